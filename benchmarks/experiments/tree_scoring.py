"""How a draft tree should score its nodes: the drafter's marginals as they are, or corrected per depth.

    .venv/bin/python benchmarks/experiments/tree_scoring.py [--drafter DIR] [--prompts 75] [--budgets 8,16]
        [--out benchmarks/experiments/results/tree_scoring.json]

A block drafter gives, in one forward, a distribution per draft position, each over what the position holds
whatever came before it (a marginal). The tree (`tree.Trees.best_first`) ranks a prefix by the product of its
tokens' marginals. What a node is worth is the chance that it and its ancestors all equal the target's tokens,
and a position's token is likelier right when the ones before it were: text that the drafter reads well at
depth 1 it tends to read well at depth 2. So the marginals may undervalue deep nodes against wide ones.

Teacher-forced on the target's greedy answers to the held-out prompts (the runtime drafter on the true prefix,
as `drafter_diagnosis.py` part (d) runs it): at every anchor, trees of each budget built by the product's
`best_first` from

- `marginal`: the drafter's log-probabilities as they are (what the loop does);
- `depth_boost`: each depth's log-probabilities plus log(k_d), k_d = the chance that the drafter's greedy token
  at depth d is right given its greedy tokens before it were, over the mean marginal of that greedy token (both
  measured on the first half of the prompts, the selection half; 1 at depth 1). A loop can measure both online.
- `depth_boost_all`: the same with k_d measured on all prompts (how much the selection half loses).

and for each, the tokens a target forward would commit (1 + the nodes along the true continuation), averaged
over anchors, on all prompts and on the half not selected on. The greedy chain of the same budget is the
reference. Averages over every anchor, not over the anchors a decoding loop reaches: the comparison between
scorings is the point, not the level.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))  # drafter_diagnosis, beside this script
TOP = 16  # candidates kept per position: a tree of budget b reads at most its position's b likeliest


def parse_args(argv=None):
    from mlx_glimmer.demo import SHIPPED_DRAFTER

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default=str(SHIPPED_DRAFTER), help="drafter directory (default: the shipped one)")
    ap.add_argument("--prompts", type=int, default=75, help="held-out prompts, the first N (default 75)")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens per held-out answer (default 128)")
    ap.add_argument("--budgets", default="8,16", help="tree budgets (nodes under the anchor), at most 16")
    ap.add_argument("--cache", default=str(ROOT / "runs" / "drafter_diagnosis"), help="held-out answers' cache")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "experiments" / "results" / "tree_scoring.json"))
    return ap.parse_args(argv)


def marginals_at_anchors(pair, answers):
    """Per anchor: the drafter's top-TOP log-probabilities and token ids per draft position [D, TOP], and the true
    continuation [D] (-1 past the answer's end); with the index of its answer."""
    import mlx.core as mx
    from drafter_diagnosis import each_anchor

    drafter = pair.drafter
    D = drafter.block_size - 1
    vals, ids, truth, owner = [], [], [], []
    for ans, a, padded in each_anchor(pair, answers, "marginals"):
        m = drafter.marginals(int(padded[a]), D)
        top = mx.argsort(-m.log_probs, axis=-1)[:, :TOP]
        v = mx.take_along_axis(m.log_probs, top, axis=-1)
        tokens = top if m.vocab is None else m.vocab[top]
        vals.append(np.array(v))
        ids.append(np.array(tokens).astype(np.int64))
        pos = a + np.arange(1, D + 1)
        truth.append(np.where(pos < len(padded) - D - 1, padded[pos], -1))
        owner.append(ans["index"])
    return np.stack(vals), np.stack(ids), np.stack(truth), np.array(owner)


def depth_boost(vals, ids, truth):
    """log k_d per depth: P(greedy right at d | greedy right before d) over the mean marginal of the greedy token
    at d, among the anchors whose greedy tokens before d were right."""

    right = ids[:, :, 0] == truth
    before = np.cumprod(np.concatenate([np.ones((len(right), 1), bool), right[:, :-1]], axis=1), axis=1).astype(bool)
    out = np.zeros(right.shape[1])
    for d in range(1, right.shape[1]):
        reached = before[:, d] & (truth[:, d] >= 0)
        if reached.sum() >= 20:
            rate = right[reached, d].mean()
            mean_p = np.exp(vals[reached, d, 0]).mean()
            out[d] = np.log(max(rate, 1e-6) / mean_p)
    return out


def committed(trees, vals, ids, truth, budget: int, offsets) -> np.ndarray:
    """Tokens a forward commits at each anchor with a best-first tree of `budget` from vals + offsets."""
    import mlx.core as mx

    scores = mx.array((vals + offsets[None, :, None]).astype(np.float32))
    out = np.zeros(len(vals))
    for n in range(len(vals)):
        cols, parents, depths = (np.array(x) for x in trees.best_first(scores[n], budget))
        tokens = ids[n][depths - 1, cols]
        node, kept = 0, 0
        for d in range(ids.shape[1]):
            if truth[n, d] < 0:
                break
            child = np.nonzero((parents == node) & (depths == d + 1) & (tokens == truth[n, d]))[0]
            if not len(child):
                break
            node, kept = int(child[0]) + 1, kept + 1
        out[n] = 1 + kept
    return out


def chain_committed(ids, truth, length: int) -> np.ndarray:

    right = (ids[:, :length, 0] == truth[:, :length]) & (truth[:, :length] >= 0)
    return 1 + np.cumprod(right, axis=1).sum(axis=1)


def main(argv=None) -> int:
    from mlx_glimmer.blas import ensure_fast_blas
    from mlx_glimmer.paths import cache_dir

    ensure_fast_blas(cache_dir() / "blas")
    args = parse_args(argv)

    from drafter_diagnosis import heldout_answers, shown

    import mlx_glimmer
    from mlx_glimmer.cpu import cpu_facts
    from mlx_glimmer.demo import demo_bundle
    from mlx_glimmer.distill.data import load_prompts
    from mlx_glimmer.paths import DATA_DIR
    from mlx_glimmer.tree import mlx_trees

    budgets = [int(b) for b in args.budgets.split(",")]
    if max(budgets) > TOP:
        raise SystemExit(f"error: --budgets: at most {TOP}")
    tic = time.perf_counter()
    pair = mlx_glimmer.load(demo_bundle(), drafter=Path(args.drafter).resolve())
    prompts = load_prompts(DATA_DIR / "prompts_heldout.jsonl")[: args.prompts]
    answers, _ = heldout_answers(pair, prompts, args.max_tokens, Path(args.cache))
    vals, ids, truth, owner = marginals_at_anchors(pair, answers)
    selection = owner < len(prompts) // 2
    boosts = {"marginal": np.zeros(vals.shape[1]), "depth_boost": depth_boost(vals[selection], ids[selection],
              truth[selection]), "depth_boost_all": depth_boost(vals, ids, truth)}  # fmt: skip
    results = {
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "drafter": shown(Path(args.drafter).resolve()),
        "prompts": len(prompts),
        "selection_prompts": int(len(prompts) // 2),
        "anchors": int(len(vals)),
        "cpu": cpu_facts(),
        "log_k_by_depth": {k: [round(float(x), 3) for x in v] for k, v in boosts.items()},
        "tokens_per_forward": {},
    }
    trees = mlx_trees
    for budget in budgets:
        row = {"chain": chain_committed(ids, truth, budget)}
        for name, offsets in boosts.items():
            row[name] = committed(trees, vals, ids, truth, budget, offsets)
        results["tokens_per_forward"][str(budget)] = {
            name: {"all": round(float(v.mean()), 4), "not_selected": round(float(v[~selection].mean()), 4)}
            for name, v in row.items()
        }
        print(f"budget {budget}: {results['tokens_per_forward'][str(budget)]}", file=sys.stderr, flush=True)
    results["seconds"] = round(time.perf_counter() - tic, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
