#!/usr/bin/env bash
# --block-size auto against plain decoding and every fixed width, greedy, side by side per prompt.
# Writes benchmarks/results/block_auto_*.json (bench checks that all methods produce the same tokens).
set -euo pipefail
cd "$(dirname "$0")/.."
BUNDLE=${BUNDLE:-$HOME/.cache/mlx-glimmer/demo}
N=${N:-3}
TOKENS=${TOKENS:-64}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p benchmarks/results
# 1. a drafter that accepts almost nothing (same format, scrambled weights): auto >= 0.95x plain
python benchmarks/make_scrambled_drafter.py "$BUNDLE/drafter" "$WORK/scrambled"
mlx-glimmer bench "$BUNDLE" --drafter "$WORK/scrambled" --num-prompts "$N" --max-tokens "$TOKENS" --no-baseline \
  --block-sizes auto,16 --json-out benchmarks/results/block_auto_scrambled.json
# 2. the demo drafter: auto >= 0.95x the best fixed width and >= 1.0x plain
mlx-glimmer bench "$BUNDLE" --num-prompts "$N" --max-tokens "$TOKENS" --no-baseline \
  --block-sizes auto,2,4,8,16 --json-out benchmarks/results/block_auto_demo.json
# 3. prompt lookup on copy-heavy prompts: auto >= 0.9x the best fixed width
mlx-glimmer bench "$BUNDLE" --prompt-lookup --prompts benchmarks/prompts_copy.jsonl --num-prompts 3 --max-tokens 96 \
  --no-baseline --block-sizes auto,4,8,11 --json-out benchmarks/results/block_auto_prompt_lookup.json
# 4. a ~3k-token prompt: auto >= 0.95x plain
python - "$WORK/long.jsonl" <<'PY'
import json, sys
text = " ".join(f"Note {i}: the meeting about item {i} moved to room {i % 7} on day {i % 5}." for i in range(190))
open(sys.argv[1], "w").write(json.dumps({"prompt": text + "\n\nSummarise these notes in two sentences."}) + "\n")
PY
mlx-glimmer bench "$BUNDLE" --prompts "$WORK/long.jsonl" --num-prompts 1 --max-tokens "$TOKENS" --no-baseline --repeats 2 \
  --block-sizes auto,16 --json-out benchmarks/results/block_auto_long_context.json
