"""What every block drafter shares: its config, its layers, the context cache, the bound drafter, one loader.

A block drafter (DFlash, DFlash2, DSpark) proposes a whole block in one
forward: the input is [anchor, mask, mask, ...] (embedded by the target's
table), queries come from the block, keys/values are [context ; block], where
the context is a projection of the target's hidden states at
`target_layer_ids` for every committed position. The families differ in their
layers, their attention mask and how they turn block outputs into drafts; this
module holds what they have in common:

- `DrafterConfig`: the settings all of them read (transformers'
  `muse_glimmer_assistant` fields and z-lab's `dflash_config` block); each
  family subclasses it (`from_raw`, `check`, `adopt_weights`, `to_dict`);
- `Attention`, `MLP`, `DecoderLayer`: the Qwen3-style layer (q/k RMS-norm, GQA,
  SiLU MLP) that every family builds on;
- `ContextCache` and `BlockContext`: per-layer context K/V, bounded by the
  window plus `CONTEXT_SLACK`, and the block forward over it;
- `BlockDrafter`: a model bound to its target, as the speculative loop's
  `Drafter` (observe, rollback, propose);
- `read_drafter_config`, `checked_config` and `load_block_model`: the one
  config reader and the one weight loader, which honours mlx-lm's per-module
  quantization entries (a weight quantized with another group size than the
  default, as `convert` writes when the default does not divide its width).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.rope_utils import initialize_rope

from ..errors import GlimmerError
from ..files import check_weight_files, read_config_json
from ..speculative import pick


@dataclass
class DrafterConfig:
    """`muse_glimmer_assistant` settings; defaults are transformers' own. Also reads z-lab DFlash configs."""

    model_type: str = "muse_glimmer_assistant"
    hidden_size: int = 6656
    intermediate_size: int = 19968
    num_hidden_layers: int = 5
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 131072
    sliding_window: int | None = 2048
    layer_types: list[str] = field(default_factory=list)
    block_size: int = 16
    mask_token_id: int = 201818
    target_layer_ids: list[int] = field(default_factory=lambda: [1, 13, 25, 37, 49])
    vocab_size: int | None = None
    num_target_layers: int | None = None
    # Drafters trained by `mlx-glimmer distill` propose from a reduced vocabulary
    # (the ids are stored as the `draft_vocab` tensor); verification is full-vocabulary.
    draft_vocab_size: int | None = None
    # Largest distance q - k at which a block query still sees a context key on
    # a sliding layer. transformers' create_bidirectional_sliding_window_mask
    # allows |q - k| <= sliding_window; z-lab's loop uses q - k < sliding_window.
    context_reach: int | None = None
    source_format: str = "muse_glimmer_assistant"

    # Families whose modules are vocabulary-sized (codebooks, Markov heads) take the target's vocabulary
    # size when their config.json does not name one.
    NEEDS_VOCAB: ClassVar[bool] = False

    def __post_init__(self):
        if not self.layer_types:
            self.layer_types = ["sliding_attention"] * self.num_hidden_layers
        if self.context_reach is None and self.sliding_window is not None:
            self.context_reach = self.sliding_window

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DrafterConfig:
        cfg = dict(raw)
        fmt = "muse_glimmer_assistant"
        dflash = cfg.pop("dflash_config", None)
        if dflash is not None or "DFlashDraftModel" in (cfg.get("architectures") or []):
            fmt = "dflash"
            for key in ("block_size", "mask_token_id", "target_layer_ids"):
                if dflash and key in dflash:
                    cfg[key] = dflash[key]
            cfg.setdefault("layer_types", ["full_attention"] * int(cfg.get("num_hidden_layers", 5)))
            if cfg.get("sliding_window") is not None:
                cfg.setdefault("context_reach", int(cfg["sliding_window"]) - 1)
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if "rope_theta" not in cfg and "rope_theta" in rope:
            cfg["rope_theta"] = rope["rope_theta"]
        if rope and rope.get("rope_type", rope.get("type", "default")) != "default":
            cfg["rope_scaling"] = rope
        else:
            cfg["rope_scaling"] = None
        fields = set(cls.__dataclass_fields__)
        out = cls(**{k: v for k, v in cfg.items() if k in fields})
        out.source_format = fmt
        return out

    @classmethod
    def from_raw(cls, raw: dict[str, Any], where: Path | None = None) -> DrafterConfig:
        """The config of a checkpoint's config.json (`where` names it in errors)."""
        return cls.from_dict(raw)

    def check(self, where: Path) -> None:
        """Family-specific settings a model cannot be built without (`validate_pair` checks the fit)."""

    def adopt_weights(self, names) -> None:
        """Settle the optional parts the checkpoint's tensor `names` show it carries."""

    def to_dict(self) -> dict[str, Any]:
        """The config as a transformers `muse_glimmer_assistant` config.json (a z-lab reach included)."""
        d = {
            "architectures": ["MuseGlimmerAssistantModel"],
            "model_type": "muse_glimmer_assistant",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default", **(self.rope_scaling or {})},
            "max_position_embeddings": self.max_position_embeddings,
            "sliding_window": self.sliding_window,
            "layer_types": self.layer_types,
            "block_size": self.block_size,
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": self.target_layer_ids,
            "hidden_act": "silu",
        }
        if self.vocab_size is not None:
            d["vocab_size"] = self.vocab_size
        if self.num_target_layers is not None:
            d["num_target_layers"] = self.num_target_layers
        if self.draft_vocab_size is not None:
            d["draft_vocab_size"] = self.draft_vocab_size
        if self.sliding_window is not None and self.context_reach != self.sliding_window:
            d["context_reach"] = self.context_reach
        return d


def make_rope(cfg: DrafterConfig):
    return initialize_rope(
        cfg.head_dim,
        base=cfg.rope_theta,
        traditional=False,
        scaling_config=cfg.rope_scaling,
        max_position_embeddings=cfg.max_position_embeddings,
    )


def quantizable(module) -> bool:
    """Convert's rule for the small side parts (codebooks, low-rank heads): float unless 32 divides the input width."""
    return module.weight.shape[-1] % 32 == 0


# ---- layers ----------------------------------------------------------------------------------------------


@dataclass
class SourceConfig(DrafterConfig):
    """A family config written back as its source config.json was read (`raw`), with what the bound target
    told us filled in: its format is the family's own, not the `muse_glimmer_assistant` one."""

    raw: dict = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.raw)
        d["vocab_size"] = self.vocab_size
        d["num_target_layers"] = self.num_target_layers
        return d


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig, layer_idx: int):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        sliding = cfg.layer_types[layer_idx] == "sliding_attention"
        self.context_reach = cfg.context_reach if sliding else None
        dim = cfg.hidden_size
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self._masks: dict[tuple[int, int], mx.array] = {}  # (position - first_pos, length) -> mask

    def cached_mask(self, position: int, length: int, first_pos: int) -> mx.array | None:
        """`mask`, built once per shape: it depends on the positions only through position - first_pos, which
        cycles through a few values once a sliding layer's context is full, so rounds reuse it."""
        key = (position - first_pos, length)
        if key not in self._masks:
            if len(self._masks) >= 256:
                self._masks.clear()
            self._masks[key] = self.mask(position, length, first_pos)
        return self._masks[key]

    def project_kv(self, x: mx.array, rope, offset: int) -> tuple[mx.array, mx.array]:
        B, L, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        return rope(k, offset=offset), v

    def mask(self, position: int, length: int, first_pos: int) -> mx.array | None:
        """Which keys (context from `first_pos`, then the block) each block query sees; None: all of them.
        Sliding layers: a query sees keys (context or block) with |q - k| <= reach."""
        if self.context_reach is None or position + length - 1 - first_pos <= self.context_reach:
            return None
        q_pos = mx.arange(position, position + length)[:, None]
        k_pos = mx.arange(first_pos, position + length)[None]
        return mx.abs(q_pos - k_pos) <= self.context_reach

    def __call__(self, x, rope, position: int, context: ContextCache) -> mx.array:
        """`x`: block hidden states [B, L, H] at positions position..position+L-1."""
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim)).transpose(0, 2, 1, 3)
        q = rope(q, offset=position)
        k_blk, v_blk = self.project_kv(x, rope, position)
        k_ctx, v_ctx, first_pos = context.fetch()
        if k_ctx is not None:
            keys = mx.concatenate([k_ctx, k_blk], axis=2)
            values = mx.concatenate([v_ctx, v_blk], axis=2)
        else:
            keys, values, first_pos = k_blk, v_blk, position
        mask = self.cached_mask(position, L, first_pos)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, x, rope, position, context):
        h = x + self.self_attn(self.input_layernorm(x), rope, position, context)
        return h + self.mlp(self.post_attention_layernorm(h))


# ---- the context -----------------------------------------------------------------------------------------


class ContextCache:
    """Per-layer K/V of committed context positions, newest last, bounded by the window (`keep`).

    Preallocated like mlx-lm's KV caches: entries are written into a buffer that grows `step` positions at a
    time, and a bounded cache drops its oldest entries in the same copy, so a round costs two slice writes,
    not a concatenation of the whole context (unbounded on full-attention layers)."""

    step = 256

    def __init__(self, keep: int | None):
        self.keep = keep
        self.keys = None  # buffers [B, H, capacity, D]; entries start..end are the context
        self.values = None
        self.start = 0
        self.end = 0
        self.first_pos = 0  # absolute position of entry `start`
        self.next_pos = 0  # absolute position of the next entry

    def append(self, k: mx.array, v: mx.array) -> None:
        n = k.shape[2]
        if self.keys is None or self.end + n > self.keys.shape[2]:
            stored = self.end - self.start
            kept = stored if self.keep is None else min(stored, max(self.keep - n, 0))
            drop = stored - kept
            B, H, _, D = k.shape
            capacity = kept + n + self.step
            keys = mx.zeros((B, H, capacity, D), dtype=k.dtype)
            values = mx.zeros((B, H, capacity, v.shape[3]), dtype=v.dtype)
            if kept:
                keys[..., :kept, :] = self.keys[..., self.start + drop : self.end, :]
                values[..., :kept, :] = self.values[..., self.start + drop : self.end, :]
            self.keys, self.values = keys, values
            self.start, self.end = 0, kept
            self.first_pos += drop
        self.keys[..., self.end : self.end + n, :] = k
        self.values[..., self.end : self.end + n, :] = v
        self.end += n
        self.next_pos += n
        if self.keep is not None and self.end - self.start > self.keep:
            drop = self.end - self.start - self.keep
            self.start += drop
            self.first_pos += drop

    def fetch(self):
        if self.keys is None:
            return None, None, self.first_pos
        return self.keys[..., self.start : self.end, :], self.values[..., self.start : self.end, :], self.first_pos

    def can_trim(self, n: int, reach: int | None) -> bool:
        stored = self.end - self.start
        if n > stored:
            return False
        return self.first_pos == 0 or reach is None or self.first_pos <= self.next_pos - n - reach

    def trim(self, n: int) -> None:
        if n:
            self.end -= n
            self.next_pos -= n


# Context entries kept beyond the window, so a chat can roll back its last few tokens.
CONTEXT_SLACK = 64


class BlockContext:
    """Context K/V and block forward shared by every block drafter model (its `layers`, `norm`, `rope`).

    `project_context` maps target features to the context's hidden states: `hidden_norm(fc(x))` in the
    z-lab/DSpark layout (the default), `encoder(x)` in the assistant's (`DFlashModel`)."""

    def project_context(self, features: mx.array) -> mx.array:
        return self.hidden_norm(self.fc(features))

    def make_context(self) -> list[ContextCache]:
        out = []
        for layer in self.layers:
            reach = layer.self_attn.context_reach
            out.append(ContextCache(None if reach is None else reach + 1 + CONTEXT_SLACK))
        return out

    def extend_context(self, features: mx.array, context: list[ContextCache]) -> None:
        """Project target features [B, n, k*H] of the next n positions into every layer's context K/V."""
        ctx = self.project_context(features)
        for layer, c in zip(self.layers, context):
            k, v = layer.self_attn.project_kv(ctx, self.rope, c.next_pos)
            c.append(k, v)

    def __call__(self, noise_embeds: mx.array, position: int, context: list[ContextCache]) -> mx.array:
        h = noise_embeds
        for layer, c in zip(self.layers, context):
            h = layer(h, self.rope, position, c)
        return self.norm(h)


# ---- the bound drafter -----------------------------------------------------------------------------------


def bind_dtype(model: nn.Module, dtype) -> None:
    """Cast the drafter's floating-point weights (quantization scales and biases included) to the target's
    activation dtype: its inputs are the target's embedding rows and features, and MLX promotes mixed
    half-precision matmuls (bfloat16 @ float16) to float32, so a float16 drafter beside a bfloat16 target
    would up-cast every weight on every call and draft in float32."""
    if dtype is None or not mx.issubdtype(dtype, mx.floating):
        return
    floats = [v for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)]
    if any(v.dtype != dtype for v in floats):
        model.set_dtype(dtype)
        mx.eval(model.parameters())


class BlockDrafter:
    """A block drafter model bound to its target: proposes a block from the committed context.

    Target features are collected as they come (`observe`) and projected into the context K/V in one
    batch before the next block, every 512 positions, or when the loop asks (`settle`: with each prefill
    chunk, and every block's worth of plain rounds); `rollback` forgets the newest positions. The weights
    are cast to the target's activation dtype on binding (`bind_dtype`)."""

    kind = "block"

    def __init__(self, model, target):
        bind_dtype(model, getattr(target, "activation_dtype", None))
        self._bind(model, model.config, target, model.get("draft_vocab"))
        self.context: list[ContextCache] = []
        self._pending: list[mx.array] = []
        self._pending_len = 0

    def _bind(self, model, config: DrafterConfig, target, draft_vocab) -> None:
        self.model, self.config, self.target, self.draft_vocab = model, config, target, draft_vocab
        self.target_layer_ids = tuple(config.target_layer_ids)
        self.block_size = int(config.block_size)
        self.mask_token_id = int(config.mask_token_id)
        self._draft_head = None

    def draft_logits(self, hidden):
        """Logits over the draft vocabulary (the full one unless the drafter has its own)."""
        if self.draft_vocab is None:
            return self.target.head(hidden)
        if self._draft_head is None:
            self._draft_head = self.target.head_rows(self.draft_vocab)
        return self._draft_head(hidden)

    def reset(self) -> None:
        self.context = self.model.make_context()
        self._pending, self._pending_len = [], 0

    @property
    def position(self) -> int:
        """Absolute position of the next context entry, i.e. of the next anchor."""
        return (self.context[0].next_pos if self.context else 0) + self._pending_len

    def observe(self, tokens: list[int], features: mx.array) -> None:
        """Target features [n, k*H] of the next n committed (target-processed) positions."""
        self._pending.append(features)
        self._pending_len += features.shape[0]
        if self._pending_len >= 512:
            self._flush()

    @property
    def backlog(self) -> int:
        """Observed positions not yet projected into the context."""
        return self._pending_len

    def settle(self) -> list[mx.array]:
        """Project the backlog into the context now; the context's arrays, for the caller to evaluate (the
        loop evaluates them with each prefill chunk, so the prompt's features are released at once)."""
        self._flush()
        return [a for c in self.context for a in c.fetch()[:2] if a is not None]

    def _flush(self) -> None:
        if not self._pending:
            return
        feats = self._pending[0] if len(self._pending) == 1 else mx.concatenate(self._pending, axis=0)
        self._pending, self._pending_len = [], 0
        self.model.extend_context(feats[None], self.context)

    def rollback(self, n: int) -> bool:
        """Forget the last n observed positions; False (and no change) if they were evicted."""
        from_pending = min(n, self._pending_len)
        rest = n - from_pending
        reaches = [layer.self_attn.context_reach for layer in self.model.layers]
        if rest and not all(c.can_trim(rest, r) for c, r in zip(self.context, reaches)):
            return False
        if from_pending:
            feats = mx.concatenate(self._pending, axis=0)[: self._pending_len - from_pending]
            self._pending = [feats] if feats.shape[0] else []
            self._pending_len -= from_pending
        for c in self.context:
            c.trim(rest)
        return True

    def embed_block(self, anchor: int, count: int) -> mx.array:
        """The block's input [count + 1, H]: the target's raw embedding rows of [anchor, mask x count]."""
        return self.target.embed(mx.array([anchor] + [self.mask_token_id] * count))

    def block_hidden(self, anchor: int, count: int) -> mx.array:
        """Drafter output for the block [anchor, mask x count]: [count + 1, H]."""
        self._flush()
        return self.model(self.embed_block(anchor, count)[None], self.position, self.context)[0]

    def propose(self, anchor: int, count: int, params, key):
        choice, probs = pick(self.target, self.draft_logits(self.block_hidden(anchor, count)[1:]), params, key)
        if self.draft_vocab is None:
            return choice, probs
        if probs is not None:
            probs = self.target.sampling.spread(probs, self.draft_vocab, self.target.vocab_size)
        return self.draft_vocab[choice], probs


# ---- reading and loading ---------------------------------------------------------------------------------


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
