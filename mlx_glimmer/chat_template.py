"""What a tokenizer's chat template offers: one check for all callers (API, chat, server, parity).

Muse Glimmer's template takes a reasoning strength (`reasoning_strength=`: low, medium, high or xhigh);
other families use other variables, so support is read from the template text.
"""

from __future__ import annotations

REASONING_LEVELS = ("low", "medium", "high", "xhigh")
DEFAULT_REASONING = "high"
REASONING_VARIABLE = "reasoning_strength"


def template_text(tokenizer) -> str:
    """The tokenizer's chat template(s) as one text ("" when it has none)."""
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):
        return "\n".join(map(str, t.values()))
    return t if isinstance(t, str) else ""


def has_chat_template(tokenizer) -> bool:
    return bool(template_text(tokenizer))


def supports_reasoning(tokenizer) -> bool:
    """Does the chat template take a reasoning strength?"""
    return REASONING_VARIABLE in template_text(tokenizer)


# The template variables that take a reasoning level, in the order they are looked for: Muse's own, then the
# `reasoning_effort` other families' templates read (an on/off `enable_thinking` takes no level).
LEVEL_VARIABLES = (REASONING_VARIABLE, "reasoning_effort")


def reasoning_variable(tokenizer) -> str | None:
    """The chat template's own variable for a reasoning level, or None when it has none."""
    text = template_text(tokenizer)
    return next((v for v in LEVEL_VARIABLES if v in text), None)


def reasoning_kwargs(tokenizer, level: str | None) -> dict:
    """`apply_chat_template` keywords for reasoning level `level`, under the template's own variable
    (none when unset or when the template takes no level)."""
    variable = reasoning_variable(tokenizer) if level else None
    return {variable: level} if variable else {}
