"""Where two greedy runs of the same target part, and whether that is a floating-point tie or a bug.

A 16-row verify and a 1-row decoding step run different kernels (on Metal most of all), so near-tied
logits (Muse's soft-capped logits in bfloat16, quantized weights) can flip a greedy token between
plain and speculative decoding. At the first diverging position this recomputes the logits of the next
token after the common context both ways, on the same target: as a plain step computes them (1 row)
and as a verify of `width` rows does (the position in row 0, the rest filler), and reports each one's
top1 - top2 margin and the gap between the two tokens. Within `torch_backend.parity`'s tolerance
(`REL_TOL[dtype]` x max |logit|) on both, it is a tie; a gap beyond it is a real disagreement.

Works through the `TargetModel` seam, so on either array library.
"""

from __future__ import annotations

import numpy as np

from .torch_backend.parity import first_divergence, tolerance


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


def explain_divergence(
    target, dtype: str, prompt: list[int], reference: list[int], tokens: list[int], width: int, detok=None
) -> dict | None:
    """The first position where `tokens` leaves `reference` (both generated after `prompt`), with the margins
    of a 1-row step and of a `width`-row verify there; None when one is a prefix of the other."""
    i = first_divergence(reference, tokens)
    if i is None or i >= min(len(reference), len(tokens)):
        return None
    a, b = reference[i], tokens[i]
    context = list(prompt) + list(reference[:i])
    kernels = {"step (1 row)": margins(next_token_logits(target, context, 1), a, b, dtype)}
    if width > 1:
        kernels[f"verify ({width} rows)"] = margins(next_token_logits(target, context, width), a, b, dtype)
    return {
        "position": i,
        "tokens": [a, b],
        "texts": [detok([a]), detok([b])] if detok is not None else None,
        "kernels": kernels,
        "tie": all(k["gap"] <= k["tolerance"] for k in kernels.values()),
    }


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
