"""Plain decode speed on a CPU by OpenBLAS thread count, on an idle machine and beside busy processes.

    python benchmarks/experiments/blas_threads_under_load.py [BUNDLE] [--threads default,1] [--busy 2]
        [--max-tokens 64] [--rounds 2] [--out benchmarks/experiments/results/blas_threads_under_load.json]

BUNDLE defaults to the demo pair. Each case runs `mlx-glimmer generate BUNDLE --chat --no-spec --json` in a process of
its own with OPENBLAS_NUM_THREADS set (`default`: unset, OpenBLAS takes every core), once with the machine as it
is and once beside `--busy` processes that each keep a core busy (a Python loop, the kind of neighbour a shared
machine has); the cases take turns for `--rounds` rounds and the results file keeps every decode rate, the
median per case, the CPU and the load average. Linux and OpenBLAS only: MLX on Apple silicon does not use it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMAND = Path(sys.executable).parent / "mlx-glimmer"
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def decode_rate(bundle: str, threads: str, max_tokens: int) -> float:
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    if threads != "default":
        env["OPENBLAS_NUM_THREADS"] = threads
    cmd = [str(COMMAND), "generate", bundle, "--chat", "--prompt", PROMPT, "--max-tokens", str(max_tokens), "--no-spec"]
    out = subprocess.run([*cmd, "--json"], env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["decode_tokens_per_second"]


def busy_neighbours(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def main(argv=None) -> int:
    from mlx_glimmer.cpu import cpu_facts
    from mlx_glimmer.demo import demo_bundle

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", nargs="?", help="a converted bundle (default: the demo pair)")
    ap.add_argument("--threads", default="default,1", help="OPENBLAS_NUM_THREADS values, comma-separated")
    ap.add_argument("--busy", type=int, default=os.cpu_count() or 1, help="busy neighbours (default: one a core)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--note", default="", help="what else ran on the machine meanwhile")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/experiments/results/blas_threads_under_load.json"))
    args = ap.parse_args(argv)
    bundle = args.bundle or str(demo_bundle())
    threads = args.threads.split(",")
    rates: dict[str, list[float]] = {}
    decode_rate(bundle, threads[0], 8)  # first use: builds or warms what the runs read
    for _ in range(args.rounds):
        for load in ("idle", "busy"):
            neighbours = busy_neighbours(args.busy) if load == "busy" else []
            try:
                for t in threads:
                    rate = decode_rate(bundle, t, args.max_tokens)
                    rates.setdefault(f"{load}, OPENBLAS_NUM_THREADS={t}", []).append(rate)
                    print(f"{load:5s} threads={t:8s} {rate:6.2f} tok/s", file=sys.stderr)
            finally:
                for p in neighbours:
                    p.kill()
                    p.wait()
    result = {
        "command": shlex.join(["python", *sys.argv]),
        "cpu": cpu_facts(),
        "bundle": "demo" if args.bundle is None else args.bundle,
        "busy_neighbours": args.busy,
        "max_tokens": args.max_tokens,
        "note": args.note,
        "load_average_at_end": list(os.getloadavg()),
        "decode_tokens_per_second": {case: {"median": statistics.median(r), "runs": r} for case, r in rates.items()},
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["decode_tokens_per_second"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
