"""Per-body reduces by hash bucket, shared by the jobs whose shard tasks emit rows keyed by body
(``stats``, ``label-index``):

1. **plan** (:func:`plan`): one :class:`ShardTask` per shard meeting the box, the bodies hashed
   into ``2**bits`` buckets (:func:`partition_bits`);
2. **run_task** (the job's): one shard's rows (:func:`shard_rows`) into a *partial file* of the
   work folder (:func:`write_partial`: Arrow IPC, record batch ``b`` holding bucket ``b``, so a
   reader fetches one bucket alone);
3. **reduce** (:func:`map_reduce`): ``fan_in`` partial files at a time merge into one, level by
   level (:class:`MergeTask`); then one :class:`BucketTask` per bucket writes
   ``bucket=HH/part-0.parquet``.

A job's :class:`Rows` say how its rows combine. No task holds more than one shard or bucket group.
The work folder records the job's parameters (``work.json``), so ``resume`` never mixes in
another run's partial results.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..dataset import Dataset
from ..errors import BlockDecodeError, OutputError, ShardFormatError, SpecError
from ..formats.arrowipc import R_NLAB, R_NSV
from ..formats.blockstats import BlockError, batch_stats
from ..formats.labelindex import bucket_name, bucket_of
from ..formats.labels import Agglomerated, LabelSource, Mapped, Supervoxels, as_labels
from ..formats.mapping import LabelMapping
from ..formats.multiscale import Scale
from ..formats.records import list_values
from ..stores import ByteStore, as_store
from .options import (
    add_box,
    add_dest,
    add_job_options,
    add_labels,
    add_scale,
    add_source,
    command_line,
    job_options,
)
from .output import LOCK, JobReport, Output
from .runner import TaskRunner, clear_work, remove_work

__all__ = ["FAN_IN", "META", "BucketTask", "Location", "MergeTask", "Rows", "ShardTask", "TableJob", "TableTotals",
           "add_arguments", "bucket_task", "label_source", "map_reduce", "merge_task", "open_source", "parameters",
           "partition_bits", "plan", "run_command", "run_dataset", "shard_origins", "shard_rows", "table_job",
           "write_partial"]

SourceLike = Dataset | str | os.PathLike[str]
LabelsLike = str | os.PathLike[str] | LabelSource | LabelMapping | Mapping[int, int] | np.ndarray
Location = str | os.PathLike[str] | dict[str, Any] | ByteStore  # a path, URL, kvstore spec or store
BoxLike = Sequence[Sequence[int]]  # [[x0, y0, z0], [x1, y1, z1]]
Box = tuple[tuple[int, ...], tuple[int, ...]]

KERNELS = ("dvidshards.formats.blockstats._batch_kernel", "dvidshards.formats.arrowipc._resolve",
           "dvidshards.formats.arrowipc._message", "dvidshards.formats.mapping._apply")
FAN_IN = 64  # partial files merged by one reduce task
COARSE_BITS = 6  # record batches of the shard partials when a merge tree follows
META = "_meta.json"  # an output dataset's own description (read by dvidshards.query.BodyIndex)
HASH = "top bits of (body * 0x9E3779B97F4A7C15 mod 2**64) >> 48"
_WORK_RECORD, _WORK_FORMAT = "work.json", "dvidshards-job-work"
_OWN = re.compile(r"shards|table|work\.json|L[0-9]+").fullmatch  # the work folder's names of these jobs
_BATCH = 512  # records decompressed and counted together
_IPC = pa.ipc.IpcWriteOptions(compression="zstd")


@dataclass(frozen=True, eq=False)
class Rows:
    """A job's rows: the body column, the partial schema, ``reduce`` (partial tables of the same
    bodies -> one; module level, so tasks pickle it), ``finish`` (a bucket's rows -> output rows)."""

    key: str
    schema: pa.Schema
    reduce: Callable[[list[pa.Table]], pa.Table]
    finish: Callable[[pa.Table], pa.Table]
    row_group: int


@dataclass
class TableTotals:
    """``JobReport.totals``: rows written, shards read, hash buckets, the work folder."""

    rows: int = 0
    shards: int = 0
    partitions: int = 0
    work: str = ""

    def to_json(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------- plan


def open_source(source: SourceLike, spec: Any) -> Dataset:
    if isinstance(source, Dataset):
        if spec is not None:
            raise SpecError("spec= is for an export given by its path or URL; this Dataset has its spec already")
        return source
    return Dataset(source, spec=spec)


def check_box(s: Scale, box: BoxLike | None) -> Box | None:
    if box is None:
        return None
    lo, hi = s.check_box(box)  # SpecError outside the volume
    return tuple(int(v) for v in lo), tuple(int(v) for v in hi)


def _bounds(s: Scale, box: BoxLike | None) -> tuple[np.ndarray, np.ndarray]:
    if box is not None:
        return s.check_box(box)
    lo = np.asarray(s.voxel_offset, np.int64)
    return lo, lo + np.asarray(s.size, np.int64)


def shard_origins(ds: Dataset, s: Scale, box: Box | None) -> list[tuple[int, int, int]]:
    """The shard files of the scale meeting the box."""
    origins = [(int(o[0]), int(o[1]), int(o[2])) for o in ds.shards(s)]  # a scale without a folder: SpecError
    if box is None:
        return origins
    lo, hi = _bounds(s, box)
    cs = np.asarray(s.chunk_size, np.int64)
    boxes = [s.shard_box(o) for o in origins]
    return [o for o, (a, b) in zip(origins, boxes, strict=True) if ((a * cs < hi) & (b * cs > lo)).all()]


def partition_bits(shards: int, partitions: int | None, fan_in: int) -> int:
    """Hash bits of the output: ``partitions`` (a power of two), by default ~16 shards per bucket."""
    if fan_in < 2:
        raise SpecError(f"fan_in must be at least 2, got {fan_in}")
    if partitions is None:
        return int(min(12, max(0, int(np.ceil(np.log2(max(shards, 1) / 16))))))
    p = int(partitions)
    if p < 1 or p & (p - 1) or p > 1 << 12:
        raise SpecError(f"partitions must be a power of two in 1..4096, got {partitions!r}")
    return p.bit_length() - 1


def label_source(labels: LabelsLike) -> LabelSource:
    """A mapping file is checked here, not held, and travels as its path: each worker loads it once."""
    src = as_labels(labels)
    if isinstance(src, Mapped):
        src.prepare()
    return src


def parameters(kind: str, s: Scale, box: Box | None, src: LabelSource, bits: int) -> dict:
    """What decides the output and the partial results (as JSON stores it)."""
    return json.loads(json.dumps({"kind": kind, "scale": s.index,
                                  "box": None if box is None else [list(box[0]), list(box[1])],
                                  "chunk_size": list(s.chunk_size), **src.identity(), "bits": bits}))


@dataclass(frozen=True)
class ShardTask:
    """One shard's rows into the partial file ``key`` of the work folder, in ``2**bits`` batches."""

    source: Dataset
    scale: int
    origin: tuple[int, int, int]
    labels: LabelSource
    box: Box | None
    work: ByteStore
    bits: int

    @property
    def key(self) -> str:
        return "shards/{}_{}_{}.arrow".format(*self.origin)

    def __str__(self) -> str:  # the shard file, as failures name it
        return self.source.store.describe(self.source.scale(self.scale).stem(self.origin) + ".arrow")


def plan(ds: Dataset, s: Scale, origins: Sequence[tuple[int, int, int]], *, labels: LabelSource,
         box: Box | None, work: ByteStore, bits: int, fan_in: int) -> Iterator[ShardTask]:
    """One task per shard; fewer batches per partial file when a merge tree follows."""
    shard_bits = bits if len(origins) <= fan_in else min(bits, COARSE_BITS)
    for o in origins:
        yield ShardTask(ds, s.index, o, labels, box, work, shard_bits)


# --------------------------------------------------------------------------- one shard's rows


def runs(keys: list[np.ndarray]) -> np.ndarray:
    """Start of each run of equal rows in sorted key columns."""
    n = len(keys[0])
    if not n:
        return np.zeros(0, np.int64)
    new = np.zeros(n, bool)
    new[0] = True
    for k in keys:
        new[1:] |= k[1:] != k[:-1]
    return np.flatnonzero(new)


def shard_rows(ds: Dataset, scale: int, origin, labels: LabelsLike, box: BoxLike | None):
    """Per block-label entry of one shard holding voxels inside the box, label 0 left out: ``(record,
    supervoxel, body, voxels, boxes (n, 6) absolute, coords (records, 3))``. Memory: the shard and
    one batch of decompressed blocks."""
    s = ds.scale(scale)
    src = as_labels(labels)
    t = ds.shard(s, origin).table()
    coords = np.asarray(t.coords, np.int64)
    cs = np.asarray(s.chunk_size, np.int64)
    vlo, vhi = _bounds(s, box)
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
        try:
            blk, ent, sv, vox, bx = batch_stats(np.frombuffer(b"".join(blocks), np.uint8), offs, lo[idx], hi[idx],
                                                nsv[idx])
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


# --------------------------------------------------------------------------- partial files


def write_partial(store: ByteStore, key: str, tables: pa.Table | Iterable[pa.Table], rows: Rows, bits: int) -> int:
    """The partial file ``key``: exactly ``2**bits`` record batches, batch ``b`` holding bucket
    ``b``, from ``tables`` in bucket order; published whole. Returns the rows written."""
    if isinstance(tables, pa.Table):
        tables = [tables]
    empty = pa.RecordBatch.from_arrays([pa.array([], f.type) for f in rows.schema], schema=rows.schema)
    head = rows.schema.with_metadata({b"dvidshards": json.dumps({"bits": bits}).encode()})
    n = nxt = 0
    with store.writer(key) as sink, pa.ipc.new_file(sink, head, options=_IPC) as w:
        for table in tables:
            if not table.num_rows:
                continue
            b = bucket_of(table[rows.key].to_numpy(), bits)
            if (np.diff(b) < 0).any():
                order = np.argsort(b, kind="stable")
                table, b = table.take(order), b[order]
            first, last = int(b[0]), int(b[-1])
            if first < nxt:
                raise ValueError(f"{key}: the tables of a partial file must come in bucket order")
            for _ in range(nxt, first):
                w.write_batch(empty)
            bounds = np.searchsorted(b, np.arange(first, last + 2))
            for k in range(last - first + 1):
                m = int(bounds[k + 1] - bounds[k])
                w.write_batch(table.slice(int(bounds[k]), m).combine_chunks().to_batches()[0] if m else empty)
            nxt = last + 1
            n += table.num_rows
        for _ in range(nxt, 1 << bits):
            w.write_batch(empty)
    return n


class _Partial:
    """A partial file read by bucket: its footer read, batches fetched on demand."""

    def __init__(self, file: Any, where: str, rows: Rows):
        self.rows = rows
        try:
            self.reader = pa.ipc.open_file(file)
            self.bits = int(json.loads(self.reader.schema.metadata[b"dvidshards"])["bits"])
            if self.reader.num_record_batches != 1 << self.bits:
                raise ValueError(f"{self.reader.num_record_batches} record batches, expected {1 << self.bits}")
        except (pa.ArrowInvalid, KeyError, TypeError, ValueError) as e:
            raise ShardFormatError(f"{where}: not a partial-result file of this job ({e})") from None

    def bucket(self, bits: int, b: int) -> pa.Table:
        """The rows of bucket ``b`` of a ``bits``-bit partition."""
        fb = self.bits
        if fb >= bits:
            idx = range(b << (fb - bits), (b + 1) << (fb - bits))
        else:  # a coarser file: the batch holding the bucket, then its rows
            idx = range(b >> (bits - fb), (b >> (bits - fb)) + 1)
        t = pa.Table.from_batches([self.reader.get_batch(i) for i in idx]).replace_schema_metadata(None)
        if fb < bits and t.num_rows:
            t = t.filter(pa.array(bucket_of(t[self.rows.key].to_numpy(), bits) == b))
        return t


@contextlib.contextmanager
def _partials(store: ByteStore, keys: Iterable[str], rows: Rows) -> Iterator[list[_Partial]]:
    with contextlib.ExitStack() as files:
        yield [_Partial(files.enter_context(store.open(k)), store.describe(k), rows) for k in keys]


# --------------------------------------------------------------------------- reduce


@dataclass(frozen=True)
class MergeTask:
    """One node of the reduce tree: partial files merged into ``L{level}/{group}.arrow``."""

    rows: Rows
    work: ByteStore
    inputs: tuple[str, ...]
    level: int
    group: int
    bits: int

    @property
    def key(self) -> str:
        return f"L{self.level}/{self.group:06d}.arrow"

    def __str__(self) -> str:
        return f"merge level {self.level}, group {self.group}"


def merge_task(task: MergeTask) -> int:
    """A bucket group at a time, reduced and written before the next is read."""
    with _partials(task.work, task.inputs, task.rows) as parts:
        bits = min(p.bits for p in parts)
        groups = (task.rows.reduce([p.bucket(bits, g) for p in parts]) for g in range(1 << bits))
        return write_partial(task.work, task.key, groups, task.rows, task.bits)


@dataclass(frozen=True)
class BucketTask:
    """The reduce's last step: one output bucket from the last level's partial files."""

    rows: Rows
    work: ByteStore
    dest: ByteStore
    inputs: tuple[str, ...]
    bucket: int
    bits: int

    def __str__(self) -> str:
        return f"bucket {self.bucket}"


def bucket_task(task: BucketTask) -> int:
    with _partials(task.work, task.inputs, task.rows) as parts:
        t = task.rows.finish(task.rows.reduce([p.bucket(task.bits, task.bucket) for p in parts]))
    with task.dest.writer(bucket_name(task.bucket, task.bits)) as f:
        pq.write_table(t, f, compression="zstd", row_group_size=task.rows.row_group)
    return t.num_rows


def map_reduce(out: Output, tr: TaskRunner, run_task: Callable[[ShardTask], int], tasks: Sequence[ShardTask], *,
               rows: Rows, work: ByteStore, dest: ByteStore, bits: int, fan_in: int, resume: bool,
               partial_ok: bool) -> dict[int, int] | None:
    """The shard tasks (``resume`` keeps an earlier run's files), then the reduce tree into ``2**bits``
    buckets in ``dest``. A failed shard stops before the reduce unless ``partial_ok`` (its rows go
    missing). Returns ``{bucket: rows}``, or None when not every bucket was written."""
    names = set(work.list_sync("shards")) if resume else set()
    done = {t for t in tasks if t.key.rpartition("/")[2] in names}
    desc = f"s{tasks[0].scale} shards" if tasks else "shards"
    ph = tr.run(run_task, tasks, desc=desc, done=done, kernels=KERNELS)
    out.add(ph)
    if ph.failed and not partial_ok:
        return None
    files = [t.key for t in tasks if t in ph.results or t in done]
    level = 0
    while len(files) > fan_in:  # the reduce tree
        level += 1
        work.delete_prefix_sync(f"L{level}")
        merges = [MergeTask(rows, work, tuple(files[i:i + fan_in]), level, k, bits)
                  for k, i in enumerate(range(0, len(files), fan_in))]
        ph = tr.run(merge_task, merges, desc=f"merge level {level}")
        out.add(ph)
        if ph.failed:
            return None
        files = [m.key for m in merges]
    finals = [BucketTask(rows, work, dest, tuple(files), b, bits) for b in range(1 << bits)]
    ph = tr.run(bucket_task, finals, desc="buckets")
    out.add(ph)
    return None if ph.failed else {t.bucket: n for t, n in ph.results.items()}


# --------------------------------------------------------------------------- the work folder


def start_work(work: ByteStore, params: dict, *, resume: bool, overwrite: bool) -> None:
    """A (locked) work folder is new, empty or holds this job's partial results: then it needs
    ``resume`` with the same parameters, or ``overwrite`` (cleared first)."""
    names = [n for n in work.list_sync("") if n != LOCK and not n.startswith(".")]
    if names:
        try:
            rec = json.loads(work.get_sync(_WORK_RECORD) or b"null") if _WORK_RECORD in names else None
        except ValueError:
            rec = None
        where = work.describe("").rstrip("/")
        if not isinstance(rec, dict) or rec.get("format") != _WORK_FORMAT:
            raise OutputError(f"work folder {where}: not empty and not a dvidshards work folder (holds "
                              f"{', '.join(names[:3])}); give a new or empty one")
        if overwrite:
            clear_work(work, _OWN)
        elif not resume:
            raise OutputError(f"work folder {where}: holds the partial results of an earlier run; --resume to "
                              f"finish it, --overwrite to start again")
        elif rec.get("job") != params:
            raise OutputError(f"work folder {where}: its partial results were made with other parameters "
                              f"({rec.get('job')}); run with the same ones, or --overwrite")
    work.put_sync(_WORK_RECORD, (json.dumps({"format": _WORK_FORMAT, "job": params}, indent=1) + "\n").encode())


# --------------------------------------------------------------------------- a dataset output


def own(name: str) -> bool:
    """The top-level names of a dataset output that are the job's (``overwrite`` deletes them)."""
    return name.startswith("bucket=") or name == META


def dataset_meta(fmt: str, s: Scale, params: dict, totals: TableTotals, failed: Mapping[str, str],
                 **more: Any) -> dict:
    """A dataset's ``_meta.json`` (``BodyIndex`` reads its keys)."""
    labels = {k: v for k, v in params.items() if k not in ("kind", "scale", "box", "chunk_size", "bits")}
    return {"format": fmt, "version": 1, "scale": s.index, **labels, "bits": params["bits"], "hash": HASH,
            "chunk_size": list(s.chunk_size), "voxel_offset": list(s.voxel_offset), "size": list(s.size),
            "box": params["box"], **more, "rows": totals.rows, "shards": totals.shards, "complete": not failed,
            "failed_shards": dict(failed), "job": params}


def kept(out: Output, totals: TableTotals, *, allow_partial: bool) -> JobReport:
    """Resuming a complete output: its figures kept."""
    prev = out.previous or {}
    totals.rows = int((prev.get("totals") or {}).get("rows", 0))
    out.report.tasks = out.report.skipped = int((prev.get("tasks") or {}).get("total", totals.shards))
    return out.finish(totals=totals, notes=[f"already complete: {totals.rows:,} rows kept"],
                      allow_partial=allow_partial)


@dataclass
class TableJob:
    """A ``stats`` or ``label-index`` run: the scale, its shards, the output and its work folder."""

    ds: Dataset
    s: Scale
    box: Box | None
    labels: LabelSource
    origins: list[tuple[int, int, int]]
    out: Output
    work: ByteStore
    totals: TableTotals
    fan_in: int
    resume: bool
    overwrite: bool
    allow_partial: bool

    def run(self, tr: TaskRunner, run_task: Callable[[ShardTask], int], reduce: Callable[..., JobReport],
            **kw: Any) -> JobReport:
        """``reduce(self, tr, run_task, tasks, **kw)`` in the locked output; the work folder emptied
        when complete. With workers elsewhere, a folder made for the check that they see it goes."""
        for store in (self.out.folder, self.work):
            path = store.local_path()
            made = path is not None and not os.path.exists(path)
            try:
                tr.check_shared(store)
            except BaseException:
                if made:
                    with contextlib.suppress(OSError):
                        os.rmdir(path)  # type: ignore[arg-type]
                raise
        with self.out:
            tasks = list(plan(self.ds, self.s, self.origins, labels=self.labels, box=self.box, work=self.work,
                              bits=self.out.parameters["bits"], fan_in=self.fan_in))
            report = reduce(self, tr, run_task, tasks, **kw)
        if report.complete:
            remove_work(self.work, _OWN)
        return report


def table_job(job: str, kind: str, source: SourceLike, dest: Location, *, scale: int, labels: LabelsLike,
              box: BoxLike | None, spec: Any, workdir: Location | None, resume: bool, overwrite: bool,
              allow_partial: bool, partitions: int | None, fan_in: int, command: str | None,
              one_file: bool = False) -> TableJob:
    """Every check before any work; ``one_file``: a ``.parquet`` destination is one file."""
    ds = open_source(source, spec)
    s = ds.scale(scale)
    box = check_box(s, box)
    src = label_source(labels)
    origins = shard_origins(ds, s, box)
    bits = partition_bits(len(origins), partitions, fan_in)
    store = as_store(dest, writable=True)
    one_file = one_file and store.describe("").rstrip("/").lower().endswith(".parquet")
    out = Output(store, job=job, parameters=parameters(kind, s, box, src, bits), source=ds, scales=[s.index],
                 command=command, resume=resume, overwrite=overwrite, own=own, kind="file" if one_file else "folder",
                 workdir=workdir, work=True)
    assert out.workdir is not None  # work=True
    totals = TableTotals(shards=len(origins), partitions=1 << bits, work=out.workdir.describe("").rstrip("/"))
    return TableJob(ds, s, box, src, origins, out, out.workdir, totals, fan_in, resume, overwrite, allow_partial)


def run_dataset(job: TableJob, tr: TaskRunner, run_task: Callable[[ShardTask], int], tasks: Sequence[ShardTask], *,
                rows: Rows, fmt: str, what: str, partial_ok: bool, **more: Any) -> JobReport:
    """A folder output: map, reduce, ``_meta.json`` (written last), the report."""
    out, totals = job.out, job.totals
    store, params = out.store, out.parameters
    if out.previous is not None and out.previous.get("complete") and store.exists_sync(META):
        return kept(out, totals, allow_partial=job.allow_partial)
    start_work(job.work, params, resume=job.resume, overwrite=job.overwrite)
    store.delete_sync(META)  # not a complete dataset until its _meta.json is written again
    out.update(work=totals.work)
    got = map_reduce(out, tr, run_task, tasks, rows=rows, work=job.work, dest=store, bits=params["bits"],
                     fan_in=job.fan_in, resume=job.resume, partial_ok=partial_ok)
    if got is not None:
        totals.rows = int(sum(got.values()))
        meta = dataset_meta(fmt, job.s, params, totals, out.report.failed, **more)
        store.put_sync(META, (json.dumps(meta, indent=1) + "\n").encode())
        notes = [f"{totals.rows:,} {what} in {totals.partitions} hash buckets from {totals.shards:,} shards"]
    else:
        notes = ["no rows written: a shard or a reduce step failed"]
    if out.report.failed:
        notes.append(f"partial results kept in {totals.work}")
    return out.finish(totals=totals, notes=notes, allow_partial=job.allow_partial)


# --------------------------------------------------------------------------- command line


def add_arguments(p, *, what: str) -> None:
    add_source(p)
    add_dest(p, what=what)
    add_scale(p)
    add_labels(p)
    add_box(p)
    p.add_argument("--partitions", type=int, default=None, metavar="N",
                   help="hash buckets of the output (a power of two; default from the number of shards)")
    add_job_options(p)


def run_command(job: Callable[..., JobReport], name: str, args) -> int:
    """0 when complete, 1 when not (the summary says why and how to finish)."""
    skip = [k for k, v in (("scale", 0), ("labels", "agglomerated")) if getattr(args, k) == v]
    report = job(args.source, args.dest, scale=args.scale, labels=args.labels, box=args.box,
                 partitions=args.partitions, spec=args.spec, allow_partial=True,
                 command=command_line(name, args, skip=skip), **job_options(args))
    print(report.summary())
    return 0 if report.ok else 1
