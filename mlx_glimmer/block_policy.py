"""`--block-size auto`: each round verifies the width that maximises expected committed tokens per second.

Two measurements drive the choice:

- **Verify cost** (`verify_cost.VerifyCost`): seconds of one target forward (+ head and
  acceptance read-back) of each measured width, per context-length band, measured on the running device
  and refined online. The loop times a round as a whole, from one host read to the next
  (`WidthPolicy.observe_round`): the draft and the verify run as one queued graph. A shape that has run is
  judged by its own rounds' time (`RoundTimes`); the table predicts the others.
- **Acceptance** (`AcceptanceModel`): per-position conditional acceptance
  a_i = P(draft i kept | drafts before it kept), from recent rounds with
  exponential forgetting, so it follows the text and the context as they
  change (greedy and sampling alike: it counts what the loop kept).

With draft trees on, the same rule also weighs tree budgets (`TreeAcceptance`:
tokens committed per round, per budget) and the n-gram lookup's continuation
verified alone (no drafter call; `LookupAcceptance`: an `AcceptanceModel` per
length of the n-gram it matched).

Expected tokens committed by a chain of width w (w - 1 drafts):
E(w) = 1 + sum_{j<w} prod_{i<=j} a_i. The rule picks argmax_w E(w) / (cost(w) +
draft cost), where width 1 is plain decoding (no drafter call, cost(1) only),
over the widths the cost table measured: a width between two measured ones
can cost more than the wider one (`VerifyCost.widths`).
The drafter still proposes at its trained block size when that is how it
works (DFlash proposes a whole block in one pass); only a prefix is verified.

Exploration is cheap and bounded: while width 1 wins, no acceptance is
observed, so every `probe_interval` plain rounds the policy verifies one small
probe (a chain of `probe_width`, never the full block, or the smallest tree
or the lookup's continuation, whichever it has seen least); a probe that does not pay
doubles the interval (up to `max_interval`), one that pays resets it. So the
fallback to plain happens by itself when drafting stops paying, and drafting
comes back when it pays again.

Every choice depends only on past rounds, so rejection sampling stays exact
and greedy output stays identical to plain decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from .verify_cost import VerifyCost, band_of

TREE_WIDTHS = (4, 8, 16, 32)  # tree budgets (tokens verified) `auto` weighs against the chain widths
# Evidence one generation hands the next, at most, in rounds (each model's prior weighs 2): a new prompt is new
# text, so what the last one kept is only a start, which the new text's first few rounds can outweigh.
CARRIED_ROUNDS = 4.0
# An untried tree budget is expected to keep this much more depth than the chain of its width: the ratio of
# best-first trees to chains at equal width, teacher-forced with the demo drafter (docs/design.md).
TREE_PRIOR_GAIN = 1.3
# A tree budget or lookup chain is probed only while it is expected to commit at least this share of the best
# shape's tokens per second: a probe then gives up at most a quarter of a round's tokens (`WidthPolicy._probe`).
PROBE_FLOOR = 0.75
# A lookup chain verifies at most this many times the tokens the last lookup round committed, and at least
# `LOOKUP_FLOOR_WIDTH` (`WidthPolicy.lookup_cap`): a copied run must be seen going on before a round bets on it
# going on much longer.
LOOKUP_GROWTH = 4
LOOKUP_FLOOR_WIDTH = 8


@dataclass(frozen=True)
class Shape:
    """What one round verifies: `width` tokens (the anchor and width - 1 drafts), as a draft tree built from
    the drafter's per-position distributions merged with the n-gram lookup (`tree`), as the n-gram lookup's
    continuation alone (`lookup`: no drafter call, so the cheapest round where the context repeats itself),
    or as the drafter's chain."""

    width: int
    tree: bool = False
    lookup: bool = False


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

    def carried(self, rounds: float = CARRIED_ROUNDS) -> "AcceptanceModel":
        """This model as the next generation starts from it: the same evidence, scaled (every position alike)
        to at most `rounds` rounds at position 0, so its rates lean further toward their priors."""
        scale = self.carried_scale(rounds)
        return replace(self, kept=[k * scale for k in self.kept], offered=[o * scale for o in self.offered])

    def carried_scale(self, rounds: float = CARRIED_ROUNDS) -> float:
        """The factor `carried` scales the evidence by: at most `rounds` rounds at position 0."""
        return min(1.0, rounds / self.offered[0]) if self.offered[0] > 0 else 1.0

    def rates(self, priors: list[float] | None = None) -> list[float]:
        """Position 0 shrinks toward 1/2; every later position toward the rate of the one before it, so a
        drafter that keeps everything it offered is expected to keep going (and wider widths get tried).
        `priors`: each position shrinks toward its own instead (a broader model's rates)."""
        out, prior = [], 0.5
        for i, (k, o) in enumerate(zip(self.kept, self.offered)):
            prior = (k + self.prior_weight * (priors[i] if priors else prior)) / (o + self.prior_weight)
            out.append(prior)
        return out

    def expected_tokens(self, width: int) -> float:
        return self.expected_all(width)[-1]

    def expected_all(self, width: int, priors: list[float] | None = None) -> list[float]:
        """`expected_tokens(w)` for w = 1..width, in one pass (`priors` as in `rates`)."""
        out, total, survive = [1.0], 1.0, 1.0
        for a in self.rates(priors)[: width - 1]:
            survive *= a
            total += survive
            out.append(total)
        return out + [total] * (width - len(out))


@dataclass
class TreeAcceptance:
    """Tokens committed per round by each tree budget (exponential forgetting), shrunk toward a prior: the
    chain of the same width's expectation, which a tree of that budget holds in the common case (its best
    path is the chain's) and beats when the drafter's second guesses or the context's n-grams are right."""

    widths: tuple[int, ...]
    decay: float = 0.9
    prior_weight: float = 2.0
    committed: dict[int, float] = field(default_factory=dict)
    rounds: dict[int, float] = field(default_factory=dict)

    def observe(self, width: int, committed: int) -> None:
        for w in self.widths:
            if w == width:
                self.committed[w] = self.committed.get(w, 0.0) * self.decay + committed
                self.rounds[w] = self.rounds.get(w, 0.0) * self.decay + 1.0

    def expected(self, width: int, prior: float) -> float:
        return (self.committed.get(width, 0.0) + self.prior_weight * prior) / (
            self.rounds.get(width, 0.0) + self.prior_weight
        )

    def seen(self, width: int) -> float:
        return self.rounds.get(width, 0.0)

    def carried(self, rounds: float = CARRIED_ROUNDS) -> "TreeAcceptance":
        """As the next generation starts from it: each budget's mean, from at most `rounds` rounds."""
        scale = {w: min(1.0, rounds / n) for w, n in self.rounds.items() if n > 0}
        return replace(
            self,
            committed={w: c * scale.get(w, 1.0) for w, c in self.committed.items()},
            rounds={w: n * scale.get(w, 1.0) for w, n in self.rounds.items()},
        )


@dataclass
class LookupAcceptance:
    """The n-gram lookup's per-position acceptance (`AcceptanceModel`), learnt apart for each length of the n-gram
    it matched: a 4-gram match goes on as the context did far more often than a 2-gram one, so one model for all
    would offer long chains after weak matches and short ones after strong matches (docs/design.md).

    Past the first draft, a position is judged only in rounds that kept every draft before it, so after a
    passage copied whole its high rates outlive the passage: on a list whose format repeats but whose entries
    are new, each round misses at its first or second draft and the deep positions are seldom judged again.
    Each length therefore also keeps, over recent rounds, the drafts kept past the first against what its model
    expected there when the round was chosen; that ratio (at most 1, shrunk toward 1) scales the expectation
    past the first draft (`expected_all`).

    A length seldom matched has little evidence of its own: its model shrinks toward the model of every match
    length pooled (`pooled`), not toward 1/2, so it starts from what the lookup keeps in this text."""

    size: int  # drafts per round at most
    ngrams: tuple[int, ...] = (1, 2, 3, 4)  # the match lengths the lookup finds
    models: dict[int, AcceptanceModel] = field(default_factory=dict)
    pooled: AcceptanceModel | None = None  # every match length's rounds together: each length's prior
    kept_deep: dict[int, float] = field(default_factory=dict)  # drafts kept past the first, decayed
    expected_deep: dict[int, float] = field(default_factory=dict)  # what the model expected there, decayed
    decay: float = 0.9  # twice as forgetful as the drafter's: how far a match goes on changes with the passage
    prior_weight: float = 2.0  # in drafts: the calibration's pull toward 1
    calibration_decay: float = 0.5  # a few rounds: it catches the passage changing, which the models are slow to

    def __post_init__(self):
        self.models = self.models or {n: AcceptanceModel(self.size, decay=self.decay) for n in self.ngrams}
        self.pooled = self.pooled or AcceptanceModel(self.size, decay=self.decay)
        self.kept_deep = self.kept_deep or {n: 0.0 for n in self.ngrams}
        self.expected_deep = self.expected_deep or {n: 0.0 for n in self.ngrams}

    def length(self, ngram: int) -> int:
        """The match length `ngram` is learnt under (clamped to the lengths kept apart)."""
        return min(max(ngram, self.ngrams[0]), self.ngrams[-1])

    def model(self, ngram: int) -> AcceptanceModel:
        """The per-position model for a match of `ngram` tokens."""
        return self.models[self.length(ngram)]

    def observe(self, ngram: int, drafted: int, accepted: int) -> None:
        """A round offered `drafted` drafts of a continuation matched on `ngram` tokens and kept the first
        `accepted`."""
        n = self.length(ngram)
        model = self.models[n]
        tokens = model.expected_all(drafted + 1, self.pooled.rates())
        expected = tokens[-1] - tokens[min(drafted, 1)]  # past the first draft
        self.kept_deep[n] = self.calibration_decay * self.kept_deep[n] + max(accepted - 1, 0)
        self.expected_deep[n] = self.calibration_decay * self.expected_deep[n] + expected
        model.observe(drafted, accepted)
        self.pooled.observe(drafted, accepted)

    def calibration(self, ngram: int) -> float:
        """Drafts kept past the first over what was expected there, in recent rounds: at most 1."""
        n = self.length(ngram)
        return min(1.0, (self.kept_deep[n] + self.prior_weight) / (self.expected_deep[n] + self.prior_weight))

    def expected_all(self, ngram: int, width: int) -> list[float]:
        """Expected committed tokens of a lookup chain of w = 1..width after a match of `ngram` tokens."""
        return self._expected_all(ngram, width, self.pooled.rates())

    def expected_each(self, width: int) -> list[list[float]]:
        """`expected_all` after a match of each length in `ngrams`, the pooled prior computed once."""
        priors = self.pooled.rates()
        return [self._expected_all(n, width, priors) for n in self.ngrams]

    def _expected_all(self, ngram: int, width: int, priors: list[float]) -> list[float]:
        tokens, scale = self.model(ngram).expected_all(width, priors), self.calibration(ngram)
        return [e if w <= 2 else tokens[1] + (e - tokens[1]) * scale for w, e in enumerate(tokens, 1)]

    def seen(self) -> float:
        """Recent rounds that judged a lookup draft, over every match length (decayed)."""
        return sum(m.offered[0] for m in self.models.values())

    def carried(self, rounds: float = CARRIED_ROUNDS) -> "LookupAcceptance":
        """As the next generation starts from it (`AcceptanceModel.carried`, per match length; the calibration
        scaled alike)."""
        scales = {n: m.carried_scale(rounds) for n, m in self.models.items()}
        return replace(
            self,
            models={n: m.carried(rounds) for n, m in self.models.items()},
            pooled=self.pooled.carried(rounds),
            kept_deep={n: k * scales[n] for n, k in self.kept_deep.items()},
            expected_deep={n: e * scales[n] for n, e in self.expected_deep.items()},
        )


@dataclass
class RoundTimes:
    """Seconds of a whole round per context band and shape, as the loop timed them (draft, verify and read
    together), averaged as `VerifyCost.observe` averages. The verify-cost table plus a drafting residual only
    predicts a shape never run here: one table timed under other load (or a drafter whose cost grows with the
    tree it builds) would otherwise mislead every later choice, and a shape's own rounds say what it costs.
    Plain rounds too: the table's plain step is a bare forward, and a round also samples and reads back."""

    alpha: float = 0.1
    seconds: dict[tuple[int, Shape], float] = field(default_factory=dict)
    counts: dict[tuple[int, Shape], int] = field(default_factory=dict)
    scale: float = 1.0  # timed / predicted over recent rounds: a table measured too high or too low, corrected

    def get(self, shape: Shape, context: int) -> float | None:
        return self.seconds.get((band_of(context), shape))

    def observe(self, shape: Shape, context: int, seconds: float, predicted: float | None = None) -> None:
        """The first round of a shape in a band only warms it up (a new shape builds its kernels, as
        `measure_verify_cost`'s first run does) and is not kept; later rounds weigh as much as each other at
        first, and a drafting round cheaper than the average pulls it at least halfway (load only ever adds
        time). Plain rounds are averaged alone: they are queued one ahead, so one is read at once (0 s) and the
        next carries the time of both. `predicted`: what the table said this round would take."""
        key = (band_of(context), shape)
        n = self.counts.get(key, 0) + 1
        self.counts[key] = n
        if n == 1:
            return
        if predicted:
            self.scale = 0.8 * self.scale + 0.2 * min(max(seconds / predicted, 0.1), 10.0)
        old = self.seconds.get(key)
        if old is None:
            self.seconds[key] = seconds
            return
        weight = max(self.alpha, 1.0 / (n - 1), 0.5 if seconds < old and shape.width > 1 else 0.0)
        self.seconds[key] = (1 - weight) * old + weight * seconds


@dataclass
class WidthPolicy:
    cost: VerifyCost
    acceptance: AcceptanceModel
    draft_seconds: float | None = None  # the drafter's propose time, averaged
    probe_width: int = 4
    probe_interval: int = 8
    max_interval: int = 256
    trees: TreeAcceptance | None = None  # tree budgets it may choose (None: chains only)
    lookup: LookupAcceptance | None = None  # the n-gram lookup's chains, offered with trees (None: never)
    tree_draft_seconds: float | None = None  # a tree round's drafting time (the drafter's, the build's), averaged
    round_times: RoundTimes = field(default_factory=RoundTimes)  # each shape's own rounds, timed (plain too)
    _interval: int = 0
    _plain_rounds: int = 0
    _lookup_run: int | None = None  # tokens the last round's lookup continuation committed (None: none yet)
    _draft_rounds: int = 0
    _probing: bool = False
    _chains_judged: bool = False  # whether a chain round ran in this generation (`_stale_chain`)
    _draft_samples: int = 0  # drafting rounds whose time fed `draft_seconds` (observe_round)
    _tree_samples: int = 0

    @property
    def max_width(self) -> int:
        """The widest chain."""
        return self.acceptance.size + 1

    def _seconds(self, shape: Shape, costs: list[float], context: int) -> float:
        """A round of this shape: its own rounds' time where it ran in this band, else the prediction scaled
        by how far predictions have been off for the shapes that ran (`RoundTimes.scale`). A plain round too,
        once one ran here, else the table's plain step (`VerifyCost.estimate`: the least over wider widths, so
        where one token's forward costs more than two tokens', as on this CPU, a bare 2-token forward)."""
        timed = self.round_times.get(shape, context)
        if timed is not None:
            return timed
        if shape.width == 1:
            return costs[0]
        return self._predicted(shape, costs) * self.round_times.scale

    def _predicted(self, shape: Shape, costs: list[float]) -> float:
        """Verify cost from the table, plus drafting time (none for the lookup's chains)."""
        if shape.lookup:
            return costs[shape.width - 1]
        draft = (self.tree_draft_seconds if shape.tree else None) or self.draft_seconds or 0.0
        return costs[shape.width - 1] + draft

    def _expected(self, shape: Shape, chain: list[float], lookup: list[float]) -> float:
        """Expected committed tokens: `chain` and `lookup` are the drafter's chains' and the lookup's chains'
        (after this round's match) expectations by width, computed once for every shape weighed."""
        if shape.lookup:
            return lookup[shape.width - 1]
        if not shape.tree:
            return chain[shape.width - 1]
        prior = 1.0 + (chain[min(shape.width, self.max_width) - 1] - 1.0) * TREE_PRIOR_GAIN
        return self.trees.expected(shape.width, prior)

    def shapes(self, found: int = 0) -> list[Shape]:
        """The shapes it weighs: the chain widths the cost table measured (`VerifyCost.widths`), each tree budget,
        and with `found` tokens of n-gram continuation at hand, the lookup's chains of measured widths up to them."""
        grid = self.cost.widths()
        chains = [Shape(w) for w in grid if w <= self.max_width]
        trees = [Shape(w, tree=True) for w in self.trees.widths] if self.trees is not None else []
        lookups = []
        if self.lookup is not None:
            widest = min(found, self.lookup.size) + 1
            lookups = [Shape(w, lookup=True) for w in grid if 2 <= w <= min(widest, self.lookup_cap())]
        return chains + [s for s in trees + lookups if s.width <= self.cost.max_width]

    def lookup_cap(self) -> int:
        """The widest lookup chain offered now: `LOOKUP_GROWTH` times the tokens the last lookup round committed,
        at least `LOOKUP_FLOOR_WIDTH` (any width before the generation's first lookup round). After a long copy
        the lookup's deep positions keep rates near 1 until a round reaches them and fails, so each new match
        would be verified 24 or 32 tokens wide (two plain steps here, twice a verify of 8); where the copy is
        broken every few tokens (an edited function, a list with changed fields) such rounds kept 0-3 drafts.
        Growing 4x a round, a copy that goes on reaches 32 in two rounds."""
        if self._lookup_run is None:
            return self.cost.max_width
        return max(LOOKUP_FLOOR_WIDTH, LOOKUP_GROWTH * self._lookup_run)

    def rate(self, shape: Shape, context: int, ngram: int = 0) -> float:
        """Expected committed tokens per second of this shape (a lookup chain: after a match of `ngram` tokens)."""
        chain, costs = self.acceptance.expected_all(self.max_width), self.cost.estimates(context)
        return self._rate(shape, chain, self._lookup_expected(ngram, shape.lookup), costs, context)

    def _lookup_expected(self, ngram: int, needed: bool) -> list[float]:
        """The lookup's chains' expected tokens by width after a match of `ngram` tokens ([] when not `needed`)."""
        return self.lookup.expected_all(ngram, self.lookup.size + 1) if needed and self.lookup is not None else []

    def _rate(self, shape: Shape, chain: list[float], lookup: list[float], costs: list[float], context: int) -> float:
        return self._expected(shape, chain, lookup) / max(self._seconds(shape, costs, context), 1e-9)

    def lookup_may_pay(self, context: int) -> bool:
        """Whether the lookup's continuation, were it found at full length after the strongest match, would beat
        a plain step. Asked before every plain round is read: each model's expectations are computed once,
        for all widths (`expected_all`), not once per width."""
        if self.lookup is None:
            return False
        costs = self.cost.estimates(context)
        found = [s for s in self.shapes(self.lookup.size) if s.lookup]
        expected = self.lookup.expected_each(self.lookup.size + 1)
        best = max(e[s.width - 1] / max(self._seconds(s, costs, context), 1e-9) for s in found for e in expected)
        return best > 1.0 / max(self._seconds(Shape(1), costs, context), 1e-9)

    def choose(self, context: int, found: int = 0, ngram: int = 0) -> Shape:
        """The next round's shape after `context` tokens, `found` tokens of n-gram continuation at hand, matched
        on an n-gram of `ngram` tokens."""
        self._interval = self._interval or self.probe_interval
        chain, costs = self.acceptance.expected_all(self.max_width), self.cost.estimates(context)
        lookup = self._lookup_expected(ngram, found > 0)
        rates = {s: self._rate(s, chain, lookup, costs, context) for s in self.shapes(found)}
        ranked = sorted(rates, key=rates.__getitem__, reverse=True)
        best = ranked[0]
        self._probing = False
        if best.width > 1:
            if not best.lookup:  # the lookup's rounds judge nothing of the drafter: plain rounds between them count
                self._plain_rounds = 0
            self._draft_rounds += 1
            if self._draft_rounds % self.probe_interval == 0:
                floor = PROBE_FLOOR * rates[best]
                stale = self._stale_chain(floor, costs, context) if best.tree or best.lookup else None
                return stale or self._probe(best, ranked, [s for s in ranked if rates[s] >= floor])
            return best
        self._plain_rounds += 1
        if self._plain_rounds >= self._interval:
            self._plain_rounds = 0
            self._probing = True
            return self._plain_probe(ranked)
        return best

    def _stale_chain(self, floor: float, costs: list[float], context: int) -> Shape | None:
        """Before any chain round of this generation, the chains' acceptance is the last generation's, on other
        text, and nothing re-judges it while the lookup or trees lead: chains rated below the probe floor are never
        probed, and the lookup's rounds keep plain probes from coming due. So until a chain has run here, a probe
        goes to the chain that would be best at the prior of a drafter not yet judged (every position 1/2) if that
        comes within `floor`; where the lookup copies far faster than any drafter could, none is."""
        if self._chains_judged:
            return None
        prior = AcceptanceModel(self.acceptance.size).expected_all(self.max_width)
        rated = {s: self._rate(s, prior, [], costs, context) for s in self.shapes() if s.width > 1 and not s.tree}
        chain = max(rated, key=rated.__getitem__, default=None)
        return chain if chain is not None and rated[chain] >= floor else None

    def _seen(self, shape: Shape) -> float:
        """How much recent evidence it has on this shape's kind (decayed rounds)."""
        if shape.tree:
            return self.trees.seen(shape.width)
        return self.lookup.seen() if shape.lookup else self.acceptance.offered[0]

    def _plain_probe(self, ranked: list[Shape]) -> Shape:
        """While plain decoding wins, the least seen of: a chain of `probe_width`, the smallest tree, and the
        n-gram continuation at hand. A tree's or the lookup's time and acceptance are otherwise only predicted
        (from the cost table, other shapes' drafting time, a prior), and one bad prediction would keep it out.
        The chain first while no chain round ran in this generation: its acceptance is the last text's."""
        chain = Shape(max((w for w in self.cost.widths() if 1 < w <= min(self.probe_width, self.max_width)), default=2))
        if not self._chains_judged:
            return chain
        tree = [Shape(min(self.trees.widths), tree=True)] if self.trees is not None else []
        lookup = [max((s for s in ranked if s.lookup), key=lambda s: s.width)] if any(s.lookup for s in ranked) else []
        candidates = [chain] + [s for s in tree + lookup if s.width <= self.cost.max_width]
        return min(candidates, key=self._seen)

    def _probe(self, best: Shape, ranked: list[Shape], close: list[Shape]) -> Shape:
        """Now and then another shape than the best, to keep its figures measured here and now, chosen among
        those `close` to the best only (expected rate at least `PROBE_FLOOR` of its: a shape that commits half
        the best's tokens per second gives up half a round each time, and its rounds could not change the
        choice unless its expectation came near). While trees are offered, every other probe is the tree budget
        or lookup chain seen least (`_lookup_probe`); else the next measured chain width above a best chain, or
        the best chain where a tree or the lookup is best (the trees' prior rests on the chains' acceptance,
        which only chain rounds measure; chains not yet judged are probed close or not). With none, the best
        itself."""
        if self.trees is not None and (self._draft_rounds // self.probe_interval) % 2:
            lookups = [s for s in close if s.lookup]
            others = [s for s in close if s.tree] + ([self._lookup_probe(best, lookups)] if lookups else [])
            if others:
                return min(others, key=self._seen)
        if best.tree or best.lookup:
            # Chains seldom judged are rated by their prior (every position 1/2) and are probed however far off.
            unjudged = self.acceptance.offered[0] < self.acceptance.prior_weight
            chains = [s for s in (ranked if unjudged else close) if not s.tree and not s.lookup and s.width > 1]
            return chains[0] if chains else best
        wider = [w for w in self.cost.widths() if best.width < w <= self.max_width]
        return Shape(wider[0]) if wider else best

    @staticmethod
    def _lookup_probe(best: Shape, lookups: list[Shape]) -> Shape:
        """The lookup chain to probe among `lookups` (close to the best, best rate first): where a lookup chain
        is best, the next wider one, so its deeper positions get judged a step at a time (a chain of 32 costs
        twice one of 8 here, and one that stops early gives up most of a round); else the best-rated one."""
        wider = [s for s in lookups if s.width > best.width] if best.lookup else []
        return min(wider, key=lambda s: s.width) if wider else lookups[0]

    def observe_round(
        self,
        shape: Shape,
        accepted: int,
        context: int,
        seconds: float,
        timed: bool = True,
        lookup_offered: int = 0,
        lookup_kept: int = 0,
        lookup_ngram: int = 0,
    ) -> None:
        """One round timed as a whole, as the loop times it: `seconds` from the host read before it to its
        own (draft and verify run as one queued graph, so they cannot be timed apart without a second
        sync). A width-1 round refines the verify cost; a drafting round's time beyond the verify estimate
        is its drafting cost (`draft_seconds`, or `tree_draft_seconds` for a tree: the first such rounds
        averaged, then an exponential average). Load only ever adds time, so a round cheaper than the
        estimate pulls it down at least halfway: one slow first round (cold caches, other load) cannot keep
        drafting switched off. `timed` False: the time is not representative (the draft projected a long
        backlog of context, such as a prompt's): only the acceptance counts, so no estimate is seeded from it.
        A tree that held `lookup_offered` nodes of the n-gram continuation, of which its accepted path kept
        `lookup_kept`, also says what that continuation verified alone would have kept. `lookup_ngram`: the
        length of the n-gram the lookup matched, for a lookup chain or a tree's lookup branch."""
        if shape.tree:
            self.trees.observe(shape.width, accepted + 1)
            if self.lookup is not None and lookup_offered:  # the tree's lookup branch: a lookup chain's evidence
                self.lookup.observe(lookup_ngram, lookup_offered, lookup_kept)
                self._lookup_run = lookup_kept + 1
        elif shape.lookup:
            self.lookup.observe(lookup_ngram, shape.width - 1, accepted)
            self._lookup_run = accepted + 1
        elif shape.width > 1:
            self.acceptance.observe(shape.width - 1, accepted)
            self._chains_judged = True
        if timed:
            if shape.width == 1:
                self.cost.observe(1, context, seconds)
                self.round_times.observe(shape, context, seconds)
            else:
                predicted = self._predicted(shape, self.cost.estimates(context))
                if not shape.lookup:
                    residual = max(seconds - self.cost.estimate(shape.width, context), 0.0)
                    self._observe_draft(shape.tree, residual)
                self.round_times.observe(shape, context, seconds, predicted)
        self._judge_probe(shape, context, lookup_ngram)

    def _observe_draft(self, tree: bool, residual: float) -> None:
        samples = (self._tree_samples if tree else self._draft_samples) + 1
        current = self.tree_draft_seconds if tree else self.draft_seconds
        if current is None:
            current = residual
        else:
            weight = max(1.0 / samples, 0.5 if residual < current else 0.1)
            current = (1 - weight) * current + weight * residual
        if tree:
            self._tree_samples, self.tree_draft_seconds = samples, current
        else:
            self._draft_samples, self.draft_seconds = samples, current

    def _judge_probe(self, shape: Shape, context: int, ngram: int = 0) -> None:
        """After a probe (always wider than 1): did it pay? Then probe at the base interval, else back off."""
        if self._probing and shape.width > 1:
            self._probing = False
            paid = self.rate(shape, context, ngram) > self.rate(Shape(1), context)
            self._interval = self.probe_interval if paid else min(2 * self._interval, self.max_interval)


def width_policy(
    max_width: int, cost: VerifyCost, previous: WidthPolicy | None = None, tree_widths: tuple[int, ...] = ()
) -> WidthPolicy:
    """A policy for one generation over chains up to `max_width` and trees of `tree_widths` tokens (with trees,
    the n-gram lookup's chains up to the widest tree too). From the pair's previous one, timings carry over as
    they were and acceptance as a start (`AcceptanceModel.carried`); probing starts again at its base interval.
    A new prompt is new text: a drafter or lookup that paid on the last one may not on this one, nor fail
    again where it failed."""
    trees = TreeAcceptance(tuple(tree_widths)) if tree_widths else None
    lookup = LookupAcceptance(max(tree_widths) - 1) if tree_widths else None
    if previous is not None and previous.max_width == max_width:
        if trees is not None and previous.trees is not None and previous.trees.widths == trees.widths:
            trees = previous.trees.carried()
        if lookup is not None and previous.lookup is not None and previous.lookup.size == lookup.size:
            lookup = previous.lookup.carried()
        return WidthPolicy(
            cost,
            previous.acceptance.carried(),
            previous.draft_seconds,
            trees=trees,
            lookup=lookup,
            tree_draft_seconds=previous.tree_draft_seconds,
            round_times=previous.round_times,
            _draft_samples=previous._draft_samples,
            _tree_samples=previous._tree_samples,
        )
    return WidthPolicy(cost, AcceptanceModel(max_width - 1), trees=trees, lookup=lookup)


def describe(widths: list[int]) -> dict[str, Any]:
    """Histogram of verify widths, as `--json` and `bench` print it."""
    hist: dict[int, int] = {}
    for w in widths:
        hist[w] = hist.get(w, 0) + 1
    return {str(w): hist[w] for w in sorted(hist)}
