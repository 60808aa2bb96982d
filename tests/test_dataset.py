"""dvidshards.open: an export as a TensorStore volume, checked against the volumes it was written from."""

from __future__ import annotations

import concurrent.futures as cf
import json
import multiprocessing as mp
import pickle

import numpy as np
import pytest
import tensorstore as ts

import dvidshards
from dvidshards.formats.codec import decode_block
from tests.conftest import REAL_SHARD


def _boxes(shape, rng, n):
    """Aligned, unaligned, single-voxel, edge-touching and shard-crossing boxes."""
    sx, sy, sz = shape
    yield tuple(slice(0, min(64, s)) for s in shape)
    yield np.s_[:, :, :]
    yield np.s_[sx - 1:sx, sy - 1:sy, sz - 1:sz]
    yield tuple(slice(v % s, v % s + 1) for v, s in zip((5, 77, 130), shape, strict=True))
    yield tuple(slice(s // 2, s) for s in shape)  # to the volume edge
    # across chunk and (at scale 0) shard corners: shards are 128 voxels
    yield tuple(slice(max(0, min(s, 136) - 16), min(s, 136)) for s in shape)
    for _ in range(n):
        lo = [int(rng.integers(0, s)) for s in shape]
        hi = [int(rng.integers(a + 1, min(s, a + 140) + 1)) for a, s in zip(lo, shape, strict=True)]
        yield tuple(slice(a, b) for a, b in zip(lo, hi, strict=True))


@pytest.mark.parametrize("labels", ["agglomerated", "supervoxels", "mapping"])
def test_boxes_equal_written_volume(synthetic_export, labels):
    ex = synthetic_export
    rng = np.random.default_rng(1)
    mapping = None
    if labels == "mapping":  # a newer mapping: merge bodies and leave some supervoxels unmapped
        m = ex.mapping.copy()
        m[:, 1] = m[0, 1]
        mapping = m[::2]
    for k in range(len(ex.scales)):
        vol = dvidshards.open(ex.root, scale=k, labels=mapping if mapping is not None else labels, spec=ex.spec)
        want = ex.expected(k, mapping if mapping is not None else labels)
        assert vol.shape == want.shape and vol.dtype == ts.uint64
        assert list(vol.domain.labels) == ["x", "y", "z"]
        for box in _boxes(want.shape, rng, 8 if k == 0 else 3):
            got = vol[box].read(order="F").result()
            np.testing.assert_array_equal(got, want[box], err_msg=f"scale {k} box {box}")


def test_chunk_layout_and_units(synthetic_export):
    vol = dvidshards.open(synthetic_export.root, spec=synthetic_export.spec, scale=1)
    layout = vol.chunk_layout
    assert list(layout.read_chunk.shape) == [64, 64, 64]
    assert list(layout.grid_origin) == [0, 0, 0]
    assert list(layout.inner_order) == [2, 1, 0]
    assert [u.multiplier for u in vol.dimension_units] == [16, 16, 16]


def test_scale_by_resolution_and_dataset(synthetic_export):
    ds = dvidshards.Dataset(synthetic_export.root, spec=synthetic_export.spec)
    assert ds.scale((16, 16, 16)).index == 1 and ds.scale(resolution=(32, 32, 32)).index == 2
    with pytest.raises(dvidshards.SpecError, match="resolution"):
        ds.scale(32.0)  # a bare number is not a resolution
    assert ds.info["scales"][0]["size"] == list(synthetic_export.sv.shape)
    with pytest.raises(dvidshards.SpecError):
        ds.scale(5)
    with pytest.raises(dvidshards.SpecError):
        dvidshards.open(synthetic_export.root, spec=synthetic_export.spec, labels="supervoxel")


def test_geometry_inferred_without_spec(synthetic_export):
    """No spec and no info: shard extent from file names, size = whole chunks up to the last one present."""
    with pytest.warns(dvidshards.GeometryWarning, match="guessed from its file names") as rec:
        ds = dvidshards.Dataset(synthetic_export.root)
    assert len(rec) == 1 and rec[0].filename == __file__  # once, and at the caller's line
    s0 = ds.scales[0]
    assert s0.shard_extent == 128 and s0.inferred
    nz = np.argwhere(synthetic_export.sv)
    last = (nz.max(axis=0) // 64 + 1) * 64  # data present in the last chunk of each axis
    assert s0.size == tuple(int(v) for v in last)
    n = [min(a, b) for a, b in zip(s0.size, synthetic_export.sv.shape, strict=True)]
    got = ds.open(0)[: n[0], : n[1], : n[2]].read(order="F").result()
    np.testing.assert_array_equal(got, synthetic_export.expected(0)[: n[0], : n[1], : n[2]])


def test_info_file_in_export(tmp_path):
    from tests.conftest import make_export

    ex = make_export(tmp_path / "e", shape=(130, 70, 64), scales=1, info=True)
    vol = dvidshards.open(ex.root)  # geometry from ./info
    np.testing.assert_array_equal(vol.read(order="F").result(), ex.expected(0))


def test_missing_chunk_is_background_missing_shard_is_error(tmp_path, synthetic_export):
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(synthetic_export.root, root)
    (root / "s0" / "128_0_0.arrow").unlink()
    vol = dvidshards.open(root, spec=synthetic_export.spec)
    with pytest.raises(dvidshards.MissingShardError, match="128_0_0.arrow"):
        vol[130:140, 0:10, 0:10].read().result()
    filled = dvidshards.open(root, spec=synthetic_export.spec, fill_missing_shards=True)
    assert not filled[128:200, 0:128, 0:128].read().result().any()
    np.testing.assert_array_equal(filled[0:128, 0:128, 0:128].read(order="F").result(),
                                  synthetic_export.expected(0)[0:128, 0:128, 0:128])


def test_real_shard_every_chunk_equals_its_record(dvid_data, tmp_path, real_records):
    """The real mCNS shard opened as a one-shard dataset (scale 1 of the real spec)."""
    (tmp_path / "s1").mkdir()
    (tmp_path / "s1" / f"{REAL_SHARD}.arrow").symlink_to(dvid_data / f"{REAL_SHARD}.arrow")
    (tmp_path / "s1" / f"{REAL_SHARD}.csv").symlink_to(dvid_data / f"{REAL_SHARD}-newformat.csv")
    spec = json.loads((dvid_data / "mcns-ng-specs.json").read_text())
    agg = dvidshards.open(tmp_path, scale=1, spec=spec)
    svs = dvidshards.open(tmp_path, scale=1, spec=spec, labels="supervoxels")
    for r in real_records:
        box = tuple(slice(64 * c, 64 * c + 64) for c in (r["chunk_x"], r["chunk_y"], r["chunk_z"]))
        got = agg[box].read(order="F").result()
        np.testing.assert_array_equal(got.T, decode_block(r["block"], np.array(r["labels"], np.uint64)))
        np.testing.assert_array_equal(svs[box].read(order="F").result().T, decode_block(r["block"]))
    # a chunk of the shard's box with no record reads as 0
    assert not agg[500 * 64:501 * 64, 413 * 64:414 * 64, 469 * 64:470 * 64].read().result().any()


def _read_in_child(payload):
    store, box = pickle.loads(payload)
    return store[box].read(order="F").result()


def test_pickle_into_spawn_process(synthetic_export):
    vol = dvidshards.open(synthetic_export.root, spec=synthetic_export.spec, labels="supervoxels")
    box = np.s_[50:190, 20:150, 10:140]
    vol[box].read().result()  # TensorStore threads are running: the child must be spawned
    payload = pickle.dumps((vol, box))
    with cf.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        got = pool.submit(_read_in_child, payload).result(timeout=300)
    np.testing.assert_array_equal(got, synthetic_export.expected(0, "supervoxels")[box])


def test_threads_agree_with_serial(synthetic_export):
    vol = dvidshards.open(synthetic_export.root, spec=synthetic_export.spec,
                          context=ts.Context({"data_copy_concurrency": {"limit": 4}}))
    rng = np.random.default_rng(5)
    boxes = list(_boxes(synthetic_export.sv.shape, rng, 24))
    serial = [vol[b].read(order="F").result() for b in boxes]
    with cf.ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(lambda b=b: vol[b].read(order="F").result()) for b in boxes]
        for f, want in zip(futs, serial, strict=True):
            np.testing.assert_array_equal(f.result(timeout=120), want)


def test_body_and_to_dask_methods_delegate(tmp_path):
    """ds.body(id) and ds.to_dask() are the Body API and arrays.to_dask on this dataset."""
    pytest.importorskip("dask.array")
    from dvidshards.bodies import Body
    from tests.conftest import make_export

    exp = make_export(tmp_path / "exp", shape=(130, 100, 70), seed=5, scales=1)
    ds = dvidshards.Dataset(exp.root, spec=exp.spec)
    bodies = exp.expected(0)
    ids, counts = np.unique(bodies[bodies != 0], return_counts=True)
    b = ds.body(int(ids[np.argmax(counts)]))
    assert isinstance(b, Body) and b.size == int(counts.max())
    a = ds.to_dask(scale=0, labels="supervoxels", chunks=64, fill_missing_shards=True)
    np.testing.assert_array_equal(a.compute(scheduler="sync"), exp.sv)
    box = [[0, 0, 0], [64, 100, 70]]
    a = ds.to_dask(box, labels="supervoxels", chunks=64, fill_missing_shards=True)
    np.testing.assert_array_equal(a.compute(scheduler="sync"), exp.sv[:64])
    with pytest.warns(DeprecationWarning, match="by keyword"):  # the old spelling, for one release
        a = ds.to_dask(0, "supervoxels", chunks=64, fill_missing_shards=True)
    np.testing.assert_array_equal(a.compute(scheduler="sync"), exp.sv)
    with pytest.warns(DeprecationWarning, match="by keyword"):
        np.testing.assert_array_equal(ds.read(box, 0, "supervoxels"), exp.sv[:64])
    with pytest.warns(DeprecationWarning, match="by keyword"):
        assert ds.body(int(ids[np.argmax(counts)]), 0).size == b.size
