"""mlx-glimmer: lossless block speculative decoding (DFlash) on MLX.

The engine (MLX, mlx-lm, transformers) is imported on first use of a name that needs it, so the
`mlx-glimmer` command refuses a bad flag before any of it loads.
"""

import sys
import types
from importlib import import_module

from ._version import __version__
from .errors import GlimmerError
from .settings import GenerationSettings, SamplingParams

# name -> the module that defines it, imported when the name is first read
_LAZY = {
    "DecodeState": "speculative",
    "GenerationChunk": "generate",
    "GenerationResult": "generate",
    "GenerationStats": "generate",
    "generate": "generate",
    "prompt_logprobs": "generate",
    "stream_generate": "generate",
    "TokenLogprob": "logprobs",
    "Pair": "loading",
    "load": "loading",
}

__all__ = [
    "DecodeState",
    "GenerationChunk",
    "GenerationResult",
    "GenerationSettings",
    "GenerationStats",
    "GlimmerError",
    "Pair",
    "SamplingParams",
    "TokenLogprob",
    "__version__",
    "generate",
    "load",
    "prompt_logprobs",
    "stream_generate",
]


class _Package(types.ModuleType):
    def __getattr__(self, name):
        if name not in _LAZY:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
        setattr(self, name, value)
        return value

    def __setattr__(self, name, value):
        # Importing the submodule `mlx_glimmer.generate` binds it on the package; the name stays the function.
        if name in _LAZY and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(_LAZY))


sys.modules[__name__].__class__ = _Package
