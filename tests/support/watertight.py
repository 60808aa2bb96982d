"""Mesh checks by trimesh, a well-kept implementation independent of the package's meshing."""

from __future__ import annotations

import numpy as np
import trimesh


def _mesh(vertices, faces) -> trimesh.Trimesh:
    return trimesh.Trimesh(np.asarray(vertices, np.float64).reshape(-1, 3), np.asarray(faces, np.int64).reshape(-1, 3),
                           process=False, validate=False)


def is_watertight(vertices, faces, *, oriented: bool = True) -> bool:
    """Closed: every edge shared by exactly two faces; with ``oriented``, wound consistently too.
    False for a mesh without faces."""
    if not len(np.asarray(faces).reshape(-1, 3)):
        return False
    m = _mesh(vertices, faces)
    return bool(m.is_watertight and (m.is_winding_consistent or not oriented))


def enclosed_volume(vertices, faces) -> float:
    """Signed volume of a closed mesh (positive for outward winding), in the vertices' units cubed."""
    if not len(np.asarray(faces).reshape(-1, 3)):
        return 0.0
    return float(_mesh(vertices, faces).volume)
