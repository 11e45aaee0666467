"""The `distill` subcommand's flags and their checks (kept apart from run.py, which imports MLX and the
trainer): every flag is checked here before the command line re-executes for BLAS, before the target
loads, and before OUT is created."""

from __future__ import annotations

import argparse
import importlib.util
import math
import re
import sys
from pathlib import Path

from ..errors import GlimmerError
from ..files import check_model_dir, check_model_files, check_regular_file, pair_paths, read_config_json
from ..flags import bounded_int, nonnegative_int, positive_float, positive_int, seed_arg, unit_float
from ..paths import DATA_DIR
from ..settings import MAX_TREE_NODES
from .step import TrainConfig, target_init_layers


def draft_vocab_arg(text: str) -> int | str:
    if text == "all":
        return text
    try:
        return positive_int(text)
    except ValueError:  # not a whole number (one below 1 is positive_int's own error)
        raise argparse.ArgumentTypeError(f"must be 'all' or a whole number >= 1, got {text!r}") from None


def draft_vocab_size(args) -> int | None:
    """--draft-vocab as TrainConfig takes it: not given, the recipe's size; 'all', None (every emitted token)."""
    if args.draft_vocab is None:
        return TrainConfig().draft_vocab_size
    return None if args.draft_vocab == "all" else args.draft_vocab


def add_distill_parser(sub) -> None:
    d = TrainConfig()  # the recipe's defaults, shown in the help as they are
    p = sub.add_parser(
        "distill",
        help="train a DFlash drafter for a target on its own answers",
        description=(
            "Train a DFlash (muse_glimmer_assistant architecture) drafter for any target: generate the target's "
            "answers to a prompt set (cached), train on them, keep the checkpoint with the best held-out "
            "acceptance, export it to OUT/drafter. Re-running the same command resumes. Every flag is checked "
            "before anything is loaded or written."
        ),
    )
    p.add_argument("target", nargs="?", help="bundle or model directory (default: the embedded demo pair's target)")
    p.add_argument(
        "--out",
        required=True,
        help="run directory (data, checkpoints, exported drafter); made once the flags check out",
    )
    p.add_argument(
        "--train-dir",
        default=None,
        help="where training writes its checkpoints, log.json and drafter (default: OUT); the answers and features "
        "stay in OUT, so several training runs (another --init, more steps on grown answers) share them",
    )
    p.add_argument(
        "--prompts",
        default=str(DATA_DIR / "prompts_train.jsonl"),
        help="training prompts (JSONL with 'prompt'), or 'synth': the shipped prompts plus templated families plus "
        "--self-instruct target-written ones, minus anything overlapping the held-out set",
    )
    p.add_argument(
        "--self-instruct",
        type=nonnegative_int,
        default=0,
        help="with --prompts synth: N instructions written by the target itself",
    )
    p.add_argument(
        "--follow-ups",
        type=nonnegative_int,
        default=0,
        help="N second-turn conversations built on greedy answers (default 0)",
    )
    p.add_argument(
        "--generator",
        choices=["auto", "mlx", "torch"],
        default="auto",
        help="batched answer generator: mlx-lm batch_generate or transformers generate (auto: torch on Linux "
        "when installed, mlx elsewhere)",
    )
    p.add_argument(
        "--gen-dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="torch generator precision (default float32, the target's exactly; bfloat16 is faster on CPUs "
        "with AVX-512 bf16/AMX, and its answers drift apart from float32 greedy ones: docs/distill.md)",
    )
    p.add_argument(
        "--gen-threads", type=positive_int, default=None, help="CPU threads for the torch generator (default: all)"
    )
    p.add_argument("--heldout", default=str(DATA_DIR / "prompts_heldout.jsonl"), help="held-out prompts for selection")
    p.add_argument("--max-prompts", type=positive_int, default=None, help="use only the first N training prompts")
    p.add_argument(
        "--temperatures",
        default="0",
        help="comma-separated answer temperatures (finite, >= 0); one pass each (default 0)",
    )
    p.add_argument("--answer-tokens", type=positive_int, default=160, help="max tokens per answer (default 160)")
    p.add_argument(
        "--batch-size",
        type=positive_int,
        default=128,
        help="answers generated at once: the torch generator's slots, mlx-lm's batch (default 128)",
    )
    p.add_argument(
        "--layers",
        type=positive_int,
        default=d.layers,
        help=f"drafter layers, 1 to the target's layer count (default {d.layers})",
    )
    p.add_argument(
        "--mlp-width",
        type=positive_float,
        default=d.mlp_width,
        help="each drafter layer's MLP hidden size as a multiple of the target's intermediate size: capacity "
        f"without depth (a layer's cost grows with it; 2 doubles the MLP) (default {d.mlp_width:g})",
    )
    p.add_argument(
        "--context-layers",
        type=positive_int,
        default=d.context_layers,
        help=f"target layers feeding the drafter: 1, or up to the target's layer count - 3 "
        f"(default {d.context_layers})",
    )
    p.add_argument(
        "--train-tags",
        default=None,
        help="train on the answers with these comma-separated tags only (greedy, t<T> for temperature T, "
        "followup), features still computed for all (default: every answer)",
    )
    p.add_argument(
        "--soft-labels",
        type=unit_float,
        default=d.soft_labels,
        help="weight of the target's own next-token distribution in each label, 0 to 1: 0 trains on the "
        "answer's tokens only, 1 on the distribution only (KL to the target); > 0 stores the target's final "
        f"hidden states beside the features (one more hidden size of float16 per token) (default {d.soft_labels:g})",
    )
    p.add_argument(
        "--context-scale",
        choices=["raw", "channel"],
        default=d.context_scale,
        help="how `fc` sees the target's features while training: raw layer outputs, or each channel divided by "
        "its RMS over the answers (folded back into `fc` on export, so the drafter reads raw features as "
        f"always; evens out the few massive-activation channels) (default {d.context_scale})",
    )
    p.add_argument(
        "--steps",
        type=positive_int,
        default=d.steps,
        help=f"optimiser steps, --sequences-per-step answers each (default {d.steps})",
    )
    p.add_argument(
        "--anchors", type=positive_int, default=d.anchors, help=f"blocks per answer per step (default {d.anchors})"
    )
    p.add_argument(
        "--sequences-per-step",
        type=positive_int,
        default=d.sequences_per_step,
        help=f"answers per optimiser step (default {d.sequences_per_step})",
    )
    p.add_argument(
        "--draft-vocab",
        type=draft_vocab_arg,
        default=None,
        help="draft vocabulary: the N tokens the target emits most in the answers (all of them when it emits "
        "fewer), at most its vocabulary, or 'all': every emitted token. A smaller head trains faster; a "
        f"token outside it is never drafted, so output stays the target's (default {d.draft_vocab_size})",
    )
    p.add_argument(
        "--init",
        default="random",
        help="warm start: random (default); target (the drafter starts as the target's last --layers layers, "
        "fc passing the deepest captured layer on); target:L1,L2,... (those target layers, in order, each once; "
        "fewer than --layers grow by identity layers); or a drafter directory to fine-tune (one with fewer layers "
        "than --layers grows by identity layers)",
    )
    p.add_argument(
        "--train-backend",
        choices=["auto", "mlx", "torch"],
        default="auto",
        help="training step: mlx (our MLX drafter; the fast one on Apple silicon) or torch (transformers' "
        "assistant class, torch.compile, precision by --train-precision; the fast one on a Linux CPU). auto: torch on "
        "Linux when installed, mlx elsewhere",
    )
    p.add_argument(
        "--features",
        choices=["stored", "online"],
        default="stored",
        help="stored (default): the target's features computed once into OUT/features (2 bytes x hidden size x "
        "context layers per token, prompts included) and read by every step; online: "
        "computed for each step's sequences as it draws them and kept nowhere, for answers whose store would not "
        "fit on the disk, at one target forward of the step's sequences per step",
    )
    p.add_argument(
        "--feature-source",
        choices=["auto", "mlx:float32", "torch:float32", "torch:bfloat16"],
        default="auto",
        help="who computes the target's features (see --features): the MLX target or the "
        "same weights on torch, several sequences per forward. auto (default): the store's own source when "
        "resuming, else the fastest measured here on a sample of the run's sequences (bfloat16 is timed only "
        "on a CPU with bfloat16 instructions)",
    )
    p.add_argument(
        "--recompute-features",
        action="store_true",
        help="replace a feature store this run cannot read (computed for other answers, other --context-layers, "
        "by another --feature-source, or without the final hidden states --soft-labels reads). Without it such "
        "a store is refused in one error line and left as it is: it may hold hours of work",
    )
    p.add_argument(
        "--train-precision",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="torch training step: matmuls under bfloat16 autocast or in float32 (weights and optimizer state "
        "stay float32 either way). auto (default): bfloat16 on a CPU with bfloat16 instructions, float32 "
        "elsewhere (emulated bfloat16 runs several times slower)",
    )
    p.add_argument(
        "--no-compile",
        action="store_true",
        help="torch backend: skip torch.compile (it compiles once per padded context width before the first step, minutes, and then ~halves step time)",
    )
    p.add_argument(
        "--lr",
        type=positive_float,
        default=d.learning_rate,
        help=f"peak learning rate, finite and > 0 (default {d.learning_rate:g})",
    )
    p.add_argument(
        "--eval-every",
        type=positive_int,
        default=d.eval_every,
        help=f"steps between held-out evaluations (default {d.eval_every})",
    )
    p.add_argument("--eval-prompts", type=positive_int, default=16, help="held-out prompts per evaluation (default 16)")
    p.add_argument("--eval-tokens", type=positive_int, default=96, help="tokens per held-out prompt (default 96)")
    p.add_argument(
        "--eval-tree",
        type=bounded_int(0, MAX_TREE_NODES),
        default=0,
        help="held-out evaluation verifies a draft tree of N nodes under the anchor every round (N + 1 tokens; "
        "7 is the tree the default decoding verifies most) instead of the 16-wide chain, and the best checkpoint "
        f"is picked on it; 0: the chain (default 0; at most {MAX_TREE_NODES})",
    )
    p.add_argument(
        "--mask-token",
        type=nonnegative_int,
        default=None,
        help="mask token id, inside the target's vocabulary (default: an unused special token)",
    )
    p.add_argument("--seed", type=seed_arg, default=d.seed, help=f"random seed, 0 to 2**63-1 (default {d.seed})")
    p.add_argument("--data-only", action="store_true", help="stop after generating the answers")
    p.add_argument(
        "--train-only",
        action="store_true",
        help="generate nothing: train on the answers already in OUT/data (for example while a partial "
        "data set is all the time allows); the prompt list must already be there",
    )


def pick_backend(kind: str, flag: str) -> str:
    """auto: torch on Linux when installed (fastest on a CPU here), mlx elsewhere."""
    if kind == "auto":
        return "torch" if sys.platform == "linux" and importlib.util.find_spec("torch") else "mlx"
    if kind == "torch" and importlib.util.find_spec("torch") is None:
        raise GlimmerError(f"distill: {flag} torch: torch is not installed (pip install torch)")
    return kind


def temperatures(args) -> list[float]:
    """`--temperatures` as numbers: finite and >= 0."""
    try:
        temps = [float(t) for t in args.temperatures.split(",")]
    except ValueError:
        temps = None
    if not temps or not all(math.isfinite(t) and t >= 0 for t in temps):
        raise GlimmerError(
            f"distill: --temperatures: {args.temperatures!r} is not a comma-separated list of finite numbers >= 0"
        )
    return temps


def check_distill_flags(args) -> None:
    """Every flag that can be judged without the target (numbers by their argparse types), and the target's
    config.json when the target is named; nothing is loaded and nothing is written."""
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise GlimmerError(f"distill: --out {out}: exists and is not a directory")
    if args.data_only and args.train_only:
        raise GlimmerError("distill: --data-only and --train-only exclude each other")
    if args.train_dir is not None and args.data_only:
        raise GlimmerError("distill: --train-dir names where training writes, and --data-only trains nothing")
    if args.recompute_features and (args.data_only or args.features == "online"):
        why = "--data-only computes none" if args.data_only else "--features online keeps none"
        raise GlimmerError(f"distill: --recompute-features replaces a stored feature store, and {why}")
    if args.train_dir is not None and Path(args.train_dir).exists() and not Path(args.train_dir).is_dir():
        raise GlimmerError(f"distill: --train-dir {args.train_dir}: exists and is not a directory")
    if args.train_tags is not None and not all(
        t == "greedy" or t == "followup" or re.fullmatch(r"t\d+(\.\d+)?", t) for t in args.train_tags.split(",")
    ):
        raise GlimmerError(
            f"distill: --train-tags {args.train_tags!r}: tags are greedy, followup or t<temperature>, comma-separated"
        )
    for flag, name in ([("--prompts", args.prompts)] if args.prompts != "synth" else []) + [
        ("--heldout", args.heldout)
    ]:
        check_regular_file(Path(name), f"{flag} prompt file")
        if not Path(name).is_file():
            raise GlimmerError(f"distill: {flag} {name}: prompt file not found")
    if args.self_instruct and args.prompts != "synth":
        raise GlimmerError("distill: --self-instruct writes prompts for --prompts synth only")
    temperatures(args)
    # the layer range is checked against the target once its shape is known (`check_against_target`)
    if target_start(args, sys.maxsize) is None and Path(args.init).is_dir():
        check_model_files(Path(args.init), "--init drafter")
    if (
        target_start(args, sys.maxsize) is None
        and args.init != "random"
        and not (Path(args.init) / "model.safetensors").is_file()
    ):
        raise GlimmerError(
            f"distill: --init {args.init}: neither 'random', 'target', 'target:L1,L2,...' nor a drafter "
            "directory (no model.safetensors there)"
        )
    if args.train_only:
        data = out / "data"
        for needed in [data / "responses.jsonl"] + ([data / "prompts.jsonl"] if args.prompts == "synth" else []):
            if not needed.is_file():
                raise GlimmerError(f"distill: --train-only: {needed} does not exist (generate answers first)")
    if not args.data_only:
        pick_backend(args.train_backend, "--train-backend")
    if not args.train_only:
        pick_backend(args.generator, "--generator")
    if args.target is not None:
        paths = pair_paths(args.target, None, None, use_drafter=False)
        check_model_dir(paths.target, "target")
        shape = target_shape(read_config_json(paths.target, "target"))
        if shape is not None:
            check_against_target(args, *shape)


def target_start(args, target_layers: int) -> list[int] | None:
    """The target layers `--init` starts the drafter from (None: it does not start from the target)."""
    try:
        return target_init_layers(args.init, target_layers, args.layers)
    except GlimmerError as e:
        raise GlimmerError(f"distill: {e}") from None


def target_shape(config: dict) -> tuple[int, int] | None:
    """(vocabulary size, layer count) from a target's config.json (its text tower's), when it says."""
    for section in (config, config.get("text_config")):
        if isinstance(section, dict):
            vocab, layers = section.get("vocab_size"), section.get("num_hidden_layers")
            if isinstance(vocab, int) and isinstance(layers, int):
                return vocab, layers
    return None


def check_against_target(args, vocab_size: int, num_layers: int) -> None:
    """The flags whose range is the target's: a mask token in its vocabulary, context layers the DFlash rule
    can place apart (`dflash_target_layer_ids`: layers 1 .. n - 3), no more drafter layers than it has.
    With --data-only nothing is trained, so none of them matters."""
    if args.data_only:
        return
    if args.mask_token is not None and not 0 <= args.mask_token < vocab_size:
        raise GlimmerError(
            f"distill: --mask-token must be in [0, {vocab_size}) (the target's vocabulary), got {args.mask_token}"
        )
    most = max(1, num_layers - 3)
    if args.context_layers > most:
        raise GlimmerError(
            f"distill: --context-layers must be in [1, {most}] for a {num_layers}-layer target, "
            f"got {args.context_layers}"
        )
    if args.layers > num_layers:
        raise GlimmerError(
            f"distill: --layers must be in [1, {num_layers}] (the target's layer count), got {args.layers}"
        )
    target_start(args, num_layers)
    if isinstance(args.draft_vocab, int) and args.draft_vocab > vocab_size:
        raise GlimmerError(
            f"distill: --draft-vocab must be in [1, {vocab_size}] (the target's vocabulary), got {args.draft_vocab}"
        )
