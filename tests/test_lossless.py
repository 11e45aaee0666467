"""Greedy speculative decoding emits exactly the target's plain greedy tokens, at any length."""

import dataclasses

import numpy as np
import pytest
import torch
from oracle_drafter import OracleDrafter

import mlx_glimmer
from mlx_glimmer.settings import GenerationSettings
from mlx_glimmer.speculative import generate_steps

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: transformers' generate on one thread

PROMPT = [256] + list(b"Once upon a time")  # BOS + 16 bytes: already twice the window of 8
N_TOKENS = 220  # > 20x the sliding window


def tokens_of(steps):
    out = []
    for s in steps:
        out.extend(s.tokens)
    return out


@pytest.fixture(scope="module")
def plain_greedy(muse_pair):
    return tokens_of(generate_steps(muse_pair.target, PROMPT, GenerationSettings(max_tokens=N_TOKENS)))


def test_plain_greedy_equals_transformers_greedy(checkpoints, plain_greedy):
    """Our baseline itself is right past the window: transformers' own generate agrees."""
    from transformers import AutoModelForImageTextToText

    ref = AutoModelForImageTextToText.from_pretrained(checkpoints["muse"], dtype=torch.float32).eval()
    out = ref.generate(
        torch.tensor([PROMPT]), max_new_tokens=N_TOKENS, do_sample=False, eos_token_id=None, min_new_tokens=N_TOKENS
    )
    assert out[0, len(PROMPT) :].tolist() == plain_greedy


@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_random_drafter_greedy_is_lossless(muse_pair, plain_greedy, block_size):
    steps = list(
        generate_steps(
            muse_pair.target,
            PROMPT,
            GenerationSettings(max_tokens=N_TOKENS, block_size=block_size),
            drafter=muse_pair.drafter,
        )
    )
    assert tokens_of(steps) == plain_greedy
    assert all(len(s.tokens) <= block_size for s in steps[1:])


@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_high_agreement_drafter_greedy_is_lossless(muse_pair, plain_greedy, block_size):
    wrong = {i for i in range(N_TOKENS) if i % 23 == 5 or i % 37 == 0}
    oracle = OracleDrafter(len(PROMPT), plain_greedy, wrong, muse_pair.target.vocab_size)
    steps = list(
        generate_steps(
            muse_pair.target, PROMPT, GenerationSettings(max_tokens=N_TOKENS, block_size=block_size), drafter=oracle
        )
    )
    assert tokens_of(steps) == plain_greedy
    lengths = [len(s.tokens) for s in steps[1:]]
    # Rounds end only at an injected error (or at max_tokens), so acceptance is high.
    assert np.mean(lengths) > 0.8 * block_size if block_size <= 4 else np.mean(lengths) > 8
    assert max(lengths) == block_size


def test_accepting_everything_commits_full_blocks(muse_pair, plain_greedy):
    oracle = OracleDrafter(len(PROMPT), plain_greedy, set(), muse_pair.target.vocab_size)
    steps = list(
        generate_steps(muse_pair.target, PROMPT, GenerationSettings(max_tokens=N_TOKENS, block_size=16), drafter=oracle)
    )
    assert tokens_of(steps) == plain_greedy
    assert [len(s.tokens) for s in steps[1:]] == [16] * 13 + [11]  # 1 + 13 * 16 + 11 = 220
    assert 1 + sum(len(s.tokens) for s in steps[1:]) == N_TOKENS


def test_llama_target_with_full_attention_is_lossless(llama_pair):
    target = llama_pair.target
    plain = tokens_of(generate_steps(target, PROMPT, GenerationSettings(max_tokens=120)))
    spec = tokens_of(
        generate_steps(target, PROMPT, GenerationSettings(max_tokens=120, block_size=16), drafter=llama_pair.drafter)
    )
    wrong = {i for i in range(120) if i % 11 == 3}
    oracle = OracleDrafter(len(PROMPT), plain, wrong, target.vocab_size)
    high = tokens_of(generate_steps(target, PROMPT, GenerationSettings(max_tokens=120, block_size=8), drafter=oracle))
    assert spec == plain and high == plain


def test_stop_token_inside_a_block_stops_exactly_there(muse_pair, plain_greedy):
    # Pretend the 30th greedy token is EOS: every method must stop right after it.
    stop = plain_greedy[29]
    first = plain_greedy.index(stop)
    oracle = OracleDrafter(len(PROMPT), plain_greedy, set(), muse_pair.target.vocab_size)
    for drafter, bs in [(None, 1), (oracle, 16), (muse_pair.drafter, 4)]:
        got = tokens_of(
            generate_steps(
                muse_pair.target,
                PROMPT,
                GenerationSettings(max_tokens=N_TOKENS, block_size=bs),
                drafter=drafter,
                stop_ids=[stop],
            )
        )
        assert got == plain_greedy[: first + 1]


@pytest.mark.parametrize("max_tokens", [1, 2, 17, 33])
def test_max_tokens_inside_a_block_stops_exactly_there(muse_pair, plain_greedy, max_tokens):
    oracle = OracleDrafter(len(PROMPT), plain_greedy, set(), muse_pair.target.vocab_size)
    got = tokens_of(
        generate_steps(
            muse_pair.target, PROMPT, GenerationSettings(max_tokens=max_tokens, block_size=16), drafter=oracle
        )
    )
    assert got == plain_greedy[:max_tokens]


def test_api_generate_speculative_equals_plain(muse_pair):
    plain = mlx_glimmer.generate(muse_pair, PROMPT, max_tokens=60, speculative=False)
    spec = mlx_glimmer.generate(muse_pair, PROMPT, max_tokens=60, block_size=4)
    assert spec.token_ids == plain.token_ids and spec.text == plain.text
    assert plain.stats.acceptance_lengths == [1] * plain.stats.target_forwards
    assert sum(spec.stats.acceptance_lengths) + 1 == spec.stats.generated_tokens == 60


def test_api_reports_high_agreement_figures(muse_pair, plain_greedy):
    """The high-agreement pair's mean acceptance and target forwards, through the public API."""
    oracle = OracleDrafter(
        len(PROMPT), plain_greedy, {i for i in range(N_TOKENS) if i % 23 == 5}, muse_pair.target.vocab_size
    )
    pair = dataclasses.replace(muse_pair, drafter=oracle)
    res = mlx_glimmer.generate(pair, PROMPT, max_tokens=N_TOKENS, block_size=16)
    assert res.token_ids == plain_greedy
    print(
        f"high-agreement pair: mean acceptance {res.stats.mean_acceptance:.2f}, "
        f"target forwards {res.stats.target_forwards} for {res.stats.generated_tokens} tokens"
    )
    assert res.stats.target_forwards < N_TOKENS / 4


def test_chunked_prefill_gives_the_same_tokens(muse_pair, plain_greedy):
    for step in (1, 3, 7):
        got = tokens_of(
            generate_steps(
                muse_pair.target,
                PROMPT,
                GenerationSettings(max_tokens=60, block_size=4),
                drafter=muse_pair.drafter,
                prefill_step=step,
            )
        )
        assert got == plain_greedy[:60]
