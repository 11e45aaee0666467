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
import json
import os
import sqlite3
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from mlx_glimmer.generate import GenerationStats

from . import stored_fields
from .session import Settings, Turn

SCHEMA_VERSION = 1
DB_NAME = "chats.db"
TITLE_LENGTH = 60
UNTITLED = "(untitled)"  # a title that cannot be read

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
    created: float | None  # None: the stored time cannot be read
    updated: float | None
    turns: int
    bundle: str | None
    model: str | None


@dataclass
class StoredConversation:
    info: ConversationInfo
    settings: Settings
    turns: list[Turn]
    processed: list[int]  # token ids the cache held after the last turn
    unreadable: list[str] = field(default_factory=list)  # what could not be read and is left out, for the user


def pack_ids(ids) -> bytes:
    a = array.array("I", ids)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def settings_json(settings: Settings) -> str:
    return json.dumps(settings.flat())


def settings_from_json(text: str | bytes | None, default: Settings | None = None) -> Settings:
    """Settings from JSON (`stored_fields.settings`), `default`'s where they cannot be read."""
    return stored_fields.settings(text, default) or default or Settings()


def stats_from_json(text: str | bytes | None) -> GenerationStats | None:
    """A turn's stored statistics (`stored_fields.stats`): None when there are none or they cannot be read."""
    return stored_fields.stats(text)


def raw(column: str) -> str:
    """SQL for `column` as stored, as bytes: text that is not UTF-8 reaches `stored_fields` instead of failing
    inside sqlite3 (which decodes every text value it returns)."""
    return f"CAST({column} AS BLOB)"


def numeric(column: str) -> str:
    """SQL for `column` when it holds a number, NULL when it holds anything else."""
    return f"CASE WHEN typeof({column}) IN ('integer', 'real') THEN {column} END"


def info_from_row(cid, title, created, updated, turns, bundle, model) -> ConversationInfo:
    """A conversation's row as stored (text columns as bytes: `raw`), read through `stored_fields`."""
    return ConversationInfo(
        cid,
        stored_fields.text(title) or UNTITLED,
        stored_fields.timestamp(created),
        stored_fields.timestamp(updated),
        turns,
        stored_fields.text(bundle),
        stored_fields.text(model),
    )


def conversation_from_rows(info: ConversationInfo, settings, processed, turn_rows) -> StoredConversation:
    """A conversation from its stored settings, cache ids and turns' rows (user, text, token ids, cancelled,
    stats), each read through `stored_fields`. What cannot be read is left out and named in `unreadable`:
    settings give way to the defaults; cache ids are dropped, so the next turn prefills the chat from its text;
    a turn's token ids are dropped (an export lists none). A turn's statistics that cannot be read are None,
    shown as unavailable under the answer."""
    unreadable = []
    restored = stored_fields.settings(settings)
    if restored is None:
        restored = Settings()
        unreadable.append("its settings (the defaults apply)")
    cache = stored_fields.ids(processed)
    if cache is None:
        unreadable.append("its cache ids (the next turn prefills the whole chat)")
    turns = []
    for position, (user, text, ids, cancelled, stats) in enumerate(turn_rows, 1):
        token_ids = stored_fields.ids(ids)
        if token_ids is None:
            unreadable.append(f"the token ids of turn {position} (an export lists none)")
        turn = Turn(
            stored_fields.text(user) or "",
            stored_fields.text(text) or "",
            token_ids or [],
            stored_fields.stats(stats),
            stored_fields.flag(cancelled),
        )
        turns.append(turn)
    return StoredConversation(info, restored, turns, cache or [], unreadable)


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
                f"SELECT c.id, {raw('c.title')}, {numeric('c.created')}, {numeric('c.updated')}, "
                f"(SELECT count(*) FROM turns t WHERE t.conversation_id = c.id), {raw('c.bundle')}, {raw('c.model')} "
                "FROM conversations c ORDER BY c.updated DESC, c.id DESC"
            ).fetchall()
            return [info_from_row(*row) for row in rows]

        return self._run(go)

    def last_id(self) -> int | None:
        found = self.list()
        return found[0].id if found else None

    def load(self, conversation_id: int) -> StoredConversation | None:
        """A stored conversation, every field read through `stored_fields`: what cannot be read is left out and
        named in `unreadable` (a turn's statistics: its `stats` is None). Writes nothing."""

        def go(db):
            row = db.execute(
                f"SELECT id, {raw('title')}, {numeric('created')}, {numeric('updated')}, {raw('bundle')}, "
                f"{raw('model')}, {raw('settings')}, {raw('processed')} FROM conversations WHERE id = ?",
                (conversation_id,),
            ).fetchone()
            if row is None:
                return None
            cid, title, created, updated, bundle, model, settings, processed = row
            rows = db.execute(
                f"SELECT {raw('user')}, {raw('text')}, {raw('token_ids')}, {numeric('cancelled')}, {raw('stats')} "
                "FROM turns WHERE conversation_id = ? ORDER BY position",
                (cid,),
            ).fetchall()
            info = info_from_row(cid, title, created, updated, len(rows), bundle, model)
            return conversation_from_rows(info, settings, processed, rows)

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


def when(t: float | None, now: float) -> str:
    if t is None:
        return "?"
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
