"""Ingest: block records into a table sorted by (shard, Morton), and DVID /blocks dumps into an export.

* `ingest` - N workers each pull one partition (``shard_id % N``) of a Flight server
  (``dvidshards serve-flight``) or read it from an export, and write one Parquet file per
  shard (``dvidshards.sources.tables`` describes the table), or insert into VastDB.
* `ingest_blocks` - DVID ``GET …/blocks`` responses turned into an export written like DVID's.
"""

from __future__ import annotations

import functools
import json
import os
import re
import time
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from ..dataset import Dataset
from ..errors import ChunkIndexError, SpecError
from ..formats.blocks import read_stream
from ..formats.codec import block_header
from ..formats.mapping import LabelMapping
from ..formats.multiscale import Scale, parse_multiscale
from ..sources.flight import SCHEMES, FlightSource
from ..sources.tables import (
    BATCH_ROWS,
    CELL_LIMIT,
    ROW_GROUP,
    STREAM_SCHEMA,
    PartialStreamError,
    ShardFileWriter,
    origins_by_shard_id,
    partition_plan,
    read_table_info,
    record_batches,
    spec_from,
    table_files,
    write_table_info,
)
from ..sources.vastdb import VastDBSink
from ..writer import default_sharding, write_shard
from .runner import describe_exception, failure_lines, run_tasks

__all__ = ["IngestCommand", "IngestReport", "ingest", "ingest_blocks", "ingest_partition"]

@dataclass
class IngestReport:
    """What `ingest` did: shards and records written, per worker, and failures."""

    shards: int = 0
    records: int = 0
    bytes: int = 0
    seconds: float = 0.0
    skipped: int = 0
    failed: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failed

    def summary(self) -> str:
        """One line: records, shards, bytes and their rate (none when nothing was moved), skips, failures."""
        rate = _rate(self.bytes, self.seconds)
        s = (f"{self.records} records in {self.shards} shards ({_size(self.bytes)} in {self.seconds:.1f} s"
             f"{', ' + rate if rate else ''}), {self.skipped} shards already there")
        if self.failed:
            s = "\n".join([f"{s}; {len(self.failed)} partitions FAILED:", *failure_lines(self.failed)])
        return s


def _size(nbytes: float) -> str:
    """A byte count in the largest unit that keeps it >= 1, three significant digits."""
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= k:
            return f"{nbytes / k:.3g} {unit}"
    return f"{int(nbytes)} B"


def _rate(nbytes: int, seconds: float) -> str | None:
    """``"12.3 MB/s"``, or None when there is no rate to tell (nothing moved, or no time)."""
    if nbytes <= 0 or seconds <= 0:
        return None
    return _size(nbytes / seconds) + "/s"


def _local_scan(ds, scale: Scale, partition: int, of: int, skip=(), batch_rows: int = BATCH_ROWS):
    """(batch, meta) of a partition read straight from a Dataset (what the Flight server streams)."""
    plan = partition_plan(origins_by_shard_id(scale, ds.shards(scale.index)), partition, of, skip)
    shards, records = 0, 0
    cache: dict = {}
    for s, o in plan:
        if o not in cache:
            cache.clear()
            cache[o] = ds.shard(scale.index, o).table()
        for batch, meta in record_batches(cache[o], scale, o, only=[s], batch_rows=batch_rows):
            records += batch.num_rows
            if meta:
                shards += 1
            yield batch, meta
    yield pa.RecordBatch.from_pylist([], schema=STREAM_SCHEMA), {"done": True, "shards": shards,
                                                                  "records": records}


def _is_stream_source(source) -> bool:
    """A record stream (``dvidshards.sources.FlightSource``): ``scan`` by partition, ``scales``, ``spec``."""
    return callable(getattr(source, "scan", None)) and hasattr(source, "scales") and hasattr(source, "spec")


def _no_uri(source) -> None:
    if isinstance(source, str) and source.startswith(("grpc://", "grpc+tcp://", "grpc+tls://")):
        raise SpecError(f"{source}: pass dvidshards.sources.FlightSource({source!r}, token=...) to ingest from a "
                        f"Flight server (or run `dvidshards ingest {source} --to TABLE`)")


def ingest_partition(source, to: str, scale: int, partition: int, of: int, *, cell_limit: int = CELL_LIMIT,
                     row_group_size: int = ROW_GROUP, batch_rows: int = BATCH_ROWS, spec=None) -> dict:
    """One worker: pull partition ``partition`` of ``of`` of a scale and write its shard files.

    Shards already in the table are skipped (and not sent); each shard file appears only
    once complete.  ``source`` is a record stream (``dvidshards.sources.FlightSource``) or an
    export/table/Dataset read directly.  Returns counts.
    """
    _no_uri(source)
    sink = to if isinstance(to, VastDBSink) else None
    done: list[int] = []
    if sink is None:
        folder = os.path.join(to, f"s{scale}")
        os.makedirs(folder, exist_ok=True)
        done = [s for s in table_files(to, scale) if s % of == partition]
        for name in os.listdir(folder):  # leftovers of a worker of this partition that died
            m = re.match(r"^\.([0-9]+)_[0-9]+_[0-9]+_[0-9]+\.parquet\..*\.tmp$", name)
            if m and int(m.group(1)) % of == partition:
                try:
                    os.unlink(os.path.join(folder, name))
                except OSError:
                    pass
    if _is_stream_source(source):
        sc = source.scales[scale]
        stream = source.scan(scale, partition=partition, of=of, skip=done, batch_rows=batch_rows)
    else:
        ds = source if hasattr(source, "shard") else Dataset(source, spec=spec)
        sc = ds.scale(scale)
        stream = _local_scan(ds, sc, partition, of, done, batch_rows)
    shards = records = nbytes = 0
    w = None
    try:
        got = 0
        for batch, meta in stream:
            if meta.get("done"):
                if w is None and meta.get("records") != got:
                    raise PartialStreamError(f"{source}: partition {partition}/{of} sent {got} records, its end "
                                             f"marker says {meta.get('records')}")
                break
            got += batch.num_rows
            if batch.num_rows:
                sid = batch.column("shard_id")
                s0 = sid[0].as_py()
                if w is None:
                    origin = meta.get("origin") or sc.shard_origin(*(int(batch.column(a)[0].as_py())
                                                                     for a in ("chunk_x", "chunk_y", "chunk_z")))
                    w = sink.writer(s0, origin) if sink is not None else \
                        ShardFileWriter(folder, s0, origin, sc, row_group_size, cell_limit)
                elif s0 != w.shard_id:
                    raise PartialStreamError(f"{source}: shard {w.shard_id} ended without its end marker")
                w.add(batch)
            if meta.get("end"):
                if w is None:  # an empty shard: nothing to write
                    continue
                if meta["shard_id"] != w.shard_id or meta["records"] != w.rows:
                    raise PartialStreamError(f"{source}: shard {w.shard_id}: received {w.rows} records, the "
                                             f"stream says {meta.get('records')} for shard {meta.get('shard_id')}")
                w.close()
                shards += 1
                records += w.rows
                nbytes += w.bytes
                w = None
        else:
            raise PartialStreamError(f"{source}: the stream of partition {partition}/{of} ended early")
        if w is not None:
            raise PartialStreamError(f"{source}: shard {w.shard_id} ended without its end marker")
    except BaseException:
        if w is not None:
            w.abort()
        raise
    return {"shards": shards, "records": records, "bytes": nbytes, "skipped": len(done)}


def _ingest_task(source, to, n, opts, item):
    scale, i = item
    return ingest_partition(source, to, scale, i, n, **dict(opts))


def ingest(source, to, *, workers: int = 2, scales=None, cell_limit: int = CELL_LIMIT,
           row_group_size: int = ROW_GROUP, batch_rows: int = BATCH_ROWS, spec=None,
           scheduler=None) -> IngestReport:
    """Write a table sorted by (shard_id, morton) from a Flight server or an export.

    ``workers`` workers each pull one partition (``shard_id % workers``) per scale and write
    one Parquet file per shard.  Run it again after a failure: complete shards are kept and
    skipped; the table's ``info`` says ``complete: true`` only when every partition finished.

    Parameters
    ----------
    source : FlightSource, Dataset, path or URL
        A Flight server, ``FlightSource("grpc://host:port", token=...)`` (see ``dvidshards
        serve-flight``), or an export (path, URL or Dataset) read directly.
    to : path or VastDBSink
        The table folder (created; an existing table is resumed, anything else refused), or a
        VastDB table (threads only; shards already there are skipped).
    workers : int
        Partitions per scale, pulled concurrently (threads, or tasks on ``scheduler``).
    scales : list of int, optional
        Default: every scale.
    cell_limit : int
        Largest cell in bytes (126 KB); larger payloads are split over bin1..bin4.
    row_group_size : int
        Rows per Parquet row group.
    batch_rows : int
        Rows per streamed batch.
    spec : dict or path, optional
        The export's spec when it has no info file.
    scheduler : None, "threads", "local[:N]", address or distributed.Client
        None or "threads": one thread per worker in this process; else ``run_tasks``.
    """
    if isinstance(workers, bool) or not isinstance(workers, (int, np.integer)) or workers < 1:
        raise SpecError(f"workers must be a positive integer, got {workers!r}")
    if cell_limit < 1 or row_group_size < 1 or batch_rows < 1:
        raise SpecError("cell_limit, row_group_size and batch_rows must be positive")
    sink = to if isinstance(to, VastDBSink) else None
    to = to if sink is not None else os.fspath(to)
    _no_uri(source)
    if _is_stream_source(source):
        src_spec = source.spec
        all_scales = sorted(source.scales)
    else:
        ds = source if hasattr(source, "shard") else Dataset(source, spec=spec)
        if ds.spec is None:
            raise SpecError(f"{source}: ingest needs the export's spec (spec=...)")
        src_spec = ds.spec
        all_scales = [s.index for s in ds.scales]
        source = ds
    if sink is None:
        _prepare_table(to, src_spec)
    elif scheduler not in (None, "threads"):
        raise SpecError("a VastDB sink holds a live table: ingest into it with threads (scheduler=None)")
    todo = all_scales if scales is None else [int(k) for k in scales]
    missing = sorted(set(todo) - set(all_scales))
    if missing:
        raise SpecError(f"scales {missing} are not in the source (scales {all_scales})")
    opts = (("cell_limit", cell_limit), ("row_group_size", row_group_size), ("batch_rows", batch_rows))
    items = [(k, i) for k in todo for i in range(int(workers))]
    task = functools.partial(_ingest_task, source, to, int(workers), opts)
    report = IngestReport()
    t0 = time.perf_counter()
    results: dict = {}
    if scheduler in (None, "threads"):
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(int(workers), thread_name_prefix="dvidshards-ingest") as pool:
            futs = {pool.submit(task, it): it for it in items}
            for f, key in futs.items():
                try:
                    results[key] = f.result()
                except Exception as e:  # noqa: BLE001 - reported per partition
                    report.failed[f"s{key[0]} partition {key[1]}/{workers}"] = describe_exception(e)
    else:
        jr = run_tasks(task, items, scheduler=scheduler, desc="partitions")
        results = dict(jr.results)
        report.failed.update({f"s{k} partition {i}/{workers}": v for (k, i), v in jr.failed.items()})
    for r in results.values():
        report.shards += r["shards"]
        report.records += r["records"]
        report.bytes += r["bytes"]
        report.skipped += r["skipped"]
    report.seconds = time.perf_counter() - t0
    if not report.failed and sink is None:
        old = (read_table_info(to) or {}).get("dvidshards_table", {})
        done = sorted(set(old.get("scales_done", [])) | set(todo))
        counts = {f"s{k}": len(table_files(to, k)) for k in done}
        write_table_info(to, src_spec, complete=set(done) == set(all_scales),
                         extra={"scales_done": done, "shards": counts, "cell_limit": cell_limit})
    return report


def _prepare_table(to: str, spec: dict) -> None:
    """Create the table folder, or check that it is a table of the same spec (resume)."""
    if os.path.exists(to) and not os.path.isdir(to):
        raise SpecError(f"{to}: exists and is not a folder")
    os.makedirs(to, exist_ok=True)
    info = read_table_info(to)
    if info is None:
        if os.listdir(to):
            raise SpecError(f"{to}: not empty and not a dvidshards table; give a new folder")
        write_table_info(to, spec, complete=False)
        return
    old = {k: v for k, v in info.items() if k != "dvidshards_table"}
    if parse_multiscale(old, to) != parse_multiscale(spec, "source"):
        raise SpecError(f"{to}: a table of another volume (its spec differs from the source's)")


# --- /blocks dumps into an export -----------------------------------------------------------------


def ingest_blocks(paths, to, *, mapping=None, spec=None, scale: int = 0, compression: str = "auto",
                  resolution=(8, 8, 8), shard_chunks: int = 32, zstd_level: int = 3) -> dict:
    """Turn DVID ``/blocks`` dumps (supervoxels) into an export written like DVID's.

    Parameters
    ----------
    paths : path or list of paths (or bytes)
        ``GET …/blocks?supervoxels=true`` responses (see ``dvidshards.formats.blocks``).
    to : path
        The export root to create (must not exist or be empty; never written into otherwise).
    mapping : optional
        Supervoxel → body mapping (anything ``LabelMapping.from_any`` takes) for the records'
        agglomerated ``labels``; default: labels = supervoxels.
    spec : dict or path, optional
        The neuroglancer multiscale spec; the blocks are its scale ``scale``.  Default: one
        scale as large as the blocks reach, ``resolution`` nm, shards of ``shard_chunks``³.
        The ``info`` written lists the spec's scales up to ``scale`` only (the export has no
        folder for the coarser ones); with ``scale`` > 0 the finer scales have no folder
        either, and reading them is a SpecError, never background.
    compression : str
        What the dumps' payloads hold (``dvidshards.formats.blocks.read_stream``).

    Returns
    -------
    dict
        The spec written to ``to/info``, with ``"records"`` and ``"shards"`` counts added
        under ``"ingest"``.
    """
    import zstandard

    to = os.fspath(to)
    if os.path.exists(to) and (not os.path.isdir(to) or os.listdir(to)):
        raise SpecError(f"{to}: exists and is not an empty folder; give a new export folder")
    if isinstance(paths, (str, os.PathLike, bytes, bytearray, memoryview)):
        paths = [paths]
    m = LabelMapping.from_any(mapping) if mapping is not None else None
    zc = zstandard.ZstdCompressor(level=zstd_level, write_checksum=True, write_content_size=True)
    recs: dict[tuple, dict] = {}
    for p in paths:
        name = os.fspath(p) if isinstance(p, (str, os.PathLike)) else "<bytes>"
        for (bx, by, bz), block in read_stream(p, compression=compression):
            if min(bx, by, bz) < 0:
                raise ChunkIndexError(f"{name}: block {(bx, by, bz)} has a negative coordinate; exports start "
                                      f"at chunk (0, 0, 0)")
            if (bx, by, bz) in recs:
                raise ChunkIndexError(f"{name}: block {(bx, by, bz)} appears twice in the dumps")
            svs = np.array(block_header(block).labels, np.uint64)
            if not svs.any():
                continue  # all background in both label modes
            recs[(bx, by, bz)] = {"chunk_x": bx, "chunk_y": by, "chunk_z": bz, "supervoxels": svs,
                                  "labels": svs.copy() if m is None else m.palette(svs),
                                  "dvid_compressed_block": zc.compress(block), "uncompressed_size": len(block)}
    if spec is None:
        hi = np.max(np.array(list(recs), np.int64), axis=0) + 1 if recs else np.ones(3, np.int64)
        size = [int(v) * 64 for v in hi]
        sh = default_sharding(size, shard_chunks)
        scales_json = [{"chunk_sizes": [[64, 64, 64]], "compressed_segmentation_block_size": [8, 8, 8],
                        "encoding": "compressed_segmentation", "key": "x".join(f"{r:g}" for r in resolution),
                        "resolution": [float(r) for r in resolution], "sharding": sh.to_json(), "size": size,
                        "voxel_offset": [0, 0, 0]}]
        spec = {"@type": "neuroglancer_multiscale_volume", "data_type": "uint64", "num_channels": 1,
                "scales": scales_json, "type": "segmentation"}
        scale = 0
    else:
        spec = spec_from(spec, None)
    sc = {s.index: s for s in parse_multiscale(spec, "spec")}.get(scale)
    if sc is None:
        raise SpecError(f"scale {scale} is not in the spec")
    spec = {**spec, "scales": list(spec["scales"][:scale + 1])}  # no scale the export has no folder for
    grid = np.asarray(sc.grid)
    by_origin: dict[tuple, list] = {}
    for c, r in recs.items():
        if (np.asarray(c) >= grid).any():
            raise SpecError(f"block {c} lies outside scale {scale}'s chunk grid {tuple(grid)}")
        by_origin.setdefault(sc.shard_origin(*c), []).append(r)
    os.makedirs(os.path.join(to, sc.folder), exist_ok=True)
    for o, rs in sorted(by_origin.items()):
        rs.sort(key=lambda r: (r["chunk_z"], r["chunk_y"], r["chunk_x"]))  # DVID's ZYX order
        write_shard(os.path.join(to, sc.stem(o)), rs)
    with open(os.path.join(to, "info"), "w", encoding="utf-8") as f:
        json.dump(spec, f, indent=1)
    return {**spec, "ingest": {"records": len(recs), "shards": len(by_origin)}}


class IngestCommand:
    """``dvidshards ingest``: a Flight server or an export into a table; /blocks dumps into an export."""

    @staticmethod
    def add_arguments(p) -> None:
        p.add_argument("source", nargs="+",
                       help="grpc://HOST:PORT (a Flight server), an export folder, or DVID /blocks dump files")
        p.add_argument("--to", required=True, metavar="FOLDER",
                       help="the table folder (from a Flight server or an export), or the export to create "
                            "(from /blocks dumps)")
        p.add_argument("--workers", type=int, default=2, metavar="N",
                       help="partitions pulled concurrently (default 2)")
        p.add_argument("--scales", type=int, nargs="+", metavar="K", help="scales to ingest (default: all)")
        p.add_argument("--spec", help="the neuroglancer multiscale spec (an export without info; or the "
                                      "/blocks dumps' volume)")
        p.add_argument("--mapping",
                       help="/blocks dumps: supervoxel -> body mapping file for the agglomerated labels")
        p.add_argument("--compression", default="auto", choices=("auto", "blocks", "gzip", "lz4", "uncompressed"),
                       help="/blocks dumps: what the payloads hold (default: tell by content)")
        p.add_argument("--cell-limit", type=int, default=CELL_LIMIT, metavar="BYTES",
                       help=f"largest table cell; bigger payloads split over bin1..bin4 (default {CELL_LIMIT})")
        p.add_argument("--row-group-size", type=int, default=ROW_GROUP, metavar="ROWS",
                       help=f"rows per Parquet row group (default {ROW_GROUP})")
        p.add_argument("--token", help="Flight bearer token (default: $DVIDSHARDS_FLIGHT_TOKEN)")
        p.add_argument("--tls-root-certs", metavar="PEM", help="root certificate of a grpc+tls:// server")
        p.add_argument("--scheduler", default="threads",
                       help="'threads' (default), 'local:N' (dask LocalCluster) or a scheduler address")

    @staticmethod
    def main(args) -> int:
        """Run ``dvidshards ingest``; 0 on success, 1 when a partition failed."""
        srcs = args.source
        remote = [s for s in srcs if s.startswith(SCHEMES)]
        if remote or (len(srcs) == 1 and os.path.isdir(srcs[0])):
            if len(srcs) != 1:
                raise SpecError("give one Flight server or export")
            if args.mapping:
                raise SpecError("--mapping applies to /blocks dumps only")
            if args.workers < 1 or args.cell_limit < 1 or args.row_group_size < 1:
                raise SpecError("--workers, --cell-limit and --row-group-size must be positive")
            source = srcs[0]
            if remote:
                source = FlightSource(source, token=args.token or os.environ.get("DVIDSHARDS_FLIGHT_TOKEN") or None,
                                      tls_root_certs=args.tls_root_certs, tune_malloc=True)
            report = ingest(source, args.to, workers=args.workers, scales=args.scales, cell_limit=args.cell_limit,
                            row_group_size=args.row_group_size, spec=args.spec,
                            scheduler=None if args.scheduler == "threads" else args.scheduler)
            print(report.summary())
            return 0 if report.ok else 1
        for s in srcs:
            if not os.path.isfile(s):
                raise SpecError(f"{s}: no such file (nor a grpc:// URI or export folder)")
        out = ingest_blocks(srcs, args.to, mapping=args.mapping, spec=args.spec, compression=args.compression)
        print(f"{out['ingest']['records']} blocks in {out['ingest']['shards']} shards -> {args.to}")
        return 0
