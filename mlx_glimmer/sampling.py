"""Turning logits into tokens, and deciding which drafted tokens to keep.

Filters apply in the order transformers uses: temperature, then top-k, then
top-p (the smallest set of most likely tokens whose mass reaches top_p). The
same `probabilities` function shapes the target's and the drafter's logits, so
rejection sampling compares like with like and the output follows the
target's filtered distribution exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx

from .errors import GlimmerError


class SamplingError(GlimmerError, ValueError):
    """A sampling setting out of range. `field` names it as the API does; `rule` says what it must be,
    so a command line or a chat command can name its own flag (`named`)."""

    def __init__(self, field: str, rule: str, value):
        self.field, self.rule, self.value = field, rule, value
        super().__init__(self.named(field))

    def named(self, name: str) -> str:
        return f"{name} {self.rule}, got {self.value}"


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    """Temperature (0 = greedy), top-p and top-k; the one place they are checked (`SamplingError`)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if not (_number(self.temperature) and self.temperature >= 0):
            raise SamplingError("temperature", "must be a number >= 0", self.temperature)
        if not (_number(self.top_p) and 0 < self.top_p <= 1):
            raise SamplingError("top_p", "must be in (0, 1]", self.top_p)
        if not (isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= 0):
            raise SamplingError("top_k", "must be a whole number >= 0", self.top_k)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probabilities(logits: mx.array, params: SamplingParams) -> mx.array:
    """Filtered next-token distribution(s), float32, same shape as `logits` ([..., V])."""
    logits = logits.astype(mx.float32) / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = mx.sort(logits, axis=-1)[..., vocab - params.top_k][..., None]
        logits = mx.where(logits < kth, -mx.inf, logits)
    probs = mx.softmax(logits, axis=-1)
    if params.top_p < 1.0:
        order = mx.argsort(-probs, axis=-1)
        sorted_probs = mx.take_along_axis(probs, order, axis=-1)
        mass_before = mx.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep_sorted = mass_before < params.top_p
        keep = mx.put_along_axis(mx.zeros_like(keep_sorted), order, keep_sorted, axis=-1)
        probs = mx.where(keep, probs, 0.0)
        probs = probs / probs.sum(axis=-1, keepdims=True)
    return probs


def argmax(logits: mx.array) -> mx.array:
    return mx.argmax(logits, axis=-1)


def sample(probs: mx.array, key: mx.array) -> mx.array:
    """One token id per row of `probs` ([..., V] -> [...])."""
    return mx.random.categorical(mx.log(probs), key=key)


def spread(probs: mx.array, ids: mx.array, vocab_size: int) -> mx.array:
    """Distributions over `ids` [n, len(ids)] as distributions over the whole vocabulary [n, vocab_size]."""
    full = mx.zeros((probs.shape[0], vocab_size), dtype=probs.dtype)
    full[:, ids] = probs
    return full


def accept_greedy(draft: mx.array, target_logits: mx.array) -> tuple[int, int]:
    """Exact-match acceptance. `draft` [n], `target_logits` [n + 1, V].

    Returns (accepted drafts, the target's own next token after them).
    """
    choice = mx.argmax(target_logits, axis=-1)
    n = draft.shape[0]
    if n == 0:
        return 0, int(choice[0].item())
    match = (draft == choice[:n]).astype(mx.int32)
    accepted = mx.cumprod(match).sum()
    both = mx.stack([accepted, choice[accepted]]).tolist()
    return int(both[0]), int(both[1])


def accept_sampled(
    draft: mx.array,
    draft_probs: mx.array | None,
    target_probs: mx.array,
    key: mx.array,
) -> tuple[int, int]:
    """Speculative rejection sampling (Leviathan et al. / Chen et al.).

    `draft` [n] tokens drawn from `draft_probs` [n, V] (None: drawn
    deterministically, i.e. one-hot); `target_probs` [n + 1, V]. Draft token i
    is kept with probability min(1, p_i(d) / q_i(d)); at the first rejection the
    replacement is drawn from max(0, p_i - q_i) renormalised; if all are kept
    the extra token comes from p_n. Returns (accepted drafts, next token).
    """
    n = draft.shape[0]
    k_accept, k_token = mx.random.split(key)
    if n == 0:
        return 0, int(sample(target_probs[0], k_token).item())
    rows = mx.arange(n)
    p = target_probs[rows, draft]
    if draft_probs is None:
        q = mx.ones_like(p)
        q_full = mx.zeros_like(target_probs[:n])
        q_full = mx.put_along_axis(q_full, draft[:, None], mx.ones((n, 1)), axis=-1)
    else:
        q = draft_probs[rows, draft]
        q_full = draft_probs
    u = mx.random.uniform(shape=(n,), key=k_accept)
    keep = (u * q < p).astype(mx.int32)  # u < p/q without dividing by q == 0
    accepted = mx.cumprod(keep).sum()
    residual = mx.maximum(target_probs[:n] - q_full, 0.0)
    residual = mx.concatenate([residual, target_probs[n:]], axis=0)[accepted]
    total = residual.sum()
    # A residual of zero mass only arises when p == q exactly; then p itself is right.
    residual = mx.where(total > 0, residual / mx.maximum(total, 1e-30), target_probs[accepted])
    token = sample(residual, k_token)
    both = mx.stack([accepted, token]).tolist()
    return int(both[0]), int(both[1])
