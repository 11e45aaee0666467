"""Chats that last: saving, the conversation list, resuming with the cache rebuilt, export.

Driven by Textual's pilot on the tiny pair of test_tui (readable tokenizer, so
cache reuse is exactly measurable).
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading

import pytest
from test_tui import SIZE, gate_after, idle, look, pair, run_scenario, say, settings_kwargs  # noqa: F401  (pair: a fixture)

from mlx_glimmer.cli import main
from mlx_glimmer.tui.app import ChatApp
from mlx_glimmer.tui.screens.conversations import ConversationList
from mlx_glimmer.tui.session import Settings
from mlx_glimmer.tui.store import Store, open_store
from mlx_glimmer.tui.widgets import AssistantMessage


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "chats.db")
    yield s
    s.close()


def chat(pair, scenario, *, store=None, **options):
    """Run `scenario(app, pilot)` in an app with history; returns what `look` saw at the end."""
    settings = options.pop("settings", Settings.of(max_tokens=24, block_size=4))
    return run_scenario(ChatApp(lambda: pair, settings, source="the tiny pair", store=store, **options), scenario)


async def nothing(app, pilot):
    pass


def user_notes(app) -> list[str]:
    return [str(n.content) for n in app.query("Note.user")]


# --- saving ---------------------------------------------------------------------------------


def test_a_turn_is_saved_as_soon_as_it_completes_with_what_the_cache_holds(pair, store):
    seen = {}

    async def scenario(app, pilot):
        await say(app, pilot, "/temp 0")
        await say(app, pilot, "Hello")
        seen["processed"] = list(app.state.processed)
        (c,) = store.list()  # already on disk, while the app still runs
        seen["stored"] = store.load(c.id)

    view = chat(pair, scenario, store=store)
    (turn,) = view.app.conversation.turns
    got = seen["stored"]
    assert got.info.title == "Hello" and got.info.model == "muse + assistant"
    assert got.info.bundle == str(pair.target_path)
    assert got.turns[0].token_ids == turn.token_ids and got.turns[0].text == turn.text
    assert got.turns[0].stats == turn.stats and not got.turns[0].cancelled
    assert got.processed == seen["processed"]
    assert got.settings == view.app.settings


def test_a_cancelled_answer_is_saved_and_marked(pair, store, monkeypatch):
    reached, release = gate_after(monkeypatch, 2)

    async def scenario(app, pilot):
        await say(app, pilot, "Hello", wait=False)
        while not reached.is_set():
            await pilot.pause(0.02)
        await pilot.press("escape")
        release.set()
        await idle(app, pilot)

    chat(pair, scenario, store=store, settings=Settings.of(max_tokens=60, block_size=4))
    (turn,) = store.load(store.last_id()).turns
    assert turn.cancelled and turn.stats.finish_reason == "cancelled" and turn.token_ids


def test_quitting_during_an_answer_saves_it_marked_cancelled(pair, store, tmp_path, monkeypatch):
    reached, release = gate_after(monkeypatch, 2)
    app = ChatApp(lambda: pair, Settings.of(max_tokens=60, block_size=4), source="the tiny pair", store=store)

    async def run():
        async with app.run_test(size=SIZE) as pilot:
            await idle(app, pilot)
            await say(app, pilot, "Hello", wait=False)
            while not reached.is_set():
                await pilot.pause(0.02)
        # ctrl+q: the app is gone while the MLX thread is still in the answer

    asyncio.run(run())
    release.set()
    assert app.shut_down(30)
    reopened = Store(tmp_path / "chats.db")
    (turn,) = reopened.load(reopened.last_id()).turns
    assert turn.cancelled and turn.user == "Hello" and turn.token_ids
    reopened.close()


def test_settings_commands_are_saved_with_the_conversation(pair, store):
    async def scenario(app, pilot):
        await say(app, pilot, "Hello")
        await say(app, pilot, "/temp 0.5")
        await say(app, pilot, "/system Be brief.")

    chat(pair, scenario, store=store)
    settings = store.load(store.last_id()).settings
    assert (settings.generation.sampling.temperature, settings.system) == (0.5, "Be brief.")


# --- resuming -------------------------------------------------------------------------------


def test_resume_rebuilds_the_cache_so_the_next_turn_is_as_in_a_live_session(pair, store):
    async def live(app, pilot):
        await say(app, pilot, "/block 2")
        await say(app, pilot, "Hello")
        await say(app, pilot, "And then?")

    live_view = chat(pair, live)
    _, live_second = live_view.app.conversation.turns

    async def first(app, pilot):
        await say(app, pilot, "/block 2")
        await say(app, pilot, "Hello")

    chat(pair, first, store=store)
    cid = store.last_id()
    stored = store.load(cid)
    rebuilt = {}

    async def resumed(app, pilot):
        rebuilt["processed"] = list(app.state.processed)
        rebuilt["settings"] = app.settings
        await say(app, pilot, "And then?")
        rebuilt["users"] = user_notes(app)

    # The app starts with other settings: the conversation's own come back.
    view = chat(pair, resumed, store=store, resume=cid, settings=Settings.of(max_tokens=24, block_size=4))
    assert rebuilt["processed"] == stored.processed  # exactly what the first session's cache held
    assert rebuilt["settings"].generation.block_size == 2
    assert rebuilt["users"] == ["Hello", "And then?"]
    assert view.answers[0] == stored.turns[0].answer  # the stored answer is shown
    assert any(i.startswith("Cache rebuilt: ") for i in view.info)
    first_turn, second = view.app.conversation.turns
    assert second.token_ids == live_second.token_ids
    assert second.stats.prefill_tokens == live_second.stats.prefill_tokens < second.stats.prompt_tokens
    assert len(store.load(cid).turns) == 2  # the follow-up joins the same conversation


def test_flags_given_with_resume_override_the_stored_settings(pair, store):
    async def first(app, pilot):
        await say(app, pilot, "/temp 0.5")
        await say(app, pilot, "Hello")

    chat(pair, first, store=store)
    view = chat(pair, nothing, store=store, resume=store.last_id(), overrides={"max_tokens": 7})
    g = view.app.settings.generation
    assert (g.sampling.temperature, g.max_tokens) == (0.5, 7)


def test_a_first_message_is_sent_once_the_model_is_loaded(pair, store):
    view = chat(pair, nothing, store=store, first_message="Hello")
    (turn,) = view.app.conversation.turns
    assert turn.user == "Hello" and store.list()[0].title == "Hello"


def test_an_empty_first_message_is_sent_as_an_empty_user_message(pair):
    """As `generate --chat --prompt ''` sends it: the chat template makes a prompt of it."""
    view = chat(pair, nothing, first_message="")
    (turn,) = view.app.conversation.turns
    assert turn.user == "" and turn.stats is not None and turn.stats.generated_tokens >= 1


# --- the conversation list -----------------------------------------------------------------------


def test_the_list_opens_renames_deletes_and_starts_new_conversations(pair, store):
    async def scenario(app, pilot):
        await say(app, pilot, "First chat")
        await say(app, pilot, "/clear")
        await say(app, pilot, "Second chat")
        first, second = sorted(c.id for c in store.list())
        assert app.conversation_id == second

        await pilot.press("ctrl+o")
        screen = app.screen
        assert isinstance(screen, ConversationList)
        assert [c.title for c in screen.items] == ["Second chat", "First chat"]
        await pilot.press("down", "r", "ctrl+a", "ctrl+k", *"Renamed", "enter")
        assert {c.id: c.title for c in store.list()}[first] == "Renamed"
        await pilot.press("up", "d")
        assert len(store.list()) == 2  # the first d only asks
        await pilot.press("d")
        assert [c.id for c in store.list()] == [first]
        await pilot.pause()
        await pilot.press("enter")  # open the one left
        await idle(app, pilot)
        assert app.screen is not screen and app.conversation_id == first
        assert user_notes(app) == ["First chat"] and app.conversation.turns[0].user == "First chat"
        assert app.state.processed == store.load(first).processed

        await pilot.press("ctrl+o")
        await pilot.press("n")
        await pilot.pause()
        assert app.conversation_id is None and not app.conversation.turns and not app.query(AssistantMessage)
        await say(app, pilot, "Third chat")
        assert len(store.list()) == 2

    view = chat(pair, scenario, store=store)
    assert view.info[0] == "New conversation."


def test_rename_and_chats_commands(pair, store):
    async def scenario(app, pilot):
        await say(app, pilot, "/rename Too early")
        await say(app, pilot, "Hello")
        await say(app, pilot, "/rename Greeting")
        await say(app, pilot, "/chats")
        assert isinstance(app.screen, ConversationList)
        await pilot.press("escape")

    view = chat(pair, scenario, store=store)
    assert "not saved yet" in view.errors[0]
    assert store.list()[0].title == "Greeting" and "Renamed to “Greeting”." in view.info


# --- export ------------------------------------------------------------------------------------------


def test_export_writes_markdown_or_json_by_extension(pair, store, tmp_path):
    async def scenario(app, pilot):
        await say(app, pilot, "/system Be brief.")
        await say(app, pilot, "Hello")
        await say(app, pilot, f"/export {tmp_path / 'chat.md'}")
        await say(app, pilot, f"/export {tmp_path / 'chat.json'}")
        await say(app, pilot, f"/export {tmp_path / 'chat.txt'}")

    view = chat(pair, scenario, store=store)
    (turn,) = view.app.conversation.turns
    md = (tmp_path / "chat.md").read_text()
    assert md.startswith("# Chat with muse + assistant") and "## You\n\nHello" in md and turn.answer in md
    record = json.loads((tmp_path / "chat.json").read_text())
    assert record["title"] == "Hello" and record["settings"]["system"] == "Be brief."
    (t,) = record["turns"]
    assert t["token_ids"] == turn.token_ids and t["text"] == turn.text and t["answer"] == turn.answer
    assert t["stats"]["acceptance_lengths"] == turn.stats.acceptance_lengths
    assert f"Exported 1 turns to {tmp_path / 'chat.json'}." in view.info
    assert "/export failed: chat.txt: name a .md (Markdown) or .json file" in view.errors[-1]


# --- faults ----------------------------------------------------------------------------------------


def test_a_corrupt_database_is_one_warning_and_the_chat_runs_without_history(pair, tmp_path):
    path = tmp_path / "chats.db"
    path.write_bytes(b"garbage" * 1000)
    store, warning = open_store(path)

    async def scenario(app, pilot):
        await say(app, pilot, "Hello")
        await say(app, pilot, "/chats")

    view = chat(pair, scenario, store=store, store_warning=warning)
    assert view.errors[0].startswith("history off: ") and "not a readable database" in view.errors[0]
    assert len(view.app.conversation.turns) == 1 and view.answers[0]
    assert "No history" in view.errors[1]


def test_a_database_locked_for_the_whole_chat_delays_saving_and_the_turns_are_written_on_exit(pair, tmp_path, capsys):
    path = tmp_path / "chats.db"
    store = Store(path, timeout=0.1)
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN EXCLUSIVE")

    async def scenario(app, pilot):
        await say(app, pilot, "Hello")
        await say(app, pilot, "Again")
        for _ in range(100):  # the first locked attempt ends within the save thread's busy timeout
            if "saving delayed" in look(app).status:
                break
            await pilot.pause(0.05)

    try:
        view = chat(pair, scenario, store=store)
        assert not view.errors  # not "history off": the lock passes
        (delayed,) = [i for i in view.info if i.startswith("saving delayed: ")]
        assert "locked" in delayed and "\n" not in delayed and "saving delayed (database busy)" in view.status
        assert len(view.app.conversation.turns) == 2 and view.app.store is not None
        assert store.list() == []  # nothing written yet
    finally:
        threading.Timer(0.5, lambda: other.execute("ROLLBACK")).start()  # free soon after the app exits
    assert view.app.shut_down(30)  # and the queue is flushed on exit
    assert capsys.readouterr().err == ""
    reopened = Store(path)
    assert [t.user for t in reopened.load(reopened.last_id()).turns] == ["Hello", "Again"]
    reopened.close()


def test_turns_still_unsaved_after_the_exit_wait_are_one_line(pair, tmp_path, capsys):
    path = tmp_path / "chats.db"
    other = sqlite3.connect(path, isolation_level=None)
    Store(path).close()
    other.execute("BEGIN EXCLUSIVE")

    async def scenario(app, pilot):
        await say(app, pilot, "Hello")
        await say(app, pilot, "Again")

    try:
        view = chat(pair, scenario, store=Store(path))
        assert view.app.shut_down(30, flush_s=0.5)
    finally:
        other.execute("ROLLBACK")
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("history: 2 turns of this chat could not be saved after waiting 0.5 s: ")
    assert str(path) in line and "locked" in line


# --- command line ----------------------------------------------------------------------------------


@pytest.fixture
def started(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    apps = []

    def run(app):
        app.had_history = app.store is not None  # the store is closed once the app has run
        apps.append(app)

    monkeypatch.setattr(ChatApp, "run", run)
    return apps


def test_chat_takes_a_first_message_a_bundle_or_both(started, checkpoints):
    bundle = checkpoints["llama"]  # a model directory: a path that is none is refused before the app starts
    assert main(["chat", "What is MLX?"]) == 0
    assert main(["chat", str(bundle)]) == 0
    assert main(["chat", str(bundle), "--temp", "0.5", "hello"]) == 0  # a message may follow the flags
    assert main(["chat", "hello", "--no-history"]) == 0
    (a, b, c, d) = started
    assert (a.first_message, a.source) == ("What is MLX?", "the demo pair")
    assert (b.first_message, b.source) == (None, str(bundle))
    assert (c.first_message, c.source, c.settings.generation.sampling.temperature) == ("hello", str(bundle), 0.5)
    assert a.had_history and not d.had_history


def test_list_and_resume_on_the_command_line(started, tmp_path, capsys):
    assert main(["chat", "--list"]) == 0
    assert capsys.readouterr().out.strip() == "no saved conversations"
    assert main(["chat", "--resume"]) == 2
    assert capsys.readouterr().err.startswith("error: chat: no saved conversations yet")
    store = Store(tmp_path / "data" / "mlx-glimmer" / "chats.db")
    cid = store.create("A saved chat", Settings.of(temperature=0.25))
    store.close()
    assert main(["chat", "--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["id", "updated", "turns", "model", "title"] and out[1].endswith("A saved chat")
    assert main(["chat", "--resume", "--top-k", "5"]) == 0
    assert main(["chat", "--resume", str(cid), "and then?"]) == 0
    (a, b) = started
    assert a.resume == cid and a.overrides == {"top_k": 5}
    assert b.resume == cid and b.first_message == "and then?"


def test_a_turn_whose_stored_stats_cannot_be_read_resumes_with_them_marked_unavailable(pair, started, tmp_path):
    store = Store(tmp_path / "data" / "mlx-glimmer" / "chats.db")  # where the command line looks

    async def first(app, pilot):
        await say(app, pilot, "Hello")
        await say(app, pilot, "Again")

    chat(pair, first, store=store)
    cid = store.last_id()
    store._db.execute("UPDATE turns SET stats = '{\"decode_tokens_per_second\": 61.' WHERE position = 0")
    assert main(["chat", "--resume", str(cid)]) == 0  # not a traceback: the app starts on it
    assert started[0].resume == cid

    view = chat(pair, nothing, store=store, resume=cid)
    unreadable, kept = view.app.conversation.turns
    assert unreadable.stats is None and unreadable.user == "Hello" and kept.stats is not None
    assert view.summaries[0] == "stats unavailable" and "tok/s" in view.summaries[1]
    assert view.answers[0] == unreadable.answer and not view.errors
    assert any(i.startswith("Resumed “Hello”") for i in view.info) and any(
        i.startswith("Cache rebuilt") for i in view.info
    )
    store.close()


@pytest.mark.parametrize(
    "args, needle",
    [
        (
            ["--resume", "what next"],
            "--resume takes a conversation id or 'last', got 'what next' (a message goes before",
        ),
        (["--resume", "7"], "no conversation 7"),
        (["--list", "--no-history"], "--list reads the history; drop --no-history"),
        (["a", "b", "c"], "at most a BUNDLE and one MESSAGE"),
    ],
)
def test_history_flag_mistakes_are_one_line(started, capsys, args, needle):
    assert main(["chat", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: chat: ") and needle in err[0], err


def test_list_on_a_corrupt_database_is_one_line(started, tmp_path, capsys):
    path = tmp_path / "data" / "mlx-glimmer" / "chats.db"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"garbage" * 1000)
    assert main(["chat", "--list"]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert err.startswith("error: chat: history off: ") and "not a readable database" in err
    assert main(["chat", "hello"]) == 0  # a plain chat starts anyway, with the warning inside
    (app,) = started
    assert not app.had_history and "not a readable database" in app.store_warning
