"""512³ read with TensorStore's data_copy_concurrency 1 vs 2 (thread scaling).

Run from the project root::

    python benchmarks/bench_threads.py [--quick] [--rounds N] [--workdir DIR]

The synthetic export of bench_read, read whole with ``read(order="F")`` (cache off) from stores
opened with ``data_copy_concurrency`` 1 and 2; the precomputed twin and the trivial-fill
``virtual_chunked`` floor likewise, to show how much of the read scales at all. All six stores
are interleaved round by round; wall time and process CPU time (user + system) per read.

A second table reads into a preallocated, already-touched output array (``ts.array(out).write
(store)``), which removes the first-touch page faults of a fresh 1 GiB output from the
measurement; a third times the callback's own work (``Shard.read_into`` of every chunk, no
TensorStore) on 1 and 2 Python threads.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import common as C
import numpy as np
import tensorstore as ts


def cpu() -> tuple[float, float]:
    t = os.times()
    return t.user, t.system


def alternate_cpu(fns: dict, rounds: int):
    names = list(fns)
    wall = {n: [] for n in names}
    cpus = {n: [] for n in names}
    for r in range(rounds + 1):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            C.gc.collect()
            t0, c0 = time.perf_counter(), cpu()
            fns[n]()
            t1, c1 = time.perf_counter(), cpu()
            if r:
                wall[n].append(t1 - t0)
                cpus[n].append((c1[0] - c0[0], c1[1] - c0[1]))
    return wall, cpus


def main(argv=None):
    ap = C.parser(__doc__)
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 7; --quick 2)")
    args = ap.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 7)
    size = 256 if args.quick else 512
    pair = C.synthetic_pair(args.workdir, size)
    C.header("bench_threads: data_copy_concurrency 1 vs 2")
    stores = {}
    for k in (1, 2):
        stores[("dvidshards", k)] = pair.open(C.context(dcc=k))
        stores[("precomputed", k)] = pair.open_precomputed(C.context(dcc=k))
        stores[("trivial fill", k)] = C.fill_store(pair.shape, ctx=C.context(dcc=k))
    C.warm(stores[("dvidshards", 1)])
    C.warm(stores[("dvidshards", 2)])

    fns = {key: (lambda s=s: s.read(order="F").result()) for key, s in stores.items()}
    wall, cpus = alternate_cpu(fns, rounds)
    rows = []
    for name in ("dvidshards", "precomputed", "trivial fill"):
        w1, w2 = C.med(wall[(name, 1)]), C.med(wall[(name, 2)])
        u1, s1 = (C.med(v) for v in zip(*cpus[(name, 1)], strict=True))
        u2, s2 = (C.med(v) for v in zip(*cpus[(name, 2)], strict=True))
        rows.append([name, C.ms(w1), C.ms(w2), f"{w1 / w2:.2f}", f"{u1 * 1e3:.0f} + {s1 * 1e3:.0f}",
                     f"{u2 * 1e3:.0f} + {s2 * 1e3:.0f}"])
    C.table(["store", "dcc=1 ms", "dcc=2 ms", "speedup", "CPU user + sys ms, dcc=1", "CPU user + sys ms, dcc=2"], rows,
            title=f"{size}³ read(order='F') into a new array (medians of {rounds} interleaved rounds)")
    speedup = C.med(wall[("dvidshards", 1)]) / C.med(wall[("dvidshards", 2)])

    out = np.empty((size,) * 3, np.uint64, order="F")
    out.fill(1)  # touch every page once
    dst = ts.array(out, copy=False)
    fns = {key: (lambda s=s, dst=dst: dst.write(s).result()) for key, s in stores.items()}
    wall2, _ = alternate_cpu(fns, rounds)
    rows = []
    for name in ("dvidshards", "precomputed", "trivial fill"):
        w1, w2 = C.med(wall2[(name, 1)]), C.med(wall2[(name, 2)])
        rows.append([name, C.ms(w1), C.ms(w2), f"{w1 / w2:.2f}"])
    C.table(["store", "dcc=1 ms", "dcc=2 ms", "speedup"], rows,
            title=f"{size}³ read into a preallocated, touched array (medians of {rounds} rounds)")
    del out, dst

    # the callback's own work, no TensorStore: every chunk decoded into per-thread buffers
    ds = C.dvidshards.Dataset(pair.export, spec=pair.spec)
    reader = ds.reader(0)  # dvidshards.read.ChunkReader: the virtual_chunked read function
    g = size // 64
    chunks = [(x, y, z) for z in range(g) for y in range(g) for x in range(g)]
    bufs = [np.empty((64, 64, 64), np.uint64) for _ in range(2)]

    def work(part, buf):
        for c in part:
            sf = reader.shard(*c)
            if sf is None:
                buf.fill(0)
            else:
                sf.read_into(*c, buf, reader.labels)

    def run(k):
        with ThreadPoolExecutor(k) as pool:
            list(pool.map(work, [chunks[i::k] for i in range(k)], bufs[:k]))

    run(2)
    w3, c3 = alternate_cpu({1: lambda: run(1), 2: lambda: run(2)}, rounds)
    C.table(["threads", "ms", "speedup", "CPU user ms"], [
        [k, C.ms(C.med(w3[k])), f"{C.med(w3[1]) / C.med(w3[k]):.2f}", C.ms(C.med([u for u, _ in c3[k]]), 0)]
        for k in (1, 2)],
        title=f"Callback work only: Shard.read_into of all {len(chunks)} chunks, Python threads")

    C.table(["target", "measured", "verdict"], [
        [f"{size}³ read: 2 threads ≥ 1.8 × 1 thread", f"{speedup:.2f} ×", C.verdict(speedup >= 1.8)]],
        title="Target")
    print(f"load average at end: {C.load_text()}")


if __name__ == "__main__":
    main()
