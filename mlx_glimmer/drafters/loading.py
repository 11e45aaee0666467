"""Reading a block drafter's checkpoint: the one config reader (checked against its target) and the one
weight loader, which honours mlx-lm's per-module quantization entries (a weight quantized with another group
size than the default, as `convert` writes when the default does not divide its width)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..errors import GlimmerError
from ..files import check_regular_file, check_weight_files, read_config_json
from .config import DrafterConfig


def read_drafter_config(path: Path, config_class: type[DrafterConfig] = DrafterConfig) -> DrafterConfig:
    """The one config reader: a drafter directory's config.json as `config_class`."""
    path = Path(path)
    return config_class.from_raw(read_config_json(path, "drafter"), path / "config.json")


def validate_pair(target, cfg: DrafterConfig, drafter_path: Path) -> None:
    """Does this drafter config fit `target` (a `TargetModel` on either backend)?"""
    where = Path(drafter_path) / "config.json"
    if cfg.hidden_size != target.hidden_size:
        raise GlimmerError(f"{where}: hidden_size {cfg.hidden_size} does not match the target's {target.hidden_size}")
    n = target.num_layers
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < n]
    if bad:
        raise GlimmerError(f"{where}: target_layer_ids {bad} out of range for a {n}-layer target")
    if cfg.num_target_layers is not None and cfg.num_target_layers != n:
        raise GlimmerError(f"{where}: num_target_layers {cfg.num_target_layers} does not match the target's {n} layers")
    if cfg.vocab_size is not None and cfg.vocab_size != target.vocab_size:
        raise GlimmerError(f"{where}: vocab_size {cfg.vocab_size} does not match the target's {target.vocab_size}")
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        raise GlimmerError(
            f"{where}: mask_token_id {cfg.mask_token_id} is outside the target's vocabulary ({target.vocab_size})"
        )
    if cfg.block_size < 2:
        raise GlimmerError(f"{where}: block_size {cfg.block_size} must be at least 2")


def checked_config(path: Path, target, config_class: type[DrafterConfig] = DrafterConfig) -> DrafterConfig:
    """A drafter's config, checked against `target` (either backend) and for its own needs, with its weight files."""
    path = Path(path)
    cfg = read_drafter_config(path, config_class)
    if cfg.vocab_size is None and cfg.NEEDS_VOCAB:
        cfg.vocab_size = target.vocab_size
    validate_pair(target, cfg, path)
    cfg.check(path / "config.json")
    check_weight_files(path)
    return cfg


def read_weights(path: Path, what: str) -> dict[str, mx.array]:
    """All model*.safetensors tensors of a model directory, as MLX arrays."""
    files = sorted(Path(path).glob("model*.safetensors"))
    if not files:
        raise GlimmerError(f"{path}: no model*.safetensors weights for the {what}")
    weights = {}
    for f in files:
        check_regular_file(f, f"{what} weights file")  # mx.load would wait on a FIFO
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:  # a truncated or foreign file
            raise GlimmerError(f"{f}: cannot read safetensors ({e})") from None
    return weights


def load_block_weights(model: nn.Module, path: Path, weights: dict[str, mx.array]) -> nn.Module:
    """Load `weights` into `model` strictly, quantized as its config.json's `quantization` block says:
    the default `group_size`/`bits`, or a module's own entry (mlx-lm's per-module layout) where it has one."""
    path = Path(path)
    quant = read_config_json(path, "drafter").get("quantization")
    if quant:

        def quantized_here(p, m):
            if not (hasattr(m, "to_quantized") and f"{p}.scales" in weights):
                return False
            own = quant.get(p)
            return {k: own[k] for k in ("group_size", "bits", "mode") if k in own} if isinstance(own, dict) else True

        nn.quantize(
            model, group_size=quant.get("group_size", 64), bits=quant.get("bits", 4), class_predicate=quantized_here
        )
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise GlimmerError(f"{path}: drafter weights do not match its config.json ({e})") from None
    mx.eval(model.parameters())
    model.eval()
    return model


def load_block_model(path: Path, cfg: DrafterConfig, model_class) -> nn.Module:
    """The one weight loader: a drafter directory's tensors (renamed by `model_class.sanitize`) in a new
    `model_class(cfg)`."""
    path = Path(path)
    cfg.check(path / "config.json")
    weights = model_class.sanitize(read_weights(path, "drafter"))
    cfg.adopt_weights(weights)
    return load_block_weights(model_class(cfg), path, weights)
