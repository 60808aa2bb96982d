"""Per-label voxel counts and bounding boxes of DVID label blocks, writing no voxels.

Blocks (FORMATS.md §1) are validated as the decoder does, then read sub-block by sub-block: one
listed label adds its whole (cropped) 8³, none adds to the implicit background; in a mixed one
every packed value adds a voxel to its local label and ORs the x, y and z bits of that label's
24-bit presence mask, giving the exact box at the sub-block's end (1-bit sub-blocks a row per
popcount, 2-3 bits lane-parallel). Results are per label-list entry plus one last entry for the
voxels of empty sub-blocks (label 0, not listed); voxels beyond the extent are not counted.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numba.core import types
from numba.extending import intrinsic

from ..errors import BlockDecodeError
from . import jit
from .blocklayout import (
    BITS,
    E_OK,
    E_VAL_RANGE,
    MAX_SUBBLOCK_LABELS,
    block_error,
    body_numpy,
    check_body,
    check_head,
    head_numpy,
    read_u16,
    read_u32,
    read_u64,
    row_word,
    values_numpy,
)

__all__ = ["BlockError", "batch_stats"]

_E_EXTENT = 100  # negative extent or accumulators of another length (batch_stats rules both out)

# first / last set bit of a non-zero byte
_FIRST8 = np.array([0] + [(i & -i).bit_length() - 1 for i in range(1, 256)], dtype=np.int64)
_LAST8 = np.array([0] + [i.bit_length() - 1 for i in range(1, 256)], dtype=np.int64)
_BIG = np.int64(1) << 40


@numba.njit(nogil=True, cache=True, inline="always")
def _add_box(boxes, g, x0, y0, z0, x1, y1, z1):  # type: ignore[no-untyped-def]
    if x0 < boxes[g, 0]:
        boxes[g, 0] = x0
    if y0 < boxes[g, 1]:
        boxes[g, 1] = y0
    if z0 < boxes[g, 2]:
        boxes[g, 2] = z0
    if x1 > boxes[g, 3]:
        boxes[g, 3] = x1
    if y1 > boxes[g, 4]:
        boxes[g, 4] = y1
    if z1 > boxes[g, 5]:
        boxes[g, 5] = z1


@numba.njit(nogil=True, cache=True, inline="always")
def _flush_local(lcnt, lmask, c, data, start, counts, boxes, x0, y0, z0, first, last):  # type: ignore[no-untyped-def]
    # local (sub-block) counts and presence masks -> block-label indices; resets the locals
    for k in range(c):
        n = lcnt[k]
        if n == 0:
            continue
        g = read_u32(data, start + 4 * k)
        counts[g] += n
        m = lmask[k]
        xm = m & 255
        ym = (m >> 8) & 255
        zm = (m >> 16) & 255
        _add_box(boxes, g, x0 + first[xm], y0 + first[ym], z0 + first[zm],
                 x0 + last[xm] + 1, y0 + last[ym] + 1, z0 + last[zm] + 1)
        lcnt[k] = 0
        lmask[k] = 0


@intrinsic
def _popcount(typingctx, x):  # type: ignore[no-untyped-def]
    sig = types.int64(types.int64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.ctpop(context.cast(builder, args[0], signature.args[0], types.int64))

    return sig, codegen


_REV8 = np.array([int(f"{i:08b}"[::-1], 2) for i in range(256)], dtype=np.int64)
_LO2 = np.int64(0x5555555555555555)  # of every 2-bit lane
_HI2 = np.int64(0xAAAAAAAAAAAAAAAA - (1 << 64))  # 2 * _LO2 as int64


@numba.njit(nogil=True, cache=True, inline="always")
def _rows_mask(a, rows, rowbits, rev8):  # type: ignore[no-untyped-def]
    """x | y << 8 masks of ``rows`` rows of 8 lanes in ``a`` (row 0 in the top bits; ``rowbits`` 8
    for 1-bit lanes, 16 for 2-bit lanes whose low bits only may be set)."""
    f = np.int64(0)
    ym = np.int64(0)
    full = (np.int64(1) << rowbits) - 1
    for r in range(rows):
        v = (a >> (rowbits * (rows - 1 - r))) & full
        f |= v
        if v != 0:
            ym |= np.int64(1) << r
    if rowbits == 16:  # gather the even bits: lane x's bit 2 * (7 - x) -> bit 7 - x
        f = (f | (f >> 1)) & 0x3333
        f = (f | (f >> 2)) & 0x0F0F
        f = (f | (f >> 4)) & 0x00FF
    return rev8[f] | (ym << 8)


@numba.njit(nogil=True, cache=True, inline="always")
def _sub1(data, q, lcnt, lmask, rev8):  # type: ignore[no-untyped-def]
    """A whole 1-bit sub-block: each z-plane is one 64-bit word, row y its byte y."""
    n1 = np.int64(0)
    a0 = np.int64(0)
    a1 = np.int64(0)
    z0 = np.int64(0)
    z1 = np.int64(0)
    for z in range(8):
        w = row_word(data, q + 8 * z, 8)
        n1 += _popcount(w)  # type: ignore[call-arg]
        a1 |= w
        a0 |= ~w
        if w != 0:
            z1 |= np.int64(1) << z
        if w != -1:
            z0 |= np.int64(1) << z
    lcnt[0] = 512 - n1
    lcnt[1] = n1
    if z0 != 0:
        lmask[0] = _rows_mask(a0, 8, 8, rev8) | (z0 << 16)
    if z1 != 0:
        lmask[1] = _rows_mask(a1, 8, 8, rev8) | (z1 << 16)


@numba.njit(nogil=True, cache=True, inline="always")
def _halves_mask(a0, a1, rev8):  # type: ignore[no-untyped-def]
    # x | y << 8 of 2-bit lane bits: a0 holds rows 0-3, a1 rows 4-7
    m0 = _rows_mask(a0, 4, 16, rev8)
    m1 = _rows_mask(a1, 4, 16, rev8)
    return (m0 & 255) | (m1 & 255) | (m0 & ~255) | ((m1 >> 8) << 12)


@numba.njit(nogil=True, cache=True, inline="always")
def _eq2(w, k):  # type: ignore[no-untyped-def]
    # the low bit of each 2-bit lane of w that equals k
    t = w ^ k
    return _LO2 & ~(t | (t >> 1))


@numba.njit(nogil=True, cache=True, inline="always")
def _sub2(data, q, c, lcnt, lmask, rev8):  # type: ignore[no-untyped-def]
    """A whole 2-bit sub-block: a z-plane is two 64-bit words of 4 rows; 4 lane values."""
    n0 = n1 = n2 = n3 = np.int64(0)
    a00 = a01 = a10 = a11 = a20 = a21 = a30 = a31 = np.int64(0)
    z0 = z1 = z2 = z3 = np.int64(0)
    for z in range(8):
        u = row_word(data, q + 16 * z, 8)
        v = row_word(data, q + 16 * z + 8, 8)
        e0, f0 = _eq2(u, 0), _eq2(v, 0)
        e1, f1 = _eq2(u, _LO2), _eq2(v, _LO2)
        e2, f2 = _eq2(u, _HI2), _eq2(v, _HI2)
        e3, f3 = _eq2(u, -1), _eq2(v, -1)
        n0 += _popcount(e0) + _popcount(f0)  # type: ignore[call-arg]
        n1 += _popcount(e1) + _popcount(f1)
        n2 += _popcount(e2) + _popcount(f2)
        n3 += _popcount(e3) + _popcount(f3)
        a00 |= e0
        a01 |= f0
        a10 |= e1
        a11 |= f1
        a20 |= e2
        a21 |= f2
        a30 |= e3
        a31 |= f3
        bit = np.int64(1) << z
        z0 |= bit if (e0 | f0) != 0 else 0
        z1 |= bit if (e1 | f1) != 0 else 0
        z2 |= bit if (e2 | f2) != 0 else 0
        z3 |= bit if (e3 | f3) != 0 else 0
    lcnt[0] = n0
    lcnt[1] = n1
    lcnt[2] = n2
    lcnt[3] = n3
    if n0:
        lmask[0] = _halves_mask(a00, a01, rev8) | (z0 << 16)
    if n1:
        lmask[1] = _halves_mask(a10, a11, rev8) | (z1 << 16)
    if n2:
        lmask[2] = _halves_mask(a20, a21, rev8) | (z2 << 16)
    if n3:
        lmask[3] = _halves_mask(a30, a31, rev8) | (z3 << 16)
    # lanes holding a value >= c select no label
    return (c < 4 and n3 != 0) or (c < 3 and n2 != 0)


@numba.njit(nogil=True, cache=True, inline="always")
def _swar(data, q, lcnt, lmask, acc, zm, b, c):  # type: ignore[no-untyped-def]
    """A whole sub-block of b = 1, 2 or 3 bits (a literal), c <= 2**b labels, lane-parallel: G = 8, 4,
    2 rows per 64- or 48-bit word (big-endian: lanes contiguous); the lanes equal to k are where
    ``w ^ (k * lo)`` has no bit set (an OR of b shifted copies, an AND, a popcount), OR-ed per
    position over the z-planes. True if a value >= c."""
    g = 8 if b == 1 else (4 if b == 2 else 2)  # rows per word
    nl = 8 * g  # lanes per word
    nbits = b * nl
    ng = 8 // g  # words per z-plane
    lo = np.int64(0)
    for i in range(nl):
        lo |= np.int64(1) << (b * i)
    for k in range(c):  # acc[k, word position in the plane]: lanes matched; zm[k]: planes
        zm[k] = 0
        for gi in range(ng):
            acc[k, gi] = 0
    bad = False
    for z in range(8):
        for gi in range(ng):
            r = q + (8 * z + gi * g) * b
            w = np.int64(0)
            for i in range(g * b):
                w = (w << 8) | np.int64(data[r + i])
            seen = np.int64(0)
            for k in range(c):
                t = w ^ (k * lo)
                o = t
                for j in range(1, b):
                    o |= t >> j
                eq = lo & ~o
                if eq != 0:
                    m = _popcount(eq)  # type: ignore[call-arg, var-annotated]
                    seen += m
                    lcnt[k] += m
                    acc[k, gi] |= eq
                    zm[k] |= np.int64(1) << z
            bad |= seen != nl
    for k in range(c):
        if lcnt[k] == 0:
            continue
        xm = np.int64(0)
        ym = np.int64(0)
        for gi in range(ng):
            a = acc[k, gi]
            for rr in range(g):
                for x in range(8):
                    if (a >> (nbits - b * (8 * rr + x + 1))) & 1:
                        xm |= np.int64(1) << x
                        ym |= np.int64(1) << (gi * g + rr)
        lmask[k] = xm | (ym << 8) | (zm[k] << 16)
    return bad


@numba.njit(nogil=True, cache=True, inline="always")
def _full_mixed(data, q, lcnt, lmask, b, c, check):  # type: ignore[no-untyped-def]
    # a whole 8x8x8 sub-block of b bits (b a literal at the call site, 2..8); True if a value >= c
    vmask = (np.int64(1) << b) - 1
    bad = False
    for z in range(8):
        for y in range(8):
            r = q + (8 * z + y) * b
            w = np.int64(0)
            for i in range(b):
                w = (w << 8) | np.int64(data[r + i])
            rowbits = (np.int64(1) << (8 + y)) | (np.int64(1) << (16 + z))
            for x in range(8):
                v = (w >> (b * (7 - x))) & vmask
                if check:  # v < 2**b <= 256 stays inside lcnt either way
                    bad |= v >= c
                lcnt[v] += 1
                lmask[v] |= rowbits | (np.int64(1) << x)
    return bad


@numba.njit(nogil=True, cache=True, inline="always")
def _full_mixed9(data, q, lcnt, lmask, c):  # type: ignore[no-untyped-def]
    bad = False
    for z in range(8):
        for y in range(8):
            r = q + (8 * z + y) * 9
            w = np.int64(0)
            for i in range(8):
                w = (w << 8) | np.int64(data[r + i])
            rowbits = (np.int64(1) << (8 + y)) | (np.int64(1) << (16 + z))
            for x in range(8):
                if x < 7:
                    v = (w >> (55 - 9 * x)) & 511
                else:
                    v = ((w & 1) << 8) | np.int64(data[r + 8])
                bad |= v >= c
                lcnt[v] += 1
                lmask[v] |= rowbits | (np.int64(1) << x)
    return bad


@numba.njit(nogil=True, cache=True)
def _stats_core(data, lx, ly, lz, hx, hy, hz, counts, boxes, first, last, rev8):  # type: ignore[no-untyped-def]
    """Validate, then count voxels in [l, h) into counts/boxes (N+1 rows); (code, a, b)."""
    zero = np.int64(0)
    code, ea, eb, gx, gy, gz, nlab = check_head(data)
    if code != E_OK:
        return code, ea, eb
    if lx < 0 or ly < 0 or lz < 0 or hx < 0 or hy < 0 or hz < 0:
        return _E_EXTENT, zero, zero
    if counts.shape[0] != nlab + 1 or boxes.shape[0] != nlab + 1 or boxes.shape[1] != 6:
        return _E_EXTENT, zero, zero
    hx = min(hx, 8 * gx)
    hy = min(hy, 8 * gy)
    hz = min(hz, 8 * gz)
    if nlab == 1:
        if lx < hx and ly < hy and lz < hz:
            counts[0] += (hx - lx) * (hy - ly) * (hz - lz)
            _add_box(boxes, 0, lx, ly, lz, hx, hy, hz)
        return E_OK, zero, zero

    code, ea, eb, p_nsb, p_idx, p_val = check_body(data, gx, gy, gz, nlab)
    if code != E_OK:
        return code, ea, eb

    lcnt = np.zeros(MAX_SUBBLOCK_LABELS, dtype=np.int64)
    lmask = np.zeros(MAX_SUBBLOCK_LABELS, dtype=np.int64)
    acc = np.zeros((8, 4), dtype=np.int64)
    zm = np.zeros(8, dtype=np.int64)
    start = p_idx
    q = p_val
    sb = zero
    for sz in range(gz):
        z0 = 8 * sz
        za = max(lz - z0, 0)  # voxels [za, zb) of the sub-block are inside
        zb = min(8, hz - z0)
        for sy in range(gy):
            y0 = 8 * sy
            ya = max(ly - y0, 0)
            yb = min(8, hy - y0)
            for sx in range(gx):
                x0 = 8 * sx
                xa = max(lx - x0, 0)
                xb = min(8, hx - x0)
                c = read_u16(data, p_nsb + 2 * sb)
                b = BITS[c]
                if za < zb and ya < yb and xa < xb:
                    if c <= 1:
                        g = nlab if c == 0 else read_u32(data, start)
                        counts[g] += (xb - xa) * (yb - ya) * (zb - za)
                        _add_box(boxes, g, x0 + xa, y0 + ya, z0 + za, x0 + xb, y0 + yb, z0 + zb)
                    else:
                        bad = False
                        check = c != (1 << b)
                        if za > 0 or ya > 0 or xa > 0 or zb < 8 or yb < 8 or xb < 8:  # cropped
                            vmask = (np.int64(1) << b) - 1
                            for z in range(za, zb):
                                for y in range(ya, yb):
                                    r = q + (8 * z + y) * b
                                    w = np.int64(0)
                                    for i in range(min(b, 8)):
                                        w = (w << 8) | np.int64(data[r + i])
                                    rowbits = (np.int64(1) << (8 + y)) | (np.int64(1) << (16 + z))
                                    for x in range(xa, xb):
                                        if b <= 8:
                                            v = (w >> (b * (7 - x))) & vmask
                                        elif x < 7:
                                            v = (w >> (55 - 9 * x)) & 511
                                        else:
                                            v = ((w & 1) << 8) | np.int64(data[r + 8])
                                        if v >= c:
                                            bad = True
                                            v = 0
                                        lcnt[v] += 1
                                        lmask[v] |= rowbits | (np.int64(1) << x)
                        elif b == 1:
                            _sub1(data, q, lcnt, lmask, rev8)
                        elif b == 2:
                            bad = _sub2(data, q, c, lcnt, lmask, rev8)
                        elif b == 3:
                            bad = _swar(data, q, lcnt, lmask, acc, zm, 3, c)
                        elif b == 4:
                            bad = _full_mixed(data, q, lcnt, lmask, 4, c, check)
                        elif b == 5:
                            bad = _full_mixed(data, q, lcnt, lmask, 5, c, check)
                        elif b == 6:
                            bad = _full_mixed(data, q, lcnt, lmask, 6, c, check)
                        elif b == 7:
                            bad = _full_mixed(data, q, lcnt, lmask, 7, c, check)
                        elif b == 8:
                            bad = _full_mixed(data, q, lcnt, lmask, 8, c, check)
                        else:
                            bad = _full_mixed9(data, q, lcnt, lmask, c)
                        if bad:
                            return E_VAL_RANGE, sb, c
                        _flush_local(lcnt, lmask, c, data, start, counts, boxes, x0, y0, z0,
                                     first, last)
                start += 4 * c
                q += 64 * b
                sb += 1
    return E_OK, zero, zero


_I64 = np.dtype(np.int64)
_FLAT = np.arange(512)
_VX, _VY, _VZ = _FLAT % 8, _FLAT // 8 % 8, _FLAT // 64  # voxel k of a sub-block's packed values
_MIXED_BATCH = 4096  # sub-blocks handled at once by the fallback (at most 16 MiB of unpacked values)


def _check_args(data: Any, counts: Any, boxes: Any, *tables: Any) -> None:
    """Refuse what the kernel's signature refuses."""
    ok = isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 1 and data.flags.c_contiguous
    for a, ndim, out in ((counts, 1, True), (boxes, 2, True), *((t, 1, False) for t in tables)):
        ok = ok and isinstance(a, np.ndarray) and a.dtype == _I64 and a.ndim == ndim and a.flags.c_contiguous \
            and (a.flags.writeable or not out)
    if not ok:
        raise TypeError("no matching definition for the block statistics kernel's signature")


def _add_boxes(boxes: Any, g: Any, x0: Any, y0: Any, z0: Any, x1: Any, y1: Any, z1: Any) -> None:
    for j, v in enumerate((x0, y0, z0)):
        np.minimum.at(boxes[:, j], g, v)
    for j, v in enumerate((x1, y1, z1)):
        np.maximum.at(boxes[:, 3 + j], g, v)


def _stats_numpy(data: Any, lx: Any, ly: Any, lz: Any, hx: Any, hy: Any, hz: Any, counts: Any, boxes: Any, first: Any, last: Any, rev8: Any) -> Any:
    """``_stats_core`` in numpy (same checks, codes, counts and boxes; a fresh worker's first stats
    task does not wait ~12 CPU-s for numba): mixed sub-blocks unpacked a bounded number at a time in
    the kernel's order, so the first bad value is the kernel's."""
    _check_args(data, counts, boxes, first, last, rev8)
    code, a, b, gx, gy, gz, nlab = head_numpy(data)
    if code:
        return code, a, b
    lx, ly, lz, hx, hy, hz = (int(v) for v in (lx, ly, lz, hx, hy, hz))
    if min(lx, ly, lz, hx, hy, hz) < 0:
        return _E_EXTENT, 0, 0
    if counts.shape[0] != nlab + 1 or boxes.shape[0] != nlab + 1 or boxes.shape[1] != 6:
        return _E_EXTENT, 0, 0
    hx, hy, hz = min(hx, 8 * gx), min(hy, 8 * gy), min(hz, 8 * gz)
    inside = lx < hx and ly < hy and lz < hz
    if nlab == 1:
        if inside:
            counts[0] += (hx - lx) * (hy - ly) * (hz - lz)
            _add_boxes(boxes, [0], lx, ly, lz, hx, hy, hz)
        return E_OK, 0, 0
    code, a, b, nsb, idx, p_val = body_numpy(data, gx, gy, gz, nlab)
    if code or not inside:
        return code, a, b
    bits = BITS[nsb]
    start = np.cumsum(nsb) - nsb
    q = p_val + np.cumsum(64 * bits) - 64 * bits
    # the sub-blocks the box reaches, in the kernel's (z, y, x) order (a bounded number at a time:
    # a hostile header may declare 128³ of them), and the part of each inside the box
    sz, sy, sx = (np.arange(lo // 8, -(-hi // 8)) for lo, hi in ((lz, hz), (ly, hy), (lx, hx)))
    shape = (sz.size, sy.size, sx.size)
    total = sz.size * sy.size * sx.size
    for p0 in range(0, total, _MIXED_BATCH):
        iz, iy, ix = np.unravel_index(np.arange(p0, min(total, p0 + _MIXED_BATCH)), shape)
        ids = (sz[iz] * gy + sy[iy]) * gx + sx[ix]
        z0, y0, x0 = 8 * sz[iz], 8 * sy[iy], 8 * sx[ix]
        za, ya, xa = (np.maximum(lo - o, 0) for lo, o in ((lz, z0), (ly, y0), (lx, x0)))
        zb, yb, xb = (np.minimum(8, hi - o) for hi, o in ((hz, z0), (hy, y0), (hx, x0)))
        c = nsb[ids]
        solid = np.flatnonzero(c <= 1)
        if solid.size:
            g = np.full(solid.size, nlab, np.int64)
            one = c[solid] == 1
            g[one] = idx[start[ids[solid[one]]]]
            np.add.at(counts, g, ((xb - xa) * (yb - ya) * (zb - za))[solid])
            _add_boxes(boxes, g, *(v[solid] for v in (x0 + xa, y0 + ya, z0 + za, x0 + xb, y0 + yb, z0 + zb)))
        m = np.flatnonzero(c > 1)
        if not m.size:
            continue
        vi = np.empty((m.size, 512), np.int64)
        for _b, sel, v in values_numpy(data, q[ids[m]], bits[ids[m]]):
            vi[sel] = v
        over = vi >= c[m][:, None]
        if (za[m] == 0).all() and (ya[m] == 0).all() and (xa[m] == 0).all() and (zb[m] == 8).all() \
                and (yb[m] == 8).all() and (xb[m] == 8).all():  # whole sub-blocks (most of them)
            bad = over.any(axis=1)
            rows, k = np.repeat(np.arange(m.size), 512), np.tile(_FLAT, m.size)
        else:
            keep = ((_VZ >= za[m][:, None]) & (_VZ < zb[m][:, None]) & (_VY >= ya[m][:, None])
                    & (_VY < yb[m][:, None]) & (_VX >= xa[m][:, None]) & (_VX < xb[m][:, None]))
            bad = (keep & over).any(axis=1)
            rows, k = np.nonzero(keep)
        if bad.any():  # solid sub-blocks cannot be bad: the first bad mixed one is the kernel's
            r = int(np.argmax(bad))
            return E_VAL_RANGE, int(ids[m[r]]), int(c[m[r]])
        g = idx[start[ids[m]][rows] + vi[rows, k]].astype(np.int64)
        counts += np.bincount(g, minlength=nlab + 1)
        x, y, z = x0[m][rows] + _VX[k], y0[m][rows] + _VY[k], z0[m][rows] + _VZ[k]
        _add_boxes(boxes, g, x, y, z, x + 1, y + 1, z + 1)
    return E_OK, 0, 0


_E_LIST = 101  # a: the record's list length, b: the block's N


@numba.njit(nogil=True, cache=True)
def _batch_kernel(buf, offs, lo, hi, nlists, first, last, rev8):  # type: ignore[no-untyped-def]
    """Count many blocks (block k = buf[offs[k]:offs[k+1]]): (code, a, b, k, block, entry, label,
    voxels, boxes), one row per entry with voxels; on an error, block k's code."""
    n = offs.shape[0] - 1
    total = np.int64(0)
    most = np.int64(0)
    for k in range(n):  # rows needed: N of each block whose label list fits (others fail below)
        a = offs[k]
        ln = offs[k + 1] - a
        if ln >= 16:
            nl = read_u32(buf, a + 12)
            if 16 + 8 * nl <= ln:
                total += nl
                most = max(most, nl)
    rb = np.empty(total, np.int64)
    re = np.empty(total, np.int64)
    rl = np.empty(total, np.uint64)
    rv = np.empty(total, np.int64)
    rx = np.empty((total, 6), np.int64)
    counts = np.empty(most + 1, np.int64)
    boxes = np.empty((most + 1, 6), np.int64)
    m = 0
    for k in range(n):
        data = buf[offs[k]:offs[k + 1]]
        nl = read_u32(data, 12) if data.shape[0] >= 16 else np.int64(0)
        if data.shape[0] >= 16 and 16 + 8 * nl <= data.shape[0] and nl != nlists[k]:
            return _E_LIST, nlists[k], nl, np.int64(k), rb[:0], re[:0], rl[:0], rv[:0], rx[:0]
        if data.shape[0] < 16 or 16 + 8 * nl > data.shape[0]:
            nl = np.int64(0)
        c = counts[:nl + 1]
        bx = boxes[:nl + 1]
        for j in range(nl + 1):
            c[j] = 0
            for q in range(3):
                bx[j, q] = _BIG
                bx[j, 3 + q] = -1
        code, a, b = _stats_core(data, lo[k, 0], lo[k, 1], lo[k, 2], hi[k, 0], hi[k, 1], hi[k, 2],
                                 c, bx, first, last, rev8)
        if code != E_OK:
            return code, a, b, np.int64(k), rb[:0], re[:0], rl[:0], rv[:0], rx[:0]
        for j in range(nl):
            if c[j] > 0:
                rb[m] = k
                re[m] = j
                rl[m] = read_u64(data, 16 + 8 * j)
                rv[m] = c[j]
                for q in range(6):
                    rx[m, q] = bx[j, q]
                m += 1
    return E_OK, np.int64(0), np.int64(0), np.int64(-1), rb[:m], re[:m], rl[:m], rv[:m], rx[:m]


def _batch_numpy(buf: Any, offs: Any, lo: Any, hi: Any, nlists: Any, first: Any, last: Any, rev8: Any) -> Any:
    """``_batch_kernel`` block by block through ``_stats_numpy``."""
    _check_args(buf, offs, np.zeros((0, 6), np.int64), nlists, first, last, rev8)
    for a in (lo, hi):
        if not (isinstance(a, np.ndarray) and a.dtype == _I64 and a.ndim == 2 and a.flags.c_contiguous):
            raise TypeError("no matching definition for the block statistics kernel's signature")
    rows = []
    for k in range(offs.shape[0] - 1):
        data = buf[offs[k]:offs[k + 1]]
        n = data.shape[0]
        nl = int(np.frombuffer(data, "<u4", 1, 12)[0]) if n >= 16 else 0
        if n >= 16 and 16 + 8 * nl <= n and nl != nlists[k]:
            return (_E_LIST, int(nlists[k]), nl, k, *_NO_ROWS)
        if n < 16 or 16 + 8 * nl > n:
            nl = 0
        counts, boxes = _accumulators(nl)
        code, a, b = _stats_numpy(data, *lo[k], *hi[k], counts, boxes, first, last, rev8)  # type: ignore[call-arg]
        if code != E_OK:
            return (code, a, b, k, *_NO_ROWS)
        j = np.flatnonzero(counts[:nl] > 0)
        rows.append((np.full(j.size, k, np.int64), j, np.frombuffer(data, "<u8", nl, 16)[j].astype(np.uint64),
                     counts[j], boxes[j]))
    if not rows:
        return (E_OK, 0, 0, -1, *_NO_ROWS)
    return (E_OK, 0, 0, -1, *(np.concatenate([r[i] for r in rows]) for i in range(5)))


_NO_ROWS = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.uint64), np.zeros(0, np.int64),
            np.zeros((0, 6), np.int64))
_BATCH_SIG = (types.Array(types.uint8, 1, "C", readonly=True), *(types.Array(types.int64, d, "C", readonly=True)
                                                                 for d in (1, 2, 2, 1, 1, 1, 1)))
_batch = jit.kernel(_batch_kernel, [_BATCH_SIG], _batch_numpy, exclusive=True)


class BlockError(BlockDecodeError):
    """A block of a batch is malformed; ``index`` is its position."""

    def __init__(self, message: str, index: int, list_mismatch: bool = False) -> None:
        super().__init__(message)
        self.index = index
        self.list_mismatch = list_mismatch


def batch_stats(buf: np.ndarray, offsets: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                nlists: np.ndarray) -> Any:
    """Counts and boxes of many blocks in one compiled loop.

    Block k is ``buf[offsets[k]:offsets[k + 1]]`` (uint8; int64 offsets); voxels in [lo[k], hi[k])
    (x, y, z within the block) count; ``nlists[k]`` is the label-list length its record gives.
    Returns ``(block, entry, label, voxels, boxes)``, a row per label-list entry holding voxels,
    boxes (x0, y0, z0, x1, y1, z1) within the block (empty sub-blocks' background not reported).
    BlockError (``.index``, the decoder's message) for the first malformed block.
    """
    offsets = np.ascontiguousarray(offsets, np.int64)
    n = offsets.shape[0] - 1
    if n < 0 or offsets[0] < 0 or offsets[-1] > buf.shape[0] or (np.diff(offsets) < 0).any():
        raise BlockDecodeError("batch_stats: offsets must rise within the buffer")
    lo = np.ascontiguousarray(lo, np.int64).reshape(n, 3)
    hi = np.ascontiguousarray(hi, np.int64).reshape(n, 3)
    if (lo < 0).any() or (hi < 0).any():
        raise BlockDecodeError("batch_stats: lo and hi must be non-negative")
    nlists = np.ascontiguousarray(nlists, np.int64).reshape(n)
    code, a, b, k, *rows = _batch(buf, offsets, lo, hi, nlists, _FIRST8, _LAST8, _REV8)
    if code == _E_LIST:
        raise BlockError(f"its label lists have {a} entries, its block has {b} labels", int(k), True)
    if code:
        d = buf[offsets[k]:offsets[k + 1]]
        raise BlockError(str(block_error(code, a, b, d, None)), int(k))
    return tuple(rows)


def _accumulators(nlab: int) -> tuple[np.ndarray, np.ndarray]:
    """Zeroed ``counts`` (N+1,) and empty ``boxes`` (N+1, 6)."""
    counts = np.zeros(nlab + 1, dtype=np.int64)
    boxes = np.empty((nlab + 1, 6), dtype=np.int64)
    boxes[:, :3] = _BIG
    boxes[:, 3:] = -1
    return counts, boxes


