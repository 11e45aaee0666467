"""Self-distillation data: the target's own answers to a prompt set, generated in batches.

Answers are appended to a JSONL file one batch at a time, so an interrupted
run resumes where it stopped (prompts already answered are skipped).
Batching uses mlx-lm's `BatchGenerator` (through `batch_generate`).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import batch_generate
from mlx_lm.sample_utils import make_sampler

DATA_DIR = Path(__file__).resolve().parent.parent / "data"


def load_prompts(path: Path) -> list[str]:
    out = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            item = json.loads(line)
            out.append(item["prompt"] if isinstance(item, dict) else str(item))
    return out


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def read_records(path: Path) -> list[dict]:
    if not Path(path).exists():
        return []
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by an interrupted run
            break
    return records


def generate_responses(
    model,
    tokenizer,
    prompts: list[str],
    out_path: Path,
    *,
    batch_size: int = 32,
    max_tokens: int = 160,
    temperature: float = 0.0,
    seed: int = 0,
    tag: str = "greedy",
    log=sys.stderr,
) -> list[dict]:
    """Answer every prompt not yet in `out_path` (matched by index and tag); return all records."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = {(r["index"], r["tag"]) for r in read_records(out_path)}
    todo = [i for i in range(len(prompts)) if (i, tag) not in done]
    sampler = make_sampler(temp=temperature) if temperature > 0 else None
    tic, produced = time.perf_counter(), 0
    for start in range(0, len(todo), batch_size):
        batch = todo[start : start + batch_size]
        mx.random.seed(seed + start)
        ids = [chat_prompt_ids(tokenizer, prompts[i]) for i in batch]
        kwargs = {"sampler": sampler} if sampler else {}
        result = batch_generate(model, tokenizer, ids, max_tokens=max_tokens, return_token_ids=True, **kwargs)
        with out_path.open("a") as f:
            for i, p_ids, r_ids in zip(batch, ids, result.token_ids):
                rec = {"index": i, "tag": tag, "prompt_ids": p_ids, "response_ids": [int(t) for t in r_ids]}
                f.write(json.dumps(rec) + "\n")
                produced += len(r_ids)
        rate = produced / (time.perf_counter() - tic)
        print(
            f"[data {tag}] {min(start + batch_size, len(todo))}/{len(todo)} prompts, {produced} tokens, {rate:.1f} tok/s",
            file=log,
            flush=True,
        )
    return read_records(out_path)
