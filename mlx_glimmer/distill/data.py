"""Self-distillation data: the target's own answers to a prompt set, many generated at once.

Each answer is appended to a JSONL file as soon as it ends, so an interrupted
run resumes where it stopped (conversations already answered under a tag are
skipped). Two generators sit behind one `Answerer` protocol:

- `MLXAnswerer`: mlx-lm's `batch_generate` (the fast one on Apple silicon), a
  group of prompts at a time;
- `TorchAnswerer`: the same weights, dequantized from the bundle, on torch
  (`torch_backend.slots`: a fixed number of slots, each refilled with the next
  prompt as its answer ends; the faster of the two on a Linux CPU).

A record is `{"index", "tag", "prompt_ids", "response_ids"}`; `response_ids`
ends with the stop token when the target emitted one (the drafter learns to
predict it), and never holds padding.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import mlx.core as mx

from ..errors import GlimmerError


class Answerer(Protocol):
    def __call__(
        self, prompts: list[list[int]], *, max_tokens: int, temperature: float, seed: int
    ) -> Iterator[tuple[int, list[int]]]:
        """Each prompt's continuation (token ids, stop token included when reached) with its position in
        `prompts`, as each is done."""


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


class MLXAnswerer:
    """mlx-lm's `batch_generate` over `group` prompts at a time (it batches within the group itself); each
    group's answers come when the group ends."""

    def __init__(self, model, tokenizer, group: int = 128):
        self.model, self.tokenizer, self.group = model, tokenizer, group

    def __call__(self, prompts, *, max_tokens, temperature, seed):
        from mlx_lm import batch_generate
        from mlx_lm.sample_utils import make_sampler

        kwargs = {"sampler": make_sampler(temp=temperature)} if temperature > 0 else {}
        for start in range(0, len(prompts), self.group):
            mx.random.seed(seed + start)
            result = batch_generate(
                self.model,
                self.tokenizer,
                prompts[start : start + self.group],
                max_tokens=max_tokens,
                return_token_ids=True,
                **kwargs,
            )
            for k, ids in enumerate(result.token_ids):
                yield start + k, [int(t) for t in ids]


class TorchAnswerer:
    """`torch_backend.slots` on the bundle's weights, on the CPU unless told: `slots` answers at once.

    `dtype` "bfloat16" runs the target in bfloat16 (faster on a CPU with AVX-512 bf16/AMX; docs/distill.md):
    the answers are then the bfloat16 target's, which agree with float32 greedy token by token at first but
    drift apart further on. Labels stay the target's text; features are always the float32 target's.
    """

    def __init__(
        self,
        target_path: Path,
        stop_ids,
        *,
        slots: int = 128,
        threads: int | None = None,
        device: str = "cpu",
        dtype: str = "float32",
    ):
        import torch

        from ..torch_backend.loading import load_torch
        from ..torch_backend.slots import SlotGenerator

        if threads:
            torch.set_num_threads(threads)
        pair = load_torch(target=target_path, use_drafter=False, device=device, dtype=getattr(torch, dtype))
        try:
            self.generator = SlotGenerator(pair.target, stop_ids, slots=slots)
        except ValueError as e:
            raise GlimmerError(f"distill --generator torch: {e}; --generator mlx answers with mlx-lm") from None

    def __call__(self, prompts, *, max_tokens, temperature, seed):
        return self.generator.generate(prompts, max_tokens=max_tokens, temperature=temperature, seed=seed)


def generate_responses(
    answer: Answerer,
    tokenizer,
    prompts: list[str | list[dict]],
    out_path: Path,
    *,
    max_tokens: int = 160,
    temperature: float = 0.0,
    seed: int = 0,
    tag: str = "greedy",
    log=sys.stderr,
) -> list[dict]:
    """Answer every prompt not yet in `out_path` (matched by index and tag); return all records.

    Prompts go to the generator in order of length within windows of 512, so prompts prefilled together pad
    little; each answer is appended as soon as it ends.
    """
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    drop_partial_line(out_path)
    done = {(r["index"], r["tag"]) for r in read_records(out_path)}
    todo = [i for i in range(len(prompts)) if (i, tag) not in done]
    encoded = {i: chat_prompt_ids(tokenizer, prompts[i]) for i in todo}
    window = 512
    todo = [i for s in range(0, len(todo), window) for i in sorted(todo[s : s + window], key=lambda i: len(encoded[i]))]
    tic = last_report = time.perf_counter()
    produced = 0
    with out_path.open("a") as f:
        answers = answer([encoded[i] for i in todo], max_tokens=max_tokens, temperature=temperature, seed=seed)
        for n, (k, r_ids) in enumerate(answers, 1):
            i = todo[k]
            f.write(json.dumps({"index": i, "tag": tag, "prompt_ids": encoded[i], "response_ids": r_ids}) + "\n")
            f.flush()
            produced += len(r_ids)
            now = time.perf_counter()
            if now - last_report >= 10 or n == len(todo):
                last_report = now
                print(
                    f"[data {tag}] {n}/{len(todo)} prompts, {produced} tokens, {produced / (now - tic):.1f} tok/s",
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
    batch_size: int = 128,
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
    stop = set(tokenizer.eos_token_ids)
    while len(have) < count:
        n = min(batch_size, count - len(have))
        outs = dict(answer([prefix_ids] * n, max_tokens=max_tokens, temperature=1.0, seed=seed + len(have)))
        texts = [tokenizer.decode([t for t in outs[k] if t not in stop]).strip() for k in range(n)]
        with out_path.open("a") as f:
            for t in texts:
                f.write(json.dumps({"prompt": t}) + "\n")
        have += texts
        print(f"[data instruct] {len(have)}/{count} self-written instructions", file=log, flush=True)
    return have[:count]
