"""Every class of bad input gives its typed error through open(...).read() and through verify."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import stat
import struct
import threading
import time

import numpy as np
import pytest
import zstandard

import dvidshards
from dvidshards import Dataset
from dvidshards.errors import (
    BlockDecodeError,
    ChunkIndexError,
    DvidShardsError,
    MissingShardError,
    ShardFormatError,
)
from dvidshards.jobs.verify import verify
from dvidshards.writer import write_shard
from tests.support.data import REAL_SHARD
from tests.support.exports import THREE_SHARDS, copy_export, crop, ts_read
from tests.support.fuzz import arrow_map

STEM = f"s1/{REAL_SHARD}"


def _block_edit(fn):
    """A record edit that rewrites the uncompressed DVID block of the target record."""

    def edit(rec):
        blk = bytearray(rec["block"])
        blk = fn(blk, rec) or blk
        rec["dvid_compressed_block"] = zstandard.ZstdCompressor(level=3).compress(bytes(blk))
        rec["uncompressed_size"] = len(blk)
    return edit


def _n(blk):
    return struct.unpack_from("<I", blk, 12)[0]


def _set(fmt, off_fn, value):
    def fn(blk, rec):
        struct.pack_into(fmt, blk, off_fn(blk), value(blk) if callable(value) else value)
    return fn


def _truncate_values(blk, rec):
    return blk[: len(blk) - 40]


def _index_overrun(blk, rec):
    n = _n(blk)
    for i in range(512):
        struct.pack_into("<H", blk, 16 + 8 * n + 2 * i, 400)


def _extra_palette_entry(rec):
    rec["labels"] = list(rec["labels"]) + [7]
    rec["supervoxels"] = list(rec["supervoxels"]) + [7]


def _zstd_truncated(rec):
    rec["dvid_compressed_block"] = rec["dvid_compressed_block"][:-9]


def _zstd_garbage(rec):
    rec["dvid_compressed_block"] = bytes(np.random.default_rng(0).integers(0, 256, 500, np.uint8))


def _usize_wrong(rec):
    rec["uncompressed_size"] += 8


def _wrong_shard(rec):
    rec["chunk_x"] -= 40  # a chunk of the neighbouring shard, recorded in this one


# record-level corruption: (name, edit of the target record, expected error)
RECORD_CASES = [
    ("zstd frame truncated", _zstd_truncated, BlockDecodeError),
    ("zstd garbage", _zstd_garbage, BlockDecodeError),
    ("uncompressed_size wrong", _usize_wrong, BlockDecodeError),
    ("block gx=0", _block_edit(_set("<I", lambda b: 0, 0)), BlockDecodeError),
    ("block gx>128", _block_edit(_set("<I", lambda b: 0, 129)), BlockDecodeError),
    ("block N=0", _block_edit(_set("<I", lambda b: 12, 0)), BlockDecodeError),
    ("block N beyond buffer", _block_edit(_set("<I", lambda b: 12, 1 << 28)), BlockDecodeError),
    ("sub-block count > 512", _block_edit(_set("<H", lambda b: 16 + 8 * _n(b), 600)), BlockDecodeError),
    ("index sum overruns", _block_edit(_index_overrun), BlockDecodeError),
    ("packed values truncated", _block_edit(_truncate_values), BlockDecodeError),
    ("label index >= N", _block_edit(_set("<I", lambda b: 16 + 8 * _n(b) + 1024, lambda b: _n(b) + 3)),
     BlockDecodeError),
    ("palette length mismatch", _extra_palette_entry, BlockDecodeError),
    ("record in the wrong shard", _wrong_shard, ChunkIndexError),
]


def _target(records):
    """A record with several labels in multi-label sub-blocks (so every block edit bites)."""
    return max(range(len(records)), key=lambda i: (len(records[i]["supervoxels"]), -i))


@pytest.fixture(scope="module")
def spec(dvid_data):
    return json.loads((dvid_data / "mcns-ng-specs.json").read_text())


def _write(root, records, **kw):
    (root / "s1").mkdir(parents=True, exist_ok=True)
    write_shard(root / STEM, records, **kw)


def _box(rec):
    return tuple(slice(64 * rec[k], 64 * rec[k] + 64) for k in ("chunk_x", "chunk_y", "chunk_z"))


def _expect(root, spec, box, err, match=None):
    """The typed error through open(...).read() and through verify; its message names the file."""
    vol = dvidshards.open(root, scale=1, spec=spec)
    with pytest.raises(err, match=match) as e:
        vol[box].read().result()
    assert REAL_SHARD in str(e.value), str(e.value)
    report = verify(root, scale=1, spec=spec, decode=True)
    assert not report.ok
    assert any(p.kind == err.__name__ for p in report.problems), report.summary()
    return str(e.value)


@pytest.mark.parametrize("name,edit,err", RECORD_CASES, ids=[c[0] for c in RECORD_CASES])
def test_record_corruption(tmp_path, spec, real_records, name, edit, err):
    recs = copy.deepcopy(real_records)
    i = _target(recs)
    box = _box(recs[i])
    edit(recs[i])
    _write(tmp_path, recs)
    msg = _expect(tmp_path, spec, box, err)
    if err is BlockDecodeError:  # names the chunk too
        assert str((recs[i]["chunk_x"], recs[i]["chunk_y"], recs[i]["chunk_z"])) in msg


def _csv_edit(fn):
    def edit(root):
        p = root / f"{STEM}.csv"
        lines = p.read_text().splitlines()
        p.write_text("\n".join(fn(lines)) + "\n")
    return edit


def _field(col, value):
    def fn(lines):
        cells = lines[5].split(",")
        cells[col] = str(value(int(cells[col])))
        lines[5] = ",".join(cells)
        return lines
    return fn


def _truncate_arrow(where):
    def edit(root):
        p = root / f"{STEM}.arrow"
        data = p.read_bytes()
        p.write_bytes(data[: where(data)])
    return edit


def _remove(suffix):
    def edit(root):
        (root / f"{STEM}{suffix}").unlink()
    return edit


def _wrong_magic(root):
    p = root / f"{STEM}.arrow"
    data = bytearray(p.read_bytes())
    data[:4] = b"PK\x03\x04"
    p.write_bytes(bytes(data))


def _append_record(root):
    """A record the CSV does not list (its row dropped after writing)."""
    p = root / f"{STEM}.csv"
    lines = p.read_text().splitlines()
    p.write_text("\n".join(lines[:-1]) + "\n")


def _bad_footer_length(root):
    p = root / f"{STEM}.arrow"
    data = bytearray(p.read_bytes())
    struct.pack_into("<Q", data, len(data) - 16, len(data) * 2)
    p.write_bytes(bytes(data))


def _schema(variant):
    """Rewrite the shard with a schema that lacks a field or has a wrong type."""
    import pyarrow as pa

    def edit(root, recs):
        p = root / f"{STEM}.arrow"
        fields = [pa.field("chunk_x", pa.int32()), pa.field("chunk_y", pa.int32()),
                  pa.field("chunk_z", pa.int32() if variant != "type" else pa.float64()),
                  pa.field("labels", pa.list_(pa.uint64())), pa.field("supervoxels", pa.list_(pa.uint64())),
                  pa.field("dvid_compressed_block", pa.binary())]
        if variant == "missing":
            fields = [f for f in fields if f.name != "supervoxels"]
        schema = pa.schema(fields)
        with pa.OSFile(str(p), "wb") as f, pa.ipc.new_stream(f, schema) as w:
            for r in recs:
                w.write_batch(pa.record_batch([[r[n] if n != "chunk_z" or variant != "type" else float(r[n])]
                                               for n in schema.names], schema=schema))
        lines = ["x,y,z,rec"] + [f"{r['chunk_x']},{r['chunk_y']},{r['chunk_z']},{i}" for i, r in enumerate(recs)]
        (root / f"{STEM}.csv").write_text("\n".join(lines) + "\n")
    return edit


# file-level corruption: (name, edit of the written export, expected error, write options)
FILE_CASES = [
    ("arrow truncated mid-schema", _truncate_arrow(lambda d: 300), ShardFormatError, {}),
    ("arrow truncated mid-batch", _truncate_arrow(lambda d: len(d) // 2 + 3), ShardFormatError, {}),
    ("wrong magic", _wrong_magic, ShardFormatError, {}),
    ("csv offset past EOF", _csv_edit(_field(3, lambda v: v + 10_000_000)), ChunkIndexError, {}),
    ("csv size not on a message", _csv_edit(_field(4, lambda v: v - 8)), ChunkIndexError, {}),
    ("csv coordinate != record", _csv_edit(_field(0, lambda v: v + 1)), ChunkIndexError, {}),
    ("duplicate csv rows", _csv_edit(lambda ls: ls + [ls[5]]), ChunkIndexError, {}),
    ("csv row without record", _csv_edit(lambda ls: ls + ["505,413,470,1106960,11064,0"]), ChunkIndexError, {}),
    ("record without csv row", _append_record, ChunkIndexError, {}),
    ("missing arrow", _remove(".arrow"), MissingShardError, {}),
    ("csv schema_size wrong", _csv_edit(lambda ls: ["# schema_size=700"] + ls[1:]), ChunkIndexError, {}),
    ("bad json footer length", _bad_footer_length, ChunkIndexError, {"index": "D", "container": "file"}),
]


@pytest.mark.parametrize("name,edit,err,kw", FILE_CASES, ids=[c[0] for c in FILE_CASES])
def test_file_corruption(tmp_path, spec, real_records, name, edit, err, kw):
    _write(tmp_path, real_records, **kw)
    edit(tmp_path)
    _expect(tmp_path, spec, _box(real_records[7]), err)


@pytest.mark.parametrize("variant", ["missing", "type"])
def test_schema_corruption(tmp_path, spec, real_records, variant):
    (tmp_path / "s1").mkdir()
    _schema(variant)(tmp_path, real_records[:20])
    msg = _expect(tmp_path, spec, _box(real_records[3]), ShardFormatError)
    assert ("supervoxels" if variant == "missing" else "chunk_z") in msg


def test_index_without_arrow_reported_by_verify(tmp_path, spec, real_records):
    _write(tmp_path, real_records)
    shutil.copy(tmp_path / f"{STEM}.csv", tmp_path / "s1" / "0_0_0.csv")
    report = verify(tmp_path, scale=1, spec=spec)
    assert [p.kind for p in report.problems] == ["MissingShardError"]


def test_verify_cli_exit_codes(tmp_path, spec, real_records, capsys):
    from dvidshards.cli import main

    _write(tmp_path, real_records)
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    assert main(["verify", str(tmp_path), "--spec", str(spec_path), "--scale", "1", "--decode", "--quiet"]) == 0
    assert "258 chunks, 258 payloads decompressed, 258 blocks decoded" in capsys.readouterr().out
    _csv_edit(_field(0, lambda v: v + 1))(tmp_path)
    assert main(["verify", str(tmp_path), "--spec", str(spec_path), "--scale", "1", "--quiet"]) == 1
    assert "ChunkIndexError" in capsys.readouterr().out


def test_container_fuzz(tmp_path, spec, real_records):
    """Random byte damage to headers, indexes and the CSV: data or a library error, nothing else."""
    _write(tmp_path / "clean", real_records[:40], batch_size=3)
    clean = {n: (tmp_path / "clean" / STEM).with_suffix(n).read_bytes() for n in (".arrow", ".csv")}
    rng = np.random.default_rng(11)
    outcomes = {"ok": 0, "error": 0}
    for trial in range(120):
        root = tmp_path / f"t{trial}"
        (root / "s1").mkdir(parents=True)
        for n, data in clean.items():
            d = bytearray(data)
            if n == ".arrow" or trial % 4 == 0:
                for _ in range(int(rng.integers(1, 6))):
                    # bias damage towards schema and batch headers, where parsing happens
                    pos = int(rng.integers(0, min(len(d), 4096) if rng.random() < 0.7 else len(d)))
                    d[pos] = int(rng.integers(0, 256))
                if rng.random() < 0.2:
                    d = d[: int(rng.integers(1, len(d)))]
            (root / STEM).with_suffix(n).write_bytes(bytes(d))
        try:
            dvidshards.open(root, scale=1, spec=spec)[_box(real_records[int(rng.integers(0, 40))])].read().result()
            outcomes["ok"] += 1
        except DvidShardsError:
            outcomes["error"] += 1
        shutil.rmtree(root)
    assert outcomes["error"] > 30, outcomes


def _tree_state(root):
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            st = os.stat(p)
            out[p] = (st.st_mtime_ns, st.st_size, hashlib.sha1(open(p, "rb").read()).hexdigest())
    return out


def test_read_only_export_is_never_written(tmp_path, synthetic_export):
    """Everything works on a read-only copy, and no file in it is created or changed."""
    from dvidshards.cli import main

    root = tmp_path / "ro"
    shutil.copytree(synthetic_export.root, root)
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(synthetic_export.spec))
    for d, dirs, files in os.walk(root):
        for n in files + dirs:
            p = os.path.join(d, n)
            os.chmod(p, os.stat(p).st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    os.chmod(root, 0o555)
    before = _tree_state(root)
    try:
        for k in range(3):
            vol = dvidshards.open(root, scale=k, spec=synthetic_export.spec, fill_missing_shards=True)
            np.testing.assert_array_equal(vol.read(order="F").result(), synthetic_export.expected(k))
        assert verify(root, spec=synthetic_export.spec, decode=True).ok
        assert main(["consolidate", str(root), "--spec", str(spec_path), "--out", str(tmp_path / "idx")]) == 0
        assert main(["info", str(root), "--spec", str(spec_path)]) == 0
        assert _tree_state(root) == before
        assert sorted(os.listdir(root)) == ["s0", "s1", "s2"]
    finally:
        for d, _dirs, _ in os.walk(root):
            os.chmod(d, 0o755)


@pytest.mark.slow  # 8-thread soak
def test_eight_threads_random_boxes_match_serial(synthetic_export):
    """8 threads on overlapping random boxes for a bounded time: identical to serial reads, no deadlock."""
    import tensorstore as ts

    vol = dvidshards.open(synthetic_export.root, spec=synthetic_export.spec, fill_missing_shards=True,
                          context=ts.Context({"data_copy_concurrency": {"limit": 8}}))
    want = synthetic_export.expected(0)
    rng = np.random.default_rng(4)
    shape = want.shape
    boxes = []
    for _ in range(64):
        lo = [int(rng.integers(0, s - 1)) for s in shape]
        boxes.append(tuple(slice(a, int(rng.integers(a + 1, min(s, a + 120) + 1))) for a, s in zip(lo, shape,
                                                                                                    strict=True)))
    errors, done = [], [0]
    deadline = time.monotonic() + 8

    def worker(seed):
        r = np.random.default_rng(seed)
        while time.monotonic() < deadline:
            b = boxes[int(r.integers(0, len(boxes)))]
            got = vol[b].read(order="F").result(timeout=60)
            if not np.array_equal(got, want[b]):
                errors.append(b)
            done[0] += 1

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    [t.start() for t in threads]
    [t.join(timeout=120) for t in threads]
    assert not any(t.is_alive() for t in threads), "deadlock: a reader thread did not finish"
    assert not errors and done[0] >= 8


# --- a truncated shard -------------------------------------------------------------------------------


def test_a_truncated_shard_says_truncated_and_lazy_reads_records_before_the_cut(three_shards, tmp_path):
    root = copy_export(three_shards, tmp_path)
    p = root / "s0" / "0_0_0.arrow"
    data = p.read_bytes()
    amap = arrow_map(data)
    nb = len(amap.batches)
    assert nb >= 3
    cut = amap.batches[-1].offset + 20  # inside the last record's batch: the others are whole
    p.write_bytes(data[:cut])
    ds = Dataset(root, spec=three_shards.spec)
    box = [[0, 0, 0], [128, 100, 70]]
    with pytest.raises((ShardFormatError, ChunkIndexError), match=rf"truncated: {cut} of \d+ bytes") as e:
        ds.read(box)
    assert "0_0_0" in str(e.value)
    lazy = Dataset(root, spec=three_shards.spec, policy="lazy")
    import pyarrow as pa

    whole = [r for b in pa.ipc.open_stream(pa.py_buffer(data)) for r in
             zip(b.column("chunk_x").to_pylist(), b.column("chunk_y").to_pylist(), b.column("chunk_z").to_pylist(),
                 strict=True)]
    for k, c in enumerate(whole):
        cb = [[64 * v for v in c], [min(64 * v + 64, s) for v, s in zip(c, THREE_SHARDS, strict=True)]]
        if k < nb - 1:
            np.testing.assert_array_equal(lazy.read(cb), crop(three_shards, cb))
            np.testing.assert_array_equal(ts_read(lazy.open(0), cb), crop(three_shards, cb))
        else:
            with pytest.raises((ShardFormatError, ChunkIndexError), match="truncated"):
                lazy.read(cb)
