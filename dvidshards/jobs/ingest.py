"""Ingest: block records into a table sorted by (shard, Morton), and DVID /blocks dumps into an export.

``dvidshards ingest SOURCE TABLE`` reads a Flight server (``dvidshards serve-flight``) or an export:

* **plan** (:func:`plan`): one :class:`IngestTask` per scale and partition (``shard_id % workers``);
* **task** (:func:`run_task`): one partition pulled, the shards the table holds not sent, each shard
  a Parquet file (:mod:`dvidshards.sources.tables`) written in the work folder and moved into the
  table when complete (a table never holds half a file), or inserted into VastDB;
* **reduce** (:func:`reduce`): the counts add up; the table's ``info`` says ``complete: true`` once
  every scale the source holds is in.

The table is a local folder (or a file system every worker shares). ``ingest_blocks`` (``dvidshards
ingest DUMP... EXPORT``) turns DVID ``GET …/blocks`` responses into an export written like DVID's.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

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
from ..formats.labels import Agglomerated, LabelSource, Mapped, Supervoxels, as_labels
from ..formats.multiscale import Scale, parse_multiscale
from ..sources.flight import SCHEMES, FlightSource
from ..sources.tables import (
    BATCH_ROWS,
    CELL_LIMIT,
    ROW_GROUP,
    STREAM_SCHEMA,
    PartialStreamError,
    TableFileWriter,
    origins_by_shard_id,
    partition_plan,
    read_table_info,
    record_batches,
    spec_from,
    table_files,
    write_table_info,
)
from ..sources.vastdb import VastDBSink
from ..stores import ByteStore, as_store, os_error
from ..writer import default_sharding, write_shard
from .options import (
    LABELS_HELP,
    add_dest,
    add_job_options,
    add_scales,
    command_line,
    job_options,
    scales_of,
)
from .output import JobReport, Lock, Output, work_folder
from .runner import PhaseReport, TaskRunner, clear_work, remove_work

__all__ = ["IngestCommand", "IngestTask", "IngestTotals", "ingest", "ingest_blocks", "plan", "reduce", "run_task"]

_SCALE_FOLDER = re.compile(r"s[0-9]+").fullmatch


@dataclass
class IngestTotals:
    """``JobReport.totals``: shards, records and bytes written, seconds, shards already there."""

    shards: int = 0
    records: int = 0
    bytes: int = 0
    seconds: float = 0.0
    skipped: int = 0

    def to_json(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        rate = f", {_size(self.bytes / self.seconds)}/s" if self.bytes > 0 and self.seconds > 0 else ""
        return (f"{self.records} records in {self.shards} shards ({_size(self.bytes)} in {self.seconds:.1f} s"
                f"{rate}), {self.skipped} shards already there")


def _size(nbytes: float) -> str:
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= k:
            return f"{nbytes / k:.3g} {unit}"
    return f"{int(nbytes)} B"


@contextlib.contextmanager
def _writing(where: str) -> Iterator[None]:
    """An OSError (a full disk, a folder that cannot be written) as one OutputError naming the path."""
    try:
        yield
    except OSError as e:
        if isinstance(e, DvidShardsError):
            raise
        raise os_error(e, e.filename or where, "write it") from None


# --------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class IngestTask:
    """Partition ``partition`` of ``of`` of one scale, from ``source`` (a Flight source or a Dataset)
    into the table through the work folder, or into ``sink``."""

    scale: int
    partition: int
    of: int
    source: Any = field(compare=False, repr=False)
    table: ByteStore | None = field(compare=False, repr=False)
    work: ByteStore | None = field(compare=False, repr=False)
    sink: VastDBSink | None = field(compare=False, repr=False)
    labels: LabelSource = field(compare=False, repr=False)
    cell_limit: int = CELL_LIMIT
    row_group_size: int = ROW_GROUP
    batch_rows: int = BATCH_ROWS

    def __str__(self) -> str:  # as failures name it
        return f"s{self.scale} partition {self.partition}/{self.of}"


def plan(source: Any, *, scales: Sequence[int], workers: int, table: ByteStore | None, work: ByteStore | None,
         sink: VastDBSink | None = None, labels: LabelSource | None = None, cell_limit: int = CELL_LIMIT,
         row_group_size: int = ROW_GROUP, batch_rows: int = BATCH_ROWS) -> Iterator[IngestTask]:
    src = labels if labels is not None else Agglomerated()
    for k in scales:
        for i in range(workers):
            yield IngestTask(int(k), i, workers, source, table, work, sink, src, cell_limit, row_group_size, batch_rows)


# --------------------------------------------------------------------------- one partition


def _local_scan(ds: Dataset, scale: Scale, partition: int, of: int, skip=(), batch_rows: int = BATCH_ROWS):
    """(batch, meta) of a partition read from a Dataset, as the Flight server streams it."""
    todo = partition_plan(origins_by_shard_id(scale, ds.shards(scale.index)), partition, of, skip)
    shards, records = 0, 0
    cache: dict = {}
    for s, o in todo:
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


def _relabel(batch: pa.RecordBatch, labels: LabelSource) -> pa.RecordBatch:
    """The records' ``labels`` as sent (agglomerated), their supervoxels, or the mapping of them."""
    if isinstance(labels, Agglomerated) or not batch.num_rows:
        return batch
    sv = batch.column("supervoxels")
    if isinstance(labels, Mapped):
        values = labels.mapping(sv.flatten().to_numpy(zero_copy_only=False))
        offsets = sv.offsets.to_numpy() - sv.offsets[0].as_py()
        sv = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, pa.uint64()))
    return batch.set_column(batch.schema.get_field_index("labels"), batch.schema.field("labels"), sv)


def _publish(path: str, table: ByteStore, key: str) -> None:
    """A complete shard file moved into the table (copied across file systems)."""
    try:
        os.replace(path, table.local_path(key))  # type: ignore[arg-type]
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
        with open(path, "rb") as f, table.writer(key) as out:
            shutil.copyfileobj(f, out, 1 << 22)
        os.unlink(path)


def run_task(task: IngestTask) -> dict:
    """One partition pulled into its shard files; counts."""
    with _writing(task.table.describe("") if task.table is not None else repr(task.sink)):
        return _pull(task)


def _pull(task: IngestTask) -> dict:
    source, scale, partition, of = task.source, task.scale, task.partition, task.of
    done: list[int] = []
    stage = ""
    if task.sink is None:
        assert task.table is not None and task.work is not None
        table, stage = task.table.local_path() or "", task.work.local_path(f"s{scale}") or ""
        os.makedirs(stage, exist_ok=True)
        os.makedirs(os.path.join(table, f"s{scale}"), exist_ok=True)
        done = [s for s in table_files(table, scale) if s % of == partition]
    if _is_stream_source(source):
        sc = source.scales[scale]
        stream = source.scan(scale, partition=partition, of=of, skip=done, batch_rows=task.batch_rows)
    else:
        sc = source.scale(scale)
        stream = _local_scan(source, sc, partition, of, done, task.batch_rows)
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
                s0 = batch.column("shard_id")[0].as_py()
                if w is None:
                    origin = meta.get("origin") or sc.shard_origin(*(int(batch.column(a)[0].as_py())
                                                                     for a in ("chunk_x", "chunk_y", "chunk_z")))
                    w = task.sink.writer(s0, origin) if task.sink is not None else \
                        TableFileWriter(stage, s0, origin, sc, task.row_group_size, task.cell_limit)
                elif s0 != w.shard_id:
                    raise PartialStreamError(f"{source}: shard {w.shard_id} ended without its end marker")
                w.add(_relabel(batch, task.labels))
            if meta.get("end"):
                if w is None:  # an empty shard: nothing to write
                    continue
                if meta["shard_id"] != w.shard_id or meta["records"] != w.rows:
                    raise PartialStreamError(f"{source}: shard {w.shard_id}: received {w.rows} records, the "
                                             f"stream says {meta.get('records')} for shard {meta.get('shard_id')}")
                path = w.close()
                if isinstance(path, str) and task.table is not None:
                    _publish(path, task.table, f"s{scale}/{os.path.basename(path)}")
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


# --------------------------------------------------------------------------- reduce


def reduce(phase: PhaseReport, totals: IngestTotals) -> IngestTotals:
    for r in phase.results.values():
        totals.shards += r["shards"]
        totals.records += r["records"]
        totals.bytes += r["bytes"]
        totals.skipped += r["skipped"]
    return totals


def _finish_table(path: str, spec: dict, todo: list[int], exported: list[int], cell_limit: int) -> None:
    """The table's ``info`` once the scales asked for are in: complete when every exported one is."""
    old = (read_table_info(path) or {}).get("dvidshards_table", {})
    done = sorted(set(old.get("scales_done", [])) | set(todo))
    counts = {f"s{k}": len(table_files(path, k)) for k in done}
    write_table_info(path, spec, complete=set(done) >= set(exported), extra={
        "scales_done": done, "scales_exported": exported, "shards": counts, "cell_limit": cell_limit})


# --------------------------------------------------------------------------- the job


def _is_stream_source(source: Any) -> bool:
    """A record stream (``FlightSource``): ``scan`` by partition, ``scales``, ``spec``."""
    return callable(getattr(source, "scan", None)) and hasattr(source, "scales") and hasattr(source, "spec")


def _local_folder(dest: Any, what: str) -> ByteStore:
    """A table or export to write: a local folder (these writers go through the operating system)."""
    store = as_store(dest, writable=True, what=what)
    if store.local_path() is None:
        raise OutputError(f"{store.describe('')}: ingest writes to a local folder (or a file system every worker "
                          f"shares), not to a bucket; give a path")
    return store


def ingest(source: Any, dest: Any, *, scales: Sequence[int] | None = None, labels: Any = "agglomerated",
           scheduler: Any = None, workdir: Any = None, resume: bool = False, overwrite: bool = False,
           progress: bool | None = None, allow_partial: bool = False, workers: int = 2,
           cell_limit: int = CELL_LIMIT, row_group_size: int = ROW_GROUP, batch_rows: int = BATCH_ROWS,
           spec: Any = None, command: str | None = None) -> JobReport:
    """Write a table sorted by (shard_id, morton) from a Flight server or an export.

    Parameters
    ----------
    source : FlightSource, Dataset, path or URL
        ``FlightSource("grpc://host:port", token=...)`` (``dvidshards serve-flight``), or an export.
    dest : path or VastDBSink
        The table folder (local, or a file system every worker shares): new, empty, or an earlier
        table of the same volume (``resume``/``overwrite``). Or a VastDB table (threads only; the
        shards there are skipped).
    scales : list of int, optional
        Default: every scale the source holds.
    labels : "agglomerated", "supervoxels" or a mapping
        The records' ``labels``: as the source holds them, their supervoxels, or a mapping of those
        (a file travels as its path).
    scheduler, workdir, resume, overwrite, progress, allow_partial :
        As for every job (:mod:`dvidshards.jobs.options`). ``scheduler`` None or "threads":
        ``workers`` threads here. ``workdir``: the shard files being written (default ``TABLE.work``).
    workers : int
        Partitions per scale, pulled concurrently.
    cell_limit, row_group_size, batch_rows : int
        Largest cell in bytes (larger payloads split over bin1..bin4); rows per Parquet row group;
        rows per streamed batch.
    spec, command :
        The export's spec when it has no info file; the command line.

    Returns
    -------
    JobReport
        ``totals`` is an :class:`IngestTotals`; ``failed`` names the partitions that failed.

    Raises
    ------
    SpecError, OutputError
        Before any work: bad input, a table of another volume, a bucket or an unwritable folder.
    JobError
        A partition failed and ``allow_partial`` is false: the complete shards kept, the table's
        ``info`` says ``complete: false``; ``resume`` finishes it.
    """
    if isinstance(workers, bool) or not isinstance(workers, (int, np.integer)) or workers < 1:
        raise SpecError(f"workers must be a positive integer, got {workers!r}")
    if cell_limit < 1 or row_group_size < 1 or batch_rows < 1:
        raise SpecError("cell_limit, row_group_size and batch_rows must be positive")
    if isinstance(source, str) and source.startswith(SCHEMES):
        raise SpecError(f"{source}: pass dvidshards.sources.FlightSource({source!r}, token=...) to ingest from a "
                        f"Flight server (or run `dvidshards ingest {source} TABLE`)")
    src = as_labels(labels)
    if not isinstance(src, (Agglomerated, Supervoxels, Mapped)):
        raise SpecError(f"labels must be 'agglomerated', 'supervoxels' or a mapping, got {labels!r}")
    if isinstance(src, Mapped):
        src.prepare()  # a bad file fails here, before any work
    sink = dest if isinstance(dest, VastDBSink) else None
    store = None if sink is not None else _local_folder(dest, "table")
    work = None if store is None else _local_folder(work_folder(store, workdir), "work folder")
    if sink is not None and workdir is not None:
        raise SpecError("a VastDB sink receives rows as they come: it has no work folder (leave workdir out)")
    if _is_stream_source(source):
        src_spec = source.spec
        held = getattr(source, "exported", None)  # the scales the server's source holds
        exported = sorted(source.scales) if held is None else sorted(held)
        origin = getattr(source, "location", None) or repr(source)
    else:
        source = source if isinstance(source, Dataset) else Dataset(source, spec=spec)
        if source.spec is None:
            raise SpecError(f"{source.store.describe('')}: ingest needs the export's spec (spec=...)")
        src_spec = source.spec
        exported = list(source.exported)
        origin = source.store.describe("")
    wanted = scales_of(scales)
    todo = exported if wanted is None else wanted
    missing = sorted(set(todo) - set(exported))
    if missing:
        raise NotExportedError(f"{origin}: scale{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} "
                               f"not exported (the source holds {', '.join(f's{k}' for k in exported)}); make "
                               f"them with: dvidshards downsample EXPORT DEST, and ingest DEST too")
    if sink is not None and scheduler not in (None, "threads"):
        raise SpecError("a VastDB sink holds a live table: ingest into it with threads (scheduler=None)")
    runner = TaskRunner(f"threads:{int(workers)}" if scheduler in (None, "threads") else scheduler, progress=progress)
    tasks = list(plan(source, scales=todo, workers=int(workers), table=store, work=work, sink=sink, labels=src,
                      cell_limit=cell_limit, row_group_size=row_group_size, batch_rows=batch_rows))
    totals = IngestTotals()
    if sink is not None:  # a live VastDB table: no folder to lock or to hold a manifest
        frame = _SinkFrame(JobReport("ingest", repr(sink), list(todo)))
        t0 = time.perf_counter()
        with runner:
            frame.add(runner.run(run_task, tasks, desc="partitions"))
        totals = reduce(frame.phase, totals)
        totals.seconds = time.perf_counter() - t0
        return frame.finish(totals, allow_partial)
    assert store is not None and work is not None
    path = store.local_path()
    assert path is not None
    if not overwrite:
        _check_table(path, src_spec)  # before the lock's manifest is written: a refusal changes nothing
    with Output(store, job="ingest", parameters={"cell_limit": int(cell_limit), **src.identity()}, scales=todo,
                source=None if _is_stream_source(source) else source, command=command, resume=resume,
                overwrite=overwrite, own=lambda n: n == "info" or bool(_SCALE_FOLDER(n)),
                workdir=work) as out, runner:
        out.update(read_from=str(origin), workers=int(workers))
        runner.check_shared(work)
        clear_work(work, _SCALE_FOLDER)  # an earlier run's half-written files (we hold the lock)
        with _writing(path):
            if read_table_info(path) is None:
                write_table_info(path, src_spec, complete=False)
            t0 = time.perf_counter()
            phase = runner.run(run_task, tasks, desc="partitions")
            out.add(phase)
            totals = reduce(phase, totals)
            totals.seconds = time.perf_counter() - t0
            if not out.report.failed:
                _finish_table(path, src_spec, todo, exported, cell_limit)
        report = out.finish(totals=totals, notes=[totals.line()], allow_partial=allow_partial)
    if report.complete:
        remove_work(work, _SCALE_FOLDER)
    return report


class _SinkFrame:
    """:class:`Output`'s report and failure contract for a VastDB sink (no folder)."""

    def __init__(self, report: JobReport):
        self.report = report
        self.phase = PhaseReport()
        self._t0 = time.perf_counter()

    def add(self, phase: PhaseReport) -> None:
        self.phase = phase
        self.report.tasks += len(phase.results) + len(phase.failed) + len(phase.skipped)
        self.report.done += len(phase.results)
        self.report.failed.update({str(k): v for k, v in phase.failed.items()})
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
    """An existing table must be of the same volume (its spec); nothing changed."""
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


# --------------------------------------------------------------------------- /blocks dumps into an export


def ingest_blocks(paths: Any, dest: Any, *, labels: Any = "agglomerated", spec: Any = None, scale: int = 0,
                  compression: str = "auto", resolution: Sequence[float] = (8, 8, 8), shard_chunks: int = 32,
                  zstd_level: int = 3) -> dict:
    """Turn DVID ``/blocks`` dumps (supervoxels) into an export written like DVID's.

    Parameters
    ----------
    paths : path or list of paths (or bytes)
        ``GET …/blocks?supervoxels=true`` responses (:mod:`dvidshards.formats.blocks`).
    dest : path
        The export root to create: a local folder, new or empty; locked while written.
    labels : "agglomerated", "supervoxels" or a mapping
        The records' agglomerated ``labels``: a mapping of the supervoxels, or (the dumps hold no
        bodies) the supervoxels themselves.
    spec : dict or path, optional
        The multiscale spec; the blocks are its scale ``scale``. Default: one scale as large as the
        blocks reach, ``resolution`` nm, shards of ``shard_chunks``³. The ``info`` lists the scales up
        to ``scale`` (the export has no folder for coarser ones; nor for finer ones: reading them is
        a SpecError, never background).
    compression : str
        What the payloads hold (``dvidshards.formats.blocks.read_stream``).

    Returns
    -------
    dict
        The spec written to ``dest/info``, with ``"ingest": {"records", "shards"}``.
    """
    src = as_labels(labels)
    store = _local_folder(dest, "export")
    to = store.local_path()
    assert to is not None
    store.check_writable()
    lock = Lock(store, "ingest")
    made = not os.path.exists(to)
    lock.acquire()  # a second writer is refused naming this one
    ok = False
    try:
        if [n for n in store.list_sync("") if n != lock.name]:
            raise SpecError(f"{to}: exists and is not an empty folder; give a new export folder")
        with _writing(to):
            out = _write_blocks(paths, to, src, spec, scale, compression, resolution, shard_chunks, zstd_level)
        ok = True
        return out
    finally:
        lock.release()
        if not ok and made and os.path.isdir(to) and not os.listdir(to):
            os.rmdir(to)  # refused or failed before anything was written: no folder left behind


def _write_blocks(paths: Any, to: str, labels: LabelSource, spec: Any, scale: int, compression: str,
                  resolution: Sequence[float], shard_chunks: int, zstd_level: int) -> dict:
    import zstandard

    if isinstance(paths, (str, os.PathLike, bytes, bytearray, memoryview)):
        paths = [paths]
    m = labels.mapping if isinstance(labels, Mapped) else None
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


# --------------------------------------------------------------------------- command line


_DEFAULTS = {"workers": 2, "cell_limit": CELL_LIMIT, "row_group_size": ROW_GROUP, "compression": "auto",
             "labels": "agglomerated"}
_TABLE_ONLY = {"workers": 2, "cell_limit": CELL_LIMIT, "row_group_size": ROW_GROUP, "scales": None, "token": None,
               "tls_root_certs": None, "scheduler": None, "workdir": None, "resume": False, "overwrite": False}


class IngestCommand:
    """``dvidshards ingest SOURCE... DEST``: a Flight server or an export into a table; /blocks dumps into an export."""

    @staticmethod
    def add_arguments(p) -> None:
        p.add_argument("source", nargs="+", metavar="SOURCE",
                       help="grpc://HOST:PORT (a Flight server), an export folder, or DVID /blocks dump files")
        add_dest(p, what="the table folder (from a Flight server or an export), or the export to create (from "
                         "/blocks dumps); a local folder")
        p.add_argument("--workers", type=int, default=2, metavar="N",
                       help="partitions pulled concurrently (default 2)")
        add_scales(p, help="scales to ingest (default: all)")
        p.add_argument("--spec", help="the neuroglancer multiscale spec (an export without info; or the "
                                      "/blocks dumps' volume)")
        p.add_argument("--labels", default="agglomerated", metavar="LABELS",
                       help=LABELS_HELP + "; /blocks dumps hold supervoxels only: a mapping gives their bodies")
        p.add_argument("--compression", default="auto", choices=("auto", "blocks", "gzip", "lz4", "uncompressed"),
                       help="/blocks dumps: what the payloads hold (default: tell by content)")
        p.add_argument("--cell-limit", type=int, default=CELL_LIMIT, metavar="BYTES",
                       help=f"largest table cell; bigger payloads split over bin1..bin4 (default {CELL_LIMIT})")
        p.add_argument("--row-group-size", type=int, default=ROW_GROUP, metavar="ROWS",
                       help=f"rows per Parquet row group (default {ROW_GROUP})")
        p.add_argument("--token", help="Flight bearer token (default: $DVIDSHARDS_FLIGHT_TOKEN)")
        p.add_argument("--tls-root-certs", metavar="PEM", help="root certificate of a grpc+tls:// server")
        add_job_options(p)

    @staticmethod
    def main(args) -> int:
        """0 on success, 1 when a partition failed."""
        srcs = list(args.source)
        remote = [s for s in srcs if s.startswith(SCHEMES)]
        if remote or (len(srcs) == 1 and os.path.isdir(srcs[0])):
            if len(srcs) != 1:
                raise SpecError("give one Flight server or export")
            if args.compression != "auto":
                raise SpecError("--compression applies to /blocks dumps only")
            _local_folder(args.dest, "table")  # a bucket is refused before connecting to anything
            source: Any = srcs[0]
            if remote:
                source = FlightSource(source, token=args.token or os.environ.get("DVIDSHARDS_FLIGHT_TOKEN") or None,
                                      tls_root_certs=args.tls_root_certs, tune_malloc=True)
            kw = {k: getattr(args, k) for k in ("workers", "scales", "labels", "cell_limit", "row_group_size", "spec")}
            skip = [k for k, v in _DEFAULTS.items() if getattr(args, k) == v]
            report = ingest(source, args.dest, allow_partial=True, **kw, **job_options(args),
                            command=command_line("ingest", args, skip=[*skip, "token"]))
            print(report.summary())
            return 0 if report.ok else 1
        for s in srcs:
            if not os.path.isfile(s):
                raise SpecError(f"{s}: no such file (nor a grpc:// URI or export folder)")
        table_only = [k for k, v in _TABLE_ONLY.items() if getattr(args, k) != v]
        if table_only:
            raise SpecError(f"--{table_only[0].replace('_', '-')} applies to a table (from a Flight server or an "
                            f"export), not to /blocks dumps")
        out = ingest_blocks(srcs, args.dest, labels=args.labels, spec=args.spec, compression=args.compression)
        print(f"{out['ingest']['records']} blocks in {out['ingest']['shards']} shards -> {args.dest}")
        return 0
