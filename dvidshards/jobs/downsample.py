"""Make the scales an export lacks, the way DVID builds its own pyramid, one task per output shard.

``downsample(source, dest)`` (and ``dvidshards downsample EXPORT DEST``) makes the scales the spec
lists that the export does not hold (or ``scales=``), each from the one below: the first from the
coarsest scale the export holds below it, every other from the scale this job has just made. The
rule is DVID's ``downresArray`` (``method="dvid"``: per 2x2x2 cell the most frequent non-zero
supervoxel, 0 only when all eight are 0, ties to the smaller id) or TensorStore's ``"mode"``
(:mod:`dvidshards.formats.downsample`), applied to the supervoxels, in DVID's compressed block
domain. Each record's ``labels`` are the supervoxel -> body mapping applied to its downsampled
supervoxels: the (supervoxels, labels) pairs of the records it was made from, or ``labels=`` a
mapping file; never a downsampling of bodies.

DEST is an export of the made scales only, laid out as today's DVID writes one: folders ``s{k}``,
shard files named by the current naming generation, CSV index variant A, record batches of the
spec's ``batch_size``, all-zero blocks (bodies all 0) skipped; plus an ``info`` file (the spec of
the whole pyramid) and the job manifest ``_dvidshards.json`` (``"job": "downsample"``, the source's
URL, the made scales, ``complete``), through which ``dvidshards.open(dest)`` / ``Dataset(dest)``
read source and destination as one pyramid. It stands on :mod:`dvidshards.jobs.output`: the
destination is parsed and checked before any work (a path, ``gs://`` or ``s3://``), locked while
written, refused unless empty or this job's own earlier output (``resume``/``overwrite``).

The job reads as plan -> tasks -> reduce:

* **plan** (:func:`plan_scale`): from the shard files present at the scale below, the output
  shards their chunks' parents fall in, each with the source shards it reads (usually one:
  where extents are multiples of 128 voxels an output block's 8 children lie in one source
  file; elsewhere, e.g. the 64-voxel files of DVID's old naming, a child is read from the file
  that holds it). One item per output shard: nothing on the client grows with chunks.
* **task** (:func:`downsample_shard`): the source shards one at a time (a task holds one loaded
  source shard, a few in the rare unaligned case), each output block from its children's zstd
  payloads through the kernel, zstd again, and streamed into the output shard file
  (``writer.write_shard``; a shard appears only once written whole).
* **reduce** (:func:`reduce_results`): the tasks' small counts summed into the report.

Scales are made in order; a scale whose tasks did not all succeed stops the coarser ones
(``resume`` finishes both). ``resume`` keeps every output shard already written whole.
"""

from __future__ import annotations

import itertools
import os
import shutil
import struct
import tempfile
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import zstandard

from ..dataset import Dataset
from ..errors import BlockDecodeError, MissingShardError, SpecError
from ..formats.downsample import METHODS, downsample_block, region_limit
from ..formats.labels import Agglomerated, LabelSource, Mapped, Supervoxels, as_labels
from ..formats.multiscale import SINGLE_SHARD, Scale, multiscale_info
from ..formats.sharding import shard_filename_stem
from ..shard import load_shard_sync, parse_shard_names
from ..stores import as_store
from ..writer import write_shard
from .options import (
    add_dest,
    add_job_options,
    add_labels,
    add_scales,
    add_source,
    command_line,
    dest_of,
    job_options,
    scales_of,
)
from .output import Destination, JobReport, Output
from .runner import TaskRunner, scheduler_of

__all__ = ["DownsampleCommand", "DownsampleTotals", "MadeScales", "Phase", "ShardResult", "add_arguments", "downsample", "downsample_shard", "main",
           "plan_scale", "reduce_results"]

#: the kernels a task uses, slowest to compile first (TaskRunner.run compiles them first)
KERNELS = ("dvidshards.formats.downsample._down_kernel", "dvidshards.formats.arrowipc._resolve",
           "dvidshards.formats.arrowipc._message")

_MAX_CACHED = 3  # source shards a task keeps loaded besides the current one (unaligned children)
_GROUP = 512  # output blocks whose source records are fetched together (a lazily read shard: ~20 MB)


# --------------------------------------------------------------------------- what a task carries


class MadeScales:
    """This job's own output, read back (the scale below each scale it makes) through the shard loader.

    Never layered over the source (as ``Dataset(dest)`` is): a scale the source also holds is read
    as this job made it. Pickles as its store.
    """

    def __init__(self, store):
        self.store = store

    def __reduce__(self):
        return (MadeScales, (self.store,))

    def shards(self, scale: Scale) -> list[tuple[int, int, int]]:
        """Origins of the shard files of a made scale."""
        return parse_shard_names(self.store.list_sync(scale.folder))

    def shard(self, scale: Scale, origin):
        """The loaded shard (MissingShardError when no file is there)."""
        return load_shard_sync(self.store, scale, origin)


@dataclass(frozen=True)
class Phase:
    """What every task of one output scale needs (pickled with each task: paths, geometry, options).

    :func:`downsample` makes one per scale; a benchmark or a custom scheduler can make one and call
    :func:`downsample_shard` with the items of :func:`plan_scale`.
    """

    read: Dataset | MadeScales  # holds the scale below: the source export, or this job's own output
    below: Scale  # the scale below, as its files are named
    scale: Scale  # the output scale (today's naming)
    dest: Destination
    method: str
    labels: LabelSource
    batch_size: int
    zstd_level: int
    staging: str | None  # a local folder for shards bound for a bucket (None: a temporary one)


@dataclass
class ShardResult:
    """What one task did (small: it travels back from the worker)."""

    records_read: int = 0
    records_written: int = 0
    shards_written: int = 0
    blocks_zero: int = 0  # output blocks with every voxel 0, or every body 0: no record (as DVID)
    outside: int = 0  # parents of source records outside the output scale's volume: skipped
    conflicts: int = 0  # supervoxels whose records named different bodies (the first child's kept)
    bytes_written: int = 0

    def add(self, o: ShardResult) -> None:
        for k in ("records_read", "records_written", "shards_written", "blocks_zero", "outside", "conflicts",
                  "bytes_written"):
            setattr(self, k, getattr(self, k) + getattr(o, k))

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass
class DownsampleTotals(ShardResult):
    """The tasks' figures summed, per scale as well."""

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


def plan_scale(below: Scale, scale: Scale, source_origins) -> list[tuple[tuple[int, int, int], tuple]]:
    """The tasks of one output scale: ``[(output shard origin, (source shard origins, ...)), ...]``.

    ``source_origins`` are the shard files present at the scale below (``below``, named as its
    files are). Every output shard that a parent of one of their chunks falls in gets one task,
    reading the source shards whose chunks' parents fall in it. Sorted by output origin.
    """
    cb = below.chunk_size[0]
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
    assert cb == c
    return [(o, tuple(sorted(tasks[o]))) for o in sorted(tasks)]


# --------------------------------------------------------------------------- one task


class _Sources:
    """The source shards of one task, loaded one at a time (a few kept for unaligned children)."""

    def __init__(self, phase: Phase, origins):
        self.phase = phase
        self.origins = {tuple(o) for o in origins}
        self.cache: OrderedDict = OrderedDict()

    def get(self, origin):
        """The loaded shard at origin (None when no file is there)."""
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


def _bodies(svs_out: np.ndarray, children, res: ShardResult) -> np.ndarray:
    """Each output supervoxel's body from the children records' (supervoxels, labels) pairs.

    A supervoxel whose records name different bodies takes the first child's (octant order),
    and is counted in ``conflicts``.
    """
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


def _pack(c: np.ndarray) -> np.ndarray:
    """Chunk coordinates (..., 3) as one int64 key each (21 bits per axis)."""
    return (c[..., 0] << 42) | (c[..., 1] << 21) | c[..., 2]


def _children(sh, o, parents: np.ndarray, below: Scale) -> tuple[np.ndarray, np.ndarray]:
    """For each parent (m, 3): its 8 children's record numbers in shard ``sh`` (-1: not there), and
    which children lie in another source shard (m, 8)."""
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
class _Task:
    """One task's constants and running state (the output shard, its sources, the counts)."""

    phase: Phase
    sources: _Sources
    res: ShardResult
    lo: np.ndarray  # the output shard's chunk box
    box_hi: np.ndarray
    hi: np.ndarray  # ... cut to the output volume
    cctx: zstandard.ZstdCompressor
    grid: bytes  # a block header's grid for the scale's chunks
    done: set = field(default_factory=set)  # output blocks made (or counted) already


def _records(phase: Phase, origin, sources: _Sources, res: ShardResult):
    """The output shard's records, source shard by source shard (each output block once)."""
    scale = phase.scale
    lo, box_hi = scale.shard_box(origin)
    task = _Task(phase, sources, res, lo, box_hi, np.minimum(box_hi, scale.grid),
                 zstandard.ZstdCompressor(level=phase.zstd_level, write_checksum=True, write_content_size=True),
                 struct.pack("<3I", *(v // 8 for v in phase.below.chunk_size)))
    for o in sorted(sources.origins):
        yield from _shard_records(task, o)
        # done with it (a later shard needing it loads it anew): a task holds one source shard at a time
        sources.cache.pop(o, None)


def _shard_records(task: _Task, o):
    """The records of the output blocks first met in source shard ``o``."""
    sources, res, done = task.sources, task.res, task.done
    sh = sources.get(o)
    if sh is None:
        return
    parents = np.unique(np.asarray(sh.coords, np.int64) // 2, axis=0)
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


def _group_records(task: _Task, parents, recs, at, others, table):
    """The records of a group of output blocks whose children's records (of this source shard) are
    in ``table``: ``recs`` their record numbers in the shard (-1: absent), ``at`` their rows in
    ``table``, ``others`` the children in another source shard."""
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
                ch = (2 * p[0] + (i & 1), 2 * p[1] + ((i >> 1) & 1), 2 * p[2] + (i >> 2))
                src = sources.get(below.shard_origin(*ch))
                r = src.find(*ch) if src is not None else None
                if r is None:
                    continue
                t = src.table([r])
                j = 0
            elif rec[i] < 0:
                continue
            kids[i] = t.block(j)  # zstd, sizes, checksum, label list == supervoxels checked
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


def _names(p, sources: _Sources, below: Scale) -> list[str]:
    """Each child of parent p named by its file and chunk (for an error message)."""
    names = []
    for i in range(8):
        ch = (2 * p[0] + (i & 1), 2 * p[1] + ((i >> 1) & 1), 2 * p[2] + (i >> 2))
        src = sources.get(below.shard_origin(*ch))
        j = src.find(*ch) if src is not None else None
        names.append(src.where(j) if j is not None else f"{below.folder}: chunk {ch}")
    return names


def downsample_shard(phase: Phase, item) -> ShardResult:
    """Make one output shard: ``item`` is (output shard origin, source shard origins)."""
    origin, source_origins = item
    res = ShardResult()
    sources = _Sources(phase, source_origins)
    records = _records(phase, origin, sources, res)
    first = next(records, None)
    if first is None:  # nothing but background: no file (DVID writes none)
        return res
    stem = shard_filename_stem(origin)
    rel = f"{phase.scale.folder}/{stem}"
    dest = phase.dest
    if dest.local:
        dest.makedirs(phase.scale.folder)
        write_shard(dest.local_path(rel), itertools.chain([first], records), batch_size=phase.batch_size,
                    index="A")
    else:  # a bucket: built in a local folder, then published index first (an index alone is no shard)
        if phase.staging is not None:
            os.makedirs(phase.staging, exist_ok=True)
        folder = tempfile.mkdtemp(prefix="dvidshards-downsample-", dir=phase.staging)
        try:
            write_shard(os.path.join(folder, stem), itertools.chain([first], records), batch_size=phase.batch_size,
                        index="A")
            for ext in (".csv", ".arrow"):
                with open(os.path.join(folder, stem + ext), "rb") as f:
                    dest.write(rel + ext, f.read())
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    res.shards_written = 1
    return res


# --------------------------------------------------------------------------- reduce


def _task_name(folder: str, item) -> str:
    return f"{folder}/{shard_filename_stem(item[0])}"


def reduce_results(results, totals: DownsampleTotals, k: int) -> None:
    """Sum one scale's task results into the totals."""
    per = totals.per_scale.setdefault(k, ShardResult())
    for r in results:
        per.add(r)
        totals.add(r)


def _notes(totals: DownsampleTotals, method: str, made: list[int], start: int, added: list[int]) -> list[str]:
    lines = [f"scales {', '.join(f's{k}' for k in made)} made from s{start} ({method} rule): "
             f"{totals.records_written:,} records in {totals.shards_written:,} shards from {totals.records_read:,} "
             f"records read"]
    if added:
        lines.append(f"also made {', '.join(f's{k}' for k in added)}: each scale is made from the one below")
    if totals.conflicts:
        lines.append(f"{totals.conflicts:,} times the source records of an output block named different bodies "
                     f"for one supervoxel (an export written while bodies changed?); the first record's (octant "
                     f"order) was kept")
    if totals.outside:
        lines.append(f"{totals.outside:,} output blocks fell outside the spec's volume and were skipped")
    return lines


# --------------------------------------------------------------------------- the job


def _labels_of(labels) -> LabelSource:
    if labels is None:
        return Agglomerated()
    src = as_labels(labels)
    if isinstance(src, Mapped):
        src.prepare()  # a bad file fails here, before any work
    return src


def _source_url(source, ds: Dataset):
    """What the manifest names as the source: the user's path or URL (a Dataset: its root)."""
    if isinstance(source, (str, os.PathLike)):
        return source
    return ds


def downsample(source, dest, *, scales=None, method: str = "dvid", labels=None, spec=None, scheduler=None,
               workdir=None, resume: bool = False, overwrite: bool = False, progress: bool | None = None,
               allow_partial: bool = False, zstd_level: int = 3, batch_size: int | None = None,
               command: str | None = None, _stop_after: int | None = None, _only=None) -> JobReport:
    """Make the scales an export lacks (or ``scales``), each from the one below, into ``dest``.

    Parameters
    ----------
    source : str, path, URL or dvidshards.Dataset
        The export (it may itself be a downsample output: its pyramid is read whole).
    dest : str, path, URL or kvstore spec dict
        A folder, ``gs://…`` or ``s3://…``: empty, or this job's own earlier output. Never inside
        the source.
    scales : list of int, optional
        The scales to make (default: every scale the spec lists that the export does not hold).
        The scales between the one below the first and the last are made too.
    method : {"dvid", "mode"}
        DVID's rule (default) or TensorStore's ``"mode"``.
    labels : None, "agglomerated", "supervoxels" or a mapping
        The records' ``labels``: the source records' own supervoxel -> body pairs (default), the
        supervoxel ids, or a mapping (file or object) applied to the supervoxels.
    spec : dict or path, optional
        The neuroglancer spec DVID was given (default: the export's ``info``); it must list the
        scales to make.
    scheduler, workdir, resume, overwrite, progress, allow_partial :
        As for every job (:mod:`dvidshards.jobs.options`). ``workdir`` is where shards bound for a
        bucket are staged (default: a temporary folder).
    zstd_level : int
        zstd level of the output payloads (frames with content size and checksum, as DVID's).
    batch_size : int, optional
        Records per Arrow record batch of the output shards (default: the spec's ``batch_size``, as
        DVID writes; 1 when it has none). One batch per record costs ~0.5 ms to write.
    command : str, optional
        The command line, for the manifest.

    Returns
    -------
    JobReport
        ``totals`` is a :class:`DownsampleTotals`.

    Raises
    ------
    SpecError, OutputError
        Before any work: no spec, a scale the spec does not list, no scale below to start from,
        chunk sizes that differ, a destination that cannot be used.
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
    destination = Destination.of(dest)
    staging = None
    if workdir is not None:
        wd = Destination.of(workdir, what="work folder")
        if not wd.local:
            raise SpecError(f"work folder {wd.describe()}: downsample stages shards on this host; give a local folder")
        staging = wd.local_path()
    ds = source if isinstance(source, Dataset) else Dataset(source, spec=spec)
    if ds.spec is None or any(s.inferred for s in ds.scales):
        raise SpecError(f"{ds.store.describe('')}: give the neuroglancer spec DVID was given (--spec): the scales "
                        f"to make and their shard sizes come from it")
    src_labels = _labels_of(labels)
    held = set(ds.exported)
    listed = [s.index for s in ds.scales]
    wanted = scales_of(scales)
    if wanted is None:
        wanted = [k for k in listed if k not in held and any(h < k for h in held)]
        if not wanted:
            raise SpecError(f"{ds.store.describe('')} holds every scale its spec lists below its coarsest "
                            f"({', '.join(f's{k}' for k in sorted(held))}); nothing to make (--scales to make some "
                            f"again)")
    for k in wanted:
        ds.scale(k)  # a scale the spec does not list: SpecError naming the ones it does
    start = max((h for h in held if h < min(wanted)), default=None)
    if start is None:
        raise SpecError(f"scale {min(wanted)} is made from scale {min(wanted) - 1}, which "
                        f"{ds.store.describe('')} does not hold (it holds {', '.join(f's{k}' for k in sorted(held))})")
    made = list(range(start + 1, max(wanted) + 1))
    if len(made) > 1 and destination.spec is not None and destination.spec.get("driver") == "memory":
        raise SpecError(f"{destination.describe()}: a memory:// destination is seen by this process only, so it "
                        f"cannot hold scales made from each other ({', '.join(f's{k}' for k in made)}); write to a "
                        f"folder or a bucket")
    added = [k for k in made if k not in wanted]
    base = ds.scale(start)
    for k in [start, *made]:
        s = ds.scale(k)
        if s.chunk_size != base.chunk_size or len(set(s.chunk_size)) != 1 or s.chunk_size[0] % 16:
            raise SpecError(f"scale {k}: chunks {s.chunk_size}; downsample needs the same cubic chunks (a multiple of "
                            f"16 voxels) at every scale")
        if any(s.voxel_offset):
            raise SpecError(f"scale {k}: voxel_offset {list(s.voxel_offset)}; downsample needs scales at the origin")
        if k in made and s.sharding is None:
            raise SpecError(f"scale {k}: the spec gives no sharding, so its shard files cannot be named")
    batch = batch_size if batch_size is not None else ds.spec.get("batch_size", 1)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise SpecError(f"batch_size must be a positive integer, got {batch!r}")
    params = {"method": method, "scales": made, "from": start, "zstd_level": zstd_level, "batch_size": batch,
              **src_labels.identity()}
    totals = DownsampleTotals()
    info = ds.spec if ds.spec is not None else multiscale_info(list(ds.scales))
    import json

    with Output(destination, job="downsample", parameters=params, source=_source_url(source, ds), scales=made,
                command=command, resume=resume, overwrite=overwrite,
                own=lambda name: name == "info" or (name[:1] == "s" and name[1:].isdigit())) as out:
        destination.write("info", (json.dumps(info, indent=1) + "\n").encode())
        mine = None if not made else MadeScales(as_store(destination.path if destination.local
                                                         else destination.kvstore))
        stopped = None
        ran = 0
        with TaskRunner(scheduler, progress=progress) as tr:
            for k in made:
                read: Dataset | MadeScales
                if k - 1 == start:
                    read, below = ds, ds.scale(k - 1)
                else:
                    assert mine is not None
                    read, below = mine, ds.scale(k - 1).with_naming("current")
                scale = ds.scale(k).with_naming("current")
                items = plan_scale(below, scale, read.shards(below))
                phase = Phase(read, below, scale, destination, method, src_labels, batch, zstd_level, staging)
                names = set(destination.list(scale.folder))
                done = [it for it in items if f"{shard_filename_stem(it[0])}.arrow" in names
                        and f"{shard_filename_stem(it[0])}.csv" in names] if resume else []
                run = items
                if _only is not None:  # benchmarks: only these (scale, output origin) tasks
                    run = [it for it in items if (k, it[0]) in _only]
                if _stop_after is not None:  # tests: as if the job were killed after this many tasks
                    run = items[:max(0, _stop_after - ran)]
                ph = tr.run(partial(downsample_shard, phase), run, done=done, desc=f"{scale.folder} shards",
                            kernels=KERNELS)
                ran += len(ph.results)
                out.add(ph, name=partial(_task_name, scale.folder))
                out.report.tasks += len(items) - len(run)
                reduce_results(ph.results.values(), totals, k)
                if ph.failed or (len(run) < len(items) and _only is None):
                    stopped = k
                    break
        notes = _notes(totals, method, made, start, added)
        if stopped is not None and stopped != made[-1]:
            rest = [f"s{k}" for k in made if k > stopped]
            notes.append(f"{', '.join(rest)} not made: s{stopped} is incomplete (--resume finishes it, then them)")
        return out.finish(totals=totals, notes=notes, complete=stopped is None and _only is None,
                          allow_partial=allow_partial)


# --------------------------------------------------------------------------- command line


def add_arguments(p) -> None:
    """Arguments of ``dvidshards downsample``."""
    add_source(p)
    add_dest(p, what="output: the made scales as a DVID export (empty, or this job's own earlier output)", old=())
    add_scales(p, help="scales to make (default: every scale the spec lists that the export lacks)")
    p.add_argument("--method", choices=METHODS, default="dvid",
                   help="dvid: DVID's own pyramid rule, the most frequent non-zero supervoxel (default); mode: "
                        "TensorStore's mode (0 counts like any id)")
    add_labels(p)
    p.add_argument("--batch-size", type=int, default=None, metavar="N",
                   help="records per Arrow record batch of the output shards (default: the spec's batch_size)")
    add_job_options(p)


def main(args) -> int:
    """Run ``dvidshards downsample``; 0 when the output is complete, 1 when it is not."""
    skip = [k for k, v in (("method", "dvid"), ("labels", "agglomerated")) if getattr(args, k) == v]
    report = downsample(args.source, dest_of(args), scales=args.scales, method=args.method,
                        labels=None if args.labels == "agglomerated" else args.labels, spec=args.spec,
                        batch_size=args.batch_size, allow_partial=True, command=command_line("downsample", args, skip=skip), **job_options(args))
    print(report.summary())
    return 0 if report.ok else 1


class DownsampleCommand:
    """``dvidshards downsample``: one row of ``cli.COMMANDS``."""

    add_arguments = staticmethod(add_arguments)
    main = staticmethod(main)
