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
    assert t.block(1) == bytes(range(256)) * 3


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
