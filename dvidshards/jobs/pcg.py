"""Supervoxel adjacency for PyChunkedGraph: per-chunk edges and components files from an export.

``pcg_edges(source, dest, chunk_size=...)`` (``dvidshards pcg-edges EXPORT DEST --chunk-size X Y
Z``) reads as plan → tasks → reduce:

* **plan** (`_plan`) - the PCG layer-1 grid is cut into *tasks* of ``chunks_per_task`` chunks
  per axis (default: one source shard's worth, so ~26 K tasks for mCNS s0 at 256³, grown if
  needed to stay under ``MAX_TASKS``). The planner lists the shard files once and computes the
  tasks that overlap them with numpy: nothing on the client loops over chunks, and a task is a
  small record (its grid key).
* **task** (`_run_task`, `_Job.run` per chunk) - for each of its chunks a task

  1. takes the supervoxel lists of the DVID blocks overlapping the chunk and its 6 face
     neighbours from the shard records (no decoding) and builds each chunk's id list: the
     chunk's pieces ((DVID supervoxel, PCG chunk) pairs) are numbered in that sorted order, so
     neighbouring chunks agree on each other's PCG ids without reading each other's voxels;
  2. reads the chunk plus a one-voxel halo as supervoxels with the bulk reader (0 outside the
     volume) and counts voxels and contact faces (``dvidshards.formats.pcg.contacts``);
  3. writes ``edges_{x}_{y}_{z}.proto.zst`` (PCG's ChunkEdgesMsg in one zstd frame) and
     ``components_{x}_{y}_{z}.proto`` (the chunk's pieces and the neighbour pieces of its
     between/cross edges, grouped by body: the records' agglomerated labels or a mapping, which
     a mapping file passes by reference and each worker loads once).

  Last, the task writes its rows of the side table, ``supervoxels/{kx}_{ky}_{kz}.parquet``
  (pcg_id, dvid_supervoxel, chunk_x, chunk_y, chunk_z, voxels; sorted by pcg_id), whose metadata
  lists the chunks it covers: that file is the task's completion record, so ``resume=True``
  redoes only chunks that no part covers, and a chunk that failed is left out of it.
* **reduce** - nothing to merge: the side table is the folder (``pyarrow.parquet.read_table(dest
  / "supervoxels")``, or `read_side_table`); the client only adds up counts.

Every file goes through :class:`dvidshards.jobs.output.Destination` (a path, ``gs://``, ``s3://``
or a kvstore spec; written under a temporary name and renamed, or as one object in a bucket), and
the job runs in :class:`dvidshards.jobs.output.Output`: the destination is checked (a bucket
probed) before any work, locked while written, refused unless empty or this job's own earlier
output (with ``resume``: the same parameters; or ``overwrite``), and its manifest
``_dvidshards.json`` says ``complete: false`` until every chunk is done; its ``pcg`` member
describes the output for PCG (layers, bits, grid, file names). Chunks whose blocks list no
supervoxel get no files (PCG reads a missing file as no edges). Needs ``dvidshards[pcg]``
(protobuf).
"""

from __future__ import annotations

import functools
import json
import re
import threading
import warnings
from dataclasses import asdict, dataclass, field

import numpy as np

from ..dataset import Dataset
from ..errors import DvidShardsError, SpecError
from ..formats import pcg as fmt
from ..formats.labels import Agglomerated, LabelSource, Mapped, as_labels
from ..formats.multiscale import SINGLE_SHARD
from ..formats.pcg import IdLayout, PcgError
from ..sources.base import RecordSource
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
from .output import Destination, JobReport, Output, is_temporary
from .runner import TaskRunner, scheduler_of

__all__ = ["PcgEdgesCommand", "MAX_TASKS", "PcgTotals", "add_arguments", "main", "pcg_edges", "read_chunk_components",
           "read_chunk_edges", "read_side_table", "write_edges"]

#: the kernels a task uses (TaskRunner.run compiles them first)
KERNELS = ("dvidshards.formats.codec._decode_kernel", "dvidshards.formats.arrowipc._resolve",
           "dvidshards.formats.arrowipc._message", "dvidshards.formats.mapping._apply")

SIDE_TABLE = "supervoxels"  # a folder: one Parquet file per task
FORMAT = "dvidshards-pcg-edges"
VERSION = 3  # 2: manifest.json of its own; 1: one supervoxels.parquet built on the client
MAX_TASKS = 100_000  # the default task size grows until a job has at most this many tasks
COVERED = b"dvidshards.covered"  # side-table part metadata: the chunks done
WRITTEN = b"dvidshards.written"  # and those with files
_OWN = re.compile(r"edges_[0-9]+_[0-9]+_[0-9]+\.proto\.zst|components_[0-9]+_[0-9]+_[0-9]+\.proto|supervoxels"
                  r"|manifest\.json|supervoxels\.parquet|pieces")  # (the last three: earlier versions' names)
_COUNTS = ("pieces", "isolated", "in", "between", "cross", "bytes")
_FAILED_PER_TASK = 8  # failed chunks a task reports by name (all are counted)
_FAILED_NAMED = 1000  # and the report keeps by name


@dataclass
class PcgTotals:
    """A pcg-edges job's own figures (``JobReport.totals``).

    Attributes
    ----------
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
    failed_chunks : int
        Chunks that failed, all counted (a task that failed as a whole counts its chunks); the
        report names up to 8 per task and 1,000 in all.
    skipped : int
        Chunks skipped as complete (resume).
    pcg_tasks : int
        Tasks of the job.
    """

    chunks: int = 0
    written: int = 0
    pieces: int = 0
    edges: dict = field(default_factory=lambda: dict.fromkeys(fmt.EDGE_TYPES, 0))
    isolated: int = 0
    failed_chunks: int = 0
    skipped: int = 0
    pcg_tasks: int = 0

    def to_json(self) -> dict:
        return asdict(self)

    def notes(self) -> list[str]:
        e = ", ".join(f"{v:,} {k}" for k, v in self.edges.items())
        lines = [f"{self.chunks:,} chunks in {self.pcg_tasks:,} tasks ({self.written:,} with files, {self.skipped:,} "
                 f"resumed), {self.pieces:,} pieces, edges written now: {e}; {self.failed_chunks:,} chunks failed"]
        if self.isolated:
            lines.append(f"note: {self.isolated:,} pieces written now touch no other piece: no edge names them, "
                         f"so PCG's ingest will not create them")
        return lines


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

    def __init__(self, ds: Dataset, scale, dest, chunk_size, layout: IdLayout, mapped: Mapped | None,
                 affinity: str, level: int, threads: int | None, fill_missing_shards: bool):
        self.ds = ds
        self.scale = ds.scale(scale)
        self.dest = Destination.of(dest)
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
        wanted: dict = {}
        per_box: list = []
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
            j = int(clash[0])
            raise PcgError(f"chunk {tuple(coords)}: supervoxel {sv[j]} has agglomerated label {body[j]} in one block "
                           f"and {body[j + 1]} in another (inconsistent export)")
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
        self.dest.write(fmt.edges_path(coords), payload)
        comp = fmt.encode_components(groups)
        self.dest.write(fmt.components_path(coords), comp)
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
    part = _read_part(job.dest, f"{SIDE_TABLE}/{task.name}")
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
        _write_part(job.dest, f"{SIDE_TABLE}/{task.name}", part)
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


def _read_part(dest: Destination, rel: str) -> _Part:
    """A task's part as written (empty when there is none)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = dest.read(rel)
    where = dest.describe(rel)
    if data is None:
        return _Part()
    try:
        t = pq.read_table(pa.BufferReader(data))
    except (OSError, pa.ArrowException) as e:
        raise PcgError(f"{where}: unreadable side-table part ({e}); delete it and resume") from None
    meta = t.schema.metadata or {}
    try:
        covered, written = ({tuple(int(v) for v in c) for c in json.loads(meta[k])} for k in (COVERED, WRITTEN))
    except (KeyError, ValueError, TypeError):
        raise PcgError(f"{where}: a side-table part without its lists of chunks; delete it and resume") from None
    if t.schema.names != [n for n, _ in _SCHEMA_FIELDS]:
        raise PcgError(f"{where}: not a side-table part (columns {t.schema.names})")
    rows = np.stack([t.column(n).to_numpy().astype(np.uint64) for n in ("pcg_id", "dvid_supervoxel", "voxels")], 1)
    chunks = np.stack([t.column(n).to_numpy().astype(np.int32) for n in ("chunk_x", "chunk_y", "chunk_z")], 1)
    return _Part(rows, chunks, covered, written)


def _write_part(dest: Destination, rel: str, part: _Part) -> None:
    """Write a task's part: its rows sorted by PCG id, its chunk lists in the metadata."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    a = np.concatenate([r for r, _ in part.parts]) if part.parts else np.zeros((0, 3), np.uint64)
    c = np.concatenate([k for _, k in part.parts]) if part.parts else np.zeros((0, 3), np.int32)
    order = np.argsort(a[:, 0], kind="stable")
    a, c = a[order], c[order]
    meta = {COVERED: json.dumps(sorted(part.covered)).encode(), WRITTEN: json.dumps(sorted(part.written)).encode()}
    table = pa.table([a[:, 0], a[:, 1], c[:, 0], c[:, 1], c[:, 2], a[:, 2]], schema=_schema().with_metadata(meta))
    dest.write_with(rel, lambda f: pq.write_table(table, f, compression="zstd"))


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


def _parameters(job: _Job, layout: IdLayout, labels: dict) -> dict:
    """What decides the output's content: a resume must give the same (a box or a chunk list
    only chooses which chunks this run does, so runs over parts of the grid can share an output)."""
    s = job.scale
    return json.loads(json.dumps({
        "format": FORMAT,
        "version": VERSION,
        "scale": s.index,
        "volume_size": list(s.size),
        "voxel_offset": list(s.voxel_offset),
        "chunk_size": [int(v) for v in job.cs],
        "grid": [int(v) for v in job.grid],
        **layout.to_json(),
        "affinity": job.affinity,
        "components": labels,
        "chunks_per_task": list(job.group),
    }))


def _description(job: _Job) -> dict:
    """The manifest's ``pcg`` member: what a PyChunkedGraph ingest needs to know besides the parameters."""
    s = job.scale
    return {"resolution": list(s.resolution) if s.resolution is not None else None,
            "compression_level": job.level,
            "edges": "edges_{x}_{y}_{z}.proto.zst",
            "components_files": "components_{x}_{y}_{z}.proto",
            "side_table": SIDE_TABLE + "/{kx}_{ky}_{kz}.parquet (one file per task; read the folder as one table)"}


def pcg_edges(source=None, dest=None, *, chunk_size=None, scale: int = 0, labels="agglomerated", box=None,
              scheduler=None, resume: bool = False, overwrite: bool = False, progress: bool | None = None,
              allow_partial: bool = False, layers: int | None = None, spatial_bits: int = 10,
              affinity: str = "area", level: int = 3, spec=None, chunks=None, chunks_per_task=None,
              threads: int | None = None, fill_missing_shards: bool = True, command: str | None = None,
              **old) -> JobReport:
    """Write PyChunkedGraph edges and components files for an export's supervoxels.

    Parameters
    ----------
    source : path, URL, kvstore spec or Dataset
        The export.
    dest : path, URL (``gs://``, ``s3://``) or kvstore spec dict
        Output folder, written by the workers: empty, new, or this job's earlier output (with
        ``resume`` or ``overwrite``). Holds ``edges_*.proto.zst``, ``components_*.proto``,
        ``supervoxels/`` (the side table, one Parquet file per task) and the manifest
        ``_dvidshards.json``.
    chunk_size : (x, y, z)
        PCG's layer-1 chunk size in voxels (its ``CHUNK_SIZE``, e.g. (256, 256, 256)); the grid
        starts at the scale's voxel offset. Required.
    scale : int
        Scale (folder number) to build the graph of; a scale the export has no folder for is a
        SpecError.
    labels : "agglomerated" or a mapping
        Bodies for the components files: the records' agglomerated labels, or a supervoxel ->
        body mapping. Give a large mapping as a *file*: it is checked here (parsed once per host,
        in a child process, into a memory-mapped sidecar), travels in the tasks as its path and
        is loaded once per worker. A mapping object (dict, (n, 2) array, Series, LabelMapping)
        travels in every task (16 bytes per supervoxel).
    box : [[x0, y0, z0], [x1, y1, z1]], optional
        Only chunks overlapping this voxel box (which must overlap the volume).
    scheduler : None, "auto", "serial", "threads[:N]", "local[:N]", address or distributed.Client
        Where tasks run (`dvidshards.jobs.runner.TaskRunner`).
    resume : bool
        Continue a run into ``dest`` with the same parameters: chunks a side-table part covers
        are skipped, failed and unfinished ones redone. A box or a chunk list may differ.
    overwrite : bool
        Delete this job's earlier output in ``dest`` (only files it writes) and start again.
    progress : bool, optional
        tqdm bar on a terminal, else a log line every ~30 s (default); False: nothing.
    allow_partial : bool
        Return the report of an incomplete output instead of raising JobError.
    layers : int, optional
        PCG layer count; default ``ceil(log2(max chunks per axis)) + 2`` as PCG computes it.
    spatial_bits : int
        PCG's ``SPATIAL_BITS`` (10).
    affinity : "area" or "default"
        Edge affinity: the contact face count, or PCG's default (float32 tiny).
    level : int
        zstd level of the edges files. PCG reads any level; its own ingest writes 17, which
        costs ~35x the CPU of level 3 for files within a few percent of the same size
        (benchmarks/RESULTS.md).
    spec : dict or path, optional
        The export's neuroglancer spec (see ``Dataset``).
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
    command : str, optional
        The command line, recorded in the manifest.

    Returns
    -------
    JobReport
        ``totals`` is a :class:`PcgTotals`; ``failed`` names failed chunks (``PCG chunk (x, y,
        z)``) and tasks that failed as a whole (``chunks x a:b, y c:d, z e:f``).

    Raises
    ------
    SpecError, OutputError
        Bad arguments, a scale without folder, a box outside the volume, a destination that
        cannot be used or holds something else; before any work.
    PcgError
        An id layout that cannot hold the grid.
    MappingError
        A mapping file that cannot be used (file and line named).
    JobError
        Chunks failed and ``allow_partial`` is false; ``.report`` is the report.

    Notes
    -----
    ``write_edges(source, out, chunk_size, ...)`` is the old name and form (one more release,
    with a DeprecationWarning); so are the keywords ``out=`` and ``mapping=``.
    """
    dest = renamed(old, "out", "dest", dest, job="pcg_edges")
    if "mapping" in old:
        warnings.warn("pcg_edges(mapping=...) is now pcg_edges(labels=...) (the old keyword goes in the next "
                      "release)", DeprecationWarning, stacklevel=2)
        labels = old.pop("mapping")
    if old:
        raise TypeError(f"pcg_edges() got an unexpected keyword argument {next(iter(old))!r}")
    if source is None or dest is None:
        raise TypeError("pcg_edges() needs source (the export) and dest (the output folder)")
    if chunk_size is None:
        raise SpecError("pcg_edges needs chunk_size, PCG's layer-1 chunk size in voxels (e.g. (256, 256, 256))")
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
    kind, _ = scheduler_of(scheduler)  # a malformed scheduler is refused before anything is written
    destination = Destination.of(dest)
    grid = -(-np.asarray(s.size, np.int64) // np.asarray(cs, np.int64))
    layout = IdLayout(int(layers) if layers is not None else fmt.layers_for_grid(grid), int(spatial_bits))
    layout.check_grid(grid)
    job = _Job(ds, s, destination, cs, layout, mapped, affinity, level, threads, fill_missing_shards)
    items = _plan(job, box, chunks, _group_of(chunks_per_task, job))
    if mapped is not None:
        mapped.prepare()  # a bad file fails now; large ones get their per-host sidecar
    if threads is None and not (kind == "serial" or len(items) <= 1):
        job.threads = 1  # tasks run side by side: one decoding thread each
    totals = PcgTotals(pcg_tasks=len(items))
    with TaskRunner(scheduler, progress=progress) as runner, \
            Output(destination, job="pcg-edges", parameters=_parameters(job, layout, src.identity()), source=ds,
                   scales=[s.index], command=command, resume=resume, overwrite=overwrite,
                   own=lambda n: bool(_OWN.fullmatch(n))) as out:
        out.update(pcg=_description(job), box=None if box is None else [list(map(int, v)) for v in box],
                   chunks=None if chunks is None else len(np.asarray(chunks).reshape(-1, 3)))
        if out.previous is not None:
            _remove_temporaries(destination)  # a killed run's half-written files (we hold the lock)
        phase = runner.run(functools.partial(_run_task, job), items,
                           desc=f"PCG tasks of {'×'.join(map(str, job.group))} chunks", kernels=KERNELS)
        out.add(phase, name=lambda t: t.describe(job.group))
        for t in phase.failed:
            totals.failed_chunks += len(job.members(t))
        named = 0
        for r in phase.results.values():
            totals.chunks += r["chunks"]
            totals.skipped += r["skipped"]
            totals.pieces += r["part_rows"]
            totals.written += r["part_written"]
            for k in fmt.EDGE_TYPES:
                totals.edges[k] += r[k]
            totals.isolated += r["isolated"]
            for c, msg in r["failed"].items():
                if named < _FAILED_NAMED:
                    out.fail(f"PCG chunk {c}", msg)
                    named += 1
            totals.failed_chunks += r["failed_count"]
        if totals.failed_chunks and not out.report.failed:  # (cannot happen: a failed chunk is named)
            out.fail("chunks", f"{totals.failed_chunks} chunks failed")
        return out.finish(totals=totals, notes=totals.notes(), allow_partial=allow_partial)


def write_edges(source, out, chunk_size, **kw) -> JobReport:
    """The old name and form of :func:`pcg_edges` (``write_edges(source, out, chunk_size, ...)``):
    works for one more release, with a DeprecationWarning, and returns the report of an incomplete
    output instead of raising (as it did)."""
    warnings.warn("write_edges(source, out, chunk_size, ...) is now pcg_edges(source, dest, chunk_size=...) (the old "
                  "name goes in the next release)", DeprecationWarning, stacklevel=2)
    kw.setdefault("allow_partial", True)
    return pcg_edges(source, out, chunk_size=chunk_size, **kw)


def _remove_temporaries(dest: Destination) -> None:
    """Delete the temporary files of interrupted writes in a local output (a bucket has none:
    its objects are written whole)."""
    if not dest.local:
        return
    import os

    for folder in (dest.local_path(), dest.local_path(SIDE_TABLE)):
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for n in names:
            if is_temporary(n):
                try:
                    os.unlink(os.path.join(folder, n))
                except OSError:
                    pass


def _triple(v, what: str) -> tuple[int, int, int]:
    try:
        t = tuple(int(x) for x in v)
    except (TypeError, ValueError):
        t = ()
    if len(t) != 3 or min(t) < 1:
        raise SpecError(f"{what} must be three positive integers, got {v!r}")
    return t


# --------------------------------------------------------------------------- reading back


def read_chunk_edges(path, coords) -> dict:
    """The edges file of one chunk: ``{"in"|"between"|"cross": (ids1, ids2, affinities, areas)}``.

    ``path`` is the output (a folder, ``gs://``, ``s3://`` or a kvstore spec). A missing file
    reads as no edges (as in PCG's ``get_chunk_edges``); a corrupt one raises PcgError naming it.
    """
    import zstandard

    d = Destination.of(path, what="pcg-edges output")
    name = fmt.edges_path(coords)
    where = d.describe(name)
    data = d.read(name)
    if data is None:
        return fmt.decode_edges(b"", where)
    try:
        raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=1 << 34)
    except zstandard.ZstdError as e:
        raise PcgError(f"{where}: not a zstd frame ({e})") from None
    return fmt.decode_edges(raw, where)


def read_chunk_components(path, coords) -> list[np.ndarray]:
    """The components file of one chunk: its groups of PCG ids (one array per body), [] if absent."""
    d = Destination.of(path, what="pcg-edges output")
    name = fmt.components_path(coords)
    data = d.read(name)
    if data is None:
        return []
    return fmt.decode_components(data, d.describe(name))


def read_side_table(path):
    """The side table of a pcg-edges output as one table, sorted by ``pcg_id``.

    ``pcg_id, dvid_supervoxel, chunk_x, chunk_y, chunk_z, voxels``: every piece (DVID supervoxel
    in a PCG chunk) of the chunks done. For large outputs read the folder ``supervoxels/`` with
    ``pyarrow.dataset`` instead (one file per task).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = Destination.of(path, what="pcg-edges output").child(SIDE_TABLE)
    names = [n for n in d.list() if n.endswith(".parquet")]
    if not names and not d.exists():
        raise PcgError(f"{d.describe()}: no side table (not a pcg-edges output of version {VERSION})")
    parts = []
    for n in names:
        data = d.read(n)
        try:
            parts.append(pq.read_table(pa.BufferReader(data or b"")).replace_schema_metadata(None))
        except (OSError, pa.ArrowException) as e:
            raise PcgError(f"{d.describe(n)}: unreadable side-table part ({e})") from None
    t = pa.concat_tables(parts) if parts else _schema().empty_table()
    return t.sort_by("pcg_id")


# --------------------------------------------------------------------------- command line


def add_arguments(p) -> None:
    """Arguments of ``dvidshards pcg-edges``."""
    add_source(p)
    add_dest(p, what="output folder (PCG's edges and components files): empty, new, or an earlier pcg-edges "
                     "output with --resume or --overwrite")
    p.add_argument("--chunk-size", type=int, nargs=3, required=True, metavar=("X", "Y", "Z"),
                   help="PCG layer-1 chunk size in voxels, e.g. 256 256 256")
    add_scale(p)
    add_labels(p, old=True)
    add_box(p)
    p.add_argument("--layers", type=int, help="PCG layer count (default: from the grid, as PCG computes it)")
    p.add_argument("--spatial-bits", type=int, default=10, help="PCG SPATIAL_BITS (default 10)")
    p.add_argument("--affinity", choices=("area", "default"), default="area",
                   help="edge affinity: contact face count (default) or PCG's tiny default")
    p.add_argument("--level", type=int, default=3,
                   help="zstd level of the edges files (default 3; PCG's own ingest writes 17)")
    p.add_argument("--chunks-per-task", type=int, default=None, metavar="G",
                   help="one task per G³ block of chunks (default: one source shard's worth, at most "
                        f"{MAX_TASKS:,} tasks)")
    add_job_options(p, workdir=False)


_DEFAULTS = {"scale": 0, "labels": "agglomerated", "spatial_bits": 10, "affinity": "area", "level": 3}


def main(args) -> int:
    """Run ``dvidshards pcg-edges``; 0 when every chunk was written, 1 when some failed."""
    report = pcg_edges(args.source, dest_of(args), chunk_size=args.chunk_size, scale=args.scale, labels=args.labels,
                       box=args.box, layers=args.layers, spatial_bits=args.spatial_bits, affinity=args.affinity,
                       level=args.level, spec=args.spec, chunks_per_task=args.chunks_per_task, allow_partial=True,
                       command=command_line("pcg-edges", args, skip=[k for k, v in _DEFAULTS.items()
                                                                     if getattr(args, k) == v]),
                       **job_options(args, workdir=False))
    print(report.summary())
    return 0 if report.ok else 1


class PcgEdgesCommand:
    """``dvidshards pcg-edges``: one row of ``cli.COMMANDS``."""

    add_arguments = staticmethod(add_arguments)
    main = staticmethod(main)
