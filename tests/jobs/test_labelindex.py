"""label-index vs brute force over written volumes (the whole volume and a box); what it leaves when
shards fail, and how --resume finishes it."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest

import dvidshards
from dvidshards.errors import JobError, SpecError
from dvidshards.formats.labelindex import INDEX_SCHEMA, bucket_of
from dvidshards.jobs import labelindex as index_job
from dvidshards.jobs.labelindex import label_index, shard_label_index
from dvidshards.jobs.output import read_manifest
from tests.support.stats import brute_index, damaged_copy, read_index, stats_export, tree


@pytest.fixture(scope="module")
def exp(tmp_path_factory):
    return stats_export(tmp_path_factory.mktemp("index") / "exp")


def test_label_index_equals_brute_force(exp, tmp_path):
    out = tmp_path / "idx"
    rep = label_index(exp.root, out, scale=0, partitions=4, progress=False)
    want = brute_index(exp.expected(0), exp.expected(0, "supervoxels"))
    assert rep.ok and rep.totals.rows == len(want) and rep.totals.shards == 7
    assert read_index(out) == want
    meta = json.loads((out / "_meta.json").read_text())
    assert meta["complete"] and meta["bits"] == 2 and meta["labels"] == "agglomerated" and meta["box"] is None
    assert read_manifest(out)["job"] == "label-index" and not (tmp_path / "idx.work").exists()
    # each bucket file holds exactly its bodies, sorted
    for b in range(4):
        t = pq.read_table(out / f"bucket={b:x}" / "part-0.parquet")
        assert t.schema.remove_metadata() == INDEX_SCHEMA
        body = t["body"].to_numpy()
        assert (bucket_of(body, 2) == b).all() and (np.diff(body.astype(np.float64)) >= 0).all()
    # supervoxels: body == supervoxel; overwrite replaces the index
    rep = label_index(exp.root, out, scale=1, labels="supervoxels", overwrite=True, progress=False)
    got = read_index(out)
    assert got == brute_index(exp.expected(1, "supervoxels"), exp.expected(1, "supervoxels"))
    assert all(r[0] == r[1] for r in got)
    assert json.loads((out / "_meta.json").read_text())["scale"] == 1


def test_label_index_of_a_box(exp, tmp_path, capsys):
    """--box: the voxels inside the box only (chunks cut by it count what lies inside), the shards
    meeting it only; the box is recorded in _meta.json and the manifest."""
    from dvidshards.cli import main

    box = [[10, 20, 30], [150, 160, 140]]
    sl = np.s_[10:150, 20:160, 30:140]
    want = brute_index(exp.expected(0)[sl], exp.expected(0, "supervoxels")[sl], offset=box[0])
    assert want != brute_index(exp.expected(0), exp.expected(0, "supervoxels"))
    rep = label_index(exp.root, tmp_path / "a", box=box, progress=False)
    assert rep.ok and read_index(tmp_path / "a") == want and rep.totals.rows == len(want)
    assert json.loads((tmp_path / "a" / "_meta.json").read_text())["box"] == box
    assert read_manifest(tmp_path / "a")["parameters"]["box"] == box
    assert main(["label-index", exp.root, str(tmp_path / "b"), "--box", "10", "20", "30", "150", "160", "140",
                 "--quiet"]) == 0
    assert read_index(tmp_path / "b") == want
    # a box inside one shard reads that shard only
    rep = label_index(exp.root, tmp_path / "c", box=[[0, 0, 0], [100, 100, 100]], progress=False)
    assert rep.totals.shards == 1 and read_index(tmp_path / "c") == brute_index(
        exp.expected(0)[:100, :100, :100], exp.expected(0, "supervoxels")[:100, :100, :100])
    before = tree(tmp_path)
    with pytest.raises(SpecError, match="not inside"):
        label_index(exp.root, tmp_path / "d", box=[[0, 0, 0], [300, 10, 10]])
    assert tree(tmp_path) == before
    # read: a warning that answers hold the box only; serve-dvid refuses it (its answers would be partial)
    from dvidshards.query import BodyIndex

    pytest.importorskip("aiohttp")
    from dvidshards.serve.dvid import serve

    with pytest.warns(RuntimeWarning, match="only the box"):
        BodyIndex(str(tmp_path / "a"))
    with pytest.warns(RuntimeWarning), pytest.raises(SpecError, match="label-index without --box"):
        serve(exp.root, label_index=str(tmp_path / "a"), port=0)


def test_shard_label_index_rows(exp):
    ds = dvidshards.Dataset(exp.root)
    o = ds.shards(0)[-1]
    t = shard_label_index(ds, scale=0, origin=o)
    (x0, y0, z0) = o
    sl = np.s_[x0:x0 + 128, y0:y0 + 128, z0:z0 + 128]
    want = brute_index(exp.expected(0)[sl], exp.expected(0, "supervoxels")[sl], offset=o)
    d = t.to_pydict()
    assert set(zip(*d.values(), strict=True)) == want and t.num_rows == len(want)


def test_label_index_failure_then_resume(exp, tmp_path, monkeypatch):
    root, path, o, _ = damaged_copy(exp, tmp_path)
    out = tmp_path / "idx"
    # 128 buckets, fan-in 6: the 6 good partials (6-bit batches) go straight to the 7-bit buckets
    with pytest.raises(JobError) as e:
        label_index(root, out, scale=0, partitions=128, fan_in=6, progress=False)
    rep = e.value.report
    assert not rep.ok and list(rep.failed) == [path]
    want = brute_index(exp.expected(0), exp.expected(0, "supervoxels"))
    assert read_index(out) == {r for r in want if (r[2] * 64 // 128 * 128, r[3] * 64 // 128 * 128,
                                                   r[4] * 64 // 128 * 128) != tuple(o)}
    meta = json.loads((out / "_meta.json").read_text())
    assert not meta["complete"] and list(meta["failed_shards"]) == [path]
    m = read_manifest(out)
    assert m["complete"] is False and list(m["failed"]) == [path] == list(rep.failed)  # manifest = report
    with pytest.warns(RuntimeWarning, match="incomplete"):
        dvidshards.Dataset(root).body_index(out)
    assert len(os.listdir(tmp_path / "idx.work" / "shards")) == 6
    shutil.copy(os.path.join(exp.root, "s0", os.path.basename(path)), path)
    ran = []
    orig = index_job.shard_label_index
    monkeypatch.setattr(index_job, "shard_label_index", lambda source, **k: ran.append(k["origin"]) or
                        orig(source, **k))
    rep = label_index(root, out, scale=0, partitions=128, fan_in=6, resume=True, scheduler="serial",
                      progress=False)
    assert rep.ok and rep.skipped == 6 and ran == [o]  # resumed shards were not recomputed
    assert read_index(out) == want  # 7 partials > fan-in 6: a merge level from 6-bit batches
    assert len(os.listdir(out)) == 128 + 2 and not (tmp_path / "idx.work").exists()
    # resuming a complete index does nothing
    rep2 = label_index(root, out, scale=0, partitions=128, fan_in=6, resume=True, progress=False)
    assert rep2.ok and rep2.totals.rows == rep.totals.rows and rep2.skipped == rep.tasks and ran == [o]


def test_cli_label_index(exp, tmp_path, capsys):
    from dvidshards.cli import main

    idx = tmp_path / "idx"
    assert main(["label-index", exp.root, str(idx), "--partitions", "2", "--workdir", str(tmp_path / "w"),
                 "--quiet"]) == 0
    assert read_index(idx) == brute_index(exp.expected(0), exp.expected(0, "supervoxels"))
    assert "label-index -> " in capsys.readouterr().out and sorted(os.listdir(tmp_path)) == ["idx"]
    assert main(["label-index", exp.root, str(tmp_path / "s1"), "--scale", "1", "--quiet"]) == 0
    assert json.loads((tmp_path / "s1" / "_meta.json").read_text())["scale"] == 1
    assert main(["label-index", exp.root, "--out", str(tmp_path / "old"), "--quiet"]) == 2  # DEST is positional
    assert not (tmp_path / "old").exists()
