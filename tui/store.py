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

The app writes through a `save_queue.SaveQueue`, never on its UI thread
(why, and its timings: that module's docstring).
"""

from __future__ import annotations

import array
import dataclasses
import json
import os
import sqlite3
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from mlx_glimmer.generate import GenerationStats

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
    return json.dumps(settings.flat())


def settings_from_json(text: str | None, default: Settings | None = None) -> Settings:
    """Settings from JSON; unknown keys (a newer version's) are ignored, missing ones keep `default`'s."""
    default = default or Settings()
    try:
        data = json.loads(text or "{}")
    except json.JSONDecodeError:
        data = {}
    if not isinstance(data, dict):
        data = {}
    names = default.flat().keys()
    try:
        return default.with_changes(**{k: v for k, v in data.items() if k in names})
    except Exception:  # a value this version does not accept (hand-edited, or a newer version's): keep the defaults
        return default


def stats_from_json(text: str | None) -> GenerationStats | None:
    """A turn's stored statistics; unknown keys (a newer version's) are ignored. None when there are none
    or they cannot be read (not JSON, not an object, a value of the wrong kind): the turn still opens,
    its statistics shown as unavailable."""
    if not text:
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict):
        return None
    defaults = GenerationStats()
    kept = {f.name: data[f.name] for f in dataclasses.fields(GenerationStats) if f.name in data}
    if not all(same_kind(value, getattr(defaults, name)) for name, value in kept.items()):
        return None
    return GenerationStats(**kept)


def same_kind(value, default) -> bool:
    """Whether a stored statistic can stand where `default` does (a number, a list of whole numbers, counts
    by name, a string or None)."""
    if isinstance(default, list):
        return isinstance(value, list) and all(isinstance(n, int) for n in value)
    if isinstance(default, dict):
        return isinstance(value, dict) and all(isinstance(k, str) and isinstance(n, int) for k, n in value.items())
    if isinstance(default, (int, float)):
        return isinstance(value, (int, float))
    return value is None or isinstance(value, str)


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
