"""``dvidshards skeletons``: every body's skeleton from the export, read by cloud-volume and navis,
checked against each body's voxels (brute force) and kimimaro run on each whole body; the scale it
lacks made first; a body subset read from the label lists alone; refusals, failures and resume."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import dvidshards
from dvidshards import cli
from dvidshards.demo.neurons import neuron_volume
from dvidshards.errors import GeometryWarning, JobError, OutputError, SpecError
from dvidshards.formats.mapping import LabelMapping
from dvidshards.formats.skeleton import Skeleton
from dvidshards.jobs.downsample import downsample
from dvidshards.jobs.skeletons import DUST, SkeletonOutput, skeletons
from dvidshards.query import chunks_with
from dvidshards.writer import write_export

kimimaro = pytest.importorskip("kimimaro")
cc3d = pytest.importorskip("cc3d")
CloudVolume = pytest.importorskip("cloudvolume").CloudVolume

SHAPE = (512, 384, 64)  # at 32 nm: neurites of 2-4 voxels, 2 x 2 blocks of 256 voxels


class Neurons:
    def __init__(self, root: Path, resolution: float = 32.0, scales: int = 1, only: tuple | None = None):
        sv, self.mapping = neuron_volume(SHAPE, n_bodies=12, svs_per_body=2, seed=8)
        self.sv = np.array(sv)
        self.bodies = LabelMapping.from_any(self.mapping)(self.sv)
        self.root = str(root)
        self.spec = write_export(self.sv, self.root, mapping=self.mapping, scales=scales, shard_chunks=2,
                                 resolution=(resolution,) * 3, only_scales=only)
        self.ids = [int(b) for b in np.unique(self.bodies)[1:]]

    def dataset(self) -> dvidshards.Dataset:
        return dvidshards.Dataset(self.root, spec=self.spec)


@pytest.fixture(scope="module")
def neurons(tmp_path_factory) -> Neurons:
    return Neurons(tmp_path_factory.mktemp("neurons") / "exp")


@pytest.fixture(scope="module")
def output(neurons, tmp_path_factory):
    dest = tmp_path_factory.mktemp("skel") / "out"
    rep = skeletons(neurons.dataset(), dest, formats=("precomputed", "swc"), scheduler="threads:2", progress=False)
    return dest, rep


def check(vol: np.ndarray, b: int, sk: Skeleton, res: float, dust: int) -> None:
    """Brute force over the body's voxels: every vertex on one, one tree per 26-connected piece of more
    than ``dust`` voxels and none spanning two, no two vertices closer than half a voxel (a seam's
    vertex twice)."""
    from scipy.spatial import cKDTree

    mask = vol == b
    vox = np.floor(sk.vertices / res).astype(int)
    assert ((vox >= 0) & (vox < vol.shape)).all() and mask[tuple(vox.T)].all(), f"body {b}: a vertex off the body"
    assert not cKDTree(sk.vertices).query_pairs(0.5 * res), f"body {b}: two vertices within half a voxel"
    cc = cc3d.connected_components(mask, connectivity=26)
    piece = cc[tuple(vox.T)]
    trees = sk.components()
    assert all(len(np.unique(piece[trees == t])) == 1 for t in range(sk.trees)), f"body {b}: a tree spans pieces"
    sizes = np.bincount(cc.reshape(-1))
    big = set(np.flatnonzero(sizes > dust).tolist()) - {0}  # kimimaro keeps pieces over its dust_threshold
    assert big <= set(piece.tolist()) and len(set(piece.tolist())) == sk.trees, f"body {b}: a piece without its tree"


def whole_kimimaro(vol: np.ndarray, res: float) -> dict:
    """kimimaro on the whole volume, 0 outside it: each body at once, vertices in nm of ``vol``."""
    whole = kimimaro.skeletonize(np.asfortranarray(np.pad(vol, 1)), teasar_params={"scale": 4, "const": 500},
                                 anisotropy=(res,) * 3, dust_threshold=1000, progress=False)
    for w in whole.values():
        w.vertices -= np.float32(res)
    return whole


def close_to(ours: dict, whole: dict, *, total_within: float = 0.05, share: float = 0.8, worst: float = 0.3) -> None:
    """Cable length against kimimaro's on each whole body: the total within ``total_within``, a ``share``
    of the bodies within 10 % (TEASAR may grow or drop a branch where a block cuts a body: its
    invalidation ball, 4 radii + 500 nm, stops at the block's face; see formats' test), none beyond
    ``worst``."""
    rel = np.array([ours[b].cable_length / whole[b].cable_length() - 1 for b in whole])
    total = sum(ours[b].cable_length for b in whole) / sum(w.cable_length() for w in whole.values()) - 1
    assert abs(total) <= total_within and (np.abs(rel) <= 0.10).mean() >= share and np.abs(rel).max() <= worst, \
        (total, rel)


@pytest.mark.slow
def test_every_body_read_by_cloudvolume_is_one_tree_per_piece_close_to_kimimaro(neurons, output):
    dest, rep = output
    sizes = {b: int((neurons.bodies == b).sum()) for b in neurons.ids}
    big = [b for b in neurons.ids if sizes[b] > DUST]  # the others are dust: no skeleton
    assert rep.ok and rep.totals["bodies"] == len(big) < len(neurons.ids)
    cv = CloudVolume(f"file://{dest}", progress=False)
    reader = SkeletonOutput(dest)
    assert all(reader.get(b) is None for b in neurons.ids if sizes[b] <= DUST)
    ours = {}
    for b in big:
        got = cv.skeleton.get(b)  # cloud-volume's reader of the sharded output, radius attribute included
        sk = reader.get(b)
        assert sk is not None
        np.testing.assert_allclose(got.vertices, sk.vertices)
        np.testing.assert_array_equal(got.edges, sk.edges)
        np.testing.assert_allclose(got.radii, sk.radii)
        assert (sk.radii > 0).all() and sk.voxel_size == (32.0, 32.0, 32.0)
        check(neurons.bodies, b, sk, 32.0, dust=1000)
        ours[b] = sk
    close_to(ours, {b: w for b, w in whole_kimimaro(neurons.bodies, 32.0).items() if b in ours})
    man = json.loads((dest / "_dvidshards.json").read_text())
    assert man["complete"] and man["job"] == "skeletons" and man["scales"] == [0]


def test_swc_files_are_read_by_navis_and_equal_the_precomputed(neurons, output):
    navis = pytest.importorskip("navis")
    dest, _ = output
    pre = SkeletonOutput(dest)
    swc = SkeletonOutput(dest / "swc", voxel_size=(32, 32, 32))
    for b in sorted(int(p.stem) for p in (dest / "swc").iterdir())[:4]:
        text = (dest / "swc" / f"{b}.swc").read_text()
        assert text.startswith("#") and '"downresLevel": 0' in text
        n = navis.read_swc(str(dest / "swc" / f"{b}.swc"))
        a, c = pre.get(b), swc.get(b)
        assert a is not None and c is not None
        assert n.n_nodes == len(a.vertices) == len(c.vertices)
        assert abs(float(n.cable_length) * 32 - a.cable_length) < 1e-3 * a.cable_length  # scale-0 voxels of 32 nm
        assert abs(c.cable_length - a.cable_length) < 1e-3 * a.cable_length
    assert pre.get(1) is None and swc.get(1) is None
    with pytest.raises(SpecError):  # SWC in voxels of an unknown size: no silent guess
        SkeletonOutput(dest / "swc")


def test_a_body_subset_reads_only_blocks_whose_lists_hold_it(neurons, output, tmp_path, monkeypatch):
    ds = neurons.dataset()
    want = neurons.ids[:2]
    listed = tmp_path / "bodies.txt"
    listed.write_text(f"# two bodies\n{want[0]}\n{want[1]}\n")
    monkeypatch.setitem(cli.COMMANDS, "skeletons", ("dvidshards.jobs.skeletons:SkeletonsCommand", "skeletons"))
    dest = tmp_path / "sub"
    assert cli.main(["skeletons", neurons.root, str(dest), "--spec", str(_spec_file(neurons, tmp_path)),
                     "--bodies", str(listed), "--format", "swc-keys", "--quiet", "--scheduler", "serial"]) == 0
    names = sorted(p.name for p in (dest / "swc").iterdir())
    assert names == sorted(f"{b}_swc" for b in want)
    man = json.loads((dest / "_dvidshards.json").read_text())
    blocks = np.unique(chunks_with(ds, want, scale=0) // 4, axis=0)  # 4 chunks a block
    assert man["totals"]["blocks"] == len(blocks) < output[1].totals["blocks"]  # the others were never read
    full = SkeletonOutput(output[0])
    for b in want:  # the same skeletons as the run over every body
        a, c = full.get(b), Skeleton.from_swc((dest / "swc" / f"{b}_swc").read_text(), voxel_size=(32,) * 3)
        assert a is not None and abs(a.cable_length - c.cable_length) < 1e-3 * a.cable_length
    small = sorted(neurons.ids, key=lambda b: int((neurons.bodies == b).sum()))
    size = int((neurons.bodies == small[2]).sum())
    rep = skeletons(ds, tmp_path / "big", min_size=size, progress=False)
    assert rep.totals["bodies"] == sum(int((neurons.bodies == b).sum()) >= size for b in neurons.ids)
    big = SkeletonOutput(tmp_path / "big")
    assert big.get(small[0]) is None and big.get(small[-1]) is not None


def _spec_file(neurons: Neurons, folder: Path) -> Path:
    p = folder / "spec.json"
    p.write_text(json.dumps(neurons.spec))
    return p


def test_the_32nm_scale_is_made_by_downsample_when_the_export_lacks_it(tmp_path):
    s0 = Neurons(tmp_path / "s0only", resolution=8.0, scales=3, only=(0,))  # s0 only, at 8 nm: s2 is 32 nm
    rep = skeletons(s0.dataset(), tmp_path / "a", dust=20, progress=False)
    assert rep.scales == [2] and any("downsample" in n for n in rep.notes)
    assert not (tmp_path / "a.work").exists()  # the made scale went with the work folder
    downsample(s0.dataset(), tmp_path / "made", scales=[2], progress=False)  # the same scale, made beforehand
    ref = skeletons(dvidshards.Dataset([s0.root, str(tmp_path / "made")], spec=s0.spec), tmp_path / "b", dust=20,
                    progress=False)
    assert rep.totals["bodies"] == ref.totals["bodies"] > 0 and not any("downsample" in n for n in ref.notes)
    a, b = SkeletonOutput(tmp_path / "a"), SkeletonOutput(tmp_path / "b")
    for i in s0.ids:
        x, y = a.get(i), b.get(i)
        assert (x is None) == (y is None)
        if x is not None and y is not None:
            np.testing.assert_allclose(x.vertices, y.vertices)
            assert x.voxel_size == (8.0, 8.0, 8.0)  # SWC in scale-0 voxels of 8 nm


def test_refusals_before_any_work(neurons, tmp_path):
    ds = neurons.dataset()
    for kw in ({"formats": ("obj",)}, {"formats": ()}, {"block": 3}, {"dust": -1}, {"heal_nm": 0}, {"bodies": []},
               {"bodies": [0]}, {"scale": 5}):
        with pytest.raises(SpecError):
            skeletons(ds, tmp_path / "x", progress=False, **kw)
    with pytest.warns(GeometryWarning), pytest.raises(SpecError):  # no spec: no nm
        skeletons(neurons.root, tmp_path / "x", progress=False)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    with pytest.raises(OutputError):
        skeletons(ds, tmp_path / "full", progress=False)
    assert not (tmp_path / "x").exists()


def test_a_failed_shard_leaves_no_skeletons_and_resume_finishes(neurons, tmp_path):
    root = tmp_path / "exp"
    spec = write_export(neurons.sv, str(root), mapping=neurons.mapping, shard_chunks=1, resolution=(32,) * 3)
    ds = dvidshards.Dataset(str(root), spec=spec)
    o = ds.shards(0)[len(ds.shards(0)) // 2]
    path = root / "s0" / f"{o[0]}_{o[1]}_{o[2]}.arrow"
    good = path.read_bytes()
    path.write_bytes(good[:500])
    dest, kw = tmp_path / "out", {"formats": ("precomputed", "swc"), "block": 1, "scheduler": "serial",
                                  "progress": False}
    with pytest.raises(JobError) as e:
        skeletons(ds, dest, **kw)
    assert any(f"{o[0]}_{o[1]}_{o[2]}.arrow" in k for k in e.value.report.failed)
    assert len(e.value.report.failed) < e.value.report.tasks  # the others kept their pieces
    assert not (dest / "info").exists() and not (dest / "skeletons").exists() and not (dest / "swc").exists()
    with pytest.raises(OutputError):  # neither resume nor overwrite
        skeletons(ds, dest, **kw)
    path.write_bytes(good)
    rep = skeletons(dvidshards.Dataset(str(root), spec=spec), dest, resume=True, **kw)
    assert rep.ok and rep.skipped > 0
    fresh = skeletons(dvidshards.Dataset(str(root), spec=spec), tmp_path / "fresh", **kw)
    assert sorted(p.name for p in (dest / "swc").iterdir()) == sorted(p.name for p in (tmp_path / "fresh" / "swc").iterdir())
    assert sorted(p.read_bytes() for p in (dest / "skeletons").iterdir()) == \
        sorted(p.read_bytes() for p in (tmp_path / "fresh" / "skeletons").iterdir())
    again = skeletons(ds, dest, resume=True, **kw)
    assert again.ok and "already complete" in again.notes and fresh.totals["bodies"] == again.totals["bodies"]
    with pytest.raises(OutputError):  # other parameters
        skeletons(ds, dest, resume=True, **{**kw, "formats": ("swc",)})


@pytest.mark.slow
def test_the_real_mcns_shard_bodies_at_32nm(real_export, tmp_path):
    """The real shard (s1, 16 nm): s2 made first; every body's skeleton checked against its voxels; the
    largest body's made on demand is the job's."""
    root, spec = real_export
    ds = dvidshards.Dataset(str(root), spec=spec)
    rep = skeletons(ds, tmp_path / "out", progress=False)
    assert rep.ok and rep.scales == [2] and rep.totals["bodies"] > 20
    reader = SkeletonOutput(tmp_path / "out")
    from dvidshards.jobs.downsample import downsample

    downsample(ds, tmp_path / "s2", scales=[2], progress=False)
    s2 = dvidshards.Dataset(str(root), spec=spec).with_scales(str(tmp_path / "s2"), [2])
    c = s2.chunks(2)
    lo, hi = c.min(axis=0) * 64, (c.max(axis=0) + 1) * 64
    vol = s2.read([lo.tolist(), hi.tolist()], scale=2)
    whole = whole_kimimaro(vol, 32.0)
    ours = {}
    for b in whole:
        sk = reader.get(b)
        assert sk is not None
        ours[b] = Skeleton(sk.vertices - lo * 32, sk.edges, sk.radii)
        check(vol, b, ours[b], 32.0, dust=1000)
    close_to(ours, whole, worst=1.5)  # real bodies: a branch more or less can double a short body (3 % in total)
    ids, n = np.unique(vol[vol > 0], return_counts=True)
    b = int(ids[np.argmax(n)])
    same_skeleton(ds.body(b).skeleton(), reader.get(b))  # on demand, s2 made from s1: the job's skeleton


@pytest.mark.slow
def test_into_a_bucket_with_its_work_folder_there(neurons, output):
    """skeletons into s3:// (moto): partial files in DEST.work in the bucket, the output equals a local
    run's byte for byte, the work folder is empty once complete, and one body reads back from there."""
    from tests.support.servers import MotoS3

    local, _ = output
    with MotoS3() as s3:
        c = s3.bucket("skel")
        url = f"s3://skel/d?endpoint_override=127.0.0.1:{s3.port}&scheme=http&region={s3.REGION}"
        rep = skeletons(neurons.dataset(), url, formats=("precomputed", "swc"), scheduler="threads:2", progress=False)
        keys = {o["Key"] for o in c.list_objects_v2(Bucket="skel")["Contents"]}
        got = {k[2:]: c.get_object(Bucket="skel", Key=k)["Body"].read() for k in keys
               if k.startswith("d/") and not k.endswith(".json") and not k.endswith(".lock")}
        b = int(next(k for k in got if k.startswith("swc/"))[4:-4])
        remote = SkeletonOutput(url).get(b)
    assert rep.ok and not [k for k in keys if k.startswith("d.work/") and not k.endswith(".lock")]
    want = {str(p.relative_to(local)): p.read_bytes() for p in local.rglob("*") if p.is_file()
            and p.name != "_dvidshards.json"}
    assert got == want
    here = SkeletonOutput(local).get(b)
    assert remote is not None and here is not None and np.array_equal(remote.vertices, here.vertices)


def same_skeleton(sk: Skeleton, ref: Skeleton | None) -> None:
    """The same skeleton node for node: the same vertices, edges and radii, in any order."""
    assert ref is not None and sk.voxel_size == ref.voxel_size
    at = {tuple(v): i for i, v in enumerate(ref.vertices.tolist())}
    idx = np.array([at[tuple(v)] for v in sk.vertices.tolist()])  # every vertex is one of the job's
    assert len(set(idx.tolist())) == len(ref.vertices) == len(sk.vertices)
    assert {frozenset(e) for e in idx[sk.edges].tolist()} == {frozenset(e) for e in ref.edges.tolist()}
    np.testing.assert_allclose(sk.radii, ref.radii[idx])


@pytest.mark.slow
def test_one_body_on_demand_equals_the_job(neurons, output, tmp_path, monkeypatch):
    """Body.skeleton (its chunks from the records' lists, decoded one at a time) is the job's skeleton of
    that body node for node, its SWC read by navis; an absent body, a body of dust only, a scale the
    export lacks and a missing kimimaro are refused, each naming why."""
    import sys

    from dvidshards.errors import NotExportedError, NotFoundError
    from dvidshards.formats.skeleton import SkeletonDependencyError

    navis = pytest.importorskip("navis")
    ds = neurons.dataset()
    job = SkeletonOutput(output[0])
    sizes = {b: int((neurons.bodies == b).sum()) for b in neurons.ids}
    for b in sorted(neurons.ids, key=lambda i: -sizes[i])[:3]:
        sk = ds.body(b).skeleton()
        same_skeleton(sk, job.get(b))
        assert sk.voxel_size == (32.0, 32.0, 32.0)
        (tmp_path / f"{b}.swc").write_text(sk.swc())
        n = navis.read_swc(str(tmp_path / f"{b}.swc"))
        assert n.n_nodes == len(sk.vertices) and abs(float(n.cable_length) * 32 - sk.cable_length) < 1e-3 * sk.cable_length
    with pytest.raises(NotFoundError, match="987654321"):
        ds.body(987654321).skeleton()
    dust = min(neurons.ids, key=lambda i: sizes[i])
    assert sizes[dust] <= DUST
    with pytest.raises(NotFoundError, match=f"over {DUST} voxels"):
        ds.body(dust).skeleton()
    with pytest.raises(NotExportedError, match="finer than its finest"):  # nothing to make it from
        Neurons(tmp_path / "s1", scales=2, only=(1,)).dataset().body(neurons.ids[0]).skeleton(scale=0)
    monkeypatch.setitem(sys.modules, "kimimaro", None)  # as if not installed
    with pytest.raises(SkeletonDependencyError, match=r"dvidshards\[skeleton\]"):
        ds.body(neurons.ids[0]).skeleton()



def fat_tubes(shape=(512, 192, 64), seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """Three tubes 18 to 26 voxels thick wandering across x, two supervoxels each (cut at mid x), and
    their (supervoxel, body) rows: bodies of a few thousand voxels at scale 2, over ``DUST``."""
    rng = np.random.default_rng(seed)
    vol = np.zeros(shape, np.uint64, order="F")
    g = np.asarray(shape)
    rows = []
    for n in range(3):
        body = 100 + n
        knots = np.column_stack([np.linspace(-10, g[0] + 10, 6), rng.uniform(30, g[1] - 30, 6),
                                 rng.uniform(20, g[2] - 20, 6)])
        r = float(rng.uniform(9, 13))
        for t in np.linspace(0, 5, 400):
            i = min(int(t), 4)
            p = knots[i] + (t - i) * (knots[i + 1] - knots[i])
            lo, hi = np.maximum(np.floor(p - r), 0).astype(int), np.minimum(np.ceil(p + r) + 1, g).astype(int)
            if (hi <= lo).any():
                continue
            x, y, z = np.ogrid[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]]
            inside = (x - p[0]) ** 2 + (y - p[1]) ** 2 + (z - p[2]) ** 2 <= r * r
            cut = vol[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]]
            sv = np.where(x >= g[0] // 2, 2 * body + 1, 2 * body).astype(np.uint64)
            cut[inside & (cut == 0)] = np.broadcast_to(sv, inside.shape)[inside & (cut == 0)]  # the first keeps it
        rows += [(2 * body, body), (2 * body + 1, body)]
    return vol, np.array(rows, np.uint64)


def test_a_body_of_an_export_holding_only_scale_0_is_skeletonized_at_the_made_32nm_scale(tmp_path, caplog,
                                                                                            monkeypatch):
    """On an export of 8 nm holding only s0 (as DVID exports), ``Body.skeleton()`` is the skeleton the
    job makes at s2 (which it makes by downsample), node for node, and says it made s2 from s0; a body
    that would need too many chunks made is refused naming downsample."""
    import logging

    from dvidshards import bodies
    from dvidshards.errors import NotExportedError

    vol, rows = fat_tubes()
    spec = write_export(vol, tmp_path / "exp", mapping=rows, scales=3, shard_chunks=2, resolution=(8.0,) * 3,
                        only_scales=(0,))
    ds = dvidshards.Dataset(str(tmp_path / "exp"), spec=spec)
    assert ds.exported == (0,)
    rep = skeletons(ds, tmp_path / "job", progress=False)
    job = SkeletonOutput(tmp_path / "job")
    ids = sorted({int(b) for b in rows[:, 1]})
    assert rep.scales == [2] and rep.totals["bodies"] == len(ids)
    for b in ids:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="dvidshards.bodies"):
            sk = ds.body(b).skeleton()
        same_skeleton(sk, job.get(b))
        assert sk.voxel_size == (8.0, 8.0, 8.0)  # SWC in scale-0 voxels
        assert f"body {b}: scale 2 is not in the export: made from" in caplog.text and "of scale 0" in caplog.text
    same_skeleton(ds.body(ids[0]).skeleton(scale=2), job.get(ids[0]))  # asked for by number: the same
    monkeypatch.setattr(bodies, "MADE_BODY_CHUNKS", len(ds.body(ids[0]).chunks(0)) - 1)
    with pytest.raises(NotExportedError, match="dvidshards downsample"):
        ds.body(ids[0]).skeleton()


@pytest.mark.slow
def test_the_demo_volume_at_32nm_with_a_seam_every_chunk(tmp_path):
    """The demo's export (``dvidshards demo``: 8 nm, its pyramid made by downsample) at its s2 (32 nm,
    128 x 112 x 64): in the default blocks (one block) kimimaro's own skeletons; in blocks of one chunk
    every body crosses seams, each checked against its voxels and kimimaro on the whole volume (at
    neurites of 1-2 voxels a 64-voxel block cuts TEASAR's 500 nm ball often: 9 % more cable in total)."""
    from dvidshards.demo import DEFAULT_SIZE, run_demo

    got = run_demo(str(tmp_path / "demo"), size=DEFAULT_SIZE, echo=lambda *a: None)
    ds = dvidshards.Dataset([got["export"], got["pyramid"]], spec=got["spec"])
    s = ds.scale(2)
    vol = ds.read([[0, 0, 0], list(s.size)], scale=2)
    whole = whole_kimimaro(vol, 32.0)
    for block, limits in ((4, {"total_within": 1e-4, "share": 1.0, "worst": 1e-4}),
                          (1, {"total_within": 0.10, "share": 0.6, "worst": 1.0})):
        rep = skeletons(ds, tmp_path / f"out{block}", block=block, progress=False)
        assert rep.ok and rep.scales == [2] and rep.totals["bodies"] == len(whole) >= 20
        reader = SkeletonOutput(tmp_path / f"out{block}")
        ours = {}
        for b in whole:
            sk = reader.get(b)
            assert sk is not None
            check(vol, b, sk, 32.0, dust=DUST)
            ours[b] = sk
        close_to(ours, whole, **limits)
