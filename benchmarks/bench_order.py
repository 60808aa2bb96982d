"""Per-chunk read latency by visiting order: Morton (compressed Z-index) vs ZYX vs random.

Run from the project root::

    python benchmarks/bench_order.py [--quick] [--passes N] [--workdir DIR] [--data DIR]

TensorStore's sharded drivers request chunks in compressed Z-index (Morton) order; DVID writes
records in ZYX order within a shard. Chunks are read one at a time (``store[chunk].read(
order="F")``, TensorStore cache off, shard indexes warm) over the same set of chunks in each
order, interleaving the orders pass by pass. Volumes:

* the synthetic 512³ export of bench_read (1 shard, 512 chunk slots, 511 records);
* the 32,768-record mCNS-geometry shard of bench_shard_size (every chunk of a 32³ box;
  a 16³ sub-box, 4,096 chunks, is visited).
"""

from __future__ import annotations

import time

import common as C
import numpy as np

from dvidshards.formats.sharding import compressed_morton_code, grid_shape


def orders(coords: np.ndarray, grid, seed: int = 3) -> dict[str, np.ndarray]:
    """The chunk list in ZYX (z slowest, as DVID writes), Morton and random order."""
    zyx = coords[np.lexsort((coords[:, 0], coords[:, 1], coords[:, 2]))]
    morton = coords[np.argsort(compressed_morton_code(coords, grid), kind="stable")]
    rnd = coords[np.random.default_rng(seed).permutation(len(coords))]
    return {"Morton (Z-index)": morton, "ZYX": zyx, "random": rnd}


def visit(store, chunks: np.ndarray) -> list[float]:
    lat = []
    for x, y, z in chunks.tolist():
        box = store[64 * x:64 * x + 64, 64 * y:64 * y + 64, 64 * z:64 * z + 64]
        t = time.perf_counter()
        box.read(order="F").result()
        lat.append(time.perf_counter() - t)
    return lat


def measure(store, coords, grid, passes: int) -> dict[str, list[float]]:
    ords = orders(coords, grid)
    visit(store, ords["ZYX"])  # warm: shard index loaded, pages mapped
    out = {k: [] for k in ords}
    names = list(ords)
    for p in range(passes):
        for k in names[p % 3:] + names[:p % 3]:
            out[k] += visit(store, ords[k])
    return out


def main(argv=None):
    ap = C.parser(__doc__)
    ap.add_argument("--passes", type=int, default=None, help="passes over the chunks per order (default 3; --quick 1)")
    args = ap.parse_args(argv)
    passes = args.passes or (1 if args.quick else 3)
    size = 256 if args.quick else 512
    pair = C.synthetic_pair(args.workdir, size)
    cases = []
    g = size // 64
    coords = np.array([(x, y, z) for z in range(g) for y in range(g) for x in range(g)], np.int64)
    cases.append((f"synthetic {size}³ (1 shard, {len(coords)} chunks)", pair.open(C.context()), coords, (g,) * 3))
    if (args.data / f"{C.REAL_SHARD}.arrow").is_file():
        import dvidshards

        big = C.big_shard_export(args.workdir, args.data)
        store = dvidshards.open(big, scale=1, spec=C.mcns_spec(args.data), context=C.context())
        n = 8 if args.quick else 16
        lo = np.array([480, 384, 448])
        coords = np.array([(x, y, z) for z in range(n) for y in range(n) for x in range(n)], np.int64) + lo
        grid = grid_shape(C.mcns_spec(args.data)["scales"][1]["size"], 64)
        cases.append((f"32,768-record shard ({n}³ = {n ** 3} chunks of it)", store, coords, grid))
    C.header("bench_order: per-chunk latency by visiting order (warm shard index, cache off)")
    rows = []
    for what, store, coords, grid in cases:
        C.warm(store, 64 * coords[0])
        res = measure(store, coords, grid, passes)
        base = C.pct(res["ZYX"], 50)
        for k, v in res.items():
            rows.append([what, k, C.ms(C.pct(v, 50), 3), C.ms(C.pct(v, 95), 3), C.ms(float(np.mean(v)), 3),
                         f"{C.pct(v, 50) / base:.2f}"])
    C.table(["volume", "order", "p50 ms", "p95 ms", "mean ms", "p50 ÷ ZYX"], rows,
            title=f"Single-chunk reads, {passes} interleaved pass(es) per order")
    print(f"load average at end: {C.load_text()}")


if __name__ == "__main__":
    main()
