"""Body: chunks, size, box, mask, sparsevol and mesh of one body, against brute force over the
volumes the export was written from, and sparsevol bytes against a reference encoder written
the way DVID's Go code walks blocks (independent of ``formats.sparsevol``)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import dvidshards
from dvidshards import cli
from dvidshards.bodies import Body, chunk_decoder
from dvidshards.errors import MissingShardError, NotFoundError, SpecError
from dvidshards.formats import mesh as M
from dvidshards.jobs.labelindex import label_index
from tests.support import watertight as W
from tests.support.data import REAL_SHARD
from tests.support.exports import make_export
from tests.support.sparsevol import decode, mask_from_runs, reference_coarse, reference_rles

pytest.importorskip("zmesh")


@pytest.fixture(scope="module")
def exp(tmp_path_factory):
    e = make_export(tmp_path_factory.mktemp("bodies") / "exp", shape=(200, 170, 150), seed=7, scales=2,
                    resolution=(8, 8, 16))
    with open(os.path.join(e.root, "info"), "w") as f:
        json.dump(e.spec, f)
    return e


@pytest.fixture(scope="module")
def ds(exp):
    return dvidshards.Dataset(exp.root)


def _mapping(exp):
    svs = np.unique(exp.scales[0])
    svs = svs[svs != 0]
    return {int(s): 5000 + int(s) % 5 for s in svs[1::2]}


def _some_ids(vol, n=4):
    ids, counts = np.unique(vol[vol != 0], return_counts=True)
    order = np.argsort(counts)
    pick = order[np.linspace(0, len(order) - 1, n).astype(int)]  # small to large
    return [int(v) for v in ids[pick]]


def _a_supervoxel_of_another_body(exp):
    vol, sv = exp.expected(0), exp.expected(0, "supervoxels")
    pairs = np.unique(np.stack([sv[vol > 0], vol[vol > 0]], axis=1), axis=0)
    s, b = next(p for p in pairs if p[0] != p[1] and not (vol == p[0]).any())
    return int(s), int(b)


def _brute(vol, b):
    m = vol == b
    idx = np.argwhere(m)
    lo, hi = idx.min(axis=0), idx.max(axis=0) + 1
    return int(m.sum()), [lo.tolist(), hi.tolist()], m[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]]


def test_size_box_mask_equal_brute_force(exp, ds):
    for scale in (0, 1):
        for labels in ("agglomerated", "supervoxels", _mapping(exp)):
            vol = exp.expected(scale, labels)
            for b in _some_ids(vol, 3):
                body = Body(ds, b, scale=scale, labels=labels)
                size, box, mask = _brute(vol, b)
                assert body.size() == size
                assert body.box() == box
                got = body.mask()
                assert got.box == box
                np.testing.assert_array_equal(got.mask, mask)
                chunks = {tuple(c) for c in (np.argwhere(vol == b) // 64).tolist()}
                assert {tuple(c) for c in body.chunks().tolist()} == chunks


def test_label_index_answers_the_same(exp, ds, tmp_path):
    vol = exp.expected(0)
    label_index(ds, tmp_path / "idx", scale=0, scheduler="serial")
    for b in _some_ids(vol, 4):
        plain, indexed = Body(ds, b), Body(ds, b, index=tmp_path / "idx")
        np.testing.assert_array_equal(indexed.chunks(), plain.chunks())
        assert indexed.size() == plain.size() == int((vol == b).sum())
        assert indexed.box() == plain.box()
        np.testing.assert_array_equal(indexed.supervoxels(), plain.supervoxels())
        np.testing.assert_array_equal(indexed.supervoxels(), np.unique(exp.sv[vol == b]))
        assert indexed.sparsevol() == plain.sparsevol()
    with pytest.raises(SpecError, match="labels"):  # bodies of another mapping are not the index's bodies
        Body(ds, 1, labels={1: 2}, index=tmp_path / "idx")


# --------------------------------------------------------------------------- sparsevol


def test_reference_encoder_agrees_with_the_naive_one():
    from tests.support.sparsevol import naive_dvid_bytes, random_body

    rng = np.random.default_rng(5)
    for offset, block in (((3, 70, 5), 8), ((-9, 0, 17), 16)):
        m = random_body(rng, (40, 21, 19))
        assert reference_rles(m, offset, block) == naive_dvid_bytes(m, offset, block)


def test_sparsevol_bytes_equal_the_reference(exp, ds):
    for labels in ("agglomerated", "supervoxels"):
        vol = exp.expected(0, labels)
        for b in _some_ids(vol, 3):
            body = Body(ds, b, labels=labels)
            _, box, mask = _brute(vol, b)
            got = body.sparsevol()
            assert got == reference_rles(mask, box[0])
            assert body.sparsevol_coarse() == reference_coarse(mask, box[0])
            runs = decode(body.sparsevol(order="zyx"))
            np.testing.assert_array_equal(mask_from_runs(runs, *box), mask)
            assert int(decode(got)[:, 3].sum()) == body.size()
    vol = exp.expected(1)
    b = _some_ids(vol, 1)[0]
    _, box, mask = _brute(vol, b)
    assert Body(ds, b, scale=0).sparsevol(scale=1) == reference_rles(mask, box[0])


@pytest.fixture(scope="module")
def real_ds(dvid_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("realbody")
    (root / "s1").mkdir()
    (root / "s1" / f"{REAL_SHARD}.arrow").symlink_to(dvid_data / f"{REAL_SHARD}.arrow")
    (root / "s1" / f"{REAL_SHARD}.csv").symlink_to(dvid_data / f"{REAL_SHARD}-newformat.csv")
    spec = json.loads((dvid_data / "mcns-ng-specs.json").read_text())
    return dvidshards.Dataset(str(root), spec=spec)


def test_sparsevol_of_a_real_body(real_ds):
    body = Body(real_ds, 1538452683, scale=1)  # 22 chunks of the real shard, runs across block faces
    c = body.chunks()
    assert len(c) == 22
    lo, hi = c.min(axis=0) * 64, (c.max(axis=0) + 1) * 64
    vol = real_ds.open(1)[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]].read(order="F").result()  # TensorStore
    mask = vol == np.uint64(body.id)
    idx = np.argwhere(mask)
    assert body.size() == int(mask.sum())
    assert body.box() == [(idx.min(axis=0) + lo).tolist(), (idx.max(axis=0) + 1 + lo).tolist()]
    got = body.sparsevol()
    assert got == reference_rles(mask, lo)
    assert body.sparsevol_coarse() == reference_coarse(mask, lo)
    runs = decode(got)
    assert (runs[:, 3] > 1).any() and ((runs[:, 0] % 64) + runs[:, 3] > 64).any()  # runs cross block faces


# --------------------------------------------------------------------------- meshes


def test_mesh_is_one_closed_surface_in_nm(exp, ds):
    vol = exp.expected(0)
    res = np.array([8.0, 8.0, 16.0])
    for b in _some_ids(vol, 3):
        body = Body(ds, b)
        m = body.mesh()
        assert W.is_watertight(m.vertices, m.faces)
        size, box, _ = _brute(vol, b)
        assert abs(W.enclosed_volume(m.vertices, m.faces) / (size * res.prod()) - 1) < 0.05
        v = m.vertices / res
        assert (v.min(axis=0) >= np.array(box[0])).all() and (v.max(axis=0) <= np.array(box[1])).all()
        coarse = body.mesh(1, units="voxels")
        assert W.is_watertight(coarse.vertices, coarse.faces) and len(coarse.faces) < len(m.faces)
        simple = body.mesh(reduction_factor=4, max_error=2)
        assert W.is_watertight(simple.vertices, simple.faces) and len(simple.faces) < len(m.faces)


def test_chunk_decoder_matches_the_bulk_reader(exp, ds):
    decode = chunk_decoder(ds, 0, fill_missing_shards=True)
    vol = exp.expected(0)
    for c in [(0, 0, 0), (3, 2, 2), (1, 1, 1), (3, 1, 0)]:  # partial edge chunks; (3, 2, 2) in no shard
        a = decode(c)
        want = np.zeros((64, 64, 64), np.uint64)
        part = vol[c[0] * 64:(c[0] + 1) * 64, c[1] * 64:(c[1] + 1) * 64, c[2] * 64:(c[2] + 1) * 64]
        want[:part.shape[2], :part.shape[1], :part.shape[0]] = part.T
        if a is None:
            assert not want.any()
        else:
            np.testing.assert_array_equal(a, want)
    assert decode((-1, 0, 0)) is None and decode((4, 0, 0)) is None
    with pytest.raises(MissingShardError):
        chunk_decoder(ds, 0)((3, 2, 2))


def test_bad_ids_and_absent_bodies(ds):
    for bad in (0, -1, 2**64, 1.5, "7", True):
        with pytest.raises(SpecError):
            Body(ds, bad)
    body = Body(ds, 123456789)  # no such body
    assert not body.exists() and len(body.chunks(missing_ok=True)) == 0
    for ask in (body.chunks, body.size, body.box, body.mask, body.runs, body.sparsevol,
                body.sparsevol_coarse, body.supervoxels, body.mesh, lambda: body.size(1), lambda: body.chunks(1)):
        with pytest.raises(NotFoundError, match="123456789 is not in this export at scale"):
            ask()
    assert len(body.mesh(chunks=[[0, 0, 0]]).faces) == 0  # chunks given: an empty mesh, as the viewer asks
    assert not issubclass(NotFoundError, SpecError)


def test_a_supervoxel_passed_as_a_body_is_named(exp, ds, tmp_path):
    """A supervoxel id as a body once said size 0, box None, then SpecError."""
    vol, sv = exp.expected(0), exp.expected(0, "supervoxels")
    pairs = np.unique(np.stack([sv[vol > 0], vol[vol > 0]], axis=1), axis=0)
    s, b = (int(v) for v in next(p for p in pairs if p[0] != p[1] and not (vol == p[0]).any()))
    body = Body(ds, s)
    assert not body.exists()
    for ask in (body.size, body.box, body.sparsevol, body.chunks):
        with pytest.raises(NotFoundError, match=f"{s} is a supervoxel of body {b} at scale 0"):
            ask()
    assert Body(ds, s, labels="supervoxels").size() == int((sv == s).sum())
    small = np.zeros((70, 64, 64), np.uint64)  # bodies whose ids are no supervoxel's
    small[:40], small[40:] = 11, 12
    from dvidshards.writer import write_export

    write_export(small, tmp_path / "small", mapping={11: 900, 12: 900})
    other = dvidshards.Dataset(str(tmp_path / "small"))
    assert Body(other, 900).size() == small.size
    with pytest.raises(NotFoundError, match="900 is a body at scale 0, not a supervoxel"):
        Body(other, 900, labels="supervoxels").size()
    with pytest.raises(NotFoundError, match="11 is a supervoxel of body 900 at scale 0"):
        Body(other, 11).box()
    label_index(ds, tmp_path / "idx", scale=0, scheduler="serial")
    indexed = Body(ds, s, index=tmp_path / "idx")
    assert not indexed.exists()  # from the index's rows: no scan
    with pytest.raises(NotFoundError, match="not in the label index"):
        indexed.sparsevol()
    with pytest.raises(NotFoundError, match=f"{s} is a supervoxel of body {b}"):
        ds.body(s).size()


def test_index_of_scale_0_finds_the_chunks_of_scale_1(exp, ds, tmp_path, monkeypatch):
    """A scale-0 label index gives a coarser scale's chunks without a scan: its blocks coarsened,
    kept where the records' lists hold the body (what DVID does with its scale-0 index)."""
    import dvidshards.bodies as B

    label_index(ds, tmp_path / "idx", scale=0, scheduler="serial")
    vol1 = exp.expected(1)
    for b in _some_ids(vol1, 4):
        plain = Body(ds, b, scale=1)
        want, rles = plain.chunks(), plain.sparsevol()
        with monkeypatch.context() as m:
            m.setattr(B, "chunks_with", lambda *a, **k: pytest.fail("scanned the lists"))
            body = Body(ds, b, scale=1, index=tmp_path / "idx")
            np.testing.assert_array_equal(body.chunks(), want)
            assert body.size() == int((vol1 == b).sum())
            assert body.sparsevol() == rles


# --------------------------------------------------------------------------- command line


@pytest.fixture
def body_cli(monkeypatch):
    monkeypatch.setitem(cli.COMMANDS, "body", ("dvidshards.cli:BodyCommand", "one body"))
    return cli.main


def _read_ply(data: bytes) -> M.Mesh:
    head, _, rest = data.partition(b"end_header\n")
    lines = head.decode().splitlines()
    nv = int(next(x for x in lines if x.startswith("element vertex")).split()[-1])
    nf = int(next(x for x in lines if x.startswith("element face")).split()[-1])
    v = np.frombuffer(rest, "<f4", 3 * nv).reshape(nv, 3)
    f = np.frombuffer(rest, np.dtype([("n", "u1"), ("v", "<u4", (3,))]), nf, 12 * nv)
    assert (f["n"] == 3).all()
    return M.Mesh(v, f["v"])


def test_body_command(exp, ds, tmp_path, body_cli, capsys):
    vol = exp.expected(0)
    b = _some_ids(vol, 1)[0]
    rle, ply, obj = tmp_path / "b.rle", tmp_path / "b.ply", tmp_path / "b.obj"
    assert body_cli(["body", exp.root, str(b), "--size", "--box", "--sparsevol", str(rle), "--mesh", str(ply)]) == 0
    facts = json.loads(capsys.readouterr().out)
    size, box, mask = _brute(vol, b)
    assert facts["size"] == size and facts["box"] == box
    assert rle.read_bytes() == reference_rles(mask, box[0])
    m = _read_ply(ply.read_bytes())
    assert W.is_watertight(m.vertices, m.faces) and len(m.faces) == facts["mesh"]["faces"]
    assert body_cli(["body", exp.root, str(b), "--mesh", str(obj), "--labels", "agglomerated"]) == 0
    text = obj.read_text().splitlines()
    assert sum(x.startswith("v ") for x in text) == len(m.vertices)
    assert sum(x.startswith("f ") for x in text) == len(m.faces)
    capsys.readouterr()
    assert body_cli(["body", exp.root, "123456789"]) == 2  # absent: a bad id, one line
    assert "NotFoundError: 123456789 is not in this export at scale 0" in capsys.readouterr().err
    sv, b = _a_supervoxel_of_another_body(exp)
    assert body_cli(["body", exp.root, str(sv), "--size"]) == 2
    err = capsys.readouterr().err
    assert f"{sv} is a supervoxel of body {b}" in err and len(err.strip().splitlines()) == 1
    assert body_cli(["body", exp.root, str(b), "--mesh", str(tmp_path / "b.stl")]) == 2
    assert ".ply or .obj" in capsys.readouterr().err
    assert body_cli(["body", exp.root, "abc"]) == 2
    assert not (tmp_path / "b.stl").exists()


def test_body_options_are_keywords_and_its_answers_methods(ds, exp):
    b = _some_ids(exp.expected(0), 1)[0]
    for positional in (lambda: Body(ds, b, 0), lambda: Body(ds, b).sparsevol(0, "zyx"),
                       lambda: Body(ds, b).sparsevol_coarse(0, None), lambda: Body(ds, b).chunks(0, True)):
        with pytest.raises(TypeError, match="positional argument"):
            positional()
    assert not [k for k, v in vars(Body).items() if isinstance(v, property)]  # a property never reads
