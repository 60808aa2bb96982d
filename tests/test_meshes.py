"""``dvidshards meshes``: every body's mesh, read back by cloud-volume and checked against the
volume the export was written from (watertight, one piece, inside the body's box, its volume
near the body's voxel count), plus the job's manifest, resume and refusals."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

import dvidshards
from dvidshards import cli
from dvidshards.bodies import Body
from dvidshards.formats import mesh as M
from dvidshards.formats.mapping import LabelMapping
from dvidshards.jobs.meshes import MANIFEST, MeshesError, meshes
from dvidshards.demo.neurons import neuron_volume
from dvidshards.writer import write_export

pytest.importorskip("zmesh")
pytest.importorskip("DracoPy")
CloudVolume = pytest.importorskip("cloudvolume").CloudVolume

SHAPE = (190, 160, 150)
RES = np.array([8.0, 8.0, 8.0])


class SixBodies:
    """6 bodies of 2 or 3 supervoxels each, crossing chunk and shard faces (2-chunk shards)."""

    def __init__(self, root):
        sv, mapping = neuron_volume(SHAPE, n_bodies=6, svs_per_body=3, seed=5)
        sv = np.array(sv)  # own copy, F order lost is fine for the writer
        bodies = mapping[:, 1].reshape(-1)
        for b in np.unique(bodies)[::2]:  # every other body: merge its last two supervoxels
            svs = mapping[mapping[:, 1] == b, 0]
            sv[sv == svs[-1]] = svs[-2]
        keep = np.isin(mapping[:, 0], np.unique(sv))
        self.mapping = mapping[keep]
        self.sv = sv
        self.root = str(root)
        self.spec = write_export(sv, self.root, mapping=self.mapping, scales=2, shard_chunks=2,
                                 resolution=tuple(RES))
        self.bodies = LabelMapping.from_any(self.mapping)(sv)
        self.ids = [int(b) for b in np.unique(self.bodies[self.bodies != 0])]

    def dataset(self):
        return dvidshards.Dataset(self.root, spec=self.spec)


@pytest.fixture(scope="module")
def six(tmp_path_factory):
    e = SixBodies(tmp_path_factory.mktemp("six") / "exp")
    with open(os.path.join(e.root, "info"), "w") as f:
        json.dump(e.spec, f)
    return e


@pytest.fixture
def run_cli(monkeypatch):
    monkeypatch.setitem(cli.COMMANDS, "meshes", ("dvidshards.jobs.meshes:MeshesCommand", "meshes"))
    return cli.main


def one_mesh(got, body: int) -> M.Mesh:
    """cloud-volume's answer (a Mesh, or {id: Mesh}) as one welded mesh, vertices in nm."""
    m = got[body] if isinstance(got, dict) else got
    return M.merge_fragments([M.Mesh(m.vertices, m.faces)])


def pieces(m: M.Mesh) -> int:
    """Connected components of a mesh (union-find over its faces' vertices)."""
    parent = np.arange(len(m.vertices))

    def find(a):
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for a, b, c in m.faces.tolist():
        ra, rb, rc = find(a), find(b), find(c)
        parent[rb] = ra
        parent[find(rc)] = ra
    used = np.unique(m.faces)
    return len({find(int(v)) for v in used})


def check_bodies(six, dest, lod=None, tol=0.01) -> None:
    """The held-out bar: one watertight piece per body, inside its box, volume within 15 %.

    ``tol`` (nm) allows for simplified meshes, whose quadric optimum may leave the box a little.
    """
    cv = CloudVolume(f"file://{dest}", progress=False)
    for b in six.ids:
        m = one_mesh(cv.mesh.get(b) if lod is None else cv.mesh.get(b, lod=lod), b)
        assert M.is_watertight(m.vertices, m.faces), b
        assert pieces(m) == 1, b
        idx = np.argwhere(six.bodies == b)
        lo, hi = idx.min(axis=0) * RES, (idx.max(axis=0) + 1) * RES
        v = m.vertices.astype(np.float64)
        assert (v.min(axis=0) >= lo - tol).all() and (v.max(axis=0) <= hi + tol).all(), b
        vox = len(idx) * RES.prod()
        assert abs(M.enclosed_volume(m.vertices, m.faces) / vox - 1) < 0.15, b


def test_held_out_six_bodies(six, tmp_path, run_cli, capsys):
    assert all(2 <= len(np.unique(six.sv[six.bodies == b])) <= 3 for b in six.ids) and len(six.ids) == 6
    dest = tmp_path / "dest"
    assert run_cli(["meshes", six.root, str(dest), "--scheduler", "serial", "--quiet"]) == 0
    assert "6 bodies" in capsys.readouterr().out
    check_bodies(six, dest)
    info = json.loads((dest / "info").read_text())
    assert info["mesh"] == "mesh" and info["scales"][0]["resolution"] == list(RES)
    man = json.loads((dest / "mesh" / MANIFEST).read_text())
    assert man["complete"] is True and man["bodies"] == 6 and man["failed"] == {}
    minfo = json.loads((dest / "mesh" / "info").read_text())
    assert minfo["@type"] == "neuroglancer_multilod_draco" and minfo["sharding"]["hash"] == "murmurhash3_x86_128"
    assert not (dest / "mesh" / "_work").exists()


def test_threads_and_serial_write_the_same_bytes(six, tmp_path):
    ds = six.dataset()
    a = meshes(ds, tmp_path / "a", scheduler="serial", progress=False)
    b = meshes(ds, tmp_path / "b", scheduler="threads:2", progress=False)
    assert a.ok and b.ok and a.bodies == b.bodies == 6
    assert tree(tmp_path / "a" / "mesh", skip=MANIFEST) == tree(tmp_path / "b" / "mesh", skip=MANIFEST)


def tree(root, skip=None) -> dict:
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            if f != skip:
                p = os.path.join(d, f)
                out[os.path.relpath(p, root)] = open(p, "rb").read()
    return out


def test_levels_of_detail_from_coarser_scales(six, tmp_path):
    # every lod at full marching-cubes resolution: the coarse one has fewer faces by its scale alone
    rep = meshes(six.dataset(), tmp_path / "d", scales=(0, 1), reduction_factor=0, scheduler="serial",
                 progress=False)
    assert rep.ok
    check_bodies(six, tmp_path / "d", lod=0)
    cv = CloudVolume(f"file://{tmp_path / 'd'}", progress=False)
    for b in six.ids:
        fine, coarse = one_mesh(cv.mesh.get(b, lod=0), b), one_mesh(cv.mesh.get(b, lod=1), b)
        assert M.is_watertight(coarse.vertices, coarse.faces)
        assert len(coarse.faces) < len(fine.faces) / 2
        ratio = M.enclosed_volume(coarse.vertices, coarse.faces) / M.enclosed_volume(fine.vertices, fine.faces)
        assert 0.6 < ratio < 1.2, (b, ratio)  # thin parts shrink at the coarser scale


def test_simplified_levels_and_reduction(six, tmp_path):
    rep = meshes(six.dataset(), tmp_path / "d", lods=3, reduction_factor=4, max_error=2, scheduler="serial",
                 progress=False)
    assert rep.ok
    check_bodies(six, tmp_path / "d", lod=0, tol=0.3 * RES.max())
    cv = CloudVolume(f"file://{tmp_path / 'd'}", progress=False)
    b = six.ids[0]
    full = Body(six.dataset(), b).mesh()
    assert len(one_mesh(cv.mesh.get(b, lod=0), b).faces) < len(full.faces) / 2
    lod1 = one_mesh(cv.mesh.get(b, lod=1), b)
    assert M.is_watertight(lod1.vertices, lod1.faces)


def test_legacy_format(six, tmp_path):
    rep = meshes(six.dataset(), tmp_path / "d", legacy=True, scheduler="serial", progress=False)
    assert rep.ok and rep.bodies == 6
    assert json.loads((tmp_path / "d" / "mesh" / "info").read_text())["@type"] == "neuroglancer_legacy_mesh"
    check_bodies(six, tmp_path / "d")


def test_supervoxel_meshes(six, tmp_path):
    rep = meshes(six.dataset(), tmp_path / "d", labels="supervoxels", scheduler="serial", progress=False)
    svs = np.unique(six.sv[six.sv != 0])
    assert rep.ok and rep.bodies == len(svs)
    cv = CloudVolume(f"file://{tmp_path / 'd'}", progress=False)
    sv = int(svs[0])
    m = one_mesh(cv.mesh.get(sv), sv)
    assert M.is_watertight(m.vertices, m.faces)
    assert abs(M.enclosed_volume(m.vertices, m.faces) / ((six.sv == sv).sum() * RES.prod()) - 1) < 0.15


def test_into_a_convert_output(six, tmp_path):
    from dvidshards.jobs.convert import convert

    dest = tmp_path / "pre"
    assert convert(six.dataset(), dest, "precomputed", progress=False).ok
    before = json.loads((dest / "info").read_text())
    rep = meshes(six.dataset(), dest, scheduler="serial", progress=False)
    assert rep.ok
    after = json.loads((dest / "info").read_text())
    assert after.pop("mesh") == "mesh" and after == before
    cv = CloudVolume(f"file://{dest}", progress=False, fill_missing=True)
    np.testing.assert_array_equal(cv[0:SHAPE[0], 0:SHAPE[1], 0:SHAPE[2]][..., 0], six.bodies)
    check_bodies(six, dest)


def test_a_failed_shard_leaves_no_meshes_and_resume_finishes(six, tmp_path, run_cli, capsys):
    root = tmp_path / "exp"
    shutil.copytree(six.root, root)
    ds = dvidshards.Dataset(str(root), spec=six.spec)
    o = ds.shards(0)[1]
    path = root / "s0" / f"{o[0]}_{o[1]}_{o[2]}.arrow"
    good = path.read_bytes()
    path.write_bytes(good[:600])
    dest = tmp_path / "dest"
    assert run_cli(["meshes", str(root), str(dest), "--scheduler", "serial", "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "INCOMPLETE" in out and "--resume" in out and f"{o[0]}_{o[1]}_{o[2]}.arrow" in out
    man = json.loads((dest / "mesh" / MANIFEST).read_text())
    assert man["complete"] is False and any(k.endswith(f"{o[0]}_{o[1]}_{o[2]}.arrow") for k in man["failed"])
    failed = len(man["failed"])  # the shard, and its - neighbours whose cells reach into it
    assert not (dest / "info").exists() and not (dest / "mesh" / "info").exists()  # nothing readers find
    assert not any(f.endswith(".shard") for f in os.listdir(dest / "mesh"))
    # without --resume or --overwrite the earlier output is refused
    assert run_cli(["meshes", str(root), str(dest), "--quiet"]) == 2
    assert "--resume" in capsys.readouterr().err
    path.write_bytes(good)
    assert run_cli(["meshes", str(root), str(dest), "--scheduler", "serial", "--quiet", "--resume"]) == 0
    out = capsys.readouterr().out
    assert f"{len(ds.shards(0)) - failed} resumed" in out
    assert json.loads((dest / "mesh" / MANIFEST).read_text())["complete"] is True
    check_bodies(six, dest)
    fresh = tmp_path / "fresh"
    assert meshes(ds, fresh, scheduler="serial", progress=False).ok
    assert tree(dest / "mesh", skip=MANIFEST) == tree(fresh / "mesh", skip=MANIFEST)
    # resuming a complete output does nothing; other parameters are refused
    assert run_cli(["meshes", str(root), str(dest), "--quiet", "--resume"]) == 0
    assert run_cli(["meshes", str(root), str(dest), "--quiet", "--resume", "--legacy"]) == 2
    assert "other parameters" in capsys.readouterr().err


def test_destinations_refused(six, tmp_path, run_cli, capsys):
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert run_cli(["meshes", six.root, str(other), "--quiet"]) == 2
    assert "precomputed" in capsys.readouterr().err
    assert os.listdir(other) == ["notes.txt"]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "info").write_text('{"scales": [{"resolution": [4, 4, 4]}]}')
    assert run_cli(["meshes", six.root, str(bad), "--quiet"]) == 2
    assert "resolution" in capsys.readouterr().err
    foreign = tmp_path / "foreign"
    (foreign / "mesh").mkdir(parents=True)
    (foreign / "info").write_text(json.dumps(six.spec))
    (foreign / "mesh" / "info").write_text('{"@type": "neuroglancer_legacy_mesh"}')
    assert run_cli(["meshes", six.root, str(foreign), "--quiet"]) == 2
    assert "did not write" in capsys.readouterr().err
    assert run_cli(["meshes", six.root, str(foreign), "--quiet", "--overwrite", "--scheduler", "serial"]) == 0
    check_bodies(six, foreign)
    for args in (["--scales", "x"], ["--legacy", "--scales", "0,1"], ["--lods", "0"], ["--resume", "--overwrite"],
                 ["--scheduler", "nonsense"]):
        assert run_cli(["meshes", six.root, str(tmp_path / "new"), "--quiet", *args]) == 2, args
    assert not (tmp_path / "new").exists()
    with pytest.raises(MeshesError):
        meshes(six.dataset(), tmp_path / "x", scales=(0, 1), lods=2)


@pytest.mark.slow
def test_on_a_local_dask_cluster(six, tmp_path):
    a = meshes(six.dataset(), tmp_path / "a", scheduler="local:2", progress=False)
    b = meshes(six.dataset(), tmp_path / "b", scheduler="serial", progress=False)
    assert a.ok and b.ok
    assert tree(tmp_path / "a" / "mesh", skip=MANIFEST) == tree(tmp_path / "b" / "mesh", skip=MANIFEST)


def test_regroup_levels_give_the_same_output(six, tmp_path, monkeypatch):
    from dvidshards.jobs import meshes as job

    monkeypatch.setattr(job, "FAN_IN", 2)  # 7 shard files -> 4 -> 2 files before the final tasks
    a = meshes(six.dataset(), tmp_path / "a", scheduler="serial", progress=False)
    monkeypatch.setattr(job, "FAN_IN", 64)
    b = meshes(six.dataset(), tmp_path / "b", scheduler="serial", progress=False)
    assert a.ok and b.ok and len(six.dataset().shards(0)) > 4
    assert tree(tmp_path / "a" / "mesh", skip=MANIFEST) == tree(tmp_path / "b" / "mesh", skip=MANIFEST)
