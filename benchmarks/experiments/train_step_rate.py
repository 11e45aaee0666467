"""Training throughput: supervised block positions per second of `distill`'s step, by backend, precision and depth.

    python benchmarks/experiments/train_step_rate.py [RUN] [--layers 2,4] [--configs torch:bfloat16,torch:float32]
        [--anchors N] [--features stored,stored-unhinted,online] [--tags greedy,followup] [--steps 20] [--rounds 3]
        [--note TEXT] [--out benchmarks/experiments/results/train_step_rate.json]

RUN is a `distill` run whose answers (RUN/data/responses.jsonl) and feature store (RUN/features; finished first
if a kill cut it short) the steps read, as `distill --train-only` would (default: runs/demo2). Each configuration
builds the trainer `distill` builds (the recipe's defaults, `--anchors` blocks per answer, random weights; the
results file spells the recipe out),
compiles its step for every context width first (`[compile]`, outside the timer, its seconds recorded), then the
configurations take turns, `--steps` optimiser steps each per round, so that load from elsewhere hits all alike.
With `--features online` the batch's features are computed as `distill --features online` computes them (by the
store's source), so each row gives the step alone and the step with the making of its batch. A store is read as
`distill` reads it, the next step's rows hinted to the OS while a step computes; `stored-unhinted` reads it without
the hint (each configuration draws sequences of its own, so one's reads do not warm the page cache for another).
The BLAS is loaded as `distill` loads it (torch first, then OpenBLAS for MLX). The results file names the CPU, its
flags that decide the precision, and the precision `--train-precision auto` picks here. Run it with nothing else
running, or say in `--note` what ran.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main(argv=None) -> int:
    from mlx_glimmer.distill.step import TrainConfig  # neither imports an array library: the BLAS is not loaded yet
    from mlx_glimmer.flags import positive_int

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", nargs="?", default=str(ROOT / "runs" / "demo2"), help="a distill run (default runs/demo2)")
    ap.add_argument("--layers", default="2,4", help="drafter depths, comma-separated")
    ap.add_argument("--configs", default="torch:bfloat16,torch:float32", help="backend:precision, comma-separated")
    ap.add_argument(
        "--anchors",
        type=positive_int,
        default=TrainConfig.anchors,
        help="blocks per answer per step (default: distill's)",
    )
    ap.add_argument(
        "--features",
        default="stored",
        help="stored, stored-unhinted (a store read without the next step's read-ahead) and/or online, comma-separated",
    )
    ap.add_argument(
        "--tags", default=None, help="the answers of these tags only, as the run's --temperatures kept (default all)"
    )
    ap.add_argument("--steps", type=int, default=20, help="timed steps per configuration per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--note", default="", help="what else ran on the machine meanwhile, for the results file")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "experiments" / "results" / "train_step_rate.json"))
    args = ap.parse_args(argv)

    from mlx_glimmer.blas import blas_name, ensure_fast_blas
    from mlx_glimmer.paths import cache_dir

    ensure_fast_blas(cache_dir() / "blas", torch_first=True)  # as `distill` runs: torch on its own BLAS

    from mlx_glimmer.cpu import cpu_facts
    from mlx_glimmer.demo import demo_bundle
    from mlx_glimmer.distill.data import read_records
    from mlx_glimmer.distill.features import make_feature_source, stored_source
    from mlx_glimmer.distill.run import pick_mask_token, train_precision
    from mlx_glimmer.distill.train import Trainer, context_layer_ids, training_sequences
    from mlx_glimmer.loading import load

    run = Path(args.run)
    data, features = run / "data" / "responses.jsonl", run / "features"
    if not data.is_file():
        sys.exit(f"error: {data} not found (RUN is a distill run with answers)")
    pair = load(demo_bundle(), use_drafter=False)
    records = [r for r in read_records(data) if args.tags is None or r["tag"] in args.tags.split(",")]
    sequences = training_sequences(records)
    layer_ids = context_layer_ids(pair.target, TrainConfig())
    stored = stored_source(features, [len(s) for s in sequences], layer_ids)
    if stored is None:
        sys.exit(f"error: {features} does not hold the features of {data}'s answers (run distill on RUN first)")
    source = make_feature_source(stored, pair.target, pair.target_path)
    mask = pick_mask_token(pair.tokenizer)

    trainers, compile_s, hinted = {}, {}, {}
    for layers in [int(x) for x in args.layers.split(",")]:
        for spec in args.configs.split(","):
            for mode in args.features.split(","):
                backend, _, precision = spec.partition(":")
                config = TrainConfig(
                    layers=layers,
                    anchors=args.anchors,
                    backend=backend,
                    precision=precision or "float32",
                    steps=10**6,
                    seed=len(trainers),  # each its own sequences: one's reads do not warm the page cache for another
                )
                work = Path(tempfile.mkdtemp())
                (work / "features").symlink_to(features.resolve())
                trainer = Trainer(
                    pair.target,
                    records,
                    config,
                    work,
                    mask_token_id=mask,
                    feature_source=source,
                    online_features=mode == "online",
                )
                trainer.features.ensure()  # a store cut short by a kill is finished first, as `distill` would
                name = f"{layers} layers, {spec}, features {mode}"
                hinted[name] = mode != "stored-unhinted"
                tic = time.perf_counter()
                trainer.warm_up()
                trainer.step_fn(trainer.batch(trainer.next_indices()))  # the first real step: allocations, caches
                compile_s[name] = round(time.perf_counter() - tic, 1)
                trainers[name] = trainer

    totals = {name: [0, 0.0, 0.0] for name in trainers}  # positions, step seconds, batch seconds
    for r in range(args.rounds):
        for name, trainer in trainers.items():
            for _ in range(args.steps):
                tic = time.perf_counter()
                batch = trainer.batch(trainer.next_indices())
                if hinted[name]:  # as `Trainer.train` does: the next step's rows are read while this one computes
                    trainer.features.prefetch(trainer.upcoming_indices())
                mid = time.perf_counter()
                trainer.step_fn(batch)
                totals[name][1] += time.perf_counter() - mid
                totals[name][2] += mid - tic
                totals[name][0] += batch.positions
            rate = totals[name][0] / totals[name][1]
            whole = totals[name][0] / (totals[name][1] + totals[name][2])
            print(
                f"round {r + 1}/{args.rounds} {name}: {rate:.0f} block positions/s, {whole:.0f} with its batch",
                file=sys.stderr,
                flush=True,
            )

    rows = [
        {
            "config": name,
            "steps": args.steps * args.rounds,
            "block_positions_per_second": round(positions / seconds),
            "steps_per_second": round(args.steps * args.rounds / seconds, 3),
            "block_positions_per_second_with_batch": round(positions / (seconds + batch_s)),
            "steps_per_second_with_batch": round(args.steps * args.rounds / (seconds + batch_s), 3),
            "compile_seconds": compile_s[name],
        }
        for name, (positions, seconds, batch_s) in totals.items()
    ]
    result = {
        "command": shlex.join(["python", "benchmarks/experiments/train_step_rate.py", *(argv or sys.argv[1:])]),
        "run": run.name,
        "answers": len(records),
        "feature_source": stored,
        "recipe": f"{config.sequences_per_step} answers x {config.anchors} anchors per step, block {config.block_size}, "
        f"draft vocabulary {config.draft_vocab_size:,}, random weights",
        "cpu": cpu_facts(),
        "blas": blas_name(),
        "auto_precision_here": train_precision("auto"),
        "note": args.note,
        "load_average_at_end": os.getloadavg(),
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
