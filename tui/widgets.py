"""The app's widgets: prompt input, conversation messages, stats panel."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Collapsible, Label, Markdown, Select, Static, TextArea

from mlx_glimmer.channels import split_channels
from mlx_glimmer.chat_template import DEFAULT_REASONING, REASONING_LEVELS
from mlx_glimmer.generate import GenerationStats

from .history import InputHistory
from .session import Turn
from .stats import histogram, prefill_line, sparkline, stats_rows, turn_summary

SPARKLINE_WIDTH = 36


class PromptInput(TextArea):
    """Multi-line input: enter sends, ctrl+j adds a line, up/down at the edges walk the history."""

    BINDINGS = [
        Binding("enter", "submit", "send"),
        Binding("ctrl+j,shift+enter", "newline", "newline"),
        Binding("up", "history_back", "history", show=False),
        Binding("down", "history_forward", "history", show=False),
    ]

    class Submitted(Message):
        def __init__(self, text: str):
            super().__init__()
            self.text = text

    def __init__(self, **kwargs):
        super().__init__(soft_wrap=True, show_line_numbers=False, compact=True, **kwargs)
        self.recall = InputHistory()

    async def _on_key(self, event) -> None:
        # TextArea inserts a newline on enter before any binding runs, and a
        # binding runs only after the keys typed behind it: act here, in order.
        actions = {"enter": self.action_submit, "ctrl+j": self.action_newline, "shift+enter": self.action_newline}
        if event.key in actions:
            event.stop()
            event.prevent_default()
            actions[event.key]()
            return
        await super()._on_key(event)

    def action_submit(self) -> None:
        text = self.text.strip("\n")
        if not text.strip():
            return
        self.recall.add(text)
        self.load_text("")
        self.post_message(self.Submitted(text))

    def action_newline(self) -> None:
        start, end = self.selection
        self.replace("\n", start, end, maintain_selection_offset=False)

    def _recall(self, entry: str | None) -> None:
        if entry is not None:
            self.load_text(entry)
            self.move_cursor(self.document.end)

    def action_history_back(self) -> None:
        if self.cursor_location[0] == 0:
            self._recall(self.recall.back(self.text))
        else:
            self.action_cursor_up()

    def action_history_forward(self) -> None:
        if self.cursor_location[0] == self.document.line_count - 1:
            self._recall(self.recall.forward())
        else:
            self.action_cursor_down()


class Note(Static):
    """A user message, or an inline note from the app (info, error)."""

    def __init__(self, text: str, kind: str, title: str | None = None):
        super().__init__(text, markup=False, classes=f"note {kind}")
        if title:
            self.border_title = title


class AssistantMessage(Vertical):
    """Reasoning (collapsible, above) and the answer, streamed into Markdown as it grows.

    Only the text appended since the last update is handed to Textual's
    `MarkdownStream`, which re-parses from the last block: a long answer costs
    the same per update as a short one (re-rendering it whole per token is O(n^2)).
    """

    def __init__(self):
        super().__init__(classes="assistant")
        self.border_title = "assistant"
        self._shown = ""  # the answer text handed to the Markdown so far
        self._reasoning: list[str] = []
        self._stream = None
        self._finished = False

    def compose(self) -> ComposeResult:
        # Kept by reference: Collapsible mounts its contents later than itself.
        self.reasoning_text = Static("", markup=False, classes="reasoning-text")
        yield Collapsible(self.reasoning_text, title="reasoning", collapsed=False)
        yield Markdown("", classes="answer")
        yield Static("", markup=False, classes="summary")

    def _show_reasoning(self, blocks: list[str]) -> None:
        if blocks == self._reasoning:
            return
        self._reasoning = blocks
        self.set_class(bool(blocks), "-reasoning")
        self.reasoning_text.update("\n\n".join(blocks))

    @property
    def streamed(self) -> str:
        """The answer text shown so far."""
        return self._shown

    async def stream(self, text: str) -> None:
        """Show the answer so far (`text` is the whole raw output up to now)."""
        if self._finished:
            return
        ch = split_channels(text, final=False)
        self._show_reasoning(ch.reasoning)
        answer = ("".join(t for k, t in ch.blocks if k == "answer") if ch.framed else text).lstrip()
        markdown = self.query_one(Markdown)
        if not answer.startswith(self._shown):  # rare: a marker turned out not to be one
            self._shown = ""
            await self._stop()
            await markdown.update("")
        delta = answer[len(self._shown) :]
        if delta:
            if self._stream is None:
                self._stream = Markdown.get_stream(markdown)
            self._shown = answer
            await self._stream.write(delta)

    async def _stop(self) -> None:
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None

    async def finish(self, turn: Turn) -> None:
        """The answer is complete: render it whole once, collapse the reasoning, add the summary line
        (a stored turn whose statistics could not be read says so)."""
        self._finished = True
        await self._stop()
        ch = split_channels(turn.text)
        self._show_reasoning(ch.reasoning)
        self.query_one(Collapsible).collapsed = True
        await self.query_one(Markdown).update(ch.answer)
        self._shown = ch.answer
        summary = turn_summary(turn.stats) if turn.stats is not None else "stats unavailable"
        self.query_one(".summary", Static).update(summary)

    @property
    def answer_source(self) -> str | None:
        """The Markdown shown for a finished answer (None while streaming)."""
        return self.query_one(Markdown).source if self._finished else None


class StatsPanel(Vertical):
    def compose(self) -> ComposeResult:
        yield Label("reasoning strength", id="reasoning-label")
        yield Select(
            [(r, r) for r in REASONING_LEVELS], allow_blank=False, value=DEFAULT_REASONING, id="reasoning", compact=True
        )
        yield Static("", id="numbers", markup=False)
        yield Label("tokens committed per round")
        yield Static("", id="rounds", markup=False)
        yield Static("", id="histogram", markup=False)

    def on_mount(self) -> None:
        self.border_title = "stats"
        self.show_reasoning(False)
        self.show(None)

    def show_reasoning(self, visible: bool) -> None:
        self.query_one("#reasoning-label").display = visible
        self.query_one("#reasoning").display = visible

    def show(self, stats: GenerationStats | None) -> None:
        rows = stats_rows(stats)
        width = max(len(k) for k, _ in rows)
        lines = [f"{k:<{width}}  {v}" for k, v in rows]
        if stats is not None:
            lines += ["", prefill_line(stats)]
        self.query_one("#numbers", Static).update("\n".join(lines))
        lengths = stats.acceptance_lengths if stats is not None else []
        top = max([stats.block_size if stats is not None else 1, *lengths])
        width = self.query_one("#rounds").size.width or SPARKLINE_WIDTH
        self.query_one("#rounds", Static).update("\n".join(sparkline(lengths, top, width)))
        self.query_one("#histogram", Static).update("\n".join(histogram(lengths)))
