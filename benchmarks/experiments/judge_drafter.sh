#!/usr/bin/env bash
# A trained drafter against the shipped one, on the held-out prompts the acceptance bars are stated on.
#
#     benchmarks/experiments/judge_drafter.sh DRAFTER NAME [NOTE]
#
# DRAFTER is a drafter directory `distill` exported (RUN/drafter); NAME names its results files. It writes
#   benchmarks/experiments/results/ablation/NAME_acceptance.json   all 75 held-out prompts x 128 tokens, greedy,
#                                                                 a 16-wide chain: tokens per forward, first
#                                                                 draft accepted, every output against plain
#   benchmarks/experiments/results/tree_vs_chain_NAME.json         the first 16 held-out prompts at a fixed width
#                                                                 of 8: tree against chain
# and the bundle DRAFTER/../bundle (the demo target with this drafter, float32) that tree_vs_chain reads. NOTE
# (what else ran on the machine) goes into the tree_vs_chain report. The shipped drafter's figures on the same
# measures: docs/drafter-research.md ("Where the acceptance bar stands").
set -euo pipefail
cd "$(dirname "$0")/../.."
drafter=${1:?usage: judge_drafter.sh DRAFTER NAME [NOTE]}
name=${2:?usage: judge_drafter.sh DRAFTER NAME [NOTE]}
note=${3:-}
py=${PYTHON:-.venv/bin/python}
bundle="$(dirname "$drafter")/bundle"
results=benchmarks/experiments/results
[ -f "$drafter/model.safetensors" ] || { echo "error: $drafter/model.safetensors not found (a drafter directory)" >&2; exit 2; }
target=$("$py" -c "from mlx_glimmer.demo import demo_bundle; print(demo_bundle() / 'target')")
"$py" benchmarks/experiments/drafter_diagnosis.py --drafter "$drafter" --parts c --prompts 75 \
  --out "$results/ablation/${name}_acceptance.json"
[ -d "$bundle" ] || "$py" -m mlx_glimmer.cli convert --target "$target" --drafter "$drafter" --out "$bundle" \
  --bits 16 --dtype float32
"$py" benchmarks/tree_vs_chain.py "$bundle" --num-prompts 16 --json-out "$results/tree_vs_chain_${name}.json" \
  --note "$note"
