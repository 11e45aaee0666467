"""Supervised block positions per second: the trainer as of commit c12d381 versus today's, same drafter, same data.

    python benchmarks/experiments/trainer_throughput.py RUN_DIR [--records 48] [--steps 12] [--rounds 3]
        [--features-dir RUN_DIR/features] [--out benchmarks/experiments/results/trainer_throughput.json]

RUN_DIR is a `mlx-glimmer distill` run with answers in RUN_DIR/data/responses.jsonl.
Every trainer builds a 2-layer drafter for the demo target on the first N
answers (`--records 0`: all of them, the data a real run trains on): the old
one (MLX, one answer x 32 anchors per step, every emitted token in its head),
today's on MLX, and today's on torch (transformers' assistant class, bfloat16
autocast) when torch is installed. The draft vocabulary depends on the data:
on 48 answers every emitted token fits in ~1.5k, on the full data the old head
holds every one of ~20k emitted tokens where today's keeps the top 8,192.
Features are outside the timer (every trainer caches them), and so is the
warm-up (today's trainer compiles its step once per padded context width, as
training does before its first step; the seconds are recorded), so the figure is
steady-state optimisation throughput; `--features-dir` reuses the store a
`distill` run computed for the same answers instead of computing it again.
They are timed in alternating rounds so that load from other processes hits
all alike. The old trainer is loaded from git (`git show c12d381:mlx_glimmer/distill/train.py`).

Also times the step's dominant kernels (the linear layers and the draft head,
forward + backward at the step's shapes) in MLX and in torch on this CPU, the
"which library's CPU kernels" comparison.
"""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

import mlx_glimmer
from mlx_glimmer.cpu import chip_name
from mlx_glimmer.demo import demo_bundle
from mlx_glimmer.distill.data import read_records
from mlx_glimmer.distill.features import MLXFeatures, TorchFeatures, stored_sequences
from mlx_glimmer.distill.step import TrainConfig
from mlx_glimmer.distill.train import Trainer
from mlx_glimmer.drafters.dflash import dflash_target_layer_ids

OLD_COMMIT = "c12d381"


def old_trainer_module():
    source = subprocess.run(
        ["git", "show", f"{OLD_COMMIT}:mlx_glimmer/distill/train.py"], capture_output=True, text=True, check=True
    ).stdout
    source = source.replace("from ..drafter import", "from ..drafters.dflash import")  # its import, at today's path
    path = Path(tempfile.mkdtemp()) / "train_old.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"mlx_glimmer.distill.train_{OLD_COMMIT}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def linked_features(features: Path, records: list[dict], pair, run_dir: Path):
    """Link a distill run's feature store into `run_dir` for a Trainer to reuse, only if it holds exactly these
    answers' features (a Trainer opening a store of other answers would rewrite it); returns its feature source
    (None: MLX's, the Trainer's default)."""
    if not (features / "features.json").is_file():
        sys.exit(f"error: {features / 'features.json'} not found (--features-dir takes a distill run's features/)")
    source_name = json.loads((features / "features.json").read_text()).get("source", MLXFeatures.name)
    lengths = [len(r["prompt_ids"]) + len(r["response_ids"]) for r in records]
    if stored_sequences(
        features, lengths, dflash_target_layer_ids(pair.target.num_layers, TrainConfig().context_layers), source_name
    ) < len(records):
        sys.exit(
            f"error: {features} holds the features of other answers (or is unfinished); "
            "pass the run's own --records, or drop --features-dir"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / "features").exists():
        (run_dir / "features").symlink_to(features.resolve())
    return TorchFeatures(pair.target_path) if source_name.startswith("torch") else None


def write_report(report: dict, out: str) -> None:
    report["machine"] = {
        "cpu": chip_name(),
        # bfloat16 matmuls run on AMX tiles where the CPU has them: the step's speed depends on it
        "amx": "amx_bf16" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else False,
        "cpus": os.cpu_count(),
        "load_average_at_end": os.getloadavg(),
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


def timed_old_steps(trainer, steps: int) -> tuple[float, float]:
    """(supervised positions, seconds) over `steps` optimiser steps of the old trainer."""
    positions, seconds = 0.0, 0.0
    for _ in range(steps):
        if not trainer.order:
            trainer.order = [int(i) for i in trainer.rng.permutation(len(trainer.sequences))]
        inputs = trainer.batch(trainer.order.pop())
        tic = time.perf_counter()
        loss, grads = trainer.loss_and_grad(*inputs)
        trainer.optimizer.update(trainer.model, grads)
        mx.eval(loss, trainer.model.parameters(), trainer.optimizer.state)
        seconds += time.perf_counter() - tic
        positions += float(inputs[5].sum().item())
    return positions, seconds


def timed_new_steps(trainer, steps: int) -> tuple[float, float]:
    positions, seconds = 0.0, 0.0
    for _ in range(steps):
        batch = trainer.batch(trainer.next_indices())
        tic = time.perf_counter()
        trainer.step_fn(batch)
        seconds += time.perf_counter() - tic
        positions += batch.positions
    return positions, seconds


def kernel_comparison(rows: int, hidden: int, inter: int, vocab: int, repeats: int = 5) -> dict:
    """Forward + backward of x -> MLP -> draft head at the step's shapes, MLX versus torch (float32, CPU)."""
    import torch

    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, hidden)).astype(np.float32)
    w = [
        rng.standard_normal(s).astype(np.float32) * 0.02
        for s in ((hidden, inter), (hidden, inter), (inter, hidden), (hidden, vocab))
    ]

    def f_mlx(ws, x):
        g, u, d, h = ws
        y = (mx.sigmoid(x @ g) * (x @ g) * (x @ u)) @ d
        return mx.logsumexp(y @ h, axis=-1).sum()

    grad = mx.grad(f_mlx)
    mw, mxx = [mx.array(a) for a in w], mx.array(x)
    mx.eval(grad(mw, mxx))
    tic = time.perf_counter()
    for _ in range(repeats):
        mx.eval(grad(mw, mxx))
    t_mlx = (time.perf_counter() - tic) / repeats

    tw = [torch.tensor(a, requires_grad=True) for a in w]
    tx = torch.tensor(x)

    def f_torch():
        g, u, d, h = tw
        y = (torch.nn.functional.silu(tx @ g) * (tx @ u)) @ d
        return torch.logsumexp(y @ h, dim=-1).sum()

    f_torch().backward()
    tic = time.perf_counter()
    for _ in range(repeats):
        for t in tw:
            t.grad = None
        f_torch().backward()
    t_torch = (time.perf_counter() - tic) / repeats
    return {
        "rows": rows,
        "hidden": hidden,
        "intermediate": inter,
        "vocab": vocab,
        "mlx_s": t_mlx,
        "torch_s": t_torch,
        "torch_threads": torch.get_num_threads(),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("--records", type=int, default=48, help="first N answers; 0: all")
    ap.add_argument("--features-dir", help="a distill run's features/ for the same answers (reused, not recomputed)")
    ap.add_argument("--steps", type=int, default=12, help="steps per round per trainer")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--anchors", type=int, default=64)
    ap.add_argument("--sequences-per-step", type=int, default=4)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--skip", default="", help="comma-separated backends of today's trainer not to time: mlx, torch")
    ap.add_argument("--no-kernels", action="store_true", help="skip the MLX/torch kernel comparison")
    ap.add_argument("--out", default="benchmarks/experiments/results/trainer_throughput.json")
    args = ap.parse_args()

    pair = mlx_glimmer.load(demo_bundle(), use_drafter=False)
    records = [r for r in read_records(Path(args.run_dir) / "data" / "responses.jsonl") if len(r["response_ids"]) >= 2]
    records = records[: args.records or None]
    tokens = sum(len(r["response_ids"]) for r in records)
    mask = int(pair.tokenizer.vocab["<|endoftext|>"]) if "<|endoftext|>" in pair.tokenizer.vocab else 0
    work = Path(tempfile.mkdtemp())

    old_mod = old_trainer_module()
    old = old_mod.Trainer(
        pair.target,
        records,
        old_mod.TrainConfig(layers=2, anchors=32, steps=10**6, warmup=10),
        work / "old",
        mask_token_id=mask,
    )
    # (the old trainer computes a sequence's features in batch(), which runs outside its timer)
    source = linked_features(Path(args.features_dir), records, pair, work / "new") if args.features_dir else None

    trainers = {"old": (old, timed_old_steps)}
    skip = args.skip.split(",")
    for backend in [b for b in ("mlx", "torch") if b not in skip and (b == "mlx" or importlib.util.find_spec("torch"))]:
        cfg = TrainConfig(
            layers=2,
            anchors=args.anchors,
            sequences_per_step=args.sequences_per_step,
            draft_vocab_size=args.draft_vocab,
            steps=10**6,
            warmup=10,
            backend=backend,
        )
        tr = Trainer(
            pair.target, records, cfg, work / "new", mask_token_id=mask, feature_source=source
        )  # one store for both
        tr.features.ensure()
        trainers[f"new_{backend}"] = (tr, timed_new_steps)
    warm_up_s = {}
    for name, (tr, timed) in trainers.items():
        tic = time.perf_counter()
        if name.startswith("new_"):
            tr.warm_up()  # what training does first: the step compiled for every context width in the data
        timed(tr, 2)  # warm-up (graph building, allocations)
        warm_up_s[name] = time.perf_counter() - tic
    totals = {name: [0.0, 0.0] for name in trainers}
    for r in range(args.rounds):
        for name, (tr, timed) in trainers.items():
            p, s = timed(tr, args.steps if name != "old" else args.steps * args.sequences_per_step)
            totals[name][0] += p
            totals[name][1] += s
            print(f"round {r + 1}/{args.rounds} {name}: {p / s:.0f} block positions/s", file=sys.stderr, flush=True)
    rate = {k: p / s for k, (p, s) in totals.items()}
    new = trainers["new_mlx"][0] if "new_mlx" in trainers else trainers["new_torch"][0]
    rows = args.anchors * args.sequences_per_step * (new.config.block_size - 1)
    kernels = (
        []
        if args.no_kernels
        else [
            kernel_comparison(rows, pair.target.hidden_size, int(pair.target.args.intermediate_size), v)
            for v in (int(old.draft_vocab.shape[0]), int(new.draft_vocab.shape[0]))
        ]
    )
    report = {
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "records": len(records),
        "target_tokens": tokens,
        "old": {
            "commit": OLD_COMMIT,
            "config": "2 layers, 1 answer x 32 anchors per step, draft vocab = every emitted token",
            "draft_vocab": int(old.draft_vocab.shape[0]),
            "block_positions_per_second": rate["old"],
        },
        "new": {
            "config": f"2 layers, {args.sequences_per_step} answers x {args.anchors} anchors per step, draft vocab top {args.draft_vocab}",
            "draft_vocab": int(new.draft_vocab.shape[0]),
            "vocab_coverage": new.vocab_coverage,
            **{f"block_positions_per_second_{k[4:]}": v for k, v in rate.items() if k.startswith("new_")},
        },
        "speedup": {k[4:]: v / rate["old"] for k, v in rate.items() if k.startswith("new_")},
        "warm_up_seconds": warm_up_s,  # outside the timer: compiling (once per context width) and the first steps
        "kernels_mlx_vs_torch": kernels,
    }
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
