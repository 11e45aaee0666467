"""`mlx-glimmer chat`: the app, driven by Textual's pilot on a tiny pair.

The tiny pair here uses a "readable" tokenizer: one printable character per
byte id, so any token sequence decodes to text that encodes back to the same
ids. That makes cache reuse across turns exactly measurable (a byte-level
tokenizer turns a random model's stray bytes into U+FFFD, which does not).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import tiny_checkpoints as tc
from slow_machine import slow_machine_timeout

import mlx_glimmer
from mlx_glimmer import GenerationChunk, GenerationStats, GlimmerError
from mlx_glimmer.cli import main
from mlx_glimmer.tui import session as session_module
from mlx_glimmer.tui.app import ChatApp
from mlx_glimmer.tui.session import Settings
from mlx_glimmer.tui.widgets import AssistantMessage, PromptInput

SNAPSHOT = Path(__file__).parent / "snapshots" / "chat_main.svg"
SIZE = (120, 36)
REASONING_TEMPLATE = (
    "{{ bos_token }}reasoning: {{ reasoning_strength | default('high') }}<|eom|>"
    + tc.CHAT_TEMPLATE.removeprefix("{{ bos_token }}")
)


def readable_char(b: int) -> str:
    return chr(b) if 0x20 <= b <= 0x7E or b == 0x0A else chr(0x100 + b)


def write_readable_tokenizer(path: Path, template: str) -> None:
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab={readable_char(b): b for b in range(256)}, merges=[]))
    tok.decoder = decoders.Fuse()
    # Name every id up to the model's vocabulary so none decodes to nothing.
    pads = [f"<|pad{i}|>" for i in range(tc.VOCAB_SIZE - 256 - len(tc.SPECIALS))]
    tok.add_special_tokens(tc.SPECIALS + pads)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin|>",
        eos_token="<|end|>",
        mask_token="<|mask|>",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = template
    fast.save_pretrained(path)


def readable_target(src: Path, dst: Path, template: str) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name == "config.json" or f.name.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copy(f, dst / f.name)
    write_readable_tokenizer(dst, template)
    return dst


@pytest.fixture(autouse=True)
def private_history(tmp_path, monkeypatch):
    """The chat command saves conversations: never into the user's own data directory."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))


@pytest.fixture(scope="module")
def pair(checkpoints, tmp_path_factory):
    target = readable_target(checkpoints["muse"], tmp_path_factory.mktemp("tui") / "muse", tc.CHAT_TEMPLATE)
    return mlx_glimmer.load(target=target, drafter=checkpoints["assistant"])


@pytest.fixture(scope="module")
def reasoning_pair(checkpoints, tmp_path_factory):
    target = readable_target(checkpoints["muse"], tmp_path_factory.mktemp("tui") / "muse-r", REASONING_TEMPLATE)
    return mlx_glimmer.load(target=target, drafter=checkpoints["assistant"])


@dataclass
class View:
    """What the screen showed when the scenario ended."""

    app: ChatApp
    info: list[str]
    errors: list[str]
    answers: list[str | None]  # the Markdown source of each finished answer
    summaries: list[str]  # the line under each answer
    status: str
    numbers: str  # the stats panel's figures
    rounds: list[str]  # its sparkline rows
    rounds_width: int
    histogram: str
    reasoning_control: bool


def look(app) -> View:
    def text(widget) -> str:
        return str(widget.content)

    return View(
        app=app,
        info=[text(n) for n in app.query("Note.info")],
        errors=[text(n) for n in app.query("Note.error")],
        answers=[m.answer_source for m in app.query(AssistantMessage)],
        summaries=[text(s) for s in app.query(".summary")],
        status=text(app.query_one("#status")),
        numbers=text(app.query_one("#numbers")),
        rounds=text(app.query_one("#rounds")).splitlines(),
        rounds_width=app.query_one("#rounds").size.width,
        histogram=text(app.query_one("#histogram")),
        reasoning_control=app.query_one("#reasoning").display,
    )


def chat(pair, scenario, *, load=None, **settings) -> View:
    """Run `scenario(app, pilot)` in a chat app over `pair` (loaded already, like a fast disk)."""
    settings = {
        "max_tokens": 24,
        "block_size": 4,
        "seed": 0,
        **settings,
    }  # seed given, as with --seed 0: answers repeat
    return run_scenario(ChatApp(load or (lambda: pair), Settings.of(**settings), source="the tiny pair"), scenario)


def run_scenario(app: ChatApp, scenario) -> View:
    """Start `app` at the test size, wait for it to settle, play `scenario(app, pilot)`, and look at it."""
    view = []

    async def run():
        async with app.run_test(size=SIZE) as pilot:
            await idle(app, pilot)
            await scenario(app, pilot)
            view.append(look(app))

    asyncio.run(run())
    return view[0]


async def idle(app, pilot, timeout=slow_machine_timeout(64)):  # an answer of the tiny pair
    deadline = time.monotonic() + timeout
    while app.busy:
        assert time.monotonic() < deadline, "the app stayed busy"
        await pilot.pause(0.02)
    await pilot.pause()


async def say(app, pilot, text: str, wait=True):
    app.query_one(PromptInput).load_text(text)
    await pilot.press("enter")
    if wait:
        await idle(app, pilot)


def settings_kwargs(**kw):
    base = dict(max_tokens=24, block_size=4, temperature=0.0, top_p=1.0, top_k=0, seed=0, speculative=True)
    return {**base, **kw}


# --- one exchange ---------------------------------------------------------------------


def test_an_answer_streams_in_and_equals_generate(pair):
    async def scenario(app, pilot):
        await pilot.press(*"Hello")
        await pilot.press("enter")
        await idle(app, pilot)

    view = chat(pair, scenario)
    ref = mlx_glimmer.generate(pair, [{"role": "user", "content": "Hello"}], **settings_kwargs())
    (turn,) = view.app.conversation.turns
    assert turn.user == "Hello"
    assert turn.token_ids == ref.token_ids and turn.text == ref.text
    assert not turn.cancelled and turn.stats.finish_reason in ("stop", "length")
    assert view.answers == [ref.text.strip()]  # rendered as Markdown once done
    assert turn.stats.prefill_tokens == turn.stats.prompt_tokens == ref.stats.prompt_tokens
    assert turn.stats.block_size == 4 and turn.stats.drafter_kind == "dflash"


def test_the_stats_panel_shows_the_last_answer(pair):
    async def scenario(app, pilot):
        await say(app, pilot, "Hello")

    view = chat(pair, scenario)
    stats = view.app.conversation.turns[0].stats
    for needle in ("decode", "prefill", "TTFT", "tok/round", "draft", "verify", "GB peak"):
        assert needle in view.numbers
    assert f"prefilled {stats.prefill_tokens} of {stats.prompt_tokens} prompt tokens" in view.numbers
    assert len(view.rounds) == 3  # one column per round, the newest on the right
    assert len(view.rounds[-1].strip()) == min(len(stats.acceptance_lengths), view.rounds_width)
    assert view.histogram.startswith(" 1 │")
    assert "muse + assistant" in view.status and "float32" in view.status and "dflash block 4" in view.status


# --- cancel -------------------------------------------------------------------------------


def gate_after(monkeypatch, n: int):
    """Make the engine stop after its n-th chunk until released; returns (reached, release)."""
    reached, release = threading.Event(), threading.Event()
    real = session_module.stream_generate

    def gated(*args, **kwargs):
        chunks = real(*args, **kwargs)
        try:
            for i, chunk in enumerate(chunks, 1):
                yield chunk
                if i == n:
                    reached.set()
                    release.wait(30)
        finally:
            chunks.close()

    monkeypatch.setattr(session_module, "stream_generate", gated)
    return reached, release


@pytest.mark.parametrize("key", ["escape", "ctrl+c"])
def test_cancel_keeps_the_partial_answer_and_the_next_turn_is_exact(pair, monkeypatch, key):
    reached, release = gate_after(monkeypatch, 3)

    async def scenario(app, pilot):
        await say(app, pilot, "Hello", wait=False)
        deadline = time.monotonic() + slow_machine_timeout(3)
        while not (reached.is_set() and app.query(AssistantMessage).last().streamed):
            assert time.monotonic() < deadline, "no text streamed in"
            await pilot.pause(0.02)
        # Text shows while the answer is still being written.
        await pilot.press(key)
        release.set()
        await idle(app, pilot)
        await say(app, pilot, "Go on")

    view = chat(pair, scenario, max_tokens=30)
    assert view.summaries[0].endswith("cancelled")
    first, second = view.app.conversation.turns
    full = mlx_glimmer.generate(pair, [{"role": "user", "content": "Hello"}], **settings_kwargs(max_tokens=30))
    assert first.cancelled and first.stats.finish_reason == "cancelled"
    assert 0 < len(first.token_ids) < len(full.token_ids)
    assert full.token_ids[: len(first.token_ids)] == first.token_ids
    assert full.text.startswith(first.text)
    conversation = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "Go on"},
    ]
    fresh = mlx_glimmer.generate(pair, conversation, **settings_kwargs(max_tokens=30))
    assert second.token_ids == fresh.token_ids and not second.cancelled
    assert second.stats.prefill_tokens < second.stats.prompt_tokens  # the cancelled turn's cache was kept


# --- multi-turn cache reuse ---------------------------------------------------------------


def test_the_second_turn_prefills_only_the_new_tokens(pair):
    async def scenario(app, pilot):
        await say(app, pilot, "Hello")
        await say(app, pilot, "And then?")

    view = chat(pair, scenario)
    first, second = view.app.conversation.turns
    # The target has run the first prompt and every committed token but the last
    # (a stop token, when one ended the answer, is committed but not in token_ids).
    stopped = first.stats.finish_reason == "stop"
    cached = first.stats.prompt_tokens + len(first.token_ids) - (0 if stopped else 1)
    assert second.stats.prefill_tokens == second.stats.prompt_tokens - cached
    assert second.stats.prefill_tokens < 20  # the new user message and template glue only
    assert f"prefilled {second.stats.prefill_tokens} of {second.stats.prompt_tokens}" in view.summaries[-1]
    conversation = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "And then?"},
    ]
    assert second.token_ids == mlx_glimmer.generate(pair, conversation, **settings_kwargs()).token_ids


# --- slash commands ----------------------------------------------------------------------


def test_settings_commands_change_the_next_turn(pair, tmp_path):
    async def scenario(app, pilot):
        await say(app, pilot, "/temp 0.8")
        await say(app, pilot, "/block 2")
        await say(app, pilot, "/system Be brief.")
        await say(app, pilot, "Hi")
        await say(app, pilot, "/spec off")
        await say(app, pilot, "Hi again")

    view = chat(pair, scenario)
    s = view.app.settings
    g = s.generation
    assert (g.sampling.temperature, g.block_size, s.system, g.speculative) == (0.8, 2, "Be brief.", False)
    first, second = view.app.conversation.turns
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ref = mlx_glimmer.generate(pair, msgs, **settings_kwargs(temperature=0.8, block_size=2))
    assert first.token_ids == ref.token_ids and first.stats.block_size == 2
    msgs += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Hi again"}]
    ref = mlx_glimmer.generate(pair, msgs, **settings_kwargs(temperature=0.8, speculative=False))
    assert second.token_ids == ref.token_ids and second.stats.drafter_kind == "none"
    assert set(second.stats.acceptance_lengths) == {1}
    info = "\n".join(view.info)
    for needle in ("Temperature 0.8", "Block size 2", "System prompt set: Be brief.", "Speculative decoding off"):
        assert needle in info


def test_clear_forgets_the_conversation_and_its_cache(pair):
    async def scenario(app, pilot):
        await say(app, pilot, "Hello")
        await say(app, pilot, "/clear")
        assert not app.query(AssistantMessage) and app.state.processed == []
        await say(app, pilot, "Hello")

    view = chat(pair, scenario)
    (turn,) = view.app.conversation.turns
    assert turn.stats.prefill_tokens == turn.stats.prompt_tokens  # nothing reused
    assert "Conversation cleared." in view.info and len(view.answers) == 1


def test_save_writes_the_transcript_and_its_stats(pair, tmp_path):
    async def scenario(app, pilot):
        await say(app, pilot, "/system Be brief.")
        await say(app, pilot, "Hello")
        await say(app, pilot, f"/save {tmp_path / 'chat'}")

    view = chat(pair, scenario)
    turn = view.app.conversation.turns[0]
    md = (tmp_path / "chat.md").read_text()
    assert md.startswith("# Chat with muse + assistant")
    assert "## System\n\nBe brief." in md and "## You\n\nHello" in md and turn.answer in md
    assert "prefilled" in md
    record = json.loads((tmp_path / "chat.json").read_text())
    assert record["settings"]["system"] == "Be brief."
    (t,) = record["turns"]
    assert t["text"] == turn.text and t["stats"]["generated_tokens"] == len(turn.token_ids)
    assert t["stats"]["acceptance_lengths"] == turn.stats.acceptance_lengths
    assert view.info[-1] == f"Saved {tmp_path / 'chat.md'} and {tmp_path / 'chat.json'}."


def test_help_and_stats_print_inline(pair):
    async def scenario(app, pilot):
        await say(app, pilot, "/stats")
        await say(app, pilot, "Hello")
        await say(app, pilot, "/stats")
        await say(app, pilot, "/help")

    view = chat(pair, scenario)
    before, after, help_ = view.info[-3:]
    assert "no answer yet" in before
    stats = view.app.conversation.turns[0].stats
    assert f"prefilled {stats.prefill_tokens} of {stats.prompt_tokens} prompt tokens" in after
    assert "session: 1 answers" in after
    for command in ("/clear", "/system", "/temp", "/block", "/spec", "/save", "/stats", "/help", "/reasoning"):
        assert command in help_
    assert "esc" in help_ and "ctrl+j" in help_


BAD_COMMANDS = [
    ("/frobnicate", "unknown command /frobnicate"),
    ("/tmp 1", "did you mean /temp?"),
    ("/temp hot", "/temp needs a number"),
    ("/temp -1", "/temp must be a number >= 0"),
    ("/block 0", "/block must be >= 1"),
    ("/block two", "/block needs 'auto' or a whole number"),
    ("/spec maybe", "usage: /spec on|off"),
    ("/save", "usage: /save FILE"),
    ("/save /nonexistent/dir/chat.md", "/save failed"),
    ("/clear now", "/clear takes no argument"),
    ("/reasoning low", "no reasoning strength"),
]


def test_bad_commands_give_an_inline_error_and_change_nothing(pair):
    errors = []

    async def scenario(app, pilot):
        for line, _ in BAD_COMMANDS:
            await say(app, pilot, line)
            errors.append(look(app).errors[-1])

    view = chat(pair, scenario)
    for (line, needle), error in zip(BAD_COMMANDS, errors):
        assert needle in error, (line, error)
    assert len(view.errors) == len(BAD_COMMANDS)
    assert view.app.settings == Settings.of(max_tokens=24, block_size=4, seed=0)


def test_a_double_slash_sends_a_literal_slash(pair):
    async def scenario(app, pilot):
        await say(app, pilot, "//temp is a prompt")

    view = chat(pair, scenario)
    assert view.app.conversation.turns[0].user == "/temp is a prompt"


# --- reasoning strength -------------------------------------------------------------------


def test_reasoning_strength_goes_to_the_template(reasoning_pair):
    async def scenario(app, pilot):
        await say(app, pilot, "/reasoning low")
        assert app.query_one("#reasoning").value == "low"
        await say(app, pilot, "Hello")

    view = chat(reasoning_pair, scenario)
    assert view.reasoning_control
    (turn,) = view.app.conversation.turns
    msgs = [{"role": "user", "content": "Hello"}]
    low = mlx_glimmer.generate(
        reasoning_pair, msgs, chat_template_kwargs={"reasoning_strength": "low"}, **settings_kwargs()
    )
    assert turn.token_ids == low.token_ids
    high = mlx_glimmer.generate(reasoning_pair, msgs, **settings_kwargs())
    assert high.stats.prompt_tokens == low.stats.prompt_tokens + 1  # "high" vs "low"
    assert "reasoning low" in view.status


def test_the_reasoning_control_is_hidden_without_template_support(pair):
    async def scenario(app, pilot):
        pass

    assert not chat(pair, scenario).reasoning_control


# --- channel-framed output ----------------------------------------------------------------

FRAMED = (
    "to=self<|message|>The user asks for a cache in Python. A dict will do.<|eom|>"
    "<|start|>assistant to=user<|message|>Use a **dict**:\n\n```python\ncache = {}\ncache[key] = value\n```\n"
    "Look-ups are O(1).<|eot|>"
)


def scripted(text: str, pieces: int = 9, lengths=(3, 1, 5, 2, 4, 4, 1, 6, 2, 3, 5, 4)):
    """A stand-in for the engine that streams `text` with fixed statistics."""

    def stream_generate(pair, prompt, **kwargs):
        stats = GenerationStats(
            prompt_tokens=42,
            prefill_tokens=42,
            drafter_kind="dflash",
            block_size=8,
            ttft_s=0.052,
            prefill_tokens_per_second=807.7,
            peak_memory_gb=1.87,
        )
        step = -(-len(text) // pieces)
        for i in range(pieces):
            stats.acceptance_lengths += list(lengths[i * len(lengths) // pieces : (i + 1) * len(lengths) // pieces])
            stats.target_forwards = len(stats.acceptance_lengths)
            stats.generated_tokens = 1 + sum(stats.acceptance_lengths)
            stats.accepted_depths = [n - 1 for n in stats.acceptance_lengths]
            stats.tokens_verified = 8 * stats.target_forwards
            stats.tree_rounds = sum(n > 3 for n in stats.acceptance_lengths)
            stats.accepted_from = {"model": sum(n > 1 for n in stats.acceptance_lengths)}
            stats.decode_tokens_per_second = 61.4
            stats.draft_s, stats.verify_s = 0.021 * (i + 1), 0.064 * (i + 1)
            if i == pieces - 1:
                stats.finish_reason = "stop"
            yield GenerationChunk(text[i * step : (i + 1) * step], [], stats)

    return stream_generate


def test_reasoning_shows_apart_and_collapses_above_the_answer(pair, monkeypatch):
    monkeypatch.setattr(session_module, "stream_generate", scripted(FRAMED))

    async def scenario(app, pilot):
        await say(app, pilot, "How do I cache things?")
        message = app.query(AssistantMessage).last()
        box = message.query_one("Collapsible")
        assert box.display and box.collapsed and box.region.y < message.query_one("Markdown").region.y
        reasoning = str(message.query_one(".reasoning-text").content)
        assert reasoning == "The user asks for a cache in Python. A dict will do."
        assert message.query("MarkdownFence")  # the code block is rendered (and highlighted) as code

    (answer,) = chat(pair, scenario).answers
    assert answer.startswith("Use a **dict**:") and answer.endswith("O(1).")
    assert "to=user" not in answer and "<|" not in answer


# --- errors ---------------------------------------------------------------------------------


def test_a_load_error_is_a_message_and_the_app_stays_up():
    def fail():
        raise GlimmerError("/nowhere: no such bundle or directory")

    async def scenario(app, pilot):
        await say(app, pilot, "Hello")
        await say(app, pilot, "/temp 0.5")

    view = chat(None, scenario, load=fail)
    assert "Could not load the tiny pair: /nowhere: no such bundle or directory" in view.errors[0]
    assert "mlx-glimmer chat BUNDLE" in view.errors[0]
    assert "No model loaded" in view.errors[1]
    assert view.app.settings.generation.sampling.temperature == 0.5
    assert "no model loaded" in view.status


def test_a_generation_error_is_a_message_and_the_next_turn_works(pair, monkeypatch):
    real = session_module.stream_generate

    def broken(*args, **kwargs):
        chunks = real(*args, **kwargs)
        yield next(chunks)
        chunks.close()
        raise RuntimeError("the accelerator fell over")

    async def scenario(app, pilot):
        monkeypatch.setattr(session_module, "stream_generate", broken)
        await say(app, pilot, "Hello")
        monkeypatch.setattr(session_module, "stream_generate", real)
        await say(app, pilot, "Hello")

    view = chat(pair, scenario)
    assert "Generation failed: RuntimeError: the accelerator fell over" in view.errors[0]
    (turn,) = view.app.conversation.turns
    ref = mlx_glimmer.generate(pair, [{"role": "user", "content": "Hello"}], **settings_kwargs())
    assert turn.token_ids == ref.token_ids and turn.stats.prefill_tokens == turn.stats.prompt_tokens


# --- input -------------------------------------------------------------------------------------


def test_input_history_and_multi_line_prompts(pair):
    async def scenario(app, pilot):
        prompt = app.query_one(PromptInput)
        await say(app, pilot, "/temp 0")
        await pilot.press(*"two", "ctrl+j", *"lines")
        assert prompt.text == "two\nlines"
        await pilot.press("enter")
        await idle(app, pilot)
        await pilot.press(*"draft")
        await pilot.press("up")
        assert prompt.text == "two\nlines"
        await pilot.press("up", "up")  # the cursor walks up the entry, then to the older one
        assert prompt.text == "/temp 0"
        await pilot.press("down")
        assert prompt.text == "two\nlines"
        await pilot.press("down", "down")
        assert prompt.text == "draft"

    view = chat(pair, scenario)
    assert view.app.conversation.turns[0].user == "two\nlines"


# --- the main screen -------------------------------------------------------------------------


def test_main_screen_snapshot(pair, monkeypatch):
    """The layout after one exchange; set UPDATE_SNAPSHOTS=1 to accept a change and review the SVG."""
    monkeypatch.setattr(session_module, "stream_generate", scripted(FRAMED))
    svg = {}

    async def scenario(app, pilot):
        await say(app, pilot, "How do I cache things in Python?")
        prompt = app.query_one(PromptInput)
        prompt.cursor_blink = False
        await pilot.pause()
        svg["text"] = app.export_screenshot()

    chat(pair, scenario, block_size=8)
    if os.environ.get("UPDATE_SNAPSHOTS"):  # regeneration only when asked; a missing snapshot fails
        SNAPSHOT.parent.mkdir(exist_ok=True)
        SNAPSHOT.write_text(svg["text"])
    assert SNAPSHOT.is_file(), f"{SNAPSHOT} is missing; run with UPDATE_SNAPSHOTS=1, review the SVG and commit it"
    assert svg["text"] == SNAPSHOT.read_text(), f"the main screen changed; review and update {SNAPSHOT}"


# --- command line -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--temp", "-1"], "chat: --temp must be a number >= 0, got -1.0"),
        (["--top-p", "0"], "chat: --top-p must be in (0, 1], got 0.0"),
        (["--reasoning", "extreme"], "invalid choice: 'extreme'"),
        (["--block-size", "0"], "--block-size"),
        (["--frob"], "unrecognized arguments: --frob"),
    ],
)
def test_chat_flag_errors_print_one_line_before_the_app_starts(capsys, args, needle):
    assert main(["chat", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


def test_chat_flags_become_the_app_settings(monkeypatch, checkpoints):
    started = []
    monkeypatch.setattr(ChatApp, "run", lambda app: started.append(app))
    bundle = str(checkpoints["llama"])  # a model directory: a path that is none is refused before the app starts
    args = [
        "chat",
        bundle,
        "--temp",
        "0.7",
        "--top-p",
        "0.9",
        "--top-k",
        "40",
        "--seed",
        "3",
        "--block-size",
        "6",
        "--max-tokens",
        "99",
        "--system",
        "Be brief.",
        "--no-spec",
        "--reasoning",
        "low",
    ]
    assert main(args) == 0
    (app,) = started
    assert app.settings == Settings.of(
        max_tokens=99,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        seed=3,
        block_size=6,
        speculative=False,
        system="Be brief.",
        reasoning="low",
    )
    assert app.source == bundle


def test_a_first_run_says_it_is_measuring_verify_cost_before_the_first_answer(pair, monkeypatch, tmp_path):
    """`auto` times a few verify widths once per model and chip, after loading; the chat says so while it waits."""
    monkeypatch.setenv("MLX_GLIMMER_CACHE", str(tmp_path))
    monkeypatch.setattr(
        importlib.import_module("mlx_glimmer.generate"), "_COSTS", {}
    )  # as in a fresh process: nothing timed yet

    async def scenario(app, pilot):
        await say(app, pilot, "Hello")

    view = chat(pair, scenario, block_size="auto")
    assert any(line.startswith("Measuring verify cost") for line in view.info), view.info
    assert view.app.conversation.turns[0].stats.finish_reason in ("stop", "length")
