"""The target model as the speculative loop sees it.

The target is an ordinary mlx-lm model. We need three things from it that its
`__call__` does not give: the outputs of a few decoder layers (the drafter's
context features), the final hidden states without the output head (so a long
prefill computes logits for its last position only), and the output head as a
function (the drafter borrows it). None of this copies mlx-lm's model code:
capture swaps the class of the chosen layer objects for a subclass that records
what the original `__call__` returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import sampling as mlx_sampling
from .cache import TreeCacheView, keep_positions, make_rollback_cache, trim_cache
from .few_rows import row_product, use_few_row_products
from .memory import DeviceMemory
from .tree import DraftTree, mlx_trees


class FeatureRecorder:
    """Collects the outputs of the captured layers during one target forward."""

    def __init__(self, layer_ids: tuple[int, ...]):
        self.layer_ids = tuple(layer_ids)
        self.active = bool(layer_ids)
        self.outputs: dict[int, mx.array] = {}

    def features(self) -> mx.array | None:
        """The captured layer outputs concatenated on the last axis, in `layer_ids` order."""
        if not self.active:
            return None
        missing = [i for i in self.layer_ids if i not in self.outputs]
        if missing:
            raise RuntimeError(f"target layers {missing} were not run")
        out = mx.concatenate([self.outputs[i] for i in self.layer_ids], axis=-1)
        self.outputs = {}
        return out


_capturing_classes: dict[type, type] = {}


def _capturing_class(cls: type) -> type:
    if cls not in _capturing_classes:

        def __call__(self, *args, **kwargs):
            out = cls.__call__(self, *args, **kwargs)
            recorder = self._glimmer_recorder
            if recorder.active:
                recorder.outputs[self._glimmer_layer_id] = out[0] if isinstance(out, tuple) else out
            return out

        _capturing_classes[cls] = type(f"Capturing{cls.__name__}", (cls,), {"__call__": __call__})
    return _capturing_classes[cls]


def decoder_layers(model: nn.Module) -> list:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None) if inner is not None else None
    if layers is None:
        layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")
    return list(layers)


def capture_layers(model: nn.Module, layer_ids: tuple[int, ...]) -> FeatureRecorder:
    recorder = FeatureRecorder(layer_ids)
    layers = decoder_layers(model)
    for i in layer_ids:
        layer = layers[i]
        base = type(layer)
        if base in _capturing_classes.values():
            base = base.__mro__[1]
        layer.__class__ = _capturing_class(base)
        object.__setattr__(layer, "_glimmer_recorder", recorder)
        object.__setattr__(layer, "_glimmer_layer_id", i)
    return recorder


_positional_classes: dict[type, type] = {}


def _positional_class(cls: type) -> type:
    """`cls` (a RoPE module) that also takes one position per token: mx.fast.rope takes a scalar offset or
    one per batch row, so a tree's positions [L] rotate [1, H, L, D] with its tokens moved into the batch
    axis and back."""
    if cls not in _positional_classes:

        def __call__(self, x, offset=0):
            if isinstance(offset, mx.array) and offset.ndim == 1 and x.shape[0] == 1 and offset.size == x.shape[-2] > 1:
                return cls.__call__(self, x.swapaxes(0, -2), offset=offset).swapaxes(0, -2)
            return cls.__call__(self, x, offset=offset)

        _positional_classes[cls] = type(f"Positional{cls.__name__}", (cls,), {"__call__": __call__})
    return _positional_classes[cls]


def accept_token_positions(model: nn.Module) -> str | None:
    """Let every attention's RoPE take per-token positions (a tree verify's anchor + depth). mlx-lm's
    attentions rotate with `self.rope(x, offset=cache.offset)`; during a tree verify that offset is a
    vector (`cache.TreeCacheView`). Returns why a tree verify cannot place its tokens (None: it can): the
    decoder layers whose attention has no RoPE module at `self_attn.rope` and does not say it rotates
    nothing (`use_rope` False, as Muse Glimmer's full-attention layers). Such a layer rotates some other
    way, with one offset for all its tokens at best."""
    missing = []
    for i, layer in enumerate(decoder_layers(model)):
        attention = getattr(layer, "self_attn", None)
        rope = getattr(attention, "rope", None)
        if isinstance(rope, nn.Module):
            if type(rope) not in _positional_classes.values():
                rope.__class__ = _positional_class(type(rope))
        elif attention is None or getattr(attention, "use_rope", True):
            missing.append(i)
    if not missing:
        return None
    more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
    return (
        f"the attention of {type(model).__name__} layer {missing[0]}{more} has no RoPE module at "
        "self_attn.rope, through which a tree verify gives each token its own position"
    )


def output_head(project: Callable, multiplier: float | None, cap: float | None, tanh: Callable) -> Callable:
    """The output head on any array library: `project`, times `output_multiplier`, then the tanh soft-cap
    (Muse: `tanh(lm_head(h) * multiplier / cap) * cap`); either factor may be absent."""

    def head(h):
        out = project(h)
        if multiplier is not None:
            out = out * multiplier
        if cap:
            out = tanh(out / cap) * cap
        return out

    return head


def output_projection(model: nn.Module) -> Callable[[mx.array], mx.array]:
    """The model's output projection alone (no multiplier, no soft-cap): its lm_head, or the tied embedding."""
    lm_head = model.get("lm_head") if isinstance(model, dict) else None
    return lm_head if lm_head is not None else model.model.embed_tokens.as_linear


def make_head(model: nn.Module, project: Callable | None = None) -> Callable[[mx.array], mx.array]:
    """hidden states after the final norm -> logits, exactly as `model.__call__` does it."""
    if project is None:
        project = output_projection(model)
    args = getattr(model, "args", None)
    return output_head(
        project, getattr(args, "output_multiplier", None), getattr(args, "final_logit_softcapping", None), mx.tanh
    )


def head_layer(model: nn.Module) -> nn.Module:
    """The module holding the output projection's weights: lm_head, or the tied embedding."""
    return model.get("lm_head") or model.model.embed_tokens


def head_weight(target: "Target") -> mx.array:
    """The target's output projection as a float matrix [V, H] (dequantized if needed)."""
    layer = head_layer(target.model)
    if isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        return mx.dequantize(layer.weight, layer.scales, layer.biases, layer.group_size, layer.bits, **_mode(layer))
    return layer.weight


def _mode(layer) -> dict:
    mode = getattr(layer, "mode", None)
    return {"mode": mode} if mode is not None else {}


def row_projection(layer: nn.Module, ids: mx.array) -> Callable[[mx.array], mx.array]:
    """h -> h @ W[ids].T for the output projection `layer`, from its own rows only: a quantized head's packed
    rows, scales and biases are gathered and multiplied with `mx.quantized_matmul`, so the full head is
    never dequantized (202,048 x 6,656 at 30B: a 2.7 GB transient)."""
    if isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        w, scales = layer.weight[ids], layer.scales[ids]
        biases = layer.biases[ids] if getattr(layer, "biases", None) is not None else None
        group_size, bits, mode = layer.group_size, layer.bits, _mode(layer)
        return lambda h: mx.quantized_matmul(
            h, w, scales, biases, transpose=True, group_size=group_size, bits=bits, **mode
        )
    rows = layer.weight[ids]
    return lambda h: row_product(h, rows)


@dataclass
class Target:
    """An mlx-lm model with feature capture, a split head and rollback-safe caches:
    the MLX side of `target_model.TargetModel`."""

    model: nn.Module
    config: dict
    recorder: FeatureRecorder = field(init=False)
    head: Callable[[mx.array], mx.array] = field(init=False)
    memory: DeviceMemory = field(default_factory=DeviceMemory)  # wired/cache limits, clear_cache (Metal only)
    tree_unsupported: str | None = field(init=False, default=None)  # why it verifies chains only (`TargetModel`)
    sampling = mlx_sampling
    trees = mlx_trees
    lazy = True  # work is queued and runs on `launch` / `read`: the loop queues its next round before yielding

    def __post_init__(self):
        self.recorder = FeatureRecorder(())
        self.head = make_head(self.model)
        self.tree_unsupported = accept_token_positions(self.model)
        use_few_row_products(self.model)

    @property
    def args(self):
        return self.model.args

    @property
    def num_layers(self) -> int:
        return len(decoder_layers(self.model))

    @property
    def hidden_size(self) -> int:
        return int(self.model.args.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.model.args.vocab_size)

    @property
    def model_type(self) -> str:
        return str(getattr(self.model.args, "model_type", self.config.get("model_type", "")))

    def capture(self, layer_ids: tuple[int, ...]) -> None:
        self.recorder = capture_layers(self.model, tuple(layer_ids))

    def embed(self, ids: mx.array) -> mx.array:
        """Raw rows of the token embedding table (no model-specific scaling or norm)."""
        return self.model.model.embed_tokens(ids)

    @property
    def activation_dtype(self):
        """The dtype the target computes its hidden states in (that of its embedding rows)."""
        return self.embed(mx.array([0])).dtype

    def head_rows(self, ids: mx.array) -> Callable[[mx.array], mx.array]:
        """The output head over the vocabulary rows `ids` only (a distilled drafter's draft vocabulary)."""
        return make_head(self.model, row_projection(head_layer(self.model), ids))

    def make_cache(self, reserve: int) -> list:
        return make_rollback_cache(self.model, reserve)

    def can_trim(self, cache: list, n: int) -> bool:
        return all(c.can_trim(n) if hasattr(c, "can_trim") else c.is_trimmable() for c in cache)

    def trim(self, cache: list, n: int) -> None:
        trim_cache(cache, n)

    def keep(self, cache: list, positions: list[int], width: int) -> None:
        """After a verify of `width` positions, keep `positions` of them (ascending) in order; drop the rest."""
        keep_positions(cache, positions, width)

    def tokens(self, ids) -> mx.array:
        return ids.astype(mx.uint32) if isinstance(ids, mx.array) else mx.array(ids, dtype=mx.uint32)

    def join(self, *ids: mx.array) -> mx.array:
        """Token arrays end to end, on the device ([anchor, drafts] for a verify)."""
        return mx.concatenate([self.tokens(i) for i in ids])

    def launch(self, *arrays) -> None:
        arrays = [a for a in arrays if a is not None]
        if arrays:
            mx.async_eval(arrays)

    def sync(self, *arrays, cache: list | None = None) -> None:
        mx.eval([c.state for c in cache or []], [a for a in arrays if a is not None])

    def read(self, *arrays) -> list[int]:
        """The one blocking host read of a round: the integer entries of `arrays`, end to end."""
        parts = [a.reshape(-1).astype(mx.int32) for a in arrays if a is not None]
        return (parts[0] if len(parts) == 1 else mx.concatenate(parts)).tolist()

    def reset_peak_memory(self) -> None:
        mx.reset_peak_memory()

    def peak_memory_gb(self) -> float:
        return mx.get_peak_memory() / 1e9

    def last_logits(self, tokens: list[int]) -> np.ndarray:
        """float32 logits [V] after one full forward over `tokens` from an empty cache (for reports)."""
        hidden, _ = self.forward(self.tokens(tokens), self.make_cache(reserve=16), capture=False)
        return np.array(self.head(hidden[-1:]).astype(mx.float32))[0]

    def forward_batch(self, tokens: mx.array) -> tuple[mx.array, mx.array]:
        """Whole sequences [B, W] (right-padded) through the decoder without a cache, causal: final hidden states
        [B, W, H] and the captured layers' outputs [B, W, k*H] (what `distill` trains on)."""
        self.recorder.active = bool(self.recorder.layer_ids)
        hidden = self.model.model(tokens)
        return hidden, self.recorder.features()

    def forward(
        self, tokens: mx.array, cache: list, capture: bool, tree: DraftTree | None = None
    ) -> tuple[mx.array, mx.array | None]:
        """Run `tokens` (shape [L]) through the decoder; return final hidden states [L, H] and features. With
        `tree`, `tokens` are [anchor, nodes] and each attends to the cache and its ancestors only, at the
        anchor's position plus its depth."""
        self.recorder.active = capture and bool(self.recorder.layer_ids)
        if tree is not None:
            cache = [TreeCacheView(c, tree) for c in cache]
        hidden = self.model.model(tokens[None], cache=cache)[0]
        features = self.recorder.features()
        return hidden, (features[0] if features is not None else None)
