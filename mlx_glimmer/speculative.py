"""The speculative loop: draft a block, verify it in one target pass, keep the agreeing prefix.

Written once for every array library. The loop only knows a `TargetModel` (the
target on one library: MLX's `target.Target`, torch's `TorchTarget`), a
`Drafter` and sampling settings; it yields one `Step` per target call and
leaves text, stats and stopping on strings to its callers. With no drafter (or
`block_size` 1) every round is a plain decoding step through the same
sampler: that is the baseline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol, Sequence, runtime_checkable

from .block_policy import WidthPolicy
from .errors import GlimmerError
from .sampling import SamplingParams

Array = Any  # an mx.array or a torch.Tensor, whichever the target computes with


@runtime_checkable
class Drafter(Protocol):
    """What the loop asks of a drafter; its arrays are its target's kind.

    observe(tokens, features)   the next n committed token ids the target has processed, and their
                                features [n, k*H] (None without target_layer_ids)
    propose(anchor, count, params, key)
                                at most `count` draft tokens, and the distributions [n, V] they were
                                drawn from (None: chosen deterministically)
    rollback(n)                 forget the last n observed positions; False (and no change) if it cannot
    """

    kind: str  # name for stats ("dflash", ...)
    target_layer_ids: tuple[int, ...]  # target layers whose outputs it reads (may be empty)
    block_size: int  # default verify width: drafted tokens + the anchor

    def reset(self) -> None: ...  # start a new sequence
    def observe(self, tokens: list[int], features: Array | None) -> None: ...
    def propose(self, anchor: int, count: int, params: SamplingParams, key: Any) -> tuple[Array, Array | None]: ...
    def rollback(self, n: int) -> bool: ...


class SamplingOps(Protocol):
    """One array library's `sampling` module (`mlx_glimmer.sampling`, `torch_backend.sampling`)."""

    def probabilities(self, logits: Array, params: SamplingParams) -> Array: ...
    def argmax(self, logits: Array) -> Array: ...
    def sample(self, probs: Array, key: Any) -> Array: ...
    def accept_greedy(self, draft: Array, target_logits: Array) -> tuple[int, int]: ...
    def accept_sampled(self, draft: Array, draft_probs: Array | None, target_probs: Array, key: Any) -> tuple[int, int]: ...


class TargetModel(Protocol):
    """The target on one array library (`target.Target`, `torch_backend.target.TorchTarget`):
    all that the loop needs and that differs between libraries.

    forward(tokens, cache, capture)  tokens [L] -> final hidden states [L, H] and, with capture, the
                                     outputs of the layers named by `capture(layer_ids)` [L, k*H] (else None)
    head(hidden)                     logits [L, V] as the model's own forward computes them
    make_cache(reserve)              a KV cache that rolls back at least `reserve` tokens at any length
    trim(cache, n)                   forget the last n positions (n <= 0: nothing)
    split(key, n)                    (the next key, n keys to use now)
    launch(array) / sync(...)        start computing / finish computing (the cache's contents too)
    """

    sampling: SamplingOps

    def capture(self, layer_ids: Sequence[int]) -> None: ...
    def forward(self, tokens: Array, cache: Any, capture: bool) -> tuple[Array, Array | None]: ...
    def head(self, hidden: Array) -> Array: ...
    def make_cache(self, reserve: int) -> Any: ...
    def can_trim(self, cache: Any, n: int) -> bool: ...
    def trim(self, cache: Any, n: int) -> None: ...
    def tokens(self, ids: Sequence[int] | Array) -> Array: ...  # token ids as this library's array
    def new_key(self, seed: int) -> Any: ...
    def split(self, key: Any, n: int) -> tuple: ...
    def launch(self, array: Array) -> None: ...
    def sync(self, *arrays: Array | None, cache: Any = None) -> None: ...


def pick(target: TargetModel, logits: Array, params: SamplingParams, key) -> tuple[Array, Array | None]:
    """One token per row of `logits`: the argmax, or a sample with the filtered distribution it came from."""
    if params.greedy:
        return target.sampling.argmax(logits), None
    probs = target.sampling.probabilities(logits, params)
    return target.sampling.sample(probs, key), probs


def _accept(target: TargetModel, logits: Array, draft: Array, draft_probs, params: SamplingParams, key) -> tuple[int, int]:
    ops = target.sampling
    if params.greedy:
        return ops.accept_greedy(draft, logits)
    return ops.accept_sampled(draft, draft_probs, ops.probabilities(logits, params), key)


@dataclass
class Step:
    tokens: list[int]  # committed by this target call, ending at a stop token if one came
    drafted: int = 0  # draft tokens offered to this verification
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_tokens: int = 0  # > 0 only on the prefill step
    stopped: bool = False  # a stop token was committed (it is the last of `tokens`)


@dataclass
class DecodeState:
    """What one generation leaves in the caches, so the next turn of a chat prefills only new tokens.

    `processed` lists the token ids whose K/V sit in `cache`, in order. The
    next prompt is compared with it: the common prefix is kept, anything after
    it is rolled back (up to `ROLLBACK_SLACK` tokens past a sliding window;
    beyond that, or when the drafter's context is out of step, the turn starts
    from scratch), and only the rest of the prompt is prefilled.
    """

    cache: Any = None
    processed: list[int] = field(default_factory=list)
    drafter: Drafter | None = None  # the drafter whose context covers exactly `processed`
    reserve: int = 0
    reused_tokens: int = 0  # prompt tokens the last turn did not have to prefill
    target: TargetModel | None = None  # the target whose K/V `cache` holds
    ahead: int = 0  # cache entries past `processed`: plain decoding's run-ahead forward, not yet undone
    owner: object | None = None  # the generation currently writing to this state


# Extra rollback room in every cache: lets a chat template re-render the tail of
# the previous answer differently without a full re-prefill.
ROLLBACK_SLACK = 64


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _resume(state: DecodeState, target: TargetModel, prompt: Sequence[int], drafter: Drafter | None,
            block_size: int) -> int:
    """Prepare `state` for `prompt`; returns how many prompt tokens are already in the cache."""
    if state.target is not None and state.target is not target:
        raise GlimmerError("this DecodeState holds another target's cache; start a new DecodeState() for this pair")
    state.target = target
    if state.ahead:  # an earlier generation stopped without being closed: undo its run-ahead forward now
        target.trim(state.cache, state.ahead)
        state.ahead = 0
    reusable = (
        state.cache is not None
        and block_size + ROLLBACK_SLACK <= state.reserve
        and (drafter is None or state.drafter is drafter)
    )
    if reusable:
        keep = min(common_prefix(state.processed, prompt), len(prompt) - 1)
        rollback = len(state.processed) - keep
        can = target.can_trim(state.cache, rollback)
        if can and drafter is not None:
            can = drafter.rollback(rollback)
        if can:
            target.trim(state.cache, rollback)
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
    target: TargetModel,
    prompt: Sequence[int],
    *,
    drafter: Drafter | None = None,
    params: SamplingParams = SamplingParams(),
    block_size: int = 16,
    max_tokens: int = 256,
    stop_ids: Sequence[int] = (),
    seed: int = 0,
    prefill_step: int = 512,
    state: DecodeState | None = None,
    policy: WidthPolicy | None = None,
) -> Iterator[Step]:
    """One `Step` per target call. `block_size` is the verify width (drafts + anchor); with a `policy`
    (`block_policy.WidthPolicy`, `--block-size auto`) each round's width is the policy's choice, at most
    `block_size`, and width 1 is a plain step (no drafter call)."""
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
    key = target.new_key(seed)

    # Prefill the prompt tokens not yet in the cache, in chunks; logits for the last position only.
    tic = time.perf_counter()
    todo = prompt[done:]
    todo_arr = target.tokens(todo)
    for start in range(0, len(todo), prefill_step):
        chunk = todo[start : start + prefill_step]
        hidden, feats = target.forward(todo_arr[start : start + prefill_step], cache, capture)
        if drafter is not None:
            drafter.observe(chunk, feats)
        state.processed.extend(chunk)
        if start + prefill_step < len(todo):
            target.sync(feats, cache=cache)
    key, sub = target.split(key, 1)
    _, first = _accept(target, target.head(hidden[-1:]), target.tokens([]), None, params, sub)
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
        context = len(state.processed) + 1
        b = min(policy.choose(context) if policy is not None else block_size, max_tokens - generated)
        key, k_draft, k_accept = target.split(key, 2)
        tic = time.perf_counter()
        draft, draft_probs = target.tokens([]), None
        if b > 1:
            # A drafter may offer fewer tokens than asked (adaptive k, no n-gram match).
            draft, draft_probs = drafter.propose(anchor, b - 1, params, k_draft)
            draft = target.tokens(draft)
            target.sync(draft, draft_probs)
            b = draft.shape[0] + 1
        toc = time.perf_counter()
        drafted = draft.tolist()
        hidden, feats = target.forward(target.tokens([anchor] + drafted), cache, capture)
        n, nxt = _accept(target, target.head(hidden), draft, draft_probs, params, k_accept)
        committed = drafted[:n] + [nxt]
        stopped = False
        for i, t in enumerate(committed):
            if t in stop:
                committed, stopped = committed[: i + 1], True
                break
        # The target has processed [anchor] + committed[:-1]; everything after is rolled back.
        m = len(committed)
        target.trim(cache, b - m)
        processed = [anchor] + committed[:-1]
        drafter.observe(processed, feats[:m] if feats is not None else None)
        state.processed.extend(processed)
        verify_s = time.perf_counter() - toc
        if policy is not None:
            policy.observe(b, n, context, toc - tic, verify_s)
        generated += m
        anchor = committed[-1]
        yield Step(committed, drafted=b - 1, draft_s=toc - tic, verify_s=verify_s, stopped=stopped)
        if stopped:
            return


def _next_token(target: TargetModel, cache, token: Array, params: SamplingParams, key) -> Array:
    """Run one token through the target and pick the next one, lazily where the library is lazy."""
    hidden, _ = target.forward(token, cache, capture=False)
    return pick(target, target.head(hidden[-1:]), params, key)[0]


def _plain_steps(target: TargetModel, state: DecodeState, owner, anchor: int, params, key, budget: int,
                 stop: set) -> Iterator[Step]:
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
    key, sub = target.split(key, 1)
    nxt = _next_token(target, cache, target.tokens([anchor]), params, sub)
    state.processed.append(anchor)
    target.launch(nxt)
    try:
        for i in range(budget):
            ahead = None
            if i + 1 < budget:
                key, sub = target.split(key, 1)
                ahead = _next_token(target, cache, nxt, params, sub)
                target.launch(ahead)
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
            target.sync(nxt)
            target.trim(cache, state.ahead)
            state.ahead = 0
