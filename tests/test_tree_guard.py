"""Draft trees run only on a target that verifies them at the right positions.

A tree verify gives each node the anchor's position plus its depth through the RoPE modules at
`self_attn.rope` (MLX) or `position_ids` (torch). A target whose attention rotates some other way verifies
chains only, and says why in one line; one whose small tree verify at load disagrees with chains of the same
tokens turns trees off the same way (`tree_check.py`). Either way its output is its plain greedy decoding.
"""

import dataclasses
import functools

import mlx.core as mx
import mlx.nn as nn
import mlx_lm.models.llama as mlx_llama
import pytest
from oracle_drafter import OracleDrafter

import mlx_glimmer
from mlx_glimmer.generate import calibrate
from mlx_glimmer.settings import GenerationSettings
from mlx_glimmer.speculative import generate_steps

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = [256] + list(b"Once upon a time")
TREE = GenerationSettings(max_tokens=40, tree=15)


def tokens_of(steps) -> list[int]:
    return [t for s in steps for t in s.tokens]


def plain_greedy(target) -> list[int]:
    return tokens_of(generate_steps(target, PROMPT, GenerationSettings(max_tokens=40)))


def tree_generation(pair):
    return list(generate_steps(pair.target, PROMPT, TREE, drafter=pair.drafter))


def announced(pair) -> list[str]:
    """The lines the CLI, the chat and the server show after loading (`generate.calibrate`) that are about
    draft trees."""
    lines = []
    calibrate(pair, TREE, lines.append)
    return [line for line in lines if "tree" in line]


class FirstOffset:
    """A cache as a fused RoPE kernel sees it: one offset for all the tokens of a forward (the first one's)."""

    def __init__(self, cache):
        self.cache = cache

    @property
    def offset(self):
        offset = self.cache.offset
        return offset[0] if isinstance(offset, mx.array) and offset.ndim else offset

    def __getattr__(self, name):
        return getattr(self.cache, name)


@pytest.fixture
def rope_as_a_function(monkeypatch):
    """mlx-lm's llama attention rotating through a plain function at `self_attn.rope`, not a RoPE module."""
    original = mlx_llama.Attention.__init__

    def init(self, args):
        original(self, args)
        rope = self.pop("rope")
        self.rope = functools.partial(
            mx.fast.rope, dims=rope.dims, traditional=rope.traditional, base=rope.base, scale=rope.scale
        )

    monkeypatch.setattr(mlx_llama.Attention, "__init__", init)


@pytest.fixture
def one_offset_rope(monkeypatch):
    """mlx-lm's llama attention rotating its tokens from one cache offset, as a fused kernel would."""
    original = mlx_llama.Attention.__call__

    def call(self, x, mask=None, cache=None):
        return original(self, x, mask, FirstOffset(cache) if cache is not None else None)

    monkeypatch.setattr(mlx_llama.Attention, "__call__", call)


class ScalarOffsetRoPE(nn.RoPE):
    """A RoPE module that takes one offset for all its tokens, and refuses more."""

    def __call__(self, x, offset=0):
        if isinstance(offset, mx.array) and offset.size > 1:
            raise ValueError("[rope] one offset only")
        return super().__call__(x, offset=offset)


@pytest.fixture
def scalar_offset_rope(monkeypatch):
    original = mlx_llama.Attention.__init__

    def init(self, args):
        original(self, args)
        self.rope = ScalarOffsetRoPE(self.rope.dims, self.rope.traditional, self.rope.base, self.rope.scale)

    monkeypatch.setattr(mlx_llama.Attention, "__init__", init)


def test_a_target_without_the_rope_seam_verifies_chains_and_says_why_once(checkpoints, rope_as_a_function):
    pair = mlx_glimmer.load(target=checkpoints["llama"], drafter=checkpoints["llama_assistant"])
    assert "self_attn.rope" in pair.target.tree_unsupported
    assert announced(pair) == [f"draft trees off, chains only: {pair.target.tree_unsupported}"]
    steps = tree_generation(pair)
    assert not any(s.tree for s in steps) and max(s.drafted for s in steps) > 1
    assert tokens_of(steps) == plain_greedy(pair.target)


def test_a_target_whose_tree_verify_disagrees_at_load_verifies_chains_with_a_warning(checkpoints, one_offset_rope):
    pair = mlx_glimmer.load(target=checkpoints["llama"], drafter=checkpoints["llama_assistant"])
    assert pair.target.tree_unsupported.startswith("a tree verify at load disagreed with chains")
    assert announced(pair) == [f"draft trees off, chains only: {pair.target.tree_unsupported}"]
    steps = tree_generation(pair)
    assert not any(s.tree for s in steps) and max(s.drafted for s in steps) > 1
    assert tokens_of(steps) == plain_greedy(pair.target)


def test_a_tree_verify_that_fails_at_load_turns_trees_off_instead_of_failing_the_load(checkpoints, scalar_offset_rope):
    pair = mlx_glimmer.load(target=checkpoints["llama"], drafter=checkpoints["llama_assistant"])
    assert pair.target.tree_unsupported == "a tree verify at load failed (ValueError: [rope] one offset only)"
    steps = tree_generation(pair)
    assert not any(s.tree for s in steps)
    assert tokens_of(steps) == plain_greedy(pair.target)


def test_a_tree_asked_of_a_chain_drafter_is_announced_as_chains(muse_pair):
    chains_only = dataclasses.replace(muse_pair, drafter=OracleDrafter(3, [5] * 40, set(), muse_pair.target.vocab_size))
    assert announced(chains_only) == [
        "draft trees off, chains only: the oracle drafter proposes chains only (no per-position distributions)"
    ]
    lines = []
    calibrate(chains_only, GenerationSettings(max_tokens=40), lines.append)  # trees "auto": nothing to say
    assert not [line for line in lines if "tree" in line]


@pytest.mark.parametrize("name", ["muse_pair", "llama_pair"])
def test_a_target_whose_tree_verify_agrees_keeps_trees(request, name):
    pair = request.getfixturevalue(name)
    assert pair.target.tree_unsupported is None
    assert announced(pair) == []
    steps = tree_generation(pair)
    assert sum(s.tree for s in steps) > 3
    assert tokens_of(steps) == plain_greedy(pair.target)


def test_pairs_that_never_draft_trees_skip_the_check(checkpoints, one_offset_rope):
    """Plain decoding, and prompt lookup alone (chains only): nothing to check; asked for a tree, the lookup says
    it drafts chains."""
    plain = mlx_glimmer.load(target=checkpoints["llama"], use_drafter=False)
    lookup = mlx_glimmer.load(target=checkpoints["llama"], prompt_lookup=True)
    assert plain.target.tree_unsupported is None and lookup.target.tree_unsupported is None
    assert announced(plain) == []
    assert announced(lookup) == [
        "draft trees off, chains only: the prompt-lookup drafter proposes chains only (no per-position distributions)"
    ]


@pytest.fixture
def positions_ignored(monkeypatch):
    """transformers' llama decoder dropping the `position_ids` it is given (each token then sits at its index)."""
    from transformers.models.llama import modeling_llama

    original = modeling_llama.LlamaModel.forward

    @functools.wraps(original)
    def forward(self, *args, position_ids=None, **kwargs):
        return original(self, *args, **kwargs)

    monkeypatch.setattr(modeling_llama.LlamaModel, "forward", forward)


def test_torch_keeps_trees_where_its_tree_verify_agrees(checkpoints):
    from mlx_glimmer.torch_backend import load_torch

    pair = load_torch(target=checkpoints["llama"], drafter=checkpoints["llama_assistant"], device="cpu")
    assert pair.target.tree_unsupported is None
    steps = tree_generation(pair)
    assert sum(s.tree for s in steps) > 3
    assert tokens_of(steps) == plain_greedy(pair.target)


def test_torch_turns_trees_off_where_its_tree_verify_disagrees(checkpoints, positions_ignored):
    from mlx_glimmer.torch_backend import load_torch

    pair = load_torch(target=checkpoints["llama"], drafter=checkpoints["llama_assistant"], device="cpu")
    assert pair.target.tree_unsupported.startswith("a tree verify at load disagreed with chains")
    steps = tree_generation(pair)
    assert not any(s.tree for s in steps) and max(s.drafted for s in steps) > 1
    assert tokens_of(steps) == plain_greedy(pair.target)
