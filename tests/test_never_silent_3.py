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
