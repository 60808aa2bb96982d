"""Per-body statistics and a label index of a whole export: plan → tasks → reduce.

Both jobs read every record of a scale once, decompress its block and count it with the
``blockstats`` kernel (no voxel is written). Per chunk that gives, per entry of the block
label list, (supervoxel, body, voxels, exact voxel box); bodies come from the records'
agglomerated lists, the supervoxels themselves or a mapping.

* :func:`write_body_stats` (``dvidshards stats EXPORT DEST``) - per body: voxels, supervoxels,
  chunks and bounding box (DVID's ``/sizes``, neuclease's ``fetch_sizes``), as a Parquet dataset
  (``DEST/bucket=HH/part-0.parquet`` and ``DEST/_meta.json``) or, for a ``DEST`` ending in
  ``.parquet``, one file assembled on a worker whose Parquet metadata carries the job's manifest.
  :func:`body_stats` returns the same rows as a table, for small exports.
* :func:`label_index` (``dvidshards label-index EXPORT DEST``) - a Parquet dataset of (body,
  supervoxel, chunk_x, chunk_y, chunk_z, voxels): DVID's ``LabelIndex`` for every body at once,
  read back with :class:`dvidshards.query.BodyIndex` (its ``_meta.json`` describes the dataset).

The job, as igneous cuts one:

1. **plan** - the shards of the scale (inside the box), the hash partition of the bodies
   (``bits``), the work folder;
2. **tasks** - one per shard (:func:`shard_body_stats`, :func:`shard_label_index`: plain
   ``(dataset, scale, shard origin) -> pyarrow.Table`` calls), each writing its partial result
   to the work folder as an Arrow IPC file of one record batch per hash bucket (temporary name,
   then a rename: a failed task leaves nothing);
3. **reduce** - groups of ``fan_in`` files merge into one, level by level, a bucket group at a
   time; then one task per bucket merges its rows and writes ``bucket=HH/part-0.parquet``.

Every phase runs in one :class:`dvidshards.jobs.runner.TaskRunner` (serially, on threads or on
one dask cluster). No task holds more than one shard or one bucket group, and the client holds
only the list of shards and per-task row counts, whatever the number of bodies.

Where the output goes is :mod:`dvidshards.jobs.output`'s concern: ``DEST`` is a path, ``gs://``,
``s3://`` or a kvstore spec, checked (and a bucket probed) before any work; it is locked while
the job runs, holds the manifest ``_dvidshards.json`` (``complete: false`` until done; a one-file
output carries it in its Parquet metadata and is written only when complete), and is refused
unless empty, or this job's own earlier output with ``resume`` or ``overwrite``. The work folder
(:class:`dvidshards.jobs.workdir.WorkDir`: a path or a bucket, visible to every worker) is by
default ``DEST.work`` beside the output, never inside it; it is locked too, kept while the output
is incomplete (``resume`` skips the shards whose partial file exists) and removed after a complete
run. A statistics output with a failed shard holds no rows (its manifest lists the failed shards);
a label index is reduced without them and says ``"complete": false`` in its ``_meta.json`` and its
manifest. Either way the job raises :class:`~dvidshards.errors.JobError` carrying the
:class:`~dvidshards.jobs.output.JobReport` unless ``allow_partial=True``.

Background (label 0) is not reported: absent chunks hold it implicitly.
"""

from __future__ import annotations

import functools
import json
import tempfile
import warnings
from dataclasses import asdict, dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..dataset import Dataset
from ..errors import BlockDecodeError, JobError, OutputError, ShardFormatError, SpecError
from ..formats.arrowipc import R_NLAB, R_NSV
from ..formats.blockstats import BlockError, batch_stats
from ..formats.labelindex import INDEX_FORMAT, INDEX_SCHEMA, bucket_name, bucket_of, labels_id
from ..formats.labels import Agglomerated, Mapped, Supervoxels, as_labels
from ..formats.records import list_values
from .options import (
    add_box,
    add_dest,
    add_job_options,
    add_labels,
    add_scale,
    add_source,
    command_line,
    dest_of,
    job_options,
    renamed,
)
from .output import LOCK, Destination, JobReport, Output
from .runner import TaskRunner
from .workdir import WorkDir

__all__ = [
    "FAN_IN",
    "INDEX_SCHEMA",
    "MAX_TABLE_ROWS",
    "STATS_FORMAT",
    "STATS_ORDER",
    "STATS_SCHEMA",
    "JobError",
    "LabelIndexCommand",
    "StatsCommand",
    "TableTotals",
    "body_stats",
    "bucket_of",
    "label_index",
    "shard_body_stats",
    "shard_label_index",
    "write_body_stats",
]

#: the kernels a shard task uses, slowest to compile first (TaskRunner.run compiles them first)
KERNELS = ("dvidshards.formats.blockstats._batch_kernel", "dvidshards.formats.arrowipc._resolve",
           "dvidshards.formats.arrowipc._message", "dvidshards.formats.mapping._apply")

FAN_IN = 64  # partial files merged by one reduce task
_COARSE_BITS = 6  # record batches of the shard partials when they are merged in a tree

_BOX = ("x0", "y0", "z0", "x1", "y1", "z1")
STATS_SCHEMA = pa.schema(
    [("label", pa.uint64()), ("voxels", pa.int64()), ("supervoxels", pa.int64()),
     ("chunks", pa.int64())] + [(c, pa.int64()) for c in _BOX]
)
# a body's partial statistics: its supervoxels as a list, so that merges can count distinct ones
_PARTIAL_SCHEMA = pa.schema(
    [("label", pa.uint64()), ("voxels", pa.int64()), ("chunks", pa.int64())]
    + [(c, pa.int64()) for c in _BOX] + [("svs", pa.large_list(pa.uint64()))]
)


# --------------------------------------------------------------------------- one shard


def _dataset(source):
    return source if isinstance(source, Dataset) else Dataset(source)


def _crop(s, box):
    """Voxel [lo, hi) of the volume, or of ``box`` (which must lie inside it)."""
    if box is not None:
        return s.check_box(box)  # SpecError for a box not inside the volume
    lo = np.asarray(s.voxel_offset, np.int64)
    return lo, lo + np.asarray(s.size, np.int64)


_BATCH = 512  # records decompressed and counted together


def _chunk_rows(ds, scale, origin, labels, box):
    """Per chunk of one shard, per block-label entry holding voxels: the raw rows.

    Returns (record, supervoxel, body, voxels, boxes (n, 6) absolute, coords (records, 3)).
    Memory: the shard and one batch of decompressed blocks.
    """
    s = ds.scale(scale)
    src = as_labels(labels)
    t = ds.shard(s, origin).table()
    coords = np.asarray(t.coords, np.int64)
    cs = np.asarray(s.chunk_size, np.int64)
    vlo, vhi = _crop(s, box)
    org = coords * cs
    lo = np.clip(vlo - org, 0, cs)
    hi = np.clip(vhi - org, 0, cs)
    todo = np.flatnonzero((hi > lo).all(axis=1))
    nsv = np.ascontiguousarray(t.rec[:, R_NSV])
    parts = []
    for k in range(0, len(todo), _BATCH):
        idx = todo[k:k + _BATCH]
        blocks = [t.block(int(i)) for i in idx]  # zstd: sizes and checksum checked, typed errors
        offs = np.zeros(len(idx) + 1, np.int64)
        np.cumsum([len(b) for b in blocks], out=offs[1:])
        buf = np.frombuffer(b"".join(blocks), np.uint8)
        try:
            blk, ent, sv, vox, bx = batch_stats(buf, offs, lo[idx], hi[idx], nsv[idx])
        except BlockError as e:
            kind = ShardFormatError if e.list_mismatch else BlockDecodeError
            raise kind(f"{t.where(int(idx[e.index]))}: {e}") from None
        rec = idx[blk]
        bx += np.hstack([org, org])[rec]
        parts.append((rec, ent, sv, vox, bx))
    if not parts:
        z = np.zeros(0, np.int64)
        return z, z.astype(np.uint64), z.astype(np.uint64), z, np.zeros((0, 6), np.int64), coords
    rec, ent, sv, vox, boxes = (np.concatenate([p[j] for p in parts]) for j in range(5))
    if isinstance(src, Supervoxels):
        body = sv
    elif isinstance(src, Agglomerated):
        flat, _ = list_values(t, "labels")
        first = np.zeros(len(t), np.int64)
        np.cumsum(t.rec[:-1, R_NLAB], out=first[1:])
        body = flat[first[rec] + ent]
    elif isinstance(src, Mapped):
        body = np.asarray(src.mapping.palette(sv), np.uint64)
    else:  # another LabelSource: its palette per record
        pal = {int(i): src.palette(t, int(i)) for i in np.unique(rec)}
        body = np.array([sv[j] if (p := pal[r]) is None else p[e] for j, (r, e) in
                         enumerate(zip(rec.tolist(), ent.tolist(), strict=True))], np.uint64)
    nz = body != 0
    if not nz.all():
        rec, sv, body, vox, boxes = rec[nz], sv[nz], body[nz], vox[nz], boxes[nz]
    return rec, sv, body, vox, boxes, coords


def _runs(keys: list[np.ndarray]) -> np.ndarray:
    """Start of each run of equal rows in sorted key columns (empty for no rows)."""
    n = len(keys[0])
    if not n:
        return np.zeros(0, np.int64)
    new = np.zeros(n, bool)
    new[0] = True
    for k in keys:
        new[1:] |= k[1:] != k[:-1]
    return np.flatnonzero(new)


def _list_column(owner_starts: np.ndarray, values: np.ndarray, n: int) -> pa.Array:
    offsets = np.append(owner_starts, len(values)).astype(np.int64)
    assert len(offsets) == n + 1
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values, pa.uint64()))


def _stats_table(label, voxels, chunks, boxes, pair_label, pair_sv) -> pa.Table:
    """A partial-statistics table; (pair_label, pair_sv) sorted by label, then sv, unique."""
    n = len(label)
    starts = np.searchsorted(pair_label, label, side="left")
    cols = [pa.array(label, pa.uint64()), pa.array(voxels, pa.int64()), pa.array(chunks, pa.int64())]
    cols += [pa.array(boxes[:, k], pa.int64()) for k in range(6)]
    cols.append(_list_column(starts, pair_sv, n))
    return pa.Table.from_arrays(cols, schema=_PARTIAL_SCHEMA)


def shard_body_stats(source, scale, origin, labels="agglomerated", box=None) -> pa.Table:
    """Partial body statistics of one shard (the per-shard task of :func:`body_stats`).

    Parameters
    ----------
    source : Dataset or anything ``Dataset`` opens
        The export (a ``Dataset`` pickles: send it to workers).
    scale : int
        Folder number.
    origin : (x, y, z)
        Voxel origin of the shard.
    labels : "agglomerated", "supervoxels" or a mapping
        What a body is.
    box : [[x0, y0, z0], [x1, y1, z1]], optional
        Count only voxels inside this box.

    Returns
    -------
    pyarrow.Table
        One row per body: ``label, voxels, chunks, x0, y0, z0, x1, y1, z1`` and ``svs`` (its
        sorted distinct supervoxels here), sorted by label.

    Raises
    ------
    DvidShardsError
        Typed errors of the shard or of a record, naming the file and chunk.
    """
    ds = _dataset(source)
    rec, sv, body, vox, boxes, _ = _chunk_rows(ds, scale, origin, labels, box)
    order = np.lexsort((rec, body))
    rec, body, vox, boxes = rec[order], body[order], vox[order], boxes[order]
    starts = _runs([body])
    if not len(starts):
        return _PARTIAL_SCHEMA.empty_table()
    voxels = np.add.reduceat(vox, starts)
    lo = np.minimum.reduceat(boxes[:, :3], starts, axis=0)
    hi = np.maximum.reduceat(boxes[:, 3:], starts, axis=0)
    first = np.zeros(len(body), np.int64)  # 1 on a body's first row in each chunk
    first[_runs([body, rec])] = 1
    chunks = np.add.reduceat(first, starts)
    ps = np.lexsort((sv[order], body))
    pb, pv = body[ps], sv[order][ps]
    keep = _runs([pb, pv])
    return _stats_table(body[starts], voxels, chunks, np.hstack([lo, hi]), pb[keep], pv[keep])


def shard_label_index(source, scale, origin, labels="agglomerated") -> pa.Table:
    """Label-index rows of one shard (the per-shard task of :func:`label_index`).

    Returns
    -------
    pyarrow.Table
        ``INDEX_SCHEMA`` rows (body, supervoxel, chunk_x, chunk_y, chunk_z, voxels), one per
        supervoxel per chunk, sorted by body, supervoxel, chunk.
    """
    ds = _dataset(source)
    rec, sv, body, vox, _, coords = _chunk_rows(ds, scale, origin, labels, None)
    order = np.lexsort((rec, sv, body))
    rec, sv, body, vox = rec[order], sv[order], body[order], vox[order]
    starts = _runs([body, sv, rec])  # a label listed twice in one block: one row
    if len(starts) != len(rec):
        vox = np.add.reduceat(vox, starts)
        rec, sv, body = rec[starts], sv[starts], body[starts]
    c = coords[rec].astype(np.int32) if len(rec) else np.zeros((0, 3), np.int32)
    return pa.Table.from_arrays(
        [pa.array(body, pa.uint64()), pa.array(sv, pa.uint64()), pa.array(c[:, 0]), pa.array(c[:, 1]),
         pa.array(c[:, 2]), pa.array(vox, pa.int64())], schema=INDEX_SCHEMA)


# --------------------------------------------------------------------------- merging


def _merge_stats(tables: list[pa.Table]) -> pa.Table:
    """Partial statistics of the same bodies from different shards, combined."""
    tables = [t for t in tables if t.num_rows]
    if not tables:
        return _PARTIAL_SCHEMA.empty_table()
    if len(tables) == 1:
        return tables[0]
    t = pa.concat_tables(tables).combine_chunks()
    label = t["label"].to_numpy()
    order = np.argsort(label, kind="stable")
    label = label[order]
    starts = _runs([label])
    voxels = np.add.reduceat(t["voxels"].to_numpy()[order], starts)
    chunks = np.add.reduceat(t["chunks"].to_numpy()[order], starts)
    box = np.stack([t[c].to_numpy()[order] for c in _BOX], axis=1)
    lo = np.minimum.reduceat(box[:, :3], starts, axis=0)
    hi = np.maximum.reduceat(box[:, 3:], starts, axis=0)
    svs = t["svs"].combine_chunks()
    off = svs.offsets.to_numpy()
    vals = svs.values.to_numpy()
    owner = np.repeat(t["label"].to_numpy(), np.diff(off))
    ps = np.lexsort((vals, owner))
    pb, pv = owner[ps], vals[ps]
    keep = _runs([pb, pv])
    return _stats_table(label[starts], voxels, chunks, np.hstack([lo, hi]), pb[keep], pv[keep])


def _merge_index(tables: list[pa.Table]) -> pa.Table:
    tables = [t for t in tables if t.num_rows]
    if not tables:
        return INDEX_SCHEMA.empty_table()
    return pa.concat_tables(tables)


def _finish_stats(t: pa.Table) -> pa.Table:
    """Final statistics from merged partials: supervoxel counts instead of lists."""
    nsv = pc.list_value_length(t["svs"]).cast(pa.int64())
    cols = [t["label"], t["voxels"], nsv, t["chunks"]] + [t[c] for c in _BOX]
    return pa.Table.from_arrays(cols, schema=STATS_SCHEMA)


def _finish_index(t: pa.Table) -> pa.Table:
    if not t.num_rows:
        return t
    return t.sort_by([("body", "ascending"), ("supervoxel", "ascending"), ("chunk_z", "ascending"),
                      ("chunk_y", "ascending"), ("chunk_x", "ascending")])


_KIND = {
    "stats": ("label", _PARTIAL_SCHEMA, _merge_stats),
    "index": ("body", INDEX_SCHEMA, _merge_index),
}


# --------------------------------------------------------------------------- partial files


_IPC = pa.ipc.IpcWriteOptions(compression="zstd")


def _empty_batch(schema: pa.Schema) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays([pa.array([], f.type) for f in schema], schema=schema)


def _write_partial(work: WorkDir, rel: str, tables, kind: str, bits: int) -> int:
    """Write a partial file: an Arrow IPC file of exactly ``2**bits`` record batches, batch ``b``
    holding the rows of bucket ``b`` (``bucket_of(key, bits)``). Returns the rows written.

    ``tables`` is a table or an iterable of tables whose buckets come in order (a merge
    writes its groups in order); they are written one at a time. The footer locates every
    batch, so a reader fetches one bucket without reading the others.
    """
    key, schema, _ = _KIND[kind]
    if isinstance(tables, pa.Table):
        tables = [tables]
    empty = _empty_batch(schema)
    head = schema.with_metadata({b"dvidshards": json.dumps({"bits": bits}).encode()})
    rows = 0

    def write(sink) -> None:
        nonlocal rows
        nxt = 0
        with pa.ipc.new_file(sink, head, options=_IPC) as w:
            for table in tables:
                if not table.num_rows:
                    continue
                b = bucket_of(table[key].to_numpy(), bits)
                if (np.diff(b) < 0).any():
                    order = np.argsort(b, kind="stable")
                    table, b = table.take(order), b[order]
                first, last = int(b[0]), int(b[-1])
                if first < nxt:
                    raise ValueError(f"{rel}: the tables of a partial file must come in bucket order")
                for _ in range(nxt, first):
                    w.write_batch(empty)
                bounds = np.searchsorted(b, np.arange(first, last + 2))
                for k in range(last - first + 1):
                    n = int(bounds[k + 1] - bounds[k])
                    part = table.slice(int(bounds[k]), n).combine_chunks() if n else None
                    w.write_batch(part.to_batches()[0] if part is not None else empty)
                nxt = last + 1
                rows += table.num_rows
            for _ in range(nxt, 1 << bits):
                w.write_batch(empty)

    work.write_with(rel, write)
    return rows


class _Partial:
    """A partial file opened for reading buckets: its footer read, batches fetched on demand."""

    def __init__(self, work: WorkDir, rel: str, kind: str):
        self.kind = kind
        where = work.describe(rel)
        self.file = work.open_input(rel)  # a real file locally (random access)
        try:
            self.reader = pa.ipc.open_file(self.file)
            self.bits = int(json.loads(self.reader.schema.metadata[b"dvidshards"])["bits"])
            if self.reader.num_record_batches != 1 << self.bits:
                raise ValueError(f"{self.reader.num_record_batches} record batches, expected {1 << self.bits}")
        except (pa.ArrowInvalid, KeyError, TypeError, ValueError) as e:
            self.file.close()
            raise ShardFormatError(f"{where}: not a partial-result file of this job ({e})") from None

    def bucket(self, bits: int, b: int) -> pa.Table:
        """The rows of bucket ``b`` of a ``bits``-bit partition."""
        key, schema, _ = _KIND[self.kind]
        fb = self.bits
        if fb >= bits:
            idx = range(b << (fb - bits), (b + 1) << (fb - bits))
        else:  # a coarser file: the batch holding the bucket, then its rows
            idx = range(b >> (bits - fb), (b >> (bits - fb)) + 1)
        t = pa.Table.from_batches([self.reader.get_batch(i) for i in idx]).replace_schema_metadata(None)
        if fb < bits and t.num_rows:
            t = t.filter(pa.array(bucket_of(t[key].to_numpy(), bits) == b))
        return t

    def close(self) -> None:
        self.file.close()


def _open_partials(work: WorkDir, rels, kind: str) -> list[_Partial]:
    parts: list[_Partial] = []
    try:
        for rel in rels:
            parts.append(_Partial(work, rel, kind))
    except BaseException:
        for p in parts:
            p.close()
        raise
    return parts


# --------------------------------------------------------------------------- tasks


@dataclass(frozen=True)
class _Job:
    """The parameters every task of a job carries (small: locations and options, no data)."""

    ds: object
    scale: int
    labels: object  # "agglomerated", "supervoxels", or a LabelSource (a mapping file travels as its path)
    box: tuple | None
    kind: str  # "stats" or "index"
    work: WorkDir
    bits: int  # final partition bits
    shard_bits: int  # batches of the shard partials (coarser when a merge tree follows)
    dest: Destination | None = None  # where the final buckets go


def _shard_rel(origin) -> str:
    return f"shards/{origin[0]}_{origin[1]}_{origin[2]}.arrow"


def _shard_task(job: _Job, origin) -> int:
    """Map: one shard's partial result into the work folder."""
    if job.kind == "stats":
        t = shard_body_stats(job.ds, job.scale, origin, job.labels, job.box)
    else:
        t = shard_label_index(job.ds, job.scale, origin, job.labels)
    return _write_partial(job.work, _shard_rel(origin), t, job.kind, job.shard_bits)


def _merge_task(job: _Job, item) -> int:
    """Reduce, one tree node: item = (level, k, input files) -> file ``L{level}/{k}.arrow``."""
    level, k, inputs = item
    _, _, merge = _KIND[job.kind]
    parts = _open_partials(job.work, inputs, job.kind)
    try:
        in_bits = min(p.bits for p in parts)
        # one input bucket group at a time, merged and written before the next is read
        groups = (merge([p.bucket(in_bits, g) for p in parts]) for g in range(1 << in_bits))
        return _write_partial(job.work, f"L{level}/{k:06d}.arrow", groups, job.kind, job.bits)
    finally:
        for p in parts:
            p.close()


_STATS_ROW_GROUP = 65536
_INDEX_ROW_GROUP = 32768


def _final_task(job: _Job, inputs, bucket: int) -> int:
    """Reduce, last step: one output bucket from the last level's files, as Parquet."""
    _, _, merge = _KIND[job.kind]
    parts = _open_partials(job.work, inputs, job.kind)
    try:
        t = merge([p.bucket(job.bits, bucket) for p in parts])
    finally:
        for p in parts:
            p.close()
    if job.kind == "stats":
        t = _finish_stats(t)
        if t.num_rows:
            t = t.sort_by([("voxels", "descending"), ("label", "ascending")])
        size = _STATS_ROW_GROUP
    else:
        t = _finish_index(t)
        size = _INDEX_ROW_GROUP
    assert job.dest is not None
    job.dest.write_with(bucket_name(bucket, job.bits),
                        lambda f: pq.write_table(t, f, compression="zstd", row_group_size=size))
    return t.num_rows


def _assemble_task(src: WorkDir, bits: int, folder: Destination, manifest: str, name: str) -> int:
    """Stream the bucket files of a statistics dataset into one Parquet file ``name`` in
    ``folder``, a row group at a time, with the job's manifest in its metadata (written under a
    temporary name and renamed when complete)."""
    schema = STATS_SCHEMA.with_metadata({b"dvidshards": manifest.encode()})
    rows = 0

    def write(sink) -> None:
        nonlocal rows
        with pq.ParquetWriter(sink, schema, compression="zstd") as w:
            for b in range(1 << bits):
                with src.open_input(bucket_name(b, bits)) as fh:
                    f = pq.ParquetFile(fh)
                    for g in range(f.num_row_groups):
                        t = f.read_row_group(g).replace_schema_metadata(schema.metadata)
                        w.write_table(t, row_group_size=_STATS_ROW_GROUP)
                        rows += t.num_rows

    folder.write_with(name, write)
    return rows


# --------------------------------------------------------------------------- planning


WORK_FORMAT = "dvidshards-job-work"
WORK_RECORD = "work.json"  # what the partial results in a work folder were made with
STATS_FORMAT = "dvidshards-body-stats"
META = "_meta.json"  # the dataset's own description (read by dvidshards.query.BodyIndex)
_HASH = "top bits of (body * 0x9E3779B97F4A7C15 mod 2**64) >> 48"
STATS_ORDER = "grouped by hash bucket of the label (bucket_of(label, bits)); in a bucket, voxels descending, then label"
MAX_TABLE_ROWS = 1 << 22  # body_stats returns at most this many rows as one table (~350 MB)


@dataclass
class TableTotals:
    """A statistics or label-index job's own figures (``JobReport.totals``).

    Attributes
    ----------
    rows : int
        Rows written: bodies (statistics) or (body, supervoxel, chunk) rows (label index).
    shards : int
        Shards of the scale (inside the box).
    partitions : int
        Hash buckets of the output.
    work : str
        The work folder (kept while the output is incomplete).
    """

    rows: int = 0
    shards: int = 0
    partitions: int = 0
    work: str = ""

    def to_json(self) -> dict:
        return asdict(self)


def _default_bits(n_shards: int) -> int:
    # about 16 shards' worth of rows per output bucket
    return int(min(12, max(0, int(np.ceil(np.log2(max(n_shards, 1) / 16))))))


def _partition_bits(partitions: int) -> int:
    p = int(partitions)
    if p < 1 or p & (p - 1) or p > 1 << 12:
        raise SpecError(f"partitions must be a power of two in 1..4096, got {partitions!r}")
    return p.bit_length() - 1


def _bits(origins, partitions, fan_in: int) -> int:
    if fan_in < 2:
        raise SpecError(f"fan_in must be at least 2, got {fan_in}")
    return _default_bits(len(origins)) if partitions is None else _partition_bits(partitions)


def _check_box(s, box):
    """The box as a tuple of two corners, inside the scale's volume (SpecError otherwise)."""
    if box is None:
        return None
    lo, hi = s.check_box(box)
    return (tuple(int(v) for v in lo), tuple(int(v) for v in hi))


def _origins(ds, s, box) -> list[tuple[int, int, int]]:
    """The shards to read: every shard of the scale, or those overlapping the box."""
    origins = [(int(o[0]), int(o[1]), int(o[2])) for o in ds.shards(s)]
    if not origins:
        _check_folder(ds, s)
    if box is None:
        return origins
    lo, hi = _crop(s, box)
    cs = np.asarray(s.chunk_size, np.int64)
    keep = []
    for o in origins:
        a, b = s.shard_box(o)
        if ((a * cs < hi) & (b * cs > lo)).all():
            keep.append(o)
    return keep


def _check_folder(ds, s) -> None:
    """A scale the spec lists but whose folder the export lacks is an error, not an empty table."""
    lister = getattr(ds.store, "list_sync", None)
    if lister is None:
        return
    try:
        names = lister("")
    except Exception:  # noqa: BLE001 - a store that cannot list its root: nothing to check here
        return
    if s.folder not in {n.rstrip("/") for n in names}:
        raise SpecError(f"{ds.store.describe(s.folder)}: scale {s.index} is in the spec but the export has no "
                        f"folder {s.folder}/")


def _labels_arg(labels):
    """What the tasks get: a name or a label source. A mapping file is checked here without being
    held in this process (``Mapped.prepare``) and travels by reference: each worker loads it once."""
    src = as_labels(labels)
    if isinstance(src, (Agglomerated, Supervoxels)):
        return src.name
    prepare = getattr(src, "prepare", None)
    if prepare is not None:
        prepare()
    return src


def _labels_identity(labels) -> dict:
    return {"labels": labels} if isinstance(labels, str) else labels_id(labels)


def _ident(kind: str, s, box, labels_ident: dict, bits: int) -> dict:
    """What decides the content of the output and of the partial results (JSON as stored)."""
    return json.loads(json.dumps({"kind": kind, "scale": s.index,
                                  "box": None if box is None else [list(box[0]), list(box[1])],
                                  "chunk_size": list(s.chunk_size), **labels_ident, "bits": bits}))


def _meta(fmt: str, s, ident: dict, bits: int, totals: TableTotals, failed: dict, **more) -> dict:
    """The dataset's ``_meta.json`` (keys read by ``BodyIndex``: unchanged)."""
    labels = {k: v for k, v in ident.items() if k not in ("kind", "scale", "box", "chunk_size", "bits")}
    return {"format": fmt, "version": 1, "scale": s.index, **labels, "bits": bits, "hash": _HASH,
            "chunk_size": list(s.chunk_size), "voxel_offset": list(s.voxel_offset), "size": list(s.size),
            **more, "rows": totals.rows, "shards": totals.shards, "complete": not failed,
            "failed_shards": dict(failed), "job": ident}


def _beside(dest: Destination, suffix: str) -> WorkDir:
    """The default work folder: ``DEST<suffix>`` beside the output (never inside it)."""
    parent, name = dest.parent_and_name()
    if not name:
        raise OutputError(f"{dest.describe()}: give the output a name (a folder or file under the root), or "
                          f"--workdir")
    return WorkDir.of(parent.child(name + suffix))


def _own_work(names) -> list[str]:
    return [n for n in names if n != LOCK and not n.startswith(".")]


def _check_work(work: WorkDir, ident: dict, resume: bool, overwrite: bool) -> None:
    """A work folder (locked by now) is new, empty or holds this job's partial results: then it
    needs ``resume`` (the same parameters) or ``overwrite`` (cleared first)."""
    names = _own_work(work.list())
    if names:
        try:
            rec = work.read_json(WORK_RECORD) if WORK_RECORD in names else None
        except OutputError:
            rec = None
        if not isinstance(rec, dict) or rec.get("format") != WORK_FORMAT:
            raise OutputError(f"work folder {work.describe()}: not empty and not a dvidshards work folder (holds "
                              f"{', '.join(names[:3])}); give a new or empty one")
        if overwrite:
            _clear_work(work)
        elif not resume:
            raise OutputError(f"work folder {work.describe()}: holds the partial results of an earlier run; "
                              f"--resume to finish it, --overwrite to start again")
        elif rec.get("job") != ident:
            raise OutputError(f"work folder {work.describe()}: its partial results were made with other parameters "
                              f"({rec.get('job')}); run with the same ones, or --overwrite")
    work.write_json(WORK_RECORD, {"format": WORK_FORMAT, "job": ident})


def _clear_work(work: WorkDir) -> None:
    """Delete this library's files from a work folder (not the folder, nor its lock)."""
    for name in _own_work(work.list()):
        if name in ("shards", "table", WORK_RECORD) or (name[:1] == "L" and name[1:].isascii() and name[1:].isdigit()):
            work.rmtree(name)


def _remove_work(work: WorkDir) -> None:
    """After a complete run (its lock released): the partial results go, and the folder when
    nothing else is in it."""
    _clear_work(work)
    if work.local:
        if not work.list():
            try:
                work.rmtree()
            except OutputError:
                pass


def _check_shared(tr: TaskRunner, *folders: Destination) -> None:
    """With a cluster whose workers run elsewhere: every local folder must be visible to them,
    checked before the job touches anything (a folder made for the check is removed again)."""
    import os

    for d in folders:
        if not d.local:
            continue
        path = d.local_path().rstrip("/") or "/"
        made = not os.path.exists(path)
        try:
            tr.check_shared(path)
        except BaseException:
            if made:
                try:
                    os.rmdir(path)
                except OSError:
                    pass
            raise


# --------------------------------------------------------------------------- reduce


def _phase(out: Output, tr: TaskRunner, fn, items, desc: str, name=str) -> dict | None:
    """A reduce phase: its failed tasks run once more (a lost worker); counted into the report.
    Returns ``{item: result}``, or None when some still failed (the job stops there)."""
    r = tr.run(fn, items, desc=desc)
    if r.failed:
        again = tr.run(fn, list(r.failed), desc=f"{desc} (retry)")
        r.results.update(again.results)
        r.failed = again.failed
        r.task_cpu += again.task_cpu
    out.add(r, name=name)
    return None if r.failed else r.results


def _map_reduce(out: Output, tr: TaskRunner, job: _Job, origins, resume: bool, fan_in: int,
                shard_name) -> dict | None:
    """Map every shard to a partial file, reduce them as a tree, write the final buckets.

    For statistics a failed shard stops the job before the reduce (no row is written); the
    label index is reduced without it. Returns ``{bucket: rows}``, or None when nothing was
    written.
    """
    work = job.work
    done: set = set()
    if resume:
        names = set(work.list("shards"))
        done = {o for o in origins if _shard_rel(o).split("/")[1] in names}
    rep = tr.run(functools.partial(_shard_task, job), origins, desc=f"s{job.scale} shards", done=done,
                 kernels=KERNELS)
    out.add(rep, name=shard_name)
    if rep.failed and job.kind == "stats":
        return None
    files = [_shard_rel(o) for o in origins if o in rep.results or o in done]
    level = 0
    while len(files) > fan_in:  # the reduce tree
        level += 1
        work.rmtree(f"L{level}")
        groups = [(level, k, tuple(files[i:i + fan_in])) for k, i in enumerate(range(0, len(files), fan_in))]
        if _phase(out, tr, functools.partial(_merge_task, job), groups, f"merge level {level}",
                  name=lambda g: f"merge level {g[0]}, group {g[1]}") is None:
            return None
        files = [f"L{level}/{g[1]:06d}.arrow" for g in groups]
    return _phase(out, tr, functools.partial(_final_task, job, tuple(files)), list(range(1 << job.bits)),
                  "buckets", name=lambda b: f"bucket {b}")


# --------------------------------------------------------------------------- old spellings


def _old_positional(job: str, args: tuple, names: tuple, given: dict, defaults: dict) -> dict:
    """Arguments once given by position after the old leading ones (one release, with a warning)."""
    if not args:
        return given
    if len(args) > len(names):
        raise TypeError(f"{job}() takes at most {len(names)} arguments after source and dest by position in its "
                        f"old form; give them by keyword")
    used = names[:len(args)]
    warnings.warn(f"{job}(..., {', '.join(used)}) by position is now {job}(..., "
                  f"{', '.join(f'{n}=...' for n in used)}) (the old form goes in the next release)",
                  DeprecationWarning, stacklevel=3)
    out = dict(given)
    for n, v in zip(used, args, strict=True):
        if given[n] is not defaults[n] and given[n] != defaults[n]:
            raise TypeError(f"{job}() got {n} twice (by position and by keyword)")
        out[n] = v
    return out


def _no_other(job: str, old: dict) -> None:
    if old:
        raise TypeError(f"{job}() got an unexpected keyword argument {next(iter(old))!r}")


def _open(source, spec):
    if isinstance(source, Dataset):
        return source
    if source is None:
        raise TypeError("give the export (source)")
    return Dataset(source, spec=spec)


# --------------------------------------------------------------------------- the jobs


def _run_folder_job(kind: str, ds, s, box, dest, *, labels, workdir, resume, overwrite, scheduler, progress,
                    allow_partial, partitions, fan_in, command, fmt: str, more: dict) -> JobReport:
    """A statistics or label-index dataset in a folder: plan, map, reduce, ``_meta.json``."""
    destination = Destination.of(dest)
    work = WorkDir.of(workdir) if workdir is not None else _beside(destination, ".work")
    origins = _origins(ds, s, box)
    bits = _bits(origins, partitions, fan_in)
    labels_arg = _labels_arg(labels)
    ident = _ident(kind, s, box, _labels_identity(labels_arg), bits)
    job = _Job(ds, s.index, labels_arg, box, kind, work, bits, _shard_bits(origins, bits, fan_in), destination)
    totals = TableTotals(shards=len(origins), partitions=1 << bits, work=work.describe())
    name = "stats" if kind == "stats" else "label-index"
    with TaskRunner(scheduler, progress=progress) as tr:
        _check_shared(tr, destination, work)
        with Output(destination, job=name, parameters=ident, source=ds, scales=[s.index], command=command,
                    resume=resume, overwrite=overwrite, workdir=work,
                    own=lambda n: n.startswith("bucket=") or n == META) as out:
            prev = out.previous
            if prev is not None and prev.get("complete") and destination.read(META) is not None:
                return _kept(out, prev, totals, allow_partial)
            _check_work(work, ident, resume, overwrite)
            destination.delete(META)  # not a complete dataset until its _meta.json is written again
            out.update(work=work.describe())
            final = _map_reduce(out, tr, job, origins, resume, fan_in, _shard_namer(ds, s))
            notes = []
            if final is not None:
                totals.rows = int(sum(final.values()))
                meta = _meta(fmt, s, ident, bits, totals, out.report.failed, **more)
                destination.write(META, (json.dumps(meta, indent=1) + "\n").encode())
                notes.append(f"{totals.rows:,} {'bodies' if kind == 'stats' else 'rows'} in {1 << bits} hash "
                             f"buckets from {totals.shards:,} shards")
            else:
                notes.append("no rows written: a shard or a reduce step failed")
            if out.report.failed:
                notes.append(f"partial results kept in {work.describe()}")
            report = out.finish(totals=totals, notes=notes, allow_partial=True)
    if report.complete:
        _remove_work(work)
    if not report.complete and not allow_partial:
        raise JobError(report.summary(), report)
    return report


def _shard_bits(origins, bits: int, fan_in: int) -> int:
    return bits if len(origins) <= fan_in else min(bits, _COARSE_BITS)


def _shard_namer(ds, s):
    return lambda o: ds.store.describe(s.stem(o) + ".arrow")


def _kept(out: Output, prev: dict, totals: TableTotals, allow_partial: bool) -> JobReport:
    """Resuming an output that is already complete: nothing to do; its figures are kept."""
    t = prev.get("totals") or {}
    totals.rows = int(t.get("rows", 0))
    tasks = prev.get("tasks") or {}
    out.report.tasks = out.report.skipped = int(tasks.get("total", totals.shards))
    return out.finish(totals=totals, notes=[f"already complete: {totals.rows:,} rows kept"],
                      allow_partial=allow_partial)


def write_body_stats(source=None, dest=None, *args, scale: int = 0, labels="agglomerated", box=None,
                     scheduler=None, workdir=None, resume: bool = False, overwrite: bool = False,
                     progress: bool | None = None, allow_partial: bool = False, partitions: int | None = None,
                     fan_in: int = FAN_IN, spec=None, command: str | None = None, **old) -> JobReport:
    """Per-body statistics of a scale, written from the workers (the client learns row counts).

    Parameters
    ----------
    source : Dataset or anything ``Dataset`` opens
        The export.
    dest : path, URL (``gs://``, ``s3://``) or kvstore spec dict
        A folder (any name not ending in ``.parquet``): a Parquet dataset
        ``dest/bucket=HH/part-0.parquet`` (every body in the file of ``bucket_of(label, bits)``)
        plus ``dest/_meta.json`` and the manifest ``dest/_dvidshards.json``. Or a ``.parquet``
        file: the same rows in one file, assembled on a worker by streaming the bucket files one
        at a time (bounded memory), with the manifest in its Parquet metadata (``b"dvidshards"``);
        written only when complete. Rows are ordered by hash bucket, and in a bucket by voxels
        (descending), then label: not globally by voxels (see :func:`body_stats` for a small
        export's sorted table).
    scale : int
        Folder number (``s{scale}``).
    labels : "agglomerated", "supervoxels" or a mapping
        What a body is: the records' agglomerated labels, each supervoxel, or a supervoxel ->
        body mapping (a mapping file path, loaded by each worker and never parsed here; or a
        LabelMapping, dict, (n, 2) array or Series, sent to every task).
    box : [[x0, y0, z0], [x1, y1, z1]], optional
        Count only voxels inside this box (voxels, upper bound exclusive), which must lie inside
        the scale's volume.
    scheduler : None, "auto", "serial", "threads[:N]", "local[:N]", address or distributed.Client
        Where the tasks run (see :mod:`dvidshards.jobs.runner`); one cluster for the whole job.
    workdir : path or URL, optional
        The work folder for partial results, visible to every worker. Default: ``DEST.work``
        beside the output; never inside it. Removed after a complete run.
    resume : bool
        Finish an earlier run: the same parameters; the shards it completed are kept.
    overwrite : bool
        Replace an earlier statistics output at ``dest`` and its partial results.
    progress : bool, optional
        Progress bar / lines (default: a bar on a terminal, lines in a log).
    allow_partial : bool
        Return the report of an incomplete output instead of raising JobError.
    partitions : int, optional
        Hash buckets of the output (a power of two); default from the number of shards.
    fan_in : int
        Partial files merged per reduce task.
    spec : dict or path, optional
        The export's neuroglancer spec (see ``Dataset``).
    command : str, optional
        The command line, recorded in the manifest.

    Returns
    -------
    JobReport
        ``totals`` is a :class:`TableTotals` (rows, shards, partitions, work folder).

    Raises
    ------
    SpecError, OutputError
        Bad input, or a destination that cannot be used; before any work.
    JobError
        A shard or a reduce step failed and ``allow_partial`` is false: no row is written, the
        manifest lists the failures and the partial results stay in the work folder (``resume``
        finishes the job); ``.report`` is the report.

    Notes
    -----
    The old forms ``write_body_stats(ds, out, scale, labels, box, scheduler)`` and the keywords
    ``ds=``, ``out=`` work for one more release, with a DeprecationWarning.
    """
    source = renamed(old, "ds", "source", source, job="write_body_stats")
    dest = renamed(old, "out", "dest", dest, job="write_body_stats")
    _no_other("write_body_stats", old)
    given = _old_positional("write_body_stats", args, ("scale", "labels", "box", "scheduler"),
                            {"scale": scale, "labels": labels, "box": box, "scheduler": scheduler},
                            {"scale": 0, "labels": "agglomerated", "box": None, "scheduler": None})
    scale, labels, box, scheduler = given["scale"], given["labels"], given["box"], given["scheduler"]
    if dest is None:
        raise TypeError("write_body_stats() needs dest, the folder or .parquet file to write")
    if resume and overwrite:
        raise SpecError("give resume or overwrite, not both")
    ds = _open(source, spec)
    s = ds.scale(scale)
    box = _check_box(s, box)
    destination = Destination.of(dest)
    if not destination.describe().lower().endswith(".parquet"):
        return _run_folder_job("stats", ds, s, box, destination, labels=labels, workdir=workdir, resume=resume,
                               overwrite=overwrite, scheduler=scheduler, progress=progress,
                               allow_partial=allow_partial, partitions=partitions, fan_in=fan_in, command=command,
                               fmt=STATS_FORMAT, more={"box": None if box is None else [list(box[0]), list(box[1])],
                                                       "order": STATS_ORDER, "columns": STATS_SCHEMA.names})
    return _write_stats_file(ds, s, box, destination, labels=labels, workdir=workdir, resume=resume,
                             overwrite=overwrite, scheduler=scheduler, progress=progress,
                             allow_partial=allow_partial, partitions=partitions, fan_in=fan_in, command=command)


class _PublishFailed(Exception):
    pass


def _write_stats_file(ds, s, box, destination: Destination, *, labels, workdir, resume, overwrite, scheduler,
                      progress, allow_partial, partitions, fan_in, command) -> JobReport:
    """Statistics as one Parquet file: the dataset is made in the work folder, then streamed into
    the file on a worker, with the final manifest in its metadata."""
    work = WorkDir.of(workdir) if workdir is not None else _beside(destination, ".work")
    origins = _origins(ds, s, box)
    bits = _bits(origins, partitions, fan_in)
    labels_arg = _labels_arg(labels)
    ident = _ident("stats", s, box, _labels_identity(labels_arg), bits)
    table = work.child("table")
    job = _Job(ds, s.index, labels_arg, box, "stats", work, bits, _shard_bits(origins, bits, fan_in), table)
    totals = TableTotals(shards=len(origins), partitions=1 << bits, work=work.describe())
    folder, name = destination.parent_and_name()
    with TaskRunner(scheduler, progress=progress) as tr:
        _check_shared(tr, folder, work)
        with Output(destination, job="stats", parameters=ident, source=ds, scales=[s.index], command=command,
                    resume=resume, overwrite=overwrite, workdir=work, kind="file") as out:
            prev = out.previous
            if prev is not None and prev.get("complete") and not overwrite:
                return _kept(out, prev, totals, allow_partial)
            _check_work(work, ident, resume, overwrite)
            final = _map_reduce(out, tr, job, origins, resume, fan_in, _shard_namer(ds, s))
            notes = []
            if final is not None:
                totals.rows = int(sum(final.values()))
                notes.append(f"{totals.rows:,} bodies from {totals.shards:,} shards in one file, {1 << bits} hash "
                             f"buckets")
            else:
                notes.append(f"nothing written at {destination.describe()}: partial results kept in "
                             f"{work.describe()}")
            out.update(table=_meta(STATS_FORMAT, s, ident, bits, totals, {},
                                   box=ident["box"], order=STATS_ORDER, columns=STATS_SCHEMA.names))

            def publish(manifest: dict) -> None:  # on a worker: the client never holds the table
                r = tr.run(functools.partial(_assemble_task, table, bits, folder,
                                             json.dumps(manifest, default=str)), [name], desc="one file")
                if r.failed:
                    raise _PublishFailed(r.failed[name])

            try:
                report = out.finish(totals=totals, notes=notes, allow_partial=True, write=publish)
            except _PublishFailed as e:
                report = out.report
                report.complete, report.status = False, "incomplete"
                report.failed[destination.describe()] = str(e)
                report.notes.append(f"nothing written at {destination.describe()}: partial results kept in "
                                    f"{work.describe()}")
    if report.complete:
        _remove_work(work)
    if not report.complete and not allow_partial:
        raise JobError(report.summary(), report)
    return report


def label_index(source=None, dest=None, *args, scale: int = 0, labels="agglomerated", scheduler=None,
                workdir=None, resume: bool = False, overwrite: bool = False, progress: bool | None = None,
                allow_partial: bool = False, partitions: int | None = None, fan_in: int = FAN_IN, spec=None,
                command: str | None = None, **old) -> JobReport:
    """Write the label index of a scale: (body, supervoxel, chunk, voxels) as a Parquet dataset.

    The dataset is ``dest/bucket=HH/part-0.parquet`` files, the rows of a body all in the file
    of ``bucket_of(body, bits)``, sorted by body, supervoxel and chunk in row groups of 32768
    rows, plus ``dest/_meta.json`` (scale, label source, bits, completeness), written last, and
    the manifest ``dest/_dvidshards.json``. Read it with :class:`dvidshards.query.BodyIndex`
    (``Dataset.body_index(dest)``). The workers write every file; the client learns row counts.

    Parameters
    ----------
    source : Dataset or anything ``Dataset`` opens
    dest : path, URL or kvstore spec dict
        Output folder: new or empty; an earlier label index only with ``resume`` (finish it) or
        ``overwrite`` (replace it). Anything else there: refused, nothing touched.
    scale, labels, scheduler, workdir, resume, overwrite, progress, allow_partial, partitions, fan_in, spec, command :
        See :func:`write_body_stats` (the work folder defaults to ``DEST.work``).

    Returns
    -------
    JobReport
        ``totals`` is a :class:`TableTotals`.

    Raises
    ------
    JobError
        Shards failed and ``allow_partial`` is false. Their rows are missing: ``_meta.json`` and
        the manifest say ``"complete": false`` (``BodyIndex`` warns), the partial results are
        kept; ``resume=True`` adds them. ``.report`` is the report.

    Notes
    -----
    The old forms ``label_index(ds, scale, out, labels, scheduler)`` and the keywords ``ds=``,
    ``out=`` work for one more release, with a DeprecationWarning.
    """
    source = renamed(old, "ds", "source", source, job="label_index")
    if isinstance(dest, (int, np.integer)) and not isinstance(dest, bool):  # label_index(ds, scale, out, ...)
        if scale != 0:
            raise TypeError("label_index() got scale twice (by position and by keyword)")
        scale, dest = int(dest), None
        if args:
            dest, args = args[0], args[1:]
        warnings.warn("label_index(ds, scale, out) is now label_index(source, dest, scale=...) (the old form goes "
                      "in the next release)", DeprecationWarning, stacklevel=2)
    dest = renamed(old, "out", "dest", dest, job="label_index")
    _no_other("label_index", old)
    given = _old_positional("label_index", args, ("labels", "scheduler"),
                            {"labels": labels, "scheduler": scheduler}, {"labels": "agglomerated", "scheduler": None})
    labels, scheduler = given["labels"], given["scheduler"]
    if dest is None:
        raise SpecError("label_index needs dest, the folder to write")
    if resume and overwrite:
        raise SpecError("give resume or overwrite, not both")
    ds = _open(source, spec)
    s = ds.scale(scale)
    return _run_folder_job("index", ds, s, None, dest, labels=labels, workdir=workdir, resume=resume,
                           overwrite=overwrite, scheduler=scheduler, progress=progress, allow_partial=allow_partial,
                           partitions=partitions, fan_in=fan_in, command=command, fmt=INDEX_FORMAT, more={})


def body_stats(source=None, *args, scale: int = 0, labels="agglomerated", box=None, scheduler=None,
               workdir=None, resume: bool = False, overwrite: bool = False, progress: bool | None = None,
               partitions: int | None = None, fan_in: int = FAN_IN, max_rows: int = MAX_TABLE_ROWS, spec=None,
               **old) -> pa.Table:
    """Per-body voxel counts, supervoxel counts, chunk counts and exact bounding boxes, as one table.

    For small exports: the table is read into this process at the end. The job itself is
    :func:`write_body_stats` into ``WORKDIR/table`` (its work folder ``WORKDIR/parts``); above
    ``max_rows`` bodies nothing is read and a ``SpecError`` says where the complete dataset is.
    For exports of any size use :func:`write_body_stats`.

    Parameters
    ----------
    source : Dataset or anything ``Dataset`` opens
        The export.
    scale, labels, box, scheduler, progress, partitions, fan_in, spec :
        See :func:`write_body_stats`.
    workdir : path or URL, optional
        Folder for the dataset and the partial results (visible to every worker; ``gs://``,
        ``s3://`` work). Default: a temporary folder. Emptied (and removed when nothing else is
        in it) after a complete run; kept when the job did not complete.
    resume : bool
        Finish an earlier run in ``workdir``.
    overwrite : bool
        Start again in a ``workdir`` holding an earlier run.
    max_rows : int
        Refuse to return more bodies than this as one table.

    Returns
    -------
    pyarrow.Table
        Columns ``label, voxels, supervoxels, chunks, x0, y0, z0, x1, y1, z1`` (box in voxels,
        upper bound exclusive), sorted by voxels (descending), then label. Schema metadata
        ``b"dvidshards"`` (JSON: scale, labels, box).

    Raises
    ------
    JobError
        Shards failed: no table; the partial results stay in the work folder (named in the
        message); fix the cause and call again with ``workdir=`` that folder and ``resume=True``.
        ``.report`` is the report.
    SpecError
        Bad input, or more than ``max_rows`` bodies.
    """
    source = renamed(old, "ds", "source", source, job="body_stats")
    _no_other("body_stats", old)
    given = _old_positional("body_stats", args, ("scale", "labels", "box", "scheduler"),
                            {"scale": scale, "labels": labels, "box": box, "scheduler": scheduler},
                            {"scale": 0, "labels": "agglomerated", "box": None, "scheduler": None})
    scale, labels, box, scheduler = given["scale"], given["labels"], given["box"], given["scheduler"]
    if resume and workdir is None:
        raise SpecError("resume needs a workdir holding the partial results of the earlier run")
    if resume and overwrite:
        raise SpecError("give resume or overwrite, not both")
    ds = _open(source, spec)
    s = ds.scale(scale)
    box = _check_box(s, box)
    _origins(ds, s, box)  # a scale without a folder is refused before a temporary folder is made
    temp = workdir is None
    root = WorkDir.of(tempfile.mkdtemp(prefix="dvidshards-stats-") if temp else workdir)
    table = root.child("table")
    try:
        report = write_body_stats(ds, table, scale=s.index, labels=labels, box=box, scheduler=scheduler,
                                  workdir=root.child("parts"), resume=resume, overwrite=overwrite, progress=progress,
                                  allow_partial=True, partitions=partitions, fan_in=fan_in)
    except BaseException:
        if temp:
            _remove_empty(root)
        raise
    if not report.complete:
        first, msg = next(iter(report.failed.items()), ("?", "?"))
        raise JobError(f"body_stats: {len(report.failed)} of {report.tasks} tasks failed (first {first}: {msg}); "
                       f"no table. Partial results kept in {root.describe()}: call again with workdir= that folder "
                       f"and resume=True", report)
    rows = report.totals.rows
    if rows > max_rows:
        raise SpecError(f"body_stats: {rows} bodies, more than max_rows={max_rows} to return as one table; the "
                        f"complete table is the Parquet dataset {table.describe()} (pyarrow.dataset.dataset); "
                        f"write_body_stats(source, dest) writes it where you want")
    bits = report.totals.partitions.bit_length() - 1
    parts = [table.read_table(bucket_name(b, bits)) for b in range(1 << bits)]
    parts = [t for t in parts if t.num_rows]
    t = pa.concat_tables(parts).combine_chunks() if parts else STATS_SCHEMA.empty_table()
    t = t.sort_by([("voxels", "descending"), ("label", "ascending")])
    about = {"scale": s.index, **_labels_identity(_labels_arg(labels)),
             "box": None if box is None else [list(box[0]), list(box[1])]}
    t = t.replace_schema_metadata({b"dvidshards": json.dumps(about).encode()})
    table.rmtree()
    _remove_empty(root)
    return t


def _remove_empty(root: WorkDir) -> None:
    """Remove a folder when nothing is left in it (locally; a bucket prefix vanishes by itself)."""
    if root.local and not root.list():
        try:
            root.rmtree()
        except OutputError:
            pass


# --------------------------------------------------------------------------- command line


def _common(p, *, what: str, box: bool) -> None:
    add_source(p)
    add_dest(p, what=what)
    add_scale(p)
    add_labels(p)
    if box:
        add_box(p)
    p.add_argument("--partitions", type=int, default=None, metavar="N",
                   help="hash buckets of the output (a power of two; default from the number of shards)")
    add_job_options(p)


def _run(job, name: str, args, **kw) -> int:
    report = job(args.source, dest_of(args), scale=args.scale, labels=args.labels, partitions=args.partitions,
                 spec=args.spec, allow_partial=True,
                 command=command_line(name, args, skip=[k for k, v in (("scale", 0), ("labels", "agglomerated"))
                                                        if getattr(args, k) == v]),
                 **kw, **job_options(args))
    print(report.summary())
    return 0 if report.ok else 1


class StatsCommand:
    """``dvidshards stats EXPORT DEST``: DEST a folder (a Parquet dataset) or a ``.parquet`` file."""

    @staticmethod
    def add_arguments(p) -> None:
        _common(p, box=True, what="the statistics: a folder (one Parquet file per hash bucket, plus _meta.json) or "
                                  "a file ending in .parquet (the same rows in one file, written only when complete); "
                                  "rows are grouped by hash bucket, by voxels (descending) within one")

    @staticmethod
    def main(args) -> int:
        """Run ``dvidshards stats``: 0 when complete, 1 when not (the summary says why and how to finish)."""
        return _run(write_body_stats, "stats", args, box=args.box)


class LabelIndexCommand:
    """``dvidshards label-index EXPORT DEST``: the label index as a Parquet dataset."""

    @staticmethod
    def add_arguments(p) -> None:
        _common(p, box=False, what="the label index: a folder (one Parquet file per hash bucket, plus _meta.json)")

    @staticmethod
    def main(args) -> int:
        """Run ``dvidshards label-index``: 0 when complete, 1 when not."""
        return _run(label_index, "label-index", args)
