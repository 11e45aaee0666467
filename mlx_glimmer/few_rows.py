"""Products of a few rows with a float weight on the CPU, taken as (W @ x.T).T.

A linear layer multiplies x [M, in] by its weight W [out, in] as x @ W.T. A short verify (an anchor and one or
two drafts) or a drafter's small block has M of 2 or 3. On the Linux CPU path (OpenBLAS, `blas.py`) the general
matrix kernel tiles M in several rows at a time, and with this few it costs up to 1.4x the single-row product
for the same weight read from memory; taking the weight as the tiled side, (W @ x.T).T, costs about what one
row does. From 4 rows on the general kernel is as fast or faster for most weight shapes, so only 2 and 3 rows
take the transposed form. `benchmarks/experiments/few_row_products.py` measures both forms per weight shape and
the whole target's verify per width. Both forms compute the same dot products; they may differ in the float
rounding of the sums, as a one-row and a many-row kernel already do.

Applied to float `nn.Linear` layers and to a tied embedding used as the output head, on the CPU only:
quantized layers and Metal run MLX's own kernels, which have no such cliff.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

FEW_ROWS = (2, 3)  # row counts that take the transposed form


def few_rows(x: mx.array) -> bool:
    """x [..., in] holds 2 or 3 rows in all."""
    return x.ndim >= 1 and x.shape[-1] > 0 and x.size // x.shape[-1] in FEW_ROWS


def transposed_product(x: mx.array, weight: mx.array) -> mx.array:
    """x @ weight.T, computed as (weight @ x.T).T over x's rows flattened."""
    rows = x.size // x.shape[-1]
    return (weight @ x.reshape(rows, x.shape[-1]).T).T.reshape(*x.shape[:-1], weight.shape[0])


class FewRowsLinear(nn.Linear):
    """`nn.Linear` that multiplies 2-3 rows as (W @ x.T).T."""

    def __call__(self, x: mx.array) -> mx.array:
        if not few_rows(x):
            return super().__call__(x)
        out = transposed_product(x, self["weight"])
        return out + self["bias"] if "bias" in self else out


class FewRowsEmbedding(nn.Embedding):
    """`nn.Embedding` whose use as the output head (`as_linear`) multiplies 2-3 rows as (W @ x.T).T."""

    def as_linear(self, x: mx.array) -> mx.array:
        return transposed_product(x, self.weight) if few_rows(x) else super().as_linear(x)


_SWAPS = {nn.Linear: FewRowsLinear, nn.Embedding: FewRowsEmbedding}


def on_cpu(device: mx.Device | None = None) -> bool:
    return (device or mx.default_device()).type == mx.cpu


def use_few_row_products(model: nn.Module, device: mx.Device | None = None) -> int:
    """Swap `model`'s float linear layers and embeddings for their few-row forms when `device` (default: MLX's
    default device) is the CPU; subclasses of either (quantized layers, a model's own kinds) stay as they are.
    Returns how many modules were swapped."""
    if not on_cpu(device):
        return 0
    swapped = 0
    for module in model.modules():
        swap = _SWAPS.get(type(module))
        if swap is not None:
            module.__class__ = swap
            swapped += 1
    return swapped


def row_product(x: mx.array, weight: mx.array, device: mx.Device | None = None) -> mx.array:
    """x @ weight.T, in the few-row form where `use_few_row_products` would take it."""
    return transposed_product(x, weight) if few_rows(x) and on_cpu(device) else x @ weight.T
