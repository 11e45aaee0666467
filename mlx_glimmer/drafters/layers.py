"""The Qwen3-style decoder layer every block drafter builds on: q/k RMS-norm, GQA, SiLU MLP, attention of the
block's queries over [context ; block] keys."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import initialize_rope

from .config import DrafterConfig
from .context import ContextCache


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
    def __init__(self, cfg: DrafterConfig, layer_idx: int, attention: type[Attention] = Attention):
        super().__init__()
        self.self_attn = attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, x, rope, position, context):
        h = x + self.self_attn(self.input_layernorm(x), rope, position, context)
        return h + self.mlp(self.post_attention_layernorm(h))
