"""`mlx_glimmer.sampling` in torch: the same filters in the same order, the same acceptance rule, and the
same positional noise (`noise.py`): a seed samples the same tokens from the same distributions as on MLX.
"""

from __future__ import annotations

import torch

from .. import noise
from ..settings import SamplingParams
from .array_ops import torch_ops

__all__ = [
    "SamplingParams",
    "probabilities",
    "argmax",
    "sample",
    "greedy_verdict",
    "gumbel_scores",
    "accept_greedy",
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


def sample(probs: torch.Tensor, where: noise.Noise, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """One column per row of `probs` ([..., V] -> [...]): row i the sample of position `where.start + i`, its
    columns the token ids 0..V-1 or `tokens` (`mlx_glimmer.sampling.sample`)."""
    return noise.gumbel_max(torch_ops(probs.device), probs, where, tokens)


def gumbel_scores(probs: torch.Tensor, where: noise.Noise) -> torch.Tensor:
    """[n, V]: `noise.gumbel_scores`, whose row argmaxes are `sample`'s tokens."""
    return noise.gumbel_scores(torch_ops(probs.device), probs, where)


def spread(probs: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Distributions over `ids` [n, len(ids)] as distributions over the whole vocabulary [n, vocab_size]."""
    full = probs.new_zeros((probs.shape[0], vocab_size))
    full[:, ids] = probs
    return full


def greedy_verdict(draft: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Exact-match acceptance on the device: [accepted drafts, the target's own next token after them] (on
    logits, or on Gumbel scores: see `mlx_glimmer.sampling.greedy_verdict`)."""
    choice = torch.argmax(target_logits, dim=-1)
    n = draft.shape[0]
    if n == 0:
        return torch.stack([torch.zeros_like(choice[0]), choice[0]])
    accepted = (draft == choice[:n]).long().cumprod(0).sum()
    return torch.stack([accepted, choice[accepted]])


def accept_greedy(draft: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """`greedy_verdict`, read: (accepted drafts, the target's own next token after them)."""
    accepted, token = greedy_verdict(draft, target_logits).tolist()
    return int(accepted), int(token)
