"""Which torch device and dtype to run on, and the few calls that differ between them."""

from __future__ import annotations

import resource
import sys

import torch

from ..errors import GlimmerError

DEVICES = ("auto", "cuda", "mps", "cpu")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str | None = "auto") -> torch.device:
    """`auto`: cuda, then mps, then cpu. A named device that is not there is an error."""
    name = (name or "auto").lower()
    cuda = torch.cuda.is_available()
    mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    if name == "auto":
        return torch.device("cuda" if cuda else "mps" if mps else "cpu")
    kind = name.split(":")[0]
    if kind not in DEVICES[1:]:
        raise GlimmerError(f"--device: {name!r} is not one of {', '.join(DEVICES)}")
    if (kind == "cuda" and not cuda) or (kind == "mps" and not mps):
        raise GlimmerError(f"--device: {name} is not available to this torch ({torch.__version__})")
    return torch.device(name)


def pick_dtype(name: str | None, default: torch.dtype = torch.float32) -> torch.dtype:
    if name in (None, "auto"):
        return default
    if name not in DTYPES:
        raise GlimmerError(f"--torch-dtype: {name!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gb(device: torch.device) -> float:
    """CUDA: peak allocated by torch; MPS: memory held by the driver; CPU: the process's peak resident size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    if device.type == "mps":
        return torch.mps.driver_allocated_memory() / 1e9
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 1e9 if sys.platform == "darwin" else rss * 1024 / 1e9


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return device.type
