"""A model's conversion worked out before a byte is written: output config, tensors, extra files.

Planning reads configs and safetensors headers only; every user mistake
(missing shard, truncated file, unknown model type, mismatched weights) is
found here, before the bundle's temporary directory exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_glimmer.errors import GlimmerError

from .quantize import QuantSpec, quantization_config
from .sources import Source


@dataclass
class ModelPlan:
    name: str  # the bundle subdirectory: "target" | "drafter"
    source: Source
    config: dict  # config.json as written
    items: list  # safetensors_stream.Item, in source order
    quantized: dict[str, QuantSpec] = field(default_factory=dict)
    dropped: int = 0  # source tensors left out (vision tower, projector, ...)
    write_extras: Callable[[Path], None] = lambda out_dir: None  # tokenizer files and the like
    model: nn.Module | None = None  # the lazily built mlx model (never evaluated)

    @property
    def source_bytes(self) -> int:
        return sum(item.source_bytes for item in self.items)


def expected_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of a lazily built model (nothing is evaluated)."""
    return {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}


def match_weights(tensors: Mapping[str, object], model: nn.Module, where: Path, what: str) -> None:
    """Every parameter of `model` present with its shape, and nothing else (mlx-lm loads strictly)."""
    expected = expected_shapes(model)
    missing = [k for k in expected if k not in tensors]
    if missing:
        raise GlimmerError(
            f"{where}: tensor {missing[0]} is missing ({len(missing)} missing in all; {what} needs them)"
        )
    for name, ref in tensors.items():
        if name not in expected:
            raise GlimmerError(f"{_file_of(ref, where)}: unexpected tensor {name} for {what}")
        if tuple(ref.shape) != expected[name]:
            raise GlimmerError(
                f"{_file_of(ref, where)}: tensor {name} has shape {list(ref.shape)}, "
                f"but config.json implies {list(expected[name])}"
            )


def _file_of(ref, default: Path) -> Path:
    return getattr(ref, "file", default)


def finish_config(config: dict, quantized: dict[str, QuantSpec], dtype_name: str, default: QuantSpec | None) -> dict:
    """Drop a source's quantization and dtype keys and write ours the way mlx-lm expects."""
    config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config", "torch_dtype")}
    config["dtype"] = dtype_name
    block = quantization_config(quantized, default)
    if block is not None:
        config["quantization"] = block
        config["quantization_config"] = block
    return config
