"""Slash commands: one table (`COMMANDS`) says, per command, its usage, how its argument is read, what it
does, whether it may run while an answer streams and whether it changes the stored settings.

`parse_command` turns one input line into a `Command` with a typed value, or raises `CommandError` with
the message to show inline; `run_command` applies it to the app. Lines that do not start with "/" are
prompts; "//" sends a literal "/".

An `apply` receives the app (`tui.app.ChatApp`) and the parsed value; it may be a coroutine.
"""

from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

from mlx_glimmer.chat_template import REASONING_LEVELS
from mlx_glimmer.settings import AUTO, MAX_TREE_NODES, OFF, SamplingError, SamplingParams

KEYS_HELP = (
    "keys: enter send · ctrl+j new line · ↑/↓ history · esc or ctrl+c cancel · ctrl+l clear · "
    "ctrl+o conversations · f2 stats panel · ctrl+q quit\n//text sends a message that starts with /"
)


class CommandError(ValueError):
    pass


@dataclass(frozen=True)
class Command:
    name: str
    value: Any = None


@dataclass(frozen=True)
class Spec:
    name: str
    usage: str
    help: str
    parse: Callable[[str, str], Any]  # (name, argument text) -> value; raises CommandError
    apply: Callable[[Any, Any], Any]  # (app, value) -> None, or a coroutine
    persists: bool = False  # changes the conversation's stored settings
    while_busy: bool = False  # may run while an answer streams


# ---- reading arguments ------------------------------------------------------------------------------------


def no_argument(name: str, arg: str) -> None:
    if arg:
        raise CommandError(f"/{name} takes no argument")


def optional_text(name: str, arg: str) -> str | None:
    return arg or None


def text(name: str, arg: str) -> str:
    if not arg:
        raise CommandError(f"usage: {COMMANDS[name].usage}")
    return arg


def temperature(name: str, arg: str) -> float:
    text(name, arg)
    try:
        value = float(arg)
    except ValueError:
        raise CommandError(f"/{name} needs a number, got {arg!r}") from None
    try:
        SamplingParams(temperature=value)
    except SamplingError as e:
        raise CommandError(f"/{name} {e.rule}, got {arg}") from None
    return value


def block_size(name: str, arg: str) -> int | str:
    text(name, arg)
    if arg.lower() == AUTO:
        return AUTO  # chosen every round (the default)
    try:
        value = int(arg)
    except ValueError:
        raise CommandError(f"/{name} needs 'auto' or a whole number, got {arg!r}") from None
    if value < 1:
        raise CommandError(f"/{name} must be >= 1, got {value}")
    return value


def tree(name: str, arg: str) -> int | str:
    text(name, arg)
    if arg.lower() in (AUTO, OFF):
        return arg.lower()
    try:
        value = int(arg)
    except ValueError:
        raise CommandError(f"/{name} needs 'auto', 'off' or a whole number, got {arg!r}") from None
    if not 1 <= value <= MAX_TREE_NODES:
        raise CommandError(f"/{name} must be in [1, {MAX_TREE_NODES}], got {value}")
    return value


def on_off(name: str, arg: str) -> bool:
    if text(name, arg).lower() not in ("on", "off"):
        raise CommandError(f"usage: {COMMANDS[name].usage}, got {arg!r}")
    return arg.lower() == "on"


def reasoning_level(name: str, arg: str) -> str:
    if text(name, arg).lower() not in REASONING_LEVELS:
        raise CommandError(f"/{name} takes one of {', '.join(REASONING_LEVELS)}, got {arg!r}")
    return arg.lower()


# ---- what they do ---------------------------------------------------------------------------------------------


def show_help(app, _) -> None:
    app.note(f"{help_text()}\n\n{KEYS_HELP}", "info")


async def clear(app, _) -> None:
    await app.action_clear()


def show_chats(app, _) -> None:
    app.action_conversations()


def rename(app, title: str) -> None:
    if app.store is None:
        raise CommandError("no history (started with --no-history, or the database failed)")
    if app.conversation_id is None:
        raise CommandError("this conversation is not saved yet; send a message first")
    title = title.strip()
    if app.history(lambda store, cid=app.conversation_id: store.rename(cid, title)):  # queued: bind the id now
        app.conversation_title = title
        app.note(f"Renamed to “{title}”.", "info")


def export(app, path: str) -> None:
    from .transcript import export_conversation

    turns = app.conversation.turns
    try:
        out = export_conversation(
            path, turns, model=app.model_name(), settings=app.settings, title=app.conversation_title
        )
    except (OSError, ValueError) as e:
        raise CommandError(f"/export failed: {e}") from None
    app.note(f"Exported {len(turns)} turns to {out}.", "info")


def save(app, path: str) -> None:
    from .transcript import save_transcript

    try:
        md, js = save_transcript(path, app.conversation.turns, model=app.model_name(), settings=app.settings)
    except (OSError, ValueError) as e:
        raise CommandError(f"/save failed: {e}") from None
    app.note(f"Saved {md} and {js}.", "info")


def show_stats(app, _) -> None:
    app.note(app.stats_text(), "info")


def set_system(app, value: str | None) -> None:
    app.update_settings(system=value)
    app.note(f"System prompt set: {value}" if value else "System prompt removed.", "info")


def set_temperature(app, value: float) -> None:
    app.update_settings(temperature=value)
    app.note(f"Temperature {value:g}" + (" (greedy)." if value == 0 else "."), "info")


def has_no_drafter(app) -> bool:
    return app.pair is not None and app.pair.drafter is None


def update_width_setting(app, name: str, value: int | str, other: str, other_label: str) -> str:
    """Set `name` (block_size or tree); a fixed one puts the other, if fixed, back to auto. Returns the sentence
    that says so, or ""."""
    before = getattr(app.settings.generation, other)
    app.update_settings(**{name: value})
    if before == getattr(app.settings.generation, other):
        return ""
    return f" {other_label} back to auto (a tree of N nodes sets the width itself)."


def set_block_size(app, value: int | str) -> None:
    if has_no_drafter(app):
        raise CommandError("this model has no drafter; the block size does not apply")
    back = update_width_setting(app, "block_size", value, "tree", "Draft trees")
    app.note(f"Block size {value}.{back}", "info")


CHAIN_DRAFTERS = ("draft-model", "prompt-lookup")  # drafters that propose chains only (no per-position scores)


def set_tree(app, value: int | str) -> None:
    if has_no_drafter(app):
        raise CommandError("this model has no drafter; draft trees do not apply")
    back = update_width_setting(app, "tree", value, "block_size", "Block size")
    what = {AUTO: "auto (a chain or a tree, per round)", OFF: "off (chains only)"}.get(value, f"{value} nodes")
    chains = app.pair is not None and app.pair.drafter.kind in CHAIN_DRAFTERS
    note = (
        f" (a {app.pair.drafter.kind} drafter verifies chains; trees need DFlash, DFlash2 or DSpark)" if chains else ""
    )
    app.note(f"Draft trees {what}.{note}{back}", "info")


def set_speculative(app, value: bool) -> None:
    if value and has_no_drafter(app):
        raise CommandError("this model has no drafter; speculative decoding needs one")
    app.update_settings(speculative=value)
    app.note(f"Speculative decoding {'on' if value else 'off'}.", "info")


def set_reasoning(app, value: str) -> None:
    if not app.conversation.reasoning_supported:
        raise CommandError("this model's chat template has no reasoning strength")
    app.update_settings(reasoning=value)
    app.show_reasoning_level()
    app.note(f"Reasoning strength {value}.", "info")


COMMANDS: dict[str, Spec] = {
    s.name: s
    for s in (
        Spec("clear", "/clear", "start a new conversation (the current one stays saved)", no_argument, clear),
        Spec(
            "chats",
            "/chats",
            "the saved conversations: open, rename, delete, new (also ctrl+o)",
            no_argument,
            show_chats,
        ),
        Spec("rename", "/rename TITLE", "rename this conversation", text, rename),
        Spec(
            "export",
            "/export FILE",
            "write this conversation as Markdown (.md) or JSON with token ids (.json)",
            text,
            export,
        ),
        Spec(
            "system",
            "/system TEXT",
            "set the system prompt (no TEXT: remove it)",
            optional_text,
            set_system,
            persists=True,
        ),
        Spec("temp", "/temp X", "sampling temperature, 0 = greedy", temperature, set_temperature, persists=True),
        Spec(
            "block",
            "/block auto|N",
            "verify width incl. the anchor: auto (per round, the default) or N >= 1",
            block_size,
            set_block_size,
            persists=True,
        ),
        Spec(
            "tree",
            "/tree auto|off|N",
            f"draft trees: auto (per round, the default), off (chains only) or N nodes (1 to {MAX_TREE_NODES})",
            tree,
            set_tree,
            persists=True,
        ),
        Spec(
            "spec",
            "/spec on|off",
            "speculative decoding on or off (off = the target alone)",
            on_off,
            set_speculative,
            persists=True,
        ),
        Spec(
            "reasoning",
            "/reasoning LEVEL",
            "reasoning strength: " + ", ".join(REASONING_LEVELS),
            reasoning_level,
            set_reasoning,
            persists=True,
        ),
        Spec("save", "/save FILE", "write the transcript (Markdown) and its stats (JSON beside it)", text, save),
        Spec(
            "stats",
            "/stats",
            "show the statistics of the last answer and the session",
            no_argument,
            show_stats,
            while_busy=True,
        ),
        Spec("help", "/help", "this list", no_argument, show_help, while_busy=True),
    )
}


def prompt_text(line: str) -> str:
    """The prompt a non-command line sends ("//x" sends "/x")."""
    return line[1:] if line.startswith("//") else line


def is_command(line: str) -> bool:
    return line.startswith("/") and not line.startswith("//")


def parse_command(line: str) -> Command:
    name, _, arg = line.strip()[1:].partition(" ")
    name = name.lower()
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f"; did you mean /{close[0]}?" if close else "; /help lists the commands"
        raise CommandError(f"unknown command /{name}{hint}")
    return Command(name, COMMANDS[name].parse(name, arg.strip()))


async def run_command(app, line: str) -> Spec:
    """Parse `line` and apply it to `app`; returns the command's `Spec`. Raises `CommandError`."""
    cmd = parse_command(line)
    spec = COMMANDS[cmd.name]
    if app.busy and not spec.while_busy:
        raise CommandError(f"/{cmd.name} has to wait until the answer is done (esc cancels it)")
    result = spec.apply(app, cmd.value)
    if inspect.isawaitable(result):
        await result
    return spec


def help_text() -> str:
    width = max(len(s.usage) for s in COMMANDS.values())
    return "\n".join(f"{s.usage.ljust(width)}  {s.help}" for s in COMMANDS.values())
