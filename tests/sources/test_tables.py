"""Tables of block records (dvidshards.sources.tables, dvidshards.jobs.ingest): ingest from Flight and exports, split cells, sources.

Everything runs on loopback: the Flight servers are started here on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dvidshards.dataset import Dataset
from dvidshards.errors import (
    ChunkIndexError,
    DvidShardsError,
    JobError,
    MissingShardError,
    OutputError,
    SpecError,
)
from dvidshards.jobs.ingest import ingest, ingest_blocks, plan, run_task
from dvidshards.jobs.output import read_manifest
from dvidshards.serve.flight import ExportFlightServer, serve
from dvidshards.sources.flight import FlightSource
from dvidshards.sources.tables import BINS, CELL_LIMIT, CellLimitError, record_keys
from dvidshards.sources.tablesource import TableSource
from dvidshards.sources.vastdb import Predicate, VastDBSink, VastDBSource, shard_predicate
from dvidshards.stores import as_store
from tests.support.data import REAL_SHARD
from tests.support.exports import make_export, spec_file
from tests.support.tables import (
    assert_chunks_equal,
    assert_volumes_equal,
    brute_morton,
    export_records,
)
from tests.support.waiting import HANG_SECONDS, wait_until

ROOT = Path(__file__).resolve().parents[2]


# --- helpers ------------------------------------------------------------------------------------


def table_rows(to: Path, scale: int) -> list[dict]:
    rows = []
    for f in sorted((to / f"s{scale}").glob("*.parquet")):
        t = pq.read_table(f)
        rows.extend(t.to_pylist())
    return rows


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    """A synthetic 3-scale export with several shards per axis at scale 0, with an info file."""
    return make_export(tmp_path_factory.mktemp("tables") / "exp", info=True)


@pytest.fixture(scope="module")
def mcns(tmp_path_factory, dvid_data):
    """The real mCNS shard as scale 1 of an export (spec: mcns-ng-specs.json)."""
    root = tmp_path_factory.mktemp("mcns") / "mcns"
    (root / "s1").mkdir(parents=True)
    os.symlink(dvid_data / f"{REAL_SHARD}.arrow", root / "s1" / f"{REAL_SHARD}.arrow")
    shutil.copyfile(dvid_data / f"{REAL_SHARD}-newformat.csv", root / "s1" / f"{REAL_SHARD}.csv")
    return root, dvid_data / "mcns-ng-specs.json"


def many_label_volume(shape, labels_per_chunk: dict, seed: int = 0) -> np.ndarray:
    """(x, y, z) volume; chunks listed get random voxels from their own n labels (big payloads)."""
    rng = np.random.default_rng(seed)
    vol = np.zeros(shape, np.uint64)
    vol[:] = 7  # one smooth body everywhere else
    base = 1000
    for (cx, cy, cz), n in labels_per_chunk.items():
        sl = tuple(slice(64 * c, 64 * c + 64) for c in (cx, cy, cz))
        vol[sl] = rng.integers(base, base + n, vol[sl].shape).astype(np.uint64)
        base += n
    return vol


# --- ingest from Flight: round trips ------------------------------------------------------------------


def test_ingest_synthetic_from_flight_two_workers(synth, tmp_path):
    root = Path(synth.root)
    to = tmp_path / "table"
    with serve(synth.root) as srv:
        report = ingest(FlightSource(srv.location), to, workers=2)
    assert report.ok, report.failed
    info = json.loads((to / "info").read_text())
    assert info["dvidshards_table"]["complete"] and info["dvidshards_table"]["scales_done"] == [0, 1, 2]
    ds = Dataset(synth.root)
    dt = Dataset(TableSource(to))
    assert dt.shards(0) == ds.shards(0) and len(ds.shards(0)) > 4
    for k in range(3):
        s = ds.scale(k)
        rows = table_rows(to, k)
        want = export_records(root, k)
        got = {(r["chunk_x"], r["chunk_y"], r["chunk_z"]): r for r in rows}
        assert len(got) == len(rows) == len(want)  # no duplicate, no missing row
        for c, r in got.items():
            labels, svs, payload = want[c]
            assert r["labels"] == labels and r["supervoxels"] == svs and r["dvid_compressed_block"] == payload
            assert r["morton"] == brute_morton(c, s.grid)
            if s.sharding is not None:
                low = s.sharding.preshift_bits + s.sharding.minishard_bits
                assert r["shard_id"] == (r["morton"] >> low) & ((1 << s.sharding.shard_bits) - 1)
            assert all(r[b] is None for b in BINS)
        # one file per shard, rows sorted by morton within it, named by shard id and origin
        for f in (to / f"s{k}").glob("*.parquet"):
            t = pq.read_table(f)
            sid, ox, oy, oz = (int(v) for v in f.stem.split("_"))
            assert set(t.column("shard_id").to_pylist()) == {sid}
            m = t.column("morton").to_numpy()
            assert (np.diff(m) > 0).all()
            cs = np.stack([t.column(a).to_numpy() for a in ("chunk_x", "chunk_y", "chunk_z")], 1)
            assert {s.shard_origin(*c) for c in cs.tolist()} == {(ox, oy, oz)}
            assert all(pq.ParquetFile(f).metadata.row_group(g).num_rows <= 256
                       for g in range(pq.ParquetFile(f).num_row_groups))
    assert_volumes_equal(ds, dt, range(3))
    for k in range(3):  # the volumes equal the expected ones too, not only each other
        s = ds.scale(k)
        box = [[0, 0, 0], list(s.size)]
        np.testing.assert_array_equal(dt.read(box, scale=k), synth.expected(k))
        np.testing.assert_array_equal(dt.read(box, scale=k, labels="supervoxels"), synth.expected(k, "supervoxels"))


def test_ingest_real_mcns_shard_from_flight(mcns, tmp_path):
    root, spec = mcns
    to = tmp_path / "t"
    with serve(str(root), spec=str(spec)) as srv:
        report = ingest(FlightSource(srv.location), to, workers=2, scales=[1])
    assert report.ok and report.totals.records == 258 and report.totals.shards == 1
    ds = Dataset(root, spec=spec)
    dt = Dataset(TableSource(to))
    coords = ds.shard(1, ds.shards(1)[0]).coords
    assert len(coords) == 258
    assert_chunks_equal(ds, dt, 1, coords)
    with pytest.raises(SpecError, match="not ingested completely"):
        dt.shards(0)  # scale 0 never ingested: said so, never read as background
    assert Dataset(TableSource(to, partial=True)).shards(0) == []


def test_ingest_from_local_export_without_flight(synth, tmp_path):
    report = ingest(synth.root, tmp_path / "t", workers=3)
    assert report.ok
    assert_volumes_equal(Dataset(synth.root), Dataset(TableSource(tmp_path / "t")), range(3))


def test_ingest_is_idempotent_and_refuses_other_folders(synth, tmp_path):
    to = tmp_path / "t"
    first = ingest(synth.root, to, workers=2)
    with pytest.raises(OutputError, match="--resume"):  # a table fills shard by shard: --resume finishes one
        ingest(synth.root, to, workers=2)
    again = ingest(synth.root, to, workers=2, resume=True)
    assert again.ok and again.totals.shards == 0 and again.totals.skipped == first.totals.shards
    assert "0 shards already there" in first.summary() and f"{first.totals.shards} shards already there" in \
        again.summary()
    assert len(table_rows(to, 0)) == len(export_records(Path(synth.root), 0))
    m = read_manifest(to)
    assert m["job"] == "ingest" and m["complete"] is True and m["totals"]["skipped"] == first.totals.shards
    other = tmp_path / "other"
    other.mkdir()
    (other / "x.txt").write_text("mine")
    with pytest.raises(OutputError, match="not empty"):
        ingest(synth.root, other)
    assert os.listdir(other) == ["x.txt"]
    small = make_export(tmp_path / "small", shape=(70, 70, 70), scales=1, info=True)
    with pytest.raises(SpecError, match="another volume"):
        ingest(small.root, to, resume=True)
    assert read_manifest(to)["complete"] is True  # a refusal changes nothing
    with pytest.raises(SpecError):
        ingest(synth.root, tmp_path / "w", workers=0)
    # overwrite starts again: every shard written anew
    fresh = ingest(synth.root, to, workers=2, overwrite=True)
    assert fresh.ok and fresh.totals.skipped == 0 and fresh.totals.shards == first.totals.shards
    # a bucket is refused in one line before any work (the table writer is local)
    with pytest.raises(OutputError, match="not to a bucket"):
        ingest(synth.root, "gs://no-such-bucket/t")


def test_cli_ingest_into_a_table(synth, tmp_path, capsys):
    from dvidshards.cli import main

    assert main(["ingest", synth.root, str(tmp_path / "t"), "--scales", "1", "2", "--quiet"]) == 0
    assert "records in" in capsys.readouterr().out
    assert read_manifest(tmp_path / "t")["command"] == f"dvidshards ingest {synth.root} {tmp_path / 't'} --scales 1 2"
    assert not (tmp_path / "t.work").exists()  # the work folder goes once the table is complete
    assert main(["ingest", synth.root, str(tmp_path / "t"), "--scales", "2", "--quiet"]) == 2  # refused
    assert "--resume" in capsys.readouterr().err
    assert main(["ingest", synth.root, str(tmp_path / "t"), "--scales", "0", "--quiet", "--resume"]) == 0
    assert json.loads((tmp_path / "t" / "info").read_text())["dvidshards_table"]["complete"] is True


def test_ingest_labels_are_the_supervoxels_or_a_mapping_of_them(synth, tmp_path, capsys):
    """--labels supervoxels|FILE: the table's records carry their supervoxels, or the mapping applied
    to them (an unmapped supervoxel keeps its id), and read back so; --workdir is the folder given."""
    from dvidshards.cli import main

    ds = Dataset(synth.root)
    box = [[0, 0, 0], list(ds.scale(0).size)]
    sv = ds.read(box, labels="supervoxels")
    ids = np.unique(sv[sv != 0])
    pairs = np.stack([ids[::2], ids[::2] + 1000], 1)  # every other supervoxel mapped
    mapping = tmp_path / "map.txt"
    np.savetxt(mapping, pairs, fmt="%d")
    lut = dict(pairs.tolist())
    u, inv = np.unique(sv, return_inverse=True)
    want = np.array([lut.get(int(v), int(v)) for v in u], np.uint64)[inv].reshape(sv.shape)
    assert ingest(synth.root, tmp_path / "s", scales=[0], labels="supervoxels").ok
    np.testing.assert_array_equal(Dataset(TableSource(tmp_path / "s", partial=True)).read(box), sv)
    assert main(["ingest", synth.root, str(tmp_path / "m"), "--scales", "0", "--labels", str(mapping),
                 "--workdir", str(tmp_path / "w"), "--quiet"]) == 0
    np.testing.assert_array_equal(Dataset(TableSource(tmp_path / "m", partial=True)).read(box), want)
    for r in table_rows(tmp_path / "m", 0):
        assert r["labels"] == [lut.get(v, v) for v in r["supervoxels"]]
    assert read_manifest(tmp_path / "m")["parameters"]["mapping_file"] == str(mapping)
    assert not (tmp_path / "w").exists() and not (tmp_path / "m.work").exists()
    assert main(["ingest", synth.root, str(tmp_path / "x"), "--workdir", str(tmp_path / "x" / "w"), "--quiet"]) == 2
    assert "work folder" in capsys.readouterr().err and not (tmp_path / "x").exists()


# --- split cells ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def big_export(tmp_path_factory):
    """Chunks with 16 and 512 random labels (payloads ~130 KB and ~430 KB) next to smooth ones."""
    from dvidshards.writer import write_export

    vol = many_label_volume((192, 128, 64), {(0, 0, 0): 16, (1, 0, 0): 512, (2, 1, 0): 100})
    mapping = {1000 + i: 5 + i % 3 for i in range(0, 628, 2)}
    root = tmp_path_factory.mktemp("big") / "exp"
    write_export(vol, root, mapping=mapping, scales=1, shard_chunks=2, info=True)
    return root, vol, mapping


def test_big_blocks_split_over_bins_and_reassemble_exactly(big_export, tmp_path):
    root, vol, mapping = big_export
    want = export_records(root, 0)
    sizes = {c: len(p) for c, (_, _, p) in want.items()}
    assert sum(v > CELL_LIMIT for v in sizes.values()) == 3 and max(sizes.values()) > 3 * CELL_LIMIT
    to = tmp_path / "t"
    with serve(str(root)) as srv:
        assert ingest(FlightSource(srv.location), to, workers=2).ok
    for r in table_rows(to, 0):
        c = (r["chunk_x"], r["chunk_y"], r["chunk_z"])
        pay = want[c][2]
        if len(pay) > CELL_LIMIT:
            assert r["dvid_compressed_block"] is None
            parts = [r[b] for b in BINS]
            n = -(-len(pay) // CELL_LIMIT)
            assert all(p is not None and len(p) <= CELL_LIMIT for p in parts[:n])
            assert all(p is None for p in parts[n:])
            assert b"".join(parts[:n]) == pay
        else:
            assert r["dvid_compressed_block"] == pay and all(r[b] is None for b in BINS)
    ds, dt = Dataset(root), Dataset(TableSource(to))
    assert_volumes_equal(ds, dt, [0])
    rt = TableSource(to).read_records(0, list(want))  # random access reassembles the split rows too
    assert {tuple(int(v) for v in rt.coords[i]): rt.payload(i).tobytes() for i in range(len(rt))} == \
        {c: p for c, (_, _, p) in want.items()}
    box = [[0, 0, 0], list(vol.shape)]
    np.testing.assert_array_equal(dt.read(box, labels="supervoxels"), vol)
    from dvidshards.formats.mapping import LabelMapping

    np.testing.assert_array_equal(dt.read(box), LabelMapping.from_any(mapping)(vol))


def test_small_cell_limit_splits_real_records(mcns, tmp_path):
    root, spec = mcns
    to = tmp_path / "t"
    sizes = [len(p) for _, _, p in export_records(root, 1).values()]
    cell = max(sizes) // 4 + 1  # every record fits in 4 cells; most need 2 or more
    report = ingest(str(root), to, spec=spec, scales=[1], cell_limit=cell, row_group_size=64)
    assert report.ok, report.failed
    rows = table_rows(to, 1)
    split = sum(r["dvid_compressed_block"] is None for r in rows)
    assert split == sum(n > cell for n in sizes) > 100
    ds, dt = Dataset(root, spec=spec), Dataset(TableSource(to))
    assert_chunks_equal(ds, dt, 1, ds.shard(1, ds.shards(1)[0]).coords[::5])


def test_payload_over_four_cells_is_a_typed_error(tmp_path):
    from dvidshards.writer import write_export

    vol = many_label_volume((128, 64, 64), {(1, 0, 0): 4096}, seed=2)
    root = tmp_path / "exp"
    write_export(vol, root, scales=1, shard_chunks=2, info=True)
    big = max(len(p) for _, _, p in export_records(root, 0).values())
    assert big > 4 * CELL_LIMIT
    table, work = as_store(tmp_path / "t", writable=True), as_store(tmp_path / "w", writable=True)
    task = next(plan(Dataset(root), scales=[0], workers=1, table=table, work=work))
    with pytest.raises(CellLimitError, match=r"chunk \(1, 0, 0\).*more than 4 cells") as e:
        run_task(task)
    assert str(big) in str(e.value)
    assert os.listdir(tmp_path / "t" / "s0") == []  # nothing half written in the table
    assert not [n for n in os.listdir(tmp_path / "w" / "s0") if n.endswith(".tmp")]
    with serve(str(root)) as srv:  # through Flight and ingest(): the partition fails, named
        with pytest.raises(JobError) as e:
            ingest(FlightSource(srv.location), tmp_path / "t2", workers=2)
    report = e.value.report
    assert not report.ok and any("CellLimitError" in v for v in report.failed.values())
    assert read_manifest(tmp_path / "t2")["failed"] == report.failed
    assert not json.loads((tmp_path / "t2" / "info").read_text())["dvidshards_table"]["complete"]
    # a higher limit takes it
    assert ingest(str(root), tmp_path / "t3", cell_limit=big // 4 + 1).ok


# --- worker faults --------------------------------------------------------------------------------


class GatedServer(ExportFlightServer):
    """Serves the first ``allow`` shards, then holds every further one until ``gate`` is set: a
    worker reading from it is stopped mid-stream, whatever the machine's speed."""

    def __init__(self, *args, allow: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.allow, self.gate, self.served, self._count = allow, threading.Event(), 0, threading.Lock()

    def _shard(self, s, origin):
        with self._count:
            self.served += 1
            held = self.served > self.allow
        if held:
            assert self.gate.wait(HANG_SECONDS), "the test never opened the gate"
        return super()._shard(s, origin)


@pytest.mark.slow
def test_worker_killed_mid_stream_and_restarted(synth, tmp_path):
    to = tmp_path / "t"
    n_shards = len(Dataset(synth.root).shards(0))
    srv = GatedServer(synth.root, allow=n_shards - 1).start()  # the last shard is never served to this worker
    try:
        code = (f"from dvidshards.sources.flight import FlightSource\nfrom dvidshards.jobs.ingest import ingest\n"
                f"ingest(FlightSource({srv.location!r}), {str(to)!r}, workers=2, scales=[0])\n")
        p = subprocess.Popen([sys.executable, "-c", code], cwd=str(ROOT))
        try:
            wait_until(lambda: len(list(to.glob("s0/*.parquet"))) >= 2, "two shards written",
                       alive=lambda: p.poll() is None)
        finally:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
            srv.gate.set()
        before = sorted(f.name for f in (to / "s0").glob("*.parquet"))
        assert 2 <= len(before) < n_shards, before
        report = ingest(FlightSource(srv.location), to, workers=2, scales=[0], resume=True)
    finally:
        srv.shutdown()
    assert report.ok and report.totals.skipped == len(before) and report.totals.shards == n_shards - len(before)
    assert not [n for n in os.listdir(to / "s0") if n.startswith(".")]  # the table never held half a file
    assert not (tmp_path / "t.work").exists()  # the dead worker's half-written file is gone with the work folder
    rows = table_rows(to, 0)
    want = export_records(Path(synth.root), 0)
    keys = [(r["chunk_x"], r["chunk_y"], r["chunk_z"]) for r in rows]
    assert len(keys) == len(set(keys)) == len(want) and set(keys) == set(want)
    assert_volumes_equal(Dataset(synth.root), Dataset(TableSource(to, partial=True)), [0])


# --- tables and streams as sources -------------------------------------------------------------------


def _real_table(dvid_data) -> pa.Table:
    with pa.OSFile(str(dvid_data / f"{REAL_SHARD}.arrow")) as f:
        return pa.ipc.open_stream(f).read_all()


def _prototype(t: pa.Table, split_at: int | None = None) -> pa.Table:
    """The DVID prototype's names; payloads over split_at in bin1..bin4 (null compressed_data)."""
    t = t.rename_columns([{"chunk_x": "block_coord_x", "chunk_y": "block_coord_y", "chunk_z": "block_coord_z",
                           "dvid_compressed_block": "compressed_data"}.get(n, n) for n in t.schema.names])
    if split_at is None:
        return t
    pays = t.column("compressed_data").to_pylist()
    assert max(map(len, pays)) <= 4 * split_at
    bins = [[None] * len(pays) for _ in range(4)]
    whole = []
    for i, p in enumerate(pays):
        if len(p) > split_at:
            whole.append(None)
            for k in range(4):
                piece = p[k * split_at:(k + 1) * split_at]
                bins[k][i] = piece if piece else None
        else:
            whole.append(p)
    t = t.set_column(t.schema.get_field_index("compressed_data"), "compressed_data", pa.array(whole, pa.binary()))
    for k in range(4):
        t = t.append_column(f"bin{k + 1}", pa.array(bins[k], pa.binary()))
    return t


class CStream:
    """Only ``__arrow_c_stream__`` (like a polars or duckdb result), readable once."""

    def __init__(self, t: pa.Table):
        self.t, self.used = t, False

    def __arrow_c_stream__(self, requested_schema=None):
        assert not self.used, "read twice"
        self.used = True
        return self.t.__arrow_c_stream__(requested_schema)


@pytest.mark.parametrize("form", ["table", "prototype", "prototype-split", "reader", "c-stream", "parquet",
                                  "feather"])
def test_any_arrow_table_or_stream_reads_like_the_files(mcns, dvid_data, form, tmp_path):
    root, spec = mcns
    t = _real_table(dvid_data)
    src = {"table": lambda: t, "prototype": lambda: _prototype(t),
           "prototype-split": lambda: _prototype(t, split_at=max(map(len, t.column(
               "dvid_compressed_block").to_pylist())) // 4 + 1),
           "reader": lambda: pa.RecordBatchReader.from_batches(t.schema, t.to_batches()),
           "c-stream": lambda: CStream(t)}.get(form)
    if form == "parquet":
        path = tmp_path / "x.parquet"
        pq.write_table(t, path, row_group_size=50)
        source = TableSource(str(path), spec=spec, scale=1)
    elif form == "feather":
        path = tmp_path / "x.arrow"
        with pa.OSFile(str(path), "wb") as f, pa.ipc.new_file(f, t.schema) as w:
            w.write_table(t)
        source = TableSource(str(path), spec=spec, scale=1)
    else:
        source = TableSource(src(), spec=spec, scale=1)
    ds, dt = Dataset(root, spec=spec), Dataset(source)
    assert dt.shards(1) == ds.shards(1) and dt.shards(0) == []
    coords = ds.shard(1, ds.shards(1)[0]).coords
    assert_chunks_equal(ds, dt, 1, coords[::3])
    sh = dt.shard(1, ds.shards(1)[0])
    assert len(sh) == 258 and sorted(map(tuple, sh.coords.tolist())) == sorted(map(tuple, coords.tolist()))


def test_table_payloads_are_zero_copy_when_nothing_is_split(synth, tmp_path):
    to = tmp_path / "t"
    ingest(synth.root, to, workers=1, scales=[0])
    src = TableSource(to, partial=True)
    s = Dataset(src).scale(0)
    o = src.shard_origins(s)[0]
    t = pq.ParquetFile(next((to / "s0").glob(f"*_{o[0]}_{o[1]}_{o[2]}.parquet"))).read()
    from dvidshards.sources.tables import normalise_records

    single = t.combine_chunks()
    rt = normalise_records(single, "x", s)
    col = single.column("dvid_compressed_block").chunk(0)
    assert rt.bufs[0].ctypes.data == col.buffers()[2].address  # the Parquet buffer itself


def test_wrong_spec_and_bad_tables_are_typed(synth, tmp_path, mcns):
    to = tmp_path / "t"
    ingest(synth.root, to, workers=1)
    info = json.loads((to / "info").read_text())
    assert info["scales"][0]["sharding"]["shard_bits"] == 3
    info["scales"][0]["sharding"]["shard_bits"] = 1  # same shard boxes, other shard ids
    (to / "info").write_text(json.dumps(info))
    dt = Dataset(TableSource(to))
    with pytest.raises(ChunkIndexError, match="another spec"):
        dt.read([[128, 128, 128], [192, 170, 150]])  # shard 7, which that spec calls 1
    with pytest.raises(ChunkIndexError, match="another spec"):  # point look-ups: never background
        TableSource(to).read_records(0, [[2, 2, 2]])
    with pytest.raises(SpecError, match="spec"):
        TableSource(pa.table({"chunk_x": [1]}))
    with pytest.raises(SpecError):
        TableSource(tmp_path / "nope.parquet", spec=mcns[1])
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 not really")
    with pytest.raises(DvidShardsError):
        TableSource(str(bad), spec=mcns[1])
    with pytest.raises(DvidShardsError):
        TableSource(pa.table({"x": [1]}), spec=mcns[1])


def test_damaged_table_file_is_typed(synth, tmp_path):
    to = tmp_path / "t"
    ingest(synth.root, to, workers=1, scales=[0])
    f = sorted((to / "s0").glob("*.parquet"))[0]
    f.write_bytes(f.read_bytes()[:-100])
    dt = Dataset(TableSource(to, partial=True))
    o = tuple(int(v) for v in f.stem.split("_")[1:])
    with pytest.raises(DvidShardsError, match=f.name):
        dt.shard(0, o)
    with pytest.raises(MissingShardError):
        dt.shard(0, (1 << 20, 0, 0))


def test_read_records_by_row_group_statistics(synth, tmp_path):
    to = tmp_path / "t"
    ingest(synth.root, to, workers=2, scales=[0], row_group_size=2)
    src = TableSource(to, partial=True)
    ds = Dataset(synth.root)
    s = ds.scale(0)
    allc = ds.chunks(0)
    rng = np.random.default_rng(3)
    pick = allc[rng.choice(len(allc), 7, replace=False)]
    absent = np.array([[3, 2, 2], [0, 0, 9]])  # outside the grid or without a record
    rt = src.read_records(0, np.concatenate([pick, absent, pick[:3]]))  # repeats: each record once
    assert sorted(map(tuple, rt.coords.tolist())) == sorted(map(tuple, pick.tolist()))
    for c in pick[:3]:  # one chunk: one row of one row group
        one = src.read_records(0, [c])
        assert len(one) == 1 and tuple(one.coords[0]) == tuple(c)
    for i in range(len(rt)):
        c = tuple(int(v) for v in rt.coords[i])
        sh = ds.shard(0, s.shard_origin(*c))
        assert rt.block(i) == sh.table().block(sh.find(*c))
        np.testing.assert_array_equal(rt.labels(i), sh.table().labels(sh.find(*c)))


def test_record_keys_against_brute_force(mcns, synth):
    spec = json.loads(Path(mcns[1]).read_text())
    from dvidshards.formats.multiscale import parse_multiscale

    rng = np.random.default_rng(0)
    for s in parse_multiscale(spec) + Dataset(synth.root).scales:
        c = (rng.random((50, 3)) * np.asarray(s.grid)).astype(np.int64)
        sid, mor = record_keys(s, c)
        low = s.sharding.preshift_bits + s.sharding.minishard_bits
        for i in range(len(c)):
            m = brute_morton(c[i], s.grid)
            assert mor[i] == m and sid[i] == (m >> low) & ((1 << s.sharding.shard_bits) - 1)
    with pytest.raises(ChunkIndexError, match="outside"):
        record_keys(s, [[-1, 0, 0]])


def test_look_ups_skip_bins_only_where_statistics_say_none_is_split(big_export, tmp_path):
    root, vol, mapping = big_export
    want = export_records(root, 0)
    to = tmp_path / "t"
    assert ingest(str(root), to, workers=1, row_group_size=2).ok
    f = sorted((to / "s0").glob("*.parquet"))
    md = [pq.ParquetFile(x).metadata for x in f]
    nulls = [m.row_group(g).column(m.schema.names.index("bin1")).statistics.null_count
             for m in md for g in range(m.num_row_groups)]
    assert 0 < sum(n < 2 for n in nulls) < len(nulls)  # row groups with and without split rows
    for x in f[:2]:  # an older file: no bin1 statistics, so every row group's bins are read
        t = pq.read_table(x)
        pq.write_table(t, x, row_group_size=2, write_statistics=["shard_id", "morton"])
    rt = TableSource(to).read_records(0, list(want))
    assert {tuple(int(v) for v in rt.coords[i]): rt.payload(i).tobytes() for i in range(len(rt))} == \
        {c: p for c, (_, _, p) in want.items()}


def test_fast_morton_codes_equal_compressed_morton_code():
    from dvidshards.formats.sharding import compressed_morton_code
    from dvidshards.sources.tables import morton_codes

    rng = np.random.default_rng(5)
    for k in range(200):
        hi = 40 if k % 3 == 0 else 1 << 21
        grid = tuple(int(v) for v in rng.integers(1, hi, 3))
        for n in (1, 3, 8, 9, 300):  # the per-chunk (Python) path and the vector path
            c = np.stack([rng.integers(0, g, n) for g in grid], axis=1).astype(np.int64)
            np.testing.assert_array_equal(morton_codes(c, grid), compressed_morton_code(c, grid))


def test_gather_copies_exact_byte_ranges():
    from dvidshards.errors import ShardFormatError
    from dvidshards.sources.tables import _gather

    rng = np.random.default_rng(1)
    src = rng.integers(0, 256, 100_000, dtype=np.uint8)
    lens = rng.integers(0, 3000, 50)
    offs = rng.integers(0, len(src) - lens)
    out, o = _gather(src, offs, lens)
    assert out.tobytes() == b"".join(src[a:a + n].tobytes() for a, n in zip(offs, lens, strict=True))
    np.testing.assert_array_equal(o, np.concatenate([[0], np.cumsum(lens)]))
    with pytest.raises(ShardFormatError):
        _gather(src, [len(src) - 2], [3])


def test_stream_batches_are_exact_slices_of_gathered_spans(mcns, monkeypatch):
    """Batches are slices of a few larger gathers; each carries (over IPC) its own records only."""
    import dvidshards.sources.tables as tables

    root, spec = mcns
    ds = Dataset(str(root), spec=str(spec))
    s, o = ds.scale(1), ds.shards(1)[0]
    t = ds.shard(1, o).table()
    sid, mor = record_keys(s, t.coords)
    order = np.lexsort((mor, sid))
    whole = tables.records_to_batch(t, order, sid[order], mor[order])
    monkeypatch.setattr(tables, "GATHER_BYTES", 60_000)  # several spans of several batches
    got = list(tables.record_batches(t, s, o, batch_rows=7))
    assert [b.num_rows for b, _ in got] == [7] * (len(t) // 7) + [len(t) % 7]
    assert [m for _, m in got[:-1]] == [{}] * (len(got) - 1) and got[-1][1]["records"] == len(t)
    assert pa.Table.from_batches([b for b, _ in got]).equals(pa.Table.from_batches([whole]))
    span = max(len(b.column("dvid_compressed_block").buffers()[2]) for b, _ in got)
    for b, _ in got[:5]:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, b.schema) as w:
            w.write_batch(b)
        buf = sink.getvalue()
        assert pa.ipc.open_stream(buf).read_all().equals(pa.Table.from_batches([b]))
        own = sum(len(b.column("dvid_compressed_block")[i].as_py()) for i in range(b.num_rows))
        assert len(buf) < own + 20_000 < span  # the slice's own payloads, not its span's


# --- VastDB through a fake ------------------------------------------------------------------------


class FakeVastTable:
    """What the adapters use of a ``vastdb`` table: ``insert`` and ``select -> RecordBatchReader``."""

    def __init__(self):
        import threading

        from dvidshards.sources.tables import TABLE_SCHEMA

        self.data = TABLE_SCHEMA.empty_table()
        self.predicates: list = []
        self.inserts = 0
        self.lock = threading.Lock()

    def insert(self, t: pa.Table):
        with self.lock:
            self.inserts += 1
            self.data = pa.concat_tables([self.data, t])

    def select(self, columns, predicate, config):
        self.predicates.append(predicate)
        t = self.data
        if predicate is not None:
            assert isinstance(predicate, Predicate)  # ibis is not installed here
            t = t.filter(predicate.to_pyarrow())
        t = t.select(columns)
        return pa.RecordBatchReader.from_batches(t.schema, t.to_batches())


def test_vastdb_sink_and_source_with_a_fake(synth):
    fake = FakeVastTable()
    sink = VastDBSink(fake)
    report = ingest(synth.root, sink, workers=2, scales=[0])
    assert report.ok and fake.inserts == report.totals.shards == len(Dataset(synth.root).shards(0))
    again = ingest(synth.root, sink, workers=2, scales=[0])  # restart: every shard is there
    assert again.ok and fake.inserts == report.totals.shards
    assert fake.data.num_rows == len(export_records(Path(synth.root), 0))
    src = VastDBSource(fake, Dataset(synth.root).spec)
    dv = Dataset(src)
    assert dv.shards(0) == Dataset(synth.root).shards(0)
    assert_volumes_equal(Dataset(synth.root), dv, [0])
    # each shard was one select with its shard ids and chunk box pushed down
    p = fake.predicates[-1]
    assert [t[0] for t in p.terms] == ["shard_id", "chunk_x", "chunk_y", "chunk_z"]


def test_vastdb_cell_limits_with_a_fake(big_export):
    root, _, _ = big_export
    fake = FakeVastTable()
    assert ingest(str(root), VastDBSink(fake), workers=1).ok
    assert fake.data.column("bin2").null_count < fake.data.num_rows  # big payloads split
    assert_volumes_equal(Dataset(root), Dataset(VastDBSource(fake, Dataset(root).spec)), [0])
    report = ingest(str(root), VastDBSink(FakeVastTable(), cell_limit=4000), workers=1, allow_partial=True)
    assert not report.ok and any("CellLimitError" in v for v in report.failed.values())
    with pytest.raises(JobError, match="CellLimitError"):
        ingest(str(root), VastDBSink(FakeVastTable(), cell_limit=4000), workers=1)


def test_vastdb_predicates_serialise_with_the_sdk(synth):
    pytest.importorskip("vastdb", reason="vastdb SDK not installed (it pins pyarrow<=23.0.1)")
    import flatbuffers
    from vastdb.internal_commands import Predicate as SdkPredicate

    from dvidshards.sources.tables import TABLE_SCHEMA

    ds = Dataset(synth.root)
    for o in ds.shards(0):
        expr = shard_predicate(ds.scale(0), o).to_ibis()
        assert SdkPredicate(TABLE_SCHEMA, expr).serialize(flatbuffers.Builder(0))


# --- /blocks dumps into an export ---------------------------------------------------------------------


def test_ingest_blocks_into_an_export_with_a_mapping(synth, tmp_path):
    from tests.support.blocks import export_blocks
    from tests.support.blockstream import write_stream

    blocks = export_blocks(Path(synth.root))
    half = len(blocks) // 2
    (tmp_path / "a.dat").write_bytes(write_stream(blocks[:half]))
    (tmp_path / "b.dat").write_bytes(write_stream(blocks[half:], compression="uncompressed"))
    mapping = tmp_path / "map.csv"
    np.savetxt(mapping, np.asarray(sorted(synth.mapping.items()) if isinstance(synth.mapping, dict)
                                   else synth.mapping, np.uint64), fmt="%d", delimiter=",")
    out = ingest_blocks([tmp_path / "a.dat", tmp_path / "b.dat"], tmp_path / "exp", labels=mapping,
                        spec=Dataset(synth.root).spec)
    assert out["ingest"]["records"] == len(blocks)
    ds_new = Dataset(tmp_path / "exp")
    box = [[0, 0, 0], list(ds_new.scale(0).size)]
    np.testing.assert_array_equal(ds_new.read(box), synth.expected(0))
    np.testing.assert_array_equal(ds_new.read(box, labels="supervoxels"), synth.expected(0, "supervoxels"))
    from dvidshards.jobs.verify import verify

    assert verify(tmp_path / "exp").ok
    with pytest.raises(SpecError, match="not an empty folder"):  # never into an existing export
        ingest_blocks([tmp_path / "a.dat"], tmp_path / "exp")
    assert "_dvidshards.lock" not in os.listdir(tmp_path / "exp")
    with pytest.raises(ChunkIndexError, match="twice"):
        ingest_blocks([tmp_path / "a.dat", tmp_path / "a.dat"], tmp_path / "dup")
    assert not (tmp_path / "dup").exists()  # failed before anything was written: no folder left
    with pytest.raises(OutputError, match="not to a bucket"):
        ingest_blocks([tmp_path / "a.dat"], "s3://no-such-bucket/exp")


def test_frame_size_kernel_agrees_with_zstandard():
    """The vectorised frame header parser behind the server's payload check, against zstandard."""
    import zstandard

    from dvidshards.formats.records import RecordTable
    from dvidshards.sources.tables import frame_sizes

    rng = np.random.default_rng(4)
    frames = []
    for n in (0, 1, 100, 255, 256, 300, 65791, 65792, 70000, 5_000_000):
        data = rng.integers(0, 4, n, dtype=np.uint8).tobytes()
        # 5 MB: over the default window (a window descriptor, no single-segment flag); at level 19
        # (36 s to compress) its header is the single-segment one 70000 bytes has already
        levels = [{"level": 19}] if n < 10**6 else []
        for kw in [{}, {"write_content_size": False}, {"write_checksum": True}, *levels]:
            frames.append(zstandard.ZstdCompressor(**kw).compress(data))
        cobj = zstandard.ZstdCompressor().compressobj()  # streamed: no content size
        frames.append(cobj.compress(data) + cobj.flush())
    frames += [b"", b"\x28\xb5\x2f", b"nope, not zstd", b"\x28\xb5\x2f\xfd\x08\x00"]  # reserved bit set
    buf = np.frombuffer(b"".join(frames), np.uint8)
    offs = np.cumsum([0] + [len(f) for f in frames[:-1]])
    rec = np.zeros((len(frames), 11), np.int64)
    from dvidshards.formats import arrowipc as ipc

    rec[:, ipc.R_PAY], rec[:, ipc.R_PAYLEN] = offs, [len(f) for f in frames]
    z = np.zeros(0, np.uint8)
    t = RecordTable(rec, (buf, z, z), "x")
    got = frame_sizes(t, np.arange(len(frames)))
    for f, g in zip(frames, got, strict=True):
        try:
            want = zstandard.frame_content_size(f)
        except zstandard.ZstdError:
            want = -2
        assert g == want, (f[:8], g, want)


def test_table_sources_pickle(synth, tmp_path):
    import pickle

    to = tmp_path / "t"
    ingest(synth.root, to, workers=1, scales=[0])
    layout = TableSource(to, partial=True)
    layout.read_records(0, [[0, 0, 0]])  # opens a Parquet file: that cache must not travel
    one = {a: pa.array([0], pa.int32()) for a in ("chunk_x", "chunk_y", "chunk_z")}
    memory = TableSource(pa.table(one), spec=Dataset(synth.root).spec)
    for src in (layout, memory):
        again = pickle.loads(pickle.dumps(Dataset(src)))
        assert again.shards(0) == Dataset(src).shards(0)
    ds2 = pickle.loads(pickle.dumps(Dataset(TableSource(to, partial=True))))
    assert_volumes_equal(Dataset(synth.root), ds2, [0])


def test_select_rows_against_brute_force(synth):
    from dvidshards.sources.tables import select_rows

    ds = Dataset(synth.root)
    s = ds.scale(0)
    rng = np.random.default_rng(9)
    for o in ds.shards(0):
        sh = ds.shard(0, o)
        c = sh.coords
        for _ in range(30):
            lo = rng.integers(-70, 260, 3)
            hi = lo + rng.integers(0, 300, 3)
            box = [lo.tolist(), hi.tolist()]
            cl, ch = lo // 64, -(-hi // 64)
            want = np.flatnonzero(((c >= cl) & (c < ch)).all(axis=1))
            np.testing.assert_array_equal(select_rows(sh, s, box=box), want)
            pick = rng.integers(0, 4, (5, 3))
            want_c = np.flatnonzero([tuple(v) in {tuple(p) for p in pick.tolist()} for v in c.tolist()])
            np.testing.assert_array_equal(select_rows(sh, s, chunks=pick), want_c)
            np.testing.assert_array_equal(select_rows(sh, s, box=box, chunks=pick), np.intersect1d(want, want_c))
        np.testing.assert_array_equal(select_rows(sh, s), np.arange(len(sh)))


# --- what ingest says it moved -----------------------------------------------------------------------


def test_ingest_reports_a_real_rate_or_none(three_shards, tmp_path, capsys):
    import re

    from dvidshards.cli import main

    assert main(["ingest", three_shards.root, str(tmp_path / "table"), "--spec",
                 spec_file(three_shards, tmp_path)]) == 0
    out = capsys.readouterr().out
    m = re.search(r"\(([0-9.]+) (k|M|G)?B in [0-9.]+ s(, ([0-9.]+) (k|M|G)?B/s)?\)", out)
    assert m, out
    assert " 0 MB/s" not in out
    if m.group(3):  # a rate, when one is told, is not zero
        assert float(m.group(4)) > 0
    # again: every shard already there, nothing moved, no rate
    assert main(["ingest", three_shards.root, str(tmp_path / "table"), "--spec",
                 spec_file(three_shards, tmp_path), "--resume"]) == 0
    out = capsys.readouterr().out
    assert "B/s" not in out and "already there" in out, out
