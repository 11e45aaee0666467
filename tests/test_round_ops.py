"""What a round builds after the target's forward: a greedy chain, and a plain round under `auto`, are judged
along the chain as plain decoding judges its token, in a fixed handful of array ops; only a tree is walked.
And the tree helpers that build in a few steps what a walk would (the ancestor matrix, a chain, the lookup's
branch through the model's nodes) give what the walk gives, on every array library."""

import io
import re
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest
from oracle_drafter import AlwaysPlain
from tree_libraries import LIBRARIES

from mlx_glimmer.settings import GenerationSettings
from mlx_glimmer.speculative import generate_steps
from mlx_glimmer.tree import CHAIN, LOOKUP, MODEL

PROMPT = [256] + list(b"Once upon a time")
NODE = re.compile(r'^\{ (\d+) \[label ="([^"]+)", shape=rectangle\]; \}$', re.M)


def primitives(*arrays) -> dict[str, str]:
    """The unevaluated primitives behind `arrays`: {node id: primitive name} (`mx.export_to_dot`)."""
    dot = io.StringIO()
    mx.export_to_dot(dot, *[a for a in arrays if a is not None])
    return dict(NODE.findall(dot.getvalue()))


@dataclass(frozen=True)
class Round:
    width: int  # tokens verified
    tree: bool
    ops: int  # primitives of its verdict
    argmaxes: int  # of them, argmax or argmin reductions


class VerdictSeam:
    """A target that counts, for each round, the primitives of what it launches after its head (the verdict)
    that its forward did not build. It starts nothing on `launch`, so the round's graph stays whole until the
    round's one read."""

    def __init__(self, target):
        self._target = target
        self.rounds: list[Round] = []
        self._forward: list = []
        self._logits = None

    def __getattr__(self, name):
        return getattr(self._target, name)

    def forward(self, tokens, cache, capture, tree=None):
        self._forward = [tokens.shape[0], tree is not None, tokens]
        return self._target.forward(tokens, cache, capture, tree)

    def read(self, *arrays) -> list[int]:
        self._logits = None  # a prompt's last logits, read with the first token
        return self._target.read(*arrays)

    def head(self, hidden):
        self._logits = self._target.head(hidden)
        return self._logits

    def launch(self, *arrays) -> None:
        if self._logits is not None:  # the verdict; not a draft (launched before the forward) or a context
            width, tree, tokens = self._forward
            launched = primitives(*arrays)
            own = [launched[k] for k in launched.keys() - primitives(self._logits, tokens).keys()]
            self.rounds.append(Round(width, tree, len(own), own.count("ArgReduce")))
            self._logits = None


def verdict_ops(pair, settings: GenerationSettings, policy=None) -> list[Round]:
    seam = VerdictSeam(pair.target)
    for _ in generate_steps(
        seam, PROMPT, settings, drafter=pair.drafter if settings.speculative else None, policy=policy
    ):
        pass
    return seam.rounds


@pytest.fixture(scope="module")
def chains(muse_pair) -> dict[int, list[Round]]:
    """The rounds of greedy chains at fixed widths 4 and 16."""
    return {w: verdict_ops(muse_pair, GenerationSettings(max_tokens=40, block_size=w, tree="off")) for w in (4, 16)}


def chain_ops(chains, width: int) -> set[int]:
    return {r.ops for r in chains[width] if r.width == width}


def test_a_greedy_chain_is_judged_with_one_argmax_in_ops_that_do_not_grow_with_its_width(chains):
    assert all(r.argmaxes == 1 and not r.tree for rounds in chains.values() for r in rounds)
    assert len(chain_ops(chains, 4)) == 1 and chain_ops(chains, 4) == chain_ops(chains, 16), chains


def test_a_plain_round_under_auto_takes_one_argmax_as_plain_decoding_does(muse_pair):
    plain = verdict_ops(muse_pair, GenerationSettings(max_tokens=40, speculative=False))
    rounds = verdict_ops(muse_pair, GenerationSettings(max_tokens=40, block_size=16), AlwaysPlain())
    assert {r.width for r in rounds} == {1} and len(rounds) == len(plain) == 39
    assert {r.argmaxes for r in rounds} == {r.argmaxes for r in plain} == {1}


def test_a_tree_is_walked_through_its_ancestors(muse_pair, chains):
    """The counter sees a walk: a tree round's verdict builds more than a chain's."""
    rounds = verdict_ops(muse_pair, GenerationSettings(max_tokens=40, tree=15))
    trees = [r.ops for r in rounds if r.tree]
    assert trees and min(trees) > max(chain_ops(chains, 16))


# --- tree helpers ---------------------------------------------------------------------------------------------------


@pytest.fixture(params=sorted(LIBRARIES))
def lib(request):
    return LIBRARIES[request.param]


def walked_ancestors(parents: list[int]) -> list[list[bool]]:
    """Row i: i and every node met walking up from i to the anchor."""
    up = [0] + parents
    rows = []
    for i in range(len(up)):
        row, node = [False] * len(up), i
        row[0] = True
        while node:
            row[node], node = True, up[node]
        rows.append(row)
    return rows


def random_parents(rng, size: int) -> list[int]:
    """Parents first: node i (from 1) hangs under any node before it, so depths run from 1 to `size`."""
    return [int(rng.integers(0, i)) for i in range(1, size + 1)]


def depths_of(parents: list[int]) -> list[int]:
    depths = [0]
    for p in parents:
        depths.append(depths[p] + 1)
    return depths


def test_the_ancestor_matrix_marks_every_ancestor_of_every_node(lib):
    rng = np.random.default_rng(11)
    cases = [random_parents(rng, int(rng.integers(1, 40))) for _ in range(30)] + [list(range(n)) for n in range(18)]
    for parents in cases:
        marks = lib.trees.ancestor_matrix(lib.ints(parents), max(depths_of(parents)))
        assert marks.tolist() == walked_ancestors(parents), parents


def test_a_chain_is_the_tree_whose_parents_are_the_positions_before_it(lib):
    for n in range(18):
        chain = lib.trees.chain(lib.tokens(list(range(100, 100 + n))), source=2)
        assert chain.chain and chain.max_depth == n and chain.tokens.tolist() == list(range(100, 100 + n))
        assert chain.parents.tolist() == list(range(n)) and chain.depths.tolist() == list(range(n + 1))
        assert chain.sources.tolist() == [2] * n
        assert chain.ancestors.tolist() == walked_ancestors(list(range(n)))


def walked_branch(tokens: list[int], parents: list[int], depths: list[int], lookup: list[int]):
    """The lookup's branch grown a token at a time: (its nodes' parents, the model nodes it runs through)."""
    parent, branch_parents, through = 0, [], set()
    for k, token in enumerate(lookup):
        branch_parents.append(parent)
        hit = next(
            (i + 1 for i in range(len(tokens)) if (parents[i], tokens[i], depths[i]) == (parent, token, k + 1)), None
        )
        if hit is None:
            parent = len(tokens) + k + 1
        else:
            through.add(hit)
            parent = hit
    return branch_parents, through


def test_the_lookups_branch_runs_through_the_model_nodes_it_repeats(lib):
    rng = np.random.default_rng(5)
    merged_some = 0
    for _ in range(60):
        depth, vocab, budget = int(rng.integers(1, 6)), int(rng.integers(2, 5)), int(rng.integers(2, 20))
        log_probs = lib.floats(np.log(rng.dirichlet(np.ones(vocab) * 0.5, depth)))
        lookup = rng.integers(0, vocab, int(rng.integers(1, budget))).tolist()
        tokens, parents, depths = (a.tolist() for a in lib.trees.best_first(log_probs, budget - len(lookup)))
        branch_parents, through = walked_branch(tokens, parents, depths, lookup)
        merged = lib.trees.merged_tree(log_probs, budget, lookup)
        n = len(tokens)
        assert merged.tokens.tolist() == tokens + lookup
        assert merged.parents.tolist() == parents + branch_parents
        assert merged.depths.tolist() == [0] + depths + list(range(1, len(lookup) + 1))
        first = [i == 0 or depths[i] != depths[i - 1] for i in range(n)]  # the model's greedy chain
        expected = [MODEL | (LOOKUP if i + 1 in through else 0) | (CHAIN if first[i] else 0) for i in range(n)]
        assert merged.sources.tolist() == expected + [LOOKUP] * len(lookup)
        assert merged.ancestors.tolist() == walked_ancestors(parents + branch_parents)
        merged_some += bool(through)
    assert merged_some > 10
