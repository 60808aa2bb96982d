"""The one file lock between processes (dvidshards.runtime.locks): exclusive while held, free after."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from dvidshards.runtime import locks

_HOLD = textwrap.dedent("""
    import sys
    from dvidshards.runtime import locks
    held = locks.acquire(sys.argv[1])
    print("held", flush=True)
    sys.stdin.readline()  # until the test says so
    held.release()
    print("released", flush=True)
    sys.stdin.readline()
""")


def test_a_lock_held_by_another_process_is_refused_until_it_lets_go(tmp_path):
    path = str(tmp_path / "x.lock")
    p = subprocess.Popen([sys.executable, "-c", _HOLD, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        assert locks.try_acquire(path) is None
        waited = locks.acquire(path, timeout=0.2)  # a stuck holder: the caller goes on without the lock
        waited.release()
        assert locks.try_acquire(path) is None  # (that one held nothing)
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "released"
        mine = locks.try_acquire(path)
        assert mine is not None
        with mine:
            pass
        with locks.acquire(path):  # free again after the with block
            assert locks.try_acquire(path) is None  # (flock: per open file, so within a process too)
    finally:
        p.stdin.write("\n")
        p.stdin.close()
        p.wait(timeout=60)


def test_an_unwritable_lock_place_gives_a_lock_that_holds_nothing(tmp_path):
    held = locks.acquire(str(tmp_path / "no" / "such" / "folder" / "x.lock"))
    held.release()  # no error: the caller goes on without the lock
