"""The target of a bundle from a transformers-layout checkpoint: text tower only, as mlx-lm reads it."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

from mlx_lm.utils import _get_classes

from mlx_glimmer.errors import GlimmerError
from mlx_glimmer.files import read_config_json
from mlx_glimmer.loading import TEXT_PREFIXES

from .plan import ModelPlan, finish_config, match_weights
from .quantize import FLOAT_DTYPES, QuantSpec, TensorItem, weight_specs
from .safetensors_stream import DTYPES, checkpoint_tensors
from .sources import Source

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
# Model types whose transformers config nests the text tower under text_config (a VLM).
FLATTENED_TYPES = {"muse_glimmer"}
TEXT_MODEL_TYPES = {"muse_glimmer_text": "muse_glimmer"}
NON_TEXT_KEYS = ("vision", "projector", "image_", "video_", "audio", "out_hidden_size", "mm_", "architectures")


def text_config(config: dict) -> dict:
    """A VLM config with the text_config fields at top level and the vision fields gone."""
    model_type = TEXT_MODEL_TYPES.get(config["model_type"], config["model_type"])
    text = config.get("text_config")
    if model_type not in FLATTENED_TYPES or not isinstance(text, dict):
        return {**config, "model_type": model_type}
    out = {k: v for k, v in config.items() if k != "text_config" and not k.startswith(NON_TEXT_KEYS)}
    out.update(text)
    out["model_type"] = model_type
    return out


def text_tower(tensors: dict) -> tuple[dict, int]:
    """Keep the language model of a VLM-layout checkpoint; count what is dropped."""
    if not any(k.startswith(TEXT_PREFIXES[:2]) for k in tensors):
        return tensors, 0
    kept = {k: v for k, v in tensors.items() if k.startswith(TEXT_PREFIXES)}
    return kept, len(tensors) - len(kept)


def build_model(config: dict, config_path: Path):
    """mlx-lm's model class for `config`, built lazily: its parameters are never evaluated."""
    try:
        model_class, args_class = _get_classes(config)
    except ValueError:
        raise GlimmerError(f"{config_path}: model_type {config['model_type']!r} is not supported by mlx-lm") from None
    try:
        return model_class(args_class.from_dict(config))
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
        raise GlimmerError(f"{config_path}: cannot build mlx-lm's {config['model_type']} model from it ({e})") from None


def tokenizer_copier(src: Path) -> Callable[[Path], None]:
    files = [src / f for f in TOKENIZER_FILES if (src / f).is_file()] + sorted(src.glob("*.tiktoken"))
    if not any(f.name in VOCAB_FILES or f.suffix == ".tiktoken" for f in files):
        raise GlimmerError(f"{src}: no tokenizer files (tokenizer.json, tokenizer.model or vocab.json)")

    def copy(out_dir: Path) -> None:
        for f in files:
            shutil.copy2(f, out_dir / f.name)

    return copy


def plan_target(
    source: Source, bits: int, group_size: int, dtype_name: str, embed_bits: int | None = None
) -> ModelPlan:
    config_path = source.path / "config.json"
    raw = read_config_json(source.path, "target")
    if "model_type" not in raw:
        raise GlimmerError(f"{config_path}: no model_type field")
    if "quantization" in raw or "quantization_config" in raw:
        raise GlimmerError(f"{config_path}: the checkpoint is already quantized; convert from its float weights")
    config = text_config(raw)
    model = build_model(config, config_path)
    tensors, dropped = text_tower(checkpoint_tensors(source.path))
    try:
        tensors = model.sanitize(dict(tensors)) if hasattr(model, "sanitize") else tensors
    except (TypeError, AttributeError) as e:
        raise GlimmerError(
            f"{config_path}: model_type {config['model_type']!r} needs a weight transform the streaming converter "
            f"does not do ({e})"
        ) from None
    match_weights(tensors, model, source.path, f"mlx-lm's {config['model_type']} model")

    dtype = FLOAT_DTYPES[dtype_name]
    default = QuantSpec(bits, group_size) if bits < 16 else None
    quantized = weight_specs(model, tensors, bits, group_size, embed_bits)
    keep_dtype = getattr(model, "cast_predicate", None)
    items = []
    for name, ref in sorted(tensors.items(), key=lambda kv: (str(kv[1].file), kv[1].offset)):
        out_dtype = dtype if keep_dtype is None or keep_dtype(name) else DTYPES[ref.dtype][1]
        items.append(TensorItem(name, ref, out_dtype, quantized.get(name)))
    return ModelPlan(
        name="target",
        source=source,
        config=finish_config(config, quantized, dtype_name, default),
        items=items,
        quantized=quantized,
        dropped=dropped,
        write_extras=tokenizer_copier(source.path),
        model=model,
    )


def target_shape_probe(plan: ModelPlan):
    """A `Target` over the lazily built model: enough for `validate_pair` (nothing is evaluated)."""
    from mlx_glimmer.target import Target

    return Target(plan.model, plan.config)
