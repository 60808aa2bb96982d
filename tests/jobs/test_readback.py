"""`verify OUT --spot-check N` and `convert --verify N`: chunks with data and background chunks.

The spot-check read only chunks the source holds, so garbage written into the output where the
source has none was never found ("3000 chunks compared: no problems"). Now half of its samples are
chunks inside the volume with no record in the source, which must read as 0 in the output, and it
says how many of each kind it compared.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil

import numpy as np
import pytest
import tensorstore as ts

import dvidshards
from dvidshards import verify
from dvidshards.cli import main as cli
from dvidshards.jobs.convert import convert
from dvidshards.jobs.readback import SpotCheck, compare_chunks, kvstore_root, open_scale
from tests.support.exports import Export, downsample_mode

SHAPE = (200, 170, 150)  # 4 x 3 x 3 chunks, 2-chunk shards


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """An export with a background chunk in a shard file (1, 0, 0) and a shard with no file (128_128_128),
    converted to precomputed."""
    from dvidshards.demo.neurons import neuron_volume
    from dvidshards.writer import write_export

    sv, mapping = neuron_volume(SHAPE, n_bodies=10, svs_per_body=4, seed=11)
    sv[64:128, :64, :64] = 0
    sv[128:, 128:, 128:] = 0
    base = tmp_path_factory.mktemp("spot")
    root = base / "exp"
    spec = write_export(sv, root, mapping=mapping, scales=1, shard_chunks=2)
    assert not os.path.exists(root / "s0" / "128_128_128.arrow")
    exp = Export(str(root), spec, sv, mapping, downsample_mode(sv, 1))
    rep = convert(exp.root, base / "out", format="precomputed", spec=exp.spec, progress=False)
    assert rep.ok and rep.complete, rep.summary()
    return exp, base / "out"


def _garbage(dest, box) -> None:
    """Write non-zero voxels over a box of the output's scale 0, through TensorStore's own driver."""
    m = json.loads((dest / "_dvidshards.json").read_text())
    key = m["keys"]["0"] if "keys" in m else m["scales"]["0"]["key"]
    out = ts.open({"driver": "neuroglancer_precomputed", "kvstore": kvstore_root(dest), "scale_metadata": {"key": key}},
                  read=True, write=True).result()[..., 0]
    sl = tuple(slice(a, b) for a, b in zip(*box, strict=True))
    shape = tuple(b - a for a, b in zip(*box, strict=True))
    out[sl].write(np.random.default_rng(1).integers(1, 1 << 40, shape, dtype=np.uint64)).result()


@pytest.mark.parametrize("where,box", [
    ("a background chunk of a shard file", [[64, 0, 0], [128, 64, 64]]),
    ("a shard with no file", [[128, 128, 128], [192, 170, 150]]),
])
def test_spot_check_finds_garbage_where_the_source_is_background(converted, tmp_path, where, box):
    exp, out = converted
    dest = tmp_path / "out"
    shutil.copytree(out, dest)
    report = verify(str(dest), spot_check=200, spec=exp.spec)
    assert report.ok, report.summary()  # untouched: no problems, and background was looked at
    _garbage(dest, box)
    report = verify(str(dest), spot_check=200, spec=exp.spec)
    assert not report.ok, (where, report.summary())
    c = tuple(v // 64 for v in box[0])
    assert any(f"chunk {c}" in p.message and "not 0 where the source has no data" in p.message
               for p in report.problems), report.summary()
    assert cli(["verify", str(dest), "--spot-check", "200", "--quiet"]) == 1


def test_spot_check_counts_each_kind(converted):
    exp, out = converted
    ds = dvidshards.Dataset(exp.root, spec=exp.spec)
    m = json.loads((out / "_dvidshards.json").read_text())
    key = m["keys"]["0"] if "keys" in m else m["scales"]["0"]["key"]
    arr = open_scale(kvstore_root(out), "precomputed", key)
    got = compare_chunks(ds, arr, "precomputed", 0, "agglomerated", 300, np.random.default_rng(3))
    # 36 chunk slots, fewer than 300 draws: each compared once, those with records and the others
    data = sum(len(ds.shard(0, o).index) for o in ds.shards(0))
    assert isinstance(got, SpotCheck) and got.problems == [] and got.compared == 36
    assert (got.with_data, got.background) == (data, 36 - data) and 0 < 36 - data < 36
    assert got.describe() == f"36 chunks compared ({data} with data, {36 - data} background)"
    half = compare_chunks(ds, arr, "precomputed", 0, "agglomerated", 10, np.random.default_rng(3))
    assert (half.with_data, half.background, half.problems) == (5, 5, [])
    assert pickle.loads(pickle.dumps(got)) == got and pickle.loads(pickle.dumps(got)).background == got.background
    # a volume with no background gives the background's share to chunks with data
    dense = dvidshards.Dataset(exp.root, spec=exp.spec)
    saved = compare_chunks.__globals__["_BACKGROUND_TRIES"]
    compare_chunks.__globals__["_BACKGROUND_TRIES"] = 0
    try:
        only = compare_chunks(dense, arr, "precomputed", 0, "agglomerated", 10, np.random.default_rng(3))
    finally:
        compare_chunks.__globals__["_BACKGROUND_TRIES"] = saved
    assert (only.with_data, only.background, only.problems) == (10, 0, [])
    assert compare_chunks(ds, arr, "precomputed", 0, "agglomerated", 0, np.random.default_rng(3)) == SpotCheck(0, 0, [])


def test_spot_check_of_a_boxed_conversion_compares_the_box(converted, tmp_path):
    """`convert --box` writes the box and 0 elsewhere: `verify --spot-check` compares the chunks
    meeting the box (the source read as 0 outside it), reports no difference outside it, and finds
    a change inside it."""
    exp, _ = converted
    box = [[10, 20, 30], [150, 100, 90]]
    dest = tmp_path / "boxed"
    assert convert(exp.root, dest, format="precomputed", spec=exp.spec, box=box, progress=False).ok
    meet = [(x, y, z) for x in range(4) for y in range(3) for z in range(3)
            if all(64 * c < b and 64 * c + 64 > a for c, a, b in zip((x, y, z), *box, strict=True))]
    report = verify(str(dest), spot_check=500, spec=exp.spec)
    assert report.ok and report.chunks == len(meet) == 12, report.summary()
    got = compare_chunks(dvidshards.Dataset(exp.root, spec=exp.spec), _scale0_of(dest)[1], "precomputed", 0,
                         "agglomerated", 500, np.random.default_rng(0), box=box)
    with_data = sum(bool(exp.sv[64 * x:64 * x + 64, 64 * y:64 * y + 64, 64 * z:64 * z + 64].any()) for x, y, z in meet)
    assert (got.with_data, got.background, got.problems) == (with_data, len(meet) - with_data, [])
    assert cli(["verify", str(dest), "--spot-check", "50", "--spec", _spec_file(exp, tmp_path), "--quiet"]) == 0
    _garbage(dest, [[100, 70, 40], [101, 71, 41]])  # one voxel inside the box
    report = verify(str(dest), spot_check=500, spec=exp.spec)
    assert [p.message for p in report.problems] == [f"{dest}/_dvidshards.json: s0 chunk (1, 1, 0): 1 voxels differ "
                                                    f"from the source"], report.summary()


def test_verify_spot_checks_an_output_given_as_a_store(converted):
    from dvidshards.stores import as_store

    exp, out = converted
    report = verify(as_store(str(out)), spot_check=10, spec=exp.spec)
    assert report.ok and report.chunks == 10, report.summary()


def _spec_file(exp, tmp_path) -> str:
    p = tmp_path / "spec.json"
    p.write_text(json.dumps(exp.spec))
    return str(p)


# --------------------------------------------------------------------------- each chunk drawn once

SMALL = (128, 128, 192)  # 2 x 2 x 3 = 12 chunk slots, 2-chunk shards


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    from dvidshards.demo.neurons import neuron_volume
    from dvidshards.writer import write_export

    sv, mapping = neuron_volume(SMALL, n_bodies=6, svs_per_body=3, seed=4)
    sv[:, :, 128:] = 0  # chunk layer z=2 is background: no records there
    sv[64:, 64:, 64:128] = 0  # and one more chunk, in a shard that has records
    base = tmp_path_factory.mktemp("draws")
    spec = write_export(sv, base / "exp", mapping=mapping, scales=1, shard_chunks=2)
    assert convert(str(base / "exp"), base / "out", format="precomputed", spec=spec, progress=False).ok
    ds = dvidshards.Dataset(str(base / "exp"), spec=spec)
    data = sum(len(ds.shard(0, o).index) for o in ds.shards(0))
    # brute force: the chunks holding a label are the ones with a record
    assert data == sum(bool(sv[x:x + 64, y:y + 64, z:z + 64].any()) for x in range(0, 128, 64)
                       for y in range(0, 128, 64) for z in range(0, 192, 64))
    return ds, base / "out", spec, data


def _scale0_of(out):
    m = json.loads((out / "_dvidshards.json").read_text())
    key = m["keys"]["0"] if "keys" in m else m["scales"]["0"]["key"]
    return key, open_scale(kvstore_root(out), "precomputed", key)


def test_more_draws_than_chunks_compare_each_chunk_once(small):
    ds, out, _, data = small
    assert data <= 7  # 12 slots: 4 in z=2 and one more are background
    _, arr = _scale0_of(out)
    got = compare_chunks(ds, arr, "precomputed", 0, "agglomerated", 500, np.random.default_rng(0))
    assert (got.with_data, got.background, got.problems) == (data, 12 - data, [])
    assert got.describe() == f"12 chunks compared ({data} with data, {12 - data} background)"
    few = compare_chunks(ds, arr, "precomputed", 0, "agglomerated", 6, np.random.default_rng(0))
    assert (few.with_data, few.background) == (3, 3)


def test_a_chunk_that_differs_is_reported_once(small, tmp_path):
    ds, out, spec, _ = small
    dest = tmp_path / "out"
    shutil.copytree(out, dest)
    key, _ = _scale0_of(dest)
    w = ts.open({"driver": "neuroglancer_precomputed", "kvstore": kvstore_root(dest), "scale_metadata": {"key": key}},
                read=True, write=True).result()[..., 0]
    c = tuple(int(v) for v in ds.shard(0, ds.shards(0)[0]).index.coords[0])  # a chunk with data
    sl = tuple(slice(64 * v, 64 * v + 64) for v in c)
    w[sl].write(w[sl].read().result() + 1).result()  # every voxel of it differs now
    report = verify(str(dest), spot_check=500, spec=spec)
    assert report.chunks == 12, report.summary()
    said = [p.message for p in report.problems if f"chunk {c}" in p.message]
    assert len(said) == 1 and "262144 voxels differ" in said[0] and len(report.problems) == 1, report.summary()
