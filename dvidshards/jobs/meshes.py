"""Meshes for every body of an export: ``dvidshards meshes EXPORT DEST``, and ``dvidshards body``.

``meshes(source, dest)`` writes neuroglancer's multi-resolution sharded Draco meshes
(``neuroglancer_multilod_draco``; ``legacy=True``: the single-resolution legacy format) into a
precomputed dataset folder: a ``convert`` output (its ``info`` gains the ``mesh`` key) or a new
folder holding only ``info`` and the mesh directory. neuroglancer and
``cloudvolume.CloudVolume("file://DEST").mesh.get(id)`` read it.

How it runs (one :class:`~dvidshards.jobs.runner.TaskRunner` for every phase):

1. **Map, one task per source shard** (per scale given): the cells of the shard's chunks are
   meshed by marching cubes (``formats.mesh.mesh_cells``: each cell is its chunk plus one voxel
   of its + neighbours, so neighbouring cells meet exactly and a body's fragments weld into one
   watertight surface). Fragments go to one work file per shard, sorted by the *bucket* of
   their body: the mesh shard the body lands in (``murmurhash3_x86_128`` of the id, as the
   sharded format hashes it) or, for the legacy format, a hash bucket of the id. The file is
   written through a temporary name, so a task that fails writes nothing; ``resume`` skips
   shards whose file exists. Memory: a shard's index, two planes of chunk faces and the
   fragment table (24 bytes a fragment); fragments stream to disk.
2. **Regroup** (only above ``FAN_IN`` files): groups of files merge bucket by bucket, level by
   level, so the last phase opens at most ``FAN_IN`` files.
3. **Final, one task per bucket**: the fragments of the bucket's bodies, body by body: lod 0
   is the scale-0 cells, lod j the cells of the j-th scale given (``scales=[0, 1, 2]``) or
   levels simplified from lod 0 (``lods=``); each body's manifest and Draco fragments are
   encoded, and the bucket's shard file written (temporary name, then renamed). Memory: one
   bucket's fragments. Never all bodies on the client: the planner holds shard origins and
   bucket numbers only.

The destination holds ``<mesh>/dvidshards.json``: written first with ``"complete": false``
(the parameters, the shards failed), made ``true`` at the end. The mesh ``info`` and the
volume ``info``'s ``mesh`` key are written only when every task succeeded, so an incomplete
output is never found by a reader. A destination holding anything but a precomputed dataset
(or an earlier run of this job) is refused, as is an earlier output unless ``resume`` or
``overwrite``.

The command line's adapter classes, ``MeshesCommand`` and ``BodyCommand``, sit at the end.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import json
import math
import os
import shutil
import struct
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..bodies import Body, chunk_decoder
from ..dataset import Dataset
from ..errors import SpecError
from ..formats.labelindex import bucket_of, labels_id
from ..formats.labels import as_labels
from ..formats.mesh import Mesh, merge_fragments, mesh_cells, to_obj, to_ply
from ..formats.multilod import (
    build_lods,
    encode_object,
    encode_shard_files,
    legacy_files,
    legacy_info,
    multilod_info,
)
from ..formats.multiscale import parse_json
from ..formats.sharding import ShardingSpec, murmurhash3_x86_128_low64, shard_key
from .runner import TaskRunner, failure_lines, job_arguments, progress_of, scheduler_of

__all__ = [
    "FAN_IN",
    "MANIFEST",
    "BodyCommand",
    "MeshesCommand",
    "MeshesReport",
    "MeshJob",
    "meshes",
]

FAN_IN = 64  # work files a regroup or final task opens at most
MANIFEST = "dvidshards.json"
FORMAT = "dvidshards-meshes"
_MAGIC = b"DVSMESH1"
_HEAD = np.dtype([("body", "<u8"), ("x", "<i4"), ("y", "<i4"), ("z", "<i4"), ("scale", "<u4"),
                  ("nv", "<u4"), ("nf", "<u4")])  # one fragment's header (32 bytes)
_INDEX = np.dtype([("bucket", "<u8"), ("off", "<u8"), ("len", "<u8")])


class MeshesError(SpecError):
    """The destination or the parameters of ``meshes`` are not usable (nothing was written)."""


# --------------------------------------------------------------------------- the job record


@dataclass(frozen=True)
class MeshJob:
    """What every task of one ``meshes`` run needs: parameters and paths, never data.

    ``scales`` are the folder numbers meshed, lod j from ``scales[j]``; ``lods`` the levels
    simplified from lod 0 when one scale is given. ``sharding`` is the mesh sharding spec
    (JSON) of the multi-resolution format; None for the legacy format, whose buckets are
    ``bucket_bits`` of the body hash.
    """

    dataset: Any
    labels: Any
    scales: tuple[int, ...]
    work: str
    mesh_dir: str
    legacy: bool = False
    sharding: dict | None = None
    bucket_bits: int = 0
    bits: int = 16
    lods: int = 1
    reduction_factor: int = 0
    max_error: float = 8.0

    def ident(self) -> dict:
        """The parameters an output depends on (a resumed run must repeat them)."""
        return {"scales": list(self.scales), "legacy": self.legacy, "sharding": self.sharding,
                "bucket_bits": self.bucket_bits, "bits": self.bits, "lods": self.lods,
                "reduction_factor": self.reduction_factor, "max_error": self.max_error,
                **labels_id(as_labels(self.labels))}


def _bucket(job: MeshJob, bodies: np.ndarray) -> np.ndarray:
    """The final task (mesh shard number, or hash bucket) of each body id."""
    b = np.asarray(bodies, np.uint64)
    if job.sharding is None:
        return bucket_of(b, job.bucket_bits).astype(np.uint64)
    sp = ShardingSpec.from_json(job.sharding)
    h = np.atleast_1d(murmurhash3_x86_128_low64(b >> np.uint64(sp.preshift_bits)))
    return (h >> np.uint64(sp.minishard_bits)) & np.uint64((1 << sp.shard_bits) - 1)


def _grid(s) -> tuple[np.ndarray, np.ndarray, int]:
    """(first chunk, last chunk, chunk edge) of a scale's volume."""
    cs = int(s.chunk_size[0])
    lo = np.asarray(s.voxel_offset, np.int64)
    hi = lo + np.asarray(s.size, np.int64)
    return lo // cs, (hi - 1) // cs, cs


# --------------------------------------------------------------------------- work files


def _frag_path(job: MeshJob, scale: int, origin) -> str:
    return os.path.join(job.work, "L0", f"s{scale}_{origin[0]}_{origin[1]}_{origin[2]}.frag")


def _replace_atomic(path: str, write) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _write_sorted(path: str, unsorted: str, table: np.ndarray) -> None:
    """Copy entries of ``unsorted`` (rows of ``table``: bucket, body, off, len) sorted by bucket
    and body into ``path``, with the bucket index as a footer."""
    order = np.lexsort((table["body"], table["bucket"]))
    table = table[order]

    def write(tmp):
        with open(tmp, "wb") as out:
            index = []
            if len(table):
                with open(unsorted, "rb") as src:  # plain reads: nothing of the file stays mapped
                    pos = 0
                    cur, start = None, 0
                    for bk, off, n in zip(table["bucket"].tolist(), table["off"].tolist(), table["len"].tolist(),
                                          strict=True):
                        if bk != cur:
                            if cur is not None:
                                index.append((cur, start, pos - start))
                            cur, start = bk, pos
                        src.seek(off)
                        out.write(src.read(n))
                        pos += n
                    index.append((cur, start, pos - start))
            _write_footer(out, index)

    _replace_atomic(path, write)


def _write_footer(out, index) -> None:
    idx = np.array(index, _INDEX) if index else np.zeros(0, _INDEX)
    out.write(idx.tobytes())
    out.write(struct.pack("<Q", len(idx)) + _MAGIC)


def _read_index(f) -> np.ndarray:
    f.seek(0, os.SEEK_END)
    size = f.tell()
    if size < 16:
        raise SpecError(f"{f.name}: not a fragment file (too short)")
    f.seek(size - 16)
    tail = f.read(16)
    if tail[8:] != _MAGIC:
        raise SpecError(f"{f.name}: not a fragment file (no footer)")
    n = struct.unpack("<Q", tail[:8])[0]
    if 16 + n * _INDEX.itemsize > size:
        raise SpecError(f"{f.name}: fragment file footer is damaged")
    f.seek(size - 16 - n * _INDEX.itemsize)
    return np.frombuffer(f.read(n * _INDEX.itemsize), _INDEX)


def _span(path: str, bucket: int) -> tuple[int, int]:
    """(offset, length) of one bucket in a fragment file ((0, 0): none)."""
    with open(path, "rb") as f:
        idx = _read_index(f)
    k = int(np.searchsorted(idx["bucket"], np.uint64(bucket)))
    if k == len(idx) or int(idx["bucket"][k]) != bucket:
        return 0, 0
    return int(idx["off"][k]), int(idx["len"][k])


def _buckets_of(path: str) -> np.ndarray:
    with open(path, "rb") as f:
        return _read_index(f)["bucket"].copy()


def _entry(body: int, cell, scale: int, m: Mesh) -> bytes:
    h = np.zeros(1, _HEAD)
    h["body"], h["x"], h["y"], h["z"] = body, cell[0], cell[1], cell[2]
    h["scale"], h["nv"], h["nf"] = scale, len(m.vertices), len(m.faces)
    return h.tobytes() + m.vertices.astype("<f4").tobytes() + m.faces.astype("<u4").tobytes()


def _scan(path: str, bucket: int):
    """(body, raw entry) of every fragment of a bucket of a file, in file order (sorted by body).

    Entries are read one at a time (plain reads, no mapping), so only the current ones are held.
    """
    off, n = _span(path, bucket)
    if not n:
        return
    with open(path, "rb") as f:
        f.seek(off)
        pos = 0
        while pos < n:
            head = f.read(_HEAD.itemsize)
            if len(head) < _HEAD.itemsize or pos + _HEAD.itemsize > n:
                raise SpecError(f"{path}: fragment data truncated")
            h = np.frombuffer(head, _HEAD, 1)[0]
            size = 12 * (int(h["nv"]) + int(h["nf"]))
            rest = f.read(size)
            if len(rest) < size or pos + _HEAD.itemsize + size > n:
                raise SpecError(f"{path}: fragment data truncated")
            yield int(h["body"]), head + rest
            pos += _HEAD.itemsize + size


def _parse(raw) -> tuple[int, tuple[int, int, int], int, Mesh]:
    """(body, cell, scale, Mesh) of one raw fragment entry."""
    h = np.frombuffer(raw, _HEAD, 1, 0)[0]
    nv, nf = int(h["nv"]), int(h["nf"])
    v = np.frombuffer(raw, "<f4", 3 * nv, _HEAD.itemsize).reshape(nv, 3)
    f = np.frombuffer(raw, "<u4", 3 * nf, _HEAD.itemsize + 12 * nv).reshape(nf, 3)
    return int(h["body"]), (int(h["x"]), int(h["y"]), int(h["z"])), int(h["scale"]), Mesh(v, f)


def _by_body(files, bucket: int):
    """``(body, [raw entries])`` of one bucket across files, body by body (a k-way merge of the
    files' body-sorted sections, read entry by entry): one body's fragments in memory at a time."""
    streams = [_scan(p, bucket) for p in files]
    merged = heapq.merge(*streams, key=lambda e: e[0])
    for body, group in itertools.groupby(merged, key=lambda e: e[0]):
        yield body, [raw for _, raw in group]


# --------------------------------------------------------------------------- map: one source shard


def _shard_cells(s, origin, coords: np.ndarray) -> np.ndarray:
    """Cells a shard's task meshes: those of its chunks and their - neighbours, plus its cells on
    its + faces (their + neighbours lie in other shards), owned by this shard."""
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


def _map_task(job: MeshJob, item) -> dict:
    """Mesh one source shard's cells; write its fragments sorted by bucket. Returns counts."""
    scale, origin = item
    ds = job.dataset
    s = ds.scale(scale)
    path = _frag_path(job, scale, origin)
    src = as_labels(job.labels)
    _, _, cs = _grid(s)
    shard = ds.reader(s, src, fill_missing_shards=True).shard(*(int(v) // cs for v in origin))  # the decoder's too
    if shard is None:
        raise SpecError(f"{ds.store.describe(s.stem(origin) + '.arrow')}: listed but not found")
    cells = _shard_cells(s, origin, np.asarray(shard.coords, np.int64))
    decode = chunk_decoder(ds, s.index, src, fill_missing_shards=True)  # listed shards only; others: none
    reduction = job.reduction_factor if scale == job.scales[0] else 0  # coarser lods: no triangle may cross
    unsorted = f"{path}.unsorted-{uuid.uuid4().hex[:12]}"
    rows: list[tuple[int, int, int]] = []
    try:
        with open(unsorted, "wb") as f:
            pos = 0
            for cell, out in mesh_cells(decode, cells, cs, reduction_factor=reduction, max_error=job.max_error):
                for body, m in out.items():
                    blob = _entry(body, cell, scale, m)
                    f.write(blob)
                    rows.append((body, pos, len(blob)))
                    pos += len(blob)
        table = np.zeros(len(rows), [("bucket", "<u8"), ("body", "<u8"), ("off", "<u8"), ("len", "<u8")])
        if rows:
            arr = np.array(rows, np.uint64)
            table["body"], table["off"], table["len"] = arr[:, 0], arr[:, 1], arr[:, 2]
            table["bucket"] = _bucket(job, table["body"])
        _write_sorted(path, unsorted, table)
    finally:
        if os.path.exists(unsorted):
            os.remove(unsorted)
    return {"fragments": len(rows), "bodies": int(len(np.unique(table["body"]))) if rows else 0}


# --------------------------------------------------------------------------- regroup and final


def _regroup_task(job: MeshJob, item) -> int:
    """Merge a group of fragment files into one, bucket by bucket, body by body (memory: one body)."""
    level, k, files = item
    path = os.path.join(job.work, f"L{level}", f"{k:06d}.frag")

    def write(tmp):
        buckets = np.unique(np.concatenate([_buckets_of(p) for p in files])) if files else []
        index = []
        pos = 0
        with open(tmp, "wb") as out:
            for b in [int(v) for v in buckets]:
                start = pos
                for _, raws in _by_body(files, b):  # stays sorted by body
                    for raw in raws:
                        out.write(raw)
                        pos += len(raw)
                index.append((b, start, pos - start))
            _write_footer(out, index)

    _replace_atomic(path, write)
    return len(files)


def _body_lods(job: MeshJob, frags: dict[int, dict[tuple[int, int, int], Mesh]], ds):
    """(lods, vertex offsets) of one body in stored model coordinates (scale-0 voxels).

    ``frags[scale][cell]`` are the body's cell meshes in voxel corner coordinates of their scale.
    """
    s0 = ds.scale(job.scales[0])
    first0, _, cs = _grid(s0)
    origin = first0 * cs + 0.5 - cs  # grid origin: corner of node (0, 0, 0)
    if len(job.scales) == 1:
        lod0 = {_node(c, first0): m for c, m in frags.get(job.scales[0], {}).items()}
        simplified = build_lods(lod0, job.lods) if job.lods > 1 else [lod0]
        return simplified, np.zeros((len(simplified), 3))
    lods: list[dict[tuple[int, int, int], Mesh]] = []
    offsets = []
    res0 = np.asarray(s0.resolution, np.float64)
    for j, k in enumerate(job.scales):
        s = ds.scale(k)
        f = float(2**j)
        first, _, _ = _grid(s)
        # node box lo = origin + cs * 2**j * p with p = c - first + 1; the cell's box is
        # f * (cs * c + 0.5): a constant shift per lod, stored as its vertex offset
        delta = f * 0.5 - origin + cs * f * (first - 1)
        level = {}
        for c, m in frags.get(k, {}).items():
            level[_node(c, first)] = Mesh((m.vertices.astype(np.float64) * f - delta).astype(np.float32), m.faces)
        if not np.allclose(np.asarray(s.resolution, np.float64), res0 * f):
            raise SpecError(f"scale {k}: resolution {s.resolution} is not 2**{j} x {list(res0)}")
        lods.append(level)
        offsets.append(delta)
    while len(lods) > 1 and not lods[-1]:
        lods.pop()
        offsets.pop()
    return lods, np.asarray(offsets, np.float64)


def _node(cell, first) -> tuple[int, int, int]:
    """Octree node position of the cell of chunk ``cell``: ``cell - first + 1`` (>= 0)."""
    x, y, z = (int(c) - int(f) + 1 for c, f in zip(cell, first, strict=True))
    return x, y, z


def _done_path(job: MeshJob, bucket: int) -> str:
    return os.path.join(job.work, "done", f"{bucket}")


def _final_task(job: MeshJob, files: tuple[str, ...], bucket: int) -> int:
    """Every body of one bucket, one at a time: levels of detail, encoded, the bucket's files written.

    Memory: one body's fragments, and the bucket's encoded output (Draco-compressed)."""
    ds = job.dataset
    s0 = ds.scale(job.scales[0])
    first0, _, cs = _grid(s0)
    origin = first0 * cs + 0.5 - cs
    n = 0
    if job.legacy:
        res = s0.resolution if s0.resolution is not None else [1.0, 1.0, 1.0]
        for body, frags in _bodies(files, bucket):
            merged = merge_fragments(frags.get(job.scales[0], {}).values())
            if not len(merged.faces):
                continue
            for rel, blob in legacy_files({body: merged}, res).items():
                if rel != "info":
                    _replace_atomic(os.path.join(job.mesh_dir, rel), lambda tmp, b=blob: _write_bytes(tmp, b))
            n += 1
    else:
        manifests, datas = {}, {}
        for body, frags in _bodies(files, bucket):
            lods, offsets = _body_lods(job, frags, ds)
            if not lods or not lods[0]:
                continue
            # simplified levels may poke a little out of their nodes: clipped (lod 0 cells are exact)
            manifests[body], datas[body] = encode_object(lods, origin, (cs, cs, cs), job.bits,
                                                         vertex_offsets=offsets, tolerance=0.05)
            n += 1
        assert job.sharding is not None
        sp = ShardingSpec.from_json(job.sharding)
        for name, blob in encode_shard_files(sp, manifests, datas).items():
            if name != shard_key(bucket, sp.shard_bits):
                raise RuntimeError(f"bucket {bucket}: body hashed to shard {name}")
            _replace_atomic(os.path.join(job.mesh_dir, name), lambda tmp, b=blob: _write_bytes(tmp, b))
    _replace_atomic(_done_path(job, bucket), lambda tmp: _write_bytes(tmp, str(n).encode()))
    return n


def _bodies(files, bucket: int):
    """``(body, {scale: {cell: Mesh}})`` of one bucket, body by body in id order."""
    for body, raws in _by_body(files, bucket):
        frags: dict[int, dict[tuple[int, int, int], Mesh]] = {}
        for raw in raws:
            _, cell, scale, m = _parse(raw)
            frags.setdefault(scale, {})[cell] = m
        yield body, frags


def _write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


# --------------------------------------------------------------------------- the destination


def _read_json(path: str) -> dict | None:
    try:
        with open(path, "rb") as f:
            return parse_json(f.read(), path)
    except FileNotFoundError:
        return None


def _write_json(path: str, obj) -> None:
    _replace_atomic(path, lambda tmp: _write_bytes(tmp, (json.dumps(obj, indent=1) + "\n").encode()))


def _check_dest(dest: str, mesh: str, ds, scale0: int, resume: bool, overwrite: bool) -> dict | None:
    """Refuse a destination that is not a precomputed dataset, a new folder or our own output.

    Returns the existing volume ``info`` (None for a new dataset).
    """
    if os.path.exists(dest) and not os.path.isdir(dest):
        raise MeshesError(f"{dest}: exists and is not a folder")
    names = sorted(os.listdir(dest)) if os.path.isdir(dest) else []
    info = _read_json(os.path.join(dest, "info")) if "info" in names else None
    if info is not None and not (isinstance(info, dict) and isinstance(info.get("scales"), list)):
        raise MeshesError(f"{dest}/info: not a neuroglancer precomputed volume info")
    mine = _read_json(os.path.join(dest, mesh, MANIFEST)) if mesh in names else None
    if mine is not None and mine.get("format") != FORMAT:
        mine = None
    if info is None and names and not (names == [mesh] and mine is not None):
        raise MeshesError(f"{dest}: holds {names[:3]} but no precomputed 'info'; give a new folder, an empty "
                          f"one, or a precomputed dataset (a convert output)")
    if mesh in names and os.listdir(os.path.join(dest, mesh)):
        if mine is None and not overwrite:
            raise MeshesError(f"{dest}/{mesh}: holds meshes this job did not write; pass --overwrite to "
                              f"replace them, or --mesh-dir for another folder")
        if mine is not None and not (resume or overwrite):
            state = "complete" if mine.get("complete") else "incomplete"
            raise MeshesError(f"{dest}/{mesh}: holds the {state} output of an earlier run; pass --resume to "
                              f"finish it or --overwrite to replace it")
    if info is not None:
        s = ds.scale(scale0)
        sc = info["scales"][0] if info["scales"] else {}
        res = sc.get("resolution")
        if s.resolution is not None and res is not None and not np.allclose(res, s.resolution):
            raise MeshesError(f"{dest}/info: its first scale has resolution {res}, the export's scale "
                              f"{scale0} has {list(s.resolution)}: meshes would not line up")
    return info


def _default_sharding(n_tasks: int) -> ShardingSpec:
    """Mesh sharding: about one mesh shard per source shard, 64 minishards each."""
    shard_bits = max(0, min(16, math.ceil(math.log2(max(n_tasks, 1)))))
    return ShardingSpec(preshift_bits=0, minishard_bits=6, shard_bits=shard_bits, hash="murmurhash3_x86_128",
                        minishard_index_encoding="gzip", data_encoding="raw")


# --------------------------------------------------------------------------- public API


@dataclass
class MeshesReport:
    """What a `meshes` run did.

    Attributes
    ----------
    path : str
        The mesh directory.
    shards : int
        Source shard tasks (every scale).
    skipped : int
        Shards resumed (their fragments were kept).
    failed : dict
        ``{shard file or bucket: "Type: message"}``; any entry means the output is incomplete.
    bodies : int
        Bodies written.
    fragments : int
        Cell fragments made by this run's map tasks.
    elapsed : float
        Seconds.
    """

    path: str = ""
    shards: int = 0
    skipped: int = 0
    failed: dict = field(default_factory=dict)
    bodies: int = 0
    fragments: int = 0
    elapsed: float = 0.0

    @property
    def ok(self) -> bool:
        """True when the output is complete."""
        return not self.failed

    def summary(self) -> str:
        lines = [f"{self.bodies} bodies from {self.shards} shards ({self.skipped} resumed, {len(self.failed)} "
                 f"failed) in {self.elapsed:.1f} s -> {self.path}" + ("" if self.ok else " (INCOMPLETE)")]
        return "\n".join(lines + failure_lines(self.failed, rest=f" (all in {os.path.join(self.path, MANIFEST)})"))


def meshes(source, dest, *, scales=(0,), labels="agglomerated", legacy: bool = False, lods: int = 1,
           bits: int = 16, reduction_factor: int = 100, max_error: float = 40.0, mesh_dir: str = "mesh",
           scheduler=None, workdir=None, resume: bool = False, overwrite: bool = False,
           progress: bool | None = None, spec=None, command: list | None = None) -> MeshesReport:
    """Mesh every body of an export into a precomputed dataset folder.

    Parameters
    ----------
    source : Dataset or anything ``Dataset`` opens
        The export.
    dest : path
        A new or empty folder, or a precomputed dataset (a ``convert`` output).
    scales : sequence of int
        Folder numbers meshed; lod j comes from ``scales[j]``, each twice as coarse as the one
        before (e.g. ``(0, 1, 2)``). Default: scale 0 only.
    labels : "agglomerated", "supervoxels" or a mapping
        What a body is (meshes are per body id).
    legacy : bool
        neuroglancer's legacy single-resolution format (one fragment per body, in nm) instead
        of the multi-resolution sharded Draco format.
    lods : int
        With one scale: levels of detail simplified from lod 0 (1: lod 0 only).
    bits : {10, 16}
        Draco vertex quantisation bits.
    reduction_factor, max_error : int, float
        Per-cell simplification of lod 0, igneous' defaults (100, 40). 0: every marching-cubes
        triangle - exact, but a dense 2048³ shard then makes tens of GB of fragments.
    mesh_dir : str
        Name of the mesh directory inside ``dest``.
    scheduler : see :class:`dvidshards.jobs.runner.TaskRunner`
    workdir : path, optional
        Fragment work files (visible to every worker); default ``dest/<mesh_dir>/_work``,
        removed when the output is complete.
    resume : bool
        Finish an earlier, incomplete run (same parameters): keep the shards it completed.
    overwrite : bool
        Replace the meshes of an earlier run (only the mesh directory is touched).
    progress : bool, optional
    spec : dict or path, optional
        The export's multiscale spec when ``source`` is a path.
    command : list of str, optional
        Recorded in the manifest.

    Returns
    -------
    MeshesReport

    Raises
    ------
    MeshesError
        Before any work, if the destination or the parameters are not usable.
    """
    t0 = time.perf_counter()
    ds = source if isinstance(source, Dataset) else Dataset(source, spec=spec)
    scales = tuple(ds.scale(k).index for k in (scales if isinstance(scales, (list, tuple)) else [scales]))
    if not scales:
        raise MeshesError("give at least one scale")
    if bits not in (10, 16):
        raise MeshesError(f"bits must be 10 or 16, got {bits}")
    if int(lods) < 1 or (int(lods) > 1 and len(scales) > 1):
        raise MeshesError("lods must be >= 1, and 1 when several scales make the levels of detail")
    if legacy and len(scales) > 1:
        raise MeshesError("the legacy mesh format has one level of detail: give one scale")
    if resume and overwrite:
        raise MeshesError("give --resume or --overwrite, not both")
    scheduler_of(scheduler)  # a malformed scheduler is refused before anything is written
    if mesh_dir in ("", ".", "..") or "/" in mesh_dir or mesh_dir == "info":
        raise MeshesError(f"mesh_dir {mesh_dir!r}: give a plain folder name")
    for j, k in enumerate(scales):
        s = ds.scale(k)
        if len({int(v) for v in s.chunk_size}) != 1:
            raise MeshesError(f"scale {k}: meshing needs cubic chunks, got {s.chunk_size}")
        if j and (s.resolution is None or ds.scale(scales[0]).resolution is None):
            raise MeshesError("several scales need known resolutions (pass the export's spec)")
    src = as_labels(labels)
    dest = os.fspath(dest)
    info = _check_dest(dest, mesh_dir, ds, scales[0], resume, overwrite)
    mdir = os.path.join(dest, mesh_dir)
    work = os.fspath(workdir) if workdir is not None else os.path.join(mdir, "_work")
    origins = [(k, tuple(int(v) for v in o)) for k in scales for o in ds.shards(k)]
    if not origins:
        raise MeshesError(f"{ds.store.describe('')}: no shard files at scale(s) {list(scales)}")
    if overwrite and os.path.isdir(mdir):
        if info is not None and info.get("mesh") == mesh_dir:
            info.pop("mesh")
            _write_json(os.path.join(dest, "info"), info)  # the volume points at no meshes while they change
        shutil.rmtree(mdir)
        if workdir is not None:
            shutil.rmtree(work, ignore_errors=True)
    sharding = None if legacy else _default_sharding(len(origins)).to_json()
    bucket_bits = 0 if not legacy else max(0, min(12, math.ceil(math.log2(len(origins)))))
    job = MeshJob(ds, labels if isinstance(labels, str) else src, scales, work, mdir, legacy, sharding,
                  bucket_bits, int(bits), int(lods), int(reduction_factor), float(max_error))
    ident = {"format": FORMAT, "version": 1, "source": ds.store.describe(""), **job.ident()}
    man_path = os.path.join(mdir, MANIFEST)
    old = _read_json(man_path)
    if resume and old is not None:
        if old.get("parameters") != json.loads(json.dumps(ident)):
            raise MeshesError(f"{man_path}: the earlier run had other parameters ({old.get('parameters')}); "
                              f"run with the same ones, or --overwrite")
        if old.get("complete") and not os.path.exists(work):
            return MeshesReport(path=mdir, shards=len(origins), skipped=len(origins), bodies=old.get("bodies", 0),
                                elapsed=time.perf_counter() - t0)
    elif resume and os.path.isdir(mdir) and os.listdir(mdir):
        raise MeshesError(f"{mdir}: nothing to resume (no {MANIFEST})")
    os.makedirs(mdir, exist_ok=True)
    manifest = {"format": FORMAT, "version": 1, "complete": False, "command": command,
                "parameters": ident, "mesh_format": "legacy" if legacy else "multilod",
                "shards": len(origins), "failed": {}, "bodies": None}
    _write_json(man_path, manifest)
    if not resume:
        for sub in ("L0", "done"):
            shutil.rmtree(os.path.join(work, sub), ignore_errors=True)
    for sub in ("L0", "done"):
        os.makedirs(os.path.join(work, sub), exist_ok=True)
    report = MeshesReport(path=mdir, shards=len(origins))
    with TaskRunner(scheduler, progress=progress) as tr:
        tr.check_shared(work)
        done = {o for o in origins if os.path.exists(_frag_path(job, *o))} if resume else set()
        rep = tr.run(functools.partial(_map_task, job), origins, desc="mesh shards", done=done)
        report.skipped = len(rep.skipped)
        report.fragments = sum(r["fragments"] for r in rep.results.values())
        report.failed = {ds.store.describe(ds.scale(k).stem(o) + ".arrow"): msg for (k, o), msg in rep.failed.items()}
        if report.failed:  # bodies crossing a failed shard would have holes: no mesh is written
            manifest["failed"] = report.failed
            _write_json(man_path, manifest)
            report.elapsed = time.perf_counter() - t0
            return report
        files = [_frag_path(job, *o) for o in origins]
        level = 0
        while len(files) > FAN_IN:
            level += 1
            d = os.path.join(work, f"L{level}")
            shutil.rmtree(d, ignore_errors=True)
            os.makedirs(d)
            groups = [(level, k, tuple(files[i:i + FAN_IN])) for k, i in enumerate(range(0, len(files), FAN_IN))]
            r = tr.run(functools.partial(_regroup_task, job), groups, desc=f"regroup level {level}")
            if r.failed:
                report.failed = {f"regroup {g[:2]}": m for g, m in r.failed.items()}
                break
            files = [os.path.join(d, f"{g[1]:06d}.frag") for g in groups]
        if not report.failed:
            nb = (1 << ShardingSpec.from_json(job.sharding).shard_bits) if job.sharding else (1 << job.bucket_bits)
            present = np.unique(np.concatenate([_buckets_of(p) for p in files]))
            buckets = [int(b) for b in present if int(b) < nb]
            fin = tr.run(functools.partial(_final_task, job, tuple(files)), buckets, desc="mesh buckets",
                         done={b for b in buckets if os.path.exists(_done_path(job, b))})
            report.failed = {f"bucket {b}": m for b, m in fin.failed.items()}
            report.bodies = sum(fin.results.values()) + sum(
                int(open(_done_path(job, b)).read() or 0) for b in fin.skipped)
    if report.failed:
        manifest["failed"] = report.failed
        _write_json(man_path, manifest)
        report.elapsed = time.perf_counter() - t0
        return report
    # complete: the mesh info, then the volume's info pointing at it, then the manifest
    res0 = ds.scale(scales[0]).resolution or (1.0, 1.0, 1.0)
    minfo = legacy_info() if job.sharding is None else multilod_info(res0, bits, ShardingSpec.from_json(job.sharding))
    _write_json(os.path.join(mdir, "info"), minfo)
    vinfo = info if info is not None else _new_info(ds)
    vinfo["mesh"] = mesh_dir
    _write_json(os.path.join(dest, "info"), vinfo)
    manifest.update(complete=True, bodies=report.bodies, failed={})
    _write_json(man_path, manifest)
    shutil.rmtree(work, ignore_errors=True)
    report.elapsed = time.perf_counter() - t0
    return report


def _new_info(ds) -> dict:
    """The volume info of a new mesh-only dataset: the export's geometry, said to hold no chunks."""
    info = ds.info
    for sc in info["scales"]:
        sc.pop("sharding", None)
        sc.pop("inferred", None)
    info["dvidshards"] = {"meshes_only": True, "note": "no voxel chunks are stored here: this dataset holds meshes"}
    return info


# --------------------------------------------------------------------------- command line


def _scales_arg(text: str) -> list[int]:
    try:
        v = [int(x) for x in str(text).replace(" ", "").split(",") if x != ""]
    except ValueError:
        v = []
    if not v or any(k < 0 for k in v):
        raise MeshesError(f"--scales {text!r}: give folder numbers like 0 or 0,1,2")
    return v


class MeshesCommand:
    """``dvidshards meshes EXPORT DEST``."""

    @staticmethod
    def add_arguments(p) -> None:
        p.add_argument("source", help="export root: a folder, gs://, s3://, http(s):// URL or kvstore JSON")
        p.add_argument("dest", help="precomputed dataset folder: new, empty, or a convert output (gains a mesh)")
        p.add_argument("--spec", help="the neuroglancer multiscale spec given to DVID's export-shards")
        p.add_argument("--labels", default="agglomerated",
                       help="agglomerated (default), supervoxels, or a supervoxel->body mapping file")
        p.add_argument("--scales", default="0", metavar="K[,K...]",
                       help="scales to mesh: lod j from the j-th, each twice as coarse (default 0)")
        p.add_argument("--lods", type=int, default=1,
                       help="with one scale: levels of detail simplified from lod 0 (default 1)")
        p.add_argument("--legacy", action="store_true", help="neuroglancer's legacy single-resolution format")
        p.add_argument("--bits", type=int, default=16, choices=(10, 16), help="Draco quantisation bits")
        p.add_argument("--reduction", type=int, default=100, metavar="R",
                       help="simplify lod 0 per cell to about 1/R of its triangles (default 100, as igneous; 0: "
                            "every marching-cubes triangle, ~40 GB of fragments per dense mCNS shard)")
        p.add_argument("--max-error", type=float, default=40.0, metavar="E",
                       help="the simplifier's error bound (zmesh's knob, default 40 as igneous)")
        p.add_argument("--mesh-dir", default="mesh", help="mesh folder inside DEST (default: mesh)")
        job_arguments(p, workdir=True, resume=True, overwrite=True)

    @staticmethod
    def main(args) -> int:
        scales = _scales_arg(args.scales)
        ds = Dataset(args.source, spec=args.spec)
        report = meshes(ds, args.dest, scales=scales, labels=args.labels, legacy=args.legacy, lods=args.lods,
                        bits=args.bits, reduction_factor=args.reduction, max_error=args.max_error,
                        mesh_dir=args.mesh_dir,
                        scheduler=args.scheduler, workdir=args.workdir, resume=args.resume,
                        overwrite=args.overwrite, progress=progress_of(args), command=["dvidshards", "meshes"]
                        + sys.argv[2:])
        print(report.summary())
        if not report.ok:
            print(f"the output is incomplete ({os.path.join(report.path, MANIFEST)} says so); run again with "
                  f"--resume to finish it")
        return 0 if report.ok else 1


class BodyCommand:
    """``dvidshards body EXPORT ID [--size] [--box] [--sparsevol F] [--coarse F] [--mesh F.ply|F.obj]``."""

    @staticmethod
    def add_arguments(p) -> None:
        p.add_argument("source", help="export root: a folder, gs://, s3://, http(s):// URL or kvstore JSON")
        p.add_argument("id", help="body id (a supervoxel id with --labels supervoxels)")
        p.add_argument("--spec", help="the neuroglancer multiscale spec given to DVID's export-shards")
        p.add_argument("--scale", type=int, default=0, metavar="K", help="scale K (folder sK); default 0")
        p.add_argument("--labels", default="agglomerated",
                       help="agglomerated (default), supervoxels, or a supervoxel->body mapping file")
        p.add_argument("--index", metavar="FOLDER", help="a label index (dvidshards label-index) to find the chunks")
        p.add_argument("--size", action="store_true", help="print the body's voxel count")
        p.add_argument("--box", action="store_true", help="print the body's exact voxel box")
        p.add_argument("--supervoxels", action="store_true", help="print the body's supervoxel ids")
        p.add_argument("--sparsevol", metavar="FILE", help="write DVID's sparsevol RLE bytes")
        p.add_argument("--coarse", metavar="FILE", help="write DVID's sparsevol-coarse RLE bytes")
        p.add_argument("--mesh", metavar="FILE", help="write the body's mesh (nm) as .ply or .obj")
        p.add_argument("--mesh-scale", type=int, default=None, metavar="K",
                       help="scale to mesh (default: --scale)")

    @staticmethod
    def main(args) -> int:
        try:
            body_id = int(args.id)
        except ValueError:
            raise SpecError(f"ID {args.id!r}: give an integer body id") from None
        outs = [(args.sparsevol, "--sparsevol", None), (args.coarse, "--coarse", None),
                (args.mesh, "--mesh", (".ply", ".obj"))]
        for path, what, suffixes in outs:  # every check before any work
            if path is None:
                continue
            if suffixes and not path.lower().endswith(suffixes):
                raise SpecError(f"{what} {path}: the file name must end in {' or '.join(suffixes)}")
            folder = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(folder) or os.path.isdir(path):
                raise SpecError(f"{what} {path}: cannot write a file there")
        ds = Dataset(args.source, spec=args.spec)
        body = Body(ds, body_id, args.scale, args.labels, index=args.index)
        if not len(body.chunks):
            print(f"body {body_id}: no voxel at scale {body.scale} ({body.labels.name} labels)", file=sys.stderr)
            return 1
        facts: dict = {"id": body_id, "scale": body.scale, "chunks": int(len(body.chunks))}
        asked = args.size or args.box or args.supervoxels or args.sparsevol or args.coarse or args.mesh
        if args.size or not asked:
            facts["size"] = body.size
        if args.box or not asked:
            facts["box"] = body.box
        if args.supervoxels:
            facts["supervoxels"] = body.supervoxels().tolist()
        if args.sparsevol:
            _write_file(args.sparsevol, body.sparsevol())
            facts["sparsevol"] = args.sparsevol
        if args.coarse:
            _write_file(args.coarse, body.sparsevol_coarse())
            facts["coarse"] = args.coarse
        if args.mesh:
            m = body.mesh(args.mesh_scale)
            _write_file(args.mesh, to_ply(m) if args.mesh.lower().endswith(".ply") else to_obj(m))
            facts["mesh"] = {"file": args.mesh, "vertices": len(m.vertices), "faces": len(m.faces)}
        print(json.dumps(facts))
        return 0


def _write_file(path: str, data: bytes) -> None:
    _replace_atomic(path, lambda tmp: _write_bytes(tmp, data))

