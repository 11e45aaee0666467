"""The frozen target's features for every training sequence, computed once and kept on disk.

Training reads the outputs of the target's `target_layer_ids` decoder layers at
every position of every sequence, every epoch. Computing them costs a target
forward per sequence (more than a training step at this size), so they are
computed once, in order, and stored as one float16 memmap:

    DIR/features.f16     rows of k*H float16 values, sequence after sequence
    DIR/features.json    layer ids, sequence lengths, how many sequences are done
    DIR/teacher.f16      with `teacher`: the target's final hidden states (what its output head reads),
                         H float16 values a position, for soft labels

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
    return target_features_and_hidden(target, ids)[0]


def target_features_and_hidden(target: Target, ids: list[int]) -> tuple[mx.array, mx.array]:
    """The captured layers' outputs [L, k*H] and the final hidden states [L, H] of one sequence, float16."""
    cache = target.make_cache(reserve=1)
    hidden, feats = target.forward(mx.array(ids, dtype=mx.uint32), cache, capture=True)
    return feats.astype(mx.float16), hidden.astype(mx.float16)


class FeatureSource(Protocol):
    name: str  # recorded with the features: a store computed by another source is recomputed
    chunk: int  # sequences per call

    def __call__(self, sequences: list[list[int]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """For each whole sequence: its [L_i, k*H] float16 features (the layers given to `capture`) and its
        [L_i, H] float16 final hidden states."""

    def capture(self, layer_ids: tuple[int, ...]) -> None: ...


class MLXFeatures:
    name, chunk = "mlx float32", 1

    def __init__(self, target: Target):
        self.target = target

    def capture(self, layer_ids) -> None:
        self.target.capture(tuple(layer_ids))

    def __call__(self, sequences):
        return [tuple(np.asarray(x) for x in target_features_and_hidden(self.target, s)) for s in sequences]


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
            for i, (f, h) in zip(group, self.target.features([sequences[i] for i in group])):
                out[i] = (f.to(dtype=torch.float16).numpy(), h.to(dtype=torch.float16).numpy())
            start = end
        return out


def stored_sequences(
    directory: Path, lengths: list[int], layer_ids: list[int], source_name: str, teacher: bool = False
) -> int:
    """How many of these sequences' features `directory` already holds (0 when it holds other sequences, other
    layers, or another source's; with `teacher`, also 0 when it holds no final hidden states)."""
    meta_path, data_path = Path(directory) / "features.json", Path(directory) / "features.f16"
    if not meta_path.is_file() or not data_path.is_file():
        return 0
    meta = json.loads(meta_path.read_text())
    same = (
        meta.get("layer_ids") == list(layer_ids)
        and meta.get("lengths") == list(lengths)
        and meta.get("source", MLXFeatures.name) == source_name
        and (not teacher or (meta.get("teacher", False) and (Path(directory) / "teacher.f16").is_file()))
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
        teacher: bool = False,
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
        self.done = stored_sequences(self.directory, self.lengths, self.layer_ids, self.source.name, teacher)
        # a store that already has the final hidden states keeps them, whether or not this run reads them
        self.teacher = teacher or bool(self.done and json.loads(self.meta_path.read_text()).get("teacher", False))
        rows = max(int(self.offsets[-1]), 1)
        self.directory.mkdir(parents=True, exist_ok=True)
        mode = "r+" if self.data_path.exists() and self.done else "w+"
        self.data = np.memmap(self.data_path, dtype=np.float16, mode=mode, shape=(rows, self.width))
        self.hidden = (
            np.memmap(self.directory / "teacher.f16", dtype=np.float16, mode=mode, shape=(rows, target.hidden_size))
            if self.teacher
            else None
        )

    def _save_meta(self) -> None:
        self.data.flush()
        if self.hidden is not None:
            self.hidden.flush()
        meta = {"layer_ids": self.layer_ids, "lengths": self.lengths, "done": self.done, "source": self.source.name}
        tmp = self.meta_path.with_suffix(".partial")
        tmp.write_text(json.dumps({**meta, "teacher": self.teacher}))
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
            for k, (feats, hidden) in zip(range(i, j), self.source(self.sequences[i:j])):
                self.data[self.offsets[k] : self.offsets[k + 1]] = feats
                if self.hidden is not None:
                    self.hidden[self.offsets[k] : self.offsets[k + 1]] = hidden
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

    def final_hidden(self, i: int) -> np.ndarray:
        """Sequence i's final hidden states [L_i, H] (a store made with `teacher`)."""
        if self.hidden is None:
            raise ValueError("this feature store holds no final hidden states (made without teacher)")
        if i >= self.done:
            raise IndexError(f"features of sequence {i} are not computed yet")
        return self.hidden[self.offsets[i] : self.offsets[i + 1]]
