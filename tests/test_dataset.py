"""dvidshards.open: an export as a TensorStore volume, checked against the volumes it was written from."""

from __future__ import annotations

import concurrent.futures as cf
import json
import multiprocessing as mp
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import tensorstore as ts

import dvidshards
from dvidshards import (
    ChunkIndexError,
    Dataset,
    GeometryWarning,
    MappingError,
    MissingShardError,
    SpecError,
)
from dvidshards.formats.codec import decode_block
from dvidshards.formats.multiscale import parse_multiscale
from tests.support.data import REAL_SHARD
from tests.support.exports import THREE_SHARDS, copy_export, crop, make_export, spec_file, ts_read


def _boxes(shape, rng, n):
    """Aligned, unaligned, single-voxel, edge-touching and shard-crossing boxes."""
    sx, sy, sz = shape
    yield tuple(slice(0, min(64, s)) for s in shape)
    yield np.s_[:, :, :]
    yield np.s_[sx - 1:sx, sy - 1:sy, sz - 1:sz]
    yield tuple(slice(v % s, v % s + 1) for v, s in zip((5, 77, 130), shape, strict=True))
    yield tuple(slice(s // 2, s) for s in shape)  # to the volume edge
    # across chunk and (at scale 0) shard corners: shards are 128 voxels
    yield tuple(slice(max(0, min(s, 136) - 16), min(s, 136)) for s in shape)
    for _ in range(n):
        lo = [int(rng.integers(0, s)) for s in shape]
        hi = [int(rng.integers(a + 1, min(s, a + 140) + 1)) for a, s in zip(lo, shape, strict=True)]
        yield tuple(slice(a, b) for a, b in zip(lo, hi, strict=True))


@pytest.mark.parametrize("labels", ["agglomerated", "supervoxels", "mapping"])
def test_boxes_equal_written_volume(synthetic_export, labels):
    ex = synthetic_export
    rng = np.random.default_rng(1)
    mapping = None
    if labels == "mapping":  # a newer mapping: merge bodies and leave some supervoxels unmapped
        m = ex.mapping.copy()
        m[:, 1] = m[0, 1]
        mapping = m[::2]
    for k in range(len(ex.scales)):
        vol = dvidshards.open(ex.root, scale=k, labels=mapping if mapping is not None else labels, spec=ex.spec)
        want = ex.expected(k, mapping if mapping is not None else labels)
        assert vol.shape == want.shape and vol.dtype == ts.uint64
        assert list(vol.domain.labels) == ["x", "y", "z"]
        for box in _boxes(want.shape, rng, 8 if k == 0 else 3):
            got = vol[box].read(order="F").result()
            np.testing.assert_array_equal(got, want[box], err_msg=f"scale {k} box {box}")


def test_chunk_layout_and_units(synthetic_export):
    vol = dvidshards.open(synthetic_export.root, spec=synthetic_export.spec, scale=1)
    layout = vol.chunk_layout
    assert list(layout.read_chunk.shape) == [64, 64, 64]
    assert list(layout.grid_origin) == [0, 0, 0]
    assert list(layout.inner_order) == [2, 1, 0]
    assert [u.multiplier for u in vol.dimension_units] == [16, 16, 16]


def test_scale_by_resolution_and_dataset(synthetic_export):
    ds = dvidshards.Dataset(synthetic_export.root, spec=synthetic_export.spec)
    assert ds.scale((16, 16, 16)).index == 1 and ds.scale(resolution=(32, 32, 32)).index == 2
    with pytest.raises(dvidshards.SpecError, match="resolution"):
        ds.scale(32.0)  # a bare number is not a resolution
    assert ds.info["scales"][0]["size"] == list(synthetic_export.sv.shape)
    with pytest.raises(dvidshards.SpecError):
        ds.scale(5)
    with pytest.raises(dvidshards.SpecError):
        dvidshards.open(synthetic_export.root, spec=synthetic_export.spec, labels="supervoxel")


def test_geometry_inferred_without_spec(synthetic_export):
    """No spec and no info: shard extent from file names, size = whole chunks up to the last one present."""
    with pytest.warns(dvidshards.GeometryWarning, match="guessed from its file names") as rec:
        ds = dvidshards.Dataset(synthetic_export.root)
    assert len(rec) == 1 and rec[0].filename == __file__  # once, and at the caller's line
    s0 = ds.scales[0]
    assert s0.shard_extent == 128 and s0.inferred
    nz = np.argwhere(synthetic_export.sv)
    last = (nz.max(axis=0) // 64 + 1) * 64  # data present in the last chunk of each axis
    assert s0.size == tuple(int(v) for v in last)
    n = [min(a, b) for a, b in zip(s0.size, synthetic_export.sv.shape, strict=True)]
    got = ds.open(0)[: n[0], : n[1], : n[2]].read(order="F").result()
    np.testing.assert_array_equal(got, synthetic_export.expected(0)[: n[0], : n[1], : n[2]])


def test_info_file_in_export(tmp_path):
    from tests.support.exports import make_export

    ex = make_export(tmp_path / "e", shape=(130, 70, 64), scales=1, info=True)
    vol = dvidshards.open(ex.root)  # geometry from ./info
    np.testing.assert_array_equal(vol.read(order="F").result(), ex.expected(0))


def test_missing_chunk_is_background_missing_shard_is_error(tmp_path, synthetic_export):
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(synthetic_export.root, root)
    (root / "s0" / "128_0_0.arrow").unlink()
    vol = dvidshards.open(root, spec=synthetic_export.spec)
    with pytest.raises(dvidshards.MissingShardError, match="128_0_0.arrow"):
        vol[130:140, 0:10, 0:10].read().result()
    filled = dvidshards.open(root, spec=synthetic_export.spec, fill_missing_shards=True)
    assert not filled[128:200, 0:128, 0:128].read().result().any()
    np.testing.assert_array_equal(filled[0:128, 0:128, 0:128].read(order="F").result(),
                                  synthetic_export.expected(0)[0:128, 0:128, 0:128])


def test_real_shard_every_chunk_equals_its_record(dvid_data, tmp_path, real_records):
    """The real mCNS shard opened as a one-shard dataset (scale 1 of the real spec)."""
    (tmp_path / "s1").mkdir()
    (tmp_path / "s1" / f"{REAL_SHARD}.arrow").symlink_to(dvid_data / f"{REAL_SHARD}.arrow")
    (tmp_path / "s1" / f"{REAL_SHARD}.csv").symlink_to(dvid_data / f"{REAL_SHARD}-newformat.csv")
    spec = json.loads((dvid_data / "mcns-ng-specs.json").read_text())
    agg = dvidshards.open(tmp_path, scale=1, spec=spec)
    svs = dvidshards.open(tmp_path, scale=1, spec=spec, labels="supervoxels")
    for r in real_records:
        box = tuple(slice(64 * c, 64 * c + 64) for c in (r["chunk_x"], r["chunk_y"], r["chunk_z"]))
        got = agg[box].read(order="F").result()
        np.testing.assert_array_equal(got.T, decode_block(r["block"], np.array(r["labels"], np.uint64)))
        np.testing.assert_array_equal(svs[box].read(order="F").result().T, decode_block(r["block"]))
    # a chunk of the shard's box with no record reads as 0
    assert not agg[500 * 64:501 * 64, 413 * 64:414 * 64, 469 * 64:470 * 64].read().result().any()


def _read_in_child(payload):
    store, box = pickle.loads(payload)
    return store[box].read(order="F").result()


def test_pickle_into_spawn_process(synthetic_export):
    vol = dvidshards.open(synthetic_export.root, spec=synthetic_export.spec, labels="supervoxels")
    box = np.s_[50:190, 20:150, 10:140]
    vol[box].read().result()  # TensorStore threads are running: the child must be spawned
    payload = pickle.dumps((vol, box))
    with cf.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        got = pool.submit(_read_in_child, payload).result(timeout=300)
    np.testing.assert_array_equal(got, synthetic_export.expected(0, "supervoxels")[box])


def test_threads_agree_with_serial(synthetic_export):
    vol = dvidshards.open(synthetic_export.root, spec=synthetic_export.spec,
                          context=ts.Context({"data_copy_concurrency": {"limit": 4}}))
    rng = np.random.default_rng(5)
    boxes = list(_boxes(synthetic_export.sv.shape, rng, 24))
    serial = [vol[b].read(order="F").result() for b in boxes]
    with cf.ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(lambda b=b: vol[b].read(order="F").result()) for b in boxes]
        for f, want in zip(futs, serial, strict=True):
            np.testing.assert_array_equal(f.result(timeout=120), want)


def test_body_and_to_dask_methods_delegate(tmp_path):
    """ds.body(id) and ds.to_dask() are the Body API and arrays.to_dask on this dataset."""
    pytest.importorskip("dask.array")
    from dvidshards.bodies import Body
    from tests.support.exports import make_export

    exp = make_export(tmp_path / "exp", shape=(130, 100, 70), seed=5, scales=1)
    ds = dvidshards.Dataset(exp.root, spec=exp.spec)
    bodies = exp.expected(0)
    ids, counts = np.unique(bodies[bodies != 0], return_counts=True)
    b = ds.body(int(ids[np.argmax(counts)]))
    assert isinstance(b, Body) and b.size() == int(counts.max())
    a = ds.to_dask(scale=0, labels="supervoxels", chunks=64, fill_missing_shards=True)
    np.testing.assert_array_equal(a.compute(scheduler="sync"), exp.sv)
    box = [[0, 0, 0], [64, 100, 70]]
    a = ds.to_dask(box, labels="supervoxels", chunks=64, fill_missing_shards=True)
    np.testing.assert_array_equal(a.compute(scheduler="sync"), exp.sv[:64])
    for positional in (lambda: ds.to_dask(box, 0), lambda: ds.read(box, 0), lambda: ds.body(1, 0),
                       lambda: ds.labels(box, 0), lambda: ds.chunks_with([1], 0), lambda: ds.body_mask(1, 0)):
        with pytest.raises(TypeError, match="positional argument"):  # the scale and labels are keywords
            positional()


# --- geometry from a spec, from file names, or from another volume -----------------------------------


def test_a_guessed_shard_size_never_reads_a_missing_shard_as_background(three_shards, tmp_path):
    root = copy_export(three_shards, tmp_path)
    shutil.rmtree(root / "s1")
    for p in (root / "s0").glob("128_*"):
        p.unlink()  # files remain only at x = 0 and 256: the names suggest 256-voxel shards
    with pytest.warns(GeometryWarning, match="spec"):
        ds = Dataset(root)
    s = ds.scale(0)
    assert "shard_extent" in s.inferred and "inferred" in ds.info["scales"][0]
    vol = ds.open(0)
    box = [[130, 0, 0], [190, 60, 60]]  # inside the missing shard 128_0_0 (true size 128)
    assert crop(three_shards, box).any()
    with pytest.raises((SpecError, MissingShardError)) as e:
        ts_read(vol, box)
    assert "spec" in str(e.value)
    with pytest.raises((SpecError, MissingShardError)):
        ds.read(box)
    # with the spec: MissingShardError naming the file
    with pytest.raises(MissingShardError, match="128_0_0"):
        ts_read(dvidshards.open(root, spec=three_shards.spec), box)
    # what exists still reads exactly
    ok = [[0, 0, 0], [128, 100, 70]]
    np.testing.assert_array_equal(ts_read(vol, ok), crop(three_shards, ok))


def test_units_unknown_without_a_spec_and_given_by_resolution(three_shards, tmp_path):
    root = copy_export(three_shards, tmp_path)
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
    with_spec = dvidshards.open(root, spec=three_shards.spec, scale=1)
    assert list(with_spec.dimension_units) == [ts.Unit(16, "nm")] * 3


def test_scale_k_is_folder_sk(tmp_path):
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


def test_a_scale_by_position_or_by_resolution(three_shards):
    ds = Dataset(three_shards.root, spec=three_shards.spec)
    with pytest.raises(SpecError, match="resolution"):
        ds.open(16.0)
    with pytest.raises(SpecError):
        dvidshards.open(three_shards.root, spec=three_shards.spec, scale=16.0)
    with pytest.raises(SpecError, match="s16"):
        ds.open(16)
    assert ds.scale(resolution=(16, 16, 16)).index == 1
    assert ds.scale((8, 8, 8)).index == 0


def test_a_missing_mapping_file_is_told_from_a_misspelt_label_mode(three_shards, tmp_path):
    missing = tmp_path / "mappings.txt"
    with pytest.raises(MappingError, match="mappings.txt") as e:
        dvidshards.open(three_shards.root, spec=three_shards.spec, labels=str(missing))
    assert "not found" in str(e.value) or "No such" in str(e.value)
    with pytest.raises(SpecError, match="agglomerated") as e:
        dvidshards.open(three_shards.root, spec=three_shards.spec, labels="agglomorated")
    assert not isinstance(e.value, MappingError)


def test_a_shard_file_named_with_other_digits_is_not_taken_for_a_shard(three_shards, tmp_path):
    root = copy_export(three_shards, tmp_path)
    # '٣' is an Arabic-Indic 3: re's \d and int() accept it, DVID never writes it
    shutil.copy(root / "s0" / "0_0_0.arrow", root / "s0" / "٣٨٤_0_0.arrow")
    ds = Dataset(root, spec=three_shards.spec)
    assert (384, 0, 0) not in ds.shards(0)
    assert ds.shards(0) == [(0, 0, 0), (128, 0, 0), (256, 0, 0)]


@pytest.mark.parametrize("bad", [["300", 100, 70], [300.5, 100, 70], [True, 100, 70], ["³⁰⁰", 100, 70]])
def test_a_spec_size_that_is_not_integers_is_a_spec_error(three_shards, bad):
    spec = json.loads(json.dumps(three_shards.spec))
    spec["scales"][0]["size"] = bad
    with pytest.raises(SpecError, match="size must be three integers"):
        Dataset(three_shards.root, spec=spec)


def test_a_spec_size_of_integral_floats_is_read(three_shards):
    spec = json.loads(json.dumps(three_shards.spec))
    spec["scales"][0]["size"] = [float(v) for v in THREE_SHARDS]
    assert parse_multiscale(spec)[0].size == THREE_SHARDS


def test_deeply_nested_json_is_a_typed_error(tmp_path, three_shards):
    spec = tmp_path / "spec.json"
    spec.write_text("[" * 100_000)
    with pytest.raises(SpecError, match="not valid JSON"):
        Dataset(three_shards.root, spec=spec)
    from dvidshards.formats.chunkindex import parse_footer

    with pytest.raises(ChunkIndexError, match="not JSON"):
        parse_footer(b"[" * 100_000, (64, 64, 64), "x.arrow")


@pytest.mark.parametrize("what", ["missing", "file"])
def test_a_wrong_path_says_what_is_wrong_with_it(tmp_path, capsys, what):
    from dvidshards.cli import main

    path = tmp_path / "exp"
    if what == "file":
        path.write_text("not an export")
    with pytest.raises(SpecError, match="no such folder" if what == "missing" else "is a file, not a folder"):
        dvidshards.open(path)
    assert main(["info", str(path)]) == 2
    err = capsys.readouterr().err
    assert ("no such folder" if what == "missing" else "is a file, not a folder") in err, err
    assert "not a directory" not in err


def _other_spec(three_shards, **changes) -> dict:
    """The export's spec with its scale entries changed (e.g. another sharding or size)."""
    spec = json.loads(json.dumps(three_shards.spec))
    for s in spec["scales"]:
        for k, v in changes.items():
            if v is None:
                s.pop(k, None)
            else:
                s[k] = v(s) if callable(v) else v
    return spec


def _bigger_shards(s):
    sh = dict(s["sharding"])
    sh["minishard_bits"] = sh["minishard_bits"] + 3  # shards of 256 voxels instead of 128
    sh["shard_bits"] = max(0, sh["shard_bits"] - 3)
    return sh


OTHER_SPECS = {
    "shards of 256 voxels": dict(sharding=_bigger_shards),
    "no sharding (one shard)": dict(sharding=None),
    "a smaller volume": dict(size=lambda s: [min(v, 100) for v in s["size"]]),
}


def _spec_error_names_a_file(e, base_root) -> None:
    msg = str(e.value)
    assert "this shard file" in msg and ".arrow" in msg and str(base_root) in msg, msg
    assert "not this export's" in msg, msg


@pytest.mark.parametrize("other", list(OTHER_SPECS))
def test_open_with_the_spec_of_another_volume_is_a_spec_error_at_open(three_shards, other):
    spec = _other_spec(three_shards, **OTHER_SPECS[other])
    with pytest.raises(SpecError, match="not on the shard grid|outside the volume") as e:
        dvidshards.open(three_shards.root, spec=spec)
    _spec_error_names_a_file(e, three_shards.root)
    ds = Dataset(three_shards.root, spec=spec)
    for call in (lambda: ds.read([[0, 0, 0], [64, 64, 64]]), lambda: ds.shards(0), lambda: ds.open(0),
                 lambda: ds.chunks(0), lambda: ds.open(0, fill_missing_shards=True)):
        with pytest.raises(SpecError, match="not on the shard grid|outside the volume"):
            call()


def test_the_export_s_own_spec_opens_and_reads_exactly(three_shards):
    vol = dvidshards.open(three_shards.root, spec=three_shards.spec)
    np.testing.assert_array_equal(vol.read(order="F").result(), three_shards.expected(0))


@pytest.mark.parametrize("store", ["memory", "s3"])
def test_another_volume_s_spec_is_a_spec_error_on_other_stores(three_shards, store, tmp_path):
    from dvidshards.stores import MemoryStore

    spec = _other_spec(three_shards, **OTHER_SPECS["shards of 256 voxels"])
    files = {p.relative_to(three_shards.root).as_posix(): p.read_bytes() for p in Path(three_shards.root).rglob("*") if p.is_file()}
    if store == "memory":
        src, ctx = MemoryStore(files, name="exp"), None
    else:
        pytest.importorskip("moto.server")
        from tests.support.servers import MotoS3

        ctx = MotoS3().start()
        for k, v in files.items():
            ctx.upload("ns3", "exp/" + k, v)
        src = ctx.spec("ns3", "exp/")
    try:
        # at open (memory: every name is at hand) or at the first read (s3: a listing is not free,
        # the reader looks next to the first shards it loads)
        with pytest.raises(SpecError, match="128_0_0.arrow: this shard file is not on the shard grid"):
            dvidshards.open(src, spec=spec).read().result()
        with pytest.raises(SpecError, match="128_0_0.arrow: this shard file is not on the shard grid"):
            Dataset(src, spec=spec).read([[0, 0, 0], [64, 64, 64]])
        with pytest.raises(SpecError, match="not on the shard grid"):
            Dataset(src, spec=spec).shards(0)  # a job's listing
        np.testing.assert_array_equal(Dataset(src, spec=three_shards.spec).read([[0, 0, 0], list(THREE_SHARDS)]),
                                      three_shards.expected(0))
    finally:
        if ctx is not None:
            ctx.stop()


def test_cli_with_another_volume_s_spec_exits_2_naming_a_file(three_shards, tmp_path, capsys):
    from dvidshards.cli import main

    spec = tmp_path / "other.json"
    spec.write_text(json.dumps(_other_spec(three_shards, **OTHER_SPECS["shards of 256 voxels"])))
    for argv in (["info", three_shards.root, "--spec", str(spec), "--no-chunks"],
                 ["consolidate", three_shards.root, "--spec", str(spec), "--out", str(tmp_path / "idx")]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "SpecError" in err and "128_0_0.arrow" in err and "not on the shard grid" in err, err
        assert "Traceback" not in err
    assert not (tmp_path / "idx").exists()  # nothing written


def test_a_job_worker_checks_the_files_of_its_scale_once(three_shards, tmp_path):
    """A reader pickled to another process lists the scale itself (never carries the listing)."""
    import pickle

    from dvidshards.formats.labels import as_labels
    from dvidshards.read import ChunkReader
    from dvidshards.stores import LocalStore

    spec = _other_spec(three_shards, **OTHER_SPECS["shards of 256 voxels"])
    s = Dataset(three_shards.root, spec=spec).scale(0)
    reader = pickle.loads(pickle.dumps(ChunkReader(LocalStore(three_shards.root), s, as_labels("agglomerated"))))
    with pytest.raises(SpecError, match="not on the shard grid"):
        reader.shard(0, 0, 0)
    good = Dataset(three_shards.root, spec=three_shards.spec).reader(0)
    assert len(pickle.dumps(good)) < 4096  # no listing in the task


@pytest.fixture(scope="module")
def only_s1(three_shards, tmp_path_factory):
    root = Path(tmp_path_factory.mktemp("only_s1")) / "exp"
    shutil.copytree(three_shards.root, root)
    shutil.rmtree(root / "s0")
    return root


def test_a_scale_without_a_folder_is_a_spec_error_for_listing_and_reading(three_shards, only_s1):
    ds = Dataset(only_s1, spec=three_shards.spec)
    for call in (lambda: ds.shards(0), lambda: ds.read([[0, 0, 0], [64, 64, 64]], scale=0), lambda: ds.open(0),
                 lambda: ds.chunks(0), lambda: ds.shard(0, (0, 0, 0)),
                 lambda: dvidshards.open(only_s1, spec=three_shards.spec, scale=0)):
        with pytest.raises(SpecError, match="has no folder s0") as e:
            call()
        assert str(only_s1) in str(e.value)
    # scale 1 is there and reads exactly
    np.testing.assert_array_equal(ds.read([[0, 0, 0], list(ds.scale(1).size)], scale=1), three_shards.expected(1))


def test_fill_missing_shards_reads_a_missing_scale_as_background(three_shards, only_s1):
    vol = dvidshards.open(only_s1, spec=three_shards.spec, scale=0, fill_missing_shards=True)
    assert not vol.read().result().any()
    ds = Dataset(only_s1, spec=three_shards.spec)
    assert not ds.read([[0, 0, 0], [100, 64, 64]], scale=0, fill_missing_shards=True).any()


def test_an_empty_scale_folder_is_all_background_not_an_error(three_shards, tmp_path):
    root = copy_export(three_shards, tmp_path)
    for p in (root / "s0").iterdir():
        p.unlink()
    ds = Dataset(root, spec=three_shards.spec)
    assert ds.shards(0) == []
    with pytest.raises(dvidshards.MissingShardError, match="fill_missing_shards"):
        ds.read([[0, 0, 0], [64, 64, 64]], scale=0)


@pytest.mark.parametrize("store", ["memory", "s3"])
def test_a_scale_without_a_folder_on_other_stores(three_shards, only_s1, store):
    from dvidshards.stores import MemoryStore

    files = {p.relative_to(only_s1).as_posix(): p.read_bytes() for p in only_s1.rglob("*") if p.is_file()}
    ctx = None
    if store == "memory":
        src = MemoryStore(files, name="only_s1")
    else:
        pytest.importorskip("moto.server")
        from tests.support.servers import MotoS3

        ctx = MotoS3().start()
        for k, v in files.items():
            ctx.upload("ns3b", "exp/" + k, v)
        src = ctx.spec("ns3b", "exp/")
    try:
        ds = Dataset(src, spec=three_shards.spec)
        with pytest.raises(SpecError, match="has no folder s0"):
            ds.shards(0)
        with pytest.raises(SpecError, match="has no folder s0"):
            ds.read([[0, 0, 0], [64, 64, 64]], scale=0)
        assert len(ds.shards(1)) == 1
    finally:
        if ctx is not None:
            ctx.stop()


def test_consolidate_refuses_a_scale_without_a_folder_and_writes_nothing_for_it(three_shards, only_s1, tmp_path, capsys):
    from dvidshards.cli import main
    from dvidshards.consolidated import write_consolidated

    ds = Dataset(only_s1, spec=three_shards.spec)
    with pytest.raises(SpecError, match="has no folder s0"):
        write_consolidated(ds, ds.scale(0), str(tmp_path / "idx"))
    assert not (tmp_path / "idx").exists()
    assert main(["consolidate", str(only_s1), "--spec", spec_file(three_shards, tmp_path), "--scale", "1",
                 "--out", str(tmp_path / "idx1")]) == 0
    assert sorted(p.name for p in (tmp_path / "idx1").iterdir()) == ["s1.chunks.arrow", "s1.shards.arrow"]
    assert main(["consolidate", str(only_s1), "--spec", spec_file(three_shards, tmp_path), "--scale", "0",
                 "--out", str(tmp_path / "idx0")]) == 2
    assert "has no folder s0" in capsys.readouterr().err
    assert not (tmp_path / "idx0").exists()


# --- the package's API: one convention, properties without I/O, every job by name --------------------


class _Watched(dvidshards.stores.MemoryStore):
    """A memory store that counts what it is asked (listings and reads)."""

    asked: list

    def _count(self, what):
        self.asked.append(what)

    async def list(self, prefix=""):
        self._count(("list", prefix))
        return await super().list(prefix)

    async def read(self, key, start=None, stop=None):
        self._count(("read", key))
        return await super().read(key, start, stop)

    async def get(self, key):
        self._count(("get", key))
        return await super().get(key)

    async def exists(self, key):
        self._count(("exists", key))
        return await super().exists(key)


def test_properties_never_read_the_store(three_shards):
    from pathlib import Path

    from dvidshards.protocol import DatasetLike

    root = Path(three_shards.root)
    st = _Watched({p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()})
    st.asked = []
    ds = dvidshards.Dataset(st, spec=three_shards.spec)
    st.asked.clear()
    assert ds.exported == (0, 1) and ds.info["scales"][0]["size"] == list(ds.scale(0).size) and ds.store is st
    assert st.asked == []  # found at open, not on access
    assert isinstance(ds, DatasetLike) and not isinstance(object(), DatasetLike)


def test_every_job_is_exported_by_name_and_imported_on_first_use():
    import subprocess
    import sys

    import dvidshards.jobs
    import dvidshards.jobs.convert  # the module of the same name: the package still gives the function
    from dvidshards.jobs import convert, downsample, verify

    jobs = ("convert", "body_stats", "label_index", "downsample", "meshes", "pcg_edges", "ingest", "verify",
            "skeletons")
    for name in jobs:
        f = getattr(dvidshards.jobs, name)
        assert callable(f) and f.__name__ == name and getattr(dvidshards, name) is f and name in dvidshards.__all__
    assert convert.__module__ == "dvidshards.jobs.convert" and downsample is dvidshards.downsample
    assert verify is dvidshards.verify and issubclass(dvidshards.VerifyReport, dvidshards.JobReport)
    code = "import sys, dvidshards; print(sorted(m for m in sys.modules if m.startswith('dvidshards.jobs')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"  # import dvidshards imports no job
