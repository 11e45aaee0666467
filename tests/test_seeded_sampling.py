"""A seed's sampled text is the target's own, whatever the drafts: every token is the sample of its position
(`noise.py`), so speculative decoding with any widths, chains or trees, chosen in any order, gives the text
plain decoding gives at that seed; the same seed repeats it and another seed gives another text."""

import pytest
from oracle_drafter import AlwaysPlain

import mlx_glimmer
from mlx_glimmer.block_policy import Shape
from mlx_glimmer.settings import GenerationSettings, SamplingParams
from mlx_glimmer.speculative import generate_steps

PROMPT = [256] + list(b"Once upon a time, far past the window")
SAMPLED = SamplingParams(temperature=0.9, top_k=40)
N_TOKENS = 48


class ScriptedShapes(AlwaysPlain):
    """A width policy whose rounds take `shapes` in turn, whatever it observes."""

    def __init__(self, shapes: list[Shape]):
        self.script, self.turn = shapes, 0

    def choose(self, context, found=0, ngram=0):
        self.turn += 1
        return self.script[(self.turn - 1) % len(self.script)]

    def shapes(self):
        return self.script


def text(pair, settings, policy=None):
    steps = list(generate_steps(pair.target, PROMPT, settings, drafter=pair.drafter, policy=policy))
    return [t for s in steps for t in s.tokens], steps


@pytest.fixture(scope="module")
def plain(muse_pair):
    return text(muse_pair, GenerationSettings(SAMPLED, max_tokens=N_TOKENS, seed=7, speculative=False))[0]


def test_the_same_seed_gives_the_same_text_and_another_seed_another(muse_pair):
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    once, again, other = (
        mlx_glimmer.generate(muse_pair, messages, max_tokens=N_TOKENS, temperature=0.9, seed=seed) for seed in (7, 7, 8)
    )
    assert once.token_ids == again.token_ids and len(once.token_ids) == N_TOKENS
    assert other.token_ids != once.token_ids


@pytest.mark.parametrize("block_size", [2, 4])
def test_fixed_widths_give_plain_decodings_text_at_the_seed(muse_pair, plain, block_size):
    settings = GenerationSettings(SAMPLED, max_tokens=N_TOKENS, seed=7, block_size=block_size, tree="off")
    tokens, steps = text(muse_pair, settings)
    assert tokens == plain
    assert any(s.accepted for s in steps[1:])  # some drafts were kept, some not
    assert any(s.accepted < s.drafted for s in steps[1:])


def test_shapes_chosen_round_by_round_give_plain_decodings_text_at_the_seed(muse_pair, plain):
    script = [Shape(3), Shape(1), Shape(6, tree=True), Shape(4), Shape(2), Shape(8, tree=True), Shape(1)]
    settings = GenerationSettings(SAMPLED, max_tokens=N_TOKENS, seed=7, block_size="auto", tree="auto")
    tokens, steps = text(muse_pair, settings, policy=ScriptedShapes(script))
    assert tokens == plain
    widths = {(s.drafted + 1, s.tree) for s in steps[1:]}
    assert {(1, False), (3, False), (6, True)} <= widths  # chains, plain rounds and trees all ran
    other = [Shape(5), Shape(4, tree=True)]
    assert text(muse_pair, settings, policy=ScriptedShapes(other))[0] == plain
