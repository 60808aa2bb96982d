"""dvidshards downsample: CPU per s0 voxel beside tinybrain and TensorStore, real density, memory, mCNS projection.

Run from the project root::

    .venv/bin/python benchmarks/bench_downsample.py [--quick] [--skip-procedural] [--rounds N]

All in one run, CPU time (``time.process_time``: every thread of this process), kernels compiled:

1. **The same 256³ neuron-like volume** (``dvidshards.demo.neurons.neuron_volume``, written as an
   s0-only export of one shard): dvidshards making s1 from the export's records through to the
   written output shard (``jobs.downsample.run_task``: shard load, zstd, the kernel, the
   records' body pairs, zstd, Arrow IPC + CSV), with DVID's rule and with ``mode``; the kernel
   alone on ready blocks; tinybrain's ``downsample_segmentation`` (mode, and ``sparse=True``, which
   ignores 0 like DVID's rule); ``ts.downsample(..., "mode")``. Rounds interleaved; medians; ns
   of CPU per s0 voxel and ratios. The outputs are checked against each other first.
2. **Real density**, each in a fresh process: one output-shard task over a dense mCNS scale-1
   shard (32,768 chunks, the real shard's blocks reused cyclically: ``common.big_shard_export``)
   making scale 2 (CPU per input chunk, peak RSS), and the real 258-record shard (s1 -> s2).
3. **Peak memory per task at mCNS density** (fresh process): the s0 -> s1 task of an output shard
   whose 8 source shards are dense 32,768-chunk procedural mCNS shards
   (``tests/support/procedural.ProceduralStore``): peak RSS and tracemalloc's peak. Its CPU
   includes synthesizing the shards' bytes (informative only).
4. **The mCNS projection**: s1-s9 made from s0, CPU per input chunk (the dense real shard's) times
   the input chunks of each scale (s0: 510 M, the real export's; coarser scales in the procedural
   export's proportions), in core-hours, against the goal of 40.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C

MCNS_S0_CHUNKS = 510_000_000  # the real mCNS export's scale-0 chunks
GOAL_CORE_HOURS = 40
NS_TARGET = 1.0  # ns CPU per s0 voxel, the whole path
VOXELS = 64 ** 3


# --------------------------------------------------------------------------- data


def neuron_export(workdir: Path, size: int, log=print) -> tuple[np.ndarray, Path, dict]:
    """The size³ neuron volume, its s0-only export (one shard) and the spec of 2 scales."""
    from dvidshards.demo.neurons import neuron_volume
    from dvidshards.writer import write_export

    params = {"kind": "downsample_neurons", "size": size, "version": 1}
    folder = workdir / f"downsample-neurons-{size}"
    if not C._fresh(folder, params):
        C._reset(folder)
        log(f"writing {folder} (once) ...")
        sv, mapping = neuron_volume((size,) * 3, n_bodies=60, seed=1)
        np.save(folder / "sv.npy", np.asarray(sv, np.uint64))
        spec = write_export(np.zeros((size,) * 3, np.uint64), folder / "spec-only", scales=2, shard_chunks=size // 64)
        write_export(sv, folder / "export", mapping=mapping, scales=1, shard_chunks=size // 64)
        (folder / "spec.json").write_text(json.dumps(spec))
        C._done(folder, params)
    return np.load(folder / "sv.npy"), folder / "export", json.loads((folder / "spec.json").read_text())


def tiled_export(workdir: Path, export: Path, spec: dict, n: int, log=print) -> tuple[Path, dict]:
    """A dense n³-chunk shard of the neuron export's blocks (its records reused cyclically, as
    ``common.big_shard_export`` does with the real ones), as s0 of a spec whose s0 has room for it."""
    import pyarrow as pa

    from dvidshards.writer import default_sharding, write_shard

    params = {"kind": "downsample_tiled", "export": str(export), "n": n, "version": 1}
    folder = workdir / f"downsample-tiled-{export.parent.name}-{n}"
    tspec = json.loads(json.dumps(spec))
    for k, sc in enumerate(tspec["scales"]):  # a (64 n)³ volume, n³-chunk shards
        sc["size"] = [-(-64 * n // 2 ** k)] * 3
        sc["sharding"] = default_sharding(sc["size"], n).to_json()
    if not C._fresh(folder, params):
        C._reset(folder)
        log(f"writing {folder} (once) ...")
        records = []
        for arrow in sorted((export / "s0").glob("*.arrow")):
            with pa.OSFile(str(arrow)) as f:
                for batch in pa.ipc.open_stream(f):
                    records += batch.to_pylist()
        (folder / "s0").mkdir()
        write_shard(folder / "s0" / "0_0_0", C.full_shard_records(records, (0, 0, 0), n=n), batch_size=256)
        (folder / "spec.json").write_text(json.dumps(tspec))
        C._done(folder, params)
    return folder, json.loads((folder / "spec.json").read_text())


def tasks_for(export: Path, spec: dict, dest: Path, method: str, source_scale: int = 0, batch: int = 256) -> list:
    """The downsample tasks making scale source_scale + 1 (record batches of 256, as the mCNS spec's)."""
    import dvidshards
    from dvidshards.formats.labels import Agglomerated
    from dvidshards.jobs.downsample import Phase, Task, output_shards
    from dvidshards.stores import as_store

    ds = dvidshards.Dataset(str(export), spec=spec)
    below = ds.scale(source_scale)
    scale = ds.scale(source_scale + 1).with_naming("current")
    phase = Phase(ds, below, scale, as_store(str(dest), writable=True), method, Agglomerated(), batch, 3)
    return [Task(phase, o, sources) for o, sources in output_shards(below, scale, ds.shards(below))]


# --------------------------------------------------------------------------- 1: one volume, every method


def same_volume(args) -> dict:
    import tensorstore as ts
    import tinybrain

    import dvidshards
    from dvidshards.formats import downsample as FD
    from dvidshards.jobs.downsample import run_task

    size = 128 if args.quick else 256
    sv, export, spec = neuron_export(args.workdir, size)
    nvox = sv.size
    tiles = 8 if args.quick else 16
    tiled, tspec = tiled_export(args.workdir, export, spec, tiles)
    out = Path(tempfile.mkdtemp(prefix="bench-downsample-", dir=args.workdir))
    phases = {m: tasks_for(export, spec, out / m, m) for m in ("dvid", "mode")}
    dense = tasks_for(tiled, tspec, out / "tiled", "dvid")
    ds = dvidshards.Dataset(str(export), spec=spec)
    t = ds.shard(0, (0, 0, 0)).table()
    blocks = {tuple(c): t.block(i) for i, c in enumerate(t.coords.tolist())}
    parents = sorted({(x // 2, y // 2, z // 2) for x, y, z in blocks})
    kids = [[blocks.get((2 * px + (i & 1), 2 * py + ((i >> 1) & 1), 2 * pz + (i >> 2))) for i in range(8)]
            for px, py, pz in parents]
    FD._down.compile()

    def task(tasks):
        for t in tasks:
            run_task(t)

    def kernel_only():
        for k in kids:
            FD.downsample_block(k)

    dense_voxels = tiles ** 3 * VOXELS
    fns = {  # name: (callable, s0 voxels it covers)
        "dvidshards, DVID rule: one task, export records -> written output shard":
            (lambda: task(phases["dvid"]), nvox),
        "dvidshards, mode: one task, export records -> written output shard": (lambda: task(phases["mode"]), nvox),
        f"dvidshards, DVID rule: the same blocks tiled into a dense {tiles}³-chunk shard, one task":
            (lambda: task(dense), dense_voxels),
        "dvidshards kernel alone (DVID rule, blocks decompressed)": (kernel_only, nvox),
        "tinybrain downsample_segmentation (mode)": (lambda: tinybrain.downsample_segmentation(sv, (2, 2, 2)), nvox),
        "tinybrain downsample_segmentation (sparse: 0 ignored)":
            (lambda: tinybrain.downsample_segmentation(sv, (2, 2, 2), sparse=True), nvox),
        "ts.downsample(..., 'mode')": (lambda: ts.downsample(ts.array(sv), [2, 2, 2], "mode").read().result(), nvox),
    }
    # correctness first: our mode equals TensorStore's; our DVID rule vs tinybrain's sparse mode (agreement)
    ref_mode = ts.downsample(ts.array(sv), [2, 2, 2], "mode").read().result()
    for m in ("dvid", "mode"):
        task(phases[m])
    got = {m: dvidshards.Dataset(str(out / m), spec=spec).read([[0, 0, 0], list(ref_mode.shape)], scale=1,
                                                               labels="supervoxels") for m in ("dvid", "mode")}
    if not np.array_equal(got["mode"], ref_mode):
        raise SystemExit("dvidshards mode differs from TensorStore's mode")
    sparse = tinybrain.downsample_segmentation(sv, (2, 2, 2), sparse=True)[0]
    agree_tb = float((sparse[:got["dvid"].shape[0], :got["dvid"].shape[1], :got["dvid"].shape[2]] == got["dvid"]).mean())
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(args.rounds + 1):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            with C.quiet_gc():
                c = time.process_time()
                fns[n][0]()
                dt = time.process_time() - c
            if r:
                times[n].append(dt)
    ns = {n: statistics.median(times[n]) / fns[n][1] * 1e9 for n in names}
    base = ns[names[0]]
    rows = [[n, f"{ns[n]:.2f}", f"{ns[n] / base:.2f}x"] for n in names]
    C.table(["method", "ns CPU / s0 voxel (median)", "vs dvidshards, one task"], rows,
            f"One {size}³ neuron-like volume ({nvox / 1e6:.1f} M voxels, {len(blocks)} chunks in one shard), "
            f"{args.rounds} interleaved rounds; output record batches of 256 (the mCNS spec's)")
    print(f"checks: dvidshards mode == ts.downsample mode voxel for voxel; dvidshards DVID rule agrees with "
          f"tinybrain sparse on {agree_tb:.4%} of voxels (tinybrain's sparse mode is not DVID's rule: it breaks "
          f"ties differently). A task's fixed costs (loading its shard, opening, naming and renaming the output "
          f"files) are spread over {len(blocks)} chunks in the first rows and over {tiles ** 3:,} in the tiled "
          f"one.\n")
    return {"ns_task": base, "ns_mode": ns[names[1]], "ns_dense": ns[names[2]], "ns_kernel": ns[names[3]],
            "ns_tinybrain": ns[names[4]], "ns_ts": ns[names[6]]}


# --------------------------------------------------------------------------- 2, 3: one task, fresh process


def child(kind: str, opts: dict) -> dict:
    """One task measured in this (fresh) process."""
    import tracemalloc

    import dvidshards.shard
    from dvidshards.formats import downsample as _fd  # noqa: F401  - registers the downsample kernel
    from dvidshards.formats import jit
    from dvidshards.jobs.downsample import downsample

    jit.compile_all()  # loaded from numba's cache before the clock starts (not a task's cost)

    if kind == "procedural":
        import dvidshards
        from tests.support.procedural import ProceduralStore

        store = ProceduralStore()
        ds = dvidshards.Dataset(store, spec=store.spec)
        o1 = tuple(opts["origin"])
        tracemalloc.start()
        c0 = time.process_time()
        rep = downsample(ds, opts["out"], scales=[1], scheduler="serial", progress=False, allow_partial=True,
                         _only={(1, o1)})
        cpu = time.process_time() - c0
        traced = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    else:
        spec = json.loads(Path(opts["spec"]).read_text())
        c0 = time.process_time()
        rep = downsample(opts["export"], opts["out"], spec=spec, scales=[opts["scale"]], scheduler="serial",
                         progress=False)
        cpu = time.process_time() - c0
        traced = 0
    t = rep.totals
    return {"cpu": cpu, "task_cpu": rep.task_cpu, "peak": C.peak_rss(), "traced": traced, "read": t.records_read,
            "written": t.records_written, "shards": t.shards_written, "done": rep.done, "failed": rep.failed}


def run_child(kind: str, opts: dict) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, json.dumps(opts)]
    env = {**os.environ, "DVIDSHARDS_KERNELS": "compiled"}
    r = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if r.returncode:
        raise SystemExit(f"child failed: {kind}\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def dense_origin(store) -> tuple[int, int, int]:
    """An s1 output shard whose 8 s0 source shards hold all 32,768 chunks each."""
    s1 = set(store.shard_origins(1))
    e0 = 2048
    for o in sorted(s1)[len(s1) // 3:]:
        src = [(2 * o[0] + dx * e0, 2 * o[1] + dy * e0, 2 * o[2] + dz * e0)
               for dz in (0, 1) for dy in (0, 1) for dx in (0, 1)]
        if all(len(store.shard_chunks(0, s)) == 32768 for s in src):
            return o
    raise SystemExit("no s1 shard over 8 dense s0 shards found")


def real_density(args) -> dict:
    C.require_real_data(args.data)
    spec = C.mcns_spec(args.data)
    work = Path(tempfile.mkdtemp(prefix="bench-downsample-", dir=args.workdir))
    (work / "spec.json").write_text(json.dumps(spec))
    rows, res = [], {}
    big = C.big_shard_export(args.workdir, args.data)
    for name, export in (("dense: 32,768 real blocks, one s1 shard -> s2", big),
                         ("the real shard (258 records) -> s2", C.real_export(args.workdir, args.data))):
        r = run_child("real", {"export": str(export), "spec": str(work / "spec.json"), "scale": 2,
                               "out": str(work / f"out-{len(rows)}")})
        if r["failed"]:
            raise SystemExit(f"{name}: {r['failed']}")
        per = r["task_cpu"] / r["read"]
        res[name] = per
        rows.append([name, f"{r['read']:,}", f"{r['written']:,}", f"{per * 1e3:.3f}", f"{per / VOXELS * 1e9:.2f}",
                     f"{r['peak'] / C.MIB:.0f}"])
    C.table(["task (fresh process, serial)", "input chunks", "output chunks", "ms CPU / input chunk",
             "ns CPU / input voxel", "peak RSS MiB"], rows,
            "Real mCNS blocks (scale-1 data, denser in boundaries than scale 0), one task each")
    return {"real_dense_s": res[rows[0][0]], "real_sparse_s": res[rows[1][0]]}


def procedural_memory(args) -> dict:
    sys.path.insert(0, str(C.ROOT))
    from tests.support.procedural import ProceduralStore

    store = ProceduralStore()
    o = dense_origin(store)
    work = Path(tempfile.mkdtemp(prefix="bench-downsample-", dir=args.workdir))
    r = run_child("procedural", {"origin": list(o), "out": str(work / "out")})
    if r["failed"] or r["done"] != 1:
        raise SystemExit(f"procedural task: {r}")
    C.table(["task", "input chunks", "output chunks", "peak RSS MiB", "tracemalloc peak MiB",
             "CPU s (incl. synthesizing the source)"],
            [[f"s1 shard {o}: 8 dense s0 shards (procedural mCNS)", f"{r['read']:,}", f"{r['written']:,}",
              f"{r['peak'] / C.MIB:.0f}", f"{r['traced'] / C.MIB:.0f}", f"{r['task_cpu']:.1f}"]],
            "Peak memory of one output-shard task at mCNS density (fresh process)")
    return {"peak": r["peak"], "traced": r["traced"]}


def projection(per_chunk_s: float, ns_neuron: float) -> list[list]:
    """Core-hours to make mCNS s1-s9 from s0."""
    sys.path.insert(0, str(C.ROOT))
    from tests.support.procedural import ProceduralStore

    store = ProceduralStore()
    rng = np.random.default_rng(0)
    counts = []
    for k in range(9):  # inputs of s1..s9: the chunks of s0..s8
        origins = store.shard_origins(k)
        pick = origins if len(origins) <= 200 else [origins[i] for i in rng.choice(len(origins), 200, replace=False)]
        counts.append(len(origins) * float(np.mean([len(store.shard_chunks(k, o)) for o in pick])))
    scale = MCNS_S0_CHUNKS / counts[0]
    rows = []
    total = 0.0
    total_neuron = 0.0
    for k in range(9):
        n = counts[k] * scale
        h = n * per_chunk_s / 3600
        hn = n * ns_neuron * 1e-9 * VOXELS / 3600
        total += h
        total_neuron += hn
        rows.append([f"s{k + 1} from s{k}", f"{n / 1e6:,.1f} M", f"{h:.2f}", f"{hn:.2f}"])
    rows.append(["s1-s9", f"{sum(counts) * scale / 1e6:,.0f} M", f"{total:.1f}", f"{total_neuron:.1f}"])
    C.table(["scale made", "input chunks", "core-hours at the dense real rate", "core-hours at the neuron-volume rate"],
            rows, f"mCNS projection: s1-s9 from s0 ({MCNS_S0_CHUNKS / 1e6:.0f} M s0 chunks; coarser scales in the "
                  f"procedural export's proportions)")
    return [total, total_neuron]


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], json.loads(sys.argv[3]))))
        return 0
    p = C.parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds of section 1 (median reported)")
    p.add_argument("--skip-procedural", action="store_true", help="skip the procedural memory task (~2 CPU-min)")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds = min(args.rounds, 3)
    args.workdir.mkdir(parents=True, exist_ok=True)
    C.header("dvidshards downsample: ns CPU per s0 voxel, real density, memory per task, mCNS projection")
    one = same_volume(args)
    real = real_density(args)
    mem = None if args.skip_procedural or args.quick else procedural_memory(args)
    hours, hours_neuron = projection(real["real_dense_s"], one["ns_dense"])
    rows = [
        [f"<= {NS_TARGET} ns CPU / s0 voxel, whole path (neuron-like blocks, dense shard, DVID rule)",
         f"{one['ns_dense']:.2f} ns (one 64-chunk task: {one['ns_task']:.2f})", C.verdict(one["ns_dense"] <= NS_TARGET)],
        ["<= 0.26 ms CPU / input chunk at real (scale-1) density", f"{real['real_dense_s'] * 1e3:.3f} ms",
         C.verdict(real["real_dense_s"] <= 0.26e-3)],
        ["tinybrain downsample_segmentation (mode) / dvidshards (dense; one task)",
         f"{one['ns_tinybrain'] / one['ns_dense']:.1f}x; {one['ns_tinybrain'] / one['ns_task']:.1f}x", "stated"],
        ["ts.downsample mode / dvidshards (dense; one task)",
         f"{one['ns_ts'] / one['ns_dense']:.1f}x; {one['ns_ts'] / one['ns_task']:.1f}x", "stated"],
        [f"mCNS s1-s9 <= {GOAL_CORE_HOURS} core-hours", f"{hours:.1f} (neuron-volume rate: {hours_neuron:.1f})",
         C.verdict(hours <= GOAL_CORE_HOURS)],
    ]
    if mem is not None:
        rows.append(["peak RSS of one output-shard task at mCNS density <= 1 GiB", f"{mem['peak'] / C.MIB:.0f} MiB",
                     C.verdict(mem["peak"] <= C.GIB)])
    C.table(["target", "measured", "verdict"], rows, "Targets")
    print(f"load average at end: {C.load_text()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
