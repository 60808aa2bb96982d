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
        lut = dict(zip(m[:, 0].tolist(), m[:, 1].tolist(), strict=True))
        u, inv = np.unique(v, return_inverse=True)
        _MADE[exp.root, k] = np.asarray([lut.get(int(x), int(x)) for x in u], np.uint64)[inv].reshape(v.shape)
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
        c = np.unique(np.argwhere(m) // 64, axis=0)
        size = dvid.get_sparsevol_size(b)
        assert (size["voxels"], size["numblocks"]) == (int(m.sum()), len(c))
        coarse = dvid.get_sparsevol(b, scale="coarse", ret_type="INDEX")
        assert {tuple(v) for v in np.asarray(coarse)[:, :3].tolist()} == {tuple(v) for v in c.tolist()}
        for k in (0, 1, 2):
            vk = made(exp, k)
            idx = np.asarray(dvid.get_sparsevol(b, scale=k, ret_type="INDEX"))[:, :3]
            want = np.argwhere(vk == b)
            assert len(idx) == len(want) and {tuple(v) for v in idx.tolist()} == {tuple(v) for v in want.tolist()}


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
