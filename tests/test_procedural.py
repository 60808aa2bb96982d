"""The procedural mCNS export: geometry, listing, file bytes, pure-function contents, pickling."""

from __future__ import annotations

import ast
import json
import pickle
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import zstandard

import dvidshards
from dvidshards import Dataset, SpecError
from dvidshards.errors import MissingShardError
from dvidshards.formats.multiscale import parse_multiscale
from dvidshards.stores.base import ByteStore, PastEndError
from dvidshards.writer import RECORD_SCHEMA, write_shard
from tests.support.procedural import MCNS_SIZE, ProceduralStore, mcns_spec

MCNS_SHARDS = 46 * 39 * 66  # the s0 shard grid: 118,404 slots


@pytest.fixture(scope="module")
def full() -> ProceduralStore:
    """The full-size mCNS export (seed 0)."""
    return ProceduralStore()


@pytest.fixture(scope="module")
def small() -> ProceduralStore:
    """The same shape, 8x smaller: the same shard grid with at most 64 chunks per shard."""
    return ProceduralStore(shrink=8, seed=1)


def _key(scale, origin, ext="arrow") -> str:
    return f"s{scale}/{origin[0]}_{origin[1]}_{origin[2]}.{ext}"


def _shard_with(store, scale, lo, hi, start=0):
    """The first shard (from index start) holding between lo and hi chunks."""
    origins = store.shard_origins(scale)
    for o in origins[start:] + origins[:start]:
        if lo <= len(store.shard_chunks(scale, o)) <= hi:
            return o
    raise AssertionError(f"no shard with {lo}..{hi} chunks")


class _Only(ByteStore):
    """A view of a store showing one scale folder with only some of its shards (to verify a sample)."""

    immediate = True

    def __init__(self, inner: ByteStore, scale: int, origins):
        self.inner, self.folder = inner, f"s{scale}"
        self.names = {_key(scale, o, e).split("/")[1] for o in origins for e in ("arrow", "csv")}

    def describe(self, key):
        return self.inner.describe(key)

    def _shown(self, key: str) -> bool:
        folder, _, name = key.strip("/").partition("/")
        return folder == self.folder and (not name or name in self.names)

    async def read(self, key, start=None, stop=None):
        if not self._shown(key):
            raise MissingShardError(f"{self.describe(key)}: hidden")
        return await self.inner.read(key, start, stop)

    async def exists(self, key):
        return key.strip("/") == "" or (self._shown(key) and await self.inner.exists(key))

    async def list(self, prefix=""):
        p = prefix.strip("/")
        if p == "":
            return [self.folder]
        return sorted(n for n in await self.inner.list(p) if n in self.names) if p == self.folder else []

    async def stat(self, key):
        if not self._shown(key):
            raise MissingShardError(f"{self.describe(key)}: hidden")
        return await self.inner.stat(key)


# --- geometry -------------------------------------------------------------------------------------


def test_spec_equals_the_real_mcns_spec(dvid_data):
    real = json.loads((dvid_data / "mcns-ng-specs.json").read_text())
    spec = mcns_spec()
    assert spec == real
    assert json.dumps(spec) == json.dumps(real)  # same key order too


def test_shrunk_spec_keeps_the_shard_grid():
    for shrink in (1, 2, 8):
        s0 = parse_multiscale(mcns_spec(shrink))[0]
        assert s0.size == tuple(-(-n // shrink) for n in MCNS_SIZE)
        assert s0.shard_chunks == 32 // shrink
        assert tuple(-(-g // s0.shard_chunks) for g in s0.grid) == (46, 39, 66)
        assert len(mcns_spec(shrink)["scales"]) == 12
    with pytest.raises(dvidshards.SpecError):
        mcns_spec(3)


def test_root_lists_twelve_scales_and_no_info(full):
    assert sorted(full.list_sync(""), key=lambda n: int(n[1:])) == [f"s{k}" for k in range(12)]
    assert not full.exists_sync("info")
    assert full.exists_sync("s11") and not full.exists_sync("s12")
    assert full.list_sync("s12") == [] and full.list_sync("nothing") == []


def test_s0_lists_about_26000_shards(full):
    store = ProceduralStore()  # cold caches
    names = store.list_sync("s0")
    # cheap: from the shard grid's mask alone, no shard's chunks planned, no CSV or record batch built
    assert set(store._masks) == {0} and not store._plans._d and not store._csvs._d and store._batches._bytes == 0
    arrows = [n for n in names if n.endswith(".arrow")]
    assert 25_000 <= len(arrows) <= 27_500, len(arrows)
    assert len(names) == 2 * len(arrows)
    assert names == sorted(names)
    assert {n[:-4] for n in names if n.endswith(".csv")} == {n[:-6] for n in arrows}
    # coarser scales: fewer shards, one from s6 on
    counts = [len(full.shard_origins(k)) for k in range(12)]
    assert counts == sorted(counts, reverse=True) and counts[6:] == [1] * 6
    assert dvidshards.Dataset(full, spec=full.spec).shards(0) == full.shard_origins(0)


@pytest.mark.slow
def test_chunks_per_shard_on_a_sample(full):
    origins = full.shard_origins(0)
    rng = np.random.default_rng(5)
    counts = np.array([len(full.shard_chunks(0, origins[i])) for i in rng.choice(len(origins), 300, replace=False)])
    assert 21_000 <= counts.mean() <= 24_500, counts.mean()
    assert counts.max() == 32 * 32 * 32
    assert counts.min() < 5_000  # boundary shards
    assert 0.2 < (counts == 32768).mean() < 0.7


def test_coarse_chunks_exist_iff_a_child_does(full):
    rng = np.random.default_rng(2)
    for scale in (1, 2):
        o = full.shard_origins(scale)[len(full.shard_origins(scale)) // 3]
        lo = np.asarray(o) // 64
        box = [(lo[a], min(lo[a] + 32, full.scales[scale].grid[a])) for a in range(3)]
        for _ in range(40):
            c = [int(rng.integers(a, b)) for a, b in box]
            kids = [full.chunk_present(0, *(np.asarray(c) * 2**scale + d))
                    for d in np.ndindex(*(2**scale,) * 3)]
            assert full.chunk_present(scale, *c) == any(kids), (scale, c)


# --- files ----------------------------------------------------------------------------------------


def test_csv_index_is_cheap_and_builds_no_arrow(full):
    store = ProceduralStore()  # cold caches
    o = _shard_with(store, 0, 32768, 32768, start=len(store.shard_origins(0)) // 2)
    store = ProceduralStore()
    text = bytes(store.read_sync(_key(0, o, "csv")))
    assert store._batches._bytes == 0  # cheap: not one record batch was built (no wall-clock bound)
    lines = text.decode().splitlines()
    assert lines[0] == f"# schema_size={len(RECORD_SCHEMA.serialize())}"
    assert lines[1] == "x,y,z,offset,size,batch_idx" and len(lines) == 2 + 32768
    rows = np.array([[int(v) for v in ln.split(",")] for ln in lines[2:]])
    assert (rows[:, 5] == np.arange(32768) % 256).all()
    assert store.stat_sync(_key(0, o)).size == rows[-1, 3] + rows[-1, 4] + 8  # + end-of-stream


def test_shard_bytes_equal_what_the_writer_writes(full, tmp_path):
    o = _shard_with(full, 0, 300, 1000)  # 2-4 record batches
    data = full.read_sync(_key(0, o))
    table = pa.ipc.open_stream(pa.py_buffer(data)).read_all()
    assert table.schema.equals(RECORD_SCHEMA, check_metadata=True)
    info = write_shard(tmp_path / "x", table.to_pylist(), batch_size=256)
    assert (tmp_path / "x.arrow").read_bytes() == bytes(data)
    assert (tmp_path / "x.csv").read_bytes() == bytes(full.read_sync(_key(0, o, "csv")))
    assert info["num_batches"] > 1
    # DVID's payloads: zstd frames with content size and checksum
    d = zstandard.ZstdDecompressor()
    for i in range(0, table.num_rows, 37):
        blob = table["dvid_compressed_block"][i].as_py()
        fp = zstandard.get_frame_parameters(blob)
        assert fp.has_checksum and fp.content_size == table["uncompressed_size"][i].as_py()
        assert len(d.decompress(blob)) == fp.content_size


def test_byte_ranges_stat_and_errors(full):
    o = _shard_with(full, 0, 300, 1000)
    key = _key(0, o)
    whole = np.asarray(full.read_sync(key)).tobytes()
    st = full.stat_sync(key)
    assert st.size == len(whole) and st.stamp == ProceduralStore().stat_sync(key).stamp
    rng = np.random.default_rng(0)
    for _ in range(30):
        a, b = sorted(int(v) for v in rng.integers(0, len(whole) + 1, 2))
        assert np.asarray(full.read_sync(key, a, b)).tobytes() == whole[a:b]
    assert np.asarray(full.read_sync(key, -100)).tobytes() == whole[-100:]
    got = full._sync(full.read_ranges(key, [(0, 10), (len(whole) - 10, len(whole))]))
    assert [bytes(g) for g in got] == [whole[:10], whole[-10:]]
    with pytest.raises(PastEndError) as e:
        full.read_sync(key, 0, len(whole) + 1)
    assert e.value.total_size == len(whole)
    absent = next((x, y, z) for z in range(0, 66 * 2048, 2048) for y in range(0, 39 * 2048, 2048)
                  for x in range(0, 46 * 2048, 2048) if not full.shard_mask(0)[z // 2048, y // 2048, x // 2048])
    for k in (_key(0, absent), _key(0, absent, "csv"), _key(0, (1, 0, 0)), _key(12, (0, 0, 0)), "s0/junk.arrow"):
        with pytest.raises(MissingShardError):
            full.read_sync(k)
        with pytest.raises(MissingShardError):
            full.stat_sync(k)
        assert not full.exists_sync(k)


def test_concurrent_reads_agree():
    store = ProceduralStore(cache_bytes=1 << 20)  # a small cache: batches are rebuilt and evicted
    o = _shard_with(store, 0, 600, 1500)
    key = _key(0, o)
    whole = np.asarray(store.read_sync(key)).tobytes()
    n = len(whole)
    ranges = [(i * n // 16, (i + 3) * n // 16) for i in range(13)]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda r: np.asarray(store.read_sync(key, *r)).tobytes(), ranges * 3))
    assert got == [whole[a:b] for a, b in ranges * 3]


def test_pickles_small(full, small):
    for store in (full, small):
        blob = pickle.dumps(store)
        assert len(blob) < 400, len(blob)
        back = pickle.loads(blob)
        assert back == store and back.describe("s0") == store.describe("s0")
        o = store.shard_origins(3)[0]
        assert bytes(back.read_sync(_key(3, o, "csv"))) == bytes(store.read_sync(_key(3, o, "csv")))
    assert ProceduralStore(seed=2) != full


# --- contents -------------------------------------------------------------------------------------


def test_sampled_shards_pass_verify(small, full):
    rng = np.random.default_rng(3)
    origins = small.shard_origins(0)
    sample = [origins[i] for i in rng.choice(len(origins), 12, replace=False)]
    report = dvidshards.verify(_Only(small, 0, sample), spec=small.spec, scale=0, decode=True)
    assert report.ok, report.summary()
    assert report.shards == 12 and report.decoded == sum(len(small.shard_chunks(0, o)) for o in sample)
    # a full-size s0 shard and a coarse one
    o = _shard_with(full, 0, 800, 2500, start=7000)
    report = dvidshards.verify(_Only(full, 0, [o]), spec=full.spec, scale=0, decode=True)
    assert report.ok and report.decoded == len(full.shard_chunks(0, o)), report.summary()
    report = dvidshards.verify(small, spec=small.spec, scale=4, decode=True)
    assert report.ok and report.shards == len(small.shard_origins(4)), report.summary()


@pytest.mark.parametrize("which, scale", [("small", 0), ("full", 0), ("full", 1), ("full", 5)])
def test_reads_equal_the_pure_function(which, scale, request):
    store = request.getfixturevalue(which)
    sv = dvidshards.open(store, spec=store.spec, scale=scale, labels="supervoxels")
    ag = dvidshards.open(store, spec=store.spec, scale=scale)
    rng = np.random.default_rng(scale)
    origins = store.shard_origins(scale)
    size = store.scales[scale].size
    checked = 0
    for i in rng.choice(len(origins), min(3, len(origins)), replace=False):
        coords = store.shard_chunks(scale, origins[i])
        for c in coords[rng.choice(len(coords), min(3, len(coords)), replace=False)]:
            x, y, z = (int(v) for v in c)
            want = store.chunk_volume(scale, x, y, z).T  # (x, y, z)
            sl = tuple(slice(64 * v, min(64 * v + 64, n)) for v, n in zip((x, y, z), size, strict=True))
            want = want[: sl[0].stop - sl[0].start, : sl[1].stop - sl[1].start, : sl[2].stop - sl[2].start]
            np.testing.assert_array_equal(sv[sl].read(order="F").result(), want)
            np.testing.assert_array_equal(ag[sl].read(order="F").result(), store.body_of(want))
            svs, labels = store.chunk_labels(scale, x, y, z)
            assert set(np.unique(want)) == set(svs) and (labels == store.body_of(svs)).all()
            checked += 1
    assert checked >= 3
    # a box across shard boundaries, absent chunks included
    s = store.scales[scale]
    e = min(s.shard_extent, 1 << 30)
    mid = [min(n - 40, (n // 2) // e * e) if n > 80 else n // 2 for n in size]
    lo, hi = [max(0, m - 40) for m in mid], [min(n, m + 40) for m, n in zip(mid, size, strict=True)]
    got = sv[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]].read(order="F").result()
    want = np.zeros_like(got)
    for cx in range(lo[0] // 64, -(-hi[0] // 64)):
        for cy in range(lo[1] // 64, -(-hi[1] // 64)):
            for cz in range(lo[2] // 64, -(-hi[2] // 64)):
                v = store.chunk_volume(scale, cx, cy, cz).T
                a = [max(lo[0], 64 * cx), max(lo[1], 64 * cy), max(lo[2], 64 * cz)]
                b = [min(hi[0], 64 * cx + 64), min(hi[1], 64 * cy + 64), min(hi[2], 64 * cz + 64)]
                want[a[0] - lo[0]:b[0] - lo[0], a[1] - lo[1]:b[1] - lo[1], a[2] - lo[2]:b[2] - lo[2]] = \
                    v[a[0] - 64 * cx:b[0] - 64 * cx, a[1] - 64 * cy:b[1] - 64 * cy, a[2] - 64 * cz:b[2] - 64 * cz]
    np.testing.assert_array_equal(got, want)


def test_labels_are_realistic(full):
    o = _shard_with(full, 0, 32768, 32768, start=len(full.shard_origins(0)) // 2)
    coords = full.shard_chunks(0, o)
    rng = np.random.default_rng(4)
    k = np.array([len(full.chunk_labels(0, *c)[0]) for c in coords[rng.choice(len(coords), 300, replace=False)]])
    assert k.min() >= 1 and k.max() <= 105 and 9 <= np.median(k) <= 20


def test_mapping_is_a_pure_agglomeration(small):
    a, b = small.shard_origins(0)[100], None
    e = small.scales[0].shard_extent
    for nb in small.shard_origins(0)[101:]:
        if nb[1:] == a[1:] and nb[0] == a[0] + e:
            b = nb
            break
    assert b is not None

    def ids(o):
        t = pa.ipc.open_stream(pa.py_buffer(small.read_sync(_key(0, o)))).read_all()
        return (np.concatenate(t["supervoxels"].to_numpy(zero_copy_only=False)),
                np.concatenate(t["labels"].to_numpy(zero_copy_only=False)))

    sa, la = ids(a)
    sb, lb = ids(b)
    np.testing.assert_array_equal(la, small.body_of(sa))
    assert set(sa) & set(sb) and set(la) & set(lb)  # supervoxels and bodies span shards
    svs = np.unique(np.concatenate([sa, sb]))
    bodies = small.body_of(svs)
    assert small.body_of(np.uint64(0)) == 0 and (bodies[svs != 0] != 0).all()
    np.testing.assert_array_equal(small.body_of(bodies), bodies)  # a body id is its anchor supervoxel's
    n_sv = np.unique(bodies[svs != 0], return_counts=True)[1]
    assert n_sv.max() >= 4 and (n_sv == 1).any()  # large bodies and singletons
    assert svs.max() <= 2**46 + 1
    m = small.mapping(svs)
    assert m.shape == (len(svs) - (svs[0] == 0), 2) and (m[:, 1] == small.body_of(m[:, 0])).all()
    huge = np.array([2**50, 2**63 + 5], np.uint64)
    np.testing.assert_array_equal(small.body_of(huge), huge)


def test_seed_changes_ids_not_presence(small):
    other = ProceduralStore(shrink=8, seed=2)
    assert other.shard_origins(0) == small.shard_origins(0)
    o = small.shard_origins(0)[500]
    np.testing.assert_array_equal(other.shard_chunks(0, o), small.shard_chunks(0, o))
    c = small.shard_chunks(0, o)[0]
    assert set(small.chunk_labels(0, *c)[0]) != set(other.chunk_labels(0, *c)[0])


def test_module_imports_only_what_it_may():
    import tests.support.procedural as mod

    tree = ast.parse(Path(mod.__file__).read_text())
    third = {"numpy", "numba", "pyarrow", "zstandard", "tensorstore", "tqdm"}
    stdlib = {"__future__", "hashlib", "json", "math", "re", "statistics", "threading", "collections"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                assert a.name.split(".")[0] in third | stdlib, a.name
        elif isinstance(node, ast.ImportFrom):
            parts = (node.module or "").split(".")
            if parts[0] == "dvidshards":  # the package's lower layers only: no reader, dataset or job
                assert not node.level and parts[1] in {"errors", "formats", "stores", "writer"}, node.module
            else:
                assert not node.level and parts[0] in third | stdlib, node.module


# --- slow -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_full_shard_of_32768_chunks_verifies():
    store = ProceduralStore()
    o = _shard_with(store, 0, 32768, 32768, start=len(store.shard_origins(0)) // 2)
    csv = bytes(store.read_sync(_key(0, o, "csv")))
    assert store._batches._bytes == 0  # the index needs no record batch
    data = store.read_sync(_key(0, o))
    assert len(data) == store.stat_sync(_key(0, o)).size and csv.count(b"\n") == 32768 + 2
    del data
    report = dvidshards.verify(_Only(store, 0, [o]), spec=store.spec, scale=0, decode=True)
    assert report.ok and report.decoded == 32768, report.summary()


# --- a spec of larger shards over the procedural mCNS export -----------------------------------------


def test_mcns_sized_export_opened_with_larger_shards_fails_at_the_first_read():
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
