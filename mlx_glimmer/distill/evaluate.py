"""Held-out acceptance: what a drafter actually buys, measured with the real speculative loop."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..drafters.dflash import DFlashDrafter, DFlashModel
from ..settings import GenerationSettings
from ..speculative import generate_steps
from ..target import Target


@dataclass
class AcceptanceReport:
    per_prompt: list[float]  # mean tokens committed per target forward, one per prompt
    tokens: int
    forwards: int

    @property
    def mean(self) -> float:
        """Tokens per target forward over all prompts together (DESIGN's mean acceptance)."""
        return self.tokens / max(self.forwards, 1)


def heldout_acceptance(
    target: Target,
    model: DFlashModel,
    prompts: list[list[int]],
    *,
    max_tokens: int = 128,
    block_size: int = 16,
    tree: int = 0,
    stop_ids=(),
) -> AcceptanceReport:
    """Greedy tokens per target forward with a chain of `block_size` verified tokens every round, or with
    `tree` > 0 a draft tree of `tree` nodes under the anchor every round."""
    drafter = DFlashDrafter(model, target)
    settings = (
        GenerationSettings(max_tokens=max_tokens, tree=tree)
        if tree
        else GenerationSettings(max_tokens=max_tokens, block_size=block_size)
    )
    per_prompt, tokens, forwards = [], 0, 0
    for ids in prompts:
        steps = list(generate_steps(target, ids, settings, drafter=drafter, stop_ids=stop_ids))
        rounds = [len(s.tokens) for s in steps[1:]]
        if rounds:
            per_prompt.append(float(np.mean(rounds)))
            tokens += sum(rounds)
            forwards += len(rounds)
    return AcceptanceReport(per_prompt, tokens, forwards)
