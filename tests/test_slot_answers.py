"""Answers generated many at once in refilled slots are each prompt's own plain decoding, token for token."""

import random

import numpy as np
import pytest
import torch
from test_sampling import chi_square_p

from mlx_glimmer.settings import GenerationSettings
from mlx_glimmer.speculative import generate_steps
from mlx_glimmer.torch_backend import load_torch
from mlx_glimmer.torch_backend.slots import SlotGenerator

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def torch_targets(checkpoints):
    return {
        name: load_torch(target=checkpoints[name], use_drafter=False, device="cpu").target for name in ("muse", "llama")
    }


def plain(target, prompt, max_tokens, stop_ids):
    steps = generate_steps(target, prompt, GenerationSettings(max_tokens=max_tokens))
    out = []
    for t in (t for s in steps for t in s.tokens):
        out.append(t)
        if t in stop_ids:
            break
    return out


def prompts_of(n, seed=0):
    rng = random.Random(seed)
    return [[256] + [rng.randrange(1, 255) for _ in range(rng.randrange(2, 19))] for _ in range(n)]


@pytest.mark.parametrize("name", ["muse", "llama"])
def test_every_answer_equals_its_plain_greedy_decoding_across_refills_and_past_the_window(torch_targets, name):
    target = torch_targets[name]
    prompts = prompts_of(11)
    max_tokens = 30  # the Muse window is 8: every answer runs far past it
    reference = [plain(target, p, max_tokens, set()) for p in prompts]
    stop = {reference[0][5]}  # some answers end early on it, so slots free at different steps
    reference = [plain(target, p, max_tokens, stop) for p in prompts]
    assert len({len(r) for r in reference}) > 1

    got = dict(SlotGenerator(target, stop, slots=3).generate(prompts, max_tokens=max_tokens))
    assert sorted(got) == list(range(len(prompts)))
    assert [got[i] for i in range(len(prompts))] == reference


def test_a_refill_prefills_in_forwards_within_the_position_budget_and_answers_stay_plain_greedy(torch_targets):
    target = torch_targets["llama"]
    prompts = prompts_of(8, seed=5)  # 3-19 tokens each
    reference = [plain(target, p, 6, set()) for p in prompts]
    prefills = []
    hook = target.decoder.register_forward_pre_hook(
        lambda module, args, kwargs: (
            prefills.append(kwargs["input_ids"].shape) if kwargs["input_ids"].shape[1] > 1 else None
        ),
        with_kwargs=True,
    )
    try:
        got = dict(SlotGenerator(target, set(), slots=8, prefill_tokens=40).generate(prompts, max_tokens=6))
    finally:
        hook.remove()
    assert len(prefills) > 1  # one refill of all 8 prompts, cut into several forwards
    assert all(rows == 1 or rows * width <= 40 for rows, width in prefills)
    assert sum(rows for rows, _ in prefills) == len(prompts)
    assert [got[i] for i in range(len(prompts))] == reference


def test_answers_come_as_they_end_not_in_prompt_order(torch_targets):
    target = torch_targets["llama"]
    prompts = prompts_of(6, seed=1)
    stop = {plain(target, prompts[2], 4, set())[1]}
    order = [i for i, _ in SlotGenerator(target, stop, slots=6).generate(prompts, max_tokens=20)]
    assert sorted(order) == list(range(6)) and order[0] == 2


def test_sampled_answers_repeat_with_the_seed_and_follow_it(torch_targets):
    target = torch_targets["llama"]
    prompts = prompts_of(5, seed=2)
    run = SlotGenerator(target, set(), slots=2).generate
    first = dict(run(prompts, max_tokens=12, temperature=1.0, seed=3))
    assert first == dict(run(prompts, max_tokens=12, temperature=1.0, seed=3))
    assert first != dict(run(prompts, max_tokens=12, temperature=1.0, seed=4))
    assert all(len(a) == 12 for a in first.values())


def test_a_bfloat16_target_keeps_its_slots_apart(checkpoints):
    # One batch of rows of different lengths: each row's answer is the one it gets alone.
    target = load_torch(target=checkpoints["llama"], use_drafter=False, device="cpu", dtype=torch.bfloat16).target
    prompts = prompts_of(4, seed=3)
    together = dict(SlotGenerator(target, set(), slots=4).generate(prompts, max_tokens=10))
    alone = {
        i: dict(SlotGenerator(target, set(), slots=1).generate([p], max_tokens=10))[0] for i, p in enumerate(prompts)
    }
    assert together == alone


def test_a_sampled_token_follows_the_targets_distribution(torch_targets):
    """2,000 slots sample the token after one prompt at temperature 0.8: the counts fit the target's softmax."""
    target, prompt, temperature = torch_targets["llama"], prompts_of(1, seed=4)[0], 0.8
    with torch.inference_mode():
        logits = target.head(target.decoder(input_ids=torch.tensor([prompt])).last_hidden_state[0, -1]).float()
    expected = torch.softmax(logits / temperature, dim=-1).numpy()
    answers = SlotGenerator(target, set(), slots=2000).generate([prompt] * 2000, max_tokens=1, temperature=temperature)
    samples = np.array([a[0] for _, a in answers])
    assert chi_square_p(samples, expected) > 1e-3
