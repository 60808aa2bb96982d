"""One body on demand: its chunks, size, box, mask, DVID sparse volumes and mesh.

``Body(ds, id)`` is what a neuclease user asks DVID for one body (``fetch_size``,
``fetch_sparsevol``, ``fetch_sparsevol_coarse``, the label index, a mask), answered from the
export without a whole-export job first:

* :attr:`Body.chunks` - the chunks holding the body: from a label index when one is given
  (``index=``; for a supervoxel, its body's rows there, found through the index's supervoxel
  table), else from the records' label lists with no decompression
  (:func:`dvidshards.query.chunks_with`).
* :attr:`Body.size` and :attr:`Body.box` - exact voxels and bounding box: from the label
  index's voxel counts, else counted in the body's blocks without writing a voxel
  (``formats.blockstats``).
* :meth:`Body.mask`, :meth:`Body.runs`, :meth:`Body.sparsevol`, :meth:`Body.sparsevol_coarse` -
  decoding only the body's chunks; the sparse volumes are DVID's bytes in its three formats
  (``formats.sparsevol``), also block by block (:meth:`Body.sparsevol_parts`, what a server
  streams) and under DVID's ``minx`` .. ``maxz`` bounds.
* :meth:`Body.exists` - whether a chunk lists the body (the label index, else the lists); an
  id with no voxel raises `NotFoundError` from every other answer, saying what the id is
  instead when that is cheap to know (a supervoxel of body B).
* :meth:`Body.mesh` - one watertight surface from per-chunk marching cubes
  (``formats.mesh.mesh_cells``: neighbouring cells meet exactly, welded into one mesh), in nm.

The dataset is duck-typed (``scale``, ``shards``, ``shard``, ``reader``, ``read``), as in
:mod:`dvidshards.query`: this module sits below ``dataset.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from .errors import NotFoundError, SpecError
from .formats.labelindex import labels_id
from .formats.labels import Supervoxels, as_labels
from .formats.mesh import Mesh, merge_fragments, mesh_cells, to_nm
from .formats.sparsevol import (
    BLOCKS_HEADER,
    HEADER,
    RunOrder,
    SparsevolError,
    binary_block_bits,
    encode_coarse,
    merge_runs,
)
from .query import (
    BodyIndex,
    BodyMask,
    IndexRows,
    body_bits,
    body_mask,
    chunks_with,
    count_blocks,
    lookup,
    record_ids,
    shard_groups,
    sorted_chunks,
)

__all__ = ["FORMATS", "Body", "chunk_decoder", "mesh_chunks", "parse_bounds"]

_U64 = 1 << 64
_I32 = (-(1 << 31), (1 << 31) - 1)
FORMATS = ("rles", "srles", "blocks")  # DVID's sparsevol formats


def parse_bounds(bounds) -> tuple[np.ndarray, np.ndarray] | None:
    """DVID's ``minx`` .. ``maxz`` bounds as (lo, hi) int64 arrays, both inclusive; None: none.

    ``bounds`` is ``((minx, miny, minz), (maxx, maxy, maxz))`` in voxels of the scale, any
    entry None (unbounded), or None.
    """
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


def chunk_decoder(ds, scale=0, labels="agglomerated", *, fill_missing_shards: bool = False
                  ) -> Callable[[tuple[int, int, int]], np.ndarray | None]:
    """A function decoding one chunk of a scale: ``(x, y, z) -> (z, y, x) array or None``.

    Voxels outside the volume (a partial edge chunk) are 0; a chunk outside the volume, or one
    no shard holds, is None (background). Thread-safe: each call decodes into a new array.

    Parameters
    ----------
    ds : Dataset
    scale : int
    labels : "agglomerated", "supervoxels" or a mapping
    fill_missing_shards : bool
        Read a missing shard file as background instead of raising ``MissingShardError``.
    """
    s = ds.scale(scale)
    src = as_labels(labels)
    reader = ds.reader(s, src, fill_missing_shards=fill_missing_shards)
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


def mesh_chunks(decode, chunks, chunk: int = 64, **kw):
    """The cells to mesh for a set of chunks holding a body: each chunk and its - neighbours.

    The cell of chunk ``c - 1`` holds the surface between ``c - 1`` and ``c`` (cells reach
    one voxel into their + neighbours), so a body's surface lies in the cells of its chunks
    and of their - neighbours. Returns ``mesh_cells(decode, cells, chunk, **kw)``.
    """
    c = np.asarray(chunks, np.int64).reshape(-1, 3)
    d = np.array([[i, j, k] for k in (0, 1) for j in (0, 1) for i in (0, 1)], np.int64)
    cells = np.unique((c[:, None, :] - d[None, :, :]).reshape(-1, 3), axis=0) if len(c) else c
    return mesh_cells(decode, cells, chunk, **kw)


class Body:
    """One body (or one supervoxel) of an export, answered on demand.

    Parameters
    ----------
    ds : Dataset
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
        labels for a supervoxel (``labels="supervoxels"``: its body's rows, by the index's
        supervoxel table); its scale's chunk list and voxel counts are used instead of scanning
        the records' lists.

    Notes
    -----
    Results are cached per scale on the object (chunks, size, box); masks, runs and meshes are
    computed on each call.
    """

    def __init__(self, ds, id, scale=0, labels="agglomerated", index=None) -> None:
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

    def _scale(self, scale):
        return self.ds.scale(self.scale if scale is None else scale)

    # --- chunks, size, box ------------------------------------------------------------------

    def chunks_at(self, scale=None) -> np.ndarray:
        """(n, 3) int64 chunk coordinates (x, y, z) holding the body at a scale, sorted z, y, x.

        From the label index when it is of that scale. When it is of a finer scale, its blocks
        coarsened (DVID's rule: a coarse voxel takes a label of its finer cell) are the
        candidates, kept where the records' lists hold the body (no decompression). Else a scan
        of the scale's lists. Empty when no chunk holds the body (see `exists`).
        """
        s = self._scale(scale)
        c = self._chunks.get(s.index)
        if c is None:
            idx = self.index
            if idx is not None and idx.scale == s.index:
                c = sorted_chunks(self._index_rows().chunks)
            elif idx is not None and idx.scale < s.index and self._coarsens(idx, s):
                fine = self._index_rows().chunks >> (s.index - idx.scale)
                c = self._listed(s, np.unique(fine, axis=0) if len(fine) else fine)
            else:
                c = chunks_with(self.ds, [self.id], s.index, self.labels)
            self._chunks[s.index] = c
        return c

    def _index_rows(self) -> IndexRows:
        """This id's rows of the label index (a supervoxel's: its body's rows holding it)."""
        assert self.index is not None
        if isinstance(self.labels, Supervoxels) and self.index.meta.get("labels") == "agglomerated":
            return self.index.supervoxel_rows(self.id)
        return self.index.rows(self.id)

    def _coarsens(self, idx: BodyIndex, s) -> bool:
        """Whether scale ``s`` is ``idx``'s scale downsampled by 2 per level, with its chunk size."""
        try:
            fine = self.ds.scale(idx.scale)
        except SpecError:
            return False
        k = s.index - idx.scale
        return tuple(fine.chunk_size) == tuple(s.chunk_size) and all(
            -(-int(n) // (1 << k)) == int(m) for n, m in zip(fine.size, s.size, strict=True))

    def _listed(self, s, candidates) -> np.ndarray:
        """The candidate chunks whose records' lists hold the body, sorted z, y, x."""
        reader = self.ds.reader(s, self.labels)
        keep: list[np.ndarray] = []
        target = np.uint64(self.id)
        for group in _by_shard(s, candidates):
            shard = reader.shard(*(int(v) for v in group[0]))
            if shard is None:
                continue
            found = [(i, c) for i, c in ((shard.find(*(int(v) for v in c)), c) for c in group) if i is not None]
            if not found:
                continue
            t = shard.table(np.asarray([i for i, _ in found], np.int64))
            vals, owner = record_ids(t, self.labels)
            hit = np.unique(owner[vals == target])
            keep.extend(found[int(k)][1] for k in hit)
        c = np.asarray(keep, np.int64).reshape(-1, 3)
        return c[np.lexsort((c[:, 0], c[:, 1], c[:, 2]))]

    @property
    def chunks(self) -> np.ndarray:
        """(n, 3) chunk coordinates (x, y, z) holding the body at its scale (see `chunks_at`).

        Raises
        ------
        NotFoundError
            If no chunk holds the body at its scale (the message says what the id is instead,
            when known).
        """
        c = self.chunks_at()
        if not len(c):
            raise self.not_found()
        return c

    def exists(self, scale=None) -> bool:
        """Whether a chunk holds the body at a scale (default: its own): the label index's rows,
        else the records' lists (no block decompressed; without an index, a scan of the scale's
        lists, kept for the other answers)."""
        return bool(len(self.chunks_at(scale)))

    def not_found(self, scale=None, why: str = "") -> NotFoundError:
        """The error for this id having no voxel at a scale, saying what the id is instead.

        Without a label index the records' lists are looked at (as finding the body's chunks
        did): an id that is a supervoxel of another body says so, as does a body asked for as
        a supervoxel. With an index no scan is made.
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
            c = chunks_with(self.ds, [self.id], s.index, "supervoxels")
            if len(c):
                b = self._body_of_supervoxel(s, c[0])
                return NotFoundError(f"{self.id} is a supervoxel of body {b}{where}, not a body: ask for body {b}, "
                                     f"or pass labels='supervoxels'")
        elif len(chunks_with(self.ds, [self.id], s.index, "agglomerated")):
            return NotFoundError(f"{self.id} is a body{where}, not a supervoxel: its supervoxels are "
                                 f"Body({self.id}).supervoxels()")
        return NotFoundError(f"{self.id} is not in this export at scale {s.index} ({self.labels.name} labels)")

    def _body_of_supervoxel(self, s, chunk) -> int:
        reader = self.ds.reader(s, self.labels)
        x, y, z = (int(v) for v in chunk)
        shard = reader.shard(x, y, z)
        i = shard.find(x, y, z) if shard is not None else None
        if shard is None or i is None:
            return 0
        t = shard.table(np.asarray([i], np.int64))
        svs = t.supervoxels(0)
        pal = self.labels.palette(t, 0)
        pal = svs if pal is None else np.asarray(pal, np.uint64)
        return int(pal[np.flatnonzero(svs == np.uint64(self.id))[0]])

    def _count(self, s) -> tuple[int, list | None]:
        """(voxels, exact box) at a scale, counted in the body's blocks (no voxel written)."""
        got = self._stats.get(s.index)
        if got is not None:
            return got
        chunks = self.chunks_at(s.index)
        cs = np.asarray(s.chunk_size, np.int64)
        vlo = np.asarray(s.voxel_offset, np.int64)
        vhi = vlo + np.asarray(s.size, np.int64)
        reader = self.ds.reader(s, self.labels)
        total = 0
        lo = np.full(3, np.iinfo(np.int64).max)
        hi = np.full(3, np.iinfo(np.int64).min)
        target = np.uint64(self.id)
        rows_c, rows_sv, rows_n = [np.zeros((0, 3), np.int64)], [np.zeros(0, np.uint64)], [np.zeros(0, np.int64)]
        for group in _by_shard(s, chunks):
            shard = reader.shard(*(int(v) for v in group[0]))
            if shard is None:
                continue
            rows, coords = [], []
            for c in group:
                i = shard.find(*(int(v) for v in c))
                if i is not None:
                    rows.append(i)
                    coords.append(c)
            if not rows:
                continue
            t = shard.table(np.asarray(rows, np.int64))
            org = np.asarray(coords, np.int64) * cs
            blk, ids, sv, vox, bx = count_blocks(t, np.arange(len(rows)), np.clip(vlo - org, 0, cs),
                                                 np.clip(vhi - org, 0, cs), self.labels)
            hit = ids == target
            if not hit.any():
                continue
            total += int(vox[hit].sum())
            b = bx[hit] + np.hstack([org, org])[blk[hit]]
            lo = np.minimum(lo, b[:, :3].min(axis=0))
            hi = np.maximum(hi, b[:, 3:].max(axis=0))
            rows_c.append(org[blk[hit]] // cs)
            rows_sv.append(sv[hit])
            rows_n.append(vox[hit])
        box = [lo.tolist(), hi.tolist()] if total else None
        self._stats[s.index] = (total, box)
        self._rows[s.index] = (np.concatenate(rows_c), np.concatenate(rows_sv), np.concatenate(rows_n))
        return total, box

    def supervoxel_counts(self, scale=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The body's label index at a scale: one row per (chunk, supervoxel) holding it.

        From the label index when it is of that scale, else counted in the body's blocks.

        Returns
        -------
        (chunks, supervoxels, voxels)
            (n, 3) int64 chunk coordinates, ``uint64`` supervoxels, ``int64`` voxels.

        Raises
        ------
        NotFoundError
            If the body has no voxel at that scale.
        """
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

    def supervoxel_sizes(self, scale=None) -> dict[int, int]:
        """``{supervoxel: voxels}`` of the body at a scale, sorted by supervoxel (DVID's
        ``/supervoxel-sizes``); NotFoundError if it has no voxel."""
        _, sv, n = self.supervoxel_counts(scale)
        u, inv = np.unique(sv, return_inverse=True)
        tot = np.bincount(inv.reshape(-1), weights=n, minlength=len(u)).astype(np.int64)
        return dict(zip(u.tolist(), tot.tolist(), strict=True))

    def size_at(self, scale=None) -> int:
        """Voxels of the body at a scale (the label index's count when it is of that scale).

        Raises
        ------
        NotFoundError
            If the body has no voxel at that scale.
        """
        s = self._scale(scale)
        if self.index is not None and self.index.scale == s.index:
            n = int(self._index_rows().voxels.sum())
        else:
            n = self._count(s)[0]
        if not n:
            raise self.not_found(s.index)
        return n

    @property
    def size(self) -> int:
        """Voxels of the body at its scale (DVID's ``/size``); NotFoundError if none."""
        return self.size_at()

    def box_at(self, scale=None) -> list:
        """Exact voxel box ``[[x0, y0, z0], [x1, y1, z1]]`` at a scale; NotFoundError if no voxel."""
        s = self._scale(scale)
        box = self._count(s)[1]
        if box is None:
            raise self.not_found(s.index)
        return box

    @property
    def box(self) -> list:
        """Exact voxel box ``[[x0, y0, z0], [x1, y1, z1]]`` at its scale, upper bound exclusive."""
        return self.box_at()

    def supervoxels(self) -> np.ndarray:
        """Sorted supervoxel ids of the body (from the label index, else the records' lists).

        Raises
        ------
        NotFoundError
            If the body has no voxel at its scale.
        """
        if self.index is not None:
            svs = np.unique(self._index_rows().supervoxels)
            if not len(svs):
                raise self.not_found()
            return svs
        if isinstance(self.labels, Supervoxels):
            self.chunks  # noqa: B018 - NotFoundError when absent
            return np.array([self.id], np.uint64)
        s = self.ds.scale(self.scale)
        reader = self.ds.reader(s, self.labels)
        found = [np.zeros(0, np.uint64)]
        for group in _by_shard(s, self.chunks):
            shard = reader.shard(*(int(v) for v in group[0]))
            rows = [i for i in (shard.find(*(int(v) for v in c)) for c in group) if i is not None] \
                if shard is not None else []
            if not rows:
                continue
            t = shard.table(np.asarray(rows, np.int64))
            for k in range(len(rows)):
                svs = t.supervoxels(k)
                pal = self.labels.palette(t, k)
                found.append(svs[np.asarray(pal, np.uint64) == np.uint64(self.id)])
        out = np.unique(np.concatenate(found))
        if not len(out):
            raise self.not_found()
        return out

    # --- voxels -----------------------------------------------------------------------------

    def _present(self, s) -> np.ndarray:
        c = self.chunks_at(s.index)
        if not len(c):
            raise self.not_found(s.index)
        return c

    def mask(self, scale=None) -> BodyMask:
        """The body as a boolean (x, y, z) mask over its exact box, decoding only its chunks.

        Returns
        -------
        BodyMask
            ``(mask, box)``.

        Raises
        ------
        NotFoundError
            If the body has no voxel at that scale.
        """
        s = self._scale(scale)
        m = body_mask(self.ds, self.id, s.index, self.labels, chunks=self._present(s))
        if m.box is None:
            raise self.not_found(s.index)
        return m

    def block_bits(self, scale=None, bounds=None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The body's chunks one by one, in (z, y, x) order: ``(chunk (x, y, z), bits)``.

        ``bits`` is `formats.sparsevol.block_bits` of the chunk's block: uint8 (nz, ny, nx / 8),
        bit i of ``[z, y, j]`` voxel (8 j + i, y, z) of the chunk, set where it is the body
        (voxels outside the volume, and chunks absent, all 0). One numba pass over the block's
        packed values per chunk, no voxel decoded. ``bounds`` (`parse_bounds`) keeps the chunks
        that DVID's block bounds keep (the bits are not cut). Memory: one shard's run of chunks.
        """
        s = self._scale(scale)
        c = self._present(s)
        cs = np.asarray(s.chunk_size, np.int64)
        if cs[0] % 8:
            raise SpecError(f"scale {s.index}: chunks {s.chunk_size} are not a whole number of bytes along x")
        b = parse_bounds(bounds)
        if b is not None:
            c = c[((c >= b[0] // cs) & (c <= b[1] // cs)).all(axis=1)]
        yield from body_bits(self.ds, s, self.labels, self.id, c)

    def runs(self, scale=None) -> np.ndarray:
        """Maximal x-runs of the body, sorted (z, y, x): int32 (n, 4) rows x, y, z, length.

        Raises
        ------
        NotFoundError
            If the body has no voxel at that scale.
        """
        s = self._scale(scale)
        order = RunOrder(int(s.chunk_size[0]))
        out = merge_runs(*(order.add_bits(c, bits) for c, bits in self.block_bits(s.index)), order.finish())
        if not len(out):
            raise self.not_found(s.index)
        return out

    def sparsevol_parts(self, scale=None, format: str = "rles", bounds=None) -> Iterator[bytes]:
        """DVID's ``GET .../sparsevol/<id>`` bytes, block by block (what a server streams).

        ``format="srles"`` and ``"blocks"`` pieces concatenate to the response. For ``"rles"``
        the pieces are the spans without the 12-byte header (its span count is known only at
        the end: `sparsevol` adds it, a server counts the bytes). Each block's runs are read
        from its packed values by numba kernels (`block_bits`, `RunOrder.add_bits`). Memory:
        one shard's run of chunks and the runs held for the next block (one row of blocks).

        Parameters
        ----------
        scale : int, optional
            Voxels of this scale (default: the body's).
        format : {"rles", "srles", "blocks"}
        bounds : ((minx, miny, minz), (maxx, maxy, maxz)), optional
            DVID's inclusive voxel bounds (entries may be None): chunks outside them are
            skipped and runs cut (``blocks``: chunks only, as DVID does).

        Raises
        ------
        NotFoundError
            If no chunk of the body lies within the bounds at that scale.
        """
        if format not in FORMATS:
            raise SpecError(f"format must be one of {FORMATS}, got {format!r}")
        s = self._scale(scale)
        cs = np.asarray(s.chunk_size, np.int64)
        b = parse_bounds(bounds)
        if format != "blocks" and len({int(v) for v in s.chunk_size}) != 1:
            raise SpecError(f"scale {s.index}: DVID's run order needs cubic chunks, got {s.chunk_size}")
        parts = self.block_bits(s.index, bounds)
        first = next(parts, None)
        if first is None:
            raise self.not_found(s.index, "within the bounds")
        if format == "blocks":
            g = [int(v) // 8 for v in s.chunk_size]
            yield BLOCKS_HEADER.pack(g[0], g[1], g[2], self.id)
            for c, bits in _chain(first, parts):
                yield binary_block_bits(c * cs, bits)
            return
        order = RunOrder(int(cs[0]), bounds=b)
        for c, bits in _chain(first, parts):
            done = order.add_bits(c, bits)
            if len(done):
                yield done.astype("<i4").tobytes()
        done = order.finish()
        if len(done):
            yield done.astype("<i4").tobytes()

    def sparsevol(self, scale=None, order: str = "dvid", *, format: str = "rles",
                  bounds=None) -> bytes:
        """DVID's ``GET .../sparsevol/<id>?scale=N&format=...`` bytes.

        Parameters
        ----------
        scale : int, optional
            Runs in voxels of this scale (default: the body's).
        order : {"dvid", "zyx"}
            Runs of ``rles``/``srles``: ``"dvid"``, the order DVID streams them in (block by
            block; see `dvidshards.formats.sparsevol.RunOrder`); ``"zyx"``: sorted.
        format : {"rles", "srles", "blocks"}
            Legacy RLEs with their header (default), streaming RLEs, or binary blocks.
        bounds : ((minx, miny, minz), (maxx, maxy, maxz)), optional
            DVID's inclusive voxel bounds (see `sparsevol_parts`). As DVID, an ``rles`` answer
            with chunks in the bounds but no voxel is empty (no header).

        Raises
        ------
        NotFoundError
            If the body has no voxel at that scale (DVID answers 404), or no chunk within the
            bounds.
        """
        if order not in ("dvid", "zyx"):
            raise SpecError(f"order must be 'dvid' or 'zyx', got {order!r}")
        data = b"".join(self.sparsevol_parts(scale, format, bounds))
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

    def sparsevol_coarse(self, scale=None, bounds=None) -> bytes:
        """DVID's ``GET .../sparsevol-coarse/<id>`` bytes: runs of the chunks holding the body.

        Block coordinates of a scale (default the body's; DVID's are those of scale 0, its
        label index's blocks); no block is decompressed. ``bounds`` (voxels, inclusive) keeps
        the blocks DVID's block bounds keep.

        Raises
        ------
        NotFoundError
            If no chunk holds the body (within the bounds).
        """
        s = self._scale(scale)
        c = self._present(s)
        b = parse_bounds(bounds)
        if b is not None:
            cs = np.asarray(s.chunk_size, np.int64)
            c = c[((c >= b[0] // cs) & (c <= b[1] // cs)).all(axis=1)]
            if not len(c):
                raise self.not_found(s.index, "within the bounds")
        return encode_coarse(c)

    def mesh(self, scale=None, *, units: str = "nm", reduction_factor: int = 0, max_error: float = 8,
             chunks=None) -> Mesh:
        """One watertight mesh of the body from its chunks' cells (marching cubes, zmesh).

        Parameters
        ----------
        scale : int, optional
            Scale to mesh (default: the body's); a coarser scale is faster.
        units : {"nm", "voxels"}
            Vertex units: nm (the scale's resolution), or voxel corner coordinates of the scale.
        reduction_factor, max_error :
            Per-cell simplification (``formats.mesh.mesh_block``); cell faces are kept, so the
            welded mesh stays closed. 0 keeps every marching-cubes triangle.
        chunks : array_like of int, shape (n, 3), optional
            Chunks to look in, a superset of the body's at that scale (e.g. a label index's
            blocks of a finer scale, coarsened); default `chunks_at`.

        Returns
        -------
        Mesh
            Empty when ``chunks`` are given and hold no voxel of the body.

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
        decode = chunk_decoder(self.ds, s.index, self.labels)
        target = np.uint64(self.id)
        chunks = self._present(s) if chunks is None else np.asarray(chunks, np.int64).reshape(-1, 3)
        holds = {tuple(c) for c in chunks.tolist()}

        def mask(c):
            if tuple(c) not in holds:  # the lists say the body is not there: no need to decode
                return None
            a = decode(c)
            if a is None:
                return None
            m = a == target
            return m if m.any() else None

        frags = [m[1] for _, out in mesh_chunks(mask, chunks, int(s.chunk_size[0]),
                                                labels=[1], reduction_factor=reduction_factor,
                                                max_error=max_error)
                 for m in out.items()]
        mesh = merge_fragments(frags)
        return to_nm(mesh, s.resolution) if units == "nm" and len(mesh.faces) else mesh


def _chain(first, rest):
    yield first
    yield from rest


def _by_shard(s, chunks) -> list[np.ndarray]:
    """Chunks grouped by the shard holding them (each group non-empty)."""
    c = np.asarray(chunks, np.int64).reshape(-1, 3)
    return [c[g] for g in shard_groups(s, c)]
