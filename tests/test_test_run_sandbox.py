"""The test run keeps to temporary folders: the real home's caches are never written (conftest also checks the
real `~/.cache` and `~/.local/share` at the end of every run and fails it when anything new appeared there)."""

import os
import subprocess
import sys
from pathlib import Path

from slow_machine import slow_machine_timeout

import mlx_glimmer
from mlx_glimmer.paths import cache_dir


def test_the_cache_of_a_test_run_is_a_temporary_folder_outside_home():
    sandbox = Path(os.environ["MLX_GLIMMER_TEST_SANDBOX"])
    assert cache_dir().is_relative_to(sandbox)
    assert not cache_dir().is_relative_to(Path.home() / ".cache")
    for name in ("XDG_CACHE_HOME", "XDG_DATA_HOME", "PIP_CACHE_DIR", "HF_HOME"):
        assert Path(os.environ[name]).is_relative_to(sandbox), name


def test_the_verify_cost_table_of_auto_goes_to_the_run_cache(muse_pair):
    mlx_glimmer.generate(muse_pair, [5, 6, 7, 8], max_tokens=4)  # block_size "auto" measures and caches the cost
    assert list((cache_dir() / "verify_cost").glob("*.json")), "auto keeps its verify-cost table in the run's cache"


PROBE = """
import os
import time
from pathlib import Path

from mlx_glimmer.paths import cache_dir


def test_probe():
    worker = os.environ["PYTEST_XDIST_WORKER"]
    mine = cache_dir() / "mine"
    mine.parent.mkdir(parents=True, exist_ok=True)
    mine.write_text(worker)
    time.sleep(0 if worker == "gw0" else 4)  # gw1 outlives gw0's whole session
    assert mine.read_text() == worker
    Path(os.environ["PROBE_OUT"], worker).write_text(str(cache_dir()))
"""


def test_each_worker_of_a_parallel_run_has_caches_of_its_own_and_the_run_cleans_up_once(tmp_path):
    """Two workers (pytest-xdist, as the default run uses) each see a cache folder of their own in the run's
    sandbox; the one that finishes first leaves the other's in place; the sandbox is gone when the run ends."""
    (tmp_path / "test_probe.py").write_text(PROBE)
    out = tmp_path / "out"
    out.mkdir()
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("MLX_GLIMMER_TEST_", "PYTEST_XDIST_"))}
    env = {**keep, "PROBE_OUT": str(out), "PYTHONPATH": str(Path(__file__).parent)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-n", "2", "--dist", "each", "test_probe.py"]
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=slow_machine_timeout(4))
    assert run.returncode == 0, run.stdout + run.stderr
    caches = {w: Path((out / w).read_text()) for w in ("gw0", "gw1")}
    sandboxes = {path.parents[2] for path in caches.values()}  # <sandbox>/<worker>/cache/mlx-glimmer
    assert caches["gw0"] != caches["gw1"] and len(sandboxes) == 1
    assert not sandboxes.pop().exists(), "the run removes its sandbox at its end"
