"""A fork after TensorStore started its threads: a warning in the parent, an error in the child.

A process forked from one running TensorStore's thread pools (``os.fork``, multiprocessing's
``fork`` start method) cannot use TensorStore: it aborts the child at its first call ("fork()
use detected"), and ``pool.apply`` then waits forever. With this module imported, the parent
warns once naming the fix (the ``spawn`` start method), and in the child TensorStore's entry
points raise `ForkError`, so the task fails in the parent and the child stays usable for work
without TensorStore. "Started": a TensorStore pool thread runs (Linux:
``/proc/self/task/*/comm``) or ran; a fork after ``import tensorstore`` alone is fine.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from typing import Any

from ..errors import ForkError

__all__ = ["ForkError", "tensorstore_started"]

SPAWN = ("start worker processes with the 'spawn' start method: multiprocessing.get_context('spawn').Pool(...), "
         "or concurrent.futures.ProcessPoolExecutor(mp_context=multiprocessing.get_context('spawn'))")


_started = False  # a TensorStore thread was seen in this process
_forking = False  # set in the parent just before a fork after TensorStore started
_warned = False
_forked = False  # this process is such a child


def tensorstore_started() -> bool:
    """Whether TensorStore has started its threads in this process (False where it cannot tell)."""
    global _started
    if _started:
        return True
    if "tensorstore" not in sys.modules:
        return False
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return False
    for t in tasks:
        with contextlib.suppress(OSError):
            with open(f"/proc/self/task/{t}/comm", "rb") as f:
                if f.read().startswith(b"ts_"):
                    _started = True
                    return True
    return False


def _message() -> str:
    return ("this process was forked (os.fork, or multiprocessing's 'fork' start method) from one in which "
            "TensorStore had started its threads; TensorStore cannot run here and would abort the process. "
            f"To read with dvidshards in worker processes, {SPAWN}")


def _before() -> None:
    global _forking, _warned
    _forking = tensorstore_started()
    if _forking and not _warned:
        _warned = True
        warnings.warn(f"dvidshards: fork after TensorStore started its threads: TensorStore cannot run in the "
                      f"child (dvidshards raises ForkError there when it is used); {SPAWN}", RuntimeWarning,
                      stacklevel=2)


def _after_in_parent() -> None:
    global _forking
    _forking = False


def _after_in_child() -> None:
    global _forking, _forked
    if _forking:
        _forking = False
        _forked = True
        _refuse_tensorstore()


def _refuse(*args: Any, **kwargs: Any) -> Any:
    raise ForkError(_message())


# the calls that start work on TensorStore's threads (indexing, specs and schemas do not)
_METHODS = {
    "TensorStore": ("read", "write", "resize", "resolve", "storage_statistics", "__array__", "__setitem__"),
    "KvStore": ("read", "write", "list", "delete_range", "experimental_copy_range_to", "__getitem__",
                "__setitem__", "__delitem__"),
    "Future": ("result", "exception", "force", "add_done_callback", "__await__"),
    "Transaction": ("commit_async", "commit_sync"),
    "Batch": ("submit",),
}
_FUNCTIONS = ("open", "virtual_chunked")


def _refuse_tensorstore() -> None:
    ts = sys.modules.get("tensorstore")
    if ts is None:
        return
    for cls_name, names in _METHODS.items():
        cls = getattr(ts, cls_name, None)
        for name in names:
            if cls is not None and name in vars(cls):
                with contextlib.suppress(AttributeError, TypeError):
                    setattr(cls, name, _refuse)
    for name in _FUNCTIONS:
        if hasattr(ts, name):
            with contextlib.suppress(AttributeError, TypeError):
                setattr(ts, name, _refuse)
    kv = getattr(ts, "KvStore", None)
    if kv is not None and "open" in vars(kv):
        with contextlib.suppress(AttributeError, TypeError):
            kv.open = staticmethod(_refuse)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before, after_in_parent=_after_in_parent, after_in_child=_after_in_child)
