"""Rounds per second of the speculative loop: this tree against an older commit, side by side.

    python benchmarks/experiments/loop_overhead.py                         # tiny pair, fixed block 16, vs 33dcc75
    python benchmarks/experiments/loop_overhead.py --old 33dcc75 --tokens 400 --repeats 5 --out benchmarks/experiments/results/loop_overhead.json
    python benchmarks/experiments/loop_overhead.py --bench-full            # also `bench --full` on the demo pair in both trees

On the tiny test pair (hidden 64, 8 layers, the random assistant) a round is almost all host work, so rounds
per second measure the loop's own overhead: host reads, graph building, bookkeeping. The bar is >= 1.2x
over 33dcc75 at fixed block 16. The old commit is checked out once as a `git worktree` under /tmp (read-only use;
nothing in this repository's git state changes) and imported in a subprocess with its root first on
`sys.path`; the current tree runs the same worker the same way. Runs alternate old / new for `--repeats`
passes so drift (other load, thermals) falls on both alike. Both use the same BLAS (the OpenBLAS preload this
tree's `mlx-glimmer` command would pick) and the same thread settings; greedy outputs must agree between the
trees (checked). Needs an idle machine for numbers worth reporting.

`--bench-full` additionally runs `mlx-glimmer bench --full --no-baseline` on the demo pair (built by
`mlx-glimmer demo`, or `--bundle`) in both trees: the shipped drafter at `--block-sizes auto,16` and a
scrambled drafter that accepts nothing (benchmarks/make_scrambled_drafter.py) at `--block-sizes auto`, and
records each method's median per-prompt speed-up over plain (bars: scrambled auto >= 0.97x plain; shipped
auto not slower than before).

Writes a JSON report (`--out`, default benchmarks/experiments/results/loop_overhead.json) and prints a summary table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROMPT = [256] + list(b"Once upon a time")

WORKER = r"""
import hashlib, inspect, json, sys, time
tree, target, drafter, block, tokens, measures, warmup = sys.argv[1:8]
sys.path.insert(0, tree)
import mlx_glimmer
from mlx_glimmer.speculative import generate_steps
assert mlx_glimmer.__file__.startswith(tree), (mlx_glimmer.__file__, tree)
pair = mlx_glimmer.load(target=target, drafter=drafter)
prompt = json.loads(sys.argv[8])
block, tokens = int(block), int(tokens)
if "settings" in inspect.signature(generate_steps).parameters:  # the loop takes a GenerationSettings
    from mlx_glimmer.settings import GenerationSettings
    def steps(n):
        return generate_steps(pair.target, prompt, GenerationSettings(max_tokens=n, block_size=block), drafter=pair.drafter)
else:  # an older tree: the loop takes keywords
    def steps(n):
        return generate_steps(pair.target, prompt, drafter=pair.drafter, block_size=block, max_tokens=n)
for _ in range(int(warmup)):
    list(steps(64))
out = []
for _ in range(int(measures)):
    ids, first, last, rounds = [], None, None, 0
    for i, step in enumerate(steps(tokens)):
        now = time.perf_counter()
        ids.extend(step.tokens)
        if i == 0:
            first = now
        else:
            rounds, last = rounds + 1, now
    out.append({"rounds": rounds, "tokens": len(ids), "seconds": last - first, "rounds_per_second": rounds / (last - first),
                "tokens_sha": hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]})
print("RESULT " + json.dumps(out))
"""


def worktree(commit: str) -> Path:
    """A detached worktree of `commit` under /tmp (made once; this repository's branches and index stay as
    they are)."""
    full = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", commit], capture_output=True, text=True, check=True
    ).stdout.strip()
    path = Path(tempfile.gettempdir()) / f"mlx-glimmer-{full[:12]}"
    if not (path / "mlx_glimmer").is_dir():
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), full], check=True, capture_output=True
        )
    return path


def child_env(threads: int | None) -> dict:
    """One environment for both trees: this tree's BLAS choice, optional thread caps."""
    sys.path.insert(0, str(ROOT))
    from mlx_glimmer.blas import reexec_env
    from mlx_glimmer.paths import cache_dir

    env = reexec_env(cache_dir() / "blas") or dict(os.environ)
    env.pop("PYTHONPATH", None)
    if threads:
        for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env[name] = str(threads)
    return env


def tiny_pair(where: Path) -> tuple[Path, Path]:
    """The tests' tiny Muse pair (window 8, assistant reading layers 1, 3, 5), built with transformers."""
    sys.path.insert(0, str(ROOT / "tests"))
    import tiny_checkpoints as tc

    target, drafter = where / "muse", where / "assistant"
    if not (target / "config.json").is_file():
        tc.build_muse_target(target, max_shard_size="200KB")
        tc.build_assistant(drafter, target_layer_ids=[1, 3, 5])
    return target, drafter


def run_worker(tree: Path, target: Path, drafter: Path, args, env: dict) -> list[dict]:
    cmd = [
        sys.executable,
        "-c",
        WORKER,
        str(tree),
        str(target),
        str(drafter),
        str(args.block_size),
        str(args.tokens),
        str(args.measures),
        str(args.warmup),
        json.dumps(PROMPT),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tempfile.gettempdir())
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"worker for {tree} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def bench_full(tree: Path, bundle: Path, drafter: Path | None, sizes: str, out: Path, env: dict) -> dict:
    code = "import sys; sys.path.insert(0, sys.argv[1]); from mlx_glimmer.cli import main; sys.exit(main(sys.argv[2:]))"
    cmd = [
        sys.executable,
        "-c",
        code,
        str(tree),
        "bench",
        str(bundle),
        "--full",
        "--no-baseline",
        "--block-sizes",
        sizes,
        "--json-out",
        str(out),
    ]
    if drafter is not None:
        cmd += ["--drafter", str(drafter)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tempfile.gettempdir())
    if proc.returncode != 0:
        raise SystemExit(f"bench in {tree} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    report = json.loads(out.read_text())
    return {
        m: {
            "tokens_per_second": r["tokens_per_second"],
            "median_speedup_over_plain": r["median_speedup_over_plain"],
            "mismatches": r["mismatches"],
        }
        for m, r in report["results"].items()
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", default="33dcc75", help="the commit to compare against (default 33dcc75)")
    ap.add_argument("--new", default=None, help="a commit for the new side (default: this working tree as it is)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=300, help="tokens per measured generation (default 300)")
    ap.add_argument("--measures", type=int, default=3, help="measured generations per worker run (default 3)")
    ap.add_argument("--repeats", type=int, default=3, help="alternating old/new worker runs (default 3)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None, help="cap BLAS/OpenMP threads in both trees")
    ap.add_argument("--work", default=None, help="where to build the tiny pair (default: a temporary folder)")
    ap.add_argument("--bench-full", action="store_true", help="also `bench --full` on the demo pair in both trees")
    ap.add_argument("--bundle", default=None, help="the bundle for --bench-full (default: the demo pair)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "experiments" / "results" / "loop_overhead.json"))
    args = ap.parse_args(argv)

    env = child_env(args.threads)
    trees = {"old": worktree(args.old), "new": worktree(args.new) if args.new else ROOT}
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="loop-overhead-"))
    target, drafter = tiny_pair(work)
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    for rep in range(args.repeats):
        for side in ("old", "new") if rep % 2 == 0 else ("new", "old"):
            runs[side] += run_worker(trees[side], target, drafter, args, env)
            last = runs[side][-1]
            print(
                f"[loop_overhead] pass {rep + 1}/{args.repeats} {side}: {last['rounds_per_second']:.1f} rounds/s "
                f"({last['rounds']} rounds, {last['tokens']} tokens)",
                file=sys.stderr,
                flush=True,
            )
    median = {side: statistics.median(r["rounds_per_second"] for r in rs) for side, rs in runs.items()}
    shas = {r["tokens_sha"] for rs in runs.values() for r in rs}
    report = {
        "what": "rounds per second of generate_steps, tiny Muse pair, greedy, fixed block size",
        "block_size": args.block_size,
        "tokens": args.tokens,
        "prompt": PROMPT,
        "trees": {"old": args.old, "new": args.new or "working tree"},
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
            "blas": env.get("MLX_GLIMMER_BLAS"),
            "threads": args.threads,
        },
        "runs": runs,
        "median_rounds_per_second": median,
        "ratio_new_over_old": median["new"] / median["old"],
        "outputs_identical": len(shas) == 1,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if args.bench_full:
        sys.path.insert(0, str(ROOT))
        from mlx_glimmer.demo import demo_bundle

        bundle = Path(args.bundle) if args.bundle else demo_bundle()
        scrambled = work / "scrambled"
        if not (scrambled / "config.json").is_file():
            subprocess.run(
                [
                    sys.executable,
                    str(ROOT / "benchmarks" / "make_scrambled_drafter.py"),
                    str(bundle / "drafter"),
                    str(scrambled),
                ],
                check=True,
                env=env,
            )
        report["bench_full"] = {
            side: {
                "shipped": bench_full(tree, bundle, None, "auto,16", work / f"bench_{side}_shipped.json", env),
                "scrambled": bench_full(tree, bundle, scrambled, "auto", work / f"bench_{side}_scrambled.json", env),
            }
            for side, tree in trees.items()
        }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"| tree | rounds/s (median of {len(runs['new'])}) |\n|---|---|")
    for side in ("old", "new"):
        print(f"| {report['trees'][side]} | {median[side]:.1f} |")
    print(
        f"new / old: {report['ratio_new_over_old']:.2f}x (the bar is >= 1.2x); "
        f"outputs {'identical' if report['outputs_identical'] else 'DIFFER'}"
    )
    for side, methods in report.get("bench_full", {}).items():
        for drafter_name, res in methods.items():
            ratios = ", ".join(f"{m} {r['median_speedup_over_plain']:.2f}x" for m, r in res.items() if m != "plain")
            print(f"bench --full [{side}, {drafter_name} drafter]: {ratios}")
    print(f"report: {out}")
    return 0 if report["outputs_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
