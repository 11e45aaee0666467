"""A prefix cache for a server: conversations' decode states, least recently used first out, bounded by bytes.

Every conversation the server answers leaves a `DecodeState` (the target's KV
cache and the token ids it holds) and, when it was speculative, a drafter
whose context covers the same tokens. A new request whose prompt starts with
(nearly) all of a cached conversation's tokens takes that conversation out of
the cache, prefills only what its prompt adds, and puts it back when it is
done; `DecodeState` rolls back the few tokens a chat template may re-render.

Each conversation owns its drafter: a shallow copy of the pair's drafter that
shares the weights and keeps its own context. With one drafter shared by all
conversations (omlx #2600, #1551) a reused state would meet a drafter that has
since followed someone else's conversation. A copy is started from scratch by
`DecodeState`'s first use, as any drafter is (`reset()`), so a reused
conversation drafts exactly what a cold start drafts.

A conversation is held by one request at a time. A request that extends a
cached conversation (keeping all but `max_rollback` of its tokens: a
follow-up turn, whose template may re-render a few tokens) takes it out of
the cache and puts it back extended. A request that shares only a part of it
(a system prompt, a templated question, the same prompt again) gets a copy
(`fork`), so the conversation stays for its own follow-up; copying a KV cache
costs far less than prefilling it.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import count
from typing import Sequence

import mlx.core as mx
import mlx.nn as nn

from ..decode_state import DecodeState, common_prefix
from ..lockstep import copied

_ids = count()


@dataclass
class Conversation:
    """One cached conversation: its decode state and its own drafter (None for plain decoding)."""

    state: DecodeState = field(default_factory=DecodeState)
    drafter: object | None = None
    nbytes: int = 0
    key: int = field(default_factory=lambda: next(_ids))

    @property
    def tokens(self) -> list[int]:
        return self.state.processed


@dataclass
class PromptCacheStats:
    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0  # prompt tokens found in cached conversations
    forks: int = 0  # hits served by a copy, leaving the cached conversation in place
    evictions: int = 0


def _arrays(obj, seen: set[int], depth: int = 0):
    """The MLX arrays reachable from `obj` through containers and plain objects (never into nn.Modules)."""
    if depth > 6 or id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool, nn.Module)):
        return
    seen.add(id(obj))
    if isinstance(obj, mx.array):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _arrays(x, seen, depth + 1)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _arrays(x, seen, depth + 1)
    elif hasattr(obj, "__dict__"):
        for x in vars(obj).values():
            yield from _arrays(x, seen, depth + 1)


def conversation_nbytes(conv: Conversation, prototype: object | None) -> int:
    """Bytes held by a conversation: its KV cache buffers and what its drafter holds beyond the shared prototype."""
    seen: set[int] = set()
    total = sum(a.nbytes for a in _arrays(conv.state.cache, seen))
    if conv.drafter is not None:
        shared = vars(prototype) if prototype is not None and hasattr(prototype, "__dict__") else {}
        own = [v for k, v in vars(conv.drafter).items() if shared.get(k) is not v]
        total += sum(a.nbytes for a in _arrays(own, seen))
    return total


class PromptCache:
    """Cached conversations, least recently used evicted first, at most `max_bytes` in all."""

    def __init__(self, drafter_prototype: object | None, max_bytes: int, max_rollback: int = 4, min_shared: int = 8):
        self.prototype = drafter_prototype
        self.max_bytes = max_bytes
        self.max_rollback = max_rollback
        self.min_shared = min_shared  # fewer tokens in common start cold rather than copy
        self._entries: OrderedDict[int, Conversation] = OrderedDict()
        self.stats = PromptCacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self._entries.values())

    def new(self) -> Conversation:
        """A cold conversation with its own drafter."""
        drafter = copy.copy(self.prototype) if self.prototype is not None else None
        return Conversation(DecodeState(), drafter)

    def fork(self, conv: Conversation) -> Conversation:
        """A deep copy of a conversation's caches and drafter context; models and weights stay shared.

        Only the state's `cache` and `processed` and the drafter's own fields are copied: whatever else
        the state refers to (its target, ...) and whatever the drafter shares with the prototype (its
        model, the target, lazily built tables) are kept by reference.
        """
        shared = vars(self.prototype) if self.prototype is not None and hasattr(self.prototype, "__dict__") else {}
        memo = {id(v): v for v in shared.values()}
        memo.update({id(v): v for k, v in vars(conv.state).items() if k not in ("cache", "processed", "drafter")})
        twin = copy.deepcopy(conv, memo)
        twin.key = next(_ids)
        copied(conv.state, twin.state)
        return twin

    def take(self, prompt: Sequence[int]) -> Conversation:
        """The conversation for `prompt`: the cached one it extends (taken out), a copy of the one it
        shares most with, or a new one."""
        best, best_common = None, 0
        for conv in reversed(self._entries.values()):  # most recent first: it wins ties
            n = common_prefix(conv.tokens, prompt)
            if n > best_common:
                best, best_common = conv, n
        if best is None or best_common < min(self.min_shared, len(prompt) - 1):
            self.stats.misses += 1
            return self.new()
        self.stats.hits += 1
        self.stats.reused_tokens += best_common
        if len(best.tokens) - best_common <= self.max_rollback:
            del self._entries[best.key]
            return best
        self.stats.forks += 1
        return self.fork(best)

    def put(self, conv: Conversation) -> None:
        """Keep a conversation (as the most recent) and evict the least recent ones beyond `max_bytes`."""
        conv.nbytes = conversation_nbytes(conv, self.prototype)
        if not conv.tokens or conv.nbytes > self.max_bytes:
            self.stats.evictions += 1
            return
        self._entries[conv.key] = conv
        self._entries.move_to_end(conv.key)
        total = self.nbytes
        while total > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            total -= old.nbytes
            self.stats.evictions += 1

    def clear(self) -> None:
        self._entries.clear()
