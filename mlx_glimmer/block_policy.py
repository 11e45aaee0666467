"""`--block-size auto`: each round verifies the width that maximises expected committed tokens per second.

Two measurements drive the choice:

- **Verify cost** (`VerifyCost`): seconds of one target forward (+ head and
  acceptance read-back) of width w = 1..W, per context-length band. Measured
  on the running device when a pair first decodes with `auto` (a few seconds),
  cached on disk per bundle, device, dtype, chip and array-library version
  (`calibration_key`), and refined online from every round's own timing
  (exponential average per band and width). The loop times a round as a whole,
  from one host read to the next (`WidthPolicy.observe_round`): the draft and
  the verify run as one queued graph.
- **Acceptance** (`AcceptanceModel`): per-position conditional acceptance
  a_i = P(draft i kept | drafts before it kept), from recent rounds with
  exponential forgetting, so it follows the text and the context as they
  change (greedy and sampling alike: it counts what the loop kept).

Expected tokens committed by a round of width w (w - 1 drafts):
E(w) = 1 + sum_{j<w} prod_{i<=j} a_i. The rule picks argmax_w E(w) / (cost(w) +
draft cost), where width 1 is plain decoding (no drafter call, cost(1) only).
The drafter still proposes at its trained block size when that is how it
works (DFlash proposes a whole block in one pass); only a prefix is verified.

Exploration is cheap and bounded: while width 1 wins, no acceptance is
observed, so every `probe_interval` plain rounds the policy verifies one small
probe (width `probe_width`, never the full block); a probe that does not pay
doubles the interval (up to `max_interval`), one that pays resets it. So the
fallback to plain happens by itself when drafting stops paying, and drafting
comes back when it pays again.

Every choice depends only on past rounds, so rejection sampling stays exact
and greedy output stays identical to plain decoding.
"""

from __future__ import annotations

import functools
import hashlib
import json
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

BANDS = (0, 512, 2048, 8192)  # context-length bands (lower bounds)


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
        """The measured cost, or the nearest measured band's scaled by this band's width-1 figure."""
        b = band_of(context)
        own = self.seconds[b][width - 1]
        if own is not None:
            return own
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


def measure_verify_cost(target, max_width: int, vocab_size: int, contexts=(32, 1024), repeats: int = 2) -> VerifyCost:
    """Time target calls of width 1..max_width after `contexts` tokens, on a cache of its own (nothing else moves)."""
    cost = VerifyCost(max_width)
    for context in contexts:
        cache = target.make_cache(reserve=max_width)
        ids = [(7 + 31 * i) % vocab_size for i in range(context + max_width)]
        hidden, _ = target.forward(target.tokens(ids[:context]), cache, False)
        target.sync(hidden, cache=cache)
        for width in range(1, max_width + 1):
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


@functools.lru_cache(maxsize=None)
def chip_name() -> str:
    """The processor by name ("Apple M4 Max", "AMD EPYC 7B13"): verify costs measured on one chip do not
    carry over to another of the same architecture."""
    if sys.platform == "darwin":
        try:
            out = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=5
            ).stdout.strip()
            if out:
                return out
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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


def cached_verify_cost(target, max_width: int, vocab_size: int, key: str, directory: Path | None) -> VerifyCost:
    """`measure_verify_cost`, read from `directory/<hash of key>.json` when a run already measured it."""
    path = None
    if directory is not None:
        path = Path(directory) / f"{hashlib.sha256(f'{key}|{max_width}'.encode()).hexdigest()[:20]}.json"
        if path.is_file():
            try:
                return VerifyCost.from_dict(json.loads(path.read_text()))
            except (ValueError, KeyError, json.JSONDecodeError):
                pass  # stale or damaged: measure again
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


@dataclass
class AcceptanceModel:
    """Per-position conditional acceptance with exponential forgetting and a chained prior (see `rates`)."""

    size: int  # drafts per round at most
    decay: float = 0.95
    prior_weight: float = 2.0
    kept: list[float] = field(default_factory=list)
    offered: list[float] = field(default_factory=list)

    def __post_init__(self):
        self.kept = self.kept or [0.0] * self.size
        self.offered = self.offered or [0.0] * self.size

    def observe(self, drafted: int, accepted: int) -> None:
        """A round offered `drafted` drafts and kept the first `accepted`."""
        self.kept = [k * self.decay for k in self.kept]
        self.offered = [o * self.decay for o in self.offered]
        for i in range(min(accepted + 1, drafted)):  # positions 0..accepted were judged; later ones were not
            self.offered[i] += 1.0
            if i < accepted:
                self.kept[i] += 1.0

    def rates(self) -> list[float]:
        """Position 0 shrinks toward 1/2; every later position toward the rate of the one before it, so a
        drafter that keeps everything it offered is expected to keep going (and wider widths get tried)."""
        out, prior = [], 0.5
        for k, o in zip(self.kept, self.offered):
            prior = (k + self.prior_weight * prior) / (o + self.prior_weight)
            out.append(prior)
        return out

    def expected_tokens(self, width: int) -> float:
        return self.expected_all(width)[-1]

    def expected_all(self, width: int) -> list[float]:
        """`expected_tokens(w)` for w = 1..width, in one pass."""
        out, total, survive = [1.0], 1.0, 1.0
        for a in self.rates()[: width - 1]:
            survive *= a
            total += survive
            out.append(total)
        return out + [total] * (width - len(out))


@dataclass
class WidthPolicy:
    cost: VerifyCost
    acceptance: AcceptanceModel
    draft_seconds: float | None = None  # the drafter's propose time, averaged
    probe_width: int = 4
    probe_interval: int = 8
    max_interval: int = 256
    _interval: int = 0
    _plain_rounds: int = 0
    _draft_rounds: int = 0
    _probing: bool = False
    _draft_samples: int = 0  # drafting rounds whose time fed `draft_seconds` (observe_round)

    @property
    def max_width(self) -> int:
        return self.cost.max_width

    def rate(self, width: int, context: int) -> float:
        """Expected committed tokens per second at this width."""
        seconds = self.cost.estimate(width, context) + (self.draft_seconds or 0.0 if width > 1 else 0.0)
        return self.acceptance.expected_tokens(width) / max(seconds, 1e-9)

    def choose(self, context: int) -> int:
        self._interval = self._interval or self.probe_interval
        expected, costs = self.acceptance.expected_all(self.max_width), self.cost.estimates(context)
        draft = self.draft_seconds or 0.0
        best = max(
            range(1, self.max_width + 1),
            key=lambda w: expected[w - 1] / max(costs[w - 1] + (draft if w > 1 else 0.0), 1e-9),
        )
        self._probing = False
        if best > 1:
            self._plain_rounds = 0
            self._draft_rounds += 1
            # Now and then one width wider than the best, to keep its verify cost measured here and now.
            if best < self.max_width and self._draft_rounds % self.probe_interval == 0:
                return best + 1
            return best
        self._plain_rounds += 1
        if self._plain_rounds >= self._interval:
            self._plain_rounds = 0
            self._probing = True
            return min(self.probe_width, self.max_width)
        return 1

    def observe_round(self, width: int, accepted: int, context: int, seconds: float, timed: bool = True) -> None:
        """One round timed as a whole, as the loop times it: `seconds` from the host read before it to its
        own (draft and verify run as one queued graph, so they cannot be timed apart without a second
        sync). A width-1 round refines the verify cost; a drafting round's time beyond the verify estimate
        is its drafting cost (`draft_seconds`: the first such rounds averaged, then an exponential
        average). Load only ever adds time, so a round cheaper than the estimate pulls it down at least
        halfway: one slow first round (cold caches, other load) cannot keep drafting switched off.
        `timed` False: the time is not representative (the draft projected a long backlog of context,
        such as a prompt's): only the acceptance counts, so no estimate is seeded from it."""
        if width > 1:
            self.acceptance.observe(width - 1, accepted)
        if timed:
            if width == 1:
                self.cost.observe(1, context, seconds)
            else:
                residual = max(seconds - self.cost.estimate(width, context), 0.0)
                self._draft_samples += 1
                weight = 1.0 / self._draft_samples
                if self.draft_seconds is None:
                    self.draft_seconds = residual
                else:
                    weight = max(weight, 0.5 if residual < self.draft_seconds else 0.1)
                    self.draft_seconds = (1 - weight) * self.draft_seconds + weight * residual
        self._judge_probe(width, context)

    def _judge_probe(self, width: int, context: int) -> None:
        """After a probe (always wider than 1): did it pay? Then probe at the base interval, else back off."""
        if self._probing and width > 1:
            self._probing = False
            paid = self.rate(width, context) > self.rate(1, context)
            self._interval = self.probe_interval if paid else min(2 * self._interval, self.max_interval)


def width_policy(max_width: int, cost: VerifyCost, previous: WidthPolicy | None = None) -> WidthPolicy:
    """A policy for one generation; acceptance and drafter cost carry over from the pair's previous one."""
    if previous is not None and previous.max_width == max_width:
        return WidthPolicy(
            cost,
            previous.acceptance,
            previous.draft_seconds,
            _interval=previous._interval,
            _draft_samples=previous._draft_samples,
        )
    return WidthPolicy(cost, AcceptanceModel(max_width - 1))


def describe(widths: list[int]) -> dict[str, Any]:
    """Histogram of verify widths, as `--json` and `bench` print it."""
    hist: dict[int, int] = {}
    for w in widths:
        hist[w] = hist.get(w, 0) + 1
    return {str(w): hist[w] for w in sorted(hist)}
