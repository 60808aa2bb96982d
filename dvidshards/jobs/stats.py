"""Per-body statistics of a whole export (``dvidshards stats EXPORT DEST``): each body's voxels,
supervoxels, chunks and exact bounding box (DVID's ``/sizes``, neuclease's ``fetch_sizes``).

Every record is read once, its block counted by the ``blockstats`` kernel (no voxel decoded).
plan, reduce: :mod:`dvidshards.jobs.buckets`; run_task: one shard's partial statistics
(:func:`shard_body_stats`, a body's supervoxels as a list), combined by body, then each bucket
``finish``-ed (supervoxel counts, voxels descending). ``DEST`` is a folder (a Parquet dataset and
``_meta.json``) or, ending in ``.parquet``, one file streamed together from the buckets on a
worker, its manifest in its metadata, written only when complete. A failed shard leaves no rows;
``--resume`` finishes. :func:`body_stats_table` returns a small export's rows as one table.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..errors import JobError, SpecError
from ..formats.labelindex import bucket_name
from ..stores import ByteStore, as_store
from .buckets import (
    FAN_IN,
    BoxLike,
    LabelsLike,
    Location,
    Rows,
    ShardTask,
    SourceLike,
    TableJob,
    add_arguments,
    check_box,
    dataset_meta,
    kept,
    label_source,
    map_reduce,
    open_source,
    run_command,
    run_dataset,
    runs,
    shard_origins,
    shard_rows,
    start_work,
    table_job,
    write_partial,
)
from .output import JobReport
from .runner import TaskRunner, remove_work

__all__ = ["MAX_TABLE_ROWS", "STATS_FORMAT", "STATS_ORDER", "STATS_SCHEMA", "StatsCommand", "body_stats",
           "body_stats_table", "reduce", "run_task", "shard_body_stats"]

STATS_FORMAT = "dvidshards-body-stats"
STATS_ORDER = "grouped by hash bucket of the label (bucket_of(label, bits)); in a bucket, voxels descending, then label"
MAX_TABLE_ROWS = 1 << 22  # body_stats_table returns at most this many rows (~350 MB)
_BOX = ("x0", "y0", "z0", "x1", "y1", "z1")
STATS_SCHEMA = pa.schema(
    [("label", pa.uint64()), ("voxels", pa.int64()), ("supervoxels", pa.int64()),
     ("chunks", pa.int64())] + [(c, pa.int64()) for c in _BOX]
)
# a body's supervoxels as a list, so that merges count distinct ones
PARTIAL_SCHEMA = pa.schema(
    [("label", pa.uint64()), ("voxels", pa.int64()), ("chunks", pa.int64())]
    + [(c, pa.int64()) for c in _BOX] + [("svs", pa.large_list(pa.uint64()))]
)


def _combined(label, voxels, chunks, boxes, owner, svs) -> pa.Table:
    """Rows sorted by label, one per label: voxels and chunks added, boxes joined, supervoxels distinct."""
    starts = runs([label])
    lo = np.minimum.reduceat(boxes[:, :3], starts, axis=0)
    hi = np.maximum.reduceat(boxes[:, 3:], starts, axis=0)
    ps = np.lexsort((svs, owner))
    keep = runs([owner[ps], svs[ps]])
    pair_label, pair_sv = owner[ps][keep], svs[ps][keep]
    label = label[starts]
    offsets = np.append(np.searchsorted(pair_label, label, side="left"), len(pair_sv)).astype(np.int64)
    cols = [pa.array(label, pa.uint64()), pa.array(np.add.reduceat(voxels, starts), pa.int64()),
            pa.array(np.add.reduceat(chunks, starts), pa.int64())]
    cols += [pa.array(c, pa.int64()) for c in np.hstack([lo, hi]).T]
    cols.append(pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(pair_sv, pa.uint64())))
    return pa.Table.from_arrays(cols, schema=PARTIAL_SCHEMA)


def shard_body_stats(source: SourceLike, *, scale: int, origin: tuple[int, int, int],
                     labels: LabelsLike = "agglomerated", box: BoxLike | None = None) -> pa.Table:
    """One shard's partial statistics of its voxels inside ``box``: a row per body (``label, voxels,
    chunks, x0, y0, z0, x1, y1, z1`` and ``svs``, its sorted distinct supervoxels), sorted by label."""
    rec, sv, body, vox, boxes, _ = shard_rows(open_source(source, None), scale, origin, labels, box)
    if not len(body):
        return PARTIAL_SCHEMA.empty_table()
    order = np.lexsort((rec, body))
    rec, sv, body = rec[order], sv[order], body[order]
    first = np.zeros(len(body), np.int64)  # 1 on a body's first row in each chunk
    first[runs([body, rec])] = 1
    return _combined(body, vox[order], first, boxes[order], body, sv)


def reduce(tables: list[pa.Table]) -> pa.Table:
    """Partial statistics of the same bodies from different shards, combined."""
    tables = [t for t in tables if t.num_rows]
    if len(tables) < 2:
        return tables[0] if tables else PARTIAL_SCHEMA.empty_table()
    t = pa.concat_tables(tables).combine_chunks()
    label = t["label"].to_numpy()
    order = np.argsort(label, kind="stable")
    svs = t["svs"].combine_chunks()
    return _combined(label[order], t["voxels"].to_numpy()[order], t["chunks"].to_numpy()[order],
                     np.stack([t[c].to_numpy()[order] for c in _BOX], axis=1),
                     np.repeat(label, np.diff(svs.offsets.to_numpy())), svs.values.to_numpy())


def finish(t: pa.Table) -> pa.Table:
    """Supervoxel counts instead of lists; voxels descending, then label."""
    nsv = pc.list_value_length(t["svs"]).cast(pa.int64())
    t = pa.Table.from_arrays([t["label"], t["voxels"], nsv, t["chunks"]] + [t[c] for c in _BOX], schema=STATS_SCHEMA)
    return t.sort_by([("voxels", "descending"), ("label", "ascending")]) if t.num_rows else t


ROWS = Rows("label", PARTIAL_SCHEMA, reduce, finish, 65536)


def run_task(task: ShardTask) -> int:
    """One shard's partial statistics into its partial file; returns their rows."""
    t = shard_body_stats(task.source, scale=task.scale, origin=task.origin, labels=task.labels, box=task.box)
    return write_partial(task.work, task.key, t, ROWS, task.bits)


@dataclass(frozen=True)
class OneFile:
    """A one-file output's last task: the buckets streamed into the file a row group at a time, the
    manifest in its metadata, published whole."""

    table: ByteStore
    bits: int
    folder: ByteStore
    name: str
    manifest: str

    def __str__(self) -> str:
        return self.folder.describe(self.name)


def write_one_file(task: OneFile) -> int:
    schema = STATS_SCHEMA.with_metadata({b"dvidshards": task.manifest.encode()})
    rows = 0
    with task.folder.writer(task.name) as sink, pq.ParquetWriter(sink, schema, compression="zstd") as w:
        for b in range(1 << task.bits):
            with task.table.open(bucket_name(b, task.bits)) as fh:
                f = pq.ParquetFile(fh)
                for g in range(f.num_row_groups):
                    t = f.read_row_group(g).replace_schema_metadata(schema.metadata)
                    w.write_table(t, row_group_size=ROWS.row_group)
                    rows += t.num_rows
    return rows


def body_stats(source: SourceLike, dest: Location, *, scale: int = 0, labels: LabelsLike = "agglomerated",
               box: BoxLike | None = None, spec: Any = None, scheduler: Any = None, workdir: Location | None = None,
               resume: bool = False, overwrite: bool = False, progress: bool | None = None,
               allow_partial: bool = False, partitions: int | None = None, fan_in: int = FAN_IN,
               command: str | None = None) -> JobReport:
    """Per-body statistics of a scale, written by the workers (the client learns row counts).

    Parameters
    ----------
    source : Dataset, path or URL
        The export (``spec``: its neuroglancer spec).
    dest : path, URL (``gs://``, ``s3://``), kvstore spec dict or store
        A folder: ``bucket=HH/part-0.parquet`` (a body in the file of ``bucket_of(label, bits)``,
        voxels descending), ``_meta.json`` and the manifest. Or a ``.parquet`` file: the same rows,
        the manifest in its metadata (``b"dvidshards"``), written only when complete.
    scale, labels, box, scheduler, workdir, resume, overwrite, progress, allow_partial :
        As for every job (:mod:`dvidshards.jobs.options`): a body is the records' agglomerated
        label, a supervoxel, or a mapping's (a file travels as its path); only voxels in the box.
    partitions : int, optional
        Hash buckets of the output (a power of two); default about one per 16 shards.
    fan_in : int
        Partial files merged per reduce task.

    Returns
    -------
    JobReport
        ``totals`` is a :class:`~dvidshards.jobs.buckets.TableTotals`.

    Raises
    ------
    SpecError, OutputError
        Bad input or a destination that cannot be used, before any work.
    JobError
        A shard or reduce step failed and ``allow_partial`` is false: no row written, the partial
        results kept for ``resume``.
    """
    job = table_job("stats", "stats", source, dest, scale=scale, labels=labels, box=box, spec=spec, workdir=workdir,
                    resume=resume, overwrite=overwrite, allow_partial=allow_partial, partitions=partitions,
                    fan_in=fan_in, command=command, one_file=True)
    with TaskRunner(scheduler, progress=progress) as tr:
        if job.out.kind == "file":
            return job.run(tr, run_task, _one_file)
        return job.run(tr, run_task, run_dataset, rows=ROWS, fmt=STATS_FORMAT, what="bodies", partial_ok=False,
                       order=STATS_ORDER, columns=STATS_SCHEMA.names)


def _one_file(job: TableJob, tr: TaskRunner, run_task: Callable[[ShardTask], int], tasks: list[ShardTask]
              ) -> JobReport:
    """The dataset made in the work folder, then streamed into the file on a worker (the client never
    holds the table), the final manifest in its metadata."""
    out, totals = job.out, job.totals
    params = out.parameters
    if out.previous is not None and out.previous.get("complete"):
        return kept(out, totals, allow_partial=job.allow_partial)
    start_work(job.work, params, resume=job.resume, overwrite=job.overwrite)
    table = job.work.child("table")
    got = map_reduce(out, tr, run_task, tasks, rows=ROWS, work=job.work, dest=table, bits=params["bits"],
                     fan_in=job.fan_in, resume=job.resume, partial_ok=False)
    where = out.where
    if got is not None:
        totals.rows = int(sum(got.values()))
        notes = [f"{totals.rows:,} bodies in {totals.partitions} hash buckets from {totals.shards:,} shards, in one "
                 f"file"]
    else:
        notes = [f"nothing written at {where}: partial results kept in {totals.work}"]
    out.update(table=dataset_meta(STATS_FORMAT, job.s, params, totals, {}, order=STATS_ORDER,
                                  columns=STATS_SCHEMA.names))
    failed: list[str] = []

    def publish(manifest: dict) -> None:
        task = OneFile(table, params["bits"], out.folder, out.name, json.dumps(manifest, default=str))
        failed.extend(tr.run(write_one_file, [task], desc="one file").failed.values())

    report = out.finish(totals=totals, notes=notes, allow_partial=True, write=publish)
    if failed:
        report.complete, report.status = False, "incomplete"
        report.failed[where] = failed[0]
        report.notes.append(f"nothing written at {where}: partial results kept in {totals.work}")
    if not report.complete and not job.allow_partial:
        raise JobError(report.summary(), report)
    return report


def body_stats_table(source: SourceLike, *, scale: int = 0, labels: LabelsLike = "agglomerated",
                     box: BoxLike | None = None, spec: Any = None, scheduler: Any = None,
                     workdir: Location | None = None, resume: bool = False, overwrite: bool = False,
                     progress: bool | None = None, partitions: int | None = None, fan_in: int = FAN_IN,
                     max_rows: int = MAX_TABLE_ROWS) -> pa.Table:
    """Per-body statistics as one table in this process (small exports; :func:`body_stats` writes
    any size): the dataset ``WORKDIR/table`` written, read and removed. ``workdir`` (seen by every
    worker) defaults to a temporary folder; ``resume`` finishes an earlier run in it. Other
    parameters as for :func:`body_stats`.

    Returns
    -------
    pyarrow.Table
        ``label, voxels, supervoxels, chunks, x0, y0, z0, x1, y1, z1`` (upper bound exclusive),
        voxels descending, then label; metadata ``b"dvidshards"`` (scale, labels, box).

    Raises
    ------
    JobError
        Shards failed: no table; the partial results stay in ``workdir`` for ``resume=True``.
    SpecError
        Bad input, or more than ``max_rows`` bodies (the message names the complete dataset).
    """
    if resume and workdir is None:
        raise SpecError("resume needs a workdir holding the partial results of the earlier run")
    ds = open_source(source, spec)
    s = ds.scale(scale)
    box = check_box(s, box)
    src = label_source(labels)
    shard_origins(ds, s, box)  # a scale without a folder is refused before a temporary folder is made
    temp = workdir is None
    root = as_store(tempfile.mkdtemp(prefix="dvidshards-stats-") if temp else workdir, writable=True,
                    what="work folder")
    table = root.child("table")
    try:
        report = body_stats(ds, table, scale=s.index, labels=src, box=box, scheduler=scheduler, resume=resume,
                            overwrite=overwrite, progress=progress, allow_partial=True, partitions=partitions,
                            fan_in=fan_in)
    except BaseException:
        if temp:
            remove_work(root)
        raise
    where = root.describe("").rstrip("/")
    if not report.complete:
        first, msg = next(iter(report.failed.items()), ("?", "?"))
        raise JobError(f"body_stats_table: {len(report.failed)} of {report.tasks} tasks failed (first {first}: "
                       f"{msg}); no table. Partial results kept in {where}: call again with workdir= that "
                       f"folder and resume=True", report)
    if report.totals.rows > max_rows:
        raise SpecError(f"body_stats_table: {report.totals.rows} bodies, more than max_rows={max_rows} to return as "
                        f"one table; the complete table is the Parquet dataset {table.describe('').rstrip('/')} "
                        f"(pyarrow.dataset.dataset); body_stats(source, dest) writes it where you want")
    bits = report.totals.partitions.bit_length() - 1
    parts = []
    for b in range(1 << bits):
        with table.open(bucket_name(b, bits)) as f:
            parts.append(pq.read_table(f))
    t = pa.concat_tables(parts).combine_chunks().sort_by([("voxels", "descending"), ("label", "ascending")])
    about = {"scale": s.index, **src.identity(), "box": None if box is None else list(map(list, box))}
    table.delete_prefix_sync("")
    remove_work(root)
    return t.replace_schema_metadata({b"dvidshards": json.dumps(about).encode()})


class StatsCommand:
    """``dvidshards stats EXPORT DEST``: DEST a folder (a Parquet dataset) or a ``.parquet`` file."""

    @staticmethod
    def add_arguments(p) -> None:
        add_arguments(p, what="the statistics: a folder (one Parquet file per hash bucket, plus _meta.json) or a "
                              "file ending in .parquet (the same rows in one file, written only when complete); "
                              "rows are grouped by hash bucket, by voxels (descending) within one")

    @staticmethod
    def main(args) -> int:
        return run_command(body_stats, "stats", args)

