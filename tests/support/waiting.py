"""Waiting in tests for what the code signals, never for a fixed time.

A test that needs something to have happened in another thread or process (a release reaching a
scheduler, a file a job writes, a line it prints) waits for that condition. The deadline is a guard
against a hang, generous enough that a busy machine never reaches it: a test fails on a deadline
only when the condition never comes.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["HANG_SECONDS", "wait_until"]

#: the deadline of a wait: only a hang reaches it, however loaded the machine
HANG_SECONDS = 300.0


def wait_until(condition: Callable[[], object], what: str, *, timeout: float = HANG_SECONDS,
               alive: Callable[[], bool] | None = None) -> None:
    """Return once ``condition()`` is true; AssertionError naming ``what`` if ``alive()`` turns false
    first (the process that was to bring it about ended) or after ``timeout`` seconds (a hang)."""
    deadline = time.monotonic() + timeout
    pause = 0.001
    while not condition():
        if alive is not None and not alive():
            if condition():  # it came about just before the end
                return
            raise AssertionError(f"it ended before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout:g} s: a hang")
        time.sleep(pause)
        pause = min(0.05, pause * 2)
