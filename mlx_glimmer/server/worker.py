"""One model, many clients: a single generation thread fed by a bounded FIFO queue.

The thread owns the pair (MLX streams belong to the thread that made them),
takes jobs in arrival order, and reports each job's progress through the
job's `emit` callback: `Delta`s of text, then one `Finished` or `Failed`. A job
whose `cancelled` event is set (its client went away) is skipped if it is
still queued, or stopped after the current round (or batched step) if it is
running; either way the conversation it was extending stays cached and
consistent.

A lone request decodes speculatively. While others wait, `batch.BatchPolicy`
(measured throughput) decides whether they join it in a `batch.DecodeBatch`
(one target forward per step for all of them) or wait their turn. A request
moves between the two at round boundaries (`Run`: what it has committed and
emitted travels with it); the last one left in a batch goes back to
speculative decoding. Log-probabilities come either way: from the verify
passes alone, from the batched step's logits in a batch.

A request joining a running batch is prefilled alone before its first token.
A long prompt is prefilled in whole chunks (`prefill_chunk` tokens,
`speculative.prefill`) between batched steps, so the requests already decoding
keep going instead of waiting for the whole prompt; its first token's forward
then runs only the rest (`Run.alone` finds the chunks in its conversation).

Stop strings are applied here, so generation ends as soon as one appears.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Protocol

import mlx.core as mx

from ..generate import GenerationPair, GenerationStats, prepare_request, stream_generate
from ..logprobs import TokenLogprob, prompt_logprobs
from ..settings import SEED_LIMIT, BatchSettings, GenerationSettings
from ..speculative import common_prefix, logprob_top, prefill
from .batch import BatchPolicy, DecodeBatch, Row, batch_support
from .metrics import ServerMetrics
from .prompt_cache import Conversation, PromptCache


@dataclass
class GenerationRequest:
    """A validated request, prompt already tokenized."""

    prompt_tokens: list[int]
    settings: GenerationSettings = field(default_factory=GenerationSettings)
    stop: list[str] = field(default_factory=list)
    prompt_logprobs: bool = False  # report the prompt's own log-probabilities first (`echo`; needs settings.logprobs)


@dataclass
class Delta:
    text: str
    logprobs: list[TokenLogprob] | None = None  # of the tokens committed with this text, when the request asks


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


class QueueFull(Exception):
    pass


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


class PairLoader(Protocol):
    """Opens the pair to serve; called once, on the generation thread."""

    def __call__(self) -> GenerationPair: ...


def resume_seed(seed: int, generated: int) -> int:
    """The seed of a request's sampling after `generated` tokens: a request that goes back to speculative
    decoding must not replay the random numbers its first tokens used."""
    return (seed + generated * 0x9E3779B97F4A7C15) % SEED_LIMIT if generated else seed


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

    def __post_init__(self):
        self.stop = StopMatcher(self.job.request.stop)
        self.stats = GenerationStats(prompt_tokens=len(self.job.request.prompt_tokens))
        self.detok.reset()

    @classmethod
    def start(cls, job: Job, prompt_cache: PromptCache, tokenizer) -> "Run":
        wait = time.perf_counter() - job.enqueued_at
        return cls(job, prompt_cache.take(job.request.prompt_tokens), tokenizer.detokenizer, wait)

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
            settings = replace(
                settings,
                max_tokens=settings.max_tokens - len(self.generated),
                seed=resume_seed(settings.seed, len(self.generated)),
            )
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
        text, hit = self.stop.feed(self.detok.last_segment)
        if text or logprobs:
            self.job.emit(Delta(text, logprobs))
        if hit:
            self.finish = "stop"
        elif self.job.cancelled.is_set():
            self.finish = "cancelled"
        elif done is not None:
            self.finish = done
            if tail := self.stop.flush():
                self.job.emit(Delta(tail))

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


class GenerationWorker:
    """The generation thread and its queue (at most `max_queue` waiting jobs); `batch` bounds how many
    requests decode together; a request joining a batch with more than `prefill_chunk` prompt tokens to
    prefill is prefilled that many at a time between batched steps."""

    def __init__(
        self,
        load_pair: PairLoader,
        *,
        max_queue: int = 32,
        prompt_cache_bytes: int = 1 << 30,
        batch: BatchSettings = BatchSettings(),
        prefill_chunk: int = 128,
    ):
        self.load_pair = load_pair
        self.max_queue = max_queue
        self.prompt_cache_bytes = prompt_cache_bytes
        self.batch = batch
        self.prefill_chunk = prefill_chunk
        self.policy = BatchPolicy()
        self.metrics = ServerMetrics()
        self.pair = None
        self.prompt_cache: PromptCache | None = None
        self.batch_unsupported: str | None = None  # why requests cannot be decoded together, if they cannot
        self.active: list[Job] = []  # jobs generating now
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._closing = False
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="mlx-glimmer-generation", daemon=True)

    def start(self):
        """Load the pair on the worker thread and warm it up; returns the pair or raises what loading raised."""
        self._thread.start()
        self._ready.wait()
        if self._load_error is not None:
            raise self._load_error
        return self.pair

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    @property
    def busy(self) -> bool:
        return bool(self.active)

    @property
    def current(self) -> Job | None:
        active = self.active
        return active[0] if active else None

    @property
    def can_batch(self) -> bool:
        return self.batch.max_batch > 1 and self.batch_unsupported is None

    def submit(self, job: Job) -> None:
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            with self.metrics.lock:
                self.metrics.rejected += 1
            raise QueueFull from None

    def cancel_all(self) -> None:
        """Cancel the running jobs (they end after their current round) and every queued one."""
        with self._queue.mutex:
            queued = [job for job in self._queue.queue if job is not None]
        for job in queued + list(self.active):
            job.cancelled.set()

    def close(self, timeout: float | None = None) -> None:
        """Cancel all jobs, then stop the thread (waiting at most `timeout`)."""
        self.cancel_all()
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            self.pair = self.load_pair()
            # One short generation fills lazily made buffers (shared by every conversation's drafter copy).
            list(stream_generate(self.pair, list(self.pair.tokenizer.encode("Hello")) or [0], max_tokens=2))
            self.prompt_cache = PromptCache(self.pair.drafter, self.prompt_cache_bytes)
            self.batch_unsupported = batch_support(self.pair.target)
            with self.metrics.lock:
                self.metrics.batching_supported = self.can_batch
                self.metrics.max_batch = self.batch.max_batch
        except BaseException as e:  # reported by start()
            self._load_error = e
            self._ready.set()
            return
        self._ready.set()
        while not self._closing and (job := self._queue.get()) is not None:
            try:
                self._serve(job)
            except Exception as e:  # a bug; the thread must live on for the other clients
                traceback.print_exc(file=sys.stderr)
                for running in self.active:  # their conversations are dropped
                    self.metrics.count("error")
                    running.emit(Failed(f"generation failed: {type(e).__name__}: {e}"))
            finally:
                self.active = []
                self.metrics.set_mode(0)
            if self._queue.empty():
                self._sample_memory()
                mx.clear_cache()  # give freed buffers back while idle, so memory does not creep up

    def _sample_memory(self) -> None:
        with self.metrics.lock:
            self.metrics.active_memory_bytes = mx.get_active_memory()
            self.metrics.cache_memory_bytes = mx.get_cache_memory()

    # ---- scheduling -------------------------------------------------------------------------------------

    def _serve(self, job: Job) -> None:
        """Serve `job` and whatever arrives while it runs, until no request is left: a lone one decodes
        alone; waiting ones join it in a batch when the policy says that pays."""
        lone = self._begin(job)
        while lone is not None:
            if self._alone(lone, preempt=self._batch_now):
                lone = self._take_next()
                continue
            batch, joining = DecodeBatch(self.pair.target), []
            self._join(batch, lone)
            self._admit(batch, joining, self._waiting_batch_size() - 1)  # the policy just chose it: no second asking
            lone = self._decode_together(batch, joining)
            if lone is None:
                lone = self._take_next()

    def _batch_now(self) -> bool:
        """Should the lone request stop at this round and decode together with those waiting?"""
        n = self._waiting_batch_size()
        return n > 1 and self.policy.together(n)

    def _waiting_batch_size(self) -> int:
        """Requests a batch would hold now: this one and those waiting (up to max_batch); 1 when none can join."""
        if not self.can_batch or self._queue.empty():
            return 1
        return min(1 + self._queue.qsize(), self.batch.max_batch)

    def _take_next(self) -> Run | None:
        """The next waiting job, started; None when none waits."""
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return None
            if job is None:
                self._closing = True
                return None
            if (run := self._begin(job)) is not None:
                return run

    def _begin(self, job: Job) -> Run | None:
        if job.cancelled.is_set():
            self.metrics.count("cancelled")
            return None
        self.active.append(job)
        return Run.start(job, self.prompt_cache, self.pair.tokenizer)

    def _alone(self, run: Run, preempt: Callable[[], bool]) -> bool:
        """Decode `run` alone until it is done (True) or `preempt` stops it (False)."""
        self.metrics.set_mode(1)
        try:
            done = run.alone(self.pair, preempt, on_round=self.policy.observe_solo)
        except Exception as e:  # a bug, not bad input (requests are validated before they queue)
            self._fail(run, e)
            return True
        if done:
            self._end(run)
        return done

    def _join(self, batch: DecodeBatch, run: Run) -> None:
        state = run.conv.state
        params = run.settings.sampling
        key = None if params.greedy else mx.random.key(resume_seed(run.settings.seed, len(run.generated)))
        top = logprob_top(self.pair.target, run.settings)
        run.row = Row(state, run.generated[-1], params, key, run, top)
        batch.join(run.row)

    def _admit(self, batch: DecodeBatch, joining: list[Run], count: int) -> None:
        """Start up to `count` waiting jobs for the batch: one with a short prompt to prefill gets its first
        token (alone) and joins now; a longer one joins `joining`, to be prefilled in chunks between steps."""
        for _ in range(count):
            if len(batch) + len(joining) >= self.batch.max_batch or (run := self._take_next()) is None:
                return
            if run.unprefilled() > self.prefill_chunk:
                run.prefilling = run.prefill(self.pair, self.prefill_chunk)
                joining.append(run)
            else:
                self._start_in(batch, run)

    def _start_in(self, batch: DecodeBatch, run: Run) -> None:
        """The first token of `run` (alone: the rest of its prefill, then one token), then into the batch."""
        try:
            done = run.alone(self.pair, preempt=always)
        except Exception as e:
            self._fail(run, e)
            return
        if done:
            self._end(run)
        else:
            self._join(batch, run)

    def _prefill_chunk(self, batch: DecodeBatch, joining: list[Run]) -> None:
        """One chunk of the first joining request's prefill; once its prompt is in, its first token, and it
        joins the batch. A request cancelled meanwhile ends here (its conversation keeps what was prefilled)."""
        run = joining[0]
        try:
            more = not run.job.cancelled.is_set() and next(run.prefilling, False)
        except Exception as e:
            joining.pop(0)
            self._fail(run, e)
            return
        batch.interrupted()
        if more:
            return
        joining.pop(0)
        run.prefilling = None
        if run.job.cancelled.is_set():
            run.finish = "cancelled"
            run.stats.prefill_tokens = run.chunked.tokens
            self._end(run)
        else:
            self._start_in(batch, run)

    def _decode_together(self, batch: DecodeBatch, joining: list[Run]) -> Run | None:
        """Step the batch until one request (returned, to decode alone) or none is left; waiting jobs join
        while the policy says a bigger batch pays, long prompts prefilled a chunk per step (`joining`)."""
        target = self.pair.target
        stop_ids = set(self.pair.tokenizer.eos_token_ids)
        drafter_model = self.pair.drafter.model if self.pair.drafter is not None else None
        with target.memory.resident(target.model, drafter_model):
            while True:
                n, size = self._waiting_batch_size() - 1, len(batch) + len(joining)
                if n > 0 and size < self.batch.max_batch and self.policy.together(size + 1):
                    self._admit(batch, joining, min(n, self.batch.max_batch - size))
                if joining:
                    self._prefill_chunk(batch, joining)
                if len(batch) <= 1 and not joining:
                    if not batch.rows:
                        return None
                    (row,) = batch.rows
                    batch.leave([row])
                    run, run.row = row.owner, None
                    return run
                if not batch.rows:
                    continue
                self.metrics.set_mode(len(batch))
                try:
                    out, seconds = batch.step()
                except Exception as e:  # a bug: every request in the batch fails, the thread lives on
                    for run in [row.owner for row in batch.rows] + joining:
                        self._fail(run, e)
                    return None
                if seconds is not None:
                    self.policy.observe_batch(len(out), seconds)
                now = time.perf_counter()
                for picked in out:
                    picked.row.owner.batched_step(picked.token, stop_ids, len(out), now, picked.logprob)
                self.metrics.record_step(len(out), self.policy.solo_rate, self.policy.rates())
                done = [row for row in batch.rows if row.owner.finish is not None]
                batch.leave(done)
                for row in done:
                    row.owner.row = None
                    self._end(row.owner)

    def _end(self, run: Run) -> None:
        self.prompt_cache.put(run.conv)
        event = run.finished()
        self.metrics.record(event.stats, event.finish_reason, event.queue_wait_s, event.batched_tokens)
        self.metrics.record_rates(self.policy.solo_rate, self.policy.rates())
        self.metrics.record_cache(self.prompt_cache)
        self._drop(run)
        run.job.emit(event)

    def _fail(self, run: Run, error: Exception) -> None:
        """A bug, not bad input: report it; the half-updated conversation is dropped."""
        traceback.print_exc(file=sys.stderr)
        self.metrics.count("error")
        self.metrics.record_cache(self.prompt_cache)
        self._drop(run)
        run.job.emit(Failed(f"generation failed: {type(error).__name__}: {error}"))

    def _drop(self, run: Run) -> None:
        self.active = [j for j in self.active if j is not run.job]
