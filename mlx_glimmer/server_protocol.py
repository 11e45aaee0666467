"""The OpenAI wire format: request bodies in, validated `GenerationRequest`s and response bodies out.

Bad input becomes an `APIError` (an OpenAI-style error body with a 4xx
status), never a traceback. Fields we do not implement are refused with a
clear 400 when a client asks for them (`n > 1`, tools, logprobs, penalties,
`logit_bias`, structured output); harmless ones (`user`, `metadata`, ...)
are ignored.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .generate import GenerationStats


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_body(message: str, type: str = "invalid_request_error", code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": None, "code": code}}


# ---- request bodies -------------------------------------------------------------------------------


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict] | None = None

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
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class CommonFields(BaseModel):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    speculative: bool | None = None
    block_size: int | None = Field(None, ge=1, le=256)
    logprobs: bool | int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None


class ChatCompletionRequest(CommonFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: Any = None
    functions: list | None = None
    response_format: dict | None = None
    reasoning_effort: Literal["low", "medium", "high", "xhigh"] | None = None
    chat_template_kwargs: dict | None = None


class CompletionRequest(CommonFields):
    prompt: str | list[int] | list[str] = Field(min_length=1)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


UNION_TAGS = {"str", "int", "float", "bool", "list[str]", "list[int]", "list[dict]", "dict", "none", "function-after[text_only(), str]"}


def parse(model: type[BaseModel], body: Any) -> BaseModel:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
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
    if req.logprobs:
        no("logprobs", "logprobs")
    if req.presence_penalty or req.frequency_penalty:
        no("presence_penalty" if req.presence_penalty else "frequency_penalty", "a non-zero penalty (it would change the target's distribution)")
    if req.logit_bias:
        no("logit_bias", "logit_bias")
    if isinstance(req, ChatCompletionRequest):
        if req.tools or req.functions or req.tool_choice not in (None, "none"):
            no("tools", "tool calling")
        if req.top_logprobs:
            no("top_logprobs", "logprobs")
        if req.response_format and req.response_format.get("type", "text") != "text":
            no("response_format", "structured output")
        if req.messages[-1].role == "assistant":
            no("messages", "continuing a final assistant message")
    if isinstance(req, CompletionRequest):
        if req.echo:
            no("echo", "echo")
        if req.suffix:
            no("suffix", "suffix")
        if req.best_of not in (None, 1):
            no("best_of", "best_of > 1")


def stop_strings(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > 4:
        raise APIError(400, "stop: at most 4 stop sequences", param="stop")
    if any(not s for s in stops):
        raise APIError(400, "stop: stop sequences must be non-empty strings", param="stop")
    return stops


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    out = []
    for m in req.messages:
        role = "system" if m.role == "developer" else m.role
        out.append({"role": role, "content": m.text()})
    return out


@dataclass
class Defaults:
    """Server-side defaults for fields a request leaves out (the `serve` flags)."""

    max_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    speculative: bool = True
    block_size: int | None = None


def sampling_fields(req: CommonFields, defaults: Defaults, prompt_tokens: int, max_context: int | None) -> dict:
    """max_tokens, sampling and speculation settings of a request, checked against the context limit."""
    if max_context is not None and prompt_tokens >= max_context:
        raise APIError(400, f"the prompt has {prompt_tokens} tokens; this model's context is {max_context} tokens",
                       param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                       code="context_length_exceeded")
    asked = getattr(req, "max_completion_tokens", None) or req.max_tokens
    if asked is None:
        max_tokens = defaults.max_tokens if max_context is None else min(defaults.max_tokens, max_context - prompt_tokens)
    elif max_context is not None and prompt_tokens + asked > max_context:
        raise APIError(400, f"the prompt ({prompt_tokens} tokens) plus max_tokens ({asked}) exceeds this model's "
                       f"context of {max_context} tokens", param="max_tokens", code="context_length_exceeded")
    else:
        max_tokens = asked
    return dict(
        max_tokens=max_tokens,
        temperature=defaults.temperature if req.temperature is None else req.temperature,
        top_p=defaults.top_p if req.top_p is None else req.top_p,
        top_k=defaults.top_k if req.top_k is None else req.top_k,
        seed=req.seed or 0,
        speculative=defaults.speculative if req.speculative is None else req.speculative,
        block_size=req.block_size or defaults.block_size,
        stop=stop_strings(req.stop),
    )


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


def glimmer_stats(stats: GenerationStats, queue_wait_s: float) -> dict:
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

    def whole(self, text: str, finish_reason: str, stats: GenerationStats, queue_wait_s: float) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._envelope(False), "choices": [choice], "usage": usage(stats),
                "glimmer": glimmer_stats(stats, queue_wait_s)}

    def chunk(self, text: str | None = None, finish_reason: str | None = None, *, role: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return {**self._envelope(True), "choices": [choice]}

    def final_chunk(self, finish_reason: str, stats: GenerationStats, queue_wait_s: float) -> dict:
        return {**self.chunk(None, finish_reason), "glimmer": glimmer_stats(stats, queue_wait_s)}

    def usage_chunk(self, stats: GenerationStats) -> dict:
        return {**self._envelope(True), "choices": [], "usage": usage(stats)}
