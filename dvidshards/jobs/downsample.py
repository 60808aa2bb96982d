"""Make the scales an export lacks, the way DVID builds its own pyramid, one task per output shard.

Each scale is made from the one below by DVID's ``downresArray`` (``method="dvid"``) or TensorStore's
``"mode"``, on the supervoxels, in DVID's compressed block domain; each record's bodies come from the
pairs of the records it was made from (or ``labels=``), never from downsampling bodies. DEST is an
export of the made scales as today's DVID writes one, with an ``info`` and a manifest naming the
source (:mod:`dvidshards.pyramid`), the shard files each made scale holds and the scales that are
all background; ``dvidshards.open(DEST)`` reads both as one pyramid. Scale by scale: :func:`plan`,
:func:`run_task` (one output shard written whole), :func:`reduce`. A scale that did not finish stops
the coarser ones; ``resume`` keeps every output shard written whole.
"""

from __future__ import annotations

import itertools
import json
import os
import struct
import tempfile
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import zstandard

from ..dataset import Dataset, shard_origins
from ..errors import BlockDecodeError, MissingShardError, OutputError, SpecError
from ..formats.codec import decode_block, encode_block
from ..formats.downsample import METHODS, downsample_block, region_limit
from ..formats.labels import Agglomerated, LabelSource, Mapped, Supervoxels, as_labels
from ..formats.multiscale import SINGLE_SHARD, Scale
from ..formats.sharding import shard_filename_stem
from ..pyramid import shard_sizes, source_identity
from ..scalefiles import scales_phrase
from ..shard import load_shard_sync
from ..stores import ByteStore, as_store, os_error
from ..writer import write_shard
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
from .output import JobReport, Output, read_manifest
from .runner import TaskRunner, scheduler_of

__all__ = ["SIZES", "DownsampleCommand", "DownsampleTotals", "MadeScales", "Phase", "ShardResult", "Task", "downsample",
           "output_shards", "plan", "reduce", "run_task"]

#: the kernels a task uses, slowest to compile first
KERNELS = ("dvidshards.formats.downsample._down_kernel", "dvidshards.formats.arrowipc._resolve",
           "dvidshards.formats.arrowipc._message")

#: the size of every shard file the scales were made from (the manifest holds their digest and a sample)
SIZES = "_dvidshards.sizes.json"
_MAX_CACHED = 3  # source shards a task keeps loaded besides the current one (unaligned children)
_GROUP = 512  # output blocks whose source records are fetched together (a lazily read shard: ~20 MB)


class MadeScales:
    """This job's own output read back; never layered over the source, so a scale the source also
    holds is read as made here."""

    def __init__(self, store: ByteStore):
        self.store = store

    def shards(self, scale: Scale) -> list[tuple[int, int, int]]:
        return shard_origins(self.store, scale.folder)

    def shard(self, scale: Scale, origin: tuple[int, int, int]) -> Any:
        return load_shard_sync(self.store, scale, origin)


@dataclass(frozen=True)
class Phase:
    """What every task of one output scale needs."""

    read: Dataset | MadeScales  # holds the scale below: the source export, or this job's own output
    below: Scale  # as its files are named
    scale: Scale  # the output scale (today's naming)
    dest: ByteStore
    method: str
    labels: LabelSource
    batch_size: int
    zstd_level: int
    box: tuple | None = None  # ((x0, y0, z0), (x1, y1, z1)) voxels of ``below`` read (the first scale made)


@dataclass(frozen=True)
class Task:
    """One output shard: its voxel origin and the source shards it reads."""

    phase: Phase
    origin: tuple[int, int, int]
    sources: tuple[tuple[int, int, int], ...]

    def name(self) -> str:
        return f"{self.phase.scale.folder}/{shard_filename_stem(self.origin)}"


@dataclass
class ShardResult:
    """What one task did."""

    records_read: int = 0
    records_written: int = 0
    shards_written: int = 0
    blocks_zero: int = 0  # output blocks with every voxel 0, or every body 0: no record (as DVID)
    outside: int = 0  # parents of source records outside the output scale's volume: skipped
    conflicts: int = 0  # supervoxels whose records named different bodies (the first child's kept)
    bytes_written: int = 0

    def add(self, o: ShardResult) -> None:
        for f in fields(ShardResult):
            setattr(self, f.name, getattr(self, f.name) + getattr(o, f.name))

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass
class DownsampleTotals(ShardResult):
    """The tasks' figures summed, and per scale."""

    per_scale: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "per_scale"}
        d["per_scale"] = {str(k): v.to_json() for k, v in self.per_scale.items()}
        return d


# --------------------------------------------------------------------------- plan


def _origins_along(lo: int, hi: int, chunk: int, extent: int) -> range:
    """Shard origins (voxels) of one axis whose shards meet chunks [lo, hi)."""
    e = min(extent, SINGLE_SHARD)
    a = lo * chunk // e * e
    b = (hi - 1) * chunk // e * e
    return range(a, b + 1, e) if e < SINGLE_SHARD else range(0, 1)


def _meets(chunks: np.ndarray, box: tuple, cs: int) -> np.ndarray:
    """Which chunks (n, 3) of ``cs`` voxels meet a voxel box."""
    lo, hi = np.asarray(box[0], np.int64), np.asarray(box[1], np.int64)
    return np.asarray(((chunks * cs < hi) & ((chunks + 1) * cs > lo)).all(axis=-1))


def output_shards(below: Scale, scale: Scale, source_origins: Iterable) -> list[tuple[tuple, tuple]]:
    """``[(output shard origin, (source shard origins, ...)), ...]``, sorted: every output shard a
    parent of a chunk of the source shards falls in, with the source shards it reads."""
    assert below.chunk_size[0] == scale.chunk_size[0]
    c = scale.chunk_size[0]
    gb = np.asarray(below.grid, np.int64)
    g = np.asarray(scale.grid, np.int64)
    tasks: dict[tuple, set] = {}
    for o in source_origins:
        lo, hi = below.shard_box(o)
        hi = np.minimum(hi, gb)
        plo = lo // 2
        phi = np.minimum((hi + 1) // 2, g)
        if (plo >= phi).any():
            continue  # every parent outside the output volume
        axes = [_origins_along(int(plo[a]), int(phi[a]), c, scale.shard_extent) for a in range(3)]
        for out in itertools.product(*axes):
            tasks.setdefault(tuple(int(v) for v in out), set()).add(tuple(int(v) for v in o))
    return [(o, tuple(sorted(tasks[o]))) for o in sorted(tasks)]


def plan(phase: Phase) -> Iterator[Task]:
    """The tasks of one output scale, from the shard files at the scale below (meeting the box)."""
    origins = phase.read.shards(phase.below)
    if phase.box is not None:
        lo, hi = (np.asarray(v, np.int64) for v in phase.box)
        c = phase.below.chunk_size[0]
        boxes = [phase.below.shard_box(o) for o in origins]  # chunks [a, b) of each file
        origins = [o for o, (a, b) in zip(origins, boxes, strict=True) if ((a * c < hi) & (b * c > lo)).all()]
    for origin, sources in output_shards(phase.below, phase.scale, origins):
        yield Task(phase, origin, sources)


# --------------------------------------------------------------------------- one task


class _Sources:
    """The source shards of one task, loaded one at a time (a few kept for unaligned children)."""

    def __init__(self, phase: Phase, origins: Iterable):
        self.phase = phase
        self.origins = {tuple(o) for o in origins}
        self.cache: OrderedDict = OrderedDict()

    def get(self, origin: Iterable) -> Any:
        """The loaded shard at origin (None: no file)."""
        origin = tuple(int(v) for v in origin)
        if origin not in self.origins:
            return None
        if origin in self.cache:
            self.cache.move_to_end(origin)
            return self.cache[origin]
        try:
            entry = self.phase.read.shard(self.phase.below, origin)
        except MissingShardError:
            entry = None
        self.cache[origin] = entry
        while len(self.cache) > _MAX_CACHED + 1:
            self.cache.popitem(last=False)
        return entry


def _crop(block: bytes, chunk: tuple, box: tuple, cs: int) -> bytes | None:
    """A child block with its voxels outside the box set to 0 (None: nothing of it is in the box)."""
    lo = np.asarray(chunk, np.int64) * cs
    a = np.clip(np.asarray(box[0], np.int64) - lo, 0, cs)
    b = np.clip(np.asarray(box[1], np.int64) - lo, 0, cs)
    if (a >= b).any():
        return None
    if (a == 0).all() and (b == cs).all():
        return block
    vol = decode_block(block)  # (z, y, x)
    cut = np.zeros_like(vol)
    inside = (slice(a[2], b[2]), slice(a[1], b[1]), slice(a[0], b[0]))
    cut[inside] = vol[inside]
    return encode_block(cut) if cut.any() else None


def _bodies(svs_out: np.ndarray, children: list, res: ShardResult) -> np.ndarray:
    """Each output supervoxel's body from the children records' (supervoxels, labels) pairs; one
    whose records name different bodies takes the first child's (octant order): ``conflicts``."""
    sv = np.concatenate([c[0] for c in children])
    lab = np.concatenate([c[1] for c in children])
    order = np.argsort(sv, kind="stable")  # equal supervoxels keep the children's order
    s, b = sv[order], lab[order]
    if s.size > 1:
        bad = (s[1:] == s[:-1]) & (b[1:] != b[:-1])
        if bad.any():  # only the supervoxels of the output block count
            res.conflicts += int(np.isin(svs_out, s[1:][bad]).sum())
    pos = np.searchsorted(s, svs_out)  # the first (lowest child) entry of each supervoxel
    return b[pos]


_OCTANTS = np.array([(i & 1, (i >> 1) & 1, i >> 2) for i in range(8)], np.int64)  # x, y, z of child i


def _child(p: list, i: int) -> tuple[int, int, int]:
    return 2 * p[0] + (i & 1), 2 * p[1] + ((i >> 1) & 1), 2 * p[2] + (i >> 2)


def _pack(c: np.ndarray) -> np.ndarray:
    """Chunk coordinates (..., 3) as one int64 key each (21 bits per axis)."""
    return (c[..., 0] << 42) | (c[..., 1] << 21) | c[..., 2]


def _children(sh: Any, o: Any, parents: np.ndarray, below: Scale) -> tuple[np.ndarray, np.ndarray]:
    """Each parent's (m, 3) 8 children's record numbers in shard ``sh`` (-1: absent), and which
    children lie in another source shard (m, 8)."""
    coords = np.asarray(sh.coords, np.int64)
    order = np.argsort(_pack(coords))
    keys = _pack(coords)[order]
    ch = 2 * parents[:, None, :] + _OCTANTS[None, :, :]
    want = _pack(ch)
    pos = np.minimum(np.searchsorted(keys, want), max(len(keys) - 1, 0))
    rec = np.where(keys[pos] == want, order[pos], -1) if len(keys) else np.full(want.shape, -1, np.int64)
    if below.shard_extent < SINGLE_SHARD:
        per = below.shard_extent // below.chunk_size[0]
        home = np.asarray(o, np.int64) // below.chunk_size[0] // per
        other = (ch // per != home).any(axis=2)
    else:
        other = np.zeros(want.shape, bool)
    return rec, other


@dataclass
class _Work:
    """One task's constants and running state."""

    phase: Phase
    sources: _Sources
    res: ShardResult
    lo: np.ndarray  # the output shard's chunk box
    box_hi: np.ndarray
    hi: np.ndarray  # ... cut to the output volume
    cctx: zstandard.ZstdCompressor
    grid: bytes  # a block header's grid for the scale's chunks
    done: set = field(default_factory=set)  # output blocks made (or counted) already


def _records(phase: Phase, origin: Any, sources: _Sources, res: ShardResult) -> Iterator[dict]:
    """The output shard's records, source shard by source shard (each output block once)."""
    scale = phase.scale
    lo, box_hi = scale.shard_box(origin)
    task = _Work(phase, sources, res, lo, box_hi, np.minimum(box_hi, scale.grid),
                 zstandard.ZstdCompressor(level=phase.zstd_level, write_checksum=True, write_content_size=True),
                 struct.pack("<3I", *(v // 8 for v in phase.below.chunk_size)))
    for o in sorted(sources.origins):
        yield from _shard_records(task, o)
        # done with it (a later shard needing it loads it anew): a task holds one source shard at a time
        sources.cache.pop(o, None)


def _shard_records(task: _Work, o: Any) -> Iterator[dict]:
    """The records of the output blocks first met in source shard ``o``."""
    sources, res, done = task.sources, task.res, task.done
    sh = sources.get(o)
    if sh is None:
        return
    coords = np.asarray(sh.coords, np.int64)
    if task.phase.box is not None:  # only the records of chunks that meet the box
        coords = coords[_meets(coords, task.phase.box, task.phase.below.chunk_size[0])]
    parents = np.unique(coords // 2, axis=0)
    mine = ((parents >= task.lo) & (parents < task.box_hi)).all(axis=1)  # this output shard's (volume or not)
    off = mine & (parents >= task.hi).any(axis=1)  # past the output volume: counted once, skipped
    for key in map(tuple, parents[off].tolist()):
        if key not in done:
            done.add(key)
            res.outside += 1
    parents = parents[mine & ~off]
    parents = parents[np.lexsort((parents[:, 0], parents[:, 1], parents[:, 2]))]  # z, y, x order
    recs, others = _children(sh, o, parents, task.phase.below)
    for g in range(0, len(parents), _GROUP):  # the records of a group of output blocks at a time
        rows = np.unique(recs[g:g + _GROUP][recs[g:g + _GROUP] >= 0])
        table = sh.table(rows)
        at = np.searchsorted(rows, recs[g:g + _GROUP])  # record number -> row of table
        yield from _group_records(task, parents[g:g + _GROUP], recs[g:g + _GROUP], at, others[g:g + _GROUP], table)


def _group_records(task: _Work, parents: np.ndarray, recs: np.ndarray, at: np.ndarray, others: np.ndarray,
                   table: Any) -> Iterator[dict]:
    """The records of a group of output blocks: ``recs`` their children's record numbers in this
    source shard (-1: absent), ``at`` their rows in ``table``, ``others`` children in another shard."""
    phase, sources, res, done = task.phase, task.sources, task.res, task.done
    below = phase.below
    c = phase.scale.chunk_size[0]
    mode = phase.method == "mode"
    agglomerated = isinstance(phase.labels, Agglomerated)
    for p, rec, row, other in zip(parents.tolist(), recs.tolist(), at.tolist(), others.tolist(), strict=True):
        key = tuple(p)
        if key in done:
            continue
        done.add(key)
        kids: list = [None] * 8
        pairs = []
        for i in range(8):
            t = table
            j = row[i]
            if other[i]:  # a child in another source file (extents not multiples of 128 voxels)
                ch = _child(p, i)
                src = sources.get(below.shard_origin(*ch))
                r = src.find(*ch) if src is not None else None
                if r is None:
                    continue
                t = src.table([r])
                j = 0
            elif rec[i] < 0:
                continue
            kids[i] = t.block(j)  # zstd, sizes, checksum, label list == supervoxels checked
            if phase.box is not None:
                kids[i] = _crop(kids[i], _child(p, i), phase.box, below.chunk_size[0])
                if kids[i] is None:
                    continue
            if agglomerated:
                pairs.append((t.supervoxels(j), t.labels(j)))
            res.records_read += 1
        lim = region_limit([2 * c * v for v in p], below.size, below.chunk_size) if mode else None
        try:
            out = downsample_block(kids, method=phase.method, limit=lim)
        except BlockDecodeError:  # again, with each child named by its file and chunk
            downsample_block(kids, method=phase.method, limit=lim, names=_names(p, sources, below))
            raise
        if out is None:
            res.blocks_zero += 1
            continue
        if out.block[:12] != task.grid:  # blocks of another size than the scale's chunks
            raise BlockDecodeError(f"{_names(p, sources, below)[next(i for i in range(8) if kids[i])]}: its "
                                   f"block is {'x'.join(str(8 * v) for v in struct.unpack('<3I', out.block[:12]))} "
                                   f"voxels, not the scale's {'x'.join(map(str, below.chunk_size))} chunks")
        svs = out.supervoxels
        if agglomerated:
            bodies = _bodies(svs, pairs, res)
        elif isinstance(phase.labels, Supervoxels):
            bodies = svs.copy()
        else:
            assert isinstance(phase.labels, Mapped)
            bodies = phase.labels.mapping.palette(svs)
        if not bodies.any():  # DVID skips blocks whose bodies are all 0
            res.blocks_zero += 1
            continue
        payload = task.cctx.compress(out.block)
        res.records_written += 1
        res.bytes_written += len(payload)
        yield {"chunk_x": p[0], "chunk_y": p[1], "chunk_z": p[2], "labels": bodies, "supervoxels": svs,
               "dvid_compressed_block": payload, "uncompressed_size": len(out.block)}


def _names(p: list, sources: _Sources, below: Scale) -> list[str]:
    """Each child of parent p named by its file and chunk (for an error message)."""
    names = []
    for i in range(8):
        ch = _child(p, i)
        src = sources.get(below.shard_origin(*ch))
        j = src.find(*ch) if src is not None else None
        names.append(src.where(j) if j is not None else f"{below.folder}: chunk {ch}")
    return names


def run_task(task: Task) -> ShardResult:
    """Make one output shard and write it (no file when it is all background, as DVID)."""
    phase = task.phase
    res = ShardResult()
    records = _records(phase, task.origin, _Sources(phase, task.sources), res)
    first = next(records, None)
    if first is None:
        return res
    rel = f"{phase.scale.folder}/{shard_filename_stem(task.origin)}"
    path = phase.dest.local_path(rel)
    if path is not None:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        except OSError as e:
            raise os_error(e, os.path.dirname(path), "make the folder") from None
        write_shard(path, itertools.chain([first], records), batch_size=phase.batch_size, index="A")
    else:  # a bucket: built in a local temporary folder, then published index first (an index alone is no shard)
        with tempfile.TemporaryDirectory(prefix="dvidshards-downsample-") as folder:
            stem = os.path.join(folder, "shard")
            write_shard(stem, itertools.chain([first], records), batch_size=phase.batch_size, index="A")
            for ext in (".csv", ".arrow"):
                with open(stem + ext, "rb") as f:
                    phase.dest.put_sync(rel + ext, f.read())
    res.shards_written = 1
    return res


# --------------------------------------------------------------------------- reduce


def reduce(results: Iterable[ShardResult], totals: DownsampleTotals, k: int) -> None:
    """Sum one scale's task results into the totals."""
    per = totals.per_scale.setdefault(k, ShardResult())
    for r in results:
        per.add(r)
        totals.add(r)


def _notes(totals: DownsampleTotals, method: str, made: list[int], start: int, added: list[int],
           background: list[int]) -> list[str]:
    lines = [f"scales {', '.join(f's{k}' for k in made)} made from s{start} ({method} rule): "
             f"{totals.records_written:,} records in {totals.shards_written:,} shards from {totals.records_read:,} "
             f"records read"]
    if added:
        lines.append(f"also made {', '.join(f's{k}' for k in added)}: each scale is made from the one below")
    if background:
        lines.append(f"{scales_phrase(background)}: every block is background (0), so no shard file holds them; "
                     f"reads give 0 there")
    if totals.conflicts:
        lines.append(f"{totals.conflicts:,} times the source records of an output block named different bodies "
                     f"for one supervoxel (an export written while bodies changed?); the first record's (octant "
                     f"order) was kept")
    if totals.outside:
        lines.append(f"{totals.outside:,} output blocks fell outside the spec's volume and were skipped")
    return lines


# --------------------------------------------------------------------------- the job


def _labels_of(labels: Any) -> LabelSource:
    src = as_labels("agglomerated" if labels is None else labels)
    if isinstance(src, Mapped):
        src.prepare()  # a bad file fails here, before any work
    return src


def _own(name: str) -> bool:
    return name in ("info", SIZES) or (name[:1] == "s" and name[1:].isdigit())


def _scales_to_make(ds: Dataset, scales: Any) -> tuple[int, list[int], list[int]]:
    """(the scale the first is made from, the scales to make, the scales asked), checked."""
    held = set(ds.exported)
    wanted = scales_of(scales)
    if wanted is None:
        wanted = [s.index for s in ds.scales if s.index not in held and any(h < s.index for h in held)]
        if not wanted:
            raise SpecError(f"{ds.store.describe('')} holds every scale its spec lists below its coarsest "
                            f"({scales_phrase(held)}); nothing to make (--scales to make some again)")
    for k in wanted:
        ds.scale(k)  # a scale the spec does not list: SpecError naming the ones it does
    start = max((h for h in held if h < min(wanted)), default=None)
    if start is None:
        raise SpecError(f"scale {min(wanted)} is made from scale {min(wanted) - 1}, which "
                        f"{ds.store.describe('')} does not hold (it holds {scales_phrase(held)})")
    made = list(range(start + 1, max(wanted) + 1))
    for k in [start, *made]:
        s = ds.scale(k)
        if s.chunk_size != ds.scale(start).chunk_size or len(set(s.chunk_size)) != 1 or s.chunk_size[0] % 16:
            raise SpecError(f"scale {k}: chunks {s.chunk_size}; downsample needs the same cubic chunks (a multiple of "
                            f"16 voxels) at every scale")
        if any(s.voxel_offset):
            raise SpecError(f"scale {k}: voxel_offset {list(s.voxel_offset)}; downsample needs scales at the origin")
        if k in made and s.sharding is None:
            raise SpecError(f"scale {k}: the spec gives no sharding, so its shard files cannot be named")
    return start, made, wanted


def downsample(source: Any, dest: Any, *, scales: Iterable[int] | None = None, method: str = "dvid",
               labels: Any = "agglomerated", box: Any = None, spec: Any = None, scheduler: Any = None,
               resume: bool = False, overwrite: bool = False, progress: bool | None = None,
               allow_partial: bool = False, zstd_level: int = 3, batch_size: int | None = None,
               command: str | None = None, _stop_after: int | None = None, _only: Any = None) -> JobReport:
    """Make the scales an export lacks (or ``scales``), each from the one below, into ``dest``.

    Parameters
    ----------
    source : str, path, URL, store or dvidshards.Dataset
        The export (a downsample output too: its pyramid is read whole).
    dest : str, path, URL, kvstore spec dict or store
        A folder, ``gs://…`` or ``s3://…``: empty, or this job's own earlier output.
    scales : list of int, optional
        The scales to make (default: those the spec lists and the export lacks); the scales
        between the one below the first and the last are made too.
    method : {"dvid", "mode"}
        DVID's rule (default) or TensorStore's ``"mode"``.
    labels : "agglomerated", "supervoxels" or a mapping
        The records' bodies: the source records' own pairs (default), the supervoxels, or a mapping.
    box : [[x0, y0, z0], [x1, y1, z1]], optional
        Scale-0 voxels: the pyramid of the export cut to the box (0 outside it).
    spec : dict or path, optional
        The neuroglancer spec DVID was given (default: the export's ``info``).
    scheduler, resume, overwrite, progress, allow_partial :
        As for every job. No work folder: a task writes whole shards (for a bucket, built in
        the system's temporary folder first).
    zstd_level, batch_size : int
        Of the output (default batch: the spec's ``batch_size``, as DVID writes).

    Returns
    -------
    JobReport
        ``totals`` is a :class:`DownsampleTotals`.

    Raises
    ------
    SpecError, OutputError
        Before any work: no spec, a scale it does not list, nothing below to start from, chunks
        that differ, a box outside the volume, a destination that cannot be used.
    JobError
        The output is incomplete and ``allow_partial`` is false (``.report`` is the report).
    """
    if method not in METHODS:
        raise SpecError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if resume and overwrite:
        raise SpecError("give resume or overwrite, not both")
    if isinstance(zstd_level, bool) or not isinstance(zstd_level, int) or not 1 <= zstd_level <= 22:
        raise SpecError(f"zstd_level must be an integer 1..22, got {zstd_level!r}")
    scheduler_of(scheduler)
    store = as_store(dest, writable=True)
    ds = source if isinstance(source, Dataset) else Dataset(source, spec=spec)
    if ds.spec is None or any(s.inferred for s in ds.scales):
        raise SpecError(f"{ds.store.describe('')}: give the neuroglancer spec DVID was given (--spec): the scales "
                        f"to make and their shard sizes come from it")
    src_labels = _labels_of(labels)
    start, made, wanted = _scales_to_make(ds, scales)
    if len(made) > 1 and store.describe("").startswith("memory://"):
        raise SpecError(f"{store.describe('')}: a memory:// destination is seen by this process only, so it "
                        f"cannot hold scales made from each other ({scales_phrase(made)}); write to a folder or a "
                        f"bucket")
    base = ds.scale(start)
    asked = box_of(box)
    cut: tuple | None = None  # the box in voxels of the scale the first made scale is made from
    if asked is not None:
        lo, hi = ds.scale(0).check_box(asked)  # SpecError for a box outside the volume
        cut = (tuple(int(v) >> start for v in lo), tuple(-(-int(v) // 2 ** start) for v in hi))
    batch = batch_size if batch_size is not None else ds.spec.get("batch_size", 1)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise SpecError(f"batch_size must be a positive integer, got {batch!r}")
    params = {"method": method, "scales": made, "from": start, "zstd_level": zstd_level, "batch_size": batch,
              "box": None if asked is None else [list(v) for v in asked], **src_labels.identity()}
    sizes = shard_sizes(ds.store, base, ds.shards(start)) if isinstance(ds.store, ByteStore) else None
    ident = None if sizes is None else source_identity(start, sizes)

    def phase_of(k: int) -> Phase:
        read, below = (ds, base) if k - 1 == start else (MadeScales(store), ds.scale(k - 1).with_naming("current"))
        return Phase(read, below, ds.scale(k).with_naming("current"), store, method, src_labels, batch, zstd_level,
                     cut if k - 1 == start else None)

    first = list(plan(phase_of(made[0])))
    if resume and sizes is not None:
        _check_kept(store, sizes, first, made)
    totals = DownsampleTotals()
    files: dict[str, int] = {}  # shard files each made scale holds (verify counts them)
    with Output(store, job="downsample", parameters=params, source=source, identity=ident, scales=made,
                command=command, resume=resume, overwrite=overwrite, own=_own) as out:
        store.put_sync("info", (json.dumps(ds.spec, indent=1) + "\n").encode())
        if sizes is not None:
            store.put_sync(SIZES, (json.dumps(sizes, separators=(",", ":")) + "\n").encode())
        stopped, ran = None, 0
        with TaskRunner(scheduler, progress=progress) as tr:
            for k in made:
                tasks = first if k == made[0] else list(plan(phase_of(k)))
                folder = ds.scale(k).folder
                done = _kept(store, folder, tasks) if resume else []
                run = tasks if _only is None else [t for t in tasks if (k, t.origin) in _only]  # benchmarks
                if _stop_after is not None:  # tests: as if the job were killed after this many tasks
                    run = tasks[:max(0, _stop_after - ran)]
                ph = tr.run(run_task, run, done=done, desc=f"{folder} shards", kernels=KERNELS)
                ran += len(ph.results)
                out.add(ph, name=Task.name)
                out.report.tasks += len(tasks) - len(run)
                reduce(ph.results.values(), totals, k)
                if ph.failed or (len(run) < len(tasks) and _only is None):
                    stopped = k
                    break
                files[str(k)] = len(done) + totals.per_scale[k].shards_written
        background = [int(k) for k, n in files.items() if not n]
        notes = _notes(totals, method, made, start, [k for k in made if k not in wanted], background)
        if stopped is not None and stopped != made[-1]:
            rest = [f"s{k}" for k in made if k > stopped]
            notes.append(f"{', '.join(rest)} not made: s{stopped} is incomplete (--resume finishes it, then them)")
        out.update(background=background, files=files)
        return out.finish(totals=totals, notes=notes, complete=stopped is None and _only is None,
                          allow_partial=allow_partial)


def _kept(store: ByteStore, folder: str, tasks: list[Task]) -> list[Task]:
    """The tasks whose output shard (index and file) an earlier run wrote."""
    names = set(store.list_sync(folder))
    return [t for t in tasks if {f"{shard_filename_stem(t.origin)}{e}" for e in (".arrow", ".csv")} <= names]


def _check_kept(store: ByteStore, sizes: dict, first: list[Task], made: list[int]) -> None:
    """Refuse a resume when a shard file the earlier run made kept shards from has changed (one
    repaired where its tasks failed is fine: nothing made from it is kept)."""
    m = read_manifest(store)
    if m is None or m.get("job") != "downsample":
        return
    try:
        before = json.loads(store.get_sync(SIZES) or b"{}")
    except ValueError:
        before = {}
    changed = {k for k in set(before) | set(sizes) if before.get(k) != sizes.get(k)}
    if not changed:
        return
    below = first[0].phase.below if first else None
    bad = [t for t in _kept(store, f"s{made[0]}", first)
           if below is not None and any(below.stem(o) + ".arrow" in changed for o in t.sources)]
    later = [k for k in made[1:] if store.list_sync(f"s{k}")]
    if bad or later:
        what = f"{bad[0].name()} was made from it" if bad else f"s{later[0]} was made from the scales it gave"
        key = sorted(changed)[0]
        raise OutputError(f"{store.describe('')}: the export it is made from has changed since the earlier run "
                          f"({len(changed):,} shard files, e.g. {key}), and {what}: resuming would mix two exports; "
                          f"pass --overwrite to make the scales again")


# --------------------------------------------------------------------------- command line


class DownsampleCommand:
    """``dvidshards downsample EXPORT DEST``."""

    @staticmethod
    def add_arguments(p: Any) -> None:
        add_source(p)
        add_dest(p, what="output: the made scales as a DVID export (empty, or this job's own earlier output)")
        add_scales(p, help="scales to make (default: every scale the spec lists that the export lacks)")
        p.add_argument("--method", choices=METHODS, default="dvid",
                       help="dvid: DVID's own pyramid rule, the most frequent non-zero supervoxel (default); mode: "
                            "TensorStore's mode (0 counts like any id)")
        add_labels(p)
        add_box(p, help="make the pyramid of the box X0 Y0 Z0 X1 Y1 Z1 only (scale-0 voxels; 0 outside it)")
        p.add_argument("--batch-size", type=int, default=None, metavar="N",
                       help="records per Arrow record batch of the output shards (default: the spec's batch_size)")
        add_job_options(p, workdir=False)

    @staticmethod
    def main(args: Any) -> int:
        """0: the output is complete; 1: it is not."""
        skip = [k for k, v in (("method", "dvid"), ("labels", "agglomerated")) if getattr(args, k) == v]
        report = downsample(args.source, args.dest, scales=args.scales, method=args.method, labels=args.labels,
                            box=args.box, spec=args.spec, batch_size=args.batch_size, allow_partial=True,
                            command=command_line("downsample", args, skip=skip), **job_options(args, workdir=False))
        print(report.summary())
        return 0 if report.ok else 1
