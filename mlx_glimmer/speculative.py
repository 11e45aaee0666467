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
    propose(anchor, count, params, key) -> (tokens [<= count], probs [n, V] | None)
                                    probs None means the tokens are deterministic
    rollback(n) -> bool             forget the last n observed positions; False if it cannot
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import mlx.core as mx

from .cache import trim_cache
from .errors import GlimmerError
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


@dataclass
class DecodeState:
    """What one generation leaves in the caches, so the next turn of a chat prefills only new tokens.

    `processed` lists the token ids whose K/V sit in `cache`, in order. The
    next prompt is compared with it: the common prefix is kept, anything after
    it is rolled back (up to `ROLLBACK_SLACK` tokens past a sliding window;
    beyond that, or when the drafter's context is out of step, the turn starts
    from scratch), and only the rest of the prompt is prefilled.
    """

    cache: list | None = None
    processed: list[int] = field(default_factory=list)
    drafter: object | None = None  # the drafter whose context covers exactly `processed`
    reserve: int = 0
    reused_tokens: int = 0  # prompt tokens the last turn did not have to prefill
    target: Target | None = None  # the target whose K/V `cache` holds
    ahead: int = 0  # cache entries past `processed`: plain decoding's run-ahead forward, not yet undone
    owner: object | None = None  # the generation currently writing to this state


# Extra rollback room in every cache: lets a chat template re-render the tail of
# the previous answer differently without a full re-prefill.
ROLLBACK_SLACK = 64


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _resume(state: DecodeState, target: Target, prompt: Sequence[int], drafter, block_size: int) -> int:
    """Prepare `state` for `prompt`; returns how many prompt tokens are already in the cache."""
    if state.target is not None and state.target is not target:
        raise GlimmerError("this DecodeState holds another target's cache; start a new DecodeState() for this pair")
    state.target = target
    if state.ahead:  # an earlier generation stopped without being closed: undo its run-ahead forward now
        trim_cache(state.cache, state.ahead)
        state.ahead = 0
    reusable = (
        state.cache is not None
        and block_size + ROLLBACK_SLACK <= state.reserve
        and (drafter is None or state.drafter is drafter)
    )
    if reusable:
        keep = min(_common_prefix(state.processed, prompt), len(prompt) - 1)
        rollback = len(state.processed) - keep
        can = all(c.can_trim(rollback) if hasattr(c, "can_trim") else c.is_trimmable() for c in state.cache)
        if can and drafter is not None:
            can = drafter.rollback(rollback)
        if can:
            trim_cache(state.cache, rollback)
            del state.processed[keep:]
            if drafter is None:
                state.drafter = None  # its context no longer follows the cache
            return keep
    state.reserve = block_size + ROLLBACK_SLACK
    state.cache = target.make_cache(reserve=state.reserve)
    state.processed = []
    state.drafter = drafter
    if drafter is not None:
        drafter.reset()
    return 0


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
    state: DecodeState | None = None,
) -> Iterator[Step]:
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    if max_tokens <= 0:
        return
    prompt = list(prompt)
    block_size = max(1, int(block_size)) if drafter is not None else 1
    stop = set(int(t) for t in stop_ids)
    capture = drafter is not None and bool(drafter.target_layer_ids)
    if drafter is not None:
        target.capture(drafter.target_layer_ids)
    state = state if state is not None else DecodeState()
    done = _resume(state, target, prompt, drafter, block_size)
    state.owner = owner = object()
    state.reused_tokens = done
    cache = state.cache
    key = mx.random.key(seed)

    # Prefill the prompt tokens not yet in the cache, in chunks; logits for the last position only.
    tic = time.perf_counter()
    todo = prompt[done:]
    todo_arr = mx.array(todo, dtype=mx.uint32)
    for start in range(0, len(todo), prefill_step):
        chunk = todo[start : start + prefill_step]
        hidden, feats = target.forward(todo_arr[start : start + prefill_step], cache, capture)
        if drafter is not None:
            drafter.observe(chunk, feats)
        state.processed.extend(chunk)
        if start + prefill_step < len(todo):
            mx.eval([c.state for c in cache], feats if feats is not None else [])
    key, sub = mx.random.split(key)
    _, first = _choose(target.head(hidden[-1:]), mx.array([], dtype=mx.uint32), None, params, sub)
    step = Step([first], prefill_tokens=len(todo), verify_s=time.perf_counter() - tic, stopped=first in stop)
    yield step
    generated = 1
    anchor = first
    if step.stopped:
        return
    if drafter is None:
        yield from _plain_steps(target, state, owner, anchor, params, key, max_tokens - generated, stop)
        return

    while generated < max_tokens:
        b = min(block_size, max_tokens - generated)
        key, k_draft, k_accept = mx.random.split(key, 3)
        tic = time.perf_counter()
        if b > 1:
            # A drafter may offer fewer tokens than asked (adaptive k, no n-gram match).
            draft, draft_probs = drafter.propose(anchor, b - 1, params, k_draft)
            draft = draft.astype(mx.uint32)
            mx.eval(draft, draft_probs if draft_probs is not None else [])
            b = draft.shape[0] + 1
        else:
            draft, draft_probs = mx.array([], dtype=mx.uint32), None
        toc = time.perf_counter()
        tokens_in = mx.concatenate([mx.array([anchor], dtype=mx.uint32), draft])
        hidden, feats = target.forward(tokens_in, cache, capture)
        n, nxt = _choose(target.head(hidden), draft, draft_probs, params, k_accept)
        committed = draft[:n].tolist() + [nxt]
        stopped = False
        for i, t in enumerate(committed):
            if t in stop:
                committed, stopped = committed[: i + 1], True
                break
        # The target has processed [anchor] + committed[:-1]; everything after is rolled back.
        m = len(committed)
        trim_cache(cache, b - m)
        processed = [anchor] + committed[:-1]
        if drafter is not None:
            drafter.observe(processed, feats[:m] if feats is not None else None)
        state.processed.extend(processed)
        verify_s = time.perf_counter() - toc
        generated += m
        anchor = committed[-1]
        yield Step(committed, drafted=b - 1, draft_s=toc - tic, verify_s=verify_s, stopped=stopped)
        if stopped:
            return


def _next_token(target: Target, cache: list, token: mx.array, params: SamplingParams, key) -> mx.array:
    """Run one token through the target and pick the next one, lazily (nothing is evaluated here)."""
    hidden, _ = target.forward(token, cache, capture=False)
    logits = target.head(hidden[-1])
    choice = mx.argmax(logits, axis=-1) if params.greedy else mx.random.categorical(mx.log(probabilities(logits, params)), key=key)
    return choice.reshape(1).astype(mx.uint32)


def _plain_steps(target, state, owner, anchor: int, params, key, budget: int, stop: set) -> Iterator[Step]:
    """Plain decoding, pipelined as mlx-lm does it: the forward for token i + 1 is queued
    before token i is read back, so Python overhead overlaps the computation.

    The queued forward means the cache may hold one token more than was committed
    (`state.ahead`). It is undone when this generator is closed (callers close it
    explicitly when they stop early) or, if a caller never closes it, by the next
    generation on the same state; a generator that no longer owns the state
    leaves it alone, so a late garbage collection cannot undo another turn's work.
    """
    cache = state.cache
    tic = time.perf_counter()
    key, sub = mx.random.split(key)
    nxt = _next_token(target, cache, mx.array([anchor], dtype=mx.uint32), params, sub)
    state.processed.append(anchor)
    mx.async_eval(nxt)
    try:
        for i in range(budget):
            ahead = None
            if i + 1 < budget:
                key, sub = mx.random.split(key)
                ahead = _next_token(target, cache, nxt, params, sub)
                mx.async_eval(ahead)
            token = int(nxt.item())
            if ahead is not None:
                state.ahead = 1  # `token` is in the cache, not yet committed to `processed`
            now = time.perf_counter()
            stopped = token in stop
            yield Step([token], verify_s=now - tic, stopped=stopped)
            tic = now
            if stopped:
                return
            if ahead is not None:
                state.processed.append(token)
                state.ahead = 0
            nxt = ahead
    finally:
        if state.owner is owner and state.ahead:  # the forward of the last committed token ran ahead: undo it
            mx.eval(nxt if nxt is not None else [])
            trim_cache(cache, state.ahead)
            state.ahead = 0
