"""One model, many clients: a single generation thread fed by a bounded FIFO queue.

The thread owns the pair (MLX streams belong to the thread that made them),
takes jobs in arrival order, and reports each job's progress through the
job's `emit` callback: `Delta`s of text, then one `Finished` or `Failed`. A job
whose `cancelled` event is set (its client went away) is skipped if it is
still queued, or stopped after the current round if it is running; either
way the conversation it was extending stays cached and consistent.

Stop strings are applied here, so generation ends as soon as one appears.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol

import mlx.core as mx

from . import stream_generate
from .generate import GenerationStats
from .loading import Pair
from .prompt_cache import PromptCache, PromptCacheStats


@dataclass
class GenerationRequest:
    """A validated request, prompt already tokenized."""

    prompt_tokens: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    speculative: bool = True
    block_size: int | None = None
    stop: list[str] = field(default_factory=list)


@dataclass
class Delta:
    text: str


@dataclass
class Finished:
    finish_reason: str  # "stop" | "length" | "cancelled"
    stats: GenerationStats
    queue_wait_s: float


@dataclass
class Failed:
    message: str


Event = Delta | Finished | Failed


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


@dataclass
class ServerMetrics:
    """Running totals for `/metrics`: written by the worker thread under `lock`, read through `snapshot()`."""

    requests: Counter = field(default_factory=Counter)  # by finish reason ("stop", "length", "cancelled", "error")
    rejected: int = 0  # answered 503 because the queue was full
    prompt_tokens: int = 0
    prefill_tokens: int = 0
    reused_tokens: int = 0
    generated_tokens: int = 0
    target_forwards: int = 0
    committed_by_rounds: int = 0  # tokens committed by verify rounds (the numerator of mean acceptance)
    decode_s: float = 0.0
    prefill_s: float = 0.0
    queue_wait_s: float = 0.0
    block_sizes: Counter = field(default_factory=Counter)  # requests by block width
    acceptance: Counter = field(default_factory=Counter)  # rounds by tokens committed
    last_decode_tokens_per_second: float = 0.0
    active_memory_bytes: int = 0
    peak_memory_bytes: int = 0
    cache_memory_bytes: int = 0
    prefix_cache: PromptCacheStats = field(default_factory=PromptCacheStats)
    prefix_cache_entries: int = 0
    prefix_cache_bytes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def snapshot(self) -> "ServerMetrics":
        """A consistent copy for the HTTP side to read."""
        with self.lock:
            return replace(self, requests=Counter(self.requests), block_sizes=Counter(self.block_sizes),
                           acceptance=Counter(self.acceptance), prefix_cache=replace(self.prefix_cache),
                           lock=threading.Lock())

    def record_cache(self, cache: PromptCache) -> None:
        with self.lock:
            self.prefix_cache = replace(cache.stats)
            self.prefix_cache_entries = len(cache)
            self.prefix_cache_bytes = cache.nbytes

    def count(self, finish_reason: str) -> None:
        with self.lock:
            self.requests[finish_reason] += 1

    def record(self, stats: GenerationStats, finish_reason: str, queue_wait_s: float) -> None:
        with self.lock:
            self._record(stats, finish_reason, queue_wait_s)

    def _record(self, stats: GenerationStats, finish_reason: str, queue_wait_s: float) -> None:
        self.requests[finish_reason] += 1
        self.prompt_tokens += stats.prompt_tokens
        self.prefill_tokens += stats.prefill_tokens
        self.reused_tokens += stats.prompt_tokens - stats.prefill_tokens
        self.generated_tokens += stats.generated_tokens
        self.target_forwards += stats.target_forwards
        self.committed_by_rounds += sum(stats.acceptance_lengths)
        self.acceptance.update(stats.acceptance_lengths)
        self.block_sizes[stats.block_size] += 1
        if stats.generated_tokens > 1 and stats.decode_tokens_per_second > 0:
            self.decode_s += (stats.generated_tokens - 1) / stats.decode_tokens_per_second
            self.last_decode_tokens_per_second = stats.decode_tokens_per_second
        if stats.prefill_tokens_per_second > 0:
            self.prefill_s += stats.prefill_tokens / stats.prefill_tokens_per_second
        self.queue_wait_s += queue_wait_s
        self.peak_memory_bytes = max(self.peak_memory_bytes, int(stats.peak_memory_gb * 1e9))

    @property
    def mean_acceptance(self) -> float:
        return self.committed_by_rounds / self.target_forwards if self.target_forwards else 0.0


class PairLoader(Protocol):
    """Opens the pair to serve; called once, on the generation thread."""

    def __call__(self) -> Pair: ...


class GenerationWorker:
    """The generation thread and its queue (at most `max_queue` waiting jobs)."""

    def __init__(self, load_pair: PairLoader, *, max_queue: int = 32, prompt_cache_bytes: int = 1 << 30):
        self.load_pair = load_pair
        self.max_queue = max_queue
        self.prompt_cache_bytes = prompt_cache_bytes
        self.metrics = ServerMetrics()
        self.pair = None
        self.prompt_cache: PromptCache | None = None
        self.busy = False
        self.current: Job | None = None
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
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

    def submit(self, job: Job) -> None:
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            with self.metrics.lock:
                self.metrics.rejected += 1
            raise QueueFull from None

    def cancel_all(self) -> None:
        """Cancel the running job (it ends after its current round) and every queued one."""
        with self._queue.mutex:
            queued = [job for job in self._queue.queue if job is not None]
        for job in queued:
            job.cancelled.set()
        if (job := self.current) is not None:
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
        except BaseException as e:  # reported by start()
            self._load_error = e
            self._ready.set()
            return
        self._ready.set()
        while (job := self._queue.get()) is not None:
            if job.cancelled.is_set():
                self.metrics.count("cancelled")
                continue
            self.busy, self.current = True, job
            try:
                self._generate(job)
            finally:
                self.busy, self.current = False, None
            if self._queue.empty():
                self._sample_memory()
                mx.clear_cache()  # give freed buffers back while idle, so memory does not creep up

    def _sample_memory(self) -> None:
        with self.metrics.lock:
            self.metrics.active_memory_bytes = mx.get_active_memory()
            self.metrics.cache_memory_bytes = mx.get_cache_memory()

    def _generate(self, job: Job) -> None:
        try:
            event = answer(self.pair, self.prompt_cache, job)
        except Exception as e:  # a bug; the thread must live on for the other clients
            traceback.print_exc(file=sys.stderr)
            event = Failed(f"generation failed: {type(e).__name__}: {e}")
        if isinstance(event, Finished):
            self.metrics.record(event.stats, event.finish_reason, event.queue_wait_s)
        else:
            self.metrics.count("error")
        self.metrics.record_cache(self.prompt_cache)
        job.emit(event)


def answer(pair, prompt_cache: PromptCache, job: Job) -> Finished | Failed:
    """Run one job on the calling thread: emit its text as `Delta`s and return how it ended.

    The conversation it extends is taken from `prompt_cache` and put back when the
    job finishes, is cancelled or meets a stop string (generation is closed at a
    round boundary, so the state holds exactly what the target processed).
    """
    req = job.request
    wait = time.perf_counter() - job.enqueued_at
    conv = prompt_cache.take(req.prompt_tokens)
    pair = replace(pair, drafter=conv.drafter)
    chunks = stream_generate(
        pair,
        req.prompt_tokens,
        max_tokens=req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        seed=req.seed,
        block_size=req.block_size,
        speculative=req.speculative and pair.drafter is not None,
        state=conv.state,
    )
    stop = StopMatcher(req.stop)
    stats = GenerationStats(prompt_tokens=len(req.prompt_tokens))
    finish = None
    try:
        for chunk in chunks:
            stats = chunk.stats
            text, hit = stop.feed(chunk.text)
            if text:
                job.emit(Delta(text))
            if hit:
                finish = "stop"
                break
            if job.cancelled.is_set():
                finish = "cancelled"
                break
        if finish is None:
            finish = stats.finish_reason or "length"
            if tail := stop.flush():
                job.emit(Delta(tail))
    except Exception as e:  # a bug, not bad input (requests are validated before they queue)
        traceback.print_exc(file=sys.stderr)
        chunks.close()
        return Failed(f"generation failed: {type(e).__name__}: {e}")  # the half-updated conversation is dropped
    chunks.close()
    prompt_cache.put(conv)
    return Finished(finish, stats, wait)
