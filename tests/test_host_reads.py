"""One blocking host read per round: the loop reads the verdict and the draft together, nothing else.

Two counts. Through the `TargetModel` seam (`read`, `sync`, `forward`), on MLX and on torch. And, on MLX, every
way a Python program can block on an array (`tolist`, `item`, `int()`, `float()`, `bool()`, an index, `mx.eval`),
so a host read hidden in a drafter or a helper shows too.
"""

import dataclasses

import mlx.core as mx
import pytest
import torch
from oracle_drafter import AlwaysPlain, OracleDrafter

from mlx_glimmer.block_policy import TREE_WIDTHS, WidthPolicy, width_policy
from mlx_glimmer.settings import GenerationSettings, SamplingParams
from mlx_glimmer.speculative import generate_steps
from mlx_glimmer.verify_cost import VerifyCost

PROMPT = [256] + list(b"Once upon a time")
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, top_k=20)
BLOCKING = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__")


class Seam:
    """A target that records what the loop asks of it."""

    def __init__(self, target):
        self._target = target
        self.events: list[str] = []

    def __getattr__(self, name):
        return getattr(self._target, name)

    def forward(self, *args, **kwargs):
        self.events.append("forward")
        return self._target.forward(*args, **kwargs)

    def read(self, *arrays):
        self.events.append("read")
        return self._target.read(*arrays)

    def sync(self, *arrays, **kwargs):
        self.events.append("sync")
        return self._target.sync(*arrays, **kwargs)


@pytest.fixture
def blocking(monkeypatch):
    """Counts every blocking read of an MLX array and every mx.eval while it is active."""
    calls = []
    for name in BLOCKING:
        original = getattr(mx.array, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(mx.array, name, counted)
    evaluate = mx.eval

    def counted_eval(*args, **kwargs):
        calls.append("eval")
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(mx, "eval", counted_eval)
    return calls


def per_step(steps, events: list) -> tuple[list, list[list[str]]]:
    """Run the generator; the events each step caused (from the previous yield to its own)."""
    out, per, seen = [], [], 0
    for step in steps:
        out.append(step)
        per.append(list(events[seen:]))
        seen = len(events)
    return out, per


def tokens_of(steps):
    return [t for s in steps for t in s.tokens]


def plain_leaning_policy(width: int) -> WidthPolicy:
    """Verify cost steep enough that width 1 wins, with drafting tried now and then."""
    cost = VerifyCost(width, [[1.0 + 0.5 * (w - 1) for w in range(1, width + 1)] for _ in range(4)])
    return width_policy(width, cost)


@pytest.fixture(scope="module")
def plain(muse_pair):
    return tokens_of(generate_steps(muse_pair.target, PROMPT, GenerationSettings(max_tokens=80)))


@pytest.mark.parametrize("params", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_a_dflash_round_blocks_on_the_host_once(muse_pair, plain, blocking, params, block_size):
    steps, per = per_step(
        generate_steps(
            muse_pair.target,
            PROMPT,
            GenerationSettings(params, max_tokens=80, block_size=block_size),
            drafter=muse_pair.drafter,
        ),
        blocking,
    )
    assert all(len(p) == 1 for p in per[1:]), per
    assert per[1] == ["tolist"] and max(s.drafted for s in steps) == block_size - 1
    if params.greedy:
        assert tokens_of(steps) == plain


@pytest.mark.parametrize("params", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
def test_width_one_rounds_read_once_and_are_queued_one_ahead_like_plain_decoding(muse_pair, plain, params):
    plain_seam, auto_seam = Seam(muse_pair.target), Seam(muse_pair.target)
    ref, plain_per = per_step(
        generate_steps(plain_seam, PROMPT, GenerationSettings(params, max_tokens=40)), plain_seam.events
    )
    got, auto_per = per_step(
        generate_steps(
            auto_seam,
            PROMPT,
            GenerationSettings(params, max_tokens=40, block_size=16),
            drafter=muse_pair.drafter,
            policy=AlwaysPlain(),
        ),
        auto_seam.events,
    )
    assert all(s.drafted == 0 for s in got[1:])
    assert auto_seam.events == plain_seam.events  # the same forwards, queued the same way, the same reads
    assert plain_seam.events[:5] == ["forward", "read", "forward", "forward", "read"]  # the prefill, then one ahead
    assert all(p.count("read") == 1 and "sync" not in p for p in auto_per)
    if params.greedy:
        assert tokens_of(got) == tokens_of(ref) == plain[:40]


@pytest.mark.parametrize("params", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
def test_auto_mixing_plain_rounds_and_probes_reads_once_per_round(muse_pair, plain, blocking, params):
    steps, per = per_step(
        generate_steps(
            muse_pair.target,
            PROMPT,
            GenerationSettings(params, max_tokens=80, block_size=8),
            drafter=muse_pair.drafter,
            policy=plain_leaning_policy(8),
        ),
        blocking,
    )
    widths = {s.drafted + 1 for s in steps[1:]}
    assert 1 in widths and len(widths) > 1, widths
    assert all(len(p) == 1 for p in per[1:]), per
    if params.greedy:
        assert tokens_of(steps) == plain


def tree_policy() -> WidthPolicy:
    """`auto` over chains up to the drafter's 16 and tree budgets up to 32, on a flat verify cost: wide shapes win,
    trees among them."""
    return width_policy(16, VerifyCost(32, [[1.0] * 32 for _ in range(4)]), tree_widths=TREE_WIDTHS)


@pytest.mark.parametrize("params", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("tree", ["auto", 15])
def test_a_tree_round_blocks_on_the_host_once(muse_pair, plain, blocking, params, tree):
    """The default path (block size and tree "auto", the policy choosing chains and trees) and a fixed tree: the
    tree is built, merged with the lookup, verified and walked on the device; one read per round."""
    seam = Seam(muse_pair.target)
    steps, seen, per_seam, per_blocking = [], (0, 0), [], []
    for step in generate_steps(
        seam,
        PROMPT,
        GenerationSettings(params, max_tokens=80, tree=tree),
        drafter=muse_pair.drafter,
        policy=tree_policy() if tree == "auto" else None,
    ):
        steps.append(step)
        per_seam.append(seam.events[seen[0] :])
        per_blocking.append(blocking[seen[1] :])
        seen = (len(seam.events), len(blocking))
    assert sum(s.tree for s in steps) > 3, [s.drafted for s in steps]
    assert all(p.count("read") == 1 and "sync" not in p for p in per_seam[1:]), per_seam
    assert all(p == ["tolist"] for p in per_blocking[1:]), per_blocking
    if params.greedy:
        assert tokens_of(steps) == plain


@pytest.fixture(scope="module")
def dspark_pair(checkpoints, tmp_path_factory):
    """A DSpark head with its config's default confidence threshold (0.5), some of whose drafts fall below it."""
    import family_checkpoints as fc

    import mlx_glimmer

    path = fc.build_dspark(tmp_path_factory.mktemp("dspark") / "dspark", seed=5)
    return mlx_glimmer.load(target=checkpoints["muse"], drafter=path)


@pytest.mark.network  # the reference package writes the checkpoint (from PyPI on first use, then .cache/refpkgs)
@pytest.mark.parametrize("params", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
def test_a_dspark_round_with_its_confidence_threshold_blocks_on_the_host_once(dspark_pair, blocking, params):
    drafter, target = dspark_pair.drafter, dspark_pair.target
    assert drafter.config.confidence_threshold == 0.5
    blocking.clear()
    expected = tokens_of(generate_steps(target, PROMPT, GenerationSettings(max_tokens=60)))
    steps, per = per_step(
        generate_steps(
            target, PROMPT, GenerationSettings(params, max_tokens=60, block_size=drafter.block_size), drafter=drafter
        ),
        blocking,
    )
    assert all(p == ["tolist"] for p in per[1:]), per
    assert max(s.drafted for s in steps) == drafter.block_size - 1
    if params.greedy:
        assert tokens_of(steps) == expected
    confidence = [mx.sigmoid(drafter.draft_block(t, drafter.draft_len)[2]).min().item() for t in range(60, 70)]
    assert min(confidence) < 0.5  # dspark-mlx would have cut some of these blocks


def test_plain_decoding_reads_once_per_token(muse_pair, plain, blocking):
    steps, per = per_step(generate_steps(muse_pair.target, PROMPT, GenerationSettings(max_tokens=80)), blocking)
    assert all(p == ["tolist"] for p in per[1:]) and tokens_of(steps) == plain


@pytest.mark.parametrize("params", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("shape", ["plain", "chain", "tree", "auto"])
def test_log_probabilities_ride_on_the_rounds_one_read(muse_pair, plain, blocking, params, shape):
    """Asked for, every committed token's log-probability and 5 alternatives come back with the verdict they
    were judged by: still one blocking read per target call, the prefill's included."""
    settings = GenerationSettings(params, max_tokens=40, logprobs=5, speculative=shape != "plain")
    settings = settings.updated(**{"chain": {"block_size": 8, "tree": "off"}, "tree": {"tree": 15}}.get(shape, {}))
    policy = plain_leaning_policy(8) if shape == "auto" else None
    steps, per = per_step(
        generate_steps(muse_pair.target, PROMPT, settings, drafter=muse_pair.drafter, policy=policy), blocking
    )
    assert all(p == ["tolist"] for p in per), per
    assert all(len(s.logprobs) == len(s.tokens) for s in steps)
    if params.greedy:
        assert tokens_of(steps) == plain[:40]


def test_an_oracle_round_reads_once_and_commits_whole_blocks(muse_pair, plain, blocking):
    oracle = OracleDrafter(len(PROMPT), plain, set(), muse_pair.target.vocab_size)
    steps, per = per_step(
        generate_steps(muse_pair.target, PROMPT, GenerationSettings(max_tokens=80, block_size=16), drafter=oracle),
        blocking,
    )
    assert all(len(p) == 1 for p in per[1:]) and tokens_of(steps) == plain
    assert [len(s.tokens) for s in steps[1:]] == [16] * 4 + [15]


@pytest.fixture(scope="module")
def torch_muse(checkpoints):
    from mlx_glimmer.torch_backend import load_torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_torch(target=checkpoints["muse"], drafter=checkpoints["assistant"], device="cpu")
    torch.set_num_threads(before)


@pytest.mark.parametrize("params", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
def test_torch_rounds_read_once_through_the_seam(torch_muse, muse_pair, plain, params):
    seam = Seam(torch_muse.target)
    steps, per = per_step(
        generate_steps(
            seam, PROMPT, GenerationSettings(params, max_tokens=40, block_size=4), drafter=torch_muse.drafter
        ),
        seam.events,
    )
    assert all(p.count("read") == 1 and "sync" not in p for p in per[1:]), per
    mixed = Seam(torch_muse.target)
    steps_auto, per_auto = per_step(
        generate_steps(
            mixed,
            PROMPT,
            GenerationSettings(params, max_tokens=40, block_size=8),
            drafter=torch_muse.drafter,
            policy=plain_leaning_policy(8),
        ),
        mixed.events,
    )
    assert all(p.count("read") == 1 and "sync" not in p for p in per_auto[1:]), per_auto
    if params.greedy:
        assert tokens_of(steps) == tokens_of(steps_auto) == plain[:40]


def test_closing_after_a_queued_round_leaves_the_cache_as_processed(muse_pair):
    """The next round is queued before a step is handed over; closing the stream there undoes it."""
    from mlx_glimmer.decode_state import DecodeState

    for drafter, policy in ((muse_pair.drafter, None), (muse_pair.drafter, AlwaysPlain())):
        state = DecodeState()
        stream = generate_steps(
            muse_pair.target,
            PROMPT,
            GenerationSettings(max_tokens=60, block_size=4),
            drafter=drafter,
            state=state,
            policy=policy,
        )
        for _ in range(4):
            next(stream)
        assert state.ahead in (1, 4)
        stream.close()
        assert state.ahead == 0
        assert max(getattr(c, "offset", 0) for c in state.cache) == len(state.processed)


def test_the_seam_read_concatenates_on_the_device(muse_pair):
    target = muse_pair.target
    assert target.read(mx.array([2, 7], dtype=mx.int32), target.tokens([5, 6])) == [2, 7, 5, 6]
    assert target.join(target.tokens([1]), target.tokens([3, 4])).tolist() == [1, 3, 4]
    assert dataclasses.is_dataclass(target)


@pytest.fixture(scope="module")
def dflash2_pair(checkpoints, tmp_path_factory):
    import family_checkpoints as fc

    import mlx_glimmer

    return mlx_glimmer.load(target=checkpoints["muse"], drafter=fc.build_dflash2(tmp_path_factory.mktemp("d2") / "d"))


@pytest.fixture(scope="module")
def draft_model_pair(checkpoints):
    """A classic autoregressive draft model (the tiny llama shares the target's tokenizer), adaptive draft_k."""
    import mlx_glimmer

    return mlx_glimmer.load(target=checkpoints["muse"], drafter=checkpoints["llama"])


@pytest.fixture(scope="module")
def lookup_pair(checkpoints):
    import mlx_glimmer

    return mlx_glimmer.load(target=checkpoints["muse"], prompt_lookup=True)


FAMILY_PAIRS = {  # every drafter family (`drafters/registry.py`), the classic draft model and prompt lookup
    "dflash": "muse_pair",
    "dflash2": "dflash2_pair",
    "dspark": "dspark_pair",
    "draft-model": "draft_model_pair",
    "prompt-lookup": "lookup_pair",
}
NETWORK = pytest.mark.network  # the reference package writes the checkpoint (from PyPI on first use)


@pytest.mark.parametrize("params", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize(
    "family",
    [pytest.param(f, marks=NETWORK) if f in ("dflash2", "dspark") else f for f in FAMILY_PAIRS],
)
def test_every_drafter_family_blocks_on_the_host_once_per_round(request, plain, blocking, family, shape, params):
    """Chains of the drafter's own block, or a fixed tree of 15 (a chain-only drafter then drafts chains)."""
    pair = request.getfixturevalue(FAMILY_PAIRS[family])
    drafter = pair.drafter
    if shape == "tree":
        settings = GenerationSettings(params, max_tokens=60, tree=15)
    else:
        settings = GenerationSettings(params, max_tokens=60, block_size=drafter.block_size, tree="off")
    blocking.clear()
    steps, per = per_step(generate_steps(pair.target, PROMPT, settings, drafter=drafter), blocking)
    assert all(p == ["tolist"] for p in per), per
    assert any(s.drafted for s in steps[1:])
    assert any(s.tree for s in steps) == (shape == "tree" and drafter.has_marginals)
    if params.greedy:
        assert tokens_of(steps) == plain[:60]


@pytest.mark.parametrize("params", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
def test_torch_tree_rounds_read_once_through_the_seam(torch_muse, plain, params):
    seam = Seam(torch_muse.target)
    steps, per = per_step(
        generate_steps(seam, PROMPT, GenerationSettings(params, max_tokens=40, tree=15), drafter=torch_muse.drafter),
        seam.events,
    )
    assert sum(s.tree for s in steps) > 3
    assert all(p.count("read") == 1 and "sync" not in p for p in per), per
    if params.greedy:
        assert tokens_of(steps) == plain[:40]
