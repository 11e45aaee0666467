"""Draft trees, as a specification, on every array library the tree module runs on (MLX and torch).

A best-first tree holds the `budget` most likely prefixes of the drafter's per-position distributions, parents
first; the n-gram lookup's branch joins it, merged where it repeats a model node. A tree verify gives every node
the logits its root-to-node path would get as a chain (its mask and RoPE positions), past a sliding window too;
keeping the accepted path leaves the cache the chain would have left. The verdict walks the tree as the target
decodes: greedy, the deepest path of argmaxes; sampled, each committed token a sample of the target's filtered
distribution. End to end: greedy trees emit exactly plain greedy's tokens, and sampled trees the target's
distribution.
"""

import dataclasses
import itertools
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import tiny_checkpoints as tc
from oracle_drafter import OracleDrafter, TreeOracle
from table_timed import table_timed
from test_sampling import chi_square_p
from tree_libraries import LIBRARIES

import mlx_glimmer
from mlx_glimmer.block_policy import TREE_WIDTHS, width_policy
from mlx_glimmer.cache import WindowedKVCache
from mlx_glimmer.drafters.base import Drafter, Marginals
from mlx_glimmer.generate import encode_prompt
from mlx_glimmer.noise import Noise
from mlx_glimmer.sampling import probabilities
from mlx_glimmer.settings import GenerationSettings, SamplingParams
from mlx_glimmer.speculative import generate_steps
from mlx_glimmer.tree import CHAIN, LOOKUP, MODEL, DraftTree, read_path
from mlx_glimmer.verify_cost import VerifyCost

PROMPT = [256] + list(b"Once upon a time, far past the window")  # 38 tokens: several windows of 8
N_TOKENS = 150  # the prompt and these run over 20 windows of 8
WINDOW6_TOKENS = 300  # trees of 31 nodes on a window of 6: 50 windows past it
BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SAMPLED = SamplingParams(temperature=0.8, top_k=5)
MLX = LIBRARIES["mlx"]  # the library of the MLX targets below


def tokens_of(steps):
    return [t for s in steps for t in s.tokens]


@pytest.fixture(params=sorted(LIBRARIES))
def lib(request):
    return LIBRARIES[request.param]


def random_tree(lib, seed: int, size: int, vocab: int = 272, most: int = 3) -> DraftTree:
    """A bushy tree of `size` nodes: 1 to `most` nodes a depth, each under a random node of the depth above."""
    rng = np.random.default_rng(seed)
    parents, previous = [], [0]
    while len(parents) < size:
        level = []
        for _ in range(min(int(rng.integers(1, most + 1)), size - len(parents))):
            parents.append(int(rng.choice(previous)))
            level.append(len(parents))
        previous = level
    return lib.handmade_tree(parents, rng.integers(0, vocab, size).tolist())


def path_to(tree: DraftTree, node: int) -> list[int]:
    """[0, ..., node]: the positions from the anchor down to `node`."""
    parents = [0] + tree.parents.tolist()
    path = [node]
    while path[-1]:
        path.append(parents[path[-1]])
    return path[::-1]


def prefix_of(tokens: list[int], parents: list[int], node: int) -> tuple[int, ...]:
    """The tokens from the anchor's first child down to `node` (1-based)."""
    out = []
    while node:
        out.append(tokens[node - 1])
        node = parents[node - 1]
    return tuple(out[::-1])


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return (x - np.log(np.exp(x).sum(-1, keepdims=True))).astype(np.float32)


# --- best-first construction -------------------------------------------------------------------------------------


def best_prefixes(log_probs: np.ndarray, budget: int) -> set[tuple[int, ...]]:
    """By brute force: the `budget` highest-scoring prefixes (a prefix scores the sum of its log-probabilities)."""
    depth, vocab = log_probs.shape
    scores = {
        p: float(sum(log_probs[i, t] for i, t in enumerate(p)))
        for d in range(1, depth + 1)
        for p in itertools.product(range(vocab), repeat=d)
    }
    return set(sorted(scores, key=scores.__getitem__, reverse=True)[:budget])


def check_tree_shape(tokens: list[int], parents: list[int], depths: list[int]) -> None:
    """Parents first, depth never decreasing, every node one deeper than its parent."""
    for i, (p, d) in enumerate(zip(parents, depths), start=1):
        assert 0 <= p < i, f"node {i}'s parent {p} does not come before it"
        assert d == (depths[p - 1] if p else 0) + 1, f"node {i} at depth {d} under a node at another depth"
    assert depths == sorted(depths), "depth decreases along the index"


@pytest.mark.parametrize("vocab_size, depth", [(7, 3), (5, 4)])
def test_best_first_holds_exactly_the_budget_best_prefixes(lib, vocab_size, depth):
    rng = np.random.default_rng(vocab_size)
    log_probs = log_softmax(rng.standard_normal((depth, vocab_size)) * 1.5)
    for budget in range(1, vocab_size + 1):
        tokens, parents, depths = (a.tolist() for a in lib.trees.best_first(lib.floats(log_probs), budget))
        assert len(tokens) == len(parents) == len(depths) == budget
        check_tree_shape(tokens, parents, depths)
        got = [prefix_of(tokens, parents, i) for i in range(1, budget + 1)]
        assert len(set(got)) == budget, "a prefix appears twice"
        assert set(got) == best_prefixes(log_probs, budget), budget


def test_best_first_with_a_budget_wider_than_the_vocabulary(lib):
    log_probs = log_softmax(np.random.default_rng(4).standard_normal((3, 4)) * 1.5)
    for budget in range(5, 20):
        tokens, parents, _ = (a.tolist() for a in lib.trees.best_first(lib.floats(log_probs), budget))
        got = {prefix_of(tokens, parents, i) for i in range(1, len(tokens) + 1)}
        assert got == best_prefixes(log_probs, budget), budget


def test_best_first_maps_columns_through_the_drafters_vocabulary_and_survives_a_certain_token(lib):
    rng = np.random.default_rng(2)
    log_probs = log_softmax(rng.standard_normal((4, 6)) * 2)
    vocab = np.array([100, 7, 55, 3, 200, 9], dtype=np.int32)
    plain = [a.tolist() for a in lib.trees.best_first(lib.floats(log_probs), 6)]
    mapped = [a.tolist() for a in lib.trees.best_first(lib.floats(log_probs), 6, lib.ints(vocab))]
    assert mapped[0] == vocab[plain[0]].tolist() and mapped[1:] == plain[1:]

    # A position the drafter is sure of (log-probability 0) still puts every child strictly below its parent.
    sure = np.full((5, 8), -20.0, np.float32)
    sure[:, 3] = 0.0
    sure[1, 5] = -0.5
    tokens, parents, depths = (a.tolist() for a in lib.trees.best_first(lib.floats(sure), 7))
    check_tree_shape(tokens, parents, depths)
    assert {prefix_of(tokens, parents, i) for i in range(1, 8)} == {
        (3,),
        (3, 3),
        (3, 3, 3),
        (3, 3, 3, 3),
        (3, 3, 3, 3, 3),
        (3, 5),
        (3, 5, 3),
    }


def test_model_tree_is_the_best_first_tree_with_its_ancestors(lib):
    log_probs = log_softmax(np.random.default_rng(3).standard_normal((5, 30)) * 2)
    tree = lib.trees.model_tree(lib.floats(log_probs), 12)
    assert tree.size == 12 and not tree.chain and tree.max_depth == 5
    sources, tokens, parents = tree.sources.tolist(), tree.tokens.tolist(), tree.parents.tolist()
    assert {s & ~CHAIN for s in sources} == {MODEL}
    # CHAIN marks the drafter's greedy chain: the argmax prefix of every depth the tree reaches
    greedy = tuple(log_probs.argmax(-1).tolist())
    marked = [prefix_of(tokens, parents, i) for i in range(1, 13) if sources[i - 1] & CHAIN]
    assert marked == [greedy[:d] for d in range(1, max(tree.depths.tolist()) + 1)]
    ancestors = np.array(tree.ancestors.tolist())
    for node in range(13):
        assert np.flatnonzero(ancestors[node]).tolist() == path_to(tree, node)


# --- merging the lookup branch ------------------------------------------------------------------------------------


def peaked(rows: list[dict[int, float]], vocab: int = 50) -> np.ndarray:
    """Log-probabilities [D, vocab]: each row's listed tokens get the listed logits, the rest -8."""
    logits = np.full((len(rows), vocab), -8.0, np.float32)
    for r, row in enumerate(rows):
        for t, v in row.items():
            logits[r, t] = v
    return log_softmax(logits)


def test_merged_tree_adds_the_lookup_branch_and_merges_what_the_model_already_has(lib):
    # The model's best prefixes: 10, 10-11, 10-11-12, 20 (a second guess at position 1), 10-21, ...
    log_probs = peaked([{10: 5.0, 20: 4.0}, {11: 5.0, 21: 4.0}, {12: 5.0, 22: 4.0}])
    model = lib.trees.model_tree(lib.floats(log_probs), 6)
    model_prefixes = [prefix_of(model.tokens.tolist(), model.parents.tolist(), i) for i in range(1, 7)]

    merged = lib.trees.merged_tree(
        lib.floats(log_probs), 9, [10, 11, 30]
    )  # the lookup repeats 10-11, then goes its own way
    assert merged.size == 9 and merged.max_depth == 3
    tokens, parents, sources = merged.tokens.tolist(), merged.parents.tolist(), merged.sources.tolist()
    assert [prefix_of(tokens, parents, i) for i in range(1, 7)] == model_prefixes  # the model's nodes come first
    node_10, node_11 = model_prefixes.index((10,)) + 1, model_prefixes.index((10, 11)) + 1
    chain = [prefix_of(tokens, parents, i) for i in range(1, 10) if sources[i - 1] & CHAIN]
    assert chain == [(10,), (10, 11), (10, 11, 12)]  # the model's greedy chain, merged nodes included
    sources = [s & ~CHAIN for s in sources]
    both = MODEL | LOOKUP
    assert sources[node_10 - 1] == sources[node_11 - 1] == both
    assert all(sources[i - 1] == MODEL for i in range(1, 7) if i not in (node_10, node_11))
    # The branch continues under the merged node: 30 hangs from the model's 10-11.
    assert tokens[6:] == [10, 11, 30] and sources[6:] == [LOOKUP] * 3
    assert parents[8] == node_11 and prefix_of(tokens, parents, 9) == (10, 11, 30)
    # The merged lookup nodes stay as duplicate leaves of the same prefixes (the verify width is fixed).
    assert prefix_of(tokens, parents, 7) == (10,) and prefix_of(tokens, parents, 8) == (10, 11)
    assert 7 not in parents and 8 not in parents
    assert all(p < i for i, p in enumerate(parents, 1))
    assert np.flatnonzero(np.array(merged.ancestors.tolist())[9]).tolist() == [0, node_10, node_11, 9]

    # A lookup that the model does not predict is a branch of its own from the anchor.
    apart = lib.trees.merged_tree(lib.floats(log_probs), 8, [40, 41])
    tokens, parents, sources = apart.tokens.tolist(), apart.parents.tolist(), apart.sources.tolist()
    sources = [s & ~CHAIN for s in sources]
    assert apart.size == 8 and tokens[6:] == [40, 41] and parents[6:] == [0, 7]
    assert sources == [MODEL] * 6 + [LOOKUP] * 2
    assert apart.max_depth == 3 and apart.depths.tolist()[7:] == [1, 2]

    # The lookup deeper than the drafter: the tree's depth follows it.
    deep = lib.trees.merged_tree(lib.floats(log_probs), 10, [49, 48, 47, 46, 45])
    assert deep.size == 10 and deep.max_depth == 5


def test_merged_tree_maps_the_model_through_its_vocabulary_before_merging(lib):
    log_probs = peaked([{1: 5.0, 2: 4.0}, {3: 5.0}], vocab=6)
    vocab = lib.ints([900, 901, 902, 903, 904, 905])
    merged = lib.trees.merged_tree(lib.floats(log_probs), 5, [901, 903], vocab)  # target ids: the model's columns 1, 3
    tokens, parents, sources = merged.tokens.tolist(), merged.parents.tolist(), merged.sources.tolist()
    sources = [s & ~CHAIN for s in sources]
    prefixes = [prefix_of(tokens, parents, i) for i in range(1, 6)]
    assert set(prefixes[:3]) == {(901,), (901, 903), (902,)} and prefixes[3:] == [(901,), (901, 903)]
    both = MODEL | LOOKUP
    assert sources == [both if p != (902,) else MODEL for p in prefixes[:3]] + [LOOKUP] * 2


def test_lookup_only_without_marginals_or_budget(lib):
    only = lib.trees.merged_tree(None, 6, [5, 6, 7])
    assert only.chain and only.size == 3 and only.tokens.tolist() == [5, 6, 7]
    assert only.parents.tolist() == [0, 1, 2] and only.sources.tolist() == [LOOKUP] * 3
    capped = lib.trees.merged_tree(None, 2, [5, 6, 7])
    assert capped.tokens.tolist() == [5, 6] and capped.chain
    no_room = lib.trees.merged_tree(
        lib.floats(peaked([{1: 5.0}, {2: 5.0}])), 3, [5, 6, 7]
    )  # the lookup fills the budget
    assert no_room.chain and no_room.tokens.tolist() == [5, 6, 7]
    model_only = lib.trees.merged_tree(lib.floats(peaked([{1: 5.0}, {2: 5.0}])), 3, [])
    assert not model_only.chain and model_only.size == 3
    assert model_only.sources.tolist() == [MODEL | CHAIN, MODEL, MODEL | CHAIN]  # by depth: a second guess at 1
    chain = lib.trees.chain(lib.tokens([4, 5, 6]))
    assert chain.chain and chain.parents.tolist() == [0, 1, 2] and chain.depths.tolist() == [0, 1, 2, 3]


# --- one module, every library ------------------------------------------------------------------------------------


def test_every_library_builds_the_same_trees_masks_and_greedy_verdicts():
    mlx, torch_lib = LIBRARIES["mlx"], LIBRARIES["torch"]
    rng = np.random.default_rng(0)
    log_probs = log_softmax(rng.standard_normal((6, 40)) * 3)
    vocab = np.arange(100, 140)
    for budget, lookup, mapped in ((9, [], False), (12, [7, 3, 9], False), (63, [101, 102], True), (4, [5] * 6, False)):
        trees = [
            lib.trees.merged_tree(lib.floats(log_probs), budget, lookup, lib.ints(vocab) if mapped else None)
            for lib in (mlx, torch_lib)
        ]
        for field in ("tokens", "parents", "depths", "sources", "ancestors"):
            assert [getattr(t, field).tolist() for t in trees] == [getattr(trees[1], field).tolist()] * 2
        assert trees[0].max_depth == trees[1].max_depth and trees[0].chain == trees[1].chain
        for before, window in ((0, None), (5, None), (3, 4), (20, 8)):
            masks = [lib.trees.attention_mask(t, before, window).tolist() for lib, t in zip((mlx, torch_lib), trees)]
            assert masks[0] == masks[1]
        logits = rng.standard_normal((trees[0].size + 1, 300)).astype(np.float32)
        logits[1:, trees[1].tokens.tolist()] += 5.0  # some nodes agree with their parent's choice
        verdicts = [lib.trees.verdict(t, lib.floats(logits), GREEDY, None) for lib, t in zip((mlx, torch_lib), trees)]
        assert verdicts[0].tolist() == verdicts[1].tolist()
        path = read_path(verdicts[1].tolist(), trees[1].size)
        assert path.positions == path_to(trees[1], path.positions[-1])
        tables = [
            lib.trees.round_logprobs(lib.floats(logits), t, v, 3)
            for lib, t, v in zip((mlx, torch_lib), trees, verdicts)
        ]
        floats = [
            np.array(table.tolist(), np.int32)[: trees[0].size + 1 + 3 * (trees[0].size + 1)].view(np.float32)
            for table in tables
        ]
        np.testing.assert_allclose(floats[0], floats[1], atol=1e-5)


# --- the mask and the cache ----------------------------------------------------------------------------------------


CONTEXT = PROMPT * 2  # 76 tokens: past the window and past what a windowed cache of reserve 32 retains


def prefilled(target, tokens: list[int], reserve: int = 32) -> list:
    cache = target.make_cache(reserve)
    hidden, _ = target.forward(target.tokens(tokens), cache, capture=False)
    mx.eval(hidden)
    return cache


def last_logits(target, tokens: list[int], cache) -> np.ndarray:
    hidden, _ = target.forward(target.tokens(tokens), cache, capture=False)
    return np.array(target.head(hidden[-1]).astype(mx.float32))


def tree_verify(target, cache, anchor: int, tree: DraftTree) -> np.ndarray:
    hidden, _ = target.forward(target.join(target.tokens([anchor]), tree.tokens), cache, capture=False, tree=tree)
    return np.array(target.head(hidden).astype(mx.float32))


@pytest.fixture(params=["muse", "llama"])
def target(request):
    pair = request.getfixturevalue(f"{request.param}_pair")
    return pair.target


def test_a_tree_verify_gives_every_node_the_logits_of_its_path_as_a_chain(target):
    tree = random_tree(MLX, 0, 31)
    assert tree.max_depth > 8  # deeper than Muse's window of 8
    prefix, anchor = CONTEXT[:-1], CONTEXT[-1]
    cache = prefilled(target, prefix)
    logits = tree_verify(target, cache, anchor, tree)
    assert max(c.offset for c in cache) == len(prefix) + tree.size + 1
    tokens = [anchor] + tree.tokens.tolist()
    for node in range(tree.size + 1):
        chain = [tokens[i] for i in path_to(tree, node)]
        np.testing.assert_allclose(
            logits[node], last_logits(target, chain, prefilled(target, prefix)), atol=1e-4, rtol=1e-4, err_msg=node
        )


def cache_arrays(cache) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """Each layer's position and the keys and values its next query can read."""
    out = []
    for c in cache:
        keys, values = (
            c.state if isinstance(c, WindowedKVCache) else (c.keys[..., : c.offset, :], c.values[..., : c.offset, :])
        )
        out.append((c.offset, np.array(keys), np.array(values)))
    return out


def test_keeping_a_side_branch_leaves_the_cache_the_chain_leaves(target):
    tree = random_tree(MLX, 1, 31)
    prefix, anchor = CONTEXT[:-1], CONTEXT[-1]
    deepest = [n for n in range(tree.size + 1) if int(tree.depths[n]) == tree.max_depth]
    # A deep path that is not a prefix of the verify: its rows move down in the cache.
    path = next(p for p in (path_to(tree, n) for n in reversed(deepest)) if p != list(range(len(p))))
    assert len(path) > 9  # more than a window of 8 kept at once
    tokens = [anchor] + tree.tokens.tolist()
    chain = [tokens[i] for i in path]

    cache = prefilled(target, prefix)
    tree_verify(target, cache, anchor, tree)
    target.keep(cache, path, tree.size + 1)
    reference = prefilled(target, prefix)
    last_logits(target, chain, reference)
    for (ours_at, ours_k, ours_v), (ref_at, ref_k, ref_v) in zip(cache_arrays(cache), cache_arrays(reference)):
        assert ours_at == ref_at == len(prefix) + len(path)
        assert ours_k.shape == ref_k.shape
        np.testing.assert_allclose(ours_k, ref_k, atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(ours_v, ref_v, atol=1e-4, rtol=1e-4)
    for token in (3, 77, 150, 9, 200, 41, 12, 8, 99, 5, 61, 130):  # decoding goes on past another window
        np.testing.assert_allclose(
            last_logits(target, [token], cache), last_logits(target, [token], reference), atol=1e-4, rtol=1e-4
        )
    # A second tree round on the compacted cache agrees with one on the chain's.
    again = random_tree(MLX, 2, 15)
    np.testing.assert_allclose(
        tree_verify(target, cache, 17, again), tree_verify(target, reference, 17, again), atol=1e-4, rtol=1e-4
    )


def test_keeping_a_prefix_of_the_verify_is_a_trim(muse_pair):
    target = muse_pair.target
    tree = random_tree(MLX, 3, 12)
    cache = prefilled(target, PROMPT[:-1])
    tree_verify(target, cache, PROMPT[-1], tree)
    target.keep(cache, [0, 1], tree.size + 1)  # the anchor and its first child: positions 0, 1 stay put
    reference = prefilled(target, PROMPT[:-1])
    last_logits(target, [PROMPT[-1], tree.tokens.tolist()[0]], reference)
    for (ours_at, ours_k, _), (ref_at, ref_k, _) in zip(cache_arrays(cache), cache_arrays(reference)):
        assert ours_at == ref_at and ours_k.shape == ref_k.shape
        np.testing.assert_allclose(ours_k, ref_k, atol=1e-4, rtol=1e-4)


# --- the verdict ---------------------------------------------------------------------------------------------------

GREEDY = SamplingParams()


def walk(tree: DraftTree, chosen: list[int]) -> int:
    """By hand: the deepest node whose every token on its path is its parent's choice (lowest index first)."""
    tokens, parents, depths = tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()
    accepted = [True]
    for i in range(1, tree.size + 1):
        accepted.append(accepted[parents[i - 1]] and tokens[i - 1] == chosen[parents[i - 1]])
    return max((i for i in range(tree.size + 1) if accepted[i]), key=lambda i: (depths[i], -i))


def test_the_greedy_verdict_takes_the_deepest_path_of_argmaxes(lib):
    vocab = 12
    for seed in range(20):
        rng = np.random.default_rng(seed)
        tree = random_tree(lib, seed, int(rng.integers(1, 32)), vocab=vocab)
        logits = rng.standard_normal((tree.size + 1, vocab)).astype(np.float32)
        argmax = logits.argmax(-1)
        # Make about two thirds of the nodes their parent's argmax, so long paths exist.
        tokens = tree.tokens.tolist()
        for i, p in enumerate(tree.parents.tolist()):
            if rng.random() < 0.65:
                tokens[i] = int(argmax[p])
        tree = dataclasses.replace(tree, tokens=lib.tokens(tokens))
        best = walk(tree, argmax.tolist())
        values = lib.trees.verdict(tree, lib.floats(logits), GREEDY, None).tolist()
        path = read_path(values, tree.size)
        assert path.positions == path_to(tree, best) and path.depth == int(tree.depths[best])
        assert path.next_token == argmax[best]
        assert values[0] == path.depth and len(values) == 2 + (tree.size + 1) + tree.size


def test_the_greedy_verdict_reads_who_proposed_the_path(lib):
    # anchor -> 5 (model) -> 6 (both) ; 5' (a lookup duplicate of 5, a leaf)
    tree = lib.handmade_tree([0, 1, 0], [5, 6, 5], [MODEL, MODEL | LOOKUP, LOOKUP])
    logits = np.zeros((4, 10), np.float32)
    logits[0, 5] = logits[1, 6] = logits[3, 6] = logits[2, 9] = 1.0
    path = read_path(lib.trees.verdict(tree, lib.floats(logits), GREEDY, None).tolist(), tree.size)
    assert path.positions == [0, 1, 2] and path.next_token == 9
    assert path.sources == [MODEL, MODEL | LOOKUP]
    logits[1, 6], logits[1, 7] = 0.0, 1.0  # 6 rejected: two paths of depth 1, the lower index wins
    path = read_path(lib.trees.verdict(tree, lib.floats(logits), GREEDY, None).tolist(), tree.size)
    assert path.positions == [0, 1] and path.next_token == 7
    logits[0, 5], logits[0, 4] = 0.0, 1.0  # nothing kept: the anchor's choice is the next token
    path = read_path(lib.trees.verdict(tree, lib.floats(logits), GREEDY, None).tolist(), tree.size)
    assert path.positions == [0] and path.next_token == 4 and path.sources == []


def test_a_tree_path_says_how_far_the_drafters_chain_would_have_been_kept(lib):
    """The chain is the model's first node at each depth; the target's choices along it do not depend on the
    rest of the tree, so the path's leading CHAIN nodes are what the chain alone would have had kept."""
    log_probs = peaked([{10: 5.0, 20: 4.0}, {11: 5.0, 21: 4.0}, {12: 5.0, 22: 4.0}])
    tree = lib.trees.merged_tree(lib.floats(log_probs), 8, [10, 11, 30])  # 5 model nodes, then the branch
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    node = {prefix_of(tokens, parents, i): i for i in range(tree.size, 0, -1)}  # the first node of each prefix

    def path_for(*target: int):
        """The path when the target decodes `target` after the anchor (and token 0 after that)."""
        logits = np.zeros((tree.size + 1, 50), np.float32)
        logits[:, 0] = 0.5
        logits[0, target[0]] = 1.0
        for d in range(1, len(target)):
            if (at := node.get(tuple(target[:d]))) is not None:
                logits[at, target[d]] = 1.0
        return read_path(lib.trees.verdict(tree, lib.floats(logits), GREEDY, None).tolist(), tree.size)

    along = path_for(10, 11, 12)
    assert along.depth == 3 and along.chain_kept == 3 and along.chain_depth == 3
    assert path_for(10, 11, 30).chain_kept == 2  # the lookup's branch goes on where the chain is rejected
    assert path_for(20, 5).chain_kept == 0 and path_for(20, 5).depth == 1  # the drafter's second guess
    chain = read_path(lib.trees.chain_verdict(lib.trees.chain(lib.tokens([4, 5])), lib.ints([2, 9])).tolist(), 2)
    assert chain.chain_depth == 0  # a chain round is the chain itself: nothing to add


def test_the_chain_verdict_is_rejection_samplings_in_the_trees_form(lib):
    chain = lib.trees.chain(lib.tokens([4, 5, 6]), LOOKUP)
    values = lib.trees.chain_verdict(chain, lib.ints([2, 9])).tolist()
    assert values == [2, 9, 1, 1, 1, 0] + [LOOKUP] * 3
    path = read_path(values, chain.size)
    assert path.positions == [0, 1, 2] and path.next_token == 9 and path.depth == 2


def test_sampled_choices_share_noise_by_depth_so_duplicates_agree(lib):
    # anchor -> 3 -> 4 ; 3' (duplicate of 3) -> 4' ; 7 -> 1: rows of equal paths get equal logits
    tree = lib.handmade_tree([0, 1, 0, 3, 0, 5], [3, 4, 3, 4, 7, 1])
    rng = np.random.default_rng(0)
    rows = {(): 0, (3,): 1, (3, 4): 2, (7,): 3, (7, 1): 4}
    table = rng.standard_normal((5, 16)).astype(np.float32) * 2
    paths = [(), (3,), (3, 4), (3,), (3, 4), (7,), (7, 1)]
    logits = lib.floats(table[[rows[p] for p in paths]])
    without = lib.handmade_tree([0, 1, 0, 3], [3, 4, 7, 1])  # the same tree, duplicates removed, same depth
    without_logits = lib.floats(table[[rows[p] for p in [(), (3,), (3, 4), (7,), (7, 1)]]])
    for seed in range(200):
        chosen = lib.trees.choices(logits, tree, SAMPLED, Noise(seed, 40)).tolist()
        assert chosen[1] == chosen[3] and chosen[2] == chosen[4]  # duplicates draw the same sample
        ours = lib.trees.verdict(tree, logits, SAMPLED, Noise(seed, 40)).tolist()
        theirs = lib.trees.verdict(without, without_logits, SAMPLED, Noise(seed, 40)).tolist()
        assert ours[:2] == theirs[:2], "a duplicate changed the outcome"


def test_a_sampled_tree_round_commits_tokens_of_the_targets_filtered_distribution(lib):
    """The committed tokens of one tree round anchored at many positions (one seed): the first follows the target's filtered
    distribution at the anchor, and the next one, given the first, its distribution after it (duplicates and
    side branches included)."""
    vocab = 8
    rng = np.random.default_rng(7)
    table = {}

    def logits_after(prefix: tuple) -> np.ndarray:  # the "target": fixed random logits per prefix
        if prefix not in table:
            table[prefix] = rng.standard_normal(vocab).astype(np.float32)
            table[prefix][[p[-1] for p in paths if p[:-1] == prefix and p]] += 1.5  # the tree's tokens: likely
        return table[prefix]

    # depth 1: 0, 1, 2 and a duplicate of 0; depth 2: 0-0, 0-1, 0-3, 1-4, and 0-1 under the duplicate too;
    # depth 3: 0-0-1, 0-1-2.
    tree = lib.handmade_tree(
        [0, 0, 0, 0, 1, 1, 1, 2, 4, 5, 6],
        [0, 1, 2, 0, 0, 1, 3, 4, 1, 1, 2],
        [1, 1, 1, 2, 1, 3, 1, 1, 2, 1, 1],
    )
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    paths = [()] + [prefix_of(tokens, parents, i) for i in range(1, tree.size + 1)]
    logits = lib.floats(np.stack([logits_after(p) for p in paths]))
    params = SamplingParams(temperature=0.9, top_k=6)

    def filtered(prefix):
        return np.array(probabilities(mx.array(logits_after(prefix)), params), dtype=np.float64)

    rounds = 4000
    verdicts = [lib.trees.verdict(tree, logits, params, Noise(11, start)) for start in range(rounds)]
    committed = []
    for start in range(0, rounds, 500):
        chunk = verdicts[start : start + 500]
        lib.eval(chunk)
        for values in chunk:
            path = read_path(values.tolist(), tree.size)
            committed.append([tokens[i - 1] for i in path.positions[1:]] + [path.next_token])
    first = [c[0] for c in committed]
    assert chi_square_p(first, filtered(())) > 1e-3
    for t1 in (0, 1):
        second = [c[1] for c in committed if c[0] == t1]
        assert len(second) > 200
        assert chi_square_p(second, filtered((t1,))) > 1e-3, t1
    third = [c[2] for c in committed if c[:2] == [0, 1]]
    assert len(third) > 100 and chi_square_p(third, filtered((0, 1))) > 1e-3
    assert max(len(c) for c in committed) == 4  # full depth reached
    assert any(c[0] == 2 and len(c) == 2 for c in committed)  # a leaf at depth 1


# --- end to end ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain(muse_pair):
    return tokens_of(generate_steps(muse_pair.target, PROMPT, GenerationSettings(max_tokens=N_TOKENS)))


def side_branches(steps, wrong: set[int]) -> int:
    """Rounds whose accepted path kept a draft at a `wrong` index: the drafter's second choice, a side branch."""
    count, generated = 0, 1
    for s in steps[1:]:
        count += any(i in wrong for i in range(generated, generated + len(s.tokens) - 1))
        generated += len(s.tokens)
    return count


@pytest.fixture(scope="module")
def window6_pair(tmp_path_factory):
    """A Muse target with a window of 6, its own drafter."""
    root = tmp_path_factory.mktemp("tree_w6")
    tc.build_muse_target(root / "t", sliding_window=6, seed=3)
    tc.build_assistant(root / "d", target_layer_ids=[1, 3, 5], seed=4)
    return mlx_glimmer.load(target=root / "t", drafter=root / "d")


@pytest.fixture(scope="module")
def window6_plain(window6_pair):
    return tokens_of(generate_steps(window6_pair.target, PROMPT, GenerationSettings(max_tokens=WINDOW6_TOKENS)))


@pytest.mark.parametrize("window, nodes", [(8, 3), (6, 31)])
def test_greedy_trees_equal_plain_greedy(request, window, nodes):
    pair = request.getfixturevalue("muse_pair" if window == 8 else "window6_pair")
    plain = request.getfixturevalue("plain" if window == 8 else "window6_plain")
    target, count = pair.target, N_TOKENS if window == 8 else WINDOW6_TOKENS
    assert target.model.args.sliding_window == window
    settings = GenerationSettings(max_tokens=count, tree=nodes)
    steps = list(generate_steps(target, PROMPT, settings, drafter=pair.drafter))
    assert tokens_of(steps) == plain
    assert all(s.tree and s.drafted <= nodes for s in steps[1:-1])

    wrong = {i for i in range(count) if i % 7 == 3}
    oracle = TreeOracle(len(PROMPT), plain, wrong, target.vocab_size)
    steps = list(generate_steps(target, PROMPT, settings, drafter=oracle))
    assert tokens_of(steps) == plain
    if nodes >= 15:
        assert np.mean([s.accepted for s in steps[1:]]) > 3  # long paths, past wrong first choices ...
        assert side_branches(steps, wrong) >= 2  # ... through the drafter's second choices
    else:
        assert side_branches(steps, wrong) > 0


def test_auto_trees_and_widths_equal_plain_greedy(muse_pair, plain):
    reference = mlx_glimmer.generate(muse_pair, PROMPT, max_tokens=N_TOKENS, speculative=False)  # stops at EOS
    assert reference.token_ids == plain[: len(reference.token_ids)]
    auto = mlx_glimmer.generate(muse_pair, PROMPT, max_tokens=N_TOKENS)  # block size and tree "auto"
    assert auto.token_ids == reference.token_ids and auto.stats.block_policy == "auto"
    wrong = {i for i in range(N_TOKENS) if i % 7 == 3}
    oracle = TreeOracle(len(PROMPT), plain, wrong, muse_pair.target.vocab_size)
    agreeing = mlx_glimmer.generate(dataclasses.replace(muse_pair, drafter=oracle), PROMPT, max_tokens=N_TOKENS)
    assert agreeing.token_ids == reference.token_ids
    # Timed by a flat cost table, not this machine's clock: a chain stops at every wrong index (6 tokens at most
    # a round), trees take the side branch there, and carry the rounds once the policy has seen both.
    flat = table_timed(width_policy(16, VerifyCost(32, [[1.0] * 32 for _ in range(4)]), tree_widths=TREE_WIDTHS))
    for _ in range(2):  # the second generation starts from what the first learnt
        oracle = TreeOracle(len(PROMPT), plain, wrong, muse_pair.target.vocab_size)
        settings = GenerationSettings(max_tokens=N_TOKENS)
        steps = list(generate_steps(muse_pair.target, PROMPT, settings, drafter=oracle, policy=flat))
        assert tokens_of(steps) == plain
    assert len(steps) < N_TOKENS / 4 and sum(s.tree for s in steps) > len(steps) / 2

    # A policy that prefers trees: each round a tree or a chain, as it chooses, and still plain greedy's tokens.
    policy = width_policy(16, VerifyCost(32, [[1.0] * 32 for _ in range(4)]), tree_widths=TREE_WIDTHS)
    steps = list(
        generate_steps(
            muse_pair.target, PROMPT, GenerationSettings(max_tokens=120), drafter=muse_pair.drafter, policy=policy
        )
    )
    assert tokens_of(steps) == plain[:120] and any(s.tree for s in steps)


def test_a_stop_token_inside_an_accepted_tree_path_stops_there(muse_pair, plain):
    stop = plain[40]
    first = plain.index(stop)
    oracle = TreeOracle(len(PROMPT), plain, {i for i in range(N_TOKENS) if i % 7 == 3}, muse_pair.target.vocab_size)
    for drafter in (oracle, muse_pair.drafter):
        settings = GenerationSettings(max_tokens=N_TOKENS, tree=15)
        got = tokens_of(generate_steps(muse_pair.target, PROMPT, settings, drafter=drafter, stop_ids=[stop]))
        assert got == plain[: first + 1]
    for max_tokens in (2, 17, 33):
        got = tokens_of(
            generate_steps(muse_pair.target, PROMPT, GenerationSettings(max_tokens=max_tokens, tree=31), drafter=oracle)
        )
        assert got == plain[:max_tokens]


def test_chain_drafters_ignore_the_tree_setting(muse_pair, plain):
    oracle = OracleDrafter(len(PROMPT), plain, {i for i in range(N_TOKENS) if i % 9 == 4}, muse_pair.target.vocab_size)
    steps = list(generate_steps(muse_pair.target, PROMPT, GenerationSettings(max_tokens=100, tree=15), drafter=oracle))
    assert tokens_of(steps) == plain[:100] and not any(s.tree for s in steps)


# --- sampling with trees -------------------------------------------------------------------------------------------

V = 32
SMALL_PROMPT = [1, 5, 9, 2, 7, 3, 11, 4, 6, 8]


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("tree_v32")
    tc.build_muse_target(root / "t", vocab_size=V, layers=4, weight_std=0.12, seed=5)
    tc.build_assistant(root / "d", layers=1, target_layer_ids=[0, 2], block_size=4, mask_token_id=V - 1, seed=6)
    return mlx_glimmer.load(target=root / "t", drafter=root / "d")


class CloseMarginals(Drafter):
    """Per-position marginals near the target's own: position 1 its filtered distribution after the context,
    each later one after the context and the most likely tokens before it, mixed with uniform."""

    kind = "close"
    block_size = 4
    has_marginals = True

    def __init__(self, target, params):
        self.target, self.params, self.history = target, params, []

    def reset(self):
        self.history = []

    def observe(self, tokens, features):
        self.history.extend(tokens)

    def propose(self, anchor, count, params, noise):
        raise AssertionError("tree rounds only")

    def marginals(self, anchor, count):
        seq, rows = self.history + [anchor], []
        for _ in range(count):
            p = probabilities(self.target.model(mx.array([seq]))[0, -1], self.params)
            rows.append(mx.log(0.7 * p + 0.3 / V))
            seq = seq + [int(mx.argmax(p).item())]
        return Marginals(mx.stack(rows))


def exact_marginals(target, params, prompt):
    """P(t1), P(t2), P(t3) of the target's filtered sampling after `prompt`, by enumerating every prefix."""

    def next_probs(prefixes):
        logits = target.model(mx.array([prompt + list(p) for p in prefixes]))[:, -1]
        return np.asarray(probabilities(logits, params), dtype=np.float64)

    p1 = next_probs([()])[0]
    p2_given = next_probs([(a,) for a in range(V)])
    p3_given = next_probs(list(itertools.product(range(V), repeat=2))).reshape(V, V, V)
    return p1, p1 @ p2_given, np.einsum("a,ab,abc->c", p1, p2_given, p3_given)


def test_sampled_tree_generation_is_reproducible(muse_pair):
    settings = GenerationSettings(SAMPLED, max_tokens=60, tree=15, seed=3)
    first = tokens_of(generate_steps(muse_pair.target, PROMPT, settings, drafter=muse_pair.drafter))
    again = tokens_of(generate_steps(muse_pair.target, PROMPT, settings, drafter=muse_pair.drafter))
    other = tokens_of(
        generate_steps(muse_pair.target, PROMPT, dataclasses.replace(settings, seed=4), drafter=muse_pair.drafter)
    )
    assert first == again and len(first) == 60 and other != first


RUNS = 220  # seeds per drafter


def test_sampled_trees_keep_the_targets_distribution(small_vocab_pair):
    target, params = small_vocab_pair.target, SamplingParams(temperature=0.7, top_p=0.9)
    expected = exact_marginals(target, params, SMALL_PROMPT)
    draws, depths = [], []
    drafters = (small_vocab_pair.drafter, CloseMarginals(target, params))  # random DFlash; a close drafter
    for run, drafter in enumerate(drafters):
        for seed in range(run * RUNS, run * RUNS + RUNS):
            steps = list(
                generate_steps(
                    target, SMALL_PROMPT, GenerationSettings(params, max_tokens=4, tree=7, seed=seed), drafter=drafter
                )
            )
            assert steps[1].tree
            depths.append(steps[1].accepted)
            draws.append(tokens_of(steps)[:3])
    draws = np.array(draws)
    assert depths.count(0) > 50 and depths.count(1) > 100 and depths.count(2) > 0  # every kind of round
    for position, probs in enumerate(expected):
        assert chi_square_p(draws[:, position], probs) > 1e-3, f"token {position + 1}"


def test_auto_verifies_the_lookups_continuation_alone_where_the_text_repeats(demo_pair):
    """Asked to continue a given list in its format, the demo target repeats long spans of its prompt: `auto`
    then verifies the n-gram continuation alone (no drafter call), and the output stays plain greedy's."""
    prompt = json.loads((BENCHMARKS / "prompts_copy_heavy.jsonl").read_text().splitlines()[6])["prompt"]
    ids = encode_prompt(demo_pair.tokenizer, prompt)
    reference = mlx_glimmer.generate(demo_pair, ids, max_tokens=48, speculative=False)
    # Every width costs the same (given, not timed): the lookup's chain, which needs no drafter call, pays
    # wherever it keeps as much as the drafter's shapes.
    policy = table_timed(width_policy(16, VerifyCost(32, [[1.0] * 32 for _ in range(4)]), tree_widths=TREE_WIDTHS))
    lookup_rounds = []
    for _ in range(3):  # the policy learns what the lookup keeps, as it does over a conversation
        steps = list(generate_steps(demo_pair.target, ids, GenerationSettings(max_tokens=48),
                                    drafter=demo_pair.drafter, policy=policy))  # fmt: skip
        assert tokens_of(steps)[: len(reference.token_ids)] == reference.token_ids
        lookup_rounds += [s for s in steps[1:] if s.drafted and not s.tree and s.source == "lookup"]
    assert len(lookup_rounds) >= 2 and sum(s.accepted for s in lookup_rounds) >= 16
