"""Ingest: block records into a table sorted by (shard, Morton), and DVID /blocks dumps into an export.

* `ingest` (``dvidshards ingest SOURCE TABLE``) - plan: the scales and ``workers`` partitions
  (``shard_id % workers``) of a Flight server (``dvidshards serve-flight``) or an export; task
  (`ingest_partition`): pull one partition and write one Parquet file per shard (each written
  aside and renamed when complete; ``dvidshards.sources.tables`` describes the table), or insert
  into VastDB; reduce: the counts add up, and the table's ``info`` says ``complete: true`` once
  every scale asked for is in. The table runs in :class:`dvidshards.jobs.output.Output`: locked
  while written, refused unless empty or an earlier table (the same volume), with the manifest
  ``_dvidshards.json``. A table fills shard by shard, so ingest *resumes by default*: a second run
  pulls only the shards that are missing (``overwrite=True`` starts again). The table is a local
  folder (or a file system every worker shares); a bucket is refused in one line before any work.
* `ingest_blocks` (``dvidshards ingest DUMP... EXPORT``) - DVID ``GET …/blocks`` responses turned
  into an export written like DVID's, in a new or empty local folder (locked while written).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import time
from dataclasses import asdict, dataclass

import numpy as np
import pyarrow as pa

from ..dataset import Dataset
from ..errors import (
    ChunkIndexError,
    DvidShardsError,
    JobError,
    NotExportedError,
    OutputError,
    SpecError,
)
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
from .options import (
    add_dest,
    add_job_options,
    add_scales,
    command_line,
    dest_of,
    renamed,
    scales_of,
)
from .output import Destination, JobReport, Lock, Output, check_apart, os_error
from .runner import TaskRunner

__all__ = ["IngestCommand", "IngestTotals", "ingest", "ingest_blocks", "ingest_partition"]


@dataclass
class IngestTotals:
    """What `ingest` moved (``JobReport.totals``): shards and records written, bytes, time, and
    the shards already in the table (skipped)."""

    shards: int = 0
    records: int = 0
    bytes: int = 0
    seconds: float = 0.0
    skipped: int = 0

    def to_json(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        """One line: records, shards, bytes and their rate (none when nothing was moved), skips."""
        rate = _rate(self.bytes, self.seconds)
        return (f"{self.records} records in {self.shards} shards ({_size(self.bytes)} in {self.seconds:.1f} s"
                f"{', ' + rate if rate else ''}), {self.skipped} shards already there")


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
                        f"Flight server (or run `dvidshards ingest {source} TABLE`)")


def _local_folder(dest, what: str) -> str:
    """The local path of a table or export to write; a bucket or an unknown scheme is refused in
    one line before any work (these writers go through the operating system)."""
    d = Destination.of(dest, what=what)
    if not d.local:
        raise OutputError(f"{d.describe()}: ingest writes to a local folder (or a file system every worker "
                          f"shares), not to a bucket; give a path")
    return d.local_path()


def ingest_partition(source, dest=None, scale: int = 0, partition: int = 0, of: int = 1, *,
                     cell_limit: int = CELL_LIMIT, row_group_size: int = ROW_GROUP, batch_rows: int = BATCH_ROWS,
                     spec=None, **old) -> dict:
    """The task: pull partition ``partition`` of ``of`` of a scale and write its shard files.

    Shards already in the table are skipped (and not sent); each shard file appears only
    once complete. ``source`` is a record stream (``dvidshards.sources.FlightSource``) or an
    export/table/Dataset read directly; ``dest`` the table folder (or a ``VastDBSink``). Returns
    counts. A full disk or a folder that cannot be written is an OutputError naming the path.
    """
    dest = renamed(old, "to", "dest", dest, job="ingest_partition")
    if old:
        raise TypeError(f"ingest_partition() got an unexpected keyword argument {next(iter(old))!r}")
    _no_uri(source)
    sink = dest if isinstance(dest, VastDBSink) else None
    if dest is None:
        raise TypeError("ingest_partition() needs dest, the table folder (or a VastDBSink)")
    try:
        return _pull(source, sink, os.fspath(dest) if sink is None else "", scale, partition, of, cell_limit,
                     row_group_size, batch_rows, spec)
    except OSError as e:
        if isinstance(e, DvidShardsError):
            raise
        raise os_error(e, e.filename or os.fspath(dest), "write it") from None


def _pull(source, sink, to: str, scale: int, partition: int, of: int, cell_limit: int, row_group_size: int,
          batch_rows: int, spec) -> dict:
    done: list[int] = []
    folder = ""
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


def _ingest_task(source, dest, n, opts, item):
    scale, i = item
    return ingest_partition(source, dest, scale, i, n, **dict(opts))


def ingest(source, dest=None, *, workers: int = 2, scales=None, cell_limit: int = CELL_LIMIT,
           row_group_size: int = ROW_GROUP, batch_rows: int = BATCH_ROWS, spec=None, scheduler=None,
           resume: bool = True, overwrite: bool = False, progress: bool | None = None,
           allow_partial: bool = False, command: str | None = None, **old) -> JobReport:
    """Write a table sorted by (shard_id, morton) from a Flight server or an export.

    ``workers`` workers each pull one partition (``shard_id % workers``) per scale and write
    one Parquet file per shard. Run it again after a failure: complete shards are kept and
    skipped; the table's ``info`` says ``complete: true`` only when every partition finished.

    Parameters
    ----------
    source : FlightSource, Dataset, path or URL
        A Flight server, ``FlightSource("grpc://host:port", token=...)`` (see ``dvidshards
        serve-flight``), or an export (path, URL or Dataset) read directly.
    dest : path or VastDBSink
        The table folder (a local path, or a file system every worker shares): new, empty, or
        an earlier table of the same volume (resumed); anything else refused before any work.
        Or a VastDB table (threads only; shards already there are skipped).
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
        None or "threads": ``workers`` threads in this process; else that scheduler.
    resume : bool
        Keep the shards an earlier run wrote (default: a table fills shard by shard).
    overwrite : bool
        Delete an earlier table's files first and start again.
    progress : bool, optional
        Progress bar / lines (default: a bar on a terminal, lines in a log).
    allow_partial : bool
        Return the report of an incomplete table instead of raising JobError.
    command : str, optional
        The command line, recorded in the manifest.

    Returns
    -------
    JobReport
        ``totals`` is an :class:`IngestTotals`; ``failed`` names the partitions that failed.

    Raises
    ------
    SpecError, OutputError
        Bad input, a table of another volume, a bucket or a folder that cannot be written;
        before any work.
    JobError
        A partition failed and ``allow_partial`` is false: the complete shards are kept, the
        table's ``info`` says ``complete: false``; run again to finish. ``.report`` is the report.

    Notes
    -----
    ``to=`` is the old name of ``dest`` (one more release, with a DeprecationWarning).
    """
    dest = renamed(old, "to", "dest", dest, job="ingest")
    if old:
        raise TypeError(f"ingest() got an unexpected keyword argument {next(iter(old))!r}")
    if dest is None:
        raise TypeError("ingest() needs dest, the table folder (or a VastDBSink)")
    if isinstance(workers, bool) or not isinstance(workers, (int, np.integer)) or workers < 1:
        raise SpecError(f"workers must be a positive integer, got {workers!r}")
    if cell_limit < 1 or row_group_size < 1 or batch_rows < 1:
        raise SpecError("cell_limit, row_group_size and batch_rows must be positive")
    if overwrite:
        resume = False
    sink = dest if isinstance(dest, VastDBSink) else None
    path = None if sink is not None else _local_folder(dest, "table")
    _no_uri(source)
    if _is_stream_source(source):
        src_spec = source.spec
        held = getattr(source, "exported", None)  # the scales the server's source holds
        all_scales = sorted(source.scales) if held is None else sorted(held)
        origin = getattr(source, "location", None) or repr(source)
    else:
        ds = source if hasattr(source, "shard") else Dataset(source, spec=spec)
        if ds.spec is None:
            raise SpecError(f"{source}: ingest needs the export's spec (spec=...)")
        src_spec = ds.spec
        all_scales = list(ds.exported)
        source = ds
        origin = ds.store.describe("") if hasattr(ds, "store") else repr(ds)
    wanted = scales_of(scales)
    todo = all_scales if wanted is None else wanted
    missing = sorted(set(todo) - set(all_scales))
    if missing:
        raise NotExportedError(f"{origin}: scale{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} "
                               f"not exported (the source holds {', '.join(f's{k}' for k in all_scales)}); make "
                               f"them with: dvidshards downsample EXPORT DEST, and ingest DEST too")
    if sink is not None and scheduler not in (None, "threads"):
        raise SpecError("a VastDB sink holds a live table: ingest into it with threads (scheduler=None)")
    runner = TaskRunner(f"threads:{int(workers)}" if scheduler in (None, "threads") else scheduler, progress=progress)
    opts = (("cell_limit", cell_limit), ("row_group_size", row_group_size), ("batch_rows", batch_rows))
    items = [(k, i) for k in todo for i in range(int(workers))]
    totals = IngestTotals()

    def run(out) -> None:
        t0 = time.perf_counter()
        task = functools.partial(_ingest_task, source, sink if sink is not None else path, int(workers), opts)
        with runner:
            phase = runner.run(task, items, desc="partitions")
        out.add(phase, name=lambda it: f"s{it[0]} partition {it[1]}/{workers}")
        for r in phase.results.values():
            totals.shards += r["shards"]
            totals.records += r["records"]
            totals.bytes += r["bytes"]
            totals.skipped += r["skipped"]
        totals.seconds = time.perf_counter() - t0

    if sink is not None:  # a live VastDB table: no folder to lock or to hold a manifest
        frame = _SinkFrame(JobReport("ingest", repr(sink), list(todo)))
        run(frame)
        return frame.finish(totals, allow_partial)
    assert path is not None
    if not overwrite:
        _check_table(path, src_spec)  # before the lock's manifest is written: a refusal changes nothing
    if not _is_stream_source(source):
        check_apart(Destination.of(path), source=source, what="table")
    with Output(path, job="ingest", parameters={"cell_limit": int(cell_limit)}, scales=todo, command=command,
                resume=resume, overwrite=overwrite, own=lambda n: n == "info" or bool(re.fullmatch(r"s[0-9]+", n))
                ) as out:
        out.update(read_from=str(origin), workers=int(workers))
        try:
            if read_table_info(path) is None:
                write_table_info(path, src_spec, complete=False)
            run(out)
            if not out.report.failed:
                old_info = (read_table_info(path) or {}).get("dvidshards_table", {})
                done = sorted(set(old_info.get("scales_done", [])) | set(todo))
                counts = {f"s{k}": len(table_files(path, k)) for k in done}
                write_table_info(path, src_spec, complete=set(done) >= set(all_scales),
                                 extra={"scales_done": done, "scales_exported": all_scales, "shards": counts,
                                        "cell_limit": cell_limit})
        except OSError as e:
            if isinstance(e, DvidShardsError):
                raise
            raise os_error(e, e.filename or path, "write it") from None
        return out.finish(totals=totals, notes=[totals.line()], allow_partial=allow_partial)


class _SinkFrame:
    """The report and failure contract of :class:`Output` for a VastDB sink (no folder)."""

    def __init__(self, report: JobReport):
        self.report = report
        self._t0 = time.perf_counter()

    def add(self, phase, name=str) -> None:
        self.report.tasks += len(phase.results) + len(phase.failed) + len(phase.skipped)
        self.report.done += len(phase.results)
        self.report.failed.update({name(k): v for k, v in phase.failed.items()})
        self.report.task_cpu += phase.task_cpu

    def finish(self, totals: IngestTotals, allow_partial: bool) -> JobReport:
        r = self.report
        r.totals, r.notes = totals, [totals.line()]
        r.complete = not r.failed
        r.status = "complete" if r.complete else "incomplete"
        r.elapsed = time.perf_counter() - self._t0
        if not r.complete and not allow_partial:
            raise JobError(r.summary(), r)
        return r


def _check_table(path: str, spec: dict) -> None:
    """An existing table must be of the same volume (its spec); read only, nothing changed."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise SpecError(f"{path}: exists and is not a folder")
    try:
        info = read_table_info(path)
    except OSError as e:
        raise os_error(e, os.path.join(path, "info"), "read it") from None
    if info is None:
        return
    old = {k: v for k, v in info.items() if k != "dvidshards_table"}
    if parse_multiscale(old, path) != parse_multiscale(spec, "source"):
        raise SpecError(f"{path}: a table of another volume (its spec differs from the source's)")


# --- /blocks dumps into an export -----------------------------------------------------------------


def ingest_blocks(paths, dest=None, *, mapping=None, spec=None, scale: int = 0, compression: str = "auto",
                  resolution=(8, 8, 8), shard_chunks: int = 32, zstd_level: int = 3, **old) -> dict:
    """Turn DVID ``/blocks`` dumps (supervoxels) into an export written like DVID's.

    Parameters
    ----------
    paths : path or list of paths (or bytes)
        ``GET …/blocks?supervoxels=true`` responses (see ``dvidshards.formats.blocks``).
    dest : path
        The export root to create, a local folder (must not exist or be empty; never written
        into otherwise). Locked while written. ``to=`` is its old name (one more release, with a
        DeprecationWarning).
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
        The spec written to ``dest/info``, with ``"records"`` and ``"shards"`` counts added
        under ``"ingest"``.
    """
    dest = renamed(old, "to", "dest", dest, job="ingest_blocks")
    if old:
        raise TypeError(f"ingest_blocks() got an unexpected keyword argument {next(iter(old))!r}")
    if dest is None:
        raise TypeError("ingest_blocks() needs dest, the export folder to create")
    to = _local_folder(dest, "export")
    d = Destination.of(to)
    d.probe()
    lock = Lock(d, "ingest")
    made = not os.path.exists(to)
    lock.acquire()  # a second writer is refused naming this one
    ok = False
    try:
        if [n for n in d.list() if n != lock.name]:
            raise SpecError(f"{to}: exists and is not an empty folder; give a new export folder")
        try:
            out = _write_blocks(paths, to, mapping, spec, scale, compression, resolution, shard_chunks, zstd_level)
        except OSError as e:
            if isinstance(e, DvidShardsError):
                raise
            raise os_error(e, e.filename or to, "write it") from None
        ok = True
        return out
    finally:
        lock.release()
        if not ok and made and os.path.isdir(to) and not os.listdir(to):
            os.rmdir(to)  # refused or failed before anything was written: no folder left behind


def _write_blocks(paths, to: str, mapping, spec, scale: int, compression: str, resolution, shard_chunks: int,
                  zstd_level: int) -> dict:
    import zstandard

    if isinstance(paths, (str, os.PathLike, bytes, bytearray, memoryview)):
        paths = [paths]
    m = LabelMapping.from_any(mapping) if mapping is not None else None
    zc = zstandard.ZstdCompressor(level=zstd_level, write_checksum=True, write_content_size=True)
    recs: dict[tuple, dict] = {}
    for p in paths:
        name = os.fspath(p) if isinstance(p, (str, os.PathLike)) else "<bytes>"
        with open(p, "rb") if isinstance(p, (str, os.PathLike)) else contextlib.nullcontext(p) as f:
            for (bx, by, bz), block in read_stream(f, compression=compression):
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
    """``dvidshards ingest SOURCE... DEST``: a Flight server or an export into a table; /blocks dumps into an export."""

    @staticmethod
    def add_arguments(p) -> None:
        p.add_argument("source", nargs="+", metavar="SOURCE",
                       help="grpc://HOST:PORT (a Flight server), an export folder, or DVID /blocks dump files; "
                            "then DEST")
        add_dest(p, what="the table folder (from a Flight server or an export; an earlier table of the same volume "
                         "is resumed), or the export to create (from /blocks dumps); a local folder",
                 old=("--to",))
        p.add_argument("--workers", type=int, default=2, metavar="N",
                       help="partitions pulled concurrently (default 2)")
        add_scales(p, help="scales to ingest (default: all)")
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
        add_job_options(p, workdir=False)

    @staticmethod
    def main(args) -> int:
        """Run ``dvidshards ingest``; 0 on success, 1 when a partition failed."""
        srcs = list(args.source)
        if args.dest is None and getattr(args, "_old_dest", None) is None and len(srcs) >= 2:
            args.dest = srcs.pop()  # SOURCE... DEST: the last one is the destination
            args.source = srcs
        dest = dest_of(args)
        remote = [s for s in srcs if s.startswith(SCHEMES)]
        if remote or (len(srcs) == 1 and os.path.isdir(srcs[0])):
            if len(srcs) != 1:
                raise SpecError("give one Flight server or export")
            if args.mapping:
                raise SpecError("--mapping applies to /blocks dumps only")
            if args.workers < 1 or args.cell_limit < 1 or args.row_group_size < 1:
                raise SpecError("--workers, --cell-limit and --row-group-size must be positive")
            _local_folder(dest, "table")  # a bucket is refused before connecting to anything
            source = srcs[0]
            if remote:
                source = FlightSource(source, token=args.token or os.environ.get("DVIDSHARDS_FLIGHT_TOKEN") or None,
                                      tls_root_certs=args.tls_root_certs, tune_malloc=True)
            skip = [k for k, v in (("workers", 2), ("cell_limit", CELL_LIMIT), ("row_group_size", ROW_GROUP),
                                   ("compression", "auto"), ("token", None)) if getattr(args, k) == v] + ["token"]
            report = ingest(source, dest, workers=args.workers, scales=args.scales, cell_limit=args.cell_limit,
                            row_group_size=args.row_group_size, spec=args.spec, scheduler=args.scheduler,
                            resume=True, overwrite=args.overwrite, progress=False if args.quiet else None,
                            allow_partial=True, command=command_line("ingest", args, skip=skip))
            print(report.summary())
            return 0 if report.ok else 1
        for s in srcs:
            if not os.path.isfile(s):
                raise SpecError(f"{s}: no such file (nor a grpc:// URI or export folder)")
        out = ingest_blocks(srcs, dest, mapping=args.mapping, spec=args.spec, compression=args.compression)
        print(f"{out['ingest']['records']} blocks in {out['ingest']['shards']} shards -> {dest}")
        return 0
