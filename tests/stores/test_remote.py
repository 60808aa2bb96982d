"""Remote exports: byte-range reads through TensorStore kvstores, against servers on 127.0.0.1.

An S3 server (moto), a Google Cloud Storage emulator and a small HTTP server with Range support
and fault injection are started here; every remote read is compared with the same read of the
local files.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import tensorstore as ts

import dvidshards
from dvidshards import ChunkIndexError, MissingShardError, RemoteReadError, SpecError
from dvidshards.dataset import Dataset
from dvidshards.demo.neurons import neuron_volume
from dvidshards.formats.labels import Agglomerated
from dvidshards.read import ChunkReader
from dvidshards.stores import run_sync
from dvidshards.stores.kvstore import KvStore
from dvidshards.writer import write_export
from tests.support.servers import FakeGCS, MotoS3, RangeServer

REAL = "30720_24576_28672"
BUCKET = "dvid-exports"
# TensorStore's own http retries, short, for the fault tests
FAST_TS = {"http_request_retries": {"max_retries": 2, "initial_delay": "5ms", "max_delay": "20ms"}}


def _read(store) -> np.ndarray:
    return store.read(order="F").result(timeout=60)


# --- data and servers -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Everything the servers publish: a synthetic export, index variants, a damaged copy."""
    root = tmp_path_factory.mktemp("remote")
    vol, mapping = neuron_volume((200, 150, 170), seed=11)
    write_export(vol, root / "synth", mapping=mapping, scales=2, shard_chunks=2, batch_size=3, index="A", info=True)
    small, smap = neuron_volume((130, 100, 140), seed=5)
    for name, index, container, bs in [("B", "B", "stream", 1), ("Cstream", "C", "stream", 2),
                                       ("Cfile", "C", "file", 2), ("D1", "D", "file", 1), ("D3", "D", "file", 3)]:
        write_export(small, root / name, mapping=smap, scales=2, shard_chunks=2, batch_size=bs, index=index,
                     container=container, info=True)
    # the synthetic export without its info file (geometry must then be listed/inferred)
    shutil.copytree(root / "synth", root / "noinfo")
    (root / "noinfo" / "info").unlink()
    return root


@pytest.fixture(scope="module")
def mcns_root(tmp_path_factory, dvid_data) -> Path:
    """The real mCNS shard as scale 1 of three exports, one per CSV variant (A, B, C)."""
    root = tmp_path_factory.mktemp("mcns")
    for name, csv in [("mcnsA", f"{REAL}-newformat.csv"), ("mcnsB", f"{REAL}-offsets.csv"), ("mcnsC", f"{REAL}.csv")]:
        (root / name / "s1").mkdir(parents=True)
        os.symlink(dvid_data / f"{REAL}.arrow", root / name / "s1" / f"{REAL}.arrow")
        shutil.copyfile(dvid_data / csv, root / name / "s1" / f"{REAL}.csv")
    return root


@pytest.fixture(scope="module")
def http(root, mcns_root):
    both = root.parent / f"{root.name}-served"
    both.mkdir(exist_ok=True)
    for d in list(root.iterdir()) + list(mcns_root.iterdir()):
        if not (both / d.name).exists():
            os.symlink(d, both / d.name)
    with RangeServer(both, seed=7) as srv:
        yield srv


@pytest.fixture
def server(http, monkeypatch):
    """The http server with clean counters and no faults, and a patient chunk gatherer: a shard's
    burst of chunk requests is gathered until none came for WINDOW (the reader's own: 1 ms), so
    that a busy machine pausing a TensorStore thread does not split a burst the tests count as one."""
    monkeypatch.setattr(dvidshards.read, "WINDOW", 0.05)
    monkeypatch.setattr(dvidshards.read, "MAX_WAIT", 2.0)
    http.set_faults()
    http.reset_counts()
    yield http
    http.set_faults()


def _publish(server, root: Path, mcns_root: Path):
    """Upload the synthetic export, its copy without info and the real mCNS shard to a bucket server."""
    for local, prefix in ((root / "synth", "synth"), (root / "noinfo", "noinfo"), (mcns_root / "mcnsA", "mcns")):
        server.upload_dir(BUCKET, local, f"exports/{prefix}/")
    return server


@pytest.fixture(scope="module")
def s3(root, mcns_root):
    pytest.importorskip("moto.server")
    with MotoS3() as m:
        yield _publish(m, root, mcns_root)


@pytest.fixture(scope="module")
def gcs(root, mcns_root):
    pytest.importorskip("gcp_storage_emulator")
    with FakeGCS() as g:
        yield _publish(g, root, mcns_root)


@pytest.fixture(scope="module")
def mcns_spec(dvid_data) -> Path:
    return dvid_data / "mcns-ng-specs.json"


def _local(root: Path, name: str, **kw):
    return dvidshards.open(root / name, fill_missing_shards=True, **kw)


# --- S3 -------------------------------------------------------------------------------------------


def test_s3_spec_equals_local(root, s3):
    spec = s3.spec(BUCKET, "exports/synth")
    for scale in (0, 1):
        expect = _read(_local(root, "synth", scale=scale))
        got = _read(dvidshards.open(spec, scale=scale, fill_missing_shards=True))
        np.testing.assert_array_equal(got, expect)
    sv = dvidshards.open(spec, labels="supervoxels", fill_missing_shards=True)[40:170, 10:140, 64:160]
    np.testing.assert_array_equal(_read(sv), _read(_local(root, "synth", labels="supervoxels")[40:170, 10:140, 64:160]))
    svs = np.unique(_read(_local(root, "synth", labels="supervoxels")[0:128, 0:128, 0:128]))
    mapping = {int(v): 10**9 + k for k, v in enumerate(svs[1:4])}  # supervoxel -> body at read time
    m = _read(dvidshards.open(spec, labels=mapping, fill_missing_shards=True)[0:128, 0:128, 0:128])
    expect = _read(_local(root, "synth", labels=mapping)[0:128, 0:128, 0:128])
    assert (expect == 10**9).any()
    np.testing.assert_array_equal(m, expect)


def test_s3_url_equals_local(root, s3, monkeypatch):
    expect = _read(_local(root, "synth")[64:200, 0:150, 30:150])
    src = KvStore.from_url(f"s3://{BUCKET}/exports/synth", options={"endpoint": s3.endpoint})
    np.testing.assert_array_equal(_read(dvidshards.open(src, fill_missing_shards=True)[64:200, 0:150, 30:150]), expect)
    # a bare s3:// URL honours the AWS SDK endpoint variable
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3.endpoint)
    store = dvidshards.open(f"s3://{BUCKET}/exports/synth/", fill_missing_shards=True)
    np.testing.assert_array_equal(_read(store[64:200, 0:150, 30:150]), expect)


def test_s3_lists_and_infers_geometry(root, s3):
    src = KvStore(s3.spec(BUCKET, "exports/noinfo/"))
    assert src.list_sync("") == ["s0", "s1"]
    assert src.list_sync("s1") == sorted(os.listdir(root / "noinfo" / "s1"))
    ds, local = Dataset(src), Dataset(root / "noinfo")
    assert [s.size for s in ds.scales] == [s.size for s in local.scales]
    assert sorted(ds.shards(0)) == sorted(local.shards(0))


def test_s3_real_mcns_shard(mcns_root, s3, mcns_spec):
    spec = s3.spec(BUCKET, "exports/mcns/")
    box = np.s_[508 * 64:512 * 64, 413 * 64:415 * 64, 474 * 64:478 * 64]
    for labels in ("agglomerated", "supervoxels"):
        local = dvidshards.open(mcns_root / "mcnsA", scale=1, spec=mcns_spec, labels=labels)[box]
        remote = dvidshards.open(spec, scale=1, spec=mcns_spec, labels=labels)[box]
        expect = _read(local)
        assert np.count_nonzero(expect) > 0
        np.testing.assert_array_equal(_read(remote), expect)


# --- Google Cloud Storage (an emulator: gs:// URLs reach it through TensorStore's environment) ------


@pytest.mark.slow
def test_gcs_url_equals_local(root, gcs):
    url = f"gs://{BUCKET}/exports/synth/"
    for scale in (0, 1):
        np.testing.assert_array_equal(_read(dvidshards.open(url, scale=scale, fill_missing_shards=True)),
                                      _read(_local(root, "synth", scale=scale)))
    box = np.s_[40:170, 10:140, 64:160]
    np.testing.assert_array_equal(_read(dvidshards.open(gcs.spec(BUCKET, "exports/synth/"), labels="supervoxels",
                                                        fill_missing_shards=True)[box]),
                                  _read(_local(root, "synth", labels="supervoxels")[box]))
    ds = Dataset(url)
    assert ds.store.describe("s0/0_0_0.arrow") == f"gs://{BUCKET}/exports/synth/s0/0_0_0.arrow"
    with pytest.raises(MissingShardError, match=f"gs://{BUCKET}/exports/synth/s0/9999_0_0.arrow"):
        ds.store.read_sync("s0/9999_0_0.arrow")


@pytest.mark.slow
def test_gcs_lists_and_infers_geometry(root, gcs):
    ds, local = Dataset(f"gs://{BUCKET}/exports/noinfo"), Dataset(root / "noinfo")
    assert ds.store.list_sync("") == ["s0", "s1"]
    assert [s.size for s in ds.scales] == [s.size for s in local.scales]
    assert sorted(ds.shards(0)) == sorted(local.shards(0))


@pytest.mark.slow
def test_gcs_real_mcns_shard(mcns_root, gcs, mcns_spec):
    box = np.s_[508 * 64:512 * 64, 413 * 64:415 * 64, 474 * 64:478 * 64]
    for labels in ("agglomerated", "supervoxels"):
        expect = _read(dvidshards.open(mcns_root / "mcnsA", scale=1, spec=mcns_spec, labels=labels)[box])
        remote = dvidshards.open(f"gs://{BUCKET}/exports/mcns/", scale=1, spec=mcns_spec, labels=labels)[box]
        assert np.count_nonzero(expect) > 0
        np.testing.assert_array_equal(_read(remote), expect)


@pytest.mark.slow
def test_gcs_jobs_read_and_write_buckets(root, gcs):
    """stats over a gs:// export equals stats over the local files; convert writes into a bucket
    (TensorStore's conditional writes), its manifest says complete, and verify spot-checks it."""
    from dvidshards.jobs.convert import convert
    from dvidshards.jobs.stats import body_stats_table

    local = body_stats_table(root / "synth", scale=0, progress=False)
    remote = body_stats_table(f"gs://{BUCKET}/exports/synth", scale=0, progress=False)
    assert remote.num_rows > 5 and remote.select(local.column_names).equals(local)
    dest = f"gs://{BUCKET}/converted/synth"
    rep = convert(root / "synth", dest, format="precomputed", scheduler="serial", progress=False)
    assert rep.ok and rep.complete and rep.dest == dest
    out = ts.open({"driver": "neuroglancer_precomputed", "kvstore": dest}).result()
    np.testing.assert_array_equal(out.read().result()[..., 0], _read(_local(root, "synth")))
    report = dvidshards.verify(dest, spot_check=25)
    assert report.ok, report.summary()


# --- HTTP -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["synth", "B", "Cstream", "Cfile", "D1", "D3"])
def test_http_index_variants_equal_local(root, server, name):
    for scale, labels in ((0, "agglomerated"), (1, "supervoxels")):
        remote = dvidshards.open(server.url + name, scale=scale, labels=labels, fill_missing_shards=True)
        np.testing.assert_array_equal(_read(remote), _read(_local(root, name, scale=scale, labels=labels)))


@pytest.mark.parametrize("name", ["Cstream", "Cfile", "D1", "D3"])
def test_http_legacy_variants_exact_reads(root, server, monkeypatch, name):
    """Tiny speculative reads and scan windows: the exact-read fallbacks give the same volume."""
    import dvidshards.shard as remote

    monkeypatch.setattr(remote, "_HEAD", 16)
    monkeypatch.setattr(remote, "_TAIL", 24)
    monkeypatch.setattr(remote, "_HEADER_PROBE", 64)
    monkeypatch.setattr(remote, "_WINDOW", 512)
    monkeypatch.setattr(remote, "_WINDOW_MAX", 2048)
    remote_vol = _read(dvidshards.open(server.url + name, fill_missing_shards=True))
    np.testing.assert_array_equal(remote_vol, _read(_local(root, name)))
    ranges = {r for _, r in server.ranges}
    assert "bytes=0-15" in ranges  # the speculative head read
    if name == "Cstream":  # scanned in windows of 512, 1024, 2048, 2048, ... bytes
        sizes = {int(b) - int(a) + 1 for a, b in (r[6:].split("-") for r in ranges if r and r[6] != "-")}
        assert {512, 1024, 2048} <= sizes
    else:  # footers found with exact suffix reads
        assert "bytes=-24" in ranges and len([r for r in ranges if r and r.startswith("bytes=-")]) > 2


@pytest.mark.parametrize("name", ["mcnsB", "mcnsC"])
def test_http_real_shard_variants(mcns_root, server, mcns_spec, name):
    box = np.s_[509 * 64:512 * 64, 413 * 64:415 * 64, 475 * 64:477 * 64]
    local = dvidshards.open(mcns_root / name, scale=1, spec=mcns_spec)[box]
    remote = dvidshards.open(server.url + name, scale=1, spec=mcns_spec)[box]
    np.testing.assert_array_equal(_read(remote), _read(local))


def _csv_rows(path: Path) -> list[list[int]]:
    return [[int(v) for v in line.split(",")] for line in path.read_text().splitlines()[2:]]


def _probes(ranges, folder: str, shard: str) -> tuple[list, list]:
    """(existence probes of other shards' names, the other requests): the check of the
    spec looks, once, for shard files between the grid's origins next to the first shard."""
    probes = [r for r in ranges if r[1] == "bytes=0-0" and r[0].startswith(folder) and shard not in r[0]]
    return probes, [r for r in ranges if r not in probes]


def test_http_one_chunk_fetches_one_record_batch(root, server):
    """Index once, schema once, then only the record batches the read needs."""
    shard = max((root / "synth" / "s0").glob("*.arrow"), key=lambda p: p.stat().st_size)
    csv = shard.with_suffix(".csv")
    schema_size = int(csv.read_text().splitlines()[0].split("=")[1])
    rows = _csv_rows(csv)
    assert len({r[3] for r in rows}) > 2  # several record batches
    x, y, z, off, size, _ = rows[0]
    store = dvidshards.open(server.url + "synth", fill_missing_shards=True)
    server.reset_counts()
    box = np.s_[x * 64:x * 64 + 64, y * 64:y * 64 + 64, z * 64:z * 64 + 64]
    got = _read(store[box])
    np.testing.assert_array_equal(got, _read(_local(root, "synth")[box]))
    assert np.count_nonzero(got)
    key = f"synth/s0/{shard.stem}"
    probes, ranges = _probes(server.ranges, "synth/s0/", shard.stem)
    assert ranges == [(key + ".csv", None), (key + ".arrow", f"bytes=0-{schema_size - 1}"),
                      (key + ".arrow", f"bytes={off}-{off + size - 1}")]
    assert len(probes) <= 3 * 5  # one existence check per off-grid neighbour: names only, nothing found
    assert server.bytes_sent == csv.stat().st_size + schema_size + size
    assert server.bytes_sent < shard.stat().st_size / 2
    # every chunk of the shard in one read: one merged request, no index or schema again
    server.reset_counts()
    o = [int(v) for v in shard.stem.split("_")]
    _read(store[o[0]:o[0] + 128, o[1]:o[1] + 128, o[2]:o[2] + 128])
    lo, hi = min(r[3] for r in rows), max(r[3] + r[4] for r in rows)
    assert server.ranges == [(key + ".arrow", f"bytes={lo}-{hi - 1}")]


def test_http_whole_volume_requests(root, server):
    """Each shard: its CSV once, its schema once, its record batches in one merged request."""
    store = dvidshards.open(server.url + "synth", fill_missing_shards=True)
    np.testing.assert_array_equal(_read(store), _read(_local(root, "synth")))
    stems = sorted(p.stem for p in (root / "synth" / "s0").glob("*.arrow"))
    assert server.requests["synth/info"] == 1  # one read per open
    for stem in stems:
        assert server.requests[f"synth/s0/{stem}.csv"] == 1
        assert server.requests[f"synth/s0/{stem}.arrow"] == 2
    # a second pass reads only record batches
    server.reset_counts()
    _read(store)
    assert set(server.requests) == {f"synth/s0/{s}.arrow" for s in stems}
    # one merged request per shard; on a loaded machine a shard's burst of callbacks can arrive
    # in two parts (the planner gathers for at most MAX_WAIT), never more
    assert len(stems) <= server.total_requests <= len(stems) + 2
    assert all(server.requests[f"synth/s0/{s}.arrow"] <= 2 for s in stems)
    total = sum((root / "synth" / "s0" / f"{s}.arrow").stat().st_size for s in stems)
    assert server.bytes_sent <= total


def test_http_mcns_one_chunk_bytes(mcns_root, server, mcns_spec):
    rows = _csv_rows(mcns_root / "mcnsA" / "s1" / f"{REAL}.csv")
    x, y, z, off, size, _ = rows[100]
    store = dvidshards.open(server.url + "mcnsA", scale=1, spec=mcns_spec)
    server.reset_counts()
    sl = np.s_[x * 64:x * 64 + 64, y * 64:y * 64 + 64, z * 64:z * 64 + 64]
    np.testing.assert_array_equal(_read(store[sl]), _read(dvidshards.open(mcns_root / "mcnsA", scale=1,
                                                                          spec=mcns_spec)[sl]))
    csv_size = (mcns_root / "mcnsA" / "s1" / f"{REAL}.csv").stat().st_size
    probes, ranges = _probes(server.ranges, "mcnsA/s1/", REAL)
    assert len(ranges) == 3 and len(probes) <= 3 * 5  # and the spec's check: 15 names probed, none there
    assert server.bytes_sent == csv_size + 688 + size
    assert server.bytes_sent < 20_000 < (mcns_root / "mcnsA" / "s1" / f"{REAL}.arrow").stat().st_size


def test_http_faults_still_equal_local(root, server):
    expect = _read(_local(root, "synth"))
    server.set_faults(fail=0.15, drop=0.1, truncate=0.1)
    src = KvStore.from_url(server.url + "synth/", retries=6, backoff=0.005)  # one retry layer: the store's
    store = dvidshards.open(src, fill_missing_shards=True)
    np.testing.assert_array_equal(_read(store), expect)
    np.testing.assert_array_equal(_read(dvidshards.open(src, scale=1, fill_missing_shards=True)),
                                  _read(_local(root, "synth", scale=1)))
    assert server.faults["503"] and server.faults["drop"] and server.faults["truncate"]


@pytest.mark.parametrize("fault", ["fail", "truncate"])
def test_http_persistent_faults_raise(root, server, fault):
    """A server that always fails: 1 + retries requests reach it (TensorStore adds none of its own),
    then RemoteReadError naming the URL and the attempts."""
    spec = Dataset(root / "synth").spec
    src = KvStore.from_url(server.url + "synth/", retries=2, backoff=0.005)
    store = dvidshards.open(src, spec=spec, fill_missing_shards=True)
    server.set_faults(**{fault: 1.0})
    with pytest.raises(RemoteReadError) as e:
        _read(store[0:64, 0:64, 0:64])
    assert server.url + "synth/s0/0_0_0.csv" in str(e.value)
    # one retry layer: 1 + 2 attempts (other names: the spec's check, given up)
    assert server.requests["synth/s0/0_0_0.csv"] == 3
    assert "failed after 3 attempts" in str(e.value)
    with pytest.raises(RemoteReadError, match=r"synth/info"):
        Dataset(src)


def test_http_missing_shard(root, server):
    holes = root.parent / f"{root.name}-served" / "holes"
    if not holes.exists():
        shutil.copytree(root / "synth", holes)
        (holes / "s0" / "0_0_0.arrow").unlink()
        (holes / "s0" / "0_0_0.csv").unlink()
    with pytest.raises(MissingShardError, match=r"fill_missing_shards"):
        _read(dvidshards.open(server.url + "holes")[0:64, 0:64, 0:64])
    store = dvidshards.open(server.url + "holes", fill_missing_shards=True)
    got = _read(store[0:192, 0:150, 0:170])
    expect = _read(_local(root, "synth")[0:192, 0:150, 0:170])
    assert not got[:128, :128, :128].any() and expect[:128, :128, :128].any()
    np.testing.assert_array_equal(got[128:], expect[128:])


def test_http_source_api(root, server):
    src = KvStore.from_url(server.url + "synth")
    assert src.describe("s0/0_0_0.csv") == server.url + "synth/s0/0_0_0.csv"
    with pytest.raises(MissingShardError, match="nope"):
        src.read_sync("s0/nope.arrow", 0, 10)
    assert src.exists_sync("info") and not src.exists_sync("nope")
    with pytest.raises(SpecError, match="info"):
        src.list_sync("s0")
    with pytest.raises(SpecError, match="spec="):
        Dataset(server.url + "noinfo")
    data = (root / "synth" / "s0" / "0_0_0.arrow").read_bytes()
    assert src.read_sync("s0/0_0_0.arrow", 10, 1000) == data[10:1000]
    assert run_sync(src.read_ranges("s0/0_0_0.arrow", [(0, 8), (100, 300)])) == [data[:8], data[100:300]]
    with pytest.raises(dvidshards.ShardFormatError, match=r"bytes \[10, \d+\).*past the end"):
        src.read_sync("s0/0_0_0.arrow", 10, len(data) + 5)


def test_remote_shard_matches_local(root, server):
    from tests.support.exports import load_shard

    src = KvStore.from_url(server.url + "D3")
    for stem in ("s0/0_0_0", "s1/0_0_0"):
        remote, local = load_shard(None, stem, store=src), load_shard(root / "D3", stem)
        assert remote.policy == "lazy" and local.policy == "eager" and len(remote) == len(local) > 0
        np.testing.assert_array_equal(remote.coords, local.coords)
        np.testing.assert_array_equal(remote.index.msg_off, local.index.msg_off)
        rt, lt = remote.table(), local.table()
        for i in (0, len(local) - 1):
            assert rt.block(i) == lt.block(i)
            np.testing.assert_array_equal(rt.labels(i), lt.labels(i))
            np.testing.assert_array_equal(rt.supervoxels(i), lt.supervoxels(i))


# --- damaged exports ------------------------------------------------------------------------------


@pytest.fixture
def damaged(root, http):
    """A copy of the synthetic export served over http, for tests that edit it."""
    d = root.parent / f"{root.name}-served" / "damaged"
    if d.exists():
        shutil.rmtree(d)
    shutil.copytree(root / "synth", d)
    http.set_faults()
    http.reset_counts()
    return d


def test_record_coordinates_are_checked(damaged, http):
    csv = damaged / "s0" / "0_0_0.csv"
    lines = csv.read_text().splitlines()
    a, b = lines[2].split(","), lines[-1].split(",")
    assert a[3] != b[3]  # in different record batches
    lines[2], lines[-1] = ",".join(b[:3] + a[3:]), ",".join(a[:3] + b[3:])
    csv.write_text("\n".join(lines) + "\n")
    x, y, z = (int(v) for v in b[:3])
    with pytest.raises(ChunkIndexError, match=rf"damaged/s0/0_0_0.arrow.*index says chunk \({x}, {y}, {z}\)"):
        _read(dvidshards.open(http.url + "damaged", fill_missing_shards=True)[x * 64:x * 64 + 1, y * 64:y * 64 + 1,
                                                                              z * 64:z * 64 + 1])


def test_index_past_end_of_file(damaged, http):
    csv = damaged / "s0" / "0_0_0.csv"
    lines = csv.read_text().splitlines()
    f = lines[2].split(",")
    f[3] = str((damaged / "s0" / "0_0_0.arrow").stat().st_size + 100)
    lines[2] = ",".join(f)
    csv.write_text("\n".join(lines) + "\n")
    x, y, z = (int(v) for v in f[:3])
    with pytest.raises(ChunkIndexError, match=r"past the end of the file"):
        _read(dvidshards.open(http.url + "damaged", fill_missing_shards=True)[x * 64:x * 64 + 1, y * 64:y * 64 + 1,
                                                                              z * 64:z * 64 + 1])


def test_schema_size_mismatch(damaged, http):
    csv = damaged / "s0" / "0_0_0.csv"
    text = csv.read_text()
    n = int(text.splitlines()[0].split("=")[1])
    csv.write_text(text.replace(f"schema_size={n}", f"schema_size={n + 8}", 1))
    with pytest.raises(ChunkIndexError, match=rf"0_0_0.csv: schema_size={n + 8} but the schema message .* is {n} bytes"):
        _read(dvidshards.open(http.url + "damaged", fill_missing_shards=True)[0:64, 0:64, 0:64])


def test_chunk_outside_shard_box(damaged, http):
    csv = damaged / "s0" / "0_0_0.csv"
    lines = csv.read_text().splitlines()
    f = lines[2].split(",")
    f[0] = "5"  # shard 0_0_0 holds chunks 0..1 per axis
    lines[2] = ",".join(f)
    csv.write_text("\n".join(lines) + "\n")
    with pytest.raises(ChunkIndexError, match=r"outside the shard"):
        _read(dvidshards.open(http.url + "damaged", fill_missing_shards=True)[0:64, 0:64, 0:64])


# --- short reads (TensorStore already rejects truncated bodies; this is the second guard) --------


class _Result:
    def __init__(self, value: bytes):
        self.state, self.value = "value", value


class _LyingKv:
    """A kvstore whose reads come back short ``short`` times."""

    def __init__(self, data: bytes, short: int):
        self.data, self.short, self.calls = data, short, 0

    def read(self, key, byte_range=None, batch=None):
        self.calls += 1
        value = self.data[byte_range]
        if self.calls <= self.short:
            value = value[:-1]

        async def done():
            return _Result(value)
        return done()


def test_short_read_is_retried_never_returned():
    src = KvStore({"driver": "memory"}, retries=2, backoff=0.001)
    data = bytes(range(256)) * 4
    src._kv = _LyingKv(data, short=2)
    assert src.read_sync("k", 10, 300) == data[10:300]
    assert src._kv.calls == 3 and src.stats["retries"] == 2
    src._kv = _LyingKv(data, short=3)
    with pytest.raises(RemoteReadError, match=r"memory://k bytes \[10, 300\).*short read: 289 of 290"):
        src.read_sync("k", 10, 300)


# --- processes and event loops --------------------------------------------------------------------


def _spawn_read(blob: bytes) -> np.ndarray:
    store = pickle.loads(blob)
    return store[30:150, 20:140, 60:170].read(order="F").result(timeout=60)


@pytest.mark.slow
def test_pickle_into_spawn_process(root, server):
    src = KvStore.from_url(server.url + "synth")
    reader = ChunkReader(src, Dataset(src).scale(0), Agglomerated())
    assert reader.shard(0, 0, 0) is not None and reader.cache.loaded == 1
    copy = pickle.loads(pickle.dumps(reader))
    assert copy._state is None and copy.cache.loaded == 0 and copy.store.url == src.url
    store = dvidshards.open(server.url + "synth", fill_missing_shards=True)
    server.reset_counts()
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        got = pool.apply(_spawn_read, (pickle.dumps(store),))
    np.testing.assert_array_equal(got, _read(_local(root, "synth")[30:150, 20:140, 60:170]))
    csvs = {k: v for k, v in server.requests.items() if k.endswith(".csv")}
    assert csvs and set(csvs.values()) == {1}  # the child loaded its own indexes


def test_open_and_await_inside_a_running_loop(root, server):
    """Jupyter runs a loop on the main thread: opening and awaiting reads must still work."""
    expect = _read(_local(root, "synth")[0:200, 0:150, 0:100])

    async def main():
        store = dvidshards.open(server.url + "synth", fill_missing_shards=True)
        first = await store[0:200, 0:150, 0:100].read(order="F")
        second = store[0:200, 0:150, 0:100].read(order="F").result(timeout=60)  # blocking, too
        return first, second

    first, second = asyncio.run(main())
    np.testing.assert_array_equal(first, expect)
    np.testing.assert_array_equal(second, expect)


def test_batched_read_is_coalesced(root, server):
    """Reads submitted in one ts.Batch reach the reader together and share requests."""
    store = dvidshards.open(server.url + "synth", fill_missing_shards=True)
    _read(store[0:64, 0:64, 0:64])  # load the shard index
    server.reset_counts()
    with ts.Batch() as batch:
        futs = [store[x:x + 64, y:y + 64, z:z + 64].read(batch=batch, order="F")
                for x in (0, 64) for y in (0, 64) for z in (0, 64)]
    got = [f.result(timeout=60) for f in futs]
    local = _read(_local(root, "synth")[0:128, 0:128, 0:128])
    for (x, y, z), g in zip([(x, y, z) for x in (0, 64) for y in (0, 64) for z in (0, 64)], got, strict=True):
        np.testing.assert_array_equal(g, local[x:x + 64, y:y + 64, z:z + 64])
    assert server.requests == {"synth/s0/0_0_0.arrow": 1}


def test_urls_and_specs():
    g = KvStore.from_url("gs://my-bucket/exports/seg")
    assert g.spec == {"driver": "gcs", "bucket": "my-bucket", "path": "exports/seg/"}
    assert g.describe("s0/0_0_0.arrow") == "gs://my-bucket/exports/seg/s0/0_0_0.arrow"
    assert g._context() is not None  # the bounded gcs retry default is a valid context
    h = KvStore.from_url("https://example.org/data/seg")
    assert h.describe("info") == "https://example.org/data/seg/info"
    s = KvStore({"driver": "s3", "bucket": "b-1", "path": "x", "endpoint": "http://127.0.0.1:1"})
    assert s.spec["path"] == "x/" and s.describe("info") == "s3://b-1/x/info"
    copy = pickle.loads(pickle.dumps(h))
    assert copy.spec == h.spec and copy._kv is None
    assert isinstance(dvidshards.stores.as_store("gs://my-bucket/exports/seg"), KvStore)
    with pytest.raises(SpecError):
        KvStore.from_url("nonsense://x")
    with pytest.raises(SpecError):
        KvStore({"bucket": "b-1"})


def test_http_bulk_read_fetches_each_shard_in_one_request_per_thread(root, server):
    """Dataset.read on a remote store: a shard's records come in at most one request per thread."""
    ds = Dataset(server.url + "synth")
    box = [[0, 0, 0], [200, 150, 170]]
    want = _read(_local(root, "synth"))
    np.testing.assert_array_equal(ds.read(box, threads=2, fill_missing_shards=True), want)  # loads indexes
    server.reset_counts()
    np.testing.assert_array_equal(ds.read(box, threads=2, fill_missing_shards=True), want)
    stems = sorted(p.stem for p in (root / "synth" / "s0").glob("*.arrow"))
    assert set(server.requests) <= {f"synth/s0/{s}.arrow" for s in stems}
    assert all(server.requests[f"synth/s0/{s}.arrow"] <= 2 for s in stems), server.requests
    server.reset_counts()
    np.testing.assert_array_equal(ds.read(box, threads=1, fill_missing_shards=True), want)
    assert all(server.requests[f"synth/s0/{s}.arrow"] == 1 for s in stems), server.requests


# --- one retry layer -------------------------------------------------------------------------------


def test_a_context_with_tensorstore_retries_is_the_only_retry_layer(root, server):
    """TensorStore's retries (the caller's context) are not multiplied by the store's."""
    spec = Dataset(root / "synth").spec
    src = KvStore.from_url(server.url + "synth/", FAST_TS, retries=5, backoff=0.005)
    server.set_faults(fail=1.0)
    with pytest.raises(RemoteReadError, match="failed after 1 attempt"):
        _read(dvidshards.open(src, spec=spec, fill_missing_shards=True)[0:64, 0:64, 0:64])
    assert server.requests["synth/s0/0_0_0.csv"] == 1 + 2  # TensorStore's, not (1 + 5) x 3


def test_no_network_fails_after_the_store_s_attempts_and_bounded_backoff():
    """A host that refuses every connection (no network): 1 + retries attempts, waits that double
    from ``backoff`` (a quarter of jitter at most) between them, then RemoteReadError."""
    from tests.support.servers import free_port

    src = KvStore.from_url(f"http://127.0.0.1:{free_port()}/exp/", retries=3, backoff=0.01)
    waits: list[float] = []
    delay = src._delay
    src._delay = lambda attempt: waits.append(delay(attempt)) or waits[-1]  # type: ignore[method-assign]
    with pytest.raises(RemoteReadError, match=r"s0/0_0_0.csv .*failed after 4 attempts"):
        src.read_sync("s0/0_0_0.csv")
    assert src.stats["requests"] == 4 and src.stats["retries"] == 3
    assert len(waits) == 3 and all(0.01 * 2**k <= w <= 0.0125 * 2**k for k, w in enumerate(waits)), waits
