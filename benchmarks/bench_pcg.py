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
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path

import common as C
import numpy as np

import dvidshards
from dvidshards.formats import pcg as fmt
from dvidshards.jobs import pcg

CS = (256, 256, 256)


def _job(root, spec, scale, out, level):
    ds = dvidshards.Dataset(root, spec=spec)
    s = ds.scale(scale)
    grid = -(-np.asarray(s.size) // CS)
    layout = fmt.IdLayout(fmt.layers_for_grid(grid))
    Path(out, pcg.PIECES).mkdir(parents=True, exist_ok=True)
    return pcg._Job(ds, s, str(out), CS, layout, None, "area", level, 1, True)


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
        pieces_bytes = sum(p.stat().st_size for p in (out / pcg.PIECES).glob("*.npy"))
        pq_rows, _ = pcg._side_table(str(out))
        parquet = (out / pcg.SIDE_TABLE).stat().st_size
    finally:
        shutil.rmtree(out, ignore_errors=True)
    vox = float(np.mean([np.prod(np.subtract(*job.box(c)[::-1])) for c in chunks]))
    return {"name": name, "chunks": len(chunks), "voxels": vox, "wall": wall, "cpu": cpu, "stages": stages,
            "files": files, "pieces_bytes": pieces_bytes, "parquet": parquet, "rows": pq_rows, "results": results}


def main(argv=None):
    ap = C.parser(__doc__)
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds over the chunks (default 5; --quick 1)")
    ap.add_argument("--level", type=int, default=3, help="zstd level of the edges files (default 3; PCG writes 17)")
    args = ap.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 5)
    args.workdir.mkdir(parents=True, exist_ok=True)
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
                 "edges + components + parquet", "pieces/ (resume record)"], prow,
                f"Projection: mCNS s0 ({'×'.join(map(str, s0.size))} voxels = {voxels:.2e}; 256³ grid "
                f"{'×'.join(map(str, grid))} = {slots / 1e6:.1f} M chunks, {fmt.layers_for_grid(grid)} layers)")
    print(f"load average at end: {C.load_text()}")


if __name__ == "__main__":
    main()
