"""RecordTable from Arrow record batches: column names, split cells, offsets."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import zstandard

from dvidshards.errors import ShardFormatError
from dvidshards.formats.arrowipc import R_LAB, R_SV
from dvidshards.formats.records import RecordTable

PAY = [zstandard.ZstdCompressor().compress(b"x" * 100), zstandard.ZstdCompressor().compress(bytes(range(256)) * 3)]


def _batch(**cols):
    d = {"chunk_x": pa.array([0, 1], pa.int32()), "chunk_y": pa.array([0, 0], pa.int32()),
         "chunk_z": pa.array([2, 2], pa.int32()),
         "labels": pa.array([[7], [8, 9]], pa.list_(pa.uint64())),
         "supervoxels": pa.array([[1], [2, 3]], pa.list_(pa.uint64()))}
    d.update(cols)
    return pa.record_batch(d)


def test_whole_payloads_are_zero_copy():
    b = _batch(dvid_compressed_block=pa.array(PAY))
    t = RecordTable.from_batch(b, "t")
    assert [bytes(t.payload(i)) for i in range(2)] == PAY
    assert np.shares_memory(t.payload(1), np.frombuffer(b.column(5).buffers()[2], np.uint8))
    assert t.labels(1).tolist() == [8, 9] and t.supervoxels(0).tolist() == [1]
    assert t.coords.tolist() == [[0, 0, 2], [1, 0, 2]]


def test_prototype_names_and_split_cells_reassemble():
    p = PAY[1]
    b = pa.record_batch({"block_coord_x": pa.array([0, 1], pa.int32()), "block_coord_y": pa.array([0, 0], pa.int32()),
                         "block_coord_z": pa.array([2, 2], pa.int32()),
                         "labels": pa.array([[7], [8, 9]], pa.list_(pa.uint64())),
                         "supervoxels": pa.array([[1], [2, 3]], pa.list_(pa.uint64())),
                         "compressed_data": pa.array([PAY[0], None], pa.binary()),
                         "bin1": pa.array([None, p[:10]], pa.binary()), "bin2": pa.array([None, p[10:500]], pa.binary()),
                         "bin3": pa.array([None, p[500:]], pa.binary()), "bin4": pa.array([None, None], pa.binary())})
    t = RecordTable.from_batch(b, "t")
    assert [bytes(t.payload(i)) for i in range(2)] == PAY
    assert zstandard.ZstdDecompressor().decompress(bytes(t.payload(1))) == bytes(range(256)) * 3


def test_only_bin1_is_zero_copy():
    b = _batch(bin1=pa.array(PAY), bin2=pa.array([None, None], pa.binary()))
    t = RecordTable.from_batch(b, "t")
    assert [bytes(t.payload(i)) for i in range(2)] == PAY
    assert np.shares_memory(t.payload(0), np.frombuffer(b.column("bin1").buffers()[2], np.uint8))


@pytest.mark.parametrize("cols,match", [
    ({"bin1": pa.array([PAY[0], None], pa.binary()), "bin2": pa.array([None, PAY[1]], pa.binary())}, "bin2 but no bin1"),
    ({"bin1": pa.array([PAY[0], None], pa.binary())}, "neither dvid_compressed_block nor bin1"),
    ({"dvid_compressed_block": pa.array([PAY[0], None], pa.binary())}, "has nulls"),
])
def test_bad_cells_are_typed(cols, match):
    with pytest.raises(ShardFormatError, match=match):
        RecordTable.from_batch(_batch(**cols), "t")


def test_sliced_batches_keep_their_offsets():
    b = _batch(dvid_compressed_block=pa.array(PAY)).slice(1, 1)
    t = RecordTable.from_batch(b, "t")
    assert len(t) == 1 and bytes(t.payload(0)) == PAY[1] and t.labels(0).tolist() == [8, 9]


def test_concat_keeps_every_record_whether_buffers_are_shared_or_not():
    parts = [RecordTable.from_batch(_batch(dvid_compressed_block=pa.array(PAY)), "t"),
             RecordTable.from_batch(_batch(dvid_compressed_block=pa.array(PAY[::-1])), "t")]

    def records(t):
        return [(bytes(t.payload(i)), t.labels(i).tolist(), t.supervoxels(i).tolist()) for i in range(len(t))]

    t = RecordTable.concat(parts, "t")  # separate buffers per column (tables, Flight)
    assert records(t) == records(parts[0]) + records(parts[1])
    one = [RecordTable(p.rec, (b, b, b), "t") for p in parts for b in
           [np.concatenate([p.bufs[0], p.bufs[1], p.bufs[2]])]]  # one buffer per part (byte ranges of a file)
    for p, o in zip(parts, one, strict=True):
        o.rec = p.rec.copy()
        o.rec[:, R_LAB] += p.bufs[0].shape[0]
        o.rec[:, R_SV] += p.bufs[0].shape[0] + p.bufs[1].shape[0]
    t = RecordTable.concat(one, "t")
    assert t.bufs[0] is t.bufs[1] is t.bufs[2] and t.bufs[0].shape[0] == sum(o.bufs[0].shape[0] for o in one)
    assert records(t) == records(parts[0]) + records(parts[1])
    assert RecordTable.concat([], "t").rec.shape == (0, len(t.rec[0])) and RecordTable.concat(parts[:1], "t") is parts[0]


def _dvid_records(sv_lists, label_lists):
    """A table of 64³ DVID blocks whose label lists are the given ones (a block per list)."""
    from dvidshards.formats.codec import encode_block

    blocks = []
    for sv in sv_lists:
        vol = np.zeros((64, 64, 64), np.uint64)
        for k, v in enumerate(sv):  # one slab per label, in list order: the block lists them so
            vol[k * 64 // len(sv):(k + 1) * 64 // len(sv)] = v
        blocks.append(encode_block(vol))
    n = len(blocks)
    b = pa.record_batch({
        "chunk_x": pa.array(range(n), pa.int32()), "chunk_y": pa.array([0] * n, pa.int32()),
        "chunk_z": pa.array([0] * n, pa.int32()),
        "labels": pa.array(label_lists, pa.list_(pa.uint64())),
        "supervoxels": pa.array([sv for sv in sv_lists], pa.list_(pa.uint64())),
        "dvid_compressed_block": pa.array([zstandard.ZstdCompressor().compress(x) for x in blocks]),
        "uncompressed_size": pa.array([len(x) for x in blocks], pa.uint32())})
    return RecordTable.from_batch(b, "t.arrow"), blocks


def test_labels_match_is_the_block_label_list_entry_for_entry():
    from dvidshards.formats.codec import block_header

    t, blocks = _dvid_records([[5, 3, 9], [4]], [[50, 30, 90], [40]])
    assert block_header(blocks[0]).labels.tolist() == [5, 3, 9]
    assert t.labels_match(0, blocks[0]) and t.labels_match(1, blocks[1])
    assert t.labels_match(0, np.frombuffer(blocks[0], np.uint8))  # bytes or a uint8 view
    assert not t.labels_match(1, blocks[0]) and not t.labels_match(0, blocks[0][:30])


def test_a_record_listing_its_supervoxels_sorted_is_a_typed_error_on_decode_and_block():
    from dvidshards.errors import BlockDecodeError
    from dvidshards.formats.labels import as_labels

    # block order 5, 3, 9; the record lists the same pairs sorted by supervoxel
    t, blocks = _dvid_records([[5, 3, 9]], [[50, 30, 90]])
    good = np.empty((64, 64, 64), np.uint64)
    t.decode_into(0, good, as_labels("agglomerated"))
    assert np.unique(good).tolist() == [30, 50, 90]
    bad = RecordTable.from_batch(pa.record_batch({
        "chunk_x": pa.array([0], pa.int32()), "chunk_y": pa.array([0], pa.int32()), "chunk_z": pa.array([0], pa.int32()),
        "labels": pa.array([[30, 50, 90]], pa.list_(pa.uint64())),
        "supervoxels": pa.array([[3, 5, 9]], pa.list_(pa.uint64())),
        "dvid_compressed_block": pa.array([zstandard.ZstdCompressor().compress(blocks[0])]),
        "uncompressed_size": pa.array([len(blocks[0])], pa.uint32())}), "t.arrow")
    for labels in ("agglomerated", "supervoxels", {3: 1, 5: 2, 9: 3}):
        with pytest.raises(BlockDecodeError, match=r"t.arrow: chunk \(0, 0, 0\): .*same ids in another order"):
            bad.decode_into(0, np.empty((64, 64, 64), np.uint64), as_labels(labels))
    with pytest.raises(BlockDecodeError, match="entry 0 is 3 in the record, 5 in the block"):
        bad.block(0)


# --- a local file's table: lists in memory, payloads read from the file ---------------------------

def _real_pair(dvid_data, tmp_path):
    """The real mCNS shard loaded from its file (a file's table) and from the same bytes in memory."""
    from dvidshards.stores import MemoryStore
    from tests.support.exports import load_shard

    stem = "s1/30720_24576_28672"
    (tmp_path / "s1").mkdir()
    files = {}
    for ext, name in ((".arrow", "30720_24576_28672.arrow"), (".csv", "30720_24576_28672.csv")):
        (tmp_path / (stem + ext)).symlink_to(dvid_data / name)
        files[stem + ext] = (dvid_data / name).read_bytes()
    local = load_shard(tmp_path, stem, extent=2048).table()
    memory = load_shard(None, stem, extent=2048, store=MemoryStore(files)).table()
    return local, memory


def test_a_files_table_reads_exactly_what_the_bytes_in_memory_read(dvid_data, tmp_path):
    import pickle

    from dvidshards.formats.labels import as_labels
    from dvidshards.formats.records import list_values

    t, m = _real_pair(dvid_data, tmp_path)
    assert t.file is not None and m.file is None and len(t) == len(m) == 258
    np.testing.assert_array_equal(t.coords, m.coords)
    for i in range(len(t)):
        assert bytes(t.payload(i)) == bytes(m.payload(i)) and t.block(i) == m.block(i)
        assert t.labels(i).tolist() == m.labels(i).tolist() and t.supervoxels(i).tolist() == m.supervoxels(i).tolist()
    for which in ("labels", "supervoxels"):
        for a, b in zip(list_values(t, which), list_values(m, which), strict=True):
            np.testing.assert_array_equal(a, b)
    assert t._whole is None  # nothing so far read the whole file: lists are in memory, payloads read one by one
    out_t, out_m = np.empty((64, 64, 64), np.uint64), np.empty((64, 64, 64), np.uint64)
    for labels in ("agglomerated", "supervoxels"):
        for i in (0, 100, 257):
            t.decode_into(i, out_t, as_labels(labels))
            m.decode_into(i, out_m, as_labels(labels))
            np.testing.assert_array_equal(out_t, out_m)
    rows = np.array([200, 3, 4, 5, 250, 3], np.int64)  # any order, repeats, gaps
    buf, off, ln = t.gather_payloads(rows)
    assert [bytes(buf[o:o + n]) for o, n in zip(off, ln, strict=True)] == [bytes(m.payload(int(i))) for i in rows]
    assert len(buf) < sum(len(m.payload(i)) for i in range(len(m)))  # only those records were read
    sub, back = t.take(rows), pickle.loads(pickle.dumps(t))
    assert sub.file is t.file and [bytes(sub.payload(k)) for k in range(len(rows))] == \
        [bytes(m.payload(int(i))) for i in rows]
    assert back.file.path == t.file.path and back.block(7) == m.block(7)
    joined = RecordTable.concat([t.take([0, 1]), t.take([2])], "j")
    assert joined.file is t.file and [joined.block(k) for k in range(3)] == [m.block(k) for k in range(3)]
    assert t.nbytes < 0.2 * t.file.size  # locations and lists; the payloads stay in the file
    whole = t.bufs[0]  # the old whole-buffer view, for code that indexes it: read once, then kept
    assert t.bufs[0] is whole and [bytes(whole[o:o + n]) for o, n in t.rec[:5, 4:6]] == \
        [bytes(m.payload(i)) for i in range(5)]


@pytest.mark.parametrize("batch_size", [1, 3, 16])
def test_a_files_table_copies_the_lists_of_every_batch_layout(tmp_path, batch_size):
    """Records one per batch (lists gathered) or many per batch (one copy per batch) read the same
    as the file's bytes in memory."""
    from dvidshards.formats.multiscale import parse_multiscale
    from dvidshards.shard import load_shard_sync
    from dvidshards.stores import LocalStore, MemoryStore
    from tests.support.exports import make_export

    exp = make_export(tmp_path / "exp", scales=1, shard_chunks=4, batch_size=batch_size)
    scale = parse_multiscale(exp.spec)[0]
    for f in sorted((tmp_path / "exp" / "s0").glob("*.arrow")):
        origin = tuple(int(v) for v in f.stem.split("_"))
        files = {f"s0/{g.name}": g.read_bytes() for g in f.parent.glob(f.stem + ".*")}
        t = load_shard_sync(LocalStore(tmp_path / "exp"), scale, origin).table()
        m = load_shard_sync(MemoryStore(files), scale, origin).table()
        assert t.file is not None and len(t) == len(m) > 0
        for i in range(len(t)):
            assert t.labels(i).tolist() == m.labels(i).tolist()
            assert t.supervoxels(i).tolist() == m.supervoxels(i).tolist() and t.block(i) == m.block(i)


def test_decode_into_is_block_then_palette_then_codec_decode_into(dvid_data, tmp_path):
    """The read path's one function (no per-chunk calls between the checks) gives what its
    parts give, for every label source, aligned tables or not, and any output layout; the same errors."""
    from dvidshards.errors import BlockDecodeError
    from dvidshards.formats.codec import decode_into
    from dvidshards.formats.labels import as_labels

    t, m = _real_pair(dvid_data, tmp_path)
    unaligned = RecordTable(m.rec.copy(), m.bufs, m.path)
    unaligned._aligned, unaligned._labv = False, None  # a writer that did not align its lists
    mapping = {int(s): 1000 + k for k, s in enumerate(np.unique(np.concatenate(
        [m.supervoxels(i) for i in range(len(m))]))) if s}
    outs = [np.empty((64, 64, 64), np.uint64), np.empty((64, 64, 64), np.uint64, order="F"),
            np.empty((70, 64, 64), np.uint64)[3:67, :, :], np.empty((64, 64, 64), np.uint64)[:40, :33, :17]]
    for labels in ("agglomerated", "supervoxels", mapping):
        src = as_labels(labels)
        for i in (0, 1, 57, 196, 257):
            want = np.empty((64, 64, 64), np.uint64)
            decode_into(np.frombuffer(m.block(i), np.uint8), src.palette(m, i), want)
            for table in (t, m, unaligned):
                for out in outs:
                    out.fill(7)
                    table.decode_into(i, out, src)
                    np.testing.assert_array_equal(out, want[tuple(slice(0, n) for n in out.shape)])
    with pytest.raises(BlockDecodeError, match=r"30720_24576_28672.arrow: chunk .*: out is read-only"):
        ro = np.empty((64, 64, 64), np.uint64)
        ro.flags.writeable = False
        t.decode_into(3, ro, as_labels("agglomerated"))
    with pytest.raises(BlockDecodeError, match=r"chunk .*: out shape \(65, 64, 64\) exceeds block shape"):
        t.decode_into(3, np.empty((65, 64, 64), np.uint64), as_labels("agglomerated"))
