"""mlx-glimmer: lossless block speculative decoding (DFlash) on MLX."""

from ._version import __version__
from .errors import GlimmerError
from .generate import GenerationChunk, GenerationResult, GenerationStats, generate, stream_generate
from .loading import Pair, load
from .sampling import SamplingParams
from .settings import GenerationSettings
from .speculative import DecodeState

__all__ = [
    "DecodeState",
    "GenerationChunk",
    "GenerationResult",
    "GenerationSettings",
    "GenerationStats",
    "GlimmerError",
    "Pair",
    "SamplingParams",
    "__version__",
    "generate",
    "load",
    "stream_generate",
]
