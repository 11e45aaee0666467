"""The block-drafter families, found by a checkpoint's config.json, each with its config, model and drafter.

    "dflash"   Meta's `muse_glimmer_assistant` or a z-lab `DFlashDraftModel` (`dflash.py`)
    "dflash2"  z-lab `DFlash2DraftModel`: conv + candidate selector (`dflash2.py`)
    "dspark"   a DSpark head: Markov bias + confidence head (`dspark.py`)

Any other model directory is a classic draft model (`DRAFT_MODEL`, `draft_model.py`): an
autoregressive LM sharing the target's tokenizer. Loading (`mlx_glimmer.loading`) and
conversion (`mlx_glimmer.convert.drafter_plan`) look a family up here instead of branching on it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..files import check_regular_file
from .block import BlockDrafter
from .config import DrafterConfig
from .dflash import DFlashDrafter, DFlashModel
from .dflash2 import DFlash2Config, DFlash2Drafter, DFlash2Model
from .dspark import DSparkConfig, DSparkDrafter, DSparkModel
from .loading import checked_config, load_block_model

DRAFT_MODEL = "draft-model"  # not a block family: any other causal LM


@dataclass(frozen=True)
class Family:
    """One block-drafter family: how to read its config, build its model and bind it to a target."""

    kind: str
    config_class: type[DrafterConfig]
    model_class: type
    drafter_class: type[BlockDrafter]

    def checked_config(self, path: Path, target) -> DrafterConfig:
        """The checkpoint's config, checked against `target` (either backend), with its weight files."""
        return checked_config(path, target, self.config_class)

    def load(self, path: Path, target) -> BlockDrafter:
        """The checkpoint at `path` as a drafter bound to `target` (MLX)."""
        cfg = self.checked_config(path, target)
        return self.drafter_class(load_block_model(path, cfg, self.model_class), target)


FAMILIES: dict[str, Family] = {
    f.kind: f
    for f in (
        Family("dflash", DrafterConfig, DFlashModel, DFlashDrafter),
        Family("dflash2", DFlash2Config, DFlash2Model, DFlash2Drafter),
        Family("dspark", DSparkConfig, DSparkModel, DSparkDrafter),
    )
}


def family_of(raw: dict) -> str | None:
    """ "dflash2" / "dspark" / "dflash" for a block drafter's config, None for anything else."""
    arch = " ".join(raw.get("architectures") or []).lower()
    block = raw.get("dflash_config") or {}
    if "dflash2" in arch or any(k in block for k in ("selector_top_k", "conv_kernel_size")):
        return "dflash2"
    if "dspark" in arch or any(k in raw for k in ("markov_rank", "dspark_markov_rank", "dspark_block_size")):
        return "dspark"
    if raw.get("model_type") == "muse_glimmer_assistant" or "dflash_config" in raw or "dflashdraftmodel" in arch:
        return "dflash"
    return None


def drafter_kind(path: Path) -> str:
    """The block-drafter family of a model directory, or `DRAFT_MODEL` for any other (a causal LM).

    An unreadable config.json counts as "dflash": loading it then names the problem. One that is not a regular
    file (a FIFO would wait for a writer) is that error at once."""
    check_regular_file(Path(path) / "config.json", "drafter config")
    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return "dflash"
    return (family_of(raw) if isinstance(raw, dict) else None) or DRAFT_MODEL
