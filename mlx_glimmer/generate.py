"""The Python API: `generate` and `stream_generate` over a loaded pair, on MLX or torch.

Prompts may be a string (encoded by the tokenizer, which adds BOS if it
does so by itself), a list of token ids (used exactly as given), or chat
messages (rendered with the tokenizer's chat template, generation prompt
appended). Stop tokens are the tokenizer's EOS ids; a stop token ends the
answer and is not part of `token_ids` or `text`.

Timing definitions (the JSON fields of `mlx-glimmer generate --json`):
    ttft_s                      start of the call -> first token known (includes prefill)
    prefill_tokens_per_second   prompt tokens / prefill time
    decode_tokens_per_second    tokens after the first / time from first token to last
    acceptance_lengths[i]       tokens committed by target call i after prefill
    tokens_verified             tokens the target verified after prefill: drafts (chain or tree nodes) + the
                                anchor, summed over rounds
    accepted_depths[i]          drafts kept by target call i (the accepted path's depth in a tree)
    tree_rounds                 target calls that verified a draft tree rather than a chain
    accepted_from               rounds by who proposed the accepted path: "model", "lookup" (n-gram
                                matches) or "both" (shared nodes); rounds that kept no draft are not counted
    draft_s, verify_s           the rounds' seconds from one host read to the next, split: proposing and
                                launching the draft; the rest (the verify, its read, the loop's host work)
    peak_memory_gb              MLX's peak; on torch CUDA's peak allocation, MPS's driver allocation,
                                or on CPU the process's peak resident size
    logprobs                    with `--logprobs K` only: per generated token {token, logprob, top: [{token,
                                logprob}] (its K likeliest alternatives)}, under the target's own distribution
On torch the device is synchronised at every step, so times are wall-clock for finished work.
"""

from __future__ import annotations

import time
import weakref
from collections import Counter
from contextlib import closing
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Generator, Iterator, Protocol, Sequence

from .block_policy import TREE_WIDTHS, WidthPolicy, width_policy
from .chat_template import has_chat_template
from .decode_state import DecodeState
from .distributed import in_lockstep
from .drafters.base import Drafter
from .errors import GlimmerError
from .logprobs import TokenLogprob
from .logprobs import prompt_logprobs as target_prompt_logprobs
from .paths import cache_dir
from .ranks import split_group
from .settings import AUTO, MAX_LOGPROBS, MAX_TREE_NODES, OFF, GenerationSettings, SamplingError
from .speculative import generate_steps, tree_setting
from .target_model import TargetModel
from .verify_cost import VerifyCost, cached_verify_cost, calibration_key

Prompt = str | Sequence[int] | Sequence[dict]


class GenerationPair(Protocol):
    """What `stream_generate` needs of a pair: `loading.Pair` (MLX) and `torch_backend.TorchPair` both are one.

    device_key   where and in what precision the target computes ("default|" on MLX, "cuda:0|torch.bfloat16"
                 on torch): verify costs are measured and cached per bundle and device_key
    """

    target: TargetModel
    drafter: Drafter | None
    tokenizer: Any  # mlx-lm's TokenizerWrapper: encode, eos_token_ids, detokenizer, chat template
    target_path: Path

    @property
    def device_key(self) -> str: ...


def width_histogram(widths: list[int]) -> dict[str, int]:
    """How many rounds verified each width, as `--json` and `bench` print it."""
    counts = Counter(widths)
    return {str(w): counts[w] for w in sorted(counts)}


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens actually run (fewer than prompt_tokens when a chat reuses its cache)
    generated_tokens: int = 0
    target_forwards: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)
    prefill_tokens_per_second: float = 0.0
    decode_tokens_per_second: float = 0.0
    ttft_s: float = 0.0
    peak_memory_gb: float = 0.0
    finish_reason: str | None = None
    drafter_kind: str = "none"
    block_size: int = 1  # the verify width, or with block_policy "auto" the widest it may choose
    block_policy: str = "fixed"  # "fixed" or "auto"
    verify_widths: list[int] = field(default_factory=list)  # per target call after prefill: drafts offered + 1
    draft_s: float = 0.0
    verify_s: float = 0.0
    tree_rounds: int = 0  # target calls after prefill that verified a draft tree
    tokens_verified: int = 0  # over target calls after prefill: drafts offered (chain or tree nodes) + 1
    accepted_depths: list[int] = field(default_factory=list)  # per target call after prefill: drafts kept
    accepted_from: dict[str, int] = field(default_factory=dict)  # rounds by source of the accepted path

    @property
    def mean_acceptance(self) -> float:
        if not self.acceptance_lengths:
            return 0.0
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths)

    @property
    def mean_accepted_depth(self) -> float:
        """Drafts kept per round (the accepted path's depth)."""
        return sum(self.accepted_depths) / len(self.accepted_depths) if self.accepted_depths else 0.0

    @property
    def mean_tokens_verified(self) -> float:
        """Tokens the target verified per round (drafts + the anchor)."""
        return self.tokens_verified / self.target_forwards if self.target_forwards else 0.0

    @property
    def verify_width_histogram(self) -> dict[str, int]:
        return width_histogram(self.verify_widths)

    def tally(self, generated: int, first_at: float, now: float, *, stopped: bool, max_tokens: int) -> None:
        """The figures after `generated` tokens, the first committed at `first_at` and the last at `now`: the decode
        rate (tokens after the first / time from the first to the last), and why the answer ended once it has
        (a stop token, or `max_tokens`)."""
        self.generated_tokens = generated
        if generated > 1 and now > first_at:
            self.decode_tokens_per_second = (generated - 1) / (now - first_at)
        if stopped:
            self.finish_reason = "stop"
        elif generated >= max_tokens:
            self.finish_reason = "length"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["mean_acceptance"] = self.mean_acceptance
        d["verify_width_histogram"] = self.verify_width_histogram
        d["mean_accepted_depth"] = self.mean_accepted_depth
        d["mean_tokens_verified"] = self.mean_tokens_verified
        return d

    def snapshot(self) -> GenerationStats:
        """A copy whose lists and dicts are its own (the figures of this moment)."""
        return replace(
            self,
            acceptance_lengths=list(self.acceptance_lengths),
            verify_widths=list(self.verify_widths),
            accepted_depths=list(self.accepted_depths),
            accepted_from=dict(self.accepted_from),
        )


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None  # one per token of `token_ids` when `settings.logprobs` asked


@dataclass
class GenerationChunk:
    text: str  # new text since the previous chunk
    token_ids: list[int]  # tokens committed in this chunk (stop token excluded)
    stats: GenerationStats  # running totals
    logprobs: list[TokenLogprob] | None = None  # one per token of `token_ids` when `settings.logprobs` asked


def encode_prompt(tokenizer, prompt: Prompt, chat_template_kwargs: dict | None = None) -> list[int]:
    """`prompt`'s token ids; every mistake in it is a `GlimmerError` naming `prompt`."""
    if isinstance(prompt, str):
        if not prompt:
            raise GlimmerError("prompt: the prompt is empty")
        ids = list(tokenizer.encode(prompt))
        if not ids:
            raise GlimmerError("prompt: the prompt encodes to no tokens")
        return ids
    try:
        prompt = list(prompt)
    except TypeError:
        raise GlimmerError(
            f"prompt: a string, a list of token ids or a list of messages, got {type(prompt).__name__}"
        ) from None
    if not prompt:
        raise GlimmerError("prompt: the prompt is empty")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    if all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
        for i, m in enumerate(prompt):
            for key in ("role", "content"):
                if not isinstance(m[key], str):
                    raise GlimmerError(f"prompt[{i}]['{key}'] must be a string, got {type(m[key]).__name__}")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise GlimmerError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}")
        if not has_chat_template(tokenizer):
            raise GlimmerError("this tokenizer has no chat template; pass a plain string prompt")
        text = tokenizer.apply_chat_template(
            prompt, add_generation_prompt=True, tokenize=False, **(chat_template_kwargs or {})
        )
        return list(tokenizer.encode(text, add_special_tokens=False))
    raise GlimmerError("a prompt is a string, a list of token ids, or a list of {'role', 'content'} messages")


def stream_generate(
    pair: GenerationPair,
    prompt: Prompt,
    settings: GenerationSettings | None = None,
    *,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    block_size: int | str | None = None,
    seed: int | None = None,
    speculative: bool | None = None,
    tree: int | str | None = None,
    logprobs: int | None = None,
    chat_template_kwargs: dict | None = None,
    state: DecodeState | None = None,
) -> Iterator[GenerationChunk]:
    """Yield text as tokens are committed, with running stats. `pair`: from `load` or `torch_backend.load_torch`.

    How to generate is `settings` (a `GenerationSettings`; default: greedy, 256 tokens, block size "auto",
    tree "auto", speculative, seed 0, no log-probabilities); a keyword given here replaces its field (None leaves
    it). `logprobs` K gives each chunk's tokens their log-probabilities and K alternatives. Pass the same
    `state` (a `DecodeState`) on every turn of a conversation to keep its KV cache and drafter context: each
    turn then prefills only the tokens its prompt adds to what is already cached.

    Every argument is checked before anything runs (a `GlimmerError` naming it); `ttft_s` counts from this
    call, so it includes a first `auto` run's verify-cost measurement.
    """
    start = time.perf_counter()
    if settings is not None and not isinstance(settings, GenerationSettings):
        raise GlimmerError(f"settings must be a GenerationSettings, got {type(settings).__name__}")
    settings = (settings or GenerationSettings()).updated(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        block_size=block_size,
        seed=seed,
        speculative=speculative,
        tree=tree,
        logprobs=logprobs,
    )
    pair.target.reset_peak_memory()
    request = prepare_request(pair, prompt, settings, chat_template_kwargs)
    steps = generate_steps(
        pair.target,
        request.tokens,
        request.settings,
        drafter=request.drafter,
        stop_ids=pair.tokenizer.eos_token_ids,
        state=state,
        policy=request.policy,
    )
    # On Metal the pair's weights stay wired while it generates (`memory.DeviceMemory`; nothing elsewhere).
    drafter_model = request.drafter.model if request.drafter is not None else None
    with pair.target.memory.resident(pair.target.model, drafter_model):
        yield from chunks_from_steps(
            pair.tokenizer, steps, request.stats, settings.max_tokens, start, pair.target.peak_memory_gb
        )


@dataclass
class Request:
    """One validated request, as the loop takes it."""

    tokens: list[int]
    settings: GenerationSettings  # its block size an int: the verify width, or under "auto" the widest
    drafter: Drafter | None
    stats: GenerationStats  # fresh, for this request's chunks
    policy: WidthPolicy | None = None  # block size "auto": the width is chosen every round


def prepare_request(
    pair: GenerationPair, prompt: Prompt, settings: GenerationSettings, chat_template_kwargs: dict | None = None
) -> Request:
    """Encode and check one request's prompt against the pair, and settle its drafter and verify width.

    `settings.block_size`: an int fixes the verify width, at most `widest_width(drafter)` (a wider one is
    capped); "auto" chooses it every round from measured verify cost and live acceptance, up to the
    drafter's own block size (`block_policy.py`)."""
    tokens = encode_prompt(pair.tokenizer, prompt, chat_template_kwargs)
    vocab = pair.target.vocab_size
    if any(not 0 <= t < vocab for t in tokens):
        raise GlimmerError(f"prompt token ids must lie in [0, {vocab})")
    drafter = pair.drafter if settings.speculative else None
    if settings.auto:
        block_size = drafter.block_size if drafter is not None else 1
    else:
        block_size = min(settings.block_size, widest_width(drafter)) if drafter is not None else settings.block_size
    fixed_tree = isinstance(tree_setting(pair.target, drafter, settings), int)
    policy = None
    if settings.auto and drafter is not None and drafter.block_size > 1 and not fixed_tree:
        policy = auto_policy(pair, drafter, settings)
    stats = GenerationStats(
        prompt_tokens=len(tokens),
        drafter_kind=drafter.kind if drafter is not None else "none",
        # a fixed tree of N nodes verifies N + 1 tokens every round: that is the width it reports
        block_size=(settings.tree + 1 if fixed_tree else block_size) if drafter is not None else 1,
        block_policy="auto" if policy is not None else "fixed",
    )
    return Request(tokens, settings.with_verify_width(block_size), drafter, stats, policy)


def widest_width(drafter: Drafter) -> int:
    """The widest verify `drafter` can fill: its block size (a DFlash drafter's trained block; a draft model's
    or prompt lookup's draft_k + 1), or an adaptive draft model's most drafts + 1."""
    if drafter.adaptive:
        return max(drafter.block_size, drafter.max_k + 1)
    return drafter.block_size


# Per target: its measured verify-cost tables; per drafter: the policy of its last generation with each set of
# tree budgets (`auto_policy` starts the next from it). Keyed by id with a weak reference to the owner (targets
# are unhashable dataclasses).
_COSTS: dict[int, tuple[weakref.ref, dict[int, VerifyCost]]] = {}  # per target, per widest width
_POLICIES: dict[int, tuple[weakref.ref, dict[tuple[int, ...], WidthPolicy]]] = {}  # per drafter, per tree budgets


def _recall(table: dict, owner):
    entry = table.get(id(owner))
    return entry[1] if entry is not None and entry[0]() is owner else None


def _remember(table: dict, owner, value) -> None:
    table[id(owner)] = (weakref.ref(owner, lambda _, k=id(owner): table.pop(k, None)), value)


def _tree_widths(target: TargetModel, drafter: Drafter, settings: GenerationSettings) -> tuple[int, ...]:
    """The tree budgets `auto` may choose: none when the drafter drafts chains only or trees are off."""
    if tree_setting(target, drafter, settings) != AUTO:
        return ()
    return tuple(w for w in TREE_WIDTHS if w <= MAX_TREE_NODES + 1)


def _verify_cost(pair: GenerationPair, width: int, on_measure: Callable[[str], None] | None = None) -> VerifyCost:
    """The pair's verify cost up to `width`: in memory, on disk (once per bundle, device, dtype, chip and
    library version), or measured now (`on_measure` hears it first)."""
    costs = _recall(_COSTS, pair.target) or {}  # per widest width: switching trees on and off keeps both tables
    cost = costs.get(width)
    if cost is None:
        config = Path(pair.target_path) / "config.json"
        stamp = config.stat().st_mtime_ns if config.is_file() else 0
        key = calibration_key(
            pair.target, Path(pair.target_path).resolve(), stamp, type(pair.target).__name__, pair.device_key
        )
        # Split across processes, every process measures at once (each forward sums across them all): never
        # one process from its disk and another live.
        directory = cache_dir() / "verify_cost" if split_group() is None else None
        cost = cached_verify_cost(pair.target, width, pair.target.vocab_size, key, directory, on_measure)
        _remember(_COSTS, pair.target, {**costs, width: cost})
    return cost


def verify_costs(pair: GenerationPair) -> dict[int, VerifyCost]:
    """The verify-cost tables this pair's `auto` generations have used, per widest width, as their rounds left
    them (a results file records what its run's choices rested on)."""
    return dict(_recall(_COSTS, pair.target) or {})


def calibrate(
    pair: GenerationPair,
    settings: GenerationSettings = GenerationSettings(),
    on_measure: Callable[[str], None] | None = None,
) -> None:
    """Have the verify cost `auto` needs for `settings` ready now. The first run on a machine times a few
    widths (two passes over them after a warm-up); a caller that shows progress calls this after loading and
    passes `on_measure`, which hears one line before any timing starts. Without it, the first generation
    measures silently. `on_measure` also hears, in one line, why draft trees are off where the drafter could
    seed them but the target cannot verify them (`TargetModel.tree_unsupported`), or where a tree of N nodes
    was asked for and the drafter proposes chains only."""
    drafter = pair.drafter if settings.speculative else None
    why = None
    if drafter is not None and settings.tree != OFF:
        if drafter.has_marginals:
            why = pair.target.tree_unsupported
        elif isinstance(settings.tree, int):  # asked for by number; under "auto" chains are the expected case
            why = f"the {drafter.kind} drafter proposes chains only (no per-position distributions)"
    if on_measure is not None and why:
        on_measure(f"draft trees off, chains only: {why}")
    if drafter is not None and settings.auto and drafter.block_size > 1:
        _verify_cost(pair, max((drafter.block_size, *_tree_widths(pair.target, drafter, settings))), on_measure)


def auto_policy(pair: GenerationPair, drafter: Drafter, settings: GenerationSettings) -> WidthPolicy:
    """The `auto` policy for this pair, over chain widths and (trees on) tree budgets; acceptance carries over
    from the drafter's previous generation that weighed the same tree budgets. Kept apart per tree budgets: a
    generation with trees off learns nothing of trees or the lookup, and must not make the next one with trees
    on start from nothing there (nor hand it acceptance learnt where the lookup never drafted)."""
    tree_widths = _tree_widths(pair.target, drafter, settings)
    cost = _verify_cost(pair, max((drafter.block_size, *tree_widths)))
    remembered = _recall(_POLICIES, drafter) or {}
    policy = width_policy(drafter.block_size, cost, remembered.get(tree_widths), tree_widths)
    _remember(_POLICIES, drafter, {**remembered, tree_widths: policy})
    return in_lockstep(policy)


def chunks_from_steps(
    tokenizer, steps, stats: GenerationStats, max_tokens: int, start: float, peak_memory_gb
) -> Iterator[GenerationChunk]:
    """Turn the loop's `Step`s into text chunks with running stats (any backend's loop).

    When the consumer stops early (closes this generator, or it is collected),
    `steps` is closed right here, so the loop's caches are tidied at once.
    """
    with closing(steps):
        yield from _chunks(tokenizer, steps, stats, max_tokens, start, peak_memory_gb)


def _chunks(
    tokenizer, steps, stats: GenerationStats, max_tokens: int, start: float, peak_memory_gb
) -> Iterator[GenerationChunk]:
    detok = tokenizer.detokenizer
    detok.reset()
    first_at = start
    for index, step in enumerate(steps):
        now = time.perf_counter()
        new = step.tokens[:-1] if step.stopped else step.tokens
        logprobs = step.logprobs[: len(new)] if step.logprobs is not None else None
        if index == 0:  # the prefill step
            first_at = now
            stats.prefill_tokens = step.prefill_tokens
            stats.ttft_s = now - start
            stats.prefill_tokens_per_second = step.prefill_tokens / max(step.verify_s, 1e-9)
        else:
            stats.target_forwards += 1
            stats.acceptance_lengths.append(len(step.tokens))
            stats.verify_widths.append(step.drafted + 1)
            stats.draft_s += step.draft_s
            stats.verify_s += step.verify_s
            count_round(stats, step)
        stats.tally(stats.generated_tokens + len(new), first_at, now, stopped=step.stopped, max_tokens=max_tokens)
        stats.peak_memory_gb = peak_memory_gb()
        for t in new:
            detok.add_token(t)
        if stats.finish_reason is not None:
            detok.finalize()
        # A snapshot: chunks kept by the caller keep the figures of their moment.
        yield GenerationChunk(detok.last_segment, new, stats.snapshot(), logprobs)
    if stats.finish_reason is None:  # max_tokens == 0
        stats.finish_reason = "length"


def count_round(stats: GenerationStats, step) -> None:
    """A round's tree figures from its `Step`: tokens verified, drafts kept, a tree or a chain, and who proposed
    the accepted path."""
    stats.tokens_verified += step.drafted + 1
    stats.accepted_depths.append(step.accepted)
    stats.tree_rounds += bool(step.tree)
    if step.source:
        stats.accepted_from[step.source] = stats.accepted_from.get(step.source, 0) + 1


def collect(
    chunks: Generator[GenerationChunk, None, None], on_chunk: Callable[[GenerationChunk], bool] | None = None
) -> GenerationResult:
    """The answer a stream of chunks makes. `on_chunk` hears each chunk as it comes; once it returns True the
    stream is closed there, at a round boundary (a `DecodeState` then holds exactly what the target processed),
    and the answer is what came so far."""
    text, ids, stats, logprobs = [], [], GenerationStats(), None
    with closing(chunks):
        for chunk in chunks:
            text.append(chunk.text)
            ids.extend(chunk.token_ids)
            stats = chunk.stats
            if chunk.logprobs is not None:
                logprobs = logprobs if logprobs is not None else []
                logprobs.extend(chunk.logprobs)
            if on_chunk is not None and on_chunk(chunk):
                break
    return GenerationResult("".join(text), ids, stats, logprobs)


def generate(
    pair: GenerationPair, prompt: Prompt, settings: GenerationSettings | None = None, **kwargs
) -> GenerationResult:
    """Generate a whole answer; `settings` and keywords as `stream_generate`."""
    return collect(stream_generate(pair, prompt, settings, **kwargs))


def prompt_logprobs(
    pair: GenerationPair, prompt: Prompt, top: int = 0, chat_template_kwargs: dict | None = None
) -> list[TokenLogprob | None]:
    """The target's log-probability of every token of `prompt` (in any of its three forms) after those before
    it, with the `top` (0..MAX_LOGPROBS) likeliest tokens there; None for the first, which has nothing before
    it. One forward over the prompt on a cache of its own (what `echo` on the server's /v1/completions reports)."""
    if not (isinstance(top, int) and not isinstance(top, bool) and 0 <= top <= MAX_LOGPROBS):
        raise SamplingError("top", f"must be a whole number in [0, {MAX_LOGPROBS}]", top)
    tokens = encode_prompt(pair.tokenizer, prompt, chat_template_kwargs)
    vocab = pair.target.vocab_size
    if any(not 0 <= t < vocab for t in tokens):
        raise GlimmerError(f"prompt token ids must lie in [0, {vocab})")
    return target_prompt_logprobs(pair.target, tokens, top)
