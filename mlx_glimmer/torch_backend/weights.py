"""Bundle weights as torch tensors: read with MLX, dequantized with `mx.dequantize`, renamed for transformers.

Reading through MLX is deliberate: the torch model then holds exactly the
values MLX computes with (an affine-quantized weight dequantizes to
`scales * q + biases`, the same numbers MLX's quantized matmul uses), so the
two backends differ only in arithmetic, never in weights.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import numpy as np
import torch
from torch import nn

from ..errors import GlimmerError

MUSE_TYPES = ("muse_glimmer", "muse_glimmer_text")
# Keys of an mlx-lm config.json that are not model settings for transformers.
NOT_MODEL_KEYS = (
    "quantization",
    "quantization_config",
    "dtype",
    "torch_dtype",
    "transformers_version",
    "architectures",
)
# The vision half of a MuseGlimmerConfig we never run: as small as the class accepts.
TINY_VISION = dict(
    num_hidden_layers=1, hidden_size=8, intermediate_size=8, num_attention_heads=1, pos_emb_height=2, pos_emb_width=2
)
VISION_PREFIXES = ("model.vision_tower.", "model.vision_adapter.", "model.vision_projection.", "model.perception")


def _spec(quant: dict, module: str) -> dict:
    override = quant.get(module)
    spec = {"group_size": quant.get("group_size"), "bits": quant.get("bits"), "mode": quant.get("mode", "affine")}
    if isinstance(override, dict):
        spec.update({k: override[k] for k in ("group_size", "bits", "mode") if k in override})
    return spec


def dequantize(weights: dict[str, mx.array], quant: dict | None, where: Path) -> dict[str, mx.array]:
    """Replace every (weight, scales, biases) triplet by its float matrix, as MLX computes it."""
    out = {}
    for name, value in weights.items():
        module, _, leaf = name.rpartition(".")
        if leaf in ("scales", "biases") and f"{module}.weight" in weights and f"{module}.scales" in weights:
            continue
        if leaf == "weight" and f"{module}.scales" in weights:
            if not quant:
                raise GlimmerError(
                    f"{where / 'config.json'}: {module} is quantized but there is no 'quantization' block"
                )
            spec = _spec(quant, module)
            value = mx.dequantize(
                value,
                weights[f"{module}.scales"],
                weights.get(f"{module}.biases"),
                group_size=spec["group_size"],
                bits=spec["bits"],
                mode=spec["mode"],
            )
        out[name] = value
    return out


def to_torch(value: mx.array, dtype: torch.dtype) -> torch.Tensor:
    """An MLX array as a torch tensor; floats are widened to float32 first (exact) and then cast."""
    if mx.issubdtype(value.dtype, mx.floating):
        return torch.from_numpy(np.array(value.astype(mx.float32))).to(dtype)
    return torch.from_numpy(np.array(value))


def transformers_name(name: str, model_type: str) -> str:
    """mlx-lm's weight name -> transformers' (mlx-lm keeps transformers' names except Muse's text-tower prefix)."""
    if model_type in MUSE_TYPES and name.startswith("model."):
        return "model.language_model." + name[len("model.") :]
    return name


@contextmanager
def empty_parameters():
    """Build modules with their parameters on the meta device (no memory, no init); buffers stay real."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=False)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def assign(model: nn.Module, state: dict[str, torch.Tensor], where: Path, optional=()) -> None:
    """Load `state` into a model built by `empty_parameters`; anything left unset must be `optional`."""
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if unexpected:
        raise GlimmerError(
            f"{where}: weights transformers' {type(model).__name__} does not have: {sorted(unexpected)[:5]}"
        )
    left = [n for n, p in model.named_parameters() if p.is_meta]
    bad = [n for n in left if not n.startswith(tuple(optional))]
    if bad:
        raise GlimmerError(f"{where}: no weights for {bad[:5]} of transformers' {type(model).__name__}")
    for name in left:  # unused parts (Muse's vision tower): zeros, never run
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        meta = module._parameters[leaf]
        module._parameters[leaf] = nn.Parameter(torch.zeros(meta.shape, dtype=meta.dtype), requires_grad=False)
