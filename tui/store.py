"""Chats that last: the conversation store (SQLite, standard library only).

One file, `chats.db`, in the platform's data directory (see `data_dir`). Each
turn is written in its own transaction as soon as it completes, together with
the token ids the conversation's KV cache held afterwards (`processed`), so a
resumed chat can rebuild exactly that cache. WAL mode lets a second app read
and write while the first one runs; a process killed mid-answer loses at most
the answer it was writing.

Every failure of the database itself (locked past the busy timeout, not a
database, written by a newer version) is a `StoreError` with a one-line
message; `busy` tells a lock (it passes) from the rest (it does not).

The app writes through a `SaveQueue`, never on its UI thread, because another
program may hold the file locked for a while (an `sqlite3` shell, a backup, a
second app): giving up on the first lock turned history off and lost every
later turn. The decision, in numbers:
- a write to a free database is on disk before the app goes on (the UI waits
  for it at most WAIT_NOW_S = 0.25 s, then leaves it queued);
- one attempt waits at most ATTEMPT_S = 0.5 s for the lock; a locked database
  leaves the write queued, in memory, and it is retried after 0.2 s, 0.4 s,
  0.8 s, ... at most RETRY_CAP_S = 2 s apart, and at once when the next turn
  comes; writes keep their order, a turn never overtakes the one before;
- while writes wait the status line says "saving delayed (database busy)" (one
  note when it starts, one when the queue is written); "history off" is only
  for a database that cannot be used at all (not a database, a newer schema,
  an unwritable path, a conversation deleted under it); the conversation list's
  rename and delete still write on the UI's own connection (not queued yet);
- on exit queued writes get FLUSH_S = 5 s more; then one line on stderr says
  how many turns could not be saved, to which file, and why.
"""

from __future__ import annotations

import array
import dataclasses
import json
import os
import sqlite3
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..generate import GenerationStats
from .session import Settings, Turn

SCHEMA_VERSION = 1
DB_NAME = "chats.db"
TITLE_LENGTH = 60

SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    bundle TEXT,                -- what the chat was opened on (a path, or "the demo pair")
    model TEXT,                 -- the model's display name
    settings TEXT NOT NULL,     -- JSON of `Settings`, restored with the conversation
    processed BLOB              -- uint32 ids in the KV cache after the last turn
);
CREATE TABLE IF NOT EXISTS turns (
    id INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    position INTEGER NOT NULL,
    created REAL NOT NULL,
    user TEXT NOT NULL,
    text TEXT NOT NULL,         -- the raw decoded answer, channel framing included
    token_ids BLOB NOT NULL,    -- uint32 ids of the answer
    cancelled INTEGER NOT NULL, -- 1: stopped by the user, the text is partial
    bundle TEXT,
    settings TEXT NOT NULL,     -- JSON of the `Settings` this turn ran with
    stats TEXT,                 -- JSON of its `GenerationStats`
    UNIQUE (conversation_id, position)
);
CREATE INDEX IF NOT EXISTS turns_by_conversation ON turns (conversation_id, position);
"""


ATTEMPT_S = 0.5  # the save thread's busy timeout: how long one write attempt waits for a lock
FIRST_RETRY_S = 0.2  # after a locked attempt, wait this long, doubling each time ...
RETRY_CAP_S = 2.0  # ... up to this: a lock that ends is noticed within about 2 s
WAIT_NOW_S = 0.25  # how long `SaveQueue.submit` waits for a write when nothing is queued before it
FLUSH_S = 5.0  # on exit: how much longer queued writes may wait for the database

SQLITE_BUSY, SQLITE_LOCKED = 5, 6


class StoreError(Exception):
    """The history database cannot be used; the message is one line for the user.

    `busy`: only because another connection holds it locked, so the same write may succeed later."""

    def __init__(self, message: str, busy: bool = False):
        super().__init__(message)
        self.busy = busy


def data_dir() -> Path:
    """Where the history lives: $XDG_DATA_HOME/mlx-glimmer when XDG_DATA_HOME is set (any platform);
    otherwise ~/Library/Application Support/mlx-glimmer on macOS, ~/.local/share/mlx-glimmer elsewhere."""
    base = os.environ.get("XDG_DATA_HOME") or ""
    if os.path.isabs(base):
        return Path(base) / "mlx-glimmer"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "mlx-glimmer"
    return Path.home() / ".local" / "share" / "mlx-glimmer"


def default_path() -> Path:
    return data_dir() / DB_NAME


@dataclass
class ConversationInfo:
    """One row of the conversation list."""

    id: int
    title: str
    created: float
    updated: float
    turns: int
    bundle: str | None
    model: str | None


@dataclass
class StoredConversation:
    info: ConversationInfo
    settings: Settings
    turns: list[Turn]
    processed: list[int]  # token ids the cache held after the last turn


def pack_ids(ids) -> bytes:
    a = array.array("I", ids)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def unpack_ids(blob: bytes | None) -> list[int]:
    a = array.array("I")
    a.frombytes(blob or b"")
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()


def settings_json(settings: Settings) -> str:
    return json.dumps(dataclasses.asdict(settings))


def settings_from_json(text: str | None, default: Settings | None = None) -> Settings:
    """Settings from JSON; unknown keys (a newer version's) are ignored, missing ones keep `default`'s."""
    base = dataclasses.asdict(default or Settings())
    try:
        data = json.loads(text or "{}")
    except json.JSONDecodeError:
        data = {}
    names = {f.name for f in dataclasses.fields(Settings)}
    if not isinstance(data, dict):
        data = {}
    try:
        return Settings(**{**base, **{k: v for k, v in data.items() if k in names}})
    except Exception:  # a value this version does not accept (hand-edited, or a newer version's): keep the defaults
        return Settings(**base)


def stats_from_json(text: str | None) -> GenerationStats | None:
    if not text:
        return None
    data = json.loads(text)
    names = {f.name for f in dataclasses.fields(GenerationStats)}
    return GenerationStats(**{k: v for k, v in data.items() if k in names})


def title_for(user: str) -> str:
    line = next((s.strip() for s in user.splitlines() if s.strip()), "") or "(empty)"
    return line if len(line) <= TITLE_LENGTH else line[: TITLE_LENGTH - 1] + "…"


def is_busy(e: sqlite3.Error) -> bool:
    """A lock held by another connection (SQLITE_BUSY or SQLITE_LOCKED, extended codes included)."""
    code = getattr(e, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (SQLITE_BUSY, SQLITE_LOCKED)
    return "locked" in str(e) or "busy" in str(e)


def describe(e: sqlite3.Error, path: Path) -> str:
    text = str(e)
    if "locked" in text or "busy" in text:
        return f"{path} is locked by another program ({text})"
    if isinstance(e, sqlite3.DatabaseError) and ("not a database" in text or "malformed" in text):
        return f"{path} is not a readable database ({text}); move it away to start a new one"
    return f"{path}: {text}"


class Store:
    """The conversation store. Every method raises `StoreError` (one line) when the database fails."""

    def __init__(self, path: str | Path | None = None, *, timeout: float = 5.0):
        self.path = Path(path) if path is not None else default_path()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"cannot create {self.path.parent}: {e.strerror or e}") from None
        self._db: sqlite3.Connection | None = None
        try:
            # Autocommit mode: each write below runs in its own explicit transaction.
            self._db = sqlite3.connect(self.path, timeout=timeout, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA foreign_keys = ON")
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"{self.path} was written by a newer mlx-glimmer (schema {version}, this one reads {SCHEMA_VERSION})"
                )
            if self._db.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                self._db.execute("PRAGMA journal_mode = WAL")
            # In WAL mode NORMAL survives a crashed process; only power loss can drop the last commit.
            self._db.execute("PRAGMA synchronous = NORMAL")
            if version < SCHEMA_VERSION:
                with self._transaction():
                    for statement in SCHEMA.split(";"):
                        if statement.strip():
                            self._db.execute(statement)
                    self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            self._db.execute("SELECT count(*) FROM conversations").fetchone()
        except sqlite3.Error as e:
            self.close()
            raise StoreError(describe(e, self.path), busy=is_busy(e)) from None
        except StoreError:
            self.close()
            raise

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    # --- plumbing -------------------------------------------------------------------

    class _Tx:
        def __init__(self, db: sqlite3.Connection):
            self.db = db

        def __enter__(self):
            self.db.execute("BEGIN IMMEDIATE")
            return self.db

        def __exit__(self, kind, value, tb):
            self.db.execute("COMMIT" if kind is None else "ROLLBACK")
            return False

    def _transaction(self) -> "Store._Tx":
        return Store._Tx(self._db)

    def _run(self, fn):
        if self._db is None:
            raise StoreError(f"{self.path}: closed")
        try:
            return fn(self._db)
        except sqlite3.Error as e:
            if self._db.in_transaction:
                try:
                    self._db.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
            raise StoreError(describe(e, self.path), busy=is_busy(e)) from None

    # --- conversations ----------------------------------------------------------------

    def create(self, title: str, settings: Settings, *, bundle: str | None = None, model: str | None = None) -> int:
        def go(db):
            now = time.time()
            with self._transaction():
                cur = db.execute(
                    "INSERT INTO conversations (title, created, updated, bundle, model, settings, processed) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (title, now, now, bundle, model, settings_json(settings), b""),
                )
            return cur.lastrowid

        return self._run(go)

    def list(self) -> list[ConversationInfo]:
        """Every conversation, the most recently updated first."""

        def go(db):
            rows = db.execute(
                "SELECT c.id, c.title, c.created, c.updated, "
                "(SELECT count(*) FROM turns t WHERE t.conversation_id = c.id), c.bundle, c.model "
                "FROM conversations c ORDER BY c.updated DESC, c.id DESC"
            ).fetchall()
            return [ConversationInfo(*row) for row in rows]

        return self._run(go)

    def last_id(self) -> int | None:
        found = self.list()
        return found[0].id if found else None

    def load(self, conversation_id: int) -> StoredConversation | None:
        def go(db):
            row = db.execute(
                "SELECT id, title, created, updated, bundle, model, settings, processed FROM conversations WHERE id = ?",
                (conversation_id,),
            ).fetchone()
            if row is None:
                return None
            cid, title, created, updated, bundle, model, settings, processed = row
            turns = [
                Turn(user, text, unpack_ids(ids), stats_from_json(stats), bool(cancelled))
                for user, text, ids, cancelled, stats in db.execute(
                    "SELECT user, text, token_ids, cancelled, stats FROM turns WHERE conversation_id = ? ORDER BY position",
                    (cid,),
                )
            ]
            info = ConversationInfo(cid, title, created, updated, len(turns), bundle, model)
            return StoredConversation(info, settings_from_json(settings), turns, unpack_ids(processed))

        return self._run(go)

    def add_turn(
        self,
        conversation_id: int,
        turn: Turn,
        *,
        processed: list[int],
        settings: Settings,
        bundle: str | None = None,
        model: str | None = None,
    ) -> None:
        """Append one finished (or cancelled) turn and the cache contents after it, in one transaction."""

        def go(db):
            now = time.time()
            with self._transaction():
                (position,) = db.execute(
                    "SELECT coalesce(max(position) + 1, 0) FROM turns WHERE conversation_id = ?", (conversation_id,)
                ).fetchone()
                db.execute(
                    "INSERT INTO turns (conversation_id, position, created, user, text, token_ids, cancelled, bundle, "
                    "settings, stats) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        conversation_id,
                        position,
                        now,
                        turn.user,
                        turn.text,
                        pack_ids(turn.token_ids),
                        int(turn.cancelled),
                        bundle,
                        settings_json(settings),
                        json.dumps(turn.stats.to_dict()) if turn.stats is not None else None,
                    ),
                )
                cur = db.execute(
                    "UPDATE conversations SET updated = ?, settings = ?, processed = ?, bundle = coalesce(?, bundle), "
                    "model = coalesce(?, model) WHERE id = ?",
                    (now, settings_json(settings), pack_ids(processed), bundle, model, conversation_id),
                )
                if cur.rowcount == 0:
                    raise sqlite3.IntegrityError(f"no conversation {conversation_id} (deleted by another window?)")

        self._run(go)

    def save_settings(self, conversation_id: int, settings: Settings) -> None:
        def go(db):
            with self._transaction():
                db.execute(
                    "UPDATE conversations SET settings = ? WHERE id = ?", (settings_json(settings), conversation_id)
                )

        self._run(go)

    def rename(self, conversation_id: int, title: str) -> None:
        def go(db):
            with self._transaction():
                db.execute("UPDATE conversations SET title = ? WHERE id = ?", (title, conversation_id))

        self._run(go)

    def delete(self, conversation_id: int) -> None:
        def go(db):
            with self._transaction():
                db.execute("DELETE FROM turns WHERE conversation_id = ?", (conversation_id,))
                db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

        self._run(go)

    def check(self) -> str:
        """SQLite's integrity check: "ok" when the file is sound."""
        return self._run(lambda db: db.execute("PRAGMA integrity_check").fetchone()[0])


def resolve(store: Store, ref: str) -> int:
    """A conversation id from "last" or a number; raises `StoreError` when there is none."""
    if ref == "last":
        found = store.last_id()
        if found is None:
            raise StoreError(f"no saved conversations yet in {store.path}")
        return found
    try:
        cid = int(ref)
    except ValueError:
        raise StoreError(f"--resume takes a conversation id or 'last', got {ref!r}") from None
    if store.load(cid) is None:
        raise StoreError(f"no conversation {cid} in {store.path} (--list shows them)")
    return cid


def format_list(items: list[ConversationInfo], now: float | None = None) -> str:
    """The `chat --list` table."""
    if not items:
        return "no saved conversations"
    now = time.time() if now is None else now
    rows = [("id", "updated", "turns", "model", "title")]
    for c in items:
        rows.append((str(c.id), when(c.updated, now), str(c.turns), c.model or c.bundle or "?", c.title))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(r[i].ljust(widths[i]) for i in range(4)) + "  " + r[4] for r in rows)


def when(t: float, now: float) -> str:
    lt, ln = time.localtime(t), time.localtime(now)
    if lt[:3] == ln[:3]:
        return time.strftime("%H:%M", lt)
    if lt.tm_year == ln.tm_year:
        return time.strftime("%b %d %H:%M", lt)
    return time.strftime("%Y-%m-%d", lt)


def open_store(path: str | Path | None = None, **kwargs) -> tuple[Store | None, str | None]:
    """(store, None), or (None, warning) when the history cannot be used."""
    try:
        return Store(path, **kwargs), None
    except StoreError as e:
        return None, f"history off: {e}"


# --- writing without waiting ---------------------------------------------------------


@dataclass
class ChatRef:
    """A conversation as queued writes see it: `id` stays None until the save thread writes its first
    turn, so every later write queued for it finds the row made by the one before."""

    id: int | None = None


@dataclass
class Write:
    """One queued write, `fn(store)` on the save thread; `turn`: it saves a turn (counted when lost)."""

    fn: Callable[[Store], object]
    turn: bool = False
    done: bool = False


class SaveQueue:
    """History writes on a thread of their own, in order, retried while the database is locked.

    Why, and the numbers: the module's docstring. The save thread has its own connection (busy
    timeout `attempt_s`); the caller's `Store` stays free for reading. `delayed` holds the lock's
    message from a locked attempt until the queue is empty again; `failed` is set by any other
    failure, which drops what is queued and stops the thread (history off). `on_change()` runs on
    the save thread each time either of them changes.
    """

    def __init__(
        self, path: str | Path, on_change: Callable[[], object] = lambda: None, *, attempt_s: float = ATTEMPT_S
    ):
        self.path = Path(path)
        self.on_change = on_change
        self.attempt_s = attempt_s
        self.delayed: str | None = None
        self.failed: str | None = None
        self._writes: deque[Write] = deque()
        self._cond = threading.Condition()
        self._kicked = False  # a write was submitted or exit came: try again now, not after the backoff
        self._closing = False  # exit: retry at the shortest interval
        self._stopping = False
        self._thread: threading.Thread | None = None

    @property
    def pending(self) -> int:
        """Writes queued (including the one being written)."""
        with self._cond:
            return len(self._writes)

    @property
    def unsaved_turns(self) -> int:
        with self._cond:
            return sum(w.turn for w in self._writes)

    def submit(self, fn: Callable[[Store], object], *, turn: bool = False) -> bool:
        """Queue `fn(store)` behind every earlier write. Returns once it is written, after at most
        WAIT_NOW_S when it is first in line, at once when writes wait before it; False when the
        queue has failed or stopped (the write is dropped)."""
        write = Write(fn, turn)
        with self._cond:
            if self.failed is not None or self._stopping:
                return False
            first = not self._writes
            self._writes.append(write)
            self._kicked = True
            self._cond.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="glimmer-history", daemon=True)
                self._thread.start()
            if first:
                self._cond.wait_for(lambda: write.done or self.failed is not None, timeout=WAIT_NOW_S)
            return self.failed is None

    def stop(self) -> None:
        """Stop after the attempt in progress, without waiting; what is queued stays unsaved."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def close(self, timeout: float = FLUSH_S) -> int:
        """Give queued writes up to `timeout` s more, then stop; returns how many turns are unsaved."""
        with self._cond:
            self._closing = self._kicked = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: not self._writes or self.failed is not None or self._stopping, timeout)
        self.stop()
        if self._thread is not None:
            self._thread.join(self.attempt_s + 1.0)  # an attempt in progress ends within its busy timeout
        return self.unsaved_turns

    # --- the save thread ------------------------------------------------------------

    def _run(self) -> None:
        store: Store | None = None
        backoff = FIRST_RETRY_S
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._writes or self._stopping)
                    if self._stopping:
                        return
                    write, self._kicked = self._writes[0], False
                try:
                    if store is None:
                        store = Store(self.path, timeout=self.attempt_s)
                    write.fn(store)
                    error = None
                except StoreError as e:
                    error = e
                except Exception as e:  # a bug in one write must not stall every write behind it
                    error = StoreError(f"{self.path}: {type(e).__name__}: {e}")
                if self._settle(write, error):
                    self._changed()
                if error is None:
                    backoff = FIRST_RETRY_S
                elif not error.busy:
                    return
                else:
                    backoff = self._wait(backoff)
        finally:
            if store is not None:
                store.close()

    def _settle(self, write: Write, error: StoreError | None) -> bool:
        """Record one attempt's outcome; True when `delayed` or `failed` changed."""
        with self._cond:
            before = (self.delayed is None, self.failed)
            if error is None:
                self._writes.popleft()
                write.done = True
                if not self._writes:
                    self.delayed = None
            elif error.busy:
                self.delayed = str(error)
            else:
                self.failed = str(error)
                self._writes.clear()
            self._cond.notify_all()
            return (self.delayed is None, self.failed) != before

    def _wait(self, backoff: float) -> float:
        """After a locked attempt: sleep `backoff` (less on exit), or until a write is submitted;
        returns the next backoff."""
        with self._cond:
            self._cond.wait_for(lambda: self._kicked or self._stopping, FIRST_RETRY_S if self._closing else backoff)
        return min(backoff * 2, RETRY_CAP_S)

    def _changed(self) -> None:
        try:
            self.on_change()
        except Exception:  # the listener is gone (the app closed): the queue carries on
            pass
