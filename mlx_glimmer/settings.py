"""How to generate, as one value: what `generate`, `chat` and `serve` build and `stream_generate` takes.

    settings = GenerationSettings(SamplingParams(temperature=0.7, top_p=0.9), max_tokens=128, seed=1)
    mlx_glimmer.generate(pair, "Hello", settings)

Everything is checked when the value is made (sampling by `SamplingParams`),
so every caller accepts and refuses the same things.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .errors import GlimmerError
from .sampling import SamplingParams

AUTO = "auto"


@dataclass(frozen=True)
class GenerationSettings:
    """`sampling`: temperature (0 = greedy), top-p, top-k. `block_size`: the verify width (drafted tokens +
    the anchor): "auto" chooses it every round from measured verify cost and live acceptance, up to the
    drafter's block size (`block_policy.py`); an int fixes it. `speculative=False` decodes with the target
    alone (the baseline). `seed` seeds sampling."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 256
    block_size: int | str = AUTO
    speculative: bool = True
    seed: int = 0

    def __post_init__(self):
        if self.block_size is None:
            object.__setattr__(self, "block_size", AUTO)
        b = self.block_size
        if b != AUTO and (isinstance(b, bool) or not isinstance(b, int)):
            raise GlimmerError(f"block_size must be 'auto' or an integer >= 1, got {b!r}")
        if b != AUTO and b < 1:
            raise GlimmerError(f"block_size must be >= 1, got {b}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise GlimmerError(f"max_tokens must be a whole number >= 0, got {self.max_tokens!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise GlimmerError(f"seed must be an integer, got {self.seed!r}")

    @classmethod
    def of(cls, *, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, **rest) -> GenerationSettings:
        """From flat keywords: `temperature`, `top_p`, `top_k` and the fields' own names."""
        return cls(SamplingParams(temperature, top_p, top_k), **rest)

    def updated(self, **changes) -> GenerationSettings:
        """A copy with `changes` (flat keywords as `of`; None leaves a field as it is)."""
        changes = {k: v for k, v in changes.items() if v is not None}
        sampling = {k: changes.pop(k) for k in ("temperature", "top_p", "top_k") if k in changes}
        if sampling:
            changes["sampling"] = replace(self.sampling, **sampling)
        return replace(self, **changes) if changes else self

    @property
    def auto(self) -> bool:
        return self.block_size == AUTO
