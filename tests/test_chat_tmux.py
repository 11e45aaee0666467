"""Resume in a real terminal (tmux), with `XDG_DATA_HOME` set to an empty folder.

One turn, quit; the turn is in the SQLite file under that folder; `chat
--resume last` shows it and answers a follow-up; `kill -9` during the next
answer, restart with `--resume last`: every earlier turn is there.
"""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tiny_checkpoints as tc
from test_tui import readable_target

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux"),
]

APP = Path(sys.executable).parent / "mlx-glimmer"


class Terminal:
    """One tmux server of our own (its own socket), one window at a time."""

    def __init__(self, tmp: Path, env: dict):
        self.socket = f"glimmer-test-{os.getpid()}"
        self.env = env
        self.tmp = tmp

    def tmux(self, *args: str) -> str:
        out = subprocess.run(
            ["tmux", "-L", self.socket, "-f", "/dev/null", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        return out.stdout

    def start(self, *args: str) -> None:
        command = " ".join(f"'{a}'" for a in [str(APP), "chat", *args])
        self.tmux("new-session", "-d", "-s", "chat", "-x", "120", "-y", "40", f"exec {command}")
        self.tmux("set-option", "-t", "chat", "remain-on-exit", "on")

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "chat")

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", "chat", *keys)

    def dead(self) -> bool:
        return self.tmux("display-message", "-p", "-t", "chat", "#{pane_dead}").strip() == "1"

    def pid(self) -> int:
        return int(self.tmux("display-message", "-p", "-t", "chat", "#{pane_pid}").strip())

    def wait(self, condition, what: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline or (self.dead() and not condition()):
                raise AssertionError(f"waited for {what}; the screen:\n{self.screen()}")
            time.sleep(0.2)

    def wait_text(self, text: str, timeout: float = 120.0) -> None:
        self.wait(lambda: text in self.screen(), repr(text), timeout)

    def quit(self) -> None:
        self.keys("C-q")
        deadline = time.monotonic() + 30
        while not self.dead():
            assert time.monotonic() < deadline, f"the app did not quit:\n{self.screen()}"
            time.sleep(0.2)
        self.close()

    def close(self) -> None:
        self.tmux("kill-session", "-t", "chat")

    def kill_server(self) -> None:
        self.tmux("kill-server")


def stored_turns(db: Path) -> list[tuple[str, int]]:
    """(user, cancelled) of every stored turn, read as another program would."""
    if not db.exists():
        return []
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    try:
        return con.execute("SELECT user, cancelled FROM turns ORDER BY conversation_id, position").fetchall()
    except sqlite3.OperationalError:  # the schema is not there yet
        return []
    finally:
        con.close()


def test_resume_in_a_real_terminal_survives_kill_9(checkpoints, tmp_path):
    target = readable_target(checkpoints["muse"], tmp_path / "muse", tc.CHAT_TEMPLATE)
    drafter = str(checkpoints["assistant"])
    data = tmp_path / "data"
    data.mkdir()
    env = {**os.environ, "XDG_DATA_HOME": str(data), "TERM": "xterm-256color"}
    db = data / "mlx-glimmer" / "chats.db"
    term = Terminal(tmp_path, env)
    try:
        # One turn, quit: it is in the SQLite file under XDG_DATA_HOME.
        term.start(str(target), "--drafter", drafter, "--max-tokens", "24", "Hello")
        term.wait(lambda: len(stored_turns(db)) == 1, "the first turn to be saved")
        term.quit()
        assert stored_turns(db) == [("Hello", 0)]

        # --resume last shows it and answers a follow-up.
        term.start(str(target), "--drafter", drafter, "--resume", "last")
        term.wait_text("Cache rebuilt")
        assert "Hello" in term.screen()
        term.keys("And then?", "Enter")
        term.wait(lambda: len(stored_turns(db)) == 2, "the follow-up to be saved")
        term.quit()

        # kill -9 during the next (long) answer.
        term.start(str(target), "--drafter", drafter, "--resume", "last", "--max-tokens", "4000")
        term.wait_text("Cache rebuilt")
        term.keys("Tell me more", "Enter")
        term.wait_text("generating")
        time.sleep(1.0)
        assert "generating" in term.screen(), "the answer ended before the kill; make it longer"
        os.kill(term.pid(), signal.SIGKILL)
        term.wait(term.dead, "the app to die", 30)
        term.close()
        assert stored_turns(db) == [("Hello", 0), ("And then?", 0)]  # only the answer being written is lost

        # Restart with --resume last: every earlier turn is there.
        term.start(str(target), "--drafter", drafter, "--resume", "last")
        term.wait_text("Cache rebuilt")
        screen = term.screen()
        assert "Hello" in screen and "And then?" in screen
        term.quit()
        con = sqlite3.connect(db)
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        term.kill_server()
