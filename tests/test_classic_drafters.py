"""Classic drafting on the same loop: an autoregressive draft model, and prompt lookup. Both lossless."""

import numpy as np
import pytest
import tiny_checkpoints as tc

from mlx_glimmer.drafters.draft_model import DraftModelDrafter
from mlx_glimmer.drafters.prompt_lookup import PromptLookupDrafter
from mlx_glimmer.settings import GenerationSettings, SamplingParams
from mlx_glimmer.speculative import generate_steps

PROMPT = [256] + list(b"Once upon a time")
N = 120  # the prompt and these run over 15 windows of 8


def tokens(steps):
    return [t for s in steps for t in s.tokens]


@pytest.fixture(scope="module")
def plain(muse_pair):
    return tokens(generate_steps(muse_pair.target, PROMPT, GenerationSettings(max_tokens=N)))


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    """A different random Muse model with the same tokenizer: it rarely agrees with the target."""
    path = tc.build_muse_target(tmp_path_factory.mktemp("draft") / "m", layers=2, seed=11)
    from mlx_glimmer.loading import load_target

    return load_target(path)[0].model


@pytest.mark.parametrize("draft_k, adaptive", [(1, False), (4, False), (3, True)])
def test_draft_model_greedy_is_lossless_past_the_window(muse_pair, plain, other_model, draft_k, adaptive):
    for model in (other_model, muse_pair.target.model):  # disagreeing; and self-drafting (agrees always)
        d = DraftModelDrafter(model, draft_k=draft_k, adaptive=adaptive)
        steps = list(
            generate_steps(muse_pair.target, PROMPT, GenerationSettings(max_tokens=N, block_size=17), drafter=d)
        )
        assert tokens(steps) == plain
    # Self-drafting accepts every draft: rounds commit k + 1 tokens (adaptive: growing to the cap).
    lengths = [len(s.tokens) for s in steps[1:-1]]
    assert min(lengths) == draft_k + 1 if not adaptive else max(lengths) == 17


def test_adaptive_k_grows_after_full_accepts_and_shrinks_after_rejections(muse_pair, other_model):
    d = DraftModelDrafter(other_model, draft_k=4, adaptive=True)
    steps = list(generate_steps(muse_pair.target, PROMPT, GenerationSettings(max_tokens=60, block_size=17), drafter=d))
    offered = [s.drafted for s in steps[1:]]
    assert min(offered) <= 2  # a disagreeing model is cut back quickly
    d = DraftModelDrafter(muse_pair.target.model, draft_k=2, adaptive=True)
    steps = list(generate_steps(muse_pair.target, PROMPT, GenerationSettings(max_tokens=60, block_size=17), drafter=d))
    offered = [s.drafted for s in steps[1:]]
    assert offered[:4] == [2, 4, 6, 8]


def test_prompt_lookup_is_lossless_and_proposes_copies(muse_pair, plain):
    d = PromptLookupDrafter(draft_k=8)
    assert (
        tokens(generate_steps(muse_pair.target, PROMPT, GenerationSettings(max_tokens=N, block_size=9), drafter=d))
        == plain
    )
    assert d.lookup([1, 2, 3, 9, 1, 2], 3) == [3, 9, 1]
    assert d.lookup([5, 6, 7], 3) == []


def test_draft_model_sampling_follows_the_target_distribution(tmp_path):
    from scipy.stats import chisquare  # noqa: F401  (the helper below uses it)
    from test_sampling import PROMPT as SP
    from test_sampling import V, chi_square_p, exact_marginals

    from mlx_glimmer.loading import load_target

    t = load_target(tc.build_muse_target(tmp_path / "t", vocab_size=V, layers=4, weight_std=0.12, seed=5))[0]
    dm = load_target(tc.build_muse_target(tmp_path / "d", vocab_size=V, layers=1, weight_std=0.12, seed=9))[0].model
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=20)
    p1, p2, p3 = exact_marginals(t, params)
    draws, kept, rejected = [], 0, 0
    for seed in range(700):
        d = DraftModelDrafter(dm, draft_k=3)
        steps = list(
            generate_steps(t, SP, GenerationSettings(params, max_tokens=3, block_size=4, seed=seed), drafter=d)
        )
        kept += sum(len(s.tokens) - 1 for s in steps[1:])
        rejected += sum(s.drafted - (len(s.tokens) - 1) for s in steps[1:])
        draws.append([x for s in steps for x in s.tokens][:3])
    draws = np.array(draws)
    assert kept > 100 and rejected > 100
    for i, expected in enumerate([p1, p2, p3]):
        assert chi_square_p(draws[:, i], expected) > 0.001
