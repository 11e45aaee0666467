"""A drafter in the same format that accepts almost nothing: every weight's values shuffled.

    python benchmarks/make_scrambled_drafter.py DRAFTER_DIR OUT_DIR [--seed 0]

Same config, same tensor names, shapes and dtypes (the draft vocabulary is kept), so it loads and runs
exactly like the original; only what it has learned is gone.
"""

import argparse
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("drafter")
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    src, out = Path(args.drafter), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    weights = {}
    for k, v in mx.load(str(src / "model.safetensors")).items():
        if k == "draft_vocab":
            weights[k] = v
            continue
        flat = np.array(v.astype(mx.float32)).reshape(-1)
        weights[k] = mx.array(rng.permutation(flat).reshape(v.shape)).astype(v.dtype)
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    shutil.copy(src / "config.json", out / "config.json")


if __name__ == "__main__":
    main()
