"""Memory on Metal: the target kept resident, freed buffers handed back. One small seam, no-ops elsewhere.

mlx-lm runs every generation inside `wired_limit` and calls `mx.clear_cache()`
after prefill chunks and every 256 tokens. Without a wired limit macOS may page
a 17 GB target out between requests on a 36 GB Mac; without clearing, freed
buffers pile up in MLX's cache. mlx-lm wires the whole recommended working set
(mlx-lm issue 883: 75% of RAM, unbounded by the model's size); here the limit is
the weights plus headroom, bounded by the device's recommended working set,
and the cache limit a quarter of it.

`DeviceMemory` is what the loop and `generate` call (`target.memory`):
`resident(*models)` around a generation, `clear()` after prefill chunks and
`tick(before, after)` as tokens are committed. It does nothing unless Metal is
available (or a test hands it `enabled=True` and a fake `ops`); `calls`
records what it did, so tests can see it.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import mlx.core as mx
from mlx.utils import tree_flatten

GIB = 1 << 30
CLEAR_EVERY = 256  # tokens between two clear_cache calls during decoding (mlx-lm's cadence)


def headroom(weights: int) -> int:
    """Room above the weights for KV caches, activations and the drafter's context: a quarter, at least 1 GiB."""
    return max(weights // 4, GIB)


def model_bytes(*models) -> int:
    """Bytes of the MLX parameters of `models` (nn.Modules; anything else counts 0)."""
    total = 0
    for model in models:
        params = getattr(model, "parameters", None)
        if params is None:
            continue
        try:
            leaves = tree_flatten(params())
        except TypeError:  # not an MLX module (a torch one)
            continue
        total += sum(v.nbytes for _, v in leaves if isinstance(v, mx.array))
    return total


class DeviceMemory:
    """Wired limit, cache limit and clear_cache cadence for one target (see the module docstring)."""

    def __init__(self, enabled: bool | None = None, ops: Any = None, clear_every: int = CLEAR_EVERY):
        self.ops = ops if ops is not None else mx
        self.enabled = bool(mx.metal.is_available()) if enabled is None else enabled
        self.clear_every = clear_every
        self.calls: list[tuple] = []  # ("wired", bytes) / ("cache_limit", bytes) / ("clear",) / ("restore", ...)
        self._depth = 0
        self._saved: tuple[int, int] | None = None

    def limits(self, weights: int) -> tuple[int, int]:
        """(wired limit, cache limit) for a working set of `weights` bytes: weights + headroom, at most the
        device's recommended working set; the cache a quarter of that."""
        wired = weights + headroom(weights)
        info = self.ops.device_info()
        bound = int(info.get("max_recommended_working_set_size", 0) or 0)
        if bound:
            wired = min(wired, bound)
        return wired, wired // 4

    @contextmanager
    def resident(self, *models) -> Iterator[None]:
        """Keep the weights of `models` (and headroom) wired while the body runs; nested and interleaved uses
        share one setting, restored when the last one ends."""
        if not self.enabled:
            yield
            return
        if self._depth == 0:
            wired, cache = self.limits(model_bytes(*models))
            old_wired = self.ops.set_wired_limit(wired)
            old_cache = self.ops.set_cache_limit(cache)
            self._saved = (old_wired, old_cache)
            self.calls += [("wired", wired), ("cache_limit", cache)]
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0 and self._saved is not None:
                old_wired, old_cache = self._saved
                self._saved = None
                self.ops.set_wired_limit(old_wired)
                self.ops.set_cache_limit(old_cache)
                self.calls.append(("restore", old_wired, old_cache))

    def clear(self) -> None:
        """Hand MLX's cached (freed) buffers back: after a prefill chunk, and every `clear_every` tokens."""
        if self.enabled:
            self.ops.clear_cache()
            self.calls.append(("clear",))

    def tick(self, before: int, after: int) -> None:
        """Tokens committed went from `before` to `after`: clear when that crossed a multiple of `clear_every`."""
        if after // self.clear_every > before // self.clear_every:
            self.clear()


NO_MEMORY = DeviceMemory(enabled=False)  # a target without Metal (the torch backend)
