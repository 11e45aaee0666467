"""Drafter recipe ablations at an equal budget of supervised block positions: one row per arm.

    python benchmarks/experiments/drafter_ablation.py [ARM ...] [--budget 3840000] [--accept-prompts 8] [--evals 1]
        [--out benchmarks/experiments/results/drafter_ablation.json]

Every arm trains a demo drafter with `mlx-glimmer distill --train-only` on the same answers
(benchmarks/experiments/distill/demo2, unpacked into runs/demo2/data per its README) and the same target features
(runs/demo2/features, shared by links), from the same seed, for the same nominal number of supervised
block positions: steps x answers per step x anchors x (block - 1), so an arm with 4x the anchors runs
a quarter of the steps. By default nothing is selected during training (one evaluation, at the end, which
`distill` exports); `--evals K` evaluates K times, evenly spaced, and each kept checkpoint is measured by
held-out teacher-forced accuracy (the row's `curve`; `python benchmarks/experiments/ablation_curve.py` draws them). A
row measures the arm's last checkpoint (exported to runs/ablation/ARM-BUDGET/drafter-last where `distill`'s
own pick on its first 4 held-out prompts exported another):

- held-out teacher-forced accuracy per block position on the target's greedy answers to all 75
  held-out prompts (`drafter_diagnosis.py --parts b`: the training step's own forward, cheap and
  deterministic: the screening measure), and the held-out loss;
- real acceptance (`drafter_diagnosis.py --parts c`, block 16, greedy, 128 tokens) on the first
  `--accept-prompts` held-out prompts (the full 75 for finalists), outputs checked against plain greedy;
- the training loss (mean of the last 100 steps' progress lines).

Each arm's run directory is runs/ablation/ARM-BUDGET; each arm's results are
benchmarks/experiments/results/ablation/ARM-BUDGET_{heldout_tf,acceptance}.json (and ARM-BUDGET_stepN_heldout_tf.json per
curve point), with its training log's progress
lines in ARM-BUDGET_train.log; the summary (one row per arm, with
the commands that wrote them) is `--out`. Re-running skips what is done (training resumes from its
checkpoint). Runs one arm at a time: the machine's cores are the trainer's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from mlx_glimmer.distill.run import export

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "runs" / "demo2"
RESULTS = ROOT / "benchmarks" / "experiments" / "results" / "ablation"

# The shipped drafter's recipe (benchmarks/experiments/distill/demo2/README.md), from random init, on all the answers.
BASE = [
    "--prompts", "synth", "--self-instruct", "128", "--follow-ups", "1500", "--temperatures", "0,0.8",
    "--answer-tokens", "256", "--layers", "2", "--sequences-per-step", "4", "--anchors", "64",
    "--draft-vocab", "8192", "--train-backend", "torch", "--init", "random", "--train-only",
    "--eval-prompts", "4", "--eval-tokens", "96",
]  # fmt: skip

SHIPPED = ROOT / "mlx_glimmer" / "data" / "demo_drafter"
ARMS = {
    "chain": (None, "the shipped drafter: a chain of fine-tunes from a 38k-token drafter (not trained here)"),
    # first trained arm: its run computes the shared feature store with the final hidden states soft labels
    # need, which every other arm then reads as it is
    "soft0.5": (["--soft-labels", "0.5"], "labels half the answer's token, half the target's distribution"),
    "scratch": ([], "the shipped recipe from random init on all 1.5M tokens"),
    "seed1": (["--seed", "1"], "the shipped recipe from random init, another seed: the rows' noise"),
    "soft1": (["--soft-labels", "1"], "labels the target's distribution only (KL to the target)"),
    "channel": (["--context-scale", "channel"], "fc trained on features / per-channel RMS"),
    "layers4": (["--layers", "4"], "4 drafter layers instead of 2"),
    "greedy": (["--train-tags", "greedy,followup"], "greedy answers only (no T=0.8 samples)"),
    "lr2x": (["--lr", "1.2e-3"], "peak learning rate 1.2e-3 instead of 6e-4"),
    "anchors256": (["--anchors", "256"], "256 blocks per answer per step instead of 64 (a quarter of the steps)"),
    "anchors16": (["--anchors", "16"], "16 blocks per answer per step instead of 64 (four times the steps)"),
    "mlp2x": (["--mlp-width", "2"], "each layer's MLP twice the target's width (3,072 instead of 1,536)"),
    # the screening winners together (layers4, greedy, lr2x)
    "combined": (
        ["--layers", "4", "--train-tags", "greedy,followup", "--lr", "1.2e-3"],
        "4 layers, greedy answers and second turns only, peak learning rate 1.2e-3",
    ),
    # not an equal-budget row: the chain's drafter plus one screening budget of the greedy lever
    "chain+greedy": (
        ["--init", str(SHIPPED.relative_to(ROOT)), "--train-tags", "greedy,followup"],
        "the shipped drafter fine-tuned on greedy answers and second turns only (the chain's budget plus this one)",
    ),
    # a start from the target's own layers, against the 4-layer default recipe (row layers4): the last four
    # (26-29; the deepest captured layer is 27) or the two after the deepest captured one, then identity layers
    "target": (
        ["--layers", "4", "--init", "target"],
        "4 layers started as the target's last four, fc passing layer 27 on",
    ),
    "target28": (
        ["--layers", "4", "--init", "target:28,29"],
        "4 layers started as the target's layers after the deepest captured one (28, 29), then 2 identity layers",
    ),
    # prompt diversity at an equal token count: a subset of the answers each (see `subset_positions`)
    "prompts1x": ([], "greedy + T=0.8 answers to the 1,728 prompts that have both (3,456 answers)"),
    "prompts2x": ([], "greedy answers to 3,456 distinct prompts: twice the prompts, the same answer count"),
}
SUBSET_ARMS = ("prompts1x", "prompts2x")


def with_arm(base: list[str], extra: list[str]) -> list[str]:
    """`base` with every flag `extra` sets replaced by `extra`'s (so a recorded command names each flag once)."""
    overridden = {f for f in extra if f.startswith("--")}
    kept, i = [], 0
    while i < len(base):
        takes_value = i + 1 < len(base) and not base[i + 1].startswith("--")
        item = base[i : i + 2] if takes_value else base[i : i + 1]
        if item[0] not in overridden:
            kept += item
        i += len(item)
    return kept + extra


def flag(flags: list[str], name: str, default: str) -> str:
    """The last value of `name` in `flags` (arm flags override the base), else `default`."""
    values = [flags[i + 1] for i, f in enumerate(flags[:-1]) if f == name]
    return values[-1] if values else default


def run_dir(name: str, budget: int) -> Path:
    out = ROOT / "runs" / "ablation" / f"{name}-{budget // 1000}k"
    out.mkdir(parents=True, exist_ok=True)
    if name in SUBSET_ARMS:
        write_subset(out, subset_positions(DATA / "data" / "responses.jsonl")[name])
        return out
    for link in ("data", "features"):
        if not (out / link).exists():
            os.symlink(DATA / link, out / link)
    return out


def subset_positions(responses: Path) -> dict[str, list[int]]:
    """Line numbers in responses.jsonl of each prompt-diversity arm's answers. `prompts1x`: the greedy and the
    T=0.8 answer of every prompt that has both; `prompts2x`: the greedy answers of those prompts and of as many
    other prompts again (the first in file order), so twice the distinct prompts for the same number of answers
    (and, answers being of like length, about the same tokens: each run's log.json counts them). Second turns
    are left out of both."""
    records = [json.loads(line) for line in responses.read_text().splitlines()]
    sampled = {r["index"] for r in records if r["tag"] == "t0.8"}
    few = [i for i, r in enumerate(records) if r["index"] in sampled and r["tag"] in ("greedy", "t0.8")]
    both_greedy = [i for i, r in enumerate(records) if r["index"] in sampled and r["tag"] == "greedy"]
    others = [i for i, r in enumerate(records) if r["index"] not in sampled and r["tag"] == "greedy"]
    return {"prompts1x": few, "prompts2x": sorted(both_greedy + others[: len(few) - len(both_greedy)])}


def write_subset(out: Path, keep: list[int]) -> None:
    """OUT/data with only the answers on lines `keep`, and OUT/features with their rows of the shared store
    (every answer of demo2 has >= 2 tokens, so store row i is line i); features.json last, so an interrupted
    copy is redone (and a finished one is left as it is)."""
    src, dst = DATA / "features", out / "features"
    if (dst / "features.json").is_file():
        return
    (out / "data").mkdir(exist_ok=True)
    for name in ("prompts.jsonl", "instructions.jsonl"):
        (out / "data" / name).write_bytes((DATA / "data" / name).read_bytes())
    lines = (DATA / "data" / "responses.jsonl").read_text().splitlines(keepends=True)
    (out / "data" / "responses.jsonl").write_text("".join(lines[i] for i in keep))
    dst.mkdir(exist_ok=True)
    meta = json.loads((src / "features.json").read_text())
    lengths = meta["lengths"]
    if len(lengths) != len(lines) or meta["done"] != len(lines):
        raise SystemExit(f"{src}: the shared store must hold every answer's features first (run an arm like scratch)")
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    for name in ["features.f16"] + (["teacher.f16"] if meta.get("teacher") else []):
        data = np.memmap(src / name, dtype=np.float16, mode="r")
        data = data.reshape(int(offsets[-1]), -1)
        rows = np.memmap(dst / name, dtype=np.float16, mode="w+", shape=(sum(lengths[i] for i in keep), data.shape[1]))
        at = 0
        for i in keep:
            rows[at : at + lengths[i]] = data[offsets[i] : offsets[i + 1]]
            at += lengths[i]
        rows.flush()
    (dst / "features.json").write_text(json.dumps({**meta, "lengths": [lengths[i] for i in keep], "done": len(keep)}))


def run(cmd: list[str], log: Path) -> None:
    print(f"[ablation] {' '.join(cmd)}", file=sys.stderr, flush=True)
    with log.open("a") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}; see {log.relative_to(ROOT)}")


def train_loss(log: Path) -> float | None:
    """Mean of the last 4 progress lines' losses (each the mean of 25 steps)."""
    losses = [float(m) for m in re.findall(r"\[train\] step \d+/\d+ loss ([0-9.]+)", log.read_text())]
    return round(sum(losses[-4:]) / len(losses[-4:]), 4) if losses else None


def arm(name: str, budget: int, accept_prompts: int, evals: int = 1) -> dict:
    extra, what = ARMS[name]
    if extra is None:
        return reference(name, what, accept_prompts)
    flags = with_arm(BASE, extra)
    per_step = int(flag(flags, "--sequences-per-step", "4")) * int(flag(flags, "--anchors", "64")) * 15
    steps = max(1, round(budget / per_step))
    out = run_dir(name, budget)
    tag = out.name
    distill = [
        str(Path(sys.executable).parent / "mlx-glimmer"), "distill", "--out", str(out.relative_to(ROOT)),
        *flags, "--steps", str(steps), "--eval-every", str(max(1, steps // evals)),
    ]  # fmt: skip
    log = out / "train.log"
    if not (out / "drafter" / "model.safetensors").is_file():
        tic = time.perf_counter()
        run(distill, log)
        (out / "train_seconds.txt").write_text(f"{time.perf_counter() - tic:.0f}\n")
    kept_log = RESULTS / f"{tag}_train.log"  # the progress lines a figure quoted from training comes from
    kept_log.write_text("".join(line for line in log.open() if line.startswith("[")))
    train_log = json.loads((out / "log.json").read_text())
    # the row measures the arm at its budget: the last checkpoint, also where distill's 4-prompt pick exported
    # another (an earlier evaluation, or a warm start's own starting point)
    drafter = out / "drafter"
    if train_log["exported"]["step"] != steps:
        drafter = checkpoint_drafter(out, steps, "drafter-last")
    tf, acc, where = diagnose(drafter, tag, accept_prompts, out / "diagnosis.log")
    curve = [
        {"step": step, "block_positions": step * per_step, **curve_point(out, step, tag)}
        for step in sorted(e["step"] for e in train_log["evaluations"])
        if 0 < step < steps
    ] + [{"step": steps, "block_positions": steps * per_step, **curve_measures(tf)}]
    return {
        "arm": name,
        "what": what,
        "flags": extra,
        "steps": steps,
        "nominal_block_positions": steps * per_step,
        "train_loss": train_loss(log),
        **measures(tf, acc),
        "curve": curve,
        "distill_eval": train_log["exported"],
        "measured_drafter": str(drafter.relative_to(ROOT)),
        "evaluations": [
            {k: e.get(k) for k in ("step", "target_tokens_seen", "mean_acceptance", "block_positions_per_second")}
            for e in train_log["evaluations"]
        ],
        "run": str(out.relative_to(ROOT)),
        "train_seconds": int((out / "train_seconds.txt").read_text())
        if (out / "train_seconds.txt").is_file()
        else None,
        "commands": {"train": " ".join(["mlx-glimmer", *distill[1:]]), **where["commands"]},
        "results": [*where["results"], str(kept_log.relative_to(ROOT))],
    }


def checkpoint_drafter(out: Path, step: int, name: str) -> Path:
    """The checkpoint distill kept at `step`, exported once as a drafter directory the diagnosis loads."""
    drafter = out / name
    if not (drafter / "model.safetensors").is_file():
        export(out / f"step{step:06d}", drafter)
    return drafter


def curve_point(out: Path, step: int, tag: str) -> dict:
    """Held-out teacher-forced accuracy of an intermediate checkpoint: one point of the arm's scaling curve."""
    drafter = checkpoint_drafter(out, step, f"curve/step{step:06d}")
    path = RESULTS / f"{tag}_step{step:06d}_heldout_tf.json"
    cmd = [*tf_command(drafter), "--out", str(path.relative_to(ROOT))]
    if not path.is_file():
        run(cmd, out / "diagnosis.log")
    point = curve_measures(json.loads(path.read_text())["b_heldout_teacher_forced"])
    return {**point, "result": str(path.relative_to(ROOT)), "command": " ".join(["python", *cmd[1:]])}


def curve_measures(tf: dict) -> dict:
    return {"heldout_tf_accuracy": tf["accuracy"][:3], "heldout_loss": round(tf["loss"], 4)}


def diagnosis_command(drafter: Path, *args: str) -> list[str]:
    return [
        sys.executable,
        "benchmarks/experiments/drafter_diagnosis.py",
        "--drafter",
        str(drafter.relative_to(ROOT)),
        *args,
    ]


def tf_command(drafter: Path) -> list[str]:
    return diagnosis_command(drafter, "--parts", "b", "--no-f32-variant", "--prompts", "75")


def diagnose(drafter: Path, tag: str, accept_prompts: int, log: Path) -> tuple[dict, dict, dict]:
    """Held-out teacher-forced accuracy (all 75 prompts) and real acceptance (the first `accept_prompts`)."""
    tf_path, acc_path = RESULTS / f"{tag}_heldout_tf.json", RESULTS / f"{tag}_acceptance.json"
    tf_cmd = [*tf_command(drafter), "--out", str(tf_path.relative_to(ROOT))]
    acc_cmd = diagnosis_command(
        drafter, "--parts", "c", "--prompts", str(accept_prompts), "--out", str(acc_path.relative_to(ROOT))
    )
    for cmd, path in ((tf_cmd, tf_path), (acc_cmd, acc_path)):
        if not path.is_file():
            run(cmd, log)
    commands = {"heldout_tf": " ".join(["python", *tf_cmd[1:]]), "acceptance": " ".join(["python", *acc_cmd[1:]])}
    tf = json.loads(tf_path.read_text())["b_heldout_teacher_forced"]
    acc = json.loads(acc_path.read_text())["c_speculative"]
    return tf, acc, {"commands": commands, "results": [str(tf_path.relative_to(ROOT)), str(acc_path.relative_to(ROOT))]}


def measures(tf: dict, acc: dict) -> dict:
    return {
        "heldout_loss": round(tf["loss"], 4),
        "heldout_tf_accuracy": tf["accuracy"],
        "heldout_tf_prefix": tf["prefix"],
        "acceptance_prompts": acc["prompts"],
        "tokens_per_forward": acc["tokens_per_forward"],
        "first_draft_accepted": acc["conditional_acceptance"][0],
        "outputs_equal_plain_greedy": f"{acc['outputs_equal_plain_greedy']}/{acc['prompts']}",
    }


def reference(name: str, what: str, accept_prompts: int) -> dict:
    log = ROOT / "runs" / "ablation" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    tf, acc, where = diagnose(SHIPPED, name, accept_prompts, log)
    return {"arm": name, "what": what, "flags": None, "steps": None, **measures(tf, acc), **where}


def table(summary: dict) -> str:
    """The summary as the markdown table benchmarks/experiments/README.md shows."""
    lines = [
        "| arm | what | steps | held-out TF accuracy k=1 / 2 / 3 | loss train / held-out | tokens per forward "
        "(prompts) | first draft accepted | equal plain |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["rows"]:
        tf = " / ".join(f"{a:.1%}" for a in r["heldout_tf_accuracy"][:3])
        loss = f"{r.get('train_loss') or '-'} / {r['heldout_loss']}"
        lines.append(
            f"| `{r['arm']}` | {r['what']} | {r['steps'] or '-'} | {tf} | {loss} | {r['tokens_per_forward']:.3f} "
            f"({r['acceptance_prompts']}) | {r['first_draft_accepted']:.1%} | {r['outputs_equal_plain_greedy']} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "arms", nargs="*", default=list(ARMS), help=f"arms to run, in order (default all: {', '.join(ARMS)})"
    )
    ap.add_argument("--budget", type=int, default=3_840_000, help="nominal supervised block positions per arm")
    ap.add_argument("--accept-prompts", type=int, default=8, help="held-out prompts for real acceptance (default 8)")
    ap.add_argument(
        "--evals", type=int, default=1, help="held-out evaluations per arm, evenly spaced (default 1: at the end)"
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "experiments" / "results" / "drafter_ablation.json"))
    ap.add_argument("--table", action="store_true", help="print the summary in --out as a markdown table and exit")
    args = ap.parse_args(argv)
    if args.table:
        print(table(json.loads(Path(args.out).read_text())))
        return 0
    if args.evals < 1:
        ap.error(f"--evals {args.evals}: at least 1")
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        ap.error(f"unknown arm(s) {unknown}; known: {', '.join(ARMS)}")
    if not (DATA / "data" / "responses.jsonl").is_file():
        raise SystemExit(
            "runs/demo2/data/responses.jsonl missing: unpack benchmarks/experiments/distill/demo2 (see its README)"
        )
    (DATA / "features").mkdir(parents=True, exist_ok=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    summary = json.loads(out.read_text()) if out.is_file() else {"rows": []}
    invocation = "python benchmarks/experiments/drafter_ablation.py " + " ".join(sys.argv[1:])
    earlier = summary.pop("commands", None) or [c for c in [summary.pop("command", None)] if c]
    summary["commands"] = [c for c in earlier if c != invocation] + [invocation]  # every run that wrote rows here
    for name in args.arms:
        row = arm(name, args.budget, args.accept_prompts, args.evals)
        summary["rows"] = [r for r in summary["rows"] if (r["arm"], r["steps"]) != (name, row["steps"])] + [row]
        out.write_text(json.dumps(summary, indent=2))
        train_loss_shown = row.get("train_loss")
        print(
            f"[ablation] {name}: held-out TF pos1 {row['heldout_tf_accuracy'][0]:.3f}, tokens/forward "
            f"{row['tokens_per_forward']:.3f} ({row['acceptance_prompts']} prompts), loss train {train_loss_shown} "
            f"held-out {row['heldout_loss']}",
            file=sys.stderr,
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
