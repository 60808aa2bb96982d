"""DVID block → compressed_segmentation transcoder, byte-compared with TensorStore's encoder."""

from __future__ import annotations

import contextlib
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from dvidshards.errors import BlockDecodeError
from dvidshards.formats import cseg, jit
from dvidshards.formats.codec import decode_block, encode_block
from dvidshards.formats.cseg import is_background, transcode, transcode_u8
from tests.support.blocks import build_block, random_block, ts_encode, ts_encode_chunks
from tests.support.kernels import compiles_held
from tests.support.waiting import HANG_SECONDS


@pytest.fixture(params=["compiled", "fallback"])
def kernels(request):
    """Run a test through the compiled kernel, then through its numpy fallback (what a fresh
    worker answers with while numba compiles): both are held to TensorStore's bytes."""
    if request.param == "compiled":
        cseg._kernel.compile()
        yield request.param
    else:
        with jit.fallbacks():
            yield request.param


def check(block, palette=None):
    """transcode(block, palette) is TensorStore's encoding of the decoded voxels, byte for byte."""
    got = transcode(block, palette)
    vol = decode_block(block, palette)
    want = ts_encode(vol)
    if want is None:  # TensorStore does not store an all-zero chunk
        assert not vol.any() and is_background(got, vol.shape)
    else:
        assert got == want
        assert not is_background(got, vol.shape)
    return got


# --------------------------------------------------------------------------- real blocks


@pytest.fixture(scope="module")
def real_tensorstore_bytes(real_records) -> dict:
    """{labels: TensorStore's chunk of every real record}, encoded once for both kernel modes."""
    origins = [np.array([r["chunk_x"], r["chunk_y"], r["chunk_z"]]) * 64 for r in real_records]
    return {mode: ts_encode_chunks(origins, [decode_block(r["block"], _palette(r, mode)) for r in real_records])
            for mode in ("agglomerated", "supervoxels")}


def _palette(rec, mode):
    return np.array(rec["labels"], np.uint64) if mode == "agglomerated" else None


@pytest.mark.parametrize("mode", ["agglomerated", "supervoxels"])
def test_real_shard_bytes_equal_tensorstore(real_records, real_tensorstore_bytes, mode, kernels):
    assert len(real_records) == 258
    for rec, want in zip(real_records, real_tensorstore_bytes[mode], strict=True):
        got = transcode(rec["block"], _palette(rec, mode))
        assert want is not None and got == want, (rec["chunk_x"], rec["chunk_y"], rec["chunk_z"])


def test_real_supervoxel_list_as_palette(real_records):
    # the supervoxels column is the block label list: as a palette it changes nothing
    for rec in real_records[:40]:
        assert transcode(rec["block"], np.array(rec["supervoxels"], np.uint64)) == transcode(rec["block"])


def test_fib19(fib19_block, fib19_volume, kernels):
    got = check(fib19_block)
    n = int.from_bytes(fib19_block[12:16], "little")
    rng = np.random.default_rng(1)
    check(fib19_block, rng.integers(0, 3, n).astype(np.uint64))  # heavy merging
    check(fib19_block, np.arange(n, 0, -1, dtype=np.uint64))  # reversed order
    assert got == ts_encode(fib19_volume)


# --------------------------------------------------------------------------- synthetic blocks


def subblock_volume(rng, per_subblock, shape=(64, 64, 64), pool=None):
    """A volume whose sub-blocks each hold per_subblock() random labels from pool."""
    nz, ny, nx = shape
    vol = np.empty(shape, np.uint64)
    pool = rng.integers(1, 2**64, 4096, dtype=np.uint64) if pool is None else pool
    for z in range(0, nz, 8):
        for y in range(0, ny, 8):
            for x in range(0, nx, 8):
                k = per_subblock()
                labs = rng.choice(pool, size=k, replace=False)
                v = labs[rng.integers(0, k, 512)]
                v[:k] = labs  # every chosen label occurs
                vol[z:z + 8, y:y + 8, x:x + 8] = rng.permutation(v).reshape(8, 8, 8)
    return vol


@pytest.mark.parametrize("order", ["appearance", "sorted"])
def test_synthetic_label_counts(order, kernels):
    rng = np.random.default_rng(7)
    cases = {
        "solid": np.full((64, 64, 64), 12345, np.uint64),
        "solid_zero": np.zeros((64, 64, 64), np.uint64),
        "two": subblock_volume(rng, lambda: 2),
        "two_of_three": subblock_volume(rng, lambda: 2, pool=np.array([5, 9, 2**63 + 1], np.uint64)),
        "few": subblock_volume(rng, lambda: int(rng.integers(1, 9))),
        "mixed": subblock_volume(rng, lambda: int(rng.choice([1, 2, 3, 4, 5, 17, 33, 64, 65]))),
        "wide": subblock_volume(rng, lambda: int(rng.integers(100, 300))),
        "all_512": subblock_volume(rng, lambda: 512, pool=np.arange(1, 40000, dtype=np.uint64)),
        "512_shared": subblock_volume(rng, lambda: 512, pool=np.arange(512, dtype=np.uint64)),
        "bits_edges": subblock_volume(rng, lambda: int(rng.choice([2, 3, 4, 5, 16, 17, 256, 257]))),
    }
    for vol in cases.values():
        block = encode_block(vol, subblock_order=order)
        check(block)
        n = int.from_bytes(block[12:16], "little")
        for pal in (
            rng.integers(0, 2**64, n, dtype=np.uint64),  # high bits set: unsigned sort
            rng.integers(0, 4, n).astype(np.uint64),  # many labels -> few bodies
            np.full(n, 77, np.uint64),  # all equal after mapping
            np.zeros(n, np.uint64),  # everything maps to background
            np.arange(n, dtype=np.uint64)[::-1].copy(),  # order reversed
            (np.arange(n) // 2).astype(np.uint64),  # pairs merged
        ):
            check(block, pal)


def test_all_zero_chunk_is_background(kernels):
    block = encode_block(np.zeros((64, 64, 64), np.uint64))
    got = transcode(block)
    assert is_background(got) and ts_encode(np.zeros((64, 64, 64), np.uint64)) is None
    assert not is_background(transcode(block, np.array([3], np.uint64)))
    vol = np.zeros((64, 64, 64), np.uint64)
    vol[5, 6, 7] = 1
    assert not is_background(transcode(encode_block(vol)))


def test_non_cubic_block_grid(kernels):
    rng = np.random.default_rng(3)
    vol = subblock_volume(rng, lambda: int(rng.integers(1, 6)), shape=(16, 40, 8))
    check(encode_block(vol))


def test_builder_blocks_unused_duplicate_and_empty(kernels):
    """Blocks the encoder never writes: nsb == 0, unused and repeated labels, any index order."""
    rng = np.random.default_rng(11)
    for _ in range(30):
        block, vol = random_block(rng, (8, 8, 8), int(rng.integers(2, 40)),
                                  max_sb_labels=int(rng.choice([3, 8, 70])), zero_frac=0.2)
        np.testing.assert_array_equal(decode_block(block), vol)
        check(block)
    # listed but unused indices; the same label listed twice in a sub-block
    labels = np.array([9, 4, 9, 2**64 - 1, 0], np.uint64)
    v = np.zeros(512, np.int64)
    v[::3] = 2
    subs = [([0, 1, 2, 3], v), ([4, 0, 2], np.ones(512, np.int64)), ([3], None), ([], None),
            ([1, 0], np.zeros(512, np.int64)), ([1, 0], np.ones(512, np.int64)), ([2, 0], v % 2)]
    subs += [([0, 3, 1, 4, 2], np.arange(512) % 5)] * (512 - len(subs))
    block, vol = build_block((8, 8, 8), labels, subs)
    np.testing.assert_array_equal(decode_block(block), vol)
    check(block)
    check(block, np.array([1, 1, 2, 2, 0], np.uint64))


def test_palette_argument_forms(fib19_block):
    n = int.from_bytes(fib19_block[12:16], "little")
    pal = np.arange(1, n + 1, dtype=np.uint64)
    want = transcode(fib19_block, pal)
    assert transcode(fib19_block, pal.astype(np.int32)) == want
    assert transcode(fib19_block, list(range(1, n + 1))) == want
    assert transcode(np.frombuffer(fib19_block, np.uint8), pal) == want
    assert transcode(bytearray(fib19_block), pal[::1]) == want
    with pytest.raises(BlockDecodeError):
        transcode(fib19_block, -pal.astype(np.int64))
    with pytest.raises(BlockDecodeError):
        transcode(fib19_block, pal.reshape(1, -1))


# --------------------------------------------------------------------------- malformed blocks


def test_truncated_blocks(fib19_block, real_records, kernels):
    for block in (fib19_block, real_records[0]["block"], encode_block(np.ones((64, 64, 64), np.uint64))):
        n = len(block)
        for cut in sorted({*range(0, 40), *range(n - 600, n, 7), n - 1}):
            if 0 <= cut < n:
                with pytest.raises(BlockDecodeError):
                    transcode(block[:cut])


def test_bad_headers_and_indices(fib19_block, kernels):
    n = int.from_bytes(fib19_block[12:16], "little")
    with pytest.raises(BlockDecodeError, match="palette has"):
        transcode(fib19_block, np.zeros(n + 1, np.uint64))
    for grid in ((0, 8, 8), (8, 129, 8)):
        with pytest.raises(BlockDecodeError, match="grid"):
            transcode(struct.pack("<3I", *grid) + fib19_block[12:])
    with pytest.raises(BlockDecodeError, match="empty"):
        transcode(fib19_block[:12] + struct.pack("<I", 0) + fib19_block[16:])
    # a sub-block claiming 513 labels
    p = 16 + 8 * n
    bad = bytearray(fib19_block)
    bad[p:p + 2] = struct.pack("<H", 513)
    with pytest.raises(BlockDecodeError, match="513"):
        transcode(bytes(bad))
    # a label index >= N
    nsb = np.frombuffer(fib19_block, "<u2", 512, p)
    bad = bytearray(fib19_block)
    q = p + 1024
    bad[q:q + 4] = struct.pack("<I", n)
    with pytest.raises(BlockDecodeError, match="label index"):
        transcode(bytes(bad))
    assert nsb.sum() > 0


def test_value_selecting_no_label(kernels):
    # three labels in a sub-block: 2-bit values, and the value 3 selects nothing
    v = np.zeros(512, np.int64)
    v[:3] = [0, 1, 2]
    block, _ = build_block((1, 1, 1), [1, 2, 3], [([0, 1, 2], v)])
    transcode(block)
    bad = bytearray(block)
    bad[-1] |= 0b11  # the last voxel's value becomes 3
    with pytest.raises(BlockDecodeError, match="selects no label"):
        transcode(bytes(bad))
    with pytest.raises(BlockDecodeError, match="selects no label"):
        decode_block(bytes(bad))
    # wide sub-blocks take the other path: 70 labels, 7 bits, value 127
    v = np.arange(512) % 70
    block, _ = build_block((1, 1, 1), np.arange(1, 71), [(np.arange(70), v)])
    transcode(block)
    bad = bytearray(block)
    bad[-1] |= 0x7F
    with pytest.raises(BlockDecodeError, match="selects no label"):
        transcode(bytes(bad))


def test_fuzz_agrees_with_decoder(real_records, kernels):
    """Random corruptions: transcode raises exactly when decode_block does, else bytes agree."""
    rng = np.random.default_rng(5)
    blocks = [r["block"] for r in real_records[::25]]
    for trial in range(300):
        b = bytearray(blocks[trial % len(blocks)])
        for _ in range(int(rng.integers(1, 4))):
            i = int(rng.integers(12, min(len(b), 16 + 8 * 30 + 1024 + 200)))  # grid kept
            b[i] = int(rng.integers(0, 256))
        b = bytes(b)
        try:
            decode_block(b)
        except BlockDecodeError:
            with pytest.raises(BlockDecodeError):
                transcode(b)
            continue
        check(b)


def test_transcode_u8(fib19_block, kernels):
    u8 = np.frombuffer(fib19_block, np.uint8)
    n = int.from_bytes(fib19_block[12:16], "little")
    pal = np.arange(5, 5 + n, dtype=np.uint64)
    assert transcode_u8(u8, None) == transcode(fib19_block)
    assert transcode_u8(u8, pal) == transcode(fib19_block, pal)
    for bad in ((u8, pal.astype(np.int64)), (u8[::2], None), (fib19_block, None), (u8, pal[::2])):
        with pytest.raises(BlockDecodeError):
            transcode_u8(*bad)
    with pytest.raises(BlockDecodeError, match="palette has"):
        transcode_u8(u8, pal[:-1])


def test_arguments(kernels):
    with pytest.raises(BlockDecodeError):
        transcode(np.zeros(100, np.uint16))
    with pytest.raises(TypeError):
        transcode(12)


def test_fallback_equals_kernel_on_random_blocks():
    """The numpy fallback returns the kernel's bytes, or the kernel's error, block for block."""
    cseg._kernel.compile()
    rng = np.random.default_rng(21)
    for k in range(40):
        grid = tuple(int(v) for v in rng.integers(1, 4, 3)) if k % 2 else (8, 8, 8)
        block, _ = random_block(rng, grid, int(rng.integers(1, 600)),
                                max_sb_labels=int(rng.choice([2, 3, 6, 40, 300, 512])), zero_frac=0.1)
        if k % 3 == 0:  # damage some: the same code and message from both
            b = bytearray(block)
            for _ in range(3):
                b[int(rng.integers(12, len(b)))] = int(rng.integers(0, 256))
            block = bytes(b[:len(b) - int(rng.integers(0, 3))])
        n = int.from_bytes(block[12:16], "little")
        for pal in (None, rng.integers(0, 5, n).astype(np.uint64)):
            outcome = []
            for ctx in (contextlib.nullcontext(), jit.fallbacks()):
                with ctx:
                    try:
                        outcome.append(transcode(block, pal))
                    except BlockDecodeError as e:
                        outcome.append(str(e))
            assert outcome[0] == outcome[1], k


def test_fresh_process_answers_before_numba_compiles(tmp_path):
    """A fresh worker with an empty numba cache: the first transcode answers through the fallback
    (the kernel is still compiling in the background), with TensorStore's bytes."""
    vol = (np.arange(64 ** 3, dtype=np.uint64).reshape(64, 64, 64) // 5000) % 7
    block = encode_block(vol)  # here: the child compiles nothing but what it is tested on
    code = """if True:
        import os, sys
        import numpy as np
        from dvidshards.formats import cseg
        got = cseg.transcode(bytes.fromhex(sys.stdin.read()))
        print(cseg._kernel.ready, got.hex(), flush=True)
        os._exit(0)  # do not wait for the background compile at exit
    """
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"), "DVIDSHARDS_KERNELS": "background"}
    with compiles_held(cseg._kernel, tmp_path / "numba"):  # its helper waits: the kernel cannot be ready yet
        out = subprocess.run([sys.executable, "-c", code], env=env, input=block.hex(), capture_output=True,
                             text=True, timeout=HANG_SECONDS)
    assert out.returncode == 0, out.stderr
    ready, hexbytes = out.stdout.split()
    assert ready == "False"
    assert bytes.fromhex(hexbytes) == ts_encode(vol)
