"""What the meshes job does to a body's welded surface: quadric decimation that keeps the topology
and the vertices shared with pieces meshed apart (`decimate`), inner shells dropped
(`drop_cavities`), the surface moved out to the volume its voxels hold (`inflate`), and pieces
welded along the boxes they were meshed in (`weld_pieces`). Vertices in voxels (`formats.mesh`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numba
import numpy as np

from . import jit
from .mesh import Mesh, MeshError, on_box

__all__ = ["decimate", "drop_cavities", "inflate", "weld_pieces"]


@numba.njit(nogil=True, cache=True, inline="always")
def _qe(q0, q1, q2, q3, q4, q5, q6, q7, q8, q9, x, y, z):  # type: ignore[no-untyped-def]  # pragma: no cover - numba
    return (x * (q0 * x + 2.0 * (q1 * y + q2 * z + q3)) + y * (q4 * y + 2.0 * (q5 * z + q6))
            + z * (q7 * z + 2.0 * q8) + q9)


@numba.njit(nogil=True, cache=True)
def _edge_target(V, Q, locked, a, b, p):  # type: ignore[no-untyped-def]  # pragma: no cover - numba
    """Where edge (a, b) collapses (into ``p``) and its quadric error; inf when both ends are
    locked. A locked end stays; else the quadric's optimum if well conditioned and near the edge,
    else the best of the ends and the midpoint."""
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
def _refs(F, alive, n, tstart, tcount, rf):  # type: ignore[no-untyped-def]  # pragma: no cover - numba
    """Vertex -> live faces (CSR in ``rf``); returns the length used."""
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
def _flip1(V, F, f, v, px, py, pz):  # type: ignore[no-untyped-def]  # pragma: no cover - numba
    """Whether moving ``v`` to ``p`` turns face ``f`` by more than ~78 degrees or flattens it."""
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
def _fin(F, alive, tstart, tcount, rf, v, c, d):  # type: ignore[no-untyped-def]  # pragma: no cover - numba
    for k in range(tstart[v], tstart[v] + tcount[v]):
        g = rf[k]
        if alive[g]:
            g0, g1, g2 = F[g, 0], F[g, 1], F[g, 2]
            if (g0 == c or g1 == c or g2 == c) and (g0 == d or g1 == d or g2 == d):
                return True
    return False


@numba.njit(nogil=True, cache=True)
def _decimate_kernel(V, F, locked, target, max_err, alive):  # type: ignore[no-untyped-def]  # pragma: no cover - numba
    """Collapse edges of (V, F) in place until ``target`` live faces or ``max_err``; returns the
    live count. A collapse keeps a manifold (link condition, tetrahedron case included), turns or
    flattens no face, moves no locked vertex and makes no edge between two vertices locked on the
    same box face (it would lie in the face, beside the next piece's own edges). Thresholds rise
    sweep by sweep (Fast Quadric Mesh Simplification's schedule) up to ``max_err``; a refused edge
    is not tried again until a collapse changes its face."""
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
                # link condition and turned faces, in one pass over each end's faces
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


def decimate(mesh: Mesh, target: int, max_error: float = 1.0, locked: Any = None) -> Mesh:
    """Simplify a welded mesh (vertices in voxels) by quadric edge collapses keeping its topology.

    Unlike ``zmesh.simplify_fqmr`` (which can pinch a tube into a non-manifold edge, and whose
    ``preserve_border`` misses border vertices) and at about a fifth of ``Mesher.simplify``'s cost,
    a closed mesh stays closed and oriented, and pieces simplified apart with their shared boundary
    ``locked`` still weld into one closed surface. Collapses stop at ``target`` faces or where the
    quadric error would pass ``max_error`` (a distance in the vertices' units). ``locked``: bools,
    or `box_faces` bits (no collapse makes an edge between two locked vertices sharing a bit).
    Returns the remaining vertices (in their order) and faces.
    """
    if not len(mesh.faces):
        return Mesh.empty()
    if max_error < 0 or int(target) < 0:
        raise MeshError("target and max_error must be >= 0")
    if len(mesh.vertices) >= 1 << 31 or len(mesh.faces) >= 1 << 28:
        raise MeshError(f"mesh of {len(mesh.vertices):,} vertices and {len(mesh.faces):,} faces is too large to decimate")
    V = mesh.vertices.astype(np.float64)
    # about a corner: less cancellation; an integer shift is exact, so locked vertices come back bit for bit
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


@numba.njit(nogil=True, cache=True)
def _normals_kernel(V, F, out):  # type: ignore[no-untyped-def]  # pragma: no cover - numba
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


_normals = jit.kernel(_normals_kernel, [numba.void(numba.float64[:, ::1], numba.int64[:, ::1], numba.float64[:, ::1])],
                      None)


def inflate(mesh: Mesh, distance: float, locked: Any = None) -> Mesh:
    """Move every vertex not ``locked`` by ``distance`` along its area-weighted normal: a closed
    mesh's volume changes by about ``distance`` x its area.

    Marching cubes half-way between voxel centres cuts every convex corner and edge, so a thin
    body's mesh encloses less than its voxels (a 2-voxel tube, ~13 %); the meshes job moves each
    surface out to give back its voxel volume. Locked vertices stay, so pieces still weld.
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
def _shell_kernel(F, n, root):  # type: ignore[no-untyped-def]  # pragma: no cover - numba
    """Union-find of the vertices of ``F``: each vertex's root (the smallest index of its piece)."""
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
def _piece_volumes_kernel(V, F, comp, c, out):  # type: ignore[no-untyped-def]  # pragma: no cover - numba
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
    """The pieces of one closed surface (welded where vertices coincide) without its inner shells.

    Voxels enclosing something (another body, or background) make marching cubes a second,
    inward-facing shell that no one outside sees: shells of signed volume <= 0 are removed.
    ``shared`` (a mask per piece) names the only vertices that can coincide with another piece's
    (those on box faces; default: any). Returns the pieces (the same objects when nothing goes)
    and the signed volume removed (<= 0), in the vertices' units cubed.
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
    # each piece's signed volume by its root vertex, about the mean
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


def weld_pieces(pieces: Sequence[Mesh], boxes: Sequence[tuple[Any, Any]]) -> Mesh:
    """`merge_fragments` for pieces that can share vertices only on their boxes' faces (cells
    meshed apart): only those vertices are compared."""
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
