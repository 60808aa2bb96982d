"""2x label downsampling in DVID's compressed domain: 8 child blocks of scale k -> 1 of scale k+1.

Children come in DVID's octant order ``4*dz + 2*dy + dx`` (None: absent, all 0). Each output
voxel is the winner of its 2x2x2 input cell:

``"dvid"``
    DVID's pyramid rule (``downresArray``, ``datatype/common/labels/compressed.go``): the most
    frequent non-zero label (0 only when all eight are), ties to the smaller id (DVID's own ties
    follow Go's random map order; FORMATS.md §3b fixes them). Every voxel of a child votes,
    inside the volume or not.
``"mode"``
    TensorStore's ``downsample(..., "mode")``: 0 counts like any label, ties to the smaller,
    only voxels inside the volume vote (``limit``); a cell wholly outside gives 0.

Nothing is decoded first. A cell never straddles input sub-blocks, so an input 8³ sub-block
makes one 4³ quadrant of an output sub-block: solid ones without touching voxels, 1-bit ones 64
cells at once by SWAR bit counts, 2-bit ones by one table look-up per cell, wider ones cell by
cell (a homogeneous cell is one word compare). The output equals ``codec.encode_block(volume,
subblock_order="sorted")`` of the decoded result. Children are validated first (numba does not
bounds-check) and must share one even sub-block grid; the numpy fallback (decode, vote,
``encode_block``) gives the same bytes and error codes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numba
import numpy as np
from numba.core import types

from ..errors import BlockDecodeError
from . import jit
from .blocklayout import (
    BITS,
    E_OK,
    E_VAL_RANGE,
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
from .codec import decode_block, encode_block

__all__ = ["METHODS", "DownsampledBlock", "downsample_block", "region_limit"]

METHODS = ("dvid", "mode")
_DVID, _MODE = 0, 1

_E_GRID_MISMATCH = 60  # a: this child's gx*... differ from the first present child's
_E_ODD_GRID = 61  # a sub-block count per axis is odd: the block cannot be halved into octants

_EMPTY = np.zeros(0, np.uint8)
_M55 = np.uint64(0x5555555555555555)
_M33 = np.uint64(0x3333333333333333)
_MTOP = np.uint64(0xFF00FF00FF00FF00)
_MBIT = np.uint64(0x8800880088008800)
_NIB = np.uint64(0x1100110011001100)
_HASH_MUL = np.uint64(0x9E3779B97F4A7C15)
_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)  # a used-label mask too wide for 64 bits: scan the cells


@numba.njit(nogil=True, cache=True)
def _validate(data, spans, info):  # type: ignore[no-untyped-def]
    """Check every present child: (code, a, b, child, gx, gy, gz), ``info[i]`` = (nlab, p_nsb, p_idx,
    p_val) absolute in ``data``; gx -1 when no child is present."""
    zero = np.int64(0)
    gx = gy = gz = np.int64(-1)
    for i in range(8):
        s = spans[2 * i]
        if s < 0:
            continue
        d = data[s:spans[2 * i + 1]]
        code, ea, eb, bx, by, bz, nlab = check_head(d)
        if code != E_OK:
            return code, ea, eb, np.int64(i), gx, gy, gz
        if gx < 0:
            gx, gy, gz = bx, by, bz
        elif bx != gx or by != gy or bz != gz:
            return _E_GRID_MISMATCH, zero, zero, np.int64(i), gx, gy, gz
        if bx % 2 or by % 2 or bz % 2:
            return _E_ODD_GRID, zero, zero, np.int64(i), gx, gy, gz
        info[i, 0] = nlab
        if nlab > 1:
            code, ea, eb, p_nsb, p_idx, p_val = check_body(d, bx, by, bz, nlab)
            if code != E_OK:
                return code, ea, eb, np.int64(i), gx, gy, gz
            info[i, 1] = s + p_nsb
            info[i, 2] = s + p_idx
            info[i, 3] = s + p_val
    return E_OK, zero, zero, zero, gx, gy, gz


@numba.njit(nogil=True, cache=True, inline="always")
def _value(data, q, b, k):  # type: ignore[no-untyped-def]
    # value k (0..511) of a sub-block of b bits (1..9) whose packed values start at byte q
    bit = k * b
    p = q + (bit >> 3)
    o = bit & 7
    w = np.int64(data[p]) << 8
    if o + b > 8:
        w |= np.int64(data[p + 1])
    return (w >> (16 - o - b)) & ((np.int64(1) << b) - 1)


@numba.njit(nogil=True, cache=True)
def _first_bad_value(data, spans, info, nsub):  # type: ignore[no-untyped-def]
    """The first packed value >= nsb in child, then sub-block order: (child, sub-block, nsb) or
    (-1, 0, 0); run once a vote met one, so the error named is the fallback's."""
    for i in range(8):
        if spans[2 * i] < 0 or info[i, 0] <= 1:
            continue
        q = info[i, 3]
        for sb in range(nsub):
            c = read_u16(data, info[i, 1] + 2 * sb)
            b = BITS[c]
            if b > 0 and c != (1 << b):
                for k in range(512):
                    if _value(data, q, b, k) >= c:
                        return np.int64(i), np.int64(sb), c
            q += 64 * b
    return np.int64(-1), np.int64(0), np.int64(0)


@numba.njit(nogil=True, cache=True, inline="always")
def _vote(vals, labs, excl0, c, ls):  # type: ignore[no-untyped-def]
    """Winner (local index) of 8 local indices, ``c`` when nothing votes; two labels (most mixed
    cells) counted in one pass."""
    for i in range(8):
        ls[i] = labs[vals[i]]
    la = ls[0]
    lb = la
    ib = 0
    na = 0
    nb = 0
    for i in range(8):
        li = ls[i]
        if li == la:
            na += 1
        else:
            if nb == 0:
                lb = li
                ib = i
            if li == lb:
                nb += 1
    if na + nb == 8:  # one or two labels
        if excl0 and la == 0:
            na = 0
        if excl0 and lb == 0:
            nb = 0
        if na == 0 and nb == 0:
            return c
        if nb > na or (nb == na and lb < la):
            return vals[ib]
        return vals[0]
    best = c
    bestn = 0
    bestlab = np.uint64(0)
    for i in range(8):
        li = ls[i]
        if excl0 and li == 0:
            continue
        n = 0
        for j in range(8):
            if ls[j] == li:
                n += 1
        if n > bestn or (n == bestn and li < bestlab):
            best = vals[i]
            bestn = n
            bestlab = li
    return best


@numba.njit(nogil=True, cache=True, inline="always")
def _vote_valid(vals, valid, labs, excl0, c):  # type: ignore[no-untyped-def]
    best = c
    bestn = 0
    bestlab = np.uint64(0)
    for i in range(8):
        if not valid[i]:
            continue
        li = labs[vals[i]]
        if excl0 and li == 0:
            continue
        n = 0
        for j in range(8):
            if valid[j] and labs[vals[j]] == li:
                n += 1
        if n > bestn or (n == bestn and li < bestlab):
            best = vals[i]
            bestn = n
            bestlab = li
    return best


@numba.njit(nogil=True, cache=True, inline="always")
def _bits1(data, q, thr, qv):  # type: ignore[no-untyped-def]
    """A whole 1-bit sub-block's 64 cell winners into ``qv`` by SWAR counts (a z-plane is one word,
    row y its byte y, x = 7 - bit; index 1 wins when n1 >= thr, 9: never); (any 0, any 1)."""
    any0 = False
    any1 = False
    if thr > 8:
        for k in range(64):
            qv[k] = 0
        return True, False
    kk = np.uint64(8 - thr) * _NIB
    for z2 in range(4):
        se = np.uint64(0)
        so = np.uint64(0)
        for dz in range(2):
            r = q + 8 * (2 * z2 + dz)
            w = np.uint64(0)
            for i in range(8):
                w = (w << np.uint64(8)) | np.uint64(data[r + i])
            p = (w & _M55) + ((w >> np.uint64(1)) & _M55)  # x pairs: 2-bit counts 0..2
            se += p & _M33  # x2 = 1 (high nibble), 3 (low nibble)
            so += (p >> np.uint64(2)) & _M33  # x2 = 0, 2
        te = ((se & _MTOP) + ((se << np.uint64(8)) & _MTOP) + kk) & _MBIT  # y pairs: counts 0..8
        to = ((so & _MTOP) + ((so << np.uint64(8)) & _MTOP) + kk) & _MBIT
        if te != _MBIT or to != _MBIT:
            any0 = True
        if te != 0 or to != 0:
            any1 = True
        for y2 in range(4):
            hi = np.uint64(63 - 16 * y2)
            lo = np.uint64(59 - 16 * y2)
            k = (z2 * 4 + y2) * 4
            qv[k] = np.int64((to >> hi) & np.uint64(1))
            qv[k + 1] = np.int64((te >> hi) & np.uint64(1))
            qv[k + 2] = np.int64((to >> lo) & np.uint64(1))
            qv[k + 3] = np.int64((te >> lo) & np.uint64(1))
    return any0, any1


def _winner_table() -> np.ndarray:
    """``[excluded, key]``: winner (0..3, 255: none) of 8 ranks packed 2 bits each, ties to the
    smaller; ``excluded`` 1: rank 0 (label 0, DVID's rule) does not vote."""
    keys = np.arange(1 << 16)
    vals = (keys[:, None] >> (2 * np.arange(8))) & 3
    counts = (vals[:, :, None] == np.arange(4)).sum(axis=1)
    out = np.empty((2, 1 << 16), np.uint8)
    for excl in (0, 1):
        n = counts.copy()
        if excl:
            n[:, 0] = 0
        w = np.argmax(n, axis=1)  # the first maximum: the smallest rank
        w[n.max(axis=1) == 0] = 255
        out[excl] = w
    return out


_WIN2 = _winner_table()


@numba.njit(nogil=True, cache=True)
def _bits2(data, q, labs, excl0, c, qv, win):  # type: ignore[no-untyped-def]
    """A whole 2-bit sub-block: each cell's winner by one look-up of its 8 values as label ranks
    (ordered like the labels, so ties go to the smaller id); False on a value >= c."""
    rank = np.zeros(4, np.int64)
    for v in range(c):
        r = 0
        for u in range(c):
            if labs[u] < labs[v]:
                r += 1
        rank[v] = r  # equal labels: the same rank (counts of smaller ones)
    rep = np.full(5, c, np.int64)  # rank -> its first local index; 4 (255 clipped): nothing votes
    for v in range(c - 1, -1, -1):
        rep[rank[v]] = v
    remap = np.zeros(16, np.int64)  # two packed values -> two packed ranks
    for f in range(16):
        remap[f] = (rank[(f >> 2) & 3] << 2) | rank[f & 3]
    ex = 0
    if excl0:
        for v in range(c):
            if labs[v] == 0:
                ex = 1
    ident = True
    for v in range(c):  # labels sorted and distinct (real export blocks): ranks are the local indices
        if rank[v] != v:
            ident = False
    ok = True
    for z2 in range(4):
        for y2 in range(4):
            r0 = q + (16 * z2 + 2 * y2) * 2
            w00 = (np.int64(data[r0]) << 8) | np.int64(data[r0 + 1])
            w01 = (np.int64(data[r0 + 2]) << 8) | np.int64(data[r0 + 3])
            w10 = (np.int64(data[r0 + 16]) << 8) | np.int64(data[r0 + 17])
            w11 = (np.int64(data[r0 + 18]) << 8) | np.int64(data[r0 + 19])
            if c == 3 and ((w00 & (w00 >> 1)) | (w01 & (w01 >> 1)) | (w10 & (w10 >> 1)) | (w11 & (w11 >> 1))) \
                    & 0x5555:
                ok = False  # a value 3 selects no label
            k = (z2 * 4 + y2) * 4
            if ident:
                for x2 in range(4):
                    sh = 12 - 4 * x2
                    key = (((w00 >> sh) & 15) << 12) | (((w01 >> sh) & 15) << 8) | (((w10 >> sh) & 15) << 4) | \
                        ((w11 >> sh) & 15)
                    qv[k + x2] = min(np.int64(win[ex, key]), c)
            else:
                for x2 in range(4):
                    sh = 12 - 4 * x2
                    key = (remap[(w00 >> sh) & 15] << 12) | (remap[(w01 >> sh) & 15] << 8) | \
                        (remap[(w10 >> sh) & 15] << 4) | remap[(w11 >> sh) & 15]
                    qv[k + x2] = rep[min(np.int64(win[ex, key]), 4)]
    return ok


@numba.njit(nogil=True, cache=True)
def _words(data, q, b, labs, excl0, c, qv, vals, ls):  # type: ignore[no-untyped-def]
    """A whole sub-block of 2..7 bits: each cell's winner into ``qv`` (a cell is homogeneous when
    its row fields and x neighbours agree: one word compare for four cells); False on a value >= c."""
    mask = (np.int64(1) << b) - 1
    pair = (np.int64(1) << (2 * b)) - 1
    odd = np.int64(0)  # the fields of odd x
    for x in range(1, 8, 2):
        odd |= mask << (b * (7 - x))
    ok = True
    for z2 in range(4):
        for y2 in range(4):
            r0 = q + (16 * z2 + 2 * y2) * b
            w00 = row_word(data, r0, b)
            w01 = row_word(data, r0 + b, b)
            w10 = row_word(data, r0 + 8 * b, b)
            w11 = row_word(data, r0 + 9 * b, b)
            h = (w00 ^ w01) | (w00 ^ w10) | (w00 ^ w11) | ((w00 ^ (w00 >> b)) & odd)
            for x2 in range(4):
                sh = b * (6 - 2 * x2)
                k = (z2 * 4 + y2) * 4 + x2
                if (h >> sh) & pair == 0:
                    v = (w00 >> (sh + b)) & mask
                    if v >= c:
                        ok = False
                        v = 0
                    qv[k] = v
                else:
                    n = 0
                    for w in (w00, w01, w10, w11):
                        for dx in range(2):
                            v = (w >> (sh + b * (1 - dx))) & mask
                            if v >= c:
                                ok = False
                                v = 0
                            vals[n] = v
                            n += 1
                    # vals in order (z, y) rows then x: the order does not change the winner
                    qv[k] = _vote(vals, labs, excl0, c, ls)
    return ok


@numba.njit(nogil=True, cache=True)
def _general(data, q, b, labs, excl0, c, nvx, nvy, nvz, qv, vals, valid, ls):  # type: ignore[no-untyped-def]
    """Any sub-block (0..9 bits), cropped to nv* voxels per axis: winners into ``qv``; False on a
    value >= c."""
    ok = True
    crop = nvx < 8 or nvy < 8 or nvz < 8
    for z2 in range(4):
        for y2 in range(4):
            for x2 in range(4):
                n = 0
                for dz in range(2):
                    z = 2 * z2 + dz
                    for dy in range(2):
                        y = 2 * y2 + dy
                        for dx in range(2):
                            x = 2 * x2 + dx
                            v = np.int64(0)
                            if b > 0:
                                v = _value(data, q, b, 64 * z + 8 * y + x)
                                if v >= c:
                                    ok = False
                                    v = 0
                            vals[n] = v
                            valid[n] = x < nvx and y < nvy and z < nvz
                            n += 1
                k = (z2 * 4 + y2) * 4 + x2
                if crop:
                    qv[k] = _vote_valid(vals, valid, labs, excl0, c)
                else:
                    qv[k] = _vote(vals, labs, excl0, c, ls)
    return ok


@numba.njit(nogil=True, cache=True, inline="always")
def _find_sorted(arr, n, v):  # type: ignore[no-untyped-def]
    lo = 0
    hi = n
    while lo < hi:
        mid = (lo + hi) >> 1
        if arr[mid] < v:
            lo = mid + 1
        else:
            hi = mid
    return lo


@numba.njit(nogil=True, cache=True, inline="always")
def _insert_sorted(arr, n, v):  # type: ignore[no-untyped-def]
    # insert v into the sorted arr[:n] unless present; returns the new length
    lo = _find_sorted(arr, n, v)
    if lo < n and arr[lo] == v:
        return n
    for j in range(n, lo, -1):
        arr[j] = arr[j - 1]
    arr[lo] = v
    return n + 1


@numba.njit(nogil=True, cache=True)
def _down_kernel(data, spans, method, limit):  # type: ignore[no-untyped-def]
    """Downsample the children ``data[spans[2i]:spans[2i+1]]`` (start < 0: absent) into one block:
    (code, a, b, child, bytes), no bytes without children; ``limit``: see `downsample_block`."""
    zero = np.int64(0)
    info = np.zeros((8, 4), np.int64)
    code, ea, eb, child, gx, gy, gz = _validate(data, spans, info)
    if code != E_OK:
        return code, ea, eb, child, _EMPTY
    if gx < 0:
        return E_OK, zero, zero, zero, _EMPTY
    excl0 = method == _DVID
    nsub = gx * gy * gz
    hx, hy, hz = gx // 2, gy // 2, gz // 2
    lim_x, lim_y, lim_z = limit[0], limit[1], limit[2]

    # per child: a solid label (absent: 0; nlab 1: its label), or its sub-block tables
    solid = np.ones(8, np.bool_)
    clab = np.zeros(8, np.uint64)
    sstart = np.zeros((8, nsub), np.int64)  # byte offset of the sub-block's label indices
    sval = np.zeros((8, nsub), np.int64)  # byte offset of its packed values
    scnt = np.zeros((8, nsub), np.int64)
    maxlab = 1
    for i in range(8):
        s = spans[2 * i]
        if s < 0:
            continue
        nlab = info[i, 0]
        maxlab += nlab
        if nlab == 1:
            clab[i] = read_u64(data, s + 16)
            continue
        solid[i] = False
        p_nsb = info[i, 1]
        st = info[i, 2]
        q = info[i, 3]
        for sb in range(nsub):
            c = read_u16(data, p_nsb + 2 * sb)
            scnt[i, sb] = c
            sstart[i, sb] = st
            sval[i, sb] = q
            st += 4 * c
            q += 64 * BITS[c]

    # output: block label list (hash: label -> index, first appearance), counts, indices, values
    logcap = 4
    while (1 << logcap) < 2 * maxlab:
        logcap += 1
    hkeys = np.zeros(1 << logcap, np.uint64)
    hslot = np.full(1 << logcap, -1, np.int64)
    hmask = (1 << logcap) - 1
    olabels = np.empty(maxlab, np.uint64)
    nout = 0
    onsb = np.empty(nsub, np.int64)
    oidx = np.empty(nsub * 8, np.int64)  # grows
    nidx = 0
    ovals = np.empty(nsub * 576, np.uint8)
    nval = 0

    # per output sub-block workspace
    qsolid = np.zeros(8, np.bool_)
    qlab = np.zeros(8, np.uint64)
    qc = np.zeros(8, np.int64)
    qlabs = np.zeros((8, 513), np.uint64)  # local labels; [c] = 0 (nothing voted)
    qv = np.zeros((8, 64), np.int16)
    qmap = np.zeros((8, 513), np.int16)
    hw = np.zeros((8, 16), np.int64)
    qused = np.zeros(8, np.uint64)
    used = np.zeros(513, np.bool_)
    sbl = np.zeros(512, np.uint64)  # the output sub-block's labels, sorted
    ov = np.zeros(512, np.int64)
    vals = np.zeros(8, np.int64)
    valid = np.zeros(8, np.bool_)
    ls = np.zeros(8, np.uint64)
    bad = False

    for osz in range(gz):
        cz = 1 if osz >= hz else 0
        lz = osz - cz * hz
        for osy in range(gy):
            cy = 1 if osy >= hy else 0
            ly = osy - cy * hy
            for osx in range(gx):
                cx = 1 if osx >= hx else 0
                lx = osx - cx * hx
                i = cz * 4 + cy * 2 + cx
                for q in range(8):
                    dz = q >> 2
                    dy = (q >> 1) & 1
                    dx = q & 1
                    sb = ((2 * lz + dz) * gy + (2 * ly + dy)) * gx + (2 * lx + dx)
                    # voxels of this input sub-block inside the volume, per axis
                    nvx = min(max(lim_x - (cx * 8 * gx + 8 * (2 * lx + dx)), 0), 8)
                    nvy = min(max(lim_y - (cy * 8 * gy + 8 * (2 * ly + dy)), 0), 8)
                    nvz = min(max(lim_z - (cz * 8 * gz + 8 * (2 * lz + dz)), 0), 8)
                    if solid[i]:
                        c = np.int64(1)
                        lab0 = clab[i]
                    else:
                        c = scnt[i, sb]
                        lab0 = np.uint64(0)
                        if c >= 1:
                            lab0 = read_u64(data, spans[2 * i] + 16 + 8 * read_u32(data, sstart[i, sb]))
                    b = BITS[c]
                    if nvx == 0 or nvy == 0 or nvz == 0:  # wholly outside: nothing votes
                        qsolid[q] = True
                        qlab[q] = 0
                        if b > 0 and c != (1 << b):  # its values are checked all the same
                            for k in range(512):
                                if _value(data, sval[i, sb], b, k) >= c:
                                    bad = True
                        continue
                    full = nvx == 8 and nvy == 8 and nvz == 8
                    if c <= 1 and full:
                        qsolid[q] = True
                        qlab[q] = lab0
                        continue
                    # local labels
                    if solid[i]:
                        qlabs[q, 0] = lab0
                    else:
                        st = sstart[i, sb]
                        base = spans[2 * i] + 16
                        for k in range(c):
                            qlabs[q, k] = read_u64(data, base + 8 * read_u32(data, st + 4 * k))
                    qlabs[q, c] = 0
                    qc[q] = c
                    qsolid[q] = False
                    qrow = qv[q]
                    if b == 1 and full:
                        la = qlabs[q, 0]
                        lb = qlabs[q, 1]
                        if la == lb:
                            thr = 9
                        elif excl0 and la == 0:
                            thr = 1
                        elif excl0 and lb == 0:
                            thr = 8
                        elif lb < la:
                            thr = 4
                        else:
                            thr = 5
                        any0, any1 = _bits1(data, sval[i, sb], thr, qrow)
                        qused[q] = np.uint64(3)
                        if not any1:
                            qsolid[q] = True
                            qlab[q] = la
                        elif not any0:
                            qsolid[q] = True
                            qlab[q] = lb
                        continue
                    if b == 2 and full:
                        ok = _bits2(data, sval[i, sb], qlabs[q], excl0, c, qrow, _WIN2)
                    elif 3 <= b <= 7 and full:
                        ok = _words(data, sval[i, sb], b, qlabs[q], excl0, c, qrow, vals, ls)
                    else:
                        ok = _general(data, sval[i, sb], b, qlabs[q], excl0, c, nvx, nvy, nvz, qrow,
                                      vals, valid, ls)
                    if not ok:
                        bad = True
                    if c < 63:  # the local labels that won a cell, as bits
                        m = np.uint64(0)
                        for k in range(64):
                            m |= np.uint64(1) << np.uint64(qrow[k])
                        qused[q] = m
                        if m & (m - np.uint64(1)) == 0:  # one label won every cell
                            qsolid[q] = True
                            qlab[q] = qlabs[q, qrow[0]]
                    else:
                        qused[q] = _ALL
                        v0 = qrow[0]
                        same = True
                        for k in range(1, 64):
                            if qrow[k] != v0:
                                same = False
                                break
                        if same:
                            qsolid[q] = True
                            qlab[q] = qlabs[q, v0]

                # the output sub-block: its sorted labels, then its values
                osb = (osz * gy + osy) * gx + osx
                allsame = True
                for q in range(8):
                    if not qsolid[q] or qlab[q] != qlab[0]:
                        allsame = False
                        break
                if allsame:
                    sbl[0] = qlab[0]
                    nl = 1
                else:
                    nl = 0
                    for q in range(8):
                        if qsolid[q]:
                            nl = _insert_sorted(sbl, nl, qlab[q])
                        else:
                            c = qc[q]
                            m = qused[q]
                            if m == _ALL:
                                for k in range(c + 1):
                                    used[k] = False
                                for k in range(64):
                                    used[qv[q, k]] = True
                                for k in range(c + 1):
                                    if used[k]:
                                        nl = _insert_sorted(sbl, nl, qlabs[q, k])
                            else:
                                for k in range(c + 1):
                                    if (m >> np.uint64(k)) & np.uint64(1):
                                        nl = _insert_sorted(sbl, nl, qlabs[q, k])
                if nl > 1:
                    for q in range(8):
                        if qsolid[q]:
                            qmap[q, 0] = _find_sorted(sbl, nl, qlab[q])
                        else:
                            m = qused[q]
                            for k in range(qc[q] + 1):
                                if m == _ALL or (m >> np.uint64(k)) & np.uint64(1):
                                    qmap[q, k] = _find_sorted(sbl, nl, qlabs[q, k])
                    b = BITS[nl]
                    if b <= 7:  # rows of 8 values are b bytes (MSB first): two half rows of 4b bits
                        rep = (np.int64(1) << (4 * b)) - 1
                        rep = rep // ((np.int64(1) << b) - 1)  # 1 in each of 4 fields
                        for q in range(8):  # each quadrant's 16 half rows of 4 values
                            if qsolid[q]:
                                hq = np.int64(qmap[q, 0]) * rep
                                for r in range(16):
                                    hw[q, r] = hq
                            else:
                                for r in range(16):
                                    k = 4 * r
                                    hw[q, r] = (((np.int64(qmap[q, qv[q, k]]) << b | qmap[q, qv[q, k + 1]]) << b
                                                 | qmap[q, qv[q, k + 2]]) << b) | qmap[q, qv[q, k + 3]]
                        hb = 4 * b
                        for z in range(8):
                            for y in range(8):
                                qa = (z >> 2) * 4 + (y >> 2) * 2
                                r = (z & 3) * 4 + (y & 3)
                                w = (hw[qa, r] << hb) | hw[qa + 1, r]
                                if b == 1:
                                    ovals[nval] = np.uint8(w)
                                elif b == 2:
                                    ovals[nval] = np.uint8(w >> 8)
                                    ovals[nval + 1] = np.uint8(w & 255)
                                else:
                                    for j in range(b):
                                        ovals[nval + j] = np.uint8((w >> (8 * (b - 1 - j))) & 255)
                                nval += b
                    else:  # 8 or 9 bits: the voxels, then an MSB-first bit stream of 64*b bytes
                        for z in range(8):
                            for y in range(8):
                                for xh in range(2):
                                    q = (z >> 2) * 4 + (y >> 2) * 2 + xh
                                    o = 64 * z + 8 * y + 4 * xh
                                    kb = ((z & 3) * 4 + (y & 3)) * 4
                                    for x in range(4):
                                        ov[o + x] = qmap[q, 0] if qsolid[q] else qmap[q, qv[q, kb + x]]
                        acc = np.int64(0)
                        nb = 0
                        for k in range(512):
                            acc = (acc << b) | ov[k]
                            nb += b
                            while nb >= 8:
                                nb -= 8
                                ovals[nval] = np.uint8((acc >> nb) & 255)
                                nval += 1
                            acc &= (np.int64(1) << nb) - 1
                # block label list indices of the sub-block's labels
                if nidx + nl > oidx.shape[0]:
                    grown = np.empty(2 * oidx.shape[0] + nl, np.int64)
                    grown[:nidx] = oidx[:nidx]
                    oidx = grown
                for k in range(nl):
                    lab = sbl[k]
                    h = np.int64((lab * _HASH_MUL) >> np.uint64(64 - logcap))
                    while hslot[h] != -1 and hkeys[h] != lab:
                        h = (h + 1) & hmask
                    if hslot[h] == -1:
                        hkeys[h] = lab
                        hslot[h] = nout
                        olabels[nout] = lab
                        nout += 1
                    oidx[nidx] = hslot[h]
                    nidx += 1
                onsb[osb] = nl

    if bad:
        bi, bsb, bc = _first_bad_value(data, spans, info, nsub)
        return E_VAL_RANGE, bsb, bc, bi, _EMPTY

    buf = assemble_block(gx, gy, gz, olabels, nout, onsb, nsub, oidx, nidx, ovals, nval)
    return E_OK, zero, zero, zero, buf


def _down_numpy(data: Any, spans: Any, method: Any, limit: Any) -> Any:
    """``_down_kernel`` in numpy: decode, vote on the whole region (sort each cell's 8 labels, count
    equal pairs), ``encode_block(..., subblock_order="sorted")``."""
    for a, dtype in ((data, np.uint8), (spans, np.int64), (limit, np.int64)):
        if not isinstance(a, np.ndarray) or a.dtype != dtype or a.ndim != 1 or not a.flags.c_contiguous:
            raise TypeError("no matching definition for the downsample kernel's signature")
    if spans.shape[0] < 16 or limit.shape[0] < 3:
        raise ValueError("spans must hold 8 (start, end) pairs and limit 3 values")
    grid = None
    blocks: list[np.ndarray | None] = [None] * 8
    parts = []
    for i in range(8):
        s, e = int(spans[2 * i]), int(spans[2 * i + 1])
        if s < 0:
            continue
        d = data[s:e]
        code, a, b, gx, gy, gz, nlab = head_numpy(d)
        if code:
            return code, a, b, i, _EMPTY
        if grid is None:
            grid = (gx, gy, gz)
        elif (gx, gy, gz) != grid:
            return _E_GRID_MISMATCH, 0, 0, i, _EMPTY
        if gx % 2 or gy % 2 or gz % 2:
            return _E_ODD_GRID, 0, 0, i, _EMPTY
        if nlab > 1:
            code, a, b, nsb, _idx, p_val = body_numpy(d, gx, gy, gz, nlab)
            if code:
                return code, a, b, i, _EMPTY
            parts.append((i, d, nsb, p_val))
        blocks[i] = d
    if grid is None:
        return E_OK, 0, 0, 0, _EMPTY
    for i, d, nsb, p_val in parts:  # the packed values, after every header and body (as the kernel)
        bits = BITS[nsb]
        q = p_val + np.cumsum(64 * bits) - 64 * bits
        first = None
        for _b, sel, vi in values_numpy(d, q, bits):
            bad = sel[(vi >= nsb[sel][:, None]).any(axis=1)]
            if bad.size and (first is None or bad[0] < first):
                first = int(bad[0])
        if first is not None:
            return E_VAL_RANGE, first, int(nsb[first]), i, _EMPTY
    gx, gy, gz = grid
    nz, ny, nx = 8 * gz, 8 * gy, 8 * gx
    region = np.zeros((2 * nz, 2 * ny, 2 * nx), np.uint64)
    for i, d in enumerate(blocks):
        if d is not None:
            z, y, x = i >> 2, (i >> 1) & 1, i & 1
            region[z * nz:(z + 1) * nz, y * ny:(y + 1) * ny, x * nx:(x + 1) * nx] = decode_block(d)
    out = _vote_volume(region, "dvid" if method == _DVID else "mode",
                      limit=(int(limit[0]), int(limit[1]), int(limit[2])))
    return E_OK, 0, 0, 0, np.frombuffer(encode_block(out, subblock_order="sorted"), np.uint8)


def _vote_volume(region: np.ndarray, method: str = "dvid", *, limit: Any = None) -> np.ndarray:
    """The 2x downsampling of an even (z, y, x) volume by ``method``; only voxels below ``limit``
    (x, y, z) vote, a cell where none does is 0."""
    nz, ny, nx = (s // 2 for s in region.shape)
    cells = region.reshape(nz, 2, ny, 2, nx, 2).transpose(0, 2, 4, 1, 3, 5).reshape(-1, 8)
    votes = np.ones(cells.shape, bool)
    if method == "dvid":
        votes &= cells != 0
    if limit is not None:
        zz, yy, xx = np.meshgrid(np.arange(2 * nz) < limit[2], np.arange(2 * ny) < limit[1],
                                 np.arange(2 * nx) < limit[0], indexing="ij")
        inside = (zz & yy & xx).reshape(nz, 2, ny, 2, nx, 2).transpose(0, 2, 4, 1, 3, 5).reshape(-1, 8)
        votes &= inside
    out = np.zeros(cells.shape[0], np.uint64)
    for lo in range(0, cells.shape[0], 1 << 15):  # bounded temporaries
        c = cells[lo:lo + (1 << 15)]
        v = votes[lo:lo + (1 << 15)]
        o = np.argsort(c, axis=1, kind="stable")
        s = np.take_along_axis(c, o, axis=1)
        sv = np.take_along_axis(v, o, axis=1)
        n = ((s[:, :, None] == s[:, None, :]) & sv[:, None, :]).sum(axis=2)
        n[~sv] = 0
        j = np.argmax(n, axis=1)  # the first maximum: the smallest label of the largest count
        win = s[np.arange(s.shape[0]), j]
        win[n.max(axis=1) == 0] = 0
        out[lo:lo + (1 << 15)] = win
    return out.reshape(nz, ny, nx)


_SIG = (
    types.Array(types.uint8, 1, "C", readonly=True),
    types.Array(types.int64, 1, "C", readonly=True),
    types.int64,
    types.Array(types.int64, 1, "C", readonly=True),
)
_down = jit.kernel(_down_kernel, [_SIG], _down_numpy, exclusive=True)


class DownsampledBlock:
    """One output block: ``block`` (uncompressed) and ``supervoxels``, its label list (a view)."""

    __slots__ = ("block", "supervoxels")

    def __init__(self, block: bytes) -> None:
        self.block = block
        n = int.from_bytes(block[12:16], "little")
        self.supervoxels = np.frombuffer(block, "<u8", n, 16).astype(np.uint64, copy=False)

    def __repr__(self) -> str:
        return f"DownsampledBlock({len(self.block)} bytes, {len(self.supervoxels)} labels)"


def region_limit(origin_voxels: Sequence[int], size: Sequence[int], chunk: Sequence[int] = (64, 64, 64)
                 ) -> tuple[int, int, int]:
    """``limit`` for ``mode``: the voxels (x, y, z) of an output block's input region starting at
    ``origin_voxels`` that lie inside a volume of ``size``."""
    return tuple(int(min(max(s - o, 0), 2 * c)) for o, s, c in zip(origin_voxels, size, chunk, strict=True))  # type: ignore[return-value]


def downsample_block(children: Sequence[Any], *, method: str = "dvid", limit: Sequence[int] | None = None,
                     names: Sequence[str] | None = None) -> DownsampledBlock | None:
    """Downsample the 8 child blocks of one output block (see the module docstring).

    ``children``: uncompressed blocks of the scale below in octant order ``4*dz + 2*dy + dx``
    (None: all 0); ``method`` ``"dvid"`` or ``"mode"``; ``limit`` the input voxels (x, y, z) of the
    region inside the volume (`region_limit`), the only ones voting with ``"mode"`` (default: the
    whole region); ``names`` how errors name each child. None when every output voxel is 0;
    BlockDecodeError when a child is malformed or the children's grids differ or are odd.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if len(children) != 8:
        raise ValueError(f"expected 8 children (2x2x2 blocks), got {len(children)}")
    arrays = [None if c is None else as_u8(c) for c in children]
    spans = np.full(16, -1, np.int64)
    pos = 0
    for i, a in enumerate(arrays):
        if a is not None:
            spans[2 * i] = pos
            pos += a.shape[0]
            spans[2 * i + 1] = pos
    data = np.concatenate([a for a in arrays if a is not None]) if pos else _EMPTY
    if method == "dvid" or limit is None:
        lim = np.full(3, 1 << 40, np.int64)
    else:
        lim = np.array([int(v) for v in limit], np.int64)
        if lim.shape != (3,) or (lim < 0).any():
            raise ValueError(f"limit must be 3 non-negative voxel counts (x, y, z), got {limit!r}")
    code, a, b, child, buf = _down(data, spans, _DVID if method == "dvid" else _MODE, lim)
    if code:
        child = int(child)
        name = names[child] if names is not None else f"child {(child & 1, (child >> 1) & 1, child >> 2)}"
        d = arrays[child]
        assert d is not None
        if code == _E_GRID_MISMATCH:
            first = next(j for j, x in enumerate(arrays) if x is not None)
            raise BlockDecodeError(f"{name}: its sub-block grid {tuple(np.frombuffer(d[:12].tobytes(), '<u4'))} "
                                   f"differs from {tuple(np.frombuffer(arrays[first][:12].tobytes(), '<u4'))} "  # type: ignore[index]
                                   "of the other children")
        if code == _E_ODD_GRID:
            raise BlockDecodeError(f"{name}: its sub-block grid {tuple(np.frombuffer(d[:12].tobytes(), '<u4'))} "
                                   "is odd along an axis: it cannot be halved")
        raise BlockDecodeError(f"{name}: {block_error(int(code), int(a), int(b), d, None)}")
    if buf.shape[0] == 0:
        return None
    if buf.shape[0] == 24 and int.from_bytes(buf[12:16].tobytes(), "little") == 1 and not buf[16:24].any():
        return None
    return DownsampledBlock(buf.tobytes())
