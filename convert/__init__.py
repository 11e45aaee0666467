"""Checkpoint conversion: HF safetensors / GGUF -> MLX bundle (`mlx-glimmer convert`).

Its names are imported on first use, so the command line builds `convert`'s flags without MLX."""

_API = {
    "ConvertReport": ".bundle",
    "convert": ".bundle",
    "find_or_fetch_smollm2_gguf": ".gguf",
}

__all__ = list(_API)


def __getattr__(name):
    if name in _API:
        from importlib import import_module

        return getattr(import_module(_API[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
