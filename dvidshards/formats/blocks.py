"""DVID ``/blocks`` streams: the body of ``GET …/blocks`` (and ``POST …/blocks``).

Records of ``int32 bx, by, bz, nbytes`` (little endian) and ``nbytes`` of one block, as the
request's ``compression`` asked: ``blocks`` (DVID's native form) is the label block (FORMATS.md
§1) gzipped, or lz4 (block format, no size prefix) when stored so and no mapping applied;
``gzip``, ``lz4``, ``uncompressed`` are the 64³ uint64 (z, y, x) volume so compressed (an lz4
payload may also hold a block DVID passed through). `read_stream` yields uncompressed DVID
blocks whatever the payload held; a record that is short, of a size no block has, corrupt,
oversized or not fitting its header is a `BlockStreamError` naming source, record, offset and
block coordinate.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from io import BytesIO
from typing import Any, BinaryIO

import numpy as np

from ..errors import BlockDecodeError, DvidShardsError
from .blocklayout import BytesLike
from .codec import block_header, encode_block

__all__ = ["COMPRESSIONS", "BlockStreamError", "decode_payload", "lz4_block_compress", "lz4_block_decompress",
           "read_stream"]

COMPRESSIONS = ("auto", "blocks", "gzip", "lz4", "uncompressed")
_HEADER = 16
_GZIP_MAGIC = b"\x1f\x8b"


class BlockStreamError(DvidShardsError, ValueError):
    """A DVID ``/blocks`` stream is truncated or holds a record that is not a block."""


# lz4 block format: no frame, no size prefix (what DVID's golz4 writes)


def _lz4() -> Any:
    try:
        import lz4.block
    except ImportError:
        raise BlockDecodeError("lz4 data needs the optional package lz4: pip install 'dvidshards[serve]'") from None
    return lz4.block


def lz4_block_decompress(data: BytesLike, max_bytes: int) -> bytes:
    """One lz4 block (no frame) decompressed to at most ``max_bytes``; BlockDecodeError when it is
    truncated, corrupt or larger (lz4 does not say which), or the lz4 package is missing."""
    block = _lz4()
    try:
        return bytes(block.decompress(data, uncompressed_size=int(max_bytes)))
    except block.LZ4BlockError as e:
        raise BlockDecodeError(f"lz4 data is truncated, corrupt or larger than {max_bytes} bytes ({e})") from None


def lz4_block_compress(data: BytesLike) -> bytes:
    """One lz4 block (no frame, no size prefix) of ``data``: DVID's lz4 form."""
    return bytes(_lz4().compress(data, store_size=False))


def _limits(chunk_size: int) -> tuple[int, int, int]:
    """(voxels, largest block or volume bytes, largest payload bytes) of a cubic chunk."""
    v = chunk_size ** 3
    nsub = v // 512
    biggest = max(16 + 8 * v + 2 * nsub + 4 * v + nsub * 576, 8 * v)
    return v, biggest, biggest + biggest // 255 + 1024  # lz4's and gzip's worst-case growth


def _gunzip(payload: BytesLike, max_bytes: int) -> bytes:
    d = zlib.decompressobj(wbits=31)
    try:
        out = d.decompress(payload, max_bytes)  # type: ignore[arg-type]
    except zlib.error as e:
        raise BlockDecodeError(f"corrupt gzip data ({e})") from None
    if d.unconsumed_tail:
        raise BlockDecodeError(f"gzip data decompresses to more than {max_bytes} bytes")
    if not d.eof:
        raise BlockDecodeError("truncated gzip data")
    if d.unused_data:
        raise BlockDecodeError(f"{len(d.unused_data)} bytes follow the gzip data")
    return out


def _is_block(data: BytesLike, chunk_size: int) -> bool:
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


def decode_payload(payload: BytesLike, compression: str = "auto", chunk_size: int = 64) -> bytes:
    """The uncompressed DVID block of one ``/blocks`` record's payload."""
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


def _reader(source: BytesLike | BinaryIO) -> tuple[BinaryIO, str]:
    if isinstance(source, (bytes, bytearray, memoryview)):
        return BytesIO(source), "<bytes>"
    if isinstance(source, np.ndarray):
        return BytesIO(source.view(np.uint8).tobytes()), "<array>"
    if hasattr(source, "read"):
        return source, str(getattr(source, "name", "<stream>"))
    hint = " (open a path with open(path, 'rb'))" if isinstance(source, str) or hasattr(source, "__fspath__") else ""
    raise TypeError(f"read_stream takes bytes or a binary file, got {type(source).__name__}{hint}")


def _read_exact(f: BinaryIO, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        b = f.read(n - got)
        if not b:
            break
        parts.append(b)
        got += len(b)
    return b"".join(parts)


def read_stream(source: BytesLike | BinaryIO, *, compression: str = "auto", chunk_size: int = 64
                ) -> Iterator[tuple[tuple[int, int, int], bytes]]:
    """``((bx, by, bz), block)`` of each record of a ``GET …/blocks`` stream, the block uncompressed.

    ``source``: bytes-like, uint8 array or binary file (read incrementally; the caller closes it).
    ``compression``: what the payloads hold (``"auto"`` tells gzip, a DVID block and a raw volume
    apart by content and takes anything else as lz4). ``chunk_size``: block side (64).
    BlockStreamError, naming the record, for one that is not a (compressed) block of that size.
    """
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 8 \
            or chunk_size % 8 or chunk_size > 1024:
        raise ValueError(f"chunk_size must be a multiple of 8 in 8..1024, got {chunk_size!r}")
    _, _, max_payload = _limits(int(chunk_size))
    f, name = _reader(source)
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


