"""A sliding-window KV cache whose recent tokens can be rolled back at any length.

mlx-lm's `RotatingKVCache` overwrites its oldest slots in place, so once the
context is longer than the window, trimming the last few tokens cannot bring
back the slots they overwrote. Speculative verification writes a whole block
and then rejects part of it, so that is exactly what we need to undo.

`WindowedKVCache` keeps its entries in temporal order and retains
`window - 1 + reserve` of them (plus whatever the current step appends), so
that after any rollback of up to `reserve` tokens every later query still sees
its full window. Old entries are dropped lazily, in one copy every `step`
tokens, so the per-token cost stays a slice assignment like mlx-lm's caches.
Requests a server decodes together hold theirs as rows of its batched form,
`server.batch_cache.BatchWindowedKVCache`.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache, _BaseCache, make_prompt_cache

from .tree import mlx_trees


class WindowedKVCache(_BaseCache):
    step = 256

    def __init__(self, window: int, reserve: int = 16):
        self.window = window
        self.reserve = reserve
        self.keys = None
        self.values = None
        self.offset = 0  # absolute position of the next token
        self.start = 0  # buffer index of the oldest visible entry
        self.end = 0  # buffer index one past the newest entry

    @property
    def retained(self) -> int:
        return self.window - 1 + self.reserve

    def _visible_before_update(self) -> int:
        return min(self.end - self.start, self.retained)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        S = keys.shape[2]
        self.start = self.end - self._visible_before_update()
        if self.keys is None or self.end + S > self.keys.shape[2]:
            B, H, _, Dk = keys.shape
            Dv = values.shape[3]
            kept = self.end - self.start
            capacity = kept + S + self.step
            new_k = mx.zeros((B, H, capacity, Dk), keys.dtype)
            new_v = mx.zeros((B, H, capacity, Dv), values.dtype)
            if self.keys is not None and kept:
                new_k[..., :kept, :] = self.keys[..., self.start : self.end, :]
                new_v[..., :kept, :] = self.values[..., self.start : self.end, :]
            self.keys, self.values = new_k, new_v
            self.start, self.end = 0, kept
        self.keys[..., self.end : self.end + S, :] = keys
        self.values[..., self.end : self.end + S, :] = values
        self.end += S
        self.offset += S
        return self.keys[..., self.start : self.end, :], self.values[..., self.start : self.end, :]

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        window = window_size or self.window
        n_prev = self._visible_before_update()
        if n_prev + N <= window and not return_array:
            return "causal" if N > 1 else None
        q_pos = mx.arange(self.offset, self.offset + N)[:, None]
        k_pos = mx.arange(self.offset - n_prev, self.offset + N)[None]
        return (k_pos <= q_pos) & (q_pos - k_pos < window)

    def size(self) -> int:
        return min(self.end - self.start, self.window)

    def is_trimmable(self) -> bool:
        return True

    def can_trim(self, n: int) -> bool:
        """After trimming n, does the next query still find its whole window?"""
        stored = self.end - self.start
        nothing_evicted = self.offset == stored
        return n <= stored and (nothing_evicted or stored - n >= self.window - 1)

    def trim(self, n: int) -> int:
        n = min(n, self.end - self.start)
        self.end -= n
        self.offset -= n
        return n

    def empty(self) -> bool:
        return self.keys is None

    @property
    def state(self):
        if self.keys is None:
            return None, None
        return self.keys[..., self.start : self.end, :], self.values[..., self.start : self.end, :]

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes


def stored_before_update(cache) -> int:
    """How many cached positions the next `update_and_fetch` returns before the new ones."""
    return cache._visible_before_update() if isinstance(cache, WindowedKVCache) else cache.offset


class TreeCacheView:
    """One layer's cache during a draft-tree verify (`target.Target.forward(tree=...)`), through the seams
    mlx-lm's models already use: `make_mask` (asked by `create_attention_mask`) returns the tree's mask
    (each position sees the cached ones within its window and its own ancestors), and `offset` (read for
    RoPE) is one position per token, the anchor's plus the depth (`target.accept_token_positions` lets the
    RoPE modules take it). K/V are written as for any verify: the tree's positions follow the cache in tree
    order, and `keep_positions` leaves the accepted path's rows, in order, afterwards."""

    def __init__(self, cache, tree):
        self.cache, self.tree = cache, tree

    @property
    def offset(self):
        return self.cache.offset + self.tree.depths

    def update_and_fetch(self, keys, values):
        return self.cache.update_and_fetch(keys, values)

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        window = window_size or (self.cache.window if isinstance(self.cache, WindowedKVCache) else None)
        return mlx_trees.attention_mask(self.tree, stored_before_update(self.cache), window)

    def __getattr__(self, name):
        return getattr(self.cache, name)


def keep_positions(caches: list, positions: list[int], width: int) -> None:
    """After a verify wrote `width` positions, keep `positions` of them (ascending indices into the verify)
    as the newest entries, in order, and drop the rest: a tree round keeps its accepted path only."""
    kept = len(positions)
    if positions != list(range(kept)):
        rows = mx.array(positions)
        for c in caches:
            base = (c.end if isinstance(c, WindowedKVCache) else c.offset) - width
            c.keys[..., base : base + kept, :] = mx.take(c.keys, base + rows, axis=2)
            c.values[..., base : base + kept, :] = mx.take(c.values, base + rows, axis=2)
    trim_cache(caches, width - kept)


def make_rollback_cache(model, reserve: int) -> list:
    """mlx-lm's prompt cache for `model`, with every sliding-window layer made rollback-safe."""
    caches = make_prompt_cache(model)
    out = []
    for c in caches:
        if isinstance(c, RotatingKVCache):
            if c.keep:
                raise ValueError("rotating caches with keep > 0 are not supported")
            out.append(WindowedKVCache(c.max_size, reserve))
        elif isinstance(c, KVCache):
            out.append(c)
        else:
            raise ValueError(f"cache type {type(c).__name__} cannot be rolled back")
    return out


def trim_cache(caches: list, n: int) -> None:
    if n <= 0:
        return
    for c in caches:
        c.trim(n)
