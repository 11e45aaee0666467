"""The server's running totals (`ServerMetrics`, written by the generation thread) and `/metrics`' text."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field, replace

from ..generate import GenerationStats
from .prompt_cache import PromptCache, PromptCacheStats


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
    tokens_verified: int = 0  # tokens verify rounds offered the target: drafts (chain or tree nodes) + the anchor
    tree_rounds: int = 0  # verify rounds that verified a draft tree
    accepted_from: Counter = field(default_factory=Counter)  # rounds by who proposed the accepted path
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
    # Decoding together (batch.py): the requests decoding now (0 idle, 1 alone, more in a batch), the bound,
    # batched steps by batch size, and the throughputs the batching decision compares.
    batch_size: int = 0
    max_batch: int = 1
    batching_supported: bool = False
    batched_steps: Counter = field(default_factory=Counter)
    batched_tokens: int = 0  # of finished requests
    solo_tokens_per_second: float = 0.0
    batched_tokens_per_second: dict = field(default_factory=dict)  # by batch size
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def snapshot(self) -> "ServerMetrics":
        """A consistent copy for the HTTP side to read."""
        with self.lock:
            return replace(
                self,
                requests=Counter(self.requests),
                block_sizes=Counter(self.block_sizes),
                acceptance=Counter(self.acceptance),
                accepted_from=Counter(self.accepted_from),
                batched_steps=Counter(self.batched_steps),
                batched_tokens_per_second=dict(self.batched_tokens_per_second),
                prefix_cache=replace(self.prefix_cache),
                lock=threading.Lock(),
            )

    def record_cache(self, cache: PromptCache) -> None:
        with self.lock:
            self.prefix_cache = replace(cache.stats)
            self.prefix_cache_entries = len(cache)
            self.prefix_cache_bytes = cache.nbytes

    def count(self, finish_reason: str) -> None:
        with self.lock:
            self.requests[finish_reason] += 1

    def record(self, stats: GenerationStats, finish_reason: str, queue_wait_s: float, batched_tokens: int = 0) -> None:
        with self.lock:
            self._record(stats, finish_reason, queue_wait_s)
            self.batched_tokens += batched_tokens

    def set_mode(self, batch_size: int) -> None:
        with self.lock:
            self.batch_size = batch_size

    def record_step(self, batch_size: int, solo_rate: float | None, rates: dict[int, float]) -> None:
        """One batched step of `batch_size` requests, and the policy's measurements after it."""
        with self.lock:
            self.batched_steps[batch_size] += 1
            self._rates(solo_rate, rates)

    def record_rates(self, solo_rate: float | None, rates: dict[int, float]) -> None:
        with self.lock:
            self._rates(solo_rate, rates)

    def _rates(self, solo_rate: float | None, rates: dict[int, float]) -> None:
        self.solo_tokens_per_second = solo_rate or 0.0
        self.batched_tokens_per_second = dict(rates)

    def _record(self, stats: GenerationStats, finish_reason: str, queue_wait_s: float) -> None:
        self.requests[finish_reason] += 1
        self.prompt_tokens += stats.prompt_tokens
        self.prefill_tokens += stats.prefill_tokens
        self.reused_tokens += stats.prompt_tokens - stats.prefill_tokens
        self.generated_tokens += stats.generated_tokens
        self.target_forwards += stats.target_forwards
        self.committed_by_rounds += sum(stats.acceptance_lengths)
        self.acceptance.update(stats.acceptance_lengths)
        self.tokens_verified += stats.tokens_verified
        self.tree_rounds += stats.tree_rounds
        self.accepted_from.update(stats.accepted_from)
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


def by_label(label: str, values: dict, empty, zero: float = 0) -> list[tuple[str, float]]:
    """One sample per key of `values` (sorted), labelled `label`; with no keys yet, one `zero` sample at `empty`,
    so the series exists from the first scrape."""
    return [(f'{{{label}="{k}"}}', v) for k, v in sorted(values.items())] or [(f'{{{label}="{empty}"}}', zero)]


def metric(lines: list[str], name: str, kind: str, help: str, samples: list[tuple[str, float]] | float) -> None:
    """One Prometheus metric: its HELP and TYPE lines and a sample per label set."""
    lines.append(f"# HELP glimmer_{name} {help}")
    lines.append(f"# TYPE glimmer_{name} {kind}")
    for labels, value in samples if isinstance(samples, list) else [("", samples)]:
        lines.append(
            f"glimmer_{name}{labels} {value:g}" if isinstance(value, float) else f"glimmer_{name}{labels} {value}"
        )


def scheduling_metrics(lines: list[str], m: ServerMetrics, queue_depth: int, busy: bool) -> None:
    metric(
        lines,
        "requests_total",
        "counter",
        "requests finished, by finish reason",
        by_label("finish_reason", m.requests, "stop"),
    )
    metric(lines, "rejected_requests_total", "counter", "requests refused with 503 (queue full)", m.rejected)
    metric(lines, "queue_depth", "gauge", "requests waiting for the generation thread", queue_depth)
    metric(lines, "busy", "gauge", "1 while a request is generating", int(busy))
    metric(
        lines,
        "batch_size",
        "gauge",
        "requests decoding now: 1 alone (speculative), more decoded together in one forward per step",
        m.batch_size,
    )
    metric(lines, "max_batch", "gauge", "most requests decoded together (--max-batch)", m.max_batch)
    metric(
        lines,
        "batching_supported",
        "gauge",
        "1 when this target's requests can be decoded together",
        int(m.batching_supported),
    )
    metric(
        lines,
        "batched_steps_total",
        "counter",
        "batched target forwards, by batch size",
        by_label("batch_size", m.batched_steps, 2),
    )
    metric(lines, "batched_tokens_total", "counter", "tokens of finished requests decoded in a batch", m.batched_tokens)
    metric(
        lines,
        "solo_tokens_per_second",
        "gauge",
        "measured decoding speed of a lone request (what batching must beat)",
        float(m.solo_tokens_per_second),
    )
    metric(
        lines,
        "batched_tokens_per_second",
        "gauge",
        "measured throughput of batched steps, all requests together, by batch size",
        by_label("batch_size", {k: float(v) for k, v in m.batched_tokens_per_second.items()}, 2, 0.0),
    )


def decoding_metrics(lines: list[str], m: ServerMetrics) -> None:
    metric(lines, "prompt_tokens_total", "counter", "prompt tokens of finished requests", m.prompt_tokens)
    metric(lines, "prefill_tokens_total", "counter", "prompt tokens actually prefilled", m.prefill_tokens)
    metric(lines, "reused_tokens_total", "counter", "prompt tokens served from the prefix cache", m.reused_tokens)
    metric(lines, "generated_tokens_total", "counter", "tokens generated", m.generated_tokens)
    metric(lines, "target_forwards_total", "counter", "target verify forwards after prefill", m.target_forwards)
    metric(
        lines, "mean_acceptance", "gauge", "tokens committed per target forward, all requests", float(m.mean_acceptance)
    )
    metric(
        lines,
        "tokens_verified_total",
        "counter",
        "tokens verify forwards offered the target after prefill: drafts (chain or tree nodes) + the anchor",
        m.tokens_verified,
    )
    metric(lines, "tree_rounds_total", "counter", "verify forwards that verified a draft tree", m.tree_rounds)
    metric(
        lines,
        "accepted_path_rounds_total",
        "counter",
        "verify rounds that kept drafts, by who proposed the accepted path (model, lookup or both)",
        by_label("source", m.accepted_from, "model"),
    )
    metric(
        lines,
        "decode_tokens_per_second",
        "gauge",
        "decode speed over all requests",
        float((m.generated_tokens - sum(m.requests.values())) / m.decode_s) if m.decode_s else 0.0,
    )
    metric(
        lines,
        "last_decode_tokens_per_second",
        "gauge",
        "decode speed of the last request",
        float(m.last_decode_tokens_per_second),
    )
    metric(
        lines,
        "prefill_tokens_per_second",
        "gauge",
        "prefill speed over all requests",
        float(m.prefill_tokens / m.prefill_s) if m.prefill_s else 0.0,
    )
    metric(lines, "queue_wait_seconds_total", "counter", "time requests spent queued", float(m.queue_wait_s))
    metric(
        lines,
        "block_size_requests_total",
        "counter",
        "requests by draft block width",
        by_label("block_size", m.block_sizes, 1),
    )
    metric(
        lines,
        "rounds_by_committed_tokens_total",
        "counter",
        "verify rounds by tokens committed (acceptance histogram)",
        by_label("committed", m.acceptance, 1),
    )


def cache_and_memory_metrics(lines: list[str], m: ServerMetrics, prompt_cache_max_bytes: int, uptime_s: float) -> None:
    cache = m.prefix_cache
    metric(lines, "prefix_cache_hits_total", "counter", "requests that reused a cached conversation", cache.hits)
    metric(
        lines,
        "prefix_cache_forks_total",
        "counter",
        "hits served by a copy of a conversation that stays cached",
        cache.forks,
    )
    metric(lines, "prefix_cache_misses_total", "counter", "requests that started cold", cache.misses)
    metric(lines, "prefix_cache_evictions_total", "counter", "conversations evicted", cache.evictions)
    metric(lines, "prefix_cache_entries", "gauge", "conversations cached", m.prefix_cache_entries)
    metric(lines, "prefix_cache_bytes", "gauge", "bytes held by cached conversations", m.prefix_cache_bytes)
    metric(lines, "prefix_cache_max_bytes", "gauge", "prefix cache bound", prompt_cache_max_bytes)
    metric(lines, "active_memory_bytes", "gauge", "MLX active memory (sampled when idle)", m.active_memory_bytes)
    metric(lines, "cache_memory_bytes", "gauge", "MLX buffer cache (sampled when idle)", m.cache_memory_bytes)
    metric(lines, "peak_memory_bytes", "gauge", "MLX peak memory of any request", m.peak_memory_bytes)
    metric(lines, "uptime_seconds", "gauge", "seconds since the server started", float(uptime_s))


def metrics_text(
    metrics: ServerMetrics, *, queue_depth: int, busy: bool, prompt_cache_max_bytes: int, uptime_s: float
) -> str:
    """The Prometheus text of `/metrics`."""
    m = metrics.snapshot()
    lines: list[str] = []
    scheduling_metrics(lines, m, queue_depth, busy)
    decoding_metrics(lines, m)
    cache_and_memory_metrics(lines, m, prompt_cache_max_bytes, uptime_s)
    return "\n".join(lines) + "\n"
