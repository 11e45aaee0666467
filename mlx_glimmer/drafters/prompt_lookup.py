"""Prompt-lookup drafting: no model, the draft is what followed the last match of the recent n-gram.

Useful when the answer copies its input (summaries, rewrites, code edits).
The longest n-gram (from `max_ngram` down to `min_ngram`) ending at the
anchor that occurred earlier in prompt + output is looked up; the most recent
earlier occurrence wins, and the tokens after it are proposed.
"""

from __future__ import annotations

import mlx.core as mx


class PromptLookupDrafter:
    kind = "prompt-lookup"
    target_layer_ids = ()

    def __init__(self, *, draft_k: int = 10, max_ngram: int = 4, min_ngram: int = 1):
        self.draft_k = draft_k
        self.block_size = draft_k + 1
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.history: list[int] = []

    def reset(self) -> None:
        self.history = []

    def observe(self, tokens, features) -> None:
        self.history.extend(tokens)

    def rollback(self, n: int) -> bool:
        if n:
            del self.history[-n:]
        return True

    def lookup(self, seq: list[int], count: int) -> list[int]:
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            tail = seq[-n:]
            for start in range(len(seq) - n - 1, -1, -1):
                if seq[start : start + n] == tail:
                    return seq[start + n : start + n + count]
        return []

    def propose(self, anchor, count, params, key):
        found = self.lookup(self.history + [anchor], min(count, self.draft_k))
        return mx.array(found, dtype=mx.uint32), None
