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


def naive_dvid_bytes(mask: np.ndarray, offset, block: int) -> bytes:
    """DVID's sparsevol stream by loops over voxels (mask indexed [x, y, z])."""
    ox, oy, oz = (int(v) for v in offset)
    nx, ny, nz = mask.shape
    present = set()
    for x in range(nx):
        for y in range(ny):
            for z in range(nz):
                if mask[x, y, z]:
                    present.add(((oz + z) // block, (oy + y) // block, (ox + x) // block))
    out: list[tuple[int, int, int, int]] = []
    buf: dict[tuple[int, int], list[int]] = {}  # (y, z) -> [x, y, z, length]
    prev = None

    def flush():
        for key in sorted(buf, key=lambda yz: (yz[1], yz[0])):
            out.append(tuple(buf[key]))
        buf.clear()

    for bz, by, bx in sorted(present):
        if prev is not None and (bz, by, bx - 1) != prev:
            flush()
        for z in range(bz * block, (bz + 1) * block):
            for y in range(by * block, (by + 1) * block):
                run = buf.pop((y, z), None)
                for x in range(bx * block, (bx + 1) * block):
                    i, j, k = x - ox, y - oy, z - oz
                    fg = 0 <= i < nx and 0 <= j < ny and 0 <= k < nz and bool(mask[i, j, k])
                    if fg:
                        if run is None:
                            run = [x, y, z, 1]
                        else:
                            run[3] += 1
                    elif run is not None:
                        out.append(tuple(run))
                        run = None
                if run is not None:
                    buf[(y, z)] = run
        prev = (bz, by, bx)
    flush()
    head = struct.pack("<BBBBII", 0, 3, 0, 0, 0, len(out))
    return head + b"".join(struct.pack("<4i", *r) for r in out)


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


def random_body(rng: np.random.Generator, shape) -> np.ndarray:
    """Blobs, solid boxes and noise: runs across block faces, solid blocks, single voxels."""
    m = rng.random(shape) < 0.15
    for _ in range(4):
        lo = [int(rng.integers(0, s)) for s in shape]
        hi = [min(s, lo_ + int(rng.integers(1, s))) for lo_, s in zip(lo, shape, strict=True)]
        m[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]] = rng.random() < 0.8
    return m


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
    assert sv.encode_runs(runs, order="dvid", block_size=block) == naive_dvid_bytes(mask, offset, block)


@pytest.mark.parametrize("seed,shape,offset,block", CASES)
def test_zyx_runs_and_coarse_match_naive(seed, shape, offset, block):
    rng = np.random.default_rng(100 + seed)
    mask = random_body(rng, shape)
    runs = sv.runs_from_mask(mask, offset)
    assert [tuple(r) for r in runs.tolist()] == naive_zyx_runs(mask, offset)
    zyx = sv.encode_runs(runs, order="zyx")
    assert zyx[12:] == runs.astype("<i4").tobytes()
    blocks = sv.blocks_from_runs(runs, block)
    assert sv.encode_coarse(blocks) == naive_coarse_bytes(mask, offset, block)
    # coarse decodes like a fine sparse volume of block coordinates
    np.testing.assert_array_equal(sv.decode(sv.encode_coarse(blocks)), sv.coarse_runs(blocks))


@pytest.mark.parametrize("seed", range(4))
def test_chunked_read_gives_same_bytes(seed):
    rng = np.random.default_rng(200 + seed)
    shape, offset, chunk = (45, 30, 26), (64 * seed - 20, 7, 128), (16, 8, 11)
    mask = random_body(rng, shape)
    whole = sv.encode_runs(sv.runs_from_mask(mask, offset), block_size=16)
    parts = []
    for i, j, k in itertools.product(*(range(0, s, c) for s, c in zip(shape, chunk, strict=True))):
        sub = mask[i:i + chunk[0], j:j + chunk[1], k:k + chunk[2]]
        parts.append(sv.runs_from_mask(sub, (offset[0] + i, offset[1] + j, offset[2] + k)))
    rng.shuffle(parts)
    assert sv.encode_runs(sv.merge_runs(*parts), block_size=16) == whole
    assert sv.encode_runs(np.concatenate(parts), block_size=16) == whole  # encode merges too


def test_round_trips():
    rng = np.random.default_rng(7)
    mask = random_body(rng, (30, 20, 10))
    lo = np.array([3, -4, 9])
    runs = sv.runs_from_mask(mask, lo)
    for order in ("dvid", "zyx"):
        data = sv.encode_runs(runs, order=order, block_size=8)
        back = sv.decode(data)
        np.testing.assert_array_equal(sv.merge_runs(back), runs)
        np.testing.assert_array_equal(sv.mask_from_runs(back, lo, lo + mask.shape), mask)
    assert sv.voxel_count(runs) == int(mask.sum())
    # a box larger than the body pads with False; a smaller one crops
    big = sv.mask_from_runs(runs, lo - 2, lo + np.array(mask.shape) + 3)
    assert big.sum() == mask.sum() and big[2:-3, 2:-3, 2:-3].tolist() == mask.tolist()
    crop = sv.mask_from_runs(runs, lo + 5, lo + 9)
    np.testing.assert_array_equal(crop, mask[5:9, 5:9, 5:9])


def test_merge_overlapping_and_touching():
    runs = np.array([[0, 0, 0, 5], [5, 0, 0, 2], [3, 0, 0, 1], [10, 0, 0, 1], [2, 1, 0, 3],
                     [9, 0, 0, 1], [0, 0, 1, 2]])
    np.testing.assert_array_equal(
        sv.merge_runs(runs), [[0, 0, 0, 7], [9, 0, 0, 2], [2, 1, 0, 3], [0, 0, 1, 2]])
    assert sv.merge_runs().shape == (0, 4)


def test_empty_and_header():
    empty = sv.encode_runs(np.zeros((0, 4), np.int32))
    assert empty == bytes([0, 3, 0, 0]) + b"\0" * 8
    assert sv.decode(empty).shape == (0, 4)
    assert sv.runs_from_mask(np.zeros((3, 4, 5), bool)).shape == (0, 4)
    assert sv.encode_coarse(np.zeros((0, 3), int)) == empty


@pytest.mark.parametrize("data,msg", [
    (b"\0\3\0", "shorter"),
    (bytes([1, 3, 0, 0]) + b"\0" * 8, "payload"),
    (bytes([0, 2, 0, 0]) + b"\0" * 8, "dimensions"),
    (bytes([0, 3, 0, 0]) + struct.pack("<II", 0, 1), "spans need"),
    (bytes([0, 3, 0, 0]) + struct.pack("<II", 0, 1) + struct.pack("<4i", 0, 0, 0, 0), "length"),
])
def test_decode_rejects(data, msg):
    with pytest.raises(sv.SparsevolError, match=msg):
        sv.decode(data)


def test_bad_runs_rejected():
    with pytest.raises(sv.SparsevolError):
        sv.encode_runs([[0, 0, 0, 0]])
    with pytest.raises(sv.SparsevolError):
        sv.encode_runs([[0.5, 0, 0, 1]])
    with pytest.raises(sv.SparsevolError):
        sv.encode_runs([[2**31 - 1, 0, 0, 2]])
    with pytest.raises(sv.SparsevolError):
        sv.encode_runs([[0, 0, 0, 1]], order="xyz")
    with pytest.raises(sv.SparsevolError):
        sv.runs_from_mask(np.zeros((2, 2), bool))
