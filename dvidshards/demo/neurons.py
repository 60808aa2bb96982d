"""Synthetic connectomics-like segmentations for tests, the demo and benchmarks.

The volumes imitate what a DVID ``labelmap`` holds: a mostly empty (0) background crossed
by tubular, branching neuron-like bodies of smoothly varying calibre, each body cut into a
few supervoxels, with large (> 2**32) supervoxel ids and a supervoxel -> body mapping in
which every body id is one of its own supervoxel ids (as DVID agglomeration does).
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["neuron_volume"]

# supervoxel ids are drawn from [_ID_LOW, _ID_HIGH): large like real mCNS/hemibrain ids
_ID_LOW = 2**32 + 1
_ID_HIGH = 2**40


@numba.njit(cache=True, nogil=True)
def _paint_spheres(vol_zyx, centers, radii, body_of_sphere, seeds, sv_ids):  # pragma: no cover - numba
    """Rasterise spheres (x, y, z centres) into ``vol_zyx``; the first body to reach a voxel keeps
    it, with the id of the nearest of that body's seeds."""
    nz, ny, nx = vol_zyx.shape
    for s in range(centers.shape[0]):
        cx, cy, cz = centers[s, 0], centers[s, 1], centers[s, 2]
        r = radii[s]
        r2 = r * r
        b = body_of_sphere[s]
        x0, x1 = max(int(np.floor(cx - r)), 0), min(int(np.ceil(cx + r)) + 1, nx)
        y0, y1 = max(int(np.floor(cy - r)), 0), min(int(np.ceil(cy + r)) + 1, ny)
        z0, z1 = max(int(np.floor(cz - r)), 0), min(int(np.ceil(cz + r)) + 1, nz)
        for z in range(z0, z1):
            dz = z - cz
            for y in range(y0, y1):
                dy = y - cy
                dyz = dy * dy + dz * dz
                if dyz > r2:
                    continue
                for x in range(x0, x1):
                    dx = x - cx
                    if dx * dx + dyz > r2 or vol_zyx[z, y, x] != 0:
                        continue
                    best = 0
                    best_d = 1e300
                    for k in range(seeds.shape[1]):
                        ex, ey, ez = x - seeds[b, k, 0], y - seeds[b, k, 1], z - seeds[b, k, 2]
                        d = ex * ex + ey * ey + ez * ez
                        if d < best_d:
                            best_d = d
                            best = k
                    vol_zyx[z, y, x] = sv_ids[b, best]


def _smooth_noise(rng: np.random.Generator, n: int, scale: float, corr: int) -> np.ndarray:
    """``n`` samples of zero-mean noise smoothed over about ``corr`` samples (std about ``scale``)."""
    raw = rng.normal(size=n + 2 * corr)
    kernel = np.hanning(2 * corr + 1)
    kernel /= np.sqrt((kernel**2).sum())
    return scale * np.convolve(raw, kernel, mode="valid")[:n]


def _trace_path(rng: np.random.Generator, start: np.ndarray, direction: np.ndarray, shape_xyz: np.ndarray,
                max_len: float, step: float, bend: float) -> np.ndarray:
    """A smooth random path (m, 3) from ``start`` until it leaves the volume or reaches ``max_len``."""
    n_max = max(int(max_len / step), 2)
    turn = np.stack([_smooth_noise(rng, n_max, bend, 12) for _ in range(3)], axis=1)
    points = np.empty((n_max, 3))
    pos = start.astype(float).copy()
    d = direction / np.linalg.norm(direction)
    lo, hi = -2.0 * step, shape_xyz + 2.0 * step
    m = 0
    for i in range(n_max):
        points[i] = pos
        m = i + 1
        d = d + turn[i]
        d /= np.linalg.norm(d)
        pos = pos + step * d
        if np.any(pos < lo) or np.any(pos > hi):
            break
    return points[:m]


def _random_direction(rng: np.random.Generator) -> np.ndarray:
    v = rng.normal(size=3)
    return v / np.linalg.norm(v)


def neuron_volume(shape_xyz: tuple[int, int, int], *, n_bodies: int = 12, svs_per_body: int = 4,
                  seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Make a neuron-like supervoxel volume and its supervoxel -> body mapping.

    Each body is a tube along a smooth random path that enters through a face of the volume
    and crosses it (so bodies cross block and shard boundaries), with a radius that varies
    smoothly along the path and zero to three thinner side branches. Every body is split into
    ``svs_per_body`` supervoxels: a voxel belongs to the nearest of ``svs_per_body`` seeds
    spread along the body's main path. Where bodies touch, the earlier body keeps the voxel.
    Most of the volume stays background (0), so many 64³ blocks of a larger volume are empty.

    Parameters
    ----------
    shape_xyz : tuple of int
        Volume size (x, y, z) in voxels; any positive sizes.
    n_bodies : int, optional
        Number of bodies (neurons).
    svs_per_body : int, optional
        Number of supervoxels each body is cut into (fewer may survive if a piece is
        completely covered by other bodies).
    seed : int, optional
        Seed of the random generator; the result depends only on the arguments.

    Returns
    -------
    volume : numpy.ndarray
        uint64 supervoxel ids indexed ``[x, y, z]`` (a Fortran-ordered view, so that
        ``volume.T`` is the C-contiguous (z, y, x) array).
    mapping : numpy.ndarray
        (n, 2) uint64 rows ``(supervoxel, body)`` for every supervoxel generated, sorted by
        supervoxel. Each body id is the id of its first supervoxel, so some rows map a
        supervoxel to itself, as in real DVID agglomerations.

    Examples
    --------
    >>> vol, mapping = neuron_volume((128, 128, 64), n_bodies=4, seed=1)
    >>> vol.shape, vol.dtype, mapping.shape
    ((128, 128, 64), dtype('uint64'), (16, 2))
    """
    shape = np.array([int(s) for s in shape_xyz], dtype=np.int64)
    if shape.shape != (3,) or np.any(shape <= 0):
        raise ValueError(f"shape_xyz must be three positive sizes, got {shape_xyz!r}")
    if n_bodies < 0 or svs_per_body < 1:
        raise ValueError("n_bodies must be >= 0 and svs_per_body >= 1")
    rng = np.random.default_rng(seed)
    dims = shape.astype(float)
    diag = float(np.linalg.norm(dims))
    r_lo, r_hi = max(1.5, 0.025 * float(dims.min())), max(2.5, 0.06 * float(dims.min()))

    # unique large supervoxel ids; each body's id is its first supervoxel
    n_sv = n_bodies * svs_per_body
    ids = np.unique(rng.integers(_ID_LOW, _ID_HIGH, size=n_sv * 2 + 8, dtype=np.uint64))
    ids = rng.permutation(ids)[:n_sv]
    sv_ids = ids.reshape(n_bodies, svs_per_body) if n_bodies else np.zeros((0, svs_per_body), np.uint64)

    centers_all, radii_all, body_all = [], [], []
    seeds = np.zeros((max(n_bodies, 1), svs_per_body, 3))
    for b in range(n_bodies):
        # enter through a random face, heading inwards
        axis, side = int(rng.integers(3)), int(rng.integers(2))
        start = rng.uniform(0.15, 0.85, size=3) * dims
        start[axis] = 0.0 if side == 0 else dims[axis] - 1
        inward = np.zeros(3)
        inward[axis] = 1.0 if side == 0 else -1.0
        direction = inward + 0.6 * _random_direction(rng)
        r0 = rng.uniform(r_lo, r_hi)
        step = max(0.75, 0.35 * r_lo)
        path = _trace_path(rng, start, direction, dims, 1.5 * diag, step, 0.03)
        radius = r0 * (1.0 + _smooth_noise(rng, len(path), 0.25, 20))
        radius = np.clip(radius, 0.5 * r0, 1.6 * r0)
        centers_all.append(path)
        radii_all.append(radius)
        body_all.append(np.full(len(path), b, np.int64))

        # supervoxel seeds spread along the main path (jittered arc positions)
        pos = (np.arange(svs_per_body) + rng.uniform(0.2, 0.8, svs_per_body)) / svs_per_body
        seeds[b] = path[np.minimum((pos * len(path)).astype(np.int64), len(path) - 1)]

        # thinner side branches leaving the middle part of the main path
        for _ in range(int(rng.integers(0, 4))):
            if len(path) < 8:
                break
            at = int(rng.integers(len(path) // 5, max(len(path) * 4 // 5, len(path) // 5 + 1)))
            tangent = path[min(at + 1, len(path) - 1)] - path[max(at - 1, 0)]
            tangent = tangent / max(np.linalg.norm(tangent), 1e-9)
            side_dir = _random_direction(rng)
            side_dir -= side_dir.dot(tangent) * tangent
            bdir = 0.6 * tangent + side_dir / max(np.linalg.norm(side_dir), 1e-9)
            bpath = _trace_path(rng, path[at], bdir, dims, rng.uniform(0.25, 0.6) * diag, step, 0.04)
            br0 = max(0.8, rng.uniform(0.45, 0.7) * radius[at])
            bradius = br0 * (1.0 + _smooth_noise(rng, len(bpath), 0.2, 15))
            bradius = np.clip(bradius, 0.5 * br0, 1.4 * br0)
            centers_all.append(bpath)
            radii_all.append(bradius)
            body_all.append(np.full(len(bpath), b, np.int64))

    vol_zyx = np.zeros((int(shape[2]), int(shape[1]), int(shape[0])), dtype=np.uint64)
    if n_bodies:
        _paint_spheres(vol_zyx, np.concatenate(centers_all), np.concatenate(radii_all), np.concatenate(body_all),
                       seeds, np.ascontiguousarray(sv_ids))

    bodies = np.repeat(sv_ids[:, 0], svs_per_body)
    mapping = np.stack([sv_ids.ravel(), bodies], axis=1).astype(np.uint64)
    mapping = mapping[np.argsort(mapping[:, 0], kind="stable")]
    return vol_zyx.T, mapping
