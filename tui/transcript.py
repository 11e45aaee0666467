"""`/save FILE`: the transcript as Markdown, its statistics as JSON beside it."""

from __future__ import annotations

import json
from pathlib import Path

from .session import Settings, Turn
from .stats import turn_summary


def transcript_markdown(turns: list[Turn], *, model: str, settings: Settings) -> str:
    lines = [f"# Chat with {model}", ""]
    if settings.system:
        lines += ["## System", "", settings.system, ""]
    for t in turns:
        lines += ["## You", "", t.user, "", "## Assistant", ""]
        for block in t.reasoning:
            lines += ["<details><summary>Reasoning</summary>", "", block, "", "</details>", ""]
        lines += [t.answer or "*(no answer)*", ""]
        if t.stats is not None:
            lines += [f"*{turn_summary(t.stats)}*", ""]
    return "\n".join(lines)


def stats_record(turns: list[Turn], *, model: str, settings: Settings) -> dict:
    return {
        "model": model,
        "settings": settings.flat(),
        "turns": [
            {"user": t.user, "text": t.text, "cancelled": t.cancelled, "stats": t.stats.to_dict() if t.stats else None}
            for t in turns
        ],
    }


def save_transcript(path: str | Path, turns: list[Turn], *, model: str, settings: Settings) -> tuple[Path, Path]:
    """Write FILE (".md" added when it has no suffix) and FILE with ".json"; returns both paths."""
    md = Path(path).expanduser()
    if not md.suffix:
        md = md.with_suffix(".md")
    if md.suffix == ".json":
        raise ValueError(f"{md}: name a Markdown file; the stats go beside it as .json")
    js = md.with_suffix(".json")
    md.write_text(transcript_markdown(turns, model=model, settings=settings))
    js.write_text(json.dumps(stats_record(turns, model=model, settings=settings), indent=2) + "\n")
    return md, js


def conversation_record(turns: list[Turn], *, model: str, settings: Settings, title: str | None = None) -> dict:
    """Everything about a conversation: settings, and per turn its text, token ids and stats."""
    record = stats_record(turns, model=model, settings=settings)
    record = {"format": "mlx-glimmer-chat/1", "title": title, **record}
    for out, t in zip(record["turns"], turns):
        out["answer"] = t.answer
        out["reasoning"] = t.reasoning
        out["token_ids"] = list(t.token_ids)
    return record


def export_conversation(
    path: str | Path, turns: list[Turn], *, model: str, settings: Settings, title: str | None = None
) -> Path:
    """`/export FILE`: Markdown for .md/.markdown, JSON (with token ids and stats) for .json."""
    out = Path(path).expanduser()
    suffix = out.suffix.lower()
    if suffix in (".md", ".markdown"):
        out.write_text(transcript_markdown(turns, model=model, settings=settings))
    elif suffix == ".json":
        record = conversation_record(turns, model=model, settings=settings, title=title)
        out.write_text(json.dumps(record, indent=2) + "\n")
    else:
        raise ValueError(f"{out.name}: name a .md (Markdown) or .json file")
    return out
