"""Mapping files: `LabelMapping.from_file` on 10⁶, 10⁷ and 10⁸ text rows, time and peak RSS.

Each load runs in a fresh process (so that its peak RSS is its own); the file is read once
beforehand so the page cache is warm. The baseline is the parser before the pyarrow.csv
rewrite (a Python loop over lines, taken from git at commit 4d13bce), run on 10⁶ rows only:
it needs ~1.9 s per million lines.

Files look like DVID's ``/mappings`` text output: ``supervoxel body`` per line, space
separated, supervoxel ids around 10¹¹ in random order, 50 supervoxels per body on average.
Each child checks what it loaded against an order-independent checksum of the generated rows.

    python benchmarks/bench_mapping.py            # 10⁶ (new and old), 10⁷, 10⁸
    python benchmarks/bench_mapping.py --quick    # 10⁶ and 10⁷ only

Workers (issue 22 item 4): ``--workers`` instead runs ``--tasks`` (default 1,000) trivial tasks
on a dask LocalCluster of 2 worker processes, each applying the job's mapping (``--workers-rows``
rows, default 10⁸; a text file) to a palette of 1,000 supervoxels, with the mapping given as a
*file* (``as_labels(path)``: pickled as path + stamp, loaded once per worker through the
memory-mapped sidecar). Two runs: "cold" (no sidecar yet: the workers race, one parses under
the lock, the other waits and maps its sidecar) and "prepared" (the client builds the sidecar in
a child process first, then every worker only maps it). Measured: loads per worker, time per
task (wall, and inside the task), worker RSS (anonymous and file-backed pages), client peak
RSS, bytes per pickled task. The baselines, measured in child processes of the same run: the
parse per task that ``--labels FILE`` cost stats/label-index before (``LabelMapping.from_file``),
and the ``LabelMapping`` pickled into every task that pcg did (its pickle size and ``loads``
time)::

    python benchmarks/bench_mapping.py --workers [--tasks 1000] [--workers-rows 100000000]

Last ``--workers`` run (2026-11-26, 2 cores shared, load average 6-7.6; wall times inflated,
counts and memory exact; 10⁸ rows, 2,480 MiB of text, 1,526 MiB sidecar)::

    mapping given as              exact  client plan s  parses/worker      maps/worker  wall/task ms  in-task ms  worker RSS MiB anon+file  client peak MiB  bytes/task
    file, cold (workers race)     yes    0.0            0+1 / 0+0          1 / 1        53.2          1.04        97+1580 / 95+1580         192 (+24)        9,998
    file, prepared by the client  yes    36.4           0 / 0 (client: 1)  1 / 1        18.1          0.99        95+1581 / 96+1581         206 (+13)        9,998
    baseline: parse per task      -      -              1,000              0            31,461        -           3,410 peak per parse      -                ~300
    baseline: pickled per task    -      -              0                  0            >= 2,085      -           +1,526 per task held      +1,526 per task  1,600,000,228

(``parses/worker``: in the worker + in a child process it started; ``cold``: the first worker
that needed the mapping started the parse, the other waited on the lock and mapped the sidecar,
its first task 36 s. The file-backed 1,580 MiB per worker are the same page-cache pages. The
task's 9,998 bytes are the 1,000-id palette; the mapping travels as ~300 bytes.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).absolute().parent))

import common

BASELINE_COMMIT = "4d13bce"  # last commit with the line-by-line parser
_MIX = np.uint64(0x9E3779B97F4A7C15)


def _rows(n: int, seed: int, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows [start, stop) of an n-row mapping: unique supervoxels, shuffled by a bijection."""
    return _rows_at(n, seed, np.arange(start, stop, dtype=np.uint64))


def _rows_at(n: int, seed: int, i: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``i`` of an n-row mapping (see `_rows`)."""
    i = np.asarray(i, np.uint64)
    # a bijection of [0, n) scrambles the order without holding a permutation of n in memory
    a = np.uint64(2_654_435_761 if n % 2_654_435_761 else 40_503)
    j = (i * a + np.uint64(seed)) % np.uint64(n)
    sv = np.uint64(100_000_000_000) + j * np.uint64(7)
    body = np.uint64(100_000_000_000) + (j // np.uint64(50)) * np.uint64(350)
    return sv, body


def checksum(keys: np.ndarray, values: np.ndarray) -> int:
    """Order-independent checksum of (supervoxel, body) rows."""
    with np.errstate(over="ignore"):
        return int(np.sum((keys * _MIX) ^ values, dtype=np.uint64))


def make_file(workdir: Path, n: int, seed: int = 1, log=print) -> tuple[Path, int]:
    """Write (once) an n-row text mapping; returns its path and checksum."""
    import pyarrow as pa
    import pyarrow.csv as pcsv

    folder = workdir / "mappings"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"mapping-{n}.txt"
    meta = folder / f"mapping-{n}.json"
    params = {"n": n, "seed": seed, "version": 1}
    try:
        m = json.loads(meta.read_text())
        if m["params"] == params and path.stat().st_size == m["bytes"]:
            return path, m["checksum"]
    except (OSError, ValueError, KeyError):
        pass
    t = time.perf_counter()
    log(f"writing {path} ({n:,} rows, once) ...")
    total = np.uint64(0)
    opts = pcsv.WriteOptions(include_header=False, delimiter=" ", quoting_style="none")
    with pcsv.CSVWriter(str(path), pa.schema([("sv", pa.uint64()), ("body", pa.uint64())]),
                        write_options=opts) as w:
        step = 5_000_000
        for lo in range(0, n, step):
            sv, body = _rows(n, seed, lo, min(n, lo + step))
            with np.errstate(over="ignore"):
                total += np.sum((sv * _MIX) ^ body, dtype=np.uint64)
            w.write_table(pa.table({"sv": sv, "body": body}))
    meta.write_text(json.dumps({"params": params, "bytes": path.stat().st_size, "checksum": int(total)}))
    log(f"  {path.stat().st_size / common.MIB:.0f} MiB in {time.perf_counter() - t:.0f} s")
    return path, int(total)


def _old_parser():
    """The line-by-line parser of commit 4d13bce, loaded from git."""
    src = subprocess.run(["git", "-C", str(Path(__file__).resolve().parents[1]), "show", f"{BASELINE_COMMIT}:dvidshards/formats/mapping.py"],
                         capture_output=True, text=True, check=True).stdout
    src = src.replace("from ..errors import MappingError", "from dvidshards.errors import MappingError")
    src = src.replace("cache=True", "cache=False")  # exec'd source has no file to cache beside
    mod = types.ModuleType("old_mapping")
    mod.__file__ = "<old_mapping>"
    exec(compile(src, "old_mapping.py", "exec"), mod.__dict__)
    return mod.LabelMapping


def child(which: str, path: str, expect: int) -> None:
    """Load one file in this process; print a JSON line of timings and memory."""
    from dvidshards.formats import mapping as new

    cls = _old_parser() if which == "old" else new.LabelMapping
    warm = Path(path).with_name("warm-up.txt")  # compile/load the kernels before measuring
    warm.write_text("sv body\n3 30\n1 10\n")
    cls.from_file(warm)
    build = [0.0]
    name = "_set" if hasattr(cls, "_set") else "__init__"  # sorting and checks, after parsing
    inner = getattr(cls, name)

    def timed(self, *a, **kw):
        t = time.perf_counter()
        inner(self, *a, **kw)
        build[0] += time.perf_counter() - t

    setattr(cls, name, timed)
    base = common.rss()
    common.reset_peak_rss()
    c = _cpu()
    t = time.perf_counter()
    m = cls.from_file(path)
    dt = time.perf_counter() - t
    cpu = _cpu() - c
    peak = common.peak_rss()
    ok = len(m.keys) > 0 and checksum(m.keys, m.values) == expect
    print(json.dumps({"seconds": dt, "cpu": cpu, "build": build[0], "peak": peak, "base": base, "rows": len(m),
                      "ok": ok, "load": common.load_text()}))


def _cpu() -> float:
    """CPU seconds of this process, every thread (user + system): what a busy machine does not inflate."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run_child(which: str, path: Path, expect: int) -> dict:
    with open(path, "rb") as f:  # warm the page cache
        while f.read(64 << 20):
            pass
    out = subprocess.run([sys.executable, __file__, "--child", which, str(path), str(expect)],
                         capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"child {which} {path} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- workers (issue 22 item 4)


def _palette_task(labels, palette, item):
    """One trivial task: the job's mapping applied to a palette; (checksum, seconds, loads here)."""
    from dvidshards.runtime import mappings as mod

    t = time.perf_counter()
    before = mod.cache_info()
    out = labels.mapping.palette(palette)
    dt = time.perf_counter() - t
    after = mod.cache_info()
    with np.errstate(over="ignore"):
        return int(np.sum(out, dtype=np.uint64)), dt, after["parsed"] - before["parsed"] + after["opened"] - before["opened"]


def _worker_memory():
    from dvidshards.runtime import mappings as mod

    st = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            st[k] = int(v.split()[0]) * 1024
    return {**st, **mod.cache_info()}


def child_pickle(path: str) -> None:
    """Baseline: a LabelMapping pickled into a task, as pcg did; size and unpickle time."""
    import pickle

    from dvidshards.formats.mapping import LabelMapping

    m = LabelMapping.from_file(path)
    blob = pickle.dumps(m, protocol=5)
    del m
    t = time.perf_counter()
    again = pickle.loads(blob)
    dt = time.perf_counter() - t
    print(json.dumps({"bytes": len(blob), "loads": dt, "rows": len(again)}))


def _cluster_run(path: Path, n: int, tasks: int, prepare: bool) -> dict:
    import functools

    import cloudpickle

    from dvidshards.formats.labels import as_labels
    from dvidshards.jobs.runner import TaskRunner
    from dvidshards.runtime import mappings as mod

    mod.clear_cache()
    palette, body = _rows_at(n, 1, np.random.default_rng(3).integers(0, n, 1000))
    with np.errstate(over="ignore"):
        want = int(np.sum(body, dtype=np.uint64))
    with TaskRunner("local:2", progress=False) as tr:
        client = tr.client()
        client.run(lambda: __import__("dvidshards.runtime"))  # import outside the timings
        common.reset_peak_rss()
        base = common.rss()
        t = time.perf_counter()
        src = as_labels(str(path))
        if prepare:
            src.prepare()
        plan = time.perf_counter() - t
        fn = functools.partial(_palette_task, src, palette)
        task_bytes = len(cloudpickle.dumps((fn, 0)))
        t = time.perf_counter()
        rep = tr.run(fn, range(tasks), desc="palette tasks")
        wall = time.perf_counter() - t
        client_peak = common.peak_rss()
        mem = client.run(_worker_memory)
    res = list(rep.results.values())
    inside = sorted(r[1] for r in res)
    return {"ok": rep.ok and all(r[0] == want for r in res), "failed": len(rep.failed), "plan": plan,
            "wall": wall, "per_task": wall / tasks, "inside_med": inside[len(inside) // 2],
            "inside_max": inside[-1], "opened": [w["opened"] for w in mem.values()], "built": [w["built"] for w in mem.values()],
            "client_built": mod.cache_info()["built"],
            "parsed": [w["parsed"] for w in mem.values()], "hits": sum(w["hits"] for w in mem.values()),
            "worker_rss": [w["VmRSS"] for w in mem.values()], "worker_hwm": [w["VmHWM"] for w in mem.values()],
            "worker_anon": [w["RssAnon"] for w in mem.values()], "worker_file": [w["RssFile"] for w in mem.values()],
            "client_peak": client_peak, "client_base": base, "task_bytes": task_bytes}


def workers(args) -> None:
    import shutil
    import tempfile

    n = args.workers_rows
    common.header(f"bench_mapping --workers: a {n:,}-row mapping file over {args.tasks:,} tasks on 2 dask workers")
    path, expect = make_file(args.workdir, n)
    cache = Path(tempfile.mkdtemp(prefix="mapcache-", dir=args.workdir))
    os.environ["DVIDSHARDS_CACHE_DIR"] = str(cache)  # the workers inherit it; a fresh cache
    try:
        runs = {}
        for name, prepare in (("cold (workers race)", False), ("prepared by the client", True)):
            shutil.rmtree(cache / "mappings", ignore_errors=True)
            runs[name] = _cluster_run(path, n, args.tasks, prepare)
            print(f"  {name}: {json.dumps(runs[name])}")
        sidecar = sum(f.stat().st_size for f in (cache / "mappings").rglob("*.npy"))
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    parse = run_child("new", path, expect)
    out = subprocess.run([sys.executable, __file__, "--child-pickle", str(path)], capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"pickle child failed:\n{out.stderr}")
    pk = json.loads(out.stdout.strip().splitlines()[-1])
    rows = []
    for name, r in runs.items():
        rows.append([f"file, {name}", "yes" if r["ok"] else f"NO ({r['failed']} failed)", f"{r['plan']:.1f}",
                     " / ".join(f"{p} + {b}" for p, b in zip(r["parsed"], r["built"], strict=True))
                     + f" (client: {r['client_built']})", " / ".join(str(v) for v in r["opened"]),
                     f"{r['per_task'] * 1e3:.1f}", f"{r['inside_med'] * 1e3:.2f} (max {r['inside_max']:.1f} s)",
                     " / ".join(f"{a / common.MIB:.0f}+{f / common.MIB:.0f}" for a, f in
                                zip(r["worker_anon"], r["worker_file"], strict=True)),
                     " / ".join(f"{v / common.MIB:.0f}" for v in r["worker_hwm"]),
                     f"{r['client_peak'] / common.MIB:.0f} (+{(r['client_peak'] - r['client_base']) / common.MIB:.0f})",
                     f"{r['task_bytes']:,}"])
    per_task_parse = parse["seconds"]
    rows.append(["baseline: parse per task (stats before)", "-", "-", f"{args.tasks:,} (one per task)", "0",
                 f"{per_task_parse * 1e3:,.0f} (one parse)", "-",
                 f"peak {parse['peak'] / common.MIB:,.0f} per parse", "-", "-", "~300"])
    rows.append(["baseline: LabelMapping pickled per task (pcg before)", "-", "-", "0 (one unpickle per task)", "0",
                 f"≥ {pk['loads'] * 1e3:,.0f} (unpickle only)", "-", f"+{pk['bytes'] / common.MIB:,.0f} per task held",
                 "-", f"+{pk['bytes'] / common.MIB:,.0f} per task submitted", f"{pk['bytes']:,}"])
    common.table(["mapping given as", "exact", "client plan s", "parses per worker: here + by a child",
                  "sidecar maps per worker",
                  "wall per task ms", "in-task ms (median)", "worker RSS MiB (anon+file)", "worker peak MiB",
                  "client peak MiB (+ during job)", "bytes per pickled task"], rows,
                 title=f"{n:,}-row mapping, {args.tasks:,} palette tasks (1,000 ids each) on a LocalCluster of 2 workers")
    best = runs["prepared by the client"]
    print(f"sidecar on disk: {sidecar / common.MIB:,.0f} MiB (shared by the workers through the page cache)")
    print(f"per task: {best['per_task'] * 1e3:.1f} ms wall vs {per_task_parse:.1f} s re-parsing "
          f"({per_task_parse / best['per_task']:,.0f} × less) and {pk['bytes'] / best['task_bytes']:,.0f} × fewer "
          f"bytes per task than a pickled LabelMapping; load average {common.load_text()}")


def main() -> None:
    p = common.parser(__doc__.split("\n")[0])
    p.add_argument("--child", nargs=3, help=argparse_hidden())
    p.add_argument("--child-pickle", help=argparse_hidden())
    p.add_argument("--rows", type=int, nargs="+", help="row counts to load (default 10⁶ 10⁷ 10⁸)")
    p.add_argument("--workers", action="store_true", help="the once-per-worker measurement (see above)")
    p.add_argument("--tasks", type=int, default=1000, help="tasks of --workers (default 1,000)")
    p.add_argument("--workers-rows", type=int, default=10**8, help="mapping rows of --workers (default 10⁸)")
    args = p.parse_args()
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]))
        return
    if args.child_pickle:
        child_pickle(args.child_pickle)
        return
    if args.workers:
        workers(args)
        return
    common.header("bench_mapping: LabelMapping.from_file on text mappings")
    sizes = args.rows or ([10**6, 10**7] if args.quick else [10**6, 10**7, 10**8])
    rows, res = [], {}
    for n in sizes:
        path, expect = make_file(args.workdir, n)
        size = path.stat().st_size
        for which in (["old", "new"] if n == 10**6 else ["new"]):
            r = run_child(which, path, expect)
            res[which, n] = r
            rows.append([
                "line loop (4d13bce)" if which == "old" else "pyarrow.csv (now)",
                f"{n:,}", f"{size / common.MIB:.0f}", f"{r['seconds']:.2f}",
                f"{r['seconds'] - r['build']:.2f}", f"{r['build']:.2f}", f"{r['cpu']:.1f}",
                f"{r['seconds'] / n * 1e6:.2f}", f"{r['peak'] / common.MIB:.0f}",
                f"{(r['peak'] - r['base']) / common.MIB:.0f}", f"{(r['peak'] - r['base']) / (16 * n):.1f}",
                "yes" if r["ok"] else "NO", r["load"]])
    common.table(["parser", "rows", "file MiB", "load s", "parse s", "sort+check s", "CPU s", "s per 10⁶ rows",
                  "peak RSS MiB", "peak − before MiB", "added / result size", "exact", "load average after"], rows,
                 title="text mapping load (fresh process each, page cache warm)")
    if ("old", 10**6) in res:
        old, new = res["old", 10**6], res["new", 10**6]
        print(f"10⁶ rows: pyarrow.csv loads {old['seconds'] / new['seconds']:.1f} × faster than the line loop "
              f"({new['seconds']:.2f} s vs {old['seconds']:.2f} s)")
    if ("new", 10**8) in res:
        r = res["new", 10**8]
        print(f"10⁸ rows in {r['seconds']:.1f} s ({r['cpu']:.1f} CPU s on {os.cpu_count()} cores): target < 60 s "
              f"{common.verdict(r['seconds'] < 60)}; load average now {common.load_text()}")


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
