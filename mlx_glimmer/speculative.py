"""The speculative loop: draft a block, verify it in one target pass, keep the agreeing prefix.

Written once for every array library. The loop only knows a `TargetModel` (the
target on one library: MLX's `target.Target`, torch's `TorchTarget`; the
protocol in target_model.py), a `Drafter` (the base class every proposer inherits,
`drafters/base.py`) and `GenerationSettings`; it yields one `Step` per target call and
leaves text, stats and stopping on strings to its callers. With no drafter (or
`block_size` 1) every round is a plain decoding step through the same
sampler: that is the baseline.

Host reads. Each round reads the device once (`TargetModel.read`): the
acceptance verdict and the draft it judged, together. The draft stays on the
device, `[anchor, drafts]` is concatenated there, and on a lazy library (MLX)
the next round (draft and verify) is queued right after that read, before the
round's bookkeeping is handed to the caller, so the host builds graphs while
the device computes. Width-1 rounds (`--block-size auto` falling back to plain)
are queued one ahead, as plain decoding does (`_plain_steps`). A round is
timed as a whole, from one read to the next (`WidthPolicy.observe_round`).

Log-probabilities (`GenerationSettings.logprobs`, `logprobs.py`) ride on the same read: each verify's logits
give, lazily on the device, a table for all its positions (`TreeOps.round_logprobs`), read with the verdict;
with them off nothing more is computed.

A prompt's prefill runs in chunks (`_prefill_chunks`). `prefill` runs one a call, for a caller with other work
to interleave with a long prompt (the server's running batch); `generate_steps` on that state then finds them
there and runs only the rest of the prompt.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Iterator, Sequence

from .block_policy import Shape, WidthPolicy
from .decode_state import DecodeState, Step, resume
from .drafters.base import Drafter
from .drafters.prompt_lookup import Match, PromptLookupDrafter
from .logprobs import logprob_top, one_row_logprobs, path_logprobs, read_one_row, read_table
from .noise import Noise
from .sampling import pick
from .settings import MAX_TREE_NODES, OFF, GenerationSettings, SamplingParams
from .target_model import Array, TargetModel
from .tree import LOOKUP, DraftTree, Path, source_name


def _verdict(target: TargetModel, logits: Array, draft: Array, params: SamplingParams, noise: Noise) -> Array:
    """[accepted drafts, next token] of a chain on the device, not read yet: drafts are kept while they equal
    the target's own choice, its argmax or, sampled, its sample of that position (`noise`: the first's)."""
    ops = target.sampling
    if params.greedy:
        return ops.greedy_verdict(draft, logits)
    return ops.greedy_verdict(draft, ops.gumbel_scores(ops.probabilities(logits, params), noise))


@dataclass
class _Round:
    """One target call queued on the device: what it verifies and what it will return (nothing read yet)."""

    shape: Shape
    draft: DraftTree  # the drafts (a chain is a tree too), on the device
    feats: Array | None  # captured target features [width, k*H]
    verdict: Array  # `tree.verdict`'s form: [depth, next token, path marks, sources]
    draft_s: float  # host seconds spent proposing and launching the draft
    timed: bool  # its time can feed the width policy (the draft did not project a long backlog)
    lookup_offered: int = 0  # nodes of the n-gram continuation it verifies (a tree's branch, or a lookup chain)
    lookup_ngram: int = 0  # the length of the n-gram that continuation matched
    logprobs: Array | None = None  # `TreeOps.round_logprobs` of its verify, when asked
    top: int = 0  # the alternatives per position in `logprobs`

    @property
    def width(self) -> int:
        return self.draft.size + 1

    @property
    def drafts(self) -> bool:
        """The drafter proposed for it (it consumed the drafter's backlog)."""
        return self.shape.width > 1 and not self.shape.lookup


@dataclass
class _Proposers:
    """Who drafts: the drafter, and with trees the n-gram index over the prompt and the answer so far."""

    drafter: Drafter
    lookup: PromptLookupDrafter | None
    depth: int  # the deepest draft the drafter proposes (its block minus the anchor)
    policy: WidthPolicy | None = None  # weighs the lookup's branch against the drafter's nodes
    no_draft: DraftTree | None = None  # a width-1 round's draft (`empty_draft`)

    def lookup_branch(self, anchor: int, budget: int, remaining: int) -> Match:
        """The n-gram continuation after `anchor` for a tree of `budget` nodes (no tokens when nothing matches):
        as long as the width policy's acceptance says it beats the drafter's nodes depth by depth
        (`WidthPolicy.branch_length`); with no policy weighing the lookup (a fixed tree), half the budget."""
        if self.lookup is None:
            return Match([], 0)
        match = self.lookup.indexed_match(anchor, min(budget, remaining - 1))
        if self.policy is None or not self.policy.lookup:
            return Match(match.tokens[: max(1, budget // 2)], match.ngram)
        return Match(match.tokens[: self.policy.branch_length(match.ngram, len(match.tokens), budget)], match.ngram)

    def empty_draft(self, target: TargetModel) -> DraftTree:
        """The draft of a width-1 round, built once a generation: a plain round's graph is its forward and
        its verdict alone."""
        if self.no_draft is None:
            self.no_draft = target.trees.chain(target.tokens([]))
        return self.no_draft


def tree_setting(target: TargetModel, drafter: Drafter | None, settings: GenerationSettings) -> int | str:
    """The tree setting that applies: `settings.tree`, or "off" where nothing drafts, the drafter drafts
    chains only (it has no per-position distributions) or the target cannot verify trees
    (`TargetModel.tree_unsupported`)."""
    if drafter is None or not settings.speculative or not drafter.has_marginals or target.tree_unsupported:
        return OFF
    return settings.tree


def generate_steps(
    target: TargetModel,
    prompt: Sequence[int],
    settings: GenerationSettings = GenerationSettings(),
    *,
    drafter: Drafter | None = None,
    stop_ids: Sequence[int] = (),
    state: DecodeState | None = None,
    policy: WidthPolicy | None = None,
    prefill_step: int = 512,
) -> Iterator[Step]:
    """One `Step` per target call, generating as `settings` say. With a drafter (and `settings.speculative`)
    the verify width (drafts + anchor) is `settings.block_size`, or under "auto" the drafter's block size; with
    a `policy` (`block_policy.WidthPolicy`) each round's width is the policy's choice, and width 1 is a plain
    step (no drafter call). `settings.tree` N verifies a draft tree of N nodes every round instead, where the
    drafter has per-position distributions (`Drafter.marginals`). Without a drafter every step is a plain one."""
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    prompt = list(prompt)
    drafter = drafter if settings.speculative else None
    block_size = _block_size(drafter, settings)
    trees = tree_setting(target, drafter, settings) != OFF
    params, max_tokens = settings.sampling, settings.max_tokens
    stop = set(int(t) for t in stop_ids)
    state = state if state is not None else DecodeState()
    done = _open(target, prompt, settings, drafter, state, policy)
    state.owner = owner = object()
    state.reused_tokens = done
    noise = Noise(settings.seed, len(prompt))  # the first token's: it sits at index len(prompt)
    memory = target.memory
    top = logprob_top(target, settings)

    # Prefill the prompt tokens not yet in the cache, in chunks; logits for the last position only (the last
    # chunk is queued, not finished: the first token's read finishes it).
    tic = time.perf_counter()
    todo = prompt[done:]
    for hidden in _prefill_chunks(target, state, todo, drafter, prefill_step):
        pass
    logits = target.head(hidden[-1:])
    verdict = _verdict(target, logits, target.tokens([]), params, noise)
    values = target.read(verdict, one_row_logprobs(target, logits, verdict[1:2], top))
    first = values[1]
    memory.clear()
    step = Step(
        [first],
        prefill_tokens=len(todo),
        verify_s=time.perf_counter() - tic,
        stopped=first in stop,
        logprobs=read_one_row(values[2:], first, top),
    )
    yield step
    if step.stopped or max_tokens == 1:
        return
    if drafter is None:
        yield from _plain_steps(target, state, owner, first, params, noise.at(1), max_tokens - 1, stop, top)
        return
    lookup = None
    if trees:
        lookup = PromptLookupDrafter(draft_k=MAX_TREE_NODES, min_ngram=1)
        lookup.observe(prompt, None)
    settings = settings.with_verify_width(block_size)
    proposers = _Proposers(drafter, lookup, drafter.block_size - 1 if trees else 0, policy)
    yield from _speculative_steps(target, state, owner, proposers, first, settings, noise, stop, policy)


def prefill(
    target: TargetModel,
    prompt: Sequence[int],
    settings: GenerationSettings = GenerationSettings(),
    *,
    drafter: Drafter | None = None,
    state: DecodeState,
    policy: WidthPolicy | None = None,
    step: int = 512,
) -> Iterator[int]:
    """Prefill `state` with `prompt` in whole chunks of `step` tokens, one per next() (each computed before
    next() returns), as `generate_steps` with the same arguments would (the same cache and drafter context),
    leaving the last 1 to `step` tokens: that call then finds the chunks in `state` and runs the rest in one
    forward with the first token. Yields how many tokens the chunks still to come will run (0 after the last).
    For a caller with other work to interleave with a long prompt's prefill (a server's running batch)."""
    prompt = list(prompt)
    drafter = drafter if settings.speculative else None
    done = _open(target, prompt, settings, drafter, state, policy)
    chunks = (len(prompt) - done - 1) // step
    for i, hidden in enumerate(_prefill_chunks(target, state, prompt[done : done + chunks * step], drafter, step)):
        target.sync(hidden, cache=state.cache)
        yield (chunks - 1 - i) * step


def _block_size(drafter: Drafter | None, settings: GenerationSettings) -> int:
    """The widest chain verify (drafts + anchor): 1 without a drafter; under "auto" the drafter's block."""
    return 1 if drafter is None else drafter.block_size if settings.auto else settings.block_size


def _open(
    target: TargetModel,
    prompt: list[int],
    settings: GenerationSettings,
    drafter: Drafter | None,
    state: DecodeState,
    policy: WidthPolicy | None,
) -> int:
    """Ready `state` for generating after `prompt` (`drafter`: None unless speculative): the target captures
    what the drafter reads, and the cache keeps room to roll back the widest verify the generation may run
    (`_resume`). Returns how many prompt tokens the cache already holds."""
    tree = tree_setting(target, drafter, settings)
    offered = policy.shapes() if policy is not None else []  # the widest verify the cache must roll back
    widest = max(_block_size(drafter, settings), tree + 1 if isinstance(tree, int) else 1, *(s.width for s in offered))
    if drafter is not None:
        target.capture(drafter.target_layer_ids)
    return resume(state, target, prompt, drafter, widest)


def _prefill_chunks(
    target: TargetModel, state: DecodeState, tokens: Sequence[int], drafter: Drafter | None, step: int
) -> Iterator[Array]:
    """Run `tokens` through the target into `state` (its cache, `processed` and the drafter's context), `step`
    tokens per next(), yielding each chunk's final hidden states [L, H], queued. The drafter's context of a
    chunk is computed with it (`settle`), so the prompt's features are not kept and round 1's draft does not
    pay for them; a chunk is finished (and the device's cache cleared) before the next one runs."""
    capture = drafter is not None and bool(drafter.target_layer_ids)
    ids = target.tokens(tokens)
    finishing = None
    for start in range(0, len(tokens), step):
        if finishing is not None:
            target.sync(*finishing, cache=state.cache)
            target.memory.clear()
        chunk = list(tokens[start : start + step])
        hidden, feats = target.forward(ids[start : start + step], state.cache, capture)
        context = []
        if drafter is not None:
            drafter.observe(chunk, feats)
            context = drafter.settle()
        state.processed.extend(chunk)
        target.launch(*context)
        finishing = (feats, *context)
        yield hidden


def _draft(target: TargetModel, proposers: _Proposers, anchor: int, shape: Shape, remaining: int, params, noise):
    """The round's drafts on the device: a tree (the drafter's best prefixes and the lookup's branch) or a
    chain (the drafter's or the lookup's); the chain's draft distributions (None: a tree, or drafted
    deterministically); the lookup's match it holds (no tokens: none)."""
    if shape.lookup:
        match = proposers.lookup.indexed_match(anchor, min(shape.width - 1, remaining - 1))
        return target.trees.chain(target.tokens(match.tokens), LOOKUP), None, match
    if shape.tree:
        budget = shape.width - 1
        match = proposers.lookup_branch(anchor, budget, remaining)
        # A tree of `budget` nodes is at most `budget` deep: a shorter block costs the drafter less.
        marginals = proposers.drafter.marginals(anchor, min(proposers.depth, remaining - 1, budget))
        return target.trees.merged_tree(marginals.log_probs, budget, match.tokens, marginals.vocab), None, match
    draft, draft_probs = proposers.drafter.propose(anchor, shape.width - 1, params, noise)
    return target.trees.chain(target.tokens(draft)), draft_probs, Match([], 0)


def _launch(
    target: TargetModel,
    proposers: _Proposers,
    cache,
    capture: bool,
    params: SamplingParams,
    noise: Noise,
    anchor: int | None,
    anchor_ids: Array,
    shape: Shape,
    block_size: int,
    remaining: int,
    top: int | None = None,
) -> _Round:
    """Queue one round: propose (width > 1), then the verify of [anchor, drafts] and its verdict. `noise`: the
    sampling noise of the round's first new token (the draft's and the verdict's: a drafter that samples its
    draft with it proposes what the target samples wherever their distributions agree); `remaining`: tokens still to generate; `top`: the
    alternatives of each committed token's log-probability (None: none computed)."""
    tic = time.perf_counter()
    draft, draft_probs, timed, match = proposers.empty_draft(target), None, True, Match([], 0)
    inputs = anchor_ids
    if shape.width > 1 and remaining > 1:
        # A long backlog (a prompt's features the drafter could not settle during the prefill) makes
        # this round's time unrepresentative: the policy then learns only its acceptance.
        timed = shape.lookup or proposers.drafter.backlog <= block_size
        # A drafter may offer fewer tokens than asked (adaptive k, no n-gram match).
        draft, draft_probs, match = _draft(target, proposers, anchor, shape, remaining, params, noise)
        target.launch(draft.tokens, draft_probs)
        inputs = target.join(anchor_ids, draft.tokens)
    draft_s = time.perf_counter() - tic
    hidden, feats = target.forward(inputs, cache, capture, None if draft.chain else draft)
    logits = target.head(hidden)
    if draft.chain:
        # Judged along the chain, as plain decoding judges its one token: no ancestor matrix, no tree walk.
        judged = _verdict(target, logits, draft.tokens, params, noise)
        verdict = target.trees.chain_verdict(draft, judged)
    else:
        verdict = target.trees.verdict(draft, logits, params, noise)
    logprobs = None if top is None else target.trees.round_logprobs(logits, draft, verdict, top)
    target.launch(verdict, logprobs)
    return _Round(shape, draft, feats, verdict, draft_s, timed, len(match.tokens), match.ngram, logprobs, top or 0)


def _commit(
    target: TargetModel, state: DecodeState, proposers: _Proposers, rnd: _Round, anchor: int, values: list, stop: set
) -> tuple[Step, Path]:
    """The step a read round commits (`values`: its verdict, then its drafts, then its log-probability table
    if it has one), up to the first stop token, and the accepted path. The target processed [anchor] +
    drafts; the accepted path's first len(committed) positions stay in its cache, in order, and the rest goes;
    that much is what the drafters observe and `state.processed` gains."""
    size = rnd.draft.size
    path = target.trees.read_path(values, size)
    drafts = values[3 + 2 * size : 3 + 3 * size]
    committed = [drafts[i - 1] for i in path.positions[1:]] + [path.next_token]
    stopped = False
    for i, t in enumerate(committed):
        if t in stop:
            committed, stopped = committed[: i + 1], True
            break
    m = len(committed)
    kept = path.positions[:m]
    target.keep(state.cache, kept, rnd.width)  # never with a round queued behind this one: that only follows width 1
    processed = [anchor] + committed[:-1]
    feats = rnd.feats
    if feats is not None:
        feats = feats[:m] if kept[-1] == m - 1 else feats[target.tokens(kept)]
    proposers.drafter.observe(processed, feats)
    if proposers.lookup is not None:
        proposers.lookup.observe(processed, None)
    state.processed.extend(processed)
    logprobs = None
    if rnd.logprobs is not None:
        table = read_table(values[3 + 3 * size :], size + 1, rnd.width, rnd.top)
        logprobs = path_logprobs(table, path.positions, committed)
    step = Step(
        committed,
        drafted=size,
        accepted=m - 1,
        tree=rnd.shape.tree,
        source=source_name(path.sources[m - 2]) if m > 1 else "",
        draft_s=rnd.draft_s,
        stopped=stopped,
        logprobs=logprobs,
    )
    return step, path


def _shape_chooser(settings: GenerationSettings, proposers: _Proposers, policy: WidthPolicy | None):
    """(context, tokens generated, anchor) -> the next round's `Shape`: a fixed tree, the policy's choice, or a
    chain of `settings.block_size` (a number here), never wider than the tokens still to generate. With the
    anchor known, the policy also weighs the n-gram lookup's continuation after it; a round planned before
    its anchor is read gets None (decide after the read) where that continuation could beat a plain step,
    so a plain streak still notices when the text starts repeating its context."""
    fixed_tree = Shape(settings.tree + 1, tree=True) if proposers.lookup and isinstance(settings.tree, int) else None
    lookup_cap = policy.lookup_size if policy is not None else 0

    def shape_for(context: int, generated: int, anchor: int | None = None) -> Shape | None:
        left = settings.max_tokens - generated
        if fixed_tree is not None:
            return fixed_tree if left > 1 else Shape(1)
        if policy is None:
            return Shape(min(settings.block_size, left))
        if lookup_cap and anchor is None and left > 1 and policy.lookup_may_pay(context):
            return None
        match = Match([], 0)
        if lookup_cap and anchor is not None and left > 1:
            match = proposers.lookup.indexed_match(anchor, min(lookup_cap, left - 1))
        shape = policy.choose(context, len(match.tokens), match.ngram)
        if shape.tree:
            return shape if left > 1 else Shape(1)
        return replace(shape, width=min(shape.width, left))

    return shape_for


def _observe(policy: WidthPolicy, rnd: _Round, path: Path, context: int, seconds: float) -> None:
    """Tell the width policy what a read round kept and took (`WidthPolicy.observe_round`)."""
    policy.observe_round(
        rnd.shape,
        path.depth,
        context,
        seconds,
        rnd.timed,
        lookup_offered=rnd.lookup_offered,
        lookup_kept=path.lookup_kept,
        lookup_ngram=rnd.lookup_ngram,
        chain_depth=path.chain_depth,
        chain_kept=path.chain_kept,
    )


def _speculative_steps(
    target: TargetModel,
    state: DecodeState,
    owner,
    proposers: _Proposers,
    anchor: int,
    settings: GenerationSettings,
    noise: Noise,
    stop: set,
    policy: WidthPolicy | None,
) -> Iterator[Step]:
    """The rounds after the first token: one host read each, the next round queued before the caller sees
    this one (on a lazy library), width-1 rounds queued one ahead. `noise` is the first token's: a round
    after n generated tokens samples with `noise.at(n)`. `state.ahead` counts the cache entries of
    queued rounds, undone when this generator is closed (or by the next generation on the state).
    `settings.block_size` is the widest chain verify, a number."""
    cache, params, max_tokens, block_size = state.cache, settings.sampling, settings.max_tokens, settings.block_size
    drafter = proposers.drafter
    capture = bool(drafter.target_layer_ids)
    shape_for, generated = _shape_chooser(settings, proposers, policy), 1
    top = logprob_top(target, settings)

    def launch(anchor: int | None, anchor_ids: Array, shape: Shape, committed: int) -> _Round:
        rnd = _launch(
            target, proposers, cache, capture, params, noise.at(committed), anchor, anchor_ids, shape, block_size,
            max_tokens - committed, top,
        )  # fmt: skip
        state.ahead += rnd.width  # its forward sits in the cache past `state.processed`
        return rnd

    queued: _Round | None = None  # the next round, already on the device
    planned: Shape | None = None  # the next round's shape, chosen before this round was read
    last_read = time.perf_counter()
    try:
        while generated < max_tokens:
            context = len(state.processed) + 1  # positions the current round's anchor sits after, plus one
            if queued is None:
                shape = planned if planned is not None else shape_for(context, generated, anchor)
                planned = None
                queued = launch(anchor, target.tokens([anchor]), shape, generated)
            rnd, queued = queued, None
            if rnd.width == 1 and generated + 1 < max_tokens:
                # Plain round: choose the next shape now; if it is plain too, queue its forward on this
                # round's (unread) token before reading, as `_plain_steps` does.
                planned = shape_for(context + 1, generated + 1)
                if planned is not None and planned.width == 1:
                    planned = None
                    queued = launch(None, rnd.verdict[1:2], Shape(1), generated + 1)
            values = target.read(rnd.verdict, rnd.draft.tokens, rnd.logprobs)
            now = time.perf_counter()
            step, path = _commit(target, state, proposers, rnd, anchor, values, stop)
            state.ahead = queued.width if queued is not None else 0
            if policy is not None:
                _observe(policy, rnd, path, context, now - last_read)
            step.verify_s, last_read = max(now - last_read - rnd.draft_s, 0.0), now
            committed = step.tokens
            target.memory.tick(generated, generated + len(committed))
            generated += len(committed)
            anchor = committed[-1]
            if not step.stopped and generated < max_tokens and queued is None and target.lazy:
                # Queue the next round before handing this one over. Only where work is lazy: torch computes a
                # draft the moment it is asked for, and its drafter could then no longer roll this round back.
                shape = planned if planned is not None else shape_for(len(state.processed) + 1, generated, anchor)
                planned = None
                queued = launch(anchor, target.tokens([anchor]), shape, generated)
            if (queued is None or not queued.drafts) and drafter.backlog >= block_size:
                target.launch(*drafter.settle())  # plain rounds: project their context in batches, off the read
            yield step
            if step.stopped:
                return
    finally:
        if state.owner is owner and state.ahead:  # queued rounds' forwards ran ahead: undo them
            if queued is not None:
                target.sync(queued.verdict)
            target.trim(cache, state.ahead)
            state.ahead = 0


def _next_token(
    target: TargetModel, cache, token: Array, params: SamplingParams, noise: Noise, top: int | None = None
) -> tuple[Array, Array | None]:
    """Run one token through the target and pick the next one, lazily where the library is lazy; with `top`,
    the picked token's log-probability table too (`one_row_logprobs`)."""
    hidden, _ = target.forward(token, cache, capture=False)
    logits = target.head(hidden[-1:])
    picked = pick(target, logits, params, noise)[0]
    return picked, one_row_logprobs(target, logits, picked, top)


def _plain_steps(
    target: TargetModel,
    state: DecodeState,
    owner,
    anchor: int,
    params,
    noise: Noise,
    budget: int,
    stop: set,
    top: int | None = None,
) -> Iterator[Step]:
    """Plain decoding, pipelined as mlx-lm does it: the forward for token i + 1 is queued
    before token i is read back, so Python overhead overlaps the computation.

    The queued forward means the cache may hold one token more than was committed
    (`state.ahead`). It is undone when this generator is closed (callers close it
    explicitly when they stop early) or, if a caller never closes it, by the next
    generation on the same state; a generator that no longer owns the state
    leaves it alone, so a late garbage collection cannot undo another turn's work.
    """
    cache = state.cache
    tic = time.perf_counter()
    nxt, nxt_logprobs = _next_token(target, cache, target.tokens([anchor]), params, noise, top)
    state.processed.append(anchor)
    target.launch(nxt, nxt_logprobs)
    try:
        for i in range(budget):
            ahead = ahead_logprobs = None
            if i + 1 < budget:
                ahead, ahead_logprobs = _next_token(target, cache, nxt, params, noise.at(i + 1), top)
                target.launch(ahead, ahead_logprobs)
            values = target.read(nxt, nxt_logprobs)
            token = values[0]
            if ahead is not None:
                state.ahead = 1  # `token` is in the cache, not yet committed to `processed`
            now = time.perf_counter()
            stopped = token in stop
            target.memory.tick(i, i + 1)
            yield Step([token], verify_s=now - tic, stopped=stopped, logprobs=read_one_row(values[1:], token, top))
            tic = now
            if stopped:
                return
            if ahead is not None:
                state.processed.append(token)
                state.ahead = 0
            nxt, nxt_logprobs = ahead, ahead_logprobs
    finally:
        if state.owner is owner and state.ahead:  # the forward of the last committed token ran ahead: undo it
            target.sync(nxt)
            target.trim(cache, state.ahead)
            state.ahead = 0
