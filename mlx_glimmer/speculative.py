"""The speculative loop: draft a block, verify it in one target pass, keep the agreeing prefix.

The loop only knows a target, a drafter and sampling settings; it yields one
`Step` per target call and leaves text, stats and stopping on strings to its
callers. With no drafter (or `block_size` 1) every round is a plain decoding
step through the same sampler: that is the baseline.

A drafter is any object with:
    kind: str                       name for stats ("dflash", ...)
    target_layer_ids: tuple[int]    target layers whose outputs it reads (may be empty)
    reset() -> None                 start a new sequence
    observe(tokens, features) -> None
                                    the next n committed token ids the target has processed,
                                    and their features [n, k*H] (None without target_layer_ids)
    propose(anchor, count, params, key) -> (tokens [count], probs [count, V] | None)
                                    probs None means the tokens are deterministic
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import mlx.core as mx

from .cache import trim_cache
from .sampling import SamplingParams, accept_greedy, accept_sampled, probabilities
from .target import Target


@dataclass
class Step:
    tokens: list[int]  # committed by this target call, ending at a stop token if one came
    drafted: int = 0  # draft tokens offered to this verification
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_tokens: int = 0  # > 0 only on the prefill step
    stopped: bool = False  # a stop token was committed (it is the last of `tokens`)


def _choose(logits: mx.array, draft: mx.array, draft_probs, params: SamplingParams, key) -> tuple[int, int]:
    if params.greedy:
        return accept_greedy(draft, logits)
    return accept_sampled(draft, draft_probs, probabilities(logits, params), key)


def generate_steps(
    target: Target,
    prompt: Sequence[int],
    *,
    drafter=None,
    params: SamplingParams = SamplingParams(),
    block_size: int = 16,
    max_tokens: int = 256,
    stop_ids: Sequence[int] = (),
    seed: int = 0,
    prefill_step: int = 512,
) -> Iterator[Step]:
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    if max_tokens <= 0:
        return
    block_size = max(1, int(block_size)) if drafter is not None else 1
    stop = set(int(t) for t in stop_ids)
    capture = drafter is not None and bool(drafter.target_layer_ids)
    if drafter is not None:
        target.capture(drafter.target_layer_ids)
        drafter.reset()
    cache = target.make_cache(reserve=block_size)
    key = mx.random.key(seed)

    # Prefill: every prompt token, in chunks; logits for the last position only.
    tic = time.perf_counter()
    prompt_arr = mx.array(list(prompt), dtype=mx.uint32)
    for start in range(0, len(prompt), prefill_step):
        chunk = prompt_arr[start : start + prefill_step]
        hidden, feats = target.forward(chunk, cache, capture)
        if drafter is not None:
            drafter.observe(list(prompt[start : start + prefill_step]), feats)
        if start + prefill_step < len(prompt):
            mx.eval([c.state for c in cache], feats if feats is not None else [])
    key, sub = mx.random.split(key)
    _, first = _choose(target.head(hidden[-1:]), mx.array([], dtype=mx.uint32), None, params, sub)
    step = Step([first], prefill_tokens=len(prompt), verify_s=time.perf_counter() - tic, stopped=first in stop)
    yield step
    generated = 1
    anchor = first
    if step.stopped:
        return

    while generated < max_tokens:
        b = min(block_size, max_tokens - generated)
        key, k_draft, k_accept = mx.random.split(key, 3)
        tic = time.perf_counter()
        if b > 1:
            draft, draft_probs = drafter.propose(anchor, b - 1, params, k_draft)
            draft = draft.astype(mx.uint32)
            mx.eval(draft, draft_probs if draft_probs is not None else [])
        else:
            draft, draft_probs = mx.array([], dtype=mx.uint32), None
        toc = time.perf_counter()
        tokens_in = mx.concatenate([mx.array([anchor], dtype=mx.uint32), draft])
        hidden, feats = target.forward(tokens_in, cache, capture)
        n, nxt = _choose(target.head(hidden), draft, draft_probs, params, k_accept)
        trim_cache(cache, b - 1 - n)
        accepted = draft[:n].tolist()
        if drafter is not None:
            drafter.observe([anchor] + accepted, feats[: n + 1] if feats is not None else None)
        committed = accepted + [nxt]
        stopped = False
        for i, t in enumerate(committed):
            if t in stop:
                committed, stopped = committed[: i + 1], True
                break
        verify_s = time.perf_counter() - toc
        generated += len(committed)
        anchor = committed[-1]
        yield Step(committed, drafted=b - 1, draft_s=toc - tic, verify_s=verify_s, stopped=stopped)
        if stopped:
            return
