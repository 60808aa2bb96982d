"""DVID's label index of every body at once (``dvidshards label-index EXPORT DEST``): a Parquet
dataset of (body, supervoxel, chunk_x, chunk_y, chunk_z, voxels), read back per body by
:class:`dvidshards.query.BodyIndex` (``serve-dvid --label-index``).

plan, reduce: :mod:`dvidshards.jobs.buckets` (each bucket sorted by body, supervoxel and chunk);
run_task: one shard's rows (:func:`shard_label_index`). A failed shard's rows are missing: the
index is still written, ``"complete": false`` in ``_meta.json`` and the manifest (``BodyIndex``
warns); ``--resume`` adds them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from ..formats.labelindex import INDEX_FORMAT, INDEX_SCHEMA
from .buckets import (
    FAN_IN,
    BoxLike,
    LabelsLike,
    Location,
    Rows,
    ShardTask,
    SourceLike,
    add_arguments,
    open_source,
    run_command,
    run_dataset,
    runs,
    shard_rows,
    table_job,
    write_partial,
)
from .output import JobReport
from .runner import TaskRunner

__all__ = ["LabelIndexCommand", "label_index", "reduce", "run_task", "shard_label_index"]


def shard_label_index(source: SourceLike, *, scale: int, origin: tuple[int, int, int],
                      labels: LabelsLike = "agglomerated", box: BoxLike | None = None) -> pa.Table:
    """Label-index rows of one shard (``INDEX_SCHEMA``: body, supervoxel, chunk_x, chunk_y, chunk_z,
    voxels), one per supervoxel per chunk (its voxels inside ``box``), sorted by body, supervoxel, chunk."""
    rec, sv, body, vox, _, coords = shard_rows(open_source(source, None), scale, origin, labels, box)
    order = np.lexsort((rec, sv, body))
    rec, sv, body, vox = rec[order], sv[order], body[order], vox[order]
    starts = runs([body, sv, rec])  # a label listed twice in one block: one row
    if len(starts) != len(rec):
        vox = np.add.reduceat(vox, starts)
        rec, sv, body = rec[starts], sv[starts], body[starts]
    c = coords[rec].astype(np.int32) if len(rec) else np.zeros((0, 3), np.int32)
    return pa.Table.from_arrays(
        [pa.array(body, pa.uint64()), pa.array(sv, pa.uint64()), pa.array(c[:, 0]), pa.array(c[:, 1]),
         pa.array(c[:, 2]), pa.array(vox, pa.int64())], schema=INDEX_SCHEMA)


def reduce(tables: list[pa.Table]) -> pa.Table:
    """Rows of the same buckets from different shards: together (a body's rows differ by chunk)."""
    tables = [t for t in tables if t.num_rows]
    return pa.concat_tables(tables) if tables else INDEX_SCHEMA.empty_table()


def finish(t: pa.Table) -> pa.Table:
    if not t.num_rows:
        return t
    return t.sort_by([("body", "ascending"), ("supervoxel", "ascending"), ("chunk_z", "ascending"),
                      ("chunk_y", "ascending"), ("chunk_x", "ascending")])


ROWS = Rows("body", INDEX_SCHEMA, reduce, finish, 32768)


def run_task(task: ShardTask) -> int:
    """One shard's rows into its partial file; returns their count."""
    t = shard_label_index(task.source, scale=task.scale, origin=task.origin, labels=task.labels, box=task.box)
    return write_partial(task.work, task.key, t, ROWS, task.bits)


def label_index(source: SourceLike, dest: Location, *, scale: int = 0, labels: LabelsLike = "agglomerated",
                box: BoxLike | None = None, spec: Any = None, scheduler: Any = None, workdir: Location | None = None,
                resume: bool = False, overwrite: bool = False, progress: bool | None = None,
                allow_partial: bool = False, partitions: int | None = None, fan_in: int = FAN_IN,
                command: str | None = None) -> JobReport:
    """Write the label index of a scale (of the voxels inside ``box``) as a Parquet dataset.

    ``dest`` (a folder, ``gs://``, ``s3://``, a kvstore spec or a store) gets ``bucket=HH/part-0.parquet``
    (a body's rows in the file of ``bucket_of(body, bits)``), ``_meta.json`` (last) and the manifest,
    which :class:`dvidshards.query.BodyIndex` reads. Parameters, returns and errors as
    :func:`dvidshards.jobs.stats.body_stats`, but failed shards' rows go missing (``resume`` adds them).
    """
    job = table_job("label-index", "index", source, dest, scale=scale, labels=labels, box=box, spec=spec,
                    workdir=workdir, resume=resume, overwrite=overwrite, allow_partial=allow_partial,
                    partitions=partitions, fan_in=fan_in, command=command)
    with TaskRunner(scheduler, progress=progress) as tr:
        return job.run(tr, run_task, run_dataset, rows=ROWS, fmt=INDEX_FORMAT, what="rows", partial_ok=True)


class LabelIndexCommand:
    """``dvidshards label-index EXPORT DEST``."""

    @staticmethod
    def add_arguments(p) -> None:
        add_arguments(p, what="the label index: a folder (one Parquet file per hash bucket, plus _meta.json)")

    @staticmethod
    def main(args) -> int:
        return run_command(label_index, "label-index", args)
