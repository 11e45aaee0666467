"""`mlx-glimmer export`: a bundle's DFlash drafter as a Hugging Face directory the serving engines load.

Two layouts, one drafter:
    "dflash"       z-lab's `DFlashDraftModel` (what SpecForge writes): vLLM `--speculative-config
                   '{"method": "dflash", ...}'`, SGLang `--speculative-algorithm DFLASH`
    "speculators"  the `speculators` package's DFlash checkpoint: `vllm serve DIR`, `SpeculatorModel.from_pretrained`
Both carry the same tensors under the same names (`layers.*`, `fc`, `hidden_norm`, `norm`; with a reduced draft
vocabulary also its head rows `lm_head` and the maps `d2t`, `t2d`); they differ only in config.json, so both live
here, beside the model they write out (`dflash.py`). `convert --drafter` reads the "dflash" layout back.

What the engines would otherwise get wrong, each settled in the written config:
    - vocab_size is written: a config without it takes Qwen3's default vocabulary (151,936);
    - the window: `use_sliding_window` is set (Qwen3's config drops `sliding_window` without it), and the
      window counts the query's own position (q - k < window), so it is our reach + 1;
    - block attention is bidirectional on every layer (`is_causal: false`, `dflash_config.causal: false`,
      speculators' `sliding_window_non_causal`); vLLM and speculators otherwise make sliding layers causal;
    - speculators names target layers by the input of the next layer: `aux_hidden_state_layer_ids` are our
      `target_layer_ids` + 1.
MLX is imported only when a drafter is exported, so the command line builds this parser without it.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import GlimmerError

FORMATS = ("dflash", "speculators")
DTYPES = ("bfloat16", "float32")
SPECULATORS_VERSION = "0.9.0"  # the release whose DFlash config and tensor names this layout follows

DESCRIPTION = """\
Write a bundle's DFlash drafter as a Hugging Face directory that vLLM and SGLang load:

  --format dflash       z-lab's DFlashDraftModel layout (vLLM method "dflash", SGLang DFLASH)
  --format speculators  the `speculators` package's layout (vllm serve OUT)

Weights are float (quantized drafters are dequantized). The target's embedding and head stay with the
target, except for a drafter with its own draft vocabulary: its head rows go along with the maps from draft
ids to token ids (vLLM uses them; SGLang drafts over the target's whole head instead). The directory is
written beside --out and renamed into place at the end; a failure leaves nothing behind."""

EPILOG = """\
examples:
  mlx-glimmer export --format dflash --out demo-dflash            # the demo pair's drafter
  mlx-glimmer export BUNDLE --drafter RUN/drafter --format speculators --out OUT --verifier ORG/TARGET"""


def add_export_parser(sub) -> None:
    p = sub.add_parser(
        "export",
        help="write a bundle's drafter in a layout vLLM and SGLang load",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("bundle", nargs="?", help="bundle whose drafter to export (default: the embedded demo pair)")
    p.add_argument("--format", required=True, choices=FORMATS, help="dflash (z-lab layout) or speculators")
    p.add_argument("--out", required=True, metavar="DIR", help="directory to create")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="float type of the weights (default bfloat16)")
    p.add_argument(
        "--drafter", metavar="DIR", help="a drafter directory to export instead of the bundle's (e.g. distill's)"
    )
    p.add_argument(
        "--verifier",
        metavar="NAME",
        help="the target as the engine should load it, a Hugging Face repo id or transformers directory "
        "(speculators records it; default: the bundle's target source, unless that was a .gguf file)",
    )
    p.add_argument("--force", action="store_true", help="replace --out if it exists")


def check_export(args) -> None:
    """Paths checked before anything loads: the bundle (when given), the --drafter, --out."""
    from ..files import check_model_dir, check_pair_dirs

    if args.bundle is not None:
        check_pair_dirs(args.bundle, args.drafter)
    elif args.drafter is not None:
        check_model_dir(Path(args.drafter), "drafter")
    out = Path(args.out).expanduser()
    if (out.exists() or out.is_symlink()) and not args.force:
        raise GlimmerError(f"{out}: already exists (pass --force to replace it)")


def cmd_export(args) -> int:
    """`args.bundle`: the bundle's path (the command line puts the demo bundle's there when none is given)."""
    check_export(args)
    done = export_drafter(
        Path(args.bundle),
        args.out,
        args.format,
        dtype=args.dtype,
        drafter=args.drafter,
        verifier=args.verifier,
        force=args.force,
    )
    print(done.summary())
    return 0


@dataclass(frozen=True)
class Exported:
    out: Path
    format: str
    block_size: int
    vocab_size: int
    draft_vocab_size: int | None
    verifier: str | None

    def summary(self) -> str:
        vocab = (
            f"draft vocabulary {self.draft_vocab_size} of {self.vocab_size}"
            if self.draft_vocab_size
            else f"vocabulary {self.vocab_size}"
        )
        target = self.verifier or "TARGET"
        lines = [f"exported the drafter ({self.format}, block {self.block_size}, {vocab}) to {self.out}"]
        if self.format == "speculators":
            lines.append(f"vLLM:   vllm serve {self.out}")
        else:
            spec = json.dumps(
                {"method": "dflash", "model": str(self.out), "num_speculative_tokens": self.block_size - 1}
            )
            lines.append(f"vLLM:   vllm serve {target} --speculative-config '{spec}'")
            lines.append(
                f"SGLang: python -m sglang.launch_server --model-path {target} --speculative-algorithm DFLASH "
                f"--speculative-draft-model-path {self.out} --speculative-num-draft-tokens {self.block_size}"
            )
        return "\n".join(lines)


def export_drafter(
    bundle: str | Path,
    out: str | Path,
    fmt: str,
    *,
    dtype: str = "bfloat16",
    drafter: str | Path | None = None,
    verifier: str | None = None,
    force: bool = False,
) -> Exported:
    """Write the drafter of `bundle` (or `drafter`, checked against the bundle's target) to `out` in `fmt`."""
    import mlx.core as mx

    from ..files import pair_paths, read_bundle_manifest
    from .registry import DRAFT_MODEL, drafter_kind

    if fmt not in FORMATS:
        raise GlimmerError(f"--format: {fmt!r} is not one of {', '.join(FORMATS)}")
    if dtype not in DTYPES:
        raise GlimmerError(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    out = Path(out).expanduser()
    if (out.exists() or out.is_symlink()) and not force:
        raise GlimmerError(f"{out}: already exists (pass --force to replace it)")
    paths = pair_paths(bundle, None, drafter)
    if paths.drafter is None:
        raise GlimmerError(f"{bundle}: the bundle has no drafter (pass --drafter DIR)")
    for source in (paths.target, paths.drafter):
        if out.resolve() in (source.resolve(), *source.resolve().parents):
            raise GlimmerError(f"{out}: --out must not be or contain the source {source}")
    kind = drafter_kind(paths.drafter)
    if kind != "dflash":
        what = "a classic draft model" if kind == DRAFT_MODEL else f"a {kind} drafter"
        raise GlimmerError(
            f"{paths.drafter / 'config.json'}: {what}; only DFlash drafters (muse_glimmer_assistant, z-lab "
            "DFlashDraftModel, distill's) have a layout the engines load"
        )
    if verifier is None and paths.bundle:
        verifier = verifier_of(read_bundle_manifest(Path(bundle)))
    if fmt == "speculators" and verifier is None:
        raise GlimmerError(
            f"--verifier: the speculators layout names the target the engine loads, and {bundle}'s target did not "
            "come from a transformers checkpoint; name it (a repo id or directory)"
        )

    target, target_config = open_target(paths.target)
    model, cfg = open_drafter(paths.drafter, target)
    check_layers(cfg, target.num_layers, paths.drafter)
    float_type = {"bfloat16": mx.bfloat16, "float32": mx.float32}[dtype]
    tensors = {name: value.astype(float_type) for name, value in engine_weights(model).items()}
    draft_vocab = model.get("draft_vocab")
    if draft_vocab is not None:
        tensors.update(vocabulary_maps(target, draft_vocab, float_type))
    config = dflash_config(cfg, target.vocab_size, target.num_layers, dtype)
    if fmt == "speculators":
        config = speculators_config(config, cfg, verifier, target_config.get("architectures") or [])
    write_directory(out, tensors, config, force)
    return Exported(out, fmt, int(cfg.block_size), target.vocab_size, cfg.draft_vocab_size, verifier)


def verifier_of(manifest: dict) -> str | None:
    """The bundle target's source, as an engine would load it: a repo id or transformers directory (not a .gguf)."""
    source = (manifest.get("sources") or {}).get("target")
    if not isinstance(source, str) or source.lower().endswith(".gguf"):
        return None
    return source


def open_target(path: Path):
    """The bundle's target with its weights left on disk (only a reduced vocabulary's head rows are read)."""
    from mlx_lm.utils import load_model

    from ..loading import read_target_config
    from ..target import Target

    config = read_target_config(path)
    try:
        model, config = load_model(path, lazy=True)
    except ValueError as e:
        raise GlimmerError(f"{path}: target weights do not match its config.json ({e})") from None
    return Target(model, config), config


def open_drafter(path: Path, target):
    """The drafter's model and config, checked against `target` as a load checks them, with the target's
    vocabulary and depth filled in where its config.json leaves them out."""
    from .dflash import DFlashModel
    from .loading import load_block_model
    from .registry import FAMILIES

    cfg = FAMILIES["dflash"].checked_config(path, target)
    cfg.vocab_size = target.vocab_size
    cfg.num_target_layers = target.num_layers
    return load_block_model(path, cfg, DFlashModel), cfg


def check_layers(cfg, num_target_layers: int, path: Path) -> None:
    """The engines capture a target layer's output as the next layer's input: the last layer's output has no
    such input, so a drafter reading it cannot be served."""
    last = num_target_layers - 1
    if last in cfg.target_layer_ids:
        raise GlimmerError(
            f"{path / 'config.json'}: target_layer_ids include the target's last layer ({last}); vLLM and SGLang "
            "capture a layer's output as the next layer's input, which the last layer does not have"
        )


def engine_weights(model) -> dict:
    """The drafter's float tensors under the z-lab names (`fc`, `hidden_norm`), quantized linears dequantized."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    out = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.QuantizedLinear):
            out[f"{name}.weight"] = mx.dequantize(
                module.weight, module.scales, module.biases, module.group_size, module.bits, mode=module.mode
            )
    for name, value in tree_flatten(model.parameters()):
        base = name.rsplit(".", 1)[0]
        if f"{base}.weight" in out or not mx.issubdtype(value.dtype, mx.floating):
            continue  # a quantized linear's parts; the draft vocabulary (written as maps)
        out[name] = value
    renamed = {}
    for name, value in out.items():
        if name.startswith("encoder.fc."):
            name = "fc." + name.removeprefix("encoder.fc.")
        elif name.startswith("encoder.output_norm_enc."):
            name = "hidden_norm." + name.removeprefix("encoder.output_norm_enc.")
        renamed[name] = value
    return renamed


def vocabulary_maps(target, draft_vocab, dtype) -> dict:
    """A reduced draft vocabulary as the engines take it (EAGLE-3 style): the head rows of its tokens
    (`lm_head`, in draft-id order), draft id -> token id as offsets (`d2t`: token = id + d2t[id]) and the
    tokens' mask over the target's vocabulary (`t2d`)."""
    import mlx.core as mx
    import mlx.nn as nn

    from ..target import head_layer

    ids = draft_vocab.astype(mx.int32)
    layer = head_layer(target.model)
    if isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        biases = layer.biases[ids] if layer.biases is not None else None
        rows = mx.dequantize(
            layer.weight[ids], layer.scales[ids], biases, layer.group_size, layer.bits, mode=layer.mode
        )
    else:
        rows = layer.weight[ids]
    mask = mx.zeros((target.vocab_size,), dtype=mx.bool_)
    mask[ids] = True
    return {
        "lm_head.weight": rows.astype(dtype),
        "d2t": (ids - mx.arange(ids.size, dtype=mx.int32)).astype(mx.int64),
        "t2d": mask,
    }


def dflash_config(cfg, vocab_size: int, num_target_layers: int, dtype: str) -> dict:
    """The z-lab `DFlashDraftModel` config.json (a Qwen3 config plus the DFlash fields)."""
    sliding = cfg.context_reach is not None
    layer_types = [t if t == "sliding_attention" and sliding else "full_attention" for t in cfg.layer_types]
    out = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default", **(cfg.rope_scaling or {})},
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": False,
        "vocab_size": vocab_size,
        "layer_types": layer_types,
        "use_sliding_window": sliding and "sliding_attention" in layer_types,
        "sliding_window": cfg.context_reach + 1 if sliding else None,
        "max_window_layers": cfg.num_hidden_layers,
        "is_causal": False,
        "block_size": cfg.block_size,
        "num_target_layers": num_target_layers,
        "dflash_config": {
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": list(cfg.target_layer_ids),
            "causal": False,
        },
        "dtype": dtype,
    }
    if cfg.draft_vocab_size:
        out["draft_vocab_size"] = cfg.draft_vocab_size
    return out


def speculators_config(dflash: dict, cfg, verifier: str, verifier_architectures: list) -> dict:
    """The `speculators` DFlash config.json around the same layer config: its layer ids are the inputs of the
    layers after ours, and the anchor is the bonus token (block_size - 1 speculative tokens)."""
    layer_config = {k: v for k, v in dflash.items() if k not in ("architectures", "block_size", "dflash_config")}
    layer_config.pop("num_target_layers")
    layer_config.pop("draft_vocab_size", None)
    return {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer_config,
        "draft_vocab_size": cfg.draft_vocab_size or dflash["vocab_size"],
        "block_size": cfg.block_size,
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],
        "mask_token_id": cfg.mask_token_id,
        "sliding_window_non_causal": True,
        "sample_from_anchor": False,
        "speculators_config": {
            "algorithm": "dflash",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": cfg.block_size - 1,
                    "accept_tolerance": 0.0,
                    "verifier_accept_k": 1,
                }
            ],
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
        "dtype": dflash["dtype"],
    }


def write_directory(out: Path, tensors: dict, config: dict, force: bool) -> None:
    """model.safetensors and config.json, written beside `out` and renamed into place."""
    import mlx.core as mx

    from ..files import staged_directory

    try:
        with staged_directory(out, "drafter directory") as staging:
            mx.save_safetensors(
                str(staging / "model.safetensors"), dict(sorted(tensors.items())), metadata={"format": "pt"}
            )
            (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            if (out.exists() or out.is_symlink()) and not force:
                raise GlimmerError(f"{out}: already exists (pass --force to replace it)")
    except OSError as e:
        raise GlimmerError(f"{e.filename or out}: {e.strerror or e}") from None
