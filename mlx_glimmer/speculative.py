"""The speculative loop: draft a block, verify it in one target pass, keep the agreeing prefix.

Written once for every array library. The loop only knows a `TargetModel` (the
target on one library: MLX's `target.Target`, torch's `TorchTarget`; the
protocol below), a `Drafter` (the base class every proposer inherits,
`drafters/base.py`) and `GenerationSettings`; it yields one `Step` per target call and
leaves text, stats and stopping on strings to its callers. With no drafter (or
`block_size` 1) every round is a plain decoding step through the same
sampler: that is the baseline.

Host reads. Each round reads the device once (`TargetModel.read`): the
acceptance verdict and the draft it judged, together. The draft stays on the
device, `[anchor, drafts]` is concatenated there, and on a lazy library (MLX)
the next round (draft and verify) is queued right after that read, before the
round's bookkeeping is handed to the caller, so the host builds graphs while
the device computes. Width-1 rounds (`--block-size auto` falling back to plain)
are queued one ahead, as plain decoding does (`_plain_steps`). A round is
timed as a whole, from one read to the next (`WidthPolicy.observe_round`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Protocol, Sequence

from .block_policy import WidthPolicy
from .drafters.base import Drafter
from .errors import GlimmerError
from .sampling import pick
from .settings import GenerationSettings, SamplingParams

Array = Any  # an mx.array or a torch.Tensor, whichever the target computes with


class SamplingOps(Protocol):
    """One array library's `sampling` module (`mlx_glimmer.sampling`, `torch_backend.sampling`)."""

    def probabilities(self, logits: Array, params: SamplingParams) -> Array: ...
    def argmax(self, logits: Array) -> Array: ...
    def sample(self, probs: Array, key: Any) -> Array: ...
    def spread(self, probs: Array, ids: Array, vocab_size: int) -> Array: ...  # [n, len(ids)] -> [n, vocab_size]
    def greedy_verdict(self, draft: Array, target_logits: Array) -> Array: ...  # [accepted, next token], lazy
    def sampled_verdict(self, draft: Array, draft_probs: Array | None, target_probs: Array, key: Any) -> Array: ...


class TargetModel(Protocol):
    """The target on one array library (`target.Target`, `torch_backend.target.TorchTarget`):
    all that the loop needs and that differs between libraries.

    forward(tokens, cache, capture)  tokens [L] -> final hidden states [L, H] and, with capture, the
                                     outputs of the layers named by `capture(layer_ids)` [L, k*H] (else None)
    head(hidden)                     logits [L, V] as the model's own forward computes them
    make_cache(reserve)              a KV cache that rolls back at least `reserve` tokens at any length
    trim(cache, n)                   forget the last n positions (n <= 0: nothing)
    split(key, n)                    (the next key, n keys to use now)
    join(*ids)                       token arrays end to end, on the device
    launch(*arrays) / sync(...)      start computing / finish computing (the cache's contents too)
    read(*arrays)                    the one blocking host read of a round: integer entries, end to end
    lazy                             True where work only runs when launched or read (MLX): the loop then
                                     queues the next round before yielding this one
    memory                           `memory.DeviceMemory`: clear_cache cadence (a no-op off Metal)

    The drafters also read its shape (`hidden_size`, `num_layers`, `vocab_size`), embed tokens with its
    table and borrow its head; `generate` reports its peak memory.
    """

    sampling: SamplingOps
    lazy: bool
    memory: Any
    model: Any  # the library's own model: its weights stay resident while it generates

    @property
    def hidden_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def activation_dtype(self) -> Any: ...  # the dtype of its hidden states (a drafter's weights take it)

    def capture(self, layer_ids: Sequence[int]) -> None: ...
    def forward(self, tokens: Array, cache: Any, capture: bool) -> tuple[Array, Array | None]: ...
    def head(self, hidden: Array) -> Array: ...
    def make_cache(self, reserve: int) -> Any: ...
    def can_trim(self, cache: Any, n: int) -> bool: ...
    def trim(self, cache: Any, n: int) -> None: ...
    def tokens(self, ids: Sequence[int] | Array) -> Array: ...  # token ids as this library's array
    def new_key(self, seed: int) -> Any: ...
    def split(self, key: Any, n: int) -> tuple: ...
    def join(self, *ids: Array) -> Array: ...
    def launch(self, *arrays: Array | None) -> None: ...
    def sync(self, *arrays: Array | None, cache: Any = None) -> None: ...
    def read(self, *arrays: Array | None) -> list[int]: ...
    def embed(self, ids: Array) -> Array: ...  # raw rows of the token embedding table
    def head_rows(self, ids: Array) -> Callable[[Array], Array]: ...  # the head over vocabulary rows `ids` only
    def reset_peak_memory(self) -> None: ...
    def peak_memory_gb(self) -> float: ...
    def last_logits(self, tokens: list[int]) -> Any: ...  # float32 numpy logits [V] after a full forward


def _verdict(target: TargetModel, logits: Array, draft: Array, draft_probs, params: SamplingParams, key) -> Array:
    """[accepted drafts, next token] on the device, not read yet."""
    ops = target.sampling
    if params.greedy:
        return ops.greedy_verdict(draft, logits)
    return ops.sampled_verdict(draft, draft_probs, ops.probabilities(logits, params), key)


@dataclass
class Step:
    tokens: list[int]  # committed by this target call, ending at a stop token if one came
    drafted: int = 0  # draft tokens offered to this verification
    # Host seconds spent proposing and launching the draft; the rest of the round (from the previous host read
    # to this one) is verify_s. The draft's device time runs in the same queued graph as the verify, so it
    # lands in verify_s: timing them apart would cost a second blocking sync per round.
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
    ahead: int = 0  # cache entries past `processed`: forwards of rounds queued ahead, not yet undone
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


def _resume(
    state: DecodeState, target: TargetModel, prompt: Sequence[int], drafter: Drafter | None, block_size: int
) -> int:
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


@dataclass
class _Round:
    """One target call queued on the device: what it verifies and what it will return (nothing read yet)."""

    width: int  # tokens verified: the anchor and width - 1 drafts
    draft: Array  # [width - 1] token ids
    feats: Array | None  # captured target features [width, k*H]
    verdict: Array  # [accepted drafts, next token]
    draft_s: float  # host seconds spent proposing and launching the draft
    timed: bool  # its time can feed the width policy (the draft did not project a long backlog)


def generate_steps(
    target: TargetModel,
    prompt: Sequence[int],
    settings: GenerationSettings = GenerationSettings(),
    *,
    drafter: Drafter | None = None,
    stop_ids: Sequence[int] = (),
    state: DecodeState | None = None,
    policy: WidthPolicy | None = None,
    prefill_step: int = 512,
) -> Iterator[Step]:
    """One `Step` per target call, generating as `settings` say. With a drafter (and `settings.speculative`)
    the verify width (drafts + anchor) is `settings.block_size`, or under "auto" the drafter's block size; with
    a `policy` (`block_policy.WidthPolicy`) each round's width is the policy's choice, and width 1 is a plain
    step (no drafter call). Without a drafter every step is a plain one."""
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    prompt = list(prompt)
    drafter = drafter if settings.speculative else None
    block_size = 1 if drafter is None else drafter.block_size if settings.auto else settings.block_size
    params, max_tokens = settings.sampling, settings.max_tokens
    stop = set(int(t) for t in stop_ids)
    capture = drafter is not None and bool(drafter.target_layer_ids)
    if drafter is not None:
        target.capture(drafter.target_layer_ids)
    state = state if state is not None else DecodeState()
    done = _resume(state, target, prompt, drafter, block_size)
    state.owner = owner = object()
    state.reused_tokens = done
    cache = state.cache
    key = target.new_key(settings.seed)
    memory = target.memory

    # Prefill the prompt tokens not yet in the cache, in chunks; logits for the last position only. The
    # drafter's context of each chunk is computed with it (`settle`), so the prompt's features are not kept
    # and round 1's draft does not pay for them.
    tic = time.perf_counter()
    todo = prompt[done:]
    todo_arr = target.tokens(todo)
    for start in range(0, len(todo), prefill_step):
        chunk = todo[start : start + prefill_step]
        hidden, feats = target.forward(todo_arr[start : start + prefill_step], cache, capture)
        context = []
        if drafter is not None:
            drafter.observe(chunk, feats)
            context = drafter.settle()
        state.processed.extend(chunk)
        if start + prefill_step < len(todo):
            target.sync(feats, *context, cache=cache)
            memory.clear()
        else:
            target.launch(*context)  # queued before the first token's logits: done when they are read
    key, sub = target.split(key, 1)
    first = target.read(_verdict(target, target.head(hidden[-1:]), target.tokens([]), None, params, sub))[1]
    memory.clear()
    step = Step([first], prefill_tokens=len(todo), verify_s=time.perf_counter() - tic, stopped=first in stop)
    yield step
    if step.stopped or max_tokens == 1:
        return
    if drafter is None:
        yield from _plain_steps(target, state, owner, first, params, key, max_tokens - 1, stop)
        return
    settings = replace(settings, block_size=block_size)
    yield from _speculative_steps(target, state, owner, drafter, first, settings, key, stop, policy)


def _launch(
    target: TargetModel,
    drafter: Drafter,
    cache,
    capture: bool,
    params: SamplingParams,
    keys: tuple,
    anchor: int | None,
    anchor_ids: Array,
    width: int,
    block_size: int,
) -> _Round:
    """Queue one round: propose (width > 1), then the verify of [anchor, drafts] and its verdict. `keys`: the
    draft's and the verdict's random keys (None when greedy)."""
    k_draft, k_accept = keys
    tic = time.perf_counter()
    draft, draft_probs, timed = target.tokens([]), None, True
    inputs = anchor_ids
    if width > 1:
        # A long backlog (a prompt's features the drafter could not settle during the prefill) makes
        # this round's time unrepresentative: the policy then learns only its acceptance.
        timed = drafter.backlog <= block_size
        # A drafter may offer fewer tokens than asked (adaptive k, no n-gram match).
        draft, draft_probs = drafter.propose(anchor, width - 1, params, k_draft)
        draft = target.tokens(draft)
        target.launch(draft, draft_probs)
        inputs = target.join(anchor_ids, draft)
    draft_s = time.perf_counter() - tic
    hidden, feats = target.forward(inputs, cache, capture)
    verdict = _verdict(target, target.head(hidden), draft, draft_probs, params, k_accept)
    target.launch(verdict)
    return _Round(draft.shape[0] + 1, draft, feats, verdict, draft_s, timed)


def _round_keys(target: TargetModel, key, greedy: bool) -> Iterator[tuple]:
    """Each round's (draft key, verdict key), split off `key` in turn; greedy rounds draw nothing."""
    while True:
        if greedy:
            yield None, None
        else:
            key, k_draft, k_accept = target.split(key, 2)
            yield k_draft, k_accept


def _commit(
    target: TargetModel, state: DecodeState, drafter: Drafter, rnd: _Round, anchor: int, values: list[int], stop: set
) -> tuple[list[int], bool]:
    """The tokens a read round commits (`values`: its verdict, then its draft), up to the first stop token, and
    whether one came. The target processed [anchor] + drafts; all after [anchor] + committed[:-1] is rolled
    back, and that much is what the drafter observes and `state.processed` gains."""
    accepted, nxt = values[0], values[1]
    committed = values[2 : 2 + accepted] + [nxt]
    stopped = False
    for i, t in enumerate(committed):
        if t in stop:
            committed, stopped = committed[: i + 1], True
            break
    m = len(committed)
    if rnd.width > m:  # never with a round queued behind this one: that only follows width 1
        target.trim(state.cache, rnd.width - m)
    processed = [anchor] + committed[:-1]
    drafter.observe(processed, rnd.feats[:m] if rnd.feats is not None else None)
    state.processed.extend(processed)
    return committed, stopped


def _speculative_steps(
    target: TargetModel,
    state: DecodeState,
    owner,
    drafter: Drafter,
    anchor: int,
    settings: GenerationSettings,
    key,
    stop: set,
    policy: WidthPolicy | None,
) -> Iterator[Step]:
    """The rounds after the first token: one host read each, the next round queued before the caller sees
    this one (on a lazy library), width-1 rounds queued one ahead. `state.ahead` counts the cache entries of
    queued rounds, undone when this generator is closed (or by the next generation on the state).
    `settings.block_size` is the widest verify, a number."""
    cache, params, max_tokens, block_size = state.cache, settings.sampling, settings.max_tokens, settings.block_size
    capture, keys = bool(drafter.target_layer_ids), _round_keys(target, key, params.greedy)
    generated = 1

    def width_for(context: int, committed: int) -> int:
        return min(policy.choose(context) if policy is not None else block_size, max_tokens - committed)

    def launch(anchor: int | None, anchor_ids: Array, width: int) -> _Round:
        rnd = _launch(target, drafter, cache, capture, params, next(keys), anchor, anchor_ids, width, block_size)
        state.ahead += rnd.width  # its forward sits in the cache past `state.processed`
        return rnd

    queued: _Round | None = None  # the next round, already on the device
    planned: int | None = None  # the next round's width, chosen before this round was read
    last_read = time.perf_counter()
    try:
        while generated < max_tokens:
            context = len(state.processed) + 1  # positions the current round's anchor sits after, plus one
            if queued is None:
                width = planned if planned is not None else width_for(context, generated)
                planned = None
                queued = launch(anchor, target.tokens([anchor]), width)
            rnd, queued = queued, None
            if rnd.width == 1 and generated + 1 < max_tokens:
                # Plain round: choose the next width now; if it is plain too, queue its forward on this
                # round's (unread) token before reading, as `_plain_steps` does.
                planned = width_for(context + 1, generated + 1)
                if planned == 1:
                    planned = None
                    queued = launch(None, rnd.verdict[1:], 1)
            values = target.read(rnd.verdict, rnd.draft)
            now = time.perf_counter()
            committed, stopped = _commit(target, state, drafter, rnd, anchor, values, stop)
            state.ahead = queued.width if queued is not None else 0
            if policy is not None:
                policy.observe_round(rnd.width, values[0], context, now - last_read, rnd.timed)
            round_s, last_read = now - last_read, now
            target.memory.tick(generated, generated + len(committed))
            generated += len(committed)
            anchor = committed[-1]
            if not stopped and generated < max_tokens and queued is None and target.lazy:
                # Queue the next round before handing this one over. Only where work is lazy: torch computes a
                # draft the moment it is asked for, and its drafter could then no longer roll this round back.
                width = planned if planned is not None else width_for(len(state.processed) + 1, generated)
                planned = None
                queued = launch(anchor, target.tokens([anchor]), width)
            if (queued is None or queued.width == 1) and drafter.backlog >= block_size:
                target.launch(*drafter.settle())  # plain rounds: project their context in batches, off the read
            yield Step(
                committed,
                drafted=rnd.width - 1,
                draft_s=rnd.draft_s,
                verify_s=max(round_s - rnd.draft_s, 0.0),
                stopped=stopped,
            )
            if stopped:
                return
    finally:
        if state.owner is owner and state.ahead:  # queued rounds' forwards ran ahead: undo them
            if queued is not None:
                target.sync(queued.verdict)
            target.trim(cache, state.ahead)
            state.ahead = 0


def _next_token(target: TargetModel, cache, token: Array, params: SamplingParams, key) -> Array:
    """Run one token through the target and pick the next one, lazily where the library is lazy."""
    hidden, _ = target.forward(token, cache, capture=False)
    return pick(target, target.head(hidden[-1:]), params, key)[0]


def _plain_steps(
    target: TargetModel, state: DecodeState, owner, anchor: int, params, key, budget: int, stop: set
) -> Iterator[Step]:
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
    sub = None
    if not params.greedy:
        key, sub = target.split(key, 1)
    nxt = _next_token(target, cache, target.tokens([anchor]), params, sub)
    state.processed.append(anchor)
    target.launch(nxt)
    try:
        for i in range(budget):
            ahead = None
            if i + 1 < budget:
                if not params.greedy:
                    key, sub = target.split(key, 1)
                ahead = _next_token(target, cache, nxt, params, sub)
                target.launch(ahead)
            token = target.read(nxt)[0]
            if ahead is not None:
                state.ahead = 1  # `token` is in the cache, not yet committed to `processed`
            now = time.perf_counter()
            stopped = token in stop
            target.memory.tick(i, i + 1)
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
