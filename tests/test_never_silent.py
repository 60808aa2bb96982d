"""Issue 16 (never a silent wrong answer) and issue 15's chunk-naming and failed-load rules.

Each test builds what a user really produced, then asserts exact data or the typed error and
its message (and the GeometryWarning where geometry is a guess).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import dvidshards
from dvidshards import (
    ChunkIndexError,
    Dataset,
    DvidShardsError,
    GeometryWarning,
    IndexRebuiltWarning,
    LabelMapping,
    MappingError,
    MissingShardError,
    ShardFormatError,
    SpecError,
    verify,
    write_export,
)
from dvidshards.demo.neurons import neuron_volume
from dvidshards.stores import MemoryStore
from tests.conftest import make_export
from tests.support.fuzz import arrow_map
from tests.support.servers import RangeServer

SHAPE = (300, 100, 70)  # shards of 128 voxels at x = 0, 128, 256


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A clean 2-scale export (variant A, one record per batch); tests copy it before damaging."""
    return make_export(tmp_path_factory.mktemp("ns") / "exp", SHAPE, seed=9, scales=2, shard_chunks=2)


def _copy(base, tmp_path, name="exp") -> Path:
    dst = tmp_path / name
    shutil.copytree(base.root, dst)
    return dst


def _want(base, box, scale=0, labels="agglomerated"):
    (x0, y0, z0), (x1, y1, z1) = box
    return base.expected(scale, labels)[x0:x1, y0:y1, z0:z1]


def _ts_read(vol, box):
    (x0, y0, z0), (x1, y1, z1) = box
    return vol[x0:x1, y0:y1, z0:z1].read(order="F").result(timeout=60)


def _consolidate(root, spec, out):
    from dvidshards.consolidated import write_consolidated

    ds = Dataset(root, spec=spec)
    for s in ds.scales:
        write_consolidated(ds, s, str(out))
    return out


SHARD1 = [[128, 0, 0], [256, 64, 64]]  # inside shard s0/128_0_0


# --- 1. a stale consolidated index --------------------------------------------------------------------


@pytest.mark.parametrize("fill", [False, True])
def test_1_shard_put_back_after_consolidate_is_a_stale_error(base, tmp_path, fill):
    root = _copy(base, tmp_path)
    aside = tmp_path / "aside"
    aside.mkdir()
    for p in (root / "s0").glob("128_0_0.*"):
        shutil.move(p, aside / p.name)
    idx = _consolidate(root, base.spec, tmp_path / "idx")
    for p in aside.iterdir():
        shutil.move(p, root / "s0" / p.name)
    with pytest.raises(ChunkIndexError, match="stale") as e:  # at open since issue 23 (the folder is listed)
        _ts_read(dvidshards.open(root, spec=base.spec, index=idx, fill_missing_shards=fill), SHARD1)
    assert "consolidate" in str(e.value) and "128_0_0" in str(e.value)
    with pytest.raises(ChunkIndexError, match="stale"):
        Dataset(root, spec=base.spec, index=idx).read(SHARD1, fill_missing_shards=fill)
    # without the index the region reads exactly
    np.testing.assert_array_equal(Dataset(root, spec=base.spec).read(SHARD1), _want(base, SHARD1))


def test_1_shard_absent_at_consolidate_and_still_absent_is_missing(base, tmp_path):
    root = _copy(base, tmp_path)
    for p in (root / "s0").glob("128_0_0.*"):
        p.unlink()
    idx = _consolidate(root, base.spec, tmp_path / "idx")
    with pytest.raises(MissingShardError, match="128_0_0"):
        _ts_read(dvidshards.open(root, spec=base.spec, index=idx), SHARD1)
    got = _ts_read(dvidshards.open(root, spec=base.spec, index=idx, fill_missing_shards=True), SHARD1)
    assert not got.any()


def test_1_shard_changed_after_consolidate_is_a_stale_error(base, tmp_path):
    root = _copy(base, tmp_path)
    idx = _consolidate(root, base.spec, tmp_path / "idx")
    import pyarrow as pa

    from dvidshards.writer import write_shard

    arrow = (root / "s0" / "128_0_0.arrow").read_bytes()
    recs = []
    for b in pa.ipc.open_stream(pa.py_buffer(arrow)):
        d = b.to_pydict()
        recs += [{k: d[k][i] for k in d} for i in range(b.num_rows)]
    write_shard(root / "s0" / "128_0_0", recs, batch_size=2)  # same records, other layout and size
    with pytest.raises(ChunkIndexError, match="stale") as e:
        _ts_read(dvidshards.open(root, spec=base.spec, index=idx), SHARD1)
    assert "consolidate" in str(e.value)


def test_1_index_folder_that_does_not_exist_is_an_error(base):
    with pytest.raises(DvidShardsError, match="no/such/folder"):
        vol = dvidshards.open(base.root, spec=base.spec, index="no/such/folder")
        _ts_read(vol, SHARD1)


# --- 2. a shard size guessed from file names ----------------------------------------------------------


def test_2_guessed_shard_size_never_reads_a_missing_shard_as_background(base, tmp_path):
    root = _copy(base, tmp_path)
    shutil.rmtree(root / "s1")
    for p in (root / "s0").glob("128_*"):
        p.unlink()  # files remain only at x = 0 and 256: the names suggest 256-voxel shards
    with pytest.warns(GeometryWarning, match="spec"):
        ds = Dataset(root)
    s = ds.scale(0)
    assert "shard_extent" in s.inferred and "inferred" in ds.info["scales"][0]
    vol = ds.open(0)
    box = [[130, 0, 0], [190, 60, 60]]  # inside the missing shard 128_0_0 (true size 128)
    assert _want(base, box).any()
    with pytest.raises((SpecError, MissingShardError)) as e:
        _ts_read(vol, box)
    assert "spec" in str(e.value)
    with pytest.raises((SpecError, MissingShardError)):
        ds.read(box)
    # with the spec: MissingShardError naming the file
    with pytest.raises(MissingShardError, match="128_0_0"):
        _ts_read(dvidshards.open(root, spec=base.spec), box)
    # what exists still reads exactly
    ok = [[0, 0, 0], [128, 100, 70]]
    np.testing.assert_array_equal(_ts_read(vol, ok), _want(base, ok))


# --- 3. mapping files ------------------------------------------------------------------------------------


def test_3_text_mapping_of_16_bytes_is_text(tmp_path):
    p = tmp_path / "m.txt"
    p.write_bytes(b"1 10\n2 20\n33 30\n")
    assert len(p.read_bytes()) == 16
    m = LabelMapping.from_file(p)
    np.testing.assert_array_equal(m(np.array([1, 2, 33, 4], np.uint64)), [10, 20, 30, 4])


@pytest.mark.parametrize("text", ["sv_id,body_id\n1,10\n2,20\n", "# comment\n1\t10\n2\t20\n", "1, 10\n2 ,20\n"])
def test_3_mapping_with_header_tab_comment(tmp_path, text):
    p = tmp_path / "m.csv"
    p.write_text(text)
    m = LabelMapping.from_file(p)
    np.testing.assert_array_equal(m(np.array([1, 2, 3], np.uint64)), [10, 20, 3])


def test_3_negative_id_names_the_line(tmp_path):
    p = tmp_path / "m.txt"
    p.write_text("1 10\n2 20\n-3 30\n")
    with pytest.raises(MappingError, match="line 3") as e:
        LabelMapping.from_file(p)
    assert "-3" in str(e.value) and str(p) in str(e.value)


def test_3_series_with_nan_and_float_keys():
    pd = pytest.importorskip("pandas")
    with pytest.raises(MappingError, match="nan|NaN"):
        LabelMapping.from_any(pd.Series([10.0, np.nan], index=[1, 2]))
    with pytest.raises(MappingError, match="1.7"):
        LabelMapping.from_any(pd.Series([10, 20], index=[1.7, 2.0]))
    with pytest.raises(MappingError, match="1.7"):
        LabelMapping.from_any({1.7: 10})


def test_3_binary_mapping_only_when_it_cannot_be_text(tmp_path):
    p = tmp_path / "m.bin"
    pairs = np.array([[1, 10], [2, 20]], "<u8")
    p.write_bytes(pairs.tobytes())
    m = LabelMapping.from_file(p)
    np.testing.assert_array_equal(m(np.array([1, 2, 3], np.uint64)), [10, 20, 3])
    m = LabelMapping.from_file(p, format="binary")
    np.testing.assert_array_equal(m(np.array([1, 2], np.uint64)), [10, 20])


# --- 4. invented units -----------------------------------------------------------------------------------


def test_4_units_unknown_without_spec_and_given_by_resolution(base, tmp_path):
    root = _copy(base, tmp_path)
    with pytest.warns(GeometryWarning, match="units unknown"):
        ds = Dataset(root)
    assert "resolution" in ds.scale(0).inferred
    assert list(ds.open(0).dimension_units) == [None, None, None]
    assert list(ds.open(1).dimension_units) == [None, None, None]
    with pytest.warns(GeometryWarning):
        ds = Dataset(root, resolution=(8, 8, 8))
    import tensorstore as ts

    assert list(ds.open(0).dimension_units) == [ts.Unit(8, "nm")] * 3
    assert list(ds.open(1).dimension_units) == [ts.Unit(16, "nm")] * 3
    with_spec = dvidshards.open(root, spec=base.spec, scale=1)
    assert list(with_spec.dimension_units) == [ts.Unit(16, "nm")] * 3


# --- 5. verify verifies --------------------------------------------------------------------------------


def test_5_verify_folder_without_shard_files(tmp_path):
    (tmp_path / "s0").mkdir()
    (tmp_path / "s0" / "notes.txt").write_text("nothing here")
    r = verify(tmp_path)
    assert not r.ok and not r.checked
    assert any("no shard files" in p.message for p in r.problems), r.summary()


def test_5_verify_empty_folder_with_spec(base, tmp_path):
    r = verify(tmp_path, spec=base.spec)
    assert not r.ok and r.shards == 0
    assert any("no shard files found under" in p.message for p in r.problems), r.summary()
    assert "nothing was checked" in r.summary() or "no shard files" in r.summary()


def test_5_verify_nothing_to_check_exits_2(tmp_path, capsys):
    from dvidshards.cli import main

    assert main(["verify", str(tmp_path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1


def test_5_verify_spec_missing_present_scales(base):
    spec = json.loads(json.dumps(base.spec))
    spec["scales"] = spec["scales"][:1]
    r = verify(base.root, spec=spec)
    assert not r.ok
    assert any("s1" in p.message and "not" in p.message for p in r.problems), r.summary()


def test_5_verify_without_decode_catches_a_flipped_payload_byte(base, tmp_path):
    root = _copy(base, tmp_path)
    p = root / "s0" / "0_0_0.arrow"
    a = bytearray(p.read_bytes())
    amap = arrow_map(bytes(a))
    m = amap.batches[2]
    off, n = m.buffers[amap.role("dvid_compressed_block", "values")]
    a[m.body_start + off + n // 2] ^= 0x21
    p.write_bytes(bytes(a))
    assert verify(base.root, spec=base.spec).ok  # the clean export
    r = verify(root, spec=base.spec)
    assert not r.ok and r.decoded == 0
    assert any(p.kind == "BlockDecodeError" and "0_0_0" in p.message for p in r.problems), r.summary()


# --- 6. typed-error gaps ---------------------------------------------------------------------------------


def test_6_write_export_with_a_label_mapping(tmp_path):
    sv, mapping = neuron_volume((90, 70, 60), n_bodies=4, svs_per_body=3, seed=2)
    m = LabelMapping.from_any(mapping)
    spec = write_export(sv, tmp_path / "out", mapping=m, shard_chunks=2)
    got = dvidshards.open(tmp_path / "out", spec=spec).read(order="F").result()
    np.testing.assert_array_equal(got, m(sv))


def test_6_write_export_bad_mapping_is_typed(tmp_path):
    sv, _ = neuron_volume((64, 64, 64), n_bodies=2, svs_per_body=2, seed=2)
    with pytest.raises(DvidShardsError):
        write_export(sv, tmp_path / "out", mapping="not a mapping at all")


# --- 7. an export holding only s1/ ---------------------------------------------------------------------


def test_7_scale_k_is_folder_sk(tmp_path):
    exp = make_export(tmp_path / "exp", (130, 100, 70), seed=4, scales=2, shard_chunks=2)
    shutil.rmtree(Path(exp.root) / "s0")
    with pytest.warns(GeometryWarning):
        ds = Dataset(exp.root)
    assert [s.index for s in ds.scales] == [1]
    want = exp.expected(1)
    vol = ds.open(1)
    got = vol[:want.shape[0], :want.shape[1], :want.shape[2]].read(order="F").result()
    np.testing.assert_array_equal(got, want)
    with pytest.raises(SpecError, match="s0"):
        ds.open(0)
    with pytest.raises(SpecError):
        dvidshards.open(exp.root, scale=0)


# --- 8. rebuild a missing index ------------------------------------------------------------------------


@pytest.mark.parametrize("policy", [None, "lazy"])
def test_8_shard_without_csv_reads_exactly_with_a_warning(base, tmp_path, policy):
    root = _copy(base, tmp_path)
    (root / "s0" / "0_0_0.csv").unlink()
    ds = Dataset(root, spec=base.spec, policy=policy)
    box = [[0, 0, 0], [128, 100, 70]]
    with pytest.warns(IndexRebuiltWarning, match="0_0_0"):
        got = ds.read(box)
    np.testing.assert_array_equal(got, _want(base, box))
    files = {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    with pytest.warns(IndexRebuiltWarning):
        got = _ts_read(Dataset(MemoryStore(files), spec=base.spec, policy=policy).open(0), box)
    np.testing.assert_array_equal(got, _want(base, box))
    assert not (root / "s0" / "0_0_0.csv").exists()  # nothing written into the export


# --- 9. ignored arguments -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(base):
    with RangeServer(Path(base.root)) as srv:
        yield srv


def test_9_http_open_uses_the_consolidated_index(base, served, tmp_path):
    idx = _consolidate(base.root, base.spec, tmp_path / "idx")
    served.reset_counts()
    vol = dvidshards.open(served.url, spec=base.spec, index=idx)
    box = [[0, 0, 0], [300, 100, 70]]
    np.testing.assert_array_equal(_ts_read(vol, box), _want(base, box))
    csv = [p for p in served.requests if p.endswith(".csv")]
    assert not csv, f"the shards' own indexes were fetched although index= was given: {csv}"


def test_9_http_verify_and_info_with_spec(base, served, tmp_path):
    r = verify(served.url, spec=base.spec)
    assert r.ok and r.shards == len(list(Path(base.root).rglob("*.arrow"))), r.summary()
    from dvidshards.cli import main

    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(base.spec))
    assert main(["info", served.url, "--spec", str(spec)]) == 0
    assert main(["consolidate", served.url, "--spec", str(spec), "--out", str(tmp_path / "idx")]) == 0


# --- 10. CLI: one line, exit codes -----------------------------------------------------------------------


def _cli(argv, capsys):
    from dvidshards.cli import main

    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    assert "Traceback" not in out.err and "Traceback" not in out.out, out.err
    return code, out


def test_10_consolidate_unwritable_or_onto_a_file(base, tmp_path, capsys):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(base.spec))
    f = tmp_path / "file"
    f.write_text("x")
    for out in ("/proc/dvidshards-unwritable", str(f)):
        code, o = _cli(["consolidate", base.root, "--spec", str(spec), "--out", out], capsys)
        assert code == 2 and o.err.strip().count("\n") == 0 and o.err.strip(), o.err


def test_10_demo_validates_before_work(tmp_path, capsys):
    for argv in (["demo", "--size", "0", "64", "64"],
                 ["demo", "--size", "64", "64", "64", "--png", str(tmp_path / "missing" / "x.png")]):
        code, o = _cli(argv + ["--out", str(tmp_path / "d")], capsys)
        assert code == 2 and o.err.strip().count("\n") == 0, (argv, o.err)
        assert not (tmp_path / "d").exists(), "work was done before the arguments were checked"


def test_10_demo_small_size_works(tmp_path, capsys):
    code, o = _cli(["demo", "--size", "10", "10", "10", "--out", str(tmp_path / "d"),
                    "--png", str(tmp_path / "x.png")], capsys)
    assert code == 0, o.err
    assert (tmp_path / "x.png").stat().st_size > 0


def test_10_exit_codes_and_help(tmp_path, base, capsys):
    code, _ = _cli(["info", str(tmp_path / "missing")], capsys)
    assert code == 2
    code, _ = _cli(["verify", base.root, "--spec", "nope.json", "--scale", "x"], capsys)
    assert code == 2
    code, o = _cli([], capsys)
    assert code in (0, 2) and "usage" in (o.out + o.err).lower()
    code, o = _cli(["--version"], capsys)
    assert code == 0 and dvidshards.__version__ in o.out + o.err


# --- 11. unhelpful messages ------------------------------------------------------------------------------


def test_11_truncated_shard_says_truncated_and_lazy_reads_records_before_the_cut(base, tmp_path):
    root = _copy(base, tmp_path)
    p = root / "s0" / "0_0_0.arrow"
    data = p.read_bytes()
    amap = arrow_map(data)
    nb = len(amap.batches)
    assert nb >= 3
    cut = amap.batches[-1].offset + 20  # inside the last record's batch: the others are whole
    p.write_bytes(data[:cut])
    ds = Dataset(root, spec=base.spec)
    box = [[0, 0, 0], [128, 100, 70]]
    with pytest.raises((ShardFormatError, ChunkIndexError), match=rf"truncated: {cut} of \d+ bytes") as e:
        ds.read(box)
    assert "0_0_0" in str(e.value)
    lazy = Dataset(root, spec=base.spec, policy="lazy")
    import pyarrow as pa

    whole = [r for b in pa.ipc.open_stream(pa.py_buffer(data)) for r in
             zip(b.column("chunk_x").to_pylist(), b.column("chunk_y").to_pylist(), b.column("chunk_z").to_pylist(),
                 strict=True)]
    for k, c in enumerate(whole):
        cb = [[64 * v for v in c], [min(64 * v + 64, s) for v, s in zip(c, SHAPE, strict=True)]]
        if k < nb - 1:
            np.testing.assert_array_equal(lazy.read(cb), _want(base, cb))
            np.testing.assert_array_equal(_ts_read(lazy.open(0), cb), _want(base, cb))
        else:
            with pytest.raises((ShardFormatError, ChunkIndexError), match="truncated"):
                lazy.read(cb)


def test_11_decode_block_given_zstd_bytes_says_so():
    import zstandard

    from dvidshards.errors import BlockDecodeError

    with pytest.raises(BlockDecodeError, match="zstd") as e:
        dvidshards.decode_block(zstandard.ZstdCompressor().compress(b"\0" * 4096))
    assert "4294967" not in str(e.value)


def test_11_missing_mapping_file_vs_misspelt_mode(base, tmp_path):
    missing = tmp_path / "mappings.txt"
    with pytest.raises(MappingError, match="mappings.txt") as e:
        dvidshards.open(base.root, spec=base.spec, labels=str(missing))
    assert "not found" in str(e.value) or "No such" in str(e.value)
    with pytest.raises(SpecError, match="agglomerated") as e:
        dvidshards.open(base.root, spec=base.spec, labels="agglomorated")
    assert not isinstance(e.value, MappingError)


def test_11_spec_too_small_says_so(base):
    spec = json.loads(json.dumps(base.spec))
    spec["scales"][0]["size"] = [64, 64, 64]
    r = verify(base.root, spec=spec, scale=0)
    assert not r.ok
    assert any("spec" in p.message for p in r.problems), r.summary()


def test_11_scale_position_vs_resolution(base):
    ds = Dataset(base.root, spec=base.spec)
    with pytest.raises(SpecError, match="resolution"):
        ds.open(16.0)
    with pytest.raises(SpecError):
        dvidshards.open(base.root, spec=base.spec, scale=16.0)
    with pytest.raises(SpecError, match="s16"):
        ds.open(16)
    assert ds.scale(resolution=(16, 16, 16)).index == 1
    assert ds.scale((8, 8, 8)).index == 0


# --- issue 15: chunk-naming errors and failed loads remembered ------------------------------------------


def _dup_row(root):
    p = root / "s0" / "0_0_0.csv"
    lines = p.read_text().splitlines()
    p.write_text("\n".join(lines + [lines[3]]) + "\n")  # a shard-level index error


def _chunks_of_shard0():
    return [(x, y, z) for z in (0, 1) for y in (0, 1) for x in (0, 1)]


def _cbox(c):
    return [[64 * v for v in c], [min(64 * v + 64, s) for v, s in zip(c, SHAPE, strict=True)]]


@pytest.mark.parametrize("store", ["local", "http"])
def test_15_every_chunk_read_error_names_that_chunk(base, tmp_path, store):
    root = _copy(base, tmp_path)
    _dup_row(root)
    with RangeServer(root) as srv:
        src = root if store == "local" else srv.url
        ds = Dataset(src, spec=base.spec)
        vol = ds.open(0)
        for c in _chunks_of_shard0():
            cb = _cbox(c)
            with pytest.raises(ChunkIndexError) as e:
                _ts_read(vol, cb)
            assert f"chunk {c}" in str(e.value) and "0_0_0" in str(e.value), (c, str(e.value))
            with pytest.raises(ChunkIndexError) as e:
                ds.read(cb)
            assert f"chunk {c}" in str(e.value), (c, str(e.value))


@pytest.mark.parametrize("store", ["local", "http"])
def test_15_a_failed_shard_load_is_not_repeated(base, tmp_path, store, monkeypatch):
    import dvidshards.read as read_mod

    root = _copy(base, tmp_path)
    _dup_row(root)
    loads = []
    real = read_mod.load_shard

    async def counting(store_, scale, origin, **kw):
        loads.append(tuple(int(v) for v in origin))
        return await real(store_, scale, origin, **kw)

    monkeypatch.setattr(read_mod, "load_shard", counting)
    with RangeServer(root) as srv:
        ds = Dataset(root if store == "local" else srv.url, spec=base.spec)
        vol = ds.open(0)
        for c in _chunks_of_shard0():
            cb = _cbox(c)
            with pytest.raises(ChunkIndexError):
                _ts_read(vol, cb)
        assert loads.count((0, 0, 0)) == 1, loads
        for c in _chunks_of_shard0():
            cb = _cbox(c)
            with pytest.raises(ChunkIndexError):
                ds.read(cb)
        # "within one store, until the store is reopened": one more load for the bulk reader at most
        assert loads.count((0, 0, 0)) <= 2, loads
        # the other shards still read exactly
        ok = [[128, 0, 0], [300, 100, 70]]
        np.testing.assert_array_equal(_ts_read(vol, ok), _want(base, ok))


def test_15_transient_remote_failure_is_not_remembered(base, tmp_path):
    root = _copy(base, tmp_path)
    with RangeServer(root) as srv:
        ds = Dataset(srv.url, spec=base.spec)
        box = [[0, 0, 0], [128, 100, 70]]
        srv.set_faults(fail=1.0)
        with pytest.raises(DvidShardsError):
            ds.read(box)
        srv.set_faults()
        np.testing.assert_array_equal(ds.read(box), _want(base, box))
