"""`mlx-glimmer convert`: arguments, progress bar and closing report."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from mlx_glimmer.errors import GlimmerError

from .formats import BITS, DEFAULT_MAX_SHARD, FLOAT_DTYPE_NAMES, GROUP_SIZES

if TYPE_CHECKING:
    from .bundle import ConvertReport

DESCRIPTION = """\
Convert a target checkpoint (and optionally its DFlash drafter) into an MLX bundle:

  BUNDLE/glimmer.json   format, sources, bits, tool version, sha256 of every file
  BUNDLE/target/        an mlx-lm model directory (text tower only; mlx_lm.load opens it)
  BUNDLE/drafter/       the drafter's config.json + weights (no embedding, no lm_head)

Tensors stream one row block at a time from the source shards, so memory stays
far below the model size. The bundle is written beside --out and renamed into
place at the end; a failure leaves nothing behind."""

EPILOG = """\
sources (--target / --drafter):
  a transformers directory (model.safetensors or shards + model.safetensors.index.json),
  a Hugging Face repo id (downloads *.safetensors, *.json, tokenizer and template files),
  or, for the target, a llama-family .gguf file (Q4_0/Q4_1/Q8_0 tensors are kept as
  they are, group size 32; other types are re-quantized at --bits/--group-size)

examples:
  mlx-glimmer convert --target meta-models/Muse-Glimmer-30B \\
      --drafter meta-models/Muse-Glimmer-30B-assistant --out muse-4bit
  mlx-glimmer convert --target SmolLM2-135M-Instruct.Q4_1.gguf --out smollm2"""


def add_convert_parser(sub) -> None:
    c = sub.add_parser(
        "convert",
        help="convert HF safetensors / GGUF checkpoints into a bundle",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    c.add_argument("--target", required=True, metavar="SRC", help="target checkpoint: directory, repo id or .gguf file")
    c.add_argument(
        "--drafter", metavar="SRC", help="DFlash drafter checkpoint (muse_glimmer_assistant): directory or repo id"
    )
    c.add_argument("--out", required=True, metavar="BUNDLE", help="bundle directory to create")
    c.add_argument(
        "--bits",
        type=int,
        choices=BITS,
        default=4,
        metavar="N",
        help="weight bits: 4 or 8 (MLX affine quantization; also 2, 3, 5, 6), or 16 to keep float weights "
        "in --dtype (default 4). Norms and other 1-D tensors always stay float",
    )
    c.add_argument(
        "--group-size",
        type=int,
        choices=GROUP_SIZES,
        default=64,
        metavar="G",
        help="quantization group size: 32, 64 or 128 (default 64)",
    )
    c.add_argument(
        "--dtype",
        choices=FLOAT_DTYPE_NAMES,
        default=None,
        help="float type of unquantized weights and of quantization scales (default bfloat16; float16 for a GGUF target)",
    )
    c.add_argument(
        "--embed-bits",
        type=int,
        choices=BITS,
        default=None,
        metavar="N",
        help="bits for the token embedding and lm_head (default: --bits). 8 with --bits 4 kept more greedy "
        "choices of SmolLM2-135M (70%% vs 56%% agreement with float) and adds about 1.3 GB (+9%%) to the 30B target",
    )
    c.add_argument(
        "--drafter-bits",
        type=int,
        choices=BITS,
        default=None,
        metavar="N",
        help="bits for the drafter's weights (default: --bits)",
    )
    c.add_argument(
        "--max-shard-size",
        default=DEFAULT_MAX_SHARD,
        metavar="SIZE",
        help=f"largest output safetensors file, e.g. 5GB, 500MB (default {DEFAULT_MAX_SHARD})",
    )
    c.add_argument("--force", action="store_true", help="replace --out if it exists")
    c.add_argument("--quiet", action="store_true", help="no progress bar and no report")


class BarProgress:
    """A tqdm bar on stderr: source bytes done, tensors done (a `bundle.Progress`)."""

    def __init__(self):
        self.bar = None
        self.tensors = 0
        self.total_tensors = 0

    def start(self, total_bytes: int, total_tensors: int) -> None:
        from tqdm import tqdm

        self.total_tensors = total_tensors
        self.bar = tqdm(
            total=total_bytes,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc="converting",
            file=sys.stderr,
            dynamic_ncols=True,
            leave=False,
        )

    def advance(self, nbytes: int, tensors: int) -> None:
        self.tensors += tensors
        if self.bar is not None:
            self.bar.set_postfix_str(f"{self.tensors}/{self.total_tensors} tensors", refresh=False)
            self.bar.update(nbytes)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def format_report(report: ConvertReport) -> str:
    lines = []
    for m in report.models:
        quant = ", ".join(f"{k} x{v}" for k, v in sorted(m.bits.items())) or "none"
        line = f"{m.name}: {m.tensors} tensors, {m.quantized} quantized ({quant}), {m.tensors - m.quantized} float"
        if m.dropped:
            line += f"; dropped {m.dropped} non-text tensors (vision tower, projector)"
        lines.append(f"{line}; {human(m.source_bytes)} -> {human(m.output_bytes)}  [{m.source}]")
    lines.append(f"bundle: {report.out} (dtype {report.dtype}) in {report.seconds:.1f} s")
    return "\n".join(lines)


def cmd_convert(args) -> int:
    show = not args.quiet
    try:
        report = run_convert(args, BarProgress() if show and sys.stderr.isatty() else None)
    except OSError as e:  # disk full, permissions: the bundle is gone, say why in one line
        raise GlimmerError(f"{e.filename or args.out}: {e.strerror or e}") from None
    if show:
        print(format_report(report))
    return 0


def run_convert(args, progress) -> ConvertReport:
    from .bundle import convert

    return convert(
        args.target,
        args.out,
        drafter=args.drafter,
        bits=args.bits,
        group_size=args.group_size,
        dtype=args.dtype,
        drafter_bits=args.drafter_bits,
        embed_bits=args.embed_bits,
        max_shard_size=args.max_shard_size,
        force=args.force,
        progress=progress,
    )
