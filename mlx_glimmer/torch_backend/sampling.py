"""`mlx_glimmer.sampling` in torch: the same filters in the same order, the same acceptance rules.

Randomness comes from a `torch.Generator`, so a seed gives a different sample
stream than on MLX; the distributions are the same.
"""

from __future__ import annotations

import torch

from ..settings import SamplingParams

__all__ = [
    "SamplingParams",
    "probabilities",
    "argmax",
    "sample",
    "greedy_verdict",
    "sampled_verdict",
    "accept_greedy",
    "accept_sampled",
]


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Filtered next-token distribution(s), float32: temperature, then top-k, then top-p (the same thresholds
    as `mlx_glimmer.sampling.probabilities`: no full-vocabulary argsort)."""
    logits = logits.float() / params.temperature
    vocab = logits.shape[-1]
    top_k = params.top_k if 0 < params.top_k < vocab else 0
    if top_k:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        ranked = torch.topk(probs, top_k, dim=-1).values if top_k else torch.sort(probs, dim=-1, descending=True).values
        mass_before = torch.cumsum(ranked, dim=-1) - ranked
        needed = (mass_before < params.top_p).sum(dim=-1, keepdim=True)  # >= 1
        threshold = torch.gather(ranked, -1, needed - 1)
        probs = torch.where(probs >= threshold, probs, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def argmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.argmax(logits, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token id per row of `probs` ([..., V] -> [...])."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def spread(probs: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Distributions over `ids` [n, len(ids)] as distributions over the whole vocabulary [n, vocab_size]."""
    full = probs.new_zeros((probs.shape[0], vocab_size))
    full[:, ids] = probs
    return full


def greedy_verdict(draft: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Exact-match acceptance on the device: [accepted drafts, the target's own next token after them]."""
    choice = torch.argmax(target_logits, dim=-1)
    n = draft.shape[0]
    if n == 0:
        return torch.stack([torch.zeros_like(choice[0]), choice[0]])
    accepted = (draft == choice[:n]).long().cumprod(0).sum()
    return torch.stack([accepted, choice[accepted]])


def sampled_verdict(draft, draft_probs, target_probs, generator) -> torch.Tensor:
    """Speculative rejection sampling with residual resampling on the device; see
    `mlx_glimmer.sampling.sampled_verdict`. Returns [accepted drafts, next token]."""
    n = draft.shape[0]
    if n == 0:
        token = sample(target_probs[0], generator)
        return torch.stack([torch.zeros_like(token), token])
    rows = torch.arange(n, device=draft.device)
    p = target_probs[rows, draft]
    if draft_probs is None:
        q = torch.ones_like(p)
        q_full = torch.zeros_like(target_probs[:n]).scatter(-1, draft[:, None], 1.0)
    else:
        q, q_full = draft_probs[rows, draft], draft_probs
    u = torch.rand(n, generator=generator, device=p.device)
    accepted = (u * q < p).long().cumprod(0).sum()
    residual = torch.cat([torch.clamp(target_probs[:n] - q_full, min=0.0), target_probs[n:]])[accepted]
    total = residual.sum()
    residual = torch.where(total > 0, residual / torch.clamp(total, min=1e-30), target_probs[accepted])
    token = sample(residual, generator)
    return torch.stack([accepted, token])


def accept_greedy(draft: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """`greedy_verdict`, read: (accepted drafts, the target's own next token after them)."""
    accepted, token = greedy_verdict(draft, target_logits).tolist()
    return int(accepted), int(token)


def accept_sampled(draft, draft_probs, target_probs, generator) -> tuple[int, int]:
    """`sampled_verdict`, read: (accepted drafts, next token)."""
    accepted, token = sampled_verdict(draft, draft_probs, target_probs, generator).tolist()
    return int(accepted), int(token)
