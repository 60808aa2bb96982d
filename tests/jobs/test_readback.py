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
    rep = convert(exp.root, base / "out", "precomputed", spec=exp.spec, progress=False)
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
    n, bad = got  # still unpacks as (chunks compared, problems)
    assert isinstance(got, SpotCheck) and bad == [] and n == got.with_data + got.background == 300
    # 3 of the 36 chunk slots are background: a background sample finds one in 16 draws 3 times in 4
    assert 100 <= got.background <= 150 and got.with_data >= 150
    assert got.describe() == f"300 chunks compared ({got.with_data} with data, {got.background} background)"
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
    assert compare_chunks(ds, arr, "precomputed", 0, "agglomerated", 0, np.random.default_rng(3)) == (0, [])
