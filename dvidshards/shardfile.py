"""One shard file: its schema, its normalised index and its resolved records.

A shard is loaded once (schema, index, record locations, all checked against each other); a
chunk read is then a table lookup, a zstd decompression of a memory-mapped slice and a nogil
decode into the caller's array, with the record's label list (also a slice of the map) as the
palette.
"""

from __future__ import annotations

import mmap
import threading

import numpy as np
import zstandard

from .formats import arrowipc as ipc
from .formats.codec import decode_into
from .errors import BlockDecodeError, ChunkIndexError, DvidShardsError, ShardFormatError
from .index import ShardIndex, footer_length, pack_key, pack_keys, parse_csv, parse_footer
from .sources import ByteSource

__all__ = ["AGGLOMERATED", "MAPPED", "SUPERVOXELS", "ShardFile", "decode_record", "decompress_block", "max_block_bytes"]

AGGLOMERATED, SUPERVOXELS, MAPPED = 0, 1, 2
_frame_content_size, _ZstdError = zstandard.frame_content_size, zstandard.ZstdError
_U8, _U64 = np.dtype(np.uint8), np.dtype(np.uint64)
_PAY, _PAYLEN, _USIZE, _LAB, _NLAB, _SV, _NSV = (ipc.R_PAY, ipc.R_PAYLEN, ipc.R_USIZE, ipc.R_LAB, ipc.R_NLAB,
                                                ipc.R_SV, ipc.R_NSV)
# One decompressor per OS thread, keyed by thread id rather than held in a threading.local:
# TensorStore's pool threads get a fresh Python thread state (hence a fresh threading.local)
# for every callback, and creating a ZSTD_DCtx per chunk cost ~10 % of a read (allocation,
# mmap/munmap and cpuid, which is slow in a VM). A thread id is only reused after its thread
# has ended, so no two live threads share a decompressor.
_dctxs: dict[int, zstandard.ZstdDecompressor] = {}


def _dctx() -> zstandard.ZstdDecompressor:
    tid = threading.get_ident()
    d = _dctxs.get(tid)
    if d is None:
        if len(_dctxs) >= 256:  # short-lived threads come and go: drop the stale ones
            _dctxs.clear()
        d = _dctxs[tid] = zstandard.ZstdDecompressor()
    return d


def _c(c) -> tuple[int, ...]:
    return tuple(int(v) for v in c)


_DROP_PAGES_ABOVE = 8 << 20  # bytes; smaller shards keep their few pages mapped
_GRID_MAX_SLOTS = 1 << 21  # dense chunk lookup up to 128³ chunk slots (8 MB); a dict beyond


def _drop_mapped_pages(data: np.ndarray) -> None:
    """Unmap the pages of a memory-mapped shard from this process (they stay in the page cache).

    Loading a shard reads every record's header, which maps nearly the whole file into the
    process (a 32,768-record shard is ~140 MB of resident memory); after this, a chunk read
    maps only the pages of its own record again.
    """
    m = getattr(data.base, "obj", None)  # np.frombuffer(mmap) -> memoryview -> mmap
    if isinstance(m, mmap.mmap) and len(m) > _DROP_PAGES_ABOVE and hasattr(mmap, "MADV_DONTNEED"):
        try:
            m.madvise(mmap.MADV_DONTNEED)
        except (OSError, ValueError):
            pass


def _is_end_of_stream(data: np.ndarray, off: int, end: int) -> bool:
    """Whether a stream scan reaching byte off would stop there at an end-of-stream marker."""
    if off + 8 > end:
        return False
    head = bytes(data[off:off + 8])
    meta = head[4:8] if head[:4] == b"\xff\xff\xff\xff" else head[:4]
    return meta == b"\x00\x00\x00\x00"


def max_block_bytes(chunk_size) -> int:
    """Largest possible DVID block encoding for a chunk of this size (bounds decompression)."""
    v = int(np.prod(chunk_size))
    nsub = v // 512
    return 16 + 8 * v + 2 * nsub + 4 * v + nsub * 576


def decompress_block(payload, usize: int, max_bytes: int, where: str) -> bytes:
    """zstd-decompress one record's dvid_compressed_block, checking its size claims first.

    ``usize`` is the record's uncompressed_size (-1 when the schema has none); ``max_bytes``
    bounds what a frame may claim (see ``max_block_bytes``).
    """
    try:
        return _decompress(payload, usize, max_bytes)
    except BlockDecodeError as e:
        raise BlockDecodeError(f"{where}: {e}") from None


def _decompress(payload, usize: int, max_bytes: int) -> bytes:
    """``decompress_block`` without the location prefix in its errors (the caller adds it)."""
    try:
        n = _frame_content_size(payload)
    except _ZstdError as e:
        raise BlockDecodeError(f"dvid_compressed_block is not a zstd frame ({e})") from None
    if n > max_bytes or (usize >= 0 and n >= 0 and n != usize):
        raise BlockDecodeError(f"zstd frame declares {n} bytes, uncompressed_size is {usize}")
    try:
        block = _dctx().decompress(payload, max_output_size=usize if usize > 0 else max_bytes)
    except _ZstdError as e:
        raise BlockDecodeError(f"corrupt zstd frame ({e})") from None
    if usize >= 0 and len(block) != usize:
        raise BlockDecodeError(f"block is {len(block)} bytes, uncompressed_size says {usize}")
    return block


def decode_record(block: bytes, palette, out: np.ndarray, where: str) -> None:
    """Decode an uncompressed DVID block into out, naming the chunk in any error."""
    try:
        decode_into(np.frombuffer(block, np.uint8), palette, out)
    except BlockDecodeError as e:
        raise BlockDecodeError(f"{where}: {e}") from None


class ShardFile:
    """A loaded shard: read chunks by coordinate.

    Parameters
    ----------
    source : ByteSource
        Where the files are.
    stem : str
        Key of the shard without extension, e.g. ``"s0/0_0_0"``.
    chunk_size : tuple of int
        Chunk shape (x, y, z) in voxels.
    box : tuple or None
        ``(lo, hi)`` chunk coordinates the shard's name says it covers; records outside are errors.
    index : ShardIndex or None
        A preloaded index (from a consolidated index); otherwise the shard's own index is read.
    """

    def __init__(self, source: ByteSource, stem: str, chunk_size=(64, 64, 64), box=None,
                 index: ShardIndex | None = None):
        self.source = source
        self.stem = stem
        self.path = source.describe(stem + ".arrow")
        self.chunk_size = tuple(int(c) for c in chunk_size)
        self._max_block = max_block_bytes(self.chunk_size)
        data = source.map(stem + ".arrow")
        self._data = data
        self.variant, self.index, self.layout, self.schema_size, records = self._load(data, index)
        if records is None:
            records = ipc.resolve_rows(data, 0, self.index.msg_off, self.index.msg_len, self.index.row,
                                       self.layout, self.path, chunks=self.index.coords)
        self.records = records
        self._check(box)
        self._grid = self._lookup = None
        self._make_lookup(box)
        # Arrow aligns buffers to 8 bytes; copy palettes only if a writer did not
        self._aligned = bool(((self.records[:, ipc.R_LAB] | self.records[:, ipc.R_SV]) % 8 == 0).all())
        _drop_mapped_pages(data)

    def __len__(self) -> int:
        return len(self.index)

    def __repr__(self) -> str:
        return f"ShardFile({self.path!r}, variant={self.variant}, chunks={len(self)})"

    # --- loading -----------------------------------------------------------------------------

    def _load(self, data: np.ndarray, given: ShardIndex | None):
        where = self.path
        size = data.shape[0]
        if size < 8:
            raise ShardFormatError(f"{where}: {size} bytes is too short for an Arrow IPC shard")
        footer_n = footer_length(bytes(data[-16:]), size, where)
        ipc_end = size - 16 - footer_n if footer_n else size
        is_file = ipc.is_ipc_file(bytes(data[:6]))
        schema, schema_len = ipc.schema_from_message(data, 8 if is_file else 0, where)
        layout = ipc.SchemaLayout(schema, where)
        if not is_file:
            try:
                fast = self._load_by_offsets(data, given, schema_len, ipc_end, layout)
            except DvidShardsError:
                fast = None  # the full path below reports the problem, in its own order
            if fast is not None:
                index, records = fast
                return index.variant, index, layout, schema_len, records
        # every record batch in the file: the index must list each record exactly once
        if is_file:
            offs, lens = ipc.file_footer_blocks(data, ipc_end, where)
            rows = ipc.batch_rows(data, offs, lens, layout, where)
        else:
            offs, lens, rows = ipc.scan_stream(data, schema_len, ipc_end, where)
        if given is not None:
            index = given
        else:
            csv_key = self.stem + ".csv"
            if self.source.exists(csv_key):
                raw = parse_csv(self.source.read(csv_key), self.source.describe(csv_key))
                if raw.schema_size is not None and not is_file and raw.schema_size != schema_len:
                    raise ChunkIndexError(f"{self.source.describe(csv_key)}: schema_size={raw.schema_size} "
                                          f"but the schema message in {where} is {schema_len} bytes")
            elif footer_n:
                raw = parse_footer(bytes(data[ipc_end:size - 16]), self.chunk_size, where)
            else:
                raise ChunkIndexError(f"{where}: no chunk index (neither {self.stem}.csv nor a CHUNKIDX footer)")
            index = ShardIndex.from_raw(raw, where, (offs, lens, rows))
        self._check_complete(index, offs, lens, rows)
        return index.variant, index, layout, schema_len, None

    def _load_by_offsets(self, data: np.ndarray, given: ShardIndex | None, schema_len: int, ipc_end: int,
                         layout) -> tuple[ShardIndex, np.ndarray] | None:
        """Load a stream whose index gives byte offsets (A, B, consolidated) without scanning it.

        Scanning a 32,768-record stream walks every message twice (~30-45 ms), only to learn
        which record batches exist. When the indexed batches, resolved (which checks each one as
        the scan would), tile the stream from the schema to its end or end-of-stream marker,
        the scan could find exactly these batches and no others, so it is skipped. Returns
        None (run the full path) for any other index or layout; a check failing here also
        sends the caller to the full path, which raises the error in its usual order.
        """
        if given is not None:
            index = given
        else:
            csv_key = self.stem + ".csv"
            if not self.source.exists(csv_key):
                return None
            raw = parse_csv(self.source.read(csv_key), self.source.describe(csv_key))
            if raw.variant not in ("A", "B") or raw.schema_size != schema_len:
                return None
            index = ShardIndex.from_raw(raw, self.path)
        if not len(index):
            return None
        records = ipc.resolve_rows(data, 0, index.msg_off, index.msg_len, index.row, layout, self.path,
                                   chunks=index.coords)
        offs, first = np.unique(index.msg_off, return_index=True)
        lens = index.msg_len[first]
        if (index.msg_len != lens[np.searchsorted(offs, index.msg_off)]).any():
            return None
        if offs[0] != schema_len or (offs[1:] != offs[:-1] + lens[:-1]).any():
            return None
        end = int(offs[-1] + lens[-1])
        if end != ipc_end and not _is_end_of_stream(data, end, ipc_end):
            return None
        self._check_complete(index, offs, lens, records[first, ipc.R_ROWS])
        return index, records

    def _check_complete(self, index: ShardIndex, offs, lens, rows) -> None:
        """Index rows and records are in one-to-one correspondence."""
        where = self.path
        order = np.argsort(offs, kind="stable")
        offs, lens, rows = offs[order], lens[order], rows[order]
        b = np.minimum(np.searchsorted(offs, index.msg_off), max(len(offs) - 1, 0))
        ok = (offs[b] == index.msg_off) if len(offs) else np.zeros(len(index), bool)
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            raise ChunkIndexError(f"{where}: index entry for chunk {_c(index.coords[i])} points at "
                                  f"byte {index.msg_off[i]}, where no record batch starts")
        bad = np.flatnonzero((lens[b] != index.msg_len) | (index.row >= rows[b]))
        if bad.size:
            i = int(bad[0])
            raise ChunkIndexError(f"{where}: index entry for chunk {_c(index.coords[i])} (size {index.msg_len[i]}, "
                                  f"row {index.row[i]}) does not match the record batch at byte {index.msg_off[i]} "
                                  f"({lens[b[i]]} bytes, {rows[b[i]]} rows)")
        starts = np.concatenate([[0], np.cumsum(rows)])
        flat = starts[b] + index.row
        seen = np.bincount(flat, minlength=int(starts[-1]))
        dup = seen[flat] > 1
        if dup.any():
            i = int(np.flatnonzero(dup)[0])
            raise ChunkIndexError(f"{where}: two index entries point at the record of chunk {_c(index.coords[i])}")
        if (seen == 0).any():
            r = int(np.flatnonzero(seen == 0)[0])
            raise ChunkIndexError(f"{where}: record {r} of {int(starts[-1])} has no index entry")

    def _check(self, box) -> None:
        where = self.path
        got = self.records[:, ipc.R_CX:ipc.R_CZ + 1]
        bad = np.flatnonzero((got != self.index.coords).any(axis=1))
        if bad.size:
            i = int(bad[0])
            raise ChunkIndexError(f"{where}: index says chunk {_c(self.index.coords[i])} but its record "
                                  f"holds chunk {_c(got[i])}")
        if box is not None:
            lo, hi = (np.asarray(v) for v in box)
            out = np.flatnonzero(((got < lo) | (got >= hi)).any(axis=1))
            if out.size:
                i = int(out[0])
                raise ChunkIndexError(f"{where}: chunk {_c(got[i])} lies outside the shard its file "
                                      f"name says (chunks {tuple(lo.tolist())} to {tuple((hi - 1).tolist())})")

    def _make_lookup(self, box) -> None:
        """Chunk → record: a dense int32 grid over the shard's box, or a dict without a (small) box.

        The grid costs 4 bytes per chunk slot (128 KB for DVID's 32³-chunk shards) where a dict
        costs ~100 bytes per record (3.3 MB for 32,768 records), and it is built in a fraction
        of the time. ``_check`` has put every record inside the box.
        """
        if box is not None:
            lo = np.asarray(box[0], np.int64)
            nx, ny, nz = (int(h) - int(a) for a, h in zip(box[0], box[1], strict=True))
            if min(nx, ny, nz) > 0 and nx * ny * nz <= _GRID_MAX_SLOTS:  # Python ints: no overflow
                c = self.index.coords - lo
                grid = np.full(nx * ny * nz, -1, np.int32)
                grid[(c[:, 2] * ny + c[:, 1]) * nx + c[:, 0]] = np.arange(len(c), dtype=np.int32)
                self._grid = memoryview(grid)  # item access gives a Python int
                self._grid_box = (*(int(v) for v in lo), nx, ny, nz)
                return
        self._lookup = dict(zip(pack_keys(self.index.coords).tolist(), range(len(self.index)), strict=True))

    # --- reading -----------------------------------------------------------------------------

    def find(self, x: int, y: int, z: int) -> int | None:
        """Record number of chunk (x, y, z), None when the shard does not hold it (background)."""
        grid = self._grid
        if grid is None:
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

    def block(self, i: int) -> bytes:
        """The uncompressed DVID block of record i."""
        rec = self.records[i].tolist()
        pay, plen = rec[ipc.R_PAY], rec[ipc.R_PAYLEN]
        return decompress_block(self._data[pay:pay + plen], rec[ipc.R_USIZE], self._max_block,
                                f"{self.path}: chunk {tuple(rec[ipc.R_CX:ipc.R_CZ + 1])}")

    def labels(self, i: int) -> np.ndarray:
        """The agglomerated label list of record i (zero-copy when aligned)."""
        rec = self.records[i]
        return self._u64(int(rec[ipc.R_LAB]), int(rec[ipc.R_NLAB]))

    def supervoxels(self, i: int) -> np.ndarray:
        """The supervoxel list of record i (zero-copy when aligned)."""
        rec = self.records[i]
        return self._u64(int(rec[ipc.R_SV]), int(rec[ipc.R_NSV]))

    def _u64(self, off: int, n: int) -> np.ndarray:
        v = self._data[off:off + 8 * n]
        return v.view(np.uint64) if self._aligned else v.copy().view(np.uint64)

    def read_into(self, x: int, y: int, z: int, out: np.ndarray, mode: int = AGGLOMERATED, mapping=None) -> bool:
        """Decode chunk (x, y, z) into out (z, y, x, any strides, possibly cropped); 0 if absent.

        Returns whether the shard held the chunk.
        """
        # block(), labels() and decode_record() inlined: this runs once per chunk with the GIL
        # held, and error locations are formatted only when there is an error
        i = self.find(x, y, z)
        if i is None:
            out.fill(0)
            return False
        rec = self.records[i].tolist()
        data = self._data
        pay = rec[_PAY]
        try:
            block = _decompress(data[pay:pay + rec[_PAYLEN]], rec[_USIZE], self._max_block)
        except BlockDecodeError as e:
            raise BlockDecodeError(f"{self.path}: chunk {tuple(rec[ipc.R_CX:ipc.R_CZ + 1])}: {e}") from None
        if mode == AGGLOMERATED:
            off = rec[_LAB]
            v = data[off:off + 8 * rec[_NLAB]]
            palette = v.view(_U64) if self._aligned else v.copy().view(_U64)
        elif mode == SUPERVOXELS:
            palette = None
        else:
            off = rec[_SV]
            v = data[off:off + 8 * rec[_NSV]]
            palette = mapping.palette(v.view(_U64) if self._aligned else v.copy().view(_U64))
        try:
            decode_into(np.frombuffer(block, _U8), palette, out)
        except BlockDecodeError as e:
            raise BlockDecodeError(f"{self.path}: chunk {(x, y, z)}: {e}") from None
        return True
