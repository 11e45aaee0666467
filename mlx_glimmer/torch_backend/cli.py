"""CLI pieces of the torch backend: `--backend/--device/--torch-dtype` and the `parity` subcommand.

Nothing here imports torch or transformers at module level: the CLI still
works where they are not installed, and a torch command then says so.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import GlimmerError
from ..flags import checked, positive_int, tree_arg
from ..settings import AUTO, OFF, GenerationSettings

PARITY_TREE = 15  # draft-tree nodes per round in `parity` by default: a fixed shape both backends verify alike


def parity_tree_arg(text: str) -> int | str:
    """`--tree` for parity: 'off' or N ('auto' chooses by timings, which differ between backends)."""
    tree = tree_arg(text)
    if tree == AUTO:
        raise argparse.ArgumentTypeError("'auto' cannot be compared across backends: give N or 'off'")
    return tree


def parity_tree(args) -> int | str:
    """The tree `parity` compares: --tree as given; else chains where --block-size fixes their width, and
    `PARITY_TREE` nodes where it does not. A fixed --block-size with --tree N disagree (a tree sets the width
    itself: `settings.FIXED_TREE_RULE`)."""
    tree = args.tree if args.tree is not None else (OFF if args.block_size is not None else PARITY_TREE)
    checked("parity", lambda: GenerationSettings(block_size=args.block_size or AUTO, tree=tree))
    return tree


def add_backend_flags(p) -> None:
    p.add_argument(
        "--backend",
        choices=("mlx", "torch"),
        default="mlx",
        help="mlx (default) or torch (transformers' model classes on CUDA, MPS or CPU)",
    )
    add_torch_flags(p)


def add_torch_flags(p) -> None:
    p.add_argument("--device", default="auto", help="torch device: auto (cuda, then mps, then cpu), cuda, mps, cpu")
    p.add_argument(
        "--torch-dtype",
        default="auto",
        help="torch compute dtype: auto (what MLX computes the bundle in), float32, bfloat16, float16",
    )


def _require_torch():
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        raise GlimmerError(f"the torch backend needs torch and transformers ({e.name} is not installed)") from None


def open_torch_pair(
    bundle: str | None,
    drafter: str | None = None,
    *,
    use_drafter: bool = True,
    device: str = "auto",
    dtype: str = "auto",
):
    _require_torch()
    from .loading import load_torch

    if bundle is None:
        from ..demo import demo_bundle

        bundle = demo_bundle()
    return load_torch(bundle, drafter=drafter, use_drafter=use_drafter, device=device, dtype=dtype)


def check_backend_flags(args) -> None:
    """What `--backend torch` cannot do, refused before anything loads."""
    if args.backend == "torch" and (args.prompt_lookup or args.draft_k is not None):
        raise GlimmerError("--backend torch drafts with DFlash drafters only (no --prompt-lookup / --draft-k)")


def open_backend(args, open_pair):
    """The pair for `generate`, on the backend its flags ask for (`open_pair` opens an MLX pair)."""
    check_backend_flags(args)
    if args.backend == "torch":
        return open_torch_pair(
            args.bundle, args.drafter, use_drafter=not args.no_spec, device=args.device, dtype=args.torch_dtype
        )
    return open_pair(
        args.bundle, args.drafter, use_drafter=not args.no_spec, draft_k=args.draft_k, prompt_lookup=args.prompt_lookup
    )


def add_parity_parser(sub) -> None:
    p = sub.add_parser(
        "parity",
        help="check that MLX and torch decode a pair to the same tokens",
        description=(
            "Greedy decoding four ways (plain and speculative, on MLX and on torch with the same weights) over a "
            "prompt set. Reports, for every pair of runs, identical or the first diverging position with both "
            "tokens and each backend's logit margins there. Exit 0 only when every divergence is a floating-point "
            "tie (within the tolerance documented in mlx_glimmer/divergence.py)."
        ),
    )
    p.add_argument("bundle", nargs="?", help="bundle or model directory (default: the embedded demo pair)")
    p.add_argument("--drafter", default=None, help="drafter directory replacing the bundle's")
    p.add_argument(
        "--prompts",
        default=None,
        help="JSONL file ({'prompt': ...} or {'messages': [...]} per line) or plain text, one prompt a "
        "line (default: mlx-glimmer's held-out prompts)",
    )
    p.add_argument(
        "--num-prompts", type=positive_int, default=None, help="use the first N prompts (default 3; 8 with --full)"
    )
    p.add_argument("--max-tokens", type=positive_int, default=None, help="tokens per run (default 64; 128 with --full)")
    p.add_argument(
        "--full", action="store_true", help="the full check: 8 prompts x 128 tokens (~20 min on a 2-core CPU)"
    )
    p.add_argument(
        "--block-size",
        type=positive_int,
        default=None,
        help="chains of this width, tree off unless --tree says otherwise (default: the drafter's block size)",
    )
    p.add_argument(
        "--tree",
        type=parity_tree_arg,
        default=None,
        help=f"draft-tree nodes per round on both backends, or 'off' for chains (default {PARITY_TREE}, or off with "
        "--block-size; N goes without --block-size: a tree sets the width itself; 'auto' is refused: its choices "
        "follow timings, which differ between the backends)",
    )
    p.add_argument("--no-chat", action="store_true", help="encode prompts as plain text, without the chat template")
    add_torch_flags(p)
    p.add_argument("--json", default=None, metavar="FILE", help="also write the whole report (token ids too) as JSON")


def cmd_parity(args, open_pair) -> int:
    _require_torch()
    from .parity import format_report, read_prompts, run_parity

    num_prompts = args.num_prompts or (8 if args.full else 3)
    max_tokens = args.max_tokens or (128 if args.full else 64)
    prompts = read_prompts(args.prompts, num_prompts)
    if args.bundle is None:
        from ..demo import demo_bundle

        args.bundle = str(demo_bundle())
    mlx_pair = open_pair(args.bundle, args.drafter)
    torch_pair = open_torch_pair(args.bundle, args.drafter, device=args.device, dtype=args.torch_dtype)
    report = run_parity(
        mlx_pair,
        torch_pair,
        prompts,
        max_tokens=max_tokens,
        block_size=args.block_size,
        tree=parity_tree(args),
        chat=not args.no_chat,
        source=str(args.bundle),
        log=lambda line: print(line.splitlines()[0], file=sys.stderr, flush=True),
    )
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_dict(), indent=1))
    return 0 if report.passed else 1
