"""The `serve` subcommand's flags (kept apart from server.py so the CLI starts without importing FastAPI)."""

from __future__ import annotations

import argparse
import re

from .errors import GlimmerError

UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
         "kib": 2**10, "mib": 2**20, "gib": 2**30}


def byte_size(text: str) -> int:
    """'2GB', '512MiB', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 2GB or 512MiB, got {text!r}")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


def add_serve_parser(sub, add_drafter_flags, positive_int) -> None:
    s = sub.add_parser(
        "serve",
        help="serve an OpenAI-compatible HTTP API (chat/completions, completions, models, health, metrics)",
        description=(
            "Serve the pair over an OpenAI-compatible HTTP API: POST /v1/chat/completions and /v1/completions "
            "(JSON or SSE streaming), GET /v1/models, /health and /metrics. Speculative by default; requests may "
            "set 'speculative' and 'block_size'. Conversations are kept in a prefix cache, so a follow-up turn "
            "prefills only what it adds."
        ),
    )
    s.add_argument("bundle", nargs="?", help="bundle or model directory (default: the embedded demo pair)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 picks a free one)")
    s.add_argument("--model-name", default=None, help="model id clients send (default: the bundle's name)")
    add_drafter_flags(s)
    s.add_argument("--max-tokens", type=positive_int, default=512, help="default max_tokens of a request (default 512)")
    s.add_argument("--temp", type=float, default=0.0, help="default temperature (default 0 = greedy)")
    s.add_argument("--top-p", type=float, default=1.0, help="default top_p (default 1.0)")
    s.add_argument("--top-k", type=int, default=0, help="default top_k (default 0 = off)")
    s.add_argument("--block-size", type=positive_int, default=None,
                   help="default tokens per draft block incl. the anchor (default: the drafter's)")
    s.add_argument("--no-spec", action="store_true", help="plain decoding unless a request sets speculative: true")
    s.add_argument("--max-queue", type=positive_int, default=32,
                   help="requests that may wait for the model; more get 503 with Retry-After (default 32)")
    s.add_argument("--prompt-cache-bytes", type=byte_size, default=byte_size("1GiB"),
                   help="bound on cached conversations' KV caches, e.g. 512MiB, 4GB (default 1GiB)")
    s.add_argument("--max-context", type=positive_int, default=None,
                   help="longest prompt + max_tokens accepted (default: the target's max_position_embeddings)")
    s.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn log level (default warning)")


def cmd_serve(args, open_pair) -> int:
    if not args.temp >= 0:
        raise GlimmerError(f"serve: --temp must be >= 0, got {args.temp}")
    if not 0 < args.top_p <= 1:
        raise GlimmerError(f"serve: --top-p must be in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        raise GlimmerError(f"serve: --top-k must be >= 0, got {args.top_k}")
    if not 0 <= args.port < 65536:
        raise GlimmerError(f"serve: --port must be in [0, 65535], got {args.port}")
    from .server import serve
    from .server_protocol import Defaults

    def load_pair():
        return open_pair(args.bundle, args.drafter, draft_k=args.draft_k, prompt_lookup=args.prompt_lookup)

    defaults = Defaults(max_tokens=args.max_tokens, temperature=args.temp, top_p=args.top_p, top_k=args.top_k,
                        speculative=not args.no_spec, block_size=args.block_size)
    serve(load_pair, host=args.host, port=args.port, model_name=args.model_name, defaults=defaults,
          max_queue=args.max_queue, prompt_cache_bytes=args.prompt_cache_bytes, max_context=args.max_context,
          log_level=args.log_level)
    return 0
