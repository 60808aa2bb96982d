"""Convert an export to neuroglancer precomputed or zarr v3: every scale of its spec.

Precomputed: ``compressed_segmentation`` chunks in ``neuroglancer_uint64_sharded_v1`` shards (by
default the export's sharding: one DVID shard is one output shard); zarr v3: one
``sharding_indexed`` array per scale, zstd inner chunks, an OME-Zarr ``multiscales`` entry. The
layouts, encoders and shard writers are :mod:`dvidshards.jobs.layouts`.

* **plan** (:func:`plan`): one :class:`Task` per source shard file, writing all of its output
  shards, or on a *grouped* scale (DVID's old names at coarse scales, a coarser output sharding)
  one per output shard, reading every file meeting it. No two tasks write one output shard.
* **task** (:func:`run_task`): interior chunks transcoded from the DVID blocks without decoding
  voxels (byte-identical to TensorStore's encoder); edge chunks, chunks cut by ``box``, zarr3 and
  ``encoder="tensorstore"`` decoded and encoded by TensorStore. A precomputed shard streams into
  the store's writer in file order (published whole, never held in memory); a zarr3 shard is one
  transaction of TensorStore's sharded driver. Background chunks are never written.
* **reduce** (:func:`reduce`): the counts summed; ``verify=N`` reads N chunks per scale back.

Scales the spec lists above the finest one held are made first by ``downsample`` into
``WORKDIR/scales`` and converted with the export as one pyramid. ``resume`` finishes either stage:
output shards holding the expected number of chunks are kept.
"""

from __future__ import annotations

import itertools
import os
import resource
import struct
import tempfile
import threading
import time
import uuid
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields
from functools import partial
from typing import Any

import numpy as np

from ..dataset import Dataset
from ..errors import OutputError, SpecError
from ..formats.cseg import is_background
from ..formats.labels import as_labels
from ..formats.sharding import ShardingSpec, compressed_morton_code
from ..stores import ByteStore, as_store
from .layouts import (
    FORMATS,
    Box,
    ConvertPlanError,
    ScaleLayout,
    Stager,
    TsGzip,
    create_output,
    existing_chunks,
    file_order,
    int3,
    scale_boxes,
    scale_layout,
    transcode_chunk,
    window,
    write_precomputed_shard,
    write_zarr3_shard,
)
from .options import (
    add_box,
    add_dest,
    add_job_options,
    add_labels,
    add_scales,
    add_source,
    box_of,
    command_line,
    job_options,
    scales_of,
)
from .output import JobReport, Output, work_folder
from .readback import compare_chunks, open_scale
from .runner import TaskRunner, remove_work, scheduler_of

__all__ = ["ConvertCommand", "ConvertResult", "ConvertTotals", "Job", "Task", "convert", "plan", "reduce",
           "run_task"]

ENCODERS = ("transcode", "tensorstore")
KERNELS = ("dvidshards.formats.cseg._transcode_kernel", "dvidshards.formats.codec._decode_kernel",
           "dvidshards.formats.arrowipc._resolve", "dvidshards.formats.arrowipc._message",
           "dvidshards.formats.mapping._apply")
STAGED = "scales"  # in the work folder: the scales made first

# --------------------------------------------------------------------------- task records


@dataclass(frozen=True, eq=False)
class Job:
    """What every task of one conversion shares (pickled with each)."""

    source: Dataset  # the pyramid read: the export, and the scales made first
    dest: ByteStore
    format: str
    labels: Any  # "agglomerated", "supervoxels" or a mapping
    encoder: str = "transcode"
    gzip_level: int = 1
    resume: bool = False
    token: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass(frozen=True)
class Task:
    """The output shards of source shard ``sources[0]``, or on a grouped scale output shard ``shard``
    (box index) from the source shards meeting it. ``clip``: the absolute voxel box converted."""

    job: Job = field(compare=False)
    layout: ScaleLayout = field(compare=False)
    scale: int
    sources: tuple[tuple[int, int, int], ...]
    shard: tuple[int, int, int] | None = None
    clip: Box | None = None

    @property
    def key(self) -> tuple:  # (scale, source origin), or (scale, output shard box index)
        return (self.scale, self.sources[0] if self.shard is None else self.shard)

    @property
    def name(self) -> str:
        """As failures name it: ``s1/0_0_2048``, or the output shard (``s7/0.shard``)."""
        if self.shard is None:
            return "s{}/{}_{}_{}".format(self.scale, *self.sources[0])
        sp = self.layout
        rel = np.asarray(self.shard, np.int64) * np.asarray(sp.shard_chunks, np.int64)
        return f"s{self.scale}/{sp.shard_file(rel).split('/', 1)[1]}"


@dataclass
class ConvertResult:
    """What one task did; summed, ``report.totals``."""

    records: int = 0
    written: int = 0
    transcoded: int = 0
    encoded: int = 0  # by TensorStore
    background: int = 0
    outside: int = 0
    shards_written: int = 0
    shards_skipped: int = 0
    encoded_bytes: int = 0
    cpu_s: float = 0.0
    wall_s: float = 0.0
    max_rss_mib: float = 0.0

    def to_json(self) -> dict:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in self.__dict__.items()}

    def add(self, o: ConvertResult) -> None:
        for f in fields(ConvertResult):
            a, b = getattr(self, f.name), getattr(o, f.name)
            setattr(self, f.name, max(a, b) if f.name == "max_rss_mib" else a + b)


@dataclass
class ConvertTotals(ConvertResult):
    """The tasks' figures summed, the read-back check, the downsample stage's totals (``made``)."""

    verified: int = 0
    verified_background: int = 0  # of ``verified``: chunks the source holds none of, read back as 0
    mismatches: list = field(default_factory=list)
    made: dict | None = None


# --------------------------------------------------------------------------- plan


def plan(source: Dataset, layouts: dict[int, ScaleLayout], *, job: Job, boxes: dict[int, Box] | None = None
         ) -> Iterator[Task]:
    """Scale by scale, a task per source shard file meeting the box, or on a grouped scale per output
    shard meeting it."""
    boxes = boxes or {}
    for k, sp in layouts.items():
        clip = boxes.get(k)
        c = sp.chunk
        origins = [int3(o) for o in source.shards(k)]
        if clip is not None:
            origins = [o for o in origins if all(o[a] < clip[1][a] and o[a] + sp.cell * c > clip[0][a]
                                                 for a in range(3))]
        if not sp.grouped:
            for o in origins:
                yield Task(job, sp, k, (o,), clip=clip)
            continue
        box = np.asarray(sp.shard_chunks, np.int64)
        lo_v, hi_v = window(sp, clip)
        off = np.asarray(sp.voxel_offset, np.int64)
        first = np.maximum((lo_v - off) // c, 0)  # the chunks meeting the box, relative
        end = np.minimum(-(-(hi_v - off) // c), sp.grid)
        groups: dict[tuple[int, int, int], set] = {}
        for o in origins:
            lo = np.maximum(np.asarray(o, np.int64) // c - sp.chunk_offset, first)
            hi = np.minimum(np.asarray(o, np.int64) // c - sp.chunk_offset + sp.cell, end)
            if (lo >= hi).any():
                continue  # a file wholly outside the volume (or the box)
            for b in itertools.product(*(range(int(lo[a] // box[a]), int((hi[a] - 1) // box[a]) + 1)
                                         for a in range(3))):
                groups.setdefault(tuple(b), set()).add(o)  # type: ignore[arg-type]
        for b in sorted(groups):
            yield Task(job, sp, k, tuple(sorted(groups[b])), shard=b, clip=clip)


# --------------------------------------------------------------------------- one task


class _Worker:
    """A conversion's state per process (TensorStore context, label source) and per thread
    (stagers, gzip, decode buffer)."""

    def __init__(self, job: Job):
        import tensorstore as ts

        self.labels = as_labels(job.labels)
        self.context = ts.Context({"cache_pool": {"total_bytes_limit": 0}})
        self.local = threading.local()

    def stager(self, format: str, sp: ScaleLayout) -> Stager:
        stagers = self.local.__dict__.setdefault("stagers", {})
        if sp.index not in stagers:
            stagers[sp.index] = Stager(format, sp, self.context)
        return stagers[sp.index]

    def gzip_index(self) -> TsGzip:
        if not hasattr(self.local, "gzip"):
            self.local.gzip = TsGzip(self.context)
        return self.local.gzip

    def scratch(self, chunk: int) -> np.ndarray:
        a = getattr(self.local, "scratch", None)
        if a is None or a.shape[0] != chunk:
            a = self.local.scratch = np.empty((chunk,) * 3, np.uint64)
        return a


_WORKERS: dict[str, _Worker] = {}
_WORKERS_LOCK = threading.Lock()


def _worker(job: Job) -> _Worker:
    with _WORKERS_LOCK:
        w = _WORKERS.get(job.token)
        if w is None:
            _WORKERS.clear()  # one conversion at a time per process
            w = _WORKERS[job.token] = _Worker(job)
        return w


def run_task(task: Task) -> ConvertResult:
    """A task's output shards written whole (on resume, kept when they hold the chunks expected)."""
    t0, c0 = time.perf_counter(), time.process_time()  # with threads: the process, others included
    w = _worker(task.job)
    res = ConvertResult()
    sp = task.layout
    if task.shard is None:
        origin = task.sources[0]
        table = task.job.source.shard(task.scale, origin).table()
        res.records = len(table)
        rel, inside, meets, full = _rows(table, origin, task)
        res.outside = int((~inside).sum())
        rows = np.flatnonzero(meets)
        ids = sp.shard_ids(rel[rows])
        order = np.argsort(ids, kind="stable")
        rows, ids = rows[order], ids[order]
        for group in np.split(rows, np.flatnonzero(np.diff(ids)) + 1):
            if len(group):
                part = (table, group, rel[group], full[group])
                _write_shard(w, task, sp.shard_file(rel[group[0]]), lambda _res, p=part: iter([p]), res)
    else:
        size = np.asarray(sp.shard_chunks, np.int64)
        lo = np.asarray(task.shard, np.int64) * size
        _write_shard(w, task, sp.shard_file(lo), partial(_group_parts, task, lo, np.minimum(lo + size, sp.grid)),
                     res)
    res.cpu_s = time.process_time() - c0
    res.wall_s = time.perf_counter() - t0
    res.max_rss_mib = _peak_rss_mib()
    return res


def _peak_rss_mib() -> float:
    """This process's peak resident memory: Linux's VmHWM, its own image's only (ru_maxrss of a
    process started by another also counts the starter's pages, copied before exec)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rows(table: Any, origin: tuple[int, int, int], task: Task) -> tuple[Any, Any, Any, Any]:
    """Per record of a source shard: its output chunk (relative to the offset), whether it lies in the
    volume, meets the task's box, lies wholly in the box (else TensorStore encodes the part inside).
    A record outside its file's box is a ShardFormatError (a damaged file, or a wrong name)."""
    from ..errors import ShardFormatError

    sp = task.layout
    coords = np.asarray(table.coords, np.int64).reshape(-1, 3)
    cell_lo = np.asarray(origin, np.int64) // sp.chunk
    outside_cell = ((coords < cell_lo) | (coords >= cell_lo + sp.cell)).any(axis=1)
    if outside_cell.any():
        i = int(np.flatnonzero(outside_cell)[0])
        raise ShardFormatError(f"{table.where(i)}: chunk lies outside its shard's box "
                               f"(origin {tuple(origin)}, {sp.cell} chunks per side)")
    rel = coords - sp.chunk_offset
    inside = ((rel >= 0) & (rel < np.asarray(sp.grid))).all(axis=1)
    lo_v, hi_v = window(sp, task.clip)
    a = coords * sp.chunk
    b = a + sp.chunk
    meets = inside & ((a < hi_v) & (b > lo_v)).all(axis=1)
    full = ((a >= lo_v) & (b <= hi_v)).all(axis=1)
    return rel, inside, meets, full


def _group_parts(task: Task, lo: np.ndarray, hi: np.ndarray, res: ConvertResult | None) -> Iterator[tuple]:
    """A grouped task's ``(table, rows, relative chunks, whole)`` per source shard meeting its output
    shard [lo, hi), one at a time; counted into ``res`` when given (the records outside the volume
    by the task whose box holds the file's first chunk)."""
    sp = task.layout
    for o in task.sources:
        table = task.job.source.shard(task.scale, o).table()
        if not len(table):
            continue
        rel, inside, meets, full = _rows(table, o, task)
        rows = np.flatnonzero(meets & ((rel >= lo) & (rel < hi)).all(axis=1))
        if res is not None:
            first = np.maximum(np.asarray(o, np.int64) // sp.chunk - sp.chunk_offset, 0)
            res.records += len(rows)
            if (first // np.asarray(sp.shard_chunks) == lo // np.asarray(sp.shard_chunks)).all():
                res.outside += int((~inside).sum())
        yield table, rows, rel[rows], full[rows]


def _write_shard(w: _Worker, task: Task, fname: str, parts: Any, res: ConvertResult) -> None:
    """One output shard from ``parts(res)``, ``(table, rows, relative chunks, whole)``."""
    job, sp = task.job, task.layout
    if job.resume:
        have = existing_chunks(job.dest, fname, job.format, sp)
        if have is not None and have == sum(_expected(w, task, *p) for p in parts(None)):
            res.shards_skipped += 1
            return
    if job.format == "zarr3":
        size = np.asarray(sp.shard_chunks)
        pieces = ((struct.pack(">III", *(int(v) for v in rr[j] % size)),
                   _chunk_bytes(w, task, table, int(rows[j]), rr[j], bool(full[j]), res))
                  for table, rows, rr, full in parts(res) for j in range(len(rows)))
        n = write_zarr3_shard(job.dest, fname, sp, pieces, w.context)
    else:
        spec = ShardingSpec.from_json(sp.precomputed_sharding())
        chunks = _spooled(w, task, fname, spec, parts(res), res) if task.shard is not None else \
            _in_file_order(w, task, spec, next(parts(res)), res)
        n = write_precomputed_shard(job.dest, fname, spec, chunks, w.gzip_index())
    res.shards_written += bool(n)


def _morton(sp: ScaleLayout, rr: np.ndarray) -> np.ndarray:
    return np.atleast_1d(compressed_morton_code(rr, sp.grid)).astype(np.uint64)


def _in_file_order(w: _Worker, task: Task, spec: ShardingSpec, part: tuple, res: ConvertResult) -> Iterator:
    table, rows, rr, full = part  # one source shard's output shard
    keys = _morton(task.layout, rr)
    for j in file_order(spec, keys).tolist():
        yield int(keys[j]), _chunk_bytes(w, task, table, int(rows[j]), rr[j], bool(full[j]), res)


def _spooled(w: _Worker, task: Task, fname: str, spec: ShardingSpec, parts: Iterator, res: ConvertResult
             ) -> Iterator:
    """A grouped output shard's chunks encoded source shard by source shard into a spool file (beside
    a local output), read back in the file's order: memory is one source shard and 24 bytes a chunk."""
    path = task.job.dest.local_path(fname)
    folder = os.path.dirname(path) if path is not None else None
    if folder is not None:
        os.makedirs(folder, exist_ok=True)
    keys, starts, sizes = [], [], []
    with tempfile.TemporaryFile(dir=folder) as spool:
        for table, rows, rr, full in parts:
            codes = _morton(task.layout, rr)
            for j in range(len(rows)):
                enc = _chunk_bytes(w, task, table, int(rows[j]), rr[j], bool(full[j]), res)
                if enc is not None:
                    keys.append(codes[j])
                    starts.append(spool.tell())
                    sizes.append(spool.write(enc))
        allkeys = np.asarray(keys, np.uint64)
        for j in file_order(spec, allkeys).tolist():
            spool.seek(starts[j])
            yield int(allkeys[j]), spool.read(sizes[j])


def _chunk_bytes(w: _Worker, task: Task, table: Any, i: int, rel: np.ndarray, full: bool, res: ConvertResult
                 ) -> bytes | None:
    """One output chunk's stored bytes (None: background)."""
    job, sp = task.job, task.layout
    enc: bytes | None
    if job.format == "precomputed" and job.encoder == "transcode" and full:
        enc = transcode_chunk(table, i, sp.chunk, w.labels)
        res.transcoded += 1
        if is_background(enc, (sp.chunk,) * 3):
            enc = None
    else:
        enc = w.stager(job.format, sp).encode(rel, _decoded(w, task, table, i, rel))
        res.encoded += 1  # None when all 0: TensorStore stores no such chunk
    if enc is None:
        res.background += 1
        return None
    if job.format == "precomputed" and sp.precomputed_sharding().get("data_encoding") == "gzip":
        gz = zlib.compressobj(job.gzip_level, zlib.DEFLATED, 31)  # gzip; TensorStore: level 9 (4.5 ms a chunk; 1: 0.31 ms)
        enc = gz.compress(enc) + gz.flush()
    res.encoded_bytes += len(enc)
    res.written += 1
    return enc


def _decoded(w: _Worker, task: Task, table: Any, i: int, rel: np.ndarray) -> np.ndarray:
    """Record ``i``'s voxels inside the volume (z, y, x), 0 outside the task's box."""
    sp = task.layout
    lo = np.asarray(rel, np.int64) * sp.chunk
    ext = np.minimum(sp.chunk, np.asarray(sp.size) - lo)  # x, y, z voxels inside the volume
    view = w.scratch(sp.chunk)[:ext[2], :ext[1], :ext[0]]
    table.decode_into(i, view, w.labels)
    if task.clip is not None:
        at = lo + np.asarray(sp.voxel_offset, np.int64)
        a = np.clip(np.asarray(task.clip[0]) - at, 0, ext)
        b = np.clip(np.asarray(task.clip[1]) - at, 0, ext)
        for axis in range(3):  # x, y, z: view axes 2, 1, 0
            index: list[Any] = [slice(None)] * 3
            index[2 - axis] = slice(0, a[axis])
            view[tuple(index)] = 0
            index[2 - axis] = slice(b[axis], None)
            view[tuple(index)] = 0
    return view


def _expected(w: _Worker, task: Task, table: Any, rows: np.ndarray, rr: np.ndarray, full: np.ndarray) -> int:
    """Chunks of these rows an output shard holds: those not all 0 (a whole chunk by its palette, a
    cut one by its voxels)."""
    n = 0
    for j, i in enumerate(rows.tolist()):
        if full[j]:
            pal = w.labels.palette(table, i)
            n += bool(np.any(table.supervoxels(i) if pal is None else pal))
        else:
            n += bool(_decoded(w, task, table, i, rr[j]).any())
    return n


# --------------------------------------------------------------------------- reduce


def reduce(results: Iterable[ConvertResult]) -> ConvertTotals:
    totals = ConvertTotals()
    for r in results:
        totals.add(r)
    return totals


def _notes(format: str, t: ConvertTotals) -> list[str]:
    lines = [f"{format}: {t.shards_written:,} output shards written, {t.shards_skipped:,} complete ones kept; "
             f"{t.written:,} chunks written ({t.transcoded:,} transcoded, {t.encoded:,} encoded by TensorStore), "
             f"{t.background:,} background skipped, {t.outside:,} outside the volume; "
             f"{t.encoded_bytes / 2**20:.1f} MiB encoded; peak worker RSS {t.max_rss_mib:.0f} MiB"]
    if t.verified or t.mismatches:
        bg = t.verified_background
        lines.append(f"verify: {t.verified:,} chunks read back ({t.verified - bg:,} with data, {bg:,} background), "
                     f"{len(t.mismatches):,} differ")
    return lines


class _Clipped:
    """The source as a conversion with a box writes it: 0 outside each scale's box."""

    def __init__(self, ds: Dataset, boxes: dict[int, Box]):
        self._ds, self._boxes = ds, boxes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ds, name)

    def read(self, box: Any, *, scale: int, **kw: Any) -> np.ndarray:
        v = self._ds.read(box, scale=scale, **kw)
        lo, hi = (np.asarray(c, np.int64) for c in box)
        clo, chi = (np.asarray(c, np.int64) for c in self._boxes[scale])
        a, b = np.clip(clo - lo, 0, hi - lo), np.clip(chi - lo, 0, hi - lo)
        keep = np.zeros(v.shape, bool)
        keep[a[0]:b[0], a[1]:b[1], a[2]:b[2]] = True
        v[~keep] = 0
        return v


def spot_check(source: Dataset, dest: ByteStore, layouts: dict[int, ScaleLayout], *, format: str, labels: Any,
               n: int, seed: int = 0, boxes: dict[int, Box] | None = None) -> tuple[int, int, list[str]]:
    """``n`` random chunks per scale read back with TensorStore's own driver and compared with the
    source: ``(chunks compared, of them background, mismatch lines)``."""
    kv = dest.kvstore_spec()
    assert kv is not None
    ds: Any = _Clipped(source, boxes) if boxes else source
    done, background, bad = 0, 0, list[str]()
    for k, sp in layouts.items():
        if n <= 0 or not source.shards(k):
            continue
        sc = compare_chunks(ds, open_scale(kv, format, sp.key), format, k, labels, n, np.random.default_rng(seed))
        done, background, bad = done + sc.compared, background + sc.background, bad + sc.problems
    return done, background, bad


# --------------------------------------------------------------------------- the job


def _held(ks: Iterable[int]) -> str:
    return ", ".join(f"s{k}" for k in sorted(ks))


def _choose_scales(ds: Dataset, wanted: list[int] | None) -> tuple[list[int], list[int]]:
    """``(scales to convert, scales to make first)``: by default those held and those the spec lists
    above the finest held; else those asked for, the absent ones made from a finer one held."""
    held = set(ds.exported)
    listed = [s.index for s in ds.scales]
    can_make = ds.spec is not None and not any(s.inferred for s in ds.scales)
    if wanted is None:
        make = [k for k in listed if k not in held and any(h < k for h in held)] if can_make else []
        return sorted(held | set(make)), make
    for k in wanted:
        ds.scale(k)  # a scale the spec does not list: SpecError naming those it does
    make = [k for k in wanted if k not in held]
    for k in make:
        if not can_make or not any(h < k for h in held):
            ds.require_scale(k)  # NotExportedError: nothing finer to make it from
    return list(wanted), make


def _check_makeable(ds: Dataset, make: list[int]) -> None:
    """Refuse, before any work, scales the downsample stage could not make."""
    held = set(ds.exported)
    start = max(h for h in held if h < min(make))
    base = ds.scale(start)
    for k in range(start, max(make) + 1):
        s = ds.scale(k)
        if s.chunk_size != base.chunk_size or len(set(s.chunk_size)) != 1 or s.chunk_size[0] % 16 or \
                any(s.voxel_offset):
            raise ConvertPlanError(f"scale {k}: chunks {list(s.chunk_size)}, voxel_offset {list(s.voxel_offset)}: "
                                   f"the scales {_held(make)} this export lacks cannot be made from s{start} (the "
                                   f"same cubic chunks at the origin are needed); convert the scales it holds "
                                   f"(--scales {' '.join(map(str, sorted(held)))})")


def _work_store(store: ByteStore, workdir: Any, *, resume: bool, overwrite: bool) -> ByteStore:
    """The work folder, refused when only this process sees it or it holds another run's scales."""
    wd = work_folder(store, workdir)
    if wd.local_path() is None and wd.kvstore_spec() is None:
        raise OutputError(f"work folder {wd.describe('')}: held in this process's memory, where the workers "
                          f"that read the made scales cannot see it; give --workdir a folder, gs:// or s3://")
    if not resume and not overwrite and wd.list_sync(STAGED):
        raise OutputError(f"work folder {wd.describe('')} holds scales made by an earlier conversion; pass "
                          f"--resume to finish it, or --overwrite to start again")
    return wd


def _make_scales(ds: Dataset, staged: ByteStore, make: list[int], out: Output, tr: TaskRunner, *,
                 scheduler: Any, labels: Any, box: Any, method: str, resume: bool, overwrite: bool, progress: bool | None,
                 command: str | None, stop_after: int | None
                 ) -> tuple[Dataset, list[int], list[str], dict | None, bool]:
    """The downsample stage: ``(pyramid to read, scales not to convert, notes, totals, finished)``."""
    from .downsample import downsample

    previous = out.previous or {}
    if resume and previous.get("complete") is True and not staged.list_sync():
        return ds, make, [f"{_held(make)} kept as the earlier complete run wrote them (the scales it made are gone; "
                          f"--overwrite makes and converts them again)"], None, True
    rep = downsample(ds, staged, scales=make, method=method, labels=labels, box=box,
                     scheduler=tr.client() if tr.distributed else scheduler, resume=resume, overwrite=overwrite,
                     progress=progress, allow_partial=True, command=command, _stop_after=stop_after)
    r = out.report  # the stage's tasks and failures count in the conversion's report
    r.tasks, r.done, r.skipped, r.task_cpu = r.tasks + rep.tasks, r.done + rep.done, r.skipped + rep.skipped, \
        r.task_cpu + rep.task_cpu
    r.failed.update({f"downsample {item}": msg for item, msg in rep.failed.items()})
    notes = [f"made first ({staged.describe('')}): {n}" for n in rep.notes]
    made = rep.totals.to_json() if rep.totals is not None else None
    if not rep.complete:
        return ds, make, [*notes, f"{_held(make)} not converted: making them did not finish (--resume finishes "
                                  f"both stages)"], made, False
    start = max(h for h in ds.exported if h < min(make))
    empty = [k for k in make if not staged.list_sync(f"s{k}")]  # all background: no files, nothing to write
    return ds.with_scales(staged, range(start + 1, max(make) + 1)), empty, notes, made, True


def convert(source: Any, dest: Any, *, format: str, spec: Any = None, scales: Any = None,
            labels: Any = "agglomerated", box: Any = None, method: str = "dvid", scheduler: Any = None,
            workdir: Any = None, resume: bool = False, overwrite: bool = False, progress: bool | None = None,
            allow_partial: bool = False, verify: int = 0, encoder: str = "transcode", shard_bits_extra: int = 0,
            sharding: dict | None = None, data_encoding: str = "gzip", gzip_level: int = 1, seed: int = 0,
            command: str | None = None, _stop_after: int | None = None, _only: Any = None,
            _stop_downsample_after: int | None = None) -> JobReport:
    """Convert an export to neuroglancer precomputed or zarr v3: every scale of its spec.

    Parameters
    ----------
    source : str, path, URL, kvstore spec or dvidshards.Dataset
    dest : str, path, URL or kvstore spec dict
        A folder, ``gs://…`` or ``s3://…``: empty, or this conversion's earlier output
        (``resume``/``overwrite``); never inside the export.
    format : {"precomputed", "zarr3"}
    spec : dict or path, optional
        The neuroglancer spec DVID was given (default: the export's ``info``).
    scales : list of int, optional
        Default: the scales held, and those the spec lists above the finest held (made first). One
        the export lacks is made with the scales between; with nothing finer held, NotExportedError.
    labels : "agglomerated", "supervoxels" or a mapping (file path, dict, ...)
        Ids written (made scales: each block's supervoxels by ``method``, then the same ids).
    box : [[x0, y0, z0], [x1, y1, z1]] or six numbers, optional
        Only this box of scale 0 (its voxels): every scale gets the voxels covering it, 0 elsewhere
        (scales made first: from the records meeting it); the volume's geometry stays.
    method : {"dvid", "mode"}
        How the scales an export lacks are made: DVID's pyramid rule or TensorStore's ``"mode"``.
    scheduler, workdir, resume, overwrite, progress, allow_partial :
        As for every job (:mod:`dvidshards.jobs.options`). ``workdir``: the scales made first.
    verify : int
        Chunks per scale read back through TensorStore's own driver and compared with the source.
    encoder : {"transcode", "tensorstore"}
        ``tensorstore``: every precomputed chunk encoded by TensorStore from decoded voxels.
    shard_bits_extra : int
        Split each source shard into ``2**n`` output shards (changes the output geometry).
    sharding : dict, optional
        An output sharding for every scale (identity hash, no wrapping shard numbers; shards larger
        than the source's are written a task per output shard).
    data_encoding : {"gzip", "raw"}
        Precomputed chunk data encoding with the export's sharding.
    gzip_level : int
        zlib level of gzip chunk data (1-9; TensorStore's own writer uses 9, ~15x the CPU).
    seed : int
        Seed of the verification sample.
    command : str, optional
        The command line, for the manifest.

    Returns
    -------
    JobReport
        ``totals`` is a :class:`ConvertTotals`; ``tasks`` counts both stages.

    Raises
    ------
    ConvertPlanError, SpecError, NotExportedError, OutputError
        Before anything is written: the layout, an argument, a scale or the destination refused.
    JobError
        The output is incomplete and ``allow_partial`` is false.
    """
    from .downsample import METHODS

    for name, value, allowed in (("format", format, FORMATS), ("encoder", encoder, ENCODERS),
                                 ("method", method, METHODS), ("data_encoding", data_encoding, ("gzip", "raw"))):
        if value not in allowed:
            raise SpecError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
    if isinstance(gzip_level, bool) or not isinstance(gzip_level, int) or not 1 <= gzip_level <= 9:
        raise SpecError(f"gzip_level must be an integer 1..9, got {gzip_level!r}")
    if resume and overwrite:
        raise SpecError("give resume or overwrite, not both")
    scheduler_of(scheduler)  # a malformed scheduler is refused before anything is written
    store = as_store(dest, writable=True)
    if store.kvstore_spec() is None:
        raise OutputError(f"{store.describe('')}: convert writes through TensorStore, which cannot reach a store "
                          f"held in this process's memory; give a folder, gs:// or s3://")
    ds = source if isinstance(source, Dataset) else Dataset(source, spec=spec)
    as_labels(labels)  # refuse a bad label argument before starting
    wanted = scales_of(scales)
    chosen, make = _choose_scales(ds, wanted)
    if make:
        _check_makeable(ds, make)
    held = set(ds.exported)
    layouts = {k: scale_layout(ds.scale(k) if k in held else ds.scale(k).with_naming("current"), format=format,
                               shard_bits_extra=shard_bits_extra, sharding=sharding, data_encoding=data_encoding)
               for k in chosen}
    if wanted is None:  # default: the scales held that have shards, and the ones made
        layouts = {k: p for k, p in layouts.items() if k not in held or ds.shards(k)}
    if not layouts:
        raise SpecError(f"{ds!r}: no shards to convert")
    b = box_of(box)
    boxes = {} if b is None else scale_boxes(ds, b, layouts)
    wd = _work_store(store, workdir, resume=resume, overwrite=overwrite) if make else None
    params = {"format": format, "scales": sorted(layouts),
              "labels": labels if isinstance(labels, str) else f"<{type(labels).__name__}>",
              "box": None if b is None else [list(b[0]), list(b[1])],
              "encoder": encoder, "shard_bits_extra": shard_bits_extra, "sharding": sharding,
              "data_encoding": data_encoding, "gzip_level": gzip_level, **({"method": method} if make else {})}
    meta = "info" if format == "precomputed" else "zarr.json"
    keys = {sp.key for sp in layouts.values()}
    made_wd = wd is not None and wd.local_path() is not None and not os.path.exists(wd.local_path() or "")
    try:
        with Output(store, job="convert", parameters=params, source=ds, scales=sorted(layouts), command=command,
                    resume=resume, overwrite=overwrite, workdir=wd,
                    own=lambda name: name == meta or name in keys) as out, TaskRunner(scheduler,
                                                                                       progress=progress) as tr:
            import tensorstore as ts

            out.update(format=format, keys={str(k): sp.key for k, sp in sorted(layouts.items())}, spec=ds.spec,
                       made=[k for k in sorted(layouts) if k in make])
            create_output(store, format, sorted(layouts.values(), key=lambda p: p.index), ts.Context())
            read, skip, notes, made, stage_ok = ds, list[int](), list[str](), None, True
            if wd is not None:
                tr.check_shared(wd)  # workers elsewhere must see the made scales
                read, skip, notes, made, stage_ok = _make_scales(
                    ds, wd.child(STAGED), make, out, tr, scheduler=scheduler,
                    labels=labels, box=box, method=method, resume=resume, overwrite=overwrite, progress=progress,
                    command=command, stop_after=_stop_downsample_after)
                lost = [k for k in (s.index for s in ds.scales) if k not in held and k not in layouts]
                if lost and wanted is None:
                    notes.append(f"{_held(lost)} not exported and not made: no finer scale is held to make them from")
            todo = {k: sp for k, sp in sorted(layouts.items()) if k not in skip}
            job = Job(read, store, format, labels, encoder, gzip_level, resume)
            tasks = list(plan(read, todo, job=job, boxes=boxes))
            run = tasks if _stop_after is None else tasks[:_stop_after]  # tests: as if killed
            fn = run_task if _only is None else partial(_run_only, frozenset(_only))  # benchmarks: a sample
            phase = tr.run(fn, run, desc=f"{format} shards", kernels=KERNELS)
            out.add(phase, name=lambda t: t.name)
            out.report.tasks += len(tasks) - len(run)
            totals = reduce(phase.results.values())
            totals.made = made
            if verify:
                totals.verified, totals.verified_background, totals.mismatches = spot_check(
                    read, store, todo, format=format, labels=labels, n=verify, seed=seed, boxes=boxes)
                for m in totals.mismatches:
                    out.fail(f"verify {m.split(':', 1)[0]}", m.split(": ", 1)[-1])
            report = out.finish(totals=totals, notes=_notes(format, totals) + notes, allow_partial=allow_partial,
                                complete=len(run) == len(tasks) and _only is None and stage_ok)
    finally:
        if wd is not None and made_wd:
            remove_work(wd)  # refused or failed before making anything: no empty folder left
    if report.complete and wd is not None:
        remove_work(wd, STAGED.__eq__)
    return report


def _run_only(only: frozenset, task: Task) -> ConvertResult:  # benchmarks: a sample of the tasks
    return run_task(task) if task.key in only else ConvertResult()


# --------------------------------------------------------------------------- command line


_DEFAULTS = {"labels": "agglomerated", "method": "dvid", "verify": 0, "encoder": "transcode", "shard_bits_extra": 0,
             "data_encoding": "gzip", "gzip_level": 1}


class ConvertCommand:
    """``dvidshards convert EXPORT DEST --format F``."""

    @staticmethod
    def add_arguments(p: Any) -> None:
        add_source(p)
        add_dest(p, what="output root: empty, or this conversion's own earlier output")
        p.add_argument("--format", required=True, choices=FORMATS,
                       help="output format: neuroglancer precomputed (sharded, compressed_segmentation) or zarr v3")
        add_scales(p, help="scales to convert (default: every scale of the spec: those the export holds, and those "
                           "it lacks above its finest, made first by --method; a scale asked for that the export "
                           "lacks is made too)")
        add_labels(p)
        add_box(p)
        p.add_argument("--method", choices=("dvid", "mode"), default="dvid",
                       help="how scales the export lacks are made: dvid, DVID's own pyramid rule (the most frequent "
                            "non-zero supervoxel; default), or mode, TensorStore's")
        add_job_options(p)
        p.add_argument("--verify", type=int, default=0, metavar="N",
                       help="read N random chunks per scale back with TensorStore and compare")
        p.add_argument("--encoder", choices=ENCODERS, default="transcode",
                       help="precomputed chunks: transcode DVID blocks (default) or TensorStore's encoder")
        p.add_argument("--shard-bits-extra", type=int, default=0, metavar="n",
                       help="split each source shard into 2^n output shards (changes the output geometry)")
        p.add_argument("--data-encoding", choices=("gzip", "raw"), default="gzip",
                       help="precomputed chunk data encoding in shards (default gzip)")
        p.add_argument("--gzip-level", type=int, default=1, choices=range(1, 10), metavar="1-9",
                       help="zlib level of gzip chunk data (default 1)")

    @staticmethod
    def main(args: Any) -> int:
        """0 when the output is complete, 1 when it is not (the manifest says so)."""
        kw = {k: getattr(args, k) for k in ("format", "spec", "scales", "labels", "box", "method", "verify",
                                            "encoder", "shard_bits_extra", "data_encoding", "gzip_level")}
        report = convert(args.source, args.dest, allow_partial=True, **kw, **job_options(args),
                         command=command_line("convert", args, skip=[k for k, v in _DEFAULTS.items()
                                                                      if getattr(args, k) == v]))
        print(report.summary())
        return 0 if report.ok else 1
