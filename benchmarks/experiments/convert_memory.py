"""Peak resident memory of `mlx-glimmer convert` on a generated >= 1.5 GB float checkpoint.

    python benchmarks/experiments/convert_memory.py [--layers 15] [--keep DIR] [--out benchmarks/experiments/results/convert_memory.txt]

Writes a random bfloat16 llama checkpoint (hidden 2048, intermediate 5632,
GQA 16/4 heads, vocab 32000, untied head) as 3 safetensors shards in a temp
dir, converts it to 4-bit in a subprocess and reads that subprocess's peak
RSS (getrusage RUSAGE_CHILDREN ru_maxrss). The bound to meet is 2 x the
largest shard + 300 MB. For scale it also shows a bare `import mlx_glimmer.cli`
process and one that `mx.load`s a single shard and evaluates it whole.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[2]
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, VOCAB = 2048, 5632, 16, 4, 32000


def layer_tensors(i: int) -> dict[str, tuple[int, ...]]:
    head_dim = HIDDEN // HEADS
    p = f"model.layers.{i}."
    return {
        p + "input_layernorm.weight": (HIDDEN,),
        p + "post_attention_layernorm.weight": (HIDDEN,),
        p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
        p + "self_attn.k_proj.weight": (KV_HEADS * head_dim, HIDDEN),
        p + "self_attn.v_proj.weight": (KV_HEADS * head_dim, HIDDEN),
        p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
        p + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
        p + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
        p + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
    }


def write_checkpoint(path: Path, layers: int) -> list[Path]:
    path.mkdir(parents=True, exist_ok=True)
    groups = [[] for _ in range(3)]
    for i in range(layers):
        groups[i * 3 // layers].append(layer_tensors(i))
    groups[0].insert(0, {"model.embed_tokens.weight": (VOCAB, HIDDEN)})
    groups[2].append({"model.norm.weight": (HIDDEN,), "lm_head.weight": (VOCAB, HIDDEN)})
    files, weight_map = [], {}
    for n, group in enumerate(groups, 1):
        shard = {}
        for spec in group:
            for name, shape in spec.items():
                if len(shape) == 1:
                    shard[name] = mx.ones(shape, dtype=mx.bfloat16)
                else:
                    shard[name] = (mx.random.normal(shape) * 0.02).astype(mx.bfloat16)
        f = path / f"model-{n:05d}-of-00003.safetensors"
        mx.save_safetensors(str(f), shard, metadata={"format": "pt"})
        weight_map.update({k: f.name for k in shard})
        files.append(f)
        del shard
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_checkpoints import write_tokenizer

    write_tokenizer(path)
    return files


def peak_rss_of(cmd: list[str]) -> tuple[int, float, subprocess.CompletedProcess]:
    """Run `cmd` as the only child so far this call; its peak RSS in bytes (ru_maxrss is in KiB on Linux)."""
    script = (
        "import resource, subprocess, sys\n"
        "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "sys.stdout.write(p.stdout); sys.stderr.write(p.stderr)\n"
        "print('PEAK', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, file=sys.stderr)\n"
        "sys.exit(p.returncode)\n"
    )
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", script, *cmd], capture_output=True, text=True)
    seconds = time.perf_counter() - start
    peak = int(next(line.split()[1] for line in proc.stderr.splitlines() if line.startswith("PEAK")))
    return peak, seconds, proc


def mb(n: int) -> str:
    return f"{n / 1e6:,.0f} MB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=15)
    ap.add_argument("--keep", default=None, help="work in this directory and keep it (default: a temp dir)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "experiments" / "results" / "convert_memory.txt"))
    args = ap.parse_args()
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="convert-memory-"))
    lines = []

    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    src = work / "source"
    start = time.perf_counter()
    if (src / "config.json").is_file() and json.loads((src / "config.json").read_text())[
        "num_hidden_layers"
    ] == args.layers:
        shards = sorted(src.glob("model-*.safetensors"))  # --keep: reuse the generated checkpoint
    else:
        shards = write_checkpoint(src, args.layers)
    total = sum(f.stat().st_size for f in shards)
    largest = max(f.stat().st_size for f in shards)
    tensors = len(json.loads((src / "model.safetensors.index.json").read_text())["weight_map"])
    biggest_tensor = VOCAB * HIDDEN * 2
    say(
        f"source: random bfloat16 llama, {args.layers} layers, {tensors} tensors in {len(shards)} shards, "
        f"{mb(total)} (largest shard {mb(largest)}, largest tensor {mb(biggest_tensor)}); "
        f"written in {time.perf_counter() - start:.0f} s"
    )

    base, _, _ = peak_rss_of([sys.executable, "-c", "import mlx_glimmer.cli"])
    say(f"baseline: a process that only imports mlx_glimmer.cli peaks at {mb(base)}")
    naive, _, _ = peak_rss_of(
        [
            sys.executable,
            "-c",
            "import sys, mlx.core as mx; w = mx.load(sys.argv[1]); mx.eval(w)",
            str(max(shards, key=lambda f: f.stat().st_size)),
        ]
    )
    say(f"for scale: mx.load of one shard, evaluated whole, peaks at {mb(naive)}")

    out = work / "bundle"
    cmd = [
        sys.executable,
        "-m",
        "mlx_glimmer.cli",
        "convert",
        "--target",
        str(src),
        "--out",
        str(out),
        "--bits",
        "4",
        "--force",
        "--quiet",
    ]
    peak, seconds, proc = peak_rss_of(cmd)
    if proc.returncode != 0:
        say(f"convert failed: {proc.stderr.strip()}")
        return 1
    written = sum(f.stat().st_size for f in (out / "target").glob("*.safetensors"))
    bound = 2 * largest + 300_000_000
    name = f"model.layers.{args.layers // 2}.mlp.down_proj"
    index = json.loads((out / "target" / "model.safetensors.index.json").read_text())["weight_map"]
    q = mx.load(str(out / "target" / index[name + ".weight"]))
    w = mx.load(
        str(src / json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][name + ".weight"])
    )
    ref = w[name + ".weight"].astype(mx.float32)
    deq = mx.dequantize(q[name + ".weight"], q[name + ".scales"], q[name + ".biases"], group_size=64, bits=4)
    err = (mx.sqrt(mx.mean((deq.astype(mx.float32) - ref) ** 2)) / mx.sqrt(mx.mean(ref**2))).item()
    say(f"convert --bits 4: {seconds:.0f} s, output {mb(written)}; peak RSS {mb(peak)}")
    say(
        f"bound 2 x largest shard + 300 MB = {mb(bound)}: {'PASS' if peak <= bound else 'FAIL'} "
        f"(peak is {peak / bound:.0%} of the bound, {peak / total:.0%} of the checkpoint)"
    )
    say(f"check: {name} dequantizes to its source within {err:.1%} RMS (4-bit, group 64)")

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    if not args.keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 0 if peak <= bound else 1


if __name__ == "__main__":
    sys.exit(main())
