"""DFlash2 block drafters (z-lab `DFlash2DraftModel`) in MLX.

DFlash2 keeps the DFlash block drafter (context = fc(target features), block
queries over [context ; block] keys, one forward per block) and adds two parts:

- a grouped dynamic causal convolution around every attention and MLP:
  `prepare` mixes each block position with the `kernel_size - 1` before it
  (per-channel base kernel plus a per-position, per-group kernel projected
  from the hidden state), and `finish` does the same to the sub-layer's output
  with the second half of those kernels. It runs over the block only; the
  block starts at the anchor, so there is no state to carry between rounds;
- a pairwise candidate selector: the `selector_top_k` best tokens of each
  block position (by the draft logits) are rescored with
  `unary + <pred_codebook[previous token] * P h, succ_codebook[candidate]>`
  and chosen left to right, the previous token being the anchor for the first
  position. When sampling, position i draws from softmax(scores_i) under the
  request's temperature / top-k / top-p, so its draft distribution is known
  exactly (zero outside the candidates): rejection sampling stays exact.

Facts taken from `dflash` 0.1.0 (`dflash/model.py`): attention is causal inside
the block on sliding layers (unless `is_causal` says otherwise) and a sliding
layer sees key k from query q iff q - k < sliding_window (and k - q < window
when not causal); draft logits are the target's raw output projection times
`output_multiplier`, then `final_logit_softcapping`, both read from the
drafter's own `dflash_config` (not the target's); noise embeddings are the
target's raw embedding rows times `input_embedding_scale`. Published
checkpoints name the codebooks without `.weight`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar

import mlx.core as mx
import mlx.nn as nn

from ..array_ops import MLX_OPS
from ..errors import GlimmerError
from ..noise import Noise, gumbel_of_tokens
from ..sampling import probabilities
from ..target import output_projection
from .block import BlockDrafter
from .config import SourceConfig
from .context import BlockContext
from .layers import Attention, DecoderLayer, make_rope, quantizable
from .loading import load_block_model, read_drafter_config

SELECTOR_CODEBOOKS = ("predecessor_codebook", "successor_codebook")


def _draft_value(raw: dict, name: str, default=None):
    """A DFlash setting: the `dflash_config` block wins over the top level (as in z-lab's loader)."""
    block = raw.get("dflash_config") or {}
    return block.get(name, raw.get(name, default))


@dataclass
class DFlash2Config(SourceConfig):
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    is_causal: bool | None = None

    NEEDS_VOCAB: ClassVar[bool] = True  # the selector's codebooks are vocabulary-sized

    @classmethod
    def from_raw(cls, raw: dict[str, Any], where: Path | None = None) -> DFlash2Config:
        cfg = cls.from_dict(raw)  # DrafterConfig reads the shared DFlash fields (dflash_config, rope, ...)
        cfg.raw = dict(raw)
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            setattr(cfg, name, int(_draft_value(raw, name, 0) or 0))
        cfg.input_embedding_scale = float(_draft_value(raw, "input_embedding_scale", 1.0))
        cfg.output_multiplier = float(_draft_value(raw, "output_multiplier", 1.0))
        cap = _draft_value(raw, "final_logit_softcapping")
        cfg.final_logit_softcapping = float(cap) if cap is not None and float(cap) > 0 else None
        cfg.is_causal = raw.get("is_causal")
        cfg.source_format = "dflash2"
        return cfg

    def check(self, where: Path) -> None:
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            if getattr(self, name) < 1:
                raise GlimmerError(
                    f"{where}: dflash_config.{name} is missing or not positive (a DFlash2 drafter needs it)"
                )
        if self.hidden_size % self.conv_group_size:
            raise GlimmerError(
                f"{where}: dflash_config.conv_group_size {self.conv_group_size} does not divide hidden_size {self.hidden_size}"
            )
        if self.vocab_size is not None and self.selector_top_k > self.vocab_size:
            raise GlimmerError(
                f"{where}: dflash_config.selector_top_k {self.selector_top_k} exceeds vocab_size {self.vocab_size}"
            )


class DFlash2Attention(Attention):
    """DFlash attention with z-lab's mask: causal inside the block on sliding layers, q - k < window."""

    def __init__(self, cfg: DFlash2Config, layer_idx: int):
        super().__init__(cfg, layer_idx)
        sliding = cfg.layer_types[layer_idx] == "sliding_attention"
        self.window = cfg.sliding_window if sliding else None
        self.causal = sliding if cfg.is_causal is None else bool(cfg.is_causal)
        # What the context cache and rollback need: the farthest context key a block query sees.
        self.context_reach = None if self.window is None else self.window - 1

    def mask(self, position: int, length: int, first_pos: int) -> mx.array | None:
        if not (self.causal or self.window is not None):
            return None
        q_pos = mx.arange(position, position + length)[:, None]
        k_pos = mx.arange(first_pos, position + length)[None]
        mask = mx.ones((length, position + length - first_pos), dtype=mx.bool_)
        if self.causal:
            mask = mask & (k_pos <= q_pos)
        if self.window is not None:
            mask = mask & (q_pos - k_pos < self.window)
            if not self.causal:
                mask = mask & (k_pos - q_pos < self.window)
        return mask


class GroupedDynamicCausalConv(nn.Module):
    """out[t] = sum_o (base[o] + dyn[t, o, group]) * x[t - o], o < kernel_size, zero before the block."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size = kernel_size
        self.group_size = group_size
        self.groups = hidden_size // group_size
        self.base_kernel = mx.zeros((2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def _convolve(self, x: mx.array, dynamic: mx.array, base: mx.array) -> mx.array:
        B, L, H = x.shape
        G, S = self.groups, self.group_size
        blocks = x.reshape(B, L, G, S)
        out = None
        for o in range(min(self.kernel_size, L)):
            shifted = blocks if o == 0 else mx.concatenate([mx.zeros_like(blocks[:, :o]), blocks[:, : L - o]], axis=1)
            weight = base[o].reshape(G, S).astype(x.dtype) + dynamic[:, :, o, :, None]
            term = weight * shifted
            out = term if out is None else out + term
        return out.reshape(B, L, H)

    def prepare(self, x: mx.array) -> tuple[mx.array, mx.array]:
        B, L, _ = x.shape
        dynamic = self.kernel_projection(x).reshape(B, L, 2, self.kernel_size, self.groups)
        return self._convolve(x, dynamic[:, :, 0], self.base_kernel[0]), dynamic[:, :, 1]

    def finish(self, x: mx.array, dynamic: mx.array) -> mx.array:
        return self._convolve(x, dynamic, self.base_kernel[1])


class DFlash2Layer(DecoderLayer):
    def __init__(self, cfg: DFlash2Config, layer_idx: int):
        super().__init__(cfg, layer_idx, DFlash2Attention)
        self.attention_conv = GroupedDynamicCausalConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        self.mlp_conv = GroupedDynamicCausalConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)

    def __call__(self, x, rope, position, context):
        h, kernel = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(h, rope, position, context), kernel)
        h, kernel = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), kernel)


class CandidateSelector(nn.Module):
    def __init__(self, cfg: DFlash2Config):
        super().__init__()
        vocab = int(cfg.vocab_size or 0)
        self.top_k = cfg.selector_top_k
        self.predecessor_codebook = nn.Embedding(vocab, cfg.selector_rank)
        self.successor_codebook = nn.Embedding(vocab, cfg.selector_rank)
        self.hidden_projection = nn.Linear(cfg.hidden_size, cfg.selector_rank, bias=False)

    def select(self, hidden: mx.array, logits: mx.array, anchor: int, params=None, noise: Noise | None = None):
        """Choose one token per block position, left to right.

        `hidden` [n, H] and `logits` [n, V] of the draft positions. Returns
        (tokens [n], candidates [n, k], scores [n, k], probs over candidates [n, k] or None).
        Greedy when `params` is None or greedy; sampled, position i draws with `noise.at(i)` the noise the
        target draws at that position for the candidates' token ids (`noise.gumbel_of_tokens`), so a draft
        is the target's own sample wherever their distributions agree. Nothing is evaluated here.
        """
        n = logits.shape[0]
        k = min(self.top_k, logits.shape[-1])
        candidates = mx.argpartition(logits, kth=-k, axis=-1)[:, -k:]
        unary = mx.take_along_axis(logits, candidates, axis=-1)
        projected = self.hidden_projection(hidden)  # [n, r]
        successors = self.successor_codebook(candidates)  # [n, k, r]
        greedy = params is None or params.greedy
        if not greedy:
            positions = mx.arange(noise.start, noise.start + n, dtype=mx.int64)
            g = gumbel_of_tokens(MLX_OPS, noise.seed, positions, candidates)  # [n, k]
        previous = mx.array([anchor])
        tokens, scores, q_rows = [], [], []
        for i in range(n):
            query = (self.predecessor_codebook(previous)[0] * projected[i]).astype(successors.dtype)
            s = unary[i] + (successors[i] @ query).astype(unary.dtype)
            if greedy:
                pick = mx.argmax(s)
            else:
                q = probabilities(s, params)
                q_rows.append(q)
                pick = mx.argmax(mx.log(q) + g[i])
            previous = candidates[i, pick].reshape(1)
            tokens.append(previous)
            scores.append(s)
        return mx.concatenate(tokens), candidates, mx.stack(scores), (mx.stack(q_rows) if q_rows else None)


class DFlash2Model(BlockContext, nn.Module):
    def __init__(self, cfg: DFlash2Config):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.layers = [DFlash2Layer(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.candidate_selector = CandidateSelector(cfg)
        self.rope = make_rope(cfg)

    def quant_predicate(self, path: str, module) -> bool:
        return quantizable(module)

    @staticmethod
    def sanitize(weights: dict) -> dict:
        out = {}
        for k, v in weights.items():
            k = k.removeprefix("model.")
            if k.startswith(("embed_tokens.", "lm_head.")):
                continue
            if k in tuple(f"candidate_selector.{name}" for name in SELECTOR_CODEBOOKS):
                k += ".weight"  # the published layout names the codebooks without `.weight`
            out[k] = v
        return out


def raw_output_projection(target) -> Callable[[mx.array], mx.array]:
    """The target's output projection alone (no multiplier, no softcap): what z-lab's `_output_head` returns."""
    return output_projection(target.model)


def compute_logits(hidden: mx.array, project, cfg: DFlash2Config) -> mx.array:
    logits = project(hidden) * cfg.output_multiplier
    cap = cfg.final_logit_softcapping
    return mx.tanh(logits / cap) * cap if cap else logits


class DFlash2Drafter(BlockDrafter):
    """A DFlash2 model bound to its target (same context handling and rollback as DFlash)."""

    kind = "dflash2"

    def __init__(self, model: DFlash2Model, target):
        super().__init__(model, target)
        self._project = raw_output_projection(target)

    def embed_block(self, anchor: int, count: int) -> mx.array:
        noise = super().embed_block(anchor, count)
        scale = self.config.input_embedding_scale
        return noise * scale if scale != 1.0 else noise

    def draft_logits(self, hidden: mx.array) -> mx.array:
        return compute_logits(hidden, self._project, self.config)

    def propose(self, anchor: int, count: int, params, noise) -> tuple[mx.array, mx.array | None]:
        hidden = self.block_hidden(anchor, count)[1:]
        logits = self.draft_logits(hidden)
        tokens, candidates, _, q = self.model.candidate_selector.select(hidden, logits, anchor, params, noise)
        if q is None:
            return tokens, None
        full = mx.zeros((count, logits.shape[-1]), dtype=q.dtype)
        return tokens, mx.put_along_axis(full, candidates, q, axis=-1)


def load_dflash2_model(path: Path, cfg: DFlash2Config | None = None) -> DFlash2Model:
    return load_block_model(path, cfg or read_drafter_config(path, DFlash2Config), DFlash2Model)
