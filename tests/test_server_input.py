"""Every malformed or unsupported client input gets an OpenAI-style 4xx body, never a 500.

The app runs in-process under FastAPI's TestClient, on the tiny random Muse checkpoint and its assistant
drafter (its chat template is the real code path; its text is noise). First a table: the issue's examples and
the other cases found (one test each), with the status and the `param` each gets. Then a property: request
bodies drawn by hypothesis for both endpoints (valid fields, wild values of every JSON type, lone surrogates,
non-objects, deep nesting) get 200 or a 4xx with an error body, within a time bound, and nothing reaches the
log as a traceback or an internal error.
"""

from __future__ import annotations

import json
import time

import pytest

hypothesis = pytest.importorskip("hypothesis")
from fastapi.testclient import TestClient  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from slow_machine import slow_machine_timeout  # noqa: E402

import mlx_glimmer  # noqa: E402
from mlx_glimmer.generate import GenerationStats  # noqa: E402
from mlx_glimmer.server.app import ServerState, create_app, model_context  # noqa: E402
from mlx_glimmer.server.metrics import ServerMetrics, metrics_text  # noqa: E402
from mlx_glimmer.server.protocol import (  # noqa: E402
    RESERVED_TEMPLATE_KWARGS,
    ChatCompletionRequest,
    CompletionRequest,
    parse,
    request_settings,
)
from mlx_glimmer.server.worker import GenerationWorker  # noqa: E402
from mlx_glimmer.settings import GenerationSettings  # noqa: E402

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
ASK = [{"role": "user", "content": "hi"}]
TIME_BOUND_S = slow_machine_timeout(8)  # one request, max_tokens at most 8: a watchdog, not a speed bound


@pytest.fixture(scope="module")
def client(checkpoints):
    pair = mlx_glimmer.load(target=checkpoints["muse"], drafter=checkpoints["assistant"])
    worker = GenerationWorker(lambda: pair, max_queue=8, prompt_cache_bytes=1 << 26)
    worker.start()
    server = ServerState(worker, "tiny", GenerationSettings(max_tokens=4), model_context(pair))
    with TestClient(create_app(server), raise_server_exceptions=False) as c:
        yield c
    worker.close(timeout=5)


def post(client, path: str, body, content_type: str = "application/json"):
    """POST `body` (JSON-encoded unless it is bytes or str already); lone surrogates go out as `\\ud800` escapes."""
    data = body if isinstance(body, bytes) else (body if isinstance(body, str) else json.dumps(body)).encode()
    start = time.monotonic()
    r = client.post(path, content=data, headers={"content-type": content_type})
    return r, time.monotonic() - start


def assert_contract(r, elapsed: float) -> None:
    assert elapsed < TIME_BOUND_S, f"took {elapsed:.1f} s"
    if r.status_code == 200:
        if r.headers["content-type"].startswith("text/event-stream"):
            events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            assert not any('"server_error"' in e for e in events), r.text
        else:
            assert "choices" in r.json()
        return
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    error = r.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error" and set(error) == {"message", "type", "param", "code"}


def chat(**fields) -> dict:
    return {"model": "tiny", "messages": ASK, "max_tokens": 2, **fields}


KNOWN = [  # (what, path, body, status, param)
    (
        "lone surrogate in content",
        CHAT,
        '{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}',
        400,
        "messages.0.content",
    ),
    (
        "lone surrogate in a text part",
        CHAT,
        '{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udfff"}]}]}',
        400,
        "messages.0.content.0.text",
    ),
    ("lone surrogate in the prompt", COMPLETIONS, '{"prompt": "\\ud800", "max_tokens": 2}', 400, "prompt"),
    (
        "lone surrogate in stop",
        CHAT,
        '{"messages": [{"role": "user", "content": "hi"}], "stop": "\\ud800"}',
        400,
        "stop",
    ),
    (
        "lone surrogate in model",
        CHAT,
        '{"messages": [{"role": "user", "content": "hi"}], "model": "\\ud800"}',
        400,
        "model",
    ),
    ("100k nested [", CHAT, "[" * 100_000, 400, None),
    ("100k nested [ in a field", CHAT, '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}", 400, None),
    ("nesting past 64 levels", CHAT, chat(metadata=json.loads("[" * 80 + "]" * 80)), 400, "metadata"),
    ("max_tokens: true", CHAT, chat(max_tokens=True), 400, "max_tokens"),
    ("max_tokens: 1.0", CHAT, chat(max_tokens=1.0), 400, "max_tokens"),
    ("max_tokens: '2'", CHAT, chat(max_tokens="2"), 400, "max_tokens"),
    ("max_tokens: 0", COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens: 10**30", CHAT, chat(max_tokens=10**30), 400, "max_tokens"),
    ("temperature: true", CHAT, chat(temperature=True), 400, "temperature"),
    (
        "temperature: NaN",
        CHAT,
        '{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
        400,
        "temperature",
    ),
    (
        "temperature: -Infinity",
        CHAT,
        '{"messages": [{"role": "user", "content": "hi"}], "temperature": -Infinity}',
        400,
        "temperature",
    ),
    ("top_k: true", CHAT, chat(top_k=True), 400, "top_k"),
    ("top_k: 2.5", CHAT, chat(top_k=2.5), 400, "top_k"),
    ("seed: true", CHAT, chat(seed=True), 400, "seed"),
    ("seed: 2**70", CHAT, chat(seed=2**70), 400, "seed"),
    ("n: true", CHAT, chat(n=True), 400, "n"),
    ("stream: 1", CHAT, chat(stream=1), 400, "stream"),
    ("stream: 'yes'", CHAT, chat(stream="yes"), 400, "stream"),
    ("speculative: 1", CHAT, chat(speculative=1), 400, "speculative"),
    ("block_size: true", CHAT, chat(block_size=True), 400, "block_size"),
    ("tree: 0", CHAT, chat(tree=0), 400, "tree"),
    ("tree: 64", CHAT, chat(tree=64), 400, "tree"),
    ("tree: 'chain'", CHAT, chat(tree="chain"), 400, "tree"),
    ("tree: true", CHAT, chat(tree=True), 400, "tree"),
    ("tree: 2.0", COMPLETIONS, {"prompt": "hi", "tree": 2.0}, 400, "tree"),
    ("tree: 'AUTO'", COMPLETIONS, {"prompt": "hi", "tree": "AUTO"}, 400, "tree"),
    ("echo: 1", COMPLETIONS, {"prompt": "hi", "echo": 1}, 400, "echo"),
    ("logprobs: 1 in a chat", CHAT, chat(logprobs=1), 400, "logprobs"),
    ("top_logprobs: 21", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("top_logprobs: -1", CHAT, chat(logprobs=True, top_logprobs=-1), 400, "top_logprobs"),
    ("top_logprobs without logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    ("top_logprobs with logprobs: false", CHAT, chat(logprobs=False, top_logprobs=0), 400, "top_logprobs"),
    ("logprobs with n: 2", CHAT, chat(logprobs=True, n=2), 400, "n"),
    ("logprobs: true in a completion", COMPLETIONS, {"prompt": "hi", "logprobs": True}, 400, "logprobs"),
    ("logprobs: 21 in a completion", COMPLETIONS, {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("logprobs: 2.0 in a completion", COMPLETIONS, {"prompt": "hi", "logprobs": 2.0}, 400, "logprobs"),
    ("a token id true", COMPLETIONS, {"prompt": [1, True]}, 400, "prompt"),
    ("a token id past the vocabulary", COMPLETIONS, {"prompt": [2**70]}, 400, "prompt"),
    ("prompt: null", COMPLETIONS, {"prompt": None}, 400, "prompt"),
    ("role: 1", CHAT, chat(messages=[{"role": 1, "content": "x"}]), 400, "messages.0.role"),
    ("unknown role", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages.0.role"),
    ("content: 5", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages.0.content"),
    ("empty messages", CHAT, chat(messages=[]), 400, "messages"),
    ("message: null", CHAT, chat(messages=[None]), 400, "messages.0"),
    ("stream_options: 5", CHAT, chat(stream=True, stream_options=5), 400, "stream_options"),
    (
        "include_usage: 1",
        CHAT,
        chat(stream=True, stream_options={"include_usage": 1}),
        400,
        "stream_options.include_usage",
    ),
    ("chat_template_kwargs a list", CHAT, chat(chat_template_kwargs=[1]), 400, "chat_template_kwargs"),
    ("body null", CHAT, "null", 400, None),
    ("body a list", COMPLETIONS, "[1, 2]", 400, None),
    ("empty body", CHAT, "", 400, None),
    ("invalid UTF-8", COMPLETIONS, b'{"prompt": "\xff"}', 400, None),
] + [
    (
        f"chat_template_kwargs {{{key!r}: ...}}",
        CHAT,
        chat(chat_template_kwargs={key: value}),
        400,
        "chat_template_kwargs",
    )
    for key, value in [
        ("add_generation_prompt", False),
        ("tokenize", True),
        ("messages", []),
        ("tools", 5),
        ("conversation", 5),
        ("continue_final_message", True),
        ("return_dict", True),
        ("chat_template", "{{ x"),
        ("bos_token", ""),
    ]
]


@pytest.mark.parametrize("what, path, body, status, param", KNOWN, ids=[k[0] for k in KNOWN])
def test_known_bad_input_gets_a_4xx_naming_the_field(client, capfd, what, path, body, status, param):
    r, elapsed = post(client, path, body)
    assert r.status_code == status, r.text
    assert_contract(r, elapsed)
    if param is not None:
        assert r.json()["error"]["param"] == param, r.json()
    out, err = capfd.readouterr()
    assert "Traceback" not in err and "internal error" not in err, err


def test_a_bad_tree_is_a_400_that_says_what_it_takes(client):
    r, _ = post(client, CHAT, chat(tree="wide"))
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "tree: must be 'auto', 'off' or a whole number in [1, 63], got 'wide'"


def test_a_request_without_tree_takes_the_servers_and_one_with_it_its_own():
    server = GenerationSettings(max_tokens=4, tree="off")  # serve --tree off
    for model, body in ((ChatCompletionRequest, {"messages": ASK}), (CompletionRequest, {"prompt": "hi"})):
        assert request_settings(parse(model, body), server, 3, None)[0].tree == "off"
        for tree in ("auto", 7):
            assert request_settings(parse(model, {**body, "tree": tree}), server, 3, None)[0].tree == tree


DISAGREEING = [
    (chat(tree=63, block_size=1), ("block_size", "tree"), "block_size 1 and tree 63 disagree"),
    ({"prompt": "hi", "max_tokens": 2, "tree": 7, "block_size": 4}, ("block_size", "tree"), "block_size 4 and tree 7"),
    (chat(speculative=False, tree=7), ("speculative", "tree"), "speculative false and tree 7 disagree"),
    (chat(speculative=False, block_size=4), ("speculative", "block_size"), "speculative false and block_size 4"),
]


@pytest.mark.parametrize("body, fields, says", DISAGREEING, ids=[d[2] for d in DISAGREEING])
def test_request_fields_that_disagree_are_a_400_naming_both(client, body, fields, says):
    r, elapsed = post(client, COMPLETIONS if "prompt" in body else CHAT, body)
    assert r.status_code == 400, r.text
    assert_contract(r, elapsed)
    error = r.json()["error"]
    assert says in error["message"] and all(f in error["message"] for f in fields), error
    assert error["param"] == fields[0]


def test_a_tree_verifies_its_own_width_and_reports_it(client):
    """A tree of N nodes with block_size auto: every round verifies at most N + 1 tokens, as the answer says."""
    r, _ = post(client, CHAT, chat(tree=3, max_tokens=8))
    assert r.status_code == 200, r.text
    assert r.json()["glimmer"]["block_size"] == 4


def test_a_requests_fixed_tree_or_block_size_wins_over_the_servers_other_one():
    """`serve --block-size 4` and a request's `tree: 7` (or `serve --tree 7` and `block_size: 4`): the request's
    field wins and the server's disagreeing default goes back to auto, so the answer reports what ran."""
    for server, field, value, other in (
        (GenerationSettings(max_tokens=4, block_size=4), "tree", 7, "block_size"),
        (GenerationSettings(max_tokens=4, tree=7), "block_size", 4, "tree"),
    ):
        for model, body in ((ChatCompletionRequest, {"messages": ASK}), (CompletionRequest, {"prompt": "hi"})):
            settings = request_settings(parse(model, {**body, field: value}), server, 3, None)[0]
            assert getattr(settings, field) == value and getattr(settings, other) == "auto"
    fine = request_settings(parse(CompletionRequest, {"prompt": "hi", "tree": "off", "block_size": 4}), server, 3, None)
    assert (fine[0].block_size, fine[0].tree) == (4, "off")


def test_metrics_count_tokens_verified_tree_rounds_and_accepted_path_sources(client):
    names = {line.split()[2] for line in client.get("/metrics").text.splitlines() if line.startswith("# TYPE")}
    assert {"glimmer_tokens_verified_total", "glimmer_tree_rounds_total", "glimmer_accepted_path_rounds_total"} <= names

    m = ServerMetrics()
    for sources in ({"model": 3, "lookup": 1}, {"model": 1, "both": 2}):
        stats = GenerationStats(target_forwards=4, tokens_verified=20, tree_rounds=3, accepted_from=sources)
        m.record(stats, "stop", 0.0)
    text = metrics_text(m, queue_depth=0, busy=False, prompt_cache_max_bytes=1, uptime_s=1.0)
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and line[0] != "#")
    assert samples["glimmer_tokens_verified_total"] == "40" and samples["glimmer_tree_rounds_total"] == "6"
    assert samples['glimmer_accepted_path_rounds_total{source="model"}'] == "4"
    assert samples['glimmer_accepted_path_rounds_total{source="lookup"}'] == "1"
    assert samples['glimmer_accepted_path_rounds_total{source="both"}'] == "2"


def test_a_non_json_content_type_gets_415_and_json_ones_are_served(client):
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        r, _ = post(client, CHAT, chat(), content_type=kind)
        assert r.status_code == 415 and r.json()["error"]["type"] == "invalid_request_error", r.text
    for kind in ("application/json", "application/json; charset=utf-8", "application/vnd.api+json", ""):
        r, _ = post(client, CHAT, chat(), content_type=kind)
        assert r.status_code == 200, (kind, r.text)


def test_template_variables_that_are_not_reserved_pass_through(client):
    assert {"add_generation_prompt", "tokenize", "messages", "tools"} <= RESERVED_TEMPLATE_KWARGS
    plain, _ = post(client, CHAT, chat())
    varied, _ = post(client, CHAT, chat(chat_template_kwargs={"reasoning_strength": "low", "enable_thinking": False}))
    assert plain.status_code == varied.status_code == 200
    assert (
        varied.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"]
    )  # the template reads neither


# ---- the property ----------------------------------------------------------------------------------------

SURROGATES = st.sampled_from(["\ud800", "a\udfffb", "\udbff\udbff"])
TEXT = st.one_of(st.text(max_size=12), SURROGATES, st.sampled_from(["", "hi", "\x00", "auto", "tiny", "text"]))
INTS = st.one_of(st.integers(-5, 8), st.sampled_from([2**31, 2**63, 2**64, 2**70, 10**30, -(2**70)]))
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 0.5, 1.0, 1.5]))
SCALARS = st.one_of(st.none(), st.booleans(), INTS, FLOATS, TEXT)
WILD = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(TEXT, inner, max_size=3)),
    max_leaves=8,
)
ROLES = st.sampled_from(["system", "developer", "user", "assistant", "tool", "wizard", "", "USER"])
PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
    st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_audio", "text"])}),
    WILD,
)
MESSAGE = st.one_of(
    st.fixed_dictionaries(
        {"role": ROLES, "content": st.one_of(TEXT, st.lists(PART, max_size=2), WILD)},
        optional={
            "name": st.one_of(TEXT, WILD),
            "tool_call_id": st.one_of(TEXT, WILD),
            "tool_calls": WILD,
            "reasoning_content": st.one_of(TEXT, WILD),
        },
    ),
    WILD,
)


PLAIN_TEXT = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12)


def field(valid, odd=None):
    """A field's plausible value: mostly a valid one, now and then an `odd` one (out of range, say)."""
    return valid if odd is None else st.one_of(*[valid] * 7, odd)


COMMON = {
    "model": field(st.sampled_from(["tiny", "default", ""]), st.sampled_from(["gpt-4o", "\ud800"])),
    "max_tokens": field(st.integers(1, 8), st.integers(-2, 0)),
    "temperature": field(st.one_of(st.just(0), st.floats(0, 2)), FLOATS),
    "top_p": field(st.floats(0.05, 1), st.floats(-1, 2)),
    "top_k": field(st.integers(0, 50), INTS),
    "seed": field(st.integers(0, 2**32), INTS),
    "stop": field(st.one_of(PLAIN_TEXT, st.lists(PLAIN_TEXT, max_size=4)), st.lists(TEXT, max_size=6)),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "n": field(st.just(1), st.integers(0, 3)),
    "speculative": st.booleans(),
    "block_size": field(st.one_of(st.integers(1, 16), st.just("auto")), st.integers(-1, 300)),
    "tree": field(st.sampled_from(["auto", "off"]), st.sampled_from([0, 64, -1, "chain", True, 2.5, [4]])),
    "presence_penalty": field(st.just(0), FLOATS),
    "user": PLAIN_TEXT,
}
CHAT_FIELDS = {
    **COMMON,
    "logprobs": field(st.booleans(), INTS),
    "top_logprobs": field(st.integers(0, 20), INTS),
    "max_completion_tokens": field(st.integers(1, 8), st.integers(-2, 0)),
    "tool_choice": st.sampled_from(["auto", "none", "required"]),
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
    "reasoning_effort": field(st.sampled_from(["low", "medium", "high"]), st.just("max")),
    "chat_template_kwargs": st.dictionaries(
        field(
            st.sampled_from(["enable_thinking", "reasoning_strength"]),
            st.sampled_from(sorted(RESERVED_TEMPLATE_KWARGS)),
        ),
        WILD,
        max_size=2,
    ),
}
COMPLETION_FIELDS = {
    **COMMON,
    "logprobs": field(st.integers(0, 5), st.one_of(INTS, st.booleans())),
    "echo": field(st.just(False), st.booleans()),
    "suffix": field(st.just(""), TEXT),
    "best_of": field(st.just(1), st.integers(0, 2)),
}
MESSAGES = field(
    st.lists(
        st.fixed_dictionaries({"role": st.sampled_from(["system", "user"]), "content": PLAIN_TEXT}),
        min_size=1,
        max_size=3,
    ).map(lambda ms: [*ms, {"role": "user", "content": "hi"}]),
    st.one_of(st.lists(MESSAGE, max_size=3), WILD),
)
PROMPT = field(
    st.one_of(PLAIN_TEXT, st.lists(st.integers(0, 255), min_size=1, max_size=4)),
    st.one_of(TEXT, st.lists(st.integers(-1, 300), max_size=4), st.lists(TEXT, max_size=2), WILD),
)


def bodies(required: dict, optional: dict):
    """Plausible bodies, and the same with one field (named or not) set to anything JSON can hold."""
    plausible = st.fixed_dictionaries(required, optional=optional)
    names = sorted({*required, *optional, "logit_bias", "tools", "metadata"})
    broken = st.tuples(plausible, st.one_of(st.sampled_from(names), TEXT), WILD).map(lambda t: {**t[0], t[1]: t[2]})
    return st.one_of(plausible, broken).map(json.dumps)


BODIES = st.one_of(  # (path, the body as JSON text)
    st.tuples(st.just(CHAT), bodies({"messages": MESSAGES}, CHAT_FIELDS)),
    st.tuples(st.just(COMPLETIONS), bodies({"prompt": PROMPT}, COMPLETION_FIELDS)),
    st.tuples(st.sampled_from([CHAT, COMPLETIONS]), WILD.map(json.dumps)),  # not an object, or an object of anything
    st.tuples(
        st.sampled_from([CHAT, COMPLETIONS]), st.integers(1, 3000).map(lambda n: "[" * n + "]" * n)
    ),  # nesting, past Python's recursion limit too
)


def test_drawn_request_bodies_get_200_or_an_openai_4xx(client, capfd):
    @settings(
        max_examples=250,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(BODIES)
    def check(drawn):
        path, body = drawn
        r, elapsed = post(client, path, body)
        assert_contract(r, elapsed)

    check()  # each request within TIME_BOUND_S (assert_contract)
    out, err = capfd.readouterr()
    assert "Traceback" not in err and "internal error" not in err, err
