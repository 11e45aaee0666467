"""Opening a target/drafter pair: from a bundle, or from transformers-layout directories.

BUNDLE layout (docs/design.md, "The pipeline"):
    BUNDLE/glimmer.json   {"format": "mlx-glimmer/1", "target": "target", "drafter": "drafter" | null, ...}
    BUNDLE/target/        an mlx-lm model directory (mlx_lm.load opens it as is)
    BUNDLE/drafter/       config.json + *.safetensors (no embedding, no lm_head)

A transformers directory of Muse Glimmer holds the vision tower and projector
as well; they are dropped here (we serve the text tower).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import _get_classes, load_config, load_model, load_tokenizer

from .blas import blas_name, check_fast_blas
from .distributed import split_target
from .drafters.base import Drafter
from .drafters.registry import DRAFT_MODEL, FAMILIES, drafter_kind
from .errors import GlimmerError
from .few_rows import FEW_ROWS, on_cpu
from .files import check_model_dir, check_weight_files, pair_paths
from .ranks import split_group
from .settings import MAX_DRAFT_K, check_draft_k
from .target import Target
from .tree_check import guard_trees

TEXT_PREFIXES = ("model.language_model.", "language_model.", "lm_head.")


@dataclass
class Pair:
    target: Target
    drafter: Drafter | None
    tokenizer: TokenizerWrapper
    target_path: Path
    drafter_path: Path | None = None

    @property
    def name(self) -> str:
        return self.target_path.parent.name if self.target_path.name == "target" else self.target_path.name

    @property
    def device_key(self) -> str:
        """MLX computes on its default device, in the weights' own dtype (`generate.GenerationPair`); on the CPU
        with few-row products (`few_rows.py`), so tables timed before them are measured again, and with the BLAS
        the process found (`blas.blas_name`): a table timed on the reference BLAS misleads every later choice once
        OpenBLAS is in."""
        return "default|" + (f"|few rows {FEW_ROWS}|BLAS {blas_name()}" if on_cpu() else "")

    @property
    def quantization(self) -> str:
        q = self.target.config.get("quantization")
        return (
            f"{q['bits']}-bit"
            if q
            else str(self.target.config.get("torch_dtype") or self.target.config.get("dtype") or "float")
        )


def _text_tower_classes(config: dict):
    model_class, args_class = _get_classes(config)

    class TextTower(model_class):
        def sanitize(self, weights):
            if any(k.startswith(TEXT_PREFIXES[:2]) for k in weights):
                weights = {k: v for k, v in weights.items() if k.startswith(TEXT_PREFIXES)}
            if hasattr(model_class, "sanitize"):
                weights = model_class.sanitize(self, weights)
            return weights

    TextTower.__name__ = model_class.__name__
    return TextTower, args_class


def read_target_config(path: Path) -> dict:
    """A target directory's config.json (eos ids from generation_config.json), once the directory checks out."""
    check_model_dir(path, "target")
    try:
        config = load_config(path)
    except json.JSONDecodeError as e:
        raise GlimmerError(f"{path / 'config.json'}: not valid JSON ({e})") from None
    if "model_type" not in config:
        raise GlimmerError(f"{path / 'config.json'}: no model_type field")
    check_weight_files(path, "*.safetensors")
    return config


def open_tokenizer(path: Path, config: dict) -> TokenizerWrapper:
    """mlx-lm's tokenizer for the target at `path`, stopping at its config's eos ids (either backend)."""
    eos = config.get("eos_token_id", (config.get("text_config") or {}).get("eos_token_id"))
    return load_tokenizer(path, eos_token_ids=eos)


def load_target(path: Path, group: mx.distributed.Group | None = None) -> tuple[Target, TokenizerWrapper]:
    """The target at `path`; with `group` (processes started by `mlx.launch`), its decoder layers split over
    them (`distributed.py`), loaded lazily so each process reads only its share into memory."""
    path = Path(path)
    config = read_target_config(path)
    try:
        _get_classes(config)
    except ValueError:
        raise GlimmerError(
            f"{path / 'config.json'}: model_type {config['model_type']!r} is not supported by mlx-lm"
        ) from None
    try:
        model, config = load_model(path, lazy=group is not None, get_model_classes=_text_tower_classes)
    except ValueError as e:
        raise GlimmerError(f"{path}: target weights do not match its config.json ({e})") from None
    if group is not None:
        return split_target(model, config, group, path), open_tokenizer(path, config)
    return Target(model, config), open_tokenizer(path, config)


def load_drafter(path: Path, target: Target, tokenizer=None, *, draft_k: int | None = None) -> Drafter:
    """A block drafter (its family read from config.json), or (any other mlx-lm model dir) a classic
    autoregressive draft model, `draft_k` tokens per round (adaptive when None)."""
    path = Path(path)
    check_model_dir(path, "drafter")
    kind = drafter_kind(path)
    if kind != DRAFT_MODEL:
        return FAMILIES[kind].load(path, target)
    from .drafters.draft_model import DraftModelDrafter, check_same_tokenizer

    draft, draft_tok = load_target(path)
    if tokenizer is not None:
        check_same_tokenizer(tokenizer, draft_tok, str(path))
    if draft.vocab_size != target.vocab_size:
        raise GlimmerError(
            f"{path / 'config.json'}: vocab_size {draft.vocab_size} differs from the target's {target.vocab_size}"
        )
    return DraftModelDrafter(draft.model, draft_k=draft_k or 4, adaptive=draft_k is None, max_k=MAX_DRAFT_K)


def load(
    path: str | Path | None = None,
    *,
    target: str | Path | None = None,
    drafter: str | Path | None = None,
    use_drafter: bool = True,
    draft_k: int | None = None,
    prompt_lookup: bool = False,
) -> Pair:
    """Open a pair: `load(BUNDLE)` or `load(target=DIR, drafter=DIR)`.

    `drafter=` beside a bundle replaces the bundle's drafter: a DFlash/assistant
    checkpoint, or any mlx-lm causal LM sharing the target's tokenizer (classic
    drafting, `draft_k` tokens per round; adaptive when not given).
    `prompt_lookup=True` drafts by n-gram lookup instead (`draft_k`, default 10). `draft_k` is at most
    `settings.MAX_DRAFT_K` (16).
    `use_drafter=False` skips drafting (plain decoding only).
    With a drafter that can seed draft trees, a small tree verify is checked against chains first
    (`tree_check.guard_trees`): where they disagree, the target verifies chains only.
    """
    check_draft_k(draft_k)
    check_fast_blas()
    paths = pair_paths(path, target, drafter, use_drafter)
    tgt, tokenizer = load_target(paths.target, split_group())
    drafter_path = paths.drafter
    if prompt_lookup and use_drafter:
        from .drafters.prompt_lookup import PromptLookupDrafter

        d, drafter_path = PromptLookupDrafter(draft_k=draft_k or 10), None
    else:
        d = load_drafter(drafter_path, tgt, tokenizer, draft_k=draft_k) if drafter_path is not None else None
    mx.eval(tgt.model.parameters())
    guard_trees(tgt, d)
    return Pair(tgt, d, tokenizer, paths.target, drafter_path)


def with_drafter(pair: Pair, drafter: str | Path) -> Pair:
    """`pair`'s target and tokenizer drafting with the drafter in `drafter`, loaded and checked as `load` would
    (two drafters measured against one target without loading it twice)."""
    d = load_drafter(Path(drafter), pair.target, pair.tokenizer)
    guard_trees(pair.target, d)
    return replace(pair, drafter=d, drafter_path=Path(drafter))
