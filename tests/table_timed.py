"""A width policy that learns every round's time from its cost table instead of the clock.

A loop-level test of `--block-size auto` then follows the costs it gives, whatever else the machine runs: the
loop still hands the policy wall-clock seconds, and this replaces them with what the table says the round's
verify costs (no drafting time), so the choices depend only on the table and on what the rounds kept.
"""

from __future__ import annotations

from mlx_glimmer.block_policy import WidthPolicy


def table_timed(policy: WidthPolicy) -> WidthPolicy:
    """`policy`, its `observe_round` fed the cost table's seconds for each round's width."""
    observe = policy.observe_round

    def observe_round(shape, accepted, context, seconds, *args, **kwargs):
        observe(shape, accepted, context, policy.cost.estimate(shape.width, context), *args, **kwargs)

    policy.observe_round = observe_round
    return policy
