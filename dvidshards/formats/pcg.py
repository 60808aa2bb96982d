"""PyChunkedGraph (PCG) chunk edges and components: ids, contact kernel and wire format.

Per layer-1 chunk PCG ingests ``edges_{x}_{y}_{z}.proto.zst`` (one zstd frame of a
``ChunkEdgesMsg``: ``in_chunk``, ``cross_chunk``, ``between_chunk`` ``EdgesMsg``s of raw
little-endian ``node_ids1``, ``node_ids2`` (uint64), ``affinities`` (float32), ``areas``
(uint64)) and ``components_{x}_{y}_{z}.proto`` (a ``ChunkComponentsMsg``: packed varints
``[len(c0), c0..., len(c1), c1...]``); the messages are the generated modules of
``proto/chunkEdges.proto`` and ``proto/chunkComponents.proto`` (optional protobuf).

A PCG supervoxel id carries its chunk: ``layer (8 bits) | x | y | z | counter``, ``max(spatial
bits, layers - 2)`` bits per axis (`IdLayout`). Each (DVID supervoxel, PCG chunk) piece is one
PCG supervoxel whose counter is 1 + the rank of the DVID id in the chunk's id list, the sorted
union of the supervoxel lists of the DVID blocks overlapping the chunk: block metadata alone, so
a chunk names its neighbours' pieces without reading their voxels.

`contacts` counts, per pair of pieces, the 6-connected faces where they touch, inside a chunk
read with a one-voxel halo and across its 6 faces (nogil numba). `chunk_graph` makes PCG's
edges: ``in`` (both in the chunk, ``node_ids1 < node_ids2``), ``between`` (different DVID
supervoxels across a face) and ``cross`` (two pieces of one DVID supervoxel across a face,
affinity +inf, area 1), the last two with ``node_ids1`` in the chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numba as nb
import numpy as np

from ..errors import DvidShardsError

__all__ = [
    "DIRECTIONS",
    "EDGE_TYPES",
    "Contacts",
    "IdLayout",
    "PcgError",
    "chunk_graph",
    "components_path",
    "contacts",
    "decode_components",
    "decode_edges",
    "edges_path",
    "encode_components",
    "encode_edges",
    "group_components",
    "layers_for_grid",
    "list_indexes",
    "message_classes",
]

EDGE_TYPES = ("in", "between", "cross")
# face neighbours in the order the kernel reports them: -x, +x, -y, +y, -z, +z
DIRECTIONS = np.array([[-1, 0, 0], [1, 0, 0], [0, -1, 0], [0, 1, 0], [0, 0, -1], [0, 0, 1]], np.int64)
DEFAULT_AFFINITY = np.finfo(np.float32).tiny  # PCG's Edges default (1.1754944e-38)
_MAX_LIST = 1 << 31  # id list entries the kernel indexes with int64 codes a * n + b


class PcgError(DvidShardsError, ValueError):
    """PCG output cannot be produced or read: id overflow, inconsistent labels, corrupt files."""


def edges_path(coords: Any) -> str:
    return "edges_" + "_".join(str(int(c)) for c in coords) + ".proto.zst"


def components_path(coords: Any) -> str:
    return "components_" + "_".join(str(int(c)) for c in coords) + ".proto"


def layers_for_grid(grid: Any, fanout: int = 2) -> int:
    """PCG's layer count for a layer-1 grid: ``ceil(log_fanout(max chunks per axis)) + 2``."""
    n = max(int(v) for v in grid)
    if n < 1 or fanout < 2:
        raise PcgError(f"grid {tuple(grid)} and fanout {fanout}: need >= 1 chunk and fanout >= 2")
    return max(2, math.ceil(math.log(n, fanout) - 1e-12) + 2)


@dataclass(frozen=True)
class IdLayout:
    """The bit layout of PCG node ids (``compute_bitmasks``): ``layers`` (`layers_for_grid`),
    ``spatial_bits`` (PCG's ``SPATIAL_BITS``, 10: the least bits per axis of layer-1 and 2
    coordinates), ``layer_bits`` (``LAYER_ID_BITS``, 8)."""

    layers: int
    spatial_bits: int = 10
    layer_bits: int = 8

    def __post_init__(self) -> None:
        if not (2 <= self.layers < (1 << self.layer_bits)) or self.layer_bits < 1:
            raise PcgError(f"layers must be in [2, {1 << self.layer_bits}), got {self.layers}")
        if self.spatial_bits < self.layers - 2:
            # PCG's compute_bitmasks: "{s} bits is not enough for encoding."
            raise PcgError(f"spatial_bits {self.spatial_bits} is not enough for {self.layers} layers "
                           f"(need >= {self.layers - 2})")
        if self.counter_bits < 1:
            raise PcgError(f"{self.layer_bits} layer bits and 3 x {self.bits_per_dim} spatial bits leave "
                           "no bits for the segment counter")

    @property
    def bits_per_dim(self) -> int:
        return max(self.spatial_bits, self.layers - 2)

    @property
    def counter_bits(self) -> int:
        return 64 - self.layer_bits - 3 * self.bits_per_dim

    @property
    def max_chunks_per_axis(self) -> int:
        return 1 << self.bits_per_dim

    def check_grid(self, grid: Any) -> None:
        """PcgError if a grid of this many chunks per axis does not fit the id bits."""
        g = [int(v) for v in grid]
        if any(v > self.max_chunks_per_axis for v in g):
            raise PcgError(f"{tuple(g)} chunks per axis do not fit {self.bits_per_dim} bits per axis "
                           f"(at most {self.max_chunks_per_axis}; use a larger chunk size or more spatial bits)")

    def chunk_id(self, x: int, y: int, z: int, layer: int = 1) -> int:
        """The id of a chunk (counter 0)."""
        b = self.bits_per_dim
        for v in (x, y, z):
            if not 0 <= int(v) < (1 << b):
                raise PcgError(f"chunk ({x}, {y}, {z}) does not fit {b} bits per axis")
        if not 1 <= layer < (1 << self.layer_bits):
            raise PcgError(f"layer {layer} out of range")
        off = 64 - self.layer_bits
        return (int(layer) << off) | (int(x) << (off - b)) | (int(y) << (off - 2 * b)) | (int(z) << (off - 3 * b))

    def node_ids(self, coords: Any, counters: Any) -> np.ndarray:
        """Layer-1 ids of pieces with 1-based ``counters`` in chunk ``coords``."""
        c = np.asarray(counters, dtype=np.int64)
        if c.size and (c.min() < 1 or c.max() >= (1 << self.counter_bits)):
            raise PcgError(f"chunk {tuple(int(v) for v in coords)}: {int(c.max())} pieces do not fit the "
                           f"{self.counter_bits}-bit segment counter")
        return np.asarray(np.uint64(self.chunk_id(*coords)) | c.astype(np.uint64))

    def decode(self, ids: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Split ids into (layer, x, y, z, counter) arrays."""
        a = np.asarray(ids, dtype=np.uint64)
        b, off = self.bits_per_dim, 64 - self.layer_bits
        m = np.uint64((1 << b) - 1)
        return (a >> np.uint64(off), (a >> np.uint64(off - b)) & m, (a >> np.uint64(off - 2 * b)) & m,
                (a >> np.uint64(off - 3 * b)) & m, a & np.uint64((1 << self.counter_bits) - 1))

    def to_json(self) -> dict[str, Any]:
        return {"layers": self.layers, "spatial_bits": self.spatial_bits, "layer_bits": self.layer_bits,
                "bits_per_dim": self.bits_per_dim, "counter_bits": self.counter_bits}


_GOLD = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing


@nb.njit(nogil=True, cache=True, inline="always")
def _slot(v, bits):  # type: ignore[no-untyped-def]  # pragma: no cover - numba
    return np.int64((v * _GOLD) >> np.uint64(64 - bits))


@nb.njit(nogil=True, cache=True)
def _build_tables(vals, offs, tk, tv, toff, tbits):  # type: ignore[no-untyped-def]  # pragma: no cover - numba
    """Open-addressing tables id -> list index, one per list vals[offs[t]:offs[t+1]]."""
    for t in range(offs.shape[0] - 1):
        mask = (1 << tbits[t]) - 1
        for j in range(offs[t], offs[t + 1]):
            v = vals[j]
            i = _slot(v, tbits[t])
            while tk[toff[t] + i] != 0:
                i = (i + 1) & mask
            tk[toff[t] + i] = v
            tv[toff[t] + i] = j - offs[t]


@nb.njit(nogil=True, cache=True, inline="always")
def _lookup(tk, tv, off, bits, v):  # type: ignore[no-untyped-def]  # pragma: no cover - numba
    mask = (1 << bits) - 1
    i = _slot(v, bits)
    while True:
        k = tk[off + i]
        if k == v:
            return tv[off + i]
        if k == 0:
            return -1
        i = (i + 1) & mask


@nb.njit(nogil=True, cache=True, inline="always")
def _add(pk, pv, bits, key, n):  # type: ignore[no-untyped-def]  # pragma: no cover - numba
    """pv[key] += n in an open-addressing table (-1: empty); 1 for a new key."""
    mask = (1 << bits) - 1
    i = _slot(np.uint64(key), bits)
    while True:
        k = pk[i]
        if k == key:
            pv[i] += n
            return 0
        if k == -1:
            pk[i] = key
            pv[i] = n
            return 1
        i = (i + 1) & mask


@nb.njit(nogil=True, cache=True)
def _list_indexes(lst, ids, out):  # type: ignore[no-untyped-def]  # pragma: no cover - numba
    """out[j] = 1 + index of ids[j] in sorted lst (0 for 0); the first j not found, or -1."""
    n = lst.shape[0]
    for j in range(ids.shape[0]):
        v = ids[j]
        if v == 0:
            out[j] = 0
            continue
        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi) >> 1
            if lst[mid] < v:
                lo = mid + 1
            else:
                hi = mid
        if lo == n or lst[lo] != v:
            return j
        out[j] = lo + 1
    return -1


def list_indexes(lst: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, int]:
    """1 + the index of each id in a sorted id list (0 for 0), and the first position of an id not
    in it (-1: none): the palette turning a block's ids into list indexes."""
    out = np.empty(ids.shape[0], np.uint64)
    return out, int(_list_indexes(lst, ids, out))


@nb.njit(nogil=True, cache=True)
def _relabel(vol, tk, tv, toff, tbits, out):  # type: ignore[no-untyped-def]  # pragma: no cover - numba
    """out = 1 + list index of each id of vol (0 for 0), the chunk through table 0, halo face d through
    table 1 + d (halo edges and corners stay 0); (error, z, y, x): 1 a chunk voxel, 2 a halo voxel
    not in its list."""
    nz = vol.shape[0] - 2
    ny = vol.shape[1] - 2
    nx = vol.shape[2] - 2
    for d in range(7):  # d = 0: the chunk; 1 + f: face f (-x, +x, -y, +y, -z, +z)
        z0, z1, y0, y1, x0, x1 = 1, nz + 1, 1, ny + 1, 1, nx + 1
        if d > 0:
            f = d - 1
            at = 0 if (f & 1) == 0 else (nx, ny, nz)[f >> 1] + 1
            if f >> 1 == 0:
                x0, x1 = at, at + 1
            elif f >> 1 == 1:
                y0, y1 = at, at + 1
            else:
                z0, z1 = at, at + 1
        off = toff[d]
        bits = tbits[d]
        av = np.uint64(0)
        ai = np.uint64(0)
        for z in range(z0, z1):
            for y in range(y0, y1):
                for x in range(x0, x1):
                    a = vol[z, y, x]
                    if a == 0:
                        out[z, y, x] = 0
                        continue
                    if a != av or ai == 0:
                        i = _lookup(tk, tv, off, bits, a)
                        if i < 0:
                            return 1 if d == 0 else 2, z, y, x
                        av = a
                        ai = np.uint64(i + 1)
                    out[z, y, x] = ai
    return 0, 0, 0, 0


@nb.njit(nogil=True, cache=True)
def _contact_kernel(vol, sizes, mx, counts, pk, pv, pbits):  # type: ignore[no-untyped-def]  # pragma: no cover - numba
    """Voxel and 6-connected contact counts of a chunk read with a 1-voxel halo.

    vol (nz+2, ny+2, nx+2) holds 1 + list index (0: background): of the chunk's list inside
    (sizes[0] ids), of neighbour d's list on halo face d (-x, +x, -y, +y, -z, +z; sizes[1 + d],
    at most mx); halo edges and corners unread. counts[i] += voxels of index i; the pair table (pk,
    pv, 2**pbits slots) sums faces per key ``a * no + b`` (a < b) inside, ``no * no + (d * no + a) *
    mx + b`` across face d. (error, z, y, x): 1 a chunk value > sizes[0], 2 a halo value past its
    list, 3 the pair table over half full (call again with a larger one).
    """
    nz = vol.shape[0] - 2
    ny = vol.shape[1] - 2
    nx = vol.shape[2] - 2
    no = sizes[0]
    uno = np.uint64(no)
    limit = (1 << pbits) >> 1
    used = 0
    kx = ky = kz = -1  # pending pair (key, count) per axis: contacts repeat along x
    cx = cy = cz = 0
    for z in range(1, nz + 1):
        for y in range(1, ny + 1):
            r = vol[z, y]
            ry = vol[z, y + 1]
            rz = vol[z + 1, y]
            av = np.uint64(0)
            run = 0
            for x in range(1, nx + 1):
                a = r[x]
                if a != av:
                    if av != 0:
                        counts[av - 1] += run
                    if a > uno:
                        return 1, z, y, x
                    av = a
                    run = 0
                if a == 0:
                    continue
                run += 1
                # values of unvisited neighbours are checked when visited: a bad one fails the call
                if x < nx:
                    b = r[x + 1]
                    if b != a and b != 0:
                        key = np.int64(min(a, b) - 1) * no + np.int64(max(a, b) - 1)
                        if key == kx:
                            cx += 1
                        else:
                            if cx:
                                used += _add(pk, pv, pbits, kx, cx)
                            kx = key
                            cx = 1
                if y < ny:
                    b = ry[x]
                    if b != a and b != 0:
                        key = np.int64(min(a, b) - 1) * no + np.int64(max(a, b) - 1)
                        if key == ky:
                            cy += 1
                        else:
                            if cy:
                                used += _add(pk, pv, pbits, ky, cy)
                            ky = key
                            cy = 1
                if z < nz:
                    b = rz[x]
                    if b != a and b != 0:
                        key = np.int64(min(a, b) - 1) * no + np.int64(max(a, b) - 1)
                        if key == kz:
                            cz += 1
                        else:
                            if cz:
                                used += _add(pk, pv, pbits, kz, cz)
                            kz = key
                            cz = 1
                if used > limit:
                    return 3, 0, 0, 0
            if av != 0:
                counts[av - 1] += run
    if cx:
        used += _add(pk, pv, pbits, kx, cx)
    if cy:
        used += _add(pk, pv, pbits, ky, cy)
    if cz:
        used += _add(pk, pv, pbits, kz, cz)
    # the six faces: chunk voxel (inside) against halo voxel (outside)
    for d in range(6):
        axis = d >> 1
        n = nx if axis == 0 else (ny if axis == 1 else nz)
        inner = 1 if (d & 1) == 0 else n
        outer = 0 if (d & 1) == 0 else n + 1
        n1 = ny if axis == 0 else nx
        n2 = ny if axis == 2 else nz
        base = no * no + d * no * mx
        nb = np.uint64(sizes[d + 1])
        pend = -1
        cnt = 0
        for j in range(1, n2 + 1):
            for i in range(1, n1 + 1):
                if axis == 0:
                    a = vol[j, i, inner]
                    b = vol[j, i, outer]
                elif axis == 1:
                    a = vol[j, inner, i]
                    b = vol[j, outer, i]
                else:
                    a = vol[inner, j, i]
                    b = vol[outer, j, i]
                if b > nb:
                    if axis == 0:
                        return 2, j, i, outer
                    if axis == 1:
                        return 2, j, outer, i
                    return 2, outer, j, i
                if a == 0 or b == 0:
                    continue
                key = base + np.int64(a - 1) * mx + np.int64(b - 1)
                if key == pend:
                    cnt += 1
                else:
                    if cnt:
                        used += _add(pk, pv, pbits, pend, cnt)
                    pend = key
                    cnt = 1
                if used > limit:
                    return 3, 0, 0, 0
        if cnt:
            used += _add(pk, pv, pbits, pend, cnt)
    return 0, 0, 0, 0


@dataclass
class Contacts:
    """Voxel and contact counts of one chunk in indexes of its id lists: ``voxels`` per list entry,
    ``in_pairs`` (a < b, sorted) and ``in_area``, and across faces ``face_dir`` (into
    ``DIRECTIONS``), ``face_pairs`` (own, neighbour index) and ``face_area``."""

    voxels: np.ndarray
    in_pairs: np.ndarray
    in_area: np.ndarray
    face_dir: np.ndarray
    face_pairs: np.ndarray
    face_area: np.ndarray


def _sorted_ids(a: Any, what: str) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=np.uint64).ravel()
    if a.size >= _MAX_LIST:
        raise PcgError(f"{what}: {a.size} ids is too many for one chunk")
    if a.size and (a[0] == 0 or np.any(a[1:] <= a[:-1])):
        raise PcgError(f"{what}: an id list must be sorted, unique and without 0")
    return np.asarray(a)


def contacts(vol_zyx: np.ndarray, own: Any, neighbours: Any, where: str = "chunk", indexed: bool = False) -> Contacts:
    """Voxels and 6-connected contacts of a chunk read with a one-voxel halo, in list indexes.

    ``vol_zyx`` (nz + 2, ny + 2, nx + 2) holds the supervoxels of the chunk and of a halo on its
    faces (0 outside the volume; edges and corners unused), or with ``indexed`` 1 + their list
    indexes (a reader's palette swap does it per block). ``own``: the chunk's id list (sorted,
    unique, non-zero, complete); ``neighbours``: the lists of the face neighbours -x, +x, -y, +y,
    -z, +z (empty: none). ``where`` is named in errors.
    """
    vol = np.asarray(vol_zyx)
    if vol.dtype != np.uint64 or vol.ndim != 3 or min(vol.shape) < 3:
        raise PcgError(f"{where}: need a (z, y, x) uint64 volume with a 1-voxel halo, got "
                       f"{vol.shape} {vol.dtype}")
    vol = np.ascontiguousarray(vol)
    own = _sorted_ids(own, f"{where}: id list")
    if len(neighbours) != 6:
        raise PcgError(f"{where}: need 6 neighbour id lists, got {len(neighbours)}")
    lists = [_sorted_ids(n, f"{where}: neighbour {tuple(DIRECTIONS[d])} id list") for d, n in enumerate(neighbours)]
    sizes = np.array([len(own)] + [len(v) for v in lists], np.int64)
    no, mx = max(int(sizes[0]), 1), max(int(sizes[1:].max()), 1)
    if no * no + 6 * no * mx >= 1 << 62:
        raise PcgError(f"{where}: id lists of {sizes[0]} and {mx} ids are too long")
    if not indexed:
        offs = np.zeros(8, np.int64)
        offs[1:] = np.cumsum(sizes)
        vals = np.concatenate([own, *lists]) if offs[-1] else np.zeros(1, np.uint64)
        tbits = np.array([max(4, (2 * max(int(n), 1) - 1).bit_length()) for n in sizes], np.int64)
        toff = np.zeros(8, np.int64)
        toff[1:] = np.cumsum(1 << tbits)
        tk = np.zeros(int(toff[-1]), np.uint64)
        tv = np.zeros(int(toff[-1]), np.int64)
        _build_tables(vals, offs, tk, tv, toff, tbits)
        ivol = np.zeros_like(vol)
        err, z, y, x = _relabel(vol, tk, tv, toff, tbits, ivol)
        if err:
            _id_error(where, err, int(vol[z, y, x]), z, y, x)
        vol = ivol
    pbits = 16
    while True:
        counts = np.zeros(len(own), np.int64)
        pk = np.full(1 << pbits, -1, np.int64)
        pv = np.zeros(1 << pbits, np.int64)
        err, z, y, x = _contact_kernel(vol, sizes, mx, counts, pk, pv, pbits)
        if err != 3:
            break
        pbits += 3  # rare: many more touching pairs than the first table holds
    if err:
        _id_error(where, err, int(vol[z, y, x]), z, y, x, indexed=True)
    used = pk >= 0
    keys, area = pk[used], pv[used]
    order = np.argsort(keys)
    keys, area = keys[order], area[order]
    inn = keys < no * no
    k, in_area = keys[inn], area[inn]
    in_pairs = np.stack([k // no, k % no], axis=1)
    fk, farea = keys[~inn] - no * no, area[~inn]
    fd, rest = fk // (no * mx), fk % (no * mx)
    return Contacts(counts, in_pairs.reshape(-1, 2), in_area, fd,
                    np.stack([rest // mx, rest % mx], axis=1).reshape(-1, 2), farea)


def _id_error(where: str, err: Any, v: Any, z: Any, y: Any, x: Any, indexed: Any = False) -> None:
    what = "the chunk's" if err == 1 else "its neighbour chunk's"
    pos = f"(x={x - 1}, y={y - 1}, z={z - 1}) relative to the chunk"
    if indexed:
        raise PcgError(f"{where}: index {v} at {pos} is past the end of {what} id list")
    raise PcgError(f"{where}: supervoxel {v} at {pos} is not in {what} block supervoxel lists (the "
                   f"export's voxels and records disagree)")


def chunk_graph(c: Contacts, coords: Any, own: Any, neighbours: Any, layout: IdLayout, affinity: str = "area") -> Any:
    """PCG edges and pieces of a chunk at ``coords`` from its `Contacts` and the id lists given to
    `contacts`: ``({"in" | "between" | "cross": (node_ids1, node_ids2, affinities, areas)}`` each
    sorted by ids, ``(ids, supervoxels, voxels)`` of its pieces, ``(ids, supervoxels)`` of the
    neighbours' pieces in its edges). ``affinity`` ``"area"`` (face count as float32) or
    ``"default"`` (PCG's, float32 tiny) for in and between edges; cross edges get +inf, area 1."""
    if affinity not in ("area", "default"):
        raise PcgError(f"affinity must be 'area' or 'default', got {affinity!r}")
    own = np.asarray(own, np.uint64)
    coords = tuple(int(v) for v in coords)
    present = np.flatnonzero(c.voxels)
    ids = layout.node_ids(coords, present + 1) if present.size else np.zeros(0, np.uint64)
    base = np.uint64(layout.chunk_id(*coords))

    def aff(area: Any) -> Any:
        if affinity == "area":
            return area.astype(np.float32)
        return np.full(area.shape, DEFAULT_AFFINITY, np.float32)

    n1 = base | (c.in_pairs[:, 0] + 1).astype(np.uint64)
    n2 = base | (c.in_pairs[:, 1] + 1).astype(np.uint64)
    edges = {"in": (n1, n2, aff(c.in_area), c.in_area.astype(np.uint64))}

    p1: list[np.ndarray] = []
    p2: list[np.ndarray] = []
    psv: list[np.ndarray] = []
    for d in range(6):
        sel = c.face_dir == d
        if not sel.any():
            continue
        nc = tuple(int(v) for v in np.add(coords, DIRECTIONS[d]))
        lst = np.asarray(neighbours[d], np.uint64)
        a, b = c.face_pairs[sel, 0], c.face_pairs[sel, 1]
        p1.append(base | (a + 1).astype(np.uint64))
        p2.append(layout.node_ids(nc, b + 1))
        psv.append(np.stack([own[a], lst[b]], axis=1))
    f1 = np.concatenate(p1) if p1 else np.zeros(0, np.uint64)
    f2 = np.concatenate(p2) if p2 else np.zeros(0, np.uint64)
    fsv = np.concatenate(psv) if psv else np.zeros((0, 2), np.uint64)
    farea = c.face_area.astype(np.uint64)
    order = np.lexsort((f2, f1))
    f1, f2, fsv, farea = f1[order], f2[order], fsv[order], farea[order]
    same = fsv[:, 0] == fsv[:, 1]
    diff = ~same
    edges["between"] = (f1[diff], f2[diff], aff(farea[diff]), farea[diff])
    ns = int(same.sum())
    edges["cross"] = (f1[same], f2[same], np.full(ns, np.inf, np.float32), np.ones(ns, np.uint64))
    nb_ids, first = np.unique(f2, return_index=True)
    pieces = (ids, own[present], c.voxels[present].astype(np.uint64))
    return edges, pieces, (nb_ids, fsv[first, 1])


def group_components(ids: Any, bodies: Any) -> list[np.ndarray]:
    """Pieces grouped by body: one sorted uint64 array per body, bodies ascending."""
    ids = np.asarray(ids, np.uint64).ravel()
    bodies = np.asarray(bodies, np.uint64).ravel()
    if ids.shape != bodies.shape:
        raise PcgError(f"{ids.size} pieces but {bodies.size} bodies")
    order = np.lexsort((ids, bodies))
    ids, bodies = ids[order], bodies[order]
    cut = np.flatnonzero(bodies[1:] != bodies[:-1]) + 1
    return [g for g in np.split(ids, cut) if g.size]


def message_classes() -> Any:
    """``(ChunkEdgesMsg, EdgesMsg, ChunkComponentsMsg)``, protobuf's generated classes (PCG's messages
    in a package of ours, so they never clash with PCG's own modules)."""
    try:
        from .proto import chunkComponents_pb2, chunkEdges_pb2
    except ImportError:
        raise PcgError("writing PCG files needs protobuf >= 4.21: pip install 'dvidshards[pcg]'") from None
    return chunkEdges_pb2.ChunkEdgesMsg, chunkEdges_pb2.EdgesMsg, chunkComponents_pb2.ChunkComponentsMsg  # type: ignore[attr-defined]


_FIELDS = {"in": "in_chunk", "between": "between_chunk", "cross": "cross_chunk"}
_DTYPES = ("<u8", "<u8", "<f4", "<u8")


def encode_edges(edges: dict[str, Any]) -> bytes:
    """A ChunkEdgesMsg of ``{"in"|"between"|"cross": (ids1, ids2, affinities, areas)}``, every
    sub-message present as PCG's ``put_chunk_edges`` writes them (empty: ``0a 00 12 00 1a 00``)."""
    chunk_cls, _, _ = message_classes()
    msg = chunk_cls()
    for name, field in _FIELDS.items():
        arrays = edges.get(name)
        sub = getattr(msg, field)
        sub.SetInParent()
        if arrays is None:
            continue
        cols = [np.ascontiguousarray(a, dtype=t).ravel() for a, t in zip(arrays, _DTYPES, strict=True)]
        if len({c.size for c in cols}) != 1:
            raise PcgError(f"{name} edges: arrays of different lengths {[c.size for c in cols]}")
        sub.node_ids1, sub.node_ids2, sub.affinities, sub.areas = (c.tobytes() for c in cols)
    return bytes(msg.SerializeToString())


def decode_edges(data: bytes, where: str = "edges") -> dict[str, Any]:
    """``{type: (ids1, ids2, affinities, areas)}`` of a decompressed ChunkEdgesMsg."""
    chunk_cls, _, _ = message_classes()
    msg = chunk_cls()
    try:
        msg.ParseFromString(bytes(data))
    except Exception as e:  # noqa: BLE001 - google.protobuf.message.DecodeError and friends
        raise PcgError(f"{where}: not a ChunkEdgesMsg ({e})") from None
    out = {}
    for name, field in _FIELDS.items():
        sub = getattr(msg, field)
        raw = (sub.node_ids1, sub.node_ids2, sub.affinities, sub.areas)
        sizes = [len(r) for r in raw]
        if any(s % (4 if t == "<f4" else 8) for s, t in zip(sizes, _DTYPES, strict=True)):
            raise PcgError(f"{where}: {name} arrays are not whole numbers of items ({sizes} bytes)")
        cols = tuple(np.frombuffer(r, dtype=t).astype(t[1:]) for r, t in zip(raw, _DTYPES, strict=True))
        if len({c.size for c in cols}) != 1:
            raise PcgError(f"{where}: {name} arrays have different lengths {[c.size for c in cols]}")
        out[name] = cols
    return out


def encode_components(groups: Any) -> bytes:
    """A ChunkComponentsMsg of groups of ids."""
    _, _, comp_cls = message_classes()
    parts = []
    for g in groups:
        g = np.asarray(g, np.uint64).ravel()
        parts += [np.array([g.size], np.uint64), g]
    msg = comp_cls()
    if parts:
        msg.components.extend(np.concatenate(parts).tolist())
    return bytes(msg.SerializeToString())


def decode_components(data: bytes, where: str = "components") -> list[np.ndarray]:
    """The groups (uint64 arrays, in file order) of a ChunkComponentsMsg."""
    _, _, comp_cls = message_classes()
    msg = comp_cls()
    try:
        msg.ParseFromString(bytes(data))
    except Exception as e:  # noqa: BLE001 - reported, never raised past here
        raise PcgError(f"{where}: not a ChunkComponentsMsg ({e})") from None
    flat = np.fromiter(msg.components, np.uint64, len(msg.components))
    groups: list[np.ndarray] = []
    i = 0
    while i < flat.size:
        n = int(flat[i])
        if n > flat.size - i - 1:
            raise PcgError(f"{where}: component {len(groups)} claims {n} ids, {flat.size - i - 1} remain")
        groups.append(flat[i + 1:i + 1 + n])
        i += 1 + n
    return groups
