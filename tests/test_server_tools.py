"""Tool calls and reasoning on `mlx-glimmer serve`: a real server process on loopback, the official `openai` client.

The models are the tiny random Muse checkpoint and its assistant drafter, with two chat templates that have a
tool format: a Muse-like one (channel-framed replies, `<atem:function_calls>` calls, `reasoning_strength`) and a
Qwen-like one (`<think>` reasoning, `<tool_call>` JSON calls, `reasoning_effort`). mlx-lm infers the tool parser
from each template. The target's replies are scripted (tests/scripted_serve.py: its logits follow a script chosen
by what the conversation holds), so the reply is a tool call, or reasoning and an answer, deterministically;
the template, the prefix cache, the speculative loop and the server are the real ones.
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path

import httpx2 as httpx
import pytest

openai = pytest.importorskip("openai")

import scripted_serve  # noqa: E402
from serving import ServeProcess  # noqa: E402
from slow_machine import slow_machine_timeout  # noqa: E402

import mlx_glimmer  # noqa: E402
from mlx_glimmer.channels import split_channels  # noqa: E402

HERE = Path(__file__).parent
MARKER = "<|assistant|>"  # the generation prompt of both templates (one special token)

# Muse-like: channel-framed messages, Muse Spark's call format, the reasoning strength variable.
MUSE_TEMPLATE = (
    "{{ bos_token }}<|start|>system<|message|>reasoning: {{ reasoning_strength | default('high') }}"
    "{%- if tools %}\n# Tools{% for t in tools %}\n{{ t.function | tojson }}{% endfor %}{% endif %}<|eom|>"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}<|start|>system<|message|>{{ m.content }}<|eom|>"
    "{%- elif m.role == 'user' %}<|user|>{{ m.content }}<|eom|>"
    "{%- elif m.role == 'tool' %}<|user|>tool {{ m.name }}<|message|>{{ m.content }}<|eom|>"
    "{%- elif m.role == 'assistant' %}<|assistant|>"
    "{%- for c in m.tool_calls or [] %}<|start|>assistant to={{ c.function.name }}<|message|><atem:function_calls>"
    '<atem:invoke name="{{ c.function.name }}">{% for k, v in c.function.arguments.items() %}'
    '<atem:parameter name="{{ k }}">{{ v | tojson }}</atem:parameter>{% endfor %}</atem:invoke>'
    "</atem:function_calls><|eom|>{% endfor %}"
    "{%- if m.content %}<|start|>assistant to=user<|message|>{{ m.content }}<|eot|>{% endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)
MUSE_CALL = (
    "to=self<|message|>The user wants the weather; call the tool.<|eom|>"
    '<|start|>assistant to=get_weather<|message|><atem:function_calls><atem:invoke name="get_weather">'
    '<atem:parameter name="city">"Paris"</atem:parameter><atem:parameter name="days">2</atem:parameter>'
    "</atem:invoke></atem:function_calls><|eom|>"
)
MUSE_ANSWER = (
    "to=self<|message|>The tool says 18 C.<|eom|><|start|>assistant to=user<|message|>It is 18 C in Paris.<|eot|>"
)
MUSE_REASONING = (
    "to=self<|message|>First, add.<|eom|>"
    "<|start|>assistant to=self<|message|>Then check: 2 + 2 = 4.<|eom|>"
    "<|start|>assistant to=user<|message|>The answer is **4**.<|eot|>"
)
MUSE_SCRIPTS = [["tool get_weather<|message|>", MUSE_ANSWER], ["Explain", MUSE_REASONING], ["", MUSE_CALL]]

# Qwen-like: <think> reasoning (single special tokens, as mlx-lm infers them), JSON calls in <tool_call> tags.
THINK_TEMPLATE = (
    "{{ bos_token }}{%- if reasoning_effort is defined %}<|user|>effort: {{ reasoning_effort }}<|eom|>{% endif %}"
    "{%- if tools %}<|user|>tools:{% for t in tools %} {{ t | tojson }}{% endfor %}<|eom|>{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|assistant|>{{ m.content or '' }}"
    "{%- for tool_call in m.tool_calls or [] %}{%- set tool_call = tool_call.function %}"
    '<tool_call>{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}</tool_call>'
    "{%- endfor %}<|eom|>"
    "{%- elif m.role == 'tool' %}<|user|>tool result: {{ m.content }}<|eom|>"
    "{%- else %}<|user|>{{ m.content }}<|eom|>{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)
THINK_CALL = '<think>I should call the tool.</think><tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
THINK_ANSWER = "<think>The tool answered.</think>It is 18 C in Paris."
THINK_REASONING = "<think>Two and two.</think>The answer is 4."
THINK_SCRIPTS = [["tool result:", THINK_ANSWER], ["Explain", THINK_REASONING], ["", THINK_CALL]]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
EXPLAIN = [{"role": "user", "content": "Explain 2 + 2."}]
MAX_TOKENS = 400


def with_template(src: Path, dst: Path, template: str, extra_specials: list[str] = ()) -> Path:
    """A copy of the target at `src` whose tokenizer has `template` (and `extra_specials`)."""
    from transformers import PreTrainedTokenizerFast

    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name == "config.json" or f.name.endswith((".safetensors", ".safetensors.index.json")):
            (dst / f.name).write_bytes(f.read_bytes())
    tok = PreTrainedTokenizerFast.from_pretrained(src)
    if extra_specials:
        tok.add_special_tokens({"additional_special_tokens": list(extra_specials)})
    tok.chat_template = template
    tok.save_pretrained(dst)
    return dst


class Server(ServeProcess):
    """`mlx-glimmer serve` on a scripted target, in its own process."""

    def __init__(
        self, spec: Path, target: Path, drafter: Path, timeout: float = slow_machine_timeout(), *, wait: bool = True
    ):
        cmd = [sys.executable, str(HERE / "scripted_serve.py"), str(spec), "--", "serve", str(target)]
        cmd += ["--drafter", str(drafter), "--port", "0", "--max-queue", "4", "--model-name", "tiny", "--tree", "off"]
        super().__init__(cmd, timeout=timeout, wait=wait)


@contextmanager
def scripted_loading(spec: dict):
    """`mlx_glimmer.load` opens scripted targets inside the block (for the in-process plain generation)."""
    from mlx_glimmer import loading

    real = loading.load_target
    scripted_serve.install(spec)
    try:
        yield
    finally:
        loading.load_target = real


def start(tmp_path_factory, checkpoints, name, template, scripts, specials=()):
    """Starts the server on a copy of the target with `template` (without waiting for it) and opens the same
    pair in this process."""
    root = tmp_path_factory.mktemp(name)
    target = with_template(checkpoints["muse"], root / "target", template, specials)
    spec = {"marker": MARKER, "scripts": scripts}
    (root / "spec.json").write_text(json.dumps(spec))
    server = Server(root / "spec.json", target, checkpoints["assistant"], wait=False)
    with scripted_loading(spec):
        pair = mlx_glimmer.load(target=target, drafter=checkpoints["assistant"])
    return server, pair


@pytest.fixture(scope="module")
def servers(tmp_path_factory, checkpoints):
    """Both templates' servers, started together."""
    started = {
        "muse": start(tmp_path_factory, checkpoints, "muse_tools", MUSE_TEMPLATE, MUSE_SCRIPTS),
        "think": start(
            tmp_path_factory, checkpoints, "think_tools", THINK_TEMPLATE, THINK_SCRIPTS, ["<think>", "</think>"]
        ),
    }
    try:
        for server, _ in started.values():
            server.ready()
        yield started
    finally:
        for server, _ in started.values():
            server.stop()
    for server, _ in started.values():
        server.stop_and_check()


@pytest.fixture(scope="module")
def muse(servers):
    return servers["muse"]


@pytest.fixture(scope="module")
def think(servers):
    return servers["think"]


def streamed(stream) -> dict:
    """A streamed reply put together: content, reasoning, calls (by index), finish reason, chunk counts."""
    out = {"content": "", "reasoning": "", "calls": {}, "finish": None, "reasoning_chunks": 0}
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        out["content"] += delta.content or ""
        if getattr(delta, "reasoning_content", None):
            out["reasoning"] += delta.reasoning_content
            out["reasoning_chunks"] += 1
        for call in delta.tool_calls or []:
            slot = out["calls"].setdefault(call.index, {"id": None, "name": "", "arguments": ""})
            slot["id"] = call.id or slot["id"]
            slot["name"] += call.function.name or ""
            slot["arguments"] += call.function.arguments or ""
        out["finish"] = choice.finish_reason or out["finish"]
    return out


def ask(server, messages, **kwargs):
    kwargs = {"max_tokens": MAX_TOKENS, "temperature": 0, **kwargs}
    return server.client(kwargs["max_tokens"]).chat.completions.create(model="tiny", messages=messages, **kwargs)


# ---- tool calls ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model, arguments", [("muse", {"city": "Paris", "days": 2}), ("think", {"city": "Paris"})])
def test_a_tool_call_comes_back_parsed_whole_and_streamed(request, model, arguments):
    server, _ = request.getfixturevalue(model)
    whole = ask(server, ASK, tools=[WEATHER, CLOCK])
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == arguments
    assert choice.message.content is None
    assert choice.message.reasoning_content == (
        "The user wants the weather; call the tool." if model == "muse" else "I should call the tool."
    )
    assert whole.model_extra["glimmer"]["drafter"] == "dflash"  # the speculative loop made it

    s = streamed(ask(server, ASK, tools=[WEATHER, CLOCK], stream=True))
    assert s["finish"] == "tool_calls" and s["content"] == ""
    assert s["reasoning"] == choice.message.reasoning_content
    assert list(s["calls"]) == [0] and s["calls"][0]["name"] == "get_weather"
    assert json.loads(s["calls"][0]["arguments"]) == arguments and s["calls"][0]["id"].startswith("call_")


@pytest.mark.parametrize(
    "model, answer, reasoning",
    [("muse", "It is 18 C in Paris.", "The tool says 18 C."), ("think", "It is 18 C in Paris.", "The tool answered.")],
)
def test_the_tool_result_goes_back_through_the_template(request, model, answer, reasoning):
    server, pair = request.getfixturevalue(model)
    first = ask(server, ASK, tools=[WEATHER])
    message = first.choices[0].message
    (call,) = message.tool_calls
    history = ASK + [
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "18 C"},
    ]
    follow = ask(server, history, tools=[WEATHER])
    assert follow.choices[0].finish_reason == "stop" and follow.choices[0].message.tool_calls is None
    assert follow.choices[0].message.content == answer  # the script for "the tool has answered" was chosen
    assert follow.choices[0].message.reasoning_content == reasoning
    # The prompt is what the template writes for the call (arguments as an object) and the named result.
    rendered = [
        *ASK,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.loads(call.function.arguments)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "name": "get_weather", "content": "18 C"},
    ]
    text = pair.tokenizer.apply_chat_template(rendered, tools=[WEATHER], add_generation_prompt=True, tokenize=False)
    assert follow.usage.prompt_tokens == len(pair.tokenizer.encode(text, add_special_tokens=False))


def test_tool_choice_none_offers_and_parses_no_call(muse):
    server, _ = muse
    offered = ask(server, ASK, tools=[WEATHER])
    r = ask(server, ASK, tools=[WEATHER], tool_choice="none")
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert r.usage.prompt_tokens < offered.usage.prompt_tokens  # the tools were not rendered
    # The (scripted) model calls anyway: that text stays in the content, unparsed.
    assert choice.message.content.startswith('<atem:function_calls><atem:invoke name="get_weather">')
    s = streamed(ask(server, ASK, tools=[WEATHER], tool_choice="none", stream=True))
    assert s["calls"] == {} and s["content"] == choice.message.content and s["finish"] == "stop"


def test_required_and_named_tool_choice_are_checked(muse):
    server, _ = muse
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = ask(server, ASK, tools=[WEATHER, CLOCK], tool_choice=tool_choice)
        assert r.choices[0].finish_reason == "tool_calls"
        assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]
    named_other = {"type": "function", "function": {"name": "get_time"}}
    with pytest.raises(openai.UnprocessableEntityError) as e:  # the model called get_weather anyway
        ask(server, ASK, tools=[WEATHER, CLOCK], tool_choice=named_other)
    assert e.value.body["code"] == "tool_choice_not_met" and "get_time" in e.value.body["message"]
    events = [
        line
        for line in httpx.post(
            server.url + "/chat/completions",
            timeout=slow_machine_timeout(MAX_TOKENS),
            json={
                "model": "tiny",
                "messages": ASK,
                "max_tokens": MAX_TOKENS,
                "stream": True,
                "tools": [WEATHER, CLOCK],
                "tool_choice": named_other,
            },
        ).text.splitlines()
        if line.startswith("data: ")
    ]
    bodies = [json.loads(line[6:]) for line in events[:-1]]
    assert events[-1] == "data: [DONE]" and bodies[-1]["error"]["code"] == "tool_choice_not_met"
    assert not any(c.get("choices") and c["choices"][0]["delta"].get("tool_calls") for c in bodies)


BAD_TOOLS = [
    ("tools not a list", {"tools": {"type": "function"}}, "tools"),
    ("tool without a function", {"tools": [{"type": "function"}]}, "tools.0.function"),
    ("unknown tool type", {"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type"),
    (
        "function without a name",
        {"tools": [{"type": "function", "function": {"description": "x"}}]},
        "tools.0.function.name",
    ),
    (
        "name with spaces",
        {"tools": [{"type": "function", "function": {"name": "get weather"}}]},
        "tools.0.function.name",
    ),
    (
        "parameters not an object",
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
        "tools.0.function.parameters",
    ),
    ("a function twice", {"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
    ("unknown tool_choice", {"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    (
        "tool_choice naming no tool",
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "f"}}},
        "tool_choice",
    ),
    ("required without tools", {"tool_choice": "required"}, "tool_choice"),
    (
        "tool message without a call id",
        {"messages": ASK + [{"role": "tool", "content": "18 C"}]},
        "messages.1.tool_call_id",
    ),
    (
        "call arguments not JSON",
        {
            "messages": ASK
            + [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{city"}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
            ]
        },
        "messages.1.tool_calls.0.function.arguments",
    ),
    ("deprecated functions", {"functions": [{"name": "f"}]}, "functions"),
]


@pytest.mark.parametrize("what, fields, param", BAD_TOOLS, ids=[b[0] for b in BAD_TOOLS])
def test_malformed_tools_get_a_400(muse, what, fields, param):
    server, _ = muse
    body = {"model": "tiny", "messages": ASK, "max_tokens": 4, **fields}
    r = httpx.post(server.url + "/chat/completions", json=body, timeout=slow_machine_timeout())
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"] and error["param"] == param, error
    if what == "name with spaces":
        with pytest.raises(openai.BadRequestError):
            server.client(4).chat.completions.create(model="tiny", messages=ASK, max_tokens=4, tools=fields["tools"])


# ---- reasoning -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["muse", "think"])
def test_reasoning_and_answer_arrive_apart_and_add_up_to_the_plain_generation(request, model):
    server, pair = request.getfixturevalue(model)
    plain = mlx_glimmer.generate(pair, EXPLAIN, max_tokens=MAX_TOKENS, speculative=False).text
    assert plain == (MUSE_REASONING if model == "muse" else THINK_REASONING)
    if model == "muse":  # the chat app's split of the same text, an independent reading of the format
        reasoning, answer = "".join(split_channels(plain).reasoning), split_channels(plain).answer
    else:
        reasoning, answer = plain.removeprefix("<think>").split("</think>")

    whole = ask(server, EXPLAIN)
    message = whole.choices[0].message
    assert message.reasoning_content == reasoning and message.content == answer
    assert whole.choices[0].finish_reason == "stop"
    s = streamed(ask(server, EXPLAIN, stream=True))
    assert s["reasoning"] == reasoning and s["content"] == answer and s["reasoning_chunks"] > 1
    for marker in ("<|", "|>", "to=", "think>"):
        assert marker not in s["content"] + s["reasoning"]
    # Nothing but the markers is taken out: reasoning + answer is the plain text without them.
    stripped = plain
    for marker in (
        "to=self<|message|>",
        "<|eom|><|start|>assistant ",
        "to=user<|message|>",
        "<|eot|>",
        "<think>",
        "</think>",
    ):
        stripped = stripped.replace(marker, "")
    assert message.reasoning_content + message.content == stripped


@pytest.mark.parametrize("model, variable", [("muse", "reasoning_strength"), ("think", "reasoning_effort")])
def test_reasoning_effort_goes_to_the_templates_own_variable(request, model, variable):
    server, pair = request.getfixturevalue(model)
    low = ask(server, EXPLAIN, reasoning_effort="low", max_tokens=2)
    high = ask(server, EXPLAIN, reasoning_effort="high", max_tokens=2)
    expected = len(
        pair.tokenizer.encode(
            pair.tokenizer.apply_chat_template(
                EXPLAIN, add_generation_prompt=True, tokenize=False, **{variable: "low"}
            ),
            add_special_tokens=False,
        )
    )
    assert low.usage.prompt_tokens == expected
    assert high.usage.prompt_tokens == low.usage.prompt_tokens + 1  # "high" vs "low"


# ---- the parser alone ------------------------------------------------------------------------------------


def parts_of(parser, pieces):
    out = []
    for p in pieces:
        out += parser.feed(p)
    out += parser.finish()
    merged = {"reasoning": "", "content": "", "calls": []}
    for kind, value in out:
        if kind == "tool_calls":
            merged["calls"] += [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in value]
        else:
            merged[kind] += value
    return merged


@pytest.mark.parametrize("model", ["muse", "think"])
def test_the_split_does_not_depend_on_how_the_text_is_chunked(request, model):
    from mlx_glimmer.server.tools import ResponseParser, ToolPlan

    _, pair = request.getfixturevalue(model)
    tok = pair.tokenizer
    plan = ToolPlan("auto", tools=[WEATHER], names=frozenset({"get_weather"}))
    texts = [MUSE_CALL, MUSE_REASONING] if model == "muse" else [THINK_CALL, THINK_REASONING]
    for text in texts:
        whole = parts_of(ResponseParser(tok, [], plan), [text])
        for size in (1, 2, 5):
            assert (
                parts_of(ResponseParser(tok, [], plan), [text[i : i + size] for i in range(0, len(text), size)])
                == whole
            )
    # Plain text from a model whose template frames channels is all content, header-like start or not.
    for text in ("Hello there.", "  to be or not to be", "to=se"):
        assert parts_of(ResponseParser(tok, [], plan), list(text)) == {"reasoning": "", "content": text, "calls": []}
    if model == "think":  # a generation prompt that opens the reasoning block (as Qwen3's can) starts there
        opened = parts_of(ResponseParser(tok, [tok.think_start_id], plan), ["Some thought", "</think>Answer"])
        assert opened == {"reasoning": "Some thought", "content": "Answer", "calls": []}
    # A call cut off by max_tokens is not parsed: its text stays content.
    call = MUSE_CALL if model == "muse" else THINK_CALL
    cut = call[: call.index('"get_weather') + 4]
    got = parts_of(ResponseParser(tok, [], plan), [cut])
    assert got["calls"] == [] and got["content"]


def test_a_template_without_a_tool_format_gets_one_clear_400(checkpoints):
    from mlx_glimmer.loading import open_tokenizer
    from mlx_glimmer.server.protocol import APIError, ChatCompletionRequest
    from mlx_glimmer.server.tools import plan_tools

    tok = open_tokenizer(checkpoints["muse"], json.loads((checkpoints["muse"] / "config.json").read_text()))
    req = ChatCompletionRequest.model_validate({"messages": ASK, "tools": [WEATHER]})
    with pytest.raises(APIError) as e:
        plan_tools(req, tok, "tiny")
    assert e.value.status == 400 and e.value.param == "tools" and e.value.code == "tools_not_supported"
    assert "no tool-call format" in e.value.message and "'tiny'" in e.value.message
    # tool_choice "none" asks for no tool format.
    none = ChatCompletionRequest.model_validate({"messages": ASK, "tools": [WEATHER], "tool_choice": "none"})
    assert plan_tools(none, tok, "tiny").tools is None
