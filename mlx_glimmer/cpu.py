"""What the processor is and which number formats it computes natively.

Results files name the CPU (speed figures do not carry from one chip to another), and `distill` picks its
precision by it: bfloat16 matrix products run in hardware only where the CPU has bfloat16 instructions
(x86 `avx512_bf16` or `amx_bf16`, Arm `bf16`); elsewhere torch emulates them, several times slower than
float32.
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess
import sys
from pathlib import Path

BFLOAT16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 AVX-512 / AMX, Arm (/proc/cpuinfo "Features")


@functools.lru_cache(maxsize=None)
def chip_name() -> str:
    """The processor by name ("Apple M4 Max", "AMD EPYC 7B13"): verify costs measured on one chip do not
    carry over to another of the same architecture."""
    if sys.platform == "darwin":
        try:
            out = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=5
            ).stdout.strip()
            if out:
                return out
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (empty elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def native_bfloat16(flags: frozenset[str] | None = None) -> bool:
    """Whether this CPU multiplies bfloat16 in hardware. Apple silicon: True (M2 and later have the Arm
    bf16 instructions; there `distill` computes on the GPU through MLX anyway)."""
    if flags is None:
        if sys.platform == "darwin":
            return platform.machine() == "arm64"
        flags = cpu_flags()
    return any(f in flags for f in BFLOAT16_FLAGS)


def cpu_facts() -> dict:
    """What a results file records about the processor: its name, core count, the flags that decide vector
    width and bfloat16 support, and whether bfloat16 is native."""
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "fma", "bf16", "asimd", "sve")
    return {
        "name": chip_name(),
        "machine": platform.machine(),
        "cores": os.cpu_count(),
        "flags": sorted(f for f in cpu_flags() if f in wanted),
        "native_bfloat16": native_bfloat16(),
    }
