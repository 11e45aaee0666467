"""Few-row products: 2-3 rows through a float linear layer as (W @ x.T).T, everything else untouched."""

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_glimmer.few_rows import (
    FewRowsEmbedding,
    FewRowsLinear,
    few_rows,
    row_product,
    transposed_product,
    use_few_row_products,
)


def _random(*shape):
    return mx.random.normal(shape, key=mx.random.key(sum(shape)))


@pytest.mark.parametrize("shape", [(2, 48), (3, 48), (1, 2, 48), (1, 3, 48), (3, 1, 48)])
def test_the_transposed_product_is_the_same_product(shape):
    x, w = _random(*shape), _random(80, 48)
    out = transposed_product(x, w)
    assert out.shape == (*shape[:-1], 80)
    assert mx.allclose(out, x @ w.T, atol=1e-4, rtol=1e-4)


def test_only_two_and_three_rows_count_as_few():
    assert [few_rows(mx.zeros((1, n, 8))) for n in range(1, 6)] == [False, True, True, False, False]
    assert few_rows(mx.zeros((3, 1, 8)))  # rows of a batch count too


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_a_few_rows_linear_layer_computes_what_the_plain_layer_does(rows, bias):
    plain = nn.Linear(48, 80, bias=bias)
    few = nn.Linear(48, 80, bias=bias)
    few.update(plain.parameters())
    few.__class__ = FewRowsLinear
    x = _random(1, rows, 48)
    assert mx.allclose(few(x), plain(x), atol=1e-4, rtol=1e-4)
    if rows not in (2, 3):  # the plain layer's own call, bit for bit
        assert mx.array_equal(few(x), plain(x))


def test_a_tied_head_takes_the_few_row_form_and_lookups_stay_lookups():
    plain = nn.Embedding(64, 48)
    few = nn.Embedding(64, 48)
    few.update(plain.parameters())
    few.__class__ = FewRowsEmbedding
    ids = mx.array([[3, 9, 27]])
    assert mx.array_equal(few(ids), plain(ids))
    h = _random(1, 3, 48)
    assert mx.allclose(few.as_linear(h), plain.as_linear(h), atol=1e-4, rtol=1e-4)


def _model():
    return nn.Sequential(nn.Linear(64, 64), nn.QuantizedLinear(64, 64), nn.Embedding(10, 64))


def test_on_the_cpu_float_layers_are_swapped_and_quantized_ones_left_alone():
    model = _model()
    assert use_few_row_products(model, mx.Device(mx.cpu)) == 2
    kinds = [type(m) for m in model.layers]
    assert kinds == [FewRowsLinear, nn.QuantizedLinear, FewRowsEmbedding]
    assert use_few_row_products(model, mx.Device(mx.cpu)) == 0  # already swapped


def test_on_the_gpu_nothing_is_swapped():
    model = _model()
    assert use_few_row_products(model, mx.Device(mx.gpu, 0)) == 0
    assert [type(m) for m in model.layers] == [nn.Linear, nn.QuantizedLinear, nn.Embedding]


def test_a_row_product_agrees_with_the_plain_one_on_either_device():
    x, w = _random(2, 48), _random(80, 48)
    for device in (mx.Device(mx.cpu), mx.Device(mx.gpu, 0)):
        assert mx.allclose(row_product(x, w, device), x @ w.T, atol=1e-4, rtol=1e-4)
