"""The conversation list (ctrl+o or /chats): open, rename, delete, new.

Rename and delete act on the store right away; opening a conversation or
starting a new one closes the list and hands a `Choice` to the chat screen.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, OptionList, Static
from textual.widgets.option_list import Option

from ..store import ConversationInfo, Store, StoreError, when

HINT = "enter open · n new · r rename · d delete · esc close"


@dataclass
class Choice:
    action: str  # "open", "new" or "close"
    conversation_id: int | None = None
    deleted: set[int] = field(default_factory=set)
    renamed: dict[int, str] = field(default_factory=dict)
    error: str | None = None  # the store failed: history goes off


def option_label(c: ConversationInfo, now: float, current: int | None) -> str:
    mark = "●" if c.id == current else " "
    turns = f"{c.turns} turn" + ("" if c.turns == 1 else "s")
    return f"{mark} {c.title}  ·  {when(c.updated, now)} · {turns} · {c.model or c.bundle or '?'}"


class ConversationList(ModalScreen[Choice]):
    BINDINGS = [
        Binding("escape", "close", "close"),
        Binding("n", "new", "new"),
        Binding("r", "rename", "rename"),
        Binding("d", "delete", "delete"),
    ]

    def __init__(self, store: Store, current: int | None):
        super().__init__()
        self.store = store
        self.current = current
        self.items: list[ConversationInfo] = []
        self.choice = Choice("close")
        self.pending_delete: int | None = None

    def compose(self) -> ComposeResult:
        with Vertical(id="chats-box"):
            yield OptionList(id="chats")
            yield Input(id="chats-rename", placeholder="new title (enter saves, esc cancels)")
            yield Static(HINT, id="chats-hint", markup=False)

    def on_mount(self) -> None:
        self.query_one("#chats-box").border_title = "conversations"
        self.refresh_list()
        self.query_one(OptionList).focus()

    def refresh_list(self, highlight: int | None = None) -> None:
        try:
            self.items = self.store.list()
        except StoreError as e:
            self.choice.error = str(e)
            self.dismiss(self.choice)
            return
        options = self.query_one(OptionList)
        now = time.time()
        options.clear_options()
        options.add_options([Option(option_label(c, now, self.current), id=str(c.id)) for c in self.items])
        if not self.items:
            self.hint("no saved conversations yet · n new · esc close")
        elif highlight is not None:
            options.highlighted = min(highlight, len(self.items) - 1)
        else:
            ids = [c.id for c in self.items]
            options.highlighted = ids.index(self.current) if self.current in ids else 0

    def hint(self, text: str = HINT) -> None:
        self.query_one("#chats-hint", Static).update(text)

    def selected(self) -> ConversationInfo | None:
        index = self.query_one(OptionList).highlighted
        return self.items[index] if index is not None and 0 <= index < len(self.items) else None

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.choice.action, self.choice.conversation_id = "open", int(event.option.id)
        self.dismiss(self.choice)

    def on_key(self, event) -> None:
        if event.key != "d" and self.pending_delete is not None:
            self.pending_delete = None
            self.hint()

    def action_close(self) -> None:
        rename = self.query_one("#chats-rename", Input)
        if rename.has_class("-visible"):
            rename.remove_class("-visible")
            self.query_one(OptionList).focus()
            self.hint()
            return
        self.dismiss(self.choice)

    def action_new(self) -> None:
        if self.focused is self.query_one("#chats-rename"):
            return
        self.choice.action = "new"
        self.dismiss(self.choice)

    def action_rename(self) -> None:
        c = self.selected()
        rename = self.query_one("#chats-rename", Input)
        if c is None or self.focused is rename:
            return
        rename.value = c.title
        rename.add_class("-visible")
        rename.focus()
        self.hint(f"rename #{c.id}: enter saves, esc cancels")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        c = self.selected()
        title = event.value.strip()
        event.input.remove_class("-visible")
        self.query_one(OptionList).focus()
        self.hint()
        if c is None or not title:
            return
        try:
            self.store.rename(c.id, title)
        except StoreError as e:
            self.choice.error = str(e)
            self.dismiss(self.choice)
            return
        self.choice.renamed[c.id] = title
        self.refresh_list(highlight=self.query_one(OptionList).highlighted)

    def action_delete(self) -> None:
        c = self.selected()
        if c is None or self.focused is self.query_one("#chats-rename"):
            return
        if self.pending_delete != c.id:
            self.pending_delete = c.id
            self.hint(f"press d again to delete “{c.title}” ({c.turns} turns); any other key keeps it")
            return
        self.pending_delete = None
        try:
            self.store.delete(c.id)
        except StoreError as e:
            self.choice.error = str(e)
            self.dismiss(self.choice)
            return
        self.choice.deleted.add(c.id)
        self.hint(f"deleted “{c.title}”")
        self.refresh_list(highlight=self.query_one(OptionList).highlighted)
