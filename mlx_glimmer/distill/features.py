"""The frozen target's features for every training sequence, computed once and kept on disk.

Training reads the outputs of the target's `target_layer_ids` decoder layers at
every position of every sequence, every epoch. Computing them costs a target
forward per sequence (more than a training step at this size), so they are
computed once, in order, and stored as one float16 memmap:

    DIR/features.f16     rows of k*H float16 values, sequence after sequence
    DIR/features.json    layer ids, sequence lengths, how many sequences are done

Disk bound: tokens x k x H x 2 bytes (SmolLM2 with 5 context layers: 5.8 KB
per token, 8.6 GB for 1.5M tokens); memory: one sequence at a time (the OS
pages the memmap). Interrupted runs resume at the first sequence not done.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..target import Target


def target_features(target: Target, ids: list[int]) -> mx.array:
    cache = target.make_cache(reserve=1)
    _, feats = target.forward(mx.array(ids, dtype=mx.uint32), cache, capture=True)
    return feats.astype(mx.float16)


class FeatureStore:
    def __init__(self, directory: Path, target: Target, sequences: list[list[int]], layer_ids: list[int]):
        self.directory = Path(directory)
        self.target = target
        self.sequences = sequences
        self.layer_ids = list(layer_ids)
        self.lengths = [len(s) for s in sequences]
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
        self.width = len(self.layer_ids) * target.hidden_size
        self.meta_path = self.directory / "features.json"
        self.data_path = self.directory / "features.f16"
        self.done = self._resume_point()
        shape = (max(int(self.offsets[-1]), 1), self.width)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.data = np.memmap(self.data_path, dtype=np.float16, mode="r+" if self.data_path.exists() and self.done else "w+", shape=shape)

    def _resume_point(self) -> int:
        if not self.meta_path.is_file() or not self.data_path.is_file():
            return 0
        meta = json.loads(self.meta_path.read_text())
        same = meta.get("layer_ids") == self.layer_ids and meta.get("lengths") == self.lengths
        return int(meta["done"]) if same else 0

    def _save_meta(self) -> None:
        self.data.flush()
        tmp = self.meta_path.with_suffix(".partial")
        tmp.write_text(json.dumps({"layer_ids": self.layer_ids, "lengths": self.lengths, "done": self.done}))
        tmp.rename(self.meta_path)

    def ensure(self, log=sys.stderr, every_s: float = 30.0) -> None:
        """Compute the features of every sequence not done yet (resumable)."""
        if self.done >= len(self.sequences):
            return
        self.target.capture(tuple(self.layer_ids))
        tic = last = time.perf_counter()
        start, tokens = self.done, 0
        for i in range(self.done, len(self.sequences)):
            feats = target_features(self.target, self.sequences[i])
            self.data[self.offsets[i] : self.offsets[i + 1]] = np.asarray(feats)
            tokens += self.lengths[i]
            self.done = i + 1
            if time.perf_counter() - last > every_s or self.done == len(self.sequences):
                self._save_meta()
                last = time.perf_counter()
                rate = tokens / (last - tic)
                print(f"[features] {self.done}/{len(self.sequences)} sequences ({rate:.0f} tokens/s)", file=log, flush=True)
        if start == self.done:
            self._save_meta()

    def get(self, i: int) -> np.ndarray:
        if i >= self.done:
            raise IndexError(f"features of sequence {i} are not computed yet")
        return self.data[self.offsets[i] : self.offsets[i + 1]]
