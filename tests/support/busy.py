"""Run a command beside busy-loop processes: the load the test suite must hold under.

    python3 -m tests.support.busy [--procs 1] [--repeat 3] -- .ci/run

(from the repository's root, with any Python 3: it needs only the standard library, so it keeps
running while .ci/run replaces .venv) starts ``--procs`` processes running ``while True: pass`` at normal priority (each keeps one core
busy), runs the command ``--repeat`` times in a row while they run (stopping at the first failure),
prints each run's exit status and wall time, stops the busy processes and exits with the first
failing status (0 when every run passed). The busy processes are stopped however this ends (a
failure, Ctrl-C, SIGTERM), by their own process ids.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence

__all__ = ["busy", "main"]

BUSY_LOOP = "while True: pass"


@contextlib.contextmanager
def busy(procs: int = 1) -> Iterator[list[int]]:
    """``procs`` busy-loop processes for the duration of the ``with`` block; yields their pids."""
    running: list[subprocess.Popen] = []
    try:
        for _ in range(procs):
            running.append(subprocess.Popen([sys.executable, "-c", BUSY_LOOP], stdin=subprocess.DEVNULL))
        yield [p.pid for p in running]
    finally:
        for p in running:
            if p.poll() is None:
                p.kill()
        for p in running:
            p.wait()


def _cpu_seconds(pid: int) -> float:
    """CPU seconds process ``pid`` has used (0 without /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.support.busy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, default=1, help="busy-loop processes beside the command (default 1)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of the command in a row (default 1)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.procs < 0 or args.repeat < 1:
        ap.error("give a command after --, --procs >= 0 and --repeat >= 1")

    def stop(signum, frame):  # SIGTERM: unwind through busy()'s finally
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    status = 0
    with busy(args.procs) as pids:
        print(f"busy: {len(pids)} busy-loop process(es) {pids} beside {' '.join(command)}", file=sys.stderr,
              flush=True)
        for run in range(1, args.repeat + 1):
            t0 = time.monotonic()
            rc = subprocess.call(command)
            took = time.monotonic() - t0
            burnt = ", ".join(f"{_cpu_seconds(p):.1f}" for p in pids)
            print(f"busy: run {run}/{args.repeat}: exit {rc} after {took:.0f} s (busy loops' CPU s so far: "
                  f"{burnt or '-'})", file=sys.stderr, flush=True)
            if rc != 0:
                status = rc
                break
    return status


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except KeyboardInterrupt:  # the command and the busy loops are stopped already
        raise SystemExit(130) from None
