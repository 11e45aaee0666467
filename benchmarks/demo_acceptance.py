"""Held-out acceptance of the demo pair: tokens committed per target forward on every held-out prompt.

    python benchmarks/demo_acceptance.py [BUNDLE] [--max-tokens 128] [--block-size 16] [--out FILE]
    python benchmarks/demo_acceptance.py --temp 0.7 ...   # sampled: prompt i with seed i + 1

Every held-out prompt (mlx_glimmer/data/prompts_heldout.jsonl), chat template
applied, greedy (or sampled at `--temp`), a chain of `--block-size` (16), 128 new tokens:
tokens committed per target forward, per prompt and overall, and the share of rounds that
commit at least k tokens (k = 1..block: where drafts stop being accepted); always checks
each answer equals plain decoding, greedy or at the same seed (a published acceptance
figure comes from a checked run; there is no switch to skip it). Counts, not times: the
figures do not depend on the machine's load.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import mlx_glimmer
from mlx_glimmer.bench import portable_path
from mlx_glimmer.blas import ensure_fast_blas
from mlx_glimmer.cpu import cpu_facts
from mlx_glimmer.demo import demo_bundle
from mlx_glimmer.distill.data import load_prompts
from mlx_glimmer.paths import DATA_DIR, cache_dir


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle", nargs="?")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument(
        "--temp", type=float, default=0.0, help="sampling temperature (0: greedy); prompt i gets seed i + 1"
    )
    ap.add_argument("--out", default="benchmarks/results/demo_acceptance.json")
    args = ap.parse_args()
    ensure_fast_blas(cache_dir() / "blas")  # as the `mlx-glimmer` command does: re-executes with OpenBLAS on Linux
    pair = mlx_glimmer.load(args.bundle or demo_bundle())
    prompts = load_prompts(DATA_DIR / "prompts_heldout.jsonl")[: args.limit]
    rows, tokens, forwards, mismatches, lengths = [], 0, 0, 0, []
    for i, p in enumerate(prompts):
        msgs = [{"role": "user", "content": p}]
        settings = dict(max_tokens=args.max_tokens, temperature=args.temp, seed=i + 1)
        r = mlx_glimmer.generate(pair, msgs, block_size=args.block_size, tree="off", **settings)
        same = r.token_ids == mlx_glimmer.generate(pair, msgs, speculative=False, **settings).token_ids
        mismatches += not same
        tokens += sum(r.stats.acceptance_lengths)
        forwards += r.stats.target_forwards
        lengths += r.stats.acceptance_lengths
        rows.append(
            {
                "prompt": p,
                "mean_acceptance": r.stats.mean_acceptance,
                "tokens": r.stats.generated_tokens,
                "target_forwards": r.stats.target_forwards,
                "equals_plain": same,
            }
        )
        print(f"{i + 1}/{len(prompts)} acceptance {r.stats.mean_acceptance:.2f}", file=sys.stderr, flush=True)
    per = [r["mean_acceptance"] for r in rows]
    summary = {
        "bundle": portable_path(pair.target_path.parent),
        "drafter": portable_path(pair.drafter_path),
        "prompts": len(rows),
        "max_tokens": args.max_tokens,
        "block_size": args.block_size,
        "temperature": args.temp,
        "cpu": cpu_facts(),
        "mean_acceptance": tokens / max(forwards, 1),
        "per_prompt_median": statistics.median(per),
        "per_prompt_min": min(per),
        "per_prompt_max": max(per),
        "plain_mismatches": mismatches,
        "rounds_committing_at_least": [
            sum(n >= k for n in lengths) / max(len(lengths), 1) for k in range(1, args.block_size + 1)
        ],
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
