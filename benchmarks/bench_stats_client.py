"""The client of ``dvidshards stats`` stays small whatever the number of bodies (issue 22's held-out bar),
and what planning stats / label-index over the procedural mCNS ``s0`` (26 K shards) costs.

Part 1, held-out bar: an external ``dask scheduler`` and 2 ``dask worker`` processes (1 process,
1 thread each, on 127.0.0.1), and two exports of the same size (default 512×512×256 voxels, 64³
chunks, 128³-voxel shards) whose bodies are the cells of a box tiling shifted by (3, 5, 7) voxels
(so bodies straddle chunk and shard borders), each body two supervoxels (its x halves), bodies
by the export's mapping: 16³-voxel cells (~18 K bodies) and 4³-voxel cells (~1.1 M bodies). The
client is ``dvidshards stats EXPORT sizes/ --scheduler tcp://...`` in a child process; its
peak RSS is the child's own ``VmHWM`` at exit. Both tables are compared with the tiling's own
arithmetic (voxels, supervoxels, chunks and box of every cell, clipped to the volume) and the
voxel counts also with ``np.bincount`` over the volume. Baseline in the same run: a client that
gathers the table (``body_stats_table()``, what ``stats`` did before) over the same cluster.
Target: the client's peak grows by at most 64 MiB from 18 K to 1.1 M bodies.

Part 2, procedural mCNS ``s0`` (``tests.support.procedural``: 26,456 shards of ~22.5 K chunks,
nothing stored): in child processes, (a) planning: open, list the shards, plan the job, pickle a
task; (b) the whole job's client side with every task stubbed (26 K shard tasks, the merge tree
and the final buckets through one ``TaskRunner`` on threads); (c) a random sample of real shard
tasks, each in a fresh process: wall, CPU, peak RSS over the process's RSS before the task,
partial-file bytes.

Run: ``python benchmarks/bench_stats_client.py`` (``--quick``: smaller exports, one sampled
task; ``--part 1`` or ``--part 2`` for one part).
"""

from __future__ import annotations

import json
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
from common import MIB, _done, _fresh, _reset, table

CHUNK = 64
OFFSET = (3, 5, 7)
TARGET_MIB = 64


# --------------------------------------------------------------------------- the exports


def tiling(shape, cell: int, off=OFFSET) -> tuple[np.ndarray, list[int]]:
    """Supervoxel volume (x, y, z) of the shifted box tiling, and the cell counts per axis."""
    ax = [np.arange(shape[i]) + off[i] for i in range(3)]
    c = [a // cell for a in ax]
    n = [int(c[i][-1]) + 1 for i in range(3)]
    body = ((c[0][:, None, None] * n[1] + c[1][None, :, None]) * n[2] + c[2][None, None, :] + 1).astype(np.uint64)
    half = ((ax[0] % cell) >= cell // 2).astype(np.uint64)
    body *= np.uint64(2)
    body -= np.uint64(1)
    body += half[:, None, None]
    return body, n  # supervoxel 2b-1 (low x half) or 2b (high x half) of body b


def expected(shape, cell: int, off=OFFSET) -> dict[str, np.ndarray]:
    """Every body's row from the tiling's arithmetic alone (no volume), sorted by label."""
    n = [(shape[i] - 1 + off[i]) // cell + 1 for i in range(3)]
    c = np.stack(np.meshgrid(*(np.arange(off[i] // cell, n[i]) for i in range(3)), indexing="ij"),
                 axis=-1).reshape(-1, 3)  # the cells that meet the volume
    lo = np.maximum(c * cell - np.asarray(off), 0)
    hi = np.minimum((c + 1) * cell - np.asarray(off), np.asarray(shape))
    mid = c[:, 0] * cell - off[0] + cell // 2  # first x of the high half
    svs = (np.minimum(hi[:, 0], mid) > lo[:, 0]).astype(np.int64) + (hi[:, 0] > np.maximum(lo[:, 0], mid))
    chunks = np.prod((hi - 1) // CHUNK - lo // CHUNK + 1, axis=1)
    label = ((c[:, 0] * n[1] + c[:, 1]) * n[2] + c[:, 2] + 1).astype(np.uint64)
    out = {"label": label, "voxels": np.prod(hi - lo, axis=1), "supervoxels": svs, "chunks": chunks}
    out.update({k: v for k, v in zip(("x0", "y0", "z0"), lo.T, strict=True)})
    out.update({k: v for k, v in zip(("x1", "y1", "z1"), hi.T, strict=True)})
    return out


def tiled_export(workdir: Path, shape, cell: int, log=print) -> Path:
    params = {"kind": "stats_client_tiling", "shape": list(shape), "cell": cell, "offset": list(OFFSET), "v": 1}
    folder = workdir / f"stats-client-{'x'.join(map(str, shape))}-c{cell}"
    if _fresh(folder, params):
        return folder / "export"
    from dvidshards.writer import write_export

    _reset(folder)
    t0 = time.perf_counter()
    sv, n = tiling(shape, cell)
    b = np.arange(1, n[0] * n[1] * n[2] + 1, dtype=np.uint64)
    mapping = np.stack([np.r_[2 * b - 1, 2 * b], np.r_[b, b]], axis=1)
    spec = write_export(sv, folder / "export", mapping=mapping, shard_chunks=2, progress=False)
    with open(folder / "export" / "info", "w") as f:
        json.dump(spec, f)
    # an independent voxel count of the written volume's bodies
    counts = np.bincount(((sv + np.uint64(1)) // np.uint64(2)).ravel().astype(np.int64))
    np.save(folder / "bincount.npy", counts)
    _done(folder, params)
    log(f"built {folder.name}: {int((counts[1:] > 0).sum()):,} bodies in {time.perf_counter() - t0:.1f} s")
    return folder / "export"


def check_table(t, shape, cell: int, bincount: np.ndarray) -> tuple[bool, str]:
    """Whether a statistics table equals the expectation exactly (and the bincount's voxels)."""
    want = expected(shape, cell)
    t = t.sort_by("label")
    if t.num_rows != len(want["label"]):
        return False, f"{t.num_rows} rows, expected {len(want['label'])}"
    for k, v in want.items():
        got = t[k].to_numpy()
        if not np.array_equal(got, v.astype(got.dtype)):
            bad = int(np.flatnonzero(got != v)[0])
            return False, f"column {k} differs at label {int(want['label'][bad])}: {got[bad]} != {v[bad]}"
    if not np.array_equal(t["voxels"].to_numpy(), bincount[t["label"].to_numpy().astype(np.int64)]):
        return False, "voxels differ from np.bincount of the volume"
    return True, "exact"


# --------------------------------------------------------------------------- an external cluster


class ExternalCluster:
    """``dask scheduler`` + ``workers`` × ``dask worker --nworkers 1 --nthreads 1`` on 127.0.0.1."""

    def __init__(self, workers: int = 2):
        self.workers = workers
        self.procs: list[subprocess.Popen] = []
        self.address = ""
        self.logs = tempfile.mkdtemp(prefix="bench-dask-")

    def __enter__(self) -> ExternalCluster:
        dask = str(Path(sys.executable).with_name("dask"))
        log = open(os.path.join(self.logs, "scheduler.log"), "w+")
        self.procs.append(subprocess.Popen([dask, "scheduler", "--host", "127.0.0.1", "--port", "0",
                                            "--no-dashboard"], stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 60
        while not self.address:
            if time.monotonic() > deadline or self.procs[0].poll() is not None:
                raise RuntimeError(f"dask scheduler did not start: {Path(log.name).read_text()[-2000:]}")
            time.sleep(0.2)
            m = re.search(r"Scheduler at:\s+(tcp://\S+)", Path(log.name).read_text())
            self.address = m.group(1) if m else ""
        for k in range(self.workers):
            wlog = open(os.path.join(self.logs, f"worker{k}.log"), "w")
            self.procs.append(subprocess.Popen([dask, "worker", self.address, "--nworkers", "1", "--nthreads", "1",
                                                "--host", "127.0.0.1", "--no-dashboard", "--memory-limit", "0"],
                                               stdout=wlog, stderr=subprocess.STDOUT,
                                               env={**os.environ, "DVIDSHARDS_KERNELS": "compiled"}))
        from distributed import Client

        with Client(self.address, timeout="30s") as c:
            c.wait_for_workers(self.workers, timeout=120)
        return self

    def __exit__(self, *exc) -> None:
        for p in reversed(self.procs):  # only the processes started here, by their id
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(self.logs, ignore_errors=True)


def run_child(code: str, *args: str) -> tuple[int, int, float, str]:
    """Run ``python -c code args``: (exit code, the child's reported VmHWM in bytes, wall s, its output)."""
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         cwd=str(common.ROOT))
    out = p.stdout.read().decode() if p.stdout else ""
    rc = p.wait()
    hwm = re.findall(r"^VmHWM (\d+)$", out, re.M)
    return rc, int(hwm[-1]) if hwm else 0, time.perf_counter() - t0, out


# the child reports its own peak (VmHWM): the kernel's ru_maxrss of a child also counts the parent's
# pages copied at fork, before exec
_HWM = ("\nfor _l in open('/proc/self/status'):\n    if _l.startswith('VmHWM:'):\n"
        "        print('VmHWM', int(_l.split()[1]) * 1024)\n")
_CLI = "import sys\nfrom dvidshards.cli import main\nrc = main(sys.argv[1:])" + _HWM + "sys.exit(rc)"
_GATHER = ("import sys\nfrom dvidshards.jobs.stats import body_stats_table\n"
           "t = body_stats_table(sys.argv[1], scheduler=sys.argv[2], progress=False, max_rows=10**9)" + _HWM)


def held_out(workdir: Path, shape=(512, 512, 256), cells=(16, 4), log=print) -> dict:
    """Part 1: returns {cell: {...}} with rows, exactness, client peaks (and prints the table)."""
    import pyarrow.parquet as pq

    exports = {c: tiled_export(workdir, shape, c, log=log) for c in cells}
    res: dict = {}
    with ExternalCluster(2) as cl:
        log(f"external dask scheduler {cl.address}, 2 workers")
        for c in cells:  # warm the workers (imports, kernels) before measuring
            out = Path(tempfile.mkdtemp(prefix="bench-stats-")) / "sizes"
            run_child(_CLI, "stats", str(exports[c]), str(out), "--scheduler", cl.address, "--quiet")
            shutil.rmtree(out.parent)
            break
        for c in cells:
            out = Path(tempfile.mkdtemp(prefix="bench-stats-")) / "sizes"
            rc, peak, wall, text = run_child(_CLI, "stats", str(exports[c]), str(out),
                                             "--scheduler", cl.address, "--quiet")
            if rc != 0:
                raise RuntimeError(f"stats exited {rc}: {text[-3000:]}")
            counts = np.load(exports[c].parent / "bincount.npy")
            ok, why = check_table(pq.read_table(out), shape, c, counts)
            shutil.rmtree(out.parent)
            grc, gpeak, gwall, gtext = run_child(_GATHER, str(exports[c]), cl.address)
            if grc != 0:
                raise RuntimeError(f"body_stats_table exited {grc}: {gtext[-3000:]}")
            res[c] = {"rows": len(expected(shape, c)["label"]), "ok": ok, "why": why, "peak": peak, "wall": wall,
                      "gather_peak": gpeak, "gather_wall": gwall}
    lo, hi = res[cells[0]], res[cells[-1]]
    grow, ggrow = hi["peak"] - lo["peak"], hi["gather_peak"] - lo["gather_peak"]
    rows = [[f"{r['rows']:,}", "exact" if r["ok"] else f"WRONG: {r['why']}", f"{r['peak'] / MIB:.0f}",
             f"{r['wall']:.1f}", f"{r['gather_peak'] / MIB:.0f}", f"{r['gather_wall']:.1f}"]
            for r in res.values()]
    rows.append(["growth", "", f"{grow / MIB:+.1f}", "", f"{ggrow / MIB:+.1f}", ""])
    table(["bodies", "table vs tiling + bincount", "stats client peak MiB", "wall s",
           "gather-table client peak MiB (body_stats_table)", "wall s"], rows,
          title=f"held-out bar: stats on an external dask scheduler + 2 workers, {'x'.join(map(str, shape))} voxels")
    print(f"client peak growth {grow / MIB:+.1f} MiB (target <= {TARGET_MIB}): "
          f"{common.verdict(grow <= TARGET_MIB * MIB and all(r['ok'] for r in res.values()))}; a client that "
          f"gathers the table grows {ggrow / MIB:+.1f} MiB ({ggrow / max(grow, MIB):.0f}x)\n")
    return {"results": res, "growth": grow, "gather_growth": ggrow}


# --------------------------------------------------------------------------- part 2: procedural mCNS s0


_HWM_FN = r"""
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
"""

_PLAN = _HWM_FN + r"""
import json, os, pickle, sys, time
t0 = time.perf_counter()
import dvidshards
from tests.support.procedural import ProceduralStore
import dvidshards.jobs.buckets as bk
from dvidshards.jobs.labelindex import run_task as index_task
from dvidshards.jobs.stats import run_task as stats_task
from dvidshards.stores import as_store
kind = sys.argv[1]
t1 = time.perf_counter()
store = ProceduralStore()
ds = dvidshards.Dataset(store, spec=store.spec)
s = ds.scale(0)
t2 = time.perf_counter()
origins = bk.shard_origins(ds, s, None)
bits = bk.partition_bits(len(origins), None, bk.FAN_IN)
labels = bk.label_source("agglomerated")
params = bk.parameters(kind, s, None, labels, bits)
tasks = list(bk.plan(ds, s, origins, labels=labels, box=None, work=as_store(sys.argv[2], writable=True), bits=bits,
                     fan_in=bk.FAN_IN))
task = pickle.dumps((stats_task if kind == "stats" else index_task, tasks[0]))
t3 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "open": t2 - t1, "plan": t3 - t2, "shards": len(origins), "bits": bits,
                  "task_bytes": len(task), "peak": hwm()}))
"""

_STUB = _HWM_FN + r"""
import json, sys, time
t0 = time.perf_counter()
import dvidshards
from tests.support.procedural import ProceduralStore
import dvidshards.jobs.buckets as bk
import dvidshards.jobs.labelindex as li
import dvidshards.jobs.stats as st
st.run_task = li.run_task = bk.merge_task = bk.bucket_task = lambda task: 0
store = ProceduralStore()
ds = dvidshards.Dataset(store, spec=store.spec)
out, kind = sys.argv[1], sys.argv[2]
t1 = time.perf_counter()
if kind == "stats":
    rep = st.body_stats(ds, out, scale=0, scheduler="threads:2", progress=False)
else:
    rep = li.label_index(ds, out, scale=0, scheduler="threads:2", progress=False)
t2 = time.perf_counter()
print(json.dumps({"start": t1 - t0, "job": t2 - t1, "shards": rep.totals.shards, "ok": rep.ok, "peak": hwm()}))
"""

_TASK = r"""
import json, os, resource, sys, time
os.environ.setdefault("DVIDSHARDS_KERNELS", "compiled")
import dvidshards
from tests.support.procedural import ProceduralStore
import dvidshards.jobs.buckets as bk
from dvidshards.jobs.labelindex import run_task as index_task
from dvidshards.jobs.stats import run_task as stats_task
from dvidshards.stores import as_store
kind, work, k = sys.argv[1], sys.argv[2], int(sys.argv[3])
store = ProceduralStore()
ds = dvidshards.Dataset(store, spec=store.spec)
origin = bk.shard_origins(ds, ds.scale(0), None)[k]
task = bk.ShardTask(ds, 0, origin, bk.label_source("agglomerated"), None, as_store(work, writable=True), 6)
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
before = rss()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
w0, c0 = time.perf_counter(), time.process_time()
rows = (stats_task if kind == "stats" else index_task)(task)
w1, c1 = time.perf_counter(), time.process_time()
peak = 0
for line in open("/proc/self/status"):
    if line.startswith("VmHWM:"):
        peak = int(line.split()[1]) * 1024
chunks = len(ds.shard(0, origin).table())
size = os.path.getsize(os.path.join(work, task.key))
print(json.dumps({"origin": origin, "chunks": chunks, "rows": rows, "wall": w1 - w0, "cpu": c1 - c0,
                  "before": before, "peak": peak, "bytes": size}))
"""


def _json_child(code: str, *args: str) -> tuple[dict, int]:
    rc, peak, _, text = run_child(code, *args)
    if rc != 0:
        raise RuntimeError(f"child exited {rc}: {text[-3000:]}")
    return json.loads(text.strip().splitlines()[-1]), peak


def procedural(samples: int, seed: int = 7, log=print) -> dict:
    """Part 2: planning, the stubbed whole job, and sampled real tasks over the procedural mCNS s0."""
    res: dict = {}
    rows = []
    for kind, name in (("stats", "stats"), ("index", "label-index")):
        with tempfile.TemporaryDirectory(prefix="bench-plan-") as tmp:
            plan, _ = _json_child(_PLAN, kind, tmp)
            stub, _ = _json_child(_STUB, os.path.join(tmp, "out"), kind)
        res[kind] = {"plan": plan, "stub": stub}
        rows.append([name, f"{plan['shards']:,}", f"{1 << plan['bits']:,}", f"{plan['open']:.2f}",
                     f"{plan['plan']:.2f}", f"{plan['peak'] / MIB:.0f}", f"{plan['task_bytes']:,}",
                     f"{stub['job']:.1f}", f"{stub['peak'] / MIB:.0f}"])
        log(f"{name}: planned")
    table(["job", "shards (tasks)", "buckets", "open s", "plan s", "planning client peak MiB",
           "bytes per pickled task", "whole job, tasks stubbed: client s", "client peak MiB"], rows,
          title="procedural mCNS s0: the client's cost (targets: peak <= 2 GiB, planning <= 2 min)")
    rng = random.Random(seed)
    n = res["stats"]["plan"]["shards"]
    picks = rng.sample(range(n), samples)
    trows = []
    for kind in ("stats", "index"):
        res[kind]["tasks"] = []
        for k in picks:
            with tempfile.TemporaryDirectory(prefix="bench-task-") as tmp:
                r, _ = _json_child(_TASK, kind, tmp, str(k))
            res[kind]["tasks"].append(r)
            trows.append([kind, str(tuple(r["origin"])), f"{r['chunks']:,}", f"{r['rows']:,}", f"{r['wall']:.1f}",
                          f"{r['cpu']:.1f}", f"{r['cpu'] / r['chunks'] * 1e3:.2f}",
                          f"{(r['peak'] - r['before']) / MIB:.0f}", f"{r['bytes'] / MIB:.1f}"])
            log(f"{kind} task {k}: {r['wall']:.1f} s")
    table(["job", "shard origin", "chunks", "partial rows", "wall s", "CPU s", "CPU ms per chunk",
           "task peak over before MiB", "partial file MiB"], trows,
          title=f"procedural mCNS s0: {samples} random shard tasks per job, each in a fresh process")
    for kind in ("stats", "index"):
        t = res[kind]["tasks"]
        per_chunk = sum(r["cpu"] for r in t) / sum(r["chunks"] for r in t)
        print(f"{kind}: {per_chunk * 1e3:.2f} CPU-ms per chunk over the sample -> "
              f"{per_chunk * 595e6 / 3600:,.0f} core-hours for the map phase of ~595 M s0 chunks")
    print()
    return res


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--part", choices=["1", "2", "all"], default="all")
    p.add_argument("--samples", type=int, default=None, help="random shard tasks per job in part 2 (default 4)")
    args = p.parse_args()
    common.header("bench_stats_client: the stats client at 16 K and 1 M bodies; planning over mCNS s0")
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    if args.part in ("1", "all"):
        shape = (256, 256, 128) if args.quick else (512, 512, 256)
        held_out(work, shape, log=log)
    if args.part in ("2", "all"):
        procedural(args.samples or (1 if args.quick else 4), log=log)
    print(f"(this process's peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB)")


if __name__ == "__main__":
    main()
