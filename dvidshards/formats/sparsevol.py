"""DVID's binary sparse-volume format: the RLEs of ``GET .../sparsevol/<label>`` and ``-coarse``.

Layout (DVID ``datatype/labelmap/labelmap.go`` help text; ``getLegacyRLEs`` and
``GetSparseCoarseVol`` in ``datatype/labelmap/labelidx.go``), all integers little endian::

    u8   payload descriptor   0 (binary sparse volume: no payload after a span)
    u8   number of dimensions 3
    u8   dimension of run     0 (runs along x)
    u8   reserved             0
    u32  voxels               0 (DVID writes a placeholder 0, "TODO")
    u32  number of spans      n
    n x (i32 x, i32 y, i32 z, i32 length)

``sparsevol-coarse`` has the same header; its spans are runs of *block* coordinates.

What DVID emits (``labels.WriteRLEs`` in ``datatype/common/labels/compressed.go``):

* Runs are **maximal along x**: a run reaching the +x face of a block is held in a buffer
  keyed by (y, z) and extended into the next block when that block is the x-successor in the
  sorted block list, so runs are *not* split at block boundaries.
* Blocks are visited in sorted ``IZYXString`` order (z, then y, then x of the block
  coordinate; the key is big-endian with the sign bit flipped, so negatives sort first).
  Within a block rows go z, then y, and a run is written when it ends, so the stream is
  ordered block by block, not globally by (z, y, x).
* A run touching a block's +x face whose x-successor block holds none of the body is written
  when the next block starts (or at the end) from a Go map: in **random order**. DVID's bytes
  are therefore not reproducible in general; `encode` with ``order="dvid"`` reproduces DVID's
  order exactly and writes such flushed groups sorted by (z, y).
* Coarse spans: the label index's blocks sorted (z, y, x), consecutive x merged
  (``IZYXSlice.WriteSerializedRLEs`` in ``dvid/``): deterministic.

`RunOrder` gives the same order block by block (what a server streams), also under DVID's
``minx`` .. ``maxz`` bounds: there a run is held for the next block when it reaches the last
voxel the row scan visits (the block's +x face or ``maxx``), as ``writeRLEs`` does.

The other two ``format`` values of ``GET .../sparsevol/<label>``:

* ``srles``: the spans alone, no header (16 bytes each, in the same order).
* ``blocks`` (``labels.WriteBinaryBlocks``): a header ``u32 gx, gy, gz`` (sub-blocks per block
  axis) and ``u64 label``, then per block holding the body ``i32 x, y, z`` (its first voxel)
  and a content byte: 0 background only, 1 foreground only, 2 both, followed then by one
  record per 8x8x8 sub-block (z, y, x order): a content byte, and for 2 a 64-byte mask, one
  bit per voxel, x fastest then y then z, least significant bit first. See `binary_block`.

Runs here are ``int32`` arrays of shape ``(n, 4)``: columns x, y, z, length.
"""

from __future__ import annotations

import struct

import numpy as np

from ..errors import DvidShardsError

__all__ = [
    "BLOCKS_HEADER",
    "HEADER",
    "RunOrder",
    "SparsevolError",
    "binary_block",
    "blocks_from_runs",
    "clip_runs",
    "coarse_runs",
    "decode",
    "decode_blocks",
    "dvid_order",
    "encode_coarse",
    "encode_runs",
    "mask_from_runs",
    "merge_runs",
    "runs_from_labels",
    "runs_from_mask",
    "voxel_count",
]

HEADER = struct.Struct("<BBBBII")  # descriptor, ndim, run dim, reserved, voxels, spans
BLOCKS_HEADER = struct.Struct("<IIIQ")  # format=blocks: sub-blocks per axis (x, y, z), label
_SUB = 8  # sub-block edge of format=blocks (DVID's SubBlockSize)
_I32 = np.iinfo(np.int32)
_ORDERS = ("dvid", "zyx")


class SparsevolError(DvidShardsError, ValueError):
    """Sparse-volume bytes or runs are malformed (truncated, wrong header, bad run)."""


def _as_runs(runs, what: str = "runs") -> np.ndarray:
    """Validated (n, 4) int64 copy of runs: integer, lengths >= 1, inside int32."""
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


def _zyx_sort(a: np.ndarray) -> np.ndarray:
    return a[np.lexsort((a[:, 0], a[:, 1], a[:, 2]))]


def merge_runs(*run_arrays) -> np.ndarray:
    """Union of runs as maximal x-runs sorted by (z, y, x).

    Runs from chunks read one by one (each cut at its chunk's x faces) merge into the runs of
    the whole body; overlapping or touching runs of one row join, so the result does not
    depend on how the body was cut.

    Parameters
    ----------
    *run_arrays : array_like of int, shape (n, 4)
        Runs (x, y, z, length), any order.

    Returns
    -------
    numpy.ndarray of int32, shape (m, 4)

    Raises
    ------
    SparsevolError
        If a run array is malformed.
    """
    parts = [_as_runs(r) for r in run_arrays]
    a = np.concatenate(parts) if parts else np.zeros((0, 4), np.int64)
    if not len(a):
        return np.zeros((0, 4), np.int32)
    a = _zyx_sort(a)
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


def runs_from_mask(mask_xyz, offset=(0, 0, 0)) -> np.ndarray:
    """Maximal x-runs of a boolean mask, sorted by (z, y, x).

    Parameters
    ----------
    mask_xyz : array_like of bool, shape (nx, ny, nz)
        The body's voxels, indexed ``[x, y, z]``.
    offset : sequence of 3 int, optional
        Voxel coordinate of ``mask_xyz[0, 0, 0]``.

    Returns
    -------
    numpy.ndarray of int32, shape (n, 4)
        Runs (x, y, z, length).

    Raises
    ------
    SparsevolError
        If the mask is not 3-d or a run falls outside int32.
    """
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


def runs_from_labels(block_xyz, labels, offset=(0, 0, 0)) -> np.ndarray:
    """Runs of the voxels of a label block holding any of ``labels`` (e.g. a body's supervoxels).

    Parameters
    ----------
    block_xyz : array_like of int, shape (nx, ny, nz)
    labels : int or sequence of int
    offset : sequence of 3 int, optional

    Returns
    -------
    numpy.ndarray of int32, shape (n, 4)
    """
    block = np.asarray(block_xyz)
    return runs_from_mask(np.isin(block, np.asarray(labels, dtype=block.dtype).reshape(-1)), offset)


def voxel_count(runs) -> int:
    """Number of voxels covered by runs (overlaps counted twice; merge first if they may overlap)."""
    return int(_as_runs(runs)[:, 3].sum())


def mask_from_runs(runs, lo, hi) -> np.ndarray:
    """Boolean mask ``[x, y, z]`` of the box ``[lo, hi)`` with the runs' voxels set.

    Parameters
    ----------
    runs : array_like of int, shape (n, 4)
    lo, hi : sequence of 3 int
        Box corners; voxels of runs outside the box are ignored.

    Returns
    -------
    numpy.ndarray of bool, shape ``hi - lo``
    """
    a = _as_runs(runs)
    lo_, hi_ = np.asarray(lo, np.int64), np.asarray(hi, np.int64)
    if lo_.shape != (3,) or hi_.shape != (3,) or (hi_ < lo_).any():
        raise SparsevolError(f"bad box {lo!r}..{hi!r}")
    shape = tuple(int(v) for v in hi_ - lo_)
    out = np.zeros(shape, bool)
    inside = (a[:, 1] >= lo_[1]) & (a[:, 1] < hi_[1]) & (a[:, 2] >= lo_[2]) & (a[:, 2] < hi_[2])
    a = a[inside]
    x0 = np.clip(a[:, 0], lo_[0], hi_[0]) - lo_[0]
    x1 = np.clip(a[:, 0] + a[:, 3], lo_[0], hi_[0]) - lo_[0]
    keep = x1 > x0
    a, x0, x1 = a[keep], x0[keep], x1[keep]
    if not len(a):
        return out
    # difference array along x, then a cumulative sum: no per-voxel Python
    diff = np.zeros((shape[0] + 1, shape[1], shape[2]), np.int32)
    yy, zz = a[:, 1] - lo_[1], a[:, 2] - lo_[2]
    np.add.at(diff, (x0, yy, zz), 1)
    np.add.at(diff, (x1, yy, zz), -1)
    out[:] = np.cumsum(diff, axis=0)[:-1] > 0
    return out


def _packer(blocks_zyx: np.ndarray):
    """Order-preserving int64 key of (z, y, x) block rows near ``blocks_zyx`` (21 bits an axis)."""
    lo = blocks_zyx.min(axis=0) - 1
    if (blocks_zyx.max(axis=0) - lo >= (1 << 21) - 2).any():
        raise SparsevolError("body spans more than 2**21 blocks along an axis")

    def pack(b: np.ndarray) -> np.ndarray:
        u = b.astype(np.int64) - lo
        return (u[:, 0] << 42) | (u[:, 1] << 21) | u[:, 2]

    return pack


def dvid_order(runs, block_size: int = 64) -> np.ndarray:
    """Runs in the order DVID's ``sparsevol`` streams them.

    Blocks holding the body are visited in (z, y, x) order; inside a block a run is written
    when it ends, rows in (z, y) order. A run that reaches a block's +x face continues into
    the next block: it is written at the start of its row there if that block holds the body,
    otherwise just before the next block holding the body (DVID: in Go map order, here sorted
    by (z, y)).

    Parameters
    ----------
    runs : array_like of int, shape (n, 4)
        Runs of one body; merged to maximal x-runs first.
    block_size : int, optional
        DVID block edge (64).

    Returns
    -------
    numpy.ndarray of int32, shape (m, 4)
    """
    if not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise SparsevolError(f"block_size must be a positive integer, got {block_size!r}")
    a = merge_runs(runs).astype(np.int64)
    if not len(a):
        return a.astype(np.int32)
    b = int(block_size)
    x1 = a[:, 0] + a[:, 3] - 1
    by, bz, bx_end = a[:, 1] // b, a[:, 2] // b, x1 // b
    blocks_zyx = blocks_from_runs(a, b)[:, ::-1].astype(np.int64)
    pack = _packer(blocks_zyx)
    table = pack(blocks_zyx)  # sorted: blocks_from_runs sorts by (z, y, x)
    end_block = np.stack([bz, by, bx_end], axis=1)
    rank = np.searchsorted(table, pack(end_block))
    phase = np.ones(len(a), np.int64)
    at_face = (x1 + 1) % b == 0
    nxt = end_block.copy()
    nxt[:, 2] += 1
    nxt_packed = pack(nxt)
    pos = np.searchsorted(table, nxt_packed)
    has_next = (pos < len(table)) & (table[np.minimum(pos, len(table) - 1)] == nxt_packed)
    cont = at_face & has_next
    rank[cont] = pos[cont]  # written at the start of its row in the next block
    flush = at_face & ~has_next
    rank[flush] += 1  # written before the next block holding the body
    phase[flush] = 0
    order = np.lexsort((x1, a[:, 1], a[:, 2], phase, rank))
    return a[order].astype(np.int32)


def encode_runs(runs, order: str = "dvid", block_size: int = 64) -> bytes:
    """Encode runs as DVID's legacy ``rles`` sparse volume (``GET .../sparsevol/<label>``).

    Runs are merged to maximal x-runs first, so the bytes depend only on the set of voxels.

    Parameters
    ----------
    runs : array_like of int, shape (n, 4)
        Runs (x, y, z, length) of one body, any order, possibly cut at chunk faces.
    order : {"dvid", "zyx"}, optional
        ``"dvid"``: DVID's streaming order (see `dvid_order`); ``"zyx"``: sorted by z, y, x.
    block_size : int, optional
        DVID block edge, used by ``order="dvid"``.

    Returns
    -------
    bytes
        12-byte header then 16 bytes per span. The voxel field is 0, as DVID writes it.

    Raises
    ------
    SparsevolError
        If runs are malformed or there are more than 2**32 - 1 spans.
    """
    if order not in _ORDERS:
        raise SparsevolError(f"order must be one of {_ORDERS}, got {order!r}")
    a = dvid_order(runs, block_size) if order == "dvid" else merge_runs(runs)
    if len(a) > 0xFFFFFFFF:
        raise SparsevolError(f"{len(a)} spans do not fit the u32 span count")
    return HEADER.pack(0, 3, 0, 0, 0, len(a)) + a.astype("<i4").tobytes()


def decode(data) -> np.ndarray:
    """Runs of a legacy ``rles`` sparse volume (fine or coarse: the layout is the same).

    Parameters
    ----------
    data : bytes-like

    Returns
    -------
    numpy.ndarray of int32, shape (n, 4)
        Runs (x, y, z, length) in stream order.

    Raises
    ------
    SparsevolError
        If the header is not a 3-d binary sparse volume with runs along x, the length does
        not match the span count, or a run length is < 1.
    """
    buf = memoryview(data).cast("B")
    if len(buf) < HEADER.size:
        raise SparsevolError(f"sparse volume of {len(buf)} bytes is shorter than its 12-byte header")
    desc, ndim, run_dim, _, _, n = HEADER.unpack_from(buf, 0)
    if desc != 0:
        raise SparsevolError(f"payload descriptor {desc:#x}: only binary sparse volumes (0) are supported")
    if ndim != 3 or run_dim != 0:
        raise SparsevolError(f"expected 3 dimensions with runs along x (0), got {ndim} and {run_dim}")
    if len(buf) != HEADER.size + 16 * n:
        raise SparsevolError(f"{n} spans need {HEADER.size + 16 * n} bytes, got {len(buf)}")
    runs = np.frombuffer(buf, "<i4", 4 * n, HEADER.size).reshape(n, 4).astype(np.int32)
    if n and (runs[:, 3] < 1).any():
        raise SparsevolError("a span has length < 1")
    return runs


def blocks_from_runs(runs, block_size: int = 64) -> np.ndarray:
    """Unique block coordinates (x, y, z) touched by runs, sorted by (z, y, x).

    Parameters
    ----------
    runs : array_like of int, shape (n, 4)
    block_size : int, optional

    Returns
    -------
    numpy.ndarray of int32, shape (m, 3)
    """
    if not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise SparsevolError(f"block_size must be a positive integer, got {block_size!r}")
    a = _as_runs(runs)
    b = int(block_size)
    if not len(a):
        return np.zeros((0, 3), np.int32)
    bx0, bx1 = a[:, 0] // b, (a[:, 0] + a[:, 3] - 1) // b
    count = bx1 - bx0 + 1
    rep = np.repeat(np.arange(len(a)), count)
    step = np.arange(len(rep)) - np.repeat(np.cumsum(count) - count, count)
    blocks = np.stack([bx0[rep] + step, a[rep, 1] // b, a[rep, 2] // b], axis=1)
    blocks = np.unique(blocks[:, ::-1], axis=0)[:, ::-1]  # unique rows sorted by (z, y, x)
    return np.ascontiguousarray(blocks).astype(np.int32)


def coarse_runs(blocks) -> np.ndarray:
    """Runs of block coordinates as ``sparsevol-coarse`` has them: sorted (z, y, x), x merged.

    Parameters
    ----------
    blocks : array_like of int, shape (n, 3)
        Block coordinates (x, y, z) of the body (its label index), any order; duplicates ok.

    Returns
    -------
    numpy.ndarray of int32, shape (m, 4)
    """
    b = np.asarray(blocks)
    if b.size == 0:
        return np.zeros((0, 4), np.int32)
    if not np.issubdtype(b.dtype, np.integer) or b.ndim != 2 or b.shape[1] != 3:
        raise SparsevolError(f"blocks must be integers of shape (n, 3), got {b.dtype} {b.shape}")
    ones = np.ones((len(b), 1), np.int64)
    return merge_runs(np.concatenate([b.astype(np.int64), ones], axis=1))


def encode_coarse(blocks) -> bytes:
    """Encode a body's blocks as DVID's ``GET .../sparsevol-coarse/<label>`` bytes.

    Parameters
    ----------
    blocks : array_like of int, shape (n, 3)
        Block coordinates (x, y, z) holding the body (e.g. `blocks_from_runs`).

    Returns
    -------
    bytes
        Same header as `encode_runs` (block count field 0, as DVID writes it), then spans of
        block coordinates.
    """
    runs = coarse_runs(blocks)
    return HEADER.pack(0, 3, 0, 0, 0, len(runs)) + runs.astype("<i4").tobytes()


# --------------------------------------------------------------------------- bounds, streaming


def clip_runs(runs, lo, hi) -> np.ndarray:
    """Runs cut to DVID's ``minx`` .. ``maxz`` bounds (inclusive voxel coordinates).

    Parameters
    ----------
    runs : array_like of int, shape (n, 4)
    lo, hi : sequence of 3 int
        Smallest and largest voxel kept along x, y, z (both inclusive, as DVID's bounds).

    Returns
    -------
    numpy.ndarray of int32, shape (m, 4)
        The runs' parts inside the bounds, in their order; runs wholly outside dropped.
    """
    a = _as_runs(runs)
    lo_, hi_ = np.asarray(lo, np.int64).reshape(3), np.asarray(hi, np.int64).reshape(3)
    keep = (a[:, 1] >= lo_[1]) & (a[:, 1] <= hi_[1]) & (a[:, 2] >= lo_[2]) & (a[:, 2] <= hi_[2])
    a = a[keep]
    x0 = np.maximum(a[:, 0], lo_[0])
    x1 = np.minimum(a[:, 0] + a[:, 3] - 1, hi_[0])
    ok = x1 >= x0
    out = a[ok].copy()
    out[:, 0] = x0[ok]
    out[:, 3] = x1[ok] - x0[ok] + 1
    return out.astype(np.int32)


class RunOrder:
    """DVID's sparsevol run order, computed block by block (``labels.WriteRLEs``).

    Feed the blocks holding the body in ascending (z, y, x) block order with `add`, each
    with the body's runs inside it (cut at the block's x faces, any order); each call
    returns the runs that are final, in DVID's order; `finish` returns the rest. The
    concatenation equals `dvid_order` of all the runs when no bounds are given.

    Parameters
    ----------
    block_size : int
        DVID block edge (64).
    maxx : int, optional
        DVID's ``maxx`` bound: a row scan stops there, so a run reaching it is held for the
        next block like one reaching the block's +x face.

    Notes
    -----
    Memory is bounded by one row of blocks: the runs held are at most one per (y, z) row of
    a block.
    """

    def __init__(self, block_size: int = 64, maxx: int | None = None):
        if not isinstance(block_size, (int, np.integer)) or block_size < 1:
            raise SparsevolError(f"block_size must be a positive integer, got {block_size!r}")
        self.b = int(block_size)
        self.maxx = None if maxx is None else int(maxx)
        self._prev: tuple[int, int, int] | None = None
        self._held = np.zeros((0, 4), np.int64)

    def _flush(self) -> np.ndarray:
        h = self._held
        self._held = np.zeros((0, 4), np.int64)
        return h[np.lexsort((h[:, 1], h[:, 2]))] if len(h) else h  # DVID: Go map order; here (z, y)

    def add(self, block, runs) -> np.ndarray:
        """The runs made final by one more block (int32 (n, 4), in DVID's order).

        Raises
        ------
        SparsevolError
            If blocks do not come in ascending (z, y, x) order, or a run is not inside its block.
        """
        bx, by, bz = (int(v) for v in np.asarray(block).reshape(3))
        if self._prev is not None and (bz, by, bx) <= self._prev[::-1]:
            raise SparsevolError(f"block {(bx, by, bz)} after {self._prev}: blocks must come in (z, y, x) order")
        b = self.b
        x0 = bx * b
        a = merge_runs(runs).astype(np.int64)
        if len(a) and ((a[:, 0] < x0) | (a[:, 0] + a[:, 3] > x0 + b) | (a[:, 1] // b != by)
                       | (a[:, 2] // b != bz)).any():
            raise SparsevolError(f"a run is not inside block {(bx, by, bz)}")
        out = []
        if self._prev is not None and self._prev != (bx - 1, by, bz):
            out.append(self._flush())
        held = self._held
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
        stop = x0 + b if self.maxx is None else min(x0 + b, self.maxx + 1)
        hold = a[:, 0] + a[:, 3] == stop
        self._held = a[hold]
        done = a[~hold]
        out.append(done[np.lexsort((done[:, 0], done[:, 1], done[:, 2]))])
        self._prev = (bx, by, bz)
        return np.concatenate(out).astype(np.int32)

    def finish(self) -> np.ndarray:
        """The runs still held after the last block (int32 (n, 4))."""
        self._prev = None
        return self._flush().astype(np.int32)


# --------------------------------------------------------------------------- format=blocks


def binary_block(offset, mask_zyx) -> bytes:
    """One block of DVID's ``sparsevol?format=blocks`` stream (``WriteBinaryBlock``).

    Parameters
    ----------
    offset : sequence of 3 int
        Voxel coordinate (x, y, z) of the block's first voxel.
    mask_zyx : array_like of bool, shape (nz, ny, nx)
        The body's voxels in the block, each side a multiple of 8.

    Returns
    -------
    bytes
        ``i32 x, y, z``, a content byte (1: every voxel is the body) and, for a block that
        mixes, one record per sub-block. An all-background block gives content 0.
    """
    m = np.asarray(mask_zyx, bool)
    if m.ndim != 3 or any(n % _SUB or n == 0 for n in m.shape):
        raise SparsevolError(f"block mask must be 3-d with sides multiples of {_SUB}, got {m.shape}")
    head = np.asarray(offset, np.int64).reshape(3)
    if (head < _I32.min).any() or (head > _I32.max).any():
        raise SparsevolError(f"block offset {head.tolist()} out of int32 range")
    start = head.astype("<i4").tobytes()
    if m.all():
        return start + b"\x01"
    if not m.any():
        return start + b"\x00"
    gz, gy, gx = (n // _SUB for n in m.shape)
    sub = m.reshape(gz, _SUB, gy, _SUB, gx, _SUB).transpose(0, 2, 4, 1, 3, 5).reshape(-1, _SUB ** 3)
    full, some = sub.all(axis=1), sub.any(axis=1)
    flag = np.where(full, 1, np.where(some, 2, 0)).astype(np.uint8)
    size = 1 + 64 * (flag == 2)
    pos = np.concatenate([[0], np.cumsum(size)])
    out = np.zeros(int(pos[-1]), np.uint8)
    out[pos[:-1]] = flag
    mixed = np.flatnonzero(flag == 2)
    if mixed.size:
        bits = np.packbits(sub[mixed], axis=1, bitorder="little")  # (k, 64): x fastest, LSB first
        out[(pos[mixed] + 1)[:, None] + np.arange(64)] = bits
    return start + b"\x02" + out.tobytes()


def decode_blocks(data) -> tuple[int, list[tuple[tuple[int, int, int], np.ndarray]]]:
    """Read DVID's ``sparsevol?format=blocks`` bytes.

    Returns
    -------
    (label, blocks)
        The header's label and ``[((x, y, z) offset, mask (nz, ny, nx) bool), ...]``.

    Raises
    ------
    SparsevolError
        If the stream is truncated or holds a content byte other than 0, 1 or 2.
    """
    buf = bytes(memoryview(data).cast("B"))
    if len(buf) < BLOCKS_HEADER.size:
        raise SparsevolError(f"format=blocks stream of {len(buf)} bytes is shorter than its 20-byte header")
    gx, gy, gz, label = BLOCKS_HEADER.unpack_from(buf, 0)
    if not (0 < gx <= 128 and 0 < gy <= 128 and 0 < gz <= 128):
        raise SparsevolError(f"format=blocks header claims {gx}x{gy}x{gz} sub-blocks")
    nsub = gx * gy * gz
    p, out = BLOCKS_HEADER.size, []
    while p < len(buf):
        if p + 13 > len(buf):
            raise SparsevolError(f"truncated block header at byte {p}")
        off = struct.unpack_from("<3i", buf, p)
        flag = buf[p + 12]
        p += 13
        if flag in (0, 1):
            m = np.full((gz * _SUB, gy * _SUB, gx * _SUB), bool(flag))
        elif flag == 2:
            sub = np.zeros((nsub, _SUB ** 3), bool)
            for k in range(nsub):
                if p >= len(buf):
                    raise SparsevolError(f"truncated sub-block {k} of block {off}")
                f = buf[p]
                p += 1
                if f == 1:
                    sub[k] = True
                elif f == 2:
                    if p + 64 > len(buf):
                        raise SparsevolError(f"truncated mask of sub-block {k} of block {off}")
                    sub[k] = np.unpackbits(np.frombuffer(buf, np.uint8, 64, p), bitorder="little").astype(bool)
                    p += 64
                elif f != 0:
                    raise SparsevolError(f"sub-block {k} of block {off} has content byte {f}")
            m = sub.reshape(gz, gy, gx, _SUB, _SUB, _SUB).transpose(0, 3, 1, 4, 2, 5).reshape(
                gz * _SUB, gy * _SUB, gx * _SUB)
        else:
            raise SparsevolError(f"block {off} has content byte {flag}")
        out.append((off, m))
    return int(label), out
