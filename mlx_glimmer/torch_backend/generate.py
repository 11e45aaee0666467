"""`generate` / `stream_generate` for a `TorchPair`: the MLX API's prompts, chunks and `GenerationStats`.

Timing fields mean what they mean on MLX (see `mlx_glimmer.generate`); the GPU
is synchronised at every step, so times are wall-clock for finished work.
`peak_memory_gb`: CUDA's peak allocation, MPS's driver allocation, or on CPU
the process's peak resident size (which includes Python and torch themselves).
"""

from __future__ import annotations

import time
from typing import Iterator

from ..errors import GlimmerError
from ..generate import GenerationChunk, GenerationResult, GenerationStats, Prompt, encode_prompt
from ..sampling import SamplingParams
from .device import peak_memory_gb, reset_peak_memory, synchronize
from .loading import TorchPair
from .speculative import generate_steps


def stream_generate(
    pair: TorchPair,
    prompt: Prompt,
    *,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    block_size: int | None = None,
    seed: int = 0,
    speculative: bool = True,
    chat_template_kwargs: dict | None = None,
) -> Iterator[GenerationChunk]:
    try:
        params = SamplingParams(temperature, top_p, top_k)
    except ValueError as e:
        raise GlimmerError(str(e)) from None
    tokens = encode_prompt(pair.tokenizer, prompt, chat_template_kwargs)
    vocab = pair.target.vocab_size
    if any(not 0 <= t < vocab for t in tokens):
        raise GlimmerError(f"prompt token ids must lie in [0, {vocab})")
    drafter = pair.drafter if speculative else None
    if block_size is None:
        block_size = drafter.block_size if drafter is not None else 1
    if block_size < 1:
        raise GlimmerError(f"block_size must be >= 1, got {block_size}")
    stats = GenerationStats(
        prompt_tokens=len(tokens),
        drafter_kind=drafter.kind if drafter is not None else "none",
        block_size=block_size if drafter is not None else 1,
    )
    detok = pair.tokenizer.detokenizer
    detok.reset()
    synchronize(pair.device)
    reset_peak_memory(pair.device)
    start = time.perf_counter()
    first_at = last_at = start
    steps = generate_steps(
        pair.target,
        tokens,
        drafter=drafter,
        params=params,
        block_size=block_size,
        max_tokens=max_tokens,
        stop_ids=pair.tokenizer.eos_token_ids,
        seed=seed,
    )
    for index, step in enumerate(steps):
        now = time.perf_counter()
        new = step.tokens[:-1] if step.stopped else step.tokens
        if index == 0:
            first_at = now
            stats.prefill_tokens = step.prefill_tokens
            stats.ttft_s = now - start
            stats.prefill_tokens_per_second = step.prefill_tokens / max(step.verify_s, 1e-9)
        else:
            last_at = now
            stats.target_forwards += 1
            stats.acceptance_lengths.append(len(step.tokens))
            stats.draft_s += step.draft_s
            stats.verify_s += step.verify_s
        stats.generated_tokens += len(new)
        if stats.generated_tokens > 1 and last_at > first_at:
            stats.decode_tokens_per_second = (stats.generated_tokens - 1) / (last_at - first_at)
        stats.peak_memory_gb = peak_memory_gb(pair.device)
        if step.stopped:
            stats.finish_reason = "stop"
        elif stats.generated_tokens >= max_tokens:
            stats.finish_reason = "length"
        for t in new:
            detok.add_token(t)
        if stats.finish_reason is not None:
            detok.finalize()
        yield GenerationChunk(detok.last_segment, new, stats)
    if stats.finish_reason is None:
        stats.finish_reason = "length"


def generate(pair: TorchPair, prompt: Prompt, **kwargs) -> GenerationResult:
    """Generate a whole answer; keywords as `stream_generate`."""
    text, ids, stats = [], [], GenerationStats()
    for chunk in stream_generate(pair, prompt, **kwargs):
        text.append(chunk.text)
        ids.extend(chunk.token_ids)
        stats = chunk.stats
    return GenerationResult("".join(text), ids, stats)
