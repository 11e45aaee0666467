"""Long commands show progress as they go, and their defaults are a short run (a flag runs the full set)."""

import json

from mlx_glimmer.cli import main


def write_prompts(path, n=5):
    path.write_text("".join(json.dumps({"prompt": f"Tell me about the number {i}."}) + "\n" for i in range(n)))
    return path


def test_bench_prints_a_line_per_prompt_and_defaults_to_three_prompts(tmp_path, checkpoints, capsys):
    prompts = write_prompts(tmp_path / "p.jsonl")
    report = tmp_path / "bench.json"
    argv = ["bench", str(checkpoints["llama"]), "--drafter", str(checkpoints["llama_assistant"]), "--prompts", str(prompts),
            "--no-baseline", "--warmup", "0", "--max-tokens", "8", "--json-out", str(report)]
    assert main(argv) == 0
    progress = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("[bench]")]
    assert [ln.split(":")[0] for ln in progress] == [f"[bench] repeat 1/1 prompt {i}/3" for i in (1, 2, 3)]
    data = json.loads(report.read_text())
    assert data["prompts"] == 3 and all(r["mismatches"] == 0 for r in data["results"].values())


def test_parity_prints_a_line_per_prompt_and_defaults_to_three_prompts(tmp_path, checkpoints, capsys):
    prompts = write_prompts(tmp_path / "p.jsonl")
    argv = ["parity", str(checkpoints["llama"]), "--drafter", str(checkpoints["llama_assistant"]), "--prompts", str(prompts),
            "--max-tokens", "8", "--device", "cpu"]
    assert main(argv) == 0
    progress = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("prompt ")]
    assert [ln.split()[1] for ln in progress] == ["1", "2", "3"]
