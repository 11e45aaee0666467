"""The target split over processes started by `mlx.launch` (tensor parallel), the drafter whole on each.

Under `mlx.launch -n N` (ring over sockets, JACCL over Thunderbolt, MPI) every process loads the same pair and
keeps 1/N of each decoder layer: attention's query, key, value (and Muse's output gate) projections split by
heads, its output projection by input columns, the MLP's gate and up projections by rows and its down
projection by columns. Each split layer's partial products are summed across the processes
(`mlx.nn.layers.distributed`), so every process ends each layer with the same hidden state. mlx-lm's own
`shard()` splits a model that has one (Llama, Qwen); Muse Glimmer has none, so `shard_muse` does it with the
same sharded linears. The embedding table, the norms and the output head stay whole on every process: the
drafter reads them, and the head's logits then need no gathering.

Every process runs the same speculative loop in lockstep: the drafter in full, its share of each target call.
A process that verified another width, or stopped a round earlier, would wait forever in the next layer's
sum, so what steers the loop is taken from rank 0: the values each round reads (`SplitTarget.read`, one
small sum on the device before the round's one host read) and, under `--block-size auto`, the policy's
choices, which weigh each process's own wall-clock timings (`LockstepPolicy`, one small sum per choice).
Only rank 0 prints.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_linear
from mlx_lm.models import muse_glimmer

from .block_policy import Shape, WidthPolicy
from .errors import GlimmerError
from .ranks import from_rank_zero, split_group, world
from .target import Target, decoder_layers


def check_divisible(model: nn.Module, group: mx.distributed.Group, config_path: Path) -> None:
    """Heads, key/value heads and the MLP width split evenly over the processes, or one error naming them."""
    n, args = group.size(), model.args
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(args, name, None)
        if isinstance(value, int) and value % n:
            raise GlimmerError(
                f"{config_path}: {name} {value} does not divide over {n} processes; "
                f"split this target over a number of processes that divides it"
            )


def shard_muse(model: muse_glimmer.Model, group: mx.distributed.Group) -> None:
    """Split a Muse Glimmer's decoder layers over `group` in place: each process keeps its share of the query
    and key/value heads (the output gate follows the query heads), and the MLP's hidden units."""
    n = group.size()
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for name in ("q_proj", "k_proj", "v_proj", "gate_proj"):
            setattr(attn, name, shard_linear(getattr(attn, name), "all-to-sharded", group=group))
        attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
        attn.n_heads //= n
        attn.n_kv_heads //= n
        mlp.gate_proj = shard_linear(mlp.gate_proj, "all-to-sharded", group=group)
        mlp.up_proj = shard_linear(mlp.up_proj, "all-to-sharded", group=group)
        mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)


def shard_model(model: nn.Module, group: mx.distributed.Group, config_path: Path) -> None:
    """Split `model`'s decoder layers over `group` in place: mlx-lm's `shard()` where the model has one, else
    `shard_muse` for Muse Glimmer; any other model is refused with one error."""
    check_divisible(model, group, config_path)
    try:
        if hasattr(model, "shard"):  # mlx-lm's own tensor-parallel split, where the model class defines one
            model.shard(group)
        elif isinstance(model, muse_glimmer.Model):
            shard_muse(model, group)
        else:
            raise GlimmerError(
                f"{config_path}: model_type {model.args.model_type!r} cannot be split across processes "
                "(mlx-lm gives it no shard()); supported: Muse Glimmer and mlx-lm models with shard()"
            )
    except ValueError as e:  # a quantized layer whose groups do not split evenly, say
        raise GlimmerError(f"{config_path}: cannot split this target over {group.size()} processes ({e})") from None


@dataclass
class SplitTarget(Target):
    """A target whose decoder layers are split over `group`: every round's read takes rank 0's values, so all
    processes commit the same tokens and run the same rounds."""

    group: Any = None  # mx.distributed.Group (not a dataclass-friendly type)

    def read(self, *arrays) -> list[int]:
        parts = [a.reshape(-1).astype(mx.int32) for a in arrays if a is not None]
        values = parts[0] if len(parts) == 1 else mx.concatenate(parts)
        return from_rank_zero(values, self.group).tolist()


def split_target(model: nn.Module, config: dict, group: mx.distributed.Group, path: Path) -> SplitTarget:
    """`model`, loaded lazily, split over `group`. Its layers are read one at a time: a layer's whole weights
    are in memory only until its share is cut from them, so loading peaks near the share, not the model."""
    shard_model(model, group, Path(path) / "config.json")
    for layer in decoder_layers(model):
        mx.eval(layer.parameters())
    return SplitTarget(model, config, group=group)


class LockstepPolicy(WidthPolicy):
    """`--block-size auto` on a split target: each process weighs its own timings, and every process takes
    rank 0's choice."""

    def choose(self, context: int, found: int = 0, ngram: int = 0) -> Shape:
        shape = super().choose(context, found, ngram)
        width, tree, lookup = from_rank_zero(mx.array([shape.width, shape.tree, shape.lookup]), world()).tolist()
        return Shape(width, bool(tree), bool(lookup))

    def lookup_may_pay(self, context: int) -> bool:
        return bool(from_rank_zero(mx.array([super().lookup_may_pay(context)], mx.int32), world()).item())


def in_lockstep(policy: WidthPolicy) -> WidthPolicy:
    """`policy`, choosing as rank 0 chooses when the target is split (the same object: what it learns
    carries over to the next generation as it does in one process)."""
    if split_group() is not None and type(policy) is WidthPolicy:
        policy.__class__ = LockstepPolicy
    return policy
