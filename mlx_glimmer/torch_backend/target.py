"""The target as the torch loop sees it: a transformers causal LM with feature capture, split head, croppable cache.

Same contract as `mlx_glimmer.target.Target`: `forward` runs the decoder stack
(the text model inside `MuseGlimmerForConditionalGeneration`, or the `.model` of
any `AutoModelForCausalLM`) and returns the final hidden states and the outputs
of the captured decoder layers; `head` is the output projection exactly as the
model's own forward applies it (Muse: `tanh(lm_head(h) * multiplier / cap) * cap`).

The KV cache is transformers' `DynamicCache` with past recording on, and the
loop calls `trim` after every forward. A sliding-window layer
(`DynamicSlidingWindowLayer`) then keeps `window - 1` entries plus the last
forward's, so `crop(-n)` restores the window before the rejected tokens at any
length, past the window too; without `activate_past_recording` it refuses to
crop once the window is full. `trim(cache, 0)` is not a no-op: it is what
shrinks a sliding layer back to `window - 1` entries.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F


def cache_keyword(forward) -> str:
    """transformers >= 5.2x calls the cache argument `cache`, earlier 5.x `past_key_values`."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


class TorchTarget:
    def __init__(self, model, device: torch.device):
        self.model = model.eval().requires_grad_(False)
        self.device = device
        inner = model.model
        self.decoder = getattr(inner, "language_model", inner)
        self.config = self.decoder.config
        self.lm_head = model.get_output_embeddings()
        self.embed_tokens = self.decoder.get_input_embeddings()
        self.multiplier = getattr(self.config, "output_multiplier", None)
        self.softcap = getattr(self.config, "final_logit_softcapping", None)
        self.cache_kw = cache_keyword(self.decoder.forward)
        self.layer_ids: tuple[int, ...] = ()
        self._hooks = []
        self._recording: dict[int, torch.Tensor] | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def num_layers(self) -> int:
        return len(self.decoder.layers)

    @property
    def vocab_size(self) -> int:
        return int(self.lm_head.weight.shape[0])

    def capture(self, layer_ids) -> None:
        for h in self._hooks:
            h.remove()
        self.layer_ids = tuple(layer_ids)

        def hook(layer_id):
            def record(module, args, output):
                if self._recording is not None:
                    self._recording[layer_id] = output[0] if isinstance(output, tuple) else output

            return record

        self._hooks = [self.decoder.layers[i].register_forward_hook(hook(i)) for i in self.layer_ids]

    def make_cache(self):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.config)
        cache.activate_past_recording()
        return cache

    def trim(self, cache, n: int) -> None:
        cache.crop(-n)

    def forward(self, tokens, cache, capture: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`tokens` [L] -> final hidden states [L, H] and captured features [L, k*H] (or None)."""
        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.device)[None]
        self._recording = {} if capture and self.layer_ids else None
        try:
            out = self.decoder(input_ids=ids, use_cache=True, **{self.cache_kw: cache})
            feats = None
            if self._recording is not None:
                feats = torch.cat([self._recording[i][0] for i in self.layer_ids], dim=-1)
        finally:
            self._recording = None
        return out.last_hidden_state[0], feats

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        if self.multiplier is not None:
            logits = logits * self.multiplier
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.finish_logits(self.lm_head(hidden))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Raw embedding rows (Muse's embedding RMS-norm is not applied: DFlash noise uses raw rows)."""
        return F.embedding(ids, self.embed_tokens.weight)

    def logits(self, tokens) -> torch.Tensor:
        """Logits [L, V] of one full forward over `tokens`, from an empty cache (for reports and tests)."""
        with torch.inference_mode():
            hidden, _ = self.forward(tokens, self.make_cache(), capture=False)
            return self.head(hidden).float()
