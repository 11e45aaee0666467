"""`mlx_glimmer.tree` in torch: draft trees built, merged, masked and judged on the device.

The same flat form (`DraftTree`, holding torch tensors: tokens, parents, depths and sources as long, the
ancestor matrix as bool), the same best-first construction, the same verdict layout ([depth, next token,
path marks (N + 1), sources (N)]) and the same rules; see `mlx_glimmer.tree` for why they hold. Sampled
choices draw one Gumbel row per depth, shared by every node of that depth, from the round's
`torch.Generator` (`TorchTarget.split` hands out one generator, drawn from in turn), so a seed gives another
sample stream than on MLX and the same distributions.
"""

from __future__ import annotations

import torch

from ..settings import SamplingParams
from ..tree import _TOP, LOOKUP, MODEL, SOURCE_NAMES, DraftTree, Path, read_path
from . import sampling

__all__ = [
    "MODEL",
    "LOOKUP",
    "SOURCE_NAMES",
    "DraftTree",
    "Path",
    "read_path",
    "ancestor_matrix",
    "chain",
    "best_first",
    "model_tree",
    "merged_tree",
    "attention_mask",
    "choices",
    "verdict",
    "chain_verdict",
    "token_logprobs",
    "round_logprobs",
]


def ancestor_matrix(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[N + 1, N + 1] bool: row i marks i and every ancestor of i (the anchor, 0, is everyone's)."""
    device = parents.device
    n = parents.shape[0] + 1
    up = torch.cat([torch.zeros(1, dtype=torch.long, device=device), parents.long()])
    cols = torch.arange(n, device=device)[None, :]
    current = torch.arange(n, device=device)
    marks = cols == current[:, None]
    for _ in range(max_depth):
        current = up[current]
        marks = marks | (cols == current[:, None])
    return marks


def _finish(tokens, parents, depths, sources, max_depth: int, chain: bool = False) -> DraftTree:
    parents = parents.long()
    return DraftTree(
        tokens.long(),
        parents,
        torch.cat([torch.zeros(1, dtype=torch.long, device=parents.device), depths.long()]),
        sources.long(),
        ancestor_matrix(parents, max_depth),
        max_depth,
        chain,
    )


def chain(tokens: torch.Tensor, source: int = MODEL) -> DraftTree:
    """The chain [anchor, t1, t2, ...] as a tree."""
    n = tokens.shape[0]
    steps = torch.arange(n, dtype=torch.long, device=tokens.device)
    return _finish(tokens, steps, steps + 1, torch.full((n,), source, dtype=torch.long, device=tokens.device), n, True)


def best_first(log_probs: torch.Tensor, budget: int, vocab: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """The `budget` best prefixes over per-position log-probabilities [D, V] (rows: draft positions 1..D), as
    (tokens, parents, depths), parents first (by depth, then score). `vocab` maps column ids to token ids (a
    drafter's own vocabulary). Fewer when fewer prefixes exist (a vocabulary smaller than the budget)."""
    device = log_probs.device
    depth_count, width = log_probs.shape
    top = min(budget, width)
    budget = min(budget, sum(min(budget, top ** (d + 1)) for d in range(depth_count)))
    log_probs = log_probs.float()
    log_probs = torch.where(log_probs.isnan(), -torch.inf, log_probs)  # a NaN score is impossible, not the best
    if top < width:
        vals, ids = torch.topk(log_probs, top, dim=-1)
    else:
        vals, ids = log_probs, torch.arange(width, device=device)[None].expand(depth_count, width)
    vals = vals.clamp(max=_TOP)
    first = torch.argsort(-vals[0], stable=True)
    missing = max(budget - top, 0)
    scores = [torch.cat([vals[0][first], torch.full((missing,), -torch.inf, device=device)])]
    toks = [torch.cat([ids[0][first], torch.zeros(missing, dtype=ids.dtype, device=device)])]
    backs = [torch.zeros(budget, dtype=torch.long, device=device)]
    for d in range(1, depth_count):
        candidates = (scores[-1][:, None] + vals[d][None, :]).reshape(-1)
        order = torch.argsort(-candidates, stable=True)[:budget]
        scores.append(candidates[order])
        toks.append(ids[d][order % top])
        backs.append(order // top)
    chosen = torch.sort(torch.argsort(-torch.cat(scores), stable=True)[:budget]).values  # by depth, then rank
    node_depth = chosen // budget
    tokens = torch.cat(toks)[chosen]
    index_of = torch.zeros(depth_count * budget, dtype=torch.long, device=device)
    index_of[chosen] = torch.arange(1, budget + 1, device=device)
    parent_slot = torch.clamp(node_depth - 1, min=0) * budget + torch.cat(backs)[chosen]
    parents = torch.where(node_depth == 0, 0, index_of[parent_slot])
    if vocab is not None:
        tokens = vocab.to(device).long()[tokens]
    return tokens, parents, node_depth + 1


def model_tree(log_probs: torch.Tensor, budget: int, vocab: torch.Tensor | None = None) -> DraftTree:
    """A best-first tree of `budget` nodes from one drafter forward's log-probabilities [D, V]."""
    tokens, parents, depths = best_first(log_probs, budget, vocab)
    sources = torch.full(tokens.shape, MODEL, dtype=torch.long, device=tokens.device)
    return _finish(tokens, parents, depths, sources, log_probs.shape[0])


def merged_tree(
    log_probs: torch.Tensor | None, budget: int, lookup: list[int], vocab: torch.Tensor | None = None
) -> DraftTree:
    """A tree of `budget` nodes: the model's best `budget - len(lookup)` prefixes and the n-gram continuation
    `lookup` as a branch from the anchor, merged as `mlx_glimmer.tree.merged_tree` merges them."""
    device = log_probs.device if log_probs is not None else torch.device("cpu")
    n_lookup = min(len(lookup), budget)
    if log_probs is None or budget - n_lookup < 1:
        return chain(torch.tensor(lookup[:budget], dtype=torch.long, device=device), LOOKUP)
    tokens, parents, depths = best_first(log_probs, budget - n_lookup, vocab)
    sources = torch.full(tokens.shape, MODEL, dtype=torch.long, device=device)
    if not n_lookup:
        return _finish(tokens, parents, depths, sources, log_probs.shape[0])
    n_model = tokens.shape[0]
    extra_parents, parent = [], torch.tensor(0, dtype=torch.long, device=device)
    merged_into = []
    for k, token in enumerate(lookup[:n_lookup]):
        match = (parents == parent) & (tokens == token) & (depths == k + 1)
        found = match.any()
        hit = torch.argmax(match.long()) + 1
        extra_parents.append(parent)
        merged_into.append(torch.where(found, hit, 0))
        parent = torch.where(found, hit, n_model + k + 1)
    marks = torch.zeros(n_model + 1, dtype=torch.long, device=device)
    marks[torch.stack(merged_into)] = LOOKUP
    sources = sources | marks[1:]
    return _finish(
        torch.cat([tokens, torch.tensor(lookup[:n_lookup], dtype=torch.long, device=device)]),
        torch.cat([parents, torch.stack(extra_parents)]),
        torch.cat([depths, torch.arange(1, n_lookup + 1, device=device)]),
        torch.cat([sources, torch.full((n_lookup,), LOOKUP, dtype=torch.long, device=device)]),
        max(log_probs.shape[0], n_lookup),
    )


def attention_mask(tree: DraftTree, before: int, window: int | None) -> torch.Tensor:
    """[N + 1, before + N + 1] bool: what each tree position sees in a verify that follows `before` cached
    positions (the newest sits right before the anchor): the cached ones within its window, counted from
    its own position (anchor + depth), and its ancestors (and itself) within the window."""
    depth = tree.depths[:, None]
    seen = tree.ancestors
    if window is not None:
        seen = seen & (depth - tree.depths[None, :] < window)
    if not before:
        return seen
    distance = depth + torch.arange(before, 0, -1, device=depth.device)[None, :]  # query minus key position
    context = distance < window if window is not None else torch.ones_like(distance, dtype=torch.bool)
    return torch.cat([context, seen], dim=1)


def _gumbel(shape: tuple[int, ...], generator: torch.Generator | None, device) -> torch.Tensor:
    u = torch.rand(shape, generator=generator, device=device).clamp(min=torch.finfo(torch.float32).tiny)
    return -torch.log(-torch.log(u))


def choices(logits: torch.Tensor, tree: DraftTree, params: SamplingParams, key) -> torch.Tensor:
    """The target's own token at every tree position [N + 1]: its argmax, or a sample of its filtered
    distribution drawn with its depth's Gumbel noise (one row per depth, from the generator `key`)."""
    if params.greedy:
        return torch.argmax(logits, dim=-1)
    probs = sampling.probabilities(logits, params)
    noise = _gumbel((tree.max_depth + 1, logits.shape[-1]), key, logits.device)
    return torch.argmax(torch.log(probs) + noise[tree.depths], dim=-1)


def verdict(tree: DraftTree, logits: torch.Tensor, params: SamplingParams, key) -> torch.Tensor:
    """long [depth, next token, path marks (N + 1), sources (N)]: the accepted path's depth, the target's
    token after it, which positions it holds (the anchor always) and who proposed each node."""
    chosen = choices(logits, tree, params, key)
    ones = torch.ones(1, dtype=torch.bool, device=chosen.device)
    agree = torch.cat([ones, tree.tokens == chosen[tree.parents]])
    accepted = ~(tree.ancestors & ~agree[None, :]).any(dim=1)
    n = tree.size + 1
    index = torch.arange(n, device=chosen.device)
    rank = torch.where(accepted, tree.depths * (n + 1) + (n - index), -1)
    best = torch.argmax(rank)
    head = torch.stack([tree.depths[best], chosen[best]])
    return torch.cat([head, tree.ancestors[best].long(), tree.sources])


def chain_verdict(tree: DraftTree, judged: torch.Tensor) -> torch.Tensor:
    """A chain's [accepted, next token] (`sampling.sampled_verdict`'s rejection sampling) in `verdict`'s form."""
    marks = (torch.arange(tree.size + 1, device=judged.device) <= judged[0]).long()
    return torch.cat([judged.long(), marks, tree.sources.to(judged.device)])


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, top: int, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """int32 [n + 2 * W * top]: the log-softmax of `logits` [W, V] (float32) at row `rows[i]` (default: row i)
    for `tokens[i]`, then every row's `top` likeliest tokens, best first: their log-probabilities, then their
    ids; floats as their int32 bit patterns. See `mlx_glimmer.tree.token_logprobs`."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    rows = torch.arange(tokens.shape[0], device=logp.device) if rows is None else rows.long()
    floats = [logp[rows, tokens.long()]]
    ids = torch.zeros(0, dtype=torch.int32, device=logp.device)
    if top:
        values, best = torch.topk(logp, top, dim=-1)
        floats.append(values.reshape(-1))
        ids = best.reshape(-1).int()
    return torch.cat([torch.cat(floats).contiguous().view(torch.int32), ids])


def round_logprobs(logits: torch.Tensor, tree: DraftTree, verdict: torch.Tensor, top: int) -> torch.Tensor:
    """`token_logprobs` of a verify round: every node's token at its parent's row, then the next token at the
    row of the accepted path's end. See `mlx_glimmer.tree.round_logprobs`."""
    marks = verdict[2 : 3 + tree.size]
    end = torch.argmax(marks * tree.depths.to(marks.device))
    rows = torch.cat([tree.parents.to(marks.device), end[None]])
    tokens = torch.cat([tree.tokens.to(marks.device), verdict[1:2]])
    return token_logprobs(logits, tokens, top, rows)
