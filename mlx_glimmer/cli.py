"""`mlx-glimmer` command line.

Every user mistake ends as one `error: ...` line on stderr and exit code 2;
see `errors.GlimmerError`.
"""

from __future__ import annotations

import argparse
import json
import sys

from .errors import GlimmerError

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
)


class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise GlimmerError(f"{self.prog.split()[-1]}: {message}")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=positive_int, default=256, help="most tokens to generate (default 256)")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 = greedy (default 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0 = off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0 = off)")
    p.add_argument("--seed", type=int, default=0, help="random seed for sampling (default 0)")
    p.add_argument(
        "--block-size",
        type=positive_int,
        default=None,
        help="tokens per draft block incl. the anchor (default: the drafter's block_size)",
    )
    p.add_argument("--no-spec", action="store_true", help="plain decoding with the target alone (the baseline)")


def build_parser() -> Parser:
    parser = Parser(
        prog="mlx-glimmer",
        description="Lossless block speculative decoding (DFlash) for Muse Glimmer on MLX.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)

    g = sub.add_parser(
        "generate",
        help="generate text for one prompt",
        description="Generate text for one prompt. Greedy speculative output equals plain greedy output token for token.",
    )
    g.add_argument("bundle", nargs="?", help="bundle or model directory (default: the embedded demo pair)")
    g.add_argument("--prompt", required=True, help="prompt text ('-' reads stdin)")
    g.add_argument("--chat", action="store_true", help="send the prompt as a user message through the chat template")
    g.add_argument("--system", default=None, help="system message (with --chat)")
    g.add_argument("--drafter", default=None, help="drafter directory replacing the bundle's")
    add_sampling_flags(g)
    g.add_argument("--json", action="store_true", help="print one JSON object with text, token ids and stats")
    return parser


def open_pair(bundle: str | None, drafter: str | None = None, use_drafter: bool = True):
    from .loading import load

    if bundle is None:
        from .demo import demo_bundle

        bundle = demo_bundle()
    return load(bundle, drafter=drafter, use_drafter=use_drafter)


def cmd_generate(args) -> int:
    from .generate import stream_generate

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    pair = open_pair(args.bundle, args.drafter, use_drafter=not args.no_spec)
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": prompt}
        ]
        prompt = messages
    elif args.system:
        raise GlimmerError("--system needs --chat")
    chunks = stream_generate(
        pair,
        prompt,
        max_tokens=args.max_tokens,
        temperature=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        block_size=args.block_size,
        speculative=not args.no_spec,
    )
    text, ids, stats = [], [], None
    for chunk in chunks:
        text.append(chunk.text)
        ids.extend(chunk.token_ids)
        stats = chunk.stats
        if not args.json:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    if args.json:
        stats_d = stats.to_dict()
        out = {"text": "".join(text), "token_ids": ids, **{k: stats_d[k] for k in JSON_FIELDS}}
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


COMMANDS = {"generate": cmd_generate}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 2
        return COMMANDS[args.command](args)
    except GlimmerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
