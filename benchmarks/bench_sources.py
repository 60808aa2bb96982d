"""Block records from shard files, a Parquet table and an Arrow Flight server (issue 13).

Measures, on one scale of DVID-like records (the real mCNS blocks reused over a full
32³-chunk shard, 32,768 records, ~124 MB of payloads + label lists):

1. **Random 64³ chunk, p50**: fetch one chunk's record and decode it (agglomerated labels),
   from the shard files (``Dataset.read`` with the shard loaded), from a Parquet table
   (``TableSource.read_records``: file name + row-group ``morton`` statistics, one row group
   read) for several row-group sizes, and from a Flight server (one DoGet whose ticket is the
   chunk's box).  Floors, timed in the same loop: decoding a record already in memory, and a
   bare ``ParquetFile.read_row_group`` of the chunk's row group (file open, footer parsed)
   plus that decode.  The sources are interleaved chunk by chunk, in rotating order.
2. **Bulk scan of the scale**, records/s and MB/s (bytes = payload + label lists): the Flight
   stream with 1-row and 256-row batches (``FlightSource.scan``, and into RecordTables as
   ``FlightSource.load_shard`` does), the Parquet tables into RecordTables, the shard files by
   the eager loader.  Floors: ``memcpy`` of the same number of bytes, and a raw DoGet of the
   same 256-row batches pre-built in the memory of another server process (C++
   ``RecordBatchStream``, read with a bare ``read_chunk`` loop).  The Flight rows run twice:
   with glibc's default malloc in this (client) process, then after
   ``dvidshards.sources.flight.tune_malloc()``.  Both servers call it (``serve-flight`` does).
3. **Ingest** (Flight server → 2 workers → Parquet) against its floor: the same record
   batches written from memory into Parquet by the same writer, 2 threads.

The Flight servers run in their own processes, the client here.
Targets (issue 13): Flight bulk scan >= 1 GB/s on loopback; Parquet random chunk <= 2 ms p50.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
from common import (
    alternate,
    big_shard_export,
    header,
    load_text,
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


def start_server(cmd: list[str], **kw) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, **kw)
    line = p.stdout.readline().strip()
    if not line.startswith("grpc://"):
        p.kill()
        sys.exit(f"server did not start: {line!r}")
    return p, line


def floor_server(export: str, spec_path: str) -> None:
    """``--floor-server``: serve the scale's 256-row batches, built once, from memory (C++ stream)."""
    import pyarrow as pa
    import pyarrow.flight as fl

    from dvidshards.dataset import Dataset
    from dvidshards.sources.flight import tune_malloc
    from dvidshards.sources.tables import record_batches

    tune_malloc()  # as serve-flight does
    ds = Dataset(export, spec=json.loads(open(spec_path).read()))
    s = ds.scale(1)
    batches = [b for o in ds.shards(1) for b, _ in record_batches(ds.shard(1, o).table(), s, o, check=False)]
    whole = pa.Table.from_batches(batches)

    class Floor(fl.FlightServerBase):
        def do_get(self, context, ticket):
            return fl.RecordBatchStream(whole)

    srv = Floor("grpc+tcp://127.0.0.1:0")
    print(f"grpc://127.0.0.1:{srv.port}", flush=True)
    srv.serve()


def open_rss(path) -> int:
    """Resident memory an open ParquetFile holds (its parsed footer), measured in a fresh process."""
    code = ("import gc, sys, pyarrow.parquet as pq\n"
            "rss = lambda: int(open('/proc/self/statm').read().split()[1]) * 4096\n"
            "pq.ParquetFile(sys.argv[1]).metadata; gc.collect(); r0 = rss()\n"
            "held = [pq.ParquetFile(sys.argv[1]) for _ in range(20)]\n"
            "print((rss() - r0) // 20)")
    return int(subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                              check=True).stdout)


def export_rev(rev: str, workdir) -> Path:
    """The source tree of a git revision of this repository, exported once into the work directory."""
    root = Path(__file__).resolve().parents[1]
    sha = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", rev], capture_output=True, text=True,
                         check=True).stdout.strip()
    out = Path(workdir) / f"src-{sha}"
    if not (out / "dvidshards").is_dir():
        out.mkdir(parents=True, exist_ok=True)
        tar = subprocess.run(["git", "-C", str(root), "archive", sha, "dvidshards"], capture_output=True,
                             check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(out)], input=tar, check=True)
    return out


def rev_module(rev_root: Path, name: str):
    """dvidshards/<name>.py of another revision, imported beside today's package (its relative
    imports resolve to today's modules: only that file's own code is the old one)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"dvidshards._rev_{name}", rev_root / "dvidshards" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def proc_cpu(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc; clock ticks of 10 ms)."""
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def self_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def raw_doget(uri: str, ticket: bytes) -> int:
    """Records of one DoGet read with a bare read_chunk loop (no Python per record, no checks)."""
    import pyarrow.flight as fl

    c = fl.FlightClient(uri.replace("grpc://", "grpc+tcp://"))
    r = c.do_get(fl.Ticket(ticket))
    n = 0
    while True:
        try:
            n += r.read_chunk().data.num_rows
        except StopIteration:
            break
    c.close()
    return n


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--floor-server":
        floor_server(sys.argv[2], sys.argv[3])
        return
    p = parser(__doc__)
    p.add_argument("--chunks", type=int, default=200, help="random chunks per source (default 200)")
    p.add_argument("--row-groups", type=int, nargs="+", default=[16, 64, 128, 256, 1024],
                   help="Parquet row-group sizes to compare (default 16 64 128 256 1024)")
    p.add_argument("--rounds", type=int, default=5, help="rounds of each bulk scan (default 5)")
    p.add_argument("--compare-rev", metavar="REV",
                   help="also time the Flight server and TableSource.read_records of git revision REV "
                        "(its tree is exported into the work directory), interleaved with today's")
    args = p.parse_args()
    data = require_real_data(args.data)
    n_chunks = 40 if args.quick else args.chunks
    row_groups = [64, 256] if args.quick else args.row_groups
    rounds = 1 if args.quick else args.rounds
    header("bench_sources: shard files vs Parquet table vs Arrow Flight")

    import pyarrow.parquet as pq

    from dvidshards.dataset import Dataset
    from dvidshards.formats.labels import as_labels
    from dvidshards.jobs.ingest import ingest
    from dvidshards.sources.flight import FlightSource, tune_malloc
    from dvidshards.sources.tables import ROW_GROUP, TableFileWriter, record_batches, record_keys
    from dvidshards.sources.tablesource import TableSource

    export = big_shard_export(args.workdir, data)
    spec = mcns_spec(data)
    spec_path = args.workdir / "mcns-spec.json"
    spec_path.write_text(json.dumps(spec))
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
    loads = [load_text()]

    # --- tables, one per row-group size, written from the files (no Flight) ------------------
    tabs, t_write = {}, {}
    for rg in row_groups:
        to = args.workdir / f"table-rg{rg}"
        if not (to / "info").exists() or "complete" not in (to / "info").read_text():
            shutil.rmtree(to, ignore_errors=True)
            t0 = time.perf_counter()
            ingest(ds, to, workers=2, scales=[1], row_group_size=rg)
            t_write[rg] = time.perf_counter() - t0
        tabs[rg] = TableSource(to, partial=True)

    serve_cmd = [sys.executable, "-m", "dvidshards.cli", "serve-flight", str(export), "--spec", str(spec_path),
                 "--port", "0"]
    proc, uri = start_server(serve_cmd)
    fproc, furi = start_server([sys.executable, __file__, "--floor-server", str(export), str(spec_path)])
    rev_proc = rev_tables = None
    rg_rev = ROW_GROUP if ROW_GROUP in tabs else row_groups[0]
    if args.compare_rev:
        rev_root = export_rev(args.compare_rev, args.workdir)
        rev_proc, rev_uri = start_server(serve_cmd, cwd=rev_root, env={**os.environ, "PYTHONPATH": str(rev_root)})
        rev_tables = rev_module(rev_root, "tables").TableSource(args.workdir / f"table-rg{rg_rev}", partial=True)
    try:
        fsrc = FlightSource(uri)
        # ---------------------------------------------------------------- random chunks
        for o in origins:
            ds.reader(1).cache.get_sync(o)  # files: shard index loaded, as in a long-running reader
        _, mor = record_keys(s, pick)
        bare = {}
        for rg in row_groups:  # the floor: the row group read straight from a ParquetFile kept open
            pf = pq.ParquetFile(next(iter(tabs[rg]._layout_files(1).values()))[1])
            md = pf.metadata
            im = pf.schema_arrow.names.index("morton")
            hi = np.array([md.row_group(g).column(im).statistics.max for g in range(md.num_row_groups)])
            bare[rg] = (pf, hi)

        def files(i, c):
            ds.read([list(c * 64), list(c * 64 + 64)], scale=1)

        def floor(i, c):
            sh = ds.reader(1).cache.get_sync(s.shard_origin(*c))
            sh.table().decode_into(sh.find(*c), out, agg)

        def bare_pq(rg):
            pf, hi = bare[rg]

            def f(i, c):
                pf.read_row_group(int(np.searchsorted(hi, mor[i])), use_threads=False)
                sh = ds.reader(1).cache.get_sync(s.shard_origin(*c))
                sh.table().decode_into(sh.find(*c), out, agg)
            return f

        def parquet(rg):
            def f(i, c):
                rt = tabs[rg].read_records(s, [c])
                rt.decode_into(0, out, agg)
            return f

        def flight(i, c):
            rt = fsrc.read_records(s, box=[list(c * 64), list(c * 64 + 64)])
            rt.decode_into(0, out, agg)

        fns = {"decode only (record in memory)": floor, "shard files (Dataset.read)": files}
        for rg in row_groups:
            fns[f"floor: bare read_row_group + decode, rg {rg}"] = bare_pq(rg)
            fns[f"Parquet read_records + decode, rg {rg}"] = parquet(rg)
        fns["Flight, one DoGet per chunk box"] = flight
        if rev_tables is not None:
            def parquet_rev(i, c):
                rev_tables.read_records(s, [c]).decode_into(0, out, agg)
            fns[f"Parquet read_records + decode, rg {rg_rev}, tables.py at {args.compare_rev}"] = parquet_rev
        res: dict[str, list[float]] = {k: [] for k in fns}
        names = list(fns)
        for f in fns.values():
            f(0, pick[0])  # warm: numba, footers, connections
        for i, c in enumerate(pick):  # interleaved, rotating start: load swings hit every source alike
            k = i % len(names)
            for name in names[k:] + names[:k]:
                t0 = time.perf_counter()
                fns[name](i, c)
                res[name].append(time.perf_counter() - t0)
        base = med(res["shard files (Dataset.read)"])
        rows = []
        for name, t in res.items():
            fl_ = res.get(name.replace("Parquet read_records + decode", "floor: bare read_row_group + decode")
                          .split(", tables.py at")[0])
            rows.append([name, ms(med(t), 2), ms(pct(t, 90), 2), f"{med(t) / base:.2f}",
                         f"{med(t) / med(fl_):.2f}" if name.startswith("Parquet") else ""])
        table(["random 64³ chunk, fetch + decode", "p50 ms", "p90 ms", "p50 / files", "p50 / its floor"], rows,
              f"Random chunks ({n_chunks}, agglomerated labels; sources interleaved per chunk)")
        pq_p50 = {rg: med(res[f"Parquet read_records + decode, rg {rg}"]) for rg in row_groups}
        loads.append(load_text())

        # ---------------------------------------------------------------- bulk scans
        def scan(batch_rows):
            return sum(b.num_rows for b, _ in fsrc.scan(1, batch_rows=batch_rows))

        def scan_flight_tables():
            return sum(len(fsrc._sync(fsrc.load_shard(s, o)).table()) for o in origins)

        def scan_parquet(rg):
            return sum(len(tabs[rg].load_shard_sync(s, o).table()) for o in origins)

        def scan_files():
            from dvidshards.shard import load_shard_sync

            return sum(len(load_shard_sync(ds.store, s, o, policy="eager").table()) for o in origins)

        src = np.ones(n_bytes, np.uint8)
        dst = np.zeros(n_bytes, np.uint8)

        def memcpy():
            np.copyto(dst, src)
            return n_rec

        ticket = json.dumps({"v": 1, "scale": 1, "batch_rows": 256}).encode()
        cpu: dict[str, list] = {}  # name: [(server CPU s, client CPU s) per call]

        def with_cpu(name, fn, pid):
            def f():
                s0, c0 = proc_cpu(pid), self_cpu()
                n = fn()
                s1, c1 = proc_cpu(pid), self_cpu()
                cpu.setdefault(name, []).append((s1 - s0, c1 - c0))
                return n
            return f

        def flight_fns(suffix=""):
            fns_ = {"floor: raw DoGet of pre-built 256-row batches (C++ stream)": (lambda: raw_doget(furi, b"x"),
                                                                                   fproc.pid),
                    "Flight stream, 256-row batches, raw read_chunk loop": (lambda: raw_doget(uri, ticket), proc.pid),
                    "Flight stream, 256-row batches (FlightSource.scan)": (lambda: scan(256), proc.pid),
                    "Flight, 256-row batches into RecordTables (load_shard)": (scan_flight_tables, proc.pid)}
            if rev_proc is not None:
                rev_src = FlightSource(rev_uri)
                fns_[f"Flight stream, 256-row batches (FlightSource.scan), server at {args.compare_rev}"] = (
                    lambda: sum(b.num_rows for b, _ in rev_src.scan(1, batch_rows=256)), rev_proc.pid)
            return {k + suffix: with_cpu(k + suffix, f, pid) for k, (f, pid) in fns_.items()}

        flight_scans = flight_fns()
        other = {"floor: memcpy of the same bytes": memcpy,
                 **{f"Parquet (row groups of {rg}) into RecordTables": (lambda rg=rg: scan_parquet(rg))
                    for rg in row_groups},
                 "shard files, eager loader": scan_files}
        for name, fn in {**flight_scans, **other}.items():
            got = fn()
            assert got == n_rec, (name, got, n_rec)
        timing = {}
        for name, t in alternate({**flight_scans, **other}, rounds).items():
            timing[name] = t
        t1 = time.perf_counter()
        scan(1)
        timing["Flight stream, 1-row batches (FlightSource.scan)"] = [time.perf_counter() - t1]
        tuned = tune_malloc()
        for name, t in alternate(flight_fns(", tune_malloc"), rounds).items():
            timing[name] = t
        t1 = time.perf_counter()
        scan(1)
        timing["Flight stream, 1-row batches (FlightSource.scan), tune_malloc"] = [time.perf_counter() - t1]
        loads.append(load_text())
        fl_floor = {"": med(timing["floor: raw DoGet of pre-built 256-row batches (C++ stream)"]),
                    ", tune_malloc": med(timing["floor: raw DoGet of pre-built 256-row batches (C++ stream), "
                                                "tune_malloc"])}
        rows = []
        for name, t in timing.items():
            sec = med(t)
            ref = fl_floor[", tune_malloc" if name.endswith("tune_malloc") else ""] if "Flight" in name or \
                "DoGet" in name else None
            c = cpu.get(name)  # the timed rounds are the last calls (warm-ups come first)
            sc, cc = (float(np.mean([v[0] for v in c[-rounds:]])), float(np.mean([v[1] for v in c[-rounds:]]))) \
                if c else (0.0, 0.0)
            rows.append([name, f"{sec * 1e3:.0f}", f"{n_rec / sec:,.0f}", f"{n_bytes / sec / 1e6:,.0f}",
                         f"{sec / ref:.2f}" if ref else "", f"{sc * 1e3:.0f}" if c else "",
                         f"{cc * 1e3:.0f}" if c else "", f"{n_bytes / max(sc, cc) / 1e6:,.0f}" if c else ""])
        table(["bulk scan of the scale", "ms", "records/s", "MB/s", "time / raw DoGet floor", "server CPU ms",
               "client CPU ms", "MB/s at max(CPU)"], rows,
              f"Bulk scans ({n_rec} records, {n_bytes / 1e6:.0f} MB; median of {rounds}, interleaved; "
              f"1-row: one pass; tune_malloc applied: {tuned}; CPU: user+sys per scan, mean; "
              f"'at max(CPU)': the rate if server and client each had a core of their own)")
        rate_default = n_bytes / med(timing["Flight stream, 256-row batches (FlightSource.scan)"])
        rate_tuned = n_bytes / med(timing["Flight stream, 256-row batches (FlightSource.scan), tune_malloc"])
        scan_mb = {rg: n_bytes / med(timing[f"Parquet (row groups of {rg}) into RecordTables"]) / 1e6
                   for rg in row_groups}

        # ---------------------------------------------------------------- ingest vs floor
        to = args.workdir / "table-ingest"
        shutil.rmtree(to, ignore_errors=True)
        t0 = time.perf_counter()
        rep = ingest(FlightSource(uri), to, workers=2, scales=[1])
        t_ingest = time.perf_counter() - t0
        assert rep.ok and rep.records == n_rec, rep.summary()
        batches: dict = {}
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
                    w = TableFileWriter(str(floor_dir / "s1"), sid, o, s, ROW_GROUP, 126 * 1024)
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
        table(["ingest", "s", "MB/s", "time / floor"], rows, f"Ingest into Parquet (row groups of {ROW_GROUP})")

        rows = []
        for rg in row_groups:
            fs_ = sorted((args.workdir / f"table-rg{rg}" / "s1").glob("*.parquet"))
            size = sum(f.stat().st_size for f in fs_)
            footer = sum(pq.ParquetFile(f).metadata.serialized_size for f in fs_)
            first = []
            for _ in range(5):  # the first look-up in a file: open it, parse the footer, read the statistics
                tabs[rg]._meta.clear()
                t0 = time.perf_counter()
                tabs[rg]._file_meta(str(fs_[0]))
                first.append(time.perf_counter() - t0)
            rows.append([rg, f"{size / 1e6:.1f}", f"{footer / 1e3:,.0f}", f"{open_rss(fs_[0]) / 1e6:.1f}",
                         ms(min(first), 1), ms(pq_p50[rg], 2),
                         ms(med(res[f"floor: bare read_row_group + decode, rg {rg}"]), 2), f"{scan_mb[rg]:,.0f}"])
        table(["row group rows", "table MB", "footer KB", "RSS per open file MB", "file open + stats ms",
               "random chunk p50 ms", "its floor p50 ms", "scan into RecordTables MB/s"], rows,
              "Parquet row-group size (one file of 32,768 records; TableSource keeps up to 64 files open)")
        best = min(pq_p50, key=lambda rg: pq_p50[rg])
        table(["target", "measured", "verdict"],
              [["Flight bulk scan >= 1 GB/s (256-row batches, loopback), library default malloc",
                f"{rate_default / 1e9:.2f} GB/s", verdict(rate_default >= 1e9)],
               ["Flight bulk scan >= 1 GB/s (256-row batches, loopback), after tune_malloc()",
                f"{rate_tuned / 1e9:.2f} GB/s", verdict(rate_tuned >= 1e9)],
               [f"Parquet random chunk <= 2 ms p50, default row groups ({ROW_GROUP})",
                f"{pq_p50[ROW_GROUP] * 1e3:.2f} ms" if ROW_GROUP in pq_p50 else "not run",
                verdict(pq_p50.get(ROW_GROUP, 1.0) <= 2e-3)],
               [f"Parquet random chunk <= 2 ms p50, best row groups ({best})", f"{pq_p50[best] * 1e3:.2f} ms",
                verdict(pq_p50[best] <= 2e-3)]], "Targets")
        loads.append(load_text())
        print(f"load average (1, 5, 15 min) at start / after random chunks / after scans / end: "
              f"{' | '.join(loads)}")
    finally:
        for p_ in (proc, fproc, rev_proc):
            if p_ is None:
                continue
            p_.terminate()
            p_.wait(timeout=30)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
