"""How to generate, as one value: what `generate`, `chat` and `serve` build and `stream_generate` takes.

    settings = GenerationSettings(SamplingParams(temperature=0.7, top_p=0.9), max_tokens=128, seed=1)
    mlx_glimmer.generate(pair, "Hello", settings)

Everything is checked when the value is made (sampling by `SamplingParams`),
so every caller accepts and refuses the same things. This module imports no
MLX: the command line checks its flags with it before anything heavy loads.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace

from .errors import GlimmerError

AUTO = "auto"  # a verify width chosen every round (`block_policy.py`)
OFF = "off"  # `tree`: chains only
MAX_TREE_NODES = 63  # most draft-tree nodes under the anchor (`--tree N`): 64 tokens verified at most
SEED_BITS = 63  # seeds are integers in [0, 2**63): what MLX's and torch's generators both take
SEED_LIMIT = 2**SEED_BITS
SEED_RULE = f"must be a whole number in [0, 2**{SEED_BITS})"
MAX_DRAFT_K = 16  # most tokens a draft model or prompt lookup proposes per round (`--draft-k`, `load(draft_k=)`)
MAX_LOGPROBS = 20  # most alternatives reported per token (`logprobs`), as OpenAI's `top_logprobs` allows


class SamplingError(GlimmerError, ValueError):
    """A generation setting out of range. `field` names it as the API does; `rule` says what it must be,
    so a command line or a chat command can name its own flag (`named`)."""

    def __init__(self, field: str, rule: str, value):
        self.field, self.rule, self.value = field, rule, value
        super().__init__(self.named(field))

    def named(self, name: str) -> str:
        got = repr(self.value) if isinstance(self.value, str) else self.value
        return f"{name} {self.rule}, got {got}"


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Temperature (0 = greedy), top-p and top-k; the one place they are checked (`SamplingError`): finite
    numbers only (no NaN, no infinity), top-k a whole number."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if not (_number(self.temperature) and self.temperature >= 0):
            raise SamplingError("temperature", "must be a number >= 0", self.temperature)
        if not (_number(self.top_p) and 0 < self.top_p <= 1):
            raise SamplingError("top_p", "must be in (0, 1]", self.top_p)
        if not (_whole(self.top_k) and self.top_k >= 0):
            raise SamplingError("top_k", "must be a whole number >= 0", self.top_k)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class GenerationSettings:
    """`sampling`: temperature (0 = greedy), top-p, top-k. `max_tokens`: at least 1. `block_size`: the verify
    width (drafted tokens + the anchor): "auto" chooses it every round from measured verify cost and live
    acceptance, up to the drafter's block size (`block_policy.py`); an int fixes it, and one wider than the
    drafter can fill is capped at that. `tree`: draft trees (`tree.py`) from a block drafter's per-position
    distributions, merged with n-gram matches from the context: "auto" lets the width policy choose a chain or a
    tree budget each round (when `block_size` is "auto" too; a fixed `block_size` verifies chains of that
    width); N (1..MAX_TREE_NODES) verifies N nodes under the anchor every round (N + 1 tokens); "off" verifies
    chains only. `speculative=False` decodes with the target alone (the baseline). `seed` seeds sampling: an
    integer in [0, SEED_LIMIT). `logprobs`: None (the default) computes no log-probabilities; K (0..MAX_LOGPROBS)
    gives every generated token its log-probability under the target's own distribution (the log-softmax of its
    logits, before temperature, top-k and top-p) and the K likeliest tokens there, with theirs
    (`logprobs.TokenLogprob`). They come from the verify pass that committed the token, never from the drafter,
    and cost no extra host read."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 256
    block_size: int | str = AUTO
    speculative: bool = True
    seed: int = 0
    tree: int | str = AUTO
    logprobs: int | None = None

    def __post_init__(self):
        b = self.block_size
        if b != AUTO and not (_whole(b) and b >= 1):
            raise SamplingError("block_size", "must be 'auto' or a whole number >= 1", b)
        t = self.tree
        if t not in (AUTO, OFF) and not (_whole(t) and 1 <= t <= MAX_TREE_NODES):
            raise SamplingError("tree", f"must be 'auto', 'off' or a whole number in [1, {MAX_TREE_NODES}]", t)
        if not (_whole(self.max_tokens) and self.max_tokens >= 1):
            raise SamplingError("max_tokens", "must be a whole number >= 1", self.max_tokens)
        if not (_whole(self.seed) and 0 <= self.seed < SEED_LIMIT):
            raise SamplingError("seed", SEED_RULE, self.seed)
        if self.logprobs is not None and not (_whole(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise SamplingError("logprobs", f"must be None or a whole number in [0, {MAX_LOGPROBS}]", self.logprobs)
        if not isinstance(self.speculative, bool):
            raise SamplingError("speculative", "must be true or false", self.speculative)
        if not isinstance(self.sampling, SamplingParams):
            raise GlimmerError(f"sampling must be a SamplingParams, got {type(self.sampling).__name__}")

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

    def flat(self) -> dict:
        """The flat keywords of `of` that make this value."""
        rest = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "sampling"}
        return {**asdict(self.sampling), **rest}

    @property
    def auto(self) -> bool:
        return self.block_size == AUTO


@dataclass(frozen=True)
class BatchSettings:
    """How a server decodes concurrent requests (`server/batch.py`): `max_batch` is the most it decodes
    together, one target forward per step for all of them, when measured throughput says that pays (1: never;
    requests are served one after another). A lone request always decodes as its own settings say."""

    max_batch: int = 8

    def __post_init__(self):
        if not (_whole(self.max_batch) and self.max_batch >= 1):
            raise SamplingError("max_batch", "must be a whole number >= 1", self.max_batch)


def check_draft_k(draft_k) -> None:
    """`draft_k` (tokens a draft model or prompt lookup proposes per round): None (the drafter's default) or a
    whole number in [1, MAX_DRAFT_K]. Bounded so the verify widths `auto` measures stay few."""
    if draft_k is not None and not (_whole(draft_k) and 1 <= draft_k <= MAX_DRAFT_K):
        raise SamplingError("draft_k", f"must be a whole number in [1, {MAX_DRAFT_K}]", draft_k)
