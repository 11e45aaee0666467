"""A test drafter that knows the target's greedy continuation and lies at chosen positions."""

import mlx.core as mx

from mlx_glimmer.drafters.base import Drafter


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

    def propose(self, anchor, count, params, key):
        self.proposals += 1
        start = self.observed - self.prompt_len + 1  # generated index of the first draft token
        out = []
        for i in range(start, start + count):
            t = self.continuation[i] if i < len(self.continuation) else 0
            out.append((t + 1) % self.vocab if i in self.wrong else t)
        return mx.array(out, dtype=mx.uint32), None
