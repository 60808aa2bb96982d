"""Neuroglancer precomputed meshes: ``neuroglancer_multilod_draco`` and the legacy format.

Multi-resolution (neuroglancer ``src/datasource/precomputed/meshes.md``):

* ``info``: ``vertex_quantization_bits`` (10 or 16), ``transform`` (the top 3 rows of a 4x4
  row-major matrix from stored model coordinates, here voxels, to nm: the resolution on the
  diagonal), ``lod_scale_multiplier``, optional ``sharding``.
* manifest ``<id>.index``: ``chunk_shape`` 3 f32, ``grid_origin`` 3 f32, ``num_lods`` u32,
  ``lod_scales`` f32[num_lods], ``vertex_offsets`` f32[num_lods, 3],
  ``num_fragments_per_lod`` u32[num_lods], then per lod the fragment positions u32 ``[3, n]``
  in Z-curve order and each fragment's byte size.
* data ``<id>``: every fragment's Draco mesh, lod 0 first, in manifest order. Neuroglancer skips
  Draco's dequantisation (``SetSkipAttributeTransform``), so the stored integers must be the
  positions quantised on the fragment's box, ``round((v - lo) / size * (2**bits - 1))``: Draco
  quantises with ``bits``, origin 0, range ``2**bits - 1`` (each integer to itself), and vertices
  on a box face are exactly 0 or ``2**bits - 1`` in both neighbours (no cracks).
* lod > 0 fragments must not cross their 2x2x2 partition.
* sharded: ``neuroglancer_uint64_sharded_v1`` keyed by segment id; the entry is the manifest and
  the fragment data sits right before it (so ``data_encoding`` must be ``raw``).

Legacy: ``info`` ``{"@type": "neuroglancer_legacy_mesh"}``, a JSON manifest ``<id>:0`` listing
fragment files, each ``u32 n``, ``f32 [n, 3]`` positions in nm, ``u32 [m, 3]`` triangles.

DracoPy is optional, imported on use.
"""

from __future__ import annotations

import gzip
import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import DvidShardsError
from .mesh import Mesh, MeshError, to_nm
from .sharding import ShardingSpec, murmurhash3_x86_128_low64, shard_key

__all__ = [
    "LEGACY_TYPE",
    "MULTILOD_TYPE",
    "Manifest",
    "MeshFormatError",
    "decode_fragment",
    "decode_legacy_fragment",
    "decode_object",
    "decode_manifest",
    "encode_fragment",
    "encode_legacy_fragment",
    "encode_manifest",
    "encode_object",
    "encode_shard_files",
    "legacy_files",
    "legacy_info",
    "morton_order",
    "multilod_info",
]

MULTILOD_TYPE = "neuroglancer_multilod_draco"
LEGACY_TYPE = "neuroglancer_legacy_mesh"
_INSTALL = "pip install 'dvidshards[mesh]'"


class MeshFormatError(DvidShardsError, ValueError):
    """Mesh manifest or fragment bytes are malformed, or arguments do not fit the format."""


def _draco() -> Any:
    try:
        import DracoPy
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(f"Draco mesh encoding needs the optional package DracoPy: {_INSTALL}") from e
    return DracoPy


def _check_bits(bits: int) -> int:
    if bits not in (10, 16):
        raise MeshFormatError(f"vertex_quantization_bits must be 10 or 16, got {bits!r}")
    return int(bits)


def _res3(resolution: Any) -> list[float]:
    res = [float(r) for r in np.asarray(resolution, np.float64).reshape(-1)]
    if len(res) != 3 or not all(r > 0 and np.isfinite(r) for r in res):
        raise MeshFormatError(f"resolution must be 3 positive numbers, got {resolution!r}")
    return res


def multilod_info(
    resolution: Any,
    vertex_quantization_bits: int = 16,
    sharding: ShardingSpec | None = None,
    lod_scale_multiplier: float = 1.0,
) -> dict[str, Any]:
    """The mesh directory's multi-resolution ``info`` (``resolution``: nm per voxel of the meshed
    scale; ``sharding`` needs ``data_encoding`` raw)."""
    r = _res3(resolution)
    info = {
        "@type": MULTILOD_TYPE,
        "vertex_quantization_bits": _check_bits(vertex_quantization_bits),
        "transform": [r[0], 0.0, 0.0, 0.0, 0.0, r[1], 0.0, 0.0, 0.0, 0.0, r[2], 0.0],
        "lod_scale_multiplier": float(lod_scale_multiplier),
    }
    if sharding is not None:
        if sharding.data_encoding != "raw":
            raise MeshFormatError("sharded multi-resolution meshes need data_encoding 'raw': the "
                                  "fragment data is read by offset before the manifest")
        info["sharding"] = sharding.to_json()
    return info


def legacy_info() -> dict[str, Any]:
    """The mesh directory's ``info`` for the legacy single-resolution format."""
    return {"@type": LEGACY_TYPE}


@dataclass(frozen=True)
class Manifest:
    """One object's multi-resolution manifest: ``fragment_positions[lod]`` uint32 (n, 3) in Z-curve
    order, ``fragment_sizes[lod]`` their byte sizes."""

    chunk_shape: tuple[float, float, float]
    grid_origin: tuple[float, float, float]
    lod_scales: tuple[float, ...]
    vertex_offsets: np.ndarray
    fragment_positions: tuple[np.ndarray, ...]
    fragment_sizes: tuple[np.ndarray, ...]

    @property
    def num_lods(self) -> int:
        return len(self.lod_scales)

    @property
    def data_size(self) -> int:
        """Bytes of fragment data the manifest describes."""
        return int(sum(int(s.sum()) for s in self.fragment_sizes))


def encode_manifest(m: Manifest) -> bytes:
    """``<id>.index`` bytes; MeshFormatError when the per-lod arrays disagree or positions are not
    in strict Z-curve order."""
    n = m.num_lods
    vo = np.asarray(m.vertex_offsets, np.float32).reshape(-1)
    if n < 1 or len(m.fragment_positions) != n or len(m.fragment_sizes) != n or vo.size != 3 * n:
        raise MeshFormatError("manifest arrays do not match num_lods")
    parts = [
        np.asarray(m.chunk_shape, "<f4").reshape(3).tobytes(),
        np.asarray(m.grid_origin, "<f4").reshape(3).tobytes(),
        struct.pack("<I", n),
        np.asarray(m.lod_scales, "<f4").tobytes(),
        vo.astype("<f4").tobytes(),
        np.asarray([len(p) for p in m.fragment_positions], "<u4").tobytes(),
    ]
    for pos, size in zip(m.fragment_positions, m.fragment_sizes, strict=True):
        p = np.asarray(pos, np.int64).reshape(-1, 3)
        s = np.asarray(size, np.int64).reshape(-1)
        if len(p) != len(s):
            raise MeshFormatError("fragment positions and sizes differ in length")
        if len(p) and (p.min() < 0 or p.max() > 0xFFFFFFFF or s.min() < 0 or s.max() > 0xFFFFFFFF):
            raise MeshFormatError("fragment position or size out of uint32 range")
        if len(p) > 1:
            hi, lo = _morton_keys(p)
            up = (hi[1:] > hi[:-1]) | ((hi[1:] == hi[:-1]) & (lo[1:] > lo[:-1]))
            if not up.all():
                raise MeshFormatError("fragment positions are not in strict Z-curve order")
        parts.append(np.ascontiguousarray(p.T).astype("<u4").tobytes())
        parts.append(s.astype("<u4").tobytes())
    return b"".join(parts)


def decode_manifest(data: Any) -> Manifest:
    """Parse ``<id>.index`` bytes; MeshFormatError when truncated or too long."""
    buf = bytes(data)
    if len(buf) < 28:
        raise MeshFormatError(f"manifest of {len(buf)} bytes is shorter than its header")
    n = struct.unpack_from("<I", buf, 24)[0]
    head = 28 + 4 * n + 12 * n + 4 * n
    if n < 1 or n > 64 or len(buf) < head:
        raise MeshFormatError(f"manifest with {n} lods does not fit {len(buf)} bytes")
    chunk = np.frombuffer(buf, "<f4", 3, 0)
    origin = np.frombuffer(buf, "<f4", 3, 12)
    scales = np.frombuffer(buf, "<f4", n, 28)
    vo = np.frombuffer(buf, "<f4", 3 * n, 28 + 4 * n).reshape(n, 3)
    counts = np.frombuffer(buf, "<u4", n, 28 + 16 * n).astype(np.int64)
    if head + int(counts.sum()) * 16 != len(buf):
        raise MeshFormatError(f"manifest of {len(buf)} bytes, its fragment counts need "
                              f"{head + int(counts.sum()) * 16}")
    off = head
    positions, sizes = [], []
    for c in counts.tolist():
        positions.append(np.frombuffer(buf, "<u4", 3 * c, off).reshape(3, c).T.copy())
        off += 12 * c
        sizes.append(np.frombuffer(buf, "<u4", c, off).astype(np.int64))
        off += 4 * c
    return Manifest(tuple(chunk.tolist()), tuple(origin.tolist()), tuple(scales.tolist()),
                    vo.copy(), tuple(positions), tuple(sizes))


def _spread(v: np.ndarray) -> np.ndarray:
    """Bits of values < 2**21 moved to every third bit."""
    x = v.astype(np.uint64) & np.uint64(0x1FFFFF)
    for shift, mask in ((32, 0x1F00000000FFFF), (16, 0x1F0000FF0000FF), (8, 0x100F00F00F00F00F),
                        (4, 0x10C30C30C30C30C3), (2, 0x1249249249249249)):
        x = (x | (x << np.uint64(shift))) & np.uint64(mask)
    return np.asarray(x)


def _morton_keys(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Z-curve keys of (n, 3) positions as (high, low) uint64 halves (x is bit 0)."""
    p = np.asarray(p, np.int64).reshape(-1, 3)
    lo = _spread(p[:, 0]) | (_spread(p[:, 1]) << np.uint64(1)) | (_spread(p[:, 2]) << np.uint64(2))
    h = p >> 21
    hi = _spread(h[:, 0]) | (_spread(h[:, 1]) << np.uint64(1)) | (_spread(h[:, 2]) << np.uint64(2))
    return hi, lo


def morton_order(positions: Any) -> np.ndarray:
    """Permutation sorting (n, 3) fragment positions into x-y-z Z-curve order."""
    p = np.asarray(positions, np.int64).reshape(-1, 3)
    if len(p) and (p.min() < 0 or p.max() > 0xFFFFFFFF):
        raise MeshFormatError("fragment positions must be uint32")
    hi, lo = _morton_keys(p)
    return np.lexsort((lo, hi))


def encode_fragment(mesh: Mesh, box_lo: Any, box_size: Any, bits: int = 16, compression_level: int = 7,
                    tolerance: float = 1e-3) -> bytes:
    """Draco bytes of one fragment (vertices in voxels; empty without faces), quantised on its octree
    box (``box_lo``, ``box_size``) with ``bits`` (10 or 16) at Draco ``compression_level`` (0..10); a
    vertex up to ``tolerance`` (box fractions) outside is clipped, further a MeshFormatError."""
    bits = _check_bits(bits)
    if not len(mesh.faces):
        return b""
    top = (1 << bits) - 1
    lo = np.asarray(box_lo, np.float64).reshape(3)
    size = np.asarray(box_size, np.float64).reshape(3)
    frac = (mesh.vertices.astype(np.float64) - lo) / size
    if frac.min() < -tolerance or frac.max() > 1 + tolerance:
        raise MeshFormatError(f"fragment vertices leave their box {lo.tolist()} + {size.tolist()}")
    q = np.clip(np.floor(frac * top + 0.5), 0, top).astype(np.float32)
    draco = _draco()
    return bytes(draco.encode(q, mesh.faces, quantization_bits=bits,
                              compression_level=int(compression_level),
                              quantization_range=float(top), quantization_origin=[0.0, 0.0, 0.0]))


def decode_fragment(data: Any, box_lo: Any, box_size: Any, bits: int = 16) -> Mesh:
    """Inverse of `encode_fragment`: vertices back in stored model coordinates."""
    bits = _check_bits(bits)
    if not len(data):
        return Mesh.empty()
    d = _draco().decode(bytes(data))
    q = np.asarray(d.points, np.float64).reshape(-1, 3)
    top = (1 << bits) - 1
    v = np.asarray(box_lo, np.float64) + np.asarray(box_size, np.float64) * (q / top)
    return Mesh(v.astype(np.float32), np.asarray(d.faces, np.int64).reshape(-1, 3))


def encode_object(
    lods: Sequence[Mapping[tuple[int, int, int], Mesh]],
    grid_origin: Any,
    chunk_shape: Any,
    bits: int = 16,
    compression_level: int = 7,
    vertex_offsets: Any = None,
    tolerance: float = 1e-3,
) -> tuple[bytes, bytes]:
    """Manifest and data (``<id>.index``, ``<id>``) of an object's levels of detail (per level, node
    position to mesh inside its box), node (0, 0, 0) at ``grid_origin``, level-0 nodes of
    ``chunk_shape``; ``vertex_offsets`` (num_lods, 3) what the viewer adds per level (default 0)."""
    origin = np.asarray(grid_origin, np.float64).reshape(3)
    chunk = np.asarray(chunk_shape, np.float64).reshape(3)
    if not (chunk > 0).all():
        raise MeshFormatError(f"chunk_shape must be positive, got {chunk_shape!r}")
    if not lods:
        raise MeshFormatError("an object needs at least one level of detail")
    data, positions, sizes = [], [], []
    for j, level in enumerate(lods):
        keys = list(level.keys())
        pos = np.asarray(keys, np.int64).reshape(-1, 3)
        pos = pos[morton_order(pos)]
        size = chunk * 2**j
        sz = []
        for p in pos:
            blob = encode_fragment(level[(int(p[0]), int(p[1]), int(p[2]))], origin + size * p, size,
                                   bits, compression_level, tolerance)
            data.append(blob)
            sz.append(len(blob))
        positions.append(pos)
        sizes.append(np.asarray(sz, np.int64))
    vo = np.zeros((len(lods), 3)) if vertex_offsets is None else np.asarray(vertex_offsets, np.float64)
    if vo.shape != (len(lods), 3) or not np.isfinite(vo).all():
        raise MeshFormatError(f"vertex_offsets must be {len(lods)} x 3 finite numbers, got {vertex_offsets!r}")
    m = Manifest(tuple(chunk.tolist()), tuple(origin.tolist()),
                 tuple(float(2**j) for j in range(len(lods))), vo, tuple(positions), tuple(sizes))
    return encode_manifest(m), b"".join(data)


def decode_object(manifest: Manifest, data: Any, lod: int = 0, bits: int = 16) -> list[Mesh]:
    """The non-empty fragments of one level of an object, in manifest order, vertices in stored
    model coordinates."""
    if not 0 <= lod < manifest.num_lods:
        raise MeshFormatError(f"lod {lod} not in [0, {manifest.num_lods})")
    buf = memoryview(bytes(data))
    if len(buf) < manifest.data_size:
        raise MeshFormatError(f"fragment data of {len(buf)} bytes, manifest needs {manifest.data_size}")
    start = int(sum(int(s.sum()) for s in manifest.fragment_sizes[:lod]))
    size = np.asarray(manifest.chunk_shape, np.float64) * 2**lod
    origin = np.asarray(manifest.grid_origin, np.float64) + manifest.vertex_offsets[lod]
    out = []
    for p, n in zip(manifest.fragment_positions[lod], manifest.fragment_sizes[lod].tolist(), strict=True):
        if n:
            out.append(decode_fragment(buf[start:start + n], origin + size * p, size, bits))
        start += n
    return out


def encode_shard_files(
    spec: ShardingSpec,
    entries: Mapping[int, bytes],
    prefixes: Mapping[int, bytes] | None = None,
) -> dict[str, bytes]:
    """``neuroglancer_uint64_sharded_v1`` shard files (``{name: bytes}``, shards without entries absent)
    holding ``entries`` (uint64 key -> bytes), as TensorStore writes them (see `PrecomputedShardWriter`).
    ``prefixes``: bytes written right before a key's entry and not indexed (a mesh's fragment data
    before its manifest); they need ``data_encoding`` raw."""
    if not isinstance(spec, ShardingSpec):
        raise TypeError(f"spec must be a ShardingSpec, got {type(spec).__name__}")
    prefixes = prefixes or {}
    if prefixes and spec.data_encoding != "raw":
        raise MeshFormatError("prefixed entries need data_encoding 'raw'")
    if not entries:
        return {}
    keys = np.array(sorted(int(k) for k in entries), dtype=np.uint64)
    if any(int(k) < 0 or int(k) >= 1 << 64 for k in entries):
        raise MeshFormatError("shard keys must be uint64")
    hashed = keys >> np.uint64(spec.preshift_bits) if spec.preshift_bits < 64 else np.zeros_like(keys)
    if spec.hash == "murmurhash3_x86_128":
        hashed = np.atleast_1d(murmurhash3_x86_128_low64(hashed))
    mini = hashed & np.uint64((1 << spec.minishard_bits) - 1)
    shard = (hashed >> np.uint64(spec.minishard_bits)) & np.uint64((1 << spec.shard_bits) - 1) \
        if spec.minishard_bits < 64 else np.zeros_like(hashed)
    nmini = 1 << spec.minishard_bits
    out = {}
    for s in np.unique(shard).tolist():
        sel = shard == np.uint64(s)
        body = bytearray()
        index = np.zeros((nmini, 2), np.uint64)
        for ms in np.unique(mini[sel]).tolist():
            ks = keys[sel & (mini == np.uint64(ms))]  # ascending
            starts, sizes = [], []
            for k in ks.tolist():
                body += prefixes.get(k, b"")
                blob = entries[k]
                if spec.data_encoding == "gzip":
                    blob = gzip.compress(blob, mtime=0)
                starts.append(len(body))
                sizes.append(len(blob))
                body += blob
            st = np.asarray(starts, np.uint64)
            sz = np.asarray(sizes, np.uint64)
            kd = np.diff(ks, prepend=np.uint64(0))
            sd = st - np.concatenate([[np.uint64(0)], st[:-1] + sz[:-1]]).astype(np.uint64)
            idx = np.concatenate([kd, sd, sz]).astype("<u8").tobytes()
            if spec.minishard_index_encoding == "gzip":
                idx = gzip.compress(idx, mtime=0)
            index[ms] = (len(body), len(body) + len(idx))
            body += idx
        out[shard_key(int(s), spec.shard_bits)] = index.astype("<u8").tobytes() + bytes(body)
    return out


def encode_legacy_fragment(mesh_nm: Mesh) -> bytes:
    """Legacy fragment bytes: u32 vertex count, f32 xyz vertices (nm), u32 triangles."""
    return (struct.pack("<I", len(mesh_nm.vertices)) + mesh_nm.vertices.astype("<f4").tobytes()
            + mesh_nm.faces.astype("<u4").tobytes())


def decode_legacy_fragment(data: Any) -> Mesh:
    """Parse a legacy fragment; MeshFormatError when the sizes do not add up."""
    buf = bytes(data)
    if len(buf) < 4:
        raise MeshFormatError("legacy fragment shorter than its vertex count")
    n = struct.unpack_from("<I", buf)[0]
    rest = len(buf) - 4 - 12 * n
    if rest < 0 or rest % 12:
        raise MeshFormatError(f"legacy fragment of {len(buf)} bytes does not fit {n} vertices")
    v = np.frombuffer(buf, "<f4", 3 * n, 4).reshape(n, 3)
    f = np.frombuffer(buf, "<u4", rest // 4, 4 + 12 * n).reshape(-1, 3)
    try:
        return Mesh(v, f)
    except MeshError as e:
        raise MeshFormatError(str(e)) from None


def legacy_files(
    objects: Mapping[int, Mesh | Sequence[Mesh] | Mapping[object, Mesh]],
    resolution: Any,
) -> dict[str, bytes]:
    """Every file of a legacy mesh directory: ``info``, ``<id>:0`` manifests and fragments.

    ``objects`` maps a segment id to a mesh, a list of fragments or a mapping of fragment names
    (tuples joined by ``_``) to fragments, in voxel corner coordinates; fragments are stored in nm
    (``resolution``) as ``<id>:0:<name>``.
    """
    res = _res3(resolution)
    files = {"info": json.dumps(legacy_info()).encode()}
    for segid, frs in objects.items():
        if isinstance(frs, Mesh):
            named = {"0": frs}
        elif isinstance(frs, Mapping):
            named = {"_".join(str(int(x)) for x in k) if isinstance(k, tuple) else str(k): m
                     for k, m in frs.items()}
        else:
            named = {str(i): m for i, m in enumerate(frs)}
        names = []
        for name, m in named.items():
            if not len(m.faces):
                continue
            key = f"{int(segid)}:0:{name}"
            files[key] = encode_legacy_fragment(to_nm(m, res))
            names.append(key)
        files[f"{int(segid)}:0"] = json.dumps({"fragments": names}).encode()
    return files

