"""`mlx-glimmer convert`: transformers / GGUF checkpoints into bundles that mlx-lm and our loader open alike.

The figures (argmax agreement of quantized bundles, GGUF vs transformers) are
printed; run with `-s` to see them.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import tiny_checkpoints as tc
import torch
from slow_machine import slow_machine_timeout

import mlx_glimmer
from mlx_glimmer.cli import main
from mlx_glimmer.convert import convert
from mlx_glimmer.convert.gguf import SMOLLM2_GGUF, find_or_fetch_smollm2_gguf, unpack_blocks
from mlx_glimmer.convert.quantize import TensorItem

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: the transformers references on one thread

REPO_CACHE = Path(__file__).resolve().parent.parent / ".cache"
PROMPTS = np.random.default_rng(1234).integers(0, 256, size=(16, 32))  # the fixed random prompt set
VISION_PREFIXES = ("model.vision_tower.", "model.vision_adapter.", "model.vision_projection.")


def weights_of(model_dir: Path) -> dict:
    out = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        out.update(mx.load(str(f)))
    return out


def source_names(model_dir: Path) -> list[str]:
    return list(json.loads((Path(model_dir) / "model.safetensors.index.json").read_text())["weight_map"])


def mlx_logits(model_dir: Path, prompts=PROMPTS) -> np.ndarray:
    import mlx_lm

    model, _ = mlx_lm.load(str(model_dir))
    return np.array(model(mx.array(prompts)).astype(mx.float32))


def transformers_logits(model, prompts=PROMPTS) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.tensor(prompts)).logits.float().numpy()


def agreement(a: np.ndarray, b: np.ndarray) -> float:
    return float((a.argmax(-1) == b.argmax(-1)).mean())


def assert_one_error_line(err: str, *needles):
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for n in needles:
        assert str(n) in lines[0], (n, lines[0])


def leftovers(out: Path) -> list[Path]:
    """A bundle or a staging directory that a failed conversion left beside --out."""
    return [p for p in out.parent.iterdir() if p.name == out.name or p.name.startswith(f".{out.name}.")]


@pytest.fixture(scope="module")
def sources(checkpoints):
    muse = Path(checkpoints["muse"])
    assert len(list(muse.glob("*.safetensors"))) >= 3
    return {"muse": muse, "assistant": Path(checkpoints["assistant"])}


@pytest.fixture(scope="module")
def bundles(tmp_path_factory, sources):
    """The tiny pair at 16 (float32, small shards), 8 and 4 bits; 4-bit through the CLI."""
    root = tmp_path_factory.mktemp("bundles")
    out = {}
    out[16] = root / "f32"
    convert(sources["muse"], out[16], drafter=sources["assistant"], bits=16, dtype="float32", max_shard_size="300KB")
    out[8] = root / "q8"
    convert(sources["muse"], out[8], drafter=sources["assistant"], bits=8)
    out[4] = root / "q4"
    argv = ["convert", "--target", str(sources["muse"]), "--drafter", str(sources["assistant"]), "--out", str(out[4])]
    assert main(argv + ["--quiet"]) == 0
    return out


@pytest.fixture(scope="module")
def reference(sources):
    from transformers import MuseGlimmerForConditionalGeneration

    return MuseGlimmerForConditionalGeneration.from_pretrained(sources["muse"]).float().eval()


# --- layout -----------------------------------------------------------------------------------------


def test_bundle_layout_manifest_and_text_tower(bundles, sources):
    src_names = source_names(sources["muse"])
    vision = [n for n in src_names if n.startswith(VISION_PREFIXES)]
    assert vision
    for bits, path in bundles.items():
        manifest = json.loads((path / "glimmer.json").read_text())
        assert manifest["format"] == "mlx-glimmer/1"
        assert (manifest["target"], manifest["drafter"]) == ("target", "drafter")
        assert manifest["bits"] == bits and manifest["group_size"] == 64
        assert manifest["tool_version"] == mlx_glimmer.__version__
        assert manifest["sources"] == {"target": str(sources["muse"]), "drafter": str(sources["assistant"])}
        on_disk = {f.relative_to(path).as_posix() for f in path.rglob("*") if f.is_file()} - {"glimmer.json"}
        assert set(manifest["files"]) == on_disk
        for rel, digest in manifest["files"].items():
            assert hashlib.sha256((path / rel).read_bytes()).hexdigest() == digest, rel
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
            assert (path / "target" / name).is_file()

        config = json.loads((path / "target" / "config.json").read_text())
        assert config["model_type"] == "muse_glimmer"
        assert "text_config" not in config and "vision_config" not in config
        assert (config["bos_token_id"], config["eos_token_id"]) == (tc.BOS_ID, tc.EOS_ID)
        assert config["num_hidden_layers"] == 8 and config["hidden_size"] == 64
        weights = weights_of(path / "target")
        index = json.loads((path / "target" / "model.safetensors.index.json").read_text())["weight_map"]
        assert set(index) == set(weights)
        assert not any("vision" in n or "language_model" in n for n in weights)
        text_names = {n.replace("model.language_model.", "model.") for n in src_names if n not in vision}
        if bits == 16:
            assert "quantization" not in config
            assert set(weights) == text_names
            assert all(w.dtype == mx.float32 for w in weights.values())
            assert len(list((path / "target").glob("model-*.safetensors"))) >= 3  # --max-shard-size 300KB
        else:
            assert (
                config["quantization"]
                == config["quantization_config"]
                == {"group_size": 64, "bits": bits, "mode": "affine"}
            )
            assert weights["lm_head.weight"].dtype == mx.uint32 and "model.embed_tokens.scales" in weights
            norms = [n for n in weights if "norm" in n]
            assert norms and all(weights[n].dtype == mx.bfloat16 and weights[n].ndim == 1 for n in norms)

        dcfg = json.loads((path / "drafter" / "config.json").read_text())
        assert dcfg["model_type"] == "muse_glimmer_assistant"
        assert (dcfg["vocab_size"], dcfg["num_target_layers"]) == (tc.VOCAB_SIZE, 8)
        assert dcfg["target_layer_ids"] == [1, 3, 5]
        assert ("quantization" in dcfg) == (bits < 16)
        dweights = weights_of(path / "drafter")
        assert "encoder.fc.weight" in dweights and not any(k.startswith(("embed_tokens", "lm_head")) for k in dweights)


def test_output_shards_respect_max_shard_size(tmp_path, sources):
    out = tmp_path / "b"
    convert(sources["muse"], out, bits=16, dtype="float32", max_shard_size="100KB")
    shards = sorted((out / "target").glob("model-*.safetensors"))
    assert len(shards) >= 10
    largest_tensor = max(v.nbytes for v in weights_of(out / "target").values())
    for s in shards:
        assert s.stat().st_size <= max(100_000, largest_tensor) + 4096, s


def test_row_blocks_write_the_same_bytes_as_whole_tensors(tmp_path, sources, monkeypatch):
    from mlx_glimmer.convert import quantize

    convert(sources["muse"], tmp_path / "whole", drafter=sources["assistant"], bits=4)
    monkeypatch.setattr(quantize, "CHUNK_BYTES", 1000)  # a few rows per block
    convert(sources["muse"], tmp_path / "blocks", drafter=sources["assistant"], bits=4)
    files = sorted(p.relative_to(tmp_path / "whole") for p in (tmp_path / "whole").rglob("*.safetensors"))
    assert len(files) == 2
    for f in files:
        assert (tmp_path / "whole" / f).read_bytes() == (tmp_path / "blocks" / f).read_bytes(), f


# --- numbers ----------------------------------------------------------------------------------------


def test_float_bundle_reproduces_transformers_logits(bundles, reference):
    ref = transformers_logits(reference)
    ours = mlx_logits(bundles[16] / "target")
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    assert rel <= 1e-4, rel


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_bundle_equals_transformers_with_its_dequantized_weights(tmp_path, sources, reference, bits):
    """The quantized path is exact: transformers running the bundle's dequantized weights gives its logits."""
    out = tmp_path / "b"
    convert(sources["muse"], out, bits=bits, dtype="float32")
    import mlx_lm

    model, _ = mlx_lm.load(str(out / "target"))
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    replaced = 0
    for path, module in model.named_modules():
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            w = mx.dequantize(module.weight, module.scales, module.biases, module.group_size, module.bits)
            name = (
                "lm_head.weight"
                if path == "lm_head"
                else path.replace("model.", "model.language_model.", 1) + ".weight"
            )
            state[name] = torch.from_numpy(np.array(w))
            replaced += 1
    assert replaced == 8 * 8 + 2  # per layer q k v o, attention gate, mlp gate up down; embedding; head
    fake = type(reference)(reference.config).float().eval()
    fake.load_state_dict(state)
    ref = transformers_logits(fake)
    ours = np.array(model(mx.array(PROMPTS)))
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    assert rel <= 1e-4, rel


@pytest.fixture(scope="module")
def peaked(tmp_path_factory):
    """A tiny Muse whose greedy choices are stable enough to measure quantization quality (see build_muse_target)."""
    path = tmp_path_factory.mktemp("peaked") / "muse"
    return tc.build_muse_target(
        path, max_shard_size="200KB", qk_scale_factor=1.0, post_norm_scale=0.38, head_from_embeddings=True
    )


def test_quantized_bundles_agree_with_float_on_greedy_argmax(tmp_path, peaked, capsys):
    """On the peaked tiny Muse. (The default one is chaotic, see build_muse_target: bf16 keeps ~82% of its
    argmaxes, 8-bit ~58%, 4-bit ~12%, which measures the checkpoint rather than the quantization.)"""
    logits = {}
    for label, kw in (
        ("float", dict(bits=16, dtype="float32")),
        ("bf16", dict(bits=16)),
        ("8-bit", dict(bits=8)),
        ("4-bit", dict(bits=4)),
        ("4-bit+8-bit embed/head", dict(bits=4, embed_bits=8)),
    ):
        out = tmp_path / label.replace("/", "-").replace("+", "-")
        convert(peaked, out, **kw)
        logits[label] = mlx_logits(out / "target")
    ref = logits.pop("float")
    figures = {k: agreement(v, ref) for k, v in logits.items()}
    other = ref.argmax(-1) != PROMPTS  # positions where float does not just repeat its input
    rest = {k: agreement(v[other], ref[other]) for k, v in logits.items()}
    with capsys.disabled():
        shown = ", ".join(f"{k} {v:.1%} ({rest[k]:.1%})" for k, v in figures.items())
        print(
            f"\n[convert] peaked tiny Muse, argmax agreement with float over {PROMPTS.size} positions "
            f"(in brackets: the {other.sum()} where float does not repeat its input): {shown}"
        )
    assert figures["8-bit"] >= 0.95, figures
    assert figures["4-bit"] >= 0.85, figures


# --- loaders and decoding -------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [4, 16])
def test_mlx_lm_opens_the_target_and_greedy_matches_our_loader(bundles, bits):
    import mlx_lm

    prompt = [tc.BOS_ID] + list(b"The converted bundle says")
    model, tokenizer = mlx_lm.load(str(bundles[bits] / "target"))
    theirs = [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=40)]
    pair = mlx_glimmer.load(bundles[bits], use_drafter=False)
    assert pair.drafter is None
    ours = mlx_glimmer.generate(pair, prompt, max_tokens=40, speculative=False).token_ids
    assert ours == theirs and len(ours) > 10


@pytest.mark.parametrize("bits", [4, 8])
def test_speculative_greedy_on_converted_bundle_equals_plain_greedy(bundles, bits):
    pair = mlx_glimmer.load(bundles[bits])
    assert pair.drafter is not None
    if bits < 16:
        assert isinstance(pair.drafter.model.layers[0].mlp.up_proj, nn.QuantizedLinear)
    prompt = [tc.BOS_ID] + list(b"Once upon a time")  # twice the window of 8
    plain = mlx_glimmer.generate(pair, prompt, max_tokens=60, speculative=False).token_ids
    spec = mlx_glimmer.generate(pair, prompt, max_tokens=60, block_size=4)
    assert spec.token_ids == plain


def test_report_on_stdout_unless_quiet(tmp_path, sources, capsys):
    assert main(["convert", "--target", str(sources["muse"]), "--out", str(tmp_path / "b"), "--bits", "8"]) == 0
    captured = capsys.readouterr()
    assert "dropped 25 non-text tensors" in captured.out and "bundle:" in captured.out
    assert captured.err == ""
    assert main(["convert", "--target", str(sources["muse"]), "--out", str(tmp_path / "b"), "--force", "--quiet"]) == 0
    captured = capsys.readouterr()
    assert captured.out == captured.err == ""


# --- bad input ----------------------------------------------------------------------------------------


def copy_source(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def break_missing_shard(tmp, s):
    muse = copy_source(s["muse"], tmp / "muse")
    victim = sorted(muse.glob("model-*.safetensors"))[2]
    victim.unlink()
    return ["--target", muse], [victim.name, "missing"]


def break_truncated(tmp, s):
    muse = copy_source(s["muse"], tmp / "muse")
    victim = sorted(muse.glob("model-*.safetensors"))[4]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    return ["--target", muse], [victim.name, "truncated"]


def break_model_type(tmp, s, value=None):
    muse = copy_source(s["muse"], tmp / "muse")
    cfg = json.loads((muse / "config.json").read_text())
    if value is None:
        del cfg["model_type"]
    else:
        cfg["model_type"] = value
    (muse / "config.json").write_text(json.dumps(cfg))
    return ["--target", muse], ["config.json", "model_type"] + ([value] if value else [])


def break_drafter_hidden(tmp, s):
    drafter = tc.build_assistant(tmp / "assistant", hidden=32, target_layer_ids=[1, 3, 5])
    return ["--target", s["muse"], "--drafter", drafter], [drafter / "config.json", "hidden_size"]


def break_drafter_layers(tmp, s):
    drafter = copy_source(s["assistant"], tmp / "assistant")
    cfg = json.loads((drafter / "config.json").read_text())
    cfg["target_layer_ids"] = [1, 3, 9]
    (drafter / "config.json").write_text(json.dumps(cfg))
    return ["--target", s["muse"], "--drafter", drafter], [drafter / "config.json", "target_layer_ids"]


def break_drafter_weights(tmp, s):
    drafter = copy_source(s["assistant"], tmp / "assistant")
    cfg = json.loads((drafter / "config.json").read_text())
    cfg["target_layer_ids"] = [1, 3]  # in range, but fc was trained on three layers
    (drafter / "config.json").write_text(json.dumps(cfg))
    return ["--target", s["muse"], "--drafter", drafter], [drafter / "model.safetensors", "encoder.fc.weight"]


def break_gguf_architecture(tmp, s):
    import gguf

    path = tmp / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return ["--target", path], [path, "architecture", "mamba"]


BREAKERS = {
    "missing-shard": break_missing_shard,
    "truncated-safetensors": break_truncated,
    "no-model-type": break_model_type,
    "unsupported-model-type": lambda tmp, s: break_model_type(tmp, s, "not_a_model"),
    "drafter-hidden-size": break_drafter_hidden,
    "drafter-target-layer-ids": break_drafter_layers,
    "drafter-fc-shape": break_drafter_weights,
    "gguf-architecture": break_gguf_architecture,
}


@pytest.mark.parametrize("case", list(BREAKERS))
def test_bad_input_is_one_error_line_and_leaves_nothing(tmp_path, sources, capsys, case):
    args, needles = BREAKERS[case](tmp_path, sources)
    out = tmp_path / "out" / "bundle"
    code = main(["convert", *map(str, args), "--out", str(out)])
    captured = capsys.readouterr()
    assert code != 0
    assert_one_error_line(captured.err, *needles)
    assert not out.parent.exists() or not leftovers(out)


def test_existing_out_needs_force(tmp_path, sources, capsys):
    out = tmp_path / "bundle"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["convert", "--target", str(sources["muse"]), "--out", str(out)]) != 0
    assert_one_error_line(capsys.readouterr().err, out, "--force")
    assert (out / "keep.txt").read_text() == "mine" and len(leftovers(out)) == 1
    assert main(["convert", "--target", str(sources["muse"]), "--out", str(out), "--force", "--quiet"]) == 0
    assert (out / "glimmer.json").is_file() and not (out / "keep.txt").exists() and len(leftovers(out)) == 1


def test_out_may_not_contain_a_source(tmp_path, sources, capsys):
    muse = copy_source(sources["muse"], tmp_path / "work" / "muse")
    assert main(["convert", "--target", str(muse), "--out", str(tmp_path / "work"), "--force"]) != 0
    assert_one_error_line(capsys.readouterr().err, "--out")
    assert (muse / "config.json").is_file()


def test_failure_while_writing_removes_the_staging_dir_and_keeps_the_old_bundle(tmp_path, sources, monkeypatch):
    out = tmp_path / "bundle"
    convert(sources["muse"], out, bits=8)
    before = (out / "glimmer.json").read_text()
    calls = []

    def flaky(self, start, stop):
        calls.append(self.name)
        if len(calls) > 20:
            raise OSError("disk full")
        return original(self, start, stop)

    original = TensorItem.produce
    monkeypatch.setattr(TensorItem, "produce", flaky)
    with pytest.raises(OSError, match="disk full"):
        convert(sources["muse"], out, bits=4, force=True)
    assert (out / "glimmer.json").read_text() == before
    assert leftovers(out) == [out]


def test_repo_id_without_network_is_one_error_line(tmp_path):
    out = tmp_path / "bundle"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_glimmer.cli",
            "convert",
            "--target",
            "meta-models/Muse-Glimmer-30B",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=slow_machine_timeout(),  # a watchdog: imports and a refused download
    )
    assert proc.returncode != 0
    assert_one_error_line(proc.stderr, "meta-models/Muse-Glimmer-30B")
    assert not leftovers(out)


# --- GGUF -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_unpack_to_mlx_triplets_exactly(tmp_path, qtype):
    """Our numpy repacking equals MLX's own GGUF reader, and dequantizes like the gguf package."""
    import gguf

    rng = np.random.default_rng(0)
    w = rng.normal(size=(48, 256)).astype(np.float32)
    kind = gguf.GGMLQuantizationType[qtype]
    blocks = gguf.quants.quantize(w, kind)
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.attn_q.weight", blocks, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    theirs = mx.load(str(path))
    ours = unpack_blocks(gguf.GGUFReader(path).tensors[0].data, qtype)
    for part, mine in zip(("weight", "scales", "biases"), ours):
        assert np.array_equal(np.array(theirs[f"blk.0.attn_q.{part}"]), mine), part
    bits = 8 if qtype == "Q8_0" else 4
    w, scales, biases = (mx.array(a) for a in ours)
    deq = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), group_size=32, bits=bits)
    assert np.allclose(np.array(deq), gguf.quants.dequantize(blocks, kind), atol=1e-6)


TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg developed a "
    "system of movable metal type in Mainz. Before that, books were copied by hand, usually by monks working in "
    "monasteries, and a single volume could take months to produce. Gutenberg combined several existing "
    "technologies: the screw press used for making wine and olive oil, oil-based inks, and a hand mould that "
    "allowed letters to be cast quickly and precisely. His most famous work, the Gutenberg Bible, was printed "
    "around 1455. Within fifty years, printing shops had spread to more than two hundred cities across Europe, "
    "and millions of books were in circulation. The effects were enormous. Ideas could travel faster than ever "
    "before, scholars could compare identical copies of a text, and literacy slowly began to rise among ordinary "
    "people. Historians often connect the press to the Reformation, the Scientific Revolution, and the growth of "
    'newspapers, although each of these developments also had many other causes. Today the word "press" still '
    "refers to journalism, a reminder of how closely the two have always been linked."
)


OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/libopenblas.so.0")
FORWARD = """
import sys, numpy as np, mlx.core as mx, mlx_lm
from mlx_lm.utils import dequantize_model
model = mlx_lm.load(sys.argv[1])[0]
dequantize_model(model)
model.set_dtype(mx.float32)
ids = np.load(sys.argv[2])
np.save(sys.argv[3], np.array(model(mx.array(ids[None]))[0]))
"""


def dequantized_forward(model_dir: Path, ids: list[int], tmp: Path):
    """Logits of a bundle's exact weights, dequantized and run in float32, computed in a process of its own
    while the caller goes on: returns a function that waits for them.

    MLX's quantized float16 CPU kernels take seconds per token; on Metal they run as they are.
    A fresh process can use Debian's OpenBLAS (docs/design.md, "Linux CPUs"), 20x MLX's bundled BLAS.
    """
    env = dict(os.environ)
    if OPENBLAS.exists() and "LD_PRELOAD" not in env:
        env["LD_PRELOAD"] = str(OPENBLAS)
    np.save(tmp / "ids.npy", np.array(ids))
    cmd = [sys.executable, "-c", FORWARD, str(model_dir), str(tmp / "ids.npy"), str(tmp / "logits.npy")]
    proc = subprocess.Popen(cmd, env=env)

    def logits() -> np.ndarray:
        try:
            proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, cmd)
        return np.load(tmp / "logits.npy")

    return logits


@pytest.mark.network
# Slow: the real 135M weights, converted, then read by transformers too. By default, GGUF blocks unpack exactly
# (above) and the demo pair, converted from this file, answers real text (test_demo.py).
@pytest.mark.slow
def test_gguf_smollm2_matches_transformers_on_real_text(tmp_path, capsys):
    import mlx_lm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = find_or_fetch_smollm2_gguf(REPO_CACHE)
    assert gguf_path.name == SMOLLM2_GGUF
    out = tmp_path / "smollm2"
    # --embed-bits 8 asks for the file's own Q8_0 embedding, so it is kept bit for bit like the Q4_1 blocks
    assert main(["convert", "--target", str(gguf_path), "--out", str(out), "--embed-bits", "8", "--quiet"]) == 0

    config = json.loads((out / "target" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 32
    assert config["quantization"]["model.embed_tokens"] == {"group_size": 32, "bits": 8, "mode": "affine"}
    assert config["rms_norm_eps"] == 1e-5 and config["dtype"] == "float16"

    # Kept bit for bit: the q rows are only reordered, the rest is MLX's own reading of the file.
    raw, metadata = mx.load(str(gguf_path), return_metadata=True)
    mine = weights_of(out / "target")
    for part in ("weight", "scales", "biases"):
        assert np.array_equal(
            np.array(raw[f"blk.5.ffn_up.{part}"]), np.array(mine[f"model.layers.5.mlp.up_proj.{part}"])
        )
        assert np.array_equal(np.array(raw[f"token_embd.{part}"]), np.array(mine[f"model.embed_tokens.{part}"]))

    tokenizer = mlx_lm.load(str(out / "target"))[1]
    ids = tokenizer.encode(TEXT)
    assert len(ids) >= 200
    ours = dequantized_forward(out / "target", ids, tmp_path)  # runs while transformers reads the file
    ref_model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    theirs = transformers_logits(ref_model.eval(), [ids])[0]
    ours = ours()
    agree = agreement(ours, theirs)
    with capsys.disabled():
        print(f"\n[convert] SmolLM2 GGUF bundle vs transformers: {agree:.1%} of {len(ids)} argmaxes agree")
    assert agree >= 0.99

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is a printing press?"},
        {"role": "assistant", "content": "A machine for printing."},
        {"role": "user", "content": "Who made it?"},
    ]
    own = metadata["tokenizer.chat_template"]
    bundle_tok = AutoTokenizer.from_pretrained(str(out / "target"))
    rendered = bundle_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == bundle_tok.apply_chat_template(
        messages, chat_template=own, tokenize=False, add_generation_prompt=True
    )
    assert rendered == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nWho made it?<|im_end|>" in rendered


# --- requested precision is never ignored ------------------------------------------------------------


def test_widths_the_group_size_does_not_divide_take_the_largest_group_that_does(tmp_path):
    src = tc.build_muse_target(tmp_path / "muse96", hidden=96, heads=4, kv_heads=2, head_dim=24, layers=2)
    out = tmp_path / "b"
    assert main(["convert", "--target", str(src), "--out", str(out), "--bits", "4", "--quiet"]) == 0
    config = json.loads((out / "target" / "config.json").read_text())
    q = config["quantization"]
    assert q["bits"] == 4
    weights = weights_of(out / "target")
    linear = [k for k in weights if k.endswith(("q_proj.weight", "down_proj.weight", "embed_tokens.weight"))]
    assert linear and all(weights[k].dtype == mx.uint32 for k in linear), "every linear weight is packed 4-bit"
    for name in linear:  # hidden 96 -> group 32; intermediate 192 -> the asked group 64
        base = name.removesuffix(".weight")
        width = weights[name].shape[-1] * 32 // 4
        group = width // weights[f"{base}.scales"].shape[-1]
        assert group == max(g for g in (128, 64, 32) if width % g == 0 and g <= 64), (name, width, group)
    applied = json.loads((out / "glimmer.json").read_text())["applied"]["target"]["quantized"]
    assert applied["4-bit/g32"] > 0 and applied["4-bit/g64"] > 0


def test_a_drafter_quantized_with_per_module_group_sizes_loads_and_stays_lossless(tmp_path, sources):
    """--group-size 128 on the tiny assistant: widths 64 and 192 take group 64 (per-module entries), width 128 the
    default; the drafter loader must honour each entry as mlx-lm does for the target."""
    out = tmp_path / "b"
    assert (
        main(
            [
                "convert",
                "--target",
                str(sources["muse"]),
                "--drafter",
                str(sources["assistant"]),
                "--out",
                str(out),
                "--bits",
                "16",
                "--dtype",
                "float32",
                "--drafter-bits",
                "4",
                "--group-size",
                "128",
                "--quiet",
            ]
        )
        == 0
    )
    q = json.loads((out / "drafter" / "config.json").read_text())["quantization"]
    assert q["group_size"] == 128 and q["layers.0.self_attn.q_proj"]["group_size"] == 64
    pair = mlx_glimmer.load(out)
    attn, mlp = pair.drafter.model.layers[0].self_attn, pair.drafter.model.layers[0].mlp
    assert (attn.q_proj.group_size, mlp.down_proj.group_size, pair.drafter.model.encoder.fc.group_size) == (64, 128, 64)
    prompt = [tc.BOS_ID] + list(b"Once upon a time")
    plain = mlx_glimmer.generate(pair, prompt, max_tokens=30, speculative=False).token_ids
    assert mlx_glimmer.generate(pair, prompt, max_tokens=30, block_size=4).token_ids == plain


def test_a_width_no_group_size_divides_is_one_error_line(tmp_path, capsys):
    src = tc.build_muse_target(tmp_path / "muse40", hidden=40, heads=2, kv_heads=1, head_dim=20, layers=2)
    out = tmp_path / "b"
    assert main(["convert", "--target", str(src), "--out", str(out), "--bits", "4"]) == 2
    assert_one_error_line(capsys.readouterr().err, "width 40", "group size 64")
    assert leftovers(out) == []


@pytest.mark.network
# Slow: converts the real 135M weights. By default, the asked width is honoured on tiny sources (above).
@pytest.mark.slow
def test_gguf_source_honours_bits(tmp_path):
    gguf_path = find_or_fetch_smollm2_gguf(REPO_CACHE)
    out = tmp_path / "q8"
    assert main(["convert", "--target", str(gguf_path), "--out", str(out), "--bits", "8", "--quiet"]) == 0
    config = json.loads((out / "target" / "config.json").read_text())
    q = config["quantization"]
    assert q["bits"] == 8 and q["group_size"] == 64
    assert not any(isinstance(v, dict) and v["bits"] != 8 for v in q.values()), "no tensor kept at the file's 4 bits"
    weights = weights_of(out / "target")
    assert weights["model.layers.5.mlp.up_proj.weight"].shape[-1] == 576 * 8 // 32
    applied = json.loads((out / "glimmer.json").read_text())["applied"]["target"]["quantized"]
    assert applied["8-bit/g64"] > 0 and all(k.startswith("8-bit/") for k in applied)  # the Q8_0 embedding keeps its g32
