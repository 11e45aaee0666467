"""Verify cost: seconds of one target call of each width, per context-length band, on the running device.

Measured when a pair first decodes with `--block-size auto` (`measure_verify_cost`: a few widths, after a short
context, a few seconds), cached on disk per bundle, device, dtype, chip and array-library version
(`calibration_key`, `cached_verify_cost`), and refined online from every plain round's own timing
(`VerifyCost.observe`). The width policy (`block_policy.py`) weighs shapes by it; a round verifies only the
widths it measured (`VerifyCost.widths`).
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from .cpu import chip_name

BANDS = (0, 512, 2048, 8192)  # context-length bands (lower bounds)
# Measured before the first answer, and the only widths a round verifies (`VerifyCost.widths`).
MEASURED_WIDTHS = (1, 2, 3, 4, 8, 16, 24, 32)


def band_of(context: int) -> int:
    return max(i for i, lo in enumerate(BANDS) if context >= lo)


@dataclass
class VerifyCost:
    """seconds[band][w - 1]: one target call of width w at a context in that band; None where never measured."""

    max_width: int
    seconds: list[list[float | None]] = field(default_factory=list)
    alpha: float = 0.1  # weight of a new online observation, once a cell has several
    counts: list[list[int]] = field(default_factory=list)  # online observations per cell

    def __post_init__(self):
        if not self.seconds:
            self.seconds = [[None] * self.max_width for _ in BANDS]
        if not self.counts:
            self.counts = [[0] * self.max_width for _ in BANDS]

    def widths(self) -> list[int]:
        """The widths a round may verify: those measured in some band (every width while none is). The cost of a
        width between two measured ones need not lie between theirs: where a matrix kernel tiles rows by 4 or
        8, a width just past a tile costs more than the next full tile (docs/design.md), and a round that
        wants such a width verifies the next measured one instead, with more drafts for the same or less time."""
        measured = [w for w in range(1, self.max_width + 1) if any(row[w - 1] is not None for row in self.seconds)]
        return measured or list(range(1, self.max_width + 1))

    def estimate(self, width: int, context: int) -> float:
        """The least time measured at this width or any wider one: a verify cannot get dearer with fewer
        tokens, and other load only ever adds time, so spikes (here or at a narrower width) drop out and
        the estimate never decreases with width."""
        return min(self._raw(w, context) for w in range(width, self.max_width + 1))

    def estimates(self, context: int) -> list[float]:
        """`estimate(w, context)` for w = 1..max_width, in one pass."""
        out = [self._raw(w, context) for w in range(1, self.max_width + 1)]
        for i in range(len(out) - 2, -1, -1):
            out[i] = min(out[i], out[i + 1])
        return out

    def _raw(self, width: int, context: int) -> float:
        """The measured cost; else interpolated between the nearest measured widths of its band (extended
        along the widest two beyond them); else the nearest measured band's, scaled by the width-1 figures."""
        b = band_of(context)
        row = self.seconds[b]
        own = row[width - 1]
        if own is not None:
            return own
        known = [w for w in range(1, self.max_width + 1) if row[w - 1] is not None]
        below, above = [w for w in known if w < width], [w for w in known if w > width]
        if below and above:
            lo, hi = below[-1], above[0]
            return row[lo - 1] + (row[hi - 1] - row[lo - 1]) * (width - lo) / (hi - lo)
        if len(below) >= 2:
            lo, hi = below[-2], below[-1]
            slope = max((row[hi - 1] - row[lo - 1]) / (hi - lo), 0.0)
            return row[hi - 1] + slope * (width - hi)
        for other in sorted(range(len(BANDS)), key=lambda o: abs(o - b)):
            ref = self.seconds[other]
            if ref[width - 1] is not None and ref[0]:
                scale = (self.seconds[b][0] / ref[0]) if self.seconds[b][0] else 1.0
                return ref[width - 1] * scale
        return float(width)  # nothing measured: proportional to width (never chosen blindly, see WidthPolicy)

    def observe(self, width: int, context: int, seconds: float) -> None:
        row, counts = self.seconds[band_of(context)], self.counts[band_of(context)]
        old = row[width - 1]
        counts[width - 1] += 1
        weight = max(self.alpha, 1.0 / (counts[width - 1] + 1))  # the first live timings weigh as much as the table
        row[width - 1] = seconds if old is None else (1 - weight) * old + weight * seconds
        for w in range(width - 1):  # a narrower verify costs no more than this one did
            if row[w] is not None and row[w] > row[width - 1]:
                row[w] = row[width - 1]

    def to_dict(self) -> dict:
        return {"max_width": self.max_width, "bands": list(BANDS), "seconds": self.seconds}

    @classmethod
    def from_dict(cls, raw: dict) -> "VerifyCost":
        if raw.get("bands") != list(BANDS) or len(raw["seconds"]) != len(BANDS):
            raise ValueError("cost table from another band layout")
        return cls(int(raw["max_width"]), [list(r) for r in raw["seconds"]])


def measure_verify_cost(
    target, max_width: int, vocab_size: int, contexts=(32,), repeats: int = 1, widths=MEASURED_WIDTHS
) -> VerifyCost:
    """Time target calls of `widths` (up to max_width, which is always measured) after `contexts` tokens, on a
    cache of its own (nothing else moves). A short prompt's band only: a first answer waits for this, and
    the other bands are scaled from it until plain rounds there measure them (`VerifyCost.observe`)."""
    cost = VerifyCost(max_width)
    chosen = sorted({w for w in widths if w < max_width} | {max_width})
    for context in contexts:
        cache = target.make_cache(reserve=max_width)
        ids = [(7 + 31 * i) % vocab_size for i in range(context + max_width)]
        hidden, _ = target.forward(target.tokens(ids[:context]), cache, False)
        target.sync(hidden, cache=cache)
        for width in chosen:
            best = float("inf")
            for _ in range(repeats + 1):  # the first run warms up this shape
                tic = time.perf_counter()
                hidden, _ = target.forward(target.tokens(ids[context : context + width]), cache, False)
                choice = target.sampling.argmax(target.head(hidden))
                target.sync(choice, cache=cache)
                choice.tolist()
                best = min(best, time.perf_counter() - tic)
                target.trim(cache, width)
            cost.seconds[band_of(context)][width - 1] = best
    return cost


def library_version(target) -> str:
    """The array library the target computes with, and its version ("mlx 0.32.4", "torch 2.13.0"): kernels
    change between releases, and so do verify costs."""
    name = "torch" if type(target).__module__.startswith("mlx_glimmer.torch_backend") else "mlx"
    try:
        return f"{name} {version(name)}"
    except PackageNotFoundError:
        return name


def calibration_key(target, *parts) -> str:
    """The cache key of a verify-cost table: `parts` (bundle, device, dtype...), the chip and the library."""
    return "|".join(map(str, (*parts, platform.machine(), chip_name(), library_version(target))))


def cached_verify_cost(
    target, max_width: int, vocab_size: int, key: str, directory: Path | None, on_measure=None
) -> VerifyCost:
    """`measure_verify_cost`, read from `directory/<hash of key>.json` when a run already measured it;
    `on_measure` (a callable taking one line) hears when it has to be measured, before it is."""
    path = None
    if directory is not None:
        name = f"{key}|{max_width}|{MEASURED_WIDTHS}"  # a table of other widths is measured again
        path = Path(directory) / f"{hashlib.sha256(name.encode()).hexdigest()[:20]}.json"
        if path.is_file():
            try:
                return VerifyCost.from_dict(json.loads(path.read_text()))
            except (ValueError, KeyError, json.JSONDecodeError):
                pass  # stale or damaged: measure again
    if on_measure is not None:
        widths = ", ".join(str(w) for w in MEASURED_WIDTHS if w < max_width)
        on_measure(f"measuring verify cost on this machine (widths {widths}, {max_width}; once per model and chip)")
    cost = measure_verify_cost(target, max_width, vocab_size)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".partial")
            tmp.write_text(json.dumps({**cost.to_dict(), "key": key}))
            tmp.rename(path)
        except OSError:
            pass  # a read-only cache only costs a re-measurement next time
    return cost
