"""Arrow Flight (dvidshards.sources.flight, dvidshards.serve.flight): a server for exports and a client source, on loopback."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.flight as fl
import pyarrow.parquet as pq
import pytest

from dvidshards.dataset import Dataset
from dvidshards.errors import (
    DvidShardsError,
    MissingShardError,
    RemoteReadError,
    ShardFormatError,
    SpecError,
)
from dvidshards.jobs.ingest import ingest
from dvidshards.serve.flight import ExportFlightServer, serve
from dvidshards.sources.flight import FlightAuthError, FlightSource
from dvidshards.sources.tables import PartialStreamError, table_files
from tests.support.data import REAL_SHARD
from tests.support.exports import make_export, spec_file
from tests.support.tables import (
    assert_chunks_equal,
    assert_volumes_equal,
    brute_morton,
    export_records,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    return make_export(tmp_path_factory.mktemp("flight") / "exp", info=True)


@pytest.fixture(scope="module")
def server(synth):
    with serve(synth.root) as srv:
        yield srv


@pytest.fixture(scope="module")
def mcns(tmp_path_factory, dvid_data):
    root = tmp_path_factory.mktemp("mcnsf") / "mcns"
    (root / "s1").mkdir(parents=True)
    os.symlink(dvid_data / f"{REAL_SHARD}.arrow", root / "s1" / f"{REAL_SHARD}.arrow")
    shutil.copyfile(dvid_data / f"{REAL_SHARD}-newformat.csv", root / "s1" / f"{REAL_SHARD}.csv")
    return root, dvid_data / "mcns-ng-specs.json"


def _get(location: str, ticket: dict, headers=()) -> list:
    """(batch, metadata) chunks of a raw DoGet."""
    c = fl.FlightClient(location.replace("grpc://", "grpc+tcp://"))
    r = c.do_get(fl.Ticket(json.dumps(ticket).encode()), fl.FlightCallOptions(headers=list(headers)))
    out = []
    while True:
        try:
            ch = r.read_chunk()
        except StopIteration:
            return out
        out.append((ch.data, json.loads(bytes(ch.app_metadata)) if ch.app_metadata is not None else {}))


# --- a volume like the shard files ----------------------------------------------------------------


def test_flight_source_reads_like_the_files(synth, server):
    ds, dfl = Dataset(synth.root), Dataset(FlightSource(server.location))
    assert dfl.spec == ds.spec
    for k in range(3):
        assert dfl.shards(k) == ds.shards(k)
        s = ds.scale(k)
        box = [[0, 0, 0], list(s.size)]
        np.testing.assert_array_equal(dfl.read(box, scale=k), synth.expected(k))
        np.testing.assert_array_equal(dfl.read(box, scale=k, labels="supervoxels"), synth.expected(k, "supervoxels"))
    # through TensorStore as well
    vol = dfl.open(0, labels="supervoxels")[10:150, 5:120, 20:140].read(order="F").result()
    np.testing.assert_array_equal(vol, synth.expected(0, "supervoxels")[10:150, 5:120, 20:140])
    from dvidshards.jobs.verify import verify

    report = verify(dfl, decode=True)
    assert report.ok and report.checked, report.summary()


def test_real_mcns_shard_over_flight(mcns):
    """Every record of the real shard arrives as in the file (block bytes, both label lists); the
    volume read over Flight equals the local one at the batch boundary and on a sample of chunks."""
    root, spec = mcns
    with serve(str(root), spec=str(spec)) as srv:
        ds, dfl = Dataset(root, spec=spec), Dataset(FlightSource(srv.location))
        origin = ds.shards(1)[0]
        assert dfl.shards(1) == ds.shards(1)
        with pytest.raises(SpecError, match="has no folder s0"):  # a scale the export lacks: typed, over Flight
            dfl.shards(0)
        local, remote = ds.shard(1, origin), dfl.shard(1, origin)
        assert len(local) == len(remote) == 258
        lt, rt = local.table(), remote.table()
        for i, c in enumerate(local.coords):
            j = remote.find(*(int(v) for v in c))
            assert j is not None and rt.block(j) == lt.block(i), c
            np.testing.assert_array_equal(rt.labels(j), lt.labels(i))
            np.testing.assert_array_equal(rt.supervoxels(j), lt.supervoxels(i))
        rows = sorted({0, 255, 256, 257, *np.random.default_rng(0).choice(258, 20, replace=False).tolist()})
        assert_chunks_equal(ds, dfl, 1, local.coords[rows])


def test_flight_info_one_endpoint_per_shard(synth, server):
    c = fl.FlightClient(server.location.replace("grpc://", "grpc+tcp://"))
    ds = Dataset(synth.root)
    for k in range(3):
        info = c.get_flight_info(fl.FlightDescriptor.for_command(json.dumps({"v": 1, "scale": k})))
        tickets = [json.loads(ep.ticket.ticket) for ep in info.endpoints]
        assert sorted(tuple(t["shard"]) for t in tickets) == ds.shards(k)
        assert all(t["v"] == 1 and t["scale"] == k for t in tickets)
        assert info.schema.names[:2] == ["shard_id", "morton"]
        # an endpoint's ticket streams exactly that shard's records
        t = tickets[-1]
        batches = [b for b, _ in _get(server.location, t)]
        got = pa.Table.from_batches(batches)
        want = ds.shard(k, tuple(t["shard"]))
        assert got.num_rows == len(want)
    by_path = c.get_flight_info(fl.FlightDescriptor.for_path("s0"))
    assert len(by_path.endpoints) == len(ds.shards(0))
    assert [f.descriptor.command for f in c.list_flights()] and len(list(c.list_flights())) == 3


@pytest.mark.parametrize("n", [1, 2, 3])
def test_partitions_cover_every_record_once_in_shard_morton_order(synth, server, n):
    ds = Dataset(synth.root)
    s = ds.scale(0)
    want = export_records(Path(synth.root), 0)
    seen = []
    for i in range(n):
        chunks = _get(server.location, {"v": 1, "scale": 0, "partition": i, "of": n})
        assert chunks[-1][1]["done"] and chunks[-1][0].num_rows == 0
        keys, ends = [], {}
        for b, meta in chunks[:-1]:
            t = b.to_pydict()
            assert len(set(t["shard_id"])) <= 1  # a batch never spans shards
            for r in range(b.num_rows):
                c = (t["chunk_x"][r], t["chunk_y"][r], t["chunk_z"][r])
                assert t["morton"][r] == brute_morton(c, s.grid)
                assert t["shard_id"][r] % n == i
                assert t["dvid_compressed_block"][r] == want[c][2] and t["labels"][r] == want[c][0]
                keys.append((t["shard_id"][r], t["morton"][r]))
                seen.append(c)
            if meta:  # the last batch of a shard id says so, with the shard's record count
                assert meta["end"] and b.num_rows and meta["shard_id"] == t["shard_id"][0], meta
                ends[meta["shard_id"]] = meta["records"]
        assert ends == dict(Counter(k[0] for k in keys))  # one end marker per shard
        assert keys == sorted(keys)
        assert chunks[-1][1]["records"] == len(keys)
    assert sorted(seen) == sorted(want) and len(seen) == len(set(seen))


def test_batches_carry_many_records(mcns):
    root, spec = mcns
    with serve(str(root), spec=str(spec)) as srv:
        chunks = _get(srv.location, {"v": 1, "scale": 1, "shard": [30720, 24576, 28672]})
        sizes = [b.num_rows for b, _ in chunks]
        assert sizes == [256, 2, 0]  # 258 records in batches of 256, then the done marker
        assert chunks[1][1] == {"shard_id": chunks[0][0].column("shard_id")[0].as_py(),
                                "origin": [30720, 24576, 28672], "records": 258, "end": True}
        one = _get(srv.location, {"v": 1, "scale": 1, "shard": [30720, 24576, 28672], "batch_rows": 1})
        assert len(one) == 259
        cols = _get(srv.location, {"v": 1, "scale": 1, "columns": ["chunk_x", "chunk_y", "chunk_z", "labels"]})
        assert cols[0][0].schema.names == ["chunk_x", "chunk_y", "chunk_z", "labels"]


def test_read_ahead_keeps_order_raises_in_place_and_stops_when_closed():
    import threading

    from dvidshards.serve.flight import _ahead

    assert list(_ahead(iter(range(50)))) == list(range(50))

    def failing():
        yield 1
        yield 2
        raise MissingShardError("shard gone")

    got = []
    with pytest.raises(MissingShardError, match="shard gone"):
        for x in _ahead(failing()):
            got.append(x)
    assert got == [1, 2]
    made = []

    def endless():
        while True:
            made.append(1)
            yield len(made)

    before = set(threading.enumerate())
    g = _ahead(endless())
    assert next(g) == 1
    (th,) = [t for t in threading.enumerate() if t.name == "dvidshards-flight-ahead" and t not in before]
    g.close()  # a client that hung up
    th.join(timeout=300)  # the thread ends (the timeout only guards against a hang)
    assert not th.is_alive()
    assert len(made) <= 3  # the item handed out, the one queued, the one it held when told to stop


def test_tune_malloc_applies_once_per_process():
    code = "from dvidshards.sources.flight import tune_malloc as t; print(t(), t(1, 1))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    import platform

    glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert out == ([str(glibc)] * 2)


def test_boxes_and_chunk_lists_are_one_doget(synth):
    calls = []

    class Counting(ExportFlightServer):
        def do_get(self, context, ticket):
            calls.append(json.loads(ticket.ticket))
            return super().do_get(context, ticket)

    ds = Dataset(synth.root)
    allc = ds.chunks(0)
    with Counting(synth.root).start() as srv:
        src = FlightSource(srv.location)
        pick = allc[::5]
        rt = src.read_records(0, chunks=np.concatenate([pick, [[3, 2, 2]]]))
        assert len(calls) == 1 and "chunks" in calls[0]
        assert sorted(map(tuple, rt.coords.tolist())) == sorted(map(tuple, pick.tolist()))
        for i in range(len(rt)):
            c = tuple(int(v) for v in rt.coords[i])
            sh = ds.shard(0, ds.scale(0).shard_origin(*c))
            assert rt.block(i) == sh.table().block(sh.find(*c))
        box = [[60, 0, 70], [130, 64, 140]]
        rb = src.read_records(0, box=box)
        assert len(calls) == 2
        lo, hi = np.asarray(box[0]) // 64, -(-np.asarray(box[1]) // 64)
        inside = allc[((allc >= lo) & (allc < hi)).all(axis=1)]
        assert sorted(map(tuple, rb.coords.tolist())) == sorted(map(tuple, inside.tolist()))
        # a Dataset over Flight loads a shard with one DoGet, then reads it from memory
        calls.clear()
        dfl = Dataset(src)
        dfl.read([[0, 0, 0], [128, 128, 128]])
        assert len(calls) == 1 and "shard" in calls[0]


# --- errors -------------------------------------------------------------------------------------


def test_a_server_started_while_another_stops_keeps_serving(synth):
    """Flight's blocking serve() shuts down, on its way out, the server of the process that called
    it last: a server started right after another's shutdown stopped listening (connection
    refused) on a busy machine. Servers here never call it; many starts and stops in a row all
    answer."""
    for _ in range(20):
        with serve(synth.root) as a:
            assert FlightSource(a.location).spec
        with serve(synth.root) as b:
            assert FlightSource(b.location).spec


def test_bad_tickets_are_typed(server):
    src = FlightSource(server.location)
    for ticket, match in [({"scale": 9}, "scale 9"), ({"scale": 0, "partition": 2, "of": 2}, "partition"),
                          ({"scale": 0, "columns": ["nope"]}, "columns"), ({"scale": 0, "box": [[0, 0]]}, "box"),
                          ({"scale": 0, "partition": 0}, "together"), ({"scale": 0, "extra": 1}, "unknown keys")]:
        with pytest.raises(SpecError, match=match):
            list(src.stream(ticket))
    with pytest.raises(fl.FlightServerError, match="version") as e:  # a plain Flight client sees the type too
        _get(server.location, {"v": 99, "scale": 0})
    assert json.loads(e.value.extra_info)["type"] == "SpecError"
    with pytest.raises(MissingShardError):
        list(src.stream({"scale": 0, "shard": [1 << 20, 0, 0]}))


def test_server_error_mid_stream_reaches_the_client_typed(synth, tmp_path):
    """A damaged shard in the middle of a partition: the batches before it arrive, then its error."""
    root = tmp_path / "exp"
    shutil.copytree(synth.root, root)
    ds = Dataset(root)
    from dvidshards.sources.tables import origins_by_shard_id

    by_id = origins_by_shard_id(ds.scale(0), ds.shards(0))
    ids = sorted(by_id)
    victim = by_id[ids[len(ids) // 2]][0]
    f = root / "s0" / f"{victim[0]}_{victim[1]}_{victim[2]}.arrow"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with serve(str(root)) as srv:
        src = FlightSource(srv.location)
        got = []
        with pytest.raises(ShardFormatError) as e:
            for b, meta in src.scan(0, partition=0, of=1):
                got.append((b, meta))
        assert f.name in str(e.value) and srv.location in str(e.value)
        ends = [m["shard_id"] for _, m in got if m.get("end")]
        assert ends == ids[: len(ids) // 2]  # every shard before the damaged one, complete
        # ingest: the partition fails, typed; the complete shards are written, the table is not complete
        report = ingest(FlightSource(srv.location), tmp_path / "t", workers=1, scales=[0], allow_partial=True)
        assert not report.ok and "ShardFormatError" in next(iter(report.failed.values()))
        assert sorted(table_files(tmp_path / "t", 0)) == ids[: len(ids) // 2]
        assert not json.loads((tmp_path / "t" / "info").read_text())["dvidshards_table"]["complete"]
        # the Dataset over Flight: the damaged shard's chunks fail typed, the others read
        dfl = Dataset(src)
        with pytest.raises(ShardFormatError):
            dfl.read([list(victim), list(np.minimum(np.asarray(victim) + 64, ds.scale(0).size))])


class Cutting(ExportFlightServer):
    """Ends every stream after its first batch, without an error and without the done marker."""

    def _generate(self, s, t, schema):
        for item in super()._generate(s, t, schema):
            yield item
            return


def test_a_cut_stream_is_detected_as_partial(synth, tmp_path):
    with Cutting(synth.root).start() as srv:
        src = FlightSource(srv.location)
        with pytest.raises(PartialStreamError, match="done marker"):
            list(src.scan(0, partition=0, of=1, batch_rows=1))
        with pytest.raises(PartialStreamError):
            Dataset(src).read([[0, 0, 0], [64, 64, 64]])
        # each partition's first shard has several records, and 1-row batches: cut inside it
        assert min(len(Dataset(synth.root).shard(0, o)) for o in Dataset(synth.root).shards(0)[:2]) > 1
        report = ingest(FlightSource(srv.location), tmp_path / "t", workers=2, scales=[0], batch_rows=1, allow_partial=True)
        assert not report.ok and all("PartialStreamError" in v for v in report.failed.values())
        assert table_files(tmp_path / "t", 0) == {}  # no shard file from a cut shard
        assert not [n for n in os.listdir(tmp_path / "t" / "s0")]
        # with whole-shard batches the first shard arrives complete (its end marker): kept, exact
        report = ingest(FlightSource(srv.location), tmp_path / "t2", workers=2, scales=[0], allow_partial=True)
        assert not report.ok
        files = table_files(tmp_path / "t2", 0)
        assert len(files) == 2
        for o, path in files.values():
            assert pq.read_table(path).num_rows == len(Dataset(synth.root).shard(0, o))


def test_bearer_auth(synth, tmp_path):
    with serve(synth.root, token="s3cret") as srv:
        for token in (None, "wrong", "s3cret "):
            with pytest.raises(FlightAuthError):
                FlightSource(srv.location, token=token)
        with pytest.raises(fl.FlightUnauthenticatedError):  # every call, not only the first
            _get(srv.location, {"v": 1, "scale": 2}, headers=[(b"authorization", b"Bearer nope")])
        src = FlightSource(srv.location, token="s3cret")
        np.testing.assert_array_equal(Dataset(src).read([[0, 0, 0], [50, 43, 38]], scale=2), synth.expected(2))
        assert ingest(FlightSource(srv.location, token="s3cret"), tmp_path / "t", workers=2, scales=[2]).ok


def test_ingest_without_the_token_is_refused(synth, tmp_path):
    with serve(synth.root, token="s3cret") as srv:
        with pytest.raises(FlightAuthError):
            ingest(FlightSource(srv.location), tmp_path / "t", workers=2)
    assert not (tmp_path / "t").exists()


def _self_signed():
    x509 = pytest.importorskip("cryptography.x509")
    import datetime
    import ipaddress

    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))


@pytest.mark.slow
def test_tls(synth):
    cert, key = _self_signed()
    with serve(synth.root, tls=(cert, key), token="t") as srv:
        assert srv.location.startswith("grpc+tls://127.0.0.1:")
        src = FlightSource(srv.location, tls_root_certs=cert, token="t")
        np.testing.assert_array_equal(Dataset(src).read([[0, 0, 0], [50, 43, 38]], scale=2), synth.expected(2))
        with pytest.raises(RemoteReadError):  # no root certificate: the server is not trusted
            FlightSource(srv.location, token="t", timeout=10)
        with pytest.raises(DvidShardsError):  # plain gRPC against a TLS server
            FlightSource(srv.location.replace("grpc+tls://", "grpc://"), token="t", timeout=10)


def test_unreachable_server_is_typed():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RemoteReadError):
        FlightSource(f"grpc://127.0.0.1:{port}", timeout=5)
    with pytest.raises(SpecError):
        FlightSource("http://127.0.0.1:1")


def test_a_flight_source_pickles(server):
    import pickle

    src = FlightSource(server.location)
    again = pickle.loads(pickle.dumps(Dataset(src)))
    assert again.shards(0) == Dataset(src).shards(0)


# --- command line ---------------------------------------------------------------------------------


def test_cli_serve_flight_prints_its_location_and_ingest_pulls(synth, tmp_path, capsys):
    """The server in a process of its own (as a user runs it), the ingest command in this one."""
    from dvidshards.cli import main

    p = subprocess.Popen([sys.executable, "-m", "dvidshards.cli", "serve-flight", synth.root, "--port", "0"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(ROOT))
    try:
        line = p.stdout.readline().rstrip("\n")
        assert re.fullmatch(r"grpc://127\.0\.0\.1:\d+", line), line
        code = main(["ingest", line, str(tmp_path / "t"), "--workers", "2"])
        out = capsys.readouterr()
        assert code == 0, out.err
        assert "records in" in out.out
    finally:
        p.terminate()
        p.wait(timeout=300)  # a guard against a hang: a busy machine may take a while to stop it
    from dvidshards.sources.tablesource import TableSource

    assert_volumes_equal(Dataset(synth.root), Dataset(TableSource(tmp_path / "t")), [0, 1, 2])
    assert main(["serve-flight", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_cli_ingest_blocks_dump(synth, tmp_path, capsys):
    from dvidshards.cli import main
    from tests.support.blocks import export_blocks
    from tests.support.blockstream import write_stream

    (tmp_path / "d.dat").write_bytes(write_stream(export_blocks(Path(synth.root))))
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(Dataset(synth.root).spec))
    assert main(["ingest", str(tmp_path / "d.dat"), str(tmp_path / "exp"), "--spec", str(spec)]) == 0, \
        capsys.readouterr().err
    ds = Dataset(tmp_path / "exp")
    box = [[0, 0, 0], list(ds.scale(0).size)]
    np.testing.assert_array_equal(ds.read(box, labels="supervoxels"), synth.expected(0, "supervoxels"))
    capsys.readouterr()
    assert main(["ingest", str(tmp_path / "d.dat"), str(tmp_path / "exp")]) == 2
    assert "not an empty folder" in capsys.readouterr().err


def test_server_checks_payload_frames_before_sending(mcns, real_records, tmp_path):
    """A record whose zstd frame disagrees with its uncompressed_size: a typed error, not bytes."""
    from dvidshards.errors import BlockDecodeError
    from dvidshards.writer import write_shard

    _, spec = mcns
    recs = [dict(r) for r in real_records]
    bad = recs[100]
    bad["uncompressed_size"] += 8
    (tmp_path / "exp" / "s1").mkdir(parents=True)
    write_shard(tmp_path / "exp" / "s1" / REAL_SHARD, recs)
    with serve(str(tmp_path / "exp"), spec=str(spec)) as srv:
        with pytest.raises(BlockDecodeError) as e:
            list(FlightSource(srv.location).scan(1))
    c = (bad["chunk_x"], bad["chunk_y"], bad["chunk_z"])
    assert f"chunk {c}" in str(e.value) and "uncompressed_size" in str(e.value)


def test_as_record_source_and_uri_strings(synth, server, tmp_path, dvid_data):
    from dvidshards.sources import as_record_source
    from dvidshards.sources.tablesource import TableSource

    assert isinstance(as_record_source(server.location), FlightSource)
    ingest(synth.root, tmp_path / "t", workers=1, scales=[2])
    assert isinstance(as_record_source(tmp_path / "t"), TableSource)
    with pytest.raises(SpecError, match="an export of shard files"):
        as_record_source(synth.root)
    t = pa.table({a: pa.array([0], pa.int32()) for a in ("chunk_x", "chunk_y", "chunk_z")})
    assert isinstance(as_record_source(t, spec=Dataset(synth.root).spec), TableSource)
    with pytest.raises(SpecError, match="FlightSource"):  # the tables layer takes a source, not a URI
        ingest(server.location, tmp_path / "u")
    assert not (tmp_path / "u").exists()


def test_an_s0_only_export_with_the_full_spec_over_flight_into_a_table(tmp_path):
    """DVID's default export (s0 only, the spec listing every scale): serve-flight says which
    scales the export holds, ingest takes those, and the table reads exactly, the others "not exported"."""
    import dvidshards
    from dvidshards.demo.neurons import neuron_volume
    from dvidshards.errors import NotExportedError

    sv, mapping = neuron_volume((130, 100, 90), n_bodies=4, svs_per_body=3, seed=5)
    spec = dvidshards.write_export(sv, tmp_path / "exp", mapping=mapping, scales=3, shard_chunks=1, only_scales=[0])
    src = Dataset(str(tmp_path / "exp"), spec=spec)
    box = [[0, 0, 0], list(src.scale(0).size)]
    want = src.read(box, scale=0, fill_missing_shards=True)
    with serve(str(tmp_path / "exp"), spec=spec) as srv:
        fs = FlightSource(srv.location)
        assert fs.exported == (0,) and sorted(fs.scales) == [0, 1, 2]
        np.testing.assert_array_equal(Dataset(fs).read(box, scale=0, fill_missing_shards=True), want)
        report = ingest(fs, tmp_path / "t", workers=2, progress=False)
        assert report.ok and report.scales == [0], report.summary()
        with pytest.raises(NotExportedError, match="scale 1"):
            ingest(fs, tmp_path / "t2", workers=1, scales=[1], progress=False)
    table = Dataset(str(tmp_path / "t"))
    assert table.exported == (0,)
    np.testing.assert_array_equal(table.read(box, scale=0, fill_missing_shards=True), want)
    vol = dvidshards.open(str(tmp_path / "t"), scale=0, fill_missing_shards=True)
    np.testing.assert_array_equal(vol.read(order="F").result(), want)
    with pytest.raises(NotExportedError, match="scale 1 is not exported"):
        table.read(box, scale=1)


# --- a busy port, a descriptor path that is not a scale ----------------------------------------------


def test_serve_flight_on_a_busy_port_is_one_line_naming_the_port(three_shards, capsys):
    import socket

    from dvidshards.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["serve-flight", three_shards.root, "--spec", spec_file(three_shards, Path(three_shards.root).parent),
                     "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"127.0.0.1:{port}" in err and "in use" in err, err


def test_serve_flight_from_python_on_a_busy_port_is_an_os_error_naming_it(three_shards):
    import errno
    import socket

    from dvidshards.serve.flight import serve

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(OSError, match=f"127.0.0.1:{port}") as e:
            serve(three_shards.root, spec=three_shards.spec, port=port)
    assert e.value.errno == errno.EADDRINUSE


def test_a_descriptor_path_with_a_non_ascii_digit_is_a_spec_error(three_shards):
    import pyarrow.flight as fl

    from dvidshards.serve.flight import serve

    with serve(three_shards.root, spec=three_shards.spec) as server:
        client = fl.connect(server.location)
        with pytest.raises(fl.FlightError) as e:
            client.get_flight_info(fl.FlightDescriptor.for_path("s²"))
        assert "descriptor path" in str(e.value)
        assert "ValueError" not in str(e.value)
