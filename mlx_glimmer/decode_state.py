"""What a generation yields and leaves behind: one `Step` per target call, and the `DecodeState` a
conversation's next turn resumes from (`resume` keeps the common prefix of the cache and rolls back the rest)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from .drafters.base import Drafter
from .errors import GlimmerError
from .logprobs import TokenLogprob
from .target_model import TargetModel


@dataclass
class Step:
    tokens: list[int]  # committed by this target call, ending at a stop token if one came
    drafted: int = 0  # draft tokens (chain drafts or tree nodes) offered to this verification: drafted + 1 verified
    accepted: int = 0  # drafts kept: the accepted path's depth
    tree: bool = False  # the drafts formed a tree (else a chain)
    source: str = ""  # who proposed the accepted path: "model", "lookup", "both" (nodes shared); "" if none kept
    # Host seconds spent proposing and launching the draft; the rest of the round (from the previous host read
    # to this one) is verify_s. The draft's device time runs in the same queued graph as the verify, so it
    # lands in verify_s: timing them apart would cost a second blocking sync per round.
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_tokens: int = 0  # > 0 only on the prefill step
    stopped: bool = False  # a stop token was committed (it is the last of `tokens`)
    logprobs: list[TokenLogprob] | None = None  # one per token of `tokens` when `settings.logprobs` asks


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


def resume(
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
