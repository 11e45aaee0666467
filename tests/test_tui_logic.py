"""The chat app's plain parts: channel splitting, slash commands, history, transcript, stats text."""

import asyncio
import dataclasses
import json
from types import SimpleNamespace

import pytest

from mlx_glimmer import GenerationSettings, GenerationStats, GlimmerError
from mlx_glimmer.channels import split_channels
from mlx_glimmer.chat_template import supports_reasoning
from mlx_glimmer.tui.commands import (
    COMMANDS,
    Command,
    CommandError,
    help_text,
    is_command,
    parse_command,
    prompt_text,
    run_command,
)
from mlx_glimmer.tui.history import InputHistory
from mlx_glimmer.tui.session import Conversation, Settings, Turn
from mlx_glimmer.tui.stats import histogram, sparkline, stats_rows, turn_summary
from mlx_glimmer.tui.transcript import save_transcript, transcript_markdown

MUSE = (
    "to=self<|message|>Think first.<|eom|>"
    "<|start|>assistant to=self<|message|>Then check.<|eom|>"
    "<|start|>assistant to=user<|message|>The answer.<|eot|>"
)

# --- channels -------------------------------------------------------------------------------


def test_plain_output_is_all_answer():
    ch = split_channels("Just text, with <b>tags</b>.")
    assert not ch.framed and ch.answer == "Just text, with <b>tags</b>." and ch.reasoning == []


def test_muse_framing_splits_reasoning_blocks_from_the_answer():
    ch = split_channels(MUSE)
    assert ch.framed
    assert ch.reasoning == ["Think first.", "Then check."]
    assert ch.answer == "The answer."


def test_tool_calls_are_shown_apart_like_reasoning():
    text = "to=self<|message|>Need a tool.<|eom|><|start|>assistant to=search<|message|><atem:function_calls>{}<|eom|>"
    assert split_channels(text).reasoning == ["Need a tool.", "{}"]


def test_a_streamed_prefix_never_shows_marker_pieces():
    final = split_channels(MUSE)
    for cut in range(1, len(MUSE)):
        ch = split_channels(MUSE[:cut], final=False)
        shown = " ".join(ch.reasoning) + ch.answer
        for piece in ("<|", "|>", "to=", "assistant"):
            assert piece not in shown, MUSE[:cut]
        # What is shown only grows into the final split.
        assert final.answer.startswith(ch.answer)
        for got, want in zip(ch.reasoning, final.reasoning):
            assert want.startswith(got)


def test_the_start_of_a_header_is_held_back_while_streaming():
    assert split_channels("to=se", final=False).blocks == []
    assert split_channels("to=se", final=True).answer == "to=se"


# --- commands --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "line, command",
    [
        ("/clear", Command("clear")),
        ("/help", Command("help")),
        ("/stats", Command("stats")),
        ("/system You are terse.", Command("system", "You are terse.")),
        ("/system", Command("system", None)),
        ("/temp 0.7", Command("temp", 0.7)),
        ("/TEMP 0", Command("temp", 0.0)),
        ("/block 8", Command("block", 8)),
        ("/block auto", Command("block", "auto")),
        ("/tree 12", Command("tree", 12)),
        ("/tree auto", Command("tree", "auto")),
        ("/tree OFF", Command("tree", "off")),
        ("/spec off", Command("spec", False)),
        ("/spec ON", Command("spec", True)),
        ("/reasoning xhigh", Command("reasoning", "xhigh")),
        ("/save chat.md", Command("save", "chat.md")),
    ],
)
def test_commands_parse_to_typed_values(line, command):
    assert is_command(line)
    assert parse_command(line) == command


@pytest.mark.parametrize(
    "line, message",
    [
        ("/nope", "unknown command /nope; /help lists the commands"),
        ("/claer", "unknown command /claer; did you mean /clear?"),
        ("/temp", "usage: /temp X"),
        ("/temp nan", "/temp must be a number >= 0, got nan"),
        ("/temp -0.1", "/temp must be a number >= 0, got -0.1"),
        ("/temp hot", "/temp needs a number, got 'hot'"),
        ("/block 1.5", "/block needs 'auto' or a whole number, got '1.5'"),
        ("/block -2", "/block must be >= 1, got -2"),
        ("/tree", "usage: /tree auto|off|N"),
        ("/tree 0", "/tree must be in [1, 63], got 0"),
        ("/tree 64", "/tree must be in [1, 63], got 64"),
        ("/tree wide", "/tree needs 'auto', 'off' or a whole number, got 'wide'"),
        ("/spec yes", "usage: /spec on|off, got 'yes'"),
        ("/reasoning max", "/reasoning takes one of low, medium, high, xhigh, got 'max'"),
        ("/help me", "/help takes no argument"),
    ],
)
def test_bad_commands_say_what_is_wrong(line, message):
    with pytest.raises(CommandError) as e:
        parse_command(line)
    assert str(e.value) == message


def test_a_double_slash_is_a_prompt_with_one_slash():
    assert not is_command("//etc/hosts?") and prompt_text("//etc/hosts?") == "/etc/hosts?"
    assert not is_command("hello") and prompt_text("hello") == "hello"


def test_help_lists_every_command():
    for name in (
        "/clear",
        "/system TEXT",
        "/temp X",
        "/block auto|N",
        "/tree auto|off|N",
        "/spec on|off",
        "/save FILE",
        "/stats",
        "/help",
    ):
        assert name in help_text()


# --- history ---------------------------------------------------------------------------------


def test_history_walks_back_and_returns_to_the_draft():
    h = InputHistory()
    for entry in ("one", "two", "two", "  "):
        h.add(entry)
    assert h.entries == ["one", "two"]
    assert h.back("draft") == "two" and h.back("two") == "one" and h.back("one") is None
    assert h.forward() == "two" and h.forward() == "draft" and h.forward() is None


# --- session ---------------------------------------------------------------------------------


def test_the_conversation_renders_system_turns_and_the_new_message():
    conv = Conversation(Settings(system="Be kind."))
    conv.turns.append(Turn("Hi", "Hello!"))
    assert conv.messages("More") == [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "More"},
    ]


def test_reasoning_strength_is_passed_only_when_the_template_has_it():
    conv = Conversation(Settings.of(reasoning="low", temperature=0.5, block_size=4, speculative=False))
    kwargs = conv.generation_kwargs()
    assert "chat_template_kwargs" not in kwargs
    settings = kwargs["settings"]
    assert (settings.sampling.temperature, settings.block_size, settings.speculative) == (0.5, 4, False)
    conv.reasoning_supported = True
    assert conv.generation_kwargs()["chat_template_kwargs"] == {"reasoning_strength": "low"}


def test_each_turn_draws_a_fresh_seed_unless_one_is_set():
    fresh = Conversation(Settings.of(temperature=0.8))
    seeds = {fresh.generation_kwargs()["settings"].seed for _ in range(5)}
    assert len(seeds) > 1
    fixed = Conversation(Settings.of(temperature=0.8, seed=3))
    assert {fixed.generation_kwargs()["settings"].seed for _ in range(5)} == {3}


def test_chat_settings_are_checked_when_made_and_never_changed_in_place():
    with pytest.raises(GlimmerError, match="top_p must be in"):
        Settings.of(top_p=0)
    with pytest.raises(GlimmerError, match="reasoning must be one of"):
        Settings(reasoning="max")
    s = Settings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.system = "Be brief."
    assert s.with_changes(temperature=1.0).generation.sampling.temperature == 1.0
    assert s.generation.sampling.temperature == 0.0


def test_chat_settings_hold_one_generation_settings_and_name_it_flat_for_flags_and_history():
    s = Settings.of(temperature=0.5, block_size=4, seed=3, system="Be brief.")
    assert s.generation == GenerationSettings.of(temperature=0.5, block_size=4, seed=3, max_tokens=1024)
    assert (s.fresh_seed, s.system) == (False, "Be brief.")
    assert s.flat()["seed"] == 3 and Settings().flat()["seed"] is None  # None: a fresh seed every turn
    assert Settings.of(**s.flat()) == s
    assert s.with_changes(seed=None, system=None) == Settings.of(temperature=0.5, block_size=4)


def test_every_command_has_one_table_entry_with_usage_help_and_apply():
    assert set(COMMANDS) == {
        "clear",
        "chats",
        "rename",
        "export",
        "system",
        "temp",
        "block",
        "tree",
        "spec",
        "reasoning",
        "save",
        "stats",
        "help",
    }
    assert {n for n, s in COMMANDS.items() if s.persists} == {"system", "temp", "block", "tree", "spec", "reasoning"}
    assert {n for n, s in COMMANDS.items() if s.while_busy} == {"help", "stats"}
    for name, spec in COMMANDS.items():
        assert spec.usage.startswith(f"/{name}") and spec.help and callable(spec.apply)


class FakeApp:
    """What a settings command reads and changes of the chat app."""

    def __init__(self, drafter_kind: str | None = "dflash"):
        drafter = None if drafter_kind is None else SimpleNamespace(kind=drafter_kind)
        self.pair = SimpleNamespace(drafter=drafter)
        self.conversation = Conversation(Settings())
        self.busy = False
        self.notes = []

    @property
    def settings(self):
        return self.conversation.settings

    def update_settings(self, **changes):
        self.conversation.settings = self.settings.with_changes(**changes)

    def note(self, text, kind):
        self.notes.append(text)


def test_the_tree_command_changes_the_conversations_tree_setting():
    app = FakeApp()
    assert app.settings.generation.tree == "auto"
    asyncio.run(run_command(app, "/tree 12"))
    assert app.settings.generation.tree == 12 and app.notes[-1] == "Draft trees 12 nodes."
    asyncio.run(run_command(app, "/tree off"))
    assert app.settings.generation.tree == "off" and app.notes[-1] == "Draft trees off (chains only)."
    assert Settings.of(**app.settings.flat()).generation.tree == "off"  # stored with the conversation
    lookup = FakeApp("prompt-lookup")
    asyncio.run(run_command(lookup, "/tree 8"))
    assert lookup.settings.generation.tree == 8 and "trees need DFlash, DFlash2 or DSpark" in lookup.notes[-1]
    with pytest.raises(CommandError, match="no drafter"):
        asyncio.run(run_command(FakeApp(None), "/tree 8"))


def test_a_fixed_block_size_and_a_fixed_tree_put_each_other_back_to_auto_and_say_so():
    app = FakeApp()
    asyncio.run(run_command(app, "/tree 7"))
    assert app.notes[-1] == "Draft trees 7 nodes."  # the block size was auto: nothing to put back
    asyncio.run(run_command(app, "/block 4"))
    assert (app.settings.generation.block_size, app.settings.generation.tree) == (4, "auto")
    assert app.notes[-1] == "Block size 4. Draft trees back to auto (a tree of N nodes sets the width itself)."
    asyncio.run(run_command(app, "/tree 15"))
    assert (app.settings.generation.block_size, app.settings.generation.tree) == ("auto", 15)
    assert app.notes[-1].endswith("Block size back to auto (a tree of N nodes sets the width itself).")


def test_the_status_line_shows_the_tree_setting_next_to_the_block():
    from mlx_glimmer.tui.status import status_line

    pair = SimpleNamespace(
        name="m",
        drafter_path=None,
        target=SimpleNamespace(model_type="muse"),
        quantization="4-bit",
        drafter=SimpleNamespace(kind="dflash"),
    )
    line = status_line(
        Settings.of(block_size=8, tree="off"), pair, reasoning_supported=False, saving_delayed=False, busy=False
    )
    assert "dflash block 8 tree off" in line


class FakeTokenizer:
    def __init__(self, template):
        self.chat_template = template


def test_reasoning_support_is_read_from_the_template_text():
    assert supports_reasoning(FakeTokenizer("{{ reasoning_strength | default('high') }}"))
    assert supports_reasoning(FakeTokenizer({"default": "x", "tools": "{% if reasoning_strength %}"}))
    assert not supports_reasoning(FakeTokenizer("{% if enable_thinking %}"))
    assert not supports_reasoning(FakeTokenizer(None))


# --- transcript ------------------------------------------------------------------------------


def stats(**kw):
    base = dict(
        prompt_tokens=30,
        prefill_tokens=8,
        generated_tokens=9,
        target_forwards=3,
        acceptance_lengths=[4, 2, 2],
        decode_tokens_per_second=40.0,
        finish_reason="stop",
    )
    return GenerationStats(**{**base, **kw})


def test_the_transcript_puts_reasoning_in_details_above_the_answer(tmp_path):
    turns = [Turn("Why?", MUSE, [1, 2], stats()), Turn("Stop", "partial", [3], stats(finish_reason="cancelled"), True)]
    md = transcript_markdown(turns, model="demo", settings=Settings(system="Be brief."))
    assert md.index("## System") < md.index("## You") < md.index("<summary>Reasoning</summary>")
    assert md.index("Think first.") < md.index("Then check.") < md.index("The answer.")
    assert "to=self" not in md and "<|eom|>" not in md
    assert "prefilled 8 of 30 prompt tokens" in md and "cancelled" in md

    md_path, json_path = save_transcript(tmp_path / "talk", turns, model="demo", settings=Settings())
    assert (md_path.name, json_path.name) == ("talk.md", "talk.json")
    record = json.loads(json_path.read_text())
    assert record["model"] == "demo" and record["settings"]["temperature"] == 0.0
    assert [t["text"] for t in record["turns"]] == [MUSE, "partial"]
    assert record["turns"][0]["stats"]["mean_acceptance"] == pytest.approx(8 / 3)
    assert record["turns"][1]["cancelled"] is True


def test_save_refuses_a_json_name_for_the_transcript(tmp_path):
    with pytest.raises(ValueError, match="name a Markdown file"):
        save_transcript(tmp_path / "chat.json", [], model="m", settings=Settings())


# --- stats text ------------------------------------------------------------------------------


def test_stats_rows_and_summary():
    rows = dict(stats_rows(stats(draft_s=1.0, verify_s=3.0, ttft_s=0.25, peak_memory_gb=2.5)))
    assert rows["accept"] == "2.67 tok/round"
    assert rows["draft"].startswith(" 25%") and rows["verify"].startswith(" 75%")
    assert rows["TTFT"] == "250 ms" and rows["memory"] == "2.50 GB peak"
    summary = "9 tokens · 40.0 tok/s · 2.67 tok/round · prefilled 8 of 30 prompt tokens · stop"
    assert turn_summary(stats()) == summary


def test_the_stats_panel_shows_tokens_verified_depth_trees_and_sources():
    rows = dict(
        stats_rows(
            stats(
                drafter_kind="dflash",
                target_forwards=49,
                tokens_verified=441,
                accepted_depths=[2] * 40 + [0] * 9,
                tree_rounds=40,
                accepted_from={"both": 2, "lookup": 8, "model": 30},
            )
        )
    )
    assert rows["verified"] == "9.0 tok/round, depth 1.6"
    assert rows["trees"] == "40/49 rounds"
    assert rows["from"] == "model 30 lookup 8 both 2"
    assert dict(stats_rows(stats(drafter_kind="dflash")))["from"] == "–"  # no draft kept yet
    assert "trees" not in dict(stats_rows(stats(drafter_kind="none")))  # plain decoding: nothing drafted


def test_histogram_counts_rounds_by_committed_tokens():
    assert histogram([1, 3, 3, 1, 1], width=6) == [
        " 1 │██████ 3",
        " 2 │       0",
        " 3 │████   2",
    ]
    assert histogram([]) == []


def test_sparkline_scales_to_the_block_and_keeps_the_newest_rounds():
    assert sparkline([4, 2, 0, 1], top=4, width=10, height=1) == ["█▄ ▂"]
    assert sparkline([1] * 5 + [4], top=4, width=3, height=2) == ["  █", "▄▄█"]


# --- pacing of streamed updates --------------------------------------------------------------


class FakeClocks:
    def __init__(self):
        self.cpu_s, self.wall_s = 0.0, 100.0

    def spend(self, cpu: float, wall: float) -> None:
        self.cpu_s += cpu
        self.wall_s += wall


def test_the_pacer_spaces_updates_so_drawing_takes_a_small_share_of_the_time():
    from mlx_glimmer.tui.pacing import Pacer

    clocks = FakeClocks()
    pacer = Pacer(share=0.05, cpu=lambda: clocks.cpu_s, clock=lambda: clocks.wall_s)
    pacer.start()
    for _ in range(20):  # every update costs the UI thread 20 ms
        clocks.spend(0.020, pacer.interval)
        pacer.updated()
    assert pacer.interval == pytest.approx(0.4, rel=0.01)  # 20 ms / 5 %
    for _ in range(20):  # a cheap screen: as fast as allowed
        clocks.spend(0.0005, pacer.interval)
        pacer.updated()
    assert pacer.interval == pytest.approx(1 / 30)
    clocks.spend(1.0, 1.0)  # one very slow frame is capped
    assert pacer.updated() == 0.5
    assert pacer.due(clocks.wall_s - 0.6) and not pacer.due(clocks.wall_s - 0.1)


def test_an_explicit_blas_thread_count_is_left_alone(monkeypatch):
    from mlx_glimmer.tui.pacing import leave_a_core_for_the_ui

    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    assert leave_a_core_for_the_ui() is None
