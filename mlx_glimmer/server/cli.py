"""The `serve` subcommand's flags (kept apart from app.py so the CLI starts without importing FastAPI)."""

from __future__ import annotations

import argparse
import re
import sys

from ..errors import GlimmerError
from ..flags import add_drafter_flags, add_sampling_flags, positive_int, settings_from_args
from ..settings import BatchSettings, GenerationSettings

# What a request leaves out comes from these (the flags change them).
SERVE_DEFAULTS = GenerationSettings(max_tokens=512)

UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
}


def byte_size(text: str) -> int:
    """'2GB', '512MiB', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 2GB or 512MiB, got {text!r}")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


def add_serve_parser(sub) -> None:
    s = sub.add_parser(
        "serve",
        help="serve an OpenAI-compatible HTTP API (chat/completions, completions, models, health, metrics)",
        description=(
            "Serve the pair over an OpenAI-compatible HTTP API: POST /v1/chat/completions and /v1/completions "
            "(JSON or SSE streaming), GET /v1/models, /health and /metrics. Speculative by default; requests may "
            "set 'speculative', 'block_size' and 'tree'. Conversations are kept in a prefix cache, so a follow-up turn "
            "prefills only what it adds. Under mlx.launch the target is split across the processes: rank 0 serves, "
            "one request at a time, and the others follow it."
        ),
    )
    s.add_argument("bundle", nargs="?", help="bundle or model directory (default: the embedded demo pair)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 picks a free one)")
    s.add_argument("--model-name", default=None, help="model id clients send (default: the bundle's name)")
    add_drafter_flags(s)
    # A request's own fields win over these.
    add_sampling_flags(s, SERVE_DEFAULTS, seed=False, what="for a request that sets none")
    next(a for a in s._actions if a.dest == "no_spec").help = "plain decoding unless a request sets speculative: true"
    s.add_argument(
        "--max-queue",
        type=positive_int,
        default=32,
        help="requests that may wait for the model; more get 503 with Retry-After (default 32)",
    )
    s.add_argument(
        "--max-batch",
        type=positive_int,
        default=BatchSettings().max_batch,
        help=(
            "most concurrent requests decoded together, one target forward per step for all of them, when measured "
            f"throughput says it pays (a lone request stays speculative; 1: one at a time; default "
            f"{BatchSettings().max_batch}; a target split under mlx.launch serves one at a time)"
        ),
    )
    s.add_argument(
        "--prompt-cache-bytes",
        type=byte_size,
        default=byte_size("1GiB"),
        help="bound on cached conversations' KV caches, e.g. 512MiB, 4GB (default 1GiB)",
    )
    s.add_argument(
        "--max-context",
        type=positive_int,
        default=None,
        help="longest prompt + max_tokens accepted (default: the target's max_position_embeddings)",
    )
    s.add_argument(
        "--log-level",
        default="warning",
        choices=("critical", "error", "warning", "info", "debug"),
        help="uvicorn log level (default warning)",
    )


def cmd_serve(args, open_pair) -> int:
    defaults = settings_from_args(args, "serve")
    if not 0 <= args.port < 65536:
        raise GlimmerError(f"serve: --port must be in [0, 65535], got {args.port}")
    from .. import lockstep
    from ..ranks import split_group

    def open_serving_pair():
        return open_pair(args.bundle, args.drafter, draft_k=args.draft_k, prompt_lookup=args.prompt_lookup)

    group = split_group()
    if group is not None and group.rank() > 0:  # the target is split: this process follows rank 0's calls
        from ..follower import follow

        return follow(open_serving_pair)
    from .app import serve

    def say(line: str) -> None:
        print(f"mlx-glimmer serve: {line}", file=sys.stderr, flush=True)

    def load_pair():
        pair = lockstep.load(open_serving_pair)
        lockstep.calibrate(pair, defaults, say)
        return pair

    batch = BatchSettings(max_batch=args.max_batch)
    if group is not None:
        batch = BatchSettings(max_batch=1)
        print(
            f"mlx-glimmer serve: the target is split over {group.size()} processes: requests are served one at a "
            "time (--max-batch does not apply)",
            file=sys.stderr,
        )
    try:
        serve(
            load_pair,
            host=args.host,
            port=args.port,
            model_name=args.model_name,
            defaults=defaults,
            max_queue=args.max_queue,
            prompt_cache_bytes=args.prompt_cache_bytes,
            max_context=args.max_context,
            log_level=args.log_level,
            batch=batch,
        )
    except KeyboardInterrupt:  # Ctrl-C, re-raised once the server has shut down
        if group is None:
            raise
    # uvicorn re-raises the signal it stopped on only where its disposition was the default: a process started
    # with Ctrl-C ignored (a shell's background job) stops on it just the same but returns here. Either way rank
    # 0 stops the followers and exits cleanly, since the launcher ends every process as soon as one exits
    # non-zero, which would cut theirs short. On a failure rank 0 exits non-zero instead, and the launcher ends
    # the others wherever they wait.
    lockstep.stop()
    if group is not None:
        print("mlx-glimmer serve: stopped; every process stopped", file=sys.stderr)
    return 0
