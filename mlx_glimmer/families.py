"""Which block-drafter family a checkpoint's config.json describes, and how to open it.

Three families run on the one speculative loop:
    "dflash"   Meta's `muse_glimmer_assistant` or a z-lab `DFlashDraftModel` (mlx_glimmer.drafter)
    "dflash2"  z-lab `DFlash2DraftModel`: conv + candidate selector (mlx_glimmer.dflash2)
    "dspark"   a DSpark head: Markov bias + confidence head (mlx_glimmer.dspark)
"""

from __future__ import annotations

from pathlib import Path

FAMILIES = ("dflash", "dflash2", "dspark")


def family_of(raw: dict) -> str | None:
    """"dflash2" / "dspark" / "dflash" for a block drafter's config, None for anything else."""
    arch = " ".join(raw.get("architectures") or []).lower()
    block = raw.get("dflash_config") or {}
    if "dflash2" in arch or any(k in block for k in ("selector_top_k", "conv_kernel_size")):
        return "dflash2"
    if "dspark" in arch or any(k in raw for k in ("markov_rank", "dspark_markov_rank", "dspark_block_size")):
        return "dspark"
    if raw.get("model_type") == "muse_glimmer_assistant" or "dflash_config" in raw or "dflashdraftmodel" in arch:
        return "dflash"
    return None


def family_classes(kind: str):
    """(config class with `from_raw`, model class) of a non-assistant family."""
    if kind == "dflash2":
        from .dflash2 import DFlash2Config, DFlash2Model

        return DFlash2Config, DFlash2Model
    if kind == "dspark":
        from .dspark import DSparkConfig, DSparkModel

        return DSparkConfig, DSparkModel
    raise ValueError(kind)


def load_family_drafter(kind: str, path: Path, target):
    if kind == "dflash2":
        from .dflash2 import load_dflash2_drafter

        return load_dflash2_drafter(path, target)
    from .dspark import load_dspark_drafter

    return load_dspark_drafter(path, target)
