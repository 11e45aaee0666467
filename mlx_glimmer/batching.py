"""How sequences of different lengths share the batched forwards of a CPU target (features, answer prefills).

A batched forward pads every row to its longest. Past a few thousand padded positions a batch's activations
(positions x the target's intermediate width) outgrow the CPU's caches, and the elementwise ops between the
products (norms, SiLU, RoPE) run at memory speed (`benchmarks/experiments/feature_pass.py --batch-tokens
2048,8192` and `answer_pass.py` with a prefill budget compare).
"""

from __future__ import annotations

BATCH_TOKENS = 2048  # padded positions per batched forward


def length_groups(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Indices grouped for batched forwards: sorted by length, each group's padded size (rows x longest) at most
    `batch_tokens` (a longer sequence goes alone)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups, start = [], 0
    while start < len(order):
        end = start + 1
        while end < len(order) and (end - start + 1) * lengths[order[end]] <= batch_tokens:
            end += 1
        groups.append(order[start:end])
        start = end
    return groups
