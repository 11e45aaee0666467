"""`mlx_glimmer.speculative.generate_steps` on torch: same rounds, same `Step`s, same acceptance.

One generation per call (no `DecodeState` reuse across chat turns). The target
cache is cropped after every target forward (see `TorchTarget`), which keeps
rollback exact past a sliding window.
"""

from __future__ import annotations

import time
from typing import Iterator, Sequence

import torch

from ..speculative import Step
from .device import synchronize
from .sampling import SamplingParams, accept_greedy, accept_sampled, probabilities
from .target import TorchTarget


def _choose(logits, draft, draft_probs, params: SamplingParams, generator) -> tuple[int, int]:
    if params.greedy:
        return accept_greedy(draft, logits)
    return accept_sampled(draft, draft_probs, probabilities(logits, params), generator)


def generate_steps(
    target: TorchTarget,
    prompt: Sequence[int],
    *,
    drafter=None,
    params: SamplingParams = SamplingParams(),
    block_size: int = 16,
    max_tokens: int = 256,
    stop_ids: Sequence[int] = (),
    seed: int = 0,
    prefill_step: int = 512,
) -> Iterator[Step]:
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    if max_tokens <= 0:
        return
    prompt = list(prompt)
    block_size = max(1, int(block_size)) if drafter is not None else 1
    stop = set(int(t) for t in stop_ids)
    capture = drafter is not None and bool(drafter.target_layer_ids)
    target.capture(drafter.target_layer_ids if drafter is not None else ())
    if drafter is not None:
        drafter.reset()
    device = target.device
    generator = torch.Generator(device=device).manual_seed(seed)
    cache = target.make_cache()
    empty = torch.zeros(0, dtype=torch.long, device=device)

    @torch.inference_mode()
    def prefill() -> int:
        for start in range(0, len(prompt), prefill_step):
            chunk = prompt[start : start + prefill_step]
            hidden, feats = target.forward(chunk, cache, capture)
            target.trim(cache, 0)
            if drafter is not None:
                drafter.observe(chunk, feats)
        return _choose(target.head(hidden[-1:]), empty, None, params, generator)[1]

    @torch.inference_mode()
    def verify(anchor: int, draft, draft_probs) -> list[int]:
        b = draft.shape[0] + 1
        hidden, feats = target.forward(torch.cat([torch.tensor([anchor], device=device), draft]), cache, capture)
        n, nxt = _choose(target.head(hidden), draft, draft_probs, params, generator)
        committed = draft[:n].tolist() + [nxt]
        for i, t in enumerate(committed):
            if t in stop:
                committed = committed[: i + 1]
                break
        # The target has processed [anchor] + committed[:-1]; everything after is rolled back.
        m = len(committed)
        target.trim(cache, b - m)
        if drafter is not None:
            drafter.observe([anchor] + committed[:-1], feats[:m] if feats is not None else None)
        return committed

    tic = time.perf_counter()
    first = prefill()
    step = Step([first], prefill_tokens=len(prompt), verify_s=time.perf_counter() - tic, stopped=first in stop)
    yield step
    generated = 1
    anchor = first
    if step.stopped:
        return

    while generated < max_tokens:
        b = min(block_size, max_tokens - generated)
        tic = time.perf_counter()
        if b > 1:
            # A drafter may offer fewer tokens than asked.
            with torch.inference_mode():
                draft, draft_probs = drafter.propose(anchor, b - 1, params, generator)
                draft = draft.to(torch.long)
            synchronize(device)
        else:
            draft, draft_probs = empty, None
        toc = time.perf_counter()
        committed = verify(anchor, draft, draft_probs)
        stopped = committed[-1] in stop
        generated += len(committed)
        anchor = committed[-1]
        yield Step(committed, drafted=draft.shape[0], draft_s=toc - tic, verify_s=time.perf_counter() - toc,
                   stopped=stopped)
        if stopped:
            return
