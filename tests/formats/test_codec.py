"""Tests of the DVID label-block codec (dvidshards.codec, FORMATS.md §1)."""

from __future__ import annotations

import contextlib
import struct
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dvidshards
from dvidshards.errors import BlockDecodeError
from dvidshards.formats.blocklayout import MAX_GRID
from dvidshards.formats.codec import (
    BlockHeader,
    block_header,
    decode_block,
    decode_into,
    encode_block,
)
from tests.support.blocks import build_block, random_block

# --------------------------------------------------------------------------- helpers
# build_block (tests/support/blocks.py) is an independent, slow, pure-numpy builder of the format: it
# lets the tests write blocks the encoder never writes (nsb == 0 sub-blocks, repeated or unused labels,
# any index order).


def dvid_order(vol):
    """Voxels in DVID's encoding order: sub-blocks z, y, x, then voxels z, y, x inside."""
    nz, ny, nx = vol.shape
    return vol.reshape(nz // 8, 8, ny // 8, 8, nx // 8, 8).transpose(0, 2, 4, 1, 3, 5).reshape(-1)


def first_appearance(a):
    _, first = np.unique(a, return_index=True)
    return a[np.sort(first)]


def block_parts(data):
    """(labels, nsb, sbidx, packed values) of a block, parsed with plain numpy."""
    h = block_header(data)
    nsub = int(np.prod(h.grid))
    p = 16 + 8 * h.num_labels
    nsb = np.frombuffer(data, "<u2", nsub, p)
    p += 2 * nsub
    sbidx = np.frombuffer(data, "<u4", int(nsb.sum()), p)
    p += 4 * sbidx.size
    return h.labels, nsb, sbidx, bytes(data[p : h.nbytes])


# --------------------------------------------------------------------------- real DVID blocks


def test_fib19_decodes_bit_for_bit(fib19_block, fib19_volume):
    got = decode_block(fib19_block)
    assert got.dtype == np.uint64 and got.shape == (64, 64, 64) and got.flags.c_contiguous
    np.testing.assert_array_equal(got, fib19_volume)


def test_fib19_header(fib19_block, fib19_volume):
    h = block_header(fib19_block)
    assert isinstance(h, BlockHeader)
    assert h.grid == (8, 8, 8) and h.shape == (64, 64, 64)
    assert h.nbytes == len(fib19_block)
    assert h.num_labels == len(h.labels) == 18
    np.testing.assert_array_equal(np.sort(h.labels), np.unique(fib19_volume))
    assert h.labels.dtype == np.uint64 and not h.labels.flags.writeable


def test_encoder_bytes_equal_dvid_fib19(fib19_block, fib19_volume):
    """Bytes equal to DVID's own encoding of fib19 sample1.

    DVID's encodeBlock numbers each sub-block's labels in first-appearance order, which we
    reproduce; it builds the block label list by ranging over Go maps (random order), so
    equality with an arbitrary DVID block is not guaranteed in general. The fib19 fixture's
    list is in first-appearance order (our deterministic choice), so here bytes are equal.
    """
    enc = encode_block(fib19_volume)
    assert enc == fib19_block


def test_encoder_sorted_bytes_equal_real_export(real_records):
    """The real mCNS export blocks list each sub-block's labels in ascending label order (not
    DVID MakeBlock's first-appearance order); with subblock_order="sorted" the encoder
    reproduces all 258 of them byte for byte. The default order gives blocks of the same size
    with the same per-sub-block label sets, in another order."""
    for rec in real_records:
        vol = decode_block(rec["block"])
        assert encode_block(vol, subblock_order="sorted") == rec["block"]
        enc = encode_block(vol)
        assert len(enc) == len(rec["block"])
        lab_a, nsb_a, idx_a, _ = block_parts(enc)
        lab_b, nsb_b, idx_b, _ = block_parts(rec["block"])
        np.testing.assert_array_equal(nsb_a, nsb_b)
        sb = np.repeat(np.arange(nsb_a.size), nsb_a)
        pairs_a = lab_a[idx_a][np.lexsort((lab_a[idx_a], sb))]
        pairs_b = lab_b[idx_b][np.lexsort((lab_b[idx_b], sb))]
        np.testing.assert_array_equal(pairs_a, pairs_b)  # same label set in every sub-block
        assert sorted(lab_a.tolist()) == sorted(lab_b.tolist())
        np.testing.assert_array_equal(decode_block(enc), vol)


def test_fib19_volume2_round_trip(fib19_volume2):
    enc = encode_block(fib19_volume2)
    np.testing.assert_array_equal(decode_block(enc), fib19_volume2)
    h = block_header(enc)
    assert h.nbytes == len(enc)
    np.testing.assert_array_equal(h.labels, first_appearance(dvid_order(fib19_volume2)))


def test_real_records_decode(real_records):
    assert len(real_records) == 258
    out = np.empty((64, 64, 64), dtype=np.uint64)
    for rec in real_records:
        block = rec["block"]
        assert len(block) == rec["uncompressed_size"]
        h = block_header(block)
        assert h.labels.tolist() == rec["supervoxels"]
        assert h.nbytes == len(block)
        sv = np.asarray(rec["supervoxels"], dtype=np.uint64)
        lab = np.asarray(rec["labels"], dtype=np.uint64)
        plain = decode_block(block)
        assert np.array_equal(decode_block(block, palette=sv), plain)
        decode_into(np.frombuffer(block, np.uint8), lab, out)
        # every voxel is one of the record's supervoxels, and its agglomerated id is that entry's label
        # (a sorted lookup of the record's lists)
        order = np.argsort(sv, kind="stable")
        at = np.searchsorted(sv[order], plain).clip(max=len(sv) - 1)
        assert np.array_equal(sv[order][at], plain)
        assert np.array_equal(out, lab[order][at])


def test_real_records_palette_is_index_swap(real_records):
    # decode with palette = arange(N): voxel = its index in the block label list
    for rec in real_records[::10]:
        n = len(rec["supervoxels"])
        idx = decode_block(rec["block"], palette=np.arange(n, dtype=np.uint64)).astype(np.int64)
        sv = np.asarray(rec["supervoxels"], dtype=np.uint64)
        lab = np.asarray(rec["labels"], dtype=np.uint64)
        np.testing.assert_array_equal(sv[idx], decode_block(rec["block"]))
        np.testing.assert_array_equal(lab[idx], decode_block(rec["block"], palette=lab))


def test_decode_accepts_every_buffer_type(fib19_block, fib19_volume):
    arr = np.frombuffer(fib19_block, dtype=np.uint8)
    for data in (fib19_block, bytearray(fib19_block), memoryview(fib19_block), arr, arr.copy()):
        np.testing.assert_array_equal(decode_block(data), fib19_volume)
    with pytest.raises(TypeError):
        decode_block(12345)


def test_threads_decode_concurrently(real_records):
    blocks = [np.frombuffer(r["block"], np.uint8) for r in real_records]
    expected = [decode_block(b) for b in blocks]
    errors = []

    def work(k):
        out = np.empty((64, 64, 64), dtype=np.uint64)
        for _ in range(2):
            for i in range(k, len(blocks), 2):
                decode_into(blocks[i], None, out)
                if not np.array_equal(out, expected[i]):
                    errors.append(i)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


# --------------------------------------------------------------------------- synthetic blocks


def test_solid_block():
    data, vol = build_block((8, 8, 8), [123456789012345])
    assert len(data) == 24
    np.testing.assert_array_equal(decode_block(data), vol)
    np.testing.assert_array_equal(
        decode_block(data, palette=np.array([7], np.uint64)), np.full((64, 64, 64), 7)
    )
    h = block_header(data)
    assert h.num_labels == 1 and h.nbytes == 24
    # solid volumes encode to DVID's 24-byte solid form
    assert encode_block(vol) == data
    # label 0 solid
    np.testing.assert_array_equal(
        decode_block(build_block((2, 8, 4), [0])[0]), np.zeros((16, 64, 32))
    )


def test_solid_block_with_trailing_subblock_data():
    # N == 1 ignores whatever follows the label (DVID's older MakeBlock wrote nsb/sbidx there)
    data, vol = build_block((2, 2, 2), [5], pad=b"\x01\x00" * 8 + b"\x00" * 32)
    np.testing.assert_array_equal(decode_block(data), vol)
    assert block_header(data).nbytes == 24


def test_zero_label_subblocks_are_zero_not_palette():
    labels = [11, 22]
    subs = [([], None)] * 4 + [([1], None)] * 3 + [([0, 1], np.arange(512) % 2)]
    data, vol = build_block((2, 2, 2), labels, subs)
    assert (vol[:8, :8, :8] == 0).all()
    np.testing.assert_array_equal(decode_block(data), vol)
    got = decode_block(data, palette=np.array([100, 200], np.uint64))
    assert (got[:8, :16, :16] == 0).all()  # nsb == 0: value 0, palette not applied
    assert (got[8:, 8:, :8] == 200).all()


@pytest.mark.parametrize("bits", range(1, 10))
def test_every_bit_width(bits):
    rng = np.random.default_rng(bits)
    subs = []
    labels = np.arange(1000, 1000 + 512, dtype=np.uint64)[::-1].copy()
    for n in (2 ** (bits - 1) + 1, 2**bits):  # smallest and largest count of that width
        ix = rng.choice(512, size=n, replace=False)
        v = np.concatenate([np.arange(n), rng.integers(0, n, size=512 - n)])
        subs.append((ix, rng.permutation(v)))
    subs += [([3], None), ([], None)]
    data, vol = build_block((1, 2, 2), labels, subs)
    assert block_header(data).nbytes == len(data)
    np.testing.assert_array_equal(decode_block(data), vol)
    np.testing.assert_array_equal(decode_block(encode_block(vol)), vol)


def test_subblock_with_512_distinct_labels():
    labels = np.arange(1, 513, dtype=np.uint64) * 1000003
    v = np.random.default_rng(5).permutation(512)
    data, vol = build_block((1, 1, 1), labels, [(np.arange(512), v)])
    assert len(np.unique(vol)) == 512
    np.testing.assert_array_equal(decode_block(data), vol)
    enc = encode_block(vol)
    assert block_parts(enc)[1].tolist() == [512]
    np.testing.assert_array_equal(decode_block(enc), vol)


@pytest.mark.parametrize("grid", [(2, 8, 4), (1, 1, 1), (3, 5, 7), (8, 8, 8), (1, 16, 2)])
def test_block_sizes(grid):
    data, vol = random_block(np.random.default_rng(sum(grid)), grid, nlabels=12)
    h = block_header(data)
    assert h.grid == grid and h.shape == vol.shape
    np.testing.assert_array_equal(decode_block(data), vol)
    enc = encode_block(vol)
    np.testing.assert_array_equal(decode_block(enc), vol)


def test_shape_16_64_32_is_zyx():
    vol = np.zeros((16, 64, 32), np.uint64)
    vol[:, :, 16:] = 5  # x half
    vol[8:, 40:, :] = 9
    enc = encode_block(vol)
    assert struct.unpack("<3I", enc[:12]) == (4, 8, 2)  # gx, gy, gz
    np.testing.assert_array_equal(decode_block(enc), vol)


def test_label_zero_and_repeated_labels_in_list():
    # list holds 0, duplicates and an unused label; all are legal
    labels = [0, 7, 7, 0, 99]
    subs = [
        ([0, 1], np.arange(512) % 2),
        ([2, 3], (np.arange(512) // 3) % 2),
        ([4], None),
        ([1, 2, 3], np.arange(512) % 3),
    ]
    data, vol = build_block((1, 2, 2), labels, subs)
    np.testing.assert_array_equal(decode_block(data), vol)
    pal = np.array([1, 2, 3, 4, 5], np.uint64)
    got = decode_block(data, palette=pal)
    exp, _ = build_block((1, 2, 2), pal, subs)
    np.testing.assert_array_equal(got, decode_block(exp))


def test_trailing_bytes_accepted_and_nbytes_reports_size():
    data, vol = random_block(np.random.default_rng(1), (2, 2, 2), 9)
    padded = data + b"\xff" * 13
    np.testing.assert_array_equal(decode_block(padded), vol)
    assert block_header(padded).nbytes == len(data)


def test_header_labels_zero_copy():
    data, _ = random_block(np.random.default_rng(2), (2, 2, 2), 5)
    arr = np.frombuffer(bytearray(data), np.uint8)
    h = block_header(arr)
    assert np.shares_memory(h.labels, arr)
    assert not h.labels.flags.writeable
    assert arr.flags.writeable  # the caller's buffer is untouched


# --------------------------------------------------------------------------- output views


@pytest.fixture(scope="module")
def odd_block():
    return random_block(np.random.default_rng(3), (2, 8, 4), nlabels=40, max_sb_labels=9)


def _views(shape):
    nz, ny, nx = shape
    big = np.zeros((2 * nz + 3, ny + 5, 2 * nx + 1), np.uint64)
    yield "step2", big[1 : 1 + 2 * nz : 2, 2 : 2 + ny, 1 : 1 + 2 * nx : 2]
    yield "fortran", np.zeros(shape, np.uint64, order="F")
    yield "transposed", np.zeros((nx, ny, nz), np.uint64).transpose(2, 1, 0)
    yield "reversed", np.zeros(shape, np.uint64)[::-1, :, ::-1]
    yield "y-x swapped", np.zeros((nz, nx, ny), np.uint64).transpose(0, 2, 1)
    yield "sub-array", np.zeros((nz + 2, ny + 3, nx + 8), np.uint64)[1:-1, 2:-1, 8:]


def test_strided_outputs(odd_block):
    data, vol = odd_block
    for name, out in _views(vol.shape):
        got = decode_block(data, out=out)
        assert got is out
        np.testing.assert_array_equal(out, vol, err_msg=name)
    # and for a solid block
    solid, svol = build_block((2, 8, 4), [42])
    for name, out in _views(svol.shape):
        np.testing.assert_array_equal(decode_block(solid, out=out), svol, err_msg=name)


@pytest.mark.parametrize(
    "crop",
    [
        (16, 64, 32),
        (16, 64, 31),
        (1, 1, 1),
        (9, 63, 17),
        (16, 8, 8),
        (3, 64, 32),
        (0, 5, 5),
        (15, 57, 24),
    ],
)
def test_cropped_outputs(odd_block, crop):
    data, vol = odd_block
    cz, cy, cx = crop
    expected = vol[:cz, :cy, :cx]
    np.testing.assert_array_equal(decode_block(data, out=np.zeros(crop, np.uint64)), expected)
    big = np.zeros((cz + 1, cy + 1, 2 * cx + 1), np.uint64)
    out = big[1:, 1:, 1::2]
    decode_block(data, out=out)
    np.testing.assert_array_equal(out, expected)
    assert (big[0] == 0).all() and (big[:, 0] == 0).all() and (big[:, :, ::2] == 0).all()
    solid, svol = build_block((2, 8, 4), [42])
    np.testing.assert_array_equal(
        decode_block(solid, out=np.zeros(crop, np.uint64)), svol[:cz, :cy, :cx]
    )


def test_decode_does_not_write_outside_crop(odd_block):
    data, vol = odd_block
    sentinel = np.uint64(0xDEADBEEF)
    big = np.full((20, 70, 40), sentinel, np.uint64)
    out = big[2:14, 3:60, 5:30]
    decode_into(np.frombuffer(data, np.uint8), None, out)
    np.testing.assert_array_equal(out, vol[:12, :57, :25])
    mask = np.ones(big.shape, bool)
    mask[2:14, 3:60, 5:30] = False
    assert (big[mask] == sentinel).all()


# --------------------------------------------------------------------------- argument checks


@pytest.mark.parametrize("kernels", ["compiled", "fallback"])
def test_decode_into_rejects_bad_arguments(fib19_block, kernels):
    from dvidshards.formats import jit

    if kernels == "compiled":
        jit.compile_all()
        _bad_arguments(fib19_block)
    else:
        with jit.fallbacks():
            _bad_arguments(fib19_block)


def _bad_arguments(fib19_block):
    data = np.frombuffer(fib19_block, np.uint8)
    out = np.empty((64, 64, 64), np.uint64)
    n = block_header(fib19_block).num_labels
    bad_calls = {
        "data dtype": (data.view(np.uint16), None, out),
        "data 2-D": (data.reshape(-1, 16), None, out),
        "data bytes": (fib19_block, None, out),
        "out dtype int64": (data, None, out.view(np.int64)),
        "out dtype float": (data, None, np.empty((64, 64, 64))),
        "out 2-D": (data, None, np.empty((64, 4096), np.uint64)),
        "out too big": (data, None, np.empty((65, 64, 64), np.uint64)),
        "out too big x": (data, None, np.empty((64, 64, 72), np.uint64)),
        "out read-only": (
            data,
            None,
            np.frombuffer(bytes(8 * 64**3), np.uint64).reshape(64, 64, 64),
        ),
        "out list": (data, None, [[[0]]]),
        "palette short": (data, np.zeros(n - 1, np.uint64), out),
        "palette long": (data, np.zeros(n + 1, np.uint64), out),
        "palette int64": (data, np.zeros(n, np.int64), out),
        "palette 2-D": (data, np.zeros((n, 1), np.uint64), out),
        "palette list": (data, [0] * n, out),
    }
    for name, args in bad_calls.items():
        with pytest.raises(BlockDecodeError):
            decode_into(*args)
            pytest.fail(name)
    with pytest.raises(BlockDecodeError, match="palette has 17 entries, block label list has N=18"):
        decode_into(data, np.zeros(17, np.uint64), out)
    with pytest.raises(
        BlockDecodeError, match=r"out shape \(65, 64, 64\) exceeds block shape \(64, 64, 64\)"
    ):
        decode_into(data, None, np.empty((65, 64, 64), np.uint64))
    # a valid palette still works after the failures
    decode_into(data, np.arange(n, dtype=np.uint64), out)
    assert out.max() == n - 1


def test_encode_rejects_bad_volumes():
    for shape in [(8, 8), (8, 8, 12), (0, 8, 8), (8, 8, 8 * MAX_GRID + 8)]:
        with pytest.raises(ValueError):
            encode_block(np.zeros(shape, np.uint64))
    with pytest.raises(ValueError):
        encode_block(np.zeros((8, 8, 8), np.int64))
    with pytest.raises(ValueError):
        encode_block(np.zeros((8, 8, 8), np.float64))
    with pytest.raises(ValueError):
        encode_block(np.zeros((8, 8, 8), np.uint64), subblock_order="random")
    # other unsigned widths are widened
    np.testing.assert_array_equal(
        decode_block(encode_block(np.full((8, 8, 8), 3, np.uint8))), np.full((8, 8, 8), 3)
    )


# --------------------------------------------------------------------------- malformed blocks


def _hdr(gx, gy, gz, n):
    return struct.pack("<4I", gx, gy, gz, n)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "shorter than the 16-byte header"),
        (b"\x08" * 15, "shorter than the 16-byte header"),
        (_hdr(0, 8, 8, 1) + bytes(8), r"\(gx, gy, gz\)=\(0, 8, 8\) out of range"),
        (_hdr(8, 129, 8, 1) + bytes(8), "out of range: each must be 1..128"),
        (_hdr(8, 8, 2**32 - 1, 1) + bytes(8), "out of range"),
        (_hdr(8, 8, 8, 0), r"empty \(N=0\)"),
        (_hdr(8, 8, 8, 3) + bytes(16), "label list of N=3 needs 40 bytes, block has 32"),
        (_hdr(8, 8, 8, 2**32 - 1) + bytes(64), "label list of N=4294967295"),
        (
            _hdr(1, 1, 2, 2) + bytes(16) + b"\x01\x00",
            "sub-block label counts need 36 bytes, block has 34",
        ),
        (
            _hdr(1, 1, 1, 2) + bytes(16) + struct.pack("<H", 513) + bytes(4 * 513 + 576),
            "sub-block 0 claims 513 labels > 512",
        ),
        (
            _hdr(1, 1, 1, 2) + bytes(16) + struct.pack("<H", 2) + bytes(4),
            "sub-block label indices need 42 bytes, block has 38",
        ),
        (
            _hdr(1, 1, 1, 2) + bytes(16) + struct.pack("<H", 2) + bytes(8) + bytes(63),
            "packed sub-block values need 106 bytes, block has 105",
        ),
    ],
)
def test_malformed_headers(data, message):
    with pytest.raises(BlockDecodeError, match=message):
        decode_block(data)
    with pytest.raises(BlockDecodeError, match=message):
        block_header(data)


def test_index_out_of_range_message():
    labels = list(range(10, 22))  # N = 12
    subs = [([0], None)] * 5 + [([1, 2], np.arange(512) % 2)] + [([3], None)] * 2
    data, _ = build_block((2, 2, 2), labels, subs)
    arr = bytearray(data)
    p = 16 + 8 * 12 + 2 * 8 + 4 * 6  # sub-block 5's second index
    arr[p : p + 4] = struct.pack("<I", 17)
    with pytest.raises(BlockDecodeError, match=r"label index 17 >= N=12 in sub-block 5"):
        decode_block(bytes(arr))
    arr[p : p + 4] = struct.pack("<I", 2**32 - 1)
    with pytest.raises(BlockDecodeError, match="label index 4294967295 >= N=12 in sub-block 5"):
        decode_block(bytes(arr))


def test_packed_value_beyond_subblock_labels():
    # nsb = 3 uses 2-bit values; value 3 has no label
    v = np.arange(512) % 3
    data, _ = build_block((1, 1, 1), [1, 2, 3], [([0, 1, 2], v)])
    np.testing.assert_array_equal(decode_block(data).ravel(), np.array([1, 2, 3], np.uint64)[v])
    arr = bytearray(data)
    arr[-1] |= 0b11  # last voxel -> value 3
    with pytest.raises(BlockDecodeError, match="packed value >= nsb=3 in sub-block 0"):
        decode_block(bytes(arr))
    # same through the strided (scalar) and cropped paths
    with pytest.raises(BlockDecodeError):
        decode_block(bytes(arr), out=np.zeros((8, 8, 8), np.uint64, order="F"))
    with pytest.raises(BlockDecodeError):
        decode_block(bytes(arr), out=np.zeros((8, 8, 16), np.uint64)[:, :, ::2])
    # a crop that does not reach the bad voxel decodes
    decode_block(bytes(arr), out=np.zeros((8, 8, 7), np.uint64))
    for bits, n in [(3, 5), (4, 9), (9, 300)]:
        assert (n - 1).bit_length() == bits
        v = np.arange(512) % n
        data, _ = build_block((1, 1, 1), np.arange(n) + 1, [(np.arange(n), v)])
        arr = bytearray(data)
        arr[-2:] = b"\xff\xff"  # last value(s) all ones = 2**bits - 1 >= n
        with pytest.raises(BlockDecodeError, match=f"packed value >= nsb={n}"):
            decode_block(bytes(arr))


def test_every_truncation_of_fib19_is_rejected(fib19_block):
    data = np.frombuffer(fib19_block, np.uint8)
    out = np.empty((64, 64, 64), np.uint64)
    for n in range(0, len(data) - 1, 3):
        with pytest.raises(BlockDecodeError):
            decode_into(data[:n], None, out)
    with pytest.raises(BlockDecodeError):
        decode_into(data[:-1], None, out)


# --------------------------------------------------------------------------- fuzz (bounded)


def mutate(rng, block):
    """One random corruption of a valid block: truncation, bit flips, header/nsb/sbidx edits."""
    b = bytearray(block)
    h = block_header(block)
    p_nsb = 16 + 8 * h.num_labels
    nsub = int(np.prod(h.grid))
    p_idx = p_nsb + 2 * nsub
    kind = int(rng.integers(0, 8))
    if kind == 0:
        return bytes(b[: int(rng.integers(0, len(b)))])
    if kind == 1:
        for _ in range(int(rng.integers(1, 9))):
            i = int(rng.integers(0, len(b)))
            b[i] ^= 1 << int(rng.integers(0, 8))
    elif kind == 2:
        field = int(rng.integers(0, 4))
        val = int(
            rng.choice(
                [
                    0,
                    1,
                    2,
                    7,
                    8,
                    9,
                    127,
                    128,
                    129,
                    255,
                    2**16,
                    2**31,
                    2**32 - 1,
                    h.num_labels + 1,
                    h.num_labels - 1,
                ]
            )
        )
        b[4 * field : 4 * field + 4] = struct.pack("<I", val % 2**32)
    elif kind == 3 and h.num_labels > 1:
        for _ in range(int(rng.integers(1, 4))):
            i = int(rng.integers(0, nsub))
            b[p_nsb + 2 * i : p_nsb + 2 * i + 2] = struct.pack(
                "<H", int(rng.choice([0, 1, 2, 3, 255, 256, 511, 512, 513, 65535]))
            )
    elif kind == 4 and h.num_labels > 1:
        nidx = (h.nbytes - p_idx) // 4
        for _ in range(int(rng.integers(1, 4))):
            i = int(rng.integers(0, max(nidx, 1)))
            val = int(
                rng.choice([h.num_labels, h.num_labels - 1, h.num_labels + 5, 2**31, 2**32 - 1])
            )
            if p_idx + 4 * i + 4 <= len(b):
                b[p_idx + 4 * i : p_idx + 4 * i + 4] = struct.pack("<I", val)
    elif kind == 5:
        i = int(rng.integers(0, len(b)))
        b[i : i + 8] = rng.integers(0, 256, size=min(8, len(b) - i), dtype=np.uint8).tobytes()
    elif kind == 6:
        b += rng.integers(0, 256, size=int(rng.integers(1, 600)), dtype=np.uint8).tobytes()
    else:
        i = int(rng.integers(0, len(b)))
        del b[i : i + int(rng.integers(1, 64))]
    return bytes(b)


def test_fuzz_mutated_real_blocks(real_records, fib19_block):
    rng = np.random.default_rng(20240601)
    sources = [r["block"] for r in real_records] + [fib19_block]
    palettes = [np.asarray(r["labels"], np.uint64) for r in real_records] + [None]
    outs = [
        np.empty((64, 64, 64), np.uint64),
        np.empty((64, 64, 64), np.uint64, order="F"),
        np.empty((64, 64, 128), np.uint64)[:, :, ::2],
        np.empty((64, 40, 23), np.uint64),
    ]
    counts = {"decoded": 0, "rejected": 0}
    for i in range(4000):
        k = int(rng.integers(0, len(sources)))
        data = np.frombuffer(mutate(rng, sources[k]), np.uint8)
        pal = palettes[k] if i % 3 == 0 else None
        out = outs[i % len(outs)]
        try:
            decode_into(data, pal, out)
            counts["decoded"] += 1
        except BlockDecodeError:
            counts["rejected"] += 1
        try:
            h = block_header(data)
            assert h.nbytes <= len(data)
        except BlockDecodeError:
            pass
    assert counts["decoded"] > 100 and counts["rejected"] > 1000, counts


# --------------------------------------------------------------------------- property: round trip


@st.composite
def label_volumes(draw):
    shape = tuple(draw(st.sampled_from([8, 16, 24, 32])) for _ in range(3))
    labels = draw(
        st.lists(
            st.one_of(st.just(0), st.integers(1, 2**64 - 1), st.integers(1, 20)),
            min_size=1,
            max_size=7,
            unique=True,
        )
    )
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    vol = np.full(shape, labels[0], dtype=np.uint64)
    style = draw(st.sampled_from(["blobs", "noise", "layers"]))
    if style == "blobs":
        zz, yy, xx = np.indices(shape)
        for lab in labels[1:]:
            c = rng.integers(0, shape)
            r = rng.integers(2, 14)
            vol[(zz - c[0]) ** 2 + (yy - c[1]) ** 2 + (xx - c[2]) ** 2 < r * r] = lab
    elif style == "noise":
        vol[...] = np.asarray(labels, np.uint64)[rng.integers(0, len(labels), size=shape)]
    else:
        cuts = np.sort(rng.integers(0, shape[0], size=len(labels) - 1))
        for lab, c in zip(labels[1:], cuts, strict=True):
            vol[c:] = lab
    return vol


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(vol=label_volumes(), order=st.sampled_from(["appearance", "sorted"]))
def test_round_trip_property(vol, order):
    enc = encode_block(vol, subblock_order=order)
    np.testing.assert_array_equal(decode_block(enc), vol)
    h = block_header(enc)
    assert h.nbytes == len(enc)
    assert h.shape == vol.shape
    if len(np.unique(vol)) == 1:
        assert len(enc) == 24
    elif order == "appearance":
        np.testing.assert_array_equal(h.labels, first_appearance(dvid_order(vol)))
    else:
        assert sorted(h.labels.tolist()) == np.unique(vol).tolist()
    # a palette is applied per list entry
    pal = np.arange(h.num_labels, dtype=np.uint64) * 3 + 1
    idx = decode_block(enc, palette=pal)
    np.testing.assert_array_equal(h.labels[((idx - 1) // 3).astype(np.int64)], vol)


def test_first_decode_from_many_threads_at_once():
    """The lazy first-call compile is shared by threads (TensorStore's pool calls it concurrently)."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import threading, numpy as np
        from dvidshards.formats.codec import encode_block, decode_block
        blk = encode_block(np.arange(64 ** 3, dtype=np.uint64).reshape(64, 64, 64) % 5)
        barrier, errors = threading.Barrier(8), []
        def go():
            barrier.wait()
            try:
                decode_block(blk)
            except Exception as e:
                errors.append(repr(e))
        ts = [threading.Thread(target=go) for _ in range(8)]
        [t.start() for t in ts]; [t.join() for t in ts]
        print(errors or "ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "ok", out.stdout + out.stderr


# --------------------------------------------------------------------------- a row of blocks


def _row_volume(rng, counts, shape=(64, 64, 64)) -> np.ndarray:
    """A (z, y, x) volume whose 8³ sub-blocks hold the given numbers of labels, cycled."""
    vol = np.empty(shape, np.uint64)
    k = 0
    for sz in range(shape[0] // 8):
        for sy in range(shape[1] // 8):
            for sx in range(shape[2] // 8):
                n = counts[k % len(counts)]
                k += 1
                pool = rng.choice(1 << 30, size=n, replace=False).astype(np.uint64) + 1
                v = rng.permutation(np.concatenate([pool, rng.choice(pool, 512 - n)]))
                vol[8 * sz:8 * sz + 8, 8 * sy:8 * sy + 8, 8 * sx:8 * sx + 8] = v.reshape(8, 8, 8)
    return vol


def _row_case(rng, k, counts_list):
    vols = [_row_volume(rng, counts_list[i % len(counts_list)]) for i in range(k)]
    blocks = [encode_block(v, subblock_order="sorted" if i % 2 else "appearance") for i, v in enumerate(vols)]
    return vols, blocks


def _row_args(blocks, palettes):
    parts = [np.frombuffer(b, np.uint8) for b in blocks]
    offs = np.concatenate([[0], np.cumsum([p.size for p in parts])]).astype(np.int64)
    if palettes is None:
        return np.concatenate(parts), offs, None, None
    poffs = np.concatenate([[0], np.cumsum([p.size for p in palettes])]).astype(np.int64)
    return np.concatenate(parts), offs, np.concatenate(palettes).astype(np.uint64), poffs


def _row_both(blocks, palettes, make_out):
    """(row decode ok, its output) and (every block ok one by one, their output), both in one mode."""
    from dvidshards.formats.codec import decode_row_into

    out_row, out_one = make_out(), make_out()
    ok_row = decode_row_into(*_row_args(blocks, palettes), out_row)
    ok_one = True
    w = out_one.shape[2] // len(blocks)
    for i, b in enumerate(blocks):
        try:
            decode_into(np.frombuffer(b, np.uint8), None if palettes is None else palettes[i],
                        out_one[:, :, i * w:(i + 1) * w])
        except BlockDecodeError:
            ok_one = False
    return (ok_row, out_row), (ok_one, out_one)


@pytest.mark.parametrize("kernels", ["compiled", "fallback"])
@pytest.mark.parametrize("k", [1, 2, 5, 8])
def test_decode_row_equals_block_by_block(k, kernels):
    from dvidshards.formats import jit

    rng = np.random.default_rng(k)
    counts = [[1], [2, 3], [5, 8, 9], [17, 64, 300, 512], [1, 2, 4, 8]]
    vols, blocks = _row_case(rng, k, counts)
    blocks[0] = encode_block(np.full((64, 64, 64), 9, np.uint64)) if k > 2 else blocks[0]  # a solid one
    if k > 2:
        vols[0] = np.full((64, 64, 64), 9, np.uint64)
    if kernels == "compiled":
        jit.compile_all()
    for palettes in (None, [rng.integers(0, 1 << 63, block_header(b).num_labels, dtype=np.uint64) for b in blocks]):
        for layout in ("F", "view"):
            def make_out(layout=layout):
                if layout == "F":  # an (x, y, z) F-ordered array's .T
                    return np.empty((64 * k, 64, 64), np.uint64, order="F").T
                return np.empty((70, 66, 64 * k + 16), np.uint64)[3:67, 1:65, 8:8 + 64 * k]  # x contiguous, cut
            with jit.fallbacks() if kernels == "fallback" else contextlib.nullcontext():
                (ok_row, got), (ok_one, want) = _row_both(blocks, palettes, make_out)
            assert ok_row and ok_one
            np.testing.assert_array_equal(got, want)
            if palettes is None:
                np.testing.assert_array_equal(got, np.concatenate(vols, axis=2))


@pytest.mark.parametrize("kernels", ["compiled", "fallback"])
def test_decode_row_refuses_what_one_block_decoding_refuses(kernels):
    """Damage anywhere in a row: False exactly when some block fails alone; else the same voxels
    (the numpy fallback on the first 100 of the compiled kernels' 300 cases)."""
    from dvidshards.formats import jit

    rng = np.random.default_rng(7)
    _, base = _row_case(rng, 3, [[2, 3, 9], [1, 5, 17], [4]])
    seen = {True: 0, False: 0}
    if kernels == "compiled":
        jit.compile_all()
    trials = 300 if kernels == "compiled" else 100
    for trial in range(trials):
        blocks = list(base)
        i = int(rng.integers(0, 3))
        d = bytearray(blocks[i])
        what = rng.integers(0, 3)
        if what == 0:
            for _ in range(int(rng.integers(1, 4))):
                d[int(rng.integers(0, min(len(d), 6000)))] = int(rng.integers(0, 256))
        elif what == 1:
            d = d[: int(rng.integers(0, len(d)))]
        else:
            d[int(rng.integers(0, 16))] = int(rng.integers(0, 256))
        blocks[i] = bytes(d)
        with jit.fallbacks() if kernels == "fallback" else contextlib.nullcontext():
            (ok_row, got), (ok_one, want) = _row_both(blocks, None, lambda: np.zeros((64, 64, 192), np.uint64))
        assert ok_row == ok_one, trial
        if ok_row:
            np.testing.assert_array_equal(got, want)
        seen[ok_row] += 1
    assert seen[False] > trials // 6 and seen[True] > trials // 60, seen


def test_decode_row_refuses_blocks_that_do_not_fit():
    from dvidshards.formats.codec import decode_row_into

    rng = np.random.default_rng(3)
    _, blocks = _row_case(rng, 2, [[2, 3]])
    small = encode_block(_row_volume(rng, [2], (32, 32, 32)))
    for kernels in ("compiled", "fallback"):
        from dvidshards.formats import jit

        with jit.fallbacks() if kernels == "fallback" else contextlib.nullcontext():
            out = np.zeros((64, 64, 128), np.uint64)
            assert not decode_row_into(*_row_args([blocks[0], small], None), out)  # another block size
            assert not decode_row_into(*_row_args(blocks, None), np.zeros((64, 64, 192), np.uint64))  # 3 slots, 2 blocks
            assert not decode_row_into(*_row_args(blocks, None), np.zeros((128, 64, 64), np.uint64).transpose(2, 1, 0)[:, :, :])  # x strided
            pal = [np.zeros(block_header(b).num_labels + 1, np.uint64) for b in blocks]
            assert not decode_row_into(*_row_args(blocks, pal), out)  # palettes one too long


def test_decode_row_refuses_arguments_of_other_types():
    from dvidshards.formats.codec import decode_row_into

    _, blocks = _row_case(np.random.default_rng(4), 2, [[2, 3]])
    data, offs, _, _ = _row_args(blocks, None)
    out = np.zeros((64, 64, 128), np.uint64)
    assert not decode_row_into(data, offs.astype(np.int32), None, None, out)
    assert not decode_row_into(data, offs, None, None, out.astype(np.int64))
    pal = [np.zeros(block_header(b).num_labels, np.int64) for b in blocks]
    d, o, p, po = _row_args(blocks, pal)
    assert not decode_row_into(d, o, p.astype(np.float64), po, out)
    assert decode_row_into(data, offs, None, None, out)


# --- bytes that are not a DVID block -----------------------------------------------------------------


def test_decode_block_given_zstd_bytes_says_so():
    import zstandard

    from dvidshards.errors import BlockDecodeError

    with pytest.raises(BlockDecodeError, match="zstd") as e:
        dvidshards.decode_block(zstandard.ZstdCompressor().compress(b"\0" * 4096))
    assert "4294967" not in str(e.value)
