"""Run one function over many items, serially or on a dask cluster, and report per-item failures.

``run_tasks(fn, items)`` is the task runner of the whole-export jobs (statistics, label index,
conversion, PCG edges). Each item is one task, usually one shard. Serially (``scheduler=None``)
nothing outside the standard library and tqdm is imported; with a scheduler the items run on
``dask.distributed`` (``pip install dvidshards[dask]``): ``"local"`` or ``"local:N"`` starts a
``LocalCluster`` of N single-threaded worker processes (spawned: TensorStore forbids ``fork``
once its threads run), an address (``"tcp://host:8786"``) or a ``distributed.Client`` uses an
existing cluster (for example dask-jobqueue on LSF).

A task that raises does not stop the job: its item lands in ``JobReport.failed`` with
``"TypeName: message"`` (the library's errors name file and chunk) and the other items go on.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["JobReport", "run_tasks", "describe_exception"]


@dataclass
class JobReport:
    """What a :func:`run_tasks` call did.

    Attributes
    ----------
    results : dict
        ``{item: result}`` of the tasks that succeeded, in the order of ``items``.
    failed : dict
        ``{item: "TypeName: message"}`` of the tasks that raised (or whose worker died).
    skipped : list
        Items skipped because they were in ``done``.
    elapsed : float
        Wall time of the call in seconds.
    dashboard : str or None
        The dask dashboard link, when there was one.
    """

    results: dict = field(default_factory=dict)
    failed: dict = field(default_factory=dict)
    skipped: list = field(default_factory=list)
    elapsed: float = 0.0
    dashboard: str | None = None

    @property
    def ok(self) -> bool:
        """True when no task failed."""
        return not self.failed

    def summary(self, limit: int = 10) -> str:
        """A few lines: counts, then up to ``limit`` failed items with their errors."""
        lines = [
            f"{len(self.results)} done, {len(self.failed)} failed, {len(self.skipped)} skipped"
            f" in {self.elapsed:.1f} s"
        ]
        for k, (item, msg) in enumerate(self.failed.items()):
            if k == limit:
                lines.append(f"  ... and {len(self.failed) - limit} more")
                break
            lines.append(f"  FAILED {item}: {msg}")
        return "\n".join(lines)


def describe_exception(exc: BaseException) -> str:
    """``"TypeName: message"`` (just the type name when the message is empty)."""
    msg = str(exc)
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


def _call(fn, item):
    # runs in the worker: exceptions become data, so unpicklable exceptions cannot lose the message
    try:
        return True, fn(item)
    except Exception as e:  # noqa: BLE001 - every task failure is reported, the job goes on
        return False, describe_exception(e)


def _progress(total: int, desc: str, progress: bool | None):
    from tqdm.auto import tqdm

    # disable=None: tqdm shows the bar only on a terminal
    return tqdm(total=total, desc=desc, unit="task", file=sys.stderr,
                disable=None if progress is None else not progress, dynamic_ncols=True)


def run_tasks(
    fn: Callable[[Any], Any],
    items: Iterable[Hashable],
    *,
    scheduler=None,
    desc: str = "shards",
    done: Iterable[Hashable] | None = None,
    progress: bool | None = None,
    max_in_flight: int | None = None,
) -> JobReport:
    """Run ``fn(item)`` for every item; collect results and per-item failures.

    Parameters
    ----------
    fn : callable
        ``item -> result``. With a scheduler it must be picklable (a top-level function or a
        ``functools.partial`` of one) and so must items and results.
    items : iterable of hashable
        The tasks' inputs, for example shard origins ``(x, y, z)``. Must be distinct.
    scheduler : None, str or distributed.Client
        None: serially in this process. ``"local"`` / ``"local:N"``: a new
        ``dask.distributed.LocalCluster`` with N (default: CPU count) single-threaded spawned
        worker processes, closed afterwards. Any other string: the address of a running dask
        scheduler. A ``distributed.Client``: that client's cluster (left open).
    desc : str
        Label of the progress bar.
    done : iterable of hashable, optional
        Items to skip (already done: resume).
    progress : bool, optional
        Show a tqdm bar on stderr. Default: only when stderr is a terminal.
    max_in_flight : int, optional
        Tasks submitted to the cluster at once (default: twice the worker threads, at least 4);
        bounds the memory of results waiting to be collected.

    Returns
    -------
    JobReport
        Results, failures (``"TypeName: message"``), skipped items, elapsed time.

    Raises
    ------
    ValueError
        If items repeat or the scheduler string is malformed.
    ImportError
        If a scheduler is given and ``dask.distributed`` is not installed.
    """
    t0 = time.perf_counter()
    items = list(items)
    if len(set(items)) != len(items):
        raise ValueError("run_tasks: items must be distinct")
    skip = set(done or ())
    report = JobReport()
    todo: list[Hashable] = []
    for it in items:
        (report.skipped if it in skip else todo).append(it)

    if scheduler is None:
        with _progress(len(todo), desc, progress) as bar:
            for it in todo:
                ok, res = _call(fn, it)
                if ok:
                    report.results[it] = res
                else:
                    report.failed[it] = res
                    bar.set_postfix(failed=len(report.failed), refresh=False)
                bar.update(1)
    else:
        _run_dask(fn, todo, scheduler, desc, progress, max_in_flight, report)

    order = {it: k for k, it in enumerate(items)}
    report.results = dict(sorted(report.results.items(), key=lambda kv: order[kv[0]]))
    report.failed = dict(sorted(report.failed.items(), key=lambda kv: order[kv[0]]))
    report.elapsed = time.perf_counter() - t0
    return report


def _local_workers(scheduler: str) -> int | None:
    if scheduler == "local":
        return os.cpu_count() or 1
    if scheduler.startswith("local:"):
        try:
            n = int(scheduler[6:])
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"scheduler {scheduler!r}: expected 'local:N' with N >= 1")
        return n
    return None


def _connect(scheduler):
    """(client, cluster-or-None, close_client) for a scheduler argument."""
    try:
        import dask
        from distributed import Client, LocalCluster
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "a dask scheduler needs dask.distributed: pip install 'dvidshards[dask]'"
        ) from e
    if isinstance(scheduler, Client):
        return scheduler, None, False
    if not isinstance(scheduler, str):
        raise ValueError(f"scheduler must be None, a string or a distributed.Client, got "
                         f"{type(scheduler).__name__}")
    n = _local_workers(scheduler)
    if n is None:
        return Client(scheduler), None, True
    # spawn, not fork: forking a process whose TensorStore threads run can deadlock the child
    with dask.config.set({"distributed.worker.multiprocessing-method": "spawn"}):
        cluster = LocalCluster(n_workers=n, threads_per_worker=1, processes=True,
                               dashboard_address=":0", silence_logs=logging.ERROR)
    return Client(cluster), cluster, True


def _dashboard(client) -> str | None:
    try:
        link = client.dashboard_link
    except Exception:  # noqa: BLE001 - no dashboard service (bokeh missing)
        return None
    return link or None


def _run_dask(fn, todo, scheduler, desc, progress, max_in_flight, report) -> None:
    from distributed import as_completed

    client, cluster, close = _connect(scheduler)
    futures = {}
    try:
        report.dashboard = _dashboard(client)
        if report.dashboard and todo:
            print(f"dask dashboard: {report.dashboard}", file=sys.stderr)
        if not todo:
            return
        if max_in_flight is None:
            threads = sum(client.nthreads().values()) or 1
            max_in_flight = max(4, 2 * threads)
        # fn travels with every task (not scattered once: a dying worker would lose it)
        pending = iter(todo)

        def submit():
            it = next(pending, _END)
            if it is _END:
                return None
            f = client.submit(_call, fn, it, pure=False)
            futures[f] = it
            return f

        ac = as_completed([f for f in (submit() for _ in range(max_in_flight)) if f is not None])
        with _progress(len(todo), desc, progress) as bar:
            for f in ac:
                it = futures.pop(f)
                if f.status == "finished":
                    ok, res = f.result()
                else:  # the task could not run: worker died (KilledWorker), cancelled, ...
                    try:
                        exc = f.exception()
                    except BaseException as e:  # noqa: BLE001 - CancelledError is raised
                        exc = e
                    ok = False
                    res = (describe_exception(exc) if exc is not None
                           else f"TaskLost: dask reports the task {f.status}")
                f.release()
                if ok:
                    report.results[it] = res
                else:
                    report.failed[it] = res
                    bar.set_postfix(failed=len(report.failed), refresh=False)
                bar.update(1)
                nf = submit()
                if nf is not None:
                    ac.add(nf)
    finally:
        if futures:
            client.cancel(list(futures))
        if close:
            client.close()
            if cluster is not None:
                cluster.close()


_END = object()
