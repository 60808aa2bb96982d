"""The one shard loader, the ``Shard`` object and the shard cache, over any byte store.

Loading a shard finds its chunk index (CSV variants A/B/C, the ``CHUNKIDX`` footer, a
consolidated index, or else the records' own chunk columns), its Arrow schema and the record
batch holding each chunk, and checks them against each other.  How much is checked at load is
the validation policy:

``"eager"``
    Reads every byte of the shard (into private memory locally, freed after the load; one
    download remotely).  Every record's batch header, buffers and offsets are checked; every
    record must have exactly one index row and lie in the shard's box.  Default for local
    files and memory; ``verify`` always uses it.
``"lazy"``
    Reads only the index, the schema and (legacy variants) batch headers; each record is
    checked when it is read.  Default for remote stores.  It cannot see a record no index row
    lists (its chunk reads as background); ``verify`` finds it.

A chunk read is a lookup, a zstd decompression of a slice and a nogil decode into the caller's
array (``RecordTable.decode_into``), whatever the store.  Every chunk read checks that its
record's supervoxel list is its block's label list entry for entry (``labels_match``: ~0.3 µs
a chunk): a list in another order would pair the labels with the wrong voxels.
"""

from __future__ import annotations

import asyncio
import threading
import warnings
from collections import OrderedDict
from concurrent.futures import Future

import numpy as np

from .errors import (
    ChunkIndexError,
    DvidShardsError,
    IndexRebuiltWarning,
    MissingShardError,
    RemoteReadError,
    ShardFormatError,
)
from .formats import arrowipc as ipc
from .formats.chunkindex import (
    MAX_BYTE_OFFSET,
    RawIndex,
    ShardIndex,
    check_coords,
    footer_length,
    pack_key,
    pack_keys,
    parse_csv,
    parse_footer,
)
from .formats.multiscale import Scale
from .formats.records import RecordTable
from .sources.base import RecordSource
from .stores.base import ByteStore, PastEndError

__all__ = ["POLICIES", "Shard", "ShardCache", "load_shard", "load_shard_sync", "merge_ranges", "with_chunk"]

POLICIES = ("eager", "lazy")
_WINDOW, _WINDOW_MAX = 1 << 20, 16 << 20  # stream scan window (lazy, legacy C streams)
_HEADER_PROBE = 4096  # bytes read to find a record batch's row count in its header
_HEAD, _TAIL = 4 << 10, 64 << 10  # speculative first reads of a shard's head and tail
_GRID_MAX_SLOTS = 1 << 21  # dense chunk lookup up to 128³ chunk slots (8 MB); a dict beyond
GAP = 64 << 10  # merge record batch fetches closer than this
MAX_REQUEST = 8 << 20  # largest merged request


def _c(c) -> tuple[int, ...]:
    return tuple(int(v) for v in c)


def with_chunk(e: DvidShardsError, chunk) -> DvidShardsError:
    """The same error type with the chunk being read added to its message (if not named yet)."""
    msg = str(e)
    tag = f"chunk {_c(chunk)}"
    if tag in msg:
        return e
    try:
        return type(e)(f"{msg} (while reading {tag})")
    except TypeError:
        return e


def merge_ranges(ranges, gap: int = GAP, max_bytes: int = MAX_REQUEST) -> list[list]:
    """Merge (start, stop, item) ranges closer than gap into [start, stop, items] groups."""
    out: list[list] = []
    for a, b, item in sorted(ranges, key=lambda r: r[0]):
        if out and a - out[-1][1] <= gap and max(b, out[-1][1]) - out[-1][0] <= max_bytes:
            g = out[-1]
            g[1] = max(g[1], b)
            g[2].append(item)
        else:
            out.append([a, b, [item]])
    return out


def _is_end_of_stream(data: np.ndarray, off: int, end: int) -> bool:
    if off + 8 > end:
        return False
    head = bytes(data[off:off + 8])
    meta = head[4:8] if head[:4] == b"\xff\xff\xff\xff" else head[:4]
    return meta == b"\x00\x00\x00\x00"


# --- the Shard --------------------------------------------------------------------------------


class Shard:
    """A loaded shard: its index, schema and (eager) records; read chunks by coordinate.

    Built by ``load_shard``.  ``coords``: the index's chunk coordinates (one row per record);
    ``find``: a chunk's record number; ``table``: validated records for bulk work;
    ``read_into``: one chunk decoded.
    """

    def __init__(self, store, key: str, scale: Scale, origin, policy: str, index: ShardIndex,
                 layout: ipc.SchemaLayout | None, schema_size: int, table: RecordTable | None, rebuilt: bool = False):
        self.store = store
        self.key = key
        self.path = store.describe(key) if layout is not None else key
        self.scale = scale
        self.origin = _c(origin)
        self.chunk_size = scale.chunk_size
        self.policy = policy
        self.index = index
        self.variant = index.variant
        self.layout = layout
        self.schema_size = schema_size
        self.rebuilt = rebuilt
        self._table = table
        self.box = scale.shard_box(origin)
        self._grid: memoryview | None = None
        self._lookup: dict | None = None
        self._make_lookup()
        self.nbytes = int(index.coords.nbytes * 2 + 24 * len(index) + (table.nbytes if table is not None else 0))

    @classmethod
    def from_records(cls, source, table: RecordTable, scale: Scale, origin) -> Shard:
        """A shard whose records came from a RecordSource: their own chunk columns are its index
        (unique, inside the shard's box)."""
        coords = np.ascontiguousarray(table.coords, np.int64)
        check_coords(coords, table.path)
        n = len(coords)
        zeros = np.zeros(n, np.int64)
        index = ShardIndex("T", coords, zeros, zeros, np.arange(n, dtype=np.int64))
        _check_box(index, scale, origin, table.path)
        return cls(source, table.path, scale, origin, "eager", index, None, 0, table)

    def __len__(self) -> int:
        return len(self.index)

    def __repr__(self) -> str:
        return f"Shard({self.path!r}, variant={self.variant}, chunks={len(self)}, policy={self.policy!r})"

    def __getstate__(self):
        raise TypeError("a Shard holds open files; pickle its Dataset and load it again")

    @property
    def coords(self) -> np.ndarray:
        """(n, 3) int64 chunk coordinates of the records, in index order."""
        return self.index.coords

    def extent(self) -> np.ndarray:
        """Chunks spanned by the records along each axis from the shard's origin (0 if empty)."""
        if not len(self):
            return np.zeros(3, np.int64)
        return self.index.coords.max(axis=0) - self.box[0] + 1

    def _make_lookup(self) -> None:
        lo, hi = self.box
        nx, ny, nz = (int(h) - int(a) for a, h in zip(lo, hi, strict=True))
        if min(nx, ny, nz) > 0 and nx * ny * nz <= _GRID_MAX_SLOTS:  # Python ints: no overflow
            c = self.index.coords - lo
            grid = np.full(nx * ny * nz, -1, np.int32)
            grid[(c[:, 2] * ny + c[:, 1]) * nx + c[:, 0]] = np.arange(len(c), dtype=np.int32)
            self._grid = memoryview(grid)  # type: ignore[arg-type]  # item access gives a Python int
            self._grid_box = (*(int(v) for v in lo), nx, ny, nz)
        else:
            self._lookup = dict(zip(pack_keys(self.index.coords).tolist(), range(len(self.index)), strict=True))

    def find(self, x: int, y: int, z: int) -> int | None:
        """Record number of chunk (x, y, z); None when the shard does not hold it (background)."""
        grid = self._grid
        if grid is None:
            assert self._lookup is not None
            return self._lookup.get(pack_key(x, y, z))
        lx, ly, lz, nx, ny, nz = self._grid_box
        x -= lx
        y -= ly
        z -= lz
        if 0 <= x < nx and 0 <= y < ny and 0 <= z < nz:
            i = grid[(z * ny + y) * nx + x]
            if i >= 0:
                return i
        return None

    def batch(self, i: int) -> tuple[int, int]:
        """(file offset, length) of the record batch message holding record i."""
        return int(self.index.msg_off[i]), int(self.index.msg_len[i])

    def where(self, i: int) -> str:
        return f"{self.path}: chunk {_c(self.index.coords[i])}"

    # --- records ------------------------------------------------------------------------------

    def _resolve(self, buf, base: int, rows: np.ndarray) -> RecordTable:
        """Records ``rows`` from bytes ``buf`` holding their batches from file offset ``base``."""
        ix = self.index
        assert self.layout is not None, "records of a RecordSource are never fetched"
        t = RecordTable.from_ipc(buf, base, ix.msg_off[rows], ix.msg_len[rows], ix.row[rows], self.layout,
                                 self.path, self.chunk_size, chunks=ix.coords[rows])
        _check_records(t, ix.coords[rows], self.path)
        return t

    async def fetch(self, rows) -> RecordTable:
        """Validated records ``rows`` (record numbers), fetching their batches when lazy."""
        rows = np.asarray(rows, np.int64)
        if self._table is not None:
            return self._table.take(rows)
        spans = [self.batch(int(i)) for i in rows]
        groups = merge_ranges([(o, o + n, int(i)) for i, (o, n) in zip(rows, spans, strict=True)])
        bufs = await self.store.read_ranges(self.key, [(g[0], g[1]) for g in groups], return_exceptions=True)
        parts, order = [], []
        for g, buf in zip(groups, bufs, strict=True):
            if isinstance(buf, BaseException):
                raise self._range_error(buf, g[2][0])
            r = np.asarray(g[2], np.int64)
            parts.append(self._resolve(np.frombuffer(buf, np.uint8) if not isinstance(buf, np.ndarray) else buf,
                                       g[0], r))
            order.append(r)
        t = RecordTable.concat(parts, self.path, self.chunk_size)
        cat = np.concatenate(order) if order else np.zeros(0, np.int64)
        if np.array_equal(cat, rows):
            return t
        where = {int(r): k for k, r in enumerate(cat)}
        return t.take(np.array([where[int(r)] for r in rows], np.int64))

    def table(self, rows=None) -> RecordTable:
        """Validated records (all by default, in index order) for bulk work."""
        if self._table is not None:
            return self._table if rows is None else self._table.take(rows)
        rows = np.arange(len(self)) if rows is None else rows
        return self.store._sync(self.fetch(rows))

    def decode(self, i: int, out: np.ndarray, labels) -> None:
        """Decode record i into out ((z, y, x), any strides, possibly cropped on its far side)."""
        t = self._table
        if t is not None:
            t.decode_into(i, out, labels)
        else:
            self.store._sync(self.fetch([i])).decode_into(0, out, labels)

    def read_into(self, x: int, y: int, z: int, out: np.ndarray, labels) -> bool:
        """Decode chunk (x, y, z) into out ((z, y, x), any strides, possibly cropped); whether the
        shard held it (else out is 0)."""
        i = self.find(x, y, z)
        if i is None:
            out.fill(0)
            return False
        self.decode(i, out, labels)
        return True

    def _range_error(self, e: BaseException, i: int) -> BaseException:
        if isinstance(e, PastEndError):
            off, n = self.batch(i)
            size = f"{e.total_size} of " if e.total_size is not None else ""
            if _tiles(self.index, self.schema_size):
                return ShardFormatError(f"{self.where(i)}: truncated: {size}{off + n}+ bytes: its record batch at "
                                        f"bytes [{off}, {off + n}) lies past the end of the file")
            return ChunkIndexError(f"{self.where(i)}: its index entry points at bytes [{off}, {off + n}), past the "
                                   f"end of the file")
        return e


def _tiles(index: ShardIndex, schema_size: int) -> bool:
    """Whether the index's batches follow the schema with no gap: a file shorter than such an
    index is truncated; otherwise the index itself is wrong."""
    if not len(index):
        return False
    offs, first = np.unique(index.msg_off, return_index=True)
    lens = index.msg_len[first]
    return bool(offs[0] <= schema_size + 8 and (offs[1:] == offs[:-1] + lens[:-1]).all())


# --- loading ----------------------------------------------------------------------------------


async def load_shard(store: ByteStore | RecordSource, scale: Scale, origin, *, policy: str | None = None,
                     index: ShardIndex | None = None) -> Shard:
    """Load and check the shard at a voxel origin of a scale (see the module docstring).

    Parameters
    ----------
    store : ByteStore or RecordSource
        Where the export is.
    scale : Scale
        The scale's geometry.
    origin : (x, y, z)
        The shard's voxel origin (its file name).
    policy : "eager", "lazy" or None
        Validation policy; None: eager for mappable stores, lazy otherwise.
    index : ShardIndex, optional
        A preloaded index (from a consolidated index) instead of the shard's own.
    """
    if isinstance(store, RecordSource):
        return Shard.from_records(store, await store.load_records(scale, origin), scale, origin)
    policy = policy or ("eager" if store.mappable else "lazy")
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    stem = scale.stem(origin)
    key = stem + ".arrow"
    if policy == "lazy":
        return await _Lazy(store, stem, scale, index).load(policy)
    if store.mappable:
        data = store.map(key)
    else:
        try:
            raw = await store.read(key)
        except MissingShardError:
            raise MissingShardError(f"{store.describe(key)}: no such shard file") from None
        data = np.frombuffer(raw, np.uint8) if not isinstance(raw, np.ndarray) else raw
    return await _Eager(store, stem, scale, data, index).load(policy)


def load_shard_sync(store: ByteStore | RecordSource, scale: Scale, origin, *, policy: str | None = None,
                    index: ShardIndex | None = None) -> Shard:
    """``load_shard`` from a thread (not from the I/O loop)."""
    return store._sync(load_shard(store, scale, origin, policy=policy, index=index))


def _check_box(index: ShardIndex, scale: Scale, origin, where: str) -> None:
    if not len(index):
        return
    lo, hi = scale.shard_box(origin)
    got = index.coords
    out = np.flatnonzero(((got < lo) | (got >= hi)).any(axis=1))
    if out.size:
        i = int(out[0])
        raise ChunkIndexError(f"{where}: chunk {_c(got[i])} lies outside the shard its file name says "
                              f"(chunks {_c(lo)} to {_c(hi - 1)}; shard extent {scale.shard_extent} voxels: "
                              f"is the spec the one the export was written with?)")


def _origin(stem: str) -> tuple[int, int, int]:
    x, y, z = stem.rsplit("/", 1)[-1].split("_")
    return int(x), int(y), int(z)


async def _read_csv(store: ByteStore, stem: str) -> RawIndex | None:
    """The shard's CSV index, None when it has none."""
    try:
        text = await store.read(stem + ".csv")
    except MissingShardError:
        return None
    return parse_csv(bytes(text), store.describe(stem + ".csv"))


def _schema_size_error(store: ByteStore, stem: str, hint: int, n: int) -> ChunkIndexError:
    return ChunkIndexError(f"{store.describe(stem + '.csv')}: schema_size={hint} but the schema message in "
                           f"{store.describe(stem + '.arrow')} is {n} bytes")


class _Eager:
    """Index discovery with every byte of the shard at hand; every record resolved and checked."""

    def __init__(self, store: ByteStore, stem: str, scale: Scale, data: np.ndarray, given: ShardIndex | None):
        self.store, self.stem, self.scale, self.data, self.given = store, stem, scale, data, given
        self.key = stem + ".arrow"
        self.where = store.describe(self.key)
        self.origin = _origin(stem)

    async def load(self, policy: str) -> Shard:
        data, where = self.data, self.where
        size = data.shape[0]
        if size < 8:
            raise ShardFormatError(f"{where}: truncated: {size} bytes is too short for an Arrow IPC shard")
        footer_n = footer_length(bytes(data[-16:]), size, where)
        ipc_end = size - 16 - footer_n if footer_n else size
        is_file = ipc.is_ipc_file(bytes(data[:6]))
        schema, schema_len = ipc.schema_from_message(data, 8 if is_file else 0, where)
        layout = ipc.SchemaLayout(schema, where)
        raw = None if self.given is not None else await _read_csv(self.store, self.stem)
        if raw is not None and raw.schema_size is not None and not is_file and raw.schema_size != schema_len:
            raise _schema_size_error(self.store, self.stem, raw.schema_size, schema_len)
        index = self.given
        if index is None and raw is not None and raw.variant in ("A", "B"):
            index = ShardIndex.from_raw(raw, where)
        if index is not None and len(index):
            ends = index.msg_off + index.msg_len
            need = int(ends.max())
            if need > size:
                if _tiles(index, schema_len):
                    raise ShardFormatError(f"{where}: truncated: {size} of {need} bytes")
                i = int(np.argmax(ends))
                raise ChunkIndexError(f"{where}: index entry for chunk {_c(index.coords[i])} points at bytes "
                                      f"[{index.msg_off[i]}, {need}), past the end of the {size}-byte file")
        if index is not None and not is_file:
            fast = self._by_offsets(index, layout, schema_len, ipc_end)
            if fast is not None:
                return Shard(self.store, self.key, self.scale, self.origin, policy, index, layout, schema_len, fast)
        # every record batch in the file: the index must list each record exactly once
        if is_file:
            offs, lens = ipc.file_footer_blocks(data, ipc_end, where)
            rows = ipc.batch_rows(data, offs, lens, layout, where)
        else:
            try:
                offs, lens, rows = ipc.scan_stream(data, schema_len, ipc_end, where)
            except ShardFormatError as e:
                if "runs past the end" in str(e):
                    raise ShardFormatError(f"{where}: truncated: the file ({size} bytes) ends inside a record "
                                           f"batch ({e})") from None
                raise
        rebuilt = False
        if index is None:
            if raw is not None:
                index = ShardIndex.from_raw(raw, where, (offs, lens, rows))
            elif footer_n:
                index = ShardIndex.from_raw(parse_footer(bytes(data[ipc_end:size - 16]), self.scale.chunk_size,
                                                         where), where, (offs, lens, rows))
            else:
                index = self._rebuild(offs, lens, rows, layout)
                rebuilt = True
        _check_complete(index, offs, lens, rows, where)
        table = RecordTable.from_ipc(data, 0, index.msg_off, index.msg_len, index.row, layout, where,
                                     self.scale.chunk_size, chunks=index.coords)
        _check_records(table, index.coords, where)
        _check_box(index, self.scale, self.origin, where)
        return Shard(self.store, self.key, self.scale, self.origin, policy, index, layout, schema_len, table, rebuilt)

    def _rebuild(self, offs, lens, rows, layout) -> ShardIndex:
        """An index from the records' own chunk columns (the shard has no CSV and no footer)."""
        n = int(rows.sum())
        b = np.repeat(np.arange(len(offs)), rows)
        starts = np.concatenate([[0], np.cumsum(rows)])
        r = np.arange(n) - starts[b]
        t = RecordTable.from_ipc(self.data, 0, offs[b], lens[b], r, layout, self.where, self.scale.chunk_size)
        coords = t.coords.copy()
        warnings.warn(f"{self.where}: no chunk index (neither {self.stem}.csv nor a CHUNKIDX footer); rebuilt it "
                      f"from the records' chunk columns ({n} records). `dvidshards consolidate` saves it outside "
                      f"the export", IndexRebuiltWarning, stacklevel=4)
        check_coords(coords, self.where)
        return ShardIndex("R", coords, offs[b].astype(np.int64), lens[b].astype(np.int64), r.astype(np.int64))

    def _by_offsets(self, index: ShardIndex, layout, schema_len: int, ipc_end: int) -> RecordTable | None:
        """Resolve an index with byte offsets (A, B, consolidated) without scanning the stream.

        When the indexed batches, resolved and checked, tile the stream from the schema to its
        end (or end-of-stream marker), a scan would find exactly these batches.  None: take the
        full path (which also reports errors in its own order).
        """
        if not len(index):
            return None
        try:
            table = RecordTable.from_ipc(self.data, 0, index.msg_off, index.msg_len, index.row, layout, self.where,
                                         self.scale.chunk_size, chunks=index.coords)
        except DvidShardsError:
            return None
        offs, first = np.unique(index.msg_off, return_index=True)
        lens = index.msg_len[first]
        if (index.msg_len != lens[np.searchsorted(offs, index.msg_off)]).any():
            return None
        if offs[0] != schema_len or (offs[1:] != offs[:-1] + lens[:-1]).any():
            return None
        end = int(offs[-1] + lens[-1])
        if end != ipc_end and not _is_end_of_stream(self.data, end, ipc_end):
            return None
        _check_complete(index, offs, lens, table.rec[first, ipc.R_ROWS], self.where)
        _check_records(table, index.coords, self.where)
        _check_box(index, self.scale, self.origin, self.where)
        return table


def _check_records(table: RecordTable, coords: np.ndarray, where: str) -> None:
    """Each record holds the chunk its index row says."""
    bad = np.flatnonzero((table.coords != coords).any(axis=1))
    if bad.size:
        i = int(bad[0])
        raise ChunkIndexError(f"{where}: index says chunk {_c(coords[i])} but its record holds chunk "
                              f"{_c(table.coords[i])}")


def _check_complete(index: ShardIndex, offs, lens, rows, where: str) -> None:
    """Index rows and records are in one-to-one correspondence."""
    order = np.argsort(offs, kind="stable")
    offs, lens, rows = offs[order], lens[order], rows[order]
    b = np.minimum(np.searchsorted(offs, index.msg_off), max(len(offs) - 1, 0))
    ok = (offs[b] == index.msg_off) if len(offs) else np.zeros(len(index), bool)
    if not ok.all():
        i = int(np.flatnonzero(~ok)[0])
        raise ChunkIndexError(f"{where}: index entry for chunk {_c(index.coords[i])} points at byte "
                              f"{index.msg_off[i]}, where no record batch starts")
    bad = np.flatnonzero((lens[b] != index.msg_len) | (index.row >= rows[b]))
    if bad.size:
        i = int(bad[0])
        raise ChunkIndexError(f"{where}: index entry for chunk {_c(index.coords[i])} (size {index.msg_len[i]}, row "
                              f"{index.row[i]}) does not match the record batch at byte {index.msg_off[i]} "
                              f"({lens[b[i]]} bytes, {rows[b[i]]} rows)")
    starts = np.concatenate([[0], np.cumsum(rows)])
    total = int(starts[-1])
    if total > MAX_BYTE_OFFSET:
        raise ShardFormatError(f"{where}: record batches claim {total} rows")
    flat = starts[b] + index.row
    seen = np.bincount(flat, minlength=total) if len(flat) else np.zeros(total, np.int64)
    dup = seen[flat] > 1
    if dup.any():
        i = int(np.flatnonzero(dup)[0])
        raise ChunkIndexError(f"{where}: two index entries point at the record of chunk {_c(index.coords[i])}")
    if (seen == 0).any():
        r = int(np.flatnonzero(seen == 0)[0])
        raise ChunkIndexError(f"{where}: record {r} of {total} has no index entry")


class _Window:
    """Sequential windowed reads of one file whose size is unknown until its end is met."""

    def __init__(self, store: ByteStore, key: str, head=b"", whole: bool = False):
        self.store, self.key, self.window = store, key, _WINDOW
        self.buf, self.base = head, 0
        self.total = len(head) if whole else None

    async def need(self, p: int, n: int) -> bool:
        """Make bytes [p, p + n) available in buf (False: the file ends before p + n)."""
        if self.base <= p and p + n <= self.base + len(self.buf):
            return True
        if self.total is not None and p + n > self.total:
            return False
        stop = p + max(n, self.window)
        if self.total is not None:
            stop = min(stop, self.total)
        try:
            self.buf, self.base = await self.store.read(self.key, p, stop), p
            self.window = min(2 * self.window, _WINDOW_MAX)
            return True
        except PastEndError as e:
            if e.total_size is not None and self.total is None:
                self.total = e.total_size
                return await self.need(p, n)
            if stop > p + n:
                try:
                    self.buf, self.base = await self.store.read(self.key, p, p + n), p
                    return True
                except PastEndError:
                    return False
            return False


class _Lazy:
    """Index discovery by byte ranges: index, schema and (legacy variants) batch headers only."""

    def __init__(self, store: ByteStore, stem: str, scale: Scale, given: ShardIndex | None):
        self.store, self.stem, self.scale, self.given = store, stem, scale, given
        self.key = stem + ".arrow"
        self.where = store.describe(self.key)
        self.origin = _origin(stem)
        self._headbuf = self._tailbuf = b""
        self._whole = False

    async def load(self, policy: str) -> Shard:
        where = self.where
        if self.given is not None:
            schema, schema_len, _ = await self._schema(None)
            index = self.given
        else:
            raw = await _read_csv(self.store, self.stem)
            if raw is not None:
                schema, schema_len, is_file = await self._schema(raw.schema_size)
                trailer = 0
            else:
                await self._speculate(tail=True, missing=f"no such shard file (nor {self.stem}.csv)")
                tail = await self._tail(16, "a CHUNKIDX footer")
                n = footer_length(bytes(tail), 1 << 62, where)
                if n is None:
                    # no index at all: rebuild it from the records, which needs the whole file
                    return await load_shard(self.store, self.scale, self.origin, policy="eager")
                blob = await self._tail(16 + n, f"its {n}-byte CHUNKIDX footer", chunk_error=True)
                raw = parse_footer(bytes(blob[:n]), self.scale.chunk_size, where)
                schema, schema_len, is_file = await self._schema(None)
                trailer = 16 + n
            if raw.variant in ("A", "B"):
                index = ShardIndex.from_raw(raw, where)
            elif is_file:
                index = ShardIndex.from_raw(raw, where, await self._file_batches(trailer, raw))
            else:
                index = ShardIndex.from_raw(raw, where, await self._stream_batches(schema_len))
        self._headbuf = self._tailbuf = b""
        layout = ipc.SchemaLayout(schema, where)
        _check_box(index, self.scale, self.origin, where)
        return Shard(self.store, self.key, self.scale, self.origin, policy, index, layout, schema_len, None)

    async def _speculate(self, *, tail: bool, missing: str = "no such shard file") -> None:
        """Read up to _TAIL last (or _HEAD first) bytes in one request; the whole file if shorter."""
        if self._whole or (self._tailbuf if tail else self._headbuf):
            return
        k = _TAIL if tail else _HEAD
        try:
            buf = await self.store.read(self.key, *((-k, None) if tail else (0, k)))
        except MissingShardError:
            raise MissingShardError(f"{self.where}: {missing}") from None
        except PastEndError as e:
            if e.total_size is None or e.total_size >= k:
                return
            buf = await self.store.read(self.key, 0, e.total_size) if e.total_size else b""
            self._headbuf = self._tailbuf = bytes(buf)
            self._whole = True
            return
        if tail:
            self._tailbuf = bytes(buf)
        else:
            self._headbuf = bytes(buf)

    async def _read(self, start: int, stop: int | None, past_end: DvidShardsError) -> bytes:
        try:
            return bytes(await self.store.read(self.key, start, stop))
        except MissingShardError:
            raise MissingShardError(f"{self.where}: no such shard file") from None
        except PastEndError:
            raise past_end from None

    async def _tail(self, n: int, what: str, *, chunk_error: bool = False) -> bytes:
        err = ChunkIndexError if chunk_error else ShardFormatError
        if len(self._tailbuf) >= n:
            return self._tailbuf[len(self._tailbuf) - n:]
        if self._whole:
            raise err(f"{self.where}: the file ({len(self._tailbuf)} bytes) is shorter than {what} ({n} bytes)")
        return await self._read(-n, None, err(f"{self.where}: the file is shorter than {what} ({n} bytes)"))

    async def _head(self, stop: int) -> bytes:
        if len(self._headbuf) >= stop:
            return self._headbuf[:stop]
        short = ShardFormatError(f"{self.where}: truncated: the file ends inside its {stop}-byte schema")
        if self._whole:
            raise short
        return await self._read(0, stop, short)

    async def _schema(self, hint: int | None):
        """(schema, schema message length, is IPC file); one read when the CSV gives the size."""
        where = self.where
        if hint is not None:
            head = await self._head(max(hint, 8))
            if not ipc.is_ipc_file(head[:6]):
                try:
                    schema, n = ipc.schema_from_message(head, 0, where)
                except ShardFormatError:
                    pass  # diagnosed below
                else:
                    if n != hint:
                        raise _schema_size_error(self.store, self.stem, hint, n)
                    return schema, n, False
        await self._speculate(tail=False)
        first = await self._head(16)
        is_file = ipc.is_ipc_file(first[:6])
        off = 8 if is_file else 0
        prefix, meta = ipc.message_prefix(first, off, where)
        if meta <= 0 or meta > 1 << 24:
            raise ShardFormatError(f"{where}: no Arrow schema message at byte {off}")
        head = await self._head(off + prefix + meta)
        schema, n = ipc.schema_from_message(head, off, where)
        if hint is not None and not is_file and n != hint:
            raise _schema_size_error(self.store, self.stem, hint, n)
        return schema, n, is_file

    async def _file_batches(self, trailer: int, raw: RawIndex):
        where = self.where
        await self._speculate(tail=True)
        end10 = await self._tail(trailer + 10, "an Arrow IPC file footer")
        if end10[4:10] != ipc.ARROW_MAGIC:
            raise ShardFormatError(f"{where}: Arrow IPC file does not end with the ARROW1 magic")
        flen = int.from_bytes(end10[:4], "little", signed=True)
        if flen <= 0 or flen > 1 << 30:
            raise ShardFormatError(f"{where}: malformed Arrow IPC file footer")
        tail = await self._tail(trailer + 10 + flen + 8, "its Arrow IPC file footer")
        offs, lens = ipc.file_footer_blocks(tail, len(tail) - trailer, where)
        return offs, lens, await self._batch_rows(offs, lens, raw)

    async def _batch_rows(self, offs: np.ndarray, lens: np.ndarray, raw: RawIndex) -> np.ndarray:
        n = len(offs)
        if n == len(raw.coords) and (n == 0 or (raw.rec is not None and int(raw.rec.max()) == n - 1)):
            return np.ones(n, np.int64)  # one record per batch (DVID's default), checked per read
        probes = [(int(o), int(o) + int(min(ln, _HEADER_PROBE)), k) for k, (o, ln) in enumerate(zip(offs, lens,
                                                                                                   strict=True))]
        groups = merge_ranges(probes)
        bufs = await self.store.read_ranges(self.key, [(g[0], g[1]) for g in groups])
        rows = np.empty(n, np.int64)
        for g, buf in zip(groups, bufs, strict=True):
            b = np.frombuffer(buf, np.uint8) if not isinstance(buf, np.ndarray) else buf
            for k in g[2]:
                off = int(offs[k]) - g[0]
                code, a, _, _, r = ipc.header_rows(b, off, min(len(b), off + int(lens[k])))
                if code == 1:  # header longer than the probe
                    whole = await self.store.read(self.key, int(offs[k]), int(offs[k] + lens[k]))
                    code, a, _, _, r = ipc.header_rows(whole, 0, len(whole))
                if code:
                    ipc.raise_error(code, int(offs[k]), a, self.where)
                rows[k] = r
        return rows

    async def _stream_batches(self, start: int):
        """Scan the stream's message headers from start (no offsets are stored anywhere)."""
        where = self.where
        w = _Window(self.store, self.key, self._headbuf, self._whole)
        offs, lens, rows = [], [], []
        p = start
        while await w.need(p, 8):
            prefix, meta = ipc.message_prefix(w.buf, p - w.base, where)
            if meta == 0:
                break  # end-of-stream marker
            if meta < 0 or not await w.need(p, prefix + meta):
                raise ShardFormatError(f"{where}: truncated: the Arrow message at byte {p} runs past the end of "
                                       f"the file")
            code, mlen, body, _, r = ipc.header_rows(w.buf, p - w.base, p - w.base + prefix + meta)
            if code:
                ipc.raise_error(code, p, mlen, where)
            offs.append(p)
            lens.append(mlen + body)
            rows.append(r)
            p += mlen + body
        return np.array(offs, np.int64), np.array(lens, np.int64), np.array(rows, np.int64)


# --- the shard cache --------------------------------------------------------------------------


class ShardCache:
    """Loaded shards of one scale, per process: single-flight loads, bounded, failures remembered.

    ``load(origin)`` is a coroutine giving a Shard, or None for a shard read as background.  One
    load runs per shard at a time, whether the callers are threads (``get_sync``) or coroutines
    (``get``).  At most ``max_shards`` shards and ``max_bytes`` of their index and records are
    kept.  A load that failed with a library error (not a transient remote one) is remembered:
    the shard's other chunks raise it without loading again, until the store is reopened.
    """

    def __init__(self, load, store, *, max_shards: int = 64, max_bytes: int = 512 << 20):
        if int(max_shards) < 1:
            raise ValueError("max_shards must be at least 1")
        self._load = load
        self.store = store
        self.max_shards = int(max_shards)
        self.max_bytes = int(max_bytes)
        self._shards: OrderedDict = OrderedDict()
        self._failed: dict = {}
        self._loading: dict = {}
        self._lock = threading.Lock()
        self._bytes = 0
        self._newest = None

    def __getstate__(self):
        raise TypeError("ShardCache holds open files; pickle the reader that builds it instead")

    @property
    def loaded(self) -> int:
        """How many shards are in memory."""
        return len(self._shards)

    def peek(self, origin):
        """The cached shard at origin (KeyError if not loaded)."""
        shard = self._shards[origin]
        if origin != self._newest and len(self._shards) > 1:
            with self._lock:
                if origin in self._shards:
                    self._shards.move_to_end(origin)
                    self._newest = origin
        return shard

    def _claim(self, origin):
        """(shard, None, False) on a hit, (None, future, owner?) otherwise."""
        try:
            return self.peek(origin), None, False
        except KeyError:
            pass
        with self._lock:
            if origin in self._shards:
                return self._shards[origin], None, False
            e = self._failed.get(origin)
            if e is not None:
                raise e
            fut = self._loading.get(origin)
            if fut is not None:
                return None, fut, False
            fut = self._loading[origin] = Future()
            return None, fut, True

    def _settle(self, origin, fut: Future, shard=None, error: BaseException | None = None) -> None:
        with self._lock:
            self._loading.pop(origin, None)
            if error is None:
                self._shards[origin] = shard
                self._newest = origin
                self._bytes += shard.nbytes if shard is not None else 0
                while len(self._shards) > 1 and (len(self._shards) > self.max_shards or self._bytes > self.max_bytes):
                    _, old = self._shards.popitem(last=False)
                    self._bytes -= old.nbytes if old is not None else 0
            elif isinstance(error, DvidShardsError) and not isinstance(error, RemoteReadError):
                if len(self._failed) >= 4096:
                    self._failed.clear()
                self._failed[origin] = error.with_traceback(None)  # its frames would hold the load's bytes
        if error is None:
            fut.set_result(shard)
        else:
            fut.set_exception(error)

    def get_sync(self, origin):
        """The shard at origin, loading it on this thread if needed (not from the I/O loop)."""
        shard, fut, owner = self._claim(origin)
        if fut is None:
            return shard
        if not owner:
            return fut.result()
        try:
            shard = self.store._sync(self._load(origin))
        except BaseException as e:
            self._settle(origin, fut, error=e)
            raise
        self._settle(origin, fut, shard)
        return shard

    async def get(self, origin):
        """The shard at origin (coroutine form)."""
        shard, fut, owner = self._claim(origin)
        if fut is None:
            return shard
        if not owner:
            return await asyncio.wrap_future(fut)
        try:
            shard = await self._load(origin)
        except BaseException as e:
            self._settle(origin, fut, error=e)
            raise
        self._settle(origin, fut, shard)
        return shard
