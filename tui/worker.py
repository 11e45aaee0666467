"""One thread for all MLX work (loading and generation), in submission order.

MLX streams and Metal command queues belong to the thread that made them, so
the app never touches the model from anywhere else.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable


class MLXThread:
    def __init__(self, name: str = "mlx"):
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        # A daemon, so quitting never waits for a model that is still loading.
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def close(self, timeout: float | None = None) -> bool:
        """Stop after the jobs already queued; True if the thread ended within `timeout`."""
        self._jobs.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()
