"""Concurrent requests decoded together: one target forward per step carries one token of every active request.

Why. A speculative round speeds up one request by verifying several of its
own tokens in one target forward; with several requests active, the same kind
of forward can instead carry one token of each. Which pays more depends on the
device, the model and the drafter's acceptance (prompt lookup on copy-heavy
text commits whole blocks per forward and can beat a small batch), so
`BatchPolicy` decides from measured throughput, as `--block-size auto` picks a
width. A lone request always decodes alone, as its settings say (speculatively
by default).

How. The batch is our own loop over batched KV caches (`batch_cache.py`:
mlx-lm's `BatchKVCache` for full-attention layers, our `BatchWindowedKVCache`
for the rollback-safe sliding-window layers of Muse Glimmer; left-padded rows,
one RoPE offset per row): a request's own KV cache is merged into it when it
joins and extracted back when it leaves, so copying costs O(context) only when
the set of requests changes, and the request's conversation goes back to the
prefix cache as if it had been decoded alone. Steps are queued one ahead, as
plain decoding is (the host reads step t while step t + 1 runs), and each is
read once: the rows' tokens and, for the rows asking for log-probabilities
(only those compute them), each token's log-softmax and likeliest
alternatives at its row of the step's logits. A request's
drafter keeps following it: every batched step captures the target features of
the row's token, as a plain round of the speculative loop does, so a request
left alone in the batch goes back to speculative decoding, and a follow-up turn
drafts from a context that covers the whole conversation.

What cannot batch (`batch_support`): a target with a cache kind that has no
batched form, or whose `forward` is not the model's own; its requests are
served one after another.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from ..decode_state import DecodeState
from ..divergence import explain_first_divergence, next_token_logits, to_numpy
from ..logprobs import TokenLogprob, read_table
from ..noise import Noise
from ..settings import SamplingParams
from ..target import Target
from .batch_cache import BatchedCache, merge_rows, unbatched_kinds


def batch_support(target) -> str | None:
    """None when `target`'s requests can be decoded together; otherwise the reason they cannot."""
    if not isinstance(target, Target):
        return "the target is not an MLX target"
    if type(target).forward is not Target.forward:
        return f"{type(target).__name__} changes the target's forward"
    kinds = unbatched_kinds(target.make_cache(reserve=1))
    if kinds:
        names = ", ".join(sorted(k.__name__ for k in kinds))
        return f"the target's caches ({names}) have no batched form"
    return None


@dataclass
class BatchPolicy:
    """Whether n requests are decoded together or one after another, from measured throughput.

    `solo_rate`: committed tokens per second of a lone request's decoding (speculative rounds, or plain
    ones where a request asks for that), from an exponential average of seconds per token over rounds.
    `step_seconds[n]`: seconds of one batched step of n requests (each commits one token), read to read,
    exponentially averaged. Load only ever adds time, so a faster measurement pulls an average at least
    halfway (as `block_policy.WidthPolicy` does): one slow moment cannot decide for long. n
    requests are decoded together when n / step_seconds(n) beats `solo_rate`: serving them one after
    another commits `solo_rate` tokens per second, whichever request runs.

    A batch size never run is estimated from the nearest one measured (its step time, taken as this
    size's); with nothing measured either way, batching is tried, and its measurement decides from then
    on. Load only ever adds time, so a batch measured at a bad moment could stay refused: after `interval`
    refusals it is tried again (a probe), and each probe that still loses doubles the interval (up to
    `max_interval`); a win resets it.
    """

    alpha: float = 0.2  # weight of a new measurement
    probe_interval: int = 64
    max_interval: int = 4096
    solo_rate: float | None = None
    step_seconds: dict[int, float] = field(default_factory=dict)
    interval: int = 0
    refused: int = 0

    def observe_solo(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            per_token = self._average(seconds / tokens, 1 / self.solo_rate if self.solo_rate else None)
            self.solo_rate = 1 / per_token

    def observe_batch(self, size: int, seconds: float) -> None:
        if size > 0 and seconds > 0:
            self.step_seconds[size] = self._average(seconds, self.step_seconds.get(size))

    def _average(self, seconds: float, old: float | None) -> float:
        """Exponential average of a time; load only ever adds time, so a faster one pulls it at least halfway."""
        if old is None:
            return seconds
        weight = max(self.alpha, 0.5) if seconds < old else self.alpha
        return (1 - weight) * old + weight * seconds

    def batched_rate(self, size: int) -> float | None:
        """Expected committed tokens per second of a batch of `size` (None: nothing measured)."""
        if not self.step_seconds:
            return None
        nearest = min(self.step_seconds, key=lambda m: (abs(m - size), -m))
        return size / self.step_seconds[nearest]

    def rates(self) -> dict[int, float]:
        """Measured batched throughput by batch size."""
        return {n: n / s for n, s in sorted(self.step_seconds.items())}

    def together(self, size: int) -> bool:
        """Decode `size` requests together (True) or one after another (False)?"""
        if size < 2:
            return False
        self.interval = self.interval or self.probe_interval
        batched = self.batched_rate(size)
        if batched is None or self.solo_rate is None or batched > self.solo_rate:
            self.refused, self.interval = 0, self.probe_interval
            return True
        self.refused += 1
        if self.refused >= self.interval:
            self.refused, self.interval = 0, min(2 * self.interval, self.max_interval)
            return True
        return False


@dataclass(eq=False)  # compared by identity
class Row:
    """One request in a batch. `state.processed` lists the tokens the batch holds for it (not counting a step
    queued ahead); `anchor` is its last committed token, the input of its next step; `drafter` (None for plain
    decoding) observes every processed token with its features."""

    state: DecodeState
    anchor: int
    params: SamplingParams
    seed: int = 0  # its sampling seed: the token at index p of its sequence draws `noise.Noise(seed, p)`
    owner: Any = None  # what the caller knows this request by
    logprobs: int | None = None  # alternatives of each token's log-probability (None: none computed)


@dataclass
class Picked:
    """A row's next token, read from a step, with its log-probability when the row asks (`Row.logprobs`)."""

    row: Row
    token: int
    logprob: TokenLogprob | None = None


@dataclass
class _Step:
    """One batched step on the device, not read yet: the next token of each of `rows`, the features of the
    tokens it ran (each row's anchor) and, for each row that asks, its token's log-probability table."""

    rows: list[Row]
    tokens: mx.array  # [len(rows)]
    feats: mx.array | None  # [len(rows), k*H]
    tables: list[mx.array | None]  # per row: `tree.token_logprobs` of its token, or None


def forward_rows(target: Target, tokens: mx.array, cache: list, capture: bool) -> tuple[mx.array, mx.array | None]:
    """One token per row through the decoder: tokens [B] -> final hidden states [B, H] and, with capture, the
    captured layers' outputs [B, k*H] (as `Target.forward` does for one sequence)."""
    recorder = target.recorder
    recorder.active = capture and bool(recorder.layer_ids)
    hidden = target.model.model(tokens[:, None], cache=cache)[:, 0]
    feats = recorder.features()
    return hidden, (feats[:, 0] if feats is not None else None)


def row_logprobs(target: Target, logits: mx.array, tokens: mx.array, rows: list[Row]) -> list[mx.array | None]:
    """For each row that asks, the log-probability table of its token at its row of `logits` (lazily, as a
    verify computes it: `tree.token_logprobs`); None for the others, which compute nothing."""
    return [
        None if r.logprobs is None else target.trees.token_logprobs(logits[i : i + 1], tokens[i : i + 1], r.logprobs)
        for i, r in enumerate(rows)
    ]


def pick_rows(target: Target, logits: mx.array, rows: list[Row], positions: list[int]) -> mx.array:
    """The next token of each row, by its own sampling settings: argmax, or the sample of its filtered
    distribution with the row's own seed at `positions[i]`, the index of that token in the row's sequence: the
    token it would draw there decoding alone (`speculative.generate_steps`)."""
    ops = target.sampling
    if all(r.params.greedy for r in rows):
        return ops.argmax(logits).astype(mx.uint32)
    out = []
    for i, r in enumerate(rows):
        if r.params.greedy:
            out.append(ops.argmax(logits[i : i + 1]).astype(mx.uint32))
        else:
            probs = ops.probabilities(logits[i : i + 1], r.params)
            out.append(ops.sample(probs, Noise(r.seed, positions[i])).astype(mx.uint32))
    return mx.concatenate(out)


class DecodeBatch:
    """Requests decoding together: `join` a request whose cache holds exactly its processed tokens, `step`
    for one token of each, `leave` to hand a request its own cache back."""

    def __init__(self, target: Target):
        self.target = target
        self.rows: list[Row] = []
        self.cache: list[BatchedCache] | None = None
        self.queued: _Step | None = None
        self.steps = 0
        self._last_read: float | None = None  # None: the next read-to-read interval is not a step's time

    def __len__(self) -> int:
        return len(self.rows)

    def join(self, row: Row) -> None:
        """Add a request; its cache moves into the batch (`state.cache` is None until it leaves)."""
        merged = merge_rows([row.state.cache])
        if self.cache is None:
            self.cache = merged
        else:
            for batch, one in zip(self.cache, merged):
                batch.extend(one)
        row.state.cache = None
        self.rows.append(row)
        self._last_read = None

    def leave(self, rows: list[Row]) -> None:
        """Take `rows` out; each gets back a cache of its own holding exactly its `state.processed` tokens (the
        step queued ahead wrote one entry more: it is trimmed), and its drafter projects the features it was
        given into its context (as the loop's plain rounds do), so nothing of the batch's buffers stays
        referenced."""
        if not rows:
            return
        gone = set(rows)
        for i, row in enumerate(self.rows):
            if row in gone:
                own = [c.extract(i) for c in self.cache]
                extra = own[0].offset - len(row.state.processed)
                for c in own:
                    c.trim(extra)
                context = row.state.drafter.settle() if row.state.drafter is not None else []
                mx.eval([c.state for c in own], context)  # its own buffers now, not views of the batch's
                row.state.cache = own
        keep = [i for i, r in enumerate(self.rows) if r not in gone]
        self.rows = [self.rows[i] for i in keep]
        self._last_read = None
        if not self.rows:
            self.close()
            return
        for c in self.cache:
            c.filter(keep)
        if self.queued is not None:
            q = self.queued
            kept = [i for i, r in enumerate(q.rows) if r not in gone]
            if not kept:  # every row it ran has left: the rows still here start from their anchors
                mx.eval(q.tokens)  # let the device finish what it was given before its arrays go
                self.queued = None
            elif len(kept) < len(q.rows):
                index = mx.array(kept)
                feats = q.feats[index] if q.feats is not None else None
                tables = [q.tables[i] for i in kept]
                self.queued = _Step([q.rows[i] for i in kept], q.tokens[index], feats, tables)

    def close(self) -> None:
        """Drop the batch's caches once the step queued ahead has finished (its rows have left)."""
        if self.queued is not None:
            mx.eval(self.queued.tokens)
        self.rows, self.cache, self.queued = [], None, None

    def step(self) -> tuple[list[Picked], float | None]:
        """Read one step: each row it ran, with its next token (and its log-probability, for a row that asks),
        and the step's seconds (None when the set of rows changed or other work ran since the last read, so
        the interval is not one step's). The next step is queued before the read, and the read is one: the
        tokens and the log-probability tables together."""
        if self.queued is None:
            self.queued = self._launch(self._inputs(None), ahead=0)
        current = self.queued
        self.queued = self._launch(self._inputs(current), ahead=len(current.rows))
        values = self.target.read(current.tokens, *current.tables)
        now = time.perf_counter()
        seconds = None if self._last_read is None else now - self._last_read
        self._last_read = now
        out, offset = [], len(current.rows)
        for i, (row, value, table) in enumerate(zip(current.rows, values, current.tables)):
            row.state.processed.append(row.anchor)
            if row.state.drafter is not None:
                row.state.drafter.observe([row.anchor], current.feats[i : i + 1] if current.feats is not None else None)
            row.anchor = token = int(value)
            logprob = None
            if table is not None:
                logprob = read_table(values[offset:], 1, 1, row.logprobs).entry(0, 0, token)
                offset += table.size
            out.append(Picked(row, token, logprob))
        self.target.memory.tick(self.steps, self.steps + 1)
        self.steps += 1
        return out, seconds

    def interrupted(self) -> None:
        """Other work ran on the device since the last read (a joining request's prefill): the next read's
        interval is not one step's time."""
        self._last_read = None

    def _inputs(self, current: _Step | None) -> mx.array:
        """The next step's input: the unread tokens of `current`'s rows, then the anchors of rows that joined
        after it was queued (joins append)."""
        ran = current.rows if current is not None else []
        assert all(a is b for a, b in zip(self.rows, ran)), "rows that joined come after the rows already running"
        fresh = mx.array([r.anchor for r in self.rows[len(ran) :]], dtype=mx.uint32)
        return mx.concatenate([current.tokens, fresh]) if ran else fresh

    def _launch(self, inputs: mx.array, ahead: int) -> _Step:
        """Queue a step on `inputs`; the first `ahead` rows' inputs are the unread tokens of the step before."""
        rows = list(self.rows)
        # A row's input sits at index len(processed) of its sequence, or one further when it is the unread
        # token of the step before (whose own input is not in `processed` yet); the step picks the next one.
        positions = [len(r.state.processed) + 1 + (i < ahead) for i, r in enumerate(rows)]
        ids = _layer_ids(rows)
        if ids and tuple(self.target.recorder.layer_ids) != ids:
            self.target.capture(ids)
        hidden, feats = forward_rows(self.target, inputs, self.cache, bool(ids))
        logits = self.target.head(hidden)
        tokens = pick_rows(self.target, logits, rows, positions)
        tables = row_logprobs(self.target, logits, tokens, rows)
        mx.async_eval(tokens, *([feats] if feats is not None else []), *[t for t in tables if t is not None])
        return _Step(rows, tokens, feats, tables)


def _layer_ids(rows: list[Row]) -> tuple[int, ...]:
    """The target layers the rows' drafters read (they are copies of one drafter: the same layers)."""
    for r in rows:
        drafter = r.state.drafter
        if drafter is not None and drafter.target_layer_ids:
            return tuple(drafter.target_layer_ids)
    return ()


def batch_logits(target: Target, context: list[int], rows: int) -> mx.array:
    """Logits [V] of the token after `context` as a batched step of `rows` requests computes them (the
    context in every row): for reports of where batched and solo greedy outputs part."""
    cache = target.make_cache(reserve=16)
    if len(context) > 1:
        hidden, _ = target.forward(target.tokens(context[:-1]), cache, False)
        target.sync(hidden, cache=cache)
    merged = merge_rows([cache] * rows)
    hidden, _ = forward_rows(target, mx.array([context[-1]] * rows, dtype=mx.uint32), merged, False)
    return target.head(hidden[:1])[0]


def explain_batched_divergence(
    target: Target, dtype: str, prompt: list[int], reference: list[int], tokens: list[int], rows: int
) -> dict | None:
    """The first position where a batched greedy output `tokens` leaves the solo one `reference` (both
    generated after `prompt`), with the margins of the next token's logits there computed both ways: a 1-row
    step and a batched step of `rows` rows (`batch_logits`). None when one output is a prefix of the other."""
    kernels = {
        "step (1 row)": lambda context: next_token_logits(target, context, 1),
        f"batched ({rows} rows)": lambda context: to_numpy(batch_logits(target, context, rows)),
    }
    return explain_first_divergence(kernels, dtype, prompt, reference, tokens)
