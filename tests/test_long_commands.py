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


def test_bench_runs_each_width_once_per_tree_setting_and_names_the_methods_by_both():
    from mlx_glimmer.bench import method_settings, spec_methods

    # a fixed width verifies chains under tree "auto": it runs once, as "off"
    assert spec_methods(["auto", 16], ["auto", "off"]) == ["spec_bauto_tauto", "spec_bauto_toff", "spec_b16_toff"]
    # a tree of N nodes sets the width itself (block size "auto" only): a fixed width with it runs as "auto"
    assert spec_methods(["auto", 4], [8]) == ["spec_bauto_t8"]
    assert spec_methods([4, 16], [8, "off"]) == ["spec_bauto_t8", "spec_b4_toff", "spec_b16_toff"]
    s = method_settings("spec_bauto_t8", 32)
    assert (s.block_size, s.tree, s.speculative, s.max_tokens) == ("auto", 8, True, 32)
    s = method_settings("spec_bauto_toff", 32)
    assert (s.block_size, s.tree) == ("auto", "off")
    assert not method_settings("plain", 32).speculative


def test_bench_trees_flag_is_checked_before_anything_loads(capsys):
    assert main(["bench", "--trees", "auto,64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: bench: --trees: 'auto,64'"), err


def test_bench_table_has_a_row_per_method_with_speedup_and_tree_figures():
    from dataclasses import asdict

    from mlx_glimmer.bench import Measurement, format_table

    def result(m: Measurement) -> dict:
        return {
            **asdict(m),
            "tokens_per_second": m.tokens_per_second,
            "mean_acceptance": m.mean_acceptance,
            "mean_tokens_verified": m.mean_tokens_verified,
            "mean_accepted_depth": m.mean_accepted_depth,
            "median_speedup_over_plain": 1.5,
            "verify_width_histogram": {},
        }

    plain, tree = Measurement("plain"), Measurement("spec_bauto_tauto")
    plain.add(10, 1.0, 10, [1] * 10, [1] * 10)
    tree.add(10, 0.5, 4, [3, 3, 2, 2], [10, 10, 4, 4])
    tree.tokens_verified, tree.tree_rounds, tree.accepted_depths = 28, 2, [2, 2, 1, 1]
    tree.accepted_from = {"model": 3, "lookup": 1}
    report = {
        "environment": {"device": "cpu", "drafter_kind": "dflash"},
        "results": {"plain": result(plain), "spec_bauto_tauto": result(tree)},
    }
    table = format_table(report)
    assert "| plain | 10.0 | 1.00x |" in table
    assert "| spec_bauto_tauto | 20.0 | 2.00x | 1.50x | 2.50 | 7.0 | 1.50 | 2/4 | 0.400 |" in table
    assert "spec_bauto_tauto accepted paths from: lookup 1, model 3" in table


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
