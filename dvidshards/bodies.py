"""One body on demand: its chunks, size, box, mask, DVID sparse volumes and mesh.

``Body(ds, id)`` is what a neuclease user asks DVID for one body (``fetch_size``,
``fetch_sparsevol``, ``fetch_sparsevol_coarse``, the label index, a mask), answered from the
export without a whole-export job first:

* :attr:`Body.chunks` - the chunks holding the body: from a label index when one is given
  (``index=``), else from the records' label lists with no decompression
  (:func:`dvidshards.query.chunks_with`).
* :attr:`Body.size` and :attr:`Body.box` - exact voxels and bounding box: from the label
  index's voxel counts, else counted in the body's blocks without writing a voxel
  (``formats.blockstats``).
* :meth:`Body.mask`, :meth:`Body.runs`, :meth:`Body.sparsevol`, :meth:`Body.sparsevol_coarse` -
  decoding only the body's chunks; the sparse volumes are DVID's binary RLE bytes
  (``formats.sparsevol``).
* :meth:`Body.mesh` - one watertight surface from per-chunk marching cubes
  (``formats.mesh.mesh_cells``: neighbouring cells meet exactly, welded into one mesh), in nm.

The dataset is duck-typed (``scale``, ``shards``, ``shard``, ``reader``, ``read``), as in
:mod:`dvidshards.query`: this module sits below ``dataset.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .errors import BlockDecodeError, ShardFormatError, SpecError
from .formats.blockstats import BlockError, batch_stats
from .formats.labelindex import labels_id
from .formats.labels import Supervoxels, as_labels
from .formats.mesh import Mesh, merge_fragments, mesh_cells, to_nm
from .formats.records import R_NSV
from .formats.sparsevol import encode_coarse, encode_runs, merge_runs, runs_from_mask
from .query import BodyIndex, BodyMask, body_mask, chunks_with

__all__ = ["Body", "chunk_decoder", "mesh_chunks"]

_U64 = 1 << 64


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
        A label index (``dvidshards label-index``) of the same label source; its scale's chunk
        list and voxel counts are used instead of scanning the records' lists.

    Notes
    -----
    Results are cached per scale on the object (chunks, size, box); masks, runs and meshes are
    computed on each call.
    """

    def __init__(self, ds, id, scale=0, labels="agglomerated", index=None) -> None:  # noqa: A002 - DVID's name
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
            if any(idx.meta.get(k) != v for k, v in labels_id(self.labels).items()):
                raise SpecError(f"{idx.path}: the index is of {idx.meta.get('labels')} labels, not "
                                f"{self.labels.name}")
            self.index = idx
        self._chunks: dict[int, np.ndarray] = {}
        self._stats: dict[int, tuple[int, list | None]] = {}

    def __repr__(self) -> str:
        return f"Body({self.id}, scale={self.scale}, labels={self.labels.name!r})"

    def _scale(self, scale):
        return self.ds.scale(self.scale if scale is None else scale)

    # --- chunks, size, box ------------------------------------------------------------------

    def chunks_at(self, scale=None) -> np.ndarray:
        """(n, 3) int64 chunk coordinates (x, y, z) holding the body at a scale, sorted z, y, x.

        From the label index when it is of that scale; else from the records' label lists
        (no decompression: a scan of the scale's shard tables).
        """
        s = self._scale(scale)
        c = self._chunks.get(s.index)
        if c is None:
            if self.index is not None and self.index.scale == s.index:
                c = self.index.blocks(self.id)
            else:
                c = chunks_with(self.ds, [self.id], s.index, self.labels)
            self._chunks[s.index] = c
        return c

    @property
    def chunks(self) -> np.ndarray:
        """(n, 3) chunk coordinates (x, y, z) holding the body at its scale (see `chunks_at`)."""
        return self.chunks_at()

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
            blocks = [t.block(k) for k in range(len(rows))]
            offs = np.zeros(len(rows) + 1, np.int64)
            np.cumsum([len(b) for b in blocks], out=offs[1:])
            try:
                blk, ent, sv, vox, bx = batch_stats(np.frombuffer(b"".join(blocks), np.uint8), offs,
                                                    np.clip(vlo - org, 0, cs), np.clip(vhi - org, 0, cs),
                                                    np.ascontiguousarray(t.rec[:, R_NSV]))
            except BlockError as e:
                kind = ShardFormatError if e.list_mismatch else BlockDecodeError
                raise kind(f"{t.where(int(e.index))}: {e}") from None
            ids = sv.astype(np.uint64)
            for k in np.unique(blk).tolist():
                pal = self.labels.palette(t, k)
                if pal is not None:
                    sel = blk == k
                    ids[sel] = np.asarray(pal, np.uint64)[ent[sel]]
            hit = ids == target
            if not hit.any():
                continue
            total += int(vox[hit].sum())
            b = bx[hit] + np.hstack([org, org])[blk[hit]]
            lo = np.minimum(lo, b[:, :3].min(axis=0))
            hi = np.maximum(hi, b[:, 3:].max(axis=0))
        box = [lo.tolist(), hi.tolist()] if total else None
        self._stats[s.index] = (total, box)
        return total, box

    def size_at(self, scale=None) -> int:
        """Voxels of the body at a scale (the label index's count when it is of that scale)."""
        s = self._scale(scale)
        if self.index is not None and self.index.scale == s.index:
            return self.index.size(self.id)
        return self._count(s)[0]

    @property
    def size(self) -> int:
        """Voxels of the body at its scale (DVID's ``/size``)."""
        return self.size_at()

    def box_at(self, scale=None) -> list | None:
        """Exact voxel box ``[[x0, y0, z0], [x1, y1, z1]]`` at a scale (None: no voxel)."""
        return self._count(self._scale(scale))[1]

    @property
    def box(self) -> list | None:
        """Exact voxel box ``[[x0, y0, z0], [x1, y1, z1]]`` at its scale, upper bound exclusive."""
        return self.box_at()

    def supervoxels(self) -> np.ndarray:
        """Sorted supervoxel ids of the body (from the label index, else the records' lists)."""
        if self.index is not None:
            return np.asarray(sorted(self.index.supervoxel_sizes(self.id)), np.uint64)
        if isinstance(self.labels, Supervoxels):
            return np.array([self.id], np.uint64) if len(self.chunks) else np.zeros(0, np.uint64)
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
        return np.unique(np.concatenate(found))

    # --- voxels -----------------------------------------------------------------------------

    def mask(self, scale=None) -> BodyMask:
        """The body as a boolean (x, y, z) mask over its exact box, decoding only its chunks.

        Returns
        -------
        BodyMask
            ``(mask, box)``; an empty mask and box None when the body has no voxel.
        """
        s = self._scale(scale)
        return body_mask(self.ds, self.id, s.index, self.labels, chunks=self.chunks_at(s.index))

    def runs(self, scale=None) -> np.ndarray:
        """Maximal x-runs of the body, sorted (z, y, x): int32 (n, 4) rows x, y, z, length."""
        s = self._scale(scale)
        decode = chunk_decoder(self.ds, s.index, self.labels)
        cs = np.asarray(s.chunk_size, np.int64)
        target = np.uint64(self.id)
        parts = []
        for c in self.chunks_at(s.index):
            a = decode(c)
            if a is None:
                continue
            m = a == target
            if m.any():
                parts.append(runs_from_mask(m.T, c * cs))
        return merge_runs(*parts)

    def sparsevol(self, scale=None, order: str = "dvid") -> bytes:
        """DVID's ``GET .../sparsevol/<id>?scale=N`` bytes (legacy ``rles`` format).

        Parameters
        ----------
        scale : int, optional
            Runs in voxels of this scale (default: the body's).
        order : {"dvid", "zyx"}
            ``"dvid"``: the order DVID streams runs in (block by block; see
            `dvidshards.formats.sparsevol.dvid_order`); ``"zyx"``: sorted.

        Raises
        ------
        SpecError
            If the body has no voxel (DVID answers 404).
        """
        s = self._scale(scale)
        runs = self.runs(s.index)
        if not len(runs):
            raise SpecError(f"body {self.id} has no voxel at scale {s.index}")
        return encode_runs(runs, order=order, block_size=int(s.chunk_size[0]))

    def sparsevol_coarse(self) -> bytes:
        """DVID's ``GET .../sparsevol-coarse/<id>`` bytes: runs of the chunks holding the body.

        Block coordinates of the body's scale (DVID's are those of scale 0, its label index's
        blocks); no block is decompressed.

        Raises
        ------
        SpecError
            If no chunk holds the body.
        """
        c = self.chunks
        if not len(c):
            raise SpecError(f"body {self.id} has no chunk at scale {self.scale}")
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
            Empty when the body has no voxel at that scale.

        Raises
        ------
        SpecError
            If ``units="nm"`` and the scale's resolution is unknown (geometry inferred).
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
        chunks = self.chunks_at(s.index) if chunks is None else np.asarray(chunks, np.int64).reshape(-1, 3)
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


def _by_shard(s, chunks) -> list[np.ndarray]:
    """Chunks grouped by the shard holding them (each group non-empty)."""
    c = np.asarray(chunks, np.int64).reshape(-1, 3)
    if not len(c):
        return []
    e = np.asarray([min(s.shard_extent, 1 << 40)] * 3, np.int64) // np.asarray(s.chunk_size, np.int64)
    key = c // np.maximum(e, 1)
    _, inv = np.unique(key, axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    return [c[inv == k] for k in range(int(inv.max()) + 1)]
