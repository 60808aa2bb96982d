"""labels(), chunks_with(), BodyIndex and body_mask vs brute force over the written volumes."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import dvidshards
from dvidshards.errors import MissingShardError, SpecError
from dvidshards.jobs.labelindex import label_index
from dvidshards.query import BodyIndex, body_mask, chunks_with, labels_in_box
from tests.support.exports import make_export


@pytest.fixture(scope="module")
def exp(tmp_path_factory):
    e = make_export(tmp_path_factory.mktemp("query") / "exp", shape=(200, 170, 150), seed=7, scales=2)
    with open(os.path.join(e.root, "info"), "w") as f:
        json.dump(e.spec, f)
    return e


@pytest.fixture(scope="module")
def ds(exp):
    return dvidshards.Dataset(exp.root)


def _mapping(exp):
    svs = np.unique(exp.scales[0])
    svs = svs[svs != 0]
    return {int(s): 5000 + int(s) % 5 for s in svs[1::2]}


def _missing_shard_boxes(ds, scale):
    s = ds.scale(scale)
    have = set(ds.shards(scale))
    e = min(s.shard_extent, 1 << 40)
    out = []
    for x in range(0, s.size[0], e):
        for y in range(0, s.size[1], e):
            for z in range(0, s.size[2], e):
                if (x, y, z) not in have:
                    out.append(((x, y, z), (x + e, y + e, z + e)))
    return out


def test_labels_equal_brute_force(exp, ds):
    rng = np.random.default_rng(1)
    for scale in (0, 1):
        size = np.array(ds.scale(scale).size)
        missing = _missing_shard_boxes(ds, scale)
        for labels in ("agglomerated", "supervoxels", _mapping(exp)):
            vol = exp.expected(scale, labels)
            boxes = [[[0, 0, 0], size.tolist()], [[64, 0, 64], [128, 64, 128]], [[3, 5, 7], [9, 6, 8]],
                     [[60, 60, 60], [70, 70, 70]], [(size - 1).tolist(), size.tolist()]]
            for _ in range(8):
                a = rng.integers(0, size)
                b = np.minimum(a + rng.integers(1, 150, 3), size)
                boxes.append([a.tolist(), b.tolist()])
            for lo, hi in boxes:
                lo, hi = np.minimum(lo, size - 1).tolist(), np.minimum(hi, size).tolist()
                hits_missing = any((np.array(lo) < m[1]).all() and (np.array(hi) > m[0]).all() for m in missing)
                if hits_missing:
                    with pytest.raises(MissingShardError):
                        ds.labels([lo, hi], scale=scale, labels=labels)
                    continue
                want = np.unique(vol[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]])
                got = ds.labels([lo, hi], scale=scale, labels=labels)
                assert got.dtype == np.uint64
                np.testing.assert_array_equal(got, want)
    assert labels_in_box(ds, [[5, 5, 5], [5, 9, 9]]).size == 0
    with pytest.raises(SpecError, match="not inside"):
        ds.labels([[0, 0, 0], [201, 10, 10]])


def test_labels_decode_only_cut_chunks(exp, ds, monkeypatch):
    calls = []
    orig = dvidshards.Dataset.read

    def spy(self, box, *a, **k):
        calls.append(np.asarray(box).tolist())
        return orig(self, box, *a, **k)

    monkeypatch.setattr(dvidshards.Dataset, "read", spy)
    got = ds.labels([[0, 0, 0], [128, 128, 128]])  # whole chunks only
    assert calls == []
    np.testing.assert_array_equal(got, np.unique(exp.expected(0)[:128, :128, :128]))
    c = ds.chunks(0)
    c = c[(c * 64 + 64 <= ds.scale(0).size).all(axis=1)][0] * 64  # a present inner chunk
    ds.labels([(c + 1).tolist(), (c + 64).tolist()])
    assert calls == [[(c + 1).tolist(), (c + 64).tolist()]]


def _brute_chunks(vol, ids, chunk=64):
    out = []
    nx, ny, nz = (-(-n // chunk) for n in vol.shape)
    for cz in range(nz):
        for cy in range(ny):
            for cx in range(nx):
                sub = vol[cx * chunk:(cx + 1) * chunk, cy * chunk:(cy + 1) * chunk, cz * chunk:(cz + 1) * chunk]
                if np.isin(sub, ids).any():
                    out.append((cx, cy, cz))
    return np.array(out, np.int64).reshape(-1, 3)


def test_chunks_with_equal_brute_force(exp, ds, monkeypatch):
    import zstandard

    def no_zstd(*a, **k):
        raise AssertionError("chunks_with decompressed a block")

    rng = np.random.default_rng(4)
    for scale in (0, 1):
        for labels in ("agglomerated", "supervoxels", _mapping(exp)):
            vol = exp.expected(scale, labels)
            u = np.unique(vol)
            for ids in (u[1:2], rng.choice(u[1:], 3, replace=False), np.array([2**63 + 5], np.uint64)):
                with monkeypatch.context() as m:
                    m.setattr(zstandard.ZstdDecompressor, "decompress", no_zstd)
                    got = ds.chunks_with(ids, scale=scale, labels=labels)
                np.testing.assert_array_equal(got, _brute_chunks(vol, ids))
    assert chunks_with(ds, 10**6).shape == (0, 3)
    with pytest.raises(SpecError, match="non-negative"):
        ds.chunks_with([-1])


@pytest.fixture(scope="module")
def index(exp, tmp_path_factory):
    out = tmp_path_factory.mktemp("idx") / "idx"
    rep = label_index(exp.root, out, scale=0, partitions=4, progress=False)
    assert rep.ok
    return out


def test_body_index_round_trip(exp, ds, index):
    bi = ds.body_index(index)
    assert isinstance(bi, BodyIndex) and bi.scale == 0 and bi.bits == 2
    body, sv = exp.expected(0), exp.expected(0, "supervoxels")
    bodies = np.unique(body)[1:]
    assert len(bodies) > 5
    for b in bodies:
        np.testing.assert_array_equal(bi.blocks(b), _brute_chunks(body, [b]))
        m = body == b
        s, n = np.unique(sv[m], return_counts=True)
        assert bi.supervoxel_sizes(b) == dict(zip(s.tolist(), n.tolist(), strict=True))
        assert bi.size(b) == int(m.sum())
        x, y, z = np.nonzero(m)
        lo = np.array([x.min(), y.min(), z.min()]) // 64 * 64
        hi = np.minimum((np.array([x.max(), y.max(), z.max()]) // 64 + 1) * 64, body.shape)
        assert bi.box(b) == [lo.tolist(), hi.tolist()]
    assert bi.blocks(123456789).shape == (0, 3) and bi.supervoxel_sizes(123456789) == {}
    assert bi.box(123456789) is None
    with pytest.raises(SpecError, match="not a label index"):
        BodyIndex(exp.root)


def test_body_mask_equals_volume(exp, ds, index):
    body = exp.expected(0)
    bodies = np.unique(body)[1:]
    for k, b in enumerate(bodies[:6]):
        m, box = ds.body_mask(b, scale=0, index=index if k % 2 else None)
        x, y, z = np.nonzero(body == b)
        lo = [int(x.min()), int(y.min()), int(z.min())]
        hi = [int(x.max()) + 1, int(y.max()) + 1, int(z.max()) + 1]
        assert box == [lo, hi]
        np.testing.assert_array_equal(m, body[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]] == b)
    sv = exp.expected(0, "supervoxels")
    s = int(np.unique(sv)[3])
    r = body_mask(ds, s, scale=0, labels="supervoxels")
    x, y, z = np.nonzero(sv == s)
    np.testing.assert_array_equal(r.mask, sv[x.min():x.max() + 1, y.min():y.max() + 1, z.min():z.max() + 1] == s)
    r = ds.body_mask(987654321)
    assert r.mask.shape == (0, 0, 0) and r.box is None
    with pytest.raises(SpecError, match="not scale 1"):
        ds.body_mask(int(bodies[0]), scale=1, index=index)
    with pytest.raises(SpecError, match="supervoxels labels"):
        ds.body_mask(int(bodies[0]), scale=0, labels="supervoxels", index=index)


# --------------------------------------------------------------------------- label_at, unique, mapping


def test_label_at_equals_brute_force(exp, ds, monkeypatch):
    from dvidshards.formats.records import RecordTable

    rng = np.random.default_rng(2)
    for scale in (0, 1):
        size = np.array(ds.scale(scale).size)
        missing = _missing_shard_boxes(ds, scale)
        for labels in ("agglomerated", "supervoxels", _mapping(exp)):
            vol = exp.expected(scale, labels)
            pts = rng.integers(0, size, (400, 3))
            pts = np.concatenate([pts, [[0, 0, 0], (size - 1).tolist()], np.argwhere(vol > 0)[::997]])
            bad = np.array([any((p >= m[0]).all() and (p < m[1]).all() for m in missing) for p in pts])
            got = dvidshards.query.label_at(ds, pts[~bad], scale=scale, labels=labels)
            assert got.dtype == np.uint64
            np.testing.assert_array_equal(got, vol[tuple(pts[~bad].T)])
            filled = dvidshards.query.label_at(ds, pts, scale=scale, labels=labels, fill_missing_shards=True)
            np.testing.assert_array_equal(filled, np.where(bad, 0, vol[tuple(pts.T)]))
            if bad.any():
                with pytest.raises(MissingShardError):
                    dvidshards.query.label_at(ds, pts[bad][:1], scale=scale, labels=labels)
    # one zstd frame per chunk holding points, none for a solid chunk; no voxel decoded
    calls = []
    orig = RecordTable.block
    monkeypatch.setattr(RecordTable, "block", lambda self, i: calls.append(i) or orig(self, i))
    monkeypatch.setattr(RecordTable, "decode_into", lambda *a: pytest.fail("decoded voxels"))
    pts = np.argwhere(exp.expected(0) > 0)[::50]
    got = dvidshards.query.label_at(ds, pts)
    np.testing.assert_array_equal(got, exp.expected(0)[tuple(pts.T)])
    assert 0 < len(calls) <= len(np.unique(pts // 64, axis=0))
    with pytest.raises(SpecError, match=r"point \[200, 0, 0\] \(#1\) is outside"):
        dvidshards.query.label_at(ds, [[0, 0, 0], [200, 0, 0]])
    with pytest.raises(SpecError, match="integer"):
        dvidshards.query.label_at(ds, [[0.5, 0, 0]])
    assert dvidshards.query.label_at(ds, np.zeros((0, 3), int)).shape == (0,)


def test_unique_with_counts_equals_brute_force(exp, ds, monkeypatch):
    from dvidshards.formats.records import RecordTable

    rng = np.random.default_rng(5)
    for scale in (0, 1):
        size = np.array(ds.scale(scale).size)
        missing = _missing_shard_boxes(ds, scale)
        for labels in ("agglomerated", "supervoxels", _mapping(exp)):
            vol = exp.expected(scale, labels)
            boxes = [[[0, 0, 0], size.tolist()], [[64, 0, 0], [128, 64, 64]], [[3, 5, 7], [70, 66, 68]]]
            for _ in range(6):
                a = rng.integers(0, size)
                boxes.append([a.tolist(), (a + rng.integers(1, 140, 3)).tolist()])
            for lo, hi in boxes:
                hi = np.minimum(hi, size).tolist()
                u, n = np.unique(vol[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]], return_counts=True)
                kw = dict(scale=scale, labels=labels)
                if any((np.array(lo) < m[1]).all() and (np.array(hi) > m[0]).all() for m in missing):
                    with pytest.raises(MissingShardError):
                        dvidshards.query.unique(ds, [lo, hi], **kw)
                    got_u, got_n = dvidshards.query.unique(ds, [lo, hi], counts=True, fill_missing_shards=True, **kw)
                else:
                    got_u, got_n = dvidshards.query.unique(ds, [lo, hi], counts=True, **kw)
                    np.testing.assert_array_equal(dvidshards.query.unique(ds, [lo, hi], **kw), u)
                np.testing.assert_array_equal(got_u, u)
                np.testing.assert_array_equal(got_n, n)
    # whole chunks answer ids from their lists: no zstd
    monkeypatch.setattr(RecordTable, "block", lambda *a: pytest.fail("decompressed a block"))
    np.testing.assert_array_equal(dvidshards.query.unique(ds, [[0, 0, 0], [128, 128, 128]]),
                                  np.unique(exp.expected(0)[:128, :128, :128]))
    assert dvidshards.query.unique(ds, [[5, 5, 5], [5, 9, 9]], counts=True)[0].size == 0


def test_unique_counts_solid_chunks_without_decompressing(tmp_path, monkeypatch):
    from dvidshards.formats.records import RecordTable
    from dvidshards.writer import write_export

    vol = np.zeros((128, 64, 64), np.uint64)
    vol[:64] = 7  # a solid chunk
    vol[64:, :32] = 9  # a mixed one
    write_export(vol, tmp_path / "e", mapping={7: 70, 9: 90}, info=True)
    ds = dvidshards.Dataset(str(tmp_path / "e"))
    calls = []
    orig = RecordTable.block
    monkeypatch.setattr(RecordTable, "block", lambda self, i: calls.append(i) or orig(self, i))
    u, n = dvidshards.query.unique(ds, [[10, 0, 0], [100, 64, 64]], counts=True)
    assert u.tolist() == [0, 70, 90] and n.tolist() == [36 * 32 * 64, 54 * 64 * 64, 36 * 32 * 64]
    assert len(calls) == 1  # the mixed chunk only


def test_mapping_from_the_records(exp, ds, monkeypatch):
    import zstandard

    monkeypatch.setattr(zstandard.ZstdDecompressor, "decompress", lambda *a, **k: pytest.fail("decompressed"))
    m = dvidshards.query.mapping(ds)
    sv, body = exp.expected(0, "supervoxels"), exp.expected(0)
    pairs = np.unique(np.stack([sv[sv > 0], body[sv > 0]], axis=1), axis=0)
    np.testing.assert_array_equal(m.keys, pairs[:, 0])
    np.testing.assert_array_equal(m.values, pairs[:, 1])
    t = dvidshards.query.mapping(ds, table=True, supervoxels=pairs[::3, 0].tolist() + [12345])
    assert t.column_names == ["supervoxel", "body"]
    np.testing.assert_array_equal(t["supervoxel"].to_numpy(), pairs[::3, 0])
    np.testing.assert_array_equal(t["body"].to_numpy(), pairs[::3, 1])
    assert dvidshards.query.held_scales(ds) == [0, 1]


def test_body_index_pairs(exp, index):
    bi = BodyIndex(index)
    got = np.concatenate([np.stack(p, axis=1) for p in bi.pairs()])
    sv, body = exp.expected(0, "supervoxels"), exp.expected(0)
    want = np.unique(np.stack([sv[sv > 0], body[sv > 0]], axis=1), axis=0)
    np.testing.assert_array_equal(got[np.lexsort((got[:, 1], got[:, 0]))], want)
