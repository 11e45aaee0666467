"""Log-probabilities of generated tokens: what the target itself gave each one, read with the verdict.

Every verify pass computes the target's logits at each position it verifies; a committed token's
log-probability is the log-softmax of the logits row it was judged at (before temperature, top-k and top-p,
as OpenAI and mlx_lm.server report them). When `GenerationSettings.logprobs` asks for them, the loop has the
device compute, next to each round's verdict, a table for every verify position (`tree.round_logprobs`):
each drafted node's log-probability at its parent's row, the next token's at the accepted path's end, and
every row's K likeliest tokens. The round's one host read brings the table back with the verdict (floats as
their int32 bit patterns, since the read is of integers); here it is turned into one `TokenLogprob` per
committed token. The rows of a draft tree are its positions: a committed token's row is the path position
before it (its parent), so the values are those of the target's own decoding, chain, tree or plain.

This module imports no array library: it reads what the device computed, and runs the `TargetModel` seam
for a prompt's own log-probabilities (`prompt_logprobs`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Sequence

from .settings import GenerationSettings
from .target_model import Array, TargetModel


@dataclass(frozen=True)
class TokenLogprob:
    """A token, its log-probability under the target at its position, and the `top` likeliest tokens there
    as (token, log-probability) pairs, best first (as many as asked: `GenerationSettings.logprobs`)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def to_dict(self) -> dict:
        return {
            "token": self.token,
            "logprob": self.logprob,
            "top": [{"token": t, "logprob": lp} for t, lp in self.top],
        }


def floats(bits: Sequence[int]) -> list[float]:
    """float32 values from their int32 bit patterns (as a host read returns them)."""
    n = len(bits)
    return list(struct.unpack(f"<{n}f", struct.pack(f"<{n}i", *bits)))


@dataclass(frozen=True)
class Table:
    """A read `tree.token_logprobs`: `chosen[i]` the log-probability of its i-th (row, token) pair, and
    `top[r]` row r's likeliest tokens with theirs, best first."""

    chosen: list[float]
    top: list[tuple[tuple[int, float], ...]]

    def entry(self, row: int, index: int, token: int) -> TokenLogprob:
        """The `TokenLogprob` of `token`, the table's `index`-th chosen pair, judged at `row`."""
        return TokenLogprob(token, self.chosen[index], self.top[row])


def read_table(values: Sequence[int], chosen: int, width: int, top: int) -> Table:
    """The `Table` in `values` (what a host read returned for `tree.token_logprobs`): `chosen` pairs over
    `width` rows, `top` alternatives per row."""
    lps = floats(values[: chosen + width * top])
    ids = values[chosen + width * top : chosen + 2 * width * top]
    rows = [
        tuple(zip(ids[r * top : (r + 1) * top], lps[chosen + r * top : chosen + (r + 1) * top])) for r in range(width)
    ]
    return Table(lps[:chosen], rows)


def table_size(chosen: int, width: int, top: int) -> int:
    """How many integers a `tree.token_logprobs` table of `chosen` pairs over `width` rows takes in a read."""
    return chosen + 2 * width * top


def path_logprobs(table: Table, positions: Sequence[int], committed: Sequence[int]) -> list[TokenLogprob]:
    """One `TokenLogprob` per committed token of a verify round read from `tree.round_logprobs` (its first
    entries: one per node, then the next token). Token j was judged at path position `positions[j]`; it is
    the node at `positions[j + 1]`, or the next token after the path's end."""
    out = []
    nodes = len(table.chosen) - 1
    for j, token in enumerate(committed):
        index = positions[j + 1] - 1 if j + 1 < len(positions) else nodes
        out.append(table.entry(positions[j], index, token))
    return out


def prompt_logprobs(target: Any, tokens: Sequence[int], top: int, chunk: int = 512) -> list[TokenLogprob | None]:
    """The log-probability of every prompt token after the ones before it, and the `top` likeliest there: one
    forward over the prompt on a cache of its own (`target` a `target_model.TargetModel`), in chunks, read once.
    The first token has nothing before it: None, as OpenAI's `echo` gives it."""
    tokens = list(tokens)
    top = min(top, target.vocab_size)
    cache = target.make_cache(reserve=1)
    ids = target.tokens(tokens)
    tables, sizes = [], []
    for start in range(0, len(tokens), chunk):
        hidden, _ = target.forward(ids[start : start + chunk], cache, capture=False)
        scored = min(chunk, len(tokens) - 1 - start)  # rows whose next token is in the prompt
        if scored > 0:
            table = target.trees.token_logprobs(target.head(hidden[:scored]), ids[start + 1 : start + 1 + scored], top)
            target.launch(table)  # computed now, so each chunk's logits are freed before the next
            tables.append(table)
            sizes.append(scored)
    values = target.read(*tables) if tables else []
    out: list[TokenLogprob | None] = [None]
    offset = 0
    for scored in sizes:
        table = read_table(values[offset:], scored, scored, top)
        offset += table_size(scored, scored, top)
        first = len(out)  # the prompt position of this chunk's first scored token
        out += [table.entry(i, i, tokens[first + i]) for i in range(scored)]
    return out


def logprob_top(target: TargetModel, settings: GenerationSettings) -> int | None:
    """How many alternatives each committed token's log-probability comes with (at most the vocabulary);
    None: none are computed."""
    return None if settings.logprobs is None else min(settings.logprobs, target.vocab_size)


def one_row_logprobs(target: TargetModel, logits: Array, token: Array, top: int | None) -> Array | None:
    """The log-probability table of one token picked from `logits` [1, V], lazily; None when not asked."""
    return None if top is None else target.trees.token_logprobs(logits, token, top)


def read_one_row(values: list[int], token: int, top: int | None) -> list[TokenLogprob] | None:
    """`one_row_logprobs`, read (`values`: what the read returned after the token)."""
    return None if top is None else [read_table(values, 1, 1, top).entry(0, 0, token)]
