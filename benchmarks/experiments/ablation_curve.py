"""The recipe ablations' scaling curve: held-out accuracy and acceptance against supervised block positions,
one line per arm, from the summary `drafter_ablation.py` writes. JSON + PNG.

    python benchmarks/experiments/ablation_curve.py [--summary benchmarks/experiments/results/drafter_ablation.json]
        [--out benchmarks/experiments/results/ablation_curve]

Left panel: teacher-forced accuracy at block position 1 on the target's greedy answers to all 75 held-out
prompts, one line per training run: a run with `--evals K` is measured at each checkpoint it kept, a
screening run at its end alone (one point). An arm's runs share a colour; a warm start (hollow square) is
placed by its own training's positions, not those of the drafter it started from.
Right panel: the held-out acceptance `distill` measured during each run (tokens per target forward on its
first 4 held-out prompts x 96 tokens), one line per row with more than one evaluation (`--evals K`). The
shipped drafter (`chain`, trained by a chain of fine-tunes, not at a known equal budget) is a dashed line.
Needs matplotlib for the PNG (`pip install -e ".[bench]"`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def curves(summary: dict) -> dict:
    """Per arm, per row (one training run): its held-out teacher-forced points as (block positions, TF accuracy
    at positions 1-3, held-out loss), the run's own checkpoints where `--evals K` kept them, else its end alone;
    the row's tokens per forward; and distill's in-run held-out acceptance as (block positions, acceptance)."""
    arms: dict[str, dict] = {}
    reference = None
    for row in summary["rows"]:
        if row["steps"] is None:
            reference = {"arm": row["arm"], "tf_accuracy_1": row["heldout_tf_accuracy"][0]}
            continue
        per_step = row["nominal_block_positions"] / row["steps"]
        entry = arms.setdefault(
            row["arm"],
            # a warm start's positions count its own training only, not those of the drafter it started from
            {"arm": row["arm"], "what": row["what"], "warm_start": "--init" in (row.get("flags") or []), "rows": []},
        )
        points = row.get("curve") or [
            {
                "block_positions": row["nominal_block_positions"],
                "heldout_tf_accuracy": row["heldout_tf_accuracy"][:3],
                "heldout_loss": row["heldout_loss"],
            }
        ]
        evaluations = [e for e in row.get("evaluations", []) if e.get("mean_acceptance") is not None]
        entry["rows"].append(
            {
                "run": row["run"],
                "block_positions": row["nominal_block_positions"],
                "tokens_per_forward": row["tokens_per_forward"],
                "acceptance_prompts": row["acceptance_prompts"],
                "heldout_tf": [
                    {k: p[k] for k in ("block_positions", "heldout_tf_accuracy", "heldout_loss")} for p in points
                ],
                "distill_acceptance": [
                    {"block_positions": round(e["step"] * per_step), "mean_acceptance": e["mean_acceptance"]}
                    for e in sorted(evaluations, key=lambda e: e["step"])
                ],
            }
        )
    for entry in arms.values():
        entry["rows"].sort(key=lambda r: r["block_positions"])
    return {"reference": reference, "arms": list(arms.values())}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    palette = plt.get_cmap("tab20").colors
    for index, entry in enumerate(report["arms"]):
        color = palette[index % len(palette)]
        for row in entry["rows"]:
            label = row["run"].rsplit("/", 1)[-1]
            left.plot(
                [p["block_positions"] / 1e6 for p in row["heldout_tf"]],
                [100 * p["heldout_tf_accuracy"][0] for p in row["heldout_tf"]],
                marker="s" if entry["warm_start"] else "o",
                fillstyle="none" if entry["warm_start"] else "full",
                color=color,
                label=f"{label} (warm start: its own positions)" if entry["warm_start"] else label,
            )
            if len(row["distill_acceptance"]) > 1:
                right.plot(
                    [p["block_positions"] / 1e6 for p in row["distill_acceptance"]],
                    [p["mean_acceptance"] for p in row["distill_acceptance"]],
                    marker="o",
                    color=color,
                    label=row["run"].rsplit("/", 1)[-1],
                )
    if report["reference"]:
        left.axhline(
            100 * report["reference"]["tf_accuracy_1"], color="grey", linestyle="--", label="shipped drafter (chain)"
        )
    left.set_ylabel("held-out teacher-forced accuracy at position 1 (%)")
    right.set_ylabel("held-out tokens per target forward (4 prompts, block 16)")
    for ax in (left, right):
        ax.set_xlabel("supervised block positions (millions)")
        ax.set_xlim(left=0)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle("Drafter recipe ablations: held-out accuracy against training volume (greedy, chat template)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--summary", default=str(ROOT / "benchmarks" / "experiments" / "results" / "drafter_ablation.json"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "experiments" / "results" / "ablation_curve"))
    args = ap.parse_args(argv)
    summary_path = Path(args.summary)
    if not summary_path.is_file():
        sys.exit(f"error: {summary_path}: no ablation summary (run benchmarks/experiments/drafter_ablation.py first)")
    report = {
        "command": " ".join(["python", Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "summary": summary_path.resolve().relative_to(ROOT).as_posix()
        if summary_path.resolve().is_relative_to(ROOT)
        else summary_path.name,
        **curves(json.loads(summary_path.read_text())),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    plot(report, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
