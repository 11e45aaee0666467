"""Which process this is under `mlx.launch`, and taking rank 0's values: what a split target's callers need.

Kept apart from `distributed.py` (the split itself, which imports mlx-lm); what the launcher set in the
environment, asked before MLX is loaded, is `launcher.py`.
"""

from __future__ import annotations

import functools
import random
import socket

import mlx.core as mx

from .errors import GlimmerError
from .launcher import launch_rank

SPLIT_COMMANDS = ("generate", "serve", "chat")  # what runs split across processes; every other command refuses


@functools.cache
def world() -> mx.distributed.Group:
    """MLX's global group: every process `mlx.launch` started (a group of one without a launcher)."""
    return mx.distributed.init()


def split_group() -> mx.distributed.Group | None:
    """The group the target splits over; None in a single process (also under a launcher of one)."""
    if launch_rank() is None:
        return None
    group = world()
    return group if group.size() > 1 else None


def is_lead() -> bool:
    """Whether this process prints: rank 0, or the only process."""
    group = split_group()
    return group is None or group.rank() == 0


def check_split_command(command: str, extra: str | None = None) -> None:
    """Refuse a command that cannot run split: rank 0 says so in one error, the others leave silently. They
    leave with 0: a launcher (`mlx.launch`, mpirun) stops every process once one exits with an error, which
    could kill rank 0 before its line is written. `extra` names a setting of a splittable command that cannot
    (a torch backend)."""
    group = split_group()
    if group is None or (command in SPLIT_COMMANDS and extra is None):
        return
    if group.rank() != 0:
        raise SystemExit(0)
    what = f"{command} {extra}" if extra else command
    supported = ", ".join(f"`{c}`" for c in SPLIT_COMMANDS)
    raise GlimmerError(
        f"{what}: cannot run split across {group.size()} processes under mlx.launch; "
        f"supported there: {supported} on the MLX backend (run {command} as one process)"
    )


def from_rank_zero(values: mx.array, group: mx.distributed.Group) -> mx.array:
    """`values` as rank 0 holds them, on every process: one sum in which the others add zeros. Theirs are
    `values * 0`, not fresh zeros, so their own graph still runs (its layers' sums are the others' too)."""
    return mx.distributed.all_sum(values * int(group.rank() == 0), group=group)


def loopback_ports(count: int) -> int:
    """The first of `count` consecutive free ports on loopback: `mlx.launch --backend ring --starting-port` for
    `count` ranks on one machine (each rank listens on its own port). Tried at random, so runs started side by
    side rarely pick the same ones."""
    for _ in range(100):
        port = random.randrange(20000, 60000 - count)
        try:
            for p in range(port, port + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
    raise GlimmerError(f"no {count} consecutive free ports on loopback")
