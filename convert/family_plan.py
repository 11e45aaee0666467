"""The drafter of a bundle when it is a DFlash2 or DSpark head (see mlx_glimmer.families).

Same rules as the assistant's plan: checked against the target before a byte
is written, every tensor matched to the family's model, weights quantized the
way mlx-lm would (`--drafter-bits`), the source config.json kept (so the
bundle's drafter is detected as the same family) with vocab_size and
num_target_layers filled in from the target.
"""

from __future__ import annotations

from ..errors import GlimmerError
from ..families import family_classes
from ..loading import validate_pair
from .plan import ModelPlan, finish_config, match_weights
from .quantize import FLOAT_DTYPES, QuantSpec, TensorItem, weight_specs
from .safetensors_stream import checkpoint_tensors
from .sources import Source


def plan_family_drafter(kind: str, source: Source, raw: dict, target, bits: int, group_size: int, dtype_name: str) -> ModelPlan:
    config_path = source.path / "config.json"
    config_class, model_class = family_classes(kind)
    cfg = config_class.from_raw(raw, config_path)
    if cfg.vocab_size is None:
        cfg.vocab_size = target.vocab_size
    if cfg.num_target_layers is None:
        cfg.num_target_layers = target.num_layers
    validate_pair(target, cfg, source.path)
    cfg.check(config_path)
    tensors = model_class.sanitize(checkpoint_tensors(source.path))
    if hasattr(cfg, "adopt_weights"):
        cfg.adopt_weights(tensors)
    model = model_class(cfg)
    match_weights(tensors, model, source.path, f"the {kind} drafter described by its config.json")

    default = QuantSpec(bits, group_size) if bits < 16 else None
    quantized = weight_specs(model, tensors, bits, group_size, None)
    dtype = FLOAT_DTYPES[dtype_name]
    items = [
        TensorItem(name, ref, dtype, quantized.get(name))
        for name, ref in sorted(tensors.items(), key=lambda kv: (str(kv[1].file), kv[1].offset))
    ]
    if not items:
        raise GlimmerError(f"{source.path}: no tensors for the drafter")
    return ModelPlan(
        name="drafter",
        source=source,
        config=finish_config(cfg.to_dict(), quantized, dtype_name, default),
        items=items,
        quantized=quantized,
        model=model,
    )
