"""The few array operations that code written once for every array library calls by name (`ArrayOps`), and
MLX's (`MLX_OPS`); torch's are `torch_backend.array_ops.torch_ops`.

Draft trees (`tree.Trees`) and positional sampling noise (`noise.py`) are written against these and Python's
operators and indexing, which both libraries share (arithmetic, comparisons, `&`, `|`, `~`, `x[i]`,
`^`, `>>`, `x[i] = v`, `.shape`, `.reshape`, `.sum()`, `.any()`, `.tolist()`); an operation whose name or arguments
differ between libraries is one field here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx

Array = Any  # an mx.array or a torch.Tensor


@dataclass(frozen=True)
class ArrayOps:
    """One array library's primitives. Dtypes: `index` holds indices, depths, sources and verdicts, `token`
    a draft's token ids; integer hashing runs in `int64`."""

    index: Any
    token: Any
    int32: Any
    int64: Any
    float32: Any
    bool_: Any
    array: Callable[[Any, Any], Array]  # (Python values, dtype)
    arange: Callable[[int, int, int, Any], Array]  # (start, stop, step, dtype)
    full: Callable[[tuple, Any, Any], Array]  # (shape, value, dtype)
    astype: Callable[[Array, Any], Array]
    concatenate: Callable[[list, int], Array]  # (arrays, axis)
    stack: Callable[[list], Array]
    where: Callable[[Array, Any, Any], Array]
    top_k: Callable[[Array, int], tuple]  # (x, k) -> (values, ids) along the last axis, best first
    argsort_descending: Callable[[Array], Array]  # of a vector
    sort: Callable[[Array], Array]  # a vector's values, ascending
    cumsum: Callable[[Array], Array]  # of a vector
    argmax: Callable[[Array, int], Array]  # (x, axis), as `index`
    log: Callable[[Array], Array]
    log_softmax: Callable[[Array], Array]  # float32, along the last axis
    bits_as_int32: Callable[[Array], Array]  # float32 values as their int32 bit patterns
    compile: Callable[[Callable], Callable]  # a function of arrays, traced once per input shape where the library can


def _top_k(x: mx.array, k: int) -> tuple[mx.array, mx.array]:
    ids = mx.argpartition(-x, k - 1, axis=-1)[..., :k] if k < x.shape[-1] else mx.argsort(-x, axis=-1)
    values = mx.take_along_axis(x, ids, axis=-1)
    order = mx.argsort(-values, axis=-1)
    return mx.take_along_axis(values, order, axis=-1), mx.take_along_axis(ids, order, axis=-1)


MLX_OPS = ArrayOps(
    index=mx.int32,
    token=mx.uint32,
    int32=mx.int32,
    int64=mx.int64,
    float32=mx.float32,
    bool_=mx.bool_,
    array=lambda values, dtype: mx.array(values, dtype=dtype),
    arange=lambda start, stop, step, dtype: mx.arange(start, stop, step, dtype=dtype),
    full=lambda shape, value, dtype: mx.full(shape, value, dtype),
    astype=lambda x, dtype: x.astype(dtype),
    concatenate=lambda arrays, axis=0: mx.concatenate(arrays, axis=axis),
    stack=mx.stack,
    where=mx.where,
    top_k=_top_k,
    argsort_descending=lambda x: mx.argsort(-x),
    sort=mx.sort,
    cumsum=mx.cumsum,
    argmax=lambda x, axis: mx.argmax(x, axis=axis).astype(mx.int32),
    log=mx.log,
    log_softmax=lambda x: x - mx.logsumexp(x, axis=-1, keepdims=True),
    bits_as_int32=lambda x: mx.view(x, mx.int32),
    compile=mx.compile,
)
