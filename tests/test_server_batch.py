"""Concurrent requests decoded together (server/batch.py): outputs equal solo ones, a lone request stays
speculative, a long prompt joins a running batch in chunks, the prefix cache keeps working, `/metrics` shows
the batch size.

Most tests run the generation worker in-process on the tiny random llama pair (plain KV caches) and the tiny
Muse pair (sliding-window layers, window 8, batched by `batch_cache.BatchWindowedKVCache`; run far past the
window); the last ones run `mlx-glimmer serve` on the demo pair (SmolLM2-135M-Instruct + its DFlash drafter), as
a client sees it, hence `network`. Greedy outputs of a batch may differ from solo ones only at a floating-point
tie: a difference is reported with both kernels' margins (`explain_batched_divergence`) and passes only if it
is one.
"""

from __future__ import annotations

import copy
import json
import queue
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from serving import DEMO_MAX_BATCH, ServeProcess, collect
from slow_machine import slow_machine_timeout

import mlx_glimmer
from mlx_glimmer import DecodeState, SamplingParams
from mlx_glimmer.cache import WindowedKVCache
from mlx_glimmer.divergence import mlx_dtype
from mlx_glimmer.generate import encode_prompt
from mlx_glimmer.noise import Noise
from mlx_glimmer.server.batch import (
    BatchPolicy,
    DecodeBatch,
    Row,
    batch_support,
    explain_batched_divergence,
    forward_rows,
)
from mlx_glimmer.server.batch_cache import BatchWindowedKVCache, merge_rows
from mlx_glimmer.server.metrics import metrics_text
from mlx_glimmer.server.prompt_cache import Conversation
from mlx_glimmer.server.run import Delta, Finished, GenerationRequest, Job
from mlx_glimmer.server.worker import GenerationWorker
from mlx_glimmer.settings import BatchSettings, GenerationSettings, SamplingError
from mlx_glimmer.speculative import generate_steps, prefill

PROMPTS = [[256] + list(f"Tell me about {topic}.".encode()) for topic in ("owls", "salt", "maps", "glass")]


# ---- helpers --------------------------------------------------------------------------------------------


def make_worker(pair, max_batch: int = 4) -> GenerationWorker:
    w = GenerationWorker(lambda: pair, max_queue=16, prompt_cache_bytes=256 << 20, batch=BatchSettings(max_batch))
    w.start()
    return w


def submit(worker, prompt, stop=(), **settings) -> queue.Queue:
    """Queue a request; its events arrive on the returned queue (whose `job` is the job)."""
    events: queue.Queue = queue.Queue()
    events.job = Job(GenerationRequest(list(prompt), GenerationSettings.of(**settings), list(stop)), events.put)
    worker.submit(events.job)
    return events


def together(worker, prompts, **settings) -> list[tuple[str, Finished]]:
    """All `prompts` submitted at once, then collected."""
    queues = [submit(worker, p, **settings) for p in prompts]
    return [collect(q) for q in queues]


def solo(pair, prompt, **kwargs):
    """A cold solo generation with a drafter of its own (the pair's drafter stays the prefix cache's prototype)."""
    return mlx_glimmer.generate(replace(pair, drafter=copy.copy(pair.drafter)), prompt, **kwargs)


def metrics(worker) -> dict[str, float]:
    text = metrics_text(
        worker.metrics, queue_depth=worker.queue_depth, busy=worker.busy, prompt_cache_max_bytes=1, uptime_s=1.0
    )
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if line and line[0] != "#")}


def idle(worker, timeout: float = slow_machine_timeout()) -> dict[str, float]:
    """/metrics once the worker has gone idle (it sets the batch size gauge to 0 after its last event)."""
    deadline = time.monotonic() + timeout
    while (m := metrics(worker))["glimmer_batch_size"] != 0 or worker.busy:
        assert time.monotonic() < deadline, "the worker did not go idle"
        time.sleep(0.05)
    return m


def assert_equal_or_tie(pair, prompt, reference: list[int], tokens: list[int], rows: int) -> None:
    """`tokens` (batched) equal `reference` (solo), or part from it at a floating-point tie, reported."""
    if tokens == reference:
        return
    d = explain_batched_divergence(pair.target, mlx_dtype(pair), list(prompt), reference, tokens, rows)
    assert d is not None, f"one output is a prefix of the other: {len(reference)} vs {len(tokens)} tokens"
    print(f"batched output parts from solo at token {d['position']} {d['tokens']}: {d['kernels']}")
    assert d["tie"], d


def assert_cached_drafter_followed(worker, pair, prompt) -> None:
    """The cached conversation that answered `prompt` has a drafter (a copy of it is asked, so the cached one
    stays as it is) that drafts what a cold drafter that read the same tokens in one prefill drafts."""
    cache = worker.prompt_cache
    warm = cache.fork(next(c for c in cache._entries.values() if c.tokens[: len(prompt)] == prompt))
    cold = Conversation(DecodeState(), copy.copy(pair.drafter))
    mlx_glimmer.generate(replace(pair, drafter=cold.drafter), warm.tokens, max_tokens=1, block_size=4, state=cold.state)
    assert cold.tokens == warm.tokens
    params, key = SamplingParams(temperature=1.0), Noise(0, len(warm.tokens))
    _, warm_probs = warm.drafter.propose(warm.tokens[-1], 3, params, key)
    _, cold_probs = cold.drafter.propose(cold.tokens[-1], 3, params, key)
    assert mx.allclose(warm_probs, cold_probs, atol=1e-4).item()


# ---- the policy and the settings ------------------------------------------------------------------------


def test_the_policy_batches_by_measured_throughput_and_probes_again_after_refusals():
    p = BatchPolicy(probe_interval=4, max_interval=8)
    assert not p.together(1)  # a lone request is never batched
    assert p.together(2)  # nothing measured: try it
    p.observe_solo(10, 1.0)  # alone: 10 tokens/s
    assert p.together(2)  # batches still unmeasured
    p.observe_batch(2, 0.1)  # 2 tokens per 0.1 s: 20 tokens/s beats 10
    assert p.together(2) and p.together(4)  # 4 is estimated from the step time at 2
    assert p.batched_rate(4) == pytest.approx(40.0)
    p = BatchPolicy(probe_interval=4, max_interval=8, solo_rate=100.0, step_seconds={2: 0.1})  # 20/s < 100/s
    choices = [p.together(2) for _ in range(4 + 8 + 8)]
    assert choices == [False] * 3 + [True] + [False] * 7 + [True] + [False] * 7 + [True]  # probes, backing off
    for _ in range(3):  # probes that pay (a faster time pulls the average at least halfway) ...
        p.observe_batch(2, 0.001)
    assert p.step_seconds[2] < 0.02  # ... batch from then on, the interval reset
    assert p.together(2) and p.interval == 4
    assert p.rates() == {2: pytest.approx(2 / p.step_seconds[2])}


def test_batch_settings_are_checked():
    assert BatchSettings().max_batch >= 2
    for bad in (0, -1, 1.5, True, "4"):
        with pytest.raises(SamplingError, match="max_batch"):
            BatchSettings(max_batch=bad)


# ---- the tiny llama pair: it batches -------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_worker(llama_pair):
    w = make_worker(llama_pair)
    yield w
    w.close(timeout=10)


def test_concurrent_requests_decode_together_and_equal_their_solo_outputs(llama_worker, llama_pair):
    assert batch_support(llama_pair.target) is None and llama_worker.can_batch
    before = metrics(llama_worker)
    results = together(llama_worker, PROMPTS, max_tokens=24, block_size=4)
    after = idle(llama_worker)
    for prompt, (text, done) in zip(PROMPTS, results):
        ref = solo(llama_pair, prompt, max_tokens=24, block_size=4)
        assert_equal_or_tie(llama_pair, prompt, ref.token_ids, done.token_ids, len(PROMPTS))
        if done.token_ids == ref.token_ids:
            assert text == ref.text
        assert done.stats.generated_tokens == len(done.token_ids)
        assert done.batched_tokens > 0 and done.batch_size > 1
    assert max(done.batch_size for _, done in results) == len(PROMPTS)
    steps = after['glimmer_batched_steps_total{batch_size="4"}'] - before.get(
        'glimmer_batched_steps_total{batch_size="4"}', 0
    )
    assert steps > 0
    assert after["glimmer_batched_tokens_total"] - before["glimmer_batched_tokens_total"] == sum(
        d.batched_tokens for _, d in results
    )
    assert after['glimmer_batched_tokens_per_second{batch_size="4"}'] > 0
    assert after["glimmer_batch_size"] == 0 and after["glimmer_batching_supported"] == 1


def test_a_lone_request_stays_speculative(llama_worker, llama_pair):
    text, done = collect(submit(llama_worker, PROMPTS[0] + [33], max_tokens=20, block_size=4))
    ref = solo(llama_pair, PROMPTS[0] + [33], max_tokens=20, block_size=4)
    assert text == ref.text and done.token_ids == ref.token_ids
    assert done.batched_tokens == 0 and done.batch_size == 1
    assert done.stats.drafter_kind == ref.stats.drafter_kind != "none"
    assert done.stats.verify_widths == ref.stats.verify_widths and max(done.stats.verify_widths) == 4


def test_a_lone_request_joins_a_batch_when_others_arrive_and_goes_back_to_speculative(llama_worker, llama_pair):
    long_prompt = PROMPTS[1] + list(b" More.")
    # Long enough that the others arrive while it decodes, however the machine's load paces the two threads.
    first = submit(llama_worker, long_prompt, max_tokens=160, block_size=4)
    got = first.get(timeout=slow_machine_timeout(1))  # it is decoding alone ...
    assert isinstance(got, Delta)
    others = [submit(llama_worker, p + list(b"!"), max_tokens=8, block_size=4) for p in PROMPTS[2:]]
    text, done = collect(first)
    text = got.text + text
    rest = [collect(q) for q in others]
    ref = solo(llama_pair, long_prompt, max_tokens=160, block_size=4)
    assert_equal_or_tie(llama_pair, long_prompt, ref.token_ids, done.token_ids, 3)
    assert 0 < done.batched_tokens < done.stats.generated_tokens  # alone, then in a batch ...
    widths = done.stats.verify_widths  # speculative rounds verify 4 (block 4), batched steps 1 token each
    start = widths.index(1)
    assert widths[start : start + done.batched_tokens] == [1] * done.batched_tokens
    assert 4 in widths[start + done.batched_tokens :]  # ... then speculative again, once the others were done
    for prompt, (_, d) in zip(PROMPTS[2:], rest):
        assert_equal_or_tie(
            llama_pair,
            prompt + list(b"!"),
            solo(llama_pair, prompt + list(b"!"), max_tokens=8).token_ids,
            d.token_ids,
            3,
        )


def test_follow_ups_of_batched_turns_hit_the_prefix_cache_and_their_drafter_followed(llama_worker, llama_pair):
    """A batched turn leaves its conversation cached with a drafter whose context covers it: follow-ups (batched
    again) prefill only what they add and equal cold starts, and the drafter drafts what a cold one drafts."""
    first = [p + list(b" Go on.") for p in PROMPTS]
    answers = together(llama_worker, first, max_tokens=16, block_size=4)
    assert all(d.batched_tokens > 0 for _, d in answers)
    hits = metrics(llama_worker)["glimmer_prefix_cache_hits_total"]
    follow = [p + d.token_ids + list(b" And?") for p, (_, d) in zip(first, answers)]
    seconds = together(llama_worker, follow, max_tokens=12, block_size=4)
    assert metrics(llama_worker)["glimmer_prefix_cache_hits_total"] - hits >= len(follow)
    for prompt, (_, d) in zip(follow, seconds):
        assert d.stats.prefill_tokens < len(prompt) // 2
        assert_equal_or_tie(
            llama_pair,
            prompt,
            solo(llama_pair, prompt, max_tokens=12, block_size=4).token_ids,
            d.token_ids,
            len(follow),
        )
    assert_cached_drafter_followed(llama_worker, llama_pair, follow[0])


def test_stop_strings_cancels_and_sampling_inside_a_batch(llama_worker, llama_pair):
    ref = solo(llama_pair, PROMPTS[0], max_tokens=24, block_size=4)
    stop = ref.text[6:9]
    cut = submit(llama_worker, PROMPTS[0], stop=[stop], max_tokens=24, block_size=4)
    dropped = submit(llama_worker, PROMPTS[1], max_tokens=200, block_size=4)
    sampled = submit(llama_worker, PROMPTS[2], max_tokens=16, temperature=0.9, top_p=0.9, seed=3)
    plain = submit(llama_worker, PROMPTS[3], max_tokens=16, speculative=False)
    while not isinstance(dropped.get(timeout=slow_machine_timeout(24, requests=2)), Delta):
        pass
    text, done = collect(cut)
    assert done.finish_reason == "stop" and text == ref.text[: ref.text.index(stop)] and done.batched_tokens > 0
    dropped.job.cancelled.set()  # it leaves the batch after its next step; the others carry on
    _, gone = collect(dropped)
    assert gone.finish_reason == "cancelled" and gone.stats.generated_tokens < 200
    _, s = collect(sampled)
    assert s.stats.generated_tokens == len(s.token_ids) and s.finish_reason in ("length", "stop")
    assert s.batched_tokens > 0
    assert all(0 <= t < llama_pair.target.vocab_size for t in s.token_ids)
    _, p = collect(plain)
    assert_equal_or_tie(llama_pair, PROMPTS[3], solo(llama_pair, PROMPTS[3], max_tokens=16).token_ids, p.token_ids, 4)
    assert p.stats.drafter_kind == "none"
    assert p.batched_tokens > 0
    idle(llama_worker)


def test_max_batch_1_serves_one_at_a_time(llama_pair):
    w = make_worker(llama_pair, max_batch=1)
    try:
        results = together(w, PROMPTS[:2], max_tokens=8, block_size=4)
    finally:
        w.close(timeout=10)
    for prompt, (_, d) in zip(PROMPTS, results):
        assert d.batched_tokens == 0 and d.token_ids == solo(llama_pair, prompt, max_tokens=8, block_size=4).token_ids


def test_over_http_responses_and_metrics_show_the_batch(llama_worker, llama_pair):
    from fastapi.testclient import TestClient

    from mlx_glimmer.server.app import ServerState, create_app, model_context

    server = ServerState(llama_worker, "tiny", GenerationSettings(max_tokens=8), model_context(llama_pair))
    body = {"model": "tiny", "max_tokens": 12, "temperature": 0, "block_size": 4}
    with TestClient(create_app(server)) as client:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            replies = list(pool.map(lambda p: client.post("/v1/completions", json={**body, "prompt": p}), PROMPTS))
        text = client.get("/metrics").text
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    stats = [r.json()["glimmer"] for r in replies]
    assert max(s["batch_size"] for s in stats) > 1 and sum(s["batched_tokens"] for s in stats) > 0
    for prompt, reply in zip(PROMPTS, replies):
        assert reply.json()["choices"][0]["text"] == solo(llama_pair, prompt, max_tokens=12, block_size=4).text
    for name in ("glimmer_batch_size", "glimmer_batched_steps_total", "glimmer_batched_tokens_per_second"):
        assert f"\n{name}" in text


@pytest.mark.parametrize("pair_name", ["llama_pair", "muse_pair"])
def test_a_difference_is_explained_with_both_kernels_margins(pair_name, request):
    pair = request.getfixturevalue(pair_name)
    prompt = PROMPTS[0] * 2  # past the Muse target's window
    ref = solo(pair, prompt, max_tokens=8, block_size=4).token_ids
    other = ref[:3] + [(ref[3] + 1) % pair.target.vocab_size] + ref[4:]
    d = explain_batched_divergence(pair.target, "float32", prompt, ref, other, 4)
    assert d["position"] == 3 and d["tokens"] == [ref[3], other[3]] and not d["tie"]  # not a tie: made up
    assert set(d["kernels"]) == {"step (1 row)", "batched (4 rows)"}
    assert all(k["argmax"] == ref[3] and k["gap"] > k["tolerance"] for k in d["kernels"].values())
    assert explain_batched_divergence(pair.target, "float32", prompt, ref, list(ref), 4) is None


# ---- a long prompt joins a running batch in chunks --------------------------------------------------------


def test_a_prompt_prefilled_in_chunks_leaves_generate_steps_only_its_last_token(muse_pair):
    """`speculative.prefill` runs a prompt's whole chunks into a state, one per next() (past the window),
    leaving the last 1 to `step` tokens; a generation on that state then prefills only those and gives a cold
    generation's tokens."""
    target, prompt = muse_pair.target, PROMPTS[0] * 2  # 40 tokens
    settings = GenerationSettings(max_tokens=24, block_size=4)
    cold = list(generate_steps(target, prompt, settings, drafter=copy.copy(muse_pair.drafter)))
    state, drafter = DecodeState(), copy.copy(muse_pair.drafter)
    left = list(prefill(target, prompt, settings, drafter=drafter, state=state, step=5))
    assert left == [30, 25, 20, 15, 10, 5, 0] and state.processed == prompt[:35]
    warm = list(generate_steps(target, prompt, settings, drafter=drafter, state=state))
    assert warm[0].prefill_tokens == 5 and state.reused_tokens == 35
    assert [t for s in warm for t in s.tokens] == [t for s in cold for t in s.tokens]


def test_a_long_prompt_joins_a_running_batch_in_chunks_while_it_keeps_decoding(llama_pair):
    """A request with more than `prefill_chunk` prompt tokens to prefill joins a running request a chunk at a
    time: the running one decodes a step between chunks (batched steps of one), the joining one counts its
    whole prompt as prefilled and its drafter follows it, and both give their solo tokens."""
    worker = GenerationWorker(lambda: llama_pair, max_queue=4, prompt_cache_bytes=64 << 20,
                              batch=BatchSettings(4), prefill_chunk=8)  # fmt: skip
    worker.start()
    running, joining = PROMPTS[1] + list(b" More."), PROMPTS[2] * 3  # 26 and 60 tokens
    try:
        first = submit(worker, running, max_tokens=96, block_size=4)
        assert isinstance(first.get(timeout=slow_machine_timeout(1)), Delta)  # it is decoding alone ...
        second = submit(worker, joining, max_tokens=8, block_size=4)
        (_, a), (_, b) = collect(first), collect(second)
        m = idle(worker)
    finally:
        worker.close(timeout=10)
    chunks = (len(joining) - 1) // 8  # whole chunks; the first token's forward runs the rest
    assert m['glimmer_batched_steps_total{batch_size="1"}'] == chunks  # one per chunk (the last queued before it)
    assert b.stats.prefill_tokens == len(joining) and b.batch_size == 2 and b.batched_tokens > 0
    assert a.batched_tokens > chunks
    assert_equal_or_tie(llama_pair, running, solo(llama_pair, running, max_tokens=96).token_ids, a.token_ids, 2)
    assert_equal_or_tie(llama_pair, joining, solo(llama_pair, joining, max_tokens=8).token_ids, b.token_ids, 2)
    assert_cached_drafter_followed(worker, llama_pair, joining)


# ---- the batched window cache ---------------------------------------------------------------------------

WINDOW = 8  # the tiny Muse target's sliding window


def random_kv(rng, rows: int, length: int) -> tuple[mx.array, mx.array]:
    """Random keys and values: `rows` rows of `length` new positions (2 heads of 4)."""
    return tuple(mx.array(rng.standard_normal((rows, 2, length, 4)).astype(np.float32)) for _ in range(2))


def twin_window_caches(rng, reserve: int, length: int, verify: int = 0, kept: int = 0) -> list[WindowedKVCache]:
    """Two identical `WindowedKVCache`s: a prefill of `length` positions, then a verify of `verify` positions
    of which `kept` are kept."""
    twins = [WindowedKVCache(WINDOW, reserve), WindowedKVCache(WINDOW, reserve)]
    for n in (length, verify):
        if n:
            keys, values = random_kv(rng, 1, n)
            for c in twins:
                c.update_and_fetch(keys, values)
    for c in twins:
        c.trim(verify - kept)
    return twins


def assert_same_window_cache(got: WindowedKVCache, expected: WindowedKVCache) -> None:
    """The same entries (bit for bit), position, window and rollback room."""
    assert (got.window, got.reserve, got.offset) == (expected.window, expected.reserve, expected.offset)
    for a, b in zip(got.state, expected.state):
        assert a.shape == b.shape and mx.array_equal(a, b).item()
    assert [got.can_trim(n) for n in range(40)] == [expected.can_trim(n) for n in range(40)]


def test_the_batched_window_cache_keeps_each_row_as_its_own_window_cache_would():
    """Rows of different lengths (one shorter than the window: left padding) and rollback reserves, one joining
    after a verify that kept part of its block: at every step each row attends to exactly the keys its own
    `WindowedKVCache` gives it within the window; a row extracted right after joining, one leaving mid-way and
    every row at the end are the very cache decoding alone leaves, bit for bit."""
    rng = np.random.default_rng(0)
    short, long, verified = (
        twin_window_caches(rng, reserve=2, length=3),
        twin_window_caches(rng, reserve=4, length=30),
        twin_window_caches(rng, reserve=6, length=20, verify=6, kept=2),  # holds more than it keeps at its next step
    )
    batch = BatchWindowedKVCache.merge([short[0], long[0]])
    batch.step = 5  # a small buffer: the columns no row keeps are dropped (copied out) every few steps
    assert_same_window_cache(batch.extract(0), short[1])
    assert_same_window_cache(batch.extract(1), long[1])
    own = [short[1], long[1]]  # each row's own cache, fed what its row is fed
    for step in range(3 * WINDOW):
        if step == 5:
            batch.extend(BatchWindowedKVCache.merge([verified[0]]))
            own.append(verified[1])
        if step == 12:
            assert_same_window_cache(batch.extract(0), own[0])
            batch.filter([1, 2])
            own = own[1:]
        mask = np.array(batch.make_mask(1))  # asked before the update, as the model asks
        keys, values = random_kv(rng, len(own), 1)
        got = np.array(batch.update_and_fetch(keys, values)[0])
        for i, c in enumerate(own):
            seen = np.array(c.make_mask(1, return_array=True))[0]
            expected = np.array(c.update_and_fetch(keys[i : i + 1], values[i : i + 1])[0])[0][:, seen]
            np.testing.assert_array_equal(got[i][:, mask[i, 0, 0]], expected)
    for i, c in enumerate(own):
        out = batch.extract(i)
        assert_same_window_cache(out, c)
        out.trim(1), c.trim(1)  # a step queued ahead of the last read, undone
        assert_same_window_cache(out, c)


# ---- the tiny Muse pair: sliding-window layers decode together too ---------------------------------------

MUSE_PROMPTS = [[256] + list(f"Tell me about {topic}.".encode()) for topic in ("owls", "salt", "glass", "rivers")]


def prefilled(target, context: list[int]) -> DecodeState:
    """A request's state after its prompt: `context` but its last token in the cache (that one is its anchor)."""
    state = DecodeState(cache=target.make_cache(reserve=8), processed=list(context[:-1]))
    hidden, _ = target.forward(target.tokens(context[:-1]), state.cache, False)
    target.sync(hidden, cache=state.cache)
    return state


def test_batched_muse_logits_equal_each_rows_solo_logits_past_the_window(muse_pair):
    target = muse_pair.target
    assert target.args.sliding_window == WINDOW
    contexts = [MUSE_PROMPTS[0][:5], MUSE_PROMPTS[1] * 2, (MUSE_PROMPTS[2] * 3)[:40]]  # 5, 38 and 40 tokens
    own = [prefilled(target, c).cache for c in contexts]
    batch = merge_rows([prefilled(target, c).cache for c in contexts])
    tokens = [c[-1] for c in contexts]
    for _ in range(3 * WINDOW):
        hidden, _ = forward_rows(target, mx.array(tokens, dtype=mx.uint32), batch, False)
        batched = target.head(hidden)
        for i, cache in enumerate(own):
            hidden, _ = target.forward(target.tokens(tokens[i : i + 1]), cache, False)
            solo = target.head(hidden)[0]
            assert mx.allclose(batched[i], solo, rtol=1e-4, atol=1e-4).item()
            tokens[i] = mx.argmax(solo).item()


def test_a_request_leaving_a_batch_takes_back_the_cache_decoding_alone_leaves(muse_pair):
    """Through `DecodeBatch` (steps queued one ahead; requests joining and leaving at different lengths): each
    request's tokens are its greedy tokens, and the cache it takes back holds what its own cache holds after the
    same forwards (the one queued ahead of its last read undone), past the window."""
    target = muse_pair.target
    contexts = [MUSE_PROMPTS[0], MUSE_PROMPTS[1][:6], MUSE_PROMPTS[3] + MUSE_PROMPTS[2]]
    rows = [Row(prefilled(target, c), c[-1], SamplingParams()) for c in contexts]
    batch = DecodeBatch(target)
    batch.join(rows[0]), batch.join(rows[1])
    plan = [2 * WINDOW, 1, 2 * WINDOW]  # steps; the third request joins after the first two, the first leaves
    for _ in range(plan[0]):
        batch.step()
    batch.join(rows[2])
    for _ in range(plan[1] + plan[2]):
        batch.step()
    batch.leave([rows[0]])
    for _ in range(WINDOW):
        batch.step()
    batch.leave([rows[1], rows[2]])
    assert not batch.rows and batch.cache is None

    for context, row in zip(contexts, rows):
        decoded = row.state.processed[len(context) - 1 :] + [row.anchor]
        assert len(decoded) > 2 * WINDOW
        alone = prefilled(target, context)
        for token, following in zip(decoded, decoded[1:]):  # each token's forward gives the next one
            hidden, _ = target.forward(target.tokens([token]), alone.cache, False)
            assert mx.argmax(target.head(hidden)[0]).item() == following
        target.forward(target.tokens([row.anchor]), alone.cache, False)  # the step queued ahead ...
        target.trim(alone.cache, 1)  # ... undone when it left
        for got, expected in zip(row.state.cache, alone.cache):
            assert type(got) is type(expected) and got.offset == expected.offset
            for a, b in zip(held(got), held(expected)):
                assert a.shape == b.shape and mx.allclose(a, b, rtol=1e-5, atol=1e-5).item()


def held(cache) -> tuple[mx.array, mx.array]:
    """The keys and values a layer's cache holds."""
    if isinstance(cache, WindowedKVCache):
        return cache.state
    return cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]


@pytest.fixture(scope="module")
def muse_worker(muse_pair):
    w = make_worker(muse_pair)
    yield w
    w.close(timeout=10)


def submit_in_turn(worker, prompts, deltas: int = 8, **settings) -> list[queue.Queue]:
    """Each request submitted once the one before it has streamed `deltas` pieces of text: they join a lone
    request, then a running batch, at different lengths."""
    queues = []
    for prompt in prompts:
        if queues:
            deadline = time.monotonic() + slow_machine_timeout(deltas)
            while queues[-1].qsize() < deltas:
                assert time.monotonic() < deadline, "the request before did not start"
                time.sleep(0.005)
        queues.append(submit(worker, prompt, **settings))
    return queues


def test_muse_requests_joining_at_different_times_decode_together_and_equal_their_solo_outputs(muse_worker, muse_pair):
    assert batch_support(muse_pair.target) is None and muse_worker.can_batch
    results = [collect(q) for q in submit_in_turn(muse_worker, MUSE_PROMPTS, max_tokens=200, block_size=4)]
    m = idle(muse_worker)
    for prompt, (text, done) in zip(MUSE_PROMPTS, results):
        ref = solo(muse_pair, prompt, max_tokens=200, speculative=False)  # the target's greedy tokens, quicker
        assert len(ref.token_ids) == 200  # 25 windows
        assert_equal_or_tie(muse_pair, prompt, ref.token_ids, done.token_ids, len(MUSE_PROMPTS))
        if done.token_ids == ref.token_ids:
            assert text == ref.text
        assert done.batched_tokens > 2 * WINDOW and done.batch_size > 1
    assert max(done.batch_size for _, done in results) == len(MUSE_PROMPTS)
    assert m['glimmer_batched_steps_total{batch_size="4"}'] > 0 and m["glimmer_batching_supported"] == 1
    last = results[-1][1]  # it joined last: once the others were done, it went back to speculative decoding
    widths = last.stats.verify_widths  # batched steps verify 1 token, speculative rounds 4 (block 4)
    start = widths.index(1)
    assert widths[start : start + last.batched_tokens] == [1] * last.batched_tokens
    assert 4 in widths[start + last.batched_tokens :]

    # Follow-ups, sent together: each takes its conversation from the prefix cache (its drafter context too),
    # prefills only what it adds, and gives a cold start's tokens.
    hits = metrics(muse_worker)["glimmer_prefix_cache_hits_total"]
    follow = [p + d.token_ids + list(b" And?") for p, (_, d) in zip(MUSE_PROMPTS, results)]
    seconds = together(muse_worker, follow, max_tokens=16, block_size=4)
    assert metrics(muse_worker)["glimmer_prefix_cache_hits_total"] - hits >= len(follow)
    for prompt, (_, d) in zip(follow, seconds):
        assert d.stats.prefill_tokens <= len(b" And?") + 1 and d.batched_tokens > 0
        ref = solo(muse_pair, prompt, max_tokens=16, speculative=False)
        assert_equal_or_tie(muse_pair, prompt, ref.token_ids, d.token_ids, len(follow))
    assert_cached_drafter_followed(muse_worker, muse_pair, follow[0])


# ---- the demo pair through `mlx-glimmer serve` --------------------------------------------------------------


def post(server: ServeProcess, body: dict) -> dict:
    import httpx2 as httpx

    timeout = slow_machine_timeout(body["max_tokens"], requests=DEMO_MAX_BATCH)  # the others may go first
    r = httpx.post(server.url + "/chat/completions", json=body, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


TOPICS = ("the moon", "bread", "volcanoes", "chess")


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def demo(demo_bundle, demo_server, demo_pair):
    assert DEMO_MAX_BATCH == len(TOPICS)  # conftest's demo server (shared with test_server.py) batches 4 at most
    return demo_bundle, demo_server, demo_pair


def shared_steps(metrics: dict[str, float]) -> float:
    """Batched steps of two rows or more, over every batch size the server reports."""
    prefix = 'glimmer_batched_steps_total{batch_size="'
    return sum(v for k, v in metrics.items() if k.startswith(prefix) and int(k[len(prefix) : -2]) > 1)


@pytest.mark.network
def test_demo_concurrent_clients_are_batched_and_equal_solo_greedy(demo):
    bundle, server, pair = demo
    before = shared_steps(server.metrics())
    messages = [ask(f"Tell me something interesting about {t}.") for t in TOPICS]
    body = {"model": "demo", "max_tokens": 32, "temperature": 0}
    with ThreadPoolExecutor(len(messages)) as pool:
        replies = list(pool.map(lambda m: post(server, {**body, "messages": m}), messages))
    # Steps that several of them shared. Which replies took part follows when each request arrived: a client
    # thread that a busy machine starts late joins a batch under way, or finds the others done and runs alone.
    assert shared_steps(server.metrics()) > before
    assert sum(r["glimmer"]["batched_tokens"] > 0 for r in replies) >= 2
    for m, reply in zip(messages, replies):
        ref = mlx_glimmer.generate(pair, m, max_tokens=32, speculative=False)  # solo greedy: the target's, quicker
        stats = reply["glimmer"]
        assert (stats["batched_tokens"] > 0) == (stats["batch_size"] > 1)
        text = reply["choices"][0]["message"]["content"]
        if text != ref.text:  # parted at a tie? (the reply's tokens, as its text encodes them)
            tokens = list(pair.tokenizer.encode(text, add_special_tokens=False))
            assert_equal_or_tie(pair, encode_prompt(pair.tokenizer, m), ref.token_ids, tokens, len(messages))


@pytest.mark.network
def test_demo_lone_request_is_speculative_and_equals_generate_chat(demo, capsys):
    from mlx_glimmer import cli

    bundle, server, _ = demo
    story = "Write a short story about a robot who learns to paint."
    assert cli.main(["generate", str(bundle), "--chat", "--prompt", story, "--max-tokens", "32", "--json"]) == 0
    expected = json.loads(capsys.readouterr().out)
    reply = post(server, {"model": "demo", "max_tokens": 32, "temperature": 0, "messages": ask(story)})
    assert reply["choices"][0]["message"]["content"] == expected["text"]
    stats = reply["glimmer"]
    assert stats["batched_tokens"] == 0 and stats["batch_size"] == 1 and stats["drafter"] == "dflash"
