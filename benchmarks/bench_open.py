"""Time and memory to open a scale and read its first chunk vs the number of shard files.

Run from the project root::

    python benchmarks/bench_open.py [--quick] [--rounds N] [--workdir DIR]

Exports of 100, 1,000, 10,000 and 30,000 tiny shards (one 64³ chunk each, shard extent 64
voxels, 2048³ volume; generated once: one pool of 30,000 shard files, hard-linked into each
export). Interleaved rounds; each round opens every export afresh with ``dvidshards.open(path,
spec=spec)`` and reads one random present chunk (the shard index of that chunk is cold).
Memory: Python-heap peak (tracemalloc, numpy buffers included) of open + first read. Folder
listings made during open + first read are counted (with a spec there must be none).

The no-spec path (geometry inferred: lists the folder and reads the indexes of the shards at
the volume's far faces) is timed separately.
"""

from __future__ import annotations

import os
import time
import tracemalloc

import common as C
import numpy as np
import zstandard

import dvidshards
from dvidshards.stores import LocalStore

GRID = 32  # chunks per axis: 32,768 slots, one chunk per shard
POOL = 30000


def spec_json() -> dict:
    size = GRID * 64
    return {"@type": "neuroglancer_multiscale_volume", "data_type": "uint64", "num_channels": 1,
            "type": "segmentation",
            "scales": [{"key": "8x8x8", "size": [size] * 3, "resolution": [8.0] * 3, "voxel_offset": [0, 0, 0],
                        "chunk_sizes": [[64, 64, 64]], "encoding": "compressed_segmentation",
                        "compressed_segmentation_block_size": [8, 8, 8],
                        "sharding": {"@type": "neuroglancer_uint64_sharded_v1", "hash": "identity",
                                     "preshift_bits": 0, "minishard_bits": 0, "shard_bits": 15,
                                     "minishard_index_encoding": "gzip"}}]}


def slots() -> np.ndarray:
    """Chunk coordinates of the pool's shards (a fixed random sample of the grid)."""
    g = np.arange(GRID ** 3)
    pick = np.random.default_rng(11).permutation(g)[:POOL]
    return np.stack([pick % GRID, pick // GRID % GRID, pick // GRID ** 2], axis=1)


def build(workdir, counts, log=print) -> dict[int, C.Path]:
    """The pool of tiny shards and one export per count (hard links into the pool)."""
    from dvidshards.demo.neurons import neuron_volume
    from dvidshards.formats.codec import block_header, encode_block
    from dvidshards.writer import write_shard

    params = {"kind": "open-pool", "grid": GRID, "pool": POOL, "version": 2}
    pool = workdir / "open-pool"
    coords = slots()
    if not C._fresh(pool, params):
        C._reset(pool)
        (pool / "s0").mkdir()
        t0 = time.perf_counter()
        log(f"writing {POOL} tiny shards into {pool} (once) ...")
        vol, _ = neuron_volume((64, 64, 64), n_bodies=6, seed=2)
        block = encode_block(vol.T)
        svs = block_header(block).labels.copy()  # the block's own label list, in its order
        payload = zstandard.ZstdCompressor(level=3, write_checksum=True, write_content_size=True).compress(block)
        for x, y, z in coords.tolist():
            write_shard(pool / "s0" / f"{64 * x}_{64 * y}_{64 * z}",
                        [{"chunk_x": x, "chunk_y": y, "chunk_z": z, "labels": svs, "supervoxels": svs,
                          "dvid_compressed_block": payload, "uncompressed_size": len(block)}])
        C._done(pool, params)
        log(f"built in {time.perf_counter() - t0:.0f} s")
    out = {}
    for n in counts:
        folder = workdir / f"open-{n}"
        p = {"kind": "open", "n": n, "pool": params}
        if not C._fresh(folder, p):
            C._reset(folder)
            (folder / "s0").mkdir()
            for x, y, z in coords[:n].tolist():
                for ext in (".arrow", ".csv"):
                    name = f"{64 * x}_{64 * y}_{64 * z}{ext}"
                    os.link(pool / "s0" / name, folder / "s0" / name)
            C._done(folder, p)
        out[n] = folder
    return out


class Listings:
    """Counts LocalStore.list calls (folder listings)."""

    def __enter__(self):
        self.n = 0
        self._orig = LocalStore.list

        async def counted(src, prefix=""):
            self.n += 1
            return await self._orig(src, prefix)

        LocalStore.list = counted
        return self

    def __exit__(self, *exc):
        LocalStore.list = self._orig


_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import dvidshards
t1 = time.perf_counter()
root, x, y, z, spec = sys.argv[1], *map(int, sys.argv[2:5]), json.loads(sys.argv[5])
store = dvidshards.open(root, spec=spec)
t2 = time.perf_counter()
store[64 * x:64 * x + 64, 64 * y:64 * y + 64, 64 * z:64 * z + 64].read(order="F").result()
t3 = time.perf_counter()
rss = [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
print(json.dumps({"import": t1 - t0, "open": t2 - t1, "first": t3 - t2, "pandas": "pandas" in sys.modules,
                  "peak": rss}))
"""


def fresh_process(root, chunk, spec) -> dict:
    """Import, open and read one chunk in a new Python process."""
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _CHILD, str(root), *map(str, chunk), json.dumps(spec)],
                       capture_output=True, text=True, check=True, cwd=str(C.ROOT))
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = C.parser(__doc__)
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 15; --quick 3)")
    args = ap.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 15)
    counts = (100, 1000, 3000) if args.quick else (100, 1000, 10000, 30000)
    exports = build(args.workdir, counts)
    spec = spec_json()
    coords = slots()
    C.header("bench_open: open a scale + read its first chunk vs shard count")
    rng = np.random.default_rng(5)

    def once(n, with_spec=True):
        x, y, z = coords[int(rng.integers(n))].tolist()
        tracemalloc.start()
        with Listings() as ls:
            t0 = time.perf_counter()
            store = dvidshards.open(exports[n], spec=spec if with_spec else None, context=C.context())
            t1 = time.perf_counter()
            store[64 * x:64 * x + 64, 64 * y:64 * y + 64, 64 * z:64 * z + 64].read(order="F").result()
            t2 = time.perf_counter()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return t1 - t0, t2 - t1, peak, ls.n

    once(counts[0])  # imports, JIT caches
    res = {n: [] for n in counts}
    for r in range(rounds):
        k = r % len(counts)
        for n in counts[k:] + counts[:k]:
            res[n].append(once(n))
    rows = []
    base = C.med([o + f for o, f, _, _ in res[counts[0]]])
    for n in counts:
        o, f, m, ls = (list(v) for v in zip(*res[n], strict=True))
        tot = C.med(np.add(o, f))
        rows.append([f"{n:,}", C.ms(C.med(o), 2), C.ms(C.med(f), 2), C.ms(tot, 2), f"{tot / base:.2f}",
                     f"{max(m) / 1e6:.2f}", max(ls)])
    C.table(["shards", "open p50 ms", "first chunk p50 ms", "open + chunk p50 ms", f"÷ {counts[0]} shards",
             "peak heap MB", "folder listings"], rows, title=f"With the spec (no listing), {rounds} interleaved rounds")
    worst = max(C.med(np.add(*list(zip(*res[n], strict=True))[:2])) for n in counts) / base

    # a fresh process: import + open + first chunk (what a script or a worker pays once)
    rows = []
    nproc = 1 if args.quick else 3
    fr = {n: [] for n in (counts[0], counts[-1])}
    for i in range(nproc):
        for n in (fr if i % 2 == 0 else list(fr)[::-1]):
            fr[n].append(fresh_process(exports[n], coords[int(rng.integers(n))].tolist(), spec))
    for n, v in fr.items():
        rows.append([f"{n:,}", C.ms(C.med([r["import"] for r in v]), 0), C.ms(C.med([r["open"] for r in v]), 1),
                     C.ms(C.med([r["first"] for r in v]), 0), "yes" if any(r["pandas"] for r in v) else "no",
                     f"{max(r['peak'] for r in v) / C.MIB:.0f}"])
    C.table(["shards", "import dvidshards ms", "open ms", "first chunk ms", "pandas imported", "peak RSS MiB"], rows,
            title=f"Fresh Python process: import, open with the spec, first chunk ({nproc} process(es) each)")

    # no spec: geometry inferred from the folder (informational)
    rows = []
    nr = 1 if args.quick else 3
    for n in counts:
        v = [once(n, with_spec=False) for _ in range(nr)]
        o, f, m, ls = (list(x) for x in zip(*v, strict=True))
        rows.append([f"{n:,}", C.ms(C.med(o), 1), C.ms(C.med(f), 2), f"{max(m) / 1e6:.1f}", max(ls)])
    C.table(["shards", "open p50 ms", "first chunk p50 ms", "peak heap MB", "folder listings"], rows,
            title=f"Without a spec (geometry inferred by listing the folder), {nr} run(s) each")
    C.table(["target", "measured", "verdict"], [
        [f"open + first chunk with {counts[-1]:,} shards within 1.5 × of {counts[0]} shards",
         f"worst {worst:.2f} ×", C.verdict(worst <= 1.5)]], title="Target")
    print(f"load average at end: {C.load_text()}")


if __name__ == "__main__":
    main()
