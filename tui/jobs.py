"""The chat's MLX side: loading the pair, every turn, rebuilding a resumed chat's cache.

All of it runs on one `MLXThread` (MLX streams belong to the thread that made them). Each job reports
back with a message handed to `post`, so the UI thread only ever reads snapshots.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

from textual.message import Message

from mlx_glimmer.decode_state import DecodeState
from mlx_glimmer.errors import GlimmerError
from mlx_glimmer.generate import GenerationStats
from mlx_glimmer.lockstep import calibrate
from mlx_glimmer.settings import GenerationSettings

from .pacing import Pacer
from .session import Settings, Turn, rebuild_state, run_turn
from .worker import MLXThread


def describe_error(e: BaseException) -> str:
    return str(e) if isinstance(e, GlimmerError) else f"{type(e).__name__}: {e}"


class Loaded(Message):
    def __init__(self, pair):
        super().__init__()
        self.pair = pair


class Measuring(Message):
    """Loaded, and timing the verify widths `auto` needs before the first answer (the first run on a machine)."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text


class Failed(Message):
    """Loading or a turn failed; `text` says what happened."""

    def __init__(self, text: str, loading: bool):
        super().__init__()
        self.text = text
        self.loading = loading


class Progress(Message):
    def __init__(self, text: str, stats: GenerationStats):
        super().__init__()
        self.text = text
        self.stats = stats


@dataclass
class Done:
    """A finished (or cancelled) turn, what the cache holds after it, and the settings it ran with."""

    turn: Turn
    processed: list[int]
    settings: Settings


class Finished(Message):
    def __init__(self, done: Done):
        super().__init__()
        self.done = done
        self.turn = done.turn


class Rebuilt(Message):
    """A resumed conversation's cache is back: `tokens` ids prefilled in `seconds` (or `error`)."""

    def __init__(self, tokens: int, seconds: float, error: str | None = None):
        super().__init__()
        self.tokens = tokens
        self.seconds = seconds
        self.error = error


class ModelJobs:
    """The pair and the decode state every turn shares, and the jobs that use them on the MLX thread.

    `busy` is read and written on the UI thread only: True from a job's start until the UI has handled
    the message that ends it (`Loaded`, `Failed`, `Finished`, `Rebuilt`).
    """

    def __init__(self, post: Callable[[Message], object]):
        self.post = post
        self.pair = None
        self.state = DecodeState()  # touched only by jobs on the MLX thread, or while no job runs
        self.mlx = MLXThread()
        self.busy = False
        self.cancel_event = threading.Event()
        self.unsaved: Done | None = None  # a finished turn the UI has not queued for saving yet
        self.pacer = Pacer()
        self._progress_posted = 0.0  # pacer clock time of the last Progress posted
        self._progress_pending = False  # posted and not handled yet: the MLX thread does not pile more on

    # --- on the UI thread ------------------------------------------------------------

    def load(self, load: Callable[[], object], settings: GenerationSettings) -> None:
        """Load the pair, then have the verify cost `settings` need ready (`Measuring` says when it is timed)."""
        self.busy = True
        self.mlx.submit(lambda: self._load_job(load, settings))

    def turn(self, messages: list[dict], kwargs: dict, settings: Settings) -> None:
        """Generate the next answer; `settings` (frozen) is what the turn is saved with."""
        self.busy = True
        self.cancel_event = cancel = threading.Event()
        self.pacer.start()
        self._progress_pending, self._progress_posted = False, 0.0
        self.mlx.submit(lambda: self._turn_job(messages, kwargs, settings, cancel))

    def rebuild(self, processed: list[int], settings: Settings) -> None:
        """Prefill `processed` (a resumed chat's stored cache contents), so the next turn reuses them."""
        self.busy = True
        processed = list(processed)
        self.mlx.submit(lambda: self._rebuild_job(processed, settings))

    def cancel(self) -> bool:
        """Stop the answer being written after its current round; False if there is none to stop."""
        if self.cancel_event.is_set():
            return False
        self.cancel_event.set()
        return True

    def progress_shown(self) -> None:
        """A `Progress` is drawn: the MLX thread may post the next one when the pacer says so."""
        self._progress_pending = False
        self.pacer.updated()

    def forget(self) -> None:
        """An empty cache (no job runs)."""
        self.state = DecodeState()

    def close(self, timeout: float) -> bool:
        """Let the jobs queued finish; True if the MLX thread ended within `timeout`."""
        return self.mlx.close(timeout=timeout)

    # --- on the MLX thread -----------------------------------------------------------

    def _load_job(self, load: Callable[[], object], settings: GenerationSettings) -> None:
        try:
            pair = load()
            calibrate(pair, settings, lambda text: self.post(Measuring(text)))
        except Exception as e:
            self.post(Failed(describe_error(e), loading=True))
        else:
            self.post(Loaded(pair))

    def _turn_job(self, messages: list[dict], kwargs: dict, settings: Settings, cancel: threading.Event) -> None:
        try:
            turn = run_turn(
                self.pair,
                messages,
                state=self.state,
                cancel=cancel,
                on_progress=self._report,
                progress_interval=0.0,  # paced in _report
                **kwargs,
            )
        except Exception as e:
            self.state = DecodeState()  # the caches may be half updated
            self.post(Failed(describe_error(e), loading=False))
        else:
            done = Done(turn, list(self.state.processed), settings)
            self.unsaved = done
            self.post(Finished(done))

    def _report(self, text: str, stats: GenerationStats) -> None:
        """Post progress when the pacer says the UI is ready for more (the final text always arrives
        with `Finished`)."""
        if self._progress_pending or not self.pacer.due(self._progress_posted):
            return
        self._progress_pending = True
        self._progress_posted = self.pacer.clock()
        self.post(Progress(text, stats))

    def _rebuild_job(self, processed: list[int], settings: Settings) -> None:
        tic = time.perf_counter()
        try:
            self.state = DecodeState()
            n = rebuild_state(self.pair, processed, self.state, settings)
        except Exception as e:
            self.state = DecodeState()
            self.post(Rebuilt(0, 0.0, describe_error(e)))
        else:
            self.post(Rebuilt(n, time.perf_counter() - tic))
