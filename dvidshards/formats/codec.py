"""DVID label-block codec (FORMATS.md §1): decode and encode label blocks.

The layout, its validation walk and its messages are `formats.blocklayout`; the decoder
validates every size, count and index first (numba does not bounds-check), then writes sub-block
by sub-block. A row of 8 voxels at b bits is b bytes, read as one big-endian word. With x
contiguous in ``out`` and a whole sub-block, 0-1 labels and 1-3 bit values (99.9 % of real mCNS
sub-blocks) take one 8-lane vector store per row (a select tree in LLVM vector IR); wider values
a lookup table, cropped or strided outputs a scalar path. The kernels release the GIL.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from ..errors import BlockDecodeError
from . import jit
from .blocklayout import (
    BITS,
    E_GRID,
    E_IDX_TRUNC,
    E_LABELS_TRUNC,
    E_NLABELS,
    E_NSB_BIG,
    E_NSB_TRUNC,
    E_OK,
    E_OUT_SHAPE,
    E_PALETTE,
    E_SHORT,
    E_VAL_RANGE,
    E_VAL_TRUNC,
    MAX_GRID,
    MAX_SUBBLOCK_LABELS,
    NO_PALETTE,
    as_palette,
    as_u8,
    assemble_block,
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

__all__ = [
    "BlockHeader",
    "block_header",
    "decode_block",
    "decode_into",
    "decode_kernel",
    "decode_row_into",
    "encode_block",
]

_U8 = np.dtype(np.uint8)
_U64 = np.dtype(np.uint64)


@numba.njit(nogil=True, cache=True, inline="always")
def _row_value(data, r, w, b, x):  # type: ignore[no-untyped-def]
    if b <= 8:
        return (w >> (b * (7 - x))) & ((np.int64(1) << b) - 1)
    if x < 7:
        return (w >> (55 - 9 * x)) & 511
    return ((w & 1) << 8) | np.int64(data[r + 8])


@intrinsic
def _store_row(typingctx, out, z, y, x, w, ents, c):  # type: ignore[no-untyped-def]
    """Store out[z, y, x:x+8] (x stride 8 bytes) as one vector: the B-bit fields of ``w`` (MSB
    first) picked from the 2**B ``ents`` by a select tree; non-zero if a field is >= c."""
    nl = len(ents)
    nbits = nl.bit_length() - 1
    sig = types.int64(out, z, y, x, w, ents, c)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        inds = [
            context.cast(builder, a, t, types.intp)
            for a, t in zip(args[1:4], signature.args[1:4], strict=True)
        ]
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, inds, wraparound=False)  # type: ignore[no-untyped-call]
        i64 = ir.IntType(64)
        vt = ir.VectorType(i64, 8)
        undef = ir.Constant(vt, ir.Undefined)
        zeros = ir.Constant(ir.VectorType(ir.IntType(32), 8), [0] * 8)

        def bcast(val: Any) -> Any:
            return builder.shuffle_vector(
                builder.insert_element(undef, val, ir.Constant(ir.IntType(32), 0)), undef, zeros
            )

        level = [bcast(builder.extract_value(args[5], j)) for j in range(nl)]
        bad = ir.Constant(i64, 0)
        if nbits:
            wv = bcast(context.cast(builder, args[4], signature.args[4], types.int64))
            shifts = ir.Constant(vt, [nbits * (7 - k) for k in range(8)])
            v = builder.and_(builder.lshr(wv, shifts), ir.Constant(vt, [nl - 1] * 8))
            for j in range(nbits):
                bit = builder.icmp_unsigned(
                    "!=", builder.and_(v, ir.Constant(vt, [1 << j] * 8)), ir.Constant(vt, [0] * 8)
                )
                level = [
                    builder.select(bit, level[2 * i + 1], level[2 * i])
                    for i in range(len(level) // 2)
                ]
            over = builder.icmp_unsigned(
                ">=", v, bcast(context.cast(builder, args[6], signature.args[6], types.int64))
            )
            bad = builder.zext(builder.bitcast(over, ir.IntType(8)), i64)
        builder.store(level[0], builder.bitcast(ptr, vt.as_pointer()), align=8)
        return bad

    return sig, codegen


@numba.njit(nogil=True, cache=True, inline="always")
def _vec_rows(data, q, out, z0, y0, x0, b, ents, c):  # type: ignore[no-untyped-def]
    # a whole sub-block of b <= 3 bits (b a literal at the call site) with vector row stores
    bad = np.int64(0)
    for z in range(8):
        for y in range(8):
            r = q + (8 * z + y) * b
            w = np.int64(0)
            for i in range(b):
                w = (w << 8) | np.int64(data[r + i])
            bad |= _store_row(out, z0 + z, y0 + y, x0, w, ents, c)  # type: ignore[call-arg]
    return bad != 0


@numba.njit(nogil=True, cache=True)
def _full_rows_any(data, q, lut, out, z0, y0, x0, b, c, check):  # type: ignore[no-untyped-def]
    # a whole sub-block of b <= 8 bits, any strides; True if a value >= c. b at run time: wider
    # than 3 bits is 0.1 % of real sub-blocks, so unrolling per width bought only compile time
    mask = (np.int64(1) << b) - 1
    bad = False
    for z in range(8):
        for y in range(8):
            r = q + (8 * z + y) * b
            w = np.int64(0)
            for i in range(b):
                w = (w << 8) | np.int64(data[r + i])
            for x in range(8):
                vi = (w >> (b * (7 - x))) & mask
                if check:
                    bad |= vi >= c
                out[z0 + z, y0 + y, x0 + x] = lut[vi]
    return bad


@numba.njit(nogil=True, cache=True)
def _full_rows9(data, q, lut, out, z0, y0, x0, c, check):  # type: ignore[no-untyped-def]
    bad = False
    for z in range(8):
        for y in range(8):
            r = q + (8 * z + y) * 9
            w = np.int64(0)
            for i in range(8):
                w = (w << 8) | np.int64(data[r + i])
            for x in range(7):
                vi = (w >> (55 - 9 * x)) & 511
                if check:
                    bad |= vi >= c
                out[z0 + z, y0 + y, x0 + x] = lut[vi]
            vi = ((w & 1) << 8) | np.int64(data[r + 8])
            if check:
                bad |= vi >= c
            out[z0 + z, y0 + y, x0 + 7] = lut[vi]
    return bad


@numba.njit(nogil=True, cache=True)
def _decode_kernel(data, pal, use_pal, out):  # type: ignore[no-untyped-def]
    """Validate the whole block, then decode it into ``out``; (code, a, b)."""
    zero = np.int64(0)
    code, ea, eb, gx, gy, gz, nlab = check_head(data)
    if code != E_OK:
        return code, ea, eb
    if use_pal and np.int64(pal.shape[0]) != nlab:
        return E_PALETTE, np.int64(pal.shape[0]), nlab
    oz = np.int64(out.shape[0])
    oy = np.int64(out.shape[1])
    ox = np.int64(out.shape[2])
    if oz > 8 * gz or oy > 8 * gy or ox > 8 * gx:
        return E_OUT_SHAPE, zero, zero

    xvec = out.strides[2] == 8  # rows of 8 voxels are contiguous: vector stores
    if nlab == 1:  # solid block
        v = pal[0] if use_pal else read_u64(data, 16)
        if xvec and ox % 8 == 0:
            for z in range(oz):
                for y in range(oy):
                    for x in range(0, ox, 8):
                        _store_row(out, z, y, x, zero, (v,), zero)  # type: ignore[call-arg]
        else:
            for z in range(oz):
                for y in range(oy):
                    for x in range(ox):
                        out[z, y, x] = v
        return E_OK, zero, zero

    # validate everything the decode reads: counts, index array, indices < N, packed values
    code, ea, eb, p_nsb, p_idx, p_val = check_body(data, gx, gy, gz, nlab)
    if code != E_OK:
        return code, ea, eb

    # block palette first: keeps the palette/label-list choice out of the voxel loops
    labs = np.empty(nlab, dtype=np.uint64)
    if use_pal:
        for j in range(nlab):
            labs[j] = pal[j]
    else:
        for j in range(nlab):
            labs[j] = read_u64(data, 16 + 8 * j)
    lut = np.zeros(MAX_SUBBLOCK_LABELS, dtype=np.uint64)
    start = p_idx  # byte offset of the current sub-block's indices
    q = p_val  # byte offset of its packed values
    sb = zero
    for sz in range(gz):
        z0 = 8 * sz
        zl = min(8, oz - z0)
        for sy in range(gy):
            y0 = 8 * sy
            yl = min(8, oy - y0)
            for sx in range(gx):
                x0 = 8 * sx
                xl = min(8, ox - x0)
                c = read_u16(data, p_nsb + 2 * sb)
                b = BITS[c]
                if zl > 0 and yl > 0 and xl > 0:
                    full = zl == 8 and yl == 8 and xl == 8
                    if c <= 1:
                        v = np.uint64(0) if c == 0 else labs[read_u32(data, start)]
                        if full and xvec:
                            _vec_rows(data, q, out, z0, y0, x0, 0, (v,), c)
                        elif full:
                            for z in range(8):
                                for y in range(8):
                                    for x in range(8):
                                        out[z0 + z, y0 + y, x0 + x] = v
                        else:
                            for z in range(zl):
                                for y in range(yl):
                                    for x in range(xl):
                                        out[z0 + z, y0 + y, x0 + x] = v
                    else:
                        for k in range(c):
                            lut[k] = labs[read_u32(data, start + 4 * k)]
                        for k in range(c, 1 << b):
                            lut[k] = 0
                        check = c != (1 << b)
                        if not full:
                            bad = False
                            for z in range(zl):
                                for y in range(yl):
                                    r = q + (8 * z + y) * b
                                    w = row_word(data, r, b)
                                    for x in range(xl):
                                        vi = _row_value(data, r, w, b, x)
                                        bad |= vi >= c
                                        out[z0 + z, y0 + y, x0 + x] = lut[vi]
                        elif b == 1 and xvec:
                            bad = _vec_rows(data, q, out, z0, y0, x0, 1, (lut[0], lut[1]), c)
                        elif b == 2 and xvec:
                            bad = _vec_rows(
                                data, q, out, z0, y0, x0, 2, (lut[0], lut[1], lut[2], lut[3]), c
                            )
                        elif b == 3 and xvec:
                            ents = (lut[0], lut[1], lut[2], lut[3], lut[4], lut[5], lut[6], lut[7])
                            bad = _vec_rows(data, q, out, z0, y0, x0, 3, ents, c)
                        elif b <= 8:
                            bad = _full_rows_any(data, q, lut, out, z0, y0, x0, b, c, check)
                        else:
                            bad = _full_rows9(data, q, lut, out, z0, y0, x0, c, check)
                        if bad:
                            return E_VAL_RANGE, sb, c
                start += 4 * c
                q += 64 * b
                sb += 1
    return E_OK, zero, zero


# one signature for any output strides ('A'): C, F, strided outputs and writable inputs all
# convert to it, so no call compiles again
_DECODE_SIG = types.UniTuple(types.int64, 3)(  # type: ignore[no-untyped-call]
    types.Array(types.uint8, 1, "C", readonly=True),
    types.Array(types.uint64, 1, "C", readonly=True),
    types.boolean,
    types.Array(types.uint64, 3, "A"),
)
_ENCODE_SIG = types.Array(types.uint8, 1, "C")(
    types.Array(types.uint64, 3, "A", readonly=True), types.boolean
)


def _decode_numpy(data: Any, pal: Any, use_pal: Any, out: np.ndarray) -> Any:
    """``_decode_kernel`` in numpy (same checks, codes and voxels; a few ms per 64³ block instead of
    a ~8 s compile). On a damaged block ``out`` is left untouched, where the kernel may have written
    the sub-blocks before the damage: ``out`` is undefined after an error."""
    for a, dtype, ndim in ((data, _U8, 1), (pal, _U64, 1), (out, _U64, 3)):
        # the arguments numba's signature accepts, and nothing else (decode_into names the fault)
        if not isinstance(a, np.ndarray) or a.dtype != dtype or a.ndim != ndim or (
                ndim == 1 and not a.flags.c_contiguous) or (a is out and not a.flags.writeable):
            raise TypeError("no matching definition for the decode kernel's signature")
    code, a, b, gx, gy, gz, nlab = head_numpy(data)
    if code:
        return code, a, b
    if use_pal and int(pal.shape[0]) != nlab:
        return E_PALETTE, int(pal.shape[0]), nlab
    oz, oy, ox = (int(v) for v in out.shape)
    if oz > 8 * gz or oy > 8 * gy or ox > 8 * gx:
        return E_OUT_SHAPE, 0, 0
    labs = pal if use_pal else np.frombuffer(data, "<u8", nlab, 16)
    if nlab == 1:
        out[...] = labs[0]
        return E_OK, 0, 0
    code, a, b, nsb, idx, p_val = body_numpy(data, gx, gy, gz, nlab)
    if code:
        return code, a, b
    bits = BITS[nsb]
    lut = np.asarray(labs, dtype=np.uint64)[idx]  # each sub-block's labels, one after another
    start = np.cumsum(nsb) - nsb
    q = p_val + np.cumsum(64 * bits) - 64 * bits
    # only the sub-blocks that out reaches (a hostile header may declare 128³ of them)
    cz, cy, cx = -(-oz // 8), -(-oy // 8), -(-ox // 8)
    ids = ((np.arange(cz)[:, None, None] * gy + np.arange(cy)[:, None]) * gx + np.arange(cx)).reshape(-1)
    c = nsb[ids]
    vox = np.zeros((ids.size, 512), np.uint64)
    one = np.flatnonzero(c == 1)
    vox[one] = lut[start[ids[one]]][:, None]
    bad = np.zeros((ids.size, 512), bool)
    w = bits[ids]
    for _b, sel, vi in values_numpy(data, q[ids], w):
        cs = c[sel][:, None]
        bad[sel] = vi >= cs
        vox[sel] = lut[start[ids[sel]][:, None] + np.minimum(vi, cs - 1)]

    def volume(a: Any) -> Any:  # (sub-block, z, y, x) -> (z, y, x) voxels, cropped to out
        return a.reshape(cz, cy, cx, 8, 8, 8).transpose(0, 3, 1, 4, 2, 5).reshape(8 * cz, 8 * cy, 8 * cx)[
            :oz, :oy, :ox]

    if bad.any():
        z, y, x = np.nonzero(volume(bad))  # only the voxels the kernel visits count
        if z.size:
            sb = int((((z // 8) * gy + y // 8) * gx + x // 8).min())
            return E_VAL_RANGE, sb, int(nsb[sb])
    out[...] = volume(vox)
    return E_OK, 0, 0


decode_kernel = jit.kernel(_decode_kernel, [_DECODE_SIG.args], _decode_numpy, exclusive=True)


@numba.njit(nogil=True, cache=True, inline="always")
def _band(data, r, out, z, y0, x, b, ents, c):  # type: ignore[no-untyped-def]
    # 8 rows (y0..y0+7) of one sub-block at one z, b <= 3 bits (a literal at the call site)
    bad = np.int64(0)
    for yy in range(8):
        w = np.int64(0)
        for i in range(b):
            w = (w << 8) | np.int64(data[r + yy * b + i])
        bad |= _store_row(out, z, y0 + yy, x, w, ents, c)  # type: ignore[call-arg]
    return bad != 0


@numba.njit(nogil=True, cache=True)
def _row_kernel(data, offs, pal, poffs, use_pal, out):  # type: ignore[no-untyped-def]
    """Decode k x-adjacent blocks into ``out`` (8gz, 8gy, 8gx * k): all validated and their label
    tables built first, then voxels written z by z, y by y across the k blocks, so an F-ordered
    output is written sequentially (~1.6x less memory traffic than block by block). Returns (code,
    a, b, block) for the first damaged block."""
    zero = np.int64(0)
    k = offs.shape[0] - 1
    gx = np.int64(out.shape[2]) // (8 * k) if k > 0 else zero
    gy = np.int64(out.shape[1]) // 8
    gz = np.int64(out.shape[0]) // 8
    nsub = gx * gy * gz
    if k < 1 or gx < 1 or 8 * gx * k != out.shape[2] or 8 * gy != out.shape[1] or 8 * gz != out.shape[0] or \
            out.strides[2] != 8 or poffs.shape[0] != k + 1:
        return E_OUT_SHAPE, zero, zero, zero
    # per block and sub-block: label count, bit offset of its values, start of its table in lut
    cnt = np.empty((k, nsub), np.int64)
    qv = np.empty((k, nsub), np.int64)
    ls = np.empty((k, nsub), np.int64)
    total = zero
    for i in range(k):
        if offs[i] < 0 or offs[i] > offs[i + 1] or offs[i + 1] > data.shape[0] or poffs[i] < 0 or \
                poffs[i] > poffs[i + 1] or poffs[i + 1] > pal.shape[0]:
            return E_OUT_SHAPE, zero, zero, np.int64(i)
        d = data[offs[i]:offs[i + 1]]
        code, ea, eb, bx, by, bz, nlab = check_head(d)
        if code != E_OK:
            return code, ea, eb, np.int64(i)
        if use_pal and poffs[i + 1] - poffs[i] != nlab:
            return E_PALETTE, poffs[i + 1] - poffs[i], nlab, np.int64(i)
        if bx != gx or by != gy or bz != gz:
            return E_OUT_SHAPE, zero, zero, np.int64(i)
        if nlab == 1:
            for sb in range(nsub):
                cnt[i, sb] = 1
                ls[i, sb] = total
                qv[i, sb] = 0
            total += 1
            continue
        code, ea, eb, p_nsb, p_idx, p_val = check_body(d, gx, gy, gz, nlab)
        if code != E_OK:
            return code, ea, eb, np.int64(i)
        q = p_val
        for sb in range(nsub):
            c = read_u16(d, p_nsb + 2 * sb)
            cnt[i, sb] = c
            qv[i, sb] = offs[i] + q
            ls[i, sb] = total
            q += 64 * BITS[c]
            total += max(c, 1)
    lut = np.zeros(total + 8, np.uint64)  # + 8: a 3-bit table may read past the last one
    for i in range(k):
        d = data[offs[i]:offs[i + 1]]
        nlab = read_u32(d, 12)
        if nlab == 1:
            lut[ls[i, 0]] = pal[poffs[i]] if use_pal else read_u64(d, 16)
            continue
        j = 16 + 8 * nlab + 2 * nsub  # the sub-block index array
        for sb in range(nsub):
            c = cnt[i, sb]
            if c == 0:
                lut[ls[i, sb]] = 0
            for m in range(c):
                v = read_u32(d, j + 4 * m)
                lut[ls[i, sb] + m] = pal[poffs[i] + v] if use_pal else read_u64(d, 16 + 8 * v)
            j += 4 * c
    bw = 8 * gx
    for z in range(8 * gz):  # z, then bands of 8 y-rows: 8 sequential write streams of k blocks' width
        sz = z >> 3
        zz = z & 7
        for sy in range(gy):
            y0 = 8 * sy
            for i in range(k):
                for sx in range(gx):
                    sb = (sz * gy + sy) * gx + sx
                    x = i * bw + 8 * sx
                    c = cnt[i, sb]
                    s = ls[i, sb]
                    r = qv[i, sb] + 8 * zz * BITS[c]  # the sub-block's rows at this z
                    if c <= 1:
                        bad = _band(data, r, out, z, y0, x, 0, (lut[s],), c)
                    else:
                        b = BITS[c]
                        if b == 1:
                            bad = _band(data, r, out, z, y0, x, 1, (lut[s], lut[s + 1]), c)
                        elif b == 2:
                            bad = _band(data, r, out, z, y0, x, 2, (lut[s], lut[s + 1], lut[s + 2], lut[s + 3]), c)
                        elif b == 3:
                            ents = (lut[s], lut[s + 1], lut[s + 2], lut[s + 3], lut[s + 4], lut[s + 5], lut[s + 6],
                                    lut[s + 7])
                            bad = _band(data, r, out, z, y0, x, 3, ents, c)
                        else:
                            bad = False
                            for yy in range(8):
                                rr = r + yy * b
                                w = row_word(data, rr, b)
                                for xx in range(8):
                                    vi = _row_value(data, rr, w, b, xx)
                                    if vi >= c:
                                        bad = True
                                    else:
                                        out[z, y0 + yy, x + xx] = lut[s + vi]
                    if bad:
                        return E_VAL_RANGE, sb, c, np.int64(i)
    return E_OK, zero, zero, zero


def _row_fallback(data: Any, offs: Any, pal: Any, poffs: Any, use_pal: Any, out: np.ndarray) -> Any:
    """``_row_kernel`` block by block through the one-block decoder."""
    k = offs.shape[0] - 1
    if k < 1 or out.shape[2] % (8 * k) or out.shape[1] % 8 or out.shape[0] % 8 or poffs.shape[0] != k + 1 \
            or out.strides[2] != 8:
        return E_OUT_SHAPE, 0, 0, 0
    w = out.shape[2] // k
    want = (w // 8, out.shape[1] // 8, out.shape[0] // 8)
    for i in range(k):
        d = data[offs[i]:offs[i + 1]]
        if d.shape[0] >= 16 and tuple(int(v) for v in np.frombuffer(d, "<u4", 3)) != want:
            return E_OUT_SHAPE, 0, 0, i  # a block of another size (the kernel's check)
        p = pal[poffs[i]:poffs[i + 1]] if use_pal else NO_PALETTE
        code, a, b = decode_kernel(d, p, use_pal, out[:, :, i * w:(i + 1) * w])
        if code:
            return code, a, b, i
    return E_OK, 0, 0, 0


_ROW_SIG = (
    types.Array(types.uint8, 1, "C", readonly=True),
    types.Array(types.int64, 1, "C", readonly=True),
    types.Array(types.uint64, 1, "C", readonly=True),
    types.Array(types.int64, 1, "C", readonly=True),
    types.boolean,
    types.Array(types.uint64, 3, "A"),
)
_row = jit.kernel(_row_kernel, [_ROW_SIG], _row_fallback, exclusive=True)


def decode_row_into(data: np.ndarray, offs: np.ndarray, palette: np.ndarray | None, poffs: np.ndarray | None,
                    out: np.ndarray) -> bool:
    """Decode k whole blocks lying side by side along x into ``out``, row by row (the bulk reader's
    hot path: F-ordered output written in memory order).

    ``data[offs[i]:offs[i + 1]]`` is block i, ``palette[poffs[i]:poffs[i + 1]]`` its palette;
    ``out`` is (z, y, x) with an 8-byte x stride, exactly k blocks wide. False when a block is
    damaged or does not fit (``out`` then partly written): decode them with `decode_into`, whose
    error names the damage.
    """
    use_pal = palette is not None
    try:
        code = _row(data, offs, palette if use_pal else NO_PALETTE,
                    poffs if use_pal else np.zeros(offs.shape[0], np.int64), use_pal, out)[0]
    except (TypeError, ValueError):  # arguments of other types or layouts: the one-block path decides
        return False
    return int(code) == E_OK


def decode_into(data_u8: Any, palette: Any, out: np.ndarray) -> None:
    """Decode one DVID block into a preallocated array (the low-overhead entry point): ``data_u8``
    1-D C-contiguous uint8, ``palette`` 1-D C-contiguous uint64 per block label or None (the
    block's own), ``out`` writable 3-D uint64 (z, y, x) of any strides no larger than the block.
    BlockDecodeError when the block is malformed or an argument is wrong (``out`` may then be
    partly written)."""
    try:
        if palette is None:
            code, a, b = decode_kernel(data_u8, NO_PALETTE, False, out)
        else:
            code, a, b = decode_kernel(data_u8, palette, True, out)
    except (TypeError, ValueError) as e:  # no matching signature: wrong type, dtype, ndim, layout
        raise _arg_error(data_u8, palette, out, e) from e
    if code:
        raise block_error(code, a, b, data_u8, out)


def _arg_error(data_u8: Any, palette: Any, out: np.ndarray, exc: Exception) -> BlockDecodeError:
    def what(a: Any) -> Any:
        return f"{a.ndim}-D {a.dtype} array" if isinstance(a, np.ndarray) else type(a).__name__

    if not isinstance(data_u8, np.ndarray) or data_u8.dtype != _U8 or data_u8.ndim != 1:
        return BlockDecodeError(f"data_u8 must be a 1-D uint8 numpy array, got {what(data_u8)}")
    if not data_u8.flags.c_contiguous:
        return BlockDecodeError("data_u8 must be C-contiguous")
    if not isinstance(out, np.ndarray) or out.dtype != _U64 or out.ndim != 3:
        return BlockDecodeError(f"out must be a 3-D uint64 (z, y, x) numpy array, got {what(out)}")
    if not out.flags.writeable:
        return BlockDecodeError("out is read-only")
    if palette is not None:
        if not isinstance(palette, np.ndarray) or palette.dtype != _U64 or palette.ndim != 1:
            return BlockDecodeError(
                f"palette must be a 1-D uint64 numpy array or None, got {what(palette)}"
            )
        if not palette.flags.c_contiguous:
            return BlockDecodeError("palette must be C-contiguous")
    return BlockDecodeError(f"invalid arguments to decode_into: {exc}")


def decode_block(data: Any, palette: Any = None, out: np.ndarray | None = None) -> np.ndarray:
    """Decode one uncompressed DVID label block to a (z, y, x) ``uint64`` array.

    Parameters
    ----------
    data : bytes-like or numpy.ndarray of uint8
        The uncompressed block (FORMATS.md §1).
    palette : array_like, optional
        ``uint64`` per block label: voxel = ``palette[v]``. Default: the block's own labels.
    out : numpy.ndarray, optional
        3-D ``uint64`` destination of any strides, possibly smaller than the block (only what fits
        is decoded). Without it the header's shape is allocated (up to 8 GiB for a hostile 24-byte
        block): pass ``out`` on untrusted input.

    Returns
    -------
    numpy.ndarray
        ``out``, or a new C-ordered array of the block's shape.

    Raises
    ------
    BlockDecodeError
        If the block is malformed or ``palette``/``out`` do not fit it.
    """
    d = as_u8(data)
    if palette is not None:
        palette = as_palette(palette)
    if out is None:
        if d.shape[0] < 16:
            raise BlockDecodeError(f"block is {d.shape[0]} bytes, shorter than the 16-byte header")
        gx, gy, gz = (int(x) for x in np.frombuffer(d[:12].tobytes(), dtype="<u4"))
        if not all(1 <= g <= MAX_GRID for g in (gx, gy, gz)):
            raise block_error(E_GRID, 0, 0, d, None)
        out = np.empty((8 * gz, 8 * gy, 8 * gx), dtype=np.uint64)
    decode_into(d, palette, out)
    return out


@dataclass(frozen=True)
class BlockHeader:
    """What a block declares, read without decoding voxels: ``grid`` (gz, gy, gx) sub-blocks,
    ``shape`` (nz, ny, nx) voxels, N labels (``labels``: a read-only view of the label list) and
    ``nbytes``, the size the encoding declares (bytes beyond it are padding)."""

    grid: tuple[int, int, int]
    shape: tuple[int, int, int]
    num_labels: int
    labels: np.ndarray
    nbytes: int


def block_header(data: Any) -> BlockHeader:
    """The `BlockHeader` of a DVID block; BlockDecodeError when the header is invalid or what it
    declares does not fit ``data`` (index values are the decoder's to check)."""
    d = as_u8(data)
    n = d.shape[0]
    if n < 16:
        raise block_error(E_SHORT, n, 0, d, None)
    gx, gy, gz, nlab = (int(x) for x in np.frombuffer(d[:16].tobytes(), dtype="<u4"))
    if not all(1 <= g <= MAX_GRID for g in (gx, gy, gz)):
        raise block_error(E_GRID, 0, 0, d, None)
    if nlab < 1:
        raise block_error(E_NLABELS, 0, 0, d, None)
    nbytes = 16 + 8 * nlab
    if nbytes > n:
        raise block_error(E_LABELS_TRUNC, nlab, n, d, None)
    labels = d[16:nbytes].view("<u8")
    labels.flags.writeable = False
    if nlab > 1:
        nsub = gx * gy * gz
        if nbytes + 2 * nsub > n:
            raise block_error(E_NSB_TRUNC, nbytes + 2 * nsub, n, d, None)
        nsb = d[nbytes : nbytes + 2 * nsub].view("<u2")
        big = np.flatnonzero(nsb > MAX_SUBBLOCK_LABELS)
        if big.size:
            raise block_error(E_NSB_BIG, int(big[0]), int(nsb[big[0]]), d, None)
        nbytes += 2 * nsub
        nbytes += 4 * int(nsb.sum(dtype=np.int64))
        if nbytes > n:
            raise block_error(E_IDX_TRUNC, nbytes, n, d, None)
        nbytes += 64 * int(BITS[nsb].sum())
        if nbytes > n:
            raise block_error(E_VAL_TRUNC, nbytes, n, d, None)
    return BlockHeader(
        (gz, gy, gx), (8 * gz, 8 * gy, 8 * gx), nlab, labels.astype(np.uint64, copy=False), nbytes
    )


_HASH_MUL = np.uint64(0x9E3779B97F4A7C15)


@numba.njit(nogil=True, cache=True)
def _encode_subblock(vol, z0, y0, x0, sb, lkeys, lstamp, lidx, loc, vbuf):  # type: ignore[no-untyped-def]
    # distinct labels of one sub-block in first-appearance order -> loc[:cnt]; local indices -> vbuf
    """Distinct labels of one sub-block in first-appearance order into ``loc`` (their count
    returned), local indices into ``vbuf``."""
    m = lkeys.shape[0] - 1
    cnt = 0
    k = 0
    last = vol[z0, y0, x0]
    li = -1
    for z in range(8):
        for y in range(8):
            for x in range(8):
                lab = vol[z0 + z, y0 + y, x0 + x]
                if li < 0 or lab != last:
                    h = np.int64((lab * _HASH_MUL) >> np.uint64(54))
                    while lstamp[h] == sb and lkeys[h] != lab:
                        h = (h + 1) & m
                    if lstamp[h] != sb:
                        lstamp[h] = sb
                        lkeys[h] = lab
                        lidx[h] = cnt
                        loc[cnt] = lab
                        cnt += 1
                    li = lidx[h]
                    last = lab
                vbuf[k] = li
                k += 1
    return cnt


@numba.njit(nogil=True, cache=True)
def _encode_kernel(vol, sort_subblocks):  # type: ignore[no-untyped-def]
    nz, ny, nx = vol.shape
    gz, gy, gx = nz // 8, ny // 8, nx // 8
    nsub = gz * gy * gx

    # per-sub-block table, stamped with the sub-block number instead of cleared
    lkeys = np.zeros(1024, dtype=np.uint64)
    lstamp = np.full(1024, -1, dtype=np.int64)
    lidx = np.zeros(1024, dtype=np.int64)
    loc = np.empty(512, dtype=np.uint64)
    rank = np.empty(512, dtype=np.int64)
    vbuf = np.empty(512, dtype=np.int64)
    # block label list: label -> index, in order of first appearance in the sub-block index stream
    logcap = 11
    keys = np.zeros(1 << logcap, dtype=np.uint64)
    slots = np.full(1 << logcap, -1, dtype=np.int64)
    labels = np.empty(1024, dtype=np.uint64)
    nlab = 0

    nsb = np.empty(nsub, dtype=np.int64)
    sbidx = np.empty(nsub * 512, dtype=np.int64)
    values = np.empty(nsub * 576, dtype=np.uint8)
    nidx = 0
    nval = 0
    sb = 0
    for sz in range(gz):
        for sy in range(gy):
            for sx in range(gx):
                cnt = _encode_subblock(
                    vol, 8 * sz, 8 * sy, 8 * sx, sb, lkeys, lstamp, lidx, loc, vbuf
                )
                if sort_subblocks and cnt > 1:
                    order = np.argsort(loc[:cnt])
                    srt = loc[order]
                    for i in range(cnt):
                        rank[order[i]] = i
                        loc[i] = srt[i]
                    for k in range(512):
                        vbuf[k] = rank[vbuf[k]]
                if nlab + cnt > labels.shape[0]:
                    labels = np.concatenate(
                        (labels, np.empty(labels.shape[0] + cnt, dtype=np.uint64))
                    )
                if 2 * (nlab + cnt) > keys.shape[0]:  # grow and rehash
                    while 2 * (nlab + cnt) > (1 << logcap):
                        logcap += 1
                    keys = np.zeros(1 << logcap, dtype=np.uint64)
                    slots = np.full(1 << logcap, -1, dtype=np.int64)
                    m = (1 << logcap) - 1
                    for g in range(nlab):
                        h = np.int64((labels[g] * _HASH_MUL) >> np.uint64(64 - logcap))
                        while slots[h] != -1:
                            h = (h + 1) & m
                        keys[h] = labels[g]
                        slots[h] = g
                m = (1 << logcap) - 1
                for i in range(cnt):
                    lab = loc[i]
                    h = np.int64((lab * _HASH_MUL) >> np.uint64(64 - logcap))
                    while slots[h] != -1 and keys[h] != lab:
                        h = (h + 1) & m
                    if slots[h] == -1:
                        keys[h] = lab
                        slots[h] = nlab
                        labels[nlab] = lab
                        nlab += 1
                    sbidx[nidx + i] = slots[h]
                nsb[sb] = cnt
                nidx += cnt
                b = BITS[cnt]
                if b > 0:  # MSB-first bit stream, 64*b bytes
                    acc = np.int64(0)
                    nb = 0
                    for k in range(512):
                        acc = (acc << b) | vbuf[k]
                        nb += b
                        while nb >= 8:
                            nb -= 8
                            values[nval] = np.uint8((acc >> nb) & 255)
                            nval += 1
                        acc &= (np.int64(1) << nb) - 1
                sb += 1

    return assemble_block(gx, gy, gz, labels, nlab, nsb, nsub, sbidx, nidx, values, nval)


def _encode_numpy(vol: Any, sort_subblocks: Any) -> Any:
    """``_encode_kernel`` in numpy, the same bytes (a fresh install's first ``write_export`` does not
    wait for numba): per sub-block a stable sort finds the distinct labels and their first voxels."""
    if not isinstance(vol, np.ndarray) or vol.dtype != _U64 or vol.ndim != 3:
        raise TypeError("no matching definition for the encode kernel's signature")
    nz, ny, nx = vol.shape
    gz, gy, gx = nz // 8, ny // 8, nx // 8
    nsub = gz * gy * gx
    # (sub-block, voxel): sub-blocks and their voxels both in z, y, x order
    sub = vol[:8 * gz, :8 * gy, :8 * gx].reshape(gz, 8, gy, 8, gx, 8).transpose(0, 2, 4, 1, 3, 5).reshape(nsub, 512)
    o = np.argsort(sub, axis=1, kind="stable")  # equal labels keep their voxel order: a run starts at its first
    srt = np.take_along_axis(sub, o, axis=1)
    new = np.ones((nsub, 512), bool)
    new[:, 1:] = srt[:, 1:] != srt[:, :-1]
    cnt = new.sum(axis=1)
    run = np.cumsum(new, axis=1) - 1  # each sorted voxel's distinct label, in label order, per sub-block
    first = (np.cumsum(cnt) - cnt)[:, None]
    rows, k = np.nonzero(new)  # the distinct labels, sub-block by sub-block, in label order
    lab, pos = srt[rows, k], o[rows, k]
    if sort_subblocks:
        local = run
        stream = lab
    else:  # by first appearance
        order = np.lexsort((pos, rows))
        rank = np.empty(order.size, np.int64)
        rank[order] = np.arange(order.size) - np.repeat(np.cumsum(cnt) - cnt, cnt)
        local = rank[first + run]
        stream = lab[order]
    vi = np.empty((nsub, 512), np.int64)
    np.put_along_axis(vi, o, local, axis=1)
    uniq, at = np.unique(stream, return_index=True)
    labels = stream[np.sort(at)]  # the block list: first appearance in the stream
    head = np.array([gx, gy, gz, labels.size], "<u4").tobytes()
    if labels.size == 1:
        return np.frombuffer(head + labels.astype("<u8").tobytes(), np.uint8).copy()
    where = np.empty(uniq.size, np.int64)  # label -> its place in the block list
    where[np.searchsorted(uniq, labels)] = np.arange(labels.size)
    sbidx = where[np.searchsorted(uniq, stream)]
    bits = BITS[cnt]
    packed = [b""] * nsub
    for b in np.unique(bits[bits > 0]).tolist():
        sel = np.flatnonzero(bits == b)
        planes = (vi[sel][:, :, None] >> np.arange(b - 1, -1, -1)) & 1  # MSB first
        for i, row in zip(sel.tolist(), np.packbits(planes.reshape(sel.size, 512 * b).astype(np.uint8), axis=1),
                          strict=True):
            packed[i] = row.tobytes()
    body = (labels.astype("<u8").tobytes() + cnt.astype("<u2").tobytes() + sbidx.astype("<u4").tobytes()
            + b"".join(packed))
    return np.frombuffer(head + body, np.uint8).copy()


_FALLBACK_VOXELS = 128 ** 3  # larger volumes compile first: the fallback's temporaries are ~6x the volume
_encode = jit.kernel(_encode_kernel, [_ENCODE_SIG.args], _encode_numpy, exclusive=True)


def encode_block(volume_zyx: Any, *, subblock_order: str = "appearance") -> bytes:
    """Encode a label volume as one uncompressed DVID label block (FORMATS.md §1).

    Each sub-block lists its labels in first-appearance order (voxels z, y, x), as DVID's
    ``MakeBlock``, or ascending with ``subblock_order="sorted"``, as real ``export-shards``
    blocks; the block list is the order of first appearance in the sub-block index stream. One
    label gives a 24-byte solid block, as ``MakeSolidBlock``.

    Parameters
    ----------
    volume_zyx : numpy.ndarray
        3-D unsigned (z, y, x) labels, each size a multiple of 8 in 8..1024.
    subblock_order : {"appearance", "sorted"}

    Raises
    ------
    ValueError
        If the volume or ``subblock_order`` is not as above.
    """
    if subblock_order not in ("appearance", "sorted"):
        raise ValueError(f"subblock_order must be 'appearance' or 'sorted', got {subblock_order!r}")
    vol = np.asarray(volume_zyx)
    if vol.ndim != 3:
        raise ValueError(f"volume must be 3-D (z, y, x), got shape {vol.shape}")
    if any(s % 8 or not 8 <= s <= 8 * MAX_GRID for s in vol.shape):
        raise ValueError(
            f"volume sizes must be multiples of 8 in 8..{8 * MAX_GRID}, got {vol.shape}"
        )
    if vol.dtype != np.uint64:
        if vol.dtype.kind != "u":
            raise ValueError(f"volume must hold unsigned integer labels, got {vol.dtype}")
        vol = vol.astype(np.uint64)
    elif not vol.dtype.isnative:
        vol = vol.astype(np.uint64)
    if vol.size > _FALLBACK_VOXELS:
        _encode.ensure()
    return bytes(_encode(vol, subblock_order == "sorted").tobytes())
