"""`mlx_glimmer.sampling` in torch: the same filters in the same order, the same acceptance rules.

Randomness comes from a `torch.Generator`, so a seed gives a different sample
stream than on MLX; the distributions are the same.
"""

from __future__ import annotations

import torch

from ..sampling import SamplingParams

__all__ = ["SamplingParams", "probabilities", "argmax", "sample", "accept_greedy", "accept_sampled"]


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Filtered next-token distribution(s), float32: temperature, then top-k, then top-p."""
    logits = logits.float() / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.sort(logits, dim=-1).values[..., vocab - params.top_k, None]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, mass_before < params.top_p)
        probs = torch.where(keep, probs, 0.0)
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


def accept_greedy(draft: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Exact-match acceptance: (accepted drafts, the target's own next token after them)."""
    choice = torch.argmax(target_logits, dim=-1)
    n = draft.shape[0]
    if n == 0:
        return 0, int(choice[0])
    accepted = (draft == choice[:n]).int().cumprod(0).sum()
    both = torch.stack([accepted, choice[accepted]]).tolist()
    return int(both[0]), int(both[1])


def accept_sampled(draft, draft_probs, target_probs, generator) -> tuple[int, int]:
    """Speculative rejection sampling with residual resampling; see `mlx_glimmer.sampling.accept_sampled`."""
    n = draft.shape[0]
    if n == 0:
        return 0, int(sample(target_probs[0], generator))
    rows = torch.arange(n, device=draft.device)
    p = target_probs[rows, draft]
    if draft_probs is None:
        q = torch.ones_like(p)
        q_full = torch.zeros_like(target_probs[:n]).scatter(-1, draft[:, None], 1.0)
    else:
        q, q_full = draft_probs[rows, draft], draft_probs
    u = torch.rand(n, generator=generator, device=p.device)
    accepted = (u * q < p).int().cumprod(0).sum()
    residual = torch.cat([torch.clamp(target_probs[:n] - q_full, min=0.0), target_probs[n:]])[accepted]
    total = residual.sum()
    residual = torch.where(total > 0, residual / torch.clamp(total, min=1e-30), target_probs[accepted])
    token = sample(residual, generator)
    both = torch.stack([accepted, token]).tolist()
    return int(both[0]), int(both[1])
