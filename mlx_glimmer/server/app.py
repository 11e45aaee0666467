"""`mlx-glimmer serve`: an OpenAI-compatible HTTP server on the speculative loop (FastAPI on uvicorn).

Routes follow mlx_lm.server: `POST /v1/chat/completions` and `POST
/v1/completions` (JSON, or SSE with `"stream": true`), `GET /v1/models`,
`GET /health`, and `GET /metrics` (Prometheus text). Responses carry the
standard `usage` and our own figures in a `glimmer` object. Chat replies come
back split (tools.py): reasoning in `reasoning_content`, tool calls parsed
into `tool_calls`, the rest in `content`. Log-probabilities, when asked, come
with the text they belong to (`ResponseExtras`), as does a completion's echo.

Requests are validated and tokenized on the HTTP side, then queued for the
one generation thread (`worker.GenerationWorker`), which decodes concurrent
requests together when that pays (`batch.py`); a full queue answers 503 with
Retry-After. A client that goes away cancels its request.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from jinja2 import TemplateError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..chat_template import reasoning_kwargs
from ..errors import GlimmerError
from ..generate import encode_prompt
from ..logprobs import TokenLogprob
from ..settings import BatchSettings, GenerationSettings
from .continuation import prompt_text, text_offsets
from .logprob_shapes import TokenPieces, chat_logprobs, completion_logprobs
from .metrics import metrics_text
from .protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ResponseShape,
    chat_messages,
    check_messages,
    error_body,
    parse,
    refuse_unsupported,
    request_settings,
)
from .run import Delta, Failed, Finished, GenerationRequest, Job, PromptLogprobs
from .tools import ResponseParser, ToolPlan, plan_tools, with_instruction
from .worker import GenerationWorker, QueueFull

DEFAULT_CONTEXT = 131072  # when the target's config names no max_position_embeddings


@dataclass
class ServerState:
    worker: GenerationWorker
    model_name: str
    defaults: GenerationSettings  # for what a request leaves out (the serve flags)
    max_context: int | None = None
    chat_template_kwargs: dict = field(default_factory=dict)
    tokenizer_lock: threading.Lock = field(default_factory=threading.Lock)
    started: float = field(default_factory=time.time)

    @property
    def pair(self):
        return self.worker.pair


def model_context(pair) -> int:
    config = pair.target.config
    for cfg in (config, config.get("text_config") or {}):
        if isinstance(cfg.get("max_position_embeddings"), int):
            return cfg["max_position_embeddings"]
    return DEFAULT_CONTEXT


# ---- request handling --------------------------------------------------------------------------------


def max_body_bytes(server: ServerState) -> int:
    """A body far beyond what the context could hold is refused (413) before it is read or tokenized."""
    return max(1 << 20, 64 * (server.max_context or DEFAULT_CONTEXT))


async def read_json(request: Request):
    kind = request.headers.get("content-type", "")
    if not json_content_type(kind):
        raise APIError(415, f"the request body must be JSON (Content-Type: application/json), not {kind!r}")
    limit = max_body_bytes(request.app.state.server)
    too_large = APIError(413, f"the request body is larger than this server accepts ({limit} bytes)")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise too_large
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"could not parse the JSON body: {e}") from None
    except RecursionError:  # thousands of nested `[`: deeper than any request (check_json refuses past 64)
        raise APIError(400, "could not parse the JSON body: it nests too deeply") from None


def json_content_type(value: str) -> bool:
    """No Content-Type, or a JSON one (`application/json`, `application/*+json`): a form or a file upload is not a
    JSON body."""
    kind = value.split(";", 1)[0].strip().lower()
    return not kind or kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def check_model(server: ServerState, model: str | None) -> None:
    if model not in (None, "", server.model_name, "default", "default_model"):
        raise APIError(
            404,
            f"the model '{model}' does not exist; this server serves '{server.model_name}'",
            param="model",
            code="model_not_found",
        )


def tokenize(server: ServerState, req, plan: ToolPlan | None = None) -> list[int]:
    tokenizer = server.pair.tokenizer
    with server.tokenizer_lock:  # HF tokenizers may refuse concurrent use from several threads
        if isinstance(req, ChatCompletionRequest):
            plan = plan or ToolPlan()
            messages = with_instruction(chat_messages(req), plan.instruction)
            kwargs = {
                **server.chat_template_kwargs,
                **reasoning_kwargs(tokenizer, req.reasoning_effort),
                **({"tools": plan.tools} if plan.tools else {}),
                **(req.chat_template_kwargs or {}),
            }
            try:
                return encode_prompt(tokenizer, messages, kwargs)
            except GlimmerError as e:
                raise APIError(400, str(e), param="messages") from None
            except TemplateError as e:  # the chat template refused the conversation (raise_exception)
                raise APIError(400, f"the chat template refused these messages: {e}", param="messages") from None
            except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
                # The template choked on what the client gave it (a variable of chat_template_kwargs of a type it
                # cannot use, say): the request's doing, as the same template renders well-formed requests.
                param = "chat_template_kwargs" if req.chat_template_kwargs else "messages"
                raise APIError(
                    400, f"the chat template could not render this request ({type(e).__name__}: {e})", param=param
                ) from None
        prompt = req.prompt
        if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise APIError(400, "prompt: a list of several prompts (batching) is not supported", param="prompt")
        prompt = the_prompt(req)
        if isinstance(prompt, str):
            return list(tokenizer.encode(prompt))
        vocab = server.pair.target.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise APIError(400, f"prompt: token ids must lie in [0, {vocab})", param="prompt")
        return list(prompt)


def the_prompt(req: CompletionRequest) -> str | list[int]:
    """A completion's one prompt: a string, or token ids."""
    prompt = req.prompt
    return prompt[0] if isinstance(prompt, list) and isinstance(prompt[0], str) else prompt


async def completion(request: Request, chat: bool):
    server: ServerState = request.app.state.server
    req = parse(ChatCompletionRequest if chat else CompletionRequest, await read_json(request))
    check_model(server, req.model)
    refuse_unsupported(req)
    plan = None
    if chat:
        check_messages(req)
        plan = plan_tools(req, server.pair.tokenizer, server.model_name)
    tokens = await run_in_threadpool(tokenize, server, req, plan)
    if not tokens:
        raise APIError(400, "the prompt is empty", param="messages" if chat else "prompt")
    settings, stop = request_settings(req, server.defaults, len(tokens), server.max_context)
    extras = await run_in_threadpool(ResponseExtras.of, server, req, tokens, settings)
    gen = GenerationRequest(
        tokens,
        settings,
        stop,
        prompt_logprobs=extras.echo is not None and extras.logprobs,
        continuation=not chat,
        ids_prompt=not chat and not isinstance(the_prompt(req), str),
    )
    reader = ResponseParser(server.pair.tokenizer, tokens, plan) if chat else None

    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def emit(event) -> None:
        try:
            loop.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:  # the event loop is gone (server shutting down)
            pass

    job = Job(gen, emit)
    try:
        server.worker.submit(job)
    except QueueFull:
        raise APIError(
            503,
            "the server is busy: its request queue is full; retry later",
            type="server_error",
            code="overloaded",
            headers={"Retry-After": str(retry_after(server))},
        ) from None
    shape = ResponseShape.new(chat, server.model_name)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(
            stream_events(job, events, shape, include_usage, reader, extras),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    return await whole_response(request, job, events, shape, reader, extras)


@dataclass
class ResponseExtras:
    """What a response carries besides the generated text: the prompt's text first (a completion's `echo`),
    and log-probabilities in the endpoint's shape, each with the text it belongs to. For completions each token
    comes with its offset in the choice's text (`text_offset`): the echoed prompt's from `prompt_offsets`, the
    generated ones' from their `Delta`s (counted from the end of the echo)."""

    chat: bool
    pieces: TokenPieces | None = None  # log-probabilities asked
    echo: str | None = None  # the echoed prompt
    prompt_tokens: list[int] = field(default_factory=list)
    prompt_offsets: list[int] = field(default_factory=list)  # of the echoed prompt's tokens, with log-probabilities

    @classmethod
    def of(cls, server: ServerState, req, tokens: list[int], settings: GenerationSettings) -> ResponseExtras:
        chat = isinstance(req, ChatCompletionRequest)
        tokenizer = server.pair.tokenizer
        pieces = TokenPieces(tokenizer) if settings.logprobs is not None else None
        echo, offsets = None, []
        if not chat and req.echo:
            prompt = the_prompt(req)
            with server.tokenizer_lock:
                echo = prompt if isinstance(prompt, str) else prompt_text(tokenizer, prompt)
                if pieces is not None:
                    offsets = text_offsets(tokenizer, tokens, echo)
        return cls(chat, pieces, echo, tokens, offsets)

    @property
    def logprobs(self) -> bool:
        return self.pieces is not None

    def shaped(self, logprobs: list[TokenLogprob], offsets: list[int] | None = None) -> dict:
        """Generated tokens' `logprobs` in the endpoint's shape (completions: with their `offsets` in the
        completion's text)."""
        if self.chat:
            return chat_logprobs(self.pieces, logprobs)
        start = len(self.echo or "")
        tokens = [lp.token for lp in logprobs]
        return completion_logprobs(self.pieces, tokens, logprobs, [start + offset for offset in offsets or []])

    def shaped_prompt(self, logprobs: list[TokenLogprob | None]) -> dict:
        """The echoed prompt's log-probabilities, in the completions' shape."""
        return completion_logprobs(self.pieces, self.prompt_tokens, logprobs, self.prompt_offsets)

    def whole(
        self, prompt: list[TokenLogprob | None] | None, generated: list[TokenLogprob], offsets: list[int]
    ) -> dict:
        """A whole response's log-probabilities: the echoed prompt's (None: not asked), then the generated
        tokens', the same lists a stream sends piece by piece."""
        if prompt is None:
            return self.shaped(generated, offsets)
        first = self.shaped_prompt(prompt)
        return {key: first[key] + values for key, values in self.shaped(generated, offsets).items()}


def retry_after(server: ServerState) -> int:
    m = server.worker.metrics.snapshot()
    done = sum(m.requests.values()) or 1
    per_request = (m.decode_s + m.prefill_s) / done
    return max(1, min(60, math.ceil(per_request * (server.worker.queue_depth + 1))))


TOOL_CHOICE_STATUS = 422  # a valid request whose tool_choice the reply did not meet (not retried by clients)


def tool_choice_error(message: str) -> dict:
    return error_body(message, code="tool_choice_not_met")


def final_reason(finish_reason: str, calls: list[dict]) -> str:
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason


async def whole_response(
    request: Request,
    job: Job,
    events: asyncio.Queue,
    shape: ResponseShape,
    reader: ResponseParser | None = None,
    extras: ResponseExtras | None = None,
):
    extras = extras or ResponseExtras(shape.chat)
    text, reasoning = [extras.echo or ""], []
    prompt_logprobs, logprobs, offsets = None, [], []

    def add(parts):
        for kind, value in parts:
            if kind != "tool_calls":
                (reasoning if kind == "reasoning" else text).append(value)

    try:
        while True:
            try:
                event = await asyncio.wait_for(events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancelled.set()
                    return JSONResponse(error_body("client disconnected"), status_code=499)
                continue
            if isinstance(event, Delta):
                add(reader.feed(event.text) if reader else [("content", event.text)])
                logprobs += event.logprobs or []
                offsets += event.offsets or []
            elif isinstance(event, PromptLogprobs):
                prompt_logprobs = event.logprobs
            elif isinstance(event, Finished):
                calls = []
                if reader is not None:
                    add(reader.finish())
                    calls, error = reader.plan.check(reader.calls)
                    if error:
                        return JSONResponse(tool_choice_error(error), status_code=TOOL_CHOICE_STATUS)
                return JSONResponse(
                    shape.whole(
                        "".join(text),
                        final_reason(event.finish_reason, calls),
                        event.stats,
                        event.queue_wait_s,
                        reasoning="".join(reasoning),
                        tool_calls=calls,
                        batched_tokens=event.batched_tokens,
                        batch_size=event.batch_size,
                        logprobs=extras.whole(prompt_logprobs, logprobs, offsets) if extras.logprobs else None,
                    )
                )
            elif isinstance(event, Failed):
                return JSONResponse(error_body(event.message, "server_error"), status_code=500)
    finally:
        job.cancelled.set()  # no-op once finished; stops the job if this handler was cancelled


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def part_chunks(shape: ResponseShape, parts, first_index: int = 0) -> list[dict]:
    """SSE chunks for parsed parts: adjacent text of one kind in one chunk, each call with its stream index."""
    chunks, index = [], first_index
    for kind, value in parts:
        if kind == "tool_calls":
            calls = [{"index": index + i, **c} for i, c in enumerate(value)]
            index += len(calls)
            chunks.append(("tool_calls", shape.chunk(tool_calls=calls)))
            continue
        field = "reasoning_content" if kind == "reasoning" else "content"
        if chunks and chunks[-1][0] == kind:
            chunks[-1][1]["choices"][0]["delta"][field] += value
        else:
            chunks.append((kind, shape.chunk(value) if kind == "content" else shape.chunk(reasoning=value)))
    return [c for _, c in chunks]


async def stream_events(
    job: Job,
    events: asyncio.Queue,
    shape: ResponseShape,
    include_usage: bool,
    reader: ResponseParser | None = None,
    extras: ResponseExtras | None = None,
):
    extras = extras or ResponseExtras(shape.chat)
    held = []  # with tool_choice required / named: content and calls wait until the reply has been checked
    enforced = reader is not None and reader.plan.enforced
    sent_calls = 0

    def emit(parts) -> list[dict]:
        nonlocal sent_calls
        if enforced:
            held.extend(p for p in parts if p[0] != "reasoning")
            parts = [p for p in parts if p[0] == "reasoning"]
        out = part_chunks(shape, parts, sent_calls)
        sent_calls += sum(len(v) for k, v in parts if k == "tool_calls")
        return out

    def with_logprobs(chunks: list[dict], delta: Delta) -> list[dict]:
        """A delta's log-probabilities ride on its first chunk, or on an empty one when none goes out now (its
        text held back, or only a tool call's start)."""
        if delta.logprobs:
            chunks = chunks or [shape.chunk("")]
            chunks[0]["choices"][0]["logprobs"] = extras.shaped(delta.logprobs, delta.offsets)
        return chunks

    try:
        if shape.chat:
            yield sse(shape.chunk(role=True))
        if extras.echo is not None and not extras.logprobs:
            yield sse(shape.chunk(extras.echo))
        while True:
            event = await events.get()
            if isinstance(event, PromptLogprobs):
                yield sse(shape.chunk(extras.echo, logprobs=extras.shaped_prompt(event.logprobs)))
            elif isinstance(event, Delta):
                chunks = emit(reader.feed(event.text)) if reader else [shape.chunk(event.text)]
                for chunk in with_logprobs(chunks, event):
                    yield sse(chunk)
            elif isinstance(event, Finished):
                finish = event.finish_reason
                if reader is not None:
                    for chunk in emit(reader.finish()):
                        yield sse(chunk)
                    calls, error = reader.plan.check(reader.calls)
                    if error:
                        yield sse(tool_choice_error(error))
                        yield sse("[DONE]")
                        return
                    if enforced:
                        allowed = {id(c) for c in calls}
                        kept = [(k, v if k != "tool_calls" else [c for c in v if id(c) in allowed]) for k, v in held]
                        for chunk in part_chunks(shape, [(k, v) for k, v in kept if v]):
                            yield sse(chunk)
                    finish = final_reason(finish, calls)
                yield sse(
                    shape.final_chunk(finish, event.stats, event.queue_wait_s, event.batched_tokens, event.batch_size)
                )
                if include_usage:
                    yield sse(shape.usage_chunk(event.stats))
                yield sse("[DONE]")
                return
            elif isinstance(event, Failed):
                yield sse(error_body(event.message, "server_error"))
                yield sse("[DONE]")
                return
    finally:
        job.cancelled.set()  # the client went away (or we are done): stop generating after this round


# ---- the app --------------------------------------------------------------------------------------------


def create_app(server: ServerState) -> FastAPI:
    app = FastAPI(title="mlx-glimmer", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        code = "not_found" if e.status_code == 404 else None
        return JSONResponse(
            error_body(f"{request.method} {request.url.path}: {e.detail}", code=code), status_code=e.status_code
        )

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        print(f"mlx-glimmer serve: internal error on {request.url.path}: {type(e).__name__}: {e}", file=sys.stderr)
        return JSONResponse(error_body("internal server error", "server_error"), status_code=500)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await completion(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await completion(request, chat=False)

    def model_card() -> dict:
        return {"id": server.model_name, "object": "model", "created": int(server.started), "owned_by": "mlx-glimmer"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(server, model_id)
        return model_card()

    @app.get("/health")
    async def health():
        w = server.worker
        return {"status": "ok", "model": server.model_name, "queue_depth": w.queue_depth, "busy": w.busy}

    @app.get("/metrics")
    async def metrics():
        w = server.worker
        text = metrics_text(
            w.metrics,
            queue_depth=w.queue_depth,
            busy=w.busy,
            prompt_cache_max_bytes=w.prompt_cache_bytes,
            uptime_s=time.time() - server.started,
        )
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return app


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise GlimmerError(f"serve: cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(128)
    return sock


def serve(
    load_pair,
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    model_name: str | None = None,
    defaults: GenerationSettings,
    max_queue: int = 32,
    prompt_cache_bytes: int = 1 << 30,
    max_context: int | None = None,
    log_level: str = "warning",
    batch: BatchSettings = BatchSettings(),
) -> None:
    """Load the pair on the generation thread, then serve until interrupted."""
    import uvicorn

    sock = bind(host, port)  # before loading: a taken port fails fast
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"mlx-glimmer serve: warning: listening on {host}, beyond this machine, with no authentication",
            file=sys.stderr,
        )
    worker = GenerationWorker(load_pair, max_queue=max_queue, prompt_cache_bytes=prompt_cache_bytes, batch=batch)
    pair = worker.start()
    if batch.max_batch > 1 and worker.batch_unsupported:
        print(f"mlx-glimmer serve: requests are served one at a time: {worker.batch_unsupported}", file=sys.stderr)
    server = ServerState(worker, model_name or pair.name, defaults, max_context or model_context(pair))
    app = create_app(server)
    actual = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    together = f"up to {batch.max_batch} requests decoded together" if worker.can_batch else "one request at a time"
    print(
        f"mlx-glimmer serve: '{server.model_name}' ({'drafter ' + pair.drafter.kind if pair.drafter else 'no drafter'}, "
        f"context {server.max_context}, {together}) at http://{shown}:{actual}/v1",
        file=sys.stderr,
        flush=True,
    )

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            worker.cancel_all()  # open streams end after their current round, so shutdown does not wait on them
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=10)
    try:
        Server(config).run(sockets=[sock])
    finally:
        worker.close(timeout=5)
