"""Serving and chatting on a target split across processes: rank 0 announces every call that runs the target.

Under `mlx.launch`, `generate` makes the same call on every process. `serve` and `chat` cannot: only rank 0
hears clients and the keyboard. So rank 0 announces each call before it makes it (loading, measuring the
verify cost, a generation, a prompt's log-probabilities, and at the end a stop), and the other processes
(`follower.follow`) make the same call on their share of the target; inside it the split loop keeps them in
step as under `generate` (`distributed.py`). The functions here take the place of `generate`'s: in one
process they are those, unchanged.

An announcement is a small JSON object broadcast from rank 0 (`broadcast`: its length, then its bytes, each
one sum in which the others add zeros). A generation's carries its prompt, its settings and the decode state
it continues: rank 0 numbers each `DecodeState` it generates on; a follower keeps one of its own under each
number, with its own drafter, and starts it fresh, continues it, or copies another, as rank 0 did (a server's
prompt cache copies a conversation: `copied`). States rank 0 has let go are dropped at the next announcement.

Rank 0 may end a generation early (a stop string, a client gone, a cancelled turn), and a follower must not
start a round rank 0 will not run: after every chunk rank 0 says whether it goes on (one more small sum per
round) and the followers close their generation at the same chunk. Generations announced this way run one at
a time: a second one started while another is open is a bug, refused.
"""

from __future__ import annotations

import itertools
import json
import threading
import weakref
from typing import Any, Callable, Iterator

import mlx.core as mx
import numpy as np

from .decode_state import DecodeState
from .errors import GlimmerError
from .generate import GenerationChunk
from .generate import calibrate as calibrate_here
from .generate import stream_generate as generate_here
from .logprobs import TokenLogprob
from .logprobs import prompt_logprobs as target_prompt_logprobs
from .ranks import from_rank_zero, split_group
from .settings import GenerationSettings

LOAD, CALIBRATE, GENERATE, PROMPT_LOGPROBS, STOP = "load", "calibrate", "generate", "prompt_logprobs", "stop"


def broadcast(message: dict | None, group: mx.distributed.Group) -> dict:
    """Rank 0's `message` on every process (the others pass None): a length, then the JSON bytes."""
    data = json.dumps(message).encode() if group.rank() == 0 else b""
    size = int(from_rank_zero(mx.array([len(data)], mx.int32), group).item())
    buffer = mx.array(np.frombuffer(data, np.uint8)) if data else mx.zeros((size,), mx.uint8)
    return json.loads(bytes(np.array(from_rank_zero(buffer, group))))


def goes_on(decision: bool, group: mx.distributed.Group) -> bool:
    """Rank 0's word after a chunk, on every process: whether its generation runs another round."""
    return bool(from_rank_zero(mx.array([int(decision)], mx.int32), group).item())


def settings_message(settings: GenerationSettings) -> dict:
    return settings.flat()


def settings_of(message: dict) -> GenerationSettings:
    return GenerationSettings.of(**message)


class StateNumbers:
    """Rank 0's numbering of the decode states it generates on, what each started from, and which it has let
    go since the last announcement."""

    def __init__(self):
        self._numbers: dict[int, tuple[weakref.ref, int]] = {}  # id(state) -> (the state, its number)
        self._copies: dict[int, tuple[weakref.ref, int]] = {}  # id(copy) -> (the copy, the number it copies)
        self._dropped: list[int] = []
        self._count = itertools.count()

    def _known(self, state: DecodeState) -> int | None:
        entry = self._numbers.get(id(state))
        return entry[1] if entry is not None and entry[0]() is state else None

    def copied(self, source: DecodeState, copy: DecodeState) -> None:
        number = self._known(source)
        if number is not None:
            self._copies[id(copy)] = (weakref.ref(copy), number)

    def number(self, state: DecodeState) -> tuple[int, int | None]:
        """(the state's number, the number of the state it starts from: itself, one it copies, or None for a
        fresh one)."""
        known = self._known(state)
        if known is not None:
            return known, known
        copy = self._copies.pop(id(state), None)
        origin = copy[1] if copy is not None and copy[0]() is state else None
        if origin is None and state.processed:
            raise GlimmerError("a split target's followers cannot rebuild a decode state rank 0 filled unannounced")
        number = next(self._count)
        self._numbers[id(state)] = (weakref.ref(state, lambda _, n=number: self._dropped.append(n)), number)
        return number, origin

    def dropped(self) -> list[int]:
        """The numbers of the states collected since the last call (their followers' twins can go)."""
        for key in [k for k, (ref, _) in self._numbers.items() if ref() is None]:
            del self._numbers[key]
        for key in [k for k, (ref, _) in self._copies.items() if ref() is None]:
            del self._copies[key]
        out, self._dropped[:] = list(self._dropped), []
        return out


_states = StateNumbers()
_open = threading.Lock()  # held while an announced call runs: announcements never interleave
_stopped = False


def _announce(message: dict) -> mx.distributed.Group:
    group = split_group()
    if _stopped:
        raise GlimmerError("the split target's followers have stopped")
    broadcast(message, group)
    return group


def copied(source: DecodeState, copy: DecodeState) -> None:
    """`copy` starts as a copy of `source` (a prompt cache's fork): under a split the followers copy theirs."""
    if split_group() is not None:
        _states.copied(source, copy)


def load(open_pair: Callable[[], Any]):
    """`open_pair()`, the followers loading theirs at once (loading runs the split target: a tree check)."""
    if split_group() is None:
        return open_pair()
    with _open:
        _announce({"kind": LOAD})
        return open_pair()


def stop() -> None:
    """Rank 0 is done: the followers return (waits for an announced call still running; idempotent)."""
    global _stopped
    if split_group() is None or _stopped:
        return
    with _open:
        _announce({"kind": STOP})
        _stopped = True


def calibrate(pair, settings: GenerationSettings = GenerationSettings(), on_measure=None) -> None:
    """`generate.calibrate`, which under a split measures the verify cost on every process together."""
    if split_group() is not None:
        with _open:
            _announce({"kind": CALIBRATE, "settings": settings_message(settings)})
            calibrate_here(pair, settings, on_measure)
    else:
        calibrate_here(pair, settings, on_measure)


def prompt_logprobs(target: Any, tokens: list[int], top: int) -> list[TokenLogprob | None]:
    """`logprobs.prompt_logprobs` (one forward over the prompt), run by every process under a split."""
    if split_group() is None:
        return target_prompt_logprobs(target, tokens, top)
    with _open:
        _announce({"kind": PROMPT_LOGPROBS, "tokens": list(tokens), "top": top})
        return target_prompt_logprobs(target, tokens, top)


def stream_generate(
    pair,
    prompt,
    settings: GenerationSettings | None = None,
    *,
    state: DecodeState | None = None,
    chat_template_kwargs: dict | None = None,
    **changes,
) -> Iterator[GenerationChunk]:
    """`generate.stream_generate`; under a split, announced to the followers, who stop where this one is
    closed. `prompt` must be JSON (a string, token ids or messages)."""
    if split_group() is None:
        return generate_here(pair, prompt, settings, state=state, chat_template_kwargs=chat_template_kwargs, **changes)
    return _led(pair, prompt, settings, state, chat_template_kwargs, changes)


def _led(pair, prompt, settings, state, chat_template_kwargs, changes) -> Iterator[GenerationChunk]:
    settings = (settings or GenerationSettings()).updated(**changes)
    if not _open.acquire(blocking=False):
        raise GlimmerError("a split target runs one generation at a time")
    try:
        number, origin = _states.number(state) if state is not None else (None, None)
        message = {
            "kind": GENERATE,
            "prompt": prompt,
            "settings": settings_message(settings),
            "chat_template_kwargs": chat_template_kwargs,
            "state": number,
            "origin": origin,
            "drop": _states.dropped(),
        }
        group = _announce(message)
        chunks = generate_here(pair, prompt, settings, state=state, chat_template_kwargs=chat_template_kwargs)
        try:
            for chunk in chunks:
                try:
                    yield chunk
                except GeneratorExit:
                    goes_on(False, group)
                    raise
                goes_on(True, group)
        finally:
            chunks.close()
    finally:
        _open.release()


def follows(chunks: Iterator, group: mx.distributed.Group) -> None:
    """A follower's side of `_led`: step `chunks` while rank 0 says it goes on."""
    for _ in chunks:
        if not goes_on(False, group):
            return
