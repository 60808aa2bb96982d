"""Ctrl-C ends a program promptly whatever numba is doing: a thread that waits for a kernel another
process compiles (the compile helper of a program, or another worker of a job) gives up once the
program ends, and the program exits with its own code and message instead of waiting minutes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dvidshards.formats import codec
from tests.support.kernels import compiles_held
from tests.support.waiting import Lines

ROOT = Path(__file__).resolve().parents[2]

# A program whose worker thread (a pool thread, as a server's) needs a kernel no process can compile
# yet (the test holds the compile locks): it says "ready", then waits for its worker until Ctrl-C.
PROGRAM = textwrap.dedent("""
    import concurrent.futures, sys, time
    import numpy as np
    from dvidshards.formats.codec import encode_block
    from dvidshards.runtime import kernels, prepare_for_job

    NAME = "dvidshards.formats.codec._encode_kernel"
    if sys.argv[1] == "program":
        encode_block(np.zeros((8, 8, 8), np.uint64))  # answered by the fallback; the kernel goes to the helper
        while NAME not in kernels._awaiting:  # the helper has it, and cannot compile it
            time.sleep(0.01)
        big = (np.arange(136 ** 3, dtype=np.uint64) % 7).reshape((136,) * 3)
        work = lambda: encode_block(big)  # enough work to ask for the kernel compiled first
    else:  # a job's worker thread: it waits for the process compiling the kernel (its lock is held)
        work = lambda: prepare_for_job(NAME)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    done = pool.submit(work)
    print("ready", flush=True)
    try:
        done.result()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        sys.exit(130)
    print("finished before Ctrl-C", file=sys.stderr, flush=True)
""")


@pytest.mark.parametrize("who", ["program", "job"])
def test_ctrl_c_ends_a_program_whose_thread_waits_for_a_kernel_compile(tmp_path, who):
    cache = tmp_path / "numba"
    cache.mkdir()
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT), "DVIDSHARDS_KERNELS": "background"}
    with compiles_held(codec._encode, cache):  # no process compiles it while the program runs
        p = subprocess.Popen([sys.executable, "-c", PROGRAM, who], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env, cwd=ROOT)
        lines = Lines(p)
        try:
            lines.wait_for(lambda ln: ln == "ready", "its ready line")
            p.send_signal(signal.SIGINT)
            rc, out, err = lines.finish()  # the old exit waited 600 s (900 s for a job) for the compile
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert rc == 130, err
    assert "interrupted" in err and "Traceback" not in err and "Fatal" not in err, err
