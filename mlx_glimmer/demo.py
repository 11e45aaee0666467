"""The embedded demo pair (built on first use; see `mlx-glimmer demo`)."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import GlimmerError


def cache_dir() -> Path:
    return Path(os.environ.get("MLX_GLIMMER_CACHE", Path.home() / ".cache" / "mlx-glimmer"))


def demo_bundle() -> Path:
    path = cache_dir() / "demo"
    if (path / "glimmer.json").is_file():
        return path
    raise GlimmerError(
        f"no bundle given and no demo pair at {path}; pass a bundle directory "
        "(build one with `mlx-glimmer convert`)"
    )
