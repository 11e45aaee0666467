"""Verify cost: seconds of one target call of each width, per context-length band, on the running device.

Measured when a pair first decodes with `--block-size auto` (`measure_verify_cost`: a few widths, after a short
context, a few seconds), cached on disk per bundle, device, dtype, chip and array-library version
(`calibration_key`, `cached_verify_cost`), and refined online by the rounds the loop runs (`VerifyCost.observe`).
Every width from 1 to the widest can be verified: a width not measured is interpolated between measured ones
until rounds of it measure it. The width policy (`block_policy.py`) weighs shapes by it.
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Hashable

from .cpu import chip_name
from .files import write_whole

BANDS = (0, 512, 2048, 8192)  # context-length bands (lower bounds): attention over the context grows with it
# Measured before the first answer; the widths between are interpolated until rounds measure them. Powers of two:
# the widths a kernel's tiling is most likely to favour, and few enough to time in a few seconds.
MEASURED_WIDTHS = (1, 2, 4, 8, 16, 32)
# Weight of a new timing in an average once it has 1 / TIME_WEIGHT samples (before that, all weigh alike): a
# round timed during a burst of other load moves an estimate by a tenth, and ten rounds of a new speed move it
# most of the way.
TIME_WEIGHT = 0.1
# Timed passes over the widths when a table is measured, each width's best kept: two, so a burst of other load
# has to span a whole pass to raise a width's cost.
TIMED_PASSES = 2


def band_of(context: int) -> int:
    return max(i for i, lo in enumerate(BANDS) if context >= lo)


def average(old: float | None, new: float, samples: int) -> float:
    """The running mean of `samples` timings, the last `new`, forgetting at `TIME_WEIGHT` once there are many."""
    if old is None:
        return new
    weight = max(TIME_WEIGHT, 1.0 / samples)
    return (1 - weight) * old + weight * new


@dataclass
class VerifyCost:
    """seconds[band][w - 1]: one target call of width w at a context in that band as measured (None where not);
    learnt[band][w - 1]: the same as the loop's rounds timed it (None where no round ran). A width no round ran
    in a band is predicted from the measured ones (interpolated between widths, borrowed from the nearest band)
    times how far the band's rounds found the measurements off (`drift`): a table timed under other load, or
    after a short context, is off by about one factor at every width."""

    max_width: int
    seconds: list[list[float | None]] = field(default_factory=list)
    learnt: list[list[float | None]] = field(default_factory=list)
    counts: list[list[int]] = field(default_factory=list)  # timings behind each learnt cell
    drift: list[float | None] = field(default_factory=list)  # per band: learnt over measured, averaged
    drift_counts: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.seconds = self.seconds or [[None] * self.max_width for _ in BANDS]
        self.learnt = self.learnt or [[None] * self.max_width for _ in BANDS]
        self.counts = self.counts or [[0] * self.max_width for _ in BANDS]
        self.drift = self.drift or [None] * len(BANDS)
        self.drift_counts = self.drift_counts or [0] * len(BANDS)

    def estimate(self, width: int, context: int) -> float:
        """One verify of `width` tokens after `context`: what its rounds took where some ran; else predicted, and
        no more than a wider verify's estimate (it could pad to the wider one, so a spike in one measurement
        drops out). A plain step (width 1) is its own: its rounds carry the sampling a bare forward lacks."""
        return self.estimates(context)[width - 1]

    def estimates(self, context: int) -> list[float]:
        """`estimate(w, context)` for w = 1..max_width, in one pass."""
        out, learnt = [self._raw(w, context) for w in range(1, self.max_width + 1)], self.learnt[band_of(context)]
        for i in range(len(out) - 2, 0, -1):
            if learnt[i] is None:
                out[i] = min(out[i], out[i + 1])
        return out

    def _raw(self, width: int, context: int) -> float:
        band = band_of(context)
        learnt = self.learnt[band][width - 1]
        if learnt is not None:
            return learnt
        drift = self.drift[band]
        if drift is None:  # nothing learnt in this band yet: the nearest band's
            drift = next((d for _, d in sorted((abs(b - band), d) for b, d in enumerate(self.drift) if d)), 1.0)
        return self.measured(width, band) * drift

    def measured(self, width: int, band: int) -> float:
        """The measured cost: in its band, interpolated between the nearest measured widths (extended along the
        widest two beyond them); else the nearest measured band's; proportional to width where nothing is."""
        for b in sorted(range(len(BANDS)), key=lambda o: abs(o - band)):
            row = self.seconds[b]
            known = [w for w in range(1, self.max_width + 1) if row[w - 1] is not None]
            if width in known:
                return row[width - 1]
            below, above = [w for w in known if w < width], [w for w in known if w > width]
            if below and above:
                lo, hi = below[-1], above[0]
                return row[lo - 1] + (row[hi - 1] - row[lo - 1]) * (width - lo) / (hi - lo)
            if len(below) >= 2:
                lo, hi = below[-2], below[-1]
                return row[hi - 1] + max((row[hi - 1] - row[lo - 1]) / (hi - lo), 0.0) * (width - hi)
        return float(width)

    def evidence(self, width: int, context: int) -> int:
        """Timings behind this width's estimate in this band: its measurement and its rounds."""
        band = band_of(context)
        return int(self.seconds[band][width - 1] is not None) + self.counts[band][width - 1]

    def observe(self, width: int, context: int, seconds: float) -> None:
        """A round verified `width` tokens after `context` in `seconds` (its drafting left out). Rounds of a
        measured width above 1 also tell how far the band's measurements are off; plain rounds do not: they
        are queued one ahead and read in pairs (one at once, the next carrying both)."""
        band = band_of(context)
        if width > 1 and any(row[width - 1] is not None for row in self.seconds):  # a measured width
            self.drift_counts[band] += 1
            ratio = seconds / max(self.measured(width, band), 1e-9)
            self.drift[band] = average(self.drift[band], ratio, self.drift_counts[band])
        self.counts[band][width - 1] += 1
        self.learnt[band][width - 1] = average(self.learnt[band][width - 1], seconds, self.counts[band][width - 1])

    def to_dict(self) -> dict:
        return {"max_width": self.max_width, "bands": list(BANDS), "seconds": self.seconds, "learnt": self.learnt}

    @classmethod
    def from_dict(cls, raw: dict) -> "VerifyCost":
        if raw.get("bands") != list(BANDS) or len(raw["seconds"]) != len(BANDS):
            raise ValueError("cost table from another band layout")
        return cls(int(raw["max_width"]), [list(r) for r in raw["seconds"]])


def measure_verify_cost(
    target, max_width: int, vocab_size: int, contexts=(32,), repeats: int = TIMED_PASSES, widths=MEASURED_WIDTHS
) -> VerifyCost:
    """Time target calls of `widths` (up to max_width, which is always measured) after `contexts` tokens, on a
    cache of its own (nothing else moves): one pass over the widths to warm their shapes up, then `repeats`
    passes, each width's best kept. Passes, not a width's runs back to back: a burst of other load then has to
    last a whole pass to raise a width's cost, where back to back it could price the widest widths out of a
    table that is cached on disk. A short prompt's band only: a first answer waits for this, and the other
    bands are scaled from it until plain rounds there measure them (`VerifyCost.observe`)."""
    cost = VerifyCost(max_width)
    chosen = sorted({w for w in widths if w < max_width} | {max_width})
    for context in contexts:
        cache = target.make_cache(reserve=max_width)
        ids = [(7 + 31 * i) % vocab_size for i in range(context + max_width)]
        hidden, _ = target.forward(target.tokens(ids[:context]), cache, False)
        target.sync(hidden, cache=cache)
        best = dict.fromkeys(chosen, float("inf"))
        for timed in [False] + [True] * repeats:
            for width in chosen:
                tic = time.perf_counter()
                hidden, _ = target.forward(target.tokens(ids[context : context + width]), cache, False)
                choice = target.sampling.argmax(target.head(hidden))
                target.sync(choice, cache=cache)
                choice.tolist()
                if timed:
                    best[width] = min(best[width], time.perf_counter() - tic)
                target.trim(cache, width)
        for width, seconds in best.items():
            cost.seconds[band_of(context)][width - 1] = seconds
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
        name = f"{key}|{max_width}|{MEASURED_WIDTHS}|{TIMED_PASSES}"  # a table measured otherwise is measured again
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
            write_whole(path, json.dumps({**cost.to_dict(), "key": key}))
        except OSError:
            pass  # a read-only cache only costs a re-measurement next time
    return cost


@dataclass
class RoundTimes:
    """A round's seconds, from one host read to the next, split into its verify (`cost`, by width) and its
    proposer's drafting (`draft`, per proposer and context band: the rest), both learnt from the rounds."""

    cost: VerifyCost
    draft: dict[tuple, float] = field(default_factory=dict)  # (proposer, band) -> seconds
    samples: dict[tuple, int] = field(default_factory=dict)  # timings behind each `draft` entry
    warm: set = field(default_factory=set)  # (shape, band) pairs whose first round (building kernels) has run

    def drafting(self, proposer: Hashable, context: int) -> float:
        """Its drafting seconds in the context's band, else the nearest band's; none before any (a first try is
        optimistic)."""
        band = band_of(context)
        timed = sorted((abs(b - band), s) for (p, b), s in self.draft.items() if p == proposer)
        return timed[0][1] if timed else 0.0

    def observe(self, shape: Hashable, proposer: Hashable | None, width: int, context: int, seconds: float | None):
        """A round of `shape`, `width` tokens drafted by `proposer` (None: a plain step), took `seconds` (None:
        not representative, as after a long drafting backlog; it still counts as the shape's first)."""
        band = band_of(context)
        if seconds is None or (shape, band) not in self.warm:  # a shape's first round in a band builds its kernels
            self.warm.add((shape, band))
            return
        if proposer is None:
            return self.cost.observe(width, context, seconds)
        # The time beyond the estimate is split between the verify and the drafting, the one with less evidence
        # taking more: a width never run gets it where the proposer's drafting is known, and the other way round.
        key = (proposer, band)
        drafted, measured = self.samples.get(key, 0), self.cost.evidence(width, context)
        verify, drafting = self.cost.estimate(width, context), self.draft.get(key, 0.0)
        error, share = seconds - verify - drafting, drafted / (drafted + measured) if drafted else 0.0
        self.cost.observe(width, context, max(verify + share * error, 0.0))
        self.samples[key] = drafted + 1
        self.draft[key] = average(self.draft.get(key), max(drafting + (1 - share) * error, 0.0), drafted + 1)

    def carried(self, cost: VerifyCost) -> RoundTimes:
        """For the next generation, on `cost`: the same drafting seconds and warm shapes."""
        return RoundTimes(cost, dict(self.draft), dict(self.samples), set(self.warm))
