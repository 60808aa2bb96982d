"""run_tasks: serial and dask runs, per-item failures, resume, scheduler arguments."""

from __future__ import annotations

import math
import subprocess
import sys
import time

import pytest

from dvidshards.errors import BlockDecodeError
from dvidshards.jobs import JobReport, describe_exception, run_tasks


def _square_or_fail(x):
    if x % 3 == 2:
        raise BlockDecodeError(f"s0/{x}_0_0.arrow: chunk ({x}, 0, 0): bad block")
    return x * x


def _empty_error(x):
    raise KeyError() if x else RuntimeError("")


def test_serial_results_failures_in_item_order():
    items = [5, 0, 1, 2, 3, 4]
    rep = run_tasks(_square_or_fail, items, progress=False)
    assert isinstance(rep, JobReport)
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
    with pytest.raises(ValueError, match="local:N"):
        run_tasks(abs, [1], scheduler="local:0")
    with pytest.raises(ValueError, match="scheduler must be"):
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
    from dvidshards.jobs.runner import _connect

    c, cluster, _ = _connect("local:2")
    assert isinstance(c, distributed.Client)
    assert len(c.nthreads()) == 2 and set(c.nthreads().values()) == {1}
    yield c
    c.close()
    cluster.close()


def test_dask_client_matches_serial(client):
    items = list(range(40))
    serial = run_tasks(_square_or_fail, items, progress=False)
    # max_in_flight=3 exercises the refill of the bounded submission window
    rep = run_tasks(_square_or_fail, items, scheduler=client, done={0, 1}, progress=False,
                    max_in_flight=3)
    assert rep.skipped == [0, 1]
    assert rep.results == {k: v for k, v in serial.results.items() if k not in (0, 1)}
    assert rep.failed == serial.failed and list(rep.failed) == list(serial.failed)
    for _ in range(100):  # releases reach the scheduler asynchronously
        if not client.who_has():
            break
        time.sleep(0.05)
    assert not client.who_has()  # no result left on the cluster
    pid = client.run(lambda: __import__("os").getpid())
    assert len(set(pid.values())) == 2  # two worker processes


def test_dask_worker_death_is_a_failure(client):
    rep = run_tasks(_die_on_7, [6, 7], scheduler=client, progress=False)
    assert rep.results == {6: 6}
    assert list(rep.failed) == [7] and rep.failed[7].startswith("KilledWorker")


def _die_on_7(x):
    if x == 7:
        import os

        os._exit(3)
    return x


def test_local_scheduler_string():
    pytest.importorskip("distributed")
    rep = run_tasks(math.sqrt, [4, -1], scheduler="local:1", progress=False)
    assert rep.results == {4: 2.0} and rep.failed == {-1: "ValueError: math domain error"}
