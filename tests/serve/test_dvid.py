"""serve-dvid: DVID's read-only labelmap API over an export, read back by parsers written here
from DVID's help text (``datatype/labelmap/labelmap.go``) and FORMATS.md §1, and by a client
nobody here wrote (``dvid-point-cloud``), against brute force over the volumes the export was
written from (and TensorStore's read of the real mCNS shard)."""

from __future__ import annotations

import gzip
import itertools
import json
import math
import os
import signal
import struct
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import dvidshards
from dvidshards.jobs.labelindex import label_index
from tests.support.data import REAL_SHARD
from tests.support.exports import make_export
from tests.support.sparsevol import naive_dvid_bytes, reference_coarse, reference_rles
from tests.support.waiting import HANG_SECONDS, Lines
from tests.test_query_supervoxels import Counting

requests = pytest.importorskip("requests")
pytest.importorskip("aiohttp")
dpc = pytest.importorskip("dvid_point_cloud")

from dvidshards.serve.dvid import serve  # noqa: E402 - after the optional imports are checked

# --------------------------------------------------------------------------- independent parsers


def parse_rles(data: bytes) -> np.ndarray:
    """Legacy RLEs: u8 descriptor 0, u8 dims 3, u8 run dim 0, u8 reserved, u32 voxels, u32 spans,
    then spans of 4 little-endian int32 (x, y, z, length)."""
    desc, dims, rundim, _, _, n = struct.unpack_from("<BBBBII", data, 0)
    assert (desc, dims, rundim) == (0, 3, 0) and len(data) == 12 + 16 * n
    return np.array(struct.unpack_from(f"<{4 * n}i", data, 12), np.int64).reshape(n, 4)


def parse_srles(data: bytes) -> np.ndarray:
    assert len(data) % 16 == 0
    return np.array(struct.unpack(f"<{len(data) // 4}i", data), np.int64).reshape(-1, 4)


def parse_binary_blocks(data: bytes):
    """format=blocks: 3 x u32 sub-blocks per axis, u64 label; per block 3 x i32 offset, a content
    byte (0 background, 1 foreground, 2 both: then per sub-block a content byte and, for 2, a
    64-byte mask, one bit per voxel)."""
    gx, gy, gz, label = struct.unpack_from("<3IQ", data, 0)
    p, blocks = 20, {}
    while p < len(data):
        off = struct.unpack_from("<3i", data, p)
        flag = data[p + 12]
        p += 13
        mask = np.zeros((gz * 8, gy * 8, gx * 8), bool)
        if flag == 1:
            mask[:] = True
        elif flag == 2:
            for sz, sy, sx in itertools.product(range(gz), range(gy), range(gx)):
                f = data[p]
                p += 1
                view = mask[sz * 8:sz * 8 + 8, sy * 8:sy * 8 + 8, sx * 8:sx * 8 + 8]
                if f == 1:
                    view[:] = True
                elif f == 2:  # voxel i (x fastest, then y, then z) is bit i % 8 of byte i // 8
                    view[:] = np.unpackbits(np.frombuffer(data, np.uint8, 64, p), bitorder="little").reshape(8, 8, 8)
                    p += 64
                else:
                    assert f == 0
        else:
            assert flag == 0
        blocks[off] = mask
    return label, (gx, gy, gz), blocks


def parse_block_records(data: bytes):
    """``/blocks`` and ``/specificblocks``: int32 x, y, z, nbytes, then nbytes of block."""
    p, out = 0, []
    while p < len(data):
        x, y, z, n = struct.unpack_from("<4i", data, p)
        out.append(((x, y, z), data[p + 16:p + 16 + n]))
        p += 16 + n
    assert p == len(data)
    return out


def decode_label_block(raw: bytes) -> np.ndarray:
    """A DVID label block (FORMATS.md §1) as a (z, y, x) uint64 volume, sub-block by sub-block."""
    gx, gy, gz, n = struct.unpack_from("<4I", raw, 0)
    labels = np.frombuffer(raw, "<u8", n, 16)
    out = np.zeros((gz * 8, gy * 8, gx * 8), np.uint64)
    if n == 1:
        out[:] = labels[0]
        return out
    nsub = gx * gy * gz
    p = 16 + 8 * n
    nsb = np.frombuffer(raw, "<u2", nsub, p)
    p += 2 * nsub
    idx = np.frombuffer(raw, "<u4", int(nsb.sum()), p)
    p += 4 * len(idx)
    k = 0
    for s in range(nsub):
        sz, sy, sx = s // (gx * gy), (s // gx) % gy, s % gx
        cnt = int(nsb[s])
        ents = idx[k:k + cnt]
        k += cnt
        view = out[sz * 8:sz * 8 + 8, sy * 8:sy * 8 + 8, sx * 8:sx * 8 + 8]
        if cnt == 1:
            view[:] = labels[ents[0]]
        elif cnt > 1:
            b = math.ceil(math.log2(cnt))
            bits = np.unpackbits(np.frombuffer(raw, np.uint8, 64 * b, p)).reshape(512, b)  # MSB first
            p += 64 * b
            view[:] = labels[ents[bits @ (1 << np.arange(b - 1, -1, -1))]].reshape(8, 8, 8)
    return out


def lz4_decode(src: bytes) -> bytes:
    """An lz4 block (no frame): sequences of literals and (offset, length) matches."""
    out, p = bytearray(), 0
    while p < len(src):
        token = src[p]
        p += 1
        lit = token >> 4
        if lit == 15:
            while True:
                lit += src[p]
                p += 1
                if src[p - 1] != 255:
                    break
        out += src[p:p + lit]
        p += lit
        if p >= len(src):
            break
        off = src[p] | src[p + 1] << 8
        p += 2
        m = (token & 15) + 4
        if token & 15 == 15:
            while True:
                m += src[p]
                p += 1
                if src[p - 1] != 255:
                    break
        start = len(out) - off  # a match copies from ``off`` back; one closer than its length repeats
        out += out[start:start + m] if off >= m else (bytes(out[start:]) * (m // off + 1))[:m]
    return bytes(out)


def block_key(key: int) -> tuple[int, int, int]:
    """DVID's block index: ZYX packed little-endian 21-bit numbers, the MSB of each the sign."""
    def axis(v):
        return -(v & 0xFFFFF) if v & 0x100000 else v & 0xFFFFF

    return axis(key & 0x1FFFFF), axis(key >> 21 & 0x1FFFFF), axis(key >> 42 & 0x1FFFFF)


def label_index_message():
    """DVID's LabelIndex (labelops.proto) built with the protobuf runtime, not dvidshards' code."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    F = descriptor_pb2.FieldDescriptorProto
    f = descriptor_pb2.FileDescriptorProto(name="h3test_labelops.proto", package="h3test", syntax="proto3")
    sv = f.message_type.add(name="SVCount")
    e = sv.nested_type.add(name="CountsEntry")
    e.options.map_entry = True
    e.field.add(name="key", number=1, type=F.TYPE_UINT64, label=F.LABEL_OPTIONAL)
    e.field.add(name="value", number=2, type=F.TYPE_UINT32, label=F.LABEL_OPTIONAL)
    sv.field.add(name="counts", number=1, type=F.TYPE_MESSAGE, label=F.LABEL_REPEATED,
                 type_name=".h3test.SVCount.CountsEntry")
    li = f.message_type.add(name="LabelIndex")
    e = li.nested_type.add(name="BlocksEntry")
    e.options.map_entry = True
    e.field.add(name="key", number=1, type=F.TYPE_UINT64, label=F.LABEL_OPTIONAL)
    e.field.add(name="value", number=2, type=F.TYPE_MESSAGE, label=F.LABEL_OPTIONAL, type_name=".h3test.SVCount")
    li.field.add(name="blocks", number=1, type=F.TYPE_MESSAGE, label=F.LABEL_REPEATED,
                 type_name=".h3test.LabelIndex.BlocksEntry")
    for name, num, t in (("label", 2, F.TYPE_UINT64), ("last_mut_id", 3, F.TYPE_UINT64),
                         ("last_mod_time", 4, F.TYPE_STRING), ("last_mod_user", 5, F.TYPE_STRING),
                         ("last_mod_app", 6, F.TYPE_STRING)):
        li.field.add(name=name, number=num, type=t, label=F.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("h3test.LabelIndex"))


# --------------------------------------------------------------------------- fixtures, brute force


@pytest.fixture(scope="module")
def exp(tmp_path_factory):
    e = make_export(tmp_path_factory.mktemp("servedvid") / "exp", shape=(200, 170, 150), seed=7, scales=2)
    with open(os.path.join(e.root, "info"), "w") as f:
        json.dump(e.spec, f)
    return e


@pytest.fixture(scope="module")
def index(exp, tmp_path_factory):
    out = tmp_path_factory.mktemp("servedvid_idx") / "idx"
    assert label_index(exp.root, out, scale=0, partitions=4, progress=False).ok
    return str(out)


@pytest.fixture(scope="module")
def servers(exp, index):
    """(with the label index, answering missing shards as background (the default); plain and --strict)."""
    a = serve(exp.root, label_index=index, port=0, threads=4)
    b = serve(exp.root, port=0, threads=2, strict=True)
    yield a, b
    a.shutdown()
    b.shutdown()


def url(srv, tail: str) -> str:
    return f"{srv.url}/api/node/{srv.api.uuid}/segmentation/{tail}"


def get(srv, tail: str, **kw):
    return requests.get(url(srv, tail), timeout=HANG_SECONDS, **kw)


def bodies(vol, n=4):
    ids, counts = np.unique(vol[vol != 0], return_counts=True)
    order = np.argsort(counts)
    return [int(v) for v in ids[order[np.linspace(0, len(order) - 1, n).astype(int)]]]


def brute_mask(vol, b):
    m = vol == b
    idx = np.argwhere(m)
    lo, hi = idx.min(axis=0), idx.max(axis=0) + 1
    return m[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]], lo


def chunk_of(vol, c, origin=(0, 0, 0)):
    """Chunk c of an (x, y, z) volume starting at voxel ``origin`` as DVID's (z, y, x) 64³ block
    (padded with 0)."""
    out = np.zeros((64, 64, 64), np.uint64)
    a = np.asarray(c, np.int64) * 64 - np.asarray(origin, np.int64)
    part = vol[a[0]:a[0] + 64, a[1]:a[1] + 64, a[2]:a[2] + 64]
    out[:part.shape[2], :part.shape[1], :part.shape[0]] = part.T
    return out


# --------------------------------------------------------------------------- instance, points


def test_info_and_repo_info(exp, servers):
    srv = servers[0]
    info = get(srv, "info").json()
    ext = info["Extended"]
    assert info["Base"]["TypeName"] == "labelmap" and info["Base"]["Name"] == "segmentation"
    assert ext["BlockSize"] == [64, 64, 64] and ext["VoxelSize"] == [8.0, 8.0, 8.0]
    assert ext["MinPoint"] == [0, 0, 0] and ext["MaxPoint"] == [199, 169, 149] and ext["MaxDownresLevel"] == 1
    repo = requests.get(f"{srv.url}/api/repo/{srv.api.uuid}/info", timeout=HANG_SECONDS).json()
    assert repo["Root"] == srv.api.uuid and "segmentation" in repo["DataInstances"]
    assert list(repo["DAG"]["Nodes"]) == [srv.api.uuid]
    assert get(srv, "help").status_code == 200
    # a short uuid prefix names the node, as in DVID
    assert requests.get(f"{srv.url}/api/node/{srv.api.uuid[:6]}/segmentation/info",
                        timeout=HANG_SECONDS).status_code == 200


def test_labels_at_points_equal_brute_force(exp, servers):
    rng = np.random.default_rng(0)
    srv = servers[0]
    for scale in (0, 1):
        size = np.array(exp.scales[scale].shape)
        for sv in (False, True):
            vol = exp.expected(scale, "supervoxels" if sv else "agglomerated")
            pts = np.concatenate([rng.integers(0, size, (300, 3)), np.argwhere(vol > 0)[::401]])
            outside = [[-1, 0, 0], size.tolist(), [10**6, 5, 5]]
            q = {"scale": scale, "supervoxels": "true" if sv else "false"}
            got = get(srv, "labels", params=q, json=pts.tolist() + outside).json()
            assert got == vol[tuple(pts.T)].tolist() + [0, 0, 0]  # DVID: 0 where no block is
            for p in pts[:5]:
                r = get(srv, f"label/{p[0]}_{p[1]}_{p[2]}", params=q)
                assert r.json() == {"Label": int(vol[tuple(p)])}


# --------------------------------------------------------------------------- sparse volumes


@pytest.mark.parametrize("which", [0, 1], ids=["label-index", "scan"])
def test_sparsevol_formats_equal_brute_force(exp, servers, which):
    srv, header, n = servers[which], ("label-index", "scan")[which], 3 - which
    for scale, sv in ((0, False), (1, False), (0, True)):
        vol = exp.expected(scale, "supervoxels" if sv else "agglomerated")
        for b in bodies(vol, n):
            q = {"scale": scale, "supervoxels": str(sv).lower()}
            mask, lo = brute_mask(vol, b)
            r = get(srv, f"sparsevol/{b}", params=q)
            assert r.status_code == 200 and r.headers["X-Dvidshards-Index"] == header
            assert r.content == reference_rles(mask, lo)  # DVID's bytes, in DVID's order
            runs = parse_rles(r.content)
            assert runs[:, 3].sum() == mask.sum()
            assert get(srv, f"sparsevol/{b}", params={**q, "format": "srles"}).content == r.content[12:]
            z = get(srv, f"sparsevol/{b}", params={**q, "compression": "gzip"}, stream=True)
            assert gzip.decompress(z.raw.read()) == r.content
            label, grid, blocks = parse_binary_blocks(get(srv, f"sparsevol/{b}", params={**q, "format": "blocks"}
                                                          ).content)
            assert label == b and grid == (8, 8, 8)
            want = {tuple(int(v) * 64 for v in c) for c in np.unique((np.argwhere(vol == b)) // 64, axis=0)}
            assert set(blocks) == want
            for off, m in blocks.items():
                np.testing.assert_array_equal(m, chunk_of(vol, [o // 64 for o in off]) == b)
            assert get(srv, f"sparsevol-coarse/{b}", params=q).content == reference_coarse(mask, lo)
            assert requests.head(url(srv, f"sparsevol/{b}"), params=q, timeout=HANG_SECONDS).status_code == 200


def test_sparsevol_bounds_as_dvid_scans_them(exp, servers):
    vol = exp.expected(0)
    b = bodies(vol, 3)[1]  # a middling body: the reference loops over voxels
    mask, lo = brute_mask(vol, b)
    hi = lo + np.array(mask.shape) - 1
    mid = (lo + hi) // 2
    seen = []
    for bounds in ((lo + 3, mid + 20), (mid, hi + 5), (lo - 9, mid)):
        q = dict(zip(("minx", "miny", "minz", "maxx", "maxy", "maxz"), [int(v) for v in (*bounds[0], *bounds[1])],
                     strict=True))
        r = get(servers[0], f"sparsevol/{b}", params=q)
        want = naive_dvid_bytes(mask, lo, 64, ([int(v) for v in bounds[0]], [int(v) for v in bounds[1]]))
        assert r.content == (want if len(want) > 12 else b"")
        cut = vol[max(bounds[0][0], 0):bounds[1][0] + 1, max(bounds[0][1], 0):bounds[1][1] + 1,
                  max(bounds[0][2], 0):bounds[1][2] + 1]
        n = int((cut == b).sum())
        assert (parse_rles(r.content)[:, 3].sum() if r.content else 0) == n
        seen.append(n)
    assert max(seen) > 0
    far = {"minx": 10**5}
    assert get(servers[0], f"sparsevol/{b}", params=far).status_code == 404
    assert requests.head(url(servers[0], f"sparsevol/{b}"), params=far, timeout=HANG_SECONDS).status_code == 204


def test_sparsevol_by_point(exp, servers):
    vol = exp.expected(0)
    p = np.argwhere(vol > 0)[1234]
    b = int(vol[tuple(p)])
    assert get(servers[1], f"sparsevol-by-point/{p[0]}_{p[1]}_{p[2]}").content == get(servers[1],
                                                                                       f"sparsevol/{b}").content


# --------------------------------------------------------------------------- body facts


def test_body_endpoints_equal_brute_force(exp, servers):
    LabelIndex = label_index_message()
    for srv in servers:
        for scale in (0, 1):
            vol, svol = exp.expected(scale), exp.expected(scale, "supervoxels")
            ids = bodies(vol, 4)
            q = {"scale": scale}
            sizes = get(srv, "sizes", params=q, json=ids + [123456789]).json()
            assert sizes == [int((vol == b).sum()) for b in ids] + [0]
            for b in ids:
                m = vol == b
                assert get(srv, f"size/{b}", params=q).json() == {"voxels": int(m.sum())}
                chunks = np.unique(np.argwhere(m) // 64, axis=0)
                assert get(srv, f"sparsevol-size/{b}", params=q).json() == {
                    "voxels": int(m.sum()), "numblocks": len(chunks), "minvoxel": (chunks.min(axis=0) * 64).tolist(),
                    "maxvoxel": (chunks.max(axis=0) * 64 + 63).tolist()}
                svs, counts = np.unique(svol[m], return_counts=True)
                assert get(srv, f"supervoxels/{b}", params=q).json() == svs.tolist()
                got = get(srv, f"supervoxel-sizes/{b}", params=q).json()
                assert dict(zip(got["supervoxels"], got["sizes"], strict=True)) == dict(
                    zip(svs.tolist(), counts.tolist(), strict=True))
                msg = LabelIndex()
                msg.ParseFromString(get(srv, f"index/{b}", params=q).content)
                assert msg.label == b
                got_idx = {block_key(k): dict(v.counts) for k, v in msg.blocks.items()}
                want_idx = {}
                for c in chunks:
                    sel = tuple(slice(int(v) * 64, int(v) * 64 + 64) for v in c)
                    s, n = np.unique(svol[sel][vol[sel] == b], return_counts=True)
                    want_idx[tuple(int(v) for v in c)] = dict(zip(s.tolist(), n.tolist(), strict=True))
                assert got_idx == want_idx
                meta = get(srv, f"index/{b}", params={**q, "metadata-only": "true"}).json()
                assert meta["num_voxels"] == int(m.sum())
        s = int(np.unique(exp.expected(0, "supervoxels"))[5])
        sm = exp.expected(0, "supervoxels") == s
        assert get(srv, f"size/{s}", params={"supervoxels": "true"}).json() == {"voxels": int(sm.sum())}
        assert get(srv, f"supervoxels/{s}", params={"supervoxels": "true"}).json() == [s]
    assert get(servers[0], f"size/{ids[0]}").headers["X-Dvidshards-Index"] == "label-index"
    assert get(servers[1], f"size/{ids[0]}").headers["X-Dvidshards-Index"] == "scan"


def test_shutdown_leaves_no_table_builder_running(exp, index):
    """The supervoxel table built at start-up stops with the server (a daemon thread inside
    pyarrow at interpreter exit aborted serve-dvid once)."""
    srv = serve(exp.root, label_index=index, port=0, threads=1)
    (th, stop), = srv.nodes[0].builders
    srv.shutdown()
    assert stop.is_set() and not th.is_alive()


def test_mappings_equal_the_volumes(exp, servers):
    sv, body = exp.expected(0, "supervoxels"), exp.expected(0)
    pairs = np.unique(np.stack([sv[sv > 0], body[sv > 0]], axis=1), axis=0)
    moved = pairs[pairs[:, 0] != pairs[:, 1]]  # DVID lists the non-identity mappings
    for srv, header in ((servers[0], "label-index"), (servers[1], "scan")):
        r = get(srv, "mappings")
        assert r.headers["X-Dvidshards-Index"] == header
        got = np.array([[int(v) for v in line.split()] for line in r.text.splitlines()], np.uint64).reshape(-1, 2)
        np.testing.assert_array_equal(got[np.argsort(got[:, 0])], moved)
        raw = get(srv, "mappings", params={"format": "binary"}).content
        got = np.frombuffer(raw, "<u8").reshape(-1, 2)
        np.testing.assert_array_equal(got[np.argsort(got[:, 0])], moved)
        ask = pairs[::4, 0].tolist() + [987654321]
        assert get(srv, "mapping", json=ask).json() == pairs[::4, 1].tolist() + [0]
    top = get(servers[0], "maxlabel").json()["maxlabel"]
    assert top == int(max(sv.max(), body.max()))


def test_supervoxel_queries_with_a_label_index_read_nothing_of_the_export(exp, index):
    """20 supervoxels' sizes, chunks, supervoxels, label indexes and their /mapping: with a label
    index of bodies they are answered from its rows and its supervoxel table, not one byte of
    the export read (without it each would scan the export's lists)."""
    ds = dvidshards.Dataset(Counting(Path(exp.root), "svq-serve"), spec=exp.spec)
    sv, body = exp.expected(0, "supervoxels"), exp.expected(0)
    svs = np.unique(sv[sv != 0])
    svs = svs[np.random.default_rng(4).choice(len(svs), 20, replace=False)].tolist()
    LabelIndex = label_index_message()
    with serve(ds, label_index=index, port=0, threads=2) as srv:
        q = {"supervoxels": "true"}
        assert get(srv, "mapping", json=svs[:1]).status_code == 200  # waits for the table built at start-up
        before = ds.store.bytes_read
        for s in svs:
            m = sv == s
            chunks = np.unique(np.argwhere(m) // 64, axis=0)
            r = get(srv, f"size/{s}", params=q)
            assert r.json() == {"voxels": int(m.sum())} and r.headers["X-Dvidshards-Index"] == "label-index"
            assert get(srv, f"sparsevol-size/{s}", params=q).json() == {
                "voxels": int(m.sum()), "numblocks": len(chunks), "minvoxel": (chunks.min(axis=0) * 64).tolist(),
                "maxvoxel": (chunks.max(axis=0) * 64 + 63).tolist()}
            assert get(srv, f"supervoxels/{s}", params=q).json() == [s]
            assert get(srv, f"supervoxel-sizes/{s}", params=q).json() == {"supervoxels": [s], "sizes": [int(m.sum())]}
            msg = LabelIndex()
            msg.ParseFromString(get(srv, f"index/{s}", params=q).content)
            assert {block_key(k): dict(v.counts) for k, v in msg.blocks.items()} == {
                tuple(c): {s: int(m[tuple(slice(v * 64, v * 64 + 64) for v in c)].sum())} for c in chunks.tolist()}
        r = get(srv, "mapping", json=svs + [987654321])
        assert r.json() == [int(body[sv == s][0]) for s in svs] + [0]
        assert r.headers["X-Dvidshards-Index"] == "label-index"
        assert ds.store.bytes_read == before


def triangles(vertices, faces) -> np.ndarray:
    """A mesh's triangles as sorted rows of their corners (nm): comparable however the vertices
    are numbered or shared."""
    t = np.asarray(vertices, np.float64)[np.asarray(faces, np.int64)]  # (n, 3 corners, 3)
    t = np.sort(t.reshape(len(t), 3, 3).view([("x", float), ("y", float), ("z", float)]).reshape(len(t), 3), axis=1)
    t = t.view(float).reshape(len(t), 9)
    return t[np.lexsort(t.T[::-1])]


@pytest.mark.parametrize("legacy", [False, True], ids=["multi-resolution sharded", "legacy"])
def test_meshes_read_from_a_meshes_output_as_cloud_volume_reads_it(exp, tmp_path, legacy):
    """``--meshes OUT``: ``<body>.ngmesh`` is the body's mesh in OUT (the finest level of the
    multi-resolution format, Draco-decoded), triangle for triangle as cloud-volume reads it; a
    body OUT has no mesh of is 404."""
    pytest.importorskip("zmesh")
    CloudVolume = pytest.importorskip("cloudvolume").CloudVolume
    from dvidshards.formats.multilod import decode_legacy_fragment
    from dvidshards.jobs.meshes import meshes
    from dvidshards.serve.meshes import MeshOutput

    out = tmp_path / "m"
    ds = dvidshards.Dataset(exp.root)
    assert meshes(ds, out, scale=0 if legacy else 1, legacy=legacy, scheduler="serial", progress=False).ok
    vol = exp.expected(0)
    with serve(exp.root, meshes=str(out), port=0, threads=2) as srv:
        kv = f"{srv.url}/api/node/{srv.api.uuid}/segmentation_meshes"
        for b in bodies(vol, 3):
            r = requests.get(f"{kv}/key/{b}.ngmesh", timeout=HANG_SECONDS)
            assert r.status_code == 200
            got = decode_legacy_fragment(r.content)
            ref = CloudVolume(f"file://{out}", progress=False).mesh.get(b)
            ref = ref[b] if isinstance(ref, dict) else ref  # (legacy meshes: the mesh itself)
            assert len(got.faces) == len(ref.faces) > 0
            np.testing.assert_allclose(triangles(got.vertices, got.faces), triangles(ref.vertices, ref.faces),
                                       atol=0.05)
        assert requests.get(f"{kv}/key/987654321.ngmesh", timeout=HANG_SECONDS).status_code == 404
    if not legacy:  # the same meshes, one file pair per body (no sharding): as cloud-volume reads them
        flat = tmp_path / "flat"
        flat.mkdir()
        info = json.loads((out / "mesh" / "info").read_text())
        sharded = MeshOutput(str(out))
        for b in bodies(vol, 3):
            (flat / f"{b}.index").write_bytes(sharded._sharded(b)[0])
            (flat / f"{b}").write_bytes(sharded._sharded(b)[1])
        info.pop("sharding")
        (flat / "info").write_text(json.dumps(info))
        (tmp_path / "flatds").mkdir()
        (tmp_path / "flatds" / "info").write_text(json.dumps({**json.loads((out / "info").read_text()),
                                                               "mesh": "../flat"}))
        for b in bodies(vol, 3):
            got = MeshOutput(str(flat)).mesh(b)
            ref = CloudVolume(f"file://{tmp_path / 'flatds'}", progress=False).mesh.get(b)[b]
            np.testing.assert_allclose(triangles(got.vertices, got.faces), triangles(ref.vertices, ref.faces),
                                       atol=0.05)
    with pytest.raises(dvidshards.errors.SpecError, match="not a meshes output"):
        serve(exp.root, meshes=str(tmp_path), port=0)


def test_answers_past_the_spool_size_come_from_a_file_unchanged(exp, servers, monkeypatch):
    """A streamed answer is made whole before its status: in memory, or a temporary file past the
    spool size; the bytes and Content-Length are the same either way."""
    from dvidshards.serve import dvid

    b = bodies(exp.expected(0), 3)[1]
    tails = ("mappings", f"sparsevol/{b}", f"sparsevol/{b}?format=blocks", "blocks/128_128_128/0_0_0")
    want = [get(servers[0], t).content for t in tails]
    monkeypatch.setattr(dvid, "_SPOOL", 100)
    for t, w in zip(tails, want, strict=True):
        r = get(servers[0], t)
        assert len(w) > 100 and r.content == w and r.headers["Content-Length"] == str(len(w)), t


# --------------------------------------------------------------------------- blocks


def test_blocks_in_every_compression(exp, servers):
    srv = servers[0]
    present = {tuple(c) for c in dvidshards.Dataset(exp.root).chunks(0).tolist()}
    ask = [(0, 0, 0), (1, 1, 1), (3, 2, 2), (2, 0, 1), (9, 9, 9)]
    for sv in (False, True):
        vol = exp.expected(0, "supervoxels" if sv else "agglomerated")
        for comp in ("blocks", "gzip", "uncompressed", "lz4"):
            q = {"blocks": ",".join(str(v) for c in ask for v in c), "compression": comp,
                 "supervoxels": str(sv).lower()}
            recs = parse_block_records(get(srv, "specificblocks", params=q).content)
            assert [c for c, _ in recs] == [c for c in ask if c in present]  # absent blocks are left out
            for c, data in recs:
                if comp == "blocks":
                    block = decode_label_block(gzip.decompress(data))
                else:
                    raw = {"gzip": gzip.decompress, "uncompressed": bytes, "lz4": lz4_decode}[comp](data)
                    block = np.frombuffer(raw, "<u8").reshape(64, 64, 64)
                np.testing.assert_array_equal(block, chunk_of(vol, c))
    # /blocks/<size>/<offset>: every present block of the box, z then y then x
    recs = parse_block_records(get(srv, "blocks/128_128_64/64_0_64", params={"compression": "blocks"}).content)
    want = [(x, y, 1) for y in (0, 1) for x in (1, 2) if (x, y, 1) in present]
    assert [c for c, _ in recs] == want
    for c, data in recs:
        np.testing.assert_array_equal(decode_label_block(gzip.decompress(data)), chunk_of(exp.expected(0), c))
    default = parse_block_records(get(srv, "blocks/64_64_64/64_0_64").content)  # DVID's default: lz4
    np.testing.assert_array_equal(np.frombuffer(lz4_decode(default[0][1]), "<u8").reshape(64, 64, 64),
                                  chunk_of(exp.expected(0), (1, 0, 1)))
    r = get(srv, "raw/0_1_2/30_20_10/5_6_7", params={"scale": 1})
    np.testing.assert_array_equal(np.frombuffer(r.content, "<u8").reshape(10, 20, 30),
                                  exp.expected(1)[5:35, 6:26, 7:17].T)


def test_label_index_protobuf_round_trip_and_block_keys():
    from dvidshards.formats import labelindex as L

    blocks = np.array([[1, 2, 3], [1, 2, 3], [-4, 5, 0], [2**20 - 1, -(2**20 - 1), 7]])
    svs, vox = [5, 9, 2**63 + 1, 3], [10, 20, 262144, 1]
    data = L.encode_label_index(77, blocks, svs, vox, last_mod_user="me")
    msg = label_index_message()()
    msg.ParseFromString(data)
    assert msg.label == 77 and msg.last_mod_user == "me"
    assert {block_key(k): dict(v.counts) for k, v in msg.blocks.items()} == {
        (1, 2, 3): {5: 10, 9: 20}, (-4, 5, 0): {2**63 + 1: 262144}, (2**20 - 1, -(2**20 - 1), 7): {3: 1}}
    assert L.decode_label_index(data)["blocks"] == {
        (1, 2, 3): {5: 10, 9: 20}, (-4, 5, 0): {2**63 + 1: 262144}, (2**20 - 1, -(2**20 - 1), 7): {3: 1}}
    assert L.decode_label_index(msg.SerializeToString())["label"] == 77  # the runtime's bytes read back
    with pytest.raises(L.LabelIndexError):
        L.encode_block_index([[2**20, 0, 0]])
    with pytest.raises(L.LabelIndexError):
        L.decode_label_index(data[:-3] + b"\xff")


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("tail,params,status,says", [
    ("label/1_2", {}, 400, "coord"),
    ("label/1_2_3", {"scale": "9"}, 400, "scale=9"),
    ("label/1_2_3", {"scale": "x"}, 400, "scale="),
    ("label/1_2_3", {"supervoxels": "maybe"}, 400, "supervoxels="),
    ("size/abc", {}, 400, "label 'abc'"),
    ("size/0", {}, 400, "label 0"),
    ("sparsevol/5", {"format": "png"}, 400, "format="),
    ("sparsevol/5", {"compression": "zip"}, 400, "compression="),
    ("sparsevol/5", {"minx": "a"}, 400, "minx="),
    ("specificblocks", {"blocks": "1,2"}, 400, "blocks"),
    ("specificblocks", {"blocks": "1,2,3", "compression": "zstd"}, 400, "compression="),
    ("blocks/64_64_64/1_0_0", {}, 400, "block aligned"),
    ("raw/0_1_2/1000_1000_1000/0_0_0", {}, 400, "size"),
    ("index/5", {"mutid": "3"}, 404, "mutid=3"),
    ("size/123456789", {}, 404, "body 123456789 is not in the label index"),
    ("sparsevol/123456789", {}, 404, "123456789"),
    ("supervoxels/123456789", {}, 404, "123456789"),
    ("pseudocolor/0_1/8_8/0_0_0", {}, 400, "pseudocolor"),
    ("frobnicate", {}, 400, "unrecognized"),
    ("merge", {}, 405, "read-only"),
])
def test_bad_requests_are_named(servers, tail, params, status, says):
    r = get(servers[0], tail, params=params)
    assert r.status_code == status and says in r.text and len(r.text.strip().splitlines()) == 1


def test_refusals(exp, servers):
    srv = servers[0]
    for method in ("post", "put", "delete"):
        r = getattr(requests, method)(url(srv, "labels"), timeout=HANG_SECONDS)
        assert r.status_code == 405 and "read-only" in r.text
    assert requests.post(url(srv, "sparsevol/5"), timeout=HANG_SECONDS).status_code == 405
    assert requests.get(f"{srv.url}/api/node/ffff0000/segmentation/info", timeout=HANG_SECONDS).status_code == 400
    assert requests.get(f"{srv.url}/api/node/{srv.api.uuid}/grayscale/info", timeout=HANG_SECONDS).status_code == 404
    sv, body = exp.expected(0, "supervoxels"), exp.expected(0)
    pairs = np.unique(np.stack([sv[body > 0], body[body > 0]], axis=1), axis=0)
    s, b = next((int(p[0]), int(p[1])) for p in pairs if p[0] != p[1] and not (body == p[0]).any())
    assert get(srv, "mapping", json=[s]).json() == [b]  # the supervoxel table is built (at start-up)
    for one in servers:  # a supervoxel asked for as a body: from the index's table, or the records' lists
        r = get(one, f"size/{s}")
        assert r.status_code == 404 and f"{s} is a supervoxel of body {b}" in r.text
    # with --strict a missing shard file is an error that says what the default does (background)
    ds = dvidshards.Dataset(exp.root)
    have = set(ds.shards(0))
    e = ds.scale(0).shard_extent
    hole = next((x, y, z) for x in range(0, 200, e) for y in range(0, 170, e) for z in range(0, 150, e)
                if (x, y, z) not in have)
    r = get(servers[1], f"label/{hole[0]}_{hole[1]}_{hole[2]}")
    assert r.status_code == 500 and "MissingShardError" in r.text and "--strict" in r.text
    assert get(servers[0], f"label/{hole[0]}_{hole[1]}_{hole[2]}").json() == {"Label": 0}


# --------------------------------------------------------------------------- concurrency


@pytest.mark.slow
def test_concurrent_clients_get_the_serial_answers(exp, servers):
    vol = exp.expected(0)
    ids = bodies(vol, 6)
    asks = [f"sparsevol/{b}" for b in ids] + [f"size/{b}" for b in ids] + [f"supervoxels/{b}" for b in ids] + \
        ["specificblocks?blocks=1,1,1,2,1,1&compression=uncompressed", "label/100_100_100", "mappings"]
    want = {a: get(servers[0], a).content for a in asks}
    errors, got = [], []

    def client(k):
        s = requests.Session()
        order = np.random.default_rng(k).permutation(len(asks))
        for i in itertools.chain(order, order):
            a = asks[i]
            r = s.get(url(servers[0], a), timeout=HANG_SECONDS)
            (got if r.content == want[a] else errors).append(a)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(got) == 8 * 2 * len(asks)


# --------------------------------------------------------------------------- command line


def test_command_line_prints_the_bound_address_and_stops_on_ctrl_c(exp, index, capsys):
    p = subprocess.Popen([sys.executable, "-m", "dvidshards.cli", "serve-dvid", exp.root, "--port", "0", "--label-index", index,
                          "--uuid", "abc123", "--instance", "seg"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    lines = Lines(p)
    try:
        line = lines.wait_for(lambda ln: ln.startswith("http"), "the server's address")
        assert line.startswith("http://127.0.0.1:") and line.endswith("/api/node/abc123/seg")
        info = requests.get(line + "/info", timeout=HANG_SECONDS).json()
        assert info["Base"]["Name"] == "seg" and info["dvidshards"]["label_index"] == index
        assert requests.post(line + "/labels", timeout=HANG_SECONDS).status_code == 405
        lines.wait_for(lambda ln: "Ctrl-C to stop" in ln, "its 'Ctrl-C to stop'", stream="err")  # it waits for it
        p.send_signal(signal.SIGINT)
        rc, out, err = lines.finish()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert rc == 0, err
    assert "serving" in err and "Traceback" not in err
    from dvidshards.cli import main  # a bad uuid is refused before a server starts: in this process

    assert main(["serve-dvid", exp.root, "--port", "0", "--uuid", "xyz!"]) == 2
    err = capsys.readouterr().err
    assert "uuid 'xyz!'" in err and len(err.strip().splitlines()) == 1, err


# --------------------------------------------------------------------------- dvid-point-cloud, a client nobody here wrote


def _check_point_cloud_client(srv, vol, svol, scale, body_ids, blocks, origin=(0, 0, 0)):
    """dvid-point-cloud's DVIDClient and sampling functions against brute force of one scale;
    ``vol`` holds the voxels from ``origin`` on (a multiple of 64)."""
    from dvid_point_cloud.parse import parse_rles as their_parse_rles

    o = np.asarray(origin, np.int64)
    client = dpc.DVIDClient(srv.url)
    client.session.params = {"scale": str(scale)}  # its label/labels/size calls have no scale argument
    uuid = srv.api.uuid
    info = client.get_info(uuid, "segmentation")
    assert info["Extended"]["MaxDownresLevel"] >= scale
    rng = np.random.default_rng(1)
    for b in body_ids:
        m = vol == b
        idx = np.argwhere(m)
        pts = idx[rng.choice(len(idx), min(len(idx), 25), replace=False)] + o
        assert client.get_labels(uuid, "segmentation", pts.tolist()) == [b] * len(pts)
        assert client.get_label(uuid, "segmentation", tuple(int(v) for v in pts[0])) == b
        stats = client.get_sparse_vol_stats(uuid, "segmentation", b)
        chunks = np.unique((idx + o) // 64, axis=0)
        assert (stats.num_voxels, stats.num_blocks) == (int(m.sum()), len(chunks))
        assert stats.min_voxel == tuple((chunks.min(axis=0) * 64).tolist())
        assert stats.max_voxel == tuple((chunks.max(axis=0) * 64 + 63).tolist())
        np.testing.assert_array_equal(client.get_supervoxels(uuid, "segmentation", b), np.unique(svol[m]))
        data = client.get_sparse_vol(uuid, "segmentation", b, format="rles", scale=scale)
        starts_zyx, lengths = their_parse_rles(data)
        got = np.zeros_like(m)
        for (z, y, x), n in zip((starts_zyx - o[::-1]).tolist(), lengths.tolist(), strict=True):
            assert not got[x:x + n, y, z].any()
            got[x:x + n, y, z] = True
        np.testing.assert_array_equal(got, m)
        label, _, bl = parse_binary_blocks(client.get_sparse_vol(uuid, "segmentation", b, format="blocks",
                                                                 scale=scale))
        assert label == b and set(bl) == {tuple(int(v) * 64 for v in c) for c in chunks}
        for off, mm in bl.items():
            np.testing.assert_array_equal(mm, chunk_of(vol, [v // 64 for v in off], o) == b)
        pc = dpc.uniform_sample(srv.url, uuid, b, 300, scale=scale)
        assert len(pc) == 300 and m[tuple((pc // 2**scale - o).T)].all()  # their points are in scale-0 voxels
    out = dpc.sample_for_bodies(srv.url, uuid, "segmentation", body_ids, 0.05, scale=scale)
    assert set(out) == set(body_ids)
    for b, pc in out.items():
        assert (vol[tuple((pc // 2**scale - o).T)] == b).all()
    text = ",".join(str(v) for c in blocks for v in c)
    recs = parse_block_records(client.get_label_blocks(uuid, "segmentation", text, scale=scale))
    assert [c for c, _ in recs] == [tuple(c) for c in blocks]
    for c, data in recs:
        np.testing.assert_array_equal(decode_label_block(gzip.decompress(data)), chunk_of(vol, c, o))
    recs = parse_block_records(client.get_label_blocks(uuid, "segmentation", text, scale=scale, supervoxels=True))
    for c, data in recs:
        np.testing.assert_array_equal(decode_label_block(gzip.decompress(data)), chunk_of(svol, c, o))


def test_dvid_point_cloud_on_a_synthetic_export(exp, servers):
    for scale in (0, 1):
        vol, svol = exp.expected(scale), exp.expected(scale, "supervoxels")
        present = dvidshards.Dataset(exp.root).chunks(scale)
        _check_point_cloud_client(servers[0], vol, svol, scale, bodies(vol, 3), present[:4].tolist())
    vol = exp.expected(0)
    b = bodies(vol, 2)[1]
    n = int((vol == b).sum())
    for density, scale in ((200 / n, 0), (400 / n, 1)):  # their rule: scale floor(log2(voxels * density / count))
        pc = dpc.uniform_auto_scale(servers[1].url, servers[1].api.uuid, b, 200, density=density)
        assert len(pc) == 200 and (exp.expected(scale)[tuple((pc // 2**scale).T)] == b).all()


@pytest.fixture(scope="module")
def real(dvid_data, tmp_path_factory):
    """A temporary export holding the real mCNS shard under s1 with its CSV, served with the real spec."""
    root = tmp_path_factory.mktemp("servedvid_real")
    (root / "s1").mkdir()
    (root / "s1" / f"{REAL_SHARD}.arrow").symlink_to(dvid_data / f"{REAL_SHARD}.arrow")
    (root / "s1" / f"{REAL_SHARD}.csv").symlink_to(dvid_data / f"{REAL_SHARD}-newformat.csv")
    spec = str(dvid_data / "mcns-ng-specs.json")
    srv = serve(str(root), spec=spec, port=0, threads=2)
    yield srv, dvidshards.Dataset(str(root), spec=spec)
    srv.shutdown()


@pytest.mark.slow
def test_dvid_point_cloud_on_the_real_mcns_shard(real, real_records):
    """The real shard, read back through the client, equals TensorStore's read of the export.

    The bodies are those whose chunks (by the records' lists, read with pyarrow) all lie in the
    box of body 1538452683's chunks, so a read of that box is each body's whole volume.
    """
    srv, ds = real
    assert srv.api.held == [1]
    chunks_of: dict = {}
    for r in real_records:
        for b in set(r["labels"]) - {0}:
            chunks_of.setdefault(b, set()).add((r["chunk_x"], r["chunk_y"], r["chunk_z"]))
    c = np.array(sorted(chunks_of[1538452683]))
    clo, chi = c.min(axis=0), c.max(axis=0) + 1
    inside = sorted((len(v), b) for b, v in chunks_of.items()
                    if all((np.array(list(v)) >= clo).all(axis=1) & (np.array(list(v)) < chi).all(axis=1)))
    ids = [b for _, b in inside[-3:]]
    assert 1538452683 in ids and len(ids) == 3
    lo, hi = clo * 64, chi * 64
    vol = ds.open(1)[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]].read(order="F").result()
    svol = ds.open(1, labels="supervoxels")[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]].read(order="F").result()
    _check_point_cloud_client(srv, vol, svol, 1, ids, c[::4].tolist(), lo)
    r = requests.get(url(srv, "label/0_0_0"), timeout=HANG_SECONDS)  # scale 0 is not in this export
    assert r.status_code == 400 and "scale=0: this export holds scales [1]" in r.text
