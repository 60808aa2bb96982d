"""The body's voxels of a DVID block as bits (`block_bits`) and DVID's run order from those bits
(`RunOrder.add_bits`), compiled and through their fallbacks, against the block decoder and the
naive DVID-order encoder of tests.support.sparsevol."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from dvidshards.errors import BlockDecodeError
from dvidshards.formats import jit
from dvidshards.formats import sparsevol as sv
from dvidshards.formats.codec import decode_block, encode_block
from tests.support.sparsevol import naive_binary_blocks, naive_dvid_bytes, random_body

BOTH = [pytest.param(False, id="compiled"), pytest.param(True, id="fallback")]


def _run(fallback: bool, f, *args, **kw):
    """f through the compiled kernels, or through their numpy fallbacks (what a fresh process
    answers with while numba compiles)."""
    if fallback:
        with jit.fallbacks():
            return f(*args, **kw)
    sv._bits.compile()
    sv._order.compile()
    sv._entries.compile()
    sv._binary.compile()
    return f(*args, **kw)


def random_block(rng, shape=(16, 24, 32), labels_per_sub=None) -> np.ndarray:
    """(z, y, x) labels: per 8³ sub-block 1 to 300 distinct labels (every bit width 0..9)."""
    vol = np.zeros(shape, np.uint64)
    gz, gy, gx = (n // 8 for n in shape)
    for z in range(gz):
        for y in range(gy):
            for x in range(gx):
                k = labels_per_sub or int(rng.choice([1, 1, 2, 3, 4, 5, 9, 17, 40, 300]))
                ids = rng.choice(np.arange(1, 400, dtype=np.uint64), k, replace=False)
                vol[8 * z:8 * z + 8, 8 * y:8 * y + 8, 8 * x:8 * x + 8] = rng.choice(ids, (8, 8, 8))
    return vol


def want_bits(vol, members, lo, hi) -> np.ndarray:
    m = np.isin(vol, members)
    z, y, x = np.ogrid[:vol.shape[0], :vol.shape[1], :vol.shape[2]]
    m &= (x >= lo[0]) & (x < hi[0]) & (y >= lo[1]) & (y < hi[1]) & (z >= lo[2]) & (z < hi[2])
    return np.packbits(m, axis=2, bitorder="little")


@pytest.mark.parametrize("fallback", BOTH)
@pytest.mark.parametrize("seed", range(8))
def test_block_bits_equal_the_decoded_block(seed, fallback):
    rng = np.random.default_rng(seed)
    vol = random_block(rng)
    block = encode_block(vol, subblock_order="sorted" if seed % 2 else "appearance")
    labels = np.frombuffer(block, "<u8", int.from_bytes(block[12:16], "little"), 16)
    assert (decode_block(block) == vol).all()
    for _ in range(6):
        members = rng.choice(labels, int(rng.integers(0, len(labels) + 1)), replace=False)
        lo = rng.integers(0, 9, 3) if rng.random() < 0.5 else np.zeros(3, int)
        hi = np.array([32, 24, 16]) - (rng.integers(0, 9, 3) if rng.random() < 0.5 else 0)
        got = _run(fallback, sv.block_bits, block, np.isin(labels, members), lo, hi)
        assert (got == want_bits(vol, members, lo, hi)).all()


@pytest.mark.parametrize("fallback", BOTH)
def test_block_bits_of_solid_and_single_label_sub_blocks(fallback):
    vol = np.full((8, 8, 16), 7, np.uint64)
    solid = encode_block(vol)
    assert len(solid) == 24
    assert (_run(fallback, sv.block_bits, solid, [True]) == 255).all()
    assert not _run(fallback, sv.block_bits, solid, [False]).any()
    vol[:, :, 8:] = 9
    got = _run(fallback, sv.block_bits, encode_block(vol), [False, True], (0, 0, 0), (13, 8, 8))
    assert got[:, :, 0].tolist() == [[0] * 8] * 8 and (got[:, :, 1] == 0b11111).all()


@pytest.mark.parametrize("fallback", BOTH)
def test_block_bits_refuse_damaged_blocks(fallback):
    rng = np.random.default_rng(5)
    vol = random_block(rng, (8, 8, 8), labels_per_sub=3)  # 2 bits, 3 labels: value 3 selects none
    block = bytearray(encode_block(vol))
    n = int.from_bytes(block[12:16], "little")
    member = np.ones(n, bool)
    with pytest.raises(BlockDecodeError, match="palette has"):
        _run(fallback, sv.block_bits, bytes(block), member[:-1])
    with pytest.raises(BlockDecodeError):
        _run(fallback, sv.block_bits, bytes(block[:40]), member)
    with pytest.raises(BlockDecodeError, match="not 16x8x8"):
        _run(fallback, sv.block_bits, bytes(block), member, out=np.zeros((8, 8, 2), np.uint8))
    bad = bytearray(block)
    bad[-1] = 0xFF  # the last row's values are all 3: no label
    with pytest.raises(BlockDecodeError, match="selects no label"):
        _run(fallback, sv.block_bits, bytes(bad), member)
    # a value past the kept voxels (x >= hi) is not read, as the decoder with a cut output
    assert _run(fallback, sv.block_bits, bytes(bad), member, (0, 0, 0), (8, 8, 7)).shape == (8, 8, 1)


def _bits_stream(mask_xyz, offset, block, bounds=None, fallback=False) -> bytes:
    """The body's blocks as bits (from encoded blocks), fed to RunOrder.add_bits in (z, y, x) order."""
    off = np.asarray(offset, np.int64)
    c = np.unique((np.argwhere(mask_xyz) + off) // block, axis=0)
    if bounds is not None:
        c = c[((c >= np.asarray(bounds[0]) // block) & (c <= np.asarray(bounds[1]) // block)).all(axis=1)]
    c = c[np.lexsort((c[:, 0], c[:, 1], c[:, 2]))]
    order = sv.RunOrder(block, bounds=bounds)
    out = []
    for cc in c:
        org = cc * block
        sub = np.zeros((block,) * 3, bool)  # [x, y, z]
        a, b = np.maximum(org, off), np.minimum(org + block, off + mask_xyz.shape)
        sub[tuple(slice(a[i] - org[i], b[i] - org[i]) for i in range(3))] = \
            mask_xyz[tuple(slice(a[i] - off[i], b[i] - off[i]) for i in range(3))]
        vol = sub.T.astype(np.uint64) * 5 + 3  # (z, y, x): body 8, else 3
        blk = encode_block(np.ascontiguousarray(vol))
        labels = np.frombuffer(blk, "<u8", int.from_bytes(blk[12:16], "little"), 16)
        bits = _run(fallback, sv.block_bits, blk, labels == 8)
        out.append(_run(fallback, order.add_bits, cc, bits))
    out.append(order.finish())
    a = np.concatenate(out)
    return struct.pack("<BBBBII", 0, 3, 0, 0, 0, len(a)) + a.astype("<i4").tobytes()


@pytest.mark.parametrize("fallback", BOTH)
@pytest.mark.parametrize("seed,shape,offset,block", [
    (0, (40, 24, 20), (0, 0, 0), 8), (1, (37, 19, 23), (5, 13, 2), 8), (2, (50, 20, 18), (-17, 30, -9), 16),
    (3, (70, 12, 10), (100, 0, 64), 64), (4, (90, 70, 30), (-64, 3, 0), 32)])
def test_bits_stream_equals_dvids_order(seed, shape, offset, block, fallback):
    mask = random_body(np.random.default_rng(700 + seed), shape)
    assert _bits_stream(mask, offset, block, fallback=fallback) == naive_dvid_bytes(mask, offset, block)


@pytest.mark.parametrize("fallback", BOTH)
@pytest.mark.parametrize("seed", range(6))
def test_bounded_bits_stream_equals_dvids_bounded_scan(seed, fallback):
    rng = np.random.default_rng(800 + seed)
    shape, offset, block = (45, 30, 26), (5 * seed - 9, 3, 17), 8
    mask = random_body(rng, shape)
    a = rng.integers(-5, 20, 3) + np.array(offset)
    b = a + rng.integers(4, 40, 3)
    bounds = (a.tolist(), b.tolist())
    assert _bits_stream(mask, offset, block, bounds, fallback) == naive_dvid_bytes(mask, offset, block, bounds)


def test_add_bits_and_add_agree_block_by_block():
    """The kernel's held runs and written runs equal the numpy step's, whatever the blocks fed."""
    rng = np.random.default_rng(3)
    mask = random_body(rng, (40, 16, 16))
    got = []
    for fallback in (False, True):
        order = sv.RunOrder(8)
        steps = []
        for c in [(0, 0, 0), (1, 0, 0), (2, 0, 0), (4, 0, 0), (0, 1, 0), (1, 1, 1)]:
            sub = mask[8 * c[0]:8 * c[0] + 8, 8 * c[1]:8 * c[1] + 8, 8 * c[2]:8 * c[2] + 8]
            bits = np.packbits(sub.transpose(2, 1, 0), axis=2, bitorder="little")
            steps.append(_run(fallback, order.add_bits, c, bits).tolist())
            steps.append(order._held.tolist())
        got.append(steps)
    assert got[0] == got[1]
    with pytest.raises(sv.SparsevolError, match="order"):
        order.add_bits((0, 0, 0), np.zeros((8, 8, 1), np.uint8))
    with pytest.raises(sv.SparsevolError, match="shape"):
        sv.RunOrder(8).add_bits((0, 0, 0), np.zeros((8, 8, 2), np.uint8))


@pytest.mark.parametrize("fallback", BOTH)
def test_binary_blocks_from_bits_equal_dvids(fallback):
    rng = np.random.default_rng(11)
    for k in range(8):
        m = rng.random((16, 8, 24)) < [0.0, 0.3, 1.0, 0.97][k % 4]
        if k >= 4:
            m[:8, :, 8:16] = True
        bits = np.packbits(m, axis=2, bitorder="little")
        assert _run(fallback, sv.binary_block_bits, (64, -64, 5), bits) == naive_binary_blocks(m, (64, -64, 5))


def _outcome(f, *args):
    try:
        return "ok", f(*args).tolist()
    except BlockDecodeError as e:
        return "error", str(e)


def test_damaged_blocks_fail_alike_compiled_and_in_numpy():
    """Every byte of a block set to other values: the kernel and its fallback give the same
    bits or the same error text."""
    rng = np.random.default_rng(9)
    block = encode_block(random_block(rng, (8, 16, 16)))
    n = int.from_bytes(block[12:16], "little")
    member = rng.random(n) < 0.5
    for pos in rng.choice(len(block), 120, replace=False).tolist():
        bad = bytearray(block)
        bad[pos] = int(rng.choice([0, 1, 7, 0x80, 0xFF]))
        got = [_run(fb, _outcome, sv.block_bits, bytes(bad), member) for fb in (False, True)]
        assert got[0] == got[1], pos


@pytest.mark.parametrize("fallback", BOTH)
@pytest.mark.parametrize("seed", range(4))
def test_entries_at_points_equal_the_decoded_entries(seed, fallback):
    rng = np.random.default_rng(20 + seed)
    vol = random_block(rng, (16, 24, 32))
    block = encode_block(vol)
    n = int.from_bytes(block[12:16], "little")
    want = decode_block(block, palette=np.arange(n, dtype=np.uint64))  # each voxel's entry number
    pts = np.stack([rng.integers(0, 32, 300), rng.integers(0, 24, 300), rng.integers(0, 16, 300)], axis=1)
    got = _run(fallback, sv.entries_at, block, pts)
    np.testing.assert_array_equal(got, want[pts[:, 2], pts[:, 1], pts[:, 0]].astype(np.int64))
    solid = encode_block(np.full((8, 8, 8), 4, np.uint64))
    assert _run(fallback, sv.entries_at, solid, [[7, 7, 7], [0, 0, 0]]).tolist() == [0, 0]
    with pytest.raises(BlockDecodeError, match="outside the block"):
        _run(fallback, sv.entries_at, block, [[0, 0, 0], [32, 0, 0]])


def test_entries_of_damaged_blocks_fail_alike_compiled_and_in_numpy():
    rng = np.random.default_rng(21)
    block = encode_block(random_block(rng, (8, 16, 16)))
    pts = np.argwhere(np.ones((8, 16, 16), bool))[:, ::-1]
    for pos in rng.choice(len(block), 120, replace=False).tolist():
        bad = bytearray(block)
        bad[pos] = int(rng.choice([0, 1, 7, 0x80, 0xFF]))
        got = [_run(fb, _outcome, sv.entries_at, bytes(bad), pts) for fb in (False, True)]
        assert got[0] == got[1], pos


@pytest.mark.parametrize("fallback", BOTH)
def test_entries_of_dvids_own_block_equal_its_voxels(fib19_block, fib19_volume, fallback):
    """The point look-up reads DVID's own block (fib19) like the decoder, voxel for voxel."""
    from dvidshards.formats.codec import block_header

    rng = np.random.default_rng(3)
    xyz = np.concatenate([rng.integers(0, 64, (3000, 3)), [[0, 0, 0], [63, 63, 63]]])
    ent = _run(fallback, sv.entries_at, fib19_block, xyz)
    labels = block_header(fib19_block).labels
    want = fib19_volume[xyz[:, 2], xyz[:, 1], xyz[:, 0]]
    np.testing.assert_array_equal(np.where(ent >= 0, labels[np.maximum(ent, 0)], 0), want)


@pytest.mark.parametrize("fallback", BOTH)
def test_entries_of_a_damaged_dvid_block_are_an_error(fib19_block, fallback):
    from dvidshards.formats.codec import block_header

    n = block_header(fib19_block).num_labels
    raw = bytearray(fib19_block)
    p_idx = 16 + 8 * n + 2 * 8 ** 3
    nsb = np.frombuffer(bytes(raw[16 + 8 * n:p_idx]), "<u2")
    k = int(np.flatnonzero(nsb > 1)[0])  # a sub-block with packed values
    first = int(nsb[:k].sum())
    raw[p_idx + 4 * first:p_idx + 4 * first + 4] = np.array([n + 5], "<u4").tobytes()  # index past the list
    pts = np.array([[(k % 8) * 8, (k // 8 % 8) * 8, (k // 64) * 8]]) + np.argwhere(np.ones((8, 8, 8), bool))[:, ::-1]
    with pytest.raises(BlockDecodeError, match=f"label index {n + 5} >= N={n}"):
        _run(fallback, sv.entries_at, bytes(raw), pts)
    with pytest.raises(BlockDecodeError, match="need"):
        _run(fallback, sv.entries_at, fib19_block[:200], pts)  # truncated: the header's sizes do not fit
