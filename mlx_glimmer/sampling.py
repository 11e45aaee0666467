"""Turning logits into tokens, and deciding which drafted tokens to keep.

Filters apply in the order transformers uses: temperature, then top-k, then
top-p (the smallest set of most likely tokens whose mass reaches top_p). The
same `probabilities` function shapes the target's and the drafter's logits.
A sample is Gumbel-max with noise keyed by the seed and the token's absolute
position (`noise.py`): a draft is kept where it equals the target's own
sample, so a seed gives the same text with or without drafts.
"""

from __future__ import annotations

import mlx.core as mx

from . import noise
from .array_ops import MLX_OPS
from .settings import SamplingParams


def probabilities(logits: mx.array, params: SamplingParams) -> mx.array:
    """Filtered next-token distribution(s), float32, same shape as `logits` ([..., V]).

    No full-vocabulary argsort: top-k's threshold is the k-th largest logit (`mx.partition`), and top-p keeps
    every token at least as likely as the last one the descending running mass needs (found by sorting
    values only: the k survivors of top-k when it is set, else the row). With distinct probabilities that
    is exactly the sorted prefix `mass_before < top_p`; tokens tied with its last one are kept with it."""
    logits = logits.astype(mx.float32) / params.temperature
    vocab = logits.shape[-1]
    top_k = params.top_k if 0 < params.top_k < vocab else 0
    if top_k:
        kth = mx.partition(logits, vocab - top_k, axis=-1)[..., vocab - top_k :][..., :1]
        logits = mx.where(logits < kth, -mx.inf, logits)
    probs = mx.softmax(logits, axis=-1)
    if params.top_p < 1.0:
        ranked = -mx.sort(-(mx.topk(probs, top_k, axis=-1) if top_k else probs), axis=-1)  # descending
        mass_before = mx.cumsum(ranked, axis=-1) - ranked
        needed = (mass_before < params.top_p).astype(mx.int32).sum(axis=-1, keepdims=True)  # >= 1
        threshold = mx.take_along_axis(ranked, needed - 1, axis=-1)
        probs = mx.where(probs >= threshold, probs, 0.0)
        probs = probs / probs.sum(axis=-1, keepdims=True)
    return probs


def argmax(logits: mx.array) -> mx.array:
    return mx.argmax(logits, axis=-1)


def sample(probs: mx.array, where: noise.Noise, tokens: mx.array | None = None) -> mx.array:
    """One column per row of `probs` ([..., V] -> [...]): row i the sample of position `where.start + i`, its
    columns the token ids 0..V-1 or `tokens` (a subset of the vocabulary, drawn with those ids' noise)."""
    return noise.gumbel_max(MLX_OPS, probs, where, tokens)


def gumbel_scores(probs: mx.array, where: noise.Noise) -> mx.array:
    """[n, V]: `noise.gumbel_scores`, whose row argmaxes are `sample`'s tokens."""
    return noise.gumbel_scores(MLX_OPS, probs, where)


def pick(target, logits, params: SamplingParams, where: noise.Noise | None, tokens=None) -> tuple:
    """One column per row of `logits`: the argmax, or the sample of row i's position `where.start + i` with the
    filtered distribution it came from; `tokens`: the token ids of the columns where they are a subset of the
    vocabulary (the sample draws their noise). On `target`'s own array library (a `target_model.TargetModel`:
    its `sampling` ops do the work)."""
    if params.greedy:
        return target.sampling.argmax(logits), None
    probs = target.sampling.probabilities(logits, params)
    return target.sampling.sample(probs, where, tokens), probs


def spread(probs: mx.array, ids: mx.array, vocab_size: int) -> mx.array:
    """Distributions over `ids` [n, len(ids)] as distributions over the whole vocabulary [n, vocab_size]."""
    full = mx.zeros((probs.shape[0], vocab_size), dtype=probs.dtype)
    full[:, ids] = probs
    return full


def greedy_verdict(draft: mx.array, target_logits: mx.array) -> mx.array:
    """Exact-match acceptance, lazily. `draft` [n], `target_logits` [n + 1, V].

    Returns int32 [accepted drafts, the target's own next token after them], not evaluated: the loop reads
    it together with the draft in its one host read per round. Sampled, `target_logits` are the target's
    Gumbel scores (`gumbel_scores`): the same rule keeps exactly the drafts the target samples.
    """
    choice = mx.argmax(target_logits, axis=-1).astype(mx.int32)
    n = draft.shape[0]
    if n == 0:
        return mx.concatenate([mx.zeros((1,), dtype=mx.int32), choice[:1]])
    match = (draft.astype(mx.int32) == choice[:n]).astype(mx.int32)
    accepted = mx.cumprod(match).sum()
    return mx.stack([accepted, choice[accepted]])


def accept_greedy(draft: mx.array, target_logits: mx.array) -> tuple[int, int]:
    """`greedy_verdict`, read: (accepted drafts, the target's own next token after them)."""
    accepted, token = greedy_verdict(draft, target_logits).tolist()
    return int(accepted), int(token)
