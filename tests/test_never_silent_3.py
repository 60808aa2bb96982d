"""Issue 23 (never silent, round 3): the reader, writer, stores and sources.

Each test is named after the issue's item and does what a user did: opens an export with a
spec, reads, writes a shard, consolidates, serves. It then asserts the exact answer, or the
typed error and what its message must name, and that nothing misleading is left behind.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import dvidshards
from dvidshards import ChunkIndexError, Dataset, SpecError
from dvidshards.formats.multiscale import parse_multiscale
from tests.conftest import make_export

SHAPE = (300, 100, 70)  # shards of 128 voxels (2 chunks) at x = 0, 128, 256


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A clean 2-scale export (variant A, one record per batch); tests copy it before changing it."""
    return make_export(tmp_path_factory.mktemp("ns3") / "exp", SHAPE, seed=5, scales=2, shard_chunks=2)


def _copy(base, tmp_path, name="exp") -> Path:
    dst = tmp_path / name
    shutil.copytree(base.root, dst)
    return dst


def _records(arrow: bytes) -> list[dict]:
    out = []
    for batch in pa.ipc.open_stream(pa.py_buffer(arrow)):
        d = batch.to_pydict()
        out += [{k: d[k][i] for k in d} for i in range(batch.num_rows)]
    return out


# --- 10. untyped errors from parsers --------------------------------------------------------------------


def _with_footer(arrow: bytes, footer: dict) -> bytes:
    """A variant D shard's bytes with its CHUNKIDX footer replaced."""
    n = struct.unpack("<Q", arrow[-16:-8])[0]
    body = arrow[:len(arrow) - 16 - n]
    blob = json.dumps(footer, ensure_ascii=False).encode()
    return body + blob + struct.pack("<Q", len(blob)) + b"CHUNKIDX"


@pytest.mark.parametrize("key", ["²_0_0", "0_٣_0", "0_0_0x"])
def test_10_chunkidx_key_with_a_non_ascii_digit_is_a_chunk_index_error(base, tmp_path, key):
    from dvidshards.writer import write_shard

    root = _copy(base, tmp_path)
    recs = _records((root / "s0" / "0_0_0.arrow").read_bytes())
    for p in (root / "s0").glob("0_0_0.*"):
        p.unlink()
    write_shard(root / "s0" / "0_0_0", recs, index="D")
    arrow = root / "s0" / "0_0_0.arrow"
    arrow.write_bytes(_with_footer(arrow.read_bytes(), {key: 0}))
    for policy in ("eager", "lazy"):
        ds = Dataset(root, spec=base.spec, policy=policy)
        with pytest.raises(ChunkIndexError, match="CHUNKIDX") as e:
            ds.read([[0, 0, 0], [64, 64, 64]])
        assert "0_0_0.arrow" in str(e.value)


def test_10_shard_file_named_with_other_digits_is_not_taken_for_a_shard(base, tmp_path):
    root = _copy(base, tmp_path)
    # '٣' is an Arabic-Indic 3: re's \d and int() accept it, DVID never writes it
    shutil.copy(root / "s0" / "0_0_0.arrow", root / "s0" / "٣٨٤_0_0.arrow")
    ds = Dataset(root, spec=base.spec)
    assert (384, 0, 0) not in ds.shards(0)
    assert ds.shards(0) == [(0, 0, 0), (128, 0, 0), (256, 0, 0)]


@pytest.mark.parametrize("bad", [["300", 100, 70], [300.5, 100, 70], [True, 100, 70], ["³⁰⁰", 100, 70]])
def test_10_spec_size_that_is_not_integers_is_a_spec_error(base, bad):
    spec = json.loads(json.dumps(base.spec))
    spec["scales"][0]["size"] = bad
    with pytest.raises(SpecError, match="size must be three integers"):
        Dataset(base.root, spec=spec)


def test_10_spec_size_of_integral_floats_is_read(base):
    spec = json.loads(json.dumps(base.spec))
    spec["scales"][0]["size"] = [float(v) for v in SHAPE]
    assert parse_multiscale(spec)[0].size == SHAPE


def test_10_deeply_nested_json_is_a_typed_error(tmp_path, base):
    spec = tmp_path / "spec.json"
    spec.write_text("[" * 100_000)
    with pytest.raises(SpecError, match="not valid JSON"):
        Dataset(base.root, spec=spec)
    from dvidshards.formats.chunkindex import parse_footer

    with pytest.raises(ChunkIndexError, match="not JSON"):
        parse_footer(b"[" * 100_000, (64, 64, 64), "x.arrow")


def test_10_flight_descriptor_path_with_a_non_ascii_digit_is_a_spec_error(base):
    import pyarrow.flight as fl

    from dvidshards.serve.flight import serve

    with serve(base.root, spec=base.spec) as server:
        client = fl.connect(server.location)
        with pytest.raises(fl.FlightError) as e:
            client.get_flight_info(fl.FlightDescriptor.for_path("s²"))
        assert "descriptor path" in str(e.value)
        assert "ValueError" not in str(e.value)


# --- 4c. a refused or interrupted write leaves nothing ---------------------------------------------------


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*"))


def test_4c_write_shard_of_records_it_refuses_leaves_no_file(base, tmp_path):
    from dvidshards.writer import write_shard

    recs = _records((Path(base.root) / "s0" / "0_0_0.arrow").read_bytes())
    bad = [{k: v for k, v in r.items() if k != "uncompressed_size"} for r in recs]
    folder = tmp_path / "s0"
    folder.mkdir()
    with pytest.raises(SpecError, match="uncompressed_size"):
        write_shard(folder / "0_0_0", bad)
    assert _files(folder) == []
    with pytest.raises(SpecError, match="record"):
        write_shard(folder / "0_0_0", [{**recs[0], "chunk_x": "left"}])
    assert _files(folder) == []


def test_4c_write_shard_interrupted_leaves_the_old_shard_as_it_was(base, tmp_path):
    from dvidshards.writer import write_shard

    root = _copy(base, tmp_path)
    before = {p.name: p.read_bytes() for p in (root / "s0").iterdir()}
    recs = _records(before["0_0_0.arrow"])

    def interrupted():
        yield recs[0]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_shard(root / "s0" / "0_0_0", interrupted())
    assert {p.name: p.read_bytes() for p in (root / "s0").iterdir()} == before
    want = base.expected(0)[:128, :64, :64]
    np.testing.assert_array_equal(Dataset(root, spec=base.spec).read([[0, 0, 0], [128, 64, 64]]), want)


def test_4c_write_shard_variant_d_over_a_removes_the_old_csv(base, tmp_path):
    from dvidshards.writer import write_shard

    root = _copy(base, tmp_path)
    recs = _records((root / "s0" / "0_0_0.arrow").read_bytes())
    write_shard(root / "s0" / "0_0_0", recs[::-1], index="D")
    assert not (root / "s0" / "0_0_0.csv").exists()  # else the old index would be read
    np.testing.assert_array_equal(Dataset(root, spec=base.spec).read([[0, 0, 0], [128, 64, 64]]),
                                  base.expected(0)[:128, :64, :64])


def test_4c_write_export_interrupted_leaves_no_export(base, tmp_path, monkeypatch):
    import dvidshards.writer as w

    calls = []
    original = w._write_scale

    def second_scale_fails(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return original(*a, **k)

    monkeypatch.setattr(w, "_write_scale", second_scale_fails)
    with pytest.raises(KeyboardInterrupt):
        w.write_export(base.sv, tmp_path / "new", scales=2, shard_chunks=2)
    assert not (tmp_path / "new").exists()
    # over an existing export (overwrite=True): the old one stays whole
    root = _copy(base, tmp_path)
    before = _files(root)
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        w.write_export(base.sv[:100], root, scales=2, shard_chunks=2, overwrite=True)
    assert _files(root) == before
    np.testing.assert_array_equal(Dataset(root, spec=base.spec).read([[0, 0, 0], list(SHAPE)]), base.expected(0))


# --- 6. a record whose supervoxel list is not in its block's order -------------------------------------


@pytest.fixture(scope="module")
def reordered(base, tmp_path_factory):
    """The export with one record of s0/0_0_0 holding its (supervoxel, label) pairs sorted by id,
    not in its block's order (the block itself untouched)."""
    from dvidshards.formats.codec import block_header
    from dvidshards.writer import write_shard

    root = Path(tmp_path_factory.mktemp("reordered")) / "exp"
    shutil.copytree(base.root, root)
    recs = _records((root / "s0" / "0_0_0.arrow").read_bytes())
    import zstandard

    for r in recs:
        own = block_header(zstandard.ZstdDecompressor().decompress(r["dvid_compressed_block"])).labels.tolist()
        pairs = sorted(zip(r["supervoxels"], r["labels"], strict=True))
        if len(set(r["labels"])) > 1 and [p[0] for p in pairs] != own:
            r["supervoxels"], r["labels"] = [p[0] for p in pairs], [p[1] for p in pairs]
            chunk = (r["chunk_x"], r["chunk_y"], r["chunk_z"])
            break
    else:
        pytest.fail("no record with labels of several bodies in an unsorted block order")
    write_shard(root / "s0" / "0_0_0", recs)
    return root, chunk


def _chunk_box(c):
    lo = [64 * v for v in c]
    return [lo, [min(a + 64, s) for a, s in zip(lo, SHAPE, strict=True)]]


def _reads(ds, box, labels):
    """Every read path a user has: TensorStore, bulk whole chunks (row decode), bulk one chunk,
    bulk cropped chunk (scratch path), Shard.read_into."""
    (x0, y0, z0), (x1, y1, z1) = box
    vol = ds.open(0, labels=labels)
    yield "open", lambda: vol[x0:x1, y0:y1, z0:z1].read(order="F").result(timeout=60)
    yield "read row", lambda: ds.read([[0, 0, 0], [128, 64, 64]] if x0 < 128 else box, labels=labels)
    yield "read chunk", lambda: ds.read(box, labels=labels)
    yield "read cropped", lambda: ds.read([[x0 + 3, y0 + 1, z0 + 2], [x1 - 1, y1, z1]], labels=labels)
    from dvidshards.formats.labels import as_labels

    out = np.empty((z1 - z0, y1 - y0, x1 - x0), np.uint64)
    shard = ds.shard(0, (0, 0, 0))
    yield "read_into", lambda: shard.read_into(x0 // 64, y0 // 64, z0 // 64, out, as_labels(labels))


@pytest.mark.parametrize("policy", ["eager", "lazy"])
@pytest.mark.parametrize("labels", ["agglomerated", "supervoxels", "mapping"])
def test_6_record_with_supervoxels_in_another_order_is_an_error_on_every_read_path(base, reordered, policy,
                                                                                   labels):
    from dvidshards import BlockDecodeError

    root, chunk = reordered
    lab = base.mapping if labels == "mapping" else labels
    ds = Dataset(root, spec=base.spec, policy=policy)
    for how, read in _reads(ds, _chunk_box(chunk), lab):
        with pytest.raises(BlockDecodeError, match="supervoxel list is not its block's label list") as e:
            read()
        msg = str(e.value)
        assert "0_0_0.arrow" in msg and f"chunk {chunk}" in msg, (how, msg)
        assert "same ids in another order" in msg, (how, msg)
    # the other chunks of the shard read exactly
    other = [[0, 0, 0], [64, 64, 64]] if chunk != (0, 0, 0) else [[64, 0, 0], [128, 64, 64]]
    want = base.expected(0, lab)
    (x0, y0, z0), (x1, y1, z1) = other
    np.testing.assert_array_equal(ds.read(other, labels=lab), want[x0:x1, y0:y1, z0:z1])


def test_6_verify_reports_the_reordered_record(base, reordered):
    root, chunk = reordered
    report = dvidshards.verify(str(root), spec=base.spec)
    assert not report.ok
    assert any(f"chunk {chunk}" in p.message and "0_0_0" in p.message for p in report.problems), report.summary()


# --- 1. a spec for another volume -------------------------------------------------------------------------


def _other_spec(base, **changes) -> dict:
    """base's spec with its scale entries changed (e.g. another sharding or size)."""
    spec = json.loads(json.dumps(base.spec))
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
def test_1_open_with_the_spec_of_another_volume_is_a_spec_error_at_open(base, other):
    spec = _other_spec(base, **OTHER_SPECS[other])
    with pytest.raises(SpecError, match="not on the shard grid|outside the volume") as e:
        dvidshards.open(base.root, spec=spec)
    _spec_error_names_a_file(e, base.root)
    ds = Dataset(base.root, spec=spec)
    for call in (lambda: ds.read([[0, 0, 0], [64, 64, 64]]), lambda: ds.shards(0), lambda: ds.open(0),
                 lambda: ds.chunks(0), lambda: ds.open(0, fill_missing_shards=True)):
        with pytest.raises(SpecError, match="not on the shard grid|outside the volume"):
            call()


def test_1_the_export_s_own_spec_opens_and_reads_exactly(base):
    vol = dvidshards.open(base.root, spec=base.spec)
    np.testing.assert_array_equal(vol.read(order="F").result(), base.expected(0))


@pytest.mark.parametrize("store", ["memory", "s3"])
def test_1_another_volume_s_spec_is_a_spec_error_on_other_stores(base, store, tmp_path):
    from dvidshards.stores import MemoryStore

    spec = _other_spec(base, **OTHER_SPECS["shards of 256 voxels"])
    files = {p.relative_to(base.root).as_posix(): p.read_bytes() for p in Path(base.root).rglob("*") if p.is_file()}
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
        np.testing.assert_array_equal(Dataset(src, spec=base.spec).read([[0, 0, 0], list(SHAPE)]),
                                      base.expected(0))
    finally:
        if ctx is not None:
            ctx.stop()


def test_1_cli_with_another_volume_s_spec_exits_2_naming_a_file(base, tmp_path, capsys):
    from dvidshards.cli import main

    spec = tmp_path / "other.json"
    spec.write_text(json.dumps(_other_spec(base, **OTHER_SPECS["shards of 256 voxels"])))
    for argv in (["info", base.root, "--spec", str(spec), "--no-chunks"],
                 ["consolidate", base.root, "--spec", str(spec), "--out", str(tmp_path / "idx")]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "SpecError" in err and "128_0_0.arrow" in err and "not on the shard grid" in err, err
        assert "Traceback" not in err
    assert not (tmp_path / "idx").exists()  # nothing written


def test_1_a_job_worker_checks_the_files_of_its_scale_once(base, tmp_path):
    """A reader pickled to another process lists the scale itself (never carries the listing)."""
    import pickle

    from dvidshards.formats.labels import as_labels
    from dvidshards.read import ChunkReader
    from dvidshards.stores import LocalStore

    spec = _other_spec(base, **OTHER_SPECS["shards of 256 voxels"])
    s = Dataset(base.root, spec=spec).scale(0)
    reader = pickle.loads(pickle.dumps(ChunkReader(LocalStore(base.root), s, as_labels("agglomerated"))))
    with pytest.raises(SpecError, match="not on the shard grid"):
        reader.shard(0, 0, 0)
    good = Dataset(base.root, spec=base.spec).reader(0)
    assert len(pickle.dumps(good)) < 4096  # no listing in the task


# --- 2. a scale the spec lists but the export lacks -----------------------------------------------------


@pytest.fixture(scope="module")
def only_s1(base, tmp_path_factory):
    root = Path(tmp_path_factory.mktemp("only_s1")) / "exp"
    shutil.copytree(base.root, root)
    shutil.rmtree(root / "s0")
    return root


def test_2_a_scale_without_a_folder_is_a_spec_error_for_listing_and_reading(base, only_s1):
    ds = Dataset(only_s1, spec=base.spec)
    for call in (lambda: ds.shards(0), lambda: ds.read([[0, 0, 0], [64, 64, 64]], scale=0), lambda: ds.open(0),
                 lambda: ds.chunks(0), lambda: ds.shard(0, (0, 0, 0)),
                 lambda: dvidshards.open(only_s1, spec=base.spec, scale=0)):
        with pytest.raises(SpecError, match="has no folder s0") as e:
            call()
        assert str(only_s1) in str(e.value)
    # scale 1 is there and reads exactly
    np.testing.assert_array_equal(ds.read([[0, 0, 0], list(ds.scale(1).size)], scale=1), base.expected(1))


def test_2_fill_missing_shards_reads_a_missing_scale_as_background(base, only_s1):
    vol = dvidshards.open(only_s1, spec=base.spec, scale=0, fill_missing_shards=True)
    assert not vol.read().result().any()
    ds = Dataset(only_s1, spec=base.spec)
    assert not ds.read([[0, 0, 0], [100, 64, 64]], scale=0, fill_missing_shards=True).any()


def test_2_an_empty_scale_folder_is_all_background_not_an_error(base, tmp_path):
    root = _copy(base, tmp_path)
    for p in (root / "s0").iterdir():
        p.unlink()
    ds = Dataset(root, spec=base.spec)
    assert ds.shards(0) == []
    with pytest.raises(dvidshards.MissingShardError, match="fill_missing_shards"):
        ds.read([[0, 0, 0], [64, 64, 64]], scale=0)


@pytest.mark.parametrize("store", ["memory", "s3"])
def test_2_a_scale_without_a_folder_on_other_stores(base, only_s1, store):
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
        ds = Dataset(src, spec=base.spec)
        with pytest.raises(SpecError, match="has no folder s0"):
            ds.shards(0)
        with pytest.raises(SpecError, match="has no folder s0"):
            ds.read([[0, 0, 0], [64, 64, 64]], scale=0)
        assert len(ds.shards(1)) == 1
    finally:
        if ctx is not None:
            ctx.stop()


def test_2_11_consolidate_refuses_a_scale_without_a_folder_and_writes_nothing_for_it(base, only_s1, tmp_path, capsys):
    from dvidshards.cli import main
    from dvidshards.consolidated import write_consolidated

    ds = Dataset(only_s1, spec=base.spec)
    with pytest.raises(SpecError, match="has no folder s0"):
        write_consolidated(ds, ds.scale(0), str(tmp_path / "idx"))
    assert not (tmp_path / "idx").exists()
    assert main(["consolidate", str(only_s1), "--spec", _spec_file(base, tmp_path), "--scale", "1",
                 "--out", str(tmp_path / "idx1")]) == 0
    assert sorted(p.name for p in (tmp_path / "idx1").iterdir()) == ["s1.chunks.arrow", "s1.shards.arrow"]
    assert main(["consolidate", str(only_s1), "--spec", _spec_file(base, tmp_path), "--scale", "0",
                 "--out", str(tmp_path / "idx0")]) == 2
    assert "has no folder s0" in capsys.readouterr().err
    assert not (tmp_path / "idx0").exists()


def _spec_file(base, tmp_path) -> str:
    p = tmp_path / "spec.json"
    p.write_text(json.dumps(base.spec))
    return str(p)


# --- 8. a stale consolidated index: a shard appeared since --------------------------------------------


def _consolidate(root, out, spec=None):
    from dvidshards.consolidated import write_consolidated

    ds = Dataset(root, spec=spec)
    for s in ds.scales:
        write_consolidated(ds, s, str(out))
    return out


@pytest.mark.parametrize("with_spec", [True, False])
def test_8_a_shard_that_appeared_since_consolidate_is_a_stale_index(base, tmp_path, with_spec):
    import warnings

    from dvidshards.errors import GeometryWarning

    root = _copy(base, tmp_path)
    aside = tmp_path / "aside"
    aside.mkdir()
    for p in (root / "s0").glob("128_0_0.*"):
        shutil.move(p, aside / p.name)
    spec = base.spec if with_spec else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GeometryWarning)  # consolidating without a spec: geometry guessed
        idx = _consolidate(root, tmp_path / "idx", spec)
    for p in aside.iterdir():
        shutil.move(p, root / "s0" / p.name)
    for fill in (False, True):
        with pytest.raises(ChunkIndexError, match="the consolidated index is stale") as e:
            dvidshards.open(root, spec=spec, index=idx, fill_missing_shards=fill)
        assert "128_0_0.arrow" in str(e.value) and "dvidshards consolidate" in str(e.value)
    ds = Dataset(root, spec=spec, index=idx)
    for call in (lambda: ds.shards(0), lambda: ds.read([[128, 0, 0], [256, 64, 64]]), lambda: ds.chunks(0)):
        with pytest.raises(ChunkIndexError, match="stale"):
            call()


def test_8_a_shard_gone_since_consolidate_is_a_stale_index(base, tmp_path):
    root = _copy(base, tmp_path)
    idx = _consolidate(root, tmp_path / "idx", base.spec)
    for p in (root / "s0").glob("256_0_0.*"):
        p.unlink()
    with pytest.raises(ChunkIndexError, match="stale: .*256_0_0.arrow is gone"):
        dvidshards.open(root, spec=base.spec, index=idx)


def test_8_an_index_written_without_a_spec_opens_with_the_geometry_it_was_written_with(base, tmp_path):
    import warnings

    from dvidshards.errors import GeometryWarning

    root = _copy(base, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GeometryWarning)
        guessed = Dataset(root)
        idx = _consolidate(root, tmp_path / "idx")
    ds = Dataset(root, index=idx)
    assert ds.spec is None  # guessed geometry is never passed off as a spec
    for a, b in zip(ds.scales, guessed.scales, strict=True):
        assert (a.size, a.shard_extent, a.resolution, a.inferred, a.proven_extent) == \
            (b.size, b.shard_extent, b.resolution, b.inferred, b.proven_extent)
    box = [[0, 0, 0], list(SHAPE)]
    np.testing.assert_array_equal(ds.read(box), base.expected(0))


def test_8_reads_of_absent_shards_do_not_ask_the_store_about_each(base, tmp_path):
    """With an index and a listable store, the folder is listed once; absent shards cost no request."""
    from dvidshards.stores import MemoryStore

    root = _copy(base, tmp_path)
    for p in (root / "s0").glob("128_0_0.*"):
        p.unlink()
    idx = _consolidate(root, tmp_path / "idx", base.spec)

    class Counting(MemoryStore):
        calls = {"exists": 0, "list": 0}

        async def exists(self, key):
            self.calls["exists"] += 1
            return await super().exists(key)

        async def list(self, prefix=""):
            self.calls["list"] += 1
            return await super().list(prefix)

    files = {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    store = Counting(files)
    vol = dvidshards.open(store, spec=base.spec, index=idx, fill_missing_shards=True)
    got = vol.read(order="F").result()
    want = base.expected(0).copy()
    want[128:256] = 0
    np.testing.assert_array_equal(got, want)
    assert store.calls["exists"] == 0 and store.calls["list"] == 1, store.calls


# --- 11. rough edges --------------------------------------------------------------------------------------


def test_11_serve_flight_on_a_busy_port_is_one_line_naming_the_port(base, capsys):
    import socket

    from dvidshards.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["serve-flight", base.root, "--spec", _spec_file(base, Path(base.root).parent),
                     "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"127.0.0.1:{port}" in err and "in use" in err, err


def test_11_serve_flight_from_python_on_a_busy_port_is_an_os_error_naming_it(base):
    import errno
    import socket

    from dvidshards.serve.flight import serve

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(OSError, match=f"127.0.0.1:{port}") as e:
            serve(base.root, spec=base.spec, port=port)
    assert e.value.errno == errno.EADDRINUSE


@pytest.mark.parametrize("what", ["missing", "file"])
def test_11_a_wrong_path_says_what_is_wrong_with_it(tmp_path, capsys, what):
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


def test_11_ingest_reports_a_real_rate_or_none(base, tmp_path, capsys):
    import re

    from dvidshards.cli import main

    assert main(["ingest", base.root, "--to", str(tmp_path / "table"), "--spec",
                 _spec_file(base, tmp_path)]) == 0
    out = capsys.readouterr().out
    m = re.search(r"\(([0-9.]+) (k|M|G)?B in [0-9.]+ s(, ([0-9.]+) (k|M|G)?B/s)?\)", out)
    assert m, out
    assert " 0 MB/s" not in out
    if m.group(3):  # a rate, when one is told, is not zero
        assert float(m.group(4)) > 0
    # again: every shard already there, nothing moved, no rate
    assert main(["ingest", base.root, "--to", str(tmp_path / "table"), "--spec",
                 _spec_file(base, tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "B/s" not in out and "already there" in out, out


def test_1_mcns_sized_export_opened_with_larger_shards_fails_at_the_first_read():
    """The procedural mCNS store cannot hand out a cheap sample of names: the first load's
    probes find the files between the larger grid's origins (no listing of ~26,500 names)."""
    from tests.support.procedural import ProceduralStore, mcns_spec

    store = ProceduralStore(shrink=8)
    spec = mcns_spec(8)
    for s in spec["scales"]:  # shards of 8 chunks per side, twice the export's 4
        s["sharding"] = dict(s["sharding"], minishard_bits=s["sharding"]["minishard_bits"] + 3,
                             shard_bits=max(0, s["sharding"]["shard_bits"] - 3))
    ds = Dataset(store, spec=spec)
    s0 = ds.scale(0)
    assert s0.shard_extent == 2 * Dataset(store, spec=store.spec).scale(0).shard_extent
    c = next(c for o in store.shard_origins(0) if s0.is_origin(o) for c in store.shard_chunks(0, o)[:1])
    with pytest.raises(SpecError, match="this shard file is not on the shard grid") as e:
        ds.read([[64 * int(v) for v in c], [64 * int(v) + 64 for v in c]])
    assert "procedural://" in str(e.value)
