"""to_dask: a scale as a dask array over the bulk reader, against the written volumes."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import dvidshards
from dvidshards.arrays import block_boxes, to_dask
from dvidshards.errors import MissingShardError, SpecError
from tests.support.exports import copy_export, make_export

da = pytest.importorskip("dask.array")


@pytest.fixture(scope="module")
def exp(tmp_path_factory):
    return make_export(tmp_path_factory.mktemp("arrays") / "exp", shape=(200, 170, 150), seed=4, scales=2)


def test_whole_scales_and_boxes(exp):
    ds = dvidshards.Dataset(exp.root, spec=exp.spec)
    for scale in (0, 1):
        a = to_dask(ds, scale, chunks=128, fill_missing_shards=True)
        assert a.dtype == np.uint64 and a.shape == exp.expected(scale).shape
        assert all(c % 128 == 0 for c in a.chunks[0][:-1])
        np.testing.assert_array_equal(a.compute(scheduler="threads"), exp.expected(scale))
    box = [[30, 64, 5], [190, 150, 140]]
    a = to_dask(ds, 0, "supervoxels", chunks=(64, 128, 64), box=box, fill_missing_shards=True)
    assert a.chunks[0][0] == 34 and a.chunks[1] == (64, 22) and a.chunks[2][0] == 59  # cut at the grid
    np.testing.assert_array_equal(a.compute(scheduler="sync"), exp.sv[30:190, 64:150, 5:140])
    assert int(a[100, 20, 70].compute()) == int(exp.sv[130, 84, 75])
    assert pickle.loads(pickle.dumps(a)).sum().compute() == a.sum().compute()


def test_errors(exp):
    ds = dvidshards.Dataset(exp.root, spec=exp.spec)
    with pytest.raises(SpecError, match="multiples"):
        to_dask(ds, 0, chunks=100)
    with pytest.raises(SpecError, match="inside the volume"):
        to_dask(ds, 0, box=[[0, 0, 0], [201, 10, 10]])
    lo, hi, edges = block_boxes(ds.scale(0), 256)
    assert edges[0] == [0, 200] and lo.tolist() == [0, 0, 0]


def test_a_shard_without_a_file_is_said_not_read_as_background(exp, tmp_path):
    """A shard file that is not there is a MissingShardError naming it; background only when asked."""
    root = copy_export(exp, tmp_path)
    ds = dvidshards.Dataset(root, spec=exp.spec)
    e = ds.scale(0).shard_extent
    x, y, z = gone = next(o for o in ds.shards(0) if any(o))
    stem = f"{x}_{y}_{z}"
    for p in (root / "s0").glob(stem + ".*"):
        p.unlink()
    ds = dvidshards.Dataset(root, spec=exp.spec)
    assert gone not in ds.shards(0) and exp.expected(0)[x:x + e, y:y + e, z:z + e].any()
    with pytest.raises(MissingShardError, match=stem):
        to_dask(ds, 0, chunks=64).compute(scheduler="sync")
    want = exp.expected(0).copy()
    want[x:x + e, y:y + e, z:z + e] = 0
    got = to_dask(ds, 0, chunks=64, fill_missing_shards=True).compute(scheduler="sync")
    np.testing.assert_array_equal(got, want)
