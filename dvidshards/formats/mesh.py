"""Meshing primitives on numpy label arrays: marching cubes per cell, welding, simplification.

Geometry conventions (all vectors x, y, z):

* Vertices are in *voxel corner* coordinates of the scale: voxel ``i`` spans ``[i, i + 1)``
  (neuroglancer's convention; nm = coordinate x resolution, see `to_nm`).
* zmesh's marching cubes runs on voxel centres, so a block meshes the cubes between the
  centres it holds and its surface lies half a voxel inside the block. Meshing cells are
  therefore the cubes between centres ``c .. c + cell`` (corner box ``[c + 0.5, c + cell +
  0.5]``): a cell's cutout is its chunk plus **one voxel of overlap on the + sides** (as
  igneous' ``MeshTask``, ``high_padding=1``), and neighbouring cells meet exactly on the
  shared plane through voxel centres, where both produce the same vertices from the same
  voxels. `MeshGrid` lays the cells over a volume, with one extra cell on the low side and
  zero padding outside the volume so bodies touching the volume's faces come out closed.
* `merge_fragments` welds the fragments of one body (identical positions become one vertex):
  a body meshed cell by cell and merged is watertight (`is_watertight`).
* `simplify` and `mesh_block`'s reduction use zmesh's quadric simplifier (Zlateski's
  ``zi::mesh::simplifier``), which never moves a vertex on an open boundary: cell fragments
  simplified on their own still meet their neighbours exactly. (``zmesh.simplify_fqmr`` with
  ``preserve_border=True`` does *not* keep them; it is not used.)

zmesh is optional (``pip install 'dvidshards[mesh]'``) and imported on use.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numba
import numpy as np

from ..errors import DvidShardsError
from . import jit

__all__ = [
    "LATTICE",
    "Mesh",
    "MeshError",
    "MeshGrid",
    "box_faces",
    "cut_padded",
    "decimate",
    "drop_cavities",
    "enclosed_volume",
    "inflate",
    "is_watertight",
    "mesh_block",
    "mesh_cells",
    "on_box",
    "merge_fragments",
    "volume_area",
    "weld_pieces",
    "simplify",
    "split_by_plane",
    "surface_area",
    "to_nm",
    "to_obj",
    "to_ply",
]

#: vertices handed to the simplifier are snapped to 1/LATTICE voxel (zmesh packs coordinates)
LATTICE = 16
_INSTALL = "pip install 'dvidshards[mesh]'"


class MeshError(DvidShardsError, ValueError):
    """A mesh or meshing argument is malformed (shapes, indices, block geometry)."""


def _zmesh():
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

    def translated(self, offset) -> Mesh:
        """A copy with ``offset`` (3 numbers) added to every vertex."""
        return Mesh(self.vertices + np.asarray(offset, np.float32), self.faces)


def to_nm(mesh: Mesh, resolution, voxel_offset=(0, 0, 0)) -> Mesh:
    """Vertices in nanometres: ``(vertex + voxel_offset) * resolution``.

    Parameters
    ----------
    mesh : Mesh
        Vertices in voxel corner coordinates of the scale.
    resolution : sequence of 3 float
        nm per voxel of the scale.
    voxel_offset : sequence of 3 number, optional
        Added first, for meshes built relative to a block.

    Returns
    -------
    Mesh
    """
    res = np.asarray(resolution, np.float64).reshape(-1)
    if res.shape != (3,) or not np.all(res > 0):
        raise MeshError(f"resolution must be 3 positive numbers, got {resolution!r}")
    v = (mesh.vertices.astype(np.float64) + np.asarray(voxel_offset, np.float64)) * res
    return Mesh(v.astype(np.float32), mesh.faces)


# --------------------------------------------------------------------------------------
# cells over a volume
# --------------------------------------------------------------------------------------


def _triple(v, what: str) -> tuple[int, int, int]:
    if isinstance(v, (int, np.integer)):
        v = (v,) * 3
    t = tuple(int(x) for x in v)
    if len(t) != 3 or any(int(x) != x for x in v):
        raise MeshError(f"{what} must be 3 integers, got {v!r}")
    return t  # type: ignore[return-value]


@dataclass(frozen=True)
class MeshGrid:
    """Meshing cells over a volume ``[offset, offset + size)`` (voxels of one scale).

    Cell ``(i, j, k)`` meshes the cubes between voxel centres ``c .. c + cell`` with
    ``c = offset - cell + cell * index``; its corner box is ``[origin + cell * index,
    origin + cell * (index + 1)]`` with ``origin = offset + 0.5 - cell``. Cell ``1 + n`` holds
    chunk ``n`` of the volume's chunk grid (plus its + side overlap); cells with a 0 index
    hold only the thin layer between the zero padding and the volume's low faces. Fragments
    of one cell stay inside its box, so these cells can be the finest octree nodes of a
    multi-resolution mesh (`dvidshards.formats.multilod`).

    Parameters
    ----------
    offset : sequence of 3 int
        Voxel offset of the volume.
    size : sequence of 3 int
        Volume size in voxels.
    cell : int or sequence of 3 int, optional
        Cell edge in voxels (the chunk size, 64).
    """

    offset: tuple[int, int, int]
    size: tuple[int, int, int]
    cell: tuple[int, int, int] = (64, 64, 64)

    def __post_init__(self) -> None:
        object.__setattr__(self, "offset", _triple(self.offset, "offset"))
        object.__setattr__(self, "size", _triple(self.size, "size"))
        object.__setattr__(self, "cell", _triple(self.cell, "cell"))
        if min(self.size) < 1 or min(self.cell) < 1:
            raise MeshError(f"size {self.size} and cell {self.cell} must be positive")

    @property
    def origin(self) -> tuple[float, float, float]:
        """Corner coordinate of cell (0, 0, 0): ``offset + 0.5 - cell``."""
        return tuple(o + 0.5 - c for o, c in zip(self.offset, self.cell, strict=True))  # type: ignore[return-value]

    @property
    def shape(self) -> tuple[int, int, int]:
        """Cells per axis: the volume's chunk count plus one."""
        return tuple(-(-s // c) + 1 for s, c in zip(self.size, self.cell, strict=True))  # type: ignore[return-value]

    def cell_of_chunk(self, chunk) -> tuple[int, int, int]:
        """Cell index holding chunk ``chunk`` of the volume's chunk grid (``chunk + 1``)."""
        return tuple(int(v) + 1 for v in _triple(chunk, "chunk"))  # type: ignore[return-value]

    def box(self, index) -> tuple[np.ndarray, np.ndarray]:
        """Corner-coordinate box ``(lo, hi)`` (float64) of a cell."""
        i = np.asarray(_triple(index, "cell index"), np.float64)
        c = np.asarray(self.cell, np.float64)
        lo = np.asarray(self.origin) + c * i
        return lo, lo + c

    def cutout(self, index) -> tuple[np.ndarray, np.ndarray] | None:
        """Voxel box ``[lo, hi)`` to mesh for a cell, or None when the cell has no cube.

        The box may reach one voxel outside the volume on either side; those voxels are
        background (`cut_padded` fills them with 0).
        """
        i = np.asarray(_triple(index, "cell index"), np.int64)
        if (i < 0).any() or (i >= np.asarray(self.shape)).any():
            raise MeshError(f"cell {tuple(i.tolist())} is outside the grid {self.shape}")
        c, off, size = (np.asarray(v, np.int64) for v in (self.cell, self.offset, self.size))
        first = off - c + c * i  # first centre of the cell
        lo = np.maximum(first, off - 1)
        hi = np.minimum(first + c, off + size) + 1
        if (hi - lo < 2).any():
            return None
        return lo, hi

    def cells(self) -> Iterable[tuple[int, int, int]]:
        """Every cell index with a cutout, x fastest."""
        for k in range(self.shape[2]):
            for j in range(self.shape[1]):
                for i in range(self.shape[0]):
                    if self.cutout((i, j, k)) is not None:
                        yield (i, j, k)


def cut_padded(volume, volume_offset, lo, hi) -> np.ndarray:
    """The box ``[lo, hi)`` of an in-memory volume ``[x, y, z]``, zero outside it.

    Parameters
    ----------
    volume : numpy.ndarray, shape (nx, ny, nz)
    volume_offset : sequence of 3 int
        Voxel coordinate of ``volume[0, 0, 0]``.
    lo, hi : sequence of 3 int

    Returns
    -------
    numpy.ndarray of the volume's dtype, shape ``hi - lo``
    """
    vol = np.asarray(volume)
    if vol.ndim != 3:
        raise MeshError(f"volume must be 3-d, got shape {vol.shape}")
    off = np.asarray(_triple(volume_offset, "volume offset"), np.int64)
    lo_, hi_ = (np.asarray(_triple(v, "box corner"), np.int64) for v in (lo, hi))
    if (hi_ < lo_).any():
        raise MeshError(f"bad box {lo_.tolist()}..{hi_.tolist()}")
    out = np.zeros(tuple(hi_ - lo_), vol.dtype)
    a = np.maximum(lo_, off)
    b = np.minimum(hi_, off + np.asarray(vol.shape))
    if (b > a).all():
        src = tuple(slice(int(x - o), int(y - o)) for x, y, o in zip(a, b, off, strict=True))
        dst = tuple(slice(int(x - s), int(y - s)) for x, y, s in zip(a, b, lo_, strict=True))
        out[dst] = vol[src]
    return out


# --------------------------------------------------------------------------------------
# marching cubes
# --------------------------------------------------------------------------------------


def mesh_block(
    block,
    origin=(0, 0, 0),
    labels: Sequence[int] | None = None,
    *,
    reduction_factor: int = 0,
    max_error: float = 8,
) -> dict[int, Mesh]:
    """Marching cubes of the labels of a block (zmesh), vertices in corner coordinates.

    The block covers the cubes between the voxel centres it holds: for seamless cells cut it
    out with `MeshGrid.cutout` (one voxel of overlap on the + sides). Each label gets its
    own surface (a body split into supervoxels must be relabelled to body ids first).

    Parameters
    ----------
    block : numpy.ndarray of unsigned int, shape (nx, ny, nz)
        Labels indexed ``[x, y, z]``; 0 is background.
    origin : sequence of 3 int, optional
        Voxel coordinate of ``block[0, 0, 0]``.
    labels : sequence of int, optional
        Labels to return (default: every non-zero label present).
    reduction_factor : int, optional
        zmesh simplification target (faces / factor); 0 keeps the marching-cubes mesh.
        Vertices on the block's faces are never moved; a vertex the simplifier puts outside the
        label's voxel box or the cubes' box (``[0.5, shape - 0.5]``) is clipped back onto them,
        so a simplified body stays inside its voxel box and its fragments inside their cells.
    max_error : float, optional
        zmesh's error bound for that simplification (its ``Mesher.get(max_error=)`` at voxel
        resolution 1).

    Returns
    -------
    dict of int to Mesh
        One mesh per label with faces; labels absent from the block are left out.

    Raises
    ------
    MeshError
        If the block is not 3-d unsigned integers with at least 2 voxels a side.
    ImportError
        If zmesh is not installed.
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
def _corner_contacts_kernel(b, out):  # pragma: no cover - numba
    """Cubes (i, j, k: their low voxel, axes as ``b``'s) of a C-ordered ``b`` in which one label holds
    exactly two opposite corners: rows (i, j, k, diagonal, label) into ``out`` (diagonal 0: from the
    cube's low corner, 1, 2, 3: from the corner one step along axis 0, 1, 2); returns how many there
    are (rows past ``out``'s length are counted, not written)."""
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
    """{label: (n, 4) rows (x, y, z, diagonal)} of the cubes of an (x, y, z) block where the label's
    voxels meet only at a corner (diagonal: 0 from the cube's low corner, 1, 2, 3 from the corner one
    step along x, y, z); None when there are none."""
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
    """Join a label's voxels that meet only at a corner: in each such cube, the two corner caps
    marching cubes made (one triangle each, facing each other) become a three-sided tube between them,
    wound as the caps were, so the surface stays closed and oriented and the two pieces are one.

    ``v`` are the label's vertices in voxel-centred coordinates of the block (voxel i at i + 0.5).
    A cube whose caps are not found as expected is left as it is.
    """
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

    def vertex(p) -> int:
        k = (int(p[0]) << 42) | (int(p[1]) << 21) | int(p[2])
        i = int(np.searchsorted(vk, k, sorter=order))
        return int(order[i]) if i < len(vk) and vk[order[i]] == k else -1

    def face(tri) -> int:
        t = sorted(tri)
        k = (t[0] << 42) | (t[1] << 21) | t[2]
        i = int(np.searchsorted(fk, k, sorter=forder))
        return int(forder[i]) if i < len(fk) and fk[forder[i]] == k else -1

    for x, y, z, d in contacts.tolist():
        c0 = np.array([x, y, z]) + _DIAGONALS[d]
        c1 = 2 * np.array([x, y, z]) + 1 - c0
        s = c1 - c0  # +-1 per axis: from corner A towards corner B
        # in half voxels, voxel i's centre is 2 i + 1; a cap vertex sits half way along a cube edge
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
    """(first, last) voxel index per axis of ``label`` in ``b``."""
    m = b == np.uint64(label)
    lo, hi = np.zeros(3), np.asarray(b.shape, np.float64) - 1  # absent: the whole block
    for ax in range(3):
        nz = np.flatnonzero(m.any(axis=tuple(a for a in range(3) if a != ax)))
        if nz.size:
            lo[ax], hi[ax] = nz[0], nz[-1]
    return lo, hi


def _faces(arr: np.ndarray | None):
    """The three low faces of a decoded (z, y, x) chunk: x = 0 (z, y), y = 0 (z, x), z = 0 (y, x)."""
    if arr is None or not arr.any():
        return None
    return arr[:, :, 0].copy(), arr[:, 0, :].copy(), arr[0, :, :].copy()


def _label_counts(arr: np.ndarray) -> dict[int, int]:
    """{label: voxels} of the non-zero labels of an array, counted over its runs (a third of
    ``np.unique``'s sort on a 64³ chunk of a few dozen labels)."""
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
    chunks,
    chunk: int = 64,
    *,
    labels: Sequence[int] | None = None,
    reduction_factor: int = 0,
    max_error: float = 8,
    voxels: bool = False,
) -> Iterator:
    """Mesh the cells of some chunks, each chunk decoded once, neighbours' faces borrowed.

    The cell of chunk ``c`` meshes the cubes between the voxel centres ``c * chunk .. (c + 1) *
    chunk`` (its cutout is the chunk plus one voxel on the + sides, corner box ``[c * chunk +
    0.5, (c + 1) * chunk + 0.5]``): the cell `MeshGrid` numbers ``c + 1`` on a grid whose
    offset is a multiple of ``chunk``. Neighbouring cells meet exactly, so the fragments of a
    body weld into one watertight surface (`merge_fragments`). A volume's first cell along an
    axis is that of chunk ``-1`` relative to it (``decode`` returns None outside the volume).

    Cells are visited in descending (z, y, x) order: a cell's + neighbours are decoded before
    it, and only their low faces are kept, for two planes of chunks at most.

    Parameters
    ----------
    decode : callable
        ``chunk (x, y, z) -> (z, y, x)`` array of shape ``(chunk,) * 3`` of unsigned labels,
        or None for an all-background chunk (absent, outside the volume). Called once per
        chunk of ``chunks`` and once per + neighbour outside them.
    chunks : array_like of int, shape (n, 3)
        Chunk coordinates (x, y, z) whose cells to mesh; duplicates are ignored.
    chunk : int, optional
        Chunk edge in voxels.
    labels : sequence of int, optional
        Labels to mesh (default: every non-zero label).
    reduction_factor, max_error :
        Per-cell simplification (see `mesh_block`); vertices on cell faces never move.
    voxels : bool, optional
        Also yield the voxel count of each non-zero label in the chunk itself (not its
        neighbours), and yield chunks that hold labels but no surface too.

    Yields
    ------
    (x, y, z), dict of int to Mesh[, dict of int to int]
        A chunk of ``chunks`` and the meshes of its cell in absolute voxel corner
        coordinates (and, with ``voxels``, its label counts); cells without a surface (or
        label) are skipped.
    """
    n = int(chunk)
    if n < 2:
        raise MeshError(f"chunk must be at least 2 voxels, got {chunk!r}")
    c = np.asarray(chunks, np.int64).reshape(-1, 3)
    if not len(c):
        return
    c = np.unique(c, axis=0)
    c = c[np.lexsort((c[:, 0], c[:, 1], c[:, 2]))[::-1]]  # descending z, then y, then x
    faces: dict[tuple[int, int, int], tuple | None] = {}
    zcur = None

    def borrowed(key):
        if key not in faces:
            faces[key] = _faces(_checked(decode(key), key))
        return faces[key]

    def _checked(arr, key):
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


# --------------------------------------------------------------------------------------
# files
# --------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------
# welding, checks, volume
# --------------------------------------------------------------------------------------


def merge_fragments(fragments: Iterable[Mesh]) -> Mesh:
    """One mesh from fragments of one body, vertices at identical positions welded.

    Fragments made cell by cell share their vertices on the cell planes exactly (same
    float32 values), so welding by exact position closes the seams. Faces that become
    degenerate (two equal corners) are dropped.

    Parameters
    ----------
    fragments : iterable of Mesh

    Returns
    -------
    Mesh
    """
    frs = [f for f in fragments if len(f.faces)]
    if not frs:
        return Mesh.empty()
    v = np.concatenate([f.vertices for f in frs])
    starts = np.cumsum([0] + [len(f.vertices) for f in frs[:-1]], dtype=np.int64)
    faces = np.concatenate([f.faces.astype(np.int64) + s for f, s in zip(frs, starts, strict=True)])
    key = np.ascontiguousarray(v).view(np.dtype((np.void, 12))).reshape(-1)
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    # keep vertices in order of first appearance: deterministic, independent of float sort order
    order = np.argsort(first, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    faces = rank[inverse.reshape(-1)][faces]
    ok = (faces[:, 0] != faces[:, 1]) & (faces[:, 1] != faces[:, 2]) & (faces[:, 0] != faces[:, 2])
    return Mesh(v[first[order]], faces[ok])


def _edge_keys(faces: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    f = np.asarray(faces, np.int64).reshape(-1, 3)
    a = np.concatenate([f[:, 0], f[:, 1], f[:, 2]])
    b = np.concatenate([f[:, 1], f[:, 2], f[:, 0]])
    return a * n + b, np.minimum(a, b) * n + np.maximum(a, b)


def is_watertight(vertices, faces, *, oriented: bool = True) -> bool:
    """Whether a mesh is closed: every edge shared by exactly two faces.

    Parameters
    ----------
    vertices : array_like, shape (n, 3)
    faces : array_like of int, shape (m, 3)
    oriented : bool, optional
        Also require consistent winding (each directed edge used once, its reverse once).

    Returns
    -------
    bool
        False for an empty mesh.
    """
    n = len(np.asarray(vertices).reshape(-1, 3))
    f = np.asarray(faces).reshape(-1, 3)
    if not len(f):
        return False
    if f.min() < 0 or f.max() >= n:
        raise MeshError(f"face index out of range for {n} vertices")
    directed, undirected = _edge_keys(f, n)
    _, counts = np.unique(undirected, return_counts=True)
    if not (counts == 2).all():
        return False
    if oriented:
        _, dcounts = np.unique(directed, return_counts=True)
        return bool((dcounts == 1).all())
    return True


def enclosed_volume(vertices, faces) -> float:
    """Signed volume of a closed mesh: sum of the tetrahedra (origin, a, b, c) / 6.

    Positive for outward (counter-clockwise seen from outside) winding, in the vertices'
    units cubed.
    """
    v = np.asarray(vertices, np.float64).reshape(-1, 3)
    f = np.asarray(faces, np.int64).reshape(-1, 3)
    if not len(f):
        return 0.0
    c = v.mean(axis=0)  # about the centroid: less cancellation far from the origin
    a, b, d = v[f[:, 0]] - c, v[f[:, 1]] - c, v[f[:, 2]] - c
    return float(np.einsum("ij,ij->i", a, np.cross(b, d)).sum() / 6.0)


# --------------------------------------------------------------------------------------
# simplification and cutting
# --------------------------------------------------------------------------------------


def simplify(mesh: Mesh, reduction_factor: int, max_error: float = 8) -> Mesh:
    """zmesh's quadric simplifier; vertices on open boundaries stay where they are.

    Vertices are first snapped to a 1/`LATTICE` voxel lattice (zmesh packs coordinates
    into integers; snapping keeps boundary vertices, which lie on half voxels, exact).

    Parameters
    ----------
    mesh : Mesh
        Vertices in voxel units (any origin); the extent must be under 65536 voxels.
    reduction_factor : int
        Target face count = faces / factor (stops early where ``max_error`` binds).
    max_error : float, optional
        Error bound on the same scale as `mesh_block`'s.

    Returns
    -------
    Mesh

    Raises
    ------
    MeshError
        If the mesh is too large for zmesh's packed coordinates.
    ImportError
        If zmesh is not installed.
    """
    zmesh = _zmesh()
    if int(reduction_factor) < 1 or max_error < 0:
        raise MeshError("reduction_factor must be >= 1 and max_error >= 0")
    if not len(mesh.faces):
        return Mesh.empty()
    v = mesh.vertices.astype(np.float64)
    base = np.floor(v.min(axis=0))
    q = np.round((v - base) * LATTICE)
    if q.max() >= (1 << 20):
        raise MeshError(f"mesh spans {q.max() / LATTICE:.0f} voxels; zmesh packs at most "
                        f"{(1 << 20) // LATTICE}")
    r = 2.0 / LATTICE  # zmesh voxel_res whose half-voxel packing is the lattice
    lattice = zmesh.Mesh((q / LATTICE * 1.0).astype(np.float32), mesh.faces, normals=None)
    norm = math.sqrt(3) * r
    s = zmesh.Mesher((r, r, r)).simplify(
        lattice, reduction_factor=int(reduction_factor), max_error=(float(max_error) + 0.5) * norm)
    out = s.vertices.astype(np.float64) + base
    return Mesh(out.astype(np.float32), s.faces)


def split_by_plane(mesh: Mesh, axis: int, position: float) -> tuple[Mesh, Mesh]:
    """Faces of a mesh on each side of a plane, by face centroid; vertices are copied.

    Meant for meshes that already have no face crossing the plane (cell fragments): faces
    lying on both sides are assigned by their centroid, not cut.

    Returns
    -------
    (Mesh, Mesh)
        Faces with centroid below ``position`` along ``axis``, and the rest.
    """
    if axis not in (0, 1, 2):
        raise MeshError(f"axis must be 0, 1 or 2, got {axis!r}")
    if not len(mesh.faces):
        return Mesh.empty(), Mesh.empty()
    cen = mesh.vertices[mesh.faces, axis].astype(np.float64).mean(axis=1)
    low = cen < position
    return _subset(mesh, low), _subset(mesh, ~low)


def _subset(mesh: Mesh, keep: np.ndarray) -> Mesh:
    faces = mesh.faces[keep]
    if not len(faces):
        return Mesh.empty()
    used, inv = np.unique(faces.reshape(-1), return_inverse=True)
    return Mesh(mesh.vertices[used], inv.reshape(-1, 3))


# --------------------------------------------------------------------------------------
# decimation: quadric edge collapse that keeps the topology and locked vertices
# --------------------------------------------------------------------------------------


@numba.njit(nogil=True, cache=True, inline="always")
def _qe(q0, q1, q2, q3, q4, q5, q6, q7, q8, q9, x, y, z):  # pragma: no cover - numba
    """The quadric (10 numbers: the upper triangle of A, then b, then c) at (x, y, z)."""
    return (x * (q0 * x + 2.0 * (q1 * y + q2 * z + q3)) + y * (q4 * y + 2.0 * (q5 * z + q6))
            + z * (q7 * z + 2.0 * q8) + q9)


@numba.njit(nogil=True, cache=True)
def _edge_target(V, Q, locked, a, b, p):  # pragma: no cover - numba
    """Where edge (a, b) collapses to (into ``p``) and its quadric error; inf when both are locked.

    A locked end stays where it is; otherwise the quadric's optimum, if the 3x3 system is well
    conditioned and the point stays near the edge, else the best of the ends and the midpoint."""
    la = locked[a]
    lb = locked[b]
    if la and lb:
        return np.inf
    q0 = Q[a, 0] + Q[b, 0]
    q1 = Q[a, 1] + Q[b, 1]
    q2 = Q[a, 2] + Q[b, 2]
    q3 = Q[a, 3] + Q[b, 3]
    q4 = Q[a, 4] + Q[b, 4]
    q5 = Q[a, 5] + Q[b, 5]
    q6 = Q[a, 6] + Q[b, 6]
    q7 = Q[a, 7] + Q[b, 7]
    q8 = Q[a, 8] + Q[b, 8]
    q9 = Q[a, 9] + Q[b, 9]
    if la or lb:
        k = a if la else b
        x, y, z = V[k, 0], V[k, 1], V[k, 2]
        p[0], p[1], p[2] = x, y, z
        return _qe(q0, q1, q2, q3, q4, q5, q6, q7, q8, q9, x, y, z)
    c0 = q4 * q7 - q5 * q5
    c1 = q2 * q5 - q1 * q7
    c2 = q1 * q5 - q2 * q4
    det = q0 * c0 + q1 * c1 + q2 * c2
    ax, ay, az = V[a, 0], V[a, 1], V[a, 2]
    ex, ey, ez = V[b, 0] - ax, V[b, 1] - ay, V[b, 2] - az
    if abs(det) > 1e-9:
        inv = 1.0 / det
        x = -(c0 * q3 + c1 * q6 + c2 * q8) * inv
        y = -(c1 * q3 + (q0 * q7 - q2 * q2) * q6 + (q1 * q2 - q0 * q5) * q8) * inv
        z = -(c2 * q3 + (q1 * q2 - q0 * q5) * q6 + (q0 * q4 - q1 * q1) * q8) * inv
        mx = ax + 0.5 * ex - x
        my = ay + 0.5 * ey - y
        mz = az + 0.5 * ez - z
        if mx * mx + my * my + mz * mz <= ex * ex + ey * ey + ez * ez:
            p[0], p[1], p[2] = x, y, z
            return _qe(q0, q1, q2, q3, q4, q5, q6, q7, q8, q9, x, y, z)
    e0 = _qe(q0, q1, q2, q3, q4, q5, q6, q7, q8, q9, ax, ay, az)
    mx, my, mz = ax + 0.5 * ex, ay + 0.5 * ey, az + 0.5 * ez
    e1 = _qe(q0, q1, q2, q3, q4, q5, q6, q7, q8, q9, mx, my, mz)
    e2 = _qe(q0, q1, q2, q3, q4, q5, q6, q7, q8, q9, ax + ex, ay + ey, az + ez)
    if e0 <= e1 and e0 <= e2:
        p[0], p[1], p[2] = ax, ay, az
        return e0
    if e1 <= e2:
        p[0], p[1], p[2] = mx, my, mz
        return e1
    p[0], p[1], p[2] = ax + ex, ay + ey, az + ez
    return e2


@numba.njit(nogil=True, cache=True)
def _refs(F, alive, n, tstart, tcount, rf):  # pragma: no cover - numba
    """Vertex -> live faces lists (CSR in ``rf``); returns the length used."""
    tcount[:] = 0
    m = F.shape[0]
    for f in range(m):
        if alive[f]:
            tcount[F[f, 0]] += 1
            tcount[F[f, 1]] += 1
            tcount[F[f, 2]] += 1
    s = 0
    for v in range(n):
        tstart[v] = s
        s += tcount[v]
        tcount[v] = 0
    for f in range(m):
        if alive[f]:
            for j in range(3):
                v = F[f, j]
                rf[tstart[v] + tcount[v]] = f
                tcount[v] += 1
    return s


@numba.njit(nogil=True, cache=True, inline="always")
def _flip1(V, F, f, v, px, py, pz):  # pragma: no cover - numba
    """Whether moving ``v`` to ``p`` turns face ``f`` by more than ~78 degrees or nearly flattens it."""
    i0, i1, i2 = F[f, 0], F[f, 1], F[f, 2]
    if i0 == v:
        s, t = i1, i2
    elif i1 == v:
        s, t = i2, i0
    else:
        s, t = i0, i1
    sx, sy, sz = V[s, 0], V[s, 1], V[s, 2]
    tx, ty, tz = V[t, 0] - sx, V[t, 1] - sy, V[t, 2] - sz
    ux, uy, uz = V[v, 0] - sx, V[v, 1] - sy, V[v, 2] - sz
    n0x, n0y, n0z = ty * uz - tz * uy, tz * ux - tx * uz, tx * uy - ty * ux
    ux, uy, uz = px - sx, py - sy, pz - sz
    n1x, n1y, n1z = ty * uz - tz * uy, tz * ux - tx * uz, tx * uy - ty * ux
    l0 = n0x * n0x + n0y * n0y + n0z * n0z
    l1 = n1x * n1x + n1y * n1y + n1z * n1z
    if l1 <= 1e-12 * l0 or l1 <= 1e-18:
        return True
    d = n0x * n1x + n0y * n1y + n0z * n1z
    return d <= 0.0 or d * d <= 0.04 * l0 * l1


@numba.njit(nogil=True, cache=True, inline="always")
def _fin(F, alive, tstart, tcount, rf, v, c, d):  # pragma: no cover - numba
    """Whether a live face of ``v`` holds both ``c`` and ``d``."""
    for k in range(tstart[v], tstart[v] + tcount[v]):
        g = rf[k]
        if alive[g]:
            g0, g1, g2 = F[g, 0], F[g, 1], F[g, 2]
            if (g0 == c or g1 == c or g2 == c) and (g0 == d or g1 == d or g2 == d):
                return True
    return False


@numba.njit(nogil=True, cache=True)
def _decimate_kernel(V, F, locked, target, max_err, alive):  # pragma: no cover - numba
    """Collapse edges of (V, F) in place until ``target`` live faces or ``max_err``; returns the live count.

    A collapse is made only if the mesh stays a manifold (the link condition: the edge's two
    faces are the only ones its ends share, and its two opposite vertices are not the third side
    of a face of each end, as in a tetrahedron), no face turns over or flattens, no locked vertex
    moves or goes, and no edge appears between two vertices locked on the same box face (``locked``
    holds bits of box faces: such an edge would lie in the face, where the piece beyond it has
    its own edges). Thresholds rise sweep by sweep (Fast Quadric Mesh Simplification's schedule)
    up to ``max_err`` (a quadric error: squared distance summed over the planes around). An edge
    refused by those checks is not tried again until a collapse changes its face.
    """
    n = V.shape[0]
    m = F.shape[0]
    Q = np.zeros((n, 10))
    live = 0
    for f in range(m):
        if not alive[f]:
            continue
        live += 1
        a, b, c = F[f, 0], F[f, 1], F[f, 2]
        ax, ay, az = V[a, 0], V[a, 1], V[a, 2]
        ux, uy, uz = V[b, 0] - ax, V[b, 1] - ay, V[b, 2] - az
        wx, wy, wz = V[c, 0] - ax, V[c, 1] - ay, V[c, 2] - az
        nx, ny, nz = uy * wz - uz * wy, uz * wx - ux * wz, ux * wy - uy * wx
        ln = np.sqrt(nx * nx + ny * ny + nz * nz)
        if ln <= 0:
            continue
        nx, ny, nz = nx / ln, ny / ln, nz / ln
        d = -(nx * ax + ny * ay + nz * az)
        q0, q1, q2, q3, q4 = nx * nx, nx * ny, nx * nz, nx * d, ny * ny
        q5, q6, q7, q8, q9 = ny * nz, ny * d, nz * nz, nz * d, d * d
        for j in range(3):
            v = F[f, j]
            Q[v, 0] += q0
            Q[v, 1] += q1
            Q[v, 2] += q2
            Q[v, 3] += q3
            Q[v, 4] += q4
            Q[v, 5] += q5
            Q[v, 6] += q6
            Q[v, 7] += q7
            Q[v, 8] += q8
            Q[v, 9] += q9
    cap = 6 * m + 64
    rf = np.empty(cap, np.int32)
    tstart = np.zeros(n, np.int32)
    tcount = np.zeros(n, np.int32)
    mark = np.zeros(n, np.int32)
    seen = np.zeros(n, np.int32)
    stamp = 0
    err = np.empty((m, 3))
    emin = np.empty(m)  # the face's smallest edge error; -1: to compute, inf: dead
    for f in range(m):
        emin[f] = -1.0 if alive[f] else np.inf
    swept = np.zeros(m, np.int32)  # the sweep that last changed the face (skipped for the rest of it)
    p = np.zeros(3)
    used = _refs(F, alive, n, tstart, tcount, rf)
    it = 0
    while live > target and it < 200:
        if it % 5 == 0 or used + 2 * 64 > cap:
            used = _refs(F, alive, n, tstart, tcount, rf)
        sweep = it + 1
        thr = 1e-9 * (it + 3.0) ** 7
        capped = thr >= max_err
        if capped:
            thr = max_err
        done = 0
        for f in range(m):
            if live <= target:
                break
            e = emin[f]
            if e > thr or swept[f] == sweep:
                continue
            if e < 0:
                e = np.inf
                for j in range(3):
                    ej = _edge_target(V, Q, locked, F[f, j], F[f, (j + 1) % 3], p)
                    err[f, j] = ej
                    if ej < e:
                        e = ej
                emin[f] = e
                if e > thr:
                    continue
            for j in range(3):
                if err[f, j] > thr:
                    continue
                a = F[f, j]
                b = F[f, (j + 1) % 3]
                _edge_target(V, Q, locked, a, b, p)
                if locked[b]:
                    a, b = b, a  # keep the locked end
                # the link condition (the two faces of the edge are the only ones a and b share) and no
                # face of a or b turned over, in one pass over each end's faces
                stamp += 1
                px, py, pz = p[0], p[1], p[2]
                moves = not locked[a]  # a locked end stays: its faces cannot turn
                bad = False
                for k in range(tstart[a], tstart[a] + tcount[a]):
                    g = rf[k]
                    if alive[g]:
                        g0, g1, g2 = F[g, 0], F[g, 1], F[g, 2]
                        mark[g0] = stamp
                        mark[g1] = stamp
                        mark[g2] = stamp
                        if moves and g0 != b and g1 != b and g2 != b and _flip1(V, F, g, a, px, py, pz):
                            bad = True
                            break
                shared = 0
                common = 0
                oc = od = -1
                face = locked[a]  # the box faces a lies on (b's edges to a vertex on one of them would lie in it)
                if not bad:
                    for k in range(tstart[b], tstart[b] + tcount[b]):
                        g = rf[k]
                        if not alive[g]:
                            continue
                        g0, g1, g2 = F[g, 0], F[g, 1], F[g, 2]
                        if g0 == a or g1 == a or g2 == a:
                            shared += 1
                        elif _flip1(V, F, g, b, px, py, pz):
                            bad = True
                            break
                        for i in range(3):
                            w = F[g, i]
                            if w == a or w == b:
                                continue
                            if mark[w] == stamp:
                                if seen[w] != stamp:
                                    seen[w] = stamp
                                    common += 1
                                    if common == 1:
                                        oc = w
                                    else:
                                        od = w
                            elif locked[w] & face:
                                bad = True  # a new edge in a locked face: the piece meshed beyond it has none
                if not bad and shared == 2 and common == 2 and _fin(F, alive, tstart, tcount, rf, a, oc, od) \
                        and _fin(F, alive, tstart, tcount, rf, b, oc, od):
                    bad = True  # faces (a, c, d) and (b, c, d) would become one face twice (a tetrahedron's)
                if bad or shared != 2 or common != 2:
                    err[f, j] = np.inf  # refused: not tried again until a collapse changes the face
                    emin[f] = min(err[f, 0], min(err[f, 1], err[f, 2]))
                    continue
                if used + tcount[a] + tcount[b] > cap:
                    used = _refs(F, alive, n, tstart, tcount, rf)
                    if used + tcount[a] + tcount[b] > cap:
                        continue
                # collapse b into a at p
                V[a, 0], V[a, 1], V[a, 2] = p[0], p[1], p[2]
                for i in range(10):
                    Q[a, i] += Q[b, i]
                start = used
                for k in range(tstart[a], tstart[a] + tcount[a]):
                    g = rf[k]
                    if alive[g]:
                        rf[used] = g
                        used += 1
                for k in range(tstart[b], tstart[b] + tcount[b]):
                    g = rf[k]
                    if not alive[g]:
                        continue
                    if F[g, 0] == a or F[g, 1] == a or F[g, 2] == a:
                        alive[g] = 0
                        emin[g] = np.inf
                        live -= 1
                        continue
                    for i in range(3):
                        if F[g, i] == b:
                            F[g, i] = a
                    rf[used] = g
                    used += 1
                tstart[a] = start
                tcount[a] = used - start
                tcount[b] = 0
                for k in range(start, used):
                    g = rf[k]
                    if alive[g]:  # a's faces went in first: those it shared with b are dead now
                        swept[g] = sweep
                        emin[g] = -1.0
                done += 1
                break
        it += 1
        if capped and done * 200 <= live:  # at the error bound, sweeps that collapse < 0.5 % stop
            break
    return live


_decimate = jit.kernel(_decimate_kernel, [numba.int64(numba.float64[:, ::1], numba.int32[:, ::1], numba.uint8[::1],
                                                        numba.int64, numba.float64, numba.uint8[::1])], None)


def decimate(mesh: Mesh, target: int, max_error: float = 1.0, locked=None) -> Mesh:
    """Simplify a mesh by quadric edge collapses that keep its topology and its locked vertices.

    Unlike ``zmesh.simplify_fqmr`` (whose collapses can pinch a thin tube into a non-manifold
    edge, and whose ``preserve_border`` misses some border vertices) and like zmesh's
    ``Mesher.simplify`` (at about a fifth of its cost), a closed mesh stays closed and
    consistently oriented, and a vertex marked ``locked`` keeps its exact position, so pieces
    simplified apart with their shared boundary locked still weld into one closed surface.

    Parameters
    ----------
    mesh : Mesh
        Vertices in voxels; welded (shared vertices are one vertex).
    target : int
        Faces wanted; fewer collapses are made where ``max_error`` binds.
    max_error : float, optional
        The largest quadric error accepted, as a distance in the vertices' units (its square
        bounds the summed squared distances to the original planes around a vertex).
    locked : array_like of bool or uint8, shape (n,), optional
        Vertices that must not move (open boundaries must be locked): booleans, or bits of the box
        faces each lies on (`box_faces`). No collapse makes an edge between two locked vertices
        sharing a bit (with booleans: between any two), so pieces meshed on either side of a face
        still weld into a manifold.

    Returns
    -------
    Mesh
        Vertices that remain (in their original order), faces among them.
    """
    if not len(mesh.faces):
        return Mesh.empty()
    if max_error < 0 or int(target) < 0:
        raise MeshError("target and max_error must be >= 0")
    if len(mesh.vertices) >= 1 << 31 or len(mesh.faces) >= 1 << 28:
        raise MeshError(f"mesh of {len(mesh.vertices):,} vertices and {len(mesh.faces):,} faces is too large to decimate")
    V = mesh.vertices.astype(np.float64)
    # about a corner near the mesh: the quadrics lose less to cancellation; an integer shift of float32
    # values is exact both ways, so an unmoved (locked) vertex comes back bit for bit
    corner = np.floor(V.min(axis=0))
    V -= corner
    F = mesh.faces.astype(np.int32)
    lk = np.zeros(len(V), np.uint8) if locked is None else np.ascontiguousarray(locked, dtype=np.uint8).reshape(-1)
    if len(lk) != len(V):
        raise MeshError(f"locked has {len(lk)} entries for {len(V)} vertices")
    alive = np.ones(len(F), np.uint8)
    _decimate(V, F, lk, int(target), float(max_error) ** 2, alive)
    F = F[alive.view(bool)]
    used = np.zeros(len(V), bool)
    used[F.reshape(-1)] = True
    remap = np.cumsum(used, dtype=np.int64) - 1
    V = V[used]
    V += corner
    return Mesh(V.astype(np.float32), remap[F].astype(np.uint32))


def box_faces(vertices, lo, hi) -> np.ndarray:
    """uint8 bits of the faces of the box ``[lo, hi]`` each vertex lies on exactly (bit 0: x = lo,
    1: x = hi, 2: y = lo, 3: y = hi, 4: z = lo, 5: z = hi): `decimate`'s ``locked``."""
    v = np.asarray(vertices)
    lo = np.asarray(lo, v.dtype).reshape(3)
    hi = np.asarray(hi, v.dtype).reshape(3)
    out = np.zeros(len(v), np.uint8)
    for ax in range(3):
        out |= (v[:, ax] == lo[ax]).astype(np.uint8) << np.uint8(2 * ax)
        out |= (v[:, ax] == hi[ax]).astype(np.uint8) << np.uint8(2 * ax + 1)
    return out


def on_box(vertices, lo, hi) -> np.ndarray:
    """Vertices lying on a face of the box ``[lo, hi]`` (exactly: cell and node boundaries)."""
    v = np.asarray(vertices)
    lo = np.asarray(lo, v.dtype).reshape(1, 3)
    hi = np.asarray(hi, v.dtype).reshape(1, 3)
    return ((v == lo) | (v == hi)).any(axis=1)


@numba.njit(nogil=True, cache=True)
def _volume_area_kernel(V, F):  # pragma: no cover - numba
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


@numba.njit(nogil=True, cache=True)
def _normals_kernel(V, F, out):  # pragma: no cover - numba
    out[:] = 0.0
    for f in range(F.shape[0]):
        a, b, c = F[f, 0], F[f, 1], F[f, 2]
        ux, uy, uz = V[b, 0] - V[a, 0], V[b, 1] - V[a, 1], V[b, 2] - V[a, 2]
        wx, wy, wz = V[c, 0] - V[a, 0], V[c, 1] - V[a, 1], V[c, 2] - V[a, 2]
        nx, ny, nz = uy * wz - uz * wy, uz * wx - ux * wz, ux * wy - uy * wx
        for v in (a, b, c):
            out[v, 0] += nx
            out[v, 1] += ny
            out[v, 2] += nz


_SIG_VA = numba.types.UniTuple(numba.float64, 2)(numba.float64[:, ::1], numba.int64[:, ::1])
_volume_area = jit.kernel(_volume_area_kernel, [_SIG_VA], None)
_normals = jit.kernel(_normals_kernel, [numba.void(numba.float64[:, ::1], numba.int64[:, ::1], numba.float64[:, ::1])],
                      None)


def volume_area(mesh: Mesh) -> tuple[float, float]:
    """(signed volume about the origin, area) of a mesh: the volume is additive over the pieces of
    a closed surface (each piece's tetrahedra with the origin), in the vertices' units."""
    if not len(mesh.faces):
        return 0.0, 0.0
    return _volume_area(mesh.vertices.astype(np.float64), mesh.faces.astype(np.int64))


def surface_area(vertices, faces) -> float:
    """Total area of a mesh's faces, in the vertices' units squared."""
    return volume_area(Mesh(vertices, faces))[1]


def inflate(mesh: Mesh, distance: float, locked=None) -> Mesh:
    """Move every vertex not ``locked`` by ``distance`` along its area-weighted normal (outward for
    outward-wound meshes): a closed mesh's volume changes by about ``distance`` x its area.

    Marching cubes at the iso-level half-way between voxel centres cuts every convex corner and
    edge of a voxel set, so a thin body's mesh encloses less than its voxels (a 2-voxel-wide tube,
    ~13 % less); the meshes job moves each body's surface out by the distance that gives back its
    voxel volume. Locked vertices (shared with pieces meshed apart) stay, so the pieces still weld.
    """
    if not len(mesh.faces) or distance == 0:
        return mesh
    v = mesh.vertices.astype(np.float64)
    vn = np.empty_like(v)
    _normals(v, mesh.faces.astype(np.int64), vn)
    ln = np.sqrt((vn * vn).sum(axis=1))
    ok = ln > 0
    vn[ok] /= ln[ok, None]
    if locked is not None:
        vn[np.asarray(locked, bool)] = 0
    return Mesh((v + distance * vn).astype(np.float32), mesh.faces)


@numba.njit(nogil=True, cache=True)
def _shell_kernel(F, n, root):  # pragma: no cover - numba
    """Union-find of the vertices of faces ``F``: each vertex's root (the smallest index of its piece)."""
    for v in range(n):
        root[v] = v
    for f in range(F.shape[0]):
        for j in range(1, 3):
            a = F[f, 0]
            b = F[f, j]
            while root[a] != a:
                root[a] = root[root[a]]
                a = root[a]
            while root[b] != b:
                root[b] = root[root[b]]
                b = root[b]
            if a != b:
                if a < b:
                    root[b] = a
                else:
                    root[a] = b
    for v in range(n):
        r = v
        while root[r] != r:
            r = root[r]
        root[v] = r


_shells = jit.kernel(_shell_kernel, [numba.void(numba.int64[:, ::1], numba.int64, numba.int64[::1])], None)


@numba.njit(nogil=True, cache=True)
def _piece_volumes_kernel(V, F, comp, c, out):  # pragma: no cover - numba
    """Add each face's signed tetrahedron volume (about ``c``) to ``out[comp[face]]``."""
    for f in range(F.shape[0]):
        a, b, d = F[f, 0], F[f, 1], F[f, 2]
        ax, ay, az = V[a, 0] - c[0], V[a, 1] - c[1], V[a, 2] - c[2]
        bx, by, bz = V[b, 0] - c[0], V[b, 1] - c[1], V[b, 2] - c[2]
        dx, dy, dz = V[d, 0] - c[0], V[d, 1] - c[1], V[d, 2] - c[2]
        out[comp[f]] += (ax * (by * dz - bz * dy) + ay * (bz * dx - bx * dz) + az * (bx * dy - by * dx)) / 6.0


_piece_volumes = jit.kernel(_piece_volumes_kernel, [numba.void(numba.float64[:, ::1], numba.int64[:, ::1],
                                                               numba.int64[::1], numba.float64[::1],
                                                               numba.float64[::1])], None)


def drop_cavities(pieces: Sequence[Mesh], shared: Sequence[np.ndarray] | None = None) -> tuple[list[Mesh], float]:
    """The pieces of one closed surface (welded where their vertices coincide) without its inner shells.

    A body's voxels that enclose something else (another body, or background) make marching cubes a
    second, inward-facing closed shell around it, a separate piece of the body's mesh that no one
    outside can see. Shells whose signed volume is not positive (inward, or flat) are removed from
    every piece. Returns the pieces (unchanged objects when nothing is removed) and the signed volume
    removed (<= 0: minus the cavities' volume), in the vertices' units cubed. ``shared`` (a boolean
    mask per piece) names the only vertices that can coincide with another piece's (those on the
    pieces' box faces); default: any.
    """
    idx = [i for i, m in enumerate(pieces) if len(m.faces)]
    if not idx:
        return list(pieces), 0.0
    live = [pieces[i] for i in idx]
    v = np.concatenate([m.vertices for m in live])
    starts = np.cumsum([0] + [len(m.vertices) for m in live[:-1]], dtype=np.int64)
    ids = np.arange(len(v), dtype=np.int64)
    if len(live) > 1:  # weld: each vertex to the first one at its position
        at = (np.flatnonzero(np.concatenate([np.asarray(shared[i], bool) for i in idx])) if shared is not None
              else ids)
        key = np.ascontiguousarray(v[at]).view(np.dtype((np.void, 12))).reshape(-1)
        _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
        ids[at] = at[first][inverse.reshape(-1)]
    allf = np.ascontiguousarray(np.concatenate([ids[m.faces.astype(np.int64) + s]
                                                for m, s in zip(live, starts, strict=True)]))
    root = np.empty(len(v), np.int64)
    _shells(allf, len(v), root)
    comp = root[allf[:, 0]]
    if comp.min() == comp.max():  # one piece (most bodies)
        return list(pieces), 0.0
    # each piece's signed volume, indexed by its root vertex (no sort), about the vertices' mean
    vol = np.zeros(len(v))
    _piece_volumes(v.astype(np.float64), allf, comp, np.asarray(v.mean(axis=0), np.float64), vol)
    inner = (vol <= 0) & (np.bincount(comp, minlength=len(v)) > 0)
    if not inner.any():
        return list(pieces), 0.0
    gone = float(vol[inner].sum())
    drop = inner[comp]
    out, pos = [], 0
    for m in pieces:
        if not len(m.faces):
            out.append(m)
            continue
        d = drop[pos:pos + len(m.faces)]
        pos += len(m.faces)
        if not d.any():
            out.append(m)
            continue
        f = m.faces[~d]
        used = np.zeros(len(m.vertices), bool)
        used[f.reshape(-1)] = True
        remap = np.cumsum(used, dtype=np.int64) - 1
        out.append(Mesh(m.vertices[used], remap[f]))
    return out, gone


def weld_pieces(pieces: Sequence[Mesh], boxes: Sequence[tuple]) -> Mesh:
    """`merge_fragments` for pieces that can share vertices only on the faces of their boxes (cells
    meshed apart): only those vertices are compared, the others kept as they are."""
    frs = [(m, b) for m, b in zip(pieces, boxes, strict=True) if len(m.faces)]
    if not frs:
        return Mesh.empty()
    v = np.concatenate([m.vertices for m, _ in frs])
    starts = np.cumsum([0] + [len(m.vertices) for m, _ in frs[:-1]], dtype=np.int64)
    faces = np.concatenate([m.faces.astype(np.int64) + s for (m, _), s in zip(frs, starts, strict=True)])
    edge = np.concatenate([on_box(m.vertices, lo, hi) for m, (lo, hi) in frs])
    idx = np.flatnonzero(edge)
    remap = np.arange(len(v), dtype=np.int64)
    if len(idx):
        key = np.ascontiguousarray(v[idx]).view(np.dtype((np.void, 12))).reshape(-1)
        _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
        remap[idx] = idx[first][inverse.reshape(-1)]
    keep = remap == np.arange(len(v))
    rank = np.cumsum(keep) - 1
    faces = rank[remap][faces]
    ok = (faces[:, 0] != faces[:, 1]) & (faces[:, 1] != faces[:, 2]) & (faces[:, 0] != faces[:, 2])
    return Mesh(v[keep], faces[ok])
