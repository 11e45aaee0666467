"""A chat's settings (`Settings`), apart from the session that runs turns, so the command line checks
`chat`'s flags with them before MLX loads."""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass

from ..chat_template import DEFAULT_REASONING, REASONING_LEVELS
from ..errors import GlimmerError
from ..settings import GenerationSettings


@dataclass(frozen=True)
class Settings:
    """A chat's settings as the user sets them (flags, slash commands) and its history stores them (flat JSON).

    The generation part becomes one `GenerationSettings` per turn (`generation`), which checks it: a
    `Settings` that could not generate is never made."""

    max_tokens: int = 1024
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None  # None: a fresh seed every turn; a number: the same seed (and answer) every time
    block_size: int | None = None  # None: auto, chosen every round
    speculative: bool = True
    system: str | None = None
    reasoning: str = DEFAULT_REASONING

    def __post_init__(self):
        self.generation(seed=0)
        if self.reasoning not in REASONING_LEVELS:
            raise GlimmerError(f"reasoning must be one of {', '.join(REASONING_LEVELS)}, got {self.reasoning!r}")

    def generation(self, seed: int | None = None) -> GenerationSettings:
        """This turn's `GenerationSettings`; `seed` is used when the chat has none of its own."""
        return GenerationSettings.of(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_tokens=self.max_tokens,
            block_size=self.block_size,
            speculative=self.speculative,
            seed=self.seed if self.seed is not None else (seed if seed is not None else secrets.randbelow(2**31)),
        )

    def with_changes(self, **changes) -> Settings:
        return dataclasses.replace(self, **changes)


DEFAULT_CHAT = Settings()
