"""Fast CPU matrix products on Linux without the user's help.

MLX's Linux CPU wheel (`mlx[cpu]`) carries a reference BLAS: float32 matmuls
run ~6 GFLOP/s there against ~100-200 with OpenBLAS, and only a preload
reaches MLX (the wheel links its own `libblas`, so the system's BLAS
alternatives do not). So the `mlx-glimmer` command re-executes itself once
with an OpenBLAS in `LD_PRELOAD`, picked in this order:

1. the system's `libopenblas.so.0` (for example Debian's `libopenblas0-pthread`);
2. the `cmeel-openblas` wheel, a dependency of this package on Linux
   (standard symbol names). It needs `libgfortran.so.5`: numpy's bundled copy,
   exposed under its standard name through a folder of links in the cache (put
   on `LD_LIBRARY_PATH`), or else the system's.

What a fresh process can load is decided from files (the loader cache, the
disk), never by `dlopen` in this process, which may have loaded them already.

A candidate is preloaded only after a child process ran one `cblas_sgemm`
with it and got the right product: a build for a newer CPU than this one
(an AVX-512 kernel on an AVX2 machine, say) dies of an illegal instruction in
the child, never in the user's command. The verdict is kept in the cache per
library file and CPU. The re-executed process checks that `cblas_sgemm` really
resolves into the chosen library; when no fast BLAS can be had it says so
once, in one line, with the fix.

A command that runs torch in the same process (`distill`, `--backend torch`)
is re-executed without the preload: a preloaded OpenBLAS interposes torch's
own `sgemm_` calls too (ELF symbol interposition), and torch's float32
products run on its bundled MKL faster than on OpenBLAS. There the chosen
library is loaded into the global symbol scope after torch is imported and
before MLX is, so MLX's `cblas_sgemm` binds to OpenBLAS and torch keeps its
own (`LD_DEBUG=bindings` shows both bindings; a test reads them).
BLAS choice never changes results beyond float rounding of the matmuls.
macOS is untouched (Metal). `MLX_GLIMMER_BLAS=reference` turns all of this off.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from .cpu import cpu_flags

ENV = "MLX_GLIMMER_BLAS"  # set by the re-exec to the preloaded path; "reference" disables the switch
SYSTEM_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
    "/usr/local/lib/libopenblas.so.0",
)
FIX = "apt-get install libopenblas0-pthread (or pip install cmeel-openblas); MLX_GLIMMER_BLAS=reference silences this"
_warned = False


@dataclass(frozen=True)
class BlasChoice:
    library: str  # path to preload
    library_path: str | None = None  # a folder to put on LD_LIBRARY_PATH (links to its dependencies)


def system_libraries(soname: str) -> list[str]:
    """The files the dynamic loader's cache (`ldconfig -p`) names for `soname` that exist on disk.

    Decided from files, never by `dlopen` in this process: once a library is loaded (by our own preload, say),
    `dlopen` of its soname succeeds whether or not a fresh process could find it, and `LD_LIBRARY_PATH` is
    ours too; a stale cache may name files that are gone, hence the existence check."""
    for ldconfig in ("ldconfig", "/sbin/ldconfig", "/usr/sbin/ldconfig"):
        try:
            listing = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, timeout=10).stdout
            break
        except (OSError, subprocess.SubprocessError):
            continue
    else:
        return []
    found = []
    for line in listing.splitlines():
        name, _, path = line.strip().partition(" => ")
        if name.split(" (")[0] == soname and os.path.isfile(path):
            found.append(path)
    return found


def _site_dirs() -> list[Path]:
    return [
        Path(p)
        for p in dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *sys.path])
        if p
    ]


def gfortran_links(cache: Path) -> str | None:
    """A folder of links to numpy's bundled libgfortran (and what it needs), under their own and standard names."""
    for site in _site_dirs():
        libs = site / "numpy.libs"
        gfortran = sorted(glob.glob(str(libs / "libgfortran-*.so.5*")))
        if not gfortran:
            continue
        cache.mkdir(parents=True, exist_ok=True)
        quadmath = sorted(glob.glob(str(libs / "libquadmath-*.so.0*")))
        # its RPATH is $ORIGIN, which the loader takes from the link's folder: link its neighbours too
        names = {Path(f).name: f for f in glob.glob(str(libs / "*.so*"))}
        names["libgfortran.so.5"] = gfortran[0]
        if quadmath:
            names["libquadmath.so.0"] = quadmath[0]
        for name, target in names.items():  # replaced atomically: two commands may start at once
            tmp = cache / f".{name}.{os.getpid()}"
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(target)
            os.replace(tmp, cache / name)
        return str(cache)
    return None


def candidates(cache: Path) -> list[BlasChoice]:
    """Every OpenBLAS a fresh process could preload, in order of preference, with what it needs to load."""
    found = [
        BlasChoice(p)
        for p in dict.fromkeys((*SYSTEM_PATHS, *system_libraries("libopenblas.so.0")))
        if os.path.isfile(p)
    ]
    for site in _site_dirs():
        wheel = site / "cmeel.prefix" / "lib" / "libopenblas.so.0"
        if wheel.is_file():
            links = gfortran_links(cache)  # numpy's copy whenever there is one: the same on every machine
            if links:
                found.append(BlasChoice(str(wheel), links))
            elif system_libraries("libgfortran.so.5"):
                found.append(BlasChoice(str(wheel)))
            break
    return found


# A 3x2 @ 2x2 product with beta 0 (OpenBLAS's beta kernel runs too), checked in the child against the answer.
SGEMM_CHECK = """
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
F = ctypes.c_float * 6
a, b, c = F(1, 2, 3, 4, 5, 6), F(1, 0, 0, 1, 0, 0), F(*[9] * 6)
lib.cblas_sgemm(101, 111, 111, 3, 2, 2, ctypes.c_float(1), a, 2, b, 2, ctypes.c_float(0), c, 2)
sys.exit(0 if list(c) == [1, 2, 3, 4, 5, 6] else 3)
"""


def cpu_signature() -> str:
    """What decides which instructions a library may use here: the machine and its CPU flags."""
    return f"{os.uname().machine} {' '.join(sorted(cpu_flags()))}"


def runs_here(choice: BlasChoice, cache: Path) -> bool:
    """Whether a fresh process with `choice` preloaded computes a matrix product (checked once per library file
    and CPU, in a child process, and remembered in `cache`)."""
    stat = os.stat(choice.library)
    key = f"{os.path.realpath(choice.library)} {stat.st_size} {stat.st_mtime_ns} {cpu_signature()}"
    verdict = cache / f"works-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    try:
        return bool(json.loads(verdict.read_text())["works"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", ENV)}
    env["LD_PRELOAD"] = choice.library
    env["OPENBLAS_NUM_THREADS"] = "1"
    if choice.library_path:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (choice.library_path, env.get("LD_LIBRARY_PATH")) if p)
    try:
        child = subprocess.run(
            [sys.executable, "-c", SGEMM_CHECK, choice.library], env=env, capture_output=True, timeout=60
        )
        works = child.returncode == 0
    except (OSError, subprocess.SubprocessError):
        works = False
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = verdict.with_name(f".{verdict.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"library": choice.library, "works": works}))
        os.replace(tmp, verdict)
    except OSError:
        pass  # an unwritable cache only means checking again next time
    return works


def first_that_runs(found: list[BlasChoice], cache: Path) -> BlasChoice | None:
    return next((choice for choice in found if runs_here(choice, cache)), None)


def find_openblas(cache: Path) -> BlasChoice | None:
    """The first OpenBLAS that runs on this machine, with what a fresh process needs to load it; None when none
    does (none installed, or each built for instructions this CPU lacks)."""
    return first_that_runs(candidates(cache), cache)


def preloaded() -> list[str]:
    return [p for p in os.environ.get("LD_PRELOAD", "").replace(":", " ").split() if p]


def sgemm_library() -> str | None:
    """The file that the process-wide `cblas_sgemm` symbol lives in (what MLX's calls resolve to), or None."""
    try:
        address = ctypes.cast(ctypes.CDLL(None).cblas_sgemm, ctypes.c_void_p).value
    except AttributeError:
        return None
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split()
        start, end = (int(x, 16) for x in parts[0].split("-"))
        if start <= address < end and len(parts) >= 6:
            return parts[5]
    return None


@functools.lru_cache(maxsize=None)
def blas_name() -> str:
    """The BLAS this process's matrix products run on, by file name ("libopenblas.so.0"; "reference" for MLX's own
    bundled one), or "system" off Linux: CPU verify costs change tenfold with it, so their tables are keyed by it."""
    if not sys.platform.startswith("linux"):
        return "system"
    import mlx.core  # noqa: F401  (loads MLX's own libblas, so the lookup sees what MLX sees)

    library = sgemm_library()
    return os.path.basename(library) if is_fast(library) else "reference"


def is_fast(library: str | None) -> bool:
    return library is not None and any(k in os.path.basename(library).lower() for k in ("openblas", "mkl", "blis"))


def warn_once(message: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        print(f"warning: {message}", file=sys.stderr)


def reexec_env(cache: Path, torch_first: bool = False) -> dict | None:
    """The environment to re-execute this process with, or None when there is nothing to do (not Linux,
    switched off, already set up) or nothing to load (then it warns once).

    Without `torch_first` the chosen OpenBLAS is preloaded; with it, the re-executed process loads it itself
    (`load_after_torch`), so a preload of it is dropped."""
    if not sys.platform.startswith("linux") or os.environ.get(ENV) == "reference":
        return None
    chosen = os.environ.get(ENV)
    if torch_first and chosen and chosen in preloaded():
        return {**os.environ, "LD_PRELOAD": " ".join(p for p in preloaded() if p != chosen)}
    if chosen or any(is_fast(p) for p in preloaded()):
        return None
    found = candidates(cache)
    choice = first_that_runs(found, cache)
    if choice is None:
        rejected = [c.library for c in found]
        found = f"no OpenBLAS here runs on this CPU ({', '.join(rejected)})" if rejected else "no optimized BLAS found"
        warn_once(f"{found}: MLX runs on its slow reference BLAS (~10x slower on CPU). Fix: {FIX}")
        return None
    env = dict(os.environ)
    env[ENV] = choice.library
    if not torch_first:
        env["LD_PRELOAD"] = " ".join([choice.library, *preloaded()])
    if choice.library_path:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (choice.library_path, env.get("LD_LIBRARY_PATH")) if p)
    return env


def load_after_torch() -> None:
    """Import torch (when installed), then load the OpenBLAS the re-execution chose into the global symbol
    scope, before MLX loads: MLX binds its `cblas_sgemm` to it at load, torch has bound its `sgemm_` already."""
    chosen = os.environ.get(ENV)
    if not chosen or chosen == "reference" or chosen in preloaded():
        return
    if "mlx.core" in sys.modules:
        warn_once(f"MLX was loaded before {chosen}: its matrix products stay on the BLAS it loaded with")
        return
    if importlib.util.find_spec("torch") is not None:
        import torch  # noqa: F401  (binds torch's BLAS calls before OpenBLAS joins the global scope)
    ctypes.CDLL(chosen, mode=ctypes.RTLD_GLOBAL)


def ensure_fast_blas(cache: Path, torch_first: bool = False) -> None:
    """On Linux, re-execute this command once so that MLX runs on an OpenBLAS, or warn that matmuls will be slow.
    `torch_first`: this command also runs torch, which keeps its own BLAS (see the module docstring).

    Call it first thing in a command-line entry point, before MLX is imported: it may not return.
    """
    env = reexec_env(cache, torch_first)
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, sys.orig_argv, env)
    if torch_first:
        load_after_torch()
    check_fast_blas()


def check_fast_blas() -> None:
    """Warn once when the running process's `cblas_sgemm` is not an optimized BLAS (Linux only)."""
    if not sys.platform.startswith("linux") or os.environ.get(ENV) == "reference":
        return
    import mlx.core  # noqa: F401  (loads MLX's own libblas, so the lookup sees what MLX sees)

    library = sgemm_library()
    if not is_fast(library):
        warn_once(
            f"MLX's matrix products run on a slow reference BLAS ({library or 'the one bundled with MLX'}). Fix: {FIX}"
        )
