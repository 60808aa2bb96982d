"""The bulk reader (``Dataset.read``): run plan, output layouts, threads, absent data and errors."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import zstandard

import dvidshards
from dvidshards import ChunkIndexError, Dataset, DvidShardsError
from dvidshards import read as bulk
from dvidshards.errors import BlockDecodeError, MissingShardError, SpecError
from tests.support.exports import (
    THREE_SHARDS,
    Export,
    copy_export,
    crop,
    downsample_mode,
    shard_records,
    ts_read,
)
from tests.support.servers import RangeServer

SHAPE = (200, 170, 150)  # 4 x 3 x 3 chunks, 2-chunk shards: 2 shards per axis


@pytest.fixture(scope="module")
def exp(tmp_path_factory):
    """Chunk (1, 0, 0) all background (no record) and shard 128_128_128 all background (no file)."""
    from dvidshards.demo.neurons import neuron_volume
    from dvidshards.writer import write_export

    sv, mapping = neuron_volume(SHAPE, n_bodies=10, svs_per_body=4, seed=11)
    sv[64:128, :64, :64] = 0
    sv[128:, 128:, 128:] = 0
    root = tmp_path_factory.mktemp("bulk") / "exp"
    spec = write_export(sv, root, mapping=mapping, scales=1, shard_chunks=2)
    assert not os.path.exists(os.path.join(root, "s0", "128_128_128.arrow"))
    return Export(str(root), spec, sv, mapping, downsample_mode(sv, 1))


@pytest.fixture(scope="module")
def ds(exp):
    return dvidshards.Dataset(exp.root, spec=exp.spec)


def _boxes(rng, n=12):
    size = np.array(SHAPE)
    boxes = [[[0, 0, 0], [128, 128, 128]], [[0, 0, 0], [200, 128, 128]], [[3, 5, 7], [9, 6, 8]],
             [[60, 60, 60], [70, 70, 70]], [[37, 1, 2], [190, 127, 100]], [[199, 127, 0], [200, 128, 128]]]
    for _ in range(n):
        a = rng.integers(0, size - 1)
        b = np.minimum(a + rng.integers(1, 150, 3), size)
        if not ((b > 128).all()):  # the missing shard is tested apart
            boxes.append([a.tolist(), b.tolist()])
    return boxes


def _sl(box):
    return tuple(slice(a, b) for a, b in zip(*box, strict=True))


def test_plan_covers_each_chunk_once_inside_its_shard(ds):
    scale = ds.scale(0)
    for lo, hi in ([0, 0, 0], list(SHAPE)), ([37, 1, 2], [190, 127, 100]), ([64, 64, 64], [65, 65, 65]):
        runs = bulk._plan(scale, lo, hi)
        seen = []
        for origin, y, z, x0, x1 in runs:
            assert 1 <= x1 - x0 <= bulk._RUN
            for x in range(x0, x1):
                assert scale.shard_origin(x, y, z) == origin
                seen.append((x, y, z))
        want = [(x, y, z) for z in range(lo[2] // 64, (hi[2] - 1) // 64 + 1)
                for y in range(lo[1] // 64, (hi[1] - 1) // 64 + 1) for x in range(lo[0] // 64, (hi[0] - 1) // 64 + 1)]
        assert seen == want  # memory order of an F-ordered output: x, then y, then z


def test_plan_splits_long_rows(ds, monkeypatch):
    monkeypatch.setattr(bulk, "_RUN", 1)
    runs = bulk._plan(ds.scale(0), [0, 0, 0], list(SHAPE))
    assert len(runs) == 4 * 3 * 3 and all(r[4] - r[3] == 1 for r in runs)


def test_group_remote_runs(ds):
    rows = bulk._plan(ds.scale(0), [0, 0, 0], list(SHAPE))
    for threads in (1, 2, 3):
        runs = bulk._group(rows, threads)
        assert [(o, r) for o, rs in runs for r in rs] == sorted(
            [(r[0], r[1:]) for r in rows], key=lambda orr: list(dict.fromkeys(r[0] for r in rows)).index(orr[0]))
        for origin, rs in runs:
            n = sum(r[3] - r[2] for r in rs)
            shard_total = sum(r[4] - r[3] for r in rows if r[0] == origin)
            assert n <= max(min(bulk._REMOTE_RUN, -(-shard_total // threads)), rs[0][3] - rs[0][2])
        if threads == 1:
            assert len(runs) == len({r[0] for r in rows})  # one run per shard


@pytest.mark.parametrize("order", ["F", "C", "strided"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_boxes_equal_written_volume(exp, ds, order, threads):
    rng = np.random.default_rng(threads)
    for labels in ("agglomerated", "supervoxels", {int(s): 7 for s in np.unique(exp.sv)[1::3]}):
        vol = exp.expected(0, labels)
        for box in _boxes(rng):
            want = vol[_sl(box)]
            shape = want.shape
            if order == "F":
                out = np.full(shape, 99, np.uint64, order="F")
            elif order == "C":
                out = np.full(shape, 99, np.uint64, order="C")
            else:  # a view into a bigger array: x not contiguous, neither C nor F order
                big = np.full((2 * shape[0] + 1, shape[1] + 1, shape[2] + 1), 99, np.uint64, order="F")
                out = big[1::2, 1:, 1:]
                assert out.strides[0] == 16 and not (out.flags.c_contiguous or out.flags.f_contiguous)
            got = ds.read(box, labels=labels, out=out, threads=threads)
            assert got is out
            np.testing.assert_array_equal(got, want, err_msg=f"{order} {box} {labels!r}")
            if order == "strided":  # nothing written outside the view
                assert (big[0::2] == 99).all() and (big[:, 0] == 99).all() and (big[:, :, 0] == 99).all()


def test_absent_chunk_is_zeroed_in_a_dirty_out(exp, ds):
    assert ds.shard(0, (0, 0, 0)).find(1, 0, 0) is None  # the fixture's all-background chunk
    out = np.full((200, 128, 128), 5, np.uint64, order="F")
    ds.read([[0, 0, 0], [200, 128, 128]], out=out, threads=2)
    np.testing.assert_array_equal(out, exp.expected(0)[:, :128, :128])
    assert not out[64:128, :64, :64].any()


def test_missing_shard(exp, ds):
    box = [[100, 100, 100], [200, 170, 150]]
    with pytest.raises(MissingShardError, match="128_128_128"):
        ds.read(box, threads=2)
    out = np.full((100, 70, 50), 5, np.uint64, order="F")
    ds.read(box, out=out, threads=2, fill_missing_shards=True)
    np.testing.assert_array_equal(out, exp.expected(0)[_sl(box)])
    assert not out[28:, 28:, 28:].any()


def test_out_is_checked(ds):
    box = [[0, 0, 0], [10, 10, 10]]
    for bad in (np.zeros((10, 10, 10), np.int64), np.zeros((10, 10, 9), np.uint64), [[[0]]]):
        with pytest.raises(SpecError, match="writable uint64"):
            ds.read(box, out=bad)
    ro = np.zeros((10, 10, 10), np.uint64)
    ro.flags.writeable = False
    with pytest.raises(SpecError):
        ds.read(box, out=ro)
    with pytest.raises(SpecError, match="not inside"):
        ds.read([[0, 0, 0], [201, 10, 10]])
    assert ds.read([[5, 5, 5], [5, 9, 9]]).shape == (0, 4, 4)


def test_batched_zstd_equals_one_chunk_path(exp, ds, monkeypatch):
    calls = []
    orig = zstandard.ZstdDecompressor.multi_decompress_to_buffer

    def spy(self, *a, **k):
        calls.append(1)
        return orig(self, *a, **k)

    box = [[0, 0, 0], [200, 128, 150]]
    monkeypatch.setattr(zstandard.ZstdDecompressor, "multi_decompress_to_buffer", spy)
    fast = ds.read(box, threads=2)
    assert calls  # runs of two chunks went through one zstd call
    monkeypatch.setattr(bulk._BulkWorker, "_decompress", lambda self, t, ks: None)
    slow = ds.read(box, threads=2)
    np.testing.assert_array_equal(fast, slow)
    np.testing.assert_array_equal(fast, exp.expected(0)[_sl(box)])


def _corrupt(root, spec, origin, chunk):
    """Flip a byte in the middle of the payload of ``chunk`` in shard ``origin``."""
    ds = dvidshards.Dataset(root, spec=spec)
    shard = ds.shard(0, origin)
    i = shard.find(*chunk)
    t = shard.table()
    path = os.path.join(root, "s0", "{}_{}_{}.arrow".format(*origin))
    data = bytearray(open(path, "rb").read())
    pay = bytes(t.payload(i))
    at = data.find(pay)
    assert at > 0 and data.find(pay, at + 1) < 0
    data[at + len(pay) // 2] ^= 0xFF
    with open(path, "wb") as f:
        f.write(bytes(data))


@pytest.mark.parametrize("threads", [1, 2])
def test_corrupt_chunk_is_typed_and_named(exp, tmp_path, threads):
    root = tmp_path / "exp"
    shutil.copytree(exp.root, root)
    _corrupt(str(root), exp.spec, (0, 0, 0), (1, 1, 0))
    _corrupt(str(root), exp.spec, (128, 128, 0), (2, 2, 1))
    ds = dvidshards.Dataset(str(root), spec=exp.spec)
    # the first damaged chunk in reading order (x, then y, then z) is the one reported, every time
    for _ in range(3):
        with pytest.raises(BlockDecodeError) as e:
            ds.read([[0, 0, 0], [200, 170, 150]], threads=threads, fill_missing_shards=True)
        assert "0_0_0.arrow" in str(e.value) and "chunk (1, 1, 0)" in str(e.value), str(e.value)
    # the same message as the TensorStore path and a one-chunk read
    with pytest.raises(BlockDecodeError) as one:
        ds.read([[64, 64, 0], [128, 128, 64]])
    with pytest.raises(BlockDecodeError) as via_ts:
        ds.open(0)[64:128, 64:128, 0:64].read().result()
    assert str(one.value) == str(e.value) == str(via_ts.value)
    # the other chunks of the damaged run still read exactly
    vol = exp.expected(0)
    np.testing.assert_array_equal(ds.read([[0, 64, 0], [64, 128, 64]], threads=threads), vol[:64, 64:128, :64])
    np.testing.assert_array_equal(ds.read([[0, 0, 0], [200, 64, 150]], threads=threads), vol[:, :64, :])


def test_label_count_mismatch_is_typed(exp, ds):
    """A record whose list length disagrees with its block fails with the one-chunk path's error."""
    from dvidshards.formats import arrowipc

    shard = ds.reader(0, labels="agglomerated").shard(0, 0, 0)  # the bulk reader's own cached shard
    t = shard.table()
    i = shard.find(0, 0, 0)
    saved = int(t.rec[i, arrowipc.R_NSV])
    t.rec[i, arrowipc.R_NSV] = saved + 1
    try:
        with pytest.raises(BlockDecodeError, match=r"0_0_0\.arrow: chunk \(0, 0, 0\): the block has \d+ labels"):
            ds.read([[0, 0, 0], [128, 64, 64]], threads=2)
    finally:
        t.rec[i, arrowipc.R_NSV] = saved
    np.testing.assert_array_equal(ds.read([[0, 0, 0], [128, 64, 64]]), exp.expected(0)[:128, :64, :64])


def test_lazy_policy_reads_the_same(exp):
    """Records fetched per run (lazy shards) rather than indexed in the loaded table."""
    lazy = dvidshards.Dataset(exp.root, spec=exp.spec, policy="lazy")
    rng = np.random.default_rng(5)
    for box in _boxes(rng, 6):
        np.testing.assert_array_equal(lazy.read(box, threads=2), exp.expected(0)[_sl(box)])
    assert lazy.reader(0, labels="agglomerated").shard(0, 0, 0).policy == "lazy"


def test_aligned_empty_and_default_out(ds):
    for shape in ((512, 3, 5), (3, 5, 7), (1, 1, 1)):
        a = bulk.aligned_empty(shape)
        assert a.shape == shape and a.dtype == np.uint64 and a.flags.f_contiguous and a.flags.writeable
        assert a.ctypes.data % 64 == 0
    c = bulk.aligned_empty((3, 5, 7), order="C")
    assert c.flags.c_contiguous and c.ctypes.data % 64 == 0
    got = ds.read([[1, 2, 3], [100, 90, 80]])
    assert got.flags.f_contiguous and got.ctypes.data % 64 == 0
    assert ds.read([[0, 0, 0], [0, 4, 4]]).shape == (0, 4, 4)


# --- a shard file that changes while a reader has it loaded ----------------------------------------

_SHRINK = r"""
import json, os, sys
import dvidshards
from dvidshards.errors import ShardFormatError

root, spec = sys.argv[1], json.loads(sys.argv[2])
path = os.path.join(root, "s0", "0_0_0.arrow")
vol = dvidshards.open(root, spec=spec)
ds = dvidshards.Dataset(root, spec=spec)
vol[0:64, 0:64, 0:64].read().result()  # the shard is loaded (TensorStore's reader) ...
ds.read([[0, 0, 0], [64, 64, 64]])  # ... and the bulk reader's
table = ds.shard(0, (0, 0, 0)).table()  # ... and a job's
table.block(0)
size = os.path.getsize(path)
os.truncate(path, size // 3)  # an export copied again over itself, a sync in progress
out = {}
for name, fn in (("tensorstore", lambda: vol[0:128, 0:128, 0:128].read().result()),
                 ("bulk", lambda: ds.read([[0, 0, 0], [128, 128, 128]])),
                 ("one chunk at a time", lambda: [ds.read([[x, y, z], [x + 64, y + 64, z + 64]])
                                                  for x in (0, 64) for y in (0, 64) for z in (0, 64)]),
                 ("job", lambda: [table.block(i) for i in range(len(table))])):
    try:
        fn()
        out[name] = "no error"
    except ShardFormatError as e:
        out[name] = str(e)
print(json.dumps(out))
"""


def test_a_shard_file_that_shrinks_while_loaded_is_a_typed_error_naming_it(exp, tmp_path):
    """Truncated after its shard was loaded: reading a chunk past the new end was SIGBUS through the
    memory map (the interpreter died); now every read path raises ShardFormatError naming the file
    and chunk and saying it changed. In a child process, so that a signal would fail the test, not
    kill the test run."""
    import json
    import subprocess
    import sys

    root = tmp_path / "exp"
    shutil.copytree(exp.root, root)
    r = subprocess.run([sys.executable, "-c", _SHRINK, str(root), json.dumps(exp.spec)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])  # -7 / 135: SIGBUS
    out = json.loads(r.stdout.strip().splitlines()[-1])
    path = str(root / "s0" / "0_0_0.arrow")
    for name, msg in out.items():
        assert msg.startswith(path + ": chunk (") and "changed since it was loaded" in msg and \
            "open the export again" in msg, (name, msg)


def test_a_shard_file_changed_in_place_after_load_is_a_typed_error(exp, tmp_path):
    """The same size, other bytes (a sync rewriting it in place): a ShardFormatError saying it changed,
    not a decode error blaming the data, nor the new bytes read as the old records."""
    from dvidshards.errors import ShardFormatError

    root = tmp_path / "exp"
    shutil.copytree(exp.root, root)
    ds = dvidshards.Dataset(str(root), spec=exp.spec)
    want = exp.expected(0)
    np.testing.assert_array_equal(ds.read([[0, 0, 0], [64, 64, 64]]), want[:64, :64, :64])
    vol = ds.open(0)
    np.testing.assert_array_equal(vol[0:64, 0:64, 0:64].read().result(), want[:64, :64, :64])
    path = root / "s0" / "0_0_0.arrow"
    data = bytearray(path.read_bytes())
    loaded = path.stat()
    with open(path, "r+b") as f:  # every byte after the schema flipped, in place
        f.seek(1024)
        f.write(bytes(b ^ 0x5A for b in data[1024:]))
    # a modification time of its own (a clock tick can be coarser than the write)
    os.utime(path, ns=(loaded.st_atime_ns, loaded.st_mtime_ns + 1_000_000_000))
    with pytest.raises(ShardFormatError, match="0_0_0.arrow: chunk .*: the file changed since it was loaded: it "
                                               "was modified since it was loaded"):
        ds.read([[0, 0, 0], [128, 128, 128]])
    with pytest.raises(ShardFormatError, match="was modified since it was loaded"):
        vol[0:128, 0:128, 0:128].read().result()
    # opened again, the file is read as it is now (here: damaged beyond its schema)
    with pytest.raises(dvidshards.errors.DvidShardsError):
        dvidshards.Dataset(str(root), spec=exp.spec).read([[0, 0, 0], [128, 128, 128]])


def test_a_shard_file_replaced_after_load_reads_as_loaded(exp, tmp_path, monkeypatch):
    """Replaced by a rename (what sync tools do): the loaded shard keeps reading the file it loaded,
    exactly; past the open-file limit, where each read opens the file again, that is a typed error."""
    from dvidshards.errors import ShardFormatError
    from dvidshards.stores import local

    root = tmp_path / "exp"
    shutil.copytree(exp.root, root)
    path = root / "s0" / "0_0_0.arrow"
    want = exp.expected(0)[:128, :128, :128]
    ds = dvidshards.Dataset(str(root), spec=exp.spec)
    ds.read([[0, 0, 0], [64, 64, 64]])
    vol = ds.open(0)
    vol[0:64, 0:64, 0:64].read().result()
    monkeypatch.setattr(local, "_cap", 0)  # shards loaded from now on keep no descriptor
    reopening = dvidshards.Dataset(str(root), spec=exp.spec)
    reopening.read([[0, 0, 0], [64, 64, 64]])
    assert reopening.shard(0, (0, 0, 0)).table().file._fd < 0
    tmp = root / "s0" / "new.tmp"
    tmp.write_bytes(b"\0" * path.stat().st_size)
    os.replace(tmp, path)
    np.testing.assert_array_equal(ds.read([[0, 0, 0], [128, 128, 128]]), want)
    np.testing.assert_array_equal(vol[0:128, 0:128, 0:128].read().result(), want)
    with pytest.raises(ShardFormatError, match=r"0_0_0\.arrow: chunk .*: the file changed since it was loaded"):
        reopening.read([[0, 0, 0], [128, 128, 128]])


def test_a_shard_file_that_shrinks_while_it_is_read_is_a_typed_error(exp, tmp_path, monkeypatch):
    """The load reads the whole file into memory (no map): a short read is a ShardFormatError."""
    from dvidshards.errors import ShardFormatError
    from dvidshards.stores import local

    real = local._preadinto
    monkeypatch.setattr(local, "_preadinto", lambda fd, buf, off: real(fd, memoryview(buf)[:100], off))
    with pytest.raises(ShardFormatError, match=r"0_0_0\.arrow: the file changed while it was read: 100 of its"):
        dvidshards.Dataset(exp.root, spec=exp.spec).read([[0, 0, 0], [64, 64, 64]])


# --- every read error names its chunk; failed loads remembered, transient ones not -------------------


def _dup_row(root):
    p = root / "s0" / "0_0_0.csv"
    lines = p.read_text().splitlines()
    p.write_text("\n".join(lines + [lines[3]]) + "\n")  # a shard-level index error


def _chunks_of_shard0():
    return [(x, y, z) for z in (0, 1) for y in (0, 1) for x in (0, 1)]


def _cbox(c):
    return [[64 * v for v in c], [min(64 * v + 64, s) for v, s in zip(c, THREE_SHARDS, strict=True)]]


@pytest.mark.parametrize("store", ["local", "http"])
def test_every_chunk_read_error_names_that_chunk(three_shards, tmp_path, store):
    root = copy_export(three_shards, tmp_path)
    _dup_row(root)
    with RangeServer(root) as srv:
        src = root if store == "local" else srv.url
        ds = Dataset(src, spec=three_shards.spec)
        vol = ds.open(0)
        for c in _chunks_of_shard0():
            cb = _cbox(c)
            with pytest.raises(ChunkIndexError) as e:
                ts_read(vol, cb)
            assert f"chunk {c}" in str(e.value) and "0_0_0" in str(e.value), (c, str(e.value))
            with pytest.raises(ChunkIndexError) as e:
                ds.read(cb)
            assert f"chunk {c}" in str(e.value), (c, str(e.value))


@pytest.mark.parametrize("store", ["local", "http"])
def test_a_failed_shard_load_is_not_repeated(three_shards, tmp_path, store, monkeypatch):
    import dvidshards.read as read_mod

    root = copy_export(three_shards, tmp_path)
    _dup_row(root)
    loads = []
    real = read_mod.load_shard

    async def counting(store_, scale, origin, **kw):
        loads.append(tuple(int(v) for v in origin))
        return await real(store_, scale, origin, **kw)

    monkeypatch.setattr(read_mod, "load_shard", counting)
    with RangeServer(root) as srv:
        ds = Dataset(root if store == "local" else srv.url, spec=three_shards.spec)
        vol = ds.open(0)
        for c in _chunks_of_shard0():
            cb = _cbox(c)
            with pytest.raises(ChunkIndexError):
                ts_read(vol, cb)
        assert loads.count((0, 0, 0)) == 1, loads
        for c in _chunks_of_shard0():
            cb = _cbox(c)
            with pytest.raises(ChunkIndexError):
                ds.read(cb)
        # "within one store, until the store is reopened": one more load for the bulk reader at most
        assert loads.count((0, 0, 0)) <= 2, loads
        # the other shards still read exactly
        ok = [[128, 0, 0], [300, 100, 70]]
        np.testing.assert_array_equal(ts_read(vol, ok), crop(three_shards, ok))


def test_a_transient_remote_failure_is_not_remembered(three_shards, tmp_path):
    root = copy_export(three_shards, tmp_path)
    with RangeServer(root) as srv:
        ds = Dataset(srv.url, spec=three_shards.spec)
        box = [[0, 0, 0], [128, 100, 70]]
        srv.set_faults(fail=1.0)
        with pytest.raises(DvidShardsError):
            ds.read(box)
        srv.set_faults()
        np.testing.assert_array_equal(ds.read(box), crop(three_shards, box))


# --- a record whose supervoxel list is not in its block's order --------------------------------------


@pytest.fixture(scope="module")
def reordered(three_shards, tmp_path_factory):
    """The export with one record of s0/0_0_0 holding its (supervoxel, label) pairs sorted by id,
    not in its block's order (the block itself untouched)."""
    from dvidshards.formats.codec import block_header
    from dvidshards.writer import write_shard

    root = Path(tmp_path_factory.mktemp("reordered")) / "exp"
    shutil.copytree(three_shards.root, root)
    recs = shard_records((root / "s0" / "0_0_0.arrow").read_bytes())
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
    return [lo, [min(a + 64, s) for a, s in zip(lo, THREE_SHARDS, strict=True)]]


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
def test_a_record_with_supervoxels_in_another_order_is_an_error_on_every_read_path(three_shards, reordered, policy,
                                                                                   labels):
    from dvidshards import BlockDecodeError

    root, chunk = reordered
    lab = three_shards.mapping if labels == "mapping" else labels
    ds = Dataset(root, spec=three_shards.spec, policy=policy)
    for how, read in _reads(ds, _chunk_box(chunk), lab):
        with pytest.raises(BlockDecodeError, match="supervoxel list is not its block's label list") as e:
            read()
        msg = str(e.value)
        assert "0_0_0.arrow" in msg and f"chunk {chunk}" in msg, (how, msg)
        assert "same ids in another order" in msg, (how, msg)
    # the other chunks of the shard read exactly
    other = [[0, 0, 0], [64, 64, 64]] if chunk != (0, 0, 0) else [[64, 0, 0], [128, 64, 64]]
    want = three_shards.expected(0, lab)
    (x0, y0, z0), (x1, y1, z1) = other
    np.testing.assert_array_equal(ds.read(other, labels=lab), want[x0:x1, y0:y1, z0:z1])


def test_verify_reports_the_reordered_record(three_shards, reordered):
    root, chunk = reordered
    report = dvidshards.verify(str(root), spec=three_shards.spec)
    assert not report.ok
    assert any(f"chunk {chunk}" in p.message and "0_0_0" in p.message for p in report.problems), report.summary()
