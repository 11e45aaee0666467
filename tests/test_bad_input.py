"""Bad input never gets a traceback, a hang, silent garbage or a leftover (docs/design.md, "Design decisions").

Every example of bad input for the command line, the Python API, bench, distill, demo and chat's startup,
as a table of what the user typed and what the one `error:` line says. The property-based counterpart is
test_cli_properties.py; the server's 4xx bodies are the server's tests.
"""

from __future__ import annotations

import errno
import importlib
import io
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import pytest
from slow_machine import slow_machine_timeout

import mlx_glimmer
from mlx_glimmer import GenerationSettings, GlimmerError, SamplingParams
from mlx_glimmer.cli import main
from mlx_glimmer.settings import MAX_DRAFT_K

EXE = Path(sys.executable).parent / "mlx-glimmer"


def one_error_line(err: str, *needles: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, checkpoints):
    """A float target + DFlash drafter (block 16), laid out as a bundle."""
    root = tmp_path_factory.mktemp("bad-input") / "b"
    shutil.copytree(checkpoints["muse"], root / "target")
    shutil.copytree(checkpoints["assistant"], root / "drafter")
    (root / "glimmer.json").write_text(
        json.dumps({"format": "mlx-glimmer/1", "target": "target", "drafter": "drafter"})
    )
    return root


@pytest.fixture(scope="module")
def list_manifest(tmp_path_factory, bundle):
    """A bundle whose glimmer.json is `[1, 2]`."""
    root = tmp_path_factory.mktemp("bad-manifest") / "b"
    shutil.copytree(bundle, root)
    (root / "glimmer.json").write_text("[1, 2]")
    return root


@pytest.fixture()
def prompts(tmp_path):
    train, heldout = tmp_path / "train.jsonl", tmp_path / "heldout.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"Fact {i} about the sea?"}) + "\n" for i in range(3)))
    heldout.write_text(json.dumps({"prompt": "What colour is the sky?"}) + "\n")
    return ["--prompts", str(train), "--heldout", str(heldout)]


SMALL = ["--layers", "1", "--context-layers", "3"]  # a drafter the 6-layer tiny llama can feed


# ---- the command line: one `error:` line naming the flag, exit 2 ---------------------------------------

# (argv, what the error line says); BUNDLE is a real bundle, BROKEN one whose glimmer.json is [1, 2].
CLI_EXAMPLES = [
    (["generate", "BUNDLE", "--prompt", ""], "generate: --prompt is empty"),
    (
        ["generate", "BUNDLE", "--prompt", "Hi", "--temp", "0.7", "--seed", "-1"],
        "generate: --seed must be a whole number in [0, 2**63), got -1",
    ),
    (
        ["generate", "BUNDLE", "--prompt", "Hi", "--temp", "0.7", "--seed", str(2**70)],
        "--seed must be a whole number in [0, 2**63)",
    ),
    (["generate", "BROKEN", "--prompt", "Hi"], "glimmer.json: not a JSON object (got list)"),
    (["generate", "BUNDLE", "--prompt", "Hi", "--temp", "nan"], "generate: --temp must be a number >= 0, got nan"),
    (["generate", "BUNDLE", "--prompt", "Hi", "--temp", "inf"], "generate: --temp must be a number >= 0, got inf"),
    (
        ["generate", "BUNDLE", "--prompt", "Hi", "--max-tokens", "4", "--prompt-lookup", "--draft-k", "100000"],
        f"argument --draft-k: must be in [1, {MAX_DRAFT_K}], got 100000",
    ),
    (["bench", "BUNDLE", "--max-tokens", "-5"], "bench: argument --max-tokens: must be >= 1, got -5"),
    (["bench", "BUNDLE", "--max-tokens", "0"], "bench: argument --max-tokens: must be >= 1, got 0"),
    (["bench", "BUNDLE", "--repeats", "0"], "bench: argument --repeats: must be >= 1, got 0"),
    (["bench", "BUNDLE", "--num-prompts", "-1"], "bench: argument --num-prompts: must be >= 1, got -1"),
    (["bench", "BUNDLE", "--block-sizes", "4,zero"], "bench: --block-sizes"),
    (["demo", "--bits", "7"], "demo: argument --bits: invalid choice: 7"),
    (["chat", "BROKEN"], "glimmer.json: not a JSON object"),
    (["chat", "--temp", "nan"], "chat: --temp must be a number >= 0, got nan"),
    (["chat", "--seed", "-1"], "chat: --seed must be a whole number in [0, 2**63), got -1"),
]


@pytest.mark.parametrize("argv, says", CLI_EXAMPLES, ids=[" ".join(a) for a, _ in CLI_EXAMPLES])
def test_a_bad_flag_or_bundle_is_one_error_line(bundle, list_manifest, capsys, argv, says):
    argv = [{"BUNDLE": str(bundle), "BROKEN": str(list_manifest)}.get(a, a) for a in argv]
    assert main(argv) == 2
    one_error_line(capsys.readouterr().err, says)


def test_an_empty_stdin_prompt_is_one_error_line(bundle, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert main(["generate", str(bundle), "--prompt", "-"]) == 2
    one_error_line(capsys.readouterr().err, "generate: --prompt -: standard input is empty")


def lock_out(monkeypatch, locked: Path) -> None:
    """`locked` as a directory the user may not read (mode 000, not root): it is there, nothing in it can be
    listed or looked at. Simulated, so the test also runs as root, whom no mode keeps out."""
    real_stat, real_listdir, real_scandir = Path.stat, os.listdir, os.scandir

    def check(path) -> None:
        if Path(path) == locked or locked in Path(path).parents:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    def stat(self, **kwargs):
        if locked in self.parents:
            check(self)
        return real_stat(self, **kwargs)

    monkeypatch.setattr(Path, "stat", stat)
    monkeypatch.setattr(os, "listdir", lambda path=".": check(path) or real_listdir(path))
    monkeypatch.setattr(os, "scandir", lambda path=".": check(path) or real_scandir(path))


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("inside", ["", "target"], ids=["bundle", "its target"])
def test_a_directory_the_user_cannot_read_is_one_error_line(bundle, capsys, monkeypatch, command, inside):
    locked = bundle / inside if inside else bundle
    lock_out(monkeypatch, locked)
    argv = [command, str(bundle), *(["--prompt", "Hi"] if command == "generate" else [])]
    assert main(argv) != 0
    one_error_line(capsys.readouterr().err, f"{locked}: cannot read", "Permission denied")


def test_a_directory_without_read_permission_is_one_error_line(bundle, tmp_path, capsys):
    """The same with a real mode 000, where it keeps the user out (not as root)."""
    locked = tmp_path / "locked"
    shutil.copytree(bundle, locked)
    locked.chmod(0)
    try:
        if os.access(locked, os.R_OK):
            pytest.skip("this user reads a directory of mode 000 (root): the simulated test covers it")
        assert main(["generate", str(locked), "--prompt", "Hi"]) != 0
        one_error_line(capsys.readouterr().err, f"{locked}: cannot read")
    finally:
        locked.chmod(0o755)


# ---- files that are not regular files: named at once, never waited on ----------------------------------


@contextmanager
def never_waits_on(fifo: Path, within: float = 120.0):
    """Fail rather than hang where a reader waits on `fifo`: after `within` seconds a writer opens it and closes
    it at once, again and again (each waiting reader then reads an empty file), and the test fails on time.
    `within` is far beyond what naming the file takes on a busy machine: it only tells a wait from none."""
    done = threading.Event()

    def unblock():
        if done.wait(within):
            return
        while not done.is_set():
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:  # no reader at the moment
                time.sleep(0.05)

    thread = threading.Thread(target=unblock, daemon=True)
    thread.start()
    start = time.monotonic()
    try:
        yield
    finally:
        done.set()
        thread.join()
    assert time.monotonic() - start < within, f"waited on {fifo}"


def make_fifo(path: Path) -> Path:
    if path.exists():
        path.unlink()
    os.mkfifo(path)
    return path


# (where in the bundle, the file made a FIFO); "first shard" is the target's first weight shard
FIFO_PLACES = [
    ("target", "config.json"),
    ("target", "tokenizer.json"),
    ("target", "first shard"),
    ("drafter", "model.safetensors"),
    ("drafter", "config.json"),
    ("", "glimmer.json"),
]


@pytest.mark.parametrize("inside, name", FIFO_PLACES, ids=[f"{i or 'bundle'}/{n}" for i, n in FIFO_PLACES])
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_a_fifo_where_a_model_file_belongs_is_one_error_line_at_once(
    bundle, tmp_path, capsys, monkeypatch, command, inside, name
):
    from mlx_glimmer.tui.app import ChatApp

    monkeypatch.setattr(ChatApp, "run", lambda app: pytest.fail("the app started"))
    copy = tmp_path / "b"
    shutil.copytree(bundle, copy)
    folder = copy / inside if inside else copy
    if name == "first shard":
        name = sorted(folder.glob("model-*.safetensors"))[0].name
    fifo = make_fifo(folder / name)
    argv = ["generate", str(copy), "--prompt", "Hi", "--max-tokens", "2"] if command == "generate" else []
    argv = argv or ["chat", str(copy), "--no-history"]
    with never_waits_on(fifo):
        assert main(argv) == 2
    one_error_line(capsys.readouterr().err, str(fifo), "FIFO", "not a regular file")


def test_a_device_or_a_dangling_link_where_weights_belong_is_one_error_line(bundle, tmp_path, capsys):
    copy = tmp_path / "b"
    shutil.copytree(bundle, copy)
    weights = copy / "drafter" / "model.safetensors"
    weights.unlink()
    weights.symlink_to("/dev/zero")  # a link to a device: reading it never ends
    assert main(["generate", str(copy), "--prompt", "Hi", "--max-tokens", "2"]) == 2
    one_error_line(capsys.readouterr().err, str(weights), "character device")
    weights.unlink()
    weights.symlink_to(tmp_path / "gone.safetensors")
    assert main(["generate", str(copy), "--prompt", "Hi", "--max-tokens", "2"]) == 2
    one_error_line(capsys.readouterr().err, str(weights), "symbolic link to nothing")


def test_the_api_refuses_a_fifo_in_a_model_directory(checkpoints, tmp_path):
    target = tmp_path / "llama"
    shutil.copytree(checkpoints["llama"], target)
    fifo = make_fifo(target / "model.safetensors")
    with never_waits_on(fifo), pytest.raises(GlimmerError, match="FIFO"):
        mlx_glimmer.load(target=target)


@pytest.mark.parametrize("what", ["shard", "config.json", "tokenizer.json", "gguf"])
def test_convert_refuses_a_fifo_source_file_at_once_and_writes_nothing(checkpoints, tmp_path, capsys, what):
    out = tmp_path / "out" / "bundle"
    if what == "gguf":
        fifo = make_fifo(tmp_path / "model.gguf")
        source = fifo
    else:
        source = tmp_path / "muse"
        shutil.copytree(checkpoints["muse"], source)
        name = sorted(source.glob("model-*.safetensors"))[0].name if what == "shard" else what
        fifo = make_fifo(source / name)
    with never_waits_on(fifo):
        assert main(["convert", "--target", str(source), "--out", str(out), "--quiet"]) == 2
    one_error_line(capsys.readouterr().err, str(fifo), "FIFO")
    assert not out.parent.exists() or not list(out.parent.iterdir())


def test_distill_refuses_a_fifo_in_its_init_drafter_before_run(checkpoints, prompts, tmp_path, capsys):
    init = tmp_path / "init"
    shutil.copytree(checkpoints["assistant"], init)
    fifo = make_fifo(init / "model.safetensors")
    run = tmp_path / "run"
    with never_waits_on(fifo):
        argv = ["distill", str(checkpoints["llama"]), "--out", str(run), *prompts, *SMALL, "--init", str(init)]
        assert main(argv) == 2
    one_error_line(capsys.readouterr().err, str(fifo), "FIFO")
    assert not run.exists()


def test_chat_with_a_broken_bundle_stops_before_the_app(list_manifest, capsys, monkeypatch):
    from mlx_glimmer.tui.app import ChatApp

    monkeypatch.setattr(ChatApp, "run", lambda app: pytest.fail("the app started"))
    assert main(["chat", str(list_manifest), "--no-history"]) == 2
    one_error_line(capsys.readouterr().err, str(list_manifest / "glimmer.json"))


def test_demo_flag_mistakes_print_nothing_before_the_error(tmp_path, capsys):
    file = tmp_path / "a-file"
    file.write_text("x")
    assert main(["demo", "--dtype", "float8"]) == 2
    one_error_line(capsys.readouterr().err, "--dtype")
    assert main(["demo", "--out", str(file)]) == 2
    one_error_line(capsys.readouterr().err, "demo: --out", "not a directory")


# ---- widths: bounded by what the drafter can use, calibration counted in ttft --------------------------


def test_block_size_beyond_the_drafters_block_is_capped(bundle, capsys):
    assert (
        main(
            [
                "generate",
                str(bundle),
                "--prompt",
                "Hello there",
                "--max-tokens",
                "40",
                "--block-size",
                "100000",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert max(int(w) for w in out["verify_width_histogram"]) <= 16  # the drafter's block
    assert max(out["acceptance_lengths"]) <= 16


def test_block_size_cap_in_the_api_and_its_stats(muse_pair):
    result = mlx_glimmer.generate(muse_pair, "Hello", max_tokens=30, block_size=100000)
    assert result.stats.block_size == muse_pair.drafter.block_size == 16
    assert max(result.stats.verify_widths) <= 16
    assert result.token_ids == mlx_glimmer.generate(muse_pair, "Hello", max_tokens=30, speculative=False).token_ids


def test_prompt_lookup_width_calibration_is_bounded_and_counted_in_ttft(checkpoints, monkeypatch):
    from mlx_glimmer.verify_cost import BANDS, VerifyCost

    generate_module = importlib.import_module("mlx_glimmer.generate")
    widths = []

    def slow_calibration(target, max_width, vocab_size, key, directory, on_measure=None):  # it takes 0.4 s
        widths.append(max_width)
        time.sleep(0.4)
        return VerifyCost(max_width, [[1e-3 * w for w in range(1, max_width + 1)] for _ in BANDS])

    monkeypatch.setattr(generate_module, "cached_verify_cost", slow_calibration)
    with pytest.raises(GlimmerError, match="draft_k"):
        mlx_glimmer.load(target=checkpoints["muse"], prompt_lookup=True, draft_k=MAX_DRAFT_K + 1)
    pair = mlx_glimmer.load(target=checkpoints["muse"], prompt_lookup=True, draft_k=MAX_DRAFT_K)
    result = mlx_glimmer.generate(pair, "Hi", max_tokens=4)
    assert widths == [MAX_DRAFT_K + 1]  # a table up to 17, never up to K+1 for a K the user typed
    assert result.stats.ttft_s >= 0.4  # the calibration is part of the wait for the first token


# ---- the Python API: GlimmerError naming the argument ---------------------------------------------------

API_EXAMPLES = [
    ("Hi", {"max_tokens": 0}, "max_tokens must be a whole number >= 1, got 0"),
    ("Hi", {"max_tokens": -1}, "max_tokens must be a whole number >= 1, got -1"),
    ("Hi", {"temperature": float("nan")}, "temperature must be a number >= 0, got nan"),
    ("Hi", {"temperature": float("inf")}, "temperature must be a number >= 0, got inf"),
    ("", {}, "prompt: the prompt is empty"),
    ([{"role": "user", "content": None}], {}, "prompt[0]['content'] must be a string, got NoneType"),
    ("Hi", {"temperature": 0.7, "seed": -1}, "seed must be a whole number in [0, 2**63), got -1"),
    ("Hi", {"temperature": 0.7, "seed": 2**63}, "seed must be a whole number in [0, 2**63)"),
    ("Hi", {"top_k": 2.5}, "top_k must be a whole number >= 0, got 2.5"),
    ("Hi", {"max_tokens": True}, "max_tokens must be a whole number >= 1, got True"),
]


@pytest.mark.parametrize("prompt, kwargs, says", API_EXAMPLES, ids=[s for _, _, s in API_EXAMPLES])
def test_api_mistakes_raise_glimmer_error_naming_the_argument(muse_pair, prompt, kwargs, says):
    with pytest.raises(GlimmerError) as e:
        mlx_glimmer.generate(muse_pair, prompt, **{"max_tokens": 3, **kwargs})
    assert says in str(e.value)


@pytest.mark.parametrize(
    "make, says",
    [
        (lambda: SamplingParams(temperature=float("nan")), "temperature"),
        (lambda: SamplingParams(top_p=float("inf")), "top_p"),
        (lambda: SamplingParams(top_k=2.5), "top_k"),
        (lambda: GenerationSettings(max_tokens=0), "max_tokens"),
        (lambda: GenerationSettings(seed=-1), "seed"),
        (lambda: GenerationSettings(seed=2**70), "seed"),
        (lambda: GenerationSettings(seed=1.5), "seed"),
    ],
)
def test_every_setting_is_refused_when_made(make, says):
    with pytest.raises(GlimmerError, match=says):
        make()


def test_the_largest_seed_and_one_token_are_fine(muse_pair):
    result = mlx_glimmer.generate(muse_pair, "Hi", max_tokens=1, temperature=0.7, seed=2**63 - 1)
    assert len(result.token_ids) <= 1 and result.stats.finish_reason in ("stop", "length")


# ---- distill: every flag before any work, RUN made only then, never a broken drafter ---------------------

DISTILL_EXAMPLES = [
    (["--steps", "0"], "argument --steps: must be >= 1, got 0"),
    (["--anchors", "0"], "argument --anchors: must be >= 1, got 0"),
    (["--sequences-per-step", "0"], "argument --sequences-per-step: must be >= 1, got 0"),
    (["--eval-every", "0"], "argument --eval-every: must be >= 1, got 0"),
    (["--mask-token", "999999"], "--mask-token must be in [0, "),
    (["--answer-tokens", "-5"], "argument --answer-tokens: must be >= 1, got -5"),
    (["--batch-size", "0"], "argument --batch-size: must be >= 1, got 0"),
    (["--layers", "0"], "argument --layers: must be >= 1, got 0"),
    (["--draft-vocab", "most"], "argument --draft-vocab: must be 'all' or a whole number >= 1, got 'most'"),
    (["--draft-vocab", "100000"], "--draft-vocab must be in [1, 272] (the target's vocabulary), got 100000"),
    (["--mlp-width", "0"], "argument --mlp-width: must be a finite number > 0, got 0.0"),
    (["--lr", "nan"], "argument --lr: must be a finite number > 0, got nan"),
    (["--lr", "-1"], "argument --lr: must be a finite number > 0"),
    (["--context-layers", "99"], "--context-layers must be in [1, 3] for a 6-layer target, got 99"),
    (["--layers", "7"], "--layers must be in [1, 6]"),
    (["--temperatures", "0,nan"], "--temperatures"),
    (["--init", "/missing"], "--init /missing: neither 'random', 'target', 'target:L1,L2,...' nor a drafter directory"),
    (["--init", "target:5,x"], "--init target:5,x: not 'target:' and comma-separated target layer numbers"),
    (["--init", "target:1,2"], "--init target:1,2: names 2 layers for a 1-layer drafter"),
    (["--init", "target:6"], "--init target:6: layers [6] out of range for a 6-layer target"),
    (["--init", "target:1,1", "--layers", "3"], "--init target:1,1: layers [1] named more than once"),
    (["--seed", "-1"], "argument --seed: must be in [0, 2**63)"),
    (["--train-tags", "greedy,warm"], "--train-tags 'greedy,warm': tags are greedy, followup or t<temperature>"),
    (["--context-scale", "layer"], "argument --context-scale: invalid choice: 'layer'"),
    (["--soft-labels", "1.5"], "argument --soft-labels: must be a number in [0, 1], got 1.5"),
    (["--soft-labels", "nan"], "argument --soft-labels: must be a number in [0, 1], got nan"),
]


@pytest.mark.parametrize("flags, says", DISTILL_EXAMPLES, ids=[" ".join(f) for f, _ in DISTILL_EXAMPLES])
@pytest.mark.parametrize("mode", ["train-only", "full"])
def test_distill_refuses_a_bad_flag_before_making_run(checkpoints, prompts, tmp_path, capsys, flags, says, mode):
    run = tmp_path / "run"
    if mode == "train-only":  # answers already there: the flags are all that can be wrong
        (run / "data").mkdir(parents=True)
        (run / "data" / "responses.jsonl").write_text("")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    extra = ["--train-only"] if mode == "train-only" else []
    assert main(["distill", str(checkpoints["llama"]), "--out", str(run), *prompts, *SMALL, *extra, *flags]) == 2
    one_error_line(capsys.readouterr().err, says)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # no RUN, nothing written


def test_distill_out_on_an_existing_file(checkpoints, prompts, tmp_path, capsys):
    file = tmp_path / "run"
    file.write_text("not a folder")
    assert main(["distill", str(checkpoints["llama"]), "--out", str(file), *prompts]) == 2
    one_error_line(capsys.readouterr().err, "--out", "not a directory")


def test_distill_refuses_a_malformed_prompt_file_before_run(checkpoints, prompts, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{not json\n')
    run = tmp_path / "run"
    assert (
        main(["distill", str(checkpoints["llama"]), "--out", str(run), "--prompts", str(bad), *prompts[2:], *SMALL])
        == 2
    )
    one_error_line(capsys.readouterr().err, str(bad), "line 2")
    assert not run.exists()


def _checkpoint(path: Path, weights: dict) -> Path:
    path.mkdir(parents=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text("{}")
    return path


def test_distill_never_exports_non_finite_weights_or_an_empty_stack(tmp_path):
    from mlx_glimmer.distill.run import UnusableDrafter, export, export_best

    fine = {
        "layers.0.mlp.down_proj.weight": mx.ones((2, 2)),
        "fc.weight": mx.ones((2, 4)),
        "draft_vocab": mx.array([0, 1], dtype=mx.int32),
    }
    nan = {**fine, "fc.weight": mx.full((2, 4), float("nan"))}
    huge = {**fine, "fc.weight": mx.full((2, 4), 1e6)}  # finite in float32, infinite once exported as float16
    empty = {"fc.weight": mx.ones((2, 4)), "draft_vocab": mx.array([0, 1], dtype=mx.int32)}
    for name, weights, says in [
        ("nan", nan, "non-finite"),
        ("huge", huge, "non-finite"),
        ("empty", empty, "no layers"),
    ]:
        with pytest.raises(UnusableDrafter, match=says):
            export(_checkpoint(tmp_path / name, weights), tmp_path / f"{name}-drafter")
        assert not (tmp_path / f"{name}-drafter").exists()

    run = tmp_path / "run"
    _checkpoint(run / "step000002", fine)
    _checkpoint(run / "step000004", nan)
    evaluations = [{"step": 2, "mean_acceptance": 1.2}, {"step": 4, "mean_acceptance": 9.0}]  # NaN "accepts" all
    assert export_best(evaluations, run)["step"] == 2
    assert (run / "drafter" / "model.safetensors").is_file()
    shutil.rmtree(run / "step000002")
    _checkpoint(run / "step000002", nan)
    with pytest.raises(GlimmerError, match="no checkpoint can be exported"):
        export_best(evaluations, run)


# ---- refused in well under a second, before the BLAS re-exec and any heavy import ------------------------

FAST_REFUSALS = [
    ["generate", "--temp", "nan", "--prompt", "hi"],
    ["generate", "--bogus"],
    ["bench", "--repeats", "0"],
    ["distill", "--out", "RUN", "--layers", "0"],
    ["demo", "--bits", "7"],
    ["chat", "--temp", "inf"],
    ["serve", "--top-p", "2"],
    ["convert", "--bits", "7", "--target", "x", "--out", "y"],
]


def test_bad_flags_are_refused_before_the_blas_reexec_and_heavy_imports(tmp_path):
    script = f"""
import json, sys
import mlx_glimmer.blas as blas
reexecs = []
blas.ensure_fast_blas = lambda cache, torch_first=False: reexecs.append(str(cache))
from mlx_glimmer.cli import main
codes = []
for argv in {[[a.replace("RUN", str(tmp_path / "run")) for a in argv] for argv in FAST_REFUSALS]!r}:
    sys.argv = ["mlx-glimmer", *argv]
    codes.append(main())
heavy = sorted(m for m in ("mlx", "mlx_lm", "transformers", "torch", "numpy", "fastapi") if m in sys.modules)
print(json.dumps({{"codes": codes, "reexecs": reexecs, "heavy": heavy}}))
"""
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=slow_machine_timeout(),
        env={**os.environ, "MLX_GLIMMER_BLAS": ""},
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report == {"codes": [2] * len(FAST_REFUSALS), "reexecs": [], "heavy": []}
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == len(FAST_REFUSALS) and all(ln.startswith("error: ") for ln in lines), proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv", [FAST_REFUSALS[0], FAST_REFUSALS[3], FAST_REFUSALS[5]], ids=lambda a: a[0])
def test_the_installed_command_refuses_a_bad_flag_before_heavy_imports_and_the_blas_reexec(tmp_path, argv):
    argv = [a.replace("RUN", str(tmp_path / "run")) for a in argv]
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}  # every import, on stderr, in every process image
    proc = subprocess.run([str(EXE), *argv], capture_output=True, text=True, timeout=slow_machine_timeout(), env=env)
    assert proc.returncode == 2
    imports = [ln.rsplit("|", 1)[1].strip() for ln in proc.stderr.splitlines() if ln.startswith("import time:")]
    one_error_line("\n".join(ln for ln in proc.stderr.splitlines() if not ln.startswith("import time:")))
    assert imports.count("mlx_glimmer.cli") == 1  # a re-executed process would import it again
    heavy = {"mlx", "mlx_lm", "transformers", "torch", "numpy", "fastapi"}
    assert not heavy & {name.split(".")[0] for name in imports}
