"""Where a job's tasks run (serially, on threads or on dask), with per-task failures and retries.

A job opens one :class:`TaskRunner` for all of its phases, so a cluster starts at most once, and
calls :meth:`TaskRunner.run` per phase. ``scheduler``, the same for every job (``--scheduler``):

* ``None`` / ``"auto"``: threads when there is more than one task and core, else serial; never a
  cluster by itself (one pays only when tasks hold the GIL or outgrow this machine);
* ``"serial"``; ``"threads[:N]"`` (default one per core; the kernels release the GIL, so task
  functions must be thread-safe);
* ``"local[:N]"``: a dask ``LocalCluster`` of N single-threaded processes (spawned: TensorStore
  forbids ``fork`` once its threads run);
* an address (``"tcp://host:8786"``, ``"host:8786"``) or a ``distributed.Client``: an existing
  cluster; an unreachable address fails within a few seconds.

A task that raises lands in ``PhaseReport.failed`` as ``"TypeName: message"``; the others go on.
One that failed for a reason that may pass (:func:`transient`: a remote read, the network, a lost
worker) runs again after the phase's other tasks, up to ``retries`` times; one that failed on its
data would fail the same way and is not. Progress: a tqdm bar on a terminal, else a line every
~30 s (a batch system's log).
"""

from __future__ import annotations

import errno
import functools
import itertools
import logging
import os
import sys
import time
import uuid
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from ..errors import DvidShardsError, OutputError, RemoteReadError, SpecError
from ..stores import ByteStore

__all__ = ["RETRIES", "SCHEDULER_HELP", "PhaseReport", "TaskRunner", "clear_work", "describe_exception",
           "remove_work", "run_tasks", "scheduler_of", "transient"]

SCHEDULER_HELP = ("where tasks run: auto (default: threads when it pays, else serial), serial, threads[:N], "
                  "local[:N] (a dask LocalCluster of N processes), or a dask scheduler address (tcp://host:8786)")
#: seconds between progress lines when stderr is not a terminal
PROGRESS_SECONDS = float(os.environ.get("DVIDSHARDS_PROGRESS_SECONDS", "30"))
CONNECT_TIMEOUT = 5.0
#: a job with at least this many tasks in a phase (or on dask) compiles its kernels first (below)
COMPILE_FIRST_TASKS = int(os.environ.get("DVIDSHARDS_COMPILE_FIRST_TASKS", "32"))
#: how many times a task that failed transiently runs again (``TaskRunner(retries=)``)
RETRIES = int(os.environ.get("DVIDSHARDS_TASK_RETRIES", "2"))
#: seconds before the k-th round of runs again (times k)
RETRY_SECONDS = float(os.environ.get("DVIDSHARDS_RETRY_SECONDS", "1"))
_NETWORK = frozenset(getattr(errno, n) for n in ("ECONNRESET", "ECONNREFUSED", "ECONNABORTED", "ETIMEDOUT",
                                                  "EHOSTUNREACH", "ENETUNREACH", "ENETDOWN", "EPIPE", "EAGAIN")
                     if hasattr(errno, n))
#: dask's names for a task lost with its worker
_LOST = frozenset({"KilledWorker", "CommClosedError", "CancelledError", "FutureCancelledError", "TaskLost"})


@dataclass
class PhaseReport:
    """What one :meth:`TaskRunner.run` (one phase of a job) did.

    Attributes
    ----------
    results : dict
        ``{item: result}`` of the tasks that succeeded, in the order of the items.
    failed : dict
        ``{item: "TypeName: message"}`` of the tasks that raised (or whose worker died).
    skipped : list
        The items in ``done``.
    elapsed : float
        Wall seconds.
    dashboard : str or None
        The dask dashboard link.
    scheduler : str
        ``"serial"``, ``"threads:N"`` or ``"dask"``.
    task_cpu : float
        CPU seconds of the tasks' own threads, every run: what core-hours project from, also when
        threads overlap.
    retried : int
        Runs again of tasks that had failed transiently.
    """

    results: dict = field(default_factory=dict)
    failed: dict = field(default_factory=dict)
    skipped: list = field(default_factory=list)
    elapsed: float = 0.0
    dashboard: str | None = None
    scheduler: str = "serial"
    task_cpu: float = 0.0
    retried: int = 0
    #: items whose failure may pass (run again), decided where the task ran
    transient: set = field(default_factory=set, repr=False)

    @property
    def ok(self) -> bool:
        """True when no task failed."""
        return not self.failed

    def summary(self, limit: int = 10) -> str:
        """Counts, then the first ``limit`` failures (a screen long when thousands failed)."""
        lines = [f"{len(self.results)} done, {len(self.failed)} failed, {len(self.skipped)} skipped"
                 f" in {self.elapsed:.1f} s"]
        lines += [f"  FAILED {item}: {msg}" for item, msg in itertools.islice(self.failed.items(), limit)]
        if len(self.failed) > limit:
            lines.append(f"  ... and {len(self.failed) - limit} more")
        return "\n".join(lines)


def describe_exception(exc: BaseException) -> str:
    """``"TypeName: message"`` (just the type name when the message is empty)."""
    msg = str(exc)
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


def transient(exc: BaseException) -> bool:
    """Whether a task that raised ``exc`` may succeed when run again (never a data or parameter error)."""
    if isinstance(exc, RemoteReadError):
        return True
    if isinstance(exc, DvidShardsError):
        return False  # ShardFormatError, BlockDecodeError, MissingShardError, SpecError, OutputError, ...
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, OSError):
        return exc.errno in _NETWORK
    return type(exc).__name__ in _LOST


def _call(fn: Callable[[Any], Any], item: Any) -> tuple[bool, Any, float, bool]:
    # in the worker: an exception becomes data (an unpicklable one keeps its message), with the
    # task's thread CPU and whether its failure may pass
    t = time.thread_time()
    try:
        return True, fn(item), time.thread_time() - t, False
    except Exception as e:  # noqa: BLE001 - every task failure is reported, the job goes on
        return False, describe_exception(e), time.thread_time() - t, transient(e)


def _record(report: PhaseReport, it, ok: bool, res, cpu: float, again: bool, bar) -> None:
    (report.results if ok else report.failed)[it] = res
    if not ok and again:
        report.transient.add(it)
    report.task_cpu += cpu
    bar.update(ok)


# --------------------------------------------------------------------------- the vocabulary


def _count(text: str, what: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise SpecError(f"scheduler {what!r}: expected a number of workers >= 1 after ':'")
    return n


def scheduler_of(scheduler):
    """``scheduler`` checked (SpecError) and normalised: ``("auto", 0)``, ``("serial", 1)``,
    ``("threads", n)``, ``("local", n)``, ``("address", "tcp://host:port")`` or ``("client", client)``."""
    if scheduler is None:
        return ("auto", 0)
    if not isinstance(scheduler, str):
        try:
            from distributed import Client
        except ImportError:  # pragma: no cover - depends on the environment
            pass
        else:
            if isinstance(scheduler, Client):
                return ("client", scheduler)
        raise SpecError(f"scheduler must be a string or a distributed.Client, got {type(scheduler).__name__}")
    s = scheduler.strip()
    cores = os.cpu_count() or 1
    name, _, arg = s.partition(":")
    if s in ("auto", ""):
        return ("auto", 0)
    if s == "serial":
        return ("serial", 1)
    if name == "threads":
        return ("threads", _count(arg, s) if arg else cores)
    if name == "local":
        return ("local", _count(arg, s) if arg else cores)
    if "://" in s:
        scheme, _, rest = s.partition("://")
        host, _, port = rest.rpartition(":")
        if scheme in ("tcp", "tls", "inproc", "ucx", "ws", "wss") and host and port.isascii() and port.isdigit():
            return ("address", s)
    else:
        host, _, port = s.rpartition(":")
        if host and port.isascii() and port.isdigit() and "/" not in s:
            return ("address", f"tcp://{s}")
    raise SpecError(f"scheduler {scheduler!r} is not one of: {SCHEDULER_HELP}")


# --------------------------------------------------------------------------- progress


class _Progress:
    """A tqdm bar on a terminal; otherwise a line on stderr every PROGRESS_SECONDS (and at the end)."""

    def __init__(self, total: int, desc: str, progress: bool | None):
        self.total, self.desc = total, desc
        self.done = self.failed = 0
        self.t0 = self.last = time.monotonic()
        self.bar = None
        if progress is True or (progress is None and sys.stderr.isatty()):
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="task", file=sys.stderr, dynamic_ncols=True)
        self.lines = self.bar is None and progress is None and bool(total)

    def update(self, ok: bool) -> None:
        self.done += 1
        if not ok:
            self.failed += 1
        if self.bar is not None:
            if not ok:
                self.bar.set_postfix(failed=self.failed, refresh=False)
            self.bar.update(1)
        elif self.lines and time.monotonic() - self.last >= PROGRESS_SECONDS:
            self._line()

    def _line(self) -> None:
        self.last = now = time.monotonic()
        dt = max(now - self.t0, 1e-9)
        rate = self.done / dt
        left = (self.total - self.done) / rate if rate > 0 else float("inf")
        eta = time.strftime("%H:%M:%S", time.gmtime(left)) if left != float("inf") else "?"
        print(f"dvidshards: {self.desc}: {self.done:,}/{self.total:,} done ({self.done / max(self.total, 1):.1%}), "
              f"{self.failed} failed, {rate:.3g} tasks/s, {now - self.t0:.0f} s so far, ETA {eta}",
              file=sys.stderr, flush=True)

    def grow(self, n: int) -> None:  # runs again
        self.total += n
        if self.bar is not None:
            self.bar.total += n
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.lines and time.monotonic() - self.t0 >= PROGRESS_SECONDS:
            self._line()  # the final count, when the job ran long enough to print lines


# --------------------------------------------------------------------------- the runner


class TaskRunner:
    """Where a job's tasks run; one per job, for all of its phases.

    Parameters
    ----------
    scheduler : None, str or distributed.Client
        See the module docstring.
    progress : bool, optional
        True: a tqdm bar; False: nothing; None: a bar on a terminal, else a line every ~30 s.
    max_in_flight : int, optional
        Tasks submitted at once (default: twice the workers, at least 4): bounds the memory of
        pending futures and uncollected results.
    retries : int, optional
        Runs again of a task that failed transiently (default :data:`RETRIES`).
    """

    def __init__(self, scheduler=None, *, progress: bool | None = None, max_in_flight: int | None = None,
                 retries: int | None = None):
        self.kind, self.arg = scheduler_of(scheduler)
        self.retries = RETRIES if retries is None else int(retries)
        if self.retries < 0:
            raise SpecError(f"retries must be >= 0, got {retries!r}")
        self.progress, self.max_in_flight = progress, max_in_flight
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0
        self._client: Any = None
        self._cluster: Any = None
        self._close_client = False
        self.dashboard: str | None = None

    def __enter__(self) -> TaskRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TaskRunner({self.kind}{'' if self.kind in ('auto', 'serial') else ':' + str(self.arg)})"

    def close(self) -> None:
        """Stop the thread pool; close a client and a cluster this runner started."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if self._client is not None and self._close_client:
            self._client.close()
        if self._cluster is not None:
            self._cluster.close()
        self._client = self._cluster = None

    @property
    def distributed(self) -> bool:
        """Whether tasks run in other processes (dask): arguments travel pickled."""
        return self.kind in ("local", "address", "client")

    @property
    def remote(self) -> bool:
        """Whether the workers may run on other hosts."""
        return self.kind in ("address", "client")

    def client(self):
        """The ``distributed.Client``, connected or started on first use."""
        if self._client is not None:
            return self._client
        try:
            import dask
            from distributed import Client, LocalCluster
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("a dask scheduler needs dask.distributed: pip install 'dvidshards[dask]'") from e
        if self.kind == "client":
            self._client, self._close_client = self.arg, False
        elif self.kind == "address":
            try:
                self._client = Client(self.arg, timeout=f"{CONNECT_TIMEOUT}s")
            except (OSError, TimeoutError) as e:
                raise RemoteReadError(f"dask scheduler {self.arg}: cannot connect within {CONNECT_TIMEOUT:g} s "
                                      f"({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
            self._close_client = True
        elif self.kind == "local":
            # spawn, not fork: forking a process whose TensorStore threads run can deadlock the child
            with dask.config.set({"distributed.worker.multiprocessing-method": "spawn"}):
                self._cluster = LocalCluster(n_workers=int(self.arg), threads_per_worker=1, processes=True,
                                             dashboard_address=":0", silence_logs=logging.ERROR)
            self._client, self._close_client = Client(self._cluster), True
        else:
            raise ValueError(f"{self!r} runs no dask cluster")
        try:  # a scheduler started with --no-dashboard has no dashboard service
            self.dashboard = self._client.dashboard_link if self._client.scheduler_info().get(
                "services", {}).get("dashboard") else None
        except Exception:  # noqa: BLE001 - no dashboard service (bokeh missing)
            self.dashboard = None
        if self.dashboard:
            print(f"dask dashboard: {self.dashboard}", file=sys.stderr)
        return self._client

    def check_shared(self, workdir: ByteStore | str | os.PathLike[str] | None) -> None:
        """Before any work, with workers that may run elsewhere: SpecError (one line) unless each
        reads a marker file written to ``workdir`` here. A bucket is shared; memory never is."""
        if not self.remote or workdir is None:
            return
        if isinstance(workdir, ByteStore):
            store, workdir = workdir, workdir.local_path()
            if workdir is None:
                spec = store.kvstore_spec()
                if spec is None or spec.get("driver") == "memory":
                    raise SpecError(f"work folder {store.describe('')}: held in this process's memory, which "
                                    f"dask workers elsewhere cannot see; give --workdir on a shared file system "
                                    f"or a bucket")
                return
        path = os.fspath(workdir)
        if "://" in path and not path.startswith("file://"):
            return
        path = os.path.abspath(path.removeprefix("file://"))
        os.makedirs(path, exist_ok=True)
        token = uuid.uuid4().hex
        marker = os.path.join(path, f".dvidshards-shared-{token}")
        with open(marker, "w") as f:
            f.write(token)
        try:
            seen = self.client().run(_sees, marker, token)
        finally:
            os.remove(marker)
        blind = sorted(w for w, ok in seen.items() if not ok)
        if blind:
            raise SpecError(f"work folder {path}: {len(blind)} of {len(seen)} dask workers cannot see it (first: "
                            f"{blind[0]}); give --workdir on a file system every worker shares")

    def _mode(self, n: int) -> tuple[str, int]:
        if self.kind == "auto":
            cores = os.cpu_count() or 1
            return ("threads", min(cores, n)) if n > 1 and cores > 1 else ("serial", 1)
        return self.kind, self.arg if isinstance(self.arg, int) else 0

    def run(self, fn: Callable[[Any], Any], items: Iterable[Hashable], *, desc: str = "tasks",
            done: Iterable[Hashable] | None = None, kernels: Iterable[str] = (),
            retries: int | None = None) -> PhaseReport:
        """``fn(item)`` for every item not in ``done``; the transient failures run again.

        Parameters
        ----------
        fn : callable
            ``item -> small result``: picklable on dask (a top-level function or a partial of
            one), thread-safe on threads.
        items : iterable of hashable
            The tasks, distinct.
        desc : str
            What the tasks are, for progress.
        done : iterable of hashable, optional
            Items to skip (resume).
        kernels : iterable of str
            The numba kernels the tasks use, slowest to compile first. A phase on dask or of at
            least ``COMPILE_FIRST_TASKS`` tasks compiles them first, once per node, so a fresh
            worker never runs long on the numpy fallbacks; a short phase here answers through the
            fallbacks while they compile behind it, as a notebook does.
        retries : int, optional
            Default: the runner's.

        Returns
        -------
        PhaseReport
        """
        t0 = time.perf_counter()
        items = list(items)
        if len(set(items)) != len(items):
            raise ValueError("run_tasks: items must be distinct")
        order, skip = order_of(items), set(done or ())
        report = PhaseReport()
        todo: list[Hashable] = []
        for it in items:
            (report.skipped if it in skip else todo).append(it)
        mode, n = self._mode(len(todo))
        kernels = tuple(kernels)
        if kernels and todo and (self.distributed or len(todo) >= COMPILE_FIRST_TASKS):
            fn = functools.partial(_compiled_first, fn, kernels)
        retries = self.retries if retries is None else int(retries)
        bar = _Progress(len(todo), desc, self.progress)
        try:
            for attempt in range(retries + 1):
                if attempt:
                    todo = sorted(report.transient, key=order.__getitem__)
                    if not todo:
                        break
                    report.retried += len(todo)
                    report.transient = set()
                    for it in todo:
                        del report.failed[it]
                    bar.grow(len(todo))
                    time.sleep(RETRY_SECONDS * attempt)
                if mode == "serial":
                    report.scheduler = "serial"
                    for it in todo:
                        _record(report, it, *_call(fn, it), bar)
                elif mode == "threads":
                    report.scheduler = f"threads:{n}"
                    self._run_threads(fn, todo, n, report, bar)
                else:
                    report.scheduler = "dask"
                    self._run_dask(fn, todo, report, bar)
                    report.dashboard = self.dashboard
        finally:
            bar.close()
        report.results = dict(sorted(report.results.items(), key=lambda kv: order[kv[0]]))
        report.failed = dict(sorted(report.failed.items(), key=lambda kv: order[kv[0]]))
        report.elapsed = time.perf_counter() - t0
        return report

    def _window(self, workers: int) -> int:
        return self.max_in_flight or max(4, 2 * workers)

    def _run_threads(self, fn, todo, n, report, bar) -> None:
        if self._pool is None or self._pool_size != n:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self._pool = ThreadPoolExecutor(n, thread_name_prefix="dvidshards-task")
            self._pool_size = n
        pending = iter(todo)
        running: dict = {}

        def submit() -> bool:
            it = next(pending, _END)
            if it is _END:
                return False
            running[self._pool.submit(_call, fn, it)] = it  # type: ignore[union-attr]
            return True

        for _ in range(self._window(n)):
            if not submit():
                break
        try:
            while running:
                finished, _ = wait(list(running), return_when=FIRST_COMPLETED)
                for f in finished:
                    it = running.pop(f)
                    ok, res, cpu, again = f.result()
                    _record(report, it, ok, res, cpu, again, bar)
                    submit()
        finally:
            for f in running:
                f.cancel()

    def _run_dask(self, fn, todo, report, bar) -> None:
        from distributed import as_completed

        client = self.client()
        if not todo:
            return
        threads = sum(client.nthreads().values()) or 1
        futures: dict = {}
        pending = iter(todo)

        # fn travels with every task (not scattered once: a dying worker would lose it)
        def submit():
            it = next(pending, _END)
            if it is _END:
                return None
            f = client.submit(_call, fn, it, pure=False)
            futures[f] = it
            return f

        ac = as_completed([f for f in (submit() for _ in range(self._window(threads))) if f is not None])
        try:
            for f in ac:
                it = futures.pop(f)
                outcome: tuple[bool, Any, float, bool]
                if f.status == "finished":
                    outcome = f.result()
                else:  # the task could not run: worker died (KilledWorker), cancelled, ...
                    try:
                        exc = f.exception()
                    except BaseException as e:  # noqa: BLE001 - CancelledError is raised
                        exc = e
                    outcome = (False, describe_exception(exc) if exc is not None
                               else f"TaskLost: dask reports the task {f.status}", 0.0, True)
                f.release()
                ok, res, cpu, again = outcome
                _record(report, it, ok, res, cpu, again, bar)
                nf = submit()
                if nf is not None:
                    ac.add(nf)
        finally:
            if futures:
                client.cancel(list(futures))


def order_of(items: list) -> dict:
    return {it: k for k, it in enumerate(items)}


def _compiled_first(fn, kernels: tuple, item):  # once per process, then a set look-up
    from ..runtime.kernels import prepare_for_job

    prepare_for_job(*kernels)
    return fn(item)


def _sees(marker: str, token: str) -> bool:
    try:
        with open(marker) as f:
            return f.read() == token
    except OSError:
        return False


_END = object()


def run_tasks(
    fn: Callable[[Any], Any],
    items: Iterable[Hashable],
    *,
    scheduler=None,
    desc: str = "tasks",
    done: Iterable[Hashable] | None = None,
    progress: bool | None = None,
    max_in_flight: int | None = None,
    retries: int | None = None,
) -> PhaseReport:
    """:meth:`TaskRunner.run` in a :class:`TaskRunner` of its own (a job of one phase)."""
    with TaskRunner(scheduler, progress=progress, max_in_flight=max_in_flight, retries=retries) as tr:
        return tr.run(fn, items, desc=desc, done=done)


# --------------------------------------------------------------------------- the work folder


def clear_work(work: ByteStore, own: Callable[[str], object]) -> None:
    """Delete a job's own names (``own(name)``) from its work folder; its other names and lock stay."""
    for name in work.list_sync(""):
        if own(name):
            work.delete_prefix_sync(name)


def remove_work(work: ByteStore, own: Callable[[str], object] | None = None) -> None:
    """After a complete run: the job's names go, then a local folder left empty (a bucket prefix
    vanishes with its objects)."""
    if own is not None:
        clear_work(work, own)
    if work.local_path() is not None and not work.list_sync(""):
        try:
            work.delete_prefix_sync("")
        except OutputError:
            pass
