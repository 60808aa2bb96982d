"""Tests of dvidshards.sharding: neuroglancer sharding math and DVID's shard naming."""

from __future__ import annotations

import csv
import io
import itertools
import json
import struct
from pathlib import Path

import numpy as np
import pytest

from dvidshards.errors import SpecError
from dvidshards.formats.sharding import (
    PrecomputedShardWriter,
    ShardingSpec,
    compressed_morton_code,
    compressed_z_index_bits,
    dvid_shard_extent,
    dvid_shard_names_collide,
    dvid_shard_origin,
    grid_shape,
    murmurhash3_x86_128_low64,
    shard_and_minishard,
    shard_extent_chunks,
    shard_filename_stem,
    shard_key,
    shard_of_key,
)

M64 = (1 << 64) - 1


def spec(p: int, m: int, s: int, h: str = "identity") -> ShardingSpec:
    return ShardingSpec(preshift_bits=p, minishard_bits=m, shard_bits=s, hash=h)


def all_coords(grid) -> np.ndarray:
    return np.array(list(itertools.product(*(range(g) for g in grid))), dtype=np.int64).reshape(
        -1, 3
    )


# --------------------------------------------------------------------------------------
# pure-Python references, written from the algorithm descriptions
# --------------------------------------------------------------------------------------


def ref_morton(coord, grid) -> int:
    """Bit-by-bit compressed Morton code: walk bit levels, skip axes with no bits left."""
    nbits = [max(g - 1, 0).bit_length() for g in grid]
    out, pos = 0, 0
    level = 0
    while any(level < n for n in nbits):
        for axis in range(3):
            if level < nbits[axis]:
                out |= ((coord[axis] >> level) & 1) << pos
                pos += 1
        level += 1
    return out


def _rotl32(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & 0xFFFFFFFF


def _fmix32(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    h ^= h >> 16
    return h


def ref_murmur3_x86_128(data: bytes, seed: int = 0) -> tuple[int, int, int, int]:
    """MurmurHash3_x86_128 of arbitrary bytes (SMHasher's algorithm), as h1..h4."""
    c = (0x239B961B, 0xAB0E9789, 0x38B34AE5, 0xA1E38B93)
    rot_k = (15, 16, 17, 18)
    rot_h = (19, 17, 15, 13)
    add_h = (0x561CCD1B, 0x0BCAA747, 0x96CD1C35, 0x32AC3B17)
    h = [seed & 0xFFFFFFFF] * 4
    nblocks = len(data) // 16
    for b in range(nblocks):
        k = struct.unpack_from("<4I", data, 16 * b)
        for i in range(4):
            ki = (k[i] * c[i]) & 0xFFFFFFFF
            ki = _rotl32(ki, rot_k[i])
            ki = (ki * c[(i + 1) % 4]) & 0xFFFFFFFF
            h[i] ^= ki
            h[i] = _rotl32(h[i], rot_h[i])
            h[i] = (h[i] + h[(i + 1) % 4]) & 0xFFFFFFFF
            h[i] = (h[i] * 5 + add_h[i]) & 0xFFFFFFFF
    tail = data[16 * nblocks :]
    for i in range(4):
        lane = tail[4 * i : 4 * i + 4]
        if lane:
            ki = int.from_bytes(lane, "little")
            ki = (ki * c[i]) & 0xFFFFFFFF
            ki = _rotl32(ki, rot_k[i])
            ki = (ki * c[(i + 1) % 4]) & 0xFFFFFFFF
            h[i] ^= ki
    h = [x ^ len(data) for x in h]
    h[0] = (h[0] + h[1] + h[2] + h[3]) & 0xFFFFFFFF
    for i in (1, 2, 3):
        h[i] = (h[i] + h[0]) & 0xFFFFFFFF
    h = [_fmix32(x) for x in h]
    h[0] = (h[0] + h[1] + h[2] + h[3]) & 0xFFFFFFFF
    for i in (1, 2, 3):
        h[i] = (h[i] + h[0]) & 0xFFFFFFFF
    return h[0], h[1], h[2], h[3]


def ref_low64(value: int) -> int:
    h = ref_murmur3_x86_128(struct.pack("<Q", value), 0)
    return (h[1] << 32) | h[0]


# --------------------------------------------------------------------------------------
# ShardingSpec
# --------------------------------------------------------------------------------------


def test_spec_round_trip():
    d = {
        "@type": "neuroglancer_uint64_sharded_v1",
        "hash": "identity",
        "minishard_bits": 6,
        "minishard_index_encoding": "gzip",
        "preshift_bits": 9,
        "shard_bits": 19,
    }
    s = ShardingSpec.from_json(d)
    assert (s.preshift_bits, s.minishard_bits, s.shard_bits) == (9, 6, 19)
    assert s.hash == "identity"
    assert s.minishard_index_encoding == "gzip"
    assert s.data_encoding == "raw"
    j = s.to_json()
    assert j == {**d, "data_encoding": "raw"}
    assert ShardingSpec.from_json(j) == s


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"@type": "neuroglancer_uint64_sharded_v2"}, "@type"),
        ({"hash": "sha1"}, "'sha1'"),
        ({"hash": "murmurhash3_x64_128"}, "murmurhash3_x64_128"),
        ({"preshift_bits": -1}, "preshift_bits"),
        ({"minishard_bits": 2.0}, "minishard_bits"),
        ({"shard_bits": True}, "shard_bits"),
        ({"shard_bits": "3"}, "shard_bits"),
        ({"preshift_bits": 30, "minishard_bits": 30, "shard_bits": 5}, "<= 64"),
        ({"shard_bits": 65}, "shard_bits"),
        ({"minishard_index_encoding": "zstd"}, "zstd"),
        ({"data_encoding": None}, "data_encoding"),
    ],
)
def test_spec_invalid(change, message):
    d = {
        "@type": "neuroglancer_uint64_sharded_v1",
        "hash": "identity",
        "preshift_bits": 1,
        "minishard_bits": 2,
        "shard_bits": 3,
    }
    d.update(change)
    with pytest.raises(SpecError, match=message.replace("+", r"\+")):
        ShardingSpec.from_json(d)


@pytest.mark.parametrize(
    "missing", ["@type", "hash", "preshift_bits", "minishard_bits", "shard_bits"]
)
def test_spec_missing_member(missing):
    d = {
        "@type": "neuroglancer_uint64_sharded_v1",
        "hash": "identity",
        "preshift_bits": 1,
        "minishard_bits": 2,
        "shard_bits": 3,
    }
    del d[missing]
    with pytest.raises(SpecError, match=missing):
        ShardingSpec.from_json(d)


def test_spec_not_object_and_direct_construction():
    with pytest.raises(SpecError):
        ShardingSpec.from_json([1, 2, 3])  # type: ignore[arg-type]
    with pytest.raises(SpecError, match="murmur"):
        ShardingSpec(1, 2, 3, "murmur")
    assert ShardingSpec(0, 0, 64, "identity").shard_bits == 64
    assert ShardingSpec(np.int64(3), 0, 0, "identity").preshift_bits == 3


# --------------------------------------------------------------------------------------
# grid and compressed Morton code
# --------------------------------------------------------------------------------------


def test_grid_shape():
    assert grid_shape((94088, 78317, 134576), 64) == (1471, 1224, 2103)
    assert grid_shape((64, 40, 24), (8, 8, 8)) == (8, 5, 3)
    assert grid_shape((1, 65, 64), (64, 64, 64)) == (1, 2, 1)
    for bad in [
        ((0, 1, 1), 64),
        ((1, 1), 64),
        ((1, 1, 1), 0),
        ((1.5, 1, 1), 64),
        ((1, 1, 1), (8, 8)),
    ]:
        with pytest.raises(SpecError):
            grid_shape(*bad)


def test_z_index_bits():
    # TensorStore's GetCompressedZIndexBits example: shape (79, 80, 144), chunk (20, 20, 12)
    assert compressed_z_index_bits(grid_shape((79, 80, 144), (20, 20, 12))) == (2, 2, 4)
    assert compressed_z_index_bits((1, 2, 3)) == (0, 1, 2)
    assert compressed_z_index_bits((1471, 1224, 2103)) == (11, 11, 12)
    with pytest.raises(SpecError):
        compressed_z_index_bits((1 << 22, 1 << 22, 1 << 22))


def test_morton_hand_computed():
    # grid (16, 4, 2) -> bits (4, 2, 1), as in TensorStore's EncodeCompressedZIndex test
    g = (16, 4, 2)
    cases = {
        (0, 0, 0): 0,
        (1, 0, 0): 1,
        (0, 1, 0): 2,
        (0b10, 0b0, 0b1): 0b1100,
        (0b10, 0b11, 0b0): 0b11010,
        (0b1001, 0b10, 0b1): 0b1010101,
        (15, 3, 1): 0b1111111,
    }
    got = compressed_morton_code(np.array(list(cases)), g)
    assert got.dtype == np.uint64
    assert got.tolist() == list(cases.values())
    single = compressed_morton_code((0b1001, 0b10, 0b1), g)
    assert isinstance(single, np.uint64) and int(single) == 0b1010101
    # grid (5, 17, 2) -> bits (3, 5, 1): x0 y0 z0 x1 y1 x2 y2 y3 y4
    assert int(compressed_morton_code((4, 16, 1), (5, 17, 2))) == (1 << 5) | (1 << 8) | (1 << 2)
    assert int(compressed_morton_code((3, 5, 0), (5, 17, 2))) == 0b1001011  # x0 y0 x1 y2


@pytest.mark.parametrize(
    "grid", [(5, 17, 2), (1, 1, 1), (1, 9, 1), (3, 1, 100), (8, 5, 3), (33, 2, 7), (2, 2, 2)]
)
def test_morton_matches_reference(grid):
    coords = all_coords(grid)
    got = compressed_morton_code(coords, grid)
    want = [ref_morton(tuple(c), grid) for c in coords.tolist()]
    assert got.tolist() == want
    total = sum(compressed_z_index_bits(grid))
    assert len(set(want)) == len(want)  # injective
    assert max(want) < (1 << total) if total else max(want) == 0


def test_morton_random_large_grids():
    rng = np.random.default_rng(1234)
    for _ in range(20):
        grid = tuple(int(v) for v in rng.integers(1, 1 << 20, size=3))
        coords = np.stack([rng.integers(0, g, size=200) for g in grid], axis=1)
        got = compressed_morton_code(coords, grid)
        assert got.tolist() == [ref_morton(tuple(c), grid) for c in coords.tolist()]


def test_morton_invalid_coords():
    with pytest.raises(ValueError, match="outside"):
        compressed_morton_code((5, 0, 0), (5, 17, 2))
    with pytest.raises(ValueError, match="outside"):
        compressed_morton_code([[0, 0, 0], [0, 0, 2]], (5, 17, 2))
    with pytest.raises(ValueError, match="negative"):
        compressed_morton_code((-1, 0, 0), (5, 17, 2))
    with pytest.raises(ValueError):
        compressed_morton_code((0.5, 0, 0), (5, 17, 2))
    with pytest.raises(ValueError):
        compressed_morton_code((0, 0), (5, 17, 2))
    with pytest.raises(ValueError):
        compressed_morton_code(np.zeros((2, 4), dtype=int), (5, 17, 2))
    assert compressed_morton_code(np.zeros((0, 3), dtype=int), (5, 17, 2)).shape == (0,)


# --------------------------------------------------------------------------------------
# MurmurHash3
# --------------------------------------------------------------------------------------


def test_reference_murmur_smhasher_verification():
    """SMHasher's verification value for MurmurHash3_x86_128 is 0xB3ECE62A."""
    key = bytes(range(256))
    hashes = b"".join(
        struct.pack("<4I", *ref_murmur3_x86_128(key[:i], 256 - i)) for i in range(256)
    )
    final = ref_murmur3_x86_128(hashes, 0)
    assert final[0] == 0xB3ECE62A


@pytest.mark.parametrize(
    ("value", "seed", "h1", "h2"),
    [  # TensorStore murmurhash3_test.cc (values computed with pymmh3)
        (0, 0, 0xE028AE41, 0x4772B084),
        (0, 1, 0x5AD58A7E, 0x54337108),
        (0, 2, 0x64010DA2, 0x62E8BC17),
        (1, 0, 0x16D4CE9A, 0xE8BD67D6),
        (1, 1, 0x4B7AB8C6, 0xEB555955),
        (1, 2, 0xEB2301BE, 0x48E12494),
        (42, 0, 0x5119F47A, 0xC20B94F9),
        (42, 1, 0xD6B51BCA, 0xA25AD86B),
        (42, 2, 0x2D83D9C7, 0x082115EB),
    ],
)
def test_murmur_published_vectors(value, seed, h1, h2):
    h = ref_murmur3_x86_128(struct.pack("<Q", value), seed)
    assert h == (h1, h2, h2, h2)
    if seed == 0:
        assert int(murmurhash3_x86_128_low64(value)) == (h2 << 32) | h1


def test_murmur_matches_reference_random():
    rng = np.random.default_rng(7)
    values = np.concatenate(
        [
            rng.integers(0, M64, size=500, dtype=np.uint64, endpoint=True),
            np.array([0, 1, M64, 1 << 32, (1 << 32) - 1, 1 << 63], dtype=np.uint64),
        ]
    )
    got = murmurhash3_x86_128_low64(values)
    assert got.dtype == np.uint64 and got.shape == values.shape
    assert got.tolist() == [ref_low64(int(v)) for v in values]
    # shape is kept; scalars give scalars
    grid = murmurhash3_x86_128_low64(values[:6].reshape(2, 3))
    assert grid.shape == (2, 3) and grid.ravel().tolist() == got[:6].tolist()
    s = murmurhash3_x86_128_low64(np.uint64(5))
    assert isinstance(s, np.uint64) and int(s) == ref_low64(5)
    assert murmurhash3_x86_128_low64(np.array([], dtype=np.uint64)).shape == (0,)
    assert murmurhash3_x86_128_low64(np.arange(3, dtype=np.int32)).tolist() == [
        ref_low64(i) for i in range(3)
    ]
    with pytest.raises(ValueError):
        murmurhash3_x86_128_low64(np.array([-1]))
    with pytest.raises(ValueError):
        murmurhash3_x86_128_low64(np.array([1.0]))


# --------------------------------------------------------------------------------------
# shard / minishard assignment, shard keys and shard boxes
# --------------------------------------------------------------------------------------


def test_shard_and_minishard_by_hand():
    g = (16, 4, 2)  # bits (4, 2, 1)
    sp = spec(1, 2, 3)
    coords = np.array([(0b1001, 0b10, 0b1), (15, 3, 1), (0, 0, 0)])
    shard, mini = shard_and_minishard(sp, coords, g)
    # 0b1010101 >> 1 = 0b101010: minishard 0b10, shard 0b1010 & 0b111 = 0b010
    # 0b1111111 >> 1 = 0b111111: minishard 0b11, shard 0b111
    assert mini.tolist() == [0b10, 0b11, 0] and shard.tolist() == [0b010, 0b111, 0]
    s1, m1 = shard_and_minishard(sp, (15, 3, 1), g)
    assert isinstance(s1, np.uint64) and (int(s1), int(m1)) == (7, 3)
    # murmur: hashed = murmur(id >> preshift)
    smur = spec(1, 2, 3, "murmurhash3_x86_128")
    shard, mini = shard_and_minishard(smur, coords, g)
    for c, s, m in zip(coords.tolist(), shard.tolist(), mini.tolist(), strict=True):
        h = ref_low64(ref_morton(c, g) >> 1)
        assert (s, m) == ((h >> 2) & 7, h & 3)
    # preshift of 64 drops the whole id
    s64, m64 = shard_and_minishard(spec(64, 0, 0), coords, g)
    assert s64.tolist() == [0, 0, 0] and m64.tolist() == [0, 0, 0]


def test_shard_key():
    assert shard_key(0, 0) == "0.shard"
    assert shard_key(5, 3) == "5.shard"
    assert shard_key(5, 19) == "00005.shard"
    assert shard_key(0xABC, 12) == "abc.shard"
    assert shard_key(np.uint64(255), 8) == "ff.shard"
    assert shard_key((1 << 64) - 1, 64) == "ffffffffffffffff.shard"
    for bad in [(8, 3), (-1, 3), (1, -1), (1, 65), (1.0, 3)]:
        with pytest.raises(ValueError):
            shard_key(*bad)


def _random_identity_cases(rng, n, *, wrap: bool):
    cases = []
    while len(cases) < n:
        grid = tuple(int(v) for v in rng.integers(1, 24, size=3))
        total = sum(compressed_z_index_bits(grid))
        p = int(rng.integers(0, total + 2))
        m = int(rng.integers(0, total + 2 - p))
        if wrap:
            s = int(rng.integers(0, max(total - p - m, 0) + 1))
            if p + m + s >= total:
                continue
        else:
            s = max(total - p - m, 0) + int(rng.integers(0, 3))
        cases.append((grid, spec(p, m, s)))
    return cases


def test_shard_extent_boxes_are_shards():
    """Identity hash, no wrap: the boxes tiling the grid are exactly the shards."""
    rng = np.random.default_rng(99)
    for grid, sp in _random_identity_cases(rng, 60, wrap=False):
        ext = shard_extent_chunks(sp, grid)
        coords = all_coords(grid)
        shard, _ = shard_and_minishard(sp, coords, grid)
        box = [tuple(v) for v in (coords // np.array(ext)).tolist()]
        box_to_shard: dict = {}
        shard_to_box: dict = {}
        for b, s in zip(box, shard.tolist(), strict=True):
            box_to_shard.setdefault(b, set()).add(s)
            shard_to_box.setdefault(s, set()).add(b)
        assert all(len(v) == 1 for v in box_to_shard.values()), (grid, sp, ext)
        assert all(len(v) == 1 for v in shard_to_box.values()), (grid, sp, ext)
        # neighbouring boxes (along each axis) hold different shards
        for b, (s,) in box_to_shard.items():
            for axis in range(3):
                nb = list(b)
                nb[axis] += 1
                if tuple(nb) in box_to_shard:
                    assert box_to_shard[tuple(nb)] != {s}
        # a box shorter than the grid on an axis is a power of two on that axis
        for e, g in zip(ext, grid, strict=True):
            assert e == g or (e & (e - 1)) == 0


def test_shard_extent_with_wrapping_shard_numbers():
    """More Morton bits than preshift+minishard+shard: boxes still lie in one shard each."""
    rng = np.random.default_rng(5)
    for grid, sp in _random_identity_cases(rng, 40, wrap=True):
        ext = shard_extent_chunks(sp, grid)
        coords = all_coords(grid)
        shard, _ = shard_and_minishard(sp, coords, grid)
        seen: dict = {}
        for b, s in zip((coords // np.array(ext)).tolist(), shard.tolist(), strict=True):
            seen.setdefault(tuple(b), set()).add(s)
        assert all(len(v) == 1 for v in seen.values())


def test_shard_extent_by_hand_and_errors():
    # mCNS s0: grid (1471, 1224, 2103), 15 low bits -> 5 per axis
    assert shard_extent_chunks(spec(9, 6, 19), (1471, 1224, 2103)) == (32, 32, 32)
    # grid (5, 17, 2): bits (3, 5, 1); 6 low bits walk x y z x y x -> (3, 2, 1) bits
    assert shard_extent_chunks(spec(4, 2, 3), (5, 17, 2)) == (5, 4, 2)
    assert shard_extent_chunks(spec(0, 0, 9), (5, 17, 2)) == (1, 1, 1)
    assert shard_extent_chunks(spec(20, 20, 0), (5, 17, 2)) == (5, 17, 2)
    with pytest.raises(SpecError, match="murmurhash3_x86_128"):
        shard_extent_chunks(spec(1, 1, 1, "murmurhash3_x86_128"), (4, 4, 4))


# --------------------------------------------------------------------------------------
# against TensorStore's own writer
# --------------------------------------------------------------------------------------


def _parse_shard_file(path: Path, minishard_bits: int):
    """Yield (minishard, chunk_id, first_uint64_of_chunk_data) for a raw/raw shard file."""
    data = path.read_bytes()
    n_mini = 1 << minishard_bits
    index_end = 16 * n_mini
    assert len(data) >= index_end
    index = np.frombuffer(data, dtype="<u8", count=2 * n_mini).reshape(n_mini, 2)
    for mini, (start, end) in enumerate(index.tolist()):
        if start == end:
            continue
        raw = data[index_end + start : index_end + end]
        assert len(raw) % 24 == 0
        n = len(raw) // 24
        arr = np.frombuffer(raw, dtype="<u8").reshape(3, n)
        ids = np.cumsum(arr[0], dtype=np.uint64)
        sizes = arr[2]
        starts = (
            index_end
            + np.cumsum(arr[1], dtype=np.uint64)
            + np.concatenate([[0], np.cumsum(sizes[:-1], dtype=np.uint64)]).astype(np.uint64)
        )
        for cid, off, size in zip(ids.tolist(), starts.tolist(), sizes.tolist(), strict=True):
            assert size >= 8 and off + size <= len(data)
            (first,) = struct.unpack_from("<Q", data, off)
            yield mini, cid, first


TS_CASES = [
    ((64, 40, 24), 8, spec(1, 2, 3)),
    ((64, 40, 24), 8, spec(2, 3, 3)),
    ((64, 40, 24), 8, spec(0, 0, 0)),
    ((60, 36, 20), 8, spec(0, 4, 5)),
    ((40, 136, 16), 8, spec(3, 1, 5)),
    ((40, 136, 16), 8, spec(2, 2, 2)),  # wraps: 9 Morton bits > 6
    ((48, 48, 48), 16, spec(1, 1, 1)),
    ((64, 40, 24), 8, spec(0, 2, 3, "murmurhash3_x86_128")),
    ((40, 136, 16), 8, spec(1, 3, 4, "murmurhash3_x86_128")),
    ((60, 36, 20), 8, spec(2, 0, 2, "murmurhash3_x86_128")),
]


@pytest.mark.parametrize(("size", "chunk", "sp"), TS_CASES)
def test_against_tensorstore_writer(tmp_path, size, chunk, sp):
    ts = pytest.importorskip("tensorstore")
    grid = grid_shape(size, chunk)
    store = ts.open(
        {
            "driver": "neuroglancer_precomputed",
            "kvstore": {"driver": "file", "path": str(tmp_path)},
            "multiscale_metadata": {
                "type": "segmentation",
                "data_type": "uint64",
                "num_channels": 1,
            },
            "scale_metadata": {
                "size": list(size),
                "resolution": [8, 8, 8],
                "voxel_offset": [0, 0, 0],
                "chunk_size": [chunk] * 3,
                "encoding": "raw",
                "sharding": sp.to_json(),
            },
        },
        create=True,
        delete_existing=True,
    ).result()
    # every voxel holds 1 + the linear index of its chunk: distinct, non-zero per chunk
    ix, iy, iz = np.meshgrid(*(np.arange(n) // chunk for n in size), indexing="ij")
    volume = (1 + ix + grid[0] * (iy + grid[1] * iz)).astype(np.uint64)
    store[ts.d["channel"][0]].write(volume).result()

    shard_files = {p.name: p for p in tmp_path.rglob("*.shard")}
    coords = all_coords(grid)
    codes = compressed_morton_code(coords, grid)
    shard, mini = shard_and_minishard(sp, coords, grid)
    expected = {
        int(cid): (shard_key(int(s), sp.shard_bits), int(m), tuple(c))
        for cid, s, m, c in zip(codes, shard, mini, coords.tolist(), strict=True)
    }
    assert set(shard_files) == {v[0] for v in expected.values()}

    found = {}
    for name, path in shard_files.items():
        for m, cid, first in _parse_shard_file(path, sp.minishard_bits):
            assert cid not in found, f"chunk id {cid} written twice"
            assert cid in expected, f"TensorStore wrote chunk id {cid} that is no Morton code"
            want_file, want_mini, c = expected[cid]
            assert (name, m) == (want_file, want_mini), (cid, c)
            # the chunk's data says which chunk it is: id == our Morton code of that chunk
            lin = first - 1
            decoded = (lin % grid[0], (lin // grid[0]) % grid[1], lin // (grid[0] * grid[1]))
            assert decoded == c
            found[cid] = name
    assert set(found) == set(expected)

    if sp.hash == "identity" and sum(compressed_z_index_bits(grid)) <= (
        sp.preshift_bits + sp.minishard_bits + sp.shard_bits
    ):
        # each shard file holds exactly one aligned box of shard_extent_chunks
        ext = np.array(shard_extent_chunks(sp, grid))
        for name in shard_files:
            cs = np.array([expected[cid][2] for cid, n in found.items() if n == name])
            lo = cs.min(axis=0)
            assert (lo % ext == 0).all()
            hi = np.minimum(lo + ext, grid)
            assert len(cs) == int(np.prod(hi - lo))
            assert (cs < hi).all()


# --------------------------------------------------------------------------------------
# DVID naming
# --------------------------------------------------------------------------------------

MCNS_S = [2048, 2048, 2048, 2048, 2048, 2048, 2048, 1088, 576, 320, 192, 128]


def _mcns_scales(dvid_data: Path) -> list[dict]:
    return json.loads((dvid_data / "mcns-ng-specs.json").read_text())["scales"]


def test_dvid_shard_extent_mcns(dvid_data):
    scales = _mcns_scales(dvid_data)
    assert len(scales) == len(MCNS_S)
    got = []
    for sc in scales:
        sp = ShardingSpec.from_json(sc["sharding"])
        assert sc["chunk_sizes"][0] == [64, 64, 64]
        got.append(dvid_shard_extent(sp, sc["size"]))
        assert not dvid_shard_names_collide(sp, sc["size"])
    assert got == MCNS_S


def _csv_chunks(path: Path) -> np.ndarray:
    with path.open() as f:
        rows = [r for r in f if not r.startswith("#")]
    reader = csv.DictReader(rows)
    return np.array([(int(r["x"]), int(r["y"]), int(r["z"])) for r in reader], dtype=np.int64)


@pytest.mark.parametrize(
    "csv_name",
    ["30720_24576_28672.csv", "30720_24576_28672-offsets.csv", "30720_24576_28672-newformat.csv"],
)
def test_dvid_origin_real_shard(dvid_data, csv_name):
    s1 = _mcns_scales(dvid_data)[1]
    sp = ShardingSpec.from_json(s1["sharding"])
    S = dvid_shard_extent(sp, s1["size"])
    assert S == 2048
    chunks = _csv_chunks(dvid_data / csv_name)
    assert len(chunks) == 258
    origins = dvid_shard_origin(chunks, S)
    assert origins.dtype == np.int64 and origins.shape == (258, 3)
    assert {tuple(o) for o in origins.tolist()} == {(30720, 24576, 28672)}
    assert {shard_filename_stem(o) for o in origins} == {"30720_24576_28672"}
    # the DVID file is one neuroglancer shard of the s1 spec
    grid = grid_shape(s1["size"], 64)
    shard, _ = shard_and_minishard(sp, chunks, grid)
    assert len(set(shard.tolist())) == 1
    assert shard_extent_chunks(sp, grid) == (32, 32, 32)


def test_dvid_origin_and_extent_by_hand():
    sp = spec(9, 6, 16)
    S = dvid_shard_extent(sp, (47044, 39159, 67288))
    assert S == 2048
    assert dvid_shard_origin((31, 32, 0), S).tolist() == [0, 2048, 0]
    assert dvid_shard_origin([[480, 384, 448], [511, 415, 479], [512, 0, 1]], S).tolist() == [
        [30720, 24576, 28672],
        [30720, 24576, 28672],
        [32768, 0, 0],
    ]
    # mCNS s7: grid (12, 10, 17) needs 13 bits, all non-shard: one box of 17 chunks in z
    s7 = spec(9, 4, 0)
    assert dvid_shard_extent(s7, (736, 612, 1052)) == 17 * 64
    assert dvid_shard_origin([[11, 9, 16], [0, 0, 0]], 1088).tolist() == [[0, 0, 0], [0, 0, 0]]
    # a different chunk size scales S
    assert dvid_shard_extent(spec(3, 0, 3), (64, 64, 64), chunk_size=8) == 16
    # non-cubic box: 17 low bits over a 64^3 grid -> (64, 64, 32) chunks, S = 4096 voxels,
    # so the two shards along z share one DVID name
    nc = spec(10, 7, 1)
    assert shard_extent_chunks(nc, (64, 64, 64)) == (64, 64, 32)
    assert dvid_shard_extent(nc, (4096, 4096, 4096)) == 4096
    assert dvid_shard_names_collide(nc, (4096, 4096, 4096))
    assert shard_filename_stem((0, 64, 128)) == "0_64_128"
    assert shard_filename_stem(np.array([1, 2, 3])) == "1_2_3"


def test_dvid_names_match_shards_when_cubic():
    """Where DVID's naming does not collide, DVID files and identity shards correspond 1:1."""
    rng = np.random.default_rng(2024)
    checked = 0
    for grid, sp in _random_identity_cases(rng, 200, wrap=False):
        size = tuple(g * 8 for g in grid)
        if dvid_shard_names_collide(sp, size, chunk_size=8):
            continue
        S = dvid_shard_extent(sp, size, chunk_size=8)
        coords = all_coords(grid)
        names = [shard_filename_stem(o) for o in dvid_shard_origin(coords, S, chunk_size=8)]
        shard, _ = shard_and_minishard(sp, coords, grid)
        pairs = set(zip(names, shard.tolist(), strict=True))
        assert len(pairs) == len(set(names)) == len(set(shard.tolist()))
        checked += 1
    assert checked > 50


def test_dvid_invalid_arguments():
    with pytest.raises(SpecError):
        dvid_shard_origin((1, 2, 3), 100)  # not a multiple of 64
    with pytest.raises(SpecError):
        dvid_shard_origin((1, 2, 3), 0)
    with pytest.raises(ValueError):
        dvid_shard_origin((-1, 2, 3), 2048)
    with pytest.raises(SpecError):
        dvid_shard_extent(spec(1, 1, 1), (64, 64, 64), chunk_size=(64, 64, 32))
    with pytest.raises(SpecError):
        dvid_shard_extent(spec(1, 1, 1), (64, 0, 64))
    with pytest.raises(ValueError):
        shard_filename_stem((1, 2))


# --------------------------------------------------------------------------------------
# PrecomputedShardWriter: shard files written as their entries arrive
# --------------------------------------------------------------------------------------


def _write_shards(spec, entries, compress=None):
    """{file name: bytes} from PrecomputedShardWriter, entries fed in file order."""
    groups: dict = {}
    for k in entries:
        shard, mini = shard_of_key(spec, k)
        groups.setdefault(shard, []).append((mini, k))
    out = {}
    for shard, keys in groups.items():
        f = io.BytesIO()
        w = PrecomputedShardWriter(spec, f, compress)
        for _, k in sorted(keys):
            w.add(k, entries[k])
        assert w.finish() == len(keys)
        out[shard_key(shard, spec.shard_bits)] = f.getvalue()
    return out


@pytest.mark.parametrize("spec", [
    ShardingSpec(1, 2, 2, "murmurhash3_x86_128"),
    ShardingSpec(2, 3, 1, "identity"),  # empty minishards: (0, 0) in the shard index
    ShardingSpec(0, 0, 0, "identity"),
])
def test_shard_writer_bytes_equal_tensorstore(tmp_path, spec):
    ts = pytest.importorskip("tensorstore")
    rng = np.random.default_rng(9)
    entries = {int(k): rng.bytes(int(rng.integers(1, 300))) for k in rng.integers(0, 2**9, 70)}
    kv = ts.KvStore.open({"driver": "neuroglancer_uint64_sharded", "base": f"file://{tmp_path}/",
                          "metadata": spec.to_json()}).result()
    with ts.Transaction() as txn:
        for key, value in entries.items():
            kv.with_transaction(txn)[key.to_bytes(8, "big")] = value
    files = _write_shards(spec, entries)
    assert sorted(files) == sorted(p.name for p in tmp_path.iterdir())
    for name, blob in files.items():
        assert (tmp_path / name).read_bytes() == blob


def test_shard_writer_gzip_index_read_by_tensorstore(tmp_path):
    ts = pytest.importorskip("tensorstore")
    spec = ShardingSpec(3, 4, 1, "identity", minishard_index_encoding="gzip")
    rng = np.random.default_rng(4)
    entries = {int(k): rng.bytes(int(rng.integers(0, 50))) for k in rng.choice(2**12, 900, replace=False)}
    for name, blob in _write_shards(spec, entries).items():
        (tmp_path / name).write_bytes(blob)
    kv = ts.KvStore.open({"driver": "neuroglancer_uint64_sharded", "base": f"file://{tmp_path}/",
                          "metadata": spec.to_json()}).result()
    assert sorted(int.from_bytes(k, "big") for k in kv.list().result()) == sorted(entries)
    for key, value in list(entries.items())[:200]:
        assert kv.read(key.to_bytes(8, "big")).result().value == value


def test_shard_writer_refuses_keys_out_of_order():
    spec = ShardingSpec(0, 2, 1, "identity")  # key = shard << 2 | minishard
    w = PrecomputedShardWriter(spec, io.BytesIO())
    w.add(1, b"a")
    with pytest.raises(ValueError, match="shard"):
        w.add(4, b"b")  # shard 1
    with pytest.raises(ValueError, match="minishard"):
        w.add(0, b"c")  # minishard 0 after minishard 1
    with pytest.raises(ValueError, match="after key"):
        w.add(1, b"d")
    f = io.BytesIO()
    assert PrecomputedShardWriter(spec, f).finish() == 0 and f.getvalue() == bytes(16 * 4)


# --------------------------------------------------------------------------------------
# DVID's two shard-file naming generations (FORMATS.md §3a)
# --------------------------------------------------------------------------------------


def _ref_old_extent(sharding: dict) -> int:
    """DVID before 2026-03-21, as FORMATS.md §3a writes it: one cube whatever the grid."""
    return 2 ** ((18 + sharding["preshift_bits"] + sharding["minishard_bits"]) // 3)


def _ref_agree(old: int, new: int, size) -> bool:
    """Brute force: every chunk of the grid gets the same file origin under both extents."""
    for n in size:
        for c in range(-(-n // 64)):
            if c * 64 // old * old != c * 64 // new * new:
                return False
    return True


def dvid_namings_agree(sp, size, chunk=64) -> bool:
    """Whether DVID's two naming generations name every chunk's file of a scale alike."""
    from dvidshards.formats.sharding import dvid_old_shard_extent, grid_shape, namings_agree

    return namings_agree(dvid_old_shard_extent(sp, chunk), dvid_shard_extent(sp, size, chunk), grid_shape(size, chunk),
                         chunk)


def test_dvid_old_shard_extent_mcns(dvid_data):
    """The real spec: 2048 at s0-s6 (as today), then 1024..64 where today's extent is 1088..128."""
    from dvidshards.formats.sharding import dvid_old_shard_extent

    scales = _mcns_scales(dvid_data)
    old = [dvid_old_shard_extent(ShardingSpec.from_json(s["sharding"])) for s in scales]
    new = [dvid_shard_extent(ShardingSpec.from_json(s["sharding"]), s["size"]) for s in scales]
    assert old == [_ref_old_extent(s["sharding"]) for s in scales]
    assert old == [2048] * 7 + [1024, 512, 256, 128, 64]
    assert new == [2048] * 7 + [1088, 576, 320, 192, 128]
    agree = [dvid_namings_agree(ShardingSpec.from_json(s["sharding"]), s["size"]) for s in scales]
    assert agree == [True] * 7 + [False] * 5


def test_dvid_namings_agree_against_brute_force():
    """Random specs and volumes; also: wherever the old cube is the larger, the two name files alike
    (so an old file is always inside one of today's shard cells)."""
    from dvidshards.formats.sharding import dvid_old_shard_extent

    rng = np.random.default_rng(21)
    seen = {True: 0, False: 0}
    for _ in range(400):
        size = [int(v) for v in rng.integers(1, 3000, 3)]
        sp = spec(int(rng.integers(0, 10)), int(rng.integers(0, 7)), 20)
        old, new = dvid_old_shard_extent(sp), dvid_shard_extent(sp, size)
        agree = dvid_namings_agree(sp, size)
        assert agree == _ref_agree(old, new, size), (size, sp)
        assert agree or old < new
        seen[agree] += 1
    assert min(seen.values()) > 20  # both cases were exercised
    with pytest.raises(SpecError, match="power-of-two"):
        dvid_old_shard_extent(spec(3, 3, 0), chunk_size=48)


def test_scale_naming_and_naming_of_origins(dvid_data):
    from dvidshards.formats.multiscale import naming_of_origins, parse_multiscale

    scales = parse_multiscale(json.loads((dvid_data / "mcns-ng-specs.json").read_text()))
    assert [s.naming for s in scales] == ["current"] * 12
    assert [s.namings_differ for s in scales] == [False] * 7 + [True] * 5
    s9 = scales[9]
    old = s9.with_naming("old")
    assert (old.shard_extent, old.naming, old.extent_of("current")) == (256, "old", 320)
    assert old.with_naming("current") == s9 and s9.with_naming("current") is s9
    assert old.shard_origin(0, 0, 4) == (0, 0, 256) and s9.shard_origin(0, 0, 4) == (0, 0, 0)
    assert old.stem((0, 0, 256)) == "s9/0_0_256"
    assert naming_of_origins(s9, [(0, 0, 0), (0, 0, 256)]) == "old"  # the real export's two files
    tall = parse_multiscale({"scales": [{**json.loads((dvid_data / "mcns-ng-specs.json").read_text())["scales"][9],
                                         "size": [184, 153, 800]}]})[0]  # today's shards: 512 voxels along z
    assert (tall.shard_extent, tall.extent_of("old")) == (512, 256)
    assert naming_of_origins(tall, [(0, 0, 0), (0, 0, 512)]) is None  # today's names fit the old cube too
    assert naming_of_origins(tall, [(0, 0, 0), (0, 0, 256), (0, 0, 512)]) == "old"
    assert naming_of_origins(s9, [(0, 0, 0)]) is None  # fits both: today's naming reads it exactly
    assert naming_of_origins(s9, []) is None
    assert naming_of_origins(scales[0], [(0, 0, 2048)]) is None  # the generations agree at s0
    # names that fit neither: the generation more of them fit, so that the check names the misfit
    assert naming_of_origins(s9, [(0, 0, 0), (0, 0, 256), (0, 0, 100)]) == "old"
    assert naming_of_origins(s9, [(0, 0, 100)]) == "current"
    assert list(s9.fits([(0, 0, 256), (0, 0, 0), (0, 0, 320)])) == [False, True, False]  # 320: past z = 263
    with pytest.raises(SpecError, match="naming"):
        s9.with_naming("older")
