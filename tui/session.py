"""A chat session without the UI: settings, turns, and running one turn.

The app keeps a `Conversation` on the UI thread and runs `run_turn` on its
MLX thread; the `DecodeState` passed to every turn keeps the KV cache and the
drafter context, so a turn prefills only the tokens it adds.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from mlx_glimmer.channels import split_channels
from mlx_glimmer.chat_template import REASONING_VARIABLE
from mlx_glimmer.decode_state import DecodeState
from mlx_glimmer.generate import GenerationChunk, GenerationStats, collect
from mlx_glimmer.lockstep import stream_generate

from .chat_settings import DEFAULT_CHAT, Settings  # noqa: F401  (re-exported: the chat's settings live apart from MLX)


@dataclass
class Turn:
    user: str
    text: str = ""  # the raw decoded answer, channel framing included
    token_ids: list[int] = field(default_factory=list)
    stats: GenerationStats | None = None
    cancelled: bool = False

    @property
    def answer(self) -> str:
        return split_channels(self.text).answer

    @property
    def reasoning(self) -> list[str]:
        return split_channels(self.text).reasoning


@dataclass
class Conversation:
    settings: Settings = field(default_factory=Settings)
    turns: list[Turn] = field(default_factory=list)
    reasoning_supported: bool = False

    def messages(self, user: str) -> list[dict]:
        """The chat so far plus a new user message, as the chat template takes it."""
        out = [{"role": "system", "content": self.settings.system}] if self.settings.system else []
        for t in self.turns:
            # The answer goes back exactly as generated, so the next turn's prompt
            # extends the cached tokens instead of rewriting them.
            out += [{"role": "user", "content": t.user}, {"role": "assistant", "content": t.text}]
        return out + [{"role": "user", "content": user}]

    def generation_kwargs(self) -> dict:
        """`stream_generate`'s arguments for the next turn: its settings and the chat template's keywords."""
        kwargs: dict = {"settings": self.settings.for_turn()}
        if self.reasoning_supported:
            kwargs["chat_template_kwargs"] = {REASONING_VARIABLE: self.settings.reasoning}
        return kwargs


def snapshot(stats: GenerationStats) -> GenerationStats:
    """A copy the UI thread can read while the generator keeps updating the original."""
    return dataclasses.replace(stats, acceptance_lengths=list(stats.acceptance_lengths))


def run_turn(
    pair,
    messages: list[dict],
    *,
    state: DecodeState,
    cancel: threading.Event | None = None,
    on_progress: Callable[[str, GenerationStats], None] | None = None,
    progress_interval: float = 1 / 30,
    **kwargs,
) -> Turn:
    """Generate one answer; stops after the current round once `cancel` is set.

    Stopping at a round boundary leaves `state` holding exactly what the target
    processed, so the next turn reuses it.
    """
    shown: list[str] = []  # the text so far, for `on_progress`
    last = 0.0

    def on_chunk(chunk: GenerationChunk) -> bool:
        nonlocal last
        shown.append(chunk.text)
        if on_progress is not None and time.monotonic() - last >= progress_interval:
            on_progress("".join(shown), snapshot(chunk.stats))
            last = time.monotonic()
        return cancel is not None and cancel.is_set()

    result = collect(stream_generate(pair, messages, state=state, **kwargs), on_chunk)
    stats = snapshot(result.stats)
    cancelled = stats.finish_reason is None
    if cancelled:
        stats.finish_reason = "cancelled"
    return Turn(messages[-1]["content"], result.text, result.token_ids, stats, cancelled)


def rebuild_state(pair, processed: list[int], state: DecodeState, settings: Settings = DEFAULT_CHAT) -> int:
    """Refill `state` with the cache a live session had after `processed` (a resumed chat's stored ids).

    Prefills exactly those ids, with the drafter (when speculative) observing them as it
    would have live, and stops before decoding: the next turn then reuses the cache as in
    the session that wrote them. Returns how many tokens the cache holds.
    """
    if not processed:
        return 0
    chunks = stream_generate(pair, list(processed), settings.generation.updated(max_tokens=1), state=state)
    try:
        next(chunks)  # the prefill step; closing here leaves state.processed == processed
    finally:
        chunks.close()
    return len(state.processed)
