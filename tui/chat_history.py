"""The open conversation's place in the history: its turns and settings saved through a `SaveQueue`,
a stored one loaded to resume, history turned off when the database cannot be used.

Writes go through the queue (its own thread, one transaction per finished turn, retried while another
program holds the database locked: `save_queue`'s docstring); the UI thread reads the `Store`.
"""

from __future__ import annotations

import sys
from typing import Callable

from textual.message import Message

from .jobs import Done
from .save_queue import ChatRef, SaveQueue
from .session import Settings
from .store import Store, StoredConversation, title_for


class SavesChanged(Message):
    """The save queue's state changed (posted from its thread): saving delayed, caught up, or failed."""


class ChatHistory:
    """What the app stores of the open conversation, and where. `store` None: no history (--no-history,
    or the database failed); `post` hands `SavesChanged` to the UI."""

    def __init__(self, store: Store | None, post: Callable[[Message], object]):
        self.store = store
        self.post = post
        self.saves = SaveQueue(store.path, self._changed) if store is not None else None
        self.chat = ChatRef()  # the stored conversation; its id is None until its first turn is saved
        self.title: str | None = None
        self.processed: list[int] = []  # what the cache should hold for the open conversation
        self.stored_bundle: str | None = None  # the target a resumed conversation last ran on
        self._delay_noted = False  # a "saving delayed" note is showing and no "caught up" one yet

    @property
    def conversation_id(self) -> int | None:
        return self.chat.id

    @conversation_id.setter
    def conversation_id(self, value: int | None) -> None:
        self.chat = ChatRef(value)  # another conversation: writes still queued for the old one keep its ref

    @property
    def delayed(self) -> bool:
        """Writes wait for a lock held by another program."""
        return self.saves is not None and bool(self.saves.delayed)

    def start_over(self) -> None:
        """A new conversation: not stored until its first turn."""
        self.conversation_id, self.title, self.processed = None, None, []

    # --- writing ----------------------------------------------------------------------

    def submit(self, fn: Callable[[Store], object]) -> bool:
        """Queue `fn(store)` behind the turns being saved (done before this returns when the database is
        free, retried while it is locked); False without history. A failure other than a lock turns
        history off (`SavesChanged`)."""
        if self.saves is None:
            return False
        return self.saves.submit(fn)

    def save_turn(self, done: Done, *, bundle: str | None, model: str) -> None:
        """Queue a finished or cancelled turn (the conversation row is made by its first turn); with the
        database free it is stored when this returns, with it locked it waits in the queue, in order."""
        self.processed = done.processed
        if self.saves is None:
            return
        if self.conversation_id is None and self.title is None:
            self.title = title_for(done.turn.user)
        chat, title = self.chat, self.title

        def save(store: Store) -> None:
            if chat.id is None:
                chat.id = store.create(title, done.settings, bundle=bundle, model=model)
            store.add_turn(
                chat.id, done.turn, processed=done.processed, settings=done.settings, bundle=bundle, model=model
            )

        self.saves.submit(save, turn=True)

    def save_settings(self, settings: Settings) -> None:
        chat = self.chat
        if chat.id is None and not (self.saves is not None and self.saves.pending):
            return  # not stored yet, and no turn of it queued

        def save(store: Store) -> None:
            if chat.id is not None:
                store.save_settings(chat.id, settings)

        self.submit(save)

    def _changed(self) -> None:
        """On the save thread: hand the news to the UI thread (nothing to do once the app is gone)."""
        try:
            self.post(SavesChanged())
        except RuntimeError:  # the event loop is closed
            pass

    def delay_news(self) -> str | None:
        """After `SavesChanged`: the note to show when saving starts waiting for a lock, and when the
        queue has caught up; None otherwise."""
        saves = self.saves
        if saves.delayed and not self._delay_noted:
            self._delay_noted = True
            n = saves.unsaved_turns
            return (
                f"saving delayed: {saves.delayed}. The chat goes on; {n} turn{'s' * (n != 1)} queued, "
                "written once it is free."
            )
        if not saves.delayed and self._delay_noted:
            self._delay_noted = False
            return "History caught up: every queued turn is saved."
        return None

    # --- resuming -------------------------------------------------------------------------

    def load(self, conversation_id: int) -> StoredConversation | None:
        """A stored conversation (None: no such one, or no history). Raises `StoreError`."""
        return self.store.load(conversation_id) if self.store is not None else None

    def opened(self, stored: StoredConversation) -> None:
        """`stored` is the open conversation: later turns join it."""
        self.conversation_id, self.title = stored.info.id, stored.info.title

    def resume_cache(self, stored: StoredConversation, bundle: str | None) -> list[int]:
        """The cache to rebuild for `stored` on the target `bundle` (None: no model loaded yet, decided
        once one is): what it held, unless it last ran on another target."""
        self.stored_bundle = stored.info.bundle
        same_model = stored.info.bundle in (None, bundle) or bundle is None
        self.processed = stored.processed if same_model else []
        return self.processed

    # --- the end ------------------------------------------------------------------------------

    def off(self) -> None:
        """History off: drop what is queued, close the store."""
        if self.saves is not None:
            self.saves.stop()
            self.saves = None
        if self.store is not None:
            self.store.close()
        self.store = None
        self.conversation_id = None

    def close(self, flush_s: float) -> None:
        """On exit: give queued turns up to `flush_s` to reach the database (one line on stderr for those
        that did not), close the store."""
        if self.saves is not None:
            saves, self.saves = self.saves, None
            left = saves.close(flush_s)
            if left:
                why = saves.delayed or saves.failed or f"{saves.path}: still writing"
                print(
                    f"history: {left} turn{'s' * (left != 1)} of this chat could not be saved after waiting "
                    f"{flush_s:g} s: {why}",
                    file=sys.stderr,
                )
        if self.store is not None:
            self.store.close()
            self.store = None
