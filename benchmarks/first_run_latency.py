"""Seconds from a loaded pair to its first token on a first run: no verify-cost table on the machine yet.

    python benchmarks/first_run_latency.py [BUNDLE] [--json-out FILE]

Default settings (`--block-size auto`, `--tree auto`) need the target's verify cost at a few widths; a first run
on a machine measures it after loading (`generate.calibrate`, announced as the CLI, chat and server do) before
the first answer. This runs that path as `mlx-glimmer generate` does, with an empty cache for the tables, and
reports the seconds from the loaded pair to the calibration's end and to the first token of a short chat
prompt, then the same again now that the table exists. Bar: the first token within 3 s of the loaded pair.
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


def first_token(pair, settings, on_measure) -> dict:
    from mlx_glimmer.generate import calibrate, stream_generate

    start = time.perf_counter()
    calibrate(pair, settings, on_measure)
    calibrated = time.perf_counter()
    chunks = stream_generate(pair, [{"role": "user", "content": "Hello! What can you do?"}], settings)
    chunk = next(chunks)
    first = time.perf_counter()
    chunks.close()
    return {
        "calibration_s": round(calibrated - start, 3),
        "first_token_s": round(first - start, 3),
        "ttft_s": round(chunk.stats.ttft_s, 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", nargs="?", help="bundle directory (default: the demo pair, built on first use)")
    ap.add_argument("--json-out", default="benchmarks/results/first_run_latency.json", help="where the report goes")
    ap.add_argument("--note", default="", help="what else ran on the machine meanwhile")
    args = ap.parse_args()

    from mlx_glimmer.blas import ensure_fast_blas
    from mlx_glimmer.paths import CACHE_ENV, cache_dir

    ensure_fast_blas(cache_dir() / "blas")  # as the `mlx-glimmer` command does
    import mlx_glimmer
    from mlx_glimmer.bench import environment
    from mlx_glimmer.demo import demo_bundle
    from mlx_glimmer.settings import GenerationSettings

    bundle = args.bundle or str(demo_bundle())
    with tempfile.TemporaryDirectory() as fresh:
        os.environ[CACHE_ENV] = fresh  # no verify-cost table yet: a first run on this machine
        tic = time.perf_counter()
        pair = mlx_glimmer.load(bundle)
        load_s = time.perf_counter() - tic
        announced: list[str] = []
        settings = GenerationSettings(max_tokens=8)
        first = first_token(pair, settings, announced.append)
        again = first_token(pair, settings, announced.append)
    report = {
        "command": shlex.join(["python", *sys.argv]),  # as a reader types it, not this interpreter's path
        "environment": environment(pair),
        "note": args.note,
        "load_s": round(load_s, 3),
        "first_run": first,
        "next_run": again,
        "announced": announced,
        "first_token_within_3_s": first["first_token_s"] <= 3.0,
    }
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("load_s", "first_run", "next_run", "announced")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
