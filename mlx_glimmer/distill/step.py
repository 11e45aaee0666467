"""The training step's contract: what the trainer (train.py) and both step backends (train.MLXStep,
torch_step.TorchStep) share, so neither backend imports the trainer.

    TrainConfig    the recipe's settings
    Batch          one optimiser step's inputs (numpy), built by `Trainer.batch`
    TrainStep      what a backend does with a Batch
    learning_rate  the schedule both backends follow
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ..errors import GlimmerError

if TYPE_CHECKING:  # annotations only: the CLI reads TrainConfig's defaults without importing numpy
    import numpy as np


@dataclass
class TrainConfig:
    layers: int = 4
    mlp_width: float = 1.0  # drafter MLP hidden size as a multiple of the target's intermediate size
    context_layers: int = 5
    block_size: int = 16
    anchors: int = 16  # blocks per sequence per step: an answer's blocks share its context, so steps teach, not blocks
    sequences_per_step: int = 4
    draft_vocab_size: int | None = 8192  # the most emitted tokens (all when fewer); None: every emitted token
    init: str = "random"  # "random", "target", "target:L1,L2,...", or a drafter directory to fine-tune
    gamma: float = 7.0
    learning_rate: float = 6e-4
    warmup: int = 100
    steps: int = 4000
    weight_decay: float = 0.01
    seed: int = 0
    eval_every: int = 500
    checkpoint_every: int = 250
    backend: str = "mlx"  # "mlx" or "torch" (see TrainStep)
    precision: str = "bfloat16"  # torch: "bfloat16" autocast or "float32" matmuls (weights stay float32 either way)
    compile: bool = True  # torch: torch.compile the step, once per context width before the first step (minutes)
    context_multiple: int = 64  # contexts padded to a multiple of this: few distinct shapes, each compiled once
    train_tags: tuple[str, ...] | None = (
        None  # answers drawn for steps: these tags only (None: all); features cover all
    )
    soft_labels: float = 0.0  # weight of the target's next-token distribution in each label; 0: the answer's token
    context_scale: str = "raw"  # "raw" or "channel": train `fc` on features divided by each channel's RMS


def target_init_layers(init: str, target_layers: int, drafter_layers: int) -> list[int] | None:
    """The target layers an `init` of "target" or "target:L1,L2,..." starts the drafter from, in drafter layer
    order; None for any other init. Plain "target" takes the target's last `drafter_layers` layers: the layers
    that turn the deepest features into next-token predictions, which is the drafter's job too. A list shorter
    than the drafter grows it by identity layers. A layer named twice is refused: two drafter layers starting
    as copies of one target layer is almost surely a typo, and the report would not say so."""
    if init == "target":
        return list(range(max(0, target_layers - drafter_layers), target_layers))
    if not init.startswith("target:"):
        return None
    if not re.fullmatch(r"target:\d+(,\d+)*", init):
        raise GlimmerError(f"--init {init}: not 'target:' and comma-separated target layer numbers")
    ids = [int(part) for part in init.removeprefix("target:").split(",")]
    bad = [i for i in ids if not i < target_layers]
    if bad:
        raise GlimmerError(f"--init {init}: layers {bad} out of range for a {target_layers}-layer target")
    twice = sorted({i for i in ids if ids.count(i) > 1})
    if twice:
        raise GlimmerError(f"--init {init}: layers {twice} named more than once; name each target layer once")
    if len(ids) > drafter_layers:
        raise GlimmerError(f"--init {init}: names {len(ids)} layers for a {drafter_layers}-layer drafter")
    return ids


def learning_rate(step: int, config: TrainConfig) -> float:
    """Linear warm-up to the peak, then cosine decay to 5% of it at `config.steps`."""
    peak = config.learning_rate
    if step < config.warmup:
        return peak * step / max(config.warmup, 1)
    progress = min(1.0, (step - config.warmup) / max(1, config.steps - config.warmup))
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass
class Batch:
    """One optimiser step's inputs: S answers x A blocks of B positions (numpy; blocks past an answer's
    anchors are padding with `valid` 0)."""

    ctx: np.ndarray  # [S, T, k*H] float16 target features, zero past each sequence's end
    block_ids: np.ndarray  # [S, A, B] the anchor token, then mask tokens
    anchors: np.ndarray  # [S, A] position of each block's anchor
    labels: np.ndarray  # [S, A, B-1] draft-vocabulary ids of the target's next B-1 tokens (0 where not valid)
    valid: np.ndarray  # [S, A, B-1] float32, 1 where supervised
    teacher: np.ndarray | None = None  # [S, A, B-1, H] float16 final hidden states predicting each label (soft labels)

    @property
    def positions(self) -> float:
        return float(self.valid.sum())


class TrainStep(Protocol):
    def __call__(self, batch: Batch) -> float:
        """One optimiser step on `batch`; returns its loss."""

    def loss(self, batch: Batch) -> float:
        """The loss on `batch`, weights unchanged."""

    def warm_up(self, batch: Batch) -> None:
        """Run `batch`'s forward and backward once, weights and optimiser unchanged (compiles its shapes)."""

    def sync(self) -> None:
        """Bring the MLX drafter's weights up to date (before evaluating or saving)."""

    def save_optimizer(self, path: Path) -> None: ...

    def load_optimizer(self, path: Path) -> None:
        """Restore the optimiser state, after the MLX drafter's weights were restored."""
