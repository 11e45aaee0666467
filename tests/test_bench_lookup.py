"""`bench --with-lookup` holds the default against prompt lookup alone in the same run, on the same prompts, and
`bench --with-drafter` against the same target drafting with another drafter."""

import json
from pathlib import Path

from tiny_checkpoints import build_assistant

from mlx_glimmer.bench import portable_path
from mlx_glimmer.cli import main


def test_lookup_alone_runs_beside_the_drafter_and_its_output_equals_plain(tmp_path, checkpoints, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Repeat after me: one two three four, one two three four."}) + "\n")
    report = tmp_path / "bench.json"
    argv = ["bench", str(checkpoints["llama"]), "--drafter", str(checkpoints["llama_assistant"])]
    argv += ["--prompts", str(prompts), "--num-prompts", "1", "--no-baseline", "--warmup", "1", "--max-tokens", "12"]
    argv += ["--block-sizes", "auto", "--trees", "off", "--with-lookup", "--json-out", str(report)]
    assert main([*argv, "--note", "a training run shared the CPU"]) == 0
    table = capsys.readouterr().out
    data = json.loads(report.read_text())
    assert list(data["results"]) == ["plain", "spec_bauto_toff", "lookup"]
    # the verify-cost tables the run's choices rested on: the drafter's block and lookup alone's widest chain
    tables = data["verify_cost"]
    assert sorted(tables, key=int) == ["11", "16"]
    assert [w for w, s in enumerate(tables["16"]["seconds"][0], 1) if s is not None] == [1, 2, 4, 8, 16]
    lookup = data["results"]["lookup"]
    assert lookup["mismatches"] == 0 and len(lookup["per_prompt_tokens_per_second"]) == 1
    assert "| lookup |" in table
    # what else ran, as the caller said and as the load averages around the run show
    assert data["note"] == "a training run shared the CPU"
    assert len(data["load_average"]["before"]) == 3 and len(data["load_average"]["after"]) == 3


def test_another_drafter_runs_the_default_interleaved_on_the_same_target(tmp_path, checkpoints, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Count: one two three four five six."}) + "\n")
    report = tmp_path / "bench.json"
    argv = ["bench", str(checkpoints["llama"]), "--drafter", str(checkpoints["llama_assistant"])]
    argv += ["--prompts", str(prompts), "--num-prompts", "1", "--no-baseline", "--max-tokens", "12"]
    argv += ["--block-sizes", "auto", "--trees", "auto", "--json-out", str(report)]
    other_drafter = build_assistant(tmp_path / "other", layers=1, target_layer_ids=[1, 2, 4], seed=2)
    assert main([*argv, "--with-drafter", str(other_drafter)]) == 0
    table = capsys.readouterr().out
    data = json.loads(report.read_text())
    assert list(data["results"]) == ["plain", "spec_bauto_tauto", "other_drafter"]
    assert data["environment"]["other_drafter"] == portable_path(other_drafter)
    other = data["results"]["other_drafter"]
    assert other["mismatches"] == 0 and len(other["per_prompt_tokens_per_second"]) == 1 and other["target_forwards"]
    assert "| other_drafter |" in table


def test_another_drafter_that_is_not_there_is_one_error_line(tmp_path, capsys):
    assert main(["bench", "--with-drafter", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "nowhere" in err[0], err


def test_results_name_paths_under_home_as_tilde_so_they_name_no_machine():
    assert portable_path(Path.home() / ".cache" / "demo") == str(Path("~") / ".cache" / "demo")


def test_results_name_paths_under_the_working_folder_relative_to_it(tmp_path, monkeypatch):
    from mlx_glimmer.bench import portable_path

    tmp_path = tmp_path.resolve()
    monkeypatch.chdir(tmp_path)
    prompts = tmp_path / "mlx_glimmer" / "data" / "prompts.jsonl"
    assert portable_path(prompts) == str(Path("mlx_glimmer") / "data" / "prompts.jsonl")
    assert portable_path(f"bench --json-out {tmp_path / 'r.json'}") == "bench --json-out r.json"
    elsewhere = f"/mnt{tmp_path}/r.json"  # holds the working folder's name without being under it
    assert portable_path(elsewhere) == elsewhere


def test_with_lookup_and_prompt_lookup_together_is_one_error_line(capsys):
    assert main(["bench", "--prompt-lookup", "--with-lookup"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: bench: --with-lookup"), err
