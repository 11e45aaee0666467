"""The target on torch: a transformers causal LM with feature capture, split head, croppable cache.

The torch side of `mlx_glimmer.target_model.TargetModel`: `forward` runs the
decoder stack (the text model inside `MuseGlimmerForConditionalGeneration`, or
the `.model` of any `AutoModelForCausalLM`) and returns the final hidden states
and the outputs of the captured decoder layers; `head` is the output
projection exactly as the model's own forward applies it.

The KV cache is transformers' `DynamicCache` with past recording on: a
sliding-window layer (`DynamicSlidingWindowLayer`) keeps every entry written
since its last `crop`, and `crop(-n)` drops the newest n and shrinks the layer
back to `window - 1` entries, so it restores the window before rejected tokens
at any length, past the window too. `forward` crops by 0 first (the shrink
alone), so what one forward wrote stays undoable until the next one.

Draft trees (`tree.Trees` on torch's `array_ops`): `forward(..., tree=...)` passes
each token's position (cache length + depth) as `position_ids` and the tree's
mask as a custom 4D additive mask, which transformers models take as their
`attention_mask` as is; a model with sliding layers (Muse Glimmer, Gemma-style
hybrids) takes a dict {layer type: mask} instead, one mask per kind of layer,
so sliding layers see only their window. `keep` then moves the accepted
path's rows into place in every layer and crops the rest, as `trim` does.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch
import torch.nn.functional as F

from ..memory import NO_MEMORY
from ..target import output_head
from ..tree import DraftTree, Trees
from . import sampling as torch_sampling
from .array_ops import torch_ops
from .device import peak_memory_gb, reset_peak_memory, synchronize


def cache_keyword(forward) -> str:
    """transformers >= 5.2x calls the cache argument `cache`, earlier 5.x `past_key_values`."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def tree_refusal(decoder) -> str | None:
    """Why a tree verify cannot place and mask its tokens on this transformers decoder (None: it can): it
    passes each token's position as `position_ids` and the tree as a custom mask, which eager and sdpa
    attention take, one per kind of layer (full and sliding)."""
    if "position_ids" not in inspect.signature(decoder.forward).parameters:
        return f"{type(decoder).__name__} takes no position_ids, through which a tree verify places each token"
    implementation = getattr(decoder.config, "_attn_implementation", None) or "eager"
    if implementation not in ("eager", "sdpa"):
        return f"draft trees need eager or sdpa attention on torch, not {implementation}"
    kinds = set(getattr(decoder.config, "layer_types", None) or ()) - {"full_attention", "sliding_attention"}
    if kinds:
        return f"draft trees on torch support full and sliding attention layers, not {', '.join(sorted(kinds))}"
    return None


def layer_masks(target, visible):
    """The decoder's attention mask from `visible(window)` (which keys each query sees, bool [rows, queries,
    keys], window None for full attention): one 4D additive mask, or, where some layers slide, one per layer
    type, so sliding layers see only their window."""
    dtype = target.activation_dtype

    def additive(seen: torch.Tensor) -> torch.Tensor:
        return torch.where(seen, torch.zeros((), dtype=dtype, device=seen.device), torch.finfo(dtype).min)[:, None]

    kinds = set(getattr(target.config, "layer_types", None) or ())
    if "sliding_attention" not in kinds:
        return additive(visible(None))
    masks = {"sliding_attention": additive(visible(int(target.config.sliding_window)))}
    if "full_attention" in kinds:
        masks["full_attention"] = additive(visible(None))
    return masks


class FeaturesRecorded(Exception):
    """Raised by the deepest captured layer's hook when a `features` pass needs nothing after it."""


class TorchTarget:
    sampling = torch_sampling
    memory = NO_MEMORY  # wired limits and clear_cache are MLX-on-Metal settings
    lazy = False  # every call computes at once (CUDA queues kernels by itself): drafts are proposed when needed

    def __init__(self, model, device: torch.device):
        self.model = model.eval().requires_grad_(False)
        self.device = device
        self.trees = Trees(torch_ops(device), torch_sampling.probabilities)
        inner = model.model
        self.decoder = getattr(inner, "language_model", inner)
        self.config = self.decoder.config
        self.lm_head = model.get_output_embeddings()
        self.embed_tokens = self.decoder.get_input_embeddings()
        self.multiplier = getattr(self.config, "output_multiplier", None)
        self.softcap = getattr(self.config, "final_logit_softcapping", None)
        self.head = output_head(self.lm_head, self.multiplier, self.softcap, torch.tanh)
        self.cache_kw = cache_keyword(self.decoder.forward)
        self.tree_unsupported = tree_refusal(self.decoder)  # why it verifies chains only (`TargetModel`)
        self.layer_ids: tuple[int, ...] = ()
        self._hooks = []
        self._recording: dict[int, torch.Tensor] | None = None
        self._stop_after: int | None = None  # the layer whose hook ends a `features` pass without final states

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def num_layers(self) -> int:
        return len(self.decoder.layers)

    @property
    def vocab_size(self) -> int:
        return int(self.lm_head.weight.shape[0])

    @property
    def activation_dtype(self) -> torch.dtype:
        """The dtype the target computes its hidden states in (that of its embedding rows)."""
        return self.embed_tokens.weight.dtype

    def capture(self, layer_ids) -> None:
        for h in self._hooks:
            h.remove()
        self.layer_ids = tuple(layer_ids)

        def hook(layer_id):
            def record(module, args, output):
                if self._recording is not None:
                    self._recording[layer_id] = output[0] if isinstance(output, tuple) else output
                    if layer_id == self._stop_after:
                        raise FeaturesRecorded

            return record

        self._hooks = [self.decoder.layers[i].register_forward_hook(hook(i)) for i in self.layer_ids]

    def make_cache(self, reserve: int = 0):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.config)
        cache.activate_past_recording()
        return cache

    def can_trim(self, cache, n: int) -> bool:
        """Like `WindowedKVCache.can_trim`: a sliding layer that dropped entries must keep `window - 1`."""
        for layer in cache.layers:
            stored = layer.keys.shape[-2] if layer.is_initialized else 0
            evicted = getattr(layer, "is_sliding", False) and layer.cumulative_length > stored
            if n > stored or (evicted and stored - n < layer.sliding_window - 1):
                return False
        return True

    def trim(self, cache, n: int) -> None:
        if n > 0:
            cache.crop(-n)

    @torch.inference_mode()
    def keep(self, cache, positions: list[int], width: int) -> None:
        """After a verify of `width` positions, keep `positions` of them (ascending) in order; drop the rest."""
        kept = len(positions)
        if positions != list(range(kept)):
            for layer in cache.layers:
                if not getattr(layer, "is_initialized", False):
                    continue
                base = layer.keys.shape[-2] - width
                rows = torch.as_tensor(positions, device=layer.keys.device) + base
                layer.keys[..., base : base + kept, :] = layer.keys[..., rows, :]
                layer.values[..., base : base + kept, :] = layer.values[..., rows, :]
        self.trim(cache, width - kept)

    def tree_mask(self, tree: DraftTree, past: int) -> torch.Tensor | dict[str, torch.Tensor]:
        """The tree verify's attention mask after `past` cached positions, as the decoder takes it: a 4D
        additive mask [1, 1, N + 1, keys], or, where some layers slide, one per layer type. A sliding layer's
        cache holds at most `window - 1` positions when a forward starts (`forward` crops by 0 first)."""
        if self.tree_unsupported is not None:
            raise ValueError(self.tree_unsupported)
        return layer_masks(
            self,
            lambda window: self.trees.attention_mask(tree, past if window is None else min(past, window - 1), window)[
                None
            ],
        )

    def tokens(self, ids) -> torch.Tensor:
        return torch.as_tensor(ids, dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def forward(
        self, tokens, cache, capture: bool, tree: DraftTree | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`tokens` [L] -> final hidden states [L, H] and captured features [L, k*H] (or None). With `tree`,
        `tokens` are [anchor, nodes] and each attends to the cache and its ancestors only, at the anchor's
        position plus its depth."""
        past = cache.get_seq_length()
        if past:
            cache.crop(0)
        extra = {}
        if tree is not None:
            extra["position_ids"] = (past + tree.depths.to(self.device))[None]
            extra["attention_mask"] = self.tree_mask(tree, past)
        self._recording = {} if capture and self.layer_ids else None
        try:
            ids = self.tokens(tokens)[None]
            out = self.decoder(input_ids=ids, use_cache=True, **{self.cache_kw: cache}, **extra)
            feats = None
            if self._recording is not None:
                feats = torch.cat([self._recording[i][0] for i in self.layer_ids], dim=-1)
        finally:
            self._recording = None
        return out.last_hidden_state[0], feats

    @torch.inference_mode()
    def features(
        self, sequences: list[list[int]], final_hidden: bool = True
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """The captured layers' outputs and the final hidden states of several whole sequences in one batched
        forward: one ([L_i, k*H], [L_i, H]) pair each. Without `final_hidden` the forward stops at the deepest
        captured layer and the second of each pair is None.

        Rows are right-padded: under causal attention a real position never sees the padding after it."""
        width = max(len(s) for s in sequences)
        ids = torch.tensor([list(s) + [0] * (width - len(s)) for s in sequences], device=self.device)
        self._recording, self._stop_after = {}, None if final_hidden else max(self.layer_ids)
        hidden = None
        try:
            try:
                hidden = self.decoder(input_ids=ids, use_cache=False).last_hidden_state
            except FeaturesRecorded:
                pass
            feats = torch.cat([self._recording[i] for i in self.layer_ids], dim=-1)
        finally:
            self._recording, self._stop_after = None, None
        return [(feats[r, : len(s)], None if hidden is None else hidden[r, : len(s)]) for r, s in enumerate(sequences)]

    def head_rows(self, ids: torch.Tensor):
        """The output head over the vocabulary rows `ids` only (a distilled drafter's draft vocabulary)."""
        rows = self.lm_head.weight[ids]
        return output_head(lambda h: h @ rows.T, self.multiplier, self.softcap, torch.tanh)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Raw embedding rows (Muse's embedding RMS-norm is not applied: DFlash noise uses raw rows)."""
        return F.embedding(ids, self.embed_tokens.weight)

    def join(self, *ids) -> torch.Tensor:
        """Token tensors end to end, on the device ([anchor, drafts] for a verify)."""
        return torch.cat([self.tokens(i).reshape(-1) for i in ids])

    def launch(self, *arrays) -> None:
        pass  # torch queues device work by itself

    def sync(self, *arrays, cache=None) -> None:
        synchronize(self.device)

    def read(self, *arrays) -> list[int]:
        """The one blocking host read of a round: the integer entries of `arrays`, end to end."""
        parts = [a.reshape(-1).long() for a in arrays if a is not None]
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist()

    def reset_peak_memory(self) -> None:
        synchronize(self.device)
        reset_peak_memory(self.device)

    def peak_memory_gb(self) -> float:
        return peak_memory_gb(self.device)

    def last_logits(self, tokens: list[int]) -> np.ndarray:
        """float32 logits [V] after one full forward over `tokens` from an empty cache (for reports)."""
        with torch.inference_mode():
            hidden, _ = self.forward(tokens, self.make_cache(), capture=False)
            return self.head(hidden[-1:]).float()[0].cpu().numpy()
