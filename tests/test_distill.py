"""Distillation: the training forward is the inference forward, training learns, and checkpoints resume."""

import io
import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mlx_glimmer
from mlx_glimmer.distill.evaluate import heldout_acceptance
from mlx_glimmer.distill.features import target_features
from mlx_glimmer.distill.step import TrainConfig
from mlx_glimmer.distill.train import Trainer, block_forward
from mlx_glimmer.drafters.dflash import dflash_target_layer_ids
from mlx_glimmer.errors import GlimmerError
from mlx_glimmer.settings import GenerationSettings
from mlx_glimmer.speculative import generate_steps

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: the torch steps on one thread


def test_dflash_layer_rule_gives_metas_layers_for_52():
    assert dflash_target_layer_ids(52, 5) == [1, 13, 25, 37, 49]
    assert dflash_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]


@pytest.fixture(scope="module")
def records(llama_pair):
    """The tiny target's own greedy answers to a few prompts."""
    out = []
    for i in range(6):
        prompt = [256] + list(f"prompt {i}: tell me".encode())
        ans = [
            t for s in generate_steps(llama_pair.target, prompt, GenerationSettings(max_tokens=48)) for t in s.tokens
        ]
        out.append({"index": i, "tag": "greedy", "prompt_ids": prompt, "response_ids": ans})
    return out


def make_trainer(llama_pair, records, tmp_path, **kw):
    cfg = TrainConfig(
        layers=kw.pop("layers", 1),
        context_layers=3,
        anchors=8,
        steps=kw.pop("steps", 60),
        warmup=5,
        eval_every=10**9,
        checkpoint_every=kw.pop("checkpoint_every", 30),
        learning_rate=3e-3,
        compile=False,
        **kw,
    )
    return Trainer(llama_pair.target, records, cfg, tmp_path / "run", mask_token_id=259)


def test_training_forward_equals_inference_forward(llama_pair, records, tmp_path):
    tr = make_trainer(llama_pair, records, tmp_path)
    seq = records[0]["prompt_ids"] + records[0]["response_ids"]
    feats = target_features(llama_pair.target, seq)
    anchors = [len(records[0]["prompt_ids"]) + k for k in (0, 5, 17)]
    B = tr.config.block_size
    ids = np.full((len(anchors), B), 259)
    ids[:, 0] = [seq[a] for a in anchors]
    noise = tr.embed(mx.array(ids))
    batched = block_forward(tr.model, noise, mx.array(anchors), feats, mx.array(anchors))
    for row, a in enumerate(anchors):
        context = tr.model.make_context()
        tr.model.extend_context(feats[None, :a].astype(mx.float32), context)
        single = tr.model(noise[row : row + 1], a, context)[0]
        np.testing.assert_allclose(np.asarray(batched[row]), np.asarray(single), atol=2e-4)


@pytest.mark.slow  # 200 optimiser steps (the loss is down ~50x by then, acceptance from 1 to ~13 of 16)
def test_training_lowers_the_loss_and_raises_acceptance_on_its_data(llama_pair, records, tmp_path):
    tr = make_trainer(llama_pair, records, tmp_path, steps=200, layers=2)
    prompts = [r["prompt_ids"] for r in records]
    before = heldout_acceptance(llama_pair.target, tr.model, prompts, max_tokens=40).mean
    first = [tr.step_fn.loss(tr.batch(i)) for i in range(len(records))]
    tr.train()
    after_loss = [tr.step_fn.loss(tr.batch(i)) for i in range(len(records))]
    after = heldout_acceptance(llama_pair.target, tr.model, prompts, max_tokens=40).mean
    print(
        f"loss {np.mean(first):.2f} -> {np.mean(after_loss):.2f}; acceptance on training prompts {before:.2f} -> {after:.2f}"
    )
    assert np.mean(after_loss) < 0.7 * np.mean(first)
    assert after > before + 0.3


def test_torch_step_computes_the_mlx_step_loss_and_gradient_direction(llama_pair, records, tmp_path):
    pytest.importorskip("transformers")
    mlx_tr = make_trainer(llama_pair, records, tmp_path / "m", sequences_per_step=3)
    torch_tr = make_trainer(llama_pair, records, tmp_path / "t", sequences_per_step=3, backend="torch")
    torch_tr.step_fn.autocast = False  # float32: the two must agree to rounding
    batch = mlx_tr.batch([0, 2, 5])
    assert batch.valid.sum() > 0 and (batch.valid[:, :, 0] == 0).any() == (len(records[2]["response_ids"]) < 9)
    np.testing.assert_allclose(torch_tr.step_fn.loss(batch), mlx_tr.step_fn.loss(batch), rtol=1e-4)
    for _ in range(3):
        mlx_tr.step_fn(batch)
        torch_tr.step_fn(batch)
    torch_tr.step_fn.sync()
    np.testing.assert_allclose(torch_tr.step_fn.loss(batch), mlx_tr.step_fn.loss(batch), rtol=1e-3)
    moved = {k: v for k, v in tree_flatten(torch_tr.model.parameters())}
    start = dict(tree_flatten(make_trainer(llama_pair, records, tmp_path / "s").model.parameters()))
    assert any(float(mx.abs(moved[k] - start[k]).max()) > 0 for k in start if k != "draft_vocab")


def test_fused_head_loss_equals_the_plain_weighted_cross_entropy_and_its_gradient():
    torch = pytest.importorskip("torch")
    from mlx_glimmer.distill.torch_step import HeadCrossEntropy, head_cross_entropy

    gen = torch.Generator().manual_seed(0)
    h = torch.randn(300, 32, generator=gen, requires_grad=True)
    head = torch.randn(1000, 32, generator=gen)
    labels = torch.randint(0, 1000, (300,), generator=gen)
    weights = torch.rand(300, generator=gen) * (torch.arange(300) % 7 != 0)  # some rows unsupervised
    fused = head_cross_entropy(h, head, labels, weights)  # one chunk at this vocabulary size
    (fused * 2.0).backward()
    grad, h.grad = h.grad.clone(), None
    plain = (torch.nn.functional.cross_entropy(h @ head.T, labels, reduction="none") * weights).sum()
    (plain * 2.0).backward()
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(grad, h.grad, rtol=1e-4, atol=1e-5)
    small = HeadCrossEntropy.apply(h.detach().requires_grad_(), head, labels, weights, 64)  # 5 chunks, last partial
    torch.testing.assert_close(small, plain, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_padding_contexts_to_a_shape_multiple_leaves_the_loss_alone(llama_pair, records, tmp_path, backend):
    if backend == "torch":
        pytest.importorskip("transformers")
    exact, padded = (
        make_trainer(llama_pair, records, tmp_path / str(m), backend=backend, context_multiple=m) for m in (1, 64)
    )
    a, b = exact.batch([0, 3]), padded.batch([0, 3])  # same seed: same anchors
    assert b.ctx.shape[1] % 64 == 0 and b.ctx.shape[1] > a.ctx.shape[1] and (a.anchors == b.anchors).all()
    exact.step_fn.autocast = padded.step_fn.autocast = False  # (torch: float32, to compare to rounding)
    np.testing.assert_allclose(padded.step_fn.loss(b), exact.step_fn.loss(a), rtol=1e-5)


@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_warm_up_runs_every_context_width_once_and_leaves_training_unchanged(llama_pair, records, tmp_path, backend):
    if backend == "torch":
        pytest.importorskip("transformers")
    records = [{**r, "response_ids": r["response_ids"][: 20 + 5 * i]} for i, r in enumerate(records)]  # lengths differ
    warmed, plain = (
        make_trainer(llama_pair, records, tmp_path / n, steps=10, backend=backend, context_multiple=8) for n in "wp"
    )
    widths = sorted({-(-(len(r["prompt_ids"]) + len(r["response_ids"])) // 8) * 8 for r in records})
    assert warmed.warm_up() == widths and len(widths) > 1
    warmed.train()
    plain.train()
    a, b = (dict(tree_flatten(t.model.parameters())) for t in (warmed, plain))
    assert max(float(mx.abs(a[k] - b[k]).max()) for k in a if k != "draft_vocab") == 0.0


@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_checkpoint_resumes_exactly(llama_pair, records, tmp_path, backend):
    if backend == "torch":
        pytest.importorskip("transformers")
    full = make_trainer(llama_pair, records, tmp_path / "a", steps=40, checkpoint_every=20, backend=backend)
    full.train()
    part = make_trainer(llama_pair, records, tmp_path / "b", steps=40, checkpoint_every=20, backend=backend)
    part.train(until=20)  # interrupted after its first checkpoint
    resumed = make_trainer(llama_pair, records, tmp_path / "c", steps=40, checkpoint_every=20, backend=backend)
    assert resumed.resume(tmp_path / "b" / "run" / "checkpoint") and resumed.step == 20
    resumed.train()
    a = dict(mx.load(str(tmp_path / "a" / "run" / "checkpoint" / "model.safetensors")))
    c = dict(mx.load(str(tmp_path / "c" / "run" / "checkpoint" / "model.safetensors")))
    assert max(float(mx.abs(a[k] - c[k]).max()) for k in a if k != "draft_vocab") < 1e-5


class Killed(BaseException):
    """What a kill looks like to the code that was running."""


def test_a_run_killed_while_it_saves_a_checkpoint_resumes_from_the_one_before(llama_pair, records, tmp_path):
    full = make_trainer(llama_pair, records, tmp_path / "a", steps=40, checkpoint_every=20)
    full.train()
    broken = make_trainer(llama_pair, records, tmp_path / "b", steps=40, checkpoint_every=20)

    def dies(path):
        raise Killed  # the step-40 weights are written; the optimizer and step are not

    broken.train(until=20)
    broken.step_fn.save_optimizer = dies
    with pytest.raises(Killed):
        broken.train()
    run = tmp_path / "b" / "run"
    resumed = make_trainer(llama_pair, records, tmp_path / "b", steps=40, checkpoint_every=20)
    assert resumed.resume(run / "checkpoint") and resumed.step == 20
    resumed.train()
    a = dict(mx.load(str(tmp_path / "a" / "run" / "checkpoint" / "model.safetensors")))
    b = dict(mx.load(str(run / "checkpoint" / "model.safetensors")))
    assert max(float(mx.abs(a[k] - b[k]).max()) for k in a if k != "draft_vocab") < 1e-5
    assert not [p.name for p in run.iterdir() if p.name.startswith(".")]


def test_a_checkpoint_a_kill_left_aside_is_resumed_and_the_leftovers_go_at_the_next_save(llama_pair, records, tmp_path):
    make_trainer(llama_pair, records, tmp_path, steps=40, checkpoint_every=20).train(until=20)
    run = tmp_path / "run"
    (run / "checkpoint").rename(run / ".checkpoint.0123abcd.old")  # killed between the save's two renames...
    (run / ".checkpoint.4567cdef.partial").mkdir()  # ...and, at an earlier save, while writing
    (run / ".checkpoint.4567cdef.partial" / "model.safetensors").write_bytes(b"cut")
    resumed = make_trainer(llama_pair, records, tmp_path, steps=40, checkpoint_every=20)
    assert resumed.resume(run / "checkpoint") and resumed.step == 20
    resumed.train()
    assert json.loads((run / "checkpoint" / "trainer.json").read_text())["step"] == 40
    assert not [p.name for p in run.iterdir() if p.name.startswith(".")]


def test_a_run_resumed_with_other_steps_goes_on_and_says_where_its_learning_rate_moved(llama_pair, records, tmp_path):
    make_trainer(llama_pair, records, tmp_path, steps=40, checkpoint_every=20).train(until=20)
    checkpoint = tmp_path / "run" / "checkpoint"
    same, longer = (make_trainer(llama_pair, records, tmp_path, steps=steps) for steps in (40, 80))
    same.log, longer.log = io.StringIO(), io.StringIO()
    assert same.resume(checkpoint) and same.log.getvalue() == ""
    assert longer.resume(checkpoint) and longer.step == 20
    assert "this run began with --steps 40; the learning rate now follows --steps 80" in longer.log.getvalue()


def test_a_shallower_drafter_grows_by_identity_layers_and_drafts_as_before(llama_pair, records, tmp_path):
    small = make_trainer(llama_pair, records, tmp_path / "small", steps=3)
    small.train()
    small.save(tmp_path / "one_layer")
    grown = make_trainer(llama_pair, records, tmp_path / "grown", layers=3, init=str(tmp_path / "one_layer"))
    batch = small.batch([0, 1])
    assert len(grown.model.layers) == 3
    np.testing.assert_allclose(grown.step_fn.loss(batch), small.step_fn.loss(batch), rtol=1e-5)
    for _ in range(2):  # (the first step's warm-up learning rate is 0)
        grown.step_fn(batch)  # the added layers learn from there
    assert float(mx.abs(grown.model.layers[2].mlp.down_proj.weight).max()) > 0


def test_a_drafter_that_does_not_fit_is_one_clear_error(llama_pair, records, tmp_path):
    deeper = make_trainer(llama_pair, records, tmp_path / "deep", layers=2)
    deeper.save(tmp_path / "two_layers")
    with pytest.raises(GlimmerError, match="2 layers, more than --layers 1"):
        make_trainer(llama_pair, records, tmp_path / "a", layers=1, init=str(tmp_path / "two_layers"))
    weights = dict(mx.load(str(tmp_path / "two_layers" / "model.safetensors")))
    weights["encoder.fc.weight"] = weights["encoder.fc.weight"][:, :8]
    mx.save_safetensors(str(tmp_path / "two_layers" / "model.safetensors"), weights)
    with pytest.raises(GlimmerError, match="do not fit this drafter .*encoder.fc.weight"):
        make_trainer(llama_pair, records, tmp_path / "b", layers=2, init=str(tmp_path / "two_layers"))


def test_a_drafter_started_from_the_target_holds_the_named_layers_and_decodes_losslessly(llama_pair, records, tmp_path):
    tr = make_trainer(llama_pair, records, tmp_path, layers=3, init="target:4,5", steps=0)
    target_layers = llama_pair.target.model.model.layers
    for j, source in enumerate([4, 5]):
        copied = dict(tree_flatten(target_layers[source].parameters()))
        for name, value in tree_flatten(tr.model.layers[j].parameters()):
            if name.startswith(("self_attn.q_norm", "self_attn.k_norm")):
                assert mx.array_equal(value, mx.ones_like(value)), name
            else:
                assert mx.array_equal(value, copied[name].astype(mx.float32)), name
    grown = tr.model.layers[2]  # past the list: an identity layer
    assert not mx.any(grown.self_attn.o_proj.weight).item() and not mx.any(grown.mlp.down_proj.weight).item()
    H = llama_pair.target.hidden_size
    fc = tr.model.encoder.fc.weight  # captured layers ascend: the deepest is the last slice
    assert mx.array_equal(fc[:, -H:], mx.eye(H)) and not mx.any(fc[:, :-H]).item()
    assert mx.array_equal(tr.model.norm.weight, llama_pair.target.model.model.norm.weight.astype(mx.float32))
    tr.save(tmp_path / "started")
    pair = mlx_glimmer.load(target=llama_pair.target_path, drafter=tmp_path / "started")
    prompt = [256] + list(b"a start from the target")
    plain = mlx_glimmer.generate(pair, prompt, max_tokens=60, speculative=False)
    assert mlx_glimmer.generate(pair, prompt, max_tokens=60).token_ids == plain.token_ids


def test_plain_target_init_takes_the_last_layers_and_bad_lists_are_one_clear_error(llama_pair, records, tmp_path):
    tr = make_trainer(llama_pair, records, tmp_path / "last", layers=2, init="target", steps=0)
    last = llama_pair.target.model.model.layers[-1]
    assert mx.array_equal(tr.model.layers[1].mlp.up_proj.weight, last.mlp.up_proj.weight.astype(mx.float32))
    with pytest.raises(GlimmerError, match="out of range for a 6-layer target"):
        make_trainer(llama_pair, records, tmp_path / "a", layers=2, init="target:5,6")
    with pytest.raises(GlimmerError, match="names 3 layers for a 2-layer drafter"):
        make_trainer(llama_pair, records, tmp_path / "b", layers=2, init="target:1,2,3")


def test_saved_drafter_loads_and_stays_lossless(llama_pair, records, tmp_path):
    tr = make_trainer(llama_pair, records, tmp_path, steps=30)
    tr.train()
    path = tmp_path / "run" / "checkpoint"
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["draft_vocab_size"] == tr.draft_vocab.shape[0] and cfg["num_target_layers"] == 6
    pair = mlx_glimmer.load(target=llama_pair.target_path, drafter=path)
    prompt = [256] + list(b"something new")
    plain = mlx_glimmer.generate(pair, prompt, max_tokens=60, speculative=False)
    spec = mlx_glimmer.generate(pair, prompt, max_tokens=60)
    sampled = mlx_glimmer.generate(pair, prompt, max_tokens=30, temperature=0.8, seed=3)
    assert spec.token_ids == plain.token_ids and len(sampled.token_ids) > 0


def test_torch_features_match_the_mlx_targets(llama_pair, records, tmp_path):
    pytest.importorskip("transformers")
    from mlx_glimmer.distill.features import MLXFeatures, TorchFeatures

    sequences = [r["prompt_ids"] + r["response_ids"] for r in records[:4]]
    layers = (1, 3, 4)
    mlx_source = MLXFeatures(llama_pair.target)
    torch_source = TorchFeatures(llama_pair.target_path, batch_tokens=300, dtype="float32")  # same weights, same layers
    mlx_source.capture(layers)
    torch_source.capture(layers)
    for (a, final_a), (b, final_b) in zip(mlx_source(sequences), torch_source(sequences)):
        assert a.shape == b.shape == (a.shape[0], 3 * llama_pair.target.hidden_size)
        np.testing.assert_allclose(b.astype(np.float32), a.astype(np.float32), atol=1e-2, rtol=1e-3)
        assert final_a.shape == final_b.shape == (a.shape[0], llama_pair.target.hidden_size)
        np.testing.assert_allclose(final_b.astype(np.float32), final_a.astype(np.float32), atol=1e-2, rtol=1e-3)


def test_features_without_final_states_are_the_same_and_skip_the_layers_after_the_last_captured(
    llama_pair, records, tmp_path
):
    pytest.importorskip("transformers")
    from mlx_glimmer.distill.features import MLXFeatures, TorchFeatures

    sequences = [r["prompt_ids"] + r["response_ids"] for r in records[:4]]
    for source in (MLXFeatures(llama_pair.target), TorchFeatures(llama_pair.target_path, dtype="float32")):
        source.capture((1, 3, 4))
        both = source(sequences)
        source.capture((1, 3, 4), final_hidden=False)
        alone = source(sequences)
        for (a, final), (b, none) in zip(both, alone):
            np.testing.assert_array_equal(a, b)
            assert final is not None and none is None
    last = source.target.decoder.layers[-1]  # the torch target's layer 5, after the deepest captured (4)
    calls = []
    hook = last.register_forward_hook(lambda *_: calls.append(1))
    try:
        source(sequences)
        assert calls == []
        source.capture((1, 3, 4))
        source(sequences)
        assert calls
    finally:
        hook.remove()
