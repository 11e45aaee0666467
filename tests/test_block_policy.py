"""`--block-size auto`: the verify width follows measured cost and live acceptance, and output stays lossless."""

import copy
import dataclasses
import json

import numpy as np
import pytest
from oracle_drafter import OracleDrafter

import mlx_glimmer
from mlx_glimmer.block_policy import (
    TREE_WIDTHS,
    AcceptanceModel,
    LookupAcceptance,
    Shape,
    WidthPolicy,
    width_policy,
)
from mlx_glimmer.cli import main
from mlx_glimmer.generate import auto_policy
from mlx_glimmer.settings import GenerationSettings
from mlx_glimmer.verify_cost import MEASURED_WIDTHS, VerifyCost, band_of, measure_verify_cost

PROMPT = [256] + list(b"Once upon a time, in a land far away")


def linear_cost(width_max: int, base: float = 1.0, per_token: float = 0.06) -> VerifyCost:
    cost = VerifyCost(width_max)
    for row in cost.seconds:
        row[:] = [base + per_token * (w - 1) for w in range(1, width_max + 1)]
    return cost


def run(policy: WidthPolicy, accept_prob: float, rounds: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    widths = []
    for _ in range(rounds):
        shape = policy.choose(100)
        assert not shape.tree  # chains only: the policy was offered no tree budgets
        w = shape.width
        widths.append(w)
        kept = 0
        while kept < w - 1 and rng.random() < accept_prob:
            kept += 1
        # The loop times a round as a whole: the verify at this width, plus 0.2 s of drafting when it drafted.
        policy.observe_round(shape, kept, 100, seconds=policy.cost.estimate(w, 100) + (0.2 if w > 1 else 0.0))
    return widths


def test_expected_tokens_follow_the_per_position_rates():
    model = AcceptanceModel(3, decay=1.0)
    for _ in range(98):
        model.observe(3, 3)  # every draft kept
    assert model.rates()[0] == pytest.approx(99 / 100)
    assert model.expected_tokens(1) == 1.0
    a = model.rates()
    assert model.expected_tokens(4) == pytest.approx(1 + a[0] + a[0] * a[1] + a[0] * a[1] * a[2])
    assert 3.9 < model.expected_tokens(4) < 4.0
    short = AcceptanceModel(8, decay=1.0)
    for _ in range(20):
        short.observe(2, 2)  # only two positions ever offered, both always kept
    assert short.rates()[5] > 0.9, "unobserved positions follow the last observed one, not 1/2"
    model = AcceptanceModel(3, decay=1.0)
    for _ in range(98):
        model.observe(3, 0)  # first draft always rejected: later positions are never judged
    assert model.rates()[0] == pytest.approx(1 / 100, abs=1e-3) and model.offered[1] == 0


def test_a_drafter_that_agrees_gets_wide_blocks():
    widths = run(WidthPolicy(linear_cost(16), AcceptanceModel(15)), accept_prob=0.95, rounds=200)
    assert np.mean(widths[50:]) > 10


def test_a_drafter_that_never_agrees_falls_back_to_plain_with_rare_small_probes():
    widths = run(WidthPolicy(linear_cost(16), AcceptanceModel(15)), accept_prob=0.0, rounds=2000)
    late = widths[100:]
    probes = [w for w in late if w > 1]
    assert len(probes) <= 12, "probes back off exponentially"
    assert max(probes, default=1) <= 4, "never a full-block probe"


def test_drafting_comes_back_when_it_pays_again():
    policy = WidthPolicy(linear_cost(16), AcceptanceModel(15))
    run(policy, accept_prob=0.0, rounds=300)
    widths = run(policy, accept_prob=0.95, rounds=700, seed=1)
    assert np.mean(widths[-100:]) >= 8  # back to wide blocks (the optimum of this cost model is 10)


def test_width_one_wins_when_verify_cost_grows_steeply():
    policy = WidthPolicy(linear_cost(16, per_token=1.0), AcceptanceModel(15))
    widths = run(policy, accept_prob=0.5, rounds=300)
    assert np.mean([w == 1 for w in widths[100:]]) > 0.9


def test_rounds_verify_only_the_widths_the_cost_table_measured():
    # A sawtooth as a kernel that tiles rows by 8 draws it: width 12 dearer than 16, which the table cannot
    # know from widths 8 and 16, so a round that would like 12 verifies 16 (more drafts, less time).
    sawtooth = {w: 1.0 + 0.02 * (w - 1) + 0.03 * (w % 8) for w in range(1, 33)}
    cost = VerifyCost(32)
    cost.seconds[0] = [sawtooth[w] if w in MEASURED_WIDTHS else None for w in range(1, 33)]
    assert cost.widths() == list(MEASURED_WIDTHS)
    policy = width_policy(16, cost, tree_widths=TREE_WIDTHS)
    offered = policy.shapes(found=20)
    assert [s.width for s in offered if not s.tree and not s.lookup] == [w for w in MEASURED_WIDTHS if w <= 16]
    assert [s.width for s in offered if s.lookup] == [w for w in MEASURED_WIDTHS if 2 <= w <= 21]
    chains = width_policy(16, cost)
    widths = run(chains, accept_prob=0.9, rounds=300)
    assert set(widths) <= set(MEASURED_WIDTHS) and max(widths) == 16
    # a table from nowhere (nothing measured) offers every width
    assert VerifyCost(4).widths() == [1, 2, 3, 4]


def test_a_generation_with_trees_off_leaves_what_trees_on_learnt(muse_pair):
    trees_on = GenerationSettings(max_tokens=12)
    learnt = auto_policy(muse_pair, muse_pair.drafter, trees_on)
    for _ in range(3):
        learnt.lookup.observe(4, 5, 5)
        learnt.trees.observe(8, 6)
    mlx_glimmer.generate(muse_pair, PROMPT, GenerationSettings(max_tokens=12, tree="off"))
    again = auto_policy(muse_pair, muse_pair.drafter, trees_on)
    assert again.lookup.model(4).rates() == pytest.approx(learnt.lookup.model(4).rates())
    assert again.trees.expected(8, prior=1.0) == pytest.approx(learnt.trees.expected(8, prior=1.0))
    assert again.cost is learnt.cost  # the widest-32 table, with what its rounds refined, is not read afresh
    chains = auto_policy(muse_pair, muse_pair.drafter, GenerationSettings(tree="off"))
    assert chains.trees is None and chains.lookup is None


def test_a_new_generation_starts_from_what_the_last_one_kept_and_follows_its_own_text_sooner():
    first = width_policy(16, linear_cost(32, per_token=0.02), tree_widths=TREE_WIDTHS)
    for _ in range(40):  # the last answer went on as its context did, 4-gram matches whole
        first.observe_round(Shape(32, lookup=True), 31, 100, 1.6, lookup_ngram=4)
        first.observe_round(Shape(1), 0, 100, 1.0)
    second = width_policy(16, first.cost, first, TREE_WIDTHS)
    assert min(second.lookup.model(4).rates()) > 0.8  # a start: still trusted
    for _ in range(3):  # this answer does not
        first.observe_round(Shape(32, lookup=True), 0, 100, 1.6, lookup_ngram=4)
        second.observe_round(Shape(32, lookup=True), 0, 100, 1.6, lookup_ngram=4)
    # three misses outweigh what the last answer taught, in the new generation only
    assert second.lookup.model(4).rates()[0] < 0.65 < first.lookup.model(4).rates()[0]


def test_long_lookup_bets_that_miss_past_their_first_draft_stop_being_made():
    """The last answer copied whole passages on 4-gram matches; this one continues a list whose format repeats
    and whose entries are new: each 31-draft continuation keeps its first draft at most. Its deep positions are
    judged only where the first draft was kept, so their rates still say "copy"; what those rounds kept past
    the first draft, against what was expected there, ends the long bets within three rounds."""
    first = width_policy(16, linear_cost(32, per_token=0.05), tree_widths=TREE_WIDTHS)
    for _ in range(40):
        first.observe_round(Shape(32, lookup=True), 31, 100, 2.55, lookup_ngram=4)
        first.observe_round(Shape(1), 0, 100, 1.0)
    second = width_policy(16, first.cost, first, TREE_WIDTHS)
    chosen = []
    for i in range(6):
        shape = second.choose(100, 31, 4)
        chosen.append(shape)
        kept = i % 2 if shape.lookup else 0  # the first draft half the time, never the second
        second.observe_round(shape, kept, 100, second.cost.estimate(shape.width, 100), lookup_ngram=4)
    assert chosen[0] == Shape(32, lookup=True)  # the last answer's start
    assert all(s.width < 32 for s in chosen[3:]), chosen
    assert second.lookup.model(4).expected_tokens(32) > 10  # the per-position model alone would go on betting
    assert second.lookup.calibration(2) == 1.0  # a 2-gram match's, never tried, is left as it was


def test_cost_bands_and_measurement(muse_pair):
    assert [band_of(c) for c in (0, 511, 512, 5000, 10**6)] == [0, 0, 1, 2, 3]
    cost = measure_verify_cost(muse_pair.target, 8, muse_pair.target.vocab_size, contexts=(8,), repeats=1)
    row = cost.seconds[0]
    # MEASURED_WIDTHS below max_width, and max_width itself; the widths between are interpolated
    assert cost.widths() == [w for w in MEASURED_WIDTHS if w < 8] + [8]
    assert [w for w in range(1, 9) if row[w - 1] is not None] == cost.widths()
    assert all(s > 0 for s in row if s is not None)
    assert cost.estimate(6, 8) > 0 and cost._raw(6, 8) == pytest.approx((row[3] + row[7]) / 2)
    assert all(r == [None] * 8 for r in cost.seconds[1:])  # one context measured
    assert cost.estimate(6, 3000) > 0  # an unmeasured band borrows the nearest measured one
    default = measure_verify_cost(muse_pair.target, 6, muse_pair.target.vocab_size, repeats=0)
    assert default.widths() == [1, 2, 3, 4, 6]
    assert all(r == [None] * 6 for r in default.seconds[1:])  # the default measures one short context only


def test_auto_greedy_equals_plain_with_random_and_agreeing_drafters(muse_pair):
    plain = mlx_glimmer.generate(muse_pair, PROMPT, max_tokens=90, speculative=False)
    auto = mlx_glimmer.generate(muse_pair, PROMPT, max_tokens=90)  # random drafter, window 8: far past it
    assert auto.token_ids == plain.token_ids and auto.stats.block_policy == "auto"
    assert sum(auto.stats.verify_width_histogram.values()) == auto.stats.target_forwards
    oracle = OracleDrafter(
        len(PROMPT), plain.token_ids, {i for i in range(90) if i % 17 == 3}, muse_pair.target.vocab_size
    )
    agreeing = mlx_glimmer.generate(dataclasses.replace(muse_pair, drafter=oracle), PROMPT, max_tokens=90)
    assert agreeing.token_ids == plain.token_ids
    assert agreeing.stats.target_forwards < 45, agreeing.stats.verify_width_histogram


def test_block_size_flag_takes_auto_or_a_width(checkpoints, capsys):
    base = [
        "generate",
        str(checkpoints["llama"]),
        "--drafter",
        str(checkpoints["llama_assistant"]),
        "--prompt",
        "hi",
        "--max-tokens",
        "12",
        "--json",
    ]
    assert main(base) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["block_policy"] == "auto" and sum(out["verify_width_histogram"].values()) == out["target_forwards"]
    assert main(base + ["--block-size", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["block_policy"] == "fixed" and set(out["verify_width_histogram"]) <= {"1", "2", "3"}
    assert main(base + ["--block-size", "wide"]) == 2
    assert "--block-size" in capsys.readouterr().err


def test_a_noisy_cost_table_cannot_make_plain_look_dearer_than_a_wider_verify():
    cost = linear_cost(8)
    cost.seconds[0][0] = 5.0  # a spike while measuring width 1
    assert all(cost.estimate(w, 100) >= cost.estimate(w - 1, 100) for w in range(2, 9))
    widths = run(WidthPolicy(cost, AcceptanceModel(7)), accept_prob=0.0, rounds=400)
    assert np.mean([w == 1 for w in widths[100:]]) > 0.95


def test_a_round_that_projects_a_long_backlog_seeds_no_estimate():
    cost = VerifyCost(4, [[1.0, 1.1, 1.2, 1.3] for _ in range(4)])
    policy = WidthPolicy(cost, AcceptanceModel(3))
    policy.observe_round(Shape(4), 3, 100, seconds=50.0, timed=False)
    assert policy.draft_seconds is None and cost.counts[0] == [0, 0, 0, 0]
    assert policy.acceptance.offered[0] == 1.0  # its acceptance still counts
    policy.observe_round(Shape(4), 3, 100, seconds=1.5)
    assert policy.draft_seconds == 1.5 - 1.3


def test_one_slow_first_round_does_not_keep_drafting_off():
    """Load only adds time: rounds cheaper than the draft estimate pull it down fast."""
    cost = VerifyCost(4, [[1.0, 1.1, 1.2, 1.3] for _ in range(4)])
    policy = WidthPolicy(cost, AcceptanceModel(3))
    policy.observe_round(Shape(4), 3, 100, seconds=1.3 + 20.0)  # a cold first round: 20 s of "drafting"
    assert policy.draft_seconds == pytest.approx(20.0)
    for _ in range(6):
        policy.observe_round(Shape(4), 3, 100, seconds=1.3 + 0.2)
    assert policy.draft_seconds < 0.6
    assert policy.choose(100).width > 1
    for _ in range(50):  # and a spike later moves it only a little
        policy.observe_round(Shape(4), 3, 100, seconds=1.5)
    policy.observe_round(Shape(4), 3, 100, seconds=1.3 + 5.0)
    assert policy.draft_seconds < 0.2 + 0.1 * 5.0 + 1e-9


def run_shapes(policy: WidthPolicy, chain_depth, tree_depth, rounds: int = 300) -> list[Shape]:
    """Rounds in which a chain keeps `chain_depth(width)` drafts and a tree `tree_depth(width)`, each round
    taking what the cost table said at the start (the policy refines its own) plus a fixed overhead."""
    truth, shapes = copy.deepcopy(policy.cost), []
    for _ in range(rounds):
        shape = policy.choose(100)
        shapes.append(shape)
        depth = 0 if shape.width == 1 else (tree_depth if shape.tree else chain_depth)(shape.width)
        policy.observe_round(shape, depth, 100, seconds=truth.estimate(shape.width, 100) + 0.05)
    return shapes


def test_auto_verifies_trees_when_they_keep_more_at_the_same_cost():
    policy = width_policy(16, linear_cost(32, per_token=0.02), tree_widths=TREE_WIDTHS)
    shapes = run_shapes(policy, chain_depth=lambda w: min(w - 1, 2), tree_depth=lambda w: min(w - 1, 5))
    late = shapes[-100:]
    assert sum(s.tree for s in late) >= 80, late


def test_auto_leaves_trees_that_keep_less_than_chains():
    policy = width_policy(16, linear_cost(32, per_token=0.02), tree_widths=TREE_WIDTHS)
    shapes = run_shapes(policy, chain_depth=lambda w: min(w - 1, 3), tree_depth=lambda w: 0)
    late = shapes[-100:]
    assert sum(s.tree for s in late) <= 10, late  # probes only
    assert all(s.width > 1 for s in late if not s.tree)


def test_trees_far_dearer_than_the_best_chain_for_the_same_tokens_are_not_probed():
    """Every tree keeps what the chain of its width keeps and takes longer to draft; verify cost grows steeply, so a
    tree of 32 would commit under half the best chain's tokens per second and is never worth a probe, while a small
    tree, nearly as good, is still probed now and then. Chains win, though a tree was tried first."""
    policy = width_policy(16, linear_cost(32, per_token=0.06), tree_widths=TREE_WIDTHS)
    shapes = []
    for _ in range(300):
        shape = policy.choose(100)
        shapes.append(shape)
        seconds = policy.cost.estimate(shape.width, 100) + (0.15 if shape.tree else 0.05)
        policy.observe_round(shape, min(shape.width - 1, 2), 100, seconds=seconds)
    assert Shape(32, tree=True) not in shapes
    late = shapes[-100:]
    assert 3 <= sum(s.tree for s in late) <= 10, late
    assert all(s.width in (3, 4, 5) for s in late if not s.tree), late


def test_auto_with_trees_still_falls_back_to_plain_when_nothing_is_kept():
    policy = width_policy(16, linear_cost(32, per_token=0.06), tree_widths=TREE_WIDTHS)
    shapes = run_shapes(policy, chain_depth=lambda w: 0, tree_depth=lambda w: 0)
    assert sum(s.width == 1 for s in shapes[-100:]) >= 90


def test_a_shape_is_judged_by_its_own_rounds_when_the_table_misjudges_it():
    """A table timed under load can rate a 16-token verify as cheap as an 8-token one; the rounds tell."""
    table = VerifyCost(32, [[0.1] * 32 for _ in range(4)])  # every width "costs" the same

    def real_seconds(shape: Shape) -> float:
        return 0.1 + 0.05 * (shape.width - 1)

    policy = width_policy(16, table, tree_widths=TREE_WIDTHS)
    shapes = []
    for _ in range(300):
        shape = policy.choose(100)
        shapes.append(shape)
        depth = 0 if shape.width == 1 else min(shape.width - 1, 3 if shape.tree else 1)
        policy.observe_round(shape, depth, 100, seconds=real_seconds(shape))
    late = shapes[-100:]
    # Truly best: a tree of 4 (4 tokens in 0.25 s); the table alone would pick the widest tree.
    assert sum(s == Shape(4, tree=True) for s in late) >= 80, late


def test_the_lookups_continuation_alone_is_chosen_when_it_is_found_and_kept():
    """Where the context repeats itself the n-gram continuation, verified alone, needs no drafter call; with
    nothing found the policy goes back to what it drafts."""
    policy = width_policy(16, linear_cost(32, per_token=0.02), tree_widths=TREE_WIDTHS)
    shapes = []
    for i in range(300):
        found = 12 if i % 2 else 0
        shape = policy.choose(100, found, ngram=4 if found else 0)
        shapes.append((found, shape))
        if shape.lookup:
            assert shape.width <= found + 1
            depth = shape.width - 1  # the lookup is always right
        else:
            depth = 0 if shape.width == 1 else min(shape.width - 1, 2)
        drafting = 0.0 if shape.lookup or shape.width == 1 else 0.3
        seconds = policy.cost.estimate(shape.width, 100) + drafting
        policy.observe_round(shape, depth, 100, seconds=seconds, lookup_ngram=4 if shape.lookup else 0)
    late = shapes[-100:]
    assert sum(s.lookup and s.width == 13 for found, s in late if found) >= 40  # the rest: probes
    assert not any(s.lookup for found, s in late if not found)


def test_where_the_lookup_is_best_its_wider_chains_are_probed_a_step_up_and_chains_far_behind_not_at_all():
    """The context's continuation keeps 7 drafts a round and the drafter's chain 1. Once the chains are judged they
    commit under half the lookup's tokens per second, so probing them gives up half a round for nothing; the
    lookup's wider chains are probed one measured width above the best, not at the widest, which here costs twice
    as much for the same 8 tokens."""
    policy = width_policy(16, linear_cost(32, per_token=0.06), tree_widths=TREE_WIDTHS)
    shapes = []
    for _ in range(300):
        shape = policy.choose(100, 31, ngram=4)
        shapes.append(shape)
        depth = 0 if shape.width == 1 else min(shape.width - 1, 7 if shape.lookup else 1)
        seconds = policy.cost.estimate(shape.width, 100) + (0.0 if shape.lookup else 0.05)
        offered = shape.width - 1 if shape.lookup else 0
        policy.observe_round(shape, depth, 100, seconds, lookup_offered=offered, lookup_kept=depth, lookup_ngram=4)
    assert any(not s.lookup and not s.tree and s.width > 1 for s in shapes), "the chains were judged once"
    late = shapes[-200:]
    assert all(s.lookup for s in late), late
    assert sum(s.width == 8 for s in late) >= 150, late
    assert all(s.width <= 9 for s in late), late


def test_after_a_broken_copy_the_lookup_verifies_a_short_chain_and_widens_only_as_the_copy_goes_on():
    """A 27-token copy leaves the lookup's deep positions rated near 1. The next match is verified at most 4x as
    wide as what the last lookup round committed (at least 8 tokens): after a round that kept 1 draft, 8; after
    one that kept all 7, up to 32 (every width costs what the line says here, so the widest need not win)."""
    policy = width_policy(16, linear_cost(32, per_token=0.02), tree_widths=TREE_WIDTHS)
    for _ in range(3):
        policy.observe_round(Shape(32, lookup=True), 27, 100, 1.6, lookup_ngram=4)
    first = policy.choose(100, 31, ngram=4)
    assert first.lookup and first.width > 16  # the last round committed 28 tokens
    policy.observe_round(Shape(32, lookup=True), 1, 100, 1.6, lookup_ngram=4)  # the copy breaks
    assert policy.lookup.expected_all(4, 32)[-1] > 10  # still expected to go on far
    assert policy.choose(100, 31, ngram=4) == Shape(8, lookup=True)
    policy.observe_round(Shape(8, lookup=True), 7, 100, 1.14, lookup_ngram=4)
    again = policy.choose(100, 31, ngram=4)
    assert again.lookup and again.width > 16


def test_a_long_ngram_match_is_trusted_apart_from_a_short_one():
    """A 4-gram match's continuation is kept whole and a 2-gram match's never: the policy verifies the first
    alone and, after the second, drafts as it would with nothing found."""
    policy = width_policy(16, linear_cost(32, per_token=0.02), tree_widths=TREE_WIDTHS)
    chosen = {2: [], 4: []}
    for i in range(400):
        ngram = 4 if i % 2 else 2
        shape = policy.choose(100, 12, ngram)
        chosen[ngram].append(shape)
        if shape.lookup:
            depth = shape.width - 1 if ngram == 4 else 0
        else:
            depth = 0 if shape.width == 1 else min(shape.width - 1, 1)
        drafting = 0.0 if shape.lookup or shape.width == 1 else 0.3
        seconds = policy.cost.estimate(shape.width, 100) + drafting
        policy.observe_round(shape, depth, 100, seconds=seconds, lookup_ngram=ngram if shape.lookup else 0)
    strong, weak = chosen[4][-100:], chosen[2][-100:]
    assert sum(s.lookup and s.width == 13 for s in strong) >= 80, strong
    assert sum(s.lookup for s in weak) <= 20, weak  # probes only
    assert policy.lookup.model(4).rates()[0] > 0.9 > 0.5 > policy.lookup.model(2).rates()[0]


def test_a_match_length_seldom_seen_starts_from_what_the_lookup_keeps_at_the_others():
    """In a passage copied whole, 4-gram matches keep all 7 drafts round after round; the first 2-gram match is
    expected to go on far past the 1/2-per-draft a lookup knows nothing of, and its own misses still count."""
    lookup = LookupAcceptance(15)
    for _ in range(12):
        lookup.observe(4, 7, 7)
    assert lookup.expected_all(2, 8)[-1] > 5.0 > AcceptanceModel(15).expected_tokens(8)
    for _ in range(6):
        lookup.observe(2, 7, 0)
    assert lookup.expected_all(2, 8)[-1] < 2.0 < 5.0 < lookup.expected_all(4, 8)[-1]


def test_plain_rounds_are_judged_by_their_own_mean_time_not_the_tables_bare_forward():
    """On this kind of CPU one token's forward costs more than two tokens' (a matrix-vector kernel), so the table's
    plain step, the least over wider widths, is a bare 2-token forward; a plain round also samples and reads back,
    and plain rounds queued one ahead are read in pairs (one at once, the next carrying both). Once plain rounds
    show what they take, a lookup chain of 2 that keeps nothing but costs less is verified instead."""
    cost = VerifyCost(32, [[1.2, 1.0, 1.05] + [1.05 + 0.02 * w for w in range(29)] for _ in range(4)])
    policy = width_policy(16, cost, tree_widths=TREE_WIDTHS)
    chosen = []
    for i in range(200):
        shape = policy.choose(100, found=1, ngram=1)
        chosen.append(shape)
        if shape.width == 1:
            seconds = 0.0 if i % 2 else 2.6  # queued in pairs: 1.3 s a round
        else:
            seconds = 1.05 if shape.lookup else 1.3 + 0.3
        policy.observe_round(shape, 0, 100, seconds, lookup_offered=shape.width - 1, lookup_ngram=1)
    late = chosen[-100:]
    assert sum(s == Shape(2, lookup=True) for s in late) >= 90, late


@pytest.mark.parametrize("found_every", [1, 2])
def test_a_new_generation_judges_the_drafters_chains_again_where_the_lookup_leads(found_every):
    """The last prompt was copied whole and its chains kept nothing; on this one the lookup's weak matches keep
    one draft and the drafter's chains three. Carried from the last prompt, the chains rate below plain and far
    below the lookup, and would never be judged again: with a match every round, a drafter not yet judged on
    this text is probed where its prior comes within the probe floor; with plain rounds between the lookup's,
    those plain rounds count toward a probe, which goes to the chains first. Then the chains take over."""
    cost, drafting = linear_cost(32, per_token=0.02), 0.1 if found_every == 1 else 0.3
    first = width_policy(16, cost, tree_widths=TREE_WIDTHS)
    for _ in range(100):
        shape = first.choose(100, 31, ngram=4)
        depth = shape.width - 1 if shape.lookup else 0
        seconds = cost.estimate(shape.width, 100) + (0.0 if shape.lookup else drafting)
        first.observe_round(shape, depth, 100, seconds, lookup_offered=31 if shape.tree else 0, lookup_kept=depth,
                            lookup_ngram=4)  # fmt: skip
    assert first.acceptance.rates()[0] < 0.3
    policy = width_policy(16, cost, first, TREE_WIDTHS)
    shapes = []
    for i in range(120):
        found = 12 if i % found_every == 0 else 0
        shape = policy.choose(100, found, ngram=1 if found else 0)
        shapes.append(shape)
        if shape.lookup:
            depth = min(shape.width - 1, 1)
        else:
            depth = 0 if shape.width == 1 else min(shape.width - 1, 0 if shape.tree else 3)
        seconds = cost.estimate(shape.width, 100) + (0.0 if shape.lookup or shape.width == 1 else drafting)
        policy.observe_round(shape, depth, 100, seconds, lookup_ngram=1 if shape.lookup else 0)
    late = shapes[-60:]
    assert sum(not s.lookup and not s.tree and s.width >= 4 for s in late) >= 45, late
