"""Per-round costs that must not grow with the context or the vocabulary, each equal to the simple rule it replaces."""

import random

import mlx.core as mx
import numpy as np
import pytest
from test_host_reads import blocking, per_step  # noqa: F401 (a fixture)

from mlx_glimmer.cpu import chip_name
from mlx_glimmer.drafters.context import ContextCache
from mlx_glimmer.drafters.draft_model import DraftModelDrafter
from mlx_glimmer.drafters.prompt_lookup import PromptLookupDrafter
from mlx_glimmer.sampling import probabilities
from mlx_glimmer.settings import GenerationSettings, SamplingParams
from mlx_glimmer.speculative import generate_steps
from mlx_glimmer.verify_cost import calibration_key, library_version

PROMPT = [256] + list(b"Once upon a time")


def sorted_probabilities(logits: mx.array, params: SamplingParams) -> mx.array:
    """The filters as they were written before: full-vocabulary sort and argsort."""
    logits = logits.astype(mx.float32) / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = mx.sort(logits, axis=-1)[..., vocab - params.top_k][..., None]
        logits = mx.where(logits < kth, -mx.inf, logits)
    probs = mx.softmax(logits, axis=-1)
    if params.top_p < 1.0:
        order = mx.argsort(-probs, axis=-1)
        sorted_probs = mx.take_along_axis(probs, order, axis=-1)
        mass_before = mx.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep = mx.put_along_axis(mx.zeros_like(mass_before < 0), order, mass_before < params.top_p, axis=-1)
        probs = mx.where(keep, probs, 0.0)
        probs = probs / probs.sum(axis=-1, keepdims=True)
    return probs


def test_partitioned_filters_equal_the_sorted_ones_bit_for_bit():
    rng = np.random.default_rng(7)
    for _ in range(120):
        vocab, rows = int(rng.integers(2, 5000)), int(rng.integers(1, 6))
        logits = mx.array((rng.standard_normal((rows, vocab)) * rng.uniform(0.5, 8)).astype(np.float32))
        params = SamplingParams(
            temperature=float(rng.uniform(0.2, 1.5)),
            top_p=float(rng.choice([1.0, rng.uniform(0.05, 0.999)])),
            top_k=int(rng.choice([0, rng.integers(1, vocab + 2)])),
        )
        assert np.array_equal(np.array(probabilities(logits, params)), np.array(sorted_probabilities(logits, params)))


def test_prompt_lookup_index_answers_as_the_scan_does_through_observe_and_rollback():
    rng = random.Random(3)
    for _ in range(400):
        d = PromptLookupDrafter(draft_k=rng.randint(1, 8), max_ngram=rng.randint(1, 4))
        d.min_ngram = rng.randint(1, d.max_ngram)
        vocab, history = rng.randint(2, 5), []
        for _ in range(rng.randint(1, 8)):
            tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 10))]
            d.observe(tokens, None)
            history += tokens
            if history and rng.random() < 0.4:
                n = rng.randint(0, len(history))
                assert d.rollback(n)
                history = history[: len(history) - n]
            anchor, count = rng.randrange(vocab), rng.randint(1, 8)
            assert d.history == history
            assert d.indexed_lookup(anchor, count) == d.lookup(history + [anchor], count)
            assert d.indexed_match(anchor, count) == d.reference_match(history + [anchor], count)
            draft, _ = d.propose(anchor, count, SamplingParams(), None)
            assert draft.tolist() == d.lookup(history + [anchor], min(count, d.draft_k))


class NaiveContext:
    """ContextCache as it was: concatenate every round, slice off the oldest beyond `keep`."""

    def __init__(self, keep):
        self.keep, self.keys, self.first_pos, self.next_pos = keep, None, 0, 0

    def append(self, k):
        self.keys = k if self.keys is None else mx.concatenate([self.keys, k], axis=2)
        self.next_pos += k.shape[2]
        if self.keep is not None and self.keys.shape[2] > self.keep:
            drop = self.keys.shape[2] - self.keep
            self.keys = self.keys[..., drop:, :]
            self.first_pos += drop

    def trim(self, n):
        if n:
            self.keys = self.keys[..., :-n, :]
            self.next_pos -= n


@pytest.mark.parametrize("keep", [None, 9, 73])
def test_the_preallocated_context_holds_what_concatenation_held(keep):
    rng = random.Random(keep or 0)
    cache, naive = ContextCache(keep), NaiveContext(keep)
    cache.step = 16  # grow often
    pos = 0
    for _ in range(150):
        n = rng.choice([1, 1, 2, 5, 16, 40]) if rng.random() > 0.02 else 300
        k = mx.arange(pos, pos + n, dtype=mx.float32).reshape(1, 1, n, 1) * mx.ones((1, 2, 1, 3))
        cache.append(k, -k)
        naive.append(k)
        pos += n
        stored = naive.keys.shape[2]
        if rng.random() < 0.4:
            t = rng.randint(0, min(stored, 6))
            if cache.can_trim(t, None):
                cache.trim(t)
                naive.trim(t)
                pos -= t
        keys, values, first = cache.fetch()
        assert (first, cache.next_pos) == (naive.first_pos, naive.next_pos)
        assert np.array_equal(np.array(keys), np.array(naive.keys)) and np.array_equal(
            np.array(values), -np.array(keys)
        )
        assert cache.keys.shape[2] <= (keep or pos) + 300 + 2 * cache.step


def test_the_classic_drafter_drafts_without_reading_and_its_rounds_read_once(muse_pair, blocking):  # noqa: F811
    plain = [t for s in generate_steps(muse_pair.target, PROMPT, GenerationSettings(max_tokens=50)) for t in s.tokens]
    drafter = DraftModelDrafter(muse_pair.target.model, draft_k=4)  # the target drafts for itself: all accepted
    steps, per = per_step(
        generate_steps(muse_pair.target, PROMPT, GenerationSettings(max_tokens=50, block_size=5), drafter=drafter),
        blocking,
    )
    assert [t for s in steps for t in s.tokens] == plain
    assert all(len(p) == 1 for p in per[1:]), per
    assert [len(s.tokens) for s in steps[1:6]] == [5] * 5
    # The accepted drafts were learnt from the target's answer, so the cache is reused, not recomputed.
    assert drafter.cached[: len(drafter.history)] == drafter.history[: len(drafter.cached)]
    assert -1 not in drafter.cached[: len(drafter.history)]


def test_the_verify_cost_key_names_the_chip_and_the_library_version(muse_pair):
    key = calibration_key(muse_pair.target, "bundle", 1, "Target", "default|")
    assert chip_name() in key and chip_name()
    assert library_version(muse_pair.target) == f"mlx {mx.__version__}" and f"mlx {mx.__version__}" in key
