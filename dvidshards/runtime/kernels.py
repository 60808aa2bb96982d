"""Where and when numba compiles the kernels of `formats.jit` (installed as its compiler on import).

Notebooks and commands (the default): a kernel called before it is ready answers through its
fallback and is made ready behind the caller, in the order of first calls: one in numba's disk
cache is loaded by a background thread; one missing is compiled into the cache by a helper
process (low CPU priority, one compile per cache folder at a time across processes), then
loaded. A fresh process reads its first chunk in well under a second and never exits with a
compile inside it: the helper finishes the kernels it was asked for, leaving the cache whole
(numba writes cache files under a temporary name). Kernels numba cannot cache, or all of them
when no helper starts, compile in the background thread. An exit (Ctrl-C included) waits at most
`_EXIT_WAIT` s in all for a compile or cache load inside the process, and never for a thread that
only waits (for the helper or another process's lock): it gives up and its caller takes the fallback.

Jobs: a task calls `prepare_for_job` first (cheap once done). A kernel missing from the cache
is then compiled at normal priority once per node: a lock file per kernel and cache folder (in
the temporary folder) lets one process compile while the others wait and load it (or, with
``wait=False``, answer through the fallback meanwhile); two fresh workers split the named
kernels between them. No job waits for a low-priority helper a busy node starves.

``dvidshards warm`` (`main`) fills numba's cache ahead of time, for images and containers.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - its exit hook (joining pool threads) runs after `_ending`
import contextlib
import hashlib
import importlib
import json
import os
import pkgutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from typing import Any

from ..errors import SpecError
from ..formats import jit
from ..formats.jit import Kernel
from .forks import SPAWN
from .locks import acquire, try_acquire

__all__ = ["MODES", "WarmCommand", "add_arguments", "in_cache", "install", "job_mode", "main", "mode", "prepare_for_job",
           "warm"]

MODES = ("background", "compiled", "fallback")
_ENV = "DVIDSHARDS_KERNELS"

_HELPER_ENV = "_DVIDSHARDS_KERNEL_HELPER"  # set in a helper: it starts no helper of its own
_HELPER_WAIT = 600.0  # ensure() waits this long for the helper, then compiles itself
_HELPER_IDLE = 60.0  # a helper with nothing to do for this long exits (a new one starts when needed)
_HELPER_STARTS = 8  # helpers per process at most
_HELPER_CODE = ("import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
                "from dvidshards.runtime import kernels; kernels._helper_main(float(sys.argv[2]))")

_STATE = threading.Condition()
# notebooks and commands: the low-priority background thread and the helper process
_pending: list[Kernel] = []  # called, waiting for the background thread
_sent: dict[str, tuple[Kernel, subprocess.Popen]] = {}  # with a helper process, by name
_awaiting: set[str] = set()  # sent to the helper process, not answered yet
_helped: set[str] = set()  # the helper has answered: compile (load) it here
_worker: threading.Thread | None = None
_current: Kernel | None = None  # the kernel the background thread is handling
_helper: subprocess.Popen | None = None
_helper_starts = 0
_helper_broken = False  # it could not be started, died, or was started too often: compile here
_inherited: list[subprocess.Popen] = []  # a forked child keeps its parent's helper pipes open, unused
# jobs: kernels another process (or thread) compiles, loaded by a normal-priority thread
_job = False
_job_wait = True  # a job's call of a kernel another process compiles waits for it (False: the fallback answers)
_JOB_LOCK_WAIT = 900.0  # a job waits this long for another process's compile, then compiles itself
_jobq: list[Kernel] = []
_jworker: threading.Thread | None = None
_jcurrent: Kernel | None = None
_prepared: set = set()  # prepare_for_job arguments whose kernels are all ready
_stopping = False
_EXIT_WAIT = 5.0  # an exit waits this long in all for a thread inside numba here, then leaves it (a daemon)
_inside: threading.Thread | None = None  # the thread inside numba through `_compile` (one at a time)


def mode() -> str:
    """``DVIDSHARDS_KERNELS``, read at each call of a kernel not ready: ``background`` (default),
    ``compiled`` (numba's own: compile at the first call and wait) or ``fallback`` (never compile)."""
    m = os.environ.get(_ENV, "background").strip().lower() or "background"
    if m not in MODES:
        raise ValueError(f"{_ENV}={m!r}: expected one of {', '.join(MODES)}")
    return m


_COMPILE = threading.RLock()  # one compile at a time in this process (numba has its own lock too)


def _compile(k: Kernel) -> None:
    """``k.compile()`` under this process's compile lock."""
    global _inside
    if _forked_mid_compile:  # a compile here would wait forever for a thread this process does not have
        e = RuntimeError(f"this process was forked while numba compiled in another thread (a fork waits up to "
                         f"{_FORK_WAIT:.0f} s for that), or from such a process: numba's compiler state here is "
                         f"half-way, so nothing compiles; {SPAWN}")
        k.give_up(e)
        raise e
    with _COMPILE:
        outer, _inside = _inside, threading.current_thread()
        try:
            k.compile()
        finally:
            _inside = outer


def _exiting() -> bool:
    """The process is ending: the main thread has finished (then Python joins the other threads: one
    waiting here for a compile would hold the exit)."""
    return _stopping or not threading.main_thread().is_alive()


def _ending() -> None:  # the main thread has finished, before Python joins the threads: start nothing more
    global _stopping
    with _STATE:
        _stopping = True
        _STATE.notify_all()


def _try_compile(k: Kernel) -> bool:
    """`_compile`; False when it failed (recorded on ``k``, warned about once: the fallback answers)
    or the process is ending (no compile starts then)."""
    if _exiting():
        return False
    try:
        _compile(k)
    except Exception:  # noqa: BLE001 - recorded on the kernel and warned about
        return False
    return True


class _Runtime(jit.Compiler):
    """The compiler this module installs in `formats.jit`."""

    def called(self, k: Kernel) -> bool:
        m = mode()
        if m == "fallback":
            return False
        if m == "compiled":
            return _try_compile(k)
        if k.handled:
            return False
        if _job:
            if _job_wait:
                _job_ensure(k)
                return k.ready
            return _job_call(k)
        _queue(k)
        return False

    def compile(self, k: Kernel) -> None:
        _compile(k)

    def asked(self, k: Kernel) -> None:
        if mode() != "fallback":
            self.ensure(k)

    def ensure(self, k: Kernel) -> None:
        if _job:
            _job_ensure(k)
            return
        _await_helper(k)  # compiling it here as well would only take the helper's core
        _try_compile(k)

    def wait(self, timeout: float | None) -> bool:
        with _STATE:
            return _STATE.wait_for(lambda: not _pending and not _sent and _current is None
                                   and not _jobq and _jcurrent is None, timeout)

    def busy(self) -> dict[str, str]:
        with _STATE:
            out = {k.name: "queued" for k in _pending + _jobq}
            out.update({name: "compiling" for name in _sent})
            for k in (_current, _jcurrent):
                if k is not None:
                    out[k.name] = "compiling"
        return out


def install() -> None:
    if not isinstance(jit.installed_compiler(), _Runtime):
        jit.install_compiler(_Runtime())


def prepare_for_job(*kernels: Any, wait: bool = True) -> None:
    """Make this process a job worker and the named kernels ready now, once per node, in the order
    given (name the slowest first); others at their first call, the same way. Afterwards it costs a
    set look-up. ``kernels``: a kernel's name (``"dvidshards.formats.cseg._transcode_kernel"``), a
    module or its name (every kernel it registers) or a `Kernel`. ``wait``: for a kernel another
    process compiles, wait and load it (default: cheaper on a busy node,
    ``benchmarks/bench_freshnode.py``) or answer through its fallback until then. SpecError for a
    name that is neither a kernel nor a module registering some."""
    global _job_wait
    key = (kernels, wait)
    if _job and key in _prepared:
        return
    _job_wait = wait
    job_mode()
    todo = _resolve(kernels)
    m = mode()
    if m == "compiled":
        for k in todo:
            _try_compile(k)
    elif m == "background":
        later = [k for k in todo if not k.ready and k.failed is None and not k.handled
                 and not _job_call(k, hand=False)]
        for k in later:  # compiled by another process (or thread) meanwhile: load them
            if wait:
                _job_ensure(k)
            else:
                _to_job_thread(k)
    if m == "fallback" or all(k.ready or k.failed is not None for k in todo):
        _prepared.add(key)


def job_mode() -> bool:
    """Switch this process to job mode (returns whether it already was); kernels queued for the
    helper go to the job thread."""
    global _job
    if _job:
        return True
    with _STATE:
        if _job:
            return True
        _job = True
        moved = list(_pending) + [k for k, _ in _sent.values()]
        _pending.clear()
        _sent.clear()
        _awaiting.clear()
    for k in moved:
        _to_job_thread(k)
    return False


def _resolve(targets: Iterable[Any]) -> list[Kernel]:
    """The kernels named by kernel names, modules, module names and Kernels."""
    out: list[Kernel] = []
    for t in targets:
        if isinstance(t, Kernel):
            found = [t]
        else:
            name = t if isinstance(t, str) else getattr(t, "__name__", str(t))
            found = [k for k in jit.kernels() if k.name == name]
            if not found:
                mod = _import(name)
                if mod is not None:  # a module (or package): every kernel it registers
                    mods = set(_walk(mod))
                    found = [k for k in jit.kernels() if k.dispatcher.py_func.__module__ in mods]
                elif _import(name.rpartition(".")[0]) is not None:  # a kernel of a module not imported yet
                    found = [k for k in jit.kernels() if k.name == name]
            if not found:
                raise SpecError(f"{name!r} is neither a kernel of dvidshards nor a module that registers kernels")
        out += [k for k in found if k not in out]
    return out


def _import(name: str) -> Any:
    if not name:
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _walk(mod: Any) -> list[str]:
    """The module's name and its submodules' (imported, so that they register)."""
    names = [mod.__name__]
    for info in pkgutil.walk_packages(getattr(mod, "__path__", []), mod.__name__ + "."):
        if _import(info.name) is not None:
            names.append(info.name)
    return names


def _job_call(k: Kernel, hand: bool = True) -> bool:
    """Compile (or load) ``k`` now in this thread unless another thread or process compiles it:
    then False, and with ``hand`` the job thread loads it once that is done."""
    lock = _COMPILE
    if not lock.acquire(blocking=False):
        if hand:
            _to_job_thread(k)
        return False
    try:
        if k.ready:
            return True
        if k.failed is not None:
            return False
        held = None
        if _cacheable(k) and not in_cache(k):
            held = try_acquire(_kernel_lock_path(k))
            if held is None:  # another process compiles it: load it when it is done
                if hand:
                    _to_job_thread(k)
                return False
        try:
            return _try_compile(k)
        finally:
            if held is not None:
                held.release()
    finally:
        lock.release()


def _job_ensure(k: Kernel) -> None:
    """Compile (or load) ``k`` now, waiting for another process compiling it."""
    if k.ready or k.failed is not None:
        return
    held = (acquire(_kernel_lock_path(k), timeout=_JOB_LOCK_WAIT, until=_exiting)
            if _cacheable(k) and not in_cache(k) else None)
    try:
        _try_compile(k)
    finally:
        if held is not None:
            held.release()


def _to_job_thread(k: Kernel) -> None:
    global _jworker
    with _STATE:
        k.handled = True
        if _stopping or k in _jobq or k is _jcurrent:
            return
        _jobq.append(k)
        if _jworker is None:
            _jworker = threading.Thread(target=_job_run, name="dvidshards-kernels-job", daemon=True)
            _jworker.start()
        _STATE.notify_all()


def _job_run() -> None:
    """The job thread (normal priority): waits for the process compiling each kernel, then loads it."""
    global _jworker, _jcurrent
    while True:
        with _STATE:
            if _stopping or not _jobq:
                _jcurrent = _jworker = None
                _STATE.notify_all()
                return
            k = _jcurrent = _jobq.pop(0)
        held = None
        try:
            if not k.ready and k.failed is None:
                if _cacheable(k):
                    held = acquire(_kernel_lock_path(k), timeout=_JOB_LOCK_WAIT, until=_exiting)
                _try_compile(k)
        finally:
            if held is not None:
                held.release()
            with _STATE:
                _jcurrent = None
                _STATE.notify_all()


def _queue(k: Kernel) -> None:
    with _STATE:
        if k.handled or _stopping:
            return
        k.handled = True
        _pending.append(k)
        _start_worker()
        _STATE.notify_all()


def _start_worker() -> None:  # under _STATE
    global _worker
    if _worker is None:
        _worker = threading.Thread(target=_run, name="dvidshards-kernels", daemon=True)
        _worker.start()


def _run() -> None:
    global _current, _worker
    try:  # Linux: a low CPU priority for this thread alone, so it yields to the work it speeds up
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass
    while True:
        with _STATE:
            while not _stopping and not _pending and _sent and not _job:  # the helper's answers come back here
                _STATE.wait()
            if _stopping or not _pending:
                _current = None
                _worker = None
                _STATE.notify_all()
                return
            k = _pending.pop(0)
            if not _job:  # (in a job, this thread's low priority is no use: the job thread takes it)
                _current = k
        if _job:
            _to_job_thread(k)
            continue
        if k.ready or k.failed is not None or not _send_to_helper(k):
            _try_compile(k)  # a load from the cache when the helper compiled it
        with _STATE:
            _current = None
            _STATE.notify_all()


def _cacheable(k: Kernel) -> bool:
    """Whether a new process can compile ``k`` into numba's cache (registered, ``cache=True``,
    defined at the top of an importable module)."""
    f = k.dispatcher.py_func
    if k not in jit.kernels() or "<" in f.__qualname__ or f.__module__ in (None, "__main__"):
        return False
    try:
        from numba.core.caching import NullCache
        return not isinstance(k.dispatcher._cache, NullCache)
    except Exception:  # noqa: BLE001 - another numba: do not guess
        return False


def in_cache(k: Kernel) -> bool:
    """Whether numba's disk cache holds every signature of ``k`` for this machine (numba's own index
    and keys); False when it cannot tell."""
    d = k.dispatcher
    try:
        cache = d._cache
        codegen = d.targetctx.codegen()
        index = cache._cache_file._load_index()  # {} when the source or numba changed
        return all(cache._index_key(sig, codegen) in index for sig in k.signatures)
    except Exception:  # noqa: BLE001 - reported, never raised past here
        return False


def _send_to_helper(k: Kernel) -> bool:
    """Ask a helper process to compile ``k`` into numba's cache (True), or say to compile it here."""
    global _helper, _helper_broken, _helper_starts
    if k.name in _helped or os.environ.get(_HELPER_ENV) or not _cacheable(k) or in_cache(k):
        return False
    with _STATE:
        if _helper_broken or _stopping or _job:
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
        _awaiting.add(k.name)  # registered first: the answer can come before write() returns
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
                _awaiting.discard(k.name)
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
    """Read a helper's answers, a kernel name a line once it is in the cache or failed there (either
    way this process compiles it next: a load, or the reason)."""
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
    _awaiting.discard(name)
    if compiled or _helper_broken:  # not compiled: to the next helper, if there is one
        _helped.add(name)
    if not _stopping:
        if _job:
            _to_job_thread(k)  # (_STATE is re-entrant)
        else:
            _pending.append(k)
            _start_worker()
    _STATE.notify_all()


def _await_helper(k: Kernel, timeout: float = _HELPER_WAIT) -> None:
    end = time.monotonic() + timeout
    with _STATE:  # (in turns of a second: no notify says the main thread has finished)
        while k.name in _awaiting and not _exiting() and time.monotonic() < end:
            _STATE.wait(min(1.0, max(0.0, end - time.monotonic())))


def _helper_main(idle: float = _HELPER_IDLE) -> None:
    """The helper process: compile each kernel named on stdin into numba's cache and write its name
    back; it finishes what it was sent after its parent exits, and exits after ``idle`` s idle."""
    import select

    try:  # (it inherits the niceness of the background thread that starts it)
        os.nice(max(0, 10 - os.nice(0)))
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
            with acquire(_lock_path(k)):  # one lock per numba cache folder: one helper compiles, the others load
                _compile(k)
        except Exception:  # noqa: BLE001 - the parent compiles it itself and reports what went wrong
            pass
        if answer:
            try:
                sys.stdout.write(name + "\n")
                sys.stdout.flush()
            except (OSError, ValueError):
                answer = False  # the parent has exited: finish the cache for the next process


def _registered(name: str) -> Kernel:
    importlib.import_module(name.rpartition(".")[0])
    for k in jit.kernels():
        if k.name == name:
            return k
    raise LookupError(f"no kernel {name} registered")


def _lock_path(k: Kernel, kernel: bool = False) -> str:
    """The lock file (in the temporary folder: shared by a node) of the numba cache folder ``k`` is
    written to (``NUMBA_CACHE_DIR`` and the source's folder, as numba picks it); with ``kernel``, of
    ``k`` alone there."""
    source = os.path.dirname(os.path.abspath(k.dispatcher.py_func.__code__.co_filename))
    what = f"{os.environ.get('NUMBA_CACHE_DIR', '')}|{source}" + (f"|{k.name}" if kernel else "")
    tag = hashlib.sha1(what.encode()).hexdigest()[:16]
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return os.path.join(tempfile.gettempdir(), f"dvidshards-numba-{uid}-{tag}.lock")


def _kernel_lock_path(k: Kernel) -> str:
    return _lock_path(k, kernel=True)


def _stop() -> None:
    # At exit: start nothing more. Kernels with the helper are its business now (it finishes
    # them into the cache). Only a thread inside numba here is waited for, `_EXIT_WAIT` s at
    # most (on a busy node a low-priority one can take minutes); then it is left, a daemon (numba
    # writes cache files under a temporary name). A thread waiting for a lock is not waited for.
    global _stopping
    with _STATE:
        _stopping = True
        _pending.clear()
        _jobq.clear()
        _STATE.notify_all()
    t = _inside
    if t is not None and t is not threading.current_thread():
        t.join(timeout=_EXIT_WAIT)


_FORK_WAIT = 600.0  # a fork waits this long for a compile inside numba to end
_fork_held = False  # this thread holds numba's compiler lock across a fork
_forked_mid_compile = False  # the fork did not get numba's lock: numba cannot compile in this child


def _numba_lock() -> Any:
    """numba's global compiler lock (an RLock), or None before numba is imported (nothing compiles
    then) or when this numba has none by that name."""
    compiler_lock = sys.modules.get("numba.core.compiler_lock")
    return getattr(getattr(compiler_lock, "global_compiler_lock", None), "_lock", None)


def _before_fork() -> None:
    """Take numba's compiler lock for the fork, so that no compile is half-way in the child: its
    copy of numba's state (the lock's owner, the typing call stack, LLVM's) would be a thread's it
    does not have, and a compile there would wait forever or fail as re-entrant."""
    global _fork_held
    lock = _numba_lock()  # (in a child that could not get it, no one will give it back: do not wait)
    _fork_held = lock is not None and not _forked_mid_compile and lock.acquire(timeout=_FORK_WAIT)


def _after_fork_in_parent() -> None:
    global _fork_held
    if _fork_held:
        _fork_held = False
        _numba_lock().release()


def _after_fork() -> None:  # a forked child has no background threads and no helper: start over
    global _STATE, _COMPILE, _worker, _current, _stopping, _helper, _helper_broken, _helper_starts
    global _jworker, _jcurrent, _inside, _fork_held, _forked_mid_compile
    if _fork_held:  # the forking thread is this one: its lock is ours to give back
        _fork_held = False
        _numba_lock().release()
    elif _numba_lock() is not None:
        _forked_mid_compile = True
    _STATE = threading.Condition()
    _worker = _current = _jworker = _jcurrent = _inside = None
    _stopping = _helper_broken = False
    _helper_starts = 0
    if _helper is not None:  # its pipes are the parent's: keep them open and unused
        _inherited.append(_helper)
    _helper = None
    _pending.clear()
    _sent.clear()
    _awaiting.clear()
    _helped.clear()
    _jobq.clear()
    _COMPILE = threading.RLock()  # the parent's may have been held by a thread that is not here
    for k in jit.kernels():  # the parent's work in flight is not here
        if not k.ready:
            k.handled = False


def _every_kernel() -> list[Kernel]:
    """Every kernel of the package (its formats modules imported, so that they register)."""
    from .. import formats

    _walk(formats)
    return jit.kernels()


def warm(names: Iterable[str] = (), processes: int = 1, log=None) -> dict[str, str]:
    """Compile the kernels into numba's cache, ``processes`` at a time, each once under its node
    lock: ``{kernel name: "in the cache" | "compiled (S s)" | "compiled by another process" | "failed:
    ..."}``."""
    names = list(names)
    todo = _resolve(names) if names else _every_kernel()
    kids = []
    if processes > 1 and sys.executable:
        env = dict(os.environ, **{_HELPER_ENV: "1"})
        code = ("import sys; from dvidshards.runtime import kernels; kernels.warm(sys.argv[1:])")
        for _ in range(processes - 1):
            kids.append(subprocess.Popen([sys.executable, "-c", code, *[k.name for k in reversed(todo)]], env=env,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    out: dict[str, str] = {}
    deferred = []
    for k in todo:
        if in_cache(k):
            out[k.name] = "in the cache"
            continue
        held = try_acquire(_kernel_lock_path(k))
        if held is None:
            deferred.append(k)
            continue
        out[k.name] = _compile_timed(k, held)
        if log:
            log(f"{k.name}: {out[k.name]}")
    for k in deferred:
        held = acquire(_kernel_lock_path(k))
        if in_cache(k):
            held.release()
            out[k.name] = "compiled by another process"
        else:
            out[k.name] = _compile_timed(k, held)
        if log:
            log(f"{k.name}: {out[k.name]}")
    for p in kids:
        p.wait()
    return {k.name: out[k.name] for k in todo}


def _compile_timed(k: Kernel, held: Any) -> str:
    t = time.thread_time()
    try:
        _compile(k)
    except Exception as e:  # noqa: BLE001 - reported, and the exit code says so
        return f"failed: {type(e).__name__}: {' '.join(str(e).split())[:200]}"
    finally:
        held.release()
    return f"compiled ({time.thread_time() - t:.1f} CPU-s)"


def _cache_folders(ks: Iterable[Kernel]) -> list[str]:
    out = []
    for k in ks:
        try:
            path = k.dispatcher._cache._cache_path
        except AttributeError:
            continue
        if path not in out:
            out.append(path)
    return out


def add_arguments(p) -> None:
    """The options of ``dvidshards warm``."""
    p.add_argument("kernels", nargs="*", metavar="NAME",
                   help="kernels or modules to compile (default: every kernel of dvidshards)")
    p.add_argument("--check", action="store_true",
                   help="compile nothing: exit 1 unless every kernel is in numba's cache already")
    p.add_argument("-j", "--processes", type=int, default=min(os.cpu_count() or 1, 4),
                   help="compile in this many processes side by side (default: the cores, at most 4)")


def main(args) -> int:
    """``dvidshards warm``: fill numba's cache ahead of time (an image build) so every process started
    from it runs compiled code at once; exit 1 when a kernel failed (``--check``: is missing)."""
    names = list(args.kernels)
    todo = _resolve(names) if names else _every_kernel()
    if args.check:
        missing = [k.name for k in todo if not in_cache(k)]
        for name in missing:
            print(f"not in the cache: {name}")
        print(f"{len(todo) - len(missing)} of {len(todo)} kernels in numba's cache "
              f"({', '.join(_cache_folders(todo)) or 'no cache folder'})")
        return 1 if missing else 0
    if args.processes < 1:
        raise SpecError(f"--processes {args.processes}: give 1 or more")
    t0 = time.perf_counter()
    done = warm([k.name for k in todo], processes=args.processes, log=print)
    failed = [n for n, v in done.items() if v.startswith("failed")]
    cached = sum(v == "in the cache" for v in done.values())
    print(f"{len(done)} kernels ready in numba's cache in {time.perf_counter() - t0:.1f} s "
          f"({cached} were there already, {len(failed)} failed): {', '.join(_cache_folders(todo))}")
    return 1 if failed else 0


atexit.register(_stop)
getattr(threading, "_register_atexit", lambda f: None)(_ending)  # (Python's hook, before the threads are joined)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork)
install()


class WarmCommand:
    """``dvidshards warm``: one row of ``cli.COMMANDS``."""

    add_arguments = staticmethod(add_arguments)
    main = staticmethod(main)
