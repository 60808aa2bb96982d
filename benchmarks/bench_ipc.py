"""The hand-written Arrow IPC reader against pyarrow: shard load time and per-chunk cost after load.

Run from the project root::

    python benchmarks/bench_ipc.py [--quick] [--rounds N] [--chunks N] [--workdir DIR]

Data: one shard holding all 32³ = 32,768 chunks of its box, one record per record batch (as DVID
writes), written by ``dvidshards.writer.write_shard`` from a synthetic pool of 64 records (a
256³ ``neuron_volume`` export) cycled; index variant A (CSV with byte offsets). Generated once
into ``--workdir``; page cache warm.

Shard load (fresh memory map each time, interleaved rounds, medians):

* ``load_shard`` eager: the library's loader as ``Dataset.shard`` runs it (CSV index, schema,
  every record resolved and checked against its index row and the shard's box);
* dvidshards IPC only: schema + ``scan_stream`` (find every batch) + ``resolve_rows`` (every
  record's payload, label lists and coordinates), no CSV: the work pyarrow would replace;
* pyarrow ``pa.ipc.open_stream(mmap).read_all()`` alone;
* pyarrow ``read_all`` + the same per-record locations built zero-copy from each batch's buffers
  (one Python step per batch: the (n, 11) location array ``resolve_rows`` returns);
* pyarrow ``read_all`` + ``RecordTable.from_batch`` (the library's own pyarrow path, used for
  Flight and Parquet: ``combine_chunks`` copies the payloads into one buffer).

Per chunk after load (random chunks, medians): decode through the dvidshards ``Shard``; through
a ``RecordTable`` over the pyarrow-built locations; and through pyarrow objects directly
(``ChunkedArray[i]`` scalars for payload and labels, then the same zstd + decode kernel).
"""

from __future__ import annotations

import time

import common as C
import numpy as np
import pyarrow as pa
import zstandard

from dvidshards.formats import arrowipc as ipc
from dvidshards.formats.codec import decode_into
from dvidshards.formats.labels import Agglomerated
from dvidshards.formats.multiscale import Scale
from dvidshards.formats.records import RecordTable
from dvidshards.shard import load_shard_sync
from dvidshards.stores import LocalStore

N = 32
ORIGIN = (0, 0, 0)
STEM = "s0/0_0_0"


def build(workdir, log=print):
    """The 32,768-record shard (once)."""
    from dvidshards.writer import write_shard

    pool = C.synthetic_records(workdir, log=log)
    params = {"kind": "ipc-32768", "pool": len(pool), "version": 1}
    folder = workdir / "ipc-32768"
    if not C._fresh(folder, params):
        C._reset(folder)
        (folder / "s0").mkdir()
        t0 = time.perf_counter()
        log(f"writing {folder}/{STEM} (32,768 records) ...")
        write_shard(folder / STEM, C.full_shard_records(pool, (0, 0, 0), N), batch_size=1, index="A")
        C._done(folder, params)
        log(f"built in {time.perf_counter() - t0:.0f} s")
    return folder


def arrow_locations(table: pa.Table, base: int) -> np.ndarray:
    """The (n, REC_FIELDS) location array from pyarrow batches, zero-copy (absolute file offsets)."""
    n = table.num_rows
    rec = np.empty((n, ipc.REC_FIELDS), np.int64)
    names = table.schema.names
    ix = {k: names.index(k) for k in ("chunk_x", "chunk_y", "chunk_z", "labels", "supervoxels",
                                      "dvid_compressed_block", "uncompressed_size")}
    pos = 0
    for b in table.to_batches():
        m = b.num_rows
        if not m:
            continue
        r = rec[pos:pos + m]
        r[:, ipc.R_ROWS] = m
        for a, k in enumerate(("chunk_x", "chunk_y", "chunk_z")):
            r[:, ipc.R_CX + a] = b.column(ix[k]).to_numpy()
        pay = b.column(ix["dvid_compressed_block"])
        _, poffb, pdata = pay.buffers()
        po = np.frombuffer(poffb, np.int32, m + 1, pay.offset * 4)
        r[:, ipc.R_PAY] = pdata.address - base + po[:-1]
        r[:, ipc.R_PAYLEN] = np.diff(po)
        for k, fo, fn in (("labels", ipc.R_LAB, ipc.R_NLAB), ("supervoxels", ipc.R_SV, ipc.R_NSV)):
            col = b.column(ix[k])
            bufs = col.buffers()
            lo = np.frombuffer(bufs[1], np.int32, m + 1, col.offset * 4)
            r[:, fo] = bufs[3].address - base + 8 * lo[:-1]
            r[:, fn] = np.diff(lo)
        r[:, ipc.R_USIZE] = b.column(ix["uncompressed_size"]).to_numpy()
        pos += m
    return rec


def main(argv=None):
    ap = C.parser(__doc__)
    ap.add_argument("--rounds", type=int, default=None, help="timed load rounds (default 9; --quick 3)")
    ap.add_argument("--chunks", type=int, default=None, help="random chunks per-chunk table (default 2000; --quick 200)")
    args = ap.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 9)
    nchunks = args.chunks or (200 if args.quick else 2000)
    root = build(args.workdir)
    store = LocalStore(root)
    scale = Scale(0, (64 * N,) * 3, None, 64 * N)
    path = str(root / (STEM + ".arrow"))
    size = (root / (STEM + ".arrow")).stat().st_size
    C.header("bench_ipc: hand-written Arrow IPC reader vs pyarrow, 32,768-record shard")

    shard = load_shard_sync(store, scale, ORIGIN, policy="eager")
    n = len(shard)

    def ours_ipc():
        data = store.map(STEM + ".arrow")
        schema, slen = ipc.schema_from_message(data, 0, path)
        lay = ipc.SchemaLayout(schema, path)
        offs, lens, rows = ipc.scan_stream(data, slen, data.shape[0], path)
        b = np.repeat(np.arange(len(offs)), rows)
        r = np.arange(int(rows.sum())) - np.concatenate([[0], np.cumsum(rows)])[b]
        return ipc.resolve_rows(data, 0, offs[b], lens[b], r, lay, path)

    def pa_read_all():
        with pa.memory_map(path) as f:
            return pa.ipc.open_stream(f).read_all()

    def pa_locations():
        with pa.memory_map(path) as f:
            whole = f.read_buffer()  # zero-copy view of the map: batch buffers lie inside it
            return arrow_locations(pa.ipc.open_stream(whole).read_all(), whole.address)

    def pa_from_batch():
        with pa.memory_map(path) as f:
            return RecordTable.from_batch(pa.ipc.open_stream(f).read_all(), path)

    # same answers: coordinates and payload bytes agree record by record
    ref = ours_ipc()
    with pa.memory_map(path) as f:
        whole = f.read_buffer()
        loc = arrow_locations(pa.ipc.open_stream(whole).read_all(), whole.address)
        if not np.array_equal(loc, ref):
            raise SystemExit("pyarrow locations differ from resolve_rows")
        del whole
    from_batch_error = None
    try:
        fb = pa_from_batch()
        if not np.array_equal(fb.coords, ref[:, ipc.R_CX:ipc.R_CX + 3]):
            raise SystemExit("RecordTable.from_batch coordinates differ")
        del fb
    except Exception as e:  # noqa: BLE001 - reported in the table, not hidden
        from_batch_error = f"{type(e).__name__}: {e}"

    fns = {
        "dvidshards load_shard (eager: CSV + IPC + checks)": lambda: load_shard_sync(store, scale, ORIGIN,
                                                                                     policy="eager"),
        "dvidshards IPC only (scan_stream + resolve_rows)": ours_ipc,
        "pyarrow open_stream().read_all()": pa_read_all,
        "pyarrow read_all + per-record locations (zero-copy)": pa_locations,
    }
    if from_batch_error is None:
        fns["pyarrow read_all + RecordTable.from_batch (copy)"] = pa_from_batch
    t = C.alternate(fns, rounds)
    base = C.med(t["dvidshards load_shard (eager: CSV + IPC + checks)"])
    rows = [[k, C.ms(C.med(v)), C.ms(min(v)), C.ms(max(v)), f"{C.med(v) / base:.2f}"] for k, v in t.items()]
    if from_batch_error is not None:
        rows.append(["pyarrow read_all + RecordTable.from_batch (copy)", f"fails: {from_batch_error}", "-", "-",
                     "-"])
    C.table(["load path", "median ms", "min ms", "max ms", "÷ load_shard"], rows,
            title=f"Shard load, {n:,} records in {n:,} record batches, {size / C.MIB:.0f} MiB "
                  f"(fresh memory map, {rounds} interleaved rounds)")

    # per chunk after load
    labels = Agglomerated()
    mm = pa.memory_map(path)
    whole = mm.read_buffer()
    tbl = pa.ipc.open_stream(whole).read_all()
    u8 = np.frombuffer(whole, np.uint8)
    fb = RecordTable(arrow_locations(tbl, whole.address), (u8, u8, u8), path)
    pay_col, lab_col = tbl.column("dvid_compressed_block"), tbl.column("labels")
    usize_col = tbl.column("uncompressed_size")
    dctx = zstandard.ZstdDecompressor()
    out = np.empty((64, 64, 64), np.uint64)
    rng = np.random.default_rng(3)
    picks = rng.integers(0, N, size=(nchunks, 3))

    def via_shard(c):
        shard.read_into(*c, out, labels)

    def via_table(c):
        fb.decode_into(shard.find(*c), out, labels)

    def via_pyarrow(c):
        i = shard.find(*c)
        payload = pay_col[i].as_buffer()
        pal = lab_col[i].values.to_numpy()
        block = dctx.decompress(payload, max_output_size=usize_col[i].as_py())
        decode_into(np.frombuffer(block, np.uint8), pal, out)

    st = shard.table()  # the loaded shard's records (Shard.table() builds an arange per call)

    def loc_shard(c):
        i = shard.find(*c)
        return st.payload(i), st.labels(i)

    def loc_table(c):
        i = shard.find(*c)
        return fb.payload(i), fb.labels(i)

    def loc_pyarrow(c):
        i = shard.find(*c)
        return pay_col[i].as_buffer(), lab_col[i].values.to_numpy()

    cases = {"dvidshards Shard (read_into)": (via_shard, loc_shard),
             "RecordTable over pyarrow-built locations": (via_table, loc_table),
             "pyarrow ChunkedArray[i] scalars": (via_pyarrow, loc_pyarrow)}
    for c in picks[:5]:
        c = tuple(int(v) for v in c)
        via_shard(c)
        a = out.copy()
        via_pyarrow(c)
        if not np.array_equal(a, out):
            raise SystemExit("pyarrow path decodes different voxels")
    lat = {k: ([], []) for k in cases}
    names = list(cases)
    for j, c in enumerate(picks):
        c = tuple(int(v) for v in c)
        k = j % len(names)
        for name in names[k:] + names[:k]:
            full, loc = cases[name]
            t0 = time.perf_counter()
            loc(c)
            t1 = time.perf_counter()
            full(c)
            t2 = time.perf_counter()
            lat[name][0].append(t1 - t0)
            lat[name][1].append(t2 - t1)
    b = C.pct(lat[names[0]][1], 50)
    rows = [[k, f"{C.pct(lo, 50) * 1e6:.1f}", f"{C.pct(fu, 50) * 1e6:.1f}", f"{C.pct(fu, 95) * 1e6:.1f}",
             f"{C.pct(fu, 50) / b:.2f}"] for k, (lo, fu) in lat.items()]
    C.table(["records through", "locate p50 µs (payload + labels)", "read p50 µs (locate + zstd + decode)",
             "read p95 µs", "read ÷ Shard"], rows, title=f"Per chunk after load, {nchunks} random 64³ chunks")
    print(f"load average at end: {C.load_text()}")


if __name__ == "__main__":
    main()
