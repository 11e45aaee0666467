"""The torch training step compiled for dynamic shapes versus once per context width, and the fused head
loss's chunk size: supervised block positions per second on the same batches, side by side in one run.

    python benchmarks/experiments/torch_step_shapes.py RUN_DIR --features-dir DIR [--steps 10] [--rounds 3]
        [--out benchmarks/experiments/results/torch_step_shapes.json]

RUN_DIR and --features-dir as for `trainer_throughput.py` (a distill run's answers and its torch feature
store). Both steps start from the same random 2-layer drafter and take the same batches (4 answers x 64
anchors, draft vocabulary 8,192) in alternating rounds; compiling is outside the timer. The chunk sweep
times `HeadCrossEntropy` forward + backward at the step's shape ([4 x 64 x 15 rows, hidden] against the
draft head, bfloat16).
"""

import argparse
import sys
import time
from pathlib import Path

import torch
from trainer_throughput import linked_features, write_report  # (this folder is the script's sys.path[0])

import mlx_glimmer
from mlx_glimmer.demo import demo_bundle
from mlx_glimmer.distill.data import read_records
from mlx_glimmer.distill.step import TrainConfig
from mlx_glimmer.distill.torch_step import HeadCrossEntropy, TorchStep
from mlx_glimmer.distill.train import Trainer


def timed(step, batches) -> tuple[float, float]:
    positions, seconds = 0.0, 0.0
    for b in batches:
        tic = time.perf_counter()
        step(b)
        seconds += time.perf_counter() - tic
        positions += b.positions
    return positions, seconds


def chunk_sweep(rows: int, head: torch.Tensor, chunks=(64, 128, 256, 512, 1024), repeats: int = 5) -> dict:
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(rows, head.shape[1], generator=g) * 0.5).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, head.shape[0], (rows,), generator=g)
    weights = torch.rand(rows, generator=g) / rows
    out = {}
    for _ in range(2):  # alternate twice, keep the faster
        for c in chunks:
            HeadCrossEntropy.apply(h, head, labels, weights, c).backward()
            tic = time.perf_counter()
            for _ in range(repeats):
                HeadCrossEntropy.apply(h, head, labels, weights, c).backward()
            out[c] = min(out.get(c, float("inf")), (time.perf_counter() - tic) / repeats)
    return {str(c): round(s * 1000, 1) for c, s in out.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("--features-dir", required=True)
    ap.add_argument("--steps", type=int, default=10, help="steps per round per variant")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/experiments/results/torch_step_shapes.json")
    args = ap.parse_args()

    pair = mlx_glimmer.load(demo_bundle(), use_drafter=False)
    records = [r for r in read_records(Path(args.run_dir) / "data" / "responses.jsonl") if len(r["response_ids"]) >= 2]
    mask = int(pair.tokenizer.vocab["<|endoftext|>"])
    config = TrainConfig(
        layers=2,
        anchors=64,
        sequences_per_step=4,
        draft_vocab_size=8192,
        steps=10**6,
        warmup=10,
        backend="torch",
        compile=True,
    )
    work = Path(args.run_dir) / "step_shapes"
    source = linked_features(Path(args.features_dir), records, pair, work)
    if source is None:
        sys.exit(f"error: {args.features_dir} holds MLX features; this compares torch steps (use a torch run's store)")
    trainer = Trainer(pair.target, records, config, work, mask_token_id=mask, feature_source=source)
    static = trainer.step_fn
    dynamic = TorchStep(trainer.model, trainer.drafter_config, trainer.head, trainer.embed, config, compile=False)
    dynamic.forward = torch.compile(dynamic._forward, dynamic=True)
    rounds = [[trainer.batch(trainer.next_indices()) for _ in range(args.steps)] for _ in range(args.rounds)]
    tic = time.perf_counter()
    trainer.warm_up()  # the static step: every width
    for b in rounds[0][:2]:
        static(b)
    compile_s = {"static": time.perf_counter() - tic}
    tic = time.perf_counter()
    for b in rounds[0][:2]:
        dynamic(b)
    compile_s["dynamic"] = time.perf_counter() - tic
    totals = {"dynamic": [0.0, 0.0], "static": [0.0, 0.0]}
    for r, batches in enumerate(rounds):
        for name, step in (("dynamic", dynamic), ("static", static)):
            p, s = timed(step, batches)
            totals[name][0] += p
            totals[name][1] += s
            print(f"round {r + 1}/{args.rounds} {name}: {p / s:.0f} block positions/s", file=sys.stderr, flush=True)
    rate = {k: p / s for k, (p, s) in totals.items()}
    report = {
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "block_positions_per_second": rate,
        "static_over_dynamic": rate["static"] / rate["dynamic"],
        "context_widths": sorted({b.ctx.shape[1] for batches in rounds for b in batches}),
        "compile_and_first_steps_seconds": compile_s,
        "head_loss_ms_by_chunk_rows": chunk_sweep(4 * 64 * 15, static.head_bf16),
    }
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
