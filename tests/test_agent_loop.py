"""An agent's loop against `mlx-glimmer serve`, end to end, with the official `openai` client.

Two agents, each with its own tools and conversation, run at the same time on one server with its default
settings (speculative, a DFlash drafter, `--block-size auto`, `--tree auto`), streaming. Each asks, gets a tool
call, runs the tool, sends the result back (`role: "tool"`, `tool_call_id`), gets a second step of calls (two
at once for one agent: stream indices 0 and 1), sends those results, and gets its final answer. The target is the tiny random Muse checkpoint with the Muse-like chat template
of test_server_tools.py, its replies scripted by what the conversation holds (tests/scripted_serve.py); so the
calls are text the speculative loop generated, which the server's tool parser must find, stream as deltas and
the agent reassemble by index. Every call (name and arguments), reasoning and final answer must equal what the
same requests get one at a time without streaming, and what the script says.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import openai
import pytest
from serving import ServeProcess
from test_server_tools import MARKER, MUSE_TEMPLATE, with_template

HERE = Path(__file__).parent
MAX_TOKENS = 512  # the longest scripted reply (two calls) is 407 tokens with its end
SPECIALS = ["<|start|>", "<|message|>", "<|eot|>"]  # single tokens, as in Muse's own tokenizer (fewer to generate)


def muse_call(reasoning: str, calls: list[tuple[str, dict]]) -> str:
    """A Muse reply that thinks, then calls each function (Muse Spark's `<atem:function_calls>` format)."""
    out = f"to=self<|message|>{reasoning}<|eom|>"
    for name, arguments in calls:
        params = "".join(f'<atem:parameter name="{k}">{json.dumps(v)}</atem:parameter>' for k, v in arguments.items())
        out += (
            f'<|start|>assistant to={name}<|message|><atem:function_calls><atem:invoke name="{name}">{params}'
            "</atem:invoke></atem:function_calls><|eom|>"
        )
    return out


def muse_answer(reasoning: str, answer: str) -> str:
    return f"to=self<|message|>{reasoning}<|eom|><|start|>assistant to=user<|message|>{answer}<|eot|>"


@dataclass
class Agent:
    """One agent: what it asks, the tools it offers and runs, and the replies the script gives it, each once
    the conversation holds its trigger: two steps of calls (reasoning, [(function, arguments), ...]), then an
    answer (reasoning, text)."""

    ask: str
    tools: dict[str, Callable[..., str]]  # name -> the tool (keyword arguments -> its result)
    parameters: dict[str, dict[str, str]]  # name -> its parameters' JSON schema types
    calls: list[tuple[str, list[tuple[str, dict]]]]
    answer: tuple[str, str]
    triggers: list[str]

    def definitions(self) -> list[dict]:
        return [
            {
                "type": "function",
                "function": {
                    "name": name,
                    "parameters": {
                        "type": "object",
                        "properties": {k: {"type": t} for k, t in props.items()},
                        "required": list(props),
                    },
                },
            }
            for name, props in self.parameters.items()
        ]

    def call(self, name: str, arguments: str) -> str:
        """What the agent sends back for a call: the tool's result, or the error it met."""
        try:
            return self.tools[name](**json.loads(arguments))
        except (KeyError, TypeError, ValueError) as e:
            return f"error: {type(e).__name__}: {e}"

    def replies(self) -> list[str]:
        return [muse_call(*step) for step in self.calls] + [muse_answer(*self.answer)]


def museum(city: str, indoor: bool) -> str:
    return "Musée d'Orsay" if (city, indoor) == ("Paris", True) else "none"


# Its second step calls two tools at once (stream indices 0 and 1).
TRIP = Agent(
    ask="Plan a rainy day in Paris.",
    tools={"get_weather": lambda city: f"{city}: rain, 14 C", "find_museum": museum, "find_cafe": lambda city: "Flore"},
    parameters={
        "get_weather": {"city": "string"},
        "find_museum": {"city": "string", "indoor": "boolean"},
        "find_cafe": {"city": "string"},
    },
    calls=[
        ("Forecast first.", [("get_weather", {"city": "Paris"})]),
        ("Rain: indoors.", [("find_museum", {"city": "Paris", "indoor": True}), ("find_cafe", {"city": "Paris"})]),
    ],
    answer=("Done.", "Rain, 14 C: see the Musée d'Orsay, then Café de Flore."),
    triggers=["rainy day in Paris", "tool get_weather<|message|>", "tool find_cafe<|message|>"],
)
UNITS = Agent(
    ask="26.2 miles in km, to one decimal?",
    tools={"miles_to_km": lambda miles: f"{miles * 1.609344:.4f}", "round": lambda x, digits: f"{x:.{digits}f}"},
    parameters={"miles_to_km": {"miles": "number"}, "round": {"x": "number", "digits": "integer"}},
    calls=[("Convert.", [("miles_to_km", {"miles": 26.2})]), ("Round.", [("round", {"x": 42.1648, "digits": 1})])],
    answer=("Done.", "26.2 miles is 42.2 km."),
    triggers=["26.2 miles in km", "tool miles_to_km<|message|>", "tool round<|message|>"],
)
AGENTS = {"trip": TRIP, "units": UNITS}


def scripts() -> list[list[str]]:
    """[trigger, reply] pairs, the latest step first (an earlier step's trigger stays in the conversation)."""
    steps = {name: list(zip(agent.triggers, agent.replies())) for name, agent in AGENTS.items()}
    return [list(steps[name][i]) for i in reversed(range(3)) for name in AGENTS]


@pytest.fixture(scope="module")
def server(tmp_path_factory, checkpoints):
    """`mlx-glimmer serve` on the scripted target, with its default settings."""
    root = tmp_path_factory.mktemp("agent_loop")
    target = with_template(checkpoints["muse"], root / "target", MUSE_TEMPLATE, SPECIALS)
    spec = root / "spec.json"
    spec.write_text(json.dumps({"marker": MARKER, "scripts": scripts()}))
    cmd = [sys.executable, str(HERE / "scripted_serve.py"), str(spec), "--", "serve", str(target)]
    cmd += ["--drafter", str(checkpoints["assistant"]), "--port", "0", "--model-name", "tiny"]
    server = ServeProcess(cmd)
    try:
        yield server
    finally:
        server.stop()
    server.stop_and_check()


@dataclass
class Reply:
    """One assistant reply as the agent reads it."""

    reasoning: str
    content: str | None
    calls: list[dict]  # {"id", "name", "arguments"} (arguments: the JSON string, as sent)
    finish: str
    chunks: int = 0  # streamed: chunks with a choice
    span: tuple[float, float] = (0.0, 0.0)  # streamed: when it was asked for, when its last chunk came
    glimmer: dict | None = None  # not streamed: the server's own figures


def whole(client, messages: list[dict], tools: list[dict]) -> Reply:
    r = client.chat.completions.create(
        model="tiny", messages=messages, tools=tools, max_tokens=MAX_TOKENS, temperature=0
    )
    choice = r.choices[0]
    message = choice.message
    calls = []
    for call in message.tool_calls or []:
        assert call.type == "function"
        calls.append({"id": call.id, "name": call.function.name, "arguments": call.function.arguments})
    reasoning = message.model_extra.get("reasoning_content") or ""
    return Reply(reasoning, message.content, calls, choice.finish_reason, glimmer=r.model_extra["glimmer"])


def streamed(client, messages: list[dict], tools: list[dict]) -> Reply:
    """A streamed reply put together as an agent does: text appended, tool-call deltas merged by index."""
    asked = time.monotonic()
    stream = client.chat.completions.create(
        model="tiny", messages=messages, tools=tools, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    reasoning, content, calls, finish, chunks = "", "", {}, None, 0
    for chunk in stream:
        if not chunk.choices:
            continue
        chunks += 1
        choice = chunk.choices[0]
        delta = choice.delta
        content += delta.content or ""
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        for call in delta.tool_calls or []:
            slot = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
            slot["id"] = call.id or slot["id"]
            if call.function is not None:
                slot["name"] += call.function.name or ""
                slot["arguments"] += call.function.arguments or ""
        if choice.finish_reason is not None:
            assert finish is None, "a second finish_reason"
            finish = choice.finish_reason
    assert sorted(calls) == list(range(len(calls))), f"call indices {sorted(calls)}"
    calls = [calls[i] for i in sorted(calls)]
    return Reply(reasoning, content or None, calls, finish, chunks=chunks, span=(asked, time.monotonic()))


def run_agent(server: ServeProcess, agent: Agent, ask: Callable) -> list[Reply]:
    """The agent's loop: ask; while the reply calls tools, run them and send the results back; stop at an
    answer (or after a step more than the script has, which fails the comparisons)."""
    client = server.client(MAX_TOKENS, requests=len(AGENTS))  # the other agent's request may go first
    messages = [{"role": "user", "content": agent.ask}]
    replies = []
    for _ in range(len(agent.calls) + 2):
        try:
            reply = ask(client, messages, agent.definitions())
        except openai.APIStatusError as e:  # the server refused the conversation: that ends the loop
            reply = Reply("", None, [], f"error {e.status_code}: {e.message}")
        replies.append(reply)
        if reply.finish != "tool_calls":
            break
        messages.append(
            {
                "role": "assistant",
                "content": reply.content,
                "tool_calls": [
                    {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                    for c in reply.calls
                ],
            }
        )
        for c in reply.calls:
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": agent.call(c["name"], c["arguments"])})
    return replies


def decoded(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments  # compared as it is


def steps_of(replies: list[Reply]) -> list[tuple]:
    """What an agent acts on, per reply: reasoning, content, calls (name, decoded arguments), finish reason."""
    return [
        (r.reasoning, r.content, [(c["name"], decoded(c["arguments"])) for c in r.calls], r.finish) for r in replies
    ]


@pytest.fixture(scope="module")
def runs(server):
    """Both agents streaming at once (first, on a fresh server), then each alone without streaming."""
    start = threading.Barrier(len(AGENTS))

    def ask_together(client, messages, tools):
        if len(messages) == 1:
            start.wait(timeout=60)  # both first requests go out together
        return streamed(client, messages, tools)

    with ThreadPoolExecutor(max_workers=len(AGENTS)) as pool:
        futures = {name: pool.submit(run_agent, server, agent, ask_together) for name, agent in AGENTS.items()}
        together = {name: f.result() for name, f in futures.items()}
    alone = {name: run_agent(server, agent, whole) for name, agent in AGENTS.items()}
    return together, alone


@pytest.mark.parametrize("name", AGENTS)
def test_an_agent_calls_its_tools_in_turn_then_answers(runs, name):
    _, alone = runs
    agent = AGENTS[name]
    expected = [(reasoning, None, calls, "tool_calls") for reasoning, calls in agent.calls]
    expected.append((*agent.answer, [], "stop"))
    assert steps_of(alone[name]) == expected
    ids = [c["id"] for r in alone[name] for c in r.calls]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == len(ids)
    for r in alone[name]:
        assert r.glimmer["drafter"] == "dflash"  # the speculative loop generated it


def test_the_two_agents_ran_at_once(runs):
    together, _ = runs
    trip, units = ([r.span for r in together[name]] for name in ("trip", "units"))
    assert any(a0 < b1 and b0 < a1 for a0, a1 in trip for b0, b1 in units)  # some requests were in flight together


@pytest.mark.parametrize("name", AGENTS)
def test_two_streaming_agents_at_once_get_what_each_gets_alone(runs, name):
    together, alone = runs
    assert steps_of(together[name]) == steps_of(alone[name])
    for r in together[name]:
        assert all(c["id"].startswith("call_") for c in r.calls)
        assert r.chunks > 2  # the role, then the reply in pieces, then the finish
        for marker in ("<atem:", "<|", "to="):
            assert marker not in (r.content or "") + r.reasoning


def test_the_replies_were_drafted_and_verified_in_chains_and_trees(server, runs):
    together, alone = runs
    m = server.metrics()
    assert m['glimmer_requests_total{finish_reason="stop"}'] == sum(map(len, [*together.values(), *alone.values()]))
    assert m["glimmer_tokens_verified_total"] > m["glimmer_target_forwards_total"] > 0  # drafts were offered
    assert m["glimmer_tree_rounds_total"] > 0  # `--tree auto` tried draft trees too
