"""How long a test waits for work before it calls it a hang.

A test run shares its CPU with whatever else the machine runs (another test run, a build, a training job),
and a wait sized to an idle machine fails on a busy one. So a test waits in proportion to the work it asked
for, with budgets far beyond what any machine needs: a wait exists only to turn a hang into a failure, and no
test asserts how fast anything ran.
"""

from __future__ import annotations

SETUP_S = 300.0  # the fixed part of one request: a first one's model warm-up and verify timing, a prefill
TOKEN_S = 5.0  # one generated token, its share of drafting and verifying included


def slow_machine_timeout(tokens: int = 0, requests: int = 1) -> float:
    """Seconds to wait for `requests` requests (one after another) of up to `tokens` generated tokens each."""
    return requests * (SETUP_S + tokens * TOKEN_S)
