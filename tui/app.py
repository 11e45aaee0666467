"""`mlx-glimmer chat`: the Textual app.

`ChatApp` holds the open conversation and what it runs on: the MLX jobs (`jobs.ModelJobs`: loading,
every turn, rebuilding a resumed chat's cache, all on one thread) and the history
(`chat_history.ChatHistory`: the store, written through a save queue on a thread of its own). Its one
screen, `screens.chat.ChatScreen`, shows the chat and drives both; slash commands (`commands`) act on
the app.
"""

from __future__ import annotations

import os
import sys
from typing import Callable

from textual.app import App
from textual.binding import Binding

from .chat_history import ChatHistory
from .jobs import Done, ModelJobs
from .pacing import leave_a_core_for_the_ui
from .save_queue import FLUSH_S
from .screens.chat import ChatScreen
from .session import Conversation, Settings
from .stats import session_report
from .status import model_names
from .store import Store
from .widgets import Note

SWITCH_INTERVAL_S = 0.001


class ChatApp(App):
    TITLE = "mlx-glimmer chat"
    CSS_PATH = "chat.tcss"

    BINDINGS = [
        Binding("escape", "cancel", "cancel"),
        Binding("ctrl+c", "interrupt", "cancel", show=False, priority=True),
        Binding("ctrl+l", "clear", "clear"),
        Binding("ctrl+o", "conversations", "chats"),
        Binding("f2", "toggle_stats", "stats"),
        Binding("ctrl+q", "quit", "quit", priority=True),
    ]

    def __init__(
        self,
        load: Callable[[], object],
        settings: Settings | None = None,
        source: str = "the model",
        *,
        store: Store | None = None,
        store_warning: str | None = None,
        resume: int | None = None,
        first_message: str | None = None,
        overrides: dict | None = None,
    ):
        super().__init__()
        self.load_pair = load
        self.source = source
        self.store_warning = store_warning
        self.resume = resume
        self.first_message = first_message  # sent once the model is loaded (and a resumed cache rebuilt)
        self.overrides = overrides or {}  # Settings fields given on the command line: they win over a resumed chat's
        self.conversation = Conversation(settings or Settings())
        self.chat_screen = ChatScreen()
        self.jobs = ModelJobs(self.chat_screen.post_message)
        self.chat_history = ChatHistory(store, self.chat_screen.post_message)

    def get_default_screen(self) -> ChatScreen:
        return self.chat_screen

    def on_unmount(self) -> None:
        self.jobs.cancel()

    # --- what the chat screen and the slash commands read and change -------------------------

    @property
    def settings(self) -> Settings:
        return self.conversation.settings

    def update_settings(self, **changes) -> None:
        """Change the open conversation's settings (a new frozen `Settings`; the next turn uses it)."""
        self.conversation.settings = self.settings.with_changes(**changes)

    def no_drafter_no_spec(self) -> None:
        """A pair without a drafter decodes with the target alone: speculative decoding off."""
        if self.pair is not None and self.pair.drafter is None and self.settings.generation.speculative:
            self.update_settings(speculative=False)

    @property
    def pair(self):
        return self.jobs.pair

    @property
    def state(self):
        return self.jobs.state

    @property
    def busy(self) -> bool:
        return self.jobs.busy

    def model_name(self) -> str:
        return model_names(self.pair) if self.pair is not None else self.source

    def bundle_name(self) -> str | None:
        return str(self.pair.target_path) if self.pair is not None else None

    @property
    def store(self) -> Store | None:
        return self.chat_history.store

    @property
    def conversation_id(self) -> int | None:
        return self.chat_history.conversation_id

    @property
    def conversation_title(self) -> str | None:
        return self.chat_history.title

    @conversation_title.setter
    def conversation_title(self, title: str | None) -> None:
        self.chat_history.title = title

    def history(self, fn: Callable[[Store], object]) -> bool:
        """Queue `fn(store)` behind the turns being saved (`ChatHistory.submit`); False without history."""
        return self.chat_history.submit(fn)

    def save_turn(self, done: Done) -> None:
        if self.jobs.unsaved is done:
            self.jobs.unsaved = None
        self.chat_history.save_turn(done, bundle=self.bundle_name(), model=self.model_name())

    def save_settings(self) -> None:
        self.chat_history.save_settings(self.settings)

    def note(self, text: str, kind: str, title: str | None = None) -> Note:
        return self.chat_screen.note(text, kind, title)

    def show_reasoning_level(self) -> None:
        self.chat_screen.show_reasoning_level()

    def stats_text(self) -> str:
        return session_report(self.conversation.turns)

    # --- keys -------------------------------------------------------------------------------------

    def action_cancel(self) -> None:
        self.chat_screen.cancel_answer()

    def action_interrupt(self) -> None:
        self.chat_screen.interrupt()

    async def action_clear(self) -> None:
        await self.chat_screen.clear_conversation()

    def action_conversations(self) -> None:
        self.chat_screen.show_conversations()

    def action_toggle_stats(self) -> None:
        self.chat_screen.toggle_stats()

    # --- the end ------------------------------------------------------------------------------------

    def shut_down(self, wait_s: float, flush_s: float = FLUSH_S) -> bool:
        """After the app has exited: let the MLX thread finish (a cancelled turn stops within one
        round), save an answer cut short by quitting, give queued turns up to `flush_s` to reach the
        database (one line on stderr for those that did not), close the store. False if the thread still runs."""
        closed = self.jobs.close(wait_s)
        if self.jobs.unsaved is not None:  # quit during an answer: keep what was written, marked cancelled
            try:
                self.save_turn(self.jobs.unsaved)
            except Exception:  # the app is gone: nowhere to show a failure
                pass
        self.chat_history.close(flush_s)
        return closed


def run(load: Callable[[], object], settings: Settings, source: str, exit_wait_s: float = 3.0, **options) -> int:
    """Run the app in this terminal; returns the exit code. `options`: `ChatApp`'s keywords."""
    # The decoder (MLX thread) releases the GIL inside MLX and needs it back between
    # steps; while the UI thread draws, a 5 ms switch interval makes it wait up to 5 ms
    # each time. 1 ms hands it back sooner (benchmarks/chat_stream_speed.py).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    leave_a_core_for_the_ui()
    app = ChatApp(load, settings, source, **options)
    app.run()
    # A model still loading cannot be stopped, and MLX aborts if the interpreter
    # exits under a running thread.
    if not app.shut_down(exit_wait_s):
        os._exit(app.return_code or 0)
    return app.return_code or 0
