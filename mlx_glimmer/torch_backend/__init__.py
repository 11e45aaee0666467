"""Torch backend (CUDA, MPS or CPU): the same pair, loop and stats as MLX, with transformers' model classes."""

from .generate import generate, stream_generate
from .loading import TorchPair, load_torch

__all__ = ["TorchPair", "generate", "load_torch", "stream_generate"]
