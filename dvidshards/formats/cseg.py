"""DVID label block → neuroglancer ``compressed_segmentation`` without decoding voxels.

Both cut a chunk into 8³ blocks (z, y, x order, x fastest inside). A DVID sub-block packs 512
MSB-first indices into its label list; a ``compressed_segmentation`` block holds a table of its
distinct uint64 values and 512 LSB-first ranks of 0, 1, 2, 4, 8, 16 or 32 bits. Transcoding a
sub-block: unpack, keep the indices that occur, map them to labels (the palette), sort and
deduplicate them into the table, repack the ranks. A 1-bit two-label sub-block is a bit reversal
of every byte (inverted when the labels sort the other way), 2-bit ones are remapped 32 voxels
at a time on 64-bit words.

The bytes equal TensorStore's (and neuroglancer's) encoder for a uint64 single-channel chunk of
the block's shape with 8³ blocks: one uint32 channel offset (1), a header of two uint32 per
block (``table offset | bits << 24`` and the values' offset, in words from the channel start),
then each block's values followed by its table unless an identical table was written before
(then that one is referenced); tables are uint64 values, low word first.

Until numba has compiled the kernel (~10-30 CPU s with an empty cache) a numpy version with the
same checks, codes and bytes answers (~3 ms per 64³ chunk, ~40x the kernel).
"""

from __future__ import annotations

from collections.abc import Sequence

import numba
import numpy as np
from numba.core import types
from numpy.typing import ArrayLike

from ..errors import BlockDecodeError
from . import jit
from .blocklayout import (
    BITS,
    E_OK,
    E_PALETTE,
    E_VAL_RANGE,
    MAX_SUBBLOCK_LABELS,
    BytesLike,
    as_palette,
    as_u8,
    block_error,
    body_numpy,
    check_body,
    check_head,
    head_numpy,
    read_u16,
    read_u32,
    read_u64,
    values_numpy,
)

__all__ = ["BLOCK", "is_background", "transcode", "transcode_u8"]

BLOCK = 8  # compressed_segmentation block size (every axis), as DVID's sub-blocks

# compressed_segmentation bits per value for a table of n distinct values (n <= 512)
_CBITS = np.array(
    [0, 0] + [next(b for b in (1, 2, 4, 8, 16) if (1 << b) >= n) for n in range(2, 513)],
    dtype=np.int64,
)
# bit reversal of a byte: an MSB-first 1-bit row of 8 voxels -> the LSB-first one
_REV = np.array([int(f"{i:08b}"[::-1], 2) for i in range(256)], dtype=np.uint8)
_HASH_MUL = np.uint64(0x9E3779B97F4A7C15)
_U8 = np.dtype(np.uint8)
_U64 = np.dtype(np.uint64)
_NO_PALETTE = np.zeros(0, dtype=_U64)


@numba.njit(nogil=True, cache=True, inline="always")
def _put32(buf, p, v):  # type: ignore[no-untyped-def]
    buf[p] = np.uint8(v & 255)
    buf[p + 1] = np.uint8((v >> 8) & 255)
    buf[p + 2] = np.uint8((v >> 16) & 255)
    buf[p + 3] = np.uint8((v >> 24) & 255)


@numba.njit(nogil=True, cache=True, inline="always")
def _put64(buf, p, v):  # type: ignore[no-untyped-def]
    for i in range(8):
        buf[p + i] = np.uint8((v >> np.uint64(8 * i)) & np.uint64(255))


_M1 = np.uint64(0x5555555555555555)
_M2 = np.uint64(0x3333333333333333)
_M4 = np.uint64(0x0F0F0F0F0F0F0F0F)


@numba.njit(nogil=True, cache=True, inline="always")
def _le64(d, p):  # type: ignore[no-untyped-def]
    w = np.uint64(0)
    for i in range(8):
        w |= np.uint64(d[p + i]) << np.uint64(8 * i)
    return w


@numba.njit(nogil=True, cache=True, inline="always")
def _put_le64(out, p, v):  # type: ignore[no-untyped-def]
    for i in range(8):
        out[p + i] = np.uint8((v >> np.uint64(8 * i)) & np.uint64(255))


@numba.njit(nogil=True, cache=True, inline="always")
def _scan2(data, q):  # type: ignore[no-untyped-def]
    # bitmask of the 2-bit values used, 32 voxels per 64-bit word (bit planes)
    a0 = np.uint64(0)
    a1 = np.uint64(0)
    a2 = np.uint64(0)
    a3 = np.uint64(0)
    for k in range(16):
        w = _le64(data, q + 8 * k)
        h = (w >> np.uint64(1)) & _M1
        lo = w & _M1
        a0 |= ~(h | lo) & _M1
        a1 |= ~h & lo
        a2 |= h & ~lo
        a3 |= h & lo
    return (np.int64(a0 != 0) | (np.int64(a1 != 0) << 1) | (np.int64(a2 != 0) << 2)
            | (np.int64(a3 != 0) << 3))


@numba.njit(nogil=True, cache=True, inline="always")
def _pack22(data, q, rank, out, pos):  # type: ignore[no-untyped-def]
    # 2-bit MSB-first values -> 2-bit LSB-first ranks, 32 voxels per 64-bit word: reverse the
    # fields inside each byte, then map each value through rank with bit-plane masks
    zero = np.uint64(0)
    ml0 = zero - np.uint64(rank[0] & 1)
    ml1 = zero - np.uint64(rank[1] & 1)
    ml2 = zero - np.uint64(rank[2] & 1)
    ml3 = zero - np.uint64(rank[3] & 1)
    mh0 = zero - np.uint64((rank[0] >> 1) & 1)
    mh1 = zero - np.uint64((rank[1] >> 1) & 1)
    mh2 = zero - np.uint64((rank[2] >> 1) & 1)
    mh3 = zero - np.uint64((rank[3] >> 1) & 1)
    for k in range(16):
        w = _le64(data, q + 8 * k)
        w = ((w >> np.uint64(4)) & _M4) | ((w & _M4) << np.uint64(4))
        w = ((w >> np.uint64(2)) & _M2) | ((w & _M2) << np.uint64(2))
        h = (w >> np.uint64(1)) & _M1
        lo = w & _M1
        i0 = ~(h | lo) & _M1
        i1 = ~h & lo
        i2 = h & ~lo
        i3 = h & lo
        rl = (i0 & ml0) | (i1 & ml1) | (i2 & ml2) | (i3 & ml3)
        rh = (i0 & mh0) | (i1 & mh1) | (i2 & mh2) | (i3 & mh3)
        _put_le64(out, pos + 8 * k, rl | (rh << np.uint64(1)))


@numba.njit(nogil=True, cache=True, inline="always")
def _scan(data, q, b):  # type: ignore[no-untyped-def]
    # bitmask of the b-bit values (b <= 6, a literal at the call site) of one sub-block
    used = np.int64(0)
    mask = (np.int64(1) << b) - 1
    for row in range(64):
        r = q + row * b
        w = np.int64(0)
        for i in range(b):
            w = (w << 8) | np.int64(data[r + i])
        for x in range(8):
            used |= np.int64(1) << ((w >> (b * (7 - x))) & mask)
    return used


@numba.njit(nogil=True, cache=True, inline="always")
def _pack(data, q, b, rank, cb, out, pos):  # type: ignore[no-untyped-def]
    # repack one sub-block's MSB-first b-bit values (b <= 8 literal) as LSB-first cb-bit ranks
    # (cb <= 8): a row of 8 voxels is b bytes in, cb bytes out
    mask = (np.int64(1) << b) - 1
    for row in range(64):
        r = q + row * b
        w = np.int64(0)
        for i in range(b):
            w = (w << 8) | np.int64(data[r + i])
        acc = np.int64(0)
        for x in range(8):
            acc |= rank[(w >> (b * (7 - x))) & mask] << (cb * x)
        p = pos + row * cb
        for i in range(cb):
            out[p + i] = np.uint8((acc >> (8 * i)) & 255)


@numba.njit(nogil=True, cache=True, inline="always")
def _rank_table(keys, ks, m, rank, table):  # type: ignore[no-untyped-def]
    # sort the m used labels keys[:m] (with their indices ks), deduplicate them into table and
    # set rank[index] = position of its label in table; returns the table length
    if m <= 24:  # insertion sort: m is small almost always
        for i in range(1, m):
            kv = keys[i]
            kk = ks[i]
            j = i - 1
            while j >= 0 and keys[j] > kv:
                keys[j + 1] = keys[j]
                ks[j + 1] = ks[j]
                j -= 1
            keys[j + 1] = kv
            ks[j + 1] = kk
    else:
        order = np.argsort(keys[:m])
        sk = keys[:m][order]
        sv = ks[:m][order]
        keys[:m] = sk
        ks[:m] = sv
    nd = 0
    for i in range(m):
        if nd == 0 or keys[i] != table[nd - 1]:
            table[nd] = keys[i]
            nd += 1
        rank[ks[i]] = nd - 1
    return nd


@numba.njit(nogil=True, cache=True)
def _transcode_kernel(data, pal, use_pal):  # type: ignore[no-untyped-def]
    """Validate a DVID block and transcode it; (code, a, b, out, nbytes)."""
    zero = np.int64(0)
    nothing = np.empty(0, dtype=np.uint8)
    code, ea, eb, gx, gy, gz, nlab = check_head(data)
    if code != E_OK:
        return code, ea, eb, nothing, zero
    if use_pal and np.int64(pal.shape[0]) != nlab:
        return E_PALETTE, np.int64(pal.shape[0]), nlab, nothing, zero
    nsub = gx * gy * gz
    hdr = 4 + 8 * nsub  # bytes before the first block's values

    if nlab == 1:  # solid block: every block references the one table after the header
        out = np.empty(hdr + 8, dtype=np.uint8)
        _put32(out, 0, 1)
        tw = 2 * nsub
        for i in range(nsub):  # (0-bit) values offsets: the output's end, after the table
            _put32(out, 4 + 8 * i, tw)
            _put32(out, 8 + 8 * i, tw if i == 0 else tw + 2)
        _put64(out, hdr, pal[0] if use_pal else read_u64(data, 16))
        return E_OK, zero, zero, out, hdr + 8

    # validate everything read below: counts, index array, indices < N, packed value sizes
    code, ea, eb, p_nsb, p_idx, p_val = check_body(data, gx, gy, gz, nlab)
    if code != E_OK:
        return code, ea, eb, nothing, zero
    cap = hdr  # output bound: values at the widest bits plus a whole table per block
    tcap = zero  # bound on the table values written
    for i in range(nsub):
        c = read_u16(data, p_nsb + 2 * i)
        cap += 64 * _CBITS[c] + 8 * max(c, 1)
        tcap += max(c, 1)

    labs = np.empty(nlab, dtype=np.uint64)
    if use_pal:
        for j in range(nlab):
            labs[j] = pal[j]
    else:
        for j in range(nlab):
            labs[j] = read_u64(data, 16 + 8 * j)

    out = np.empty(cap, dtype=np.uint8)
    _put32(out, 0, 1)
    # tables written so far, by content: open addressing over (first value, length) slots
    hbits = 4
    while (1 << hbits) < 2 * nsub:
        hbits += 1
    hmask = (1 << hbits) - 1
    hslot = np.full(1 << hbits, -1, dtype=np.int64)  # -> index into tstart/tlen/toff
    tstart = np.empty(nsub, dtype=np.int64)  # table k's values: tvals[tstart[k]:+tlen[k]]
    tlen = np.empty(nsub, dtype=np.int64)
    toff = np.empty(nsub, dtype=np.int64)  # its offset in words from the channel start
    tvals = np.empty(tcap, dtype=np.uint64)
    ntab = 0
    nt = 0

    vals = np.empty(512, dtype=np.int64)
    stamp = np.full(MAX_SUBBLOCK_LABELS, -1, dtype=np.int64)
    keys = np.empty(MAX_SUBBLOCK_LABELS, dtype=np.uint64)
    ks = np.empty(MAX_SUBBLOCK_LABELS, dtype=np.int64)
    rank = np.empty(MAX_SUBBLOCK_LABELS, dtype=np.int64)
    table = np.empty(MAX_SUBBLOCK_LABELS, dtype=np.uint64)

    pos = hdr  # next output byte
    start = p_idx  # byte offset of the current sub-block's indices
    q = p_val  # byte offset of its packed values
    for sb in range(nsub):
        c = read_u16(data, p_nsb + 2 * sb)
        b = BITS[c]
        vpos = pos
        nd = 1
        cb = 0
        if c == 0:
            table[0] = 0
        elif c == 1:
            table[0] = labs[read_u32(data, start)]
        elif c == 2:  # 1 bit, both values valid
            l0 = labs[read_u32(data, start)]
            l1 = labs[read_u32(data, start + 4)]
            anyone = np.uint64(0)
            allone = ~np.uint64(0)
            for k in range(8):
                w = _le64(data, q + 8 * k)
                anyone |= w
                allone &= w
            if anyone == 0 or l0 == l1:
                table[0] = l0
            elif allone == ~np.uint64(0):
                table[0] = l1
            else:
                nd = 2
                cb = 1
                inv = ~np.uint64(0) if l0 > l1 else np.uint64(0)
                table[0] = min(l0, l1)
                table[1] = max(l0, l1)
                for k in range(8):  # reverse the bits of every byte, 8 bytes at a time
                    w = _le64(data, q + 8 * k)
                    w = ((w >> np.uint64(1)) & _M1) | ((w & _M1) << np.uint64(1))
                    w = ((w >> np.uint64(2)) & _M2) | ((w & _M2) << np.uint64(2))
                    w = ((w >> np.uint64(4)) & _M4) | ((w & _M4) << np.uint64(4))
                    _put_le64(out, pos + 8 * k, w ^ inv)
        elif b <= 6:  # up to 64 labels: the values that occur as one bitmask
            if b == 2:
                used = _scan2(data, q)
            elif b == 3:
                used = _scan(data, q, 3)
            elif b == 4:
                used = _scan(data, q, 4)
            elif b == 5:
                used = _scan(data, q, 5)
            else:
                used = _scan(data, q, 6)
            if c < 64 and (used >> c) != 0:
                return E_VAL_RANGE, np.int64(sb), c, nothing, zero
            m = 0
            for v in range(c):
                if (used >> v) & 1:
                    keys[m] = labs[read_u32(data, start + 4 * v)]
                    ks[m] = v
                    m += 1
            nd = _rank_table(keys, ks, m, rank, table)
            cb = _CBITS[nd]
            if cb > 0:
                if b == 2 and cb == 2:
                    _pack22(data, q, rank, out, pos)
                elif b == 2:
                    _pack(data, q, 2, rank, cb, out, pos)
                elif b == 3:
                    _pack(data, q, 3, rank, cb, out, pos)
                elif b == 4:
                    _pack(data, q, 4, rank, cb, out, pos)
                elif b == 5:
                    _pack(data, q, 5, rank, cb, out, pos)
                else:
                    _pack(data, q, 6, rank, cb, out, pos)
        else:  # 65..512 labels: unpack to an array first
            for row in range(64):
                r = q + row * b
                if b <= 8:
                    w = np.int64(0)
                    for i in range(b):
                        w = (w << 8) | np.int64(data[r + i])
                    mask = (np.int64(1) << b) - 1
                    for x in range(8):
                        vals[8 * row + x] = (w >> (b * (7 - x))) & mask
                else:  # 9 bits: 8 bytes hold 7 values and a bit
                    w = np.int64(0)
                    for i in range(8):
                        w = (w << 8) | np.int64(data[r + i])
                    for x in range(7):
                        vals[8 * row + x] = (w >> (55 - 9 * x)) & 511
                    vals[8 * row + 7] = ((w & 1) << 8) | np.int64(data[r + 8])
            m = 0
            for k in range(512):
                v = vals[k]
                if v >= c:
                    return E_VAL_RANGE, np.int64(sb), c, nothing, zero
                if stamp[v] != sb:
                    stamp[v] = sb
                    keys[m] = labs[read_u32(data, start + 4 * v)]
                    ks[m] = v
                    m += 1
            nd = _rank_table(keys, ks, m, rank, table)
            cb = _CBITS[nd]
            if cb == 16:
                for k in range(512):
                    rv = rank[vals[k]]
                    out[pos + 2 * k] = np.uint8(rv & 255)
                    out[pos + 2 * k + 1] = np.uint8(rv >> 8)
            elif cb > 0:
                per = 8 // cb  # values per output byte
                for k in range(0, 512, per):
                    acc = 0
                    for i in range(per):
                        acc |= rank[vals[k + i]] << (cb * i)
                    out[pos + k // per] = np.uint8(acc)
        pos += 64 * cb

        # the table: reuse an identical one written before, else append it after the values
        h = np.uint64(nd)
        for i in range(nd):
            h = (h ^ table[i]) * _HASH_MUL
        s = np.int64(h >> np.uint64(64 - hbits)) & hmask
        tw = np.int64(-1)
        while hslot[s] != -1:
            k = hslot[s]
            if tlen[k] == nd:
                t0 = tstart[k]
                same = True
                for i in range(nd):
                    if tvals[t0 + i] != table[i]:
                        same = False
                        break
                if same:
                    tw = toff[k]
                    break
            s = (s + 1) & hmask
        if tw < 0:
            tw = (pos - 4) // 4
            for i in range(nd):
                _put64(out, pos + 8 * i, table[i])
                tvals[nt + i] = table[i]
            pos += 8 * nd
            hslot[s] = ntab
            tstart[ntab] = nt
            tlen[ntab] = nd
            toff[ntab] = tw
            ntab += 1
            nt += nd
        _put32(out, 4 + 8 * sb, tw | (cb << 24))
        _put32(out, 8 + 8 * sb, (vpos - 4) // 4)
        start += 4 * c
        q += 64 * b
    return E_OK, zero, zero, out, pos


_SIG = types.Tuple(  # type: ignore[no-untyped-call]
    (types.int64, types.int64, types.int64, types.Array(types.uint8, 1, "C"), types.int64)
)(
    types.Array(types.uint8, 1, "C", readonly=True),
    types.Array(types.uint64, 1, "C", readonly=True),
    types.boolean,
)


def _transcode_numpy(data: np.ndarray, pal: np.ndarray, use_pal: bool
                     ) -> tuple[int, int, int, np.ndarray, int]:
    """``_transcode_kernel`` in numpy: the same checks in the same order, the same codes and bytes
    (the block unpacked per sub-block, then sorted, ranked and packed per block)."""
    for arg in (data, pal):  # the arguments numba's signature accepts, and nothing else
        if not isinstance(arg, np.ndarray) or arg.dtype != (_U8 if arg is data else _U64) or arg.ndim != 1 \
                or not arg.flags.c_contiguous:
            raise TypeError("no matching definition for the transcode kernel's signature")
    nothing = np.empty(0, dtype=np.uint8)
    code, a, b, gx, gy, gz, nlab = head_numpy(data)
    if code:
        return code, a, b, nothing, 0
    if use_pal and int(pal.shape[0]) != nlab:
        return E_PALETTE, int(pal.shape[0]), nlab, nothing, 0
    labs = pal if use_pal else np.frombuffer(data, "<u8", nlab, 16)
    nsub = gx * gy * gz
    if nlab == 1:  # solid: one table after the header, every block at 0 bits
        tw = 2 * nsub
        head = np.empty(1 + 2 * nsub, "<u4")
        head[0] = 1
        head[1::2] = tw
        head[2::2] = tw + 2
        head[2] = tw
        out = np.frombuffer(head.tobytes() + np.asarray(labs[:1], "<u8").tobytes(), np.uint8)
        return E_OK, 0, 0, out, out.size
    code, a, b, nsb, idx, p_val = body_numpy(data, gx, gy, gz, nlab)
    if code:
        return code, a, b, nothing, 0
    bits = BITS[nsb]
    nidx = idx.size
    # each sub-block's labels one after another, then a 0 for the sub-blocks without labels
    lut = np.concatenate([np.asarray(labs, np.uint64)[idx], np.zeros(1, np.uint64)])
    start = np.where(nsb > 0, np.cumsum(nsb) - nsb, nidx)
    q = p_val + np.cumsum(64 * bits) - 64 * bits
    vi = np.zeros((nsub, 512), np.int64)
    for _b, sel, v in values_numpy(data, q, bits):
        vi[sel] = v
    over = ((vi >= nsb[:, None]) & (bits > 0)[:, None]).any(axis=1)
    if over.any():
        sb = int(np.argmax(over))
        return E_VAL_RANGE, sb, int(nsb[sb]), nothing, 0
    # per sub-block, the indices that occur, their labels sorted and deduplicated: the tables
    w = max(int(nsb.max()), 1)
    used = np.bincount((np.arange(nsub)[:, None] * w + vi).ravel(), minlength=nsub * w).reshape(nsub, w) > 0
    us, uv = np.nonzero(used)
    keys = lut[start[us] + uv]
    o = np.lexsort((keys, us))
    us, uv, keys = us[o], uv[o], keys[o]
    new = np.ones(us.size, bool)
    new[1:] = (us[1:] != us[:-1]) | (keys[1:] != keys[:-1])
    dense = np.cumsum(new) - 1
    ranks = np.zeros((nsub, w), np.uint32)
    ranks[us, uv] = dense - dense[np.searchsorted(us, us)]
    nd = np.bincount(us[new], minlength=nsub)
    out = _pack_blocks(ranks[np.arange(nsub)[:, None], vi], nd, keys[new])
    return E_OK, 0, 0, out, out.size


def _pack_blocks(rank: np.ndarray, nd: np.ndarray, tables: np.ndarray) -> np.ndarray:
    """TensorStore's compressed_segmentation of one channel: ``rank`` (blocks, 512) each voxel's
    place in its block's table, ``nd`` the tables' lengths, ``tables`` their sorted values in a row."""
    nb = rank.shape[0]
    cb = _CBITS[nd]
    packed: list[bytes] = [b""] * nb
    for b in np.unique(cb[cb > 0]).tolist():  # LSB-first: value k of a 32-bit word at bit b*k
        sel = np.flatnonzero(cb == b)
        per = 32 // b
        r = rank[sel].reshape(sel.size, 512 // per, per) << (b * np.arange(per, dtype=np.uint32))
        words = r.sum(axis=2, dtype=np.uint32).astype("<u4")
        for k, i in enumerate(sel.tolist()):
            packed[i] = words[k].tobytes()
    tvals = tables.astype("<u8")
    tend = np.cumsum(nd).tolist()
    head = np.empty(1 + 2 * nb, "<u4")
    head[0] = 1
    pieces = [b""]
    seen: dict[bytes, int] = {}
    pos = 4 + 8 * nb
    t0 = 0
    for i in range(nb):
        vpos = pos
        pieces.append(packed[i])
        pos += len(packed[i])
        table = tvals[t0:tend[i]].tobytes()
        t0 = tend[i]
        tw = seen.get(table)
        if tw is None:  # a new table after this block's values; an identical one is shared
            tw = seen[table] = (pos - 4) // 4
            pieces.append(table)
            pos += len(table)
        head[1 + 2 * i] = tw | (int(cb[i]) << 24)
        head[2 + 2 * i] = (vpos - 4) // 4
    pieces[0] = head.tobytes()
    return np.frombuffer(b"".join(pieces), np.uint8)


_kernel = jit.kernel(_transcode_kernel, [_SIG.args], _transcode_numpy, exclusive=True)


def transcode(block: BytesLike, palette: ArrayLike | None = None) -> bytes:
    """One uncompressed DVID label block as ``compressed_segmentation`` bytes: the chunk TensorStore's
    ``neuroglancer_precomputed`` driver writes for the same voxels (uint64, one channel, 8³ blocks,
    the block's shape). ``palette``: uint64 per block label (a record's ``labels``; default the
    block's own). BlockDecodeError when the block is malformed or the palette does not fit it."""
    d = as_u8(block)
    if palette is None:
        code, a, b, out, nbytes = _kernel(d, _NO_PALETTE, False)
    else:
        code, a, b, out, nbytes = _kernel(d, as_palette(palette), True)
    if code:
        raise block_error(code, a, b, d, None)
    return bytes(out[:nbytes].tobytes())


def transcode_u8(data_u8: np.ndarray, palette: np.ndarray | None) -> bytes:
    """`transcode` without argument conversion (bulk jobs): ``data_u8`` 1-D C-contiguous uint8,
    ``palette`` 1-D C-contiguous uint64 or None; BlockDecodeError for anything else."""
    k = _kernel
    try:
        if palette is None:
            code, a, b, out, nbytes = k(data_u8, _NO_PALETTE, False)
        else:
            code, a, b, out, nbytes = k(data_u8, palette, True)
    except (TypeError, ValueError) as e:  # no matching signature
        raise BlockDecodeError(f"transcode_u8 takes a 1-D C-contiguous uint8 array and a 1-D C-contiguous "
                               f"uint64 palette or None ({e})") from None
    if code:
        raise block_error(code, a, b, data_u8, None)
    return bytes(out[:nbytes].tobytes())


def is_background(encoded: bytes, shape: Sequence[int] = (64, 64, 64)) -> bool:
    """Whether a ``compressed_segmentation`` chunk of ``shape`` (z, y, x) is all 0 (the header and
    one 0 table every block references at 0 bits): TensorStore stores no such chunk, nor does
    ``dvidshards convert``."""
    nblocks = int(np.prod([-(-s // BLOCK) for s in shape]))
    return len(encoded) == 4 + 8 * nblocks + 8 and encoded[-8:] == bytes(8)
