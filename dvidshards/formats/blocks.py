"""DVID ``/blocks`` streams: the body of ``GET …/blocks`` (and ``POST …/blocks``).

A stream is a run of records, each ``int32 bx, by, bz, nbytes`` (little endian) followed by
``nbytes`` of one block, compressed as the request's ``compression`` asked:

``blocks`` (DVID's native form)
    the DVID label block serialization (FORMATS.md §1), gzip-compressed, or lz4 (block
    format, no size prefix) when the instance stores lz4 and no mapping was applied;
``gzip`` / ``lz4`` / ``uncompressed``
    the block's 64³ uint64 label volume (z, y, x), compressed so; DVID passes an lz4-stored
    block through unchanged for ``lz4`` when it applies no mapping, so an lz4 payload may
    also hold a DVID block.

`read_stream` yields ``((bx, by, bz), block)`` with ``block`` the uncompressed DVID block,
whatever the payload held (a label volume is encoded as a block).  Every record is checked:
a short header or payload, a size no block can have, a corrupt or oversized compressed
payload or a block whose header does not fit it raise `BlockStreamError` naming the
source, the record, its byte offset and its block coordinate.  `write_stream` writes the
same format (what ``POST …/blocks`` takes).
"""

from __future__ import annotations

import io
import os
import zlib
from collections.abc import Iterable, Iterator

import numba
import numpy as np

from ..errors import BlockDecodeError, DvidShardsError
from .codec import block_header, encode_block

__all__ = ["COMPRESSIONS", "BlockStreamError", "lz4_block_decompress", "read_stream", "write_stream"]

COMPRESSIONS = ("auto", "blocks", "gzip", "lz4", "uncompressed")
_HEADER = 16
_GZIP_MAGIC = b"\x1f\x8b"


class BlockStreamError(DvidShardsError, ValueError):
    """A DVID ``/blocks`` stream is truncated or holds a record that is not a block."""


# --- lz4 block format (no frame, no size prefix: what DVID's golz4 writes) ---------------------


@numba.njit(nogil=True, cache=True)
def _lz4_length(src, ip, v):  # pragma: no cover - compiled
    """Add the 255-continued length bytes at ip to v: (length, next position), position -1 if truncated."""
    while True:
        if ip >= src.shape[0]:
            return v, np.int64(-1)
        b = np.int64(src[ip])
        ip += 1
        v += b
        if b != 255:
            return v, np.int64(ip)


@numba.njit(nogil=True, cache=True)
def _lz4_kernel(src, dst):  # pragma: no cover - compiled
    """Decode an lz4 block into dst; bytes written, or a negative error code.

    -1: input ends inside a sequence; -2: output would exceed dst; -3: bad match offset.
    """
    n, cap = src.shape[0], dst.shape[0]
    ip, op = 0, 0
    while ip < n:
        token = src[ip]
        ip += 1
        lit = np.int64(token >> 4)
        if lit == 15:
            lit, ip = _lz4_length(src, ip, lit)
            if ip < 0:
                return -1
        if lit > n - ip:
            return -1
        if lit > cap - op:
            return -2
        for k in range(lit):
            dst[op + k] = src[ip + k]
        ip += lit
        op += lit
        if ip == n:  # the last sequence holds literals only
            return op
        if n - ip < 2:
            return -1
        off = np.int64(src[ip]) | (np.int64(src[ip + 1]) << 8)
        ip += 2
        if off == 0 or off > op:
            return -3
        mlen = np.int64(token & 15)
        if mlen == 15:
            mlen, ip = _lz4_length(src, ip, mlen)
            if ip < 0:
                return -1
        mlen += 4
        if mlen > cap - op:
            return -2
        for k in range(mlen):  # byte by byte: a match may overlap its own output
            dst[op + k] = dst[op - off + k]
        op += mlen
    return -1  # empty input, or it ended right after a match


def lz4_block_decompress(data, max_bytes: int) -> bytes:
    """Decompress one lz4 *block* (no frame header), producing at most ``max_bytes`` bytes.

    Raises
    ------
    BlockDecodeError
        If the block is truncated, refers before its start, or decompresses to more than
        ``max_bytes``.
    """
    src = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data.view(np.uint8)
    dst = np.empty(int(max_bytes), np.uint8)
    n = int(_lz4_kernel(src, dst))
    if n < 0:
        why = {-1: "truncated lz4 data", -2: f"lz4 data decompresses to more than {max_bytes} bytes",
               -3: "corrupt lz4 data (a match refers before the start)"}[n]
        raise BlockDecodeError(why)
    return dst[:n].tobytes()


# --- payloads ---------------------------------------------------------------------------------


def _limits(chunk_size: int) -> tuple[int, int, int]:
    """(voxels, largest block or volume bytes, largest payload bytes) of a cubic chunk."""
    v = chunk_size ** 3
    nsub = v // 512
    biggest = max(16 + 8 * v + 2 * nsub + 4 * v + nsub * 576, 8 * v)
    return v, biggest, biggest + biggest // 255 + 1024  # lz4's and gzip's worst-case growth


def _gunzip(payload, max_bytes: int) -> bytes:
    d = zlib.decompressobj(wbits=31)
    try:
        out = d.decompress(payload, max_bytes)
    except zlib.error as e:
        raise BlockDecodeError(f"corrupt gzip data ({e})") from None
    if d.unconsumed_tail:
        raise BlockDecodeError(f"gzip data decompresses to more than {max_bytes} bytes")
    if not d.eof:
        raise BlockDecodeError("truncated gzip data")
    if d.unused_data:
        raise BlockDecodeError(f"{len(d.unused_data)} bytes follow the gzip data")
    return out


def _is_block(data, chunk_size: int) -> bool:
    if len(data) < 16:
        return False
    head = np.frombuffer(data, "<u4", 3)
    if not (head == chunk_size // 8).all():
        return False
    try:
        return block_header(data).nbytes <= len(data)
    except BlockDecodeError:
        return False


def _as_block(raw: bytes, chunk_size: int, what: str) -> bytes:
    """A DVID block from decompressed bytes: a block as is, a uint64 volume encoded."""
    voxels = chunk_size ** 3
    if _is_block(raw, chunk_size):
        return raw
    if len(raw) == 8 * voxels:
        vol = np.frombuffer(raw, "<u8").reshape((chunk_size,) * 3)
        return encode_block(vol)
    try:
        h = block_header(raw)
    except BlockDecodeError as e:
        raise BlockDecodeError(f"{what} is neither a DVID block ({e}) nor a {chunk_size}³ uint64 "
                               f"volume ({len(raw)} bytes)") from None
    raise BlockDecodeError(f"{what} is a DVID block of {h.shape[::-1]} voxels (x, y, z), not "
                           f"{(chunk_size,) * 3}")


def decode_payload(payload, compression: str = "auto", chunk_size: int = 64) -> bytes:
    """The uncompressed DVID block of one ``/blocks`` record's payload (see the module doc)."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
    _, biggest, _ = _limits(chunk_size)
    head = bytes(payload[:2])
    if compression == "gzip" or (compression in ("auto", "blocks") and head == _GZIP_MAGIC):
        return _as_block(_gunzip(payload, biggest), chunk_size, "the gunzipped payload")
    if compression == "uncompressed" or (compression in ("auto", "blocks") and _is_block(payload, chunk_size)) \
            or (compression == "auto" and len(payload) == 8 * chunk_size ** 3):
        return _as_block(bytes(payload), chunk_size, "the payload")
    return _as_block(lz4_block_decompress(payload, biggest), chunk_size, "the lz4-decompressed payload")


# --- streams ----------------------------------------------------------------------------------


def _reader(source):
    """(file-like, name, close?) of bytes, a numpy array, a path or a binary file."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return io.BytesIO(source), "<bytes>", False
    if isinstance(source, np.ndarray):
        return io.BytesIO(source.view(np.uint8).tobytes()), "<array>", False
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        return open(path, "rb"), path, True
    if hasattr(source, "read"):
        return source, getattr(source, "name", "<stream>"), False
    raise TypeError(f"read_stream takes bytes, a path or a binary file, got {type(source).__name__}")


def _read_exact(f, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        b = f.read(n - got)
        if not b:
            break
        parts.append(b)
        got += len(b)
    return b"".join(parts)


def read_stream(source, *, compression: str = "auto", chunk_size: int = 64
                ) -> Iterator[tuple[tuple[int, int, int], bytes]]:
    """Iterate the records of a DVID ``GET …/blocks`` stream.

    Parameters
    ----------
    source : bytes, bytearray, memoryview, numpy.ndarray, path or binary file
        The stream (read incrementally from a file).
    compression : {"auto", "blocks", "gzip", "lz4", "uncompressed"}
        What the payloads hold (the request's ``compression``); ``"auto"`` tells gzip, a
        DVID block and a raw volume apart by content and takes anything else as lz4.
    chunk_size : int
        Block side in voxels (64 for DVID labelmap instances).

    Yields
    ------
    ((bx, by, bz), bytes)
        The block coordinate and the uncompressed DVID block.

    Raises
    ------
    BlockStreamError
        A record is truncated, claims a size no block can have, or its payload is not a
        (compressed) block of ``chunk_size``³ voxels; the message names the record.
    """
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 8 \
            or chunk_size % 8 or chunk_size > 1024:
        raise ValueError(f"chunk_size must be a multiple of 8 in 8..1024, got {chunk_size!r}")
    _, _, max_payload = _limits(int(chunk_size))
    f, name, close = _reader(source)
    try:
        pos, k = 0, 0
        while True:
            head = _read_exact(f, _HEADER)
            if not head:
                return
            if len(head) < _HEADER:
                raise BlockStreamError(f"{name}: truncated: record {k} at byte {pos} has a {len(head)}-byte "
                                       f"header (16 expected)")
            bx, by, bz, nbytes = (int(v) for v in np.frombuffer(head, "<i4"))
            where = f"{name}: record {k} (block {(bx, by, bz)}) at byte {pos}"
            if nbytes < 0 or nbytes > max_payload:
                raise BlockStreamError(f"{where}: claims {nbytes} bytes, which no {chunk_size}³ block can be "
                                       f"(is this a /blocks stream?)")
            payload = _read_exact(f, nbytes)
            if len(payload) < nbytes:
                raise BlockStreamError(f"{where}: truncated: {len(payload)} of its {nbytes} bytes")
            try:
                block = decode_payload(payload, compression, int(chunk_size))
            except BlockDecodeError as e:
                raise BlockStreamError(f"{where}: {e}") from None
            yield (bx, by, bz), block
            pos += _HEADER + nbytes
            k += 1
    finally:
        if close:
            f.close()


def write_stream(records: Iterable, out=None, *, compression: str = "gzip") -> bytes | None:
    """Write ``((bx, by, bz), block)`` records as a ``/blocks`` stream (``POST …/blocks`` body).

    ``block`` is an uncompressed DVID block; ``compression`` is ``"gzip"`` (DVID's native
    ``blocks`` form) or ``"uncompressed"``.  Returns the bytes, or writes them to ``out``
    (a binary file) and returns None.
    """
    if compression not in ("gzip", "uncompressed"):
        raise ValueError(f"compression must be 'gzip' or 'uncompressed', got {compression!r}")
    sink = io.BytesIO() if out is None else out
    for (bx, by, bz), block in records:
        data = bytes(block)
        if compression == "gzip":
            c = zlib.compressobj(6, zlib.DEFLATED, 31)
            data = c.compress(data) + c.flush()
        sink.write(np.array([bx, by, bz, len(data)], "<i4").tobytes())
        sink.write(data)
    return sink.getvalue() if out is None else None
