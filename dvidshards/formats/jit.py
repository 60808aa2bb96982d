"""Kernels that answer before numba has compiled them.

numba compiles a kernel on its first call. For the read path that is ~17 CPU seconds after a
fresh install, and ~0.5 s even to load the compiled code from numba's cache in a new process.
A :class:`Kernel` pairs a numba dispatcher with a *fallback* that computes the same result
without compiling: a numpy version, or the kernel's own Python source run by the interpreter
(:func:`python_twins`). Until the dispatcher is ready, calls go to the fallback and a background
thread compiles (or loads from the cache) the kernels that have been called, in the order they
were first called; from then on calls go to the compiled code. A fresh process reads its first
chunk in well under a second, and a long job loses nothing: the fallback works while the
compiler runs on the other core.

``DVIDSHARDS_KERNELS`` chooses the behaviour, read at each first call:

* ``background`` (default): as above;
* ``compiled``: numba's own behaviour, compile on the first call and wait for it;
* ``fallback``: never compile (tests of the fallbacks, and platforms where numba cannot compile).

:func:`wait` blocks until every kernel called so far is compiled (benchmarks call it before
measuring steady-state speed).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = ["MODES", "Kernel", "compile_all", "fallbacks", "kernel", "mode", "python_twins", "status", "wait"]

MODES = ("background", "compiled", "fallback")
_ENV = "DVIDSHARDS_KERNELS"


def mode() -> str:
    """The kernel mode from ``DVIDSHARDS_KERNELS`` (``background`` when unset)."""
    m = os.environ.get(_ENV, "background").strip().lower() or "background"
    if m not in MODES:
        raise ValueError(f"{_ENV}={m!r}: expected one of {', '.join(MODES)}")
    return m


class Kernel:
    """A numba dispatcher that answers through ``fallback`` until it is compiled.

    ``signatures`` are compiled ahead of the first compiled call; with ``exclusive`` the
    dispatcher then refuses other signatures (numba converts writable and strided arrays to a
    compiled ``readonly``/``'A'`` signature), so no call ever compiles in the caller's thread.
    ``fallback`` takes the same arguments and returns the same result (bit for bit, error codes
    included): the tests hold each pair to that. Without one (``None``: kernels off the read
    path, such as the encoder), the first call compiles the signatures and waits, in any mode.
    """

    def __init__(self, dispatcher: Any, signatures: Sequence[Any], fallback: Callable[..., Any] | None,
                 exclusive: bool = False):
        self.dispatcher = dispatcher
        self.signatures = tuple(signatures)
        self.fallback = fallback
        self.exclusive = exclusive
        self.name = f"{dispatcher.py_func.__module__}.{dispatcher.py_func.__qualname__}"
        self.failed: BaseException | None = None
        self._fast: Callable[..., Any] | None = None
        self._queued = False

    @property
    def ready(self) -> bool:
        """True once calls run the compiled code."""
        return self._fast is not None

    def __call__(self, *args: Any) -> Any:
        fast = self._fast
        if fast is not None and not _forced:
            return fast(*args)
        if self.fallback is None:  # nothing else can answer: compile once, for every thread
            self.compile()
            return self.dispatcher(*args)
        if _forced:
            return self.fallback(*args)
        m = mode()
        if m == "compiled" and self.failed is None:
            try:
                self.compile()
            except Exception:
                return self.fallback(*args)  # warned about once, by compile()
            return self(*args)
        if m == "background" and not self._queued:
            _queue(self)
        return self.fallback(*args)

    def ensure(self) -> None:
        """Compile now, in this thread, unless already done (or the mode or ``fallbacks()`` says no).

        For callers about to give the kernel enough work that the fallback would take longer
        than the compile (the IPC resolver on a shard of many thousand records).
        """
        if self._fast is None and self.failed is None and not _forced and mode() != "fallback":
            try:
                self.compile()
            except Exception:
                pass  # warned about once, by compile(); the fallback answers

    def compile(self) -> None:
        """Compile (or load from numba's cache) every signature now, in this thread."""
        with _COMPILE:
            if self._fast is not None:
                return
            try:
                for sig in self.signatures:
                    self.dispatcher.compile(sig)
                if self.exclusive:
                    self.dispatcher.disable_compile()
            except Exception as e:  # numba cannot compile here: keep the fallback, say so once
                if self.fallback is None:
                    raise
                self.failed = e
                warnings.warn(f"numba could not compile {self.name} ({type(e).__name__}: {e}); "
                              "the slower fallback is used", RuntimeWarning, stacklevel=2)
                raise
            self._fast = self.dispatcher

    def __repr__(self) -> str:
        state = "compiled" if self.ready else "failed" if self.failed else "fallback"
        return f"<Kernel {self.name} ({state})>"


_forced = 0  # > 0 inside fallbacks()


@contextlib.contextmanager
def fallbacks() -> Iterator[None]:
    """Run the fallbacks of every kernel while inside, compiled or not (the tests hold each
    fallback to its kernel through the whole read path with it). Process-wide."""
    global _forced
    _forced += 1
    try:
        yield
    finally:
        _forced -= 1


# --- the background compiler ---------------------------------------------------------------------

_COMPILE = threading.RLock()  # one compile at a time (numba has its own lock too)
_STATE = threading.Condition()
_pending: list[Kernel] = []
_worker: threading.Thread | None = None
_stopping = False
_current: Kernel | None = None


def _queue(k: Kernel) -> None:
    global _worker
    with _STATE:
        if k._queued or _stopping:
            return
        k._queued = True
        _pending.append(k)
        if _worker is None:
            _worker = threading.Thread(target=_run, name="dvidshards-kernels", daemon=True)
            _worker.start()
        _STATE.notify_all()


def _run() -> None:
    global _current, _worker
    try:  # Linux: a low CPU priority for this thread alone, so it yields to the work it speeds up
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass
    while True:
        with _STATE:
            if _stopping or not _pending:
                _current = None
                _worker = None
                _STATE.notify_all()
                return
            _current = _pending.pop(0)
            k = _current
        try:
            k.compile()
        except Exception:
            pass  # recorded on the kernel and warned about; the fallback stays in use
        with _STATE:
            _current = None
            _STATE.notify_all()


def wait(timeout: float | None = None) -> bool:
    """Block until every kernel called so far is compiled; False if ``timeout`` ran out first."""
    with _STATE:
        return _STATE.wait_for(lambda: not _pending and _current is None, timeout)


def compile_all() -> None:
    """Compile (or load from the cache) every kernel registered so far, in this thread."""
    for k in list(_KERNELS):
        if not k.ready and k.failed is None:
            try:
                k.compile()
            except Exception:
                pass  # warned about by compile(); the fallback stays in use


def status() -> dict[str, str]:
    """``{kernel name: 'compiled' | 'queued' | 'compiling' | 'failed'}`` for the kernels called so far."""
    with _STATE:
        out = {k.name: "queued" for k in _pending}
        if _current is not None:
            out[_current.name] = "compiling"
    for k in _KERNELS:
        if k.ready or k.failed:
            out[k.name] = "compiled" if k.ready else "failed"
    return out


def _stop() -> None:
    # At exit: start no further compile, and let the one running finish (its cache entry is
    # written whole); tearing LLVM down under a compiling thread can crash the exit.
    global _stopping
    with _STATE:
        _stopping = True
        _pending.clear()
        t = _worker
    if t is not None and t is not threading.current_thread():
        t.join(timeout=120)


def _after_fork() -> None:  # a forked child has no compiler thread: start over
    global _COMPILE, _STATE, _worker, _current, _stopping
    _COMPILE = threading.RLock()
    _STATE = threading.Condition()
    _worker = _current = None
    _stopping = False
    for k in _KERNELS + _pending:  # the parent's compile in flight does not exist here
        if not k.ready:
            k._queued = False
    _pending.clear()


atexit.register(_stop)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)

_KERNELS: list[Kernel] = []


def kernel(dispatcher: Any, signatures: Sequence[Any], fallback: Callable[..., Any] | None,
           exclusive: bool = False) -> Kernel:
    """Register a :class:`Kernel` (see there)."""
    k = Kernel(dispatcher, signatures, fallback, exclusive)
    _KERNELS.append(k)
    return k


# --- fallbacks from the kernels' own source ------------------------------------------------------


def python_twins(namespace: dict[str, Any], overrides: dict[str, Callable[..., Any]] | None = None
                 ) -> types.SimpleNamespace:
    """The numba kernels of a module as plain Python functions that call each other.

    Every dispatcher in ``namespace`` (a module's ``globals()``) gets a twin: its
    ``py_func`` with a copy of the module globals in which the other kernels are twins too, so
    a twin never triggers a compile. Same source, same integer types (numpy scalars), same
    results and error codes: slower per element (interpreted), but ready at once.
    ``overrides`` replace some kernels (byte readers, say) by faster Python that returns the
    same values.
    """
    from numba.core.registry import CPUDispatcher

    scope = dict(namespace)
    twins: dict[str, Any] = {}
    for name, obj in namespace.items():
        if isinstance(obj, CPUDispatcher):
            f = obj.py_func
            twins[name] = types.FunctionType(f.__code__, scope, f.__name__, f.__defaults__, f.__closure__)
    twins.update(overrides or {})
    scope.update(twins)
    return types.SimpleNamespace(**twins)
