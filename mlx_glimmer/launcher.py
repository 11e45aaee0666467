"""What a launcher (`mlx.launch`, mpirun) told this process in its environment: read without importing MLX, so
the command line can ask before it loads anything heavy (and before its BLAS re-exec, `blas.py`)."""

from __future__ import annotations

import os
import time

# Where a process learns its rank from the launcher, before MLX is imported: `mlx.launch` (ring, JACCL) sets
# MLX_RANK; mpirun sets the MPI ones.
RANK_ENV = ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
# How long a rank other than 0 holds back its error. Every rank gets the same command line, so a wrong flag fails
# on all of them at about the same moment; the launcher stops the others once one exits with an error, so the
# lead's line comes alone if the others wait. Seconds, generous for a loaded machine; paid only on an error.
FOLLOWER_ERROR_WAIT = 5.0


def launch_rank() -> int | None:
    """This process's rank as the launcher set it in the environment; None outside a launcher. Read without
    starting MLX's distributed backend, which must not start before the command re-executes itself
    (`blas.py`): the other processes would have connected to the process that is gone."""
    for name in RANK_ENV:
        value = os.environ.get(name)
        if value is not None and value.strip().isdigit():
            return int(value)
    return None


def error_prefix() -> str:
    """What goes before this process's `error:` text: nothing in rank 0 or a single process. Another rank of a
    launcher first waits FOLLOWER_ERROR_WAIT (rank 0, failing the same way, speaks and the launcher stops this
    one), then names itself: an error only it meets (a file missing on its host) is still said."""
    rank = launch_rank()
    if not rank:
        return ""
    time.sleep(FOLLOWER_ERROR_WAIT)
    return f"rank {rank}: "
