"""The drafter of a bundle: a `muse_glimmer_assistant` (or z-lab DFlash) checkpoint checked against its target."""

from __future__ import annotations

from ..drafter import DFlashModel, DrafterConfig
from ..errors import GlimmerError
from ..families import family_of
from ..loading import validate_pair
from .plan import ModelPlan, finish_config, match_weights, read_config
from .quantize import FLOAT_DTYPES, QuantSpec, TensorItem, weight_specs
from .safetensors_stream import checkpoint_tensors
from .sources import Source


def drafter_config_dict(cfg: DrafterConfig) -> dict:
    d = cfg.to_dict()
    # z-lab checkpoints reach one position less than transformers' mask; to_dict does not say so.
    if cfg.context_reach != cfg.sliding_window:
        d["context_reach"] = cfg.context_reach
    return d


def plan_drafter(source: Source, target, bits: int, group_size: int, dtype_name: str) -> ModelPlan:
    """`target`: a `Target` (possibly over a lazily built model) the drafter must fit."""
    if source.kind != "dir":
        raise GlimmerError(f"{source.path}: a drafter must be a safetensors checkpoint directory")
    config_path = source.path / "config.json"
    raw = read_config(source.path)
    kind = family_of(raw)
    if kind in ("dflash2", "dspark"):
        from .family_plan import plan_family_drafter

        return plan_family_drafter(kind, source, raw, target, bits, group_size, dtype_name)
    cfg = DrafterConfig.from_dict(raw)
    if raw.get("model_type") != "muse_glimmer_assistant" and cfg.source_format != "dflash":
        raise GlimmerError(
            f"{config_path}: model_type {raw.get('model_type')!r} is not a DFlash drafter "
            "(expected muse_glimmer_assistant or a z-lab DFlash config)"
        )
    if cfg.vocab_size is None:
        cfg.vocab_size = target.vocab_size
    if cfg.num_target_layers is None:
        cfg.num_target_layers = target.num_layers
    validate_pair(target, cfg, source.path)
    model = DFlashModel(cfg)
    tensors = DFlashModel.sanitize(checkpoint_tensors(source.path))
    match_weights(tensors, model, source.path, "the drafter described by its config.json")

    default = QuantSpec(bits, group_size) if bits < 16 else None
    quantized = weight_specs(model, tensors, bits, group_size, None)
    dtype = FLOAT_DTYPES[dtype_name]
    items = [
        TensorItem(name, ref, dtype, quantized.get(name))
        for name, ref in sorted(tensors.items(), key=lambda kv: (str(kv[1].file), kv[1].offset))
    ]
    return ModelPlan(
        name="drafter",
        source=source,
        config=finish_config(drafter_config_dict(cfg), quantized, dtype_name, default),
        items=items,
        quantized=quantized,
        model=model,
    )
