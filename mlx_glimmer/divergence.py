"""Where two greedy runs of the same target part, and whether that is a floating-point tie or a bug.

A 16-row verify and a 1-row decoding step run different kernels (on Metal most of all), so near-tied
logits (Muse's soft-capped logits in bfloat16, quantized weights) can flip a greedy token between
plain and speculative decoding, or between batched and solo steps, or between MLX and torch. At the
first diverging position the logits of the next token after the common context are computed each way
(`explain_first_divergence`), and each one's top1 - top2 margin and the gap between the two tokens are
reported. Within the tolerance below on every one, it is a tie; a gap beyond it is a real disagreement.

Tie tolerance
-------------
Two correct implementations of the same network do not produce bit-equal
logits: matmul blocking, reduction order, fused kernels and (speculatively)
verifying 16 positions at once instead of 1 change the rounding. Greedy
decoding turns that noise into a different token only when the two best
logits are closer than the noise. A divergence therefore counts as a
floating-point tie when, on every kernel's logits at the common context (for
parity: both backends' full forwards), the two tokens are within

    tol = REL_TOL[dtype] * max |logit|

where dtype is the compute dtype (the coarser of the two backends'). The scale is
max|logit| because rounding errors are relative: they grow with the size of
the numbers summed, and the logits inherit the hidden state's relative error.
Measured on SmolLM2-135M (30 layers, the last position of a chat prompt or 91
positions of an answer), torch CPU against MLX CPU float32, as
max |logit difference| / max |logit|:

    float32 weights, torch float32    4.8e-6   (~80 unit roundoffs u = 2^-24)
    2-bit bundle, torch float32       4.1e-5   (MLX's quantized matmul computes
                                               scale * sum(q x) + bias * sum(x),
                                               torch sum((scale q + bias) x))
    float32 weights, torch float16    6.2e-3   (~13 u, u = 2^-11)
    float32 weights, torch bfloat16   5.2e-2   (~13 u, u = 2^-8; only 94.5% of
                                               argmaxes agree)

The gap between two tokens can move by twice that. So:

- float32: 3e-4, about 4x what a quantized bundle needs and 60x the float
  case, leaving room for a 52-layer, 6656-wide target and GPU kernels, yet far
  below the logit gaps of real choices (O(0.1-1); 3e-4 x 30 = 9e-3).
- float16: 2^-6 = 1.6e-2 and bfloat16: 2^-3 = 0.125, i.e. 32 unit roundoffs,
  above twice the measured ~13 u. In half precision many divergences are ties
  at this scale (bfloat16 logits near 20-30 are spaced 0.125 apart): parity in
  float32 is the sharp check, bfloat16 parity only catches gross errors.

Works through the `TargetModel` seam, so on either array library: `bench` (step vs verify),
`server.batch` (step vs batched step) and `torch_backend.parity` (MLX vs torch) all explain here.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

REL_TOL = {"float32": 3e-4, "float16": 2**-6, "bfloat16": 2**-3}
PRECISION = ("float32", "float16", "bfloat16")  # finest first


def tolerance(dtype: str, max_abs_logit: float) -> float:
    return REL_TOL[dtype] * max_abs_logit


def coarser(a: str, b: str) -> str:
    return max(a, b, key=PRECISION.index)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def mlx_dtype(pair) -> str:
    """The tolerance's dtype name of an MLX pair: that of its embedding (its scales when quantized)."""
    import mlx.core as mx

    w = pair.target.model.model.embed_tokens
    dt = getattr(w, "scales", w.weight).dtype
    return {mx.float32: "float32", mx.bfloat16: "bfloat16", mx.float16: "float16"}.get(dt, "float32")


def to_numpy(x) -> np.ndarray:
    """float32 numpy values of an MLX array or a torch tensor."""
    if hasattr(x, "detach"):
        return x.detach().float().cpu().numpy()
    import mlx.core as mx

    return np.array(x.astype(mx.float32))


def next_token_logits(target, context: list[int], width: int, prefill_step: int = 512) -> np.ndarray:
    """Logits [V] of the token after `context`, as a target call of `width` rows computes them: the cache
    holds `context[:-1]` (prefilled in chunks, as the loop does), then one call over [context[-1], filler]
    of `width` tokens, whose row 0 is read (causal: the filler after it changes nothing but the kernel)."""
    cache = target.make_cache(reserve=max(width, 16))
    prefix = list(context[:-1])
    for start in range(0, len(prefix), prefill_step):
        hidden, _ = target.forward(target.tokens(prefix[start : start + prefill_step]), cache, False)
        target.sync(hidden, cache=cache)
    hidden, _ = target.forward(target.tokens([context[-1]] * width), cache, False)
    return to_numpy(target.head(hidden[:1]))[0]


def margins(logits: np.ndarray, a: int, b: int, dtype: str) -> dict:
    top2 = np.sort(logits)[-2:]
    return {
        "argmax": int(np.argmax(logits)),
        "margin": float(top2[1] - top2[0]),
        "gap": float(abs(logits[a] - logits[b])),
        "tolerance": float(tolerance(dtype, float(np.abs(logits).max()))),
    }


def explain_first_divergence(
    kernels: dict[str, Callable[[list[int]], np.ndarray]],
    dtype: str,
    prompt: list[int],
    reference: list[int],
    tokens: list[int],
) -> dict | None:
    """The first position where `tokens` leaves `reference` (both generated after `prompt`), with the margins
    of each kernel's logits there (`kernels`: name -> logits [V] of the token after a context); None when one
    is a prefix of the other. A tie: the gap is within tolerance on every kernel."""
    i = first_divergence(reference, tokens)
    if i is None or i >= min(len(reference), len(tokens)):
        return None
    a, b = reference[i], tokens[i]
    context = list(prompt) + list(reference[:i])
    found = {name: margins(logits_of(context), a, b, dtype) for name, logits_of in kernels.items()}
    return {
        "position": i,
        "tokens": [a, b],
        "kernels": found,
        "tie": all(k["gap"] <= k["tolerance"] for k in found.values()),
    }


def explain_divergence(
    target, dtype: str, prompt: list[int], reference: list[int], tokens: list[int], width: int, detok=None
) -> dict | None:
    """`explain_first_divergence` with the kernels of a 1-row step and of a `width`-row verify, and the two
    tokens' texts (`detok`)."""
    kernels = {"step (1 row)": lambda context: next_token_logits(target, context, 1)}
    if width > 1:
        kernels[f"verify ({width} rows)"] = lambda context: next_token_logits(target, context, width)
    d = explain_first_divergence(kernels, dtype, prompt, reference, tokens)
    if d is not None:
        a, b = d["tokens"]
        d["texts"] = [detok([a]), detok([b])] if detok is not None else None
    return d


def format_divergence(method: str, prompt_index: int, d: dict) -> str:
    a, b = d["tokens"]
    texts = f" {d['texts'][0]!r} vs {d['texts'][1]!r}" if d.get("texts") else ""
    parts = [
        f"{name}: top1-top2 {k['margin']:.3g}, |gap| {k['gap']:.3g} (tol {k['tolerance']:.3g})"
        for name, k in d["kernels"].items()
    ]
    verdict = "floating-point tie" if d["tie"] else "DISAGREE"
    return (
        f"  {method} prompt {prompt_index}: first divergence at generated token {d['position']}: {a} vs {b}{texts}; "
        + "; ".join(parts)
        + f": {verdict}"
    )
