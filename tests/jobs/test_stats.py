"""stats (body_stats, body_stats_table) vs brute force over written volumes, serially, on threads and
on dask; the outputs it refuses to write, and what it leaves when shards fail. It stands on
dvidshards.jobs.output: one manifest, a lock, JobError unless allow_partial."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import dvidshards
from dvidshards.errors import JobError, MappingError, OutputError, RemoteReadError, SpecError
from dvidshards.formats import jit
from dvidshards.formats.codec import decode_block
from dvidshards.formats.labelindex import bucket_of
from dvidshards.jobs import buckets, runner
from dvidshards.jobs import stats as stats_job
from dvidshards.jobs.labelindex import label_index
from dvidshards.jobs.output import JobReport, read_manifest
from dvidshards.jobs.runner import TaskRunner
from dvidshards.jobs.stats import STATS_SCHEMA, body_stats, body_stats_table, shard_body_stats
from tests.support.kernels import compiles_held
from tests.support.stats import (
    as_dict,
    brute_index,
    brute_stats,
    damaged_copy,
    read_dataset,
    read_folder,
    read_index,
    stats_export,
    tree,
)
from tests.support.waiting import HANG_SECONDS


@pytest.fixture(scope="module")
def exp(tmp_path_factory):
    return stats_export(tmp_path_factory.mktemp("stats") / "exp")


@pytest.fixture(scope="module")
def client():
    distributed = pytest.importorskip("distributed")
    tr = TaskRunner("local:2")
    c = tr.client()
    assert isinstance(c, distributed.Client)
    yield c
    tr.close()


@pytest.fixture
def damaged(exp, tmp_path):
    return damaged_copy(exp, tmp_path)


def check_sorted(t):
    assert t.schema.remove_metadata() == STATS_SCHEMA
    assert (np.diff(t["voxels"].to_numpy()) <= 0).all()


# --------------------------------------------------------------------------- body_stats_table


@pytest.mark.parametrize("scale", [0, 1])
@pytest.mark.parametrize("labels", ["agglomerated", "supervoxels", "mapped"])
def test_body_stats_equal_brute_force(exp, scale, labels):
    mapping = None
    if labels == "mapped":  # merge pairs of bodies, leave some supervoxels unmapped
        svs = np.unique(exp.scales[0])
        svs = svs[svs != 0]
        mapping = {int(s): 1000 + int(s) % 7 for s in svs[::2]}
    lab = mapping if labels == "mapped" else labels
    t = body_stats_table(exp.root, scale=scale, labels=lab, progress=False)
    check_sorted(t)
    want = brute_stats(exp.expected(scale, lab), exp.expected(scale, "supervoxels"))
    assert as_dict(t) == want
    assert len(want) > 5
    meta = json.loads(t.schema.metadata[b"dvidshards"])
    assert meta["scale"] == scale and meta["labels"] == ("mapped" if mapping else labels) and meta["box"] is None


def test_body_stats_box(exp):
    box = [[37, 70, 11], [190, 129, 140]]
    t = body_stats_table(dvidshards.Dataset(exp.root), scale=0, labels="agglomerated", box=box, progress=False)
    sl = np.s_[37:190, 70:129, 11:140]
    want = brute_stats(exp.expected(0)[sl], exp.expected(0, "supervoxels")[sl], offset=box[0])
    assert as_dict(t) == want


def test_reduce_tree_and_partitions(exp, tmp_path):
    ds = dvidshards.Dataset(exp.root)
    assert len(ds.shards(0)) == 7  # 8 shard boxes, one all background
    want = brute_stats(exp.expected(0), exp.expected(0, "supervoxels"))
    # 3 levels, 2 levels, no merge level; 128 buckets: 6-bit shard partials merged into 7-bit files
    for fan_in, parts in [(2, 4), (3, 1), (64, 8), (3, 128)]:
        t = body_stats_table(ds, scale=0, workdir=tmp_path / f"w{fan_in}", partitions=parts, fan_in=fan_in,
                             progress=False)
        assert as_dict(t) == want
        assert not (tmp_path / f"w{fan_in}").exists()  # removed after a run with no failure
    with pytest.raises(SpecError, match="power of two"):
        body_stats_table(ds, scale=0, partitions=3)


def test_shard_function_is_plain(exp):
    ds = dvidshards.Dataset(exp.root)
    o = ds.shards(0)[0]
    t = shard_body_stats(exp.root, scale=0, origin=o)  # a path works as well as a Dataset
    assert t.column_names[:3] == ["label", "voxels", "chunks"] and t.num_rows
    (x0, y0, z0) = o
    sl = np.s_[x0:x0 + 128, y0:y0 + 128, z0:z0 + 128]
    want = brute_stats(exp.expected(0)[sl], exp.expected(0, "supervoxels")[sl], offset=o)
    got = {r["label"]: r for r in t.to_pylist()}
    assert {k: (v["voxels"], len(v["svs"]), v["chunks"]) for k, v in got.items()} == \
        {k: v[:3] for k, v in want.items()}


def test_arguments_after_the_source_are_keywords(exp, tmp_path):
    with pytest.raises(TypeError):
        body_stats(exp.root, tmp_path / "a.parquet", 1)  # the scale by position
    with pytest.raises(TypeError):
        body_stats(exp.root)  # no destination: body_stats_table returns a table
    with pytest.raises(TypeError):
        body_stats_table(exp.root, 1)
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_dask_equals_serial(exp, client, tmp_path):
    serial = body_stats_table(exp.root, scale=0, scheduler="serial", progress=False)
    t = body_stats_table(exp.root, scale=0, scheduler=client, fan_in=2, partitions=2, progress=False)
    assert t.equals(serial)
    rep = label_index(exp.root, tmp_path / "idx", scale=0, scheduler=client, fan_in=3, partitions=4,
                      progress=False)
    assert rep.ok and read_index(tmp_path / "idx") == brute_index(exp.expected(0), exp.expected(0, "supervoxels"))
    rep = body_stats(exp.root, tmp_path / "sizes.parquet", scheduler=client, fan_in=3, progress=False)
    assert rep.ok and as_dict(pq.read_table(tmp_path / "sizes.parquet")) == as_dict(serial)


def test_body_stats_table_refuses_more_than_max_rows(exp, tmp_path):
    n = len(brute_stats(exp.expected(0), exp.expected(0, "supervoxels")))
    with pytest.raises(SpecError, match=f"{n} bodies, more than max_rows=3") as e:
        body_stats_table(exp.root, scale=0, workdir=tmp_path / "w", max_rows=3, progress=False)
    assert "body_stats(source, dest)" in str(e.value) and str(tmp_path / "w" / "table") in str(e.value)
    assert len(as_dict(read_folder(tmp_path / "w" / "table"))) == n  # the complete dataset, where it says
    assert read_manifest(tmp_path / "w" / "table")["complete"] is True


# --------------------------------------------------------------------------- body_stats: written by the workers


def test_stats_dataset_written_by_the_workers(exp, tmp_path):
    out = tmp_path / "sizes"
    rep = body_stats(exp.root, out, scale=0, partitions=4, fan_in=3, progress=False)
    want = brute_stats(exp.expected(0), exp.expected(0, "supervoxels"))
    assert isinstance(rep, JobReport) and rep.ok and rep.complete and rep.job == "stats"
    assert rep.totals.rows == len(want) and rep.totals.shards == 7 and rep.dest == str(out)
    assert read_dataset(out) == want
    assert as_dict(read_folder(out)) == want  # readable as one hive-partitioned dataset
    meta = json.loads((out / "_meta.json").read_text())
    assert meta["format"] == "dvidshards-body-stats" and meta["complete"] and meta["rows"] == len(want)
    assert meta["bits"] == 2 and meta["labels"] == "agglomerated" and "voxels descending" in meta["order"]
    assert sorted(os.listdir(out)) == ["_dvidshards.json", "_meta.json"] + [f"bucket={b}" for b in range(4)]
    assert sorted(os.listdir(tmp_path)) == ["sizes"]  # the work folder sizes.work (beside it) is removed
    # the manifest and the summary come from the same report: they cannot disagree
    m = read_manifest(out)
    assert m["job"] == "stats" and m["complete"] is True and m["failed"] == {}
    assert m["totals"]["rows"] == rep.totals.rows and m["tasks"]["total"] == rep.tasks
    assert f"{rep.done:,} of {rep.tasks:,} tasks done" in rep.summary() and "complete" in rep.summary()


def test_single_file_assembled_from_the_buckets(exp, tmp_path):
    out = tmp_path / "sizes.parquet"
    rep = body_stats(exp.root, out, scale=1, labels="supervoxels", partitions=8, progress=False)
    t = pq.read_table(out)
    sv = exp.expected(1, "supervoxels")
    assert rep.ok and as_dict(t) == brute_stats(sv, sv)
    b = bucket_of(t["label"].to_numpy(), 3)
    assert (np.diff(b) >= 0).all()  # grouped by bucket, in bucket order
    for k in np.unique(b):
        assert (np.diff(t["voxels"].to_numpy()[b == k]) <= 0).all()
    m = json.loads(t.schema.metadata[b"dvidshards"])  # the job's manifest, in the file itself
    assert m == read_manifest(out)
    assert m["complete"] and m["job"] == "stats" and m["parameters"]["scale"] == 1
    assert m["parameters"]["labels"] == "supervoxels" and m["totals"]["rows"] == rep.totals.rows
    assert m["table"]["format"] == "dvidshards-body-stats" and m["table"]["bits"] == 3
    assert sorted(os.listdir(tmp_path)) == ["sizes.parquet"]  # work folder sizes.parquet.work and lock removed


def test_workdir_is_the_one_given_or_beside_the_output(exp, damaged, tmp_path):
    """--workdir holds the partial results when given, else DEST.work beside the output; a work
    folder inside the output is refused before any work."""
    root, path, _, _ = damaged
    rep = body_stats(root, tmp_path / "a", workdir=tmp_path / "elsewhere" / "w", allow_partial=True, progress=False)
    assert not rep.ok and len(os.listdir(tmp_path / "elsewhere" / "w" / "shards")) == 6
    assert not (tmp_path / "a.work").exists() and rep.totals.work == str(tmp_path / "elsewhere" / "w")
    rep = body_stats(root, tmp_path / "b.parquet", allow_partial=True, progress=False)
    assert len(os.listdir(tmp_path / "b.parquet.work" / "shards")) == 6
    before = tree(tmp_path)
    with pytest.raises(OutputError, match="overlap"):
        body_stats(exp.root, tmp_path / "c", workdir=tmp_path / "c" / "w")
    assert tree(tmp_path) == before and not (tmp_path / "c").exists()


@pytest.mark.slow
def test_workdir_and_outputs_in_an_s3_bucket(exp, tmp_path):
    from tests.support.servers import MotoS3

    with MotoS3() as s3:
        s3.bucket("work")
        q = f"?endpoint_override=127.0.0.1:{s3.port}&scheme=http&region={s3.REGION}"
        out = tmp_path / "sizes"
        rep = body_stats(exp.root, out, scale=0, workdir=f"s3://work/job1{q}", fan_in=4, partitions=2,
                         progress=False)
        assert rep.ok and read_dataset(out) == brute_stats(exp.expected(0), exp.expected(0, "supervoxels"))
        assert s3.client().list_objects_v2(Bucket="work").get("KeyCount", 0) == 0  # emptied after a complete run
        # the outputs themselves can live in a bucket, their work folder beside them
        rep = label_index(exp.root, f"s3://work/idx{q}", scale=0, partitions=2, progress=False)
        keys = sorted(o["Key"] for o in s3.client().list_objects_v2(Bucket="work")["Contents"])
        assert rep.ok and keys == ["idx/_dvidshards.json", "idx/_meta.json", "idx/bucket=0/part-0.parquet",
                                   "idx/bucket=1/part-0.parquet"]
        # one file in a bucket
        rep = body_stats(exp.root, f"s3://work/out/sizes.parquet{q}", scale=0, partitions=2, progress=False)
        body = s3.client().get_object(Bucket="work", Key="out/sizes.parquet")["Body"].read()
        assert rep.ok and as_dict(pq.read_table(pa.BufferReader(body))) == brute_stats(
            exp.expected(0), exp.expected(0, "supervoxels"))
        assert [o["Key"] for o in s3.client().list_objects_v2(Bucket="work", Prefix="out/")["Contents"]] == \
            ["out/sizes.parquet"]


def test_remote_scheduler_checks_the_work_folder_first(exp, tmp_path, monkeypatch, capsys):
    from dvidshards.cli import main

    seen = []

    def blind(self, workdir):
        seen.append(workdir.local_path())
        raise SpecError(f"work folder {workdir.local_path()}: 2 of 2 dask workers cannot see it (first: tcp://w:1); "
                        f"give --workdir on a file system every worker shares")

    monkeypatch.setattr(TaskRunner, "check_shared", blind)
    out = tmp_path / "sizes"
    assert main(["stats", exp.root, str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "cannot see it" in err
    assert seen == [str(out)] and os.listdir(tmp_path) == []  # checked before any work, nothing left


def test_one_task_runner_for_every_phase(exp, tmp_path, monkeypatch):
    made, phases = [], []

    class Counting(TaskRunner):
        def __init__(self, *a, **k):
            made.append(1)
            super().__init__(*a, **k)

        def run(self, fn, items, **kw):
            phases.append(kw.get("desc"))
            return super().run(fn, items, **kw)

    monkeypatch.setattr(stats_job, "TaskRunner", Counting)
    rep = body_stats(exp.root, tmp_path / "s.parquet", fan_in=2, partitions=2, progress=False)
    assert rep.ok and len(made) == 1
    assert phases == ["s0 shards", "merge level 1", "merge level 2", "buckets", "one file"]  # 7 -> 4 -> 2 files


def test_failures_that_may_pass_are_run_again_by_the_runner(exp, tmp_path, monkeypatch):
    """A shard task and a merge task that fail once on a remote read run again (the runner's
    retries); the output equals brute force."""
    monkeypatch.setattr(runner, "RETRY_SECONDS", 0.0)
    calls: dict = {}

    def flaky(fn, what):
        def task(t):
            key = (what, t.origin if what == "shard" else (t.level, t.group))
            n = calls[key] = calls.get(key, 0) + 1
            if n == 1 and (what == "merge" or t.origin == first):
                raise RemoteReadError(f"{t}: connection reset")
            return fn(t)
        return task

    first = dvidshards.Dataset(exp.root).shards(0)[0]
    monkeypatch.setattr(stats_job, "run_task", flaky(stats_job.run_task, "shard"))
    monkeypatch.setattr(buckets, "merge_task", flaky(buckets.merge_task, "merge"))
    out = tmp_path / "sizes"
    rep = body_stats(exp.root, out, fan_in=4, scheduler="serial", progress=False)
    assert rep.ok and read_dataset(out) == brute_stats(exp.expected(0), exp.expected(0, "supervoxels"))
    assert calls["shard", first] == 2 and sum(v for k, v in calls.items() if k[0] == "shard") == 8
    assert sorted(v for k, v in calls.items() if k[0] == "merge") == [2, 2]  # 7 files -> 2 merges, each run twice


def test_mapping_file_travels_by_reference(exp, tmp_path, monkeypatch):
    import pickle

    svs = np.unique(exp.scales[0])
    svs = svs[svs != 0]
    mapping = {int(s): 5000 + int(s) % 5 for s in svs}
    path = tmp_path / "map.txt"
    path.write_text("".join(f"{k} {v}\n" for k, v in mapping.items()) + "".join(
        f"{10**9 + k} 7\n" for k in range(20000)))  # rows for absent supervoxels: a bigger file
    carried = []
    orig = stats_job.run_task

    def spy(task):
        carried.append(len(pickle.dumps(task)))
        return orig(task)

    monkeypatch.setattr(stats_job, "run_task", spy)
    rep = body_stats(exp.root, tmp_path / "sizes", scale=0, labels=str(path), scheduler="serial", progress=False)
    assert rep.ok and read_dataset(tmp_path / "sizes") == brute_stats(exp.expected(0, mapping),
                                                                      exp.expected(0, "supervoxels"))
    assert carried and max(carried) < 4096 < path.stat().st_size // 10  # the path, not 16 B per supervoxel
    meta = json.loads((tmp_path / "sizes" / "_meta.json").read_text())
    assert meta["labels"] == "mapped" and meta["mapping_file"] == str(path) and "mapping_sha256" not in meta
    # the label index names the mapping the same way, and BodyIndex users of the same file match it
    rep = label_index(exp.root, tmp_path / "idx", scale=0, labels=str(path), progress=False)
    assert rep.ok and json.loads((tmp_path / "idx" / "_meta.json").read_text())["mapping_file"] == str(path)
    body = 5003
    m, box = dvidshards.Dataset(exp.root).body_mask(body, scale=0, labels=str(path), index=tmp_path / "idx")
    vol = exp.expected(0, mapping)
    x, y, z = np.nonzero(vol == body)
    assert box == [[int(x.min()), int(y.min()), int(z.min())], [int(x.max()) + 1, int(y.max()) + 1, int(z.max()) + 1]]
    assert int(m.sum()) == int((vol == body).sum())
    with pytest.raises(MappingError, match="not found"):
        body_stats(exp.root, tmp_path / "other", scale=0, labels=str(tmp_path / "nope.txt"), progress=False)
    assert not (tmp_path / "other").exists()


# --------------------------------------------------------------------------- failures and resume


def test_corrupt_shard_fails_its_task_and_resumes(exp, damaged, tmp_path, monkeypatch):
    root, path, o, good = damaged
    work = tmp_path / "work"
    with pytest.raises(JobError, match="1 of 7 tasks failed") as e:
        body_stats_table(root, scale=0, workdir=work, progress=False)
    msg = str(e.value)
    assert os.path.basename(path) in msg and "BlockDecodeError" in msg and "chunk (" in msg and str(work) in msg
    assert list(e.value.report.failed) == [path] and not e.value.report.complete
    # the other shards are there, the failed one wrote nothing; no reduce ran
    parts = sorted(os.listdir(work / "table.work" / "shards"))
    assert len(parts) == 6 and f"{o[0]}_{o[1]}_{o[2]}.arrow" not in parts
    assert sorted(os.listdir(work / "table.work")) == ["shards", "work.json"]  # its lock released
    m = read_manifest(work / "table")
    assert m["complete"] is False and list(m["failed"]) == [path] and m["failed"][path].startswith("BlockDecodeError:")
    assert os.listdir(work / "table") == ["_dvidshards.json"]  # no rows
    # fix the shard and resume: only it runs again
    with open(path, "wb") as f:
        f.write(good)
    ran = []
    orig = stats_job.shard_body_stats
    monkeypatch.setattr(stats_job, "shard_body_stats", lambda source, **k: ran.append(k["origin"]) or orig(source, **k))
    t = body_stats_table(root, scale=0, workdir=work, resume=True, scheduler="serial", progress=False)
    assert as_dict(t) == brute_stats(exp.expected(0), exp.expected(0, "supervoxels"))
    assert ran == [o] and not work.exists()


def test_allow_partial_returns_the_report(damaged, tmp_path):
    root, path, _, _ = damaged
    rep = body_stats(root, tmp_path / "s", allow_partial=True, progress=False)
    assert not rep.ok and not rep.complete and rep.status == "incomplete" and list(rep.failed) == [path]
    assert "INCOMPLETE" in rep.summary() and "--resume" in rep.summary()
    m = read_manifest(tmp_path / "s")
    assert m["complete"] is False and m["failed"] == rep.failed and m["tasks"]["failed"] == len(rep.failed)
    rep = body_stats(root, tmp_path / "s.parquet", allow_partial=True, progress=False)
    assert not rep.ok and not (tmp_path / "s.parquet").exists()  # a one-file output only when complete
    assert os.listdir(tmp_path / "s.parquet.work" / "shards")


def test_resume_refuses_other_parameters(damaged, tmp_path):
    root = damaged[0]
    work = tmp_path / "w"
    with pytest.raises(JobError):
        body_stats_table(root, scale=0, workdir=work, progress=False)
    with pytest.raises(OutputError, match="other parameters"):
        body_stats_table(root, scale=0, labels="supervoxels", workdir=work, resume=True)
    with pytest.raises(OutputError, match="--resume to finish it"):
        body_stats_table(root, scale=0, workdir=work)
    with pytest.raises(SpecError, match="workdir"):
        body_stats_table(root, scale=0, resume=True)
    # a work folder given that holds something else is refused, and left alone
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    with pytest.raises(OutputError, match="not a dvidshards work folder"):
        body_stats(root, tmp_path / "o", workdir=tmp_path / "mine", overwrite=True)
    assert os.listdir(tmp_path / "mine") == ["notes.txt"]
    # the partial results of another job's parameters are not mixed in
    with pytest.raises(JobError):
        body_stats(root, tmp_path / "o2", workdir=tmp_path / "w2", progress=False)
    with pytest.raises(OutputError, match="other parameters"):
        body_stats(root, tmp_path / "o3", labels="supervoxels", workdir=tmp_path / "w2", resume=True)


# --------------------------------------------------------------------------- command line


def test_cli_stats(exp, tmp_path, capsys):
    from dvidshards.cli import main

    out = tmp_path / "sizes.parquet"
    assert main(["stats", exp.root, str(out), "--scale", "1", "--quiet"]) == 0
    t = pq.read_table(out)
    assert as_dict(t) == brute_stats(exp.expected(1), exp.expected(1, "supervoxels"))
    text = capsys.readouterr().out
    assert "stats -> " in text and ": complete:" in text
    assert read_manifest(out)["command"] == f"dvidshards stats {exp.root} {out} --scale 1"
    folder = tmp_path / "sizes"
    assert main(["stats", exp.root, str(folder), "--scale", "1", "--quiet"]) == 0
    assert read_dataset(folder) == as_dict(t)
    assert main(["stats", exp.root, str(tmp_path / "s.parquet"), "--box", "1", "2", "3"]) == 2
    assert "--box takes six numbers X0 Y0 Z0 X1 Y1 Z1" in capsys.readouterr().err
    box = tmp_path / "box.parquet"
    assert main(["stats", exp.root, str(box), "--box", "10", "20", "30", "150", "160", "140",
                 "--labels", "supervoxels", "--quiet"]) == 0
    sl = np.s_[10:150, 20:160, 30:140]
    sv = exp.expected(0, "supervoxels")[sl]
    assert as_dict(pq.read_table(box)) == brute_stats(sv, sv, offset=(10, 20, 30))
    assert main(["stats", exp.root, "--out", str(tmp_path / "old.parquet"), "--quiet"]) == 2  # DEST is positional
    assert not (tmp_path / "old.parquet").exists()


def test_scale_in_the_spec_without_a_folder(exp, tmp_path, capsys):
    from dvidshards.cli import main

    root = tmp_path / "exp"
    shutil.copytree(exp.root, root)
    shutil.rmtree(root / "s0")  # the info still lists scale 0
    before = tree(tmp_path)
    for cmd, out in (("stats", tmp_path / "sizes.parquet"), ("stats", tmp_path / "sizes"),
                     ("label-index", tmp_path / "idx")):
        assert main([cmd, str(root), str(out), "--scale", "0", "--quiet"]) == 2
        err = capsys.readouterr().err
        assert "s0" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert tree(tmp_path) == before  # nothing written
    with pytest.raises(SpecError, match="s0"):
        body_stats_table(root, scale=0, progress=False)
    assert main(["stats", str(root), str(tmp_path / "s1.parquet"), "--scale", "1", "--quiet"]) == 0


def test_box_outside_the_volume(exp, tmp_path, capsys):
    from dvidshards.cli import main

    for box, said in ((["150", "100", "100", "260", "160", "140"], "not inside scale 0's volume"),
                      (["-5", "0", "0", "10", "10", "10"], "empty or negative"),
                      (["10", "10", "10", "5", "20", "20"], "empty or negative")):
        assert main(["stats", exp.root, str(tmp_path / "b.parquet"), "--box", *box, "--quiet"]) == 2
        err = capsys.readouterr().err
        assert said in err and len(err.strip().splitlines()) == 1
    assert os.listdir(tmp_path) == []
    with pytest.raises(SpecError, match="not inside"):
        body_stats_table(exp.root, scale=0, box=[[150, 100, 100], [260, 160, 140]])
    with pytest.raises(SpecError, match="not inside"):
        shard_body_stats(exp.root, scale=0, origin=(0, 0, 0), box=[[0, 0, 0], [300, 10, 10]])


@pytest.mark.parametrize("form", ["sizes.parquet", "sizes"])
def test_damaged_shard_writes_no_rows(exp, damaged, tmp_path, capsys, form):
    from dvidshards.cli import main

    root, path, _, _ = damaged
    out = tmp_path / form
    work = tmp_path / f"{form}.work"
    assert main(["stats", str(root), str(out), "--quiet"]) == 1
    text = capsys.readouterr().out
    assert f"FAILED {path}: BlockDecodeError" in text and "--resume" in text and str(work) in text
    if form.endswith(".parquet"):
        assert not out.exists()
    else:
        assert os.listdir(out) == ["_dvidshards.json"] and read_manifest(out)["complete"] is False
    assert json.loads((work / "work.json").read_text())["format"] == "dvidshards-job-work"
    assert len(os.listdir(work / "shards")) == 6
    # without --resume the partial results are not thrown away
    assert main(["stats", str(root), str(out), "--quiet"]) == 2
    assert "--resume to finish it" in capsys.readouterr().err
    shutil.copy(os.path.join(exp.root, "s0", os.path.basename(path)), path)
    assert main(["stats", str(root), str(out), "--resume", "--quiet"]) == 0
    assert ", 6 kept from an earlier run, 0 failed" in capsys.readouterr().out
    want = brute_stats(exp.expected(0), exp.expected(0, "supervoxels"))
    assert (as_dict(pq.read_table(out)) if form.endswith(".parquet") else read_dataset(out)) == want
    assert not work.exists()


@pytest.mark.parametrize("cmd", ["stats", "label-index"])
def test_output_folder_with_other_files_is_refused(exp, tmp_path, capsys, cmd):
    from dvidshards.cli import main

    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "bucket=0").mkdir()
    before = tree(tmp_path)
    for flags in ([], ["--resume"]):
        assert main([cmd, exp.root, str(out), "--quiet", *flags]) == 2
        assert "not empty and holds no dvidshards output" in capsys.readouterr().err
    assert tree(tmp_path) == before
    # --overwrite replaces what this job writes there (bucket folders), and leaves the rest alone
    assert main([cmd, exp.root, str(out), "--quiet", "--partitions", "2", "--overwrite"]) == 0
    assert sorted(os.listdir(out)) == ["_dvidshards.json", "_meta.json", "bucket=0", "bucket=1", "notes.txt"]
    # its own earlier output: refused without a flag, replaced with --overwrite, kept with --resume
    new = tmp_path / "new"
    assert main([cmd, exp.root, str(new), "--quiet", "--partitions", "2"]) == 0
    capsys.readouterr()
    done = {k: v for k, v in tree(new).items() if k != "_dvidshards.json"}
    assert main([cmd, exp.root, str(new), "--quiet", "--partitions", "2"]) == 2
    assert "pass --resume to finish it, or --overwrite" in capsys.readouterr().err
    assert main([cmd, exp.root, str(new), "--quiet", "--partitions", "2", "--resume"]) == 0
    assert {k: v for k, v in tree(new).items() if k != "_dvidshards.json"} == done  # nothing redone
    assert main([cmd, exp.root, str(new), "--quiet", "--partitions", "4", "--resume"]) == 2
    assert "other parameters" in capsys.readouterr().err
    assert {k: v for k, v in tree(new).items() if k != "_dvidshards.json"} == done
    assert main([cmd, exp.root, str(new), "--quiet", "--partitions", "4", "--overwrite"]) == 0
    assert sorted(os.listdir(new)) == ["_dvidshards.json", "_meta.json"] + [f"bucket={b}" for b in range(4)]


def test_file_output_refused_unless_ours_and_asked(exp, tmp_path, capsys):
    from dvidshards.cli import main

    other = tmp_path / "other.parquet"
    pq.write_table(pa.table({"x": [1, 2]}), other)
    before = tree(tmp_path)
    for flags in ([], ["--resume"]):
        assert main(["stats", exp.root, str(other), "--quiet", *flags]) == 2
        assert "exists and is not a stats output" in capsys.readouterr().err
    assert tree(tmp_path) == before
    out = tmp_path / "sizes.parquet"
    assert main(["stats", exp.root, str(out), "--quiet"]) == 0
    assert main(["stats", exp.root, str(out), "--quiet"]) == 2
    assert "--overwrite to replace it" in capsys.readouterr().err
    assert main(["stats", exp.root, str(out), "--quiet", "--labels", "supervoxels", "--overwrite"]) == 0
    sv = exp.expected(0, "supervoxels")
    assert as_dict(pq.read_table(out)) == brute_stats(sv, sv)


def test_scheduler_vocabulary(exp, tmp_path, capsys):
    from dvidshards.cli import main

    want = brute_stats(exp.expected(1), exp.expected(1, "supervoxels"))
    for k, sched in enumerate(("serial", "threads:2", "auto")):
        out = tmp_path / f"s{k}.parquet"
        assert main(["stats", exp.root, str(out), "--scale", "1", "--scheduler", sched, "--quiet"]) == 0
        assert as_dict(pq.read_table(out)) == want
    assert main(["stats", exp.root, str(tmp_path / "x.parquet"), "--scheduler", "nonsense"]) == 2
    assert "is not one of" in capsys.readouterr().err and not (tmp_path / "x.parquet").exists()
    assert sorted(os.listdir(tmp_path)) == [f"s{k}.parquet" for k in range(3)]


# --------------------------------------------------------------------------- the real shard


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


@pytest.mark.slow  # brute force decodes every chunk of the real shard twice (~1 min)
def test_real_shard(real_export, real_records, tmp_path):
    """Statistics and the label index of the real mCNS shard equal its blocks decoded one by one."""
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
        t = body_stats_table(ds, scale=1, labels=labels, progress=False)
        check_sorted(t)
        assert as_dict(t) == want and len(want) > 50
        if labels == "agglomerated":
            with jit.fallbacks():  # what a fresh worker answers with while numba compiles
                assert as_dict(body_stats_table(ds, scale=1, labels=labels, progress=False)) == want
        rep = label_index(ds, tmp_path / labels, scale=1, labels=labels, progress=False)
        assert rep.ok and read_index(tmp_path / labels) == rows[labels]


def test_fresh_worker_counts_before_numba_has_compiled(exp, tmp_path):
    """A process with an empty numba cache: its first stats task answers through the numpy
    fallbacks (block statistics included) while the kernels compile elsewhere; the same table."""
    code = """if True:
        import json, os, sys
        from dvidshards.formats import blockstats
        from dvidshards.jobs.stats import body_stats_table
        t = body_stats_table(sys.argv[1], scale=0, labels="agglomerated", scheduler="serial", progress=False)
        rows = sorted(map(list, zip(*(t[c].to_pylist() for c in t.column_names))))
        print(json.dumps([blockstats._batch.ready, rows]), flush=True)
        os._exit(0)  # leave the compile to the helper process
    """
    from dvidshards.formats import blockstats

    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"), "DVIDSHARDS_KERNELS": "background"}
    with compiles_held(blockstats._batch, tmp_path / "numba"):  # its helper waits: the kernel cannot be ready yet
        out = subprocess.run([sys.executable, "-c", code, exp.root], env=env, capture_output=True, text=True,
                             timeout=HANG_SECONDS)
    assert out.returncode == 0, out.stderr
    ready, rows = json.loads(out.stdout)
    t = body_stats_table(exp.root, scale=0, labels="agglomerated", progress=False)
    assert ready is False
    assert rows == sorted(map(list, zip(*(t[c].to_pylist() for c in t.column_names), strict=True)))


# --------------------------------------------------------------------------- the client's memory, small


@pytest.mark.slow
def test_stats_client_memory_does_not_grow_with_bodies(tmp_path, monkeypatch):
    """stats on an external dask scheduler + 2 workers over two exports of the same size (2.6 K and
    139 K bodies): both tables exact, the client's peak RSS grows by at most 64 MiB
    (benchmarks/bench_stats_client.py runs 18 K and 1.1 M bodies)."""
    import importlib.util

    pytest.importorskip("distributed")
    path = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks", "bench_stats_client.py")
    monkeypatch.setenv("DVIDSHARDS_KERNELS", os.environ.get("DVIDSHARDS_KERNELS", "background"))  # restored after
    monkeypatch.syspath_prepend(os.path.dirname(path))
    spec = importlib.util.spec_from_file_location("bench_stats_client", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    res = bench.held_out(tmp_path, (256, 256, 128), (16, 4), log=lambda s: None)
    assert all(r["ok"] for r in res["results"].values()), res
    assert [r["rows"] for r in res["results"].values()] == [2601, 139425]
    assert res["growth"] <= 64 << 20
