"""A saved conversation with damaged fields still opens: at once, without a traceback, the damaged part marked
unavailable, the rest as saved, and the file left as it was.

Every column `chat --resume` and `chat --list` read is damaged in the ways a row can be (another program, a
failing disk, a hand edit): bytes that are not UTF-8 (stored as a blob, and as text, which sqlite3 cannot even
return), JSON that is not JSON, JSON of the wrong type, figures and sizes no run produces, nesting 100,000
levels deep, blobs cut short.
"""

from __future__ import annotations

import asyncio
import copy
import json
import sqlite3
import time

import pytest

from mlx_glimmer import GenerationStats
from mlx_glimmer.cli import main
from mlx_glimmer.errors import GlimmerError
from mlx_glimmer.tui.app import ChatApp
from mlx_glimmer.tui.screens.chat import ChatScreen
from mlx_glimmer.tui.session import Settings, Turn
from mlx_glimmer.tui.stats import histogram, last_stats, session_report, stats_rows, turn_summary
from mlx_glimmer.tui.store import Store, format_list, resolve
from mlx_glimmer.tui.stored_fields import MAX_IDS, MAX_JSON_BYTES, WIDEST_VERIFY, json_object, stats

SETTINGS = Settings.of(temperature=0.5, block_size=4, system="Be brief.")
# The most opening a conversation may take, damaged or not: a damaged field once made it take a minute, and it
# takes a small fraction of a second now, so the bound holds on a CPU shared with other jobs and still fails that.
OPEN_S = 5.0
DEEP = "[" * 100_000 + "]" * 100_000


def a_turn(i: int) -> Turn:
    figures = GenerationStats(
        prompt_tokens=10 + i,
        generated_tokens=3,
        target_forwards=2,
        acceptance_lengths=[2, 1],
        verify_widths=[4, 4],
        finish_reason="stop",
        drafter_kind="dflash",
        block_size=4,
    )
    return Turn(f"question {i}", f"answer {i}", [i, i + 1, 70000 + i], figures)


@pytest.fixture
def saved(tmp_path):
    """A conversation of two turns in a closed database: (its path, its id, what it loads as undamaged)."""
    path = tmp_path / "chats.db"
    store = Store(path)
    cid = store.create("A saved chat", SETTINGS, bundle="/b/target", model="tiny")
    for i in range(2):
        store.add_turn(cid, a_turn(i), processed=[1, 2, 3 + i], settings=SETTINGS, bundle="/b/target", model="tiny")
    undamaged = store.load(cid)
    store.close()
    return path, cid, undamaged


def damage(path, sql: str, *params) -> None:
    """Change a row behind the store's back, as another program would."""
    db = sqlite3.connect(path)
    db.execute(sql, params)
    db.commit()
    db.close()


def contents(path) -> tuple[bytes, list]:
    """The file's bytes and every row, as stored."""
    db = sqlite3.connect(path)
    db.text_factory = bytes
    rows = [db.execute(f"SELECT * FROM {table} ORDER BY id").fetchall() for table in ("conversations", "turns")]
    db.close()
    return path.read_bytes(), rows


def opened(path, cid):
    """What `chat --resume ID`, `chat --resume last` and `chat --list` read, and what the stats panel and the
    answers' summaries are built from: (the conversation, the list table, seconds it all took)."""
    tic = time.perf_counter()
    store = Store(path)
    try:
        stored = store.load(cid)
        table = format_list(store.list())
        assert resolve(store, "last") == resolve(store, str(cid)) == cid
    finally:
        store.close()
    last = last_stats(stored.turns)
    stats_rows(last), session_report(stored.turns), histogram(last.acceptance_lengths if last else [])
    [turn_summary(t.stats) for t in stored.turns if t.stats is not None]
    return stored, table, time.perf_counter() - tic


def opens_as(path, cid, expected):
    """The conversation opens at once as `expected`, and the file is not written."""
    before = contents(path)
    stored, table, seconds = opened(path, cid)
    assert stored == expected and stored.unreadable == expected.unreadable
    assert seconds < OPEN_S
    assert contents(path) == before
    return table


# --- per field, per kind of damage ----------------------------------------------------------------


NOT_UTF8 = b'{"finish_reason": "stop\xff"}'
STATS_DAMAGE = {
    "not UTF-8, as a blob": ("?", NOT_UTF8),
    "not UTF-8, as text": ("CAST(? AS TEXT)", NOT_UTF8),
    "cut short inside a character": ("?", '{"drafter_kind": "dflash-é"}'.encode()[:-3]),
    "not JSON (NaN)": ("?", '{"draft_s": NaN}'),
    "a count of the wrong type": ("?", '{"generated_tokens": true}'),
    "a round committing a million tokens": ("?", '{"acceptance_lengths": [1, 1000000]}'),
    "a round one wider than the widest verify": ("?", json.dumps({"verify_widths": [WIDEST_VERIFY + 1]})),
    "a number past Python's digit limit": ("?", '{"prompt_tokens": ' + "9" * 5000 + "}"),
    "a count no float holds": ("?", '{"tokens_verified": ' + "9" * 400 + ', "target_forwards": 1}'),
    "nested 100,000 levels deep": ("?", '{"accepted_from": ' + DEEP + "}"),
    "past the size bound": ("?", '{"acceptance_lengths": [' + "1," * (MAX_JSON_BYTES // 2) + "1]}"),
    "a name a megabyte long": ("?", json.dumps({"drafter_kind": "x" * 1_000_000})),
}


@pytest.mark.parametrize("value, param", STATS_DAMAGE.values(), ids=STATS_DAMAGE.keys())
def test_a_turns_stats_that_cannot_be_used_are_shown_as_unavailable(saved, value, param):
    path, cid, undamaged = saved
    damage(path, f"UPDATE turns SET stats = {value} WHERE position = 1", param)
    expected = copy.deepcopy(undamaged)
    expected.turns[1].stats = None  # its answer says "stats unavailable"; the panel shows the turn before
    opens_as(path, cid, expected)


IDS_DAMAGE = {
    "cut short": ("?", b"\x01\x00\x00\x00\x02\x00"),
    "not UTF-8, as text": ("CAST(? AS TEXT)", b"\xff\xfe\xfd\xfc\xfb"),
    "one id past the size bound": ("zeroblob(?)", 4 * (MAX_IDS + 1)),
}


@pytest.mark.parametrize("value, param", IDS_DAMAGE.values(), ids=IDS_DAMAGE.keys())
def test_a_turns_token_ids_that_cannot_be_used_are_dropped(saved, value, param):
    path, cid, undamaged = saved
    damage(path, f"UPDATE turns SET token_ids = {value} WHERE position = 0", param)
    expected = copy.deepcopy(undamaged)
    expected.turns[0].token_ids = []
    expected.unreadable = ["the token ids of turn 1 (an export lists none)"]
    opens_as(path, cid, expected)


@pytest.mark.parametrize("value, param", IDS_DAMAGE.values(), ids=IDS_DAMAGE.keys())
def test_cache_ids_that_cannot_be_used_are_dropped_so_the_next_turn_prefills_the_text(saved, value, param):
    path, cid, undamaged = saved
    damage(path, f"UPDATE conversations SET processed = {value}", param)
    expected = copy.deepcopy(undamaged)
    expected.processed = []  # nothing to rebuild: the next turn prefills the whole chat
    expected.unreadable = ["its cache ids (the next turn prefills the whole chat)"]
    opens_as(path, cid, expected)


SETTINGS_DAMAGE = {
    "not UTF-8, as a blob": ("?", b'{"temperature": 0.5, "system": "\xff"}'),
    "not UTF-8, as text": ("CAST(? AS TEXT)", b'{"temperature": 0.5, "system": "\xff"}'),
    "not JSON": ("?", '{"temperature": 0.5, '),
    "not JSON (Infinity)": ("?", '{"max_tokens": Infinity}'),
    "not an object": ("?", "[0.5]"),
    "a system prompt of the wrong type": ("?", '{"system": 5}'),
    "a number past Python's digit limit": ("?", '{"seed": ' + "9" * 5000 + "}"),
    "nested 100,000 levels deep": ("?", '{"system": ' + DEEP + "}"),
    "past the size bound": ("zeroblob(?)", MAX_JSON_BYTES + 1),
}


@pytest.mark.parametrize("value, param", SETTINGS_DAMAGE.values(), ids=SETTINGS_DAMAGE.keys())
def test_settings_that_cannot_be_used_give_way_to_the_defaults_and_say_so(saved, value, param):
    path, cid, undamaged = saved
    damage(path, f"UPDATE conversations SET settings = {value}", param)
    expected = copy.deepcopy(undamaged)
    expected.settings = Settings()
    expected.unreadable = ["its settings (the defaults apply)"]
    opens_as(path, cid, expected)


TEXT_COLUMNS = {
    "the title": ("conversations", "title", lambda c: c.info, "title"),
    "the bundle": ("conversations", "bundle", lambda c: c.info, "bundle"),
    "the model": ("conversations", "model", lambda c: c.info, "model"),
    "a question": ("turns", "user", lambda c: c.turns[0], "user"),
    "an answer": ("turns", "text", lambda c: c.turns[0], "text"),
}


@pytest.mark.parametrize("kind", ["as text", "as a blob"])
@pytest.mark.parametrize("table, column, part, name", TEXT_COLUMNS.values(), ids=TEXT_COLUMNS.keys())
def test_text_that_is_not_utf8_shows_what_it_can(saved, table, column, part, name, kind):
    path, cid, undamaged = saved
    value = "CAST(? AS TEXT)" if kind == "as text" else "?"
    damage(path, f"UPDATE {table} SET {column} = {value} WHERE id = 1", b"caf\xc3 \xff!")
    expected = copy.deepcopy(undamaged)
    setattr(part(expected), name, "caf\ufffd \ufffd!")
    listed = opens_as(path, cid, expected)
    assert len(listed.splitlines()) == 2


@pytest.mark.parametrize("when", ["'yesterday'", "CAST(x'ff' AS TEXT)", "1e300", "-1e12"])
def test_a_time_that_cannot_be_read_is_a_question_mark_in_the_list(saved, when):
    path, cid, undamaged = saved
    damage(path, f"UPDATE conversations SET updated = {when}, created = {when}")
    expected = copy.deepcopy(undamaged)
    expected.info.created = expected.info.updated = None
    table = opens_as(path, cid, expected)
    assert table.splitlines()[1].split()[:4] == [str(cid), "?", "2", "tiny"]


def test_a_cancelled_mark_that_cannot_be_read_is_not_set(saved):
    path, cid, undamaged = saved
    damage(path, "UPDATE turns SET cancelled = CAST(x'ff' AS TEXT)")
    opens_as(path, cid, undamaged)


def test_every_field_damaged_at_once_still_opens(saved):
    path, cid, undamaged = saved
    damage(path, "UPDATE turns SET stats = ?, token_ids = x'0102', user = CAST(x'ff' AS TEXT)", NOT_UTF8)
    damage(path, "UPDATE conversations SET settings = ?, processed = x'01', title = x'ff', updated = 'x'", DEEP)
    stored, table, seconds = opened(path, cid)
    assert [t.text for t in stored.turns] == ["answer 0", "answer 1"]
    assert [(t.user, t.token_ids, t.stats) for t in stored.turns] == [("\ufffd", [], None)] * 2
    assert (stored.settings, stored.processed, stored.info.title) == (Settings(), [], "\ufffd")
    assert len(stored.unreadable) == 4 and seconds < OPEN_S


# --- the readers' bounds ---------------------------------------------------------------------------


def test_stats_as_saved_come_back_whole_from_bytes_or_text():
    figures = a_turn(0).stats
    figures.accepted_from, figures.accepted_depths = {"model": 1, "lookup": 1}, [1, 0]
    figures.acceptance_lengths = [WIDEST_VERIFY, 1]
    saved = json.dumps(figures.to_dict())
    assert stats(saved) == stats(saved.encode()) == figures
    assert stats(None) is None and stats(b"") is None


def test_json_is_refused_before_it_is_parsed_when_too_big_or_too_deep():
    shallow = {"a": [[[1]]], "b": "[{" * 100}  # brackets inside strings are text
    assert json_object(json.dumps(shallow)) == shallow
    assert json_object(DEEP) is None
    assert json_object(b" " * MAX_JSON_BYTES + b"{}") is None
    tic = time.perf_counter()
    assert json_object('"\\' * (MAX_JSON_BYTES // 2)) is None  # a string never closed: one pass, not one per quote
    assert time.perf_counter() - tic < OPEN_S


# --- the command line and the app -----------------------------------------------------------------


@pytest.fixture
def started(monkeypatch, tmp_path):
    """`chat` on the command line, with its history in `tmp_path`; the apps it would run, not run."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    apps = []
    monkeypatch.setattr(ChatApp, "run", lambda app: apps.append(app))
    return apps


@pytest.mark.parametrize("args", [["--list"], ["--resume", "last"], ["--resume", "1"]])
def test_list_and_resume_on_the_command_line_take_a_damaged_conversation(started, tmp_path, capsys, args):
    path = tmp_path / "data" / "mlx-glimmer" / "chats.db"
    path.parent.mkdir(parents=True)
    store = Store(path)
    cid = store.create("A saved chat", SETTINGS)
    store.add_turn(cid, a_turn(0), processed=[1, 2], settings=SETTINGS)
    store.close()
    damage(path, "UPDATE turns SET stats = ?, token_ids = x'010203'", '{"acceptance_lengths": [1, 1000000]}')
    damage(path, "UPDATE conversations SET settings = ?, title = CAST(? AS TEXT), updated = 1e300", NOT_UTF8, b"\xff")
    before = contents(path)
    assert main(["chat", *args]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    if args == ["--list"]:
        assert out.splitlines()[1].split() == [str(cid), "?", "1", "?", "\ufffd"]
    else:
        assert started[0].resume == cid
    assert contents(path) == before


def test_the_app_resumes_a_conversation_with_a_million_token_round_at_once(saved, monkeypatch):
    path, cid, undamaged = saved
    damage(path, "UPDATE turns SET stats = ? WHERE position = 1", '{"acceptance_lengths": [1, 1000000]}')
    damage(path, "UPDATE conversations SET settings = ?", NOT_UTF8)
    before = contents(path)
    took = []
    original = ChatScreen.open_conversation

    async def timed(screen, conversation_id):
        tic = time.perf_counter()
        ok = await original(screen, conversation_id)
        took.append(time.perf_counter() - tic)
        return ok

    monkeypatch.setattr(ChatScreen, "open_conversation", timed)

    def no_model():
        raise GlimmerError("no model in this test")

    app = ChatApp(no_model, Settings.of(temperature=0.9), source="no model", store=Store(path), resume=cid)
    seen = {}

    async def run():
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause()
            seen["summaries"] = [str(s.content) for s in app.query(".summary")]
            seen["errors"] = [str(n.content) for n in app.query("Note.error")]
            seen["histogram"] = str(app.query_one("#histogram").content).splitlines()

    asyncio.run(run())
    app.shut_down(1.0)
    assert took[0] < OPEN_S
    assert seen["summaries"][0].startswith("3 tokens") and seen["summaries"][1] == "stats unavailable"
    assert seen["histogram"] == histogram(undamaged.turns[0].stats.acceptance_lengths)  # the last turn with stats
    assert seen["errors"][0] == "Could not read its settings (the defaults apply)."
    assert app.settings == Settings()  # the conversation's own could not be read
    assert [t.text for t in app.conversation.turns] == ["answer 0", "answer 1"]
    assert contents(path) == before
