"""serve-dvid's voxels as DVID answers them, against brute force: every scale of the spec (those
the export lacks made by DVID's rule), neuroglancer's compressed_segmentation, lz4, png, zero-fill
outside the volume, absent blocks skipped, background for shard files DVID never wrote, several
exports in one server, and the repository answers neuroglancer's dvid source reads."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import struct

import numpy as np
import pytest

from tests.support.downsample import by_count
from tests.support.exports import make_export

requests = pytest.importorskip("requests")
pytest.importorskip("aiohttp")
lz4_block = pytest.importorskip("lz4.block")

from dvidshards.serve.dvid import serve  # noqa: E402 - after the optional imports are checked

SHAPE = (200, 170, 150)


@pytest.fixture(scope="module")
def exp(tmp_path_factory):
    """An export holding scale 0 only, its spec (info) listing three scales."""
    e = make_export(tmp_path_factory.mktemp("dvidvol") / "exp", SHAPE, seed=5, scales=3)
    with open(os.path.join(e.root, "info"), "w") as f:
        json.dump(e.spec, f)
    for k in (1, 2):
        shutil.rmtree(os.path.join(e.root, f"s{k}"))
    return e


@pytest.fixture(scope="module")
def srv(exp):
    s = serve(exp.root, port=0, threads=2)
    yield s
    s.shutdown()


_MADE: dict = {}


def scales(exp, labels="agglomerated") -> list[np.ndarray]:
    """Scales 0-2 (z, y, x) by DVID's rule (tests/support/downsample) on the supervoxels (padded
    with 0: voxels DVID's blocks hold beyond the volume); bodies are the export's mapping of the
    made supervoxels."""
    key = (exp.root, labels)
    if key not in _MADE:
        pad = np.zeros([-(-s // 4) * 4 for s in SHAPE], np.uint64)
        pad[:SHAPE[0], :SHAPE[1], :SHAPE[2]] = exp.sv
        out = [pad.T]
        for _ in range(2):
            out.append(by_count(out[-1]))
        if labels == "agglomerated":
            m = np.asarray(exp.mapping, np.uint64).reshape(-1, 2)
            lut = dict(zip(m[:, 0].tolist(), m[:, 1].tolist(), strict=True))
            res = []
            for v in out:
                u, inv = np.unique(v, return_inverse=True)
                res.append(np.asarray([lut.get(int(x), int(x)) for x in u], np.uint64)[inv].reshape(v.shape))
            out = res
        _MADE[key] = out
    return _MADE[key]


def url(srv, tail: str, uuid=None, instance="segmentation") -> str:
    return f"{srv.url}/api/node/{uuid or srv.api.uuid}/{instance}/{tail}"


def box_of(vol_zyx, off, size) -> np.ndarray:
    """The (z, y, x) box of a scale at offset/size (x, y, z voxels), 0 outside the volume."""
    lo, n = np.asarray(off[::-1]), np.asarray(size[::-1])
    out = np.zeros(tuple(n), np.uint64)
    a, b = np.maximum(lo, 0), np.minimum(lo + n, vol_zyx.shape)
    if (b > a).all():
        out[tuple(slice(i - j, k - j) for i, j, k in zip(a, lo, b, strict=True))] = \
            vol_zyx[tuple(slice(i, k) for i, k in zip(a, b, strict=True))]
    return out


def decode_cseg(data: bytes, shape_zyx) -> np.ndarray:
    """neuroglancer's compressed_segmentation (one channel, uint64, 8³ blocks), from its spec."""
    w = np.frombuffer(data, "<u4")
    base = int(w[0])
    gz, gy, gx = (s // 8 for s in shape_zyx)
    out = np.zeros(shape_zyx, np.uint64)
    for b in range(gz * gy * gx):
        bz, by, bx = b // (gy * gx), (b // gx) % gy, b % gx
        h0, h1 = int(w[base + 2 * b]), int(w[base + 2 * b + 1])
        table, bits, values = h0 & 0xFFFFFF, h0 >> 24, h1
        if bits == 0:
            idx = np.zeros(512, np.int64)
        else:
            packed = w[base + values: base + values + (512 * bits + 31) // 32]
            allbits = np.unpackbits(packed.view(np.uint8), bitorder="little")
            idx = (allbits[:512 * bits].reshape(512, bits) * (1 << np.arange(bits))).sum(axis=1)
        lut = np.frombuffer(data, "<u8", int(idx.max()) + 1, 4 * (base + table))
        out[bz * 8:bz * 8 + 8, by * 8:by * 8 + 8, bx * 8:bx * 8 + 8] = lut[idx].reshape(8, 8, 8)
    return out


def test_every_scale_of_the_spec_answers_by_dvids_rule(exp, srv):
    info = requests.get(url(srv, "info"), timeout=30).json()
    assert info["Extended"]["MaxDownresLevel"] == 2  # s0 held, s1-s2 made: neuroglancer needs >= 1
    for labels in ("agglomerated", "supervoxels"):
        ref = scales(exp, labels)
        q = {"supervoxels": "true"} if labels == "supervoxels" else {}
        for k in (0, 1, 2):
            for off, size in (([0, 64, 64], [64, 64, 64]), ([5, 6, 7], [30, 20, 10]), ([-10, 40, 60], [64, 16, 8]),
                              ([180 >> k, 150 >> k, 130 >> k], [40, 48, 64])):
                r = requests.get(url(srv, f"raw/0_1_2/{'_'.join(map(str, size))}/{'_'.join(map(str, off))}"),
                                 params={**q, "scale": k}, timeout=60)
                got = np.frombuffer(r.content, "<u8").reshape(size[::-1])
                np.testing.assert_array_equal(got, box_of(ref[k], off, size))  # 0 outside, below 0 too
                if all(v % 8 == 0 for v in size):
                    g = requests.get(url(srv, f"raw/0_1_2/{'_'.join(map(str, size))}/{'_'.join(map(str, off))}"),
                                     params={**q, "scale": k, "compression": "googlegzip"}, timeout=60)
                    assert g.headers["Content-Encoding"] == "gzip"  # requests undid it
                    np.testing.assert_array_equal(decode_cseg(g.content, size[::-1]), box_of(ref[k], off, size))
            pts = np.random.default_rng(k).integers(0, ref[k].shape[::-1], (50, 3))
            got = requests.get(url(srv, "labels"), params={**q, "scale": k}, json=pts.tolist(), timeout=60).json()
            assert got == [int(ref[k][z, y, x]) for x, y, z in pts]


def test_a_made_chunk_needing_too_many_chunks_is_refused_naming_downsample(exp, monkeypatch):
    """A chunk of a scale the export lacks is made from the held chunks under it (none: background,
    nothing made); one needing more than ``MADE_LIMIT`` of them is a 400 that says to run
    ``dvidshards downsample``, and the server goes on answering."""
    from dvidshards.serve import dvid_volume

    monkeypatch.setattr(dvid_volume, "MADE_LIMIT", 7)
    ref = scales(exp)
    with serve(exp.root, port=0, threads=1) as s:
        r = requests.get(url(s, "raw/0_1_2/64_64_64/0_0_0"), params={"scale": 2}, timeout=60)  # 27 chunks of s0
        assert r.status_code == 400 and "dvidshards downsample" in r.text and "scale 2" in r.text
        r = requests.get(url(s, "raw/0_1_2/64_64_64/64_64_64"), params={"scale": 1}, timeout=60)  # 1 of s0
        got = np.frombuffer(r.content, "<u8").reshape(64, 64, 64)
        np.testing.assert_array_equal(got, box_of(ref[1], [64, 64, 64], [64, 64, 64]))
        r = requests.get(url(s, "raw/0_1_2/64_64_64/0_0_0"), params={"scale": 1}, timeout=60)  # 8 chunks of s0
        assert r.status_code == 400


def test_raw_compressions_and_label_images(exp, srv):
    ref = scales(exp)[1]
    want = box_of(ref, [3, 4, 5], [40, 30, 20])
    base = url(srv, "raw/0_1_2/40_30_20/3_4_5")
    lz = requests.get(base, params={"scale": 1, "compression": "lz4"}, timeout=30).content
    np.testing.assert_array_equal(np.frombuffer(lz4_block.decompress(lz, uncompressed_size=want.size * 8), "<u8"),
                                  want.ravel())
    gz = requests.get(base, params={"scale": 1, "compression": "gzip"}, stream=True, timeout=30).raw.read()
    np.testing.assert_array_equal(np.frombuffer(gzip.decompress(gz), "<u8"), want.ravel())
    png = pytest.importorskip("png")  # pypng: reads 16-bit RGBA as it is
    for tail, sl in (("raw/xy/40_30/3_4_5", ref[5, 4:34, 3:43]), ("isotropic/xz/40_20/3_4_5", ref[5:25, 4, 3:43])):
        r = requests.get(url(srv, tail), params={"scale": 1}, timeout=30)
        assert r.headers["Content-Type"] == "image/png"
        w, h, rows, meta = png.Reader(bytes=r.content).read()
        assert (h, w, meta["bitdepth"], meta["alpha"]) == (*sl.shape, 16, True)
        px = np.array([list(row) for row in rows], np.uint16).reshape(h, w, 4)  # the label's bytes two at a time
        b = px.astype(">u2").view(np.uint8).reshape(*sl.shape, 8)
        np.testing.assert_array_equal(b.copy().view("<u8")[..., 0], sl)


def test_block_streams_skip_what_dvid_has_not(exp, srv):
    ref = scales(exp)
    ask = [(0, 0, 0), (1, 1, 1), (9, 9, 9), (-1, 0, 0), (3, 2, 2), (1, 0, 1)]
    for k in (0, 1):
        grid = [-(-s // (64 << k)) for s in SHAPE]
        present = [c for c in ask if all(0 <= v < g for v, g in zip(c, grid, strict=True))
                   and box_of(ref[k], [64 * v for v in c], [64] * 3).any()]
        r = requests.get(url(srv, "specificblocks"), params={"blocks": ",".join(str(v) for c in ask for v in c),
                                                             "compression": "uncompressed", "scale": k}, timeout=60)
        assert r.status_code == 200
        p, got = 0, []
        while p < len(r.content):
            x, y, z, n = struct.unpack_from("<4i", r.content, p)
            got.append((x, y, z))
            np.testing.assert_array_equal(np.frombuffer(r.content, "<u8", n // 8, p + 16).reshape(64, 64, 64),
                                          box_of(ref[k], [64 * x, 64 * y, 64 * z], [64] * 3))
            p += 16 + n
        assert got == present  # blocks outside the volume or never written are left out


def test_shard_files_dvid_never_wrote_are_background(exp, tmp_path):
    root = tmp_path / "holes"
    shutil.copytree(exp.root, root)
    arrows = sorted((root / "s0").glob("*.arrow"))
    gone = arrows[len(arrows) // 2]
    gone.unlink()
    gone.with_suffix(".csv").unlink()
    x, y, z = (int(v) for v in gone.stem.split("_"))
    with serve(str(root), port=0, threads=1) as s, serve(str(root), port=0, threads=1, strict=True) as strict:
        r = requests.get(url(s, f"label/{x}_{y}_{z}"), timeout=30)
        assert r.json() == {"Label": 0}
        raw = requests.get(url(s, f"raw/0_1_2/8_8_8/{x}_{y}_{z}"), timeout=30).content
        assert raw == bytes(8 * 512)
        r = requests.get(url(strict, f"label/{x}_{y}_{z}"), timeout=30)
        assert r.status_code == 500 and gone.name in r.text and "--strict" in r.text


@pytest.mark.parametrize("tail,params,status,says", [
    ("label/1_2_99999999999999999999", {}, 400, "99999999999999999999"),
    ("raw/0_1_2/8_8_8/0_0_4294967296", {}, 400, "4294967296"),
    ("raw/0_1_2/2097152_2097152_4194304/0_0_0", {}, 400, "voxels"),  # 2^64 voxels: numpy's product is 0
    ("specificblocks", {"blocks": "1,2,99999999999"}, 400, "blocks"),
    ("raw/0_1_2/8_8_8/0_0_0", {"scale": "3"}, 400, "scale=3"),
    ("raw/0_1_2/10_8_8/0_0_0", {"compression": "googlegzip"}, 400, "multiples of 8"),
    ("indices-compressed", {}, 400, "/indices"),
])
def test_what_cannot_be_answered_is_one_line(srv, tail, params, status, says):
    r = requests.get(url(srv, tail), params={**params, "u": "me", "app": "test"}, timeout=30)
    assert r.status_code == status and says in r.text and len(r.text.strip().splitlines()) == 1


def test_repos_as_neuroglancer_reads_them(exp, srv):
    r = requests.get(f"{srv.url}/api/repos/info", timeout=30)
    assert r.headers["Access-Control-Allow-Origin"] == "*"
    repo = r.json()[srv.api.uuid]
    assert isinstance(repo["Alias"], str) and isinstance(repo["Description"], str)
    assert srv.api.uuid in repo["DAG"]["Nodes"]
    inst = repo["DataInstances"]
    seg = inst["segmentation"]
    assert seg["Base"]["TypeName"] == "labelmap" and seg["Extended"]["Values"][0]["DataType"] == "uint64"
    assert seg["Extended"]["MaxDownresLevel"] >= 1 and seg["Extended"]["BlockSize"] == [64, 64, 64]
    assert inst["segmentation_meshes"]["Base"]["TypeName"] == "keyvalue"
    assert requests.get(f"{srv.url}/api/repo/{srv.api.uuid[:5]}/branch-versions/master", timeout=30).json() == [
        srv.api.uuid]
    assert requests.get(f"{srv.url}/api/server/info", timeout=30).json()["DVID Version"].startswith("v")


def test_several_exports_as_nodes_or_instances(exp, tmp_path):
    other = make_export(tmp_path / "other", (100, 90, 80), seed=9, scales=1)
    with serve([exp.root, other.root], port=0, threads=1) as s:
        nodes = requests.get(f"{s.url}/api/repos/info", timeout=30).json()
        assert len(nodes) == 2
        for n, vol in zip(s.nodes, (exp.expected(0), other.expected(0)), strict=True):
            r = requests.get(url(s, "raw/0_1_2/16_16_16/40_40_40", uuid=n.uuid), timeout=30)
            np.testing.assert_array_equal(np.frombuffer(r.content, "<u8").reshape(16, 16, 16),
                                          vol[40:56, 40:56, 40:56].T)
    with serve({"big": exp.root, "small": other.root}, port=0, threads=1) as s:
        (node,) = s.nodes
        assert {"big", "small", "big_meshes", "small_meshes"} <= set(node.instances)
        for name, vol in (("big", exp.expected(0)), ("small", other.expected(0))):
            p = np.argwhere(vol > 0)[100]
            r = requests.get(url(s, f"label/{p[0]}_{p[1]}_{p[2]}", uuid=node.uuid, instance=name), timeout=30)
            assert r.json() == {"Label": int(vol[tuple(p)])}


def test_missing_shards_options_name_the_default_and_strict(capsys):
    """--fill-missing-shards names the default (the option every reader of the package knows);
    --strict the other choice; both at once is a usage error."""
    from dvidshards.cli import build_parser, main

    p = build_parser("serve-dvid")
    assert p.parse_args(["serve-dvid", "e"]).strict is False
    assert p.parse_args(["serve-dvid", "e", "--fill-missing-shards"]).strict is False
    assert p.parse_args(["serve-dvid", "e", "--strict"]).strict is True
    assert main(["serve-dvid", "e", "--strict", "--fill-missing-shards"]) == 2
    assert "not allowed with" in capsys.readouterr().err
