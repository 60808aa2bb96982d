"""Per-body statistics and a label index of a whole export, one task per shard.

Both jobs read every record of a scale once, decompress its block and count it with the
``blockstats`` kernel (no voxel is written). Per chunk that gives, per entry of the block
label list, (supervoxel, body, voxels, exact voxel box); bodies come from the records'
agglomerated lists, the supervoxels themselves or a mapping.

* :func:`write_body_stats` - per body: voxels, supervoxels, chunks and bounding box (DVID's
  ``/sizes``, neuclease's ``fetch_sizes``) as a Parquet dataset (or one file) written by the
  workers; :func:`body_stats` returns the same rows as a table, for small exports.
* :func:`label_index` - a Parquet dataset of (body, supervoxel, chunk_x, chunk_y, chunk_z,
  voxels): DVID's ``LabelIndex`` for every body at once (read back with
  :class:`dvidshards.query.BodyIndex`).

The per-shard functions :func:`shard_body_stats` and :func:`shard_label_index` are plain
``(dataset, scale, shard origin) -> pyarrow.Table`` calls, so any runner can wrap them. Here a
job runs every phase in one :class:`dvidshards.jobs.runner.TaskRunner` (serially, on threads or
on one dask cluster):

1. *map* - one task per shard writes its partial result to the work folder (an Arrow IPC file
   of one record batch per hash bucket of the body id; temporary name, then a move: a failed
   task leaves nothing);
2. *reduce* - groups of ``FAN_IN`` files merge into one, level by level, a bucket group at a
   time;
3. *final* - one task per bucket merges its rows from the last level and writes
   ``bucket=HH/part-0.parquet`` of the output.

No task holds more than one shard or one bucket group, and the client holds only the list of
shards and per-task row counts, whatever the number of bodies. The work folder
(:class:`dvidshards.jobs.workdir.WorkDir`: a path or a ``gs://``/``s3://`` URL) must be visible
to every worker; with a remote scheduler a local folder is checked before any work starts. Its
``manifest.json`` names the job's parameters, its state and its failed shards; ``resume``
skips shards whose partial file exists.

Outputs are complete or say that they are not: statistics with a failed shard write nothing
at the requested path (the partial results stay for ``resume``); a label index with failed
shards says ``"complete": false`` in its ``_meta.json``. An output folder holding anything but
this job's earlier output is refused.

Background (label 0) is not reported: absent chunks hold it implicitly.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..dataset import Dataset
from ..errors import BlockDecodeError, JobError, ShardFormatError, SpecError
from ..formats.arrowipc import R_NLAB, R_NSV
from ..formats.blockstats import BlockError, batch_stats
from ..formats.labelindex import INDEX_FORMAT, INDEX_SCHEMA, bucket_name, bucket_of, labels_id
from ..formats.labels import Agglomerated, Mapped, Supervoxels, as_labels
from ..formats.records import list_values
from .runner import TaskRunner, failure_lines, job_arguments, progress_of
from .workdir import WorkDir, is_temporary, is_url

__all__ = [
    "FAN_IN",
    "INDEX_SCHEMA",
    "MAX_TABLE_ROWS",
    "STATS_FORMAT",
    "STATS_ORDER",
    "STATS_SCHEMA",
    "IndexReport",
    "LabelIndexCommand",
    "StatsCommand",
    "body_stats",
    "bucket_of",
    "label_index",
    "shard_body_stats",
    "shard_label_index",
    "write_body_stats",
]

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
        body = np.array([sv[j] if pal[r] is None else pal[r][e] for j, (r, e) in
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

    def write(path, fs):
        nonlocal rows
        nxt = 0
        with fs.open_output_stream(path) as sink, pa.ipc.new_file(sink, head, options=_IPC) as w:
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

    work.write_atomic(rel, write)
    return rows


class _Partial:
    """A partial file opened for reading buckets: its footer only, batches fetched on demand."""

    def __init__(self, work: WorkDir, rel: str, kind: str):
        self.kind = kind
        where = work.describe(rel)
        try:
            self.reader = pa.ipc.open_file(work.fs.open_input_file(work.full(rel)))
            self.bits = int(json.loads(self.reader.schema.metadata[b"dvidshards"])["bits"])
        except (pa.ArrowInvalid, KeyError, TypeError, ValueError) as e:
            raise ShardFormatError(f"{where}: not a partial-result file of this job ({e})") from None
        if self.reader.num_record_batches != 1 << self.bits:
            raise ShardFormatError(f"{where}: {self.reader.num_record_batches} record batches, "
                                   f"expected {1 << self.bits}")

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


@dataclass(frozen=True)
class _Job:
    """The parameters every task of a job carries (small: paths and options, no data)."""

    ds: object
    scale: int
    labels: object  # "agglomerated", "supervoxels", a mapping file path or a LabelSource
    box: tuple | None
    kind: str  # "stats" or "index"
    work: WorkDir
    bits: int  # final partition bits
    shard_bits: int  # batches of the shard partials (coarser when a merge tree follows)
    dest: WorkDir | None = None  # where the final buckets go


def _shard_rel(origin) -> str:
    return f"shards/{origin[0]}_{origin[1]}_{origin[2]}.arrow"


def _shard_task(job: _Job, origin) -> int:
    if job.kind == "stats":
        t = shard_body_stats(job.ds, job.scale, origin, job.labels, job.box)
    else:
        t = shard_label_index(job.ds, job.scale, origin, job.labels)
    return _write_partial(job.work, _shard_rel(origin), t, job.kind, job.shard_bits)


def _merge_task(job: _Job, item) -> int:
    """One reduce-tree node: item = (level, k, input files) -> file ``L{level}/{k}.arrow``."""
    level, k, inputs = item
    _, _, merge = _KIND[job.kind]
    parts = [_Partial(job.work, rel, job.kind) for rel in inputs]
    in_bits = min(p.bits for p in parts)
    # one input bucket group at a time, merged and written before the next is read
    groups = (merge([p.bucket(in_bits, g) for p in parts]) for g in range(1 << in_bits))
    return _write_partial(job.work, f"L{level}/{k:06d}.arrow", groups, job.kind, job.bits)


_STATS_ROW_GROUP = 65536
_INDEX_ROW_GROUP = 32768


def _final_task(job: _Job, inputs, bucket: int) -> int:
    """One output bucket from the last level's files, written to ``dest`` as Parquet."""
    _, _, merge = _KIND[job.kind]
    t = merge([_Partial(job.work, rel, job.kind).bucket(job.bits, bucket) for rel in inputs])
    if job.kind == "stats":
        t = _finish_stats(t)
        if t.num_rows:
            t = t.sort_by([("voxels", "descending"), ("label", "ascending")])
        size = _STATS_ROW_GROUP
    else:
        t = _finish_index(t)
        size = _INDEX_ROW_GROUP
    assert job.dest is not None

    def write(path, fs):
        pq.write_table(t, path, filesystem=fs, compression="zstd", row_group_size=size)

    job.dest.write_atomic(bucket_name(bucket, job.bits), write)
    return t.num_rows


def _assemble_task(src: WorkDir, bits: int, folder: WorkDir, meta: str, name: str) -> int:
    """Stream the bucket files of a statistics dataset into one Parquet file, a row group at a time.

    Written under a temporary name and moved to ``name`` (in ``folder``) when complete.
    """
    schema = STATS_SCHEMA.with_metadata({b"dvidshards": meta.encode(), b"failed_shards": b"{}"})
    rows = 0

    def write(path, fs):
        nonlocal rows
        with pq.ParquetWriter(path, schema, filesystem=fs, compression="zstd") as w:
            for b in range(1 << bits):
                f = src.parquet(bucket_name(b, bits))
                for g in range(f.num_row_groups):
                    t = f.read_row_group(g).replace_schema_metadata(schema.metadata)
                    w.write_table(t, row_group_size=_STATS_ROW_GROUP)
                    rows += t.num_rows

    folder.write_atomic(name, write)
    return rows


# --------------------------------------------------------------------------- the job


WORK_FORMAT = "dvidshards-job-work"
STATS_FORMAT = "dvidshards-body-stats"
_MANIFEST = "manifest.json"
_HASH = "top bits of (body * 0x9E3779B97F4A7C15 mod 2**64) >> 48"
STATS_ORDER = "grouped by hash bucket of the label (bucket_of(label, bits)); in a bucket, voxels descending, then label"


def _default_bits(n_shards: int) -> int:
    # about 16 shards' worth of rows per output bucket
    return int(min(12, max(0, int(np.ceil(np.log2(max(n_shards, 1) / 16))))))


def _check_box(s, box):
    """The box as a tuple of two corners, inside the scale's volume (SpecError otherwise)."""
    if box is None:
        return None
    lo, hi = s.check_box(box)
    return (tuple(int(v) for v in lo), tuple(int(v) for v in hi))


def _origins(ds, s, box) -> list[tuple[int, int, int]]:
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


@dataclass
class IndexReport:
    """What a :func:`label_index`, :func:`write_body_stats` or :func:`body_stats` run did.

    Attributes
    ----------
    path : str
        The output (folder or file), or "" when only returned.
    rows : int
        Rows written (0 when nothing was written).
    shards : int
        Shards of the scale (inside the box).
    failed : dict
        ``{shard path: "TypeName: message"}`` of shards whose task failed: their data are
        missing; a ``resume`` run retries them.
    skipped : int
        Shards skipped on resume (their partial results existed).
    elapsed : float
        Seconds.
    work : str
        The work folder (kept when the run did not complete; its ``manifest.json`` lists the
        failed shards).
    """

    path: str = ""
    rows: int = 0
    shards: int = 0
    failed: dict = field(default_factory=dict)
    skipped: int = 0
    elapsed: float = 0.0
    work: str = ""

    @property
    def ok(self) -> bool:
        return not self.failed

    def summary(self, limit: int = 20) -> str:
        lines = [f"{self.rows} rows from {self.shards} shards ({self.skipped} resumed, "
                 f"{len(self.failed)} failed) in {self.elapsed:.1f} s" + (f" -> {self.path}" if self.path else "")]
        return "\n".join(lines + failure_lines(self.failed, limit, rest=f" (all in {self.work}/{_MANIFEST})"))


def _partition_bits(partitions: int) -> int:
    p = int(partitions)
    if p < 1 or p & (p - 1) or p > 1 << 12:
        raise SpecError(f"partitions must be a power of two in 1..4096, got {partitions!r}")
    return p.bit_length() - 1


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


def _is_work(work: WorkDir) -> bool:
    try:
        return work.read_json(_MANIFEST).get("format") == WORK_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _own_names(names) -> list[str]:
    return [n for n in names if not (is_temporary(n) or n.startswith(".dvidshards-shared-"))]


def _check_work(work: WorkDir, resume: bool, overwrite: bool) -> None:
    """A work folder is new, empty or holds this library's partial results (then: resume or overwrite)."""
    names = _own_names(work.listdir())
    if not names:
        return
    if not _is_work(work):
        raise SpecError(f"work folder {work.describe()}: not empty and not a dvidshards work folder (holds "
                        f"{names[:3]}); give a new or empty one")
    if not (resume or overwrite):
        raise SpecError(f"work folder {work.describe()}: holds the partial results of an earlier run; "
                        f"--resume to finish it, --overwrite to start again")


def _clear_work(work: WorkDir) -> None:
    """Delete this library's files from a work folder (not the folder)."""
    for name in work.listdir():
        if name in ("shards", "table") or name == _MANIFEST or (name[:1] == "L" and name[1:].isascii() and name[1:].isdigit()) \
                or is_temporary(name):
            if work.is_dir(name):
                work.rmtree(name)
            else:
                work.remove(name)


def _check_out_folder(out: WorkDir, fmt: str, what: str, resume: bool, overwrite: bool) -> dict | None:
    """An output folder is new, empty or this job's earlier output (then: resume or overwrite).

    Returns the earlier output's ``_meta.json`` (None without one). Touches nothing.
    """
    if out.is_file():
        raise SpecError(f"{out.describe()}: exists and is a file; give a folder")
    names = _own_names(out.listdir())
    if not names:
        return None
    foreign = [n for n in names if not (n.startswith("bucket=") or n in ("_meta.json", "_work"))]
    meta = None
    if "_meta.json" in names:
        try:
            meta = out.read_json("_meta.json")
        except (OSError, ValueError):
            meta = None
        if not isinstance(meta, dict) or meta.get("format") != fmt:
            foreign.append("_meta.json")
    elif "_work" not in names or not _is_work(out.child("_work")):
        foreign = names  # bucket folders nobody claims: someone else's dataset
    if foreign:
        raise SpecError(f"{out.describe()}: not empty and not an earlier {what} (holds {sorted(foreign)[:3]}); "
                        f"give a new or empty folder")
    if not (resume or overwrite):
        raise SpecError(f"{out.describe()}: holds an earlier {what}; --overwrite to replace it, --resume to "
                        f"finish it")
    return meta


def _clear_out_folder(out: WorkDir) -> None:
    for name in out.listdir():
        if name.startswith("bucket=") or name == "_meta.json" or is_temporary(name):
            if out.is_dir(name):
                out.rmtree(name)
            else:
                out.remove(name)


def _file_about(folder: WorkDir, name: str) -> dict | None:
    """The ``dvidshards`` metadata of an earlier statistics file (SpecError: not one)."""
    try:
        md = folder.parquet(name).schema_arrow.metadata or {}
        return json.loads(md[b"dvidshards"])
    except (OSError, KeyError, ValueError, pa.ArrowException) as e:
        raise SpecError(f"{folder.describe(name)}: exists and is not a dvidshards statistics file "
                        f"({type(e).__name__}); give another name") from None


def _split_file(text: str) -> tuple[str, str]:
    """``(folder location, file name)`` of a file path or URL (a URL keeps its query)."""
    if is_url(text) and not text.startswith("file://"):
        base, sep, query = text.partition("?")
        folder, _, name = base.rstrip("/").rpartition("/")
        return folder + sep + query, name
    path = os.path.abspath(text.removeprefix("file://"))
    return os.path.dirname(path), os.path.basename(path)


class _Setup:
    """Folders a job creates before its work starts, removed again if the setup fails."""

    def __init__(self, tr: TaskRunner, folders: list[WorkDir]):
        self.made = [w for w in dict.fromkeys(folders) if not w.exists()]
        try:
            for w in dict.fromkeys(folders):
                w.makedirs()
                if w.local:
                    tr.check_shared(w.path)  # one line when the workers cannot see it
        except BaseException:
            self.undo()
            raise

    def undo(self) -> None:
        for w in reversed(self.made):
            if not _own_names(w.listdir()):
                w.rmtree()


def _run_phase(tr: TaskRunner, fn, items, desc: str):
    """A reduce phase: its failed tasks run once more (a lost worker), then it is an error."""
    r = tr.run(fn, items, desc=desc)
    if r.failed:
        again = tr.run(fn, list(r.failed), desc=f"{desc} (retry)")
        r.results.update(again.results)
        r.failed = again.failed
    if r.failed:
        item, msg = next(iter(r.failed.items()))
        raise JobError(f"{desc}: {len(r.failed)} task(s) failed twice, first {str(item)[:200]}: {msg}")
    return r


def _execute(tr: TaskRunner, ds, s, origins, labels, ident: dict, box, kind: str, work: WorkDir,
             resume: bool, bits: int, fan_in: int, dest: WorkDir) -> tuple[IndexReport, dict]:
    """Map shards to partial files, reduce them as a tree, write the final buckets to ``dest``.

    For statistics, a failed shard stops the job before the reduce (nothing is written to
    ``dest``); for the label index the reduce goes on without it. Returns the report and the
    final ``{bucket: rows}``.
    """
    t0 = time.perf_counter()
    shard_bits = bits if len(origins) <= fan_in else min(bits, _COARSE_BITS)
    ident = {**ident, "bits": bits, "shard_bits": shard_bits}
    if resume and _is_work(work):
        old = work.read_json(_MANIFEST).get("job")
        if old != json.loads(json.dumps(ident)):
            raise SpecError(f"{work.describe()}: partial results were made with other parameters ({old}); "
                            f"run with the same ones ({ident}) or --overwrite")
    else:
        _clear_work(work)
    manifest = {"format": WORK_FORMAT, "job": ident, "shards": len(origins), "state": "mapping", "failed": {}}
    work.write_json(_MANIFEST, manifest)
    job = _Job(ds, s.index, labels, box, kind, work, bits, shard_bits, dest)
    done: set = set()
    if resume:
        names = set(work.listdir("shards"))
        done = {o for o in origins if _shard_rel(o).split("/")[1] in names}
    rep = tr.run(functools.partial(_shard_task, job), origins, desc=f"{s.folder} shards", done=done)
    failed = {ds.store.describe(s.stem(o) + ".arrow"): msg for o, msg in rep.failed.items()}
    report = IndexReport(shards=len(origins), failed=failed, skipped=len(rep.skipped), work=work.describe())
    manifest.update(failed=failed, done=len(rep.results) + len(rep.skipped))
    if failed and kind == "stats":
        manifest["state"] = "shards failed: nothing written; --resume retries them"
        work.write_json(_MANIFEST, manifest)
        report.elapsed = time.perf_counter() - t0
        return report, {}
    manifest["state"] = "reducing"
    work.write_json(_MANIFEST, manifest)
    try:
        files = [_shard_rel(o) for o in origins if o in rep.results or o in done]
        level = 0
        while len(files) > fan_in:  # the reduce tree
            level += 1
            work.rmtree(f"L{level}")
            groups = [(level, k, tuple(files[i:i + fan_in])) for k, i in enumerate(range(0, len(files), fan_in))]
            _run_phase(tr, functools.partial(_merge_task, job), groups, f"merge level {level}")
            files = [f"L{level}/{g[1]:06d}.arrow" for g in groups]
        final = _run_phase(tr, functools.partial(_final_task, job, tuple(files)), list(range(1 << bits)), "buckets")
    except JobError as e:
        manifest["state"] = f"reduce failed: {e}; --resume runs the reduce again"
        work.write_json(_MANIFEST, manifest)
        e.report = report
        raise
    report.rows = int(sum(final.results.values()))
    manifest["state"] = "complete" if report.ok else "reduced without the failed shards"
    work.write_json(_MANIFEST, manifest)
    report.elapsed = time.perf_counter() - t0
    return report, final.results


def _same_complete(old: dict | None, job: dict) -> bool:
    """Whether an earlier output is complete and made by the same job (resume: nothing to do)."""
    if not old:
        return False
    return bool(old.get("complete")) and old.get("job") == json.loads(json.dumps(job))


def _ident(kind: str, s, box, labels_ident: dict) -> dict:
    return {"kind": kind, "scale": s.index, "box": None if box is None else [list(box[0]), list(box[1])],
            "chunk_size": list(s.chunk_size), **labels_ident}


def _finish_work(work: WorkDir) -> None:
    """After a complete run: the partial results go, and the folder when nothing else is in it."""
    _clear_work(work)
    if not _own_names(work.listdir()):
        work.rmtree()


def _meta(fmt: str, s, ident: dict, bits: int, report: IndexReport, **more) -> dict:
    labels = {k: v for k, v in ident.items() if k not in ("kind", "scale", "box", "chunk_size")}
    return {"format": fmt, "version": 1, "scale": s.index, **labels, "bits": bits, "hash": _HASH,
            "chunk_size": list(s.chunk_size), "voxel_offset": list(s.voxel_offset), "size": list(s.size),
            **more, "rows": report.rows, "shards": report.shards, "complete": report.ok,
            "failed_shards": report.failed, "job": ident}


# --------------------------------------------------------------------------- public API


MAX_TABLE_ROWS = 1 << 22  # body_stats returns at most this many rows as one table (~350 MB)


def _bits(origins, partitions, fan_in: int = FAN_IN) -> int:
    if fan_in < 2:
        raise SpecError(f"fan_in must be at least 2, got {fan_in}")
    return _default_bits(len(origins)) if partitions is None else _partition_bits(partitions)


def write_body_stats(ds, out, scale=0, labels="agglomerated", box=None, scheduler=None, *, workdir=None,
                     resume: bool = False, overwrite: bool = False, partitions: int | None = None,
                     progress: bool | None = None, fan_in: int = FAN_IN) -> IndexReport:
    """Per-body statistics of a scale, written from the workers (the client learns row counts).

    Parameters
    ----------
    ds : Dataset or anything ``Dataset`` opens
        The export.
    out : path or URL
        A folder (any name not ending in ``.parquet``): a Parquet dataset ``out/bucket=HH/part-0.parquet``
        (every body in the file of ``bucket_of(label, bits)``) plus ``out/_meta.json``. Or a
        ``.parquet`` file: the same rows in one file, assembled on a worker by streaming the bucket
        files one at a time (bounded memory), under a temporary name moved to ``out`` when complete.
        Rows are ordered by hash bucket, and in a bucket by voxels (descending), then label: not
        globally by voxels (see :func:`body_stats` for a small export's sorted table).
    scale, labels, box, scheduler, partitions, progress, fan_in :
        See :func:`body_stats`.
    workdir : path or URL, optional
        The work folder for partial results, visible to every worker. Default: ``out/_work``
        (a folder ``out``) or ``out.parts`` (a file), removed after a complete run.
    resume : bool
        Finish an earlier run: keep the shards it completed (the same parameters only).
    overwrite : bool
        Replace an earlier statistics output at ``out`` and its partial results.

    Returns
    -------
    IndexReport
        With failed shards nothing is written at ``out``: the partial results stay in the work
        folder (its ``manifest.json`` lists the failed shards); ``resume=True`` finishes the job.

    Raises
    ------
    SpecError
        Bad input, or an output that holds anything but an earlier statistics output (and,
        without ``resume`` or ``overwrite``, that too); nothing is touched.
    JobError
        A reduce task failed twice (partial results kept: ``resume=True`` runs the reduce again).
    """
    ds = _dataset(ds)
    s = ds.scale(scale)
    box = _check_box(s, box)
    if resume and overwrite:
        raise SpecError("give resume or overwrite, not both")
    text = os.fspath(out)
    single = text.lower().split("?", 1)[0].endswith(".parquet")
    if single:
        loc, name = _split_file(text)
        parent = WorkDir(loc)
        if parent.local and not os.path.isdir(parent.path):
            raise SpecError(f"--out {text}: the folder {parent.path} does not exist")
        if parent.is_dir(name):
            raise SpecError(f"--out {text}: is a folder; give a new .parquet file name or the folder form")
        old = _file_about(parent, name) if parent.exists(name) else None
        if old is not None and not (resume or overwrite):
            raise SpecError(f"{parent.describe(name)}: exists (earlier statistics); --overwrite to replace it")
        base, sep, query = text.partition("?")
        work = WorkDir(workdir) if workdir is not None else WorkDir(f"{base}.parts{sep}{query}")
        dest, where = work.child("table"), parent
    else:
        outd = WorkDir(text)
        old = _check_out_folder(outd, STATS_FORMAT, "statistics output", resume, overwrite)
        work = WorkDir(workdir) if workdir is not None else outd.child("_work")
        dest, where = outd, outd
    if workdir is not None or single:
        _check_work(work, resume, overwrite)
    origins = _origins(ds, s, box)
    bits = _bits(origins, partitions, fan_in)
    labels_arg = _labels_arg(labels)
    ident = _ident("stats", s, box, _labels_identity(labels_arg))
    path = parent.describe(name) if single else outd.describe()
    if resume and old is not None and old.get("complete"):
        if _same_complete(old, {**ident, "bits": bits}):
            return IndexReport(path=path, rows=old["rows"], shards=old["shards"], skipped=old["shards"])
        raise SpecError(f"{path}: holds complete statistics made with other parameters; --overwrite to "
                        f"replace them")
    with TaskRunner(scheduler, progress=progress) as tr:
        _Setup(tr, [where, work])
        if overwrite:
            if single and old is not None:
                parent.remove(name)
            elif not single:
                _clear_out_folder(outd)
        elif not single:
            outd.remove("_meta.json")  # resuming: the folder is not a complete output until rewritten
        report, _ = _execute(tr, ds, s, origins, labels_arg, ident, box, "stats", work, resume, bits, fan_in, dest)
        if not report.ok:
            return report
        meta = _meta(STATS_FORMAT, s, {**ident, "bits": bits}, bits, report,
                     box=ident["box"], order=STATS_ORDER, columns=STATS_SCHEMA.names)
        if single:  # on a worker: the client never holds the table
            r = tr.run(functools.partial(_assemble_task, dest, bits, parent, json.dumps(meta)), [name],
                       desc="one file")
            if r.failed:
                raise JobError(f"{path}: writing the file failed: {r.failed[name]}; the partial results stay in "
                               f"{work.describe()} (--resume writes it again)", report)
        else:
            dest.write_json("_meta.json", meta)
    report.path = path
    _finish_work(work)
    return report


def body_stats(ds, scale=0, labels="agglomerated", box=None, scheduler=None, *, workdir=None,
               resume: bool = False, overwrite: bool = False, partitions: int | None = None,
               progress: bool | None = None, fan_in: int = FAN_IN, max_rows: int = MAX_TABLE_ROWS) -> pa.Table:
    """Per-body voxel counts, supervoxel counts, chunk counts and exact bounding boxes, as one table.

    For small exports: the table is read into this process at the end. The job itself runs
    like :func:`write_body_stats` (the workers write a Parquet dataset into the work folder);
    above ``max_rows`` bodies nothing is read and a ``SpecError`` says where the complete
    dataset is. For exports of any size use :func:`write_body_stats`.

    Parameters
    ----------
    ds : Dataset or anything ``Dataset`` opens
        The export.
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
        Folder for the partial results (visible to every worker; ``gs://``, ``s3://`` work).
        Default: a temporary folder. Emptied after a complete run.
    resume : bool
        Keep the partial results of shards already done in ``workdir``.
    overwrite : bool
        Start again in a ``workdir`` holding an earlier run's partial results.
    partitions : int, optional
        Hash buckets of the reduce (a power of two); default from the number of shards.
    progress : bool, optional
        Progress bar / lines (default: a bar on a terminal, lines in a log).
    fan_in : int
        Partial files merged per reduce task.
    max_rows : int
        Refuse to return more bodies than this as one table.

    Returns
    -------
    pyarrow.Table
        Columns ``label, voxels, supervoxels, chunks, x0, y0, z0, x1, y1, z1`` (box in voxels,
        upper bound exclusive), sorted by voxels (descending), then label. Schema metadata
        ``b"dvidshards"`` (JSON: scale, labels, box, ...).

    Raises
    ------
    JobError
        Shards failed: no table; the partial results stay in the work folder (named in the
        message, with ``manifest.json``); fix the cause and run with ``workdir=`` that folder and
        ``resume=True``.
    SpecError
        Bad input, or more than ``max_rows`` bodies.
    """
    ds = _dataset(ds)
    s = ds.scale(scale)
    box = _check_box(s, box)
    if resume and workdir is None:
        raise SpecError("resume needs a workdir holding the partial results of the earlier run")
    if resume and overwrite:
        raise SpecError("give resume or overwrite, not both")
    temp = workdir is None
    work = WorkDir(tempfile.mkdtemp(prefix="dvidshards-stats-") if temp else workdir)
    if not temp:
        _check_work(work, resume, overwrite)
    origins = _origins(ds, s, box)
    bits = _bits(origins, partitions, fan_in)
    labels_arg = _labels_arg(labels)
    ident = _ident("stats", s, box, _labels_identity(labels_arg))
    dest = work.child("table")
    with TaskRunner(scheduler, progress=progress) as tr:
        try:
            _Setup(tr, [work])
        except BaseException:
            if temp:
                work.rmtree()
            raise
        report, _ = _execute(tr, ds, s, origins, labels_arg, ident, box, "stats", work, resume, bits, fan_in, dest)
    if not report.ok:
        first, msg = next(iter(report.failed.items()))
        raise JobError(f"body_stats: {len(report.failed)} of {report.shards} shards failed (first {first}: {msg}); "
                       f"no table. Partial results kept in {work.describe()}: run again with workdir= that folder "
                       f"and resume=True", report)
    if report.rows > max_rows:
        raise SpecError(f"body_stats: {report.rows} bodies, more than max_rows={max_rows} to return as one table; "
                        f"the complete table is the Parquet dataset {dest.describe()} (pyarrow.dataset.dataset); "
                        f"write_body_stats(out=...) writes it where you want")
    parts = [dest.parquet(bucket_name(b, bits)).read() for b in range(1 << bits)]
    parts = [t for t in parts if t.num_rows]
    t = pa.concat_tables(parts).combine_chunks() if parts else STATS_SCHEMA.empty_table()
    t = t.sort_by([("voxels", "descending"), ("label", "ascending")])
    about = {"scale": s.index, **{k: v for k, v in ident.items() if k not in ("kind", "scale", "chunk_size")}}
    t = t.replace_schema_metadata({b"dvidshards": json.dumps(about).encode(), b"failed_shards": b"{}"})
    _finish_work(work)
    return t


def label_index(ds, scale=0, out=None, labels="agglomerated", scheduler=None, *, workdir=None,
                resume: bool = False, overwrite: bool = False, partitions: int | None = None,
                progress: bool | None = None, fan_in: int = FAN_IN) -> IndexReport:
    """Write the label index of a scale: (body, supervoxel, chunk, voxels) as a Parquet dataset.

    The dataset is ``out/bucket=HH/part-0.parquet`` files, the rows of a body all in the file
    of ``bucket_of(body, bits)``, sorted by body, supervoxel and chunk in row groups of 32768
    rows, plus ``out/_meta.json`` (scale, label source, bits, completeness), written last. Read
    it with :class:`dvidshards.query.BodyIndex` (``Dataset.body_index(out)``). The workers
    write every file; the client learns row counts.

    Parameters
    ----------
    ds : Dataset or anything ``Dataset`` opens
    scale : int
    out : path or URL
        Output folder: new or empty; an earlier label index only with ``resume`` (finish it) or
        ``overwrite`` (replace it). Anything else there: refused, nothing touched.
    labels, scheduler, partitions, progress, fan_in :
        See :func:`body_stats`.
    workdir : path or URL, optional
        Work folder for the partial results (default ``out/_work``), kept until the index is
        complete.
    resume : bool
        Reuse the partial results of an earlier, unfinished run.
    overwrite : bool
        Replace an earlier label index in ``out``.

    Returns
    -------
    IndexReport
        Rows written, shards, failed shards: their rows are missing, ``_meta.json`` says
        ``"complete": false`` (``BodyIndex`` warns) and the work folder is kept; run again with
        ``resume=True`` to add them.
    """
    if out is None:
        raise SpecError("label_index needs out=, the folder to write")
    if resume and overwrite:
        raise SpecError("give resume or overwrite, not both")
    ds = _dataset(ds)
    s = ds.scale(scale)
    outd = WorkDir(out)
    old = _check_out_folder(outd, INDEX_FORMAT, "label index", resume, overwrite)
    work = WorkDir(workdir) if workdir is not None else outd.child("_work")
    if workdir is not None:
        _check_work(work, resume, overwrite)
    origins = _origins(ds, s, None)
    bits = _bits(origins, partitions, fan_in)
    labels_arg = _labels_arg(labels)
    ident = _ident("index", s, None, _labels_identity(labels_arg))
    if resume and old is not None and old.get("complete"):
        if _same_complete(old, {**ident, "bits": bits}):
            return IndexReport(path=outd.describe(), rows=old["rows"], shards=old["shards"], skipped=old["shards"])
        raise SpecError(f"{outd.describe()}: holds a complete label index made with other parameters; "
                        f"--overwrite to replace it")
    with TaskRunner(scheduler, progress=progress) as tr:
        _Setup(tr, [outd, work])
        if overwrite:
            _clear_out_folder(outd)
        outd.remove("_meta.json")  # the folder is not a complete index until _meta.json is rewritten
        report, _ = _execute(tr, ds, s, origins, labels_arg, ident, None, "index", work, resume, bits, fan_in, outd)
    report.path = outd.describe()
    outd.write_json("_meta.json", _meta(INDEX_FORMAT, s, {**ident, "bits": bits}, bits, report))
    if report.ok:
        _finish_work(work)
    return report


# --------------------------------------------------------------------------- command line


def _box_arg(text: str | None):
    if text is None:
        return None
    try:
        v = [int(x) for x in text.replace(" ", "").split(",")]
    except ValueError:
        v = []
    if len(v) != 6:
        raise SpecError(f"--box {text!r}: give x0,y0,z0,x1,y1,z1 in voxels")
    return [v[:3], v[3:]]


def _common(p) -> None:
    p.add_argument("source", help="export root: a folder, gs://, s3://, http(s):// URL or kvstore JSON")
    p.add_argument("--spec", help="the neuroglancer multiscale spec given to DVID's export-shards")
    p.add_argument("--scale", type=int, default=0, metavar="K", help="scale K (folder sK); default 0")
    p.add_argument("--labels", default="agglomerated",
                   help="agglomerated (default), supervoxels, or a supervoxel->body mapping file (each worker "
                        "loads it once)")
    p.add_argument("--partitions", type=int, default=None, help="hash buckets (a power of two)")
    job_arguments(p, workdir=True, overwrite=True)


class StatsCommand:
    """``dvidshards stats SOURCE --out sizes/`` (a Parquet dataset) or ``--out sizes.parquet``."""

    @staticmethod
    def add_arguments(p) -> None:
        _common(p)
        p.add_argument("--out", required=True,
                       help="folder for the Parquet dataset (bucket=HH/part-0.parquet + _meta.json), or a file "
                            "ending in .parquet (the same rows in one file, written on a worker); rows are "
                            "grouped by hash bucket, by voxels (descending) within one")
        p.add_argument("--box", default=None, help="only voxels in x0,y0,z0,x1,y1,z1 (inside the volume)")

    @staticmethod
    def main(args) -> int:
        ds = Dataset(args.source, spec=args.spec)
        # a JobError (the job ran, did not complete) reaches the command line: one line, exit 1
        report = write_body_stats(ds, args.out, args.scale, args.labels, _box_arg(args.box), args.scheduler,
                                  workdir=args.workdir, resume=args.resume, overwrite=args.overwrite,
                                  partitions=args.partitions, progress=progress_of(args))
        print(report.summary())
        if not report.ok:
            print(f"nothing written to {args.out}: partial results kept in {report.work} (the failed shards are "
                  f"listed in its {_MANIFEST}); fix their cause and run the same command with --resume")
        return 0 if report.ok else 1


class LabelIndexCommand:
    """``dvidshards label-index SOURCE --scale 0 --out idx/``."""

    @staticmethod
    def add_arguments(p) -> None:
        _common(p)
        p.add_argument("--out", required=True, help="folder to write the Parquet dataset into")

    @staticmethod
    def main(args) -> int:
        ds = Dataset(args.source, spec=args.spec)
        report = label_index(ds, args.scale, args.out, args.labels, args.scheduler, workdir=args.workdir,
                             resume=args.resume, overwrite=args.overwrite, partitions=args.partitions,
                             progress=progress_of(args))
        print(report.summary())
        if not report.ok:
            print(f"the index is incomplete (its _meta.json says so): partial results kept in {report.work}; "
                  f"fix the failed shards' cause and run the same command with --resume")
        return 0 if report.ok else 1
