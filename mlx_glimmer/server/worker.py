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
from typing import Callable, Protocol

import mlx.core as mx

from ..generate import GenerationPair
from ..lockstep import stream_generate
from ..logprobs import logprob_top
from ..settings import BatchSettings
from .batch import BatchPolicy, DecodeBatch, Row, batch_support
from .metrics import ServerMetrics
from .prompt_cache import PromptCache
from .run import Failed, Job, Run, always


class QueueFull(Exception):
    pass


class PairLoader(Protocol):
    """Opens the pair to serve; called once, on the generation thread."""

    def __call__(self) -> GenerationPair: ...


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
        top = logprob_top(self.pair.target, run.settings)
        run.row = Row(state, run.generated[-1], run.settings.sampling, run.settings.seed, run, top)
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
