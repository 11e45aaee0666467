"""`mlx-glimmer serve`: an OpenAI-compatible HTTP server on the speculative loop (FastAPI on uvicorn).

Routes follow mlx_lm.server: `POST /v1/chat/completions` and `POST
/v1/completions` (JSON, or SSE with `"stream": true`), `GET /v1/models`,
`GET /health`, and `GET /metrics` (Prometheus text). Responses carry the
standard `usage` and our own figures in a `glimmer` object.

Requests are validated and tokenized on the HTTP side, then queued for the
one generation thread (`server_worker.GenerationWorker`); a full queue
answers 503 with Retry-After. A client that goes away cancels its request.
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
from jinja2 import TemplateError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from .errors import GlimmerError
from .generate import encode_prompt
from .server_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    Defaults,
    ResponseShape,
    chat_messages,
    error_body,
    parse,
    refuse_unsupported,
    sampling_fields,
)
from .server_worker import Delta, Failed, Finished, GenerationRequest, GenerationWorker, Job, QueueFull

DEFAULT_CONTEXT = 131072  # when the target's config names no max_position_embeddings


@dataclass
class ServerState:
    worker: GenerationWorker
    model_name: str
    defaults: Defaults = field(default_factory=Defaults)
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


def supports_reasoning_strength(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    text = "\n".join(map(str, template.values())) if isinstance(template, dict) else str(template or "")
    return "reasoning_strength" in text


# ---- request handling --------------------------------------------------------------------------------


def max_body_bytes(server: ServerState) -> int:
    """A body far beyond what the context could hold is refused (413) before it is read or tokenized."""
    return max(1 << 20, 64 * (server.max_context or DEFAULT_CONTEXT))


async def read_json(request: Request):
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


def check_model(server: ServerState, model: str | None) -> None:
    if model not in (None, "", server.model_name, "default", "default_model"):
        raise APIError(404, f"the model '{model}' does not exist; this server serves '{server.model_name}'",
                       param="model", code="model_not_found")


def tokenize(server: ServerState, req) -> list[int]:
    tokenizer = server.pair.tokenizer
    with server.tokenizer_lock:  # HF tokenizers may refuse concurrent use from several threads
        if isinstance(req, ChatCompletionRequest):
            messages = chat_messages(req)
            kwargs = dict(server.chat_template_kwargs)
            if req.reasoning_effort and supports_reasoning_strength(tokenizer):
                kwargs["reasoning_strength"] = req.reasoning_effort
            kwargs.update(req.chat_template_kwargs or {})
            try:
                return encode_prompt(tokenizer, messages, kwargs)
            except GlimmerError as e:
                raise APIError(400, str(e), param="messages") from None
            except TemplateError as e:  # the chat template refused the conversation (raise_exception)
                raise APIError(400, f"the chat template refused these messages: {e}", param="messages") from None
        prompt = req.prompt
        if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise APIError(400, "prompt: a list of several prompts (batching) is not supported", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return list(tokenizer.encode(prompt))
        vocab = server.pair.target.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise APIError(400, f"prompt: token ids must lie in [0, {vocab})", param="prompt")
        return list(prompt)


async def completion(request: Request, chat: bool):
    server: ServerState = request.app.state.server
    req = parse(ChatCompletionRequest if chat else CompletionRequest, await read_json(request))
    check_model(server, req.model)
    refuse_unsupported(req)
    if chat:
        for i, m in enumerate(req.messages):
            if m.content is None and m.role != "assistant":
                raise APIError(400, f"messages.{i}.content: a {m.role} message needs content", param=f"messages.{i}.content")
    tokens = await run_in_threadpool(tokenize, server, req)
    if not tokens:
        raise APIError(400, "the prompt is empty", param="messages" if chat else "prompt")
    fields = sampling_fields(req, server.defaults, len(tokens), server.max_context)
    gen = GenerationRequest(prompt_tokens=tokens, **fields)

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
        raise APIError(503, "the server is busy: its request queue is full; retry later", type="server_error",
                       code="overloaded", headers={"Retry-After": str(retry_after(server))}) from None
    shape = ResponseShape.new(chat, server.model_name)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(stream_events(job, events, shape, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await whole_response(request, job, events, shape)


def retry_after(server: ServerState) -> int:
    m = server.worker.metrics.snapshot()
    done = sum(m.requests.values()) or 1
    per_request = (m.decode_s + m.prefill_s) / done
    return max(1, min(60, math.ceil(per_request * (server.worker.queue_depth + 1))))


async def whole_response(request: Request, job: Job, events: asyncio.Queue, shape: ResponseShape):
    text = []
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
                text.append(event.text)
            elif isinstance(event, Finished):
                return JSONResponse(shape.whole("".join(text), event.finish_reason, event.stats, event.queue_wait_s))
            elif isinstance(event, Failed):
                return JSONResponse(error_body(event.message, "server_error"), status_code=500)
    finally:
        job.cancelled.set()  # no-op once finished; stops the job if this handler was cancelled


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def stream_events(job: Job, events: asyncio.Queue, shape: ResponseShape, include_usage: bool):
    try:
        if shape.chat:
            yield sse(shape.chunk(role=True))
        while True:
            event = await events.get()
            if isinstance(event, Delta):
                yield sse(shape.chunk(event.text))
            elif isinstance(event, Finished):
                yield sse(shape.final_chunk(event.finish_reason, event.stats, event.queue_wait_s))
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


def metrics_text(server: ServerState) -> str:
    w, m = server.worker, server.worker.metrics.snapshot()
    cache = m.prefix_cache
    lines = []

    def metric(name: str, kind: str, help: str, samples: list[tuple[str, float]] | float):
        lines.append(f"# HELP glimmer_{name} {help}")
        lines.append(f"# TYPE glimmer_{name} {kind}")
        for labels, value in samples if isinstance(samples, list) else [("", samples)]:
            lines.append(f"glimmer_{name}{labels} {value:g}" if isinstance(value, float) else f"glimmer_{name}{labels} {value}")

    metric("requests_total", "counter", "requests finished, by finish reason",
           [(f'{{finish_reason="{k}"}}', v) for k, v in sorted(m.requests.items())] or [('{finish_reason="stop"}', 0)])
    metric("rejected_requests_total", "counter", "requests refused with 503 (queue full)", m.rejected)
    metric("queue_depth", "gauge", "requests waiting for the generation thread", w.queue_depth)
    metric("busy", "gauge", "1 while a request is generating", int(w.busy))
    metric("prompt_tokens_total", "counter", "prompt tokens of finished requests", m.prompt_tokens)
    metric("prefill_tokens_total", "counter", "prompt tokens actually prefilled", m.prefill_tokens)
    metric("reused_tokens_total", "counter", "prompt tokens served from the prefix cache", m.reused_tokens)
    metric("generated_tokens_total", "counter", "tokens generated", m.generated_tokens)
    metric("target_forwards_total", "counter", "target verify forwards after prefill", m.target_forwards)
    metric("mean_acceptance", "gauge", "tokens committed per target forward, all requests", float(m.mean_acceptance))
    metric("decode_tokens_per_second", "gauge", "decode speed over all requests",
           float((m.generated_tokens - sum(m.requests.values())) / m.decode_s) if m.decode_s else 0.0)
    metric("last_decode_tokens_per_second", "gauge", "decode speed of the last request", float(m.last_decode_tokens_per_second))
    metric("prefill_tokens_per_second", "gauge", "prefill speed over all requests",
           float(m.prefill_tokens / m.prefill_s) if m.prefill_s else 0.0)
    metric("queue_wait_seconds_total", "counter", "time requests spent queued", float(m.queue_wait_s))
    metric("block_size_requests_total", "counter", "requests by draft block width",
           [(f'{{block_size="{k}"}}', v) for k, v in sorted(m.block_sizes.items())] or [('{block_size="1"}', 0)])
    metric("rounds_by_committed_tokens_total", "counter", "verify rounds by tokens committed (acceptance histogram)",
           [(f'{{committed="{k}"}}', v) for k, v in sorted(m.acceptance.items())] or [('{committed="1"}', 0)])
    metric("prefix_cache_hits_total", "counter", "requests that reused a cached conversation", cache.hits)
    metric("prefix_cache_forks_total", "counter", "hits served by a copy of a conversation that stays cached", cache.forks)
    metric("prefix_cache_misses_total", "counter", "requests that started cold", cache.misses)
    metric("prefix_cache_evictions_total", "counter", "conversations evicted", cache.evictions)
    metric("prefix_cache_entries", "gauge", "conversations cached", m.prefix_cache_entries)
    metric("prefix_cache_bytes", "gauge", "bytes held by cached conversations", m.prefix_cache_bytes)
    metric("prefix_cache_max_bytes", "gauge", "prefix cache bound", w.prompt_cache_bytes)
    metric("active_memory_bytes", "gauge", "MLX active memory (sampled when idle)", m.active_memory_bytes)
    metric("cache_memory_bytes", "gauge", "MLX buffer cache (sampled when idle)", m.cache_memory_bytes)
    metric("peak_memory_bytes", "gauge", "MLX peak memory of any request", m.peak_memory_bytes)
    metric("uptime_seconds", "gauge", "seconds since the server started", float(time.time() - server.started))
    return "\n".join(lines) + "\n"


def create_app(server: ServerState) -> FastAPI:
    app = FastAPI(title="mlx-glimmer", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        code = "not_found" if e.status_code == 404 else None
        return JSONResponse(error_body(f"{request.method} {request.url.path}: {e.detail}", code=code),
                            status_code=e.status_code)

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
        return PlainTextResponse(metrics_text(server), media_type="text/plain; version=0.0.4")

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


def serve(load_pair, *, host: str = "127.0.0.1", port: int = 8080, model_name: str | None = None,
          defaults: Defaults | None = None, max_queue: int = 32, prompt_cache_bytes: int = 1 << 30,
          max_context: int | None = None, log_level: str = "warning") -> None:
    """Load the pair on the generation thread, then serve until interrupted."""
    import uvicorn

    sock = bind(host, port)  # before loading: a taken port fails fast
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(f"mlx-glimmer serve: warning: listening on {host}, beyond this machine, with no authentication",
              file=sys.stderr)
    worker = GenerationWorker(load_pair, max_queue=max_queue, prompt_cache_bytes=prompt_cache_bytes)
    pair = worker.start()
    server = ServerState(worker, model_name or pair.name, defaults or Defaults(),
                         max_context or model_context(pair))
    app = create_app(server)
    actual = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    print(f"mlx-glimmer serve: '{server.model_name}' ({'drafter ' + pair.drafter.kind if pair.drafter else 'no drafter'}, "
          f"context {server.max_context}) at http://{shown}:{actual}/v1", file=sys.stderr, flush=True)
    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            worker.cancel_all()  # open streams end after their current round, so shutdown does not wait on them
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=10)
    try:
        Server(config).run(sockets=[sock])
    finally:
        worker.close(timeout=5)
