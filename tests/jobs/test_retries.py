"""Tasks that failed for a reason that may pass run again, for every job (``TaskRunner``); tasks
that failed on their data do not."""

from __future__ import annotations

import errno
import os
import threading

import pytest

from dvidshards.errors import BlockDecodeError, MissingShardError, RemoteReadError, ShardFormatError
from dvidshards.jobs import runner
from dvidshards.jobs.runner import TaskRunner, run_tasks


@pytest.fixture(autouse=True)
def _no_wait(monkeypatch):
    monkeypatch.setattr(runner, "RETRY_SECONDS", 0.0)


class Flaky:
    """A task that raises ``errors[k]`` on its k-th run for an item (then returns the item doubled)."""

    def __init__(self, errors: dict):
        self.errors = errors
        self.runs: dict = {}
        self.lock = threading.Lock()

    def __call__(self, item):
        with self.lock:
            k = self.runs[item] = self.runs.get(item, 0) + 1
        plan = self.errors.get(item, [])
        if k <= len(plan):
            raise plan[k - 1]
        return 2 * item


@pytest.mark.parametrize("scheduler", ["serial", "threads:3"])
def test_a_transient_failure_runs_again_and_succeeds(scheduler):
    task = Flaky({1: [RemoteReadError("gs://b/s0/x.arrow bytes [0, 10): failed after 4 attempts: 503")],
                  3: [ConnectionResetError(errno.ECONNRESET, "reset"), TimeoutError("slow")]})
    with TaskRunner(scheduler, progress=False) as tr:
        r = tr.run(task, range(5))
    assert r.results == {0: 0, 1: 2, 2: 4, 3: 6, 4: 8} and list(r.results) == [0, 1, 2, 3, 4]
    assert r.failed == {} and r.ok
    assert task.runs == {0: 1, 1: 2, 2: 1, 3: 3, 4: 1} and r.retried == 3


@pytest.mark.parametrize("error", [ShardFormatError("s0/a.arrow: truncated record batch"),
                                   BlockDecodeError("chunk (1, 2, 3): bad header"),
                                   MissingShardError("s0/b.arrow: no such file"),
                                   ValueError("a bug"), OSError(errno.ENOSPC, "No space left on device")])
def test_a_failure_on_the_data_is_not_run_again(error):
    task = Flaky({2: [error] * 5})
    r = run_tasks(task, range(4), scheduler="serial", progress=False)
    assert task.runs[2] == 1 and r.retried == 0
    assert list(r.failed) == [2] and r.failed[2].startswith(type(error).__name__ + ":")
    assert sorted(r.results) == [0, 1, 3]


def test_retries_are_bounded_and_the_last_failure_is_reported():
    task = Flaky({0: [RemoteReadError(f"attempt {k}") for k in range(1, 10)]})
    with TaskRunner("serial", progress=False, retries=3) as tr:
        r = tr.run(task, [0, 1])
        assert task.runs[0] == 4 and r.retried == 3 and r.failed == {0: "RemoteReadError: attempt 4"}
        again = tr.run(task, [0], retries=0)  # a phase may say otherwise
    assert task.runs[0] == 5 and again.retried == 0 and again.failed == {0: "RemoteReadError: attempt 5"}


def test_runs_again_are_counted_in_cpu_and_never_touch_skipped_items():
    task = Flaky({1: [RemoteReadError("x")]})
    r = run_tasks(task, range(3), scheduler="serial", progress=False, done=[2])
    assert r.skipped == [2] and 2 not in task.runs and r.results == {0: 0, 1: 2} and r.retried == 1


def test_retries_must_not_be_negative():
    with pytest.raises(Exception, match="retries must be >= 0"):
        TaskRunner("serial", retries=-1)


def _dies_once(marker: str, item: int) -> int:
    """Kills its worker process the first time it runs item 1 (a node lost mid-task)."""
    if item == 1 and not os.path.exists(marker):
        with open(marker, "w") as f:
            f.write("died")
        os._exit(1)
    return item + 100


@pytest.mark.slow
def test_a_task_whose_worker_died_runs_again_on_another(tmp_path):
    import functools

    dask = pytest.importorskip("dask")
    pytest.importorskip("distributed")
    marker = str(tmp_path / "died")
    # dask gives the task up at its worker's first death (KilledWorker): the runner runs it again
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}), \
            TaskRunner("local:2", progress=False) as tr:
        r = tr.run(functools.partial(_dies_once, marker), range(4))
    assert os.path.exists(marker)
    assert r.results == {0: 100, 1: 101, 2: 102, 3: 103} and r.failed == {} and r.retried >= 1  # the dead worker's queued tasks too
