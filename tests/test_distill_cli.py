"""`mlx-glimmer distill` end to end on a tiny target: answers, resuming after an interruption, training on the
answers already there, the exported drafter, and one `error:` line for contradictory flags."""

import json
import os
import shutil
import subprocess
import sys

import mlx.core as mx
import pytest

import mlx_glimmer

PROMPTS = [f"Tell me fact number {i} about the sea." for i in range(6)]


def distill(*args):
    return subprocess.run(
        [sys.executable, "-m", "mlx_glimmer.cli", "distill", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},  # a tiny model: thread hand-offs cost more than they save
    )


def write_prompt_files(folder):
    train, heldout = folder / "train.jsonl", folder / "heldout.jsonl"
    train.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    heldout.write_text(json.dumps({"prompt": "What colour is the sky at noon?"}) + "\n")
    return ["--prompts", train, "--heldout", heldout]


@pytest.fixture()
def prompt_files(tmp_path):
    return write_prompt_files(tmp_path)


ANSWER_FLAGS = ["--generator", "mlx", "--answer-tokens", 24, "--batch-size", 3, "--temperatures", "0,0.8"]
TRAIN_FLAGS = ["--layers", 1, "--context-layers", 3, "--anchors", 4, "--sequences-per-step", 2, "--eval-prompts", 1]
TRAIN_FLAGS += ["--eval-tokens", 8, "--mask-token", 259]


@pytest.fixture(scope="module")
def answered(checkpoints, tmp_path_factory):
    """A `--data-only` run's answers (greedy and at temperature 0.8, 24 tokens each), made once for the tests
    that resume or train on them: (its folder, the prompt flags it was made with)."""
    root = tmp_path_factory.mktemp("answered")
    prompts = write_prompt_files(root)
    run = root / "run"
    data = distill(checkpoints["llama"], "--out", run, *prompts, *ANSWER_FLAGS, "--data-only")
    assert data.returncode == 0, data.stderr
    return run, prompts


def records(run):
    return [json.loads(line) for line in (run / "data" / "responses.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def resumed(checkpoints, answered, tmp_path_factory):
    """A whole run (answers, then training) started again on a copy of the answers whose last append was cut
    mid-line, as a killed run leaves it: (its folder, the answers before the cut, the finished process)."""
    answers, prompt_files = answered
    run = tmp_path_factory.mktemp("resumed") / "run"
    shutil.copytree(answers, run)
    full = records(run)
    lines = (run / "data" / "responses.jsonl").read_text().splitlines(keepends=True)
    (run / "data" / "responses.jsonl").write_text("".join(lines[:5]) + lines[5][: len(lines[5]) // 2])
    flags = [*ANSWER_FLAGS, "--train-backend", "mlx", *TRAIN_FLAGS, "--steps", 4, "--eval-every", 4]
    return run, full, distill(checkpoints["llama"], "--out", run, *prompt_files, *flags)


def copy_of_whole_run(resumed, tmp_path):
    """A copy of the fixture's whole run (answers, features, a trained drafter) for a test to change."""
    first, _, done = resumed
    assert done.returncode == 0, done.stderr
    run = tmp_path / "run"
    shutil.copytree(first, run)
    return run


def test_answers_resume_after_an_interrupted_append(resumed):
    run, full, again = resumed
    assert sorted((r["index"], r["tag"]) for r in full) == sorted((i, t) for i in range(6) for t in ("greedy", "t0.8"))
    assert all(r["response_ids"] and len(r["response_ids"]) <= 24 for r in full)
    assert again.returncode == 0, again.stderr
    resumed = records(run)  # every line parses: the cut line was dropped, not appended to
    assert sorted((r["index"], r["tag"]) for r in resumed) == sorted((r["index"], r["tag"]) for r in full)
    greedy = {r["index"]: r["response_ids"] for r in full if r["tag"] == "greedy"}
    assert all(greedy[r["index"]] == r["response_ids"] for r in resumed if r["tag"] == "greedy")
    log = json.loads((run / "log.json").read_text())  # then it trained on both temperatures' answers
    assert log["answers"] == 12 and (run / "drafter" / "model.safetensors").is_file()


def test_the_torch_generator_writes_the_greedy_answers_mlx_lm_writes(checkpoints, answered, tmp_path):
    answers, prompt_files = answered
    run = tmp_path / "run"
    flags = [*ANSWER_FLAGS[2:-2], "--temperatures", "0", "--generator", "torch", "--batch-size", 4, "--data-only"]
    made = distill(checkpoints["llama"], "--out", run, *prompt_files, *flags)
    assert made.returncode == 0, made.stderr
    greedy = sorted((r["index"], r["response_ids"]) for r in records(answers) if r["tag"] == "greedy")
    assert sorted((r["index"], r["response_ids"]) for r in records(run)) == greedy
    assert "[data greedy] 6/6 prompts" in made.stderr


@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_train_only_uses_the_answers_there_and_exports_a_lossless_drafter(checkpoints, answered, tmp_path, backend):
    if backend == "torch":
        pytest.importorskip("transformers")
    answers, prompt_files = answered
    run = tmp_path / "run"
    shutil.copytree(answers, run)  # a run that has its answers and nothing else yet
    before = (run / "data" / "responses.jsonl").read_bytes()
    flags = ["--train-only", "--train-backend", backend, *TRAIN_FLAGS, "--steps", 6, "--eval-every", 3]
    train = distill(checkpoints["llama"], "--out", run, *prompt_files, *flags, "--no-compile")
    assert train.returncode == 0, train.stderr
    assert (run / "data" / "responses.jsonl").read_bytes() == before  # nothing generated
    log = json.loads((run / "log.json").read_text())
    assert [e["step"] for e in log["evaluations"]] == [3, 6] and log["config"]["backend"] == backend
    assert log["answers"] == 6 and log["eval"]["block_size"] == 16  # the greedy ones: --temperatures 0
    pair = mlx_glimmer.load(target=checkpoints["llama"], drafter=run / "drafter")
    prompt = [256] + list(b"a prompt never seen")
    assert (
        mlx_glimmer.generate(pair, prompt, max_tokens=40).token_ids
        == mlx_glimmer.generate(pair, prompt, max_tokens=40, speculative=False).token_ids
    )


def test_online_features_train_and_export_with_no_feature_store(checkpoints, answered, tmp_path):
    answers, prompt_files = answered
    run = tmp_path / "run"
    shutil.copytree(answers, run)
    flags = ["--train-only", "--train-backend", "mlx", *TRAIN_FLAGS, "--steps", 4, "--eval-every", 4]
    train = distill(checkpoints["llama"], "--out", run, *prompt_files, *flags, "--features", "online")
    assert train.returncode == 0, train.stderr
    log = json.loads((run / "log.json").read_text())
    assert log["features"] == "online" and [e["step"] for e in log["evaluations"]] == [4]
    assert (run / "drafter" / "model.safetensors").is_file() and not (run / "features").exists()


def test_a_warm_start_is_evaluated_before_its_first_step(checkpoints, prompt_files, resumed, tmp_path):
    run, _, first = resumed  # a whole run: its drafter is the warm start
    assert first.returncode == 0, first.stderr
    tuned = tmp_path / "tuned"
    (tuned / "data").mkdir(parents=True)
    (tuned / "data" / "responses.jsonl").write_bytes((run / "data" / "responses.jsonl").read_bytes())
    flags = ["--train-only", "--train-backend", "mlx", *TRAIN_FLAGS, "--init", run / "drafter", "--steps", 2]
    again = distill(checkpoints["llama"], *prompt_files, "--out", tuned, *flags, "--eval-every", 2)
    assert again.returncode == 0, again.stderr
    log = json.loads((tuned / "log.json").read_text())
    assert [e["step"] for e in log["evaluations"]] == [0, 2] and log["config"]["init"] == str(run / "drafter")
    init = mx.load(str(run / "drafter" / "model.safetensors"))
    at_zero = mx.load(str(tuned / "step000000" / "model.safetensors"))  # what step 0 evaluated: the init's weights
    assert all(mx.array_equal(at_zero[k], v.astype(mx.float32)) for k, v in init.items() if k != "draft_vocab")


def test_a_second_training_run_in_its_own_train_dir_shares_the_answers_and_features(
    checkpoints, prompt_files, resumed, tmp_path
):
    run = copy_of_whole_run(resumed, tmp_path)
    kept = {p: p.read_bytes() for p in (run / "features" / "features.json", run / "log.json")}
    kept |= {p: p.read_bytes() for p in (run / "drafter").iterdir()}
    flags = ["--train-only", "--train-backend", "mlx", *TRAIN_FLAGS, "--init", run / "drafter", "--steps", 2]
    flags += ["--temperatures", "0,0.8"]  # the first run's answers
    second = distill(checkpoints["llama"], *prompt_files, "--out", run, "--train-dir", run / "more", *flags)
    assert second.returncode == 0, second.stderr
    assert "features (" not in second.stderr  # nothing computed again
    assert all(p.read_bytes() == b for p, b in kept.items())  # the first training's outputs are left alone
    log = json.loads((run / "more" / "log.json").read_text())
    assert [e["step"] for e in log["evaluations"]] == [0, 2]
    assert (run / "more" / "drafter" / "model.safetensors").is_file() and not (run / "more" / "features").exists()


def test_a_run_can_pick_its_checkpoint_on_a_draft_tree_and_never_compares_across_shapes(
    checkpoints, answered, tmp_path
):
    answers, prompt_files = answered
    run = tmp_path / "run"
    shutil.copytree(answers, run)
    flags = ["--train-only", "--train-backend", "mlx", *TRAIN_FLAGS, "--steps", 2, "--eval-every", 2]
    tree = distill(checkpoints["llama"], "--out", run, *prompt_files, *flags, "--eval-tree", 3)
    assert tree.returncode == 0, tree.stderr
    log = json.loads((run / "log.json").read_text())
    assert log["eval"]["tree"] == 3 and [(e["step"], e["eval_tree"]) for e in log["evaluations"]] == [(2, 3)]
    assert (run / "drafter" / "model.safetensors").is_file()
    chain = distill(checkpoints["llama"], "--out", run, *prompt_files, *flags)  # done: nothing new to evaluate
    assert chain.returncode != 0 and chain.stderr.strip().splitlines()[-1].startswith("error:")
    assert "--eval-tree [3], not 0" in chain.stderr and "Traceback" not in chain.stderr


def test_contradictory_or_premature_flags_are_one_error_line(checkpoints, prompt_files, tmp_path):
    both = distill(checkpoints["llama"], "--out", tmp_path / "a", *prompt_files, "--data-only", "--train-only")
    nothing = distill(checkpoints["llama"], "--out", tmp_path / "b", *prompt_files, "--train-only")
    no_training = distill(
        checkpoints["llama"], "--out", tmp_path / "c", *prompt_files, "--data-only", "--train-dir", tmp_path / "d"
    )
    no_store = distill(
        checkpoints["llama"], "--out", tmp_path / "e", *prompt_files, "--features", "online", "--recompute-features"
    )
    for proc, needle in (
        (both, "--data-only and --train-only"),
        (nothing, "responses.jsonl"),
        (no_training, "--data-only trains nothing"),
        (no_store, "--features online keeps none"),
    ):
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert proc.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], (
            proc.stderr
        )
    assert not (tmp_path / "e").exists()


def test_a_log_cut_by_hand_is_one_error_line_and_the_run_is_left_alone(checkpoints, prompt_files, resumed, tmp_path):
    run = copy_of_whole_run(resumed, tmp_path)
    log = run / "log.json"
    log.write_text(log.read_text()[:40])
    checkpoint = (run / "checkpoint" / "trainer.json").read_bytes()
    flags = ["--train-only", "--train-backend", "mlx", *TRAIN_FLAGS, "--steps", 4, "--temperatures", "0,0.8"]
    again = distill(checkpoints["llama"], *prompt_files, "--out", run, *flags)
    errors = [line for line in again.stderr.splitlines() if line.startswith("error:")]
    assert again.returncode == 2 and "Traceback" not in again.stderr, again.stderr
    assert len(errors) == 1 and f"{log} is not JSON" in errors[0]
    assert log.read_text() == (resumed[0] / "log.json").read_text()[:40]
    assert (run / "checkpoint" / "trainer.json").read_bytes() == checkpoint


def test_a_feature_store_another_recipe_cannot_read_is_refused_until_asked_to_replace_it(
    checkpoints, prompt_files, resumed, tmp_path
):
    run = copy_of_whole_run(resumed, tmp_path)
    store = {f.name: f.read_bytes() for f in (run / "features").iterdir()}
    flags = ["--train-only", "--train-backend", "mlx", *TRAIN_FLAGS, "--steps", 2, "--temperatures", "0,0.8"]
    flags += ["--train-dir", tmp_path / "two_layers", "--context-layers", 2]
    refused = distill(checkpoints["llama"], *prompt_files, "--out", run, *flags)
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert len(errors) == 1 and str(run / "features") in errors[0] and "--recompute-features" in errors[0], errors
    assert {f.name: f.read_bytes() for f in (run / "features").iterdir()} == store
    assert not (tmp_path / "two_layers").exists()
    replaced = distill(checkpoints["llama"], *prompt_files, "--out", run, *flags, "--recompute-features")
    assert replaced.returncode == 0, replaced.stderr
    assert f"computing {run / 'features'} anew: it holds layers" in replaced.stderr
