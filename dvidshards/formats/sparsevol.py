"""DVID's binary sparse volumes: the RLEs of ``GET .../sparsevol/<label>`` and ``-coarse``.

Layout (``labelmap.go`` help text; ``getLegacyRLEs``, ``GetSparseCoarseVol``), little endian:
``u8`` descriptor 0, ``u8`` dimensions 3, ``u8`` run dimension 0 (x), ``u8`` 0, ``u32`` voxels
(DVID writes 0, "TODO"), ``u32`` spans n, then n x ``i32 x, y, z, length``. ``-coarse`` has the
same header and runs of block coordinates (the label index's blocks sorted (z, y, x), x merged).
``format=srles`` is the spans alone.

DVID's order (``labels.WriteRLEs``, ``datatype/common/labels/compressed.go``): blocks in sorted
``IZYXString`` order (z, y, x; negatives first), rows z then y inside a block, a run written
when it ends; a run reaching the block's +x face is held per (y, z) and continued into the
x-successor block, so runs are maximal along x. Held runs whose successor holds none of the
body are written when the next block starts, from a Go map: in random order (`RunOrder` writes
them sorted by (z, y), otherwise DVID's order exactly). Under ``minx`` .. ``maxz`` bounds a run
reaching ``maxx`` is held like one reaching the +x face.

``format=blocks`` (``labels.WriteBinaryBlocks``): ``u32 gx, gy, gz`` (sub-blocks per axis),
``u64 label``, then per block ``i32 x, y, z`` (first voxel) and a content byte (0 background, 1
all the body, 2 both), for 2 followed by per 8³ sub-block (z, y, x) a content byte and for 2 a
64-byte mask, x fastest then y then z, least significant bit first.

A server reads a block's voxels as bits straight from its packed values (`block_bits`), runs
from them (`RunOrder.add_bits`) and ``format=blocks`` (`binary_block_bits`); `entries_at` reads
the labels at points. Runs are ``int32`` (n, 4): x, y, z, length.
"""

from __future__ import annotations

import struct
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic
from numpy.typing import ArrayLike

from ..errors import BlockDecodeError, DvidShardsError
from . import jit
from .blocklayout import (
    BITS,
    E_OK,
    E_PALETTE,
    E_VAL_RANGE,
    MAX_SUBBLOCK_LABELS,
    BytesLike,
    block_error,
    body_numpy,
    check_body,
    check_head,
    head_numpy,
    read_u16,
    read_u32,
)
from .codec import decode_kernel

__all__ = [
    "BLOCKS_HEADER",
    "HEADER",
    "RunOrder",
    "SparsevolError",
    "binary_block",
    "binary_block_bits",
    "block_bits",
    "clip_runs",
    "coarse_runs",
    "encode_coarse",
    "entries_at",
    "merge_runs",
    "runs_from_mask",
]

HEADER = struct.Struct("<BBBBII")  # descriptor, ndim, run dim, reserved, voxels, spans
BLOCKS_HEADER = struct.Struct("<IIIQ")  # format=blocks: sub-blocks per axis (x, y, z), label
_SUB = 8  # sub-block edge of format=blocks (DVID's SubBlockSize)
_I32 = np.iinfo(np.int32)


class SparsevolError(DvidShardsError, ValueError):
    """Sparse-volume bytes or runs are malformed."""


def _as_runs(runs: ArrayLike, what: str = "runs") -> np.ndarray:
    """Validated (n, 4) int64 copy of runs: integers, lengths >= 1, inside int32."""
    arr = np.asarray(runs)
    if arr.size == 0:
        return np.zeros((0, 4), np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise SparsevolError(f"{what} must be integers, got dtype {arr.dtype}")
    if arr.ndim != 2 or arr.shape[1] != 4:
        raise SparsevolError(f"{what} must have shape (n, 4) (x, y, z, length), got {arr.shape}")
    if arr.dtype == np.uint64 and int(arr.max()) > _I32.max:
        raise SparsevolError(f"{what} out of int32 range")
    a = arr.astype(np.int64)
    if a.min() < _I32.min or a.max() > _I32.max:
        raise SparsevolError(f"{what} out of int32 range")
    if (a[:, 3] < 1).any():
        raise SparsevolError(f"{what} have a length < 1")
    if (a[:, 0] + a[:, 3] - 1 > _I32.max).any():
        raise SparsevolError(f"{what} end past the int32 range")
    return a


def merge_runs(*run_arrays: ArrayLike) -> np.ndarray:
    """Union of runs (x, y, z, length; any order, overlapping or cut at chunk faces) as maximal
    x-runs sorted by (z, y, x), int32 (m, 4); SparsevolError when a run array is malformed."""
    parts = [_as_runs(r) for r in run_arrays]
    a = np.concatenate(parts) if parts else np.zeros((0, 4), np.int64)
    if not len(a):
        return np.zeros((0, 4), np.int32)
    a = a[np.lexsort((a[:, 0], a[:, 1], a[:, 2]))]
    x, end = a[:, 0], a[:, 0] + a[:, 3]
    new_row = np.ones(len(a), bool)
    new_row[1:] = (a[1:, 1] != a[:-1, 1]) | (a[1:, 2] != a[:-1, 2])
    row = np.cumsum(new_row) - 1
    # running max of run ends within a row: offset each row above every end of earlier rows
    shifted = (row << 33) + (end - _I32.min)
    reach = np.maximum.accumulate(shifted) - (row << 33) + _I32.min
    start = new_row.copy()
    start[1:] |= x[1:] > reach[:-1]  # a gap after everything before it in the row
    first = np.flatnonzero(start)
    last = np.append(first[1:], len(a)) - 1
    out = np.empty((len(first), 4), np.int64)
    out[:, :3] = a[first, :3]
    out[:, 3] = reach[last] - x[first]
    return out.astype(np.int32)


def runs_from_mask(mask_xyz: ArrayLike, offset: ArrayLike = (0, 0, 0)) -> np.ndarray:
    """Maximal x-runs (int32 (n, 4), sorted by (z, y, x)) of a bool ``[x, y, z]`` mask whose first
    voxel is at ``offset``; SparsevolError unless 3-d and inside int32."""
    m = np.asarray(mask_xyz)
    if m.ndim != 3:
        raise SparsevolError(f"mask must be 3-d (x, y, z), got shape {m.shape}")
    off = np.asarray(offset, np.int64).reshape(-1)
    if off.shape != (3,):
        raise SparsevolError(f"offset must be 3 integers, got {offset!r}")
    zyx = np.ascontiguousarray(m.astype(bool, copy=False).transpose(2, 1, 0))
    nz, ny, nx = zyx.shape
    padded = np.zeros((nz * ny, nx + 2), np.int8)
    padded[:, 1:-1] = zyx.reshape(nz * ny, nx)
    step = np.diff(padded, axis=1).ravel()  # +1 at a run's first voxel, -1 one past its last
    at = np.flatnonzero(step)  # one pass; in C order the k-th end follows the k-th start
    kind = step[at]
    first, last = at[kind == 1], at[kind == -1]
    row, x0 = np.divmod(first, nx + 1)
    runs = np.stack([x0 + off[0], row % ny + off[1], row // ny + off[2], last - first], axis=1)
    return _as_runs(runs).astype(np.int32) if len(runs) else np.zeros((0, 4), np.int32)


def coarse_runs(blocks: ArrayLike) -> np.ndarray:
    """``sparsevol-coarse`` runs of block coordinates (n, 3) (duplicates ok): sorted (z, y, x),
    consecutive x merged."""
    b = np.asarray(blocks)
    if b.size == 0:
        return np.zeros((0, 4), np.int32)
    if not np.issubdtype(b.dtype, np.integer) or b.ndim != 2 or b.shape[1] != 3:
        raise SparsevolError(f"blocks must be integers of shape (n, 3), got {b.dtype} {b.shape}")
    ones = np.ones((len(b), 1), np.int64)
    return merge_runs(np.concatenate([b.astype(np.int64), ones], axis=1))


def encode_coarse(blocks: ArrayLike) -> bytes:
    """``GET .../sparsevol-coarse/<label>`` bytes of a body's blocks (x, y, z; its label index)."""
    runs = coarse_runs(blocks)
    return HEADER.pack(0, 3, 0, 0, 0, len(runs)) + runs.astype("<i4").tobytes()


def clip_runs(runs: ArrayLike, lo: ArrayLike, hi: ArrayLike) -> np.ndarray:
    """The parts of runs inside DVID's ``minx`` .. ``maxz`` bounds (inclusive), in their order."""
    a = _as_runs(runs)
    lo_, hi_ = np.asarray(lo, np.int64).reshape(3), np.asarray(hi, np.int64).reshape(3)
    keep = (a[:, 1] >= lo_[1]) & (a[:, 1] <= hi_[1]) & (a[:, 2] >= lo_[2]) & (a[:, 2] <= hi_[2])
    a = a[keep]
    x0 = np.maximum(a[:, 0], lo_[0])
    x1 = np.minimum(a[:, 0] + a[:, 3] - 1, hi_[0])
    ok = x1 >= x0
    out: np.ndarray = a[ok].copy()
    out[:, 0] = x0[ok]
    out[:, 3] = x1[ok] - x0[ok] + 1
    return out.astype(np.int32)


def _merge_held(a: np.ndarray, held: np.ndarray, flush: bool, x0: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """One block's step of `RunOrder` in numpy: (runs written now, runs held). ``a``: the block's
    maximal runs; ``held``: those held from the block before, sorted (z, y); ``flush``: that block
    was not this one's x-predecessor."""
    out = []
    if flush and len(held):
        out.append(held)
        held = held[:0]
    if len(held):
        first = a[a[:, 0] == x0]  # runs starting at the block's -x face continue a held run
        hk = held[:, 1] + (held[:, 2] << 32)
        fk = first[:, 1] + (first[:, 2] << 32)
        cont = np.isin(hk, fk)
        if cont.any():
            order = np.argsort(fk)
            pos = order[np.searchsorted(fk, hk[cont], sorter=order)]
            joined = held[cont].copy()
            joined[:, 3] += first[pos, 3]
            a = np.concatenate([a[~np.isin(np.arange(len(a)), np.flatnonzero(a[:, 0] == x0)[pos])], joined])
        a = np.concatenate([a, held[~cont]])  # not continued: written at its row's start here
    hold = a[:, 0] + a[:, 3] == stop
    done, kept = a[~hold], a[hold]
    out.append(done[np.lexsort((done[:, 0], done[:, 1], done[:, 2]))])
    return np.concatenate(out), kept[np.lexsort((kept[:, 1], kept[:, 2]))]


@numba.njit(nogil=True, cache=True, inline="always")
def _put(x, y, z, n, stop, out, no, held, nh):  # type: ignore[no-untyped-def]
    # one run, final (out) or held for the next block (it ends where the row scan stops)
    if x + n == stop:
        held[nh, 0], held[nh, 1], held[nh, 2], held[nh, 3] = x, y, z, n
        return no, nh + 1
    out[no, 0], out[no, 1], out[no, 2], out[no, 3] = x, y, z, n
    return no + 1, nh


@intrinsic
def _ctz(typingctx, x):  # type: ignore[no-untyped-def]
    sig = types.int64(types.int64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.cttz(args[0], ir.Constant(ir.IntType(1), 1))

    return sig, codegen


@numba.njit(nogil=True, cache=True, inline="always")
def _run(pend, hx, hn, a, e, x0, yy, zz, stop, out, no, held, nh):  # type: ignore[no-untyped-def]
    # the row's next run [a, e), after the held run of the row (pending until a run or the row's end)
    if pend and a == x0:  # continues the held run
        return _put(hx, yy, zz, hn + e - a, stop, out, no, held, nh)
    if pend:
        no, nh = _put(hx, yy, zz, hn, stop, out, no, held, nh)
    return _put(a, yy, zz, e - a, stop, out, no, held, nh)


@numba.njit(nogil=True, cache=True)
def _order_kernel(words, nx, org, stop, blo, bhi, held, flush, out, held_out):  # type: ignore[no-untyped-def]
    """`_merge_held` of a block's runs read from its member bits as 64-bit words (``words[z, y, k]``
    bit p is voxel 64 k + p; a word's changes give its runs), cut to [blo, bhi]."""
    nz, ny, nw = words.shape
    x0, y0, z0 = org[0], org[1], org[2]
    no = np.int64(0)
    nh = np.int64(0)
    nheld = held.shape[0]
    hp = np.int64(0)
    if flush:
        for k in range(nheld):
            for i in range(4):
                out[no, i] = held[k, i]
            no += 1
        hp = nheld
    xlo = max(blo[0], x0)
    xhi = min(bhi[0] + 1, x0 + nx)
    for z in range(nz):
        zz = z0 + z
        for y in range(ny):
            yy = y0 + y
            # held runs of rows before this one (none when fed in order) are written first
            while hp < nheld and (held[hp, 2] < zz or (held[hp, 2] == zz and held[hp, 1] < yy)):
                no, nh = _put(held[hp, 0], held[hp, 1], held[hp, 2], held[hp, 3], stop, out, no, held_out, nh)
                hp += 1
            pend = hp < nheld and held[hp, 2] == zz and held[hp, 1] == yy
            hx = held[hp, 0] if pend else 0
            hn = held[hp, 3] if pend else 0
            if pend:
                hp += 1
            if blo[1] <= yy <= bhi[1] and blo[2] <= zz <= bhi[2] and xlo < xhi:
                inrun = np.int64(0)
                start = np.int64(0)
                for k in range(nw):
                    w = words[z, y, k]
                    if w == 0 and inrun == 0:
                        continue
                    trans = w ^ ((w << 1) | inrun)  # bit p: voxel p differs from voxel p - 1
                    while trans != 0:
                        p = np.int64(_ctz(trans))  # type: ignore[call-arg]
                        trans ^= np.int64(1) << p
                        x = x0 + 64 * k + p
                        if inrun == 0:
                            start = x
                            inrun = 1
                            continue
                        inrun = 0
                        ra, re = max(start, xlo), min(x, xhi)  # the run [start, x), cut to the bounds
                        if re > ra:
                            no, nh = _run(pend, hx, hn, ra, re, x0, yy, zz, stop, out, no, held_out, nh)
                            pend = False
                    inrun = (w >> 63) & 1
                if inrun:
                    ra, re = max(start, xlo), min(x0 + 64 * nw, xhi)
                    if re > ra:
                        no, nh = _run(pend, hx, hn, ra, re, x0, yy, zz, stop, out, no, held_out, nh)
                        pend = False
            if pend:
                no, nh = _put(hx, yy, zz, hn, stop, out, no, held_out, nh)
    while hp < nheld:
        no, nh = _put(held[hp, 0], held[hp, 1], held[hp, 2], held[hp, 3], stop, out, no, held_out, nh)
        hp += 1
    return no, nh


def _order_numpy(words: np.ndarray, nx: int, org: np.ndarray, stop: int, blo: np.ndarray, bhi: np.ndarray,
                 held: np.ndarray, flush: bool, out: np.ndarray, held_out: np.ndarray) -> tuple[int, int]:
    mask = np.unpackbits(words.view(np.uint8), axis=2, bitorder="little").astype(bool)[:, :, :nx]
    runs = clip_runs(runs_from_mask(mask.transpose(2, 1, 0), org), blo, bhi).astype(np.int64)
    done, kept = _merge_held(runs, held, bool(flush), int(org[0]), int(stop))
    out[:len(done)] = done
    held_out[:len(kept)] = kept
    return len(done), len(kept)


_ORDER_SIG = types.UniTuple(types.int64, 2)(  # type: ignore[no-untyped-call]
    types.Array(types.int64, 3, "C", readonly=True), types.int64, types.Array(types.int64, 1, "C", readonly=True), types.int64,
    types.Array(types.int64, 1, "C", readonly=True), types.Array(types.int64, 1, "C", readonly=True),
    types.Array(types.int64, 2, "C", readonly=True), types.boolean, types.Array(types.int32, 2, "C"),
    types.Array(types.int64, 2, "C"))
_order = jit.kernel(_order_kernel, [_ORDER_SIG.args], _order_numpy, exclusive=True)


class RunOrder:
    """DVID's sparsevol run order, block by block (``labels.WriteRLEs``).

    Feed the blocks holding the body in ascending (z, y, x) order with their runs (`add`) or member
    bits (`add_bits`, cut to ``bounds``: DVID's inclusive ``minx`` .. ``maxz``); each call returns
    the runs now final, `finish` the rest. A run reaching ``maxx`` (default ``bounds``' maxx) is
    held like one reaching the +x face. Memory: one held run per (y, z) row of a block.
    """

    def __init__(self, block_size: int = 64, maxx: int | None = None, *,
                 bounds: tuple[ArrayLike, ArrayLike] | None = None) -> None:
        if not isinstance(block_size, (int, np.integer)) or block_size < 1:
            raise SparsevolError(f"block_size must be a positive integer, got {block_size!r}")
        self.b = int(block_size)
        lo, hi = (np.full(3, _I32.min, np.int64), np.full(3, _I32.max, np.int64)) if bounds is None else \
            (np.asarray(bounds[0], np.int64).reshape(3), np.asarray(bounds[1], np.int64).reshape(3))
        self.bounds = (lo, hi)
        if maxx is None and hi[0] < _I32.max:
            maxx = int(hi[0])
        self.maxx = None if maxx is None else int(maxx)
        self._prev: tuple[int, int, int] | None = None
        self._held = np.zeros((0, 4), np.int64)
        self._out: np.ndarray | None = None

    def _next(self, block: ArrayLike) -> tuple[int, int, int, bool, int]:
        """(bx, by, bz, flush, stop) of the next block; SparsevolError out of order."""
        bx, by, bz = (int(v) for v in np.asarray(block).reshape(3))
        prev = self._prev
        if prev is not None and (bz, by, bx) <= prev[::-1]:
            raise SparsevolError(f"block {(bx, by, bz)} after {prev}: blocks must come in (z, y, x) order")
        self._prev = (bx, by, bz)
        x0 = bx * self.b
        stop = x0 + self.b if self.maxx is None else min(x0 + self.b, self.maxx + 1)
        return bx, by, bz, prev is not None and prev != (bx - 1, by, bz), stop

    def add(self, block: ArrayLike, runs: ArrayLike) -> np.ndarray:
        """The runs made final by one more block (int32 (n, 4)); SparsevolError when blocks come out
        of (z, y, x) order or a run leaves its block."""
        b = self.b
        a = merge_runs(runs).astype(np.int64)
        bx, by, bz = (int(v) for v in np.asarray(block).reshape(3))
        x0 = bx * b
        if len(a) and ((a[:, 0] < x0) | (a[:, 0] + a[:, 3] > x0 + b) | (a[:, 1] // b != by)
                       | (a[:, 2] // b != bz)).any():
            raise SparsevolError(f"a run is not inside block {(bx, by, bz)}")
        _, _, _, flush, stop = self._next(block)
        done, self._held = _merge_held(a, self._held, flush, x0, stop)
        return done.astype(np.int32)

    def add_bits(self, block: ArrayLike, bits: ArrayLike) -> np.ndarray:
        """`add` for a block given as its member bits (`block_bits`, (b, b, b / 8) uint8)."""
        b = self.b
        bits = np.asarray(bits)
        if bits.dtype != np.uint8 or bits.shape != (b, b, b // 8) or b % 8:
            raise SparsevolError(f"bits must be uint8 of shape {(b, b, b // 8)} for {b}-voxel blocks, got "
                                 f"{bits.dtype} {bits.shape}")
        bx, by, bz, flush, stop = self._next(block)
        cap = len(self._held) + b * b * (b // 2 + 1)
        out = self._out
        if out is None or len(out) < cap:
            out = self._out = np.empty((cap, 4), np.int32)
        held = np.empty((b * b + len(self._held), 4), np.int64)
        org = np.array([bx * b, by * b, bz * b], np.int64)
        lo, hi = self.bounds
        words = bits if b % 64 == 0 else np.pad(bits, ((0, 0), (0, 0), (0, -(b // 8) % 8)))
        n, nh = _order(np.ascontiguousarray(words).view(np.int64), b, org, stop, lo, hi, self._held, flush, out, held)
        self._held = held[:nh]
        done: np.ndarray = out[:n].copy()
        return done

    def finish(self) -> np.ndarray:
        """The runs still held after the last block."""
        self._prev = None
        h, self._held = self._held, np.zeros((0, 4), np.int64)
        return h.astype(np.int32)  # DVID: Go map order; here (z, y)


_E_SHAPE = 100  # the block's grid is not the shape of the bits asked for


_REV8 = np.array([int(f"{i:08b}"[::-1], 2) for i in range(256)], np.int64)  # bits of a byte reversed


@numba.njit(nogil=True, cache=True, inline="always")
def _lanes(m):  # type: ignore[no-untyped-def]
    # the low bits of 8 2-bit lanes (lane k at bit 2 k) gathered into bits 0..7
    m = (m | (m >> 1)) & 0x3333
    m = (m | (m >> 2)) & 0x0F0F
    return (m | (m >> 4)) & 0x00FF


@numba.njit(nogil=True, cache=True, inline="always")
def _value(data, r, w, b, x):  # type: ignore[no-untyped-def]
    # value x of a row of 8 MSB-first values of b bits starting at byte r (w: its first bytes)
    if b <= 8:
        return (w >> (b * (7 - x))) & ((np.int64(1) << b) - 1)
    if x < 7:
        return (w >> (55 - 9 * x)) & 511
    return ((w & 1) << 8) | np.int64(data[r + 8])


@numba.njit(nogil=True, cache=True)
def _bits_kernel(data, member, lo, hi, bits):  # type: ignore[no-untyped-def]
    """Validate the block, then set bit i of ``bits[z, y, j]`` where voxel (8 j + i, y, z) is a
    label-list entry ``member`` marks, inside [lo, hi) (voxels past hi not read); (code, a, b)."""
    zero = np.int64(0)
    code, ea, eb, gx, gy, gz, nlab = check_head(data)
    if code != E_OK:
        return code, ea, eb
    if np.int64(member.shape[0]) != nlab:
        return E_PALETTE, np.int64(member.shape[0]), nlab
    if bits.shape[0] != 8 * gz or bits.shape[1] != 8 * gy or bits.shape[2] != gx:
        return _E_SHAPE, zero, zero
    bits[:] = 0
    hx, hy, hz = hi[0], hi[1], hi[2]
    p_nsb = p_idx = p_val = zero
    if nlab > 1:
        code, ea, eb, p_nsb, p_idx, p_val = check_body(data, gx, gy, gz, nlab)
        if code != E_OK:
            return code, ea, eb
    lut = np.zeros(MAX_SUBBLOCK_LABELS, np.int64)
    start = p_idx
    q = p_val
    sb = zero
    for sz in range(gz):
        zl = min(8, hz - 8 * sz)
        for sy in range(gy):
            yl = min(8, hy - 8 * sy)
            for sx in range(gx):
                xl = min(8, hx - 8 * sx)
                xm = (np.int64(1) << max(xl, 0)) - 1
                c = np.int64(1) if nlab == 1 else read_u16(data, p_nsb + 2 * sb)
                b = BITS[c]
                if zl > 0 and yl > 0 and xl > 0:
                    fill = np.int64(-1)  # every visited voxel: 0 or 255; -1: read the values
                    if c == 0:
                        fill = 0
                    elif c == 1:
                        fill = 255 if member[0 if nlab == 1 else read_u32(data, start)] != 0 else 0
                    else:
                        some = np.int64(0)
                        every = np.int64(1)
                        for k in range(c):
                            m = np.int64(member[read_u32(data, start + 4 * k)] != 0)
                            lut[k] = m
                            some |= m
                            every &= m
                        for k in range(c, 1 << b):
                            lut[k] = 0
                        if c == 1 << b and (some == 0 or every == 1):  # no value can select no label
                            fill = 255 * every
                    if fill == 0:
                        pass
                    elif fill > 0:
                        for z in range(zl):
                            for y in range(yl):
                                bits[8 * sz + z, 8 * sy + y, sx] = xm
                    elif b == 1:  # two labels, one a member: each row's byte, reversed (x first)
                        inv = 255 if lut[0] else 0
                        for z in range(zl):
                            for y in range(yl):
                                bits[8 * sz + z, 8 * sy + y, sx] = (_REV8[data[q + 8 * z + y]] ^ inv) & xm
                    elif b == 2:  # 2-bit lanes compared at once: a lane's high bit moved onto its low one
                        for z in range(zl):
                            for y in range(yl):
                                r = q + 2 * (8 * z + y)
                                w = (np.int64(data[r]) << 8) | np.int64(data[r + 1])
                                h1 = (w >> 1) & 0x5555
                                h0 = w & 0x5555
                                m = (lut[0] * (~(h1 | h0) & 0x5555)) | (lut[1] * (h0 & ~h1)) | (lut[2] * (h1 & ~h0)) \
                                    | (lut[3] * (h1 & h0))
                                if c == 3 and _REV8[_lanes(h1 & h0)] & xm:
                                    return E_VAL_RANGE, sb, c
                                bits[8 * sz + z, 8 * sy + y, sx] = _REV8[_lanes(m)] & xm
                    else:
                        for z in range(zl):
                            for y in range(yl):
                                r = q + (8 * z + y) * b
                                w = np.int64(0)
                                for i in range(min(b, 8)):
                                    w = (w << 8) | np.int64(data[r + i])
                                v8 = np.int64(0)
                                bad = np.int64(0)
                                for x in range(8):
                                    v = _value(data, r, w, b, x)
                                    bad |= np.int64(v >= c) << x
                                    v8 |= lut[v & 511] << x
                                if bad & xm:
                                    return E_VAL_RANGE, sb, c
                                bits[8 * sz + z, 8 * sy + y, sx] = v8 & xm
                if nlab > 1:
                    start += 4 * c
                    q += 64 * b
                sb += 1
    if lo[0] or lo[1] or lo[2]:  # voxels below lo are not the body's
        for z in range(8 * gz):
            for y in range(8 * gy):
                for j in range(gx):
                    if z < lo[2] or y < lo[1]:
                        bits[z, y, j] = 0
                    elif 8 * j < lo[0]:
                        bits[z, y, j] &= (255 << min(lo[0] - 8 * j, 8)) & 255
    return E_OK, zero, zero


def _bits_numpy(data: np.ndarray, member: np.ndarray, lo: np.ndarray, hi: np.ndarray, bits: np.ndarray
                ) -> tuple[int, int, int]:
    """``_bits_kernel`` through the block decoder with a 1/0 member palette."""
    code, ea, eb, gx, gy, gz, nlab = head_numpy(data)
    if code != E_OK:
        return code, ea, eb
    if len(member) != nlab:
        return E_PALETTE, len(member), nlab
    if bits.shape != (8 * gz, 8 * gy, gx):
        return _E_SHAPE, 0, 0
    vol = np.zeros((8 * gz, 8 * gy, 8 * gx), np.uint64)
    code, ea, eb = decode_kernel(data, member.astype(np.uint64), True, vol[:hi[2], :hi[1], :hi[0]])
    if code != E_OK:
        return code, ea, eb
    vol[:lo[2]], vol[:, :lo[1]], vol[:, :, :lo[0]] = 0, 0, 0
    bits[...] = np.packbits(vol != 0, axis=2, bitorder="little")
    return E_OK, 0, 0


_BITS_SIG = types.UniTuple(types.int64, 3)(  # type: ignore[no-untyped-call]
    types.Array(types.uint8, 1, "C", readonly=True), types.Array(types.uint8, 1, "C", readonly=True),
    types.Array(types.int64, 1, "C", readonly=True), types.Array(types.int64, 1, "C", readonly=True),
    types.Array(types.uint8, 3, "C"))
_bits = jit.kernel(_bits_kernel, [_BITS_SIG.args], _bits_numpy, exclusive=True)


def block_bits(block: BytesLike, member: ArrayLike, lo: ArrayLike = (0, 0, 0), hi: ArrayLike | None = None,
               out: np.ndarray | None = None) -> np.ndarray:
    """The voxels of a DVID block whose label-list entry ``member`` marks, as bits: uint8 (nz, ny,
    nx / 8), bit i of ``[z, y, j]`` (LSB first) voxel (8 j + i, y, z).

    One numba pass over the packed values (no voxel decoded): what a body's sparse volume, binary
    blocks and runs are made from. Voxels outside [lo, hi) (x, y, z; a chunk cut by the volume's
    edge) are 0, and past ``hi`` not read; ``out`` receives them. BlockDecodeError when the block is
    malformed, ``member`` is not one entry per label, or ``out`` is not the block's shape.
    """
    data = np.frombuffer(block, np.uint8) if not isinstance(block, np.ndarray) else block.view(np.uint8).reshape(-1)
    m = np.asarray(member)
    if m.dtype != np.uint8:
        m = m.astype(bool).view(np.uint8)
    if out is None:
        code, a, b, gx, gy, gz, _ = head_numpy(data)
        if code != E_OK:
            raise block_error(code, a, b, data, None)
        out = np.empty((8 * gz, 8 * gy, gx), np.uint8)
    nz, ny, nb = out.shape
    ext = np.array([8 * nb, ny, nz], np.int64)
    lo_ = np.minimum(np.maximum(np.asarray(lo, np.int64).reshape(3), 0), ext)
    hi_ = ext if hi is None else np.minimum(np.maximum(np.asarray(hi, np.int64).reshape(3), 0), ext)
    code, a, b = _bits(data, np.ascontiguousarray(m.reshape(-1)), lo_, hi_, out)
    if code == _E_SHAPE:
        g = np.frombuffer(data[:12].tobytes(), "<u4")
        raise BlockDecodeError(f"the block is {8 * int(g[0])}x{8 * int(g[1])}x{8 * int(g[2])} voxels, not "
                               f"{8 * nb}x{ny}x{nz}")
    if code != E_OK:
        raise block_error(code, a, b, data, None)
    return out


_E_POINT = 101  # a point outside the block (a: its number)


@numba.njit(nogil=True, cache=True)
def _entries_kernel(data, xyz, out):  # type: ignore[no-untyped-def]
    """Validate the block, then ``out[i]``: the label-list entry of voxel ``xyz[i]`` from its
    sub-block's packed values, -1 in an empty sub-block; (code, a, b)."""
    zero = np.int64(0)
    code, ea, eb, gx, gy, gz, nlab = check_head(data)
    if code != E_OK:
        return code, ea, eb
    n = xyz.shape[0]
    for i in range(n):
        if not (0 <= xyz[i, 0] < 8 * gx and 0 <= xyz[i, 1] < 8 * gy and 0 <= xyz[i, 2] < 8 * gz):
            return _E_POINT, np.int64(i), zero
    if nlab == 1:
        for i in range(n):
            out[i] = 0
        return E_OK, zero, zero
    code, ea, eb, p_nsb, p_idx, p_val = check_body(data, gx, gy, gz, nlab)
    if code != E_OK:
        return code, ea, eb
    nsub = gx * gy * gz
    first = np.empty(nsub, np.int64)  # each sub-block's first index and first packed byte
    vpos = np.empty(nsub, np.int64)
    a = zero
    v = p_val
    for s in range(nsub):
        c = read_u16(data, p_nsb + 2 * s)
        first[s], vpos[s] = a, v
        a += c
        v += 64 * BITS[c]
    for i in range(n):
        x, y, z = xyz[i, 0], xyz[i, 1], xyz[i, 2]
        s = ((z >> 3) * gy + (y >> 3)) * gx + (x >> 3)
        c = read_u16(data, p_nsb + 2 * s)
        if c == 0:
            out[i] = -1
            continue
        k = zero
        if c > 1:
            b = BITS[c]
            bit = (((z & 7) * 8 + (y & 7)) * 8 + (x & 7)) * b  # MSB first
            p = vpos[s] + (bit >> 3)
            w = np.int64(data[p]) << 8
            if (bit & 7) + b > 8:  # the value reaches the next byte
                w |= np.int64(data[p + 1])
            k = (w >> (16 - (bit & 7) - b)) & ((np.int64(1) << b) - 1)
            if k >= c:
                return E_VAL_RANGE, s, c
        out[i] = read_u32(data, p_idx + 4 * (first[s] + k))
    return E_OK, zero, zero


def _entries_numpy(data: np.ndarray, xyz: np.ndarray, out: np.ndarray) -> tuple[int, int, int]:
    code, ea, eb, gx, gy, gz, nlab = head_numpy(data)
    if code != E_OK:
        return code, ea, eb
    outside = np.flatnonzero(((xyz < 0) | (xyz >= 8 * np.array([gx, gy, gz]))).any(axis=1))
    if outside.size:
        return _E_POINT, int(outside[0]), 0
    if nlab == 1:
        out[:] = 0
        return E_OK, 0, 0
    code, ea, eb, nsb, idx, p_val = body_numpy(data, gx, gy, gz, nlab)
    if code != E_OK:
        return code, ea, eb
    x, y, z = xyz[:, 0], xyz[:, 1], xyz[:, 2]
    s = ((z >> 3) * gy + (y >> 3)) * gx + (x >> 3)
    c = nsb[s]
    b = BITS[c]
    first = np.concatenate([[0], np.cumsum(nsb)[:-1]])
    vpos = p_val + 64 * np.concatenate([[0], np.cumsum(BITS[nsb])[:-1]])
    bit = (((z & 7) * 8 + (y & 7)) * 8 + (x & 7)) * b
    p = vpos[s] + (bit >> 3)
    two = (bit & 7) + b > 8
    w = (data[np.minimum(p, len(data) - 1)].astype(np.int64) << 8) | np.where(
        two, data[np.minimum(p + 1, len(data) - 1)], 0)
    k = np.where(c > 1, (w >> (16 - (bit & 7) - b)) & ((1 << b) - 1), 0)
    bad = np.flatnonzero((c > 1) & (k >= c))
    if bad.size:
        return E_VAL_RANGE, int(s[bad[0]]), int(c[bad[0]])
    out[:] = np.where(c == 0, -1, idx[np.minimum(first[s] + k, max(len(idx) - 1, 0))] if len(idx) else -1)
    return E_OK, 0, 0


_ENTRIES_SIG = types.UniTuple(types.int64, 3)(  # type: ignore[no-untyped-call]
    types.Array(types.uint8, 1, "C", readonly=True), types.Array(types.int64, 2, "C", readonly=True),
    types.Array(types.int64, 1, "C"))
_entries = jit.kernel(_entries_kernel, [_ENTRIES_SIG.args], _entries_numpy, exclusive=True)


def entries_at(block: BytesLike, xyz: ArrayLike) -> np.ndarray:
    """The label-list entries (int64 (n,)) of voxels ``xyz`` (x, y, z in the block) of a DVID block,
    read from its packed values in one numba pass: what DVID's ``/labels`` answers from. -1 for a
    voxel of an empty sub-block; BlockDecodeError for a malformed block or a point outside it."""
    data = np.frombuffer(block, np.uint8) if not isinstance(block, np.ndarray) else block.view(np.uint8).reshape(-1)
    p = np.ascontiguousarray(np.asarray(xyz, np.int64).reshape(-1, 3))
    out = np.empty(len(p), np.int64)
    code, a, b = _entries(data, p, out)
    if code == _E_POINT:
        raise BlockDecodeError(f"point {p[a].tolist()} lies outside the block")
    if code != E_OK:
        raise block_error(code, a, b, data, None)
    return out


def binary_block(offset: ArrayLike, mask_zyx: ArrayLike) -> bytes:
    """One block of ``sparsevol?format=blocks`` (``WriteBinaryBlock``) from the body's mask
    (nz, ny, nx, sides multiples of 8) and the block's first voxel (x, y, z)."""
    m = np.asarray(mask_zyx, bool)
    if m.ndim != 3 or any(n % _SUB or n == 0 for n in m.shape):
        raise SparsevolError(f"block mask must be 3-d with sides multiples of {_SUB}, got {m.shape}")
    return binary_block_bits(offset, np.packbits(m, axis=2, bitorder="little"))


@numba.njit(nogil=True, cache=True)
def _binary_kernel(bits, out):  # type: ignore[no-untyped-def]
    """``format=blocks`` sub-block records of a block's bits into ``out`` after its content byte;
    returns the bytes written (1 when the block is all or nothing: ``out[0]`` says which)."""
    nz, ny, gx = bits.shape
    n = np.int64(1)
    full = True
    some = False
    for sz in range(nz // 8):
        for sy in range(ny // 8):
            for sx in range(gx):
                a = np.int64(255)
                o = np.int64(0)
                for z in range(8):
                    for y in range(8):
                        v = np.int64(bits[8 * sz + z, 8 * sy + y, sx])
                        a &= v
                        o |= v
                if a == 255:
                    out[n] = 1
                    n += 1
                elif o == 0:
                    out[n] = 0
                    n += 1
                else:  # one byte per (z, y) row: x fastest, least significant bit first
                    out[n] = 2
                    for z in range(8):
                        for y in range(8):
                            out[n + 1 + 8 * z + y] = bits[8 * sz + z, 8 * sy + y, sx]
                    n += 65
                full &= a == 255
                some |= o != 0
    out[0] = 1 if full else 2 if some else 0
    return np.int64(1) if full or not some else n


def _binary_numpy(bits: np.ndarray, out: np.ndarray) -> int:
    nz, ny, gx = bits.shape
    sub = bits.reshape(nz // _SUB, _SUB, ny // _SUB, _SUB, gx).transpose(0, 2, 4, 1, 3).reshape(-1, 64)
    full, some = (sub == 255).all(axis=1), sub.any(axis=1)
    out[0] = 1 if full.all() else 2 if some.any() else 0
    if full.all() or not some.any():
        return 1
    flag = np.where(full, 1, np.where(some, 2, 0)).astype(np.uint8)
    pos = 1 + np.concatenate([[0], np.cumsum(1 + 64 * (flag == 2))])
    out[pos[:-1]] = flag
    mixed = np.flatnonzero(flag == 2)
    out[(pos[mixed] + 1)[:, None] + np.arange(64)] = sub[mixed]
    return int(pos[-1])


_BINARY_SIG = types.int64(types.Array(types.uint8, 3, "C", readonly=True), types.Array(types.uint8, 1, "C"))
_binary = jit.kernel(_binary_kernel, [_BINARY_SIG.args], _binary_numpy, exclusive=True)


def binary_block_bits(offset: ArrayLike, bits: ArrayLike) -> bytes:
    """`binary_block` of a block given as its bits (`block_bits`), in one numba pass."""
    head = np.asarray(offset, np.int64).reshape(3)
    if (head < _I32.min).any() or (head > _I32.max).any():
        raise SparsevolError(f"block offset {head.tolist()} out of int32 range")
    bits = np.ascontiguousarray(bits, np.uint8)
    nz, ny, gx = bits.shape
    if nz % _SUB or ny % _SUB or not nz or not ny or not gx:
        raise SparsevolError(f"block bits must be (nz, ny, nx / 8) with sides multiples of {_SUB}, got {bits.shape}")
    out = np.empty(1 + 65 * (nz // _SUB) * (ny // _SUB) * gx, np.uint8)
    n = _binary(bits, out)
    return head.astype("<i4").tobytes() + out[:n].tobytes()
