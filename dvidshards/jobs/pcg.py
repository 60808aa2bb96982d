"""Supervoxel adjacency for PyChunkedGraph: per-chunk edges and components files from an export.

``write_edges`` cuts the PCG layer-1 grid into *tasks* of ``chunks_per_task`` chunks per axis
(default: one source shard's worth, so ~26 K tasks for mCNS s0 at 256³, grown if needed to stay
under ``MAX_TASKS``) and runs them with `dvidshards.jobs.runner` (serially, on threads or on
dask; a bounded number in flight). The planner lists the shard files once and computes the
tasks that overlap them with numpy: nothing on the client loops over chunks, and a task is a
small record (its grid key). For each of its chunks a task

1. takes the supervoxel lists of the DVID blocks overlapping the chunk and its 6 face
   neighbours from the shard records (no decoding) and builds each chunk's id list: the
   chunk's pieces ((DVID supervoxel, PCG chunk) pairs) are numbered in that sorted order, so
   neighbouring chunks agree on each other's PCG ids without reading each other's voxels;
2. reads the chunk plus a one-voxel halo as supervoxels with the bulk reader (0 outside the
   volume) and counts voxels and contact faces (``dvidshards.formats.pcg.contacts``);
3. writes ``edges_{x}_{y}_{z}.proto.zst`` (PCG's ChunkEdgesMsg in one zstd frame) and
   ``components_{x}_{y}_{z}.proto`` (the chunk's pieces and the neighbour pieces of its
   between/cross edges, grouped by body: the records' agglomerated labels or a mapping, which
   a mapping file passes by reference and each worker loads once), each to a temporary name
   under ``.tmp/`` then renamed.

Last, the task writes its rows of the side table, ``supervoxels/{kx}_{ky}_{kz}.parquet``
(pcg_id, dvid_supervoxel, chunk_x, chunk_y, chunk_z, voxels; sorted by pcg_id), whose metadata
lists the chunks it covers: that file is the task's completion record, so ``resume=True``
redoes only chunks that no part covers, and a chunk that failed is left out of it. The
side table is the folder (``pyarrow.parquet.read_table(out / "supervoxels")``, or
`read_side_table`); the client only adds up counts. ``manifest.json`` is written first as
incomplete and completed at the end. Chunks whose blocks list no supervoxel get no files (PCG
reads a missing file as no edges). Needs ``dvidshards[pcg]`` (protobuf).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from ..dataset import Dataset
from ..errors import DvidShardsError, SpecError
from ..formats import pcg as fmt
from ..formats.labels import Agglomerated, LabelSource, Mapped, as_labels
from ..formats.multiscale import SINGLE_SHARD
from ..formats.pcg import IdLayout, PcgError
from ..sources.base import RecordSource
from .runner import TaskRunner, failure_lines, job_arguments, progress_of, scheduler_of

__all__ = ["MAX_TASKS", "PcgReport", "add_arguments", "main", "read_chunk_components", "read_chunk_edges",
           "read_side_table", "write_edges"]

MANIFEST = "manifest.json"
SIDE_TABLE = "supervoxels"  # a folder: one Parquet file per task
TMP = ".tmp"
FORMAT = "dvidshards-pcg-edges"
VERSION = 2  # 1: one supervoxels.parquet built on the client from per-chunk pieces/ files
MAX_TASKS = 100_000  # the default task size grows until a job has at most this many tasks
COVERED = b"dvidshards.covered"  # side-table part metadata: the chunks done
WRITTEN = b"dvidshards.written"  # and those with files
_OWN = re.compile(r"(edges_[0-9]+_[0-9]+_[0-9]+\.proto\.zst|components_[0-9]+_[0-9]+_[0-9]+\.proto|manifest\.json|supervoxels"
                  r"|supervoxels\.parquet|pieces|\.tmp)(\.tmp[0-9]+)?")
_COUNTS = ("pieces", "isolated", "in", "between", "cross", "bytes")
_FAILED_PER_TASK = 8  # failed chunks a task reports by name (all are counted)
_FAILED_NAMED = 1000  # and the report keeps by name


@dataclass
class PcgReport:
    """What ``write_edges`` did.

    Attributes
    ----------
    out : str
        The output folder.
    chunks : int
        Chunks of the job (done now, done before, or empty).
    written : int
        Chunks with files (now and in earlier runs), over the job's tasks.
    pieces : int
        Rows of the side table over the job's tasks.
    edges : dict
        Edges written in this run per type (between and cross count each file's copy).
    isolated : int
        Pieces written in this run that touch no other piece (no edge at all): PCG's ingest
        only creates nodes for ids in the edges files, so these would be left out of the graph.
    failed : dict
        ``{chunk: "TypeName: message"}`` of failed chunks (up to 8 per task, 1,000 in all), and
        ``{"chunks x a:b, y c:d, z e:f": ...}`` of tasks that failed as a whole (the manifest
        stays incomplete; resume redoes them).
    failed_chunks : int
        Chunks that failed, all counted (a task that failed as a whole counts its chunks).
    skipped : int
        Chunks skipped as complete (resume).
    tasks : int
        Tasks of the job.
    elapsed : float
        Seconds.
    """

    out: str
    chunks: int = 0
    written: int = 0
    pieces: int = 0
    edges: dict = field(default_factory=lambda: dict.fromkeys(fmt.EDGE_TYPES, 0))
    isolated: int = 0
    failed: dict = field(default_factory=dict)
    failed_chunks: int = 0
    skipped: int = 0
    tasks: int = 0
    elapsed: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failed

    def summary(self) -> str:
        e = ", ".join(f"{v} {k}" for k, v in self.edges.items())
        lines = [f"{self.out}: {self.chunks} chunks in {self.tasks} tasks ({self.written} with files, {self.skipped} "
                 f"resumed), {self.pieces} pieces, edges written now: {e}; {self.failed_chunks} chunks failed in "
                 f"{self.elapsed:.1f} s"]
        if self.isolated:
            lines.append(f"  note: {self.isolated} pieces written now touch no other piece: no edge names them, "
                         f"so PCG's ingest will not create them")
        return "\n".join(lines + failure_lines(self.failed))


@dataclass(frozen=True)
class _Task:
    """One task: block ``key`` of the task grid (``chunks_per_task`` chunks per axis), or the
    chunks of it that were asked for (``only``)."""

    key: tuple[int, ...]
    only: tuple[tuple[int, ...], ...] | None = None

    @property
    def name(self) -> str:
        return "_".join(str(int(v)) for v in self.key) + ".parquet"

    def describe(self, group) -> str:
        if self.only is not None:
            return f"chunks {list(self.only)[:4]}{' ...' if len(self.only) > 4 else ''}"
        lo = [k * g for k, g in zip(self.key, group, strict=True)]
        return "chunks " + ", ".join(f"{n} {a}:{a + g}" for n, a, g in zip("xyz", lo, group, strict=True))


# --------------------------------------------------------------------------- the job


class _IndexPalette(LabelSource):
    """Reads 1 + each supervoxel's index in an id list (0 for background): a palette swap per
    block, so the contact kernel never looks a voxel's id up. ``target`` is set before each read
    (one palette per thread); compared by identity, so each gets its own reader."""

    name = "pcg-index"

    def __init__(self):
        self.target = np.zeros(0, np.uint64)
        self.where = ""

    def palette(self, table, i: int) -> np.ndarray:
        sv = table.supervoxels(i)
        out, bad = fmt.list_indexes(self.target, sv)
        if bad >= 0:
            raise PcgError(f"{table.where(i)}: supervoxel {sv[bad]} is not in the id list of {self.where}")
        return out

    def __eq__(self, other) -> bool:
        return other is self

    def __hash__(self) -> int:
        return id(self)

    def __getstate__(self):
        return {"target": np.zeros(0, np.uint64), "where": ""}


class _Job:
    """One write_edges run: everything a chunk task needs (pickles without open files)."""

    def __init__(self, ds: Dataset, scale, out: str, chunk_size, layout: IdLayout, mapped: Mapped | None,
                 affinity: str, level: int, threads: int | None, fill_missing_shards: bool):
        self.ds = ds
        self.scale = ds.scale(scale)
        self.out = out
        self.cs = np.asarray(chunk_size, np.int64)
        self.layout = layout
        # None: the records' agglomerated labels; else the mapping (a file travels as its path)
        self.mapped = mapped
        self.affinity = affinity
        self.level = int(level)
        self.threads = threads
        self.fill = fill_missing_shards
        s = self.scale
        self.lo = np.asarray(s.voxel_offset, np.int64)
        self.hi = self.lo + np.asarray(s.size, np.int64)
        self.grid = -(-(self.hi - self.lo) // self.cs)
        self._local = threading.local()  # a palette (and so a reader) per thread
        self.group: tuple[int, ...] = (1, 1, 1)  # chunks per task along each axis
        self.crange = (np.zeros(3, np.int64), self.grid.copy())  # chunks [lo, hi) of the job

    def members(self, task: _Task) -> list[tuple[int, ...]]:
        """The job's chunks in a task: its block of the task grid within the job's chunk range,
        or its chunks given."""
        if task.only is not None:
            return list(task.only)
        g = np.asarray(self.group, np.int64)
        k = np.asarray(task.key, np.int64)
        lo = np.maximum(k * g, self.crange[0])
        hi = np.minimum((k + 1) * g, self.crange[1])
        if (hi <= lo).any():
            return []
        zyx = np.indices(tuple(int(v) for v in (hi - lo)[::-1])).reshape(3, -1).T  # x fastest
        return [tuple(c) for c in (zyx[:, ::-1] + lo).tolist()]

    @property
    def palette(self) -> _IndexPalette:
        """This thread's index palette: tasks on threads read side by side, each with its own."""
        p = getattr(self._local, "palette", None)
        if p is None:
            p = self._local.palette = _IndexPalette()
        return p

    def __getstate__(self):
        d = self.__dict__.copy()
        d["_local"] = None
        return d

    def __setstate__(self, d):
        self.__dict__.update(d)
        self._local = threading.local()

    def box(self, c) -> tuple[np.ndarray, np.ndarray]:
        """Voxel box [a, b) of chunk c, clipped to the volume (empty outside the grid)."""
        c = np.asarray(c, np.int64)
        a = self.lo + c * self.cs
        b = np.minimum(a + self.cs, self.hi)
        if (c < 0).any() or (c >= self.grid).any():
            return a, a
        return a, b

    # --- block metadata ------------------------------------------------------------------

    def id_lists(self, coords):
        """Id lists of chunk c and its 6 neighbours, and a supervoxel -> body lookup."""
        s = self.scale
        reader = self.ds.reader(s, self.palette, fill_missing_shards=self.fill)  # the reads' shard cache
        bcs = np.asarray(s.chunk_size, np.int64)
        boxes = [self.box(coords)] + [self.box(np.add(coords, d)) for d in fmt.DIRECTIONS]
        # DVID blocks overlapping each box
        wanted, per_box = {}, []
        for a, b in boxes:
            if (b <= a).any():
                per_box.append([])
                continue
            b0, b1 = a // bcs, (b - 1) // bcs + 1
            keys = [(x, y, z) for z in range(int(b0[2]), int(b1[2])) for y in range(int(b0[1]), int(b1[1]))
                    for x in range(int(b0[0]), int(b1[0]))]
            per_box.append(keys)
            for k in keys:
                wanted[k] = None
        by_shard: dict = {}
        for k in wanted:
            by_shard.setdefault(s.shard_origin(*k), []).append(k)
        svs, bodies = {}, {}
        for keys in by_shard.values():
            shard = reader.shard(*keys[0])
            if shard is None:
                continue
            rows, found = [], []
            for k in keys:
                i = shard.find(*k)
                if i is not None:
                    rows.append(i)
                    found.append(k)
            if not rows:
                continue
            # ascending record numbers: file order for lazy (remote) shards' batch fetches
            order = np.argsort(rows)
            rows = [rows[j] for j in order]
            found = [found[j] for j in order]
            t = shard.table(rows)
            for j, k in enumerate(found):
                sv = t.supervoxels(j)
                svs[k] = sv
                if self.mapped is None:
                    lab = t.labels(j)
                    if lab.shape != sv.shape:
                        raise PcgError(f"{t.where(j)}: {len(lab)} labels for {len(sv)} supervoxels")
                    bodies[k] = lab
        empty = np.zeros(0, np.uint64)
        lists = []
        for keys in per_box:
            parts = [svs[k] for k in keys if k in svs]
            u = np.unique(np.concatenate(parts)) if parts else empty
            lists.append(u[1:] if u.size and u[0] == 0 else u)
        if self.mapped is not None:
            return lists, None
        if not bodies:
            return lists, (empty, empty)
        sv = np.concatenate([svs[k] for k in bodies])
        body = np.concatenate(list(bodies.values()))
        order = np.argsort(sv)
        sv, body = sv[order], body[order]
        same = sv[1:] == sv[:-1]
        clash = np.flatnonzero(same & (body[1:] != body[:-1]))
        if clash.size:
            k = int(clash[0])
            raise PcgError(f"chunk {tuple(coords)}: supervoxel {sv[k]} has agglomerated label {body[k]} in one block "
                           f"and {body[k + 1]} in another (inconsistent export)")
        keep = np.r_[True, ~same]
        return lists, (sv[keep], body[keep])

    def body_of(self, sv: np.ndarray, table) -> np.ndarray:
        if self.mapped is not None:
            return self.mapped.mapping(sv)  # a file: loaded once per process
        keys, vals = table
        i = np.searchsorted(keys, sv)
        ok = (i < keys.size) & (keys[np.minimum(i, max(keys.size - 1, 0))] == sv) if keys.size else sv != sv
        if not ok.all():  # cannot happen: every id list comes from the same records
            raise PcgError(f"no agglomerated label for supervoxel {sv[~ok][0]}")
        return vals[i]

    # --- voxels -------------------------------------------------------------------------

    def read_halo(self, coords, lists=None) -> np.ndarray:
        """The chunk and a one-voxel halo on its faces (0 outside the volume), x, y, z F-ordered.

        Read as the chunk plus six face slabs: the halo's edges and corners are never used, and
        leaving them out spares decoding the blocks that hold only them. With ``lists`` (the
        chunk's and its neighbours' id lists) voxels hold 1 + their id's index in the list of
        their chunk instead of the id.
        """
        a, b = self.box(coords)
        ha = a - 1
        out = np.zeros(tuple(int(v) for v in b - a + 2), np.uint64, order="F")
        boxes = [(a, b)]
        for ax in range(3):
            lo, hi = a.copy(), b.copy()
            lo[ax], hi[ax] = a[ax] - 1, a[ax]
            boxes.append((lo, hi))
            lo, hi = a.copy(), b.copy()
            lo[ax], hi[ax] = b[ax], b[ax] + 1
            boxes.append((lo, hi))
        palette = self.palette
        for k, (lo, hi) in enumerate(boxes):
            lo, hi = np.maximum(lo, self.lo), np.minimum(hi, self.hi)
            if (hi <= lo).any():
                continue  # outside the volume: stays 0
            if lists is not None:
                palette.target = lists[k]
                palette.where = f"PCG chunk {tuple(np.add(coords, fmt.DIRECTIONS[k - 1]) if k else coords)}"
            oa, ob = lo - ha, hi - ha
            self.ds.read([lo.tolist(), hi.tolist()], scale=self.scale,
                         labels="supervoxels" if lists is None else palette,
                         out=out[oa[0]:ob[0], oa[1]:ob[1], oa[2]:ob[2]],
                         threads=self.threads if k == 0 else 1, fill_missing_shards=self.fill)
        return out

    # --- one chunk ----------------------------------------------------------------------

    def run(self, coords) -> tuple[dict, np.ndarray]:
        """Write one chunk's edges and components files; (counts, its side-table rows (n, 3):
        PCG id, DVID supervoxel, voxels)."""
        coords = tuple(int(v) for v in coords)
        where = f"PCG chunk {coords}"
        stats = {"pieces": 0, "isolated": 0, "in": 0, "between": 0, "cross": 0, "bytes": 0, "written": False}
        lists, table = self.id_lists(coords)
        if lists[0].size == 0:
            return stats, np.zeros((0, 3), np.uint64)
        vol = self.read_halo(coords, lists)
        c = fmt.contacts(vol.T, lists[0], lists[1:], where, indexed=True)
        edges, pieces, nb = fmt.chunk_graph(c, coords, lists[0], lists[1:], self.layout, self.affinity)
        ids = np.concatenate([pieces[0], nb[0]])
        groups = fmt.group_components(ids, self.body_of(np.concatenate([pieces[1], nb[1]]), table))
        import zstandard

        payload = zstandard.ZstdCompressor(level=self.level).compress(fmt.encode_edges(edges))
        _put(self.out, fmt.edges_path(coords), payload)
        comp = fmt.encode_components(groups)
        _put(self.out, fmt.components_path(coords), comp)
        rows = np.stack(pieces, axis=1).astype(np.uint64)
        linked = np.concatenate([edges["in"][0], edges["in"][1], edges["between"][0], edges["cross"][0]])
        stats.update(pieces=len(rows), bytes=len(payload) + len(comp), written=True,
                     isolated=int(np.count_nonzero(~np.isin(pieces[0], linked))),
                     **{k: len(v[0]) for k, v in edges.items()})
        return stats, rows


def _run_task(job: _Job, task: _Task) -> dict:
    """Every chunk of a task not covered yet, then the task's side-table part.

    A chunk that raises a `DvidShardsError` is reported in ``failed`` and left out of the part
    (resume retries it); the other chunks go on. Returns counts only.
    """
    members = job.members(task)
    part = _read_part(os.path.join(job.out, SIDE_TABLE, task.name))
    todo = [c for c in members if c not in part.covered]
    total: dict = dict.fromkeys(_COUNTS, 0)
    failed: dict = {}
    total.update(chunks=len(members), skipped=len(members) - len(todo), failed=failed, failed_count=0)
    if todo:
        for c in todo:
            try:
                r, piece_rows = job.run(c)
            except DvidShardsError as e:
                total["failed_count"] += 1
                if len(failed) < _FAILED_PER_TASK:  # results stay small however much fails
                    failed[c] = f"{type(e).__name__}: {e}"
                continue
            for k in _COUNTS:
                total[k] += r[k]
            part.add(c, piece_rows, bool(r["written"]))
        _write_part(job.out, task.name, part)
    total["part_rows"] = part.rows
    total["part_written"] = len(part.written)
    return total


class _Part:
    """A task's side-table part: its rows and the chunks it covers (done) and wrote files for."""

    def __init__(self, rows=None, chunks=None, covered=(), written=()):
        self.parts = [] if rows is None else [(rows, chunks)]
        self.covered = set(covered)
        self.written = set(written)

    @property
    def rows(self) -> int:
        return sum(len(r) for r, _ in self.parts)

    def add(self, c, rows: np.ndarray, written: bool) -> None:
        rows = rows.reshape(-1, 3)
        self.parts.append((rows, np.broadcast_to(np.asarray(c, np.int32), (len(rows), 3))))
        self.covered.add(c)
        if written:
            self.written.add(c)


_SCHEMA_FIELDS = (("pcg_id", "uint64"), ("dvid_supervoxel", "uint64"), ("chunk_x", "int32"), ("chunk_y", "int32"),
                  ("chunk_z", "int32"), ("voxels", "uint64"))


def _schema():
    import pyarrow as pa

    return pa.schema([(n, getattr(pa, t)()) for n, t in _SCHEMA_FIELDS])


def _read_part(path: str) -> _Part:
    """A task's part as written (empty when there is none)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        t = pq.read_table(path)
    except FileNotFoundError:
        return _Part()
    except (OSError, pa.ArrowException) as e:
        raise PcgError(f"{path}: unreadable side-table part ({e}); delete it and resume") from None
    meta = t.schema.metadata or {}
    try:
        covered, written = ({tuple(int(v) for v in c) for c in json.loads(meta[k])} for k in (COVERED, WRITTEN))
    except (KeyError, ValueError, TypeError):
        raise PcgError(f"{path}: a side-table part without its lists of chunks; delete it and resume") from None
    if t.schema.names != [n for n, _ in _SCHEMA_FIELDS]:
        raise PcgError(f"{path}: not a side-table part (columns {t.schema.names})")
    rows = np.stack([t.column(n).to_numpy().astype(np.uint64) for n in ("pcg_id", "dvid_supervoxel", "voxels")], 1)
    chunks = np.stack([t.column(n).to_numpy().astype(np.int32) for n in ("chunk_x", "chunk_y", "chunk_z")], 1)
    return _Part(rows, chunks, covered, written)


def _write_part(out: str, name: str, part: _Part) -> None:
    """Write a task's part: its rows sorted by PCG id, its chunk lists in the metadata."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    a = np.concatenate([r for r, _ in part.parts]) if part.parts else np.zeros((0, 3), np.uint64)
    c = np.concatenate([k for _, k in part.parts]) if part.parts else np.zeros((0, 3), np.int32)
    order = np.argsort(a[:, 0], kind="stable")
    a, c = a[order], c[order]
    meta = {COVERED: json.dumps(sorted(part.covered)).encode(), WRITTEN: json.dumps(sorted(part.written)).encode()}
    table = pa.table([a[:, 0], a[:, 1], c[:, 0], c[:, 1], c[:, 2], a[:, 2]], schema=_schema().with_metadata(meta))
    tmp = _tmp_name(out, name)
    pq.write_table(table, tmp, compression="zstd")
    os.replace(tmp, os.path.join(out, SIDE_TABLE, name))


def _tmp_name(out: str, name: str) -> str:
    return os.path.join(out, TMP, f"{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")


def _put(out: str, name: str, data: bytes) -> None:
    """Write ``out/name`` through a temporary file in ``out/.tmp`` (same file system: atomic)."""
    tmp = _tmp_name(out, name)
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, os.path.join(out, name))


# --------------------------------------------------------------------------- planning


def _present_shards(ds: Dataset, s) -> list:
    """Origins of the scale's shard files; SpecError when the export has no folder for the scale."""
    origins = ds.shards(s)
    if origins or isinstance(ds.store, RecordSource):
        return origins
    try:
        names = ds.store.list_sync("")
    except (DvidShardsError, OSError):
        return origins  # a store that cannot list (http): the probe found no shard
    if s.folder not in names:
        have = sorted((n for n in names if re.fullmatch(r"s[0-9]+", n)), key=lambda n: int(n[1:]))
        raise SpecError(f"{ds.store.describe(s.folder)}: scale {s.index} has no folder in this export (it has "
                        f"{', '.join(have) if have else 'no scale folders'})")
    return origins


def _task_keys(job: _Job, origins: np.ndarray, g: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Task-grid keys (k, 3) of the blocks of ``g`` chunks that overlap a shard inside [lo, hi)."""
    if not len(origins):
        return np.zeros((0, 3), np.int64)
    extent = min(job.scale.shard_extent, SINGLE_SHARD)
    a = np.maximum(origins, lo)
    b = np.minimum(origins + extent, hi)
    keep = (b > a).all(axis=1)
    a, b = a[keep], b[keep]
    k0 = (a - job.lo) // job.cs // g
    k1 = (b - 1 - job.lo) // job.cs // g + 1
    span = (k1 - k0).max(axis=0) if len(k0) else np.zeros(3, np.int64)
    keys = []
    for dx in range(int(span[0])):  # a shard spans few task blocks per axis: loops over offsets, not shards
        for dy in range(int(span[1])):
            for dz in range(int(span[2])):
                k = k0 + (dx, dy, dz)
                keys.append(k[(k < k1).all(axis=1)])
    return np.unique(np.concatenate(keys), axis=0) if keys else np.zeros((0, 3), np.int64)


def _group_of(chunks_per_task, job: _Job) -> np.ndarray | None:
    """Chunks per task per axis given (None: the default, per source shard)."""
    if chunks_per_task is None:
        return None
    try:
        g = np.broadcast_to(np.asarray(chunks_per_task, np.int64), (3,)).copy()
    except (TypeError, ValueError):
        g = np.zeros(3, np.int64)
    if isinstance(chunks_per_task, bool) or (g < 1).any():
        raise SpecError(f"chunks_per_task must be a positive integer or three, got {chunks_per_task!r}")
    return g


def _default_group(job: _Job, origins: np.ndarray) -> np.ndarray:
    """One source shard's worth of chunks per axis, doubled until the whole scale has at most
    ``MAX_TASKS`` tasks. Depends only on the export and the chunk size (not on a box or chunk
    list), so every run into one folder cuts the grid the same way."""
    extent = min(job.scale.shard_extent, SINGLE_SHARD)
    g = np.minimum(np.maximum(extent // job.cs, 1), job.grid)
    while len(_task_keys(job, origins, g, job.lo, job.hi)) > MAX_TASKS and (g < job.grid).any():
        g = np.minimum(g * 2, job.grid)
    return g


def _plan(job: _Job, box, chunks, group: np.ndarray | None) -> list[_Task]:
    """The job's tasks: for chunks given, their task blocks; else the blocks overlapping shards
    (and the box). Sets ``job.group`` and ``job.crange``."""
    grid = job.grid
    arr = None
    if chunks is not None:
        try:
            arr = np.asarray(chunks, np.int64).reshape(-1, 3)
        except (TypeError, ValueError):
            raise SpecError(f"chunks must be (n, 3) chunk indices, got {chunks!r}") from None
        bad = ((arr < 0) | (arr >= grid)).any(axis=1)
        if bad.any():
            raise SpecError(f"chunk {tuple(int(v) for v in arr[bad][0])} is outside the PCG grid "
                            f"{tuple(int(v) for v in grid)}")
    lo, hi = job.lo, job.hi
    if box is not None:
        try:
            blo, bhi = (np.asarray(v, np.int64).reshape(3) for v in box)
        except (TypeError, ValueError):
            raise SpecError(f"box must be [[x0, y0, z0], [x1, y1, z1]], got {box!r}") from None
        lo, hi = np.maximum(lo, blo), np.minimum(hi, bhi)
        if (hi <= lo).any():
            raise SpecError(f"box {[blo.tolist(), bhi.tolist()]} does not overlap scale {job.scale.index}'s volume "
                            f"{[job.lo.tolist(), job.hi.tolist()]}")
        job.crange = ((lo - job.lo) // job.cs, (hi - 1 - job.lo) // job.cs + 1)
    origins = np.asarray(_present_shards(job.ds, job.scale), np.int64).reshape(-1, 3)
    g = group if group is not None else _default_group(job, origins)
    job.group = tuple(int(v) for v in g)
    if arr is not None:
        arr = np.unique(arr, axis=0)
        keys, inv = np.unique(arr // g, axis=0, return_inverse=True)
        members: list[list] = [[] for _ in range(len(keys))]
        for c, k in zip(arr.tolist(), inv.ravel().tolist(), strict=True):  # the chunks asked for, not the grid
            members[k].append(tuple(c))
        return [_Task(tuple(int(v) for v in k), tuple(m)) for k, m in zip(keys.tolist(), members, strict=True)]
    keys = _task_keys(job, origins, g, lo, hi)
    return [_Task((int(x), int(y), int(z))) for x, y, z in keys.tolist()]


def _manifest(job: _Job, source, ds: Dataset, layout: IdLayout, labels: dict) -> dict:
    s = job.scale
    return {
        "format": FORMAT,
        "version": VERSION,
        "source": _describe(source, ds),
        "scale": s.index,
        "resolution": list(s.resolution) if s.resolution is not None else None,
        "volume_size": list(s.size),
        "voxel_offset": list(s.voxel_offset),
        "chunk_size": [int(v) for v in job.cs],
        "grid": [int(v) for v in job.grid],
        **layout.to_json(),
        "affinity": job.affinity,
        "compression_level": job.level,
        "components": labels,
        "chunks_per_task": list(job.group),
        "edges": "edges_{x}_{y}_{z}.proto.zst",
        "components_files": "components_{x}_{y}_{z}.proto",
        "side_table": SIDE_TABLE + "/{kx}_{ky}_{kz}.parquet (one file per task; read the folder as one table)",
    }


def _describe(source, ds: Dataset) -> str:
    if isinstance(source, (str, os.PathLike)):
        s = os.fspath(source)
        return s if "://" in s else os.path.abspath(s)
    return repr(ds)


_PARAMS = ("format", "version", "scale", "volume_size", "voxel_offset", "chunk_size", "grid", "layers",
           "spatial_bits", "layer_bits", "affinity", "components", "chunks_per_task")


def write_edges(source, out, chunk_size, *, scale=0, layers: int | None = None, spatial_bits: int = 10,
                labels="agglomerated", affinity: str = "area", level: int = 3, scheduler=None,
                resume: bool = False, overwrite: bool = False, spec=None, box=None, chunks=None,
                chunks_per_task=None, threads: int | None = None, fill_missing_shards: bool = True,
                progress: bool | None = None) -> PcgReport:
    """Write PyChunkedGraph edges and components files for an export's supervoxels.

    Parameters
    ----------
    source : path, URL, kvstore spec or Dataset
        The export.
    out : path
        Output folder (local or shared by the workers): empty, new, or this job's earlier output
        (with ``resume`` or ``overwrite``). Holds ``edges_*.proto.zst``, ``components_*.proto``,
        ``supervoxels/`` (the side table, one Parquet file per task) and ``manifest.json``.
    chunk_size : (x, y, z)
        PCG's layer-1 chunk size in voxels (its ``CHUNK_SIZE``, e.g. (256, 256, 256)); the grid
        starts at the scale's voxel offset.
    scale : int
        Scale (folder number) to build the graph of; a scale the export has no folder for is a
        SpecError.
    layers : int, optional
        PCG layer count; default ``ceil(log2(max chunks per axis)) + 2`` as PCG computes it.
    spatial_bits : int
        PCG's ``SPATIAL_BITS`` (10).
    labels : "agglomerated" or a mapping
        Bodies for the components files: the records' agglomerated labels, or a supervoxel ->
        body mapping. Give a large mapping as a *file*: it is checked here (parsed once per host,
        in a child process, into a memory-mapped sidecar), travels in the tasks as its path and
        is loaded once per worker. A mapping object (dict, (n, 2) array, Series, LabelMapping)
        travels in every task (16 bytes per supervoxel).
    affinity : "area" or "default"
        Edge affinity: the contact face count, or PCG's default (float32 tiny).
    level : int
        zstd level of the edges files. PCG reads any level; its own ingest writes 17, which
        costs ~35x the CPU of level 3 for files within a few percent of the same size
        (benchmarks/RESULTS.md).
    scheduler : None, "auto", "serial", "threads[:N]", "local[:N]", address or distributed.Client
        Where tasks run (`dvidshards.jobs.runner.TaskRunner`).
    resume : bool
        Continue a run into ``out`` with the same parameters: chunks a side-table part covers
        are skipped, failed and unfinished ones redone.
    overwrite : bool
        Delete this job's earlier output in ``out`` (only files it writes) and start again.
    spec : dict or path, optional
        The export's neuroglancer spec (see ``Dataset``).
    box : [[x0, y0, z0], [x1, y1, z1]], optional
        Only chunks overlapping this voxel box (which must overlap the volume).
    chunks : (n, 3) ints, optional
        Only these chunks (PCG grid indices).
    chunks_per_task : int or (3 ints), optional
        Chunks per task along each axis. Default: one source shard's worth (shard extent //
        chunk size; 8³ = 512 chunks for mCNS shards at 256³), doubled until the job has at most
        ``MAX_TASKS`` tasks. A task skips its chunks that are already covered.
    threads : int, optional
        Decoding threads per task (default: all cores when tasks run one at a time, else 1).
    fill_missing_shards : bool
        Read shard files that do not exist as background (DVID writes none for empty shards).
    progress : bool, optional
        tqdm bar on a terminal, else a log line every ~30 s (default); False: nothing.

    Returns
    -------
    PcgReport

    Raises
    ------
    SpecError
        Bad arguments, a scale without folder, a box outside the volume.
    PcgError
        ``out`` holds something other than this job's earlier output (or, without ``resume``
        / ``overwrite``, holds that); a resume with other parameters.
    MappingError
        A mapping file that cannot be used (file and line named).
    """
    t0 = time.perf_counter()
    fmt.message_classes()  # fail early without protobuf
    ds = source if isinstance(source, Dataset) else Dataset(source, spec=spec)
    s = ds.scale(scale)
    cs = _triple(chunk_size, "chunk_size")
    if affinity not in ("area", "default"):
        raise SpecError(f"affinity must be 'area' or 'default', got {affinity!r}")
    if not 1 <= int(level) <= 22:
        raise SpecError(f"zstd level must be in 1..22, got {level}")
    if resume and overwrite:
        raise SpecError("give resume or overwrite, not both")
    if isinstance(labels, str) and labels == "supervoxels":
        raise SpecError("components group pieces by body: labels must be 'agglomerated' or a mapping")
    src = as_labels(labels)
    if not isinstance(src, (Agglomerated, Mapped)):
        raise SpecError(f"labels must be 'agglomerated' or a mapping, got {labels!r}")
    mapped = src if isinstance(src, Mapped) else None
    runner = TaskRunner(scheduler, progress=progress)  # checks the scheduler before anything is written
    grid = -(-np.asarray(s.size, np.int64) // np.asarray(cs, np.int64))
    layout = IdLayout(int(layers) if layers is not None else fmt.layers_for_grid(grid), int(spatial_bits))
    layout.check_grid(grid)
    out = os.path.abspath(os.fspath(out))
    job = _Job(ds, s, out, cs, layout, mapped, affinity, level, threads, fill_missing_shards)
    group = _group_of(chunks_per_task, job)
    old = _existing(out)
    if group is None and resume and old is not None and old.get("chunks_per_task"):
        group = _group_of(old["chunks_per_task"], job)  # the earlier run's cut
    items = _plan(job, box, chunks, group)
    if mapped is not None:
        mapped.prepare()  # a bad file fails now; large ones get their per-host sidecar
    manifest = _manifest(job, source, ds, layout, src.identity())
    kind, _ = scheduler_of(scheduler)
    if threads is None and not (kind == "serial" or len(items) <= 1):
        job.threads = 1  # tasks run side by side: one decoding thread each
    _prepare(out, manifest, old, resume, overwrite)
    report = PcgReport(out, tasks=len(items))
    with runner:
        jr = runner.run(functools.partial(_run_task, job), items, desc=f"PCG tasks of {'×'.join(map(str, job.group))} "
                                                                         f"chunks")
    for t, msg in jr.failed.items():
        report.failed[t.describe(job.group)] = msg
        report.failed_chunks += len(job.members(t))
    for r in jr.results.values():
        report.chunks += r["chunks"]
        report.skipped += r["skipped"]
        report.pieces += r["part_rows"]
        report.written += r["part_written"]
        for k in fmt.EDGE_TYPES:
            report.edges[k] += r[k]
        report.isolated += r["isolated"]
        for c, msg in r["failed"].items():
            if len(report.failed) < _FAILED_NAMED:
                report.failed[c] = msg
        report.failed_chunks += r["failed_count"]
    manifest.update(complete=report.ok, chunks=report.chunks, chunks_written=report.written, pieces=report.pieces,
                    tasks=report.tasks, failed=report.failed_chunks)
    _write_manifest(out, manifest)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.join(out, TMP))  # when empty
    report.elapsed = time.perf_counter() - t0
    return report


def _triple(v, what: str) -> tuple[int, int, int]:
    try:
        t = tuple(int(x) for x in v)
    except (TypeError, ValueError):
        t = ()
    if len(t) != 3 or min(t) < 1:
        raise SpecError(f"{what} must be three positive integers, got {v!r}")
    return t


def _existing(out: str) -> dict | None:
    """The manifest of earlier output in ``out`` (None: none)."""
    path = os.path.join(out, MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path, "rb") as f:
            old = json.loads(f.read())
    except (OSError, ValueError) as e:
        raise PcgError(f"{path}: unreadable manifest ({e})") from None
    if not isinstance(old, dict) or old.get("format") != FORMAT:
        raise PcgError(f"{out} holds a {MANIFEST} that is not pcg-edges output; choose an empty or new folder")
    return old


def _prepare(out: str, manifest: dict, old: dict | None, resume: bool, overwrite: bool) -> None:
    """Create ``out``; refuse anything in it but this job's earlier output (resume: with the same
    parameters; overwrite: deleted first)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise PcgError(f"{out} exists and is not a folder")
    if old is None:
        if os.path.isdir(out):
            with os.scandir(out) as it:
                first = next(iter(it), None)
            if first is not None:
                raise PcgError(f"{out} is not empty ({first.name!r} ...) and holds no pcg-edges output; choose an "
                               f"empty or new folder")
    elif resume:
        diff = [k for k in _PARAMS if old.get(k) != manifest.get(k)]
        if diff:
            raise PcgError(f"{os.path.join(out, MANIFEST)}: cannot resume with different parameters: "
                           + ", ".join(f"{k} {old.get(k)!r} -> {manifest.get(k)!r}" for k in diff))
        shutil.rmtree(os.path.join(out, TMP), ignore_errors=True)  # leftovers of interrupted writes
    elif overwrite:
        _remove_own(out)
    else:
        raise PcgError(f"{out} already holds pcg-edges output; pass resume=True (--resume) to continue it, "
                       f"overwrite=True (--overwrite) to replace it, or choose a new folder")
    os.makedirs(os.path.join(out, SIDE_TABLE), exist_ok=True)
    os.makedirs(os.path.join(out, TMP), exist_ok=True)
    _write_manifest(out, {**manifest, "complete": False})


def _remove_own(out: str) -> None:
    """Delete the files this job writes (any version) from ``out``; nothing else."""
    os.remove(os.path.join(out, MANIFEST))  # first: an interrupted delete leaves no output that looks whole
    with os.scandir(out) as it:
        for e in it:
            if not _OWN.fullmatch(e.name):
                continue
            if e.is_dir(follow_symlinks=False):
                shutil.rmtree(e.path)
            else:
                os.remove(e.path)


def _write_manifest(out: str, manifest: dict) -> None:
    _put(out, MANIFEST, json.dumps(manifest, indent=1).encode())


# --------------------------------------------------------------------------- reading back


def read_chunk_edges(path, coords) -> dict:
    """The edges file of one chunk: ``{"in"|"between"|"cross": (ids1, ids2, affinities, areas)}``.

    A missing file reads as no edges (as in PCG's ``get_chunk_edges``); a corrupt one raises
    PcgError naming it.
    """
    import zstandard

    f = os.path.join(os.fspath(path), fmt.edges_path(coords))
    try:
        with open(f, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        return fmt.decode_edges(b"", f)
    try:
        raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=1 << 34)
    except zstandard.ZstdError as e:
        raise PcgError(f"{f}: not a zstd frame ({e})") from None
    return fmt.decode_edges(raw, f)


def read_chunk_components(path, coords) -> list[np.ndarray]:
    """The components file of one chunk: its groups of PCG ids (one array per body), [] if absent."""
    f = os.path.join(os.fspath(path), fmt.components_path(coords))
    try:
        with open(f, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        return []
    return fmt.decode_components(data, f)


def read_side_table(path):
    """The side table of a pcg-edges output as one table, sorted by ``pcg_id``.

    ``pcg_id, dvid_supervoxel, chunk_x, chunk_y, chunk_z, voxels``: every piece (DVID supervoxel
    in a PCG chunk) of the chunks done. For large outputs read the folder ``supervoxels/`` with
    ``pyarrow.dataset`` instead (one file per task).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = os.path.join(os.fspath(path), SIDE_TABLE)
    if not os.path.isdir(folder):
        raise PcgError(f"{folder}: no side table (not a pcg-edges output of version {VERSION})")
    names = sorted(n for n in os.listdir(folder) if n.endswith(".parquet"))
    parts = []
    for n in names:
        try:
            parts.append(pq.read_table(os.path.join(folder, n)).replace_schema_metadata(None))
        except (OSError, pa.ArrowException) as e:
            raise PcgError(f"{os.path.join(folder, n)}: unreadable side-table part ({e})") from None
    t = pa.concat_tables(parts) if parts else _schema().empty_table()
    return t.sort_by("pcg_id")


# --------------------------------------------------------------------------- command line


def add_arguments(p) -> None:
    """Arguments of ``dvidshards pcg-edges``."""
    p.add_argument("source", help="export root (directory, gs://, s3://, http(s):// URL)")
    p.add_argument("--spec", help="the neuroglancer multiscale spec given to DVID (default: ./info or inferred)")
    p.add_argument("--out", required=True, help="output folder (PCG's edges and components files); empty, new, or "
                                                "an earlier pcg-edges output with --resume or --overwrite")
    p.add_argument("--chunk-size", type=int, nargs=3, required=True, metavar=("X", "Y", "Z"),
                   help="PCG layer-1 chunk size in voxels, e.g. 256 256 256")
    p.add_argument("--scale", type=int, default=0, help="scale folder number (default 0)")
    p.add_argument("--layers", type=int, help="PCG layer count (default: from the grid, as PCG computes it)")
    p.add_argument("--spatial-bits", type=int, default=10, help="PCG SPATIAL_BITS (default 10)")
    p.add_argument("--mapping", help="supervoxel -> body mapping file for the components (default: the "
                                     "export's agglomerated labels); loaded once per worker")
    p.add_argument("--affinity", choices=("area", "default"), default="area",
                   help="edge affinity: contact face count (default) or PCG's tiny default")
    p.add_argument("--level", type=int, default=3,
                   help="zstd level of the edges files (default 3; PCG's own ingest writes 17)")
    p.add_argument("--box", type=int, nargs=6, metavar=("X0", "Y0", "Z0", "X1", "Y1", "Z1"),
                   help="only chunks overlapping this voxel box")
    p.add_argument("--chunks-per-task", type=int, default=None, metavar="G",
                   help="one task per G³ block of chunks (default: one source shard's worth, at most "
                        f"{MAX_TASKS:,} tasks)")
    job_arguments(p, workdir=False, resume=True, overwrite=True)


def main(args) -> int:
    """Run ``dvidshards pcg-edges``; 0 when every chunk was written, 1 when some failed."""
    box = None if args.box is None else [args.box[:3], args.box[3:]]
    report = write_edges(args.source, args.out, args.chunk_size, scale=args.scale, layers=args.layers,
                         spatial_bits=args.spatial_bits,
                         labels=args.mapping if args.mapping else "agglomerated", affinity=args.affinity,
                         level=args.level, scheduler=args.scheduler, resume=args.resume,
                         overwrite=getattr(args, "overwrite", False), spec=args.spec, box=box,
                         chunks_per_task=args.chunks_per_task, progress=progress_of(args))
    print(report.summary(), file=sys.stdout)
    return 0 if report.ok else 1


if __name__ == "__main__":  # pragma: no cover
    import argparse

    _p = argparse.ArgumentParser(prog="dvidshards pcg-edges")
    add_arguments(_p)
    try:
        sys.exit(main(_p.parse_args()))
    except DvidShardsError as _e:
        print(f"dvidshards: {type(_e).__name__}: {_e}", file=sys.stderr)
        sys.exit(2)
