"""dvidshards verify: a shard without its index file on every store, the output of ``dvidshards
convert`` checked from its manifest, and what verify says when there is nothing (or not all) to check."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest

from dvidshards import Dataset, verify
from dvidshards.cli import main as cli
from dvidshards.errors import IndexRebuiltWarning
from dvidshards.jobs.convert import convert
from dvidshards.stores import MemoryStore
from tests.support.exports import copy_export, make_export
from tests.support.fuzz import arrow_map
from tests.support.servers import MotoS3, RangeServer

BUCKET = "verify"
STEM = "s0/0_0_0"


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """A clean export and a copy whose shard 0_0_0 lost its index file, both served over HTTP and S3."""
    base = tmp_path_factory.mktemp("verify")
    exp = make_export(base / "clean", (130, 100, 70), seed=5, scales=1, shard_chunks=2)
    shutil.copytree(exp.root, base / "noindex")
    (base / "noindex" / f"{STEM}.csv").unlink()
    with RangeServer(base) as http:
        try:
            import moto.server  # noqa: F401
        except ImportError:
            yield exp, base, http, None
            return
        with MotoS3() as s3:
            for name in ("clean", "noindex"):
                s3.upload_dir(BUCKET, base / name, name + "/")
            yield exp, base, http, s3


def _dataset(exports, store: str, name: str) -> Dataset:
    exp, base, http, s3 = exports
    if store == "local":
        src = base / name
    elif store == "memory":
        src = MemoryStore({p.relative_to(base / name).as_posix(): p.read_bytes()
                           for p in (base / name).rglob("*") if p.is_file()}, name=name)
    elif store == "http":
        src = http.url + name + "/"
    else:
        if s3 is None:
            pytest.skip("moto is not installed")
        src = s3.spec(BUCKET, name + "/")
    return Dataset(src, spec=exp.spec)


# --------------------------------------------------------------------------- a shard without its index file


@pytest.mark.parametrize("store", ["local", "memory", "http", "s3"])
def test_shard_without_index_file_is_a_problem(exports, store):
    clean = verify(_dataset(exports, store, "clean"))
    assert clean.ok, clean.summary()
    with warnings.catch_warnings():
        warnings.simplefilter("error", IndexRebuiltWarning)  # a problem in the report, not a warning
        report = verify(_dataset(exports, store, "noindex"))
    assert not report.ok
    missing = [p for p in report.problems if "no chunk index" in p.message]
    assert len(missing) == 1 and "0_0_0" in missing[0].message, report.summary()
    assert missing[0].kind == "MissingShardError" and "no problems" not in report.summary()
    assert report.shards == clean.shards and report.chunks == clean.chunks  # the records were still checked


def test_cli_exits_1_on_a_missing_index(exports, capsys):
    exp, base, _, _ = exports
    spec = base / "spec.json"
    spec.write_text(json.dumps(exp.spec))
    assert cli(["verify", str(base / "clean"), "--spec", str(spec), "--quiet"]) == 0
    assert cli(["verify", str(base / "noindex"), "--spec", str(spec), "--quiet"]) == 1
    out = capsys.readouterr()
    assert "0_0_0.csv" in out.out and "no chunk index" in out.out and "warning" not in out.err


# --------------------------------------------------------------------------- convert outputs


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A complete precomputed conversion, and one where a damaged source shard failed."""
    base = tmp_path_factory.mktemp("conv")
    exp = make_export(base / "exp", (200, 170, 150), scales=1, shard_chunks=2)
    rep = convert(exp.root, base / "good", format="precomputed", spec=exp.spec, progress=False)
    assert rep.ok and rep.complete
    bad_root = base / "damaged"
    shutil.copytree(exp.root, bad_root)
    victim = sorted((bad_root / "s0").glob("*.arrow"))[1]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    rep = convert(bad_root, base / "partial", format="precomputed", spec=exp.spec, progress=False, allow_partial=True)
    assert not rep.ok and not rep.complete and len(rep.failed) == 1
    return exp, base, victim.stem


def test_verify_reads_a_complete_manifest(converted):
    exp, base, _ = converted
    report = verify(str(base / "good"), spot_check=3, spec=exp.spec)  # the source's spec: it has no info file
    assert report.ok, report.summary()
    assert report.manifests[0]["complete"] is True and report.chunks == 3
    assert "complete" in report.summary() and "no problems" in report.summary()


def test_verify_names_the_failed_shard_of_a_partial_output(converted, capsys):
    exp, base, victim = converted
    report = verify(str(base / "partial"))
    assert not report.ok and report.manifests[0]["complete"] is False
    assert any(victim in p.message for p in report.problems), report.summary()
    assert "INCOMPLETE" in report.summary()
    assert cli(["verify", str(base / "partial"), "--quiet"]) == 1
    assert victim in capsys.readouterr().out
    assert cli(["verify", str(base / "good"), "--quiet"]) == 0


def test_verify_spot_check_finds_a_changed_chunk(converted, tmp_path):
    exp, base, _ = converted
    dest = tmp_path / "good"
    shutil.copytree(base / "good", dest)
    m = json.loads((dest / "_dvidshards.json").read_text())
    key = m["keys"]["0"]
    for f in (dest / key).glob("*.shard"):  # another volume's chunks under the same names
        data = bytearray(f.read_bytes())
        data[-30:] = bytes(30)  # the minishard index and its last chunk's tail
        f.write_bytes(bytes(data))
    report = verify(str(dest), spot_check=20, spec=exp.spec)
    assert not report.ok, report.summary()


def test_interrupted_conversion_says_incomplete(converted, tmp_path):
    exp, base, _ = converted
    dest = tmp_path / "out"
    rep = convert(exp.root, dest, format="precomputed", spec=exp.spec, progress=False, _stop_after=2, allow_partial=True)
    assert not rep.complete and not rep.failed
    report = verify(str(dest))
    assert not report.ok and any("not converted" in p.message for p in report.problems), report.summary()
    convert(exp.root, dest, format="precomputed", spec=exp.spec, progress=False, resume=True)
    assert verify(str(dest)).ok
    assert json.loads((Path(dest) / "_dvidshards.json").read_text())["complete"] is True


def test_verify_reads_any_jobs_manifest_a_one_file_output_included(tmp_path, capsys):
    """`dvidshards verify DEST` reads the manifest of any job's output, a stats Parquet file's
    (in its own metadata) and a folder's alike; one reader for all (jobs.output.read_manifest)."""
    import json

    import dvidshards
    from dvidshards.cli import main
    from dvidshards.demo.neurons import neuron_volume

    sv, m = neuron_volume((96, 80, 70), n_bodies=4, svs_per_body=3, seed=3)
    spec = dvidshards.write_export(sv, tmp_path / "exp", mapping=m, scales=2)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    exp, spec_file = str(tmp_path / "exp"), str(tmp_path / "spec.json")
    for dest in ("sizes.parquet", "sizes"):
        assert main(["stats", exp, str(tmp_path / dest), "--spec", spec_file, "--quiet"]) == 0
        capsys.readouterr()
        assert main(["verify", str(tmp_path / dest)]) == 0
        out = capsys.readouterr().out
        assert out.startswith("stats output of") and "manifest says complete: no problems" in out


# --- verify verifies: nothing to check, a spec that does not fit, a flipped byte, over http ----------


def test_verify_of_a_folder_without_shard_files(tmp_path):
    (tmp_path / "s0").mkdir()
    (tmp_path / "s0" / "notes.txt").write_text("nothing here")
    r = verify(tmp_path)
    assert not r.ok and not r.checked
    assert any("no shard files" in p.message for p in r.problems), r.summary()


def test_verify_of_an_empty_folder_with_a_spec(three_shards, tmp_path):
    r = verify(tmp_path, spec=three_shards.spec)
    assert not r.ok and r.shards == 0
    assert any("no shard files found under" in p.message for p in r.problems), r.summary()
    assert "nothing was checked" in r.summary() or "no shard files" in r.summary()


def test_verify_with_nothing_to_check_exits_2(tmp_path, capsys):
    from dvidshards.cli import main

    assert main(["verify", str(tmp_path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1


def test_verify_with_a_spec_missing_present_scales(three_shards):
    spec = json.loads(json.dumps(three_shards.spec))
    spec["scales"] = spec["scales"][:1]
    r = verify(three_shards.root, spec=spec)
    assert not r.ok
    assert any("s1" in p.message and "not" in p.message for p in r.problems), r.summary()


def test_verify_with_a_spec_too_small_says_so(three_shards):
    spec = json.loads(json.dumps(three_shards.spec))
    spec["scales"][0]["size"] = [64, 64, 64]
    r = verify(three_shards.root, spec=spec, scale=0)
    assert not r.ok
    assert any("spec" in p.message for p in r.problems), r.summary()


def test_verify_without_decode_catches_a_flipped_payload_byte(three_shards, tmp_path):
    root = copy_export(three_shards, tmp_path)
    p = root / "s0" / "0_0_0.arrow"
    a = bytearray(p.read_bytes())
    amap = arrow_map(bytes(a))
    m = amap.batches[2]
    off, n = m.buffers[amap.role("dvid_compressed_block", "values")]
    a[m.body_start + off + n // 2] ^= 0x21
    p.write_bytes(bytes(a))
    assert verify(three_shards.root, spec=three_shards.spec).ok  # the clean export
    r = verify(root, spec=three_shards.spec)
    assert not r.ok and r.decoded == 0
    assert any(p.kind == "BlockDecodeError" and "0_0_0" in p.message for p in r.problems), r.summary()


@pytest.fixture(scope="module")
def served(three_shards):
    with RangeServer(Path(three_shards.root)) as srv:
        yield srv


def test_verify_info_and_consolidate_over_http_with_a_spec(three_shards, served, tmp_path):
    r = verify(served.url, spec=three_shards.spec)
    assert r.ok and r.shards == len(list(Path(three_shards.root).rglob("*.arrow"))), r.summary()
    from dvidshards.cli import main

    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(three_shards.spec))
    assert main(["info", served.url, "--spec", str(spec)]) == 0
    assert main(["consolidate", served.url, "--spec", str(spec), "--out", str(tmp_path / "idx")]) == 0


# --- every manifest of an output; the report and failure contract of every job ------------------------


def test_verify_after_meshes_reads_the_manifest_in_the_mesh_folder(tmp_path, capsys):
    """`meshes EXPORT OUT` writes its manifest in OUT/mesh/: verify OUT reads it (complete: exit 0;
    said incomplete: exit 1 naming it), never "nothing was checked"."""
    pytest.importorskip("zmesh")
    from dvidshards.cli import main

    exp = make_export(tmp_path / "exp", (96, 80, 70), seed=2, scales=1)
    (tmp_path / "spec.json").write_text(json.dumps(exp.spec))
    out = tmp_path / "out"
    assert main(["meshes", exp.root, str(out), "--spec", str(tmp_path / "spec.json"), "--scale", "0",
                 "--quiet"]) == 0
    capsys.readouterr()
    assert (out / "mesh" / "_dvidshards.json").exists() and not (out / "_dvidshards.json").exists()
    assert cli(["verify", str(out), "--quiet"]) == 0
    said = capsys.readouterr().out
    assert said.startswith("meshes output of") and "manifest says complete: no problems" in said, said
    m = json.loads((out / "mesh" / "_dvidshards.json").read_text())
    m.update(complete=False, status="interrupted")
    (out / "mesh" / "_dvidshards.json").write_text(json.dumps(m))
    assert cli(["verify", str(out), "--quiet"]) == 1
    said = capsys.readouterr().out
    assert "INCOMPLETE" in said and "mesh/_dvidshards.json" in said, said


def test_verify_reads_the_manifest_of_each_job_in_an_output(converted, tmp_path):
    """A conversion that gained meshes: both manifests checked, each named when it says incomplete."""
    exp, base, _ = converted
    out = tmp_path / "out"
    shutil.copytree(base / "good", out)
    (out / "mesh").mkdir()
    m = json.loads((out / "_dvidshards.json").read_text())
    (out / "mesh" / "_dvidshards.json").write_text(json.dumps({**m, "job": "meshes", "complete": False,
                                                               "status": "interrupted"}))
    report = verify(str(out))
    assert [x["job"] for x in report.manifests] == ["convert", "meshes"]
    assert not report.ok and len(report.problems) == 1 and "mesh/_dvidshards.json" in report.problems[0].message


def test_verify_report_is_a_job_report_and_a_check_that_cannot_run_is_a_job_error(three_shards, monkeypatch):
    from dvidshards.errors import JobError
    from dvidshards.jobs.output import JobReport
    from dvidshards.jobs.verify import ShardCheck

    report = verify(three_shards.root, spec=three_shards.spec)
    assert isinstance(report, JobReport) and report.ok and report.complete and report.tasks == report.done
    assert report.tasks == report.shards == len(list(Path(three_shards.root).rglob("*.arrow")))
    real = ShardCheck.run

    def broken(self):  # a check that cannot run (a bug, a store that keeps failing), not a finding
        if self.origin == (0, 0, 0) and self.scale == 0:
            raise RuntimeError("the check itself broke")
        return real(self)

    monkeypatch.setattr(ShardCheck, "run", broken)
    with pytest.raises(JobError) as e:
        verify(three_shards.root, spec=three_shards.spec)
    r = e.value.report
    assert not r.complete and not r.ok and len(r.failed) == 1 and "the check itself broke" in next(iter(r.failed.values()))
    assert "0_0_0.arrow" in next(iter(r.failed)) and "incomplete" in r.summary()
    assert not verify(three_shards.root, spec=three_shards.spec, allow_partial=True).ok


def test_verify_command_ends_its_module(exports, tmp_path, capsys):
    """``VerifyCommand`` (the row ``cli.COMMANDS`` points at): 0 clean, 1 problems, SpecError for nothing."""
    import argparse

    from dvidshards.errors import SpecError
    from dvidshards.jobs.verify import VerifyCommand

    exp, base, _, _ = exports
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(exp.spec))
    p = argparse.ArgumentParser()
    VerifyCommand.add_arguments(p)
    assert VerifyCommand.main(p.parse_args([str(base / "clean"), "--spec", str(spec), "--quiet"])) == 0
    assert VerifyCommand.main(p.parse_args([str(base / "noindex"), "--spec", str(spec), "--quiet",
                                            "--scheduler", "threads:2"])) == 1
    assert "no chunk index" in capsys.readouterr().out
    with pytest.raises(SpecError, match="nothing was checked"):
        VerifyCommand.main(p.parse_args([str(tmp_path), "--quiet"]))
