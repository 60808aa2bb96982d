"""A procedural, mCNS-shaped DVID export: shard files synthesized on demand, nothing stored.

`ProceduralStore` is a read-only `ByteStore` that lists and serves the files of a DVID
``export-shards`` export of the male CNS (mCNS) geometry: 12 scales ``s0`` ... ``s11``, ~26,500
shard files at ``s0`` holding ~600 million 64³ chunks, each file a variant A shard (Arrow IPC
stream, record batches of ``batch_size`` rows, CSV index ``# schema_size=N`` then
``x,y,z,offset,size,batch_idx``; FORMATS.md §1-§3). Every byte is a pure function of
``(spec, seed, scale, chunk)``, so benchmarks and tests can run whole-export jobs against an
export of the real size, and check any chunk against `ProceduralStore.chunk_volume`.

How it is derived
-----------------
*Presence.* The tissue is a fixed union of 350 axis-aligned ellipsoids (brain, optic lobes,
neck, ventral nerve cord) placed in fractions of the scale-0 volume. A chunk of scale ``k`` is
present iff its box, in scale-0 voxels (closed), meets the union. A scale-``k`` box is the union
of its children's boxes, so a coarse chunk exists iff one of its scale-0 descendants does, and
a shard file exists iff one of its chunks does; both tests are exact and cheap (nearest point
of a box to each ellipsoid).

*Blocks.* A chunk's voxels are one of 64 *templates*: a 64³ partition into ``K`` regions
(weighted anisotropic Voronoi cells drawn on a 32³ grid and doubled; ``K`` from 1 to ~100,
median 14), region 0 the largest; blocks of ~25 kB that compress ~6x, like the real mCNS ones.
The template and its DVID encoding (FORMATS.md §1, sub-block labels sorted by template region)
are built once per seed and process; a chunk only substitutes its supervoxel ids into the
block label list.

*Ids.* Region ``r`` of a chunk is "slot" ``r``. Slot ``r`` has a lattice of cells of
``s_r`` scale-0 chunks per side (12 for the largest slots, 10, then 8), shifted by a per-slot
offset; the supervoxel of slot ``r`` in scale-0 chunk ``c`` is the id of cell
``(c + offset_r) // s_r`` of lattice ``r``, so neighbouring chunks share supervoxels and
supervoxels cross shard boundaries. An id is an invertible 46-bit mix of ``(r, cell)`` plus
one (never 0). The body of a supervoxel is the id of the anchor cell of its ``B_r``-cell group
(``B_r`` 8 for slot 0, spanning 3 shards, 4 and 2 for the next; 1 for the rare slots >= 64,
whose supervoxels are their own bodies): ~1.0e8 supervoxels in ~5e7 bodies at ``s0``.
`ProceduralStore.body_of` inverts the mix, so the supervoxel → body mapping is a pure
function of the id. A coarse chunk takes its ids from the scale-0 chunk at its centre. In
chunks not wholly inside one ellipsoid, slot 0 is background (0) when ``K > 1``.

*Payloads.* The zstd frame of a block is assembled, not compressed: a raw zstd block holding
the header and label list, then the template's pre-compressed sub-block data (zstd blocks of a
fresh frame do not refer back before their own start), then the XXH64 content checksum; the
frame carries the content size. Its length is therefore a function of the template alone, and
with it every record batch's byte size: the CSV index of a shard is computed from the chunk
list without building a byte of the .arrow file. Record batches are built on demand (only the
ones a byte range touches) with pyarrow, and kept in a bounded LRU cache.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import statistics
import threading
from collections import OrderedDict

import numba
import numpy as np
import pyarrow as pa
import zstandard

from dvidshards.errors import MissingShardError, SpecError
from dvidshards.formats.codec import encode_block
from dvidshards.formats.multiscale import SINGLE_SHARD, Scale, parse_multiscale
from dvidshards.stores.base import ByteStore, PastEndError, Stat
from dvidshards.writer import CHUNK_SIZE, RECORD_SCHEMA, default_sharding

__all__ = ["MCNS_SIZE", "ProceduralStore", "mcns_spec"]

# --- the mCNS geometry ------------------------------------------------------------------------------

MCNS_SIZE = (94088, 78317, 134576)  # scale-0 voxels (x, y, z) at 8 nm
MCNS_SCALES = 12
MCNS_RESOLUTION = 8.0
MCNS_BATCH_SIZE = 256
MCNS_SHARD_CHUNKS = 32  # 2048-voxel shards


def mcns_spec(shrink: int = 1) -> dict:
    """The neuroglancer multiscale spec DVID was given for the mCNS export.

    Built from its numbers: scale-0 size, 12 scales of 2× mode downsampling (``ceil(size/2)``),
    8 nm voxels, 64³ chunks, cubic shards of 32 chunks (`dvidshards.writer.default_sharding`,
    identity hash, gzip minishard index) and ``batch_size`` 256. ``shrink=1`` gives
    ``mcns-ng-specs.json`` exactly (same keys, values and key order).

    Parameters
    ----------
    shrink : {1, 2, 4, 8, 16, 32}, optional
        A smaller version of the same shape: scale-0 size ``ceil(size / shrink)``, voxels
        ``shrink`` times larger, shards of ``32 / shrink`` chunks, so the shard grid (and the
        ~26,000 shard files of `ProceduralStore`'s ``s0``) stays the same while every shard
        holds ``shrink**3`` times fewer chunks.

    Returns
    -------
    dict
        ``batch_size``, ``@type``, ``data_type``, ``num_channels``, ``scales``, ``type``.
    """
    if isinstance(shrink, bool) or shrink not in (1, 2, 4, 8, 16, 32):
        raise SpecError(f"shrink must be one of 1, 2, 4, 8, 16, 32, got {shrink!r}")
    scales = []
    for k in range(MCNS_SCALES):
        f = shrink << k
        size = [-(-n // f) for n in MCNS_SIZE]
        res = MCNS_RESOLUTION * f
        sh = default_sharding(size, MCNS_SHARD_CHUNKS // shrink).to_json()
        if sh.get("data_encoding", "raw") == "raw":
            sh.pop("data_encoding", None)
        scales.append({
            "chunk_sizes": [[CHUNK_SIZE, CHUNK_SIZE, CHUNK_SIZE]],
            "encoding": "compressed_segmentation",
            "key": f"{res:g}x{res:g}x{res:g}",
            "resolution": [res, res, res],
            "sharding": {key: sh[key] for key in sorted(sh)},
            "size": size,
        })
    return {
        "batch_size": MCNS_BATCH_SIZE,
        "@type": "neuroglancer_multiscale_volume",
        "data_type": "uint64",
        "num_channels": 1,
        "scales": scales,
        "type": "segmentation",
    }


# --- deterministic hashing (the same on every platform and numpy version) ---------------------------

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix64(x) -> np.ndarray:
    """splitmix64's finalizer on a uint64 array (a bijection; wraps mod 2**64)."""
    x = np.array(x, dtype=np.uint64, copy=True, ndmin=1)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def _hash_int(*parts: int) -> int:
    """A 64-bit hash of a few integers (Python ints, any size)."""
    h = 0x243F6A8885A308D3
    for p in parts:
        h = int(_mix64([(h ^ (int(p) & _M64)) + _GOLDEN & _M64])[0])
    return h


def _uniform(key: int, n: int) -> np.ndarray:
    """n floats in [0, 1) from the stream named by key."""
    i = np.arange(n, dtype=np.uint64) * np.uint64(_GOLDEN) + np.uint64(key & _M64)
    return (_mix64(i) >> np.uint64(11)).astype(np.float64) * 2.0**-53


# --- the tissue: a union of ellipsoids --------------------------------------------------------------

# envelopes (fractions of the scale-0 volume): centre x, y, z, radii x, y, z, share of the blobs
_ENVELOPES = np.array([
    (0.50, 0.48, 0.20, 0.297, 0.396, 0.154, 4.0),  # central brain
    (0.13, 0.48, 0.20, 0.110, 0.418, 0.121, 1.5),  # optic lobes
    (0.87, 0.48, 0.20, 0.110, 0.418, 0.121, 1.5),
    (0.50, 0.55, 0.38, 0.055, 0.066, 0.077, 0.3),  # neck connective
    (0.50, 0.56, 0.65, 0.198, 0.242, 0.275, 3.0),  # ventral nerve cord
])
_N_BLOBS = 350
_BLOB_RADII = (1.5, 4.0)  # in 2048-voxel mCNS shards; tuned for ~26,000 s0 shards of ~22,500 chunks


def _make_blobs() -> np.ndarray:
    """(n, 6) ellipsoids, centre and radii as fractions of the scale-0 size (fixed, seed-free)."""
    w = np.cumsum(_ENVELOPES[:, 6]) / _ENVELOPES[:, 6].sum()
    size = np.asarray(MCNS_SIZE, np.float64)
    out = np.empty((_N_BLOBS, 6))
    for i in range(_N_BLOBS):
        u = _uniform(_hash_int(1, i), 64)
        e = _ENVELOPES[int(np.searchsorted(w, u[0], side="right"))]
        for j in range(1, 61, 3):  # a point of the unit ball, by rejection
            p = 2.0 * u[j:j + 3] - 1.0
            if p @ p <= 1.0:
                break
        else:
            p = np.zeros(3)
        r = (_BLOB_RADII[0] + (_BLOB_RADII[1] - _BLOB_RADII[0]) * u[61:64]) * 2048.0 / size
        c = np.clip(e[:3] + p * e[3:6], r + 0.003, 1.0 - r - 0.003)
        out[i, :3], out[i, 3:] = c, r
    return out


_BLOBS = _make_blobs()


def _near_terms(lo: np.ndarray, hi: np.ndarray, c: np.ndarray, r: np.ndarray) -> np.ndarray:
    """((nearest point of [lo, hi] to c) - c)² / r² per blob and interval: (blobs, n)."""
    p = np.clip(c[:, None], lo[None, :], hi[None, :])
    return ((p - c[:, None]) / r[:, None]) ** 2


def _far_terms(lo: np.ndarray, hi: np.ndarray, c: np.ndarray, r: np.ndarray) -> np.ndarray:
    """(farthest point of [lo, hi] from c - c)² / r² per blob and interval: (blobs, n)."""
    d = np.maximum(np.abs(lo[None, :] - c[:, None]), np.abs(hi[None, :] - c[:, None]))
    return (d / r[:, None]) ** 2


# --- block templates --------------------------------------------------------------------------------

_N_TEMPLATES = 64
_MAX_K = 105  # the real s1 shard's largest block label list
_SLOT_BITS = 7  # slots < 128
_CELL_BITS = 13  # cell coordinates < 8192 per axis
_ID_BITS = _SLOT_BITS + 3 * _CELL_BITS  # 46
_ID_MASK = (1 << _ID_BITS) - 1
_MUL1, _MUL2 = 0x2C1B3C6D5A3F, 0x297A2D39B5B3  # odd multipliers (mod 2**46)
_INV1, _INV2 = pow(_MUL1, -1, 1 << _ID_BITS), pow(_MUL2, -1, 1 << _ID_BITS)


def _slot_params() -> tuple[np.ndarray, np.ndarray]:
    """Per slot: supervoxel cell size s (scale-0 chunks) and body group size B (cells)."""
    r = np.arange(1 << _SLOT_BITS)
    s = np.select([r < 4, r < 16], [12, 10], 8).astype(np.int64)
    b = np.select([r == 0, r < 4, r < 64], [8, 4, 2], 1).astype(np.int64)
    return s, b


_CELL, _GROUP = _slot_params()


def _template_sizes() -> np.ndarray:
    """Label-list lengths of the templates: log-normal quantiles (median 14), 1 and 105 at the ends."""
    nd = statistics.NormalDist(math.log(14.0), 0.8)
    k = [round(math.exp(nd.inv_cdf((i + 0.5) / _N_TEMPLATES))) for i in range(_N_TEMPLATES)]
    k[0], k[-1] = 1, _MAX_K
    return np.clip(np.asarray(k, np.int64), 1, _MAX_K)


@numba.njit(cache=True, nogil=True)
def _voronoi_kernel(pos, aniso, weight, out):  # pragma: no cover - numba
    """out[z, y, x] = argmin_k weight[k] * |aniso[k] * (voxel centre - pos[k])|² (pos in x, y, z)."""
    nz, ny, nx = out.shape
    nk = pos.shape[0]
    for z in range(nz):
        for y in range(ny):
            for x in range(nx):
                best = 0
                bd = 1e300
                for k in range(nk):
                    dx = (x + 0.5 - pos[k, 0]) * aniso[k, 0]
                    dy = (y + 0.5 - pos[k, 1]) * aniso[k, 1]
                    dz = (z + 0.5 - pos[k, 2]) * aniso[k, 2]
                    d = weight[k] * (dx * dx + dy * dy + dz * dz)
                    if d < bd:
                        bd = d
                        best = k
                out[z, y, x] = best


def _zstd_blocks(frame: bytes) -> bytes:
    """The blocks of a one-frame zstd stream, without frame header and checksum."""
    if len(frame) < 6 or frame[:4] != b"\x28\xb5\x2f\xfd":
        raise RuntimeError("zstandard did not write a zstd frame")
    fhd = frame[4]
    fcs_flag, single, checksum, dict_flag = fhd >> 6, (fhd >> 5) & 1, (fhd >> 2) & 1, fhd & 3
    p = 5 + (0 if single else 1) + (0, 1, 2, 4)[dict_flag] + ((1 if single else 0), 2, 4, 8)[fcs_flag]
    start = p
    while True:
        if p + 3 > len(frame):
            raise RuntimeError("truncated zstd frame")
        h = int.from_bytes(frame[p:p + 3], "little")
        p += 3 + (1 if (h >> 1) & 3 == 1 else h >> 3)
        if h & 1:
            break
    if p + 4 * checksum != len(frame):
        raise RuntimeError("unexpected bytes after the last zstd block")
    return frame[start:p]


def _fcs_len(usize: int) -> int:
    """Frame_Content_Size field length of a single-segment frame."""
    return 1 if usize < 256 else 2 if usize < 65536 + 256 else 4


class _Templates:
    """The block templates of one seed: index volumes, DVID encodings, zstd block runs."""

    def __init__(self, seed: int):
        ks = _template_sizes()
        self.vols = np.empty((_N_TEMPLATES, 64, 64, 64), np.uint8)
        self.k = np.empty(_N_TEMPLATES, np.int64)
        orders, bodies, blocks = [], [], []
        cctx = zstandard.ZstdCompressor(level=3, write_checksum=False, write_content_size=False,
                                        write_dict_id=False)
        for t in range(_N_TEMPLATES):
            k = int(ks[t])
            # weighted anisotropic Voronoi cells (few large, many small) on a 32³ grid, doubled:
            # 2-voxel steps on boundaries compress like the real mCNS blocks (~7x)
            u = _uniform(_hash_int(2, seed, t), 7 * k).reshape(k, 7)
            pos = np.ascontiguousarray(u[:, :3] * 36.0 - 2.0)
            aniso = np.ascontiguousarray(0.7 + 0.6 * u[:, 3:6])
            weight = np.ascontiguousarray(np.exp(u[:, 6] * math.log(30.0)))
            half = np.empty((32, 32, 32), np.uint8)
            _voronoi_kernel(pos, aniso, weight, half)
            raw = half.repeat(2, 0).repeat(2, 1).repeat(2, 2)
            counts = np.bincount(raw.ravel(), minlength=k)
            rank = np.empty(k, np.int64)  # slot 0: the largest region
            rank[np.argsort(-counts, kind="stable")] = np.arange(k)
            present = int((counts > 0).sum())
            vol = rank[raw].astype(np.uint8)
            self.vols[t] = vol
            self.k[t] = present
            block = encode_block(vol.astype(np.uint64) + np.uint64(1), subblock_order="sorted")
            n = int.from_bytes(block[12:16], "little")
            if n != present:
                raise RuntimeError(f"template {t}: {n} labels in the block, {present} regions")
            orders.append(np.frombuffer(block, "<u8", count=n, offset=16).astype(np.int64) - 1)
            body = block[16 + 8 * n:]
            bodies.append(np.frombuffer(body, np.uint8))
            blocks.append(np.frombuffer(_zstd_blocks(cctx.compress(body)) if body else b"", np.uint8))
        self.order_off = np.concatenate([[0], np.cumsum(self.k)]).astype(np.int64)
        self.order = np.concatenate(orders)  # slot of each label-list position
        self.body_off = np.concatenate([[0], np.cumsum([len(b) for b in bodies])]).astype(np.int64)
        self.body = np.concatenate(bodies)
        self.blocks_off = np.concatenate([[0], np.cumsum([len(b) for b in blocks])]).astype(np.int64)
        self.blocks = np.concatenate(blocks)
        self.usize = 16 + 8 * self.k + np.diff(self.body_off)
        fcs = np.array([_fcs_len(int(u)) for u in self.usize], np.int64)
        self.payload = 4 + 1 + fcs + 3 + 16 + 8 * self.k + np.diff(self.blocks_off) + 4
        self._self_check()

    def _self_check(self) -> None:
        """Assemble one payload per template and decompress it (the zstd frame layout holds)."""
        t = np.arange(_N_TEMPLATES, dtype=np.int64)
        offs = self.order_off
        svs = np.arange(1, offs[-1] + 1, dtype=np.uint64) * np.uint64(0x10001)
        data, poff = _payloads(self, t, svs, offs)
        d = zstandard.ZstdDecompressor()
        for i in range(_N_TEMPLATES):
            blob = data[poff[i]:poff[i + 1]].tobytes()
            got = d.decompress(blob)
            k = int(self.k[i])
            want = (np.array([8, 8, 8, k], "<u4").tobytes() + svs[offs[i]:offs[i + 1]].astype("<u8").tobytes()
                    + self.body[self.body_off[i]:self.body_off[i + 1]].tobytes())
            if got != want:
                raise RuntimeError(f"assembled zstd frame of template {i} does not decompress to its block")


_templates_lock = threading.Lock()
_templates_cache: OrderedDict[int, _Templates] = OrderedDict()


def _templates(seed: int) -> _Templates:
    """The templates of a seed (built once per process; the last 2 seeds kept)."""
    with _templates_lock:
        t = _templates_cache.get(seed)
        if t is not None:
            _templates_cache.move_to_end(seed)
            return t
    t = _Templates(seed)
    with _templates_lock:
        _templates_cache[seed] = t
        while len(_templates_cache) > 2:
            _templates_cache.popitem(last=False)
    return t


# --- zstd frame assembly (XXH64 content checksum) --------------------------------------------------

_P1 = np.uint64(0x9E3779B185EBCA87)
_P2 = np.uint64(0xC2B2AE3D27D4EB4F)
_P3 = np.uint64(0x165667B19E3779F9)
_P4 = np.uint64(0x85EBCA77C2B2AE63)
_P5 = np.uint64(0x27D4EB2F165667C5)


@numba.njit(cache=True, nogil=True, inline="always")
def _rotl(x, r):  # pragma: no cover - numba
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


@numba.njit(cache=True, nogil=True, inline="always")
def _xround(acc, v):  # pragma: no cover - numba
    acc = acc + v * _P2
    return _rotl(acc, 31) * _P1


@numba.njit(cache=True, nogil=True)
def _xxh64(w64, b8, n):  # pragma: no cover - numba
    """XXH64 (seed 0) of the first n bytes of a buffer seen as uint64 words w64 and bytes b8."""
    zero = np.uint64(0)
    p = 0
    if n >= 32:
        v1 = _P1 + _P2
        v2 = _P2
        v3 = zero
        v4 = zero - _P1
        while p + 32 <= n:
            i = p >> 3
            v1 = _xround(v1, w64[i])
            v2 = _xround(v2, w64[i + 1])
            v3 = _xround(v3, w64[i + 2])
            v4 = _xround(v4, w64[i + 3])
            p += 32
        h = _rotl(v1, 1) + _rotl(v2, 7) + _rotl(v3, 12) + _rotl(v4, 18)
        for v in (v1, v2, v3, v4):
            h ^= _xround(zero, v)
            h = h * _P1 + _P4
    else:
        h = _P5
    h += np.uint64(n)
    while p + 8 <= n:
        h ^= _xround(zero, w64[p >> 3])
        h = _rotl(h, 27) * _P1 + _P4
        p += 8
    if p + 4 <= n:
        k = (np.uint64(b8[p]) | (np.uint64(b8[p + 1]) << np.uint64(8)) | (np.uint64(b8[p + 2]) << np.uint64(16))
             | (np.uint64(b8[p + 3]) << np.uint64(24)))
        h ^= k * _P1
        h = _rotl(h, 23) * _P2 + _P3
        p += 4
    while p < n:
        h ^= np.uint64(b8[p]) * _P5
        h = _rotl(h, 11) * _P1
        p += 1
    h ^= h >> np.uint64(33)
    h *= _P2
    h ^= h >> np.uint64(29)
    h *= _P3
    h ^= h >> np.uint64(32)
    return h


@numba.njit(cache=True, nogil=True, inline="always")
def _put_le(buf, p, v, n):  # pragma: no cover - numba
    for i in range(n):
        buf[p + i] = np.uint8((np.uint64(v) >> np.uint64(8 * i)) & np.uint64(255))


@numba.njit(cache=True, nogil=True)
def _assemble_kernel(tmpl, svs, offs, body, body_off, blocks, blocks_off, poff, out, w64, b8):  # pragma: no cover
    """Write the zstd frame of every record's DVID block into out[poff[i]:poff[i+1]].

    The caller validated tmpl < templates, offs (label counts of the templates, ending at
    len(svs)), poff (ending at len(out)) and w64 (holds the largest block).  Each frame's size
    is checked against its slot in out before anything is written: returns the first record
    whose frame would not fit exactly, or -1.
    """
    for i in range(tmpl.shape[0]):
        t = tmpl[i]
        k = offs[i + 1] - offs[i]
        b0 = body_off[t]
        nb = body_off[t + 1] - b0
        head = 16 + 8 * k
        usize = head + nb
        c0 = blocks_off[t]
        nc = blocks_off[t + 1] - c0
        fcs = 1 if usize < 256 else (2 if usize < 65536 + 256 else 4)
        if 4 + 1 + fcs + 3 + head + nc + 4 != poff[i + 1] - poff[i] or 8 * w64.shape[0] < usize:
            return i
        # the uncompressed block: header, label list, the template's sub-block data
        _put_le(b8, 0, 8, 4)
        _put_le(b8, 4, 8, 4)
        _put_le(b8, 8, 8, 4)
        _put_le(b8, 12, k, 4)
        for j in range(k):
            w64[2 + j] = svs[offs[i] + j]  # label list starts at byte 16 (word 2), little-endian host
        for j in range(nb):
            b8[head + j] = body[b0 + j]
        h = _xxh64(w64, b8, usize)
        p = poff[i]
        out[p] = 0x28
        out[p + 1] = 0xB5
        out[p + 2] = 0x2F
        out[p + 3] = 0xFD
        if usize < 256:
            out[p + 4] = 0x24  # single segment, checksum, 1-byte content size
            out[p + 5] = np.uint8(usize)
            p += 6
        elif usize < 65536 + 256:
            out[p + 4] = 0x64
            _put_le(out, p + 5, usize - 256, 2)
            p += 7
        else:
            out[p + 4] = 0xA4
            _put_le(out, p + 5, usize, 4)
            p += 9
        _put_le(out, p, (head << 3) | (1 if nc == 0 else 0), 3)  # raw block, last if nothing follows
        p += 3
        for j in range(head):
            out[p + j] = b8[j]
        p += head
        for j in range(nc):
            out[p + j] = blocks[c0 + j]
        p += nc
        _put_le(out, p, h & np.uint64(0xFFFFFFFF), 4)
    return -1


def _payloads(tp: _Templates, tmpl: np.ndarray, svs: np.ndarray, offs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The zstd payloads of records (template, label list) and their offsets."""
    if not np.little_endian:  # the kernel stores labels and reads XXH64 words in host order
        raise RuntimeError("ProceduralStore builds shards on little-endian hosts only")
    n = len(tmpl)
    if n and (tmpl.min() < 0 or tmpl.max() >= _N_TEMPLATES):
        raise ValueError("template index out of range")
    if len(offs) != n + 1 or offs[0] != 0 or offs[-1] != len(svs) or np.any(np.diff(offs) != tp.k[tmpl]):
        raise ValueError("label lists do not match the templates")
    poff = np.zeros(n + 1, np.int64)
    np.cumsum(tp.payload[tmpl], out=poff[1:])
    out = np.empty(int(poff[-1]), np.uint8)
    w64 = np.empty(int(tp.usize.max()) // 8 + 2, np.uint64)
    bad = _assemble_kernel(tmpl.astype(np.int64), np.ascontiguousarray(svs, np.uint64), offs.astype(np.int64),
                           tp.body, tp.body_off, tp.blocks, tp.blocks_off, poff, out, w64, w64.view(np.uint8))
    if bad >= 0:
        raise RuntimeError(f"record {bad}: its zstd frame does not fit its precomputed size")
    return out, poff


# --- Arrow message sizes ----------------------------------------------------------------------------

_SCHEMA_MSG = np.frombuffer(RECORD_SCHEMA.serialize(), np.uint8)
_EOS = np.frombuffer(b"\xff\xff\xff\xff\x00\x00\x00\x00", np.uint8)


def _p8(n):
    return (n + 7) // 8 * 8


def _body_len(rows, nlabels, nbytes):
    """Body bytes of a record batch message (buffers padded to 8 bytes, no validity bitmaps)."""
    return 3 * _p8(4 * rows) + 2 * (_p8(4 * rows + 4) + 8 * nlabels) + _p8(4 * rows + 4) + _p8(nbytes) + _p8(4 * rows)


def _batch_meta_len() -> int:
    """Prefix + flatbuffer bytes of a record batch message of this schema (the same for every batch)."""
    one = pa.RecordBatch.from_arrays(
        [pa.array([0], pa.int32())] * 3 + [pa.array([[1]], pa.list_(pa.uint64()))] * 2
        + [pa.array([b"x"], pa.binary()), pa.array([1], pa.uint32())], schema=RECORD_SCHEMA)
    return len(one.serialize()) - _body_len(1, 1, 1)


_META_LEN = _batch_meta_len()


# --- the store ---------------------------------------------------------------------------------------

_KEY = re.compile(r"^s(\d+)/(\d+)_(\d+)_(\d+)\.(arrow|csv)$")


class _LRU:
    """A thread-safe LRU dict bounded by entry count and (optionally) total bytes."""

    def __init__(self, max_items: int, max_bytes: int | None = None):
        self.max_items, self.max_bytes = max_items, max_bytes
        self._d: OrderedDict = OrderedDict()  # key -> (value, nbytes)
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key):
        with self._lock:
            v = self._d.get(key)
            if v is None:
                return None
            self._d.move_to_end(key)
            return v[0]

    def put(self, key, value, nbytes: int = 0):
        """Store value (unless another thread did first); returns the cached value."""
        with self._lock:
            old = self._d.get(key)
            if old is not None:
                self._d.move_to_end(key)
                return old[0]
            self._d[key] = (value, nbytes)
            self._bytes += nbytes
            while len(self._d) > 1 and (len(self._d) > self.max_items
                                        or (self.max_bytes is not None and self._bytes > self.max_bytes)):
                _, (_, nb) = self._d.popitem(last=False)
                self._bytes -= nb
            return value


class _Plan:
    """What a shard holds, without its bytes: chunks in z, y, x order, templates, batch layout."""

    __slots__ = ("batch_off", "batch_rows", "boundary", "coords", "tmpl", "total")

    def __init__(self, coords, tmpl, boundary, batch_off, batch_rows):
        self.coords, self.tmpl, self.boundary = coords, tmpl, boundary
        self.batch_off, self.batch_rows = batch_off, batch_rows  # batch_off: m + 1 byte offsets
        self.total = int(batch_off[-1]) + len(_EOS)


class ProceduralStore(ByteStore):
    """A DVID export of mCNS geometry whose files are synthesized on demand (nothing stored).

    Lists ``s0`` ... ``s{n-1}`` at the root and ``{ox}_{oy}_{oz}.arrow`` + ``.csv`` per present
    shard in each scale folder; reads serve exact byte ranges (the lazy shard loader fetches
    only the CSV, the schema and the record batches it needs, and only those batches are
    built). See the module docstring for how presence, ids and payloads are derived.
    DVID writes no ``info`` file and neither does this store: pass ``spec=store.spec`` to
    `dvidshards.open` / `dvidshards.Dataset`.

    Parameters
    ----------
    spec : dict, optional
        The neuroglancer multiscale spec (default ``mcns_spec(shrink)``). Any spec with 64³
        chunks and sharding works; the tissue is placed in fractions of its scale-0 volume.
    seed : int, optional
        Chooses templates, slot offsets and ids; presence does not depend on it.
    shrink : int, optional
        With ``spec=None``: use ``mcns_spec(shrink)``, a quick small version of the same shape.
    cache_bytes : int, optional
        Budget of the cache of built record batches (LRU).

    Notes
    -----
    Pickles to its arguments (a few hundred bytes unless a custom spec is given), so dask
    tasks carry it; caches are per process and bounded (templates ~20 MB per seed, at most
    two seeds; record batches ``cache_bytes``; shard plans and CSV texts a few dozen).
    """

    mappable = False
    immediate = True  # everything is computed on the caller's thread

    def __init__(self, spec: dict | None = None, *, seed: int = 0, shrink: int = 1,
                 cache_bytes: int = 128 << 20):
        if spec is not None and shrink != 1:
            raise SpecError("give either spec or shrink, not both")
        self._spec_arg = spec
        self.spec = mcns_spec(shrink) if spec is None else spec
        self.seed = int(seed)
        self.shrink = int(shrink)
        self.cache_bytes = int(cache_bytes)
        self.scales: list[Scale] = parse_multiscale(self.spec, "ProceduralStore spec")
        self.batch_size = int(self.spec.get("batch_size", 1))
        if self.batch_size < 1:
            raise SpecError(f"batch_size must be positive, got {self.batch_size}")
        s0 = self.scales[0]
        for s in self.scales:
            if s.chunk_size != (CHUNK_SIZE,) * 3 or s.voxel_offset != (0, 0, 0):
                raise SpecError(f"scale {s.index}: ProceduralStore needs 64³ chunks and voxel_offset 0")
            if s.resolution is None or s0.resolution is None:
                raise SpecError("ProceduralStore needs resolutions in the spec")
        if max(s0.grid) + int(_CELL.max()) >= 1 << _CELL_BITS:
            raise SpecError(f"scale-0 chunk grid {s0.grid} is too large for 13-bit cell coordinates")
        # scale-0 voxels per voxel of each scale, tissue in scale-0 voxels
        self._factor = [np.asarray(s.resolution, np.float64) / np.asarray(s0.resolution, np.float64)
                        for s in self.scales]
        size0 = np.asarray(s0.size, np.float64)
        self._centre = _BLOBS[:, :3] * size0  # (blobs, 3)
        self._radius = _BLOBS[:, 3:] * size0
        self._salt = _hash_int(3, self.seed)
        self._id_salt = _hash_int(4, self.seed) & _ID_MASK
        u = _mix64(np.uint64(_hash_int(5, self.seed)) + np.arange(3 * len(_CELL), dtype=np.uint64))
        self._offsets = (u.reshape(-1, 3) % _CELL[:, None].astype(np.uint64)).astype(np.int64)  # (slots, 3)
        digest = hashlib.sha256(json.dumps(self.spec, sort_keys=True).encode()).hexdigest()[:16]
        self._stamp = f"procedural:{digest}:{self.seed}"
        self._name = (f"mcns{'' if self.shrink == 1 else f'-shrink{self.shrink}'}" if spec is None
                      else f"custom-{digest[:8]}") + f"-seed{self.seed}"
        self._init_caches()

    def _init_caches(self) -> None:
        self._masks: dict[int, np.ndarray] = {}
        self._masks_lock = threading.Lock()
        self._plans = _LRU(32)
        self._csvs = _LRU(8)
        self._batches = _LRU(1 << 16, self.cache_bytes)

    def __reduce__(self):
        return (_rebuild, (self._spec_arg, self.seed, self.shrink, self.cache_bytes))

    def __eq__(self, other) -> bool:
        return isinstance(other, ProceduralStore) and other._stamp == self._stamp

    def __hash__(self) -> int:
        return hash(self._stamp)

    def __repr__(self) -> str:
        return f"ProceduralStore({self._name!r}, {len(self.scales)} scales)"

    def describe(self, key: str) -> str:
        return f"procedural://{self._name}/{key}"

    # --- geometry -----------------------------------------------------------------------------------

    def _scale(self, k: int) -> Scale | None:
        return self.scales[k] if 0 <= k < len(self.scales) else None

    @staticmethod
    def _extent(s: Scale) -> int:
        return min(s.shard_extent, SINGLE_SHARD)

    def _shard_grid(self, s: Scale) -> tuple[int, ...]:
        e = self._extent(s)
        return tuple(-(-(g * CHUNK_SIZE) // e) for g in s.grid)

    def _present(self, lo_vox: list, hi_vox: list, f: np.ndarray, blobs=None,
                 inside_too: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
        """(meets tissue, wholly inside one ellipsoid) for the boxes lo[x] x lo[y] x lo[z] (scale voxels).

        Returns (z, y, x) boolean arrays. Boxes are closed, in scale-0 voxels ``v * f``.
        """
        b = np.arange(len(_BLOBS)) if blobs is None else blobs
        c, r = self._centre[b], self._radius[b]
        near = [_near_terms(lo_vox[a] * f[a], hi_vox[a] * f[a], c[:, a], r[:, a]) for a in range(3)]
        shape = (len(lo_vox[2]), len(lo_vox[1]), len(lo_vox[0]))
        meets = np.zeros(shape, bool)
        for i in range(len(b)):
            meets |= ((near[0][i][None, None, :] + near[1][i][None, :, None]) + near[2][i][:, None, None]) <= 1.0
        if not inside_too:
            return meets, None
        far = [_far_terms(lo_vox[a] * f[a], hi_vox[a] * f[a], c[:, a], r[:, a]) for a in range(3)]
        inside = np.zeros(shape, bool)
        for i in range(len(b)):
            inside |= ((far[0][i][None, None, :] + far[1][i][None, :, None]) + far[2][i][:, None, None]) <= 1.0
        return meets, inside

    def shard_mask(self, scale: int) -> np.ndarray:
        """Which shard files exist at a scale: boolean (z, y, x) over the shard grid."""
        with self._masks_lock:
            m = self._masks.get(scale)
        if m is not None:
            return m
        s = self.scales[scale]
        e, grid = self._extent(s), s.grid
        lo, hi = [], []
        for a, n in enumerate(self._shard_grid(s)):
            o = np.arange(n, dtype=np.int64) * e
            lo.append(o.astype(np.float64))
            hi.append(np.minimum(o + e, grid[a] * CHUNK_SIZE).astype(np.float64))
        m, _ = self._present(lo, hi, self._factor[scale], inside_too=False)
        m.setflags(write=False)
        with self._masks_lock:
            self._masks[scale] = m
        return m

    def shard_origins(self, scale: int) -> list[tuple[int, int, int]]:
        """Voxel origins (x, y, z) of the shard files of a scale, sorted."""
        e = self._extent(self.scales[scale])
        zyx = np.argwhere(self.shard_mask(scale))
        return sorted((int(x) * e, int(y) * e, int(z) * e) for z, y, x in zyx)

    def _chunk_masks(self, scale: int, lo_c, hi_c) -> tuple[np.ndarray, np.ndarray]:
        """(present, inside) (z, y, x) over the chunk box [lo_c, hi_c) of a scale."""
        f = self._factor[scale]
        cs = CHUNK_SIZE
        lo = [np.arange(lo_c[a], hi_c[a], dtype=np.int64) * cs for a in range(3)]
        hi = [v + cs for v in lo]
        lo_f = [v.astype(np.float64) for v in lo]
        hi_f = [v.astype(np.float64) for v in hi]
        # only the ellipsoids that reach the box
        blo = [np.array([float(lo_c[a] * cs)]) for a in range(3)]
        bhi = [np.array([float(hi_c[a] * cs)]) for a in range(3)]
        near = [_near_terms(blo[a] * f[a], bhi[a] * f[a], self._centre[:, a], self._radius[:, a])[:, 0]
                for a in range(3)]
        blobs = np.flatnonzero(((near[0] + near[1]) + near[2]) <= 1.0)
        present, inside = self._present(lo_f, hi_f, f, blobs)
        assert inside is not None
        return present, inside

    def _shard_box(self, scale: int, origin) -> tuple[list[int], list[int]]:
        s = self.scales[scale]
        e = self._extent(s)
        lo = [int(origin[a]) // CHUNK_SIZE for a in range(3)]
        hi = [min((int(origin[a]) + e) // CHUNK_SIZE, s.grid[a]) for a in range(3)]
        return lo, hi

    def _is_shard(self, scale: int, origin) -> bool:
        s = self._scale(scale)
        if s is None:
            return False
        e = self._extent(s)
        n = self._shard_grid(s)
        idx = [int(o) // e for o in origin]
        if any(int(o) % e for o in origin) or any(not 0 <= i < m for i, m in zip(idx, n, strict=True)):
            return False
        return bool(self.shard_mask(scale)[idx[2], idx[1], idx[0]])

    def chunk_hashes(self, scale: int, coords: np.ndarray) -> np.ndarray:
        """A 64-bit hash per chunk (x, y, z rows) of a scale."""
        c = np.asarray(coords, np.int64).reshape(-1, 3).astype(np.uint64)
        base = np.uint64(_hash_int(self._salt, scale))
        h = _mix64(base ^ c[:, 0])
        h = _mix64(h ^ c[:, 1])
        return _mix64(h ^ c[:, 2])

    def _plan(self, scale: int, origin) -> _Plan:
        key = (scale, tuple(int(v) for v in origin))
        p = self._plans.get(key)
        if p is not None:
            return p
        lo, hi = self._shard_box(scale, origin)
        present, inside = self._chunk_masks(scale, lo, hi)
        z, y, x = np.nonzero(present)  # C order: z slowest, as the writer (and DVID's ZYX scan)
        coords = np.stack([x + lo[0], y + lo[1], z + lo[2]], axis=1).astype(np.int64)
        tmpl = (self.chunk_hashes(scale, coords) % np.uint64(_N_TEMPLATES)).astype(np.int64)
        boundary = ~inside[z, y, x]
        tp = _templates(self.seed)
        n = len(coords)
        bs = self.batch_size
        m = -(-n // bs)
        starts = np.arange(m, dtype=np.int64) * bs
        rows = np.minimum(starts + bs, n) - starts
        nl = np.add.reduceat(tp.k[tmpl], starts) if n else np.zeros(0, np.int64)
        nb = np.add.reduceat(tp.payload[tmpl], starts) if n else np.zeros(0, np.int64)
        sizes = _META_LEN + _body_len(rows, nl, nb)
        off = np.empty(m + 1, np.int64)
        off[0] = len(_SCHEMA_MSG)
        np.cumsum(sizes, out=off[1:])
        off[1:] += len(_SCHEMA_MSG)
        return self._plans.put(key, _Plan(coords, tmpl, boundary, off, rows))

    # --- ids -----------------------------------------------------------------------------------------

    def _ids(self, slot: np.ndarray, cell: np.ndarray) -> np.ndarray:
        """Ids of (slot, cell x, y, z): an invertible mix on 46 bits, plus one."""
        key = (slot.astype(np.uint64) << np.uint64(3 * _CELL_BITS))
        for a in range(3):
            key |= cell[..., a].astype(np.uint64) << np.uint64(a * _CELL_BITS)
        x = key ^ np.uint64(self._id_salt)
        mask = np.uint64(_ID_MASK)
        x ^= x >> np.uint64(23)
        x = (x * np.uint64(_MUL1)) & mask
        x ^= x >> np.uint64(24)
        x = (x * np.uint64(_MUL2)) & mask
        x ^= x >> np.uint64(23)
        return x + np.uint64(1)

    def _unids(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(valid, slot, cell (n, 3)) of ids; the inverse of `_ids`."""
        ids = np.asarray(ids, np.uint64)
        valid = (ids >= np.uint64(1)) & (ids <= np.uint64(_ID_MASK + 1))
        x = (ids - np.uint64(1)) & np.uint64(_ID_MASK)
        mask = np.uint64(_ID_MASK)
        x ^= x >> np.uint64(23)
        x = (x * np.uint64(_INV2)) & mask
        x ^= x >> np.uint64(24)
        x = (x * np.uint64(_INV1)) & mask
        x ^= x >> np.uint64(23)
        key = x ^ np.uint64(self._id_salt)
        slot = (key >> np.uint64(3 * _CELL_BITS)).astype(np.int64)
        cm = np.uint64((1 << _CELL_BITS) - 1)
        cell = np.stack([((key >> np.uint64(a * _CELL_BITS)) & cm).astype(np.int64) for a in range(3)], axis=-1)
        return valid, slot, cell

    def body_of(self, supervoxels) -> np.ndarray:
        """The body (agglomerated id) of each supervoxel id: the mapping of this export.

        Pure: the id of the anchor cell of the supervoxel's body group. 0 maps to 0, and so does
        nothing else; ids this export never makes (other slots, or above 2**46) map to themselves.

        Parameters
        ----------
        supervoxels : array_like of uint64

        Returns
        -------
        numpy.ndarray
            uint64 body ids, same shape.
        """
        given = np.asarray(supervoxels, np.uint64)
        sv = given.reshape(-1)  # 1-d: numpy array arithmetic wraps silently, 0-d would warn
        valid, slot, cell = self._unids(sv)
        valid &= slot < _MAX_K
        slot = np.where(valid, slot, 0)
        g = _GROUP[slot][:, None]
        anchor = cell // g * g
        return np.where(valid, self._ids(slot, anchor), sv).reshape(given.shape)

    def mapping(self, supervoxels) -> np.ndarray:
        """(n, 2) uint64 rows (supervoxel, body) for the distinct non-zero ids given (a LabelMapping input)."""
        sv = np.unique(np.asarray(supervoxels, np.uint64))
        sv = sv[sv != 0]
        return np.stack([sv, self.body_of(sv)], axis=1)

    def _slot_ids(self, scale: int, coords: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Supervoxel of slot ``slots[i]`` in chunk ``coords[i]`` (x, y, z) of a scale."""
        f = self._factor[scale].astype(np.int64)
        grid0 = np.asarray(self.scales[0].grid, np.int64)
        c0 = np.clip(coords * f + f // 2, 0, grid0 - 1)  # the scale-0 chunk at the centre
        cell = (c0 + self._offsets[slots]) // _CELL[slots][:, None]
        return self._ids(slots, cell)

    def _labels(self, scale: int, coords, tmpl, boundary) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(supervoxels, bodies) flat in label-list order, and per-chunk offsets."""
        tp = _templates(self.seed)
        k = tp.k[tmpl]
        offs = np.zeros(len(tmpl) + 1, np.int64)
        np.cumsum(k, out=offs[1:])
        row = np.repeat(np.arange(len(tmpl)), k)
        pos = np.arange(offs[-1]) - offs[row]
        slots = tp.order[tp.order_off[tmpl][row] + pos]
        svs = self._slot_ids(scale, coords[row], slots)
        svs[(slots == 0) & boundary[row] & (k[row] > 1)] = 0
        bodies = self.body_of(svs)
        return svs, bodies, offs

    # --- pure functions for tests ----------------------------------------------------------------------

    def chunk_present(self, scale: int, x: int, y: int, z: int) -> bool:
        """Whether chunk (x, y, z) of a scale has a record."""
        s = self.scales[scale]
        if not all(0 <= v < g for v, g in zip((x, y, z), s.grid, strict=True)):
            return False
        p, _ = self._chunk_masks(scale, (x, y, z), (x + 1, y + 1, z + 1))
        return bool(p[0, 0, 0])

    def chunk_labels(self, scale: int, x: int, y: int, z: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(supervoxels, labels) of a chunk's record, in block label-list order; None if absent."""
        s = self.scales[scale]
        if not all(0 <= v < g for v, g in zip((x, y, z), s.grid, strict=True)):
            return None
        p, inside = self._chunk_masks(scale, (x, y, z), (x + 1, y + 1, z + 1))
        if not p[0, 0, 0]:
            return None
        coords = np.array([[x, y, z]], np.int64)
        tmpl = (self.chunk_hashes(scale, coords) % np.uint64(_N_TEMPLATES)).astype(np.int64)
        svs, bodies, _ = self._labels(scale, coords, tmpl, ~inside.reshape(1))
        return svs, bodies

    def chunk_volume(self, scale: int, x: int, y: int, z: int) -> np.ndarray:
        """The (z, y, x) uint64 supervoxels of a whole 64³ chunk (zeros where there is no record).

        Computed from the template's index volume, independently of the block codec.
        """
        out = np.zeros((CHUNK_SIZE,) * 3, np.uint64)
        s = self.scales[scale]
        if not all(0 <= v < g for v, g in zip((x, y, z), s.grid, strict=True)):
            return out
        p, inside = self._chunk_masks(scale, (x, y, z), (x + 1, y + 1, z + 1))
        if not p[0, 0, 0]:
            return out
        tp = _templates(self.seed)
        coords = np.array([[x, y, z]], np.int64)
        t = int(self.chunk_hashes(scale, coords)[0] % np.uint64(_N_TEMPLATES))
        k = int(tp.k[t])
        slots = np.arange(k, dtype=np.int64)
        by_slot = self._slot_ids(scale, np.repeat(coords, k, axis=0), slots)
        if k > 1 and not inside[0, 0, 0]:
            by_slot[0] = 0
        return by_slot[tp.vols[t]]

    def shard_chunks(self, scale: int, origin) -> np.ndarray:
        """(n, 3) chunk coordinates (x, y, z) of a shard's records, in file order."""
        return self._plan(scale, origin).coords.copy()

    # --- file contents ---------------------------------------------------------------------------------

    def _csv(self, scale: int, origin) -> bytes:
        key = (scale, tuple(int(v) for v in origin))
        c = self._csvs.get(key)
        if c is not None:
            return c
        p = self._plan(scale, origin)
        n = len(p.coords)
        b = np.repeat(np.arange(len(p.batch_rows)), p.batch_rows)
        off = p.batch_off[b]
        size = (p.batch_off[1:] - p.batch_off[:-1])[b]
        idx = np.arange(n) - b * self.batch_size
        cols = [p.coords[:, 0], p.coords[:, 1], p.coords[:, 2], off, size, idx]
        lines = [f"# schema_size={len(_SCHEMA_MSG)}", "x,y,z,offset,size,batch_idx"]
        lines += map("{},{},{},{},{},{}".format, *(col.tolist() for col in cols))
        text = ("\n".join(lines) + "\n").encode("ascii")
        return self._csvs.put(key, text, len(text))

    def _batch(self, scale: int, origin, b: int) -> np.ndarray:
        """The bytes of record batch b of a shard (a cached read-only array)."""
        key = (scale, tuple(int(v) for v in origin), b)
        got = self._batches.get(key)
        if got is not None:
            return got
        p = self._plan(scale, origin)
        r0 = b * self.batch_size
        r1 = r0 + int(p.batch_rows[b])
        coords, tmpl, boundary = p.coords[r0:r1], p.tmpl[r0:r1], p.boundary[r0:r1]
        svs, bodies, offs = self._labels(scale, coords, tmpl, boundary)
        tp = _templates(self.seed)
        data, poff = _payloads(tp, tmpl, svs, offs)
        n = r1 - r0
        offs32 = pa.array(offs.astype(np.int32))
        arrays = [pa.array(coords[:, a].astype(np.int32)) for a in range(3)] + [
            pa.ListArray.from_arrays(offs32, pa.array(bodies, pa.uint64())),
            pa.ListArray.from_arrays(offs32, pa.array(svs, pa.uint64())),
            pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(poff.astype(np.int32)), pa.py_buffer(data)]),
            pa.array(tp.usize[tmpl].astype(np.uint32)),
        ]
        msg = np.frombuffer(pa.RecordBatch.from_arrays(arrays, schema=RECORD_SCHEMA).serialize(), np.uint8)
        want = int(p.batch_off[b + 1] - p.batch_off[b])
        if len(msg) != want:
            raise RuntimeError(f"{self.describe(_stem(scale, origin))}.arrow: batch {b} "
                               f"is {len(msg)} bytes, its index says {want} (pyarrow's IPC layout changed?)")
        return self._batches.put(key, msg, len(msg))

    def _arrow_range(self, scale: int, origin, a: int, z: int) -> np.ndarray:
        """Bytes [a, z) of a shard's .arrow file (bounds already checked)."""
        p = self._plan(scale, origin)
        off = p.batch_off
        parts = []
        pos = a
        while pos < z:
            if pos < off[0]:  # the schema message
                end = min(z, int(off[0]))
                parts.append(_SCHEMA_MSG[pos:end])
            elif pos >= off[-1]:  # the end-of-stream marker
                end = z
                parts.append(_EOS[pos - int(off[-1]):end - int(off[-1])])
            else:
                b = int(np.searchsorted(off, pos, side="right")) - 1
                end = min(z, int(off[b + 1]))
                parts.append(self._batch(scale, origin, b)[pos - int(off[b]):end - int(off[b])])
            pos = end
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else np.zeros(0, np.uint8)

    def _parse(self, key: str):
        m = _KEY.match(key)
        if m is None:
            return None
        scale = int(m.group(1))
        origin = (int(m.group(2)), int(m.group(3)), int(m.group(4)))
        if not self._is_shard(scale, origin):
            return None
        return scale, origin, m.group(5)

    def _missing(self, key: str):
        return MissingShardError(f"{self.describe(key)}: no such file")

    def arrow_bytes(self, scale: int, origin) -> np.ndarray:
        """The whole .arrow file of a shard (MissingShardError if the shard does not exist)."""
        key = _stem(scale, origin) + ".arrow"
        if not self._is_shard(scale, origin):
            raise self._missing(key)
        return self._arrow_range(scale, origin, 0, self._plan(scale, origin).total)

    # --- ByteStore ---------------------------------------------------------------------------------------

    async def read(self, key: str, start: int | None = None, stop: int | None = None):
        parsed = self._parse(key)
        if parsed is None:
            raise self._missing(key)
        scale, origin, ext = parsed
        if ext == "csv":
            data = np.frombuffer(self._csv(scale, origin), np.uint8)
            n = len(data)
        else:
            n = self._plan(scale, origin).total
        a = (n + start if start < 0 else start) if start is not None else 0
        b = n if stop is None else stop
        if a < 0 or b > n or a > b:
            raise PastEndError(f"{self.describe(key)}: bytes [{start}, {stop}) lie past its end ({n} bytes)", n)
        if ext == "csv":
            return data[a:b]
        return self._arrow_range(scale, origin, a, b)

    async def exists(self, key: str) -> bool:
        k = key.strip("/")
        if k == "" or (re.fullmatch(r"s\d+", k) and int(k[1:]) < len(self.scales)):
            return True
        return self._parse(k) is not None

    async def list(self, prefix: str = "") -> list[str]:
        p = prefix.strip("/")
        if p == "":
            return sorted(f"s{s.index}" for s in self.scales)
        m = re.fullmatch(r"s(\d+)", p)
        if m is None or int(m.group(1)) >= len(self.scales):
            return []
        names: list[str] = []
        for x, y, z in self.shard_origins(int(m.group(1))):
            names += (f"{x}_{y}_{z}.arrow", f"{x}_{y}_{z}.csv")
        return sorted(names)

    async def stat(self, key: str) -> Stat:
        parsed = self._parse(key)
        if parsed is None:
            raise self._missing(key)
        scale, origin, ext = parsed
        size = len(self._csv(scale, origin)) if ext == "csv" else self._plan(scale, origin).total
        return Stat(size, self._stamp)


def _stem(scale: int, origin) -> str:
    return f"s{scale}/{int(origin[0])}_{int(origin[1])}_{int(origin[2])}"


def _rebuild(spec, seed, shrink, cache_bytes) -> ProceduralStore:
    return ProceduralStore(spec, seed=seed, shrink=shrink, cache_bytes=cache_bytes)
