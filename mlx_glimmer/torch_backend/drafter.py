"""transformers' `MuseGlimmerAssistantModel` as a `Drafter` (see `mlx_glimmer.drafters.base`).

Each `propose` runs the assistant once on [new context features ; block], with
transformers' `DFlashCache` protocol (the one its DFlash candidate generator
uses): tell the cache how many context positions come in, crop the previous
block's K/V, pass absolute position ids. The block may be shorter than
`block_size` (the loop asks for fewer at the end). Drafting from the block's
logits (`draft_logits`, `propose`) is `DFlashDrafter`'s, on torch arrays;
`marginals` (a draft tree's material) is its torch twin.
"""

from __future__ import annotations

import torch

from ..drafters.base import Marginals
from ..drafters.config import DrafterConfig
from ..drafters.dflash import DFlashDrafter
from .target import TorchTarget, cache_keyword


class TorchDFlashDrafter(DFlashDrafter):
    kind = "dflash"

    def __init__(self, model, config: DrafterConfig, target: TorchTarget, draft_vocab: torch.Tensor | None = None):
        self._bind(model.eval().requires_grad_(False), config, target, draft_vocab)
        self.cache_kw = cache_keyword(model.forward)
        self.reset()

    def reset(self) -> None:
        from transformers.cache_utils import DFlashCache

        self.cache = DFlashCache(config=self.model.config)
        self.cache.activate_past_recording()
        self._pending: list[torch.Tensor] = []
        self._pending_len = 0
        self._context = 0  # context positions inside the cache
        self._block = 0  # block positions the last forward left in the cache

    @property
    def position(self) -> int:
        return self._context + self._pending_len

    def settle(self) -> list:
        """Nothing to do ahead: the assistant reads the pending context together with the next block."""
        return []

    def observe(self, tokens, features: torch.Tensor) -> None:
        self._pending.append(features)
        self._pending_len += features.shape[0]

    def rollback(self, n: int) -> bool:
        """Only not-yet-projected positions can be forgotten."""
        if n > self._pending_len:
            return False
        if n:
            feats = torch.cat(self._pending)[: self._pending_len - n]
            self._pending = [feats] if feats.shape[0] else []
            self._pending_len -= n
        return True

    @torch.inference_mode()
    def block_hidden(self, anchor: int, count: int) -> torch.Tensor:
        """Drafter output for the block [anchor, mask x count]: [count + 1, H]."""
        feats = torch.cat(self._pending) if self._pending else None
        n_new = 0 if feats is None else feats.shape[0]
        self.cache.set_previous_accepted_tokens(n_new)
        if self._block:
            self.cache.crop(-self._block)
        device = self.target.device
        ids = torch.tensor([anchor] + [self.mask_token_id] * count, device=device)
        noise = self.target.embed(ids)[None]
        if feats is None:
            feats = noise.new_zeros((0, len(self.target_layer_ids) * noise.shape[-1]))
        positions = torch.arange(self._context, self._context + n_new + count + 1, device=device)[None]
        out = self.model(
            noise_embeds=noise, context_hidden_states=feats[None], position_ids=positions, **{self.cache_kw: self.cache}
        )
        self._context += n_new
        self._pending, self._pending_len = [], 0
        self._block = count + 1
        return out.last_hidden_state[0]

    def marginals(self, anchor: int, count: int) -> Marginals:
        """Log-probabilities [count, V'] of the draft positions after `anchor`, from one forward."""
        logits = self.draft_logits(self.block_hidden(anchor, count)[1:]).float()
        return Marginals(torch.log_softmax(logits, dim=-1), self.draft_vocab)
