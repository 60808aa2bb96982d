"""Meshes for every body of an export: ``dvidshards meshes EXPORT DEST``.

neuroglancer's multi-resolution sharded Draco meshes (``legacy``: the single-resolution format) in
a precomputed dataset folder (a ``convert`` output, whose ``info`` gains the ``mesh`` key, or a new
one). Level of detail 0 is the finest scale whose voxel is at least 32 nm (s2 of 8 nm data, as FlyEM
and igneous); each coarser level comes from the next scale, at an eighth of the cost.

* **plan** (:func:`levels`, :func:`plan`): one :class:`MeshTask` per source shard of each level;
* **task** (:func:`run_task`): each chunk's cell (plus one voxel of its + neighbours, so cells meet
  exactly) meshed by marching cubes, each body's piece decimated to about a quarter with the cell's
  border locked (so pieces still weld watertight), into a fragment file sorted by the body's
  bucket, the mesh shard it lands in (:mod:`dvidshards.jobs.fragments`);
* **reduce** (:func:`reduce`, :func:`write_bucket`): per bucket, body by body and level by level,
  each octree node's pieces welded and decimated with the node's border locked, then moved out
  along their normals to the body's voxel volume (marching cubes cuts every convex corner).

The mesh ``info`` and the volume ``info``'s ``mesh`` key are written only when every task succeeded.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..bodies import chunk_decoder
from ..dataset import Dataset
from ..errors import OutputError, SpecError
from ..formats.labelindex import bucket_of, labels_id
from ..formats.labels import as_labels
from ..formats.mesh import Mesh, box_faces, merge_fragments, mesh_cells, volume_area
from ..formats.meshreduce import decimate, drop_cavities, inflate, weld_pieces
from ..formats.multilod import (
    encode_object,
    encode_shard_files,
    legacy_files,
    legacy_info,
    multilod_info,
)
from ..formats.sharding import ShardingSpec, murmurhash3_x86_128_low64, shard_key
from ..stores import ByteStore, as_store
from .fragments import Fragment, FragmentWriter, MergeTask, buckets_of, by_body, merge_task, parse
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
from .output import MANIFEST, JobReport, Output, work_folder
from .runner import TaskRunner, clear_work, remove_work, scheduler_of

__all__ = ["FAN_IN", "MANIFEST", "NODE", "TARGET_NM", "BucketTask", "MeshJob", "MeshTask", "MeshesCommand",
           "MeshesError", "default_scale", "levels", "meshes", "plan", "reduce", "run_task", "write_bucket"]

FAN_IN = 64  # work files a regroup or reduce task opens at most
NODE = 4  # cells per octree node edge at every level (4 x 64 = 256 voxels, FlyEM's mesh blocks)
TARGET_NM = 32.0  # level of detail 0 by default: the finest scale whose voxel is at least this
MAX_LODS = 6  # levels of detail made from coarser scales by default
MAX_ERROR = 1.25  # the simplifier's bound by default, voxels of each level's scale (40 nm at 32 nm)
CELL_REDUCTION = 4  # the per-cell pass keeps about 1/4 of the marching-cubes faces
CELL_ERROR = 2 / 3  # ... within this share of the per-node pass's bound
_WORK = re.compile(r"L[0-9]+|done").fullmatch  # the work folder's own names


class MeshesError(SpecError):
    """The parameters of ``meshes`` are not usable (nothing was written)."""


@dataclass(frozen=True)
class MeshJob:
    """What every task of one run needs (parameters and stores, never data).

    Level of detail j comes from ``scales[j]``. ``sharding``: the mesh sharding (JSON); None for the
    legacy format, bucketed by ``bucket_bits`` of the body hash. ``cell_*`` drive the per-cell
    pass, ``reduction_factor`` / ``max_error`` the per-node pass. Errors are in voxels of each
    level's scale; ``max_error_nm`` is what the caller gave.
    """

    dataset: Any
    labels: Any
    scales: tuple[int, ...]
    work: ByteStore
    mesh: ByteStore
    legacy: bool = False
    sharding: dict | None = None
    bucket_bits: int = 0
    bits: int = 16
    reduction_factor: int = 10
    max_error: float = MAX_ERROR
    cell_reduction: int = CELL_REDUCTION
    cell_error: float = MAX_ERROR * CELL_ERROR
    inflate: bool = True
    box: tuple | None = None
    max_error_nm: float | None = None

    def ident(self) -> dict:
        """What the output depends on (a resumed run must repeat it)."""
        return {"scales": list(self.scales), "legacy": self.legacy, "sharding": self.sharding,
                "bucket_bits": self.bucket_bits, "bits": self.bits, "reduction_factor": self.reduction_factor,
                "max_error_nm": self.max_error_nm, "max_error_voxels": self.max_error,
                "cell_reduction": self.cell_reduction, "cell_error_voxels": self.cell_error, "inflate": self.inflate,
                "box": None if self.box is None else [list(self.box[0]), list(self.box[1])],
                "node": NODE, **labels_id(as_labels(self.labels))}


def _bucket(job: MeshJob, bodies: np.ndarray) -> np.ndarray:
    """Each body's mesh shard number, or hash bucket."""
    b = np.asarray(bodies, np.uint64)
    if job.sharding is None:
        return bucket_of(b, job.bucket_bits).astype(np.uint64)
    sp = ShardingSpec.from_json(job.sharding)
    h = np.atleast_1d(murmurhash3_x86_128_low64(b >> np.uint64(sp.preshift_bits)))
    return (h >> np.uint64(sp.minishard_bits)) & np.uint64((1 << sp.shard_bits) - 1)


def _grid(s) -> tuple[np.ndarray, np.ndarray, int]:
    """(first chunk, last chunk, chunk edge)."""
    cs = int(s.chunk_size[0])
    lo = np.asarray(s.voxel_offset, np.int64)
    hi = lo + np.asarray(s.size, np.int64)
    return lo // cs, (hi - 1) // cs, cs


# --------------------------------------------------------------------------- plan


def default_scale(ds: Dataset) -> tuple[int, str | None]:
    """The finest exported scale of voxels >= 32 nm, else the coarsest with a note (unknown
    resolutions: scale 0)."""
    present = sorted(ds.exported)
    if not present:
        raise MeshesError(f"{ds.store.describe('')}: no scale is exported")
    sized = [(k, None if (r := ds.scale(k).resolution) is None else float(min(r))) for k in present]
    if any(nm is None for _, nm in sized):
        return present[0], "resolutions unknown (no spec): meshed scale 0; pass --scale K to choose"
    for k, nm in sized:
        if nm is not None and nm >= TARGET_NM - 1e-6:
            return k, None
    k, nm = sized[-1]
    return k, (f"no exported scale has voxels of {TARGET_NM:g} nm or more: meshed s{k} ({nm:g} nm); "
               f"`dvidshards downsample` makes the coarser scales")


def _coarser(ds: Dataset, first: int, lods: int | None) -> tuple[int, ...]:
    """``first`` and the exported scales after it, each twice as coarse, up to ``lods`` levels."""
    want = MAX_LODS if lods is None else int(lods)
    out = [first]
    present = set(ds.exported)
    res0 = ds.scale(first).resolution
    while len(out) < want and out[-1] + 1 in present and res0 is not None:
        k = out[-1] + 1
        r = ds.scale(k).resolution
        if r is None or not np.allclose(r, np.asarray(res0, np.float64) * 2 ** len(out)):
            break
        out.append(k)
    return tuple(out)


def levels(ds: Dataset, *, scales: Sequence[int] | None = None, scale: int | None = None, lods: int | None = None,
           legacy: bool = False) -> tuple[tuple[int, ...], str | None]:
    """(level of detail j's scale, what the user should know of the choice)."""
    note = None
    if scales is not None and scale is not None:
        raise MeshesError("give scales (one per level of detail) or scale (level 0, coarser levels after it), "
                          "not both")
    if lods is not None and int(lods) < 1:
        raise MeshesError("lods must be >= 1")
    if scales is not None:
        ks = tuple(ds.scale(k).index for k in scales_of(scales) or [])
        if lods is not None and int(lods) != len(ks) and ks:
            want = ", ".join(str(ks[0] + j) for j in range(int(lods)))
            raise MeshesError(f"lods={lods} with scales={list(ks)}: each level of detail comes from a scale of its "
                              f"own; give scale={ks[0]}, lods={lods} (or scales=({want}))")
    else:
        first, note = (ds.scale(scale).index, None) if scale is not None else default_scale(ds)
        ks = (first,) if legacy else _coarser(ds, first, lods)
        if lods is not None and len(ks) < int(lods):
            nxt = ks[-1] + 1
            more = (f"s{nxt} is not exported (`dvidshards downsample` makes the coarser scales)"
                    if nxt not in set(ds.exported) else "resolutions unknown (pass the export's spec)"
                    if ds.scale(first).resolution is None else f"s{nxt} does not halve the resolution")
            note = ((note + "; ") if note else "") + f"{len(ks)} of {lods} levels of detail: {more}"
    if not ks:
        raise MeshesError("give at least one scale")
    if legacy and len(ks) > 1:
        raise MeshesError("the legacy mesh format has one level of detail: give one scale")
    res0 = ds.scale(ks[0]).resolution
    for j, k in enumerate(ks):
        ds.require_scale(k)
        s = ds.scale(k)
        if len({int(v) for v in s.chunk_size}) != 1:
            raise MeshesError(f"scale {k}: meshing needs cubic chunks, got {s.chunk_size}")
        if j and (s.resolution is None or res0 is None):
            raise MeshesError("several scales need known resolutions (pass the export's spec)")
        if j and not np.allclose(np.asarray(s.resolution, np.float64), np.asarray(res0, np.float64) * 2 ** j):
            raise MeshesError(f"scale {k}: resolution {s.resolution} is not 2**{j} x {res0}: levels of "
                              f"detail must halve the resolution one scale at a time")
    return ks, note


@dataclass(frozen=True)
class MeshTask:
    """One source shard of a level's scale: its pieces into the fragment file ``key``."""

    job: MeshJob = field(compare=False, repr=False)
    scale: int
    origin: tuple[int, int, int]

    @property
    def key(self) -> str:
        return "L0/s{}_{}_{}_{}.frag".format(self.scale, *self.origin)

    def __str__(self) -> str:  # the shard file, as failures name it
        ds = self.job.dataset
        return ds.store.describe(ds.scale(self.scale).stem(self.origin) + ".arrow")


def plan(job: MeshJob, shards: dict[int, list]) -> Iterator[MeshTask]:
    """One task per shard file of each level's scale (``shards``: origins by scale)."""
    for k in job.scales:
        for o in shards[k]:
            yield MeshTask(job, k, (int(o[0]), int(o[1]), int(o[2])))


def _default_sharding(n_tasks: int) -> ShardingSpec:
    """Mesh sharding: about one mesh shard per source shard, 64 minishards each."""
    shard_bits = max(0, min(16, math.ceil(math.log2(max(n_tasks, 1)))))
    return ShardingSpec(preshift_bits=0, minishard_bits=6, shard_bits=shard_bits, hash="murmurhash3_x86_128",
                        minishard_index_encoding="gzip", data_encoding="raw")


def _shard_cells(s, origin, coords: np.ndarray) -> np.ndarray:
    """The cells a shard's task owns: its chunks' and their - neighbours', and its cells on its +
    faces (their + neighbours lie in other shards)."""
    first, last, cs = _grid(s)
    e = min(int(s.shard_extent), 1 << 40) // cs
    o = np.asarray(origin, np.int64) // cs
    lo = np.maximum(o, first - 1)
    hi = np.minimum(o + e, last + 1)  # exclusive
    d = np.array([[i, j, k] for k in (0, 1) for j in (0, 1) for i in (0, 1)], np.int64)
    parts = [(coords[:, None, :] - d[None]).reshape(-1, 3)] if len(coords) else []
    # the cells on the shard's + faces: cheap when the neighbour chunks are absent
    for ax in range(3):
        if hi[ax] - 1 < lo[ax]:
            continue
        rng = [np.arange(lo[a], hi[a]) for a in range(3)]
        rng[ax] = np.array([hi[ax] - 1])
        g = np.stack(np.meshgrid(*rng, indexing="ij"), axis=-1).reshape(-1, 3)
        parts.append(g)
    if not parts:
        return np.zeros((0, 3), np.int64)
    c = np.unique(np.concatenate(parts), axis=0)
    owner = np.maximum(c, first)  # the volume's first cells (chunk -1) belong to its first chunks
    own = ((owner >= o) & (owner < o + e)).all(axis=1) & (c >= first - 1).all(axis=1) & (c <= last).all(axis=1)
    return c[own]


# --------------------------------------------------------------------------- task: one source shard


def _box_at(job: MeshJob, scale: int):
    """The job's box (level 0's voxels) at a scale: (lo, hi), or None."""
    if job.box is None:
        return None
    f = 2 ** (job.scales.index(scale))
    return np.asarray(job.box[0], np.int64) // f, -(-np.asarray(job.box[1], np.int64) // f)


def _boxed(decode, box, cs: int):
    """``decode`` giving 0 outside ``box``."""
    lo, hi = box

    def dec(c):
        o = np.asarray(c, np.int64) * cs
        a0 = np.clip(lo - o, 0, cs)
        a1 = np.clip(hi - o, 0, cs)
        if (a1 <= a0).any():
            return None  # outside the box: not even decoded
        a = decode(c)
        if a is None or ((a0 == 0).all() and (a1 == cs).all()):
            return a
        out = np.zeros_like(a)
        out[a0[2]:a1[2], a0[1]:a1[1], a0[0]:a1[0]] = a[a0[2]:a1[2], a0[1]:a1[1], a0[0]:a1[0]]
        return out

    return dec


def run_task(task: MeshTask) -> dict:
    """One source shard's cells meshed into its fragment file; counts."""
    job, scale, origin = task.job, task.scale, task.origin
    ds = job.dataset
    s = ds.scale(scale)
    src = as_labels(job.labels)
    _, _, cs = _grid(s)
    shard = ds.reader(s, labels=src, fill_missing_shards=True).shard(*(int(v) // cs for v in origin))  # the decoder's too
    if shard is None:
        raise SpecError(f"{ds.store.describe(s.stem(origin) + '.arrow')}: listed but not found")
    cells = _shard_cells(s, origin, np.asarray(shard.coords, np.int64))
    decode = chunk_decoder(ds, s.index, labels=src, fill_missing_shards=True)  # listed shards only; others: none
    box = _box_at(job, scale)
    if box is not None:
        decode = _boxed(decode, box, cs)
        vox = cells * cs  # a cell meshes its chunk and one voxel of each + neighbour: those reaching the box
        cells = cells[((vox < box[1]) & (vox + cs + 1 > box[0])).all(axis=1)]
    faces_mc = faces_kept = 0
    with FragmentWriter(job.work, task.key, functools.partial(_bucket, job)) as w:
        for cell, out, counts in mesh_cells(decode, cells, cs, voxels=True):
            lo = np.asarray(cell, np.float64) * cs + 0.5
            hi = lo + cs
            for body in sorted(set(out) | set(counts)):
                m = out.get(body, Mesh.empty())
                mc = len(m.faces)
                vol = area = 0.0
                if mc:
                    vol, area = volume_area(m)
                    if job.cell_reduction > 1:
                        m = decimate(m, max(mc // job.cell_reduction, 1), job.cell_error, box_faces(m.vertices, lo, hi))
                faces_mc += mc
                faces_kept += len(m.faces)
                w.add(body, cell, scale, m, mc, counts.get(body, 0), vol, area)
    return {"fragments": w.count, "faces_mc": faces_mc, "faces_kept": faces_kept}


# --------------------------------------------------------------------------- reduce


def _node_box(first, cs: int, q) -> tuple[np.ndarray, np.ndarray]:
    """Corner-coordinate box of octree node ``q`` (``first``: the scale's first chunk)."""
    lo = (np.asarray(first, np.int64) - 1 + NODE * np.asarray(q, np.int64)) * cs + 0.5
    return lo, lo + NODE * cs


def _level(job: MeshJob, scale: int, pieces: list[Fragment]) -> dict[tuple[int, ...], Mesh]:
    """One level of detail of one body: ``{octree node: Mesh}`` in corner coordinates of ``scale``.

    Each node's pieces welded and decimated with the node's border locked (the cell borders inside
    go); inner shells dropped (a connected body is one piece); then every node moved out along its
    normals until the outer surface encloses the body's voxel volume (node borders stay: nodes weld).
    """
    s = job.dataset.scale(scale)
    first, _, cs = _grid(s)
    nodes: dict[tuple[int, ...], list[Fragment]] = {}
    mc: dict[tuple[int, ...], int] = {}
    for p in pieces:
        if len(p.mesh.faces):
            q = tuple(int(v) for v in (np.asarray(p.cell, np.int64) - first + 1) // NODE)
            nodes.setdefault(q, []).append(p)
            mc[q] = mc.get(q, 0) + p.mc_faces
    out: dict[tuple[int, ...], tuple[Mesh, np.ndarray]] = {}
    for q, ps in sorted(nodes.items()):
        cells = [np.asarray(p.cell, np.float64) * cs + 0.5 for p in ps]
        m = weld_pieces([p.mesh for p in ps], [(c, c + cs) for c in cells])
        lo, hi = _node_box(first, cs, q)
        locked = box_faces(m.vertices, lo, hi)
        if job.reduction_factor:
            target = max(mc[q] // job.reduction_factor, 4)
            if target < len(m.faces):
                m = decimate(m, target, job.max_error, locked)
                locked = box_faces(m.vertices, lo, hi)  # the same vertices, renumbered
        if len(m.faces):
            out[q] = (m, locked)
    n_vox = float(sum(p.voxels for p in pieces))
    kept, cavities = drop_cavities([m for m, _ in out.values()], [lk != 0 for _, lk in out.values()])
    if cavities:  # one piece per connected body
        out = {q: (k, box_faces(k.vertices, *_node_box(first, cs, q))) for q, k in zip(out, kept, strict=True)
               if len(k.faces)}
        n_vox -= cavities  # the outer surface encloses the cavities too
    total = 0.0
    for _ in range(3 if job.inflate and n_vox and out else 0):  # the volume is not linear in the shift
        va = [volume_area(m) for m, _ in out.values()]  # the nodes weld into closed surfaces
        vol, area = sum(a for a, _ in va), sum(b for _, b in va)
        if area <= 0 or abs(n_vox - vol) <= 0.01 * n_vox:
            break
        shift = float(np.clip((n_vox - vol) / area, -0.25 - total, 0.5 - total))
        if not shift:
            break
        total += shift
        out = {q: (inflate(m, shift, lk), lk) for q, (m, lk) in out.items()}
    return {q: m for q, (m, _) in out.items()}


def _lods(job: MeshJob, pieces: list[Fragment]):
    """(levels, vertex offsets) of one body in model coordinates (level 0's voxels)."""
    ds = job.dataset
    first0, _, cs = _grid(ds.scale(job.scales[0]))
    origin = first0 * cs + 0.5 - cs  # grid origin: corner of node (0, 0, 0)
    by_scale: dict[int, list[Fragment]] = {}
    for p in pieces:
        by_scale.setdefault(p.scale, []).append(p)
    lods: list[dict[tuple[int, ...], Mesh]] = []
    offsets = []
    for j, k in enumerate(job.scales):
        level = _level(job, k, by_scale.get(k, []))
        if not level:  # the body vanished at this scale: no coarser level
            break
        f = float(2**j)
        first, _, _ = _grid(ds.scale(k))
        # node box lo = origin + NODE * cs * 2**j * q; at scale k it is f * ((first - 1 + NODE q) cs + 0.5):
        # a constant shift per level, stored as its vertex offset
        delta = f * 0.5 - origin + cs * f * (first - 1)
        lods.append({q: Mesh((m.vertices.astype(np.float64) * f - delta).astype(np.float32), m.faces)
                     for q, m in level.items()})
        offsets.append(delta)
    return lods, np.asarray(offsets, np.float64).reshape(-1, 3)


@dataclass(frozen=True)
class BucketTask:
    """One bucket (a mesh shard, or a legacy hash bucket) of the fragment files ``keys``."""

    job: MeshJob = field(compare=False, repr=False)
    keys: tuple[str, ...]
    bucket: int

    def __str__(self) -> str:
        return f"bucket {self.bucket}"


def write_bucket(task: BucketTask) -> int:
    """Every body of a bucket, one at a time, then its mesh shard file; bodies written. Memory: one
    body's pieces and the bucket's encoded output."""
    job, files, bucket = task.job, task.keys, task.bucket
    ds = job.dataset
    s0 = ds.scale(job.scales[0])
    first0, _, cs = _grid(s0)
    origin = first0 * cs + 0.5 - cs
    n = 0
    if job.legacy:
        res = s0.resolution if s0.resolution is not None else [1.0, 1.0, 1.0]
        for _body, raws in by_body(job.work, files, bucket):
            pieces = [parse(r) for r in raws]
            level = _level(job, job.scales[0], pieces)
            merged = merge_fragments(level.values())
            if not len(merged.faces):
                continue
            for rel, blob in legacy_files({pieces[0].body: merged}, res).items():
                if rel != "info":
                    job.mesh.put_sync(rel, blob)
            n += 1
    else:
        manifests, datas = {}, {}
        for body, raws in by_body(job.work, files, bucket):
            lods, offsets = _lods(job, [parse(r) for r in raws])
            if not lods:
                continue
            # inflated vertices near a node face may poke a little out of it: clipped (borders are exact)
            manifests[body], datas[body] = encode_object(lods, origin, (NODE * cs,) * 3, job.bits,
                                                         vertex_offsets=offsets, tolerance=0.05)
            n += 1
        assert job.sharding is not None
        sp = ShardingSpec.from_json(job.sharding)
        for name, blob in encode_shard_files(sp, manifests, datas).items():
            if name != shard_key(bucket, sp.shard_bits):
                raise RuntimeError(f"bucket {bucket}: body hashed to shard {name}")
            job.mesh.put_sync(name, blob)
    job.work.put_sync(f"done/{bucket}", str(n).encode())
    return n


def reduce(tr: TaskRunner, out: Output, job: MeshJob, keys: list[str]) -> int:
    """``FAN_IN`` fragment files merged into one while there are more, then a task per bucket not done
    before; the bodies written."""
    level = 0
    while len(keys) > FAN_IN:
        level += 1
        job.work.delete_prefix_sync(f"L{level}")
        groups = [MergeTask(job.work, level, k, tuple(keys[i:i + FAN_IN]))
                  for k, i in enumerate(range(0, len(keys), FAN_IN))]
        phase = tr.run(merge_task, groups, desc=f"regroup level {level}")
        out.add(phase)
        if phase.failed:
            return 0
        keys = [g.key for g in groups]
    nb = 1 << (ShardingSpec.from_json(job.sharding).shard_bits if job.sharding else job.bucket_bits)
    present = np.unique(np.concatenate([buckets_of(job.work, k) for k in keys]))
    tasks = [BucketTask(job, tuple(keys), int(v)) for v in present if int(v) < nb]
    done = set(job.work.list_sync("done"))
    phase = tr.run(write_bucket, tasks, desc="mesh buckets", done=[t for t in tasks if str(t.bucket) in done])
    out.add(phase)
    return sum(phase.results.values()) + sum(int(job.work.get_sync(f"done/{t.bucket}") or 0) for t in phase.skipped)


# --------------------------------------------------------------------------- the destination's volume


def _check_root(root: ByteStore, mesh_dir: str, ds: Dataset) -> dict | None:
    """The volume ``info`` of a precomputed dataset (None: new or empty); other folders refused."""
    root.check_writable()
    names = root.list_sync("")
    data = root.get_sync("info") if "info" in names else None
    try:
        info = None if data is None else json.loads(data)
    except ValueError:
        raise OutputError(f"{root.describe('info')}: not JSON") from None
    if info is not None and not (isinstance(info, dict) and isinstance(info.get("scales"), list)):
        raise OutputError(f"{root.describe('info')}: not a neuroglancer precomputed volume info")
    if info is None and [n for n in names if n != mesh_dir]:
        raise OutputError(f"{root.describe('')}: holds {names[:3]} but no precomputed 'info'; give a new folder, "
                          f"an empty one, or a precomputed dataset (a convert output)")
    if info is not None:
        s = ds.scale(0)
        sc = info["scales"][0] if info["scales"] else {}
        res = sc.get("resolution")
        if s.resolution is not None and res is not None and not np.allclose(res, s.resolution):
            raise OutputError(f"{root.describe('info')}: its first scale has resolution {res}, the export's scale "
                              f"0 has {list(s.resolution)}: meshes would not line up")
    return info


def _new_info(ds) -> dict:
    """A new mesh-only dataset's info: the export's geometry, said to hold no chunks."""
    info = ds.info
    for sc in info["scales"]:
        sc.pop("sharding", None)
        sc.pop("inferred", None)
    info["dvidshards"] = {"meshes_only": True, "note": "no voxel chunks are stored here: this dataset holds meshes"}
    return info


def _write_json(store: ByteStore, key: str, obj: Any) -> None:
    store.put_sync(key, (json.dumps(obj, indent=1) + "\n").encode())


# --------------------------------------------------------------------------- the job


def meshes(source: Dataset | str | os.PathLike, dest: str | os.PathLike | dict | ByteStore, *,
           scales: Sequence[int] | None = None, scale: int | None = None, labels: Any = "agglomerated",
           box: Any = None, scheduler: Any = None, workdir: str | os.PathLike | dict | ByteStore | None = None,
           resume: bool = False, overwrite: bool = False, progress: bool | None = None, allow_partial: bool = False,
           lods: int | None = None, legacy: bool = False, bits: int = 16, reduction_factor: int = 10,
           max_error_nm: float | None = None, cell_reduction: int = CELL_REDUCTION, inflate: bool = True,
           mesh_dir: str = "mesh", spec: Any = None, command: str | None = None) -> JobReport:
    """Mesh every body of an export into a precomputed dataset folder.

    Parameters
    ----------
    source : Dataset or anything ``Dataset`` opens
        The export (with ``Dataset([export, downsampled])``, the scales ``dvidshards downsample`` made).
    dest : path, URL, kvstore spec or store
        A new or empty folder, or a precomputed dataset (a ``convert`` output).
    scales, scale : optional
        One scale per level of detail, each twice as coarse as the one before (``(2, 3, 4)``); or
        level 0's scale, the coarser levels from the exported scales after it. Default: the finest
        scale of voxels >= 32 nm (else the coarsest).
    labels, box, scheduler, workdir, resume, overwrite, progress, allow_partial :
        As for every job (:mod:`dvidshards.jobs.options`). ``box``: level 0's voxels (bodies closed
        at its faces); ``workdir``: the fragment files; ``overwrite`` replaces the mesh directory only.
    lods : int, optional
        Levels of detail at most (default: every exported coarser scale, up to 6).
    legacy : bool
        neuroglancer's legacy single-resolution format (one fragment per body, in nm).
    bits : {10, 16}
        Draco vertex quantisation bits.
    reduction_factor, max_error_nm :
        Keep about ``1 / reduction_factor`` of the marching-cubes faces (igneous'
        ``simplification_factor``; 0: all), fewer where the bound ``max_error_nm`` binds (nm at
        level 0, igneous' ``max_simplification_error``; default 1.25 voxels, 40 nm at 32 nm; the same
        in voxels at each coarser level).
    cell_reduction : int
        The per-cell pass, cell borders locked: about ``1 / cell_reduction`` of the faces (0 or 1:
        none), within 2/3 of the bound.
    inflate : bool
        Move each body's surface out to enclose its voxel volume.
    mesh_dir, spec, command :
        The mesh directory inside ``dest``; the export's spec; the command line.

    Returns
    -------
    JobReport
        ``totals``: bodies, pieces, marching-cubes and kept faces; ``notes`` say which scales.

    Raises
    ------
    MeshesError, OutputError
        Before any work, if the parameters or the destination are not usable.
    JobError
        If the output is incomplete (``allow_partial`` false); ``.report`` is the report.
    """
    ds = source if isinstance(source, Dataset) else Dataset(source, spec=spec)
    if bits not in (10, 16):
        raise MeshesError(f"bits must be 10 or 16, got {bits}")
    if int(reduction_factor) < 0 or int(cell_reduction) < 0 or (max_error_nm is not None and not max_error_nm >= 0):
        raise MeshesError("reduction factors and max_error_nm must be >= 0")
    if mesh_dir in ("", ".", "..") or "/" in mesh_dir or mesh_dir == "info":
        raise MeshesError(f"mesh_dir {mesh_dir!r}: give a plain folder name")
    scheduler_of(scheduler)  # a malformed scheduler is refused before anything is written
    ks, note = levels(ds, scales=scales, scale=scale, lods=lods, legacy=legacy)
    shards = {k: ds.shards(k) for k in ks}
    n = sum(len(v) for v in shards.values())
    if not n:
        raise MeshesError(f"{ds.store.describe('')}: no shard files at scale(s) {list(ks)}")
    root = as_store(dest, writable=True)
    mdest = root.child(mesh_dir)
    info = _check_root(root, mesh_dir, ds)
    work = work_folder(root, workdir)
    r0 = ds.scale(ks[0]).resolution
    err = MAX_ERROR
    if max_error_nm is not None:
        if r0 is None:
            raise MeshesError("max_error_nm needs the export's resolution (pass its spec)")
        err = float(max_error_nm) / float(max(r0))  # of the coarsest axis: a bound everywhere
    job = MeshJob(ds, labels if isinstance(labels, str) else as_labels(labels), ks, work, mdest, legacy,
                  None if legacy else _default_sharding(n).to_json(),
                  0 if not legacy else max(0, min(12, math.ceil(math.log2(n)))), int(bits), int(reduction_factor),
                  err, int(cell_reduction), err * CELL_ERROR, bool(inflate), box_of(box),
                  None if max_error_nm is None else float(max_error_nm))
    params = {"mesh_format": "legacy" if legacy else "multilod", "mesh_dir": mesh_dir, **job.ident()}
    notes = [f"levels of detail from {', '.join(f's{k}' for k in ks)}" + (f" ({r0[0]:g} nm)" if r0 else "")]
    if note:
        notes.append(note)
    with Output(mdest, job="meshes", parameters=params, source=ds, scales=ks, command=command, resume=resume,
                overwrite=overwrite, workdir=work) as out:
        prev = out.previous
        if resume and prev is not None and prev.get("complete"):
            totals = prev.get("totals") or {}
            out.report.skipped = out.report.tasks = (prev.get("tasks") or {}).get("total", 0)
            return out.finish(totals=totals, notes=[*notes, "already complete"], allow_partial=allow_partial)
        if overwrite and info is not None and info.get("mesh") == mesh_dir:
            info.pop("mesh")
            _write_json(root, "info", info)  # the volume points at no meshes while they change
        if not resume:
            clear_work(work, _WORK)  # another run's fragments
        totals = {"bodies": 0, "pieces": 0, "faces_marching_cubes": 0, "faces_after_cell_pass": 0}
        tasks = list(plan(job, shards))
        with TaskRunner(scheduler, progress=progress) as tr:
            tr.check_shared(work)
            made = set(work.list_sync("L0")) if resume else set()
            phase = tr.run(run_task, tasks, desc="mesh shards", done=[t for t in tasks if t.key[3:] in made])
            out.add(phase)
            for r in phase.results.values():
                totals["pieces"] += r["fragments"]
                totals["faces_marching_cubes"] += r["faces_mc"]
                totals["faces_after_cell_pass"] += r["faces_kept"]
            if not phase.failed:  # bodies crossing a failed shard would have holes: no mesh is written
                totals["bodies"] = reduce(tr, out, job, [t.key for t in tasks])
        if not out.report.failed:  # complete: the mesh info, then the volume's info pointing at it
            res0 = ds.scale(ks[0]).resolution or (1.0, 1.0, 1.0)
            sp = None if job.sharding is None else ShardingSpec.from_json(job.sharding)
            _write_json(mdest, "info", legacy_info() if sp is None else multilod_info(res0, bits, sp))
            vinfo = info if info is not None else _new_info(ds)
            vinfo["mesh"] = mesh_dir
            _write_json(root, "info", vinfo)
        notes.insert(0, f"{totals['bodies']:,} bodies, {totals['pieces']:,} cell pieces")
        report = out.finish(totals=totals, notes=notes, allow_partial=allow_partial)
    if report.complete:
        remove_work(work, _WORK)
    return report


# --------------------------------------------------------------------------- command line


class MeshesCommand:
    """``dvidshards meshes EXPORT DEST``."""

    @staticmethod
    def add_arguments(p) -> None:
        add_source(p)
        add_dest(p, what="precomputed dataset folder: new, empty, or a convert output (gains a mesh)")
        p.add_argument("--scale", type=int, default=None, metavar="K",
                       help=f"level of detail 0's scale (default: the finest with voxels of {TARGET_NM:g} nm or "
                            f"more); coarser levels from the scales after it")
        add_scales(p, help="one scale per level of detail instead (e.g. --scales 2 3 4)")
        p.add_argument("--lods", type=int, default=None, help=f"levels of detail at most (default {MAX_LODS})")
        add_labels(p)
        add_box(p)
        p.add_argument("--legacy", action="store_true", help="neuroglancer's legacy single-resolution format")
        p.add_argument("--bits", type=int, default=16, choices=(10, 16), help="Draco quantisation bits")
        p.add_argument("--reduction", type=int, default=10, metavar="R",
                       help="keep about 1/R of the marching-cubes faces (default 10; 0: every face)")
        p.add_argument("--max-error-nm", type=float, default=None, metavar="NM",
                       help=f"the simplifier's bound at level 0 in nm, as igneous' max_simplification_error "
                            f"(default {MAX_ERROR:g} voxels: 40 nm at 32 nm; the same in voxels at each coarser "
                            f"level)")
        p.add_argument("--mesh-dir", default="mesh", help="mesh folder inside DEST (default: mesh)")
        add_job_options(p)

    @staticmethod
    def main(args) -> int:
        kw = {k: getattr(args, k) for k in ("spec", "scale", "scales", "lods", "labels", "box", "legacy", "bits",
                                            "max_error_nm", "mesh_dir")}
        report = meshes(args.source, args.dest, reduction_factor=args.reduction, allow_partial=True,
                        cell_reduction=CELL_REDUCTION if args.reduction else 0, command=command_line("meshes", args),
                        **kw, **job_options(args))
        print(report.summary())
        return 0 if report.ok else 1
