"""The drafter of a bundle: a block-drafter checkpoint (DFlash, DFlash2 or DSpark) checked against its target.

The family comes from the checkpoint's config.json (`mlx_glimmer.drafters.registry`); every family goes
the same way: its config is checked against the target and for its own needs before a byte is written,
every tensor is matched to the family's (lazily built) model, weights are quantized the way mlx-lm
would (`--drafter-bits`), and the written config.json is the family's `to_dict()` with `vocab_size` and
`num_target_layers` filled in from the target: the assistant layout for DFlash (a z-lab checkpoint's
shorter `context_reach` included), the source config for DFlash2 and DSpark (so the bundle's drafter is
detected as the same family).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from mlx_glimmer.drafters.loading import validate_pair
from mlx_glimmer.drafters.registry import FAMILIES, family_of
from mlx_glimmer.errors import GlimmerError
from mlx_glimmer.files import read_config_json

from .plan import ModelPlan, finish_config, match_weights
from .quantize import FLOAT_DTYPES, QuantSpec, TensorItem, weight_specs
from .safetensors_stream import ITEMSIZE, TensorRef, checkpoint_tensors
from .sources import Source


@dataclass(frozen=True)
class DraftIdsFromOffsets:
    """`draft_vocab` (draft id -> token id) read from an EAGLE-3-style `d2t` tensor of offsets (token = id +
    d2t[id]), the form `mlx-glimmer export` writes for the engines; streamed like a `TensorRef`."""

    offsets: TensorRef
    dtype = "I32"
    is_float = False

    @property
    def file(self):
        return self.offsets.file

    @property
    def offset(self) -> int:
        return self.offsets.offset

    @property
    def shape(self) -> tuple[int, ...]:
        return self.offsets.shape

    @property
    def nbytes(self) -> int:
        return self.offsets.nbytes * 4 // ITEMSIZE[self.offsets.dtype]

    def read_rows(self, start: int, stop: int) -> mx.array:
        return (mx.arange(start, stop) + self.offsets.read_rows(start, stop)).astype(mx.int32)


def draft_vocab_from_maps(tensors: dict) -> dict:
    """An exported drafter's vocabulary maps (`d2t`, and the mask `t2d` it implies) as our `draft_vocab`."""
    if "d2t" not in tensors:
        return tensors
    out = {name: ref for name, ref in tensors.items() if name not in ("d2t", "t2d")}
    out["draft_vocab"] = DraftIdsFromOffsets(tensors["d2t"])
    return out


def plan_drafter(source: Source, target, bits: int, group_size: int, dtype_name: str) -> ModelPlan:
    """`target`: a `Target` (possibly over a lazily built model) the drafter must fit."""
    if source.kind != "dir":
        raise GlimmerError(f"{source.path}: a drafter must be a safetensors checkpoint directory")
    config_path = source.path / "config.json"
    raw = read_config_json(source.path, "drafter")
    kind = family_of(raw)
    if kind is None:
        raise GlimmerError(
            f"{config_path}: model_type {raw.get('model_type')!r} is not a block drafter (expected "
            "muse_glimmer_assistant, a z-lab DFlash / DFlash2 config or a DSpark head)"
        )
    family = FAMILIES[kind]
    cfg = family.config_class.from_raw(raw, config_path)
    if cfg.vocab_size is None:
        cfg.vocab_size = target.vocab_size
    if cfg.num_target_layers is None:
        cfg.num_target_layers = target.num_layers
    validate_pair(target, cfg, source.path)
    cfg.check(config_path)
    tensors = draft_vocab_from_maps(family.model_class.sanitize(checkpoint_tensors(source.path)))
    if not tensors:
        raise GlimmerError(f"{source.path}: no tensors for the drafter")
    cfg.adopt_weights(tensors)
    model = family.model_class(cfg)
    match_weights(tensors, model, source.path, f"the {kind} drafter described by its config.json")

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
        config=finish_config(cfg.to_dict(), quantized, dtype_name, default),
        items=items,
        quantized=quantized,
        model=model,
    )
