"""Chat history survives a transient lock.

Another program holding chats.db locked (an `sqlite3` shell inside a transaction, a backup) must not
cost a turn: the chat goes on without waiting, finished turns wait in the save queue, in order, and
reach the database once it is free (on a timer, with the next turn, or on exit). Only a database that
cannot be used at all turns history off, and says so once.
"""

from __future__ import annotations

import asyncio
import functools
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from test_store import a_turn
from test_tui import SIZE, idle, look, pair, say  # noqa: F401  (pair: a fixture)

from mlx_glimmer.tui import chat_history as chat_history_module
from mlx_glimmer.tui import save_queue as save_queue_module
from mlx_glimmer.tui.app import ChatApp
from mlx_glimmer.tui.save_queue import ATTEMPT_S, FIRST_RETRY_S, RETRY_CAP_S, WAIT_NOW_S, ChatRef, SaveQueue
from mlx_glimmer.tui.session import Settings
from mlx_glimmer.tui.store import SCHEMA_VERSION, Store

# Once the lock is gone, the next attempt starts within the backoff cap and takes at most one busy timeout.
CATCH_UP_S = RETRY_CAP_S + ATTEMPT_S + 2.0
# Added to a wait for what the save queue does on its own: a busy machine may run its thread late, and a wait
# that ends only turns a queue that never gets there into a failure.
WATCHDOG_S = 60.0


def hold_lock(path) -> sqlite3.Connection:
    """Another connection takes the write lock, as an `sqlite3` shell after BEGIN EXCLUSIVE would."""
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN EXCLUSIVE")
    return other


def wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def queued_turn(chat: ChatRef, i: int):
    """A write as the app queues it: the first one makes the conversation row."""

    def save(store: Store) -> None:
        if chat.id is None:
            chat.id = store.create("c", Settings())
        store.add_turn(chat.id, a_turn(i), processed=[i], settings=Settings())

    return save


def users(store: Store, cid: int | None) -> list[str]:
    return [t.user for t in store.load(cid).turns] if cid is not None else []


# --- the queue ---------------------------------------------------------------------------------------


def test_queued_writes_wait_out_a_lock_without_blocking_and_land_in_order(tmp_path):
    path = tmp_path / "chats.db"
    reader = Store(path)
    changes = []
    saves = SaveQueue(path, lambda: changes.append((saves.delayed is not None, saves.failed)))
    chat = ChatRef()
    assert saves.submit(queued_turn(chat, 0), turn=True) and users(reader, chat.id) == ["question 0"]  # free: on disk

    other = hold_lock(path)
    for i in (1, 2, 3):  # each returns while the lock is held: none waits for it
        assert saves.submit(queued_turn(chat, i), turn=True)
    assert wait_until(lambda: saves.delayed is not None, WATCHDOG_S) and "locked" in saves.delayed
    time.sleep(2 * ATTEMPT_S)  # several attempts fail while it lasts
    assert saves.unsaved_turns == 3 and users(reader, chat.id) == ["question 0"]
    other.execute("ROLLBACK")

    assert wait_until(lambda: saves.pending == 0, CATCH_UP_S + WATCHDOG_S)  # on the timer: nothing new submitted
    assert users(reader, chat.id) == [f"question {i}" for i in range(4)]
    assert saves.delayed is None and changes == [(True, None), (False, None)]
    assert saves.close() == 0
    reader.close()


def test_a_database_that_cannot_be_used_fails_once_and_drops_the_queue(tmp_path):
    path = tmp_path / "chats.db"
    Store(path).close()
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")  # a newer version took the file over
    db.commit()
    db.close()
    changes = []
    saves = SaveQueue(path, lambda: changes.append(saves.failed))
    assert not saves.submit(queued_turn(ChatRef(), 0), turn=True)
    assert "newer mlx-glimmer" in saves.failed and saves.delayed is None
    assert not saves.submit(queued_turn(ChatRef(), 1), turn=True)  # not retried, not queued
    assert len(changes) == 1 and saves.pending == 0 and saves.close() == 0


def test_close_flushes_the_queue_once_the_lock_is_gone_and_counts_what_it_could_not(tmp_path):
    path = tmp_path / "chats.db"
    reader = Store(path)
    saves, chat = SaveQueue(path), ChatRef()
    other = hold_lock(path)
    for i in range(2):
        saves.submit(queued_turn(chat, i), turn=True)
    threading.Timer(1.0, lambda: other.execute("ROLLBACK")).start()
    assert saves.close(timeout=WATCHDOG_S) == 0  # the lock went away while it waited
    assert users(reader, chat.id) == ["question 0", "question 1"]

    saves, chat = SaveQueue(path), ChatRef()
    other = hold_lock(path)
    saves.submit(queued_turn(chat, 0), turn=True)
    tic = time.monotonic()
    assert saves.close(timeout=0.5) == 1  # the lock outlasted the wait: one turn unsaved, and it says so
    assert time.monotonic() - tic < WATCHDOG_S  # it gave up: the lock, still held, would keep a waiter forever
    other.execute("ROLLBACK")
    reader.close()


# --- a live chat ----------------------------------------------------------------------------------------

# Holds the lock until it reads a line: however slow the machine, the lock lasts until the test lets it go.
LOCKER = textwrap.dedent(
    """
    import sqlite3, sys
    db = sqlite3.connect(sys.argv[1], isolation_level=None)
    db.execute("BEGIN EXCLUSIVE")
    print("locked", flush=True)
    sys.stdin.readline()
    db.execute("ROLLBACK")
    """
)


def run_chat(app, scenario):
    async def run():
        async with app.run_test(size=SIZE) as pilot:
            await idle(app, pilot)
            await scenario(app, pilot)

    asyncio.run(run())


async def until(pilot, condition, timeout: float) -> bool:
    """Wait for `condition()` while the app keeps running."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        await pilot.pause(0.05)
    return True


def faster_clock(monkeypatch, clock: float) -> tuple[float, float]:
    """The save queue's lock timings (busy timeout, first retry, retry cap) times `clock`; returns the
    (attempt, catch-up) times that hold then. The UI's own wait for a free database stays as it is."""
    if clock == 1.0:
        return ATTEMPT_S, CATCH_UP_S
    monkeypatch.setattr(save_queue_module, "FIRST_RETRY_S", FIRST_RETRY_S * clock)
    monkeypatch.setattr(save_queue_module, "RETRY_CAP_S", RETRY_CAP_S * clock)
    monkeypatch.setattr(chat_history_module, "SaveQueue", functools.partial(SaveQueue, attempt_s=ATTEMPT_S * clock))
    return ATTEMPT_S * clock, (RETRY_CAP_S + ATTEMPT_S) * clock + 2.0


# A lock held 25 s past the turn it delays; the same test with 3 s runs the same logic (every attempt the
# store makes waits at most ATTEMPT_S, so several of them fail while it lasts). The 25 s case runs on a
# clock 4x faster: a 6.25 s lock against the store's lock timings divided by 4, so the save queue goes
# through the same attempts as in 25 s (the backoff up to its cap, then ~8 attempts at the cap).
@pytest.mark.parametrize(
    "lock_s, clock", [pytest.param(3.0, 1.0, id="3.0"), pytest.param(25.0, 0.25, marks=pytest.mark.slow, id="25s")]
)
def test_a_lock_held_by_another_process_during_turn_2_loses_no_turn(pair, tmp_path, capsys, monkeypatch, lock_s, clock):
    attempt_s, catch_up_s = faster_clock(monkeypatch, clock)
    lock_s *= clock
    assert lock_s > 4 * max(attempt_s, WAIT_NOW_S)
    path = tmp_path / "chats.db"
    store = Store(path)
    app = ChatApp(lambda: pair, Settings.of(max_tokens=24, block_size=4), source="the tiny pair", store=store)
    assert app.chat_history.saves.attempt_s == attempt_s
    seen = {}

    async def scenario(app, pilot):
        await say(app, pilot, "Turn one")
        cid = app.conversation_id
        assert users(store, cid) == ["Turn one"]

        locker = subprocess.Popen(
            [sys.executable, "-c", LOCKER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert locker.stdout.readline().strip() == "locked"
        await say(app, pilot, "Turn two")  # answered while the file is locked: the chat does not wait
        assert await until(pilot, lambda: "saving delayed (database busy)" in look(app).status, WATCHDOG_S)
        await pilot.pause(lock_s)  # several attempts fail while it lasts
        assert users(store, cid) == ["Turn one"] and app.chat_history.saves.unsaved_turns == 1
        seen["during"] = look(app)

        locker.communicate("\n", timeout=WATCHDOG_S)  # the lock ends
        turns = ["Turn one", "Turn two"]
        assert await until(pilot, lambda: users(store, cid) == turns, catch_up_s + WATCHDOG_S)  # on the timer
        await pilot.pause()
        await say(app, pilot, "Turn three")
        seen["after"] = look(app)

    run_chat(app, scenario)
    assert app.shut_down(30)
    assert capsys.readouterr().err == ""  # nothing left unsaved
    during, after = seen["during"], seen["after"]
    assert not during.errors and not after.errors  # never "history off"
    assert sum(i.startswith("saving delayed: ") and "locked" in i for i in after.info) == 1
    assert "History caught up: every queued turn is saved." in after.info
    assert "saving delayed" not in after.status

    reopened = Store(path)
    (stored,) = [reopened.load(c.id) for c in reopened.list()]
    assert [t.user for t in stored.turns] == ["Turn one", "Turn two", "Turn three"]
    assert [t.token_ids for t in stored.turns] == [t.token_ids for t in app.conversation.turns]
    assert stored.processed == app.chat_history.processed  # the cache after the last turn
    reopened.close()
    store.close()


def test_a_database_that_cannot_be_used_mid_chat_turns_history_off_once(pair, tmp_path):
    path = tmp_path / "chats.db"
    store = Store(path)
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")  # a newer version migrated it while we ran
    db.commit()
    db.close()
    app = ChatApp(lambda: pair, Settings.of(max_tokens=24, block_size=4), source="the tiny pair", store=store)
    seen = {}

    async def scenario(app, pilot):
        await say(app, pilot, "Hello")
        await pilot.pause()
        await say(app, pilot, "Again")
        seen["view"] = look(app)

    run_chat(app, scenario)
    view = seen["view"]
    (error,) = view.errors
    assert error.startswith("history off: ") and "newer mlx-glimmer" in error and "\n" not in error
    assert not any(i.startswith("saving delayed") for i in view.info)
    assert len(app.conversation.turns) == 2 and app.store is None and app.chat_history.saves is None
    assert app.shut_down(30)
