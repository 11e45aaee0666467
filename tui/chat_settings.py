"""A chat's settings (`Settings`), apart from the session that runs turns, so the command line checks
`chat`'s flags with them before MLX loads."""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass

from mlx_glimmer.chat_template import DEFAULT_REASONING, REASONING_LEVELS
from mlx_glimmer.errors import GlimmerError
from mlx_glimmer.settings import SEED_LIMIT, GenerationSettings

CHAT_GENERATION = GenerationSettings(max_tokens=1024)


@dataclass(frozen=True)
class Settings:
    """How a chat generates (`generation`) and what is the chat's own: whether each turn draws a fresh seed
    (`fresh_seed`; else every turn uses `generation.seed`, and so repeats its answer), the system prompt and
    the reasoning strength.

    Flags, slash commands and the chat history name the settings flat (`flat`, `with_changes`, `of`):
    `GenerationSettings.of`'s keywords, `seed` (None: a fresh one per turn), `system` and `reasoning`."""

    generation: GenerationSettings = CHAT_GENERATION
    fresh_seed: bool = True
    system: str | None = None
    reasoning: str = DEFAULT_REASONING

    def __post_init__(self):
        if not isinstance(self.generation, GenerationSettings):
            raise GlimmerError(f"generation must be a GenerationSettings, got {type(self.generation).__name__}")
        if self.reasoning not in REASONING_LEVELS:
            raise GlimmerError(f"reasoning must be one of {', '.join(REASONING_LEVELS)}, got {self.reasoning!r}")

    @classmethod
    def of(cls, **flat) -> Settings:
        """The default chat's settings with `flat` changes (as `with_changes`)."""
        return cls().with_changes(**flat)

    def with_changes(self, **flat) -> Settings:
        """A copy with `flat` changes. None leaves a generation setting as it is; `seed=None` draws a fresh seed
        every turn and `system=None` removes the system prompt."""
        own = {name: flat.pop(name) for name in ("system", "reasoning") if name in flat}
        if "seed" in flat:
            own["fresh_seed"] = flat["seed"] is None
            flat["seed"] = 0 if flat["seed"] is None else flat["seed"]
        return dataclasses.replace(self, generation=self.generation.updated(**flat), **own)

    def flat(self) -> dict:
        return {
            **self.generation.flat(),
            "seed": None if self.fresh_seed else self.generation.seed,
            "system": self.system,
            "reasoning": self.reasoning,
        }

    def for_turn(self) -> GenerationSettings:
        """The next turn's `GenerationSettings`: `generation`, with a fresh seed when the chat draws one."""
        if not self.fresh_seed:
            return self.generation
        return dataclasses.replace(self.generation, seed=secrets.randbelow(SEED_LIMIT))


DEFAULT_CHAT = Settings()
