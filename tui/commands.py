"""Slash commands: parsing and checking, nothing else.

`parse_command` turns one input line into a `Command` with a typed value, or
raises `CommandError` with the message to show inline. Lines that do not
start with "/" are prompts; "//" sends a literal "/".
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import Any

REASONING_LEVELS = ("low", "medium", "high", "xhigh")

HELP = {
    "clear": ("/clear", "start a new conversation (the current one stays saved)"),
    "chats": ("/chats", "the saved conversations: open, rename, delete, new (also ctrl+o)"),
    "rename": ("/rename TITLE", "rename this conversation"),
    "export": ("/export FILE", "write this conversation as Markdown (.md) or JSON with token ids (.json)"),
    "system": ("/system TEXT", "set the system prompt (no TEXT: remove it)"),
    "temp": ("/temp X", "sampling temperature, 0 = greedy"),
    "block": ("/block auto|N", "verify width incl. the anchor: auto (per round, the default) or N >= 1"),
    "spec": ("/spec on|off", "speculative decoding on or off (off = the target alone)"),
    "reasoning": ("/reasoning LEVEL", "reasoning strength: " + ", ".join(REASONING_LEVELS)),
    "save": ("/save FILE", "write the transcript (Markdown) and its stats (JSON beside it)"),
    "stats": ("/stats", "show the statistics of the last answer and the session"),
    "help": ("/help", "this list"),
}


class CommandError(ValueError):
    pass


@dataclass(frozen=True)
class Command:
    name: str
    value: Any = None


def prompt_text(line: str) -> str:
    """The prompt a non-command line sends ("//x" sends "/x")."""
    return line[1:] if line.startswith("//") else line


def is_command(line: str) -> bool:
    return line.startswith("/") and not line.startswith("//")


def parse_command(line: str) -> Command:
    name, _, arg = line.strip()[1:].partition(" ")
    arg = arg.strip()
    name = name.lower()
    if name not in HELP:
        close = difflib.get_close_matches(name, HELP, n=1)
        hint = f"; did you mean /{close[0]}?" if close else "; /help lists the commands"
        raise CommandError(f"unknown command /{name}{hint}")
    usage = HELP[name][0]
    if name in ("clear", "chats", "stats", "help"):
        if arg:
            raise CommandError(f"/{name} takes no argument")
        return Command(name)
    if name == "system":
        return Command(name, arg or None)
    if not arg:
        raise CommandError(f"usage: {usage}")
    if name == "temp":
        try:
            value = float(arg)
        except ValueError:
            raise CommandError(f"/temp needs a number, got {arg!r}") from None
        if not math.isfinite(value) or value < 0:
            raise CommandError(f"/temp must be a number >= 0, got {arg}")
        return Command(name, value)
    if name == "block":
        if arg.lower() == "auto":
            return Command(name, None)  # chosen every round (the default)
        try:
            value = int(arg)
        except ValueError:
            raise CommandError(f"/block needs 'auto' or a whole number, got {arg!r}") from None
        if value < 1:
            raise CommandError(f"/block must be >= 1, got {value}")
        return Command(name, value)
    if name == "spec":
        if arg.lower() not in ("on", "off"):
            raise CommandError(f"usage: {usage}, got {arg!r}")
        return Command(name, arg.lower() == "on")
    if name == "reasoning":
        if arg.lower() not in REASONING_LEVELS:
            raise CommandError(f"/reasoning takes one of {', '.join(REASONING_LEVELS)}, got {arg!r}")
        return Command(name, arg.lower())
    return Command(name, arg)  # save, export, rename


def help_text() -> str:
    width = max(len(u) for u, _ in HELP.values())
    return "\n".join(f"{u.ljust(width)}  {d}" for u, d in HELP.values())
