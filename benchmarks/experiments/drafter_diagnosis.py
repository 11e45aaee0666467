"""Where a DFlash drafter loses its drafts, block position by block position.

    .venv/bin/python benchmarks/experiments/drafter_diagnosis.py [--drafter DIR] [--answers 200] [--prompts 75]
        [--max-tokens 128] [--out benchmarks/experiments/results/drafter_diagnosis.json]

For the drafter (default the shipped one) on the demo target, per block position k = 1..B-1:

(a) top-1 accuracy of the TRAINING forward, teacher-forced, on N training answers
    (benchmarks/experiments/distill/demo2/responses.jsonl.gz, a seeded random sample over all tags). It is the
    trainer's own code: a `distill.train.Trainer` built for these answers (warm-started from the
    drafter, so its weights are the drafter's), `Trainer.batch` for the blocks and masks and the
    step's own `loss` (`MLXStep` or `TorchStep`, whichever the drafter was trained with, with the
    feature source `distill` pairs with it) for the forward; the step's hidden states are read where
    its loss takes them (`block_forward`'s output, or what `TorchStep` hands `head_cross_entropy`).
    Every answer position is an anchor (no sampling), labels and masks are the loss's.
(b) the same on the target's own plain greedy answers (float32 demo target, chat template,
    `--max-tokens`) to the held-out prompts (mlx_glimmer/data/prompts_heldout.jsonl); the answers
    are generated once and cached in runs/drafter_diagnosis/. Also `b_mlx_f32`: the trainer's MLX
    forward on float32 MLX features (what inference feeds), which separates a code mismatch from a
    precision one when the drafter was trained on the torch path.
(c) acceptance in real speculative decoding (`speculative.generate_steps`, greedy, block B fixed,
    `--max-tokens`, chat template) on those prompts: for position k, the share of rounds whose draft
    k was accepted among rounds that offered it and accepted every draft before it; and the
    unconditional share of rounds committing >= k+1 tokens. Outputs are checked against (b)'s.
(d) the teacher-forced accuracy measured inference-style: for each held-out answer and every anchor,
    the runtime `DFlashDrafter` (its context cache, `observe` / `propose`) on the true prefix, the
    target's features computed as the loop computes them (prompt prefill, then B tokens per
    forward), its block compared with the true continuation. Same anchors and labels as (b), so the
    two are compared prediction by prediction (`agreement`): they must agree up to rounding.

Every accuracy is given over the positions the loss supervises (label inside the answer and in the
draft vocabulary) and, as `accuracy_all`, over all positions inside the answer (a label outside the
draft vocabulary counts as a miss: acceptance sees it that way); `conditional` is the accuracy at
k among anchors whose positions < k were all right (teacher-forced counterpart of (c)).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def shown(path) -> str:
    """A path as a results file records it: relative to the repository, or under $MLX_GLIMMER_CACHE."""
    from mlx_glimmer.paths import cache_dir

    path = Path(path).resolve()
    for base, name in ((ROOT, ""), (cache_dir().resolve(), "$MLX_GLIMMER_CACHE/")):
        if path.is_relative_to(base):
            return name + str(path.relative_to(base))
    return path.name


DEFAULT_RESPONSES = ROOT / "benchmarks" / "experiments" / "distill" / "demo2" / "responses.jsonl.gz"
CACHE = ROOT / "runs" / "drafter_diagnosis"


def parse_args(argv=None):
    from mlx_glimmer.demo import SHIPPED_DRAFTER

    ap = argparse.ArgumentParser(
        description="Per-block-position diagnosis of a DFlash drafter on the demo target: teacher-forced accuracy of "
        "the training forward on training answers (a) and on the target's greedy held-out answers (b), "
        "real speculative acceptance per position (c), and teacher-forced accuracy of the runtime "
        "drafter forward on the same held-out answers (d), which must agree with (b)."
    )
    ap.add_argument(
        "--drafter", default=str(SHIPPED_DRAFTER), help="drafter directory (default: the shipped demo drafter)"
    )
    ap.add_argument("--answers", type=int, default=200, help="training answers for (a) (default 200)")
    ap.add_argument("--prompts", type=int, default=75, help="held-out prompts for (b)-(d), the first N (default 75)")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens per held-out answer (default 128)")
    ap.add_argument(
        "--out",
        default=str(ROOT / "benchmarks" / "experiments" / "results" / "drafter_diagnosis.json"),
        help="results JSON",
    )
    ap.add_argument("--responses", default=str(DEFAULT_RESPONSES), help="training answers (JSONL or JSONL.gz)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the training-answer sample (default 0)")
    ap.add_argument(
        "--forward",
        choices=["auto", "mlx", "torch"],
        default="auto",
        help="training step whose forward (a)/(b) use; auto: the backend in the drafter's training_log.json "
        "(mlx when it has none)",
    )
    ap.add_argument(
        "--features",
        choices=["auto", "mlx", "torch"],
        default="auto",
        help="feature source for (a)/(b): mlx (the float32 MLX target, what inference feeds) or torch "
        "(bfloat16 torch target); auto: what `distill` pairs with the step (torch for torch)",
    )
    ap.add_argument("--parts", default="abcd", help="which parts to run, e.g. 'bd' (default abcd)")
    ap.add_argument(
        "--no-f32-variant",
        action="store_true",
        help="(b): only the training forward's own variant, not also the MLX forward on float32 MLX features",
    )
    ap.add_argument(
        "--cache", default=str(CACHE), help="where answers and feature stores are kept (default runs/drafter_diagnosis)"
    )
    return ap.parse_args(argv)


# ----------------------------------------------------------------------------------------------------------------
# metrics


class Tally:
    """Per-anchor predictions of a block against the true continuation; per-position metrics."""

    def __init__(self, positions: int):
        self.K = positions
        self.correct: list = []  # per anchor: bool [K]
        self.present: list = []  # label inside the answer
        self.supervised: list = []  # inside and in the draft vocabulary (what the loss sees)
        self.pred: dict = {}  # (answer, anchor) -> predicted full-vocabulary ids [K]
        self.ce_sum = None
        self.tags: list = []

    def add(self, key, tag, pred, labels, present, supervised, ce=None):
        import numpy as np

        pred, labels = np.asarray(pred, dtype=np.int64), np.asarray(labels, dtype=np.int64)
        self.correct.append((pred == labels) & present)
        self.present.append(np.asarray(present, dtype=bool))
        self.supervised.append(np.asarray(supervised, dtype=bool))
        self.pred[key] = pred
        self.tags.append(tag)
        if ce is not None:
            if self.ce_sum is None:
                self.ce_sum = np.zeros(self.K)
            self.ce_sum += np.where(supervised, ce, 0.0)

    def summary(self, select=None) -> dict:
        import numpy as np

        if not self.correct:
            return {}
        idx = np.arange(len(self.correct)) if select is None else np.asarray(select, dtype=np.int64)
        c, p, s = (np.array(x)[idx] for x in (self.correct, self.present, self.supervised))
        prefix_ok = np.cumprod(np.where(p, c, False), axis=1).astype(bool)  # all <= k right
        before = np.concatenate([np.ones((len(c), 1), dtype=bool), prefix_ok[:, :-1]], axis=1)  # all < k right

        def ratio(num, den):
            return [round(float(n) / float(d), 4) if d else None for n, d in zip(num, den)]

        out = {
            "anchors": int(len(c)),
            "accuracy": ratio((c & s).sum(0), s.sum(0)),
            "accuracy_all": ratio(c.sum(0), p.sum(0)),
            "conditional": ratio((c & before & p).sum(0), (before & p).sum(0)),
            "prefix": ratio((prefix_ok & p).sum(0), p.sum(0)),
            "supervised_positions": [int(x) for x in s.sum(0)],
            "positions": [int(x) for x in p.sum(0)],
        }
        if self.ce_sum is not None and select is None:
            out["cross_entropy"] = [round(float(x) / max(int(d), 1), 4) for x, d in zip(self.ce_sum, s.sum(0))]
        return out

    def by_tag(self) -> dict:
        tags = sorted(set(self.tags))
        if len(tags) < 2:
            return {}
        return {
            t: {
                k: v
                for k, v in self.summary([i for i, x in enumerate(self.tags) if x == t]).items()
                if k in ("anchors", "accuracy", "conditional")
            }
            for t in tags
        }


def agreement(x: Tally, y: Tally) -> dict:
    """Share of (anchor, position) inside the answer where x and y predicted the same token."""
    import numpy as np

    keys = [k for k in x.pred if k in y.pred]
    if not keys:
        return {}
    same, present = np.zeros(x.K), np.zeros(x.K)
    pos = {k: i for i, k in enumerate(x.pred)}
    for k in keys:
        p = x.present[pos[k]]
        same += (x.pred[k] == y.pred[k]) & p
        present += p
    return {
        "anchors": len(keys),
        "same_prediction": [round(float(s) / p, 4) if p else None for s, p in zip(same, present)],
        "same_prediction_overall": round(float(same.sum() / max(present.sum(), 1)), 4),
    }


# ----------------------------------------------------------------------------------------------------------------
# data


def read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def training_answers(path: Path, n: int, seed: int) -> list[dict]:
    import numpy as np

    records = [r for r in read_jsonl(path) if len(r["response_ids"]) >= 2]
    pick = np.sort(np.random.default_rng(seed).choice(len(records), size=min(n, len(records)), replace=False))
    return [records[i] for i in pick]


def heldout_answers(pair, prompts: list[str], max_tokens: int, cache_dir: Path) -> tuple[list[dict], float]:
    """The target's plain greedy answers (stop token included when emitted, as `distill` records them),
    cached per prompt and max_tokens."""
    from mlx_glimmer.distill.data import chat_prompt_ids
    from mlx_glimmer.generate import encode_prompt
    from mlx_glimmer.settings import GenerationSettings
    from mlx_glimmer.speculative import generate_steps

    path = cache_dir / f"heldout_greedy_{max_tokens}.json"
    weights = pair.target_path / "model.safetensors"
    stamp = {
        "target": str(pair.target_path),
        "target_bytes": weights.stat().st_size if weights.is_file() else None,
        "quantization": pair.quantization,
        "max_tokens": max_tokens,
    }
    cached = json.loads(path.read_text()) if path.is_file() else {}
    table = cached.get("answers", {}) if cached.get("stamp") == stamp else {}
    tic, made = time.perf_counter(), 0
    for i, p in enumerate(prompts):
        if p in table:
            continue
        ids = encode_prompt(pair.tokenizer, [{"role": "user", "content": p}])
        assert ids == chat_prompt_ids(pair.tokenizer, p), "the API and distill render the chat template differently"
        steps = generate_steps(
            pair.target,
            ids,
            GenerationSettings(max_tokens=max_tokens),
            drafter=None,
            stop_ids=pair.tokenizer.eos_token_ids,
        )
        table[p] = {"prompt_ids": ids, "response_ids": [t for s in steps for t in s.tokens]}
        made += 1
        print(
            f"[heldout] greedy answer {i + 1}/{len(prompts)} ({len(table[p]['response_ids'])} tokens)",
            file=sys.stderr,
            flush=True,
        )
        if made % 8 == 0 or i == len(prompts) - 1:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"stamp": stamp, "answers": table}))
    if made:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"stamp": stamp, "answers": table}))
    return [{"index": i, "tag": "heldout-greedy", **table[p]} for i, p in enumerate(prompts)], time.perf_counter() - tic


# ----------------------------------------------------------------------------------------------------------------
# (a), (b): the trainer's forward


def training_log_backend(drafter_dir: Path) -> str | None:
    log = drafter_dir / "training_log.json"
    if not log.is_file():
        return None
    return (json.loads(log.read_text()).get("config") or {}).get("backend")


def config_differences(trainer_cfg, drafter_cfg) -> dict:
    a, b = trainer_cfg.to_dict(), drafter_cfg.to_dict()
    return {
        k: {"trainer": a.get(k), "drafter": b.get(k)}
        for k in sorted(set(a) | set(b))
        if k != "draft_vocab_size" and a.get(k) != b.get(k)
    }


def build_trainer(pair, records, drafter_dir: Path, forward: str, features: str, cache_dir: Path, name: str):
    """A `Trainer` over `records` whose model is the drafter and whose draft vocabulary is the drafter's own
    (a trainer derives its vocabulary from its records; these are not all of the drafter's)."""
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten

    from mlx_glimmer.distill.step import TrainConfig
    from mlx_glimmer.distill.train import MLXStep, Trainer
    from mlx_glimmer.target import head_weight

    dcfg = pair.drafter.config
    config = TrainConfig(
        layers=dcfg.num_hidden_layers,
        mlp_width=dcfg.intermediate_size / int(pair.target.args.intermediate_size),
        context_layers=len(dcfg.target_layer_ids),
        block_size=dcfg.block_size,
        anchors=1,
        sequences_per_step=1,
        draft_vocab_size=None,
        init=str(drafter_dir),
        backend="mlx",
        compile=False,
    )
    digest = hashlib.sha1(json.dumps([r["prompt_ids"] + r["response_ids"] for r in records]).encode()).hexdigest()[:10]
    source = None
    if features == "torch":
        from mlx_glimmer.distill.features import TorchFeatures

        source = TorchFeatures(pair.target_path)
    out_dir = cache_dir / f"{name}-{len(records)}-{digest}-{features}"
    tr = Trainer(pair.target, records, config, out_dir, mask_token_id=dcfg.mask_token_id, feature_source=source)
    diffs = config_differences(tr.drafter_config, dcfg)
    if list(tr.drafter_config.target_layer_ids) != list(dcfg.target_layer_ids):
        raise SystemExit(
            f"the trainer would read target layers {tr.drafter_config.target_layer_ids}, the drafter "
            f"{dcfg.target_layer_ids}: not this trainer's drafter"
        )
    vocab = pair.drafter.draft_vocab
    vocab = mx.arange(pair.target.vocab_size, dtype=mx.int32) if vocab is None else vocab.astype(mx.int32)
    tr.draft_vocab = vocab
    tr.to_draft = np.full(pair.target.vocab_size, -1, dtype=np.int64)
    tr.to_draft[np.array(vocab)] = np.arange(vocab.shape[0])
    tr.model.draft_vocab = vocab
    tr.head = head_weight(pair.target)[vocab]
    if forward == "mlx":
        tr.step_fn = MLXStep(tr.model, tr.head, tr.embed, config)
    else:
        from mlx_glimmer.distill.torch_step import TorchStep

        config.backend = "torch"
        tr.step_fn = TorchStep(tr.model, tr.drafter_config, tr.head, tr.embed, config, compile=False)
    mine = dict(tree_flatten(tr.model.parameters()))
    theirs = dict(tree_flatten(pair.drafter.model.parameters()))
    worst = max(float(mx.abs(mine[k].astype(mx.float32) - theirs[k].astype(mx.float32)).max()) for k in theirs)
    if set(mine) != set(theirs) or worst > 0:
        raise SystemExit(f"the trainer's warm-started weights differ from the drafter's (max |diff| {worst})")
    return tr, diffs


def step_hidden(tr, batch, forward: str):
    """Run the step's own loss on `batch`; return (loss, logits over the draft vocabulary [rows, B-1, Vd] as numpy
    float32) with the hidden states taken where the loss takes them."""
    import mlx.core as mx
    import numpy as np

    S, A, B = batch.block_ids.shape
    if forward == "mlx":
        from mlx_glimmer.distill import train as T

        seen = {}
        original = T.block_forward

        def recording(*args, **kwargs):
            seen["h"] = original(*args, **kwargs)
            return seen["h"]

        T.block_forward = recording
        try:
            loss = tr.step_fn.loss(batch)
        finally:
            T.block_forward = original
        logits = seen["h"][:, 1:] @ tr.step_fn.head.T  # MLXStep._loss's logits
        return loss, np.array(logits.astype(mx.float32))
    import torch

    from mlx_glimmer.distill import torch_step as TS

    seen = {}
    original = TS.head_cross_entropy

    def recording(h, head, labels, weights, *soft):
        seen["h"], seen["head"] = h.detach(), head
        return original(h, head, labels, weights, *soft)

    TS.head_cross_entropy = recording
    try:
        loss = tr.step_fn.loss(batch)
    finally:
        TS.head_cross_entropy = original
    with torch.no_grad():  # as HeadCrossEntropy computes them
        logits = (seen["h"].to(seen["head"].dtype) @ seen["head"].T).float()
    return loss, logits.reshape(S * A, B - 1, -1).numpy()


def teacher_forced(tr, records, forward: str, label: str) -> tuple[Tally, float]:
    """Every anchor of every answer through the trainer's batch and step; predictions vs the true continuation."""
    import numpy as np

    B = tr.config.block_size
    vocab = np.array(tr.draft_vocab)
    tally, losses, weights = Tally(B - 1), [], []
    tic = last = time.perf_counter()
    for i in range(len(tr.sequences)):
        seq, lp = np.array(tr.sequences[i]), tr.prompt_lens[i]
        T = len(seq)
        tr.config.anchors = T - 1 - lp  # every candidate position: no sampling
        batch = tr.batch([i], np.random.default_rng(0))
        loss, logits = step_hidden(tr, batch, forward)
        m = logits.max(-1, keepdims=True)
        lse = m[..., 0] + np.log(np.exp(logits - m).sum(-1))
        labels = batch.labels.reshape(-1, B - 1)
        ce = lse - np.take_along_axis(logits, labels[..., None], -1)[..., 0]
        pred = vocab[logits.argmax(-1)]
        anchors = batch.anchors.reshape(-1)
        n = T - 1 - lp
        for j in range(n):
            a = int(anchors[j])
            pos = a + np.arange(1, B)
            present = pos < T
            true = np.where(present, np.concatenate([seq, np.zeros(B, dtype=seq.dtype)])[pos], -1)
            tally.add(
                (records[i]["index"], records[i]["tag"], a),
                records[i]["tag"],
                pred[j],
                true,
                present,
                batch.valid.reshape(-1, B - 1)[j] > 0,
                ce[j],
            )
        losses.append(loss)
        weights.append(float(batch.valid.sum()))
        if time.perf_counter() - last > 30 or i == len(tr.sequences) - 1:
            last = time.perf_counter()
            print(f"[{label}] {i + 1}/{len(tr.sequences)} answers ({last - tic:.0f} s)", file=sys.stderr, flush=True)
    mean_loss = float(np.average(losses, weights=weights)) if losses else None
    return tally, mean_loss


# ----------------------------------------------------------------------------------------------------------------
# (d): the runtime drafter, teacher-forced


def each_anchor(pair, answers: list[dict], label: str):
    """For each held-out answer and every anchor a in it: (answer, a, tokens), the tokens the answer's prompt and
    answer then B zeros (a block's labels past the end read them), with the runtime drafter's context on the true
    prefix before a, the target's features computed as the loop computes them (prompt
    prefill, then B tokens per forward)."""
    import mlx.core as mx
    import numpy as np

    from mlx_glimmer.decode_state import ROLLBACK_SLACK

    target, drafter = pair.target, pair.drafter
    B = drafter.block_size
    target.capture(drafter.target_layer_ids)
    tic = time.perf_counter()
    for n, ans in enumerate(answers):
        seq = ans["prompt_ids"] + ans["response_ids"]
        lp, T = len(ans["prompt_ids"]), len(seq)
        cache = target.make_cache(reserve=B + ROLLBACK_SLACK)
        feats = []
        for start in range(0, lp, 512):  # the prompt prefill, as generate_steps chunks it
            feats.append(target.forward(target.tokens(seq[start : min(lp, start + 512)]), cache, True)[1])
            target.sync(feats[-1], cache=cache)
        for start in range(lp, T, B):  # then B tokens per target forward, as verification runs them
            feats.append(target.forward(target.tokens(seq[start : start + B]), cache, True)[1])
            target.sync(feats[-1], cache=cache)
        feats = mx.concatenate(feats, axis=0)
        drafter.reset()
        drafter.observe(seq[:lp], feats[:lp])
        padded = np.array(seq + [0] * B)
        for a in range(lp, T - 1):
            yield ans, a, padded
            drafter.observe([seq[a]], feats[a : a + 1])
        print(
            f"[{label}] {n + 1}/{len(answers)} answers ({time.perf_counter() - tic:.0f} s)", file=sys.stderr, flush=True
        )


def inference_teacher_forced(pair, answers: list[dict], label: str = "d") -> Tally:
    import numpy as np

    from mlx_glimmer.settings import SamplingParams

    drafter = pair.drafter
    B = drafter.block_size
    vocab = set(np.array(drafter.draft_vocab).tolist()) if drafter.draft_vocab is not None else None
    tally, params = Tally(B - 1), SamplingParams()
    for ans, a, padded in each_anchor(pair, answers, label):
        draft, _ = drafter.propose(int(padded[a]), B - 1, params, None)
        pred = np.array(draft).astype(np.int64)
        pos = a + np.arange(1, B)
        present = pos < len(padded) - B
        true = np.where(present, padded[pos], -1)
        supervised = present & np.array([vocab is None or int(t) in vocab for t in true])
        tally.add((ans["index"], ans["tag"], a), ans["tag"], pred, true, present, supervised)
    return tally


# ----------------------------------------------------------------------------------------------------------------
# (c): real speculative decoding


def speculative_acceptance(pair, answers: list[dict], max_tokens: int, block_size: int) -> tuple[dict, list]:
    import numpy as np

    from mlx_glimmer.decode_state import common_prefix
    from mlx_glimmer.settings import GenerationSettings
    from mlx_glimmer.speculative import generate_steps

    drafter = pair.drafter
    K = block_size - 1
    offered, accepted, censored = (np.zeros(K, dtype=np.int64) for _ in range(3))
    committed_lengths, mismatches, rounds_at = [], [], []
    recorded: list = []
    original = drafter.propose

    def propose(anchor, count, params, noise):
        out = original(anchor, count, params, noise)
        recorded.append(np.array(out[0]).astype(np.int64).tolist())
        return out

    drafter.propose = propose
    tic = time.perf_counter()
    try:
        for n, ans in enumerate(answers):
            recorded.clear()
            steps = list(
                generate_steps(
                    pair.target,
                    ans["prompt_ids"],
                    GenerationSettings(max_tokens=max_tokens, block_size=block_size),
                    drafter=drafter,
                    stop_ids=pair.tokenizer.eos_token_ids,
                )
            )
            tokens = [t for s in steps for t in s.tokens]
            if tokens != ans["response_ids"]:
                mismatches.append(ans["index"])
            position = len(ans["prompt_ids"]) + len(steps[0].tokens) - 1  # the first anchor
            drafts = iter(recorded)
            for s in steps[1:]:
                draft = next(drafts) if s.drafted else []
                acc = common_prefix(draft, s.tokens)  # greedy: the target's token differs from the rejected draft
                cut = s.stopped and acc == len(s.tokens)  # a stop token among the accepted drafts ends the round
                for k in range(1, len(draft) + 1):
                    if acc < k - 1:
                        break
                    if cut and k > acc:
                        censored[k - 1] += 1
                        break
                    offered[k - 1] += 1
                    accepted[k - 1] += acc >= k
                committed_lengths.append(len(s.tokens))
                rounds_at.append(
                    (
                        ans["index"],
                        ans["tag"],
                        position,
                        draft[: acc + 1] if len(draft) > acc else draft,
                        acc,
                        len(draft),
                    )
                )
                position += len(s.tokens)
            print(
                f"[c] {n + 1}/{len(answers)} prompts ({time.perf_counter() - tic:.0f} s)", file=sys.stderr, flush=True
            )
    finally:
        del drafter.propose
    rounds = len(committed_lengths)
    out = {
        "prompts": len(answers),
        "rounds": rounds,
        "tokens_per_forward": round(sum(committed_lengths) / max(rounds, 1), 4),
        "conditional_acceptance": [round(float(a) / o, 4) if o else None for a, o in zip(accepted, offered)],
        "offered_given_previous_accepted": [int(x) for x in offered],
        "rounds_committing_at_least": [
            round(sum(m >= k for m in committed_lengths) / max(rounds, 1), 4) for k in range(1, block_size + 1)
        ],
        "outputs_equal_plain_greedy": len(answers) - len(mismatches),
        "mismatched_prompts": mismatches,
        "seconds": round(time.perf_counter() - tic, 1),
    }
    return out, rounds_at


def rounds_vs_teacher_forced(rounds_at: list, d: Tally) -> dict:
    """(d) at the anchors real decoding visited: its conditional accuracy there, and how often its block equals
    the real round's draft on the drafts that round showed (accepted ones and the first rejected one)."""

    keys = {k: i for i, k in enumerate(d.pred)}
    select, same, shown = [], 0, 0
    for idx, tag, pos, draft, acc, offered in rounds_at:
        i = keys.get((idx, tag, pos))
        if i is None or offered == 0:
            continue
        select.append(i)
        if offered == d.K:  # a shorter block (the last rounds before max_tokens) drafts differently
            pred = d.pred[(idx, tag, pos)]
            same += int(sum(int(a) == int(b) for a, b in zip(draft, pred)))
            shown += len(draft)
    s = d.summary(select) if select else {}
    return {
        "anchors": len(select),
        "conditional": s.get("conditional"),
        "accuracy_all": s.get("accuracy_all"),
        "draft_tokens_equal_to_real_drafts": round(same / max(shown, 1), 4),
        "draft_tokens_compared": shown,
    }


# ----------------------------------------------------------------------------------------------------------------


def fmt(x):
    return "   -  " if x is None else f"{100 * x:5.1f}%"


def print_table(results: dict, K: int) -> None:
    cols = [
        ("a train TF", results.get("a_training_teacher_forced", {}).get("accuracy")),
        ("b heldout TF", results.get("b_heldout_teacher_forced", {}).get("accuracy")),
        ("b mlx-f32", results.get("b_heldout_teacher_forced_mlx_f32", {}).get("accuracy")),
        ("d runtime TF", results.get("d_heldout_runtime_teacher_forced", {}).get("accuracy")),
        ("b cond", results.get("b_heldout_teacher_forced", {}).get("conditional")),
        ("d cond", results.get("d_heldout_runtime_teacher_forced", {}).get("conditional")),
        ("c accept|prev", results.get("c_speculative", {}).get("conditional_acceptance")),
        ("c P(>=k+1)", (results.get("c_speculative", {}).get("rounds_committing_at_least") or [None])[1:]),
        ("b=d pred", results.get("agreement", {}).get("b_vs_d", {}).get("same_prediction")),
    ]
    cols = [(n, v) for n, v in cols if v]
    print("pos " + " ".join(f"{n:>13}" for n, _ in cols))
    for k in range(K):
        print(f"{k + 1:>3} " + " ".join(f"{fmt(v[k] if k < len(v) else None):>13}" for _, v in cols))


def main(argv=None) -> int:
    from mlx_glimmer.blas import ensure_fast_blas

    try:
        from mlx_glimmer.paths import cache_dir
    except ImportError:  # before the package reorganisation
        from mlx_glimmer.demo import cache_dir
    ensure_fast_blas(cache_dir() / "blas")
    args = parse_args(argv)
    import mlx_glimmer
    from mlx_glimmer.cpu import cpu_facts
    from mlx_glimmer.demo import demo_bundle
    from mlx_glimmer.distill.data import load_prompts
    from mlx_glimmer.paths import DATA_DIR

    started = time.perf_counter()
    cache_dir = Path(args.cache)
    drafter_dir = Path(args.drafter).resolve()
    pair = mlx_glimmer.load(demo_bundle(), drafter=drafter_dir)
    if getattr(pair.drafter, "kind", None) != "dflash":
        raise SystemExit(f"{drafter_dir}: not a DFlash drafter")
    B = pair.drafter.block_size
    logged = training_log_backend(drafter_dir)
    forward = args.forward if args.forward != "auto" else (logged or "mlx")
    features = args.features if args.features != "auto" else ("torch" if forward == "torch" else "mlx")
    results = {
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "settings": {
            "drafter": shown(drafter_dir),
            "bundle": shown(pair.target_path.parent),
            "target": pair.quantization,
            "answers": args.answers,
            "prompts": args.prompts,
            "max_tokens": args.max_tokens,
            "block_size": B,
            "sampling": "greedy",
            "chat_template": True,
            "seed": args.seed,
            "responses": shown(args.responses),
            "training_forward": forward,
            "training_features": features,
            "drafter_training_backend": logged,
            "draft_vocab": None if pair.drafter.draft_vocab is None else int(pair.drafter.draft_vocab.shape[0]),
        },
        "cpu": cpu_facts(),
        "seconds": {},
    }

    def write():
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        results["seconds"]["total"] = round(time.perf_counter() - started, 1)
        out.write_text(json.dumps(results, indent=2))

    tallies = {}
    prompts = load_prompts(DATA_DIR / "prompts_heldout.jsonl")[: args.prompts]
    heldout = None
    if set(args.parts) & set("bcd"):
        heldout, secs = heldout_answers(pair, prompts, args.max_tokens, cache_dir)
        results["seconds"]["heldout_answers"] = round(secs, 1)
        results["heldout_answers"] = {
            "count": len(heldout),
            "tokens": sum(len(a["response_ids"]) for a in heldout),
            "cache": shown(cache_dir / f"heldout_greedy_{args.max_tokens}.json"),
        }

    if "a" in args.parts:
        tic = time.perf_counter()
        records = training_answers(Path(args.responses), args.answers, args.seed)
        tr, diffs = build_trainer(pair, records, drafter_dir, forward, features, cache_dir, "train")
        tally, loss = teacher_forced(tr, records, forward, "a")
        tallies["a"] = tally
        results["a_training_teacher_forced"] = {
            "forward": forward,
            "features": features,
            "answers": len(records),
            "tags": {t: sum(r["tag"] == t for r in records) for t in sorted({r["tag"] for r in records})},
            "loss": loss,
            **tally.summary(),
            "by_tag": tally.by_tag(),
        }
        results["trainer_vs_drafter_config"] = diffs
        results["seconds"]["a"] = round(time.perf_counter() - tic, 1)
        write()

    if "b" in args.parts:
        variants = [(forward, features, "b_heldout_teacher_forced")]
        if (forward, features) != ("mlx", "mlx") and not args.no_f32_variant:
            variants.append(("mlx", "mlx", "b_heldout_teacher_forced_mlx_f32"))
        for fw, ft, name in variants:
            tic = time.perf_counter()
            tr, diffs = build_trainer(pair, heldout, drafter_dir, fw, ft, cache_dir, f"heldout{args.max_tokens}")
            tally, loss = teacher_forced(tr, heldout, fw, name[:1] + ("" if name.endswith("forced") else "-mlx"))
            tallies[name] = tally
            results[name] = {"forward": fw, "features": ft, "answers": len(heldout), "loss": loss, **tally.summary()}
            results["trainer_vs_drafter_config"] = diffs
            results["seconds"][name] = round(time.perf_counter() - tic, 1)
            write()

    if "d" in args.parts:
        tic = time.perf_counter()
        d = inference_teacher_forced(pair, heldout)
        tallies["d"] = d
        results["d_heldout_runtime_teacher_forced"] = {
            "forward": "DFlashDrafter (runtime), float32 MLX target features",
            "answers": len(heldout),
            **d.summary(),
        }
        results["seconds"]["d"] = round(time.perf_counter() - tic, 1)
        agree = {}
        for name, key in (
            ("b_heldout_teacher_forced", "b_vs_d"),
            ("b_heldout_teacher_forced_mlx_f32", "b_mlx_f32_vs_d"),
        ):
            if name in tallies:
                agree[key] = agreement(tallies[name], d)
        if "b_heldout_teacher_forced" in tallies and "b_heldout_teacher_forced_mlx_f32" in tallies:
            agree["b_vs_b_mlx_f32"] = agreement(
                tallies["b_heldout_teacher_forced"], tallies["b_heldout_teacher_forced_mlx_f32"]
            )
        results["agreement"] = agree
        write()

    if "c" in args.parts:
        tic = time.perf_counter()
        c, rounds_at = speculative_acceptance(pair, heldout, args.max_tokens, B)
        results["c_speculative"] = c
        if "d" in tallies:
            results["d_at_real_rounds"] = rounds_vs_teacher_forced(rounds_at, tallies["d"])
        results["seconds"]["c"] = round(time.perf_counter() - tic, 1)

    write()
    print_table(results, B - 1)
    summary = {k: results[k] for k in ("c_speculative", "d_at_real_rounds") if k in results}
    for k in ("agreement", "trainer_vs_drafter_config", "seconds"):
        if k in results:
            summary[k] = results[k]
    for name in ("a_training_teacher_forced", "b_heldout_teacher_forced", "b_heldout_teacher_forced_mlx_f32"):
        if name in results:
            summary[f"{name}.loss"] = results[name]["loss"]
    for k, v in summary.items():
        print(f"{k}: {json.dumps(v)}")
    print(f"results: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
