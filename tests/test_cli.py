"""`mlx-glimmer generate`: the documented JSON, and one `error:` line for every user mistake."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tiny_checkpoints as tc

import mlx_glimmer
from mlx_glimmer.cli import JSON_FIELDS, main

DOCUMENTED = {"text", "token_ids", *JSON_FIELDS}


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "mlx_glimmer.cli", *map(str, args)], capture_output=True, text=True, timeout=300
    )


def assert_one_error_line(proc_or_capsys_err: str, *needles):
    lines = [ln for ln in proc_or_capsys_err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc_or_capsys_err
    for n in needles:
        assert n in lines[0], (n, lines[0])


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, checkpoints):
    """A bundle laid out by hand (the converter has its own tests): float target + drafter."""
    root = tmp_path_factory.mktemp("bundle") / "b"
    shutil.copytree(checkpoints["muse"], root / "target")
    shutil.copytree(checkpoints["assistant"], root / "drafter")
    (root / "glimmer.json").write_text(
        json.dumps({"format": "mlx-glimmer/1", "target": "target", "drafter": "drafter"})
    )
    return root


def test_generate_json_prints_the_documented_object(bundle, muse_pair):
    proc = run_cli("generate", bundle, "--prompt", "Hello there", "--max-tokens", "40", "--block-size", "4", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) == DOCUMENTED
    n = out["generated_tokens"]
    assert n == len(out["token_ids"])
    stopped = out["finish_reason"] == "stop"
    assert (n == 40 and not stopped) or (n < 40 and stopped)
    # Every committed token but the first (prefill) comes from a round; a stop token is committed, not returned.
    assert sum(out["acceptance_lengths"]) + 1 == n + stopped
    assert len(out["acceptance_lengths"]) == out["target_forwards"]
    assert out["mean_acceptance"] == pytest.approx(sum(out["acceptance_lengths"]) / out["target_forwards"])
    assert out["draft_s"] > 0 and out["verify_s"] > 0  # the rounds' time, split
    ref = mlx_glimmer.generate(muse_pair, "Hello there", max_tokens=40, speculative=False)
    assert out["token_ids"] == ref.token_ids and out["text"] == ref.text


def test_no_spec_commits_one_token_per_round(bundle, capsys):
    assert main(["generate", str(bundle), "--prompt", "Hi", "--max-tokens", "12", "--no-spec", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["acceptance_lengths"] == [1] * 11 and out["target_forwards"] == 11


def test_chat_flag_applies_the_chat_template(bundle, capsys, muse_pair):
    assert main(["generate", str(bundle), "--prompt", "Hi", "--chat", "--max-tokens", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    expected = len(
        muse_pair.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    )
    assert out["prompt_tokens"] == expected


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["generate", "/nonexistent/bundle", "--prompt", "x"], ["/nonexistent/bundle"]),
        (["generate", "BUNDLE", "--prompt", "x", "--max-tokens", "0"], ["--max-tokens"]),
        (["generate", "BUNDLE", "--prompt", "x", "--top-p", "1.5"], ["generate: --top-p must be in (0, 1], got 1.5"]),
        (["generate", "BUNDLE", "--prompt", "x", "--temp", "-1"], ["generate: --temp must be a number >= 0"]),
        (["generate", "BUNDLE", "--prompt", "x", "--bogus"], ["--bogus"]),
        (["generate", "BUNDLE"], ["--prompt"]),
        (["generate", "BUNDLE", "--prompt", "x", "--system", "be brief"], ["--system"]),
    ],
)
def test_bad_flags_and_paths_give_one_error_line(bundle, capsys, argv, needles):
    argv = [str(bundle) if a == "BUNDLE" else a for a in argv]
    assert main(argv) != 0
    assert_one_error_line(capsys.readouterr().err, *needles)


def _bundle_with(tmp_path, bundle, drafter_dir):
    root = tmp_path / "bad"
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(bundle, root, ignore=shutil.ignore_patterns("drafter"))
    shutil.copytree(drafter_dir, root / "drafter")
    return root


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(hidden=32), "hidden_size"),
        (dict(target_layer_ids=[1, 3, 8]), "target_layer_ids"),
        (dict(mask_token_id=5000), "mask_token_id"),
    ],
)
def test_mismatched_pair_names_the_field(tmp_path, bundle, capsys, overrides, field):
    drafter = tc.build_assistant(tmp_path / "d", **overrides)
    root = _bundle_with(tmp_path, bundle, drafter)
    assert main(["generate", str(root), "--prompt", "x"]) != 0
    assert_one_error_line(capsys.readouterr().err, field, "config.json")


def test_drafter_vocab_and_layer_count_are_checked_when_present(tmp_path, bundle, capsys):
    root = _bundle_with(tmp_path, bundle, bundle / "drafter")
    cfg_path = root / "drafter" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for key, bad in [("vocab_size", 999), ("num_target_layers", 52)]:
        cfg_path.write_text(json.dumps({**cfg, key: bad}))
        assert main(["generate", str(root), "--prompt", "x"]) != 0
        assert_one_error_line(capsys.readouterr().err, key)


def test_truncated_weights_name_the_file(tmp_path, bundle, capsys):
    root = _bundle_with(tmp_path, bundle, bundle / "drafter")
    shard = sorted((root / "target").glob("*.safetensors"))[3]
    shard.write_bytes(shard.read_bytes()[:-100])
    assert main(["generate", str(root), "--prompt", "x"]) != 0
    assert_one_error_line(capsys.readouterr().err, shard.name, "truncated")


def test_missing_manifest_fields_and_configs_are_named(tmp_path, bundle, capsys):
    root = _bundle_with(tmp_path, bundle, bundle / "drafter")
    (root / "glimmer.json").write_text(json.dumps({"format": "something-else"}))
    assert main(["generate", str(root), "--prompt", "x"]) != 0
    assert_one_error_line(capsys.readouterr().err, "glimmer.json", "format")
    (root / "glimmer.json").write_text(
        json.dumps({"format": "mlx-glimmer/1", "target": "target", "drafter": "drafter"})
    )
    (root / "drafter" / "config.json").unlink()
    assert main(["generate", str(root), "--prompt", "x"]) != 0
    assert_one_error_line(capsys.readouterr().err, "config.json", "drafter")


def test_cli_runs_as_installed_entry_point_and_reports_errors_without_traceback():
    exe = Path(sys.executable).parent / "mlx-glimmer"
    proc = subprocess.run([str(exe), "generate", "/does/not/exist", "--prompt", "x"], capture_output=True, text=True)
    assert proc.returncode != 0
    assert_one_error_line(proc.stderr, "/does/not/exist")
    assert "Traceback" not in proc.stderr


def test_every_command_takes_block_size_auto_and_defaults_to_it():
    from mlx_glimmer.cli import build_parser

    parser = build_parser()
    for command in (["generate", "--prompt", "x"], ["serve"], ["chat"]):
        assert parser.parse_args([*command, "--block-size", "auto"]).block_size == "auto"
        assert parser.parse_args([*command, "--block-size", "6"]).block_size == 6
    assert parser.parse_args(["generate", "--prompt", "x"]).block_size == "auto"
    assert parser.parse_args(["serve"]).block_size == "auto"


def test_every_command_takes_tree_auto_off_or_a_node_count_and_its_settings_carry_it():
    from mlx_glimmer.cli import build_parser
    from mlx_glimmer.flags import settings_from_args

    parser = build_parser()
    for command in (["generate", "--prompt", "x"], ["serve"], ["chat"]):
        for given, value in (("auto", "auto"), ("off", "off"), ("1", 1), ("63", 63)):
            assert parser.parse_args([*command, "--tree", given]).tree == value
    assert parser.parse_args(["generate", "--prompt", "x"]).tree == "auto"
    assert parser.parse_args(["serve"]).tree == "auto"
    assert parser.parse_args(["chat"]).tree is None  # the chat's own settings (or a resumed chat's) fill it
    for command in (["generate", "--prompt", "x"], ["serve"]):
        assert settings_from_args(parser.parse_args([*command, "--tree", "12"]), "x").tree == 12
    generate = parser._subparsers._group_actions[0].choices["generate"]
    help_ = next(a for a in generate._actions if a.dest == "tree").help
    assert "N + 1 tokens verified" in help_ and "block drafter" in help_ and "'off' for chains only" in help_


@pytest.mark.parametrize("value", ["0", "64", "-1", "wide", "2.5", "", "OFF", "Auto"])
@pytest.mark.parametrize("command", [["generate", "--prompt", "x"], ["serve"], ["chat"]])
def test_a_bad_tree_is_one_error_line_naming_the_flag(capsys, command, value):
    assert main([*command, "--tree", value]) == 2
    assert_one_error_line(capsys.readouterr().err, f"{command[0]}: argument --tree: must be 'auto', 'off'")


def test_tree_and_the_servers_tree_take_the_same_spellings():
    """One reader (`settings.tree_value`): what `--tree` takes, the server's `tree` takes, and nothing else (a
    number is a JSON number there, as the command line's digits are read as one)."""
    import argparse

    from mlx_glimmer.flags import tree_arg
    from mlx_glimmer.server.protocol import APIError, CompletionRequest, parse

    def on_the_command_line(text):
        try:
            return tree_arg(text)
        except argparse.ArgumentTypeError:
            return "refused"

    def on_the_server(value):
        try:
            return parse(CompletionRequest, {"prompt": "hi", "tree": value}).tree
        except APIError:
            return "refused"

    for word in ("auto", "off", "AUTO", "Off", " auto", "chain", ""):
        assert on_the_command_line(word) == on_the_server(word), word
    for n in (-1, 0, 1, 7, 63, 64):
        assert on_the_command_line(str(n)) == on_the_server(n), n
    assert on_the_server("AUTO") == "refused" and on_the_server(7) == 7


NO = "/no/such/drafter"  # the flags are refused before any path is looked at
DISAGREEING_FLAGS = [
    (
        ["generate", "--prompt", "x", "--tree", "7", "--block-size", "1"],
        "generate: --block-size 1 and --tree 7 disagree",
    ),
    (["chat", "--block-size", "4", "--tree", "7"], "chat: --block-size 4 and --tree 7 disagree"),
    (["serve", "--tree", "63", "--block-size", "1"], "serve: --block-size 1 and --tree 63 disagree"),
    (["generate", "--prompt", "x", "--no-spec", "--tree", "7"], "generate: --no-spec and --tree 7 disagree"),
    (["generate", "--prompt", "x", "--no-spec", "--block-size", "4"], "generate: --no-spec and --block-size 4"),
    (["generate", "--prompt", "x", "--no-spec", "--prompt-lookup"], "generate: --no-spec and --prompt-lookup"),
    (["generate", "--prompt", "x", "--no-spec", "--drafter", NO], "generate: --no-spec and --drafter disagree"),
    (["generate", "--prompt", "x", "--no-spec", "--draft-k", "3"], "generate: --no-spec and --draft-k disagree"),
    (["generate", "--prompt", "x", "--prompt-lookup", "--drafter", NO], "generate: --prompt-lookup and --drafter"),
    (["generate", "--prompt", "x", "--prompt-lookup", "--tree", "5"], "generate: --prompt-lookup and --tree 5"),
    (["serve", "--prompt-lookup", "--drafter", NO], "serve: --prompt-lookup and --drafter disagree"),
    (["bench", "--prompt-lookup", "--drafter", NO], "bench: --prompt-lookup and --drafter disagree"),
    (["parity", "--block-size", "4", "--tree", "7"], "parity: --block-size 4 and --tree 7 disagree"),
]


@pytest.mark.parametrize("argv, says", DISAGREEING_FLAGS, ids=[" ".join(a) for a, _ in DISAGREEING_FLAGS])
def test_flags_that_disagree_are_one_error_line_naming_both(capsys, monkeypatch, argv, says):
    from mlx_glimmer import cli

    monkeypatch.setitem(cli.COMMANDS, argv[0], lambda args: pytest.fail("the flags were taken"))
    assert main(argv) == 2
    assert_one_error_line(capsys.readouterr().err, says)


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--prompt", "x", "--tree", "7", "--block-size", "auto"],
        ["generate", "--prompt", "x", "--tree", "off", "--block-size", "4"],
        ["generate", "--prompt", "x", "--tree", "auto", "--block-size", "4"],
        ["generate", "--prompt", "x", "--no-spec", "--tree", "off"],
        ["chat", "--no-spec", "--tree", "7", "--no-history"],  # a preset: /spec on drafts with it
        ["serve", "--no-spec", "--block-size", "4"],  # a request may set speculative: true
        ["serve", "--no-spec", "--prompt-lookup"],
        ["parity", "--block-size", "4"],  # chains of 4: the default tree is for a parity run without a width
    ],
    ids=" ".join,
)
def test_flags_that_agree_pass_the_checks(argv):
    from mlx_glimmer.cli import CHECKS, build_parser
    from mlx_glimmer.torch_backend.cli import PARITY_TREE, parity_tree

    args = build_parser().parse_args(argv)
    CHECKS[argv[0]](args)
    if argv[0] == "parity":
        assert parity_tree(args) == "off"
        assert parity_tree(build_parser().parse_args(["parity"])) == PARITY_TREE


def test_settings_refuse_a_fixed_tree_with_a_fixed_block_size_and_a_change_wins_over_the_other():
    from mlx_glimmer.settings import GenerationSettings, SettingsConflict
    from mlx_glimmer.tui.chat_settings import Settings

    with pytest.raises(SettingsConflict) as e:
        GenerationSettings(block_size=1, tree=7)
    assert e.value.fields == ("block_size", "tree") and "block_size 1 and tree 7 disagree" in str(e.value)
    with pytest.raises(SettingsConflict):
        GenerationSettings().updated(block_size=1, tree=7)
    assert GenerationSettings(block_size=4).updated(tree=7).block_size == "auto"
    assert GenerationSettings(tree=7).updated(block_size=4).tree == "auto"
    assert GenerationSettings(block_size=4).updated(tree="off").block_size == 4
    assert Settings.of(block_size=4).with_changes(tree=9).generation.block_size == "auto"  # the chat's /tree 9


def test_a_fixed_tree_reports_the_width_it_verifies(muse_pair):
    result = mlx_glimmer.generate(muse_pair, "Hello", max_tokens=12, tree=3)
    assert result.stats.block_size == 4 and result.stats.block_policy == "fixed"
    assert max(result.stats.verify_widths) <= 4


def test_an_empty_prompt_is_an_empty_user_message_with_chat_and_refused_without(bundle, capsys, monkeypatch):
    """The chat template makes a prompt of an empty user message; a raw empty prompt has nothing to condition
    on. `generate --chat` and `chat` send an empty message alike, and an empty system prompt is left out by both."""
    import io

    from mlx_glimmer.cli import build_parser
    from mlx_glimmer.tui.app import ChatApp

    assert main(["generate", str(bundle), "--chat", "--prompt", "", "--max-tokens", "3", "--json"]) == 0
    empty = json.loads(capsys.readouterr().out)
    assert empty["prompt_tokens"] > 0 and empty["generated_tokens"] >= 1
    argv = ["generate", str(bundle), "--chat", "--system", "", "--prompt", "", "--max-tokens", "3", "--json"]
    assert main(argv) == 0 and json.loads(capsys.readouterr().out)["token_ids"] == empty["token_ids"]
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert main(["generate", str(bundle), "--chat", "--prompt", "-", "--max-tokens", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == empty["token_ids"]
    assert main(["generate", str(bundle), "--prompt", ""]) == 2
    assert_one_error_line(capsys.readouterr().err, "generate: --prompt is empty", "with --chat")

    started = []
    monkeypatch.setattr(ChatApp, "run", lambda app: started.append(app))
    assert main(["chat", str(bundle), "", "--no-history"]) == 0
    assert main(["chat", "", "--no-history"]) == 0  # an empty word is a message, not the current directory
    assert main(["chat", str(bundle), "--system", "", "--no-history"]) == 0
    assert [(a.first_message, a.source) for a in started] == [
        ("", str(bundle)),
        ("", "the demo pair"),
        (None, str(bundle)),
    ]
    generate = build_parser()._subparsers._group_actions[0].choices["generate"]
    helps = {a.dest: a.help for a in generate._actions}
    assert "refused without --chat" in helps["prompt"] and "empty user message" in helps["prompt"]
    assert "an empty one is left out" in helps["system"]


def test_chat_flags_carry_the_tree_into_the_chat_settings():
    from mlx_glimmer.cli import build_parser, chat_plan

    _, _, settings, given = chat_plan(build_parser().parse_args(["chat", "--tree", "off", "--no-history"]))
    assert settings.generation.tree == "off" and given == {"tree": "off"}


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["serve", "--temp", "-1"], "serve: --temp must be a number >= 0, got -1.0"),
        (["serve", "--top-k", "-2"], "serve: --top-k must be a whole number >= 0, got -2"),
        (["serve", "--block-size", "0"], "--block-size"),
        (["serve", "--port", "70000"], "serve: --port must be in [0, 65535]"),
    ],
)
def test_serve_flag_errors_are_one_line_before_anything_loads(capsys, argv, needle):
    assert main(argv) == 2
    assert_one_error_line(capsys.readouterr().err, needle)


def test_distill_steps_help_names_the_recipe_default():
    from mlx_glimmer.cli import build_parser
    from mlx_glimmer.distill.step import TrainConfig

    distill = build_parser()._subparsers._group_actions[0].choices["distill"]
    steps = next(a for a in distill._actions if a.dest == "steps")
    assert steps.default == TrainConfig.steps and f"(default {TrainConfig.steps})" in steps.help
    assert "one answer each" not in steps.help


def test_a_first_run_says_it_is_measuring_verify_cost_and_the_next_does_not(bundle, capsys, monkeypatch, tmp_path):
    """`auto` times a few verify widths once per model and chip; the first run says so on stderr before it
    waits, and the table it wrote spares the next run the wait."""
    monkeypatch.setenv("MLX_GLIMMER_CACHE", str(tmp_path))
    args = ["generate", str(bundle), "--prompt", "Hi", "--max-tokens", "4", "--json"]
    assert main(args) == 0
    first = capsys.readouterr()
    assert "measuring verify cost" in first.err
    json.loads(first.out)  # stdout stays the JSON object alone
    assert list((tmp_path / "verify_cost").glob("*.json"))
    assert main(args) == 0
    assert "measuring verify cost" not in capsys.readouterr().err
