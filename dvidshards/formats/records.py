"""RecordTable: DVID block records located in byte buffers, whatever carried them.

Every source ends here: a shard file's Arrow IPC bytes (a local snapshot, a download, byte
ranges) or a ``pyarrow.RecordBatch`` (Flight, Parquet, any Arrow stream). A table is one int64
array of record locations (``arrowipc.REC_FIELDS``) plus the buffers they point into: a chunk
read is a row lookup, a zstd decompression and a nogil decode into the caller's array, with no
Arrow object built. A table of a local file's snapshot (memory carrying a ``shard_file``) copies
its label lists and reads payloads from the file (``pread``): a file that shrank since is a
ShardFormatError naming file and chunk, where a memory map would die of SIGBUS.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import zstandard

from ..errors import BlockDecodeError, ShardFormatError
from . import arrowipc as ipc
from .blocklayout import E_OK, NO_PALETTE, block_error
from .codec import decode_into, decode_kernel
from .labels import Agglomerated, Supervoxels

__all__ = ["RecordTable", "install_decompressor", "list_values", "max_block_bytes",
           "normalise_batch"]

# R_SV and R_NSV are adjacent (one slice gives both)
R_CX, R_PAY, R_PAYLEN, R_LAB, R_NLAB, R_SV, R_NSV, R_USIZE = (ipc.R_CX, ipc.R_PAY, ipc.R_PAYLEN, ipc.R_LAB,
                                                              ipc.R_NLAB, ipc.R_SV, ipc.R_NSV, ipc.R_USIZE)
_U8, _U64 = np.dtype(np.uint8), np.dtype(np.uint64)
_NO_BYTES = np.zeros(0, np.uint8)
_GAP = 4096  # payload reads closer than this are merged into one
_frame_content_size, _ZstdError = zstandard.frame_content_size, zstandard.ZstdError

# a new decompressor per call unless the runtime installs its per-thread ones (runtime.zstd)
_dctx: Callable[[], zstandard.ZstdDecompressor] = zstandard.ZstdDecompressor


def install_decompressor(get: Callable[[], zstandard.ZstdDecompressor]) -> None:
    """Make every block decompression of this process use ``get()``'s decompressor."""
    global _dctx
    _dctx = get


def max_block_bytes(chunk_size: Any) -> int:
    """Largest DVID block encoding for a chunk of this size (bounds decompression)."""
    v = int(np.prod(chunk_size))
    nsub = v // 512
    return 16 + 8 * v + 2 * nsub + 4 * v + nsub * 576


def _decompress(payload: Any, usize: int, max_bytes: int) -> Any:
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


def _labels_match(labels: bytes, sv: bytes) -> bool:
    """A block's label list (bytes 16..16+8N) equals a record's supervoxel list."""
    return labels == sv


def _mismatch(block: Any, sv: np.ndarray) -> str:
    """What differs between a block's label list and a record's supervoxel list."""
    b = bytes(memoryview(block)[:16])
    n = int.from_bytes(b[12:16], "little") if len(b) >= 16 else -1
    if n != len(sv):
        return f"the block has {n} labels but its record lists {len(sv)}"
    own = np.frombuffer(bytes(memoryview(block)[16:16 + 8 * n]), "<u8")
    j = int(np.flatnonzero(own != sv)[0])
    how = ("the same ids in another order" if np.array_equal(np.sort(own), np.sort(sv)) else "other ids")
    return (f"the record's supervoxel list is not its block's label list ({how}: entry {j} is {int(sv[j])} in "
            f"the record, {int(own[j])} in the block), so its labels cannot be matched to the block's voxels")


class RecordTable:
    """Records: chunk coordinates, payloads, uncompressed sizes and the two label lists.

    ``rec`` is the (n, REC_FIELDS) int64 location array; payload offsets index ``bufs[0]``, label
    lists ``bufs[1]``, supervoxel lists ``bufs[2]``. With ``file`` (a ``stores.local.ShardFile``:
    ``pread``, ``readinto``, ``changed``, ``path``) payload offsets are offsets in that file, read
    when a record is.
    """

    __slots__ = ("_aligned", "_bufs", "_file", "_labv", "_max_block", "_svmv", "_whole", "chunk_size", "path",
                 "rec")

    def __init__(self, rec: np.ndarray, bufs: tuple[np.ndarray, ...], path: str, chunk_size: Any = (64, 64, 64), file: Any = None) -> None:
        self.rec = rec
        self._bufs = tuple(bufs)
        self._file = file
        self._whole: np.ndarray | None = None
        self.path = path
        self.chunk_size = tuple(int(c) for c in chunk_size)
        self._max_block = max_block_bytes(self.chunk_size)
        self._svmv = memoryview(bufs[2])  # type: ignore[arg-type]  # slicing a memoryview costs half of slicing the array
        lab, sv = bufs[1], bufs[2]
        # Arrow aligns buffers to 8 bytes; copy palettes only if a writer did not
        self._aligned = bool(len(rec) == 0 or (lab.ctypes.data % 8 == 0 and sv.ctypes.data % 8 == 0
                                               and ((rec[:, R_LAB] | rec[:, R_SV]) % 8 == 0).all()))
        # the label lists as one uint64 array (aligned tables): a record's palette is one slice of it
        self._labv = lab[:lab.shape[0] // 8 * 8].view(_U64) if self._aligned else None

    @property
    def bufs(self) -> tuple[Any, ...]:
        """(payloads, label lists, supervoxel lists); a file's table reads the whole file once for the
        first (prefer `gather_payloads`)."""
        if self._file is None:
            return self._bufs
        w = self._whole
        if w is None:
            end = int((self.rec[:, R_PAY] + self.rec[:, R_PAYLEN]).max()) if len(self.rec) else 0
            w = np.empty(end, _U8)
            got = self._file.readinto(w, 0) if end else 0
            if got != end:
                raise ShardFormatError(f"{self.path}: the file changed since it was loaded: it ends at byte "
                                       f"{got}, its records at byte {end} (copied or synced while open?); open "
                                       f"the export again")
            w.flags.writeable = False
            self._whole = w
        return (w, self._bufs[1], self._bufs[2])

    @property
    def file(self) -> Any:
        """The shard file payloads are read from (None: in memory)."""
        return self._file

    @property
    def nbytes(self) -> int:
        """Memory this table holds of its own."""
        n = self.rec.nbytes
        if self._file is not None:
            n += self._bufs[1].nbytes + self._bufs[2].nbytes + (self._whole.nbytes if self._whole is not None else 0)
        return int(n)

    @classmethod
    def concat(cls, parts: list[RecordTable], path: str, chunk_size: Any = (64, 64, 64)) -> RecordTable:
        """One table over the records of several, their buffers copied into one per column (parts over
        one buffer, byte ranges of a shard file, give a table over one buffer)."""
        if len(parts) == 1:
            return parts[0]
        if not parts:
            z = np.zeros(0, np.uint8)
            return cls(np.zeros((0, ipc.REC_FIELDS), np.int64), (z, z, z), path, chunk_size)
        f = parts[0]._file
        if f is not None and all(p._file is f for p in parts):
            # records of one file: payload offsets stay file offsets, only the lists are joined
            groups, kinds = [[R_LAB], [R_SV]], [1, 2]
        else:
            f = None
            shared = all(p.bufs[0] is p.bufs[1] is p.bufs[2] for p in parts)
            groups, kinds = ([[R_PAY, R_LAB, R_SV]], [0]) if shared else ([[R_PAY], [R_LAB], [R_SV]], [0, 1, 2])
        recs = [p.rec.copy() for p in parts]
        bufs = []
        for k, cols in zip(kinds, groups, strict=True):
            pos = 0
            for p, r in zip(parts, recs, strict=True):
                r[:, cols] += pos
                pos += (p._bufs if f is not None else p.bufs)[k].shape[0]
            bufs.append(np.concatenate([(p._bufs if f is not None else p.bufs)[k] for p in parts]))
        if f is not None:
            return cls(np.concatenate(recs), (_NO_BYTES, *bufs), path, chunk_size, f)
        return cls(np.concatenate(recs), tuple(bufs * 3 if len(bufs) == 1 else bufs), path, chunk_size)

    def __reduce__(self) -> Any:
        return (RecordTable, (self.rec, self._bufs, self.path, self.chunk_size, self._file))

    def take(self, rows: Any) -> RecordTable:
        """The records ``rows``, in that order, sharing this table's buffers."""
        return RecordTable(self.rec[np.asarray(rows, np.int64)], self._bufs, self.path, self.chunk_size,
                           self._file)

    def __len__(self) -> int:
        return len(self.rec)

    def __repr__(self) -> str:
        return f"RecordTable({self.path!r}, {len(self)} records)"

    @property
    def coords(self) -> np.ndarray:
        return self.rec[:, R_CX:R_CX + 3]

    def where(self, i: int) -> str:
        """``"path: chunk (x, y, z)"`` of record i, for messages."""
        return f"{self.path}: chunk {tuple(int(v) for v in self.rec[i, R_CX:R_CX + 3])}"

    def payload(self, i: int) -> np.ndarray:
        """The zstd frame of record i (a zero-copy view, or read from the file)."""
        off, n = int(self.rec[i, R_PAY]), int(self.rec[i, R_PAYLEN])
        if self._file is None:
            return self._bufs[0][off:off + n]
        return np.frombuffer(self._read(i, off, n), _U8)

    def _read(self, i: int, off: int, n: int) -> bytes:
        """Bytes [off, off + n) of this table's file, all of them or a typed error."""
        f = self._file
        data = f.pread(off, n)
        if len(data) != n:
            raise ShardFormatError(f"{self.where(i)}: the file changed since it was loaded: it ends at byte "
                                   f"{off + len(data)}, before this chunk's record [{off}, {off + n}) (copied or "
                                   f"synced while open?); open the export again")
        return bytes(data)

    def _changed(self, i: int) -> ShardFormatError | None:
        """A ShardFormatError if this table's file changed since it was loaded, else None."""
        f = self._file
        how = f.changed() if f is not None else None
        if how is None:
            return None
        return ShardFormatError(f"{self.where(i)}: the file changed since it was loaded: {how} (copied or synced "
                                f"while open?); open the export again")

    def gather_payloads(self, rows: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(buffer, offsets, lengths) of the zstd frames of records ``rows``: a table's own buffer, or
        for a file's table those records read (ranges closer than 4 KiB merged) into one new buffer."""
        rows = np.asarray(rows, np.int64)
        rec = self.rec[rows]
        off, ln = rec[:, R_PAY], rec[:, R_PAYLEN]
        if self._file is None:
            return self._bufs[0], off, ln
        offs, lens = off.tolist(), ln.tolist()  # a run is tens of records: Python ints beat numpy here
        spans: list[list[int]] = []  # [file start, file end, position in the buffer]
        new = [0] * len(offs)
        pos = 0
        g: list[int] = []
        for k in sorted(range(len(offs)), key=offs.__getitem__):
            a = offs[k]
            b = a + lens[k]
            if spans and a - g[1] <= _GAP:
                if b > g[1]:
                    pos += b - g[1]
                    g[1] = b
            else:
                g = [a, b, pos]
                spans.append(g)
                pos += b - a
            new[k] = g[2] + a - g[0]
        if len(spans) == 1:  # records next to each other (a row of chunks, usually): one read, no copy
            a, b, _ = spans[0]
            data = self._file.pread(a, b - a)
            got = len(data)
            buf = np.frombuffer(data, _U8)
        else:
            buf = np.empty(pos, _U8)
            for a, b, q in spans:
                got = self._file.readinto(buf[q:q + b - a], a)
                if got != b - a:
                    break
        if got != b - a:
            k = next(k for k in range(len(offs)) if a <= offs[k] < b and offs[k] + lens[k] > a + got)
            raise ShardFormatError(f"{self.where(int(rows[k]))}: the file changed since it was loaded: it ends at "
                                   f"byte {a + got}, before this chunk's record [{offs[k]}, {offs[k] + lens[k]}) "
                                   f"(copied or synced while open?); open the export again")
        return buf, np.array(new, np.int64), ln

    def usize(self, i: int) -> int:
        """Record i's uncompressed_size (-1 when the schema has none)."""
        return int(self.rec[i, R_USIZE])

    def _u64(self, buf: np.ndarray, off: int, n: int) -> np.ndarray:
        v = buf[off:off + 8 * n]
        return v.view(_U64) if self._aligned else v.copy().view(_U64)

    def labels(self, i: int) -> np.ndarray:
        return self._u64(self._bufs[1], int(self.rec[i, R_LAB]), int(self.rec[i, R_NLAB]))

    def supervoxels(self, i: int) -> np.ndarray:
        return self._u64(self._bufs[2], int(self.rec[i, R_SV]), int(self.rec[i, R_NSV]))

    def block(self, i: int) -> bytes:
        """The uncompressed DVID block of record i (sizes and zstd checksum checked, its label list the
        record's supervoxel list: the record's palettes are indexed by block label)."""
        try:
            block = _decompress(self.payload(i), self.usize(i), self._max_block)
            if len(block) >= 16 and not self.labels_match(i, block):
                raise BlockDecodeError(_mismatch(block, self.supervoxels(i)))
        except BlockDecodeError as e:
            raise (self._file is not None and self._changed(i)) or BlockDecodeError(f"{self.where(i)}: {e}") \
                from None
        return bytes(block)

    def labels_match(self, i: int, block: Any) -> bool:
        """Whether record i's supervoxel list is ``block``'s label list, entry for entry (the same ids in
        another order would pair the record's labels with the wrong voxels)."""
        off, n = self.rec[i, R_SV:R_NSV + 1].tolist()
        head = bytes(memoryview(block)[12:16 + 8 * n]) if not isinstance(block, np.ndarray) else \
            block[12:16 + 8 * n].tobytes()
        return n < 1 << 32 and head[:4] == n.to_bytes(4, "little") and \
            _labels_match(head[4:], self._svmv[off:off + 8 * n].tobytes())

    def decode_into(self, i: int, out: np.ndarray, labels: Any) -> None:
        """Decode record i into ``out`` ((z, y, x), any strides, possibly cropped) through the label
        source ``labels``; BlockDecodeError or ShardFormatError naming file and chunk.

        The TensorStore callback's hot path: `block`, `labels_match`, the palette and
        ``codec.decode_into`` in one function (a Python call costs ~10x more between two 2 MiB decodes
        than in a loop).
        """
        r = self.rec[i].tolist()
        pay, usize = r[R_PAY], r[R_USIZE]
        f = self._file
        try:
            plen = r[R_PAYLEN]
            if f is None:
                payload = self._bufs[0][pay:pay + plen]
            else:
                payload = f.pread(pay, plen)
                if len(payload) != plen:
                    self._read(i, pay, plen)  # raises: the file ends before the record
            # _decompress, inline: the frame's declared size is checked before anything is allocated
            try:
                n = _frame_content_size(payload)  # type: ignore[arg-type]
            except _ZstdError as e:
                raise BlockDecodeError(f"dvid_compressed_block is not a zstd frame ({e})") from None
            if n > self._max_block or (usize >= 0 and n >= 0 and n != usize):
                raise BlockDecodeError(f"zstd frame declares {n} bytes, uncompressed_size is {usize}")
            d = _dctx()
            try:
                block = d.decompress(payload, max_output_size=usize if usize > 0 else self._max_block)  # type: ignore[arg-type]
            except _ZstdError as e:
                raise BlockDecodeError(f"corrupt zstd frame ({e})") from None
            size = len(block)
            if usize >= 0 and size != usize:
                raise BlockDecodeError(f"block is {size} bytes, uncompressed_size says {usize}")
            # labels_match: the record's supervoxel list is the block's label list, entry for entry
            n = int.from_bytes(block[12:16], "little") if size >= 16 else -1
            if n >= 1 and size >= 16 + 8 * n:  # else the decoder names the damage
                sv = r[R_SV]
                if n != r[R_NSV] or block[16:16 + 8 * n] != self._svmv[sv:sv + 8 * n].tobytes():
                    raise BlockDecodeError(_mismatch(block, self.supervoxels(i)))
            kind = type(labels)
            if kind is Agglomerated and self._labv is not None:  # Agglomerated.palette: the record's labels
                lab = r[R_LAB] >> 3
                pal = self._labv[lab:lab + r[R_NLAB]]
            elif kind is Supervoxels:
                pal = None
            else:
                pal = labels.palette(self, i)
            data = np.frombuffer(block, _U8)
            try:
                code, a, b = decode_kernel(data, NO_PALETTE if pal is None else pal, pal is not None, out)
            except (TypeError, ValueError):  # arguments of another type or layout: decode_into says which
                decode_into(data, pal, out)
                return
            if code != E_OK:
                raise block_error(code, a, b, data, out)
        except BlockDecodeError as e:
            raise (f is not None and self._changed(i)) or BlockDecodeError(f"{self.where(i)}: {e}") from None

    @classmethod
    def from_ipc(cls, data: Any, base: int, msg_off: Any, msg_len: Any, rows: Any, layout: ipc.SchemaLayout, path: str,
                 chunk_size: Any = (64, 64, 64), chunks: Any = None) -> RecordTable:
        """Records of Arrow IPC record batch messages in ``data`` (from offset ``base``): each record's
        message offset and length and its row in it; every header, buffer and offset checked."""
        u8 = data if isinstance(data, np.ndarray) else np.frombuffer(data, _U8)
        rec = ipc.resolve_rows(u8, base, msg_off, msg_len, rows, layout, path, chunks=chunks)
        f = _shard_file(data) if base == 0 else None
        if f is not None:  # a local file's snapshot: keep the lists, read payloads from the file
            lab, rec[:, R_LAB] = _compact(u8, rec[:, R_LAB], rec[:, R_NLAB])
            sv, rec[:, R_SV] = _compact(u8, rec[:, R_SV], rec[:, R_NSV])
            return cls(rec, (_NO_BYTES, lab, sv), path, chunk_size, f)
        if base:
            rec[:, [R_PAY, R_LAB, R_SV]] -= base
        return cls(rec, (u8, u8, u8), path, chunk_size)

    @classmethod
    def from_batch(cls, batch: Any, path: str, chunk_size: Any = (64, 64, 64)) -> RecordTable:
        """Records of a ``pyarrow.RecordBatch`` (or Table), normalised (`normalise_batch`), buffers
        used in place."""
        batch = normalise_batch(batch, path)
        n = batch.num_rows
        rec = np.empty((n, ipc.REC_FIELDS), np.int64)
        rec[:, ipc.R_ROWS] = n
        for a, name in enumerate(("chunk_x", "chunk_y", "chunk_z")):
            rec[:, R_CX + a] = batch.column(name).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
        pay_buf, pay_off, pay_len = _binary(batch.column("dvid_compressed_block"), path)
        lab_buf, lab_off, nlab = _u64_lists(batch.column("labels"), path, "labels")
        sv_buf, sv_off, nsv = _u64_lists(batch.column("supervoxels"), path, "supervoxels")
        bad = np.flatnonzero(nlab != nsv)
        if bad.size:
            i = int(bad[0])
            raise ShardFormatError(f"{path}: chunk {tuple(rec[i, R_CX:R_CX + 3].tolist())}: labels and "
                                   f"supervoxels lists differ in length ({nlab[i]} vs {nsv[i]})")
        rec[:, R_PAY], rec[:, R_PAYLEN] = pay_off, pay_len
        rec[:, R_LAB], rec[:, R_NLAB] = lab_off, nlab
        rec[:, R_SV], rec[:, R_NSV] = sv_off, nsv
        if "uncompressed_size" in batch.schema.names:
            rec[:, R_USIZE] = batch.column("uncompressed_size").to_numpy(zero_copy_only=False).astype(np.int64)
        else:
            rec[:, R_USIZE] = -1
        return cls(rec, (pay_buf, lab_buf, sv_buf), path, chunk_size)


def _shard_file(data: Any) -> Any:
    b = data
    while isinstance(b, np.ndarray):
        b = b.base
    return getattr(getattr(b, "obj", b), "shard_file", None)


def _compact(u8: np.ndarray, off: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Lists of n[i] uint64 at byte offsets off[i] of u8, copied back to back: (buffer, offsets)."""
    n = np.asarray(n, np.int64)
    first = np.zeros(len(n), np.int64)
    if len(n) > 1:
        np.cumsum(n[:-1], out=first[1:])
    total = int(n.sum())
    out = np.empty(total, np.uint64)
    if total:
        off = np.asarray(off, np.int64)
        ends = off + 8 * n
        cut = np.flatnonzero(off[1:] != ends[:-1]) + 1  # records of one batch: their lists follow each other
        if 8 * (len(cut) + 1) <= len(n):  # batches of many records: one copy per batch
            o8 = out.view(_U8)
            for a, b in zip([0, *cut.tolist()], [*cut.tolist(), len(n)], strict=True):
                p, q = 8 * int(first[a]), int(ends[b - 1])
                o8[p:p + q - int(off[a])] = u8[int(off[a]):q]
        elif u8.ctypes.data % 8 == 0 and not (off % 8).any():  # Arrow's 8-byte alignment: one uint64 gather
            u64 = u8[:u8.shape[0] // 8 * 8].view("<u8")
            out[:] = u64[np.repeat(off // 8 - first, n) + np.arange(total, dtype=np.int64)]
        else:
            out.view(_U8)[:] = u8[np.repeat(off - 8 * first, 8 * n) + np.arange(8 * total, dtype=np.int64)]
    return out.view(_U8), 8 * first


_RENAMES = {"block_coord_x": "chunk_x", "block_coord_y": "chunk_y", "block_coord_z": "chunk_z",
            "compressed_data": "dvid_compressed_block"}


def normalise_batch(batch: Any, path: str) -> Any:
    """A RecordBatch with DVID's export column names (the prototype's ``block_coord_*`` and
    ``compressed_data`` renamed, payloads split over ``bin1..bin4`` reassembled)."""
    if isinstance(batch, pa.Table):
        batch = batch.combine_chunks().to_batches()[0] if batch.num_rows else pa.RecordBatch.from_pylist(
            [], schema=batch.schema)
    names = [_RENAMES.get(n, n) for n in batch.schema.names]
    if names != batch.schema.names:
        batch = pa.RecordBatch.from_arrays(batch.columns, names=names)
    if "bin1" in names:
        import pyarrow.compute as pc

        n = batch.num_rows
        bins = [batch.column(b) if b in names else pa.nulls(n, pa.binary()) for b in ("bin1", "bin2", "bin3", "bin4")]
        whole = batch.column("dvid_compressed_block") if "dvid_compressed_block" in names else pa.nulls(n, pa.binary())
        # a cell is used only after the one before it, and a record has its payload somewhere
        valid = [np.asarray(b.is_valid()) for b in bins]
        for k in range(1, 4):
            gap = np.flatnonzero(valid[k] & ~valid[k - 1])
            if gap.size:
                raise ShardFormatError(f"{path}: row {int(gap[0])} has bin{k + 1} but no bin{k}")
        has_whole = np.asarray(whole.is_valid())
        none = np.flatnonzero(~has_whole & ~valid[0])
        if none.size:
            raise ShardFormatError(f"{path}: row {int(none[0])} has neither dvid_compressed_block nor bin1")
        if not any(v.any() for v in valid[1:]) and not has_whole.any():
            joined = bins[0]  # nothing split: the payloads as they are (zero-copy)
        else:
            big = [b.cast(pa.large_binary()) for b in bins]
            joined = pc.binary_join_element_wise(*big, pa.scalar(b"", pa.large_binary()),
                                                 null_handling="replace", null_replacement=b"")
            joined = pc.if_else(pa.array(has_whole), whole.cast(pa.large_binary()), joined)
        drop = ("bin1", "bin2", "bin3", "bin4", "dvid_compressed_block")
        cols = [c for nm, c in zip(names, batch.columns, strict=True) if nm not in drop]
        keep = [nm for nm in names if nm not in drop]
        batch = pa.RecordBatch.from_arrays([*cols, joined], names=[*keep, "dvid_compressed_block"])
    missing = [c for c in ("chunk_x", "chunk_y", "chunk_z", "labels", "supervoxels", "dvid_compressed_block")
               if c not in batch.schema.names]
    if missing:
        raise ShardFormatError(f"{path}: record batch lacks DVID columns {missing}")
    for c in batch.schema.names:
        if batch.column(c).null_count:
            raise ShardFormatError(f"{path}: column {c!r} has nulls; DVID record columns are non-nullable")
    return batch


def _offsets(arr: Any, path: str, what: str, nvalues: int) -> np.ndarray:
    """An array's value offsets (its slice respected), checked monotone and within nvalues."""
    large = pa.types.is_large_binary(arr.type) or pa.types.is_large_list(arr.type)
    ob = arr.buffers()[1]
    if ob is None:
        offs = np.zeros(1, np.int64)
    else:
        raw = np.frombuffer(ob, np.int64 if large else np.int32)
        offs = raw[arr.offset:arr.offset + len(arr) + 1].astype(np.int64)
    if len(offs) != len(arr) + 1 or (len(offs) and (offs[0] < 0 or offs[-1] > nvalues)) or \
            (np.diff(offs) < 0).any():
        raise ShardFormatError(f"{path}: column {what!r} has offsets out of order or out of range")
    return offs


def _binary(arr: Any, path: str) -> Any:
    if not (pa.types.is_binary(arr.type) or pa.types.is_large_binary(arr.type)):
        raise ShardFormatError(f"{path}: column 'dvid_compressed_block' has type {arr.type}, expected binary")
    data = arr.buffers()[2]
    buf = np.frombuffer(data, _U8) if data is not None else np.zeros(0, _U8)
    offs = _offsets(arr, path, "dvid_compressed_block", len(buf))
    return buf, offs[:-1], np.diff(offs)


def _u64_lists(arr: Any, path: str, what: str) -> Any:
    t = arr.type
    if not ((pa.types.is_list(t) or pa.types.is_large_list(t)) and t.value_type == pa.uint64()):
        raise ShardFormatError(f"{path}: column {what!r} has type {t}, expected list<uint64>")
    child = arr.values
    if child.null_count:
        raise ShardFormatError(f"{path}: column {what!r} holds null ids")
    vb = child.buffers()[1]
    buf = np.frombuffer(vb, _U8) if vb is not None else np.zeros(0, _U8)
    offs = _offsets(arr, path, what, len(buf) // 8 - child.offset)
    return buf, 8 * (offs[:-1] + child.offset), np.diff(offs)


def list_values(t: Any, which: str) -> tuple[np.ndarray, np.ndarray]:
    """All entries of one list column of a RecordTable, flat, and the record each belongs to."""
    lists = t._bufs  # the list buffers (never the payloads: a file's table would read them whole)
    off_col, n_col, buf = (R_LAB, R_NLAB, lists[1]) if which == "labels" else (R_SV, R_NSV, lists[2])
    n = t.rec[:, n_col]
    owner = np.repeat(np.arange(len(t), dtype=np.int64), n)
    if not len(t):
        return np.zeros(0, np.uint64), owner
    off = t.rec[:, off_col]
    if buf.ctypes.data % 8 == 0 and not (off % 8).any():
        # one gather over the buffer viewed as uint64 (offsets were checked when the table was built)
        u64 = buf[:buf.shape[0] // 8 * 8].view("<u8")
        first = np.repeat(off // 8 - np.concatenate(([0], np.cumsum(n)[:-1])), n)
        vals = u64[first + np.arange(len(owner), dtype=np.int64)].astype(np.uint64, copy=False)
    else:
        get = t.labels if which == "labels" else t.supervoxels
        vals = np.concatenate([get(i) for i in range(len(t))]).astype(np.uint64, copy=False)
    return vals, owner
