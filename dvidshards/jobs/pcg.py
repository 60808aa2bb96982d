"""Supervoxel adjacency for PyChunkedGraph: per-chunk edges and components files from an export
(``dvidshards pcg-edges EXPORT DEST --chunk-size X Y Z``).

* **plan** (:func:`plan`): the PCG layer-1 grid cut into tasks of ``chunks_per_task`` chunks a side
  (default one source shard's worth, ~26 K tasks for mCNS s0 at 256³, grown to at most
  ``MAX_TASKS``), from the listed shard files: a task is its grid key.
* **task** (:func:`run_task`, :meth:`PcgJob.run` per chunk): the supervoxels of the DVID blocks
  meeting a chunk and its 6 face neighbours, from the records (no decoding), number the chunk's
  pieces ((supervoxel, PCG chunk) pairs) in sorted order, so neighbours agree on each other's PCG
  ids; the chunk and a one-voxel halo are read and contacts counted. Written:
  ``edges_{x}_{y}_{z}.proto.zst`` (PCG's ChunkEdgesMsg, one zstd frame), ``components_{x}_{y}_{z}.proto``
  (pieces grouped by body), and last the task's side-table part ``supervoxels/{kx}_{ky}_{kz}.parquet``,
  whose metadata lists the chunks it covers: its completion record (a failed chunk is left out, so
  ``resume`` redoes it). Every :data:`CHECKPOINT_SECONDS` a running task records its finished
  chunks in the work folder, so a task whose worker died goes on where it was.
* **reduce** (:func:`reduce`): the counts add up, failed chunks named; the side table is the folder
  (:mod:`dvidshards.jobs.pcgfiles` reads an output back).

The manifest's ``pcg`` member describes the output for PCG. Chunks whose blocks list no supervoxel
get no files (PCG reads a missing file as no edges). Needs ``dvidshards[pcg]`` (protobuf).
"""

from __future__ import annotations

import contextlib
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
from .runner import PhaseReport, TaskRunner, remove_work, scheduler_of

__all__ = ["CHECKPOINT_SECONDS", "MAX_TASKS", "PcgEdgesCommand", "PcgJob", "PcgTask", "PcgTotals", "pcg_edges", "plan",
           "reduce", "run_task"]

KERNELS = ("dvidshards.formats.codec._decode_kernel", "dvidshards.formats.arrowipc._resolve",
           "dvidshards.formats.arrowipc._message", "dvidshards.formats.mapping._apply")

CHECKPOINTS = "tasks"  # the work folder's: running tasks' parts
FORMAT = "dvidshards-pcg-edges"
MAX_TASKS = 100_000  # the default task size grows until a job has at most this many tasks
CHECKPOINT_SECONDS = float(os.environ.get("DVIDSHARDS_PCG_CHECKPOINT_SECONDS", "60"))
_OWN = re.compile(r"edges_[0-9]+_[0-9]+_[0-9]+\.proto\.zst|components_[0-9]+_[0-9]+_[0-9]+\.proto|supervoxels")
_COUNTS = ("pieces", "isolated", "in", "between", "cross", "bytes")
_FAILED_PER_TASK = 8  # failed chunks a task reports by name (all are counted)
_FAILED_NAMED = 1000  # and the report keeps by name


@dataclass
class PcgTotals:
    """``JobReport.totals``: ``chunks`` of the job (done now, before, or empty); ``written`` (chunks
    with files) and ``pieces`` (side-table rows) over its tasks; ``edges`` written now by type
    (between and cross count each file's copy); ``isolated``: pieces written now that touch no other
    (PCG's ingest makes nodes only for ids in the edges files); ``failed_chunks`` (up to 8 a task, 1,000
    in all named); ``skipped``: complete before."""

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
    """1 + each supervoxel's index in the id list ``target`` (0: background), a palette swap per
    block, so the contact kernel never looks an id up. One per thread; equal only to itself, so each
    gets its own reader."""

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
    """What every task of one run needs (pickles without open files). ``mapped``: None for the
    records' agglomerated labels, else a mapping (a file travels as its path)."""

    def __init__(self, ds: Dataset, scale: int | Scale, dest: ByteStore, work: ByteStore,
                 chunk_size: Sequence[int], layout: IdLayout, mapped: Mapped | None, affinity: str, level: int,
                 threads: int | None, fill_missing_shards: bool):
        self.ds, self.scale, self.dest, self.work = ds, ds.scale(scale), dest, work
        self.cs = np.asarray(chunk_size, np.int64)
        self.layout, self.mapped, self.affinity, self.level = layout, mapped, affinity, int(level)
        self.threads, self.fill = threads, fill_missing_shards
        self.lo = np.asarray(self.scale.voxel_offset, np.int64)
        self.hi = self.lo + np.asarray(self.scale.size, np.int64)
        self.grid = -(-(self.hi - self.lo) // self.cs)
        self._local = threading.local()  # a palette (and so a reader) per thread
        self.group: tuple[int, ...] = (1, 1, 1)  # chunks per task per axis (set by plan)
        self.crange = (np.zeros(3, np.int64), self.grid.copy())  # chunks [lo, hi) of the job

    def members(self, task: PcgTask) -> list[Chunk]:
        """A task's chunks: its block of the task grid within the job's range, or those given."""
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
    def palette(self) -> _IndexPalette:  # this thread's
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
        """Voxel box [a, b) of chunk c in the volume (empty outside the grid)."""
        c = np.asarray(c, np.int64)
        a = self.lo + c * self.cs
        if (c < 0).any() or (c >= self.grid).any():
            return a, a
        return a, np.minimum(a + self.cs, self.hi)

    def id_lists(self, coords):
        """Id lists of chunk c and its 6 neighbours, and a supervoxel -> body lookup."""
        s = self.scale
        reader = self.ds.reader(s, labels=self.palette, fill_missing_shards=self.fill)  # the reads' shard cache
        bcs = np.asarray(s.chunk_size, np.int64)
        boxes = [self.box(coords)] + [self.box(np.add(coords, d)) for d in fmt.DIRECTIONS]
        by_shard: dict = {}  # the DVID blocks meeting the boxes
        per_box: list = []
        for a, b in boxes:
            b0, b1 = a // bcs, (b - 1) // bcs + 1
            keys = [] if (b <= a).any() else [(x, y, z) for z in range(int(b0[2]), int(b1[2]))
                                              for y in range(int(b0[1]), int(b1[1])) for x in range(int(b0[0]), int(b1[0]))]
            per_box.append(keys)
            for k in keys:
                by_shard.setdefault(s.shard_origin(*k), {})[k] = None
        svs, bodies = {}, {}
        for keys in by_shard.values():
            shard = reader.shard(*next(iter(keys)))
            if shard is None:
                continue
            # ascending record numbers: file order for lazy (remote) shards' batch fetches
            found = sorted((i, k) for k in keys if (i := shard.find(*k)) is not None)
            if not found:
                continue
            t = shard.table([i for i, _ in found])
            for j, (_, k) in enumerate(found):
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

    def read_halo(self, coords, lists=None) -> np.ndarray:
        """The chunk and a one-voxel halo on its faces (0 outside the volume), x, y, z F-ordered.

        Read as the chunk plus six face slabs: the halo's edges and corners are never used, and
        leaving them out spares decoding the blocks that hold only them. With ``lists`` (the chunk's
        and its neighbours'), a voxel holds 1 + its id's index in its chunk's list.
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

    def run(self, coords) -> tuple[dict, np.ndarray]:
        """One chunk's edges and components files; (counts, its side-table rows: PCG id, DVID
        supervoxel, voxels)."""
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
    """Block ``key`` of the task grid, or the chunks of it asked for (``only``)."""

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
    """A task's chunks not covered yet, then its side-table part; counts. A chunk that raises a
    DvidShardsError is named in ``failed`` and left out of the part; the others go on."""
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
    """Task-grid keys (k, 3) of the blocks of ``g`` chunks meeting a shard inside [lo, hi)."""
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
    """One source shard's worth of chunks per axis, doubled until the scale has at most ``MAX_TASKS``
    tasks. Of the export and chunk size alone (no box or chunk list): every run into one folder cuts
    the grid the same way."""
    extent = min(job.scale.shard_extent, SINGLE_SHARD)
    g = np.minimum(np.maximum(extent // job.cs, 1), job.grid)
    while len(_task_keys(job, origins, g, job.lo, job.hi)) > MAX_TASKS and (g < job.grid).any():
        g = np.minimum(g * 2, job.grid)
    return g


def plan(job: PcgJob, *, box: Any = None, chunks: Any = None,
         chunks_per_task: int | Sequence[int] | None = None) -> list[PcgTask]:
    """The task blocks of the chunks given, else those meeting shards (and the box). Sets
    ``job.group`` and ``job.crange``."""
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
    """What a resume must repeat (not a box or chunk list: runs over parts of the grid share an output)."""
    s = job.scale
    return json.loads(json.dumps({
        "format": FORMAT, "version": VERSION, "scale": s.index, "volume_size": list(s.size),
        "voxel_offset": list(s.voxel_offset), "chunk_size": [int(v) for v in job.cs],
        "grid": [int(v) for v in job.grid], **job.layout.to_json(), "affinity": job.affinity,
        "components": labels, "chunks_per_task": list(job.group)}))


def _description(job: PcgJob) -> dict:
    """The manifest's ``pcg`` member: what PCG's ingest needs besides the parameters."""
    s = job.scale
    return {"resolution": list(s.resolution) if s.resolution is not None else None,
            "compression_level": job.level,
            "edges": "edges_{x}_{y}_{z}.proto.zst",
            "components_files": "components_{x}_{y}_{z}.proto",
            "side_table": SIDE_TABLE + "/{kx}_{ky}_{kz}.parquet (one file per task; read the folder as one table)"}


# --------------------------------------------------------------------------- reduce


def reduce(phase: PhaseReport, out: Output, totals: PcgTotals) -> PcgTotals:
    """The tasks' counts summed; failed chunks named in the report (1,000 at most)."""
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
    dest : path, URL (``gs://``, ``s3://``), kvstore spec dict or store
        The output folder: ``edges_*.proto.zst``, ``components_*.proto``, ``supervoxels/`` (the side
        table, one Parquet file per task) and the manifest.
    chunk_size : (x, y, z)
        PCG's layer-1 ``CHUNK_SIZE`` in voxels; the grid starts at the scale's voxel offset.
    scale, box, scheduler, workdir, resume, overwrite, progress, allow_partial :
        As for every job (:mod:`dvidshards.jobs.options`): the chunks meeting the box; ``workdir``:
        running tasks' finished chunks; ``resume`` skips the chunks a side-table part covers (the
        box or chunk list may differ).
    labels : "agglomerated" or a mapping
        Bodies for the components files (a mapping file travels as its path).
    layers, spatial_bits :
        PCG's layer count (default ``ceil(log2(max chunks per axis)) + 2``, as PCG computes it) and
        ``SPATIAL_BITS``.
    affinity : "area" or "default"
        The contact face count, or PCG's default (float32 tiny).
    level : int
        zstd level of the edges files (PCG's own ingest writes 17: ~35x the CPU of 3).
    spec, chunks, chunks_per_task, threads, fill_missing_shards, command :
        The export's spec; only these chunks (PCG grid indices); chunks per task a side (default
        one source shard's worth, doubled until at most ``MAX_TASKS`` tasks); decoding threads per
        task (default: all cores when tasks run one at a time, else 1); absent shard files read as
        background (DVID writes none for empty shards); the command line.

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
        Chunks failed and ``allow_partial`` is false.
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
        report = out.finish(totals=totals, notes=totals.notes(), allow_partial=allow_partial)
    if report.complete:
        remove_work(work, CHECKPOINTS.__eq__)
    return report


def _remove_temporaries(store: ByteStore) -> None:
    """Interrupted writes' temporary files in a local output (a bucket's objects appear whole)."""
    for folder in ("", SIDE_TABLE):
        path = store.local_path(folder)
        try:
            names = os.listdir(path) if path is not None else []
        except OSError:
            continue
        for n in filter(is_temporary, names):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(path, n))  # type: ignore[arg-type]


def _triple(v: Any, what: str) -> tuple[int, int, int]:
    try:
        t = tuple(int(x) for x in v)
    except (TypeError, ValueError):
        t = ()
    if len(t) != 3 or min(t) < 1:
        raise SpecError(f"{what} must be three positive integers, got {v!r}")
    return t  # type: ignore[return-value]


# --------------------------------------------------------------------------- command line


_DEFAULTS = {"scale": 0, "labels": "agglomerated", "spatial_bits": 10, "affinity": "area", "level": 3}


class PcgEdgesCommand:
    """``dvidshards pcg-edges EXPORT DEST --chunk-size X Y Z``."""

    @staticmethod
    def add_arguments(p) -> None:
        add_source(p)
        add_dest(p, what="output folder (PCG's edges and components files): empty, new, or an earlier pcg-edges "
                         "output with --resume or --overwrite")
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

    @staticmethod
    def main(args) -> int:
        """0 when every chunk was written, 1 when some failed."""
        kw = {k: getattr(args, k) for k in ("chunk_size", "scale", "labels", "box", "layers", "spatial_bits",
                                            "affinity", "level", "spec", "chunks_per_task")}
        report = pcg_edges(args.source, args.dest, allow_partial=True, **kw, **job_options(args),
                           command=command_line("pcg-edges", args, skip=[k for k, v in _DEFAULTS.items()
                                                                         if getattr(args, k) == v]))
        print(report.summary())
        return 0 if report.ok else 1
