"""Kernels that answer before numba has compiled them.

numba compiles a kernel on its first call. For the read path that is ~17 CPU seconds after a
fresh install, and ~0.5 s even to load the compiled code from numba's cache in a new process.
A :class:`Kernel` pairs a numba dispatcher with a *fallback* that computes the same result
without compiling: a numpy version, or the kernel's own Python source run by the interpreter
(:func:`python_twins`). Until the dispatcher is ready, calls go to the fallback, and the kernels
that have been called are made ready behind the caller, in the order they were first called;
from then on calls go to the compiled code. A fresh process reads its first chunk in well under
a second, and a long job loses nothing: the fallback works while the compiler runs on the other
core.

Where the compiling happens: a kernel already in numba's on-disk cache is loaded by a
background thread of this process. A kernel missing from the cache is compiled by a *helper
process* (one per process that needs it, at low CPU priority, one compile at a time per cache
folder across processes), which writes numba's cache; the background thread then loads it from
there. So a process never has a compile running inside it when its work is done: it exits at
once, and the helper finishes the kernels it was asked for, leaving the cache whole for the next
process (numba writes each cache file to a temporary name and renames it, so a file is never
seen half written). Kernels numba cannot cache (``cache=False``, or defined where a new process
cannot import them) are compiled by the background thread itself, as is everything when the
helper cannot be started; a process exiting during such a compile waits for it.

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
import hashlib
import importlib
import json
import os
import subprocess
import sys
import tempfile
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
    path), the first call compiles the signatures and waits, in any mode.
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
        self._awaiting = False  # sent to the helper process, not answered yet
        self._helped = False  # the helper has answered: compile (load) it here

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
            _await_helper(self)  # compiling it here as well would only take the helper's core
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
_pending: list[Kernel] = []  # called, waiting for the background thread
_sent: dict[str, tuple[Kernel, subprocess.Popen]] = {}  # with a helper process, by name
_worker: threading.Thread | None = None
_stopping = False
_current: Kernel | None = None  # the kernel the background thread is handling
_here = False  # the background thread is inside numba in this process (a compile or a cache load)
_helper: subprocess.Popen | None = None
_helper_starts = 0
_helper_broken = False  # it could not be started, died, or was started too often: compile here
_inherited: list[subprocess.Popen] = []  # a forked child keeps its parent's helper pipes open, unused
_HELPER_ENV = "_DVIDSHARDS_KERNEL_HELPER"  # set in a helper: it starts no helper of its own
_HELPER_WAIT = 600.0  # ensure() waits this long for the helper, then compiles itself
_HELPER_IDLE = 60.0  # a helper with nothing to do for this long exits (a new one starts when needed)
_HELPER_STARTS = 8  # helpers per process at most
_HELPER_CODE = ("import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
                "from dvidshards.formats.jit import _helper_main; _helper_main(float(sys.argv[2]))")


def _queue(k: Kernel) -> None:
    with _STATE:
        if k._queued or _stopping:
            return
        k._queued = True
        _pending.append(k)
        _start_worker()
        _STATE.notify_all()


def _start_worker() -> None:  # under _STATE
    global _worker
    if _worker is None:
        _worker = threading.Thread(target=_run, name="dvidshards-kernels", daemon=True)
        _worker.start()


def _run() -> None:
    global _current, _worker, _here
    try:  # Linux: a low CPU priority for this thread alone, so it yields to the work it speeds up
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass
    while True:
        with _STATE:
            while not _stopping and not _pending and _sent:  # the helper's answers come back here
                _STATE.wait()
            if _stopping or not _pending:
                _current = None
                _worker = None
                _STATE.notify_all()
                return
            k = _current = _pending.pop(0)
            _here = True  # the cache look-up below starts numba's code generator
        if k.ready or k.failed is not None or not _send_to_helper(k):
            try:
                k.compile()  # a load from the cache when the helper compiled it
            except Exception:
                pass  # recorded on the kernel and warned about; the fallback stays in use
        with _STATE:
            _here = False
            _current = None
            _STATE.notify_all()


def _cacheable(k: Kernel) -> bool:
    """Whether a new process can compile ``k`` into numba's cache (a registered kernel with
    ``cache=True``, defined at the top of an importable module)."""
    f = k.dispatcher.py_func
    if k not in _KERNELS or "<" in f.__qualname__ or f.__module__ in (None, "__main__"):
        return False
    try:
        from numba.core.caching import NullCache
        return not isinstance(k.dispatcher._cache, NullCache)
    except Exception:  # another numba: do not guess
        return False


def _in_cache(k: Kernel) -> bool:
    """Whether numba's on-disk cache holds every signature of ``k`` for this machine (numba's
    own index and keys: a load then needs no compile). False when it cannot tell."""
    d = k.dispatcher
    try:
        cache = d._cache
        codegen = d.targetctx.codegen()
        index = cache._cache_file._load_index()  # {} when the source or numba changed
        return all(cache._index_key(sig, codegen) in index for sig in k.signatures)
    except Exception:
        return False


def _send_to_helper(k: Kernel) -> bool:
    """Ask a helper process to compile ``k`` into numba's cache (True), or say to compile it here."""
    global _helper, _helper_broken, _helper_starts
    if k._helped or os.environ.get(_HELPER_ENV) or not _cacheable(k) or _in_cache(k):
        return False
    with _STATE:
        if _helper_broken or _stopping:
            return False
        proc = _helper
        if proc is None:
            if _helper_starts >= _HELPER_STARTS:
                _helper_broken = True
                return False
            _helper_starts += 1
            try:
                proc = _helper = _start_helper()
            except (OSError, ValueError):
                _helper_broken = True
                return False
        k._awaiting = True  # registered first: the answer can come before write() returns
        _sent[k.name] = (k, proc)
    try:
        assert proc.stdin is not None
        proc.stdin.write(k.name + "\n")
        proc.stdin.flush()
    except (OSError, ValueError):  # it has just exited (idle) or died: send again to a new one
        with _STATE:
            if _helper is proc:
                _helper = None
            if _sent.get(k.name, (None, None))[1] is proc:
                del _sent[k.name]
                k._awaiting = False
                _pending.insert(0, k)
        return True
    return True


def _start_helper() -> subprocess.Popen:  # under _STATE
    if not sys.executable:
        raise OSError("no Python executable to start a helper process with")
    env = dict(os.environ, **{_HELPER_ENV: "1"})
    proc = subprocess.Popen([sys.executable, "-c", _HELPER_CODE, json.dumps(sys.path), str(_HELPER_IDLE)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env=env, text=True, close_fds=True)
    threading.Thread(target=_listen, args=(proc,), name="dvidshards-kernel-helper", daemon=True).start()
    return proc


def _listen(proc: subprocess.Popen) -> None:
    """Read a helper's answers: one kernel name a line, once it is in numba's cache or once it
    failed there (either way this process compiles it next, which loads it or says why not)."""
    global _helper, _helper_broken
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            with _STATE:
                _answered(line.strip(), proc)
    except (OSError, ValueError):
        pass
    try:  # it has closed its end: it is exiting (idle, or its work is done) or it died
        code = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        code = None
    with _STATE:
        if _helper is proc:
            _helper = None
        if code != 0:  # killed or crashed: compile here from now on
            _helper_broken = True
        for name in [n for n, (_, p) in _sent.items() if p is proc]:
            _answered(name, proc, compiled=False)


def _answered(name: str, proc: subprocess.Popen, compiled: bool = True) -> None:  # under _STATE
    k, p = _sent.get(name, (None, None))
    if k is None or p is not proc:
        return
    del _sent[name]
    k._awaiting = False
    k._helped = compiled or _helper_broken  # not compiled: to the next helper, if there is one
    if not _stopping:
        _pending.append(k)
        _start_worker()
    _STATE.notify_all()


def _await_helper(k: Kernel, timeout: float = _HELPER_WAIT) -> None:
    with _STATE:
        _STATE.wait_for(lambda: not k._awaiting, timeout)


def _helper_main(idle: float = _HELPER_IDLE) -> None:
    """The helper process: compile each kernel named on stdin into numba's cache, in order, and
    write its name back. It goes on after its parent has exited until it has compiled every
    kernel it was sent (end of stdin); it exits after ``idle`` seconds without work."""
    import select

    try:
        os.nice(10)
    except (AttributeError, OSError):
        pass
    fd, buf, answer = sys.stdin.fileno(), b"", True
    while True:
        while b"\n" not in buf:
            try:
                ready = select.select([fd], [], [], idle)[0]
            except (OSError, ValueError):  # no select on this pipe: read without the idle limit
                ready = [fd]
            data = os.read(fd, 4096) if ready else b""
            if not data:  # idle, or the parent has closed its end with everything sent
                if not answer:
                    with contextlib.suppress(OSError, ValueError):
                        sys.stdout = None  # type: ignore[assignment]  # no flush of a closed pipe at exit
                return
            buf += data
        line, _, buf = buf.partition(b"\n")
        name = line.decode().strip()
        if not name:
            continue
        try:
            k = _registered(name)
            with _cache_lock(k):  # helpers of other processes: one compiles, the others load
                k.compile()
        except Exception:
            pass  # the parent compiles it itself and reports what went wrong
        if answer:
            try:
                sys.stdout.write(name + "\n")
                sys.stdout.flush()
            except (OSError, ValueError):
                answer = False  # the parent has exited: finish the cache for the next process


def _registered(name: str) -> Kernel:
    importlib.import_module(name.rpartition(".")[0])
    for k in _KERNELS:
        if k.name == name:
            return k
    raise LookupError(f"no kernel {name} registered")


def _lock_path(k: Kernel) -> str:
    """The lock file of the numba cache folder ``k`` is written to (numba picks the folder from
    ``NUMBA_CACHE_DIR`` and the source file's folder: so does this)."""
    source = os.path.dirname(os.path.abspath(k.dispatcher.py_func.__code__.co_filename))
    tag = hashlib.sha1(f"{os.environ.get('NUMBA_CACHE_DIR', '')}|{source}".encode()).hexdigest()[:16]
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return os.path.join(tempfile.gettempdir(), f"dvidshards-numba-{uid}-{tag}.lock")


@contextlib.contextmanager
def _cache_lock(k: Kernel) -> Iterator[None]:
    """An exclusive lock per numba cache folder, across processes (none where flock is missing)."""
    try:
        import fcntl
        f = open(_lock_path(k), "a")
    except (ImportError, OSError):
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def wait(timeout: float | None = None) -> bool:
    """Block until every kernel called so far is compiled; False if ``timeout`` ran out first."""
    with _STATE:
        return _STATE.wait_for(lambda: not _pending and not _sent and _current is None, timeout)


def compile_all() -> None:
    """Compile (or load from the cache) every kernel registered so far, in this thread."""
    for k in list(_KERNELS):
        if not k.ready and k.failed is None:
            _await_helper(k)
            try:
                k.compile()
            except Exception:
                pass  # warned about by compile(); the fallback stays in use


def status() -> dict[str, str]:
    """``{kernel name: 'compiled' | 'queued' | 'compiling' | 'failed'}`` for the kernels called so far."""
    with _STATE:
        out = {k.name: "queued" for k in _pending}
        out.update({name: "compiling" for name in _sent})
        if _current is not None:
            out[_current.name] = "compiling"
    for k in _KERNELS:
        if k.ready or k.failed:
            out[k.name] = "compiled" if k.ready else "failed"
    return out


def _stop() -> None:
    # At exit: start nothing more. Kernels with the helper are its business now (it finishes
    # them into the cache). Only numba work inside this process is waited for: tearing LLVM
    # down under a compiling thread can crash the exit; a cache load takes a fraction of a second.
    global _stopping
    with _STATE:
        _stopping = True
        _pending.clear()
        t = _worker if _here else None
    if t is not None and t is not threading.current_thread():
        t.join(timeout=120)


def _after_fork() -> None:  # a forked child has no background thread and no helper: start over
    global _COMPILE, _STATE, _worker, _current, _stopping, _here, _helper, _helper_broken, _helper_starts
    _COMPILE = threading.RLock()
    _STATE = threading.Condition()
    _worker = _current = None
    _stopping = _here = _helper_broken = False
    _helper_starts = 0
    if _helper is not None:  # its pipes are the parent's: keep them open and unused
        _inherited.append(_helper)
    _helper = None
    for k in _KERNELS + _pending + [k for k, _ in _sent.values()]:  # the parent's work in flight is not here
        if not k.ready:
            k._queued = k._awaiting = k._helped = False
    _pending.clear()
    _sent.clear()


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
