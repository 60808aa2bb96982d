"""Supervoxel and mapping queries from a label index and a supervoxel -> body table built once,
never a rescan per id; a label index read from any store; Body.exists()."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dvidshards import Dataset
from dvidshards.bodies import Body
from dvidshards.errors import NotFoundError, ShardFormatError, SpecError
from dvidshards.jobs.labelindex import label_index
from dvidshards.query import BodyIndex, mapping
from dvidshards.stores import MemoryStore
from dvidshards.stores.base import Stat, slice_range
from tests.support.exports import make_export


class Counting(MemoryStore):
    """A memory store that counts the bytes it hands out (whole files mapped, ranges read)."""

    def __init__(self, root: Path, name: str):
        super().__init__({p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()},
                         name=name)
        self.bytes_read = 0
        self.total = sum(len(v) for v in self.files.values())

    def map(self, key):
        a = super().map(key)
        self.bytes_read += a.nbytes
        return a

    async def read(self, key, start=None, stop=None):
        data = slice_range(MemoryStore.map(self, key), start, stop, self.describe(key))
        self.bytes_read += len(data)
        return data

    async def get(self, key):
        data = await super().get(key)
        self.bytes_read += len(data or b"")
        return data

    async def stat(self, key):
        return Stat(len(MemoryStore.map(self, key)), None)


@pytest.fixture(scope="module")
def exp(tmp_path_factory):
    root = tmp_path_factory.mktemp("svq")
    ex = make_export(root / "exp", (160, 140, 130), seed=8, scales=2)
    label_index(ex.root, str(root / "idx"), scale=0, spec=ex.spec, partitions=4, progress=False)
    ex.index = root / "idx"
    return ex


def _brute_chunks(vol, v) -> np.ndarray:
    c = np.unique(np.argwhere(vol == v) // 64, axis=0)
    return c[np.lexsort((c[:, 0], c[:, 1], c[:, 2]))]


def test_supervoxel_queries_read_no_more_for_more_ids(exp):
    """20 supervoxels' sizes, chunks, bodies and /mapping with a label index: the index's
    supervoxel table is read once, each body's rows once; the export is not read at all."""
    ds = Dataset(Counting(Path(exp.root), "svq-export"), spec=exp.spec)
    idx = BodyIndex(Counting(exp.index, "svq-index"))
    svs = np.unique(exp.sv[exp.sv != 0])
    svs = svs[np.random.default_rng(1).choice(len(svs), 20, replace=False)]
    body_of = dict(exp.mapping.tolist())
    read = []
    for sv in svs.tolist():
        b = Body(ds, sv, labels="supervoxels", index=idx)
        assert b.size() == int((exp.sv == sv).sum())
        np.testing.assert_array_equal(b.chunks(), _brute_chunks(exp.sv, sv))
        assert b.supervoxels().tolist() == [sv] and b.exists()
        assert mapping(ds, supervoxels=[sv, 999_999_999], index=idx).values.tolist() == [body_of[sv]]
        read.append(idx.store.bytes_read)
    assert ds.store.bytes_read == 0  # nothing of the export
    assert read[-1] - read[1] <= read[0] // 2  # 18 more ids: at most the body rows of a few row groups
    assert read[-1] <= 4 * idx.store.total  # each bucket: its footer, its body rows, its two columns once


def test_mapping_without_an_index_scans_the_export_once(exp):
    ds = Dataset(Counting(Path(exp.root), "svq-export2"), spec=exp.spec)
    svs = np.unique(exp.sv[exp.sv != 0])[::3]
    body_of = dict(exp.mapping.tolist())
    m = mapping(ds, supervoxels=svs[:1])
    once = ds.store.bytes_read
    assert 0 < once <= sum(len(v) for k, v in ds.store.files.items() if k.startswith("s0/"))
    for sv in svs.tolist():
        assert mapping(ds, supervoxels=[sv]).values.tolist() == [body_of[sv]]
    assert ds.store.bytes_read == once
    whole = mapping(ds)
    present = np.unique(exp.sv[exp.sv != 0])
    np.testing.assert_array_equal(whole.keys, present)
    np.testing.assert_array_equal(whole.values, [body_of[v] for v in present.tolist()])
    assert m.keys.tolist() == svs[:1].tolist()


@pytest.mark.parametrize("scale", [0, 1])
def test_a_supervoxel_with_an_index_of_bodies_answers_as_without(exp, scale):
    ds = Dataset(exp.root, spec=exp.spec)
    idx = BodyIndex(exp.index)
    for sv in np.unique(exp.scales[scale][exp.scales[scale] != 0])[::7].tolist():
        plain = Body(ds, sv, scale=scale, labels="supervoxels")
        indexed = Body(ds, sv, scale=scale, labels="supervoxels", index=idx)
        np.testing.assert_array_equal(indexed.chunks(), plain.chunks())
        assert indexed.size() == plain.size() == int((exp.scales[scale] == sv).sum())
        assert indexed.box() == plain.box()
        assert indexed.sparsevol() == plain.sparsevol()
        if scale == 0:
            for a, b in zip(indexed.supervoxel_counts(), plain.supervoxel_counts(), strict=True):
                np.testing.assert_array_equal(np.sort(a, axis=0), np.sort(b, axis=0))
    with pytest.raises(SpecError, match="labels"):  # a body of a mapping given at read time is not the index's
        Body(ds, 1, labels=exp.mapping, index=idx)


def test_exists_is_a_method_from_the_index_or_the_lists(exp):
    ds = Dataset(exp.root, spec=exp.spec)
    idx = BodyIndex(exp.index)
    vol = exp.expected(0)
    body = int(np.bincount(np.unique(vol, return_inverse=True)[1].ravel())[1:].argmax() + 1)
    body = int(np.unique(vol)[body])
    sv_only = int(next(s for s, b in exp.mapping.tolist() if s != b and (exp.sv == s).any()))
    for index in (None, idx):
        assert Body(ds, body, index=index).exists() and Body(ds, body, index=index).exists(1)
        assert not Body(ds, 987_654_321, index=index).exists()
        assert not Body(ds, sv_only, index=index).exists()  # a supervoxel is not a body
        assert Body(ds, sv_only, labels="supervoxels", index=index).exists()
    assert not [k for k, v in vars(Body).items() if isinstance(v, property)]  # a property never reads


def test_an_absent_body_is_named_a_supervoxel_once_the_table_is_built(exp):
    ds = Dataset(exp.root, spec=exp.spec)
    idx = BodyIndex(exp.index)
    sv_only = int(next(s for s, b in exp.mapping.tolist() if s != b and (exp.sv == s).any()))
    body = dict(exp.mapping.tolist())[sv_only]
    with pytest.raises(NotFoundError, match="supervoxel id"):  # no scan to know more
        Body(ds, sv_only, index=idx).size()
    idx.bodies_of([1])
    with pytest.raises(NotFoundError, match=f"supervoxel of body {body}"):
        Body(ds, sv_only, index=idx).size()


@pytest.mark.filterwarnings("ignore::dvidshards.errors.GeometryWarning")
def test_one_supervoxel_in_two_bodies_is_a_shard_format_error(tmp_path):
    """Two records pairing one supervoxel with different bodies are not one export: said, not guessed."""
    import zstandard

    from dvidshards.formats.codec import encode_block
    from dvidshards.writer import write_shard

    raw = encode_block(np.full((64, 64, 64), 7, np.uint64))
    rec = {"supervoxels": [7], "dvid_compressed_block": zstandard.ZstdCompressor().compress(raw),
           "uncompressed_size": len(raw), "chunk_y": 0, "chunk_z": 0}
    write_shard(tmp_path / "exp" / "s0" / "0_0_0", [{**rec, "chunk_x": 0, "labels": [1]}, {**rec, "chunk_x": 1,
                                                                                           "labels": [2]}])
    ds = Dataset(str(tmp_path / "exp"))
    with pytest.raises(ShardFormatError, match="supervoxel 7 belongs to body 1 in one record and to 2"):
        mapping(ds, supervoxels=[7])


def test_label_index_in_a_memory_store_equals_the_folder(exp):
    store = MemoryStore.named("svq-index-mem")
    store.files.update({p.relative_to(exp.index).as_posix(): p.read_bytes()
                        for p in Path(exp.index).rglob("*") if p.is_file()})
    _same_index(BodyIndex("memory://svq-index-mem/"), BodyIndex(exp.index))


def _same_index(remote: BodyIndex, local: BodyIndex) -> None:
    assert remote.scale == local.scale and remote.bits == local.bits
    bodies, sizes = local.body_sizes()
    got = remote.body_sizes()
    np.testing.assert_array_equal(got[0], bodies)
    np.testing.assert_array_equal(got[1], sizes)
    for b in bodies[::3].tolist():
        np.testing.assert_array_equal(remote.blocks(b), local.blocks(b))
        assert remote.supervoxel_sizes(b) == local.supervoxel_sizes(b)
    pairs = [np.concatenate(x) for x in zip(*remote.pairs(), strict=True)]
    np.testing.assert_array_equal(remote.bodies_of(pairs[0]), pairs[1])


@pytest.mark.slow
def test_label_index_written_to_s3_is_read_there(exp, tmp_path):
    from tests.support.servers import MotoS3

    with MotoS3() as s3:
        s3.bucket("svq")
        q = f"?endpoint_override=127.0.0.1:{s3.port}&scheme=http&region={s3.REGION}"
        rep = label_index(exp.root, f"s3://svq/idx{q}", scale=0, spec=exp.spec, partitions=4, progress=False)
        assert rep.ok
        remote = BodyIndex(f"s3://svq/idx{q}")
        _same_index(remote, BodyIndex(exp.index))
        ds = Dataset(exp.root, spec=exp.spec)
        sv = int(exp.mapping[0, 0])
        assert Body(ds, sv, labels="supervoxels", index=remote).size() == int((exp.sv == sv).sum())
        with pytest.raises(SpecError, match="not a label index"):
            BodyIndex(f"s3://svq/nothing{q}")


def test_supervoxels_of_the_real_shard_from_its_label_index(dvid_data, tmp_path):
    """The real mCNS shard (scale 1, 258 records): a label index of it answers 20 supervoxels'
    sizes, chunks and bodies as DVID's own blocks hold them, decoded one by one."""
    import json

    import zstandard

    from dvidshards.formats.codec import decode_block
    from tests.support.data import REAL_SHARD

    root = tmp_path / "real"
    (root / "s1").mkdir(parents=True)
    (root / "s1" / f"{REAL_SHARD}.arrow").symlink_to(dvid_data / f"{REAL_SHARD}.arrow")
    (root / "s1" / f"{REAL_SHARD}.csv").symlink_to(dvid_data / f"{REAL_SHARD}-newformat.csv")
    spec = json.loads((dvid_data / "mcns-ng-specs.json").read_text())
    label_index(str(root), str(tmp_path / "idx"), scale=1, spec=spec, progress=False)
    ds, idx = Dataset(str(root), spec=spec), BodyIndex(tmp_path / "idx")
    sizes: dict[int, int] = {}
    chunks: dict[int, set] = {}
    body_of: dict[int, int] = {}
    t = ds.shard(1, tuple(int(v) for v in REAL_SHARD.split("_"))).table()  # brute force: every block decoded
    for k in range(len(t)):
        vol = decode_block(zstandard.ZstdDecompressor().decompress(bytes(t.payload(k))))
        u, n = np.unique(vol, return_counts=True)
        for v, m in zip(u.tolist(), n.tolist(), strict=True):
            sizes[v] = sizes.get(v, 0) + m
            chunks.setdefault(v, set()).add(tuple(int(x) for x in t.coords[k]))
        body_of.update(zip(t.supervoxels(k).tolist(), t.labels(k).tolist(), strict=True))
    svs = sorted(v for v in sizes if v)[::max(1, len(sizes) // 20)][:20]
    for sv in svs:
        b = Body(ds, sv, scale=1, labels="supervoxels", index=idx)
        assert b.size() == sizes[sv]
        assert {tuple(c) for c in b.chunks().tolist()} == chunks[sv]
    assert idx.bodies_of(svs).tolist() == [body_of[v] for v in svs]
    assert mapping(ds, supervoxels=svs, index=idx).values.tolist() == [body_of[v] for v in svs]


def test_a_stopped_supervoxel_table_build_keeps_nothing(exp, monkeypatch):
    """serve-dvid builds the table on a thread and stops it at shutdown (a thread left inside
    pyarrow at interpreter exit can abort the process): a stopped build returns None after the
    bucket it reads and keeps no partial table; the next build is whole."""
    import threading

    idx = BodyIndex(exp.index)
    assert len(list(idx.pairs())) > 1
    stop, seen = threading.Event(), []
    whole = BodyIndex.pairs

    def pairs(self):
        for p in whole(self):
            seen.append(len(p[0]))
            stop.set()  # as a shutdown during the first bucket
            yield p

    monkeypatch.setattr(BodyIndex, "pairs", pairs)
    assert idx.supervoxel_table(stop=stop) is None and len(seen) == 1
    assert idx.supervoxel_table(build=False) is None
    monkeypatch.setattr(BodyIndex, "pairs", whole)
    svs = np.unique(exp.sv[exp.sv != 0])
    body_of = dict(exp.mapping.tolist())
    np.testing.assert_array_equal(idx.bodies_of(svs), [body_of[v] for v in svs.tolist()])


def test_a_label_index_over_http_answers_supervoxel_queries(exp):
    """http(s) cannot list: the index's buckets are the ones its bits name, absent ones empty."""
    from tests.support.servers import RangeServer

    with RangeServer(exp.index) as srv:
        idx = BodyIndex(srv.url)
        svs = np.unique(exp.sv[exp.sv != 0])
        body_of = dict(exp.mapping.tolist())
        np.testing.assert_array_equal(idx.bodies_of(svs), [body_of[v] for v in svs.tolist()])
        bodies, sizes = idx.body_sizes()
        local = BodyIndex(exp.index).body_sizes()
        np.testing.assert_array_equal(bodies, local[0])
        np.testing.assert_array_equal(sizes, local[1])
