"""Skeletons of bodies: TEASAR (kimimaro) on overlapping blocks, joined into one tree per piece.

Conventions (all vectors x, y, z):

* A :class:`Skeleton` holds vertices in **nm** (neuroglancer's model space: voxel ``i`` of a scale
  spans ``[i, i + 1) x resolution``, so a vertex on voxel ``i`` of the skeleton scale lies at
  ``(i + 0.5) x resolution``), edges ``(M, 2)`` and radii in nm (kimimaro's distance to the body's
  boundary). One connected tree per connected piece of the body: no cycle, no repeated vertex.
* **SWC** (:meth:`Skeleton.swc`) is written as FlyEM writes it (neuclease's ``skeletonize_neuron``,
  the ``<body>_swc`` keys of a DVID keyvalue instance that neuroglancer's ``dvid`` source and NeuTu
  read): ``x y z`` in **scale-0 voxel** units (``nm / voxel_size``, the centre of a scale-k voxel
  ``c`` is ``(c + 0.5) * 2**k``) and the radius in **nm**; ``units="nm"`` writes nm throughout.
  Node ids from 1 in breadth-first order from each tree's root (its widest vertex), parent ``-1``
  for a root, type 0.
* **Precomputed** (:meth:`Skeleton.encode_precomputed`): neuroglancer's skeleton encoding, vertices
  in nm, one ``radius`` float32 vertex attribute (:data:`PRECOMPUTED_INFO`, identity transform).

How a body is skeletonized (:func:`skeletonize_block`, :func:`join_pieces`): the scale is cut into
blocks (``BLOCK`` chunks a side); each block is read with **one voxel of its + neighbours** (as
igneous' skeleton forge) and every body in it skeletonized by kimimaro with ``fix_borders``, which
puts a vertex at a fixed point of each piece of the body on each face of the cutout, computed from
that face plane alone: the block on the other side of the face computes the same plane and so the
same vertex. Pieces wholly inside a block of at most ``dust`` voxels are dropped there (they are
whole pieces of the body, as kimimaro's own ``dust_threshold`` keeps only larger ones); a piece touching the cutout's
border is kept whatever its size, since it may continue next door. The join welds the pieces'
vertices by voxel (a seam's shared vertices become one), links vertices on 26-adjacent voxels of
different pieces (they lie in one connected piece of the body), optionally heals gaps up to a
distance (``heal_nm``, kimimaro's ``join_close_components``), and keeps the minimum spanning tree:
one tree per connected piece. TEASAR's invalidation ball (``scale`` radii + ``const``) stops at a
block's face, so a body cut by one may keep a branch kimimaro on the whole body would not grow:
at 256³ blocks the total cable is 1-3 % over kimimaro's, at 64³ blocks of 1-2 voxel neurites 9 %.

**The scale** (:func:`skeleton_scale`): the finest whose voxel is at least ``TARGET_NM`` (32 nm: s2 of
mCNS, FlyEM's ``SparseSkeletons`` scale), as the ``skeletons`` job and ``Body.skeleton`` choose it.

kimimaro and cc3d are optional (``pip install 'dvidshards[skeleton]'``) and imported on use
(:func:`need_kimimaro`: `SkeletonDependencyError` without them).
"""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

from ..errors import DvidShardsError

__all__ = ["BLOCK", "DUST", "PRECOMPUTED_INFO", "TARGET_NM", "TEASAR", "Piece", "Skeleton", "SkeletonDependencyError",
           "SkeletonError", "closed_faces", "join_pieces", "need_kimimaro", "skeleton_scale", "skeletonize_block",
           "skeletonize_chunks"]

BLOCK = 4  # chunks a side of a skeletonized block (256 voxels of 64³ chunks: ~0.6 GiB in kimimaro)
TEASAR = {"scale": 4.0, "const": 500.0}  # kimimaro's README and igneous' defaults (nm)
TARGET_NM = 32.0  # the skeleton scale's voxel, at least (FlyEM's SparseSkeletons: s2 of mCNS)
DUST = 1000  # voxels: smaller pieces (and bodies) get no skeleton, as kimimaro's dust_threshold
#: the ``info`` of a precomputed skeleton directory (``sharding`` added when sharded)
PRECOMPUTED_INFO: dict[str, Any] = {"@type": "neuroglancer_skeletons", "transform": [1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0],
                    "vertex_attributes": [{"id": "radius", "data_type": "float32", "num_components": 1}],
                    "spatial_index": None}
_HALF = np.array([d for d in itertools.product((-1, 0, 1), repeat=3) if d > (0, 0, 0)], np.int64)  # 13 of 26


class SkeletonError(DvidShardsError, ValueError):
    """Skeleton arrays or bytes that do not describe a skeleton."""


class SkeletonDependencyError(DvidShardsError, ImportError):
    """Skeletonizing needs kimimaro, which is not installed; the message names the extra to install."""


def skeleton_scale(resolutions: Iterable[tuple[int, Sequence[float]]]) -> int:
    """Of ``(scale, nm per voxel)`` pairs, finest first, the finest whose voxel is at least
    :data:`TARGET_NM` on every axis, else the coarsest."""
    pairs = list(resolutions)
    if not pairs:
        raise SkeletonError("no scale to skeletonize")
    return next((k for k, res in pairs if min(res) >= TARGET_NM - 1e-6), pairs[-1][0])


@dataclass(frozen=True, eq=False)
class Skeleton:
    """A body's skeleton: a forest, one tree per connected piece.

    Attributes
    ----------
    vertices : (N, 3) float32
        nm (see the module docstring).
    edges : (M, 2) uint32
        Vertex index pairs, ``M = N - trees``.
    radii : (N,) float32
        nm.
    voxel_size : (3,) float or None
        nm per scale-0 voxel: the unit of :meth:`swc`'s coordinates (None: nm).
    """

    vertices: np.ndarray
    edges: np.ndarray
    radii: np.ndarray
    voxel_size: Sequence[float] | None = field(default=None)  # made a tuple of floats

    def __post_init__(self) -> None:
        v = np.ascontiguousarray(self.vertices, np.float32).reshape(-1, 3)
        e = np.ascontiguousarray(self.edges).reshape(-1, 2)
        r = np.ascontiguousarray(self.radii, np.float32).reshape(-1)
        if len(r) != len(v) or (len(e) and (e.min() < 0 or e.max() >= len(v))) or not np.isfinite(v).all():
            raise SkeletonError(f"skeleton of {len(v)} vertices with {len(r)} radii and edges beyond them "
                                f"(or non-finite vertices)")
        object.__setattr__(self, "vertices", v)
        object.__setattr__(self, "edges", e.astype(np.uint32))
        object.__setattr__(self, "radii", r)
        if self.voxel_size is not None:
            object.__setattr__(self, "voxel_size", tuple(float(x) for x in self.voxel_size))

    def __repr__(self) -> str:
        return f"Skeleton({len(self.vertices)} vertices, {self.trees} trees, {self.cable_length:,.0f} nm)"

    @property
    def cable_length(self) -> float:
        """Summed edge length, nm."""
        d = self.vertices[self.edges[:, 0]] - self.vertices[self.edges[:, 1]]
        return float(np.sqrt((d.astype(np.float64) ** 2).sum(axis=1)).sum())

    @property
    def trees(self) -> int:
        """Connected components (one per piece of the body)."""
        return int(self._bfs()[2].max(initial=-1)) + 1

    def components(self) -> np.ndarray:
        """The tree (0 .. trees - 1) of every vertex."""
        return self._bfs()[2]

    # --- SWC -------------------------------------------------------------------------------------

    def swc(self, *, units: str = "voxels", header: Iterable[str] = ()) -> str:
        """SWC text: ``id type x y z radius parent``, parents before children; numbers in fixed point
        with 6 decimals (as kimimaro's ``to_swc`` writes them: no exponent, whatever the coordinate).

        Parameters
        ----------
        units : {"voxels", "nm"}
            ``x y z`` in scale-0 voxels (FlyEM's ``<body>_swc``, needs ``voxel_size``) or nm. The
            radius is in nm either way (as neuclease writes it).
        header : iterable of str
            Comment lines (``#`` added where missing).
        """
        scale = _unit(units, self.voxel_size)
        n = len(self.vertices)
        order, parent, _ = self._bfs()
        rank = np.empty(n, np.int64)
        rank[order] = np.arange(1, n + 1)
        par = np.where(parent[order] < 0, -1, rank[np.maximum(parent[order], 0)])
        xyz = self.vertices[order].astype(np.float64) / scale
        lines = [h if h.startswith("#") else "# " + h for h in header]
        lines += [f"{i} 0 {x:.6f} {y:.6f} {z:.6f} {r:.6f} {p}" for i, (x, y, z), r, p in
                  zip(range(1, n + 1), xyz.tolist(), self.radii[order].tolist(), par.tolist(), strict=True)]
        return "\n".join(lines) + "\n"

    @classmethod
    def from_swc(cls, text: str | bytes, *, voxel_size: Sequence[float] | None = None, units: str = "voxels"
                 ) -> Skeleton:
        """Parse SWC text (comment lines skipped; ``units`` as :meth:`swc` wrote them).

        Raises
        ------
        SkeletonError
            A line that is not 7 numbers, a repeated id, a parent that is no node.
        """
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        rows = [ln.split() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
        try:
            a = np.array(rows, np.float64).reshape(-1, 7)
        except ValueError:
            raise SkeletonError("SWC: every node line must hold 7 numbers (id type x y z radius parent)") from None
        ids, parents = a[:, 0].astype(np.int64), a[:, 6].astype(np.int64)
        order = np.argsort(ids)
        if len(ids) and (np.diff(ids[order]) == 0).any():
            raise SkeletonError("SWC: a node id is repeated")
        has = parents >= 0
        at = np.searchsorted(ids[order], parents[has])
        if (at >= len(ids)).any() or (ids[order][np.minimum(at, len(ids) - 1)] != parents[has]).any():
            raise SkeletonError("SWC: a parent id names no node")
        edges = np.stack([np.flatnonzero(has), order[at]], axis=1) if len(ids) else np.zeros((0, 2), np.int64)
        return cls(a[:, 2:5] * _unit(units, voxel_size), edges, a[:, 5], voxel_size)

    def _bfs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(vertex order, parent or -1, tree): breadth first from each tree's widest vertex (numpy and
        Python only: a server answering SWC needs no scipy)."""
        n = len(self.vertices)
        e = self.edges.astype(np.int64)
        src, dst = np.r_[e[:, 0], e[:, 1]], np.r_[e[:, 1], e[:, 0]]
        by = np.argsort(src, kind="stable")
        nbr, start = dst[by].tolist(), np.searchsorted(src[by], np.arange(n + 1)).tolist()
        parent, tree, order, k = [-1] * n, [-1] * n, [], 0
        for r in np.argsort(-self.radii, kind="stable").tolist():  # each tree's widest vertex comes first
            if tree[r] >= 0:
                continue
            tree[r], queue = k, [r]
            for v in queue:  # grows while it is walked
                for w in nbr[start[v]:start[v + 1]]:
                    if tree[w] < 0:
                        tree[w], parent[w] = k, v
                        queue.append(w)
            order.extend(queue)
            k += 1
        return np.asarray(order, np.int64), np.asarray(parent, np.int64), np.asarray(tree, np.int64)

    # --- neuroglancer precomputed --------------------------------------------------------------------

    def encode_precomputed(self) -> bytes:
        """neuroglancer's precomputed skeleton bytes (vertices in nm, then the ``radius`` attribute)."""
        head = np.array([len(self.vertices), len(self.edges)], "<u4")
        return b"".join([head.tobytes(), self.vertices.astype("<f4").tobytes(), self.edges.astype("<u4").tobytes(),
                         self.radii.astype("<f4").tobytes()])

    @classmethod
    def decode_precomputed(cls, data: bytes | bytearray | memoryview, *,
                           vertex_attributes: Sequence[dict[str, Any]] | None = None,
                           voxel_size: Sequence[float] | None = None) -> Skeleton:
        """Parse precomputed skeleton bytes; ``vertex_attributes`` as the directory's ``info`` lists them
        (default: ``radius`` only). Radii are 0 when there is no ``radius`` attribute.

        Raises
        ------
        SkeletonError
            Sizes that do not add up.
        """
        buf = bytes(data)
        attrs = PRECOMPUTED_INFO["vertex_attributes"] if vertex_attributes is None else vertex_attributes
        if len(buf) < 8:
            raise SkeletonError(f"precomputed skeleton of {len(buf)} bytes: shorter than its header")
        nv, ne = (int(x) for x in np.frombuffer(buf, "<u4", 2))
        sizes = [np.dtype(a["data_type"]).itemsize * int(a.get("num_components", 1)) for a in attrs]
        if len(buf) != 8 + 12 * nv + 8 * ne + nv * sum(sizes):
            raise SkeletonError(f"precomputed skeleton of {len(buf)} bytes does not hold {nv} vertices, {ne} edges "
                                f"and attributes {[a['id'] for a in attrs]}")
        v = np.frombuffer(buf, "<f4", 3 * nv, 8).reshape(nv, 3)
        e = np.frombuffer(buf, "<u4", 2 * ne, 8 + 12 * nv).reshape(ne, 2)
        radii, off = np.zeros(nv, np.float32), 8 + 12 * nv + 8 * ne
        for a, size in zip(attrs, sizes, strict=True):
            if a["id"] == "radius":
                radii = np.frombuffer(buf, np.dtype(a["data_type"]).newbyteorder("<"), nv, off).astype(np.float32)
            off += nv * size
        return cls(v, e, radii, voxel_size)


def _unit(units: str, voxel_size: Sequence[float] | None) -> np.ndarray:
    """nm per SWC coordinate unit."""
    if units == "nm":
        return np.ones(3)
    if units != "voxels":
        raise SkeletonError(f"units must be 'voxels' or 'nm', got {units!r}")
    if voxel_size is None:
        raise SkeletonError("SWC in voxels needs the scale-0 voxel size (voxel_size=); or units='nm'")
    return np.asarray(voxel_size, np.float64).reshape(3)


def _graph(n: int, edges: np.ndarray, weights: np.ndarray | None = None) -> Any:
    from scipy.sparse import coo_matrix

    w = np.ones(len(edges)) if weights is None else weights
    return coo_matrix((w, (edges[:, 0], edges[:, 1])), shape=(n, n)).tocsr()


def _components(n: int, edges: np.ndarray) -> tuple[int, np.ndarray]:
    from scipy.sparse.csgraph import connected_components

    k, comp = connected_components(_graph(n, edges), directed=False)
    return int(k), np.asarray(comp)


# --------------------------------------------------------------------------- one block


@dataclass(frozen=True)
class Piece:
    """One body's part of one block: vertices as voxel indices of the skeleton scale (int32),
    edges between them, radii (nm), and the body's voxels in the block's own chunks."""

    voxels: np.ndarray
    edges: np.ndarray
    radii: np.ndarray
    count: int


def need_kimimaro() -> ModuleType:
    """The kimimaro module, or `SkeletonDependencyError` saying how to install it."""
    try:
        return importlib.import_module("kimimaro")
    except ImportError as e:
        raise SkeletonDependencyError(f"skeletons need kimimaro, which is not installed: pip install "
                                      f"'dvidshards[skeleton]' ({e})") from None


def _drop_small_inner(labels: np.ndarray, dust: int) -> None:
    """Zero (in place) the 26-connected pieces of at most ``dust`` voxels that touch no face of the cutout."""
    import cc3d

    cc = cc3d.connected_components(labels, connectivity=26)
    st = cc3d.statistics(cc)
    for i in np.flatnonzero(np.asarray(st["voxel_counts"]) <= dust).tolist():
        box = st["bounding_boxes"][i]
        if i and box is not None and all(0 < b.start and b.stop < n for b, n in zip(box, labels.shape, strict=True)):
            labels[box][cc[box] == i] = 0


def skeletonize_block(labels: np.ndarray, origin: Any, *, resolution: Any, core: Any = None, closed: Any = None,
                      dust: int = 0, teasar: dict[str, float] | None = None, object_ids: Iterable[int] | None = None
                      ) -> dict[int, Piece]:
    """Skeletonize every body of one block: ``{body: Piece}`` (kimimaro, ``fix_borders``).

    ``labels`` (x, y, z) is the block and one voxel of its + neighbours (less at the volume's end) at
    the skeleton scale, changed in place; ``origin`` the voxel of ``labels[0, 0, 0]``; ``resolution``
    nm per voxel (kimimaro's anisotropy); ``core`` the block's own extent, where ``Piece.count`` is
    counted (default: ``labels``' shape less one a side); ``closed`` (3, 2) bools, the cutout's (low,
    high) faces that are the volume's: a plane of 0 is put there, so that no vertex is forced onto them;
    ``dust``: pieces of at most that many voxels touching no face of the cutout are dropped;
    ``teasar``: kimimaro's ``teasar_params`` (default :data:`TEASAR`); ``object_ids``: only these bodies.
    """
    kimimaro = need_kimimaro()
    import fastremap

    lab = np.asfortranarray(labels)
    if object_ids is not None:
        lab = fastremap.mask_except(lab, [int(b) for b in object_ids], in_place=True)
    core = np.maximum(np.asarray(lab.shape) - 1, 1) if core is None else np.asarray(core, np.int64)
    o = np.asarray(origin, np.int64)
    pad = np.zeros((3, 2), np.int64) if closed is None else np.asarray(closed, bool).astype(np.int64)
    if pad.any():
        lab, o, core = np.asfortranarray(np.pad(lab, pad)), o - pad[:, 0], core + pad[:, 0]
    renumbered, ids_of = fastremap.renumber(lab[:core[0], :core[1], :core[2]], in_place=False)  # faster than unique
    n_of = np.bincount(renumbered.ravel(order="K"))
    counts = {int(b): int(n_of[int(k)]) for b, k in ids_of.items() if b}
    del renumbered
    if dust > 0:
        _drop_small_inner(lab, int(dust))
    res = np.asarray(resolution, np.float32)
    skels = kimimaro.skeletonize(lab, teasar_params=dict(TEASAR if teasar is None else teasar), anisotropy=res,
                                 dust_threshold=0, fix_borders=True, fix_branching=True, progress=False,
                                 parallel=1, in_place=True)
    out = {}
    empty = Piece(np.zeros((0, 3), np.int32), np.zeros((0, 2), np.uint32), np.zeros(0, np.float32), 0)
    for b in set(skels) | set(counts):
        s = skels.get(b)
        n = counts.get(int(b), 0)
        if s is None or not len(s.vertices):
            out[int(b)] = Piece(empty.voxels, empty.edges, empty.radii, n)
            continue
        v = (np.rint(s.vertices / res) + o).astype(np.int32)
        out[int(b)] = Piece(v, s.edges.astype(np.uint32), s.radii.astype(np.float32), n)
    return out


# --------------------------------------------------------------------------- the join


def _keys(v: np.ndarray, lo: np.ndarray, ext: np.ndarray) -> np.ndarray:
    w = v.astype(np.int64) - lo
    return np.asarray((w[:, 0] * ext[1] + w[:, 1]) * ext[2] + w[:, 2])


def join_pieces(pieces: Iterable[Piece], *, resolution: Any, voxel_size: Sequence[float] | None = None,
                heal_nm: float | None = None) -> Skeleton:
    """One body's pieces (from every block) joined into one tree per connected piece.

    Vertices on the same voxel become one (the larger radius kept); vertices on 26-adjacent voxels
    in different trees are linked; with ``heal_nm``, trees closer than that are joined
    (kimimaro's ``join_close_components``); cycles are cut by keeping the minimum spanning tree.
    """
    from scipy.sparse.csgraph import minimum_spanning_tree

    ps = [p for p in pieces if len(p.voxels)]
    res = np.asarray(resolution, np.float64)
    if not ps:
        return Skeleton(np.zeros((0, 3)), np.zeros((0, 2), np.uint32), np.zeros(0), voxel_size)
    vox = np.concatenate([p.voxels for p in ps]).astype(np.int64)
    starts = np.cumsum([0] + [len(p.voxels) for p in ps[:-1]])
    edges = np.concatenate([p.edges.astype(np.int64) + s for p, s in zip(ps, starts, strict=True)])
    radii = np.concatenate([p.radii for p in ps])
    lo, ext = vox.min(axis=0) - 1, vox.max(axis=0) - vox.min(axis=0) + 3
    keys, first, inv = np.unique(_keys(vox, lo, ext), return_index=True, return_inverse=True)
    inv = inv.reshape(-1)
    vox, n = vox[first], len(keys)
    r = np.zeros(n, np.float32)
    np.maximum.at(r, inv, radii)
    e = np.sort(inv[edges], axis=1)
    links = [e[e[:, 0] != e[:, 1]]]
    comp = _components(n, links[0])[1]
    for d in _HALF:  # 26-adjacent voxels of different trees: one piece of the body
        at = np.minimum(np.searchsorted(keys, _keys(vox + d, lo, ext)), n - 1)
        hit = np.flatnonzero(keys[at] == _keys(vox + d, lo, ext))
        hit = hit[comp[hit] != comp[at[hit]]]
        links.append(np.sort(np.stack([hit, at[hit]], axis=1), axis=1))
    e = np.unique(np.concatenate(links), axis=0)
    nm = ((vox + 0.5) * res).astype(np.float32)
    if heal_nm and _components(n, e)[0] > 1:
        e = _heal(nm, e, r, float(heal_nm))
    w = np.sqrt(((nm[e[:, 0]] - nm[e[:, 1]]).astype(np.float64) ** 2).sum(axis=1))
    t = minimum_spanning_tree(_graph(n, e, w)).tocoo()
    return Skeleton(nm, np.stack([t.row, t.col], axis=1), r, voxel_size)


def _heal(nm: np.ndarray, edges: np.ndarray, radii: np.ndarray, heal_nm: float) -> np.ndarray:
    """Edges plus kimimaro's bridges between trees closer than ``heal_nm``."""
    kimimaro = need_kimimaro()
    from osteoid import Skeleton as Osteoid

    k, comp = _components(len(nm), edges)
    parts = []
    for c in range(k):
        idx = np.flatnonzero(comp == c)
        local = np.searchsorted(idx, edges[comp[edges[:, 0]] == c])
        parts.append(Osteoid(nm[idx], local.astype(np.uint32), radii[idx], segid=c, space="physical"))
    joined = kimimaro.join_close_components(parts, radius=heal_nm)
    at = {v: i for i, v in enumerate(map(tuple, nm.tolist()))}  # vertices are distinct voxels
    je = np.asarray([at[tuple(v)] for v in joined.vertices.tolist()], np.int64)[joined.edges.astype(np.int64)]
    return np.unique(np.concatenate([edges, np.sort(je, axis=1)]), axis=0)


# --------------------------------------------------------------------------- one body on demand


def closed_faces(lo: Any, side: int, vlo: Any, vhi: Any) -> np.ndarray:
    """(3, 2) bools: the faces of the cutout of the block at ``lo`` (``side`` voxels and one of its +
    neighbours) that are the volume's [vlo, vhi): its low face where no block lies below, its high
    face where the volume ends before the overlap voxel."""
    lo = np.asarray(lo, np.int64)
    return np.stack([lo <= np.asarray(vlo), lo + side + 1 > np.asarray(vhi)], axis=1)


def skeletonize_chunks(chunks: Any, mask_of: Callable[[tuple[int, ...]], np.ndarray | None], *, chunk_size: Any,
                       resolution: Any, bounds: Any = None, voxel_size: Sequence[float] | None = None,
                       block: int = BLOCK, dust: int = 0, teasar: dict[str, float] | None = None,
                       heal_nm: float | None = None) -> Skeleton:
    """One body's skeleton from its chunks at the skeleton scale, block by block (memory: one block).

    ``mask_of(chunk (x, y, z))`` gives the body's (z, y, x) bool mask there, or None; chunks are cubic
    of ``chunk_size``; ``resolution`` is nm per voxel of the scale; ``bounds`` the volume's voxels [lo,
    hi), where blocks are cut as the job cuts them; ``voxel_size`` nm per scale-0 voxel (for
    :meth:`Skeleton.swc`); ``block``, ``dust``, ``teasar``, ``heal_nm`` as :func:`skeletonize_block` and
    :func:`join_pieces` take them.
    """
    c = np.asarray(chunks, np.int64).reshape(-1, 3)
    sides = {int(v) for v in np.atleast_1d(chunk_size)}
    if len(sides) != 1:
        raise SkeletonError(f"skeletons need cubic chunks, got {list(np.atleast_1d(chunk_size))}")
    cs, b = sides.pop(), int(block)
    holds = set(map(tuple, c.tolist()))  # the lists say the body is nowhere else: nothing else decoded
    pieces = []
    vlo, vhi = (np.full(3, -(1 << 40)), np.full(3, 1 << 40)) if bounds is None else np.asarray(bounds, np.int64)
    for blk in np.unique(c // b, axis=0) if len(c) else c:
        lo, hi = np.maximum(blk * b * cs, vlo), np.minimum((blk + 1) * b * cs + 1, vhi)
        cut = np.zeros(hi - lo, np.uint8, order="F")
        for d in itertools.product(range(b + 1), repeat=3):
            at = tuple(int(v) for v in blk * b + d)
            m = mask_of(at) if at in holds else None
            if m is not None:  # the chunk's part inside the cutout
                o = np.asarray(at) * cs - lo
                a, z = np.maximum(o, 0), np.minimum(o + cs, hi - lo)
                if (z > a).all():
                    cut[a[0]:z[0], a[1]:z[1], a[2]:z[2]] = np.asarray(m).T[a[0] - o[0]:z[0] - o[0],
                                                                         a[1] - o[1]:z[1] - o[1], a[2] - o[2]:z[2] - o[2]]
        got = skeletonize_block(cut, lo, resolution=resolution, core=np.minimum((blk + 1) * b * cs, vhi) - lo,
                                closed=closed_faces(blk * b * cs, b * cs, vlo, vhi), dust=dust, teasar=teasar).get(1)
        if got is not None:
            pieces.append(got)
    return join_pieces(pieces, resolution=resolution, voxel_size=voxel_size, heal_nm=heal_nm)

