"""`mlx-glimmer chat`: the Textual app.

All MLX work (loading, every turn, rebuilding a resumed chat's cache) runs on
one `MLXThread`; it reports back with messages, so the UI thread only ever
reads snapshots. The conversation store is written through a `store.SaveQueue`
(its own thread, one transaction per finished turn, retried while another
program holds the database locked); the UI thread reads it.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

from textual import on
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.message import Message
from textual.widgets import Footer, Header, Select, Static

from ..chat_template import supports_reasoning
from ..errors import GlimmerError
from ..generate import GenerationStats
from ..speculative import DecodeState
from .chats import Choice, ConversationList
from .commands import CommandError, is_command, prompt_text, run_command
from .pacing import Pacer, leave_a_core_for_the_ui
from .session import Conversation, Settings, Turn, rebuild_state, run_turn
from .stats import prefill_line, stats_rows
from .store import FLUSH_S, ChatRef, SaveQueue, Store, StoreError, title_for
from .widgets import AssistantMessage, Note, PromptInput, StatsPanel
from .worker import MLXThread

SWITCH_INTERVAL_S = 0.001

LOAD_HINT = "Quit (ctrl+q) and start with a bundle: `mlx-glimmer chat BUNDLE`. /help still works."


class Loaded(Message):
    def __init__(self, pair):
        super().__init__()
        self.pair = pair


class Failed(Message):
    """Loading or a turn failed; `text` says what happened."""

    def __init__(self, text: str, loading: bool):
        super().__init__()
        self.text = text
        self.loading = loading


class Progress(Message):
    def __init__(self, text: str, stats: GenerationStats):
        super().__init__()
        self.text = text
        self.stats = stats


@dataclass
class Done:
    """A finished (or cancelled) turn, what the cache holds after it, and the settings it ran with."""

    turn: Turn
    processed: list[int]
    settings: Settings


class Finished(Message):
    def __init__(self, done: Done):
        super().__init__()
        self.done = done
        self.turn = done.turn


class SavesChanged(Message):
    """The save queue's state changed (posted from its thread): saving delayed, caught up, or failed."""


class Rebuilt(Message):
    """A resumed conversation's cache is back: `tokens` ids prefilled in `seconds` (or `error`)."""

    def __init__(self, tokens: int, seconds: float, error: str | None = None):
        super().__init__()
        self.tokens = tokens
        self.seconds = seconds
        self.error = error


def describe_error(e: BaseException) -> str:
    return str(e) if isinstance(e, GlimmerError) else f"{type(e).__name__}: {e}"


def model_names(pair) -> str:
    if pair.drafter_path is None:
        return pair.name
    if pair.drafter_path.parent == pair.target_path.parent and pair.target_path.name == "target":
        return f"{pair.name} (target + drafter)"
    return f"{pair.name} + {pair.drafter_path.name}"


class ChatApp(App):
    TITLE = "mlx-glimmer chat"
    CSS_PATH = "chat.tcss"
    # The UI thread and the MLX thread share the GIL: every update drawn is time the
    # decoder waits. The pacer keeps the UI's share small (benchmarks/chat_stream_speed.py
    # measures the app against `generate`); the stats panel updates once a second and
    # the prompt's cursor stops blinking while an answer streams.
    STATS_INTERVAL = 1.0

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
        self._load = load
        self.source = source
        self.conversation = Conversation(settings or Settings())
        self.store = store  # None: no history (--no-history, or the database failed)
        self.store_warning = store_warning
        self.saves = SaveQueue(store.path, self._saves_changed) if store is not None else None
        self._saving_delayed = False  # a "saving delayed" note is showing and no "caught up" one yet
        self.chat = (
            ChatRef()
        )  # the stored conversation; `conversation_id` is its id, None until its first turn is saved
        self.conversation_title: str | None = None
        self.resume = resume
        self.first_message = first_message
        self.overrides = overrides or {}  # Settings fields given on the command line: they win over a resumed chat's
        self.unsaved: Done | None = None  # a turn the UI has not stored yet (saved on exit if the app quits first)
        self._processed: list[int] = []  # what the cache should hold for the open conversation
        self._stored_bundle: str | None = None  # the target a resumed conversation last ran on
        self._stats_shown = 0.0  # when the stats panel was last updated while streaming
        self.pacer = Pacer()
        self._progress_posted = 0.0  # pacer clock time of the last Progress posted
        self._progress_pending = False  # posted and not handled yet: the MLX thread does not pile more on
        self.pair = None
        self.state = DecodeState()  # touched only by jobs on the MLX thread, or while no job runs
        self.mlx = MLXThread()
        self.busy = False
        self.cancel_event = threading.Event()
        self.current: AssistantMessage | None = None
        self.last_stats: GenerationStats | None = None

    @property
    def settings(self) -> Settings:
        return self.conversation.settings

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="body"):
            yield VerticalScroll(id="log")
            yield StatsPanel(id="side")
        yield PromptInput(id="prompt", placeholder="Message (enter sends, ctrl+j new line, /help)")
        yield Static("", id="status", markup=False)
        yield Footer()

    async def on_mount(self) -> None:
        self.query_one(PromptInput).focus()
        if self.store_warning:
            self.note(self.store_warning, "error")
        if self.resume is not None:
            await self.open_conversation(self.resume)
        self.note(f"Loading {self.source}…", "info")
        self.set_status(f"loading {self.source}…")
        self.busy = True
        self.mlx.submit(self._load_job)

    def on_unmount(self) -> None:
        self.cancel_event.set()

    # --- jobs on the MLX thread -------------------------------------------------

    def _load_job(self) -> None:
        try:
            pair = self._load()
        except Exception as e:
            self.post_message(Failed(describe_error(e), loading=True))
        else:
            self.post_message(Loaded(pair))

    def _turn_job(self, messages: list[dict], kwargs: dict, settings: Settings, cancel: threading.Event) -> None:
        try:
            turn = run_turn(
                self.pair,
                messages,
                state=self.state,
                cancel=cancel,
                on_progress=self._report,
                progress_interval=0.0,  # paced in _report
                **kwargs,
            )
        except Exception as e:
            self.state = DecodeState()  # the caches may be half updated
            self.post_message(Failed(describe_error(e), loading=False))
        else:
            done = Done(turn, list(self.state.processed), settings)
            self.unsaved = done
            self.post_message(Finished(done))

    def _report(self, text: str, stats: GenerationStats) -> None:
        """On the MLX thread: post progress when the pacer says the UI is ready for more (the final text
        always arrives with `Finished`)."""
        if self._progress_pending or not self.pacer.due(self._progress_posted):
            return
        self._progress_pending = True
        self._progress_posted = self.pacer.clock()
        self.post_message(Progress(text, stats))

    def _rebuild_job(self, processed: list[int], settings: Settings) -> None:
        tic = time.perf_counter()
        try:
            self.state = DecodeState()
            n = rebuild_state(self.pair, processed, self.state, settings)
        except Exception as e:
            self.state = DecodeState()
            self.post_message(Rebuilt(0, 0.0, describe_error(e)))
        else:
            self.post_message(Rebuilt(n, time.perf_counter() - tic))

    # --- results ------------------------------------------------------------------

    def on_loaded(self, message: Loaded) -> None:
        self.pair = message.pair
        self.busy = False
        self.sub_title = model_names(self.pair)
        supported = supports_reasoning(self.pair.tokenizer)
        self.conversation.reasoning_supported = supported
        panel = self.query_one(StatsPanel)
        panel.show_reasoning(supported)
        if supported:
            self.show_reasoning_level()
        if self.settings.speculative and self.pair.drafter is None:
            self.update_settings(speculative=False)
        self.note(f"Loaded {model_names(self.pair)}. Type a message; /help lists the commands.", "info")
        self.set_status()
        if self._processed and self._stored_bundle not in (None, self.bundle_name()):
            self.note(f"This conversation last ran on {self._stored_bundle}; the next turn prefills it whole.", "info")
            self._processed = []
        if self._processed:
            self.start_rebuild()
        elif self.first_message:
            self.ask(self.first_message)
            self.first_message = None

    def on_failed(self, message: Failed) -> None:
        self.busy = False
        self.query_one(PromptInput).cursor_blink = True
        if message.loading:
            self.note(f"Could not load {self.source}: {message.text}\n{LOAD_HINT}", "error", "error")
            self.set_status("no model loaded")
            return
        if self.current is not None:
            self.current.remove()
            self.current = None
        text = f"Generation failed: {message.text}\nThe conversation is kept; the cache starts over."
        self.note(text, "error", "error")
        self.set_status()

    async def on_progress(self, message: Progress) -> None:
        self._progress_pending = False
        self.pacer.updated()
        if self.current is not None:
            await self.current.stream(message.text)
            now = time.monotonic()
            if now - self._stats_shown >= self.STATS_INTERVAL:
                self.query_one(StatsPanel).show(message.stats)
                self._stats_shown = now
            self.scroll_log()

    async def on_finished(self, message: Finished) -> None:
        self.query_one(PromptInput).cursor_blink = True
        turn = message.turn
        self.conversation.turns.append(turn)
        self.save_turn(message.done)
        self.last_stats = turn.stats
        self.query_one(StatsPanel).show(turn.stats)
        if self.current is not None:
            await self.current.finish(turn)
            self.current = None
        self.busy = False
        self.set_status()
        self.scroll_log()

    # --- input ----------------------------------------------------------------------

    @on(PromptInput.Submitted)
    async def submitted(self, event: PromptInput.Submitted) -> None:
        line = event.text
        if is_command(line):
            try:
                await self.run_command(line)
            except CommandError as e:
                self.note(str(e), "error")
            return
        if self.busy:
            wait = (
                "the model is still loading"
                if self.pair is None
                else "the cache is being rebuilt"
                if self.current is None
                else "press Esc to cancel the answer first"
            )
            self.note(f"Still busy; {wait}.", "error")
            return
        if self.pair is None:
            self.note("No model loaded (see the error above).", "error")
            return
        self.ask(prompt_text(line))

    def ask(self, text: str) -> None:
        messages = self.conversation.messages(text)
        kwargs = self.conversation.generation_kwargs()
        self.note(text, "user", "you")
        self.current = AssistantMessage()
        self.query_one("#log").mount(self.current)
        self.scroll_log()
        self.busy = True
        self.cancel_event = cancel = threading.Event()
        self.set_status("generating… (esc cancels)")
        settings = self.settings  # frozen: the turn keeps what it ran with
        self.pacer.start()
        self.query_one(PromptInput).cursor_blink = False
        self._progress_pending, self._progress_posted = False, 0.0
        self.mlx.submit(lambda: self._turn_job(messages, kwargs, settings, cancel))

    async def run_command(self, line: str) -> None:
        spec = await run_command(self, line)
        if spec.persists:
            self.save_settings()
        self.set_status()

    def update_settings(self, **changes) -> None:
        """Change the open conversation's settings (a new frozen `Settings`; the next turn uses it)."""
        self.conversation.settings = self.settings.with_changes(**changes)

    def show_reasoning_level(self) -> None:
        self.query_one("#reasoning", Select).value = self.settings.reasoning

    def stats_text(self) -> str:
        rows = stats_rows(self.last_stats)
        width = max(len(k) for k, _ in rows)
        lines = ["last answer:"] + [f"  {k:<{width}}  {v}" for k, v in rows]
        if self.last_stats is not None:
            lines.append(f"  {prefill_line(self.last_stats)}")
        done = [t.stats for t in self.conversation.turns if t.stats is not None]
        rounds = [n for st in done for n in st.acceptance_lengths]
        tokens = sum(st.generated_tokens for st in done)
        mean = sum(rounds) / len(rounds) if rounds else 0.0
        prompt = sum(st.prompt_tokens for st in done)
        prefilled = sum(st.prefill_tokens for st in done)
        lines.append(
            f"session: {len(done)} answers, {tokens} tokens, {mean:.2f} tok/round over {len(rounds)} rounds, "
            f"prefilled {prefilled} of {prompt} prompt tokens"
        )
        return "\n".join(lines)

    @on(Select.Changed, "#reasoning")
    def reasoning_changed(self, event: Select.Changed) -> None:
        if event.value in (None, Select.BLANK) or event.value == self.settings.reasoning:
            return
        self.update_settings(reasoning=str(event.value))
        self.save_settings()
        self.set_status()

    # --- actions --------------------------------------------------------------------

    def action_cancel(self) -> None:
        if self.busy and self.current is not None and not self.cancel_event.is_set():
            self.cancel_event.set()
            self.set_status("cancelling…")

    def action_interrupt(self) -> None:
        prompt = self.query_one(PromptInput)
        if self.busy and self.current is not None:
            self.action_cancel()
        elif self.focused is prompt and prompt.selected_text:
            prompt.action_copy()
        else:
            self.notify("Press ctrl+q to quit.", timeout=3)

    async def action_clear(self) -> None:
        if self.busy:
            self.note("Still busy; press Esc to cancel the answer first.", "error")
            return
        await self.start_over()
        self.note("Conversation cleared." + (" The old one stays in the list (ctrl+o)." if self.store else ""), "info")

    async def start_over(self, settings: Settings | None = None) -> None:
        """An empty conversation (not stored until its first turn) and an empty cache."""
        self.conversation.turns.clear()
        if settings is not None:
            self.conversation.settings = settings
        self.conversation_id, self.conversation_title, self._processed = None, None, []
        self.state = DecodeState()
        self.last_stats = None
        await self.query_one("#log").remove_children()
        self.query_one(StatsPanel).show(None)

    def shut_down(self, wait_s: float, flush_s: float = FLUSH_S) -> bool:
        """After the app has exited: let the MLX thread finish (a cancelled turn stops within one
        round), save an answer cut short by quitting, give queued turns up to `flush_s` to reach the
        database (one line on stderr for those that did not), close the store. False if the thread still runs."""
        closed = self.mlx.close(timeout=wait_s)
        if self.unsaved is not None:  # quit during an answer: keep what was written, marked cancelled
            try:
                self.save_turn(self.unsaved)
            except Exception:  # the app is gone: nowhere to show a failure
                pass
        if self.saves is not None:
            self.flush_history(flush_s)
        if self.store is not None:
            self.store.close()
            self.store = None
        return closed

    # --- history ------------------------------------------------------------------------

    @property
    def conversation_id(self) -> int | None:
        return self.chat.id

    @conversation_id.setter
    def conversation_id(self, value: int | None) -> None:
        self.chat = ChatRef(value)  # another conversation: writes still queued for the old one keep its ref

    def history(self, fn) -> bool:
        """Queue `fn(store)` behind the turns being saved (`store.SaveQueue`: done before this returns when
        the database is free, retried while it is locked); False without history. A failure other than a
        lock turns history off (`on_saves_changed`)."""
        if self.saves is None:
            return False
        return self.saves.submit(fn)

    def _saves_changed(self) -> None:
        """On the save thread: hand the news to the UI thread (nothing to do once the app is gone)."""
        try:
            self.post_message(SavesChanged())
        except RuntimeError:  # the event loop is closed
            pass

    def on_saves_changed(self, message: SavesChanged) -> None:
        saves = self.saves
        if saves is None:
            return
        if saves.failed is not None:
            self.history_off(saves.failed)
            return
        if saves.delayed and not self._saving_delayed:
            self._saving_delayed = True
            n = saves.unsaved_turns
            self.note(
                f"saving delayed: {saves.delayed}. The chat goes on; {n} turn{'s' * (n != 1)} queued, "
                "written once it is free.",
                "info",
            )
        elif not saves.delayed and self._saving_delayed:
            self._saving_delayed = False
            self.note("History caught up: every queued turn is saved.", "info")
        if not self.busy:
            self.set_status()

    def flush_history(self, flush_s: float) -> None:
        """On exit: wait up to `flush_s` for queued turns, then say in one line what could not be saved."""
        saves, self.saves = self.saves, None
        left = saves.close(flush_s)
        if left:
            why = saves.delayed or saves.failed or f"{saves.path}: still writing"
            print(
                f"history: {left} turn{'s' * (left != 1)} of this chat could not be saved after waiting "
                f"{flush_s:g} s: {why}",
                file=sys.stderr,
            )

    def history_off(self, why: str) -> None:
        self.note(f"history off: {why}", "error")
        if self.saves is not None:
            self.saves.stop()
            self.saves = None
        if self.store is not None:
            self.store.close()
        self.store = None
        self.conversation_id = None

    def model_name(self) -> str:
        return model_names(self.pair) if self.pair is not None else self.source

    def bundle_name(self) -> str | None:
        return str(self.pair.target_path) if self.pair is not None else None

    def save_turn(self, done: Done) -> None:
        """Queue a finished or cancelled turn (the conversation row is made by its first turn); with the
        database free it is stored when this returns, with it locked it waits in the queue, in order."""
        if self.unsaved is done:
            self.unsaved = None
        self._processed = done.processed
        if self.saves is None:
            return
        if self.conversation_id is None and self.conversation_title is None:
            self.conversation_title = title_for(done.turn.user)
        chat, title, bundle, model = self.chat, self.conversation_title, self.bundle_name(), self.model_name()

        def save(store: Store) -> None:
            if chat.id is None:
                chat.id = store.create(title, done.settings, bundle=bundle, model=model)
            store.add_turn(
                chat.id, done.turn, processed=done.processed, settings=done.settings, bundle=bundle, model=model
            )

        self.saves.submit(save, turn=True)

    def save_settings(self) -> None:
        chat, settings = self.chat, self.settings
        if chat.id is None and not (self.saves is not None and self.saves.pending):
            return  # not stored yet, and no turn of it queued

        def save(store: Store) -> None:
            if chat.id is not None:
                store.save_settings(chat.id, settings)

        self.history(save)

    async def open_conversation(self, conversation_id: int) -> bool:
        """Show a stored conversation, restore its settings, and (once a model is loaded) rebuild its cache."""
        try:
            stored = self.store.load(conversation_id) if self.store is not None else None
        except StoreError as e:
            self.history_off(str(e))
            return False
        if stored is None:
            self.note(f"No conversation {conversation_id}.", "error")
            return False
        settings = stored.settings
        if conversation_id == self.resume:
            settings = dataclasses.replace(settings, **self.overrides)
        await self.start_over(settings)
        self.conversation.turns.extend(stored.turns)
        self.conversation_id, self.conversation_title = stored.info.id, stored.info.title
        log = self.query_one("#log")
        for turn in stored.turns:
            self.note(turn.user, "user", "you")
            message = AssistantMessage()
            await log.mount(message)
            await message.finish(turn)
        done = [t.stats for t in stored.turns if t.stats is not None]
        self.last_stats = done[-1] if done else None
        self.query_one(StatsPanel).show(self.last_stats)
        where = (
            f" (it ran on {stored.info.model})"
            if stored.info.model and self.pair is not None and stored.info.model != self.model_name()
            else ""
        )
        self.note(f"Resumed “{stored.info.title}” (#{stored.info.id}, {len(stored.turns)} turns){where}.", "info")
        if self.pair is not None:
            if self.settings.speculative and self.pair.drafter is None:
                self.update_settings(speculative=False)
            if self.conversation.reasoning_supported:
                self.show_reasoning_level()
        self._stored_bundle = stored.info.bundle
        same_model = stored.info.bundle in (None, self.bundle_name()) or self.pair is None
        self._processed = stored.processed if same_model else []
        if self.pair is not None and self._processed:
            self.start_rebuild()
        self.set_status()
        self.scroll_log()
        return True

    def start_rebuild(self) -> None:
        """Prefill the stored cache contents on the MLX thread, so the next turn reuses them."""
        if self.pair is not None and self.pair.drafter is None and self.settings.speculative:
            self.update_settings(speculative=False)
        self.busy = True
        self.set_status(f"rebuilding the cache ({len(self._processed)} tokens)…")
        processed, s = list(self._processed), self.settings
        self.mlx.submit(lambda: self._rebuild_job(processed, s))

    def on_rebuilt(self, message: Rebuilt) -> None:
        self.busy = False
        if message.error:
            self.note(f"Could not rebuild the cache ({message.error}); the next turn prefills the whole chat.", "error")
        else:
            self.note(f"Cache rebuilt: {message.tokens} tokens in {message.seconds:.1f} s.", "info")
        self.set_status()
        if self.first_message:
            self.ask(self.first_message)
            self.first_message = None

    def action_conversations(self) -> None:
        if self.store is None:
            self.note("No history: started with --no-history, or the database could not be used.", "error")
            return
        if self.busy:
            self.note("Still busy; wait for the answer (esc cancels it) before switching conversations.", "error")
            return
        self.push_screen(ConversationList(self.store, self.conversation_id), self.chosen)

    async def chosen(self, choice: Choice | None) -> None:
        if choice is None:
            return
        if choice.error:
            self.history_off(choice.error)
            return
        if self.conversation_id in choice.renamed:
            self.conversation_title = choice.renamed[self.conversation_id]
        if self.conversation_id in choice.deleted:
            await self.start_over()
            self.note("This conversation was deleted; a new one starts here.", "info")
        if choice.action == "open" and choice.conversation_id is not None:
            await self.open_conversation(choice.conversation_id)
        elif choice.action == "new":
            await self.start_over()
            self.note("New conversation.", "info")
        self.set_status()

    def action_toggle_stats(self) -> None:
        side = self.query_one(StatsPanel)
        side.display = not side.display

    # --- helpers --------------------------------------------------------------------

    def note(self, text: str, kind: str, title: str | None = None) -> Note:
        note = Note(text, kind, title)
        self.query_one("#log").mount(note)
        self.scroll_log()
        return note

    def scroll_log(self) -> None:
        self.query_one("#log").scroll_end(animate=False)

    def set_status(self, activity: str | None = None) -> None:
        s, pair = self.settings, self.pair
        parts = []
        if pair is not None:
            parts += [model_names(pair), pair.target.model_type, pair.quantization]
            if pair.drafter is None:
                parts.append("no drafter")
            elif s.speculative:
                parts.append(f"{pair.drafter.kind} block {s.block_size or 'auto'}")
            else:
                parts.append("spec off")
            parts.append("greedy" if s.temperature == 0 else f"temp {s.temperature:g}")
            if self.conversation.reasoning_supported:
                parts.append(f"reasoning {s.reasoning}")
            if s.system:
                parts.append("system prompt set")
        if self.saves is not None and self.saves.delayed:
            parts.append("saving delayed (database busy)")
        if activity is None and self.busy:
            activity = "generating… (esc cancels)"
        elif activity is None and pair is None:
            activity = "no model loaded"
        if activity:
            parts.append(activity)
        self.query_one("#status", Static).update(" · ".join(parts))


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
