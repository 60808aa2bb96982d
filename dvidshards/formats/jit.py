"""Kernels that answer before numba has compiled them.

numba compiles a kernel on its first call: ~17 CPU s for the read path after a fresh install,
~0.5 s to load it from numba's cache in a new process. A `Kernel` pairs a dispatcher with a
fallback that needs no compile (a numpy version, or the kernel's own source interpreted:
`python_twins`); calls go to the fallback until the dispatcher is ready. When and where kernels
compile is the installed `Compiler`'s business (``dvidshards.runtime.kernels`` installs the
package's); with none, a kernel compiles in the caller's thread at its first call, as numba does.
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

    ``signatures`` are compiled ahead of the first compiled call; ``exclusive`` then refuses other
    signatures (numba converts writable and strided arrays to a compiled ``readonly``/``'A'`` one),
    so no call compiles in the caller's thread. ``fallback`` returns the same result, error codes
    included (the tests hold each pair to it); None (kernels off the read path): the first call
    compiles and waits. ``handled``: the installed compiler has it in hand, so calls answer through
    the fallback without asking again.
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
        """Compile now unless done (or the compiler or `fallbacks` says no): for callers about to give
        it more work than the fallback would finish before a compile."""
        if self._fast is None and self.failed is None and not _forced:
            _compiler.asked(self)

    def compile(self) -> None:
        """Compile (or load from numba's cache) every signature now, in this thread."""
        if self._fast is not None:
            return
        try:
            for sig in self.signatures:
                self.dispatcher.compile(sig)
            if self.exclusive:
                self.dispatcher.disable_compile()
        except Exception as e:  # numba cannot compile here: keep the fallback, say so once
            self.give_up(e)
            raise
        self._fast = self.dispatcher

    def give_up(self, e: Exception) -> None:
        """numba cannot compile this kernel in this process (``e`` says why): keep the fallback for
        good and say so once; a kernel without a fallback raises ``e``."""
        if self.fallback is None:
            raise e
        self.failed = e
        warnings.warn(f"numba could not compile {self.name} ({type(e).__name__}: {e}); "
                      "the slower fallback is used", RuntimeWarning, stacklevel=3)

    def __repr__(self) -> str:
        state = "compiled" if self.ready else "failed" if self.failed else "fallback"
        return f"<Kernel {self.name} ({state})>"


_forced = 0  # > 0 inside fallbacks()


@contextlib.contextmanager
def fallbacks() -> Iterator[None]:
    """Run every kernel's fallback while inside, compiled or not (process-wide; the tests' switch)."""
    global _forced
    _forced += 1
    try:
        yield
    finally:
        _forced -= 1


class Compiler:
    """When and where kernels are compiled; this default compiles at the first call, in the
    caller's thread, which waits."""

    def called(self, k: Kernel) -> bool:
        """``k`` was called before it was ready: True when it is ready now, False to answer through the
        fallback."""
        try:
            k.compile()
        except Exception:  # noqa: BLE001 - recorded on the kernel and warned about; the fallback answers
            return False
        return True

    def compile(self, k: Kernel) -> None:
        """Compile ``k`` now in this thread; its error passes through."""
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
        """Block until every kernel in hand is compiled; False on timeout."""
        return True

    def busy(self) -> dict[str, str]:
        """``{kernel name: 'queued' | 'compiling'}`` of the kernels in hand."""
        return {}


_compiler: Compiler = Compiler()


def install_compiler(compiler: Compiler) -> Compiler:
    """Make ``compiler`` decide for every kernel of this process; returns the one it replaces."""
    global _compiler
    old, _compiler = _compiler, compiler
    return old


def installed_compiler() -> Compiler:
    return _compiler


def wait(timeout: float | None = None) -> bool:
    """Block until every kernel called so far is compiled; False if ``timeout`` ran out first."""
    return _compiler.wait(timeout)


def compile_all() -> None:
    """Compile (or load) every kernel registered so far, in this thread."""
    for k in list(_KERNELS):
        if not k.ready and k.failed is None:
            _compiler.ensure(k)


def status() -> dict[str, str]:
    """``{kernel name: 'compiled' | 'queued' | 'compiling' | 'failed'}`` of the kernels called so far."""
    out = dict(_compiler.busy())
    for k in _KERNELS:
        if k.ready or k.failed:
            out[k.name] = "compiled" if k.ready else "failed"
    return out


_KERNELS: list[Kernel] = []


def kernel(dispatcher: Any, signatures: Sequence[Any], fallback: Callable[..., Any] | None,
           exclusive: bool = False) -> Kernel:
    """Register a `Kernel`."""
    k = Kernel(dispatcher, signatures, fallback, exclusive)
    _KERNELS.append(k)
    return k


def kernels() -> list[Kernel]:
    """Every kernel registered so far, in order."""
    return list(_KERNELS)


def python_twins(namespace: dict[str, Any], overrides: dict[str, Callable[..., Any]] | None = None
                 ) -> types.SimpleNamespace:
    """The numba kernels of a module (its ``globals()``) as plain Python functions calling each other:
    each ``py_func`` with a copy of the globals in which the other kernels are twins too, so a twin
    never compiles. Same source, integer types and results, slower per element, ready at once;
    ``overrides`` replace some kernels (byte readers, say) by faster Python with the same values."""
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
