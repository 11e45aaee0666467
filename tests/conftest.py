import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import tiny_checkpoints as tc  # noqa: E402


def pytest_configure(config):
    """Run the suite on an optimized BLAS, as the `mlx-glimmer` command does (Linux: re-executes pytest once
    with an OpenBLAS preloaded; elsewhere, or with MLX_GLIMMER_BLAS=reference, nothing happens)."""
    from mlx_glimmer.blas import reexec_env
    from mlx_glimmer.demo import cache_dir

    env = reexec_env(cache_dir() / "blas")
    if env is not None:
        capture = config.pluginmanager.getplugin("capturemanager")
        if capture is not None:
            capture.stop_global_capturing()  # give the terminal back before the process image is replaced
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, sys.orig_argv, env)


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
