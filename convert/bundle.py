"""`convert()`: plan the target (and drafter), write them into a temporary directory beside
`out`, record `glimmer.json`, and rename into place. A failure leaves nothing behind."""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from mlx_glimmer._version import __version__
from mlx_glimmer.errors import GlimmerError
from mlx_glimmer.files import BUNDLE_FORMAT, staged_directory

from .drafter_plan import plan_drafter
from .formats import BITS, DEFAULT_MAX_SHARD
from .gguf import plan_gguf
from .plan import ModelPlan
from .quantize import FLOAT_DTYPES, GROUP_SIZES
from .safetensors_stream import write_model_shards
from .sources import Source, resolve
from .target_plan import plan_target, target_shape_probe

SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise GlimmerError(f"--max-shard-size: cannot read {text!r} (use e.g. 5GB, 500MB)")
    n = int(float(m.group(1)) * SIZE_UNITS[(m.group(2) or "").upper()])
    if n <= 0:
        raise GlimmerError(f"--max-shard-size: must be positive, got {text!r}")
    return n


@dataclass
class ModelReport:
    name: str
    source: str
    tensors: int
    quantized: int
    dropped: int
    source_bytes: int
    output_bytes: int = 0
    bits: dict[str, int] = field(default_factory=dict)  # "4-bit/g64" -> count


@dataclass
class ConvertReport:
    out: Path
    models: list[ModelReport]
    seconds: float
    dtype: str


class Progress:
    """Receives (source bytes, tensors) as conversion advances; the CLI shows a bar."""

    def start(self, total_bytes: int, total_tensors: int) -> None: ...

    def advance(self, nbytes: int, tensors: int) -> None: ...

    def close(self) -> None: ...


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _check_out(out: Path, sources: list[Source]) -> None:
    """--force must never delete a source: --out may not be, or contain, one."""
    resolved = out.resolve()
    for src in sources:
        if _inside(src.path, resolved):
            raise GlimmerError(f"{out}: --out must not be or contain the source {src.path}")


def _write_model(plan: ModelPlan, out_dir: Path, max_shard_bytes: int, progress: Progress) -> int:
    out_dir.mkdir()
    files = write_model_shards(plan.items, out_dir, max_shard_bytes, progress.advance)
    (out_dir / "config.json").write_text(json.dumps(plan.config, indent=4, sort_keys=True))
    plan.write_extras(out_dir)
    return sum((out_dir / f).stat().st_size for f in files if f.endswith(".safetensors"))


def _report(plan: ModelPlan, output_bytes: int) -> ModelReport:
    bits: dict[str, int] = {}
    for spec in plan.quantized.values():
        key = f"{spec.bits}-bit/g{spec.group_size}"
        bits[key] = bits.get(key, 0) + 1
    return ModelReport(
        name=plan.name,
        source=plan.source.spec,
        tensors=len(plan.items),
        quantized=len(plan.quantized),
        dropped=plan.dropped,
        source_bytes=plan.source_bytes,
        output_bytes=output_bytes,
        bits=bits,
    )


def convert(
    target: str | Path,
    out: str | Path,
    *,
    drafter: str | Path | None = None,
    bits: int = 4,
    group_size: int = 64,
    dtype: str | None = None,
    drafter_bits: int | None = None,
    embed_bits: int | None = None,
    max_shard_size: str | int = DEFAULT_MAX_SHARD,
    force: bool = False,
    progress: Progress | None = None,
) -> ConvertReport:
    """Convert a target (HF dir, repo id or .gguf) and optionally its drafter into a bundle at `out`.

    `dtype` defaults to bfloat16 (float16 for a GGUF target, whose scales are float16).
    """
    started = time.perf_counter()
    out = Path(out).expanduser()
    drafter_bits = bits if drafter_bits is None else drafter_bits
    for flag, value in (("--bits", bits), ("--drafter-bits", drafter_bits), ("--embed-bits", embed_bits or bits)):
        if value not in BITS:
            raise GlimmerError(f"{flag}: {value} is not one of {', '.join(map(str, BITS))}")
    if group_size not in GROUP_SIZES:
        raise GlimmerError(f"--group-size: {group_size} is not one of {', '.join(map(str, GROUP_SIZES))}")
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise GlimmerError(f"--dtype: {dtype!r} is not one of {', '.join(FLOAT_DTYPES)}")
    max_shard_bytes = max_shard_size if isinstance(max_shard_size, int) else parse_size(max_shard_size)
    if (out.exists() or out.is_symlink()) and not force:
        raise GlimmerError(f"{out}: already exists (pass --force to replace it)")

    target_src = resolve(str(target), "target")
    dtype = dtype or ("float16" if target_src.kind == "gguf" else "bfloat16")
    plan = plan_gguf if target_src.kind == "gguf" else plan_target
    plans = [plan(target_src, bits, group_size, dtype, embed_bits)]
    if drafter is not None:
        drafter_src = resolve(str(drafter), "drafter")
        probe = target_shape_probe(plans[0])
        plans.append(plan_drafter(drafter_src, probe, drafter_bits, group_size, dtype))
    _check_out(out, [p.source for p in plans])

    progress = progress or Progress()
    with staged_directory(out, "bundle") as staging:
        try:
            progress.start(sum(p.source_bytes for p in plans), sum(len(p.items) for p in plans))
            reports = [_report(p, _write_model(p, staging / p.name, max_shard_bytes, progress)) for p in plans]
        finally:
            progress.close()
        files = {f.relative_to(staging).as_posix(): sha256(f) for f in sorted(staging.rglob("*")) if f.is_file()}
        manifest = {
            "format": BUNDLE_FORMAT,
            "target": "target",
            "drafter": "drafter" if drafter is not None else None,
            "sources": {p.name: p.source.spec for p in plans},
            "bits": bits,
            "drafter_bits": drafter_bits if drafter is not None else None,
            "embed_bits": embed_bits if embed_bits is not None else bits,
            "group_size": group_size,
            "dtype": dtype,
            "applied": {r.name: {"quantized": r.bits, "float_tensors": r.tensors - r.quantized} for r in reports},
            "tool_version": __version__,
            "files": files,
        }
        (staging / "glimmer.json").write_text(json.dumps(manifest, indent=2))
    return ConvertReport(out, reports, time.perf_counter() - started, dtype)
