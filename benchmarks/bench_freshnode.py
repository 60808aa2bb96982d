"""A fresh node under load: convert with 2 new worker processes and an empty numba cache.

Every dask-jobqueue node and every container starts with an empty numba cache. Before issue 32
the kernels it missed were compiled by a helper process at low CPU priority; on a node whose
cores were busy with the job the helper starved, and the job ran on the numpy fallbacks (7.9x
the CPU) for minutes. Now a job's task calls ``runtime.kernels.prepare_for_job()`` and each
kernel is compiled at normal priority, once per node, by the first worker that needs it.

Run from the project root::

    python benchmarks/bench_freshnode.py [--quick] [--minutes 5] [--warm-minutes 2] [--before]

Data: the demo's export (37 shard files at 3 scales; ``bench_coldstart``'s), written once into
``--workdir``.

Each condition starts a dask ``LocalCluster`` of 2 spawned worker processes (one thread each)
with its own ``NUMBA_CACHE_DIR``, and a CPU-bound process that keeps another core busy ("under
load"); then ``dvidshards.jobs.convert.convert(export, new folder, scheduler=client)`` runs back
to back for the window, each output deleted after its run. Measured: the wall time of each run
and the chunks it converted; the CPU of every process of the condition (the workers, and the
helper processes they start), sampled from ``/proc`` every second, and whatever the helpers
still spend after the window until they exit.

* **warm** (before and after the fresh run; their mean is the reference): the cache filled
  beforehand by ``kernels.warm`` (what ``dvidshards warm`` does), which also measures **one
  compile**: the CPU of compiling the kernels convert uses, in one process;
* **fresh**: an empty cache, the tasks calling ``prepare_for_job()`` (the benchmark wraps
  convert's ``run_task`` in the workers when convert does not call it itself);
* **fresh, before** (``--before``): an empty cache, no call (the low-priority helper).

Targets (issue 32): the fresh run's CPU ≤ 1.2 x the warm CPU for the same chunks + one compile;
its chunks in the first ``--minutes`` ≥ 80 % of what the warm runs convert in that time. Also
the CPU per chunk of the first run with a fresh cache against a warm run.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import bench_coldstart
import common as C

os.environ.pop("DVIDSHARDS_KERNELS", None)  # the default mode, as a user's workers get it (common sets it)
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


# --------------------------------------------------------------------------- CPU of a condition's processes


class CpuMeter:
    """The CPU seconds (user + system) of every process whose environment holds ``tag``, sampled
    every ``period`` seconds; a process that has exited keeps its last sample."""

    def __init__(self, tag: str, period: float = 1.0):
        self.tag = tag.encode()
        self.period = period
        self.last: dict[int, float] = {}
        self.known: dict[int, bool] = {}  # pid -> has the tag
        self.samples: list[tuple[float, float]] = []  # (perf_counter, total CPU)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> CpuMeter:
        self.sample()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.sample()

    def sample(self) -> float:
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            pid = int(d)
            tagged = self.known.get(pid)
            if tagged is None:
                try:
                    with open(f"/proc/{d}/environ", "rb") as f:
                        tagged = self.tag in f.read()
                except OSError:
                    continue
                self.known[pid] = tagged
            if tagged:
                try:
                    with open(f"/proc/{d}/stat", "rb") as f:
                        fields = f.read().rsplit(b")", 1)[1].split()
                    self.last[pid] = (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime
                except (OSError, IndexError, ValueError):
                    pass
        total = sum(self.last.values())
        self.samples.append((time.perf_counter(), total))
        return total

    def at(self, t: float) -> float:
        """Total CPU at perf_counter time ``t`` (the sample at or before it)."""
        best = self.samples[0][1]
        for ts_, v in self.samples:
            if ts_ > t:
                break
            best = v
        return best

    def helpers(self) -> bool:
        """Whether a kernel helper process of the condition still runs (compiling into the cache)."""
        for pid, tagged in list(self.known.items()):
            if tagged:
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        if b"_helper_main" in f.read():
                            return True
                except OSError:
                    pass
        return False


# --------------------------------------------------------------------------- in the workers


# the kernels convert runs (its default options; the mapping's look-up with --labels FILE), the
# slowest to compile first: what convert's task is to name in its prepare_for_job call
CONVERT_KERNELS = ("dvidshards.formats.cseg._transcode_kernel", "dvidshards.formats.codec._decode_kernel",
                   "dvidshards.formats.arrowipc._resolve", "dvidshards.formats.arrowipc._message",
                   "dvidshards.formats.mapping._apply")


def _wrap_convert(names: tuple, wait: bool) -> str:
    """In a worker: make convert's ``run_task`` call ``prepare_for_job(*names, wait=wait)`` first
    (as the job's task will); nothing when it calls it already."""
    import importlib

    from dvidshards.runtime import kernels

    convert = importlib.import_module("dvidshards.jobs.convert")  # the module (the package's name is the job)
    real = convert.run_task
    if getattr(real, "_bench_wrapped", False) or "prepare_for_job" in inspect.getsource(real):
        return "convert calls prepare_for_job itself"

    def run_task(task):
        kernels.prepare_for_job(*names, wait=wait)
        return real(task)

    run_task._bench_wrapped = True  # type: ignore[attr-defined]
    convert.run_task = run_task
    return "wrapped"


def _install() -> bool:
    """In a worker: what ``import dvidshards`` installs (the kernel compiler, ...)."""
    import dvidshards.runtime  # noqa: F401

    return True


def _status() -> dict:
    from dvidshards.formats import jit

    return jit.status()


# --------------------------------------------------------------------------- one condition


def _chunks(report) -> int:
    totals = getattr(report, "totals", None) or report
    return int(getattr(totals, "records", 0))


def run_condition(name: str, export: Path, spec: dict, cache: Path, seconds: float, prepare: tuple | None,
                  scratch: Path, drain: float = 900.0, log=print) -> dict:
    import dask
    from distributed import Client, LocalCluster

    from dvidshards.jobs.convert import convert

    tag = f"freshnode-{uuid.uuid4().hex}"
    old = {k: os.environ.get(k) for k in ("NUMBA_CACHE_DIR", "DVIDSHARDS_BENCH_TAG")}
    os.environ["NUMBA_CACHE_DIR"] = str(cache)
    os.environ["DVIDSHARDS_BENCH_TAG"] = tag  # the workers (and the helpers they start) inherit it
    load_env = {k: v for k, v in os.environ.items() if k != "DVIDSHARDS_BENCH_TAG"}
    load = subprocess.Popen([sys.executable, "-c", "while True: pass"], env=load_env)  # another core busy
    meter = CpuMeter(tag).start()
    runs: list[dict] = []
    try:
        with dask.config.set({"distributed.worker.multiprocessing-method": "spawn"}):
            cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                                   silence_logs=40)
        client = Client(cluster)
        try:
            client.run(_install)
            if prepare is not None:
                how = set(client.run(_wrap_convert, *prepare).values())
                log(f"  [{name}] tasks: {', '.join(sorted(how))}")
            t0 = time.perf_counter()
            c0 = meter.sample()
            while time.perf_counter() - t0 < seconds:
                dest = scratch / f"out-{len(runs)}"
                ts0 = time.perf_counter()
                cs0 = meter.sample()
                with contextlib.redirect_stderr(io.StringIO()):  # the runner names the dask dashboard each run
                    rep = convert(str(export), str(dest), format="precomputed", spec=spec, scheduler=client, progress=False)
                ts1 = time.perf_counter()
                cs1 = meter.sample()
                runs.append({"start": ts0 - t0, "end": ts1 - t0, "chunks": _chunks(rep), "cpu": cs1 - cs0})
                shutil.rmtree(dest, ignore_errors=True)
            t_end = time.perf_counter()
            status = list(client.run(_status).values())
        finally:
            client.close()
            cluster.close()
    finally:
        load.kill()
        load.wait()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    window_cpu = meter.sample() - c0
    waited = time.perf_counter()
    while meter.helpers() and time.perf_counter() - waited < drain:  # helpers finishing the cache
        time.sleep(1.0)
    meter.stop()
    total_cpu = meter.samples[-1][1] - c0
    compiled = sorted({n for st in status for n, v in st.items() if v == "compiled"})
    return {"name": name, "runs": runs, "seconds": t_end - t0, "t0": t0, "window_cpu": window_cpu, "total_cpu": total_cpu,
            "after_cpu": total_cpu - window_cpu, "drained": time.perf_counter() - waited,
            "kernels": compiled, "meter": meter}


def done_by(runs: list[dict], t: float) -> float:
    """Chunks converted by ``t`` seconds: whole runs, and the run in progress pro rata."""
    n = 0.0
    for r in runs:
        if r["end"] <= t:
            n += r["chunks"]
        elif r["start"] < t:
            n += r["chunks"] * (t - r["start"]) / (r["end"] - r["start"])
    return n


def warm_cache(cache: Path, names=CONVERT_KERNELS, log=print) -> dict[str, float]:
    """Fill ``cache`` with convert's kernels (``kernels.warm`` in one fresh process, as
    ``dvidshards warm -j 1 NAME...``); returns the CPU seconds each compile took."""
    code = ("import json, sys; from dvidshards.runtime import kernels; "
            "print(json.dumps(kernels.warm(sys.argv[1:])))")
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache))
    r = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, env=env, cwd=str(C.ROOT))
    if r.returncode:
        raise SystemExit(f"warming the cache failed:\n{r.stderr}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    cpu = {}
    for name, what in out.items():
        if what.startswith("compiled ("):
            cpu[name] = float(what.split("(")[1].split()[0])
        elif what.startswith("failed"):
            log(f"  {name}: {what}")
    return cpu


def main(argv=None):
    ap = C.parser(__doc__)
    ap.add_argument("--minutes", type=float, default=None, help="window of a fresh run (default 5; --quick 2)")
    ap.add_argument("--warm-minutes", type=float, default=None, help="window of each warm run (default 2; --quick 1)")
    ap.add_argument("--before", action="store_true",
                    help="also run a fresh node without prepare_for_job (the low-priority helper; +1 window)")
    ap.add_argument("--variants", action="store_true",
                    help="also run fresh nodes whose tasks name no kernels, and that answer through the fallbacks "
                         "while another worker compiles (wait=False) (+2 windows)")
    args = ap.parse_args(argv)
    minutes = args.minutes or (2.0 if args.quick else 5.0)
    warm_minutes = args.warm_minutes or (1.0 if args.quick else 2.0)
    export, spec_path, _ = bench_coldstart.build(args.workdir)
    spec = json.loads(Path(spec_path).read_text())
    C.header(f"bench_freshnode: convert the demo export (37 shards) on 2 fresh dask workers + 1 busy core, "
             f"{minutes:g}-minute fresh windows")
    tmp = Path(tempfile.mkdtemp(prefix="freshnode-", dir=args.workdir))
    try:
        warm_dir = tmp / "numba-warm"
        warm_dir.mkdir()
        print("filling the warm cache (convert's kernels, one process) ...")
        compile_cpu = warm_cache(warm_dir)
        scratch = tmp / "out"
        scratch.mkdir()
        now = (CONVERT_KERNELS, True)
        conds = [("warm (before)", warm_dir, warm_minutes, now), ("fresh", tmp / "numba-fresh", minutes, now),
                 ("warm (after)", warm_dir, warm_minutes, now)]
        if args.variants:
            conds += [("fresh, no kernels named", tmp / "numba-unnamed", minutes, ((), True)),
                      ("fresh, fallbacks while another compiles", tmp / "numba-nowait", minutes,
                       (CONVERT_KERNELS, False))]
        if args.before:
            conds.append(("fresh, before: no prepare_for_job", tmp / "numba-before", minutes, None))
        res = {}
        for name, cache, mins, prepare in conds:
            cache.mkdir(exist_ok=True)
            print(f"{name}: {mins:g} min ...", flush=True)
            res[name] = run_condition(name, export, spec, cache, mins * 60, prepare, scratch)
            r = res[name]
            print(f"  {len(r['runs'])} runs, {sum(x['chunks'] for x in r['runs'])} chunks, "
                  f"{r['window_cpu']:.1f} CPU-s in the window, {r['after_cpu']:.1f} after; load {C.load_text()}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report(res, compile_cpu, minutes)


def report(res: dict, compile_cpu: dict, minutes: float) -> None:
    warm = [res["warm (before)"], res["warm (after)"]]
    warm_runs = [r for w in warm for r in w["runs"][1:]]  # each cluster's first run: its workers' imports
    chunks_per_run = max(r["chunks"] for w in warm for r in w["runs"])
    warm_rate = sum(done_by(w["runs"], w["seconds"]) for w in warm) / sum(w["seconds"] for w in warm)
    warm_cpu_chunk = sum(r["cpu"] for r in warm_runs) / sum(r["chunks"] for r in warm_runs)
    warm_first = [w["runs"][0] for w in warm]
    used = sorted(set(res["fresh"]["kernels"]) | set(warm[0]["kernels"]))
    one_compile = sum(compile_cpu.get(n, 0.0) for n in used)
    rows, verdicts = [], []
    window = minutes * 60
    for name, r in res.items():
        runs = r["runs"]
        chunks = sum(x["chunks"] for x in runs)
        rate = done_by(runs, min(window, r["seconds"])) / min(window, r["seconds"])
        first = runs[0]
        steady = runs[len(runs) // 2:]
        rows.append([name, len(runs), f"{chunks:,}", f"{r['seconds']:.0f}", f"{rate:.0f}",
                     f"{rate / warm_rate:.0%}", f"{r['window_cpu']:.1f}", f"{r['after_cpu']:.1f}",
                     f"{first['cpu'] / first['chunks'] * 1e3:.2f}",
                     f"{sum(x['cpu'] for x in steady) / sum(x['chunks'] for x in steady) * 1e3:.2f}",
                     f"{first['end'] - first['start']:.1f}"])
    C.table(["condition", "runs", "chunks", "window s", "chunks/s in the window", "of warm",
             "CPU-s in the window", "CPU-s after (helpers)", "first run: ms CPU / chunk",
             "second half: ms CPU / chunk", "first run s"], rows,
            title=f"convert of the demo export ({chunks_per_run:,} chunks a run) on 2 fresh dask workers, "
                  f"one more core busy; warm reference {warm_rate:.0f} chunks/s, {warm_cpu_chunk * 1e3:.2f} ms CPU "
                  f"per chunk (runs after each cluster's first)")
    for name, r in res.items():
        if not name.startswith("fresh"):
            continue
        runs = r["runs"]
        chunks = sum(x["chunks"] for x in runs)
        budget = 1.2 * warm_cpu_chunk * chunks + one_compile
        rate = done_by(runs, min(window, r["seconds"])) / min(window, r["seconds"])
        # the slow start, in slices of the window
        slices = []
        for a, b in ((0, 30), (30, 60), (60, 120), (120, 180), (180, 300), (300, window)):
            if b > r["seconds"] or b <= a:
                continue
            n = done_by(runs, b) - done_by(runs, a)
            cpu = r["meter"].at(r["t0"] + b) - r["meter"].at(r["t0"] + a)
            slices.append(f"{a}-{b} s: {n / (b - a) / warm_rate:.0%} of warm, {cpu / max(n, 1) * 1e3:.2f} ms CPU/chunk")
        print(f"{name}: " + "; ".join(slices))
        # the first-run cost of a warm cluster (imports, loads) is in the warm reference's first runs too
        verdicts.append([f"{name}: total CPU ≤ 1.2 x warm for the same chunks + one compile",
                         f"{r['total_cpu']:.1f} CPU-s vs 1.2 x {warm_cpu_chunk * chunks:.1f} + {one_compile:.1f} "
                         f"= {budget:.1f} (+{sum(w['cpu'] for w in warm_first) / 2:.1f} a warm cluster's first run)",
                         C.verdict(r["total_cpu"] <= budget + sum(w["cpu"] for w in warm_first) / 2)])
        verdicts.append([f"{name}: first {minutes:g} min ≥ 80 % of warm throughput",
                         f"{rate / warm_rate:.0%} ({rate:.0f} vs {warm_rate:.0f} chunks/s)",
                         C.verdict(rate >= 0.8 * warm_rate)])
    print()
    C.table(["target (issue 32)", "measured", "verdict"], verdicts,
            title=f"Targets; one compile = the CPU of compiling the {len(used)} kernels convert used, in one "
                  f"process: {one_compile:.1f} CPU-s ({', '.join(n.rsplit('.', 2)[-2] + '.' + n.rsplit('.', 1)[-1] for n in used)})")
    first = res["fresh"]["runs"][0]
    rows = [["fresh cache, first run (compiles included)", f"{first['cpu'] / first['chunks'] * 1e3:.2f}"],
            ["warm cache, a cluster's first run", f"{sum(w['cpu'] for w in warm_first) / sum(w['chunks'] for w in warm_first) * 1e3:.2f}"],
            ["warm cache, later runs", f"{warm_cpu_chunk * 1e3:.2f}"]]
    for name, r in res.items():
        if name.startswith("fresh"):
            chunks = sum(x["chunks"] for x in r["runs"])
            if name != "fresh":
                b = r["runs"][0]
                rows.append([f"{name}: first run", f"{b['cpu'] / b['chunks'] * 1e3:.2f}"])
            rows.append([f"{name}: the whole {r['seconds'] / 60:.0f} minutes (compiles and helpers included)",
                         f"{r['total_cpu'] / chunks * 1e3:.2f}"])
    C.table(["convert", "ms CPU per chunk (workers and helpers)"], rows,
            title="Side by side: convert CPU per chunk with a fresh numba cache and a warm one")
    print(f"load average at end: {C.load_text()}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
