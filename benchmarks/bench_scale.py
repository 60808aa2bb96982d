"""Every whole-export job planned, submitted and sampled over an mCNS-shaped export (issue 22).

The export is ``tests.support.procedural.ProceduralStore``: the real mCNS geometry (12
scales, ~26,500 shard files at s0 holding ~6*10^8 chunks, ~10^8 supervoxels), synthesized on
demand, nothing stored. For each job, in a fresh process of its own (so that its peak RSS is its
own):

* **plan** - open the export and run the job's public entry point until its first phase hands
  its tasks to the task runner: planning time (from the start of the process's work), client
  peak RSS, number of tasks, bytes per pickled task (the task function and item, as dask sends
  them);
* **submit** - every task of that phase submitted through a dask ``LocalCluster`` of 2 workers
  with a stand-in body (the real function and item travel, nothing is computed): scheduler
  overhead per task and the client's peak RSS while it holds the bounded window of futures
  (``--submit N`` caps the number of tasks; 0 skips);
* **sample** - ``--sample K`` random real tasks, each in a fresh process: wall, CPU and peak
  RSS of the task, and the core-hours projected for the whole phase: CPU per chunk of the
  sampled tasks times the phase's chunks (estimated from 200 random shards per scale; every
  task of these jobs covers one source shard). ``meshes`` samples K *dense* shards of level 0's
  scale instead (fixed order; at least 95 % of their chunks, a central all-tissue block), runs
  the map and the reduce over that block, and projects from the median CPU per chunk (the
  spread over the K samples beside it). ``skeletons`` likewise samples the central cube (8³ chunks)
  of K dense shards of s2 and reduces what it wrote.

Targets (issue 22): client peak <= 2 GiB and planning <= 2 min for every job.

Run: ``python benchmarks/bench_scale.py`` (all jobs; ``--jobs stats,convert``;
``--sample 1``; ``--submit 2000``).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import pickle
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common as C
import numpy as np

JOBS = ("stats", "label-index", "convert", "pcg-edges", "meshes", "skeletons")
CLIENT_TARGET_MIB = 2048
PLAN_TARGET_S = 120


class _Planned(BaseException):  # not an Exception: no job catches it on its way out
    pass


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


_STORE = None


def _store():
    global _STORE
    if _STORE is None:
        from tests.support.procedural import ProceduralStore

        _STORE = ProceduralStore()
    return _STORE


def _task_shard(job: str, item) -> tuple[int, tuple]:
    """(scale, origin) of the source shard a task covers."""
    if job == "pcg-edges":  # a block of PCG chunks (8³ of 256³ by default): the 2048³ source shard at its corner
        lo = item.job.lo + np.asarray(item.key, np.int64) * np.asarray(item.job.group) * item.job.cs
        return 0, tuple(int(v) // 2048 * 2048 for v in lo)
    if job == "convert":
        return int(item.scale), tuple(item.sources[0])
    if job == "skeletons":  # a cube of 8³ chunks of one shard
        return item.job.scale, item.shard
    return int(item.scale), tuple(item.origin)  # meshes, stats and label-index: one source shard


def _census(scales: list[int], n: int = 200) -> dict:
    """{scale: estimated chunks} from ``n`` random shards per scale."""
    store = _store()
    out = {}
    for k in scales:
        origins = store.shard_origins(k)
        pick = random.Random(k).sample(origins, min(n, len(origins)))
        mean = sum(len(store.shard_chunks(k, o)) for o in pick) / max(len(pick), 1)
        out[k] = mean * len(origins)
    return out


def _start(job: str, out: Path):
    """The job's public entry point over the procedural export (runs until its first phase)."""
    from dvidshards import Dataset

    store = _store()
    ds = Dataset(store, spec=store.spec)
    kw = {"scheduler": "serial", "progress": False}
    if job == "stats":
        _job("stats").body_stats(ds, out / "stats", scale=0, **kw)
    elif job == "label-index":
        _job("labelindex").label_index(ds, out / "index", scale=0, **kw)
    elif job == "convert":
        _job("convert").convert(ds, out / "precomputed", format="precomputed", **kw)
    elif job == "pcg-edges":
        _job("pcg").pcg_edges(ds, out / "pcg", chunk_size=(256, 256, 256), **kw)
    elif job == "meshes":
        _job("meshes").meshes(ds, out / "meshes", **kw)  # the default: level 0 at >= 32 nm
    elif job == "skeletons":
        _job("skeletons").skeletons(ds, out / "skeletons", **kw)  # the default: s2 (32 nm)
    else:
        raise SystemExit(f"unknown job {job!r}")


def _job(name: str):
    """A job's module (``dvidshards.jobs`` gives its function under the module's name)."""
    return importlib.import_module(f"dvidshards.jobs.{name}")


class _Stub:
    """A stand-in task body: carries the real function (its pickled bytes travel), runs nothing."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, item):
        return None


def _child(job: str, mode: str, arg: int) -> dict:
    """One measurement in this (fresh) process; returns a dict printed as JSON."""
    from dvidshards.jobs import runner

    t0 = time.perf_counter()
    got: dict = {"job": job}
    real = runner.TaskRunner.run

    def run(self, fn, items, *, desc="tasks", done=None, **kw):
        items = list(items)
        got["plan_s"] = time.perf_counter() - t0
        got["tasks"] = len(items)
        got["desc"] = desc
        got["plan_peak_mib"] = _peak_mib()
        sample = random.Random(1).sample(items, min(20, len(items)))
        sizes = [len(pickle.dumps((fn, it), protocol=5)) for it in sample]
        got["task_bytes"] = sum(sizes) / max(len(sizes), 1)
        if mode == "submit" and arg:
            todo = items[:arg]
            with runner.TaskRunner("local:2", progress=False) as tr:
                tr.client()
                t = time.perf_counter()
                rep = real(tr, _Stub(fn), todo, desc="stand-in")
                got["submit_n"] = len(todo)
                got["overhead_ms"] = (time.perf_counter() - t) / max(len(todo), 1) * 1e3
                got["submit_failed"] = len(rep.failed)
            got["submit_peak_mib"] = _peak_mib()
        elif mode == "sample":
            it = _dense_mesh_item(items, arg) if job == "meshes" else _dense_cube(items, arg) if job == "skeletons" \
                else random.Random(arg).choice(items)
            got["item"] = str(it)[:80]  # as failures name the task
            scale, origin = _task_shard(job, it)
            got["chunks"] = len(_store().shard_chunks(scale, origin))
            base = _peak_mib()
            c, t = time.process_time(), time.perf_counter()
            if job == "meshes":
                res = _mesh_sample(fn, it, got)
            elif job == "skeletons":
                res = _skeleton_sample(fn, it, got)
            else:
                res = fn(it)
            got["task_s"] = time.perf_counter() - t
            got["task_cpu_s"] = time.process_time() - c
            got["task_peak_mib"] = _peak_mib()
            got["task_rss_before_mib"] = base
            got["result_bytes"] = len(pickle.dumps(res, protocol=5))
        raise _Planned

    runner.TaskRunner.run = run  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory(prefix="dvidshards-scale-") as tmp:
        try:
            _start(job, Path(tmp))
        except _Planned:
            pass
    return got


MESH_BOX = 8  # meshes: chunks a side of the sampled block of a shard (a whole s2 shard is ~1 CPU-hour)
MESH_DENSE = 0.95  # meshes: a sampled shard holds at least this share of its chunks


def _dense_mesh_item(items, k: int):
    """meshes: the k-th dense shard (``items``: tasks with ``scale`` and ``origin``) of level 0's scale (the
    scale that holds ~88 % of the chunks meshed), in a fixed shuffled order: one whose chunks fill at
    least MESH_DENSE of it and whose central MESH_BOX³ block is all tissue (every chunk present, no
    background slot), so the CPU per chunk is that of dense tissue, never that of a lucky sparse edge
    shard."""
    first = items[0].scale
    todo = sorted((it for it in items if it.scale == first), key=lambda it: it.origin)
    random.Random(1234).shuffle(todo)
    store = _store()
    full = (2048 // 64) ** 3
    seen = 0
    for it in todo:
        c = np.asarray(store.shard_chunks(first, it.origin), np.int64)
        if len(c) < MESH_DENSE * full:
            continue
        lo = np.median(c, axis=0).astype(np.int64) - MESH_BOX // 2
        present, inside = store._chunk_masks(first, lo.tolist(), (lo + MESH_BOX).tolist())
        if not (present.all() and inside.all()):
            continue
        if seen == k:
            return it
        seen += 1
    raise SystemExit(f"meshes: fewer than {k + 1} dense shards at s{first}")


def _mesh_sample(fn, item, got: dict):
    """meshes: the map task on a block of MESH_BOX³ chunks of the sampled shard (the job's ``box``),
    then the reduce tasks over what it wrote (each piece is reduced once in a whole run), so the
    CPU per chunk covers both phases. ``got["chunks"]`` becomes the chunks of the block."""
    M = _job("meshes")
    F = _job("fragments")
    job = item.job
    scale, origin = int(item.scale), tuple(int(v) for v in item.origin)
    f = 2 ** job.scales.index(scale)
    chunks = _store().shard_chunks(scale, origin)
    c = np.asarray(chunks, np.int64)
    centre = np.median(c, axis=0).astype(np.int64)  # a block inside the tissue the shard holds
    lo = centre - MESH_BOX // 2
    inside = ((c >= lo) & (c < lo + MESH_BOX)).all(axis=1)
    got["chunks"] = int(inside.sum())
    got["item"] = f"{got.get('item', '')[:50]} block {MESH_BOX}^3 at chunk {lo.tolist()}"
    cs = 64
    job = dataclasses.replace(job, box=((lo * cs * f).tolist(), ((lo + MESH_BOX) * cs * f).tolist()))
    task = dataclasses.replace(item, job=job)
    c0 = time.process_time()
    res = fn(task)
    c1 = time.process_time()
    n = 0
    for b in F.buckets_of(job.work, task.key).tolist():
        n += M.write_bucket(M.BucketTask(job, (task.key,), int(b)))
    res["bodies"] = n
    got["map_cpu_s"], got["reduce_cpu_s"] = c1 - c0, time.process_time() - c1
    return res


def _dense_cube(items, k: int):
    """skeletons: the central cube of the k-th dense shard of the skeleton scale (as for meshes)."""
    first = items[0].job.scale
    by_shard = {}
    for it in items:
        by_shard.setdefault(it.shard, []).append(it)
    shard = _dense_mesh_item([_At(first, o) for o in by_shard], k).origin
    c = np.asarray(_store().shard_chunks(first, shard), np.int64)
    centre = np.median(c, axis=0) * 64
    return min(by_shard[shard], key=lambda it: float(np.abs(np.asarray(it.origin) + 256 - centre).sum()))


@dataclasses.dataclass(frozen=True)
class _At:
    scale: int
    origin: tuple


def _skeleton_sample(fn, task, got: dict):
    """skeletons: the cube's task, then the reduce of every bucket its partial file holds (each piece is
    reduced once in a whole run), so the CPU per chunk covers both phases."""
    import pyarrow as pa

    S = _job("skeletons")

    c = np.asarray(_store().shard_chunks(task.job.scale, task.shard), np.int64)
    c0 = np.asarray(task.origin, np.int64) // 64
    got["chunks"] = int(((c >= c0) & (c < c0 + S.TASK)).all(axis=1).sum())
    got["item"] = f"s{task.job.scale} cube {list(task.origin)}"
    t0 = time.process_time()
    res = fn(task)
    t1 = time.process_time()
    with task.job.work.open(task.key) as f:
        buckets = np.unique(pa.ipc.open_file(f).read_all()["bucket"].to_numpy())
    res["bodies"] = sum(S.bucket_task(S.BucketTask(task.job, (task.key,), int(b)))["bodies"] for b in buckets)
    got["map_cpu_s"], got["reduce_cpu_s"] = t1 - t0, time.process_time() - t1
    return res


def _spawn(job: str, mode: str, arg: int, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--child", job, mode, str(arg)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=str(C.ROOT))
    for line in r.stdout.splitlines()[::-1]:
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"{job} {mode}: no result (exit {r.returncode}):\n{r.stderr[-3000:]}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        job, mode, arg = sys.argv[2], sys.argv[3], int(sys.argv[4])
        if mode == "census":
            print(json.dumps({str(k): v for k, v in _census(list(range(arg))).items()}))
        else:
            print(json.dumps(_child(job, mode, arg)))
        return
    p = C.parser(__doc__)
    p.add_argument("--jobs", default=",".join(JOBS), help=f"comma-separated, of {', '.join(JOBS)}")
    p.add_argument("--submit", type=int, default=3000,
                   help="tasks submitted with a stand-in body to measure scheduler overhead (0: skip)")
    p.add_argument("--sample", type=int, default=1, help="random real tasks executed per job, each in a fresh process")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per child process")
    args = p.parse_args()
    jobs = [j for j in args.jobs.split(",") if j]
    C.header("bench_scale: every job over the procedural mCNS export")
    rows, samples = [], []
    census = {int(k): v for k, v in _spawn("-", "census", 12, args.timeout).items()} if args.sample else {}
    if census:
        print(f"  estimated chunks: s0 {census[0]:,.0f}, all scales {sum(census.values()):,.0f}", file=sys.stderr)
    for job in jobs:
        plan = _spawn(job, "plan", 0, args.timeout)
        sub = _spawn(job, "submit", args.submit, args.timeout) if args.submit else {}
        got = [_spawn(job, "sample", k, args.timeout) for k in range(args.sample)]
        samples += got
        ok = plan["plan_s"] <= PLAN_TARGET_S and max(plan["plan_peak_mib"], sub.get("submit_peak_mib", 0)) \
            <= CLIENT_TARGET_MIB
        cpu = [g["task_cpu_s"] for g in got]
        chunks = sum(census.values()) if job == "convert" else census.get(0, 0)
        if job == "meshes":  # the levels' scales: s2 (32 nm) and every coarser one, up to 6 levels
            chunks = sum(census.get(k, 0) for k in range(2, 8))
        if job == "skeletons":  # the skeleton scale: s2 (32 nm)
            chunks = census.get(2, 0)
        per_chunk = sum(cpu) / max(sum(g["chunks"] for g in got), 1)
        proj = per_chunk * chunks / 3600 if cpu else float("nan")
        proj_text = f"{proj:,.1f}" if cpu else "-"
        if job in ("meshes", "skeletons") and cpu:  # dense shards only: the median, and the spread
            per = sorted(g["task_cpu_s"] / max(g["chunks"], 1) for g in got)
            proj = statistics.median(per) * chunks / 3600
            proj_text = (f"{proj:,.1f}" + (f" (median of {len(per)}: {per[0] * chunks / 3600:,.0f}-"
                                            f"{per[-1] * chunks / 3600:,.0f})" if len(per) > 1 else ""))
            for g in got:
                print(f"  {job} sample {g['item']}: map {g['map_cpu_s'] / g['chunks'] * 1e3:.1f} + reduce "
                      f"{g['reduce_cpu_s'] / g['chunks'] * 1e3:.1f} ms CPU per chunk, peak {g['task_peak_mib']:.0f} MiB "
                      f"(before {g['task_rss_before_mib']:.0f})", file=sys.stderr)
        rows.append([job, plan["desc"], f"{plan['tasks']:,}", f"{plan['plan_s']:.2f}",
                     f"{plan['plan_peak_mib']:.0f}",
                     f"{sub['submit_peak_mib']:.0f}" if sub else "-",
                     f"{plan['task_bytes']:,.0f}",
                     f"{sub['overhead_ms']:.2f} ({sub['submit_n']:,})" if sub else "-",
                     proj_text, C.verdict(ok)])
        print(f"  {job}: planned {plan['tasks']:,} tasks in {plan['plan_s']:.2f} s", file=sys.stderr, flush=True)
    C.table(["job", "first phase", "tasks", "plan s", "client peak MiB (plan)", "client peak MiB (submit)",
                   "bytes per task", "overhead ms per task (n)", "projected core-h (CPU per chunk x chunks)", "targets"], rows,
                  title=f"Planning and submission over ProceduralStore() (s0: 26,456 shards), targets: plan <= "
                        f"{PLAN_TARGET_S} s, client <= {CLIENT_TARGET_MIB} MiB")
    if samples:
        C.table(["job", "task", "chunks", "wall s", "CPU s", "CPU ms per chunk", "peak MiB (process)",
                 "RSS before MiB", "result bytes"],
                      [[g["job"], g["item"], f"{g['chunks']:,}", f"{g['task_s']:.1f}", f"{g['task_cpu_s']:.1f}",
                        f"{g['task_cpu_s'] / max(g['chunks'], 1) * 1e3:.2f}",
                        f"{g['task_peak_mib']:.0f}", f"{g['task_rss_before_mib']:.0f}", f"{g['result_bytes']:,}"]
                       for g in samples], title="Sampled real tasks (each in a fresh process)")


if __name__ == "__main__":
    os.environ.setdefault("DVIDSHARDS_KERNELS", "compiled")
    main()
