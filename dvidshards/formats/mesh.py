"""Meshing primitives on numpy label arrays: marching cubes per cell, welding, file formats.

Vertices are in voxel corner coordinates of the scale (voxel ``i`` spans ``[i, i + 1)``, as in
neuroglancer; `to_nm` scales them). zmesh's marching cubes runs on voxel centres, so the cell of
chunk ``c`` meshes the cubes between centres ``c * chunk .. (c + 1) * chunk``: its cutout is the
chunk plus one voxel on the + sides (igneous' ``high_padding=1``), neighbouring cells produce
identical vertices on their shared plane, and `merge_fragments` welds them into a closed
surface. zmesh's quadric simplifier never moves a vertex on an open boundary, so fragments
simplified apart still meet (``simplify_fqmr(preserve_border=True)`` does not keep them:
unused). What the meshes job does to a body's surface afterwards is `formats.meshreduce`. zmesh
is optional, imported on use.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np

from ..errors import DvidShardsError
from . import jit

__all__ = [
    "Mesh",
    "MeshError",
    "box_faces",
    "mesh_block",
    "mesh_cells",
    "on_box",
    "merge_fragments",
    "volume_area",
    "to_nm",
    "to_obj",
    "to_ply",
]

_INSTALL = "pip install 'dvidshards[mesh]'"


class MeshError(DvidShardsError, ValueError):
    """A mesh or meshing argument is malformed (shapes, indices, block geometry)."""


def _zmesh() -> Any:
    try:
        import zmesh
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(f"meshing needs the optional package zmesh: {_INSTALL}") from e
    return zmesh


@dataclass(frozen=True, eq=False)
class Mesh:
    """A triangle mesh: ``vertices`` float32 (n, 3), ``faces`` uint32 (m, 3) indices into them."""

    vertices: np.ndarray
    faces: np.ndarray

    def __post_init__(self) -> None:
        v = np.ascontiguousarray(np.asarray(self.vertices, np.float32).reshape(-1, 3))
        f = np.asarray(self.faces)
        if f.size and not np.issubdtype(f.dtype, np.integer):
            raise MeshError(f"faces must be integers, got {f.dtype}")
        f = np.ascontiguousarray(f.reshape(-1, 3))
        if f.size and (f.min() < 0 or f.max() >= len(v)):
            raise MeshError(f"face index out of range for {len(v)} vertices")
        object.__setattr__(self, "vertices", v)
        object.__setattr__(self, "faces", f.astype(np.uint32, copy=False))

    @classmethod
    def empty(cls) -> Mesh:
        """A mesh with no vertices and no faces."""
        return cls(np.zeros((0, 3), np.float32), np.zeros((0, 3), np.uint32))

    def __len__(self) -> int:
        return len(self.faces)


def to_nm(mesh: Mesh, resolution: Any, voxel_offset: Any = (0, 0, 0)) -> Mesh:
    """Vertices in nanometres: ``(vertex + voxel_offset) * resolution`` (nm per voxel)."""
    res = np.asarray(resolution, np.float64).reshape(-1)
    if res.shape != (3,) or not np.all(res > 0):
        raise MeshError(f"resolution must be 3 positive numbers, got {resolution!r}")
    v = (mesh.vertices.astype(np.float64) + np.asarray(voxel_offset, np.float64)) * res
    return Mesh(v.astype(np.float32), mesh.faces)


def _triple(v: Any, what: str) -> tuple[int, int, int]:
    if isinstance(v, (int, np.integer)):
        v = (v,) * 3
    t = tuple(int(x) for x in v)
    if len(t) != 3 or any(int(x) != x for x in v):
        raise MeshError(f"{what} must be 3 integers, got {v!r}")
    return t[0], t[1], t[2]


def mesh_block(
    block: Any,
    origin: Any = (0, 0, 0),
    labels: Sequence[int] | None = None,
    *,
    reduction_factor: int = 0,
    max_error: float = 8,
) -> dict[int, Mesh]:
    """Marching cubes of the labels of a block (zmesh): ``{label: Mesh}`` in corner coordinates.

    ``block`` holds unsigned labels ``[x, y, z]`` (0: background) whose first voxel is at
    ``origin``; it covers the cubes between the voxel centres it holds (for seamless cells, its
    chunk and one voxel on the + sides). ``labels``: those to return (default every one present).
    ``reduction_factor`` > 0 simplifies with zmesh (faces / factor, within ``max_error`` at voxel
    resolution 1): vertices on the block's faces never move, and one put outside the label's voxel
    box or the cubes' box is clipped back, so fragments stay inside their cells. MeshError unless
    the block is 3-d unsigned with 2 voxels a side; ImportError without zmesh.
    """
    zmesh = _zmesh()
    b = np.asarray(block)
    if b.ndim != 3 or b.dtype.kind not in "ui":
        raise MeshError(f"block must be a 3-d integer array, got {b.dtype} {b.shape}")
    if min(b.shape) < 2:
        raise MeshError(f"block {b.shape} has no cube between voxel centres")
    if b.dtype.kind == "i":
        if b.size and b.min() < 0:
            raise MeshError("labels must be non-negative")
        b = b.astype(np.uint64)
    if not (b.flags.c_contiguous or b.flags.f_contiguous):
        b = np.ascontiguousarray(b)
    if int(reduction_factor) < 0 or max_error < 0:
        raise MeshError("reduction_factor and max_error must be >= 0")
    off = np.asarray(_triple(origin, "origin"), np.float64)
    mesher = zmesh.Mesher((1, 1, 1))
    mesher.mesh(b)
    contacts = None if reduction_factor else _corner_contacts(b)
    present = {int(v) for v in mesher.ids()}
    wanted = sorted(present) if labels is None else [int(v) for v in labels if int(v) in present]
    out: dict[int, Mesh] = {}
    for label in wanted:
        if label == 0:
            continue
        m = mesher.get(label, normals=False, reduction_factor=int(reduction_factor),
                       max_error=float(max_error), voxel_centered=True)
        mesher.erase(label)
        if len(m.faces):
            v = m.vertices.astype(np.float64)
            faces = m.faces
            if reduction_factor:  # the quadric optimum may leave the label's box (and the cell): put it back
                lo, hi = _label_box(b, label)
                cube = np.asarray(b.shape, np.float64) - 0.5
                v = np.clip(v, np.maximum(lo, 0.5), np.minimum(hi + 1, cube))  # its voxel box, in its cell
            elif contacts is not None and label in contacts:
                faces = _bridge(v, faces, contacts[label])
            out[label] = Mesh((v + off).astype(np.float32), faces)
    return out


_DIAGONALS = np.array([[0, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1]], np.int64)  # a cube's 4 diagonals, from these


@numba.njit(nogil=True, cache=True)
def _corner_contacts_kernel(b, out):  # type: ignore[no-untyped-def]  # pragma: no cover - numba
    """Rows (i, j, k, diagonal, label) of the cubes of C-ordered ``b`` in which one label holds
    exactly two opposite corners (diagonal 0 from the low corner, 1-3 from one step along axis
    0-2); returns their count (rows past ``out`` are counted, not written)."""
    ni, nj, nk = b.shape
    n = 0
    for i in range(ni - 1):
        for j in range(nj - 1):
            for k in range(nk - 1):
                c000 = b[i, j, k]
                c001 = b[i, j, k + 1]
                c010 = b[i, j + 1, k]
                c011 = b[i, j + 1, k + 1]
                c100 = b[i + 1, j, k]
                c101 = b[i + 1, j, k + 1]
                c110 = b[i + 1, j + 1, k]
                c111 = b[i + 1, j + 1, k + 1]
                for d in range(4):
                    if d == 0:
                        lab, far = c000, c111
                    elif d == 1:
                        lab, far = c100, c011
                    elif d == 2:
                        lab, far = c010, c101
                    else:
                        lab, far = c001, c110
                    if lab == 0 or far != lab:
                        continue
                    same = ((c000 == lab) + (c001 == lab) + (c010 == lab) + (c011 == lab) + (c100 == lab)
                            + (c101 == lab) + (c110 == lab) + (c111 == lab))
                    if same != 2:
                        continue
                    if n < out.shape[0]:
                        out[n, 0], out[n, 1], out[n, 2], out[n, 3], out[n, 4] = i, j, k, d, lab
                    n += 1
    return n


_contacts = jit.kernel(_corner_contacts_kernel, [numba.int64(numba.uint64[:, :, ::1], numba.uint64[:, ::1])], None)


def _corner_contacts(b: np.ndarray) -> dict[int, np.ndarray] | None:
    """``{label: (n, 4) rows (x, y, z, diagonal)}`` of the cubes of an (x, y, z) block where the
    label's voxels meet only at a corner; None when there are none."""
    flip = not b.flags.c_contiguous and b.flags.f_contiguous  # mesh_cells' blocks: (z, y, x) in memory
    a = b.T if flip else b
    a = np.ascontiguousarray(a, dtype=np.uint64)
    out = np.zeros((64, 5), np.uint64)
    n = _contacts(a, out)
    if n > len(out):
        out = np.zeros((n, 5), np.uint64)
        n = _contacts(a, out)
    if not n:
        return None
    rows = out[:n].astype(np.int64)
    if flip:  # (z, y, x) back to (x, y, z); a diagonal from one step along z is one from x and back
        rows[:, :3] = rows[:, 2::-1]
        rows[:, 3] = np.array([0, 3, 2, 1])[rows[:, 3]]
    labs = out[:n, 4]
    return {int(lab): rows[labs == lab, :4] for lab in np.unique(labs).tolist()}


def _bridge(v: np.ndarray, faces: np.ndarray, contacts: np.ndarray) -> np.ndarray:
    """Join a label's voxels that meet only at a corner: the two caps marching cubes made in each
    such cube become a three-sided tube wound as they were (zmesh leaves them apart), so the
    surface stays closed, oriented and one piece. ``v`` is voxel-centred; a cube whose caps are
    not found as expected is left alone."""
    key = np.round(np.asarray(v, np.float64) * 2).astype(np.int64)  # half voxels: exact
    vk = (key[:, 0] << 42) | (key[:, 1] << 21) | key[:, 2]
    order = np.argsort(vk)
    fs = np.sort(faces.astype(np.int64), axis=1)
    fk = (fs[:, 0] << 42) | (fs[:, 1] << 21) | fs[:, 2] if len(v) < (1 << 21) else None
    if fk is None:
        return faces
    forder = np.argsort(fk)
    keep = np.ones(len(faces), bool)
    new = []

    def vertex(p: Any) -> int:
        k = (int(p[0]) << 42) | (int(p[1]) << 21) | int(p[2])
        i = int(np.searchsorted(vk, k, sorter=order))
        return int(order[i]) if i < len(vk) and vk[order[i]] == k else -1

    def face(tri: Any) -> int:
        t = sorted(tri)
        k = (t[0] << 42) | (t[1] << 21) | t[2]
        i = int(np.searchsorted(fk, k, sorter=forder))
        return int(forder[i]) if i < len(fk) and fk[forder[i]] == k else -1

    for x, y, z, d in contacts.tolist():
        c0 = np.array([x, y, z]) + _DIAGONALS[d]
        c1 = 2 * np.array([x, y, z]) + 1 - c0
        s = c1 - c0  # +-1 per axis, from corner A towards B; in half voxels a centre is 2 i + 1
        ca, cb = 2 * c0 + 1, 2 * c1 + 1
        ua = [vertex(ca + s * np.eye(3, dtype=np.int64)[ax]) for ax in range(3)]
        ub = [vertex(cb - s * np.eye(3, dtype=np.int64)[ax]) for ax in range(3)]
        if min(ua) < 0 or min(ub) < 0:
            continue
        fa, fb = face(ua), face(ub)
        if fa < 0 or fb < 0 or not (keep[fa] and keep[fb]):
            continue
        wa = [int(i) for i in faces[fa]]
        wb = [int(i) for i in faces[fb]]
        partner = dict(zip(ua, ub, strict=True))
        edges_b = {(wb[i], wb[(i + 1) % 3]) for i in range(3)}
        tube: list[tuple[int, int, int]] = []
        for i in range(3):
            p, q = wa[i], wa[(i + 1) % 3]  # the cap's edge p -> q; its neighbour outside runs q -> p
            pp, qq = partner[p], partner[q]
            if (qq, pp) not in edges_b:  # cap B must run pp -> qq to be closed by this tube
                tube = []
                break
            tube += [(p, q, qq), (p, qq, pp)]
        if tube:
            keep[fa] = keep[fb] = False
            new += tube
    if not new:
        return faces
    return np.concatenate([faces[keep], np.asarray(new, faces.dtype)])


def _label_box(b: np.ndarray, label: int) -> tuple[np.ndarray, np.ndarray]:
    m = b == np.uint64(label)
    lo, hi = np.zeros(3), np.asarray(b.shape, np.float64) - 1  # absent: the whole block
    for ax in range(3):
        nz = np.flatnonzero(m.any(axis=tuple(a for a in range(3) if a != ax)))
        if nz.size:
            lo[ax], hi[ax] = nz[0], nz[-1]
    return lo, hi


def _faces(arr: np.ndarray | None) -> Any:
    """The low faces of a (z, y, x) chunk: x = 0 (z, y), y = 0 (z, x), z = 0 (y, x)."""
    if arr is None or not arr.any():
        return None
    return arr[:, :, 0].copy(), arr[:, 0, :].copy(), arr[0, :, :].copy()


def _label_counts(arr: np.ndarray) -> dict[int, int]:
    """``{label: voxels}`` of the non-zero labels, counted over runs (a third of ``np.unique``'s
    sort on a 64³ chunk of a few dozen labels)."""
    f = arr.reshape(-1)
    if not f.size:
        return {}
    start = np.empty(f.size, bool)
    start[0] = True
    np.not_equal(f[1:], f[:-1], out=start[1:])
    at = np.flatnonzero(start)
    lab, inv = np.unique(f[at], return_inverse=True)
    num = np.bincount(inv.reshape(-1), weights=np.diff(at, append=f.size), minlength=len(lab))
    return {int(a): int(b) for a, b in zip(lab.tolist(), num.tolist(), strict=True) if a}


def mesh_cells(
    decode: Callable[[tuple[int, int, int]], np.ndarray | None],
    chunks: Any,
    chunk: int = 64,
    *,
    labels: Sequence[int] | None = None,
    reduction_factor: int = 0,
    max_error: float = 8,
    voxels: bool = False,
) -> Iterator[tuple[Any, ...]]:
    """Mesh the cells of ``chunks`` (x, y, z), each chunk decoded once, neighbours' faces borrowed.

    The cell of chunk ``c`` meshes the cubes between the voxel centres ``c * chunk .. (c + 1) *
    chunk``, so a body's fragments weld into one watertight surface (`merge_fragments`). Cells go in
    descending (z, y, x) order, keeping the low faces of two planes of chunks at most. ``decode``
    gives a chunk's (z, y, x) unsigned labels or None (background, outside the volume), once per
    chunk and + neighbour. Yields ``(x, y, z), {label: Mesh}`` in absolute corner coordinates for
    cells with a surface; with ``voxels`` also each label's voxel count in the chunk itself (and
    chunks with labels but no surface). ``labels``, ``reduction_factor``, ``max_error``: as
    `mesh_block`.
    """
    n = int(chunk)
    if n < 2:
        raise MeshError(f"chunk must be at least 2 voxels, got {chunk!r}")
    c = np.asarray(chunks, np.int64).reshape(-1, 3)
    if not len(c):
        return
    c = np.unique(c, axis=0)
    c = c[np.lexsort((c[:, 0], c[:, 1], c[:, 2]))[::-1]]  # descending z, then y, then x
    faces: dict[tuple[int, int, int], tuple[Any, ...] | None] = {}
    zcur = None

    def borrowed(key: Any) -> Any:
        if key not in faces:
            faces[key] = _faces(_checked(decode(key), key))
        return faces[key]

    def _checked(arr: Any, key: Any) -> Any:
        if arr is None:
            return None
        a = np.asarray(arr)
        if a.shape != (n, n, n) or a.dtype.kind not in "ub":
            raise MeshError(f"decode({key}) gave {a.dtype} {a.shape}, expected unsigned ({n}, {n}, {n})")
        return a

    for x, y, z in c.tolist():
        if z != zcur:  # a new plane: faces of chunks two planes up are no longer needed
            zcur = z
            for k in [k for k in faces if k[2] > z + 1]:
                del faces[k]
        key = (x, y, z)
        own = _checked(decode(key), key)
        faces[key] = _faces(own)
        fx = borrowed((x + 1, y, z))
        fy = borrowed((x, y + 1, z))
        fz = borrowed((x, y, z + 1))
        exy = borrowed((x + 1, y + 1, z))
        exz = borrowed((x + 1, y, z + 1))
        eyz = borrowed((x, y + 1, z + 1))
        cor = borrowed((x + 1, y + 1, z + 1))
        counts: dict[int, int] = {}
        if voxels and own is not None:
            counts = _label_counts(own)
        if own is None and all(f is None for f in (fx, fy, fz, exy, exz, eyz, cor)):
            continue
        dtype = own.dtype if own is not None else next(f[0].dtype for f in (fx, fy, fz, exy, exz, eyz, cor)
                                                         if f is not None)
        block = np.zeros((n + 1,) * 3, dtype)  # (z, y, x)
        if own is not None:
            block[:n, :n, :n] = own
        if fx is not None:
            block[:n, :n, n] = fx[0]
        if fy is not None:
            block[:n, n, :n] = fy[1]
        if fz is not None:
            block[n, :n, :n] = fz[2]
        if exy is not None:
            block[:n, n, n] = exy[0][:, 0]
        if exz is not None:
            block[n, :n, n] = exz[0][0, :]
        if eyz is not None:
            block[n, n, :n] = eyz[1][0, :]
        if cor is not None:
            block[n, n, n] = cor[0][0, 0]
        if not block.any():
            continue
        if block.dtype == bool:
            block = block.view(np.uint8)
        out = mesh_block(block.T, (x * n, y * n, z * n), labels, reduction_factor=reduction_factor,
                         max_error=max_error)
        if voxels:
            if out or counts:
                yield key, out, counts
        elif out:
            yield key, out


def to_ply(mesh: Mesh) -> bytes:
    """Binary little-endian PLY bytes of a mesh (float32 x, y, z; uint32 triangle indices)."""
    head = (f"ply\nformat binary_little_endian 1.0\ncomment dvidshards\nelement vertex {len(mesh.vertices)}\n"
            "property float x\nproperty float y\nproperty float z\n"
            f"element face {len(mesh.faces)}\nproperty list uchar uint vertex_indices\nend_header\n")
    f = np.zeros(len(mesh.faces), np.dtype([("n", "u1"), ("v", "<u4", (3,))]))
    f["n"] = 3
    f["v"] = mesh.faces
    return head.encode() + mesh.vertices.astype("<f4").tobytes() + f.tobytes()


def to_obj(mesh: Mesh) -> bytes:
    """Wavefront OBJ text of a mesh (``v x y z`` lines, then 1-based ``f a b c`` lines)."""
    v = "".join(f"v {a:.9g} {b:.9g} {c:.9g}\n" for a, b, c in mesh.vertices.tolist())
    f = "".join(f"f {a + 1} {b + 1} {c + 1}\n" for a, b, c in mesh.faces.tolist())
    return ("# dvidshards\n" + v + f).encode()


def merge_fragments(fragments: Iterable[Mesh]) -> Mesh:
    """One mesh from fragments of one body, vertices at identical positions welded (cells share
    their plane's vertices exactly, so this closes the seams); degenerate faces are dropped."""
    frs = [f for f in fragments if len(f.faces)]
    if not frs:
        return Mesh.empty()
    v = np.concatenate([f.vertices for f in frs])
    starts = np.cumsum([0] + [len(f.vertices) for f in frs[:-1]], dtype=np.int64)
    faces = np.concatenate([f.faces.astype(np.int64) + s for f, s in zip(frs, starts, strict=True)])
    key = np.ascontiguousarray(v).view(np.dtype((np.void, 12))).reshape(-1)
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    # vertices in order of first appearance: independent of float sort order
    order = np.argsort(first, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    faces = rank[inverse.reshape(-1)][faces]
    ok = (faces[:, 0] != faces[:, 1]) & (faces[:, 1] != faces[:, 2]) & (faces[:, 0] != faces[:, 2])
    return Mesh(v[first[order]], faces[ok])


def box_faces(vertices: Any, lo: Any, hi: Any) -> np.ndarray:
    """uint8 bits of the faces of the box ``[lo, hi]`` each vertex lies on exactly (bit 2 ax: the
    low face of axis ax, 2 ax + 1 the high): `decimate`'s ``locked``."""
    v = np.asarray(vertices)
    lo = np.asarray(lo, v.dtype).reshape(3)
    hi = np.asarray(hi, v.dtype).reshape(3)
    out = np.zeros(len(v), np.uint8)
    for ax in range(3):
        out |= (v[:, ax] == lo[ax]).astype(np.uint8) << np.uint8(2 * ax)
        out |= (v[:, ax] == hi[ax]).astype(np.uint8) << np.uint8(2 * ax + 1)
    return out


def on_box(vertices: Any, lo: Any, hi: Any) -> np.ndarray:
    """Vertices lying on a face of the box ``[lo, hi]`` (exactly: cell and node boundaries)."""
    v = np.asarray(vertices)
    lo = np.asarray(lo, v.dtype).reshape(1, 3)
    hi = np.asarray(hi, v.dtype).reshape(1, 3)
    return np.asarray(((v == lo) | (v == hi)).any(axis=1))


@numba.njit(nogil=True, cache=True)
def _volume_area_kernel(V, F):  # type: ignore[no-untyped-def]  # pragma: no cover - numba
    vol = 0.0
    area = 0.0
    for f in range(F.shape[0]):
        a, b, c = F[f, 0], F[f, 1], F[f, 2]
        ax, ay, az = V[a, 0], V[a, 1], V[a, 2]
        bx, by, bz = V[b, 0], V[b, 1], V[b, 2]
        cx, cy, cz = V[c, 0], V[c, 1], V[c, 2]
        vol += ax * (by * cz - bz * cy) + ay * (bz * cx - bx * cz) + az * (bx * cy - by * cx)
        ux, uy, uz = bx - ax, by - ay, bz - az
        wx, wy, wz = cx - ax, cy - ay, cz - az
        nx, ny, nz = uy * wz - uz * wy, uz * wx - ux * wz, ux * wy - uy * wx
        area += np.sqrt(nx * nx + ny * ny + nz * nz)
    return vol / 6.0, area / 2.0


_SIG_VA = numba.types.UniTuple(numba.float64, 2)(numba.float64[:, ::1], numba.int64[:, ::1])  # type: ignore[no-untyped-call]
_volume_area = jit.kernel(_volume_area_kernel, [_SIG_VA], None)


def volume_area(mesh: Mesh) -> tuple[float, float]:
    """(signed volume about the origin, area) of a mesh, in the vertices' units; the volume is
    additive over the pieces of a closed surface."""
    if not len(mesh.faces):
        return 0.0, 0.0
    vol, area = _volume_area(mesh.vertices.astype(np.float64), mesh.faces.astype(np.int64))
    return float(vol), float(area)
