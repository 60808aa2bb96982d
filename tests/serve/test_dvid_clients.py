"""serve-dvid read by a client nobody here wrote: dvidtools (PyPI), against brute force over the
volume the export was written from. The export holds scale 0 only while its spec lists three
scales (DVID's export-shards default), so every coarser answer is made on demand."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from tests.support.downsample import by_count
from tests.support.exports import make_export
from tests.support.waiting import HANG_SECONDS

requests = pytest.importorskip("requests")
pytest.importorskip("aiohttp")
dvid = pytest.importorskip("dvid")  # dvidtools

from dvidshards.serve.dvid import serve  # noqa: E402 - after the optional imports are checked

SHAPE = (200, 170, 150)


@pytest.fixture(scope="module")
def exp(tmp_path_factory):
    e = make_export(tmp_path_factory.mktemp("dvidclients") / "exp", SHAPE, seed=7, scales=3)
    with open(os.path.join(e.root, "info"), "w") as f:
        json.dump(e.spec, f)
    for k in (1, 2):
        shutil.rmtree(os.path.join(e.root, f"s{k}"))
    return e


@pytest.fixture(scope="module")
def srv(exp):
    s = serve(exp.root, port=0, threads=2)
    dvid.setup(server=s.url, node=s.api.uuid)
    yield s
    s.shutdown()


def bodies(vol, n=3):
    ids, counts = np.unique(vol[vol != 0], return_counts=True)
    order = np.argsort(counts)
    return [int(v) for v in ids[order[np.linspace(0, len(order) - 1, n).astype(int)]]]


_MADE: dict = {}


def occupied_blocks(mask: np.ndarray) -> np.ndarray:
    """The 64³ blocks (their indices, sorted rows) holding a voxel of ``mask``."""
    pad = [(0, -n % 64) for n in mask.shape]
    m = np.pad(mask, pad)
    a, b, c = (n // 64 for n in m.shape)
    return np.argwhere(m.reshape(a, 64, b, 64, c, 64).any(axis=(1, 3, 5)))


def sorted_rows(a) -> np.ndarray:
    """The rows of an (n, 3) array in lexicographic order (a set of points, compared as one array)."""
    a = np.asarray(a, np.int64)
    return a[np.lexsort(a.T[::-1])]


def made(exp, k: int) -> np.ndarray:
    """Scale k (x, y, z) by DVID's rule from scale 0 (tests/support/downsample), bodies mapped."""
    if (exp.root, k) not in _MADE:
        pad = np.zeros([-(-s // 4) * 4 for s in SHAPE], np.uint64)
        pad[:SHAPE[0], :SHAPE[1], :SHAPE[2]] = exp.sv
        v = pad.T
        for _ in range(k):
            v = by_count(v)
        v = v.T
        m = np.asarray(exp.mapping, np.uint64).reshape(-1, 2)
        m = m[np.argsort(m[:, 0])]  # supervoxel -> body; a supervoxel not in it is its own body
        at = np.searchsorted(m[:, 0], v).clip(max=len(m) - 1)
        _MADE[exp.root, k] = np.where(m[at, 0] == v, m[at, 1], v)
    return _MADE[exp.root, k]


def test_projects_nodes_and_branches(srv):
    projects = dvid.list_projects(server=srv.url)
    assert srv.api.uuid in list(projects.index) + list(projects.get("Root", []))
    assert dvid.get_master_node(srv.api.uuid, server=srv.url) == srv.api.uuid
    assert list(dvid.get_branch_history(srv.api.uuid, "master", server=srv.url)) == [srv.api.uuid]
    info = dvid.get_segmentation_info(srv.url, srv.api.uuid)
    assert info["Extended"]["MaxDownresLevel"] == 2 and info["Extended"]["MaxPoint"] == [199, 169, 149]


def test_points_sizes_and_existence(exp, srv):
    vol = exp.expected(0)
    rng = np.random.default_rng(3)
    pts = np.concatenate([rng.integers(0, SHAPE, (200, 3)), [[-5, 0, 0], [10**5, 1, 1]]])
    want = [int(vol[tuple(p)]) if (p >= 0).all() and (p < SHAPE).all() else 0 for p in pts]
    got = dvid.locs_to_ids(pts, progress=False)
    assert [int(v) for v in got] == want
    ids = bodies(vol, 4)
    sizes = dvid.get_sizes(ids + [987654321], progress=False)
    assert [int(v) for v in sizes] == [int((vol == b).sum()) for b in ids] + [0]
    assert list(dvid.ids_exist(ids + [987654321], progress=False)) == [True] * len(ids) + [False]


def test_sparse_volumes_at_every_scale(exp, srv):
    vol0 = exp.expected(0)
    for b in bodies(vol0, 3):
        m = vol0 == b
        c = occupied_blocks(m)
        size = dvid.get_sparsevol_size(b)
        assert (size["voxels"], size["numblocks"]) == (int(m.sum()), len(c))
        coarse = dvid.get_sparsevol(b, scale="coarse", ret_type="INDEX")
        assert np.array_equal(sorted_rows(np.asarray(coarse)[:, :3]), c)  # c: np.unique's sorted rows
        for k in (0, 1, 2):
            vk = made(exp, k)
            idx = np.asarray(dvid.get_sparsevol(b, scale=k, ret_type="INDEX"))[:, :3]
            want = np.argwhere(vk == b)
            assert np.array_equal(sorted_rows(idx), want)  # argwhere: rows in sorted order


def test_last_mod_and_meshes(exp, srv):
    vol = exp.expected(0)
    b = bodies(vol, 3)[1]
    mod = dvid.get_last_mod(b)
    assert mod["mutation id"] == 0 and mod["last mod time"]
    with pytest.raises(requests.HTTPError):
        dvid.get_last_mod(987654321)
    assert list(dvid.has_mesh([b, 987654321], progress=False)) == [True, False]
    mesh = dvid.get_meshes(b, output="trimesh", progress=False)[0]
    m = vol == b
    lo, hi = np.argwhere(m).min(axis=0) * 8.0, (np.argwhere(m).max(axis=0) + 1) * 8.0  # nm at 8 nm voxels
    v = np.asarray(mesh.vertices)
    assert len(mesh.faces) and (v.min(axis=0) >= lo - 8.01).all() and (v.max(axis=0) <= hi + 8.01).all()
    pos = dvid.get_body_position(b)
    assert vol[tuple(int(x) for x in pos)] == b


@pytest.fixture(scope="module")
def exp16(tmp_path_factory):
    """The same kind of export at 16 nm: FlyEM's skeleton scale (the finest of at least 32 nm) is s1."""
    e = make_export(tmp_path_factory.mktemp("dvidclients16") / "exp", SHAPE, seed=7, scales=2, resolution=(16, 16, 16))
    with open(os.path.join(e.root, "info"), "w") as f:
        json.dump(e.spec, f)
    shutil.rmtree(os.path.join(e.root, "s1"))
    return e


def test_skeletons_read_by_dvidtools(exp16):
    """``<body>_swc`` made on demand at FlyEM's scale (the finest of at least 32 nm: s1 here, made by
    DVID's rule): dvidtools reads it as a navis neuron in scale-0 voxels, every node on a voxel of
    the body at s1 (within one voxel), one tree per connected piece of at least DUST voxels, radii
    in nm; an absent body is 404."""
    pytest.importorskip("kimimaro")
    pytest.importorskip("navis")
    from scipy import ndimage

    from dvidshards.jobs.skeletons import DUST

    vol = made(exp16, 1)
    near = np.ones((3, 3, 3), bool)
    ids, counts = np.unique(vol[vol != 0], return_counts=True)
    big_bodies = ids[counts >= 2 * DUST].tolist()
    assert len(big_bodies) >= 2
    with serve(exp16.root, port=0, threads=2) as s:
        for b in big_bodies[:: max(1, len(big_bodies) // 3)]:
            n = dvid.get_skeletons(b, output="navis", progress=False, on_error="raise", server=s.url,
                                   node=s.api.uuid)[0]
            xyz = n.nodes[["x", "y", "z"]].to_numpy()
            at = np.floor(xyz / 2).astype(int)  # scale-0 voxels -> s1 voxels
            assert np.allclose(at * 2 + 1, xyz)  # a node is the centre of an s1 voxel
            assert ndimage.binary_dilation(vol == b, near)[tuple(at.T)].all()
            pieces, _ = ndimage.label(vol == b, near)
            big = int((np.bincount(pieces.ravel())[1:] > DUST).sum())
            assert (n.nodes["parent_id"] < 0).sum() == big >= 1  # one tree per connected piece
            assert (n.nodes["radius"] > 0).all()
        assert list(dvid.has_skeleton([big_bodies[0], 987654321], progress=False, server=s.url,
                                      node=s.api.uuid)) == [True, False]
        r = requests.get(f"{s.url}/api/node/{s.api.uuid}/segmentation_skeletons/key/987654321_swc",
                         timeout=HANG_SECONDS)
        assert r.status_code == 404


def test_skeletons_read_from_a_skeletons_output(exp16, tmp_path):
    """``--skeletons OUT``: ``<body>_swc`` holds the body's skeleton in OUT, node for node as
    cloud-volume reads OUT's precomputed skeletons (nm); the one made on demand is the same."""
    pytest.importorskip("kimimaro")
    CloudVolume = pytest.importorskip("cloudvolume").CloudVolume
    from dvidshards.formats.skeleton import Skeleton
    from dvidshards.jobs.skeletons import skeletons

    out = tmp_path / "sk"
    assert skeletons(exp16.root, str(out), scheduler="serial", progress=False).ok
    cv = CloudVolume(f"file://{out}", progress=False)
    vol = made(exp16, 1)
    ids, counts = np.unique(vol[vol != 0], return_counts=True)
    some = ids[np.argsort(counts)[::-1][:3]].tolist()

    def rows(v):
        v = np.asarray(v, np.float64)
        return v[np.lexsort(v.T[::-1])]

    with serve(exp16.root, skeletons=str(out), port=0, threads=2) as s, serve(exp16.root, port=0, threads=2) as live:
        for b in some:
            got = [Skeleton.from_swc(requests.get(f"{x.url}/api/node/{x.api.uuid}/segmentation_skeletons/key/{b}_swc",
                                                  timeout=HANG_SECONDS).content, voxel_size=(16, 16, 16))
                   for x in (s, live)]
            ref = cv.skeleton.get(b)
            for sk in got:
                assert len(sk.vertices) == len(ref.vertices) > 0 and len(sk.edges) == len(ref.edges)
                np.testing.assert_allclose(rows(sk.vertices), rows(ref.vertices), atol=1e-3)
                np.testing.assert_allclose(np.sort(sk.radii), np.sort(ref.radius), rtol=1e-5)
        r = requests.get(f"{s.url}/api/node/{s.api.uuid}/segmentation_skeletons/key/987654321_swc",
                         timeout=HANG_SECONDS)
        assert r.status_code == 404
