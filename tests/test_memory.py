"""Metal memory settings through one seam (`memory.DeviceMemory`): what a generation asks of it, and no-ops here."""

import itertools

import mlx.core as mx
import pytest
from oracle_drafter import OracleDrafter

import mlx_glimmer
from mlx_glimmer.memory import GIB, NO_MEMORY, DeviceMemory, model_bytes
from mlx_glimmer.settings import GenerationSettings
from mlx_glimmer.speculative import generate_steps

PROMPT = [256] + list(b"Once upon a time")


class FakeMetal:
    """The four MLX memory calls, recorded; a device recommending `bound` bytes as its working set."""

    def __init__(self, bound: int):
        self.bound = bound
        self.wired, self.cache = 0, 10 * GIB
        self.clears = 0

    def device_info(self):
        return {"max_recommended_working_set_size": self.bound, "memory_size": 2 * self.bound}

    def set_wired_limit(self, n):
        old, self.wired = self.wired, n
        return old

    def set_cache_limit(self, n):
        old, self.cache = self.cache, n
        return old

    def clear_cache(self):
        self.clears += 1


@pytest.fixture
def metal(muse_pair, monkeypatch):
    fake = FakeMetal(bound=24 * GIB)
    memory = DeviceMemory(enabled=True, ops=fake)
    monkeypatch.setattr(muse_pair.target, "memory", memory)
    return memory, fake


@pytest.fixture
def stubbed_metal(monkeypatch):
    """MLX's own Metal queries stubbed, by their real names: `monkeypatch.setattr` refuses a name MLX does not
    have, and a misspelt call in memory.py would reach MLX itself and fail, so the Metal-only branches run
    here as they do on a Mac."""
    fake = FakeMetal(bound=24 * GIB)
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    for name in ("device_info", "set_wired_limit", "set_cache_limit", "clear_cache"):
        monkeypatch.setattr(mx, name, getattr(fake, name))
    return fake


def test_without_metal_every_call_is_a_no_op(muse_pair, monkeypatch):
    assert muse_pair.target.memory.enabled == bool(mx.metal.is_available())  # on by itself where Metal is
    monkeypatch.setattr(mx.metal, "is_available", lambda: False)
    for memory in (DeviceMemory(), NO_MEMORY):
        assert memory.enabled is False
        with memory.resident(muse_pair.target.model):
            memory.clear()
            memory.tick(255, 300)
        assert memory.calls == []


def test_with_metal_the_seam_calls_mlx_itself(checkpoints, stubbed_metal):
    """A pair loaded where Metal is available gets a live seam on MLX's own module: a generation wires the
    weights, clears the cache and puts both limits back."""
    pair = mlx_glimmer.load(target=checkpoints["muse"])
    memory = pair.target.memory
    assert memory.enabled is True and memory.ops is mx
    assert memory.limits(GIB) == (2 * GIB, 2 * GIB // 4)
    assert memory.limits(100 * GIB) == (24 * GIB, 24 * GIB // 4)  # the device's recommended working set
    prompt = [256] + list(b"x" * 600)  # 2 prefill chunks: one clear between them
    mlx_glimmer.generate(pair, prompt, max_tokens=8, speculative=False)
    wired = model_bytes(pair.target.model) + GIB
    assert memory.calls[:2] == [("wired", wired), ("cache_limit", wired // 4)]
    assert memory.calls[-1] == ("restore", 0, 10 * GIB) and ("clear",) in memory.calls
    assert (stubbed_metal.wired, stubbed_metal.cache) == (0, 10 * GIB) and stubbed_metal.clears >= 1


def test_limits_are_the_weights_plus_headroom_bounded_by_the_working_set():
    memory = DeviceMemory(enabled=True, ops=FakeMetal(bound=27 * GIB))
    assert memory.limits(17 * GIB) == (17 * GIB + 17 * GIB // 4, (17 * GIB + 17 * GIB // 4) // 4)
    assert memory.limits(100 << 20) == ((100 << 20) + GIB, ((100 << 20) + GIB) // 4)  # at least 1 GiB of room
    assert memory.limits(30 * GIB) == (27 * GIB, 27 * GIB // 4)  # never past the recommended working set


def test_a_generation_wires_its_weights_and_puts_the_limits_back(muse_pair, metal):
    memory, fake = metal
    mlx_glimmer.generate(muse_pair, PROMPT, max_tokens=8, speculative=False)
    wired = model_bytes(muse_pair.target.model) + GIB
    assert memory.calls[:2] == [("wired", wired), ("cache_limit", wired // 4)]
    assert memory.calls[-1] == ("restore", 0, 10 * GIB)
    assert (fake.wired, fake.cache) == (0, 10 * GIB)
    memory.calls.clear()
    mlx_glimmer.generate(muse_pair, PROMPT, max_tokens=8, block_size=4)
    weights = model_bytes(muse_pair.target.model, muse_pair.drafter.model)
    assert memory.calls[0] == ("wired", weights + GIB) and weights > wired - GIB


LONG_PROMPT = [256] + list(b"x" * 1100)  # 3 prefill chunks of 512
# 2 chunks before the last, 1 after the first token, then at 256 and 512 tokens.
CLEARS_IN_600_TOKENS = 2 + 1 + 2


@pytest.fixture(scope="module")
def plain_600(muse_pair):
    """600 tokens of the plain loop after LONG_PROMPT, with the seam on a fake Metal: (tokens, the seam's calls,
    the clears Metal saw)."""
    fake = FakeMetal(bound=24 * GIB)
    memory, before = DeviceMemory(enabled=True, ops=fake), muse_pair.target.memory
    muse_pair.target.memory = memory
    try:
        steps = list(generate_steps(muse_pair.target, LONG_PROMPT, GenerationSettings(max_tokens=600)))
    finally:
        muse_pair.target.memory = before
    return [t for s in steps for t in s.tokens], memory.calls, fake.clears


def test_the_plain_loop_clears_after_prefill_chunks_and_every_256_tokens(plain_600):
    tokens, calls, clears = plain_600
    assert len(tokens) == 600
    assert calls == [("clear",)] * CLEARS_IN_600_TOKENS and clears == CLEARS_IN_600_TOKENS


def test_the_speculative_loop_clears_after_prefill_chunks_and_every_256_tokens(muse_pair, metal, plain_600):
    """Its rounds commit several tokens each (a drafter that knows the answer but for every 7th token)."""
    memory, fake = metal
    plain = plain_600[0]
    drafter = OracleDrafter(len(LONG_PROMPT), plain, {i for i in range(600) if i % 7 == 5}, muse_pair.target.vocab_size)
    steps = list(
        generate_steps(
            muse_pair.target, LONG_PROMPT, GenerationSettings(max_tokens=600, block_size=16), drafter=drafter
        )
    )
    assert [t for s in steps for t in s.tokens] == plain
    ends = set(itertools.accumulate(len(s.tokens) for s in steps))
    assert 256 not in ends and 512 not in ends  # both counts are passed inside a round
    assert memory.calls == [("clear",)] * CLEARS_IN_600_TOKENS and fake.clears == CLEARS_IN_600_TOKENS


def test_streams_that_overlap_share_one_setting(muse_pair, metal):
    memory, fake = metal
    a = mlx_glimmer.stream_generate(muse_pair, PROMPT, max_tokens=20, speculative=False)
    b = mlx_glimmer.stream_generate(muse_pair, PROMPT, max_tokens=20, speculative=False)
    next(a)
    next(b)
    assert fake.wired > 0
    a.close()
    assert fake.wired > 0, "the other stream still runs"
    b.close()
    assert fake.wired == 0 and [c[0] for c in memory.calls].count("wired") == 1
