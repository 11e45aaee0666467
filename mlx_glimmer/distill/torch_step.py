"""The training step on torch: transformers' `MuseGlimmerAssistantModel` under bfloat16 autocast.

The model is transformers' own assistant class (the one the torch backend drafts
with), fed the whole step at once: each answer is a batch row whose queries are
its A blocks side by side, whose keys are [its context ; its A blocks], with
position ids [0..T-1 ; a..a+B-1 per block]. Block j sees context positions
< a_j and its own block only: `block_attention`, registered with transformers'
`AttentionInterface`, computes just those scores (queries x context, and B x B
inside each block) instead of a dense masked [A*B, T + A*B] attention, which
spent most of its work on masked block pairs. That is exactly
`train.block_forward`'s attention, which a test checks.

The loss is `head_cross_entropy`: the frozen draft head and the weighted
cross-entropy in one autograd function over row chunks (~8 MB of logits each),
with the gradient for the hidden states computed on the way (the head is
frozen, so nothing else needs it). Done the plain way (logits, float32 copy,
log-softmax, its backward) the [rows, draft vocab] logits cost a large share of a
step's time in memory traffic.

The weights start from, and are copied back into, the MLX drafter (`sync`), so
evaluation, checkpoints and export are the MLX trainer's. Master weights and
AdamW state stay float32; matmuls run in bfloat16 where the CPU has AVX-512
bf16/AMX (`dtype="float32"` turns autocast off).

Compiled, the forward is specialised to each context width (static shapes: more
steps per second than one dynamic-shape graph, the softmax kernels vectorise
better; `benchmarks/experiments/results/torch_step_shapes.json`);
`Trainer.warm_up` compiles every width the data has before the first step.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import torch
from mlx.utils import tree_flatten

from ..drafters.config import DrafterConfig
from ..drafters.dflash import DFlashModel
from .step import Batch, TrainConfig, learning_rate


def context_mask(anchors: torch.Tensor, context_len: int) -> torch.Tensor:
    """[S, 1, A, 1, T] bool: block j's queries see the context positions < anchors[:, j]."""
    return (torch.arange(context_len) < anchors[:, :, None])[:, None, :, None, :]


def block_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Attention for DFlash training blocks. query [S, Hq, A*B, D]; key, value [S, Hkv, T + A*B, D] (context,
    then the blocks); attention_mask: `context_mask`. Returns ([S, A*B, Hq, D], None) as transformers expects."""
    S, Hq, Q, D = query.shape
    A = attention_mask.shape[2]
    B, T = Q // A, key.shape[2] - Q
    groups = Hq // key.shape[1]
    q = query.view(S, key.shape[1], groups, A, B, D)  # heads grouped by their key/value head
    k_ctx, v_ctx = key[:, :, None, :T], value[:, :, None, :T]  # [S, Hkv, 1, T, D]
    k_blk = key[:, :, T:].view(S, key.shape[1], 1, A, B, D)
    v_blk = value[:, :, T:].view(S, key.shape[1], 1, A, B, D)
    ctx_scores = (q.flatten(3, 4) @ k_ctx.transpose(-1, -2)).view(S, key.shape[1], groups, A, B, T) * scaling
    ctx_scores = ctx_scores.masked_fill(~attention_mask[:, :, None], float("-inf"))
    blk_scores = (q @ k_blk.transpose(-1, -2)) * scaling  # [S, Hkv, g, A, B, B]
    p = torch.softmax(torch.cat([ctx_scores, blk_scores], dim=-1).float(), dim=-1).to(value.dtype)
    out = (p[..., :T].flatten(3, 4) @ v_ctx).view(S, key.shape[1], groups, A, B, D) + p[..., T:] @ v_blk
    return out.reshape(S, Hq, Q, D).transpose(1, 2), None


class HeadCrossEntropy(torch.autograd.Function):
    """sum_i weights[i] * cross_entropy(h[i] @ head.T, labels[i]); h [N, H], head [Vd, H] frozen, labels and
    weights [N]. With `teacher` [N, H] and `soft` > 0 the label is the distribution (1 - soft) * one-hot +
    soft * softmax(teacher[i] @ head.T). The gradient for h is computed in the forward, chunk by chunk, so the
    logits are never kept."""

    @staticmethod
    def forward(ctx, h, head, labels, weights, chunk, teacher=None, soft=0.0):
        loss = torch.zeros((), dtype=torch.float32)
        grad = torch.empty(h.shape, dtype=torch.float32)
        for s in range(0, h.shape[0], chunk):
            rows = slice(s, s + chunk)
            logits = (h[rows].to(head.dtype) @ head.T).float()
            lse = torch.logsumexp(logits, dim=-1)
            y, w = labels[rows, None], weights[rows]
            if teacher is not None and soft:
                q = torch.softmax((teacher[rows].to(head.dtype) @ head.T).float(), dim=-1).mul_(soft)
                q.scatter_add_(1, y, torch.full(y.shape, 1.0 - soft))
                loss += ((lse - (q * logits).sum(-1)) * w).sum()
            else:
                q = None
                loss += ((lse - logits.gather(1, y)[:, 0]) * w).sum()
            p = logits.sub_(lse[:, None]).exp_()  # softmax
            if q is None:
                p.scatter_add_(1, y, torch.full(y.shape, -1.0))
            else:
                p.sub_(q)
            grad[rows] = (p.mul_(w[:, None]).to(head.dtype) @ head).float()
        ctx.save_for_backward(grad)
        ctx.h_dtype = h.dtype
        return loss

    @staticmethod
    def backward(ctx, g):
        (grad,) = ctx.saved_tensors
        return (grad * g).to(ctx.h_dtype), None, None, None, None, None, None


def head_cross_entropy(
    h: torch.Tensor,
    head: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    teacher: torch.Tensor | None = None,
    soft: float = 0.0,
) -> torch.Tensor:
    chunk = max(16, (1 << 21) // head.shape[0])  # ~8 MB of float32 logits per chunk (256 rows of an 8k head)
    return HeadCrossEntropy.apply(h, head, labels, weights, chunk, teacher, soft)


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register("drafter_blocks", block_attention)


class TorchStep:
    def __init__(
        self,
        model: DFlashModel,
        drafter_config: DrafterConfig,
        head: mx.array,
        embed,
        config: TrainConfig,
        dtype: str = "bfloat16",
        compile: bool = False,
    ):
        from transformers import MuseGlimmerAssistantModel

        from ..torch_backend.loading import assistant_config

        self.mlx_model, self.embed, self.config = model, embed, config
        self.autocast = dtype == "bfloat16"
        _register()
        self.net = MuseGlimmerAssistantModel._from_config(
            assistant_config(drafter_config), attn_implementation="drafter_blocks"
        )
        self.net.train()
        self._load_from_mlx()
        if compile:  # static shapes, one compile per context width (`TrainConfig.context_multiple` keeps them few)
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.forward = torch.compile(self._forward, dynamic=False) if compile else self._forward
        self.head = torch.from_numpy(np.array(head.astype(mx.float32)))  # [Vd, H], frozen
        self.head_bf16 = self.head.to(torch.bfloat16)
        self.position_weights = torch.exp(-torch.arange(config.block_size - 1, dtype=torch.float32) / config.gamma)
        self.optimizer = torch.optim.AdamW(
            self.net.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay, fused=True
        )
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: learning_rate(step, config) / config.learning_rate
        )

    def _mlx_weights(self) -> dict[str, mx.array]:
        return {k: v for k, v in tree_flatten(self.mlx_model.parameters()) if k != "draft_vocab"}

    def _load_from_mlx(self) -> None:
        state = {k: torch.from_numpy(np.array(v.astype(mx.float32))) for k, v in self._mlx_weights().items()}
        missing, unexpected = self.net.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.endswith("inv_freq")]
        if missing or unexpected:
            raise RuntimeError(
                f"MLX drafter and transformers' assistant differ: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )

    def _loss(self, batch: Batch) -> torch.Tensor:
        S, A, B = batch.block_ids.shape
        T = batch.ctx.shape[1]
        noise = torch.from_numpy(np.array(self.embed(mx.array(batch.block_ids.reshape(S, A * B))).astype(mx.float32)))
        anchors = torch.from_numpy(batch.anchors)
        block_positions = (anchors[:, :, None] + torch.arange(B)).reshape(S, A * B)
        position_ids = torch.cat([torch.arange(T).expand(S, T), block_positions], dim=1)
        mask = context_mask(anchors, T)
        context = torch.from_numpy(batch.ctx).to(torch.bfloat16 if self.autocast else torch.float32)
        h = self.forward(noise, context, position_ids, mask).reshape(S, A, B, -1)[:, :, 1:]  # [S, A, B-1, H]
        w = (self.position_weights * torch.from_numpy(batch.valid)).flatten()
        head = self.head_bf16 if self.autocast else self.head
        teacher = None if batch.teacher is None else torch.from_numpy(batch.teacher).flatten(0, 2)
        return head_cross_entropy(
            h.flatten(0, 2),
            head,
            torch.from_numpy(batch.labels).flatten(),
            w / w.sum().clamp(min=1.0),
            teacher,
            self.config.soft_labels,
        )

    def _forward(self, noise, context, position_ids, mask) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            return self.net(
                noise_embeds=noise,
                context_hidden_states=context,
                position_ids=position_ids,
                attention_mask={"full_attention": mask, "sliding_attention": mask},
            ).last_hidden_state

    def __call__(self, batch: Batch) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._loss(batch)
        loss.backward()
        self.optimizer.step()
        self.schedule.step()
        return float(loss.detach())

    @torch.no_grad()
    def loss(self, batch: Batch) -> float:
        return float(self._loss(batch))

    def warm_up(self, batch: Batch) -> None:
        self._loss(batch).backward()
        self.optimizer.zero_grad(set_to_none=True)

    def sync(self) -> None:
        state = self.net.state_dict()
        self.mlx_model.load_weights(
            [(k, mx.array(state[k].float().numpy())) for k in self._mlx_weights()], strict=False
        )

    def save_optimizer(self, path: Path) -> None:
        torch.save(
            {"optimizer": self.optimizer.state_dict(), "schedule": self.schedule.state_dict()}, path / "optimizer.pt"
        )

    def load_optimizer(self, path: Path) -> None:
        self._load_from_mlx()
        saved = torch.load(path / "optimizer.pt", weights_only=True)
        self.optimizer.load_state_dict(saved["optimizer"])
        self.schedule.load_state_dict(saved["schedule"])
