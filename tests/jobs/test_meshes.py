"""``dvidshards meshes``: every body's mesh, read back by cloud-volume and checked against the
volume the export was written from (watertight, one piece, inside the body's box, its volume
near the body's voxel count), plus the job's manifest, resume and refusals."""

from __future__ import annotations

import importlib
import json
import os
import shutil

import numpy as np
import pytest

import dvidshards
from dvidshards import cli
from dvidshards.bodies import Body
from dvidshards.demo.neurons import neuron_volume
from dvidshards.errors import JobError
from dvidshards.formats import mesh as M
from dvidshards.formats.mapping import LabelMapping
from dvidshards.jobs.meshes import MANIFEST, MeshesError, default_scale, meshes
from dvidshards.writer import write_export
from tests.support import watertight as W

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


def check_bodies(six, dest, lod=None, scale=0, tol=0.5) -> None:
    """Every body's mesh is one watertight piece, inside its box, volume within 15 % of its
    voxels at the meshed scale.

    ``tol`` (voxels of that scale) allows for surfaces moved out to their voxel volume.
    """
    cv = CloudVolume(f"file://{dest}", progress=False)
    vol = six.dataset().read([[0, 0, 0], list(six.dataset().scale(scale).size)], scale=scale)
    res = RES * 2**scale
    for b in six.ids:
        m = one_mesh(cv.mesh.get(b) if lod is None else cv.mesh.get(b, lod=lod), b)
        assert W.is_watertight(m.vertices, m.faces), b
        assert pieces(m) == 1, b
        idx = np.argwhere(vol == b)
        lo, hi = idx.min(axis=0) * res, (idx.max(axis=0) + 1) * res
        v = m.vertices.astype(np.float64)
        assert (v.min(axis=0) >= lo - tol * res).all() and (v.max(axis=0) <= hi + tol * res).all(), b
        vox = len(idx) * res.prod()
        assert abs(W.enclosed_volume(m.vertices, m.faces) / vox - 1) < 0.15, b


def test_six_bodies_mesh_as_watertight_pieces_inside_their_boxes(six, tmp_path, run_cli, capsys):
    assert all(2 <= len(np.unique(six.sv[six.bodies == b])) <= 3 for b in six.ids) and len(six.ids) == 6
    dest = tmp_path / "dest"
    assert run_cli(["meshes", six.root, str(dest), "--scheduler", "serial", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "6 bodies" in out and "from s1 (16 nm)" in out and "downsample" in out  # no 32 nm scale here
    check_bodies(six, dest, scale=1)
    info = json.loads((dest / "info").read_text())
    assert info["mesh"] == "mesh" and info["scales"][0]["resolution"] == list(RES)
    man = json.loads((dest / "mesh" / MANIFEST).read_text())
    assert man["job"] == "meshes" and man["complete"] is True and man["totals"]["bodies"] == 6
    assert man["failed"] == {} and man["scales"] == [1]
    minfo = json.loads((dest / "mesh" / "info").read_text())
    assert minfo["@type"] == "neuroglancer_multilod_draco" and minfo["sharding"]["hash"] == "murmurhash3_x86_128"
    assert minfo["transform"][0] == 16.0  # level 0 is s1
    assert not (tmp_path / "dest.work").exists()  # the work folder beside DEST goes once complete


def test_every_scale_meshed_watertight_at_its_voxel_volume(six, tmp_path):
    """Each scale on its own (scale=K, one level): one watertight piece per body, its volume within
    15 % of its voxels at that scale (and within 3 % here: surfaces are moved out to it)."""
    for k in (0, 1):
        rep = meshes(six.dataset(), tmp_path / f"s{k}", scale=k, lods=1, scheduler="serial", progress=False)
        assert rep.ok and rep.scales == [k] and rep.totals["bodies"] == 6
        check_bodies(six, tmp_path / f"s{k}", scale=k)
        cv = CloudVolume(f"file://{tmp_path / f's{k}'}", progress=False)
        vol = six.dataset().read([[0, 0, 0], list(six.dataset().scale(k).size)], scale=k)
        for b in six.ids:
            m = one_mesh(cv.mesh.get(b), b)
            assert abs(W.enclosed_volume(m.vertices, m.faces) / ((vol == b).sum() * (RES * 2**k).prod()) - 1) < 0.03


def test_default_scale_is_the_finest_at_32_nm(tmp_path):
    sv, mapping = neuron_volume((96, 80, 72), n_bodies=2, svs_per_body=2, seed=3)
    spec = write_export(np.array(sv), tmp_path / "e", mapping=mapping, scales=4, resolution=(8, 8, 8))
    assert default_scale(dvidshards.Dataset(tmp_path / "e", spec=spec)) == (2, None)
    spec = write_export(np.array(sv), tmp_path / "f", mapping=mapping, scales=2, resolution=(16, 16, 40))
    assert default_scale(dvidshards.Dataset(tmp_path / "f", spec=spec))[0] == 1  # 32 x 32 x 80 nm
    spec = write_export(np.array(sv), tmp_path / "g", mapping=mapping, scales=1, resolution=(8, 8, 8))
    k, note = default_scale(dvidshards.Dataset(tmp_path / "g", spec=spec))
    assert k == 0 and "downsample" in note


def test_threads_and_serial_write_the_same_bytes(six, tmp_path):
    ds = six.dataset()
    a = meshes(ds, tmp_path / "a", scheduler="serial", progress=False)
    b = meshes(ds, tmp_path / "b", scheduler="threads:2", progress=False)
    assert a.ok and b.ok and a.totals["bodies"] == b.totals["bodies"] == 6
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
    rep = meshes(six.dataset(), tmp_path / "d", scale=0, scheduler="serial", progress=False)
    assert rep.ok and rep.scales == [0, 1]  # every exported coarser scale
    check_bodies(six, tmp_path / "d", lod=0, scale=0)
    cv = CloudVolume(f"file://{tmp_path / 'd'}", progress=False)
    for b in six.ids:
        fine, coarse = one_mesh(cv.mesh.get(b, lod=0), b), one_mesh(cv.mesh.get(b, lod=1), b)
        assert W.is_watertight(coarse.vertices, coarse.faces)
        assert len(coarse.faces) < len(fine.faces) / 2
        ratio = W.enclosed_volume(coarse.vertices, coarse.faces) / W.enclosed_volume(fine.vertices, fine.faces)
        assert 0.85 < ratio < 1.15, (b, ratio)  # each level holds its own scale's voxel volume


def test_reduction_zero_keeps_every_marching_cubes_face(six, tmp_path):
    a = meshes(six.dataset(), tmp_path / "a", scale=0, lods=1, reduction_factor=0, cell_reduction=0,
               inflate=False, scheduler="serial", progress=False)
    b = meshes(six.dataset(), tmp_path / "b", scale=0, lods=1, scheduler="serial", progress=False)
    assert a.ok and b.ok
    assert a.totals["faces_after_cell_pass"] == a.totals["faces_marching_cubes"]
    cva, cvb = (CloudVolume(f"file://{tmp_path / k}", progress=False) for k in "ab")
    for body in six.ids:
        full = Body(six.dataset(), body).mesh()
        ma, mb = one_mesh(cva.mesh.get(body), body), one_mesh(cvb.mesh.get(body), body)
        assert len(ma.faces) == len(full.faces)  # marching cubes, cell by cell, welded: the whole body's
        assert len(mb.faces) < len(full.faces) / 4


def test_legacy_format(six, tmp_path):
    rep = meshes(six.dataset(), tmp_path / "d", legacy=True, scheduler="serial", progress=False)
    assert rep.ok and rep.totals["bodies"] == 6
    assert json.loads((tmp_path / "d" / "mesh" / "info").read_text())["@type"] == "neuroglancer_legacy_mesh"
    check_bodies(six, tmp_path / "d", scale=1)


def test_supervoxel_meshes(six, tmp_path):
    rep = meshes(six.dataset(), tmp_path / "d", scale=0, labels="supervoxels", scheduler="serial", progress=False)
    svs = np.unique(six.sv[six.sv != 0])
    assert rep.ok and rep.totals["bodies"] == len(svs)
    cv = CloudVolume(f"file://{tmp_path / 'd'}", progress=False)
    sv = int(svs[0])
    m = one_mesh(cv.mesh.get(sv), sv)
    assert W.is_watertight(m.vertices, m.faces)
    assert abs(W.enclosed_volume(m.vertices, m.faces) / ((six.sv == sv).sum() * RES.prod()) - 1) < 0.15


def test_into_a_convert_output(six, tmp_path):
    from dvidshards.jobs.convert import convert

    dest = tmp_path / "pre"
    assert convert(six.dataset(), dest, format="precomputed", progress=False).ok
    before = json.loads((dest / "info").read_text())
    rep = meshes(six.dataset(), dest, scheduler="serial", progress=False)
    assert rep.ok
    after = json.loads((dest / "info").read_text())
    assert after.pop("mesh") == "mesh" and after == before
    cv = CloudVolume(f"file://{dest}", progress=False, fill_missing=True)
    np.testing.assert_array_equal(cv[0:SHAPE[0], 0:SHAPE[1], 0:SHAPE[2]][..., 0], six.bodies)
    check_bodies(six, dest, scale=1)


def test_a_failed_shard_leaves_no_meshes_and_resume_finishes(six, tmp_path, run_cli, capsys):
    root = tmp_path / "exp"
    shutil.copytree(six.root, root)
    ds = dvidshards.Dataset(str(root), spec=six.spec)
    o = ds.shards(0)[1]
    path = root / "s0" / f"{o[0]}_{o[1]}_{o[2]}.arrow"
    good = path.read_bytes()
    path.write_bytes(good[:600])
    dest = tmp_path / "dest"
    one = ["--scale", "0", "--lods", "1"]
    assert run_cli(["meshes", str(root), str(dest), "--scheduler", "serial", "--quiet", *one]) == 1
    out = capsys.readouterr().out
    assert "INCOMPLETE" in out and "--resume" in out and f"{o[0]}_{o[1]}_{o[2]}.arrow" in out
    man = json.loads((dest / "mesh" / MANIFEST).read_text())
    assert man["complete"] is False and any(k.endswith(f"{o[0]}_{o[1]}_{o[2]}.arrow") for k in man["failed"])
    failed = len(man["failed"])  # the shard, and its - neighbours whose cells reach into it
    assert not (dest / "info").exists() and not (dest / "mesh" / "info").exists()  # nothing readers find
    assert not any(f.endswith(".shard") for f in os.listdir(dest / "mesh"))
    # without --resume or --overwrite the earlier output is refused
    assert run_cli(["meshes", str(root), str(dest), "--quiet", *one]) == 2
    assert "--resume" in capsys.readouterr().err
    with pytest.raises(JobError) as e:  # Python: the same failure raises, carrying the report
        meshes(dvidshards.Dataset(str(root), spec=six.spec), tmp_path / "py", scale=0, lods=1, scheduler="serial",
               progress=False)
    assert not e.value.report.ok and e.value.report.failed
    path.write_bytes(good)
    assert run_cli(["meshes", str(root), str(dest), "--scheduler", "serial", "--quiet", "--resume", *one]) == 0
    out = capsys.readouterr().out
    assert f"{len(ds.shards(0)) - failed} kept from an earlier run" in out
    assert json.loads((dest / "mesh" / MANIFEST).read_text())["complete"] is True
    check_bodies(six, dest)
    fresh = tmp_path / "fresh"
    assert meshes(ds, fresh, scale=0, lods=1, scheduler="serial", progress=False).ok
    assert tree(dest / "mesh", skip=MANIFEST) == tree(fresh / "mesh", skip=MANIFEST)
    # resuming a complete output does nothing; other parameters are refused
    assert run_cli(["meshes", str(root), str(dest), "--quiet", "--resume", *one]) == 0
    assert run_cli(["meshes", str(root), str(dest), "--quiet", "--resume", "--scale", "0", "--legacy"]) == 2
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
    assert "no dvidshards output" in capsys.readouterr().err
    assert run_cli(["meshes", six.root, str(foreign), "--quiet", "--overwrite", "--scheduler", "serial"]) == 0
    check_bodies(six, foreign, scale=1)
    for args in (["--scales", "x"], ["--legacy", "--scales", "0,1"], ["--lods", "0"], ["--resume", "--overwrite"],
                 ["--scheduler", "nonsense"]):
        assert run_cli(["meshes", six.root, str(tmp_path / "new"), "--quiet", *args]) == 2, args
    assert not (tmp_path / "new").exists()
    with pytest.raises(MeshesError):
        meshes(six.dataset(), tmp_path / "x", scales=(0, 1), lods=3)
    with pytest.raises(MeshesError):
        meshes(six.dataset(), tmp_path / "x", scales=(0,), scale=1)
    # a URL with a slash missing is refused in one line, and no local folder is made
    assert run_cli(["meshes", six.root, "gs:/bucket/m", "--quiet"]) == 2
    assert "gs:" not in os.listdir(".") and not os.path.exists("gs:")


@pytest.mark.slow
def test_into_a_bucket_with_its_work_folder_there(six, tmp_path):
    """meshes into s3:// (moto): the fragment files go to DEST.work in the bucket (the one rule), the
    mesh files equal a local run's byte for byte, and the work folder is empty once complete."""
    from tests.support.servers import MotoS3

    local = meshes(six.dataset(), tmp_path / "local", scale=0, lods=1, scheduler="serial", progress=False)
    with MotoS3() as s3:
        c = s3.bucket("meshes")
        url = f"s3://meshes/d?endpoint_override=127.0.0.1:{s3.port}&scheme=http&region={s3.REGION}"
        rep = meshes(six.dataset(), url, scale=0, lods=1, scheduler="threads:2", progress=False)
        keys = {o["Key"] for o in c.list_objects_v2(Bucket="meshes")["Contents"]}
        got = {k[len("d/mesh/"):]: c.get_object(Bucket="meshes", Key=k)["Body"].read() for k in keys
               if k.startswith("d/mesh/") and not k.endswith(MANIFEST)}
    assert local.ok and rep.ok and rep.totals["bodies"] == 6
    assert got == tree(tmp_path / "local" / "mesh", skip=MANIFEST)
    assert not [k for k in keys if k.startswith("d.work/")] and "d/info" in keys


def test_a_box_meshes_the_voxels_inside_it(six, tmp_path):
    box = [[40, 30, 20], [150, 120, 110]]
    rep = meshes(six.dataset(), tmp_path / "b", scale=0, lods=1, box=box, scheduler="serial", progress=False)
    vol = np.zeros_like(six.bodies)
    vol[40:150, 30:120, 20:110] = six.bodies[40:150, 30:120, 20:110]
    cv = CloudVolume(f"file://{tmp_path / 'b'}", progress=False)
    ids = [int(b) for b in np.unique(vol[vol != 0])]
    assert rep.ok and rep.totals["bodies"] == len(ids)
    for b in ids:
        m = one_mesh(cv.mesh.get(b), b)
        assert W.is_watertight(m.vertices, m.faces)
        v = m.vertices / RES
        assert (v.min(axis=0) >= np.array(box[0]) - 0.5).all() and (v.max(axis=0) <= np.array(box[1]) + 0.5).all()
        assert abs(W.enclosed_volume(m.vertices, m.faces) / ((vol == b).sum() * RES.prod()) - 1) < 0.05


@pytest.mark.slow
def test_on_a_local_dask_cluster(six, tmp_path):
    a = meshes(six.dataset(), tmp_path / "a", scheduler="local:2", progress=False)
    b = meshes(six.dataset(), tmp_path / "b", scheduler="serial", progress=False)
    assert a.ok and b.ok
    assert tree(tmp_path / "a" / "mesh", skip=MANIFEST) == tree(tmp_path / "b" / "mesh", skip=MANIFEST)


def test_regroup_levels_give_the_same_output(six, tmp_path, monkeypatch):
    job = importlib.import_module("dvidshards.jobs.meshes")  # the module (the package exports the function)

    monkeypatch.setattr(job, "FAN_IN", 2)  # 7 shard files -> 4 -> 2 files before the final tasks
    a = meshes(six.dataset(), tmp_path / "a", scale=0, scheduler="serial", progress=False)
    monkeypatch.setattr(job, "FAN_IN", 64)
    b = meshes(six.dataset(), tmp_path / "b", scale=0, scheduler="serial", progress=False)
    assert a.ok and b.ok and len(six.dataset().shards(0)) > 4
    assert tree(tmp_path / "a" / "mesh", skip=MANIFEST) == tree(tmp_path / "b" / "mesh", skip=MANIFEST)


def test_levels_of_detail_and_the_simplifier_bound(six, tmp_path):
    """scales and lods that disagree are refused in one line saying what to give; max_error_nm is
    the bound at level 0 in nm (voxels of its scale in the manifest); lods beyond the exported
    scales says which level is missing and why."""
    with pytest.raises(MeshesError, match=r"scale=0, lods=3 \(or scales=\(0, 1, 2\)\)"):
        meshes(six.dataset(), tmp_path / "a", scales=(0,), lods=3)
    with pytest.raises(TypeError, match="first_reduction"):  # no old spellings
        meshes(six.dataset(), tmp_path / "a", first_reduction=2)
    assert not (tmp_path / "a").exists()
    rep = meshes(six.dataset(), tmp_path / "b", scale=0, lods=1, cell_reduction=2, max_error_nm=16,
                 scheduler="serial", progress=False)
    params = json.loads((tmp_path / "b" / "mesh" / MANIFEST).read_text())["parameters"]
    assert rep.ok and params["cell_reduction"] == 2 and params["max_error_nm"] == 16
    assert params["max_error_voxels"] == 2.0  # 16 nm at 8 nm
    rep = meshes(six.dataset(), tmp_path / "d", scale=0, lods=3, scheduler="serial", progress=False)
    assert rep.ok and rep.scales == [0, 1] and any("2 of 3 levels of detail: s2 is not exported" in n
                                                   for n in rep.notes)


def test_workdir_is_the_folder_given_apart_from_the_output(six, tmp_path, run_cli, capsys):
    """--workdir holds the fragment files while the job runs (a failed run keeps them for --resume)
    and is emptied once the output is complete; one inside DEST's mesh folder is refused."""
    dest, work = tmp_path / "dest", tmp_path / "w"
    args = ["meshes", six.root, str(dest), "--scale", "0", "--lods", "1", "--quiet", "--scheduler", "serial"]
    assert run_cli([*args, "--workdir", str(dest / "mesh" / "w")]) == 2
    assert "work folder" in capsys.readouterr().err
    assert run_cli([*args, "--workdir", str(work)]) == 0
    assert not work.exists() and not (tmp_path / "dest.work").exists()
    assert json.loads((dest / "mesh" / MANIFEST).read_text())["command"].endswith(f"--workdir {work}")
    check_bodies(six, dest)


def test_a_connected_body_is_one_piece_corner_contacts_and_cavities_too(tmp_path):
    """cloud-volume's answer for each body (its fragments welded where they meet): one watertight
    piece for a body whose voxels meet only at a corner (across a chunk face: marching cubes alone
    leaves such voxels apart) and for a body enclosing another (its inner shell is dropped); a body
    in two separate parts is two closed pieces, still watertight; volumes within 15 %."""
    vol = np.zeros((130, 70, 70), np.uint64)
    vol[56:64, 20:28, 20:28] = 1  # body 1: two boxes meeting at one corner, across the chunk face x = 64
    vol[64:72, 28:36, 28:36] = 1
    vol[10:30, 40:60, 40:60] = 2  # body 2 encloses body 3
    vol[18:22, 48:52, 48:52] = 3
    vol[90:100, 10:20, 10:20] = 4  # body 4: two parts far apart
    vol[110:120, 40:50, 40:50] = 4
    spec = write_export(vol, str(tmp_path / "exp"), scales=1, resolution=(32, 32, 32))
    ds = dvidshards.Dataset(str(tmp_path / "exp"), spec=spec)
    assert meshes(ds, tmp_path / "m", scheduler="serial", progress=False).ok
    cv = CloudVolume(f"file://{tmp_path / 'm'}", progress=False)
    for b, parts in ((1, 1), (2, 1), (3, 1), (4, 2)):
        m = one_mesh(cv.mesh.get(b), b)
        assert W.is_watertight(m.vertices, m.faces) and pieces(m) == parts, b
        assert abs(W.enclosed_volume(m.vertices, m.faces) / ((vol == b).sum() * 32**3) - 1) < 0.15, b
