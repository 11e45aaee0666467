"""Classic speculative decoding: a small autoregressive model drafts k tokens one by one.

Any mlx-lm causal LM that shares the target's tokenizer can draft. It keeps
its own KV cache (rollback-safe, like the target's) and the ids it holds; each
round it first catches up on what the target committed (dropping the drafts
that were rejected), then drafts.

`draft_k` is fixed, or adaptive with the rule transformers uses by default
(`num_assistant_tokens_schedule="heuristic"`): +2 after a round where every
draft was kept, -1 (not below 1) after a rejection. It grows when the draft
model agrees, which is when long drafts pay, and backs off quickly otherwise.

Drafting never reads the device: each drafted token feeds the next step as an
array, and the ids fed to the cache are learnt from what the target accepts
(an accepted draft is the drafted token), so the loop's one read per round
covers the draft too.
"""

from __future__ import annotations

import mlx.core as mx

from ..cache import make_rollback_cache, trim_cache
from ..decode_state import common_prefix
from ..errors import GlimmerError
from ..sampling import probabilities, sample
from .base import Drafter

UNREAD = -1  # a drafted token in the draft model's cache whose id is not known yet (never equals a token id)


class DraftModelDrafter(Drafter):
    kind = "draft-model"

    def __init__(self, model, *, draft_k: int = 4, adaptive: bool = False, max_k: int = 16):
        self.model = model
        self.draft_k = draft_k
        self.adaptive = adaptive
        self.max_k = max_k
        self.block_size = draft_k + 1
        self.k = draft_k
        self.history: list[int] = []
        self.cached: list[int] = []
        self.cache = None
        self._last_proposed = 0
        self._unread = 0  # the last entries of `cached`: drafted tokens whose ids were not read (UNREAD)

    def reset(self) -> None:
        self.history, self.cached = [], []
        self.cache = make_rollback_cache(self.model, reserve=self.max_k + 64)
        self.k = self.draft_k
        self._last_proposed = 0
        self._unread = 0

    def observe(self, tokens, features) -> None:
        if self._last_proposed and self.adaptive:
            kept = len(tokens) - 1
            if kept >= self._last_proposed:
                self.k = min(self.k + 2, self.max_k)
            else:
                self.k = max(1, self.k - 1)
            self._last_proposed = 0
        self.history.extend(tokens)
        self._learn_drafted()

    def _learn_drafted(self) -> None:
        """The target kept a prefix of the last drafts: those cache entries hold the history's tokens. The
        rest never match anything again (a rejected draft differs from what the target chose there)."""
        if not self._unread:
            return
        first = len(self.cached) - self._unread
        for i in range(first, len(self.cached)):
            self.cached[i] = self.history[i] if i < len(self.history) else UNREAD
        self._unread = 0

    def rollback(self, n: int) -> bool:
        if n:
            del self.history[-n:]
        self._unread = 0  # the drafts' entries, if any, stay UNREAD: rolled-back history says nothing of them
        self._last_proposed = 0
        return True

    def _catch_up(self, tokens: list[int]) -> mx.array:
        """Make the cache hold `tokens`; return logits after the last one."""
        keep = min(common_prefix(self.cached, tokens), len(tokens) - 1)
        drop = len(self.cached) - keep
        if drop and not all(c.can_trim(drop) if hasattr(c, "can_trim") else True for c in self.cache):
            self.cache = make_rollback_cache(self.model, reserve=self.max_k + 64)
            keep, drop = 0, 0
        trim_cache(self.cache, drop)
        self.cached = self.cached[:keep]
        todo = tokens[keep:]
        logits = self.model(mx.array([todo], dtype=mx.uint32), cache=self.cache)[0, -1]
        self.cached.extend(todo)
        return logits

    def propose(self, anchor, count, params, noise):
        count = min(count, self.k) if self.adaptive else min(count, self.draft_k)
        logits = self._catch_up(self.history + [anchor])
        tokens, rows = [], []
        keys = None if params.greedy else noise.rows(max(count, 1))
        for i in range(count):
            if params.greedy:
                t = mx.argmax(logits)
            else:
                probs = probabilities(logits, params)
                rows.append(probs)
                t = sample(probs, keys[i])
            tokens.append(t)
            if i + 1 < count:
                logits = self.model(t.reshape(1, 1).astype(mx.uint32), cache=self.cache)[0, -1]
                self.cached.append(UNREAD)
                self._unread += 1
        self._last_proposed = count
        draft = mx.stack(tokens) if tokens else mx.array([], dtype=mx.uint32)
        return draft, (mx.stack(rows) if rows else None)


def check_same_tokenizer(target_tok, draft_tok, where: str) -> None:
    """Vocabulary size and a sample of token strings must agree."""
    tv, dv = len(target_tok.vocab), len(draft_tok.vocab)
    if tv != dv:
        raise GlimmerError(f"{where}: tokenizer vocabulary {dv} differs from the target's {tv}")
    t_inv = {i: s for s, i in target_tok.vocab.items()}
    d_inv = {i: s for s, i in draft_tok.vocab.items()}
    for i in list(range(0, tv, max(1, tv // 200)))[:200]:
        if t_inv.get(i) != d_inv.get(i):
            raise GlimmerError(
                f"{where}: token {i} is {d_inv.get(i)!r} in the drafter but {t_inv.get(i)!r} in the target"
            )
