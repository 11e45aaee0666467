"""The batched forms of a target's KV caches: one request's cache merged into a batch, and extracted back.

A full-attention layer's `KVCache` batches as mlx-lm's `BatchKVCache` (rows
left-padded, one RoPE offset per row). A sliding-window layer's rollback-safe
`cache.WindowedKVCache` batches as `BatchWindowedKVCache`, below: mlx-lm's
`BatchRotatingKVCache` keeps `window` entries per row, so a request leaving it
could no longer roll back the tokens a chat template re-renders, and its
follow-up turn would start cold.

`BatchWindowedKVCache` keeps each row as its own `WindowedKVCache` would: the
entries in temporal order, right-aligned (a row's newest entry is in the same
column as every other row's), and before each update each row keeps
`window - 1 + reserve` of its entries, as `WindowedKVCache.update_and_fetch`
does. A row's cache extracted after any number of steps is therefore the very
cache that row's `WindowedKVCache` would hold after the same forwards: the
same entries, the same offset, the same rollback room. Columns older than
every row keeps are dropped lazily, in one copy every `step` tokens, as the
solo cache does.
"""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from ..cache import WindowedKVCache


class BatchedCache(Protocol):
    """What the batch loop needs of a layer's batched cache (mlx-lm's `BatchKVCache` is one): `merge` a
    request's own caches into one, `extend` by another batch's rows, `extract` a row as a request's own cache,
    `filter` to keep some rows; the model calls `update_and_fetch`, `make_mask` and reads `offset` (one per
    row)."""

    @classmethod
    def merge(cls, caches: list) -> "BatchedCache": ...

    def extend(self, other: "BatchedCache") -> None: ...

    def extract(self, idx: int): ...

    def filter(self, batch_indices: list[int]) -> None: ...


class BatchWindowedKVCache:
    """Rows of `WindowedKVCache`s decoding together (see the module docstring). `stored[i]`: entries row i
    holds (the newest `stored[i]` columns before `end`); `offset`: each row's absolute position, for RoPE."""

    step = 256

    def __init__(self, window: int, reserves: list[int], stored: list[int], positions: list[int]):
        self.window = window
        self.reserves = list(reserves)
        self.stored = list(stored)
        self.positions = list(positions)  # the host's copy of `offset`
        self.offset = mx.array(self.positions)
        self.keys = None
        self.values = None
        self.start = 0  # buffer column of the oldest entry any row still holds
        self.end = 0  # buffer column one past the newest entry

    def _kept(self) -> list[int]:
        """Entries each row keeps before the next update (`WindowedKVCache._visible_before_update`)."""
        return [min(n, self.window - 1 + r) for n, r in zip(self.stored, self.reserves)]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        S = keys.shape[2]
        kept = self._kept()
        self.start = self.end - max(kept)
        if self.keys is None or self.end + S > self.keys.shape[2]:
            self._reallocate(S + self.step, keys, values)
        self.keys[..., self.end : self.end + S, :] = keys
        self.values[..., self.end : self.end + S, :] = values
        self.end += S
        self.stored = [n + S for n in kept]
        self.positions = [p + S for p in self.positions]
        self.offset = self.offset + S
        return self.keys[..., self.start : self.end, :], self.values[..., self.start : self.end, :]

    def _reallocate(self, room: int, keys: mx.array, values: mx.array) -> None:
        """A new buffer holding the columns [start, end) at its front, with `room` more after them (shaped and
        typed as `keys` and `values`)."""
        B, H, _, Dk = keys.shape
        kept = self.end - self.start
        new_k = mx.zeros((B, H, kept + room, Dk), keys.dtype)
        new_v = mx.zeros((B, H, kept + room, values.shape[3]), values.dtype)
        if self.keys is not None and kept:
            new_k[..., :kept, :] = self.keys[..., self.start : self.end, :]
            new_v[..., :kept, :] = self.values[..., self.start : self.end, :]
        self.keys, self.values = new_k, new_v
        self.start, self.end = 0, kept

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False) -> mx.array:
        """[B, 1, N, K]: query i (position p + i of its row) sees the keys of its own row that are neither
        padding nor in the future nor `window` or more positions back. Every row's newest entry sits in the
        same column, so positions differ by columns."""
        window = window_size or self.window
        kept = self._kept()
        before = max(kept)  # columns `update_and_fetch` returns ahead of the new ones
        q = mx.arange(before, before + N)[:, None]
        k = mx.arange(before + N)[None]
        first = mx.array([before - n for n in kept])[:, None, None, None]  # each row's oldest kept column
        return (k <= q) & (q - k < window) & (k >= first)

    @classmethod
    def merge(cls, caches: list[WindowedKVCache]) -> "BatchWindowedKVCache":
        """Requests' own caches as rows of one batch (their windows must agree)."""
        windows = {c.window for c in caches}
        if len(windows) != 1:
            raise ValueError(f"caches with different windows ({sorted(windows)}) cannot decode together")
        stored = [c.end - c.start for c in caches]
        batch = cls(windows.pop(), [c.reserve for c in caches], stored, [c.offset for c in caches])
        like = next((c for c in caches if c.keys is not None), None)
        if like is None:
            return batch
        width = max(stored)
        B, (_, H, _, Dk), Dv = len(caches), like.keys.shape, like.values.shape[3]
        batch.keys = mx.zeros((B, H, width, Dk), like.keys.dtype)
        batch.values = mx.zeros((B, H, width, Dv), like.values.dtype)
        for i, (c, n) in enumerate(zip(caches, stored)):
            if n:
                keys, values = c.state
                batch.keys[i : i + 1, :, width - n :] = keys
                batch.values[i : i + 1, :, width - n :] = values
        batch.end = width
        return batch

    def extend(self, other: "BatchWindowedKVCache") -> None:
        """Add `other`'s rows after this batch's, both right-aligned in one buffer."""
        if other.window != self.window:
            raise ValueError(f"caches with windows {self.window} and {other.window} cannot decode together")
        if self.keys is None or other.keys is None:
            ours = self if self.keys is not None else other
            if ours.keys is not None:  # the empty side's rows are all padding
                empty = other if ours is self else self
                pad = [(0, len(empty.stored))] if ours is self else [(len(empty.stored), 0)]
                ours.keys = mx.pad(ours.keys, pad + [(0, 0)] * 3)
                ours.values = mx.pad(ours.values, pad + [(0, 0)] * 3)
                self.keys, self.values, self.start, self.end = ours.keys, ours.values, ours.start, ours.end
        else:
            width = max(self.end - self.start, other.end - other.start)
            self.keys = mx.concatenate([self._aligned(self.keys, width), other._aligned(other.keys, width)])
            self.values = mx.concatenate([self._aligned(self.values, width), other._aligned(other.values, width)])
            self.start, self.end = 0, width
        self.reserves += other.reserves
        self.stored += other.stored
        self.positions += other.positions
        self.offset = mx.array(self.positions)

    def _aligned(self, buffer: mx.array, width: int) -> mx.array:
        """Columns [start, end) of `buffer`, left-padded to `width`."""
        held = buffer[..., self.start : self.end, :]
        return mx.pad(held, [(0, 0), (0, 0), (width - held.shape[2], 0), (0, 0)])

    def extract(self, idx: int) -> WindowedKVCache:
        """Row `idx` as a request's own cache: its entries (copied out of the batch's buffer) and position."""
        cache = WindowedKVCache(self.window, self.reserves[idx])
        n = self.stored[idx]
        cache.offset = self.positions[idx]
        if n and self.keys is not None:
            cache.keys = mx.contiguous(self.keys[idx : idx + 1, :, self.end - n : self.end])
            cache.values = mx.contiguous(self.values[idx : idx + 1, :, self.end - n : self.end])
            cache.end = n
        return cache

    def filter(self, batch_indices: list[int]) -> None:
        """Keep the rows `batch_indices`, in that order."""
        if self.keys is not None:
            index = mx.array(batch_indices)
            self.keys, self.values = self.keys[index], self.values[index]
        self.reserves = [self.reserves[i] for i in batch_indices]
        self.stored = [self.stored[i] for i in batch_indices]
        self.positions = [self.positions[i] for i in batch_indices]
        self.offset = mx.array(self.positions)

    @property
    def state(self):
        if self.keys is None:
            return None, None
        return self.keys[..., self.start : self.end, :], self.values[..., self.start : self.end, :]

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


BATCHED_FORMS: dict[type, type] = {KVCache: BatchKVCache, WindowedKVCache: BatchWindowedKVCache}


def unbatched_kinds(caches: list) -> set[type]:
    """The kinds among a request's `caches` that have no batched form."""
    return {type(c) for c in caches} - set(BATCHED_FORMS)


def merge_rows(caches: list[list]) -> list[BatchedCache]:
    """Several requests' caches (one list of layers each, same layout) as one batched cache per layer."""
    return [BATCHED_FORMS[type(layer[0])].merge(list(layer)) for layer in zip(*caches)]
