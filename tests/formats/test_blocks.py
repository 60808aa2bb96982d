"""DVID /blocks streams (dvidshards.formats.blocks): dumps read back exactly, damage is typed."""

from __future__ import annotations

import gzip
import io
import struct
import sys

import numpy as np
import pyarrow as pa
import pytest

from dvidshards.errors import BlockDecodeError, DvidShardsError
from dvidshards.formats.blocks import (
    BlockStreamError,
    decode_payload,
    lz4_block_compress,
    lz4_block_decompress,
    read_stream,
)
from dvidshards.formats.codec import decode_block, encode_block
from tests.support.blocks import export_blocks
from tests.support.blockstream import write_stream


def _lz4(data: bytes) -> bytes:
    """lz4 block format by Arrow's codec (an encoder independent of the decoder under test)."""
    return pa.compress(data, codec="lz4_raw", asbytes=True)


@pytest.fixture(scope="module")
def writer_blocks(tmp_path_factory):
    from tests.support.exports import make_export

    ex = make_export(tmp_path_factory.mktemp("blocks") / "exp", shape=(150, 130, 140), scales=1)
    blocks = export_blocks(__import__("pathlib").Path(ex.root))
    assert len(blocks) > 8
    return ex, blocks


# --- dumps read back exactly ------------------------------------------------------------------------


@pytest.mark.parametrize("compression", ["gzip", "uncompressed"])
def test_dump_of_writer_blocks_reads_back_exactly(writer_blocks, compression, tmp_path):
    _, blocks = writer_blocks
    data = write_stream(blocks, compression=compression)
    # the format by hand: int32 x, y, z, nbytes then the payload
    x, y, z, n = struct.unpack_from("<4i", data, 0)
    assert (x, y, z) == blocks[0][0]
    first = data[16:16 + n]
    assert (gzip.decompress(first) if compression == "gzip" else first) == blocks[0][1]
    for source in (data, bytearray(data), memoryview(data), np.frombuffer(data, np.uint8), io.BytesIO(data)):
        got = list(read_stream(source))
        assert [c for c, _ in got] == [c for c, _ in blocks]
        assert all(a == b for (_, a), (_, b) in zip(got, blocks, strict=True))
    path = tmp_path / "dump.dat"
    path.write_bytes(data)
    with open(path, "rb") as f:
        got = list(read_stream(f, compression=compression))
    assert [b for _, b in got] == [b for _, b in blocks]
    with pytest.raises(TypeError, match="open a path"):  # formats reads bytes and files, never paths
        list(read_stream(path))


def test_lz4_payloads_of_blocks_and_of_label_volumes(writer_blocks):
    """DVID's lz4 form: a DVID block passed through, or the 64³ uint64 volume (mapped reads)."""
    _, blocks = writer_blocks
    parts = []
    for (x, y, z), block in blocks[:6]:
        parts.append(struct.pack("<4i", x, y, z, len(c := _lz4(block))) + c)
        vol = decode_block(block)
        parts.append(struct.pack("<4i", x, y, z + 100, len(c := _lz4(vol.astype("<u8").tobytes()))) + c)
    got = list(read_stream(b"".join(parts), compression="lz4"))
    assert len(got) == 12
    for k, ((x, y, z), block) in enumerate(blocks[:6]):
        assert got[2 * k] == ((x, y, z), block)  # a block is yielded as it was
        (c, enc) = got[2 * k + 1]
        assert c == (x, y, z + 100)
        np.testing.assert_array_equal(decode_block(enc), decode_block(block))  # a volume is encoded
    # auto tells them apart too
    assert [c for c, _ in read_stream(b"".join(parts))] == [c for c, _ in got]


def test_gzip_and_raw_label_volumes_become_blocks():
    rng = np.random.default_rng(5)
    vol = rng.integers(1, 9, (64, 64, 64)).astype(np.uint64)
    raw = vol.astype("<u8").tobytes()
    data = struct.pack("<4i", 3, 4, 5, len(raw)) + raw
    gz = gzip.compress(raw)
    data += struct.pack("<4i", 6, 7, 8, len(gz)) + gz
    got = list(read_stream(data))
    assert [c for c, _ in got] == [(3, 4, 5), (6, 7, 8)]
    for _, block in got:
        np.testing.assert_array_equal(decode_block(block), vol)


def test_real_dvid_block_in_a_dump(fib19_block, fib19_volume):
    """fib19's block as DVID encoded it, in DVID's native gzip form and as lz4."""
    for payload in (gzip.compress(fib19_block), _lz4(fib19_block), fib19_block):
        data = struct.pack("<4i", -2, 0, 7, len(payload)) + payload
        [(c, block)] = list(read_stream(data))
        assert c == (-2, 0, 7)  # DVID block coordinates may be negative: yielded as they are
        assert block == fib19_block
        np.testing.assert_array_equal(decode_block(block), fib19_volume)


def test_empty_stream_and_record_boundaries(writer_blocks):
    _, blocks = writer_blocks
    assert list(read_stream(b"")) == []
    data = write_stream(blocks[:3])
    ends = []
    pos = 0
    for _ in range(3):
        n = struct.unpack_from("<i", data, pos + 12)[0]
        pos += 16 + n
        ends.append(pos)
    for k, end in enumerate(ends):  # a stream cut between records is a shorter valid stream
        assert len(list(read_stream(data[:end]))) == k + 1


# --- damage is typed ----------------------------------------------------------------------------


def test_every_truncation_is_typed_and_names_the_record(writer_blocks):
    _, blocks = writer_blocks
    data = write_stream(blocks[:2])
    n0 = struct.unpack_from("<i", data, 12)[0]
    boundaries = {0, 16 + n0, len(data)}
    cuts = sorted(set(range(0, 40)) | set(range(16 + n0 - 20, 16 + n0 + 40)) | set(range(len(data) - 40, len(data)))
                  | set(np.random.default_rng(0).integers(0, len(data), 200).tolist()))
    for cut in cuts:
        if cut in boundaries:
            continue
        with pytest.raises(BlockStreamError) as e:
            list(read_stream(data[:cut]))
        k = 0 if cut < 16 + n0 else 1
        assert f"record {k} " in str(e.value) and "<bytes>" in str(e.value)
        assert "truncated" in str(e.value) or "gzip" in str(e.value), (cut, str(e.value))


@pytest.mark.parametrize("nbytes", [-1, -(1 << 31), 1 << 30])
def test_impossible_sizes(nbytes):
    with pytest.raises(BlockStreamError, match="claims"):
        list(read_stream(struct.pack("<4i", 1, 2, 3, nbytes) + b"\0" * 64))


def test_payloads_that_are_not_blocks(writer_blocks):
    _, blocks = writer_blocks
    block = blocks[0][1]
    bad = [
        gzip.compress(b"not a block at all"),                      # gunzips to garbage
        gzip.compress(block)[:-9] + b"\0" * 9,                     # corrupt gzip trailer
        gzip.compress(block) + b"xx",                              # bytes after the gzip member
        b"\x01\x02\x03",                                            # neither block nor lz4
        _lz4(block)[:-7],                                           # truncated lz4
        encode_block(np.ones((32, 32, 32), np.uint64) * 7) + b"",   # a block of the wrong size
    ]
    for payload in bad:
        data = struct.pack("<4i", 9, 9, 9, len(payload)) + payload
        with pytest.raises(BlockStreamError) as e:
            list(read_stream(data))
        assert "block (9, 9, 9)" in str(e.value)
        assert isinstance(e.value, DvidShardsError)


def test_bad_arguments():
    with pytest.raises(ValueError):
        list(read_stream(b"", compression="zip"))
    with pytest.raises(ValueError):
        list(read_stream(b"", chunk_size=60))
    with pytest.raises(TypeError):
        list(read_stream(12))
    with pytest.raises(ValueError):
        decode_payload(b"", compression="nope")


# --- lz4 blocks (the lz4 package) ----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["zeros", "random", "repeats", "short", "text"])
def test_lz4_blocks_read_arrows_encoding_and_write_what_arrow_reads(kind):
    rng = np.random.default_rng(1)
    data = {"zeros": bytes(100_000), "random": rng.integers(0, 256, 70_000, dtype=np.uint8).tobytes(),
            "repeats": (b"abcdefgh" * 5000) + bytes(rng.integers(0, 4, 5000, dtype=np.uint8)),
            "short": b"x", "text": b"the quick brown fox " * 999}[kind]
    c = _lz4(data)
    assert lz4_block_decompress(c, len(data)) == data
    assert lz4_block_decompress(c, len(data) + 1000) == data  # exact length, not the bound
    if len(data) > 1:
        with pytest.raises(BlockDecodeError, match="larger than"):
            lz4_block_decompress(c, len(data) - 1)
    for cut in (1, 2, len(c) // 2, len(c) - 1):
        if 0 < cut < len(c):
            try:
                out = lz4_block_decompress(c[:cut], len(data))
            except BlockDecodeError:
                continue
            assert out != data  # a cut that happens to end on a literal run decodes less, never garbage bytes
            assert data.startswith(out)
    mine = lz4_block_compress(data)
    assert pa.decompress(mine, len(data), codec="lz4_raw", asbytes=True) == data
    if kind in ("zeros", "repeats", "text"):
        assert len(mine) < len(data) // 4  # compressed: a client asking for lz4 gets fewer bytes


def test_lz4_blocks_refuse_bad_offsets():
    # token: 1 literal, match length 4; literal 'a'; offset 2 (> 1 byte written)
    with pytest.raises(BlockDecodeError, match="corrupt"):
        lz4_block_decompress(bytes([0x10, 0x61, 0x02, 0x00, 0x00]), 100)
    with pytest.raises(BlockDecodeError, match="corrupt"):
        lz4_block_decompress(bytes([0x10, 0x61, 0x00, 0x00, 0x00]), 100)  # offset 0
    with pytest.raises(BlockDecodeError):
        lz4_block_decompress(b"", 10)


def test_lz4_streams_round_trip(writer_blocks):
    _, blocks = writer_blocks
    data = write_stream(blocks, compression="lz4")
    assert len(data) < sum(len(b) for _, b in blocks) // 2
    assert list(read_stream(data, compression="lz4")) == list(blocks)
    assert list(read_stream(data)) == list(blocks)  # auto: neither gzip nor a raw block or volume


def test_without_lz4_an_lz4_payload_names_the_extra_and_gzip_still_reads(writer_blocks, monkeypatch):
    _, blocks = writer_blocks
    lz4_data = write_stream(blocks[:1], compression="lz4")
    monkeypatch.setitem(sys.modules, "lz4", None)
    monkeypatch.setitem(sys.modules, "lz4.block", None)
    assert list(read_stream(write_stream(blocks[:2]))) == list(blocks[:2])  # no core read needs lz4
    with pytest.raises(BlockStreamError, match=r"record 0 .*lz4.*dvidshards\[serve\]"):
        list(read_stream(lz4_data, compression="lz4"))
    with pytest.raises(BlockDecodeError, match=r"dvidshards\[serve\]"):
        lz4_block_compress(blocks[0][1])
