"""Holding numba compiles back, so that a test of "answers through the fallback while the kernel
compiles" does not race the process compiling it."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["compiles_held"]


@contextlib.contextmanager
def compiles_held(kernel, cache: Path) -> Iterator[None]:
    """While inside, no process compiles ``kernel`` (a `formats.jit.Kernel`) into the numba cache
    folder ``cache``: the runtime's lock of that cache folder (what a compile helper takes) and of
    the kernel there (what a job takes) are held here. A process using ``cache`` keeps answering
    through the kernel's fallback until the block ends; then its helper goes on."""
    from dvidshards.runtime import kernels as rk

    before = os.environ.get("NUMBA_CACHE_DIR")
    os.environ["NUMBA_CACHE_DIR"] = str(cache)  # the lock names depend on it
    try:
        paths = [rk._lock_path(kernel), rk._kernel_lock_path(kernel)]
    finally:
        if before is None:
            del os.environ["NUMBA_CACHE_DIR"]
        else:
            os.environ["NUMBA_CACHE_DIR"] = before
    with contextlib.ExitStack() as stack:
        for p in paths:
            f = stack.enter_context(open(p, "a"))
            fcntl.flock(f, fcntl.LOCK_EX)
            stack.callback(fcntl.flock, f, fcntl.LOCK_UN)
        yield
