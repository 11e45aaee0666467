"""mlx-glimmer: lossless block speculative decoding (DFlash) on MLX."""

from .errors import GlimmerError
from .generate import GenerationChunk, GenerationResult, GenerationStats, generate, stream_generate
from .loading import Pair, load
from .sampling import SamplingParams
from .speculative import DecodeState

__version__ = "0.1.0"

__all__ = [
    "DecodeState",
    "GenerationChunk",
    "GenerationResult",
    "GenerationStats",
    "GlimmerError",
    "Pair",
    "SamplingParams",
    "generate",
    "load",
    "stream_generate",
]
