#!/usr/bin/env bash
# The default (`--block-size auto`, trees auto) against plain decoding and against prompt lookup alone, side by
# side (interleaved per prompt in each run), on four kinds of input; every output checked against plain greedy.
# Writes one JSON (OUT, default benchmarks/results/auto_vs_plain.json) naming the CPU, with each suite's bench
# report and its medians of per-prompt speed-ups. Run from the repository root with the venv active, on an
# otherwise idle machine (timings under other load say nothing):
#   benchmarks/auto_vs_plain.sh                      everyday 8 x 128, copy-heavy 16 x 128 (2 repeats), scrambled 8 x 128, long 1 x 128 (2 repeats)
#   N=2 TOKENS=16 REPEATS=1 benchmarks/auto_vs_plain.sh   a smoke run: outputs equal, figures meaningless
set -euo pipefail
cd "$(dirname "$0")/.."
BUNDLE=${BUNDLE:-$HOME/.cache/mlx-glimmer/demo}
N=${N:-8}
COPY_N=${COPY_N:-$((N * 2))}
TOKENS=${TOKENS:-128}
REPEATS=${REPEATS:-2}
OUT=${OUT:-benchmarks/results/auto_vs_plain.json}
NOTE=${NOTE:-}  # what else ran on the machine, stored in the results file
LOAD_BEFORE=$(cut -d" " -f1-3 /proc/loadavg 2>/dev/null || uptime)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$(dirname "$OUT")"
common=(--max-tokens "$TOKENS" --block-sizes auto --trees auto --with-lookup --no-baseline)
# 1. everyday prompts (held-out set)
mlx-glimmer bench "$BUNDLE" --num-prompts "$N" "${common[@]}" --json-out "$WORK/everyday.json"
# 2. copy-heavy prompts (answers that repeat long spans of their context)
mlx-glimmer bench "$BUNDLE" --prompts benchmarks/prompts_copy_heavy.jsonl --num-prompts "$COPY_N" --repeats "$REPEATS" \
  "${common[@]}" --json-out "$WORK/copy_heavy.json"
# 3. a drafter that accepts almost nothing (the demo drafter's weights shuffled)
python benchmarks/make_scrambled_drafter.py "$BUNDLE/drafter" "$WORK/scrambled"
mlx-glimmer bench "$BUNDLE" --drafter "$WORK/scrambled" --num-prompts "$N" "${common[@]}" --json-out "$WORK/scrambled.json"
# 4. a ~3,478-token prompt (153 numbered notes and a request to summarise them, chat template included)
python - "$WORK/long.jsonl" <<'PY'
import json, sys
text = " ".join(f"Note {i}: the meeting about item {i} moved to room {i % 7} on day {i % 5}." for i in range(153))
open(sys.argv[1], "w").write(json.dumps({"prompt": text + "\n\nSummarise these notes in two sentences."}) + "\n")
PY
mlx-glimmer bench "$BUNDLE" --prompts "$WORK/long.jsonl" --num-prompts 1 --repeats "$REPEATS" "${common[@]}" \
  --json-out "$WORK/long_prompt.json"
python - "$WORK" "$OUT" "$0 (N=$N COPY_N=$COPY_N TOKENS=$TOKENS REPEATS=$REPEATS)" "$NOTE" "$LOAD_BEFORE" <<'PY'
import json, sys
from pathlib import Path
from mlx_glimmer.cpu import chip_name

work, out, command, note, load = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
suites, summary = {}, {}
for name in ("everyday", "copy_heavy", "scrambled", "long_prompt"):
    report = json.loads((work / f"{name}.json").read_text())
    suites[name] = report
    res = report["results"]
    auto = next(m for m in res if m.startswith("spec_"))
    summary[name] = {
        "auto_over_plain": res[auto]["median_speedup_over_plain"],
        "lookup_over_plain": res["lookup"]["median_speedup_over_plain"],
        "auto_over_lookup": res[auto]["tokens_per_second"] / max(res["lookup"]["tokens_per_second"], 1e-9),
        "mismatches": sum(r.get("mismatches", 0) for r in res.values()),
        "auto_widths": res[auto]["verify_width_histogram"],
    }
env = suites["everyday"]["environment"]
result = {"command": command, "cpu": chip_name(), "device": env["device"], "blas": env["blas"], "note": note,
          "load_average_before": load, "summary": summary, "suites": suites}
out.write_text(json.dumps(result, indent=1) + "\n")
print(f"cpu {result['cpu']}, blas {result['blas']}")
for name, s in summary.items():
    print(f"{name:12s} auto/plain {s['auto_over_plain']:.2f}x  lookup/plain {s['lookup_over_plain']:.2f}x  "
          f"auto/lookup {s['auto_over_lookup']:.2f}x  mismatches {s['mismatches']}")
print(f"wrote {out}")
sys.exit(1 if any(s["mismatches"] for s in summary.values()) else 0)
PY
