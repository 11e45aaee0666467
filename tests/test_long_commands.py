"""Long commands show progress as they go, and their defaults are a short run (a flag runs the full set)."""

import json

from mlx_glimmer.cli import main


def write_prompts(path, n=5):
    path.write_text("".join(json.dumps({"prompt": f"Tell me about the number {i}."}) + "\n" for i in range(n)))
    return path


def test_bench_prints_a_line_per_prompt_and_defaults_to_three_prompts(tmp_path, checkpoints, capsys):
    prompts = write_prompts(tmp_path / "p.jsonl")
    report = tmp_path / "bench.json"
    argv = [
        "bench",
        str(checkpoints["llama"]),
        "--drafter",
        str(checkpoints["llama_assistant"]),
        "--prompts",
        str(prompts),
        "--no-baseline",
        "--warmup",
        "0",
        "--max-tokens",
        "8",
        "--json-out",
        str(report),
    ]
    assert main(argv) == 0
    progress = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("[bench]")]
    assert [ln.split(":")[0] for ln in progress] == [f"[bench] repeat 1/1 prompt {i}/3" for i in (1, 2, 3)]
    data = json.loads(report.read_text())
    assert data["prompts"] == 3 and all(r["mismatches"] == 0 for r in data["results"].values())
    assert all(len(r["per_prompt_tokens_per_second"]) == 3 for r in data["results"].values())


def test_bench_speedup_is_the_median_of_per_prompt_ratios_not_the_ratio_of_totals():
    from mlx_glimmer.bench import Measurement, median_speedup

    plain, spec = Measurement("plain"), Measurement("spec_b16")
    for plain_s, spec_s in ((1.0, 0.5), (1.0, 2.0), (10.0, 5.0)):  # 10 tokens each: ratios 2x, 0.5x, 2x
        plain.add(10, plain_s)
        spec.add(10, spec_s)
    assert spec.tokens_per_second / plain.tokens_per_second == 12.0 / 7.5  # totals: 30 tokens in 7.5 s vs 12 s
    assert median_speedup(spec.per_prompt_tokens_per_second, plain.per_prompt_tokens_per_second) == 2.0


def test_parity_prints_a_line_per_prompt_and_defaults_to_three_prompts(tmp_path, checkpoints, capsys):
    prompts = write_prompts(tmp_path / "p.jsonl")
    argv = [
        "parity",
        str(checkpoints["llama"]),
        "--drafter",
        str(checkpoints["llama_assistant"]),
        "--prompts",
        str(prompts),
        "--max-tokens",
        "8",
        "--device",
        "cpu",
    ]
    assert main(argv) == 0
    progress = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("prompt ")]
    assert [ln.split()[1] for ln in progress] == ["1", "2", "3"]
