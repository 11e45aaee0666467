#!/usr/bin/env bash
# Torch/CUDA checks of mlx-glimmer on a lent GPU machine that has NO network.
#
# What that machine has:
#   Python 3.12, torch 2.11 (CUDA 13), transformers 5.17, numpy, safetensors,
#   tokenizers, jinja2, pytest, scipy. transformers 5.17 already has
#   MuseGlimmerForConditionalGeneration, MuseGlimmerAssistantModel, DFlashCache
#   and DynamicSlidingWindowLayer.activate_past_recording: our torch backend runs
#   on it as is (the cache argument is `past_key_values` there, `cache` in 5.24;
#   target.cache_keyword picks it), so no transformers wheel is carried.
#   Missing: mlx, mlx-lm (and textual, which these checks do not need).
#
# What travels (64 MiB in all; the working tree is 18 MB since the demo drafter,
# mlx_glimmer/data/demo_drafter, 17.5 MB float16, is tracked):
#   .whl/   mlx 0.32.4 cp312 (0.8 MB) + mlx-cpu 0.32.4 (10.5 MB) + mlx-lm 0.32.2 (0.5 MB)
#           = 11.8 MB: MLX's CPU backend, for the MLX half of parity, the converter
#           and the bundle loader (bundle weights are dequantized by MLX).
#   .carry/demo/  optional, any bundle to check instead of the SmolLM2-shaped one below
#           (with float32 scales: MLX's CPU float16 kernels take minutes per prefill).
# What does not fit: mlx-cuda-13 (89.8 MB: MLX never runs on the GPU); the demo target
#   in any form: float32 538 MB, as converted from the GGUF (4-bit blocks, 8-bit
#   embedding) 98 MB, the GGUF itself 98 MB, even 2-bit/group 64 re-quantized (42.2 MB
#   + 3.5 MB tokenizer.json) next to 18 MB of tree and 11.8 MB of wheels (75.5 MB).
#   So the real-size step uses a random llama of SmolLM2's shape built on the device,
#   with the shipped demo drafter: real sizes and kernels, meaningless acceptance.
#   (Measured here: the 2-bit demo, widened to float32 scales, passes parity on CPU.)
#   Everything else runs on tiny random checkpoints built on the device.
#
# Usage:
#   here, once, with network:   bash benchmarks/device_check.sh --prepare
#   on the device:              bash benchmarks/device_check.sh   (with .whl/ copied along, and
#                                   .carry/ to check a carried bundle; about 9 minutes at most)
#   here, to test the script:   bash benchmarks/device_check.sh --device cpu --no-install
# Options: --device cuda|cpu|mps (default cuda), --no-install (use this python's
#   packages), --quick (fewer prompts/tokens). Each step has a timeout, and all of
#   them share a deadline of $BUDGET seconds (default 520): steps that no longer fit
#   are skipped, most important first, so the run returns inside the device call.
# Output: one directory, $OUT if set, else ./device_out (9 files at most, what
#   such a machine hands back): summary.txt (environment + one line per step),
#   log.txt (everything), pytest.txt, parity_tiny.txt, parity_tiny.json,
#   cuda_checks.txt, demo.txt, demo_parity.json, engines.txt (the drafter exported for vLLM/SGLang).

set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
DEVICE=cuda
INSTALL=1
QUICK=0
PREPARE=0
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE=$2; shift ;;
    --no-install) INSTALL=0 ;;
    --quick) QUICK=1 ;;
    --prepare) PREPARE=1 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
PY=${PYTHON:-python3}

if [ "$PREPARE" = 1 ]; then
  # Runs here (network), fills the ignored folders the device run carries.
  PY=${PYTHON:-.venv/bin/python}
  for d in /.whl/ /.carry/; do grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
  mkdir -p .whl
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    -d .whl mlx==0.32.4 mlx-cpu==0.32.4 mlx-lm==0.32.2 || exit 1
  total=$(du -scb .whl .carry $(git ls-files) $(git ls-files -o --exclude-standard) 2>/dev/null | tail -1 | cut -f1)
  du -sh .whl .carry 2>/dev/null
  echo "travels: $((total / 1048576)) MiB of 64 MiB"
  [ "$total" -lt $((64 * 1048576)) ] || { echo "too big to carry" >&2; exit 1; }
  exit 0
fi

OUT=${OUT:-$ROOT/device_out}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/glimmer-check.XXXXXX)
LOG=$OUT/log.txt
SUMMARY=$OUT/summary.txt
: > "$LOG"
: > "$SUMMARY"
DEADLINE=$((SECONDS + ${BUDGET:-520}))
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 MLX_GLIMMER_CACHE=$WORK/cache
if [ "$QUICK" = 1 ]; then NP=2; NT=24; else NP=4; NT=64; fi

step() {  # step NAME SECONDS OUTFILE CMD...: run CMD with a timeout, tee to OUTFILE and the log, record the result
  local name=$1 limit=$2 out=$3; shift 3
  local t0=$SECONDS rc left=$((DEADLINE - SECONDS))
  if [ $left -lt 15 ]; then echo "$name: SKIPPED (deadline)" | tee -a "$SUMMARY"; return; fi
  [ $limit -gt $left ] && limit=$left
  echo "=== $name: $*" >> "$LOG"
  timeout "$limit" "$@" > >(tee -a "$out" >> "$LOG") 2>> "$LOG"
  rc=$?
  sleep 0.2
  if [ $rc = 0 ]; then s=ok; elif [ $rc = 124 ]; then s="TIMEOUT after ${limit}s"; else s="FAIL (exit $rc)"; fi
  echo "$name: $s in $((SECONDS - t0)) s" | tee -a "$SUMMARY"
}

{
  echo "date: $(date -u +%FT%TZ)  host: $(uname -srm)  device flag: $DEVICE"
  command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
} >> "$SUMMARY"

# 1. Packages: carried wheels into /tmp/site, our source as a package tree (no build step needed).
if [ "$INSTALL" = 1 ]; then
  if ls .whl/*.whl > /dev/null 2>&1; then
    step install-wheels 90 /dev/null $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$WORK/site" .whl/*.whl
  else
    echo "install-wheels: no .whl/ carried (run --prepare here first)" | tee -a "$SUMMARY"
  fi
  mkdir -p "$WORK/src"
  cp -r mlx_glimmer "$WORK/src/" && cp -r convert "$WORK/src/mlx_glimmer/convert" && cp -r tui "$WORK/src/mlx_glimmer/tui"
  export PYTHONPATH=$WORK/src:$WORK/site${PYTHONPATH:+:$PYTHONPATH}
fi
# From here on the working directory is $WORK: the checkout's own mlx_glimmer/ (without its convert/ and tui/
# subpackages, which live beside it) must not shadow the package on the path.
export ROOT
cd "$WORK"
GLIMMER="$PY -m mlx_glimmer.cli"
$PY - >> "$SUMMARY" 2>&1 <<'EOF'
import platform, torch, transformers, numpy
try:
    import mlx.core as mx, mlx_lm
    mlx = f"mlx {mx.__version__} ({mx.default_device()}), mlx-lm {mlx_lm.__version__}"
except ImportError as e:
    mlx = f"no mlx ({e})"
cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no cuda"
print(f"python {platform.python_version()}, torch {torch.__version__} ({cuda}), transformers {transformers.__version__}, "
      f"numpy {numpy.__version__}, {mlx}")
from transformers import MuseGlimmerAssistantModel, MuseGlimmerForConditionalGeneration  # noqa: F401
print("transformers has MuseGlimmerForConditionalGeneration and MuseGlimmerAssistantModel")
EOF

# 2. Tiny random checkpoints (as the tests build them) and bundles made from them by our converter.
CK=$WORK/ckpt
step build-tiny 120 /dev/null $PY - "$CK" <<'EOF'
import os, sys
from pathlib import Path
sys.path.insert(0, os.environ["ROOT"] + "/tests")
import tiny_checkpoints as tc
from mlx_glimmer.convert.bundle import convert
root = Path(sys.argv[1])
tc.build_muse_target(root / "muse")
tc.build_assistant(root / "assistant", target_layer_ids=[1, 3, 5])
tc.build_llama_target(root / "llama")
tc.build_assistant(root / "llama_assistant", target_layer_ids=[1, 2, 4], sliding_window=8)
for name, drafter, bits in [("muse", "assistant", 16), ("muse", "assistant", 8), ("llama", "llama_assistant", 16)]:
    convert(root / name, root / f"{name}-{bits}", drafter=root / drafter, bits=bits, group_size=32, dtype="float32")
print("built", sorted(p.name for p in root.iterdir()))
EOF

# 3. Parity, MLX CPU vs torch on $DEVICE, on the tiny bundles (window 8: every run is far past it).
: > "$OUT/parity_tiny.txt"
for spec in "muse-16 float32" "muse-16 bfloat16" "muse-8 float32" "llama-16 float32"; do
  set -- $spec
  echo "--- parity $1 torch $2" >> "$OUT/parity_tiny.txt"
  step "parity-$1-$2" 90 "$OUT/parity_tiny.txt" $GLIMMER parity "$CK/$1" --device "$DEVICE" --torch-dtype "$2" \
    --num-prompts $NP --max-tokens $NT --json "$WORK/parity-$1-$2.json"
done
$PY - "$WORK" "$OUT/parity_tiny.json" <<'EOF' >> "$LOG" 2>&1
import json, sys
from pathlib import Path
runs = {p.stem: json.loads(p.read_text()) for p in sorted(Path(sys.argv[1]).glob("parity-*.json"))}
Path(sys.argv[2]).write_text(json.dumps(runs, indent=1))
EOF

# 4. On $DEVICE: torch speculative == torch plain == MLX plain for 220 tokens (window 8), float32 and bfloat16;
#    generate --backend torch --json. bfloat16 divergences are reported with their logit gap, not failed.
step lossless 120 "$OUT/cuda_checks.txt" $PY - "$CK" "$DEVICE" <<'EOF'
import sys, time
import mlx_glimmer
from mlx_glimmer.settings import GenerationSettings
from mlx_glimmer.speculative import generate_steps as mlx_steps
from mlx_glimmer.torch_backend import load_torch
from mlx_glimmer.speculative import generate_steps  # the one loop: a torch target runs it too
ck, device = sys.argv[1], sys.argv[2]
prompt = [256] + list(b"Once upon a time")
toks = lambda steps: [t for s in steps for t in s.tokens]


def report(pair, ref, i, other):
    """The reference's logit gap to the other token at the divergence (bfloat16 ulp at 16..32 is 0.125)."""
    logits = pair.target.last_logits(prompt + ref[:i])
    return f"{ref[i]} vs {other}, gap {float(logits[ref[i]] - logits[other]):.3g} ({pair.dtype})"


ref = toks(mlx_steps(mlx_glimmer.load(target=f"{ck}/muse").target, prompt, GenerationSettings(max_tokens=220)))
failed = False
for dtype in ("float32", "bfloat16"):
    pair = load_torch(target=f"{ck}/muse", drafter=f"{ck}/assistant", device=device, dtype=dtype)
    t0 = time.perf_counter()
    plain = toks(generate_steps(pair.target, prompt, GenerationSettings(max_tokens=220)))
    t1 = time.perf_counter()
    for block in (4, 16):
        settings = GenerationSettings(max_tokens=220, block_size=block)
        steps = list(generate_steps(pair.target, prompt, settings, drafter=pair.drafter))
        spec = toks(steps)
        i = next((i for i, (a, b) in enumerate(zip(spec, plain)) if a != b), None)
        where = "identical" if i is None else f"first divergence at token {i}: {report(pair, plain, i, spec[i])}"
        failed |= dtype == "float32" and i is not None
        print(f"{device} {dtype} block {block}: speculative vs plain over 220 tokens: {where}; {len(steps) - 1} rounds")
    i = next((i for i, (a, b) in enumerate(zip(plain, ref)) if a != b), None)
    where = "identical" if i is None else f"first divergence at token {i}: {report(pair, ref, i, plain[i])}"
    failed |= dtype == "float32" and i is not None
    print(f"{device} {dtype}: torch plain vs MLX CPU float32 plain: {where}; plain {220 / (t1 - t0):.0f} tok/s (tiny)")
sys.exit(1 if failed else 0)
EOF
step generate-json 60 "$OUT/cuda_checks.txt" $GLIMMER generate "$CK/muse-8" --backend torch --device "$DEVICE" \
  --prompt "Hello there" --chat --max-tokens 40 --block-size 4 --json

# 5. The torch backend's tests (on CPU: this machine's Python and transformers).
step pytest 150 "$OUT/pytest.txt" $PY -m pytest -q -p no:cacheprovider "$ROOT/tests/test_torch_backend.py"

# 6. A SmolLM2-135M-shaped pair on $DEVICE: parity, and the benchmark's torch backend when `bench` has one.
#    The real demo target does not fit the carry limit (see the header), so unless a bundle is carried in
#    .carry/demo, the target is a random llama of SmolLM2's shape (30 layers, 576 wide, 9/3 heads, vocab
#    49152), built here, with the demo drafter shipped in mlx_glimmer/data/demo_drafter: real sizes and
#    kernels, meaningless text and acceptance.
: > "$OUT/demo.txt"
DEMO=$ROOT/.carry/demo
if ! [ -f "$DEMO/glimmer.json" ]; then
  DEMO=$WORK/smol
  step build-smol 120 /dev/null $PY - "$DEMO" "$CK/muse" <<'EOF'
import shutil, sys, torch
from pathlib import Path
from transformers import LlamaConfig, LlamaForCausalLM
from mlx_glimmer.convert.bundle import convert
from mlx_glimmer.demo import SHIPPED_DRAFTER
out, tok = Path(sys.argv[1]), Path(sys.argv[2])
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
src = out.parent / "smol-hf"
LlamaForCausalLM(cfg).float().save_pretrained(src)
for f in tok.glob("*token*"):  # the tiny byte-level tokenizer: ids < 272, prompts still encode
    shutil.copy(f, src / f.name)
shutil.copy(tok / "chat_template.jinja", src / "chat_template.jinja")
drafter = SHIPPED_DRAFTER if (SHIPPED_DRAFTER / "config.json").is_file() else None
convert(src, out, drafter=drafter, bits=16, dtype="float32")
EOF
fi
step demo-parity 180 "$OUT/demo.txt" $GLIMMER parity "$DEMO" --device "$DEVICE" --torch-dtype float32 \
  --num-prompts 2 --max-tokens $((NT / 2)) --json "$OUT/demo_parity.json"
if $GLIMMER bench --help 2>/dev/null | grep -q -- "--backend"; then
  step demo-bench 150 "$OUT/demo.txt" $GLIMMER bench "$DEMO" --backend torch --device "$DEVICE"
else
  echo "demo-bench: this mlx-glimmer's bench has no --backend flag" | tee -a "$SUMMARY"
fi

# 7. The pair's drafter exported for the serving engines (docs/export.md), then served by vLLM and SGLang where this
#    machine has them (neither travels: vLLM's wheel alone is 336 MB and pins its own torch). Acceptance means
#    something only on a real target (.carry/demo); on the random one the run checks that the engines load the layout.
: > "$OUT/engines.txt"
step export-dflash 60 "$OUT/engines.txt" $GLIMMER export "$DEMO" --format dflash --out "$WORK/export-dflash" \
  --verifier "$DEMO/target"
step export-speculators 60 "$OUT/engines.txt" $GLIMMER export "$DEMO" --format speculators --out "$WORK/export-spec" \
  --verifier "$DEMO/target"
BLOCK=$($PY -c 'import json, sys; print(json.load(open(sys.argv[1]))["block_size"])' "$WORK/export-dflash/config.json" 2>/dev/null)
BLOCK=${BLOCK:-16}
if $PY -c "import vllm" 2>/dev/null && [ "$DEVICE" = cuda ]; then
  # vLLM drafts block_size - 1 tokens (the anchor is the bonus token); `vllm serve TARGET --speculative-config` alike
  step vllm-dflash 240 "$OUT/engines.txt" $PY - "$DEMO/target" "$WORK/export-dflash" "$BLOCK" <<'EOF'
import sys
from vllm import LLM, SamplingParams
target, drafter, block = sys.argv[1], sys.argv[2], int(sys.argv[3])
llm = LLM(model=target, max_model_len=2048, gpu_memory_utilization=0.5,
          speculative_config={"method": "dflash", "model": drafter, "num_speculative_tokens": block - 1})
out = llm.generate(["Write a short story about a lighthouse keeper."], SamplingParams(temperature=0, max_tokens=64))
print(repr(out[0].outputs[0].text))
for metric in llm.get_metrics():
    if "spec_decode" in metric.name:
        print(metric.name, getattr(metric, "value", getattr(metric, "values", "")))
EOF
else
  {
    echo "vllm-dflash: SKIPPED (no vllm here, or not cuda); on a GPU machine with vLLM:"
    echo "  vllm serve TARGET --speculative-config '{\"method\": \"dflash\", \"model\": \"DFLASH_DIR\", \"num_speculative_tokens\": $((BLOCK - 1))}'"
    echo "  vllm serve SPECULATORS_DIR"
  } | tee -a "$SUMMARY"
fi
if $PY -c "import sglang" 2>/dev/null && [ "$DEVICE" = cuda ]; then
  # SGLang counts the anchor among its draft tokens: block_size of them
  step sglang-dflash 240 "$OUT/engines.txt" $PY - "$DEMO/target" "$WORK/export-dflash" "$BLOCK" <<'EOF'
import sys
import sglang as sgl
target, drafter, block = sys.argv[1], sys.argv[2], int(sys.argv[3])
engine = sgl.Engine(model_path=target, speculative_algorithm="DFLASH", speculative_draft_model_path=drafter,
                    speculative_num_draft_tokens=block, mem_fraction_static=0.5)
out = engine.generate("Write a short story about a lighthouse keeper.", {"temperature": 0, "max_new_tokens": 64})
meta = out.get("meta_info", {})
print(repr(out["text"]), "verify rounds", meta.get("spec_verify_ct"), "tokens", meta.get("completion_tokens"))
engine.shutdown()
EOF
else
  {
    echo "sglang-dflash: SKIPPED (no sglang here, or not cuda); on a GPU machine with SGLang:"
    echo "  python -m sglang.launch_server --model-path TARGET --speculative-algorithm DFLASH" \
      "--speculative-draft-model-path DFLASH_DIR --speculative-num-draft-tokens $BLOCK"
  } | tee -a "$SUMMARY"
fi

rm -rf "$WORK"
grep -q -E "FAIL|TIMEOUT" "$SUMMARY" && exit 1
exit 0
