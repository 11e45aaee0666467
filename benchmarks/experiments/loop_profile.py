"""Where a speculative round's time goes on this machine: MLX evaluation against the loop's own host work.

    python benchmarks/experiments/loop_profile.py [--tokens 300] [--block-size 16] [--out benchmarks/experiments/results/loop_profile.json]

The tiny test pair (the one `loop_overhead.py` times), greedy, fixed block size, under cProfile. Every
blocking MLX call of the loop goes through the `TargetModel` seam (`launch`: `mx.async_eval`, `sync`:
`mx.eval`, `read`: the one `.tolist()` of a round), so the time inside those three is time the host spends
waiting on MLX's evaluation; the rest is the loop's own Python (graph building, bookkeeping, the
profiler's overhead). If the host share is s, removing every bit of host work could raise rounds per second
by at most 1 / (1 - s). cProfile inflates Python time, so the share it reports is an upper bound.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "experiments"))

BLOCKING = ("launch", "sync", "read")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "experiments" / "results" / "loop_profile.json"))
    args = ap.parse_args(argv)

    from mlx_glimmer.blas import ensure_fast_blas
    from mlx_glimmer.paths import cache_dir

    ensure_fast_blas(cache_dir() / "blas")
    import loop_overhead

    import mlx_glimmer
    from mlx_glimmer.settings import GenerationSettings
    from mlx_glimmer.speculative import generate_steps
    from mlx_glimmer.target import Target

    target_dir, drafter_dir = loop_overhead.tiny_pair(Path(tempfile.mkdtemp(prefix="loop-profile-")))
    pair = mlx_glimmer.load(target=target_dir, drafter=drafter_dir)

    settings = GenerationSettings(max_tokens=args.tokens, block_size=args.block_size)

    def run() -> tuple[int, float]:
        rounds, tic = 0, time.perf_counter()
        for _ in generate_steps(pair.target, loop_overhead.PROMPT, settings, drafter=pair.drafter):
            rounds += 1
        return rounds, time.perf_counter() - tic

    run()  # warm-up
    plain = [run() for _ in range(3)]
    profiler = cProfile.Profile()
    profiler.enable()
    rounds, seconds = run()
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    blocking = {
        name: sum(v[3] for k, v in stats.items() if k[2] == name and k[0].endswith("target.py")) for name in BLOCKING
    }
    waiting = sum(blocking.values())
    host_share = 1 - waiting / seconds
    report = {
        "what": "tiny pair, greedy, fixed block size: time inside the loop's blocking MLX calls vs the rest",
        "block_size": args.block_size,
        "tokens": args.tokens,
        "rounds_per_second_unprofiled": [round(r / s, 1) for r, s in plain],
        "profiled": {"rounds": rounds, "seconds": round(seconds, 3)},
        "seconds_in_blocking_mlx_calls": {k: round(v, 3) for k, v in blocking.items()},
        "host_share_upper_bound": round(host_share, 4),
        "most_rounds_per_second_gain_from_host_work": round(1 / (1 - host_share), 3),
        "target_class": Target.__name__,
        "machine": {"platform": platform.platform(), "load_average": list(os.getloadavg())},
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
