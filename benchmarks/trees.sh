#!/usr/bin/env bash
# Draft trees against chains and plain decoding, greedy, every output checked against plain (README: "Draft trees").
# Writes benchmarks/results/tree_vs_chain_demo.json and benchmarks/results/trees_*.json, one file a step.
# Run from a shell with the venv active (`python` and `mlx-glimmer` on PATH), on an otherwise idle machine:
#   benchmarks/trees.sh                         all steps, 75 held-out prompts x 128 tokens (hours on a 2-core CPU)
#   N=2 TOKENS=16 benchmarks/trees.sh           a smoke run of every step (minutes)
#   NOTE="what else ran" benchmarks/trees.sh    stored in tree_vs_chain's report
#   STEPS=2345 benchmarks/trees.sh              only the steps named (default all: 12345)
#   COPY_REPEATS=1 benchmarks/trees.sh          runs of each copy-heavy prompt (default 2), averaged per prompt
set -euo pipefail
cd "$(dirname "$0")/.."
BUNDLE=${BUNDLE:-$HOME/.cache/mlx-glimmer/demo}
N=${N:-75}
TOKENS=${TOKENS:-128}
COPY_N=$((N < 20 ? N : 20)) # the copy-heavy file's first 20 prompts: 5 of each kind
COPY_REPEATS=${COPY_REPEATS:-2}
NOTE=${NOTE:-}
STEPS=${STEPS:-12345}
FULL_N=$((N < 8 ? N : 8)) # bench --full: the first 8 held-out prompts
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p benchmarks/results
# 1. tree of 8 verified tokens against a chain of 8, tokens per target forward: tree >= 1.12x chain, N/N equal plain
[[ $STEPS == *1* ]] && python benchmarks/tree_vs_chain.py "$BUNDLE" --num-prompts "$N" --max-tokens "$TOKENS" --width 8 --note "$NOTE" \
  --json-out benchmarks/results/tree_vs_chain_demo.json
# 2. the default (block auto, trees auto) against today's chain-only default and plain, held-out prompts:
#    default >= 1.2x plain, median of per-prompt ratios
[[ $STEPS == *2* ]] && mlx-glimmer bench "$BUNDLE" --full --num-prompts "$FULL_N" --max-tokens "$TOKENS" \
  --block-sizes auto --trees auto,off --no-baseline --json-out benchmarks/results/trees_bench_full.json
# 3. copy-heavy prompts: the default against DFlash chains alone (trees off) and prompt lookup alone, all with plain,
#    interleaved per prompt in one run: default >= 1.6x plain (median), and per prompt within 5% of the better of the
#    other two. Each prompt runs COPY_REPEATS times (default 2): one run of a prompt moves by 5-10% with the load
[[ $STEPS == *3* ]] && mlx-glimmer bench "$BUNDLE" --prompts benchmarks/prompts_copy_heavy.jsonl --num-prompts "$COPY_N" --max-tokens "$TOKENS" \
  --repeats "$COPY_REPEATS" --block-sizes auto --trees auto,off --with-lookup --no-baseline --json-out benchmarks/results/trees_copy_heavy.json
# 4. a drafter that accepts almost nothing (same format, scrambled weights), default settings: >= 0.97x plain
[[ $STEPS == *4* ]] && python benchmarks/make_scrambled_drafter.py "$BUNDLE/drafter" "$WORK/scrambled"
[[ $STEPS == *4* ]] && mlx-glimmer bench "$BUNDLE" --drafter "$WORK/scrambled" --num-prompts "$FULL_N" --max-tokens "$TOKENS" --block-sizes auto \
  --trees auto --no-baseline --json-out benchmarks/results/trees_scrambled.json
# 5. a ~3,500-token prompt (chat template included), default settings: >= 0.97x plain (2 repeats)
[[ $STEPS == *5* ]] && python - "$WORK/long.jsonl" <<'PY'
import json, sys
text = " ".join(f"Note {i}: the meeting about item {i} moved to room {i % 7} on day {i % 5}." for i in range(153))
open(sys.argv[1], "w").write(json.dumps({"prompt": text + "\n\nSummarise these notes in two sentences."}) + "\n")
PY
[[ $STEPS == *5* ]] && mlx-glimmer bench "$BUNDLE" --prompts "$WORK/long.jsonl" --num-prompts 1 --max-tokens "$TOKENS" --repeats 2 \
  --block-sizes auto --trees auto --no-baseline --json-out benchmarks/results/trees_long_context.json
true
