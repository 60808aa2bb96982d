"""Supervoxel adjacency for PyChunkedGraph: per-chunk edges and components files from an export.

``pcg_edges(source, dest, chunk_size=...)`` (``dvidshards pcg-edges EXPORT DEST --chunk-size X Y Z``)
reads as plan -> tasks -> reduce:

* **plan** (:func:`plan`): the PCG layer-1 grid cut into tasks of ``chunks_per_task`` chunks per
  axis (default: one source shard's worth, ~26 K tasks for mCNS s0 at 256³, grown to stay under
  ``MAX_TASKS``), computed with numpy from the listed shard files: a task is its grid key.
* **task** (:func:`run_task`, :meth:`PcgJob.run` per chunk): the supervoxel lists of the DVID blocks
  overlapping a chunk and its 6 face neighbours, from the records (no decoding), number the chunk's
  pieces ((DVID supervoxel, PCG chunk) pairs) in sorted order, so neighbouring chunks agree on
  each other's PCG ids; the chunk plus a one-voxel halo is read and its contacts counted
  (``formats.pcg.contacts``); ``edges_{x}_{y}_{z}.proto.zst`` (PCG's ChunkEdgesMsg, one zstd
  frame) and ``components_{x}_{y}_{z}.proto`` (pieces grouped by body: the records' agglomerated
  labels, or a mapping a file passes by reference) are written. Last, the task writes its part of
  the side table, ``supervoxels/{kx}_{ky}_{kz}.parquet`` (pcg_id, dvid_supervoxel, chunk_x,
  chunk_y, chunk_z, voxels; sorted by pcg_id), whose metadata lists the chunks it covers: the
  task's completion record (``resume`` redoes the chunks no part covers; a failed chunk is left
  out). A running task records the chunks it finished in the work folder every
  :data:`CHECKPOINT_SECONDS` (``--workdir``, default ``DEST.work``), so a task whose worker died
  resumes where it was.
* **reduce** (:func:`reduce`): the side table is the folder (``pyarrow.parquet.read_table(dest /
  "supervoxels")``; :mod:`dvidshards.jobs.pcgfiles` reads an output back); the counts add up and
  failed chunks are named.

The output is a store (a folder, ``gs://``, ``s3://``) in :class:`dvidshards.jobs.output.Output`;
its manifest's ``pcg`` member describes it for PCG (layers, bits, grid, file names). Chunks whose
blocks list no supervoxel get no files (PCG reads a missing file as no edges). Needs
``dvidshards[pcg]`` (protobuf).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import zstandard

from ..dataset import Dataset
from ..errors import DvidShardsError, SpecError
from ..formats import pcg as fmt
from ..formats.labels import Agglomerated, LabelSource, Mapped, as_labels
from ..formats.multiscale import SINGLE_SHARD, Scale
from ..formats.pcg import IdLayout, PcgError
from ..stores import ByteStore, as_store, is_temporary
from .options import (
    add_box,
    add_dest,
    add_job_options,
    add_labels,
    add_scale,
    add_source,
    box_of,
    command_line,
    job_options,
)
from .output import JobReport, Output, work_folder
from .pcgfiles import SIDE_TABLE, VERSION, Chunk, read_part, write_part
from .runner import PhaseReport, TaskRunner, scheduler_of

__all__ = ["CHECKPOINT_SECONDS", "MAX_TASKS", "PcgEdgesCommand", "PcgJob", "PcgTask", "PcgTotals", "add_arguments",
           "main", "pcg_edges", "plan", "reduce", "run_task"]

#: the kernels a task uses (TaskRunner.run compiles them first)
KERNELS = ("dvidshards.formats.codec._decode_kernel", "dvidshards.formats.arrowipc._resolve",
           "dvidshards.formats.arrowipc._message", "dvidshards.formats.mapping._apply")

CHECKPOINTS = "tasks"  # in the work folder: the parts of running tasks
FORMAT = "dvidshards-pcg-edges"
MAX_TASKS = 100_000  # the default task size grows until a job has at most this many tasks
#: seconds between a running task's records of the chunks it finished (in the work folder)
CHECKPOINT_SECONDS = float(os.environ.get("DVIDSHARDS_PCG_CHECKPOINT_SECONDS", "60"))
_OWN = re.compile(r"edges_[0-9]+_[0-9]+_[0-9]+\.proto\.zst|components_[0-9]+_[0-9]+_[0-9]+\.proto|supervoxels")
_COUNTS = ("pieces", "isolated", "in", "between", "cross", "bytes")
_FAILED_PER_TASK = 8  # failed chunks a task reports by name (all are counted)
_FAILED_NAMED = 1000  # and the report keeps by name


@dataclass
class PcgTotals:
    """A pcg-edges job's own figures (``JobReport.totals``).

    ``chunks``: of the job (done now, before, or empty); ``written``: chunks with files and
    ``pieces``: side-table rows, over the job's tasks; ``edges``: written in this run per type
    (between and cross count each file's copy); ``isolated``: pieces written now that touch no
    other piece (PCG's ingest creates nodes only for ids in the edges files); ``failed_chunks``:
    all counted (the report names up to 8 per task, 1,000 in all); ``skipped``: chunks complete
    before (resume); ``pcg_tasks``: tasks of the job.
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


class _IndexPalette(LabelSource):
    """Reads 1 + each supervoxel's index in an id list (0 for background): a palette swap per
    block, so the contact kernel never looks a voxel's id up. ``target`` is set before each read
    (one palette per thread); compared by identity, so each gets its own reader."""

    name = "pcg-index"

    def __init__(self) -> None:
        self.target = np.zeros(0, np.uint64)
        self.where = ""

    def palette(self, table, i: int) -> np.ndarray:
        sv = table.supervoxels(i)
        out, bad = fmt.list_indexes(self.target, sv)
        if bad >= 0:
            raise PcgError(f"{table.where(i)}: supervoxel {sv[bad]} is not in the id list of {self.where}")
        return out

    def __eq__(self, other: object) -> bool:
        return other is self

    def __hash__(self) -> int:
        return id(self)

    def __getstate__(self) -> dict:
        return {"target": np.zeros(0, np.uint64), "where": ""}


class PcgJob:
    """What every task of one run needs (pickles without open files): the dataset and scale, the
    output and work folders (stores), the PCG grid and id layout, the bodies (None: the records'
    agglomerated labels; else a mapping, a file travelling as its path), the edge options."""

    def __init__(self, ds: Dataset, scale: int | Scale, dest: ByteStore, work: ByteStore,
                 chunk_size: Sequence[int], layout: IdLayout, mapped: Mapped | None, affinity: str, level: int,
                 threads: int | None, fill_missing_shards: bool):
        self.ds = ds
        self.scale = ds.scale(scale)
        self.dest, self.work = dest, work
        self.cs = np.asarray(chunk_size, np.int64)
        self.layout = layout
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
        self.group: tuple[int, ...] = (1, 1, 1)  # chunks per task along each axis (set by plan)
        self.crange = (np.zeros(3, np.int64), self.grid.copy())  # chunks [lo, hi) of the job

    def members(self, task: PcgTask) -> list[Chunk]:
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

    def __getstate__(self) -> dict:
        d = self.__dict__.copy()
        d["_local"] = None
        return d

    def __setstate__(self, d: dict) -> None:
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
        payload = zstandard.ZstdCompressor(level=self.level).compress(fmt.encode_edges(edges))
        self.dest.put_sync(fmt.edges_path(coords), payload)
        comp = fmt.encode_components(groups)
        self.dest.put_sync(fmt.components_path(coords), comp)
        rows = np.stack(pieces, axis=1).astype(np.uint64)
        linked = np.concatenate([edges["in"][0], edges["in"][1], edges["between"][0], edges["cross"][0]])
        stats.update(pieces=len(rows), bytes=len(payload) + len(comp), written=True,
                     isolated=int(np.count_nonzero(~np.isin(pieces[0], linked))),
                     **{k: len(v[0]) for k, v in edges.items()})
        return stats, rows



@dataclass(frozen=True)
class PcgTask:
    """Block ``key`` of the task grid (``job.group`` chunks per axis), or the chunks of it that
    were asked for (``only``)."""

    job: PcgJob = field(compare=False, repr=False)
    key: Chunk
    only: tuple[Chunk, ...] | None = None

    @property
    def name(self) -> str:
        return "_".join(str(int(v)) for v in self.key) + ".parquet"

    def __str__(self) -> str:  # as failures name it
        if self.only is not None:
            return f"chunks {list(self.only)[:4]}{' ...' if len(self.only) > 4 else ''}"
        g = self.job.group
        lo = [k * n for k, n in zip(self.key, g, strict=True)]
        return "chunks " + ", ".join(f"{n} {a}:{a + b}" for n, a, b in zip("xyz", lo, g, strict=True))


def run_task(task: PcgTask) -> dict:
    """Every chunk of a task not covered yet, then the task's side-table part; counts only.

    A chunk that raises a `DvidShardsError` is reported in ``failed`` and left out of the part
    (resume retries it); the other chunks go on. The chunks finished so far are recorded in the
    work folder every :data:`CHECKPOINT_SECONDS`, and taken from there when the task runs again.
    """
    job = task.job
    members = job.members(task)
    key = f"{SIDE_TABLE}/{task.name}"
    ckpt = f"{CHECKPOINTS}/{task.name}"
    part = read_part(job.dest, key)
    saved = read_part(job.work, ckpt)
    grew = part.merge(saved)
    todo = [c for c in members if c not in part.covered]
    total: dict = dict.fromkeys(_COUNTS, 0)
    failed: dict = {}
    total.update(chunks=len(members), skipped=len(members) - len(todo), failed=failed, failed_count=0)
    kept = bool(saved.covered)
    if todo or grew:
        last = time.monotonic()
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
            if time.monotonic() - last >= CHECKPOINT_SECONDS:
                write_part(job.work, ckpt, part)
                kept, last = True, time.monotonic()
        write_part(job.dest, key, part)
    if kept:
        job.work.delete_sync(ckpt)
    total["part_rows"] = part.rows
    total["part_written"] = len(part.written)
    return total


# --------------------------------------------------------------------------- plan


def _task_keys(job: PcgJob, origins: np.ndarray, g: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
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


def _group_of(chunks_per_task: int | Sequence[int] | None) -> np.ndarray | None:
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


def _default_group(job: PcgJob, origins: np.ndarray) -> np.ndarray:
    """One source shard's worth of chunks per axis, doubled until the whole scale has at most
    ``MAX_TASKS`` tasks. Depends only on the export and the chunk size (not on a box or chunk
    list), so every run into one folder cuts the grid the same way."""
    extent = min(job.scale.shard_extent, SINGLE_SHARD)
    g = np.minimum(np.maximum(extent // job.cs, 1), job.grid)
    while len(_task_keys(job, origins, g, job.lo, job.hi)) > MAX_TASKS and (g < job.grid).any():
        g = np.minimum(g * 2, job.grid)
    return g


def plan(job: PcgJob, *, box: Any = None, chunks: Any = None,
         chunks_per_task: int | Sequence[int] | None = None) -> list[PcgTask]:
    """The job's tasks: for chunks given, their task blocks; else the blocks overlapping shards
    (and the box). Sets ``job.group`` and ``job.crange``."""
    grid = job.grid
    group = _group_of(chunks_per_task)
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
    b = box_of(box)
    if b is not None:
        blo, bhi = np.asarray(b[0], np.int64), np.asarray(b[1], np.int64)
        lo, hi = np.maximum(lo, blo), np.minimum(hi, bhi)
        if (hi <= lo).any():
            raise SpecError(f"box {[blo.tolist(), bhi.tolist()]} does not overlap scale {job.scale.index}'s volume "
                            f"{[job.lo.tolist(), job.hi.tolist()]}")
        job.crange = ((lo - job.lo) // job.cs, (hi - 1 - job.lo) // job.cs + 1)
    origins = np.asarray(job.ds.shards(job.scale), np.int64).reshape(-1, 3)  # NotExportedError: no folder
    g = group if group is not None else _default_group(job, origins)
    job.group = tuple(int(v) for v in g)
    if arr is not None:
        arr = np.unique(arr, axis=0)
        keys, inv = np.unique(arr // g, axis=0, return_inverse=True)
        members: list[list] = [[] for _ in range(len(keys))]
        for c, k in zip(arr.tolist(), inv.ravel().tolist(), strict=True):  # the chunks asked for, not the grid
            members[k].append(tuple(c))
        return [PcgTask(job, tuple(int(v) for v in k), tuple(m)) for k, m in zip(keys.tolist(), members, strict=True)]
    keys = _task_keys(job, origins, g, lo, hi)
    return [PcgTask(job, (int(x), int(y), int(z))) for x, y, z in keys.tolist()]


def _parameters(job: PcgJob, labels: dict) -> dict:
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
        **job.layout.to_json(),
        "affinity": job.affinity,
        "components": labels,
        "chunks_per_task": list(job.group),
    }))


def _description(job: PcgJob) -> dict:
    """The manifest's ``pcg`` member: what a PyChunkedGraph ingest needs to know besides the parameters."""
    s = job.scale
    return {"resolution": list(s.resolution) if s.resolution is not None else None,
            "compression_level": job.level,
            "edges": "edges_{x}_{y}_{z}.proto.zst",
            "components_files": "components_{x}_{y}_{z}.proto",
            "side_table": SIDE_TABLE + "/{kx}_{ky}_{kz}.parquet (one file per task; read the folder as one table)"}



# --------------------------------------------------------------------------- reduce


def reduce(phase: PhaseReport, out: Output, totals: PcgTotals) -> PcgTotals:
    """The tasks' counts summed into ``totals``; failed chunks named in the report (1,000 at most)."""
    for t in phase.failed:
        totals.failed_chunks += len(t.job.members(t))
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
    return totals


# --------------------------------------------------------------------------- the job


def pcg_edges(source: Dataset | str | os.PathLike, dest: str | os.PathLike | dict | ByteStore, *,
              chunk_size: Sequence[int], scale: int = 0, labels: Any = "agglomerated", box: Any = None,
              scheduler: Any = None, workdir: str | os.PathLike | dict | ByteStore | None = None, resume: bool = False,
              overwrite: bool = False, progress: bool | None = None, allow_partial: bool = False,
              layers: int | None = None, spatial_bits: int = 10, affinity: str = "area", level: int = 3,
              spec: Any = None, chunks: Any = None, chunks_per_task: int | Sequence[int] | None = None,
              threads: int | None = None, fill_missing_shards: bool = True, command: str | None = None) -> JobReport:
    """Write PyChunkedGraph edges and components files for an export's supervoxels.

    Parameters
    ----------
    source : path, URL, kvstore spec or Dataset
        The export.
    dest : path, URL (``gs://``, ``s3://``), kvstore spec dict or store
        The output folder: ``edges_*.proto.zst``, ``components_*.proto``, ``supervoxels/`` (the side
        table, one Parquet file per task) and the manifest.
    chunk_size : (x, y, z)
        PCG's layer-1 chunk size in voxels (its ``CHUNK_SIZE``); the grid starts at the scale's
        voxel offset.
    scale, box, scheduler, workdir, resume, overwrite, progress, allow_partial :
        As for every job (:mod:`dvidshards.jobs.options`): only chunks overlapping the box; the
        work folder holds the chunks running tasks finished (default ``DEST.work``); ``resume``
        skips the chunks a side-table part covers (a box or chunk list may differ).
    labels : "agglomerated" or a mapping
        Bodies for the components files: the records' agglomerated labels, or a supervoxel -> body
        mapping (a file is checked here and travels as its path; an object travels in every task).
    layers, spatial_bits :
        PCG's layer count (default ``ceil(log2(max chunks per axis)) + 2``, as PCG computes it) and
        ``SPATIAL_BITS``.
    affinity : "area" or "default"
        Edge affinity: the contact face count, or PCG's default (float32 tiny).
    level : int
        zstd level of the edges files (PCG's own ingest writes 17: ~35x the CPU of 3).
    spec, chunks, chunks_per_task, threads, fill_missing_shards, command :
        The export's spec; only these chunks (PCG grid indices); chunks per task per axis (default
        one source shard's worth, doubled until there are at most ``MAX_TASKS`` tasks); decoding
        threads per task (default: all cores when tasks run one at a time, else 1); absent shard
        files read as background (DVID writes none for empty shards); the command line.

    Returns
    -------
    JobReport
        ``totals`` is a :class:`PcgTotals`; ``failed`` names failed chunks (``PCG chunk (x, y, z)``)
        and tasks that failed whole (``chunks x a:b, y c:d, z e:f``).

    Raises
    ------
    SpecError, OutputError, PcgError, MappingError
        Before any work: bad arguments, a scale not exported, a box outside the volume, an id
        layout that cannot hold the grid, a mapping file or destination that cannot be used.
    JobError
        Chunks failed and ``allow_partial`` is false; ``.report`` is the report.
    """
    if chunk_size is None:
        raise SpecError("pcg_edges needs chunk_size, PCG's layer-1 chunk size in voxels (e.g. (256, 256, 256))")
    cs = _triple(chunk_size, "chunk_size")
    fmt.message_classes()  # fail early without protobuf
    ds = source if isinstance(source, Dataset) else Dataset(source, spec=spec)
    s = ds.scale(scale)
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
    store = as_store(dest, writable=True, what="destination")
    work = work_folder(store, workdir)
    grid = -(-np.asarray(s.size, np.int64) // np.asarray(cs, np.int64))
    layout = IdLayout(int(layers) if layers is not None else fmt.layers_for_grid(grid), int(spatial_bits))
    layout.check_grid(grid)
    job = PcgJob(ds, s, store, work, cs, layout, mapped, affinity, level, threads, fill_missing_shards)
    tasks = plan(job, box=box, chunks=chunks, chunks_per_task=chunks_per_task)
    if mapped is not None:
        mapped.prepare()  # a bad file fails now; large ones get their per-host sidecar
    if threads is None and not (kind == "serial" or len(tasks) <= 1):
        job.threads = 1  # tasks run side by side: one decoding thread each
    b = box_of(box)
    with TaskRunner(scheduler, progress=progress) as runner, \
            Output(store, job="pcg-edges", parameters=_parameters(job, src.identity()), source=ds,
                   scales=[s.index], command=command, resume=resume, overwrite=overwrite,
                   own=lambda n: bool(_OWN.fullmatch(n)), workdir=work) as out:
        runner.check_shared(work)
        out.update(pcg=_description(job), box=None if b is None else [list(b[0]), list(b[1])],
                   chunks=None if chunks is None else len(np.asarray(chunks).reshape(-1, 3)))
        if out.previous is not None:
            _remove_temporaries(store)  # a killed run's half-written files (we hold the lock)
        if not resume:
            work.delete_prefix_sync(CHECKPOINTS)  # another run's
        phase = runner.run(run_task, tasks, desc=f"PCG tasks of {'×'.join(map(str, job.group))} chunks",
                           kernels=KERNELS)
        out.add(phase)
        totals = reduce(phase, out, PcgTotals(pcg_tasks=len(tasks)))
        if not out.report.failed:
            work.delete_prefix_sync(CHECKPOINTS)
        report = out.finish(totals=totals, notes=totals.notes(), allow_partial=allow_partial)
    if report.complete:
        _remove_if_empty(work)
    return report


def _remove_if_empty(store: ByteStore) -> None:
    """A local work folder with nothing left in it goes (a bucket prefix vanishes by itself)."""
    if store.local_path() is not None and not store.list_sync(""):
        store.delete_prefix_sync("")


def _remove_temporaries(store: ByteStore) -> None:
    """Delete the temporary files of interrupted writes in a local output (a bucket has none:
    its objects are written whole)."""
    for folder in ("", SIDE_TABLE):
        path = store.local_path(folder)
        try:
            names = os.listdir(path) if path is not None else []
        except OSError:
            continue
        for n in names:
            if is_temporary(n):
                try:
                    os.unlink(os.path.join(path, n))  # type: ignore[arg-type]
                except OSError:
                    pass


def _triple(v: Any, what: str) -> tuple[int, int, int]:
    try:
        t = tuple(int(x) for x in v)
    except (TypeError, ValueError):
        t = ()
    if len(t) != 3 or min(t) < 1:
        raise SpecError(f"{what} must be three positive integers, got {v!r}")
    return t  # type: ignore[return-value]


# --------------------------------------------------------------------------- command line


def add_arguments(p) -> None:
    """Arguments of ``dvidshards pcg-edges``."""
    add_source(p)
    add_dest(p, what="output folder (PCG's edges and components files): empty, new, or an earlier pcg-edges "
                     "output with --resume or --overwrite", old=())
    p.add_argument("--chunk-size", type=int, nargs=3, required=True, metavar=("X", "Y", "Z"),
                   help="PCG layer-1 chunk size in voxels, e.g. 256 256 256")
    add_scale(p)
    add_labels(p)
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
    add_job_options(p)


_DEFAULTS = {"scale": 0, "labels": "agglomerated", "spatial_bits": 10, "affinity": "area", "level": 3}


def main(args) -> int:
    """Run ``dvidshards pcg-edges``; 0 when every chunk was written, 1 when some failed."""
    report = pcg_edges(args.source, args.dest, chunk_size=args.chunk_size, scale=args.scale, labels=args.labels,
                       box=args.box, layers=args.layers, spatial_bits=args.spatial_bits, affinity=args.affinity,
                       level=args.level, spec=args.spec, chunks_per_task=args.chunks_per_task, allow_partial=True,
                       command=command_line("pcg-edges", args, skip=[k for k, v in _DEFAULTS.items()
                                                                     if getattr(args, k) == v]),
                       **job_options(args))
    print(report.summary())
    return 0 if report.ok else 1


class PcgEdgesCommand:
    """``dvidshards pcg-edges``: one row of ``cli.COMMANDS``."""

    add_arguments = staticmethod(add_arguments)
    main = staticmethod(main)
