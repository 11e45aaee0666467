"""Opening a pair on torch with transformers' own classes.

- A BUNDLE (or any mlx-lm directory): the target's flattened mlx-lm config is
  turned back into a transformers config (`MuseGlimmerConfig` with a minimal
  vision half for Muse, `AutoConfig.for_model` otherwise), the model is built
  with empty parameters and filled with the bundle's weights, read and
  dequantized by MLX (`weights.py`) and renamed from mlx-lm's names.
- A transformers-layout directory (the original checkpoint): `from_pretrained`.
- The drafter, either way: our `DrafterConfig` reader (transformers'
  `muse_glimmer_assistant` and z-lab DFlash configs), a
  `MuseGlimmerAssistantConfig` built from it, weights through MLX as above. A
  distilled drafter's `draft_vocab` is kept beside the model.

The tokenizer is mlx-lm's wrapper over the same files, so prompts, stop ids and
text are those of the MLX backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..drafters.base import Drafter
from ..drafters.config import DrafterConfig
from ..drafters.dflash import DFlashModel
from ..drafters.loading import read_weights
from ..drafters.registry import DRAFT_MODEL, FAMILIES, drafter_kind
from ..errors import GlimmerError
from ..files import check_model_dir, pair_paths, read_config_json
from ..loading import open_tokenizer, read_target_config
from ..tree_check import guard_trees
from . import weights as W
from .device import pick_device, pick_dtype
from .drafter import TorchDFlashDrafter
from .target import TorchTarget

MLX_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class TorchPair:
    target: TorchTarget
    drafter: Drafter | None
    tokenizer: TokenizerWrapper
    target_path: Path
    drafter_path: Path | None
    device: torch.device
    dtype: torch.dtype
    source: str  # "bundle" (weights dequantized by MLX) or "transformers" (from_pretrained)

    @property
    def name(self) -> str:
        return self.target_path.parent.name if self.target_path.name == "target" else self.target_path.name

    @property
    def device_key(self) -> str:
        """The torch device and compute dtype (`generate.GenerationPair`)."""
        return f"{self.device}|{self.dtype}"


def is_mlx_layout(config: dict) -> bool:
    """A bundle target / mlx-lm directory (flattened, maybe quantized) rather than a transformers checkpoint."""
    nested_muse = config.get("model_type") == "muse_glimmer" and isinstance(config.get("text_config"), dict)
    return "quantization" in config or (config.get("model_type") in W.MUSE_TYPES and not nested_muse)


def mlx_compute_dtype(config: dict) -> torch.dtype:
    """The float dtype MLX computes this target in: its config's dtype, else float32."""
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    return MLX_DTYPES.get(str(name), torch.float32)


def transformers_config(config: dict, where: Path):
    """A transformers config from an mlx-lm config.json."""
    cfg = {k: v for k, v in config.items() if k not in W.NOT_MODEL_KEYS and v is not None}
    model_type = cfg.pop("model_type", None)
    try:
        if model_type in W.MUSE_TYPES:
            from transformers import MuseGlimmerConfig

            return MuseGlimmerConfig(
                text_config=cfg, vision_config=W.TINY_VISION, out_hidden_size=8, projector_hidden_size=8
            )
        from transformers import AutoConfig

        return AutoConfig.for_model(model_type, **cfg)
    except (ValueError, TypeError, KeyError) as e:
        raise GlimmerError(f"{where}: transformers cannot build a {model_type!r} config from it ({e})") from None


def _model_class(model_type: str):
    if model_type in W.MUSE_TYPES:
        from transformers import MuseGlimmerForConditionalGeneration

        return MuseGlimmerForConditionalGeneration
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM


def load_target_from_mlx(path: Path, config: dict, dtype: torch.dtype, device: torch.device) -> TorchTarget:
    hf_config = transformers_config(config, path / "config.json")
    model_type = config["model_type"]
    cls = _model_class(model_type)
    with W.empty_parameters():
        model = cls.from_config(hf_config) if cls.__name__.startswith("Auto") else cls._from_config(hf_config)
    raw = W.dequantize(read_weights(path, "target"), config.get("quantization"), path)
    state = {W.transformers_name(k, model_type): W.to_torch(v, dtype) for k, v in raw.items()}
    del raw
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    modules = {id(m): n for n, m in model.named_modules()}
    head_name, embed_name = modules[id(head)] + ".weight", modules[id(embed)] + ".weight"
    tied = head_name not in state
    if tied and not (getattr(hf_config.get_text_config(), "tie_word_embeddings", False) and embed_name in state):
        raise GlimmerError(f"{path}: no {head_name} and the config does not tie it to the embeddings")
    if tied:
        state[head_name] = state[embed_name]
    W.assign(model, state, path, optional=W.VISION_PREFIXES)
    if tied:
        head.weight = embed.weight
    return TorchTarget(model.to(device), device)


def load_target_from_transformers(path: Path, config: dict, dtype: torch.dtype, device: torch.device) -> TorchTarget:
    cls = _model_class(config.get("model_type"))
    try:
        model = cls.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError, KeyError) as e:
        raise GlimmerError(f"{path}: transformers cannot load it ({e})") from None
    return TorchTarget(model.to(device), device)


def assistant_config(cfg: DrafterConfig):
    from transformers import MuseGlimmerAssistantConfig

    d = {k: v for k, v in cfg.to_dict().items() if k not in ("architectures", "model_type", "draft_vocab_size")}
    d.update(bos_token_id=None, eos_token_id=None, pad_token_id=None)  # no vocabulary of its own
    if d.get("sliding_window") is None:
        d.pop("sliding_window", None)
    elif cfg.context_reach is not None:
        # transformers' mask lets a query see |q - k| <= sliding_window: z-lab's reach is one less.
        d["sliding_window"] = cfg.context_reach
    return MuseGlimmerAssistantConfig(**d)


def load_torch_drafter(path: Path, target: TorchTarget, dtype: torch.dtype) -> TorchDFlashDrafter:
    from transformers import MuseGlimmerAssistantModel

    path = Path(path)
    check_model_dir(path, "drafter")
    kind = drafter_kind(path)
    if kind != "dflash":
        what = "a classic draft model (an autoregressive LM)" if kind == DRAFT_MODEL else f"a {kind} block drafter"
        raise GlimmerError(
            f"{path}: the torch backend drafts with DFlash drafters only (this is {what}); use --backend mlx"
        )
    cfg = FAMILIES[kind].checked_config(path, target)
    quant = read_config_json(path, "drafter").get("quantization")
    raw = W.dequantize(DFlashModel.sanitize(read_weights(path, "drafter")), quant, path)
    vocab = raw.pop("draft_vocab", None)
    with W.empty_parameters():
        model = MuseGlimmerAssistantModel._from_config(assistant_config(cfg))
    W.assign(model, {k: W.to_torch(v, dtype) for k, v in raw.items()}, path)
    draft_vocab = W.to_torch(vocab, torch.long).long().to(target.device) if vocab is not None else None
    return TorchDFlashDrafter(model.to(target.device), cfg, target, draft_vocab)


def load_torch(
    path: str | Path | None = None,
    *,
    target: str | Path | None = None,
    drafter: str | Path | None = None,
    use_drafter: bool = True,
    device: str | torch.device | None = "auto",
    dtype: str | torch.dtype | None = "auto",
) -> TorchPair:
    """`mlx_glimmer.load` on torch: `load_torch(BUNDLE)` or `load_torch(target=DIR, drafter=DIR)`.

    `dtype="auto"`: what MLX computes the target in (the bundle's dtype; float32
    for a float32 bundle), or the checkpoint's dtype for a transformers directory. A drafter that can seed
    draft trees has them checked first, as `mlx_glimmer.load` does (`tree_check.guard_trees`).
    """
    paths = pair_paths(path, target, drafter, use_drafter)
    config = read_target_config(paths.target)
    dev = device if isinstance(device, torch.device) else pick_device(device)
    mlx_layout = is_mlx_layout(config) or paths.bundle
    if isinstance(dtype, torch.dtype):
        dt = dtype
    elif mlx_layout:
        dt = pick_dtype(dtype, mlx_compute_dtype(config))
    else:
        text = config.get("text_config") or config
        dt = pick_dtype(dtype, MLX_DTYPES.get(str(text.get("dtype") or config.get("dtype")), torch.float32))
    load = load_target_from_mlx if mlx_layout else load_target_from_transformers
    tgt = load(paths.target, config, dt, dev)
    d = load_torch_drafter(paths.drafter, tgt, dt) if paths.drafter is not None else None
    guard_trees(tgt, d)
    return TorchPair(
        tgt,
        d,
        open_tokenizer(paths.target, config),
        paths.target,
        paths.drafter,
        dev,
        dt,
        "bundle" if mlx_layout else "transformers",
    )
