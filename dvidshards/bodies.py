"""One body on demand: its chunks, size, box, mask, DVID sparse volumes and mesh.

``Body(ds, id)`` answers what a neuclease user asks DVID for one body (``fetch_size``,
``fetch_sparsevol``, ``fetch_sparsevol_coarse``, the label index, a mask) from the export,
without a whole-export job first.  Every answer is a method (each reads the export):

* `Body.chunks`: from a label index when one is given (``index=``; for a supervoxel, its
  body's rows through the index's supervoxel table), else the records' label lists (no block
  decompressed); `Body.exists` says whether there are any.
* `Body.size`, `Body.box`: the label index's voxel counts, else counted in the body's blocks
  without writing a voxel (``formats.blockstats``).
* `Body.mask`, `Body.runs`, `Body.sparsevol`, `Body.sparsevol_coarse`: only the body's chunks
  decoded; the sparse volumes are DVID's bytes in its three formats (``formats.sparsevol``),
  also block by block (`Body.sparsevol_parts`, what a server streams) and under DVID's bounds.
* `Body.mesh`: one watertight surface from per-chunk marching cubes, welded, in nm.
* `Body.skeleton`: its skeleton as ``dvidshards skeletons`` makes it (``formats.skeleton``), at
  a scale the export lacks too: `MadeScales` makes any chunk of the spec's scales from the finest
  held finer scale by DVID's rule, as ``dvidshards downsample`` does (serve-dvid's pyramid is it).

An id with no voxel raises `NotFoundError` from every answer, saying what the id is instead
when that is cheap to know (a supervoxel of body B).  The dataset is any `DatasetLike`.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import NotExportedError, NotFoundError, SpecError
from .formats.codec import decode_into
from .formats.downsample import downsample_block
from .formats.labelindex import labels_id
from .formats.labels import LabelSource, Supervoxels, as_labels
from .formats.mesh import Mesh, merge_fragments, mesh_cells, to_nm
from .formats.multiscale import Scale
from .formats.records import RecordTable
from .formats.skeleton import DUST, Skeleton, need_kimimaro, skeleton_scale, skeletonize_chunks
from .formats.sparsevol import (
    BLOCKS_HEADER,
    HEADER,
    RunOrder,
    SparsevolError,
    binary_block_bits,
    encode_coarse,
    merge_runs,
)
from .protocol import DatasetLike
from .query import (
    BodyIndex,
    BodyMask,
    IndexRows,
    body_bits,
    body_mask,
    chunks_with,
    count_blocks,
    held_scales,
    ids_of,
    lookup,
    record_ids,
    shard_groups,
    sorted_chunks,
)

__all__ = ["FORMATS", "MADE_BODY_CHUNKS", "Body", "MadeScales", "Rec", "chunk_decoder", "parse_bounds"]

log = logging.getLogger(__name__)

_U64 = 1 << 64
_I32 = (-(1 << 31), (1 << 31) - 1)
FORMATS = ("rles", "srles", "blocks")  # DVID's sparsevol formats

Bounds = Any  # ((minx, miny, minz), (maxx, maxy, maxz)), entries int or None
_OCTANTS = [(i & 1, (i >> 1) & 1, i >> 2) for i in range(8)]
#: a body's chunks of the held scale a skeleton's made scale may be made from on demand: one made chunk
#: in memory at a time, ~0.2 ms of CPU per held chunk (the real mCNS shard; ~6 s in all), while
#: kimimaro then takes minutes: beyond, the job (``dvidshards downsample`` first)
MADE_BODY_CHUNKS = 1 << 15


def parse_bounds(bounds: Bounds) -> tuple[np.ndarray, np.ndarray] | None:
    """DVID's ``minx`` .. ``maxz`` bounds ``((minx, miny, minz), (maxx, maxy, maxz))`` (voxels of
    the scale, any entry None: unbounded) as (lo, hi) int64 arrays, both inclusive; None: none."""
    if bounds is None:
        return None
    try:
        lo_, hi_ = bounds
        lo_, hi_ = list(lo_), list(hi_)
        if len(lo_) != 3 or len(hi_) != 3:
            raise ValueError
        lo = np.array([_I32[0] if v is None else int(v) for v in lo_], np.int64)
        hi = np.array([_I32[1] if v is None else int(v) for v in hi_], np.int64)
    except (TypeError, ValueError):
        raise SpecError(f"bounds must be ((minx, miny, minz), (maxx, maxy, maxz)), entries int or None; "
                        f"got {bounds!r}") from None
    if (lo < _I32[0]).any() or (hi > _I32[1]).any():
        raise SpecError(f"bounds {bounds!r} exceed int32")
    return lo, hi


def chunk_decoder(ds: DatasetLike, scale: int | Scale = 0, *, labels: Any = "agglomerated",
                  fill_missing_shards: bool = False) -> Callable[[Any], np.ndarray | None]:
    """A function decoding one chunk (x, y, z) of a scale into a new (z, y, x) array, thread-safe.

    Voxels outside the volume (a partial edge chunk) are 0; a chunk outside the volume, or one
    no shard holds, is None (background).  ``fill_missing_shards``: a missing shard file is
    background instead of a ``MissingShardError``.
    """
    s = ds.scale(scale)
    src = as_labels(labels)
    reader = ds.reader(s, labels=src, fill_missing_shards=fill_missing_shards)
    cs = np.asarray(s.chunk_size, np.int64)
    vlo = np.asarray(s.voxel_offset, np.int64)
    vhi = vlo + np.asarray(s.size, np.int64)
    shape = tuple(int(v) for v in cs[::-1])

    def decode(c) -> np.ndarray | None:
        c = np.asarray(c, np.int64).reshape(3)
        org = c * cs
        if ((org + cs) <= vlo).any() or (org >= vhi).any():
            return None
        x, y, z = (int(v) for v in c)
        shard = reader.shard(x, y, z)
        if shard is None:
            return None
        a = np.clip(vlo - org, 0, cs)
        b = np.clip(vhi - org, 0, cs)
        buf = np.zeros(shape, np.uint64)
        if not shard.read_into(x, y, z, buf[:b[2], :b[1], :b[0]], src):
            reader.absent(shard, x, y, z)
            return None
        if a.any():  # voxels below the volume's offset are not part of it
            buf[:a[2]] = 0
            buf[:, :a[1]] = 0
            buf[:, :, :a[0]] = 0
        return buf

    return decode


@dataclass(frozen=True)
class Rec:
    """One chunk's record: its uncompressed DVID block and its two label lists."""

    block: np.ndarray  # uint8
    supervoxels: np.ndarray  # the block's label list
    labels: np.ndarray  # the agglomerated body of each entry

    def palette(self, src: LabelSource) -> np.ndarray | None:
        """The label of each entry of the block's list under ``src`` (None: the list itself)."""
        return None if isinstance(src, Supervoxels) else src.palette(_One(self), 0)

    def decode(self, src: LabelSource, out: np.ndarray) -> None:
        """The voxels (z, y, x) into ``out`` with the label source's palette."""
        pal = self.palette(src)
        decode_into(self.block, None if pal is None else np.ascontiguousarray(pal, np.uint64), out)


class _One:
    """A `Rec` as a one-row record table (what ``LabelSource.palette`` reads)."""

    def __init__(self, rec: Rec):
        self.rec = rec

    def labels(self, i: int) -> np.ndarray:
        return self.rec.labels

    def supervoxels(self, i: int) -> np.ndarray:
        return self.rec.supervoxels


def _made_bodies(svs: np.ndarray, pairs: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Each made supervoxel's body from its children's (supervoxels, labels) pairs (the first
    child's in octant order, as the downsample job does); 0 stays 0."""
    if not pairs:
        return np.zeros(len(svs), np.uint64)
    sv = np.concatenate([p[0] for p in pairs]).astype(np.uint64)
    lab = np.concatenate([p[1] for p in pairs]).astype(np.uint64)
    order = np.argsort(sv, kind="stable")
    s, b = sv[order], lab[order]
    pos = np.minimum(np.searchsorted(s, svs), len(s) - 1)
    return np.where(s[pos] == svs, b[pos], np.uint64(0)).astype(np.uint64)


class MadeScales:
    """The records of every scale of a dataset's spec from the finest held one up: read where the
    export holds the scale (``held``, finest first), else made on demand from the scale below by
    DVID's rule (:func:`~dvidshards.formats.downsample.downsample_block` on the supervoxel blocks,
    down to the nearest held finer scale; each made supervoxel's body is its first child's), as
    ``dvidshards downsample`` makes them.  ``fill``: a missing shard file is background (else
    ``MissingShardError``).  Nothing is cached here (serve-dvid's pyramid caches)."""

    def __init__(self, ds: DatasetLike, held: list[int], *, fill: bool = True):
        self.ds, self.held, self.fill = ds, list(held), fill
        self.served = [s.index for s in ds.scales if s.index >= self.held[0]]
        self._origins: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def records(self, k: int, chunks: Any) -> Iterator[tuple[tuple[int, int, int], Rec]]:
        """The records of the chunks present (in the given order), skipping absent ones and those
        outside the scale's grid."""
        c = np.asarray(chunks, np.int64).reshape(-1, 3)
        c = c[((c >= 0) & (c < np.asarray(self.ds.scale(k).grid, np.int64))).all(axis=1)]
        if k in self.held:
            yield from self._held(k, c)
            return
        for x, y, z in c.tolist():
            r = self.made(k, (x, y, z))
            if r is not None:
                yield (x, y, z), r

    def _held(self, k: int, chunks: np.ndarray) -> Iterator[tuple[tuple[int, int, int], Rec]]:
        reader = self.ds.reader(k, labels=Supervoxels(), fill_missing_shards=self.fill)
        s = reader.scale
        if not len(chunks):
            return
        origins = [s.shard_origin(*c) for c in chunks.tolist()]
        start = [0] + [i for i in range(1, len(origins)) if origins[i] != origins[i - 1]]
        for a, b in zip(start, start[1:] + [len(chunks)], strict=True):
            run = chunks[a:b].tolist()
            shard = reader.shard(*run[0])
            if shard is None:
                continue
            found = [(i, tuple(c)) for i, c in ((shard.find(*c), c) for c in run) if i is not None]
            if not found:
                continue
            t = shard.table(np.asarray([i for i, _ in found], np.int64))
            for r, (_, c) in enumerate(found):
                yield c, Rec(np.frombuffer(t.block(r), np.uint8), np.asarray(t.supervoxels(r), np.uint64),
                             np.asarray(t.labels(r), np.uint64))

    def record(self, k: int, c: Any) -> Rec | None:
        got = list(self.records(k, [c]))
        return got[0][1] if got else None

    def made(self, k: int, c: tuple[int, int, int], present: np.ndarray | None = None) -> Rec | None:
        """Chunk c of a scale the export lacks, from its 8 children (None: no block there).

        ``present``: the chunks of the nearest held finer scale under c to make it from (default:
        those the shard files' indexes list); others read as background, so a body's chunks there
        make that body's voxels exactly.
        """
        h = max(v for v in self.held if v < k)
        if present is None:
            present = self.present(h, c, k - h)
        if not len(present):
            return None
        below = max(v for v in self.served if v < k)
        kids_at = [(2 * c[0] + dx, 2 * c[1] + dy, 2 * c[2] + dz) for dx, dy, dz in _OCTANTS]
        if below in self.held:
            got = dict(self.records(below, kids_at))
        else:
            up = present >> (below - h)
            got = {}
            for ch in kids_at:
                sub = present[(up == ch).all(axis=1)]
                r = self.made(below, ch, sub) if len(sub) else None
                if r is not None:
                    got[ch] = r
        out = downsample_block([got[ch].block if ch in got else None for ch in kids_at])
        if out is None:
            return None
        svs = out.supervoxels.astype(np.uint64)
        return Rec(np.frombuffer(out.block, np.uint8), svs,
                   _made_bodies(svs, [(got[ch].supervoxels, got[ch].labels) for ch in kids_at if ch in got]))

    def present(self, h: int, c: Any, shift: int) -> np.ndarray:
        """The chunks of held scale h the export holds under chunk c of scale h + shift."""
        lo = np.asarray(c, np.int64) << shift
        hi = lo + (1 << shift)
        s = self.ds.scale(h)
        n = np.asarray(s.chunk_size, np.int64)
        with self._lock:
            origins = self._origins.get(h)
        if origins is None:
            origins = np.asarray(self.ds.shards(h), np.int64).reshape(-1, 3) // n
            with self._lock:
                self._origins[h] = origins
        span = np.maximum(int(s.shard_extent) // n, 1)
        reader = self.ds.reader(h, labels=Supervoxels(), fill_missing_shards=self.fill)
        out = [np.zeros((0, 3), np.int64)]
        for o in origins[((origins < hi) & (origins + span > lo)).all(axis=1)].tolist():
            shard = reader.shard(*o)
            if shard is not None and len(shard):
                cc = shard.coords
                out.append(cc[((cc >= lo) & (cc < hi)).all(axis=1)])
        return np.concatenate(out)


class Body:
    """One body (or one supervoxel) of an export, answered on demand.

    Parameters
    ----------
    ds : DatasetLike
        The export.
    id : int
        Body id (a uint64; with ``labels="supervoxels"`` a supervoxel id).
    scale : int
        Default scale of the answers (folder number).
    labels : "agglomerated", "supervoxels" or a mapping
        What a body is: the records' agglomerated labels, a supervoxel, or a supervoxel ->
        body mapping.
    index : BodyIndex or path, optional
        A label index (``dvidshards label-index``) of the same label source, or of agglomerated
        labels for a supervoxel (its body's rows, by the index's supervoxel table): its chunk
        lists and voxel counts are used instead of scanning the records' lists.

    Chunks, size and box are cached per scale on the object; masks, runs and meshes are
    computed on each call.
    """

    def __init__(self, ds: DatasetLike, id: int, *, scale: int | Scale = 0, labels: Any = "agglomerated",
                 index: BodyIndex | Any = None) -> None:
        if not isinstance(id, (int, np.integer)) or isinstance(id, bool):
            raise SpecError(f"body id must be an integer, got {id!r}")
        body = int(id)
        if not 0 < body < _U64:
            raise SpecError(f"body id must be in 1 .. 2**64 - 1 (0 is background), got {body}")
        self.ds = ds
        self.id = body
        self.scale = ds.scale(scale).index
        self.labels = as_labels(labels)
        self.index: BodyIndex | None = None
        if index is not None:
            idx = index if isinstance(index, BodyIndex) else BodyIndex(index)
            sv_of_bodies = isinstance(self.labels, Supervoxels) and idx.meta.get("labels") == "agglomerated"
            if not sv_of_bodies and any(idx.meta.get(k) != v for k, v in labels_id(self.labels).items()):
                raise SpecError(f"{idx.path}: the index is of {idx.meta.get('labels')} labels, not "
                                f"{self.labels.name}")
            self.index = idx
        self._chunks: dict[int, np.ndarray] = {}
        self._stats: dict[int, tuple[int, list | None]] = {}
        self._rows: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def __repr__(self) -> str:
        return f"Body({self.id}, scale={self.scale}, labels={self.labels.name!r})"

    def _scale(self, scale: int | Scale | None) -> Scale:
        return self.ds.scale(self.scale if scale is None else scale)

    def _tables(self, s: Scale, chunks: np.ndarray) -> Iterator[tuple[RecordTable, np.ndarray]]:
        """(records, their chunks) of the chunks a shard holds, one shard at a time."""
        reader = self.ds.reader(s, labels=self.labels)
        for group in (chunks[g] for g in shard_groups(s, chunks)):
            shard = reader.shard(*(int(v) for v in group[0]))
            if shard is None:
                continue
            found = [(i, c) for i, c in ((shard.find(*(int(v) for v in c)), c) for c in group) if i is not None]
            if found:
                yield (shard.table(np.asarray([i for i, _ in found], np.int64)),
                       np.asarray([c for _, c in found], np.int64).reshape(-1, 3))

    # --- chunks, size, box ------------------------------------------------------------------

    def chunks(self, scale: int | Scale | None = None, *, missing_ok: bool = False) -> np.ndarray:
        """(n, 3) int64 chunk coordinates (x, y, z) holding the body at a scale, sorted z, y, x.

        From the label index when it is of that scale.  When it is of a finer scale, its blocks
        coarsened (DVID's rule: a coarse voxel takes a label of its finer cell) are the
        candidates, kept where the records' lists hold the body.  Else a scan of the scale's
        lists (no block decompressed).  NotFoundError when no chunk holds the body, unless
        ``missing_ok`` (then empty).
        """
        s = self._scale(scale)
        c = self._chunks.get(s.index)
        if c is None:
            idx = self.index
            if idx is not None and idx.scale == s.index:
                c = sorted_chunks(self._index_rows().chunks)
            elif idx is not None and idx.scale < s.index and self._coarsens(idx.scale, s):
                fine = self._index_rows().chunks >> (s.index - idx.scale)
                c = self._listed(s, np.unique(fine, axis=0) if len(fine) else fine)
            else:
                c = chunks_with(self.ds, [self.id], scale=s.index, labels=self.labels)
            self._chunks[s.index] = c
        if not len(c) and not missing_ok:
            raise self.not_found(s.index)
        return c

    def _index_rows(self) -> IndexRows:
        """This id's rows of the label index (a supervoxel's: its body's rows holding it)."""
        assert self.index is not None
        if isinstance(self.labels, Supervoxels) and self.index.meta.get("labels") == "agglomerated":
            return self.index.supervoxel_rows(self.id)
        return self.index.rows(self.id)

    def _coarsens(self, h: int, s: Scale) -> bool:
        """Whether scale ``s`` is scale ``h`` downsampled by 2 per level, with its chunk size."""
        try:
            fine = self.ds.scale(h)
        except SpecError:
            return False
        k = s.index - h
        return tuple(fine.chunk_size) == tuple(s.chunk_size) and all(
            -(-int(n) // (1 << k)) == int(m) for n, m in zip(fine.size, s.size, strict=True))

    def _listed(self, s: Scale, candidates: np.ndarray) -> np.ndarray:
        """The candidate chunks whose records' lists hold the body, sorted z, y, x."""
        keep = [np.zeros((0, 3), np.int64)]
        for t, c in self._tables(s, candidates):
            vals, owner = record_ids(t, self.labels)
            keep.append(c[np.unique(owner[vals == np.uint64(self.id)])])
        return sorted_chunks(np.concatenate(keep))

    def exists(self, scale: int | Scale | None = None) -> bool:
        """Whether a chunk holds the body at a scale (default: its own), by the label index's rows
        or the records' lists (no block decompressed)."""
        return bool(len(self.chunks(scale, missing_ok=True)))

    def not_found(self, scale: int | Scale | None = None, *, why: str = "") -> NotFoundError:
        """The error for this id having no voxel at a scale, saying what the id is instead.

        Without a label index the records' lists are looked at (as finding the body's chunks
        did): an id that is a supervoxel of another body says so, as does a body asked for as a
        supervoxel.  With an index no scan is made.
        """
        s = self._scale(scale)
        kind = "supervoxel" if isinstance(self.labels, Supervoxels) else "body"
        where = f" at scale {s.index}" + (f" {why}" if why else "")
        if why:
            return NotFoundError(f"{kind} {self.id} has no voxel{where}")
        if self.index is not None and self.index.scale <= s.index:
            table = self.index.supervoxel_table(build=False)  # known only when already built: no scan here
            b = int(lookup(table, [self.id])[0]) if table is not None and kind == "body" else 0
            if b:
                return NotFoundError(f"{self.id} is a supervoxel of body {b}{where}, not a body: ask for body {b}, "
                                     f"or pass labels='supervoxels'")
            hint = " (a supervoxel id? pass labels='supervoxels')" if kind == "body" and table is None else ""
            return NotFoundError(f"{kind} {self.id} is not in the label index {self.index.path}{where}{hint}")
        if not isinstance(self.labels, Supervoxels):
            c = chunks_with(self.ds, [self.id], scale=s.index, labels="supervoxels")
            if len(c):
                b = self._body_of_supervoxel(s, c[0])
                return NotFoundError(f"{self.id} is a supervoxel of body {b}{where}, not a body: ask for body {b}, "
                                     f"or pass labels='supervoxels'")
        elif len(chunks_with(self.ds, [self.id], scale=s.index, labels="agglomerated")):
            return NotFoundError(f"{self.id} is a body{where}, not a supervoxel: its supervoxels are "
                                 f"Body({self.id}).supervoxels()")
        return NotFoundError(f"{self.id} is not in this export at scale {s.index} ({self.labels.name} labels)")

    def _body_of_supervoxel(self, s: Scale, chunk: np.ndarray) -> int:
        for t, _ in self._tables(s, np.asarray(chunk, np.int64).reshape(1, 3)):
            svs = t.supervoxels(0)
            return int(ids_of(t, 0, self.labels)[np.flatnonzero(svs == np.uint64(self.id))[0]])
        return 0

    def _count(self, s: Scale) -> tuple[int, list | None]:
        """(voxels, exact box) at a scale, counted in the body's blocks (no voxel written)."""
        got = self._stats.get(s.index)
        if got is not None:
            return got
        cs = np.asarray(s.chunk_size, np.int64)
        vlo = np.asarray(s.voxel_offset, np.int64)
        vhi = vlo + np.asarray(s.size, np.int64)
        total = 0
        lo = np.full(3, np.iinfo(np.int64).max)
        hi = np.full(3, np.iinfo(np.int64).min)
        rows_c, rows_sv, rows_n = [np.zeros((0, 3), np.int64)], [np.zeros(0, np.uint64)], [np.zeros(0, np.int64)]
        for t, c in self._tables(s, self.chunks(s.index, missing_ok=True)):
            org = c * cs
            blk, ids, sv, vox, bx = count_blocks(t, np.arange(len(c)), np.clip(vlo - org, 0, cs),
                                                 np.clip(vhi - org, 0, cs), self.labels)
            hit = ids == np.uint64(self.id)
            if not hit.any():
                continue
            total += int(vox[hit].sum())
            b = bx[hit] + np.hstack([org, org])[blk[hit]]
            lo = np.minimum(lo, b[:, :3].min(axis=0))
            hi = np.maximum(hi, b[:, 3:].max(axis=0))
            rows_c.append(c[blk[hit]])
            rows_sv.append(sv[hit])
            rows_n.append(vox[hit])
        box = [lo.tolist(), hi.tolist()] if total else None
        self._stats[s.index] = (total, box)
        self._rows[s.index] = (np.concatenate(rows_c), np.concatenate(rows_sv), np.concatenate(rows_n))
        return total, box

    def supervoxel_counts(self, scale: int | Scale | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The body's label index at a scale: (chunks (n, 3) int64, supervoxels uint64, voxels int64),
        a row per chunk and supervoxel holding it; the label index's when of that scale, else
        counted in the body's blocks.  NotFoundError if the body has no voxel there."""
        s = self._scale(scale)
        if self.index is not None and self.index.scale == s.index:
            r = self._index_rows()
            out = (r.chunks, r.supervoxels, r.voxels)
        else:
            self._count(s)
            out = self._rows[s.index]
        if not int(out[2].sum()):
            raise self.not_found(s.index)
        return out

    def supervoxel_sizes(self, scale: int | Scale | None = None) -> dict[int, int]:
        """``{supervoxel: voxels}`` of the body at a scale, sorted by supervoxel (DVID's
        ``/supervoxel-sizes``); NotFoundError if it has no voxel."""
        _, sv, n = self.supervoxel_counts(scale)
        u, inv = np.unique(sv, return_inverse=True)
        tot = np.bincount(inv.reshape(-1), weights=n, minlength=len(u)).astype(np.int64)
        return dict(zip(u.tolist(), tot.tolist(), strict=True))

    def size(self, scale: int | Scale | None = None) -> int:
        """Voxels of the body at a scale (DVID's ``/size``; the label index's count when it is of
        that scale); NotFoundError if none."""
        s = self._scale(scale)
        if self.index is not None and self.index.scale == s.index:
            n = int(self._index_rows().voxels.sum())
        else:
            n = self._count(s)[0]
        if not n:
            raise self.not_found(s.index)
        return n

    def box(self, scale: int | Scale | None = None) -> list[list[int]]:
        """Exact voxel box ``[[x0, y0, z0], [x1, y1, z1]]`` (upper bound exclusive) at a scale;
        NotFoundError if no voxel."""
        s = self._scale(scale)
        box = self._count(s)[1]
        if box is None:
            raise self.not_found(s.index)
        return box

    def supervoxels(self) -> np.ndarray:
        """Sorted supervoxel ids of the body (the label index's, else from the records' lists at its
        scale); NotFoundError if it has no voxel there."""
        if self.index is not None:
            svs = np.unique(self._index_rows().supervoxels)
            if not len(svs):
                raise self.not_found()
            return svs
        if isinstance(self.labels, Supervoxels):
            self.chunks()  # NotFoundError when absent
            return np.array([self.id], np.uint64)
        s = self._scale(None)
        found = [np.zeros(0, np.uint64)]
        for t, c in self._tables(s, self.chunks()):
            for k in range(len(c)):
                found.append(t.supervoxels(k)[ids_of(t, k, self.labels) == np.uint64(self.id)])
        out = np.unique(np.concatenate(found))
        if not len(out):
            raise self.not_found()
        return out

    # --- voxels -----------------------------------------------------------------------------

    def mask(self, scale: int | Scale | None = None) -> BodyMask:
        """The body as a boolean (x, y, z) mask over its exact box, decoding only its chunks:
        ``(mask, box)``; NotFoundError if it has no voxel at that scale."""
        s = self._scale(scale)
        m = body_mask(self.ds, self.id, scale=s.index, labels=self.labels, chunks=self.chunks(s.index))
        if m.box is None:
            raise self.not_found(s.index)
        return m

    def block_bits(self, scale: int | Scale | None = None, *, bounds: Bounds = None
                   ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The body's chunks one by one, in (z, y, x) order: ``(chunk (x, y, z), bits)``.

        ``bits``: `formats.sparsevol.block_bits` of the chunk's block, uint8 (nz, ny, nx / 8), bit
        i of ``[z, y, j]`` voxel (8 j + i, y, z) of the chunk, set where it is the body (outside
        the volume, and absent chunks, 0), from the block's packed values (no voxel decoded).
        ``bounds`` (`parse_bounds`) keeps the chunks DVID's block bounds keep (bits not cut).
        Memory: one shard's run of chunks.
        """
        s = self._scale(scale)
        c = self.chunks(s.index)
        cs = np.asarray(s.chunk_size, np.int64)
        if cs[0] % 8:
            raise SpecError(f"scale {s.index}: chunks {s.chunk_size} are not a whole number of bytes along x")
        b = parse_bounds(bounds)
        if b is not None:
            c = c[((c >= b[0] // cs) & (c <= b[1] // cs)).all(axis=1)]
        yield from body_bits(self.ds, s, self.labels, self.id, c)

    def runs(self, scale: int | Scale | None = None) -> np.ndarray:
        """Maximal x-runs of the body, sorted (z, y, x): int32 (n, 4) rows x, y, z, length;
        NotFoundError if it has no voxel at that scale."""
        s = self._scale(scale)
        order = RunOrder(int(s.chunk_size[0]))
        out = merge_runs(*(order.add_bits(c, bits) for c, bits in self.block_bits(s.index)), order.finish())
        if not len(out):
            raise self.not_found(s.index)
        return out

    def sparsevol_parts(self, scale: int | Scale | None = None, *, format: str = "rles",
                        bounds: Bounds = None) -> Iterator[bytes]:
        """DVID's ``GET .../sparsevol/<id>`` bytes, block by block (what a server streams).

        ``"srles"`` and ``"blocks"`` pieces concatenate to the response; ``"rles"`` pieces are
        the spans without the 12-byte header (its span count is known only at the end:
        `sparsevol` adds it, a server counts the bytes).  ``bounds``: DVID's inclusive voxel
        bounds; chunks outside them are skipped and runs cut (``blocks``: chunks only, as DVID
        does).  Memory: one shard's run of chunks and one row of blocks' runs.  NotFoundError if
        no chunk of the body lies within the bounds at that scale.
        """
        if format not in FORMATS:
            raise SpecError(f"format must be one of {FORMATS}, got {format!r}")
        s = self._scale(scale)
        cs = np.asarray(s.chunk_size, np.int64)
        b = parse_bounds(bounds)
        if format != "blocks" and len({int(v) for v in s.chunk_size}) != 1:
            raise SpecError(f"scale {s.index}: DVID's run order needs cubic chunks, got {s.chunk_size}")
        parts = self.block_bits(s.index, bounds=bounds)
        first = next(parts, None)
        if first is None:
            raise self.not_found(s.index, why="within the bounds")
        if format == "blocks":
            g = [int(v) // 8 for v in s.chunk_size]
            yield BLOCKS_HEADER.pack(g[0], g[1], g[2], self.id)
            for c, bits in itertools.chain([first], parts):
                yield binary_block_bits(c * cs, bits)
            return
        order = RunOrder(int(cs[0]), bounds=b)
        for c, bits in itertools.chain([first], parts):
            done = order.add_bits(c, bits)
            if len(done):
                yield done.astype("<i4").tobytes()
        done = order.finish()
        if len(done):
            yield done.astype("<i4").tobytes()

    def sparsevol(self, scale: int | Scale | None = None, *, order: str = "dvid", format: str = "rles",
                  bounds: Bounds = None) -> bytes:
        """DVID's ``GET .../sparsevol/<id>?scale=N&format=...`` bytes.

        Parameters
        ----------
        scale : int, optional
            Runs in voxels of this scale (default: the body's).
        order : {"dvid", "zyx"}
            Runs of ``rles``/``srles`` in the order DVID streams them (block by block; see
            `dvidshards.formats.sparsevol.RunOrder`), or sorted.
        format : {"rles", "srles", "blocks"}
            Legacy RLEs with their header (default), streaming RLEs, or binary blocks.
        bounds : ((minx, miny, minz), (maxx, maxy, maxz)), optional
            DVID's inclusive voxel bounds (see `sparsevol_parts`).  As DVID, an ``rles`` answer
            with chunks in the bounds but no voxel is empty (no header).

        Raises
        ------
        NotFoundError
            If the body has no voxel at that scale (DVID answers 404), or no chunk within the
            bounds.
        """
        if order not in ("dvid", "zyx"):
            raise SpecError(f"order must be 'dvid' or 'zyx', got {order!r}")
        data = b"".join(self.sparsevol_parts(scale, format=format, bounds=bounds))
        if format == "blocks":
            return data
        if order == "zyx":
            runs = merge_runs(np.frombuffer(data, "<i4").reshape(-1, 4)) if data else np.zeros((0, 4), np.int32)
            data = runs.astype("<i4").tobytes()
        if format == "srles":
            return data
        n = len(data) // 16
        if not n:
            if bounds is None:
                raise self.not_found(scale)
            return b""
        if n > 0xFFFFFFFF:
            raise SparsevolError(f"{n} spans do not fit the u32 span count")
        return HEADER.pack(0, 3, 0, 0, 0, n) + data

    def sparsevol_coarse(self, scale: int | Scale | None = None, *, bounds: Bounds = None) -> bytes:
        """DVID's ``GET .../sparsevol-coarse/<id>`` bytes: runs of the chunks holding the body.

        Block coordinates of a scale (default the body's; DVID's are those of scale 0, its label
        index's blocks), no block decompressed; ``bounds`` (voxels, inclusive) keeps the blocks
        DVID's block bounds keep.  NotFoundError if no chunk holds the body (within the bounds).
        """
        s = self._scale(scale)
        c = self.chunks(s.index)
        b = parse_bounds(bounds)
        if b is not None:
            cs = np.asarray(s.chunk_size, np.int64)
            c = c[((c >= b[0] // cs) & (c <= b[1] // cs)).all(axis=1)]
            if not len(c):
                raise self.not_found(s.index, why="within the bounds")
        return encode_coarse(c)

    def mesh(self, scale: int | Scale | None = None, *, units: str = "nm", reduction_factor: int = 0,
             max_error: float = 8, chunks: Any = None) -> Mesh:
        """One watertight mesh of the body from its chunks' cells (marching cubes, zmesh).

        Parameters
        ----------
        scale : int, optional
            Scale to mesh (default: the body's); a coarser scale is faster.
        units : {"nm", "voxels"}
            Vertex units: nm (the scale's resolution), or voxel corner coordinates of the scale.
        reduction_factor, max_error :
            Per-cell simplification (``formats.mesh.mesh_block``); cell faces are kept, so the
            welded mesh stays closed.  0 keeps every marching-cubes triangle.
        chunks : array_like of int, shape (n, 3), optional
            Chunks to look in, a superset of the body's at that scale (e.g. a label index's blocks
            of a finer scale, coarsened); default `chunks`.  Given chunks holding no voxel of the
            body give an empty mesh.

        Raises
        ------
        SpecError
            If ``units="nm"`` and the scale's resolution is unknown (geometry inferred).
        NotFoundError
            If ``chunks`` are not given and no chunk holds the body at that scale.
        """
        if units not in ("nm", "voxels"):
            raise SpecError(f"units must be 'nm' or 'voxels', got {units!r}")
        s = self._scale(scale)
        if units == "nm" and s.resolution is None:
            raise SpecError(f"scale {s.index}: resolution unknown (no spec): give spec= or units='voxels'")
        if len({int(v) for v in s.chunk_size}) != 1:
            raise SpecError(f"scale {s.index}: meshing needs cubic chunks, got {s.chunk_size}")
        decode = chunk_decoder(self.ds, s.index, labels=self.labels)
        target = np.uint64(self.id)
        chunks = self.chunks(s.index) if chunks is None else np.asarray(chunks, np.int64).reshape(-1, 3)
        holds = {tuple(c) for c in chunks.tolist()}

        def mask(c):
            if tuple(c) not in holds:  # the lists say the body is not there: no need to decode
                return None
            a = decode(c)
            if a is None:
                return None
            m = a == target
            return m if m.any() else None

        # the body's chunks and their - neighbours: a cell reaches one voxel into its + neighbours, so
        # the cell of chunk c - 1 holds the surface between c - 1 and c
        d = np.array([[i, j, k] for k in (0, 1) for j in (0, 1) for i in (0, 1)], np.int64)
        cells = np.unique((chunks[:, None, :] - d[None, :, :]).reshape(-1, 3), axis=0) if len(chunks) else chunks
        frags = [m[1] for _, out in mesh_cells(mask, cells, int(s.chunk_size[0]), labels=[1],
                                               reduction_factor=reduction_factor, max_error=max_error)
                 for m in out.items()]
        mesh = merge_fragments(frags)
        return to_nm(mesh, s.resolution) if units == "nm" and len(mesh.faces) else mesh

    def skeleton(self, *, scale: int | None = None) -> Skeleton:
        """The body's skeleton as ``dvidshards skeletons`` makes it: kimimaro on blocks of its chunks
        (one voxel of overlap), joined into one tree per 26-connected piece; pieces under ``DUST``
        voxels or fewer get none.  Vertices and radii in nm; ``.swc()`` in scale-0 voxels (FlyEM's).

        Parameters
        ----------
        scale : int, optional
            Default: the job's (``formats.skeleton.skeleton_scale``): of the spec's scales from the
            finest the export holds up, the finest whose voxel is at least 32 nm, else the coarsest.
            A scale the export lacks is made chunk by chunk from the body's chunks at the nearest
            held finer scale, by DVID's rule as ``dvidshards downsample`` makes it (`MadeScales`;
            logged), so the skeleton is the job's.

        Raises
        ------
        NotFoundError
            No voxel of the body at that scale, or no piece of it over ``DUST`` voxels.
        NotExportedError
            ``scale`` is finer than the finest held one, or making it would read more than
            ``MADE_BODY_CHUNKS`` of the body's chunks: make it with ``dvidshards downsample``.
        SpecError
            The resolution is unknown (no spec): skeletons are in nm.
        SkeletonDependencyError
            kimimaro is not installed (``pip install 'dvidshards[skeleton]'``).
        """
        need_kimimaro()
        held = held_scales(self.ds)
        if scale is None:  # an unknown resolution is refused below
            scale = skeleton_scale([(s.index, s.resolution or (0.0,)) for s in self.ds.scales
                                    if s.index >= held[0]]) if held else self.scale
        s, voxel_size = self.ds.scale(scale), self.ds.scales[0].resolution
        if s.resolution is None or voxel_size is None:
            raise SpecError(f"scale {s.index}: resolution unknown (no spec): skeletons are in nm; give the spec")
        if s.index in held:
            chunks, decode = self.chunks(s.index), chunk_decoder(self.ds, s.index, labels=self.labels,
                                                                 fill_missing_shards=True)
        else:
            chunks, decode = self._made(s.index, held)
        target = np.uint64(self.id)

        def mask_of(c: Any) -> np.ndarray | None:
            a = decode(c)
            return None if a is None else a == target

        lo = np.asarray(s.voxel_offset, np.int64)
        sk = skeletonize_chunks(chunks, mask_of, chunk_size=s.chunk_size, resolution=s.resolution, dust=DUST,
                                bounds=(lo, lo + np.asarray(s.size, np.int64)), voxel_size=voxel_size)
        if not len(sk.vertices):
            raise NotFoundError(f"body {self.id} has no skeleton at scale {s.index}: no piece of it is over "
                                f"{DUST} voxels")
        return sk

    def _made(self, k: int, held: list[int]) -> tuple[np.ndarray, Callable[[Any], np.ndarray | None]]:
        """The body's chunks at a scale the export lacks (those over its chunks at the nearest held
        finer scale) and their decoder, which makes each from those chunks (`MadeScales`)."""
        if not held or k < held[0]:
            raise NotExportedError(f"scale {k} is not in this export (it holds {held}) and is finer than its finest: "
                                   f"it cannot be made; open an export that holds it")
        h = max(v for v in held if v < k)
        if not self._coarsens(h, self.ds.scale(k)):
            raise NotExportedError(f"scale {k} is not in this export and is not scale {h} halved per level with its "
                                   f"chunk size: it cannot be made on demand; make it with dvidshards downsample")
        fine = self.chunks(h)
        if len(fine) > MADE_BODY_CHUNKS:
            raise NotExportedError(f"body {self.id}: scale {k} is not in this export and would be made from "
                                   f"{len(fine):,} chunks of scale {h} (at most {MADE_BODY_CHUNKS:,} on demand): "
                                   f"make it with dvidshards downsample and open it with the export")
        log.info("body %d: scale %d is not in the export: made from its %d chunks of scale %d", self.id, k,
                 len(fine), h)
        chunks, inverse = np.unique(fine >> (k - h), axis=0, return_inverse=True)
        inverse = inverse.reshape(-1)
        parts = np.split(fine[np.argsort(inverse, kind="stable")], np.cumsum(np.bincount(inverse))[:-1])
        under = dict(zip(map(tuple, chunks.tolist()), parts, strict=True))
        made, src, shape = MadeScales(self.ds, held), self.labels, tuple(int(v) for v in self.ds.scale(k).chunk_size[::-1])

        def decode(c: Any) -> np.ndarray | None:  # not kept: making is ~1 % of kimimaro's time
            x, y, z = (int(v) for v in c)
            rec = made.made(k, (x, y, z), under[x, y, z]) if (x, y, z) in under else None
            if rec is None:
                return None
            out = np.empty(shape, np.uint64)
            rec.decode(src, out)
            return out

        return chunks, decode
