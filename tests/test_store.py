"""The conversation store: what it keeps, where, and how it fails.

Faults covered: a writer killed with SIGKILL mid-answer, two processes writing
at once, a locked database, a file that is not a database, a newer schema.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mlx_glimmer import GenerationStats
from mlx_glimmer.tui.session import Settings, Turn
from mlx_glimmer.tui.store import (
    SCHEMA_VERSION,
    Store,
    StoreError,
    data_dir,
    format_list,
    open_store,
    resolve,
    settings_from_json,
    stats_from_json,
    title_for,
)


def a_turn(i: int = 0, cancelled: bool = False) -> Turn:
    stats = GenerationStats(
        prompt_tokens=10 + i,
        prefill_tokens=10,
        generated_tokens=3,
        acceptance_lengths=[2, 1],
        finish_reason="cancelled" if cancelled else "stop",
        drafter_kind="dflash",
        block_size=4,
    )
    return Turn(f"question {i}", f"answer {i}", [i, i + 1, 70000 + i], stats, cancelled)


def test_stored_settings_keep_what_is_valid_and_fall_back_on_what_is_not():
    assert settings_from_json('{"temperature": 0.5, "from_a_newer_version": 1}') == Settings.of(temperature=0.5)
    assert settings_from_json('{"temperature": -1, "system": "x"}') == Settings()  # a value no Settings takes
    assert settings_from_json("[1, 2]") == settings_from_json("not json") == Settings()


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "chats.db")
    yield s
    s.close()


# --- what is kept -----------------------------------------------------------------------------


def test_a_turn_comes_back_with_its_token_ids_settings_stats_and_cache_ids(store):
    settings = Settings.of(temperature=0.7, block_size=2, system="Be brief.", reasoning="low")
    cid = store.create("first", settings, bundle="/b/target", model="tiny")
    store.add_turn(cid, a_turn(0), processed=[1, 2, 3, 2**32 - 1], settings=settings, bundle="/b/target", model="tiny")
    store.add_turn(cid, a_turn(1, cancelled=True), processed=[1, 2, 3, 4, 5], settings=settings)

    got = store.load(cid)
    assert [t.user for t in got.turns] == ["question 0", "question 1"]
    assert got.turns[0].token_ids == [0, 1, 70000] and got.turns[0].text == "answer 0"
    assert got.turns[0].stats == a_turn(0).stats
    assert got.turns[1].cancelled and got.turns[1].stats.finish_reason == "cancelled"
    assert got.processed == [1, 2, 3, 4, 5]  # the cache after the last turn
    assert got.settings == settings
    assert (got.info.title, got.info.turns, got.info.bundle, got.info.model) == ("first", 2, "/b/target", "tiny")
    row = store._db.execute("SELECT bundle, settings FROM turns WHERE position = 0").fetchone()
    assert row[0] == "/b/target" and '"temperature": 0.7' in row[1]  # every turn keeps what it ran with


def test_the_list_is_newest_first_and_rename_delete_act_on_one_conversation(store):
    ids = [store.create(f"chat {i}", Settings()) for i in range(3)]
    store.add_turn(ids[0], a_turn(), processed=[1], settings=Settings())  # now the most recent
    assert [c.id for c in store.list()] == [ids[0], ids[2], ids[1]]
    assert store.last_id() == ids[0] and resolve(store, "last") == ids[0] and resolve(store, str(ids[1])) == ids[1]
    store.rename(ids[1], "renamed")
    store.delete(ids[0])
    assert {c.id: c.title for c in store.list()} == {ids[1]: "renamed", ids[2]: "chat 2"}
    assert store._db.execute("SELECT count(*) FROM turns").fetchone()[0] == 0  # its turns went with it
    with pytest.raises(StoreError, match="no conversation 99"):
        resolve(store, "99")
    with pytest.raises(StoreError, match="conversation id or 'last'"):
        resolve(store, "what next")


def test_settings_saved_alone_are_restored(store):
    cid = store.create("c", Settings())
    store.save_settings(cid, Settings.of(temperature=0.3, speculative=False))
    assert store.load(cid).settings == Settings.of(temperature=0.3, speculative=False)


def test_titles_and_the_list_table():
    assert title_for("\n  How do I cache things?\nmore") == "How do I cache things?"
    assert len(title_for("x" * 200)) == 60 and title_for("x" * 200).endswith("…")
    assert format_list([]) == "no saved conversations"


def test_the_file_is_wal_schema_versioned_and_in_the_data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert data_dir() == tmp_path / "xdg" / "mlx-glimmer"
    s = Store()
    s.close()
    db = sqlite3.connect(tmp_path / "xdg" / "mlx-glimmer" / "chats.db")
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    monkeypatch.setenv("XDG_DATA_HOME", "relative/ignored")
    default = Path.home() / ("Library/Application Support" if sys.platform == "darwin" else ".local/share")
    assert data_dir() == default / "mlx-glimmer"


# --- faults -------------------------------------------------------------------------------------


def test_a_file_that_is_not_a_database_is_one_line_and_left_alone(tmp_path):
    path = tmp_path / "chats.db"
    path.write_bytes(b"this is not sqlite" * 100)
    store, warning = open_store(path)
    assert store is None
    assert warning.startswith("history off: ") and "not a readable database" in warning and "\n" not in warning
    assert path.read_bytes() == b"this is not sqlite" * 100  # the user's file is not touched


def test_a_turn_whose_stats_cannot_be_read_comes_back_without_them(store):
    cid = store.create("c", Settings())
    for i in range(4):
        store.add_turn(cid, a_turn(i), processed=[i], settings=Settings())
    unreadable = ['{"decode_tokens_per_second": 61.', "[1, 2]", '{"generated_tokens": "many"}']
    for position, text in enumerate(unreadable):
        store._db.execute("UPDATE turns SET stats = ? WHERE position = ?", (text, position))
    got = store.load(cid)  # the whole conversation still opens
    assert [t.stats for t in got.turns] == [None, None, None, a_turn(3).stats]
    assert [t.text for t in got.turns] == [f"answer {i}" for i in range(4)] and got.processed == [3]
    assert resolve(store, str(cid)) == cid  # `chat --resume N` finds it
    assert stats_from_json('{"generated_tokens": 3, "from_a_newer_version": 1}') == GenerationStats(generated_tokens=3)


def test_a_turns_draft_tree_figures_and_the_tree_setting_are_kept(store):
    turn = a_turn(0)
    turn.stats.tokens_verified, turn.stats.tree_rounds, turn.stats.accepted_depths = 12, 1, [1, 0]
    turn.stats.accepted_from = {"model": 1}
    cid = store.create("c", Settings())
    store.add_turn(cid, turn, processed=[0], settings=Settings.of(tree=9))
    loaded = store.load(cid)
    assert loaded.turns[0].stats == turn.stats and loaded.settings.generation.tree == 9
    assert stats_from_json('{"accepted_from": {"model": "many"}}') is None  # not counts: the stats are unreadable


def test_a_database_from_a_newer_version_is_refused(tmp_path):
    path = tmp_path / "chats.db"
    Store(path).close()
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.commit()
    db.close()
    with pytest.raises(StoreError, match="newer mlx-glimmer") as e:
        Store(path)
    assert not e.value.busy  # it does not pass: history off


def test_a_locked_database_fails_in_one_line_after_the_busy_timeout(tmp_path):
    path = tmp_path / "chats.db"
    store = Store(path, timeout=0.2)
    cid = store.create("c", Settings())
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")  # another program holds the write lock
    try:
        tic = time.monotonic()
        with pytest.raises(StoreError, match="locked") as e:
            store.add_turn(cid, a_turn(), processed=[1], settings=Settings())
        assert time.monotonic() - tic < 60 and "\n" not in str(e.value)  # the lock stays: a wait for it never ends
        assert e.value.busy  # a lock passes: the app keeps the turn queued (tests/test_history_lock.py)
        assert store.list()[0].turns == 0  # readers still read under WAL
    finally:
        other.execute("ROLLBACK")
    store.add_turn(cid, a_turn(), processed=[1], settings=Settings())  # and it recovers
    assert store.load(cid).info.turns == 1


WRITER = textwrap.dedent(
    """
    import sys
    from mlx_glimmer import GenerationStats
    from mlx_glimmer.tui.session import Settings, Turn
    from mlx_glimmer.tui.store import Store

    path, name, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    store = Store(path, timeout=30)
    cid = store.create(name, Settings())
    ids = list(range(20000))  # a long answer: the write takes a while
    for i in range(count):
        turn = Turn(f"{name} {i}", "x" * 20000, ids, GenerationStats(generated_tokens=len(ids)), False)
        store.add_turn(cid, turn, processed=ids * 2, settings=Settings())
        print(i, flush=True)
    """
)


def spawn_writer(path, name, count):
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path), name, str(count)], stdout=subprocess.PIPE, text=True
    )


def test_kill_9_of_a_writer_loses_at_most_the_answer_it_was_writing(tmp_path):
    path = tmp_path / "chats.db"
    writer = spawn_writer(path, "w", 10_000)
    saved = -1
    while saved < 5:  # a few turns committed, then kill it in the middle of whatever it is doing
        saved = int(writer.stdout.readline())
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()
    store = Store(path)
    assert store.check() == "ok"
    (info,) = store.list()
    got = store.load(info.id)
    assert len(got.turns) >= saved + 1  # every turn reported as saved is there
    assert [t.user for t in got.turns] == [f"w {i}" for i in range(len(got.turns))]
    assert all(t.token_ids == list(range(20000)) and len(t.text) == 20000 for t in got.turns)  # none half written
    assert got.processed == list(range(20000)) * 2
    store.add_turn(info.id, a_turn(), processed=[1], settings=Settings())  # and it is writable again


def test_two_processes_writing_at_once_keep_every_turn(tmp_path):
    path = tmp_path / "chats.db"
    Store(path).close()
    writers = [spawn_writer(path, name, 15) for name in ("a", "b")]
    for w in writers:
        out, _ = w.communicate(timeout=120)
        assert w.returncode == 0 and out.split()[-1] == "14"
    store = Store(path)
    assert store.check() == "ok"
    chats = {c.title: store.load(c.id) for c in store.list()}
    assert sorted(chats) == ["a", "b"]
    for name, got in chats.items():
        assert [t.user for t in got.turns] == [f"{name} {i}" for i in range(15)]
