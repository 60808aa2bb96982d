"""A small synthetic segmentation for the mesh tests: bodies of 2-3 supervoxels over 64³ chunks."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from dvidshards.formats import mesh as M
from tests.support.meshgrid import MeshGrid, cut_padded

OFFSET = (64, 0, 128)  # voxel offset of the volume
SIZE = (150, 140, 100)  # 3 x 3 x 2 chunks of 64, the last ones partial
RESOLUTION = (8.0, 8.0, 16.0)
# supervoxel -> body
BODIES = {11: 1, 12: 1, 13: 1, 21: 2, 22: 2, 31: 3, 32: 3, 33: 3}


@lru_cache(maxsize=1)
def supervoxels() -> np.ndarray:
    """uint64 supervoxel ids indexed [x, y, z] (coordinates relative to OFFSET)."""
    x, y, z = np.meshgrid(*(np.arange(s, dtype=np.float64) for s in SIZE), indexing="ij")
    sv = np.zeros(SIZE, np.uint64)
    # body 1: an ellipsoid across chunk faces, cut into 3 supervoxels along x
    e = ((x - 70) / 50) ** 2 + ((y - 60) / 35) ** 2 + ((z - 50) / 30) ** 2 < 1
    sv[e & (x < 55)] = 11
    sv[e & (x >= 55) & (x < 90)] = 12
    sv[e & (x >= 90)] = 13
    # body 2: a bent tube (torus arc) crossing several chunks, 2 supervoxels
    r = np.hypot(x - 75, y - 70)
    t = (r - 55) ** 2 + (z - 60) ** 2 < 9**2
    arc = t & (y > 85)
    sv[arc & (x < 75)] = 21
    sv[arc & (x >= 75)] = 22
    # body 3: a slab touching the volume's low and high faces (x = 0 .. end) with a hole
    slab = (y >= 5) & (y < 30) & (z >= 0) & (z < 20) & ~(((x - 100) ** 2 + (y - 17) ** 2) < 36)
    sv[slab & (x < 40)] = 31
    sv[slab & (x >= 40) & (x < 120)] = 32
    sv[slab & (x >= 120)] = 33
    return sv


def bodies() -> np.ndarray:
    """The body ids (supervoxels mapped through BODIES)."""
    sv = supervoxels()
    keys = np.array(sorted(BODIES), np.uint64)
    vals = np.array([BODIES[k] for k in sorted(BODIES)], np.uint64)
    out = np.zeros_like(sv)
    nz = sv != 0
    out[nz] = vals[np.searchsorted(keys, sv[nz])]
    return out


def body_box(body: int) -> tuple[np.ndarray, np.ndarray]:
    """Corner-coordinate box [lo, hi] of a body's voxels (absolute voxel coordinates)."""
    idx = np.argwhere(bodies() == body)
    return idx.min(axis=0) + np.asarray(OFFSET), idx.max(axis=0) + 1 + np.asarray(OFFSET)


@lru_cache(maxsize=4)
def cell_fragments(reduction_factor: int = 0) -> dict[int, dict[tuple[int, int, int], M.Mesh]]:
    """body -> cell -> fragment, meshed cell by cell from the body volume."""
    grid = MeshGrid(OFFSET, SIZE, 64)
    vol = bodies()
    out: dict[int, dict] = {}
    for cell in grid.cells():
        lo, hi = grid.cutout(cell)
        block = cut_padded(vol, OFFSET, lo, hi)
        for label, m in M.mesh_block(block, lo, reduction_factor=reduction_factor, max_error=4).items():
            out.setdefault(label, {})[cell] = m
    return out
