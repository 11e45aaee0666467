"""The status line under the prompt, and the model's name in the header."""

from __future__ import annotations

from .session import Settings


def model_names(pair) -> str:
    if pair.drafter_path is None:
        return pair.name
    if pair.drafter_path.parent == pair.target_path.parent and pair.target_path.name == "target":
        return f"{pair.name} (target + drafter)"
    return f"{pair.name} + {pair.drafter_path.name}"


def status_line(
    settings: Settings,
    pair,
    *,
    reasoning_supported: bool,
    saving_delayed: bool,
    busy: bool,
    activity: str | None = None,
) -> str:
    """The model and the settings the next turn runs with, then what the app is doing (`activity`;
    by default "generating…" while `busy`, or that no model is loaded)."""
    s = settings.generation
    parts = []
    if pair is not None:
        parts += [model_names(pair), pair.target.model_type, pair.quantization]
        if pair.drafter is None:
            parts.append("no drafter")
        elif s.speculative:
            parts.append(f"{pair.drafter.kind} block {s.block_size} tree {s.tree}")
        else:
            parts.append("spec off")
        parts.append("greedy" if s.sampling.greedy else f"temp {s.sampling.temperature:g}")
        if reasoning_supported:
            parts.append(f"reasoning {settings.reasoning}")
        if settings.system:
            parts.append("system prompt set")
    if saving_delayed:
        parts.append("saving delayed (database busy)")
    if activity is None and busy:
        activity = "generating… (esc cancels)"
    elif activity is None and pair is None:
        activity = "no model loaded"
    if activity:
        parts.append(activity)
    return " · ".join(parts)
