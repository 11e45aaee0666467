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
(the OS pages the memmap). Interrupted runs resume at the first chunk not done. A
run whose answers grew (new records are appended, so the old sequences are a
prefix of the new list) keeps the features it has: the files are extended and
only the new sequences are computed.

Who computes them is a `FeatureSource`: the MLX target (`MLXFeatures`, float32, what the drafter
sees at inference) or the same weights on torch (`TorchFeatures`, float32 or bfloat16), each several
right-padded sequences per forward (under causal attention a real position never sees the padding after
it). `pick_feature_source` measures the candidates this machine offers on the run's own sequences and keeps
the fastest; bfloat16 is a candidate only on a CPU that multiplies it in hardware (`cpu.native_bfloat16`).
A store keeps the source it was computed with, and a resumed run continues with it.
"""

from __future__ import annotations

import importlib.util
import json
import mmap
import sys
import time
from pathlib import Path
from typing import Protocol

import mlx.core as mx
import numpy as np

from ..batching import BATCH_TOKENS, length_groups
from ..cpu import native_bfloat16
from ..errors import GlimmerError
from ..files import write_whole
from ..target import Target


def target_features(target: Target, ids: list[int]) -> mx.array:
    return target_features_and_hidden(target, ids)[0]


def target_features_and_hidden(target: Target, ids: list[int]) -> tuple[mx.array, mx.array]:
    """The captured layers' outputs [L, k*H] and the final hidden states [L, H] of one sequence, float16."""
    cache = target.make_cache(reserve=1)
    hidden, feats = target.forward(mx.array(ids, dtype=mx.uint32), cache, capture=True)
    return feats.astype(mx.float16), hidden.astype(mx.float16)


class FeatureSource(Protocol):
    name: str  # recorded with the features: a store computed by another source does not serve this one
    spec: str  # how --feature-source names it
    chunk: int  # sequences per call
    batch_tokens: int  # padded positions per batched forward

    def __call__(self, sequences: list[list[int]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """For each whole sequence: its [L_i, k*H] float16 features (the layers given to `capture`) and its
        [L_i, H] float16 final hidden states."""

    def capture(self, layer_ids: tuple[int, ...], final_hidden: bool = True) -> None:
        """Compute these layers' outputs from now on, and the final hidden states only with `final_hidden` (else
        each pair's second is None and the layers after the deepest of `layer_ids` need not run)."""


class Features(Protocol):
    """Where the trainer reads the features of its sequences: a `FeatureStore` or `OnlineFeatures`."""

    width: int  # k*H: the captured layers' outputs side by side
    lengths: list[int]  # of every sequence

    def ensure(self, log=sys.stderr) -> None:
        """Compute ahead whatever is computed ahead (a store: every sequence not done yet)."""

    def rows(self, indices: list[int]) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """The features [L_i, k*H] and final hidden states [L_i, H] (None without `teacher`) of these sequences."""

    def prefetch(self, indices: list[int]) -> None:
        """These sequences' `rows` come next: start whatever can start now, and return at once."""


# Sequences per chunk: each chunk is sorted by length before it is cut into batches, so a larger chunk pads less
# (on the demo answers: 23% padded positions at 64, 9% at 256); and the store saves after each one.
CHUNK = 256


class MLXFeatures:
    """The MLX target itself, float32 (what the drafter reads at inference), several sequences per forward."""

    name, spec = "mlx float32", "mlx:float32"

    def __init__(self, target: Target, batch_tokens: int = BATCH_TOKENS, chunk: int = CHUNK):
        self.target = target
        self.batch_tokens, self.chunk = batch_tokens, chunk
        self.final_hidden = True

    def capture(self, layer_ids, final_hidden: bool = True) -> None:
        self.target.capture(tuple(layer_ids))
        self.final_hidden = final_hidden

    def __call__(self, sequences):
        out: list = [None] * len(sequences)
        for group in length_groups([len(s) for s in sequences], self.batch_tokens):
            width = max(len(sequences[i]) for i in group)
            ids = mx.array([sequences[i] + [0] * (width - len(sequences[i])) for i in group], dtype=mx.uint32)
            hidden, feats = self.target.forward_batch(ids)
            # evaluated alone, the features leave the layers after the deepest captured one unrun
            feats = np.asarray(feats.astype(mx.float16))
            hidden = np.asarray(hidden.astype(mx.float16)) if self.final_hidden else None
            for row, i in enumerate(group):
                n = len(sequences[i])
                out[i] = (feats[row, :n], None if hidden is None else hidden[row, :n])
        return out


class TorchFeatures:
    """The bundle's target on torch (CPU), float32 or bfloat16, several sequences per forward."""

    def __init__(
        self, target_path: Path, batch_tokens: int = BATCH_TOKENS, dtype: str = "bfloat16", chunk: int = CHUNK
    ):
        import torch

        from ..torch_backend.loading import load_torch

        self.name, self.spec = f"torch {dtype}", f"torch:{dtype}"
        self.target = load_torch(
            target=target_path, use_drafter=False, device="cpu", dtype=getattr(torch, dtype)
        ).target
        self.batch_tokens, self.chunk = batch_tokens, chunk
        self.final_hidden = True

    def capture(self, layer_ids, final_hidden: bool = True) -> None:
        self.target.capture(tuple(layer_ids))
        self.final_hidden = final_hidden

    def __call__(self, sequences):
        import torch

        out: list = [None] * len(sequences)
        for group in length_groups([len(s) for s in sequences], self.batch_tokens):
            pairs = self.target.features([sequences[i] for i in group], final_hidden=self.final_hidden)
            for i, (f, h) in zip(group, pairs):
                out[i] = (f.to(dtype=torch.float16).numpy(), None if h is None else h.to(dtype=torch.float16).numpy())
        return out


SOURCES = ("mlx:float32", "torch:float32", "torch:bfloat16")


def candidate_sources() -> list[str]:
    """The sources worth timing here: MLX always; torch when installed, in bfloat16 only where the CPU
    multiplies bfloat16 in hardware (emulated, it runs several times slower than float32)."""
    out = ["mlx:float32"]
    if importlib.util.find_spec("torch") is not None and sys.platform != "darwin":
        out.append("torch:float32")
        if native_bfloat16():
            out.append("torch:bfloat16")
    return out


def make_feature_source(spec: str, target: Target, target_path: Path) -> FeatureSource:
    """A source by its spec (one of `SOURCES`)."""
    if spec == "mlx:float32":
        return MLXFeatures(target)
    if spec in ("torch:float32", "torch:bfloat16"):
        if importlib.util.find_spec("torch") is None:
            raise GlimmerError(f"--feature-source {spec}: torch is not installed (pip install torch)")
        return TorchFeatures(target_path, dtype=spec.split(":")[1])
    raise GlimmerError(f"--feature-source {spec}: expected auto or one of {', '.join(SOURCES)}")


def pick_feature_source(
    target: Target,
    target_path: Path,
    sequences: list[list[int]],
    layer_ids: list[int],
    candidates: list[str] | None = None,
    sample_tokens: int = 2048,
    log=sys.stderr,
) -> FeatureSource:
    """The fastest of `candidates` (default `candidate_sources()`) on this machine, timed on the run's own
    sequences: each computes about `sample_tokens` tokens once to warm up and once timed."""
    candidates = candidates or candidate_sources()
    if len(candidates) == 1:
        return make_feature_source(candidates[0], target, target_path)
    sample, total = [], 0
    for s in sorted(sequences, key=len)[len(sequences) // 2 :]:  # typical lengths, not the shortest
        if total >= sample_tokens:
            break
        sample.append(s)
        total += len(s)
    timed = []
    for spec in candidates:
        source = make_feature_source(spec, target, target_path)
        source.capture(tuple(layer_ids))
        source(sample)
        tic = time.perf_counter()
        source(sample)
        timed.append((total / (time.perf_counter() - tic), spec, source))
    rate, spec, best = max(timed, key=lambda t: t[0])
    rates = ", ".join(f"{s} {r:.0f}" for r, s, _ in timed)
    print(f"[features] timed on {total} tokens (tokens/s): {rates}; computing with {spec}", file=log, flush=True)
    return best


def store_mismatch(
    directory: Path, lengths: list[int], layer_ids: list[int], source_name: str | None = None, teacher: bool = False
) -> str | None:
    """Why the store in `directory` cannot serve these sequences at these layers (computed by `source_name` when
    given; with final hidden states when `teacher`), or None when it can or holds nothing. It serves them when it
    holds all of them, the first of them (the answers grew since), or them and more after them (a run of fewer
    answers reading a grown store, which it reads as it is)."""
    meta_path, data_path = Path(directory) / "features.json", Path(directory) / "features.f16"
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        return "its record features.json is unreadable"
    stored = meta.get("lengths") or []
    common = min(len(stored), len(lengths))
    if not data_path.is_file():
        return "features.f16 is missing"
    if meta.get("layer_ids") != list(layer_ids):
        return f"it holds layers {meta.get('layer_ids')}, this run reads {list(layer_ids)}"
    if stored[:common] != list(lengths[:common]):
        return "it holds the features of other answers"
    computed_with = meta.get("source", MLXFeatures.name)
    if source_name is not None and computed_with != source_name:
        spec, wanted = computed_with.replace(" ", ":"), source_name.replace(" ", ":")
        return f"it was computed with {spec}, this run computes with {wanted}"
    if teacher and not (meta.get("teacher", False) and (Path(directory) / "teacher.f16").is_file()):
        return "it holds no final hidden states, which --soft-labels reads"
    return None


def stored_meta(directory: Path, lengths: list[int], layer_ids: list[int]) -> dict | None:
    """The store's record (features.json) when `directory` holds features of these sequences at these layers
    (see `store_mismatch`), else None."""
    meta_path = Path(directory) / "features.json"
    if not meta_path.is_file() or store_mismatch(directory, lengths, layer_ids) is not None:
        return None
    return json.loads(meta_path.read_text())


def extend_file(path: Path, size: int) -> None:
    """Grow a file to `size` bytes (the new bytes read as zeros until written)."""
    if path.is_file() and path.stat().st_size < size:
        with path.open("r+b") as f:
            f.truncate(size)


def stored_sequences(
    directory: Path, lengths: list[int], layer_ids: list[int], source_name: str, teacher: bool = False
) -> int:
    """How many of these sequences' features `directory` already holds (0 when `store_mismatch` gives a reason)."""
    if store_mismatch(directory, lengths, layer_ids, source_name, teacher) is not None:
        return 0
    return stored_count(directory, len(lengths))


def stored_count(directory: Path, count: int) -> int:
    """How many sequences the record in `directory` says are done, at most `count` (0 without a record); only
    meaningful where `store_mismatch` gives no reason."""
    return min(recorded_done(directory), count)


def recorded_done(directory: Path) -> int:
    """How many sequences the record in `directory` says were computed, whatever they were (0 without a readable
    record): the work a store that cannot serve a run would lose."""
    try:
        return int(json.loads((Path(directory) / "features.json").read_text()).get("done", 0))
    except (OSError, ValueError, AttributeError):
        return 0


def stored_source(directory: Path, lengths: list[int], layer_ids: list[int]) -> str | None:
    """The spec of the source that computed the features `directory` holds for these sequences and layers (None
    when it holds none of them)."""
    meta = stored_meta(directory, lengths, layer_ids)
    if meta is None or not meta.get("done"):
        return None
    return meta.get("source", MLXFeatures.name).replace(" ", ":")


def choose_feature_source(
    spec: str,
    directory: Path,
    target: Target,
    target_path: Path,
    sequences: list[list[int]],
    layer_ids: list[int],
    log=sys.stderr,
) -> FeatureSource:
    """`--feature-source`: a named source, or `auto`: the source the store in `directory` was computed with when
    it holds some of these sequences (a resumed run goes on as it began), else the fastest measured here."""
    if spec != "auto":
        return make_feature_source(spec, target, target_path)
    stored = stored_source(directory, [len(s) for s in sequences], layer_ids)
    if stored in candidate_sources():
        print(f"[features] resuming the store computed with {stored}", file=log, flush=True)
        return make_feature_source(stored, target, target_path)
    return pick_feature_source(target, target_path, sequences, layer_ids, log=log)


def read_map(path: Path) -> mmap.mmap:
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


class FeatureStore:
    def __init__(
        self,
        directory: Path,
        target: Target,
        sequences: list[list[int]],
        layer_ids: list[int],
        source: FeatureSource | None = None,
        teacher: bool = False,
        recompute: bool = False,
        log=sys.stderr,
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
        reason = store_mismatch(self.directory, self.lengths, self.layer_ids, self.source.name, teacher)
        # computed anew for the final hidden states alone, the store keeps serving every run it served
        lost = reason and store_mismatch(self.directory, self.lengths, self.layer_ids, self.source.name)
        if lost and not recompute and recorded_done(self.directory):
            raise GlimmerError(
                f"distill: {self.directory} holds features this run cannot read ({lost}); --recompute-features "
                "replaces them, or give the run another --out"
            )
        if reason is not None:
            print(f"[features] computing {self.directory} anew: {reason}", file=log, flush=True)
        self.done = 0 if reason is not None else stored_count(self.directory, len(self.lengths))
        # a store that already has the final hidden states keeps them, whether or not this run reads them
        self.teacher = teacher or bool(self.done and json.loads(self.meta_path.read_text()).get("teacher", False))
        rows = max(int(self.offsets[-1]), 1)
        self.directory.mkdir(parents=True, exist_ok=True)
        mode = "r+" if self.data_path.exists() and self.done else "w+"
        if mode == "r+":  # the answers may have grown since: room for the new sequences
            extend_file(self.data_path, rows * self.width * 2)
            extend_file(self.directory / "teacher.f16", rows * target.hidden_size * 2)
        self.data = np.memmap(self.data_path, dtype=np.float16, mode=mode, shape=(rows, self.width))
        self.hidden = (
            np.memmap(self.directory / "teacher.f16", dtype=np.float16, mode=mode, shape=(rows, target.hidden_size))
            if self.teacher
            else None
        )
        self._hinted: list[tuple[mmap.mmap, int]] | None = None  # read-only maps for `prefetch`, once trained

    def _save_meta(self) -> None:
        self.data.flush()
        if self.hidden is not None:
            self.hidden.flush()
        meta = {"layer_ids": self.layer_ids, "lengths": self.lengths, "done": self.done, "source": self.source.name}
        write_whole(self.meta_path, json.dumps({**meta, "teacher": self.teacher}))

    def ensure(self, log=sys.stderr) -> None:
        """Compute the features of every sequence not done yet (resumable: saved after every chunk, so a killed
        pass restarts at the first chunk not done). A bar on `log` shows tokens, rate and ETA."""
        if self.done >= len(self.sequences):
            return
        from tqdm import tqdm

        if self.done:
            print(f"[features] resuming at sequence {self.done}/{len(self.sequences)}", file=log, flush=True)
        self.source.capture(tuple(self.layer_ids), final_hidden=self.hidden is not None)
        total = int(self.offsets[-1])
        bar = tqdm(
            total=total,
            initial=int(self.offsets[self.done]),
            unit="tok",
            unit_scale=True,
            desc=f"features ({self.source.name})",
            file=log,
            mininterval=1.0 if log.isatty() else 30.0,
            dynamic_ncols=True,
        )
        try:
            while self.done < len(self.sequences):
                i, j = self.done, min(self.done + self.source.chunk, len(self.sequences))
                for k, (feats, hidden) in zip(range(i, j), self.source(self.sequences[i:j])):
                    self.data[self.offsets[k] : self.offsets[k + 1]] = feats
                    if self.hidden is not None:
                        self.hidden[self.offsets[k] : self.offsets[k + 1]] = hidden
                self.done = j
                self._save_meta()
                bar.update(int(self.offsets[j] - self.offsets[i]))
        finally:
            bar.close()
        rate = bar.format_dict["rate"]
        print(
            f"[features] {self.done}/{len(self.sequences)} sequences, {total} tokens"
            + (f" ({rate:.0f} tokens/s)" if rate else ""),
            file=log,
            flush=True,
        )

    def rows(self, indices: list[int]) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """The features [L_i, k*H] and final hidden states [L_i, H] (None without `teacher`) of these sequences."""
        return [(self.get(i), self.final_hidden(i) if self.hidden is not None else None) for i in indices]

    def prefetch(self, indices: list[int]) -> None:
        """Ask the OS to read these sequences' rows from disk now, and return at once. A store larger than memory
        is read a step's sequences at a time; hinted a step ahead, those reads overlap the step before instead
        of stalling the next one."""
        if not hasattr(mmap, "MADV_WILLNEED"):  # a platform without the hint reads on demand, as before
            return
        if self._hinted is None:
            self._hinted = [(read_map(self.data_path), self.width * 2)]
            if self.hidden is not None:
                self._hinted.append((read_map(self.directory / "teacher.f16"), self.target.hidden_size * 2))
        for view, row_bytes in self._hinted:
            for i in indices:
                if i < self.done:
                    start, end = int(self.offsets[i]) * row_bytes, int(self.offsets[i + 1]) * row_bytes
                    start -= start % mmap.PAGESIZE
                    view.madvise(mmap.MADV_WILLNEED, start, end - start)

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


class OnlineFeatures:
    """The features of each step's sequences computed when the step draws them, in one call of the source, and
    kept nowhere. A store holds 2 bytes x hidden size x context layers per token (prompts included), which for a
    large target or many answers outgrows the disk; this is how the public DFlash recipes train. The price is one
    target forward of the step's sequences every step, where a store pays it once."""

    def __init__(
        self,
        target: Target,
        sequences: list[list[int]],
        layer_ids: list[int],
        source: FeatureSource | None = None,
        teacher: bool = False,
    ):
        self.source = source or MLXFeatures(target)
        self.sequences = sequences
        self.layer_ids = list(layer_ids)
        self.lengths = [len(s) for s in sequences]
        self.width = len(self.layer_ids) * target.hidden_size
        self.teacher = teacher
        self.source.capture(tuple(self.layer_ids), final_hidden=teacher)

    def ensure(self, log=sys.stderr) -> None:
        """Nothing to compute ahead: every step computes its own."""

    def prefetch(self, indices: list[int]) -> None:
        """Nothing to read ahead: a step computes its sequences' features when it draws them."""

    def rows(self, indices: list[int]) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """The features [L_i, k*H] and final hidden states [L_i, H] (None without `teacher`) of these sequences."""
        out = self.source([self.sequences[i] for i in indices])
        return [(feats, hidden if self.teacher else None) for feats, hidden in out]
