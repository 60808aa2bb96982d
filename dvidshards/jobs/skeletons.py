"""Skeletons of every body of an export: ``dvidshards skeletons EXPORT DEST``.

``skeletons(source, dest)`` writes one skeleton per body (``formats.skeleton``: kimimaro's TEASAR on
overlapping blocks, joined into one tree per connected piece of the body, vertices and radii in nm)
as neuroglancer's sharded precomputed skeletons (``DEST/skeletons``, a ``radius`` attribute; the
volume ``DEST/info`` names them, so ``cloudvolume.CloudVolume("file://DEST").skeleton.get(id)``
and neuroglancer read them) and/or SWC files (``DEST/swc/<body>.swc``, or ``<body>_swc`` as FlyEM's
DVID keyvalue keys; coordinates in scale-0 voxels, radii in nm). :class:`SkeletonOutput` reads one
body back from any of them (what ``serve-dvid`` and ``view`` serve).

**The scale.** By default the finest scale whose voxel is at least 32 nm (s2 of mCNS, FlyEM's
``SparseSkeletons`` scale), made first by ``downsample`` into the work folder when the export lacks
it; ``scale=K`` chooses another.

The job reads as plan → tasks → reduce:

1. **Plan** (:func:`plan`): one :class:`CubeTask` per cube of ``TASK`` chunks a side of every shard
   of the scale (cubes never straddle shards). The client holds shard origins and task records.
2. **run_task** (:func:`run_task`), one cube: its chunks from the shard's index (with ``bodies``:
   only those whose label lists hold one, no block decoded for the others), cut into blocks of
   ``block`` chunks; each block is read with one voxel of its + neighbours and skeletonized
   (``formats.skeleton.skeletonize_block``). Every (block, body) piece goes to the cube's partial
   file in the work folder: Arrow IPC, one record batch per group of buckets (a body's bucket is
   its output shard). Memory: one block in kimimaro (~0.6 GiB at 256³) and the cube's pieces.
3. **reduce** (:func:`reduce`): groups of ``FAN_IN`` partial files merge into one, level by level;
   then one :class:`BucketTask` per bucket joins each of its bodies' pieces
   (``formats.skeleton.join_pieces``) and writes the bucket's shard file and SWC files. Memory:
   one bucket's pieces.

On the output frame of ``jobs.output``, ``DEST/info`` and ``DEST/skeletons/info`` are written only
when every task succeeded (``JobError`` carrying the report otherwise, unless ``allow_partial``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..dataset import Dataset
from ..errors import JobError, ShardFormatError, SpecError
from ..formats.labels import Mapped, as_labels
from ..formats.multilod import encode_shard_files
from ..formats.sharding import ShardingSpec, murmurhash3_x86_128_low64, shard_key
from ..formats.skeleton import (
    BLOCK,
    DUST,
    PRECOMPUTED_INFO,
    TARGET_NM,
    TEASAR,
    Piece,
    Skeleton,
    closed_faces,
    join_pieces,
    need_kimimaro,
    skeleton_scale,
    skeletonize_block,
)
from ..query import record_ids
from ..stores import ByteStore, as_store
from .options import (
    add_dest,
    add_job_options,
    add_labels,
    add_source,
    command_line,
    job_options,
)
from .output import JobReport, Output, read_manifest
from .runner import TaskRunner, clear_work, remove_work, scheduler_of

__all__ = ["DUST", "FAN_IN", "FORMATS", "TARGET_NM", "TASK", "BucketTask", "CubeTask", "SkeletonJob",
           "SkeletonOutput", "SkeletonsCommand", "default_scale", "plan", "reduce", "run_task", "skeletons"]

TASK = 8  # chunks a side of a map task's cube (512 voxels)
FAN_IN = 64  # partial files one reduce task reads
COARSE = 6  # bucket bits of the cubes' partial files when a merge tree follows
FORMATS = ("precomputed", "swc", "swc-keys")
_SCHEMA = pa.schema([("body", pa.uint64()), ("bucket", pa.uint32()), ("count", pa.int64()),
                     ("voxels", pa.large_list(pa.int32())), ("edges", pa.large_list(pa.uint32())),
                     ("radii", pa.large_list(pa.float32()))])


# --------------------------------------------------------------------------- the job record


@dataclass(frozen=True, eq=False)
class SkeletonJob:
    """What every task of one run needs: parameters and locations, never data."""

    source: Dataset
    labels: Any
    scale: int
    work: ByteStore
    dest: ByteStore
    bits: int  # buckets = output shards: 2**bits
    formats: tuple[str, ...]
    block: int = BLOCK
    dust: int = DUST
    min_size: int = 0
    heal_nm: float | None = None
    teasar: dict = field(default_factory=lambda: dict(TEASAR))
    bodies: bool = False  # the work folder's bodies.u64 lists the bodies (uint64) to skeletonize
    voxel_size: tuple[float, ...] = (1.0, 1.0, 1.0)

    @property
    def sharding(self) -> ShardingSpec:
        return ShardingSpec(preshift_bits=0, minishard_bits=6, shard_bits=self.bits, hash="murmurhash3_x86_128",
                            minishard_index_encoding="gzip", data_encoding="gzip")

    def bucket(self, bodies: np.ndarray) -> np.ndarray:
        """The output shard (reduce bucket) of each body id."""
        h = np.atleast_1d(murmurhash3_x86_128_low64(np.asarray(bodies, np.uint64)))
        return ((h >> np.uint64(6)) & np.uint64((1 << self.bits) - 1)).astype(np.uint32)

    def ident(self) -> dict:
        """The parameters an output depends on (``resume`` must repeat them)."""
        return {"scale": self.scale, "formats": list(self.formats), "block": self.block, "dust": self.dust,
                "min_size": self.min_size, "heal_nm": self.heal_nm, "teasar": self.teasar, "bits": self.bits,
                "voxel_size": list(self.voxel_size), **as_labels(self.labels).identity()}


@functools.lru_cache(maxsize=4)
def _wanted(job: SkeletonJob) -> np.ndarray | None:
    """The sorted body ids of ``bodies`` (loaded once per process), or None: every body."""
    if not job.bodies:
        return None
    data = job.work.get_sync("bodies.u64")
    if data is None:
        raise SpecError(f"{job.work.describe('bodies.u64')}: the body list is missing (run without --resume)")
    return np.frombuffer(data, "<u8").astype(np.uint64)


# --------------------------------------------------------------------------- plan


def default_scale(ds: Dataset) -> int:
    """The finest scale the spec lists whose voxel is at least 32 nm (made when not exported)."""
    sized = [(s.index, s.resolution) for s in ds.scales if s.resolution is not None]
    if len(sized) < len(ds.scales):
        raise SpecError("the scales' resolutions are unknown (no spec): give the export's spec (--spec), or --scale K "
                        "with a spec that states its resolution")
    return skeleton_scale(sized)


@dataclass(frozen=True, eq=False)
class CubeTask:
    """One cube of ``TASK`` chunks a side (inside one shard): its pieces into the partial file ``key``."""

    job: SkeletonJob
    origin: tuple[int, int, int]  # voxels of the scale
    shard: tuple[int, int, int]
    fbits: int  # bucket bits of its partial file

    @property
    def key(self) -> str:
        return "cubes/{}_{}_{}.arrow".format(*self.origin)

    def __str__(self) -> str:
        s = self.job.source.scale(self.job.scale)
        return f"{self.job.source.store.describe(s.stem(self.shard) + '.arrow')} cube {list(self.origin)}"


def plan(job: SkeletonJob) -> Iterator[CubeTask]:
    """One task per cube of ``TASK`` chunks of every shard file of the scale."""
    ds = job.source
    s = ds.scale(job.scale)
    cs = int(s.chunk_size[0])
    lo = np.asarray(s.voxel_offset, np.int64)
    hi = lo + np.asarray(s.size, np.int64)
    extent = min(int(s.shard_extent), 1 << 40)
    side = min(TASK * cs, extent)
    origins = ds.shards(s)
    fbits = job.bits if len(origins) * (extent // side) ** 3 <= FAN_IN else min(job.bits, COARSE)
    for origin in origins:
        o = np.asarray(origin, np.int64)
        end = np.minimum(o + extent, -(-hi // cs) * cs)
        for c in np.stack(np.meshgrid(*[np.arange(max(o[a], lo[a] // side * side), end[a], side)
                                        for a in range(3)], indexing="ij"), axis=-1).reshape(-1, 3):
            yield CubeTask(job, (int(c[0]), int(c[1]), int(c[2])), (int(o[0]), int(o[1]), int(o[2])), fbits)


# --------------------------------------------------------------------------- one cube


def _blocks(task: CubeTask) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """(block coordinate, bodies to skeletonize or None: all) of the cube's blocks holding chunks."""
    job = task.job
    ds = job.source
    s = ds.scale(job.scale)
    cs = int(s.chunk_size[0])
    shard = ds.reader(s, labels=as_labels(job.labels), fill_missing_shards=True).shard(*(v // cs for v in task.origin))
    if shard is None:
        raise ShardFormatError(f"{task}: the shard file is listed but not found")
    coords = np.asarray(shard.coords, np.int64).reshape(-1, 3)
    c0 = np.asarray(task.origin, np.int64) // cs
    side = min(TASK, max(1, min(int(s.shard_extent), 1 << 40) // cs))  # the cube's chunks a side
    rows = np.flatnonzero(((coords >= c0) & (coords < c0 + side)).all(axis=1))
    want = _wanted(job)
    if want is None:
        return [(b, None) for b in np.unique(coords[rows] // job.block, axis=0)]
    vals, owner = record_ids(shard.table(rows), as_labels(job.labels))  # the lists only: nothing decoded
    hit = np.isin(vals, want)
    blocks: dict[tuple, set] = {}
    for r, v in zip(owner[hit].tolist(), vals[hit].tolist(), strict=True):
        blocks.setdefault(tuple((coords[rows[r]] // job.block).tolist()), set()).add(v)
    return [(np.asarray(b), np.fromiter(v, np.uint64)) for b, v in sorted(blocks.items())]


def run_task(task: CubeTask) -> dict:
    """Skeletonize one cube's blocks; its pieces go to the partial file ``task.key``. Returns counts."""
    job = task.job
    s = job.source.scale(job.scale)
    cs = int(s.chunk_size[0])
    vlo = np.asarray(s.voxel_offset, np.int64)
    vhi = vlo + np.asarray(s.size, np.int64)
    cols: dict[str, list] = {k: [] for k in ("body", "count", "voxels", "edges", "radii")}
    blocks = _blocks(task)
    side = job.block * cs
    for b, ids in blocks:  # the block and one voxel of its + neighbours, inside the volume
        lo, hi = np.maximum(b * side, vlo), np.minimum(b * side + side + 1, vhi)
        labels = job.source.read([lo.tolist(), hi.tolist()], scale=job.scale, labels=job.labels, threads=1,
                                 fill_missing_shards=True)
        core = np.minimum(b * side + side, vhi) - lo
        for body, p in skeletonize_block(labels, lo, resolution=s.resolution, core=core, dust=job.dust,
                                         closed=closed_faces(b * side, side, vlo, vhi), teasar=job.teasar,
                                         object_ids=ids).items():
            for k, v in (("body", body), ("count", p.count), ("voxels", p.voxels.reshape(-1)),
                         ("edges", p.edges.reshape(-1)), ("radii", p.radii)):
                cols[k].append(v)
    if not cols["body"]:
        return {"blocks": len(blocks), "pieces": 0}  # no partial file: nothing to reduce
    ids = np.asarray(cols["body"], np.uint64)
    t = pa.table({"body": ids, "bucket": job.bucket(ids),
                  "count": np.asarray(cols["count"], np.int64),
                  **{k: pa.array(cols[k], _SCHEMA.field(k).type) for k in ("voxels", "edges", "radii")}},
                 schema=_SCHEMA)
    _write_partial(job.work, task.key, [t], job.bits, task.fbits)
    return {"blocks": len(blocks), "pieces": t.num_rows}


# --------------------------------------------------------------------------- partial files


def _write_partial(store: ByteStore, key: str, tables: Iterable[pa.Table], bits: int, fbits: int) -> None:
    """An Arrow IPC file of ``2**fbits`` record batches, batch ``g`` holding the rows whose bucket's top
    ``fbits`` bits are ``g``; ``tables`` come with their groups in order."""
    empty = pa.RecordBatch.from_pylist([], schema=_SCHEMA)
    nxt = 0
    with store.writer(key) as sink, pa.ipc.new_file(sink, _SCHEMA, options=pa.ipc.IpcWriteOptions(
            compression="zstd")) as w:
        for t in tables:
            if not t.num_rows:
                continue
            g = t["bucket"].to_numpy() >> np.uint32(bits - fbits)
            order = np.argsort(g, kind="stable")
            t, g = t.take(order), g[order]
            bounds = np.searchsorted(g, np.arange(nxt, int(g[-1]) + 2))
            for k in range(len(bounds) - 1):
                part = t.slice(int(bounds[k]), int(bounds[k + 1] - bounds[k])).combine_chunks()
                w.write_batch(part.to_batches()[0] if part.num_rows else empty)
            nxt = int(g[-1]) + 1
        for _ in range(nxt, 1 << fbits):
            w.write_batch(empty)


def _read_group(reader: pa.ipc.RecordBatchFileReader, bits: int, bucket: int) -> pa.Table:
    """The rows of ``bucket`` from a partial file of any bucket bits <= ``bits``."""
    fbits = int(reader.num_record_batches).bit_length() - 1
    t = pa.Table.from_batches([reader.get_batch(bucket >> (bits - fbits))], _SCHEMA)
    return t.filter(pc.equal(t["bucket"], pa.scalar(bucket, pa.uint32()))) if fbits < bits else t


@contextlib.contextmanager
def _partials(store: ByteStore, keys: Iterable[str]) -> Iterator[list[pa.ipc.RecordBatchFileReader]]:
    """Partial files open together (closed on leaving the ``with``)."""
    with contextlib.ExitStack() as stack:
        readers = []
        for key in keys:
            try:
                readers.append(pa.ipc.open_file(stack.enter_context(store.open(key))))
            except pa.ArrowInvalid as e:
                raise ShardFormatError(f"{store.describe(key)}: not a partial file of this job ({e})") from None
        yield readers


# --------------------------------------------------------------------------- reduce


@dataclass(frozen=True, eq=False)
class MergeTask:
    """One node of the reduce tree: partial files merged into ``L{level}/{group}.arrow`` (every bucket)."""

    job: SkeletonJob
    inputs: tuple[str, ...]
    level: int
    group: int

    @property
    def key(self) -> str:
        return f"L{self.level}/{self.group:06d}.arrow"

    def __str__(self) -> str:
        return f"merge level {self.level}, group {self.group}"


def merge_task(task: MergeTask) -> int:
    """Concatenate the inputs' rows group by group (one group in memory)."""
    job = task.job
    with _partials(job.work, task.inputs) as parts:
        n = parts[0].num_record_batches
        groups = (pa.Table.from_batches([p.get_batch(g) for p in parts], _SCHEMA) for g in range(n))
        _write_partial(job.work, task.key, groups, job.bits, job.bits)
    return len(task.inputs)


@dataclass(frozen=True, eq=False)
class BucketTask:
    """The last step: every body of one bucket joined, its shard file and SWC files written."""

    job: SkeletonJob
    inputs: tuple[str, ...]
    bucket: int

    def __str__(self) -> str:
        return f"bucket {self.bucket}"


def _pieces(t: pa.Table) -> Iterator[tuple[int, int, list[Piece]]]:
    """(body, voxels, pieces) of a bucket's rows, body by body."""
    t = t.sort_by("body")
    body = t["body"].to_numpy()
    count = t["count"].to_numpy()
    lists = {k: t[k].combine_chunks() for k in ("voxels", "edges", "radii")}
    flat = {k: a.values.to_numpy(zero_copy_only=False) for k, a in lists.items()}
    offs = {k: a.offsets.to_numpy() for k, a in lists.items()}
    starts = np.flatnonzero(np.r_[True, body[1:] != body[:-1]])[:len(body)]
    for a, b in zip(starts, np.append(starts[1:], len(body))[:len(starts)], strict=True):
        ps = [Piece(flat["voxels"][offs["voxels"][i]:offs["voxels"][i + 1]].reshape(-1, 3),
                    flat["edges"][offs["edges"][i]:offs["edges"][i + 1]].reshape(-1, 2),
                    flat["radii"][offs["radii"][i]:offs["radii"][i + 1]], int(count[i])) for i in range(a, b)]
        yield int(body[a]), int(count[a:b].sum()), ps


def bucket_task(task: BucketTask) -> dict:
    """Join every body of the bucket; write its precomputed shard and SWC files. Returns counts."""
    job = task.job
    s = job.source.scale(job.scale)
    with _partials(job.work, task.inputs) as parts:
        t = pa.concat_tables([_read_group(p, job.bits, task.bucket) for p in parts])
    entries: dict[int, bytes] = {}
    n = vertices = 0
    header = [f"#Generated by dvidshards skeletons (kimimaro) at scale {job.scale}",
              "#$" + json.dumps({"downresLevel": job.scale})]
    for body, count, ps in _pieces(t):
        if count < job.min_size or count <= job.dust:  # kimimaro keeps pieces over its dust_threshold
            continue
        sk = join_pieces(ps, resolution=s.resolution, voxel_size=job.voxel_size, heal_nm=job.heal_nm)
        if not len(sk.vertices):
            continue
        n, vertices = n + 1, vertices + len(sk.vertices)
        if "precomputed" in job.formats:
            entries[body] = sk.encode_precomputed()
        for fmt, name in (("swc", f"{body}.swc"), ("swc-keys", f"{body}_swc")):
            if fmt in job.formats:
                job.dest.put_sync(f"swc/{name}", sk.swc(header=header).encode())
    for name, blob in encode_shard_files(job.sharding, entries).items():
        if name != shard_key(task.bucket, job.bits):
            raise RuntimeError(f"bucket {task.bucket}: a body hashed to shard {name}")
        job.dest.put_sync(f"skeletons/{name}", blob)
    job.work.put_sync(f"done/{task.bucket}", json.dumps({"bodies": n, "vertices": vertices}).encode())
    return {"bodies": n, "vertices": vertices}


def reduce(out: Output, tr: TaskRunner, job: SkeletonJob, files: Sequence[str], *, resume: bool) -> dict | None:
    """The merge tree over the cubes' partial files, then one task per bucket; every phase counted into
    ``out``. Returns the totals of the buckets, or None when a step failed."""
    files, level = list(files), 0
    if not files:  # no body anywhere
        return {"bodies": 0, "vertices": 0}
    while len(files) > FAN_IN:
        level += 1
        merges = [MergeTask(job, tuple(files[i:i + FAN_IN]), level, k) for k, i in enumerate(range(0, len(files), FAN_IN))]
        have = set(job.work.list_sync(f"L{level}")) if resume else set()
        ph = tr.run(merge_task, merges, desc=f"merge level {level}",
                    done={m for m in merges if m.key.rpartition("/")[2] in have})
        out.add(ph)
        if ph.failed:
            return None
        files = [m.key for m in merges]
    finals = [BucketTask(job, tuple(files), b) for b in range(1 << job.bits)]
    done = set(job.work.list_sync("done")) if resume else set()
    ph = tr.run(bucket_task, finals, desc="bucket shards", done={f for f in finals if str(f.bucket) in done})
    out.add(ph)
    if ph.failed:
        return None
    totals = {"bodies": 0, "vertices": 0}
    for f in finals:
        got = ph.results.get(f) or json.loads(job.work.get_sync(f"done/{f.bucket}") or b"{}")
        for k in totals:
            totals[k] += int(got.get(k, 0))
    return totals


# --------------------------------------------------------------------------- reading an output


class SkeletonOutput:
    """One body's skeleton read back from a ``skeletons`` output (what servers call per request).

    ``location`` is the output folder (path, URL or store), its ``skeletons`` directory, any
    neuroglancer precomputed skeleton directory (sharded or not), or a folder of SWC files
    (``<body>.swc`` or ``<body>_swc``, also under ``swc/``). Opening reads the ``info`` once.
    ``voxel_size`` (nm per scale-0 voxel) is needed for a folder of SWC files that is not in an
    output (SpecError otherwise: their coordinates are in voxels).

    Attributes
    ----------
    voxel_size : tuple of 3 float or None
        nm per scale-0 voxel (the unit of SWC coordinates), from the output's manifest or ``info``.
    """

    def __init__(self, location: Any, *, voxel_size: Any = None):
        store = as_store(location)
        self.where = store.describe("")
        self.voxel_size = None if voxel_size is None else tuple(float(v) for v in voxel_size)
        if self.voxel_size is None:
            try:
                self.voxel_size = tuple((read_manifest(store) or {}).get("parameters", {})["voxel_size"])
            except (KeyError, TypeError, SpecError):
                pass
        info = _json(store, "info")
        if isinstance(info, dict) and isinstance(info.get("skeletons"), str):
            if self.voxel_size is None and info.get("scales"):
                self.voxel_size = tuple(info["scales"][0]["resolution"])
            store = store.child(info["skeletons"])
            info = _json(store, "info")
        self.store = store
        self.info = info if isinstance(info, dict) and info.get("@type") == "neuroglancer_skeletons" else None
        self.swc = None if self.info is not None else (store.child("swc") if store.is_folder_sync("swc") else store)
        if self.swc is not None and self.voxel_size is None:
            raise SpecError(f"{self.where}: SWC files in scale-0 voxels of an unknown size: give voxel_size= (nm)")
        self._kv = None
        if self.info is not None and self.info.get("sharding"):
            import tensorstore as ts

            base = store.kvstore_spec() or {"driver": "file", "path": (store.local_path() or "").rstrip("/") + "/"}
            self._kv = ts.KvStore.open({"driver": "neuroglancer_uint64_sharded", "base": base,
                                        "metadata": self.info["sharding"]}).result()

    def __repr__(self) -> str:
        return f"SkeletonOutput({self.where!r})"

    def get(self, body: int) -> Skeleton | None:
        """The body's skeleton, or None when the output holds none."""
        body = int(body)
        if self.swc is not None:
            for name in (f"{body}.swc", f"{body}_swc"):
                data = self.swc.get_sync(name)
                if data is not None:
                    return Skeleton.from_swc(data, voxel_size=self.voxel_size)
            return None
        assert self.info is not None
        if self._kv is not None:
            data = self._kv.read(body.to_bytes(8, "big")).result().value or None
        else:
            data = self.store.get_sync(str(body))
        if data is None:
            return None
        return Skeleton.decode_precomputed(data, vertex_attributes=self.info.get("vertex_attributes", []),
                                           voxel_size=self.voxel_size)


def _json(store: ByteStore, key: str) -> Any:
    data = store.get_sync(key)
    try:
        return None if data is None else json.loads(data)
    except ValueError:
        raise SpecError(f"{store.describe(key)}: not JSON") from None


# --------------------------------------------------------------------------- public API


def _body_list(bodies: Any) -> np.ndarray:
    """Sorted distinct ids from a sequence or a text file (one id a line; '#' comments, commas ok)."""
    if isinstance(bodies, (str, bytes)) or hasattr(bodies, "__fspath__"):
        try:
            with open(bodies) as f:
                words = f.read().replace(",", " ").split("\n")
        except OSError as e:
            raise SpecError(f"bodies file {bodies}: {e.strerror}") from None
        items: list = [w for line in words for w in line.partition("#")[0].split()]
    else:
        items = list(np.asarray(bodies).reshape(-1).tolist())
    try:
        ids = np.unique(np.asarray([int(v) for v in items], np.uint64))
    except (TypeError, ValueError, OverflowError):
        raise SpecError(f"bodies: give uint64 body ids, got {items[:3]!r}") from None
    if not len(ids) or ids[0] == 0:
        raise SpecError("bodies: give at least one body id (0 is background)")
    return ids


def _make_scale(ds: Dataset, k: int, out: Output, tr: TaskRunner, *, scheduler: Any, resume: bool, overwrite: bool,
                progress: bool | None) -> tuple[Dataset, str | None]:
    """The dataset with scale ``k`` made by ``downsample`` into the work folder when not exported (its
    records carry supervoxels and the export's bodies, so every label source reads it)."""
    if k in ds.exported:
        return ds, None
    from .downsample import downsample

    below = [h for h in ds.exported if h < k]
    if not below:
        ds.require_scale(k)  # NotExportedError: nothing finer to make it from
    made = out.workdir.child("scales")  # type: ignore[union-attr]
    rep = downsample(ds, made, scales=[k], scheduler=tr.client() if tr.distributed else scheduler, resume=resume,
                     overwrite=overwrite, progress=progress, allow_partial=True)
    r = out.report
    r.tasks, r.done, r.skipped, r.task_cpu = r.tasks + rep.tasks, r.done + rep.done, r.skipped + rep.skipped, \
        r.task_cpu + rep.task_cpu
    r.failed.update({f"downsample {item}": msg for item, msg in rep.failed.items()})
    if not rep.complete:
        return ds, None
    return ds.with_scales(made, range(max(below) + 1, k + 1)), f"s{k} made from s{max(below)} by downsample first"


def skeletons(source: Any, dest: Any, *, scale: int | None = None, labels: Any = "agglomerated",
              bodies: Any = None, min_size: int = 0, dust: int = DUST, heal_nm: float | None = None,
              formats: Sequence[str] = ("precomputed",), teasar: dict | None = None, block: int = BLOCK,
              spec: Any = None, scheduler: Any = None, workdir: Any = None, resume: bool = False,
              overwrite: bool = False, progress: bool | None = None, allow_partial: bool = False,
              command: str | None = None) -> JobReport:
    """Skeletonize every body of an export into ``dest``.

    Parameters
    ----------
    source : Dataset or anything ``Dataset`` opens
    dest : path, URL or store
        A new or empty folder, or this job's own earlier output; ``gs://`` and ``s3://`` too.
    scale : int, optional
        The skeleton scale (default: the finest with voxels of at least 32 nm, made by
        ``downsample`` when the export lacks it).
    labels : "agglomerated", "supervoxels" or a mapping
    bodies : sequence of int or path, optional
        Only these bodies (a text file: one id a line); blocks whose label lists hold none of them
        are not read.
    min_size : int
        Bodies of fewer voxels (at the skeleton scale) get no skeleton.
    dust : int
        Connected pieces of at most this many voxels get no tree (kimimaro's ``dust_threshold``).
    heal_nm : float, optional
        Join a body's trees that come closer than this (nm); default: never (as FlyEM's workflow).
    formats : sequence of {"precomputed", "swc", "swc-keys"}
        Sharded precomputed skeletons, ``swc/<body>.swc`` files, ``swc/<body>_swc`` (FlyEM's keys).
    teasar : dict, optional
        kimimaro's ``teasar_params`` (default ``{"scale": 4, "const": 500}``, nm).
    block : int
        Chunks a side of a skeletonized block (default 4: 256³ voxels, ~0.6 GiB in kimimaro).
    spec, scheduler, workdir, resume, overwrite, progress, allow_partial, command :
        As for every job (:mod:`dvidshards.jobs.options`).

    Returns
    -------
    JobReport
        ``totals``: bodies, vertices, blocks, pieces.

    Raises
    ------
    SpecError, OutputError
        Before any work, when the parameters or the destination are not usable.
    JobError
        If the output is incomplete (``allow_partial`` false); ``.report`` is the report.
    """
    ds = source if isinstance(source, Dataset) else Dataset(source, spec=spec)
    formats = tuple(dict.fromkeys(formats))
    if not formats or set(formats) - set(FORMATS):
        raise SpecError(f"formats must be some of {', '.join(FORMATS)}, got {list(formats)}")
    if int(block) < 1 or int(block) > TASK or TASK % int(block) or min_size < 0 or dust < 0 or \
            (heal_nm is not None and not heal_nm > 0):
        raise SpecError(f"block must divide {TASK} (1, 2, 4 or 8 chunks); min_size and dust >= 0; heal_nm > 0")
    scheduler_of(scheduler)
    need_kimimaro()  # before any work: every task needs it
    k = default_scale(ds) if scale is None else ds.scale(scale).index
    s = ds.scale(k)
    res0 = ds.scale(0).resolution
    if s.resolution is None or res0 is None:
        raise SpecError(f"scale {k}: resolution unknown (no spec): skeletons are in nm; give the export's spec")
    if len({int(v) for v in s.chunk_size}) != 1:
        raise SpecError(f"scale {k}: skeletons need cubic chunks, got {list(s.chunk_size)}")
    ids = None if bodies is None else _body_list(bodies)
    src = as_labels(labels)
    if isinstance(src, Mapped):
        src.prepare()
    extent = min(int(s.shard_extent), 1 << 40)
    block = min(int(block), max(1, extent // int(s.chunk_size[0])))  # a block never straddles two shards
    below = max([h for h in ds.exported if h <= k], default=k)
    n_shards = len(ds.shards(below)) if below in ds.exported else 1  # the scale's files, or those it is made from
    bits = max(0, min(16, math.ceil(math.log2(max(n_shards, 1)))))  # about one output shard per source shard
    params: dict = {}
    out = Output(dest, job="skeletons", parameters=params, source=ds, scales=[k], command=command, resume=resume,
                 overwrite=overwrite, workdir=workdir, work=True)
    work = out.workdir
    assert work is not None
    job = SkeletonJob(ds, src, k, work, out.store, bits, formats, int(block), int(dust), int(min_size),
                      None if heal_nm is None else float(heal_nm), dict(TEASAR if teasar is None else teasar),
                      ids is not None, tuple(float(v) for v in res0))
    params.update(job.ident(), bodies=None if ids is None else len(ids))
    notes = [f"skeletons at s{k} ({', '.join(f'{v:g}' for v in s.resolution)} nm)"]
    totals = {"bodies": 0, "vertices": 0, "blocks": 0, "pieces": 0}
    with out, TaskRunner(scheduler, progress=progress) as tr:
        prev = out.previous or {}
        if resume and prev.get("complete"):
            out.report.tasks = out.report.skipped = int((prev.get("tasks") or {}).get("total", 0))
            return out.finish(totals=prev.get("totals") or totals, notes=[*notes, "already complete"],
                              allow_partial=allow_partial)
        tr.check_shared(work)
        if not resume:
            clear_work(work, _own)
        if ids is not None:
            work.put_sync("bodies.u64", ids.astype("<u8").tobytes())
        ds2, made = _make_scale(ds, k, out, tr, scheduler=scheduler, resume=resume, overwrite=overwrite,
                                progress=progress)
        notes += [made] if made else []
        if not out.report.failed:
            job = replace(job, source=ds2)
            tasks = list(plan(job)) if k in ds2.exported else []
            have = set(work.list_sync("cubes")) if resume else set()
            ph = tr.run(run_task, tasks, desc=f"s{k} cubes", done={t for t in tasks if t.key.rpartition("/")[2] in have})
            out.add(ph, name=str)
            for r in ph.results.values():
                totals["blocks"] += r["blocks"]
                totals["pieces"] += r["pieces"]
            files = [t.key for t in tasks if ph.results.get(t, {}).get("pieces") or t in ph.skipped]
            got = None if ph.failed else reduce(out, tr, job, files, resume=resume)
            totals.update(got or {})
        if not out.report.failed and "precomputed" in formats:
            out.store.put_sync("skeletons/info", json.dumps({**PRECOMPUTED_INFO, "sharding":
                                                             job.sharding.to_json()}).encode())
            out.store.put_sync("info", json.dumps(_volume_info(ds)).encode())
        notes.insert(0, f"{totals['bodies']:,} bodies, {totals['vertices']:,} vertices")
        rep = out.finish(totals=totals, notes=notes, allow_partial=True)
    if rep.complete:
        remove_work(work, _own)
    elif not allow_partial:
        raise JobError(rep.summary(), rep)
    return rep


def _own(name: str) -> bool:
    """The names this job keeps in its work folder."""
    return name in ("cubes", "done", "scales", "bodies.u64") or (name[:1] == "L" and name[1:].isdigit())


def _volume_info(ds: Dataset) -> dict:
    """The export's geometry, said to hold skeletons and no voxel chunks."""
    info = ds.info
    for sc in info["scales"]:
        sc.pop("sharding", None)
        sc.pop("inferred", None)
    info["skeletons"] = "skeletons"
    info["dvidshards"] = {"skeletons_only": True, "note": "no voxel chunks are stored here: this dataset holds "
                                                          "skeletons"}
    return info


# --------------------------------------------------------------------------- command line


class SkeletonsCommand:
    """``dvidshards skeletons EXPORT DEST``."""

    @staticmethod
    def add_arguments(p) -> None:
        add_source(p)
        add_dest(p, what="skeletons folder (new or empty)")
        p.add_argument("--scale", type=int, default=None, metavar="K",
                       help=f"skeleton scale (default: the finest with voxels of {TARGET_NM:g} nm or more, made by "
                            f"downsample when the export lacks it)")
        add_labels(p)
        p.add_argument("--format", nargs="+", default=["precomputed"], choices=FORMATS, dest="formats",
                       help="precomputed (sharded, neuroglancer and cloud-volume), swc (swc/<body>.swc), swc-keys "
                            "(swc/<body>_swc, FlyEM's keyvalue keys); several allowed")
        p.add_argument("--bodies", nargs="+", default=None, metavar="ID|FILE",
                       help="only these bodies: ids, or a file of ids (one a line)")
        p.add_argument("--min-size", type=int, default=0, metavar="N", help="skip bodies of fewer voxels")
        p.add_argument("--dust", type=int, default=DUST, metavar="N",
                       help=f"pieces of N voxels or fewer get no tree (default {DUST}, kimimaro's dust_threshold)")
        p.add_argument("--heal-nm", type=float, default=None, metavar="NM",
                       help="join a body's trees closer than NM (default: never, as FlyEM's workflow)")
        p.add_argument("--block", type=int, default=BLOCK, metavar="C",
                       help=f"chunks a side of a skeletonized block (default {BLOCK}; memory ~ C^3; smaller blocks cut "
                            f"TEASAR's 500 nm ball at more faces: more cable than kimimaro on the whole body)")
        add_job_options(p)

    @staticmethod
    def main(args) -> int:
        bodies = args.bodies
        if bodies is not None and len(bodies) == 1 and not bodies[0].isdigit():
            bodies = bodies[0]  # a file
        report = skeletons(args.source, args.dest, spec=args.spec, scale=args.scale, labels=args.labels,
                           bodies=bodies, min_size=args.min_size, dust=args.dust, heal_nm=args.heal_nm,
                           formats=args.formats, block=args.block, allow_partial=True,
                           command=command_line("skeletons", args), **job_options(args))
        print(report.summary())
        return 0 if report.ok else 1
