"""Held-out acceptance of distilled drafters against target tokens seen and against steps: JSON + PNG.

    python benchmarks/experiments/scaling_curve.py RUN [RUN ...] [--continues LATER=EARLIER ...] [--out benchmarks/experiments/results/scaling_curve]

Each RUN is a `mlx-glimmer distill` run directory or its log.json (kept copies,
like benchmarks/experiments/distill/demo2/run_*.log.json, name the run by file name); the log holds one evaluation
per `--eval-every` steps (held-out prompts, chat template, greedy, block 16:
tokens committed per target forward, measured with the real speculative loop).
Writes OUT.json (every run's settings and points) and OUT.png (two panels:
acceptance vs target tokens seen, acceptance vs optimiser steps). `--continues LATER=EARLIER` (run
names) says LATER was warm-started from the drafter EARLIER exported: LATER's steps and tokens are then
counted from EARLIER's exported evaluation, so the two read as one training history. Needs
matplotlib for the PNG (`pip install -e ".[bench]"`).
"""

import argparse
import json
import sys
from pathlib import Path


def run_points(run: Path) -> dict:
    log = json.loads((run if run.is_file() else run / "log.json").read_text())
    config = log.get("config", {})
    points = sorted(log["evaluations"], key=lambda e: e["step"])
    return {
        "run": run.name.removesuffix(".log.json") if run.is_file() else run.name,
        "command": log.get("command"),
        "answers": log.get("answers"),
        "target_tokens": log.get("target_tokens"),
        "draft_vocab": log.get("draft_vocab"),
        "draft_vocab_coverage": log.get("draft_vocab_coverage"),
        "layers": config.get("layers"),
        "init": config.get("init"),
        "backend": config.get("backend"),
        "eval": log.get("eval"),
        "points": [
            {
                "step": e["step"],
                "target_tokens_seen": e["target_tokens_seen"],
                "sequences_seen": e["sequences_seen"],
                "mean_acceptance": e["mean_acceptance"],
                "block_positions_per_second": e.get("block_positions_per_second"),
            }
            for e in points
        ],
    }


def continue_from(later: dict, earlier: dict, exported: dict) -> None:
    """Count `later`'s steps, answers and tokens from `earlier`'s exported evaluation (and from whatever
    `earlier` itself continues, so a chain of warm starts reads as one history)."""
    base = earlier.get("continues", {}).get("offset", {})
    offset = {k: exported[k] + base.get(k, 0) for k in ("step", "target_tokens_seen", "sequences_seen")}
    later["continues"] = {"run": earlier["run"], "step": exported["step"], "offset": offset}
    for p in later["points"]:
        for k, v in offset.items():
            p[k] += v


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--continues", action="append", default=[], metavar="LATER=EARLIER")
    ap.add_argument("--out", default="benchmarks/experiments/results/scaling_curve")
    args = ap.parse_args()
    runs = [run_points(Path(r)) for r in args.runs]
    by_name = {r["run"]: (r, Path(path)) for r, path in zip(runs, args.runs)}
    parent = {}
    for pair in args.continues:
        later, _, earlier = pair.partition("=")
        if later not in by_name or earlier not in by_name or later == earlier:
            sys.exit(f"error: --continues {pair}: name two of the runs given ({', '.join(by_name)})")
        parent[later] = earlier
    done = set()

    def resolve(name: str, seen: tuple = ()) -> None:
        if name in done or name not in parent:
            return
        if name in seen:
            sys.exit(f"error: --continues: a cycle through {name}")
        earlier = parent[name]
        resolve(earlier, (*seen, name))
        path = by_name[earlier][1]
        exported = json.loads((path if path.is_file() else path / "log.json").read_text()).get("exported")
        if not exported:
            sys.exit(f"error: --continues {name}={earlier}: {path} records no exported drafter")
        continue_from(by_name[name][0], by_name[earlier][0], exported)
        done.add(name)

    for name in parent:
        resolve(name)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]), "runs": runs}
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in runs:
        start = f"continues {r['continues']['run']}" if "continues" in r else f"init {r['init']}"
        label = f"{r['run']} ({r['layers']} layers, {start})"
        xs = [p["target_tokens_seen"] / 1e6 for p in r["points"]]
        ys = [p["mean_acceptance"] for p in r["points"]]
        left.plot(xs, ys, marker="o", label=label)
        right.plot([p["step"] for p in r["points"]], ys, marker="o", label=label)
    for ax, xlabel in ((left, "target tokens seen (millions)"), (right, "optimiser steps")):
        ax.axhline(3.0, color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out tokens per target forward (block 16)")
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    fig.suptitle("Demo drafter distillation: held-out acceptance (greedy, chat template); dashed: the 3.0 bar")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
