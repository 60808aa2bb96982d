"""One shard file: its schema, its normalised index and its resolved records.

A shard is loaded once (schema, index, record locations, all checked against each other); a
chunk read is then a dict lookup, a zstd decompression of a memory-mapped slice and a nogil
decode into the caller's array, with the record's label list (also a slice of the map) as the
palette.
"""

from __future__ import annotations

import threading

import numpy as np
import zstandard

from . import arrowipc as ipc
from .codec import decode_into
from .errors import BlockDecodeError, ChunkIndexError, ShardFormatError
from .index import ShardIndex, footer_length, pack_key, pack_keys, parse_csv, parse_footer
from .sources import ByteSource

__all__ = ["AGGLOMERATED", "MAPPED", "SUPERVOXELS", "ShardFile", "decode_record", "decompress_block", "max_block_bytes"]

AGGLOMERATED, SUPERVOXELS, MAPPED = 0, 1, 2
_tls = threading.local()


def _dctx() -> zstandard.ZstdDecompressor:
    d = getattr(_tls, "dctx", None)
    if d is None:
        d = _tls.dctx = zstandard.ZstdDecompressor()
    return d


def _c(c) -> tuple[int, ...]:
    return tuple(int(v) for v in c)


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
        n = zstandard.frame_content_size(payload)
    except zstandard.ZstdError as e:
        raise BlockDecodeError(f"{where}: dvid_compressed_block is not a zstd frame ({e})") from None
    if n > max_bytes or (usize >= 0 and n >= 0 and n != usize):
        raise BlockDecodeError(f"{where}: zstd frame declares {n} bytes, uncompressed_size is {usize}")
    try:
        block = _dctx().decompress(payload, max_output_size=usize if usize > 0 else max_bytes)
    except zstandard.ZstdError as e:
        raise BlockDecodeError(f"{where}: corrupt zstd frame ({e})") from None
    if usize >= 0 and len(block) != usize:
        raise BlockDecodeError(f"{where}: block is {len(block)} bytes, uncompressed_size says {usize}")
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
        self.variant, self.index, self.layout, self.schema_size = self._load(data, index)
        self.records = ipc.resolve_rows(data, 0, self.index.msg_off, self.index.msg_len, self.index.row,
                                        self.layout, self.path, chunks=self.index.coords)
        self._check(box)
        self._lookup = dict(zip(pack_keys(self.index.coords).tolist(), range(len(self.index)), strict=True))
        # Arrow aligns buffers to 8 bytes; copy palettes only if a writer did not
        self._aligned = bool(((self.records[:, ipc.R_LAB] | self.records[:, ipc.R_SV]) % 8 == 0).all())

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
        return index.variant, index, layout, schema_len

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

    # --- reading -----------------------------------------------------------------------------

    def find(self, x: int, y: int, z: int) -> int | None:
        """Record number of chunk (x, y, z), None when the shard does not hold it (background)."""
        return self._lookup.get(pack_key(x, y, z))

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
        i = self._lookup.get(pack_key(x, y, z))
        if i is None:
            out.fill(0)
            return False
        block = self.block(i)
        if mode == AGGLOMERATED:
            palette = self.labels(i)
        elif mode == SUPERVOXELS:
            palette = None
        else:
            palette = mapping.palette(self.supervoxels(i))
        decode_record(block, palette, out, f"{self.path}: chunk {(x, y, z)}")
        return True
