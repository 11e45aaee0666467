"""Command-line flags several subcommands share, and turning them into one `GenerationSettings`.

Kept apart from cli.py so that subcommands defined elsewhere (serve, bench, parity, distill) use the
same flags without importing the CLI that imports them. Nothing here imports MLX: every flag is parsed
and checked before the command line re-executes for BLAS or loads a model.
"""

from __future__ import annotations

import argparse
import math

from .errors import GlimmerError
from .settings import (
    AUTO,
    MAX_DRAFT_K,
    MAX_LOGPROBS,
    SEED_BITS,
    SEED_LIMIT,
    GenerationSettings,
    SamplingError,
    check_together,
    tree_value,
)

# The flag of each generation setting, by the setting's name (`GenerationSettings.of`'s keyword, the field a
# sampling error names). Every command that takes these flags reads them through this table.
FLAG_OF = {
    "max_tokens": "--max-tokens",
    "temperature": "--temp",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "seed": "--seed",
    "block_size": "--block-size",
    "tree": "--tree",
    "speculative": "--no-spec",  # the flag turns it off
    "logprobs": "--logprobs",  # `generate` only (`add_logprobs_flag`)
}


def dest(name: str) -> str:
    """The attribute argparse keeps setting `name`'s flag in."""
    return FLAG_OF[name].removeprefix("--").replace("-", "_")


def given_settings(args) -> dict:
    """The generation settings `args` gives, by name: each flag the command has, unless it was left at None."""
    values = {}
    for name in FLAG_OF:
        value = getattr(args, dest(name), None)
        if value is not None:
            values[name] = not value if name == "speculative" else value
    return values


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def nonnegative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def bounded_int(low: int, high: int):
    """An argparse type: a whole number in [low, high]."""

    def parse(text: str) -> int:
        value = int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {value}")
        return value

    parse.__name__ = "int"  # argparse names the type in "invalid int value"
    return parse


def seed_arg(text: str) -> int:
    value = int(text)
    if not 0 <= value < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"must be in [0, 2**{SEED_BITS}), got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {value}")
    return value


def unit_float(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {value}")
    return value


unit_float.__name__ = "float"


def block_size_arg(text: str) -> int | str:
    return AUTO if text == AUTO else positive_int(text)


def tree_arg(text: str) -> int | str:
    """`--tree`: what `settings.tree_value` takes ("auto", "off", a whole number of nodes in [1, MAX_TREE_NODES]),
    digits read as a number first: the server's `tree` field takes the same spellings."""
    try:
        value = int(text)
    except ValueError:
        value = text
    try:
        return tree_value(value)
    except SamplingError as e:
        raise argparse.ArgumentTypeError(f"{e.rule}, got {text!r}") from None


TREE_HELP = (
    "draft trees: N nodes under the anchor (N + 1 tokens verified per target call, so it goes with --block-size "
    "auto only), 'off' for chains only, 'auto' (default) lets the width policy choose a chain width or a tree "
    "budget each round; trees need a block drafter (DFlash, DFlash2, DSpark); n-gram matches from the "
    "conversation join the tree as a branch"
)

draft_k_arg = bounded_int(1, MAX_DRAFT_K)


def add_sampling_flags(
    p: argparse.ArgumentParser,
    defaults: GenerationSettings = GenerationSettings(),
    *,
    seed: bool = True,
    what: str = "",
) -> None:
    """--max-tokens --temp --top-p --top-k [--seed] --block-size --tree --no-spec; help shows `defaults`.
    `what`: whose setting it is in the help ("a request's " for serve's defaults)."""
    s = defaults.sampling
    p.add_argument(
        FLAG_OF["max_tokens"],
        type=positive_int,
        default=defaults.max_tokens,
        help=f"most tokens {what or 'to generate'} (default {defaults.max_tokens})",
    )
    p.add_argument(
        FLAG_OF["temperature"],
        type=float,
        default=s.temperature,
        help=f"sampling temperature{what and ' ' + what}; 0 = greedy (default {s.temperature:g})",
    )
    p.add_argument(
        FLAG_OF["top_p"], type=float, default=s.top_p, help=f"nucleus sampling mass (default {s.top_p:g}; 1 = off)"
    )
    p.add_argument(
        FLAG_OF["top_k"], type=int, default=s.top_k, help=f"keep the k most likely tokens (default {s.top_k}; 0 = off)"
    )
    if seed:
        p.add_argument(
            FLAG_OF["seed"],
            type=int,
            default=defaults.seed,
            help=f"random seed for sampling, 0 to 2**{SEED_BITS}-1 (default {defaults.seed})",
        )
    p.add_argument(
        FLAG_OF["block_size"],
        type=block_size_arg,
        default=defaults.block_size,
        metavar="auto|N",
        help="verify width: drafted tokens + the anchor. auto (default): chosen every round from the measured "
        "verify cost and live acceptance, up to the drafter's block size, falling back to plain decoding when "
        "drafting does not pay; N fixes it, capped at the drafter's block size (DFlash: its trained block, "
        "16 for the demo drafter; a draft model or prompt lookup: --draft-k + 1), with --tree auto (chains of N) "
        "or off; --tree N sets the width itself",
    )
    p.add_argument(
        FLAG_OF["tree"],
        type=tree_arg,
        default=defaults.tree,
        metavar="auto|off|N",
        help=TREE_HELP,
    )
    p.add_argument(
        FLAG_OF["speculative"], action="store_true", help="plain decoding with the target alone (the baseline)"
    )


def add_logprobs_flag(p: argparse.ArgumentParser) -> None:
    """--logprobs K: each generated token's log-probability and its K likeliest alternatives."""
    p.add_argument(
        FLAG_OF["logprobs"],
        type=bounded_int(0, MAX_LOGPROBS),
        default=None,
        metavar="K",
        help="with --json: each generated token's log-probability under the target (before temperature, top-p and "
        f"top-k) and its K likeliest alternatives, 0 to {MAX_LOGPROBS}; computed in the verify passes, no extra "
        "host reads",
    )


def add_drafter_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--drafter",
        default=None,
        help="drafter directory replacing the bundle's: a DFlash / DFlash2 / DSpark checkpoint, or any mlx-lm model "
        "with the target's tokenizer (classic drafting)",
    )
    p.add_argument(
        "--draft-k",
        type=draft_k_arg,
        default=None,
        help=f"tokens per round for a draft model (default: adaptive, up to {MAX_DRAFT_K}) or prompt lookup (default "
        f"10): 1 to {MAX_DRAFT_K}",
    )
    p.add_argument(
        "--prompt-lookup",
        action="store_true",
        help="draft by n-gram lookup in prompt + output (no model) instead of a drafter: not with --drafter; it "
        "drafts chains, so not with --tree N",
    )


def check_drafter_flags(args, prog: str) -> None:
    """`add_drafter_flags`' flags against each other and the tree: prompt lookup replaces any drafter (a
    --drafter beside it would be loaded for nothing) and drafts chains (a fixed --tree would never be one)."""
    if args.prompt_lookup and args.drafter is not None:
        raise GlimmerError(f"{prog}: --prompt-lookup and --drafter disagree: prompt lookup drafts without a model")
    tree = getattr(args, "tree", None)
    if args.prompt_lookup and isinstance(tree, int):
        raise GlimmerError(
            f"{prog}: --prompt-lookup and --tree {tree} disagree: prompt lookup drafts chains; trees need a block "
            "drafter (--tree auto or off)"
        )


def check_one_generation(args, prog: str) -> GenerationSettings:
    """The settings of a command that runs ONE generation (`generate`) as its flags give them, refusing flags
    that disagree there: `settings.check_together`'s, and --no-spec with a drafter flag (nothing drafts)."""
    settings = settings_from_args(args, prog)
    checked(prog, lambda: check_together(given_settings(args)))
    if getattr(args, "no_spec", False):
        for flag, given in (
            ("--drafter", args.drafter is not None),
            ("--prompt-lookup", args.prompt_lookup),
            ("--draft-k", args.draft_k is not None),
        ):
            if given:
                raise GlimmerError(f"{prog}: --no-spec and {flag} disagree: plain decoding drafts nothing")
    check_drafter_flags(args, prog)
    return settings


def checked(prog: str, make):
    """`make()`, with a setting out of range told as one error line naming `prog`'s flag."""
    try:
        return make()
    except SamplingError as e:
        raise GlimmerError(f"{prog}: {e.named(*(FLAG_OF.get(f, f) for f in e.fields))}") from None


def settings_from_args(args, prog: str) -> GenerationSettings:
    """The `GenerationSettings` of `add_sampling_flags`' flags."""
    return checked(prog, lambda: GenerationSettings.of(**given_settings(args)))
