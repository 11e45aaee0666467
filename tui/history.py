"""Up/down recall of earlier inputs, shell style."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class InputHistory:
    entries: list[str] = field(default_factory=list)
    index: int = 0  # == len(entries) while editing a new line
    draft: str = ""  # what was typed before walking back

    def add(self, entry: str) -> None:
        if entry.strip() and (not self.entries or self.entries[-1] != entry):
            self.entries.append(entry)
        self.index, self.draft = len(self.entries), ""

    def back(self, current: str) -> str | None:
        """The previous entry, or None at the oldest one."""
        if self.index == 0:
            return None
        if self.index == len(self.entries):
            self.draft = current
        self.index -= 1
        return self.entries[self.index]

    def forward(self) -> str | None:
        """The next entry (the unsent draft after the newest), or None when editing a new line."""
        if self.index >= len(self.entries):
            return None
        self.index += 1
        return self.entries[self.index] if self.index < len(self.entries) else self.draft
