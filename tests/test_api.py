"""The Python API: prompts in three forms, streaming with running stats."""

import pytest

import mlx_glimmer
from mlx_glimmer import GlimmerError


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
    ],
)
def test_settings_are_checked_once_when_made(make, field):
    with pytest.raises(GlimmerError, match=field):
        make()
