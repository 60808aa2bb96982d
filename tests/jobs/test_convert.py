"""dvidshards.jobs.convert: outputs read back with plain TensorStore, resume, planner refusals, dask."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
import tensorstore as ts

import dvidshards
from dvidshards.errors import DvidShardsError, JobError, NotExportedError, OutputError, SpecError
from dvidshards.formats.codec import decode_block
from dvidshards.formats.mapping import LabelMapping
from dvidshards.formats.sharding import compressed_morton_code
from dvidshards.jobs.convert import convert, plan
from dvidshards.jobs.layouts import (
    ZARR_INDEX_CODECS,
    ConvertPlanError,
    existing_chunks,
    scale_layout,
)
from dvidshards.stores import as_store
from tests.support.blocks import ts_encode_chunks
from tests.support.exports import make_export


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """3 scales, 200x170x150 voxels, 2-chunk shards: several shards, edge chunks everywhere."""
    return make_export(tmp_path_factory.mktemp("conv") / "exp")


def read_back(dest, fmt, key, shape=None):
    """A whole scale read with TensorStore's own driver (not through dvidshards), x, y, z."""
    if fmt == "precomputed":
        t = ts.open({"driver": "neuroglancer_precomputed", "kvstore": f"file://{dest}/",
                     "scale_metadata": {"key": key}}).result()
        assert t.domain.inclusive_min[:3] == (0, 0, 0)
        return t[..., 0].read().result()
    return ts.open({"driver": "zarr3", "kvstore": f"file://{dest}/{key}/"}).result().read().result()


def stored_chunk_keys(dest, fmt, sp):
    """Chunk keys actually stored in the output (sharded kvstore listing / zarr shard indexes)."""
    if fmt == "precomputed":
        kv = ts.KvStore.open({"driver": "neuroglancer_uint64_sharded", "base": f"file://{dest}/{sp.key}/",
                              "metadata": sp.sharding}).result()
        return sorted(struct.unpack(">Q", k)[0] for k in kv.list().result())
    keys = []
    for root, _, files in os.walk(f"{dest}/{sp.key}/c"):
        for f in files:
            rel = os.path.relpath(os.path.join(root, f), f"{dest}/{sp.key}/c")
            shard = np.array([int(v) for v in rel.split("/")])
            kv = ts.KvStore.open({"driver": "zarr3_sharding_indexed", "base": f"file://{dest}/{sp.key}/c/{rel}",
                                  "grid_shape": list(sp.shard_chunks), "index_codecs": ZARR_INDEX_CODECS}).result()
            for k in kv.list().result():
                inner = np.array(struct.unpack(">III", k))
                keys.append(tuple((shard * sp.shard_chunks + inner).tolist()))
    return sorted(keys)


def nonzero_chunks(vol, chunk=64):
    out = []
    for x in range(0, vol.shape[0], chunk):
        for y in range(0, vol.shape[1], chunk):
            for z in range(0, vol.shape[2], chunk):
                if vol[x:x + chunk, y:y + chunk, z:z + chunk].any():
                    out.append((x // chunk, y // chunk, z // chunk))
    return out


def spot_checked(ds, n: int, scales=None) -> int:
    """How many chunks a spot check of ``n`` per scale compares: each chunk slot of a scale's volume
    (with data or background) once at most."""
    return sum(min(n, int(np.prod([-(-v // c) for v, c in zip(s.size, s.chunk_size, strict=True)])))
               for s in ds.scales if scales is None or s.index in scales)


def expected_keys(vol, fmt, sp):
    nz = nonzero_chunks(vol)
    if fmt == "precomputed":
        return sorted(int(compressed_morton_code(c, sp.grid)) for c in nz)
    return sorted(nz)


# --------------------------------------------------------------------------- synthetic exports


@pytest.mark.parametrize("fmt", ["precomputed", "zarr3"])
@pytest.mark.parametrize("labels", ["agglomerated", "supervoxels"])
def test_synthetic_every_scale_reads_back(export, tmp_path, fmt, labels):
    dest = tmp_path / "out"
    rep = convert(export.root, dest, format=fmt, spec=export.spec, labels=labels, verify=4, progress=False)
    assert rep.ok, rep.summary()
    ds = dvidshards.Dataset(export.root, spec=export.spec)
    assert rep.totals.verified == spot_checked(ds, 4) == 4 + 4 + 1 and rep.scales == [0, 1, 2]
    for s in ds.scales:
        sp = scale_layout(s, format=fmt)
        want = export.expected(s.index, labels)
        np.testing.assert_array_equal(read_back(dest, fmt, sp.key), want)
        # absent and background chunks are not stored; every other chunk is
        assert stored_chunk_keys(dest, fmt, sp) == expected_keys(want, fmt, sp)
    t = rep.totals
    assert t.written == sum(len(nonzero_chunks(export.expected(k, labels))) for k in range(3))
    if fmt == "precomputed":
        assert t.transcoded > 0 and t.encoded > 0  # interior chunks transcoded, edge ones not
        info = json.loads((dest / "info").read_text())
        assert [s["key"] for s in info["scales"]] == [s["key"] for s in export.spec["scales"]]
        for got, src in zip(info["scales"], export.spec["scales"], strict=True):
            assert got["size"] == src["size"] and got["resolution"] == src["resolution"]
            assert got["encoding"] == "compressed_segmentation"
            assert {k: v for k, v in got["sharding"].items() if k != "data_encoding"} == \
                {k: v for k, v in src["sharding"].items() if k != "data_encoding"}
    else:
        assert t.transcoded == 0
        group = json.loads((dest / "zarr.json").read_text())
        ms = group["attributes"]["ome"]["multiscales"][0]
        assert [d["path"] for d in ms["datasets"]] == ["s0", "s1", "s2"]
        assert ms["datasets"][1]["coordinateTransformations"][0]["scale"] == [16.0, 16.0, 16.0]
        meta = json.loads((dest / "s0" / "zarr.json").read_text())
        assert meta["dimension_names"] == ["x", "y", "z"]
        assert meta["codecs"][0]["name"] == "sharding_indexed"
        assert meta["codecs"][0]["configuration"]["chunk_shape"] == [64, 64, 64]


def test_mapping_to_background_writes_no_chunk(export, tmp_path):
    """A mapping sending bodies to 0: chunks left all-0 are not written, read back as 0."""
    sv = export.scales[1]
    ids = np.unique(sv[sv > 0])
    m = {int(i): (0 if k % 2 else int(i) + 1000) for k, i in enumerate(ids)}
    for fmt in ("precomputed", "zarr3"):
        dest = tmp_path / fmt
        rep = convert(export.root, dest, format=fmt, spec=export.spec, scales=[1], labels=m, progress=False)
        assert rep.ok, rep.summary()
        want = LabelMapping.from_any(m)(sv)
        sp = scale_layout(dvidshards.Dataset(export.root, spec=export.spec).scale(1), format=fmt)
        np.testing.assert_array_equal(read_back(dest, fmt, sp.key), want)
        assert stored_chunk_keys(dest, fmt, sp) == expected_keys(want, fmt, sp)
        assert rep.totals.background == len(nonzero_chunks(sv)) - len(nonzero_chunks(want)) > 0


def test_tensorstore_encoder_gives_the_same_bytes(export, tmp_path):
    a = convert(export.root, tmp_path / "a", format="precomputed", spec=export.spec, progress=False)
    b = convert(export.root, tmp_path / "b", format="precomputed", spec=export.spec, encoder="tensorstore",
                progress=False)
    assert a.ok and b.ok and b.totals.transcoded == 0 and a.totals.transcoded > 0
    assert tree_bytes(tmp_path / "a") == tree_bytes(tmp_path / "b")


def tree_bytes(root):
    """Every output file's bytes but the manifest's (it records the arguments and times)."""
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            if f == "_dvidshards.json":
                continue
            p = os.path.join(d, f)
            out[os.path.relpath(p, root)] = open(p, "rb").read()
    return out


@pytest.mark.parametrize("fmt", ["precomputed", pytest.param("zarr3", marks=pytest.mark.slow)])
def test_shard_bits_extra_splits_shards(tmp_path, fmt):
    exp = make_export(tmp_path / "exp", shape=(256, 256, 256), scales=1, shard_chunks=2, seed=5)
    ds = dvidshards.Dataset(exp.root, spec=exp.spec)
    base = scale_layout(ds.scale(0), format=fmt)
    for extra in (0, 3):
        dest = tmp_path / f"out{extra}"
        rep = convert(ds, dest, format=fmt, shard_bits_extra=extra, progress=False)
        assert rep.ok, rep.summary()
        sp = scale_layout(ds.scale(0), format=fmt, shard_bits_extra=extra)
        assert np.prod(sp.shard_chunks) * 2**extra == np.prod(base.shard_chunks)
        np.testing.assert_array_equal(read_back(dest, fmt, sp.key), exp.expected(0))
        assert rep.totals.shards_written > len(ds.shards(0)) or extra == 0
        if fmt == "precomputed":
            assert json.loads((dest / "info").read_text())["scales"][0]["sharding"]["shard_bits"] == \
                exp.spec["scales"][0]["sharding"]["shard_bits"] + extra


# --------------------------------------------------------------------------- the real shard


@pytest.mark.parametrize("fmt", ["precomputed", pytest.param("zarr3", marks=pytest.mark.slow)])
def test_real_shard_every_chunk(real_export, real_records, tmp_path, fmt):
    root, spec = real_export
    dest = tmp_path / "out"
    for labels in ("agglomerated", "supervoxels"):
        rep = convert(root, dest / labels, format=fmt, spec=spec, scales=[1], labels=labels, progress=False)
        assert rep.ok, rep.summary()
        assert rep.totals.written == 258 and rep.totals.shards_written == 1
        assert rep.totals.transcoded == (258 if fmt == "precomputed" else 0)
        sp = scale_layout(dvidshards.Dataset(root, spec=spec).scale(1), format=fmt)
        if fmt == "precomputed":
            t = ts.open({"driver": "neuroglancer_precomputed", "kvstore": f"file://{dest / labels}/",
                         "scale_metadata": {"key": sp.key}}).result()[..., 0]
            kv = ts.KvStore.open({"driver": "neuroglancer_uint64_sharded",
                                  "base": f"file://{dest / labels}/{sp.key}/", "metadata": sp.sharding}).result()
        else:
            t = ts.open({"driver": "zarr3", "kvstore": f"file://{dest / labels}/{sp.key}/"}).result()
        # every chunk read back at once (TensorStore runs the reads side by side)
        chunks = [np.array([r["chunk_x"], r["chunk_y"], r["chunk_z"]]) * 64 for r in real_records]
        wants = [decode_block(r["block"], np.array(r["labels"], np.uint64) if labels == "agglomerated" else None)
                 for r in real_records]
        reads = [t[lo[0]:lo[0] + 64, lo[1]:lo[1] + 64, lo[2]:lo[2] + 64].read(order="F") for lo in chunks]
        for got, want in zip(reads, wants, strict=True):
            np.testing.assert_array_equal(got.result().T, want)
        if fmt == "precomputed":  # the stored chunk is TensorStore's encoding, byte for byte
            stored = [kv.read(struct.pack(">Q", int(compressed_morton_code(lo // 64, sp.grid)))) for lo in chunks]
            for got, want in zip(stored, ts_encode_chunks(chunks, wants), strict=True):
                assert got.result().value == want


# --------------------------------------------------------------------------- resume


def mtimes(root):
    return {os.path.relpath(os.path.join(d, f), root): os.stat(os.path.join(d, f)).st_mtime_ns
            for d, _, files in os.walk(root) for f in files}


@pytest.mark.parametrize("fmt", ["precomputed", "zarr3"])
def test_resume_after_interruption(export, tmp_path, fmt):
    dest = tmp_path / "out"
    first = convert(export.root, dest, format=fmt, spec=export.spec, progress=False, _stop_after=4, allow_partial=True)
    assert not first.complete and not first.failed and first.done == 4 and first.totals.shards_written == 4
    before = {k: v for k, v in mtimes(dest).items() if "json" not in k and k != "info"}
    assert len(before) == 4
    second = convert(export.root, dest, format=fmt, spec=export.spec, progress=False, resume=True)
    assert second.ok, second.summary()
    assert second.totals.shards_skipped == 4 and second.totals.shards_written == second.tasks - 4
    after = mtimes(dest)
    for k, v in before.items():
        assert after[k] == v, f"{k} was rewritten"
    for k in range(3):
        sp = scale_layout(dvidshards.Dataset(export.root, spec=export.spec).scale(k), format=fmt)
        np.testing.assert_array_equal(read_back(dest, fmt, sp.key), export.expected(k))
    # a damaged shard and one with a chunk missing are rewritten, complete ones are not
    files = sorted(before)
    with open(dest / files[0], "r+b") as f:
        f.truncate(20)
    third = convert(export.root, dest, format=fmt, spec=export.spec, progress=False, resume=True)
    assert third.ok and third.totals.shards_written == 1
    assert mtimes(dest)[files[1]] == before[files[1]]
    sp0 = scale_layout(dvidshards.Dataset(export.root, spec=export.spec).scale(0), format=fmt)
    np.testing.assert_array_equal(read_back(dest, fmt, sp0.key), export.expected(0))
    # without resume an earlier output is refused; with overwrite everything is rewritten
    with pytest.raises(OutputError, match="--resume"):
        convert(export.root, dest, format=fmt, spec=export.spec, progress=False)
    fourth = convert(export.root, dest, format=fmt, spec=export.spec, progress=False, overwrite=True)
    assert fourth.totals.shards_skipped == 0 and fourth.totals.shards_written == fourth.tasks


def test_a_shards_chunks_are_counted_from_its_index(export, tmp_path):
    for fmt in ("precomputed", "zarr3"):
        dest = tmp_path / fmt
        convert(export.root, dest, format=fmt, spec=export.spec, scales=[0], progress=False)
        sp = scale_layout(dvidshards.Dataset(export.root, spec=export.spec).scale(0), format=fmt)
        store = as_store(dest, writable=True)
        keys = [os.path.relpath(os.path.join(d, f), dest) for d, _, fs in os.walk(dest / sp.key) for f in fs
                if f != "zarr.json"]
        assert sum(existing_chunks(store, k, fmt, sp) for k in keys) == len(nonzero_chunks(export.expected(0)))
        store.put_sync("damaged", b"\x00" * 7)
        assert existing_chunks(store, "damaged", fmt, sp) == -1 and existing_chunks(store, "absent", fmt, sp) is None


# --------------------------------------------------------------------------- planner


def test_planner_refusals(export, tmp_path):
    ds = dvidshards.Dataset(export.root, spec=export.spec)
    s0 = ds.scale(0)
    sh = export.spec["scales"][0]["sharding"]
    dest = tmp_path / "never"
    cases = [
        # hashed shards are not boxes: a task cannot own whole output shards
        dict(sharding={**sh, "hash": "murmurhash3_x86_128"}),
        # too few bits: shard numbers wrap, so far-apart source shards share an output shard
        dict(sharding={**sh, "shard_bits": 0}),
        # more splits than bits
        dict(shard_bits_extra=sh["preshift_bits"] + sh["minishard_bits"] + 1),
    ]
    for kw in cases:
        with pytest.raises(ConvertPlanError):
            scale_layout(s0, format="precomputed", **kw)
        with pytest.raises(ConvertPlanError):
            convert(ds, dest, format="precomputed", scales=[0], progress=False, **kw)
        assert not dest.exists()  # refused before writing anything
    # geometry that cannot be converted chunk for chunk
    off = dvidshards.formats.multiscale.Scale(0, (100, 100, 100), (8.0, 8.0, 8.0), 128,
                                              voxel_offset=(32, 0, 0), sharding=s0.sharding)
    with pytest.raises(ConvertPlanError, match="voxel_offset"):
        scale_layout(off, format="zarr3")
    nosh = dvidshards.formats.multiscale.Scale(0, (100, 100, 100), (8.0, 8.0, 8.0), 128)
    with pytest.raises(ConvertPlanError, match="no sharding"):
        scale_layout(nosh, format="precomputed")
    # a finer output sharding that keeps boxes inside source shards is accepted
    sp = scale_layout(s0, format="precomputed", sharding={**sh, "preshift_bits": 0, "minishard_bits": 0,
                                                  "shard_bits": sh["shard_bits"] + sh["preshift_bits"]})
    assert sp.shard_chunks == (1, 1, 1) and not sp.grouped
    # output shard boxes bigger than a source shard: one task per output shard, not refused
    sp = scale_layout(s0, format="precomputed", sharding={**sh, "preshift_bits": sh["preshift_bits"] + 3, "shard_bits": 0})
    assert sp.grouped and sp.shard_chunks == sp.grid


def test_refuses_bad_arguments(export, tmp_path):
    with pytest.raises(SpecError):
        convert(export.root, tmp_path / "x", format="n5", spec=export.spec)
    with pytest.raises(SpecError):
        convert(export.root, tmp_path / "x", format="zarr3", spec=export.spec, encoder="fast")
    with pytest.raises(OutputError, match="inside the export"):
        convert(export.root, os.path.join(export.root, "converted"), format="zarr3", spec=export.spec)
    with pytest.raises(DvidShardsError):
        convert(export.root, tmp_path / "x", format="zarr3", spec=export.spec, labels="bodies")
    # an existing output of another conversion is not overwritten, nor resumed
    convert(export.root, tmp_path / "y", format="precomputed", spec=export.spec, scales=[2], progress=False)
    before = tree_bytes(tmp_path / "y")
    other = make_export(tmp_path / "other", shape=(90, 90, 90), scales=3)
    for resume in (False, True):
        with pytest.raises(OutputError, match="--resume" if not resume else "another source"):
            convert(other.root, tmp_path / "y", format="precomputed", spec=other.spec, scales=[2], resume=resume,
                    progress=False)
    assert tree_bytes(tmp_path / "y") == before
    # metadata of other geometry and no manifest (an older output): refused by the driver's check
    os.remove(tmp_path / "y" / "_dvidshards.json")
    with pytest.raises(OutputError, match="holds no dvidshards output"):
        convert(other.root, tmp_path / "y", format="precomputed", spec=other.spec, scales=[2], resume=True,
                progress=False)
    # --overwrite replaces the conversion's own files (info included): the other geometry is written
    assert convert(other.root, tmp_path / "y", format="precomputed", spec=other.spec, scales=[2], overwrite=True,
                   progress=False).ok


# --------------------------------------------------------------------------- failures, verify


def test_bad_source_shard_fails_alone(tmp_path):
    exp = make_export(tmp_path / "exp", scales=1)
    ds = dvidshards.Dataset(exp.root, spec=exp.spec)
    victim = ds.shards(0)[1]
    path = os.path.join(exp.root, "s0", "{}_{}_{}.arrow".format(*victim))
    data = bytearray(open(path, "rb").read())
    payload = bytes(ds.shard(0, victim).table().payload(0))
    start = bytes(data).find(payload)
    assert start > 0 and len(payload) > 40
    data[start + 20:start + 30] = b"\xff" * 10  # inside the first record's zstd frame
    open(path, "wb").write(bytes(data))
    with pytest.raises(JobError) as err:
        convert(exp.root, tmp_path / "out", format="precomputed", spec=exp.spec, progress=False)
    rep = err.value.report
    name = "s0/{}_{}_{}".format(*victim)
    assert not rep.ok and list(rep.failed) == [name] and name in str(err.value)
    assert rep.failed[name].startswith(("BlockDecodeError", "ShardFormatError"))
    assert "{}_{}_{}".format(*victim) in rep.failed[name]
    assert rep.totals.shards_written == len(ds.shards(0)) - 1


def test_verify_detects_a_changed_chunk(export, tmp_path):
    dest = tmp_path / "out"
    convert(export.root, dest, format="precomputed", spec=export.spec, scales=[2], progress=False)
    ds = dvidshards.Dataset(export.root, spec=export.spec)
    sp = scale_layout(ds.scale(2), format="precomputed")
    v = dvidshards.verify(str(dest), spot_check=5)
    assert v.ok and v.chunks == 1  # s2 is one chunk
    t = ts.open({"driver": "neuroglancer_precomputed", "kvstore": f"file://{dest}/",
                 "scale_metadata": {"key": sp.key}}).result()
    t[..., 0].write(np.uint64(12345)).result()  # the whole scale changed behind our back
    v = dvidshards.verify(str(dest), spot_check=5)
    assert not v.ok and v.chunks == 1 and len(v.problems) == 1  # each chunk compared, and reported, once


# --------------------------------------------------------------------------- dask


@pytest.mark.slow  # a dask LocalCluster
def test_local_cluster_equals_serial(tmp_path):
    pytest.importorskip("distributed")
    exp = make_export(tmp_path / "exp", shape=(150, 130, 70), scales=1)
    a = convert(exp.root, tmp_path / "serial", format="precomputed", spec=exp.spec, progress=False)
    b = convert(exp.root, tmp_path / "dask", format="precomputed", spec=exp.spec, progress=False,
                scheduler="local:2")
    assert a.ok and b.ok and b.tasks == a.tasks > 2
    assert tree_bytes(tmp_path / "serial") == tree_bytes(tmp_path / "dask")


def test_data_encodings(export, tmp_path):
    """gzip (done here, any level) and raw chunk data hold the same chunks; TensorStore reads both."""
    ds = dvidshards.Dataset(export.root, spec=export.spec)
    sp = scale_layout(ds.scale(1), format="precomputed")
    values = {}
    for name, kw in {"gzip1": {}, "gzip9": {"gzip_level": 9}, "raw": {"data_encoding": "raw"}}.items():
        dest = tmp_path / name
        assert convert(ds, dest, format="precomputed", scales=[1], progress=False, **kw).ok
        info = json.loads((dest / "info").read_text())
        enc = info["scales"][0]["sharding"]["data_encoding"]
        assert enc == ("raw" if name == "raw" else "gzip")
        np.testing.assert_array_equal(read_back(dest, "precomputed", sp.key), export.expected(1))
        kv = ts.KvStore.open({"driver": "neuroglancer_uint64_sharded", "base": f"file://{dest}/{sp.key}/",
                              "metadata": {**sp.sharding, "data_encoding": enc}}).result()
        values[name] = {k: kv.read(k).result().value for k in kv.list().result()}
    assert values["gzip1"] == values["gzip9"] == values["raw"] and len(values["raw"]) > 1
    assert sum(map(os.path.getsize, _files(tmp_path / "gzip1"))) < sum(map(os.path.getsize, _files(tmp_path / "raw")))
    with pytest.raises(SpecError):
        convert(ds, tmp_path / "bad", format="precomputed", gzip_level=0)


def _files(root):
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if "." in f]


def test_command_line(export, tmp_path, capsys):
    from dvidshards.cli import main

    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(export.spec))
    dest = tmp_path / "out"
    code = main(["convert", export.root, str(dest), "--format", "zarr3", "--spec", str(spec), "--scales", "1", "2",
                 "--scheduler", "serial", "--verify", "3", "--quiet"])
    out = capsys.readouterr().out
    assert code == 0, out
    n = spot_checked(dvidshards.Dataset(export.root, spec=export.spec), 3, scales=(1, 2))
    assert n == 3 + 1 and f"verify: {n} chunks read back ({n} with data, 0 background), 0 differ" in out
    for k in (1, 2):
        np.testing.assert_array_equal(read_back(dest, "zarr3", f"s{k}"), export.expected(k))
    assert main(["convert", export.root, str(tmp_path / "o2"), "--format", "n5"]) == 2
    assert "invalid choice" in capsys.readouterr().err
    code = main(["convert", export.root, str(tmp_path / "o3"), "--format", "precomputed", "--spec", str(spec),
                 "--shard-bits-extra", "40", "--scheduler", "serial"])
    err = capsys.readouterr().err
    assert code == 2 and "ConvertPlanError" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o3").exists()


# --------------------------------------------------------------------------- bounded memory


@pytest.mark.parametrize("data_encoding", ["raw", "gzip"])
def test_streamed_shards_are_tensorstores_bytes(export, tmp_path, data_encoding):
    """A local output shard is built on disk chunk by chunk; its bytes are what TensorStore's own
    sharded writer makes of the same chunk values (gzip minishard indexes included)."""
    dest = tmp_path / "out"
    rep = convert(export.root, dest, format="precomputed", spec=export.spec, data_encoding=data_encoding, progress=False)
    assert rep.ok and rep.complete, rep.summary()
    for s in dvidshards.Dataset(export.root, spec=export.spec).scales:
        sp = scale_layout(s, format="precomputed", data_encoding=data_encoding)
        meta = {**sp.sharding, "data_encoding": "raw"}  # stored values as they are
        assert meta["minishard_index_encoding"] == "gzip"
        ours = ts.KvStore.open({"driver": "neuroglancer_uint64_sharded", "base": f"file://{dest}/{sp.key}/",
                                "metadata": meta}).result()
        again = tmp_path / "ts" / sp.key
        theirs = ts.KvStore.open({"driver": "neuroglancer_uint64_sharded", "base": f"file://{again}/",
                                  "metadata": meta}).result()
        with ts.Transaction() as txn:
            for key in ours.list().result():
                theirs.with_transaction(txn)[key] = ours.read(key).result().value
        files = sorted(os.listdir(dest / sp.key))
        assert files and files == sorted(os.listdir(again))
        for f in files:
            assert (dest / sp.key / f).read_bytes() == (again / f).read_bytes(), f
    assert not [p for p in dest.rglob("*.tmp")]


_DENSE = """if True:
    import json, sys
    import numpy as np
    import dvidshards
    import tensorstore as ts
    from dvidshards.jobs.convert import convert
    from dvidshards.jobs.layouts import scale_layout
    from tests.support.procedural import ProceduralStore
    store = ProceduralStore()
    ds = dvidshards.Dataset(store, spec=store.spec)
    origins = store.shard_origins(0)
    o = next(o for o in origins[len(origins) // 2:] if len(store.shard_chunks(0, o)) == 32768)
    rep = convert(ds, sys.argv[1], format="precomputed", scales=[0], data_encoding="raw", scheduler="serial",
                  labels="supervoxels", progress=False, _only={(0, tuple(o))}, allow_partial=True)
    # VmHWM: this image's own peak (ru_maxrss would also count the test process's pages, copied before exec)
    peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    sp = scale_layout(ds.scale(0), format="precomputed", data_encoding="raw")
    t = ts.open({"driver": "neuroglancer_precomputed", "kvstore": "file://" + sys.argv[1] + "/",
                 "scale_metadata": {"key": sp.key}}).result()[..., 0]
    rng = np.random.default_rng(0)
    coords = store.shard_chunks(0, o)
    same = 0
    for c in coords[rng.choice(len(coords), 12, replace=False)]:
        lo = np.asarray(c) * 64
        got = t[lo[0]:lo[0] + 64, lo[1]:lo[1] + 64, lo[2]:lo[2] + 64].read().result()
        same += bool(np.array_equal(got.T, store.chunk_volume(0, *c)))
    from dvidshards.formats import jit
    from dvidshards.runtime import kernels
    print(json.dumps({"peak": peak, "written": rep.totals.written, "shards": rep.totals.shards_written,
                      "bytes": rep.totals.encoded_bytes, "same": same, "ok": rep.ok,
                      "not_compiled": [k.name for k in jit.kernels() if not kernels.in_cache(k)],
                      "cpu_s": rep.totals.cpu_s, "wall_s": rep.totals.wall_s}))
"""


@pytest.mark.slow
def test_dense_32768_chunk_shard_raw_under_1_gib(tmp_path):
    """A full mCNS shard (32,768 chunks, raw chunk data: ~0.8 GB of output) converts in a fresh
    process whose peak RSS stays under 1 GiB, without changing the output geometry."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _DENSE, str(tmp_path / "out")], capture_output=True, text=True,
                         timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    # one task of many (_only): the output says it is partial
    assert not r["ok"] and r["written"] == 32768 and r["shards"] == 1 and r["same"] == 12
    assert r["bytes"] > 600 << 20  # the output shard is most of a GiB ...
    assert r["peak"] < 1 << 30, f"peak RSS {r['peak'] / 2**20:.0f} MiB; {r}; {out.stderr[-2000:]}"  # ... never held


# --------------------------------------------------------------------------- outputs that say so


def _damage_one_shard(exp):
    ds = dvidshards.Dataset(exp.root, spec=exp.spec)
    victim = ds.shards(0)[1]
    path = os.path.join(exp.root, "s0", "{}_{}_{}.arrow".format(*victim))
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    return ds, victim


def test_damaged_shard_gives_an_output_that_says_it_is_partial(tmp_path, capsys):
    from dvidshards.cli import main

    exp = make_export(tmp_path / "exp", scales=1)
    ds, victim = _damage_one_shard(exp)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(exp.spec))
    dest = tmp_path / "out"
    assert main(["convert", exp.root, str(dest), "--format", "precomputed", "--spec", str(spec), "--quiet"]) == 1
    assert "INCOMPLETE" in capsys.readouterr().out
    m = json.loads((dest / "_dvidshards.json").read_text())
    name = "{}_{}_{}".format(*victim)
    assert m["complete"] is False and m["status"] == "incomplete" and list(m["failed"]) == ["s0/" + name]
    assert m["tasks"]["done"] == len(ds.shards(0)) - 1 == m["tasks"]["total"] - 1
    assert m["job"] == "convert" and m["command"].startswith("dvidshards convert")
    assert m["parameters"]["format"] == "precomputed"
    assert main(["verify", str(dest), "--quiet"]) == 1
    assert name in capsys.readouterr().out


def test_manifest_is_incomplete_until_the_end_and_resume_finishes_it(export, tmp_path):
    dest = tmp_path / "out"
    rep = convert(export.root, dest, format="zarr3", spec=export.spec, progress=False, _stop_after=3, allow_partial=True)
    m = json.loads((dest / "_dvidshards.json").read_text())
    assert not rep.failed and not rep.complete and m["complete"] is False and m["tasks"]["done"] == 3
    with pytest.raises(OutputError, match="other parameters"):  # resume needs the same arguments
        convert(export.root, dest, format="zarr3", spec=export.spec, scales=[0], progress=False, resume=True)
    rep = convert(export.root, dest, format="zarr3", spec=export.spec, progress=False, resume=True)
    assert rep.ok and rep.complete and rep.totals.shards_skipped == 3
    assert json.loads((dest / "_dvidshards.json").read_text())["complete"] is True


def test_refuses_a_destination_holding_other_files(export, tmp_path, capsys):
    from dvidshards.cli import main

    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(export.spec))
    dest = tmp_path / "mine"
    dest.mkdir()
    (dest / "notes.txt").write_text("my notes")
    (dest / "info").write_text("{}")
    before = tree_bytes(dest)
    args = ["convert", export.root, str(dest), "--format", "precomputed", "--spec", str(spec), "--quiet",
            "--scales", "2"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "notes.txt" in err and "--overwrite" in err and len(err.strip().splitlines()) == 1
    assert tree_bytes(dest) == before  # nothing touched
    with pytest.raises(OutputError):
        convert(export.root, dest, format="precomputed", spec=export.spec, scales=[2], resume=True, progress=False)
    assert tree_bytes(dest) == before
    # --overwrite: this conversion's files replaced, the others left alone
    assert main(args + ["--overwrite"]) == 0
    assert (dest / "notes.txt").read_text() == "my notes"
    assert json.loads((dest / "_dvidshards.json").read_text())["complete"] is True
    sp = scale_layout(dvidshards.Dataset(export.root, spec=export.spec).scale(2), format="precomputed")
    np.testing.assert_array_equal(read_back(dest, "precomputed", sp.key), export.expected(2))
    # its own earlier output: run again (rewritten) or resumed, with the notes beside it
    assert main(args + ["--resume"]) == 0
    assert main(args) == 2  # without a flag an earlier output is refused


def test_one_scheduler_vocabulary(export, tmp_path, capsys):
    from dvidshards.cli import main

    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(export.spec))
    outs = {}
    for sched in ("serial", "threads:2", None):
        dest = tmp_path / f"out-{sched}"
        extra = ["--scheduler", sched] if sched else []
        assert main(["convert", export.root, str(dest), "--format", "precomputed", "--spec", str(spec),
                     "--quiet", *extra]) == 0
        outs[sched] = tree_bytes(dest)
    assert outs["serial"] == outs["threads:2"] == outs[None]
    assert main(["convert", export.root, str(tmp_path / "bad"), "--format", "precomputed", "--spec", str(spec),
                 "--scheduler", "cluster please"]) == 2
    assert "scheduler" in capsys.readouterr().err and not (tmp_path / "bad").exists()


# --------------------------------------------------------------------------- output shards over several files


def same_bytes_as_tensorstores_writer(dest, sp, work):
    """Every output shard file of a precomputed scale is what TensorStore's own sharded writer makes
    of the same stored values."""
    meta = {**sp.sharding, "data_encoding": "raw"}
    ours = ts.KvStore.open({"driver": "neuroglancer_uint64_sharded", "base": f"file://{dest}/{sp.key}/",
                            "metadata": meta}).result()
    theirs = ts.KvStore.open({"driver": "neuroglancer_uint64_sharded", "base": f"file://{work}/",
                              "metadata": meta}).result()
    with ts.Transaction() as txn:
        for key in ours.list().result():
            theirs.with_transaction(txn)[key] = ours.read(key).result().value
    files = sorted(os.listdir(os.path.join(dest, sp.key)))
    assert files and files == sorted(os.listdir(work))
    for f in files:
        assert open(os.path.join(dest, sp.key, f), "rb").read() == open(os.path.join(work, f), "rb").read(), f


@pytest.mark.parametrize("fmt", ["precomputed", "zarr3"])
def test_output_shards_larger_than_source_shards(export, tmp_path, fmt):
    """A sharding whose shards span several source files (as DVID's old names do at coarse scales):
    one task per output shard, reading every source file meeting it; exact, and a streamed shard
    is TensorStore's bytes."""
    from dvidshards.jobs.convert import Job

    ds = dvidshards.Dataset(export.root, spec=export.spec)
    sharding = {**export.spec["scales"][0]["sharding"], "preshift_bits": 2, "minishard_bits": 2, "shard_bits": 2}
    sp = scale_layout(ds.scale(0), format=fmt, sharding=sharding)
    tasks = list(plan(ds, {0: sp}, job=Job(ds, as_store(tmp_path / "x", writable=True), fmt, "agglomerated")))
    assert sp.grouped and 1 < len(tasks) < len(ds.shards(0))
    assert all(t.shard is not None and len(t.sources) > 1 for t in tasks)  # every output shard reads several files
    assert sorted({o for t in tasks for o in t.sources}) == sorted(ds.shards(0))
    dest = tmp_path / "out"
    rep = convert(ds, dest, format=fmt, scales=[0], sharding=sharding, progress=False)
    assert rep.ok and rep.tasks == len(tasks) and rep.totals.shards_written == len(tasks), rep.summary()
    want = export.expected(0)
    np.testing.assert_array_equal(read_back(dest, fmt, sp.key), want)
    assert stored_chunk_keys(dest, fmt, sp) == expected_keys(want, fmt, sp)
    assert rep.totals.records == sum(len(ds.shard(0, o).table()) for o in ds.shards(0))  # each record once
    if fmt == "precomputed":
        same_bytes_as_tensorstores_writer(str(dest), sp, str(tmp_path / "ts"))
    assert not [p for p in dest.rglob("*") if p.name.startswith(".") or p.suffix == ".tmp"]
    # resume keeps whole output shards and rewrites a damaged one
    files = sorted(p for p in (dest / sp.key).rglob("*") if p.is_file() and p.name != "zarr.json")
    before = mtimes(dest)
    with open(files[0], "r+b") as f:
        f.truncate(10)
    again = convert(ds, dest, format=fmt, scales=[0], sharding=sharding, progress=False, resume=True)
    assert again.ok and again.totals.shards_written == 1 and again.totals.shards_skipped == len(tasks) - 1
    after = mtimes(dest)
    assert all(after[str(p.relative_to(dest))] == before[str(p.relative_to(dest))] for p in files[1:])
    np.testing.assert_array_equal(read_back(dest, fmt, sp.key), want)


def test_a_failing_source_file_names_the_output_shard_it_was_for(tmp_path):
    exp = make_export(tmp_path / "exp", scales=1)
    ds, victim = _damage_one_shard(exp)
    sharding = {**exp.spec["scales"][0]["sharding"], "preshift_bits": 2, "minishard_bits": 2, "shard_bits": 2}
    rep = convert(ds, tmp_path / "out", format="precomputed", sharding=sharding, progress=False, allow_partial=True)
    assert not rep.ok and len(rep.failed) >= 1
    name, msg = next(iter(rep.failed.items()))
    assert name.startswith("s0/") and name.endswith(".shard") and "{}_{}_{}".format(*victim) in msg


# --------------------------------------------------------------------------- partial exports


@pytest.fixture(scope="module")
def partial(tmp_path_factory):
    """An odd-sized 4-scale export holding scale 0 only (DVID's default), its info listing all four;
    and the pyramid by DVID's rule (dvidshards.demo.dvid_downsample, a plain numpy port)."""
    from dvidshards.demo import dvid_downsample

    exp = make_export(tmp_path_factory.mktemp("partial") / "exp", (141, 99, 77), seed=7, scales=4,
                      only_scales=[0], info=True)
    dvid = [exp.sv]
    for _ in range(3):
        dvid.append(dvid_downsample(dvid[-1]))
    return exp, dvid


def mapped(exp, sv):
    return LabelMapping.from_any(exp.mapping)(sv)


def test_partial_export_the_reference_is_independent():
    """dvid_downsample is a plain port: check it on cells written by hand, and that it does not
    stand on the compressed-domain kernel it is the reference of."""
    import inspect

    from dvidshards.demo import dvid_downsample

    v = np.zeros((4, 2, 3), np.uint64)
    v[0:2, :, 0:2] = [[[5, 5], [7, 7]], [[7, 7], [0, 0]]]  # 7 four times, 5 twice
    v[2:4, :, 0:2] = [[[0, 0], [0, 9]], [[0, 0], [0, 0]]]  # a lone non-zero wins over zeros
    v[0:2, :, 2] = [[3, 4], [4, 3]]  # a tie: the smaller id (the odd edge counts as 0)
    got = dvid_downsample(v)
    assert got.shape == (2, 1, 2)
    assert got[:, 0, :].tolist() == [[7, 3], [9, 0]]
    assert "formats.downsample" not in inspect.getsource(inspect.getmodule(dvid_downsample))


@pytest.mark.parametrize("fmt", ["precomputed", "zarr3"])
def test_partial_export_converts_every_scale_of_its_spec(partial, tmp_path, fmt):
    exp, dvid = partial
    ds = dvidshards.Dataset(exp.root)
    assert ds.exported == (0,) and len(ds.scales) == 4
    dest = tmp_path / "out"
    rep = convert(exp.root, dest, format=fmt, progress=False)
    assert rep.ok, rep.summary()
    assert rep.scales == [0, 1, 2, 3] and rep.totals.made["records_written"] > 0
    assert any("made first" in n for n in rep.notes)
    for k in range(4):
        key = scale_layout(ds.scale(k).with_naming("current"), format=fmt).key
        np.testing.assert_array_equal(read_back(dest, fmt, key), mapped(exp, dvid[k]), err_msg=f"s{k}")
    m = json.loads((dest / "_dvidshards.json").read_text())
    assert m["made"] == [1, 2, 3] and m["spec"] == ds.spec and m["parameters"]["method"] == "dvid"
    assert m["tasks"]["total"] == rep.tasks == rep.done
    assert not (tmp_path / "out.work").exists()  # the staging folder is gone after a complete run
    assert sorted(os.listdir(tmp_path)) == ["out"]
    v = dvidshards.verify(str(dest), spot_check=6)
    assert v.ok and v.chunks == 6 and "s1, s2, s3: made by the conversion" in v.summary(), v.summary()


def test_partial_export_supervoxels_and_tensorstores_mode(partial, tmp_path):
    exp, dvid = partial
    rep = convert(exp.root, tmp_path / "sv", format="zarr3", labels="supervoxels", progress=False, verify=3)
    assert rep.ok and not rep.totals.mismatches
    assert rep.totals.verified == spot_checked(dvidshards.Dataset(exp.root), 3) == 3 + 2 + 1 + 1
    for k in range(4):
        np.testing.assert_array_equal(read_back(tmp_path / "sv", "zarr3", f"s{k}"), dvid[k])
    rep = convert(exp.root, tmp_path / "mode", format="zarr3", method="mode", progress=False)
    assert rep.ok
    for k in range(4):  # TensorStore's own mode downsampling of the volume, then the mapping
        np.testing.assert_array_equal(read_back(tmp_path / "mode", "zarr3", f"s{k}"), exp.expected(k))
    assert not np.array_equal(exp.expected(2), mapped(exp, dvid[2]))  # the two rules differ here


def test_partial_export_resume_across_both_stages(partial, tmp_path):
    exp, dvid = partial
    dest, work = tmp_path / "out", tmp_path / "out.work"
    # killed while making the scales: the output says incomplete, what was made is kept
    first = convert(exp.root, dest, format="precomputed", progress=False, allow_partial=True, _stop_downsample_after=1)
    assert not first.complete and not first.failed and (work / "scales" / "s1").is_dir()
    assert json.loads((dest / "_dvidshards.json").read_text())["complete"] is False
    assert any("not converted: making them did not finish" in n for n in first.notes)
    made = mtimes(work / "scales" / "s1")
    with pytest.raises(OutputError, match="--resume"):
        convert(exp.root, dest, format="precomputed", progress=False)
    second = convert(exp.root, dest, format="precomputed", progress=False, resume=True, _stop_after=2, allow_partial=True)
    assert not second.complete and second.skipped >= 1  # the made shard kept
    assert all(mtimes(work / "scales" / "s1")[k] == v for k, v in made.items())
    # killed while converting: resume keeps both the made scales and the output shards written
    third = convert(exp.root, dest, format="precomputed", progress=False, resume=True)
    assert third.ok and third.totals.shards_skipped == 2, third.summary()
    assert not work.exists()
    ds = dvidshards.Dataset(exp.root)
    for k in range(4):
        key = scale_layout(ds.scale(k).with_naming("current"), format="precomputed").key
        np.testing.assert_array_equal(read_back(dest, "precomputed", key), mapped(exp, dvid[k]))
    # resuming a complete output does not make the scales again
    before = mtimes(dest)
    fourth = convert(exp.root, dest, format="precomputed", progress=False, resume=True)
    assert fourth.ok and any("kept as the earlier complete run wrote them" in n for n in fourth.notes)
    assert not work.exists() and fourth.totals.made is None
    assert {k: v for k, v in mtimes(dest).items() if "json" not in k} == \
        {k: v for k, v in before.items() if "json" not in k}


def test_partial_export_explicit_scales(partial, tmp_path):
    exp, dvid = partial
    rep = convert(exp.root, tmp_path / "two", format="zarr3", scales=[2], progress=False)
    assert rep.ok and rep.scales == [2]
    assert "s1, s2 made from s0" in " ".join(rep.notes)  # s2 is made from s1, made first
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == ["_dvidshards.json", "s2", "zarr.json"]
    np.testing.assert_array_equal(read_back(tmp_path / "two", "zarr3", "s2"), mapped(exp, dvid[2]))
    # an export holding s1 and s2 only: s0 cannot be made; the default converts s1, s2 and makes s3
    top = make_export(tmp_path / "top", (141, 99, 77), seed=7, scales=4, only_scales=[1, 2], info=True)
    with pytest.raises(NotExportedError, match="scale 0 is not exported"):
        convert(top.root, tmp_path / "never", format="zarr3", scales=[0, 1])
    assert not (tmp_path / "never").exists() and not (tmp_path / "never.work").exists()
    rep = convert(top.root, tmp_path / "top-out", format="zarr3", progress=False)
    assert rep.ok and rep.scales == [1, 2, 3] and any("s0 not exported and not made" in n for n in rep.notes)
    np.testing.assert_array_equal(read_back(tmp_path / "top-out", "zarr3", "s3"),
                                  mapped(top, dvid_from(top.expected(2, "supervoxels"))))


def dvid_from(sv):
    from dvidshards.demo import dvid_downsample

    return dvid_downsample(sv)


def test_partial_export_work_folder(partial, tmp_path, capsys):
    from dvidshards.cli import main

    exp, dvid = partial
    # the made scales go to NAME.work beside the output (every job's rule); a bucket's root has no
    # "beside", and no worker but this process sees memory://: refused in one line, before any work
    with pytest.raises(OutputError, match="--workdir"):
        convert(exp.root, "gs://bucket", format="zarr3", progress=False)
    with pytest.raises(OutputError, match="memory"):
        convert(exp.root, "memory://x/out/", format="zarr3", progress=False)
    with pytest.raises(OutputError, match="memory.*--workdir"):
        convert(exp.root, tmp_path / "o0", format="zarr3", workdir="memory://x/work", progress=False)
    assert not (tmp_path / "o0").exists()
    # an explicit work folder holding the user's files: the staged scales go, the rest stays
    wd = tmp_path / "mine"
    wd.mkdir()
    (wd / "notes.txt").write_text("mine")
    assert convert(exp.root, tmp_path / "o1", format="zarr3", workdir=wd, scales=[1], progress=False).ok
    assert sorted(os.listdir(wd)) == ["notes.txt"]
    # refused before any work: inside the export, overlapping the output
    for bad, why in ((os.path.join(exp.root, "work"), "inside the export"), (tmp_path / "o2" / "w", "overlap")):
        with pytest.raises(OutputError, match=why):
            convert(exp.root, tmp_path / "o2", format="zarr3", workdir=bad, progress=False)
        assert not os.path.exists(bad)
    assert not os.path.exists(os.path.join(exp.root, "work")) and sorted(os.listdir(exp.root)) == ["info", "s0"]
    # a work folder left by another run: refused without --resume / --overwrite; --overwrite makes them again
    convert(exp.root, tmp_path / "o3", format="zarr3", progress=False, allow_partial=True, _stop_downsample_after=1)
    shutil_rm(tmp_path / "o3")
    with pytest.raises(OutputError, match="holds scales made by an earlier conversion"):
        convert(exp.root, tmp_path / "o3", format="zarr3", progress=False)
    assert main(["convert", exp.root, str(tmp_path / "o3"), "--format", "zarr3", "--overwrite", "--quiet",
                 "--method", "dvid", "--scheduler", "serial"]) == 0
    assert "made first" in capsys.readouterr().out and not (tmp_path / "o3.work").exists()
    np.testing.assert_array_equal(read_back(tmp_path / "o3", "zarr3", "s3"), mapped(exp, dvid[3]))


def shutil_rm(p):
    import shutil

    shutil.rmtree(p)


@pytest.mark.slow
def test_made_scales_and_grouped_shards_on_a_local_cluster_equal_serial(partial, export, tmp_path):
    """Both stages on dask workers (other processes: the dataset over the export and the made scales
    travels pickled), and tasks of output shards over several files: the same bytes as serially."""
    distributed = pytest.importorskip("distributed")
    from dvidshards.jobs.runner import TaskRunner

    exp, _ = partial
    sharding = {**export.spec["scales"][0]["sharding"], "preshift_bits": 2, "minishard_bits": 2, "shard_bits": 2}
    with TaskRunner("local:2") as tr:
        client = tr.client()
        assert isinstance(client, distributed.Client)
        for name, src, kw in (("made", exp.root, {}), ("grouped", export.root,
                                                          {"spec": export.spec, "scales": [0], "sharding": sharding})):
            a = convert(src, tmp_path / f"{name}-serial", format="precomputed", scheduler="serial", progress=False, **kw)
            b = convert(src, tmp_path / f"{name}-dask", format="precomputed", scheduler=client, progress=False, **kw)
            assert a.ok and b.ok and a.tasks == b.tasks > 1
            assert tree_bytes(tmp_path / f"{name}-serial") == tree_bytes(tmp_path / f"{name}-dask")
    assert not (tmp_path / "made-dask.work").exists()


def test_partial_export_to_a_bucket(partial, tmp_path):
    """A bucket destination: the made scales are staged beside it in the same bucket (out.work/),
    removed when the output is complete; the output's objects are a local run's files."""
    pytest.importorskip("moto.server")
    from tests.support.servers import MotoS3

    exp, dvid = partial
    local = convert(exp.root, tmp_path / "local", format="precomputed", progress=False)
    assert local.ok
    with MotoS3() as s3:
        c = s3.bucket("seg")
        url = f"s3://seg/conv/out?endpoint_override=127.0.0.1:{s3.port}&scheme=http&region={s3.REGION}"
        first = convert(exp.root, url, format="precomputed", progress=False, allow_partial=True, _stop_after=1)
        keys = {o["Key"] for o in c.list_objects_v2(Bucket="seg", Prefix="conv/")["Contents"]}
        assert not first.complete and any(k.startswith("conv/out.work/scales/s1/") for k in keys)
        rep = convert(exp.root, url, format="precomputed", progress=False, resume=True)
        assert rep.ok and rep.totals.shards_skipped == 1, rep.summary()
        keys = {o["Key"] for o in c.list_objects_v2(Bucket="seg", Prefix="conv/")["Contents"]}
        assert not [k for k in keys if k.startswith("conv/out.work")]
        got = {k[len("conv/out/"):]: c.get_object(Bucket="seg", Key=k)["Body"].read() for k in keys
               if k != "conv/out/_dvidshards.json"}
        assert got == tree_bytes(tmp_path / "local")


# --------------------------------------------------------------------------- a box of the volume


def boxed(vol, box, k):
    """The volume of scale k with every voxel outside the box (s0 voxels, each scale taking the
    voxels that cover it) set to 0: brute force over the expected volume."""
    lo = [v // 2**k for v in box[0]]
    hi = [-(-v // 2**k) for v in box[1]]
    out = np.zeros_like(vol)
    out[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]] = vol[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]]
    return out


@pytest.mark.parametrize("fmt", ["precomputed", "zarr3"])
def test_box_converts_the_box_at_every_scale_and_nothing_else(export, tmp_path, fmt):
    box = [[30, 10, 10], [120, 101, 140]]  # not chunk-aligned: chunks cut by the box at every scale
    dest = tmp_path / "out"
    first = convert(export.root, dest, format=fmt, spec=export.spec, box=box, progress=False, _stop_after=2,
                    allow_partial=True)
    assert not first.complete and first.done == 2
    rep = convert(export.root, dest, format=fmt, spec=export.spec, box=box, progress=False, resume=True, verify=4)
    assert rep.ok and not rep.totals.mismatches and rep.totals.verified > 0, rep.summary()
    assert rep.totals.shards_skipped == first.totals.shards_written > 0  # the interrupted run's shards kept
    ds = dvidshards.Dataset(export.root, spec=export.spec)
    assert rep.tasks < sum(len(ds.shards(k)) for k in range(3))  # source shards outside the box are not read
    for k in range(3):
        sp = scale_layout(ds.scale(k), format=fmt)
        want = boxed(export.expected(k), box, k)
        assert want.any() and not np.array_equal(want, export.expected(k))
        np.testing.assert_array_equal(read_back(dest, fmt, sp.key), want)
        assert stored_chunk_keys(dest, fmt, sp) == expected_keys(want, fmt, sp)  # nothing outside the box
    m = json.loads((dest / "_dvidshards.json").read_text())
    assert m["parameters"]["box"] == box and m["complete"] is True


def test_box_of_made_scales(partial, tmp_path):
    """The scales an export lacks are made from the box alone: DVID's rule over the boxed volume."""
    from dvidshards.demo import dvid_downsample

    exp, dvid = partial
    box = [[20, 10, 5], [111, 90, 60]]
    rep = convert(exp.root, tmp_path / "out", format="zarr3", box=box, progress=False)
    assert rep.ok and rep.scales == [0, 1, 2, 3], rep.summary()
    pyramid = [boxed(exp.sv, box, 0)]
    for _ in range(3):
        pyramid.append(dvid_downsample(pyramid[-1]))
    for k in range(4):
        want = mapped(exp, pyramid[k])
        assert want.any() and not np.array_equal(want, mapped(exp, dvid[k]))
        np.testing.assert_array_equal(read_back(tmp_path / "out", "zarr3", f"s{k}"), want, err_msg=f"s{k}")


def test_box_outside_the_volume_is_refused_in_one_line(export, tmp_path, capsys):
    from dvidshards.cli import main

    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(export.spec))
    dest = tmp_path / "out"
    assert main(["convert", export.root, str(dest), "--format", "precomputed", "--spec", str(spec),
                 "--box", "0", "0", "0", "201", "10", "10"]) == 2
    err = capsys.readouterr().err
    assert "not inside scale 0's volume" in err and len(err.strip().splitlines()) == 1
    assert not dest.exists()
    # the box is in scale-0 voxels whichever scales are converted
    with pytest.raises(SpecError, match="scale 0"):
        convert(export.root, dest, format="zarr3", spec=export.spec, scales=[2], box=[[0, 0, 0], [201, 10, 10]])
    assert main(["convert", export.root, str(dest), "--format", "zarr3", "--spec", str(spec), "--scales", "2",
                 "--box", "8", "0", "0", "199", "170", "150", "--quiet"]) == 0
    want = boxed(export.expected(2), [[8, 0, 0], [199, 170, 150]], 2)
    assert not np.array_equal(want, export.expected(2))
    np.testing.assert_array_equal(read_back(dest, "zarr3", "s2"), want)


def test_grouped_shards_into_a_bucket_are_a_local_runs_files(export, tmp_path):
    """Output shards over several source files, written to S3 (moto): the encoded chunks spooled on
    this host, each shard one object; the objects are the bytes a local run writes."""
    pytest.importorskip("moto.server")
    from tests.support.servers import MotoS3

    sharding = {**export.spec["scales"][0]["sharding"], "preshift_bits": 2, "minishard_bits": 2, "shard_bits": 2}
    kw = dict(format="precomputed", spec=export.spec, scales=[0], sharding=sharding, progress=False)
    assert convert(export.root, tmp_path / "local", **kw).ok
    with MotoS3() as s3:
        c = s3.bucket("seg")
        url = f"s3://seg/out?endpoint_override=127.0.0.1:{s3.port}&scheme=http&region={s3.REGION}"
        rep = convert(export.root, url, **kw)
        assert rep.ok and rep.totals.shards_written > 1, rep.summary()
        keys = [o["Key"] for o in c.list_objects_v2(Bucket="seg", Prefix="out/")["Contents"]]
        got = {k[len("out/"):]: c.get_object(Bucket="seg", Key=k)["Body"].read() for k in keys
               if k != "out/_dvidshards.json"}
    assert got == tree_bytes(tmp_path / "local")
