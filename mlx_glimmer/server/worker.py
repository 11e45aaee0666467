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
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol

import mlx.core as mx

from ..generate import GenerationPair, GenerationStats, stream_generate
from ..settings import GenerationSettings
from .metrics import ServerMetrics
from .prompt_cache import PromptCache


@dataclass
class GenerationRequest:
    """A validated request, prompt already tokenized."""

    prompt_tokens: list[int]
    settings: GenerationSettings = field(default_factory=GenerationSettings)
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


class PairLoader(Protocol):
    """Opens the pair to serve; called once, on the generation thread."""

    def __call__(self) -> GenerationPair: ...


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
    chunks = stream_generate(pair, req.prompt_tokens, req.settings, state=conv.state)
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
