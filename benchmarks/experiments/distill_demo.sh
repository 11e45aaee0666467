#!/usr/bin/env bash
# End to end: the earlier demo drafter's data, trainer throughput, training runs, scaling curve, shipping, checks.
# It made benchmarks/experiments/drafters/demo-vocab8192, shipped until the current drafter (trained on from it:
# docs/distill.md, "How the shipped drafter was made"); its ship step puts the best run in that folder.
# Every step resumes: re-run the script (or one step: STEPS="train curve" benchmarks/experiments/distill_demo.sh).
# Tuned for the 2-core x86 CPU (AVX-512 bf16/AMX) it was measured on; on a Mac drop the torch-specific flags.
set -euo pipefail
cd "$(dirname "$0")/../.."
STEPS=${STEPS:-"data throughput train curve ship check"}
TRAIN_STEPS=${TRAIN_STEPS:-600}
DATA=(--prompts synth --self-instruct 128 --follow-ups 1500 --temperatures 0,0.8 --answer-tokens 256)
TRAIN=(--layers 2 --sequences-per-step 4 --anchors 64 --draft-vocab 8192 --steps "$TRAIN_STEPS" --eval-every 150
       --eval-prompts 4 --eval-tokens 96 --train-backend auto)
has() { [[ " $STEPS " == *" $1 "* ]]; }

if has data; then  # the target's answers: ~4 h of one idle 2-core CPU for all of them (bfloat16 generation)
  # (the kept data stopped at 1.5M target tokens: every greedy answer, the follow-ups, 1,728 of the 0.8 ones;
  # generated as greedy + follow-ups first: the same records, in another order)
  mlx-glimmer distill --out runs/demo2 "${DATA[@]}" --batch-size 64 --gen-dtype bfloat16 --data-only
fi
if has train; then  # random init vs the target's last two layers, same answers and features
  # (in the 2026-11-30 run the answers stopped at 897k target tokens for time, and run 2 was stopped after
  # its step-300 evaluation: same schedule as run 1 up to there)
  mlx-glimmer distill --out runs/demo2 "${DATA[@]}" "${TRAIN[@]}" --init random --train-only
  mkdir -p runs/demo2-target
  ln -sfn ../demo2/data runs/demo2-target/data
  ln -sfn ../demo2/features runs/demo2-target/features
  mlx-glimmer distill --out runs/demo2-target "${DATA[@]}" "${TRAIN[@]}" --init target --train-only
  # run 3: fine-tune the drafter shipped before (git show 6426820:mlx_glimmer/data/demo_drafter), all 1.5M tokens
  mkdir -p runs/demo3
  ln -sfn ../demo2/data runs/demo3/data
  mlx-glimmer distill --out runs/demo3 "${DATA[@]}" "${TRAIN[@]}" --steps 3500 --eval-every 500 \
    --init mlx_glimmer/data/demo_drafter --train-only  # (2026-11-30: stopped after the step-2000 evaluation)
  cp runs/demo3/log.json benchmarks/experiments/distill/demo2/run_finetune.log.json
  # run 4: run 3's step-2000 drafter (shipped in 71400ed) trained on, a fresh 5,000-step schedule, run 3's features
  mkdir -p runs/demo4
  ln -sfn ../demo2/data runs/demo4/data
  ln -sfn ../demo3/features runs/demo4/features
  mlx-glimmer distill --out runs/demo4 "${DATA[@]}" "${TRAIN[@]}" --steps 5000 --eval-every 500 \
    --init mlx_glimmer/data/demo_drafter --train-only  # (--init: 71400ed's drafter, run 3's step 2000)
  cp runs/demo4/log.json benchmarks/experiments/distill/demo2/run_finetune2.log.json
  # run 5, depth: two arms from run 4's drafter, same 2,000-step schedule; 2 layers vs 3 (grown by an identity layer)
  for arm in "demo5 2 run_finetune3" "demo5-deep 3 run_deep3"; do
    read -r dir layers kept <<<"$arm"
    mkdir -p "runs/$dir"
    ln -sfn ../demo2/data "runs/$dir/data"
    ln -sfn ../demo3/features "runs/$dir/features"
    mlx-glimmer distill --out "runs/$dir" "${DATA[@]}" "${TRAIN[@]}" --layers "$layers" --steps 2000 --eval-every 500 \
      --init runs/demo4/drafter --train-only
    cp "runs/$dir/log.json" "benchmarks/experiments/distill/demo2/$kept.log.json"
  done
  # run 6: the shipped drafter (run 5's), 500 steps of the per-width compiled step (a check of it in a real run)
  mkdir -p runs/demo6
  ln -sfn ../demo2/data runs/demo6/data
  ln -sfn ../demo3/features runs/demo6/features
  mlx-glimmer distill --out runs/demo6 "${DATA[@]}" "${TRAIN[@]}" --steps 500 --eval-every 500 \
    --init benchmarks/experiments/drafters/demo-vocab8192 --train-only
  cp runs/demo6/log.json benchmarks/experiments/distill/demo2/run_finetune4.log.json
fi
if has throughput; then  # old trainer (c12d381) vs today's, same drafter and answers: all of them (needs run 3's features)
  # (trainer_throughput_full.json and _full2.json were taken with this script at e9947c2 and ce8201d, before the
  # step was compiled per context width: `git show COMMIT:benchmarks/distill_demo.sh`)
  python benchmarks/experiments/trainer_throughput.py runs/demo2 --records 0 --features-dir runs/demo3/features --steps 20 --rounds 3 \
    --skip mlx --no-kernels --out benchmarks/experiments/results/trainer_throughput_full3.json
  python benchmarks/experiments/trainer_throughput.py runs/demo2 --records 0 --features-dir runs/demo3/features --steps 20 --rounds 5 \
    --skip mlx --no-kernels --out benchmarks/experiments/results/trainer_throughput_full5.json
  python benchmarks/experiments/torch_step_shapes.py runs/demo2 --features-dir runs/demo3/features --steps 10 --rounds 3
fi
if has curve; then
  python benchmarks/experiments/scaling_curve.py benchmarks/experiments/distill/demo2/run_random_init.log.json \
    benchmarks/experiments/distill/demo2/run_target_init.log.json benchmarks/experiments/distill/demo2/run_finetune.log.json \
    benchmarks/experiments/distill/demo2/run_finetune2.log.json benchmarks/experiments/distill/demo2/run_finetune3.log.json \
    benchmarks/experiments/distill/demo2/run_deep3.log.json benchmarks/experiments/distill/demo2/run_finetune4.log.json \
    --continues run_finetune2=run_finetune --continues run_finetune3=run_finetune2 --continues run_deep3=run_finetune2 \
    --continues run_finetune4=run_finetune3 \
    --out benchmarks/experiments/results/scaling_curve
fi
if has ship; then  # the run whose best held-out evaluation is highest
  best=$(python - <<'PY'
import json
runs = ["runs/demo2", "runs/demo2-target", "runs/demo3", "runs/demo4", "runs/demo5", "runs/demo5-deep", "runs/demo6"]
print(max(runs, key=lambda r: json.load(open(f"{r}/log.json"))["exported"]["mean_acceptance"]))
PY
)
  dest=benchmarks/experiments/drafters/demo-vocab8192
  rm -rf "$dest.new"
  cp -r "$best/drafter" "$dest.new"
  cp "$best/log.json" "$dest.new/training_log.json"
  rm -rf "$dest" && mv "$dest.new" "$dest"
fi
if has check; then  # held-out acceptance (checked against plain greedy) and speed, default settings
  bundle=runs/demo-vocab8192-bundle
  [ -d "$bundle" ] || mlx-glimmer convert --target ~/.cache/mlx-glimmer/demo/target \
    --drafter benchmarks/experiments/drafters/demo-vocab8192 --out "$bundle" --bits 16 --dtype float32
  python benchmarks/demo_acceptance.py "$bundle" --limit 8 --max-tokens 128 --out benchmarks/results/demo_acceptance_demo5.json
  python benchmarks/demo_acceptance.py "$bundle" --max-tokens 128 --out benchmarks/results/demo_acceptance_demo5_all.json  # all 75
  mlx-glimmer bench "$bundle" --full --block-sizes auto,16 --no-baseline --json-out benchmarks/results/bench_demo5_full_cpu.json
fi
