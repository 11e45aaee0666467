"""Checkpoint conversion: HF safetensors / GGUF -> MLX bundle (`mlx-glimmer convert`)."""

from .bundle import ConvertReport, convert
from .gguf import find_or_fetch_smollm2_gguf

__all__ = ["ConvertReport", "convert", "find_or_fetch_smollm2_gguf"]
