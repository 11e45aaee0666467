#!/usr/bin/env bash
# On an M-series Mac (Metal): plain vs --block-size auto vs fixed widths 16/8/5/3 on one bundle.
#
# NOT RUN YET: written and checked on the Linux CPU box (no Mac, no Metal there), so no figure in
# benchmarks/README.md comes from it. It needs macOS on Apple silicon with `pip install mlx-glimmer`
# (mlx with Metal); nothing else.
#
# Usage:
#   benchmarks/mac.sh                                   # the demo pair (`mlx-glimmer demo` builds it once)
#   BUNDLE=~/models/muse-30b-4bit benchmarks/mac.sh     # Muse Glimmer 30B, 4-bit, with its assistant:
#       mlx-glimmer convert --target meta-models/Muse-Glimmer-30B \
#           --drafter meta-models/Muse-Glimmer-30B-assistant --out ~/models/muse-30b-4bit --bits 4
#   N=8 TOKENS=128 WIDTHS="auto 16 8 5 3" REPEATS=2 OUT=benchmarks/results/mac_m4max_muse4.json benchmarks/mac.sh
#
# For every prompt in turn (greedy, chat template, the held-out prompts): plain decoding, then each width,
# interleaved so thermals and other load fall on all methods alike. Every output is checked against plain
# (a mismatch is reported with the first divergence and both kernels' logit margins: a 16-row verify and a
# 1-row step run different Metal kernels, so bf16/4-bit near-ties can flip a token; see mlx_glimmer/divergence.py).
# Prints the seed's table (device | plain tok/s | speculative tok/s | speed-up | tokens per round | target
# forwards/token) plus peak memory and the wired limit each method ran under, and writes the JSON to $OUT.
# For reference (public, self-reported): on M4 Max, Muse 4-bit + assistant at block 16 ran 0.92x, at
# block 5 1.97x (3.97 tokens per round): the table shows where our widths land on this Mac.
# Then benchmarks/round_ops.py on the same bundle: the array ops each round shape builds around the target's
# forward and their time beside the forward's (written beside $OUT as *_round_ops.json). A forward here takes a
# few milliseconds, so what the loop adds shows: the loop/forward column is the figure to watch.
set -euo pipefail
cd "$(dirname "$0")/.."
BUNDLE=${BUNDLE:-}
N=${N:-3}
TOKENS=${TOKENS:-128}
WIDTHS=${WIDTHS:-"auto 16 8 5 3"}
REPEATS=${REPEATS:-1}
OUT=${OUT:-benchmarks/results/mac_$(date +%Y%m%d_%H%M%S).json}
if [[ "$(uname -s)" != "Darwin" && "${MAC_SH_ANYWAY:-}" != 1 ]]; then
  echo "mac.sh: this is for macOS on Apple silicon (Metal); here MLX would run on the CPU (MAC_SH_ANYWAY=1 runs it anyway)" >&2
  exit 2
fi
mkdir -p "$(dirname "$OUT")"
python - "$BUNDLE" "$N" "$TOKENS" "$WIDTHS" "$REPEATS" "$OUT" <<'PY'
import json
import platform
import statistics
import subprocess
import sys
import time

import mlx.core as mx

import mlx_glimmer
from mlx_glimmer.divergence import explain_divergence, format_divergence
from mlx_glimmer.generate import encode_prompt
from mlx_glimmer.distill.data import load_prompts
from mlx_glimmer.paths import DATA_DIR
from mlx_glimmer.torch_backend.parity import mlx_dtype

bundle, n, tokens, widths, repeats, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(), int(sys.argv[5]), sys.argv[6]
if not bundle:
    from mlx_glimmer.demo import demo_bundle

    bundle = str(demo_bundle())
pair = mlx_glimmer.load(bundle)
if pair.drafter is None:
    sys.exit(f"mac.sh: {bundle} has no drafter")
try:
    chip = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True).stdout.strip()
except OSError:
    chip = platform.machine()
device = f"{chip or platform.machine()} ({mx.default_device()}, metal {'on' if mx.metal.is_available() else 'OFF'})"
prompts = [[{"role": "user", "content": t}] for t in load_prompts(DATA_DIR / "prompts_heldout.jsonl")[:n]]
methods = ["plain"] + [f"b{w}" for w in widths]


def settings(method):
    if method == "plain":
        return mlx_glimmer.GenerationSettings(max_tokens=tokens, speculative=False)
    width = method[1:]
    return mlx_glimmer.GenerationSettings(max_tokens=tokens, block_size="auto" if width == "auto" else int(width))


memory = pair.target.memory
runs = {m: [] for m in methods}
divergences = []
for ids in prompts[:1]:  # warm-up: kernels compiled, the auto calibration measured
    for m in methods:
        mlx_glimmer.generate(pair, ids, settings(m).updated(max_tokens=16))
for rep in range(repeats):
    for p, prompt in enumerate(prompts, 1):
        reference = None
        for m in methods:
            memory.calls.clear()
            result = mlx_glimmer.generate(pair, prompt, settings(m))
            s = result.stats
            wired = next((c[1] for c in memory.calls if c[0] == "wired"), None)
            runs[m].append({"prompt": p, "tokens": s.generated_tokens, "tok_s": s.decode_tokens_per_second,
                            "rounds": s.target_forwards, "tokens_per_round": s.mean_acceptance,
                            "peak_memory_gb": s.peak_memory_gb, "wired_limit_gb": wired / 1e9 if wired else None,
                            "widths": s.verify_width_histogram, "ids": result.token_ids})
            if reference is None:
                reference = result.token_ids
            elif result.token_ids != reference:
                prompt_ids = encode_prompt(pair.tokenizer, prompt)
                width = pair.drafter.block_size if m == "bauto" else int(m[1:])
                d = explain_divergence(pair.target, mlx_dtype(pair), prompt_ids, reference, result.token_ids,
                                       max(width, 2), pair.tokenizer.decode)
                divergences.append({"method": m, "prompt": p, **(d or {"note": "one output is a prefix of the other"})})
        print(f"[mac.sh] repeat {rep + 1}/{repeats} prompt {p}/{len(prompts)} done", file=sys.stderr, flush=True)


def per_prompt_median(m):
    ratios = [r["tok_s"] / q["tok_s"] for r, q in zip(runs[m], runs["plain"]) if q["tok_s"] > 0]
    return statistics.median(ratios) if ratios else 0.0


def total(m, key):
    return sum(r[key] for r in runs[m])


plain_rate = (total("plain", "tokens") - len(runs["plain"])) / sum(
    (r["tokens"] - 1) / r["tok_s"] for r in runs["plain"] if r["tok_s"] > 0)
rows = ["| device | plain tok/s | speculative tok/s | speed-up (median per prompt) | tokens per round | "
        "target forwards/token | peak memory GB | wired limit GB |", "|---|---|---|---|---|---|---|---|"]
summary = {}
for m in methods[1:]:
    rate = (total(m, "tokens") - len(runs[m])) / sum((r["tokens"] - 1) / r["tok_s"] for r in runs[m] if r["tok_s"] > 0)
    per_round = (total(m, "tokens") - len(runs[m])) / max(total(m, "rounds"), 1)
    peak = max(r["peak_memory_gb"] for r in runs[m])
    wired = max((r["wired_limit_gb"] or 0) for r in runs[m])
    summary[m] = {"tok_s": rate, "speedup_median": per_prompt_median(m), "tokens_per_round": per_round,
                  "forwards_per_token": total(m, "rounds") / max(total(m, "tokens"), 1), "peak_memory_gb": peak,
                  "wired_limit_gb": wired or None, "mismatches": sum(d["method"] == m for d in divergences)}
    label = "auto" if m == "bauto" else m[1:]
    rows.append(f"| {device} [{pair.drafter.kind}, block {label}] | {plain_rate:.1f} | {rate:.1f} | "
                f"{summary[m]['speedup_median']:.2f}x | {per_round:.2f} | {summary[m]['forwards_per_token']:.3f} | "
                f"{peak:.2f} | {wired or 0:.2f} |")
plain_peak = max(r["peak_memory_gb"] for r in runs["plain"])
print("\n".join(rows))
print(f"\nplain: peak memory {plain_peak:.2f} GB; bundle {bundle} ({pair.quantization}); {len(prompts)} prompts x {tokens} "
      f"tokens x {repeats} repeats")
print("outputs identical to plain for every method" if not divergences else f"OUTPUT MISMATCHES: {len(divergences)}")
for d in divergences:
    if d.get("tokens"):
        print(format_divergence("block " + d["method"][1:], d["prompt"], d))
report = {"device": device, "bundle": bundle, "quantization": pair.quantization, "mlx": mx.__version__,
          "prompts": len(prompts), "max_tokens": tokens, "repeats": repeats, "plain_tok_s": plain_rate,
          "plain_peak_memory_gb": plain_peak, "summary": summary, "runs": runs, "divergences": divergences,
          "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
with open(out, "w") as f:
    json.dump(report, f, indent=2)
print(f"report: {out}")
PY

# What a round adds around the target's forward, by shape (tree shapes where the drafter seeds trees).
ROUND_OPS_OUT="${OUT%.json}_round_ops.json"
echo
echo "[mac.sh] round ops and overhead by shape -> $ROUND_OPS_OUT" >&2
python benchmarks/round_ops.py ${BUNDLE:+--bundle "$BUNDLE"} --out "$ROUND_OPS_OUT"
