"""A process of a split target other than rank 0, under `serve` or `chat`: it makes each call rank 0 announces
(`lockstep.py`) on its share of the target, and nothing else: no server, no app, no output.

It keeps a decode state of its own for each one rank 0 numbers, each with its own copy of the drafter (as a
server's prompt cache does), so its caches and drafter context hold what rank 0's hold.
"""

from __future__ import annotations

import signal
from dataclasses import replace
from typing import Callable

from .errors import GlimmerError
from .generate import GenerationPair, calibrate, stream_generate
from .lockstep import CALIBRATE, GENERATE, LOAD, PROMPT_LOGPROBS, STOP, broadcast, follows, settings_of
from .logprobs import prompt_logprobs
from .ranks import split_group
from .server.prompt_cache import Conversation, PromptCache


class Twins:
    """This process's decode states, each the twin of one rank 0 numbered."""

    def __init__(self, pair: GenerationPair):
        self.made = PromptCache(pair.drafter, max_bytes=0)  # makes and copies conversations; holds none
        self.held: dict[int, Conversation] = {}

    def drop(self, numbers: list[int]) -> None:
        for number in numbers:
            self.held.pop(number, None)

    def take(self, number: int, origin: int | None) -> Conversation:
        """The twin of rank 0's state `number`: the one held, a copy of `origin`'s, or a fresh one."""
        if origin is None:
            conv = self.made.new()
        elif origin == number:
            conv = self.held[number]
        else:
            conv = self.made.fork(self.held[origin])
        self.held[number] = conv
        return conv


def follow(load: Callable[[], GenerationPair]) -> int:
    """Make rank 0's calls until it stops: load when it loads (or return if it stops first), then each
    calibration, generation and prompt log-probabilities it announces. Ctrl-C is rank 0's to act on (a
    server's graceful shutdown, a chat's cancel): here it is ignored, and rank 0's stop ends this."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    group = split_group()
    if broadcast(None, group)["kind"] != LOAD:
        return 0
    pair = load()
    twins = Twins(pair)
    while (message := broadcast(None, group))["kind"] != STOP:
        if message["kind"] == CALIBRATE:
            calibrate(pair, settings_of(message["settings"]))
        elif message["kind"] == PROMPT_LOGPROBS:
            prompt_logprobs(pair.target, message["tokens"], message["top"])
        elif message["kind"] == GENERATE:
            generation(pair, twins, message, group)
    return 0


def generation(pair: GenerationPair, twins: Twins, message: dict, group) -> None:
    """One announced generation, stopped where rank 0's stops. Bad input fails here as it failed there, before
    any round, so both go on to the next announcement."""
    twins.drop(message["drop"])
    state = None
    if message["state"] is not None:
        conv = twins.take(message["state"], message["origin"])
        pair, state = replace(pair, drafter=conv.drafter), conv.state
    chunks = stream_generate(
        pair,
        message["prompt"],
        settings_of(message["settings"]),
        state=state,
        chat_template_kwargs=message["chat_template_kwargs"],
    )
    try:
        follows(chunks, group)
    except GlimmerError:
        pass
    finally:
        chunks.close()
