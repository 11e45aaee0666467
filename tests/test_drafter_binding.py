"""A drafter bound to its target computes in the target's dtype and reads a quantized head by its own rows."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_glimmer.drafters.dflash import DFlashDrafter, load_dflash_model
from mlx_glimmer.loading import load_target
from mlx_glimmer.settings import GenerationSettings, SamplingParams
from mlx_glimmer.speculative import generate_steps
from mlx_glimmer.target import head_weight, make_head, row_projection

PROMPT = [256] + list(b"Once upon a time")


def float_dtypes(model) -> set:
    return {v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)}


def test_a_float16_drafter_beside_a_bfloat16_target_drafts_in_bfloat16(checkpoints):
    target, _ = load_target(checkpoints["muse"])
    target.model.set_dtype(mx.bfloat16)
    model = load_dflash_model(checkpoints["assistant"])
    model.set_dtype(mx.float16)  # what `distill` exports
    assert target.activation_dtype == mx.bfloat16
    drafter = DFlashDrafter(model, target)
    assert float_dtypes(drafter.model) == {mx.bfloat16}
    target.capture(drafter.target_layer_ids)
    drafter.reset()
    hidden, feats = target.forward(target.tokens(PROMPT), target.make_cache(16), True)
    drafter.observe(PROMPT, feats)
    block = drafter.block_hidden(PROMPT[-1], 5)
    logits = drafter.draft_logits(block[1:])
    assert block.dtype == mx.bfloat16 and logits.dtype == mx.bfloat16  # not float32 (bf16 @ fp16 promotes)
    draft, _ = drafter.propose(PROMPT[-1], 5, SamplingParams(), None)
    assert draft.shape == (5,)
    # The pair decodes end to end in that dtype (greedy output is checked in float32 elsewhere: bf16 ties flip).
    steps = list(generate_steps(target, PROMPT, GenerationSettings(max_tokens=12, block_size=4), drafter=drafter))
    assert sum(len(s.tokens) for s in steps) == 12


def test_a_drafter_already_in_the_target_dtype_is_left_alone(checkpoints):
    target, _ = load_target(checkpoints["muse"])
    model = load_dflash_model(checkpoints["assistant"])
    weights = dict(tree_flatten(model.parameters()))
    DFlashDrafter(model, target)
    assert all(v is weights[k] for k, v in tree_flatten(model.parameters()))


@pytest.fixture(scope="module")
def target4(checkpoints):
    target, _ = load_target(checkpoints["muse"])
    nn.quantize(target.model, group_size=32, bits=4)
    mx.eval(target.model.parameters())
    assert isinstance(target.model["lm_head"], nn.QuantizedLinear)
    return target


def test_the_quantized_draft_head_equals_dequantize_then_gather(target4, monkeypatch):
    ids = mx.array([3, 250, 17, 0, 271, 99, 17], dtype=mx.int32)  # any order, repeats allowed
    h = mx.random.normal((5, target4.hidden_size), key=mx.random.key(0))
    reference = make_head(target4.model, lambda x: x @ head_weight(target4)[ids].T)(h)
    mx.eval(reference)

    def whole_head(*args, **kwargs):
        raise AssertionError("the full head was dequantized")

    monkeypatch.setattr(mx, "dequantize", whole_head)
    got = target4.head_rows(ids)(h)
    np.testing.assert_allclose(np.array(got), np.array(reference), rtol=1e-5, atol=1e-5)
    assert got.shape == (5, 7)


def test_a_quantized_tied_embedding_is_gathered_by_rows_too():
    emb = nn.Embedding(300, 64)
    quantized = nn.QuantizedEmbedding.from_embedding(emb, group_size=32, bits=4)
    ids = mx.array([5, 1, 299], dtype=mx.int32)
    h = mx.random.normal((2, 64), key=mx.random.key(1))
    full = mx.dequantize(quantized.weight, quantized.scales, quantized.biases, 32, 4)
    np.testing.assert_allclose(
        np.array(row_projection(quantized, ids)(h)), np.array(h @ full[ids].T), rtol=1e-5, atol=1e-5
    )
