"""Turning logits into tokens, and deciding which drafted tokens to keep.

Filters apply in the order transformers uses: temperature, then top-k, then
top-p (the smallest set of most likely tokens whose mass reaches top_p). The
same `probabilities` function shapes the target's and the drafter's logits, so
rejection sampling compares like with like and the output follows the
target's filtered distribution exactly.
"""

from __future__ import annotations

import mlx.core as mx

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


def sample(probs: mx.array, key: mx.array) -> mx.array:
    """One token id per row of `probs` ([..., V] -> [...])."""
    return mx.random.categorical(mx.log(probs), key=key)


def pick(target, logits, params: SamplingParams, key) -> tuple:
    """One token per row of `logits`: the argmax, or a sample with the filtered distribution it came from.
    On `target`'s own array library (a `target_model.TargetModel`: its `sampling` ops do the work)."""
    if params.greedy:
        return target.sampling.argmax(logits), None
    probs = target.sampling.probabilities(logits, params)
    return target.sampling.sample(probs, key), probs


def spread(probs: mx.array, ids: mx.array, vocab_size: int) -> mx.array:
    """Distributions over `ids` [n, len(ids)] as distributions over the whole vocabulary [n, vocab_size]."""
    full = mx.zeros((probs.shape[0], vocab_size), dtype=probs.dtype)
    full[:, ids] = probs
    return full


def greedy_verdict(draft: mx.array, target_logits: mx.array) -> mx.array:
    """Exact-match acceptance, lazily. `draft` [n], `target_logits` [n + 1, V].

    Returns int32 [accepted drafts, the target's own next token after them], not evaluated: the loop reads
    it together with the draft in its one host read per round.
    """
    choice = mx.argmax(target_logits, axis=-1).astype(mx.int32)
    n = draft.shape[0]
    if n == 0:
        return mx.concatenate([mx.zeros((1,), dtype=mx.int32), choice[:1]])
    match = (draft.astype(mx.int32) == choice[:n]).astype(mx.int32)
    accepted = mx.cumprod(match).sum()
    return mx.stack([accepted, choice[accepted]])


def sampled_verdict(
    draft: mx.array,
    draft_probs: mx.array | None,
    target_probs: mx.array,
    key: mx.array,
) -> mx.array:
    """Speculative rejection sampling (Leviathan et al. / Chen et al.), lazily.

    `draft` [n] tokens drawn from `draft_probs` [n, V] (None: drawn
    deterministically, i.e. one-hot); `target_probs` [n + 1, V]. Draft token i
    is kept with probability min(1, p_i(d) / q_i(d)); at the first rejection the
    replacement is drawn from max(0, p_i - q_i) renormalised; if all are kept
    the extra token comes from p_n. Returns int32 [accepted drafts, next token], not evaluated.
    """
    n = draft.shape[0]
    k_accept, k_token = mx.random.split(key)
    if n == 0:
        return mx.stack([mx.array(0, dtype=mx.int32), sample(target_probs[0], k_token).astype(mx.int32)])
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
    return mx.stack([accepted, token.astype(mx.int32)])


def accept_greedy(draft: mx.array, target_logits: mx.array) -> tuple[int, int]:
    """`greedy_verdict`, read: (accepted drafts, the target's own next token after them)."""
    accepted, token = greedy_verdict(draft, target_logits).tolist()
    return int(accepted), int(token)


def accept_sampled(
    draft: mx.array, draft_probs: mx.array | None, target_probs: mx.array, key: mx.array
) -> tuple[int, int]:
    """`sampled_verdict`, read: (accepted drafts, next token)."""
    accepted, token = sampled_verdict(draft, draft_probs, target_probs, key).tolist()
    return int(accepted), int(token)
