"""Block records from shard files, a Parquet table and an Arrow Flight server (issue 13).

Measures, on one scale of DVID-like records (the real mCNS blocks reused over a full
32³-chunk shard, 32,768 records, ~140 MB):

1. **Random 64³ chunk, p50**: fetch one chunk's record and decode it (agglomerated labels),
   from the shard files (``Dataset.read`` with the shard loaded), from a Parquet table
   (``TableSource.read_records``: file name + row-group ``morton`` statistics, one row group
   read) for several row-group sizes, and from a Flight server (one DoGet whose ticket is the
   chunk's box).  Floor: decoding a record already in memory.
2. **Bulk scan of the scale**, records/s and MB/s (bytes = payload + label lists): the Flight
   stream with 1-row and 256-row batches (raw stream, and into RecordTables as
   ``FlightSource.load_shard`` does), the Parquet table read into RecordTables, and the shard
   files loaded by the eager loader.
3. **Ingest** (Flight server → 2 workers → Parquet) against its floor: the same record
   batches written from memory into Parquet by the same writer, 2 threads.

The Flight server runs in its own process (``dvidshards serve-flight``), the client here.
Targets (issue 13): Flight bulk scan >= 1 GB/s on loopback; Parquet random chunk <= 2 ms p50.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time

import numpy as np
from common import (
    big_shard_export,
    header,
    mcns_spec,
    med,
    ms,
    parser,
    pct,
    require_real_data,
    table,
    verdict,
)


def _record_bytes(t) -> int:
    from dvidshards.formats import arrowipc as ipc

    r = t.rec
    return int(r[:, ipc.R_PAYLEN].sum() + 8 * (r[:, ipc.R_NLAB].sum() + r[:, ipc.R_NSV].sum()))


def start_server(export, spec_path) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, "-m", "dvidshards.cli", "serve-flight", str(export), "--spec",
                          str(spec_path), "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = p.stdout.readline().strip()
    if not line.startswith("grpc://"):
        p.kill()
        sys.exit(f"serve-flight did not start: {line!r}")
    return p, line


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--chunks", type=int, default=200, help="random chunks per source (default 200)")
    p.add_argument("--row-groups", type=int, nargs="+", default=[64, 256, 1024, 4096],
                   help="Parquet row-group sizes to compare (default 64 256 1024 4096)")
    args = p.parse_args()
    data = require_real_data(args.data)
    n_chunks = 40 if args.quick else args.chunks
    row_groups = [256] if args.quick else args.row_groups
    header("bench_sources: shard files vs Parquet table vs Arrow Flight")

    from dvidshards.dataset import Dataset
    from dvidshards.flight import FlightSource
    from dvidshards.formats.labels import as_labels
    from dvidshards.tables import TableSource, _ShardFileWriter, ingest, record_batches

    export = big_shard_export(args.workdir, data)
    spec = mcns_spec(data)
    spec_path = args.workdir / "mcns-spec.json"
    spec_path.write_text(__import__("json").dumps(spec))
    ds = Dataset(export, spec=spec)
    s = ds.scale(1)
    origins = ds.shards(1)
    tables = {o: ds.shard(1, o).table() for o in origins}
    n_rec = sum(len(t) for t in tables.values())
    n_bytes = sum(_record_bytes(t) for t in tables.values())
    print(f"scale 1 of {export}: {len(origins)} shard(s), {n_rec} records, {n_bytes / 1e6:.1f} MB "
          f"(payloads + label lists)\n")
    coords = np.concatenate([ds.shard(1, o).coords for o in origins])
    rng = np.random.default_rng(7)
    pick = coords[rng.choice(len(coords), n_chunks, replace=False)]
    agg = as_labels("agglomerated")
    out = np.empty((64, 64, 64), np.uint64)

    # --- tables, one per row-group size, written from the files (no Flight) ------------------
    tabs = {}
    for rg in row_groups:
        to = args.workdir / f"table-rg{rg}"
        if not (to / "info").exists() or "complete" not in (to / "info").read_text():
            shutil.rmtree(to, ignore_errors=True)
            ingest(ds, to, workers=2, scales=[1], row_group_size=rg)
        tabs[rg] = TableSource(to, partial=True)

    proc, uri = start_server(export, spec_path)
    try:
        fsrc = FlightSource(uri)
        # ---------------------------------------------------------------- random chunks
        rows = []

        def timed(fn):
            fn(pick[0])  # warm: numba, footers, connections
            t = []
            for c in pick:
                t0 = time.perf_counter()
                fn(c)
                t.append(time.perf_counter() - t0)
            return t

        for o in origins:
            ds.reader(1).cache.get_sync(o)  # files: shard index loaded, as in a long-running reader

        def files(c):
            ds.read([list(c * 64), list(c * 64 + 64)], scale=1)

        def floor(c):
            sh = ds.reader(1).cache.get_sync(s.shard_origin(*c))
            sh.table().decode_into(sh.find(*c), out, agg)

        def parquet(rg):
            def f(c):
                rt = tabs[rg].read_records(s, [c])
                rt.decode_into(0, out, agg)
            return f

        def flight(c):
            rt = fsrc.read_records(s, box=[list(c * 64), list(c * 64 + 64)])
            rt.decode_into(0, out, agg)

        res = {"decode only (record in memory)": timed(floor), "shard files (Dataset.read)": timed(files)}
        for rg in row_groups:
            res[f"Parquet, row groups of {rg}"] = timed(parquet(rg))
        res["Flight, one DoGet per chunk box"] = timed(flight)
        base = med(res["shard files (Dataset.read)"])
        for name, t in res.items():
            rows.append([name, ms(med(t), 2), ms(pct(t, 90), 2), f"{med(t) / base:.2f}"])
        table(["random 64³ chunk, fetch + decode", "p50 ms", "p90 ms", "p50 / files"], rows,
              f"Random chunks ({n_chunks}, agglomerated labels)")
        best_pq = min(med(res[f"Parquet, row groups of {rg}"]) for rg in row_groups)

        # ---------------------------------------------------------------- bulk scans
        def scan_raw(batch_rows):
            return sum(b.num_rows for b, _ in fsrc.scan(1, batch_rows=batch_rows))

        def scan_flight_tables():
            return sum(len(fsrc._sync(fsrc.load_shard(s, o)).table()) for o in origins)

        def scan_parquet(rg):
            return sum(len(tabs[rg].load_shard_sync(s, o).table()) for o in origins)

        def scan_files():
            from dvidshards.shard import load_shard_sync

            return sum(len(load_shard_sync(ds.store, s, o, policy="eager").table()) for o in origins)

        scans = {"Flight stream, 1-row batches": lambda: scan_raw(1),
                 "Flight stream, 256-row batches": lambda: scan_raw(256),
                 "Flight, 256-row batches into RecordTables": scan_flight_tables,
                 **{f"Parquet (row groups of {rg}) into RecordTables": (lambda rg=rg: scan_parquet(rg))
                    for rg in row_groups},
                 "shard files, eager loader": scan_files}
        rows = []
        flight_rate = 0.0
        rounds = 1 if args.quick else 3
        for name, fn in scans.items():
            got = fn()  # warm
            assert got == n_rec, (name, got, n_rec)
            t = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                fn()
                t.append(time.perf_counter() - t0)
            sec = med(t)
            rate = n_bytes / sec
            if name.startswith("Flight stream, 256"):
                flight_rate = rate
            rows.append([name, f"{sec * 1e3:.0f}", f"{n_rec / sec:,.0f}", f"{rate / 1e6:,.0f}"])
        table(["bulk scan of the scale", "ms", "records/s", "MB/s"], rows,
              f"Bulk scans ({n_rec} records, {n_bytes / 1e6:.0f} MB; median of {rounds})")

        # ---------------------------------------------------------------- ingest vs floor
        to = args.workdir / "table-ingest"
        shutil.rmtree(to, ignore_errors=True)
        t0 = time.perf_counter()
        rep = ingest(FlightSource(uri), to, workers=2, scales=[1])
        t_ingest = time.perf_counter() - t0
        assert rep.ok and rep.records == n_rec, rep.summary()
        batches = {}
        for o, t in tables.items():
            for b, meta in record_batches(t, s, o, batch_rows=256, check=False):
                batches.setdefault(int(b.column("shard_id")[0].as_py()) if b.num_rows else meta["shard_id"],
                                   (o, []))[1].append(b)
        floor_dir = args.workdir / "table-floor"
        shutil.rmtree(floor_dir, ignore_errors=True)
        (floor_dir / "s1").mkdir(parents=True)

        def write_part(i):
            for sid, (o, bs) in batches.items():
                if sid % 2 == i:
                    w = _ShardFileWriter(str(floor_dir / "s1"), sid, o, s, 256, 126 * 1024)
                    for b in bs:
                        w.add(b)
                    w.close()

        t0 = time.perf_counter()
        th = [threading.Thread(target=write_part, args=(i,)) for i in range(2)]
        for x in th:
            x.start()
        for x in th:
            x.join()
        t_floor = time.perf_counter() - t0
        t0 = time.perf_counter()
        shutil.rmtree(args.workdir / "table-local", ignore_errors=True)
        ingest(ds, args.workdir / "table-local", workers=2, scales=[1])
        t_local = time.perf_counter() - t0
        rows = [["floor: same batches from memory -> Parquet (2 threads)", f"{t_floor:.2f}",
                 f"{n_bytes / t_floor / 1e6:,.0f}", "1.00"],
                ["ingest from the shard files (no Flight), 2 workers", f"{t_local:.2f}",
                 f"{n_bytes / t_local / 1e6:,.0f}", f"{t_local / t_floor:.2f}"],
                ["ingest from the Flight server, 2 workers", f"{t_ingest:.2f}", f"{n_bytes / t_ingest / 1e6:,.0f}",
                 f"{t_ingest / t_floor:.2f}"]]
        table(["ingest", "s", "MB/s", "time / floor"], rows, "Ingest into Parquet")
        sizes = {rg: sum(f.stat().st_size for f in (args.workdir / f"table-rg{rg}" / "s1").glob("*.parquet"))
                 for rg in row_groups}
        table(["row group rows", "table MB", "random chunk p50 ms", "scan ms"],
              [[rg, f"{sizes[rg] / 1e6:.1f}", ms(med(res[f'Parquet, row groups of {rg}']), 2), "see above"]
               for rg in row_groups], "Parquet row-group size")
        table(["target", "measured", "verdict"],
              [["Flight bulk scan >= 1 GB/s (256-row batches, loopback)", f"{flight_rate / 1e9:.2f} GB/s",
                verdict(flight_rate >= 1e9)],
               ["Parquet random chunk <= 2 ms p50 (best row-group size)", f"{best_pq * 1e3:.2f} ms",
                verdict(best_pq <= 2e-3)]], "Targets")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
