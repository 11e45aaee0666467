"""Every field of the history database, read back: the one place a stored value is checked before the chat
uses it.

A row can hold anything SQLite can: bytes where text belongs, text that is not UTF-8, JSON that is not ours,
figures no run could produce, a blob cut short (another program, a failing disk, a hand edit, a newer
version). Each reader returns what the chat can use, or None for a part it cannot, and the conversation
opens with that part marked unavailable: a turn without statistics, token ids dropped (the cache is then
rebuilt from the text), the default settings, "?" for a time. Text keeps what it can: bytes that are not
UTF-8 show as U+FFFD.

Reading never raises and never writes, and it is bounded: a JSON field past `MAX_JSON_BYTES` or nested past
`MAX_JSON_DEPTH`, ids past `MAX_IDS`, a per-round figure past `WIDEST_VERIFY` are refused before anything
is built from them (the stats panel draws one histogram row per committed-tokens count up to the largest).

The store selects every column through `Store`'s SQL helpers, so text that is not UTF-8 reaches these readers
as bytes instead of failing inside sqlite3.
"""

from __future__ import annotations

import array
import dataclasses
import json
import math
import re
import sys
from datetime import datetime
from itertools import accumulate

from mlx_glimmer.generate import GenerationStats
from mlx_glimmer.settings import MAX_TREE_NODES

from .session import Settings

# The most tokens one target call verifies, so the most a round commits: a draft tree's budget plus the anchor.
# A chain verifies at most the drafter's trained block (16 for the shipped drafter); the turns of a drafter
# trained on a wider block than this would resume with their statistics unavailable.
WIDEST_VERIFY = MAX_TREE_NODES + 1
MAX_JSON_BYTES = 1 << 22  # a turn's statistics: ~10 bytes a round, so answers of 400k rounds fit
MAX_JSON_DEPTH = 64  # ours nest 2 levels (statistics: lists and counts); the server refuses requests past 64
MAX_IDS = 1 << 22  # token ids in one blob: 16 MiB, past any model's context
NAME_LENGTH = 64  # a drafter kind, a finish reason, a width policy or a draft source: one word on the panel
MAX_SOURCES = 16  # entries of `accepted_from` (the engine counts three: the drafter's model, lookup, both)

# A JSON string, or an unterminated one running to the end: every quote outside strings starts a match that
# succeeds, so stripping strings is one pass over the text.
STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"?', re.DOTALL)
NOT_BRACKET = re.compile(r"[^\[\]{}]+")
STEPS = str.maketrans("[]{}", "\x02\x00\x02\x00")  # a bracket as 1 + its step in depth


def text(value) -> str | None:
    """A text column: None stays None, bytes are decoded (what is not UTF-8 shows as U+FFFD), a number is
    written out."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def timestamp(value) -> float | None:
    """Seconds since the epoch, of a date in the calendar's years 1 to 9999; None for anything else."""
    if not number(value):
        return None
    try:
        datetime.fromtimestamp(value)
    except (OverflowError, OSError, ValueError):
        return None
    return float(value)


def flag(value) -> bool:
    """`turns.cancelled`: 1 is set; anything but a nonzero number is not."""
    return number(value) and value != 0


def ids(value) -> list[int] | None:
    """uint32 token ids, little-endian ([] for none); None when they cannot be used: not a whole number of ids
    (a blob cut short), more than `MAX_IDS`, or not a blob."""
    if value is None:
        return []
    if not isinstance(value, bytes) or len(value) % 4 or len(value) > 4 * MAX_IDS:
        return None
    a = array.array("I")
    a.frombytes(value)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()


def json_object(value) -> dict | None:
    """A stored JSON object, from bytes or text; None when there is none or it cannot be used (not UTF-8, past
    `MAX_JSON_BYTES` or `MAX_JSON_DEPTH`, not JSON, NaN or infinity, not an object)."""
    if isinstance(value, bytes):
        if len(value) > MAX_JSON_BYTES:
            return None
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            return None
    if not isinstance(value, str) or not value or len(value) > MAX_JSON_BYTES:
        return None
    if json_depth(value) > MAX_JSON_DEPTH:
        return None
    try:
        data = json.loads(value, parse_constant=refuse)
    except (ValueError, RecursionError):  # not JSON, a number past Python's digit limit, NaN or infinity
        return None
    return data if isinstance(data, dict) else None


def json_depth(text: str) -> int:
    """How deep arrays and objects nest in JSON `text`, counted without parsing it (strings left out)."""
    steps = NOT_BRACKET.sub("", STRING.sub("", text)).translate(STEPS).encode("latin-1")
    return max(accumulate(step - 1 for step in steps), default=0)


def refuse(constant: str):
    raise ValueError(f"{constant} is not JSON")


def settings(value, default: Settings | None = None) -> Settings | None:
    """Settings from their JSON; unknown keys (a newer version's) are ignored, missing ones keep `default`'s.
    None when they cannot be used: not a JSON object, or a value this version does not accept."""
    default = default or Settings()
    data = json_object(value)
    if data is None:
        return None
    names = default.flat().keys()
    changes = {k: v for k, v in data.items() if k in names}
    if not isinstance(changes.get("system", ""), (str, type(None))):
        return None
    try:
        return default.with_changes(**changes)
    except Exception:  # a value no Settings takes (hand-edited, or a newer version's)
        return None


def stats(value) -> GenerationStats | None:
    """A turn's statistics; unknown keys (a newer version's) are ignored. None when there are none or they
    cannot be used (see `usable_stat`): the turn still opens, its statistics shown as unavailable."""
    data = json_object(value)
    if data is None:
        return None
    defaults = GenerationStats()
    kept = {f.name: data[f.name] for f in dataclasses.fields(GenerationStats) if f.name in data}
    if not all(usable_stat(name, v, getattr(defaults, name)) for name, v in kept.items()):
        return None
    return GenerationStats(**kept)


def usable_stat(name: str, value, default) -> bool:
    """Whether a stored statistic can stand where `default` does: a width from 1 to `WIDEST_VERIFY`, per-round
    figures from 0 to `WIDEST_VERIFY`, rounds by source, a whole number or a finite one (>= 0), a short name."""
    if name == "block_size":
        return whole(value) and 1 <= value <= WIDEST_VERIFY
    if isinstance(default, list):
        return isinstance(value, list) and all(whole(n) and 0 <= n <= WIDEST_VERIFY for n in value)
    if isinstance(default, dict):
        return (
            isinstance(value, dict)
            and len(value) <= MAX_SOURCES
            and all(short_name(k) and whole(n) and n >= 0 for k, n in value.items())
        )
    if isinstance(default, int):
        return whole(value) and value >= 0
    if isinstance(default, float):
        return number(value) and value >= 0
    return value is None or short_name(value)


def number(value) -> bool:
    """A number a float holds (NaN, infinity and larger whole numbers are not), booleans left out."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return abs(value) <= sys.float_info.max if isinstance(value, int) else math.isfinite(value)


def whole(value) -> bool:
    return isinstance(value, int) and number(value)


def short_name(value) -> bool:
    return isinstance(value, str) and len(value) <= NAME_LENGTH
