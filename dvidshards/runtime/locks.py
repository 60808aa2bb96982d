"""One exclusive file lock between the processes of a host (``fcntl.flock``); without ``fcntl`` or
file-system locks a stand-in that holds nothing (callers then repeat work: slower, never wrong)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import IO, Any

__all__ = ["Held", "acquire", "try_acquire"]


class Held:
    """A lock held until `release` (or the ``with`` block's end); holds nothing without a file."""

    def __init__(self, f: IO[Any] | None = None) -> None:
        self._f = f

    def release(self) -> None:
        f, self._f = self._f, None
        if f is not None:
            f.close()  # closing the file drops its flock

    def __enter__(self) -> Held:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def acquire(path: str, *, timeout: float | None = None, until: Callable[[], bool] | None = None) -> Held:
    """An exclusive lock on the file ``path`` (made if absent), waiting for its holder; after
    ``timeout`` s (a stuck holder), or once ``until()`` is true (checked as it waits, with a
    ``timeout``), one that holds nothing: the caller goes on."""
    held = _lock(path, blocking=True, timeout=timeout, until=until)
    assert held is not None
    return held


def try_acquire(path: str) -> Held | None:
    """An exclusive lock on the file ``path`` (made if absent), or None when another holds it."""
    return _lock(path, blocking=False, timeout=None)


def _lock(path: str, blocking: bool, timeout: float | None, until: Callable[[], bool] | None = None) -> Held | None:
    try:
        import fcntl
        f = open(path, "a")  # held open until release()
    except (ImportError, OSError):
        return Held()
    end = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if blocking and end is None else fcntl.LOCK_NB))
            return Held(f)
        except BlockingIOError:
            if not blocking or end is None or time.monotonic() > end or (until is not None and until()):
                f.close()
                return None if not blocking else Held()
            time.sleep(0.05)
        except OSError:  # a file system without locks: go on without
            f.close()
            return Held()
