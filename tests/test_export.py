"""`mlx-glimmer export`: a drafter written in the engines' layouts is the same drafter.

Round trip: the z-lab layout converted back by `convert` drafts exactly as before (same weights in float32, same
acceptance round by round), for the demo pair's distilled drafter (reduced vocabulary) and for a Meta assistant
whose window the decode crosses. Conformance: the `speculators` package loads the speculators layout and computes
the same draft logits as ours from the demo target's hidden states."""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_glimmer
from mlx_glimmer.cli import main
from mlx_glimmer.convert import convert
from mlx_glimmer.demo import SHIPPED_DRAFTER
from mlx_glimmer.drafters.export import export_drafter

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
CHAT = [{"role": "user", "content": PROMPT}]


def tensors_of(path: Path) -> dict[str, np.ndarray]:
    """A directory's safetensors, floats as float32 numpy arrays."""
    out = {}
    for f in Path(path).glob("model*.safetensors"):
        for name, value in mx.load(str(f)).items():
            out[name] = np.array(value.astype(mx.float32) if mx.issubdtype(value.dtype, mx.floating) else value)
    return out


def decode(pair, prompt, max_tokens: int, block_size: int) -> tuple[list[int], list[int]]:
    """Greedy token ids and the tokens each verify round committed: equal drafts give equal acceptances."""
    result = mlx_glimmer.generate(pair, prompt, max_tokens=max_tokens, block_size=block_size)
    return result.token_ids, result.stats.acceptance_lengths


@pytest.fixture(scope="module")
def demo_export(demo_bundle, tmp_path_factory):
    """The demo drafter exported in the z-lab layout (float32) and converted back beside the demo target."""
    root = tmp_path_factory.mktemp("export")
    export_drafter(demo_bundle, root / "dflash", "dflash", dtype="float32")
    convert(demo_bundle / "target", root / "bundle", drafter=root / "dflash", bits=16, dtype="float32")
    return root


def test_demo_drafter_round_trips_through_the_zlab_layout(demo_bundle, demo_pair, demo_export):
    before = tensors_of(demo_bundle / "drafter")
    after = tensors_of(demo_export / "bundle" / "drafter")
    assert sorted(after) == sorted(before)
    for name, value in before.items():
        assert np.array_equal(after[name], value), name
    again = mlx_glimmer.load(demo_bundle, drafter=demo_export / "bundle" / "drafter")
    expected = decode(demo_pair, CHAT, 48, 16)
    assert max(expected[1]) > 1  # the drafter drafts: equal acceptances say something
    assert decode(again, CHAT, 48, 16) == expected


def test_zlab_layout_states_what_engines_would_otherwise_guess(demo_bundle, demo_export):
    """vocab_size present, the window kept by Qwen3's config (counting the query: our reach + 1), blocks
    bidirectional, and the draft vocabulary as EAGLE-3 maps beside the target's head rows of its tokens."""
    from transformers import Qwen3Config

    out = demo_export / "dflash"
    raw = json.loads((out / "config.json").read_text())
    shipped = json.loads((SHIPPED_DRAFTER / "config.json").read_text())
    layer = Qwen3Config(**{k: v for k, v in raw.items() if k != "model_type"})
    assert layer.vocab_size == shipped["vocab_size"]
    assert layer.sliding_window == shipped["sliding_window"] + 1
    assert layer.layer_types == shipped["layer_types"]
    assert raw["is_causal"] is False and raw["dflash_config"]["causal"] is False
    assert raw["dflash_config"]["target_layer_ids"] == shipped["target_layer_ids"]

    tensors = tensors_of(out)
    ids = tensors_of(SHIPPED_DRAFTER)["draft_vocab"]
    assert np.array_equal(np.arange(ids.size) + tensors["d2t"], ids)
    assert np.array_equal(np.flatnonzero(tensors["t2d"]), np.sort(ids))
    embedding = tensors_of(demo_bundle / "target")["model.embed_tokens.weight"]  # SmolLM2 ties its head to it
    assert np.array_equal(tensors["lm_head.weight"], embedding[ids])
    assert not any(name.startswith(("encoder.", "embed_tokens", "draft_vocab")) for name in tensors)


@pytest.fixture(scope="module")
def tiny_bundle(checkpoints, tmp_path_factory):
    """A tiny Muse target with its Meta assistant (window 8, no vocab_size in its config), converted."""
    out = tmp_path_factory.mktemp("tiny") / "bundle"
    convert(checkpoints["muse"], out, drafter=checkpoints["assistant"], bits=16, dtype="float32")
    return out


def test_meta_assistant_round_trips_past_its_window(tiny_bundle, tmp_path):
    export_drafter(tiny_bundle, tmp_path / "dflash", "dflash", dtype="float32")
    raw = json.loads((tmp_path / "dflash" / "config.json").read_text())
    assert raw["sliding_window"] == 9 and "draft_vocab_size" not in raw
    assert sorted(tensors_of(tmp_path / "dflash")) == sorted(
        ["fc.weight", "hidden_norm.weight", "norm.weight"]
        + [f"layers.{i}.{n}.weight" for i in range(2) for n in LAYER_TENSORS]
    )
    convert(tiny_bundle / "target", tmp_path / "again", drafter=tmp_path / "dflash", bits=16, dtype="float32")
    original = mlx_glimmer.load(tiny_bundle)
    again = mlx_glimmer.load(tiny_bundle, drafter=tmp_path / "again" / "drafter")
    prompt = list(range(40, 60))
    assert decode(again, prompt, 40, 4) == decode(original, prompt, 40, 4)
    # a block 20 positions in: its context reaches past the window by 12 positions
    assert np.array_equal(block_logits(again, prompt), block_logits(original, prompt))


def block_logits(pair, context: list[int]) -> np.ndarray:
    """The drafter's logits for the block after `context` (its last token the anchor)."""
    drafter, target = pair.drafter, pair.target
    target.capture(drafter.target_layer_ids)
    _, features = target.forward(mx.array(context), target.make_cache(16), capture=True)
    drafter.reset()
    drafter.observe(context[:-1], features[:-1])
    return np.array(drafter.draft_logits(drafter.block_hidden(context[-1], drafter.block_size - 1)[1:]))


LAYER_TENSORS = (
    "input_layernorm",
    "post_attention_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def test_quantized_drafter_is_exported_dequantized(checkpoints, tmp_path):
    convert(checkpoints["muse"], tmp_path / "q", drafter=checkpoints["assistant"], bits=16, drafter_bits=4)
    export_drafter(tmp_path / "q", tmp_path / "dflash", "dflash", dtype="float32")
    tensors = tensors_of(tmp_path / "dflash")
    stored = mx.load(str(tmp_path / "q" / "drafter" / "model.safetensors"))
    w, scales, biases = (stored[f"layers.0.mlp.up_proj.{n}"] for n in ("weight", "scales", "biases"))
    group_size = w.shape[-1] * 32 // 4 // scales.shape[-1]
    expected = mx.dequantize(w, scales, biases, group_size=group_size, bits=4).astype(mx.float32)
    assert np.array_equal(tensors["layers.0.mlp.up_proj.weight"], np.array(expected))
    assert not any(name.endswith((".scales", ".biases")) for name in tensors)


def test_speculators_package_computes_our_draft_logits(demo_bundle, demo_pair, tmp_path):
    """The speculators DFlash model, loaded from our export (its embedding and head from the demo target as its
    verifier), drafts one block from the demo target's hidden states: logits within 1e-3 of ours (float32 both;
    we measured about 2e-5 on logits of magnitude ~15), argmax equal at every position. The context is shorter
    than the window, where speculators' training mask (window from the anchor) and the engines' (from each query)
    agree."""
    torch = pytest.importorskip("torch")
    if os.environ.get("MLX_GLIMMER_REQUIRE_SPECULATORS"):
        import speculators  # CI installs it (.ci/run): a missing package fails there instead of skipping
    else:
        speculators = pytest.importorskip("speculators")

    out = tmp_path / "spec"
    export_drafter(demo_bundle, out, "speculators", dtype="float32", verifier=str(demo_bundle / "target"))
    raw = json.loads((out / "config.json").read_text())
    drafter, target = demo_pair.drafter, demo_pair.target
    assert raw["aux_hidden_state_layer_ids"] == [i + 1 for i in drafter.target_layer_ids]
    assert raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == drafter.block_size - 1

    config = speculators.SpeculatorModelConfig.from_pretrained(str(out))
    config.transformer_layer_config._attn_implementation = "eager"  # flex attention wants a compiler on CPU
    model = speculators.SpeculatorModel.from_pretrained(str(out), config=config).float().eval()

    ids = demo_pair.tokenizer.encode(f"{PROMPT} {PROMPT}")
    anchor = 12  # context: positions 0..11; speculators anchors a block only where a whole block follows
    block = drafter.block_size
    assert len(ids) > anchor + block
    target.capture(drafter.target_layer_ids)
    _, features = target.forward(mx.array(ids), target.make_cache(16), capture=True)
    drafter.reset()
    drafter.observe(ids[:anchor], features[:anchor])
    ours = np.array(drafter.draft_logits(drafter.block_hidden(ids[anchor], block - 1)[1:]).astype(mx.float32))

    n = len(ids)
    loss_mask = torch.zeros(1, n)
    loss_mask[0, anchor] = 1  # the one anchor
    with torch.no_grad():
        _, logits, *_ = model._backbone_forward(
            torch.tensor(np.array(features.astype(mx.float32)))[None],
            torch.tensor([ids]),
            loss_mask,
            torch.zeros(1, n, target.hidden_size),  # the verifier's last states: its training targets only
            torch.zeros(1, n, dtype=torch.long),
            max_anchors=1,
        )
    theirs = logits[0, 1:].numpy()  # position 0 is the anchor (the bonus token), not a draft
    assert theirs.shape == ours.shape == (block - 1, drafter.config.draft_vocab_size)
    assert np.abs(theirs - ours).max() < 1e-3
    assert np.array_equal(theirs.argmax(-1), ours.argmax(-1))


def test_command_writes_the_directory_and_says_how_to_serve_it(tiny_bundle, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["export", str(tiny_bundle), "--format", "dflash", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert '"num_speculative_tokens": 15' in printed and "--speculative-num-draft-tokens 16" in printed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert {v.dtype for v in mx.load(str(out / "model.safetensors")).values()} == {mx.bfloat16}


def refused(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    return err[0]


def test_bad_input_is_one_error_line_and_leaves_nothing(tiny_bundle, demo_bundle, checkpoints, tmp_path, capsys):
    out = tmp_path / "out"
    base = ["export", str(tiny_bundle), "--out", str(out)]
    assert "--format" in refused(capsys, base)
    assert "--format" in refused(capsys, base + ["--format", "eagle3"])
    assert "no such bundle" in refused(
        capsys, ["export", str(tmp_path / "nowhere"), "--format", "dflash", "--out", str(out)]
    )
    # the demo target came from a .gguf: the speculators layout needs the name an engine loads it by
    assert "--verifier" in refused(capsys, ["export", str(demo_bundle), "--format", "speculators", "--out", str(out)])
    target_only = tmp_path / "target_only"
    convert(checkpoints["muse"], target_only, bits=16)
    assert "no drafter" in refused(capsys, ["export", str(target_only), "--format", "dflash", "--out", str(out)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target_only"]
    source = ["export", str(tiny_bundle), "--format", "dflash", "--force", "--out"]
    assert "must not be or contain the source" in refused(capsys, source + [str(tiny_bundle / "drafter")])
    assert "must not be or contain the source" in refused(capsys, source + [str(tiny_bundle)])
    out.mkdir()
    assert "already exists" in refused(capsys, base + ["--format", "dflash"])
    assert list(out.iterdir()) == []


def test_a_failed_write_leaves_nothing_behind(tiny_bundle, tmp_path, capsys, monkeypatch):
    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(mx, "save_safetensors", disk_full)
    assert "No space left" in refused(
        capsys, ["export", str(tiny_bundle), "--format", "dflash", "--out", str(tmp_path / "out")]
    )
    assert list(tmp_path.iterdir()) == []
