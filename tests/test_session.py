"""A conversation keeps its caches: each turn prefills only what it adds, and stays lossless."""

import mlx_glimmer
from mlx_glimmer import DecodeState
from mlx_glimmer.settings import GenerationSettings
from mlx_glimmer.speculative import generate_steps

PROMPT = [256] + list(b"The quick brown fox")


def tokens(steps):
    return [t for s in steps for t in s.tokens]


def fresh(pair, prompt, drafter=None, n=40):
    return tokens(generate_steps(pair.target, prompt, GenerationSettings(max_tokens=n, block_size=4), drafter=drafter))


def test_second_turn_prefills_only_new_tokens_and_matches_a_fresh_run(muse_pair):
    state = DecodeState()
    d = muse_pair.drafter
    first = list(
        generate_steps(
            muse_pair.target, PROMPT, GenerationSettings(max_tokens=40, block_size=4), drafter=d, state=state
        )
    )
    assert first[0].prefill_tokens == len(PROMPT)
    answer = tokens(first)
    turn2 = PROMPT + answer + list(b" and then?")  # > 8x the window of 8
    second = list(
        generate_steps(muse_pair.target, turn2, GenerationSettings(max_tokens=40, block_size=4), drafter=d, state=state)
    )
    # Everything but the last answer token (never run through the target) was cached.
    assert second[0].prefill_tokens == len(turn2) - (len(PROMPT) + len(answer) - 1)
    assert state.reused_tokens == len(PROMPT) + len(answer) - 1
    assert tokens(second) == fresh(muse_pair, turn2)


def test_a_turn_that_rewrites_the_tail_rolls_back_and_stays_lossless(muse_pair):
    state = DecodeState()
    d = muse_pair.drafter
    answer = tokens(
        generate_steps(
            muse_pair.target, PROMPT, GenerationSettings(max_tokens=30, block_size=4), drafter=d, state=state
        )
    )
    # The chat template re-renders the last 5 tokens of the answer differently.
    turn2 = PROMPT + answer[:-5] + list(b"<edit> more")
    got = list(
        generate_steps(muse_pair.target, turn2, GenerationSettings(max_tokens=30, block_size=4), drafter=d, state=state)
    )
    assert state.reused_tokens == len(PROMPT) + len(answer) - 5
    assert tokens(got) == fresh(muse_pair, turn2, n=30)


def test_a_rollback_deeper_than_the_cache_holds_starts_over(muse_pair):
    state = DecodeState()
    d = muse_pair.drafter
    long_prompt = PROMPT * 12  # 240 tokens: far more than window + slack
    list(
        generate_steps(
            muse_pair.target, long_prompt, GenerationSettings(max_tokens=5, block_size=4), drafter=d, state=state
        )
    )
    turn2 = PROMPT + list(b" something else")
    got = list(
        generate_steps(muse_pair.target, turn2, GenerationSettings(max_tokens=30, block_size=4), drafter=d, state=state)
    )
    assert state.reused_tokens == 0 and got[0].prefill_tokens == len(turn2)
    assert tokens(got) == fresh(muse_pair, turn2, n=30)


def test_switching_speculation_off_and_on_between_turns(muse_pair):
    state = DecodeState()
    d = muse_pair.drafter
    a1 = tokens(
        generate_steps(
            muse_pair.target, PROMPT, GenerationSettings(max_tokens=20, block_size=4), drafter=d, state=state
        )
    )
    t2 = PROMPT + a1 + list(b"ok")
    a2 = tokens(generate_steps(muse_pair.target, t2, GenerationSettings(max_tokens=20), drafter=None, state=state))
    assert a2 == fresh(muse_pair, t2, n=20)
    t3 = t2 + a2 + list(b"go on")
    a3 = tokens(
        generate_steps(muse_pair.target, t3, GenerationSettings(max_tokens=20, block_size=4), drafter=d, state=state)
    )
    assert a3 == fresh(muse_pair, t3, n=20)


def test_api_reports_prefill_tokens_per_turn(muse_pair):
    state = DecodeState()
    msgs = [{"role": "user", "content": "Hello"}]
    r1 = mlx_glimmer.generate(muse_pair, msgs, max_tokens=12, state=state)
    msgs += [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "More"}]
    r2 = mlx_glimmer.generate(muse_pair, msgs, max_tokens=12, state=state)
    assert r2.stats.prefill_tokens < r2.stats.prompt_tokens
    assert r2.stats.prefill_tokens == r2.stats.prompt_tokens - state.reused_tokens
    assert r2.token_ids == mlx_glimmer.generate(muse_pair, msgs, max_tokens=12).token_ids


def cache_length(state) -> int:
    return max(getattr(c, "offset", 0) for c in state.cache)


def test_closing_a_plain_stream_early_undoes_its_run_ahead_at_once(muse_pair):
    state = DecodeState()
    stream = mlx_glimmer.stream_generate(muse_pair, PROMPT, max_tokens=30, speculative=False, state=state)
    for _ in range(5):
        next(stream)
    assert state.ahead == 1, "plain decoding queues the next forward before yielding"
    stream.close()
    assert state.ahead == 0 and cache_length(state) == len(state.processed)


def test_an_abandoned_stream_is_tidied_by_the_next_turn_not_by_its_late_collection(muse_pair):
    state = DecodeState()
    stream = mlx_glimmer.stream_generate(muse_pair, PROMPT, max_tokens=30, speculative=False, state=state)
    answer = [t for _, chunk in zip(range(6), stream) for t in chunk.token_ids]
    turn2 = PROMPT + answer + list(b" and?")
    second = mlx_glimmer.generate(muse_pair, turn2, max_tokens=25, speculative=False, state=state)
    processed_after = list(state.processed)
    stream.close()  # the old generator's late cleanup must not touch the new turn's state
    assert state.processed == processed_after and cache_length(state) == len(state.processed)
    assert second.token_ids == mlx_glimmer.generate(muse_pair, turn2, max_tokens=25, speculative=False).token_ids


def test_a_decode_state_refuses_another_target(muse_pair, llama_pair):
    import pytest

    state = DecodeState()
    mlx_glimmer.generate(muse_pair, PROMPT, max_tokens=4, state=state)
    with pytest.raises(mlx_glimmer.GlimmerError, match="another target"):
        mlx_glimmer.generate(llama_pair, PROMPT, max_tokens=4, state=state)
