"""What the mesh tests build on and the package does not need: cells over a whole volume (the
cells `formats.mesh.mesh_cells` meshes, plus a low sliver cell), a padded cutout, zmesh's
boundary-keeping simplifier, octree levels of detail and a whole multilod directory."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from dvidshards.formats.mesh import Mesh, MeshError, _triple, _zmesh, merge_fragments
from dvidshards.formats.multilod import encode_object, encode_shard_files, multilod_info

LATTICE = 16  # the simplifier snaps vertices to 1/LATTICE voxel (zmesh packs coordinates)


@dataclass(frozen=True)
class MeshGrid:
    """Meshing cells over a volume ``[offset, offset + size)``: cell ``1 + n`` holds chunk ``n``
    plus its + overlap, cells with a 0 index the layer between the zero padding and the volume."""

    offset: tuple[int, int, int]
    size: tuple[int, int, int]
    cell: tuple[int, int, int] = (64, 64, 64)

    def __post_init__(self) -> None:
        object.__setattr__(self, "offset", _triple(self.offset, "offset"))
        object.__setattr__(self, "size", _triple(self.size, "size"))
        object.__setattr__(self, "cell", _triple(self.cell, "cell"))

    @property
    def origin(self) -> tuple[float, ...]:
        return tuple(o + 0.5 - c for o, c in zip(self.offset, self.cell, strict=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(-(-s // c) + 1 for s, c in zip(self.size, self.cell, strict=True))

    def box(self, index) -> tuple[np.ndarray, np.ndarray]:
        """Corner-coordinate box of a cell."""
        lo = np.asarray(self.origin) + np.asarray(self.cell, np.float64) * np.asarray(index, np.float64)
        return lo, lo + np.asarray(self.cell, np.float64)

    def cutout(self, index) -> tuple[np.ndarray, np.ndarray] | None:
        """Voxel box ``[lo, hi)`` to mesh for a cell (up to one voxel outside the volume), or None."""
        i = np.asarray(index, np.int64)
        if (i < 0).any() or (i >= np.asarray(self.shape)).any():
            raise MeshError(f"cell {tuple(i.tolist())} is outside the grid {self.shape}")
        c, off, size = (np.asarray(v, np.int64) for v in (self.cell, self.offset, self.size))
        first = off - c + c * i  # first centre of the cell
        lo, hi = np.maximum(first, off - 1), np.minimum(first + c, off + size) + 1
        return None if (hi - lo < 2).any() else (lo, hi)

    def cells(self):
        """Every cell index with a cutout, x fastest."""
        for k in range(self.shape[2]):
            for j in range(self.shape[1]):
                for i in range(self.shape[0]):
                    if self.cutout((i, j, k)) is not None:
                        yield (i, j, k)


def cut_padded(volume, volume_offset, lo, hi) -> np.ndarray:
    """The box ``[lo, hi)`` of an ``[x, y, z]`` volume starting at ``volume_offset``, zero outside it."""
    vol = np.asarray(volume)
    off, lo_, hi_ = (np.asarray(v, np.int64) for v in (volume_offset, lo, hi))
    out = np.zeros(tuple(hi_ - lo_), vol.dtype)
    a, b = np.maximum(lo_, off), np.minimum(hi_, off + np.asarray(vol.shape))
    if (b > a).all():
        out[tuple(slice(int(x - s), int(y - s)) for x, y, s in zip(a, b, lo_, strict=True))] = \
            vol[tuple(slice(int(x - o), int(y - o)) for x, y, o in zip(a, b, off, strict=True))]
    return out


def simplify(mesh: Mesh, reduction_factor: int, max_error: float = 8) -> Mesh:
    """zmesh's quadric simplifier, vertices snapped to 1/LATTICE voxel first (boundary vertices,
    on half voxels, stay exact and do not move)."""
    zmesh = _zmesh()
    if not len(mesh.faces):
        return Mesh.empty()
    v = mesh.vertices.astype(np.float64)
    base = np.floor(v.min(axis=0))
    q = np.round((v - base) * LATTICE)
    r = 2.0 / LATTICE  # zmesh voxel_res whose half-voxel packing is the lattice
    lattice = zmesh.Mesh((q / LATTICE).astype(np.float32), mesh.faces, normals=None)
    s = zmesh.Mesher((r, r, r)).simplify(lattice, reduction_factor=int(reduction_factor),
                                         max_error=(float(max_error) + 0.5) * math.sqrt(3) * r)
    return Mesh((s.vertices.astype(np.float64) + base).astype(np.float32), s.faces)


def build_lods(fragments, num_lods: int, *, reduction_factor: int = 4, max_error: float = 8) -> list[dict]:
    """Octree levels of detail from level-0 cell fragments: a node of level j is the union of its
    8 children, each welded and simplified on its own (boundaries kept, so levels meet and no
    triangle crosses a node's 2x2x2 partition); stops once the body fits one node."""
    level = {tuple(int(v) for v in k): m for k, m in fragments.items() if len(m.faces)}
    lods = [level]
    for j in range(1, num_lods):
        if len(level) <= 1 and j > 1:
            break
        parents: dict[tuple[int, ...], list[Mesh]] = defaultdict(list)
        for d, mesh in sorted(level.items()):
            piece = simplify(merge_fragments([mesh]), reduction_factor, max_error * 2 ** (j - 1))
            if len(piece.faces):
                parents[(d[0] >> 1, d[1] >> 1, d[2] >> 1)].append(piece)
        level = {c: merge_fragments(ps) for c, ps in parents.items()}
        lods.append(level)
        if len(level) <= 1:
            break
    return lods


def multilod_files(objects, resolution, grid_origin, chunk_shape, *, bits: int = 16, sharding=None,
                   compression_level: int = 7) -> dict[str, bytes]:
    """Every file of a multi-resolution mesh directory (``info`` included), objects' levels of
    detail from `build_lods`; unsharded: ``<id>.index`` and ``<id>`` per object."""
    files = {"info": json.dumps(multilod_info(resolution, bits, sharding)).encode()}
    manifests, datas = {}, {}
    for segid, lods in objects.items():
        manifests[int(segid)], datas[int(segid)] = encode_object(lods, grid_origin, chunk_shape, bits,
                                                                 compression_level)
    if sharding is None:
        for segid in manifests:
            files[f"{segid}.index"], files[f"{segid}"] = manifests[segid], datas[segid]
    else:
        files.update(encode_shard_files(sharding, manifests, datas))
    return files
