"""Concurrent requests decoded together (server/batch.py): outputs equal solo ones, a lone request stays
speculative, the prefix cache keeps working, `/metrics` shows the batch size.

Most tests run the generation worker in-process on the tiny random llama pair (plain KV caches: it batches)
and the tiny Muse pair (sliding-window caches: it does not); the last ones run `mlx-glimmer serve` on the demo
pair (SmolLM2-135M-Instruct + its DFlash drafter), as a client sees it, hence `network`. Greedy outputs of a
batch may differ from solo ones only at a floating-point tie: a difference is reported with both kernels'
margins (`explain_batched_divergence`) and passes only if it is one.
"""

from __future__ import annotations

import copy
import json
import queue
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import mlx.core as mx
import pytest
from serving import ServeProcess, collect

import mlx_glimmer
from mlx_glimmer import DecodeState, SamplingParams
from mlx_glimmer.divergence import mlx_dtype
from mlx_glimmer.generate import encode_prompt
from mlx_glimmer.server.batch import BatchPolicy, batch_support, explain_batched_divergence
from mlx_glimmer.server.metrics import metrics_text
from mlx_glimmer.server.prompt_cache import Conversation
from mlx_glimmer.server.worker import Delta, Finished, GenerationRequest, GenerationWorker, Job
from mlx_glimmer.settings import BatchSettings, GenerationSettings, SamplingError

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


def idle(worker, timeout: float = 30) -> dict[str, float]:
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
    first = submit(llama_worker, long_prompt, max_tokens=48, block_size=4)
    got = first.get(timeout=300)  # it is decoding alone ...
    assert isinstance(got, Delta)
    others = [submit(llama_worker, p + list(b"!"), max_tokens=8, block_size=4) for p in PROMPTS[2:]]
    text, done = collect(first)
    text = got.text + text
    rest = [collect(q) for q in others]
    ref = solo(llama_pair, long_prompt, max_tokens=48, block_size=4)
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

    # The cached conversation's drafter (a copy of it, so the cached one stays as it is) drafts what a cold
    # drafter that read the same tokens in one prefill drafts.
    cache = llama_worker.prompt_cache
    warm = cache.fork(next(c for c in cache._entries.values() if c.tokens[: len(follow[0])] == follow[0]))
    cold = Conversation(DecodeState(), copy.copy(llama_pair.drafter))
    mlx_glimmer.generate(
        replace(llama_pair, drafter=cold.drafter), warm.tokens, max_tokens=1, block_size=4, state=cold.state
    )
    assert cold.tokens == warm.tokens
    params, key = SamplingParams(temperature=1.0), mx.random.key(0)
    _, warm_probs = warm.drafter.propose(warm.tokens[-1], 3, params, key)
    _, cold_probs = cold.drafter.propose(cold.tokens[-1], 3, params, key)
    assert mx.allclose(warm_probs, cold_probs, atol=1e-4).item()


def test_stop_strings_cancels_and_sampling_inside_a_batch(llama_worker, llama_pair):
    ref = solo(llama_pair, PROMPTS[0], max_tokens=24, block_size=4)
    stop = ref.text[6:9]
    cut = submit(llama_worker, PROMPTS[0], stop=[stop], max_tokens=24, block_size=4)
    dropped = submit(llama_worker, PROMPTS[1], max_tokens=200, block_size=4)
    sampled = submit(llama_worker, PROMPTS[2], max_tokens=16, temperature=0.9, top_p=0.9, seed=3)
    plain = submit(llama_worker, PROMPTS[3], max_tokens=16, speculative=False)
    while not isinstance(dropped.get(timeout=300), Delta):
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


def test_a_difference_is_explained_with_both_kernels_margins(llama_pair):
    prompt = PROMPTS[0]
    ref = solo(llama_pair, prompt, max_tokens=8, block_size=4).token_ids
    other = ref[:3] + [(ref[3] + 1) % llama_pair.target.vocab_size] + ref[4:]
    d = explain_batched_divergence(llama_pair.target, "float32", prompt, ref, other, 4)
    assert d["position"] == 3 and d["tokens"] == [ref[3], other[3]] and not d["tie"]  # not a tie: made up
    assert set(d["kernels"]) == {"step (1 row)", "batched (4 rows)"}
    assert all(k["argmax"] == ref[3] and k["gap"] > k["tolerance"] for k in d["kernels"].values())
    assert explain_batched_divergence(llama_pair.target, "float32", prompt, ref, list(ref), 4) is None


# ---- the tiny Muse pair: sliding-window layers, served one at a time ---------------------------------------


def test_a_sliding_window_target_serves_concurrent_requests_one_at_a_time(muse_pair):
    reason = batch_support(muse_pair.target)
    assert reason is not None and "WindowedKVCache" in reason
    w = make_worker(muse_pair)
    try:
        assert not w.can_batch
        results = together(w, PROMPTS, max_tokens=12, block_size=4)
        m = metrics(w)
    finally:
        w.close(timeout=10)
    for prompt, (text, d) in zip(PROMPTS, results):
        ref = solo(muse_pair, prompt, max_tokens=12, block_size=4)
        assert d.token_ids == ref.token_ids and text == ref.text
        assert d.batched_tokens == 0 and d.batch_size == 1
    assert m["glimmer_batching_supported"] == 0 and m["glimmer_batched_tokens_total"] == 0


# ---- the demo pair through `mlx-glimmer serve` --------------------------------------------------------------


def post(server: ServeProcess, body: dict) -> dict:
    import httpx2 as httpx

    r = httpx.post(server.url + "/chat/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


TOPICS = ("the moon", "bread", "volcanoes", "chess")


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def demo(demo_bundle, demo_pair):
    server = ServeProcess([sys.executable, "-m", "mlx_glimmer.cli", "serve", str(demo_bundle), "--max-batch", "4",
                           "--port", "0"])  # fmt: skip
    yield demo_bundle, server, demo_pair
    server.stop_and_check()


@pytest.mark.network
def test_demo_four_concurrent_clients_are_batched_and_equal_solo_greedy(demo):
    bundle, server, pair = demo
    messages = [ask(f"Tell me something interesting about {t}.") for t in TOPICS]
    body = {"model": "demo", "max_tokens": 32, "temperature": 0}
    seen, running = [], threading.Event()

    def watch():  # the batch size gauge while the clients run
        while not running.is_set():
            seen.append(server.metrics()["glimmer_batch_size"])
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    with ThreadPoolExecutor(len(messages)) as pool:
        replies = list(pool.map(lambda m: post(server, {**body, "messages": m}), messages))
    running.set()
    watcher.join()
    assert max(seen) > 1
    assert server.metrics()['glimmer_batched_steps_total{batch_size="4"}'] > 0
    for m, reply in zip(messages, replies):
        ref = mlx_glimmer.generate(pair, m, max_tokens=32)
        stats = reply["glimmer"]
        assert stats["batched_tokens"] > 0 and stats["batch_size"] > 1
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
