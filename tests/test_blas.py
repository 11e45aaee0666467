"""On Linux the command line finds a fast BLAS by itself, checks that MLX really uses it, and says so when it cannot."""

import json
import os
import subprocess
import sys

import pytest

from mlx_glimmer import blas

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the BLAS switch is Linux-only (macOS uses Metal)"
)

PROBE = "import mlx.core as mx; from mlx_glimmer.blas import sgemm_library; print(sgemm_library())"


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "LD_LIBRARY_PATH", blas.ENV)}
    env.update(extra)
    return env


def test_the_command_line_runs_on_an_optimized_blas_without_ld_preload():
    """The package depends on cmeel-openblas on Linux, so one can always be had; `--version` reports what MLX calls."""
    out = subprocess.run(
        [sys.executable, "-m", "mlx_glimmer.cli", "--version"],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "openblas" in out.stdout.lower(), out.stdout
    assert "warning" not in out.stderr


def test_reference_opt_out_keeps_mlx_own_blas():
    out = subprocess.run(
        [sys.executable, "-m", "mlx_glimmer.cli", "--version"],
        env=clean_env(MLX_GLIMMER_BLAS="reference"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0 and "reference BLAS" in out.stdout, out.stdout


def test_the_wheel_openblas_loads_with_numpys_gfortran_when_the_system_has_none(tmp_path, monkeypatch):
    monkeypatch.setattr(blas, "SYSTEM_PATHS", ())
    monkeypatch.setattr(blas, "system_libraries", lambda soname: [])
    choice = blas.find_openblas(tmp_path / "links")
    assert choice is not None and choice.library.endswith("cmeel.prefix/lib/libopenblas.so.0")
    assert choice.library_path == str(tmp_path / "links") and (tmp_path / "links" / "libgfortran.so.5").exists()
    env = clean_env(LD_PRELOAD=choice.library, LD_LIBRARY_PATH=choice.library_path)
    code = (
        PROBE
        + "; import pathlib; print(any('numpy.libs/libgfortran' in l for l in pathlib.Path('/proc/self/maps').read_text().splitlines()))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    library, numpy_gfortran = out.stdout.split()
    assert library == choice.library or os.path.realpath(library) == os.path.realpath(choice.library), out
    assert numpy_gfortran == "True", "libgfortran came from numpy's wheel, as the links say"


def test_the_choice_does_not_depend_on_what_this_process_has_loaded(tmp_path, monkeypatch):
    """Asked from a process that already runs on the wheel's OpenBLAS (as the re-executed test run does), the
    choice still carries what a fresh process needs: the links to numpy's libgfortran."""
    monkeypatch.setattr(blas, "SYSTEM_PATHS", ())
    monkeypatch.setattr(blas, "system_libraries", lambda soname: [])
    code = (
        "import ctypes, pathlib, sys; from mlx_glimmer import blas; "
        "blas.SYSTEM_PATHS = (); blas.system_libraries = lambda soname: []; "
        "c = blas.find_openblas(pathlib.Path(sys.argv[1])); print(c.library, c.library_path)"
    )
    first = blas.find_openblas(tmp_path / "links")
    env = clean_env(LD_PRELOAD=first.library, LD_LIBRARY_PATH=first.library_path)
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "again")], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [first.library, str(tmp_path / "again")]


def test_a_stale_loader_cache_entry_is_not_a_library(monkeypatch, tmp_path):
    real = tmp_path / "libgfortran.so.5"
    real.write_bytes(b"")
    listing = (
        "3 libs found in cache `/etc/ld.so.cache'\n"
        "\tlibgfortran.so.5 (libc6,x86-64) => /gone/libgfortran.so.5\n"
        f"\tlibgfortran.so.5 (libc6,x86-64) => {real}\n"
        f"\tlibquadmath.so.0 (libc6,x86-64) => {real}\n"
    )
    monkeypatch.setattr(blas.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=listing))
    assert blas.system_libraries("libgfortran.so.5") == [str(real)]
    assert blas.system_libraries("libopenblas.so.0") == []


def test_a_library_that_cannot_multiply_on_this_cpu_is_never_preloaded(tmp_path, monkeypatch):
    """A build for instructions this CPU lacks dies in a child process, not in the command: the next one is taken,
    and the verdict is remembered per library file and CPU."""
    broken = tmp_path / "libopenblas.so.0"
    broken.write_bytes(b"not a library: loading it fails, as an AVX-512 build fails on an AVX2 CPU")
    monkeypatch.setattr(blas, "SYSTEM_PATHS", (str(broken),))
    monkeypatch.setattr(blas, "system_libraries", lambda soname: [])
    choice = blas.find_openblas(tmp_path / "cache")
    assert choice is not None and choice.library.endswith("cmeel.prefix/lib/libopenblas.so.0")
    verdicts = [json.loads(f.read_text()) for f in (tmp_path / "cache").glob("works-*.json")]
    assert {(v["library"], v["works"]) for v in verdicts} == {(str(broken), False), (choice.library, True)}

    def no_child(*args, **kwargs):
        raise AssertionError("a remembered verdict needs no child process")

    monkeypatch.setattr(blas.subprocess, "run", no_child)
    assert blas.find_openblas(tmp_path / "cache") == choice


def test_when_no_library_runs_the_warning_names_them(tmp_path, monkeypatch, capsys):
    broken = tmp_path / "libopenblas.so.0"
    broken.write_bytes(b"not a library")
    monkeypatch.delenv(blas.ENV, raising=False)
    monkeypatch.setenv("LD_PRELOAD", "")
    monkeypatch.setattr(blas, "candidates", lambda cache: [blas.BlasChoice(str(broken))])
    monkeypatch.setattr(blas, "_warned", False)
    assert blas.reexec_env(tmp_path / "cache") is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"no OpenBLAS here runs on this CPU ({broken})" in err[0] and "apt-get" in err[0]


def test_no_fast_blas_is_one_warning_line_with_the_fix(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv(blas.ENV, raising=False)
    monkeypatch.setenv("LD_PRELOAD", "")
    monkeypatch.setattr(blas, "candidates", lambda cache: [])
    monkeypatch.setattr(blas, "_warned", False)
    blas.ensure_fast_blas(tmp_path)
    blas.ensure_fast_blas(tmp_path)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: ") and "apt-get install libopenblas0-pthread" in err[0]


def test_the_blas_never_changes_greedy_tokens_but_keys_the_verify_cost_tables(llama_pair, checkpoints, tmp_path):
    """Same tiny pair, plain greedy, reference BLAS versus OpenBLAS: the same token ids; and each run called
    the BLAS it names (a preload the loader ignores would compare the reference BLAS with itself). Verify costs
    differ tenfold between the two, so a table timed on one is never read on the other."""
    code = (
        "import json, sys; import mlx_glimmer; from mlx_glimmer.blas import sgemm_library; "
        "pair = mlx_glimmer.load(target=sys.argv[1], drafter=sys.argv[2]); "
        "r = mlx_glimmer.generate(pair, list(range(260, 0, -9))[:24], max_tokens=40, speculative=False); "
        "print(json.dumps({'tokens': r.token_ids, 'sgemm': sgemm_library(), 'key': pair.device_key}))"
    )
    choice = blas.find_openblas(tmp_path / "links")
    assert choice is not None, "the package depends on cmeel-openblas on Linux"
    envs = {
        "reference": clean_env(MLX_GLIMMER_BLAS="reference"),
        "openblas": clean_env(
            LD_PRELOAD=choice.library, **({"LD_LIBRARY_PATH": choice.library_path} if choice.library_path else {})
        ),
    }
    argv = [sys.executable, "-c", code, str(checkpoints["llama"]), str(checkpoints["llama_assistant"])]
    procs = {  # both at once: each is mostly its imports
        name: subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, env in envs.items()
    }
    runs = {}
    for name, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 0, stderr
        runs[name] = json.loads(stdout.strip().splitlines()[-1])
    assert os.path.realpath(runs["openblas"]["sgemm"]) == os.path.realpath(choice.library), runs["openblas"]["sgemm"]
    assert not blas.is_fast(runs["reference"]["sgemm"]), runs["reference"]["sgemm"]
    assert runs["reference"]["tokens"] == runs["openblas"]["tokens"] and len(runs["openblas"]["tokens"]) == 40
    assert "BLAS reference" in runs["reference"]["key"] and "openblas" in runs["openblas"]["key"].lower(), runs


TORCH_AND_MLX = (
    "import sys; from pathlib import Path; from mlx_glimmer.blas import ensure_fast_blas; "
    "ensure_fast_blas(Path(sys.argv[1]), torch_first=sys.argv[2] == 'torch-first'); "
    "import mlx.core as mx, torch; mx.eval(mx.ones((8, 8)) @ mx.ones((8, 8))); torch.ones(8, 8) @ torch.ones(8, 8)"
)


def sgemm_bindings(tmp_path, order: str) -> set[tuple[str, str, str]]:
    """(library, bound to, symbol) for every `sgemm_` / `cblas_sgemm` binding the dynamic loader made in a process
    set up by `ensure_fast_blas` (and its re-execution), as `LD_DEBUG=bindings` reports them."""
    debug = tmp_path / order
    debug.mkdir()
    env = clean_env(LD_DEBUG="bindings", LD_DEBUG_OUTPUT=str(debug / "ld"))
    out = subprocess.run(
        [sys.executable, "-c", TORCH_AND_MLX, str(tmp_path / "cache"), order],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    found = set()
    for path in debug.iterdir():
        for line in path.read_text(errors="replace").splitlines():
            if "binding file" in line and ("`sgemm_'" in line or "`cblas_sgemm'" in line):
                parts = line.split()
                library, bound = parts[parts.index("file") + 1], parts[parts.index("to") + 1]
                found.add((os.path.basename(library), os.path.basename(bound), parts[-1].strip("`'")))
    return found


def test_a_command_that_runs_torch_keeps_torchs_own_blas_while_mlx_gets_openblas(tmp_path):
    """A preloaded OpenBLAS interposes torch's `sgemm_` calls as well as MLX's; a command that runs torch
    (`distill`, `--backend torch`) loads it after torch instead, so MLX binds to it and torch keeps its own."""
    pytest.importorskip("torch")
    preloaded = sgemm_bindings(tmp_path, "preload")
    assert ("libtorch_cpu.so", "libopenblas.so.0", "sgemm_") in preloaded, preloaded
    torch_first = sgemm_bindings(tmp_path, "torch-first")
    assert ("libtorch_cpu.so", "libtorch_cpu.so", "sgemm_") in torch_first, torch_first
    assert ("libmlx.so", "libopenblas.so.0", "cblas_sgemm") in torch_first, torch_first
    assert not any(lib == "libtorch_cpu.so" and "openblas" in bound for lib, bound, _ in torch_first), torch_first


def test_a_command_that_runs_torch_is_named_so_before_the_reexec():
    from mlx_glimmer.cli import build_parser, runs_torch

    parse = build_parser().parse_args
    assert runs_torch(parse(["distill", "--out", "run"]))
    assert runs_torch(parse(["generate", "--prompt", "hi", "--backend", "torch"]))
    assert not runs_torch(parse(["generate", "--prompt", "hi"]))
    assert not runs_torch(parse(["chat"]))
