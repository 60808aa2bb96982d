"""dvidshards vs the same voxels converted to neuroglancer precomputed, read side by side.

Run from the project root::

    python benchmarks/bench_read.py [--quick] [--rounds N] [--size 512] [--workdir DIR]

Data: a synthetic neuron-like export (``size``³, default 512³, ~70 % foreground, ~20 labels per
block) written in DVID's layout, and the same agglomerated voxels written by TensorStore as
``neuroglancer_precomputed`` (compressed_segmentation, sharded with the export's own sharding
parameters, local disk). Both are generated once into ``--workdir``.

Measured in this one process, TensorStore cache off (``cache_pool`` 0) for every store,
default ``data_copy_concurrency`` (= CPU count), interleaved rounds, medians:

1. the whole aligned ``size``³ box with ``read(order="F")``: dvidshards, precomputed and the
   trivial-fill floor (a ``virtual_chunked`` store like dvidshards' whose callback only fills), in
   wall time and in the process's CPU time (all threads; what other processes on a loaded machine
   disturb far less), and the thread CPU time spent inside the two read callbacks (dvidshards' part
   of the read; ``--headline-only`` runs this section alone);
2. unaligned boxes at odd offsets;
3. single 64³ chunks in random order with warm shard indexes (per-chunk latency);
4. single random 64³ chunks right after opening (cold shard index; the OS page cache is warm);
5. the read-time check that each record's supervoxel list is its block's label list (issue 23):
   the aligned read (TensorStore, and the bulk reader ``Dataset.read``) with the check and with
   the two methods it changed as they were before it (``without_check``) in this same process,
   interleaved, in wall time and in the process's CPU
   time (all threads), which other processes on a loaded machine disturb far less;
6. what checking the spec against the files costs on an export of mCNS size (issue 23): the
   procedural mCNS store (``tests.support.procedural``, 26,456 shard files at ``s0``) and
   a local folder of the same 52,912 names (empty files, made once in ``--workdir``): a full
   listing check (what a job's ``Dataset.shards`` and an open with a consolidated index do),
   the sample an open takes of a local folder, the existence probes next to the first shards
   a reader loads, and open + first chunk with these checks and without them.
"""

from __future__ import annotations

import time

import common as C
import numpy as np
import tensorstore as ts

import dvidshards
from dvidshards.errors import BlockDecodeError
from dvidshards.formats import records
from dvidshards.formats.codec import decode_into

UNALIGNED = [  # (offset, shape), x y z
    ((37, 101, 211), (300, 200, 100)),
    ((130, 7, 333), (200, 300, 150)),
    ((0, 0, 257), (512, 512, 1)),  # one z section: 64 chunks for 0.25 M voxels
    ((311, 259, 17), (190, 190, 390)),
]


# --- the reads as they were before the label-list check (issue 23), to time it in this process ---

def _decode_into_before(self, i, out, labels):
    """RecordTable.decode_into without the check: the label counts compared, not the lists (the rest
    as it is now: payload read, zstd, palette, decode)."""
    r = self.rec[i].tolist()
    pay = r[records.R_PAY]
    f = self.file
    try:
        payload = self.payload(i) if f is not None else self.bufs[0][pay:pay + r[records.R_PAYLEN]]
        block = records._decompress(payload, r[records.R_USIZE], self._max_block)
        n = int.from_bytes(block[12:16], "little") if len(block) >= 16 else -1
        if n >= 1 and n != r[records.R_NSV]:
            raise BlockDecodeError(f"the block has {n} labels but its record lists {r[records.R_NSV]}")
        decode_into(np.frombuffer(block, np.uint8), labels.palette(self, i), out)
    except BlockDecodeError as e:
        raise BlockDecodeError(f"{self.where(i)}: {e}") from None


def _labels_match_before(self, i, b):
    """The bulk reader's test before the check: the block's label count against the record's."""
    return int(b[12:16].view("<u4")[0]) == self.rec[i, records.R_NSV]


def without_check(fn):
    """fn run with the reads as they were before the check."""
    def run():
        saved = records.RecordTable.decode_into, records.RecordTable.labels_match
        records.RecordTable.decode_into = _decode_into_before
        records.RecordTable.labels_match = _labels_match_before
        try:
            return fn()
        finally:
            records.RecordTable.decode_into, records.RecordTable.labels_match = saved
    return run


def alternate_cpu(fns: dict, rounds: int) -> tuple[dict, dict]:
    """``C.alternate``, timing each call in wall time and in this process's CPU time: (wall, cpu)."""
    import gc

    names = list(fns)
    wall: dict = {n: [] for n in names}
    cpu: dict = {n: [] for n in names}
    for r in range(1 + rounds):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            gc.collect()
            t, c = time.perf_counter(), time.process_time()
            fns[n]()
            if r:
                wall[n].append(time.perf_counter() - t)
                cpu[n].append(time.process_time() - c)
    return wall, cpu


class CallbackClock:
    """Thread CPU time spent inside read callbacks (dvidshards' ChunkReader, the fill store's)."""

    def __init__(self):
        import threading

        from dvidshards import read as read_mod

        self.total = 0.0
        self.calls = 0
        self._lock = threading.Lock()
        self._cls = read_mod.ChunkReader
        self._orig = read_mod.ChunkReader.__call__
        clock = self

        def timed(reader, domain, array, params=None):
            c = time.thread_time()
            try:
                return clock._orig(reader, domain, array, params)
            finally:
                clock.add(time.thread_time() - c)

        self._timed = timed

    def add(self, dt: float) -> None:
        with self._lock:
            self.total += dt
            self.calls += 1

    def __enter__(self):
        self.total, self.calls = 0.0, 0
        self._cls.__call__ = self._timed
        return self

    def __exit__(self, *exc):
        self._cls.__call__ = self._orig


def timed_fill_store(shape, clock: CallbackClock, ctx=None):
    """``C.fill_store`` whose callback time goes to ``clock``."""
    def fill(domain, array, params):
        c = time.thread_time()
        array.fill(3)
        clock.add(time.thread_time() - c)

    return ts.virtual_chunked(
        fill, dtype=ts.uint64, domain=ts.IndexDomain(labels=["x", "y", "z"], shape=list(shape)),
        chunk_layout=ts.ChunkLayout(read_chunk_shape=[C.CHUNK] * 3, grid_origin=[0, 0, 0], inner_order=[2, 1, 0]),
        context=ctx)


def headline_section(d, p, f, size: int, rounds: int) -> dict[str, float]:
    """Section 1: the aligned read of the whole volume, wall and CPU, and the callbacks' own CPU."""
    wall, cpu = alternate_cpu({"dvidshards": lambda: d.read(order="F").result(),
                               "precomputed": lambda: p.read(order="F").result(),
                               "trivial fill": lambda: f.read(order="F").result()}, rounds)
    pw, pc = C.med(wall["precomputed"]), C.med(cpu["precomputed"])
    rows = [[k, C.ms(C.med(wall[k])), C.ms(min(wall[k])), f"{C.med(wall[k]) / pw:.3f}",
             f"{C.med(np.divide(wall[k], wall['precomputed'])):.3f}", C.ms(C.med(cpu[k])),
             f"{C.med(cpu[k]) / pc:.3f}", f"{C.med(np.divide(cpu[k], cpu['precomputed'])):.3f}"] for k in wall]
    C.table(["store", "wall median ms", "wall min ms", "wall ÷ precomputed", "per-round wall ratio",
             "CPU median ms", "CPU ÷ precomputed", "per-round CPU ratio"], rows,
            title=f"Aligned {size}³ read, read(order='F') into a new array, {rounds} interleaved rounds")
    clock = CallbackClock()
    timed_fill = timed_fill_store(f.shape, clock, C.context())
    per = {}
    for name, store in (("dvidshards", d), ("trivial fill", timed_fill)):
        got = []
        for _ in range(max(3, rounds // 2)):
            with clock:
                store.read(order="F").result()
            got.append(clock.total / max(1, clock.calls))
        per[name] = C.med(got)
    C.table(["read callback", "thread CPU per 64³ chunk µs"], [[k, f"{v * 1e6:.1f}"] for k, v in per.items()],
            title="Inside the read callbacks (TensorStore's own work, the copy into the output, is outside)")
    return {"wall": C.med(wall["dvidshards"]) / pw, "cpu": C.med(cpu["dvidshards"]) / pc,
            "wall_rounds": C.med(np.divide(wall["dvidshards"], wall["precomputed"])),
            "cpu_rounds": C.med(np.divide(cpu["dvidshards"], cpu["precomputed"])),
            "floor": C.med(wall["trivial fill"]) / pw, "callback": per["dvidshards"], "fill_callback": per["trivial fill"]}


def _box(store, off, shape):
    return store[tuple(slice(o, o + s) for o, s in zip(off, shape, strict=True))]


def check_section(d, pair, size: int, rounds: int) -> dict[str, float]:
    """Section 5: the aligned read with the label-list check and as before it; CPU-time ratios."""
    ds = dvidshards.Dataset(pair.export, spec=pair.spec)
    whole = [[0, 0, 0], list(pair.shape)]
    bulk_out = np.empty(pair.shape, np.uint64, order="F")
    variants = {"TensorStore read": lambda: d.read(order="F").result(),
                "Dataset.read (bulk)": lambda: ds.read(whole, out=bulk_out)}
    check_rows, check_ratio = [], {}
    for name, fn in variants.items():
        fns = {"on": fn, "off": without_check(fn)}
        wall: dict = {"on": [], "off": []}
        cpu: dict = {"on": [], "off": []}
        for r in range(1 + 2 * rounds):  # interleaved, alternating which goes first
            for k in (("on", "off") if r % 2 else ("off", "on")):
                t0, c0 = time.perf_counter(), time.process_time()
                fns[k]()
                if r:
                    wall[k].append(time.perf_counter() - t0)
                    cpu[k].append(time.process_time() - c0)
        check_ratio[name] = C.med(np.divide(cpu["on"], cpu["off"]))
        check_rows.append([name, C.ms(C.med(wall["on"])), C.ms(C.med(wall["off"])),
                           f"{C.med(np.divide(wall['on'], wall['off'])):.3f}", C.ms(C.med(cpu["on"])),
                           C.ms(C.med(cpu["off"])), f"{check_ratio[name]:.3f}"])
    C.table(["aligned read", "check wall ms", "before wall ms", "wall ÷ before", "check CPU ms", "before CPU ms",
             "CPU ÷ before"], check_rows,
            title=f"Read-time label-list check (N uint64 compares per chunk), aligned {size}³, medians of "
                  f"{2 * rounds} interleaved rounds (per-round ratios)")
    return check_ratio


def spec_check_section(workdir, rounds: int) -> None:
    """Section 6: the cost of checking the spec against the files, at mCNS size."""
    import os

    from dvidshards import dataset as dataset_mod
    from dvidshards import read as read_mod
    from dvidshards.read import check_scale
    from dvidshards.scalefiles import neighbour_origins, parse_shard_names
    from dvidshards.stores import LocalStore
    from tests.support.procedural import ProceduralStore

    proc = ProceduralStore()
    spec = proc.spec
    s0 = dvidshards.Dataset(proc, spec=spec).scale(0)
    names = proc.list_sync("s0")
    folder = workdir / "mcns-names" / "s0"
    if not folder.is_dir() or len(os.listdir(folder)) != len(names):
        folder.mkdir(parents=True, exist_ok=True)
        for n in names:
            (folder / n).touch()
    local = LocalStore(folder.parent)
    origins = parse_shard_names(names)
    first = origins[len(origins) // 2]

    def timed(fn, n=rounds):
        out = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
        return C.med(out)

    rows = [
        ["list s0 (the store's own cost)", f"{len(names):,} names",
         C.ms(timed(lambda: proc.list_sync("s0"))), C.ms(timed(lambda: local.list_sync("s0")))],
        ["names -> origins, checked against the spec", f"{len(origins):,} origins",
         C.ms(timed(lambda: parse_shard_names(names))), "same"],
        ["full listing check (check_scale)", "a job's shards(), an open with index=",
         C.ms(timed(lambda: proc._sync(check_scale(proc, s0)))),
         C.ms(timed(lambda: local._sync(check_scale(local, s0))))],
        ["sample at open (sample_scale, 256 names)", "local folders only",
         "-", C.ms(timed(lambda: dataset_mod.Dataset(folder.parent, spec=spec)._sample(s0)), 2)],
        ["existence probes next to one shard", f"{len(neighbour_origins(s0, first))} names",
         C.ms(timed(lambda: [proc.exists_sync(s0.stem(o) + ".arrow") for o in neighbour_origins(s0, first)]), 2),
         C.ms(timed(lambda: [local.exists_sync(s0.stem(o) + ".arrow") for o in neighbour_origins(s0, first)]), 2)],
    ]
    C.table(["step", "what", "procedural mCNS ms", "local folder of the names ms"], rows,
            title="Checking the spec against the files at mCNS size (medians)")

    # open + first chunk, procedural mCNS, with the checks and without them (same process, interleaved)
    present = [c for c in proc.shard_chunks(0, first)[:1]]
    x, y, z = (int(v) for v in present[0])

    def open_and_read():
        v = dvidshards.open(proc, spec=spec)
        v[64 * x:64 * x + 64, 64 * y:64 * y + 64, 64 * z:64 * z + 64].read(order="F").result()

    def without_checks():
        saved = read_mod.probe_neighbours, dataset_mod.sample_scale

        async def nothing(*a, **k):
            return None

        read_mod.probe_neighbours, dataset_mod.sample_scale = nothing, nothing
        try:
            open_and_read()
        finally:
            read_mod.probe_neighbours, dataset_mod.sample_scale = saved

    open_and_read()
    t = C.alternate({"with the checks": open_and_read, "without": without_checks}, rounds)
    C.table(["procedural mCNS s0", "open + first chunk p50 ms", "÷ without"],
            [[k, C.ms(C.med(v), 2), f"{C.med(v) / C.med(t['without']):.3f}"] for k, v in t.items()],
            title="Open + first chunk of the mCNS-sized export (the first load probes its neighbours)")


def main(argv=None):
    ap = C.parser(__doc__)
    ap.add_argument("--size", type=int, default=None, help="volume side in voxels (default 512; --quick 256)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds per read (default 11; --quick 3)")
    ap.add_argument("--chunks", type=int, default=None, help="random single chunks (default 300; --quick 60)")
    ap.add_argument("--cold", type=int, default=None, help="cold opens (default 30; --quick 8)")
    ap.add_argument("--check-only", action="store_true", help="only section 5 (the label-list check)")
    ap.add_argument("--spec-check-only", action="store_true", help="only section 6 (checking the spec)")
    ap.add_argument("--headline-only", action="store_true", help="only section 1 (the aligned read, wall and CPU)")
    args = ap.parse_args(argv)
    size = args.size or (256 if args.quick else 512)
    rounds = args.rounds or (3 if args.quick else 11)
    nchunks = args.chunks or (60 if args.quick else 300)
    ncold = args.cold or (8 if args.quick else 30)

    if args.spec_check_only:
        C.header("bench_read: checking the spec against the files at mCNS size")
        spec_check_section(args.workdir, rounds)
        print(f"load average at end: {C.load_text()}")
        return
    pair = C.synthetic_pair(args.workdir, size)
    C.header("bench_read: dvidshards vs neuroglancer precomputed (TensorStore), cache off")
    st = pair.stats
    C.table(["data", "value"], [
        ["volume", f"{size}³ uint64 ({size ** 3 * 8 / C.GIB:.2f} GiB), 64³ chunks, {(size // 64) ** 3} chunk slots"],
        ["foreground", f"{st['foreground']:.0%}"],
        ["labels per 64³ chunk", f"median {st['labels_per_chunk_median']:.0f}, max {st['labels_per_chunk_max']}"],
        ["export on disk (DVID, zstd)", f"{st['export_bytes'] / C.MIB:.1f} MiB"],
        ["precomputed on disk (compressed_segmentation, sharded)", f"{st['precomputed_bytes'] / C.MIB:.1f} MiB"],
        ["rounds", f"{rounds} interleaved + 1 warm-up"],
    ], title="Data")

    d = pair.open(C.context())
    p = pair.open_precomputed(C.context())
    f = C.fill_store(pair.shape, ctx=C.context())
    C.warm(d)
    if args.check_only:
        ratio = check_section(d, pair, size, rounds)
        print(f"label-list check: {ratio}; load average at end: {C.load_text()}")
        return
    a = d.read(order="F").result()
    b = p.read(order="F").result()
    if not np.array_equal(a, b):
        raise SystemExit("dvidshards and precomputed volumes differ: rebuild --workdir")
    del a, b

    # 1. aligned whole box
    head = headline_section(d, p, f, size, rounds)
    aligned_ratio, floor_ratio = head["wall"], head["floor"]
    if args.headline_only:
        C.table(["target", "measured", "verdict"], [
            [f"aligned {size}³: dvidshards ≤ 1.0 × precomputed (wall)", f"{aligned_ratio:.3f} × (per round "
             f"{head['wall_rounds']:.3f} ×; trivial-fill floor {floor_ratio:.3f} ×)", C.verdict(aligned_ratio <= 1.0)],
            [f"aligned {size}³: dvidshards ≤ 1.0 × precomputed (process CPU)", f"{head['cpu']:.3f} × (per round "
             f"{head['cpu_rounds']:.3f} ×)", C.verdict(head["cpu"] <= 1.0)],
        ], title="Targets")
        print(f"load average at end: {C.load_text()}")
        return

    # the same into a preallocated, already-touched array: no first-touch page faults of the
    # fresh output (most of the time above, and most of its variance on this VM)
    out = np.empty(pair.shape, np.uint64, order="F")
    out.fill(1)
    dst = ts.array(out, copy=False)
    tp = C.alternate({k: (lambda s=s, dst=dst: dst.write(s).result())
                      for k, s in (("dvidshards", d), ("precomputed", p), ("trivial fill", f))}, rounds)
    pm2 = C.med(tp["precomputed"])
    rows = [[k, C.ms(C.med(v)), C.ms(min(v)), f"{C.med(v) / pm2:.3f}", C.ms(C.med(v) - C.med(tp["trivial fill"]))]
            for k, v in tp.items()]
    C.table(["store", "median ms", "min ms", "÷ precomputed", "above the fill floor ms"], rows,
            title=f"Aligned {size}³ read into a preallocated, touched array (ts.array(out).write(store))")
    del out, dst

    # 2. unaligned boxes
    rows = []
    for off, shape in UNALIGNED:
        if size != 512:  # same boxes relative to the volume
            off = tuple(o * size // 512 | (o & 1) for o in off)
            shape = tuple(max(1, s * size // 512) for s in shape)
        bd, bp, bf = (_box(s, off, shape) for s in (d, p, f))
        t = C.alternate({k: (lambda b=b: b.read(order="F").result()) for k, b in (("d", bd), ("p", bp), ("f", bf))},
                        rounds)
        md, mp, mf = (C.med(t[k]) for k in "dpf")
        rows.append([f"{shape[0]}×{shape[1]}×{shape[2]} at {off}", C.ms(md), C.ms(mp), C.ms(mf),
                     f"{md / mp:.3f}", f"{mf / mp:.3f}"])
    C.table(["box (x×y×z at offset)", "dvidshards ms", "precomputed ms", "fill ms", "dvid ÷ pre", "fill ÷ pre"],
            rows, title="Unaligned boxes (medians)")

    # 3. single chunks, random order, warm
    g = size // 64
    rng = np.random.default_rng(7)
    picks = rng.integers(0, g, size=(nchunks, 3))
    lat = {"dvidshards": [], "precomputed": [], "trivial fill": []}
    stores = list(zip(lat, (d, p, f), strict=True))
    for i, c in enumerate(picks):
        sl = tuple(slice(64 * int(v), 64 * int(v) + 64) for v in c)
        k = i % 3
        for name, s in stores[k:] + stores[:k]:
            t0 = time.perf_counter()
            s[sl].read(order="F").result()
            lat[name].append(time.perf_counter() - t0)
    rows = [[k, C.ms(C.pct(v, 50), 3), C.ms(C.pct(v, 95), 3), C.ms(float(np.mean(v)), 3)] for k, v in lat.items()]
    C.table(["store", "p50 ms", "p95 ms", "mean ms"], rows,
            title=f"Single 64³ chunks, random order, warm ({nchunks} chunks)")
    warm_p50 = C.pct(lat["dvidshards"], 50)

    # 4. cold: open, then one random chunk
    cold = {"dvidshards": ([], []), "precomputed": ([], [])}
    for i in range(ncold):
        c = rng.integers(0, g, size=3)
        sl = tuple(slice(64 * int(v), 64 * int(v) + 64) for v in c)
        for name in (("dvidshards", "precomputed") if i % 2 == 0 else ("precomputed", "dvidshards")):
            t0 = time.perf_counter()
            s = pair.open(C.context()) if name == "dvidshards" else pair.open_precomputed(C.context())
            t1 = time.perf_counter()
            s[sl].read(order="F").result()
            t2 = time.perf_counter()
            cold[name][0].append(t1 - t0)
            cold[name][1].append(t2 - t1)
            del s
    rows = [[k, C.ms(C.med(o), 2), C.ms(C.med(r), 2), C.ms(C.pct(r, 95), 2),
             C.ms(C.med(np.add(o, r)), 2)] for k, (o, r) in cold.items()]
    C.table(["store", "open p50 ms", "first chunk p50 ms", "first chunk p95 ms", "open + chunk p50 ms"], rows,
            title=f"Single random 64³ chunk from a freshly opened volume (cold shard index), {ncold} opens")
    cold_p50 = C.med(cold["dvidshards"][1])

    check_ratio = check_section(d, pair, size, rounds)
    spec_check_section(args.workdir, rounds)

    C.table(["target", "measured", "verdict"], [
        [f"aligned {size}³: dvidshards ≤ 1.0 × precomputed", f"{aligned_ratio:.3f} × wall, {head['cpu']:.3f} × "
         f"CPU (trivial-fill floor {floor_ratio:.3f} ×); into a preallocated array "
         f"{C.med(tp['dvidshards']) / pm2:.3f} ×", C.verdict(aligned_ratio <= 1.0)],
        ["random 64³ chunk, cold shard index ≤ 20 ms", f"{cold_p50 * 1e3:.2f} ms (p50)", C.verdict(cold_p50 <= 0.020)],
        ["random 64³ chunk, warm ≤ 1 ms (p50)", f"{warm_p50 * 1e3:.3f} ms", C.verdict(warm_p50 <= 0.001)],
        [f"label-list check on the aligned {size}³ read ≤ 2 % (CPU time)",
         ", ".join(f"{k} {v:.3f} ×" for k, v in check_ratio.items()),
         C.verdict(max(check_ratio.values()) <= 1.02)],
    ], title="Targets")
    print(f"load average at end: {C.load_text()}")


if __name__ == "__main__":
    main()
