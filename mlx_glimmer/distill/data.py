"""Self-distillation data: the target's own answers to a prompt set, generated in batches.

Answers are appended to a JSONL file one batch at a time, so an interrupted
run resumes where it stopped (conversations already answered under a tag are
skipped). Two batched generators sit behind one `Answerer` protocol, both thin
wrappers over their library's own batched generation:

- `MLXAnswerer`: mlx-lm's `batch_generate` (the fast one on Apple silicon);
- `TorchAnswerer`: transformers' `generate` on the same weights, dequantized
  from the bundle (the faster of the two on a Linux CPU).

A record is `{"index", "tag", "prompt_ids", "response_ids"}`; `response_ids`
ends with the stop token when the target emitted one (the drafter learns to
predict it), and never holds padding.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Protocol

import mlx.core as mx

from ..errors import GlimmerError


class Answerer(Protocol):
    def __call__(self, prompts: list[list[int]], *, max_tokens: int, temperature: float, seed: int) -> list[list[int]]:
        """One continuation per prompt (token ids, stop token included when reached)."""


def load_prompts(path: Path) -> list[str]:
    """The prompts of a JSONL file: one {"prompt": ...} object (or a bare string) a line."""
    out = []
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise GlimmerError(f"{path}: cannot read it as a text file ({getattr(e, 'strerror', None) or e})") from None
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise GlimmerError(f"{path}: line {n} is not valid JSON ({e})") from None
            if isinstance(item, dict) and not isinstance(item.get("prompt"), str):
                raise GlimmerError(f"{path}: line {n} has no 'prompt' string")
            out.append(item["prompt"] if isinstance(item, dict) else str(item))
    return out


def as_messages(prompt: str | list[dict]) -> list[dict]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


def chat_prompt_ids(tokenizer, prompt: str | list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(as_messages(prompt), add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def drop_partial_line(path: Path) -> None:
    """Cut a JSONL file back to its last complete line (what an interrupted append leaves), so the next append
    starts a line of its own."""
    path = Path(path)
    if not path.is_file() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if not data.endswith(b"\n"):
        with path.open("r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


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


def cut_at_stop(ids: list[int], stop_ids) -> list[int]:
    for i, t in enumerate(ids):
        if t in stop_ids:
            return ids[: i + 1]
    return ids


class MLXAnswerer:
    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer

    def __call__(self, prompts, *, max_tokens, temperature, seed):
        from mlx_lm import batch_generate
        from mlx_lm.sample_utils import make_sampler

        mx.random.seed(seed)
        kwargs = {"sampler": make_sampler(temp=temperature)} if temperature > 0 else {}
        result = batch_generate(
            self.model, self.tokenizer, prompts, max_tokens=max_tokens, return_token_ids=True, **kwargs
        )
        return [[int(t) for t in ids] for ids in result.token_ids]


class TorchAnswerer:
    """transformers' `generate` with left padding; weights from the bundle, on the CPU unless told.

    `dtype` "bfloat16" runs the target in bfloat16 (faster on a CPU with AVX-512 bf16/AMX; docs/distill.md):
    the answers are then the bfloat16 target's, which agree with float32 greedy token by token at first but
    drift apart further on. Labels stay the target's text; features are always the float32 target's.
    """

    def __init__(
        self, target_path: Path, stop_ids, *, threads: int | None = None, device: str = "cpu", dtype: str = "float32"
    ):
        import torch

        from ..torch_backend.loading import load_torch

        if threads:
            torch.set_num_threads(threads)
        pair = load_torch(target=target_path, use_drafter=False, device=device, dtype=getattr(torch, dtype))
        self.model, self.device = pair.target.model, pair.device
        self.stop_ids = set(int(t) for t in stop_ids)
        self.pad = min(self.stop_ids)

    def __call__(self, prompts, *, max_tokens, temperature, seed):
        import torch

        torch.manual_seed(seed)
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + list(p) for p in prompts], device=self.device)
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        sampling = (
            {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0}
            if temperature > 0
            else {"do_sample": False}
        )
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=attention,
                max_new_tokens=max_tokens,
                eos_token_id=sorted(self.stop_ids),
                pad_token_id=self.pad,
                **sampling,
            )
        return [cut_at_stop(row[width:].tolist(), self.stop_ids) for row in out]


def generate_responses(
    answer: Answerer,
    tokenizer,
    prompts: list[str | list[dict]],
    out_path: Path,
    *,
    batch_size: int = 32,
    max_tokens: int = 160,
    temperature: float = 0.0,
    seed: int = 0,
    tag: str = "greedy",
    log=sys.stderr,
) -> list[dict]:
    """Answer every prompt not yet in `out_path` (matched by index and tag); return all records.

    Prompts are answered in order of length within windows of 8 batches, so a
    batch pads little; each batch is appended as soon as it is done.
    """
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    drop_partial_line(out_path)
    done = {(r["index"], r["tag"]) for r in read_records(out_path)}
    todo = [i for i in range(len(prompts)) if (i, tag) not in done]
    encoded = {i: chat_prompt_ids(tokenizer, prompts[i]) for i in todo}
    window = 8 * batch_size
    todo = [i for s in range(0, len(todo), window) for i in sorted(todo[s : s + window], key=lambda i: len(encoded[i]))]
    tic, produced = time.perf_counter(), 0
    for start in range(0, len(todo), batch_size):
        batch = todo[start : start + batch_size]
        ids = [encoded[i] for i in batch]
        responses = answer(ids, max_tokens=max_tokens, temperature=temperature, seed=seed + start)
        with out_path.open("a") as f:
            for i, p_ids, r_ids in zip(batch, ids, responses):
                f.write(json.dumps({"index": i, "tag": tag, "prompt_ids": p_ids, "response_ids": r_ids}) + "\n")
                produced += len(r_ids)
        rate = produced / (time.perf_counter() - tic)
        print(
            f"[data {tag}] {min(start + batch_size, len(todo))}/{len(todo)} prompts, {produced} tokens, {rate:.1f} tok/s",
            file=log,
            flush=True,
        )
    return read_records(out_path)


def self_instructions(
    answer: Answerer,
    tokenizer,
    prefix_ids: list[int],
    out_path: Path,
    *,
    count: int,
    batch_size: int = 64,
    max_tokens: int = 64,
    seed: int = 0,
    log=sys.stderr,
) -> list[str]:
    """The target's own user requests (Magpie): sampled continuations of the chat template's user-turn prefix.

    Appended to `out_path` (JSONL, one `{"prompt"}` per line) batch by batch; resumes by count.
    """
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    drop_partial_line(out_path)
    have = [r["prompt"] for r in read_records(out_path)]
    while len(have) < count:
        n = min(batch_size, count - len(have))
        outs = answer([prefix_ids] * n, max_tokens=max_tokens, temperature=1.0, seed=seed + len(have))
        texts = [tokenizer.decode([t for t in ids if t not in tokenizer.eos_token_ids]).strip() for ids in outs]
        with out_path.open("a") as f:
            for t in texts:
                f.write(json.dumps({"prompt": t}) + "\n")
        have += texts
        print(f"[data instruct] {len(have)}/{count} self-written instructions", file=log, flush=True)
    return have[:count]
