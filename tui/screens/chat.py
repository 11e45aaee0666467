"""The chat screen: the conversation, the stats panel, the prompt and the status line.

It turns what the user does (a prompt, a slash command, a key) into jobs for the MLX thread and writes
for the history, both held by the app (`ChatApp.jobs`, `ChatApp.chat_history`), and shows what comes
back: the answer as it streams, its statistics, notes.
"""

from __future__ import annotations

import time

from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Header, Select, Static

from mlx_glimmer.chat_template import supports_reasoning

from ..chat_history import SavesChanged
from ..commands import CommandError, is_command, prompt_text, run_command
from ..jobs import Failed, Finished, Loaded, Measuring, Progress, Rebuilt
from ..session import Settings, Turn
from ..stats import last_stats
from ..status import model_names, status_line
from ..store import StoreError
from ..widgets import AssistantMessage, Note, PromptInput, StatsPanel
from .conversations import Choice, ConversationList

LOAD_HINT = "Quit (ctrl+q) and start with a bundle: `mlx-glimmer chat BUNDLE`. /help still works."


class ChatScreen(Screen):
    """The app's one main screen; `self.app` is the `ChatApp`, which holds the conversation."""

    # The UI thread and the MLX thread share the GIL: every update drawn is time the
    # decoder waits. The pacer keeps the UI's share small (benchmarks/chat_stream_speed.py
    # measures the app against `generate`); the stats panel updates once a second and
    # the prompt's cursor stops blinking while an answer streams.
    STATS_INTERVAL = 1.0

    def __init__(self):
        super().__init__()
        self.current: AssistantMessage | None = None  # the answer streaming in
        self._stats_shown = 0.0  # when the stats panel was last updated while streaming

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="body"):
            yield VerticalScroll(id="log")
            yield StatsPanel(id="side")
        yield PromptInput(id="prompt", placeholder="Message (enter sends, ctrl+j new line, /help)")
        yield Static("", id="status", markup=False)
        yield Footer()

    async def on_mount(self) -> None:
        app = self.app
        self.query_one(PromptInput).focus()
        if app.store_warning:
            self.note(app.store_warning, "error")
        if app.resume is not None:
            await self.open_conversation(app.resume)
        self.note(f"Loading {app.source}…", "info")
        self.set_status(f"loading {app.source}…")
        app.jobs.load(app.load_pair, app.settings.generation)

    # --- what the MLX thread and the save queue report ---------------------------------

    def on_measuring(self, message: Measuring) -> None:
        text = message.text[0].upper() + message.text[1:]
        self.note(text + "…", "info")
        self.set_status(message.text + "…")

    def on_loaded(self, message: Loaded) -> None:
        app, jobs, history = self.app, self.app.jobs, self.app.chat_history
        jobs.pair = pair = message.pair
        jobs.busy = False
        app.sub_title = model_names(pair)
        supported = supports_reasoning(pair.tokenizer)
        app.conversation.reasoning_supported = supported
        self.query_one(StatsPanel).show_reasoning(supported)
        if supported:
            self.show_reasoning_level()
        app.no_drafter_no_spec()
        self.note(f"Loaded {model_names(pair)}. Type a message; /help lists the commands.", "info")
        self.set_status()
        if history.processed and history.stored_bundle not in (None, app.bundle_name()):
            self.note(
                f"This conversation last ran on {history.stored_bundle}; the next turn prefills it whole.", "info"
            )
            history.processed = []
        if history.processed:
            self.start_rebuild()
        elif app.first_message is not None:
            self.ask(app.first_message)
            app.first_message = None

    def on_failed(self, message: Failed) -> None:
        self.app.jobs.busy = False
        self.query_one(PromptInput).cursor_blink = True
        if message.loading:
            self.note(f"Could not load {self.app.source}: {message.text}\n{LOAD_HINT}", "error", "error")
            self.set_status("no model loaded")
            return
        if self.current is not None:
            self.current.remove()
            self.current = None
        text = f"Generation failed: {message.text}\nThe conversation is kept; the cache starts over."
        self.note(text, "error", "error")
        self.set_status()

    async def on_progress(self, message: Progress) -> None:
        self.app.jobs.progress_shown()
        if self.current is not None:
            await self.current.stream(message.text)
            now = time.monotonic()
            if now - self._stats_shown >= self.STATS_INTERVAL:
                self.query_one(StatsPanel).show(message.stats)
                self._stats_shown = now
            self.scroll_log()

    async def on_finished(self, message: Finished) -> None:
        app = self.app
        self.query_one(PromptInput).cursor_blink = True
        turn = message.turn
        app.conversation.turns.append(turn)
        app.save_turn(message.done)
        self.query_one(StatsPanel).show(turn.stats)
        if self.current is not None:
            await self.current.finish(turn)
            self.current = None
        app.jobs.busy = False
        self.set_status()
        self.scroll_log()

    def on_rebuilt(self, message: Rebuilt) -> None:
        app = self.app
        app.jobs.busy = False
        if message.error:
            self.note(f"Could not rebuild the cache ({message.error}); the next turn prefills the whole chat.", "error")
        else:
            self.note(f"Cache rebuilt: {message.tokens} tokens in {message.seconds:.1f} s.", "info")
        self.set_status()
        if app.first_message is not None:
            self.ask(app.first_message)
            app.first_message = None

    def on_saves_changed(self, message: SavesChanged) -> None:
        history = self.app.chat_history
        if history.saves is None:
            return
        if history.saves.failed is not None:
            self.history_off(history.saves.failed)
            return
        news = history.delay_news()
        if news:
            self.note(news, "info")
        if not self.app.busy:
            self.set_status()

    # --- input -------------------------------------------------------------------------------

    @on(PromptInput.Submitted)
    async def submitted(self, event: PromptInput.Submitted) -> None:
        line = event.text
        if is_command(line):
            try:
                await self.run_command(line)
            except CommandError as e:
                self.note(str(e), "error")
            return
        jobs = self.app.jobs
        if jobs.busy:
            wait = (
                "the model is still loading"
                if jobs.pair is None
                else "the cache is being rebuilt"
                if self.current is None
                else "press Esc to cancel the answer first"
            )
            self.note(f"Still busy; {wait}.", "error")
            return
        if jobs.pair is None:
            self.note("No model loaded (see the error above).", "error")
            return
        self.ask(prompt_text(line))

    def ask(self, text: str) -> None:
        conversation = self.app.conversation
        messages = conversation.messages(text)
        kwargs = conversation.generation_kwargs()
        self.note(text, "user", "you")
        self.current = AssistantMessage()
        self.query_one("#log").mount(self.current)
        self.scroll_log()
        self.set_status("generating… (esc cancels)")
        self.query_one(PromptInput).cursor_blink = False
        self.app.jobs.turn(messages, kwargs, conversation.settings)  # frozen: the turn keeps what it ran with

    async def run_command(self, line: str) -> None:
        spec = await run_command(self.app, line)
        if spec.persists:
            self.app.save_settings()
        self.set_status()

    @on(Select.Changed, "#reasoning")
    def reasoning_changed(self, event: Select.Changed) -> None:
        app = self.app
        if event.value in (None, Select.BLANK) or event.value == app.settings.reasoning:
            return
        app.update_settings(reasoning=str(event.value))
        app.save_settings()
        self.set_status()

    def show_reasoning_level(self) -> None:
        self.query_one("#reasoning", Select).value = self.app.settings.reasoning

    # --- what the app's keys do --------------------------------------------------------------

    def cancel_answer(self) -> None:
        if self.app.busy and self.current is not None and self.app.jobs.cancel():
            self.set_status("cancelling…")

    def interrupt(self) -> None:
        prompt = self.query_one(PromptInput)
        if self.app.busy and self.current is not None:
            self.cancel_answer()
        elif self.focused is prompt and prompt.selected_text:
            prompt.action_copy()
        else:
            self.notify("Press ctrl+q to quit.", timeout=3)

    async def clear_conversation(self) -> None:
        if self.app.busy:
            self.note("Still busy; press Esc to cancel the answer first.", "error")
            return
        await self.start_over()
        stays = " The old one stays in the list (ctrl+o)." if self.app.store else ""
        self.note("Conversation cleared." + stays, "info")

    def show_conversations(self) -> None:
        app = self.app
        if app.store is None:
            self.note("No history: started with --no-history, or the database could not be used.", "error")
            return
        if app.busy:
            self.note("Still busy; wait for the answer (esc cancels it) before switching conversations.", "error")
            return
        app.push_screen(ConversationList(app.store, app.conversation_id), self.chosen)

    def toggle_stats(self) -> None:
        side = self.query_one(StatsPanel)
        side.display = not side.display

    # --- conversations -------------------------------------------------------------------------

    async def start_over(self, settings: Settings | None = None) -> None:
        """An empty conversation (not stored until its first turn) and an empty cache."""
        app = self.app
        app.conversation.turns.clear()
        if settings is not None:
            app.conversation.settings = settings
        app.chat_history.start_over()
        app.jobs.forget()
        await self.query_one("#log").remove_children()
        self.query_one(StatsPanel).show(None)

    async def chosen(self, choice: Choice | None) -> None:
        """What the conversation list closed with."""
        if choice is None:
            return
        history = self.app.chat_history
        if choice.error:
            self.history_off(choice.error)
            return
        if history.conversation_id in choice.renamed:
            history.title = choice.renamed[history.conversation_id]
        if history.conversation_id in choice.deleted:
            await self.start_over()
            self.note("This conversation was deleted; a new one starts here.", "info")
        if choice.action == "open" and choice.conversation_id is not None:
            await self.open_conversation(choice.conversation_id)
        elif choice.action == "new":
            await self.start_over()
            self.note("New conversation.", "info")
        self.set_status()

    async def open_conversation(self, conversation_id: int) -> bool:
        """Show a stored conversation, restore its settings, and (once a model is loaded) rebuild its cache."""
        app, history = self.app, self.app.chat_history
        try:
            stored = history.load(conversation_id)
        except StoreError as e:
            self.history_off(str(e))
            return False
        if stored is None:
            self.note(f"No conversation {conversation_id}.", "error")
            return False
        settings = stored.settings
        if conversation_id == app.resume:
            settings = settings.with_changes(**app.overrides)
        await self.start_over(settings)
        app.conversation.turns.extend(stored.turns)
        history.opened(stored)
        await self.show_turns(stored.turns)
        self.query_one(StatsPanel).show(last_stats(stored.turns))
        info = stored.info
        ran_elsewhere = info.model and app.pair is not None and info.model != app.model_name()
        where = f" (it ran on {info.model})" if ran_elsewhere else ""
        self.note(f"Resumed “{info.title}” (#{info.id}, {len(stored.turns)} turns){where}.", "info")
        if stored.unreadable:
            self.note(f"Could not read {'; '.join(stored.unreadable)}.", "error")
        if app.pair is not None:
            app.no_drafter_no_spec()
            if app.conversation.reasoning_supported:
                self.show_reasoning_level()
        if history.resume_cache(stored, app.bundle_name()) and app.pair is not None:
            self.start_rebuild()
        self.set_status()
        self.scroll_log()
        return True

    async def show_turns(self, turns: list[Turn]) -> None:
        log = self.query_one("#log")
        for turn in turns:
            self.note(turn.user, "user", "you")
            message = AssistantMessage()
            await log.mount(message)
            await message.finish(turn)

    def start_rebuild(self) -> None:
        """Prefill the stored cache contents on the MLX thread, so the next turn reuses them."""
        app = self.app
        app.no_drafter_no_spec()
        processed = app.chat_history.processed
        app.jobs.rebuild(processed, app.settings)
        self.set_status(f"rebuilding the cache ({len(processed)} tokens)…")

    def history_off(self, why: str) -> None:
        self.note(f"history off: {why}", "error")
        self.app.chat_history.off()

    # --- the log and the status line ---------------------------------------------------------------

    def note(self, text: str, kind: str, title: str | None = None) -> Note:
        note = Note(text, kind, title)
        self.query_one("#log").mount(note)
        self.scroll_log()
        return note

    def scroll_log(self) -> None:
        self.query_one("#log").scroll_end(animate=False)

    def set_status(self, activity: str | None = None) -> None:
        app = self.app
        line = status_line(
            app.settings,
            app.pair,
            reasoning_supported=app.conversation.reasoning_supported,
            saving_delayed=app.chat_history.delayed,
            busy=app.busy,
            activity=activity,
        )
        self.query_one("#status", Static).update(line)
