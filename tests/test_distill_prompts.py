"""`distill --prompts synth`: a training set that shares no text with the held-out prompts, frozen on first use,
and grown (indices kept) when a resumed run asks the target for more self-written requests."""

import json
from types import SimpleNamespace

import pytest

from mlx_glimmer.distill.prompts import build_prompt_set, shingles
from mlx_glimmer.distill.run import training_prompts

HELDOUT = ["Explain how photosynthesis works in simple terms.", "Write a haiku about the sea at night."]


class WritesNumberedRequests:
    """An `Answerer` standing in for the target's sampled user turns: request k of the run, whatever the seed."""

    def __init__(self, tokenizer):
        self.tokenizer, self.written = tokenizer, 0

    def __call__(self, prompts, *, max_tokens, temperature, seed):
        texts = [f"Please tell me three things about object number {self.written + k}." for k in range(len(prompts))]
        self.written += len(prompts)
        return enumerate(self.tokenizer.encode(t, add_special_tokens=False) for t in texts)


def synth_args(count: int) -> SimpleNamespace:
    return SimpleNamespace(prompts="synth", self_instruct=count, seed=0)


@pytest.fixture()
def tokenizer(llama_pair):
    return llama_pair.tokenizer


def test_the_synthetic_set_shares_no_five_word_run_with_the_heldout_prompts():
    items = build_prompt_set([], HELDOUT, self_instruct=["Explain how photosynthesis works in simple terms for me"])
    banned = set().union(*(shingles(p) for p in HELDOUT))
    assert items and not any(shingles(it["prompt"]) & banned for it in items)


def test_a_larger_self_instruct_appends_new_requests_and_keeps_every_index(tokenizer, tmp_path):
    writer = WritesNumberedRequests(tokenizer)
    first = training_prompts(synth_args(3), writer, tokenizer, HELDOUT, tmp_path)
    frozen = [json.loads(line)["prompt"] for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    assert len(first) > 3 and frozen == first

    grown = training_prompts(synth_args(7), writer, tokenizer, HELDOUT, tmp_path)
    assert grown[: len(first)] == first
    assert grown[len(first) :] == [f"Please tell me three things about object number {k}." for k in range(3, 7)]
    assert len((tmp_path / "instructions.jsonl").read_text().splitlines()) == 7

    assert training_prompts(synth_args(7), writer, tokenizer, HELDOUT, tmp_path) == grown  # nothing new to add
    assert writer.written == 7
    assert training_prompts(synth_args(9), None, tokenizer, HELDOUT, tmp_path) == grown  # --train-only: as it is


def test_a_grown_list_leaves_out_requests_that_touch_the_heldout_set_or_repeat_one(tokenizer, tmp_path):
    class Repeats(WritesNumberedRequests):
        def __call__(self, prompts, *, max_tokens, temperature, seed):
            texts = ["Explain how photosynthesis works in simple terms.", "Name two rivers in Africa, please."]
            return enumerate(self.tokenizer.encode(texts[k % 2], add_special_tokens=False) for k in range(len(prompts)))

    first = training_prompts(synth_args(1), Repeats(tokenizer), tokenizer, HELDOUT, tmp_path)
    grown = training_prompts(synth_args(4), Repeats(tokenizer), tokenizer, HELDOUT, tmp_path)
    assert grown == first + ["Name two rivers in Africa, please."]
