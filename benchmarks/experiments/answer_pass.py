"""Answer-generation throughput: answer tokens per second of `distill`'s torch generator against transformers'
`generate`, on the same prompts, greedy.

    python benchmarks/experiments/answer_pass.py [BUNDLE] [--prompts benchmarks/experiments/distill/demo3/prompts.jsonl]
        [--skip 3000] [--count 256] [--max-tokens 256] [--runs slots:bfloat16:128,generate:bfloat16:64]
        [--note TEXT] [--out benchmarks/experiments/results/answer_pass.json]
    python benchmarks/experiments/answer_pass.py --responses benchmarks/experiments/distill/demo3/responses_added.jsonl.gz \
        --tag followup --skip 0 --count 256 --runs slots:float32:128,slots:float32:128:1000000

Each run answers the same `--count` prompts (chat template, after skipping the first `--skip` of the list) up
to `--max-tokens` tokens, stopping at the target's stop tokens:

- `slots:DTYPE:N[:P]`: `torch_backend.slots.SlotGenerator` with N slots, what `distill --generator torch` runs,
  prefilling at most P padded positions per forward (default `batching.BATCH_TOKENS`, what `distill` runs; a
  P larger than a refill prefills each refill in one forward);
- `generate:DTYPE:N`: transformers' `generate` on batches of N left-padded prompts, sorted by length (how
  `distill` generated before): a batch runs until its longest answer ends.

Tokens per second counts answer tokens up to and including the stop token, over the wall time of the whole run
(prefills included). `--responses FILE --tag TAG` answers the prompts of a run's answers file
(`responses.jsonl`, or gzipped as the demo data ships) instead, as they were encoded there: `--tag followup`
gives second turns, the long prompts whose prefills dominate a refill. The results file names the CPU and its
flags, and how many answers of each run equal the first run's (bfloat16 answers drift from each other after a
few dozen tokens: rounding, not a bug).
Run it with nothing else running.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def generate_batches(model, prompts, stop_ids, batch, max_tokens):
    """transformers' `generate` over length-sorted batches: (index, answer) pairs."""
    import torch

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    pad = min(stop_ids)
    for start in range(0, len(order), batch):
        rows = order[start : start + batch]
        width = max(len(prompts[i]) for i in rows)
        ids = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in rows])
        mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in rows])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=sorted(stop_ids),
                pad_token_id=pad,
            )
        for i, row in zip(rows, out[:, width:].tolist()):
            cut = next((k + 1 for k, t in enumerate(row) if t in stop_ids), len(row))
            yield i, row[:cut]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", nargs="?", default=None, help="bundle (default: the demo pair)")
    ap.add_argument("--prompts", default=str(ROOT / "benchmarks/experiments/distill/demo3/prompts.jsonl"))
    ap.add_argument("--responses", default=None, help="answers file whose prompts to answer instead of --prompts")
    ap.add_argument("--tag", default="followup", help="with --responses: the answers whose prompts to take")
    ap.add_argument("--skip", type=int, default=3000)
    ap.add_argument("--count", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--runs", default="slots:bfloat16:128,slots:bfloat16:64,generate:bfloat16:64")
    ap.add_argument("--note", default="", help="what else ran on the machine meanwhile, for the results file")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/experiments/results/answer_pass.json"))
    args = ap.parse_args(argv)

    from mlx_glimmer.blas import blas_name, ensure_fast_blas
    from mlx_glimmer.paths import cache_dir

    ensure_fast_blas(cache_dir() / "blas", torch_first=True)

    import torch

    from mlx_glimmer.batching import BATCH_TOKENS
    from mlx_glimmer.cpu import cpu_facts
    from mlx_glimmer.demo import demo_bundle
    from mlx_glimmer.distill.data import chat_prompt_ids, load_prompts
    from mlx_glimmer.torch_backend.loading import load_torch
    from mlx_glimmer.torch_backend.slots import SlotGenerator

    bundle = Path(args.bundle or demo_bundle())
    if args.responses:
        opened = gzip.open if args.responses.endswith(".gz") else open
        with opened(args.responses, "rt") as f:
            records = [r for r in map(json.loads, f) if r["tag"] == args.tag]
        encoded = [r["prompt_ids"] for r in records[args.skip : args.skip + args.count]]
    else:
        texts = load_prompts(Path(args.prompts))[args.skip : args.skip + args.count]
    rows, first = [], None
    for spec in args.runs.split(","):
        kind, dtype, width, *prefill = spec.split(":")
        pair = load_torch(target=bundle / "target", use_drafter=False, device="cpu", dtype=getattr(torch, dtype))
        prompts = encoded if args.responses else [chat_prompt_ids(pair.tokenizer, t) for t in texts]
        stop_ids = set(pair.tokenizer.eos_token_ids)
        tic = time.perf_counter()
        if kind == "slots":
            budget = int(prefill[0]) if prefill else BATCH_TOKENS
            slots = SlotGenerator(pair.target, stop_ids, slots=int(width), prefill_tokens=budget)
            made = slots.generate(prompts, max_tokens=args.max_tokens)
        else:
            made = generate_batches(pair.target.model, prompts, stop_ids, int(width), args.max_tokens)
        answers = dict(made)
        seconds = time.perf_counter() - tic
        tokens = sum(len(a) for a in answers.values())
        first = first or answers
        rows.append(
            {
                "run": spec,
                "seconds": round(seconds, 2),
                "answer_tokens": tokens,
                "tokens_per_second": round(tokens / seconds, 1),
                "equal_to_first_run": sum(answers[i] == first[i] for i in answers),
            }
        )
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    result = {
        "command": shlex.join(["python", "benchmarks/experiments/answer_pass.py", *(argv or sys.argv[1:])]),
        "bundle": str(args.bundle or "demo"),
        "prompts": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "max_tokens": args.max_tokens,
        "cpu": cpu_facts(),
        "torch_threads": torch.get_num_threads(),
        "blas": blas_name(),
        "note": args.note,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
