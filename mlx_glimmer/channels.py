"""Muse Glimmer's channel-framed output: one description of the format, used by the chat app and the server.

A Muse turn is a run of messages, each behind a header
(as `mlx_lm/chat_templates/muse_spark.py` describes the family's format):

    to=self<|message|>reasoning<|eom|>
    <|start|>assistant to=NAME<|message|><atem:function_calls>...<|eom|>
    <|start|>assistant to=user<|message|>answer<|eot|>

Header text is dropped. The markers need not be single tokens, so this works
on decoded text. Output without any header is all answer.

`split_channels` splits a whole (or partial) text, for the chat app;
`RESPONSE_FORMAT` is the same format as transitions for mlx-lm's streaming
`TextStateMachine` (the server's reasoning/answer/tool-call split).
"""

from __future__ import annotations

from dataclasses import dataclass, field

HEADERS = {
    "to=self<|message|>": "reasoning",
    "to=user<|message|>": "answer",
    "to=commentary<|message|>": "answer",
    "<atem:function_calls>": "tool",
}
ENDS = {
    "reasoning": {"<|eom|>": "header"},
    "answer": {"<|eom|>": "header", "<|eot|>": "answer"},
    "tool": {"<|eom|>": "header"},
}


@dataclass
class Channels:
    blocks: list[tuple[str, str]] = field(default_factory=list)  # (kind, text) in order: reasoning, answer, tool
    framed: bool = False

    @property
    def answer(self) -> str:
        return "".join(t for k, t in self.blocks if k == "answer").strip()

    @property
    def reasoning(self) -> list[str]:
        """Reasoning and tool-call blocks, in order: everything shown apart from the answer."""
        return [t.strip() for k, t in self.blocks if k != "answer" and t.strip()]


def _partial_marker(text: str, markers) -> int:
    """Length of the longest tail of `text` that could still grow into one of `markers`."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


def is_framed(text: str, final: bool = True, headers=HEADERS) -> bool:
    """Does `text` hold a header (or, with `final=False`, is it still the start of one)?"""
    if any(h in text for h in headers):
        return True
    head = text.lstrip()
    return not final and bool(head) and any(h.startswith(head) for h in headers)


def split_channels(text: str, final: bool = True) -> Channels:
    """Split decoded output; with `final=False` a marker cut off at the end is held back."""
    if not is_framed(text, final):
        return Channels([("answer", text)] if text else [], framed=False)
    blocks: list[list[str]] = []
    state, pos = "header", 0
    while True:
        markers = HEADERS if state == "header" else ENDS[state]
        hits = [(i, m) for m in markers if (i := text.find(m, pos)) >= 0]
        end = min(hits)[0] if hits else len(text)
        piece = text[pos:end]
        if not hits and not final:
            piece = piece[: len(piece) - _partial_marker(piece, markers)]
        if state != "header":
            blocks[-1][1] += piece
        if not hits:
            break
        i, marker = min(hits, key=lambda h: (h[0], -len(h[1])))
        pos = i + len(marker)
        new = markers[marker]
        if new != state and new != "header":
            blocks.append([new, ""])
        state = new
    return Channels([(k, t) for k, t in blocks], framed=True)


# The same format for mlx-lm's `TextStateMachine` (as `make_text_state_machine` reads a tokenizer's
# `response_transitions`): its states are "header", "reasoning", "normal" (the answer) and "tool".
_STATE = {"answer": "normal"}
RESPONSE_FORMAT = {
    "initial_state": "header",
    "transitions": {
        "header": [(m, _STATE.get(k, k)) for m, k in HEADERS.items()],
        **{_STATE.get(s, s): [(m, _STATE.get(k, k)) for m, k in ends.items()] for s, ends in ENDS.items()},
    },
}
CHANNEL_MARK = "<|message|>"  # what a chat template of this format writes in every message header


def is_channel_template(template: str) -> bool:
    """Does a chat template's text write Muse's channel-framed messages?"""
    return CHANNEL_MARK in template
