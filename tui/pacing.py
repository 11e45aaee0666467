"""How often the app redraws a streaming answer.

The UI thread and the MLX thread share the GIL, so every redraw is time the
decoder waits. `Pacer` spaces updates so that the UI thread's own CPU time
(Textual's layout and rendering of the last update included) stays near a
fixed share of the wall time: a cheap screen updates up to 30 times a second,
a heavy one (a long answer with many Markdown blocks) less often.
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
