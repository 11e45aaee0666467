"""The frozen target's features for every training sequence, computed once and kept on disk.

Training reads the outputs of the target's `target_layer_ids` decoder layers at
every position of every sequence, every epoch. Computing them costs a target
forward per sequence (more than a training step at this size), so they are
computed once, in order, and stored as one float16 memmap:

    DIR/features.f16     rows of k*H float16 values, sequence after sequence
    DIR/features.json    layer ids, sequence lengths, how many sequences are done

Disk bound: tokens x k x H x 2 bytes (SmolLM2 with 5 context layers: 5.8 KB
per token, 8.6 GB for 1.5M tokens); memory: one chunk of sequences at a time
(the OS pages the memmap). Interrupted runs resume at the first chunk not done.

Who computes them is a `FeatureSource`: the MLX target itself, one sequence at
a time (`MLXFeatures`, float32: what the drafter sees at inference), or the
same weights on torch in batches under bfloat16 (`torch_backend`'s
`TorchTarget.features`): on a CPU with AMX that is the difference between
hours and minutes for a million tokens, at the cost of bfloat16 rounding in the
training inputs only.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Protocol

import mlx.core as mx
import numpy as np

from ..target import Target


def target_features(target: Target, ids: list[int]) -> mx.array:
    cache = target.make_cache(reserve=1)
    _, feats = target.forward(mx.array(ids, dtype=mx.uint32), cache, capture=True)
    return feats.astype(mx.float16)


class FeatureSource(Protocol):
    name: str  # recorded with the features: a store computed by another source is recomputed
    chunk: int  # sequences per call

    def __call__(self, sequences: list[list[int]]) -> list[np.ndarray]:
        """[L_i, k*H] float16 features of each whole sequence (the layers given to `capture`)."""

    def capture(self, layer_ids: tuple[int, ...]) -> None: ...


class MLXFeatures:
    name, chunk = "mlx float32", 1

    def __init__(self, target: Target):
        self.target = target

    def capture(self, layer_ids) -> None:
        self.target.capture(tuple(layer_ids))

    def __call__(self, sequences):
        return [np.asarray(target_features(self.target, s)) for s in sequences]


class TorchFeatures:
    """The bundle's target on torch (CPU, bfloat16), several sequences per forward, sorted by length."""

    chunk = 64

    def __init__(self, target_path: Path, batch_tokens: int = 8192, dtype: str = "bfloat16"):
        import torch

        from ..torch_backend.loading import load_torch

        self.name = f"torch {dtype}"
        self.target = load_torch(
            target=target_path, use_drafter=False, device="cpu", dtype=getattr(torch, dtype)
        ).target
        self.batch_tokens = batch_tokens

    def capture(self, layer_ids) -> None:
        self.target.capture(tuple(layer_ids))

    def __call__(self, sequences):
        import torch

        out: list = [None] * len(sequences)
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
        start = 0
        while start < len(order):
            end = start + 1
            while end < len(order) and (end - start + 1) * len(sequences[order[end]]) <= self.batch_tokens:
                end += 1
            group = order[start:end]
            for i, f in zip(group, self.target.features([sequences[i] for i in group])):
                out[i] = f.to(dtype=torch.float16).numpy()
            start = end
        return out


def stored_sequences(directory: Path, lengths: list[int], layer_ids: list[int], source_name: str) -> int:
    """How many of these sequences' features `directory` already holds (0 when it holds other sequences, other
    layers, or another source's)."""
    meta_path, data_path = Path(directory) / "features.json", Path(directory) / "features.f16"
    if not meta_path.is_file() or not data_path.is_file():
        return 0
    meta = json.loads(meta_path.read_text())
    same = (
        meta.get("layer_ids") == list(layer_ids)
        and meta.get("lengths") == list(lengths)
        and meta.get("source", MLXFeatures.name) == source_name
    )
    return int(meta["done"]) if same else 0


class FeatureStore:
    def __init__(
        self,
        directory: Path,
        target: Target,
        sequences: list[list[int]],
        layer_ids: list[int],
        source: FeatureSource | None = None,
    ):
        self.directory = Path(directory)
        self.target = target
        self.source = source or MLXFeatures(target)
        self.sequences = sequences
        self.layer_ids = list(layer_ids)
        self.lengths = [len(s) for s in sequences]
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
        self.width = len(self.layer_ids) * target.hidden_size
        self.meta_path = self.directory / "features.json"
        self.data_path = self.directory / "features.f16"
        self.done = stored_sequences(self.directory, self.lengths, self.layer_ids, self.source.name)
        shape = (max(int(self.offsets[-1]), 1), self.width)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.data = np.memmap(
            self.data_path, dtype=np.float16, mode="r+" if self.data_path.exists() and self.done else "w+", shape=shape
        )

    def _save_meta(self) -> None:
        self.data.flush()
        tmp = self.meta_path.with_suffix(".partial")
        tmp.write_text(
            json.dumps(
                {"layer_ids": self.layer_ids, "lengths": self.lengths, "done": self.done, "source": self.source.name}
            )
        )
        tmp.rename(self.meta_path)

    def ensure(self, log=sys.stderr, every_s: float = 30.0) -> None:
        """Compute the features of every sequence not done yet (resumable)."""
        if self.done >= len(self.sequences):
            return
        self.source.capture(tuple(self.layer_ids))
        tic = last = time.perf_counter()
        start, tokens = self.done, 0
        while self.done < len(self.sequences):
            i, j = self.done, min(self.done + self.source.chunk, len(self.sequences))
            for k, feats in zip(range(i, j), self.source(self.sequences[i:j])):
                self.data[self.offsets[k] : self.offsets[k + 1]] = feats
            tokens += int(self.offsets[j] - self.offsets[i])
            self.done = j
            if time.perf_counter() - last > every_s or self.done == len(self.sequences):
                self._save_meta()
                last = time.perf_counter()
                rate = tokens / (last - tic)
                print(
                    f"[features] {self.done}/{len(self.sequences)} sequences ({rate:.0f} tokens/s)",
                    file=log,
                    flush=True,
                )
        if start == self.done:
            self._save_meta()

    def get(self, i: int) -> np.ndarray:
        if i >= self.done:
            raise IndexError(f"features of sequence {i} are not computed yet")
        return self.data[self.offsets[i] : self.offsets[i + 1]]
