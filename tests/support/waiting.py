"""Waiting in tests for what the code signals, never for a fixed time.

A test that needs something to have happened in another thread or process (a release reaching a
scheduler, a file a job writes, a line it prints) waits for that condition. The deadline is a guard
against a hang, generous enough that a busy machine never reaches it: a test fails on a deadline
only when the condition never comes.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable

__all__ = ["HANG_SECONDS", "Lines", "wait_until"]

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


class Lines:
    """The stdout and stderr lines of a running process (``Popen(..., stdout=PIPE, stderr=PIPE,
    text=True)``), read by two threads as they come, so that a test can wait for the line that says
    the process is ready (``wait_for``) without a deadlock on a full pipe, then collect the rest
    once it ends (``finish``)."""

    def __init__(self, p: subprocess.Popen) -> None:
        self.p = p
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(f, lines), daemon=True)
                         for f, lines in ((p.stdout, self.out), (p.stderr, self.err))]
        for th in self._readers:
            th.start()

    @staticmethod
    def _read(f, lines: list[str]) -> None:
        for line in f:
            lines.append(line.rstrip("\n"))

    def wait_for(self, has: Callable[[str], bool], what: str, *, stream: str = "out") -> str:
        """The first line of ``stream`` ("out" or "err") for which ``has(line)``, once the process
        prints it; AssertionError naming ``what`` (and the process's stderr) if it ends first."""
        lines = self.out if stream == "out" else self.err

        def found() -> str | None:
            return next((ln for ln in list(lines) if has(ln)), None)

        def alive() -> bool:  # the process runs, or its last lines are still being read
            return self.p.poll() is None or any(th.is_alive() for th in self._readers)

        try:
            wait_until(lambda: found() is not None, what, alive=alive)
        except AssertionError as e:
            raise AssertionError(f"{e}; its stderr: {chr(10).join(self.err)[-2000:]}") from None
        line = found()
        assert line is not None
        return line

    def finish(self) -> tuple[int, str, str]:
        """Wait for the process to end (a hang guard only: HANG_SECONDS); its exit code, stdout and stderr."""
        code = self.p.wait(HANG_SECONDS)
        for th in self._readers:
            th.join(HANG_SECONDS)
        return code, "\n".join(self.out), "\n".join(self.err)
