"""The feature pass: batched sources compute what one sequence at a time computes, a killed pass resumes to the
same features and the same drafter, features computed online feed the steps what a store feeds them, and the
precision follows what the CPU multiplies in hardware."""

import io
import json
import re

import mlx.core as mx
import numpy as np
import pytest

from mlx_glimmer.batching import length_groups
from mlx_glimmer.cpu import native_bfloat16
from mlx_glimmer.distill.features import (
    FeatureStore,
    MLXFeatures,
    candidate_sources,
    choose_feature_source,
    stored_source,
    target_features_and_hidden,
)
from mlx_glimmer.distill.run import train_precision
from mlx_glimmer.distill.step import TrainConfig
from mlx_glimmer.distill.train import Trainer, training_sequences
from mlx_glimmer.errors import GlimmerError
from mlx_glimmer.settings import GenerationSettings
from mlx_glimmer.speculative import generate_steps

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: the torch steps on one thread

LAYERS = [1, 3, 4]


@pytest.fixture(scope="module")
def records(llama_pair):
    """The tiny target's greedy answers to prompts of different lengths (so batches are padded)."""
    out = []
    for i in range(7):
        prompt = [256] + list(f"prompt {i}: {'tell me more ' * i}".encode())
        settings = GenerationSettings(max_tokens=20 + 4 * i)
        ans = [t for s in generate_steps(llama_pair.target, prompt, settings) for t in s.tokens]
        out.append({"index": i, "tag": "greedy", "prompt_ids": prompt, "response_ids": ans})
    return out


class Killed(Exception):
    """What a kill looks like to the code that was running."""


class DiesAfter:
    """A feature source that computes `chunks` chunks, then dies as a killed process would."""

    def __init__(self, source, chunks: int):
        self.source, self.left = source, chunks
        self.name, self.spec, self.chunk = source.name, source.spec, source.chunk

    def capture(self, layer_ids, final_hidden=True):
        self.source.capture(layer_ids, final_hidden)

    def __call__(self, sequences):
        if self.left == 0:
            raise Killed
        self.left -= 1
        return self.source(sequences)


def test_length_groups_cover_every_sequence_once_within_the_token_budget():
    lengths = [5, 30, 7, 7, 100, 1, 12]
    groups = length_groups(lengths, batch_tokens=32)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 32


def test_batched_mlx_features_equal_one_sequence_at_a_time(llama_pair, records):
    sequences = training_sequences(records)
    source = MLXFeatures(llama_pair.target, batch_tokens=200)  # several padded groups
    source.capture(LAYERS)
    batched = source(sequences)
    for seq, (feats, hidden) in zip(sequences, batched):
        one_feats, one_hidden = target_features_and_hidden(llama_pair.target, seq)
        assert feats.shape == (len(seq), len(LAYERS) * llama_pair.target.hidden_size)
        np.testing.assert_allclose(feats.astype(np.float32), np.asarray(one_feats, dtype=np.float32), atol=2e-2)
        np.testing.assert_allclose(hidden.astype(np.float32), np.asarray(one_hidden, dtype=np.float32), atol=2e-2)


def test_a_killed_feature_pass_resumes_where_it_saved_and_ends_with_the_same_features(llama_pair, records, tmp_path):
    sequences = training_sequences(records)
    whole = FeatureStore(
        tmp_path / "whole", llama_pair.target, sequences, LAYERS, MLXFeatures(llama_pair.target, chunk=2)
    )
    whole.ensure(log=io.StringIO())

    dying = DiesAfter(MLXFeatures(llama_pair.target, chunk=2), chunks=2)
    killed = FeatureStore(tmp_path / "killed", llama_pair.target, sequences, LAYERS, dying)
    with pytest.raises(Killed):
        killed.ensure(log=io.StringIO())
    assert json.loads((tmp_path / "killed" / "features.json").read_text())["done"] == 4

    log = io.StringIO()
    again = FeatureStore(
        tmp_path / "killed", llama_pair.target, sequences, LAYERS, MLXFeatures(llama_pair.target, chunk=2)
    )
    assert again.done == 4
    again.ensure(log=log)
    assert "resuming at sequence 4/7" in log.getvalue()
    for i in range(len(sequences)):
        np.testing.assert_array_equal(again.get(i), whole.get(i))


def test_a_store_of_fewer_answers_grows_and_computes_only_the_new_ones(llama_pair, records, tmp_path):
    sequences = training_sequences(records)
    whole = FeatureStore(tmp_path / "whole", llama_pair.target, sequences, LAYERS, teacher=True)
    whole.ensure(log=io.StringIO())
    first = FeatureStore(tmp_path / "grown", llama_pair.target, sequences[:4], LAYERS, teacher=True)
    first.ensure(log=io.StringIO())
    kept = [np.array(first.get(i)) for i in range(4)]

    seen = []

    class Counts(MLXFeatures):
        def __call__(self, batch):
            seen.extend(batch)
            return super().__call__(batch)

    grown = FeatureStore(tmp_path / "grown", llama_pair.target, sequences, LAYERS, Counts(llama_pair.target), True)
    assert grown.done == 4
    grown.ensure(log=io.StringIO())
    assert seen == sequences[4:]
    assert all(np.array_equal(grown.get(i), kept[i]) for i in range(4))  # kept as stored, not recomputed
    for i in range(len(sequences)):  # batched with other sequences than in `whole`: rounded a little apart
        np.testing.assert_allclose(grown.get(i).astype(np.float32), whole.get(i).astype(np.float32), atol=2e-2)
        np.testing.assert_allclose(grown.final_hidden(i), whole.final_hidden(i), atol=2e-2)
    other = FeatureStore(tmp_path / "grown", llama_pair.target, sequences[::-1], LAYERS, recompute=True)
    assert other.done == 0  # other answers


def test_a_run_of_fewer_answers_reads_a_grown_store_as_it_is(llama_pair, records, tmp_path):
    sequences = training_sequences(records)
    whole = FeatureStore(tmp_path / "store", llama_pair.target, sequences, LAYERS, teacher=True)
    whole.ensure(log=io.StringIO())
    kept = [np.array(whole.get(i)) for i in range(len(sequences))]

    fewer = FeatureStore(tmp_path / "store", llama_pair.target, sequences[:4], LAYERS, DiesAfter(whole.source, 0))
    assert fewer.done == 4
    fewer.ensure(log=io.StringIO())  # computes nothing: the source would die
    assert all(np.array_equal(fewer.get(i), kept[i]) for i in range(4))
    assert fewer.teacher and np.array_equal(fewer.final_hidden(3), whole.final_hidden(3))

    again = FeatureStore(tmp_path / "store", llama_pair.target, sequences, LAYERS)
    assert again.done == len(sequences)  # the grown store's record is whole after the smaller run
    assert all(np.array_equal(again.get(i), kept[i]) for i in range(len(sequences)))


def test_a_store_that_cannot_serve_the_run_is_refused_and_left_as_it_is(llama_pair, records, tmp_path):
    sequences = training_sequences(records)
    FeatureStore(tmp_path / "store", llama_pair.target, sequences, LAYERS).ensure(log=io.StringIO())
    kept = {f.name: f.read_bytes() for f in (tmp_path / "store").iterdir()}
    for seqs, layers, says in ((sequences[::-1], LAYERS, "other answers"), (sequences, LAYERS[:2], "layers")):
        with pytest.raises(
            GlimmerError, match=rf"{re.escape(str(tmp_path / 'store'))} holds features .*{says}.*--recompute-features"
        ):
            FeatureStore(tmp_path / "store", llama_pair.target, seqs, layers)
    assert {f.name: f.read_bytes() for f in (tmp_path / "store").iterdir()} == kept


def test_a_store_that_cannot_serve_the_run_is_computed_anew_when_asked_with_one_line_saying_why(
    llama_pair, records, tmp_path
):
    sequences = training_sequences(records)
    FeatureStore(tmp_path / "store", llama_pair.target, sequences, LAYERS).ensure(log=io.StringIO())
    quiet = io.StringIO()
    assert FeatureStore(tmp_path / "store", llama_pair.target, sequences, LAYERS, log=quiet).done == len(sequences)
    assert quiet.getvalue() == ""

    cases = [
        ((sequences[::-1], LAYERS, False), "other answers"),
        ((sequences, LAYERS[:2], False), "layers [1, 3, 4], this run reads [1, 3]"),
        ((sequences, LAYERS, True), "no final hidden states"),
    ]
    for (seqs, layers, teacher), reason in cases:
        FeatureStore(tmp_path / "store", llama_pair.target, sequences, LAYERS).ensure(log=io.StringIO())
        log = io.StringIO()
        store = FeatureStore(
            tmp_path / "store", llama_pair.target, seqs, layers, teacher=teacher, recompute=True, log=log
        )
        assert store.done == 0
        assert log.getvalue().count("\n") == 1 and f"computing {tmp_path / 'store'} anew: " in log.getvalue()
        assert reason in log.getvalue()

    (tmp_path / "store" / "features.json").write_text('{"layer_ids": [1, 3')  # cut by a full disk
    log = io.StringIO()
    store = FeatureStore(tmp_path / "store", llama_pair.target, sequences, LAYERS, log=log)
    assert store.done == 0 and "features.json is unreadable" in log.getvalue()
    store.ensure(log=io.StringIO())
    assert FeatureStore(tmp_path / "store", llama_pair.target, sequences, LAYERS).done == len(sequences)


def train(llama_pair, records, run, soft_labels=0.0, **kw):
    cfg = TrainConfig(
        soft_labels=soft_labels,
        layers=1,
        context_layers=3,
        anchors=8,
        steps=30,
        warmup=5,
        eval_every=10**9,
        checkpoint_every=10,
        learning_rate=3e-3,
        compile=False,
    )
    trainer = Trainer(llama_pair.target, records, cfg, run, mask_token_id=259, log=io.StringIO(), **kw)
    trainer.resume(run / "checkpoint")
    return trainer


def test_a_run_killed_in_its_feature_pass_and_again_in_training_ends_with_the_same_drafter(
    llama_pair, records, tmp_path
):
    def source():  # a chunk is 2 sequences, so a kill can land between chunks of this small set
        return MLXFeatures(llama_pair.target, chunk=2)

    unbroken = train(llama_pair, records, tmp_path / "unbroken", feature_source=source())
    unbroken.train()

    run = tmp_path / "broken"
    with pytest.raises(Killed):
        train(llama_pair, records, run, feature_source=DiesAfter(source(), chunks=2)).train()
    assert json.loads((run / "features" / "features.json").read_text())["done"] == 4
    resumed = train(llama_pair, records, run, feature_source=source())
    resumed.train(until=20)  # the features resume at sequence 4; killed again after the step-20 checkpoint
    resumed = train(llama_pair, records, run, feature_source=source())
    assert resumed.step == 20
    resumed.train()

    a = dict(mx.load(str(tmp_path / "unbroken" / "checkpoint" / "model.safetensors")))
    b = dict(mx.load(str(run / "checkpoint" / "model.safetensors")))
    assert a.keys() == b.keys()
    assert max(float(mx.abs(a[k] - b[k]).max()) for k in a if k != "draft_vocab") < 1e-5


class Recorded:
    """A trainer's features, with what the trainer asked of them, in order."""

    def __init__(self, features):
        self.features, self.calls = features, []

    def __getattr__(self, name):
        return getattr(self.features, name)

    def rows(self, indices):
        self.calls.append(("rows", sorted(indices)))
        return self.features.rows(indices)

    def prefetch(self, indices):
        self.calls.append(("prefetch", sorted(indices)))
        self.features.prefetch(indices)


def test_each_steps_sequences_are_read_ahead_while_the_step_before_computes(llama_pair, records, tmp_path):
    trainer = train(llama_pair, records, tmp_path / "run", soft_labels=0.5)  # a store with final hidden states too
    trainer.features = recorded = Recorded(trainer.features)
    trainer.train(until=12)
    assert [kind for kind, _ in recorded.calls] == ["rows", "prefetch"] * 12
    hinted = [(hint, read) for (_, hint), (_, read) in zip(recorded.calls[1::2], recorded.calls[2::2])]
    assert all(hint in ([], read) for hint, read in hinted)  # none where a new permutation is drawn first
    assert sum(hint == read for hint, read in hinted) >= 4


def test_online_features_feed_each_step_what_a_store_feeds_it_and_write_nothing(llama_pair, records, tmp_path):
    stored = train(llama_pair, records, tmp_path / "stored", soft_labels=0.5)
    online = train(llama_pair, records, tmp_path / "online", soft_labels=0.5, online_features=True)
    for _ in range(3):  # the same seed draws the same sequences and anchors
        a, b = stored.batch(stored.next_indices()), online.batch(online.next_indices())
        np.testing.assert_array_equal(a.anchors, b.anchors)
        np.testing.assert_array_equal(a.labels, b.labels)
        # batched with other sequences than in the store's pass: rounded a little apart
        np.testing.assert_allclose(a.ctx.astype(np.float32), b.ctx.astype(np.float32), atol=2e-2)
        np.testing.assert_allclose(a.teacher.astype(np.float32), b.teacher.astype(np.float32), atol=2e-2)
        assert np.abs(b.ctx).max() > 0 and np.abs(b.teacher).max() > 0
    assert (tmp_path / "stored" / "features" / "features.f16").is_file()
    assert not (tmp_path / "online" / "features").exists()


def test_an_online_run_killed_in_training_resumes_to_the_same_drafter(llama_pair, records, tmp_path):
    unbroken = train(llama_pair, records, tmp_path / "unbroken", online_features=True)
    unbroken.train()
    run = tmp_path / "broken"
    train(llama_pair, records, run, online_features=True).train(until=20)  # killed after the step-20 checkpoint
    resumed = train(llama_pair, records, run, online_features=True)
    assert resumed.step == 20
    resumed.train()
    a = dict(mx.load(str(tmp_path / "unbroken" / "checkpoint" / "model.safetensors")))
    b = dict(mx.load(str(run / "checkpoint" / "model.safetensors")))
    assert max(float(mx.abs(a[k] - b[k]).max()) for k in a if k != "draft_vocab") < 1e-5


def test_auto_resumes_with_the_source_the_store_was_computed_with(llama_pair, records, tmp_path):
    pytest.importorskip("torch")
    sequences = training_sequences(records)
    directory = tmp_path / "features"
    assert stored_source(directory, [len(s) for s in sequences], LAYERS) is None
    first = choose_feature_source(
        "torch:float32", directory, llama_pair.target, llama_pair.target_path, sequences, LAYERS
    )
    first.chunk = 2  # so that a kill lands between chunks of this small set
    store = FeatureStore(directory, llama_pair.target, sequences, LAYERS, DiesAfter(first, chunks=1))
    with pytest.raises(Killed):
        store.ensure(log=io.StringIO())
    assert stored_source(directory, [len(s) for s in sequences], LAYERS) == "torch:float32"
    assert stored_source(directory, [len(s) for s in sequences], [1, 2, 3]) is None  # other layers: not this store

    log = io.StringIO()
    again = choose_feature_source("auto", directory, llama_pair.target, llama_pair.target_path, sequences, LAYERS, log)
    assert again.spec == "torch:float32" and "resuming the store computed with torch:float32" in log.getvalue()


def test_bfloat16_is_native_only_with_the_cpu_instructions_for_it():
    assert native_bfloat16(frozenset({"avx2", "fma"})) is False
    assert native_bfloat16(frozenset({"avx512f", "avx512_bf16"})) is True
    assert native_bfloat16(frozenset({"amx_tile", "amx_bf16"})) is True
    assert native_bfloat16(frozenset({"asimd", "bf16"})) is True  # Arm


def test_precision_auto_follows_the_cpu_and_explicit_choices_stand(monkeypatch):
    import mlx_glimmer.distill.features as features
    import mlx_glimmer.distill.run as run

    assert train_precision("float32") == "float32" and train_precision("bfloat16") == "bfloat16"
    monkeypatch.setattr(run, "native_bfloat16", lambda: False)
    assert train_precision("auto") == "float32"
    monkeypatch.setattr(run, "native_bfloat16", lambda: True)
    assert train_precision("auto") == "bfloat16"
    if "torch:float32" in candidate_sources():
        monkeypatch.setattr(features, "native_bfloat16", lambda: False)
        assert "torch:bfloat16" not in candidate_sources()
