"""Tests of dvidshards.writer and dvidshards.synthetic.

Everything written is read back with pyarrow alone (plus the block codec), never with a
dvidshards reader, and compared with the real DVID files in ../shared/data/dvid.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import tensorstore as ts
import zstandard

import dvidshards
from dvidshards import Dataset, DvidShardsError
from dvidshards.demo.neurons import neuron_volume
from dvidshards.errors import MappingError, SpecError
from dvidshards.formats.codec import decode_block
from dvidshards.formats.mapping import LabelMapping
from dvidshards.formats.sharding import (
    ShardingSpec,
    dvid_shard_extent,
    dvid_shard_origin,
    grid_shape,
    shard_filename_stem,
)
from dvidshards.writer import (
    D_FOOTER_MAGIC,
    RECORD_SCHEMA,
    default_sharding,
    record_schema,
    write_export,
    write_shard,
)
from tests.support.exports import THREE_SHARDS, copy_export, shard_records

EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"
REAL_SCHEMA_SIZE = 688  # what Go's Arrow writer produced for the real shard
FIELDS = (
    "chunk_x",
    "chunk_y",
    "chunk_z",
    "labels",
    "supervoxels",
    "dvid_compressed_block",
    "uncompressed_size",
)


# --------------------------------------------------------------------------- helpers


def _read_csv(path: Path) -> tuple[int | None, list[str], list[dict[str, int]]]:
    """(schema_size or None, header columns, rows) of a chunk index CSV."""
    lines = path.read_text().split("\n")
    assert lines[-1] == "", "CSV must end with a newline"
    lines = lines[:-1]
    schema_size = None
    if lines[0].startswith("#"):
        m = re.fullmatch(r"# schema_size=(\d+)", lines[0])
        assert m, lines[0]
        schema_size = int(m.group(1))
        lines = lines[1:]
    header = lines[0].split(",")
    rows = [dict(zip(header, (int(v) for v in line.split(",")), strict=True)) for line in lines[1:]]
    return schema_size, header, rows


def _rows(batches) -> list[dict]:
    out = []
    for b in batches:
        d = b.to_pydict()
        out.extend({k: d[k][i] for k in d} for i in range(b.num_rows))
    return out


def _schema_message_size(buf: bytes, at: int = 0) -> int:
    cont, meta_len = struct.unpack_from("<Ii", buf, at)
    assert cont == 0xFFFFFFFF
    msg = pa.ipc.read_message(pa.py_buffer(buf[at : at + 8 + meta_len]))
    assert msg.type == "schema"
    return 8 + meta_len


def _split_d(buf: bytes) -> tuple[bytes, dict]:
    assert buf[-8:] == D_FOOTER_MAGIC == b"CHUNKIDX"
    (n,) = struct.unpack("<Q", buf[-16:-8])
    index = json.loads(buf[-16 - n : -16])
    return buf[: -16 - n], index


def _mode_pyramid(vol: np.ndarray, scales: int) -> list[np.ndarray]:
    out = [vol]
    store = ts.array(vol)
    for _ in range(1, scales):
        store = ts.downsample(store, [2, 2, 2], "mode")
        out.append(store.read().result())
    return out


def _map(mapping: np.ndarray, ids: np.ndarray) -> np.ndarray:
    d = {int(a): int(b) for a, b in mapping}
    return np.array([d.get(int(i), int(i)) for i in ids], dtype=np.uint64)


# --------------------------------------------------------------------------- schema


def test_record_schema_is_dvids(dvid_data):
    real = pa.ipc.open_stream((dvid_data / "30720_24576_28672.arrow").read_bytes()).schema
    assert RECORD_SCHEMA.equals(real, check_metadata=True)
    assert RECORD_SCHEMA.field("dvid_compressed_block").metadata == {
        b"compression": b"true",
        b"codec": b"zstd",
    }
    assert all(not f.nullable for f in RECORD_SCHEMA)
    assert (
        RECORD_SCHEMA.field("labels").type.value_field.nullable
        == real.field("labels").type.value_field.nullable
    )
    assert record_schema(False).names == list(FIELDS[:-1])


# --------------------------------------------------------------------------- re-packing the real shard

VARIANTS = [
    pytest.param("A", 1, "stream", id="A-batch1"),
    pytest.param("A", 7, "stream", id="A-batch7"),
    pytest.param("B", 1, "stream", id="B"),
    pytest.param("C", 1, "stream", id="C-stream"),
    pytest.param("C", 1, "file", id="C-file"),
    pytest.param("C", 5, "file", id="C-file-batch5"),
    pytest.param("D", 1, "stream", id="D"),
]


@pytest.mark.parametrize(("index", "batch_size", "container"), VARIANTS)
def test_repack_real_shard(real_records, tmp_path, index, batch_size, container):
    res = write_shard(
        tmp_path / "shard", real_records, batch_size=batch_size, index=index, container=container
    )
    buf = (tmp_path / "shard.arrow").read_bytes()
    n = len(real_records)
    assert res["num_records"] == n
    assert res["num_batches"] == -(-n // batch_size)
    fields = FIELDS if index != "D" else FIELDS[:-1]

    if index == "D":
        arrow, jindex = _split_d(buf)
        reader = pa.ipc.open_file(pa.py_buffer(arrow))
        batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        assert not (tmp_path / "shard.csv").exists()
    elif container == "file":
        reader = pa.ipc.open_file(pa.py_buffer(buf))
        batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        assert buf[:6] == b"ARROW1" and buf[-6:] == b"ARROW1"
    else:
        assert buf.endswith(EOS)
        reader = pa.ipc.open_stream(pa.py_buffer(buf))
        batches = list(reader)
    schema = reader.schema
    assert schema.names == list(fields)
    assert schema.equals(record_schema(index != "D"), check_metadata=True)
    assert [b.num_rows for b in batches] == [batch_size] * (n // batch_size) + (
        [n % batch_size] if n % batch_size else []
    )

    got = _rows(batches)
    assert got == [{k: r[k] for k in fields} for r in real_records]

    if index == "D":
        assert len(jindex) == n
        for key, rec in jindex.items():
            x, y, z = (int(v) for v in key.split("_"))
            assert x % 64 == y % 64 == z % 64 == 0  # voxel units
            assert (
                got[rec]["chunk_x"] * 64,
                got[rec]["chunk_y"] * 64,
                got[rec]["chunk_z"] * 64,
            ) == (x, y, z)
        assert sorted(jindex.values()) == list(range(n))
        return

    schema_size, header, rows = _read_csv(tmp_path / "shard.csv")
    assert len(rows) == n
    if index == "C":
        assert schema_size is None and header == ["x", "y", "z", "rec"]
        assert [r["rec"] for r in rows] == list(range(n))
        for r in rows:
            g = got[r["rec"]]
            assert (g["chunk_x"], g["chunk_y"], g["chunk_z"]) == (r["x"], r["y"], r["z"])
        return

    # A and B: offset/size are exactly the record batch messages of the stream
    assert header == (
        ["x", "y", "z", "offset", "size", "batch_idx"]
        if index == "A"
        else ["x", "y", "z", "rec", "offset", "size"]
    )
    assert schema_size == _schema_message_size(buf) == res["schema_size"]
    assert schema_size == len(RECORD_SCHEMA.serialize())
    spans = []
    for i, r in enumerate(rows):
        msg_bytes = buf[r["offset"] : r["offset"] + r["size"]]
        assert len(msg_bytes) == r["size"]
        msg = pa.ipc.read_message(pa.py_buffer(msg_bytes))
        assert msg.type == "record batch"
        assert 8 + msg.metadata.size + msg.body.size == r["size"]  # nothing before or after it
        batch = pa.ipc.read_record_batch(msg, schema)
        row = r["batch_idx"] if index == "A" else 0
        if index == "B":
            assert r["rec"] == i
        assert row < batch.num_rows
        assert batch.column("chunk_x")[row].as_py() == r["x"]
        assert batch.column("chunk_y")[row].as_py() == r["y"]
        assert batch.column("chunk_z")[row].as_py() == r["z"]
        assert batch.slice(row, 1).to_pylist()[0] == {k: real_records[i][k] for k in fields}
        spans.append((r["offset"], r["size"]))
    # batches tile the file: schema, batch, batch, ..., EOS
    distinct = sorted(set(spans))
    assert distinct[0][0] == schema_size
    for (o1, s1), (o2, _) in zip(distinct, distinct[1:], strict=False):
        assert o1 + s1 == o2
    assert distinct[-1][0] + distinct[-1][1] + len(EOS) == len(buf)
    if index == "A":
        assert [r["batch_idx"] for r in rows] == [i % batch_size for i in range(n)]


def test_repack_matches_real_csv_layout(dvid_data, real_records, tmp_path):
    """Re-packed with DVID's settings, the indexes equal the real ones up to the schema size."""
    a = write_shard(tmp_path / "a", real_records, index="A")
    b = write_shard(tmp_path / "b", real_records, index="B")
    write_shard(tmp_path / "c", real_records, index="C")
    real_a = (dvid_data / "30720_24576_28672-newformat.csv").read_text()
    ours_a = (tmp_path / "a.csv").read_text()
    assert real_a.split("\n")[0] == f"# schema_size={REAL_SCHEMA_SIZE}"
    assert ours_a.split("\n")[0] == f"# schema_size={a['schema_size']}"
    assert real_a.split("\n")[1] == ours_a.split("\n")[1] == "x,y,z,offset,size,batch_idx"
    delta = a["schema_size"] - REAL_SCHEMA_SIZE
    for real_path, ours_path, res in (
        ("30720_24576_28672-newformat.csv", tmp_path / "a.csv", a),
        ("30720_24576_28672-offsets.csv", tmp_path / "b.csv", b),
    ):
        real_ss, real_header, real_rows = _read_csv(dvid_data / real_path)
        ss, header, rows = _read_csv(ours_path)
        assert (real_ss, ss) == (REAL_SCHEMA_SIZE, res["schema_size"])
        assert header == real_header
        assert len(rows) == len(real_rows) == len(real_records)
        # same batch sizes, offsets shifted by the schema size difference
        for r, q in zip(rows, real_rows, strict=True):
            assert r == {**q, "offset": q["offset"] + delta}
    real_len = (dvid_data / "30720_24576_28672.arrow").stat().st_size
    assert (tmp_path / "a.arrow").stat().st_size == real_len + delta
    # variant C does not depend on byte layout: identical to the real file
    assert (tmp_path / "c.csv").read_text() == (dvid_data / "30720_24576_28672.csv").read_text()


def test_write_shard_rejects_bad_layouts(real_records, tmp_path):
    with pytest.raises(SpecError, match="batch_size"):
        write_shard(tmp_path / "b", real_records[:3], index="B", batch_size=2)
    with pytest.raises(SpecError, match="container"):
        write_shard(tmp_path / "a", real_records[:3], index="A", container="file")
    with pytest.raises(SpecError, match="index must be one of"):
        write_shard(tmp_path / "e", real_records[:3], index="E")
    with pytest.raises(SpecError, match="batch_size"):
        write_shard(tmp_path / "z", real_records[:3], batch_size=0)
    rec = {k: v for k, v in real_records[0].items() if k != "uncompressed_size"}
    with pytest.raises(SpecError, match="uncompressed_size"):
        write_shard(tmp_path / "u", [rec], index="A")
    assert list(tmp_path.iterdir()) == []  # a refused write leaves no file, not even a temporary one


def test_write_shard_empty(tmp_path):
    res = write_shard(tmp_path / "e", [], index="A")
    buf = (tmp_path / "e.arrow").read_bytes()
    assert buf == RECORD_SCHEMA.serialize().to_pybytes() + EOS
    assert res["schema_size"] == len(buf) - 8
    assert (
        tmp_path / "e.csv"
    ).read_text() == f"# schema_size={res['schema_size']}\nx,y,z,offset,size,batch_idx\n"


# --------------------------------------------------------------------------- sharding


def test_default_sharding_reproduces_mcns(dvid_data):
    spec = json.loads((dvid_data / "mcns-ng-specs.json").read_text())
    for scale in spec["scales"]:
        got = default_sharding(scale["size"], 32)
        assert got == ShardingSpec.from_json(scale["sharding"]), scale["key"]


def test_default_sharding_validation():
    with pytest.raises(SpecError, match="power of two"):
        default_sharding((100, 100, 100), 3)
    spec = default_sharding((200, 150, 130), 2)
    assert spec.preshift_bits + spec.minishard_bits == 3
    assert spec.shard_bits == 3  # 6 Morton bits for a 4x3x3 grid
    assert dvid_shard_extent(spec, (200, 150, 130)) == 128


# --------------------------------------------------------------------------- whole exports


@pytest.fixture(scope="module")
def synth():
    vol, mapping = neuron_volume((200, 150, 130), n_bodies=10, svs_per_body=3, seed=3)
    return vol, mapping


def _read_export_scale(scale_dir: Path, index: str = "A"):
    """{chunk: record} of every record of one scale, checking names, order and indexes."""
    recs = {}
    for arrow in sorted(scale_dir.glob("*.arrow")):
        buf = arrow.read_bytes()
        if index == "D":
            buf, _ = _split_d(buf)
        if buf[:6] == b"ARROW1":
            reader = pa.ipc.open_file(pa.py_buffer(buf))
            rows = _rows(reader.get_batch(i) for i in range(reader.num_record_batches))
        else:
            assert buf.endswith(EOS)
            rows = _rows(pa.ipc.open_stream(pa.py_buffer(buf)))
        assert rows, f"{arrow} has no records"
        keys = [(r["chunk_z"], r["chunk_y"], r["chunk_x"]) for r in rows]
        assert keys == sorted(keys) and len(set(keys)) == len(keys), "records must be in ZYX order"
        if index != "D":
            _, _, csv_rows = _read_csv(arrow.with_suffix(".csv"))
            assert [(c["x"], c["y"], c["z"]) for c in csv_rows] == [
                (r["chunk_x"], r["chunk_y"], r["chunk_z"]) for r in rows
            ]
        for r in rows:
            chunk = (r["chunk_x"], r["chunk_y"], r["chunk_z"])
            assert chunk not in recs
            recs[chunk] = (arrow.stem, r)
    return recs


def test_write_export_synthetic(synth, tmp_path):
    vol, mapping = synth
    scales = 3
    out = tmp_path / "export"
    spec = write_export(vol, out, mapping=mapping, scales=scales, shard_chunks=2, info=True)

    assert json.loads((out / "info").read_text()) == spec
    assert spec["@type"] == "neuroglancer_multiscale_volume"
    assert (spec["data_type"], spec["num_channels"], spec["type"], spec["batch_size"]) == (
        "uint64",
        1,
        "segmentation",
        1,
    )
    assert sorted(p.name for p in out.iterdir()) == ["info", "s0", "s1", "s2"]

    expected = _mode_pyramid(vol, scales)
    n_skipped = 0
    for k, (scale, exp) in enumerate(zip(spec["scales"], expected, strict=True)):
        size = list(exp.shape)
        assert scale["size"] == size
        assert scale["resolution"] == [8.0 * 2**k] * 3
        assert scale["key"] == "x".join([str(8 * 2**k)] * 3)
        assert scale["chunk_sizes"] == [[64, 64, 64]] and scale["voxel_offset"] == [0, 0, 0]
        assert scale["encoding"] == "compressed_segmentation"
        assert scale["compressed_segmentation_block_size"] == [8, 8, 8]
        sh = ShardingSpec.from_json(scale["sharding"])
        assert sh == default_sharding(size, 2)
        s = dvid_shard_extent(sh, size)

        grid = grid_shape(size, 64)
        padded = np.zeros([g * 64 for g in grid], dtype=np.uint64)
        padded[: size[0], : size[1], : size[2]] = exp
        got = np.zeros_like(padded)
        recs = _read_export_scale(out / f"s{k}")
        present = set()
        for cx in range(grid[0]):
            for cy in range(grid[1]):
                for cz in range(grid[2]):
                    if padded[
                        cx * 64 : cx * 64 + 64, cy * 64 : cy * 64 + 64, cz * 64 : cz * 64 + 64
                    ].any():
                        present.add((cx, cy, cz))
                    else:
                        n_skipped += 1
        assert set(recs) == present, f"scale {k}: records must be exactly the non-empty blocks"
        origins = set()
        for chunk, (stem, r) in recs.items():
            origin = dvid_shard_origin(np.array(chunk), s)
            assert stem == shard_filename_stem(origin)
            origins.add(tuple(int(v) for v in origin))
            raw = zstandard.ZstdDecompressor().decompress(r["dvid_compressed_block"])
            params = zstandard.get_frame_parameters(r["dvid_compressed_block"])
            assert params.content_size == len(raw) == r["uncompressed_size"]
            assert params.has_checksum
            block = decode_block(raw)
            assert block.shape == (64, 64, 64)
            (n_labels,) = struct.unpack_from("<I", raw, 12)
            assert r["supervoxels"] == np.frombuffer(raw, "<u8", n_labels, 16).tolist()
            assert sorted(r["supervoxels"]) == np.unique(block).tolist()
            assert r["labels"] == _map(mapping, np.array(r["supervoxels"], np.uint64)).tolist()
            x, y, z = (c * 64 for c in chunk)
            got[x : x + 64, y : y + 64, z : z + 64] = block.transpose(2, 1, 0)
        np.testing.assert_array_equal(got, padded)
        if k == 0:
            assert all(len({o[a] for o in origins}) >= 2 for a in range(3)), origins
    assert n_skipped > 0, "the test volume must have empty blocks"


def test_write_export_inputs_and_variants(synth, tmp_path):
    """TensorStore input (with an origin), dict mapping, batches and index variants agree."""
    vol, mapping = synth
    vol = np.ascontiguousarray(vol[:130, :70, :80])
    ref = write_export(vol, tmp_path / "ref", mapping=mapping, scales=2, shard_chunks=2)
    ref_recs = [_read_export_scale(tmp_path / "ref" / f"s{k}") for k in range(2)]

    store = ts.array(vol)[ts.d[:].translate_to[5, -3, 100]]
    mapping_dict = {int(a): int(b) for a, b in mapping}
    for index, container, batch in (("C", "file", 3), ("D", "stream", 2), ("A", "stream", 4)):
        out = tmp_path / f"v{index}"
        spec = write_export(
            store,
            out,
            mapping=mapping_dict,
            scales=2,
            shard_chunks=2,
            batch_size=batch,
            index=index,
            container=container,
        )
        assert spec["batch_size"] == batch
        assert spec["scales"] == ref["scales"]
        for k in range(2):
            got = _read_export_scale(out / f"s{k}", index)
            assert set(got) == set(ref_recs[k])
            for chunk, (stem, r) in got.items():
                ref_stem, ref_r = ref_recs[k][chunk]
                assert stem == ref_stem
                assert {f: r[f] for f in r} == {f: ref_r[f] for f in r}
            if index == "D":
                assert not list((out / f"s{k}").glob("*.csv"))


def test_write_export_reads_piecewise(synth, tmp_path, monkeypatch):
    import dvidshards.writer as w

    vol, _ = synth
    shapes = []
    original = w._Volume.read

    def spy(self, lo, hi):
        shapes.append(tuple(b - a for a, b in zip(lo, hi, strict=True)))
        return original(self, lo, hi)

    monkeypatch.setattr(w._Volume, "read", spy)
    write_export(ts.array(vol), tmp_path / "x", shard_chunks=2)
    assert shapes
    assert (
        max(s[0] for s in shapes) <= 128
        and max(s[1] for s in shapes) <= 64
        and max(s[2] for s in shapes) <= 64
    )


def test_write_export_skips_blocks_mapped_to_zero(tmp_path):
    vol = np.zeros((128, 64, 70), dtype=np.uint64)
    vol[:64, :, :] = 7  # block (0,0,0): only supervoxel 7, mapped to 0
    vol[64:, 10:20, 3:9] = 9  # block (1,0,0)
    vol[100, 5, 66] = 7  # block (1,0,1): also only 7 (+ background)
    spec = write_export(vol, tmp_path / "e", mapping={7: 0, 9: 12345678901234}, shard_chunks=1)
    assert spec["scales"][0]["size"] == [128, 64, 70]
    recs = _read_export_scale(tmp_path / "e" / "s0")
    assert set(recs) == {(1, 0, 0)}
    stem, r = recs[(1, 0, 0)]
    assert stem == "64_0_0"
    assert (
        r["supervoxels"] in ([0, 9], [9, 0])
        and r["labels"]
        == _map(np.array([[9, 12345678901234]]), np.array(r["supervoxels"])).tolist()
    )


def test_write_export_sharding_arguments(synth, tmp_path):
    vol, _ = synth
    small = np.ascontiguousarray(vol[:100, :100, :64])
    given = {
        "@type": "neuroglancer_uint64_sharded_v1",
        "preshift_bits": 0,
        "minishard_bits": 0,
        "shard_bits": 2,
        "hash": "identity",
        "minishard_index_encoding": "gzip",
    }
    spec = write_export(small, tmp_path / "a", sharding=given)
    assert ShardingSpec.from_json(spec["scales"][0]["sharding"]) == ShardingSpec.from_json(given)
    # one chunk per shard: every record is alone in a file named by its own origin
    for chunk, (stem, _) in _read_export_scale(tmp_path / "a" / "s0").items():
        assert stem == "_".join(str(64 * c) for c in chunk)
    specs = [default_sharding((100, 100, 64), 1), ShardingSpec.from_json(given)]
    spec = write_export(small, tmp_path / "b", sharding=specs, scales=2)
    assert [ShardingSpec.from_json(s["sharding"]) for s in spec["scales"]] == specs
    bad = [
        ("c", {"sharding": given, "shard_chunks": 2}, "not both"),
        ("d", {"sharding": [given], "scales": 2}, "1 sharding specs for 2 scales"),
        ("e", {"index": "B", "batch_size": 2}, "batch_size must be 1"),
        ("g", {"sharding": "32"}, "ShardingSpec or a JSON dict"),
        ("h", {"sharding": {"shard_bits": 1}}, "sharding spec"),
        ("i", {"scales": 0}, "scales must be a positive integer"),
        ("j", {"resolution": (8, 8)}, "resolution must be 3 positive numbers"),
        ("k", {"resolution": "8nm"}, "resolution must be 3 positive numbers"),
        ("l", {"resolution": (8, 8, float("nan"))}, "resolution must be 3 positive numbers"),
        ("m", {"zstd_level": 99}, "zstd_level"),
    ]
    for name, kw, match in bad:
        with pytest.raises(SpecError, match=match):
            write_export(small, tmp_path / name, **kw)
    with pytest.raises(SpecError, match="integer labels"):
        write_export(small.astype(np.float32), tmp_path / "f")
    with pytest.raises(SpecError, match="3-D"):
        write_export(small[0], tmp_path / "f")
    assert not any((tmp_path / n).exists() for n in "cdefghijklm"), (
        "invalid calls must not create anything"
    )


def test_write_export_takes_a_label_mapping_and_refuses_bad_ones(synth, tmp_path):
    vol, mapping = synth
    small = np.ascontiguousarray(vol[:100, :90, :70])
    ref = write_export(small, tmp_path / "ref", mapping=mapping, shard_chunks=2)
    path = tmp_path / "mapping.txt"
    path.write_text("sv_id,body_id\n" + "".join(f"{a},{b}\n" for a, b in mapping.tolist()))
    for i, m in enumerate([LabelMapping.from_any(mapping), str(path)]):
        spec = write_export(small, tmp_path / f"m{i}", mapping=m, shard_chunks=2)
        assert spec == ref
        assert _read_export_scale(tmp_path / f"m{i}" / "s0") == _read_export_scale(tmp_path / "ref" / "s0")
    svs = np.unique(small)
    for name, m, match in [
        ("a", {int(svs[1]): 1.7}, "the value of key .* is 1.7, which is not an integer"),
        ("b", np.array([[1, -2]]), "row 0 column 1 .* negative"),
        ("c", [1, 2, 3], r"\(n, 2\) array"),
        ("d", tmp_path / "absent.txt", "cannot read mapping|mapping file not found"),
    ]:
        with pytest.raises(MappingError, match=match):
            write_export(small, tmp_path / name, mapping=m)
        assert not (tmp_path / name).exists()


def test_write_export_progress(synth, tmp_path, capfd):
    vol, _ = synth
    small = np.ascontiguousarray(vol[:130, :64, :64])
    write_export(small, tmp_path / "quiet", shard_chunks=1)  # stderr is not a terminal here
    write_export(small, tmp_path / "off", shard_chunks=1, progress=False)
    assert capfd.readouterr().err == ""
    write_export(small, tmp_path / "on", shard_chunks=1, progress=True)
    err = capfd.readouterr().err
    assert "writing on" in err and "/3 " in err  # 3 shard boxes of one chunk each


def test_write_export_overwrite(synth, tmp_path):
    vol, _ = synth
    small = np.ascontiguousarray(vol[:64, :64, :64])
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        write_export(small, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    (out / "s7").mkdir()
    (out / "s7" / "0_0_0.arrow").write_bytes(b"stale")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x").write_text("x")
    (out / "s3").symlink_to(outside, target_is_directory=True)
    write_export(small, out, overwrite=True, info=True)
    assert sorted(p.name for p in out.iterdir()) == ["info", "keep.txt", "s0"]
    assert (outside / "x").read_text() == "x"
    with pytest.raises(FileExistsError):
        write_export(small, out)
    (tmp_path / "file").write_text("")
    with pytest.raises(FileExistsError):
        write_export(small, tmp_path / "file", overwrite=True)


# --------------------------------------------------------------------------- synthetic volumes


def test_neuron_volume_properties():
    vol, mapping = neuron_volume((256, 192, 160), n_bodies=8, svs_per_body=4, seed=11)
    again, mapping2 = neuron_volume((256, 192, 160), n_bodies=8, svs_per_body=4, seed=11)
    other, _ = neuron_volume((256, 192, 160), n_bodies=8, svs_per_body=4, seed=12)
    assert vol.shape == (256, 192, 160) and vol.dtype == np.uint64
    np.testing.assert_array_equal(vol, again)
    np.testing.assert_array_equal(mapping, mapping2)
    assert not np.array_equal(vol, other)

    fg = np.count_nonzero(vol) / vol.size
    assert 0.01 < fg < 0.5, fg
    svs = np.unique(vol)
    assert svs[0] == 0 and len(svs) > 8
    assert svs[1] > 2**32
    assert mapping.dtype == np.uint64 and mapping.shape == (8 * 4, 2)
    assert np.isin(svs[1:], mapping[:, 0]).all(), "mapping must cover every supervoxel"
    assert len(np.unique(mapping[:, 0])) == len(mapping)
    bodies = np.unique(mapping[:, 1])
    assert len(bodies) == 8 and np.isin(bodies, mapping[:, 0]).all()  # body id = one of its svs

    # per-body block spans on the 64³ grid (the last z block is cut at 160)
    sv_to_body = dict(zip(mapping[:, 0].tolist(), mapping[:, 1].tolist(), strict=True))
    spans: dict[int, set] = {}
    empty_blocks = 0
    for bx in range(4):
        for by in range(3):
            for bz in range(3):
                ids = np.unique(
                    vol[bx * 64 : bx * 64 + 64, by * 64 : by * 64 + 64, bz * 64 : bz * 64 + 64]
                )
                ids = ids[ids != 0]
                empty_blocks += ids.size == 0
                for i in ids.tolist():
                    spans.setdefault(sv_to_body[i], set()).add((bx, by, bz))
    assert empty_blocks > 0, "some 64³ blocks must be entirely background"
    assert sum(len(s) >= 4 for s in spans.values()) >= 3, (
        "several bodies must cross block boundaries"
    )
    # each body is split into several supervoxels
    per_body = {b: sum(1 for s in svs[1:].tolist() if sv_to_body[s] == b) for b in bodies.tolist()}
    assert sum(n >= 2 for n in per_body.values()) >= 6


def test_neuron_volume_validation():
    with pytest.raises(ValueError):
        neuron_volume((0, 10, 10))
    vol, mapping = neuron_volume((20, 30, 40), n_bodies=0)
    assert vol.shape == (20, 30, 40) and not vol.any() and mapping.shape == (0, 2)


def test_write_export_old_naming_one_cube_per_scale(synth, tmp_path):
    """naming="old": files named by DVID's cube of 2**((18 + preshift + minishard) // 3) voxels."""
    from dvidshards import Dataset
    from dvidshards.formats.sharding import dvid_old_shard_extent

    vol, mapping = synth
    sh = ShardingSpec(preshift_bits=1, minishard_bits=0, shard_bits=5, hash="identity")  # today: 2x1x1 chunks
    assert (dvid_old_shard_extent(sh), dvid_shard_extent(sh, vol.shape)) == (64, 128)
    for naming, side in (("old", 64), ("current", 128)):
        spec = write_export(vol, tmp_path / naming, mapping=mapping, sharding=sh, naming=naming)
        recs = _read_export_scale(tmp_path / naming / "s0")
        for (x, y, z), (stem, _) in recs.items():  # brute force: floor(64 c / S) S per axis, S a cube
            assert stem == "_".join(str(64 * c // side * side) for c in (x, y, z))
        ds = Dataset(tmp_path / naming, spec=spec)
        assert ds.scale(0).naming == naming and ds.scale(0).shard_extent == side
        got = ds.read([[0, 0, 0], list(vol.shape)], labels="supervoxels", fill_missing_shards=True)
        np.testing.assert_array_equal(got, vol)
    with pytest.raises(SpecError, match="naming must be one of current, old"):
        write_export(vol, tmp_path / "bad", naming="older")
    assert not (tmp_path / "bad").exists()


def test_write_export_zero_blocks_and_only_scales(tmp_path):
    """zero_blocks: a record for every block, as DVID before 2026-03-27; only_scales: some folders only."""
    vol = np.zeros((128, 64, 70), dtype=np.uint64)
    vol[:64, :, :] = 7  # block (0,0,0): supervoxel 7, mapped to 0
    vol[64:, 10:20, 3:9] = 9  # block (1,0,0); block (1,0,1) all background
    spec = write_export(vol, tmp_path / "e", mapping={7: 0}, shard_chunks=1, zero_blocks=True)
    recs = _read_export_scale(tmp_path / "e" / "s0")
    assert set(recs) == {(x, 0, z) for x in (0, 1) for z in (0, 1)}
    assert recs[(0, 0, 0)][1]["labels"] == [0] and recs[(1, 0, 1)][1]["supervoxels"] == [0]
    from dvidshards import Dataset

    ds = Dataset(tmp_path / "e", spec=spec)
    np.testing.assert_array_equal(ds.read([[0, 0, 0], [128, 64, 70]]), np.where(vol == 7, 0, vol))
    spec = write_export(vol, tmp_path / "p", scales=3, only_scales=[0, 2], shard_chunks=1, info=True)
    assert len(spec["scales"]) == 3 and sorted(p.name for p in (tmp_path / "p").iterdir()) == ["info", "s0", "s2"]
    for bad in ([3], [-1]):
        with pytest.raises(SpecError, match="only_scales"):
            write_export(vol, tmp_path / "q", scales=3, only_scales=bad)
    assert not (tmp_path / "q").exists()


# --- write_export's mapping; a refused or interrupted write leaves nothing ---------------------------


def test_write_export_with_a_label_mapping(tmp_path):
    sv, mapping = neuron_volume((90, 70, 60), n_bodies=4, svs_per_body=3, seed=2)
    m = LabelMapping.from_any(mapping)
    spec = write_export(sv, tmp_path / "out", mapping=m, shard_chunks=2)
    got = dvidshards.open(tmp_path / "out", spec=spec).read(order="F").result()
    np.testing.assert_array_equal(got, m(sv))


def test_write_export_bad_mapping_is_typed(tmp_path):
    sv, _ = neuron_volume((64, 64, 64), n_bodies=2, svs_per_body=2, seed=2)
    with pytest.raises(DvidShardsError):
        write_export(sv, tmp_path / "out", mapping="not a mapping at all")


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*"))


def test_write_shard_of_records_it_refuses_leaves_no_file(three_shards, tmp_path):
    from dvidshards.writer import write_shard

    recs = shard_records((Path(three_shards.root) / "s0" / "0_0_0.arrow").read_bytes())
    bad = [{k: v for k, v in r.items() if k != "uncompressed_size"} for r in recs]
    folder = tmp_path / "s0"
    folder.mkdir()
    with pytest.raises(SpecError, match="uncompressed_size"):
        write_shard(folder / "0_0_0", bad)
    assert _files(folder) == []
    with pytest.raises(SpecError, match="record"):
        write_shard(folder / "0_0_0", [{**recs[0], "chunk_x": "left"}])
    assert _files(folder) == []


def test_write_shard_interrupted_leaves_the_old_shard_as_it_was(three_shards, tmp_path):
    from dvidshards.writer import write_shard

    root = copy_export(three_shards, tmp_path)
    before = {p.name: p.read_bytes() for p in (root / "s0").iterdir()}
    recs = shard_records(before["0_0_0.arrow"])

    def interrupted():
        yield recs[0]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_shard(root / "s0" / "0_0_0", interrupted())
    assert {p.name: p.read_bytes() for p in (root / "s0").iterdir()} == before
    want = three_shards.expected(0)[:128, :64, :64]
    np.testing.assert_array_equal(Dataset(root, spec=three_shards.spec).read([[0, 0, 0], [128, 64, 64]]), want)


def test_write_shard_variant_d_over_a_removes_the_old_csv(three_shards, tmp_path):
    from dvidshards.writer import write_shard

    root = copy_export(three_shards, tmp_path)
    recs = shard_records((root / "s0" / "0_0_0.arrow").read_bytes())
    write_shard(root / "s0" / "0_0_0", recs[::-1], index="D")
    assert not (root / "s0" / "0_0_0.csv").exists()  # else the old index would be read
    np.testing.assert_array_equal(Dataset(root, spec=three_shards.spec).read([[0, 0, 0], [128, 64, 64]]),
                                  three_shards.expected(0)[:128, :64, :64])


def test_write_export_interrupted_leaves_no_export(three_shards, tmp_path, monkeypatch):
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
        w.write_export(three_shards.sv, tmp_path / "new", scales=2, shard_chunks=2)
    assert not (tmp_path / "new").exists()
    # over an existing export (overwrite=True): the old one stays whole
    root = copy_export(three_shards, tmp_path)
    before = _files(root)
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        w.write_export(three_shards.sv[:100], root, scales=2, shard_chunks=2, overwrite=True)
    assert _files(root) == before
    np.testing.assert_array_equal(Dataset(root, spec=three_shards.spec).read([[0, 0, 0], list(THREE_SHARDS)]), three_shards.expected(0))
