"""MLX affine quantization of one weight at a time, and the config block mlx-lm reads.

Which weights get quantized follows `mlx_lm.utils.quantize_model`: the
`.weight` of every module with `to_quantized` (Linear, Embedding, ...),
subject to the model's own `quant_predicate`. Everything else (norms, 1-D
tensors) stays float. Where mlx-lm silently leaves a weight float because the
group size does not divide its input width, we never do: such a weight takes
the largest supported group size that divides its width (recorded per weight
in config.json), and a width no supported group size divides is an error.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_glimmer.errors import GlimmerError

from .formats import FLOAT_DTYPE_NAMES, GROUP_SIZES  # noqa: F401  (GROUP_SIZES re-exported)
from .safetensors_stream import CHUNK_BYTES, MX_CODES, num_rows

EMBED_AND_HEAD = ("embed_tokens.weight", "lm_head.weight")
FLOAT_DTYPES = {name: getattr(mx, name) for name in FLOAT_DTYPE_NAMES}


@dataclass(frozen=True)
class QuantSpec:
    bits: int
    group_size: int

    def to_dict(self) -> dict:
        return {"group_size": self.group_size, "bits": self.bits, "mode": "affine"}

    def packed_shapes(self, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of the packed weight and of the scales/biases for a float weight of `shape`."""
        *lead, cols = shape
        return (*lead, cols * self.bits // 32), (*lead, cols // self.group_size)


class Source(Protocol):
    shape: tuple[int, ...]
    nbytes: int
    is_float: bool

    def read_rows(self, start: int, stop: int) -> mx.array: ...


@dataclass
class TensorItem:
    """A source tensor written as float (cast to `dtype`) or as an affine-quantized triplet."""

    name: str
    source: Source
    dtype: mx.Dtype
    quant: QuantSpec | None = None

    @property
    def rows(self) -> int:
        return num_rows(self.source.shape)

    @property
    def source_bytes(self) -> int:
        return self.source.nbytes

    def chunk_rows(self) -> int:
        return max(1, CHUNK_BYTES * self.rows // max(self.source.nbytes, 1))

    def outputs(self) -> list[tuple[str, str, tuple[int, ...]]]:
        shape = tuple(self.source.shape)
        if self.quant is None:
            code = MX_CODES[self.dtype] if self.source.is_float else self.source.dtype
            return [(self.name, code, shape)]
        base = self.name.removesuffix(".weight")
        packed, groups = self.quant.packed_shapes(shape)
        code = MX_CODES[self.dtype]
        return [(f"{base}.weight", "U32", packed), (f"{base}.scales", code, groups), (f"{base}.biases", code, groups)]

    def produce(self, start: int, stop: int) -> list[mx.array]:
        x = self.source.read_rows(start, stop)
        if self.source.is_float:
            x = x.astype(self.dtype)
        if self.quant is None:
            return [x]
        return list(mx.quantize(x, group_size=self.quant.group_size, bits=self.quant.bits))


def quantizable_weights(model: nn.Module, names, spec: QuantSpec) -> dict[str, QuantSpec]:
    """weight name -> how to quantize it, for the weights mlx-lm would quantize in `model`."""
    modules = dict(tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module))
    predicate = getattr(model, "quant_predicate", None)
    out = {}
    for name in names:
        if not name.endswith(".weight"):
            continue
        path = name.removesuffix(".weight")
        module = modules.get(path)
        if module is None or not hasattr(module, "to_quantized"):
            continue
        choice = predicate(path, module) if predicate is not None else True
        if not choice:
            continue
        if isinstance(choice, dict):
            if choice.get("mode", "affine") != "affine":
                continue
            wanted = QuantSpec(choice.get("bits", spec.bits), choice.get("group_size", spec.group_size))
        else:
            wanted = spec
        out[name] = fit_group_size(name, module.weight.shape[-1], wanted)
    return out


def fit_group_size(name: str, width: int, spec: QuantSpec) -> QuantSpec:
    """`spec`, or the same bits with the largest supported group size dividing `width`."""
    if width % spec.group_size == 0 or spec.bits >= 16:
        return spec
    for g in sorted(GROUP_SIZES, reverse=True):
        if width % g == 0:
            return QuantSpec(spec.bits, g)
    raise GlimmerError(
        f"{name}: input width {width} is not divisible by group size {spec.group_size} or any supported group size "
        f"({', '.join(map(str, GROUP_SIZES))}); convert with --bits 16 to keep it float"
    )


def weight_specs(model: nn.Module, names, bits: int, group_size: int, embed_bits: int | None) -> dict[str, QuantSpec]:
    """The weights to quantize and how: `bits` for all, `embed_bits` for the token embedding and
    output head; 16 bits means float (left out)."""
    specs = quantizable_weights(model, names, QuantSpec(bits, group_size))
    if embed_bits is not None:
        specs.update({k: QuantSpec(embed_bits, s.group_size) for k, s in specs.items() if k.endswith(EMBED_AND_HEAD)})
    return {k: s for k, s in specs.items() if s.bits < 16}


def quantization_config(specs: dict[str, QuantSpec], default: QuantSpec | None = None) -> dict | None:
    """The config.json `quantization` block: a default plus one entry per weight that differs."""
    if not specs:
        return None
    if default is None:
        default = Counter(specs.values()).most_common(1)[0][0]
    block = default.to_dict()
    for name, spec in sorted(specs.items()):
        if spec != default:
            block[name.removesuffix(".weight")] = spec.to_dict()
    return block
