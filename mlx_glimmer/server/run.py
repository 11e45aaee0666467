"""One request's decoding, alone or in a batch: the request and the events it emits (`Delta`s of text, then
one `Finished` or `Failed`), and its `Run`: what it has committed and emitted, its stop strings, its stats.
A run moves between decoding alone and in a batch at round boundaries, and all of this travels with it."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

from ..decode_state import common_prefix
from ..generate import GenerationStats, prepare_request
from ..lockstep import prompt_logprobs, stream_generate
from ..logprobs import TokenLogprob
from ..settings import GenerationSettings
from ..speculative import prefill
from .batch import Row
from .continuation import Continuation
from .prompt_cache import Conversation, PromptCache


@dataclass
class GenerationRequest:
    """A validated request, prompt already tokenized."""

    prompt_tokens: list[int]
    settings: GenerationSettings = field(default_factory=GenerationSettings)
    stop: list[str] = field(default_factory=list)
    prompt_logprobs: bool = False  # report the prompt's own log-probabilities first (`echo`; needs settings.logprobs)
    continuation: bool = False  # text as it reads after the prompt (completions), not as a text of its own (chat)
    ids_prompt: bool = False  # the prompt came as token ids (it may end inside a character)


@dataclass
class Delta:
    text: str
    logprobs: list[TokenLogprob] | None = None  # of the tokens committed with this text, when the request asks
    offsets: list[int] | None = None  # with them, a continuation's: where each token stands in its text


@dataclass
class PromptLogprobs:
    """The prompt's log-probabilities (None for its first token), before any `Delta`."""

    logprobs: list[TokenLogprob | None]


@dataclass
class Finished:
    finish_reason: str  # "stop" | "length" | "cancelled"
    stats: GenerationStats
    queue_wait_s: float
    token_ids: list[int] = field(default_factory=list)  # committed (a stop token excluded)
    batched_tokens: int = 0  # of them, decoded in a batch with other requests
    batch_size: int = 1  # the most requests it was decoded together with (1: always alone)


@dataclass
class Failed:
    message: str


Event = Delta | PromptLogprobs | Finished | Failed


@dataclass
class Job:
    request: GenerationRequest
    emit: Callable[[Event], None]  # called on the worker thread; must be thread-safe and must not block
    cancelled: threading.Event = field(default_factory=threading.Event)
    enqueued_at: float = field(default_factory=time.perf_counter)


class StopMatcher:
    """Cuts streamed text at the first stop string, holding back any tail that could start one."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text that is safe to emit, whether a stop string was found)."""
        if not self.stops:
            return text, False
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


@dataclass
class ChunkedPrefill:
    """The prompt tokens a request prefilled in chunks between batched steps before its first token: they count
    as prefilled (not reused from the prefix cache), their seconds in its prefill rate, from `started` in its
    time to first token."""

    tokens: int = 0
    seconds: float = 0.0  # each chunk from its launch to its end (a batched step queued before it included)
    started: float = 0.0  # when the first chunk began

    def counted_in(self, stats: GenerationStats, stream_start: float) -> GenerationStats:
        """`stats` of the generation that followed (started at `stream_start`), with the chunks counted in."""
        if self.tokens:
            rate = stats.prefill_tokens_per_second
            seconds = self.seconds + (stats.prefill_tokens / rate if rate > 0 else 0.0)
            stats.prefill_tokens += self.tokens
            stats.prefill_tokens_per_second = stats.prefill_tokens / max(seconds, 1e-9)
            stats.ttft_s += stream_start - self.started
        return stats


@dataclass
class Run:
    """One job from its start to its end, alone or in a batch: its conversation, the tokens it has committed,
    its text so far (detokenizer, stop strings) and its running stats."""

    job: Job
    conv: Conversation
    detok: Any
    queue_wait_s: float
    stop: StopMatcher = field(init=False)
    stats: GenerationStats = field(init=False)
    generated: list[int] = field(default_factory=list)
    finish: str | None = None  # "stop" | "length" | "cancelled" once done
    first_at: float = 0.0
    batched_tokens: int = 0
    batch_size: int = 1
    row: Row | None = None  # while in a batch
    chunked: ChunkedPrefill = field(default_factory=ChunkedPrefill)
    prefilling: Iterator[bool] | None = None  # while its prompt is prefilled in chunks (`prefill`)
    waiting: list[TokenLogprob] = field(default_factory=list)  # log-probabilities of tokens whose text is held back

    def __post_init__(self):
        self.stop = StopMatcher(self.job.request.stop)
        self.stats = GenerationStats(prompt_tokens=len(self.job.request.prompt_tokens))
        self.detok.reset()

    @classmethod
    def start(cls, job: Job, prompt_cache: PromptCache, tokenizer) -> "Run":
        wait = time.perf_counter() - job.enqueued_at
        request = job.request
        if request.continuation:
            detok = Continuation(tokenizer, request.prompt_tokens, request.ids_prompt)
        else:
            detok = tokenizer.detokenizer
        return cls(job, prompt_cache.take(request.prompt_tokens), detok, wait)

    @property
    def settings(self) -> GenerationSettings:
        return self.job.request.settings

    def unprefilled(self) -> int:
        """Prompt tokens its conversation does not hold yet (what its prefill would run, as far as the cache
        can tell before it is resumed)."""
        prompt = self.job.request.prompt_tokens
        return len(prompt) - common_prefix(self.conv.tokens, prompt)

    def prefill(self, pair, chunk: int) -> Iterator[bool]:
        """Prefill the prompt into the request's conversation in whole chunks of `chunk` tokens, one per next()
        (each computed before next() returns; yields whether more follow), as `alone` would prefill them (which
        then runs the last 1 to `chunk` tokens with the first token); timed into `chunked`."""
        pair = replace(pair, drafter=self.conv.drafter)
        request = prepare_request(pair, self.job.request.prompt_tokens, self.settings)
        chunks = prefill(
            pair.target,
            request.tokens,
            request.settings,
            drafter=request.drafter,
            state=self.conv.state,
            policy=request.policy,
            step=chunk,
        )
        self.chunked.started = tic = time.perf_counter()
        for left in chunks:
            self.chunked.tokens += chunk
            self.chunked.seconds += time.perf_counter() - tic
            yield left > 0
            tic = time.perf_counter()

    def alone(self, pair, preempt: Callable[[], bool] = lambda: False, on_round=None) -> bool:
        """Decode alone from where the request stands, as its settings say (speculative by default), until it
        is done (True) or, at a round boundary, `preempt()` says to stop (False). `on_round(tokens, seconds)`
        hears every round after the first (that one includes a prefill)."""
        resumed = bool(self.generated)
        settings = self.settings
        if settings.logprobs is not None and self.job.request.prompt_logprobs and not resumed:
            tokens = self.job.request.prompt_tokens
            self.job.emit(PromptLogprobs(prompt_logprobs(pair.target, tokens, settings.logprobs)))
        if resumed:
            # The same seed: sampling noise is keyed by the token's index in the sequence, so the tokens still
            # to come draw what they would have drawn had the request never paused.
            settings = replace(settings, max_tokens=settings.max_tokens - len(self.generated))
        prompt = self.job.request.prompt_tokens + self.generated
        began = time.perf_counter()
        chunks = stream_generate(replace(pair, drafter=self.conv.drafter), prompt, settings, state=self.conv.state)
        base, last = self.stats, None
        try:
            for chunk in chunks:
                now = time.perf_counter()
                stopped = chunk.stats.finish_reason == "stop"
                if last is not None and on_round is not None:
                    on_round(len(chunk.token_ids) + stopped, now - last)
                last = now
                self.stats = joined(base, chunk.stats) if resumed else self.chunked.counted_in(chunk.stats, began)
                self.commit(chunk.token_ids, stopped, now, chunk.logprobs)
                if self.finish is not None:
                    return True
                if preempt():
                    return False
        finally:
            chunks.close()
        if self.finish is None:  # the loop ended without saying why
            self.finish = self.stats.finish_reason or "length"
        return True

    def commit(self, tokens: list[int], stopped: bool, now: float, logprobs: list[TokenLogprob] | None = None) -> None:
        """Take newly committed tokens (`stopped`: a stop token came after them): emit their text (and
        `logprobs`, theirs), and see whether the request is done (a stop token or string, its token budget,
        its client gone)."""
        self.first_at = self.first_at or now
        self.generated += tokens
        for t in tokens:
            self.detok.add_token(t)
        self.stats.tally(len(self.generated), self.first_at, now, stopped=stopped, max_tokens=self.settings.max_tokens)
        done = self.stats.finish_reason
        if done is not None:
            self.detok.finalize()
        logprobs, offsets = self.with_text(logprobs)
        text, hit = self.stop.feed(self.detok.last_segment)
        if text or logprobs:
            self.job.emit(Delta(text, logprobs, offsets))
        if hit:
            self.finish = "stop"
        elif self.job.cancelled.is_set():
            self.finish = "cancelled"
        elif done is not None:
            self.finish = done
            if tail := self.stop.flush():
                self.job.emit(Delta(tail))

    def with_text(self, logprobs: list[TokenLogprob] | None) -> tuple[list[TokenLogprob] | None, list[int] | None]:
        """The log-probabilities to send now, with their tokens' offsets in the text: a continuation's wait for
        their tokens' text (the bytes of a character split across tokens are held back until it is whole),
        whose offsets it then knows; a chat reply's go as they come."""
        if not isinstance(self.detok, Continuation):
            return logprobs, None
        self.waiting += logprobs or []
        offsets = self.detok.take_offsets()
        if not self.waiting:
            return None, None
        ready, self.waiting = self.waiting[: len(offsets)], self.waiting[len(offsets) :]
        return ready, offsets

    def batched_step(
        self, token: int, stop_ids: set, batch_size: int, now: float, logprob: TokenLogprob | None = None
    ) -> None:
        """One token from a batched step (a target forward of width 1 for this request), with its
        log-probability when the request asks."""
        stats = self.stats
        stats.target_forwards += 1
        stats.acceptance_lengths.append(1)
        stats.verify_widths.append(1)
        stats.tokens_verified += 1
        stats.accepted_depths.append(0)
        stopped = token in stop_ids
        self.batched_tokens += not stopped
        self.batch_size = max(self.batch_size, batch_size)
        self.commit([] if stopped else [token], stopped, now, None if stopped or logprob is None else [logprob])

    def finished(self) -> Finished:
        return Finished(
            self.finish or "length",
            self.stats,
            self.queue_wait_s,
            list(self.generated),
            self.batched_tokens,
            self.batch_size,
        )


def always() -> bool:
    return True


def joined(base: GenerationStats, segment: GenerationStats) -> GenerationStats:
    """The stats of a request that went back to decoding alone: `base` (so far) and the new segment's, whose
    one-token "prefill" is the forward of the request's last token (a round committing one token)."""
    sources = dict(base.accepted_from)
    for source, rounds in segment.accepted_from.items():
        sources[source] = sources.get(source, 0) + rounds
    return replace(
        base,
        target_forwards=base.target_forwards + 1 + segment.target_forwards,
        acceptance_lengths=base.acceptance_lengths + [1] + segment.acceptance_lengths,
        verify_widths=base.verify_widths + [1] + segment.verify_widths,
        tokens_verified=base.tokens_verified + 1 + segment.tokens_verified,
        accepted_depths=base.accepted_depths + [0] + segment.accepted_depths,
        tree_rounds=base.tree_rounds + segment.tree_rounds,
        accepted_from=sources,
        draft_s=base.draft_s + segment.draft_s,
        verify_s=base.verify_s + segment.verify_s,
        peak_memory_gb=max(base.peak_memory_gb, segment.peak_memory_gb),
        drafter_kind=segment.drafter_kind,
        block_size=segment.block_size,
        block_policy=segment.block_policy,
    )
