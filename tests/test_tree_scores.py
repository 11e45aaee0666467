"""Tree construction on scores a half-precision head can give: NaN and -inf log-probabilities never make a
node whose parent is not in the tree, and greedy decoding through such trees stays plain greedy. Such scores
tie, and a device's sort need not keep ties in order: the tree module runs here with an argsort that puts
tied entries in reverse order."""

import numpy as np
import pytest
from oracle_drafter import TreeOracle
from tree_libraries import LIBRARIES

from mlx_glimmer.drafters.base import Marginals
from mlx_glimmer.settings import GenerationSettings
from mlx_glimmer.speculative import generate_steps
from mlx_glimmer.torch_backend import load_torch


def reversed_ties(lib):
    """`lib`'s descending argsort, except that equal (or both NaN) entries come last index first."""

    def argsort_descending(a):
        values = np.array(a.tolist(), dtype=np.float32)
        order = np.lexsort((-np.arange(values.size), -np.nan_to_num(values, nan=-np.inf)))
        return lib.ints(order)

    return argsort_descending


@pytest.fixture(params=sorted(LIBRARIES))
def lib(request):
    base = LIBRARIES[request.param]
    return base.with_ops(argsort_descending=reversed_ties(base), compile=lambda function: function)  # a host sort


PROMPT = [256] + list(b"Once upon a time, far past the window")
N_TOKENS = 60


def check_closed(tokens: list[int], parents: list[int], depths: list[int]) -> None:
    """Every node's parent is in the tree, before it, and one level shallower."""
    for i, (p, d) in enumerate(zip(parents, depths), start=1):
        assert 0 <= p < i, f"node {i}'s parent {p} is not a node before it"
        assert d == (depths[p - 1] if p else 0) + 1, (
            f"node {i} at depth {d} hangs from depth {depths[p - 1] if p else 0}"
        )


def spoiled(depth: int, vocab: int, bad: float, seed: int) -> np.ndarray:
    """Log-probabilities [depth, vocab] where most entries, and some whole rows, are `bad` (NaN or -inf)."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(depth, vocab)).astype(np.float32)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    log_probs[rng.random((depth, vocab)) < 0.7] = bad
    log_probs[0, rng.integers(vocab)] = -0.5  # the anchor has a child worth drafting
    log_probs[rng.integers(1, depth)] = bad
    return log_probs


@pytest.mark.parametrize("bad", [float("nan"), -float("inf")], ids=["nan", "-inf"])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("depth, vocab, budget", [(4, 6, 12), (6, 3, 20), (3, 40, 31)])
def test_best_first_trees_are_closed_under_parents_on_bad_scores(lib, bad, seed, depth, vocab, budget):
    log_probs = lib.floats(spoiled(depth, vocab, bad, seed))
    tokens, parents, depths = lib.trees.best_first(log_probs, budget)
    check_closed(tokens.tolist(), parents.tolist(), depths.tolist())
    tree = lib.trees.model_tree(log_probs, budget)
    check_closed(tree.tokens.tolist(), tree.parents.tolist(), tree.depths[1:].tolist())


@pytest.mark.parametrize("bad", [float("nan"), -float("inf")], ids=["nan", "-inf"])
def test_best_first_trees_are_closed_when_every_score_is_bad(lib, bad):
    log_probs = lib.floats(np.full((5, 4), bad, np.float32))
    tokens, parents, depths = lib.trees.best_first(log_probs, 15)
    check_closed(tokens.tolist(), parents.tolist(), depths.tolist())


class SpoiledOracle(TreeOracle):
    """A `TreeOracle` whose marginals read as a half-precision head's can: beyond its two choices every
    score is `bad`, and every third round a whole position is."""

    def __init__(self, *args, bad: float, lib):
        super().__init__(*args)
        self.bad, self.rounds, self.lib = bad, 0, lib

    def marginals(self, anchor, count):
        logits = self.logits(count)
        log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        log_probs[logits == 0] = self.bad
        self.rounds += 1
        if self.rounds % 3 == 0 and count > 1:
            log_probs[count // 2] = self.bad
        return Marginals(self.lib.floats(log_probs))


class WithTrees:
    """`target` judging and building its trees with `trees`."""

    def __init__(self, target, trees):
        self._target, self.trees = target, trees

    def __getattr__(self, name):
        return getattr(self._target, name)


@pytest.fixture(scope="module")
def muse_targets(muse_pair, checkpoints):
    torch_muse = load_torch(target=checkpoints["muse"], device="cpu").target
    return {"mlx": muse_pair.target, "torch": torch_muse}


@pytest.fixture(scope="module")
def plain(muse_pair):
    steps = generate_steps(muse_pair.target, PROMPT, GenerationSettings(max_tokens=N_TOKENS))
    return [t for s in steps for t in s.tokens]


@pytest.mark.parametrize("bad", [float("nan"), -float("inf")], ids=["nan", "-inf"])
@pytest.mark.parametrize("nodes", [7, 31])
def test_greedy_trees_on_bad_scores_equal_plain_greedy(lib, muse_targets, bad, nodes):
    target = muse_targets[lib.name]
    plain = [t for s in generate_steps(target, PROMPT, GenerationSettings(max_tokens=N_TOKENS)) for t in s.tokens]
    wrong = {i for i in range(N_TOKENS) if i % 5 == 2}
    oracle = SpoiledOracle(len(PROMPT), plain, wrong, target.vocab_size, bad=bad, lib=lib)
    settings = GenerationSettings(max_tokens=N_TOKENS, tree=nodes)
    steps = list(generate_steps(WithTrees(target, lib.trees), PROMPT, settings, drafter=oracle))
    assert [t for s in steps for t in s.tokens] == plain
