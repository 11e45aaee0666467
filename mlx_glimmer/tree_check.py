"""A draft tree verified once at load, against the same tokens verified as chains.

A tree verify gives each node the anchor's position plus its depth through the seam its target offers (MLX:
the RoPE modules at `self_attn.rope`, `target.accept_token_positions`; torch: `position_ids`) and masks it
to its ancestors. A model that rotates its queries and keys some other way, a fused kernel reading one cache
offset for all its tokens say, would verify every node off the first branch at the wrong position and never
say so: the verdict would then accept tokens the target does not choose. A target whose layers lack the seam
says so itself (`TargetModel.tree_unsupported`); for the rest, loading a pair whose drafter can seed trees
runs `guard_trees`: a tree of `BUDGET` nodes in two branches after a short context is verified, each branch
is verified again as a plain chain, and at every node both must give the same likeliest token and
the same log-probabilities to the chain's `TOP` likeliest tokens, within `TOLERANCE`. A disagreement turns
trees off for that target, and the loop verifies chains.

Written once for every array library, through the `TargetModel` seam: four forwards and two host reads, at
load only.
"""

from __future__ import annotations

from .drafters.base import Drafter
from .logprobs import read_table
from .target_model import TargetModel

CONTEXT = 6  # tokens before the anchor
BUDGET = 3  # nodes: the model's best token and a two-token branch from the anchor
TOP = 8  # the likeliest tokens compared at each node
# Log-probabilities (nats) a tree verify and a chain verify of the same tokens may differ by: a verify of
# different width sums in a different order, in the target's dtype (bfloat16 included). A token placed a
# position off moves them much further.
TOLERANCE = 0.1


def tree_verify_error(target: TargetModel) -> str | None:
    """Verify a small tree on `target`, then each of its branches as a chain: what went wrong, in one line
    (the first node whose log-probabilities disagree, or the error the tree verify raised), or None."""
    vocab = target.vocab_size
    context = [(97 * i + 31) % vocab for i in range(CONTEXT + 1)]
    before, anchor, lookup = context[:-1], context[-1], context[:2]
    cache = target.make_cache(reserve=BUDGET + 1)
    hidden, _ = target.forward(target.tokens(before), cache, capture=False)
    logits = target.head(hidden[-2:])
    # [anchor, the model's best token, lookup[0], lookup[1]]: lookup[1] sits at index 3 and depth 2. Any scores
    # serve. A lookup token equal to the model's merges into it (lookup[1] then hangs from the model's node,
    # index 2 stays a duplicate leaf): each node's root path holds the same tokens either way.
    tree = target.trees.merged_tree(logits - logits.max() - 1.0, BUDGET, lookup)
    try:
        hidden, _ = target.forward(target.join(target.tokens([anchor]), tree.tokens), cache, capture=False, tree=tree)
    except (ValueError, TypeError, RuntimeError) as e:  # a RoPE that takes one offset only, say
        return f"a tree verify at load failed ({type(e).__name__}: {str(e).split(chr(10))[0]})"
    tree_logits = target.head(hidden)
    target.trim(cache, BUDGET + 1)
    chains = [tree.tokens[:1], target.tokens(lookup)]
    rows, depths = [0, 1, 0, 2, 3], [0, 1, 0, 1, 2]  # the tree position and depth of each chain row, in order
    tables = []
    for ids in chains:
        hidden, _ = target.forward(target.join(target.tokens([anchor]), ids), cache, capture=False)
        tables.append(target.trees.token_logprobs(target.head(hidden), ids, TOP))
        target.trim(cache, ids.shape[0] + 1)
    values, compared = target.read(*tables), []  # each chain row's likeliest tokens, with theirs
    for ids in chains:
        width = ids.shape[0] + 1
        compared += read_table(values, width - 1, width, TOP).top
        values = values[width - 1 + 2 * width * TOP :]
    ids = [token for top in compared for token, _ in top]
    queried = target.trees.token_logprobs(
        tree_logits, target.tokens(ids), 1, target.tokens([row for row in rows for _ in range(TOP)])
    )
    under_tree = read_table(target.read(queried), len(ids), BUDGET + 1, 1)
    for k, (row, depth, top) in enumerate(zip(rows, depths, compared)):
        same_tokens = under_tree.chosen[k * TOP : (k + 1) * TOP]
        difference = max(abs(a - b) for a, (_, b) in zip(same_tokens, top))
        choice, best = under_tree.top[row][0]
        same_choice = choice == top[0][0] or best - same_tokens[0] <= TOLERANCE
        if difference > TOLERANCE or not same_choice:
            return (
                f"a tree verify at load disagreed with chains of the same tokens at node {row} (depth "
                f"{depth}): log-probabilities {difference:.3g} apart (tolerance {TOLERANCE})"
                + ("" if same_choice else ", another likeliest token")
            )
    return None


def guard_trees(target: TargetModel, drafter: Drafter | None) -> None:
    """For a pair that may draft trees (its drafter has per-position distributions, its target the position
    seam): check a tree verify against chains, and where it disagrees, set `target.tree_unsupported` so the
    loop verifies chains only (`speculative.tree_setting`)."""
    if drafter is None or not drafter.has_marginals or target.tree_unsupported is not None:
        return
    target.tree_unsupported = tree_verify_error(target)
