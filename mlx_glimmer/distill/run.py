"""`mlx-glimmer distill`: data, training, held-out selection and export, resumable at every stage.

OUT/data/responses.jsonl    the target's answers (one tag per temperature), appended per batch
OUT/checkpoint/             latest weights + optimizer + step (resume point)
OUT/stepNNNNNN/             weights at each evaluation
OUT/drafter/                the best checkpoint by held-out acceptance, float16, ready for a bundle
OUT/log.json                data size, settings, evaluation history, the command line
"""

from __future__ import annotations

import importlib.util
import json
import random
import shutil
import sys
from pathlib import Path

import mlx.core as mx

from ..errors import GlimmerError
from .data import (
    DATA_DIR,
    Answerer,
    MLXAnswerer,
    TorchAnswerer,
    chat_prompt_ids,
    generate_responses,
    load_prompts,
    read_records,
    self_instructions,
)
from .evaluate import heldout_acceptance
from .prompts import FOLLOW_UPS, build_prompt_set
from .step import TrainConfig
from .train import Trainer


def add_distill_parser(sub) -> None:
    d = TrainConfig()  # the recipe's defaults, shown in the help as they are
    p = sub.add_parser(
        "distill",
        help="train a DFlash drafter for a target on its own answers",
        description=(
            "Train a DFlash (muse_glimmer_assistant architecture) drafter for any target: generate the target's "
            "answers to a prompt set (cached), train on them, keep the checkpoint with the best held-out "
            "acceptance, export it to OUT/drafter. Re-running the same command resumes."
        ),
    )
    p.add_argument("target", nargs="?", help="bundle or model directory (default: the embedded demo pair's target)")
    p.add_argument("--out", required=True, help="run directory (data, checkpoints, exported drafter)")
    p.add_argument(
        "--prompts", default=str(DATA_DIR / "prompts_train.jsonl"),
        help="training prompts (JSONL with 'prompt'), or 'synth': the shipped prompts plus templated families plus "
        "--self-instruct target-written ones, minus anything overlapping the held-out set",
    )
    p.add_argument("--self-instruct", type=int, default=0, help="with --prompts synth: N instructions written by the target itself")
    p.add_argument("--follow-ups", type=int, default=0, help="N second-turn conversations built on greedy answers (default 0)")
    p.add_argument("--generator", choices=["auto", "mlx", "torch"], default="auto",
                   help="batched answer generator: mlx-lm batch_generate or transformers generate (auto: torch on Linux "
                        "when installed, mlx elsewhere)")
    p.add_argument("--gen-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="torch generator precision (default float32, the target's exactly; bfloat16 is ~3.4x faster on "
                        "CPUs with AVX-512 bf16/AMX and gives answers that drift from float32 greedy after ~30 tokens)")
    p.add_argument("--gen-threads", type=int, default=None, help="CPU threads for the torch generator (default: all)")
    p.add_argument("--heldout", default=str(DATA_DIR / "prompts_heldout.jsonl"), help="held-out prompts for selection")
    p.add_argument("--max-prompts", type=int, default=None, help="use only the first N training prompts")
    p.add_argument("--temperatures", default="0", help="comma-separated answer temperatures; one pass each (default 0)")
    p.add_argument("--answer-tokens", type=int, default=160, help="max tokens per answer (default 160)")
    p.add_argument("--batch-size", type=int, default=32, help="answers generated per batch (default 32)")
    p.add_argument("--layers", type=int, default=d.layers, help=f"drafter layers (default {d.layers})")
    p.add_argument("--context-layers", type=int, default=d.context_layers,
                   help=f"target layers feeding the drafter (default {d.context_layers})")
    p.add_argument("--steps", type=int, default=d.steps,
                   help=f"optimiser steps, --sequences-per-step answers each (default {d.steps})")
    p.add_argument("--anchors", type=int, default=d.anchors, help=f"blocks per answer per step (default {d.anchors})")
    p.add_argument("--sequences-per-step", type=int, default=d.sequences_per_step,
                   help=f"answers per optimiser step (default {d.sequences_per_step})")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="draft vocabulary: the N tokens the target emits most (default: every emitted token)")
    p.add_argument("--init", default="random",
                   help="warm start: random (default), target (copy the target's last layers), or a drafter directory "
                        "to fine-tune (one with fewer layers than --layers grows by identity layers)")
    p.add_argument("--train-backend", choices=["auto", "mlx", "torch"], default="auto",
                   help="training step: mlx (our MLX drafter; the fast one on Apple silicon) or torch (transformers' "
                        "assistant class, bfloat16 autocast, torch.compile; the fast one on a Linux CPU). auto: torch on "
                        "Linux when installed, mlx elsewhere")
    p.add_argument("--no-compile", action="store_true",
                   help="torch backend: skip torch.compile (it compiles once per padded context width before the first step, minutes, and then ~halves step time)")
    p.add_argument("--lr", type=float, default=d.learning_rate, help=f"peak learning rate (default {d.learning_rate:g})")
    p.add_argument("--eval-every", type=int, default=d.eval_every,
                   help=f"steps between held-out evaluations (default {d.eval_every})")
    p.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts per evaluation (default 16)")
    p.add_argument("--eval-tokens", type=int, default=96, help="tokens per held-out prompt (default 96)")
    p.add_argument("--mask-token", type=int, default=None, help="mask token id (default: an unused special token)")
    p.add_argument("--seed", type=int, default=d.seed, help=f"random seed (default {d.seed})")
    p.add_argument("--data-only", action="store_true", help="stop after generating the answers")
    p.add_argument("--train-only", action="store_true",
                   help="generate nothing: train on the answers already in OUT/data (for example while a partial "
                        "data set is all the time allows); the prompt list must already be there")


def pick_backend(kind: str, flag: str) -> str:
    """auto: torch on Linux when installed (fastest on a CPU here), mlx elsewhere."""
    if kind == "auto":
        return "torch" if sys.platform == "linux" and importlib.util.find_spec("torch") else "mlx"
    if kind == "torch" and importlib.util.find_spec("torch") is None:
        raise GlimmerError(f"{flag} torch: torch is not installed (pip install torch)")
    return kind


def make_answerer(kind: str, pair, threads: int | None, dtype: str = "float32") -> Answerer:
    if pick_backend(kind, "--generator") == "mlx":
        return MLXAnswerer(pair.target.model, pair.tokenizer)
    return TorchAnswerer(pair.target_path, pair.tokenizer.eos_token_ids, threads=threads, dtype=dtype)


def training_prompts(args, answer: Answerer, tokenizer, heldout: list[str], data_dir: Path) -> list[str]:
    """The prompt list, frozen to `data_dir/prompts.jsonl` on first use so a resumed run sees the same indices."""
    frozen = data_dir / "prompts.jsonl"
    if frozen.is_file():
        return load_prompts(frozen)
    if args.prompts != "synth":
        return load_prompts(Path(args.prompts))
    own = []
    if args.self_instruct:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "@@"}], tokenize=False)
        prefix = tokenizer.encode(text[: text.index("@@")], add_special_tokens=False)
        own = self_instructions(answer, tokenizer, prefix, data_dir / "instructions.jsonl", count=args.self_instruct, seed=args.seed)
    base = [json.loads(line) for line in (DATA_DIR / "prompts_train.jsonl").read_text().splitlines() if line.strip()]
    items = build_prompt_set(base, heldout, seed=args.seed, self_instruct=own)
    data_dir.mkdir(parents=True, exist_ok=True)
    tmp = frozen.with_suffix(".partial")
    tmp.write_text("".join(json.dumps(it) + "\n" for it in items))
    tmp.rename(frozen)
    print(f"[data] {len(items)} training prompts ({len(own)} self-written requested) -> {frozen}", file=sys.stderr)
    return [it["prompt"] for it in items]


def follow_up_conversations(first: list[dict], prompts: list[str], tokenizer, count: int, seed: int) -> list[list[dict]]:
    """Second turns: [user, the target's own answer, a follow-up request], for `count` answered first turns."""
    rng = random.Random(seed)
    picked = sorted(first, key=lambda r: r["index"])[:count]
    return [
        [
            {"role": "user", "content": prompts[r["index"]]},
            {"role": "assistant", "content": tokenizer.decode([t for t in r["response_ids"] if t not in tokenizer.eos_token_ids])},
            {"role": "user", "content": rng.choice(FOLLOW_UPS)},
        ]
        for r in picked
    ]


def pick_mask_token(tokenizer) -> int:
    """An id the target never emits in chat: prefer a rarely used special token."""
    vocab = tokenizer.vocab
    for name in ("<|mask|>", "<mask>", "<empty_output>", "<|reserved_special_token_0|>", "<unk>"):
        if name in vocab:
            return int(vocab[name])
    raise GlimmerError("cannot pick a mask token for this tokenizer; pass --mask-token ID")


def cmd_distill(args, open_pair) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pair = open_pair(args.target, None, use_drafter=False)
    target, tok = pair.target, pair.tokenizer
    for name in ([args.prompts] if args.prompts != "synth" else []) + [args.heldout]:
        if not Path(name).is_file():
            raise GlimmerError(f"{name}: prompt file not found")
    heldout = load_prompts(Path(args.heldout))
    try:
        temps = [float(t) for t in args.temperatures.split(",")]
    except ValueError:
        raise GlimmerError(f"--temperatures: {args.temperatures!r} is not a comma-separated list of numbers") from None

    if args.data_only and args.train_only:
        raise GlimmerError("--data-only and --train-only exclude each other")
    data = out / "data" / "responses.jsonl"
    if args.train_only:
        for needed in [data] + ([out / "data" / "prompts.jsonl"] if args.prompts == "synth" else []):
            if not needed.is_file():
                raise GlimmerError(f"--train-only: {needed} does not exist (generate answers first)")
        answer = None
    else:
        answer = make_answerer(args.generator, pair, args.gen_threads, args.gen_dtype)
    train_prompts = training_prompts(args, answer, tok, heldout, out / "data")[: args.max_prompts]
    tags = []
    for i, t in enumerate(temps):
        tags.append("greedy" if t == 0 else f"t{t}")
        if args.train_only:
            continue
        generate_responses(
            answer, tok, train_prompts, data, batch_size=args.batch_size, max_tokens=args.answer_tokens,
            temperature=t, seed=args.seed + 1000 * i, tag=tags[-1],
        )
    if args.follow_ups and args.train_only:
        tags.append("followup")
    elif args.follow_ups:
        first = [r for r in read_records(data) if r["tag"] == tags[0]]
        generate_responses(
            answer, tok, follow_up_conversations(first, train_prompts, tok, args.follow_ups, args.seed), data,
            batch_size=args.batch_size, max_tokens=args.answer_tokens, temperature=temps[0], seed=args.seed + 999, tag="followup",
        )
        tags.append("followup")
    records = [r for r in read_records(data) if r["tag"] in set(tags)]
    n_tokens = sum(len(r["response_ids"]) for r in records)
    print(f"[data] {len(records)} answers, {n_tokens} target tokens", file=sys.stderr)
    if args.data_only:
        return 0

    mask = args.mask_token if args.mask_token is not None else pick_mask_token(tok)
    config = TrainConfig(
        layers=args.layers, context_layers=args.context_layers, anchors=args.anchors, steps=args.steps,
        sequences_per_step=args.sequences_per_step, draft_vocab_size=args.draft_vocab, init=args.init,
        learning_rate=args.lr, eval_every=args.eval_every, seed=args.seed, backend=pick_backend(args.train_backend, "--train-backend"),
        compile=not args.no_compile,
    )
    source = None
    if config.backend == "torch":  # the torch step's features come from torch too (batched, bfloat16: minutes, not hours)
        from .features import TorchFeatures

        source = TorchFeatures(pair.target_path)
    trainer = Trainer(target, records, config, out, mask_token_id=mask, feature_source=source)
    if trainer.resume(out / "checkpoint"):
        print(f"[train] resumed at step {trainer.step}", file=sys.stderr)
    eval_ids = [chat_prompt_ids(tok, p) for p in heldout[: args.eval_prompts]]
    log_path = out / "log.json"
    log = json.loads(log_path.read_text()) if log_path.is_file() else {"evaluations": []}
    log.update(
        command=" ".join(sys.argv), answers=len(records), target_tokens=n_tokens, draft_vocab=int(trainer.draft_vocab.shape[0]),
        config=vars(config), mask_token_id=mask, target_layer_ids=trainer.drafter_config.target_layer_ids,
        draft_vocab_coverage=trainer.vocab_coverage,
        eval={"prompts": len(eval_ids), "max_tokens": args.eval_tokens, "block_size": 16, "sampling": "greedy",
              "chat_template": True},
    )

    def evaluate(tr: Trainer) -> float:
        report = heldout_acceptance(target, tr.model, eval_ids, max_tokens=args.eval_tokens, stop_ids=tok.eos_token_ids)
        seen = tr.step * config.sequences_per_step
        log["evaluations"] = [e for e in log["evaluations"] if e["step"] != tr.step] + [
            {"step": tr.step, "mean_acceptance": report.mean, "per_prompt": report.per_prompt,
             "sequences_seen": seen, "target_tokens_seen": round(seen * n_tokens / max(len(records), 1)),
             "block_positions_per_second": getattr(tr, "positions_per_second", None)}
        ]
        log_path.write_text(json.dumps(log, indent=2))
        return report.mean

    trainer.train(evaluate=evaluate)
    best = max(log["evaluations"], key=lambda e: e["mean_acceptance"])
    export(out / f"step{best['step']:06d}", out / "drafter")
    log["exported"] = best
    log_path.write_text(json.dumps(log, indent=2))
    print(f"[done] exported step {best['step']} (held-out mean acceptance {best['mean_acceptance']:.3f}) to {out / 'drafter'}", file=sys.stderr)
    return 0


def export(checkpoint: Path, dest: Path) -> None:
    """Weights as float16 (the vocabulary map stays int32) plus config: a drafter directory."""
    weights = mx.load(str(checkpoint / "model.safetensors"))
    weights = {k: (v if k == "draft_vocab" else v.astype(mx.float16)) for k, v in weights.items()}
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    mx.save_safetensors(str(tmp / "model.safetensors"), weights)
    shutil.copy(checkpoint / "config.json", tmp / "config.json")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
