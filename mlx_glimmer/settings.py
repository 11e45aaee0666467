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
from typing import Any, Mapping

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

    @property
    def fields(self) -> tuple[str, ...]:
        """Every setting at fault (`named` takes a name for each, in this order)."""
        return (self.field,)

    def named(self, name: str) -> str:
        got = repr(self.value) if isinstance(self.value, str) else self.value
        return f"{name} {self.rule}, got {got}"


class SettingsConflict(SamplingError):
    """Two settings, each fine alone, that disagree: `fields` names both (`values` holds theirs) and `rule`
    says what goes together, with {0} and {1} where the two names go, so a command line names its flags and the
    server its fields (`named`)."""

    def __init__(self, fields: tuple[str, str], values: tuple, rule: str):
        self._fields, self.values = fields, values
        super().__init__(fields[0], rule, values[0])

    @property
    def fields(self) -> tuple[str, ...]:
        return self._fields

    def named(self, *names: str) -> str:
        names = names + self._fields[len(names) :]
        both = " and ".join(_shown(n, v) for n, v in zip(names, self.values))
        return f"{both} disagree: {self.rule.format(*names)}"


def _shown(name: str, value) -> str:
    """A setting as a message shows it: a flag that only switches (`--no-spec`) by its name alone."""
    if isinstance(value, bool):
        return name if name.startswith("--") else f"{name} {str(value).lower()}"
    return f"{name} {value!r}" if isinstance(value, str) else f"{name} {value}"


TREE_RULE = f"must be 'auto', 'off' or a whole number in [1, {MAX_TREE_NODES}]"
FIXED_TREE_RULE = (
    "{1} N verifies N + 1 tokens every round, whatever the block size; give {1} N with {0} 'auto', "
    "or a fixed {0} with {1} 'auto' or 'off'"
)
PLAIN_RULE = "plain decoding drafts nothing, so {1} does not apply; drop one of them"


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def tree_value(value):
    """The one reader of a draft-tree setting, for every caller: the command line (`flags.tree_arg`, which
    reads digits as a number first), the server's `tree` field and `GenerationSettings`. One spelling: "auto"
    or "off" exactly (as "auto" for the block size), or a whole number of nodes in [1, MAX_TREE_NODES]; anything
    else is a `SamplingError` naming `tree`."""
    if (isinstance(value, str) and value in (AUTO, OFF)) or (_whole(value) and 1 <= value <= MAX_TREE_NODES):
        return value
    raise SamplingError("tree", TREE_RULE, value)


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
    width); N (1..MAX_TREE_NODES) verifies N nodes under the anchor every round (N + 1 tokens), which sets the
    verify width itself, so it goes with `block_size` "auto" only (a fixed block size with it is a
    `SettingsConflict` naming both); "off" verifies chains only. `tree_value` reads every tree setting.
    `speculative=False` decodes with the target alone (the baseline). `seed` seeds sampling: an
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
        tree_value(self.tree)
        if _whole(b) and _whole(self.tree):
            raise SettingsConflict(("block_size", "tree"), (b, self.tree), FIXED_TREE_RULE)
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
        """A copy with `changes` (flat keywords as `of`; None leaves a field as it is). A change that fixes the
        block size or the tree, without the other, puts the other back to "auto" where it was fixed: the newer
        setting wins over an older one it disagrees with (a request's field over the server's default, a chat
        command over the chat's setting) and the copy says so. Both fixed in one change disagree
        (`SettingsConflict`)."""
        changes = {k: v for k, v in changes.items() if v is not None}
        for name, other in (("block_size", "tree"), ("tree", "block_size")):
            if _whole(changes.get(name)) and other not in changes and _whole(getattr(self, other)):
                changes[other] = AUTO
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

    def with_verify_width(self, width: int) -> GenerationSettings:
        """The loop's own copy, its `block_size` the width it settled on (the verify width, or under "auto" the
        widest chain) whatever the tree: not a setting anyone gave, so not held to `FIXED_TREE_RULE`."""
        if not (_whole(width) and width >= 1):
            raise SamplingError("block_size", "must be a whole number >= 1", width)
        out = replace(self, block_size=AUTO)
        object.__setattr__(out, "block_size", width)
        return out


def check_together(given: Mapping[str, Any]) -> None:
    """Settings given together for ONE generation (`generate`'s flags, a server request's own fields) that
    disagree where a stored default would not: plain decoding (`speculative` false) with a fixed block size or
    tree, which only drafting uses. A server's or a chat's defaults may hold both (`serve --no-spec --tree 7`,
    `chat --no-spec --block-size 4`): a request or `/spec on` turns drafting on later."""
    if given.get("speculative") is False:
        for name in ("block_size", "tree"):
            if _whole(given.get(name)):
                raise SettingsConflict(("speculative", name), (False, given[name]), PLAIN_RULE)


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
