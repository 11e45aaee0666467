"""A block drafter model bound to its target, as the loop's `Drafter`.

A block drafter (DFlash, DFlash2, DSpark) proposes a whole block in one
forward: the input is [anchor, mask, mask, ...] (embedded by the target's
table), queries come from the block, keys/values are [context ; block], where
the context is a projection of the target's hidden states at
`target_layer_ids` for every committed position. The families differ in their
layers (`layers.py`), their attention mask and how they turn block outputs
into drafts; `BlockDrafter` holds the rest: collecting features, projecting
them into the context (`context.py`), rolling back, drafting from the block.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..few_rows import use_few_row_products
from ..sampling import pick
from .base import Drafter, Marginals
from .config import DrafterConfig
from .context import ContextCache


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


class BlockDrafter(Drafter):
    """A block drafter model bound to its target: proposes a block from the committed context.

    Target features are collected as they come (`observe`) and projected into the context K/V in one
    batch before the next block, every 512 positions, or when the loop asks (`settle`: with each prefill
    chunk, and every block's worth of plain rounds); `rollback` forgets the newest positions. The weights
    are cast to the target's activation dtype on binding (`bind_dtype`)."""

    kind = "block"
    has_marginals = True

    def __init__(self, model, target):
        if target is not None:  # a DSpark head with its own embedding and head drafts without one
            bind_dtype(model, target.activation_dtype)
        use_few_row_products(model)
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

    def marginals(self, anchor: int, count: int) -> Marginals:
        logits = self.draft_logits(self.block_hidden(anchor, count)[1:]).astype(mx.float32)
        return Marginals(logits - mx.logsumexp(logits, axis=-1, keepdims=True), self.draft_vocab)

    def propose(self, anchor: int, count: int, params, noise):
        logits = self.draft_logits(self.block_hidden(anchor, count)[1:])
        choice, probs = pick(self.target, logits, params, noise, self.draft_vocab)
        if self.draft_vocab is None:
            return choice, probs
        if probs is not None:
            probs = self.target.sampling.spread(probs, self.draft_vocab, self.target.vocab_size)
        return self.draft_vocab[choice], probs
