"""The OpenAI wire format: request bodies in, validated `GenerationRequest`s and response bodies out.

Bad input becomes an `APIError` (an OpenAI-style error body with a 4xx
status), never a traceback. Fields we do not implement are refused with a
clear 400 when a client asks for them (`n > 1`, penalties, `logit_bias`,
structured output, the deprecated `functions`); harmless ones (`user`,
`metadata`, `parallel_tool_calls`, ...) are ignored. Tools are checked and
planned in tools.py.

Log-probabilities are shaped for the wire in logprob_shapes.py.

Types are strict (`strict=True`), as OpenAI's are: `true` is not an integer, `"2"` not a number, `1` not a
boolean. `chat_template_kwargs` may set the template's own variables (`enable_thinking`, ...) but not what
fixes the prompt's format (`RESERVED_TEMPLATE_KWARGS`).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..chat_template import REASONING_LEVELS
from ..generate import GenerationStats
from ..settings import (
    AUTO,
    MAX_LOGPROBS,
    SEED_LIMIT,
    GenerationSettings,
    SamplingError,
    check_together,
    tree_value,
)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {
            "error": {
                "message": printable(self.message),
                "type": self.type,
                "param": printable(self.param),
                "code": self.code,
            }
        }


def printable(text: str | None) -> str | None:
    """`text` with any lone surrogate (from the client's input) escaped, so the error body can be encoded."""
    return text if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(message: str, type: str = "invalid_request_error", code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": None, "code": code}}


# ---- request bodies -------------------------------------------------------------------------------


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON Schema, given to the chat template as it is
    strict: bool | None = None


class ToolDefinition(BaseModel):
    """One entry of `tools`: `{"type": "function", "function": {"name": ..., "parameters": {...}}}`."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["function"]
    function: FunctionDefinition


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str = Field(min_length=1)
    arguments: str | dict = "{}"  # a JSON object, as text (OpenAI) or already decoded


class ToolCall(BaseModel):
    """A call in an assistant message of the history (as a response's `message.tool_calls` gave it)."""

    model_config = ConfigDict(extra="allow", strict=True)
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call they answer
    name: str | None = None
    reasoning_content: str | None = None  # assistant messages: their reasoning, for templates that show it

    @field_validator("content", mode="before")
    @classmethod
    def text_only(cls, value):
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("content must be a string or a list of text parts")
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"only text content is supported (part {i} is {kind!r})")
        return value

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p["text"] for p in self.content)
        return self.content or ""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool = False


class CommonFields(BaseModel):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None  # temperature, top_p, top_k: checked by SamplingParams (`request_settings`)
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    speculative: bool | None = None
    block_size: Annotated[int, Field(ge=1, le=256)] | Literal[AUTO] | None = None
    tree: int | str | None = None  # "auto", "off" or N draft-tree nodes (`tree_value`)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None

    @field_validator("tree", mode="before")
    @classmethod
    def tree_value(cls, value):
        """One message for every wrong `tree` (a union's per-member messages would not say what it takes)."""
        if value is None:
            return value
        try:
            return tree_value(value)  # the spellings `--tree` takes
        except SamplingError as e:
            got = repr(value) if isinstance(value, str) else json.dumps(value)
            got = got if len(got) <= 40 else got[:39] + "…"
            raise ValueError(f"{e.rule}, got {got}") from None


# `chat_template_kwargs` keys refused with a 400: the arguments of `apply_chat_template` itself and the
# variables the server fills (the conversation, the tools, the generation prompt, the special tokens). Each
# would change the prompt's format or what tokenizing returns, not just a template variable.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "add_special_tokens",
        "bos_token",
        "eos_token",
        "unk_token",
        "sep_token",
        "pad_token",
        "cls_token",
        "mask_token",
        "additional_special_tokens",
        "raise_exception",
        "strftime_now",
    }
)


class ChatCompletionRequest(CommonFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None  # 0..MAX_LOGPROBS, with `logprobs` (`logprobs_asked`)
    tools: list[ToolDefinition] | None = None
    tool_choice: Any = None  # checked by tools.plan_tools
    functions: list | None = None
    function_call: Any = None
    response_format: dict | None = None
    reasoning_effort: Literal[REASONING_LEVELS] | None = None
    chat_template_kwargs: dict | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def template_variables_only(cls, value):
        for key in value or {}:
            if key in RESERVED_TEMPLATE_KWARGS:
                raise ValueError(
                    f"{key!r} is set by the server, not by a request (it would change the prompt's "
                    "format); chat_template_kwargs sets only the template's own variables"
                )
        return value


class CompletionRequest(CommonFields):
    prompt: str | list[int] | list[str] = Field(min_length=1)
    logprobs: int | None = None  # 0..MAX_LOGPROBS alternatives (OpenAI's legacy API takes up to 5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


UNION_TAGS = {
    "str",
    "int",
    "float",
    "bool",
    "list[str]",
    "list[int]",
    "list[dict]",
    "dict",
    "none",
    "constrained-int",
    "literal['auto']",
    "function-after[text_only(), str]",
}


def check_messages(req: "ChatCompletionRequest") -> None:
    """What the field types alone do not say about a conversation."""
    for i, m in enumerate(req.messages):
        if m.content is None and m.role != "assistant":
            raise APIError(
                400, f"messages.{i}.content: a {m.role} message needs content", param=f"messages.{i}.content"
            )
        if m.role == "tool" and not m.tool_call_id:
            raise APIError(
                400,
                f"messages.{i}.tool_call_id: a tool message needs the id of the call it answers",
                param=f"messages.{i}.tool_call_id",
            )
        if m.tool_calls and m.role != "assistant":
            raise APIError(
                400,
                f"messages.{i}.tool_calls: only assistant messages hold tool calls",
                param=f"messages.{i}.tool_calls",
            )


MAX_JSON_DEPTH = 64  # arrays and objects nested deeper than this (tool schemas included) are refused


def check_json(body: Any) -> None:
    """What JSON allows but no field can use: nesting past `MAX_JSON_DEPTH`, and strings (or keys) holding a lone
    UTF-16 surrogate such as `"\\ud800"`, which is no character and cannot be encoded or tokenized."""

    def where(path: tuple) -> str | None:
        return ".".join(str(p) for p in path) or None

    stack = [(body, ())]
    while stack:
        value, path = stack.pop()
        if len(path) > MAX_JSON_DEPTH:
            raise APIError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels", param=where(path[:1]))
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                param = where(path)
                raise APIError(
                    400, f"{param or 'body'}: the string holds a lone surrogate (not valid Unicode)", param=param
                ) from None
        elif isinstance(value, dict):
            for key, item in value.items():
                stack.append((item, (*path, key)))
                stack.append((key, path))  # checked first: a bad key is not part of a param
        elif isinstance(value, list):
            stack.extend((item, (*path, i)) for i, item in enumerate(value))


def parse(model: type[BaseModel], body: Any) -> BaseModel:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    check_json(body)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        # Union members show up in `loc` by type name ("stop.str"); the client's field is what counts.
        param = ".".join(str(p) for p in err["loc"] if not (isinstance(p, str) and p in UNION_TAGS)) or None
        message = err["msg"].removeprefix("Value error, ")
        raise APIError(400, f"{param}: {message}" if param else message, param=param) from None


def refuse_unsupported(req: CommonFields) -> None:
    def no(param: str, what: str):
        raise APIError(400, f"{param}: {what} is not supported by mlx-glimmer serve", param=param)

    if req.n != 1:
        no("n", "more than one choice per request (n > 1)")
    if req.presence_penalty or req.frequency_penalty:
        no(
            "presence_penalty" if req.presence_penalty else "frequency_penalty",
            "a non-zero penalty (it would change the target's distribution)",
        )
    if req.logit_bias:
        no("logit_bias", "logit_bias")
    if isinstance(req, ChatCompletionRequest):
        if req.functions or req.function_call is not None:
            no("functions" if req.functions else "function_call", "the deprecated functions API (use tools)")
        if req.response_format and req.response_format.get("type", "text") != "text":
            no("response_format", "structured output")
        if req.messages[-1].role == "assistant":
            no("messages", "continuing a final assistant message")
    if isinstance(req, CompletionRequest):
        if req.suffix:
            no("suffix", "suffix")
        if req.best_of not in (None, 1):
            no("best_of", "best_of > 1")


def logprobs_asked(req: CommonFields) -> int | None:
    """How many alternatives each generated token's log-probability comes with (None: none asked). Chat:
    `logprobs: true` with `top_logprobs` (default 0); completions: `logprobs` itself. Both 0..MAX_LOGPROBS."""
    rule = f"must be a whole number in [0, {MAX_LOGPROBS}]"
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs: {rule}, got {req.top_logprobs}", param="top_logprobs")
        return (req.top_logprobs or 0) if req.logprobs else None
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise APIError(400, f"logprobs: {rule}, got {req.logprobs}", param="logprobs")
    return req.logprobs


def stop_strings(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > 4:
        raise APIError(400, "stop: at most 4 stop sequences", param="stop")
    if any(not s for s in stops):
        raise APIError(400, "stop: stop sequences must be non-empty strings", param="stop")
    return stops


def call_arguments(call: ToolCall, param: str) -> dict:
    """A history call's arguments as the object chat templates iterate over (mlx_lm.server decodes them too)."""
    args = call.function.arguments
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise APIError(400, f"{param}: not valid JSON: {e}", param=param) from None
    if not isinstance(args, dict):
        raise APIError(400, f"{param}: the arguments must be a JSON object", param=param)
    return args


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    """The conversation as the chat template takes it: assistant `tool_calls` with decoded arguments, and tool
    results with the name of the function they answer (looked up from the call they name)."""
    out, names = [], {}
    for i, m in enumerate(req.messages):
        role = "system" if m.role == "developer" else m.role
        msg = {"role": role, "content": m.text()}
        if m.tool_calls:
            msg["tool_calls"] = []
            for j, c in enumerate(m.tool_calls):
                args = call_arguments(c, f"messages.{i}.tool_calls.{j}.function.arguments")
                msg["tool_calls"].append(
                    {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}}
                )
                names[c.id] = c.function.name
        if m.role == "tool":
            msg["tool_call_id"] = m.tool_call_id
            if name := m.name or names.get(m.tool_call_id):
                msg["name"] = name
        if m.role == "assistant" and m.reasoning_content:
            msg["reasoning_content"] = m.reasoning_content
        out.append(msg)
    return out


def request_settings(
    req: CommonFields, defaults: GenerationSettings, prompt_tokens: int, max_context: int | None
) -> tuple[GenerationSettings, list[str]]:
    """A request's settings (its fields over the server's `defaults`) and stop strings, checked against the
    context limit."""
    if max_context is not None and prompt_tokens >= max_context:
        raise APIError(
            400,
            f"the prompt has {prompt_tokens} tokens; this model's context is {max_context} tokens",
            param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
            code="context_length_exceeded",
        )
    asked = (req.max_completion_tokens if isinstance(req, ChatCompletionRequest) else None) or req.max_tokens
    if asked is None:
        max_tokens = (
            defaults.max_tokens if max_context is None else min(defaults.max_tokens, max_context - prompt_tokens)
        )
    elif max_context is not None and prompt_tokens + asked > max_context:
        raise APIError(
            400,
            f"the prompt ({prompt_tokens} tokens) plus max_tokens ({asked}) exceeds this model's "
            f"context of {max_context} tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )
    else:
        max_tokens = asked
    own = {"speculative": req.speculative, "block_size": req.block_size, "tree": req.tree}
    try:
        # the request's own fields must agree with each other; one that disagrees with a server default wins
        # over it (`GenerationSettings.updated`)
        check_together({k: v for k, v in own.items() if v is not None})
        settings = defaults.updated(
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            seed=req.seed or 0,
            speculative=req.speculative,
            block_size=req.block_size,
            tree=req.tree,
            logprobs=logprobs_asked(req),
        )
    except SamplingError as e:  # a conflict names both fields in its message, the first as `param`
        raise APIError(400, str(e) if len(e.fields) > 1 else f"{e.field}: {e}", param=e.field) from None
    return settings, stop_strings(req.stop)


# ---- response bodies ------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(stats: GenerationStats) -> dict:
    reused = stats.prompt_tokens - stats.prefill_tokens
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": reused},
    }


def glimmer_stats(stats: GenerationStats, queue_wait_s: float, batched_tokens: int = 0, batch_size: int = 1) -> dict:
    """Our own figures of a response. `batched_tokens`: completion tokens decoded in a batch with other
    requests; `batch_size`: the most requests it was decoded together with (1: alone throughout)."""
    return {
        "prefill_tokens": stats.prefill_tokens,
        "reused_tokens": stats.prompt_tokens - stats.prefill_tokens,
        "mean_acceptance": stats.mean_acceptance,
        "target_forwards": stats.target_forwards,
        "decode_tokens_per_second": stats.decode_tokens_per_second,
        "prefill_tokens_per_second": stats.prefill_tokens_per_second,
        "ttft_s": stats.ttft_s,
        "queue_wait_s": queue_wait_s,
        "block_size": stats.block_size,
        "drafter": stats.drafter_kind,
        "batched_tokens": batched_tokens,
        "batch_size": batch_size,
    }


@dataclass
class ResponseShape:
    """What differs between chat and plain completions in a response body."""

    chat: bool
    id: str
    model: str
    created: int

    @classmethod
    def new(cls, chat: bool, model: str) -> "ResponseShape":
        return cls(chat, new_id("chatcmpl" if chat else "cmpl"), model, int(time.time()))

    def _envelope(self, stream: bool) -> dict:
        kind = ("chat.completion.chunk" if stream else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(
        self,
        text: str,
        finish_reason: str,
        stats: GenerationStats,
        queue_wait_s: float,
        *,
        reasoning: str = "",
        tool_calls: list[dict] | None = None,
        batched_tokens: int = 0,
        batch_size: int = 1,
        logprobs: dict | None = None,
    ) -> dict:
        if self.chat:
            message = {"role": "assistant", "content": text if text or not tool_calls else None}
            if reasoning:
                message["reasoning_content"] = reasoning
            if tool_calls:
                message["tool_calls"] = tool_calls
            choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return {
            **self._envelope(False),
            "choices": [choice],
            "usage": usage(stats),
            "glimmer": glimmer_stats(stats, queue_wait_s, batched_tokens, batch_size),
        }

    def chunk(
        self,
        text: str | None = None,
        finish_reason: str | None = None,
        *,
        role: bool = False,
        reasoning: str | None = None,
        tool_calls: list[dict] | None = None,
        logprobs: dict | None = None,
    ) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
            if reasoning is not None:
                delta["reasoning_content"] = reasoning
            if tool_calls is not None:
                delta["tool_calls"] = tool_calls
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        return {**self._envelope(True), "choices": [choice]}

    def final_chunk(
        self,
        finish_reason: str,
        stats: GenerationStats,
        queue_wait_s: float,
        batched_tokens: int = 0,
        batch_size: int = 1,
    ) -> dict:
        return {
            **self.chunk(None, finish_reason),
            "glimmer": glimmer_stats(stats, queue_wait_s, batched_tokens, batch_size),
        }

    def usage_chunk(self, stats: GenerationStats) -> dict:
        return {**self._envelope(True), "choices": [], "usage": usage(stats)}
