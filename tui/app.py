"""`mlx-glimmer chat`: the Textual app.

All MLX work (loading, every turn) runs on one `MLXThread`; it reports back
with messages, so the UI thread only ever reads snapshots.
"""

from __future__ import annotations

import os
import threading
from typing import Callable

from textual import on
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.message import Message
from textual.widgets import Footer, Header, Select, Static

from mlx_glimmer import DecodeState, GenerationStats, GlimmerError

from .commands import CommandError, help_text, is_command, parse_command, prompt_text
from .session import Conversation, Settings, Turn, run_turn, supports_reasoning
from .stats import prefill_line, stats_rows
from .transcript import save_transcript
from .widgets import AssistantMessage, Note, PromptInput, StatsPanel
from .worker import MLXThread

LOAD_HINT = "Quit (ctrl+q) and start with a bundle: `mlx-glimmer chat BUNDLE`. /help still works."

KEYS_HELP = (
    "keys: enter send · ctrl+j new line · ↑/↓ history · esc or ctrl+c cancel · ctrl+l clear · "
    "f2 stats panel · ctrl+q quit\n//text sends a message that starts with /"
)


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


class Finished(Message):
    def __init__(self, turn: Turn):
        super().__init__()
        self.turn = turn


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
    CSS = """
    #body { height: 1fr; }
    #log { width: 1fr; padding: 0 1; }
    #side { width: 42; border: round $primary-darken-1; padding: 0 1; }
    #side Label { margin-top: 1; color: $text-muted; }
    #rounds { height: 3; color: $success; }
    #histogram { margin-top: 1; }
    #reasoning { width: 100%; }
    .note { margin: 1 0 0 0; padding: 0 1; }
    .user { border: round $accent; }
    .info { color: $text-muted; }
    .error { color: $error; border: round $error; }
    .assistant { height: auto; margin: 1 0 0 0; border: round $success; padding: 0 1; }
    .assistant Collapsible { display: none; margin: 0; padding: 0; border: none; }
    .assistant.-reasoning Collapsible { display: block; }
    .assistant .reasoning-text { color: $text-muted; }
    .assistant Markdown { margin: 0; padding: 0; }
    .summary { color: $text-muted; }
    #prompt { height: auto; min-height: 3; max-height: 10; border: round $primary; }
    #status { height: 1; background: $panel; color: $text; padding: 0 1; }
    """
    BINDINGS = [
        Binding("escape", "cancel", "cancel"),
        Binding("ctrl+c", "interrupt", "cancel", show=False, priority=True),
        Binding("ctrl+l", "clear", "clear"),
        Binding("f2", "toggle_stats", "stats"),
        Binding("ctrl+q", "quit", "quit", priority=True),
    ]

    def __init__(self, load: Callable[[], object], settings: Settings | None = None, source: str = "the model"):
        super().__init__()
        self._load = load
        self.source = source
        self.conversation = Conversation(settings or Settings())
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

    def on_mount(self) -> None:
        self.query_one(PromptInput).focus()
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

    def _turn_job(self, messages: list[dict], kwargs: dict, cancel: threading.Event) -> None:
        try:
            turn = run_turn(
                self.pair,
                messages,
                state=self.state,
                cancel=cancel,
                on_progress=lambda text, stats: self.post_message(Progress(text, stats)),
                **kwargs,
            )
        except Exception as e:
            self.state = DecodeState()  # the caches may be half updated
            self.post_message(Failed(describe_error(e), loading=False))
        else:
            self.post_message(Finished(turn))

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
            self.query_one("#reasoning", Select).value = self.settings.reasoning
        if self.settings.speculative and self.pair.drafter is None:
            self.settings.speculative = False
        self.note(f"Loaded {model_names(self.pair)}. Type a message; /help lists the commands.", "info")
        self.set_status()

    def on_failed(self, message: Failed) -> None:
        self.busy = False
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

    def on_progress(self, message: Progress) -> None:
        if self.current is not None:
            self.current.stream(message.text)
            self.query_one(StatsPanel).show(message.stats)
            self.scroll_log()

    async def on_finished(self, message: Finished) -> None:
        turn = message.turn
        self.conversation.turns.append(turn)
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
            wait = "the model is still loading" if self.pair is None else "press Esc to cancel the answer first"
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
        self.mlx.submit(lambda: self._turn_job(messages, kwargs, cancel))

    async def run_command(self, line: str) -> None:
        cmd = parse_command(line)
        if self.busy and cmd.name not in ("help", "stats"):
            raise CommandError(f"/{cmd.name} has to wait until the answer is done (esc cancels it)")
        s = self.settings
        if cmd.name == "help":
            self.note(f"{help_text()}\n\n{KEYS_HELP}", "info")
        elif cmd.name == "clear":
            await self.action_clear()
        elif cmd.name == "system":
            s.system = cmd.value
            self.note(f"System prompt set: {cmd.value}" if cmd.value else "System prompt removed.", "info")
        elif cmd.name == "temp":
            s.temperature = cmd.value
            self.note(f"Temperature {cmd.value:g}" + (" (greedy)." if cmd.value == 0 else "."), "info")
        elif cmd.name == "block":
            if self.pair is not None and self.pair.drafter is None:
                raise CommandError("this model has no drafter; the block size does not apply")
            s.block_size = cmd.value
            self.note(f"Block size {cmd.value}.", "info")
        elif cmd.name == "spec":
            if cmd.value and self.pair is not None and self.pair.drafter is None:
                raise CommandError("this model has no drafter; speculative decoding needs one")
            s.speculative = cmd.value
            self.note(f"Speculative decoding {'on' if cmd.value else 'off'}.", "info")
        elif cmd.name == "reasoning":
            if not self.conversation.reasoning_supported:
                raise CommandError("this model's chat template has no reasoning strength")
            s.reasoning = cmd.value
            self.query_one("#reasoning", Select).value = cmd.value
            self.note(f"Reasoning strength {cmd.value}.", "info")
        elif cmd.name == "save":
            model = model_names(self.pair) if self.pair is not None else self.source
            try:
                md, js = save_transcript(cmd.value, self.conversation.turns, model=model, settings=s)
            except (OSError, ValueError) as e:
                raise CommandError(f"/save failed: {e}") from None
            self.note(f"Saved {md} and {js}.", "info")
        elif cmd.name == "stats":
            self.note(self.stats_text(), "info")
        self.set_status()

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
        self.settings.reasoning = str(event.value)
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
        self.conversation.turns.clear()
        self.state = DecodeState()
        self.last_stats = None
        await self.query_one("#log").remove_children()
        self.query_one(StatsPanel).show(None)
        self.note("Conversation cleared.", "info")

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
                parts.append(f"{pair.drafter.kind} block {s.block_size or pair.drafter.block_size}")
            else:
                parts.append("spec off")
            parts.append("greedy" if s.temperature == 0 else f"temp {s.temperature:g}")
            if self.conversation.reasoning_supported:
                parts.append(f"reasoning {s.reasoning}")
            if s.system:
                parts.append("system prompt set")
        if activity is None and self.busy:
            activity = "generating… (esc cancels)"
        elif activity is None and pair is None:
            activity = "no model loaded"
        if activity:
            parts.append(activity)
        self.query_one("#status", Static).update(" · ".join(parts))


def run(load: Callable[[], object], settings: Settings, source: str, exit_wait_s: float = 3.0) -> int:
    """Run the app in this terminal; returns the exit code."""
    app = ChatApp(load, settings, source)
    app.run()
    # A cancelled turn stops within one round. A model still loading cannot be
    # stopped, and MLX aborts if the interpreter exits under a running thread.
    if not app.mlx.close(timeout=exit_wait_s):
        os._exit(app.return_code or 0)
    return app.return_code or 0
