"""The server's generation worker and prefix cache, without HTTP, on the tiny Muse pair.

A conversation taken from the cache must give exactly what a cold start gives,
also with sampling and a drafter, also after other conversations ran in between.
"""

import copy
import queue
from dataclasses import replace

import mlx.core as mx
import pytest
from serving import collect
from slow_machine import slow_machine_timeout

import mlx_glimmer
from mlx_glimmer import DecodeState, GenerationSettings, SamplingParams
from mlx_glimmer.noise import Noise
from mlx_glimmer.server.prompt_cache import Conversation, PromptCache, common_prefix
from mlx_glimmer.server.run import Delta, Failed, Finished, GenerationRequest, Job, Run, StopMatcher
from mlx_glimmer.server.worker import GenerationWorker

A = [256] + list(b"The quick brown fox")
B = [256] + list(b"Lorem ipsum dolor sit amet")


@pytest.fixture(scope="module")
def worker(muse_pair):
    w = GenerationWorker(lambda: muse_pair, max_queue=4, prompt_cache_bytes=64 << 20)
    w.start()
    yield w
    w.close(timeout=10)


def request(prompt_tokens, stop=(), **settings) -> GenerationRequest:
    """A queued request: its prompt, `GenerationSettings.of(**settings)` and stop strings."""
    return GenerationRequest(prompt_tokens, GenerationSettings.of(**settings), list(stop))


def run(worker, **fields):
    events: queue.Queue = queue.Queue()
    worker.submit(Job(request(**fields), events.put))
    return collect(events)


def answer_here(pair, cache: PromptCache, **fields):
    """One job on this thread, as the worker serves a lone request: its conversation taken from `cache`, decoded
    alone (`Run.alone`) and put back."""
    text = []
    run = Run.start(Job(request(**fields), lambda e: text.append(e.text)), cache, pair.tokenizer)
    assert run.alone(pair)
    cache.put(run.conv)
    return "".join(text), run.finished()


def cold(pair, prompt, **kwargs):
    """A cold start, with a drafter of its own (the pair's drafter stays the cache's untouched prototype)."""
    return mlx_glimmer.generate(replace(pair, drafter=copy.copy(pair.drafter)), prompt, **kwargs)


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, top_p=0.95, seed=7)])
def test_follow_up_turns_reuse_their_conversation_and_equal_a_cold_start(muse_pair, sampling):
    cache = PromptCache(muse_pair.drafter, 1 << 30)
    text_a, first_a = answer_here(muse_pair, cache, prompt_tokens=A, max_tokens=12, block_size=4, **sampling)
    assert first_a.stats.prefill_tokens == len(A)
    ids_a = cold(muse_pair, A, max_tokens=12, block_size=4, **sampling).token_ids
    answer_here(muse_pair, cache, prompt_tokens=B, max_tokens=12, block_size=4, **sampling)  # another conversation

    follow_up = A + ids_a + list(b"?")  # shorter than the drafter's window: its old context matters
    text, done = answer_here(muse_pair, cache, prompt_tokens=follow_up, max_tokens=20, block_size=4, **sampling)
    assert done.stats.prefill_tokens < len(follow_up) // 2  # only what the follow-up adds
    ref = cold(muse_pair, follow_up, max_tokens=20, block_size=4, **sampling)
    assert text == ref.text and done.stats.generated_tokens == ref.stats.generated_tokens
    assert done.stats.acceptance_lengths == ref.stats.acceptance_lengths

    # The conversation's drafter followed this conversation, not the one in between: after another
    # interleaved request, a short third turn leaves it drafting exactly what a cold run's drafter drafts.
    answer_here(muse_pair, cache, prompt_tokens=B, max_tokens=12, block_size=4, **sampling)
    turn3 = follow_up + ref.token_ids + list(b"!")
    answer_here(muse_pair, cache, prompt_tokens=turn3, max_tokens=2, block_size=4, **sampling)
    warm = next(c for c in cache._entries.values() if c.tokens[: len(turn3)] == turn3)
    params, noise = SamplingParams(temperature=1.0), Noise(0, len(warm.tokens))
    _, warm_probs = warm.drafter.propose(warm.tokens[-1], 3, params, noise)
    ref_conv = Conversation(DecodeState(), copy.copy(muse_pair.drafter))
    mlx_glimmer.generate(
        replace(muse_pair, drafter=ref_conv.drafter),
        turn3,
        max_tokens=2,
        block_size=4,
        state=ref_conv.state,
        **sampling,
    )
    assert warm.tokens == ref_conv.tokens
    _, cold_probs = ref_conv.drafter.propose(ref_conv.tokens[-1], 3, params, noise)
    assert mx.allclose(warm_probs, cold_probs, atol=1e-5).item()


def test_a_request_sharing_part_of_a_conversation_gets_a_copy_and_the_conversation_stays(muse_pair):
    cache = PromptCache(muse_pair.drafter, 1 << 30)
    long_a = A + list(b" jumps over the lazy dog")
    answer_here(muse_pair, cache, prompt_tokens=long_a, max_tokens=12, block_size=4)
    (kept,) = cache._entries.values()
    kept_tokens = list(kept.tokens)

    other = A + list(b" sleeps all day")  # shares A only
    text, done = answer_here(muse_pair, cache, prompt_tokens=other, max_tokens=12, block_size=4)
    assert cache.stats.forks == 1 and done.stats.prefill_tokens == len(other) - common_prefix(long_a, other)
    assert text == cold(muse_pair, other, max_tokens=12, block_size=4).text
    assert len(cache) == 2 and kept.tokens == kept_tokens  # the first conversation is still there, untouched

    follow_up = kept_tokens + list(b"??")  # ... and its own follow-up still finds it
    text, done = answer_here(muse_pair, cache, prompt_tokens=follow_up, max_tokens=12, block_size=4)
    assert cache.stats.forks == 1 and done.stats.prefill_tokens == 2
    assert text == cold(muse_pair, follow_up, max_tokens=12, block_size=4).text

    _, again = answer_here(muse_pair, cache, prompt_tokens=other, max_tokens=12, block_size=4)  # a retry
    assert again.stats.prefill_tokens == 1  # all but the last prompt token came from the cache
    unrelated = list(b"Something else entirely")
    _, fresh = answer_here(muse_pair, cache, prompt_tokens=unrelated, max_tokens=4, block_size=4)
    assert fresh.stats.prefill_tokens == len(unrelated) and cache.stats.misses == 2


def test_stop_strings_end_generation_and_are_not_returned(worker, muse_pair):
    ref = cold(muse_pair, A, max_tokens=24).text
    stop = ref[5:8]
    text, done = run(worker, prompt_tokens=A, max_tokens=24, stop=[stop, "never here"])
    assert done.finish_reason == "stop" and text == ref[: ref.index(stop)]


def test_a_cancelled_job_stops_after_one_round_and_its_conversation_stays_usable(worker, muse_pair):
    events: queue.Queue = queue.Queue()
    job = Job(request(prompt_tokens=B, max_tokens=200, block_size=4), events.put)
    worker.submit(job)
    while not isinstance(events.get(timeout=slow_machine_timeout()), Delta):
        pass
    job.cancelled.set()
    while not isinstance(e := events.get(timeout=slow_machine_timeout()), Finished):
        pass
    assert e.finish_reason == "cancelled" and e.stats.generated_tokens < 40
    follow_up = B + list(b" again")
    text, _ = run(worker, prompt_tokens=follow_up, max_tokens=10)
    assert text == cold(muse_pair, follow_up, max_tokens=10).text


def test_cache_is_bounded_by_bytes_least_recently_used_out(muse_pair):
    cache = PromptCache(muse_pair.drafter, max_bytes=1 << 40)
    convs = []
    for prompt in (A, B, A[:3] + B):
        conv = cache.take(prompt)
        mlx_glimmer.generate(replace(muse_pair, drafter=conv.drafter), prompt, max_tokens=4, state=conv.state)
        cache.put(conv)
        convs.append(conv)
    sizes = [c.nbytes for c in convs]
    assert all(s > 0 for s in sizes) and cache.nbytes == sum(sizes)
    cache.take(A + [1])  # A is now the most recent ...
    cache.put(convs[0])
    cache.max_bytes = sizes[0] + sizes[2]
    cache.put(Conversation())  # (an empty one is not kept)
    cache.put(convs[2])  # ... so B, the least recent, goes
    assert {c.key for c in cache._entries.values()} == {convs[0].key, convs[2].key}
    cache.max_bytes = 1
    cache.put(convs[1])  # bigger than the whole bound: not kept
    assert convs[1].key not in cache._entries


@pytest.mark.parametrize(
    "stops, pieces, out, stopped",
    [
        (["END"], ["hello E", "N", "D tail"], ["hello ", "", ""], True),
        (["END"], ["hello E", "x"], ["hello ", "Ex"], False),
        (["\n\n", "."], ["a\n", "b. c"], ["a", "\nb"], True),
        ([], ["any", "thing"], ["any", "thing"], False),
    ],
)
def test_stop_matcher_holds_back_what_could_start_a_stop_string(stops, pieces, out, stopped):
    m = StopMatcher(stops)
    got, hit = [], False
    for p in pieces:
        text, hit = m.feed(p)
        got.append(text)
        if hit:
            break
    assert got == out[: len(got)] and hit == stopped


def test_a_fork_copies_caches_and_drafter_context_but_shares_models(muse_pair):
    cache = PromptCache(muse_pair.drafter, 1 << 30)
    conv = cache.new()
    mlx_glimmer.generate(replace(muse_pair, drafter=conv.drafter), A, max_tokens=5, state=conv.state)
    twin = cache.fork(conv)
    assert twin.key != conv.key and twin.tokens == conv.tokens and twin.tokens is not conv.tokens
    assert twin.state.cache is not conv.state.cache and twin.state.drafter is twin.drafter
    assert twin.drafter.model is muse_pair.drafter.model and twin.drafter.target is muse_pair.target
    for name, value in vars(conv.state).items():
        if name not in ("cache", "processed", "drafter"):
            assert getattr(twin.state, name) is value  # the target (and anything else) stays shared


def test_a_failing_job_reports_failed_and_the_worker_serves_the_next(worker, muse_pair):
    events: queue.Queue = queue.Queue()
    worker.submit(Job(request(prompt_tokens=[10**9], max_tokens=4), events.put))  # not a token id
    assert isinstance(events.get(timeout=slow_machine_timeout()), Failed)
    text, done = run(worker, prompt_tokens=A, max_tokens=6)
    assert done.finish_reason == "length" and text == cold(muse_pair, A, max_tokens=6).text
