"""`array_ops.ArrayOps` in torch: what draft trees and positional noise call by name, on one device."""

from __future__ import annotations

from functools import lru_cache

import torch

from ..array_ops import ArrayOps


def torch_ops(device: torch.device | str = "cpu") -> ArrayOps:
    """torch's primitives, creating their arrays on `device`."""
    return _ops(torch.device(device))


@lru_cache(maxsize=None)
def _ops(device: torch.device) -> ArrayOps:
    return ArrayOps(
        index=torch.long,
        token=torch.long,
        int32=torch.int32,
        int64=torch.long,
        float32=torch.float32,
        bool_=torch.bool,
        array=lambda values, dtype: torch.tensor(values, dtype=dtype, device=device),
        arange=lambda start, stop, step, dtype: torch.arange(start, stop, step, dtype=dtype, device=device),
        full=lambda shape, value, dtype: torch.full(shape, value, dtype=dtype, device=device),
        astype=lambda x, dtype: x.to(device=device, dtype=dtype),
        concatenate=lambda arrays, axis=0: torch.cat(arrays, dim=axis),
        stack=torch.stack,
        where=torch.where,
        top_k=lambda x, k: tuple(torch.topk(x, k, dim=-1)),
        argsort_descending=lambda x: torch.argsort(x, descending=True, stable=True),
        sort=lambda x: torch.sort(x).values,
        cumsum=lambda x: torch.cumsum(x, dim=0),
        argmax=lambda x, axis: torch.argmax(x, dim=axis),
        log=torch.log,
        log_softmax=lambda x: torch.log_softmax(x, dim=-1),
        bits_as_int32=lambda x: x.contiguous().view(torch.int32),
        compile=lambda function: function,  # eager: nothing to trace
    )
