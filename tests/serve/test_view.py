"""``dvidshards view``: the precomputed server read over HTTP, without a browser.

The reference readers are TensorStore's own ``neuroglancer_precomputed`` driver over its
``http`` kvstore, and the numpy volumes the export was written from.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
import tensorstore as ts

from dvidshards.dataset import Dataset
from dvidshards.errors import SpecError
from dvidshards.serve.view import ViewServer, serve
from tests.support.exports import make_export
from tests.support.waiting import HANG_SECONDS, Lines
from tests.support.watertight import enclosed_volume, is_watertight

SHAPE = (200, 170, 150)  # not a multiple of 64: every scale has clipped edge chunks


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    return make_export(tmp_path_factory.mktemp("view") / "exp", SHAPE, seed=11)


@pytest.fixture(scope="module")
def server(export):
    with serve(Dataset(export.root, spec=export.spec), threads=2) as srv:
        yield srv


def get(url: str, headers=None, method="GET"):
    """(status, headers, body) of a request; HTTP errors are answers too."""
    req = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=HANG_SECONDS) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def open_scale(url: str, k: int, concurrency: int | None = None):
    context = {"cache_pool": {"total_bytes_limit": 0}}
    if concurrency is not None:
        context["http_request_concurrency"] = {"limit": concurrency}
    spec = {"driver": "neuroglancer_precomputed", "kvstore": url.rstrip("/") + "/", "scale_index": k,
            "context": context}
    return ts.open(spec, read=True).result()


def chunk_boxes(scale_json: dict):
    """Every chunk box [(x0, y0, z0), (x1, y1, z1)] of a served scale, clipped at the volume edge."""
    off, size = np.array(scale_json["voxel_offset"]), np.array(scale_json["size"])
    cs = np.array(scale_json["chunk_sizes"][0])
    grid = -(-size // cs)
    for c in np.ndindex(*grid):
        lo = off + np.array(c) * cs
        yield lo, np.minimum(lo + cs, off + size)


def chunk_url(base: str, key: str, lo, hi) -> str:
    return f"{base}/{key}/{lo[0]}-{hi[0]}_{lo[1]}-{hi[1]}_{lo[2]}-{hi[2]}"


def decode_chunk(data: bytes, key: str, lo, hi, scale_json: dict) -> np.ndarray:
    """Decode served chunk bytes with TensorStore's precomputed driver (from a memory kvstore)."""
    meta = {"key": key, "size": scale_json["size"], "resolution": scale_json["resolution"],
            "voxel_offset": scale_json["voxel_offset"], "chunk_size": scale_json["chunk_sizes"][0],
            "encoding": "compressed_segmentation", "compressed_segmentation_block_size": [8, 8, 8]}
    t = ts.open({"driver": "neuroglancer_precomputed", "kvstore": {"driver": "memory"},
                 "multiscale_metadata": {"type": "segmentation", "data_type": "uint64", "num_channels": 1},
                 "scale_metadata": meta, "create": True}, context=ts.Context()).result()
    name = f"{key}/{lo[0]}-{hi[0]}_{lo[1]}-{hi[1]}_{lo[2]}-{hi[2]}"
    t.kvstore.write(name, data).result()
    return t[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2], 0].read().result()


def test_info_is_the_datasets_info_unsharded(export, server):
    ds = Dataset(export.root, spec=export.spec)
    status, headers, body = get(server.http_url() + "/info")
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "*"
    info = json.loads(body)
    want = ds.info
    assert info.pop("mesh") == "mesh"  # its mesh source
    assert info.pop("skeletons", "skeletons") == "skeletons"  # its skeleton source (where kimimaro is installed)
    assert {k: v for k, v in info.items() if k != "scales"} == {k: v for k, v in want.items() if k != "scales"}
    assert len(info["scales"]) == len(want["scales"]) == 3
    for got, ref in zip(info["scales"], want["scales"], strict=True):
        assert "sharding" in ref and "sharding" not in got  # served one key per chunk
        assert got == {k: v for k, v in ref.items() if k != "sharding"}
        assert got["chunk_sizes"] == [[64, 64, 64]] and got["encoding"] == "compressed_segmentation"


def test_tensorstore_reads_every_scale_equal_to_the_volume(export, server):
    for k in range(3):
        t = open_scale(server.http_url(), k)
        want = export.expected(k)
        assert tuple(t.shape) == want.shape + (1,)
        np.testing.assert_array_equal(t[..., 0].read().result(), want)
    st = server.stats()["agglomerated"]
    # no chunk failed; a 503 "busy" (all slots taken while a first request compiles numba's
    # kernels on a loaded machine) is retried by TensorStore, so the data above is exact either way
    assert st["failed"]["count"] == 0
    assert st["absent"]["count"] > 0  # the export has background chunks: served as 404, read as 0


@pytest.mark.parametrize("labels", ["supervoxels", "mapping"])
def test_other_label_choices(export, labels):
    ds = Dataset(export.root, spec=export.spec)
    if labels == "mapping":  # a newer mapping: merge two bodies
        sv = np.unique(export.sv[export.sv != 0])
        lab = {int(sv[0]): 5, int(sv[1]): 5, int(sv[2]): 6}
    else:
        lab = labels
    with serve(ds, lab) as srv:
        name = "supervoxels" if labels == "supervoxels" else "mapped"
        assert srv.source().endswith(f"/{name}")
        for k in (0, 2):
            got = open_scale(srv.http_url(), k)[..., 0].read().result()
            np.testing.assert_array_equal(got, export.expected(k, lab))


def test_edge_chunks_are_clipped_and_whole_boxes_refused(export, server):
    info = json.loads(get(server.http_url() + "/info")[2])
    base = server.http_url()
    for k in (0, 1):
        s = info["scales"][k]
        size = np.array(s["size"])
        want = export.expected(k)
        edges = [(lo, hi) for lo, hi in chunk_boxes(s) if np.any(hi - lo < 64) and want[
            lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]].any()]
        assert edges
        for lo, hi in edges[:4]:
            status, headers, body = get(chunk_url(base, s["key"], lo, hi))
            assert status == 200, body
            assert headers["Access-Control-Allow-Origin"] == "*"
            got = decode_chunk(body, s["key"], lo, hi, s)
            np.testing.assert_array_equal(got, want[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]])
            # the unclipped box of the same chunk is not a chunk of the volume
            full = lo + 64
            assert np.any(full > size)
            assert get(chunk_url(base, s["key"], lo, full))[0] == 404
    # misaligned, out of range, unknown key, unknown volume
    s = info["scales"][0]
    for url in (chunk_url(base, s["key"], [1, 0, 0], [65, 64, 64]),
                chunk_url(base, s["key"], [256, 0, 0], [320, 64, 64]),
                chunk_url(base, "nokey", [0, 0, 0], [64, 64, 64]),
                server.url + "/novolume/info", base + "/info/extra"):
        assert get(url)[0] == 404, url


def test_absent_chunks_are_404_and_read_as_zero(export, server):
    info = json.loads(get(server.http_url() + "/info")[2])
    s = info["scales"][0]
    want = export.expected(0)
    absent = [(lo, hi) for lo, hi in chunk_boxes(s) if not want[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]].any()]
    assert absent, "the synthetic export should have background chunks"
    t = open_scale(server.http_url(), 0)
    for lo, hi in absent:
        status, headers, _ = get(chunk_url(server.http_url(), s["key"], lo, hi))
        assert status == 404 and headers["Access-Control-Allow-Origin"] == "*"
        assert not t[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]].read().result().any()


def test_cors_preflight_head_and_gzip(export):
    ds = Dataset(export.root, spec=export.spec)
    with serve(ds, gzip=True) as srv:
        s = json.loads(get(srv.http_url() + "/info")[2])["scales"][0]
        status, headers, _ = get(srv.http_url() + "/info", method="OPTIONS",
                                 headers={"Origin": "http://elsewhere", "Access-Control-Request-Method": "GET"})
        assert status == 204 and headers["Access-Control-Allow-Origin"] == "*"
        assert "GET" in headers["Access-Control-Allow-Methods"]
        url = chunk_url(srv.http_url(), s["key"], [64, 64, 64], [128, 128, 128])
        plain = get(url)
        assert plain[0] == 200 and "Content-Encoding" not in plain[1]
        zipped = get(url, headers={"Accept-Encoding": "gzip"})
        assert zipped[1]["Content-Encoding"] == "gzip" and gzip.decompress(zipped[2]) == plain[2]
        head = get(url, method="HEAD")
        assert head[0] == 200 and head[2] == b"" and int(head[1]["Content-Length"]) == len(plain[2])
        # TensorStore's http kvstore reads the gzip answers too
        np.testing.assert_array_equal(open_scale(srv.http_url(), 0)[..., 0].read().result(), export.expected(0))


def _shard_of(lo, scale) -> tuple[int, ...]:
    e = min(scale.shard_extent, 1 << 40)
    return tuple(int(v) // e * e for v in lo)


def test_corrupt_shard_fails_its_chunks_only(export, tmp_path, caplog):
    root = tmp_path / "exp"
    shutil.copytree(export.root, root)
    ds = Dataset(str(root), spec=export.spec)
    scale = ds.scale(0)
    origins = sorted(ds.shards(0))
    bad = origins[len(origins) // 2]
    path = root / scale.folder / f"{bad[0]}_{bad[1]}_{bad[2]}.arrow"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # truncated: the shard cannot be loaded
    want = export.expected(0)
    caplog.set_level(logging.ERROR, logger="dvidshards.serve.view")
    with serve(ds, threads=2) as srv:
        s = json.loads(get(srv.http_url() + "/info")[2])["scales"][0]
        n_bad = n_ok = 0
        for lo, hi in chunk_boxes(s):
            status, headers, body = get(chunk_url(srv.http_url(), s["key"], lo, hi))
            assert headers["Access-Control-Allow-Origin"] == "*"
            if _shard_of(lo, scale) == bad:
                assert status == 500, (lo, status)
                assert body.startswith(b"ShardFormatError") or body.startswith(b"ChunkIndexError"), body
                n_bad += 1
            else:
                exp = want[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]]
                if exp.any():
                    assert status == 200
                    np.testing.assert_array_equal(decode_chunk(body, s["key"], lo, hi, s), exp)
                    n_ok += 1
                else:
                    assert status == 404
        assert n_bad > 0 and n_ok > 0
        # the server is still up and answers again, also for the bad shard
        assert get(srv.http_url() + "/info")[0] == 200
        lo = np.array(bad)
        assert get(chunk_url(srv.http_url(), s["key"], lo, np.minimum(lo + 64, s["size"])))[0] == 500
        assert srv.stats()["agglomerated"]["failed"]["count"] == n_bad + 1
    logged = [r.getMessage() for r in caplog.records if r.name == "dvidshards.serve.view"]
    assert logged and all(str(path.name) in m for m in logged), logged[:2]
    assert all(("ShardFormatError" in m or "ChunkIndexError" in m) for m in logged)


def test_bounded_concurrency_answers_busy_not_hang(export, monkeypatch):
    """With every worker slot held, a further chunk request gets 503 after the admit timeout."""
    ds = Dataset(export.root, spec=export.spec)
    srv = ViewServer(threads=1, admit_timeout=0.5)
    try:
        srv.add(ds)
        vol = srv.volume()
        release, entered = threading.Event(), threading.Event()
        orig = vol.chunk

        def slow(k, box):
            entered.set()
            assert release.wait(HANG_SECONDS)
            return orig(k, box)

        monkeypatch.setattr(vol, "chunk", slow)
        s = vol.info["scales"][0]
        url = chunk_url(srv.http_url(), s["key"], [64, 64, 64], [128, 128, 128])
        first = []
        th = threading.Thread(target=lambda: first.append(get(url)))
        th.start()
        assert entered.wait(HANG_SECONDS)
        status, headers, _ = get(url)
        assert status == 503 and headers["Retry-After"] == "1"
        release.set()
        th.join(HANG_SECONDS)
        assert first[0][0] == 200
        assert vol.stats.busy == 1
    finally:
        srv.close()


def test_several_volumes_on_one_server(export):
    ds = Dataset(export.root, spec=export.spec)
    with ViewServer() as srv:
        a = srv.add(ds, "agglomerated")
        b = srv.add(ds, "supervoxels")
        assert a.startswith("precomputed://http://127.0.0.1:") and a != b
        with pytest.raises(SpecError, match="name one"):
            srv.source()
        got = open_scale(b[len("precomputed://"):], 2)[..., 0].read().result()
        np.testing.assert_array_equal(got, export.expected(2, "supervoxels"))


def test_viewer_state(export):
    ng = pytest.importorskip("neuroglancer")
    from dvidshards.serve.view import viewer

    img = "precomputed://http://127.0.0.1:1/em"
    v = viewer(Dataset(export.root, spec=export.spec), select=[7, 9], position=(10, 20, 30), image=img)
    try:
        st = v.state
        assert [lay.name for lay in st.layers] == ["image", "segmentation"]  # segmentation drawn on top
        assert isinstance(st.layers["image"].layer, ng.ImageLayer) and st.layers["image"].source[0].url == img
        layer = st.layers["segmentation"]
        assert isinstance(layer.layer, ng.SegmentationLayer)
        assert layer.source[0].url == v.dvidshards_server.source()
        assert sorted(int(i) for i in layer.segments) == [7, 9]
        assert list(st.position) == [10, 20, 30]
        assert list(st.dimensions.scales) == pytest.approx([8e-9] * 3)
        assert v.get_viewer_url().startswith("http://127.0.0.1:")
    finally:
        v.dvidshards_server.close()


def test_cli_prints_the_source_and_serves_until_interrupted(export):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "dvidshards.cli", "view", export.root, "--no-viewer", "--port", "0"]
    spec = os.path.join(os.path.dirname(export.root), "spec.json")
    with open(spec, "w") as f:
        json.dump(export.spec, f)
    p = subprocess.Popen(cmd + ["--spec", spec], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines = Lines(p)
    try:
        line = lines.wait_for(lambda ln: ln.startswith("precomputed://"), "the source it serves")
        assert line.startswith("precomputed://http://127.0.0.1:") and line.endswith("/agglomerated"), line
        t = open_scale(line[len("precomputed://"):], 1)
        np.testing.assert_array_equal(t[..., 0].read().result(), export.expected(1))
        lines.wait_for(lambda ln: "Ctrl-C to stop" in ln, "its 'Ctrl-C to stop'")  # it waits for Ctrl-C now
        p.send_signal(signal.SIGINT)
        rc, out, err = lines.finish()
        assert rc == 0 and "Traceback" not in err, err
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_cli_bad_source_is_a_user_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "dvidshards.cli", "view", str(tmp_path / "nothing"), "--no-viewer"],
                       capture_output=True, text=True, timeout=HANG_SECONDS)
    assert r.returncode == 2 and "SpecError" in r.stderr and "nothing" in r.stderr


def tensorstore_chunks(vol: np.ndarray, scale_json: dict) -> dict:
    """{chunk key: bytes} TensorStore's precomputed writer makes of a volume (x, y, z)."""
    t = ts.open({"driver": "neuroglancer_precomputed", "kvstore": {"driver": "memory"},
                 "multiscale_metadata": {"type": "segmentation", "data_type": "uint64", "num_channels": 1},
                 "scale_metadata": {"key": scale_json["key"], "size": scale_json["size"],
                                    "resolution": scale_json["resolution"], "voxel_offset": scale_json["voxel_offset"],
                                    "chunk_size": scale_json["chunk_sizes"][0], "encoding": "compressed_segmentation",
                                    "compressed_segmentation_block_size": [8, 8, 8]},
                 "create": True}, context=ts.Context()).result()
    t[..., 0].write(vol).result()
    return {k.decode(): t.kvstore.read(k).result().value for k in t.kvstore.list().result()}


def test_chunks_equal_tensorstores_encoding(export, server):
    """Whole chunks come straight from the records, bytes equal to TensorStore's encoder's; decoded
    and re-encoded (``transcode=False``, and every chunk cut by the volume's edge) they read back
    as the same voxels."""
    ds = Dataset(export.root, spec=export.spec)
    with serve(ds, transcode=False) as slow:
        for k in (0, 1):
            s = server.volume().info["scales"][k]
            vol = export.expected(k)
            want = tensorstore_chunks(vol, s)
            n = 0
            for lo, hi in chunk_boxes(s):
                key = f"{s['key']}/{lo[0]}-{hi[0]}_{lo[1]}-{hi[1]}_{lo[2]}-{hi[2]}"
                a, b = get(chunk_url(server.http_url(), s["key"], lo, hi)), get(chunk_url(slow.http_url(), s["key"], lo, hi))
                assert a[0] == b[0] == (200 if key in want else 404), (k, lo)
                if a[0] != 200:
                    continue
                vox = vol[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]]
                for got in (a[2], b[2]):
                    np.testing.assert_array_equal(decode_chunk(got, s["key"], lo, hi, s), vox)
                if not np.any(hi - lo < 64):
                    assert a[2] == want[key], (k, lo)
                    n += 1
            assert n > 0
        st, st_slow = server.stats()["agglomerated"], slow.stats()["agglomerated"]
        assert st["transcoded"]["count"] > 0 and st_slow["transcoded"]["count"] == 0
        assert st_slow["encoded"]["count"] > 0


def test_corrupt_record_fails_that_chunk_only(export, tmp_path, caplog):
    root = tmp_path / "exp"
    shutil.copytree(export.root, root)
    ds = Dataset(str(root), spec=export.spec)
    origin = sorted(ds.shards(0))[0]
    shard = ds.shard(0, origin)
    t = shard.table()
    i = len(t) // 2
    chunk = tuple(int(v) for v in t.coords[i])
    payload = bytes(t.payload(i))
    path = root / "s0" / f"{origin[0]}_{origin[1]}_{origin[2]}.arrow"
    data = bytearray(path.read_bytes())
    at = data.find(payload)
    assert at > 0 and data.find(payload, at + 1) < 0
    for j in range(at + len(payload) // 2, at + len(payload) // 2 + 8):  # the frame's middle
        data[j] ^= 0xFF
    path.write_bytes(bytes(data))
    caplog.set_level(logging.ERROR, logger="dvidshards.serve.view")
    with serve(Dataset(str(root), spec=export.spec)) as srv:
        s = srv.volume().info["scales"][0]
        want = export.expected(0)
        for c in map(tuple, t.coords):
            lo = np.array(c) * 64
            hi = np.minimum(lo + 64, s["size"])
            status, _, body = get(chunk_url(srv.http_url(), s["key"], lo, hi))
            if c == chunk:
                assert status == 500 and body.startswith(b"BlockDecodeError"), body
                assert f"{chunk}".encode() in body and path.name.encode() in body
            else:
                assert status == 200
                np.testing.assert_array_equal(decode_chunk(body, s["key"], lo, hi, s),
                                              want[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]])
    logged = [r.getMessage() for r in caplog.records if r.name == "dvidshards.serve.view"]
    assert len(logged) == 1 and "BlockDecodeError" in logged[0] and path.name in logged[0]


def test_remote_export_over_http(export):
    """An export read through byte ranges from an HTTP server is served the same way."""
    from pathlib import Path

    from tests.support.servers import RangeServer

    with RangeServer(Path(export.root)) as remote, serve(Dataset(remote.url, spec=export.spec)) as srv:
        for k in (0, 2):
            # (TensorStore's HTTP client is shared in a process: keep its requests to the viewer
            # server fewer than it allows at once, so the server's own remote reads get through)
            got = open_scale(srv.http_url(), k, concurrency=4)[..., 0].read().result()
            np.testing.assert_array_equal(got, export.expected(k))
        st = srv.stats()["agglomerated"]
        assert st["transcoded"]["count"] > 0 and st["failed"]["count"] == 0
        assert remote.total_requests > 0


def test_inferred_geometry_is_served_with_relative_resolutions(export, caplog):
    """Without a spec the scales have no resolution: each is served as 2**k, so they stack."""
    import warnings

    caplog.set_level(logging.WARNING, logger="dvidshards.serve.view")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = Dataset(export.root)
    assert ds.scales[0].resolution is None
    with serve(ds) as srv:
        info = json.loads(get(srv.http_url() + "/info")[2])
        assert [s["resolution"] for s in info["scales"]] == [[1.0] * 3, [2.0] * 3, [4.0] * 3]
        got = open_scale(srv.http_url(), 1)[..., 0].read().result()
        want = export.expected(1)
        np.testing.assert_array_equal(got[:want.shape[0], :want.shape[1], :want.shape[2]], want)
    assert any("resolution unknown" in r.getMessage() for r in caplog.records)


def test_voxel_offset_off_dvids_grid(export):
    """A volume starting at x=32: the served chunk grid starts there too, so every chunk straddles
    DVID chunks and is decoded and encoded; TensorStore still reads the volume exactly."""
    import copy

    spec = copy.deepcopy(export.spec)
    s0 = spec["scales"][0]
    s0["voxel_offset"] = [32, 0, 0]
    s0["size"] = [SHAPE[0] - 32, SHAPE[1], SHAPE[2]]
    spec["scales"] = [s0]
    with serve(Dataset(export.root, spec=spec)) as srv:
        t = open_scale(srv.http_url(), 0)
        assert list(t.domain.inclusive_min[:3]) == [32, 0, 0]
        np.testing.assert_array_equal(t[32:, :, :, 0].read().result(), export.expected(0)[32:])
        st = srv.stats()["agglomerated"]
        assert st["transcoded"]["count"] == 0 and st["encoded"]["count"] > 0


# --------------------------------------------------------------------------- meshes


def _legacy_fragment(data: bytes):
    from dvidshards.formats.multilod import decode_legacy_fragment

    return decode_legacy_fragment(data)


def test_meshes_on_demand(export, server):
    from dvidshards.formats import mesh as M

    pytest.importorskip("zmesh")
    base = server.http_url()
    info = json.loads(get(base + "/info")[2])
    assert info["mesh"] == "mesh"
    status, _, body = get(base + "/mesh/info")
    assert status == 200 and json.loads(body) == {"@type": "neuroglancer_legacy_mesh"}
    vol = export.expected(0)
    ids, counts = np.unique(vol[vol != 0], return_counts=True)
    b = int(ids[np.argmax(counts)])
    status, _, body = get(f"{base}/mesh/{b}:0")
    assert status == 200 and json.loads(body) == {"fragments": [f"{b}:0:mesh"]}
    status, _, data = get(f"{base}/mesh/{b}:0:mesh")
    assert status == 200
    m = M.merge_fragments([_legacy_fragment(data)])
    assert is_watertight(m.vertices, m.faces)
    st = server.stats()["agglomerated"]
    assert st["meshes"]["count"] == 1 and sum(st["mesh_scales"].values()) == 1
    k = [s["key"] for s in info["scales"]].index(next(iter(st["mesh_scales"])))
    res = np.array(info["scales"][k]["resolution"])
    idx = np.argwhere(vol == b)
    lo, hi = idx.min(axis=0) * 8.0, (idx.max(axis=0) + 1) * 8.0  # scale-0 nm (resolution 8)
    assert (m.vertices >= lo - res).all() and (m.vertices <= hi + res).all()  # a coarser scale: within a voxel
    want = counts.max() * 8.0**3
    assert abs(enclosed_volume(m.vertices, m.faces) / want - 1) < (0.15 if k == 0 else 0.5)
    assert get(f"{base}/mesh/{b}:0:mesh")[2] == data  # cached: computed once
    assert server.stats()["agglomerated"]["meshes"]["count"] == 1
    status, _, data = get(f"{base}/mesh/123456789:0:mesh")  # no such body: an empty fragment
    assert status == 200 and len(_legacy_fragment(data).faces) == 0
    assert get(f"{base}/mesh/{b}:1")[0] == 404 and get(f"{base}/mesh/x")[0] == 404


def test_mesh_scale_follows_the_budget(export):
    from dvidshards.formats import mesh as M

    pytest.importorskip("zmesh")
    ds = Dataset(export.root, spec=export.spec)
    vol = export.expected(0)
    ids, counts = np.unique(vol[vol != 0], return_counts=True)
    b = int(ids[np.argmax(counts)])
    keys = [s.to_json()["key"] for s in ds.scales]
    for budget, key in ((1e-6, keys[-1]), (60.0, keys[0])):
        with serve(ds, mesh_budget=budget) as srv:
            status, _, data = get(f"{srv.http_url()}/mesh/{b}:0:mesh")
            assert status == 200
            assert srv.stats()["agglomerated"]["mesh_scales"] == {key: 1}
            m = M.merge_fragments([_legacy_fragment(data)])
            assert is_watertight(m.vertices, m.faces)
            if key == keys[0]:  # full resolution: the body's own volume
                assert abs(enclosed_volume(m.vertices, m.faces) / (counts.max() * 512.0) - 1) < 0.05


def test_serves_a_meshes_output(export, tmp_path):
    pytest.importorskip("zmesh")
    CloudVolume = pytest.importorskip("cloudvolume").CloudVolume
    from dvidshards.formats import mesh as M
    from dvidshards.jobs.meshes import MANIFEST, meshes

    ds = Dataset(export.root, spec=export.spec)
    assert meshes(ds, tmp_path / "m", scheduler="serial", progress=False).ok
    with serve(ds, meshes=tmp_path / "m") as srv:
        base = srv.http_url()
        assert json.loads(get(base + "/mesh/info")[2])["@type"] == "neuroglancer_multilod_draco"
        shard = sorted(f for f in os.listdir(tmp_path / "m" / "mesh") if f.endswith(".shard"))[0]
        whole = (tmp_path / "m" / "mesh" / shard).read_bytes()
        status, headers, part = get(f"{base}/mesh/{shard}", {"Range": "bytes=5-99"})
        assert status == 206 and part == whole[5:100]
        assert headers["Content-Range"] == f"bytes 5-99/{len(whole)}"
        assert get(f"{base}/mesh/{shard}", {"Range": "bytes=-10"})[2] == whole[-10:]
        assert get(f"{base}/mesh/{shard}", {"Range": f"bytes={len(whole)}-"})[0] == 416
        assert get(f"{base}/mesh/{shard}")[2] == whole
        for hidden in (MANIFEST, "dvidshards.json", "../info", "_work/x"):
            assert get(f"{base}/mesh/{hidden}")[0] == 404
        # cloud-volume reads the served meshes over HTTP, equal to the files
        vol = export.expected(0)
        b = int(np.unique(vol[vol != 0])[0])
        served = CloudVolume(base, progress=False, use_https=False).mesh.get(b)[b]
        local = CloudVolume(f"file://{tmp_path / 'm'}", progress=False).mesh.get(b)[b]
        np.testing.assert_array_equal(served.vertices, local.vertices)
        m = M.merge_fragments([M.Mesh(served.vertices, served.faces)])
        assert is_watertight(m.vertices, m.faces)
    man = tmp_path / "m" / "mesh" / MANIFEST
    man.write_text(json.dumps({**json.loads(man.read_text()), "complete": False}))
    with pytest.raises(SpecError, match="incomplete"):
        serve(ds, meshes=tmp_path / "m")
    with pytest.raises(SpecError, match="meshes output"):
        serve(ds, meshes=tmp_path)


def test_port_in_use_is_named_in_one_line(export):
    with serve(Dataset(export.root, spec=export.spec)) as srv:
        with pytest.raises(SpecError, match=f"port {srv.port} on 127.0.0.1 is in use"):
            ViewServer("127.0.0.1", srv.port)
        spec = os.path.join(os.path.dirname(export.root), "spec.json")
        with open(spec, "w") as f:
            json.dump(export.spec, f)
        r = subprocess.run([sys.executable, "-m", "dvidshards.cli", "view", export.root, "--spec", spec,
                            "--no-viewer", "--port", str(srv.port)], capture_output=True, text=True,
                           timeout=HANG_SECONDS)
        assert r.returncode == 2
        assert r.stderr.strip().count("\n") == 0 and f"port {srv.port}" in r.stderr and "in use" in r.stderr


def test_mesh_chunks_from_a_label_index(export, tmp_path, monkeypatch):
    """With a label index, a coarser scale's chunks come from the index's blocks (no scan of
    the lists): the same mesh as without it."""
    pytest.importorskip("zmesh")
    from dvidshards.jobs.labelindex import label_index

    ds = Dataset(export.root, spec=export.spec)
    label_index(ds, tmp_path / "idx", scale=0, scheduler="serial")
    vol = export.expected(0)
    ids, counts = np.unique(vol[vol != 0], return_counts=True)
    b = int(ids[np.argmax(counts)])
    import dvidshards.bodies

    scans = []
    real = dvidshards.bodies.chunks_with
    monkeypatch.setattr(dvidshards.bodies, "chunks_with", lambda *a, **k: scans.append(k["scale"]) or real(*a, **k))
    got = {}
    for index in (None, tmp_path / "idx"):
        scans.clear()
        with serve(ds, mesh_budget=1e-6, index=index) as srv:  # the coarsest scale
            got[index is None] = get(f"{srv.http_url()}/mesh/{b}:0:mesh")[2]
            assert list(srv.stats()["agglomerated"]["mesh_scales"]) == [ds.scales[-1].to_json()["key"]]
        assert scans == ([] if index else [2])  # the lists of the coarsest scale scanned, or nothing
    assert got[True] == got[False] and len(got[True]) > 1000


def test_skeletons_on_demand_and_from_an_output(tmp_path):
    """The volume's skeleton source (``info`` names it): cloud-volume reads a body's skeleton over
    HTTP (nm, its ``radius`` attribute), made on demand at the skeletons job's scale equal to what
    the job writes, and from ``skeletons=OUT`` the same; an absent body has an empty skeleton."""
    pytest.importorskip("kimimaro")
    CloudVolume = pytest.importorskip("cloudvolume").CloudVolume
    from dvidshards.jobs.skeletons import skeletons

    e = make_export(tmp_path / "exp", SHAPE, seed=4, scales=2, resolution=(16, 16, 16))  # s1: 32 nm
    ds = Dataset(e.root, spec=e.spec)
    assert skeletons(ds, str(tmp_path / "sk"), scheduler="serial", progress=False).ok
    ref = CloudVolume(f"file://{tmp_path / 'sk'}", progress=False)
    vol = e.expected(1)
    ids, counts = np.unique(vol[vol != 0], return_counts=True)

    def rows(v):
        v = np.asarray(v, np.float64)
        return v[np.lexsort(v.T[::-1])]

    for given in (None, str(tmp_path / "sk")):
        with serve(ds, skeletons=given) as srv:
            info = json.loads(get(srv.http_url() + "/info")[2])
            assert info["skeletons"] == "skeletons"
            assert json.loads(get(srv.http_url() + "/skeletons/info")[2])["@type"] == "neuroglancer_skeletons"
            cv = CloudVolume(srv.http_url(), progress=False, use_https=False)
            for b in ids[np.argsort(counts)[::-1][:2]].tolist():
                got, want = cv.skeleton.get(b), ref.skeleton.get(b)
                assert len(got.vertices) == len(want.vertices) > 0 and len(got.edges) == len(want.edges)
                np.testing.assert_allclose(rows(got.vertices), rows(want.vertices), atol=1e-3)
                np.testing.assert_allclose(np.sort(got.radius), np.sort(want.radius), rtol=1e-5)
            assert get(srv.http_url() + "/skeletons/987654321")[2] == bytes(8)  # no such body: no vertex, no edge
            assert get(srv.http_url() + "/skeletons/x")[0] == 404
