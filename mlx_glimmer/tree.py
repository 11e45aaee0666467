"""Draft trees: built, merged, masked and judged on the device, so a round still reads the host once.

Written once for every array library: `Trees` holds one library's primitives (`array_ops.ArrayOps`) and
filtered distributions (its `sampling.probabilities`); `mlx_trees` is MLX's, a `TorchTarget` builds torch's.

One flat form for every draft (`DraftTree`): index 0 is the anchor, nodes 1..N follow with their token, the
index of their parent (0: the anchor) and their depth; parents come before children (in the model's part by
depth; the n-gram branch follows it). A chain is the tree whose parents are 0, 1, 2, ...

Best-first construction (DDTree). A block drafter gives, from one forward, a log-probability per draft
position; a prefix of depth d scores the sum of its tokens' log-probabilities, so a prefix never scores
below one of its extensions, and the N best prefixes form a tree. They are found without a host read by a
beam of width N over the depths: each depth keeps its N best prefixes (the N best overall are among them,
as no prefix outside a depth's N best can have an extension inside them), the global N best of those are
the tree, and the beam's back-pointers give the parents. Log-probabilities are capped just below zero (a NaN
reads as -inf) so a child never scores above its parent, and ties go to the shallower prefix: the chosen
set is closed under parents whatever the rounding, and with -inf scores too.

The verdict (`verdict`) walks the tree the way the target decodes: at every node the target's own choice
(its argmax, or its sample of the token at that node's position, anchor + depth + 1, `noise.py`), and a node
is accepted when its token is its parent's choice and its parent is accepted; the deepest accepted node ends
the path and its choice is the next token. Every committed token is then the very token plain decoding draws
at its position with the same seed, so a sampled generation's text is the same whatever the drafts, the
widths or the tree shapes; nodes of equal depth share their noise, so a merged duplicate never changes the
outcome (docs/design.md, "Sampling").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from . import sampling
from .array_ops import MLX_OPS, Array, ArrayOps
from .noise import Noise, gumbel
from .settings import SamplingParams

# Node sources, as bits: a node both proposed is MODEL | LOOKUP. CHAIN marks the model's first node at each depth,
# the best prefix there: the drafter's greedy chain (its positions' argmaxes), so a tree round also says how far
# that chain alone would have been kept.
MODEL, LOOKUP, CHAIN = 1, 2, 4
SOURCE_NAMES = {MODEL: "model", LOOKUP: "lookup", MODEL | LOOKUP: "both"}


_TOP = -1e-3  # log-probabilities are capped here, so a child scores strictly below its parent
_INF = float("inf")


def source_name(source: int) -> str:
    """Who proposed a node, by its source bits (`SOURCE_NAMES`; CHAIN says nothing of who)."""
    return SOURCE_NAMES.get(source & (MODEL | LOOKUP), "")


@dataclass
class DraftTree:
    """A draft on the device. `tokens` [N] (`ArrayOps.token`), `parents` [N] (indices into [anchor, nodes]),
    `depths` [N + 1] (the anchor's 0 first), `sources` [N] (MODEL / LOOKUP bits), all three `ArrayOps.index`;
    `ancestors` [N + 1, N + 1] bool (row i: i and its ancestors). `max_depth` bounds `depths` on the host;
    `chain` says the parents are 0, 1, 2, ... (its verify needs no tree mask)."""

    tokens: Array
    parents: Array
    depths: Array
    sources: Array
    ancestors: Array
    max_depth: int
    chain: bool = False

    @property
    def size(self) -> int:
        """Nodes under the anchor."""
        return int(self.tokens.shape[0])


@dataclass(frozen=True)
class Trees:
    """The draft-tree operations (`target_model.TreeOps`) on one array library: its primitives `ops` and its
    filtered distributions `probabilities` (`sampling.probabilities`)."""

    ops: ArrayOps
    probabilities: Callable[[Array, SamplingParams], Array]

    def ancestor_matrix(self, parents: Array, max_depth: int) -> Array:
        """[N + 1, N + 1] bool: row i marks i and every ancestor of i (the anchor, 0, is everyone's). By pointer
        jumping: rows that mark the ancestors up to `reach` levels up, and each node's ancestor `reach` levels
        up (the anchor above the root), double their reach each step, so a tree `max_depth` deep takes
        log2(max_depth) steps."""
        ops = self.ops
        n = parents.shape[0] + 1
        up = ops.concatenate([ops.full((1,), 0, ops.index), ops.astype(parents, ops.index)], 0)
        cols = ops.arange(0, n, 1, ops.index)[None, :]
        marks = (cols == ops.arange(0, n, 1, ops.index)[:, None]) | (cols == up[:, None])
        reach = 1
        while reach < max_depth:
            marks = marks | marks[up]
            up = up[up]
            reach *= 2
        return marks

    def _finish(self, tokens, parents, depths, sources, max_depth: int, chain: bool = False) -> DraftTree:
        ops = self.ops
        parents = ops.astype(parents, ops.index)
        return DraftTree(
            ops.astype(tokens, ops.token),
            parents,
            ops.concatenate([ops.full((1,), 0, ops.index), ops.astype(depths, ops.index)], 0),
            ops.astype(sources, ops.index),
            self.ancestor_matrix(parents, max_depth),
            max_depth,
            chain,
        )

    def chain(self, tokens: Array, source: int = MODEL) -> DraftTree:
        """The chain [anchor, t1, t2, ...] as a tree: each position's parent the one before, its ancestors
        those before it."""
        ops = self.ops
        n = tokens.shape[0]
        steps = ops.arange(0, n + 1, 1, ops.index)
        sources = ops.full((n,), source, ops.index)
        before = steps[None, :] <= steps[:, None]
        return DraftTree(ops.astype(tokens, ops.token), steps[:n], steps, sources, before, n, chain=True)

    def best_first(self, log_probs: Array, budget: int, vocab: Array | None = None) -> tuple[Array, Array, Array]:
        """The `budget` best prefixes over per-position log-probabilities [D, V] (rows: draft positions 1..D),
        as (tokens, parents, depths), parents first (by depth, then score). `vocab` maps column ids to token
        ids (a drafter's own vocabulary). Fewer when fewer prefixes exist (a vocabulary smaller than the
        budget). The beam's steps are a few hundred small operations, so a library that compiles
        (`ArrayOps.compile`) traces them once per budget and shape."""
        traced = _traced_best_first(self, budget)
        return traced(log_probs) if vocab is None else traced(log_probs, vocab)

    def _best_first(self, budget: int, log_probs: Array, vocab: Array | None = None) -> tuple[Array, Array, Array]:
        ops = self.ops
        depth_count, width = log_probs.shape
        top = min(budget, width)  # a prefix's children worth keeping: its position's `top` likeliest tokens
        budget = min(budget, sum(min(budget, top ** (d + 1)) for d in range(depth_count)))
        log_probs = ops.astype(log_probs, ops.float32)
        log_probs = ops.where(log_probs != log_probs, -_INF, log_probs)  # a NaN score (an fp16 head) is impossible
        vals, ids = ops.top_k(log_probs, top)  # best first
        vals = ops.where(vals > _TOP, _TOP, vals)
        ids = ops.astype(ids, ops.index)
        missing = budget - top if budget > top else 0  # the beam is `budget` wide; depth 1 has only `top` prefixes
        scores = [ops.concatenate([vals[0], ops.full((missing,), -_INF, ops.float32)], 0)]
        toks = [ops.concatenate([ids[0], ops.full((missing,), 0, ops.index)], 0)]
        backs = [ops.full((budget,), 0, ops.index)]
        for d in range(1, depth_count):
            candidates = (scores[-1][:, None] + vals[d][None, :]).reshape(-1)
            order = ops.astype(ops.argsort_descending(candidates)[:budget], ops.index)
            scores.append(candidates[order])
            toks.append(ids[d][order % top])
            backs.append(order // top)
        chosen = self._closed_best(ops.concatenate(scores, 0), budget)  # by depth, then beam rank: parents first
        node_depth = chosen // budget
        tokens = ops.concatenate(toks, 0)[chosen]
        index_of = ops.full((depth_count * budget,), 0, ops.index)
        index_of[chosen] = ops.arange(1, budget + 1, 1, ops.index)
        below = ops.where(node_depth > 0, node_depth - 1, 0)
        parent_slot = below * budget + ops.concatenate(backs, 0)[chosen]
        parents = ops.where(node_depth == 0, 0, index_of[parent_slot])
        if vocab is not None:
            tokens = ops.astype(vocab, ops.index)[tokens]
        return tokens, parents, node_depth + 1

    def _closed_best(self, scores: Array, budget: int) -> Array:
        """The indices of the `budget` best `scores`, ascending, ties taken in index order. A child never scores
        above its parent and comes after it (by depth), so the chosen set holds every chosen node's parent even
        when scores tie (-inf, or a sum that rounds to its parent's score)."""
        ops = self.ops
        cut = ops.sort(scores)[-budget]  # the budget-th best score
        above = scores > cut
        level = scores == cut
        take = above | (level & (ops.cumsum(ops.astype(level, ops.index)) <= budget - above.sum()))
        positions = ops.arange(0, scores.shape[0], 1, ops.index)
        return ops.sort(ops.where(take, positions, positions + scores.shape[0]))[:budget]

    def model_tree(self, log_probs: Array, budget: int, vocab: Array | None = None) -> DraftTree:
        """A best-first tree of `budget` nodes from one drafter forward's log-probabilities [D, V]."""
        tokens, parents, depths = self.best_first(log_probs, budget, vocab)
        return self._finish(tokens, parents, depths, self._model_sources(depths), log_probs.shape[0])

    def _model_sources(self, depths: Array) -> Array:
        """MODEL for every node of a best-first tree, with CHAIN on the first at each depth (nodes come by depth,
        then score: the first is the best prefix of its depth, the drafter's greedy chain)."""
        ops = self.ops
        first = ops.concatenate([ops.full((1,), True, ops.bool_), depths[1:] != depths[:-1]], 0)
        return ops.astype(ops.where(first, MODEL | CHAIN, MODEL), ops.index)

    def merged_tree(self, log_probs: Array | None, budget: int, lookup: list[int], vocab: Array | None = None):
        """A tree of `budget` nodes: the model's best `budget - len(lookup)` prefixes and the n-gram continuation
        `lookup` as a branch from the anchor. A lookup node equal to a model node (same parent, same token) is
        merged into it: the model node gains the LOOKUP source and the branch continues from it; the lookup
        node stays as a duplicate leaf (its verdict equals the model node's, see the module docstring), since
        the verify width is fixed before the tree is read."""
        ops = self.ops
        n_lookup = min(len(lookup), budget)
        if log_probs is None or budget - n_lookup < 1:
            return self.chain(ops.array(lookup[:budget], ops.token), LOOKUP)
        tokens, parents, depths = self.best_first(log_probs, budget - n_lookup, vocab)
        sources = self._model_sources(depths)
        if not n_lookup:
            return self._finish(tokens, parents, depths, sources, log_probs.shape[0])
        # The model nodes the branch runs through: each carries the lookup's token at its depth, and so does
        # every ancestor of it. Those are merged (LOOKUP joins their sources); the branch's node at depth k + 1
        # hangs under the one at depth k, or, past them, under the branch's node before it.
        n_model = tokens.shape[0]
        branch = ops.array(lookup[:n_lookup], ops.index)
        shallow = depths <= n_lookup
        fits = shallow & (tokens == branch[ops.where(shallow, depths - 1, 0)])
        through = ~(self.ancestor_matrix(parents, log_probs.shape[0])[1:, 1:] & ~fits[None, :]).any(-1)
        at = through[None, :] & (depths[None, :] == ops.arange(1, n_lookup + 1, 1, ops.index)[:, None])
        hit = ops.argmax(ops.astype(at, ops.index), -1) + 1
        below = ops.where(at.any(-1), hit, ops.arange(n_model + 1, n_model + n_lookup + 1, 1, ops.index))
        return self._finish(
            ops.concatenate([ops.astype(tokens, ops.token), ops.astype(branch, ops.token)], 0),
            ops.concatenate([parents, ops.full((1,), 0, ops.index), below[:-1]], 0),
            ops.concatenate([depths, ops.arange(1, n_lookup + 1, 1, ops.index)], 0),
            ops.concatenate([sources | ops.where(through, LOOKUP, 0), ops.full((n_lookup,), LOOKUP, ops.index)], 0),
            max(log_probs.shape[0], n_lookup),
        )

    def attention_mask(self, tree: DraftTree, before: int, window: int | None) -> Array:
        """[N + 1, before + N + 1] bool: what each tree position sees in a verify that follows `before` cached
        positions (the newest sits right before the anchor): the cached ones within its window, counted from
        its own position (anchor + depth), and its ancestors (and itself) within the window."""
        ops = self.ops
        depth = tree.depths[:, None]
        seen = tree.ancestors
        if window is not None:
            seen = seen & (depth - tree.depths[None, :] < window)
        if not before:
            return seen
        distance = depth + ops.arange(before, 0, -1, ops.index)[None, :]  # query position minus key position
        context = distance < window if window is not None else ops.full(tuple(distance.shape), True, ops.bool_)
        return ops.concatenate([context, seen], 1)

    def choices(self, logits: Array, tree: DraftTree, params: SamplingParams, noise: Noise | None) -> Array:
        """The target's own token at every tree position [N + 1]: its argmax, or a sample of its filtered
        distribution with the noise of the position it decodes: a node at depth d chooses the token at
        `noise.start + d` (`noise.py`)."""
        ops = self.ops
        if params.greedy:
            return ops.argmax(logits, -1)
        probs = self.probabilities(logits, params)
        positions = ops.arange(noise.start, noise.start + tree.max_depth + 1, 1, ops.int64)
        g = gumbel(ops, noise.seed, positions, logits.shape[-1])
        return ops.argmax(ops.log(probs) + g[tree.depths], -1)

    def verdict(self, tree: DraftTree, logits: Array, params: SamplingParams, noise: Noise | None) -> Array:
        """[depth, next token, path marks (N + 1), sources (N)] (`ArrayOps.index`) lazily: the accepted path's
        depth, the target's token after it, which positions it holds (the anchor always) and who proposed each
        node."""
        ops = self.ops
        chosen = self.choices(logits, tree, params, noise)
        agree = ops.astype(tree.tokens, ops.index) == chosen[tree.parents]
        agree = ops.concatenate([ops.full((1,), True, ops.bool_), agree], 0)
        accepted = ~(tree.ancestors & ~agree[None, :]).any(-1)
        n = tree.size + 1
        rank = ops.where(accepted, tree.depths * (n + 1) + (n - ops.arange(0, n, 1, ops.index)), -1)
        best = ops.argmax(rank, 0)
        head = ops.stack([tree.depths[best], chosen[best]])
        return ops.concatenate([head, ops.astype(tree.ancestors[best], ops.index), tree.sources], 0)

    def chain_verdict(self, tree: DraftTree, judged: Array) -> Array:
        """A chain's [accepted, next token] (judged along the chain: `SamplingOps.greedy_verdict`, on the
        target's logits or, sampled, on its Gumbel scores, `noise.gumbel_scores`) in `verdict`'s form: the
        same walk, without the ancestor matrix."""
        ops = self.ops
        marks = ops.astype(ops.arange(0, tree.size + 1, 1, ops.index) <= judged[0], ops.index)
        return ops.concatenate([ops.astype(judged, ops.index), marks, tree.sources], 0)

    def token_logprobs(self, logits: Array, tokens: Array, top: int, rows: Array | None = None) -> Array:
        """int32 [n + 2 * W * top] lazily: the log-softmax of `logits` [W, V] (float32, before any sampling
        filter) at row `rows[i]` (default: row i) for `tokens[i]`, then every row's `top` likeliest tokens, best
        first: their log-probabilities, then their ids. The floats travel as their int32 bit patterns
        (`logprobs.read_table`), so a round reads them with its verdict, in its one integer host read."""
        ops = self.ops
        logp = ops.log_softmax(ops.astype(logits, ops.float32))
        rows = ops.arange(0, tokens.shape[0], 1, ops.index) if rows is None else ops.astype(rows, ops.index)
        floats = [logp[rows, ops.astype(tokens, ops.index)]]
        ids = ops.full((0,), 0, ops.int32)
        if top:
            values, best = ops.top_k(logp, top)
            floats.append(values.reshape(-1))
            ids = ops.astype(best.reshape(-1), ops.int32)
        return ops.concatenate([ops.bits_as_int32(ops.concatenate(floats, 0)), ids], 0)

    def round_logprobs(self, logits: Array, tree: DraftTree, verdict: Array, top: int) -> Array:
        """`token_logprobs` of a verify round, lazily: every node's token at its parent's row, then the next
        token (`verdict`'s, in its form) at the row of the accepted path's end. The committed tokens are the
        path's nodes and that next token, so whatever path the verdict takes, their values are here
        (`logprobs.path_logprobs`)."""
        ops = self.ops
        marks = verdict[2 : 3 + tree.size]
        end = ops.argmax(marks * tree.depths, 0)  # the deepest marked position: the path's end
        rows = ops.concatenate([tree.parents, end[None]], 0)
        tokens = ops.concatenate([ops.astype(tree.tokens, ops.index), verdict[1:2]], 0)
        return self.token_logprobs(logits, tokens, top, rows)

    @staticmethod
    def read_path(values: list[int], size: int) -> Path:
        """The `Path` in a read `verdict` (of a tree of `size` nodes)."""
        return read_path(values, size)


@dataclass
class Path:
    """A read verdict: the accepted path's positions in [anchor, nodes] (the anchor's 0 first), the target's
    token after it, and the sources of the path's nodes."""

    positions: list[int]
    next_token: int
    sources: list[int]
    chain_depth: int = 0  # how deep the drafter's greedy chain runs in the tree (CHAIN nodes; 0 in a chain draft)

    @property
    def depth(self) -> int:
        return len(self.positions) - 1

    @property
    def chain_kept(self) -> int:
        """How many drafts the drafter's greedy chain would have had kept: the path's leading CHAIN nodes (the
        target's choices along them are the same whatever else the tree holds)."""
        return next((i for i, source in enumerate(self.sources) if not source & CHAIN), len(self.sources))

    @property
    def lookup_kept(self) -> int:
        """Nodes of the path the n-gram lookup proposed (a prefix of it: the lookup's branch hangs from the
        anchor)."""
        return sum(1 for source in self.sources if source & LOOKUP)


def read_path(values: list[int], size: int) -> Path:
    """The `Path` in a read `verdict` (of a tree of `size` nodes)."""
    positions = [i for i, mark in enumerate(values[2 : 3 + size]) if mark]
    sources = values[3 + size : 3 + 2 * size]
    chain_depth = sum(1 for source in sources if source & CHAIN)
    return Path(positions, values[1], [sources[i - 1] for i in positions[1:]], chain_depth)


@functools.lru_cache(maxsize=None)
def _traced_best_first(trees: Trees, budget: int) -> Callable:
    """`Trees.best_first` for one budget as one lasting function, so a library that keeps its traces by
    function finds them again round after round."""
    return trees.ops.compile(functools.partial(trees._best_first, budget))


mlx_trees = Trees(MLX_OPS, sampling.probabilities)
