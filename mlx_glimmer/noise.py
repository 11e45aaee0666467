"""Sampling noise keyed by position: the target's sample of the token at absolute position p (its index in the
whole sequence, prompt included) is argmax(log filtered_probs + G(seed, p, token)), Gumbel-max with noise G
that a counter-based hash of (seed, p, token) gives. Nothing else draws randomness, so a seed's text is the
same whatever rounds produced it: plain decoding, chains or trees of any shape (docs/design.md, "Sampling").

Written once over `array_ops.ArrayOps`, in 64-bit integers that never overflow (32-bit products are taken as
two 16-bit halves), so MLX and torch hash alike. A drafter that samples its draft of position p with the same
noise proposes the token the target will choose whenever their distributions agree closely.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from .array_ops import Array, ArrayOps

_MASK = 0xFFFFFFFF
_FLOAT_BITS = 23  # uniforms take the hash's top 23 bits: (k + 0.5) / 2**23 is exact in float32, never 0 or 1


@dataclass(frozen=True)
class Noise:
    """A sample's noise: the generation's `seed` and the absolute position `start` of the token its first row
    draws; row i draws the token at `start + i`."""

    seed: int
    start: int

    def at(self, offset: int) -> Noise:
        """The noise of the row `offset` rows further on."""
        return Noise(self.seed, self.start + offset)

    def rows(self, n: int) -> list[Noise]:
        """One noise per row of `n`, each a row of its own."""
        return [self.at(i) for i in range(n)]


def _times(x: Array, factor: int) -> Array:
    """x * factor modulo 2**32, for x in [0, 2**32), without products past 2**49."""
    return (x * (factor & 0xFFFF) + ((x * (factor >> 16)) & 0xFFFF) * 0x10000) & _MASK


def _mix(x: Array) -> Array:
    """A bijection of [0, 2**32) whose every output bit depends on every input bit (lowbias32)."""
    x = x ^ (x >> 16)
    x = _times(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _times(x, 0x846CA68B)
    return x ^ (x >> 16)


def gumbel(ops: ArrayOps, seed: int, positions: Array, vocab: int) -> Array:
    """float32 [len(positions), vocab]: the Gumbel noise G(seed, p, token) of each position p in `positions`
    (non-negative integers below 2**32) over the vocabulary."""
    return gumbel_of_tokens(ops, seed, positions, ops.arange(0, vocab, 1, ops.int64)[None, :])


def gumbel_of_tokens(ops: ArrayOps, seed: int, positions: Array, tokens: Array) -> Array:
    """float32 [len(positions), k]: G(seed, positions[i], tokens[i, j]), the noise `gumbel` gives those tokens
    at those positions, for `tokens` [len(positions), k] or [1, k] (a sample over a subset of the vocabulary
    draws what the full one draws there)."""
    seed_words = ops.array([seed & _MASK, (seed >> 32) & _MASK], ops.int64)
    return _traced_gumbel(ops)(ops.astype(positions, ops.int64), seed_words, ops.astype(tokens, ops.int64))


@functools.lru_cache(maxsize=None)
def _traced_gumbel(ops: ArrayOps) -> Callable:
    """The hash as one lasting function of arrays (positions, seed and tokens are all inputs, nothing is baked
    into a trace), so a library that compiles (`ArrayOps.compile`) fuses its few dozen elementwise passes over
    [rows, vocab] into one and traces it once per shape."""
    return ops.compile(functools.partial(_gumbel, ops))


def _gumbel(ops: ArrayOps, positions: Array, seed_words: Array, tokens: Array) -> Array:
    key = _mix(_mix((positions & _MASK) ^ seed_words[0]) ^ seed_words[1])[:, None]
    bits = _mix(_mix(key ^ tokens) ^ key)
    uniform = (ops.astype(bits >> (32 - _FLOAT_BITS), ops.float32) + 0.5) / float(1 << _FLOAT_BITS)
    return -ops.log(-ops.log(uniform))


def gumbel_scores(ops: ArrayOps, probs: Array, noise: Noise, tokens: Array | None = None) -> Array:
    """float32 [n, V]: log `probs` [..., V] (rows flattened in order) plus the noise of row i's position
    `noise.start + i`, column j drawing the noise of token j, or of token `tokens[j]` where the columns are a
    subset of the vocabulary (a drafter's own: its sample is then the token a full-vocabulary sample of the
    same distribution draws). A row's argmax is its sample; a draft judged against these scores as against
    greedy logits keeps exactly the tokens the target samples."""
    rows = probs.reshape(-1, probs.shape[-1])
    positions = ops.arange(noise.start, noise.start + rows.shape[0], 1, ops.int64)
    if tokens is None:
        draws = gumbel(ops, noise.seed, positions, rows.shape[-1])
    else:
        draws = gumbel_of_tokens(ops, noise.seed, positions, tokens.reshape(1, -1))
    return ops.log(rows) + draws


def gumbel_max(ops: ArrayOps, probs: Array, noise: Noise, tokens: Array | None = None) -> Array:
    """One column per row of `probs` ([..., V] -> [...], `ArrayOps.index`): row i the sample of the token at
    position `noise.start + i` (rows flattened in order), the columns being tokens 0..V-1 or `tokens`
    (`gumbel_scores`)."""
    return ops.argmax(gumbel_scores(ops, probs, noise, tokens), -1).reshape(tuple(probs.shape[:-1]))
