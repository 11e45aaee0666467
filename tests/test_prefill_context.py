"""The drafter's prompt context is computed with the prefill, so `auto` keeps drafting after a long prompt."""

import mlx.core as mx
import numpy as np
from oracle_drafter import OracleDrafter
from table_timed import table_timed

import mlx_glimmer
from mlx_glimmer.block_policy import width_policy
from mlx_glimmer.settings import GenerationSettings
from mlx_glimmer.speculative import generate_steps
from mlx_glimmer.verify_cost import BANDS, VerifyCost

LONG = 2000


class WorkingOracle(OracleDrafter):
    """Proposes the target's own greedy tokens, doing all the work of a real DFlash drafter on the way: it reads
    the target's features, projects them into the drafter's context and runs the drafter's block forward (its
    draft depends on that forward's output, so the work is part of the draft's graph)."""

    def __init__(self, real, prompt_len, continuation, vocab):
        super().__init__(prompt_len, continuation, set(), vocab, block_size=real.block_size)
        self.real = real
        self.target_layer_ids = real.target_layer_ids

    def reset(self):
        super().reset()
        self.real.reset()

    def observe(self, tokens, features):
        super().observe(tokens, features)
        self.real.observe(tokens, features)

    def rollback(self, n):
        return self.real.rollback(n)

    @property
    def backlog(self):
        return self.real.backlog

    def settle(self):
        return self.real.settle()

    def propose(self, anchor, count, params, noise):
        own, _ = super().propose(anchor, count, params, noise)
        real, _ = self.real.propose(anchor, count, params, noise)
        return own + real.astype(mx.uint32) * 0, None


def long_prompt(vocab: int) -> list[int]:
    rng = np.random.default_rng(11)
    return [256] + [int(t) for t in rng.integers(0, 256, LONG - 1)]


def test_auto_drafts_wide_after_a_2000_token_prompt(muse_pair):
    """With a cost table where wide verifies pay (given, not timed), a drafter that knows the answer is verified
    wide from the first rounds after a long prompt, and on the next generation too (the policy carries over)."""
    prompt = long_prompt(muse_pair.target.vocab_size)
    plain = mlx_glimmer.generate(muse_pair, prompt, max_tokens=200, speculative=False).token_ids
    oracle = WorkingOracle(muse_pair.drafter, len(prompt), plain, muse_pair.target.vocab_size)
    width = oracle.block_size
    cost = VerifyCost(width, [[1.0 + 0.02 * (w - 1) for w in range(1, width + 1)] for _ in BANDS])
    policy = table_timed(width_policy(width, cost))
    for turn in range(2):
        steps = list(generate_steps(muse_pair.target, prompt, GenerationSettings(max_tokens=200), drafter=oracle,
                                    policy=policy))  # fmt: skip
        assert [t for s in steps for t in s.tokens][: len(plain)] == plain
        widths = [s.drafted + 1 for s in steps[1:9]]
        assert sum(w > 4 for w in widths) >= 6, (turn, widths)
        policy = table_timed(width_policy(width, cost, policy))


def test_the_prompt_context_is_evaluated_with_the_prefill(muse_pair):
    """After the prefill step the drafter holds no backlog: its context arrays were computed with the prompt."""
    prompt = long_prompt(muse_pair.target.vocab_size)
    drafter = muse_pair.drafter
    steps = generate_steps(muse_pair.target, prompt, GenerationSettings(max_tokens=20, block_size=4), drafter=drafter)
    first = next(steps)
    assert first.prefill_tokens == LONG and drafter.backlog == 0
    assert drafter.position == LONG
    steps.close()
