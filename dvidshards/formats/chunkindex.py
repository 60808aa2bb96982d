"""Chunk indexes: every variant DVID has written (FORMATS.md §3: CSV ``x,y,z,offset,size,batch_idx``
(A), ``x,y,z,rec,offset,size`` (B), ``x,y,z,rec`` (C), the ``CHUNKIDX`` JSON footer (D)) as one
`ShardIndex`: chunk coordinates, their record batch message's byte range and row."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from ..errors import ChunkIndexError

__all__ = ["FOOTER_MAGIC", "MAX_BYTE_OFFSET", "RawIndex", "ShardIndex", "check_coords", "footer_length", "pack_key", "pack_keys",
           "parse_csv", "parse_footer"]

FOOTER_MAGIC = b"CHUNKIDX"
_VARIANTS = {
    ("x", "y", "z", "offset", "size", "batch_idx"): "A",
    ("x", "y", "z", "rec", "offset", "size"): "B",
    ("x", "y", "z", "rec"): "C",
}
KEY_BITS = 21
KEY_LIMIT = 1 << KEY_BITS
# no file is 2**53 bytes: offsets, sizes and rows below it cannot wrap int64 when two are summed
MAX_BYTE_OFFSET = 1 << 53


def pack_keys(coords: np.ndarray) -> np.ndarray:
    """One int64 key per (x, y, z) chunk coordinate (21 bits per axis)."""
    c = np.asarray(coords, np.int64)
    return (c[..., 0] << (2 * KEY_BITS)) | (c[..., 1] << KEY_BITS) | c[..., 2]


def pack_key(x: int, y: int, z: int) -> int:
    return (x << (2 * KEY_BITS)) | (y << KEY_BITS) | z


@dataclass(frozen=True)
class RawIndex:
    """An index as read from its file, before record batches are located."""

    variant: str
    coords: np.ndarray  # (n, 3) int64 chunk coordinates
    rec: np.ndarray | None = None  # row across the whole file (B, C, D)
    offset: np.ndarray | None = None  # record batch message offset (A, B)
    size: np.ndarray | None = None  # record batch message length (A, B)
    batch_idx: np.ndarray | None = None  # row inside the batch (A)
    schema_size: int | None = None


@dataclass(frozen=True)
class ShardIndex:
    """One shard's chunks in normalised form (one row per chunk)."""

    variant: str
    coords: np.ndarray  # (n, 3) int64
    msg_off: np.ndarray  # int64 file offset of the record batch message
    msg_len: np.ndarray  # int64 its length
    row: np.ndarray  # int64 row inside that batch

    def __len__(self) -> int:
        return len(self.coords)

    @classmethod
    def from_raw(cls, raw: RawIndex, where: str, batches: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
                 ) -> ShardIndex:
        """Locate every chunk's record batch (``batches``: offsets, lengths, rows; needed for C and D)."""
        if raw.variant in ("A", "B"):
            assert raw.offset is not None and raw.size is not None
            row = raw.batch_idx if raw.batch_idx is not None else np.zeros(len(raw.coords), np.int64)
            return cls(raw.variant, raw.coords, raw.offset, raw.size, row)
        if batches is None or raw.rec is None:
            raise ChunkIndexError(f"{where}: a variant {raw.variant} index needs the file's record batches")
        offs, lens, rows = batches
        starts = np.concatenate([[0], np.cumsum(rows)])
        bad = np.flatnonzero(raw.rec >= starts[-1])
        if bad.size:
            i = bad[0]
            raise ChunkIndexError(f"{where}: chunk {_c(raw.coords[i])} points at record {raw.rec[i]}, "
                                  f"but the file holds {starts[-1]} records")
        b = np.searchsorted(starts, raw.rec, side="right") - 1
        return cls(raw.variant, raw.coords, offs[b], lens[b], raw.rec - starts[b])


def _c(c: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in c)


def check_coords(coords: np.ndarray, where: str) -> None:
    if coords.size and (coords.min() < 0 or coords.max() >= KEY_LIMIT):
        i = int(np.flatnonzero(((coords < 0) | (coords >= KEY_LIMIT)).any(axis=1))[0])
        raise ChunkIndexError(f"{where}: chunk coordinate {_c(coords[i])} out of range")
    keys = pack_keys(coords)
    uniq, first, counts = np.unique(keys, return_index=True, return_counts=True)
    if uniq.size != keys.size:
        i = first[np.flatnonzero(counts > 1)[0]]
        raise ChunkIndexError(f"{where}: chunk {_c(coords[i])} is listed more than once")


def _int64s(col: pa.ChunkedArray) -> np.ndarray:
    """An int64 column's data buffer (pyarrow's to_numpy imports pandas: ~250 ms)."""
    a = col.combine_chunks()
    return np.frombuffer(a.buffers()[1], np.int64, count=len(a), offset=8 * a.offset)


def parse_csv(text: bytes, where: str) -> RawIndex:
    """A CSV chunk index of variant A, B or C (told by its header)."""
    schema_size = None
    body = bytes(text)
    if body.startswith(b"#"):
        first, _, body = body.partition(b"\n")
        key, _, value = first[1:].strip().partition(b"=")
        if key.strip() != b"schema_size" or not value.strip().isdigit():
            raise ChunkIndexError(f"{where}: unrecognised first line {first[:60]!r}")
        schema_size = int(value)
    header, _, rows = body.partition(b"\n")
    cols = tuple(c.strip() for c in header.decode("ascii", "replace").strip().split(","))
    variant = _VARIANTS.get(cols)
    if variant is None:
        raise ChunkIndexError(f"{where}: unknown chunk index columns {','.join(cols)!r}")
    if variant in "AB" and schema_size is None:
        raise ChunkIndexError(f"{where}: variant {variant} index lacks its '# schema_size=' line")
    try:
        table = pacsv.read_csv(
            pa.py_buffer(rows),
            read_options=pacsv.ReadOptions(column_names=list(cols), use_threads=False),
            convert_options=pacsv.ConvertOptions(column_types={c: pa.int64() for c in cols}),
        ) if rows.strip() else None
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise ChunkIndexError(f"{where}: malformed chunk index row: {str(e).splitlines()[0]}") from None
    if table is None:
        arrays = {c: np.zeros(0, np.int64) for c in cols}
    else:
        if any(table.column(c).null_count for c in cols):
            raise ChunkIndexError(f"{where}: chunk index has empty fields")
        arrays = {c: _int64s(table.column(c)) for c in cols}
    coords = np.stack([arrays["x"], arrays["y"], arrays["z"]], axis=1).astype(np.int64, copy=False)
    check_coords(coords, where)
    for c in cols[3:]:
        bad = np.flatnonzero((arrays[c] < 0) | (arrays[c] >= MAX_BYTE_OFFSET))
        if bad.size:
            v = int(arrays[c][bad[0]])
            raise ChunkIndexError(f"{where}: chunk {_c(coords[bad[0]])} has {c}={v}, "
                                  f"{'negative' if v < 0 else 'beyond any file size'}")
    return RawIndex(variant, coords, rec=arrays.get("rec"), offset=arrays.get("offset"),
                    size=arrays.get("size"), batch_idx=arrays.get("batch_idx"), schema_size=schema_size)


def footer_length(tail: bytes, file_size: int, where: str) -> int | None:
    """Length of a CHUNKIDX footer's JSON from the file's last 16 bytes (None: no footer)."""
    if len(tail) < 16 or tail[-8:] != FOOTER_MAGIC:
        return None
    (n,) = struct.unpack("<Q", tail[-16:-8])
    if n < 2 or n > file_size - 16:
        raise ChunkIndexError(f"{where}: CHUNKIDX footer claims {n} bytes of JSON in a {file_size}-byte file")
    return int(n)


def parse_footer(blob: bytes, chunk_size: tuple[int, int, int], where: str) -> RawIndex:
    """A CHUNKIDX footer's JSON (variant D: keys ``"x_y_z"`` in voxels)."""
    try:
        obj = json.loads(blob)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise ChunkIndexError(f"{where}: CHUNKIDX footer is not JSON ({str(e)[:80]})") from None
    if not isinstance(obj, dict):
        raise ChunkIndexError(f"{where}: CHUNKIDX footer is not a JSON object")
    n = len(obj)
    coords = np.empty((n, 3), np.int64)
    rec = np.empty(n, np.int64)
    cs = np.asarray(chunk_size, np.int64)
    for i, (k, v) in enumerate(obj.items()):
        parts = k.split("_")
        # ASCII digits only: str.isdigit() also accepts '²', on which int() fails
        if (len(parts) != 3 or not all(p.isascii() and p.isdigit() for p in parts) or type(v) is not int or v < 0
                or v >= MAX_BYTE_OFFSET):
            raise ChunkIndexError(f"{where}: bad CHUNKIDX entry {k!r}: {v!r}")
        ints = [int(p) for p in parts]
        if max(ints) >= MAX_BYTE_OFFSET:
            raise ChunkIndexError(f"{where}: CHUNKIDX key {k!r} is out of range")
        vox = np.array(ints, np.int64)
        if (vox % cs).any():
            raise ChunkIndexError(f"{where}: CHUNKIDX key {k!r} is not a chunk origin (chunk size {tuple(cs)})")
        coords[i] = vox // cs
        rec[i] = v
    check_coords(coords, where)
    return RawIndex("D", coords, rec=rec)
