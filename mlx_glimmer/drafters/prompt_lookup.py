"""Prompt-lookup drafting: no model, the draft is what followed the last match of the recent n-gram.

Useful when the answer copies its input (summaries, rewrites, code edits).
The longest n-gram (from `max_ngram` down to `min_ngram`) ending at the
anchor that occurred earlier in prompt + output is looked up; the most recent
earlier occurrence wins, and the tokens after it are proposed.

An index from every n-gram of the history to where it starts (newest last) is
kept as tokens are observed and rolled back, so a lookup costs one dictionary
probe per n-gram length instead of a scan of the whole history.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .base import Drafter


@dataclass(frozen=True)
class Match:
    """What the lookup found: the continuation, and the length of the n-gram it matched (0: nothing). A longer
    match continues the context far more often (docs/design.md), so acceptance is learnt per length."""

    tokens: list[int]
    ngram: int


class PromptLookupDrafter(Drafter):
    kind = "prompt-lookup"

    def __init__(self, *, draft_k: int = 10, max_ngram: int = 4, min_ngram: int = 1):
        self.draft_k = draft_k
        self.block_size = draft_k + 1
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.history: list[int] = []
        self._starts: dict[tuple[int, ...], list[int]] = {}  # n-gram -> where it starts in history, ascending

    def reset(self) -> None:
        self.history = []
        self._starts = {}

    def observe(self, tokens, features) -> None:
        for t in tokens:
            self.history.append(int(t))
            end = len(self.history)
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self._starts.setdefault(tuple(self.history[end - n :]), []).append(end - n)

    def rollback(self, n: int) -> bool:
        for _ in range(min(n, len(self.history))):
            end = len(self.history)
            for m in range(self.min_ngram, min(self.max_ngram, end) + 1):
                gram = tuple(self.history[end - m :])
                starts = self._starts[gram]
                starts.pop()
                if not starts:
                    del self._starts[gram]
            self.history.pop()
        return True

    def lookup(self, seq: list[int], count: int) -> list[int]:
        """The reference rule, by scanning `seq` (the history plus the anchor): what `propose` answers."""
        return self.reference_match(seq, count).tokens

    def reference_match(self, seq: list[int], count: int) -> Match:
        """`lookup` with the length of the n-gram it matched."""
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            tail = seq[-n:]
            for start in range(len(seq) - n - 1, -1, -1):
                if seq[start : start + n] == tail:
                    return Match(seq[start + n : start + n + count], n)
        return Match([], 0)

    def indexed_lookup(self, anchor: int, count: int) -> list[int]:
        """`lookup(history + [anchor], count)` from the index."""
        return self.indexed_match(anchor, count).tokens

    def indexed_match(self, anchor: int, count: int) -> Match:
        """`reference_match(history + [anchor], count)` from the index: an earlier occurrence of the tail lies
        wholly in the history, and the newest one wins."""
        history = self.history
        size = len(history)
        for n in range(min(self.max_ngram, size), self.min_ngram - 1, -1):
            starts = self._starts.get(tuple(history[size - n + 1 :]) + (anchor,))
            if starts:
                start = starts[-1] + n
                found = history[start : start + count]
                if len(found) < count and start + len(found) == size:
                    found.append(anchor)
                return Match(found, n)
        return Match([], 0)

    def propose(self, anchor, count, params, noise):
        found = self.indexed_lookup(int(anchor), min(count, self.draft_k))
        return mx.array(found, dtype=mx.uint32), None
