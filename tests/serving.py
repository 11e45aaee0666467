"""How the server tests reach a server: `mlx-glimmer serve` in a process of its own (ready once it prints its
address), and a worker job's events collected into its answer."""

from __future__ import annotations

import os
import queue
import subprocess
import threading
import time

from slow_machine import slow_machine_timeout

DEMO_MAX_QUEUE = 12  # the demo pair's server (conftest's `demo_server`): requests waiting at most
DEMO_MAX_BATCH = 4  # ... and decoded together at most


class ServeProcess:
    """Runs `cmd` (a `serve` command line), keeps its stderr in `log` and waits for the line with its URL
    (`wait=False`: starts it and returns; `ready()` waits then, so several servers can start at once)."""

    def __init__(self, cmd: list[str], timeout: float = slow_machine_timeout(), *, wait: bool = True):
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
        self.log: list[str] = []
        self._lines: queue.Queue = queue.Queue()
        self._timeout = timeout

        def drain():  # keep reading, so the pipe never fills
            for line in self.proc.stderr:
                self.log.append(line)
                self._lines.put(line)
            self._lines.put(None)

        threading.Thread(target=drain, daemon=True).start()
        if wait:
            self.ready()

    def ready(self) -> "ServeProcess":
        """Wait until it listens (its URL in `url`, without /v1 in `root`); stops it if it never does."""
        deadline = time.monotonic() + self._timeout
        try:
            while True:
                line = self._lines.get(timeout=max(0.1, deadline - time.monotonic()))
                if line is None:
                    raise RuntimeError("serve exited before it was ready:\n" + "".join(self.log))
                if " at http://" in line:
                    self.url = line.split(" at ")[-1].strip()  # http://127.0.0.1:PORT/v1
                    break
        except BaseException:
            self.stop()
            raise
        self.root = self.url.removesuffix("/v1")
        return self

    def client(self, tokens: int, requests: int = 1, **kwargs):
        """An `openai` client that waits for an answer of up to `tokens` tokens, behind up to `requests` - 1
        others, as long as a busy machine may take (`slow_machine_timeout`; a stream waits that for each chunk)."""
        import openai

        timeout = slow_machine_timeout(tokens, requests)
        return openai.OpenAI(base_url=self.url, api_key="not-needed", max_retries=0, timeout=timeout, **kwargs)

    def metrics(self) -> dict[str, float]:
        import httpx2 as httpx

        text = httpx.get(self.root + "/metrics", timeout=slow_machine_timeout()).text
        return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if line and line[0] != "#")}

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:  # no failure: a server slow to stop is killed
            self.proc.kill()
            self.proc.wait()

    def stop_and_check(self):
        """Stop it; it must have exited, and printed no traceback while it ran."""
        self.stop()
        assert self.proc.returncode is not None
        assert "Traceback" not in "".join(self.log), "".join(self.log)


def collect(events: queue.Queue, timeout: float = slow_machine_timeout(256)):
    """A submitted job's answer: its streamed text and its `Finished` event (a `Failed` one fails the test).
    `timeout`: the longest wait for one event, which may come after requests queued before this one."""
    from mlx_glimmer.server.run import Delta, Failed, Finished

    text = []
    while True:
        e = events.get(timeout=timeout)
        if isinstance(e, Delta):
            text.append(e.text)
        elif isinstance(e, Finished):
            return "".join(text), e
        elif isinstance(e, Failed):
            raise AssertionError(e.message)
