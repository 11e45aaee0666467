"""Draft trees on torch targets: a tree verify is the chains it holds; generating through trees is plain
greedy's output, and a seed repeats. (The tree module's own cases run on torch too: test_tree.py.)"""

import numpy as np
import pytest
import torch
from oracle_drafter import TreeOracle
from tree_libraries import LIBRARIES

from mlx_glimmer.drafters.base import Marginals
from mlx_glimmer.settings import GenerationSettings
from mlx_glimmer.speculative import generate_steps
from mlx_glimmer.torch_backend import load_torch
from mlx_glimmer.tree import MODEL, DraftTree

TORCH = LIBRARIES["torch"]
PROMPT = [256] + list(b"Once upon a time, far past the window")  # 38 tokens: several Muse windows of 8


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def muse(checkpoints):
    return load_torch(target=checkpoints["muse"], drafter=checkpoints["assistant"], device="cpu")


def tokens_of(steps):
    return [t for s in steps for t in s.tokens]


def random_tree(seed: int, max_depth: int, vocab: int = 272) -> DraftTree:
    """A bushy tree, parents first, depth never decreasing along the index: 1 to 3 nodes a depth."""
    rng = np.random.default_rng(seed)
    parents, depths, previous = [], [], [0]
    for d in range(1, max_depth + 1):
        level = []
        for _ in range(int(rng.integers(1, 4))):
            parents.append(int(rng.choice(previous)))
            depths.append(d)
            level.append(len(parents))
        previous = level
    parents_t = torch.tensor(parents)
    return DraftTree(
        torch.tensor(rng.integers(0, vocab, len(parents))),
        parents_t,
        torch.tensor([0] + depths),
        torch.full((len(parents),), MODEL),
        TORCH.trees.ancestor_matrix(parents_t, max_depth),
        max_depth,
    )


def path_to(tree, node: int) -> list[int]:
    """[0, ..., node]: the positions from the anchor to `node`."""
    path = [node]
    while path[-1]:
        path.append(int(tree.parents[path[-1] - 1]))
    return path[::-1]


def test_a_tree_verify_gives_every_node_the_logits_of_its_path_as_a_chain_far_past_the_window(muse):
    target = muse.target
    window = target.config.sliding_window
    assert window == 8 and "full_attention" in target.config.layer_types
    tree = random_tree(0, max_depth=11)  # deeper than the window: ancestors fall out of sliding layers
    prefix, anchor = PROMPT[:-1], PROMPT[-1]

    def prefilled():
        cache = target.make_cache()
        target.forward(prefix, cache, capture=False)
        return cache

    cache = prefilled()
    tokens = torch.cat([torch.tensor([anchor]), tree.tokens])
    hidden, _ = target.forward(tokens, cache, capture=False, tree=tree)
    tree_logits = target.head(hidden)
    assert cache.get_seq_length() == len(prefix) + tree.size + 1
    for node in range(tree.size + 1):
        path = path_to(tree, node)
        chain_hidden, _ = target.forward(tokens[path], prefilled(), capture=False)
        np.testing.assert_allclose(
            tree_logits[node].numpy(), target.head(chain_hidden[-1]).numpy(), atol=1e-4, rtol=1e-4
        )

    # Keep one deep path whose positions are not a prefix of the verify: the cache is then the chain's.
    deepest = [i for i in range(tree.size + 1) if tree.depths[i] == tree.max_depth]
    path = max((path_to(tree, n) for n in deepest), key=lambda p: p != list(range(len(p))))
    assert path != list(range(len(path)))
    target.keep(cache, path, tree.size + 1)
    reference = prefilled()
    target.forward(tokens[path], reference, capture=False)
    assert cache.get_seq_length() == reference.get_seq_length() == len(prefix) + len(path)
    for token in (3, 77, 150, 9, 200, 41, 12, 8, 99, 5):  # on past another window
        ours, _ = target.forward([token], cache, capture=False)
        expected, _ = target.forward([token], reference, capture=False)
        np.testing.assert_allclose(target.head(ours).numpy(), target.head(expected).numpy(), atol=1e-4, rtol=1e-4)


def test_a_tree_verify_on_llama_takes_one_mask(checkpoints):
    target = load_torch(target=checkpoints["llama"], device="cpu").target
    tree = random_tree(5, max_depth=4)
    cache = target.make_cache()
    target.forward(PROMPT[:-1], cache, capture=False)
    tokens = torch.cat([torch.tensor([PROMPT[-1]]), tree.tokens])
    hidden, _ = target.forward(tokens, cache, capture=False, tree=tree)
    for node in (tree.size, tree.size // 2):
        reference = target.make_cache()
        chain_hidden, _ = target.forward(PROMPT[:-1] + tokens[path_to(tree, node)].tolist(), reference, False)
        np.testing.assert_allclose(
            target.head(hidden[node]).numpy(), target.head(chain_hidden[-1]).numpy(), atol=1e-4, rtol=1e-4
        )


class TorchTreeOracle(TreeOracle):
    """`TreeOracle`'s marginals as torch tensors, for the torch target; it drafts trees only."""

    def propose(self, anchor, count, params, noise):
        raise AssertionError("tree rounds only")

    def marginals(self, anchor, count):
        return Marginals(torch.log_softmax(torch.from_numpy(self.logits(count)), dim=-1))


def test_greedy_tree_and_chain_generation_on_torch_equal_plain_greedy(muse):
    target, drafter = muse.target, muse.drafter
    plain = tokens_of(generate_steps(target, PROMPT, GenerationSettings(max_tokens=60)))
    for tree in (7, "off"):
        steps = list(generate_steps(target, PROMPT, GenerationSettings(max_tokens=60, tree=tree), drafter=drafter))
        assert tokens_of(steps) == plain, tree
        assert all(s.tree == (tree == 7) for s in steps[1:-1])
    wrong = {i for i in range(60) if i % 5 == 2}
    oracle = TorchTreeOracle(len(PROMPT), plain, wrong, target.vocab_size)
    steps = list(generate_steps(target, PROMPT, GenerationSettings(max_tokens=60, tree=7), drafter=oracle))
    assert tokens_of(steps) == plain
    assert np.mean([s.accepted for s in steps[1:]]) > 2  # long paths, through side branches at the wrong ones


def test_sampled_tree_generation_on_torch_is_reproducible(muse):
    target, drafter = muse.target, muse.drafter
    settings = GenerationSettings.of(max_tokens=30, tree=7, temperature=0.8, seed=3)
    first = tokens_of(generate_steps(target, PROMPT, settings, drafter=drafter))
    again = tokens_of(generate_steps(target, PROMPT, settings, drafter=drafter))
    assert first == again and len(first) == 30 and all(0 <= t < target.vocab_size for t in first)
