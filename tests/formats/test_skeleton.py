"""Skeletons (formats.skeleton): the SWC and precomputed encodings against other readers, the join of
block pieces, and blockwise skeletons against brute force and kimimaro run on each whole body."""

from __future__ import annotations

import numpy as np
import pytest

from dvidshards.demo.neurons import neuron_volume
from dvidshards.formats.mapping import LabelMapping
from dvidshards.formats.skeleton import (
    Piece,
    Skeleton,
    SkeletonError,
    closed_faces,
    join_pieces,
    skeletonize_block,
    skeletonize_chunks,
)

kimimaro = pytest.importorskip("kimimaro")
cc3d = pytest.importorskip("cc3d")

RES = np.array([32.0, 32.0, 32.0])


def forest(n_trees: int = 2, seed: int = 0) -> Skeleton:
    """Random trees (each vertex hangs on an earlier one of its tree), nm, scale-0 voxels of 8 nm."""
    rng = np.random.default_rng(seed)
    v, e, start = [], [], 0
    for _ in range(n_trees):
        n = int(rng.integers(3, 30))
        v.append(rng.uniform(0, 10000, (n, 3)))
        e += [(start + i, start + int(rng.integers(0, i))) for i in range(1, n)]
        start += n
    return Skeleton(np.concatenate(v), np.array(e), rng.uniform(10, 500, start), voxel_size=(8, 8, 8))


def same_tree(a: Skeleton, b: Skeleton, tol: float = 0.01) -> bool:
    """The same vertices (within ``tol`` nm, in any order) joined by the same edges."""
    from scipy.spatial import cKDTree

    if len(a.vertices) != len(b.vertices) or len(a.edges) != len(b.edges):
        return False
    d, at = cKDTree(b.vertices).query(a.vertices)
    if len(a.vertices) and (d.max() > tol or len(np.unique(at)) != len(at)):
        return False
    return {frozenset(e) for e in at[a.edges].tolist()} == {frozenset(e) for e in b.edges.tolist()}


# --------------------------------------------------------------------------- encodings


def test_swc_round_trip_in_scale0_voxels_with_parents_first():
    sk = forest(3)
    text = sk.swc(header=["made by a test"])
    rows = [r.split() for r in text.splitlines() if not r.startswith("#")]
    ids = [int(r[0]) for r in rows]
    assert ids == list(range(1, len(sk.vertices) + 1))
    assert all(int(r[6]) < int(r[0]) for r in rows)  # parents come before their children
    assert sum(int(r[6]) == -1 for r in rows) == 3  # one root per tree
    xyz = np.array([[float(x) for x in r[2:5]] for r in rows])
    assert np.allclose(np.sort(xyz, axis=0), np.sort(sk.vertices / 8, axis=0), rtol=1e-5)  # scale-0 voxels
    back = Skeleton.from_swc(text, voxel_size=(8, 8, 8))
    assert same_tree(back, sk)
    assert np.allclose(np.sort(back.radii), np.sort(sk.radii), rtol=1e-5)  # radii in nm either way
    nm = Skeleton.from_swc(sk.swc(units="nm"), units="nm")
    assert same_tree(nm, sk) and abs(nm.cable_length - sk.cable_length) < 1e-3 * sk.cable_length


def test_swc_numbers_are_fixed_point_whatever_their_size():
    """SWC readers that take no exponent (%g writes 1.2e+05 past 6 digits) read every coordinate."""
    sk = Skeleton(np.array([[8.0e5, 1.6e6, 4.0], [8.0e5 + 8, 1.6e6, 4.0]]), np.array([[0, 1]]), np.array([3e6, 2.0]),
                  voxel_size=(8, 8, 8))
    for units in ("voxels", "nm"):
        rows = [r.split() for r in sk.swc(units=units).splitlines()]
        assert not any("e" in w.lower() for r in rows for w in r), rows
        assert all(len(w.split(".")[1]) == 6 for r in rows for w in r[2:6])
    assert [r.split()[2:6] for r in sk.swc().splitlines()][0] == ["100000.000000", "200000.000000", "0.500000",
                                                                  "3000000.000000"]


def test_swc_is_read_by_navis(tmp_path):
    navis = pytest.importorskip("navis")
    sk = forest(1, seed=4)
    path = tmp_path / "5.swc"
    path.write_text(sk.swc())
    n = navis.read_swc(str(path))
    assert n.n_nodes == len(sk.vertices) and n.n_skeletons if hasattr(n, "n_skeletons") else True
    assert abs(float(n.cable_length) * 8 - sk.cable_length) < 1e-3 * sk.cable_length  # navis: voxel units
    assert np.allclose(np.sort(n.nodes.radius.to_numpy()), np.sort(sk.radii), rtol=1e-5)


def test_precomputed_is_read_by_cloudvolume():
    cloudvolume = pytest.importorskip("cloudvolume")
    sk = forest(2, seed=1)
    attrs = [{"id": "radius", "data_type": "float32", "num_components": 1}]
    cv = cloudvolume.Skeleton.from_precomputed(sk.encode_precomputed(), segid=7, vertex_attributes=attrs)
    np.testing.assert_allclose(cv.vertices, sk.vertices)
    np.testing.assert_array_equal(cv.edges, sk.edges)
    np.testing.assert_allclose(cv.radii, sk.radii)
    back = Skeleton.decode_precomputed(cv.to_precomputed())  # and the other way
    np.testing.assert_allclose(back.vertices, sk.vertices)
    np.testing.assert_allclose(back.radii, sk.radii)
    typed = [*attrs, {"id": "vertex_types", "data_type": "uint8", "num_components": 1}]  # igneous' attributes
    two = Skeleton.decode_precomputed(sk.encode_precomputed() + bytes(len(sk.vertices)), vertex_attributes=typed)
    np.testing.assert_allclose(two.radii, sk.radii)


@pytest.mark.parametrize("bad", [b"", b"\x01\x00\x00\x00\x00\x00\x00\x00", forest().encode_precomputed()[:-3]])
def test_damaged_precomputed_bytes_are_refused(bad):
    with pytest.raises(SkeletonError):
        Skeleton.decode_precomputed(bad)


@pytest.mark.parametrize("text", ["1 0 1 2 3 4\n", "1 0 1 2 3 4 -1\n1 0 1 2 3 4 -1\n", "1 0 1 2 3 4 9\n"])
def test_malformed_swc_is_refused(text):
    with pytest.raises(SkeletonError):
        Skeleton.from_swc(text, units="nm")


def test_a_skeleton_that_names_missing_vertices_is_refused():
    with pytest.raises(SkeletonError):
        Skeleton(np.zeros((2, 3)), np.array([[0, 2]]), np.zeros(2))
    with pytest.raises(SkeletonError):
        forest().swc(units="feet")
    with pytest.raises(SkeletonError):
        Skeleton(np.zeros((2, 3)), np.array([[0, 1]]), np.zeros(2)).swc()  # voxels without a voxel size


# --------------------------------------------------------------------------- the join


def piece(points, edges, count=1) -> Piece:
    p = np.asarray(points, np.int32)
    return Piece(p, np.asarray(edges, np.uint32).reshape(-1, 2), np.full(len(p), 50, np.float32), count)


def test_join_welds_shared_voxels_links_neighbours_and_cuts_cycles():
    a = piece([[0, 0, 0], [1, 0, 0], [2, 0, 0], [3, 0, 0]], [[0, 1], [1, 2], [2, 3]])
    b = piece([[3, 0, 0], [4, 0, 0], [5, 1, 0]], [[0, 1], [1, 2]])  # shares voxel (3, 0, 0) with a
    c = piece([[6, 2, 1], [7, 2, 1]], [[0, 1]])  # 26-adjacent to b's last vertex: the same piece of the body
    d = piece([[0, 0, 0], [0, 1, 0], [1, 1, 0], [1, 0, 0]], [[0, 1], [1, 2], [2, 3]])  # a cycle through a
    far = piece([[20, 0, 0], [21, 0, 0]], [[0, 1]])
    sk = join_pieces([a, b, c, d, far], resolution=RES)
    assert len(sk.vertices) == 4 + 2 + 2 + 2 + 2  # (3,0,0), (0,0,0), (1,0,0) once each
    assert len(np.unique(np.round(sk.vertices / RES - 0.5).astype(int), axis=0)) == len(sk.vertices)
    assert sk.trees == 2 and len(sk.edges) == len(sk.vertices) - 2  # a forest: no cycle left
    np.testing.assert_allclose(sk.vertices, (np.round(sk.vertices / RES - 0.5) + 0.5) * RES)  # voxel centres, nm
    healed = join_pieces([a, b, c, d, far], resolution=RES, heal_nm=14 * 32.0)
    assert healed.trees == 1 and join_pieces([a, b, c, d, far], resolution=RES, heal_nm=12 * 32.0).trees == 2
    assert join_pieces([], resolution=RES).trees == 0


# --------------------------------------------------------------------------- against brute force


@pytest.fixture(scope="module")
def neurons():
    """Neuron-like bodies as thin as mCNS neurites at 32 nm (2-4 voxels), crossing 256-voxel blocks."""
    sv, mapping = neuron_volume((512, 384, 64), n_bodies=14, svs_per_body=2, seed=3)
    return np.asfortranarray(LabelMapping.from_any(mapping)(np.array(sv)))


def blockwise(vol: np.ndarray, side: int, dust: int = 0) -> dict[int, Skeleton]:
    """Blocks of ``side`` voxels, each with one voxel of its + neighbours (cut at the volume's end)."""
    pieces: dict[int, list] = {}
    for o in np.stack(np.meshgrid(*[np.arange(0, n, side) for n in vol.shape], indexing="ij"), -1).reshape(-1, 3):
        cut = np.array(vol[o[0]:o[0] + side + 1, o[1]:o[1] + side + 1, o[2]:o[2] + side + 1], order="F")
        core = np.minimum(o + side, vol.shape) - o
        closed = closed_faces(o, side, (0, 0, 0), vol.shape)
        for b, p in skeletonize_block(cut, o, resolution=RES, core=core, closed=closed, dust=dust).items():
            pieces.setdefault(b, []).append(p)
    return {b: join_pieces(ps, resolution=RES) for b, ps in pieces.items()}


def check_against_masks(vol: np.ndarray, skels: dict[int, Skeleton], dust: int) -> None:
    """Every vertex on a voxel of its body; one tree per 26-connected piece (of >= dust voxels), none
    spanning two; no two vertices closer than half a voxel."""
    from scipy.spatial import cKDTree

    for b, sk in skels.items():
        mask = vol == b
        vox = np.floor(sk.vertices / RES).astype(int)
        assert mask[tuple(vox.T)].all(), f"body {b}: a vertex off the body"
        cc, _ = cc3d.connected_components(mask, connectivity=26, return_N=True)
        sizes = np.bincount(cc.reshape(-1))
        piece_of = cc[tuple(vox.T)]
        trees = sk.components()
        for t in range(sk.trees):
            assert len(np.unique(piece_of[trees == t])) == 1, f"body {b}: a tree spans two pieces"
        big = set(np.flatnonzero(sizes >= max(dust, 2)).tolist()) - {0}
        got = piece_of.tolist()
        assert big <= set(got) and len(set(got)) == sk.trees, f"body {b}: pieces {big} vs trees {sk.trees}"
        assert not cKDTree(sk.vertices / RES).query_pairs(0.5), f"body {b}: two vertices within half a voxel"


def cable_ratios(ours: dict[int, Skeleton], whole: dict) -> tuple[float, np.ndarray]:
    """(total cable / kimimaro's total - 1, per body cable / kimimaro's - 1)."""
    rel = np.array([ours[b].cable_length / whole[b].cable_length() - 1 for b in whole])
    return sum(ours[b].cable_length for b in whole) / sum(w.cable_length() for w in whole.values()) - 1, rel


@pytest.mark.slow
def test_blockwise_skeletons_match_kimimaro_on_each_whole_body(neurons):
    """kimimaro on the whole volume at once, 0 outside it, is the reference. TEASAR's choice of branches depends on
    where it starts, so a body cut by a block face can gain or lose a short branch: the total is held
    to 5 %, each body to 10 % (a body or two of a dozen may miss it by a branch, as kimimaro misses its
    own result by one when the volume is mirrored)."""
    whole = kimimaro.skeletonize(np.asfortranarray(np.pad(neurons, 1)), teasar_params={"scale": 4, "const": 500},
                                 anisotropy=RES, dust_threshold=0, progress=False)  # 0 outside: no face of its own
    for w in whole.values():
        w.vertices -= RES.astype(np.float32)
    ours = blockwise(neurons, 256)
    check_against_masks(neurons, ours, dust=2)
    assert set(ours) == set(whole)
    total, rel = cable_ratios(ours, whole)
    assert abs(total) <= 0.05 and np.median(np.abs(rel)) <= 0.02, (total, rel)
    assert (np.abs(rel) <= 0.10).mean() >= 0.85 and np.abs(rel).max() <= 0.25, rel


def test_small_inner_pieces_are_dust_and_pieces_at_a_seam_are_kept():
    vol = np.zeros((65, 65, 65), np.uint64, order="F")
    vol[10:13, 10:13, 10:13] = 5  # 27 voxels inside the block: dust
    vol[60:65, 30:33, 30:33] = 6  # 45 voxels touching the + face: may continue next door, kept
    vol[20:40, 20:40, 20:40] = 7
    vol[45:49, 45:50, 45:50] = 8  # 100 voxels: dust too, as kimimaro keeps only pieces over its dust_threshold
    alone = kimimaro.skeletonize(np.asfortranarray(np.where(vol == 8, vol, 0)), dust_threshold=100, progress=False)
    got = skeletonize_block(vol, (0, 0, 0), resolution=RES, core=(64, 64, 64), dust=100)
    assert got[5].count == 27 and len(got[5].voxels) == 0
    assert got[8].count == 100 and len(got[8].voxels) == 0 and 8 not in alone
    assert len(got[6].voxels) > 0 and got[6].count == 4 * 9
    assert len(got[7].voxels) > 0 and got[7].count == 20 ** 3


def test_one_body_on_demand_equals_the_blockwise_run(neurons):
    b = int(np.unique(neurons)[3])
    mask = neurons == b
    chunks = np.unique(np.argwhere(mask) // 64, axis=0)

    def mask_of(c):
        lo = np.asarray(c) * 64
        out = np.zeros((64, 64, 64), bool)
        part = mask[lo[0]:lo[0] + 64, lo[1]:lo[1] + 64, lo[2]:lo[2] + 64]
        out[:part.shape[0], :part.shape[1], :part.shape[2]] = part
        return out.T  # (z, y, x), as Body.block_masks gives them

    sk = skeletonize_chunks(chunks, mask_of, chunk_size=64, resolution=RES, bounds=((0, 0, 0), mask.shape),
                            voxel_size=(8, 8, 8), block=2)
    ref = blockwise(np.where(mask, np.uint64(b), np.uint64(0)), 128)[b]
    assert same_tree(sk, ref)
    check_against_masks(neurons, {b: sk}, dust=2)
    assert sk.swc().count("\n") == len(sk.vertices)  # scale-0 voxels: the voxel size travels with it
