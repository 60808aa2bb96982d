"""PCG edges and components per 256³ chunk vs the bulk read of the chunk plus its halo.

Run from the project root::

    python benchmarks/bench_pcg.py [--quick] [--rounds N] [--level L] [--workdir DIR] [--data DIR]

One ``dvidshards.pcg`` task per PCG chunk (``_Job.run``: block id lists from the records, the
chunk and its six 1-voxel face slabs read with a palette of id-list indexes, the contact kernel, edges,
components, zstd at ``--level`` (default 3, the library's default), three files written) against the floor: the bulk
read of the chunk plus its halo, one box ``Dataset.read([a - 1, b + 1], labels="supervoxels",
threads=1)`` clipped to the volume. Also shown: the bulk read of the chunk alone. All
single-threaded, timed interleaved over ``--rounds`` rounds (one untimed warm-up); wall and CPU
(``process_time``) medians per chunk.

Data sets:

* synthetic 512³: ``common.synthetic_pair`` (200 neuron-like bodies of 8 supervoxels, ~70 %
  foreground, median ~20 labels per 64³ block); its 8 PCG chunks.
* real blocks, tiled: the 32,768-record mCNS scale-1 shard of ``common.big_shard_export``
  (every chunk of the 2048³ box holds a real block, reused cyclically): 8 interior 256³ chunks
  (full neighbours). Denser than real tissue and with unrelated neighbouring blocks, so more
  contacts across block faces than real data: a pessimistic case for the kernel.

The projection to the real export's s0 (``mcns-ng-specs.json`` scale 0) scales the measured
per-chunk CPU time and output size to its 256³ grid.

Planning at full size (issue 22 items 2-3): ``pcg-edges`` over the procedural mCNS export's s0
(``tests.support.procedural.ProceduralStore``: ~26 K shard files of 2048³, 256³ PCG chunks),
in a fresh child process standing for the client: planning time, client peak RSS, tasks, bytes
per pickled task; then every task (``--submit-tasks``, default all) submitted through the job's
runner to a LocalCluster of 2 workers with a stand-in task function (unpickles the real task,
lists its chunks, returns a result of the real shape), for the scheduler overhead per task and
the client's peak RSS while it holds the results. Baseline in the same child: the planner before
(one item per chunk, a Python triple loop per shard) timed on ``--old-shards`` shards and scaled
to all. Last, ``--sample`` random tasks (default 2) run for real, each in a fresh process as on
a worker: wall and CPU time, peak RSS, result size. ``--mcns-only`` skips the per-chunk tables::

    python benchmarks/bench_pcg.py --mcns-only [--sample 2] [--sample-chunks K] [--submit-tasks N]

Last ``--mcns-only`` run (2026-11-26, 2 cores shared, load average 3-13; times inflated)::

    procedural mCNS s0: 26,456 shard files, grid 368×306×526 chunks of 256³
                                           now                              before (one task per chunk)
    tasks                                  26,456 (blocks of 8×8×8 chunks)  13,545,472
    planning time                          0.62 s                           53 s (est. from 300 shards)
    client peak RSS after planning         207 MiB                          +1,180 MiB for the item set alone
    bytes per pickled task (fn + item)     4,648                            same job + a chunk
    results held by the client             26,456 × 145 B                   13,545,472 × ~851 B
    submit + run all 26,456 stand-ins      529 s = 20.0 ms per task         75 h of overhead at that rate
    client peak RSS during submission      424 MiB (before 237)             target <= 2 GiB: met

    sample tasks (fresh process, 1 decoding thread, zstd 3, load 4.5)
    task key      chunks  with files  pieces  edges      wall s  CPU s  CPU ms/chunk  peak RSS MiB  result bytes
    (22, 13, 13)  512     512         76,932  1,258,536  123.2   58.5   114           627           179
    (23, 7, 16)   512     258         34,998  537,351    27.4    24.3   48            626           175
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import common as C
import numpy as np

import dvidshards
from dvidshards.formats import pcg as fmt
from dvidshards.jobs import pcg, pcgfiles
from dvidshards.stores import as_store

CS = (256, 256, 256)


def _job(root, spec, scale, out, level):
    ds = dvidshards.Dataset(root, spec=spec)
    s = ds.scale(scale)
    grid = -(-np.asarray(s.size) // CS)
    layout = fmt.IdLayout(fmt.layers_for_grid(grid))
    Path(out, pcgfiles.SIDE_TABLE).mkdir(parents=True, exist_ok=True)
    return pcg.PcgJob(ds, s, as_store(out, writable=True), as_store(Path(out) / "work", writable=True), CS, layout,
                      None, "area", level, 1, True)


def _timed(fn):
    w, c = time.perf_counter(), time.process_time()
    r = fn()
    return time.perf_counter() - w, time.process_time() - c, r


def _breakdown(job, c) -> dict:
    """One task's stages, timed separately (CPU seconds)."""
    import zstandard

    t = {}
    st = time.process_time()
    lists, table = job.id_lists(c)
    t["id lists"] = time.process_time() - st
    st = time.process_time()
    vol = job.read_halo(c, lists)
    t["read"] = time.process_time() - st
    st = time.process_time()
    ct = fmt.contacts(vol.T, lists[0], lists[1:], indexed=True)
    t["kernel"] = time.process_time() - st
    st = time.process_time()
    edges, pieces, nb = fmt.chunk_graph(ct, c, lists[0], lists[1:], job.layout)
    groups = fmt.group_components(np.concatenate([pieces[0], nb[0]]),
                                  job.body_of(np.concatenate([pieces[1], nb[1]]), table))
    t["graph"] = time.process_time() - st
    st = time.process_time()
    raw = fmt.encode_edges(edges)
    comp = fmt.encode_components(groups)
    t["encode"] = time.process_time() - st
    st = time.process_time()
    z = zstandard.ZstdCompressor(level=job.level).compress(raw)
    t["zstd"] = time.process_time() - st
    st = time.process_time()
    z17 = zstandard.ZstdCompressor(level=17).compress(raw)
    t["_zstd17"] = (time.process_time() - st, len(z17))
    t["_sizes"] = (len(raw), len(z), len(comp), len(pieces[0]), {k: len(v[0]) for k, v in edges.items()})
    return t


def bench(name, root, spec, scale, chunks, rounds, level, workdir) -> dict:
    out = Path(tempfile.mkdtemp(prefix="pcgbench-", dir=workdir))
    try:
        job = _job(root, spec, scale, out, level)
        for c in chunks[:1]:  # load kernels, shards and protobuf outside the timings
            job.run(c)
        def floor(c):
            a, b = job.box(c)
            lo, hi = np.maximum(a - 1, job.lo), np.minimum(b + 1, job.hi)
            return job.ds.read([lo.tolist(), hi.tolist()], scale=job.scale, labels="supervoxels", threads=1,
                               fill_missing_shards=True)

        def chunk_only(c):
            a, b = job.box(c)
            return job.ds.read([a.tolist(), b.tolist()], scale=job.scale, labels="supervoxels", threads=1,
                               fill_missing_shards=True)

        fns = {"floor": floor, "pcg": lambda c: job.run(c), "chunk": chunk_only}
        wall = {k: [] for k in fns}
        cpu = {k: [] for k in fns}
        results = {}
        for r in range(rounds + 1):
            order = list(fns)[r % 3:] + list(fns)[:r % 3]
            for c in chunks:
                for k in order:
                    w, p, res = _timed(lambda k=k, c=c: fns[k](c))
                    if r:
                        wall[k].append(w)
                        cpu[k].append(p)
                    if k == "pcg":
                        results[c] = res
        stages = [_breakdown(job, c) for c in chunks]
        files = sum(p.stat().st_size for p in out.glob("*.proto*"))
        part = pcgfiles.Part()
        for c in chunks:
            part.add(c, results[c][1], results[c][0]["written"])
        pcgfiles.write_part(job.dest, f"{pcgfiles.SIDE_TABLE}/all.parquet", part)
        pq_rows = part.rows
        parquet = (out / pcgfiles.SIDE_TABLE / "all.parquet").stat().st_size
        pieces_bytes = parquet  # the side-table part is the resume record now
    finally:
        shutil.rmtree(out, ignore_errors=True)
    vox = float(np.mean([np.prod(np.subtract(*job.box(c)[::-1])) for c in chunks]))
    return {"name": name, "chunks": len(chunks), "voxels": vox, "wall": wall, "cpu": cpu, "stages": stages,
            "files": files, "pieces_bytes": pieces_bytes, "parquet": parquet, "rows": pq_rows}


# --------------------------------------------------------------------------- mCNS planning (issue 22)


def _mcns_job(out: str):
    from tests.support.procedural import ProceduralStore

    store = ProceduralStore()
    ds = dvidshards.Dataset(store, spec=store.spec)
    s = ds.scale(0)
    grid = -(-np.asarray(s.size) // CS)
    layout = fmt.IdLayout(fmt.layers_for_grid(grid))
    dest = as_store(out, writable=True)
    return pcg.PcgJob(ds, s, dest, dest.child("work"), CS, layout, None, "area", 3, 1, True), store


def _dry_task(task):
    """Stand-in task: the real task unpickled, its chunks listed, a result of the real shape."""
    members = task.job.members(task)
    return {**dict.fromkeys(pcg._COUNTS, 0), "chunks": len(members), "skipped": 0, "failed": {}, "part_rows": 0,
            "part_written": 0}


def _old_items(job, origins) -> set:
    """The planner before (commit 842aed7, ``_job_items`` with one chunk per task): a Python
    triple loop over the chunks of every shard."""
    lo, hi, g = job.lo, job.hi, 1
    extent = min(job.scale.shard_extent, 1 << 40)
    found = set()
    for o in origins:
        a, b = np.maximum(np.asarray(o, np.int64), lo), np.minimum(np.asarray(o, np.int64) + extent, hi)
        if (b <= a).any():
            continue
        c0, c1 = (a - job.lo) // job.cs // g, ((b - 1 - job.lo) // job.cs) // g + 1
        for x in range(int(c0[0]), int(c1[0])):
            for y in range(int(c0[1]), int(c1[1])):
                for z in range(int(c0[2]), int(c1[2])):
                    found.add((x, y, z))
    return found


def child_plan(args) -> None:
    """The client: plan, pickle, submit; one JSON line."""
    import pickle
    import tracemalloc

    from dvidshards.jobs.runner import TaskRunner

    res = {"rss_start": C.rss()}
    t = time.perf_counter()
    job, store = _mcns_job(str(args.workdir / "pcg-mcns-plan"))
    res["open_s"] = time.perf_counter() - t
    t = time.perf_counter()
    tasks = pcg.plan(job)
    res["plan_s"] = time.perf_counter() - t
    res["plan_peak"] = C.peak_rss()
    res.update(tasks=len(tasks), group=list(job.group), shards=len(store.shard_origins(0)),
               grid=[int(v) for v in job.grid], chunks=int(sum(len(job.members(k)) for k in tasks)))
    fn = pcg.run_task
    rng = np.random.default_rng(0)
    sizes = [len(pickle.dumps((fn, tasks[int(i)]))) for i in rng.integers(0, len(tasks), 200)]
    res.update(task_bytes_mean=float(np.mean(sizes)), task_bytes_max=int(max(sizes)))
    res["result_bytes"] = len(pickle.dumps(_dry_task(tasks[0])))
    # the planner before, on a sample of shards
    origins = store.shard_origins(0)
    k = min(args.old_shards, len(origins))
    tracemalloc.start()
    t = time.perf_counter()
    old = _old_items(job, origins[:k])
    dt = time.perf_counter() - t
    mem = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    res["old"] = {"shards": k, "items": len(old), "seconds": dt, "bytes": mem}
    one = {"pieces": 0, "isolated": 0, "in": 0, "between": 0, "cross": 0, "bytes": 0, "written": False}
    res["old"]["result_bytes"] = sys.getsizeof(one) + sum(sys.getsizeof(v) + sys.getsizeof(k) for k, v in one.items())
    del old
    # submission of every task through the runner, stand-in work
    n = min(args.submit_tasks or len(tasks), len(tasks))
    with TaskRunner("local:2", progress=False) as tr:
        tr.client()
        C.reset_peak_rss()
        before = C.rss()
        t = time.perf_counter()
        rep = tr.run(_dry_task, tasks[:n], desc="PCG tasks (stand-in)")
        res["submit"] = {"tasks": n, "seconds": time.perf_counter() - t, "failed": len(rep.failed),
                         "chunks": int(sum(r["chunks"] for r in rep.results.values())), "rss_before": before,
                         "peak": C.peak_rss()}
    print(json.dumps(res))


def child_task(path: str) -> None:
    """One real task in a fresh process (as a worker runs it); one JSON line."""
    import pickle
    import resource

    with open(path, "rb") as f:
        fn, task = pickle.load(f)
    w, c = time.perf_counter(), time.process_time()
    r = fn(task)
    wall, cpu = time.perf_counter() - w, time.process_time() - c
    print(json.dumps({"wall": wall, "cpu": cpu, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "result_bytes": len(pickle.dumps(r)), "chunks": r["chunks"], "pieces": r["part_rows"],
                      "written": r["part_written"], "failed": len(r["failed"]),
                      "edges": sum(r[k] for k in fmt.EDGE_TYPES), "load": C.load_text()}))


def _child(args_list: list[str]) -> dict:
    import subprocess

    out = subprocess.run([sys.executable, __file__, *args_list], capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"child {args_list} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def mcns(args) -> None:
    C.header("bench_pcg: planning pcg-edges over the procedural mCNS s0 (256³ chunks)")
    if not args.sample_only:
        plan_table(args)
    sample_tasks(args)


def plan_table(args) -> None:
    extra = ["--workdir", str(args.workdir), "--old-shards", str(args.old_shards)]
    if args.submit_tasks:
        extra += ["--submit-tasks", str(args.submit_tasks)]
    p = _child(["--child-plan", *extra])
    old = p["old"]
    scale_up = p["shards"] / old["shards"]
    old_items = old["items"] * scale_up
    sub = p["submit"]
    per_task = sub["seconds"] / sub["tasks"]
    rows = [
        ["tasks", f"{p['tasks']:,} (blocks of {'×'.join(map(str, p['group']))} chunks)",
         f"{old_items:,.0f} (one per chunk)", f"{old_items / p['tasks']:,.0f} × fewer"],
        ["chunks covered", f"{p['chunks']:,}", f"{old_items:,.0f}", "same"],
        ["planning time", f"{p['plan_s']:.2f} s", f"{old['seconds'] * scale_up:,.0f} s (est. from {old['shards']} shards)",
         f"{old['seconds'] * scale_up / p['plan_s']:,.0f} ×"],
        ["client peak RSS after planning", f"{p['plan_peak'] / C.MIB:,.0f} MiB",
         f"+{old['bytes'] * scale_up / C.MIB:,.0f} MiB for the item set alone (est.)", ""],
        ["bytes per pickled task (fn + item)", f"{p['task_bytes_mean']:,.0f} (max {p['task_bytes_max']:,})",
         "same job + a chunk (+16 B per supervoxel of a mapping object)", ""],
        ["results held by the client", f"{p['tasks']:,} × {p['result_bytes']} B pickled",
         f"{old_items:,.0f} × ~{old['result_bytes']} B", ""],
        [f"submit + run {sub['tasks']:,} stand-in tasks on local:2", f"{sub['seconds']:.0f} s = {per_task * 1e3:.1f} ms "
         f"per task; {sub['failed']} failed", f"{old_items * per_task / 3600:,.1f} h of overhead at that rate", ""],
        ["client peak RSS during submission", f"{sub['peak'] / C.MIB:,.0f} MiB (before: {sub['rss_before'] / C.MIB:,.0f})",
         "", f"target ≤ 2 GiB: {C.verdict(max(sub['peak'], p['plan_peak']) <= 2 * C.GIB)}"],
    ]
    C.table(["", "now", "before (one task per chunk)", "ratio"], rows,
            f"pcg-edges plan over the procedural mCNS s0: {p['shards']:,} shard files, grid "
            f"{'×'.join(map(str, p['grid']))} chunks of 256³")
    print(f"planning ≤ 2 min: {C.verdict(p['plan_s'] <= 120)}; no per-chunk loop on the client; load {C.load_text()}")



def sample_tasks(args) -> None:
    """A random sample of real tasks, each in a fresh process."""
    import pickle

    out = args.workdir / "pcg-mcns-sample"
    shutil.rmtree(out, ignore_errors=True)
    (out / pcgfiles.SIDE_TABLE).mkdir(parents=True)
    job, _ = _mcns_job(str(out))
    tasks = pcg.plan(job)
    rng = np.random.default_rng(args.seed)
    srows = []
    for i in rng.choice(len(tasks), args.sample, replace=False):
        task = tasks[int(i)]
        if args.sample_chunks:
            task = pcg.PcgTask(job, task.key, tuple(job.members(task)[:args.sample_chunks]))
        f = out / f"task-{i}.pkl"
        f.write_bytes(pickle.dumps((pcg.run_task, task)))
        r = _child(["--child-task", str(f)])
        srows.append([str(task.key), r["chunks"], r["written"], f"{r['pieces']:,}", f"{r['edges']:,}", r["failed"],
                      f"{r['wall']:.1f}", f"{r['cpu']:.1f}", f"{r['cpu'] / max(r['chunks'], 1) * 1e3:.0f}",
                      f"{r['peak'] / C.MIB:,.0f}", r["result_bytes"], r["load"]])
    C.table(["task key", "chunks", "with files", "pieces", "edges", "failed", "wall s", "CPU s", "CPU ms per chunk",
             "peak RSS MiB", "result bytes", "load average"], srows,
            "Sample tasks run for real (fresh process each, 1 decoding thread, zstd 3)")
    shutil.rmtree(out, ignore_errors=True)


def main(argv=None):
    ap = C.parser(__doc__)
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds over the chunks (default 5; --quick 1)")
    ap.add_argument("--level", type=int, default=3, help="zstd level of the edges files (default 3; PCG writes 17)")
    ap.add_argument("--mcns-only", action="store_true", help="only the procedural mCNS planning and sample tasks")
    ap.add_argument("--no-mcns", action="store_true", help="skip the procedural mCNS planning and sample tasks")
    ap.add_argument("--sample", type=int, default=None, help="random mCNS tasks run for real (default 2; --quick 1)")
    ap.add_argument("--sample-chunks", type=int, default=None,
                    help="run only the first K chunks of each sampled task (default all; --quick 16)")
    ap.add_argument("--submit-tasks", type=int, default=None,
                    help="stand-in tasks submitted to local:2 (default all; --quick 2000)")
    ap.add_argument("--old-shards", type=int, default=300, help="shards the old planner is timed on (default 300)")
    ap.add_argument("--seed", type=int, default=1, help="seed of the task sample")
    ap.add_argument("--sample-only", action="store_true", help="skip the planning table (with --mcns-only)")
    ap.add_argument("--child-plan", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-task", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_plan:
        child_plan(args)
        return
    if args.child_task:
        child_task(args.child_task)
        return
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.sample is None:
        args.sample = 1 if args.quick else 2
    if args.quick:
        args.sample_chunks = args.sample_chunks or 16
        args.submit_tasks = args.submit_tasks or 2000
    if not args.no_mcns:
        mcns(args)
    if args.mcns_only:
        return
    rounds = args.rounds or (1 if args.quick else 5)
    C.header("bench_pcg: PCG edges + components per 256³ chunk vs bulk read of chunk + halo")

    runs = []
    size = 256 if args.quick else 512
    pair = C.synthetic_pair(args.workdir, size)
    n = size // 256
    chunks = [(x, y, z) for z in range(n) for y in range(n) for x in range(n)]
    runs.append(bench(f"synthetic {size}³ (neuron-like)", pair.export, pair.spec, 0, chunks, rounds, args.level,
                      args.workdir))
    if (args.data / f"{C.REAL_SHARD}.arrow").is_file():
        big = C.big_shard_export(args.workdir, args.data)
        spec = C.mcns_spec(args.data)
        lo = np.array([30720, 24576, 28672]) // 256 + 1  # interior chunks of the 2048³ shard box
        k = 1 if args.quick else 2
        chunks = [tuple(int(v) for v in lo + (x, y, z)) for z in range(k) for y in range(k) for x in range(k)]
        runs.append(bench("real mCNS blocks, tiled (s1 shard, 32,768 records)", big, spec, 1, chunks, rounds,
                          args.level, args.workdir))

    rows, brows = [], []
    for r in runs:
        fw, pw = statistics.median(r["wall"]["floor"]), statistics.median(r["wall"]["pcg"])
        fc, pc = statistics.median(r["cpu"]["floor"]), statistics.median(r["cpu"]["pcg"])
        ratios = [p / f for p, f in zip(r["cpu"]["pcg"], r["cpu"]["floor"], strict=True)]
        r.update(pc=pc, fc=fc)
        cc = statistics.median(r["cpu"]["chunk"])
        rows.append([r["name"], r["chunks"], C.ms(cc, 0), C.ms(fw, 0), C.ms(pw, 0), C.ms(fc, 0), C.ms(pc, 0),
                     f"{pc / fc:.2f} × (paired {statistics.median(ratios):.2f})", f"{1 / pc:.2f}",
                     f"{r['voxels'] / pc / 1e6:.0f}", C.verdict(pc / fc <= 3.0)])
        st = r["stages"]
        names = [k for k in st[0] if not k.startswith("_")]
        tot = {k: statistics.median(s[k] for s in st) for k in names}
        sizes = [s["_sizes"] for s in st]
        brows.append([r["name"]] + [C.ms(tot[k], 1) for k in names]
                     + [f"{np.mean([s[3] for s in sizes]):.0f}",
                        "/".join(f"{np.mean([s[4][t] for s in sizes]):.0f}" for t in fmt.EDGE_TYPES),
                        f"{np.mean([s[0] for s in sizes]) / 1024:.0f} → {np.mean([s[1] for s in sizes]) / 1024:.1f}",
                        f"{C.ms(statistics.median(s['_zstd17'][0] for s in st), 1)} ms, "
                        f"{np.mean([s['_zstd17'][1] for s in st]) / 1024:.1f} KiB"])
    C.table(["data", "chunks", "chunk-only read CPU ms", "floor wall ms", "pcg wall ms", "floor CPU ms", "pcg CPU ms", "pcg / floor (CPU)",
             "chunks/s/core", "Mvoxels/s/core", "≤ 3 ×"], rows, "Per 256³ chunk (single thread, medians)")
    C.table(["data"] + [f"{k} ms" for k in names] + ["pieces", "in/between/cross edges",
                                                     f"edges KiB raw → zstd {args.level}", "zstd 17 (PCG's level)"],
            brows, "Where a task's CPU goes (one pass, medians)")

    # projection to the real export's s0
    s0 = dvidshards.formats.multiscale.parse_multiscale(C.mcns_spec(args.data))[0] if (
        args.data / "mcns-ng-specs.json").is_file() else None
    if s0 is not None:
        grid = -(-np.asarray(s0.size) // CS)
        slots = int(np.prod(grid))
        voxels = float(np.prod(s0.size))
        prow = []
        for r in runs:
            per_chunk_bytes = (r["files"] + r["parquet"]) / r["chunks"]
            for frac in (1.0, 0.3):
                n = slots * frac
                prow.append([r["name"], f"{frac:.0%}", f"{n / 1e6:.1f} M", f"{n * r['pc'] / 3600:,.0f}",
                             f"{n * r['fc'] / 3600:,.0f}",
                             f"{n * per_chunk_bytes / 1e12:.1f} TB",
                             f"{n * r['pieces_bytes'] / r['chunks'] / 1e12:.2f} TB"])
        C.table(["per-chunk cost from", "chunks with data", "chunks", "core-hours", "floor core-hours",
                 "edges + components + parquet", "of which side table (resume record)"], prow,
                f"Projection: mCNS s0 ({'×'.join(map(str, s0.size))} voxels = {voxels:.2e}; 256³ grid "
                f"{'×'.join(map(str, grid))} = {slots / 1e6:.1f} M chunks, {fmt.layers_for_grid(grid)} layers)")
    print(f"load average at end: {C.load_text()}")


if __name__ == "__main__":
    main()
