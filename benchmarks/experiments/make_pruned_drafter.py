"""A classic draft model from the target itself: its first N decoder layers + final norm + head.

    python benchmarks/experiments/make_pruned_drafter.py TARGET_DIR OUT_DIR --layers N

Writes an mlx-lm model directory (same tokenizer) that `--drafter OUT_DIR` uses.
"""

import argparse
import json
import shutil
from pathlib import Path

import mlx.core as mx


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, required=True)
    args = ap.parse_args()
    src, out = Path(args.target), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = args.layers
    weights = {}
    for f in sorted(src.glob("model*.safetensors")):
        for k, v in mx.load(str(f)).items():
            parts = k.split(".")
            if "layers" in parts and int(parts[parts.index("layers") + 1]) >= args.layers:
                continue
            weights[k] = v
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(
            (".jinja", "special_tokens_map.json", "generation_config.json")
        ):
            shutil.copy(f, out / f.name)
    print(out)


if __name__ == "__main__":
    main()
