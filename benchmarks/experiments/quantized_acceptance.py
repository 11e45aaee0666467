"""The shipped drafter against the demo target at the precision it is served in: tokens per target forward.

    python benchmarks/experiments/quantized_acceptance.py [--bits 4,3] [--group-size 64] [--num-prompts 24]
        [--max-tokens 128] [--drafter DIR] [--no-float] [--out benchmarks/experiments/results/quantized_acceptance.json]

The float demo target is re-quantized by `mlx-glimmer convert --bits B --group-size G` (into
runs/quantized/qB), as a user serving it at B bits would. MLX's quantized products are about ten times slower
than float ones on a Linux CPU, so acceptance is measured on the same weights dequantized to float32
(runs/quantized/qB-values: every weight equals the quantized model's value, computed by float kernels); a
parity check decodes the first prompts with both and records where they agree. For each target (float,
then each B), the drafter (default: the shipped one, unchanged) speculatively decodes the first
`--num-prompts` held-out prompts (chat template, greedy, block 16 chain), every answer checked against that
target's own plain greedy decoding: tokens committed per target forward, and the share of rounds whose first
draft is accepted. The results file names the CPU.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "mlx_glimmer" / "data" / "demo_drafter"


def quantized_target(float_target: Path, bits: int, group_size: int, work: Path) -> Path:
    """The float target re-quantized by `convert` (kept in `work`; made once)."""
    out = work / f"q{bits}"
    if not (out / "glimmer.json").is_file():
        cmd = [str(Path(sys.executable).parent / "mlx-glimmer"), "convert", "--target", str(float_target)]
        cmd += ["--out", str(out), "--bits", str(bits), "--group-size", str(group_size), "--dtype", "float32"]
        subprocess.run([*cmd, "--force", "--quiet"], check=True)
    return out / "target"


def dequantized_copy(quantized: Path, out: Path) -> Path:
    """`quantized`'s weights as float32 values (the same numbers, float kernels), as an mlx-lm model dir."""
    import mlx.core as mx

    if (out / "model.safetensors").is_file():
        return out
    config = json.loads((quantized / "config.json").read_text())
    spec = config.pop("quantization")
    config.pop("quantization_config", None)
    weights = {}
    for shard in sorted(quantized.glob("*.safetensors")):
        weights.update(mx.load(str(shard)))
    values = {}
    for name, w in weights.items():
        if name.endswith((".scales", ".biases")):
            continue
        module = name.rsplit(".", 1)[0]
        if f"{module}.scales" in weights:
            own = spec.get(module, spec) if isinstance(spec.get(module), dict) else spec
            w = mx.dequantize(
                w, weights[f"{module}.scales"], weights[f"{module}.biases"], own["group_size"], own["bits"]
            )
        values[name] = w.astype(mx.float32)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(quantized, tmp, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(tmp / "model.safetensors"), values)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def measure(target: Path, drafter: Path, prompts: list[str], max_tokens: int) -> dict:
    import mlx_glimmer

    pair = mlx_glimmer.load(target=target, drafter=drafter)
    committed, forwards, first, rounds, equal, per_prompt = 0, 0, 0, 0, 0, []
    tic = time.perf_counter()
    for p in prompts:
        msgs = [{"role": "user", "content": p}]
        r = mlx_glimmer.generate(pair, msgs, max_tokens=max_tokens, block_size=16, tree="off")
        plain = mlx_glimmer.generate(pair, msgs, max_tokens=max_tokens, speculative=False)
        equal += r.token_ids == plain.token_ids
        lengths = r.stats.acceptance_lengths
        committed += sum(lengths)
        forwards += r.stats.target_forwards
        first += sum(n >= 2 for n in lengths)
        rounds += len(lengths)
        per_prompt.append(round(sum(lengths) / max(r.stats.target_forwards, 1), 3))
        print(f"  {len(per_prompt)}/{len(prompts)} {per_prompt[-1]}", file=sys.stderr, flush=True)
    return {
        "tokens_per_forward": round(committed / forwards, 3),
        "first_draft_accepted": round(first / rounds, 3),
        "equal_to_plain": f"{equal}/{len(prompts)}",
        "per_prompt": per_prompt,
        "seconds": round(time.perf_counter() - tic),
    }


def parity(quantized: Path, values: Path, prompts: list[str], max_tokens: int) -> dict:
    """Plain greedy answers of the quantized target and of its float copy: tokens until they part."""
    import mlx_glimmer

    q, f = (mlx_glimmer.load(target=t, use_drafter=False) for t in (quantized, values))
    agree = []
    for p in prompts:
        msgs = [{"role": "user", "content": p}]
        a = mlx_glimmer.generate(q, msgs, max_tokens=max_tokens, speculative=False).token_ids
        b = mlx_glimmer.generate(f, msgs, max_tokens=max_tokens, speculative=False).token_ids
        agree.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    return {"prompts": len(prompts), "max_tokens": max_tokens, "tokens_equal_before_parting": agree}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bits", default="4,3")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--parity-prompts", type=int, default=2)
    ap.add_argument("--drafter", default=str(SHIPPED))
    ap.add_argument("--no-float", action="store_true", help="measure the quantized targets only")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/experiments/results/quantized_acceptance.json"))
    args = ap.parse_args(argv)

    from mlx_glimmer.blas import blas_name, ensure_fast_blas
    from mlx_glimmer.paths import cache_dir

    ensure_fast_blas(cache_dir() / "blas")

    from mlx_glimmer.cpu import cpu_facts
    from mlx_glimmer.demo import demo_bundle
    from mlx_glimmer.distill.data import load_prompts
    from mlx_glimmer.paths import DATA_DIR

    prompts = load_prompts(DATA_DIR / "prompts_heldout.jsonl")[: args.num_prompts]
    float_target = demo_bundle() / "target"
    work = ROOT / "runs" / "quantized"
    rows = []
    if not args.no_float:
        print("float target", file=sys.stderr)
        rows.append(
            {
                "target": "float32 (the demo target)",
                **measure(float_target, Path(args.drafter), prompts, args.max_tokens),
            }
        )
    for bits in (int(b) for b in args.bits.split(",")):
        quantized = quantized_target(float_target, bits, args.group_size, work)
        values = dequantized_copy(quantized, work / f"q{bits}-values")
        print(f"{bits}-bit target", file=sys.stderr)
        row = {"target": f"{bits}-bit, group {args.group_size} (convert --bits {bits} --group-size {args.group_size})"}
        row["parity_with_quantized_kernels"] = parity(quantized, values, prompts[: args.parity_prompts], 32)
        rows.append({**row, **measure(values, Path(args.drafter), prompts, args.max_tokens)})
    result = {
        "command": shlex.join(["python", "benchmarks/experiments/quantized_acceptance.py", *(argv or sys.argv[1:])]),
        "drafter": str(Path(args.drafter).resolve().relative_to(ROOT))
        if Path(args.drafter).resolve().is_relative_to(ROOT)
        else args.drafter,
        "prompts": f"the first {len(prompts)} held-out prompts, chat template, greedy, block 16 chain, {args.max_tokens} tokens",
        "cpu": cpu_facts(),
        "blas": blas_name(),
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({r["target"]: (r["tokens_per_forward"], r["equal_to_plain"]) for r in rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
