"""Body statistics and label index over a whole export: rate per core, floor, today's way, projection.

Data (built once into the work directory and reused):

* a synthetic neuron-like export of 1024³ voxels (1.07 G; ``--quick``: 512³): the 512³
  ``neuron_volume`` of ``synthetic_pair`` tiled 2×2×2 with distinct ids per tile, written by
  ``write_export`` with 512-voxel shards (8 shards of 512 chunks);
* for the projection, ``big-32768``: one mCNS scale-1 shard holding all 32³ chunks of its box,
  the real shard's blocks reused cyclically (real block statistics).

Measured in one process, serially (one core) unless said otherwise:

* ``body_stats_table`` (and ``label_index``) over the whole export: chunks per second of CPU time;
* the floor: zstd decompression of the same payloads plus the count kernel
  (``blockstats.batch_stats`` on ready buffers), nothing else;
* today's way: 256³ boxes read through TensorStore (``dvidshards.open``) and
  ``np.unique(return_counts=True)`` (voxel counts only: no supervoxel count, no box), on a
  sample of boxes, per chunk;
* a 2-worker ``LocalCluster`` run (wall time);
* a projection to the real export (587 M chunks, 26,128 shards) from the real-block rate.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
from common import CHUNK, MIB, _done, _fresh, _reset, table

import dvidshards
from dvidshards.formats.blockstats import batch_stats
from dvidshards.formats.records import _dctx
from dvidshards.jobs.labelindex import label_index, shard_label_index
from dvidshards.jobs.stats import body_stats_table, shard_body_stats

REAL_CHUNKS = 587_000_000
REAL_SHARDS = 26_128
WORKERS = 100


def tiled_export(workdir: Path, base: int, tiles: int, seed: int = 1, log=print) -> tuple[Path, dict]:
    """A (base*tiles)³ export: the base³ neuron volume tiled with distinct ids per tile."""
    import tensorstore as ts

    from dvidshards.demo.neurons import neuron_volume
    from dvidshards.formats.mapping import LabelMapping
    from dvidshards.writer import write_export

    params = {"kind": "stats_tiled", "base": base, "tiles": tiles, "seed": seed, "version": 1}
    folder = workdir / f"stats-tiled-{base}x{tiles}-s{seed}"
    if _fresh(folder, params):
        return folder / "export", json.loads((folder / "spec.json").read_text())
    _reset(folder)
    t0 = time.perf_counter()
    log(f"building {folder} (once) ...")
    sv, mapping = neuron_volume((base,) * 3, n_bodies=200, svs_per_body=8, seed=seed)
    m = LabelMapping.from_any(mapping)
    off = np.uint64(1 << 32)
    keys = np.concatenate([m.keys + np.uint64(t) * off for t in range(tiles ** 3)])
    vals = np.concatenate([m.values + np.uint64(t) * off for t in range(tiles ** 3)])

    def read(domain, array, params):
        lo = [int(v) for v in domain.inclusive_min]
        t = ((lo[0] // base) * tiles + lo[1] // base) * tiles + lo[2] // base
        a = [v % base for v in lo]
        sub = sv[a[0]:a[0] + array.shape[0], a[1]:a[1] + array.shape[1], a[2]:a[2] + array.shape[2]]
        array[...] = np.where(sub != 0, sub + np.uint64(t) * off, np.uint64(0))

    vol = ts.virtual_chunked(read, dtype=ts.uint64, domain=ts.IndexDomain(shape=[base * tiles] * 3),
                             chunk_layout=ts.ChunkLayout(read_chunk_shape=[CHUNK] * 3))
    spec = write_export(vol, folder / "export", mapping=np.stack([keys, vals], axis=1), shard_chunks=8,
                        progress=False)
    (folder / "spec.json").write_text(json.dumps(spec))
    _done(folder, params)
    log(f"built in {time.perf_counter() - t0:.0f} s")
    return folder / "export", spec


def cpu_wall(fn, rounds: int = 3):
    """Best (cpu seconds, wall seconds) of ``rounds`` calls, and the last result."""
    best = (float("inf"), float("inf"))
    res = None
    for _ in range(rounds):
        c, w = time.process_time(), time.perf_counter()
        res = fn()
        best = min(best, (time.process_time() - c, time.perf_counter() - w))
    return best, res


def floor_parts(ds: dvidshards.Dataset, scale: int):
    """(zstd cpu s, kernel cpu s, chunks) over every record of the scale."""
    tables = [ds.shard(scale, o).table() for o in ds.shards(scale)]
    payloads = [[bytes(t.payload(i)) for i in range(len(t))] for t in tables]
    n = sum(len(p) for p in payloads)
    dctx = _dctx()

    def zstd():
        return [[dctx.decompress(p) for p in ps] for ps in payloads]

    (zs, _), blocks = cpu_wall(zstd)
    batches = []
    cs = ds.scale(scale).chunk_size
    for bl in blocks:
        for k in range(0, len(bl), 512):
            part = bl[k:k + 512]
            offs = np.zeros(len(part) + 1, np.int64)
            np.cumsum([len(b) for b in part], out=offs[1:])
            nsv = np.array([int.from_bytes(b[12:16], "little") for b in part], np.int64)
            batches.append((np.frombuffer(b"".join(part), np.uint8), offs, np.zeros((len(part), 3), np.int64),
                            np.tile(np.asarray(cs, np.int64), (len(part), 1)), nsv))

    def kernel():
        for b in batches:
            batch_stats(*b)

    kernel()  # compile / load
    (ks, _), _ = cpu_wall(kernel)
    return zs, ks, n


def todays_way(export: Path, spec: dict, boxes: int, edge: int = 256):
    """cpu and wall seconds per chunk: TensorStore box reads + np.unique(return_counts)."""
    vol = dvidshards.open(export, spec=spec)
    rng = np.random.default_rng(0)
    size = np.array(vol.shape)
    starts = [(rng.integers(0, (size - edge) // CHUNK + 1) * CHUNK) for _ in range(boxes)]

    def run():
        counts: dict = {}
        for a in starts:
            v = vol[a[0]:a[0] + edge, a[1]:a[1] + edge, a[2]:a[2] + edge].read(order="F").result()
            u, c = np.unique(v, return_counts=True)
            for k, n in zip(u.tolist(), c.tolist(), strict=True):
                counts[k] = counts.get(k, 0) + n
        return counts

    (c, w), _ = cpu_wall(run, rounds=1)
    chunks = boxes * (edge // CHUNK) ** 3
    return c / chunks, w / chunks


def merge_cost(ds, scale: int, work: Path) -> float:
    """CPU seconds per row of one reduce pass: the scale's label-index partials (6-bit row groups,
    as the shard tasks write them in a big job) merged into one file of 7-bit buckets."""
    from dvidshards.jobs import buckets
    from dvidshards.jobs.labelindex import ROWS, run_task
    from dvidshards.stores import as_store

    store = as_store(work, writable=True)
    src = buckets.label_source("agglomerated")
    tasks = [buckets.ShardTask(ds, scale, o, src, None, store, 6) for o in ds.shards(scale)]
    rows = sum(run_task(t) for t in tasks)
    merge = buckets.MergeTask(ROWS, store, tuple(t.key for t in tasks), 1, 0, 7)
    (c, _), n = cpu_wall(lambda: buckets.merge_task(merge))
    assert n == rows
    return c / rows


def real_bytes_per_row(data: Path, work: Path) -> float:
    """Parquet (zstd) bytes per label-index row of the real shard's own rows (distinct real ids)."""
    import io

    import pyarrow.parquet as pq

    rds = dvidshards.Dataset(common.real_export(work, data), spec=common.mcns_spec(data))
    t = shard_label_index(rds, scale=1, origin=rds.shards(1)[0])
    t = t.sort_by([("body", "ascending"), ("supervoxel", "ascending")])
    buf = io.BytesIO()
    pq.write_table(t, buf, compression="zstd", row_group_size=32768)
    return len(buf.getvalue()) / t.num_rows


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--no-real", action="store_true", help="skip the real-block shard (projection)")
    p.add_argument("--no-dask", action="store_true", help="skip the LocalCluster run")
    args = p.parse_args()
    common.header("bench_stats: body statistics and label index over a whole export")
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    tiles = 1 if args.quick else 2
    export, spec = tiled_export(work, 512, tiles, log=lambda s: print(s, file=sys.stderr))
    ds = dvidshards.Dataset(export, spec=spec)
    s = ds.scale(0)
    nshards = len(ds.shards(0))
    nchunks = len(ds.chunks(0))
    voxels = int(np.prod(s.size))
    print(f"synthetic export: {s.size[0]}x{s.size[1]}x{s.size[2]} = {voxels / 1e9:.2f} G voxels, "
          f"{nchunks} chunks in {nshards} shards, {du(export) / MIB:.1f} MiB\n")

    tmp = Path(tempfile.mkdtemp(prefix="bench-stats-"))
    try:
        body_stats_table(ds, scale=0, scheduler="serial", progress=False)  # compile / load kernels
        (st_cpu, st_wall), t = cpu_wall(lambda: body_stats_table(ds, scale=0, scheduler="serial", progress=False))
        bodies = t.num_rows
        (ix_cpu, ix_wall), rep = cpu_wall(lambda: label_index(ds, tmp / "idx", scale=0, scheduler="serial", overwrite=True, progress=False))
        idx_bytes = du(tmp / "idx")
        (map_cpu, _), _ = cpu_wall(lambda: [shard_body_stats(ds, scale=0, origin=o) for o in ds.shards(0)])
        (ix_map, _), _ = cpu_wall(lambda: [shard_label_index(ds, scale=0, origin=o) for o in ds.shards(0)])
        zs, ks, n = floor_parts(ds, 0)
        assert n == nchunks
        floor = zs + ks
        today_cpu, today_wall = todays_way(export, spec, boxes=1 if args.quick else 2)
        dask_wall = dask_start = None
        if not args.no_dask:
            from dvidshards.jobs.runner import TaskRunner

            w = time.perf_counter()
            runner = TaskRunner("local:2")
            client = runner.client()
            body_stats_table(ds, scale=0, scheduler=client, progress=False)  # workers load the kernels once
            dask_start = time.perf_counter() - w
            try:
                runs = []
                for _ in range(2):
                    w = time.perf_counter()
                    t2 = body_stats_table(ds, scale=0, scheduler=client, progress=False)
                    runs.append(time.perf_counter() - w)
                    assert t2.equals(t)
                dask_wall = min(runs)
            finally:
                runner.close()

        per = st_cpu / nchunks
        rows = [
            ["body_stats_table (serial)", f"{st_cpu:.2f}", f"{st_wall:.2f}", f"{per * 1e6:.0f}",
             f"{1 / per:,.0f}", f"{floor / st_cpu:.2f}", f"{today_cpu / per:,.0f}x"],
            ["  per-shard tasks only (no reduce)", f"{map_cpu:.2f}", "", f"{map_cpu / nchunks * 1e6:.0f}",
             f"{nchunks / map_cpu:,.0f}", f"{floor / map_cpu:.2f}", ""],
            ["label_index (serial)", f"{ix_cpu:.2f}", f"{ix_wall:.2f}", f"{ix_cpu / nchunks * 1e6:.0f}",
             f"{nchunks / ix_cpu:,.0f}", f"{floor / ix_cpu:.2f}", f"{today_cpu / (ix_cpu / nchunks):,.0f}x"],
            ["  per-shard tasks only (no reduce)", f"{ix_map:.2f}", "", f"{ix_map / nchunks * 1e6:.0f}",
             f"{nchunks / ix_map:,.0f}", f"{floor / ix_map:.2f}", ""],
            ["floor: zstd + count kernel", f"{floor:.2f}", "", f"{floor / nchunks * 1e6:.0f}",
             f"{nchunks / floor:,.0f}", "1.00", ""],
            ["  zstd decompression", f"{zs:.2f}", "", f"{zs / nchunks * 1e6:.0f}", "", "", ""],
            ["  count kernel", f"{ks:.2f}", "", f"{ks / nchunks * 1e6:.0f}", "", "", ""],
            ["today: TensorStore 256³ boxes + np.unique", "", "", f"{today_cpu * 1e6:,.0f}",
             f"{1 / today_cpu:,.0f}", f"{floor / nchunks / today_cpu:.3f}", "1x"],
        ]
        if dask_wall is not None:
            rows.append(["body_stats_table, LocalCluster 2 workers (wall)", "", f"{dask_wall:.2f}", "", "", "", ""])
            rows.append(["  cluster start + first run (wall)", "", f"{dask_start:.2f}", "", "", "", ""])
        table(["job", "cpu s", "wall s", "us/chunk (cpu)", "chunks/s per core", "floor / this",
               "vs today"], rows, title=f"{nchunks} chunks, {voxels / 1e9:.2f} G voxels")
        print(f"body_stats: {bodies} bodies; label index: {rep.totals.rows} rows "
              f"({rep.totals.rows / nchunks:.1f} per chunk), {idx_bytes / MIB:.2f} MiB "
              f"({idx_bytes / nchunks:.0f} B per chunk); today's way measured on "
              f"{1 if args.quick else 2} boxes of 256³ (counts only)")
        print(f"target >= 10x today's way: {common.verdict(today_cpu / per >= 10)} ({today_cpu / per:,.0f}x)\n")

        if not args.no_real:
            real = common.big_shard_export(work, common.require_real_data(args.data),
                                           log=lambda s_: print(s_, file=sys.stderr))
            rds = dvidshards.Dataset(real, spec=common.mcns_spec(args.data))
            rn = len(rds.chunks(1))
            body_stats_table(rds, scale=1, scheduler="serial", progress=False)
            (rc, rw), rt = cpu_wall(lambda: body_stats_table(rds, scale=1, scheduler="serial", progress=False))
            (ric, riw), rrep = cpu_wall(lambda: label_index(rds, tmp / "ridx", scale=1, scheduler="serial", overwrite=True, progress=False))
            rbytes = du(tmp / "ridx")
            rzs, rks, _ = floor_parts(rds, 1)
            rper, riper = rc / rn, ric / rn
            table(["job (real blocks, 1 shard)", "chunks", "cpu s", "us/chunk", "chunks/s per core", "floor / this"],
                  [["body_stats_table", rn, f"{rc:.2f}", f"{rper * 1e6:.0f}", f"{1 / rper:,.0f}", f"{(rzs + rks) / rc:.2f}"],
                   ["label_index", rn, f"{ric:.2f}", f"{riper * 1e6:.0f}", f"{1 / riper:,.0f}",
                    f"{(rzs + rks) / ric:.2f}"],
                   ["floor (zstd + kernel)", rn, f"{rzs + rks:.2f}", f"{(rzs + rks) / rn * 1e6:.0f}",
                    f"{rn / (rzs + rks):,.0f}", "1.00"]],
                  title="Real mCNS blocks (big-32768: one scale-1 shard, all 32³ chunks)")
            rows_per_chunk = rrep.totals.rows / rn
            ix_reduce_per_row = merge_cost(rds, 1, tmp / "merge")
            proj = []
            for name, per_chunk in (("body_stats", rper), ("label_index", riper)):
                ch = REAL_CHUNKS * per_chunk / 3600
                proj.append([name, f"{ch:,.0f}", f"{ch / WORKERS:.1f} h",
                             f"{REAL_CHUNKS / REAL_SHARDS * per_chunk:.1f} s"])
            table(["job", "core-hours", f"wall on {WORKERS} workers", "per shard (22.5 k chunks)"], proj,
                  title=f"Projection to the real export ({REAL_CHUNKS / 1e6:.0f} M chunks, {REAL_SHARDS:,} shards)")
            bpr = real_bytes_per_row(args.data, work)
            nrows = REAL_CHUNKS * rows_per_chunk
            print(f"label index output: {rows_per_chunk:.1f} rows per chunk -> {nrows / 1e9:.1f} G rows; "
                  f"{bpr:.1f} B per row (Parquet zstd of the real shard's own rows) -> {nrows * bpr / 1e9:,.0f} GB "
                  f"(the tiled shard, which repeats 258 blocks, compresses to {rbytes / rrep.totals.rows:.1f} B per row: "
                  f"{REAL_CHUNKS * rbytes / rn / 1e9:,.0f} GB); 36 B per row uncompressed")
            print(f"body_stats output: {rt.nbytes / max(rt.num_rows, 1):.0f} B per body in memory "
                  f"(10 int64 columns); a Parquet file is at most that per body")
            # reduce at full scale: 26,128 partials -> 409 -> 7 files -> buckets: three passes over the
            # rows where the synthetic run made one (8 partials -> buckets)
            red = 3 * REAL_CHUNKS * rows_per_chunk * ix_reduce_per_row / 3600
            print(f"label index reduce at full scale: 3 passes (26,128 partials -> 409 -> 7 files -> buckets) "
                  f"at {ix_reduce_per_row * 1e9:.0f} ns CPU per row per pass (one merge of the real-block "
                  f"shard's partial) -> ~{red:,.0f} core-hours, ~{red / WORKERS:.1f} h on {WORKERS} workers")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        os.sync()


if __name__ == "__main__":
    main()
