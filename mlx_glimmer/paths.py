"""Where mlx-glimmer keeps what it builds: one place, so nothing else needs to import the demo builder for a path."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "MLX_GLIMMER_CACHE"
DATA_DIR = Path(__file__).resolve().parent / "data"  # shipped with the package: prompt sets, the demo drafter


def cache_dir() -> Path:
    """`$MLX_GLIMMER_CACHE`, default `~/.cache/mlx-glimmer`: the demo bundle, BLAS links, verify-cost tables."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "mlx-glimmer").expanduser()
