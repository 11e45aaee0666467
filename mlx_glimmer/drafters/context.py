"""The drafter's context: per-layer K/V of the committed positions (`ContextCache`), bounded by the window
plus `CONTEXT_SLACK`, and the block forward over it (`BlockContext`)."""

from __future__ import annotations

import mlx.core as mx


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
