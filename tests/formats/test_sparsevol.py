"""Tests of dvidshards.formats.sparsevol against a deliberately naive re-implementation.

The naive encoder below walks voxels one by one the way DVID's ``labels.WriteRLEs`` does
(blocks in (z, y, x) order, rows z then y inside a block, runs reaching a block's +x face
buffered per (y, z) row and continued into the x-successor block), writing the flushed
buffer sorted by (z, y) where DVID uses Go map order.
"""

from __future__ import annotations

import itertools
import struct

import numpy as np
import pytest

from dvidshards.formats import sparsevol as sv
from tests.support.sparsevol import (
    decode,
    decode_blocks,
    mask_from_runs,
    naive_binary_blocks,
    naive_dvid_bytes,
    random_body,
)


def encode_runs(runs, order: str = "dvid", block_size: int = 64) -> bytes:
    """A body's ``rles`` bytes from its runs (any order, possibly cut at chunk faces): merged to
    maximal runs, then in DVID's order (cut at block faces and fed to `RunOrder` block by block)
    or sorted by (z, y, x)."""
    a = sv.merge_runs(runs).astype(np.int64)
    if order == "dvid" and len(a):
        ro = sv.RunOrder(block_size)
        b = ro.b
        first, last = a[:, 0] // b, (a[:, 0] + a[:, 3] - 1) // b
        rep = np.repeat(np.arange(len(a)), last - first + 1)  # a run's piece in each block it crosses
        bx = first[rep] + np.arange(len(rep)) - np.repeat(np.cumsum(last - first + 1) - (last - first + 1),
                                                            last - first + 1)
        x0 = np.maximum(a[rep, 0], bx * b)
        pieces = np.stack([x0, a[rep, 1], a[rep, 2], np.minimum(a[rep, 0] + a[rep, 3], (bx + 1) * b) - x0], axis=1)
        blocks = np.stack([bx, a[rep, 1] // b, a[rep, 2] // b], axis=1)
        k = np.lexsort((blocks[:, 0], blocks[:, 1], blocks[:, 2]))
        pieces, blocks = pieces[k], blocks[k]
        cut = np.flatnonzero((blocks[1:] != blocks[:-1]).any(axis=1)) + 1
        a = np.concatenate([ro.add(blocks[i], p) for i, p in zip(np.r_[0, cut], np.split(pieces, cut), strict=True)]
                           + [ro.finish()])
    return sv.HEADER.pack(0, 3, 0, 0, 0, len(a)) + a.astype("<i4").tobytes()


def naive_zyx_runs(mask: np.ndarray, offset) -> list[tuple[int, int, int, int]]:
    ox, oy, oz = (int(v) for v in offset)
    nx, ny, nz = mask.shape
    runs = []
    for z in range(nz):
        for y in range(ny):
            x = 0
            while x < nx:
                if mask[x, y, z]:
                    s = x
                    while x < nx and mask[x, y, z]:
                        x += 1
                    runs.append((s + ox, y + oy, z + oz, x - s))
                else:
                    x += 1
    return runs


def naive_coarse_bytes(mask: np.ndarray, offset, block: int) -> bytes:
    ox, oy, oz = (int(v) for v in offset)
    blocks = set()
    for x, y, z in zip(*np.nonzero(mask), strict=True):
        blocks.add(((int(z) + oz) // block, (int(y) + oy) // block, (int(x) + ox) // block))
    spans = []
    for bz, by, bx in sorted(blocks):
        if spans and spans[-1][1] == by and spans[-1][2] == bz and spans[-1][0] + spans[-1][3] == bx:
            spans[-1][3] += 1
        else:
            spans.append([bx, by, bz, 1])
    head = struct.pack("<BBBBII", 0, 3, 0, 0, 0, len(spans))
    return head + b"".join(struct.pack("<4i", *s) for s in spans)


CASES = [
    # (seed, shape, offset, block)
    (0, (40, 24, 20), (0, 0, 0), 8),
    (1, (37, 19, 23), (5, 13, 2), 8),
    (2, (50, 20, 18), (-17, 30, -9), 16),
    (3, (33, 17, 9), (60, 61, 62), 4),
    (4, (70, 12, 10), (100, 0, 64), 64),
]


@pytest.mark.parametrize("seed,shape,offset,block", CASES)
def test_dvid_order_bytes_match_naive(seed, shape, offset, block):
    rng = np.random.default_rng(seed)
    mask = random_body(rng, shape)
    runs = sv.runs_from_mask(mask, offset)
    assert encode_runs(runs, order="dvid", block_size=block) == naive_dvid_bytes(mask, offset, block)


@pytest.mark.parametrize("seed,shape,offset,block", CASES)
def test_zyx_runs_and_coarse_match_naive(seed, shape, offset, block):
    rng = np.random.default_rng(100 + seed)
    mask = random_body(rng, shape)
    runs = sv.runs_from_mask(mask, offset)
    assert [tuple(r) for r in runs.tolist()] == naive_zyx_runs(mask, offset)
    zyx = encode_runs(runs, order="zyx")
    assert zyx[12:] == runs.astype("<i4").tobytes()
    blocks = np.unique((np.argwhere(mask) + offset) // block, axis=0)
    assert sv.encode_coarse(blocks) == naive_coarse_bytes(mask, offset, block)
    # coarse decodes like a fine sparse volume of block coordinates
    np.testing.assert_array_equal(decode(sv.encode_coarse(blocks)), sv.coarse_runs(blocks))


@pytest.mark.parametrize("seed", range(4))
def test_chunked_read_gives_same_bytes(seed):
    rng = np.random.default_rng(200 + seed)
    shape, offset, chunk = (45, 30, 26), (64 * seed - 20, 7, 128), (16, 8, 11)
    mask = random_body(rng, shape)
    whole = encode_runs(sv.runs_from_mask(mask, offset), block_size=16)
    parts = []
    for i, j, k in itertools.product(*(range(0, s, c) for s, c in zip(shape, chunk, strict=True))):
        sub = mask[i:i + chunk[0], j:j + chunk[1], k:k + chunk[2]]
        parts.append(sv.runs_from_mask(sub, (offset[0] + i, offset[1] + j, offset[2] + k)))
    rng.shuffle(parts)
    assert encode_runs(sv.merge_runs(*parts), block_size=16) == whole
    assert encode_runs(np.concatenate(parts), block_size=16) == whole  # encode merges too


def test_round_trips():
    rng = np.random.default_rng(7)
    mask = random_body(rng, (30, 20, 10))
    lo = np.array([3, -4, 9])
    runs = sv.runs_from_mask(mask, lo)
    for order in ("dvid", "zyx"):
        data = encode_runs(runs, order=order, block_size=8)
        back = decode(data)
        np.testing.assert_array_equal(sv.merge_runs(back), runs)
        np.testing.assert_array_equal(mask_from_runs(back, lo, lo + mask.shape), mask)
    assert int(runs[:, 3].sum()) == int(mask.sum())
    # a box larger than the body pads with False; a smaller one crops
    big = mask_from_runs(runs, lo - 2, lo + np.array(mask.shape) + 3)
    assert big.sum() == mask.sum() and big[2:-3, 2:-3, 2:-3].tolist() == mask.tolist()
    crop = mask_from_runs(runs, lo + 5, lo + 9)
    np.testing.assert_array_equal(crop, mask[5:9, 5:9, 5:9])


def test_merge_overlapping_and_touching():
    runs = np.array([[0, 0, 0, 5], [5, 0, 0, 2], [3, 0, 0, 1], [10, 0, 0, 1], [2, 1, 0, 3],
                     [9, 0, 0, 1], [0, 0, 1, 2]])
    np.testing.assert_array_equal(
        sv.merge_runs(runs), [[0, 0, 0, 7], [9, 0, 0, 2], [2, 1, 0, 3], [0, 0, 1, 2]])
    assert sv.merge_runs().shape == (0, 4)


def test_empty_and_header():
    empty = encode_runs(np.zeros((0, 4), np.int32))
    assert empty == bytes([0, 3, 0, 0]) + b"\0" * 8
    assert decode(empty).shape == (0, 4)
    assert sv.runs_from_mask(np.zeros((3, 4, 5), bool)).shape == (0, 4)
    assert sv.encode_coarse(np.zeros((0, 3), int)) == empty


def test_bad_runs_rejected():
    with pytest.raises(sv.SparsevolError):
        sv.merge_runs([[0, 0, 0, 0]])
    with pytest.raises(sv.SparsevolError):
        sv.merge_runs([[0.5, 0, 0, 1]])
    with pytest.raises(sv.SparsevolError):
        sv.merge_runs([[2**31 - 1, 0, 0, 2]])
    with pytest.raises(sv.SparsevolError):
        sv.runs_from_mask(np.zeros((2, 2), bool))


# --------------------------------------------------------------------------- streaming order, bounds


def _stream(mask, offset, block, bounds=None, *, empty_blocks=()):
    """RunOrder fed block by block, as a server does; ``empty_blocks`` are fed with no runs
    (blocks whose lists hold the body but whose runs are all outside the bounds)."""
    lo, hi = bounds if bounds is not None else ((-(2**31),) * 3, (2**31 - 1,) * 3)
    runs = sv.runs_from_mask(mask, offset)
    if bounds is not None:
        runs = sv.clip_runs(runs, lo, hi)
    cut = []  # runs cut at block faces, grouped by block
    for x, y, z, n in runs.tolist():
        while n:
            e = min(x + n, (x // block + 1) * block)
            cut.append((z // block, y // block, x // block, x, y, z, e - x))
            n -= e - x
            x = e
    by_block: dict = {}
    for bz, by, bx, *r in cut:
        by_block.setdefault((bz, by, bx), []).append(r)
    for b in empty_blocks:
        by_block.setdefault(b, [])
    order = sv.RunOrder(block, maxx=None if bounds is None else hi[0])
    out = [order.add((bx, by, bz), np.array(by_block[(bz, by, bx)], np.int64).reshape(-1, 4))
           for bz, by, bx in sorted(by_block)]
    out.append(order.finish())
    a = np.concatenate(out)
    return struct.pack("<BBBBII", 0, 3, 0, 0, 0, len(a)) + a.astype("<i4").tobytes()


@pytest.mark.parametrize("seed,shape,offset,block", CASES)
def test_streamed_order_equals_dvid_order(seed, shape, offset, block):
    rng = np.random.default_rng(300 + seed)
    mask = random_body(rng, shape)
    assert _stream(mask, offset, block) == naive_dvid_bytes(mask, offset, block)
    assert _stream(mask, offset, block) == encode_runs(sv.runs_from_mask(mask, offset), block_size=block)


@pytest.mark.parametrize("seed", range(6))
def test_bounded_stream_equals_dvids_bounded_scan(seed):
    rng = np.random.default_rng(400 + seed)
    shape, offset, block = (45, 30, 26), (5 * seed - 9, 3, 17), 8
    mask = random_body(rng, shape)
    a = rng.integers(-5, 20, 3) + np.array(offset)
    b = a + rng.integers(4, 40, 3)
    lo, hi = a.tolist(), b.tolist()
    if seed == 0:
        lo[0] = None  # one side unbounded
    lo_ = [v if v is not None else -(2**31) for v in lo]
    got = _stream(mask, offset, block, (lo_, hi))
    assert got == naive_dvid_bytes(mask, offset, block, (lo_, hi))
    # the same voxels as the mask cut to the box
    runs = decode(got)
    want = mask.copy()
    for ax in range(3):
        idx = np.arange(shape[ax]) + offset[ax]
        keep = (idx >= lo_[ax]) & (idx <= hi[ax])
        want = np.compress(keep, want, axis=ax) if not keep.all() else want
    assert int(runs[:, 3].sum()) == int(want.sum())


def test_blocks_without_runs_in_the_bounds_change_nothing():
    """A block listing the body with no run in the bounds is scanned by DVID (no flush there):
    feeding it empty gives the same bytes as skipping it."""
    mask = np.zeros((24, 8, 8), bool)
    mask[0:8, 2, 0] = True  # reaches block 0's +x face: held
    mask[10, 6, 0] = True  # block 1 holds the body only outside maxy = 5
    mask[18, 3, 0] = True
    bounds = ((-(2**31),) * 3, (2**31 - 1, 5, 2**31 - 1))
    want = naive_dvid_bytes(mask, (0, 0, 0), 8, bounds)  # scans block 1: writes the held run there
    assert _stream(mask, (0, 0, 0), 8, bounds, empty_blocks=[(0, 0, 1)]) == want
    assert _stream(mask, (0, 0, 0), 8, bounds) == want
    assert decode(want).tolist() == [[0, 2, 0, 8], [18, 3, 0, 1]]


def test_run_order_rejects_disorder():
    order = sv.RunOrder(8)
    order.add((1, 0, 0), np.zeros((0, 4), int))
    with pytest.raises(sv.SparsevolError, match="order"):
        order.add((0, 0, 0), np.zeros((0, 4), int))
    with pytest.raises(sv.SparsevolError, match="not inside"):
        sv.RunOrder(8).add((0, 0, 0), [[6, 0, 0, 4]])


def test_clip_runs():
    runs = np.array([[0, 0, 0, 10], [5, 1, 0, 2], [0, 5, 0, 3], [8, 2, 7, 1]])
    got = sv.clip_runs(runs, (2, 0, 0), (6, 4, 6))
    np.testing.assert_array_equal(got, [[2, 0, 0, 5], [5, 1, 0, 2]])


# --------------------------------------------------------------------------- format=blocks


def test_binary_block_equals_naive_and_decodes():
    rng = np.random.default_rng(11)
    masks = [np.zeros((16, 16, 16), bool), np.ones((16, 16, 16), bool), rng.random((16, 24, 8)) < 0.3]
    m = np.zeros((16, 16, 16), bool)
    m[:8, :8, :8] = True
    m[8:, 8:, 8:] = rng.random((8, 8, 8)) < 0.5
    masks.append(m)
    stream = sv.BLOCKS_HEADER.pack(2, 2, 2, 77)
    for k, mask in enumerate(masks):
        got = sv.binary_block((64 * k, -64, 5), mask)
        assert got == naive_binary_blocks(mask, (64 * k, -64, 5))
        if mask.shape == (16, 16, 16):
            stream += got
    label, blocks = decode_blocks(stream)
    assert label == 77 and len(blocks) == 3
    for (off, got), mask, k in zip(blocks, [masks[0], masks[1], masks[3]], (0, 1, 3), strict=True):
        assert off == (64 * k, -64, 5)
        np.testing.assert_array_equal(got, mask)
    with pytest.raises(sv.SparsevolError, match="multiples"):
        sv.binary_block((0, 0, 0), np.zeros((4, 8, 8), bool))
