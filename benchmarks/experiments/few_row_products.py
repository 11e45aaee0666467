"""What few-row products (`mlx_glimmer/few_rows.py`) save: each weight shape's product, and whole verifies.

    python benchmarks/experiments/few_row_products.py [BUNDLE] [--rows 1,2,3,4,8,16] [--rounds 4]
        [--out benchmarks/experiments/results/few_row_products.json]

1. For every weight shape of the target's float linear layers (and its output head), the time of multiplying
   M rows by all the target's weights of that shape, as x @ W.T (MLX's own product) and as (W @ x.T).T.
2. The target's verify (forward, head, argmax read back) at each width after 32 tokens of context, with the
   few-row layers on and off, alternating `--rounds` times so that a busy machine slows both alike; the best
   of each is reported.

On a CPU without few-row products (Metal, or `--rows` beyond 3) the two forms are the same call.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from mlx_glimmer.bench import environment, portable_path
from mlx_glimmer.blas import ensure_fast_blas
from mlx_glimmer.few_rows import FEW_ROWS, FewRowsEmbedding, FewRowsLinear, transposed_product, use_few_row_products
from mlx_glimmer.loading import load
from mlx_glimmer.paths import cache_dir
from mlx_glimmer.target import head_layer, head_weight
from mlx_glimmer.verify_cost import measure_verify_cost

PLAIN = {FewRowsLinear: nn.Linear, FewRowsEmbedding: nn.Embedding}


def best_ms(fn, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats + 1):
        tic = time.perf_counter()
        mx.eval(fn())
        best = min(best, time.perf_counter() - tic)
    return round(1000 * best, 3)


def weights_by_shape(model: nn.Module) -> dict[tuple[int, int], list[mx.array]]:
    shapes: dict[tuple[int, int], list[mx.array]] = {}
    for module in model.modules():
        if isinstance(module, nn.Linear) and not isinstance(module, nn.QuantizedLinear):
            shapes.setdefault(tuple(module.weight.shape), []).append(module.weight)
    return shapes


def set_few_rows(model: nn.Module, on: bool) -> None:
    if on:
        use_few_row_products(model)
        return
    for module in model.modules():
        plain = PLAIN.get(type(module))
        if plain is not None:
            module.__class__ = plain


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", nargs="?", default=None)
    ap.add_argument("--rows", default="1,2,3,4,8,16", help="row counts (and verify widths) to time")
    ap.add_argument("--rounds", type=int, default=4, help="alternations of the whole-verify timing")
    ap.add_argument("--note", default="", help="what else ran")
    ap.add_argument("--out", default="benchmarks/experiments/results/few_row_products.json")
    args = ap.parse_args()
    ensure_fast_blas(cache_dir() / "blas")
    bundle = args.bundle or str(cache_dir() / "demo")
    pair = load(bundle, use_drafter=False)
    target = pair.target
    rows = [int(r) for r in args.rows.split(",")]
    report = {
        "command": "python benchmarks/experiments/few_row_products.py"
        + (f" {portable_path(bundle)}" if args.bundle else "")
        + f" --rows {args.rows} --rounds {args.rounds}",
        "environment": environment(pair),
        "note": args.note,
        "few_rows": list(FEW_ROWS),
        "products_ms": {},
        "verify_ms": {},
    }
    shapes = weights_by_shape(target.model)
    if isinstance(head_layer(target.model), nn.Embedding):  # a tied head: the embedding used as a product
        shapes.setdefault(tuple(head_weight(target).shape), []).append(head_weight(target))
    for (out, inp), weights in sorted(shapes.items()):
        entry = {"layers": len(weights), "x @ W.T": {}, "(W @ x.T).T": {}}
        for m in rows:
            x = mx.random.normal((m, inp), key=mx.random.key(m)).astype(weights[0].dtype)
            mx.eval(x)
            entry["x @ W.T"][str(m)] = best_ms(lambda: [x @ w.T for w in weights])
            entry["(W @ x.T).T"][str(m)] = best_ms(lambda: [mx.contiguous(transposed_product(x, w)) for w in weights])
        report["products_ms"][f"{out}x{inp}"] = entry
        print(f"{out}x{inp} x{len(weights)}: " + "  ".join(
            f"M{m} {entry['x @ W.T'][str(m)]:.2f}/{entry['(W @ x.T).T'][str(m)]:.2f}" for m in rows
        ), flush=True)  # fmt: skip
    widest = max(rows)
    timings: dict[str, list[list[float]]] = {"off": [], "on": []}
    for _ in range(args.rounds):
        for label in ("off", "on"):
            set_few_rows(target.model, label == "on")
            cost = measure_verify_cost(target, widest, target.vocab_size, repeats=2, widths=rows)
            timings[label].append([cost.seconds[0][w - 1] for w in rows])
    set_few_rows(target.model, True)
    for label, runs in timings.items():
        report["verify_ms"][label] = {str(w): round(1000 * min(r[i] for r in runs), 2) for i, w in enumerate(rows)}
        print(f"verify, few rows {label}: " + " ".join(
            f"{w}:{report['verify_ms'][label][str(w)]:.1f}" for w in rows
        ), flush=True)  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
