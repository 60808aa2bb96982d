"""The task runner: serial, threads and dask runs, per-item failures, resume, the scheduler vocabulary,
progress lines for batch logs, the shared-work-folder check."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import pytest

from dvidshards.errors import BlockDecodeError, RemoteReadError, SpecError
from dvidshards.jobs import PhaseReport, describe_exception, run_tasks
from dvidshards.jobs.runner import TaskRunner, scheduler_of
from tests.support.waiting import wait_until


def _square_or_fail(x):
    if x % 3 == 2:
        raise BlockDecodeError(f"s0/{x}_0_0.arrow: chunk ({x}, 0, 0): bad block")
    return x * x


def _empty_error(x):
    raise KeyError() if x else RuntimeError("")


def test_serial_results_failures_in_item_order():
    items = [5, 0, 1, 2, 3, 4]
    rep = run_tasks(_square_or_fail, items, progress=False)
    assert isinstance(rep, PhaseReport)
    assert list(rep.results) == [0, 1, 3, 4]  # order of items, not of completion
    assert rep.results == {0: 0, 1: 1, 3: 9, 4: 16}
    assert rep.failed == {
        5: "BlockDecodeError: s0/5_0_0.arrow: chunk (5, 0, 0): bad block",
        2: "BlockDecodeError: s0/2_0_0.arrow: chunk (2, 0, 0): bad block",
    }
    assert not rep.ok and rep.skipped == []
    s = rep.summary()
    assert "4 done, 2 failed, 0 skipped" in s and "FAILED 5: BlockDecodeError" in s


def test_serial_done_skips_and_tuple_items():
    items = [(0, 0, 0), (64, 0, 0), (0, 64, 0)]
    rep = run_tasks(sum, items, done={(64, 0, 0), (9, 9, 9)}, progress=False)
    assert rep.results == {(0, 0, 0): 0, (0, 64, 0): 64}
    assert rep.skipped == [(64, 0, 0)] and rep.ok


def test_serial_imports_no_dask():
    code = (
        "import sys, math\n"
        "from dvidshards.jobs import run_tasks\n"
        "r = run_tasks(math.sqrt, [4, 9, -1], progress=False)\n"
        "assert r.results == {4: 2.0, 9: 3.0}, r\n"
        "assert r.failed == {-1: 'ValueError: math domain error'}, r.failed\n"
        "assert 'dask' not in sys.modules and 'distributed' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_describe_exception_and_bad_arguments():
    assert describe_exception(KeyError()) == "KeyError"
    assert run_tasks(_empty_error, [0, 1], progress=False).failed == {0: "RuntimeError", 1: "KeyError"}
    with pytest.raises(ValueError, match="distinct"):
        run_tasks(abs, [1, 1])
    with pytest.raises(SpecError, match="number of workers"):
        run_tasks(abs, [1], scheduler="local:0")
    with pytest.raises(SpecError, match="scheduler must be"):
        run_tasks(abs, [1], scheduler=3)


def test_empty_items():
    rep = run_tasks(abs, [], progress=False)
    assert rep.results == {} and rep.failed == {} and rep.ok


def test_progress_bar_on_request(capsys):
    run_tasks(abs, [1, -2], desc="things", progress=True)
    err = capsys.readouterr().err
    assert "things" in err and "2/2" in err


@pytest.fixture(scope="module")
def client():
    distributed = pytest.importorskip("distributed")
    with TaskRunner("local:2") as tr:
        c = tr.client()
        assert isinstance(c, distributed.Client)
        assert len(c.nthreads()) == 2 and set(c.nthreads().values()) == {1}
        yield c


@pytest.mark.slow
def test_dask_client_matches_serial(client):
    items = list(range(40))
    serial = run_tasks(_square_or_fail, items, progress=False)
    # max_in_flight=3 exercises the refill of the bounded submission window
    rep = run_tasks(_square_or_fail, items, scheduler=client, done={0, 1}, progress=False,
                    max_in_flight=3)
    assert rep.skipped == [0, 1]
    assert rep.results == {k: v for k, v in serial.results.items() if k not in (0, 1)}
    assert rep.failed == serial.failed and list(rep.failed) == list(serial.failed)
    # no result left on the cluster (releases reach the scheduler asynchronously: wait for them)
    wait_until(lambda: not client.who_has(), "the cluster to hold no result")
    pid = client.run(lambda: __import__("os").getpid())
    assert len(set(pid.values())) == 2  # two worker processes


@pytest.mark.slow
def test_dask_worker_death_is_a_failure(client):
    rep = run_tasks(_die_on_7, [6, 7], scheduler=client, progress=False)
    assert rep.results == {6: 6}
    assert list(rep.failed) == [7] and rep.failed[7].startswith("KilledWorker")


def _die_on_7(x):
    if x == 7:
        import os

        os._exit(3)
    return x


@pytest.mark.slow
def test_local_scheduler_string():
    pytest.importorskip("distributed")
    rep = run_tasks(math.sqrt, [4, -1], scheduler="local:1", progress=False)
    assert rep.results == {4: 2.0} and rep.failed == {-1: "ValueError: math domain error"}


def test_one_vocabulary_for_every_job():
    assert scheduler_of(None) == ("auto", 0) == scheduler_of("auto")
    assert scheduler_of("serial") == ("serial", 1)
    assert scheduler_of("threads:3") == ("threads", 3)
    assert scheduler_of("local:2") == ("local", 2)
    assert scheduler_of("tcp://10.0.0.1:8786") == ("address", "tcp://10.0.0.1:8786")
    assert scheduler_of("node7:8786") == ("address", "tcp://node7:8786")
    for bad in ("serial:2x", "threads:0", "tcp://nohost", "cluster", "http://x:1", "/tmp/sched:1", "node7:87²6",
                "tcp://node7:8\u0667"):
        with pytest.raises(SpecError, match="scheduler"):
            scheduler_of(bad)


def test_threads_match_serial_and_auto_picks_threads():
    items = list(range(30))
    serial = run_tasks(_square_or_fail, items, scheduler="serial", progress=False)
    assert serial.scheduler == "serial"
    threads = run_tasks(_square_or_fail, items, scheduler="threads:3", done={4}, progress=False, max_in_flight=2)
    assert threads.scheduler == "threads:3" and threads.skipped == [4]
    assert threads.results == {k: v for k, v in serial.results.items() if k != 4}
    assert list(threads.failed) == list(serial.failed)  # item order, not completion order
    auto = run_tasks(_square_or_fail, items, progress=False)
    assert auto.results == serial.results
    assert auto.scheduler == ("threads:2" if (__import__("os").cpu_count() or 1) >= 2 else "serial")
    assert run_tasks(abs, [-1], progress=False).scheduler == "serial"  # one task: no pool


def test_threads_run_concurrently():
    import threading

    seen = set()
    gate = threading.Barrier(2, timeout=600)  # a guard against a hang, never reached when they overlap

    def meet(x):
        gate.wait()  # both tasks must be running at once, else this times out
        seen.add(threading.get_ident())
        return x

    rep = run_tasks(meet, [1, 2], scheduler="threads:2", progress=False)
    assert rep.ok and len(seen) == 2


@pytest.mark.slow
def test_unreachable_scheduler_fails_after_the_connect_timeout(monkeypatch):
    """The client is given the runner's connect timeout (not dask's default of 30 s + retries), and
    the error names the scheduler and that timeout."""
    distributed = pytest.importorskip("distributed")
    import socket

    import dvidshards.jobs.runner as runner

    monkeypatch.setattr(runner, "CONNECT_TIMEOUT", 0.5)
    given = []
    real = distributed.Client

    def client(*args, **kwargs):
        given.append(kwargs.get("timeout"))
        return real(*args, **kwargs)

    monkeypatch.setattr(distributed, "Client", client)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RemoteReadError, match=rf"dask scheduler tcp://127.0.0.1:{port}: cannot connect within 0.5 s"):
        run_tasks(abs, [1, 2], scheduler=f"127.0.0.1:{port}", progress=False)
    assert given == ["0.5s"]


def test_progress_lines_when_stderr_is_not_a_terminal(monkeypatch, capsys):
    import dvidshards.jobs.runner as runner

    monkeypatch.setattr(runner, "PROGRESS_SECONDS", 0.0)  # a line per task
    run_tasks(_square_or_fail, [0, 1, 2], scheduler="serial", desc="s0 shards")
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("dvidshards: s0 shards: 1/3 done (33.3%), 0 failed")
    assert "3/3 done (100.0%), 1 failed" in err[-1] and "ETA" in err[-1]
    run_tasks(_square_or_fail, [0, 1, 2], scheduler="serial", desc="x", progress=False)
    assert capsys.readouterr().err == ""  # --quiet


class _FakeClient:
    """A client whose workers run elsewhere: none of them sees this host's folders."""

    def run(self, fn, *args):
        return {"tcp://10.1.1.1:40000": False, "tcp://10.1.1.2:40000": False}


def test_remote_cluster_without_a_shared_work_folder_is_refused_before_work(tmp_path):
    tr = TaskRunner("tcp://10.1.1.1:8786")
    tr._client = _FakeClient()
    with pytest.raises(SpecError, match=r"work folder .*: 2 of 2 dask workers cannot see it"):
        tr.check_shared(tmp_path / "work")
    assert list((tmp_path / "work").iterdir()) == []  # the marker is gone
    tr.check_shared("gs://bucket/work")  # URLs are shared by construction
    from dvidshards.stores import MemoryStore, as_store

    with pytest.raises(SpecError, match=r"work folder .*w2: 2 of 2 dask workers cannot see it"):
        tr.check_shared(as_store(tmp_path / "w2", writable=True))  # a work folder's store: its local path
    with pytest.raises(SpecError, match=r"memory://m/: held in this process's memory"):
        tr.check_shared(MemoryStore(name="m"))
    TaskRunner("local:2").check_shared(tmp_path)  # same host: nothing to check, no cluster started


@pytest.mark.slow
def test_remote_client_that_sees_the_folder_passes(client, tmp_path):
    tr = TaskRunner(client)
    assert tr.remote
    tr.check_shared(tmp_path)


def _spin(seconds: float) -> None:
    t = time.thread_time()
    while time.thread_time() - t < seconds:
        pass


def _task_beside_a_busy_thread(x):
    """Spins 20 ms of its own thread's CPU while another thread of the process spins 100 ms; returns
    its own thread's CPU."""
    import threading

    t = time.thread_time()
    other = threading.Thread(target=_spin, args=(0.1,))
    other.start()
    other.join()
    _spin(0.02)
    return time.thread_time() - t


def test_task_cpu_counts_each_tasks_own_thread():
    """task_cpu is the sum of the tasks' own threads' CPU (CPU time: a busy machine changes nothing),
    not the process's, which here is 6x larger."""
    rep = run_tasks(_task_beside_a_busy_thread, range(4), scheduler="threads:2", progress=False)
    own = sum(rep.results.values())
    assert own >= 4 * 0.02
    assert own <= rep.task_cpu <= own + 0.02  # the runner's bookkeeping around each call, no more


def test_a_long_phase_compiles_its_kernels_first_a_short_one_answers_on_fallbacks(tmp_path):
    """A phase of many tasks (or on dask) makes its kernels ready before its first task, at
    normal priority; a short one in this process keeps the notebook behaviour (fallbacks at once)."""
    code = """if True:
        import json, sys
        from dvidshards.formats import mapping
        from dvidshards.jobs import runner
        runner.COMPILE_FIRST_TASKS = int(sys.argv[1])
        def task(i):
            return mapping._apply_k.ready
        with runner.TaskRunner("serial", progress=False) as tr:
            r = tr.run(task, range(3), kernels=("dvidshards.formats.mapping._apply",))
        print(json.dumps(list(r.results.values())), flush=True)
    """
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"), "DVIDSHARDS_KERNELS": "background"}
    for threshold, first in (("2", True), ("100", False)):
        out = subprocess.run([sys.executable, "-c", code, threshold], env=env, capture_output=True, text=True,
                             timeout=600, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-2000:]
        assert json.loads(out.stdout)[0] is first, (threshold, out.stdout)
