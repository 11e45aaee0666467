"""`--block-size auto`: each round verifies the shape expected to commit the most tokens per second.

One model weighs every shape a round may verify, a plain step (width 1), the drafter's chain of any width, a
draft tree of each budget, the n-gram lookup's continuation alone: rate = E / (verify(width) + draft(proposer)).
E = 1 + sum_j prod_{i<=j} a_i over the per-depth continuation rates of the shape's proposer (`DepthAcceptance`,
one estimator for chains, each tree budget and the lookup after each n-gram length); verify from
`verify_cost.VerifyCost`, draft the rest of a round's time per proposer and context band, both refined by
every round. Exploration is one rule, an upper confidence bound: a shape ranks by its rate times
1 + EXPLORATION * sqrt(ln t / (n + PRIOR_WEIGHT)), t the rounds so far and n those its proposer ran, so a
proposer that keeps losing is tried about ln t times. docs/design.md ("Block size: auto") explains the model.
Every choice depends only on past rounds: greedy output equals plain decoding and sampling stays exact.
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from dataclasses import dataclass, field, replace
from itertools import accumulate
from typing import Any

from .verify_cost import VerifyCost, average, band_of

TREE_WIDTHS = (4, 8, 16, 32)  # tree budgets (tokens verified) `auto` weighs against the chains
LOOKUP_NGRAMS = (1, 2, 3, 4)  # n-gram lengths the lookup's acceptance is learnt apart for (0: all pooled)

# Evidence kept from one round to the next of a proposer: about 1 / (1 - DECAY) = 20 recent rounds weigh, so an
# estimate follows the text as it changes and one odd round moves it by a twentieth.
DECAY = 0.95
# Rounds' worth of prior behind every rate, and behind the exploration count: two rounds of a proposer's own
# weigh as much as what it was expected to do.
PRIOR_WEIGHT = 2.0
# A depth nothing is known of (a new proposer's first): kept as often as not.
PRIOR_RATE = 0.5
# Rounds of evidence one generation hands the next, at most: a new prompt is new text, so what the last one kept
# is a start that the new text's first few rounds outweigh.
CARRIED_ROUNDS = 4.0
# The exploration constant: with no evidence, a shape is tried while within about a third of the best rate, and
# after n rounds of its proposer while within EXPLORATION * sqrt(ln t / n) of it.
EXPLORATION = 0.5


@dataclass(frozen=True)
class Shape:
    """What one round verifies: `width` tokens (the anchor and width - 1 drafts), as a draft tree merged with the
    n-gram lookup's branch (`tree`), as the lookup's continuation alone (`lookup`), or as the drafter's chain."""

    width: int
    tree: bool = False
    lookup: bool = False


@dataclass
class DepthAcceptance:
    """Per-depth conditional continuation rates of one proposer, a_j = P(depth j kept | the depths before kept), from
    its recent rounds with exponential forgetting, each shrunk toward a prior: given rates (a broader model's), else
    the depth before's estimate, so a proposer that keeps all it offers is expected to keep going."""

    size: int  # the deepest depth a round offers
    kept: list[float] = field(default_factory=list)
    judged: list[float] = field(default_factory=list)
    rounds: float = 0.0  # rounds observed, not forgotten: exploration's count

    def __post_init__(self):
        self.kept, self.judged = self.kept or [0.0] * self.size, self.judged or [0.0] * self.size

    def observe(self, offered: int, accepted: int) -> None:
        """A round offered `offered` depths and kept the first `accepted`: depths 0..accepted were judged."""
        self.kept, self.judged = [k * DECAY for k in self.kept], [j * DECAY for j in self.judged]
        for i in range(min(accepted + 1, offered, self.size)):
            self.judged[i] += 1.0
            self.kept[i] += float(i < accepted)
        self.rounds += 1.0

    def rates(self, prior: list[float] | None = None) -> list[float]:
        out, last = [], PRIOR_RATE
        for i, (k, j) in enumerate(zip(self.kept, self.judged)):
            last = (k + PRIOR_WEIGHT * (prior[i] if prior and i < len(prior) else last)) / (j + PRIOR_WEIGHT)
            out.append(last)
        return out

    def survival(self, prior: list[float] | None = None) -> list[float]:
        """P(depths 0..j all kept), for each j: E's summands."""
        return list(accumulate(self.rates(prior), operator.mul))

    def expected(self, prior: list[float] | None = None) -> list[float]:
        """Expected committed tokens E(w) = 1 + sum_{j < w - 1} P(depths 0..j kept), for w = 1..size + 1."""
        return list(accumulate(self.survival(prior), initial=1.0))

    def carried(self) -> "DepthAcceptance":
        """As the next generation starts from it: the same rates, from at most `CARRIED_ROUNDS` rounds."""
        scale = min(1.0, CARRIED_ROUNDS / self.judged[0]) if self.judged[0] > 0 else 1.0
        kept, judged = [k * scale for k in self.kept], [j * scale for j in self.judged]
        return DepthAcceptance(self.size, kept, judged, min(self.rounds, CARRIED_ROUNDS))


@dataclass
class WidthPolicy:
    """The shapes' acceptance (`chain`, `trees` per budget, `lookup` per n-gram length with 0 pooled), their
    verify cost (`cost`) and drafting seconds (`draft`, per proposer and band), and the choice they make."""

    cost: VerifyCost
    chain: DepthAcceptance
    trees: dict[int, DepthAcceptance] = field(default_factory=dict)  # none: chains only
    lookup: dict[int, DepthAcceptance] = field(default_factory=dict)  # none: the lookup's chains are not weighed
    draft: dict[tuple, float] = field(default_factory=dict)  # (proposer, band) -> seconds
    samples: dict[tuple, int] = field(default_factory=dict)  # timings behind each `draft` entry
    warm: set = field(default_factory=set)  # (shape, band) pairs whose first round (building kernels) has run
    rounds: int = 0  # rounds observed in this generation

    @property
    def max_width(self) -> int:  # the widest chain
        return self.chain.size + 1

    @property
    def lookup_size(self) -> int:  # the most lookup tokens a round verifies (0: none)
        return self.lookup[0].size if self.lookup else 0

    def shapes(self, found: int = 0) -> list[Shape]:
        """Chains of every width, each tree budget, and the lookup's chains up to the `found` tokens at hand."""
        widest, chains = min(found, self.lookup_size, self.cost.max_width - 1) + 1, range(1, self.max_width + 1)
        trees = [Shape(b, tree=True) for b in self.trees if b <= self.cost.max_width]
        return [Shape(w) for w in chains] + trees + [Shape(w, lookup=True) for w in range(2, widest + 1)]

    def _model(self, shape: Shape, ngram: int) -> DepthAcceptance | None:  # None: a plain step
        if shape.tree:
            return self.trees[shape.width]
        if shape.lookup:
            return self.lookup[min(max(ngram, LOOKUP_NGRAMS[0]), LOOKUP_NGRAMS[-1])]
        return self.chain if shape.width > 1 else None

    def _prior(self, shape: Shape) -> list[float] | None:
        """A tree budget starts from the next smaller budget's rates, the smallest from the chains' (best-first
        trees nest: a larger one holds every path of a smaller one); an n-gram length from all lengths pooled."""
        smaller = max((b for b in self.trees if b < shape.width), default=None) if shape.tree else None
        if shape.tree:
            return (
                self.chain.rates() if smaller is None else self.trees[smaller].rates(self._prior(Shape(smaller, True)))
            )
        return self.lookup[0].rates() if shape.lookup else None

    @staticmethod
    def _proposer(shape: Shape) -> tuple[str, int]:
        """Whose drafting a round's time holds beyond its verify: a tree's grows with its budget."""
        return ("tree", shape.width) if shape.tree else ("lookup", 0) if shape.lookup else ("chain", 0)

    def _drafting(self, proposer: tuple[str, int], band: int) -> float:
        """Its drafting seconds in this band, else the nearest band's; none before any (a first try is optimistic)."""
        timed = sorted((abs(b - band), s) for (p, b), s in self.draft.items() if p == proposer)
        return timed[0][1] if timed else 0.0

    def rates(self, context: int, found: int = 0, ngram: int = 0, shapes: list[Shape] | None = None) -> dict:
        """Expected committed tokens per second of each shape weighed (or of `shapes`)."""
        costs, band, models, out = self.cost.estimates(context), band_of(context), {}, {}
        for shape in shapes or self.shapes(found):
            model = self._model(shape, ngram)
            if id(model) not in models:
                drafting = self._drafting(self._proposer(shape), band) if model is not None else 0.0
                models[id(model)] = (model.expected(self._prior(shape)) if model else [1.0], drafting)
            expected, drafting = models[id(model)]
            out[shape] = expected[min(shape.width, len(expected)) - 1] / max(costs[shape.width - 1] + drafting, 1e-9)
        return out

    def index(self, shape: Shape, rate: float, ngram: int = 0) -> float:
        """The rate, raised by how little its proposer has been tried (upper confidence bound)."""
        if (model := self._model(shape, ngram)) is None:
            return rate
        return rate * (1.0 + EXPLORATION * math.sqrt(math.log(self.rounds + 1) / (model.rounds + PRIOR_WEIGHT)))

    def choose(self, context: int, found: int = 0, ngram: int = 0) -> Shape:
        """The next round's shape after `context` tokens, `found` lookup tokens at hand after `ngram` matched."""
        rates = self.rates(context, found, ngram)
        return max(rates, key=lambda s: self.index(s, rates[s], ngram))

    def lookup_may_pay(self, context: int) -> bool:
        """Whether a lookup continuation found at full length after some n-gram could rank above a plain step:
        asked for a round planned behind a plain step, whose anchor (and so its match) is not read yet."""
        if not self.lookup:
            return False
        plain = self.rates(context, shapes=[Shape(1)])[Shape(1)]
        found = [Shape(w, lookup=True) for w in range(2, min(self.lookup_size + 1, self.cost.max_width) + 1)]
        return any(
            self.index(s, r, n) > plain for n in LOOKUP_NGRAMS for s, r in self.rates(context, 0, n, found).items()
        )

    def branch_length(self, ngram: int, found: int, nodes: int) -> int:
        """How many of `found` lookup tokens a tree of `nodes` nodes takes as its lookup branch, leaving the
        drafter a node: the length that most raises E, each lookup node at depth j adding its chance of being
        kept, P(lookup depths 0..j kept), in place of the drafter's node there, P(chain depths 0..j kept)."""
        lookup = self._model(Shape(2, lookup=True), ngram).survival(self.lookup[0].rates())
        chain = self.chain.survival() + [0.0] * len(lookup)
        gains = list(accumulate((lookup[j] - chain[j] for j in range(min(found, nodes - 1))), initial=0.0))
        return gains.index(max(gains))

    def observe_round(self, shape: Shape, accepted: int, context: int, seconds: float, timed: bool = True,
                      lookup_offered: int = 0, lookup_kept: int = 0, lookup_ngram: int = 0) -> None:  # fmt: skip
        """A round of `shape` kept `accepted` drafts in `seconds`, from the host read before it to its own (`timed`
        False: the draft projected a long backlog, so only acceptance counts). A tree's lookup branch of
        `lookup_offered` nodes, `lookup_kept` on its path, counts for the lookup after `lookup_ngram` tokens."""
        self.rounds += 1
        if (model := self._model(shape, lookup_ngram)) is not None:
            model.observe(shape.width - 1, accepted)
        if shape.lookup:
            self.lookup[0].observe(shape.width - 1, accepted)
        elif shape.tree and lookup_offered and self.lookup:
            for m in (self._model(Shape(2, lookup=True), lookup_ngram), self.lookup[0]):
                m.observe(lookup_offered, lookup_kept)
        band = band_of(context)
        if not timed or (shape, band) not in self.warm:  # a shape's first round in a band builds its kernels
            self.warm.add((shape, band))
            return
        if shape.width == 1:
            return self.cost.observe(1, context, seconds)
        # The round's time beyond the estimate is split between its verify and its drafting, the one with less
        # evidence taking more: a width never run gets it where the proposer's drafting is known, and the other way
        key = (self._proposer(shape), band)
        drafted, measured = self.samples.get(key, 0), self.cost.evidence(shape.width, context)
        verify, drafting = self.cost.estimate(shape.width, context), self.draft.get(key, 0.0)
        error, share = seconds - verify - drafting, drafted / (drafted + measured) if drafted else 0.0
        self.cost.observe(shape.width, context, max(verify + share * error, 0.0))
        self.samples[key] = drafted + 1
        self.draft[key] = average(self.draft.get(key), max(drafting + (1 - share) * error, 0.0), drafted + 1)


def width_policy(
    max_width: int, cost: VerifyCost, previous: WidthPolicy | None = None, tree_widths: tuple[int, ...] = ()
) -> WidthPolicy:
    """A policy for one generation over chains up to `max_width`, trees of `tree_widths` and with trees the lookup's
    chains; from the pair's `previous`, timings carry over as they were and acceptance as a start."""
    chain = DepthAcceptance(max_width - 1)
    trees = {b: DepthAcceptance(b - 1) for b in tree_widths}
    lookup = {n: DepthAcceptance(max(tree_widths) - 1) for n in (0, *LOOKUP_NGRAMS)} if tree_widths else {}
    if previous is None or previous.max_width != max_width:
        return WidthPolicy(cost, chain, trees, lookup)

    def carried(new: dict, old: dict) -> dict:
        return {k: old[k].carried() if k in old and old[k].size == m.size else m for k, m in new.items()}

    return replace(
        previous, cost=cost, chain=previous.chain.carried(), trees=carried(trees, previous.trees),
        lookup=carried(lookup, previous.lookup), draft=dict(previous.draft), samples=dict(previous.samples),
        warm=set(previous.warm), rounds=0,
    )  # fmt: skip


def describe(widths: list[int]) -> dict[str, Any]:
    """Histogram of verify widths, as `--json` and `bench` print it."""
    hist = Counter(widths)
    return {str(w): hist[w] for w in sorted(hist)}
