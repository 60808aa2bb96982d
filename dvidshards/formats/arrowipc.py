"""Arrow IPC read without Arrow objects on the hot path.

A shard's record batches are located once (from the chunk index, a stream scan or the IPC file
footer); each record's payload, label lists and chunk coordinate are then resolved by reading the
batch's flatbuffer header with a small nogil numba kernel that checks every offset against the
bytes it was given.  pyarrow is used only to parse the schema, once per shard.
"""

from __future__ import annotations

from typing import Any

import numba as nb
import numpy as np
import pyarrow as pa
from numba.core import types as nbt

from ..errors import ShardFormatError
from . import jit

__all__ = [
    "ARROW_MAGIC",
    "REC_FIELDS",
    "SchemaLayout",
    "batch_rows",
    "file_footer_blocks",
    "header_rows",
    "is_ipc_file",
    "message_extent",
    "message_prefix",
    "raise_error",
    "resolve_rows",
    "scan_stream",
    "schema_from_message",
]

ARROW_MAGIC = b"ARROW1"
CONTINUATION = 0xFFFFFFFF
HEADER_SCHEMA = 1
HEADER_RECORD_BATCH = 3
_LIMIT = 1 << 53  # no file is this long: offsets and lengths below it cannot overflow a sum

# columns of a resolved record (resolve_rows output), offsets absolute in the buffer given
R_ROWS, R_CX, R_CY, R_CZ, R_PAY, R_PAYLEN, R_LAB, R_NLAB, R_SV, R_NSV, R_USIZE = range(11)
REC_FIELDS = 11

# kernel error codes -> message templates (detail a, b)
_ERRORS = {
    1: "Arrow message at byte {a} runs past the end of its byte range",
    2: "no Arrow message at byte {a} (metadata length {b})",
    3: "Arrow message at byte {a} has a malformed flatbuffer header",
    4: "Arrow message at byte {a} is not a record batch (header type {b})",
    5: "record batch at byte {a}: index size {b} does not end where the message ends",
    6: "record batch at byte {a} uses IPC body compression, which DVID never writes",
    7: "record batch at byte {a}: {b} field nodes/buffers, not what the schema needs",
    8: "record batch at byte {a}: buffer {b} lies outside the message body",
    9: "record batch at byte {a}: row {b} is past the batch's rows",
    10: "record batch at byte {a}: column has {b} nulls; DVID columns are non-nullable",
    11: "record batch at byte {a}: list/binary offsets of row {b} are out of range",
    12: "record batch at byte {a}: labels and supervoxels lists differ in length ({b})",
    13: "record batch at byte {a}: column length {b} differs from the batch length",
    14: "record batch at byte {a} with size {b} lies past the end of the file",
    15: "record batch at byte {a} claims {b} rows, more than its body can hold",
    16: "record batch at byte {a}: buffer {b} is not 8-byte aligned",
    17: "record batch at byte {a}: buffer {b} overlaps or precedes the buffer before it",
    18: "record batch at byte {a}: offsets of column {b} are not monotone or leave their values buffer",
}


def _raise(code: int, a: int, b: int, where: str) -> None:
    msg = _ERRORS.get(code, "Arrow IPC error {a} {b}").format(a=a, b=b)
    raise ShardFormatError(f"{where}: {msg}")


# --- little-endian readers; callers check bounds first -------------------------------------------


@nb.njit(cache=True)
def _u16(b, p):  # type: ignore[no-untyped-def]
    return np.int64(b[p]) | (np.int64(b[p + 1]) << 8)


@nb.njit(cache=True)
def _u32(b, p):  # type: ignore[no-untyped-def]
    return np.int64(b[p]) | (np.int64(b[p + 1]) << 8) | (np.int64(b[p + 2]) << 16) | (np.int64(b[p + 3]) << 24)


@nb.njit(cache=True)
def _i32(b, p):  # type: ignore[no-untyped-def]
    v = _u32(b, p)
    return v - (np.int64(1) << 32) if v >= (np.int64(1) << 31) else v


@nb.njit(cache=True)
def _i64(b, p):  # type: ignore[no-untyped-def]
    lo = np.uint64(_u32(b, p))
    hi = np.uint64(_u32(b, p + 4))
    return np.int64(lo | (hi << np.uint64(32)))


# --- flatbuffer tables ---------------------------------------------------------------------------


@nb.njit(cache=True)
def _field(b, t, k, lo, hi):  # type: ignore[no-untyped-def]
    """Position of field k of the table at t, 0 if absent, -1 if malformed."""
    if t < lo or t + 4 > hi:
        return -1
    vt = t - _i32(b, t)
    if vt < lo or vt + 4 > hi:
        return -1
    vsize = _u16(b, vt)
    if vt + vsize > hi:
        return -1
    if 4 + 2 * k + 2 > vsize:
        return 0
    fo = _u16(b, vt + 4 + 2 * k)
    if fo == 0:
        return 0
    return t + fo


@nb.njit(cache=True)
def _deref(b, p, lo, hi):  # type: ignore[no-untyped-def]
    """Follow the uoffset at p; -1 if it leaves [lo, hi)."""
    if p < lo or p + 4 > hi:
        return -1
    q = p + _u32(b, p)
    if q < lo or q >= hi:
        return -1
    return q


@nb.njit(nogil=True, cache=True)
def _message(b, off, end):  # type: ignore[no-untyped-def]
    """Decode the message envelope at off: (code, prefix+metadata length, body length, type, header table)."""
    if off < 0 or off + 8 > end:
        return 1, 0, 0, 0, 0
    first = _u32(b, off)
    if first == CONTINUATION:
        meta = _i32(b, off + 4)
        prefix = 8
    else:
        meta = _i32(b, off)
        prefix = 4
    if meta == 0:
        return 0, prefix, 0, 0, 0  # end-of-stream marker
    if meta < 0:
        return 2, meta, 0, 0, 0
    lo = off + prefix
    hi = lo + meta
    if hi > end:
        return 1, 0, 0, 0, 0
    root = _deref(b, lo, lo, hi)
    if root < 0:
        return 3, 0, 0, 0, 0
    p = _field(b, root, 1, lo, hi)
    if p < 0 or p + 1 > hi:
        return 3, 0, 0, 0, 0
    htype = np.int64(b[p]) if p > 0 else 0
    p = _field(b, root, 2, lo, hi)
    if p <= 0:
        return 3, 0, 0, 0, 0
    hdr = _deref(b, p, lo, hi)
    if hdr < 0:
        return 3, 0, 0, 0, 0
    p = _field(b, root, 3, lo, hi)
    if p < 0 or p + 8 > hi:
        return 3, 0, 0, 0, 0
    body = _i64(b, p) if p > 0 else 0
    if body < 0:
        return 3, 0, 0, 0, 0
    return 0, prefix + meta, body, htype, hdr


@nb.njit(nogil=True, cache=True)
def _scan(b, start, end, offs, lens, rows, fill):  # type: ignore[no-untyped-def]
    """Walk the messages of a stream from start; count (fill=False) or record batch extents."""
    p = start
    n = 0
    while p < end:
        code, mlen, body, htype, hdr = _message(b, p, end)
        if code != 0:
            return code, p, mlen, n
        if mlen <= 8 and body == 0 and htype == 0:
            return 0, p, 0, n  # end-of-stream
        if body > end - p - mlen:
            return 1, p, 0, n
        if htype != HEADER_RECORD_BATCH:
            return 4, p, htype, n
        if fill:
            lo = p + (8 if _u32(b, p) == CONTINUATION else 4)
            q = _field(b, hdr, 0, lo, p + mlen)
            if q < 0 or q + 8 > p + mlen:
                return 3, p, 0, n
            nrows = _i64(b, q) if q > 0 else 0
            if nrows < 0 or nrows > body // 12:  # three int32 coordinates per row at least
                return 15, p, nrows, n
            offs[n] = p
            lens[n] = mlen + body
            rows[n] = nrows
        n += 1
        p += mlen + body
    return 0, p, 0, n


@nb.njit(nogil=True, cache=True)
def _resolve(b, base, offs, lens, rows, layout, top, res):  # type: ignore[no-untyped-def]
    """Resolve row rows[i] of the batch message at offs[i] (relative to base) into res[i]."""
    checked = np.int64(-1)  # file offset of the last batch whose whole layout was validated
    for i in range(offs.shape[0]):
        off = offs[i] - base
        size = lens[i]
        if off < 0 or size < 8 or off > b.shape[0] or size > b.shape[0] - off:
            return 14, offs[i], size, i
        end = off + size
        code, mlen, body, htype, hdr = _message(b, off, end)
        if code != 0:
            return code, offs[i], mlen, i
        if htype != HEADER_RECORD_BATCH:
            return 4, offs[i], htype, i
        if body != size - mlen:
            return 5, offs[i], size, i
        lo = off + (8 if _u32(b, off) == CONTINUATION else 4)
        hi = off + mlen
        bstart = off + mlen
        p = _field(b, hdr, 0, lo, hi)
        if p < 0 or p + 8 > hi:
            return 3, offs[i], 0, i
        nrows = _i64(b, p) if p > 0 else 0
        if nrows < 0 or nrows > body // 12:
            return 15, offs[i], nrows, i
        row = rows[i]
        if row < 0 or row >= nrows:
            return 9, offs[i], row, i
        if _field(b, hdr, 3, lo, hi) != 0:
            return 6, offs[i], 0, i
        # nodes: count, nulls, top-level lengths
        p = _field(b, hdr, 1, lo, hi)
        nv = _deref(b, p, lo, hi) if p > 0 else -1
        if nv < 0 or nv + 4 > hi:
            return 7, offs[i], 0, i
        nn = _u32(b, nv)
        if nn != layout[0] or nv + 4 + 16 * nn > hi:
            return 7, offs[i], nn, i
        for k in range(nn):
            if _i64(b, nv + 4 + 16 * k + 8) != 0:
                return 10, offs[i], _i64(b, nv + 4 + 16 * k + 8), i
        for k in range(top.shape[0]):
            if _i64(b, nv + 4 + 16 * top[k]) != nrows:
                return 13, offs[i], _i64(b, nv + 4 + 16 * top[k]), i
        # buffers
        p = _field(b, hdr, 2, lo, hi)
        bv = _deref(b, p, lo, hi) if p > 0 else -1
        if bv < 0 or bv + 4 > hi:
            return 7, offs[i], 0, i
        nb_ = _u32(b, bv)
        if nb_ != layout[1] or bv + 4 + 16 * nb_ > hi:
            return 7, offs[i], nb_, i
        prev = np.int64(0)
        for k in range(nb_):
            bo = _i64(b, bv + 4 + 16 * k)
            bl = _i64(b, bv + 4 + 16 * k + 8)
            if bo < 0 or bl < 0 or bo > body or bl > body - bo:
                return 8, offs[i], k, i
            if bo % 8 != 0:
                return 16, offs[i], k, i
            if bo < prev:
                return 17, offs[i], k, i
            prev = bo + bl
        if offs[i] != checked:  # every row's offsets, once per batch
            for c in range(3):
                ob = layout[6 + 3 * c]
                ow = layout[7 + 3 * c]
                vb = layout[8 + 3 * c]
                vw = 1 if c == 2 else 8
                bo = _i64(b, bv + 4 + 16 * ob)
                bl = _i64(b, bv + 4 + 16 * ob + 8)
                vl = _i64(b, bv + 4 + 16 * vb + 8)
                if nrows >= bl // ow:
                    return 18, offs[i], c, i
                q = bstart + bo
                last = _i32(b, q) if ow == 4 else _i64(b, q)
                if last < 0:
                    return 18, offs[i], c, i
                for r in range(1, nrows + 1):
                    v = _i32(b, q + r * ow) if ow == 4 else _i64(b, q + r * ow)
                    if v < last:
                        return 18, offs[i], c, i
                    last = v
                if last > vl // vw:
                    return 18, offs[i], c, i
            checked = offs[i]
        # coordinates
        cw = layout[2]
        for a in range(3):
            k = layout[3 + a]
            bo = _i64(b, bv + 4 + 16 * k)
            bl = _i64(b, bv + 4 + 16 * k + 8)
            if (row + 1) * cw > bl:
                return 8, offs[i], k, i
            q = bstart + bo + row * cw
            res[i, R_CX + a] = _i32(b, q) if cw == 4 else _i64(b, q)
        res[i, R_ROWS] = nrows
        # list and binary columns: (offsets buffer, offset width, values buffer, value width)
        for c in range(3):
            ob = layout[6 + 3 * c]
            ow = layout[7 + 3 * c]
            vb = layout[8 + 3 * c]
            vw = 1 if c == 2 else 8
            bo = _i64(b, bv + 4 + 16 * ob)
            bl = _i64(b, bv + 4 + 16 * ob + 8)
            if (row + 2) * ow > bl:
                return 11, offs[i], row, i
            q = bstart + bo + row * ow
            o0 = _i32(b, q) if ow == 4 else _i64(b, q)
            o1 = _i32(b, q + ow) if ow == 4 else _i64(b, q + ow)
            vo = _i64(b, bv + 4 + 16 * vb)
            vl = _i64(b, bv + 4 + 16 * vb + 8)
            if o0 < 0 or o1 < o0 or o1 > vl // vw:
                return 11, offs[i], row, i
            dst = R_PAY if c == 2 else R_LAB + 2 * c
            res[i, dst] = bstart + vo + o0 * vw + base
            res[i, dst + 1] = o1 - o0
        if res[i, R_NLAB] != res[i, R_NSV]:
            return 12, offs[i], res[i, R_NLAB] - res[i, R_NSV], i
        ub = layout[15]
        if ub >= 0:
            bo = _i64(b, bv + 4 + 16 * ub)
            bl = _i64(b, bv + 4 + 16 * ub + 8)
            uw = layout[16]
            if (row + 1) * uw > bl:
                return 8, offs[i], ub, i
            q = bstart + bo + row * uw
            res[i, R_USIZE] = _u32(b, q) if uw == 4 else _i64(b, q)
        else:
            res[i, R_USIZE] = -1
    return 0, 0, 0, offs.shape[0]


@nb.njit(nogil=True, cache=True)
def _footer(b, end, offs, lens, fill):  # type: ignore[no-untyped-def]
    """Record-batch blocks of the IPC file footer ending at end (just past the closing magic)."""
    if end < 16:
        return 1, 0, 0
    flen = _i32(b, end - 10)
    lo = end - 10 - flen
    hi = end - 10
    if flen <= 0 or lo < 8:
        return 2, flen, 0
    root = _deref(b, lo, lo, hi)
    if root < 0:
        return 3, 0, 0
    p = _field(b, root, 3, lo, hi)
    if p < 0:
        return 3, 0, 0
    if p == 0:
        return 0, 0, lo
    v = _deref(b, p, lo, hi)
    if v < 0 or v + 4 > hi:
        return 3, 0, 0
    n = _u32(b, v)
    if v + 4 + 24 * n > hi:
        return 3, n, 0
    if fill:
        for k in range(n):
            q = v + 4 + 24 * k
            o, meta, body = _i64(b, q), _i32(b, q + 8), _i64(b, q + 16)
            if o < 0 or meta < 0 or body < 0 or o >= _LIMIT or body >= _LIMIT:
                return 3, n, 0
            offs[k] = o
            lens[k] = meta + body
    return 0, n, lo


# --- compiled, or interpreted until compiled (formats.jit) -------------------------------------------
# The fallbacks are the kernels' own source run by Python, with the byte readers replaced by
# int.from_bytes (same values, 20x faster than numpy scalars): ~0.2 ms per record, so a
# 258-record shard resolves in ~50 ms while numba compiles these kernels (~6 s) in the background.


def _py_u16(b: Any, p: Any) -> Any:
    return int.from_bytes(b[p:p + 2], "little")


def _py_u32(b: Any, p: Any) -> Any:
    return int.from_bytes(b[p:p + 4], "little")


def _py_i32(b: Any, p: Any) -> Any:
    return int.from_bytes(b[p:p + 4], "little", signed=True)


def _py_i64(b: Any, p: Any) -> Any:
    return int.from_bytes(b[p:p + 8], "little", signed=True)


_twin = jit.python_twins(globals(), {"_u16": _py_u16, "_u32": _py_u32, "_i32": _py_i32, "_i64": _py_i64})
_B = nbt.Array(nbt.uint8, 1, "C", readonly=True)
_I = nbt.int64
_IN = nbt.Array(nbt.int64, 1, "C", readonly=True)
_OUT = nbt.Array(nbt.int64, 1, "C")
# above this many records (or bytes of stream to scan) the interpreted twin would take longer
# than compiling (~0.3 ms per record vs ~5 s): the caller compiles and waits
_WAIT_RECORDS = 4096
_WAIT_SCAN_BYTES = 16 << 20
_k_message = jit.kernel(_message, [(_B, _I, _I)], _twin._message, exclusive=True)
_k_field = jit.kernel(_field, [(_B, _I, _I, _I, _I)], _twin._field, exclusive=True)
_k_scan = jit.kernel(_scan, [(_B, _I, _I, _OUT, _OUT, _OUT, nbt.boolean)], _twin._scan, exclusive=True)
_k_footer = jit.kernel(_footer, [(_B, _I, _OUT, _OUT, nbt.boolean)], _twin._footer, exclusive=True)
_k_resolve = jit.kernel(_resolve, [(_B, _I, _IN, _IN, _IN, _IN, _IN, nbt.Array(nbt.int64, 2, "C"))],
                        _twin._resolve, exclusive=True)


# --- Python-level API ----------------------------------------------------------------------------


def _u8(data: Any) -> np.ndarray:
    return data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)


def raise_error(code: int, a: int, b: int, where: str) -> None:
    """Raise the ShardFormatError of a kernel error code (used by range-reading loaders)."""
    _raise(code, a, b, where)


def message_prefix(head: Any, off: int, where: str) -> tuple[int, int]:
    """(prefix length, metadata length) of the IPC message starting at ``head[off:off + 8]``."""
    head = bytes(head[off:off + 8])
    if len(head) < 8:
        raise ShardFormatError(f"{where}: the file ends inside the Arrow message at byte {off}")
    first = int.from_bytes(head[:4], "little")
    if first == CONTINUATION:
        return 8, int.from_bytes(head[4:8], "little", signed=True)
    return 4, int.from_bytes(head[:4], "little", signed=True)


def header_rows(data: Any, off: int, end: int) -> tuple[int, int, int, int, int]:
    """(code, message length incl. prefix, body length, header type, rows) from a message header.

    ``data[off:end]`` must hold the message's prefix and metadata (its body is not needed).
    A non-zero code is a kernel error code for ``raise_error``.
    """
    b = _u8(data)
    code, mlen, body, htype, hdr = (int(v) for v in _k_message(b, off, end))
    if code != 0:
        return code, mlen, 0, 0, 0
    if htype != HEADER_RECORD_BATCH:
        return 4, htype, 0, htype, 0
    lo = off + (8 if int.from_bytes(bytes(b[off:off + 4]), "little") == CONTINUATION else 4)
    q = int(_k_field(b, hdr, 0, lo, off + mlen))
    if q < 0 or q + 8 > off + mlen:
        return 3, 0, 0, htype, 0
    rows = int.from_bytes(bytes(b[q:q + 8]), "little", signed=True) if q > 0 else 0
    if rows < 0 or rows > body // 12:
        return 15, rows, 0, htype, 0
    return 0, mlen, body, htype, rows


def is_ipc_file(head: bytes) -> bool:
    """True when the bytes start with the Arrow IPC *file* magic (otherwise: a stream)."""
    return bytes(head[:6]) == ARROW_MAGIC


def message_extent(data: Any, off: int, where: str) -> tuple[int, int, int]:
    """(metadata length incl. prefix, body length, header type) of the message at off."""
    b = _u8(data)
    code, mlen, body, htype, _ = _k_message(b, off, b.shape[0])
    if code:
        _raise(code, off, mlen, where)
    return mlen, body, htype


def schema_from_message(data: Any, off: int, where: str) -> tuple[pa.Schema, int]:
    """The schema message at off and its byte length (prefix, flatbuffer and padding)."""
    mlen, body, htype = message_extent(data, off, where)
    if htype != HEADER_SCHEMA or body != 0:
        raise ShardFormatError(f"{where}: no Arrow schema message at byte {off}")
    try:
        msg = pa.ipc.read_message(pa.py_buffer(bytes(_u8(data)[off : off + mlen])))
        schema = pa.ipc.read_schema(msg)
        for f in schema:  # names and metadata decode lazily: make damage show here
            _ = f.name, f.type, f.metadata
        return schema, mlen
    except (pa.ArrowException, OSError, UnicodeDecodeError, ValueError) as e:
        raise ShardFormatError(f"{where}: unreadable Arrow schema: {e}") from None


def scan_stream(data: Any, start: int, end: int, where: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Offsets, lengths and row counts of every record batch message of a stream in [start, end)."""
    b = _u8(data)
    empty = np.zeros(0, np.int64)
    if end - start > _WAIT_SCAN_BYTES:
        _k_scan.ensure()
    code, a, c, n = _k_scan(b, start, end, empty, empty, empty, False)
    if code:
        _raise(code, a, c, where)
    offs, lens, rows = (np.empty(n, np.int64) for _ in range(3))
    code, a, c, _ = _k_scan(b, start, end, offs, lens, rows, True)
    if code:
        _raise(code, a, c, where)
    return offs, lens, rows


def file_footer_blocks(data: Any, end: int, where: str) -> tuple[np.ndarray, np.ndarray]:
    """Offsets and message lengths of the record batches listed in an IPC file footer."""
    b = _u8(data)
    if end < 16 or bytes(b[end - 6 : end]) != ARROW_MAGIC:
        raise ShardFormatError(f"{where}: Arrow IPC file does not end with the ARROW1 magic")
    empty = np.zeros(0, np.int64)
    code, n, _ = _k_footer(b, end, empty, empty, False)
    if code:
        raise ShardFormatError(f"{where}: malformed Arrow IPC file footer")
    offs, lens = np.empty(n, np.int64), np.empty(n, np.int64)
    _k_footer(b, end, offs, lens, True)
    return offs, lens


def batch_rows(data: Any, offs: np.ndarray, lens: np.ndarray, layout: SchemaLayout, where: str) -> np.ndarray:
    """Row count of each record batch message (row 0 is resolved, which also validates it)."""
    res = resolve_rows(data, 0, offs, lens, np.zeros(len(offs), np.int64), layout, where)
    return np.asarray(res[:, R_ROWS].copy())


def resolve_rows(data: Any, base: int, offs: Any, lens: Any, rows: Any, layout: SchemaLayout, where: str, chunks: Any = None) -> np.ndarray:
    """Resolve records to absolute byte locations (an (n, REC_FIELDS) int64 array).

    ``data`` holds the bytes from file offset ``base``; ``offs``/``lens`` are the batch
    messages' file offsets and lengths, ``rows`` the row inside each batch.
    """
    b = _u8(data)
    offs = np.ascontiguousarray(offs, np.int64)
    res = np.empty((len(offs), REC_FIELDS), np.int64)
    if len(offs) > _WAIT_RECORDS:
        _k_resolve.ensure()
    code, a, c, i = _k_resolve(b, base, offs, np.ascontiguousarray(lens, np.int64),
                             np.ascontiguousarray(rows, np.int64), layout.array, layout.top, res)
    if code:
        chunk = f" (chunk {tuple(int(v) for v in chunks[i])})" if chunks is not None and i < len(chunks) else ""
        _raise(code, a, c, where + chunk)
    return res


class SchemaLayout:
    """Where each DVID column's buffers sit in a record batch of this schema."""

    REQUIRED = ("chunk_x", "chunk_y", "chunk_z", "labels", "supervoxels", "dvid_compressed_block")

    def __init__(self, schema: pa.Schema, where: str) -> None:
        names = schema.names
        unknown = [n for n in names if n not in self.REQUIRED and n != "uncompressed_size"]
        missing = [n for n in self.REQUIRED if n not in names]
        if missing or unknown or len(set(names)) != len(names):
            what = f"missing {missing}" if missing else f"unexpected columns {unknown or names}"
            raise ShardFormatError(f"{where}: schema is not a DVID export schema ({what})")
        node = buf = 0
        where_col: dict[str, tuple[int, int, pa.DataType]] = {}
        top = []
        for f in schema:
            top.append(node)
            where_col[f.name] = (node, buf, f.type)
            n, k = _counts(f.type)
            if n is None:
                raise ShardFormatError(f"{where}: column {f.name!r} has unsupported type {f.type}")
            node += n
            buf += k

        def col(name: str, ok: Any, what: str) -> Any:
            t = where_col[name][2]
            if not ok(t):
                raise ShardFormatError(f"{where}: column {name!r} has type {t}, expected {what}")
            return where_col[name][1]

        ints = (pa.int32(), pa.int64())
        cw = {str(schema.field(n).type) for n in ("chunk_x", "chunk_y", "chunk_z")}
        if len(cw) != 1:
            raise ShardFormatError(f"{where}: chunk_x/y/z have different types {sorted(cw)}")
        coords = [col(n, lambda t: t in ints, "int32") + 1 for n in ("chunk_x", "chunk_y", "chunk_z")]
        lists = []
        for name in ("labels", "supervoxels"):
            b0 = col(name, lambda t: (pa.types.is_list(t) or pa.types.is_large_list(t))
                     and t.value_type == pa.uint64(), "list<uint64>")
            lists += [b0 + 1, 8 if pa.types.is_large_list(where_col[name][2]) else 4, b0 + 3]
        bb = col("dvid_compressed_block", lambda t: t in (pa.binary(), pa.large_binary()), "binary")
        lists += [bb + 1, 8 if where_col["dvid_compressed_block"][2] == pa.large_binary() else 4, bb + 2]
        if "uncompressed_size" in where_col:
            ub = col("uncompressed_size", lambda t: t in (pa.uint32(), pa.int32(), pa.uint64(), pa.int64()),
                     "uint32") + 1
            uw = where_col["uncompressed_size"][2].bit_width // 8
        else:
            ub, uw = -1, 0
        cwidth = schema.field("chunk_x").type.bit_width // 8
        self.schema = schema
        self.array = np.array([node, buf, cwidth, *coords, *lists, ub, uw], np.int64)
        self.top = np.array(top, np.int64)


def _counts(t: pa.DataType) -> tuple[int | None, int]:
    """(field nodes, buffers) an Arrow type occupies in a record batch."""
    if pa.types.is_integer(t):
        return 1, 2
    if t in (pa.binary(), pa.large_binary()):
        return 1, 3
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        n, k = _counts(t.value_type)
        return (None, 0) if n is None else (1 + n, 2 + k)
    return None, 0
