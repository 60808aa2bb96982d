"""Kernels that answer before numba has compiled them.

numba compiles a kernel on its first call. For the read path that is ~17 CPU seconds after a
fresh install, and ~0.5 s even to load the compiled code from numba's cache in a new process.
A :class:`Kernel` pairs a numba dispatcher with a *fallback* that computes the same result
without compiling: a numpy version, or the kernel's own Python source run by the interpreter
(:func:`python_twins`). Until the dispatcher is ready, calls may go to the fallback; from then on
calls go to the compiled code.

This module holds the pure part: the kernel object, its registry and the fallbacks. *When and
where* a kernel is compiled is the business of a :class:`Compiler`, installed with
:func:`install_compiler`. ``dvidshards.runtime.kernels`` installs the one the package uses when
``dvidshards`` is imported (kernels compiled behind the caller for notebooks, at normal priority
once per node for jobs; its ``DVIDSHARDS_KERNELS`` chooses). With none installed, a kernel is
compiled in the caller's thread at its first call and the call waits for it (numba's own
behaviour): no thread, no process, no lock of ours (numba holds its own while it compiles).

:func:`wait` blocks until every kernel called so far is compiled (benchmarks call it before
measuring steady-state speed); :func:`status` says where each is.
"""

from __future__ import annotations

import contextlib
import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = ["Compiler", "Kernel", "compile_all", "fallbacks", "install_compiler", "installed_compiler", "kernel",
           "kernels", "python_twins", "status", "wait"]


class Kernel:
    """A numba dispatcher that answers through ``fallback`` until it is compiled.

    ``signatures`` are compiled ahead of the first compiled call; with ``exclusive`` the
    dispatcher then refuses other signatures (numba converts writable and strided arrays to a
    compiled ``readonly``/``'A'`` signature), so no call ever compiles in the caller's thread.
    ``fallback`` takes the same arguments and returns the same result (bit for bit, error codes
    included): the tests hold each pair to that. Without one (``None``: kernels off the read
    path), the first call compiles the signatures and waits, in any mode.

    ``handled`` is the installed compiler's mark: it has this kernel in hand (queued, with a
    helper, or waiting for another process), so further calls answer through the fallback
    without asking it again.
    """

    def __init__(self, dispatcher: Any, signatures: Sequence[Any], fallback: Callable[..., Any] | None,
                 exclusive: bool = False):
        self.dispatcher = dispatcher
        self.signatures = tuple(signatures)
        self.fallback = fallback
        self.exclusive = exclusive
        self.name = f"{dispatcher.py_func.__module__}.{dispatcher.py_func.__qualname__}"
        self.failed: BaseException | None = None
        self.handled = False
        self._fast: Callable[..., Any] | None = None

    @property
    def ready(self) -> bool:
        """True once calls run the compiled code."""
        return self._fast is not None

    def __call__(self, *args: Any) -> Any:
        fast = self._fast
        if fast is not None and not _forced:
            return fast(*args)
        if self.fallback is None:  # nothing else can answer: compile once, for every thread
            _compiler.compile(self)
            return self.dispatcher(*args)
        if not _forced and self.failed is None and _compiler.called(self):
            fast = self._fast
            if fast is not None:
                return fast(*args)
        return self.fallback(*args)

    def ensure(self) -> None:
        """Compile now, unless already done (or the installed compiler or ``fallbacks()`` says no).

        For callers about to give the kernel enough work that the fallback would take longer
        than the compile (the IPC resolver on a shard of many thousand records). The installed
        compiler may wait for another process that is compiling it.
        """
        if self._fast is None and self.failed is None and not _forced:
            _compiler.asked(self)

    def compile(self) -> None:
        """Compile (or load from numba's cache) every signature now, in this thread (the
        installed compiler decides whether other threads wait meanwhile)."""
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


# --- the compiler hook -----------------------------------------------------------------------------


class Compiler:
    """When and where kernels are compiled. This base class is the default: at the first call,
    in the caller's thread, and the call waits. ``dvidshards.runtime.kernels`` installs its own."""

    def called(self, k: Kernel) -> bool:
        """``k`` was called before it was ready (and not inside ``fallbacks()``, nor failed).
        Return True when it is ready now (the call runs the compiled code); False to answer
        through the fallback."""
        try:
            k.compile()
        except Exception:  # noqa: BLE001 - recorded on the kernel and warned about; the fallback answers
            return False
        return True

    def compile(self, k: Kernel) -> None:
        """Compile ``k`` now in this thread; its error passes through (a kernel without fallback)."""
        k.compile()

    def ensure(self, k: Kernel) -> None:
        """Compile (or load) ``k`` now in this thread; failures stay on ``k.failed``."""
        try:
            k.compile()
        except Exception:  # noqa: BLE001 - warned about by compile(); the fallback stays in use
            pass

    def asked(self, k: Kernel) -> None:
        """A caller with much work for ``k`` wants it compiled now (`Kernel.ensure`)."""
        self.ensure(k)

    def wait(self, timeout: float | None) -> bool:
        """Block until every kernel this compiler has in hand is compiled; False on timeout."""
        return True

    def busy(self) -> dict[str, str]:
        """``{kernel name: 'queued' | 'compiling'}`` for the kernels in hand."""
        return {}


_compiler: Compiler = Compiler()


def install_compiler(compiler: Compiler) -> Compiler:
    """Make ``compiler`` decide for every kernel of this process; returns the one it replaces."""
    global _compiler
    old, _compiler = _compiler, compiler
    return old


def installed_compiler() -> Compiler:
    """The compiler in use."""
    return _compiler


def wait(timeout: float | None = None) -> bool:
    """Block until every kernel called so far is compiled; False if ``timeout`` ran out first."""
    return _compiler.wait(timeout)


def compile_all() -> None:
    """Compile (or load from the cache) every kernel registered so far, in this thread."""
    for k in list(_KERNELS):
        if not k.ready and k.failed is None:
            _compiler.ensure(k)


def status() -> dict[str, str]:
    """``{kernel name: 'compiled' | 'queued' | 'compiling' | 'failed'}`` for the kernels called so far."""
    out = dict(_compiler.busy())
    for k in _KERNELS:
        if k.ready or k.failed:
            out[k.name] = "compiled" if k.ready else "failed"
    return out


# --- the registry ----------------------------------------------------------------------------------

_KERNELS: list[Kernel] = []


def kernel(dispatcher: Any, signatures: Sequence[Any], fallback: Callable[..., Any] | None,
           exclusive: bool = False) -> Kernel:
    """Register a :class:`Kernel` (see there)."""
    k = Kernel(dispatcher, signatures, fallback, exclusive)
    _KERNELS.append(k)
    return k


def kernels() -> list[Kernel]:
    """Every kernel registered so far (by the modules imported so far), in order."""
    return list(_KERNELS)


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
