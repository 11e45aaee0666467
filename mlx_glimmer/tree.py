"""Draft trees on MLX: built, merged, masked and judged on the device, so a round still reads the host once.

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
(its argmax, or a sample drawn with the noise of that node's depth), and a node is accepted when its token
is its parent's choice and its parent is accepted; the deepest accepted node ends the path and its choice
is the next token. Noise shared by depth makes nodes on the same root path draw the same sample, so a
merged duplicate can never change the outcome, and along the one path walked every depth draws fresh
noise: each committed token is an exact sample from the target's filtered distribution (docs/design.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from . import sampling
from .settings import SamplingParams

MODEL, LOOKUP = 1, 2  # node sources, as bits: a node both proposed is MODEL | LOOKUP
SOURCE_NAMES = {MODEL: "model", LOOKUP: "lookup", MODEL | LOOKUP: "both"}
_TOP = -1e-3  # log-probabilities are capped here, so a child scores strictly below its parent


@dataclass
class DraftTree:
    """A draft on the device. `tokens` [N] uint32, `parents` [N] int32 (indices into [anchor, nodes]),
    `depths` [N + 1] int32 (the anchor's 0 first), `sources` [N] int32 (MODEL / LOOKUP bits),
    `ancestors` [N + 1, N + 1] bool (row i: i and its ancestors). `max_depth` bounds `depths` on the host;
    `chain` says the parents are 0, 1, 2, ... (rejection sampling then applies, `sampling.sampled_verdict`)."""

    tokens: mx.array
    parents: mx.array
    depths: mx.array
    sources: mx.array
    ancestors: mx.array
    max_depth: int
    chain: bool = False

    @property
    def size(self) -> int:
        """Nodes under the anchor."""
        return int(self.tokens.shape[0])


def ancestor_matrix(parents: mx.array, max_depth: int) -> mx.array:
    """[N + 1, N + 1] bool: row i marks i and every ancestor of i (the anchor, 0, is everyone's)."""
    n = parents.shape[0] + 1
    up = mx.concatenate([mx.zeros((1,), mx.int32), parents.astype(mx.int32)])
    cols = mx.arange(n)[None, :]
    current = mx.arange(n)
    marks = cols == current[:, None]
    for _ in range(max_depth):
        current = up[current]
        marks = marks | (cols == current[:, None])
    return marks


def _finish(tokens, parents, depths, sources, max_depth: int, chain: bool = False) -> DraftTree:
    parents = parents.astype(mx.int32)
    return DraftTree(
        tokens.astype(mx.uint32),
        parents,
        mx.concatenate([mx.zeros((1,), mx.int32), depths.astype(mx.int32)]),
        sources.astype(mx.int32),
        ancestor_matrix(parents, max_depth),
        max_depth,
        chain,
    )


def chain(tokens: mx.array, source: int = MODEL) -> DraftTree:
    """The chain [anchor, t1, t2, ...] as a tree."""
    n = tokens.shape[0]
    steps = mx.arange(n, dtype=mx.int32)
    return _finish(tokens, steps, steps + 1, mx.full((n,), source, mx.int32), n, chain=True)


def best_first(log_probs: mx.array, budget: int, vocab: mx.array | None = None) -> tuple[mx.array, ...]:
    """The `budget` best prefixes over per-position log-probabilities [D, V] (rows: draft positions 1..D), as
    (tokens, parents, depths), parents first (by depth, then score). `vocab` maps column ids to token ids (a
    drafter's own vocabulary). Fewer when fewer prefixes exist (a vocabulary smaller than the budget)."""
    depth_count, width = log_probs.shape
    top = min(budget, width)  # a prefix's children worth keeping: its position's `top` likeliest tokens
    budget = min(budget, sum(min(budget, top ** (d + 1)) for d in range(depth_count)))
    log_probs = log_probs.astype(mx.float32)
    log_probs = mx.where(mx.isnan(log_probs), -mx.inf, log_probs)  # a NaN score (an fp16 head) is impossible
    ids = (
        mx.argpartition(-log_probs, top - 1, axis=-1)[:, :top]
        if top < width
        else mx.broadcast_to(mx.arange(width)[None], (depth_count, width))
    )
    vals = mx.minimum(mx.take_along_axis(log_probs, ids, axis=-1), _TOP)
    first = mx.argsort(-vals[0])
    missing = budget - top if budget > top else 0  # the beam is `budget` wide; depth 1 has only `top` prefixes
    pad = mx.full((missing,), -mx.inf, mx.float32)
    scores = [mx.concatenate([vals[0][first], pad])]
    toks = [mx.concatenate([ids[0][first], mx.zeros((missing,), ids.dtype)])]
    backs = [mx.zeros((budget,), mx.int32)]
    for d in range(1, depth_count):
        candidates = (scores[-1][:, None] + vals[d][None, :]).reshape(-1)
        order = mx.argsort(-candidates)[:budget]
        scores.append(candidates[order])
        toks.append(ids[d][order % top])
        backs.append((order // top).astype(mx.int32))
    chosen = _closed_best(mx.concatenate(scores), budget)  # by depth, then beam rank: parents first
    node_depth = (chosen // budget).astype(mx.int32)
    tokens = mx.concatenate(toks)[chosen]
    index_of = mx.zeros((depth_count * budget,), mx.int32)
    index_of[chosen] = mx.arange(1, budget + 1, dtype=mx.int32)
    parent_slot = mx.maximum(node_depth - 1, 0) * budget + mx.concatenate(backs)[chosen]
    parents = mx.where(node_depth == 0, 0, index_of[parent_slot])
    if vocab is not None:
        tokens = vocab[tokens]
    return tokens, parents, node_depth + 1


def _closed_best(scores: mx.array, budget: int) -> mx.array:
    """The indices of the `budget` best `scores`, ascending, ties taken in index order. A child never scores
    above its parent and comes after it (by depth), so the chosen set holds every chosen node's parent even
    when scores tie (-inf, or a sum that rounds to its parent's score)."""
    cut = mx.sort(scores)[-budget]  # the budget-th best score
    above = scores > cut
    level = scores == cut
    take = above | (level & (mx.cumsum(level.astype(mx.int32)) <= budget - above.sum()))
    positions = mx.arange(scores.shape[0])
    return mx.sort(mx.where(take, positions, positions + scores.shape[0]))[:budget]


def model_tree(log_probs: mx.array, budget: int, vocab: mx.array | None = None) -> DraftTree:
    """A best-first tree of `budget` nodes from one drafter forward's log-probabilities [D, V]."""
    tokens, parents, depths = best_first(log_probs, budget, vocab)
    return _finish(tokens, parents, depths, mx.full(tokens.shape, MODEL, mx.int32), log_probs.shape[0])


def merged_tree(log_probs: mx.array | None, budget: int, lookup: list[int], vocab: mx.array | None = None) -> DraftTree:
    """A tree of `budget` nodes: the model's best `budget - len(lookup)` prefixes and the n-gram continuation
    `lookup` as a branch from the anchor. A lookup node equal to a model node (same parent, same token) is
    merged into it: the model node gains the LOOKUP source and the branch continues from it; the lookup node
    stays as a duplicate leaf (its verdict equals the model node's, see the module docstring), since the
    verify width is fixed before the tree is read."""
    n_lookup = min(len(lookup), budget)
    if log_probs is None or budget - n_lookup < 1:
        return chain(mx.array(lookup[:budget], mx.uint32), LOOKUP)
    tokens, parents, depths = best_first(log_probs, budget - n_lookup, vocab)
    sources = mx.full(tokens.shape, MODEL, mx.int32)
    if not n_lookup:
        return _finish(tokens, parents, depths, sources, log_probs.shape[0])
    n_model = tokens.shape[0]
    extra_parents, parent = [], mx.array(0, mx.int32)
    merged_into = []
    for k, token in enumerate(lookup[:n_lookup]):
        match = (parents == parent) & (tokens == token) & (depths == k + 1)
        found = match.any()
        hit = mx.argmax(match).astype(mx.int32) + 1
        extra_parents.append(parent)
        merged_into.append(mx.where(found, hit, 0))
        parent = mx.where(found, hit, mx.array(n_model + k + 1, mx.int32))
    marks = mx.zeros((n_model + 1,), mx.int32)
    marks[mx.stack(merged_into)] = LOOKUP
    sources = sources | marks[1:]
    return _finish(
        mx.concatenate([tokens.astype(mx.uint32), mx.array(lookup[:n_lookup], mx.uint32)]),
        mx.concatenate([parents, mx.stack(extra_parents)]),
        mx.concatenate([depths, mx.arange(1, n_lookup + 1, dtype=mx.int32)]),
        mx.concatenate([sources, mx.full((n_lookup,), LOOKUP, mx.int32)]),
        max(log_probs.shape[0], n_lookup),
    )


def attention_mask(tree: DraftTree, before: int, window: int | None) -> mx.array:
    """[N + 1, before + N + 1] bool: what each tree position sees in a verify that follows `before` cached
    positions (the newest sits right before the anchor): the cached ones within its window, counted from
    its own position (anchor + depth), and its ancestors (and itself) within the window."""
    depth = tree.depths[:, None]
    seen = tree.ancestors
    if window is not None:
        seen = seen & (depth - tree.depths[None, :] < window)
    if not before:
        return seen
    distance = depth + mx.arange(before, 0, -1)[None, :]  # query position minus key position
    context = distance < window if window is not None else mx.ones(distance.shape, mx.bool_)
    return mx.concatenate([context, seen], axis=1)


def choices(logits: mx.array, tree: DraftTree, params: SamplingParams, key) -> mx.array:
    """The target's own token at every tree position [N + 1]: its argmax, or a sample of its filtered
    distribution drawn with its depth's Gumbel noise."""
    if params.greedy:
        return mx.argmax(logits, axis=-1).astype(mx.int32)
    probs = sampling.probabilities(logits, params)
    noise = mx.random.gumbel((tree.max_depth + 1, logits.shape[-1]), key=key)
    return mx.argmax(mx.log(probs) + noise[tree.depths], axis=-1).astype(mx.int32)


def verdict(tree: DraftTree, logits: mx.array, params: SamplingParams, key) -> mx.array:
    """int32 [depth, next token, path marks (N + 1), sources (N)] lazily: the accepted path's depth, the
    target's token after it, which positions it holds (the anchor always) and who proposed each node."""
    chosen = choices(logits, tree, params, key)
    agree = mx.concatenate([mx.ones((1,), mx.bool_), tree.tokens.astype(mx.int32) == chosen[tree.parents]])
    accepted = ~(tree.ancestors & ~agree[None, :]).any(axis=1)
    n = tree.size + 1
    rank = mx.where(accepted, tree.depths * (n + 1) + (n - mx.arange(n)), -1)
    best = mx.argmax(rank)
    head = mx.stack([tree.depths[best], chosen[best]])
    return mx.concatenate([head, tree.ancestors[best].astype(mx.int32), tree.sources])


def chain_verdict(tree: DraftTree, judged: mx.array) -> mx.array:
    """A chain's [accepted, next token] (`sampling.sampled_verdict`'s rejection sampling) in `verdict`'s form."""
    marks = (mx.arange(tree.size + 1) <= judged[0]).astype(mx.int32)
    return mx.concatenate([judged.astype(mx.int32), marks, tree.sources])


def token_logprobs(logits: mx.array, tokens: mx.array, top: int, rows: mx.array | None = None) -> mx.array:
    """int32 [n + 2 * W * top] lazily: the log-softmax of `logits` [W, V] (float32, before any sampling filter) at
    row `rows[i]` (default: row i) for `tokens[i]`, then every row's `top` likeliest tokens, best first: their
    log-probabilities, then their ids. The floats travel as their int32 bit patterns (`logprobs.read_table`),
    so a round reads them with its verdict, in its one integer host read."""
    logp = logits.astype(mx.float32)
    logp = logp - mx.logsumexp(logp, axis=-1, keepdims=True)
    rows = mx.arange(tokens.shape[0]) if rows is None else rows.astype(mx.int32)
    floats = [logp[rows, tokens.astype(mx.int32)]]
    ids = mx.zeros((0,), mx.int32)
    if top:
        ids = mx.argpartition(-logp, top - 1, axis=-1)[:, :top]
        values = mx.take_along_axis(logp, ids, axis=-1)
        order = mx.argsort(-values, axis=-1)
        floats.append(mx.take_along_axis(values, order, axis=-1).reshape(-1))
        ids = mx.take_along_axis(ids, order, axis=-1).reshape(-1).astype(mx.int32)
    return mx.concatenate([mx.view(mx.concatenate(floats), mx.int32), ids])


def round_logprobs(logits: mx.array, tree: DraftTree, verdict: mx.array, top: int) -> mx.array:
    """`token_logprobs` of a verify round, lazily: every node's token at its parent's row, then the next token
    (`verdict`'s, in its form) at the row of the accepted path's end. The committed tokens are the path's nodes
    and that next token, so whatever path the verdict takes, their values are here (`logprobs.path_logprobs`)."""
    marks = verdict[2 : 3 + tree.size]
    end = mx.argmax(marks * tree.depths)  # the deepest marked position: the path's end
    rows = mx.concatenate([tree.parents, end[None].astype(mx.int32)])
    tokens = mx.concatenate([tree.tokens.astype(mx.int32), verdict[1:2].astype(mx.int32)])
    return token_logprobs(logits, tokens, top, rows)


@dataclass
class Path:
    """A read verdict: the accepted path's positions in [anchor, nodes] (the anchor's 0 first), the target's
    token after it, and the sources of the path's nodes."""

    positions: list[int]
    next_token: int
    sources: list[int]

    @property
    def depth(self) -> int:
        return len(self.positions) - 1

    @property
    def lookup_kept(self) -> int:
        """Nodes of the path the n-gram lookup proposed (a prefix of it: the lookup's branch hangs from the
        anchor)."""
        return sum(1 for source in self.sources if source & LOOKUP)


def read_path(values: list[int], size: int) -> Path:
    """The `Path` in a read `verdict` (of a tree of `size` nodes)."""
    positions = [i for i, mark in enumerate(values[2 : 3 + size]) if mark]
    sources = values[3 + size : 3 + 2 * size]
    return Path(positions, values[1], [sources[i - 1] for i in positions[1:]])
