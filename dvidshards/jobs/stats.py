"""Per-body statistics and a label index of a whole export, one task per shard.

Both jobs read every record of a scale once, decompress its block and count it with the
``blockstats`` kernel (no voxel is written). Per chunk that gives, per entry of the block
label list, (supervoxel, body, voxels, exact voxel box); bodies come from the records'
agglomerated lists, the supervoxels themselves or a mapping.

* :func:`body_stats` - per body: voxels, supervoxels, chunks and bounding box (DVID's
  ``/sizes``, neuclease's ``fetch_sizes``).
* :func:`label_index` - a Parquet dataset of (body, supervoxel, chunk_x, chunk_y, chunk_z,
  voxels): DVID's ``LabelIndex`` for every body at once (read back with
  :class:`dvidshards.query.BodyIndex`).

The per-shard functions :func:`shard_body_stats` and :func:`shard_label_index` are plain
``(dataset, scale, shard origin) -> pyarrow.Table`` calls, so any runner can wrap them. Here they
run through :func:`dvidshards.jobs.run_tasks` (serially or on dask); each writes its partial
result to a work directory (temp file + ``os.replace``: a failed task writes nothing), and
the partials reduce as a tree: groups of ``FAN_IN`` files merge into one, level by level,
and the last level is split into hash buckets of the body id, so no task holds more than one
shard or one bucket of a group. ``resume`` skips shards whose partial file exists. The work
directory must be visible to every worker (local disk for a ``LocalCluster``, a shared file
system on a cluster).

Background (label 0) is not reported: absent chunks hold it implicitly.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
import time
import uuid
import warnings
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..dataset import Dataset
from ..errors import BlockDecodeError, ShardFormatError, SpecError
from ..formats.arrowipc import R_NLAB, R_NSV
from ..formats.blockstats import BlockError, batch_stats
from ..formats.labelindex import INDEX_FORMAT, INDEX_SCHEMA, bucket_name, bucket_of, labels_id
from ..formats.labels import Agglomerated, Mapped, Supervoxels, as_labels
from ..formats.records import list_values
from .runner import run_tasks

__all__ = [
    "FAN_IN",
    "INDEX_SCHEMA",
    "STATS_SCHEMA",
    "IndexReport",
    "LabelIndexCommand",
    "StatsCommand",
    "body_stats",
    "bucket_of",
    "label_index",
    "shard_body_stats",
    "shard_label_index",
]

FAN_IN = 64  # partial files merged by one reduce task
_COARSE_BITS = 6  # row groups of the shard partials when they are merged in a tree

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
    """Voxel [lo, hi) of the volume, intersected with ``box``."""
    lo = np.asarray(s.voxel_offset, np.int64)
    hi = lo + np.asarray(s.size, np.int64)
    if box is not None:
        b = np.asarray(box, np.int64)
        if b.shape != (2, 3):
            raise SpecError(f"box must be [[x0, y0, z0], [x1, y1, z1]], got {box!r}")
        lo, hi = np.maximum(lo, b[0]), np.minimum(hi, b[1])
    return lo, hi


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


def _write_atomic(path: str, write) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _write_bucketed(path: str, tables, kind: str, bits: int) -> int:
    """Write a partial file from tables (written one at a time): one row group per bucket.

    ``tables`` is a table or an iterable of them whose buckets do not interleave (a merge
    writes its groups in order). The file's key-value metadata lists each row group's bucket.
    """
    key, schema, _ = _KIND[kind]
    if isinstance(tables, pa.Table):
        tables = [tables]
    buckets: list[int] = []
    rows = 0

    def write(tmp):
        nonlocal rows
        with pq.ParquetWriter(tmp, schema, compression="zstd") as w:
            for table in tables:
                if not table.num_rows:
                    continue
                b = bucket_of(table[key].to_numpy(), bits)
                if not (np.diff(b) >= 0).all():
                    order = np.argsort(b, kind="stable")
                    table, b = table.take(order), b[order]
                ub = np.unique(b)
                bounds = np.searchsorted(b, np.append(ub, 1 << bits))
                for k in range(len(ub)):
                    part = table.slice(int(bounds[k]), int(bounds[k + 1] - bounds[k]))
                    w.write_table(part, row_group_size=max(part.num_rows, 1))
                buckets.extend(ub.tolist())
                rows += table.num_rows
            w.add_key_value_metadata({"dvidshards": json.dumps({"bits": bits, "buckets": buckets})})

    _write_atomic(path, write)
    return rows


def _file_meta(f: pq.ParquetFile) -> dict:
    return json.loads(f.metadata.metadata[b"dvidshards"])


def _read_bucket(path: str, bits: int, bucket: int, kind: str) -> pa.Table:
    """The rows of one bucket (at ``bits`` resolution) of a partial file."""
    key, schema, _ = _KIND[kind]
    f = pq.ParquetFile(path)
    meta = _file_meta(f)
    fb, groups = meta["bits"], meta["buckets"]
    if fb >= bits:
        rgs = [k for k, g in enumerate(groups) if g >> (fb - bits) == bucket]
        t = f.read_row_groups(rgs) if rgs else schema.empty_table()
    else:  # a coarser file: read the group holding the bucket, keep its rows
        rgs = [k for k, g in enumerate(groups) if g == bucket >> (bits - fb)]
        t = f.read_row_groups(rgs) if rgs else schema.empty_table()
        if t.num_rows:
            t = t.filter(pa.array(bucket_of(t[key].to_numpy(), bits) == bucket))
    return t.replace_schema_metadata(None).cast(schema)  # no-op: the files have this schema


@dataclass(frozen=True)
class _Job:
    ds: object
    scale: int
    labels: object
    box: tuple | None
    kind: str
    work: str
    bits: int  # final partition bits
    shard_bits: int  # row-group partition of the shard partials
    out: str = ""  # label index: the output folder


def _shard_path(job: _Job, origin) -> str:
    return os.path.join(job.work, "shards", f"{origin[0]}_{origin[1]}_{origin[2]}.parquet")


def _shard_task(job: _Job, origin) -> int:
    if job.kind == "stats":
        t = shard_body_stats(job.ds, job.scale, origin, job.labels, job.box)
    else:
        t = shard_label_index(job.ds, job.scale, origin, job.labels)
    return _write_bucketed(_shard_path(job, origin), t, job.kind, job.shard_bits)


def _merge_task(job: _Job, item) -> int:
    """One reduce-tree node: item = (level, k, input paths) -> level file k."""
    level, k, inputs = item
    _, _, merge = _KIND[job.kind]
    out = os.path.join(job.work, f"L{level}", f"{k:06d}.parquet")
    in_bits = min(_file_meta(pq.ParquetFile(p))["bits"] for p in inputs)
    # one input bucket group at a time, merged and written before the next is read
    groups = (merge([_read_bucket(p, in_bits, g, job.kind) for p in inputs]) for g in range(1 << in_bits))
    return _write_bucketed(out, groups, job.kind, job.bits)


def _final_task(job: _Job, inputs, bucket: int):
    """One output bucket from the last level's files."""
    _, _, merge = _KIND[job.kind]
    t = merge([_read_bucket(p, job.bits, bucket, job.kind) for p in inputs])
    if job.kind == "stats":
        return _finish_stats(t)
    t = _finish_index(t)
    path = os.path.join(job.out, bucket_name(bucket, job.bits))
    os.makedirs(os.path.dirname(path), exist_ok=True)

    def write(tmp):
        pq.write_table(t, tmp, compression="zstd", row_group_size=_INDEX_ROW_GROUP)

    _write_atomic(path, write)
    return t.num_rows


_INDEX_ROW_GROUP = 32768


# --------------------------------------------------------------------------- the job


def _default_bits(n_shards: int) -> int:
    # about 16 shards' worth of rows per output bucket
    return int(min(12, max(0, int(np.ceil(np.log2(max(n_shards, 1) / 16))))))


def _origins(ds, s, box) -> list[tuple[int, int, int]]:
    origins = [(int(o[0]), int(o[1]), int(o[2])) for o in ds.shards(s)]
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


@dataclass
class IndexReport:
    """What a :func:`label_index` or :func:`body_stats` run did.

    Attributes
    ----------
    path : str
        The output (label-index folder or statistics file), or "" when only returned.
    rows : int
        Rows written.
    shards : int
        Shards of the scale (inside the box).
    failed : dict
        ``{shard path: "TypeName: message"}`` of shards whose task failed: their data are
        missing from the output; a ``resume`` run retries them.
    skipped : int
        Shards skipped on resume (their partial results existed).
    elapsed : float
        Seconds.
    """

    path: str = ""
    rows: int = 0
    shards: int = 0
    failed: dict = field(default_factory=dict)
    skipped: int = 0
    elapsed: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failed

    def summary(self) -> str:
        lines = [f"{self.rows} rows from {self.shards} shards ({self.skipped} resumed, "
                 f"{len(self.failed)} failed) in {self.elapsed:.1f} s" + (f" -> {self.path}" if self.path else "")]
        lines += [f"  FAILED {k}: {v}" for k, v in self.failed.items()]
        return "\n".join(lines)


def _run(ds, scale, labels, box, kind, work, resume, scheduler, partitions, progress, fan_in, out=""):
    """Map shards to partial files, reduce them as a tree, finish per bucket.

    Returns (final results {bucket: result}, IndexReport without path/rows).
    """
    t0 = time.perf_counter()
    ds = _dataset(ds)
    s = ds.scale(scale)
    src = as_labels(labels)
    if isinstance(src, (Agglomerated, Supervoxels)):
        labels = src.name
    box = None if box is None else tuple(tuple(int(v) for v in c) for c in np.asarray(box, np.int64))
    origins = _origins(ds, s, box)
    bits = _default_bits(len(origins)) if partitions is None else _partition_bits(partitions)
    shard_bits = bits if len(origins) <= fan_in else min(bits, _COARSE_BITS)
    ident = {"kind": kind, "scale": s.index, "box": box, "bits": bits, "shard_bits": shard_bits,
             "chunk_size": list(s.chunk_size), **labels_id(src)}
    os.makedirs(os.path.join(work, "shards"), exist_ok=True)
    id_path = os.path.join(work, "job.json")
    if resume and os.path.exists(id_path):
        with open(id_path) as f:
            old = json.load(f)
        if old != json.loads(json.dumps(ident)):
            raise SpecError(f"{work}: partial results were made with other parameters ({old}); "
                            f"remove the folder or run with the same ones ({ident})")
    else:
        for name in os.listdir(os.path.join(work, "shards")):  # not resuming: start clean
            os.remove(os.path.join(work, "shards", name))
        with open(id_path, "w") as f:
            json.dump(ident, f)
    job = _Job(ds, s.index, labels, box, kind, work, bits, shard_bits, out)
    done = {o for o in origins if os.path.exists(_shard_path(job, o))} if resume else set()
    rep = run_tasks(functools.partial(_shard_task, job), origins, scheduler=scheduler,
                    desc=f"{s.folder} shards", done=done, progress=progress)
    failed = {ds.store.describe(s.stem(o) + ".arrow"): msg for o, msg in rep.failed.items()}
    files = [_shard_path(job, o) for o in origins if o in rep.results or o in done]

    level = 0
    while len(files) > fan_in:  # the reduce tree
        level += 1
        d = os.path.join(work, f"L{level}")
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        groups = [(level, k, tuple(files[i:i + fan_in])) for k, i in enumerate(range(0, len(files), fan_in))]
        r = run_tasks(functools.partial(_merge_task, job), groups, scheduler=scheduler,
                      desc=f"merge level {level}", progress=progress)
        _check_reduce(r)
        files = [os.path.join(d, f"{g[1]:06d}.parquet") for g in groups]
    if out:  # label index: drop the buckets of an earlier run before writing these
        for name in os.listdir(out):
            if name.startswith("bucket="):
                shutil.rmtree(os.path.join(out, name))
    final = run_tasks(functools.partial(_final_task, job, tuple(files)), list(range(1 << bits)),
                      scheduler=scheduler, desc="buckets", progress=progress)
    _check_reduce(final)
    report = IndexReport(shards=len(origins), failed=failed, skipped=len(rep.skipped),
                         elapsed=time.perf_counter() - t0)
    return final.results, report, job


def _check_reduce(r) -> None:
    if r.failed:
        item, msg = next(iter(r.failed.items()))
        raise RuntimeError(f"reduce failed for {len(r.failed)} task(s), first {item!r}: {msg}")


def _partition_bits(partitions: int) -> int:
    p = int(partitions)
    if p < 1 or p & (p - 1) or p > 1 << 12:
        raise SpecError(f"partitions must be a power of two in 1..4096, got {partitions!r}")
    return p.bit_length() - 1




# --------------------------------------------------------------------------- public API


def body_stats(ds, scale=0, labels="agglomerated", box=None, scheduler=None, *, workdir=None,
               resume: bool = False, partitions: int | None = None, progress: bool | None = None,
               fan_in: int = FAN_IN) -> pa.Table:
    """Per-body voxel counts, supervoxel counts, chunk counts and exact bounding boxes.

    Parameters
    ----------
    ds : Dataset or anything ``Dataset`` opens
        The export.
    scale : int
        Folder number (``s{scale}``).
    labels : "agglomerated", "supervoxels" or a mapping
        What a body is: the records' agglomerated labels, each supervoxel, or a supervoxel ->
        body mapping (LabelMapping, dict, (n, 2) array, Series or mapping file).
    box : [[x0, y0, z0], [x1, y1, z1]], optional
        Count only voxels inside this box (voxels, upper bound exclusive).
    scheduler : None, "local", "local:N", address or distributed.Client
        Where the per-shard tasks run (see :func:`dvidshards.jobs.run_tasks`).
    workdir : path, optional
        Folder for the partial results (visible to every worker). Default: a temporary folder,
        removed afterwards. A given folder is removed after a run with no failure.
    resume : bool
        Keep the partial results of shards already done in ``workdir``.
    partitions : int, optional
        Hash buckets of the reduce (a power of two); default from the number of shards.
    progress : bool, optional
        tqdm bars (default: on a terminal).
    fan_in : int
        Partial files merged per reduce task.

    Returns
    -------
    pyarrow.Table
        Columns ``label, voxels, supervoxels, chunks, x0, y0, z0, x1, y1, z1`` (box in voxels,
        upper bound exclusive), sorted by voxels (descending), then label. Shards that failed
        are named in the schema metadata (``b"failed_shards"``, JSON) and in a RuntimeWarning;
        their voxels are missing.
    """
    table, report = _body_stats(ds, scale, labels, box, scheduler, workdir, resume, partitions,
                                progress, fan_in)
    if report.failed:
        warnings.warn(f"body_stats: {len(report.failed)} shard(s) failed and are missing: "
                      + "; ".join(f"{k}: {v}" for k, v in report.failed.items()),
                      RuntimeWarning, stacklevel=2)
    return table


def _body_stats(ds, scale, labels, box, scheduler, workdir, resume, partitions, progress, fan_in):
    if resume and workdir is None:
        raise SpecError("resume needs a workdir holding the partial results of the earlier run")
    ds = _dataset(ds)
    work = os.fspath(workdir) if workdir is not None else tempfile.mkdtemp(prefix="dvidshards-stats-")
    os.makedirs(work, exist_ok=True)
    ok = False
    try:
        results, report, _ = _run(ds, scale, labels, box, "stats", work, resume, scheduler,
                                  partitions, progress, fan_in)
        parts = [t for t in results.values() if t.num_rows]
        t = pa.concat_tables(parts) if parts else STATS_SCHEMA.empty_table()
        t = t.sort_by([("voxels", "descending"), ("label", "ascending")])
        about = {"scale": ds.scale(scale).index, **labels_id(as_labels(labels)),
                 "box": None if box is None else np.asarray(box).tolist()}
        meta = {b"dvidshards": json.dumps(about).encode(),
                b"failed_shards": json.dumps(report.failed).encode()}
        t = t.replace_schema_metadata(meta)
        report.rows = t.num_rows
        ok = report.ok
        return t, report
    finally:
        if workdir is None or ok:
            shutil.rmtree(work, ignore_errors=True)




def label_index(ds, scale=0, out=None, labels="agglomerated", scheduler=None, *,
                resume: bool = False, partitions: int | None = None,
                progress: bool | None = None, fan_in: int = FAN_IN) -> IndexReport:
    """Write the label index of a scale: (body, supervoxel, chunk, voxels) as a Parquet dataset.

    The dataset is ``out/bucket=HH/part-0.parquet`` files, the rows of a body all in the file
    of ``bucket_of(body, bits)``, sorted by body, supervoxel and chunk in row groups of 32768
    rows, plus ``out/_meta.json`` (scale, label source, bits, completeness). Read it with
    :class:`dvidshards.query.BodyIndex` (``Dataset.body_index(out)``).

    Parameters
    ----------
    ds : Dataset or anything ``Dataset`` opens
    scale : int
    out : path
        Output folder: new, empty or an earlier label index (replaced). Partial results are
        kept in ``out/_work`` until the index is complete.
    labels, scheduler, partitions, progress, fan_in :
        See :func:`body_stats`.
    resume : bool
        Reuse the partial results of an earlier, unfinished run in ``out/_work``.

    Returns
    -------
    IndexReport
        Rows written, shards, failed shards (their rows are missing and ``_meta.json`` says
        ``"complete": false``; run again with ``resume=True`` to add them).
    """
    if out is None:
        raise SpecError("label_index needs out=, the folder to write")
    out = os.fspath(out)
    if os.path.exists(out) and not os.path.isdir(out):
        raise SpecError(f"{out}: exists and is not a folder")
    os.makedirs(out, exist_ok=True)
    meta_path = os.path.join(out, "_meta.json")
    others = [n for n in os.listdir(out) if not (n.startswith("bucket=") or n in ("_meta.json", "_work"))]
    if others:
        raise SpecError(f"{out}: not empty and not a label index (holds {others[:3]}); give a new folder")
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            old = json.load(f)
        if old.get("format") != INDEX_FORMAT:
            raise SpecError(f"{meta_path}: not a dvidshards label index")
    work = os.path.join(out, "_work")
    ds = _dataset(ds)
    s = ds.scale(scale)
    src = as_labels(labels)
    if os.path.exists(meta_path) and not os.path.exists(work):
        if resume and old.get("complete") and old.get("scale") == s.index and all(
                old.get(k) == v for k, v in labels_id(src).items()):
            return IndexReport(path=out, rows=old["rows"], shards=old["shards"], skipped=old["shards"])
        os.remove(meta_path)  # replacing a complete index: it is invalid until rewritten
    results, report, job = _run(ds, scale, labels, None, "index", work, resume, scheduler,
                                partitions, progress, fan_in, out=out)
    report.rows = int(sum(results.values()))
    report.path = out
    meta = {"format": INDEX_FORMAT, "version": 1, "scale": s.index, **labels_id(src),
            "bits": job.bits, "hash": "top bits of (body * 0x9E3779B97F4A7C15 mod 2**64) >> 48",
            "chunk_size": list(s.chunk_size), "voxel_offset": list(s.voxel_offset),
            "size": list(s.size), "rows": report.rows, "shards": report.shards,
            "complete": report.ok, "failed_shards": report.failed}

    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(meta, f, indent=1)

    _write_atomic(meta_path, write)
    if report.ok:
        shutil.rmtree(work, ignore_errors=True)
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
                   help="agglomerated (default), supervoxels, or a supervoxel->body mapping file")
    p.add_argument("--scheduler", default=None,
                   help="run the shard tasks on dask: local, local:N, or a scheduler address")
    p.add_argument("--resume", action="store_true",
                   help="keep the partial results of shards an earlier run finished")
    p.add_argument("--partitions", type=int, default=None, help="hash buckets (a power of two)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _progress(args):
    import sys

    return False if args.quiet else None if sys.stderr.isatty() else False


class StatsCommand:
    """``dvidshards stats SOURCE --scale 0 --out sizes.parquet``."""

    @staticmethod
    def add_arguments(p) -> None:
        _common(p)
        p.add_argument("--out", required=True, help="Parquet file to write (one row per body)")
        p.add_argument("--box", default=None, help="only voxels in x0,y0,z0,x1,y1,z1")

    @staticmethod
    def main(args) -> int:
        out = os.fspath(args.out)
        if not out.lower().endswith(".parquet"):
            raise SpecError(f"--out {out}: the file name must end in .parquet")
        folder = os.path.dirname(os.path.abspath(out))
        if not os.path.isdir(folder):
            raise SpecError(f"--out {out}: the folder {folder} does not exist")
        ds = Dataset(args.source, spec=args.spec)
        work = out + ".parts" if args.resume else None
        t, report = _body_stats(ds, args.scale, args.labels, _box_arg(args.box),
                                args.scheduler, work, args.resume, args.partitions,
                                _progress(args), FAN_IN)

        def write(tmp):
            pq.write_table(t, tmp, compression="zstd")

        _write_atomic(out, write)
        report.path = out
        print(report.summary())
        if not report.ok and work is not None:
            print(f"partial results kept in {work}: run again with --resume to add the failed shards")
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
        report = label_index(ds, args.scale, args.out, args.labels, args.scheduler,
                             resume=args.resume, partitions=args.partitions, progress=_progress(args))
        print(report.summary())
        if not report.ok:
            print(f"partial results kept in {os.path.join(args.out, '_work')}: run again with "
                  f"--resume to add the failed shards")
        return 0 if report.ok else 1
