"""DSpark block drafters (dspark-mlx's standalone `layers.*` format) in MLX.

A DSpark head is an EAGLE-style stack on the DFlash recipe: context =
hidden_norm(fc(target features)); block queries [anchor, mask, ...] over
[context ; block] keys, bidirectional, no window (the whole accepted context);
Qwen3-style layers (q/k RMS-norm, GQA, SiLU MLP). What differs from DFlash:

- block position i predicts the token after it (position 0, the anchor,
  predicts the first draft), so a block of `block_size` positions drafts
  `block_size` tokens: the loop's verify width is `block_size + 1`;
- a low-rank Markov bias: logits_i = head(h_i) + W2 W1[previous token],
  chosen left to right (the previous token of position 0 is the anchor);
- a confidence head: sigmoid(proj([h_i ; W1[previous token]])) estimates
  whether draft i will be accepted. dspark-mlx's loop reads it on the host and
  stops the block before the first draft below `confidence_threshold`
  (`_confident_prefix_length`), only to shrink the verify. Here the block is
  always offered whole (see `DSparkDrafter.propose`): `confidence_threshold`
  is read from config.json and checked, and `draft_block` still gives the
  head's logits, but no round waits on them.

The checkpoint may carry its own `embed_tokens` / `lm_head` (dspark-mlx's
drafters do); without them the head borrows the target's raw embedding rows
and its full output head, as the DFlash assistant does. Facts from dspark-mlx
0.1.0 (`arch/qwen3.py`, `model/heads.py`, `recipe.py`, `loop.py`). The
DeepSeek-V4 (`mtp.*`, MLA + MoE) and Gemma4 DSpark backbones are not read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn

from ..errors import GlimmerError
from ..sampling import probabilities, sample
from .base import Marginals
from .block import BlockDrafter
from .config import SourceConfig
from .context import BlockContext
from .layers import DecoderLayer, make_rope, quantizable
from .loading import load_block_model, read_drafter_config

DEFAULT_CONFIDENCE_THRESHOLD = 0.5
UNSUPPORTED_BACKBONES = ("deepseek_v4", "gemma4", "gemma4_text")


@dataclass
class DSparkConfig(SourceConfig):
    markov_rank: int = 256
    confidence_threshold: float = DEFAULT_CONFIDENCE_THRESHOLD
    own_embeddings: bool = False
    own_head: bool = False
    confidence_bias: bool = True

    NEEDS_VOCAB: ClassVar[bool] = True  # the Markov head is vocabulary-sized

    @classmethod
    def from_raw(cls, raw: dict[str, Any], where: Path | None = None) -> DSparkConfig:
        model_type = raw.get("model_type")
        if model_type in UNSUPPORTED_BACKBONES or "dspark_block_size" in raw:
            raise GlimmerError(
                f"{where}: model_type {model_type!r}: only Qwen3-style DSpark heads (layers.*) are supported, "
                "not the DeepSeek-V4 or Gemma4 DSpark backbones"
            )
        cfg = dict(raw)
        cfg["layer_types"] = ["full_attention"] * int(cfg.get("num_hidden_layers", 5))
        cfg["sliding_window"] = None  # DSpark attends to the whole accepted context
        cfg.setdefault("block_size", 7)
        out = cls.from_dict(cfg)
        out.raw = dict(raw)
        out.context_reach = None
        out.source_format = "dspark"
        return out

    def check(self, where: Path) -> None:
        if self.markov_rank < 1:
            raise GlimmerError(f"{where}: markov_rank {self.markov_rank} must be positive")
        if self.block_size < 1:
            raise GlimmerError(f"{where}: block_size {self.block_size} must be at least 1")
        if not 0.0 <= self.confidence_threshold < 1.0:
            raise GlimmerError(f"{where}: confidence_threshold {self.confidence_threshold} must be in [0, 1)")

    def adopt_weights(self, names) -> None:
        """Which optional parts the checkpoint carries (its own embedding / head, a confidence bias)."""
        names = set(names)
        self.own_embeddings = "embed_tokens.weight" in names
        self.own_head = "lm_head.weight" in names
        self.confidence_bias = "confidence_head.proj.bias" in names


class MarkovHead(nn.Module):
    """Low-rank token-transition bias: logits W2 (W1[token]) with W1, W2 both [vocab, rank]."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)


class ConfidenceHead(nn.Module):
    def __init__(self, dim: int, bias: bool):
        super().__init__()
        self.proj = nn.Linear(dim, 1, bias=bias)


class DSparkModel(BlockContext, nn.Module):
    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.config = cfg
        H, V = cfg.hidden_size, int(cfg.vocab_size or 0)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = nn.RMSNorm(H, eps=cfg.rms_norm_eps)
        self.layers = [DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.norm = nn.RMSNorm(H, eps=cfg.rms_norm_eps)
        self.markov_head = MarkovHead(V, cfg.markov_rank)
        self.confidence_head = ConfidenceHead(H + cfg.markov_rank, cfg.confidence_bias)
        if cfg.own_embeddings:
            self.embed_tokens = nn.Embedding(V, H)
        if cfg.own_head:
            self.lm_head = nn.Linear(H, V, bias=False)
        self.rope = make_rope(cfg)

    def quant_predicate(self, path: str, module) -> bool:
        return not path.startswith("confidence_head") and quantizable(module)  # one output row: nothing to gain

    @staticmethod
    def sanitize(weights: dict) -> dict:
        return {k.removeprefix("model."): v for k, v in weights.items()}


class DSparkDrafter(BlockDrafter):
    """A DSpark head bound to its target. `block_size` is the verify width (drafts + anchor)."""

    kind = "dspark"

    def __init__(self, model: DSparkModel, target):
        super().__init__(model, target)
        self.draft_len = int(self.config.block_size)
        self.block_size = self.draft_len + 1

    def embed(self, ids: mx.array) -> mx.array:
        return self.model.embed_tokens(ids) if self.config.own_embeddings else self.target.embed(ids)

    def base_logits(self, hidden: mx.array) -> mx.array:
        return self.model.lm_head(hidden) if self.config.own_head else self.target.head(hidden)

    def block_hidden(self, anchor: int, count: int | None = None) -> mx.array:
        """Drafter output for the full trained block [anchor, mask x (block_size - 1)]: [block_size, H]."""
        self._flush()
        ids = mx.array([anchor] + [self.mask_token_id] * (self.draft_len - 1))
        return self.model(self.embed(ids)[None], self.position, self.context)[0]

    def draft_block(self, anchor: int, n: int, params=None, noise=None):
        """Walk the block left to right: (tokens [n], biased logits [n, V], confidence logits [n], probs [n, V] | None)."""
        hidden = self.block_hidden(anchor)[:n]
        base = self.base_logits(hidden).astype(mx.float32)
        head, conf = self.model.markov_head, self.model.confidence_head
        greedy = params is None or params.greedy
        keys = None if greedy else noise.rows(n)
        previous = mx.array([anchor])
        tokens, biased, embeds, q_rows = [], [], [], []
        for i in range(n):
            embed = head.markov_w1(previous)  # [1, r]
            logits = base[i] + head.markov_w2(embed.astype(mx.float32))[0]
            if greedy:
                previous = mx.argmax(logits).reshape(1)
            else:
                q = probabilities(logits, params)
                q_rows.append(q)
                previous = sample(q, keys[i]).reshape(1)
            tokens.append(previous)
            biased.append(logits)
            embeds.append(embed[0])
        joined = mx.concatenate([hidden, mx.stack(embeds).astype(hidden.dtype)], axis=-1)
        confidence = conf.proj(joined.astype(mx.float32))[:, 0]
        probs = mx.stack(q_rows) if q_rows else None
        return mx.concatenate(tokens), mx.stack(biased), confidence, probs

    def marginals(self, anchor: int, count: int) -> Marginals:
        """The block's own per-position distributions (without the Markov head's bias on the previous token,
        which a tree's branches do not share)."""
        logits = self.base_logits(self.block_hidden(anchor)[: min(count, self.draft_len)]).astype(mx.float32)
        return Marginals(logits - mx.logsumexp(logits, axis=-1, keepdims=True))

    def propose(self, anchor: int, count: int, params, noise) -> tuple[mx.array, mx.array | None]:
        """The block's first `count` drafts (at most `draft_len`), all of them, on the device: nothing is read.

        dspark-mlx cuts the block before the first draft whose confidence is below `confidence_threshold`. That
        cut depends only on earlier drafts, so it never changes the output; its only use is a narrower verify.
        But the verify's width is a shape, fixed on the host before the draft exists (the loop queues draft and
        verify together and reads once per round, after the verdict), so cutting would need a second host read
        every round, or else verify the whole block anyway and throw away the accepted drafts past the cut:
        the same cost for fewer tokens. Offering the whole block is the lossless option that reads nothing
        (greedy output equals plain decoding; rejection sampling over the whole block is exact), and the width
        is left to whoever decides it on the host: `--block-size`, or the width policy from the acceptance
        it has read."""
        n = min(count, self.draft_len)
        if n < 1:
            return mx.array([], dtype=mx.uint32), None
        tokens, _, _, probs = self.draft_block(anchor, n, params, noise)
        return tokens, probs


def load_dspark_model(path: Path, cfg: DSparkConfig | None = None) -> DSparkModel:
    return load_block_model(path, cfg or read_drafter_config(path, DSparkConfig), DSparkModel)
