"""The Python API: prompts in three forms, streaming with running stats."""

import time

import pytest

import mlx_glimmer
from mlx_glimmer import GlimmerError
from mlx_glimmer.decode_state import Step
from mlx_glimmer.generate import GenerationStats, chunks_from_steps


def test_stream_generate_yields_segments_that_add_up_to_generate(muse_pair):
    chunks = list(mlx_glimmer.stream_generate(muse_pair, "Hello", max_tokens=30, block_size=4))
    whole = mlx_glimmer.generate(muse_pair, "Hello", max_tokens=30, block_size=4)
    assert "".join(c.text for c in chunks) == whole.text
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    counts = [c.stats.generated_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == len(whole.token_ids)
    assert chunks[-1].stats.finish_reason in ("stop", "length")
    assert all(c.stats.finish_reason is None for c in chunks[:-1])


def test_prompt_forms(muse_pair):
    tok = muse_pair.tokenizer
    ids = [256, 72, 105]
    assert mlx_glimmer.generate(muse_pair, ids, max_tokens=3).stats.prompt_tokens == 3  # used exactly as given
    text = mlx_glimmer.generate(muse_pair, "Hi", max_tokens=3)
    assert text.stats.prompt_tokens == len(tok.encode("Hi"))
    msgs = [{"role": "user", "content": "Hi"}]
    chat = mlx_glimmer.generate(muse_pair, msgs, max_tokens=3)
    assert chat.stats.prompt_tokens == len(tok.apply_chat_template(msgs, add_generation_prompt=True))


@pytest.mark.parametrize(
    "prompt, kwargs",
    [
        ([], {}),
        ([999999], {}),
        ([{"bad": 1}], {}),
        ("hi", {"temperature": -1}),
        ("hi", {"top_p": 0}),
        ("hi", {"block_size": 0}),
        ("hi", {"tree": 0}),
        ("hi", {"tree": "wide"}),
    ],
)
def test_bad_arguments_raise_glimmer_error(muse_pair, prompt, kwargs):
    with pytest.raises(GlimmerError):
        mlx_glimmer.generate(muse_pair, prompt, max_tokens=3, **kwargs)


def test_one_settings_value_or_the_keywords_give_the_same_answer(muse_pair):
    settings = mlx_glimmer.GenerationSettings(
        mlx_glimmer.SamplingParams(temperature=0.8, top_p=0.9), max_tokens=20, block_size=4, seed=5
    )
    by_value = mlx_glimmer.generate(muse_pair, "Hello", settings)
    by_keywords = mlx_glimmer.generate(
        muse_pair, "Hello", temperature=0.8, top_p=0.9, max_tokens=20, block_size=4, seed=5
    )
    assert by_value.token_ids == by_keywords.token_ids and by_value.stats.block_size == 4
    # a keyword replaces its field of the settings, the rest stays
    fewer = mlx_glimmer.generate(muse_pair, "Hello", settings, max_tokens=5)
    assert (
        fewer.token_ids
        == mlx_glimmer.generate(
            muse_pair, "Hello", temperature=0.8, top_p=0.9, max_tokens=5, block_size=4, seed=5
        ).token_ids
    )
    assert len(fewer.token_ids) <= 5


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: mlx_glimmer.SamplingParams(temperature=float("nan")), "temperature"),
        (lambda: mlx_glimmer.SamplingParams(top_p=1.5), "top_p"),
        (lambda: mlx_glimmer.SamplingParams(top_k=-1), "top_k"),
        (lambda: mlx_glimmer.GenerationSettings(block_size=0), "block_size"),
        (lambda: mlx_glimmer.GenerationSettings(block_size="wide"), "block_size"),
        (lambda: mlx_glimmer.GenerationSettings(tree=64), "tree"),
        (lambda: mlx_glimmer.GenerationSettings(tree="chain"), "tree"),
        (lambda: mlx_glimmer.GenerationSettings(tree=True), "tree"),
    ],
)
def test_settings_are_checked_once_when_made(make, field):
    with pytest.raises(GlimmerError, match=field):
        make()


class Detokenizer:
    """Token ids as text, one character per id (what `chunks_from_steps` needs of mlx-lm's detokenizer)."""

    def __init__(self):
        self.pending = ""

    def reset(self):
        self.pending = ""

    def add_token(self, t):
        self.pending += chr(ord("a") + t % 26)

    def finalize(self):
        pass

    @property
    def last_segment(self):
        out, self.pending = self.pending, ""
        return out


class StepsTokenizer:
    detokenizer = Detokenizer()


def run_steps(steps: list[Step], max_tokens: int = 100) -> list:
    def loop():
        yield from steps

    return list(chunks_from_steps(StepsTokenizer(), loop(), GenerationStats(), max_tokens, time.perf_counter(), float))


def test_stats_count_each_rounds_drafts_depth_tree_and_source_from_the_loops_steps():
    chunks = run_steps(
        [
            Step([1], prefill_tokens=5, verify_s=0.01),  # the prefill: no round
            Step([2, 3, 4], drafted=9, accepted=2, tree=True, source="model"),  # a 9-node tree, a path of 2 kept
            Step([5], drafted=3, accepted=0),  # a chain of 3, none kept
            Step([6, 7], drafted=5, accepted=1, tree=True, source="lookup"),
            Step([8, 9], drafted=2, accepted=1, source="both", stopped=True),  # a chain; 9 is the stop token
        ]
    )
    s = chunks[-1].stats
    assert s.tokens_verified == 10 + 4 + 6 + 3  # drafts + the anchor, every round after the prefill
    assert s.accepted_depths == [2, 0, 1, 1] and s.mean_accepted_depth == 1.0
    assert s.tree_rounds == 2 and s.target_forwards == 4 and s.mean_tokens_verified == 23 / 4
    assert s.accepted_from == {"model": 1, "lookup": 1, "both": 1}  # a round that kept nothing has no source
    assert s.acceptance_lengths == [3, 1, 2, 2] and s.generated_tokens == 8 and s.finish_reason == "stop"
    d = s.to_dict()
    assert (d["tokens_verified"], d["tree_rounds"], d["accepted_depths"]) == (23, 2, [2, 0, 1, 1])
    assert d["mean_accepted_depth"] == 1.0 and d["accepted_from"] == {"model": 1, "lookup": 1, "both": 1}
    # each chunk keeps the figures of its moment
    first = chunks[1].stats
    assert (first.accepted_depths, first.accepted_from, first.tree_rounds) == ([2], {"model": 1}, 1)
    assert chunks[0].stats.tokens_verified == 0 and chunks[0].stats.mean_accepted_depth == 0.0


def test_plain_rounds_verify_one_token_and_keep_no_draft():
    s = run_steps([Step([1], prefill_tokens=2), Step([2]), Step([3])])[-1].stats
    assert (s.tokens_verified, s.accepted_depths, s.tree_rounds, s.accepted_from) == (2, [0, 0], 0, {})
    assert s.mean_tokens_verified == 1.0 and s.mean_accepted_depth == 0.0
