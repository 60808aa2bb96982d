"""body_stats and label_index vs brute force over the written volumes, serial and on dask."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest

import dvidshards
from dvidshards.errors import SpecError
from dvidshards.formats.codec import decode_block
from dvidshards.formats.labelindex import bucket_of
from dvidshards.jobs.stats import (
    INDEX_SCHEMA,
    STATS_SCHEMA,
    body_stats,
    label_index,
    shard_body_stats,
    shard_label_index,
)
from tests.conftest import REAL_SHARD, make_export

# --------------------------------------------------------------------------- brute force


def unique_pairs(a: np.ndarray, b: np.ndarray):
    """Distinct (a, b) pairs sorted, with their counts (np.unique(axis=0) is very slow)."""
    o = np.lexsort((b, a))
    a, b = a[o], b[o]
    starts = np.flatnonzero(np.r_[True, (a[1:] != a[:-1]) | (b[1:] != b[:-1])])
    return a[starts], b[starts], np.diff(np.r_[starts, len(a)])


def brute_stats(body: np.ndarray, sv: np.ndarray, offset=(0, 0, 0), chunk=64) -> dict:
    """{label: (voxels, supervoxels, chunks, box)} of an (x, y, z) volume, label 0 left out."""
    flat = body.ravel()
    order = np.argsort(flat, kind="stable")
    lab = flat[order]
    starts = np.flatnonzero(np.r_[True, lab[1:] != lab[:-1]])
    xyz = np.stack(np.unravel_index(order, body.shape), axis=1) + np.asarray(offset)
    lo = np.minimum.reduceat(xyz, starts, axis=0)
    hi = np.maximum.reduceat(xyz, starts, axis=0) + 1
    voxels = np.diff(np.r_[starts, len(lab)])
    pb, _, _ = unique_pairs(flat, sv.ravel())
    nsv = dict(zip(*np.unique(pb, return_counts=True), strict=True))
    cid = xyz // chunk
    key = (cid[:, 0] * 100_003 + cid[:, 1]) * 100_003 + cid[:, 2]
    cb, _, _ = unique_pairs(lab, key.astype(np.uint64))
    nch = dict(zip(*np.unique(cb, return_counts=True), strict=True))
    out = {}
    for k, s in enumerate(starts):
        lb = int(lab[s])
        if lb:
            out[lb] = (int(voxels[k]), int(nsv[lb]), int(nch[lb]), tuple(lo[k].tolist() + hi[k].tolist()))
    return out


def as_dict(t) -> dict:
    d = t.to_pydict()
    return {d["label"][i]: (d["voxels"][i], d["supervoxels"][i], d["chunks"][i],
                            tuple(d[c][i] for c in ("x0", "y0", "z0", "x1", "y1", "z1")))
            for i in range(t.num_rows)}


def check_sorted(t):
    assert t.schema.remove_metadata() == STATS_SCHEMA
    v = t["voxels"].to_numpy()
    assert (np.diff(v) <= 0).all()


def brute_index(body, sv, chunk=64) -> set:
    """{(body, sv, cx, cy, cz, voxels)} of (x, y, z) volumes."""
    rows = set()
    nx, ny, nz = (-(-n // chunk) for n in body.shape)
    for cx in range(nx):
        for cy in range(ny):
            for cz in range(nz):
                sl = np.s_[cx * chunk:(cx + 1) * chunk, cy * chunk:(cy + 1) * chunk, cz * chunk:(cz + 1) * chunk]
                pb, ps, n = unique_pairs(body[sl].ravel(), sv[sl].ravel())
                rows |= {(int(b), int(s), cx, cy, cz, int(c)) for b, s, c in zip(pb, ps, n, strict=True) if b}
    return rows


def read_index(out) -> set:
    t = pq.read_table(out)  # the whole hive-partitioned dataset
    d = t.to_pydict()
    return set(zip(d["body"], d["supervoxel"], d["chunk_x"], d["chunk_y"], d["chunk_z"], d["voxels"],
                   strict=False))


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def exp(tmp_path_factory):
    e = make_export(tmp_path_factory.mktemp("stats") / "exp", shape=(200, 170, 150), seed=5, scales=2)
    with open(os.path.join(e.root, "info"), "w") as f:  # exact geometry, no GeometryWarning
        json.dump(e.spec, f)
    return e


@pytest.fixture(scope="module")
def client():
    distributed = pytest.importorskip("distributed")
    from dvidshards.jobs.runner import _connect

    c, cluster, _ = _connect("local:2")
    assert isinstance(c, distributed.Client)
    yield c
    c.close()
    cluster.close()


# --------------------------------------------------------------------------- body_stats


@pytest.mark.parametrize("scale", [0, 1])
@pytest.mark.parametrize("labels", ["agglomerated", "supervoxels", "mapped"])
def test_body_stats_equal_brute_force(exp, scale, labels):
    mapping = None
    if labels == "mapped":  # merge pairs of bodies, leave some supervoxels unmapped
        svs = np.unique(exp.scales[0])
        svs = svs[svs != 0]
        mapping = {int(s): 1000 + int(s) % 7 for s in svs[::2]}
    lab = mapping if labels == "mapped" else labels
    t = body_stats(exp.root, scale, lab, progress=False)
    check_sorted(t)
    want = brute_stats(exp.expected(scale, lab), exp.expected(scale, "supervoxels"))
    assert as_dict(t) == want
    assert len(want) > 5
    meta = json.loads(t.schema.metadata[b"dvidshards"])
    assert meta["scale"] == scale and json.loads(t.schema.metadata[b"failed_shards"]) == {}


def test_body_stats_box(exp):
    box = [[37, 70, 11], [190, 129, 140]]
    t = body_stats(dvidshards.Dataset(exp.root), 0, "agglomerated", box=box, progress=False)
    sl = np.s_[37:190, 70:129, 11:140]
    want = brute_stats(exp.expected(0)[sl], exp.expected(0, "supervoxels")[sl], offset=box[0])
    assert as_dict(t) == want


def test_reduce_tree_and_partitions(exp, tmp_path):
    ds = dvidshards.Dataset(exp.root)
    assert len(ds.shards(0)) == 7  # 8 shard boxes, one all background
    want = brute_stats(exp.expected(0), exp.expected(0, "supervoxels"))
    # 3 levels, 2 levels, no merge level; 128 buckets: 6-bit shard partials merged into 7-bit files
    for fan_in, parts in [(2, 4), (3, 1), (64, 8), (3, 128)]:
        t = body_stats(ds, 0, workdir=tmp_path / f"w{fan_in}", partitions=parts, fan_in=fan_in,
                       progress=False)
        assert as_dict(t) == want
        assert not (tmp_path / f"w{fan_in}").exists()  # removed after a run with no failure
    with pytest.raises(SpecError, match="power of two"):
        body_stats(ds, 0, partitions=3)


def test_shard_function_is_plain(exp):
    ds = dvidshards.Dataset(exp.root)
    o = ds.shards(0)[0]
    t = shard_body_stats(exp.root, 0, o)  # a path works as well as a Dataset
    assert t.column_names[:3] == ["label", "voxels", "chunks"] and t.num_rows
    (x0, y0, z0) = o
    sl = np.s_[x0:x0 + 128, y0:y0 + 128, z0:z0 + 128]
    want = brute_stats(exp.expected(0)[sl], exp.expected(0, "supervoxels")[sl], offset=o)
    got = {r["label"]: r for r in t.to_pylist()}
    assert {k: (v["voxels"], len(v["svs"]), v["chunks"]) for k, v in got.items()} == \
        {k: v[:3] for k, v in want.items()}


def test_dask_equals_serial(exp, client, tmp_path):
    serial = body_stats(exp.root, 0, progress=False)
    t = body_stats(exp.root, 0, scheduler=client, fan_in=2, partitions=2, progress=False)
    assert t.equals(serial)
    rep = label_index(exp.root, 0, tmp_path / "idx", scheduler=client, fan_in=3, partitions=4,
                      progress=False)
    assert rep.ok and read_index(tmp_path / "idx") == brute_index(exp.expected(0), exp.expected(0, "supervoxels"))


# --------------------------------------------------------------------------- label index


def test_label_index_equals_brute_force(exp, tmp_path):
    out = tmp_path / "idx"
    rep = label_index(exp.root, 0, out, partitions=4, progress=False)
    want = brute_index(exp.expected(0), exp.expected(0, "supervoxels"))
    assert rep.ok and rep.rows == len(want) and rep.shards == 7
    assert read_index(out) == want
    meta = json.loads((out / "_meta.json").read_text())
    assert meta["complete"] and meta["bits"] == 2 and meta["labels"] == "agglomerated"
    assert not (out / "_work").exists()
    # each bucket file holds exactly its bodies, sorted
    for b in range(4):
        t = pq.read_table(out / f"bucket={b:x}" / "part-0.parquet")
        assert t.schema.remove_metadata() == INDEX_SCHEMA
        body = t["body"].to_numpy()
        assert (bucket_of(body, 2) == b).all() and (np.diff(body.astype(np.float64)) >= 0).all()
    # supervoxels: body == supervoxel; a rerun replaces the index
    rep = label_index(exp.root, 1, out, labels="supervoxels", progress=False)
    got = read_index(out)
    assert got == brute_index(exp.expected(1, "supervoxels"), exp.expected(1, "supervoxels"))
    assert all(r[0] == r[1] for r in got)
    assert json.loads((out / "_meta.json").read_text())["scale"] == 1
    (out / "notmine.txt").write_text("x")
    with pytest.raises(SpecError, match="not empty and not a label index"):
        label_index(exp.root, 0, out)


def test_shard_label_index_rows(exp):
    ds = dvidshards.Dataset(exp.root)
    o = ds.shards(0)[-1]
    t = shard_label_index(ds, 0, o)
    (x0, y0, z0) = o
    sl = np.s_[x0:x0 + 128, y0:y0 + 128, z0:z0 + 128]
    want = {(b, s, cx + x0 // 64, cy + y0 // 64, cz + z0 // 64, n) for b, s, cx, cy, cz, n in
            brute_index(exp.expected(0)[sl], exp.expected(0, "supervoxels")[sl])}
    d = t.to_pydict()
    assert set(zip(*d.values(), strict=True)) == want and t.num_rows == len(want)


# --------------------------------------------------------------------------- failures and resume


def _corrupt_one_record(root, scale=0):
    ds = dvidshards.Dataset(root)
    o = ds.shards(scale)[3]
    t = ds.shard(scale, o).table()
    path = os.path.join(root, f"s{scale}", f"{o[0]}_{o[1]}_{o[2]}.arrow")
    data = bytearray(open(path, "rb").read())
    pay = bytes(t.payload(len(t) - 1))
    at = data.find(pay)
    assert at > 0 and len(pay) > 20
    data[at + len(pay) // 2] ^= 0xFF
    with open(path, "wb") as f:
        f.write(bytes(data))
    return path, o


def test_corrupt_shard_fails_its_task_and_resumes(exp, tmp_path):
    root = tmp_path / "exp"
    shutil.copytree(exp.root, root)
    path, o = _corrupt_one_record(root)
    good = open(os.path.join(exp.root, "s0", os.path.basename(path)), "rb").read()
    work = tmp_path / "work"
    with pytest.warns(RuntimeWarning, match="1 shard\\(s\\) failed") as w:
        t = body_stats(root, 0, workdir=work, progress=False)
    assert os.path.basename(path) in str(w[0].message) and "BlockDecodeError" in str(w[0].message)
    failed = json.loads(t.schema.metadata[b"failed_shards"])
    assert list(failed) == [os.path.join(str(root), "s0", os.path.basename(path))] or \
        os.path.basename(path) in next(iter(failed))
    msg = next(iter(failed.values()))
    assert msg.startswith("BlockDecodeError:") and "chunk (" in msg
    # the other shards are there, the failed one wrote nothing
    parts = sorted(os.listdir(work / "shards"))
    assert len(parts) == 6 and f"{o[0]}_{o[1]}_{o[2]}.parquet" not in parts
    assert not [p for p in parts if ".tmp" in p]
    want = brute_stats(exp.expected(0), exp.expected(0, "supervoxels"))
    assert as_dict(t) != want
    # fix the shard and resume: only it runs again
    with open(path, "wb") as f:
        f.write(good)
    mt = {p: os.stat(work / "shards" / p).st_mtime_ns for p in parts}
    t = body_stats(root, 0, workdir=work, resume=True, progress=False)
    assert as_dict(t) == want
    assert not work.exists()
    assert mt  # (the kept partials were reused: their files were not rewritten before removal)


def test_label_index_failure_then_resume(exp, tmp_path):
    root = tmp_path / "exp"
    shutil.copytree(exp.root, root)
    path, o = _corrupt_one_record(root)
    out = tmp_path / "idx"
    # 128 buckets, fan-in 6: the 6 good partials (6-bit row groups) go straight to the 7-bit buckets
    rep = label_index(root, 0, out, partitions=128, fan_in=6, progress=False)
    assert not rep.ok and list(rep.failed)[0].endswith(os.path.basename(path))
    want = brute_index(exp.expected(0), exp.expected(0, "supervoxels"))
    assert read_index(out) == {r for r in want if (r[2] * 64 // 128 * 128, r[3] * 64 // 128 * 128,
                                                   r[4] * 64 // 128 * 128) != tuple(o)}
    meta = json.loads((out / "_meta.json").read_text())
    assert not meta["complete"] and len(meta["failed_shards"]) == 1
    kept = sorted(os.listdir(out / "_work" / "shards"))
    assert len(kept) == 6
    mt = {p: os.stat(out / "_work" / "shards" / p).st_mtime_ns for p in kept}
    shutil.copy(os.path.join(exp.root, "s0", os.path.basename(path)), path)
    seen = {}
    orig = shutil.rmtree

    def spy(p, *a, **k):  # look at the partials just before the finished run removes them
        if str(p).endswith("_work"):
            seen.update({q: os.stat(out / "_work" / "shards" / q).st_mtime_ns for q in kept})
        return orig(p, *a, **k)

    shutil.rmtree = spy
    try:
        rep = label_index(root, 0, out, partitions=128, fan_in=6, resume=True, progress=False)
    finally:
        shutil.rmtree = orig
    assert rep.ok and rep.skipped == 6
    assert seen == mt  # resumed shards were not recomputed
    assert read_index(out) == want  # 7 partials > fan-in 6: a merge level from 6-bit row groups
    assert len(os.listdir(out)) == 128 + 1
    # resuming a complete index does nothing
    rep2 = label_index(root, 0, out, partitions=128, fan_in=6, resume=True, progress=False)
    assert rep2.ok and rep2.rows == rep.rows and rep2.skipped == 7


def test_resume_refuses_other_parameters(exp, tmp_path):
    root = tmp_path / "exp"
    shutil.copytree(exp.root, root)
    _corrupt_one_record(root)
    work = tmp_path / "w"
    with pytest.warns(RuntimeWarning):
        body_stats(root, 0, workdir=work, progress=False)
    with pytest.raises(SpecError, match="other parameters"):
        body_stats(root, 0, "supervoxels", workdir=work, resume=True)
    with pytest.raises(SpecError, match="workdir"):
        body_stats(root, 0, resume=True)


# --------------------------------------------------------------------------- the real shard


@pytest.fixture(scope="module")
def real_export(dvid_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("real") / "exp"
    (root / "s1").mkdir(parents=True)
    (root / "s1" / f"{REAL_SHARD}.arrow").symlink_to(dvid_data / f"{REAL_SHARD}.arrow")
    (root / "s1" / f"{REAL_SHARD}.csv").symlink_to(dvid_data / f"{REAL_SHARD}-newformat.csv")
    return root, json.loads((dvid_data / "mcns-ng-specs.json").read_text())


def _chunk_brute(c, ub, ib, us, js, acc, rows):
    """Add one decoded chunk (labels ub[ib], supervoxels us[js], x-y-z ravel order) to acc/rows."""
    pair = np.bincount(ib * len(us) + js, minlength=len(ub) * len(us)).reshape(len(ub), len(us))
    box = []
    for ax in range(3):  # which coordinates along each axis hold each label
        co = np.broadcast_to(np.arange(64).reshape([64 if a == ax else 1 for a in range(3)]), (64, 64, 64))
        pres = np.bincount(ib * 64 + co.ravel(), minlength=len(ub) * 64).reshape(len(ub), 64) > 0
        box.append((pres.argmax(1), 64 - pres[:, ::-1].argmax(1)))
    for k, lab in enumerate(ub.tolist()):
        if not lab:
            continue
        nz = np.flatnonzero(pair[k])
        rows |= {(lab, int(us[j]), *c.tolist(), int(pair[k, j])) for j in nz}
        lo = c * 64 + [box[a][0][k] for a in range(3)]
        hi = c * 64 + [box[a][1][k] for a in range(3)]
        v0, s0, n0, lo0, hi0 = acc.get(lab, (0, set(), 0, lo, hi))
        acc[lab] = (v0 + int(pair[k].sum()), s0 | set(us[nz].tolist()), n0 + 1,
                    np.minimum(lo0, lo), np.maximum(hi0, hi))


def test_real_shard(real_export, real_records, tmp_path):
    root, spec = real_export
    ds = dvidshards.Dataset(root, spec=spec)
    acc = {"agglomerated": {}, "supervoxels": {}}
    rows = {"agglomerated": set(), "supervoxels": set()}
    for r in real_records:  # brute force: decode every chunk, count and box its labels
        vol = decode_block(r["block"], palette=np.asarray(r["labels"], np.uint64)).T  # (x, y, z)
        svv = decode_block(r["block"]).T
        c = np.array([r["chunk_x"], r["chunk_y"], r["chunk_z"]])
        ub, ib = np.unique(vol.ravel(), return_inverse=True)
        us, js = np.unique(svv.ravel(), return_inverse=True)
        _chunk_brute(c, ub, ib, us, js, acc["agglomerated"], rows["agglomerated"])
        _chunk_brute(c, us, js, us, js, acc["supervoxels"], rows["supervoxels"])
    for labels in ("agglomerated", "supervoxels"):
        want = {k: (v, len(s), n, tuple(lo.tolist() + hi.tolist()))
                for k, (v, s, n, lo, hi) in acc[labels].items()}
        t = body_stats(ds, 1, labels, progress=False)
        check_sorted(t)
        assert as_dict(t) == want and len(want) > 50
        rep = label_index(ds, 1, tmp_path / labels, labels=labels, progress=False)
        assert rep.ok and read_index(tmp_path / labels) == rows[labels]


# --------------------------------------------------------------------------- command line


def test_cli_stats_and_label_index(exp, tmp_path, capsys):
    from dvidshards.cli import main

    out = tmp_path / "sizes.parquet"
    assert main(["stats", exp.root, "--scale", "1", "--out", str(out), "--quiet"]) == 0
    t = pq.read_table(out)
    assert as_dict(t) == brute_stats(exp.expected(1), exp.expected(1, "supervoxels"))
    assert "rows from" in capsys.readouterr().out
    assert main(["stats", exp.root, "--out", str(tmp_path / "s.csv")]) == 2
    assert "must end in .parquet" in capsys.readouterr().err
    assert main(["stats", exp.root, "--out", str(out), "--box", "1,2,3"]) == 2
    assert "x0,y0,z0,x1,y1,z1" in capsys.readouterr().err
    box = tmp_path / "box.parquet"
    assert main(["stats", exp.root, "--out", str(box), "--box", "10,20,30,150,160,140",
                 "--labels", "supervoxels", "--quiet"]) == 0
    sl = np.s_[10:150, 20:160, 30:140]
    sv = exp.expected(0, "supervoxels")[sl]
    assert as_dict(pq.read_table(box)) == brute_stats(sv, sv, offset=(10, 20, 30))
    idx = tmp_path / "idx"
    assert main(["label-index", exp.root, "--out", str(idx), "--partitions", "2", "--quiet"]) == 0
    assert read_index(idx) == brute_index(exp.expected(0), exp.expected(0, "supervoxels"))


def test_cli_failed_shard_exit_1_and_resume(exp, tmp_path, capsys):
    from dvidshards.cli import main

    root = tmp_path / "exp"
    shutil.copytree(exp.root, root)
    path, _ = _corrupt_one_record(root)
    out = tmp_path / "sizes.parquet"
    assert main(["stats", str(root), "--out", str(out), "--resume", "--quiet"]) == 1
    text = capsys.readouterr().out
    assert f"FAILED {path}: BlockDecodeError" in text and "--resume" in text
    assert (tmp_path / "sizes.parquet.parts" / "shards").is_dir()
    shutil.copy(os.path.join(exp.root, "s0", os.path.basename(path)), path)
    assert main(["stats", str(root), "--out", str(out), "--resume", "--quiet"]) == 0
    assert "(6 resumed, 0 failed)" in capsys.readouterr().out
    assert as_dict(pq.read_table(out)) == brute_stats(exp.expected(0), exp.expected(0, "supervoxels"))
    assert not (tmp_path / "sizes.parquet.parts").exists()
