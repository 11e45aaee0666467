"""Tiny DFlash2 and DSpark drafters written by their reference packages, for tests.

The references are pinned here and installed (no dependencies: their own
requirements would pull datasets / mlx-vlm and move our pins) into
`.cache/refpkgs/<name>-<version>` on first use, then put on sys.path:
    dflash==0.1.0      z-lab, torch: DFlash2DraftModel (also needs transformers + torch, from [test])
    dspark-mlx==0.1.0  MLX: dspark_mlx.arch.qwen3.Qwen3DSparkDrafter
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import tiny_checkpoints as tc

REFERENCES = {"dflash": ("dflash", "0.1.0"), "dspark_mlx": ("dspark-mlx", "0.1.0")}
CACHE = Path(__file__).resolve().parent.parent / ".cache" / "refpkgs"


def reference(module: str):
    """Import a pinned reference package, installing it under .cache/refpkgs first if needed."""
    dist, version = REFERENCES[module.split(".")[0]]
    where = CACHE / f"{dist}-{version}"
    if not (where / module.split(".")[0]).is_dir():
        where.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-deps",
                "--target",
                str(where),
                f"{dist}=={version}",
            ],
            check=True,
            timeout=300,
        )
    if str(where) not in sys.path:
        sys.path.insert(0, str(where))
    return importlib.import_module(module)


def _randomise_torch(model, seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and param.ndim == 1:
                param.copy_(0.5 + torch.rand(param.shape, generator=gen))
            elif "base_kernel" in name:
                param.copy_(0.5 * torch.randn(param.shape, generator=gen))
            elif param.ndim == 2:
                param.normal_(0.0, 0.15, generator=gen)


def build_dflash2(
    path: Path,
    *,
    hidden: int = 64,
    vocab_size: int = tc.VOCAB_SIZE,
    target_layer_ids=(1, 3, 5),
    num_target_layers: int = 8,
    block_size: int = 10,
    sliding_window: int = 8,
    seed: int = 3,
    output_multiplier: float | None = 2.0,
    softcap: float | None = 20.0,
    mask_token_id: int = tc.MASK_ID,
) -> Path:
    """A DFlash2DraftModel (layer 0 sliding, layer 1 full) saved as z-lab publishes it."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3Config

    dflash_model = reference("dflash.model")
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        use_sliding_window=True,
        sliding_window=sliding_window,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
    )
    config.num_target_layers = num_target_layers
    block = dict(
        block_size=block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=list(target_layer_ids),
        conv_kernel_size=3,
        conv_group_size=16,
        selector_rank=8,
        selector_top_k=12,
    )
    if output_multiplier is not None:
        block["output_multiplier"] = output_multiplier
    if softcap is not None:
        block["final_logit_softcapping"] = softcap
    config.dflash_config = block
    config.architectures = ["DFlash2DraftModel"]
    model = dflash_model.DFlash2DraftModel(config).float().eval()
    _randomise_torch(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    # The published checkpoints name the selector codebooks without `.weight`
    # (DFlash2DraftModel.from_pretrained maps them back).
    weights = load_file(Path(path) / "model.safetensors")
    for name in ("predecessor_codebook", "successor_codebook"):
        weights[f"candidate_selector.{name}"] = weights.pop(f"candidate_selector.{name}.weight")
    save_file(weights, Path(path) / "model.safetensors", metadata={"format": "pt"})
    return Path(path)


def dspark_args(**overrides):
    qwen3 = reference("dspark_mlx.arch.qwen3")
    base = dict(
        vocab_size=tc.VOCAB_SIZE,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        target_layer_ids=(1, 3, 5),
        num_target_layers=8,
        block_size=5,
        mask_token_id=tc.MASK_ID,
        markov_rank=8,
        temperature=0.0,
    )
    base.update(overrides)
    return qwen3.Qwen3DSparkArgs(**base)


def build_dspark(path: Path, *, seed: int = 4, confidence_threshold: float | None = None, **overrides) -> Path:
    """A dspark-mlx Qwen3 DSpark drafter with random weights, saved under its checkpoint names."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    qwen3 = reference("dspark_mlx.arch.qwen3")
    args = dspark_args(**overrides)
    mx.random.seed(seed)
    drafter = qwen3.Qwen3DSparkDrafter(args)
    rng = np.random.default_rng(seed)
    params = {}
    for name, value in tree_flatten(drafter.parameters()):
        if "norm" in name and value.ndim == 1:
            new = 0.5 + rng.random(value.shape)
        elif value.ndim == 2 or name.endswith("bias"):
            new = rng.normal(0.0, 0.15, value.shape)
        else:
            continue
        params[name] = mx.array(new.astype(np.float32))
    drafter.update(tree_unflatten(list(params.items())))
    # Checkpoint names: what dspark-mlx's qwen3_key_map maps back to these parameters.
    out = {}
    for name, value in tree_flatten(drafter.parameters()):
        key = name.removeprefix("backbone.")
        assert qwen3.qwen3_key_map(key) == name, name
        out[key] = value
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), out, metadata={"format": "mlx"})
    config = {
        "architectures": ["DSparkDraftModel"],
        "model_type": "qwen3",
        "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_hidden_layers,
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "head_dim": args.head_dim,
        "intermediate_size": args.intermediate_size,
        "rms_norm_eps": args.rms_norm_eps,
        "rope_parameters": {"rope_theta": args.rope_theta, "rope_type": "default"},
        "max_position_embeddings": args.max_position_embeddings,
        "target_layer_ids": list(args.target_layer_ids),
        "num_target_layers": args.num_target_layers,
        "block_size": args.block_size,
        "mask_token_id": args.mask_token_id,
        "markov_rank": args.markov_rank,
        "enable_confidence_head": True,
    }
    if confidence_threshold is not None:
        config["confidence_threshold"] = confidence_threshold
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
