"""DVID's label block layout (FORMATS.md §1), shared by every kernel that walks a block.

``u32 gx, gy, gz, N``, ``u64 labels[N]`` and, when N > 1, ``u16 nsb[gx*gy*gz]``, ``u32
sbidx[sum(nsb)]`` and per sub-block with nsb > 1 512 MSB-first values of ``ceil(log2(nsb))``
bits (64 bytes per bit of width). One vocabulary for the decoder, the transcoder, statistics,
the downsampler and sparse volumes: sizes, byte readers, the validation walk (`check_head`,
`check_body` and their numpy twins), its error codes and messages (`block_error`). numba does
not bounds-check: nothing reads past what the walk approved.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numba
import numpy as np

from ..errors import BlockDecodeError

BytesLike = bytes | bytearray | memoryview | np.ndarray  # what a block or payload may come as

__all__ = [
    "BITS", "BytesLike", "E_GRID", "E_IDX_RANGE", "E_IDX_TRUNC", "E_LABELS_TRUNC", "E_NLABELS", "E_NSB_BIG", "E_NSB_TRUNC", "E_OK",
    "E_OUT_SHAPE", "E_PALETTE", "E_SHORT", "E_VAL_RANGE", "E_VAL_TRUNC", "MAX_GRID", "MAX_SUBBLOCK_LABELS",
    "NO_PALETTE", "as_palette", "as_u8", "assemble_block", "block_error", "body_numpy", "check_body", "check_head", "head_numpy", "read_u16",
    "read_u32", "read_u64", "row_word", "values_numpy", "write_le",
]

MAX_GRID = 128  # sub-blocks per axis: DVID's MaxBlockSize 1024 / 8
MAX_SUBBLOCK_LABELS = 512  # 8*8*8 voxels, hence at most 9-bit values

# bits per value for a sub-block using n labels: 0 for n <= 1, else ceil(log2(n))
BITS = np.array(
    [0, 0] + [(n - 1).bit_length() for n in range(2, MAX_SUBBLOCK_LABELS + 1)], dtype=np.int64
)

# kernel error codes (first item of the kernel's return tuple)
E_OK = 0
E_SHORT = 1  # a: len
E_GRID = 2
E_NLABELS = 3
E_LABELS_TRUNC = 4  # a: N, b: len
E_PALETTE = 5  # a: palette length, b: N
E_OUT_SHAPE = 6
E_NSB_TRUNC = 7  # a: bytes needed, b: len
E_NSB_BIG = 8  # a: sub-block, b: nsb
E_IDX_TRUNC = 9  # a: bytes needed, b: len
E_IDX_RANGE = 10  # a: position in sbidx, b: value
E_VAL_TRUNC = 11  # a: bytes needed, b: len
E_VAL_RANGE = 12  # a: sub-block, b: value

NO_PALETTE = np.zeros(0, dtype=np.uint64)  # use_palette=False


@numba.njit(nogil=True, cache=True, inline="always")
def read_u16(d, p):  # type: ignore[no-untyped-def]
    return np.int64(d[p]) | (np.int64(d[p + 1]) << 8)


@numba.njit(nogil=True, cache=True, inline="always")
def read_u32(d, p):  # type: ignore[no-untyped-def]
    return (
        np.int64(d[p])
        | (np.int64(d[p + 1]) << 8)
        | (np.int64(d[p + 2]) << 16)
        | (np.int64(d[p + 3]) << 24)
    )


@numba.njit(nogil=True, cache=True, inline="always")
def read_u64(d, p):  # type: ignore[no-untyped-def]
    v = np.uint64(0)
    for i in range(7, -1, -1):
        v = (v << np.uint64(8)) | np.uint64(d[p + i])
    return v


@numba.njit(nogil=True, cache=True, inline="always")
def row_word(data, r, b):  # type: ignore[no-untyped-def]
    # big-endian word of a row of 8 values (b <= 8: b bytes); for b == 9 the first 8 bytes
    w = np.int64(0)
    for i in range(min(b, 8)):
        w = (w << 8) | np.int64(data[r + i])
    return w


@numba.njit(nogil=True, cache=True, inline="always")
def write_le(buf, p, v, nbytes):  # type: ignore[no-untyped-def]
    for i in range(nbytes):
        buf[p + i] = np.uint8((v >> (8 * i)) & 255)


@numba.njit(nogil=True, cache=True)
def assemble_block(gx, gy, gz, labels, nlab, nsb, nsub, sbidx, nidx, values, nval):  # type: ignore[no-untyped-def]
    """A block's bytes from its parts (a solid block is its header and one label)."""
    total = 24 if nlab == 1 else 16 + 8 * nlab + 2 * nsub + 4 * nidx + nval
    buf = np.empty(total, dtype=np.uint8)
    write_le(buf, 0, gx, 4)
    write_le(buf, 4, gy, 4)
    write_le(buf, 8, gz, 4)
    write_le(buf, 12, nlab, 4)
    p = 16
    for j in range(nlab):
        v = labels[j]
        for i in range(8):
            buf[p + i] = np.uint8((v >> np.uint64(8 * i)) & np.uint64(255))
        p += 8
    if nlab > 1:
        for j in range(nsub):
            write_le(buf, p, nsb[j], 2)
            p += 2
        for j in range(nidx):
            write_le(buf, p, sbidx[j], 4)
            p += 4
        buf[p:p + nval] = values[:nval]
    return buf


@numba.njit(nogil=True, cache=True)
def check_head(data):  # type: ignore[no-untyped-def]
    """Check a block's header and label list size: (code, a, b, gx, gy, gz, N)."""
    n = np.int64(data.shape[0])
    zero = np.int64(0)
    if n < 16:
        return E_SHORT, n, zero, zero, zero, zero, zero
    gx = read_u32(data, 0)
    gy = read_u32(data, 4)
    gz = read_u32(data, 8)
    if gx < 1 or gx > MAX_GRID or gy < 1 or gy > MAX_GRID or gz < 1 or gz > MAX_GRID:
        return E_GRID, zero, zero, zero, zero, zero, zero
    nlab = read_u32(data, 12)
    if nlab < 1:
        return E_NLABELS, zero, zero, zero, zero, zero, zero
    if 16 + 8 * nlab > n:
        return E_LABELS_TRUNC, nlab, n, zero, zero, zero, zero
    return E_OK, zero, zero, gx, gy, gz, nlab


@numba.njit(nogil=True, cache=True)
def check_body(data, gx, gy, gz, nlab):  # type: ignore[no-untyped-def]
    """Check a multi-label block's counts, index array, indices < N and packed value sizes: (code, a,
    b, offset of the counts, of the indices, of the values)."""
    n = np.int64(data.shape[0])
    zero = np.int64(0)
    nsub = gx * gy * gz
    p_nsb = 16 + 8 * nlab
    p_idx = p_nsb + 2 * nsub
    if p_idx > n:
        return E_NSB_TRUNC, p_idx, n, zero, zero, zero
    nidx = zero
    nval = zero
    for i in range(nsub):
        c = read_u16(data, p_nsb + 2 * i)
        if c > MAX_SUBBLOCK_LABELS:
            return E_NSB_BIG, np.int64(i), c, zero, zero, zero
        nidx += c
        nval += 64 * BITS[c]
    p_val = p_idx + 4 * nidx
    if p_val > n:
        return E_IDX_TRUNC, p_val, n, zero, zero, zero
    if p_val + nval > n:
        return E_VAL_TRUNC, p_val + nval, n, zero, zero, zero
    for j in range(nidx):
        v = read_u32(data, p_idx + 4 * j)
        if v >= nlab:
            return E_IDX_RANGE, np.int64(j), v, zero, zero, zero
    return E_OK, zero, zero, p_nsb, p_idx, p_val


def head_numpy(data: np.ndarray) -> tuple[int, int, int, int, int, int, int]:
    """``check_head`` in numpy (Python ints): (code, a, b, gx, gy, gz, N)."""
    n = int(data.shape[0])
    if n < 16:
        return E_SHORT, n, 0, 0, 0, 0, 0
    gx, gy, gz, nlab = (int(v) for v in np.frombuffer(data, "<u4", 4))
    if not (1 <= gx <= MAX_GRID and 1 <= gy <= MAX_GRID and 1 <= gz <= MAX_GRID):
        return E_GRID, 0, 0, 0, 0, 0, 0
    if nlab < 1:
        return E_NLABELS, 0, 0, 0, 0, 0, 0
    if 16 + 8 * nlab > n:
        return E_LABELS_TRUNC, nlab, n, 0, 0, 0, 0
    return E_OK, 0, 0, gx, gy, gz, nlab


def body_numpy(data: np.ndarray, gx: int, gy: int, gz: int, nlab: int
               ) -> tuple[int, int, int, Any, Any, int]:
    """``check_body`` in numpy: (code, a, b, nsb, idx, p_val), the counts (int64) and indices (<u4)
    in place of their offsets (None on an error)."""
    n = int(data.shape[0])
    nsub = gx * gy * gz
    p_nsb = 16 + 8 * nlab
    p_idx = p_nsb + 2 * nsub
    if p_idx > n:
        return E_NSB_TRUNC, p_idx, n, None, None, 0
    nsb = np.frombuffer(data, "<u2", nsub, p_nsb).astype(np.int64)
    big = np.flatnonzero(nsb > MAX_SUBBLOCK_LABELS)
    if big.size:
        return E_NSB_BIG, int(big[0]), int(nsb[big[0]]), None, None, 0
    nidx = int(nsb.sum())
    p_val = p_idx + 4 * nidx
    if p_val > n:
        return E_IDX_TRUNC, p_val, n, None, None, 0
    nval = 64 * int(BITS[nsb].sum())
    if p_val + nval > n:
        return E_VAL_TRUNC, p_val + nval, n, None, None, 0
    idx = np.frombuffer(data, "<u4", nidx, p_idx)
    bad = np.flatnonzero(idx >= nlab)
    if bad.size:
        return E_IDX_RANGE, int(bad[0]), int(idx[bad[0]]), None, None, 0
    return E_OK, 0, 0, nsb, idx, p_val


def values_numpy(data: np.ndarray, q: np.ndarray, bits: np.ndarray) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """The packed values of sub-blocks ``q`` (value offsets) grouped by width: (b, positions,
    values (len(positions), 512) int64), 0-bit sub-blocks skipped."""
    for b in np.unique(bits[bits > 0]).tolist():
        sel = np.flatnonzero(bits == b)
        raw = data[q[sel][:, None] + np.arange(64 * b)]
        yield b, sel, np.unpackbits(raw, axis=1).reshape(sel.size, 512, b) @ (1 << np.arange(b - 1, -1, -1))


def block_error(code: int, a: int, b: int, data: BytesLike, out: Any) -> BlockDecodeError:
    """The exception, with a readable message, of a kernel error code."""
    if code == E_SHORT:
        return BlockDecodeError(f"block is {a} bytes, shorter than the 16-byte header")
    if bytes(data[:4]) == b"\x28\xb5\x2f\xfd":
        return BlockDecodeError("these bytes are a zstd frame (magic 28 b5 2f fd), not a DVID block: decompress "
                                "the record's dvid_compressed_block first")
    g = np.frombuffer(bytes(data[:16]).ljust(16, b"\0"), dtype="<u4")
    if code == E_GRID:
        gx, gy, gz = (int(x) for x in g[:3])
        return BlockDecodeError(
            f"sub-block grid (gx, gy, gz)=({gx}, {gy}, {gz}) out of range: each must be 1..{MAX_GRID}"
            f" (block side <= {8 * MAX_GRID} voxels)"
        )
    if code == E_NLABELS:
        return BlockDecodeError("block label list is empty (N=0)")
    if code == E_LABELS_TRUNC:
        return BlockDecodeError(f"label list of N={a} needs {16 + 8 * a} bytes, block has {b}")
    if code == E_PALETTE:
        return BlockDecodeError(f"palette has {a} entries, block label list has N={b}")
    if code == E_OUT_SHAPE:
        shape = tuple(8 * int(x) for x in g[2::-1])
        return BlockDecodeError(f"out shape {tuple(out.shape)} exceeds block shape {shape}")
    if code == E_NSB_TRUNC:
        return BlockDecodeError(f"sub-block label counts need {a} bytes, block has {b}")
    if code == E_NSB_BIG:
        return BlockDecodeError(f"sub-block {a} claims {b} labels > {MAX_SUBBLOCK_LABELS}")
    if code == E_IDX_TRUNC:
        return BlockDecodeError(f"sub-block label indices need {a} bytes, block has {b}")
    if code == E_VAL_TRUNC:
        return BlockDecodeError(f"packed sub-block values need {a} bytes, block has {b}")
    if code == E_IDX_RANGE:
        n = int(g[3])
        nsb = np.frombuffer(data, dtype="<u2", count=int(g[:3].prod()), offset=16 + 8 * n)
        sb = int(np.searchsorted(np.cumsum(nsb, dtype=np.int64), a, side="right"))
        return BlockDecodeError(f"label index {b} >= N={n} in sub-block {sb}")
    if code == E_VAL_RANGE:
        return BlockDecodeError(f"packed value >= nsb={b} in sub-block {a}: it selects no label")
    return BlockDecodeError(f"unknown block decode error {code}")


def as_palette(palette: Any) -> np.ndarray:
    """A palette as 1-D C-contiguous uint64; BlockDecodeError for other values or shapes."""
    p = np.asarray(palette)
    if p.dtype != np.uint64:
        if p.dtype.kind not in "ui" or (p.size and p.min() < 0):
            raise BlockDecodeError(f"palette must hold uint64 values, got {p.dtype}")
        p = p.astype(np.uint64)
    if p.ndim != 1:
        raise BlockDecodeError(f"palette must be 1-D, got shape {p.shape}")
    return np.ascontiguousarray(p)


def as_u8(data: BytesLike) -> np.ndarray:
    """Bytes-like or uint8 data as a contiguous 1-D uint8 view (copied only if strided)."""
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8:
            raise BlockDecodeError(f"block data must be uint8, got {data.dtype}")
        return np.ascontiguousarray(data.reshape(-1))
    try:
        mv = memoryview(data)
    except TypeError as e:
        raise TypeError(
            f"block data must be bytes-like or a uint8 array, got {type(data).__name__}"
        ) from e
    if not mv.c_contiguous:
        mv = memoryview(mv.tobytes())
    return np.frombuffer(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv, dtype=np.uint8)
