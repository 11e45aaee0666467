"""How much of what the target says a draft vocabulary can draft, by its size.

    .venv/bin/python benchmarks/experiments/draft_vocab_coverage.py [RUN] [--sizes 4096,8192,16384,32768]
        [--tags greedy,followup] [--prompts 75] [--out benchmarks/experiments/results/draft_vocab_coverage.json]

`distill --draft-vocab N` keeps the N tokens its training answers emit most (`distill.train.draft_vocabulary`);
a token outside them can never be drafted, so the share of answer positions inside bounds every drafter of
that vocabulary. For each size: that share over RUN's training answers of `--tags` (default runs/big) and over
the demo target's greedy answers to the held-out prompts (128 tokens each, chat template, cached by
`drafter_diagnosis.py`), and the same for the shipped drafter's vocabulary.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))  # drafter_diagnosis, beside this script


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", nargs="?", default=str(ROOT / "runs" / "big"), help="a distill run (default runs/big)")
    ap.add_argument("--sizes", default="4096,8192,16384,32768", help="draft vocabulary sizes, comma-separated")
    ap.add_argument("--tags", default="greedy,followup", help="the training answers' tags (default greedy,followup)")
    ap.add_argument("--prompts", type=int, default=75, help="held-out prompts, the first N (default 75)")
    ap.add_argument("--cache", default=str(ROOT / "runs" / "drafter_diagnosis"), help="held-out answers' cache")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "experiments" / "results" / "draft_vocab_coverage.json"))
    args = ap.parse_args(argv)

    from mlx_glimmer.blas import ensure_fast_blas
    from mlx_glimmer.paths import cache_dir

    ensure_fast_blas(cache_dir() / "blas")
    from drafter_diagnosis import heldout_answers, shown
    from safetensors.numpy import load_file

    import mlx_glimmer
    from mlx_glimmer.demo import SHIPPED_DRAFTER, demo_bundle
    from mlx_glimmer.distill.data import load_prompts, read_records
    from mlx_glimmer.distill.run import pick_mask_token
    from mlx_glimmer.distill.train import draft_vocabulary
    from mlx_glimmer.paths import DATA_DIR

    data = Path(args.run) / "data" / "responses.jsonl"
    if not data.is_file():
        raise SystemExit(f"error: {data} not found (RUN is a distill run with answers)")
    records = [r for r in read_records(data) if r["tag"] in args.tags.split(",")]
    pair = mlx_glimmer.load(demo_bundle(), use_drafter=False)
    prompts = load_prompts(DATA_DIR / "prompts_heldout.jsonl")[: args.prompts]
    answers, _ = heldout_answers(pair, prompts, 128, Path(args.cache))
    heldout = np.array([t for a in answers for t in a["response_ids"]])

    def share(vocab) -> float:
        return round(float(np.isin(heldout, np.asarray(list(vocab))).mean()), 4)

    shipped = load_file(str(Path(SHIPPED_DRAFTER) / "model.safetensors"))["draft_vocab"]
    results = {
        "command": " ".join(["python", Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "run": shown(Path(args.run).resolve()),
        "training_answers": len(records),
        "training_tokens": sum(len(r["response_ids"]) for r in records),
        "heldout_answers": len(answers),
        "heldout_tokens": int(len(heldout)),
        "shipped_drafter": {"size": int(len(shipped)), "heldout": share(shipped)},
        "by_size": {},
    }
    mask = pick_mask_token(pair.tokenizer)
    for size in (int(s) for s in args.sizes.split(",")):
        vocab, coverage = draft_vocabulary(records, mask, size)
        results["by_size"][str(size)] = {"training": round(coverage, 4), "heldout": share(vocab)}
        print(f"{size}: training {coverage:.4f}, held-out {results['by_size'][str(size)]['heldout']:.4f}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
