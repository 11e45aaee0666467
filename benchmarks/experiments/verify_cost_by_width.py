"""What one target verify costs at every width from 1 to 32, not only at the widths `auto` measures.

    python benchmarks/experiments/verify_cost_by_width.py [BUNDLE] [--contexts 32,300] [--repeats 3]
        [--out benchmarks/experiments/results/verify_cost_by_width.json]

Times the target call of each width (forward, head and the argmax read back) after each context length, the way
`verify_cost.measure_verify_cost` times its few widths: the best of `--repeats` runs after one warm-up, on a
cache of its own. Also reports, per context, the widths that cost more than a wider one. Why a round verifies
only widths the cost table measured (`VerifyCost.widths`): where a matrix kernel tiles rows, the cost between two
measured widths is not the line between them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mlx_glimmer.bench import environment, portable_path
from mlx_glimmer.blas import ensure_fast_blas
from mlx_glimmer.loading import load
from mlx_glimmer.paths import cache_dir
from mlx_glimmer.verify_cost import MEASURED_WIDTHS, band_of, measure_verify_cost

WIDEST = 32


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", nargs="?", default=None)
    ap.add_argument("--contexts", default="32,300", help="context lengths to time after (comma-separated)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--note", default="", help="what else ran")
    ap.add_argument("--out", default="benchmarks/experiments/results/verify_cost_by_width.json")
    args = ap.parse_args()
    ensure_fast_blas(cache_dir() / "blas")
    bundle = args.bundle or str(cache_dir() / "demo")
    pair = load(bundle, use_drafter=False)
    target = pair.target
    report = {
        "command": "python benchmarks/experiments/verify_cost_by_width.py"
        + (f" {portable_path(bundle)}" if args.bundle else "")
        + f" --contexts {args.contexts} --repeats {args.repeats}",
        "environment": environment(pair),
        "note": args.note,
        "measured_widths": list(MEASURED_WIDTHS),
        "contexts": {},
    }
    for context in (int(c) for c in args.contexts.split(",")):
        cost = measure_verify_cost(
            target, WIDEST, target.vocab_size, contexts=(context,), repeats=args.repeats, widths=range(1, WIDEST + 1)
        )
        ms = [round(1000 * s, 2) for s in cost.seconds[band_of(context)]]
        dearer = [w for w in range(1, WIDEST) if ms[w - 1] > min(ms[w:])]
        report["contexts"][str(context)] = {
            "ms_by_width": {str(w): ms[w - 1] for w in range(1, WIDEST + 1)},
            "dearer_than_a_wider_width": dearer,
        }
        print(f"context {context}: " + " ".join(f"{w}:{ms[w - 1]:.0f}" for w in range(1, WIDEST + 1)), flush=True)
        print(f"  widths dearer than a wider one: {dearer}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
