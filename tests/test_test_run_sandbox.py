"""The test run keeps to temporary folders: the real home's caches are never written (conftest also checks the
real `~/.cache` and `~/.local/share` at the end of every run and fails it when anything new appeared there)."""

import os
from pathlib import Path

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
