"""How often the app redraws a streaming answer.

The UI thread and the MLX thread share the GIL, so every redraw is time the
decoder waits. `Pacer` spaces updates so that the UI thread's own CPU time
(Textual's layout and rendering of the last update included) stays near a
fixed share of the wall time: a cheap screen updates as often as `fastest`
allows, a heavy one (a long answer with many Markdown blocks) less often.
What the app's decode speed comes to against `generate`:
benchmarks/chat_stream_speed.py, results in benchmarks/results/chat_stream_speed_*.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Pacer:
    share: float = 0.05  # the UI thread's target share of the time while an answer streams
    fastest: float = 1 / 30  # seconds between updates, at least
    slowest: float = 0.5  # and at most
    interval: float = 0.1
    cpu: Callable[[], float] = time.thread_time  # CPU time of the calling (UI) thread
    clock: Callable[[], float] = time.perf_counter
    _mark: tuple[float, float] | None = field(default=None, repr=False)

    def start(self) -> None:
        """A new answer: measure from here (call on the UI thread)."""
        self._mark = (self.cpu(), self.clock())

    def updated(self) -> float:
        """Call on the UI thread at each update; returns the interval to wait before the next one."""
        cpu, now = self.cpu(), self.clock()
        if self._mark is not None:
            spent = cpu - self._mark[0]  # drawing the last update, and the UI's other work since
            # Smoothed, so one slow frame does not stall the stream.
            wanted = spent / self.share
            self.interval = min(self.slowest, max(self.fastest, 0.5 * self.interval + 0.5 * wanted))
        self._mark = (cpu, now)
        return self.interval

    def due(self, last: float, now: float | None = None) -> bool:
        """Whether an update posted at `last` (clock time) is far enough back (any thread)."""
        return (self.clock() if now is None else now) - last >= self.interval


def leave_a_core_for_the_ui() -> int | None:
    """On Linux with OpenBLAS doing the matmuls, run it on all cores but one.

    With BLAS threads on every core, the UI thread's few percent of CPU preempts a
    BLAS worker and the whole matmul waits for it; with one core left free the app
    decodes closer to `generate`'s speed (benchmarks/chat_stream_speed.py measures
    both ways; the figures are in benchmarks/README.md, "The chat app").
    Leaves an explicit OPENBLAS_NUM_THREADS / OMP_NUM_THREADS alone; returns the
    thread count set, or None.
    """
    import ctypes
    import os
    import sys

    if sys.platform != "linux" or "OPENBLAS_NUM_THREADS" in os.environ or "OMP_NUM_THREADS" in os.environ:
        return None
    try:
        set_threads = ctypes.CDLL(None).openblas_set_num_threads
    except (OSError, AttributeError):  # MLX's own BLAS, or another library
        return None
    threads = max(1, (os.cpu_count() or 1) - 1)
    set_threads(threads)
    return threads
