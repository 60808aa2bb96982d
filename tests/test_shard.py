"""Every index variant reads through one path; the global and consolidated indexes."""

from __future__ import annotations

import json
import os
import shutil
import struct
import threading
from pathlib import Path

import numpy as np
import pytest

import dvidshards
from dvidshards import ChunkIndexError, DvidShardsError, IndexRebuiltWarning, MissingShardError
from dvidshards.dataset import Dataset
from dvidshards.formats.chunkindex import parse_csv, parse_footer
from dvidshards.formats.labels import Agglomerated
from dvidshards.formats.multiscale import Scale
from dvidshards.read import ChunkReader
from dvidshards.shard import Shard, _Eager
from dvidshards.stores import LocalStore, MemoryStore
from dvidshards.writer import write_shard
from tests.support.data import REAL_SHARD
from tests.support.exports import (
    THREE_SHARDS,
    consolidate,
    copy_export,
    crop,
    load_shard,
    shard_records,
    spec_file,
    ts_read,
)
from tests.support.servers import RangeServer

CSVS = {"A": "-newformat.csv", "B": "-offsets.csv", "C": ".csv"}


def _real_shard_dir(tmp_path, dvid_data, variant):
    d = tmp_path / variant / "s1"
    d.mkdir(parents=True)
    (d / f"{REAL_SHARD}.arrow").symlink_to(dvid_data / f"{REAL_SHARD}.arrow")
    (d / f"{REAL_SHARD}.csv").symlink_to(dvid_data / f"{REAL_SHARD}{CSVS[variant]}")
    return d.parent


def _contents(sf: Shard) -> dict:
    """chunk -> (labels, supervoxels, block bytes) through the public reading calls."""
    out = {}
    t = sf.table()
    for i, c in enumerate(sf.coords.tolist()):
        out[tuple(c)] = (t.labels(i).tolist(), t.supervoxels(i).tolist(), t.block(i))
    return out


def test_real_shard_three_csv_variants_identical(dvid_data, tmp_path, real_records):
    got = {}
    for v in CSVS:
        sf = load_shard(_real_shard_dir(tmp_path, dvid_data, v), f"s1/{REAL_SHARD}")
        assert sf.variant == v and len(sf) == 258 and sf.schema_size == 688
        got[v] = _contents(sf)
    assert got["A"] == got["B"] == got["C"]
    ref = {(r["chunk_x"], r["chunk_y"], r["chunk_z"]): (r["labels"], r["supervoxels"], r["block"]) for r in real_records}
    assert got["A"] == ref


@pytest.mark.parametrize("variant,container,batch", [("A", "stream", 1), ("A", "stream", 7), ("B", "stream", 1),
                                                     ("C", "stream", 5), ("C", "file", 1), ("C", "file", 3),
                                                     ("D", "file", 1), ("D", "file", 4)])
def test_real_shard_repacked(dvid_data, tmp_path, real_records, variant, container, batch):
    """The real shard re-packed in every variant, container and batch size reads the same."""
    (tmp_path / "s1").mkdir()
    recs = list(reversed(real_records))  # any record order
    write_shard(tmp_path / "s1" / REAL_SHARD, recs, batch_size=batch, index=variant, container=container)
    sf = load_shard(tmp_path, f"s1/{REAL_SHARD}")
    assert sf.variant == variant and len(sf) == 258
    ref = {(r["chunk_x"], r["chunk_y"], r["chunk_z"]): (r["labels"], r["supervoxels"], r["block"]) for r in recs}
    assert _contents(sf) == ref
    spec = json.loads((dvid_data / "mcns-ng-specs.json").read_text())
    vol = dvidshards.open(tmp_path, scale=1, spec=spec)
    r = recs[17]
    box = tuple(slice(64 * c, 64 * c + 64) for c in (r["chunk_x"], r["chunk_y"], r["chunk_z"]))
    want = dvidshards.decode_block(r["block"], np.array(r["labels"], np.uint64))
    np.testing.assert_array_equal(vol[box].read(order="F").result().T, want)


@pytest.mark.parametrize("variant,container", [("A", "stream"), ("B", "stream"), ("C", "stream"), ("C", "file"),
                                               ("D", "file")])
def test_writer_roundtrip_every_variant(tmp_path, variant, container):
    from tests.support.exports import make_export

    ex = make_export(tmp_path / "e", shape=(150, 140, 90), scales=2, index=variant, container=container,
                     batch_size=1 if variant == "B" else 7)
    for k in range(2):
        vol = dvidshards.open(ex.root, scale=k, spec=ex.spec, fill_missing_shards=True)  # some shards are empty
        np.testing.assert_array_equal(vol.read(order="F").result(), ex.expected(k))


def test_parse_csv_forms():
    raw = parse_csv(b"# schema_size=688\nx,y,z,offset,size,batch_idx\n1,2,3,688,100,0\n4,5,6,788,50,2\n", "t.csv")
    assert raw.variant == "A" and raw.schema_size == 688
    assert raw.coords.tolist() == [[1, 2, 3], [4, 5, 6]] and raw.batch_idx.tolist() == [0, 2]
    assert parse_csv(b"x,y,z,rec\n", "t.csv").coords.shape == (0, 3)
    assert parse_csv(b"x,y,z,rec\r\n7,8,9,0\r\n", "t.csv").rec.tolist() == [0]


@pytest.mark.parametrize("text,match", [
    (b"x,y,z,offset,size,batch_idx\n1,2,3,4,5,0\n", "schema_size"),
    (b"# schema_size=688\nx,y,z,foo\n1,2,3,4\n", "unknown chunk index columns"),
    (b"# schema=1\nx,y,z,rec\n", "unrecognised first line"),
    (b"x,y,z,rec\n1,2,3,0\n1,2,3,1\n", "more than once"),
    (b"x,y,z,rec\n1,2,3,-1\n", "rec=-1, negative"),
    (b"# schema_size=688\nx,y,z,offset,size,batch_idx\n1,2,3,4,9223372036854775000,0\n", "beyond any file size"),
    (b"x,y,z,rec\n1,2,three,0\n", "malformed"),
    (b"x,y,z,rec\n1,2,3\n", "malformed"),
    (b"x,y,z,rec\n-1,2,3,0\n", "out of range"),
])
def test_parse_csv_rejects(text, match):
    with pytest.raises(dvidshards.ChunkIndexError, match=match) as e:
        parse_csv(text, "bad.csv")
    assert "bad.csv" in str(e.value)


def test_parse_footer():
    raw = parse_footer(b'{"64_128_0": 0, "0_0_0": 1}', (64, 64, 64), "f.arrow")
    assert raw.variant == "D" and raw.coords.tolist() == [[1, 2, 0], [0, 0, 0]] and raw.rec.tolist() == [0, 1]
    for bad in (b'{"1_2_3": 0}', b'{"a_b_c": 0}', b"[1]", b"{", b'{"0_0_0": -1}'):
        with pytest.raises(dvidshards.ChunkIndexError, match="f.arrow"):
            parse_footer(bad, (64, 64, 64), "f.arrow")


def _recording_reader(root, max_shards=64):
    """A chunk reader of s0 (shard extent 128) whose shard loads are recorded."""
    scale = Scale(0, (1 << 20,) * 3, None, 128)
    reader = ChunkReader(LocalStore(root), scale, Agglomerated(), max_shards=max_shards)
    loads, load = [], reader.load

    async def recording(origin):
        loads.append(origin)
        return await load(origin)

    reader.load = recording
    return loads, reader


def test_shard_cache_is_lazy_and_bounded(synthetic_export):
    loads, reader = _recording_reader(synthetic_export.root, max_shards=2)
    assert reader.cache.loaded == 0
    assert reader.scale.shard_origin(3, 1, 2) == (128, 0, 128)
    for c in [(0, 0, 0), (1, 1, 1), (2, 0, 0), (0, 2, 0), (0, 0, 0)]:
        reader.shard(*c)
    assert loads == [(0, 0, 0), (128, 0, 0), (0, 128, 0), (0, 0, 0)] and reader.cache.loaded == 2
    # concurrent first touches of one shard load it once
    loads2, reader2 = _recording_reader(synthetic_export.root)
    ts = [threading.Thread(target=reader2.shard, args=(1, 1, 1)) for _ in range(8)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert loads2 == [(0, 0, 0)]


def test_consolidated_index(synthetic_export, tmp_path):
    from dvidshards.cli import main

    out = tmp_path / "idx"
    assert main(["consolidate", synthetic_export.root, "--spec", spec_file(synthetic_export, tmp_path),
                 "--out", str(out)]) == 0
    ds = Dataset(synthetic_export.root, index=out)  # geometry from the consolidated index too
    assert [s.size for s in ds.scales] == [tuple(v.shape) for v in synthetic_export.scales]
    listed = ds.chunks(0)
    nonzero = {tuple(c) for c in np.argwhere(synthetic_export.sv) // 64}
    assert {tuple(c) for c in listed.tolist()} == nonzero
    assert sorted(ds.shards(0)) == sorted(Dataset(synthetic_export.root, spec=synthetic_export.spec).shards(0))
    for k in range(3):
        np.testing.assert_array_equal(ds.open(k).read(order="F").result(), synthetic_export.expected(k))
    inside = os.path.join(synthetic_export.root, "idx")
    assert main(["consolidate", synthetic_export.root, "--out", inside]) == 2  # never writes into the export
    assert not os.path.exists(inside)
    with pytest.raises(dvidshards.ChunkIndexError, match="outside the export"):
        from dvidshards.consolidated import write_consolidated

        write_consolidated(ds, ds.scales[0], inside)


def test_shard_cache_lru_order(synthetic_export):
    """Touching a shard makes it the newest; the least recently touched one is evicted."""
    loads, reader = _recording_reader(synthetic_export.root, max_shards=2)
    for c in [(0, 0, 0), (2, 0, 0), (0, 0, 0), (1, 0, 0), (0, 2, 0), (0, 0, 0), (2, 0, 0)]:
        reader.shard(*c)
    # (128, 0, 0) was the least recently used when (0, 128, 0) came in
    assert loads == [(0, 0, 0), (128, 0, 0), (0, 128, 0), (128, 0, 0)]


@pytest.mark.parametrize("variant,batch", [("A", 1), ("A", 7), ("B", 1)])
def test_offset_index_loads_without_scan_to_the_same(dvid_data, tmp_path, real_records, monkeypatch, variant, batch):
    """A stream indexed by byte offsets loads without a scan, to exactly what the full path gives."""
    (tmp_path / "s1").mkdir()
    write_shard(tmp_path / "s1" / REAL_SHARD, list(reversed(real_records)), batch_size=batch, index=variant)
    fast_path = _Eager._by_offsets
    taken = []

    def spy(self, *args):
        r = fast_path(self, *args)
        taken.append(r is not None)
        return r

    monkeypatch.setattr(_Eager, "_by_offsets", spy)
    fast = load_shard(tmp_path, f"s1/{REAL_SHARD}")
    monkeypatch.setattr(_Eager, "_by_offsets", lambda self, *args: None)
    full = load_shard(tmp_path, f"s1/{REAL_SHARD}")
    assert taken == [True] and fast.variant == full.variant == variant
    np.testing.assert_array_equal(fast.table().rec, full.table().rec)
    for k in ("coords", "msg_off", "msg_len", "row"):
        np.testing.assert_array_equal(getattr(fast.index, k), getattr(full.index, k))
    assert _contents(fast) == _contents(full)


@pytest.mark.parametrize("drop", [0, 100, -1])
def test_offset_index_missing_a_record_same_error(dvid_data, tmp_path, real_records, monkeypatch, drop):
    """An index that leaves a record batch out still fails, with the full path's message."""
    (tmp_path / "s1").mkdir()
    write_shard(tmp_path / "s1" / REAL_SHARD, real_records[:150], index="A")
    csv = tmp_path / "s1" / f"{REAL_SHARD}.csv"
    lines = csv.read_text().splitlines()
    del lines[2 + drop if drop >= 0 else drop]  # after "# schema_size" and the header
    csv.write_text("\n".join(lines) + "\n")
    with pytest.raises(dvidshards.ChunkIndexError, match="has no index entry") as fast:
        load_shard(tmp_path, f"s1/{REAL_SHARD}")
    monkeypatch.setattr(_Eager, "_by_offsets", lambda self, *args: None)
    with pytest.raises(dvidshards.ChunkIndexError) as full:
        load_shard(tmp_path, f"s1/{REAL_SHARD}")
    assert str(fast.value) == str(full.value)


def test_chunk_lookup_grid_and_dict_agree(dvid_data, tmp_path):
    """Dense lookup over the shard's box (the reader's case) and the dict (no box) agree."""
    root = _real_shard_dir(tmp_path, dvid_data, "A")
    lo = np.array([30720, 24576, 28672]) // 64
    grid = load_shard(root, f"s1/{REAL_SHARD}", extent=2048)
    huge = load_shard(root, f"s1/{REAL_SHARD}")  # single-shard exports
    plain = huge
    r = np.arange(-1, 33)
    for x in r:
        for y in r:
            for z in r:
                c = (int(lo[0] + x), int(lo[1] + y), int(lo[2] + z))
                assert grid.find(*c) == plain.find(*c) == huge.find(*c)
    assert sum(grid.find(*c) is not None for c in grid.index.coords.tolist()) == 258


# --------------------------------------------------------------------------- naming generations, scales not exported


def _mcns_scale(dvid_data, k: int):
    from dvidshards.formats.multiscale import parse_multiscale

    return parse_multiscale(json.loads((dvid_data / "mcns-ng-specs.json").read_text()))[k]


@pytest.mark.parametrize("kind", ["sample", "listing", "probe"])
def test_scale_naming_from_a_sample_a_listing_or_existence_probes(dvid_data, kind):
    """A local folder gives a sample, an object store a listing, an http server neither: each decides."""
    from dvidshards.errors import SpecError
    from dvidshards.scalefiles import scale_naming
    from dvidshards.stores import MemoryStore
    from dvidshards.stores.base import drive

    class Store(MemoryStore):
        async def sample(self, prefix, n):
            return await super().sample(prefix, n) if kind == "sample" else None

        async def list(self, prefix=""):
            if kind == "probe":
                raise SpecError("cannot list")
            return await super().list(prefix)

    s9 = _mcns_scale(dvid_data, 9)
    old = Store({"s9/0_0_0.arrow": b"", "s9/0_0_256.arrow": b"", "s0/0_0_0.arrow": b""})
    new = Store({"s9/0_0_0.arrow": b""})
    naming, seen = drive(scale_naming(old, s9))
    assert naming == "old" and seen == (None if kind == "probe" else [(0, 0, 0), (0, 0, 256)])
    assert drive(scale_naming(new, s9))[0] is None  # one file that fits both: read as today's DVID names it
    assert drive(scale_naming(old, _mcns_scale(dvid_data, 0))) == (None, None)  # the namings agree: nothing listed
    assert drive(scale_naming(new, s9, origins=[(0, 0, 0), (0, 0, 256)]))[0] == "old"  # a consolidated index's


def test_messages_of_scales_not_exported_and_files_off_both_grids(dvid_data):
    from dvidshards.errors import NotExportedError, SpecError
    from dvidshards.scalefiles import check_origins, not_exported_error, scales_phrase
    from dvidshards.stores import MemoryStore

    assert [scales_phrase(h) for h in ([0], [0, 1], range(4), [0, 1, 2, 3, 4, 5, 6, 10, 11], [], [1, 3, 4, 5, 9])] == \
        ["s0", "s0, s1", "s0-s3", "s0-s6, s10, s11", "no scale", "s1, s3-s5, s9"]
    st = MemoryStore({}, name="exp")
    e = not_exported_error(st, 2, [0])
    assert isinstance(e, NotExportedError) and isinstance(e, SpecError)
    assert str(e) == ("scale 2 is not exported in memory://exp/ (it has no folder s2; it holds s0); make it with: "
                      "dvidshards downsample memory://exp/ DEST")
    s9 = _mcns_scale(dvid_data, 9)
    check_origins(s9.with_naming("old"), [(0, 0, 0), (0, 0, 256)], st)
    with pytest.raises(SpecError, match=r"0_0_256.arrow: this shard file is not on the shard grid of the spec \(scale "
                                        r"9: shards of 320 voxels, or 256 voxels as DVID named files before "
                                        r"2026-03-21\)"):
        check_origins(s9, [(0, 0, 0), (0, 0, 256)], st)


# --- a consolidated index that is stale, or absent; a shard without its index file -------------------


SHARD1 = [[128, 0, 0], [256, 64, 64]]  # inside shard s0/128_0_0


@pytest.mark.parametrize("fill", [False, True])
def test_a_shard_put_back_after_consolidate_is_a_stale_index(three_shards, tmp_path, fill):
    root = copy_export(three_shards, tmp_path)
    aside = tmp_path / "aside"
    aside.mkdir()
    for p in (root / "s0").glob("128_0_0.*"):
        shutil.move(p, aside / p.name)
    idx = consolidate(root, tmp_path / "idx", three_shards.spec)
    for p in aside.iterdir():
        shutil.move(p, root / "s0" / p.name)
    with pytest.raises(ChunkIndexError, match="stale") as e:  # at open: the folder is listed
        ts_read(dvidshards.open(root, spec=three_shards.spec, index=idx, fill_missing_shards=fill), SHARD1)
    assert "consolidate" in str(e.value) and "128_0_0" in str(e.value)
    with pytest.raises(ChunkIndexError, match="stale"):
        Dataset(root, spec=three_shards.spec, index=idx).read(SHARD1, fill_missing_shards=fill)
    # without the index the region reads exactly
    np.testing.assert_array_equal(Dataset(root, spec=three_shards.spec).read(SHARD1), crop(three_shards, SHARD1))


def test_a_shard_absent_at_consolidate_and_still_absent_is_missing(three_shards, tmp_path):
    root = copy_export(three_shards, tmp_path)
    for p in (root / "s0").glob("128_0_0.*"):
        p.unlink()
    idx = consolidate(root, tmp_path / "idx", three_shards.spec)
    with pytest.raises(MissingShardError, match="128_0_0"):
        ts_read(dvidshards.open(root, spec=three_shards.spec, index=idx), SHARD1)
    got = ts_read(dvidshards.open(root, spec=three_shards.spec, index=idx, fill_missing_shards=True), SHARD1)
    assert not got.any()


def test_a_shard_changed_after_consolidate_is_a_stale_index(three_shards, tmp_path):
    root = copy_export(three_shards, tmp_path)
    idx = consolidate(root, tmp_path / "idx", three_shards.spec)
    import pyarrow as pa

    from dvidshards.writer import write_shard

    arrow = (root / "s0" / "128_0_0.arrow").read_bytes()
    recs = []
    for b in pa.ipc.open_stream(pa.py_buffer(arrow)):
        d = b.to_pydict()
        recs += [{k: d[k][i] for k in d} for i in range(b.num_rows)]
    write_shard(root / "s0" / "128_0_0", recs, batch_size=2)  # same records, other layout and size
    with pytest.raises(ChunkIndexError, match="stale") as e:
        ts_read(dvidshards.open(root, spec=three_shards.spec, index=idx), SHARD1)
    assert "consolidate" in str(e.value)


def test_an_index_folder_that_does_not_exist_is_an_error(three_shards):
    with pytest.raises(DvidShardsError, match="no/such/folder"):
        vol = dvidshards.open(three_shards.root, spec=three_shards.spec, index="no/such/folder")
        ts_read(vol, SHARD1)


@pytest.mark.parametrize("with_spec", [True, False])
def test_a_shard_that_appeared_since_consolidate_is_a_stale_index(three_shards, tmp_path, with_spec):
    import warnings

    from dvidshards.errors import GeometryWarning

    root = copy_export(three_shards, tmp_path)
    aside = tmp_path / "aside"
    aside.mkdir()
    for p in (root / "s0").glob("128_0_0.*"):
        shutil.move(p, aside / p.name)
    spec = three_shards.spec if with_spec else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GeometryWarning)  # consolidating without a spec: geometry guessed
        idx = consolidate(root, tmp_path / "idx", spec)
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


def test_a_shard_gone_since_consolidate_is_a_stale_index(three_shards, tmp_path):
    root = copy_export(three_shards, tmp_path)
    idx = consolidate(root, tmp_path / "idx", three_shards.spec)
    for p in (root / "s0").glob("256_0_0.*"):
        p.unlink()
    with pytest.raises(ChunkIndexError, match="stale: .*256_0_0.arrow is gone"):
        dvidshards.open(root, spec=three_shards.spec, index=idx)


def test_an_index_written_without_a_spec_opens_with_the_geometry_it_was_written_with(three_shards, tmp_path):
    import warnings

    from dvidshards.errors import GeometryWarning

    root = copy_export(three_shards, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GeometryWarning)
        guessed = Dataset(root)
        idx = consolidate(root, tmp_path / "idx")
    ds = Dataset(root, index=idx)
    assert ds.spec is None  # guessed geometry is never passed off as a spec
    for a, b in zip(ds.scales, guessed.scales, strict=True):
        assert (a.size, a.shard_extent, a.resolution, a.inferred, a.proven_extent) == \
            (b.size, b.shard_extent, b.resolution, b.inferred, b.proven_extent)
    box = [[0, 0, 0], list(THREE_SHARDS)]
    np.testing.assert_array_equal(ds.read(box), three_shards.expected(0))


def test_reads_of_absent_shards_do_not_ask_the_store_about_each(three_shards, tmp_path):
    """With an index and a listable store, the folder is listed once; absent shards cost no request."""
    from dvidshards.stores import MemoryStore

    root = copy_export(three_shards, tmp_path)
    for p in (root / "s0").glob("128_0_0.*"):
        p.unlink()
    idx = consolidate(root, tmp_path / "idx", three_shards.spec)

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
    vol = dvidshards.open(store, spec=three_shards.spec, index=idx, fill_missing_shards=True)
    got = vol.read(order="F").result()
    want = three_shards.expected(0).copy()
    want[128:256] = 0
    np.testing.assert_array_equal(got, want)
    assert store.calls["exists"] == 0 and store.calls["list"] == 1, store.calls


@pytest.fixture(scope="module")
def served(three_shards):
    with RangeServer(Path(three_shards.root)) as srv:
        yield srv


def test_http_open_uses_the_consolidated_index(three_shards, served, tmp_path):
    idx = consolidate(three_shards.root, tmp_path / "idx", three_shards.spec)
    served.reset_counts()
    vol = dvidshards.open(served.url, spec=three_shards.spec, index=idx)
    box = [[0, 0, 0], [300, 100, 70]]
    np.testing.assert_array_equal(ts_read(vol, box), crop(three_shards, box))
    csv = [p for p in served.requests if p.endswith(".csv")]
    assert not csv, f"the shards' own indexes were fetched although index= was given: {csv}"


@pytest.mark.parametrize("policy", [None, "lazy"])
def test_a_shard_without_its_csv_reads_exactly_with_a_warning(three_shards, tmp_path, policy):
    root = copy_export(three_shards, tmp_path)
    (root / "s0" / "0_0_0.csv").unlink()
    ds = Dataset(root, spec=three_shards.spec, policy=policy)
    box = [[0, 0, 0], [128, 100, 70]]
    with pytest.warns(IndexRebuiltWarning, match="0_0_0"):
        got = ds.read(box)
    np.testing.assert_array_equal(got, crop(three_shards, box))
    files = {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    with pytest.warns(IndexRebuiltWarning):
        got = ts_read(Dataset(MemoryStore(files), spec=three_shards.spec, policy=policy).open(0), box)
    np.testing.assert_array_equal(got, crop(three_shards, box))
    assert not (root / "s0" / "0_0_0.csv").exists()  # nothing written into the export


def _with_footer(arrow: bytes, footer: dict) -> bytes:
    """A variant D shard's bytes with its CHUNKIDX footer replaced."""
    n = struct.unpack("<Q", arrow[-16:-8])[0]
    body = arrow[:len(arrow) - 16 - n]
    blob = json.dumps(footer, ensure_ascii=False).encode()
    return body + blob + struct.pack("<Q", len(blob)) + b"CHUNKIDX"


@pytest.mark.parametrize("key", ["²_0_0", "0_٣_0", "0_0_0x"])
def test_a_chunkidx_key_with_a_non_ascii_digit_is_a_chunk_index_error(three_shards, tmp_path, key):
    from dvidshards.writer import write_shard

    root = copy_export(three_shards, tmp_path)
    recs = shard_records((root / "s0" / "0_0_0.arrow").read_bytes())
    for p in (root / "s0").glob("0_0_0.*"):
        p.unlink()
    write_shard(root / "s0" / "0_0_0", recs, index="D")
    arrow = root / "s0" / "0_0_0.arrow"
    arrow.write_bytes(_with_footer(arrow.read_bytes(), {key: 0}))
    for policy in ("eager", "lazy"):
        ds = Dataset(root, spec=three_shards.spec, policy=policy)
        with pytest.raises(ChunkIndexError, match="CHUNKIDX") as e:
            ds.read([[0, 0, 0], [64, 64, 64]])
        assert "0_0_0.arrow" in str(e.value)
