"""Training a DFlash drafter on the target's own answers (the DFlash recipe, in MLX).

Per step, `sequences_per_step` answered prompts; for each, the frozen
target's features at `target_layer_ids` for every position (computed once and
kept on disk, or as each step draws its sequences: `features.py`), a random
set of `anchors` positions inside the answer, and one block per anchor:
[anchor token, mask x (B-1)] at positions a..a+B-1, seeing its own sequence's
context before a and its own block (each block is a batch row, so blocks never
see each other). Loss: cross-entropy of
block positions 1..B-1 against the target's tokens, weighted exp(-(k-1)/gamma).
The target's embedding table and output head are frozen and borrowed; only
the drafter's layers, `fc` and norms learn.

The loss and the drafter's proposals use a reduced draft vocabulary (the
`draft_vocab_size` tokens the target emits most often in the training answers,
or all of them; EAGLE-3/FR-Spec style): the output head is the dominant cost at
this size. Verification still uses the full vocabulary, so output stays
lossless; a token outside the draft vocabulary is simply never drafted.

Warm starts (`init`): "random"; "target" (or "target:L1,L2,...") starts the
drafter as the target's own layers continuing from its deepest captured state
(`init_from_target`); a drafter directory
fine-tunes its weights, growing a shallower drafter by identity layers
(`load_for_fine_tuning`).

The optimiser step runs on one of two backends behind the `TrainStep`
protocol (`step.py`: the contract both sides share), both fed the same `Batch`: `MLXStep` trains our MLX `DFlashModel`
itself (MLX on the GPU is the fast choice on a Mac); `TorchStep`
(`torch_step.py`) trains transformers' `MuseGlimmerAssistantModel` under
bfloat16 autocast, the fast choice on a CPU with AVX-512 bf16/AMX, and copies
its weights into the MLX drafter for every evaluation and checkpoint. The MLX
drafter stays the one that is evaluated, saved and shipped.
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from ..drafters.config import DrafterConfig
from ..drafters.dflash import DFlashModel, dflash_target_layer_ids
from ..errors import GlimmerError
from ..files import published_directory, remove_leftovers, staged_directory
from ..target import Target, head_weight
from .features import Features, FeatureSource, FeatureStore, OnlineFeatures
from .step import Batch, TrainConfig, TrainStep, learning_rate, target_init_layers


def context_layer_ids(target: Target, config: TrainConfig) -> list[int]:
    """The target layers whose outputs the drafter reads (and the feature store holds)."""
    return dflash_target_layer_ids(target.num_layers, config.context_layers)


def drafter_config_for(
    target: Target, train: TrainConfig, mask_token_id: int, draft_vocab_size: int | None
) -> DrafterConfig:
    args = target.args
    heads = int(args.num_attention_heads)
    return DrafterConfig(
        hidden_size=target.hidden_size,
        intermediate_size=max(1, round(int(args.intermediate_size) * train.mlp_width)),
        num_hidden_layers=train.layers,
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(args, "num_key_value_heads", heads) or heads),
        head_dim=int(getattr(args, "head_dim", None) or target.hidden_size // heads),
        rms_norm_eps=float(getattr(args, "rms_norm_eps", 1e-5)),
        rope_theta=float(getattr(args, "rope_theta", 10000.0)),
        max_position_embeddings=int(getattr(args, "max_position_embeddings", 8192)),
        sliding_window=2048,
        block_size=train.block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=context_layer_ids(target, train),
        vocab_size=target.vocab_size,
        num_target_layers=target.num_layers,
        draft_vocab_size=draft_vocab_size,
    )


def block_forward(
    model: DFlashModel,
    noise: mx.array,
    positions: mx.array,
    ctx: mx.array,
    anchors: mx.array,
    rows: mx.array | None = None,
) -> mx.array:
    """Hidden states of A blocks at once. noise [A, B, H]; positions [A] (anchor positions); ctx [S, T, k*H]
    features of S sequences (or [T, k*H] for one); `rows` [A] the sequence of each block (default all 0);
    block a sees its sequence's context positions < anchors[a] and its own block."""
    A, B, _ = noise.shape
    if ctx.ndim == 2:
        ctx = ctx[None]
    rows = rows if rows is not None else mx.zeros((A,), dtype=mx.int32)
    T = ctx.shape[1]
    c = model.encoder(ctx.astype(mx.float32))  # [S, T, H]
    ctx_visible = mx.arange(T)[None, :] < anchors[:, None]  # [A, T]
    mask = mx.concatenate([ctx_visible, mx.ones((A, B), dtype=mx.bool_)], axis=1)[:, None, None, :]
    h = noise
    for layer in model.layers:
        att = layer.self_attn
        x = layer.input_layernorm(h)
        q = att.q_norm(att.q_proj(x).reshape(A, B, att.n_heads, att.head_dim)).transpose(0, 2, 1, 3)
        q = model.rope(q, offset=positions)
        k_blk, v_blk = att.project_kv(x, lambda t, offset: model.rope(t, offset=positions), 0)
        k_ctx, v_ctx = att.project_kv(c, model.rope, 0)
        k = mx.concatenate([k_ctx[rows], k_blk], axis=2)
        v = mx.concatenate([v_ctx[rows], v_blk], axis=2)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=att.scale, mask=mask)
        h = h + att.o_proj(out.transpose(0, 2, 1, 3).reshape(A, B, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.norm(h)


def draft_vocabulary(records: list[dict], mask_token_id: int, size: int | None) -> tuple[list[int], float]:
    """The `size` most frequent answer tokens (all when None) plus the mask token, sorted; and their coverage."""
    counts = np.bincount(np.concatenate([np.asarray(r["response_ids"], dtype=np.int64) for r in records]))
    emitted = np.nonzero(counts)[0]
    if size is not None and size < len(emitted):
        emitted = emitted[np.argsort(-counts[emitted], kind="stable")[:size]]
    coverage = float(counts[emitted].sum() / max(counts.sum(), 1))
    return sorted(set(emitted.tolist()) | {mask_token_id}), coverage


def float_weights(module: nn.Module) -> dict[str, mx.array]:
    """A module's weights in float32 by name, quantized linears dequantized (quantized bundles train too)."""
    out = {}
    for name, sub in module.named_modules():
        if isinstance(sub, nn.QuantizedLinear):
            w = mx.dequantize(sub.weight, sub.scales, sub.biases, sub.group_size, sub.bits)
            out[f"{name}.weight" if name else "weight"] = w.astype(mx.float32)
    for name, value in tree_flatten(module.parameters()):
        base = name.rsplit(".", 1)[0]
        if name.endswith((".scales", ".biases")) and f"{base}.weight" in out:
            continue
        if name not in out and mx.issubdtype(value.dtype, mx.floating):
            out[name] = value.astype(mx.float32)
    return out


def init_from_target(model: DFlashModel, target: Target, layer_ids: list[int]) -> int:
    """Start the drafter from the target's own computation; returns how many identity layers follow the copies.

    Drafter layer i becomes target layer `layer_ids[i]` (attention and MLP projections, both norms); layers
    past the list start as the identity (zero output projections). `fc` passes the deepest captured layer's
    features on as they are (the identity on that slice, zero elsewhere), the q/k norms start at one and the
    final norm is the target's, so the drafter begins as the target's last layers continuing from its deepest
    captured state."""
    own = dict(tree_flatten(model.parameters()))
    weights, missing = [], set()
    for j, source in enumerate(layer_ids):
        copied = float_weights(target.model.model.layers[source])
        for name, value in own.items():
            if not name.startswith(f"layers.{j}."):
                continue
            local = name.removeprefix(f"layers.{j}.")
            if local.startswith("self_attn.q_norm.") or local.startswith("self_attn.k_norm."):
                weights.append((name, mx.ones_like(value)))
            elif local in copied and copied[local].shape == value.shape:
                weights.append((name, copied[local]))
            else:
                missing.add(local)
    if missing:
        raise GlimmerError(
            f"--init target: the target's layers do not match the drafter's ({', '.join(sorted(missing)[:3])})"
        )
    H = model.config.hidden_size
    captured = list(model.config.target_layer_ids)
    deepest = captured.index(max(captured))
    fc = mx.zeros_like(own["encoder.fc.weight"])
    fc[:, deepest * H : (deepest + 1) * H] = mx.eye(H)
    weights.append(("encoder.fc.weight", fc))
    weights.append(("encoder.output_norm_enc.weight", mx.ones_like(own["encoder.output_norm_enc.weight"])))
    final = float_weights(target.model.model.norm).get("weight")
    if final is not None and final.shape == own["norm.weight"].shape:
        weights.append(("norm.weight", final))
    model.load_weights(weights, strict=False)
    for layer in model.layers[len(layer_ids) :]:
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    return len(model.layers) - len(layer_ids)


def load_for_fine_tuning(model: DFlashModel, saved: dict[str, mx.array], source: str) -> int:
    """Load a drafter's weights into `model` to fine-tune them; returns how many layers `model` adds.

    A drafter with fewer layers grows: its layers become the first ones, and each added layer starts
    with zero output projections (attention `o_proj`, MLP `down_proj`), an identity on the residual
    stream, so the grown drafter drafts exactly what the saved one did and training only adds to it.
    """
    own = {k: v for k, v in tree_flatten(model.parameters()) if k != "draft_vocab"}
    saved_layers = len({k.split(".")[1] for k in saved if k.startswith("layers.")})
    if saved_layers > len(model.layers):
        raise GlimmerError(f"--init {source}: it has {saved_layers} layers, more than --layers {len(model.layers)}")
    added = tuple(f"layers.{j}." for j in range(saved_layers, len(model.layers)))
    misfit = [f"{k} {tuple(v.shape)}" for k, v in saved.items() if k not in own or own[k].shape != v.shape]
    misfit += [f"{k} (missing)" for k in own if k not in saved and not k.startswith(added)]
    if misfit:
        raise GlimmerError(f"--init {source}: its weights do not fit this drafter ({', '.join(misfit[:3])})")
    model.load_weights(list(saved.items()), strict=False)
    for layer in model.layers[saved_layers:]:
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    return len(model.layers) - saved_layers


def trained_records(records: list[dict]) -> list[dict]:
    """The answers a run trains on: those with at least two tokens (one anchor and one label)."""
    return [r for r in records if len(r["response_ids"]) >= 2]


def training_sequences(records: list[dict]) -> list[list[int]]:
    """Prompt + answer token ids of every trained answer, in order: what the feature store holds."""
    return [r["prompt_ids"] + r["response_ids"] for r in trained_records(records)]


class Trainer:
    def __init__(
        self,
        target: Target,
        records: list[dict],
        config: TrainConfig,
        out_dir: Path,
        *,
        mask_token_id: int,
        feature_source: FeatureSource | None = None,
        features_dir: Path | None = None,
        online_features: bool = False,
        recompute_features: bool = False,
        log=sys.stderr,
    ):
        self.target = target
        self.config = config
        self.out_dir = Path(out_dir)
        self.log = log
        self.rng = np.random.default_rng(config.seed)
        kept = trained_records(records)
        self.sequences = training_sequences(kept)
        self.prompt_lens = [len(r["prompt_ids"]) for r in kept]
        tags = config.train_tags
        self.trained = [i for i, r in enumerate(kept) if tags is None or r.get("tag") in tags]  # drawn for steps
        if not self.trained and tags is not None:
            raise GlimmerError(f"--train-tags {','.join(tags)}: no answer has one of these tags")
        self.answer_tokens_per_draw = sum(len(kept[i]["response_ids"]) for i in self.trained) / max(
            len(self.trained), 1
        )
        vocab, self.vocab_coverage = draft_vocabulary(kept, mask_token_id, config.draft_vocab_size)
        self.draft_vocab = mx.array(vocab, dtype=mx.int32)
        self.to_draft = np.full(target.vocab_size, -1, dtype=np.int64)
        self.to_draft[np.array(vocab)] = np.arange(len(vocab))
        self.drafter_config = drafter_config_for(target, config, mask_token_id, len(vocab))
        target.capture(tuple(self.drafter_config.target_layer_ids))
        if not 0.0 <= config.soft_labels <= 1.0:
            raise GlimmerError(f"soft_labels: {config.soft_labels} is not in [0, 1]")
        layer_ids, teacher = self.drafter_config.target_layer_ids, config.soft_labels > 0
        self.features: Features
        if online_features:
            self.features = OnlineFeatures(target, self.sequences, layer_ids, feature_source, teacher)
        else:
            directory = Path(features_dir) if features_dir is not None else self.out_dir / "features"
            self.features = FeatureStore(
                directory, target, self.sequences, layer_ids, feature_source, teacher, recompute_features, log=log
            )
        self.feature_scale = self._feature_scale(config.context_scale)
        mx.random.seed(config.seed)
        self.model = DFlashModel(self.drafter_config)
        self.initialise(config.init)
        self.model.draft_vocab = self.draft_vocab
        self.model.freeze(keys=["draft_vocab"])
        self.head = head_weight(target)[self.draft_vocab]  # [Vd, H], frozen
        self.embed = target.model.model.embed_tokens
        self.step = 0
        self.order: list[int] = []  # sequences left in this epoch
        self.positions_per_second: float | None = None  # over the last logged stretch of steps
        if config.backend == "mlx":
            self.step_fn: TrainStep = MLXStep(self.model, self.head, self.embed, config)
        elif config.backend == "torch":
            from .torch_step import TorchStep

            self.step_fn = TorchStep(
                self.model,
                self.drafter_config,
                self.head,
                self.embed,
                config,
                dtype=config.precision,
                compile=config.compile,
            )
        else:
            raise GlimmerError(f"backend: {config.backend!r} is neither 'mlx' nor 'torch'")

    def _feature_scale(self, kind: str) -> np.ndarray | None:
        """`context_scale` "channel": each feature channel's RMS over the answers' positions past the first of
        up to 256 sequences (a seeded sample). The first position is left out: layer outputs there carry the
        attention sink's massive activations (x1000 the rest in SmolLM2's middle layers). None for "raw"."""
        if kind == "raw":
            return None
        if kind != "channel":
            raise GlimmerError(f"context_scale: {kind!r} is neither 'raw' nor 'channel'")
        self.features.ensure(self.log)
        sample = np.random.default_rng(self.config.seed).permutation(len(self.sequences))[:256]
        squares, count = np.zeros(self.features.width), 0
        for feats, _ in self.features.rows([int(i) for i in sample]):
            x = feats[1:].astype(np.float32)
            squares += (x * x).sum(0)
            count += len(x)
        return np.maximum(np.sqrt(squares / max(count, 1)), 1e-3).astype(np.float32)

    def _scale_fc(self, factor: np.ndarray) -> None:
        fc = self.model.encoder.fc
        fc.weight = fc.weight * mx.array(factor)[None, :]

    @contextmanager
    def inference_weights(self):
        """`self.model` with the weights inference uses: with `context_scale` "channel" the trained `fc` (on
        features / scale) folded into one for raw features, and put back exactly afterwards."""
        self.step_fn.sync()
        kept = self.model.encoder.fc.weight
        if self.feature_scale is not None:
            self._scale_fc(1.0 / self.feature_scale)
        try:
            yield self.model
        finally:
            self.model.encoder.fc.weight = kept

    def initialise(self, init: str) -> None:
        if init == "random":
            return
        ids = target_init_layers(init, self.target.num_layers, len(self.model.layers))
        if ids is not None:
            added = init_from_target(self.model, self.target, ids)
            grown = f", then {added} identity layers" if added else ""
            print(f"[init] drafter layers from the target's layers {ids}{grown}", file=self.log, flush=True)
            return
        path = Path(init)
        if not (path / "model.safetensors").is_file():
            raise GlimmerError(f"--init: {init!r} is neither 'random', 'target' nor a drafter directory")
        saved = {
            k: v.astype(mx.float32) for k, v in mx.load(str(path / "model.safetensors")).items() if k != "draft_vocab"
        }
        added = load_for_fine_tuning(self.model, saved, str(path))
        if self.feature_scale is not None:
            self._scale_fc(self.feature_scale)
        if added:
            print(
                f"[init] {path}: {len(self.model.layers) - added} layers, grown to {len(self.model.layers)} by "
                "identity layers",
                file=self.log,
                flush=True,
            )

    def context_width(self, indices) -> int:
        m = max(1, self.config.context_multiple)
        return -(-max(len(self.sequences[i]) for i in indices) // m) * m  # padding: no block sees past its anchor

    def batch(self, indices, rng: np.random.Generator | None = None) -> Batch:
        """The step's inputs for one sequence index or a list of them: `anchors` blocks per sequence, contexts padded.
        Anchors are drawn from `rng` (default: the trainer's own, which a checkpoint saves)."""
        indices = [indices] if isinstance(indices, int) else list(indices)
        rng = self.rng if rng is None else rng
        self.features.ensure(self.log)
        B, A = self.config.block_size, self.config.anchors
        width = self.context_width(indices)
        ctx = np.zeros((len(indices), width, self.features.width), dtype=np.float16)
        block_ids = np.full((len(indices), A, B), self.drafter_config.mask_token_id, dtype=np.int64)
        anchors = np.zeros((len(indices), A), dtype=np.int64)
        labels = np.zeros((len(indices), A, B - 1), dtype=np.int64)
        valid = np.zeros((len(indices), A, B - 1), dtype=np.float32)
        soft = self.config.soft_labels > 0
        teacher = np.zeros((len(indices), A, B - 1, self.target.hidden_size), dtype=np.float16) if soft else None
        for r, (i, (feats, hidden)) in enumerate(zip(indices, self.features.rows(indices))):
            seq, lp = np.array(self.sequences[i]), self.prompt_lens[i]
            T = len(seq)
            ctx[r, :T] = feats if self.feature_scale is None else feats / self.feature_scale
            candidates = np.arange(lp, T - 1)
            n = min(A, len(candidates))
            a = np.sort(rng.choice(candidates, size=n, replace=False))
            anchors[r, :n] = a
            block_ids[r, :n, 0] = seq[a]
            label_pos = a[:, None] + np.arange(1, B)[None]
            lab = self.to_draft[np.concatenate([seq, np.zeros(B, dtype=seq.dtype)])[label_pos]]
            labels[r, :n] = np.maximum(lab, 0)
            valid[r, :n] = (label_pos < T) & (lab >= 0)
            if soft:  # the target's hidden state at p - 1 is what predicted the token at p
                teacher[r, :n] = hidden[np.minimum(label_pos, T) - 1]
        return Batch(ctx, block_ids, anchors, labels, valid, teacher)

    def next_indices(self) -> list[int]:
        out = []
        while len(out) < min(self.config.sequences_per_step, len(self.trained)):
            if not self.order:  # permutation of [0..n) draws as permutation(n) does: the same stream as before
                self.order = [int(i) for i in self.rng.permutation(self.trained)]
            out.append(self.order.pop())
        return out

    def upcoming_indices(self) -> list[int]:
        """The next step's sequences as `next_indices` will draw them, drawing nothing: none where the permutation
        ends first (a new one is drawn then)."""
        n = min(self.config.sequences_per_step, len(self.trained))
        return self.order[-n:] if len(self.order) >= n else []

    def warm_up(self) -> list[int]:
        """Run one batch of every padded context width in the data through `step_fn.warm_up` (a compiled step
        compiles each width once, here rather than in the middle of training); the weights, the optimiser
        and the trainer's random stream are untouched. Returns the widths."""
        by_width: dict[int, list[int]] = {}
        for i in range(len(self.sequences)):
            by_width.setdefault(self.context_width([i]), []).append(i)
        n, rng, tic = (
            min(self.config.sequences_per_step, len(self.sequences)),
            np.random.default_rng(0),
            time.perf_counter(),
        )
        for k, (width, indices) in enumerate(sorted(by_width.items())):
            self.step_fn.warm_up(self.batch((indices * n)[:n], rng))
            print(
                f"[compile] context width {width} ({k + 1}/{len(by_width)}, {time.perf_counter() - tic:.0f} s)",
                file=self.log,
                flush=True,
            )
        return sorted(by_width)

    def train(self, evaluate=None, until: int | None = None) -> None:
        """Train to `config.steps` (or stop early at step `until`, as an interruption would)."""
        c = self.config
        self.features.ensure(self.log)
        if c.backend == "torch" and c.compile and self.step < min(c.steps, until or c.steps):
            self.warm_up()
        if evaluate is not None and self.step == 0 and c.init != "random":  # where a warm start begins
            self._evaluate(evaluate)
        tic, losses, positions = time.perf_counter(), [], 0.0
        while self.step < min(c.steps, until or c.steps):
            batch = self.batch(self.next_indices())
            self.features.prefetch(self.upcoming_indices())  # read while this step computes
            losses.append(self.step_fn(batch))
            positions += batch.positions
            self.step += 1
            if self.step % 25 == 0:
                elapsed = time.perf_counter() - tic
                self.positions_per_second = positions / elapsed
                print(
                    f"[train] step {self.step}/{c.steps} loss {np.mean(losses):.3f} ({25 / elapsed:.2f} steps/s, "
                    f"{self.positions_per_second:.0f} block positions/s)",
                    file=self.log,
                    flush=True,
                )
                tic, losses, positions = time.perf_counter(), [], 0.0
            if self.step % c.checkpoint_every == 0 or self.step == c.steps:
                self.save(self.out_dir / "checkpoint")
            if evaluate is not None and (self.step % c.eval_every == 0 or self.step == c.steps):
                self._evaluate(evaluate)

    def _evaluate(self, evaluate) -> None:
        with self.inference_weights():
            acc = evaluate(self)
        print(f"[eval] step {self.step} held-out mean acceptance {acc:.3f}", file=self.log, flush=True)
        self.save(self.out_dir / f"step{self.step:06d}")

    def save(self, path: Path) -> None:
        """Weights, optimizer and trainer state at `path`, replaced whole: a kill while saving leaves the previous
        checkpoint (its weights, optimizer and step agreeing), never the new weights beside the old step."""
        with self.inference_weights() as model:
            weights = dict(tree_flatten(model.parameters()))
        weights["draft_vocab"] = self.draft_vocab
        with staged_directory(path, "checkpoint") as staging:
            mx.save_safetensors(str(staging / "model.safetensors"), weights)
            (staging / "config.json").write_text(json.dumps(self.drafter_config.to_dict(), indent=2))
            self.step_fn.save_optimizer(staging)
            meta = {
                "step": self.step,
                "order": self.order,
                "rng": self.rng.bit_generator.state,
                "backend": self.config.backend,
                "steps": self.config.steps,
            }
            (staging / "trainer.json").write_text(json.dumps(meta))
        remove_leftovers(path)  # of saves killed before this one

    def resume(self, path: Path) -> bool:
        path = published_directory(path)
        if not (path / "trainer.json").is_file():
            return False
        meta = json.loads((path / "trainer.json").read_text())
        if meta.get("backend", "mlx") != self.config.backend:
            raise GlimmerError(
                f"{path}: this checkpoint was trained with --train-backend {meta.get('backend', 'mlx')}; "
                f"resume with the same backend (or start a new --out)"
            )
        self.model.load_weights(str(path / "model.safetensors"), strict=False)
        if self.feature_scale is not None:
            self._scale_fc(self.feature_scale)
        self.step_fn.load_optimizer(path)
        self.step = meta["step"]
        self.order = meta["order"]
        self.rng.bit_generator.state = meta["rng"]
        began = meta.get("steps", self.config.steps)
        if began != self.config.steps:  # allowed (it extends or shortens a run), but the schedule moves
            print(
                f"[train] this run began with --steps {began}; the learning rate now follows --steps "
                f"{self.config.steps}: {learning_rate(self.step, self.config):.2e} at step {self.step}, where it "
                f"was {learning_rate(self.step, replace(self.config, steps=began)):.2e}",
                file=self.log,
                flush=True,
            )
        return True


def blocks_flat(batch: Batch) -> tuple[np.ndarray, np.ndarray]:
    """The batch's blocks as rows: ([S*A, B] block token ids, [S*A] their sequence)."""
    S, A, B = batch.block_ids.shape
    return batch.block_ids.reshape(S * A, B), np.repeat(np.arange(S, dtype=np.int32), A)


class MLXStep:
    """AdamW on the MLX drafter itself."""

    def __init__(self, model: DFlashModel, head: mx.array, embed, config: TrainConfig):
        self.model, self.head, self.embed = model, head, embed
        self.position_weights = mx.exp(-mx.arange(config.block_size - 1, dtype=mx.float32) / config.gamma)
        self.soft = config.soft_labels
        self.optimizer = optim.AdamW(
            learning_rate=lambda step: mx.array(learning_rate(int(step.item()), config)),
            weight_decay=config.weight_decay,
            bias_correction=True,
        )
        self.loss_and_grad = nn.value_and_grad(model, self._loss)

    def _loss(self, batch: Batch) -> mx.array:
        ids, rows = blocks_flat(batch)
        anchors = mx.array(batch.anchors.reshape(-1))
        h = block_forward(self.model, self.embed(mx.array(ids)), anchors, mx.array(batch.ctx), anchors, mx.array(rows))
        logits = h[:, 1:] @ self.head.T  # [S*A, B-1, Vd]
        labels = mx.array(batch.labels.reshape(logits.shape[:2]))
        w = self.position_weights[None] * mx.array(batch.valid.reshape(logits.shape[:2]))
        ce = nn.losses.cross_entropy(logits, labels, reduction="none")
        if self.soft:  # cross-entropy to (1 - soft) * one-hot + soft * the target's distribution
            q = mx.softmax(mx.array(batch.teacher).reshape(*logits.shape[:2], -1).astype(mx.float32) @ self.head.T, -1)
            ce_soft = mx.logsumexp(logits, axis=-1) - (q * logits).sum(-1)
            ce = (1 - self.soft) * ce + self.soft * ce_soft
        return (ce * w).sum() / mx.maximum(w.sum(), 1.0)

    def __call__(self, batch: Batch) -> float:
        loss, grads = self.loss_and_grad(batch)
        self.optimizer.update(self.model, grads)
        mx.eval(loss, self.model.parameters(), self.optimizer.state)
        return loss.item()

    def loss(self, batch: Batch) -> float:
        return self._loss(batch).item()

    def warm_up(self, batch: Batch) -> None:
        mx.eval(self.loss_and_grad(batch))

    def sync(self) -> None:
        pass

    def save_optimizer(self, path: Path) -> None:
        state = dict(tree_flatten(self.optimizer.state))
        mx.save_safetensors(
            str(path / "optimizer.safetensors"), {k: v for k, v in state.items() if isinstance(v, mx.array)}
        )

    def load_optimizer(self, path: Path) -> None:
        from mlx.utils import tree_unflatten

        self.optimizer.init(self.model.trainable_parameters())
        saved = mx.load(str(path / "optimizer.safetensors"))
        self.optimizer.state = tree_unflatten(list({**dict(tree_flatten(self.optimizer.state)), **saved}.items()))
