"""The recipe's options: `context_scale` "channel" (the drafter trains on features divided by each channel's
RMS, and what it saves reads raw features exactly as the trained one read the scaled ones), `train_tags`
(steps draw only answers with those tags, the features cover all) and `soft_labels` (each label mixes the
answer's token with the target's own next-token distribution, from its stored final hidden states)."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mlx_glimmer
from mlx_glimmer.distill.features import target_features
from mlx_glimmer.distill.step import TrainConfig
from mlx_glimmer.distill.train import Trainer, block_forward
from mlx_glimmer.drafters.dflash import DFlashModel
from mlx_glimmer.errors import GlimmerError
from mlx_glimmer.settings import GenerationSettings
from mlx_glimmer.speculative import generate_steps


@pytest.fixture(scope="module")
def records(llama_pair):
    out = []
    for i in range(4):
        prompt = [256] + list(f"prompt {i}: say".encode())
        ans = [
            t for s in generate_steps(llama_pair.target, prompt, GenerationSettings(max_tokens=32)) for t in s.tokens
        ]
        out.append({"index": i, "tag": "greedy" if i % 2 else "t0.8", "prompt_ids": prompt, "response_ids": ans})
    return out


def trainer(llama_pair, records, where, **kw):
    cfg = TrainConfig(
        layers=1,
        context_layers=3,
        anchors=8,
        steps=kw.pop("steps", 20),
        warmup=2,
        eval_every=10**9,
        learning_rate=3e-3,
        compile=False,
        **kw,
    )
    return Trainer(llama_pair.target, records, cfg, where, mask_token_id=259)


def block_inputs(tr, records):
    seq = records[0]["prompt_ids"] + records[0]["response_ids"]
    anchors = mx.array([len(records[0]["prompt_ids"]) + k for k in (0, 4, 11)])
    ids = np.full((anchors.shape[0], tr.config.block_size), 259)
    ids[:, 0] = [seq[int(a)] for a in anchors]
    return tr.embed(mx.array(ids)), anchors, target_features(tr.target, seq).astype(mx.float32)


def test_the_scale_is_each_channels_rms_past_the_first_position(llama_pair, records, tmp_path):
    tr = trainer(llama_pair, records, tmp_path / "run", context_scale="channel")
    rows = np.concatenate([tr.features.get(i)[1:].astype(np.float32) for i in range(len(records))])
    np.testing.assert_allclose(tr.feature_scale, np.sqrt((rows**2).mean(0)), rtol=1e-4)
    batch = tr.batch(0)
    n = len(tr.sequences[0])
    np.testing.assert_allclose(batch.ctx[0, :n], tr.features.get(0) / tr.feature_scale, rtol=2e-3)


def test_the_saved_drafter_reads_raw_features_as_the_trained_one_read_scaled_ones(llama_pair, records, tmp_path):
    tr = trainer(llama_pair, records, tmp_path / "run", context_scale="channel")
    tr.train()
    before = dict(tree_flatten(tr.model.parameters()))
    tr.save(tmp_path / "saved")
    after = dict(tree_flatten(tr.model.parameters()))
    assert all(mx.array_equal(before[k], after[k]).item() for k in before), "saving changed the trained weights"

    saved = DFlashModel(tr.drafter_config)
    saved.load_weights(str(tmp_path / "saved" / "model.safetensors"), strict=False)
    noise, anchors, raw = block_inputs(tr, records)
    trained = block_forward(tr.model, noise, anchors, raw / mx.array(tr.feature_scale), anchors)
    exported = block_forward(saved, noise, anchors, raw, anchors)
    np.testing.assert_allclose(np.asarray(exported), np.asarray(trained), atol=2e-4)
    fc = tr.model.encoder.fc.weight
    assert not mx.allclose(saved.encoder.fc.weight, fc).item(), (
        "the export must hold the folded fc, not the trained one"
    )


def test_fine_tuning_a_raw_drafter_with_channel_scale_starts_where_it_was(llama_pair, records, tmp_path):
    raw_tr = trainer(llama_pair, records, tmp_path / "raw", steps=5)
    raw_tr.train()
    raw_tr.save(tmp_path / "raw_drafter")
    tr = trainer(llama_pair, records, tmp_path / "ft", context_scale="channel", init=str(tmp_path / "raw_drafter"))
    noise, anchors, raw = block_inputs(tr, records)
    scaled = block_forward(tr.model, noise, anchors, raw / mx.array(tr.feature_scale), anchors)
    np.testing.assert_allclose(
        np.asarray(scaled), np.asarray(block_forward(raw_tr.model, noise, anchors, raw, anchors)), atol=2e-4
    )


def test_an_unknown_scale_is_one_clear_error(llama_pair, records, tmp_path):
    with pytest.raises(GlimmerError, match="context_scale"):
        trainer(llama_pair, records, tmp_path / "run", context_scale="layer")


def test_steps_draw_only_the_answers_with_the_chosen_tags(llama_pair, records, tmp_path):
    tr = trainer(llama_pair, records, tmp_path / "run", train_tags=("greedy",), sequences_per_step=3)
    drawn = {i for _ in range(10) for i in tr.next_indices()}
    assert drawn == {i for i, r in enumerate(records) if r["tag"] == "greedy"}
    assert len(tr.features.lengths) == len(records)  # one feature store for every answer, whatever is trained


def test_tokens_seen_count_the_answers_steps_draw_from(llama_pair, records, tmp_path):
    varied = [dict(r, response_ids=r["response_ids"][: 8 + 6 * i]) for i, r in enumerate(records)]
    tr = trainer(llama_pair, varied, tmp_path / "run", train_tags=("greedy",))
    greedy = [len(r["response_ids"]) for r in varied if r["tag"] == "greedy"]
    assert tr.answer_tokens_per_draw == sum(greedy) / len(greedy) != sum(len(r["response_ids"]) for r in varied) / 4


def test_tags_no_answer_has_are_one_clear_error(llama_pair, records, tmp_path):
    with pytest.raises(GlimmerError, match="--train-tags followup"):
        trainer(llama_pair, records, tmp_path / "run", train_tags=("followup",))


def test_soft_labels_read_the_final_hidden_state_that_predicted_each_label(llama_pair, records, tmp_path):
    tr = trainer(llama_pair, records, tmp_path / "run", soft_labels=0.5)
    tr.features.ensure()
    greedy = 1  # records[1] is a greedy answer: each label is the target's argmax
    seq = records[greedy]["prompt_ids"] + records[greedy]["response_ids"]
    cache = llama_pair.target.make_cache(reserve=1)
    hidden, _ = llama_pair.target.forward(mx.array(seq, dtype=mx.uint32), cache, False)
    np.testing.assert_allclose(tr.features.final_hidden(greedy), np.asarray(hidden), atol=2e-2, rtol=1e-2)
    batch = tr.batch(greedy)
    head = np.asarray(tr.head.astype(mx.float32))
    for j in range(3):
        a = int(batch.anchors[0, j])
        assert (batch.teacher[0, j, 0].astype(np.float32) @ head.T).argmax() == batch.labels[0, j, 0]
        np.testing.assert_array_equal(batch.teacher[0, j, 0], tr.features.final_hidden(greedy)[a])


def soft_cross_entropy(logits, labels, teacher_logits, soft, weights):
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    q = np.exp(teacher_logits - teacher_logits.max(-1, keepdims=True))
    q = soft * q / q.sum(-1, keepdims=True)
    q[np.arange(len(labels)), labels] += 1 - soft
    return float(((lse - (q * logits).sum(-1)) * weights).sum())


@pytest.mark.parametrize("soft", [0.0, 0.3, 1.0])
def test_the_fused_soft_label_loss_and_gradient_are_the_plain_formula(soft):
    torch = pytest.importorskip("torch")
    from mlx_glimmer.distill.torch_step import HeadCrossEntropy

    gen = torch.Generator().manual_seed(1)
    h = torch.randn(200, 16, generator=gen, requires_grad=True)
    head, teacher = torch.randn(500, 16, generator=gen), torch.randn(200, 16, generator=gen)
    labels, weights = torch.randint(0, 500, (200,), generator=gen), torch.rand(200, generator=gen)
    fused = HeadCrossEntropy.apply(h, head, labels, weights, 64, teacher, soft)  # 4 chunks, the last partial
    fused.backward()
    plain = soft_cross_entropy(
        (h @ head.T).detach().numpy(), labels.numpy(), (teacher @ head.T).numpy(), soft, weights.numpy()
    )
    np.testing.assert_allclose(float(fused.detach()), plain, rtol=1e-5)
    hh = h.detach().clone().requires_grad_()
    z, y = hh @ head.T, torch.nn.functional.one_hot(labels, 500).float()
    q = (1 - soft) * y + soft * torch.softmax(teacher @ head.T, -1)
    ((torch.logsumexp(z, -1) - (q * z).sum(-1)) * weights).sum().backward()
    torch.testing.assert_close(h.grad, hh.grad, rtol=1e-4, atol=1e-5)


def test_the_mlx_and_torch_steps_agree_on_the_soft_label_loss(llama_pair, records, tmp_path):
    pytest.importorskip("transformers")
    mlx_tr = trainer(llama_pair, records, tmp_path / "m", soft_labels=0.5, sequences_per_step=2)
    torch_tr = trainer(llama_pair, records, tmp_path / "t", soft_labels=0.5, sequences_per_step=2, backend="torch")
    torch_tr.step_fn.autocast = False
    batch = mlx_tr.batch([0, 1])
    hard = trainer(llama_pair, records, tmp_path / "h", sequences_per_step=2).step_fn.loss(batch)
    soft = mlx_tr.step_fn.loss(batch)
    np.testing.assert_allclose(torch_tr.step_fn.loss(batch), soft, rtol=1e-4)
    assert abs(soft - hard) > 1e-3  # the target's distribution is not one-hot: the soft loss is another loss


def test_a_store_without_final_hidden_states_is_recomputed_for_soft_labels_and_kept_after(
    llama_pair, records, tmp_path
):
    trainer(llama_pair, records, tmp_path / "run").features.ensure()
    features = tmp_path / "run" / "features"
    assert not (features / "teacher.f16").exists()
    soft = trainer(llama_pair, records, tmp_path / "run", soft_labels=1.0)
    assert soft.features.done == 0 and soft.features.teacher
    soft.features.ensure()
    assert (features / "teacher.f16").is_file()
    again = trainer(llama_pair, records, tmp_path / "run")  # hard labels: the store serves it as it is
    assert again.features.done == len(records) and again.features.teacher


def test_a_wider_mlp_is_saved_with_its_width_and_drafts_losslessly(llama_pair, records, tmp_path):
    tr = trainer(llama_pair, records, tmp_path / "run", mlp_width=2.0, steps=5)
    target_width = int(llama_pair.target.args.intermediate_size)
    assert tr.model.layers[0].mlp.down_proj.weight.shape[1] == 2 * target_width
    tr.train()
    tr.save(tmp_path / "wide")
    assert json.loads((tmp_path / "wide" / "config.json").read_text())["intermediate_size"] == 2 * target_width
    pair = mlx_glimmer.load(target=llama_pair.target_path, drafter=tmp_path / "wide")
    prompt = [256] + list(b"a wider drafter")
    plain = mlx_glimmer.generate(pair, prompt, max_tokens=40, speculative=False)
    assert mlx_glimmer.generate(pair, prompt, max_tokens=40).token_ids == plain.token_ids
