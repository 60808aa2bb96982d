"""dvidshards downsample: the scales an export lacks, made the way DVID makes them, as a DVID export.

References are independent of the job: the rule counted per (cell, label) (``by_count``, held to a
plain port of DVID's ``downresArray`` in tests/formats/test_downsample.py, and the port itself on a
small volume here) applied scale by scale to the source supervoxels, TensorStore's own ``mode``
pyramid, and the supervoxel -> body mapping the export was written with.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import pytest
import tensorstore as ts

import dvidshards
from dvidshards.dataset import IncompleteScalesWarning
from dvidshards.errors import GeometryWarning, JobError, OutputError, SpecError
from dvidshards.formats.mapping import LabelMapping
from dvidshards.formats.multiscale import parse_multiscale
from dvidshards.jobs.downsample import DownsampleCommand, downsample, output_shards
from dvidshards.writer import write_export
from tests.support.data import REAL_SHARD
from tests.support.downsample import by_count, dvid_port


def _dvid_xyz(vol: np.ndarray) -> np.ndarray:
    """DVID's rule on an (x, y, z) volume of any size: padded with 0 (votes for nothing), halved."""
    pad = np.zeros(tuple(s + s % 2 for s in vol.shape), np.uint64)
    pad[:vol.shape[0], :vol.shape[1], :vol.shape[2]] = vol
    return by_count(pad.transpose(2, 1, 0)).transpose(2, 1, 0)


def _mode_xyz(vol: np.ndarray) -> np.ndarray:
    return ts.downsample(ts.array(vol), [2, 2, 2], "mode").read().result()


class S0Only:
    """An s0-only export of a neuron volume and the spec of its whole pyramid."""

    def __init__(self, root, shape, scales, shard_chunks, seed=3):
        from dvidshards.demo.neurons import neuron_volume

        self.sv, self.mapping = neuron_volume(shape, n_bodies=10, svs_per_body=4, seed=seed)
        self.sv = np.asarray(self.sv, np.uint64)
        self.spec = _pyramid_spec(shape, scales, shard_chunks)  # every scale's, as write_export gives it
        write_export(self.sv, root, mapping=self.mapping, scales=1, shard_chunks=shard_chunks)
        self.root = str(root)

    def reference(self, method: str, k: int) -> np.ndarray:
        """Scale k by ``method`` from s0, each scale from the one below (made once, read-only)."""
        made = self.__dict__.setdefault("_made", {(m, 0): self.sv for m in ("dvid", "mode")})
        if (method, k) not in made:
            below = self.reference(method, k - 1)
            made[method, k] = _dvid_xyz(below) if method == "dvid" else _mode_xyz(below)
            made[method, k].setflags(write=False)
        return made[method, k]


def _pyramid_spec(shape, scales, shard_chunks) -> dict:
    """write_export's spec of ``scales`` scales of a volume of ``shape`` (the sizes and sharding DVID gets)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:  # a volume of 0: no shard written, the spec returned
        return write_export(np.zeros(shape, np.uint64), os.path.join(d, "e"), scales=scales,
                            shard_chunks=shard_chunks)


@pytest.fixture(scope="module")
def s0_only(tmp_path_factory):
    return S0Only(tmp_path_factory.mktemp("s0only") / "exp", (200, 170, 150), 4, 2)


def _check_pyramid(exp: S0Only, dest, method: str, scales) -> None:
    """Every made scale, read through Dataset(dest), equals the reference; bodies the mapping's."""
    ds = dvidshards.Dataset(dest)
    mapping = LabelMapping.from_any(exp.mapping)
    for k in scales:
        ref = exp.reference(method, k)
        s = ds.scale(k)
        assert tuple(s.size) == ref.shape
        box = [[0, 0, 0], list(ref.shape)]
        np.testing.assert_array_equal(ds.read(box, scale=k, labels="supervoxels"), ref, err_msg=f"s{k} supervoxels")
        np.testing.assert_array_equal(ds.read(box, scale=k), mapping(ref), err_msg=f"s{k} bodies")


def _records(root, k):
    """Every record of scale k of an export (pyarrow), as dicts."""
    import pyarrow as pa

    out = []
    for f in sorted(os.listdir(os.path.join(root, f"s{k}"))):
        if f.endswith(".arrow"):
            with pa.OSFile(os.path.join(root, f"s{k}", f)) as fh:
                for b in pa.ipc.open_stream(fh):
                    out += b.to_pylist()
    return out


# --------------------------------------------------------------------------- the pyramid


def test_s0_only_export_dvid_rule(s0_only, tmp_path):
    dest = tmp_path / "out"
    rep = downsample(s0_only.root, dest, spec=s0_only.spec, progress=False)
    assert rep.ok and rep.complete and rep.scales == [1, 2, 3]
    _check_pyramid(s0_only, dest, "dvid", [1, 2, 3])
    # the destination is a DVID export of the made scales: s1..s3, info, manifest
    names = sorted(os.listdir(dest))
    assert names == ["_dvidshards.json", "_dvidshards.sizes.json", "info", "s1", "s2", "s3"]
    m = json.loads((dest / "_dvidshards.json").read_text())
    assert m["job"] == "downsample" and m["complete"] is True and m["scales"] == [1, 2, 3]
    assert m["source"]["url"] == os.path.abspath(s0_only.root)
    assert m["parameters"]["method"] == "dvid"
    assert json.loads((dest / "info").read_text()) == s0_only.spec
    # every record: its labels are the mapping of its supervoxels, its supervoxels its block's list,
    # no all-0 block, the CSV index variant A
    mapping = LabelMapping.from_any(s0_only.mapping)
    for k in (1, 2, 3):
        for r in _records(dest, k):
            sv = np.array(r["supervoxels"], np.uint64)
            assert r["labels"] == mapping(sv).tolist() and any(r["labels"])
            block = dvidshards.decode_block(__import__("zstandard").ZstdDecompressor().decompress(
                r["dvid_compressed_block"]))
            assert set(np.unique(block).tolist()) == set(sv.tolist())
        for f in os.listdir(dest / f"s{k}"):
            if f.endswith(".csv"):
                head = (dest / f"s{k}" / f).read_text().splitlines()[:2]
                assert head[0].startswith("# schema_size=") and head[1] == "x,y,z,offset,size,batch_idx"
    # the source is untouched and reads the same; dvidshards.open of [source, dest] is the pyramid too
    vol = dvidshards.open([s0_only.root, str(dest)], scale=2, labels="supervoxels")
    np.testing.assert_array_equal(vol.read().result(), s0_only.reference("dvid", 2))


def test_the_plain_port_of_dvid_on_a_small_volume(tmp_path):
    exp = S0Only(tmp_path / "exp", (46, 38, 30), 2, 1, seed=7)
    rep = downsample(exp.root, tmp_path / "out", spec=exp.spec, progress=False)
    assert rep.ok
    ds = dvidshards.Dataset(tmp_path / "out")
    pad = np.zeros((46, 38, 30), np.uint64)
    pad[...] = exp.sv
    ref = dvid_port(pad.transpose(2, 1, 0)).transpose(2, 1, 0)
    np.testing.assert_array_equal(ds.read([[0, 0, 0], [23, 19, 15]], scale=1, labels="supervoxels"), ref)


def test_mode_equals_tensorstore(s0_only, tmp_path):
    dest = tmp_path / "out"
    rep = downsample(s0_only.root, dest, spec=s0_only.spec, method="mode", progress=False)
    assert rep.ok
    _check_pyramid(s0_only, dest, "mode", [1, 2, 3])
    assert json.loads((dest / "_dvidshards.json").read_text())["parameters"]["method"] == "mode"


@pytest.mark.parametrize("shape,chunks", [((77, 45, 101), 1), ((130, 67, 129), 2), ((65, 200, 33), 1)])
def test_odd_sizes_every_scale(tmp_path, shape, chunks):
    """Odd sizes at every scale; 1-chunk shards make every output block read 8 source files."""
    scales = 1 + (max(shape) - 1).bit_length() - 5  # down to a scale of a few voxels
    exp = S0Only(tmp_path / "exp", shape, scales, chunks, seed=sum(shape))
    for method in ("dvid", "mode"):
        dest = tmp_path / method
        rep = downsample(exp.root, dest, spec=exp.spec, method=method, progress=False, scheduler="serial")
        assert rep.ok, rep.summary()
        _check_pyramid(exp, dest, method, range(1, scales))


def test_threads_equal_serial(s0_only, tmp_path):
    a = downsample(s0_only.root, tmp_path / "a", spec=s0_only.spec, scheduler="serial", progress=False)
    b = downsample(s0_only.root, tmp_path / "b", spec=s0_only.spec, scheduler="threads:2", progress=False)
    assert a.ok and b.ok and a.totals.to_json() == b.totals.to_json()
    for k in (1, 2, 3):
        for f in os.listdir(tmp_path / "a" / f"s{k}"):
            assert (tmp_path / "a" / f"s{k}" / f).read_bytes() == (tmp_path / "b" / f"s{k}" / f).read_bytes()


@pytest.mark.slow
def test_dask_workers_equal_serial(s0_only, tmp_path):
    """Tasks pickled to spawned dask workers (a LocalCluster of 2) write the same files."""
    pytest.importorskip("distributed")
    a = downsample(s0_only.root, tmp_path / "a", spec=s0_only.spec, scheduler="serial", progress=False)
    b = downsample(s0_only.root, tmp_path / "b", spec=s0_only.spec, scheduler="local:2", progress=False)
    assert a.ok and b.ok, b.summary()
    for k in (1, 2, 3):
        for f in os.listdir(tmp_path / "a" / f"s{k}"):
            assert (tmp_path / "a" / f"s{k}" / f).read_bytes() == (tmp_path / "b" / f"s{k}" / f).read_bytes()


def test_labels_supervoxels_and_a_mapping_file(s0_only, tmp_path):
    rep = downsample(s0_only.root, tmp_path / "sv", spec=s0_only.spec, labels="supervoxels", scales=[1],
                     progress=False)
    assert rep.ok
    for r in _records(tmp_path / "sv", 1):
        assert r["labels"] == r["supervoxels"]
    # a newer mapping: every supervoxel of body B now in body B + 1
    m = LabelMapping.from_any(s0_only.mapping)
    path = tmp_path / "mapping.txt"
    path.write_text("".join(f"{a} {b + 1}\n" for a, b in zip(m.keys.tolist(), m.values.tolist(), strict=True)))
    rep = downsample(s0_only.root, tmp_path / "mapped", spec=s0_only.spec, labels=str(path), scales=[1, 2],
                     progress=False)
    assert rep.ok
    newer = LabelMapping.from_file(str(path))
    for r in _records(tmp_path / "mapped", 2):
        assert r["labels"] == newer(np.array(r["supervoxels"], np.uint64)).tolist()
    assert json.loads((tmp_path / "mapped" / "_dvidshards.json").read_text())["parameters"]["labels"] == "mapped"


def test_records_that_disagree_on_a_body(tmp_path):
    """Two records naming different bodies for one supervoxel: the first child's is kept, and said."""
    from dvidshards.writer import write_shard

    exp = S0Only(tmp_path / "exp", (128, 128, 128), 2, 2)
    recs = _records(exp.root, 0)
    by = {(r["chunk_x"], r["chunk_y"], r["chunk_z"]): r for r in recs}
    # a supervoxel in two children of one output block, and in its output: its body changed in the later
    # child (octant order: z, y, x)
    made = downsample(exp.root, tmp_path / "before", spec=exp.spec, progress=False)
    assert made.ok and made.totals.conflicts == 0
    out_svs = {(r["chunk_x"], r["chunk_y"], r["chunk_z"]): set(r["supervoxels"]) for r in _records(tmp_path / "before", 1)}
    sv, first, later = next((sv, a, b) for a in by for b in by if a[::-1] < b[::-1]
                            and tuple(v // 2 for v in a) == tuple(v // 2 for v in b)
                            for sv in set(by[a]["supervoxels"]) & set(by[b]["supervoxels"])
                            if sv and sv in out_svs.get(tuple(v // 2 for v in a), ()))
    r = by[later]
    r["labels"] = [lab + 1 if s == sv else lab for s, lab in zip(r["supervoxels"], r["labels"], strict=True)]
    write_shard(os.path.join(exp.root, "s0", "0_0_0"), recs)
    rep = downsample(exp.root, tmp_path / "out", spec=exp.spec, progress=False)
    assert rep.ok and rep.totals.conflicts >= 1 and any("different bodies" in n for n in rep.notes)
    body = dict(zip(by[first]["supervoxels"], by[first]["labels"], strict=True))[sv]
    out = next(r for r in _records(tmp_path / "out", 1)
               if (r["chunk_x"], r["chunk_y"], r["chunk_z"]) == tuple(v // 2 for v in first))
    assert dict(zip(out["supervoxels"], out["labels"], strict=True))[sv] == body


def test_scales_asked(s0_only, tmp_path):
    """--scales 2: s1 is made too (s2 is made from it); a scale the spec lacks is refused."""
    rep = downsample(s0_only.root, tmp_path / "out", spec=s0_only.spec, scales=[2], progress=False)
    assert rep.ok and rep.scales == [1, 2] and any("also made s1" in n for n in rep.notes)
    assert sorted(os.listdir(tmp_path / "out")) == ["_dvidshards.json", "_dvidshards.sizes.json", "info", "s1", "s2"]
    with pytest.raises(SpecError, match="scale 7"):
        downsample(s0_only.root, tmp_path / "x", spec=s0_only.spec, scales=[7], progress=False)
    assert not (tmp_path / "x").exists()


def test_remaking_a_scale_the_export_holds(tmp_path):
    """--scales 1 2 over an export holding s0 and s1 (made with TensorStore's mode): s2 is made from
    the s1 this job made (DVID's rule), not from the export's."""
    from dvidshards.demo.neurons import neuron_volume

    sv, mapping = neuron_volume((160, 150, 140), n_bodies=12, svs_per_body=4, seed=11)
    spec = _pyramid_spec((160, 150, 140), 3, 1)
    write_export(sv, tmp_path / "exp", mapping=mapping, scales=2, shard_chunks=1)
    rep = downsample(str(tmp_path / "exp"), tmp_path / "out", spec=spec, scales=[1, 2], progress=False)
    assert rep.ok and rep.scales == [1, 2]
    want = _dvid_xyz(_dvid_xyz(np.asarray(sv, np.uint64)))
    assert not np.array_equal(want, _dvid_xyz(_mode_xyz(np.asarray(sv, np.uint64))))  # the test can tell
    got = dvidshards.Dataset(tmp_path / "out").read([[0, 0, 0], list(want.shape)], scale=2, labels="supervoxels")
    np.testing.assert_array_equal(got, want)


def test_a_downsample_output_as_the_source(s0_only, tmp_path):
    """s1 made first; then s2, s3 made from it, reading the first output over its source."""
    assert downsample(s0_only.root, tmp_path / "d1", spec=s0_only.spec, scales=[1], progress=False).ok
    rep = downsample(str(tmp_path / "d1"), tmp_path / "d2", progress=False)
    assert rep.ok and rep.scales == [2, 3]
    _check_pyramid(s0_only, tmp_path / "d2", "dvid", [1, 2, 3])
    assert dvidshards.Dataset(tmp_path / "d2").exported == (0, 1, 2, 3)


# --------------------------------------------------------------------------- resume, failures


def _files(root):
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            out[os.path.relpath(p, root)] = (os.stat(p).st_ino, open(p, "rb").read())
    return out


def test_resume_after_a_killed_task(tmp_path):
    exp = S0Only(tmp_path / "exp", (200, 170, 150), 4, 1)
    dest = tmp_path / "out"
    rep = downsample(exp.root, dest, spec=exp.spec, progress=False, allow_partial=True, _stop_after=5)
    m = json.loads((dest / "_dvidshards.json").read_text())
    assert not rep.complete and m["complete"] is False and rep.done == 5 and not rep.failed
    with pytest.warns(IncompleteScalesWarning):
        dvidshards.Dataset(dest)
    before = _files(dest / "s1")
    with pytest.raises(OutputError, match="--resume"):
        downsample(exp.root, dest, spec=exp.spec, progress=False)
    with pytest.raises(OutputError, match="other parameters"):
        downsample(exp.root, dest, spec=exp.spec, method="mode", progress=False, resume=True)
    rep = downsample(exp.root, dest, spec=exp.spec, progress=False, resume=True)
    assert rep.ok and rep.complete and rep.skipped == 5
    after = _files(dest / "s1")
    assert all(after[f] == before[f] for f in before)  # kept, not rewritten (same inode, same bytes)
    _check_pyramid(exp, dest, "dvid", [1, 2, 3])
    assert json.loads((dest / "_dvidshards.json").read_text())["complete"] is True
    # a fresh run writes the same files
    fresh = tmp_path / "fresh"
    assert downsample(exp.root, fresh, spec=exp.spec, progress=False).ok
    for k in (1, 2, 3):
        for f in os.listdir(fresh / f"s{k}"):
            assert (fresh / f"s{k}" / f).read_bytes() == (dest / f"s{k}" / f).read_bytes()


def test_a_failed_task_stops_the_coarser_scales_and_resume_finishes(tmp_path):
    exp = S0Only(tmp_path / "exp", (200, 170, 150), 3, 1)
    victim = sorted(f for f in os.listdir(os.path.join(exp.root, "s0")) if f.endswith(".arrow"))[1]
    path = os.path.join(exp.root, "s0", victim)
    good = open(path, "rb").read()
    with open(path, "r+b") as f:
        f.truncate(len(good) // 2)
    dest = tmp_path / "out"
    with pytest.raises(JobError) as e:
        downsample(exp.root, dest, spec=exp.spec, progress=False)
    rep = e.value.report
    assert not rep.complete and len(rep.failed) == 1
    (item, msg), = rep.failed.items()
    assert item.startswith("s1/") and victim in msg
    assert any("s2 not made" in n for n in rep.notes)
    assert not (dest / "s2").exists()
    m = json.loads((dest / "_dvidshards.json").read_text())
    assert m["complete"] is False and list(m["failed"]) == [item]
    with open(path, "wb") as f:  # repaired
        f.write(good)
    rep = downsample(exp.root, dest, spec=exp.spec, progress=False, resume=True)
    assert rep.ok and rep.skipped == rep.tasks - len(dvidshards.Dataset(dest).shards(2)) - 1
    _check_pyramid(exp, dest, "dvid", [1, 2])


def test_damaged_block_named(tmp_path):
    """A record whose block is damaged fails its task naming the file and chunk."""
    import pyarrow as pa
    import zstandard

    from dvidshards.writer import write_shard

    exp = S0Only(tmp_path / "exp", (130, 130, 130), 2, 4)
    stem = os.path.join(exp.root, "s0", "0_0_0")
    recs = _records(exp.root, 0)
    r = recs[3]
    block = bytearray(zstandard.ZstdDecompressor().decompress(r["dvid_compressed_block"]))
    n = int.from_bytes(block[12:16], "little")
    if n > 1:
        block[16 + 8 * n] = 0xFF  # sub-block 0 claims 255 labels
        block[17 + 8 * n] = 0x01
    else:
        block[0] = 3  # an odd grid
    r["dvid_compressed_block"] = zstandard.ZstdCompressor(write_content_size=True).compress(bytes(block))
    r["uncompressed_size"] = len(block)
    write_shard(stem, recs)
    del pa
    with pytest.raises(JobError) as e:
        downsample(exp.root, tmp_path / "out", spec=exp.spec, progress=False)
    msg = next(iter(e.value.report.failed.values()))
    assert "BlockDecodeError" in msg and "0_0_0.arrow" in msg and f"chunk {(r['chunk_x'], r['chunk_y'], r['chunk_z'])}" in msg


# --------------------------------------------------------------------------- refused before any work


def test_refusals(s0_only, tmp_path):
    with pytest.raises(SpecError, match="--spec"), pytest.warns(GeometryWarning):  # no spec: scales unknown
        downsample(s0_only.root, tmp_path / "a", progress=False)
    with pytest.raises(OutputError, match="inside the export"):
        downsample(s0_only.root, os.path.join(s0_only.root, "pyramid"), spec=s0_only.spec, progress=False)
    with pytest.raises(OutputError, match="not http"):
        downsample(s0_only.root, "http://example.com/x", spec=s0_only.spec, progress=False)
    with pytest.raises(OutputError, match="slash missing"):
        downsample(s0_only.root, "gs:/bucket/x", spec=s0_only.spec, progress=False)
    with pytest.raises(SpecError, match="method"):
        downsample(s0_only.root, tmp_path / "b", spec=s0_only.spec, method="max", progress=False)
    one = dict(s0_only.spec, scales=s0_only.spec["scales"][:1])
    with pytest.raises(SpecError, match="nothing to make"):
        downsample(s0_only.root, tmp_path / "c", spec=one, progress=False)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match="notes.txt"):
        downsample(s0_only.root, tmp_path / "busy", spec=s0_only.spec, progress=False)
    assert os.listdir(tmp_path / "busy") == ["notes.txt"]
    assert not any((tmp_path / n).exists() for n in "abc")


def test_overwrite_and_resume_of_a_complete_output(s0_only, tmp_path):
    dest = tmp_path / "out"
    assert downsample(s0_only.root, dest, spec=s0_only.spec, scales=[1, 2], progress=False).ok
    (dest / "notes.txt").write_text("mine")
    (dest / "s2" / "stale.arrow").write_bytes(b"not a shard")
    rep = downsample(s0_only.root, dest, spec=s0_only.spec, scales=[1, 2], method="mode", progress=False,
                     overwrite=True)
    assert rep.ok and not (dest / "s2" / "stale.arrow").exists() and (dest / "notes.txt").read_text() == "mine"
    _check_pyramid(s0_only, dest, "mode", [1, 2])
    again = downsample(s0_only.root, dest, spec=s0_only.spec, scales=[1, 2], method="mode", progress=False,
                       resume=True)
    assert again.ok and again.done == 0 and again.skipped == rep.done


def test_command_line(s0_only, tmp_path, capsys):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(s0_only.spec))
    p = argparse.ArgumentParser()
    DownsampleCommand.add_arguments(p)
    args = p.parse_args([s0_only.root, str(tmp_path / "out"), "--spec", str(spec), "--scales", "1", "2",
                         "--method", "mode", "--quiet"])
    assert DownsampleCommand.main(args) == 0
    out = capsys.readouterr().out
    assert "complete" in out and "s1, s2 made from s0 (mode rule)" in out
    m = json.loads((tmp_path / "out" / "_dvidshards.json").read_text())
    assert m["command"].startswith("dvidshards downsample") and "--method mode" in m["command"]
    assert m["scales"] == [1, 2]


# --------------------------------------------------------------------------- geometry


def test_plan_reads_dvid_old_named_files(dvid_data):
    """With the mCNS spec at s7 (old names: 1024-voxel files where today's shard is 1088), s8's one
    output shard reads both s7 files; today's names: one."""
    spec = json.loads((dvid_data / "mcns-ng-specs.json").read_text())
    scales = parse_multiscale(spec)
    s7, s8 = scales[7], scales[8]
    old = s7.with_naming("old")
    assert old.shard_extent == 1024 and s7.shard_extent == 1088
    tasks = output_shards(old, s8, [(0, 0, 0), (0, 0, 1024)])
    assert tasks == [((0, 0, 0), ((0, 0, 0), (0, 0, 1024)))]
    assert output_shards(s7, s8, [(0, 0, 0)]) == [((0, 0, 0), ((0, 0, 0),))]
    # mCNS s0 -> s1: an output shard of 2048 voxels reads the 8 source shards of 2048 it covers
    s0, s1 = scales[0], scales[1]
    src = [(x, y, z) for x in (0, 2048) for y in (0, 2048) for z in (0, 2048)]
    assert output_shards(s0, s1, src) == [((0, 0, 0), tuple(sorted(src)))]


@pytest.fixture(scope="module")
def real_pyramid(dvid_data, tmp_path_factory):
    """The real mCNS shard as s0 of an s0-only export with the real 12-scale spec, downsampled."""
    spec = json.loads((dvid_data / "mcns-ng-specs.json").read_text())
    tmp = tmp_path_factory.mktemp("real")
    root = tmp / "exp"
    (root / "s0").mkdir(parents=True)
    (root / "s0" / f"{REAL_SHARD}.arrow").symlink_to(dvid_data / f"{REAL_SHARD}.arrow")
    (root / "s0" / f"{REAL_SHARD}.csv").symlink_to(dvid_data / f"{REAL_SHARD}-newformat.csv")
    dest = tmp / "out"
    rep = downsample(str(root), dest, spec=spec, progress=False)
    src = dvidshards.Dataset(str(root), spec=spec)
    t = src.shard(0, tuple(int(v) for v in REAL_SHARD.split("_"))).table()
    keys, values = [], []
    for i in range(len(t)):  # each supervoxel's body as the real records pair them
        keys.append(t.supervoxels(i))
        values.append(t.labels(i))
    pairs = LabelMapping.from_any(np.stack([np.concatenate(keys), np.concatenate(values)], axis=1))
    return spec, rep, src, dvidshards.Dataset(dest), pairs


def _real_checks(real_pyramid, n1: int, n2: int) -> None:
    spec, rep, src, ds, pairs = real_pyramid
    chunks = ds.chunks(1)
    rng = np.random.default_rng(0)
    for c in chunks[rng.choice(len(chunks), n1, replace=False)]:
        lo = c * 64
        region = src.read([(2 * lo).tolist(), (2 * lo + 128).tolist()], scale=0, labels="supervoxels")
        ref = by_count(region.transpose(2, 1, 0)).transpose(2, 1, 0)
        np.testing.assert_array_equal(ds.read([lo.tolist(), (lo + 64).tolist()], scale=1, labels="supervoxels"), ref)
        np.testing.assert_array_equal(ds.read([lo.tolist(), (lo + 64).tolist()], scale=1), pairs(ref))
    c2s = ds.chunks(2)
    for c2 in c2s[rng.choice(len(c2s), n2, replace=False)]:  # s2: from the s0 chunks through the rule twice
        lo = c2 * 64
        region = src.read([(4 * lo).tolist(), (4 * lo + 256).tolist()], scale=0, labels="supervoxels")
        ref = by_count(by_count(region.transpose(2, 1, 0))).transpose(2, 1, 0)
        np.testing.assert_array_equal(ds.read([lo.tolist(), (lo + 64).tolist()], scale=2, labels="supervoxels"), ref)
        np.testing.assert_array_equal(ds.read([lo.tolist(), (lo + 64).tolist()], scale=2), pairs(ref))


def test_real_shard_as_scale_0(real_pyramid):
    """The real mCNS shard as s0 of an s0-only export with the real 12-scale spec: s1 and s2 are DVID's
    rule on its real supervoxels, bodies by its records' own pairs."""
    spec, rep, src, ds, pairs = real_pyramid
    assert rep.ok and rep.scales == list(range(1, 12))
    assert ds.exported == tuple(range(12)) and len(ds.chunks(1)) == 51
    assert ds.scale(11).size == tuple(spec["scales"][11]["size"])
    _real_checks(real_pyramid, 2, 0)
    c2 = ds.chunks(2)[0]  # s2 from the s1 made (the slow test checks it from s0)
    lo = c2 * 64
    s1 = ds.read([(2 * lo).tolist(), (2 * lo + 128).tolist()], scale=1, labels="supervoxels")
    ref = by_count(s1.transpose(2, 1, 0)).transpose(2, 1, 0)
    np.testing.assert_array_equal(ds.read([lo.tolist(), (lo + 64).tolist()], scale=2, labels="supervoxels"), ref)
    np.testing.assert_array_equal(ds.read([lo.tolist(), (lo + 64).tolist()], scale=2), pairs(ref))


@pytest.mark.slow
def test_real_shard_as_scale_0_every_chunk(real_pyramid):
    spec, rep, src, ds, pairs = real_pyramid
    _real_checks(real_pyramid, len(ds.chunks(1)), len(ds.chunks(2)))


# --------------------------------------------------------------------------- destinations


def test_a_bucket_destination(s0_only, tmp_path, monkeypatch):
    """s3://: the shards are built in the temporary folder and published index first; the scale below
    each made one is read back from the bucket; the output equals a local run's, object for object."""
    pytest.importorskip("moto.server")
    import tempfile

    from tests.support.servers import MotoS3

    local = downsample(s0_only.root, tmp_path / "local", spec=s0_only.spec, progress=False)
    assert local.ok
    (tmp_path / "stage").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "stage"))
    with MotoS3() as s3:
        c = s3.bucket("seg")
        url = f"s3://seg/pyr/out?endpoint_override=127.0.0.1:{s3.port}&scheme=http&region={s3.REGION}"
        rep = downsample(s0_only.root, url, spec=s0_only.spec, progress=False)
        assert rep.ok, rep.summary()
        keys = {o["Key"] for o in c.list_objects_v2(Bucket="seg", Prefix="pyr/out/")["Contents"]}
        got = {k[len("pyr/out/"):]: c.get_object(Bucket="seg", Key=k)["Body"].read() for k in keys}
        want = {os.path.relpath(os.path.join(d, f), tmp_path / "local"): open(os.path.join(d, f), "rb").read()
                for d, _, fs in os.walk(tmp_path / "local") for f in fs}
        assert set(got) == set(want)
        assert all(got[k] == want[k] for k in want if k != "_dvidshards.json")
        assert json.loads(got["_dvidshards.json"])["complete"] is True
        assert os.listdir(tmp_path / "stage") == []  # staged shards removed
        ds = dvidshards.Dataset(s3.spec("seg", "pyr/out/"))
        np.testing.assert_array_equal(ds.read([[0, 0, 0], [25, 22, 19]], scale=3, labels="supervoxels"),
                                      s0_only.reference("dvid", 3))


def test_memory_destination_refused_for_several_scales(s0_only):
    with pytest.raises(SpecError, match="memory://"):
        downsample(s0_only.root, "memory://pyr/", spec=s0_only.spec, progress=False)


def test_a_remade_scale_is_read_from_the_destination(tmp_path):
    """--scales 1 over an export that holds s1: Dataset(dest) reads the made s1, not the source's copy."""
    import dvidshards
    from dvidshards.demo import dvid_downsample
    from dvidshards.demo.neurons import neuron_volume
    from dvidshards.jobs.downsample import downsample

    sv, mapping = neuron_volume((96, 80, 70), n_bodies=4, svs_per_body=3, seed=3)
    spec = dvidshards.write_export(sv, tmp_path / "exp", mapping=mapping, scales=2)  # s1 by TensorStore's mode
    downsample(tmp_path / "exp", tmp_path / "down", spec=spec, scales=[1], progress=False)
    ds = dvidshards.Dataset(tmp_path / "down")
    box = [[0, 0, 0], list(ds.scale(1).size)]
    np.testing.assert_array_equal(ds.read(box, scale=1, labels="supervoxels"), dvid_downsample(sv))
    both = dvidshards.Dataset([tmp_path / "exp", tmp_path / "down"], spec=spec)
    np.testing.assert_array_equal(both.read(box, scale=1, labels="supervoxels"), dvid_downsample(sv))


# --------------------------------------------------------------------------- a pyramid and its source


def _verify_cli(capsys, *args) -> tuple[int, str]:
    from dvidshards.cli import main

    code = main(["verify", *map(str, args), "--quiet"])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_a_pyramid_whose_export_was_replaced_is_refused_and_verify_says_so(tmp_path, capsys):
    """Another export copied over the source: opening the pyramid (alone, or with the export given
    again) is a SpecError that says what to do, never the new s0 under the old s1; verify finds it."""
    import shutil

    exp = S0Only(tmp_path / "exp", (130, 100, 90), 3, 1, seed=3)
    pyr = tmp_path / "pyr"
    assert downsample(exp.root, pyr, spec=exp.spec, progress=False).ok
    assert _verify_cli(capsys, pyr)[0] == 0
    other = S0Only(tmp_path / "other", (130, 100, 90), 3, 1, seed=9)  # same geometry, other bodies
    shutil.rmtree(exp.root)
    shutil.copytree(other.root, exp.root)
    for roots in (pyr, [exp.root, pyr], [pyr, exp.root]):
        with pytest.raises(SpecError, match="has changed since") as e:
            dvidshards.Dataset(roots)
        assert "--overwrite" in str(e.value) and "s1, s2" in str(e.value) and "0_0_0.arrow" in str(e.value)
    code, out = _verify_cli(capsys, pyr)
    assert code == 1 and "has changed since" in out and "no problems" not in out, out
    # made again, the pair reads as the new export's pyramid
    assert downsample(exp.root, pyr, spec=exp.spec, progress=False, overwrite=True).ok
    np.testing.assert_array_equal(dvidshards.Dataset(pyr).read([[0, 0, 0], [65, 50, 45]], scale=1,
                                                               labels="supervoxels"), other.reference("dvid", 1))


def test_one_changed_shard_file_is_found_by_verify(tmp_path, capsys):
    """A source shard file the open's sample does not look at (36 files, 16 looked at), rewritten:
    the pyramid opens, and verify compares every file's size."""
    from dvidshards.pyramid import downsample_manifest
    from dvidshards.stores import as_store
    from dvidshards.writer import write_shard

    exp = S0Only(tmp_path / "exp", (200, 170, 150), 3, 1, seed=4)
    pyr = tmp_path / "pyr"
    assert downsample(exp.root, pyr, spec=exp.spec, progress=False).ok
    sample = downsample_manifest(as_store(str(pyr)))["source"]["identity"]["sample"]
    files = sorted(f"s0/{f}" for f in os.listdir(os.path.join(exp.root, "s0")) if f.endswith(".arrow"))
    victim = next(f for f in files if f not in sample)
    write_shard(os.path.join(exp.root, victim[:-6]), _records_of(exp.root, victim),
                with_uncompressed_size=False)  # the same blocks in other bytes
    dvidshards.Dataset(pyr)  # the sample still matches
    code, out = _verify_cli(capsys, pyr)
    assert code == 1 and "SourceChanged" in out and victim in out, out


def _records_of(root, key):
    import pyarrow as pa

    with pa.OSFile(os.path.join(root, key)) as fh:
        return [r for b in pa.ipc.open_stream(fh) for r in b.to_pylist()]


def test_a_pyramid_moved_with_its_export_still_opens(tmp_path):
    """Moved together (the manifest's relative path), or given again after a move that broke it."""
    import shutil

    exp = S0Only(tmp_path / "a" / "exp", (130, 100, 90), 3, 1, seed=3)
    assert downsample(exp.root, tmp_path / "a" / "pyr", spec=exp.spec, progress=False).ok
    shutil.move(tmp_path / "a", tmp_path / "b")
    want = exp.reference("dvid", 2)
    box = [[0, 0, 0], list(want.shape)]
    for roots in (tmp_path / "b" / "pyr", [tmp_path / "b" / "exp", tmp_path / "b" / "pyr"]):
        np.testing.assert_array_equal(dvidshards.Dataset(roots).read(box, scale=2, labels="supervoxels"), want)
    shutil.move(tmp_path / "b" / "exp", tmp_path / "elsewhere")  # the relative path leads nowhere now
    with pytest.raises(SpecError, match="give it with it"):
        dvidshards.Dataset(tmp_path / "b" / "pyr")
    vol = dvidshards.open([tmp_path / "elsewhere", tmp_path / "b" / "pyr"], scale=2, labels="supervoxels")
    np.testing.assert_array_equal(vol.read().result(), want)


def test_a_pyramid_uploaded_with_its_export_opens_from_the_bucket(tmp_path):
    pytest.importorskip("moto.server")
    from tests.support.servers import MotoS3

    exp = S0Only(tmp_path / "exp", (130, 100, 90), 3, 1, seed=3)
    assert downsample(exp.root, tmp_path / "pyr", spec=exp.spec, progress=False).ok
    with MotoS3() as s3:
        s3.upload_dir("seg", tmp_path / "exp", "v1/exp/")
        s3.upload_dir("seg", tmp_path / "pyr", "v1/pyr/")
        ds = dvidshards.Dataset(s3.spec("seg", "v1/pyr/"))
        assert ds.store.describe("s0/0_0_0.arrow").endswith("seg/v1/exp/s0/0_0_0.arrow")
        np.testing.assert_array_equal(ds.read([[0, 0, 0], [33, 25, 23]], scale=2, labels="supervoxels"),
                                      exp.reference("dvid", 2))


def test_resume_refuses_when_kept_shards_were_made_from_files_that_changed(tmp_path):
    import shutil

    exp = S0Only(tmp_path / "exp", (200, 170, 150), 3, 1)
    dest = tmp_path / "out"
    rep = downsample(exp.root, dest, spec=exp.spec, progress=False, allow_partial=True, _stop_after=5)
    assert not rep.complete
    other = S0Only(tmp_path / "other", (200, 170, 150), 3, 1, seed=8)
    shutil.rmtree(exp.root)
    shutil.copytree(other.root, exp.root)
    with pytest.raises(OutputError, match="has changed since the earlier run"):
        downsample(exp.root, dest, spec=exp.spec, progress=False, resume=True)
    assert downsample(exp.root, dest, spec=exp.spec, progress=False, overwrite=True).ok
    _check_pyramid(other, dest, "dvid", [1, 2])


# --------------------------------------------------------------------------- background, a box


def test_a_made_scale_that_is_all_background_holds_background(s0_only, tmp_path, capsys):
    """A mapping that sends every body to 0: the made scales hold no record (DVID skips them) and
    read as 0 everywhere; info, verify and reads never call them not exported."""
    from dvidshards.cli import main

    m = LabelMapping.from_any(s0_only.mapping)
    zero = tmp_path / "zero.txt"
    zero.write_text("".join(f"{a} 0\n" for a in m.keys.tolist()))
    dest = tmp_path / "out"
    rep = downsample(s0_only.root, dest, spec=s0_only.spec, labels=str(zero), progress=False)
    assert rep.ok and any("background" in n for n in rep.notes), rep.summary()
    manifest = json.loads((dest / "_dvidshards.json").read_text())
    assert manifest["background"] == [1, 2, 3] and manifest["complete"] is True
    ds = dvidshards.Dataset(dest)
    for k in (1, 2, 3):
        assert ds.shards(k) == [] and k in ds.exported
        size = list(ds.scale(k).size)
        assert not ds.read([[0, 0, 0], size], scale=k).any()
        assert not dvidshards.open(dest, scale=k).read().result().any()
    assert main(["info", str(dest)]) == 0
    out = capsys.readouterr().out
    assert "not exported" not in out and "downsample" not in out
    code, said = _verify_cli(capsys, dest)
    assert code == 0 and "no problems" in said and "downsample" not in said.split("\n", 1)[1], said


def test_box_makes_the_pyramid_of_the_box(s0_only, tmp_path, capsys):
    """--box: the pyramid of the export cut to the box (0 outside), made from the records meeting it;
    the scales hold only the shards meeting the box, and read as 0 elsewhere."""
    box = [[37, 64, 20], [151, 117, 141]]
    cut = np.zeros_like(s0_only.sv)
    (x0, y0, z0), (x1, y1, z1) = box
    cut[x0:x1, y0:y1, z0:z1] = s0_only.sv[x0:x1, y0:y1, z0:z1]
    for method in ("dvid", "mode"):
        dest = tmp_path / method
        rep = downsample(s0_only.root, dest, spec=s0_only.spec, method=method, box=box, progress=False)
        assert rep.ok, rep.summary()
        ds = dvidshards.Dataset(dest)
        ref = cut
        for k in (1, 2, 3):
            ref = _dvid_xyz(ref) if method == "dvid" else _mode_xyz(ref)
            np.testing.assert_array_equal(ds.read([[0, 0, 0], list(ref.shape)], scale=k, labels="supervoxels"), ref,
                                          err_msg=f"{method} s{k}")
        assert 0 < len(ds.shards(1)) < len(dvidshards.Dataset(s0_only.root, spec=s0_only.spec).shards(0))
    assert json.loads((tmp_path / "dvid" / "_dvidshards.json").read_text())["parameters"]["box"] == box
    p = argparse.ArgumentParser()
    DownsampleCommand.add_arguments(p)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(s0_only.spec))
    args = p.parse_args([s0_only.root, str(tmp_path / "cli"), "--spec", str(spec), "--box", "37", "64", "20", "151",
                         "117", "141", "--quiet"])
    assert DownsampleCommand.main(args) == 0
    for k in (1, 2):
        a, b = (f.read_bytes() for f in (tmp_path / "cli" / f"s{k}" / "0_0_0.arrow", tmp_path / "dvid" / f"s{k}" /
                                         "0_0_0.arrow"))
        assert a == b
    with pytest.raises(SpecError, match="not inside"):
        downsample(s0_only.root, tmp_path / "x", spec=s0_only.spec, box=[[0, 0, 0], [500, 10, 10]], progress=False)
    assert not (tmp_path / "x").exists()


def test_a_made_shard_file_lost_in_a_copy_is_found_by_verify(s0_only, tmp_path, capsys):
    """A complete made scale reads a shard file it did not write as 0, so verify counts its files."""
    dest = tmp_path / "out"
    assert downsample(s0_only.root, dest, spec=s0_only.spec, progress=False).ok
    assert json.loads((dest / "_dvidshards.json").read_text())["files"] == {"1": 1, "2": 1, "3": 1}
    (dest / "s2" / "0_0_0.arrow").unlink()
    (dest / "s2" / "0_0_0.csv").unlink()
    code, out = _verify_cli(capsys, dest)
    assert code == 1 and "holds 0 shard files, the job wrote 1" in out and "s2" in out, out
