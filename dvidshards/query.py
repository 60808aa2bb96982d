"""Label queries from the records' label lists, and per-body look-ups in a label index.

The ``Dataset`` methods ``labels``, ``chunks_with``, ``body_index`` and ``body_mask`` delegate
here:

* :func:`labels_in_box` - the ids in a box: chunks inside the box from their label lists (no
  decompression), the chunks the box cuts through decoded.
* :func:`chunks_with` - the chunks whose lists hold any of some ids: a vectorised scan of the
  list columns, no zstd.
* :class:`BodyIndex` - DVID's ``LabelIndex`` of one body (its chunks, supervoxel sizes, box)
  from the Parquet dataset written by :func:`dvidshards.jobs.stats.label_index`.
* :func:`body_mask` - a body as a mask over its bounding box, decoding only its chunks (DVID's
  ``sparsevol``).

The lists name the labels a block holds: DVID lists exactly those, so a chunk inside the box
holds every label of its list. Background (0) is reported when a chunk of the box is absent
or a list or decoded chunk holds it.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import NamedTuple

import numpy as np

from .errors import SpecError
from .formats.labelindex import INDEX_SCHEMA, bucket_name, bucket_of, labels_id
from .formats.labels import Mapped, Supervoxels, as_labels
from .formats.records import list_values

__all__ = ["BodyIndex", "BodyMask", "body_mask", "chunks_with", "labels_in_box"]


def _box(box, s) -> tuple[np.ndarray, np.ndarray]:
    return s.check_box(box)


def _record_ids(t, src) -> tuple[np.ndarray, np.ndarray]:
    """Every record's ids under a label source (flat) and the record each belongs to."""
    if isinstance(src, Supervoxels):
        return list_values(t, "supervoxels")
    if isinstance(src, Mapped):
        sv, owner = list_values(t, "supervoxels")
        return np.asarray(src.mapping.palette(sv), np.uint64), owner
    return list_values(t, "labels")


def _ids(ids) -> np.ndarray:
    a = np.atleast_1d(np.asarray(ids))
    if a.dtype.kind not in "ui" or (a.dtype.kind == "i" and a.size and a.min() < 0):
        raise SpecError(f"ids must be non-negative integers, got {a.dtype} values")
    return np.unique(a.astype(np.uint64))


def chunks_with(ds, ids, scale=0, labels="agglomerated") -> np.ndarray:
    """Chunks whose label lists hold any of ``ids``, without decompressing any block.

    Parameters
    ----------
    ds : Dataset
    ids : int or array_like of int
        Body ids (or supervoxel ids with ``labels="supervoxels"``).
    scale : int
    labels : "agglomerated", "supervoxels" or a mapping

    Returns
    -------
    numpy.ndarray
        (n, 3) int64 chunk coordinates (x, y, z), sorted by z, y, x. Absent chunks are
        background but hold no list: id 0 finds only the chunks that list it.
    """
    s = ds.scale(scale)
    src = as_labels(labels)
    want = _ids(ids)
    out = []
    for o in ds.shards(s):
        t = ds.shard(s, o).table()
        vals, owner = _record_ids(t, src)
        hit = np.unique(owner[np.isin(vals, want)])
        if hit.size:
            out.append(np.asarray(t.coords, np.int64)[hit])
    c = np.concatenate(out) if out else np.zeros((0, 3), np.int64)
    return c[np.lexsort((c[:, 0], c[:, 1], c[:, 2]))]


def labels_in_box(ds, box, scale=0, labels="agglomerated") -> np.ndarray:
    """Sorted unique ids in a voxel box: whole chunks from their lists, cut chunks decoded.

    Parameters
    ----------
    ds : Dataset
    box : [[x0, y0, z0], [x1, y1, z1]]
        Voxels (upper bound exclusive), inside the volume.
    scale : int
    labels : "agglomerated", "supervoxels" or a mapping

    Returns
    -------
    numpy.ndarray
        ``uint64`` ids, sorted; 0 when background is in the box.

    Raises
    ------
    SpecError
        If the box is not inside the volume.
    MissingShardError
        If a shard file the box needs is missing (as ``Dataset.read`` does).
    """
    s = ds.scale(scale)
    src = as_labels(labels)
    lo, hi = _box(box, s)
    if (hi <= lo).any():
        return np.zeros(0, np.uint64)
    cs = np.asarray(s.chunk_size, np.int64)
    clo, chi = lo // cs, -(-hi // cs)
    reader = ds.reader(s, src)
    found = [np.zeros(0, np.uint64)]
    present = 0
    so = min(s.shard_extent, 1 << 40) // cs  # chunks per shard side
    for sx in range(clo[0] // so[0], (chi[0] - 1) // so[0] + 1):
        for sy in range(clo[1] // so[1], (chi[1] - 1) // so[1] + 1):
            for sz in range(clo[2] // so[2], (chi[2] - 1) // so[2] + 1):
                first = np.maximum(clo, np.array([sx, sy, sz]) * so)
                shard = reader.shard(*(int(v) for v in first))
                if shard is None:  # missing and filled as background
                    continue
                c = np.asarray(shard.coords, np.int64)
                rows = np.flatnonzero(((c >= clo) & (c < chi)).all(axis=1))
                present += rows.size
                if not rows.size:
                    continue
                c = c[rows]
                whole = ((c * cs >= lo) & ((c + 1) * cs <= hi)).all(axis=1)
                if whole.any():
                    t = shard.table(rows[whole])
                    vals, _ = _record_ids(t, src)
                    found.append(np.unique(vals))
                for cc in c[~whole]:  # cut by the box: decode the part inside
                    a = np.maximum(cc * cs, lo)
                    b = np.minimum((cc + 1) * cs, hi)
                    found.append(np.unique(ds.read([a, b], s.index, src)))
    if present < int(np.prod(chi - clo)):
        found.append(np.zeros(1, np.uint64))  # absent chunks are background
    return np.unique(np.concatenate(found))


# --------------------------------------------------------------------------- label index


class BodyIndex:
    """Per-body look-ups in a label index written by :func:`dvidshards.jobs.stats.label_index`.

    Parameters
    ----------
    path : path
        The label-index folder (holding ``_meta.json`` and ``bucket=*/part-0.parquet``).

    Attributes
    ----------
    meta : dict
        The index's ``_meta.json`` (scale, label source, bits, geometry, completeness).

    Notes
    -----
    A body's rows are all in one bucket file, sorted by body in row groups, so one look-up
    reads the row groups whose body range holds it.
    """

    def __init__(self, path):
        self.path = os.fspath(path)
        meta_path = os.path.join(self.path, "_meta.json")
        try:
            with open(meta_path) as f:
                self.meta = json.load(f)
        except FileNotFoundError:
            raise SpecError(f"{self.path}: not a label index (no _meta.json)") from None
        except (OSError, ValueError) as e:
            raise SpecError(f"{meta_path}: cannot read ({e})") from None
        if self.meta.get("format") != "dvidshards-label-index":
            raise SpecError(f"{meta_path}: not a dvidshards label index")
        if not self.meta.get("complete", False):
            warnings.warn(f"{self.path}: the label index is incomplete; missing shards: "
                          f"{list(self.meta.get('failed_shards', {}))}", RuntimeWarning, stacklevel=2)
        self.bits = int(self.meta["bits"])
        self.scale = int(self.meta["scale"])

    def __repr__(self) -> str:
        return f"BodyIndex({self.path!r}, scale={self.scale}, labels={self.meta.get('labels')!r})"

    def _file(self, body: int) -> str:
        return os.path.join(self.path, bucket_name(int(bucket_of(np.uint64(body), self.bits)), self.bits))

    def rows(self, body):
        """All rows of a body as a ``pyarrow.Table`` (body, supervoxel, chunk_x/y/z, voxels)."""
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        body = int(body)
        if body < 0 or body >= 1 << 64:
            raise SpecError(f"body must be a uint64 id, got {body}")
        path = self._file(body)
        if not os.path.exists(path):
            return INDEX_SCHEMA.empty_table()
        return pq.read_table(path, filters=pc.field("body") == pa.scalar(body, pa.uint64()))

    def blocks(self, body) -> np.ndarray:
        """(n, 3) int64 chunk coordinates holding the body, sorted by z, y, x."""
        t = self.rows(body)
        c = np.stack([t[k].to_numpy().astype(np.int64) for k in ("chunk_x", "chunk_y", "chunk_z")], axis=1)
        c = np.unique(c, axis=0) if len(c) else c.reshape(0, 3)
        return c[np.lexsort((c[:, 0], c[:, 1], c[:, 2]))]

    def supervoxel_sizes(self, body) -> dict[int, int]:
        """``{supervoxel: voxels}`` of a body, sorted by supervoxel (empty if absent)."""
        t = self.rows(body)
        sv = t["supervoxel"].to_numpy()
        vox = t["voxels"].to_numpy()
        u, inv = np.unique(sv, return_inverse=True)
        return dict(zip(u.tolist(), np.bincount(inv, weights=vox, minlength=len(u)).astype(np.int64).tolist(),
                        strict=True))

    def size(self, body) -> int:
        """Voxels of a body."""
        return int(self.rows(body)["voxels"].to_numpy().sum())

    def box(self, body):
        """The body's chunk-aligned box ``[[x0, y0, z0], [x1, y1, z1]]`` (voxels), clipped to the
        volume; None if the index holds no row of it. ``body_mask`` gives the exact box."""
        c = self.blocks(body)
        if not len(c):
            return None
        cs = np.asarray(self.meta["chunk_size"], np.int64)
        vlo = np.asarray(self.meta["voxel_offset"], np.int64)
        vhi = vlo + np.asarray(self.meta["size"], np.int64)
        lo = np.maximum(c.min(axis=0) * cs, vlo)
        hi = np.minimum((c.max(axis=0) + 1) * cs, vhi)
        return [lo.tolist(), hi.tolist()]


class BodyMask(NamedTuple):
    """A body's voxels: ``mask`` (x, y, z) bool over ``box`` [[x0, y0, z0], [x1, y1, z1]]."""

    mask: np.ndarray
    box: list | None


def body_mask(ds, body, scale=0, labels="agglomerated", index=None, *, chunks=None) -> BodyMask:
    """A body's voxels as a boolean mask over its exact bounding box (DVID's ``sparsevol``).

    Only the chunks holding the body are decompressed and decoded: those listed by ``index``
    (a :class:`BodyIndex` or its path) or else found by :func:`chunks_with`.

    Parameters
    ----------
    ds : Dataset
    body : int
    scale : int
    labels : "agglomerated", "supervoxels" or a mapping
    index : BodyIndex or path, optional
        A label index of the same scale and label source.
    chunks : array_like of int, shape (n, 3), optional
        The chunks holding the body, when already known (``index`` is then not used).

    Returns
    -------
    BodyMask
        ``(mask, box)``: the (x, y, z) bool mask and its voxel box; an empty mask and box
        None when no voxel holds the body.
    """
    s = ds.scale(scale)
    src = as_labels(labels)
    body = int(body)
    if chunks is not None:
        chunks = np.asarray(chunks, np.int64).reshape(-1, 3)
    elif index is not None:
        idx = index if isinstance(index, BodyIndex) else BodyIndex(index)
        if idx.scale != s.index or any(idx.meta.get(k) != v for k, v in labels_id(src).items()):
            raise SpecError(f"{idx.path}: the index is of scale {idx.scale} with {idx.meta.get('labels')} labels, "
                            f"not scale {s.index} with {src.name} labels")
        chunks = idx.blocks(body)
    else:
        chunks = chunks_with(ds, [body], s.index, src)
    cs = np.asarray(s.chunk_size, np.int64)
    vlo = np.asarray(s.voxel_offset, np.int64)
    vhi = vlo + np.asarray(s.size, np.int64)
    reader = ds.reader(s, src)
    buf = np.empty(tuple(int(v) for v in cs[::-1]), np.uint64)  # (z, y, x)
    pieces = []
    target = np.uint64(body)
    for c in chunks:
        shard = reader.shard(*(int(v) for v in c))
        if shard is None:
            continue
        org = c * cs
        ext = np.clip(vhi - org, 0, cs)
        out = buf[:ext[2], :ext[1], :ext[0]]
        if not shard.read_into(int(c[0]), int(c[1]), int(c[2]), out, src):
            continue
        m = (out == target).T  # (x, y, z)
        if not m.any():
            continue
        nz = [np.flatnonzero(m.any(axis=tuple(a for a in range(3) if a != ax))) for ax in range(3)]
        a = np.array([v[0] for v in nz])
        b = np.array([v[-1] + 1 for v in nz])
        pieces.append((org + a, m[a[0]:b[0], a[1]:b[1], a[2]:b[2]].copy()))
    if not pieces:
        return BodyMask(np.zeros((0, 0, 0), bool), None)
    lo = np.min([p[0] for p in pieces], axis=0)
    hi = np.max([p[0] + p[1].shape for p in pieces], axis=0)
    mask = np.zeros(tuple(int(v) for v in hi - lo), bool)
    for o, m in pieces:
        d = o - lo
        mask[d[0]:d[0] + m.shape[0], d[1]:d[1] + m.shape[1], d[2]:d[2] + m.shape[2]] = m
    return BodyMask(mask, [lo.tolist(), hi.tolist()])
