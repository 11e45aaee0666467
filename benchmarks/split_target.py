"""A target split over two processes (`mlx.launch -n 2 --backend ring`, loopback) against the same target in one
process: memory per process and plain greedy decoding speed.

    python benchmarks/split_target.py [--dir DIR] [--tokens 200] [--json-out benchmarks/results/split_target.json]

The target is `benchmarks/tiny_muse.py`'s random Muse Glimmer (hidden 512, 8 layers, built once into DIR): its
decoder layers hold most of its weights, as a real target's do, and its heads (8 query, 2 key/value) split
over two processes. The same worker (`--worker`) runs as one process and on two ranks; each process reports
the bytes of weights it holds (all, and of the decoder layers), MLX's peak memory after loading and while
generating, and its decode rate. Both runs preload the OpenBLAS the `mlx-glimmer` command would use.

Decode speed on one machine over loopback says little about two Macs over Thunderbolt: each split layer adds
two sums across the processes per forward, which here cost socket round trips between processes that share
the same cores (and, on a busy machine, wait for the scheduler). The results file records the machine's load
average before and after, and calls its speeds indicative.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROMPT = "Once upon a time, in a city by the sea, there lived"


def worker(target: Path, tokens: int) -> None:
    """Load the target (split when launched on several ranks), decode plainly; rank 0 prints every rank's
    figures as one JSON object."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    import mlx_glimmer
    from mlx_glimmer.ranks import is_lead, world

    mx.reset_peak_memory()
    pair = mlx_glimmer.load(target=target, use_drafter=False)
    load_peak = mx.get_peak_memory()
    params = pair.target.model.parameters()
    weights = sum(v.nbytes for _, v in tree_flatten(params))
    layers = sum(v.nbytes for _, v in tree_flatten(params["model"]["layers"]))
    mlx_glimmer.generate(pair, PROMPT, max_tokens=8, temperature=0, speculative=False)  # warm-up
    mx.reset_peak_memory()
    result = mlx_glimmer.generate(pair, PROMPT, max_tokens=tokens, temperature=0, speculative=False)
    figures = [weights, layers, load_peak, mx.get_peak_memory(), round(result.stats.decode_tokens_per_second * 1000)]
    every = mx.distributed.all_gather(mx.array([figures], mx.int64), group=world()).tolist()
    if is_lead():
        names = ("weight_bytes", "layer_weight_bytes", "load_peak_bytes", "generate_peak_bytes", "decode_mtok_s")
        ranks = [dict(zip(names, row)) for row in every]
        for r in ranks:
            r["decode_tokens_per_second"] = r.pop("decode_mtok_s") / 1000
        print(json.dumps({"ranks": ranks, "token_ids": result.token_ids}), flush=True)


def run(command: list[str], env: dict) -> tuple[dict, float]:
    tic = time.perf_counter()
    out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    lines = out.stdout.splitlines()
    if out.returncode != 0 or len(lines) != 1:
        sys.exit(f"error: {' '.join(command)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return json.loads(lines[0]), time.perf_counter() - tic


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=HERE.parent / ".cache" / "tiny-muse-512")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--json-out", type=Path, default=HERE / "results" / "split_target.json")
    ap.add_argument("--note", default="", help="what else ran on the machine while it measured (kept in the results)")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        worker(args.worker, args.tokens)
        return

    sys.path.insert(0, str(HERE))
    from tiny_muse import ensure_built

    from mlx_glimmer.blas import reexec_env
    from mlx_glimmer.cpu import cpu_facts
    from mlx_glimmer.paths import cache_dir
    from mlx_glimmer.ranks import loopback_ports

    target = ensure_built(args.dir)
    env = reexec_env(cache_dir() / "blas") or dict(os.environ)
    me = [sys.executable, str(Path(__file__).resolve()), "--worker", str(target), "--tokens", str(args.tokens)]
    launch = [str(Path(sys.executable).parent / "mlx.launch"), "-n", "2", "--backend", "ring"]
    load_before = os.getloadavg()
    one, one_s = run(me, env)
    split, split_s = run([*launch, "--starting-port", str(loopback_ports(2)), "--", *me], env)
    load_after = os.getloadavg()
    whole = one["ranks"][0]
    result = {
        "what": "plain greedy decoding of a random Muse Glimmer (hidden 512, 8 layers, float32), one process vs "
        "split over two processes by mlx.launch --backend ring on loopback",
        "command": f"python benchmarks/split_target.py --tokens {args.tokens}",
        "cpu": cpu_facts(),
        "load_average_before": load_before,
        "load_average_after": load_after,
        "blas_threads": {k: os.environ.get(k) for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")},
        "note": args.note,
        "tokens": args.tokens,
        "same_tokens": one["token_ids"] == split["token_ids"],
        "one_process": {**whole, "wall_s": round(one_s, 1)},
        "split_ranks": split["ranks"],
        "split_wall_s": round(split_s, 1),
        "layer_weights_per_rank_vs_one_process": [
            r["layer_weight_bytes"] / whole["layer_weight_bytes"] for r in split["ranks"]
        ],
        "weights_per_rank_vs_one_process": [r["weight_bytes"] / whole["weight_bytes"] for r in split["ranks"]],
        "generate_peak_per_rank_vs_one_process": [
            r["generate_peak_bytes"] / whole["generate_peak_bytes"] for r in split["ranks"]
        ],
        "decode_split_vs_one_process": split["ranks"][0]["decode_tokens_per_second"]
        / whole["decode_tokens_per_second"],
    }
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
