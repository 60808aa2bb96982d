"""dvidshards.jobs.pcg: PCG edges and components files of whole exports, against brute force."""

from __future__ import annotations

import argparse
import functools
import json
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from dvidshards.errors import DvidShardsError, JobError, OutputError, SpecError
from dvidshards.formats.mapping import LabelMapping
from dvidshards.formats.pcg import EDGE_TYPES, IdLayout, PcgError
from dvidshards.jobs import pcg, pcgfiles
from dvidshards.jobs.output import read_manifest
from tests.support.data import REAL_SHARD
from tests.support.pcg import (
    brute_force,
    components_independently,
    decode_independently,
)

pytest.importorskip("google.protobuf")
zstandard = pytest.importorskip("zstandard")


def side_table(out):
    import pyarrow.parquet as pq

    t = pcgfiles.read_side_table(out)
    assert t.column_names == ["pcg_id", "dvid_supervoxel", "chunk_x", "chunk_y", "chunk_z", "voxels"]
    folder = pq.read_table(os.path.join(out, "supervoxels"))  # the folder reads as one table too
    assert folder.num_rows == t.num_rows and folder.sort_by("pcg_id").equals(t.replace_schema_metadata(None))
    return {k: t.column(k).to_numpy() for k in t.column_names}


def files(out) -> dict:
    """The edges and components files of an output, by name."""
    return {p.name: p.read_bytes() for p in Path(out).iterdir() if p.name.startswith(("edges_", "components_"))}


def params(out) -> dict:
    """The parameters in an output's manifest (_dvidshards.json)."""
    return read_manifest(out)["parameters"]


def layout_of(out) -> IdLayout:
    m = params(out)
    lay = IdLayout(m["layers"], m["spatial_bits"], m["layer_bits"])
    assert m["bits_per_dim"] == lay.bits_per_dim and m["counter_bits"] == lay.counter_bits
    return lay


def read_file(out, c):
    """A chunk's edges decoded with the independent message class (None if there is no file)."""
    p = os.path.join(out, f"edges_{c[0]}_{c[1]}_{c[2]}.proto.zst")
    if not os.path.exists(p):
        return None
    with open(p, "rb") as f:
        data = f.read()
    raw = zstandard.ZstdDecompressor().decompress(data)
    assert zstandard.get_frame_parameters(data).content_size == len(raw)  # PCG's reader needs it
    got = decode_independently(raw)
    lib = pcgfiles.read_chunk_edges(out, c)
    for t in EDGE_TYPES:
        for a, b in zip(got[t], lib[t], strict=True):
            np.testing.assert_array_equal(a, b)
    return got


def check_output(out, ref_vol, origin, cs, chunks, body, piece_of=None):
    """Compare every chunk file of ``chunks`` with a brute-force reference.

    ref_vol (x, y, z) holds the supervoxels from voxel ``origin`` (in PCG grid voxels, i.e.
    relative to the volume offset) and must cover every chunk of ``chunks`` plus one voxel.
    ``body`` maps supervoxel ids to bodies. ``piece_of(pcg_id)`` names pieces of chunks that are
    not in ``chunks`` (default: the side table must name every piece).
    """
    lay = layout_of(out)
    st = side_table(out)
    chunks = {tuple(int(v) for v in c) for c in chunks}
    names = {}
    for pid, sv, x, y, z, n in zip(*(st[k].tolist() for k in st), strict=True):
        _, cx, cy, cz, cnt = (int(v[0]) for v in lay.decode([pid]))
        assert (cx, cy, cz) == (x, y, z) and (x, y, z) in chunks and n > 0
        names[pid] = (sv, (x, y, z))
    assert len(names) == len(st["pcg_id"])

    def piece(pid):
        if pid in names:
            return names[pid]
        assert piece_of is not None, f"id {pid} is not in the side table"
        return piece_of(pid)

    want, want_vox = brute_force(ref_vol, cs, origin)
    want = {k: v for k, v in want.items() if k[0][1] in chunks or k[1][1] in chunks}
    want_vox = {k: v for k, v in want_vox.items() if k[1] in chunks}
    assert {names[p]: n for p, n in zip(st["pcg_id"].tolist(), st["voxels"].tolist(), strict=True)} == want_vox
    got, seen = {}, Counter()
    for c in chunks:
        edges = read_file(out, c)
        comps = pcgfiles.read_chunk_components(out, c)
        if edges is None:
            assert not comps and not any(k[1] == c for k in want_vox)
            continue
        nb_ids = set()
        for t in EDGE_TYPES:
            n1, n2, aff, area = edges[t]
            keys = list(zip(n1.tolist(), n2.tolist(), strict=True))
            assert keys == sorted(keys) and len(set(keys)) == len(keys), t
            for i, j, a, ar in zip(n1.tolist(), n2.tolist(), aff.tolist(), area.tolist(), strict=True):
                p, q = piece(i), piece(j)
                assert p[1] == c, "node_ids1 must lie in the file's chunk"
                if t == "in":
                    assert q[1] == c and i < j and p[0] != q[0]
                else:
                    assert q[1] != c and int(np.abs(np.subtract(q[1], c)).sum()) == 1
                    assert (p[0] == q[0]) == (t == "cross")
                    nb_ids.add(j)
                k = (p, q) if p < q else (q, p)
                seen[k] += 1
                if t == "cross":
                    assert (a, ar) == (np.inf, 1)
                    got[k] = want.get(k)
                else:
                    assert a == ar  # affinity = contact faces
                    got[k] = ar
        # components: the chunk's pieces and the neighbours' pieces of its edges, by body
        assert all((g[1:] > g[:-1]).all() for g in comps)  # sorted, no repeats
        mine = [pid for pid, (_, pc) in names.items() if pc == c]
        members = mine + sorted(nb_ids)
        by_body = {}
        for pid in members:
            by_body.setdefault(int(body(piece(pid)[0])), set()).add(pid)
        assert {frozenset(g.tolist()) for g in comps} == {frozenset(v) for v in by_body.values()}
        assert [int(body(piece(int(g[0]))[0])) for g in comps] == sorted(by_body)
        with open(os.path.join(out, f"components_{c[0]}_{c[1]}_{c[2]}.proto"), "rb") as f:
            raw = f.read()
        assert components_independently(raw) == [g.tolist() for g in comps]
    assert got == want
    for (p, q), n in seen.items():  # in edges once; between and cross in both chunks' files
        both = p[1] in chunks and q[1] in chunks
        assert n == (1 if p[1] == q[1] else (2 if both else 1)), (p, q, n)
    return got


def _body(mapping):
    m = LabelMapping.from_any(mapping)
    return lambda sv: m(np.array([sv], np.uint64))[0]


def _grid(shape, cs):
    return [tuple(c) for c in np.ndindex(*(-(-np.asarray(shape) // cs)))]


@pytest.mark.parametrize("cs", [(96, 80, 64), (64, 64, 64)])
def test_synthetic_export_equals_brute_force(tmp_path, synthetic_export, cs):
    ex = synthetic_export
    out = tmp_path / "pcg"
    rep = pcg.pcg_edges(ex.root, out, chunk_size=cs, spec=ex.spec, progress=False)
    assert rep.ok and rep.complete and rep.totals.chunks == len(_grid(ex.sv.shape, cs)) and rep.totals.skipped == 0
    sv = ex.expected(0, "supervoxels")
    got = check_output(str(out), sv, (0, 0, 0), np.asarray(cs), _grid(sv.shape, cs), _body(ex.mapping))
    st = side_table(str(out))
    linked = {p for pair in got for p in pair}
    pieces = {(s, (x, y, z)) for s, x, y, z in zip(*(st[k].tolist() for k in ("dvid_supervoxel", "chunk_x", "chunk_y",
                                                                            "chunk_z")), strict=True)}
    assert rep.totals.isolated == len(pieces - linked)
    kinds = Counter(("in" if p[1] == q[1] else ("cross" if p[0] == q[0] else "between")) for p, q in got)
    assert min(kinds["in"], kinds["between"], kinds["cross"]) > 10, kinds  # the volume exercises all three
    m = read_manifest(out)
    assert m["job"] == "pcg-edges" and m["complete"] and m["parameters"]["chunk_size"] == list(cs)
    assert m["totals"]["pieces"] == rep.totals.pieces and m["tasks"]["total"] == rep.tasks  # manifest = report
    assert m["parameters"]["voxel_offset"] == [0, 0, 0] and m["parameters"]["layers"] == 4
    assert m["parameters"]["bits_per_dim"] == 10 and m["pcg"]["edges"] == "edges_{x}_{y}_{z}.proto.zst"
    assert not [p for p in out.rglob("*") if ".tmp" in p.name or p.name == "_dvidshards.lock"]


def test_voxel_offset_and_scale(tmp_path, synthetic_export):
    """The PCG grid starts at the scale's voxel offset; scale 1 of the export."""
    ex = synthetic_export
    spec = json.loads(json.dumps(ex.spec))
    s1 = spec["scales"][1]
    s1["voxel_offset"] = [32, 0, 16]
    s1["size"] = [s1["size"][0] - 32, s1["size"][1], s1["size"][2] - 16]
    cs = np.array([30, 40, 25])
    rep = pcg.pcg_edges(ex.root, tmp_path / "o", chunk_size=cs, spec=spec, scale=1, progress=False)
    assert rep.ok
    vol = ex.expected(1, "supervoxels")[32:, :, 16:]
    check_output(str(tmp_path / "o"), vol, (0, 0, 0), cs, _grid(vol.shape, cs), _body(ex.mapping))
    assert params(tmp_path / "o")["voxel_offset"] == [32, 0, 16]


def test_components_from_a_mapping(tmp_path, synthetic_export):
    ex = synthetic_export
    m = ex.mapping.copy()
    m[::3, 1] = m[0, 1]  # merge some bodies
    m = m[:-2]  # and leave two supervoxels unmapped (they are their own body)
    cs = np.array([100, 85, 75])
    rep = pcg.pcg_edges(ex.root, tmp_path / "o", chunk_size=cs, spec=ex.spec, labels=m, affinity="default",
                        progress=False)
    assert rep.ok
    lay_edges = pcgfiles.read_chunk_edges(tmp_path / "o", (0, 0, 0))
    assert (lay_edges["in"][2] == np.finfo(np.float32).tiny).all()
    body = _body(m)
    st = side_table(str(tmp_path / "o"))
    names = dict(zip(st["pcg_id"].tolist(), st["dvid_supervoxel"].tolist(), strict=True))
    for c in _grid(ex.sv.shape, cs):
        for g in pcgfiles.read_chunk_components(tmp_path / "o", c):
            assert len({int(body(names[int(i)])) for i in g}) == 1
        groups = pcgfiles.read_chunk_components(tmp_path / "o", c)
        bodies = [int(body(names[int(g[0])])) for g in groups]
        assert bodies == sorted(set(bodies))


def test_resume_and_guards(tmp_path, synthetic_export):
    ex = synthetic_export
    cs = (100, 85, 75)
    out = tmp_path / "o"
    first = pcg.pcg_edges(ex.root, out, chunk_size=cs, spec=ex.spec, chunks=[(0, 0, 0), (1, 1, 1)], progress=False)
    assert first.ok and first.totals.chunks == 2
    before = files(out)
    with pytest.raises(OutputError, match="pass --resume to finish it"):
        pcg.pcg_edges(ex.root, out, chunk_size=cs, spec=ex.spec, progress=False)
    with pytest.raises(OutputError, match="other parameters.*chunk_size"):
        pcg.pcg_edges(ex.root, out, chunk_size=(64, 64, 64), spec=ex.spec, resume=True, progress=False)
    assert files(out) == before and read_manifest(out)["complete"] is True  # a refusal changes nothing
    parts = sorted(p.name for p in (out / "supervoxels").iterdir())
    assert parts == ["0_0_0.parquet", "1_1_1.parquet"]  # one task per source shard here: one chunk each
    (out / "edges_1_1_1.proto.zst").unlink()  # an interrupted task: its side-table part is written last
    (out / "supervoxels" / "1_1_1.parquet").unlink()
    (out / ".edges_0_0_0.proto.zst.tmp-123abc").write_bytes(b"partial")  # a crashed writer's leftover
    rep = pcg.pcg_edges(ex.root, out, chunk_size=cs, spec=ex.spec, resume=True, progress=False)
    assert rep.ok and rep.totals.chunks == 8 and rep.totals.skipped == 1
    assert not (out / ".edges_0_0_0.proto.zst.tmp-123abc").exists()  # leftovers of crashed writers are removed
    for name, data in before.items():
        assert (out / name).read_bytes() == data, name
    full = pcg.pcg_edges(ex.root, tmp_path / "fresh", chunk_size=cs, spec=ex.spec, progress=False)
    assert files(tmp_path / "fresh") == files(out)  # deterministic output
    assert pcgfiles.read_side_table(tmp_path / "fresh").equals(pcgfiles.read_side_table(out))
    assert full.totals.pieces == rep.totals.pieces and full.totals.written == rep.totals.written
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "x").write_text("x")
    with pytest.raises(OutputError, match="not empty"):
        pcg.pcg_edges(ex.root, tmp_path / "junk", chunk_size=cs, spec=ex.spec, progress=False)
    for k, bad in enumerate(({"affinity": "mean"}, {"level": 30}, {"labels": "supervoxels"},
                             {"chunks": [(9, 0, 0)]}, {"box": [[0, 0], [1, 1]]}, {"box": [[500, 0, 0], [600, 9, 9]]},
                             {"scheduler": "lokal"}, {"chunks_per_task": 0}, {"resume": True, "overwrite": True},
                             {"chunk_size": None})):
        with pytest.raises(DvidShardsError):
            pcg.pcg_edges(ex.root, tmp_path / f"bad{k}", **{"chunk_size": cs, **bad}, spec=ex.spec, progress=False)
        assert not (tmp_path / f"bad{k}").exists()  # nothing written for a bad call
    with pytest.raises(PcgError, match="chunks per axis"):  # 200 voxels in 1-voxel chunks at 4 spatial bits
        pcg.pcg_edges(ex.root, tmp_path / "bad2", chunk_size=(1, 1, 1), spec=ex.spec, layers=3, spatial_bits=4,
                      progress=False)
    assert not (tmp_path / "bad2").exists()


def test_a_task_whose_worker_died_resumes_from_the_chunks_it_finished(tmp_path, synthetic_export, monkeypatch):
    """A task that dies mid-way (an error that is not about the data) leaves the chunks it finished
    recorded in the work folder (DEST.work by default); resumed, it runs only the others, the
    output equals a clean run's, and the work folder is gone once the output is complete."""
    ex = synthetic_export
    cs = (64, 64, 64)
    monkeypatch.setattr(pcg, "CHECKPOINT_SECONDS", 0.0)  # a record after every chunk
    real = pcg.PcgJob.run
    calls = []

    def dying(self, c):
        calls.append(c)
        if len(calls) == 5:
            raise MemoryError("the worker ran out of memory")
        return real(self, c)

    monkeypatch.setattr(pcg.PcgJob, "run", dying)
    out = tmp_path / "o"
    kw = dict(chunk_size=cs, spec=ex.spec, chunks_per_task=6, scheduler="serial", progress=False)  # one task
    first = pcg.pcg_edges(ex.root, out, allow_partial=True, **kw)
    assert not first.ok and first.tasks == 1 and "MemoryError" in next(iter(first.failed.values()))
    assert [p.name for p in (tmp_path / "o.work" / "tasks").iterdir()] == ["0_0_0.parquet"]
    assert not (out / "supervoxels" / "0_0_0.parquet").exists()  # the task never finished
    calls.clear()
    monkeypatch.setattr(pcg.PcgJob, "run", lambda self, c: calls.append(c) or real(self, c))
    again = pcg.pcg_edges(ex.root, out, resume=True, **kw)
    assert again.ok and again.totals.chunks == 36 and again.totals.skipped == 4 and len(calls) == 36 - 4
    assert not (tmp_path / "o.work").exists()
    fresh = pcg.pcg_edges(ex.root, tmp_path / "fresh", **kw)
    assert fresh.ok and files(out) == files(tmp_path / "fresh")
    assert pcgfiles.read_side_table(out).equals(pcgfiles.read_side_table(tmp_path / "fresh"))


def test_a_task_that_failed_for_a_passing_reason_runs_again_from_its_chunks(tmp_path, synthetic_export, monkeypatch):
    """A network error in a task: the runner runs it again (retries), and it goes on from the chunks
    it had finished; the output equals a clean run's."""
    from dvidshards.jobs import runner

    ex = synthetic_export
    monkeypatch.setattr(pcg, "CHECKPOINT_SECONDS", 0.0)
    monkeypatch.setattr(runner, "RETRY_SECONDS", 0.0)
    real = pcg.PcgJob.run
    calls = []

    def flaky(self, c):
        calls.append(c)
        if len(calls) == 7:
            raise ConnectionResetError("the bucket hung up")
        return real(self, c)

    monkeypatch.setattr(pcg.PcgJob, "run", flaky)
    kw = dict(chunk_size=(64, 64, 64), spec=ex.spec, chunks_per_task=6, scheduler="serial", progress=False)
    rep = pcg.pcg_edges(ex.root, tmp_path / "o", **kw)
    assert rep.ok and rep.totals.chunks == 36 and len(calls) == 36 + 1  # the failed chunk once more, no other
    monkeypatch.setattr(pcg.PcgJob, "run", real)
    assert pcg.pcg_edges(ex.root, tmp_path / "fresh", **kw).ok
    assert files(tmp_path / "o") == files(tmp_path / "fresh")


def test_workdir_is_the_folder_given_and_apart_from_the_output(tmp_path, synthetic_export, capsys):
    from dvidshards import cli

    ex = synthetic_export
    (tmp_path / "spec.json").write_text(json.dumps(ex.spec))
    args = ["pcg-edges", ex.root, str(tmp_path / "o"), "--spec", str(tmp_path / "spec.json"), "--chunk-size", "64",
            "64", "64", "--quiet", "--scheduler", "serial"]
    assert cli.main([*args, "--workdir", str(tmp_path / "o" / "work")]) == 2  # inside the output: refused
    assert "work folder" in capsys.readouterr().err and not (tmp_path / "o").exists()
    assert cli.main([*args, "--workdir", str(tmp_path / "w")]) == 0
    assert not (tmp_path / "w").exists() and not (tmp_path / "o.work").exists()  # emptied when complete
    assert read_manifest(tmp_path / "o")["command"].endswith(f"--workdir {tmp_path / 'w'}")


def test_chunk_groups_match_one_chunk_per_task(tmp_path, synthetic_export):
    ex = synthetic_export
    cs = (64, 64, 64)
    a = pcg.pcg_edges(ex.root, tmp_path / "a", chunk_size=cs, spec=ex.spec, chunks_per_task=1, progress=False)
    b = pcg.pcg_edges(ex.root, tmp_path / "b", chunk_size=cs, spec=ex.spec, chunks_per_task=3, progress=False)
    c = pcg.pcg_edges(ex.root, tmp_path / "c", chunk_size=cs, spec=ex.spec, progress=False)  # default: per shard
    assert a.ok and b.ok and c.ok and a.totals.chunks == b.totals.chunks == c.totals.chunks == 36
    assert a.totals.pieces == b.totals.pieces == c.totals.pieces
    assert (a.tasks, b.tasks, c.tasks) == (36, 2 * 1 * 1, 2 * 2 * 2)
    assert files(tmp_path / "a") == files(tmp_path / "b") == files(tmp_path / "c")
    table = pcgfiles.read_side_table(tmp_path / "a")
    assert pcgfiles.read_side_table(tmp_path / "b").equals(table) and pcgfiles.read_side_table(tmp_path / "c").equals(table)
    (tmp_path / "b" / "supervoxels" / "0_0_0.parquet").unlink()  # the task of chunks x 0:3, y 0:3, z 0:3
    d = pcg.pcg_edges(ex.root, tmp_path / "b", chunk_size=cs, spec=ex.spec, chunks_per_task=3, resume=True,
                      box=[[0, 0, 0], [256, 128, 192]], progress=False)
    # task (1, 0, 0)'s chunks in the box were done
    assert d.ok and d.totals.chunks == 4 * 2 * 3 and d.totals.skipped == 1 * 2 * 3
    assert pcgfiles.read_side_table(tmp_path / "b").num_rows < table.num_rows  # chunks y 2:3 of task 0 are not done yet
    e = pcg.pcg_edges(ex.root, tmp_path / "b", chunk_size=cs, spec=ex.spec, chunks_per_task=3, resume=True,
                      progress=False)
    assert e.ok and e.totals.skipped == 36 - 3 * 1 * 3 and pcgfiles.read_side_table(tmp_path / "b").equals(table)
    assert files(tmp_path / "b") == files(tmp_path / "a")


def test_corrupt_output_files_are_typed(tmp_path):
    (tmp_path / "edges_0_0_0.proto.zst").write_bytes(b"not zstd")
    with pytest.raises(PcgError, match="edges_0_0_0"):
        pcgfiles.read_chunk_edges(tmp_path, (0, 0, 0))
    (tmp_path / "edges_0_0_1.proto.zst").write_bytes(zstandard.ZstdCompressor().compress(b"\x0a\x09abc"))
    with pytest.raises(PcgError, match="edges_0_0_1"):
        pcgfiles.read_chunk_edges(tmp_path, (0, 0, 1))
    (tmp_path / "components_0_0_0.proto").write_bytes(b"\x0a\x02\x05\x01")
    with pytest.raises(PcgError, match="components_0_0_0"):
        pcgfiles.read_chunk_components(tmp_path, (0, 0, 0))
    assert all(len(a) == 0 for v in pcgfiles.read_chunk_edges(tmp_path, (5, 5, 5)).values() for a in v)
    assert pcgfiles.read_chunk_components(tmp_path, (5, 5, 5)) == []


def test_cli(tmp_path, synthetic_export, capsys):
    ex = synthetic_export
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(ex.spec))
    p = argparse.ArgumentParser()
    pcg.PcgEdgesCommand.add_arguments(p)
    args = p.parse_args([ex.root, str(tmp_path / "o"), "--spec", str(spec), "--chunk-size", "128", "128",
                         "128", "--box", "0", "0", "0", "100", "100", "100", "--level", "3", "--quiet"])
    assert pcg.PcgEdgesCommand.main(args) == 0
    text = capsys.readouterr().out
    assert "pcg-edges -> " in text and ": complete: 1 of 1 tasks done" in text and "1 chunks in 1 tasks" in text
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == [
        "_dvidshards.json", "components_0_0_0.proto", "edges_0_0_0.proto.zst", "supervoxels"]
    m = read_manifest(tmp_path / "o")
    assert m["box"] == [[0, 0, 0], [100, 100, 100]] and m["command"].startswith(f"dvidshards pcg-edges {ex.root} ")


@pytest.mark.slow
def test_dask_scheduler_matches_serial(tmp_path, synthetic_export):
    pytest.importorskip("distributed")
    ex = synthetic_export
    cs = (100, 85, 75)
    chunks = [(0, 0, 0), (1, 0, 0), (0, 1, 1)]
    a = pcg.pcg_edges(ex.root, tmp_path / "a", chunk_size=cs, spec=ex.spec, chunks=chunks, progress=False)
    b = pcg.pcg_edges(ex.root, tmp_path / "b", chunk_size=cs, spec=ex.spec, chunks=chunks, scheduler="local:1",
                      progress=False)
    assert a.ok and b.ok, b.failed
    for p in (tmp_path / "a").iterdir():
        if p.is_file() and p.suffix != ".json":
            assert (tmp_path / "b" / p.name).read_bytes() == p.read_bytes(), p.name


@pytest.mark.slow
def test_writes_into_a_bucket_through_the_destination(tmp_path, synthetic_export):
    """`pcg-edges EXPORT s3://bucket/e` writes into the bucket (not a local folder named like the
    URL); the files equal a local run's, and the readers read them back from the bucket."""
    from dvidshards import cli
    from tests.support.servers import MotoS3

    ex = synthetic_export
    cs = (100, 85, 75)
    local = pcg.pcg_edges(ex.root, tmp_path / "local", chunk_size=cs, spec=ex.spec, progress=False)
    (tmp_path / "spec.json").write_text(json.dumps(ex.spec))
    with MotoS3() as s3:
        s3.bucket("pcg")
        url = f"s3://pcg/e?endpoint_override=127.0.0.1:{s3.port}&scheme=http&region={s3.REGION}"
        cwd = os.getcwd()
        os.chdir(tmp_path)
        try:
            assert cli.main(["pcg-edges", ex.root, url, "--spec", str(tmp_path / "spec.json"), "--chunk-size",
                             "100", "85", "75", "--quiet"]) == 0
        finally:
            os.chdir(cwd)
        assert not (tmp_path / "s3:").exists()
        keys = {o["Key"] for o in s3.client().list_objects_v2(Bucket="pcg")["Contents"]}
        assert "e/_dvidshards.json" in keys and "e/_dvidshards.lock" not in keys
        got = {k[2:]: s3.client().get_object(Bucket="pcg", Key=k)["Body"].read() for k in keys
               if k.startswith("e/edges_") or k.startswith("e/components_")}
        assert got == files(tmp_path / "local") and local.ok
        assert pcgfiles.read_side_table(url).equals(pcgfiles.read_side_table(tmp_path / "local"))
        c = next(tuple(int(v) for v in k[len("edges_"):-len(".proto.zst")].split("_")) for k in got
                 if k.startswith("edges_"))
        for t, arrays in pcgfiles.read_chunk_edges(url, c).items():
            for x, y in zip(arrays, pcgfiles.read_chunk_edges(tmp_path / "local", c)[t], strict=True):
                np.testing.assert_array_equal(x, y)
        assert read_manifest(url)["complete"] is True


# --------------------------------------------------------------------------- the real mCNS shard


@pytest.mark.slow
def test_real_shard_equals_brute_force(dvid_data, tmp_path, real_records):
    """Eight 128³ PCG chunks of the real mCNS shard (scale 1 of the real spec) with their halo."""
    from dvidshards.formats.codec import decode_block

    root = tmp_path / "export"
    (root / "s1").mkdir(parents=True)
    (root / "s1" / f"{REAL_SHARD}.arrow").symlink_to(dvid_data / f"{REAL_SHARD}.arrow")
    (root / "s1" / f"{REAL_SHARD}.csv").symlink_to(dvid_data / f"{REAL_SHARD}-newformat.csv")
    spec = json.loads((dvid_data / "mcns-ng-specs.json").read_text())
    cs = np.array([128, 128, 128])
    chunks = [(x, y, z) for x in (254, 255) for y in (206, 207) for z in (238, 239)]  # the densest part
    out = tmp_path / "pcg"
    rep = pcg.pcg_edges(root, out, chunk_size=cs, spec=spec, scale=1, chunks=chunks, progress=False)
    assert rep.ok and rep.totals.written == 8, rep.summary()
    m = params(out)
    assert m["layers"] == 12 and m["grid"] == [368, 306, 526]

    # the reference: the records' blocks decoded by the codec into the chunks plus a 1-voxel halo
    lo = np.array(chunks[0]) * cs - 1
    hi = (np.array(chunks[-1]) + 1) * cs + 1
    vol = np.zeros(tuple(hi - lo), np.uint64)
    svs, body = {}, {}
    for r in real_records:
        b = np.array([r["chunk_x"], r["chunk_y"], r["chunk_z"]])
        svs[tuple(b)] = np.array(r["supervoxels"], np.uint64)
        for s, lab in zip(r["supervoxels"], r["labels"], strict=True):
            assert body.setdefault(s, lab) == lab
        a, e = np.maximum(b * 64, lo), np.minimum(b * 64 + 64, hi)
        if (e <= a).any():
            continue
        blk = decode_block(r["block"]).T  # x, y, z
        vol[tuple(slice(int(p - q), int(t - q)) for p, t, q in zip(a, e, lo, strict=True))] = \
            blk[tuple(slice(int(p - q), int(t - q)) for p, t, q in zip(a, e, b * 64, strict=True))]
    assert vol.any()

    lay = IdLayout(12)

    @functools.cache
    def id_list(c):  # the naming rule, from the records: sorted union of the overlapping blocks' lists
        b0, b1 = np.asarray(c) * cs // 64, ((np.asarray(c) + 1) * cs - 1) // 64 + 1
        parts = [v for k, v in svs.items() if all(p <= x < q for x, p, q in zip(k, b0, b1, strict=True))]
        u = np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.uint64)
        return u[u != 0]

    def piece_of(pid):
        _, x, y, z, n = (int(v[0]) for v in lay.decode([pid]))
        return int(id_list((x, y, z))[n - 1]), (x, y, z)

    got = check_output(str(out), vol, lo, cs, chunks, lambda s: body[int(s)], piece_of)
    assert len(got) > 100
    st = side_table(str(out))  # the side table follows the same naming rule
    assert all(piece_of(p) == (s, (x, y, z)) for p, s, x, y, z in
               zip(*(st[k].tolist() for k in ("pcg_id", "dvid_supervoxel", "chunk_x", "chunk_y", "chunk_z")),
                   strict=True))


def test_index_palette_guards_its_list():
    class Table:
        def supervoxels(self, i):
            return np.array([0, 5, 9], np.uint64)

        def where(self, i):
            return "s0/0_0_0.arrow: chunk (1, 2, 3)"

    p = pcg._IndexPalette()
    p.target = np.array([5, 9, 11], np.uint64)
    assert p.palette(Table(), 0).tolist() == [0, 1, 2]
    p.target = np.array([5, 11], np.uint64)
    p.where = "PCG chunk (0, 0, 0)"
    with pytest.raises(PcgError, match=r"chunk \(1, 2, 3\): supervoxel 9 is not in the id list of PCG chunk"):
        p.palette(Table(), 0)


def test_inconsistent_bodies_fail_the_chunk_not_the_job(tmp_path, synthetic_export, capsys):
    """A supervoxel with two agglomerated labels in two blocks: that chunk fails, named; others are written."""
    import pyarrow as pa

    from dvidshards.writer import write_shard

    ex = synthetic_export
    root = tmp_path / "e"
    (root / "s0").mkdir(parents=True)
    for arrow in sorted(Path(ex.root, "s0").glob("*.arrow")):
        with pa.OSFile(str(arrow)) as f:
            recs = pa.ipc.open_stream(f).read_all().to_pylist()
        if arrow.stem == "0_0_0":
            r = next(r for r in recs if (r["chunk_x"], r["chunk_y"], r["chunk_z"]) == (1, 1, 1) and len(r["labels"]) > 1)
            r["labels"] = [0] + [v + 1 for v in r["labels"][1:]]
            bad_sv = r["supervoxels"][1]
        write_shard(root / "s0" / arrow.stem, recs)
    spec = json.loads(json.dumps(ex.spec))
    spec["scales"] = spec["scales"][:1]
    cs = (64, 64, 64)
    with pytest.raises(JobError) as e:
        pcg.pcg_edges(root, tmp_path / "o", chunk_size=cs, spec=spec, progress=False)
    rep = e.value.report
    assert not rep.ok and rep.totals.written > 0
    assert all(f"supervoxel {bad_sv} has agglomerated label" in m for m in rep.failed.values())
    bad = [tuple(int(v) for v in k[len("PCG chunk ("):-1].split(", ")) for k in rep.failed]
    assert (1, 1, 1) in bad and all(abs(np.subtract(c, (1, 1, 1))).sum() <= 1 for c in bad)
    assert not (tmp_path / "o" / "edges_1_1_1.proto.zst").exists()
    m = read_manifest(tmp_path / "o")
    assert m["complete"] is False and m["failed"] == rep.failed and len(rep.failed) == rep.totals.failed_chunks
    p = argparse.ArgumentParser()
    pcg.PcgEdgesCommand.add_arguments(p)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    args = p.parse_args([str(root), str(tmp_path / "o"), "--spec", str(tmp_path / "spec.json"),
                         "--chunk-size", "64", "64", "64", "--resume", "--quiet"])
    assert pcg.PcgEdgesCommand.main(args) == 1
    text = capsys.readouterr().out
    assert "FAILED PCG chunk (1, 1, 1)" in text and "INCOMPLETE" in text and "--resume" in text


# --------------------------------------------------------------------------- tasks, plans and refusals


def test_tasks_are_source_shards_and_carry_no_mapping(tmp_path, synthetic_export, monkeypatch):
    """Default tasks: one per source shard (planned without a loop over chunks), each a small
    record; a mapping file travels as its path (a big mapping object would travel by value)."""
    import pickle

    from dvidshards.jobs import runner

    ex = synthetic_export
    seen = {}
    real_run = runner.TaskRunner.run

    def spy(self, fn, items, **kw):
        items = list(items)
        seen["bytes"] = max(len(pickle.dumps((fn, it))) for it in items)
        seen["tasks"] = len(items)
        return real_run(self, fn, items, **kw)

    monkeypatch.setattr(runner.TaskRunner, "run", spy)
    big = np.concatenate([ex.mapping, np.stack([np.arange(1, 100_001, dtype=np.uint64) + np.uint64(1 << 40)] * 2, 1)])
    path = tmp_path / "mappings.txt"
    np.savetxt(path, big, fmt="%d")
    rep = pcg.pcg_edges(ex.root, tmp_path / "o", chunk_size=(64, 64, 64), spec=ex.spec, labels=str(path),
                        scheduler="threads:2", progress=False)
    shards = len(list(Path(ex.root, "s0").glob("*.arrow")))
    assert rep.ok and rep.tasks == seen["tasks"] == shards and rep.totals.chunks == 36  # 128³ shards: 2³ chunks
    assert seen["bytes"] < 8_000 < 16 * len(big)
    m = params(tmp_path / "o")
    assert m["components"]["mapping_file"] == str(path) and m["chunks_per_task"] == [2, 2, 2]
    ref = pcg.pcg_edges(ex.root, tmp_path / "ref", chunk_size=(64, 64, 64), spec=ex.spec, labels=big,
                        chunks_per_task=1, progress=False)
    assert ref.ok and ref.tasks == 36 and ref.totals.pieces == rep.totals.pieces
    assert files(tmp_path / "o") == files(tmp_path / "ref")  # same output as one chunk per task


def test_plan_over_the_procedural_mcns_export_is_per_shard():
    """pcg-edges over the mCNS-shaped export's s0 at 256³: ~26 K tasks of 8³ chunks (not 13 M)."""
    from dvidshards import Dataset
    from dvidshards.formats import pcg as fmt
    from dvidshards.stores import as_store
    from tests.support.procedural import ProceduralStore

    store = ProceduralStore()
    ds = Dataset(store, spec=store.spec)
    s = ds.scale(0)
    grid = -(-np.asarray(s.size) // 256)
    nowhere = as_store("memory://pcg-plan/out")
    job = pcg.PcgJob(ds, s, nowhere, nowhere, (256, 256, 256), IdLayout(fmt.layers_for_grid(grid)), None, "area", 3,
                     1, True)
    tasks = pcg.plan(job)
    assert job.group == (8, 8, 8) and len(tasks) == len(store.shard_origins(0)) <= pcg.MAX_TASKS
    assert {t.key for t in tasks} == {tuple(v // 2048 for v in o) for o in store.shard_origins(0)}


def test_a_scale_without_folder_is_a_clean_error(tmp_path, synthetic_export, capsys):
    from dvidshards import cli

    ex = synthetic_export
    root = tmp_path / "only-s0"
    root.mkdir()
    (root / "s0").symlink_to(Path(ex.root, "s0"))
    (tmp_path / "spec.json").write_text(json.dumps(ex.spec))  # lists 3 scales
    with pytest.raises(SpecError, match="no folder") as e:
        pcg.pcg_edges(root, tmp_path / "o", chunk_size=(64, 64, 64), spec=ex.spec, scale=1, progress=False)
    assert "s1" in str(e.value) or "scale 1" in str(e.value)
    assert not (tmp_path / "o").exists()
    code = cli.main(["pcg-edges", str(root), str(tmp_path / "o"), "--spec", str(tmp_path / "spec.json"),
                     "--chunk-size", "64", "64", "64", "--scale", "1", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and ("no folder" in err or "not exported" in err) and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_an_output_folder_with_other_files_is_refused(tmp_path, synthetic_export, capsys):
    from dvidshards import cli

    ex = synthetic_export
    (tmp_path / "spec.json").write_text(json.dumps(ex.spec))
    args = ["--spec", str(tmp_path / "spec.json"), "--chunk-size", "64", "64", "64", "--box", "0", "0",
            "0", "64", "64", "64", "--quiet", "--scheduler", "serial"]
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    for extra in ([], ["--resume"]):  # not pcg-edges output: refused
        assert cli.main(["pcg-edges", ex.root, str(out)] + args + extra) == 2
        assert "not empty" in capsys.readouterr().err
        assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # nothing touched
    assert cli.main(["pcg-edges", ex.root, str(out)] + args + ["--overwrite"]) == 0  # writes its files, leaves the rest
    assert "notes.txt" in os.listdir(out) and (out / "notes.txt").read_text() == "my notes"
    out = tmp_path / "o"
    assert cli.main(["pcg-edges", ex.root, str(out)] + args) == 0
    first = files(out)
    assert cli.main(["pcg-edges", ex.root, str(out)] + args) == 2  # its own output: --resume or --overwrite
    assert "--overwrite" in capsys.readouterr().err
    (out / "edges_0_0_0.proto.zst").write_bytes(b"stale")
    assert cli.main(["pcg-edges", ex.root, str(out)] + args + ["--overwrite"]) == 0
    assert files(out) == first and read_manifest(out)["complete"] is True
    assert cli.main(["pcg-edges", ex.root, str(out)] + args + ["--scheduler", "nowhere"]) == 2
    assert "scheduler 'nowhere'" in capsys.readouterr().err
    assert files(out) == first
