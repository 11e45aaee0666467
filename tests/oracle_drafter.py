"""Test drafters that know the target's greedy continuation and lie at chosen positions (as a chain, or
as marginals whose second choice is the right token), and a width policy that never drafts."""

import mlx.core as mx
import numpy as np

from mlx_glimmer.block_policy import Shape
from mlx_glimmer.drafters.base import Drafter, Marginals


class OracleDrafter(Drafter):
    """Proposes `continuation[i]` for generated index i, except at `wrong` indices.

    This exercises the loop at high acceptance (long accepted runs, full
    blocks, rejections at known places) without a trained drafter.
    """

    kind = "oracle"
    target_layer_ids = ()

    def __init__(self, prompt_len: int, continuation: list[int], wrong: set[int], vocab: int, block_size: int = 16):
        self.prompt_len = prompt_len
        self.continuation = list(continuation)
        self.wrong = set(wrong)
        self.vocab = vocab
        self.block_size = block_size
        self.observed = 0
        self.proposals = 0

    def reset(self):
        self.observed = 0

    def observe(self, tokens, features):
        self.observed += len(tokens)

    def propose(self, anchor, count, params, noise):
        self.proposals += 1
        start = self.observed - self.prompt_len + 1  # generated index of the first draft token
        out = []
        for i in range(start, start + count):
            t = self.continuation[i] if i < len(self.continuation) else 0
            out.append((t + 1) % self.vocab if i in self.wrong else t)
        return mx.array(out, dtype=mx.uint32), None


class TreeOracle(Drafter):
    """Knows the target's greedy continuation: its per-position marginals put the most mass on the right token
    and the second most on a wrong one, except at `wrong` indices, where a wrong token comes first and the right
    one second, so the accepted path must take a side branch there. Its chain is its marginals' first choices,
    as a block drafter's greedy chain is, so a chain stops at every `wrong` index."""

    kind = "tree-oracle"
    block_size = 16
    has_marginals = True

    def __init__(self, prompt_len: int, continuation: list[int], wrong: set[int], vocab: int):
        self.prompt_len, self.continuation, self.wrong, self.vocab = prompt_len, continuation, wrong, vocab
        self.observed = 0

    def reset(self):
        self.observed = 0

    def observe(self, tokens, features):
        self.observed += len(tokens)

    def rollback(self, n):
        self.observed -= n
        return True

    def propose(self, anchor, count, params, noise):
        start = self.observed - self.prompt_len + 1
        return mx.array([self.first(i) for i in range(start, start + count)], dtype=mx.uint32), None

    def right(self, i: int) -> int:
        return self.continuation[i] if i < len(self.continuation) else 0

    def first(self, i: int) -> int:
        """Its first choice at generated index `i`."""
        return (self.right(i) + 1) % self.vocab if i in self.wrong else self.right(i)

    def logits(self, count: int) -> np.ndarray:
        """[count, vocab]: the next `count` draft positions' logits, the first choice at 10, the second at 9.5."""
        start = self.observed - self.prompt_len + 1  # generated index of the first draft position
        logits = np.zeros((count, self.vocab), np.float32)
        for row, i in enumerate(range(start, start + count)):
            right, first = self.right(i), self.first(i)
            logits[row, first], logits[row, right if i in self.wrong else (right + 2) % self.vocab] = 10.0, 9.5
        return logits

    def marginals(self, anchor, count):
        logits = mx.array(self.logits(count))
        return Marginals(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


class AlwaysPlain:
    """A width policy that never drafts: every round is a width-1 round of the drafting loop."""

    lookup = None  # no n-gram chains offered
    lookup_size = 0

    def choose(self, context, found=0, ngram=0):
        return Shape(1)

    def shapes(self):
        return [Shape(1)]

    def observe_round(self, *args, **kwargs):
        pass
