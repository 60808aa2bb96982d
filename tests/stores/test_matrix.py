"""The corruption matrix runs on every store.

Every corruption class is applied to a small export written by ``write_export`` (and, when
../shared is present, to the real mCNS shard), then run through five byte stores: a local
folder, ``MemoryStore``, a loopback HTTP range server, a loopback S3 server (moto) and a Google
Cloud Storage emulator (``gs://`` URLs, as a user gives them).  On each:

* ``verify`` reports the damage (not ok, a problem naming the damaged shard);
* every chunk read through ``Dataset.open(k)`` and ``Dataset.read(box, scale=k)`` raises a typed
  ``DvidShardsError`` or returns exactly the expected data, never other data;
* under the ``lazy`` policy (the remote default) the one class allowed to read as background
  is the documented one: a record that no index row lists.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from dvidshards import Dataset, DvidShardsError, verify
from dvidshards.stores import MemoryStore
from dvidshards.writer import write_shard
from tests.support.data import REAL_SHARD
from tests.support.exports import make_export
from tests.support.fuzz import arrow_map
from tests.support.servers import FakeGCS, MotoS3, RangeServer

BUCKET = "matrix"
SHAPE = (130, 100, 70)  # 3x2x2 chunks; shards of 2³ chunks at x = 0 and x = 128
STEM = "s0/0_0_0"  # the shard every case damages (8 records)
NO_ROW = "record without an index row"  # the one class lazy may read as background


# --- records and files ----------------------------------------------------------------------------


def _records(arrow: bytes) -> list[dict]:
    out = []
    for batch in pa.ipc.open_stream(pa.py_buffer(arrow)):
        d = batch.to_pydict()
        out += [{k: d[k][i] for k in d} for i in range(batch.num_rows)]
    return out


def _rewrite(tmp: Path, records: list[dict], **kw) -> dict[str, bytes]:
    """{".arrow": ..., ".csv": ...} of a shard written by write_shard from records."""
    stem = tmp / "shard"
    for p in tmp.glob("shard.*"):
        p.unlink()
    write_shard(stem, records, **kw)
    return {p.suffix: p.read_bytes() for p in tmp.glob("shard.*")}


def _csv_lines(b: bytes) -> tuple[list[str], list[str]]:
    lines = b.decode().splitlines()
    head = [ln for ln in lines if ln.startswith("#") or ln[:1].isalpha()]
    body = [ln for ln in lines if ln not in head]
    return head, body


def _join(head, body) -> bytes:
    return ("\n".join(head + body) + "\n").encode()


def _flip(b: bytes, pos: int) -> bytes:
    d = bytearray(b)
    d[pos] ^= 0x5A
    return bytes(d)


def _put_i64(b: bytes, pos: int, value: int) -> bytes:
    d = bytearray(b)
    d[pos:pos + 8] = int(value).to_bytes(8, "little", signed=True)
    return bytes(d)


# A case: name -> function(files, tmp) -> files (files: {relative key: bytes}), plus the chunk whose
# record the case hides from the index (None otherwise).


def _truncate(frac):
    def f(files, tmp):
        a = files[STEM + ".arrow"]
        files[STEM + ".arrow"] = a[:int(len(a) * frac)] if frac < 1 else a[:-40]  # into the last record
        return files
    return f


def _schema_flip(files, tmp):
    a = files[STEM + ".arrow"]
    m = arrow_map(a).schema
    pos = a.index(b"supervoxels", m.offset, m.end)
    files[STEM + ".arrow"] = _flip(a, pos + 3)
    return files


def _row_count(files, tmp):
    a = files[STEM + ".arrow"]
    files[STEM + ".arrow"] = _put_i64(a, arrow_map(a).batches[2].length_pos, 2 ** 31)
    return files


def _buffer_offset(files, tmp):
    a = files[STEM + ".arrow"]
    amap = arrow_map(a)
    m = amap.batches[3]
    k = amap.role("labels.item", "values")
    files[STEM + ".arrow"] = _put_i64(a, m.buffer_pos(k), m.buffers[k][0] + 8)
    return files


def _payload_flip(files, tmp):
    a = files[STEM + ".arrow"]
    amap = arrow_map(a)
    m = amap.batches[1]
    off, n = m.buffers[amap.role("dvid_compressed_block", "values")]
    files[STEM + ".arrow"] = _flip(a, m.body_start + off + n // 2)
    return files


def _csv(fn):
    def f(files, tmp):
        head, body = _csv_lines(files[STEM + ".csv"])
        files[STEM + ".csv"] = _join(head, fn(body))
        return files
    return f


def _point_elsewhere(body):
    # row 2 takes row 5's offset, size and batch index: it points at another chunk's record
    a, b = body[2].split(","), body[5].split(",")
    body[2] = ",".join(a[:3] + b[3:])
    return body


def _records_edit(fn, **kw):
    def f(files, tmp):
        recs = _records(files[STEM + ".arrow"])
        fn(recs)
        out = _rewrite(tmp, recs, **kw)
        files[STEM + ".arrow"], files[STEM + ".csv"] = out[".arrow"], out[".csv"]
        return files
    return f


def _move_record_csv_kept(files, tmp):
    """The record's own chunk columns changed, its CSV row still at the old chunk."""
    recs = _records(files[STEM + ".arrow"])
    old = _rewrite(tmp, recs)
    recs[3]["chunk_x"] = recs[3]["chunk_x"] ^ 1
    new = _rewrite(tmp, recs)
    files[STEM + ".arrow"] = new[".arrow"]
    files[STEM + ".csv"] = old[".csv"]  # same offsets (same sizes): the row keeps the old coordinate
    return files


def _outside_box(recs):
    recs[2]["chunk_x"] += 2  # a chunk of the neighbouring shard, recorded (and indexed) here


def _labels_longer(recs):
    recs[2]["labels"] = list(recs[2]["labels"]) + [7]


def _both_longer(recs):
    recs[2]["labels"] = list(recs[2]["labels"]) + [7]
    recs[2]["supervoxels"] = list(recs[2]["supervoxels"]) + [7]


def _pairs_reordered(recs):
    """A record's (supervoxel, label) pairs in another order than its block's list."""
    r = next(r for r in recs if len(set(r["labels"])) > 1)
    pairs = sorted(zip(r["supervoxels"], r["labels"], strict=True), reverse=True)
    assert [p[0] for p in pairs] != list(r["supervoxels"])
    r["supervoxels"], r["labels"] = [p[0] for p in pairs], [p[1] for p in pairs]


def _no_row(variant):
    def f(files, tmp):
        recs = _records(files[STEM + ".arrow"])
        out = _rewrite(tmp, recs, index=variant)
        head, body = _csv_lines(out[".csv"])
        files[STEM + ".arrow"] = out[".arrow"]
        files[STEM + ".csv"] = _join(head, body[:4] + body[5:])  # record 4 keeps its bytes, loses its row
        return files
    return f


def _shard_elsewhere(files, tmp):
    """Shard 0_0_0's files stored under the name of shard 128_0_0."""
    files["s0/128_0_0.arrow"] = files[STEM + ".arrow"]
    files["s0/128_0_0.csv"] = files[STEM + ".csv"]
    return files


NO_INDEX = "index file missing"

CASES = {
    "truncated mid-schema": _truncate(0.004),
    "truncated mid-batch": _truncate(0.5),
    "truncated last bytes": _truncate(1),
    "flipped byte in schema": _schema_flip,
    "batch row count 2^31": _row_count,
    "batch buffer offset +8": _buffer_offset,
    "flipped byte in payload": _payload_flip,
    "csv row duplicated": _csv(lambda b: b + [b[3]]),
    "csv row points elsewhere": _csv(_point_elsewhere),
    "record moved to another chunk": _move_record_csv_kept,
    "labels list longer than block's": _records_edit(_labels_longer),
    "both label lists longer": _records_edit(_both_longer),
    "supervoxels in another order": _records_edit(_pairs_reordered),
    NO_ROW + " (A)": _no_row("A"),
    NO_ROW + " (B)": _no_row("B"),
    NO_ROW + " (C)": _no_row("C"),
    "shard outside its box": _shard_elsewhere,
    # DVID always writes the index: verify reports its absence; reads rebuild it (IndexRebuiltWarning), exactly
    NO_INDEX: lambda files, tmp: {k: v for k, v in files.items() if k != STEM + ".csv"},
}


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


# --- the exports and servers (module scope) ---------------------------------------------------------


class Matrix:
    def __init__(self, root: Path, spec: dict, expected: np.ndarray, files: dict, hidden: dict):
        self.root, self.spec, self.expected, self.files, self.hidden = root, spec, expected, files, hidden
        self.http = self.s3 = self.gcs = None


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    base = tmp_path_factory.mktemp("matrix")
    exp = make_export(base / "clean", SHAPE, seed=5, scales=1, shard_chunks=2, batch_size=1)
    clean = {p.relative_to(exp.root).as_posix(): p.read_bytes() for p in Path(exp.root).rglob("*") if p.is_file()}
    assert STEM + ".arrow" in clean and len(_records(clean[STEM + ".arrow"])) == 8
    files, hidden = {}, {}
    for name, fn in CASES.items():
        tmp = base / "work" / _slug(name)
        tmp.mkdir(parents=True)
        f = fn(dict(clean), tmp)
        files[name] = f
        if name.startswith(NO_ROW):
            r = _records(f[STEM + ".arrow"])[4]
            hidden[name] = (r["chunk_x"], r["chunk_y"], r["chunk_z"])
        d = base / "served" / _slug(name)
        for k, v in f.items():
            (d / k).parent.mkdir(parents=True, exist_ok=True)
            (d / k).write_bytes(v)
    m = Matrix(base / "served", exp.spec, exp.expected(0), files, hidden)
    with RangeServer(m.root) as http:
        m.http = http
        try:
            import moto.server  # noqa: F401
        except ImportError:
            yield m
            return
        with MotoS3() as s3, _gcs() as gcs:
            for name in CASES:
                s3.upload_dir(BUCKET, m.root / _slug(name), _slug(name) + "/")
                if gcs is not None:
                    gcs.upload_dir(BUCKET, m.root / _slug(name), _slug(name) + "/")
            m.s3, m.gcs = s3, gcs
            yield m


def _gcs():
    """The Google Cloud Storage emulator, or nothing when it is not installed."""
    try:
        import gcp_storage_emulator  # noqa: F401
    except ImportError:
        return contextlib.nullcontext()
    return FakeGCS()


# the remote stores of the matrix run in the slow tier (tests/stores/test_remote.py keeps http, s3 and gcs in
# the default one)
def _remote(store: str):
    return pytest.param(store, marks=pytest.mark.slow, id=store)


STORES = ["local", "memory", *(_remote(s) for s in ("http", "s3", "gcs"))]


def _dataset(m: Matrix, store: str, name: str, policy=None) -> Dataset:
    if store == "local":
        src = m.root / _slug(name)
    elif store == "memory":
        src = MemoryStore(m.files[name], name=_slug(name))
    elif store == "http":
        src = m.http.url + _slug(name) + "/"
    elif store == "s3":
        if m.s3 is None:
            pytest.skip("moto is not installed")
        src = m.s3.spec(BUCKET, _slug(name) + "/")
    else:
        if m.gcs is None:
            pytest.skip("gcp-storage-emulator is not installed")
        src = f"gs://{BUCKET}/{_slug(name)}/"
    return Dataset(src, spec=m.spec, policy=policy)


def _chunks(shape):
    g = [-(-s // 64) for s in shape]
    return [(x, y, z) for z in range(g[2]) for y in range(g[1]) for x in range(g[0])]


def _box(c, shape):
    lo = [64 * v for v in c]
    hi = [min(64 * v + 64, s) for v, s in zip(c, shape, strict=True)]
    return [lo, hi]


def _check_reads(ds: Dataset, expected: np.ndarray, hidden, lazy: bool, what: str, chunks=None,
                 scale: int = 0) -> dict:
    """Read every chunk two ways: typed error or exact data (or background for the hidden chunk)."""
    outcome = {"exact": 0, "error": 0, "background": 0}
    vol = ds.open(scale)
    for c in chunks or _chunks(expected.shape):
        lo, hi = _box(c, expected.shape)
        want = expected[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]]
        for how in ("open", "read"):
            try:
                if how == "open":
                    got = vol[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]].read(order="F").result(timeout=60)
                else:
                    got = ds.read([lo, hi], scale=scale)
            except DvidShardsError:
                outcome["error"] += 1
                continue
            if np.array_equal(got, want):
                outcome["exact"] += 1
                continue
            if lazy and hidden == c and not got.any():
                outcome["background"] += 1  # the documented case: lazy cannot see an unlisted record
                continue
            pytest.fail(f"{what}: chunk {c} via {how} read other data without an error "
                        f"({int((got != want).sum())} voxels differ)")
    # the whole volume at once, too
    try:
        got = vol.read(order="F").result(timeout=60)
    except DvidShardsError:
        return outcome
    diff = got != expected
    if diff.any():
        assert lazy and hidden is not None, f"{what}: whole read returned other data without an error"
        lo, hi = _box(hidden, expected.shape)
        inside = np.zeros_like(diff)
        inside[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]] = True
        assert not (diff & ~inside).any() and not got[inside].any(), \
            f"{what}: whole read differs outside the unlisted record's chunk"
    return outcome


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("name", list(CASES))
def test_verify_reports_every_class(matrix, store, name):
    ds = _dataset(matrix, store, name)
    report = verify(ds)
    assert not report.ok, f"{name} on {store}: verify says ok\n{report.summary()}"
    damaged = "128_0_0" if name == "shard outside its box" else "0_0_0"
    assert any(damaged in p.message or damaged in p.path for p in report.problems), report.summary()
    # a problem that is only "could not list" or "nothing checked" is not a report of the damage
    assert report.shards >= 1, f"{name} on {store}: verify checked no shard\n{report.summary()}"


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("name", list(CASES))
def test_reads_are_exact_or_typed(matrix, store, name):
    ds = _dataset(matrix, store, name)
    lazy = store in ("http", "s3", "gcs")  # the remote default
    out = _check_reads(ds, matrix.expected, matrix.hidden.get(name), lazy, f"{name} on {store}")
    if out["background"]:
        assert name.startswith(NO_ROW), out
    if name == NO_INDEX:  # the records are intact: rebuilt from their own chunk columns, read exactly
        assert out["error"] == 0 and out["exact"] > 0, out
    elif not name.startswith(NO_ROW) or not lazy:
        # the damaged shard cannot read entirely exact: something must have been reported
        assert out["error"] > 0, f"{name} on {store}: every chunk read exactly despite the damage ({out})"


@pytest.mark.parametrize("store", ["local", "memory"])
@pytest.mark.parametrize("name", list(CASES))
def test_lazy_policy_on_local_stores(matrix, store, name):
    ds = _dataset(matrix, store, name, policy="lazy")
    out = _check_reads(ds, matrix.expected, matrix.hidden.get(name), True, f"{name} on {store} (lazy)")
    if out["background"]:
        assert name.startswith(NO_ROW), out


@pytest.mark.parametrize("store", STORES)
def test_undamaged_shard_reads_exactly_everywhere(matrix, store):
    """The matrix's reference: in "shard outside its box" shard 0_0_0 is intact and reads exactly."""
    ds = _dataset(matrix, store, "shard outside its box")
    for c in _chunks(SHAPE):
        if c[0] < 2:
            lo, hi = _box(c, SHAPE)
            np.testing.assert_array_equal(ds.read([lo, hi], scale=0), matrix.expected[lo[0]:hi[0], lo[1]:hi[1],
                                                                                 lo[2]:hi[2]])


@pytest.mark.parametrize("store", ["local", _remote("http")])
def test_lazy_unlisted_record_is_found_by_verify(matrix, store):
    """The documented limit of lazy: the unlisted record reads as 0, and verify reports it."""
    name = NO_ROW + " (A)"
    ds = _dataset(matrix, store, name, policy="lazy")
    c = matrix.hidden[name]
    lo, hi = _box(c, SHAPE)
    want = matrix.expected[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]]
    assert want.any(), "the hidden record must hold labels for this test to mean anything"
    got = ds.read([lo, hi], scale=0)  # lazy never reads a record no index row lists: its chunk is background
    np.testing.assert_array_equal(got, np.zeros_like(want))
    others = [c2 for c2 in _chunks(SHAPE) if c2 != c and c2[0] < 2][:4]
    for c2 in others:  # and the listed records beside it read exactly
        a, b = _box(c2, SHAPE)
        np.testing.assert_array_equal(ds.read([a, b], scale=0), matrix.expected[a[0]:b[0], a[1]:b[1], a[2]:b[2]])
    report = verify(_dataset(matrix, store, name))
    assert not report.ok
    assert any("0_0_0" in p.message for p in report.problems), report.summary()


# --- the real mCNS shard ------------------------------------------------------------------------------

REAL_NO_ROW = NO_ROW + " (DVID's own CSV)"
REAL_CASES = ["truncated mid-batch", "flipped byte in payload", REAL_NO_ROW, NO_ROW + " (A)",
              NO_ROW + " (C)", "labels list longer than block's"]


@pytest.fixture(scope="module")
def real_matrix(tmp_path_factory, dvid_data):
    from dvidshards.formats.codec import decode_block

    spec = json.loads((dvid_data / "mcns-ng-specs.json").read_text())
    arrow = (dvid_data / f"{REAL_SHARD}.arrow").read_bytes()
    recs = _records(arrow)
    base = tmp_path_factory.mktemp("real")
    clean = {f"s1/{REAL_SHARD}.arrow": arrow,
             f"s1/{REAL_SHARD}.csv": (dvid_data / f"{REAL_SHARD}-newformat.csv").read_bytes()}
    stem = f"s1/{REAL_SHARD}"
    files, hidden = {}, {}
    global STEM
    saved, STEM = STEM, stem
    try:
        for name in REAL_CASES:
            tmp = base / "work" / _slug(name)
            tmp.mkdir(parents=True)
            if name == REAL_NO_ROW:  # row 3 of DVID's own variant-A CSV deleted
                head, body = _csv_lines(clean[stem + ".csv"])
                f = dict(clean)
                f[stem + ".csv"] = _join(head, body[:3] + body[4:])
                hidden[name] = tuple(int(v) for v in body[3].split(",")[:3])
            else:
                f = CASES[name](dict(clean), tmp)
            files[name] = f
            if name.startswith(NO_ROW) and name != REAL_NO_ROW:
                r = _records(f[stem + ".arrow"])[4]
                hidden[name] = (r["chunk_x"], r["chunk_y"], r["chunk_z"])
            d = base / "served" / _slug(name)
            for k, v in f.items():
                (d / k).parent.mkdir(parents=True, exist_ok=True)
                (d / k).write_bytes(v)
    finally:
        STEM = saved
    import zstandard

    # reference chunks (agglomerated): records 0..7, the last and the hidden ones, decoded independently
    want = {c for c in hidden.values()}
    ref = {}
    for k, r in enumerate(recs):
        if 8 <= k < len(recs) - 1 and (r["chunk_x"], r["chunk_y"], r["chunk_z"]) not in want:
            continue
        block = zstandard.ZstdDecompressor().decompress(r["dvid_compressed_block"])
        ref[(r["chunk_x"], r["chunk_y"], r["chunk_z"])] = decode_block(block, np.asarray(r["labels"], np.uint64))
    return base / "served", spec, files, hidden, ref


def _real_source(real_matrix, store, name, stack):
    root, spec, files, hidden, ref = real_matrix
    if store == "local":
        return root / _slug(name)
    if store == "memory":
        return MemoryStore(files[name], name=_slug(name))
    srv = stack.enter_context(RangeServer(root))
    return srv.url + _slug(name) + "/"


@pytest.mark.parametrize("store", ["local", "memory", _remote("http")])
@pytest.mark.parametrize("name", REAL_CASES)
def test_real_shard_verify(real_matrix, store, name):
    with contextlib.ExitStack() as stack:
        ds = Dataset(_real_source(real_matrix, store, name, stack), spec=real_matrix[1])
        report = verify(ds, scale=1)
        assert not report.ok and any(REAL_SHARD in p.message for p in report.problems), report.summary()
        assert report.shards == 1, report.summary()


@pytest.mark.parametrize("store", ["local", "memory", _remote("http")])
@pytest.mark.parametrize("name", REAL_CASES)
def test_real_shard_reads(real_matrix, store, name):
    root, spec, files, hidden, ref = real_matrix
    with contextlib.ExitStack() as stack:
        ds = Dataset(_real_source(real_matrix, store, name, stack), spec=spec)
        lazy = store == "http"
        vol = ds.open(1)
        errors = 0
        for c, want_zyx in ref.items():
            box = tuple(slice(64 * v, 64 * v + 64) for v in c)
            try:
                got = vol[box].read(order="F").result(timeout=60)
            except DvidShardsError:
                errors += 1
                continue
            if np.array_equal(got.T, want_zyx):
                continue
            assert lazy and hidden.get(name) == c and not got.any(), \
                f"{name} on {store}: chunk {c} read other data without an error"
        if not (lazy and name.startswith(NO_ROW)):
            assert errors, f"{name} on {store}: every chunk read exactly despite the damage"


# --- the kernels' fallbacks (formats.jit) behave exactly like the compiled kernels ----------------


def _outcomes(ds: Dataset, shape) -> list:
    """Per chunk, via TensorStore and the bulk reader: the data's digest or the error's type and text."""
    vol = ds.open(0)
    out = []
    for c in _chunks(shape):
        lo, hi = _box(c, shape)
        for how in ("open", "read"):
            try:
                got = (vol[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]].read(order="F").result(timeout=60)
                       if how == "open" else ds.read([lo, hi], scale=0))
                out.append((c, how, got.tobytes()))
            except DvidShardsError as e:
                out.append((c, how, type(e).__name__, str(e)))
    return out


@pytest.mark.parametrize("store", ["local", "memory"])
@pytest.mark.parametrize("name", list(CASES))
def test_fallback_kernels_read_and_verify_identically(matrix, store, name):
    """A fresh process reads through the fallbacks until numba has compiled: same data, same errors."""
    import re

    from dvidshards.formats import jit

    def summary(ds) -> str:  # without the elapsed time ("... in 0.1 s"), which differs run to run
        return re.sub(r" in [0-9.]+ s\b", "", verify(ds).summary())

    jit.compile_all()
    compiled = _outcomes(_dataset(matrix, store, name), SHAPE), summary(_dataset(matrix, store, name))
    with jit.fallbacks():
        fallback = _outcomes(_dataset(matrix, store, name), SHAPE), summary(_dataset(matrix, store, name))
    assert fallback[1] == compiled[1]
    for a, b in zip(fallback[0], compiled[0], strict=True):
        assert a == b, f"{name} on {store}: chunk {a[0]} via {a[1]}: fallback {a[2:]!r:.200} != compiled {b[2:]!r:.200}"
