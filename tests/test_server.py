"""`mlx-glimmer serve` as a client sees it: a real server process on loopback, the official `openai` client.

The server serves the embedded demo pair (SmolLM2-135M-Instruct + our DFlash
drafter, real text and a real chat template); building it needs PyPI once,
hence `network`. Answers are short (48 tokens where the acceptance criteria say so, fewer
elsewhere) to keep the module quick on a 2-core CPU.
"""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import httpx2 as httpx
import pytest

openai = pytest.importorskip("openai")

from serving import DEMO_MAX_QUEUE  # noqa: E402
from slow_machine import slow_machine_timeout  # noqa: E402

import mlx_glimmer  # noqa: E402
from mlx_glimmer import cli  # noqa: E402

pytestmark = pytest.mark.network

STORY = "Write a short story about a robot who learns to paint."


@pytest.fixture(scope="module")
def bundle(demo_bundle):
    return demo_bundle


@pytest.fixture(scope="module")
def server(demo_server):
    return demo_server  # conftest: the demo pair's server, shared with test_server_batch.py


@pytest.fixture(scope="module")
def pair(demo_pair):
    return demo_pair


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def glimmer(response) -> dict:
    return response.model_extra["glimmer"]


def test_models_health_and_metrics(server):
    client = server.client(0)
    assert [m.id for m in client.models.list().data] == ["demo"]
    assert client.models.retrieve("demo").id == "demo"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")
    assert httpx.get(server.root + "/health", timeout=slow_machine_timeout()).json()["status"] == "ok"
    m = server.metrics()
    for name in (
        "glimmer_queue_depth",
        "glimmer_mean_acceptance",
        "glimmer_prefix_cache_hits_total",
        "glimmer_decode_tokens_per_second",
        "glimmer_active_memory_bytes",
    ):
        assert name in m


def test_greedy_answer_equals_generate_chat_streamed_and_not(server, bundle, capsys):
    assert cli.main(["generate", str(bundle), "--chat", "--prompt", STORY, "--max-tokens", "48", "--json"]) == 0
    expected = json.loads(capsys.readouterr().out)
    assert expected["generated_tokens"] == 48

    client = server.client(48)
    whole = client.chat.completions.create(model="demo", messages=ask(STORY), max_tokens=48, temperature=0)
    assert whole.choices[0].message.content == expected["text"]
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 48 and whole.usage.prompt_tokens == expected["prompt_tokens"]
    stats = glimmer(whole)
    assert stats["drafter"] == "dflash" and stats["target_forwards"] >= 1 and stats["mean_acceptance"] >= 1

    stream = client.chat.completions.create(
        model="demo",
        messages=ask(STORY),
        max_tokens=48,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected["text"]
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # really streamed
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 48


def test_follow_up_turn_prefills_under_half_its_prompt_and_equals_a_cold_start(server, pair):
    client = server.client(16)
    messages = ask("Name three colours of the rainbow.")
    first = client.chat.completions.create(model="demo", messages=messages, max_tokens=16, temperature=0)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And one more?"},
    ]
    second = client.chat.completions.create(model="demo", messages=messages, max_tokens=16, temperature=0)
    stats = glimmer(second)
    assert stats["prefill_tokens"] < 0.5 * second.usage.prompt_tokens
    assert stats["reused_tokens"] == second.usage.prompt_tokens - stats["prefill_tokens"]
    assert second.usage.prompt_tokens_details.cached_tokens == stats["reused_tokens"]
    assert second.choices[0].message.content == mlx_glimmer.generate(pair, messages, max_tokens=16).text


def continued(pair, prompt: str, tokens: list[int]) -> str:
    """What `tokens` add to `prompt`'s text, as the tokenizer reads them together (a completion's text)."""
    ids = list(pair.tokenizer.encode(prompt))
    return pair.tokenizer.decode(ids + tokens)[len(pair.tokenizer.decode(ids)) :]


def test_completions_endpoint_and_request_fields(server, pair):
    client = server.client(10)
    prompt = "The three primary colours are"
    expected = continued(pair, prompt, mlx_glimmer.generate(pair, prompt, max_tokens=10).token_ids)
    whole = client.completions.create(model="demo", prompt=prompt, max_tokens=10, temperature=0)
    assert whole.choices[0].text == expected
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model="demo", prompt=prompt, max_tokens=10, temperature=0, stream=True)
        if c.choices
    )
    assert streamed == expected

    plain = client.completions.create(model="demo", prompt=prompt, max_tokens=10, extra_body={"speculative": False})
    assert plain.choices[0].text == expected and glimmer(plain)["drafter"] == "none"
    small = client.completions.create(model="demo", prompt=prompt, max_tokens=10, extra_body={"block_size": 4})
    assert small.choices[0].text == expected and glimmer(small)["block_size"] == 4

    stop = expected.strip().split()[2]
    cut = client.completions.create(model="demo", prompt=prompt, max_tokens=10, stop=[stop])
    assert cut.choices[0].text == expected[: expected.index(stop)] and cut.choices[0].finish_reason == "stop"

    # A seed repeats a sample at a fixed width (under "auto" the widths follow timings, and so may the sample).
    sampled = [
        client.completions.create(
            model="demo", prompt=prompt, max_tokens=8, temperature=0.9, top_p=0.9, seed=11, extra_body={"block_size": 4}
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    reference = mlx_glimmer.generate(pair, prompt, max_tokens=8, temperature=0.9, top_p=0.9, seed=11, block_size=4)
    assert sampled[0] == sampled[1] == continued(pair, prompt, reference.token_ids)


def conversation(server, index: int) -> list[str]:
    client = server.client(4, requests=9)  # behind the other clients' turns and the dropped stream
    messages = ask(f"Give me one fact about the number {index + 2}.")
    answers = []
    for turn in range(3):
        r = client.chat.completions.create(model="demo", messages=messages, max_tokens=4, temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
        answers.append(r.choices[0].message.content)
        messages += [{"role": "assistant", "content": answers[-1]}, {"role": "user", "content": "Another one?"}]
    return answers


def drop_mid_stream(server) -> int:
    """Start a long stream, read a little of it, hang up; returns the chunks read."""
    stream = server.client(400).chat.completions.create(model="demo", messages=ask(STORY), max_tokens=400, stream=True)
    read = 0
    for chunk in stream:
        read += 1
        if read == 3:
            break
    stream.close()
    return read


def test_eight_clients_three_turns_each_while_another_drops_mid_stream(server):
    before = server.metrics()
    with ThreadPoolExecutor(9) as pool:
        dropped = pool.submit(drop_mid_stream, server)
        results = list(pool.map(lambda i: conversation(server, i), range(8)))
        assert dropped.result() == 3
    assert len(results) == 8 and all(len(a) == 3 and all(a) for a in results)
    # The same questions asked again, one at a time, give the same greedy answers.
    assert conversation(server, 5) == results[5]
    after = server.metrics()
    assert after['glimmer_requests_total{finish_reason="cancelled"}'] >= 1
    assert after["glimmer_prefix_cache_hits_total"] - before["glimmer_prefix_cache_hits_total"] >= 16  # turns 2 and 3
    assert after["glimmer_queue_depth"] == 0
    assert 0 < after["glimmer_prefix_cache_bytes"] <= after["glimmer_prefix_cache_max_bytes"]


def test_a_dropped_stream_stops_within_a_round_and_the_next_request_is_served(server):
    before = server.metrics()
    assert drop_mid_stream(server) == 3
    deadline = time.monotonic() + slow_machine_timeout(16)  # the round in flight ends, and the stream with it
    key = 'glimmer_requests_total{finish_reason="cancelled"}'
    while server.metrics().get(key, 0) == before.get(key, 0):
        assert time.monotonic() < deadline, "the dropped stream was not cancelled"
        time.sleep(0.2)
    generated = server.metrics()["glimmer_generated_tokens_total"] - before["glimmer_generated_tokens_total"]
    assert generated <= 3 * 16  # the chunks read, plus at most a round or two of 16-token blocks; far from 400
    r = server.client(4).chat.completions.create(model="demo", messages=ask("Say hi."), max_tokens=4)
    assert r.choices[0].message.content


def test_a_full_queue_answers_503_with_retry_after(server):
    stream = server.client(400).chat.completions.create(model="demo", messages=ask(STORY), max_tokens=400, stream=True)
    next(iter(stream))  # the model is busy with this one
    body = {"model": "demo", "messages": ask("Say hi."), "max_tokens": 1}
    timeout = slow_machine_timeout(1, requests=DEMO_MAX_QUEUE + 1)  # the queue ahead of one of them
    with ThreadPoolExecutor(DEMO_MAX_QUEUE + 4) as pool:
        futures = [
            pool.submit(httpx.post, server.url + "/chat/completions", json=body, timeout=timeout)
            for _ in range(DEMO_MAX_QUEUE + 4)
        ]
        for done in as_completed(futures, timeout):
            if done.result().status_code == 503:  # the queue is full
                break
        stream.close()
        responses = [f.result() for f in futures]
    refused = [r for r in responses if r.status_code == 503]
    assert refused and all(int(r.headers["retry-after"]) >= 1 for r in refused)
    assert all(r.json()["error"]["code"] == "overloaded" for r in refused)
    assert all(r.status_code == 200 for r in responses if r.status_code != 503)
    assert sum(r.status_code == 200 for r in responses) >= DEMO_MAX_QUEUE - 1


LONG = "word " * 9000  # more tokens than the demo's 8192-token context

BAD_REQUESTS = [
    ("malformed JSON", b'{"model": "demo", "messages": [', 400, None),
    ("body not an object", b"[1, 2]", 400, None),
    ("missing messages", {"model": "demo"}, 400, "messages"),
    ("empty messages", {"model": "demo", "messages": []}, 400, "messages"),
    ("messages of the wrong type", {"model": "demo", "messages": "hello"}, 400, "messages"),
    ("message that is not an object", {"model": "demo", "messages": ["hello"]}, 400, "messages.0"),
    ("message without a role", {"model": "demo", "messages": [{"content": "hi"}]}, 400, "messages.0.role"),
    ("user message without content", {"model": "demo", "messages": [{"role": "user"}]}, 400, "messages.0.content"),
    ("unknown role", {"model": "demo", "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    (
        "image content",
        {
            "model": "demo",
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
        },
        400,
        "messages.0.content",
    ),
    ("negative max_tokens", {"model": "demo", "messages": ask("hi"), "max_tokens": -5}, 400, "max_tokens"),
    ("non-numeric temperature", {"model": "demo", "messages": ask("hi"), "temperature": "hot"}, 400, "temperature"),
    ("top_p out of range", {"model": "demo", "messages": ask("hi"), "top_p": 0}, 400, "top_p"),
    ("negative seed", {"model": "demo", "messages": ask("hi"), "seed": -1}, 400, "seed"),
    ("zero block_size", {"model": "demo", "messages": ask("hi"), "block_size": 0}, 400, "block_size"),
    ("unknown model", {"model": "gpt-17", "messages": ask("hi")}, 404, "model"),
    ("n > 1", {"model": "demo", "messages": ask("hi"), "n": 2}, 400, "n"),
    (
        "tools",
        {"model": "demo", "messages": ask("hi"), "tools": [{"type": "function", "function": {"name": "f"}}]},
        400,
        "tools",
    ),
    (
        "top_logprobs past 20",
        {"model": "demo", "messages": ask("hi"), "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
    ),
    ("five stop strings", {"model": "demo", "messages": ask("hi"), "stop": list("abcde")}, 400, "stop"),
    ("prompt over the context", {"model": "demo", "messages": ask(LONG)}, 400, "messages"),
    ("max_tokens past the context", {"model": "demo", "messages": ask("hi"), "max_tokens": 9000}, 400, "max_tokens"),
]


@pytest.mark.parametrize("what, body, status, param", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_get_an_openai_error_and_the_server_stays_up(server, what, body, status, param):
    kwargs = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    for stream in (False, True):
        if stream and isinstance(body, dict):
            body = {**body, "stream": True}
            kwargs = {"json": body}
        r = httpx.post(server.url + "/chat/completions", timeout=slow_machine_timeout(), **kwargs)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert error["message"] and error["type"] == "invalid_request_error"
        if param is not None:
            assert error["param"] == param or error["param"].startswith(param), error
        if "context" in what:
            assert error["code"] == "context_length_exceeded"
        if what == "tools":  # SmolLM2's template has no tool format
            assert error["code"] == "tools_not_supported" and "no tool-call format" in error["message"]
    assert httpx.get(server.root + "/health", timeout=slow_machine_timeout()).json()["status"] == "ok"


def test_bad_completions_and_routes(server):
    for body, param in [
        ({"model": "demo"}, "prompt"),
        ({"model": "demo", "prompt": ""}, "prompt"),
        ({"model": "demo", "prompt": ["a", "b"]}, "prompt"),
        ({"model": "demo", "prompt": [10**9]}, "prompt"),
        ({"model": "demo", "prompt": "hi", "logprobs": 21}, "logprobs"),
    ]:
        r = httpx.post(server.url + "/completions", json=body, timeout=slow_machine_timeout())
        assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), r.text
    huge = httpx.post(
        server.url + "/chat/completions",
        json={"model": "demo", "messages": ask("x" * 2**21)},
        timeout=slow_machine_timeout(),
    )
    assert huge.status_code == 413 and huge.json()["error"]["message"]
    assert httpx.get(server.url + "/nowhere", timeout=slow_machine_timeout()).status_code == 404
    assert httpx.get(server.url + "/chat/completions", timeout=slow_machine_timeout()).status_code == 405
    with pytest.raises(openai.BadRequestError):
        server.client(4).chat.completions.create(model="demo", messages=[], max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        server.client(4).chat.completions.create(model="nope", messages=ask("hi"), max_tokens=4)


def test_serve_flag_errors_are_one_line(capsys):
    assert cli.main(["serve", "--port", "70000"]) == 2
    assert cli.main(["serve", "--prompt-cache-bytes", "lots"]) == 2
    assert cli.main(["serve", "/no/such/bundle", "--port", "0"]) == 2
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert cli.main(["serve", "--port", str(taken.getsockname()[1])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all(line.startswith("error:") for line in err), err
    assert "Address already in use" in err[-1] or "in use" in err[-1]
