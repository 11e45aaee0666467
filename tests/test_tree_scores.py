"""Tree construction on scores a half-precision head can give: NaN and -inf log-probabilities never make a
node whose parent is not in the tree, and greedy decoding through such trees stays plain greedy. Such scores
tie, and a device's sort need not keep ties in order: the tree module runs here with an argsort that puts
tied entries in reverse order."""

import types

import mlx.core as mx
import numpy as np
import pytest
from oracle_drafter import TreeOracle

from mlx_glimmer import tree as mlx_tree
from mlx_glimmer.drafters.base import Marginals
from mlx_glimmer.settings import GenerationSettings
from mlx_glimmer.speculative import generate_steps

_argsort = mx.argsort


def reversed_ties_argsort(a, axis=-1, **kwargs):
    """`mx.argsort`, except that equal (or both NaN) entries of a vector come last index first."""
    if a.ndim != 1:
        return _argsort(a, axis=axis, **kwargs)
    values = np.array(a.astype(mx.float32))
    order = np.lexsort((-np.arange(values.size), values))  # NaN last, as mx.argsort puts it
    return mx.array(order.astype(np.uint32))


@pytest.fixture(autouse=True)
def unstable_sort(monkeypatch):
    fake = types.SimpleNamespace(**{k: getattr(mx, k) for k in dir(mx) if not k.startswith("__")})
    fake.argsort = reversed_ties_argsort
    monkeypatch.setattr(mlx_tree, "mx", fake)


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
def test_best_first_trees_are_closed_under_parents_on_bad_scores(bad, seed, depth, vocab, budget):
    log_probs = mx.array(spoiled(depth, vocab, bad, seed))
    tokens, parents, depths = mlx_tree.best_first(log_probs, budget)
    check_closed(tokens.tolist(), parents.tolist(), depths.tolist())
    tree = mlx_tree.model_tree(log_probs, budget)
    check_closed(tree.tokens.tolist(), tree.parents.tolist(), tree.depths[1:].tolist())


@pytest.mark.parametrize("bad", [float("nan"), -float("inf")], ids=["nan", "-inf"])
def test_best_first_trees_are_closed_when_every_score_is_bad(bad):
    log_probs = mx.full((5, 4), bad, mx.float32)
    tokens, parents, depths = mlx_tree.best_first(log_probs, 15)
    check_closed(tokens.tolist(), parents.tolist(), depths.tolist())


class SpoiledOracle(TreeOracle):
    """A `TreeOracle` whose marginals read as a half-precision head's can: beyond its two choices every
    score is `bad`, and every third round a whole position is."""

    def __init__(self, *args, bad: float):
        super().__init__(*args)
        self.bad, self.rounds = bad, 0

    def marginals(self, anchor, count):
        logits = self.logits(count)
        log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        log_probs[logits == 0] = self.bad
        self.rounds += 1
        if self.rounds % 3 == 0 and count > 1:
            log_probs[count // 2] = self.bad
        return Marginals(mx.array(log_probs))


@pytest.fixture(scope="module")
def plain(muse_pair):
    steps = generate_steps(muse_pair.target, PROMPT, GenerationSettings(max_tokens=N_TOKENS))
    return [t for s in steps for t in s.tokens]


@pytest.mark.parametrize("bad", [float("nan"), -float("inf")], ids=["nan", "-inf"])
@pytest.mark.parametrize("nodes", [7, 31])
def test_greedy_trees_on_bad_scores_equal_plain_greedy(muse_pair, plain, bad, nodes):
    target = muse_pair.target
    wrong = {i for i in range(N_TOKENS) if i % 5 == 2}
    oracle = SpoiledOracle(len(PROMPT), plain, wrong, target.vocab_size, bad=bad)
    steps = list(generate_steps(target, PROMPT, GenerationSettings(max_tokens=N_TOKENS, tree=nodes), drafter=oracle))
    assert [t for s in steps for t in s.tokens] == plain
