#!/usr/bin/env bash
# Drafting methods side by side on the demo target (float32 SmolLM2-135M-Instruct), greedy, this CPU.
# Writes benchmarks/experiments/results/bench_*.json and prints one table per method.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUNDLE=${BUNDLE:-$HOME/.cache/mlx-glimmer/demo}
N=${N:-6}
TOKENS=${TOKENS:-96}
export LD_PRELOAD=${LD_PRELOAD:-/usr/lib/x86_64-linux-gnu/libopenblas.so.0}
GGUF=$(ls "${MLX_GLIMMER_CACHE:-$HOME/.cache/mlx-glimmer}"/SmolLM2-135M-Instruct.Q4_1.gguf)
WORK=$(mktemp -d)
mlx-glimmer convert --target "$GGUF" --out "$WORK/q4" --bits 4 --dtype float32 --quiet  # float32 scales: MLX CPU quantized matmul is ~40x slower with float16
python benchmarks/experiments/make_pruned_drafter.py "$BUNDLE/target" "$WORK/pruned8" --layers 8
mkdir -p benchmarks/experiments/results
mlx-glimmer bench "$BUNDLE" --num-prompts "$N" --max-tokens "$TOKENS" --json-out benchmarks/experiments/results/bench_dflash.json
mlx-glimmer bench "$BUNDLE" --num-prompts "$N" --max-tokens "$TOKENS" --no-baseline --drafter "$WORK/q4/target" --draft-k 4 --json-out benchmarks/experiments/results/bench_self4bit.json
mlx-glimmer bench "$BUNDLE" --num-prompts "$N" --max-tokens "$TOKENS" --no-baseline --drafter "$WORK/pruned8" --draft-k 4 --json-out benchmarks/experiments/results/bench_pruned8.json
mlx-glimmer bench "$BUNDLE" --num-prompts "$N" --max-tokens "$TOKENS" --no-baseline --prompt-lookup --json-out benchmarks/experiments/results/bench_prompt_lookup.json
rm -rf "$WORK"
