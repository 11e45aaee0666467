"""`mlx-glimmer distill`: data, training, held-out selection and export, resumable at every stage.

OUT/data/responses.jsonl    the target's answers (one tag per temperature), appended per batch
OUT/checkpoint/             latest weights + optimizer + step (resume point)
OUT/stepNNNNNN/             weights at each evaluation
OUT/drafter/                the best checkpoint by held-out acceptance, float16, ready for a bundle
OUT/log.json                data size, settings, evaluation history, the command line
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx

from ..errors import GlimmerError
from .data import DATA_DIR, chat_prompt_ids, generate_responses, load_prompts, read_records
from .evaluate import heldout_acceptance
from .train import Trainer, TrainConfig


def add_distill_parser(sub) -> None:
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
    p.add_argument("--prompts", default=str(DATA_DIR / "prompts_train.jsonl"), help="training prompts (JSONL with 'prompt')")
    p.add_argument("--heldout", default=str(DATA_DIR / "prompts_heldout.jsonl"), help="held-out prompts for selection")
    p.add_argument("--max-prompts", type=int, default=None, help="use only the first N training prompts")
    p.add_argument("--temperatures", default="0", help="comma-separated answer temperatures; one pass each (default 0)")
    p.add_argument("--answer-tokens", type=int, default=160, help="max tokens per answer (default 160)")
    p.add_argument("--batch-size", type=int, default=32, help="answers generated per batch (default 32)")
    p.add_argument("--layers", type=int, default=3, help="drafter layers (default 3)")
    p.add_argument("--context-layers", type=int, default=5, help="target layers feeding the drafter (default 5)")
    p.add_argument("--steps", type=int, default=4000, help="training steps, one answer each (default 4000)")
    p.add_argument("--anchors", type=int, default=32, help="blocks per answer per step (default 32)")
    p.add_argument("--lr", type=float, default=6e-4, help="peak learning rate (default 6e-4)")
    p.add_argument("--eval-every", type=int, default=500, help="steps between held-out evaluations (default 500)")
    p.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts per evaluation (default 16)")
    p.add_argument("--eval-tokens", type=int, default=96, help="tokens per held-out prompt (default 96)")
    p.add_argument("--mask-token", type=int, default=None, help="mask token id (default: an unused special token)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--data-only", action="store_true", help="stop after generating the answers")


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
    for name in (args.prompts, args.heldout):
        if not Path(name).is_file():
            raise GlimmerError(f"{name}: prompt file not found")
    train_prompts = load_prompts(Path(args.prompts))[: args.max_prompts]
    heldout = load_prompts(Path(args.heldout))
    try:
        temps = [float(t) for t in args.temperatures.split(",")]
    except ValueError:
        raise GlimmerError(f"--temperatures: {args.temperatures!r} is not a comma-separated list of numbers") from None

    data = out / "data" / "responses.jsonl"
    for i, t in enumerate(temps):
        generate_responses(
            target.model, tok, train_prompts, data, batch_size=args.batch_size, max_tokens=args.answer_tokens,
            temperature=t, seed=args.seed + 1000 * i, tag="greedy" if t == 0 else f"t{t}",
        )
    records = [r for r in read_records(data) if r["tag"] in {("greedy" if t == 0 else f"t{t}") for t in temps}]
    n_tokens = sum(len(r["response_ids"]) for r in records)
    print(f"[data] {len(records)} answers, {n_tokens} target tokens", file=sys.stderr)
    if args.data_only:
        return 0

    mask = args.mask_token if args.mask_token is not None else pick_mask_token(tok)
    config = TrainConfig(
        layers=args.layers, context_layers=args.context_layers, anchors=args.anchors, steps=args.steps,
        learning_rate=args.lr, eval_every=args.eval_every, seed=args.seed,
    )
    trainer = Trainer(target, records, config, out, mask_token_id=mask)
    if trainer.resume(out / "checkpoint"):
        print(f"[train] resumed at step {trainer.step}", file=sys.stderr)
    eval_ids = [chat_prompt_ids(tok, p) for p in heldout[: args.eval_prompts]]
    log_path = out / "log.json"
    log = json.loads(log_path.read_text()) if log_path.is_file() else {"evaluations": []}
    log.update(
        command=" ".join(sys.argv), answers=len(records), target_tokens=n_tokens, draft_vocab=int(trainer.draft_vocab.shape[0]),
        config=vars(config), mask_token_id=mask, target_layer_ids=trainer.drafter_config.target_layer_ids,
    )

    def evaluate(tr: Trainer) -> float:
        report = heldout_acceptance(target, tr.model, eval_ids, max_tokens=args.eval_tokens, stop_ids=tok.eos_token_ids)
        log["evaluations"] = [e for e in log["evaluations"] if e["step"] != tr.step] + [
            {"step": tr.step, "mean_acceptance": report.mean, "per_prompt": report.per_prompt}
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
