"""`--block-size auto`: one model, expected committed tokens per second, chooses every round's shape.

The policy is driven here with a given cost table and given acceptance: synthetic rounds with synthetic
seconds, never the wall clock."""

import copy
import json

import numpy as np
import pytest
from oracle_drafter import OracleDrafter
from table_timed import table_timed

import mlx_glimmer
from mlx_glimmer import verify_cost
from mlx_glimmer.block_policy import CARRIED_ROUNDS, TREE_WIDTHS, DepthAcceptance, Shape, width_policy
from mlx_glimmer.cli import main
from mlx_glimmer.generate import auto_policy
from mlx_glimmer.settings import GenerationSettings
from mlx_glimmer.speculative import generate_steps
from mlx_glimmer.verify_cost import MEASURED_WIDTHS, VerifyCost, band_of, measure_verify_cost

PROMPT = [256] + list(b"Once upon a time, in a land far away")


def table(per_token: float = 0.06, width: int = 32, seconds=None) -> VerifyCost:
    """A cost table measured at MEASURED_WIDTHS (and the widest) after a short context: a line, or `seconds(w)`."""
    cost = VerifyCost(width)
    line = seconds or (lambda w: 1.0 + per_token * (w - 1))
    cost.seconds[0] = [line(w) if w in MEASURED_WIDTHS or w == width else None for w in range(1, width + 1)]
    return cost


def kept_by(rng, odds: float, most: int) -> int:
    """Drafts kept while a coin with `odds` says so, at most `most`."""
    kept = 0
    while kept < most and rng.random() < odds:
        kept += 1
    return kept


def rounds(policy, n, keep, draft=0.2, found=0, ngram=4, context=100, seed=0, truth=None) -> list[Shape]:
    """`n` rounds: each keeps drafts while a coin with `keep(shape)`'s odds says so and takes what `truth` (the
    table as first given) says its width costs, plus `draft` seconds when the drafter drafted (1.5x for a tree).
    A tree holds the drafter's chain a quarter of its budget deep, judged with the chain's odds: the tree keeps at
    least what that chain keeps."""
    rng, truth, shapes = np.random.default_rng(seed), truth or copy.deepcopy(policy.cost), []
    for _ in range(n):
        shape = policy.choose(context, found, ngram)
        kept, chain_depth, chain_kept = kept_by(rng, keep(shape), shape.width - 1), 0, 0
        if shape.tree:
            chain_depth = shape.width // 4
            chain_kept = kept_by(rng, keep(Shape(2)), chain_depth)
            kept = max(kept, chain_kept)
        drafting = 0.0 if shape.width == 1 or shape.lookup else draft * (1.5 if shape.tree else 1.0)
        seconds = truth.measured(shape.width, band_of(context)) + drafting
        policy.observe_round(
            shape, kept, context, seconds, lookup_ngram=ngram if shape.lookup else 0,
            chain_depth=chain_depth, chain_kept=chain_kept,
        )  # fmt: skip
        shapes.append(shape)
    return shapes


def odds(chain=0.0, tree=0.0, lookup=0.0):
    return lambda s: tree if s.tree else lookup if s.lookup else chain


def test_expected_tokens_follow_the_per_depth_rates():
    model = DepthAcceptance(3)
    for _ in range(200):
        model.observe(3, 3)  # every draft kept
    a = model.rates()
    assert a[0] > 0.95 and model.expected()[0] == 1.0
    assert model.expected()[3] == pytest.approx(1 + a[0] + a[0] * a[1] + a[0] * a[1] * a[2])
    short = DepthAcceptance(8)
    for _ in range(20):
        short.observe(2, 2)  # only two depths ever offered, both kept
    assert short.rates()[5] > 0.9, "a depth never judged follows the one before it, not 1/2"
    never = DepthAcceptance(3)
    for _ in range(50):
        never.observe(3, 0)
    assert never.rates()[0] < 0.05 and never.judged[1] == 0  # later depths were never judged
    assert DepthAcceptance(3).rates(prior=[0.9, 0.8, 0.7]) == pytest.approx([0.9, 0.8, 0.7])


def test_plain_when_nothing_is_accepted_and_exploration_stays_bounded():
    """A drafter that accepts nothing: drafting shapes are tried less and less often (about ln t times each)."""
    policy = width_policy(16, table(), tree_widths=TREE_WIDTHS)
    shapes = rounds(policy, 3000, odds())
    late = shapes[1000:]
    assert sum(s.width > 1 for s in late) <= 0.02 * len(late), [s for s in late if s.width > 1]
    assert sum(s.width > 1 for s in shapes[:1000]) <= 60


def test_wide_chains_when_acceptance_is_high_and_verify_is_cheap():
    policy = width_policy(16, table(per_token=0.02))
    widths = [s.width for s in rounds(policy, 300, odds(chain=0.95))]
    assert np.mean(widths[100:]) > 10


def test_plain_when_verify_grows_steeply():
    policy = width_policy(16, table(per_token=1.0))
    widths = [s.width for s in rounds(policy, 500, odds(chain=0.5))]
    assert np.mean([w == 1 for w in widths[100:]]) > 0.95


def test_any_width_is_verified_when_the_cost_table_makes_it_best():
    """No width is left out by a kernel's tiling: width 5 costs what 4 does and 6 up to 16 far more (as where a
    matrix kernel tiles rows by 5), so with a drafter that keeps most drafts, chains of 5 win."""
    cost = table(seconds=lambda w: 1.0 + 0.01 * w if w <= 5 else 2.0 + 0.05 * w, width=16)
    cost.seconds[0][4] = 1.05  # width 5 measured too
    policy = width_policy(16, cost)
    assert [s.width for s in policy.shapes()] == list(range(1, 17))
    widths = [s.width for s in rounds(policy, 300, odds(chain=0.8))]
    assert sum(w == 5 for w in widths[100:]) >= 180, widths[100:]


def test_a_width_never_measured_is_interpolated_then_measured_by_its_rounds():
    policy = width_policy(16, table(per_token=0.02), tree_widths=TREE_WIDTHS)
    assert policy.cost.learnt[0][12] is None and policy.cost.estimate(13, 100) == pytest.approx(1.24)
    for _ in range(5):  # the lookup's rounds at a measured width: what it takes beyond its verify
        policy.observe_round(Shape(8, lookup=True), 7, 100, seconds=1.14 + 0.05, lookup_ngram=4)
    for _ in range(5):
        policy.observe_round(Shape(13, lookup=True), 12, 100, seconds=2.0, lookup_ngram=4)
    assert policy.cost.estimate(13, 100) > 1.8  # a tiling that makes 13 dear shows once 13 ran


def test_the_lookups_chain_wins_where_it_copies():
    policy = width_policy(16, table(per_token=0.02), tree_widths=TREE_WIDTHS)
    shapes = rounds(policy, 300, odds(chain=0.3, tree=0.4, lookup=0.98), found=20)
    late = shapes[-100:]
    assert sum(s.lookup and s.width >= 16 for s in late) >= 90, late
    nothing_found = rounds(policy, 50, odds(chain=0.3, tree=0.4), found=0)
    assert not any(s.lookup for s in nothing_found)


def test_trees_win_where_tree_rounds_commit_more_per_second():
    policy = width_policy(16, table(per_token=0.02), tree_widths=TREE_WIDTHS)
    late = rounds(policy, 400, odds(chain=0.5, tree=0.8))[-100:]
    assert sum(s.tree for s in late) >= 90, late
    chains = width_policy(16, table(per_token=0.02), tree_widths=TREE_WIDTHS)
    late = rounds(chains, 400, odds(chain=0.8, tree=0.3))[-100:]
    assert sum(not s.tree and s.width > 1 for s in late) >= 90, late


def test_a_trees_estimate_is_the_chains_times_the_gain_measured_on_the_same_rounds():
    """Tree rounds on hard text commit twice what the chain inside them would have: as the text turns easy and
    the chain's own rounds keep more, the tree's estimate rises with the chain's by that gain, not from its own
    stale rounds."""
    policy = width_policy(16, table(), tree_widths=TREE_WIDTHS)
    for _ in range(40):  # hard text: the chain inside an 8-node tree, 4 deep, keeps nothing; the tree keeps 1
        policy.observe_round(Shape(8, tree=True), 1, 100, 1.5, chain_depth=4, chain_kept=0)
    tree = policy.trees[8]
    assert policy.chain.rates()[0] < 0.1, "tree rounds teach the chain too"
    hard = tree.expected(policy.chain.expected())
    assert hard == pytest.approx(2.0, abs=0.1)
    for _ in range(40):  # easy text, chains only: 3 of 7 kept each round
        policy.observe_round(Shape(8), 3, 100, 1.5)
    chain = policy.chain.expected()
    # E of the chain 4 deep, times the gain 2 (shrunk a little toward E(chain of 8) / E(chain 4 deep))
    assert tree.expected(chain) == pytest.approx(2.0 * chain[4], rel=0.1) and tree.expected(chain) > 1.8 * hard


@pytest.mark.parametrize("seed", range(3))
def test_every_shape_kind_is_explored_and_one_that_keeps_losing_rarely(seed):
    """The lookup keeps 40% where the chain keeps 70%: it is tried, and then in about ln t of 2,000 rounds (its
    tries come in short runs, where its first luck raises it above the best for a few rounds)."""
    policy = width_policy(16, table(per_token=0.02), tree_widths=TREE_WIDTHS)
    shapes = rounds(policy, 2000, odds(chain=0.7, tree=0.6, lookup=0.4), found=12, seed=seed)
    kinds = {("tree", s.width) if s.tree else "lookup" if s.lookup else "chain" for s in shapes}
    assert kinds >= {"chain", "lookup", *(("tree", b) for b in TREE_WIDTHS)}
    losers = [i for i, s in enumerate(shapes) if s.lookup]
    assert len(losers) <= 0.02 * len(shapes), losers


def test_drafting_comes_back_when_it_pays_again():
    policy = width_policy(16, table())
    rounds(policy, 300, odds())
    widths = [s.width for s in rounds(policy, 700, odds(chain=0.95), seed=1)]
    assert np.mean(widths[-100:]) >= 8


def test_draft_seconds_are_what_a_round_takes_beyond_its_verify():
    policy = width_policy(4, table(width=4))
    policy.observe_round(Shape(4), 3, 100, seconds=1.18 + 20.0)  # the first round builds its kernels: not timed
    assert policy.times.draft == {}
    for _ in range(20):
        policy.observe_round(Shape(4), 3, 100, seconds=1.18 + 0.3)
    assert policy.times.draft[(("chain", 0), 0)] == pytest.approx(0.3, abs=0.05)
    policy.observe_round(Shape(4), 3, 100, seconds=50.0, timed=False)  # it projected a long backlog
    assert policy.times.draft[(("chain", 0), 0)] == pytest.approx(0.3, abs=0.05) and policy.chain.rounds == 22


def test_a_long_context_is_costed_by_its_own_rounds():
    """After a long prompt, verifies and drafting cost more than the short-context table says: the band's rounds
    set its draft seconds and how far its unrun widths are off, and the choice follows."""
    policy = width_policy(16, table(per_token=0.02))
    rounds(policy, 200, odds(chain=0.6))
    assert np.mean([s.width for s in rounds(policy, 50, odds(chain=0.6))]) > 3
    long = copy.deepcopy(policy.cost)
    long.seconds[0] = [1.0 + 0.3 * (w - 1) if s is not None else None for w, s in enumerate(long.seconds[0], 1)]
    shapes = rounds(policy, 300, odds(chain=0.6), context=3500, truth=long, draft=1.0)
    assert sum(s.width == 1 for s in shapes[-100:]) >= 95
    assert policy.times.draft[(("chain", 0), 0)] == pytest.approx(0.2)  # the short context's stays as it was


def test_a_new_generation_starts_from_what_the_last_one_kept_and_its_timings():
    first = width_policy(16, table(per_token=0.02), tree_widths=TREE_WIDTHS)
    rounds(first, 200, odds(lookup=1.0), found=31)
    second = width_policy(16, first.cost, first, TREE_WIDTHS)
    assert second.lookup[4].judged[0] <= CARRIED_ROUNDS and min(second.lookup[4].rates()[:8]) > 0.8
    assert second.times.draft == first.times.draft and second.rounds == 0
    for _ in range(3):  # this answer does not copy: three misses outweigh the last answer's evidence
        second.observe_round(Shape(32, lookup=True), 0, 100, 1.6, lookup_ngram=4)
    assert second.lookup[4].rates()[0] < 0.6 < 0.9 < first.lookup[4].rates()[0]


def test_a_trees_lookup_branch_is_as_long_as_the_lookup_beats_the_drafter():
    policy = width_policy(16, table(), tree_widths=TREE_WIDTHS)
    for _ in range(20):
        policy.observe_round(Shape(8), 2, 100, 1.6)  # the drafter keeps 2 of 7
        policy.observe_round(Shape(16, lookup=True), 15, 100, 1.9, lookup_ngram=4)  # 4-gram matches copy
        policy.observe_round(Shape(16, lookup=True), 0, 100, 1.9, lookup_ngram=1)  # single tokens never do
    assert policy.branch_length(4, found=20, nodes=15) == 14  # all but one node
    assert policy.branch_length(1, found=20, nodes=15) == 0


def test_cost_bands_and_measurement(muse_pair):
    assert [band_of(c) for c in (0, 511, 512, 5000, 10**6)] == [0, 0, 1, 2, 3]
    cost = measure_verify_cost(muse_pair.target, 8, muse_pair.target.vocab_size, contexts=(8,), repeats=1)
    row = cost.seconds[0]
    assert [w for w in range(1, 9) if row[w - 1] is not None] == [w for w in MEASURED_WIDTHS if w < 8] + [8]
    assert all(s > 0 for s in row if s is not None)
    assert cost.measured(6, 0) == pytest.approx((row[3] + row[7]) / 2)  # the widths between are interpolated
    assert all(r == [None] * 8 for r in cost.seconds[1:])  # one context measured
    assert cost.estimate(6, 3000) > 0  # an unmeasured band borrows the nearest measured one


class ClockedTarget:
    """A target whose every call of width w takes w seconds on a clock of its own, ten times that while a burst of
    other load covers the call (calls are counted from 0, the prefill's first)."""

    def __init__(self, burst: range):
        self.now, self.calls, self.burst = 0.0, 0, burst
        self.sampling = self

    def perf_counter(self) -> float:
        return self.now

    def make_cache(self, reserve: int):
        return None

    def tokens(self, ids):
        return ids

    def forward(self, tokens, cache, _):
        self.now += len(tokens) * (10 if self.calls in self.burst else 1)
        self.calls += 1
        return tokens, None

    def head(self, hidden):
        return np.array(hidden[-1:])

    argmax = head

    def sync(self, *_, cache=None):
        pass

    def trim(self, cache, width):
        pass


def test_a_burst_of_other_load_shorter_than_a_pass_leaves_the_measured_costs_alone(monkeypatch):
    widths = [w for w in MEASURED_WIDTHS if w < 16] + [16]
    for start in range(1, 1 + 3 * len(widths)):  # the prefill, a warm-up pass and two timed passes
        target = ClockedTarget(range(start, start + len(widths) - 1))
        monkeypatch.setattr(verify_cost, "time", target)
        row = measure_verify_cost(target, 16, 100, contexts=(8,)).seconds[0]
        assert [row[w - 1] for w in widths] == widths, f"burst from call {start}"


def test_a_generation_with_trees_off_leaves_what_trees_on_learnt(checkpoints):
    # a pair of its own: the synthetic rounds below stay in what its target and drafter remember
    muse_pair = mlx_glimmer.load(target=checkpoints["muse"], drafter=checkpoints["assistant"])
    trees_on = GenerationSettings(max_tokens=12)
    learnt = auto_policy(muse_pair, muse_pair.drafter, trees_on)
    for _ in range(3):
        learnt.observe_round(Shape(6, lookup=True), 5, 100, 1.0, lookup_ngram=4)
        learnt.observe_round(Shape(8, tree=True), 6, 100, 1.0)
    mlx_glimmer.generate(muse_pair, PROMPT, GenerationSettings(max_tokens=12, tree="off"))
    again = auto_policy(muse_pair, muse_pair.drafter, trees_on)
    assert again.lookup[4].rates() == pytest.approx(learnt.lookup[4].rates())
    assert again.trees[8].sums == pytest.approx(learnt.trees[8].sums)
    assert again.cost is learnt.cost  # the widest-32 table, with what its rounds refined, is not read afresh
    chains = auto_policy(muse_pair, muse_pair.drafter, GenerationSettings(tree="off"))
    assert chains.trees == {} and chains.lookup == {}


def test_auto_greedy_equals_plain_with_random_and_agreeing_drafters(muse_pair):
    plain = mlx_glimmer.generate(muse_pair, PROMPT, max_tokens=90, speculative=False)
    auto = mlx_glimmer.generate(muse_pair, PROMPT, max_tokens=90)  # random drafter, window 8: far past it
    assert auto.token_ids == plain.token_ids and auto.stats.block_policy == "auto"
    assert sum(auto.stats.verify_width_histogram.values()) == auto.stats.target_forwards
    oracle = OracleDrafter(
        len(PROMPT), plain.token_ids, {i for i in range(90) if i % 17 == 3}, muse_pair.target.vocab_size
    )
    # The drafter that agrees is verified wide where the cost table (given, not timed) makes wide rounds pay
    policy = table_timed(width_policy(oracle.block_size, table(width=oracle.block_size)))
    steps = list(
        generate_steps(muse_pair.target, PROMPT, GenerationSettings(max_tokens=90), drafter=oracle, policy=policy)
    )
    assert [t for s in steps for t in s.tokens] == plain.token_ids
    assert len(steps) < 45, [s.drafted + 1 for s in steps]


def test_block_size_flag_takes_auto_or_a_width(checkpoints, capsys):
    base = ["generate", str(checkpoints["llama"]), "--drafter", str(checkpoints["llama_assistant"])]
    base += ["--prompt", "hi", "--max-tokens", "12", "--json"]
    assert main(base) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["block_policy"] == "auto" and sum(out["verify_width_histogram"].values()) == out["target_forwards"]
    assert main(base + ["--block-size", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["block_policy"] == "fixed" and set(out["verify_width_histogram"]) <= {"1", "2", "3"}
    assert main(base + ["--block-size", "wide"]) == 2
    assert "--block-size" in capsys.readouterr().err
