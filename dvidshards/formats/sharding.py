"""Neuroglancer ``neuroglancer_uint64_sharded_v1`` math and DVID's shard naming.

* Neuroglancer's scheme (FORMATS.md §4): chunk id = compressed Morton code of the chunk's grid
  coordinate, ``hashed = hash(id >> preshift_bits)``, minishard = its low ``minishard_bits``,
  shard = the next ``shard_bits``; files ``<hex, zero padded to ceil(shard_bits / 4)>.shard``,
  as TensorStore (``EncodeCompressedZIndex``, ``GetChunkShardInfo``,
  ``MurmurHash3_x86_128Hash64Bits``).
* DVID's ``export-shards`` names (FORMATS.md §3, ``datatype/labelmap/export.go``): a file is
  ``{ox}_{oy}_{oz}`` after the voxel origin ``floor(chunk * c / S) * S`` of one cubic extent
  ``S`` per scale: the low ``min(preshift + minishard bits, total)`` Morton bits handed out
  round robin over x, y, z (as TensorStore's ``GetShardChunkHierarchy``), ``S`` the largest
  ``min(grid, 2**bits_taken)`` times the chunk. Before DVID's 2026-03-21 commit ("Fix Morton
  code and shard extent computation to match tensorstore") ``S`` was ``2 ** ((18 + preshift +
  minishard) // 3)`` voxels whatever the grid (`dvid_old_shard_extent`), which splits a shard
  over several files where it is larger on some axis (FORMATS.md §3a).
"""

from __future__ import annotations

import gzip
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np
from numba import njit

from ..errors import SpecError

__all__ = [
    "HASH_FUNCTIONS",
    "ENCODINGS",
    "SHARDING_TYPE",
    "PrecomputedShardWriter",
    "ShardingSpec",
    "compressed_morton_code",
    "compressed_z_index_bits",
    "DVID_NAMING_CHANGE",
    "NAMINGS",
    "dvid_old_shard_extent",
    "dvid_shard_extent",
    "dvid_shard_names_collide",
    "dvid_shard_origin",
    "grid_shape",
    "namings_agree",
    "murmurhash3_x86_128_low64",
    "shard_and_minishard",
    "shard_extent_chunks",
    "shard_filename_stem",
    "shard_key",
    "shard_of_key",
]

SHARDING_TYPE = "neuroglancer_uint64_sharded_v1"
HASH_FUNCTIONS = ("identity", "murmurhash3_x86_128")
#: DVID's shard-file naming generations: today's extent, and the cubic one before DVID_NAMING_CHANGE
NAMINGS = ("current", "old")
DVID_NAMING_CHANGE = "2026-03-21"  # DVID commit "Fix Morton code and shard extent computation to match tensorstore"
ENCODINGS = ("raw", "gzip")


def _is_int(value: Any) -> bool:
    """Python or numpy integers, not bools."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


@dataclass(frozen=True)
class ShardingSpec:
    """A validated ``neuroglancer_uint64_sharded_v1`` spec (SpecError on a bad field): low
    ``preshift_bits`` of the chunk id dropped before ``hash`` (``"identity"`` or
    ``"murmurhash3_x86_128"``), then ``minishard_bits`` and above them ``shard_bits``; the encodings
    ``"raw"`` or ``"gzip"``."""

    preshift_bits: int
    minishard_bits: int
    shard_bits: int
    hash: str
    minishard_index_encoding: str = "raw"
    data_encoding: str = "raw"

    def __post_init__(self) -> None:
        for name in ("preshift_bits", "minishard_bits", "shard_bits"):
            value = getattr(self, name)
            if not _is_int(value):
                raise SpecError(f"sharding {name} must be an integer, got {value!r}")
            if value < 0 or value > 64:
                raise SpecError(f"sharding {name} must be in [0, 64], got {value}")
            object.__setattr__(self, name, int(value))
        total = self.preshift_bits + self.minishard_bits + self.shard_bits
        if total > 64:
            raise SpecError(
                "sharding preshift_bits + minishard_bits + shard_bits must be <= 64, "
                f"got {self.preshift_bits} + {self.minishard_bits} + {self.shard_bits} = {total}"
            )
        if self.hash not in HASH_FUNCTIONS:
            raise SpecError(
                f"unknown sharding hash {self.hash!r}; expected one of {', '.join(HASH_FUNCTIONS)}"
            )
        for name in ("minishard_index_encoding", "data_encoding"):
            value = getattr(self, name)
            if value not in ENCODINGS:
                raise SpecError(
                    f"unknown sharding {name} {value!r}; expected one of {', '.join(ENCODINGS)}"
                )

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ShardingSpec:
        """The spec of a scale's ``"sharding"`` JSON object (encodings default to raw, unknown
        members ignored); SpecError when it is not such an object or a member is missing or bad."""
        if not isinstance(d, Mapping):
            raise SpecError(f"sharding spec must be a JSON object, got {type(d).__name__}")
        if "@type" not in d:
            raise SpecError("sharding spec has no '@type' member")
        if d["@type"] != SHARDING_TYPE:
            raise SpecError(f"sharding '@type' must be {SHARDING_TYPE!r}, got {d['@type']!r}")
        missing = [
            k for k in ("preshift_bits", "minishard_bits", "shard_bits", "hash") if k not in d
        ]
        if missing:
            raise SpecError(f"sharding spec is missing {', '.join(missing)}")
        return cls(
            preshift_bits=d["preshift_bits"],
            minishard_bits=d["minishard_bits"],
            shard_bits=d["shard_bits"],
            hash=d["hash"],
            minishard_index_encoding=d.get("minishard_index_encoding", "raw"),
            data_encoding=d.get("data_encoding", "raw"),
        )

    def to_json(self) -> dict[str, Any]:
        """The spec's JSON object, accepted back by `from_json` and by TensorStore."""
        return {
            "@type": SHARDING_TYPE,
            "hash": self.hash,
            "preshift_bits": self.preshift_bits,
            "minishard_bits": self.minishard_bits,
            "shard_bits": self.shard_bits,
            "minishard_index_encoding": self.minishard_index_encoding,
            "data_encoding": self.data_encoding,
        }


def _xyz_ints(values: Any, what: str, *, minimum: int) -> tuple[int, int, int]:
    """An int or 3 ints >= minimum as (x, y, z); SpecError otherwise."""
    if _is_int(values):
        values = (values,) * 3
    try:
        items = tuple(values)
    except TypeError:
        raise SpecError(f"{what} must be an integer or 3 integers, got {values!r}") from None
    if len(items) != 3 or not all(_is_int(v) for v in items):
        raise SpecError(f"{what} must be 3 integers (x, y, z), got {values!r}")
    if any(v < minimum for v in items):
        raise SpecError(f"{what} must be >= {minimum} on every axis, got {items}")
    return int(items[0]), int(items[1]), int(items[2])


def grid_shape(size_voxels: Sequence[int], chunk_size: Sequence[int] | int) -> tuple[int, int, int]:
    """Chunks along x, y, z covering ``size_voxels`` (``ceil(size / chunk)``); SpecError unless
    both are positive integers (3, or one for every axis)."""
    size = _xyz_ints(size_voxels, "volume size", minimum=1)
    chunk = _xyz_ints(chunk_size, "chunk size", minimum=1)
    return tuple(-(-s // c) for s, c in zip(size, chunk, strict=True))  # type: ignore[return-value]


def compressed_z_index_bits(grid: Sequence[int]) -> tuple[int, int, int]:
    """Bits each axis gives the compressed Morton code (``bit_width(grid - 1)``); SpecError when
    the grid is bad or needs more than 64 bits."""
    g = _xyz_ints(grid, "chunk grid shape", minimum=1)
    bits = tuple(int(n - 1).bit_length() for n in g)
    if sum(bits) > 64:
        raise SpecError(f"chunk grid {g} needs {sum(bits)} > 64 bits of compressed Morton code")
    return bits  # type: ignore[return-value]


def _bit_layout(bits: tuple[int, int, int]) -> list[tuple[int, int]]:
    """(axis, source bit) of each bit of the compressed Morton code, bit 0 first."""
    layout = []
    for bit in range(max(bits)):
        for axis in range(3):
            if bit < bits[axis]:
                layout.append((axis, bit))
    return layout


def _as_coords(chunk_coords: Any) -> tuple[np.ndarray, bool]:
    """Chunk coordinates as (n, 3) int64, and whether the input was one (3,) point."""
    arr = np.asarray(chunk_coords)
    if not np.issubdtype(arr.dtype, np.integer):  # bool, float, object, str...
        if arr.size == 0 and arr.dtype.kind == "f":  # np.asarray([]) is float64
            arr = arr.astype(np.int64)
        else:
            raise ValueError(f"chunk coordinates must be integers, got dtype {arr.dtype}")
    single = arr.ndim == 1
    if single:
        if arr.shape != (3,):
            raise ValueError(f"a single chunk coordinate must have 3 values, got shape {arr.shape}")
        arr = arr[None, :]
    elif arr.ndim != 2 or arr.shape[1] != 3:
        raise ValueError(f"chunk coordinates must have shape (n, 3) or (3,), got {arr.shape}")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise ValueError("chunk coordinate out of range")
    return arr.astype(np.int64, copy=False), single


def _check_in_grid(coords: np.ndarray, grid: tuple[int, int, int]) -> None:
    if coords.size == 0:
        return
    if coords.min() < 0:
        bad = coords[(coords < 0).any(axis=1)][0]
        raise ValueError(f"chunk coordinate {tuple(int(v) for v in bad)} is negative")
    over = coords >= np.asarray(grid, dtype=np.int64)
    if over.any():
        bad = coords[over.any(axis=1)][0]
        raise ValueError(
            f"chunk coordinate {tuple(int(v) for v in bad)} is outside the chunk grid {grid}"
        )


def compressed_morton_code(chunk_coords: Any, grid_shape: Sequence[int]) -> np.ndarray | np.uint64:
    """Neuroglancer's compressed Morton code (chunk id) of chunk coordinates ((n, 3), or (3,) for a
    scalar): bits of x, y, z interleaved from bit 0, each axis ``bit_width(grid - 1)`` bits, an
    exhausted axis skipped (TensorStore's ``EncodeCompressedZIndex``). ValueError for coordinates
    that are not integers or lie outside the grid, SpecError for a bad grid."""
    grid = _xyz_ints(grid_shape, "chunk grid shape", minimum=1)
    bits = compressed_z_index_bits(grid)
    coords, single = _as_coords(chunk_coords)
    _check_in_grid(coords, grid)
    c = coords.astype(np.uint64)
    code = np.zeros(len(c), dtype=np.uint64)
    one = np.uint64(1)
    for out_bit, (axis, bit) in enumerate(_bit_layout(bits)):
        code |= ((c[:, axis] >> np.uint64(bit)) & one) << np.uint64(out_bit)
    return code[0] if single else code


# MurmurHash3_x86_128 (seed 0) of one little-endian uint64, low 64 bits of the result
_M32 = np.uint64(0xFFFFFFFF)
_C1 = np.uint64(0x239B961B)
_C2 = np.uint64(0xAB0E9789)
_C3 = np.uint64(0x38B34AE5)
_F1 = np.uint64(0x85EBCA6B)
_F2 = np.uint64(0xC2B2AE35)
_LEN = np.uint64(8)
_S13 = np.uint64(13)
_S15 = np.uint64(15)
_S16 = np.uint64(16)
_S17 = np.uint64(17)
_S32 = np.uint64(32)


@njit(cache=True, nogil=True)
def _fmix32(h):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    h ^= h >> _S16
    h = (h * _F1) & _M32
    h ^= h >> _S13
    h = (h * _F2) & _M32
    h ^= h >> _S16
    return h


@njit(cache=True, nogil=True)
def _murmur_low64_kernel(values, out):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    for i in range(values.shape[0]):
        v = values[i]
        low = v & _M32
        high = v >> _S32
        # body: one 16-byte block is not reached; 8 bytes fall in the tail (k1 = low, k2 = high)
        k2 = (high * _C2) & _M32
        k2 = ((k2 << _S16) | (k2 >> _S16)) & _M32
        k2 = (k2 * _C3) & _M32
        h2 = k2
        k1 = (low * _C1) & _M32
        k1 = ((k1 << _S15) | (k1 >> _S17)) & _M32
        k1 = (k1 * _C2) & _M32
        h1 = k1
        h3 = np.uint64(0)
        h4 = np.uint64(0)
        h1 ^= _LEN
        h2 ^= _LEN
        h3 ^= _LEN
        h4 ^= _LEN
        h1 = (h1 + h2) & _M32
        h1 = (h1 + h3) & _M32
        h1 = (h1 + h4) & _M32
        h2 = (h2 + h1) & _M32
        h3 = (h3 + h1) & _M32
        h4 = (h4 + h1) & _M32
        h1 = _fmix32(h1)
        h2 = _fmix32(h2)
        h3 = _fmix32(h3)
        h4 = _fmix32(h4)
        h1 = (h1 + h2) & _M32
        h1 = (h1 + h3) & _M32
        h1 = (h1 + h4) & _M32
        h2 = (h2 + h1) & _M32
        out[i] = (h2 << _S32) | h1


def murmurhash3_x86_128_low64(values: Any) -> np.ndarray | np.uint64:
    """MurmurHash3_x86_128 (seed 0) of each non-negative integer as 8 little-endian bytes, low 64 bits
    (``h2 << 32 | h1``, what neuroglancer's sharding uses); an array of the input's shape, or a
    ``numpy.uint64`` for a scalar. ValueError for non-integers or negatives."""
    arr = np.asarray(values)
    if not np.issubdtype(arr.dtype, np.integer):
        if arr.size == 0:
            arr = arr.astype(np.uint64)
        else:
            raise ValueError(f"values to hash must be integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "i" and arr.size and int(arr.min()) < 0:
        raise ValueError("values to hash must be non-negative")
    flat = np.ascontiguousarray(arr, dtype=np.uint64).reshape(-1)
    out = np.empty_like(flat)
    _murmur_low64_kernel(flat, out)
    if arr.ndim == 0:
        first: np.uint64 = np.uint64(out[0])
        return first
    return out.reshape(arr.shape)


def _low_mask(nbits: int) -> np.uint64:
    out: np.uint64 = np.uint64((1 << nbits) - 1)
    return out


def _shift_right(x: np.ndarray, amount: int) -> np.ndarray:
    if amount >= 64:
        return np.zeros_like(x)
    return np.asarray(x >> np.uint64(amount))


def shard_and_minishard(
    spec: ShardingSpec, chunk_coords: Any, grid_shape: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """(shard, minishard) uint64 arrays of chunk coordinates ((n, 3), or scalars for (3,)) under
    ``spec``; ValueError when coordinates are malformed or outside ``grid_shape``."""
    if not isinstance(spec, ShardingSpec):
        raise TypeError(f"spec must be a ShardingSpec, got {type(spec).__name__}")
    ids = np.atleast_1d(compressed_morton_code(chunk_coords, grid_shape))
    hashed = _shift_right(ids, spec.preshift_bits)
    if spec.hash == "murmurhash3_x86_128":
        hashed = np.atleast_1d(murmurhash3_x86_128_low64(hashed))
    minishard = hashed & _low_mask(spec.minishard_bits)
    shard = _shift_right(hashed, spec.minishard_bits) & _low_mask(spec.shard_bits)
    if np.asarray(chunk_coords).ndim == 1:
        return shard[0], minishard[0]
    return shard, minishard


def _bits_taken(bits: tuple[int, int, int], nbits: int) -> list[int]:
    """Bits per axis used by the lowest ``nbits`` Morton bits: round robin over x, y, z, skipping
    an exhausted axis (TensorStore's ``CompressedMortonBitIterator``)."""
    taken = [0, 0, 0]
    axis = 0
    for _ in range(nbits):
        while taken[axis] == bits[axis]:
            axis = (axis + 1) % 3
        taken[axis] += 1
        axis = (axis + 1) % 3
    return taken


def _box_chunks(spec: ShardingSpec, grid: tuple[int, int, int]) -> tuple[int, int, int]:
    bits = compressed_z_index_bits(grid)
    non_shard_bits = min(spec.preshift_bits + spec.minishard_bits, sum(bits))
    taken = _bits_taken(bits, non_shard_bits)
    return tuple(min(g, 1 << t) for g, t in zip(grid, taken, strict=True))  # type: ignore[return-value]


def shard_extent_chunks(spec: ShardingSpec, grid_shape: Sequence[int]) -> tuple[int, int, int]:
    """Per-axis extent, in chunks, of the aligned box of chunks one identity-hash shard holds.

    The low ``preshift_bits + minishard_bits`` Morton bits spread over the axes as the interleave
    does: ``min(grid, 2**bits_on_axis)`` chunks per axis (TensorStore's ``GetShardChunkHierarchy``);
    boxes tile the grid from the origin. When the grid needs more Morton bits than the spec's, shard
    numbers wrap: a box is still one shard, a shard several boxes. SpecError for a hashed spec
    (hashed shards are not boxes) or a bad grid.
    """
    if not isinstance(spec, ShardingSpec):
        raise TypeError(f"spec must be a ShardingSpec, got {type(spec).__name__}")
    if spec.hash != "identity":
        raise SpecError(
            f"shards are not boxes of chunks with hash {spec.hash!r}; only 'identity' has a shard extent"
        )
    grid = _xyz_ints(grid_shape, "chunk grid shape", minimum=1)
    return _box_chunks(spec, grid)


def _cubic_chunk_size(chunk_size: Any) -> int:
    c = _xyz_ints(chunk_size, "chunk size", minimum=1)
    if len(set(c)) != 1:
        raise SpecError(f"DVID shard naming assumes cubic chunks, got chunk size {c}")
    return c[0]


def dvid_shard_extent(spec: ShardingSpec, size_voxels: Sequence[int], chunk_size: int = 64) -> int:
    """Shard extent ``S`` (voxels) DVID's export-shards names files by (``shardHandler.Initialize``).

    ``S = max over axes of min(grid, 2**bits_taken) * chunk`` from the low ``min(preshift +
    minishard, total)`` Morton bits; hash and shard_bits do not enter (DVID implements only the
    identity hash). Not a power of two where the grid caps the box (17 chunks -> 1088 voxels).
    SpecError for a bad size or non-cubic chunk.
    """
    if not isinstance(spec, ShardingSpec):
        raise TypeError(f"spec must be a ShardingSpec, got {type(spec).__name__}")
    chunk = _cubic_chunk_size(chunk_size)
    grid = grid_shape(size_voxels, chunk)
    return max(_box_chunks(spec, grid)) * chunk


def dvid_old_shard_extent(spec: ShardingSpec, chunk_size: int = 64) -> int:
    """``S`` (voxels) of DVID's names before 2026-03-21 (`DVID_NAMING_CHANGE`): ``chunk * 2 **
    ((preshift_bits + minishard_bits) // 3)``, one cube whatever the grid. mCNS: 2048 at s0-s6 (as
    today), then 1024 .. 64 at s7-s11 where `dvid_shard_extent` gives 1088, 576, 320, 192, 128.
    SpecError unless the chunk size is a power of two."""
    if not isinstance(spec, ShardingSpec):
        raise TypeError(f"spec must be a ShardingSpec, got {type(spec).__name__}")
    chunk = chunk_size if type(chunk_size) is int and chunk_size > 0 else _cubic_chunk_size(chunk_size)
    if chunk & (chunk - 1):
        raise SpecError(f"DVID's old shard naming needs a power-of-two chunk size, got {chunk}")
    return chunk << ((spec.preshift_bits + spec.minishard_bits) // 3)


def namings_agree(old: int, new: int, grid: Sequence[int], chunk: int = 64) -> bool:
    """Whether ``floor(chunk * c / S) * S`` is the same with both extents (voxels) for every chunk
    coordinate of the grid: DVID's two naming generations then name every file alike."""
    if old == new:
        return True
    for g in grid:
        v = np.arange(int(g), dtype=np.int64) * chunk
        if not np.array_equal(v // new * new, v // old * old):
            return False
    return True


def dvid_shard_names_collide(
    spec: ShardingSpec, size_voxels: Sequence[int], chunk_size: int = 64
) -> bool:
    """Whether DVID's cubic naming can give two neuroglancer shards one file name: where the shard box
    is shorter than ``S`` on an axis without covering the grid, two shards share a cubic cell and
    DVID appends both to one file."""
    if not isinstance(spec, ShardingSpec):
        raise TypeError(f"spec must be a ShardingSpec, got {type(spec).__name__}")
    chunk = _cubic_chunk_size(chunk_size)
    grid = grid_shape(size_voxels, chunk)
    box = _box_chunks(spec, grid)
    side = max(box)
    return any(b != side and b != g for b, g in zip(box, grid, strict=True))


def dvid_shard_origin(
    chunk_coords: Any, shard_extent_voxels: int, chunk_size: int = 64
) -> np.ndarray:
    """Voxel origin ``floor(chunk_size * chunk / S) * S`` of the DVID shard file holding each chunk
    (``shardOriginFromChunkCoord``): (n, 3) int64, or (3,) for one coordinate. ValueError for
    malformed or negative coordinates, SpecError unless ``S`` is a positive multiple of the chunk."""
    chunk = _cubic_chunk_size(chunk_size)
    if not _is_int(shard_extent_voxels) or shard_extent_voxels <= 0:
        raise SpecError(f"shard extent must be a positive integer, got {shard_extent_voxels!r}")
    extent = int(shard_extent_voxels)
    if extent % chunk:
        raise SpecError(f"shard extent {extent} is not a multiple of the chunk size {chunk}")
    coords, single = _as_coords(chunk_coords)
    if coords.size and coords.min() < 0:
        raise ValueError("chunk coordinates must be non-negative")
    span = extent // chunk  # chunks per shard side
    origin = (coords // span) * extent
    return origin[0] if single else origin


def shard_filename_stem(origin: Sequence[int]) -> str:
    """DVID's shard file stem ``"{ox}_{oy}_{oz}"`` of a voxel origin (3 integers, else ValueError)."""
    items = list(np.asarray(origin).reshape(-1)) if isinstance(origin, np.ndarray) else list(origin)
    if len(items) != 3 or not all(_is_int(v) for v in items):
        raise ValueError(f"a shard origin must be 3 integers, got {origin!r}")
    return "_".join(str(int(v)) for v in items)


def shard_key(shard_number: int, shard_bits: int) -> str:
    """Neuroglancer's shard file name: lowercase hex zero padded to ``ceil(shard_bits / 4)``
    digits, plus ``".shard"``; ValueError for arguments out of range."""
    if not _is_int(shard_bits) or not 0 <= shard_bits <= 64:
        raise ValueError(f"shard_bits must be an integer in [0, 64], got {shard_bits!r}")
    if not _is_int(shard_number) or not 0 <= int(shard_number) < (1 << int(shard_bits)):
        raise ValueError(f"shard number {shard_number!r} is not in [0, 2**{shard_bits})")
    width = math.ceil(int(shard_bits) / 4)
    return f"{int(shard_number):0{width}x}.shard"


def shard_of_key(spec: ShardingSpec, key: int) -> tuple[int, int]:
    """(shard, minishard) of one uint64 key (a chunk id or a segment id) under ``spec``."""
    k = int(key)
    if not 0 <= k < 1 << 64:
        raise ValueError(f"key {key!r} is not a uint64")
    h = k >> spec.preshift_bits if spec.preshift_bits < 64 else 0
    if spec.hash == "murmurhash3_x86_128":
        h = int(murmurhash3_x86_128_low64(np.uint64(h)))
    mini = h & ((1 << spec.minishard_bits) - 1)
    shard = (h >> spec.minishard_bits if spec.minishard_bits < 64 else 0) & ((1 << spec.shard_bits) - 1)
    return shard, mini


class PrecomputedShardWriter:
    """Write one ``neuroglancer_uint64_sharded_v1`` shard file to ``file`` (empty, seekable) as its
    entries arrive.

    TensorStore's layout: the shard index (per minishard u64 [start, end) of its index, relative to
    the index's end; (0, 0) when empty), then per minishard its entries and its index (u64 ``[3,
    n]``: delta-coded keys, delta-coded starts, sizes). Memory is one minishard's index; `finish`
    writes the shard index over its placeholder. Entries go as given (gzip them for
    ``data_encoding`` gzip), by minishard then ascending key, all of one shard. ``compress`` gzips a
    minishard index (default Python's, mtime 0; pass TensorStore's to match its bytes).
    """

    def __init__(self, spec: ShardingSpec, file: BinaryIO, compress: Callable[[bytes], bytes] | None = None):
        if not isinstance(spec, ShardingSpec):
            raise TypeError(f"spec must be a ShardingSpec, got {type(spec).__name__}")
        self.spec = spec
        self.file = file
        self.compress = compress or (lambda b: gzip.compress(b, mtime=0))
        self.shard: int | None = None
        self.entries = 0
        self._nmini = 1 << spec.minishard_bits
        self._ranges = np.zeros((self._nmini, 2), "<u8")
        self._mini = -1
        self._keys: list[int] = []
        self._starts: list[int] = []
        self._sizes: list[int] = []
        self._pos = 0  # bytes written after the shard index
        file.write(bytes(16 * self._nmini))

    def add(self, key: int, value: bytes) -> None:
        """Append the entry ``key`` holding ``value``; ValueError when the key belongs to another
        shard or comes out of order."""
        shard, mini = shard_of_key(self.spec, key)
        if self.shard is None:
            self.shard = shard
        elif shard != self.shard:
            raise ValueError(f"key {key} belongs to shard {shard}, this file holds shard {self.shard}")
        if mini != self._mini:
            if mini < self._mini:
                raise ValueError(f"key {key} of minishard {mini} comes after minishard {self._mini}")
            self._flush()
            self._mini = mini
        elif self._keys and int(key) <= self._keys[-1]:
            raise ValueError(f"key {key} comes after key {self._keys[-1]} of its minishard")
        self.file.write(value)
        self._keys.append(int(key))
        self._starts.append(self._pos)
        self._sizes.append(len(value))
        self._pos += len(value)
        self.entries += 1

    def _flush(self) -> None:
        if not self._keys:
            return
        keys = np.asarray(self._keys, np.uint64)
        st = np.asarray(self._starts, np.uint64)
        sz = np.asarray(self._sizes, np.uint64)
        prev_end = np.concatenate([np.zeros(1, np.uint64), st[:-1] + sz[:-1]])
        idx = np.concatenate([np.diff(keys, prepend=np.uint64(0)), st - prev_end, sz]).astype("<u8").tobytes()
        if self.spec.minishard_index_encoding == "gzip":
            idx = self.compress(idx)
        self._ranges[self._mini] = (self._pos, self._pos + len(idx))
        self.file.write(idx)
        self._pos += len(idx)
        self._keys, self._starts, self._sizes = [], [], []

    def finish(self) -> int:
        """Write the last minishard index and the shard index; returns the entries written (none: the
        file is only zeros, write no such file, TensorStore does not)."""
        self._flush()
        self.file.seek(0)
        self.file.write(self._ranges.tobytes())
        self.file.seek(0, 2)
        return self.entries
