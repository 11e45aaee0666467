"""Tool calls and reasoning on /v1/chat/completions, on mlx-lm's own pieces.

Request side (`plan_tools`): `tools` and `tool_choice` are checked, and what
the chat template gets is decided: the tool definitions (`tools=`, rendered
by the model's own template, in whatever format it writes), and for
`required` or a named function an instruction in the system message (a named
choice offers that function alone).

Output side (`ResponseParser`): the decoded text is split as it streams into
reasoning, content and tool calls by mlx-lm's `TextStateMachine`, with the
transitions `make_text_state_machine` builds from the tokenizer (the
`<think>`-style markers and the tool-call markers `TokenizerWrapper` inferred
from the chat template) plus Muse's channel format (`mlx_glimmer.channels`)
when the template writes it. Calls are parsed by the tool parser mlx-lm
inferred (`mlx_lm/tool_parsers/`) and formatted by mlx_lm.server's
`ToolCallFormatter`. Only the markers are removed; the text between them
comes back unchanged.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from mlx_lm.generate import TextStateMachine, make_text_state_machine
from mlx_lm.server import ToolCallFormatter

from ..channels import RESPONSE_FORMAT as CHANNEL_FORMAT
from ..channels import is_channel_template, is_framed
from ..chat_template import template_text
from .protocol import APIError, ChatCompletionRequest

CHOICES = ("auto", "none", "required")


def tool_support(tokenizer) -> bool:
    """Can this model take tools: did mlx-lm infer a tool-call format (and parser) from its chat template, and
    does the template render tool definitions at all?"""
    if not getattr(tokenizer, "has_tool_calling", False):
        return False
    if getattr(tokenizer, "_chat_template", None) is not None:  # a Python renderer (mlx_lm/chat_templates/)
        return True
    return "tools" in template_text(tokenizer)


def uses_tools_in_history(req: ChatCompletionRequest) -> bool:
    return any(m.role == "tool" or m.tool_calls for m in req.messages)


@dataclass
class ToolPlan:
    """How one request's tools are offered and its output read."""

    choice: str = "none"  # "auto" | "none" | "required" | "function" (a named function)
    function: str | None = None  # the named function
    tools: list[dict] | None = None  # the definitions the chat template gets (None: no tools offered)
    names: frozenset[str] = field(default_factory=frozenset)
    instruction: str | None = None  # added to the system message (required / named)

    @property
    def parse(self) -> bool:
        """Are calls in the output parsed (else their text stays in `content`)?"""
        return self.choice != "none"

    @property
    def enforced(self) -> bool:
        """Must the reply hold a call (checked once it is complete)?"""
        return self.choice in ("required", "function")

    def describe(self) -> str:
        return (
            f"tool_choice names the function '{self.function}'"
            if self.choice == "function"
            else "tool_choice is 'required'"
        )

    def check(self, calls: list[dict]) -> tuple[list[dict], str | None]:
        """The calls this tool_choice lets through, or an error when it asks for a call and none qualifies."""
        if not self.enforced:
            return calls, None
        wanted = {self.function} if self.choice == "function" else self.names
        kept = [c for c in calls if c["function"]["name"] in wanted]
        if kept:
            return kept, None
        what = f"a call to '{self.function}'" if self.choice == "function" else "a call to one of the offered tools"
        return [], (
            f"{self.describe()}, but the model's reply holds no {what}; tool_choice is honoured by the "
            f"prompt and by checking the reply, not by constraining generation (try again, or sample)"
        )


def plan_tools(req: ChatCompletionRequest, tokenizer, model_name: str) -> ToolPlan:
    """Check `tools` / `tool_choice` (a 400 for anything malformed) and decide what the template gets."""
    tools = req.tools or []
    names = [t.function.name for t in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise APIError(
                400,
                f"tools.{i}.function.name: the function '{name}' is defined twice",
                param=f"tools.{i}.function.name",
            )
    choice, function = req.tool_choice, None
    if choice is None:
        choice = "auto" if tools else "none"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(
                400,
                'tool_choice: expected "auto", "none", "required" or {"type": "function", "function": {"name": ...}}',
                param="tool_choice",
            )
        choice, function = "function", fn["name"]
        if function not in names:
            raise APIError(400, f"tool_choice: the function '{function}' is not among the tools", param="tool_choice")
    elif choice not in CHOICES:
        raise APIError(
            400, f'tool_choice: expected "auto", "none", "required" or a function, got {choice!r}', param="tool_choice"
        )
    if choice in ("required", "function") and not tools:
        raise APIError(400, f"tool_choice: {choice!r} needs tools", param="tool_choice")

    offered = bool(tools) and choice != "none"
    if (offered or uses_tools_in_history(req)) and not tool_support(tokenizer):
        param = "tools" if offered else "messages"
        raise APIError(
            400,
            f"{param}: the chat template of '{model_name}' has no tool-call format (mlx-lm infers no "
            f"tool parser from it), so this model takes no tools and no tool calls or tool messages",
            param=param,
            code="tools_not_supported",
        )
    if not offered:
        return ToolPlan("none")
    chosen = [t for t in tools if choice != "function" or t.function.name == function]
    plan = ToolPlan(choice, function, [t.model_dump(exclude_none=True) for t in chosen], frozenset(names))
    if choice == "required":
        plan.instruction = "In this reply, call at least one of the tools provided."
    elif choice == "function":
        plan.instruction = f"In this reply, call the tool `{function}`."
    return plan


def with_instruction(messages: list[dict], instruction: str | None) -> list[dict]:
    """The conversation with `instruction` at the end of its system message (one is added when it has none)."""
    if not instruction:
        return messages
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = f"{first['content']}\n\n{instruction}" if first["content"] else instruction
        return [first, *messages[1:]]
    return [{"role": "system", "content": instruction}, *messages]


# ---- output -------------------------------------------------------------------------------------------------


class _TokenizerView:
    """The tokenizer as `make_text_state_machine` reads it, with some of its answers replaced."""

    def __init__(self, tokenizer, **overrides):
        self._tokenizer = tokenizer
        self.__dict__.update(overrides)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def response_format(tokenizer) -> dict | None:
    """The channel format of the model's replies: mlx-lm's own for the tokenizer (a model module's
    `chat_template_type`), else Muse's when the chat template writes channel headers; None for plain replies."""
    if tokenizer.response_transitions:
        return {
            "transitions": tokenizer.response_transitions,
            "initial_state": tokenizer.response_initial_state or "normal",
        }
    if is_channel_template(template_text(tokenizer)):
        return CHANNEL_FORMAT
    return None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ResponseParser:
    """Splits one reply, as its text streams, into ("reasoning", text), ("content", text) and
    ("tool_calls", [call, ...]) parts.

    A channel-framed format starts in its header state; until the reply shows a header (or can no longer
    start with one) its text is held back, and a reply with no header at all is read as plain text.
    """

    def __init__(self, tokenizer, prompt: list[int], plan: ToolPlan):
        self.tokenizer = tokenizer
        self.plan = plan
        self.parse_calls = plan.parse and tokenizer.has_tool_calling
        self.formatter = ToolCallFormatter(tokenizer.tool_parser, plan.tools) if self.parse_calls else None
        self.prompt = prompt
        self.format = response_format(tokenizer)
        self.calls: list[dict] = []
        self.tool_text = ""
        self.in_tool = False
        self.held: str | None = None  # text held while it is not yet known whether the reply is channel-framed
        self.headers: tuple[str, ...] = ()
        if self.format is not None and self.format["initial_state"] == "header":
            self.headers = tuple(m for m, _ in self.format["transitions"]["header"])
            self.held = ""
            self.state = None
        else:
            self._start(self.format)

    def _start(self, fmt: dict | None) -> None:
        transitions = {state: list(edges) for state, edges in (fmt or {}).get("transitions", {}).items()}
        for edges in list(transitions.values()):
            for _, state in edges:
                transitions.setdefault(state, [])  # every state a format leads to exists
        closes_at_end = self.parse_calls  # (make_text_state_machine adds the exit at the tool-call end marker)
        if transitions.get("tool") == [] and self.tokenizer.tool_call_end:
            transitions["tool"], closes_at_end = [(self.tokenizer.tool_call_end, "normal")], True
        view = _TokenizerView(self.tokenizer, has_tool_calling=self.parse_calls, response_transitions=transitions)
        self.machine = make_text_state_machine(view)
        if fmt is not None:
            initial = fmt["initial_state"]
        else:
            initial = "normal"
            tok = self.tokenizer
            if tok.has_thinking and tok.rfind_think_start(self.prompt) > tok.rfind_think_end(self.prompt):
                initial = "reasoning"  # the generation prompt opened the reasoning block
        # The marker that opens a tool block, and the one that closes it (re-added when a block stays text).
        into_tool = [m for edges in (fmt or {}).get("transitions", {}).values() for m, d in edges if d == "tool"]
        self.tool_open = self.tokenizer.tool_call_start if self.parse_calls else (into_tool[0] if into_tool else "")
        self.tool_close = (self.tokenizer.tool_call_end or "") if closes_at_end else ""
        self.state = self.machine.make_state(initial)

    def feed(self, text: str) -> list[tuple[str, object]]:
        if self.held is not None:
            self.held += text
            buf = self.held
            if not any(h in buf for h in self.headers):
                if not buf.strip() or is_framed(buf, final=False, headers=self.headers):
                    return []  # could still be the start of a header
                self.format = None  # plain text from a model whose template frames channels
            self._start(self.format)
            self.held, text = None, buf
        self.state, segments = TextStateMachine.split(self.state, text)
        return self._collect(segments)

    def finish(self) -> list[tuple[str, object]]:
        """The parts left once generation has ended (a marker cut off at the end is text; an open call is closed)."""
        if self.held is not None:
            held, self.held = self.held, None
            return [("content", held)] if held else []
        self.state, rest, current = TextStateMachine.flush(self.state)
        parts = self._collect([(current, rest)])
        if self.in_tool:
            parts += self._close_call(closed=False)
        return parts

    def _collect(self, segments) -> list[tuple[str, object]]:
        parts = []
        for state, text in segments:
            if state == "tool":
                self.tool_text += text
                self.in_tool = True
                continue
            if self.in_tool:
                parts += self._close_call(closed=True)
            if text and state in ("reasoning", "normal"):
                parts.append(("reasoning" if state == "reasoning" else "content", text))
        return parts

    def _close_call(self, closed: bool) -> list[tuple[str, object]]:
        text, self.tool_text, self.in_tool = self.tool_text, "", False
        if self.parse_calls:
            calls = self.formatter([text])
            if calls:
                for c in calls:
                    c["id"] = new_call_id()
                self.calls += calls
                return [("tool_calls", calls)]
        # Not parsed (tool_choice "none") or not parseable (cut off by max_tokens): the text stays content.
        raw = self.tool_open + text + (self.tool_close if closed else "")
        return [("content", raw)] if raw else []
