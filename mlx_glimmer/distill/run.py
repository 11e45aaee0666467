"""`mlx-glimmer distill`: data, training, held-out selection and export, resumable at every stage.

OUT/data/responses.jsonl    the target's answers (one tag per temperature), appended per batch
OUT/checkpoint/             latest weights + optimizer + step (resume point)
OUT/stepNNNNNN/             weights at each evaluation
OUT/drafter/                the best checkpoint by held-out acceptance, float16, ready for a bundle
                            (never one with non-finite weights or no layers)
OUT/log.json                data size, settings, evaluation history, the command line

The flags and their checks are in cli.py; OUT is made only once they all pass.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path

import mlx.core as mx

from ..cpu import native_bfloat16
from ..errors import GlimmerError
from ..files import write_whole
from ..paths import DATA_DIR
from .cli import check_against_target, check_distill_flags, draft_vocab_size, pick_backend, temperatures
from .data import (
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
from .features import choose_feature_source
from .prompts import FOLLOW_UPS, build_prompt_set, more_self_instructed
from .step import TrainConfig
from .train import Trainer, context_layer_ids, training_sequences


def make_answerer(args, pair) -> Answerer:
    if pick_backend(args.generator, "--generator") == "mlx":
        return MLXAnswerer(pair.target.model, pair.tokenizer, group=args.batch_size)
    return TorchAnswerer(
        pair.target_path,
        pair.tokenizer.eos_token_ids,
        slots=args.batch_size,
        threads=args.gen_threads,
        dtype=args.gen_dtype,
    )


def training_prompts(args, answer: Answerer | None, tokenizer, heldout: list[str], data_dir: Path) -> list[str]:
    """The prompt list, frozen to `data_dir/prompts.jsonl` on first use so a resumed run sees the same indices.
    A synth run resumed with a larger `--self-instruct` grows it: the new self-written prompts are appended, so
    every answer already there keeps its index (`answer` None, as with --train-only: the list as it is)."""
    frozen = data_dir / "prompts.jsonl"
    if frozen.is_file():
        prompts = load_prompts(frozen)
        if args.prompts == "synth" and args.self_instruct and answer is not None:
            added = more_self_instructed(prompts, self_written(args, answer, tokenizer, data_dir), heldout)
            if added:
                write_prompt_list(frozen, frozen.read_text(), added)
                print(f"[data] grew the prompt set by {len(added)} self-written prompts -> {frozen}", file=sys.stderr)
            prompts += [it["prompt"] for it in added]
        return prompts
    if args.prompts != "synth":
        return load_prompts(Path(args.prompts))
    own = self_written(args, answer, tokenizer, data_dir) if args.self_instruct else []
    base = [json.loads(line) for line in (DATA_DIR / "prompts_train.jsonl").read_text().splitlines() if line.strip()]
    items = build_prompt_set(base, heldout, seed=args.seed, self_instruct=own)
    data_dir.mkdir(parents=True, exist_ok=True)
    write_prompt_list(frozen, "", items)
    print(f"[data] {len(items)} training prompts ({len(own)} self-written requested) -> {frozen}", file=sys.stderr)
    return [it["prompt"] for it in items]


def self_written(args, answer: Answerer, tokenizer, data_dir: Path) -> list[str]:
    """`--self-instruct` requests the target writes itself, kept in `data_dir/instructions.jsonl` (resumed)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": "@@"}], tokenize=False)
    prefix = tokenizer.encode(text[: text.index("@@")], add_special_tokens=False)
    return self_instructions(
        answer, tokenizer, prefix, data_dir / "instructions.jsonl", count=args.self_instruct, seed=args.seed
    )


def read_log(path: Path) -> dict:
    """A training run's log.json (a new one when there is none)."""
    try:
        return json.loads(path.read_text()) if path.is_file() else {"evaluations": []}
    except ValueError as e:
        raise GlimmerError(f"distill: {path} is not JSON ({e}); move it aside to start a new log") from None


def write_prompt_list(path: Path, head: str, items: list[dict]) -> None:
    """`head` (the list's text so far) then `items`, written whole or not at all."""
    write_whole(path, head + "".join(json.dumps(it) + "\n" for it in items))


def follow_up_conversations(
    first: list[dict], prompts: list[str], tokenizer, count: int, seed: int
) -> list[list[dict]]:
    """Second turns: [user, the target's own answer, a follow-up request], for `count` answered first turns."""
    rng = random.Random(seed)
    picked = sorted(first, key=lambda r: r["index"])[:count]
    return [
        [
            {"role": "user", "content": prompts[r["index"]]},
            {
                "role": "assistant",
                "content": tokenizer.decode([t for t in r["response_ids"] if t not in tokenizer.eos_token_ids]),
            },
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
    # Nothing is written before every flag checks out: first what needs no target, then what needs its size.
    check_distill_flags(args)
    temps = temperatures(args)
    heldout = load_prompts(Path(args.heldout))
    if args.prompts != "synth":
        load_prompts(Path(args.prompts))  # a malformed file is one error line now, not after the target loads
    pair = open_pair(args.target, None, use_drafter=False)
    check_against_target(args, pair.target.vocab_size, pair.target.num_layers)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = answered_records(args, pair, temps, heldout, out / "data")
    n_tokens = sum(len(r["response_ids"]) for r in records)
    print(f"[data] {len(records)} answers, {n_tokens} target tokens", file=sys.stderr)
    if args.data_only:
        return 0
    train_and_export(args, pair, records, n_tokens, heldout, out, Path(args.train_dir) if args.train_dir else out)
    return 0


def answered_records(args, pair, temps: list[float], heldout: list[str], data_dir: Path) -> list[dict]:
    """The target's answers to the training prompts (and the follow-up turns), generated into
    `data_dir/responses.jsonl` where missing: the records the run trains on."""
    tok = pair.tokenizer
    data = data_dir / "responses.jsonl"
    answer = None if args.train_only else make_answerer(args, pair)
    train_prompts = training_prompts(args, answer, tok, heldout, data_dir)[: args.max_prompts]
    tags = []
    for i, t in enumerate(temps):
        tags.append("greedy" if t == 0 else f"t{t}")
        if args.train_only:
            continue
        generate_responses(
            answer,
            tok,
            train_prompts,
            data,
            max_tokens=args.answer_tokens,
            temperature=t,
            seed=args.seed + 1000 * i,
            tag=tags[-1],
        )
    if args.follow_ups and args.train_only:
        tags.append("followup")
    elif args.follow_ups:
        first = [r for r in read_records(data) if r["tag"] == tags[0]]
        generate_responses(
            answer,
            tok,
            follow_up_conversations(first, train_prompts, tok, args.follow_ups, args.seed),
            data,
            max_tokens=args.answer_tokens,
            temperature=temps[0],
            seed=args.seed + 999,
            tag="followup",
        )
        tags.append("followup")
    return [r for r in read_records(data) if r["tag"] in set(tags)]


def train_config(args) -> TrainConfig:
    """The recipe the flags ask for."""
    return TrainConfig(
        layers=args.layers,
        mlp_width=args.mlp_width,
        context_layers=args.context_layers,
        anchors=args.anchors,
        steps=args.steps,
        sequences_per_step=args.sequences_per_step,
        draft_vocab_size=draft_vocab_size(args),
        init=args.init,
        learning_rate=args.lr,
        eval_every=args.eval_every,
        seed=args.seed,
        backend=pick_backend(args.train_backend, "--train-backend"),
        precision=train_precision(args.train_precision),
        compile=not args.no_compile,
        context_scale=args.context_scale,
        soft_labels=args.soft_labels,
        train_tags=tuple(args.train_tags.split(",")) if args.train_tags else None,
    )


def train_precision(flag: str) -> str:
    """`--train-precision auto`: bfloat16 where the CPU multiplies it in hardware, float32 elsewhere."""
    if flag != "auto":
        return flag
    return "bfloat16" if native_bfloat16() else "float32"


def evaluation_record(args, prompts: int) -> dict:
    """How the run's held-out checks are made, as log.json records it."""
    shape = {"block_size": 16, "tree": args.eval_tree, "sampling": "greedy", "chat_template": True}
    return {"prompts": prompts, "max_tokens": args.eval_tokens, **shape}


def train_and_export(
    args, pair, records: list[dict], n_tokens: int, heldout: list[str], out: Path, train_dir: Path
) -> None:
    """Train on `records` (their features in OUT/features, or computed per step with `--features online`),
    evaluating held-out acceptance as it goes (logged to TRAIN_DIR/log.json), and export the best checkpoint to
    TRAIN_DIR/drafter."""
    target, tok = pair.target, pair.tokenizer
    mask = args.mask_token if args.mask_token is not None else pick_mask_token(tok)
    config = train_config(args)
    source = choose_feature_source(
        args.feature_source,
        out / "features",
        target,
        pair.target_path,
        training_sequences(records),
        context_layer_ids(target, config),
    )
    trainer = Trainer(
        target,
        records,
        config,
        train_dir,
        mask_token_id=mask,
        feature_source=source,
        features_dir=out / "features",
        online_features=args.features == "online",
        recompute_features=args.recompute_features,
    )
    train_dir.mkdir(parents=True, exist_ok=True)
    if trainer.resume(train_dir / "checkpoint"):
        print(f"[train] resumed at step {trainer.step}", file=sys.stderr)
    eval_ids = [chat_prompt_ids(tok, p) for p in heldout[: args.eval_prompts]]
    log_path = train_dir / "log.json"
    log = read_log(log_path)
    log.update(
        command=" ".join(sys.argv),
        answers=len(records),
        target_tokens=n_tokens,
        features=args.features,
        draft_vocab=int(trainer.draft_vocab.shape[0]),
        config=vars(config),
        mask_token_id=mask,
        target_layer_ids=trainer.drafter_config.target_layer_ids,
        draft_vocab_coverage=trainer.vocab_coverage,
        eval=evaluation_record(args, len(eval_ids)),
    )

    def evaluate(tr: Trainer) -> float:
        report = heldout_acceptance(
            target, tr.model, eval_ids, max_tokens=args.eval_tokens, tree=args.eval_tree, stop_ids=tok.eos_token_ids
        )
        seen = tr.step * config.sequences_per_step
        log["evaluations"] = [e for e in log["evaluations"] if e["step"] != tr.step] + [
            {
                "step": tr.step,
                "eval_tree": args.eval_tree,
                "mean_acceptance": report.mean,
                "per_prompt": report.per_prompt,
                "sequences_seen": seen,
                "target_tokens_seen": round(seen * tr.answer_tokens_per_draw),  # of the answers steps draw from
                "block_positions_per_second": tr.positions_per_second,
            }
        ]
        write_whole(log_path, json.dumps(log, indent=2))
        return report.mean

    trainer.train(evaluate=evaluate)
    same = [e for e in log["evaluations"] if e.get("eval_tree", 0) == args.eval_tree]
    if log["evaluations"] and not same:
        shapes = sorted({e.get("eval_tree", 0) for e in log["evaluations"]})
        raise GlimmerError(
            f"distill: {train_dir}'s checkpoints were evaluated with --eval-tree {shapes}, not {args.eval_tree}"
        )
    best = export_best(same, train_dir)
    log["exported"] = best
    write_whole(log_path, json.dumps(log, indent=2))
    print(
        f"[done] exported step {best['step']} (held-out mean acceptance {best['mean_acceptance']:.3f}) to {train_dir / 'drafter'}",
        file=sys.stderr,
    )


def export_best(evaluations: list[dict], out: Path) -> dict:
    """Export the evaluated checkpoint with the best held-out acceptance whose weights are usable (finite, a
    non-empty stack of layers) to OUT/drafter; returns its evaluation. None usable: a `GlimmerError`."""
    refused = []
    for e in sorted(evaluations, key=lambda e: -e["mean_acceptance"]):
        try:
            export(out / f"step{e['step']:06d}", out / "drafter")
        except UnusableDrafter as why:
            refused.append(f"step {e['step']}: {why}")
            continue
        return e
    raise GlimmerError(
        f"distill: no checkpoint can be exported ({'; '.join(refused) or 'none was evaluated'}); try a lower --lr"
    )


class UnusableDrafter(GlimmerError):
    """A checkpoint that must not become a drafter: non-finite weights, or no layers."""


def check_drafter_weights(weights: dict[str, mx.array]) -> None:
    if not any(k.startswith("layers.") for k in weights):
        raise UnusableDrafter("the drafter has no layers")
    bad = [k for k, v in weights.items() if k != "draft_vocab" and not mx.all(mx.isfinite(v)).item()]
    if bad:
        raise UnusableDrafter(f"non-finite weights (NaN or infinity) in {len(bad)} tensors, e.g. {bad[0]}")


def export(checkpoint: Path, dest: Path) -> None:
    """Weights as float16 (the vocabulary map stays int32) plus config: a drafter directory. Refuses
    (`UnusableDrafter`) weights that are not finite, also once in float16, and an empty stack of layers."""
    weights = mx.load(str(checkpoint / "model.safetensors"))
    weights = {k: (v if k == "draft_vocab" else v.astype(mx.float16)) for k, v in weights.items()}
    check_drafter_weights(weights)
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    mx.save_safetensors(str(tmp / "model.safetensors"), weights)
    shutil.copy(checkpoint / "config.json", tmp / "config.json")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
