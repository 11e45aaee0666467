"""Feature-pass throughput: target tokens per second of `distill`'s feature store, by source and precision.

    python benchmarks/experiments/feature_pass.py [BUNDLE] [--data runs/demo2/data/responses.jsonl] [--answers 256]
        [--sources torch:float32,torch:bfloat16,mlx:float32] [--blas-order torch-first|preload] [--batch-tokens N,...]
        [--teacher on|off|on,off] [--note TEXT]
        [--out benchmarks/experiments/results/feature_pass.json]

Each source computes the features (the outputs of the drafter's target layers, and the final hidden states) of
the same first `--answers` training sequences (prompt + answer, as `distill` trains on them) into a fresh store
in a temporary folder, the way `distill` does (`FeatureStore.ensure`), and the wall time of the whole pass is
divided into the tokens. The first chunk is timed too: what a user waits for is the whole pass. The results
file names the CPU, its flags that decide the precision (`avx512_bf16`, `amx_bf16`, ...), the BLAS MLX runs on,
and which of the sources `distill --feature-source auto` would time here (`candidate_sources`) measured fastest.
`--blas-order preload` measures torch's products on the preloaded OpenBLAS (how `distill` ran before it loaded
OpenBLAS after torch). `--batch-tokens` gives the padded positions per forward (default `distill`'s); with
several, comma-separated, each source makes one pass at each. `--teacher off` stores no final hidden states, as
`distill` without `--soft-labels` (the layers after the deepest captured one then never run); `on,off` measures
both. Run it with nothing else running.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", nargs="?", default=None, help="bundle (default: the demo pair)")
    ap.add_argument("--data", default=str(ROOT / "runs" / "demo2" / "data" / "responses.jsonl"))
    ap.add_argument("--answers", type=int, default=256)
    ap.add_argument("--sources", default="torch:float32,torch:bfloat16,mlx:float32")
    ap.add_argument("--blas-order", choices=["torch-first", "preload"], default="torch-first")
    ap.add_argument(
        "--batch-tokens", default=None, help="padded positions per forward, comma-separated (default distill's)"
    )
    ap.add_argument("--teacher", default="on", help="store the final hidden states too: on, off or on,off")
    ap.add_argument("--note", default="", help="what else ran on the machine meanwhile, for the results file")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "experiments" / "results" / "feature_pass.json"))
    args = ap.parse_args(argv)

    from mlx_glimmer.blas import blas_name, ensure_fast_blas
    from mlx_glimmer.paths import cache_dir

    # torch-first, as `distill` does: MLX on OpenBLAS where one runs here, torch on its own BLAS (loaded before
    # OpenBLAS); preload: OpenBLAS preloaded, which torch's products then run on too (how `distill` ran before)
    ensure_fast_blas(cache_dir() / "blas", torch_first=args.blas_order == "torch-first")

    from mlx_glimmer.batching import BATCH_TOKENS
    from mlx_glimmer.cpu import cpu_facts
    from mlx_glimmer.demo import demo_bundle
    from mlx_glimmer.distill.data import read_records
    from mlx_glimmer.distill.features import FeatureStore, candidate_sources, make_feature_source
    from mlx_glimmer.distill.train import training_sequences
    from mlx_glimmer.drafters.dflash import dflash_target_layer_ids
    from mlx_glimmer.loading import load

    pair = load(args.bundle or demo_bundle(), use_drafter=False)
    sequences = training_sequences(read_records(Path(args.data))[: args.answers])
    tokens = sum(len(s) for s in sequences)
    layer_ids = dflash_target_layer_ids(pair.target.num_layers, 5)
    rows = []
    sizes = [int(x) for x in args.batch_tokens.split(",")] if args.batch_tokens else [BATCH_TOKENS]
    for spec in args.sources.split(","):
        source = make_feature_source(spec, pair.target, pair.target_path)
        for size, teacher in [(size, t == "on") for size in sizes for t in args.teacher.split(",")]:
            source.batch_tokens = size
            with tempfile.TemporaryDirectory() as tmp:
                store = FeatureStore(Path(tmp), pair.target, sequences, layer_ids, source=source, teacher=teacher)
                tic = time.perf_counter()
                store.ensure(log=sys.stderr)
                seconds = time.perf_counter() - tic
            row = {"source": spec, "batch_tokens": size, "teacher": teacher, "seconds": round(seconds, 2)}
            rows.append(row | {"tokens_per_second": round(tokens / seconds)})
    here = [r for r in rows if r["source"] in candidate_sources() and r["batch_tokens"] == BATCH_TOKENS]
    result = {
        "command": shlex.join(["python", "benchmarks/experiments/feature_pass.py", *(argv or sys.argv[1:])]),
        "bundle": str(args.bundle or "demo"),
        "answers": len(sequences),
        "target_tokens": tokens,
        "cpu": cpu_facts(),
        "blas": blas_name(),
        "blas_order": args.blas_order,
        "distill_batch_tokens": BATCH_TOKENS,
        "note": args.note,
        "candidates_here": candidate_sources(),
        "fastest_candidate": max(here, key=lambda r: r["tokens_per_second"])["source"] if here else None,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
