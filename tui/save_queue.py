"""History writes without waiting: a queue on a thread of its own, in order, retried while the database
is locked.

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

import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .store import Store, StoreError

ATTEMPT_S = 0.5  # the save thread's busy timeout: how long one write attempt waits for a lock
FIRST_RETRY_S = 0.2  # after a locked attempt, wait this long, doubling each time ...
RETRY_CAP_S = 2.0  # ... up to this: a lock that ends is noticed within about 2 s
WAIT_NOW_S = 0.25  # how long `SaveQueue.submit` waits for a write when nothing is queued before it
FLUSH_S = 5.0  # on exit: how much longer queued writes may wait for the database


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
