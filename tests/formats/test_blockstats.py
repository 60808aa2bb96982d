"""blockstats: per-label counts and exact boxes of DVID blocks vs brute force over decode_block."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dvidshards.errors import BlockDecodeError
from dvidshards.formats import blockstats, jit
from dvidshards.formats.blockstats import BlockError, batch_stats
from dvidshards.formats.codec import decode_block, encode_block
from tests.support.blocks import build_block, random_block
from tests.support.blockstats import block_stats


@pytest.fixture(autouse=True, params=["compiled", "fallback"])
def kernels(request):
    """Every test through the compiled kernels, then through their numpy fallbacks (what a fresh
    worker or notebook answers with while numba compiles): both are held to brute force."""
    if request.param == "compiled":
        blockstats._batch.compile()
        yield request.param
    else:
        with jit.fallbacks():
            yield request.param


def brute(block: bytes, extent=None, lo=(0, 0, 0)):
    """(counts, boxes) per list entry from the decoded voxels (0 marks empty sub-blocks)."""
    n = struct.unpack_from("<I", block, 12)[0]
    pal = np.arange(1, n + 1, dtype=np.uint64)  # 0 = empty sub-block
    gx, gy, gz = struct.unpack_from("<3I", block, 0)
    ex, ey, ez = extent if extent is not None else (8 * gx, 8 * gy, 8 * gz)
    # decode only the extent: values beyond it are never read
    out = np.empty((min(ez, 8 * gz), min(ey, 8 * gy), min(ex, 8 * gx)), np.uint64)
    vol = decode_block(block, palette=pal, out=out)[lo[2]:, lo[1]:, lo[0]:]
    counts = np.bincount(vol.ravel().astype(np.int64), minlength=n + 1)
    boxes = np.zeros((n + 1, 6), dtype=np.int64)
    for k in np.flatnonzero(counts):
        z, y, x = np.nonzero(vol == k)
        boxes[k] = x.min(), y.min(), z.min(), x.max() + 1, y.max() + 1, z.max() + 1
        boxes[k] += np.tile(lo, 2)
    return counts[1:], boxes[1:]


def check(block: bytes, extent=None, lo=(0, 0, 0)):
    s = block_stats(block, extent, lo=lo)
    counts, boxes = brute(block, extent, lo)
    np.testing.assert_array_equal(s.counts, counts)
    np.testing.assert_array_equal(s.boxes, boxes)
    n = struct.unpack_from("<I", block, 12)[0]
    np.testing.assert_array_equal(s.labels, np.frombuffer(block, "<u8", n, 16))
    return s


@pytest.mark.parametrize("max_sb", [2, 3, 4, 8, 9, 17, 40, 200, 512])
def test_random_blocks_every_bit_width(max_sb):
    rng = np.random.default_rng(max_sb)
    for grid in [(1, 1, 1), (2, 3, 4), (8, 8, 8)]:
        nl = max(max_sb, 3)
        block, _ = random_block(rng, grid, nl, max_sb_labels=max_sb, zero_frac=0.15)
        check(block)
        g = 8 * np.array(grid[::-1])
        check(block, tuple(int(v) for v in rng.integers(0, g + 1)))  # cropped edge chunk
        lo = tuple(int(v) for v in rng.integers(0, g // 2 + 1))
        check(block, tuple(int(v) for v in rng.integers(g // 2, g + 1)), lo=lo)  # a box
        check(block, lo=lo)


def test_one_bit_subblocks_and_repeated_labels():
    # 1-bit rows take the popcount path; a label listed twice keeps two separate entries
    rng = np.random.default_rng(5)
    subs = []
    for i in range(8):
        v = rng.integers(0, 2, size=512)
        v[:2] = (0, 1)
        subs.append(([i % 3, (i + 1) % 3], v))
    block, _ = build_block((2, 2, 2), [7, 7, 9], subs)
    check(block)
    for ext in [(16, 16, 16), (1, 16, 16), (9, 3, 16), (16, 16, 1), (0, 5, 5), (100, 100, 100)]:
        check(block, ext)
        check(block, ext, lo=(1, 8, 3))


def test_solid_and_single_label_subblocks():
    block, _ = build_block((8, 8, 8), [42])
    s = check(block)
    assert s.counts.tolist() == [64**3] and s.boxes.tolist() == [[0, 0, 0, 64, 64, 64]]
    check(block, (10, 64, 3))
    s = check(block, (10, 64, 3), lo=(2, 60, 1))
    assert s.counts.tolist() == [8 * 4 * 2] and s.boxes.tolist() == [[2, 60, 1, 10, 64, 3]]
    s = check(block, (10, 64, 3), lo=(10, 0, 0))
    assert s.counts.tolist() == [0]
    s = check(block, (0, 64, 64))
    assert s.counts.tolist() == [0] and s.boxes.tolist() == [[0] * 6]
    # nsb 0/1 only: whole sub-blocks
    subs = [([], None), ([1], None), ([0], None), ([1], None)] * 2
    block, _ = build_block((2, 2, 2), [3, 4], subs)
    s = check(block)
    assert s.counts.tolist() == [2 * 512, 4 * 512]  # and 2 * 512 voxels of empty sub-blocks, not listed
    check(block, (12, 5, 16))
    check(block, (12, 5, 16), lo=(3, 4, 9))


@given(st.data())
@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
def test_encoded_volumes_hypothesis(data):
    shape = data.draw(st.tuples(*[st.sampled_from([8, 16, 24]) for _ in range(3)]))
    k = data.draw(st.sampled_from([1, 2, 3, 5, 16, 300]))
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    vol = rng.integers(0, k, size=shape, dtype=np.uint64) * np.uint64(2**40 + 1)
    if data.draw(st.booleans()):  # runs: few labels per sub-block
        vol = np.sort(vol, axis=data.draw(st.integers(0, 2)))
    block = encode_block(vol, subblock_order=data.draw(st.sampled_from(["appearance", "sorted"])))
    ext = data.draw(st.tuples(*[st.integers(0, s + 3) for s in shape[::-1]]))
    lo = data.draw(st.tuples(*[st.integers(0, s) for s in shape[::-1]]))
    check(block)
    check(block, ext)
    check(block, ext, lo=lo)
    # per label (the decode of the block itself), labels listed once by the encoder
    s = block_stats(block, ext)
    crop = vol[: ext[2], : ext[1], : ext[0]]
    lab, cnt = np.unique(crop, return_counts=True)
    got = dict(zip(s.labels[s.counts > 0].tolist(), s.counts[s.counts > 0].tolist(), strict=True))
    assert got == dict(zip(lab.tolist(), cnt.tolist(), strict=True))


def test_fib19_and_real_records(fib19_block, real_records):
    check(fib19_block)
    check(fib19_block, (64, 40, 7))
    for rec in real_records[::7]:
        check(rec["block"])
    check(real_records[0]["block"], (33, 64, 17))


def test_a_negative_box_is_refused():
    rng = np.random.default_rng(2)
    block, _ = random_block(rng, (2, 2, 2), 5, max_sb_labels=4)
    with pytest.raises(BlockDecodeError, match="non-negative"):
        block_stats(block, (16, -1, 16))
    with pytest.raises(BlockDecodeError, match="non-negative"):
        block_stats(block, lo=(0, -3, 0))


def _decode_error(block: bytes, extent):
    ex, ey, ez = extent
    gx, gy, gz = struct.unpack_from("<3I", block, 0) if len(block) >= 12 else (1, 1, 1)
    try:
        if not all(1 <= g <= 128 for g in (gx, gy, gz)):
            decode_block(block)
        else:
            out = np.empty((min(ez, 8 * gz), min(ey, 8 * gy), min(ex, 8 * gx)), np.uint64)
            decode_block(block, out=out)
    except BlockDecodeError as e:
        return str(e)
    return None


def test_malformed_blocks_same_errors_as_decoder():
    rng = np.random.default_rng(11)
    block, _ = random_block(rng, (2, 2, 2), 40, max_sb_labels=12, zero_frac=0.1)
    cases = [block[:n] for n in (0, 5, 15, 16, 40, 16 + 8 * 40, 16 + 8 * 40 + 9, len(block) - 1)]
    cases.append(struct.pack("<4I", 0, 1, 1, 1) + bytes(8))
    cases.append(struct.pack("<4I", 1, 1, 1, 0) + bytes(8))
    cases.append(struct.pack("<4I", 129, 1, 1, 1) + bytes(8))
    b = bytearray(block)
    struct.pack_into("<H", b, 16 + 8 * 40 + 2, 513)  # nsb > 512
    cases.append(bytes(b))
    b = bytearray(block)
    struct.pack_into("<I", b, 16 + 8 * 40 + 16, 40)  # index == N
    cases.append(bytes(b))
    b = bytearray(block)
    b[-64:] = b"\xff" * 64  # packed values >= nsb (12 labels in 4 bits)
    cases.append(bytes(b))
    for _ in range(300):  # random byte flips
        b = bytearray(block)
        for p in rng.integers(0, len(b), size=rng.integers(1, 4)):
            b[p] = int(rng.integers(0, 256))
        cases.append(bytes(b))
    nerr = 0
    for c in cases:
        for ext in [(16, 16, 16), (5, 16, 9)]:
            want = _decode_error(c, ext)
            if want is None:
                check(c, ext)
            else:
                nerr += 1
                with pytest.raises(BlockDecodeError) as ei:
                    block_stats(c, ext)
                assert str(ei.value) == want
    assert nerr > 20


def test_batch_equals_single_blocks():
    rng = np.random.default_rng(8)
    blocks, los, his = [], [], []
    for k in range(40):
        grid = tuple(int(v) for v in rng.integers(1, 4, 3))
        if k % 7 == 0:
            b, _ = build_block(grid, [int(rng.integers(1, 99))])
        else:
            b, _ = random_block(rng, grid, 12, max_sb_labels=int(rng.integers(2, 12)))
        g = 8 * np.array(grid[::-1])
        lo = rng.integers(0, g // 2 + 1) if k % 3 else np.zeros(3, np.int64)
        hi = rng.integers(g // 2, g + 5)
        blocks.append(b), los.append(lo), his.append(hi)
    blocks.append(blocks[3])  # a block after a long list, and an empty batch below
    los.append(np.zeros(3, np.int64)), his.append(np.full(3, 64))
    offs = np.cumsum([0] + [len(b) for b in blocks])
    buf = np.frombuffer(b"".join(blocks), np.uint8)
    nl = [struct.unpack_from("<I", b, 12)[0] for b in blocks]
    blk, ent, lab, vox, box = batch_stats(buf, offs, np.array(los), np.array(his), np.array(nl))
    rows = set(zip(blk.tolist(), ent.tolist(), lab.tolist(), vox.tolist(), map(tuple, box.tolist()), strict=True))
    want = set()
    for k, b in enumerate(blocks):
        counts, boxes = brute(b, tuple(his[k]), tuple(los[k]))
        labels = np.frombuffer(b, "<u8", len(counts), 16)
        for j in np.flatnonzero(counts):
            want.add((k, int(j), int(labels[j]), int(counts[j]), tuple(boxes[j].tolist())))
    assert rows == want and len(rows) > 100
    assert all(len(a) == 0 for a in batch_stats(buf[:0], np.zeros(1), np.zeros((0, 3)), np.zeros((0, 3)), []))
    # the first bad block is named by its index, with the decoder's message
    bad = bytearray(blocks[5])
    struct.pack_into("<I", bad, 8, 0)
    blocks2 = blocks[:5] + [bytes(bad)] + blocks[6:]
    buf2 = np.frombuffer(b"".join(blocks2), np.uint8)
    with pytest.raises(BlockError, match="grid") as ei:
        batch_stats(buf2, offs, np.array(los), np.array(his), np.array(nl))
    assert ei.value.index == 5 and isinstance(ei.value, BlockDecodeError)
    nl2 = list(nl)
    nl2[9] += 1
    with pytest.raises(BlockError, match="label lists have") as ei:
        batch_stats(buf, offs, np.array(los), np.array(his), np.array(nl2))
    assert ei.value.index == 9 and ei.value.list_mismatch
    with pytest.raises(BlockDecodeError, match="offsets"):
        batch_stats(buf, offs[::-1], np.array(los), np.array(his), np.array(nl))
    trunc = np.frombuffer(blocks[1][:20], np.uint8)  # label list cut short
    with pytest.raises(BlockError, match="needs"):
        batch_stats(trunc, np.array([0, 20]), np.zeros((1, 3)), np.full((1, 3), 8), np.array([nl[1]]))

