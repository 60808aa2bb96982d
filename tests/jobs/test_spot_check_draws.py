"""A spot check draws each chunk once: a source with fewer chunks than asked for has each of them
compared once, the count says how many were, and a chunk that differs is reported once."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tensorstore as ts

import dvidshards
from dvidshards import verify
from dvidshards.jobs.convert import convert
from dvidshards.jobs.readback import compare_chunks, kvstore_root, open_scale

SHAPE = (128, 128, 192)  # 2 x 2 x 3 = 12 chunk slots, 2-chunk shards


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    from dvidshards.demo.neurons import neuron_volume
    from dvidshards.writer import write_export

    sv, mapping = neuron_volume(SHAPE, n_bodies=6, svs_per_body=3, seed=4)
    sv[:, :, 128:] = 0  # chunk layer z=2 is background: no records there
    sv[64:, 64:, 64:128] = 0  # and one more chunk, in a shard that has records
    base = tmp_path_factory.mktemp("draws")
    spec = write_export(sv, base / "exp", mapping=mapping, scales=1, shard_chunks=2)
    assert convert(str(base / "exp"), base / "out", "precomputed", spec=spec, progress=False).ok
    ds = dvidshards.Dataset(str(base / "exp"), spec=spec)
    data = sum(len(ds.shard(0, o).index) for o in ds.shards(0))
    # brute force: the chunks holding a label are the ones with a record
    assert data == sum(bool(sv[x:x + 64, y:y + 64, z:z + 64].any()) for x in range(0, 128, 64)
                       for y in range(0, 128, 64) for z in range(0, 192, 64))
    return ds, base / "out", spec, data


def _scale0(out):
    m = json.loads((out / "_dvidshards.json").read_text())
    key = m["keys"]["0"] if "keys" in m else m["scales"]["0"]["key"]
    return key, open_scale(kvstore_root(out), "precomputed", key)


def test_more_draws_than_chunks_compare_each_chunk_once(small):
    ds, out, _, data = small
    assert data <= 7  # 12 slots: 4 in z=2 and one more are background
    _, arr = _scale0(out)
    got = compare_chunks(ds, arr, "precomputed", 0, "agglomerated", 500, np.random.default_rng(0))
    assert (got.with_data, got.background, got.problems) == (data, 12 - data, [])
    assert got.describe() == f"12 chunks compared ({data} with data, {12 - data} background)"
    few = compare_chunks(ds, arr, "precomputed", 0, "agglomerated", 6, np.random.default_rng(0))
    assert (few.with_data, few.background) == (3, 3)


def test_a_chunk_that_differs_is_reported_once(small, tmp_path):
    import shutil

    ds, out, spec, _ = small
    dest = tmp_path / "out"
    shutil.copytree(out, dest)
    key, _ = _scale0(dest)
    w = ts.open({"driver": "neuroglancer_precomputed", "kvstore": kvstore_root(dest), "scale_metadata": {"key": key}},
                read=True, write=True).result()[..., 0]
    c = tuple(int(v) for v in ds.shard(0, ds.shards(0)[0]).index.coords[0])  # a chunk with data
    sl = tuple(slice(64 * v, 64 * v + 64) for v in c)
    w[sl].write(w[sl].read().result() + 1).result()  # every voxel of it differs now
    report = verify(str(dest), spot_check=500, spec=spec)
    assert report.chunks == 12, report.summary()
    said = [p.message for p in report.problems if f"chunk {c}" in p.message]
    assert len(said) == 1 and "262144 voxels differ" in said[0] and len(report.problems) == 1, report.summary()
