"""Label queries from the records' label lists, and per-body look-ups in a label index.

The ``Dataset`` methods ``labels``, ``chunks_with``, ``label_at``, ``mapping`` and ``body_mask``
delegate here: `labels_in_box` (whole chunks from their lists, cut ones decoded), `chunks_with`
(a scan of the list columns, no zstd), `label_at` (DVID's ``/labels``: one zstd frame per chunk
holding points, their entries read from the block's packed values, nothing in a solid chunk),
`unique` (cloud-volume's: solid chunks from their lists, the others counted in their blocks),
`mapping` (DVID's ``/mappings`` from the records' two lists), `body_mask` (DVID's
``sparsevol``: only the body's chunks decoded) and `BodyIndex` (DVID's ``LabelIndex`` from the
Parquet dataset ``dvidshards label-index`` writes).

DVID lists exactly the labels a block holds, so a chunk inside a box holds every label of its
list.  Background (0) is reported when a chunk of the box is absent, or a list or decoded chunk
holds it.  The dataset is any `DatasetLike` (this module sits below ``dataset.py``).
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from .errors import BlockDecodeError, MissingShardError, ShardFormatError, SpecError
from .formats.blockstats import BlockError, batch_stats
from .formats.chunkindex import pack_keys
from .formats.labelindex import INDEX_FORMAT, bucket_name, bucket_of, labels_id
from .formats.labels import LabelSource, Mapped, Supervoxels, as_labels
from .formats.mapping import LabelMapping
from .formats.multiscale import Scale
from .formats.records import R_NSV, RecordTable, list_values
from .formats.sparsevol import block_bits, entries_at
from .protocol import DatasetLike
from .read import ChunkReader
from .shard import Shard
from .stores import as_store

__all__ = ["BodyIndex", "BodyMask", "IndexRows", "SupervoxelTable", "body_bits", "body_mask", "chunks_with",
           "count_blocks", "held_scales", "ids_of", "label_at", "labels_in_box", "lookup", "mapping", "record_ids",
           "shard_groups", "sorted_chunks", "supervoxel_table", "unique"]

_U64_MAX = np.uint64((1 << 64) - 1)


def record_ids(t: RecordTable, src: LabelSource) -> tuple[np.ndarray, np.ndarray]:
    """Every record's ids under a label source (flat) and the record each belongs to."""
    if isinstance(src, Supervoxels):
        return list_values(t, "supervoxels")
    if isinstance(src, Mapped):
        sv, owner = list_values(t, "supervoxels")
        return np.asarray(src.mapping.palette(sv), np.uint64), owner
    return list_values(t, "labels")


def ids_of(t: RecordTable, k: int, src: LabelSource) -> np.ndarray:
    """Record k's label list under a label source (``uint64``, entry for entry its supervoxels')."""
    pal = src.palette(t, k)
    return t.supervoxels(k) if pal is None else np.asarray(pal, np.uint64)


def _ids(ids) -> np.ndarray:
    a = np.atleast_1d(np.asarray(ids))
    if a.dtype.kind not in "ui" or (a.dtype.kind == "i" and a.size and a.min() < 0):
        raise SpecError(f"ids must be non-negative integers, got {a.dtype} values")
    return np.unique(a.astype(np.uint64))


def chunks_with(ds: DatasetLike, ids: Any, *, scale: int | Scale = 0, labels: Any = "agglomerated") -> np.ndarray:
    """(n, 3) int64 chunks (x, y, z; sorted by z, y, x) whose label lists hold any of ``ids``
    (bodies, or supervoxels with ``labels="supervoxels"``), no block decompressed.  Absent chunks
    hold no list: id 0 finds only the chunks that list it."""
    s = ds.scale(scale)
    src = as_labels(labels)
    want = _ids(ids)
    out = []
    for o in ds.shards(s):
        t = ds.shard(s, o).table()
        vals, owner = record_ids(t, src)
        hit = np.unique(owner[np.isin(vals, want)])
        if hit.size:
            out.append(np.asarray(t.coords, np.int64)[hit])
    c = np.concatenate(out) if out else np.zeros((0, 3), np.int64)
    return c[np.lexsort((c[:, 0], c[:, 1], c[:, 2]))]


def labels_in_box(ds: DatasetLike, box: Any, *, scale: int | Scale = 0, labels: Any = "agglomerated") -> np.ndarray:
    """Sorted ``uint64`` ids in a voxel box ``[[x0, y0, z0], [x1, y1, z1]]`` inside the volume (0 when
    background is in it): whole chunks from their lists, cut chunks decoded.  MissingShardError for
    a missing shard file the box needs, as ``Dataset.read``."""
    s = ds.scale(scale)
    src = as_labels(labels)
    lo, hi = s.check_box(box)
    if (hi <= lo).any():
        return np.zeros(0, np.uint64)
    cs = np.asarray(s.chunk_size, np.int64)
    clo, chi = lo // cs, -(-hi // cs)
    reader = ds.reader(s, labels=src)
    found = [np.zeros(0, np.uint64)]
    present = 0
    for shard, rows, c in _shards_in(reader, s, clo, chi):
        present += rows.size
        whole = ((c * cs >= lo) & ((c + 1) * cs <= hi)).all(axis=1)
        if whole.any():
            found.append(np.unique(record_ids(shard.table(rows[whole]), src)[0]))
        for cc in c[~whole]:  # cut by the box: decode the part inside
            a = np.maximum(cc * cs, lo)
            b = np.minimum((cc + 1) * cs, hi)
            found.append(np.unique(ds.read([a, b], scale=s.index, labels=src)))
    if present < int(np.prod(chi - clo)):
        found.append(np.zeros(1, np.uint64))  # absent chunks are background
    return np.unique(np.concatenate(found))


# --------------------------------------------------------------------------- points


def _points(points) -> np.ndarray:
    p = np.asarray(points)
    if p.size == 0:
        return np.zeros((0, 3), np.int64)
    if p.ndim == 1 and p.shape[0] == 3:
        p = p.reshape(1, 3)
    if p.ndim != 2 or p.shape[1] != 3:
        raise SpecError(f"points must be (n, 3) voxel coordinates x, y, z; got shape {p.shape}")
    if p.dtype.kind not in "ui":
        if p.dtype.kind != "f" or not np.isfinite(p).all() or (p != np.round(p)).any():
            raise SpecError(f"points must be integer voxel coordinates, got {p.dtype} values")
    return p.astype(np.int64)


def label_at(ds: DatasetLike, points: Any, *, scale: int | Scale = 0, labels: Any = "agglomerated",
             fill_missing_shards: bool = False) -> np.ndarray:
    """The ``uint64`` ids at (n, 3) voxels x, y, z of a scale, 0 for background (DVID's ``/labels``,
    cloud-volume's ``download_point``); SpecError naming the first point outside the volume.

    Points are grouped by chunk: a solid chunk answers from its lists; any other costs one zstd
    decompression, then each point's label-list entry is read from the block's packed values.
    ``fill_missing_shards``: a missing shard file reads as background.
    """
    s = ds.scale(scale)
    src = as_labels(labels)
    p = _points(points)
    out = np.zeros(len(p), np.uint64)
    if not len(p):
        return out
    vlo = np.asarray(s.voxel_offset, np.int64)
    vhi = vlo + np.asarray(s.size, np.int64)
    outside = np.flatnonzero(((p < vlo) | (p >= vhi)).any(axis=1))
    if outside.size:
        raise SpecError(f"point {p[outside[0]].tolist()} (#{int(outside[0])}) is outside scale {s.index}'s "
                        f"volume {vlo.tolist()}..{vhi.tolist()}")
    cs = np.asarray(s.chunk_size, np.int64)
    c = p // cs
    if (c == c[0]).all():  # one chunk (one point): nothing to group
        chunks, order, bounds, groups = c[:1], np.arange(len(p)), np.array([0, len(p)]), [np.zeros(1, np.int64)]
    else:
        _, first, inv = np.unique(_pack(c), return_index=True, return_inverse=True)
        chunks = c[first]
        inv = inv.reshape(-1)
        order = np.argsort(inv, kind="stable")
        bounds = np.searchsorted(inv[order], np.arange(len(chunks) + 1))
        groups = shard_groups(s, chunks)
    reader = ds.reader(s, labels=src, fill_missing_shards=fill_missing_shards)
    for group in groups:
        first = chunks[group[0]]
        shard = reader.shard(*(int(v) for v in first))
        if shard is None:
            continue
        rows, which = [], []
        for k in group:
            x, y, z = (int(v) for v in chunks[k])
            i = shard.find(x, y, z)
            if i is None:
                reader.absent(shard, x, y, z)
                continue
            rows.append(i)
            which.append(k)
        if not rows:
            continue
        t = shard.table(np.asarray(rows, np.int64))
        for r, k in enumerate(which):
            sel = order[bounds[k]:bounds[k + 1]]
            pal = ids_of(t, r, src)
            if int(t.rec[r, R_NSV]) == 1:  # solid: the list says it all
                out[sel] = pal[0]
                continue
            try:
                ent = entries_at(t.block(r), p[sel] - chunks[k] * cs)
            except BlockDecodeError as e:
                raise BlockDecodeError(f"{t.where(r)}: {e}") from None
            out[sel] = np.where(ent >= 0, pal[np.maximum(ent, 0)], np.uint64(0))
    return out


def _pack(c: np.ndarray) -> np.ndarray:
    """One int64 per (n, 3) coordinate row, ordered as the rows by (x, y, z)."""
    return pack_keys(c - c.min(axis=0))


def _per_shard(s: Scale) -> np.ndarray:
    """Chunks per shard side (x, y, z)."""
    return np.maximum(min(s.shard_extent, 1 << 40) // np.asarray(s.chunk_size, np.int64), 1)


def _shards_in(reader: ChunkReader, s: Scale, clo: np.ndarray, chi: np.ndarray
               ) -> Iterator[tuple[Shard, np.ndarray, np.ndarray]]:
    """(shard, rows, coords) of each shard holding chunks of [clo, chi) (rows: its records there;
    a shard missing and filled as background is left out)."""
    so = _per_shard(s)
    for sx, sy, sz in itertools.product(*(range(a // n, (b - 1) // n + 1) for a, b, n in zip(clo, chi, so,
                                                                                              strict=True))):
        shard = reader.shard(*(int(v) for v in np.maximum(clo, np.array([sx, sy, sz]) * so)))
        if shard is not None:
            c = np.asarray(shard.coords, np.int64)
            rows = np.flatnonzero(((c >= clo) & (c < chi)).all(axis=1))
            yield shard, rows, c[rows]


def shard_groups(s: Scale, chunks: Any) -> list[np.ndarray]:
    """Positions of chunks grouped by the shard holding them (each group non-empty, ascending)."""
    c = np.asarray(chunks, np.int64).reshape(-1, 3)
    if not len(c):
        return []
    key = _pack(c // _per_shard(s))
    order = np.argsort(key, kind="stable")
    return np.split(order, np.flatnonzero(np.diff(key[order])) + 1)


# --------------------------------------------------------------------------- unique, mapping


def unique(ds: DatasetLike, box: Any, *, scale: int | Scale = 0, labels: Any = "agglomerated", counts: bool = False,
           fill_missing_shards: bool = False) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Sorted ``uint64`` ids in a voxel box (0 for background), and with ``counts`` their ``int64``
    voxels in it (cloud-volume's ``unique``).

    A solid chunk answers from its lists (its count: the part of the box it covers), as does a
    chunk wholly inside the box when counts are not asked; the others are counted in their
    blocks (``formats.blockstats``: no voxel written).  Absent chunks are background;
    ``fill_missing_shards``: so are missing shard files.
    """
    s = ds.scale(scale)
    src = as_labels(labels)
    lo, hi = s.check_box(box)
    ids_parts, cnt_parts = [np.zeros(0, np.uint64)], [np.zeros(0, np.int64)]
    if (hi <= lo).any():
        return (ids_parts[0], cnt_parts[0]) if counts else ids_parts[0]
    cs = np.asarray(s.chunk_size, np.int64)
    clo, chi = lo // cs, -(-hi // cs)
    reader = ds.reader(s, labels=src, fill_missing_shards=fill_missing_shards)
    background = int(np.prod(hi - lo))  # voxels not yet accounted for by a chunk
    for shard, rows, c in _shards_in(reader, s, clo, chi):
        if not rows.size:
            continue
        org = c * cs
        a = np.maximum(org, lo) - org
        b = np.minimum(org + cs, hi) - org
        t = shard.table(rows)
        solid = t.rec[:, R_NSV] == 1
        whole = ((a == 0) & (b == cs)).all(axis=1)
        listed = solid | (whole & (not counts))
        for k in np.flatnonzero(listed):
            pal = ids_of(t, int(k), src)
            nvox = int(np.prod(b[k] - a[k]))
            background -= nvox  # DVID lists exactly the labels a block holds
            if solid[k]:
                ids_parts.append(pal[:1])
                cnt_parts.append(np.array([nvox], np.int64))
            else:
                ids_parts.append(np.unique(pal))
        rest = np.flatnonzero(~listed)
        if rest.size:
            _, got_ids, _, got_n, _ = count_blocks(t, rest, a[rest], b[rest], src)
            ids_parts.append(got_ids)
            cnt_parts.append(got_n)
            background -= int(got_n.sum())  # empty sub-blocks are not reported: background
    # what no chunk accounted for lies in absent chunks or empty sub-blocks: background
    ids = np.concatenate(ids_parts + [np.zeros(1 if background else 0, np.uint64)])
    if not counts:
        return np.unique(ids)
    n = np.concatenate(cnt_parts + [np.array([background] if background else [], np.int64)])
    u, inv = np.unique(ids, return_inverse=True)
    tot = np.bincount(inv.reshape(-1), weights=n, minlength=len(u)).astype(np.int64)
    keep = tot > 0
    return u[keep], tot[keep]


def count_blocks(t: RecordTable, rows: Any, a: np.ndarray, b: np.ndarray, src: LabelSource) -> tuple[np.ndarray, ...]:
    """The labels of records ``rows`` of a table counted inside [a, b) of each (voxels of its
    chunk; no voxel written): ``(k, ids, supervoxels, voxels, boxes)``, one entry per label
    found in a record: its position in ``rows``, id under ``src``, supervoxel, voxels and box
    (int64 (n, 6) x0, y0, z0, x1, y1, z1 in its chunk)."""
    rows = np.asarray(rows, np.int64)
    blocks = [t.block(int(k)) for k in rows]
    offs = np.zeros(len(rows) + 1, np.int64)
    np.cumsum([len(x) for x in blocks], out=offs[1:])
    try:
        blk, ent, sv, vox, box = batch_stats(np.frombuffer(b"".join(blocks), np.uint8), offs, a, b,
                                             np.ascontiguousarray(t.rec[rows, R_NSV]))
    except BlockError as e:
        kind = ShardFormatError if e.list_mismatch else BlockDecodeError
        raise kind(f"{t.where(int(rows[int(e.index)]))}: {e}") from None
    ids = sv.astype(np.uint64)
    for k in np.unique(blk).tolist():
        pal = src.palette(t, int(rows[k]))
        if pal is not None:
            sel = blk == k
            ids[sel] = np.asarray(pal, np.uint64)[ent[sel]]
    return blk, ids, sv.astype(np.uint64), vox.astype(np.int64), box


def held_scales(ds: DatasetLike) -> list[int]:
    """The scales the export holds (a folder with shard files), finest first.

    A spec may list more scales than an export holds (DVID exports scale 0 by default; FORMATS
    §3a); this lists each scale's folder once.
    """
    out = []
    for s in ds.scales:
        try:
            if ds.shards(s.index):
                out.append(s.index)
        except SpecError:
            continue
    return out


def mapping(ds: DatasetLike, *, scale: int | Scale | None = None, supervoxels: Any = None, table: bool = False,
            index: BodyIndex | None = None) -> Any:
    """The export's own supervoxel -> body pairs (DVID's ``/mappings``): every supervoxel found (0
    excluded, identity pairs included), as a `LabelMapping` or with ``table`` a ``pyarrow.Table``
    (``supervoxel``, ``body``; sorted by supervoxel).

    Every record pairs its block's supervoxels with their agglomerated labels at export time; a
    scale's pairs are collected once per process and dataset (`supervoxel_table`: the lists, or
    ``index``'s columns when it is a label index of agglomerated labels at that scale).  Default
    scale: the finest the export holds (it holds every supervoxel).  ``supervoxels``: only these
    (those the export does not hold left out).  ShardFormatError when two records pair one
    supervoxel with different bodies (not one export).
    """
    t = supervoxel_table(ds, scale=scale, index=index)
    if supervoxels is None:
        sv, body = t.keys, t.values
    else:
        sv = _ids(supervoxels)
        body = lookup(t, sv)
        keep = body != 0
        sv, body = sv[keep], body[keep]
    if table:
        import pyarrow as pa

        return pa.table({"supervoxel": pa.array(sv, pa.uint64()), "body": pa.array(body, pa.uint64())})
    return LabelMapping(sv, body)


# --------------------------------------------------------------------------- label index

INDEX_META = "_meta.json"  # the label index's own description (jobs.labelindex writes it)
_ROW_COLUMNS = ("body", "supervoxel", "chunk_x", "chunk_y", "chunk_z", "voxels")


class IndexRows(NamedTuple):
    """One body's rows of a label index: (n, 3) int64 ``chunks``, uint64 ``supervoxels``, int64
    ``voxels`` (one row per chunk and supervoxel, sorted by supervoxel then chunk)."""

    chunks: np.ndarray
    supervoxels: np.ndarray
    voxels: np.ndarray


def _empty_rows() -> IndexRows:
    return IndexRows(np.zeros((0, 3), np.int64), np.zeros(0, np.uint64), np.zeros(0, np.int64))


class BodyIndex:
    """Per-body look-ups in a label index (``dvidshards label-index``: ``_meta.json`` and
    ``bucket=*/part-0.parquet``) on any store: a folder, ``gs://``, ``s3://``, ``http(s)://``.
    ``meta`` is its ``_meta.json`` (scale, label source, bits, geometry, completeness).

    A body's rows are all in one bucket file, sorted by body in row groups: a look-up reads the
    row groups whose body range holds it (their footer once per bucket) and keeps them decoded
    (~36 bytes a row) up to ``cache_bytes`` (least recently used dropped first), so repeated and
    nearby look-ups read nothing.  Supervoxel -> body look-ups use a table of every supervoxel of
    the index, built once per process (`supervoxel_table`).
    """

    def __init__(self, path, *, cache_bytes: int = 64 << 20):
        if isinstance(path, (str, os.PathLike)) and "://" not in os.fspath(path) and not os.path.isdir(path):
            raise SpecError(f"{os.fspath(path)}: not a label index (no such folder)")
        self.store = as_store(path, what="label index")
        self.path = self.store.describe("").rstrip("/")
        raw = self.store.get_sync(INDEX_META)
        if raw is None:
            raise SpecError(f"{self.path}: not a label index (no {INDEX_META})")
        try:
            self.meta = json.loads(raw)
        except ValueError as e:
            raise SpecError(f"{self.store.describe(INDEX_META)}: cannot read ({e})") from None
        if not isinstance(self.meta, dict) or self.meta.get("format") != INDEX_FORMAT:
            raise SpecError(f"{self.store.describe(INDEX_META)}: not a dvidshards label index")
        if not self.meta.get("complete", False):
            warnings.warn(f"{self.path}: the label index is incomplete; missing shards: "
                          f"{list(self.meta.get('failed_shards', {}))}", RuntimeWarning, stacklevel=2)
        if self.meta.get("box"):
            warnings.warn(f"{self.path}: the label index holds only the box {self.meta['box']}: a body's answers "
                          f"from it (size, chunks, supervoxels) count its voxels inside that box only", RuntimeWarning,
                          stacklevel=2)
        self.bits = int(self.meta["bits"])
        self.scale = int(self.meta["scale"])
        self.cache_bytes = int(cache_bytes)
        self._lock = threading.Lock()
        self._footers: dict[int, tuple | None] = {}
        self._groups: OrderedDict[tuple[int, int], tuple[np.ndarray, ...]] = OrderedDict()
        self._held = 0
        self._table: SupervoxelTable | None = None

    def __repr__(self) -> str:
        return f"BodyIndex({self.path!r}, scale={self.scale}, labels={self.meta.get('labels')!r})"

    # --- reading ------------------------------------------------------------------------------

    def _footer(self, bucket: int) -> tuple | None:
        """(Parquet metadata, each row group's smallest and largest body) of a bucket; None: no file."""
        with self._lock:
            if bucket in self._footers:
                return self._footers[bucket]
        import pyarrow.parquet as pq

        key = bucket_name(bucket, self.bits)
        try:
            md = pq.ParquetFile(self.store.open(key)).metadata
        except MissingShardError:
            got = None
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
            raise SpecError(f"{self.store.describe(key)}: not a Parquet file ({e})") from None
        else:
            col = md.schema.names.index("body")
            lo, hi = np.zeros(md.num_row_groups, np.uint64), np.full(md.num_row_groups, _U64_MAX, np.uint64)
            for g in range(md.num_row_groups):
                st = md.row_group(g).column(col).statistics
                if st is not None and st.has_min_max:
                    lo[g], hi[g] = st.min, st.max
            got = (md, lo, hi)
        with self._lock:
            self._footers[bucket] = got
        return got

    def _group(self, bucket: int, g: int, md) -> tuple[np.ndarray, ...]:
        """Row group ``g`` of a bucket as numpy columns (``_ROW_COLUMNS``), from the cache."""
        with self._lock:
            got = self._groups.get((bucket, g))
            if got is not None:
                self._groups.move_to_end((bucket, g))
                return got
        import pyarrow.parquet as pq

        t = pq.ParquetFile(self.store.open(bucket_name(bucket, self.bits)), metadata=md).read_row_group(
            g, columns=list(_ROW_COLUMNS))
        got = tuple(t[c].to_numpy().astype(np.uint64 if c in ("body", "supervoxel") else np.int64)
                    for c in _ROW_COLUMNS)
        with self._lock:
            self._groups[(bucket, g)] = got
            self._held += sum(a.nbytes for a in got)
            while self._held > self.cache_bytes and len(self._groups) > 1:
                self._held -= sum(a.nbytes for a in self._groups.popitem(last=False)[1])
        return got

    def rows(self, body) -> IndexRows:
        """All rows of a body (empty if the index holds none)."""
        body = int(body)
        if body < 0 or body >= 1 << 64:
            raise SpecError(f"body must be a uint64 id, got {body}")
        bucket = int(bucket_of(np.uint64(body), self.bits))
        f = self._footer(bucket)
        if f is None:
            return _empty_rows()
        md, lo, hi = f
        b = np.uint64(body)
        parts = []
        for g in np.flatnonzero((lo <= b) & (hi >= b)).tolist():
            cols = self._group(bucket, g, md)
            a, z = np.searchsorted(cols[0], b), np.searchsorted(cols[0], b, side="right")
            if z > a:
                parts.append([c[a:z] for c in cols])
        if not parts:
            return _empty_rows()
        whole = [np.concatenate([p[k] for p in parts]) for k in range(len(_ROW_COLUMNS))]
        return IndexRows(np.stack(whole[2:5], axis=1), whole[1], whole[5])

    def _buckets(self) -> list[str]:
        try:
            return sorted(n.rstrip("/") for n in self.store.list_sync("") if n.startswith("bucket="))
        except SpecError:  # a store that cannot list (http): every bucket its bits name (absent: none)
            return [bucket_name(b, self.bits).split("/")[0] for b in range(1 << self.bits)]

    def _columns(self, name: str, columns: list[str]):
        import pyarrow.parquet as pq

        key = f"{name}/part-0.parquet"
        try:
            return pq.read_table(self.store.open(key), columns=columns)
        except MissingShardError:
            return None

    def pairs(self):
        """The (supervoxel, body) pairs of the index, one bucket file at a time.

        Yields
        ------
        (numpy.ndarray, numpy.ndarray)
            ``uint64`` supervoxels (sorted, each once: a body's rows are all in one bucket) and
            their bodies. Memory: one bucket's two columns.
        """
        for name in self._buckets():
            t = self._columns(name, ["supervoxel", "body"])
            if t is None:
                continue
            pairs = np.unique(np.stack([t["supervoxel"].to_numpy().astype(np.uint64),
                                        t["body"].to_numpy().astype(np.uint64)], axis=1), axis=0)
            yield pairs[:, 0], pairs[:, 1]

    def body_sizes(self) -> tuple[np.ndarray, np.ndarray]:
        """Every body of the index, sorted, and its voxels (``uint64``, ``int64``), one bucket at a time."""
        ids, sizes = [np.zeros(0, np.uint64)], [np.zeros(0, np.int64)]
        for name in self._buckets():
            t = self._columns(name, ["body", "voxels"])
            if t is None or not t.num_rows:
                continue
            u, inv = np.unique(t["body"].to_numpy().astype(np.uint64), return_inverse=True)
            ids.append(u)
            sizes.append(np.bincount(inv.reshape(-1), weights=t["voxels"].to_numpy(), minlength=len(u)).astype(
                np.int64))
        u, n = np.concatenate(ids), np.concatenate(sizes)
        order = np.argsort(u, kind="stable")
        return u[order], n[order]

    # --- supervoxels --------------------------------------------------------------------------

    def supervoxel_table(self, *, build: bool = True, stop: threading.Event | None = None
                         ) -> SupervoxelTable | None:
        """Every supervoxel of the index with its body, built once per process from the buckets'
        two columns (None when not built yet and ``build`` is False, or when ``stop`` was set
        before the build ended: it stops after the bucket it reads, and keeps nothing).

        Memory: 16 bytes per supervoxel held (1.6 GB for 10^8), about three times that while
        it is built.
        """
        with self._lock:
            if self._table is not None or not build:
                return self._table
        with _TABLE_BUILD:  # one build at a time; the others wait for it
            if self._table is None:
                parts = self.pairs()
                if stop is not None:
                    parts = itertools.takewhile(lambda _: not stop.is_set(), parts)
                table = _table_of(parts, self.path)
                if stop is not None and stop.is_set():
                    return None
                self._table = table
            return self._table

    def bodies_of(self, supervoxels) -> np.ndarray:
        """The bodies of supervoxels (``uint64``; 0 for one the index does not hold), from
        `supervoxel_table`: no rescan per id."""
        return lookup(self.supervoxel_table(), supervoxels)

    def supervoxel_rows(self, supervoxel) -> IndexRows:
        """The rows of one supervoxel: its chunks and voxels (empty when the index holds none)."""
        sv = int(supervoxel)
        body = int(self.bodies_of([sv])[0]) if sv else 0
        if not body:
            return _empty_rows()
        r = self.rows(body)
        keep = r.supervoxels == np.uint64(sv)
        return IndexRows(r.chunks[keep], r.supervoxels[keep], r.voxels[keep])

    # --- one body -----------------------------------------------------------------------------

    def blocks(self, body) -> np.ndarray:
        """(n, 3) int64 chunk coordinates holding the body, sorted by z, y, x."""
        return sorted_chunks(self.rows(body).chunks)

    def supervoxel_sizes(self, body) -> dict[int, int]:
        """``{supervoxel: voxels}`` of a body, sorted by supervoxel (empty if absent)."""
        r = self.rows(body)
        u, inv = np.unique(r.supervoxels, return_inverse=True)
        return dict(zip(u.tolist(), np.bincount(inv.reshape(-1), weights=r.voxels, minlength=len(u)).astype(
            np.int64).tolist(), strict=True))

    def size(self, body) -> int:
        """Voxels of a body."""
        return int(self.rows(body).voxels.sum())

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


def sorted_chunks(c: np.ndarray) -> np.ndarray:
    """Unique (n, 3) chunk coordinates sorted by z, y, x."""
    c = np.unique(c, axis=0) if len(c) else c.reshape(0, 3)
    return c[np.lexsort((c[:, 0], c[:, 1], c[:, 2]))]


_TABLE_BUILD = threading.Lock()


class SupervoxelTable(NamedTuple):
    """Every supervoxel of an export (``keys``: sorted, unique, uint64) and its body (``values``)."""

    keys: np.ndarray
    values: np.ndarray


def _table_of(parts, where: str) -> SupervoxelTable:
    """A supervoxel -> body table from (supervoxels, bodies) parts (0 left out); ShardFormatError
    naming ``where`` when one supervoxel has two bodies.

    The parts are copied one by one into arrays grown by doubling (large ones, given back to the
    system when freed) and sorted there: 16 bytes per supervoxel kept, about 40 while sorting.
    """
    sv, body, n = np.zeros(1 << 16, np.uint64), np.zeros(1 << 16, np.uint64), 0
    for s, b in parts:
        keep = s != 0
        k = int(keep.sum())
        if n + k > len(sv):
            size = max(2 * len(sv), n + k)
            sv, body = np.resize(sv, size), np.resize(body, size)
        sv[n:n + k], body[n:n + k] = s[keep], b[keep]
        n += k
    order = np.argsort(sv[:n], kind="stable")
    sv = sv[order]
    body = body[order]
    del order
    dup = np.flatnonzero(sv[1:] == sv[:-1])
    if dup.size:
        bad = dup[body[dup] != body[dup + 1]]
        if bad.size:
            i = int(bad[0])
            raise ShardFormatError(f"{where}: supervoxel {sv[i]} belongs to body {body[i]} in one record and to "
                                   f"{body[i + 1]} in another (not one export)")
        keep = np.ones(n, bool)
        keep[dup + 1] = False
        sv, body = sv[keep], body[keep]
    return SupervoxelTable(sv, body)


def lookup(table: SupervoxelTable | None, supervoxels) -> np.ndarray:
    """The bodies of supervoxels in a supervoxel -> body table (``uint64``; 0 where absent)."""
    a = np.atleast_1d(np.asarray(supervoxels, np.uint64)).reshape(-1)
    if table is None or not len(table.keys):
        return np.zeros(len(a), np.uint64)
    pos = np.minimum(np.searchsorted(table.keys, a), len(table.keys) - 1)
    return np.where(table.keys[pos] == a, table.values[pos], np.uint64(0)).astype(np.uint64)


_EXPORT_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def supervoxel_table(ds: DatasetLike, *, scale: int | Scale | None = None, index: BodyIndex | None = None
                     ) -> SupervoxelTable:
    """The export's supervoxel -> body table, built once per process and dataset (and scale).

    From ``index`` when it is a label index of agglomerated labels at that scale (its
    `BodyIndex.supervoxel_table`); else from the records' two lists of every shard of the
    scale (no block decompressed). Default scale: the finest the export holds (the one
    holding every supervoxel).

    Memory: 16 bytes per supervoxel, held as long as the dataset (or the index) is.
    """
    if scale is None:
        held = held_scales(ds)
        if not held:
            raise SpecError(f"{ds.store.describe('')}: the export holds no scale")
        scale = held[0]
    s = ds.scale(scale)
    if index is not None and index.scale == s.index and index.meta.get("labels") == "agglomerated":
        table = index.supervoxel_table()
        assert table is not None
        return table
    with _TABLE_BUILD:
        got = _EXPORT_TABLES.setdefault(ds, {})
        if s.index not in got:
            got[s.index] = _table_of(_export_pairs(ds, s), ds.store.describe(s.folder))
        return got[s.index]


def _export_pairs(ds: DatasetLike, s: Scale) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    for o in ds.shards(s):
        t = ds.shard(s, o).table()
        sv, _ = list_values(t, "supervoxels")
        lab, _ = list_values(t, "labels")
        pairs = np.unique(np.stack([sv, lab], axis=1), axis=0) if len(sv) else np.zeros((0, 2), np.uint64)
        yield pairs[:, 0], pairs[:, 1]


class BodyMask(NamedTuple):
    """A body's voxels: ``mask`` (x, y, z) bool over ``box`` [[x0, y0, z0], [x1, y1, z1]]."""

    mask: np.ndarray
    box: list | None


def body_mask(ds: DatasetLike, body: int, *, scale: int | Scale = 0, labels: Any = "agglomerated", index: Any = None,
              chunks: Any = None) -> BodyMask:
    """A body's voxels as ``(mask, box)``: an (x, y, z) bool mask over its exact voxel box (DVID's
    ``sparsevol``); an empty mask and box None when no voxel holds the body.

    Only the body's chunks are decoded: ``chunks`` when known, else those listed by ``index`` (a
    `BodyIndex` or its path, of the same scale and label source), else found by `chunks_with`.
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
        chunks = chunks_with(ds, [body], scale=s.index, labels=src)
    cs = np.asarray(s.chunk_size, np.int64)
    pieces = []
    for c, bits in body_bits(ds, s, src, body, chunks):
        m = np.unpackbits(bits, axis=2, bitorder="little").astype(bool).T  # (x, y, z)
        if not m.any():
            continue
        nz = [np.flatnonzero(m.any(axis=tuple(a for a in range(3) if a != ax))) for ax in range(3)]
        a = np.array([v[0] for v in nz])
        b = np.array([v[-1] + 1 for v in nz])
        pieces.append((c * cs + a, m[a[0]:b[0], a[1]:b[1], a[2]:b[2]].copy()))
    if not pieces:
        return BodyMask(np.zeros((0, 0, 0), bool), None)
    lo = np.min([p[0] for p in pieces], axis=0)
    hi = np.max([p[0] + p[1].shape for p in pieces], axis=0)
    mask = np.zeros(tuple(int(v) for v in hi - lo), bool)
    for o, m in pieces:
        d = o - lo
        mask[d[0]:d[0] + m.shape[0], d[1]:d[1] + m.shape[1], d[2]:d[2] + m.shape[2]] = m
    return BodyMask(mask, [lo.tolist(), hi.tolist()])


def body_bits(ds: DatasetLike, s: Scale, src: LabelSource, body: int, chunks: Any
              ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(chunk, bits)`` for chunks, in their order: `formats.sparsevol.block_bits` of the chunk's
    block for the voxels that are ``body`` under label source ``src``, uint8 (nz, ny, nx / 8), bit
    i of ``[z, y, j]`` voxel (8 j + i, y, z) of the chunk (voxels outside the volume, and absent
    chunks, all 0). A run of consecutive chunks of one shard is fetched at once."""
    cs = np.asarray(s.chunk_size, np.int64)
    reader = ds.reader(s, labels=src)
    vlo = np.asarray(s.voxel_offset, np.int64)
    vhi = vlo + np.asarray(s.size, np.int64)
    target = np.uint64(body)
    shape = (int(cs[2]), int(cs[1]), int(cs[0]) // 8)
    c = np.asarray(chunks, np.int64).reshape(-1, 3)
    key = c // _per_shard(s)
    for run in np.split(c, np.flatnonzero((key[1:] != key[:-1]).any(axis=1)) + 1) if len(c) else []:
        shard = reader.shard(*(int(v) for v in run[0]))
        rows = [None if shard is None else shard.find(*(int(v) for v in cc)) for cc in run]
        held = [i for i in rows if i is not None]
        t = shard.table(np.asarray(held, np.int64)) if held and shard is not None else None
        k = 0
        for cc, i in zip(run, rows, strict=True):
            if i is None or t is None:
                if shard is not None:
                    reader.absent(shard, *(int(v) for v in cc))
                yield cc, np.zeros(shape, np.uint8)
                continue
            pal = ids_of(t, k, src)
            org = cc * cs
            try:
                bits = block_bits(t.block(k), pal == target, vlo - org, vhi - org, np.empty(shape, np.uint8))
            except BlockDecodeError as e:
                raise BlockDecodeError(f"{t.where(k)}: {e}") from None
            k += 1
            yield cc, bits
