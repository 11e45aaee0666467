"""The DFlash block drafter (`muse_glimmer_assistant`) in MLX.

One forward proposes a whole block: the input is the target's raw embeddings
of [anchor, mask, mask, ...]; queries come from the block only; keys/values
are [context ; block], where the context is the projection of the target's
hidden states at `target_layer_ids` for every committed position. Attention is
bidirectional; on sliding layers a query at position q sees a key (context or
block) at k iff |q - k| <= sliding_window, the rule of transformers'
`create_bidirectional_sliding_window_mask`. The drafter has no embedding table or output head
of its own: it borrows the target's.

Also reads z-lab DFlash checkpoints (`DFlashDraftModel`: `fc` / `hidden_norm`
names, settings in a `dflash_config` block); their math is the same.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from .block import BlockDrafter
from .config import DrafterConfig
from .context import BlockContext
from .layers import DecoderLayer, make_rope
from .loading import load_block_model, read_drafter_config


def dflash_target_layer_ids(num_target_layers: int, num_context_layers: int) -> list[int]:
    """The DFlash rule for which target layers feed the drafter."""
    k, n = num_context_layers, num_target_layers
    if k == 1:
        return [1]
    return [round(1 + i * (n - 4) / (k - 1)) for i in range(k)]


class ContextProjection(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.output_norm_enc = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, features):
        return self.output_norm_enc(self.fc(features))


class DFlashModel(BlockContext, nn.Module):
    """The drafter's weights and forward; bound to a target's embedding and head by `DFlashDrafter`."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        self.encoder = ContextProjection(cfg)
        self.layers = [DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        if cfg.draft_vocab_size:
            self.draft_vocab = mx.zeros((cfg.draft_vocab_size,), dtype=mx.int32)
        self.rope = make_rope(cfg)

    def project_context(self, features: mx.array) -> mx.array:
        return self.encoder(features)

    @staticmethod
    def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
        out = {}
        for k, v in weights.items():
            k = k.removeprefix("model.")
            if k.startswith("fc."):
                k = "encoder." + k
            elif k.startswith("hidden_norm."):
                k = "encoder.output_norm_enc." + k[len("hidden_norm.") :]
            if k.startswith(("embed_tokens.", "lm_head.")):
                continue
            out[k] = v
        return out


class DFlashDrafter(BlockDrafter):
    """A DFlash model bound to its target."""

    kind = "dflash"


def load_dflash_model(path: Path, config: DrafterConfig | None = None) -> DFlashModel:
    return load_block_model(path, config or read_drafter_config(path), DFlashModel)
