"""Cost per chunk in the real 258-record mCNS shard vs a 32,768-record shard of the same blocks.

Run from the project root::

    python benchmarks/bench_shard_size.py [--quick] [--passes N] [--workdir DIR] [--data DIR]

* small: the real shard ``30720_24576_28672`` (mCNS scale 1, 258 records, 1.1 MB; read in
  place from ``--data`` through symlinks, with its variant A index);
* big: a shard with the same name and box holding all 32³ = 32,768 chunks, record k carrying
  the real record ``k % 258``'s block, labels and supervoxels (~140 MB; written once).

Warm: the same 258 blocks are read from each: every real chunk of the small shard, and in the
big shard one chunk per real block (at a random position of the 32³ box). One chunk per
``store[chunk].read(order="F")`` (TensorStore cache off), small and big interleaved chunk by
chunk, random order, ``--passes`` passes. Also without TensorStore: ``Shard.read_into`` into
one buffer. Cold: open + first chunk (the shard index is loaded) on fresh stores.
"""

from __future__ import annotations

import time

import common as C
import numpy as np

import dvidshards

ORIGIN = (30720, 24576, 28672)
LO = np.array(ORIGIN) // 64


def main(argv=None):
    ap = C.parser(__doc__)
    ap.add_argument("--passes", type=int, default=None, help="passes over the 258 blocks (default 10; --quick 2)")
    ap.add_argument("--cold", type=int, default=None, help="cold opens per shard (default 10; --quick 3)")
    args = ap.parse_args(argv)
    C.require_real_data(args.data)
    passes = args.passes or (2 if args.quick else 10)
    ncold = args.cold or (3 if args.quick else 10)
    spec = C.mcns_spec(args.data)
    small_root = C.real_export(args.workdir, args.data)
    big_root = C.big_shard_export(args.workdir, args.data)
    records = C.real_records(args.data)
    n = len(records)
    rng = np.random.default_rng(9)
    small_chunks = np.array([(r["chunk_x"], r["chunk_y"], r["chunk_z"]) for r in records], np.int64)
    # big: record k = real record k % n; one chunk per real block, k = j + n * m
    ks = np.arange(n) + n * rng.integers(0, 32768 // n, size=n)
    big_chunks = LO + np.stack([ks % 32, ks // 32 % 32, ks // 1024], axis=1)

    C.header("bench_shard_size: per-chunk cost, 258-record vs 32,768-record shard")
    small = dvidshards.open(small_root, scale=1, spec=spec, context=C.context())
    big = dvidshards.open(big_root, scale=1, spec=spec, context=C.context())
    for s, c in ((small, small_chunks), (big, big_chunks)):
        C.warm(s, 64 * c[0])

    def box(store, c):
        x, y, z = (int(v) for v in c)
        return store[64 * x:64 * x + 64, 64 * y:64 * y + 64, 64 * z:64 * z + 64]

    # correctness: same blocks, same voxels
    for j in rng.choice(n, 8, replace=False):
        if not np.array_equal(box(small, small_chunks[j]).read().result(), box(big, big_chunks[j]).read().result()):
            raise SystemExit("big shard does not hold the small shard's blocks: rebuild --workdir")

    lat = {"small": [], "big": []}
    for p in range(passes):
        for j in rng.permutation(n):
            pair = (("small", small, small_chunks[j]), ("big", big, big_chunks[j]))
            for name, store, c in (pair if (p + j) % 2 else pair[::-1]):
                b = box(store, c)
                t = time.perf_counter()
                b.read(order="F").result()
                lat[name].append(time.perf_counter() - t)

    # the same without TensorStore: the shard object's read_into
    from dvidshards.formats.labels import Agglomerated

    labels = Agglomerated()
    direct = {"small": [], "big": []}
    out = np.empty((64, 64, 64), np.uint64)
    readers = {}
    for name, root in (("small", small_root), ("big", big_root)):
        readers[name] = dvidshards.Dataset(root, spec=spec).shard(1, ORIGIN)
    for _ in range(passes):
        for j in rng.permutation(n):
            for name, c in (("small", small_chunks[j]), ("big", big_chunks[j])):
                sf = readers[name]
                t = time.perf_counter()
                sf.read_into(*(int(v) for v in c), out, labels)
                direct[name].append(time.perf_counter() - t)

    rows = []
    for label, res in (("TensorStore read", lat), ("Shard.read_into", direct)):
        for name in ("small", "big"):
            v = res[name]
            rows.append([label, f"{name} ({len(readers[name]):,} records)", C.ms(C.pct(v, 50), 3),
                         C.ms(float(np.mean(v)), 3), C.ms(C.pct(v, 95), 3),
                         f"{C.pct(v, 50) / C.pct(res['small'], 50):.3f}",
                         f"{np.mean(v) / np.mean(res['small']):.3f}"])
    C.table(["path", "shard", "p50 ms", "mean ms", "p95 ms", "p50 ÷ small", "mean ÷ small"], rows,
            title=f"Warm per-chunk cost, same 258 blocks, {passes} passes (interleaved)")

    cold = {"small": [], "big": []}
    for i in range(ncold):
        for name, root, chunks in (("small", small_root, small_chunks), ("big", big_root, big_chunks))[::1 - 2 * (i % 2)]:
            c = chunks[rng.integers(n)]
            t0 = time.perf_counter()
            s = dvidshards.open(root, scale=1, spec=spec, context=C.context())
            box(s, c).read(order="F").result()
            cold[name].append(time.perf_counter() - t0)
            del s
    rows = [[f"{name} ({len(readers[name]):,} records, "
             f"{(C.Path(root) / 's1' / (C.REAL_SHARD + '.arrow')).stat().st_size / 1e6:.1f} MB)",
             C.ms(C.med(cold[name]), 1), C.ms(min(cold[name]), 1), C.ms(max(cold[name]), 1)]
            for name, root in (("small", small_root), ("big", big_root))]
    C.table(["shard", "p50 ms", "min ms", "max ms"], rows,
            title=f"Cold: open + first chunk (shard index loaded and checked), {ncold} fresh stores each")

    # where a cold load goes (no TensorStore): the steps of the shard loader, timed alone
    from dvidshards.formats import arrowipc as ipc
    from dvidshards.formats.chunkindex import parse_csv
    from dvidshards.shard import load_shard_sync
    from dvidshards.stores import LocalStore

    rows = []
    stem = f"s1/{C.REAL_SHARD}"
    for name, root in (("small", small_root), ("big", big_root)):
        src = LocalStore(root)
        scale = dvidshards.Dataset(root, spec=spec).scale(1)
        steps = {k: [] for k in ("load_shard_sync()", "parse_csv", "resolve_rows", "scan_stream (skipped)")}
        for _ in range(ncold):
            t = time.perf_counter()
            sf = load_shard_sync(src, scale, ORIGIN)
            steps["load_shard_sync()"].append(time.perf_counter() - t)
            data = src.map(stem + ".arrow")
            t = time.perf_counter()
            parse_csv(bytes(src.read_sync(stem + ".csv")), stem)
            steps["parse_csv"].append(time.perf_counter() - t)
            t = time.perf_counter()
            ipc.resolve_rows(data, 0, sf.index.msg_off, sf.index.msg_len, sf.index.row, sf.layout, stem)
            steps["resolve_rows"].append(time.perf_counter() - t)
            t = time.perf_counter()
            ipc.scan_stream(data, sf.schema_size, data.shape[0], stem)
            steps["scan_stream (skipped)"].append(time.perf_counter() - t)
            del sf, data
        rows.append([f"{name} ({len(readers[name]):,} records)", *(C.ms(C.med(v), 1) for v in steps.values())])
    C.table(["shard", "load_shard_sync() total ms", "parse_csv ms", "resolve_rows ms",
             "scan_stream ms (not needed for a tiling A/B index)"], rows,
            title=f"Cold shard load without TensorStore (medians of {ncold}; steps re-timed alone, fresh mapping)")

    ratio = C.pct(lat["big"], 50) / C.pct(lat["small"], 50)
    ratio_mean = float(np.mean(lat["big"]) / np.mean(lat["small"]))
    C.table(["target", "measured", "verdict"], [
        ["per-chunk cost in a 32,768-record shard ≤ 1.2 × that in a 258-record shard",
         f"{ratio:.3f} × (p50), {ratio_mean:.3f} × (mean)", C.verdict(ratio <= 1.2 and ratio_mean <= 1.2)],
        *[[f"random 64³ chunk from a cold shard index ≤ 20 ms, {name} shard",
           f"{C.med(cold[name]) * 1e3:.1f} ms (p50, open included)", C.verdict(C.med(cold[name]) <= 0.020)]
          for name in ("small", "big")]],
        title="Target")
    print(f"load average at end: {C.load_text()}")


if __name__ == "__main__":
    main()
