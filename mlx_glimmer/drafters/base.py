"""The drafter contract: what the speculative loop asks of anything that proposes tokens.

Every drafter inherits `Drafter`: the block drafters (`block.py`), the classic draft model, prompt lookup and
the torch assistant. What a drafter may go without has a default here, so the loop never probes for it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from ..settings import SamplingParams


@dataclass
class Marginals:
    """What one drafter forward says about each draft position: `log_probs` [D, V'] for positions 1..D,
    over the target's vocabulary or, with `vocab` (column -> token id), over the drafter's own."""

    log_probs: Any
    vocab: Any = None


class Drafter(ABC):
    """Proposes the tokens the target verifies; its arrays are its target's kind (MLX or torch)."""

    kind: str  # name for stats ("dflash", ...)
    block_size: int  # default verify width: drafted tokens + the anchor
    target_layer_ids: tuple[int, ...] = ()  # target layers whose outputs it reads
    model: Any = None  # its weights, kept resident while it drafts
    adaptive: bool = False  # chooses how many tokens to draft each round, at most `max_k`
    max_k: int = 0
    backlog: int = 0  # observed positions not yet projected into its context
    has_marginals: bool = False  # `marginals` answers: it can seed draft trees

    @abstractmethod
    def reset(self) -> None:
        """Start a new sequence."""

    @abstractmethod
    def observe(self, tokens: list[int], features: Any) -> None:
        """The next n committed token ids the target has processed, and their features [n, k*H] (None
        without `target_layer_ids`)."""

    @abstractmethod
    def propose(self, anchor: int, count: int, params: SamplingParams, noise: Any) -> tuple[Any, Any]:
        """At most `count` draft tokens after `anchor`, and the distributions [n, V] they were drawn from
        (None: chosen deterministically). Sampled, `noise` is the first draft token's noise (`noise.Noise`): a
        draft sampled with it (`sampling.sample`, row i with `noise.at(i)`) is kept wherever it equals the
        target's own sample."""

    def marginals(self, anchor: int, count: int) -> Marginals | None:
        """Per-position distributions of up to `count` draft positions after `anchor` from one forward (the
        material of a draft tree, `tree.py`); None where the drafter has none (it drafts a chain)."""
        return None

    def rollback(self, n: int) -> bool:
        """Forget the last n observed positions; False (and no change) if it cannot."""
        return False

    def settle(self) -> list:
        """Project the backlog into the context now; the arrays to evaluate (with a prefill chunk, or launched
        during plain rounds), so no round's draft pays for a prompt's context."""
        return []
