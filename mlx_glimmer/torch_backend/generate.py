"""`generate` / `stream_generate` for a `TorchPair`: the MLX API's prompts, chunks and `GenerationStats`.

Timing fields mean what they mean on MLX (see `mlx_glimmer.generate`); the GPU
is synchronised at every step, so times are wall-clock for finished work.
`peak_memory_gb`: CUDA's peak allocation, MPS's driver allocation, or on CPU
the process's peak resident size (which includes Python and torch themselves).
"""

from __future__ import annotations

import time
from typing import Iterator

from ..generate import GenerationChunk, GenerationResult, Prompt, chunks_from_steps, collect, prepare_request
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
    tokens, params, drafter, block_size, stats = prepare_request(
        pair, prompt, temperature, top_p, top_k, block_size, speculative, chat_template_kwargs
    )
    synchronize(pair.device)
    reset_peak_memory(pair.device)
    start = time.perf_counter()
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
    yield from chunks_from_steps(pair.tokenizer, steps, stats, max_tokens, start, lambda: peak_memory_gb(pair.device))


def generate(pair: TorchPair, prompt: Prompt, **kwargs) -> GenerationResult:
    """Generate a whole answer; keywords as `stream_generate`."""
    return collect(stream_generate(pair, prompt, **kwargs))
