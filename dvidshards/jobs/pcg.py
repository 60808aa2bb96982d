"""Supervoxel adjacency for PyChunkedGraph: per-chunk edges and components files from an export.

``write_edges`` runs one task per PCG layer-1 chunk (``dvidshards.jobs.run_tasks``, serially or
on dask). A task

1. takes the supervoxel lists of the DVID blocks overlapping the chunk and its 6 face
   neighbours from the shard records (no decoding) and builds each chunk's id list: the
   chunk's pieces ((DVID supervoxel, PCG chunk) pairs) are numbered in that sorted order, so
   neighbouring tasks agree on each other's PCG ids without reading each other's voxels;
2. reads the chunk plus a one-voxel halo as supervoxels with the bulk reader (0 outside the
   volume) and counts voxels and contact faces (``dvidshards.formats.pcg.contacts``);
3. writes ``edges_{x}_{y}_{z}.proto.zst`` (PCG's ChunkEdgesMsg in one zstd frame),
   ``components_{x}_{y}_{z}.proto`` (the chunk's pieces and the neighbour pieces of its
   between/cross edges, grouped by body: the records' agglomerated labels or a mapping) and
   last ``pieces/{x}_{y}_{z}.npy`` (its rows of the side table), each to a temporary name then
   renamed, so a chunk whose pieces file exists is complete (``resume=True`` skips it).

At the end ``supervoxels.parquet`` (pcg_id, dvid_supervoxel, chunk_x, chunk_y, chunk_z, voxels)
is built from the pieces files and ``manifest.json`` is completed. Chunks whose blocks list no
supervoxel get no files (PCG reads a missing file as no edges). Needs ``dvidshards[pcg]``
(protobuf).
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from ..dataset import Dataset
from ..errors import DvidShardsError, SpecError
from ..formats import pcg as fmt
from ..formats.labels import Agglomerated, LabelSource, as_labels
from ..formats.pcg import IdLayout, PcgError
from .runner import run_tasks

__all__ = ["PcgReport", "add_arguments", "main", "read_chunk_components", "read_chunk_edges", "write_edges"]

MANIFEST = "manifest.json"
SIDE_TABLE = "supervoxels.parquet"
PIECES = "pieces"
FORMAT = "dvidshards-pcg-edges"
_PIECES_RE = re.compile(r"(\d+)_(\d+)_(\d+)\.npy")
VERSION = 1


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
        Chunks with files (now and in earlier runs).
    pieces : int
        Rows of ``supervoxels.parquet``.
    edges : dict
        Edges written in this run per type (between and cross count each file's copy).
    isolated : int
        Pieces written in this run that touch no other piece (no edge at all): PCG's ingest
        only creates nodes for ids in the edges files, so these would be left out of the graph.
    failed : dict
        ``{chunk: "TypeName: message"}`` of failed chunks (the side table then covers the rest,
        the manifest stays incomplete).
    skipped : int
        Chunks skipped as complete (resume).
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
    skipped: int = 0
    elapsed: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failed

    def summary(self) -> str:
        e = ", ".join(f"{v} {k}" for k, v in self.edges.items())
        lines = [f"{self.out}: {self.chunks} chunks ({self.written} with files, {self.skipped} resumed), "
                 f"{self.pieces} pieces, edges written now: {e}; {len(self.failed)} failed in {self.elapsed:.1f} s"]
        if self.isolated:
            lines.append(f"  note: {self.isolated} pieces written now touch no other piece: no edge names them, "
                         f"so PCG's ingest will not create them")
        lines += [f"  FAILED {c}: {m}" for c, m in list(self.failed.items())[:10]]
        return "\n".join(lines)


# --------------------------------------------------------------------------- the job


class _IndexPalette(LabelSource):
    """Reads 1 + each supervoxel's index in an id list (0 for background): a palette swap per
    block, so the contact kernel never looks a voxel's id up. ``target`` is set before each read
    (under the job's lock); compared by identity, so each job gets its own reader."""

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

    def __init__(self, ds: Dataset, scale, out: str, chunk_size, layout: IdLayout, bodies, affinity: str,
                 level: int, threads: int | None, fill_missing_shards: bool):
        self.ds = ds
        self.scale = ds.scale(scale)
        self.out = out
        self.cs = np.asarray(chunk_size, np.int64)
        self.layout = layout
        self.bodies = bodies  # None: the records' agglomerated labels; else a LabelMapping
        self.affinity = affinity
        self.level = int(level)
        self.threads = threads
        self.fill = fill_missing_shards
        s = self.scale
        self.lo = np.asarray(s.voxel_offset, np.int64)
        self.hi = self.lo + np.asarray(s.size, np.int64)
        self.grid = -(-(self.hi - self.lo) // self.cs)
        self.palette = _IndexPalette()
        self._lock = threading.Lock()
        self.group = 1  # chunks per task along each axis
        self.crange = (np.zeros(3, np.int64), self.grid.copy())  # chunks [lo, hi) of the job
        self.only: frozenset | None = None  # or the job's chunks

    def members(self, key) -> list[tuple[int, int, int]]:
        """The job's chunks in task group ``key``."""
        g = self.group
        lo = np.maximum(np.asarray(key, np.int64) * g, self.crange[0])
        hi = np.minimum((np.asarray(key, np.int64) + 1) * g, self.crange[1])
        out = [(x, y, z) for z in range(int(lo[2]), int(hi[2])) for y in range(int(lo[1]), int(hi[1]))
               for x in range(int(lo[0]), int(hi[0]))]
        return out if self.only is None else [c for c in out if c in self.only]

    def __getstate__(self):
        d = self.__dict__.copy()
        d["_lock"] = None
        return d

    def __setstate__(self, d):
        self.__dict__.update(d)
        self._lock = threading.Lock()

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
                if self.bodies is None:
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
        if self.bodies is not None:
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
        if self.bodies is not None:
            return self.bodies(sv)
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
        with self._lock:
            for k, (lo, hi) in enumerate(boxes):
                lo, hi = np.maximum(lo, self.lo), np.minimum(hi, self.hi)
                if (hi <= lo).any():
                    continue  # outside the volume: stays 0
                if lists is not None:
                    self.palette.target = lists[k]
                    self.palette.where = f"PCG chunk {tuple(np.add(coords, fmt.DIRECTIONS[k - 1]) if k else coords)}"
                oa, ob = lo - ha, hi - ha
                self.ds.read([lo.tolist(), hi.tolist()], scale=self.scale,
                             labels="supervoxels" if lists is None else self.palette,
                             out=out[oa[0]:ob[0], oa[1]:ob[1], oa[2]:ob[2]],
                             threads=self.threads if k == 0 else 1, fill_missing_shards=self.fill)
        return out

    # --- one chunk ----------------------------------------------------------------------

    def run(self, coords) -> dict:
        coords = tuple(int(v) for v in coords)
        where = f"PCG chunk {coords}"
        stats = {"pieces": 0, "isolated": 0, "in": 0, "between": 0, "cross": 0, "bytes": 0, "written": False}
        lists, table = self.id_lists(coords)
        if lists[0].size == 0:
            return stats
        vol = self.read_halo(coords, lists)
        c = fmt.contacts(vol.T, lists[0], lists[1:], where, indexed=True)
        edges, pieces, nb = fmt.chunk_graph(c, coords, lists[0], lists[1:], self.layout, self.affinity)
        ids = np.concatenate([pieces[0], nb[0]])
        groups = fmt.group_components(ids, self.body_of(np.concatenate([pieces[1], nb[1]]), table))
        import zstandard

        payload = zstandard.ZstdCompressor(level=self.level).compress(fmt.encode_edges(edges))
        _put(os.path.join(self.out, fmt.edges_path(coords)), payload)
        comp = fmt.encode_components(groups)
        _put(os.path.join(self.out, fmt.components_path(coords)), comp)
        rows = np.stack(pieces, axis=1).astype(np.uint64)
        _put_npy(os.path.join(self.out, PIECES, _pieces_name(coords)), rows)
        linked = np.concatenate([edges["in"][0], edges["in"][1], edges["between"][0], edges["cross"][0]])
        stats.update(pieces=len(rows), bytes=len(payload) + len(comp), written=True,
                     isolated=int(np.count_nonzero(~np.isin(pieces[0], linked))),
                     **{k: len(v[0]) for k, v in edges.items()})
        return stats


def _task(job: _Job, coords) -> dict:
    return job.run(coords)


def _task_group(job: _Job, key) -> dict:
    """The job's chunks in group ``key`` (chunks // chunks_per_task), skipping complete ones."""
    total = {"chunks": 0, "skipped": 0, "pieces": 0, "isolated": 0, "in": 0, "between": 0, "cross": 0, "bytes": 0,
             "written": 0}
    for c in job.members(key):
        total["chunks"] += 1
        if os.path.exists(os.path.join(job.out, PIECES, _pieces_name(c))):
            total["skipped"] += 1
            continue
        r = job.run(c)
        for k in ("pieces", "isolated", "in", "between", "cross", "bytes"):
            total[k] += r[k]
        total["written"] += bool(r["written"])
    return total


def _pieces_name(coords) -> str:
    return "_".join(str(int(v)) for v in coords) + ".npy"


def _put(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _put_npy(path: str, a: np.ndarray) -> None:
    tmp = f"{path}.tmp{os.getpid()}.npy"
    np.save(tmp, a)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- driver


def _job_items(job: _Job, box, chunks) -> list[tuple[int, int, int]]:
    """Task items: chunks (or chunk groups) given, or overlapping present shards (and the box)."""
    grid, g = job.grid, job.group
    if chunks is not None:
        out = {(int(c[0]), int(c[1]), int(c[2])) for c in np.asarray(chunks, np.int64).reshape(-1, 3)}
        for c in out:
            if min(c) < 0 or any(v >= n for v, n in zip(c, grid, strict=True)):
                raise SpecError(f"chunk {c} is outside the PCG grid {tuple(int(n) for n in grid)}")
        job.only = frozenset(out)
        return sorted({(c[0] // g, c[1] // g, c[2] // g) for c in out})
    lo, hi = job.lo, job.hi
    if box is not None:
        try:
            blo, bhi = (np.asarray(v, np.int64).reshape(3) for v in box)
        except (TypeError, ValueError):
            raise SpecError(f"box must be [[x0, y0, z0], [x1, y1, z1]], got {box!r}") from None
        lo, hi = np.maximum(lo, blo), np.minimum(hi, bhi)
        if (hi <= lo).any():
            return []
        job.crange = ((lo - job.lo) // job.cs, (hi - 1 - job.lo) // job.cs + 1)
    s = job.scale
    extent = min(s.shard_extent, 1 << 40)
    found = set()
    for o in job.ds.shards(s):
        a, b = np.maximum(np.asarray(o, np.int64), lo), np.minimum(np.asarray(o, np.int64) + extent, hi)
        if (b <= a).any():
            continue
        c0, c1 = (a - job.lo) // job.cs // g, ((b - 1 - job.lo) // job.cs) // g + 1
        for x in range(int(c0[0]), int(c1[0])):
            for y in range(int(c0[1]), int(c1[1])):
                for z in range(int(c0[2]), int(c1[2])):
                    found.add((x, y, z))
    return sorted(found)


def _manifest(job: _Job, source, ds: Dataset, layout: IdLayout, labels_desc: str) -> dict:
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
        "components": labels_desc,
        "edges": "edges_{x}_{y}_{z}.proto.zst",
        "components_files": "components_{x}_{y}_{z}.proto",
        "side_table": SIDE_TABLE,
    }


def _describe(source, ds: Dataset) -> str:
    if isinstance(source, (str, os.PathLike)):
        s = os.fspath(source)
        return s if "://" in s else os.path.abspath(s)
    return repr(ds)


_PARAMS = ("format", "version", "scale", "volume_size", "voxel_offset", "chunk_size", "grid", "layers",
           "spatial_bits", "layer_bits", "affinity", "components")


def write_edges(source, out, chunk_size, *, scale=0, layers: int | None = None, spatial_bits: int = 10,
                labels="agglomerated", affinity: str = "area", level: int = 3, scheduler=None,
                resume: bool = False, spec=None, box=None, chunks=None, chunks_per_task: int = 1,
                threads: int | None = None, fill_missing_shards: bool = True,
                progress: bool | None = None) -> PcgReport:
    """Write PyChunkedGraph edges and components files for an export's supervoxels.

    Parameters
    ----------
    source : path, URL, kvstore spec or Dataset
        The export.
    out : path
        Output folder (local). Holds ``edges_*.proto.zst``, ``components_*.proto``,
        ``pieces/``, ``supervoxels.parquet`` and ``manifest.json``.
    chunk_size : (x, y, z)
        PCG's layer-1 chunk size in voxels (its ``CHUNK_SIZE``, e.g. (256, 256, 256)); the grid
        starts at the scale's voxel offset.
    scale : int
        Scale (folder number) to build the graph of.
    layers : int, optional
        PCG layer count; default ``ceil(log2(max chunks per axis)) + 2`` as PCG computes it.
    spatial_bits : int
        PCG's ``SPATIAL_BITS`` (10).
    labels : "agglomerated" or a mapping
        Bodies for the components files: the records' agglomerated labels, or a supervoxel ->
        body mapping (dict, (n, 2) array, Series, LabelMapping or mapping file).
    affinity : "area" or "default"
        Edge affinity: the contact face count, or PCG's default (float32 tiny).
    level : int
        zstd level of the edges files. PCG reads any level; its own ingest writes 17, which
        costs ~35x the CPU of level 3 for files within a few percent of the same size
        (benchmarks/RESULTS.md).
    scheduler : None, "local", "local:N", address or distributed.Client
        Where tasks run (``dvidshards.jobs.run_tasks``).
    resume : bool
        Continue a run into ``out`` with the same parameters, skipping complete chunks.
    spec : dict or path, optional
        The export's neuroglancer spec (see ``Dataset``).
    box : [[x0, y0, z0], [x1, y1, z1]], optional
        Only chunks overlapping this voxel box.
    chunks : (n, 3) ints, optional
        Only these chunks (PCG grid indices).
    chunks_per_task : int
        1 (default): one task per chunk. g > 1: one task per g³ block of chunks, for jobs of
        millions of chunks (fewer items for the driver and the scheduler to hold); failures are
        then reported per group, and a task skips its chunks that are already complete.
    threads : int, optional
        Decoding threads per task (default: 1 on a cluster, all cores serially).
    fill_missing_shards : bool
        Read shard files that do not exist as background (DVID writes none for empty shards).
    progress : bool, optional
        tqdm bar (default: when stderr is a terminal).

    Returns
    -------
    PcgReport
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
    if isinstance(labels, str) and labels == "supervoxels":
        raise SpecError("components group pieces by body: labels must be 'agglomerated' or a mapping")
    src = as_labels(labels)
    bodies = None if isinstance(src, Agglomerated) else getattr(src, "mapping", None)
    if bodies is None and not isinstance(src, Agglomerated):
        raise SpecError(f"labels must be 'agglomerated' or a mapping, got {labels!r}")
    desc = "agglomerated" if bodies is None else f"mapping ({len(bodies)} supervoxels)"
    grid = -(-np.asarray(s.size, np.int64) // np.asarray(cs, np.int64))
    layout = IdLayout(int(layers) if layers is not None else fmt.layers_for_grid(grid), int(spatial_bits))
    layout.check_grid(grid)
    out = os.path.abspath(os.fspath(out))
    if threads is None and scheduler is not None:
        threads = 1
    job = _Job(ds, s, out, cs, layout, bodies, affinity, level, threads, fill_missing_shards)
    if int(chunks_per_task) < 1:
        raise SpecError(f"chunks_per_task must be >= 1, got {chunks_per_task}")
    job.group = int(chunks_per_task)
    manifest = _manifest(job, source, ds, layout, desc)
    items = _job_items(job, box, chunks)
    _prepare(out, manifest, resume)
    if job.group == 1:
        done = {c for c in items if os.path.exists(os.path.join(out, PIECES, _pieces_name(c)))} if resume else set()
        jr = run_tasks(functools.partial(_task, job), items, scheduler=scheduler, desc="PCG chunks", done=done,
                       progress=progress)
        report = PcgReport(out, chunks=len(items), failed=dict(jr.failed), skipped=len(jr.skipped))
    else:  # tasks skip their complete chunks themselves
        jr = run_tasks(functools.partial(_task_group, job), items, scheduler=scheduler,
                       desc=f"PCG chunk groups of {job.group}³", progress=progress)
        report = PcgReport(out, failed=dict(jr.failed))
        for r in jr.results.values():
            report.chunks += r["chunks"]
            report.skipped += r["skipped"]
    for r in jr.results.values():
        for k in fmt.EDGE_TYPES:
            report.edges[k] += r[k]
        report.isolated += r["isolated"]
    report.pieces, report.written = _side_table(out)
    manifest.update(complete=report.ok, chunks=report.chunks, chunks_written=report.written, pieces=report.pieces,
                    failed=len(report.failed))
    _put(os.path.join(out, MANIFEST), json.dumps(manifest, indent=1).encode())
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


def _prepare(out: str, manifest: dict, resume: bool) -> None:
    """Create out, or check that it holds a run with the same parameters (resume)."""
    path = os.path.join(out, MANIFEST)
    if os.path.exists(path):
        try:
            with open(path, "rb") as f:
                old = json.loads(f.read())
        except (OSError, ValueError) as e:
            raise PcgError(f"{path}: unreadable manifest ({e})") from None
        if not resume:
            raise PcgError(f"{out} already holds PCG output; pass resume=True (--resume) to continue it, or "
                           f"choose a new folder")
        diff = [k for k in _PARAMS if old.get(k) != manifest.get(k)]
        if diff:
            raise PcgError(f"{path}: cannot resume with different parameters: "
                           + ", ".join(f"{k} {old.get(k)!r} -> {manifest.get(k)!r}" for k in diff))
        for folder in (out, os.path.join(out, PIECES)):  # leftovers of interrupted writes
            for name in os.listdir(folder) if os.path.isdir(folder) else ():
                if ".tmp" in name and (name.startswith(("edges_", "components_", SIDE_TABLE)) or folder != out):
                    os.remove(os.path.join(folder, name))
    elif os.path.isdir(out) and os.listdir(out):
        raise PcgError(f"{out} is not empty and holds no {MANIFEST}; choose an empty or new folder")
    os.makedirs(os.path.join(out, PIECES), exist_ok=True)
    _put(path, json.dumps({**manifest, "complete": False}, indent=1).encode())


def _side_table(out: str, rows_per_group: int = 1 << 20) -> tuple[int, int]:
    """Write supervoxels.parquet from every pieces file in out; (rows, chunks with files)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("pcg_id", pa.uint64()), ("dvid_supervoxel", pa.uint64()), ("chunk_x", pa.int32()),
                        ("chunk_y", pa.int32()), ("chunk_z", pa.int32()), ("voxels", pa.uint64())])
    path = os.path.join(out, SIDE_TABLE)
    tmp = f"{path}.tmp{os.getpid()}"
    chunks = []
    with os.scandir(os.path.join(out, PIECES)) as it:
        for e in it:
            m = _PIECES_RE.fullmatch(e.name)
            if m:
                chunks.append(tuple(int(v) for v in m.groups()))
    chunks.sort()
    total = files = 0
    buf: list[np.ndarray] = []
    cbuf: list[np.ndarray] = []
    n = 0

    def flush(writer):
        nonlocal buf, cbuf, n
        if not buf:
            return
        a, c = np.concatenate(buf), np.concatenate(cbuf)
        writer.write_table(pa.table([a[:, 0], a[:, 1], c[:, 0], c[:, 1], c[:, 2], a[:, 2]], schema=schema))
        buf, cbuf, n = [], [], 0

    with pq.ParquetWriter(tmp, schema, compression="zstd") as writer:
        for c in chunks:
            p = os.path.join(out, PIECES, _pieces_name(c))
            try:
                a = np.load(p)
            except (OSError, ValueError) as e:
                raise PcgError(f"{p}: unreadable pieces file ({e}); delete it and resume") from None
            if a.dtype != np.uint64 or a.ndim != 2 or a.shape[1] != 3:
                raise PcgError(f"{p}: not a pieces table ((n, 3) uint64)")
            files += 1
            buf.append(a)
            cbuf.append(np.broadcast_to(np.asarray(c, np.int32), (len(a), 3)))
            n += len(a)
            total += len(a)
            if n >= rows_per_group:
                flush(writer)
        flush(writer)
    os.replace(tmp, path)
    return total, files


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


# --------------------------------------------------------------------------- command line


def add_arguments(p) -> None:
    """Arguments of ``dvidshards pcg-edges``."""
    p.add_argument("source", help="export root (directory, gs://, s3://, http(s):// URL)")
    p.add_argument("--spec", help="the neuroglancer multiscale spec given to DVID (default: ./info or inferred)")
    p.add_argument("--out", required=True, help="output folder (PCG's edges and components files)")
    p.add_argument("--chunk-size", type=int, nargs=3, required=True, metavar=("X", "Y", "Z"),
                   help="PCG layer-1 chunk size in voxels, e.g. 256 256 256")
    p.add_argument("--scale", type=int, default=0, help="scale folder number (default 0)")
    p.add_argument("--layers", type=int, help="PCG layer count (default: from the grid, as PCG computes it)")
    p.add_argument("--spatial-bits", type=int, default=10, help="PCG SPATIAL_BITS (default 10)")
    p.add_argument("--mapping", help="supervoxel -> body mapping file for the components (default: the "
                                     "export's agglomerated labels)")
    p.add_argument("--affinity", choices=("area", "default"), default="area",
                   help="edge affinity: contact face count (default) or PCG's tiny default")
    p.add_argument("--level", type=int, default=3,
                   help="zstd level of the edges files (default 3; PCG's own ingest writes 17)")
    p.add_argument("--box", type=int, nargs=6, metavar=("X0", "Y0", "Z0", "X1", "Y1", "Z1"),
                   help="only chunks overlapping this voxel box")
    p.add_argument("--scheduler", help="dask scheduler: local, local:N or an address (default: serial)")
    p.add_argument("--chunks-per-task", type=int, default=1, metavar="G",
                   help="one task per G³ block of chunks (default 1: one task per chunk)")
    p.add_argument("--resume", action="store_true", help="continue a run in --out, skipping complete chunks")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def main(args) -> int:
    """Run ``dvidshards pcg-edges``; 0 when every chunk was written, 1 when some failed."""
    box = None if args.box is None else [args.box[:3], args.box[3:]]
    report = write_edges(args.source, args.out, args.chunk_size, scale=args.scale, layers=args.layers,
                         spatial_bits=args.spatial_bits,
                         labels=args.mapping if args.mapping else "agglomerated", affinity=args.affinity,
                         level=args.level, scheduler=args.scheduler, resume=args.resume, spec=args.spec, box=box,
                         chunks_per_task=args.chunks_per_task, progress=False if args.quiet else None)
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
