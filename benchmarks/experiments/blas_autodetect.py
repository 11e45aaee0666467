"""Plain decoding of the demo with the BLAS the command picks by itself, side by side with a manual OpenBLAS preload.

    python benchmarks/experiments/blas_autodetect.py [--rounds 3] [--max-tokens 64] [--out benchmarks/experiments/results/blas_autodetect.json]

Each round runs `mlx-glimmer generate --no-spec --json` three ways, interleaved:
`preloaded` (LD_PRELOAD set by hand, as the README once told users to),
`automatic` (no LD_PRELOAD: the command re-executes itself with an OpenBLAS),
`reference` (MLX_GLIMMER_BLAS=reference: MLX's bundled BLAS). Reports median
decode tokens/s per way and the automatic/preloaded ratio; also checks that
all three produced the same tokens.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

PROMPT = "Explain in three sentences why the sky is blue."
SYSTEM_OPENBLAS = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"


def run(env: dict, max_tokens: int) -> dict:
    exe = shutil.which("mlx-glimmer") or str(Path(sys.executable).parent / "mlx-glimmer")
    out = subprocess.run(
        [exe, "generate", "--chat", "--prompt", PROMPT, "--no-spec", "--max-tokens", str(max_tokens), "--json"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--openblas", default=SYSTEM_OPENBLAS, help="library to preload by hand for the comparison")
    ap.add_argument("--out", default="benchmarks/experiments/results/blas_autodetect.json")
    args = ap.parse_args()
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MLX_GLIMMER_BLAS", "LD_LIBRARY_PATH")}
    ways = {
        "preloaded": {**base, "LD_PRELOAD": args.openblas},
        "automatic": dict(base),
        "reference": {**base, "MLX_GLIMMER_BLAS": "reference"},
    }
    rates = {w: [] for w in ways}
    tokens = {}
    for r in range(args.rounds):
        for way, env in ways.items():
            result = run(env, args.max_tokens)
            rates[way].append(result["decode_tokens_per_second"])
            tokens.setdefault(way, result["token_ids"])
            print(
                f"round {r + 1}/{args.rounds} {way}: {result['decode_tokens_per_second']:.1f} tok/s",
                file=sys.stderr,
                flush=True,
            )
    median = {w: statistics.median(v) for w, v in rates.items()}
    report = {
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "decode_tokens_per_second": rates,
        "median": median,
        "automatic_over_preloaded": median["automatic"] / median["preloaded"],
        "reference_over_preloaded": median["reference"] / median["preloaded"],
        "same_tokens": tokens["automatic"] == tokens["preloaded"] == tokens["reference"],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "decode_tokens_per_second"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
