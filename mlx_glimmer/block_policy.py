"""`--block-size auto`: each round verifies the shape expected to commit the most tokens per second.

Every shape a round may verify (a plain step, the drafter's chain of any width, a draft tree of each budget, the
n-gram lookup's continuation alone) is weighed by one model: rate = E / (verify(width) + draft(proposer)), E =
1 + sum_j prod_{i<=j} a_i over per-depth continuation rates (`DepthAcceptance`: the chain, the lookup after each
n-gram length); a tree's E is the chain's times the gain its rounds measured over the chain inside it
(`TreeGain`); verify and draft from `verify_cost.RoundTimes`, refined by every round. Exploration is one rule,
an upper confidence bound (`WidthPolicy.index`). docs/design.md ("Block size: auto") explains it. Choices depend
only on past rounds: greedy output equals plain decoding and sampling stays exact.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field, replace
from itertools import accumulate

from .verify_cost import RoundTimes, VerifyCost

TREE_WIDTHS = (4, 8, 16, 32)  # tree budgets (tokens verified) `auto` weighs against the chains
LOOKUP_NGRAMS = (1, 2, 3, 4)  # n-gram lengths the lookup's acceptance is learnt apart for (0: all pooled)

# Evidence a proposer's round keeps from the last: about 20 recent rounds weigh, so estimates follow the text.
DECAY = 0.95
# Rounds' worth of prior behind every rate and the exploration count: two own rounds outweigh what was expected.
PRIOR_WEIGHT = 2.0
# A depth nothing is known of (a new proposer's first): kept as often as not.
PRIOR_RATE = 0.5
# Rounds of evidence a generation hands the next, at most: a new prompt's first few rounds outweigh them.
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

    def expected(self, prior: list[float] | None = None) -> list[float]:
        """Expected committed tokens E(w) = 1 + sum_{j < w - 1} P(depths 0..j kept), for w = 1..size + 1."""
        return list(accumulate(accumulate(self.rates(prior), operator.mul), initial=1.0))

    def carried(self) -> "DepthAcceptance":
        """As the next generation starts from it: the same rates, from at most `CARRIED_ROUNDS` rounds."""
        scale = min(1.0, CARRIED_ROUNDS / self.judged[0]) if self.judged[0] > 0 else 1.0
        kept, judged = [k * scale for k in self.kept], [j * scale for j in self.judged]
        return DepthAcceptance(self.size, kept, judged, min(self.rounds, CARRIED_ROUNDS))


@dataclass
class TreeGain:
    """A tree of `size` nodes against the drafter's chain inside it (its first node at each depth), on the same
    rounds: E is the chain's current E at the chain's depth in these trees times the ratio of what they committed
    to what that chain would have, shrunk toward E(chain as wide) / that. Trees run where chains did badly, on
    harder text: the ratio carries, and the estimate follows the chain's (tree rounds update it too)."""

    size: int  # nodes under the anchor (the budget less one)
    # Over its rounds, decayed: tokens committed, tokens the chain inside would have, its depth, the rounds.
    sums: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0, 0.0])
    rounds: float = 0.0  # not forgotten: exploration's count

    def observe(self, accepted: int, chain_depth: int, chain_kept: int) -> None:
        new = (accepted + 1, chain_kept + 1, chain_depth, 1)
        self.sums, self.rounds = [DECAY * s + x for s, x in zip(self.sums, new)], self.rounds + 1

    def expected(self, chain: list[float]) -> float:
        """E of the tree, from the chain's E(w) for w = 1..len(chain)."""
        committed, kept, depth, weight = self.sums
        full = chain[min(self.size, len(chain) - 1)]
        if not weight:
            return full
        inside = chain[min(round(depth / weight), len(chain) - 1)]
        return inside * (weight * committed / kept + PRIOR_WEIGHT * full / inside) / (weight + PRIOR_WEIGHT)

    def carried(self) -> "TreeGain":
        scale = min(1.0, CARRIED_ROUNDS / self.sums[-1]) if self.sums[-1] else 1.0
        return TreeGain(self.size, [s * scale for s in self.sums], min(self.rounds, CARRIED_ROUNDS))


@dataclass
class WidthPolicy:
    """The shapes' acceptance (`chain`, `trees` per budget, `lookup` per n-gram length with 0 pooled), what their
    rounds take (`times`: verify cost by width, drafting seconds per proposer and band), and the choice they make."""

    times: RoundTimes
    chain: DepthAcceptance
    trees: dict[int, TreeGain] = field(default_factory=dict)  # none: chains only
    lookup: dict[int, DepthAcceptance] = field(default_factory=dict)  # none: the lookup's chains are not weighed
    rounds: int = 0  # rounds observed in this generation

    @property
    def cost(self) -> VerifyCost:
        return self.times.cost

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

    def _model(self, shape: Shape, ngram: int) -> DepthAcceptance | TreeGain | None:  # None: a plain step
        if shape.tree:
            return self.trees[shape.width]
        if shape.lookup:
            return self.lookup[min(max(ngram, LOOKUP_NGRAMS[0]), LOOKUP_NGRAMS[-1])]
        return self.chain if shape.width > 1 else None

    @staticmethod
    def _proposer(shape: Shape) -> tuple[str, int] | None:
        """Whose drafting a round's time holds beyond its verify (a tree's grows with its budget); None: a plain step."""
        if shape.width == 1:
            return None
        return ("tree", shape.width) if shape.tree else ("lookup", 0) if shape.lookup else ("chain", 0)

    def rates(self, context: int, found: int = 0, ngram: int = 0, shapes: list[Shape] | None = None) -> dict:
        """Expected committed tokens per second of each shape weighed (or of `shapes`)."""
        costs, chain, out = self.cost.estimates(context), self.chain.expected(), {}
        lookup = self._model(Shape(2, lookup=True), ngram).expected(self.lookup[0].rates()) if self.lookup else []
        for shape in shapes or self.shapes(found):
            if shape.tree:
                expected = self.trees[shape.width].expected(chain)
            else:
                along = lookup if shape.lookup else chain
                expected = along[min(shape.width, len(along)) - 1]
            out[shape] = expected / max(self.seconds(shape, context, costs), 1e-9)
        return out

    def seconds(self, shape: Shape, context: int, costs: list[float]) -> float:
        """A round of `shape`'s expected seconds after `context`: its verify (`costs`, by width) and its drafting."""
        return costs[shape.width - 1] + self.times.drafting(self._proposer(shape), context)

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
        drafter a node: the length L that most raises E, each lookup node at depth j replacing the drafter's there,
        so by E_lookup(L + 1) - E_chain(L + 1) (the sums of each one's P(depths 0..j kept) for j < L)."""
        lookup, chain = (
            self._model(Shape(2, lookup=True), ngram).expected(self.lookup[0].rates()),
            self.chain.expected(),
        )
        gains = [lookup[j] - chain[min(j, len(chain) - 1)] for j in range(min(found, nodes - 1) + 1)]
        return gains.index(max(gains))

    def observe_round(self, shape: Shape, accepted: int, context: int, seconds: float, timed: bool = True,
                      lookup_offered: int = 0, lookup_kept: int = 0, lookup_ngram: int = 0,
                      chain_depth: int = 0, chain_kept: int = 0) -> None:  # fmt: skip
        """A round of `shape` kept `accepted` drafts in `seconds`, from the host read before it to its own (`timed`
        False: the draft projected a long backlog, so only acceptance counts). A tree's lookup branch of
        `lookup_offered` nodes, `lookup_kept` on its path, counts for the lookup after `lookup_ngram` tokens; the
        drafter's chain inside it, `chain_depth` deep, would have had `chain_kept` kept: that counts for the chain."""
        self.rounds += 1
        if shape.tree:
            self.trees[shape.width].observe(accepted, chain_depth, chain_kept)
        elif (model := self._model(shape, lookup_ngram)) is not None:
            model.observe(shape.width - 1, accepted)
        if chain_depth:
            self.chain.observe(chain_depth, chain_kept)
        if shape.lookup:
            self.lookup[0].observe(shape.width - 1, accepted)
        elif shape.tree and lookup_offered and self.lookup:
            for m in (self._model(Shape(2, lookup=True), lookup_ngram), self.lookup[0]):
                m.observe(lookup_offered, lookup_kept)
        self.times.observe(shape, self._proposer(shape), shape.width, context, seconds if timed else None)


def width_policy(
    max_width: int, cost: VerifyCost, previous: WidthPolicy | None = None, tree_widths: tuple[int, ...] = ()
) -> WidthPolicy:
    """A policy for one generation over chains up to `max_width`, trees of `tree_widths` and with trees the lookup's
    chains; from the pair's `previous`, timings carry over as they were and acceptance as a start."""
    chain = DepthAcceptance(max_width - 1)
    trees = {b: TreeGain(b - 1) for b in tree_widths}
    lookup = {n: DepthAcceptance(max(tree_widths) - 1) for n in (0, *LOOKUP_NGRAMS)} if tree_widths else {}
    if previous is None or previous.max_width != max_width:
        return WidthPolicy(RoundTimes(cost), chain, trees, lookup)

    def carried(new: dict, old: dict) -> dict:
        return {k: old[k].carried() if k in old and old[k].size == m.size else m for k, m in new.items()}

    return replace(
        previous, times=previous.times.carried(cost), chain=previous.chain.carried(),
        trees=carried(trees, previous.trees), lookup=carried(lookup, previous.lookup), rounds=0,
    )  # fmt: skip
