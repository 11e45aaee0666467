"""Sampling draws each token from the target's filtered distribution with noise keyed by the seed and the
token's position; speculative sampling keeps exactly the drafts the target samples, so it emits the same
distribution (and, at one seed, the same tokens as plain decoding)."""

import functools
import itertools

import mlx.core as mx
import numpy as np
import pytest
import tiny_checkpoints as tc
import torch
from scipy.stats import chisquare

import mlx_glimmer
from mlx_glimmer.array_ops import MLX_OPS
from mlx_glimmer.drafters.base import Drafter
from mlx_glimmer.noise import Noise, gumbel_of_tokens
from mlx_glimmer.sampling import probabilities, sample
from mlx_glimmer.settings import GenerationSettings, SamplingParams
from mlx_glimmer.speculative import generate_steps

SETTINGS = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=0.7, top_k=20),
    SamplingParams(temperature=0.7, top_p=0.9, top_k=20),
]
V = 32
PROMPT = [1, 5, 9, 2, 7, 3, 11, 4, 6, 8]


def chi_square_p(samples: np.ndarray, expected_probs: np.ndarray) -> float:
    """Pearson chi-square, pooling cells expected below 5 into one."""
    n = len(samples)
    expected_probs = np.asarray(expected_probs, dtype=np.float64)
    expected_probs = expected_probs / expected_probs.sum()
    observed = np.bincount(samples, minlength=len(expected_probs)).astype(float)
    expected = expected_probs * n
    small = expected < 5
    assert observed[expected_probs == 0].sum() == 0, "a token outside the filtered support was emitted"
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    if len(exp) == 1:  # a single possible token: all samples must be it, checked above
        return 1.0
    exp = exp * obs.sum() / exp.sum()
    exp[-1] += obs.sum() - exp.sum()
    return float(chisquare(obs, exp).pvalue)


@pytest.mark.parametrize("params", SETTINGS, ids=str)
def test_filters_match_transformers_logits_warpers(params):
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = np.random.default_rng(3).standard_normal((5, 50)).astype(np.float32) * 3
    scores = torch.from_numpy(logits)
    scores = TemperatureLogitsWarper(params.temperature)(None, scores)
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    ref = torch.softmax(scores, dim=-1).numpy()
    np.testing.assert_allclose(np.asarray(probabilities(mx.array(logits), params)), ref, atol=1e-6)


@pytest.mark.parametrize("params", SETTINGS, ids=str)
def test_the_positional_sampler_follows_the_filtered_distribution_over_positions_and_over_seeds(params):
    """Row i of `sample` draws the token at position start + i: with one seed over many positions, and at one
    position over many seeds, the draws follow the filtered distribution."""
    logits = mx.array(np.random.default_rng(3).standard_normal(V).astype(np.float32) * 2)
    p = probabilities(logits, params)
    rows = mx.broadcast_to(p[None], (4000, V))
    over_positions = np.array(sample(rows, Noise(seed=7, start=100)))
    assert chi_square_p(over_positions, np.asarray(p, np.float64)) > 0.001
    over_seeds = np.array([sample(p, Noise(seed, 100)).item() for seed in range(3000)])
    assert chi_square_p(over_seeds, np.asarray(p, np.float64)) > 0.001


def test_the_positional_sampler_draws_the_same_token_for_the_same_seed_and_position_only():
    probs = mx.full((64, V), 1.0 / V)
    draws = np.array(sample(probs, Noise(5, 0)))
    assert (draws == np.array(sample(probs, Noise(5, 0)))).all()
    assert (draws[1:] == np.array(sample(probs[1:], Noise(5, 1)))).all()  # keyed by position, not by row
    assert (draws != np.array(sample(probs, Noise(6, 0)))).mean() > 0.8
    assert (draws[1:] != draws[:-1]).mean() > 0.8


def test_a_sample_over_a_subset_of_the_vocabulary_draws_the_full_samples_token_whenever_it_holds_it():
    """What DFlash2's candidate selector relies on: noise of the candidates' token ids, not their ranks."""
    rng = np.random.default_rng(0)
    probs = mx.softmax(mx.array(rng.normal(0, 2, (64, V)), mx.float32), axis=-1)
    full = np.array(sample(probs, Noise(3, 10)))
    subsets = mx.array(np.stack([rng.permutation(V)[:8] for _ in range(64)]))  # 8 token ids a row
    noise = gumbel_of_tokens(MLX_OPS, 3, mx.arange(10, 74), subsets)
    picked = np.take_along_axis(
        np.array(subsets), np.array(mx.argmax(mx.log(mx.take_along_axis(probs, subsets, -1)) + noise, -1))[:, None], 1
    )[:, 0]
    holds = (np.array(subsets) == full[:, None]).any(1)
    assert 0 < holds.sum() < 64
    assert (picked[holds] == full[holds]).all()


@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_a_drafter_with_its_own_vocabulary_drafts_the_sample_the_full_vocabulary_draws(backend, checkpoints, tmp_path):
    """A distilled drafter scores its own vocabulary only; its sample of position p must still draw the noise of
    the token ids it proposes, so that its draft is the target's own sample wherever their distributions agree."""
    from mlx_glimmer.torch_backend import load_torch

    vocab = list(range(0, 272, 3))
    drafter_dir = tc.with_draft_vocab(checkpoints["assistant"], tmp_path / "distilled", vocab)
    load = mlx_glimmer.load if backend == "mlx" else functools.partial(load_torch, device="cpu")
    pair = load(target=checkpoints["muse"], drafter=drafter_dir)
    target, drafter = pair.target, pair.drafter
    prompt = [256] + list(b"Once upon a time")
    target.capture(drafter.target_layer_ids)
    drafter.reset()
    _, feats = target.forward(target.tokens(prompt), target.make_cache(16), True)
    drafter.observe(prompt, feats)
    noise = Noise(7, len(prompt))
    draft, probs = drafter.propose(prompt[-1], 8, SamplingParams(temperature=1.5), noise)
    assert probs.shape[-1] == target.vocab_size  # the draft distributions over the whole vocabulary
    assert set(draft.tolist()) <= set(vocab)
    assert draft.tolist() == target.sampling.sample(probs, noise).tolist()


def test_chi_square_detects_sampling_from_the_drafter():
    """Control: taking drafter samples without the acceptance test is caught."""
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(V) * 0.5).astype(np.float32)
    q = rng.dirichlet(np.ones(V) * 0.5).astype(np.float32)
    wrong = rng.choice(V, size=3000, p=q / q.sum())
    assert chi_square_p(wrong, p) < 1e-6


class NoisyTargetDrafter(Drafter):
    """Drafts autoregressively from q = 0.6 * p + 0.4 * uniform, p the target's own filtered distribution.

    Close enough to the target that most drafts are kept, different enough that
    rejections and residual resampling happen often.
    """

    kind = "noisy-target"
    target_layer_ids = ()

    def __init__(self, target):
        self.target = target
        self.history = []
        self.known = {}  # (params, context) -> q: the draws of a test repeat contexts

    def q(self, seq: list[int], params):
        """The draft distribution after `seq` (the same every time: the target's forward runs once)."""
        key = (params, tuple(seq))
        if key not in self.known:
            p = probabilities(self.target.model(mx.array([seq]))[0, -1], params)
            self.known[key] = 0.6 * p + 0.4 / p.shape[-1]
        return self.known[key]

    def reset(self):
        self.history = []

    def observe(self, tokens, features):
        self.history.extend(tokens)

    def propose(self, anchor, count, params, noise):
        seq, tokens, rows = self.history + [anchor], [], []
        for where in noise.rows(count):
            q = self.q(seq, params)
            t = int(sample(q, where).item())
            seq.append(t)
            tokens.append(t)
            rows.append(q)
        return mx.array(tokens, dtype=mx.uint32), mx.stack(rows)


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("v32")
    tc.build_muse_target(root / "t", vocab_size=V, layers=4, weight_std=0.12, seed=5)
    tc.build_assistant(root / "d", layers=1, target_layer_ids=[0, 2], block_size=4, mask_token_id=V - 1, seed=6)
    return mlx_glimmer.load(target=root / "t", drafter=root / "d")


def exact_marginals(target, params):
    """P(t1), P(t2), P(t3) of the target's filtered sampling, by enumerating every prefix."""

    def next_probs(prefixes):
        ids = mx.array([PROMPT + list(p) for p in prefixes])
        logits = target.model(ids)[:, -1]
        return np.asarray(probabilities(logits, params), dtype=np.float64)

    p1 = next_probs([()])[0]
    p2_given = next_probs([(a,) for a in range(V)])  # [V, V]
    p2 = p1 @ p2_given
    pairs = list(itertools.product(range(V), range(V)))
    p3_given = next_probs(pairs).reshape(V, V, V)
    p3 = np.einsum("a,ab,abc->c", p1, p2_given, p3_given)
    return p1, p2, p3


@pytest.mark.parametrize("params", SETTINGS, ids=str)
def test_speculative_samples_match_target_distribution(small_vocab_pair, params):
    target = small_vocab_pair.target
    p1, p2, p3 = exact_marginals(target, params)
    draws, kept, rejected = [], 0, 0
    drafters = (small_vocab_pair.drafter, NoisyTargetDrafter(target))  # random DFlash; a close drafter
    for run, drafter in enumerate(drafters):
        for seed in range(run * 400, run * 400 + 400):  # distinct seeds: every draw independent
            steps = list(
                generate_steps(
                    target, PROMPT, GenerationSettings(params, max_tokens=3, block_size=4, seed=seed), drafter=drafter
                )
            )
            toks = [t for s in steps for t in s.tokens]
            kept += sum(len(s.tokens) - 1 for s in steps[1:])
            rejected += sum(s.drafted - (len(s.tokens) - 1) for s in steps[1:])
            draws.append(toks[:3])
    draws = np.array(draws)
    assert kept > 150 and rejected > 150  # both branches of the acceptance test ran
    for position, expected in enumerate([p1, p2, p3]):
        assert chi_square_p(draws[:, position], expected) > 0.001, f"token {position + 1}"


def test_auto_width_keeps_the_target_distribution(small_vocab_pair):
    """Widths chosen per round from past rounds (block size auto) leave each token's distribution exact."""
    from mlx_glimmer.block_policy import width_policy
    from mlx_glimmer.verify_cost import VerifyCost

    target, params = small_vocab_pair.target, SETTINGS[0]
    p1, p2, p3 = exact_marginals(target, params)
    cost = VerifyCost(4, [[1.0, 1.05, 1.1, 1.15] for _ in range(4)])
    policy = width_policy(4, cost)
    draws, widths, drafter = [], set(), NoisyTargetDrafter(target)
    for seed in range(800):  # as many draws as the fixed-width test takes
        steps = list(
            generate_steps(
                target,
                PROMPT,
                GenerationSettings(params, max_tokens=3, block_size=4, seed=10_000 + seed),
                drafter=drafter,
                policy=policy,
            )
        )
        widths.update(s.drafted + 1 for s in steps[1:])
        draws.append([t for s in steps for t in s.tokens][:3])
    draws = np.array(draws)
    assert len(widths) > 1, "the policy varied the width"
    for position, expected in enumerate([p1, p2, p3]):
        assert chi_square_p(draws[:, position], expected) > 0.001, f"token {position + 1}"
