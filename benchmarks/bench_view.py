"""``dvidshards view`` against neuroglancer's own LocalVolume fed with the same TensorStore.

Three measurements, the servers in this process, on a synthetic neuron-like export (3 DVID scales):

1. **Chunks served per second** over HTTP (2 keep-alive connections from a client process, as
   a browser is), and this process's CPU per chunk (the server's, robust on a busy machine), every chunk of a
   scale: dvidshards' precomputed server (whole chunks transcoded from the records; and with
   the transcoder off, voxels decoded and encoded again) vs LocalVolume's ``npz`` route on
   ``Dataset.open(0)``. Zoomed out, a dvidshards chunk comes from DVID's own small scale, a
   LocalVolume chunk strides full resolution (factor 2 and 4 per axis).
2. **Time to the first full screenshot** in headless Chromium (SwiftShader WebGL), from
   loading the viewer page to neuroglancer's screenshot reply (it waits until every visible
   chunk is drawn): at full resolution (1 voxel per pixel) and zoomed out (4 voxels per pixel,
   the smallest scale), each on a fresh server, page and shard cache.
3. With the real mCNS shard (``--data``): its 258 real blocks served transcoded vs decoded and
   encoded.

Run: ``python benchmarks/bench_view.py [--quick]``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from common import DEFAULT_DATA, REAL_SHARD, header, mcns_spec, med, parser, real_export, table

import dvidshards
import dvidshards.serve.view
from dvidshards.serve.view import ViewServer, find_browser, open_browser, screenshot


def build_export(workdir: Path, size, seed: int = 5, log=print) -> tuple[Path, dict]:
    """A 3-scale synthetic export (built once, kept in workdir)."""
    from dvidshards.demo.neurons import neuron_volume
    from dvidshards.writer import write_export

    folder = workdir / f"view-{'x'.join(map(str, size))}-s{seed}"
    spec_path = folder / "spec.json"
    if spec_path.exists():
        return folder / "export", json.loads(spec_path.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    log(f"building {folder} (once) ...")
    sv, mapping = neuron_volume(size, n_bodies=120, svs_per_body=6, seed=seed)
    spec = write_export(sv, folder / "export", mapping=mapping, scales=3, overwrite=True)
    spec_path.write_text(json.dumps(spec))
    log(f"built in {time.perf_counter() - t:.0f} s")
    return folder / "export", spec


# --------------------------------------------------------------------------- HTTP clients


_CLIENT = r"""
import http.client, json, sys, threading, time, urllib.parse
from concurrent.futures import ThreadPoolExecutor
u, threads = urllib.parse.urlsplit(sys.argv[1]), int(sys.argv[2])
prefix, paths, local = u.path.rstrip("/"), json.load(sys.stdin), threading.local()
def get(path):
    for attempt in range(2):
        c = getattr(local, "conn", None) or http.client.HTTPConnection(u.hostname, u.port, timeout=300)
        local.conn = c
        try:
            c.request("GET", prefix + path)
            r = c.getresponse()
            body = r.read()
            if r.getheader("Connection", "").lower() == "close":
                c.close(); local.conn = None
            return r.status, len(body)
        except (http.client.HTTPException, ConnectionError):
            c.close(); local.conn = None
            if attempt:
                raise
with ThreadPoolExecutor(threads) as ex:
    t = time.perf_counter()
    got = list(ex.map(get, paths))
    dt = time.perf_counter() - t
print(json.dumps({"seconds": dt, "got": got}))
"""


def fetch_all(base_url: str, paths: list[str], threads: int = 2) -> tuple[float, float, list[tuple[int, int]]]:
    """GET every path with ``threads`` keep-alive connections from another process, as a browser is
    (a client in this process would share the server's GIL): (seconds, this process's CPU seconds
    meanwhile, [(status, bytes)])."""
    cpu = time.process_time()
    r = subprocess.run([sys.executable, "-c", _CLIENT, base_url, str(threads)], input=json.dumps(paths),
                       capture_output=True, text=True, check=True)
    out = json.loads(r.stdout)
    return out["seconds"], time.process_time() - cpu, [(s, n) for s, n in out["got"]]


def dvid_paths(info: dict, k: int) -> list[str]:
    s = info["scales"][k]
    size, cs = np.array(s["size"]), np.array(s["chunk_sizes"][0])
    out = []
    for c in np.ndindex(*(-(-size // cs))):
        lo = np.array(c) * cs
        hi = np.minimum(lo + cs, size)
        out.append(f"/{s['key']}/{lo[0]}-{hi[0]}_{lo[1]}-{hi[1]}_{lo[2]}-{hi[2]}")
    return out


def localvolume_paths(key: str, shape0, f: int) -> list[str]:
    """LocalVolume chunk URLs covering the volume at downsampling factor f (64³ downsampled voxels)."""
    size = -(-np.asarray(shape0) // f)
    out = []
    for c in np.ndindex(*(-(-size // 64))):
        lo = np.array(c) * 64
        hi = np.minimum(lo + 64, size)
        out.append(f"/neuroglancer/npz/{key}/{f},{f},{f}/{lo[0]},{lo[1]},{lo[2]}/{hi[0]},{hi[1]},{hi[2]}")
    return out


def local_volume(ds):
    import neuroglancer as ng

    vol = ds.open(0, fill_missing_shards=True)
    dims = ng.CoordinateSpace(names=["x", "y", "z"], units="nm", scales=list(ds.scales[0].resolution))
    lv = ng.LocalVolume(vol, dimensions=dims, volume_type="segmentation")
    calls = []
    orig = lv.get_encoded_subvolume

    def counted(data_format, start, end, scale_key):  # count and time the server's chunk work
        t = time.perf_counter()
        try:
            return orig(data_format, start, end, scale_key)
        finally:
            calls.append((scale_key, time.perf_counter() - t))

    lv.get_encoded_subvolume = counted
    return lv, dims, calls


def lv_viewer(ds, lv, dims, position):
    import neuroglancer as ng

    v = ng.Viewer()
    with v.txn() as s:
        s.dimensions = dims
        s.position = position
        s.layers["segmentation"] = ng.SegmentationLayer(source=ng.LayerDataSource(
            url=lv, subsources={"default": True, "bounds": True, "meshes": False},
            enable_default_subsources=False))
    return v


# --------------------------------------------------------------------------- measurements


def throughput(export, spec, rounds: int, localvolume: bool = True) -> list[list]:
    import neuroglancer as ng

    rows = []
    ds = dvidshards.Dataset(export, spec=spec)
    shape0 = ds.scales[0].size
    results: dict[str, list] = {}
    for k in range(len(ds.scales)):
        f = 2 ** k
        runs: dict[str, list[tuple[float, float]]] = {"dvidshards": [], "dvidshards, transcoder off": []}
        if localvolume:
            runs["LocalVolume"] = []
        info = {}
        for r in range(rounds + 1):  # round 0 warms the page cache and numba
            for name in list(runs)[r % len(runs):] + list(runs)[:r % len(runs)]:
                dsr = dvidshards.Dataset(export, spec=spec)  # a fresh shard cache every run
                if name == "LocalVolume":
                    if not ng.server.is_server_running():
                        ng.set_server_bind_address("127.0.0.1", 0)
                    lv, dims, calls = local_volume(dsr)
                    v = lv_viewer(dsr, lv, dims, [0, 0, 0])
                    key = v.volume_manager.get_volume_key(lv)
                    base_url = ng.server.get_server_url()
                    paths = localvolume_paths(key, shape0, f)
                else:
                    srv = ViewServer(threads=2)
                    srv.add(dsr, transcode=name == "dvidshards")
                    base_url = srv.http_url()
                    paths = dvid_paths(srv.volume().info, k)
                dt, cpu, got = fetch_all(base_url, paths)
                if name != "LocalVolume":
                    srv.close()
                bad = [s for s, _ in got if s not in (200, 404)]
                assert not bad, (name, bad[:3])
                if r:
                    runs[name].append((dt, cpu))
                info[name] = (len(paths), sum(n for _, n in got), sum(s == 200 for s, _ in got))
        base = med([dt for dt, _ in runs["LocalVolume"]]) if localvolume else float("nan")
        for name, v in runs.items():
            n, nbytes, n200 = info[name]
            t = med([dt for dt, _ in v])
            rows.append([f"s{k}" if name != "LocalVolume" else f"s0 strided {f},{f},{f}" if f > 1 else "s0",
                         name, n, n200, f"{n / t:.0f}", f"{t:.2f}", f"{1e3 * med([c for _, c in v]) / n:.2f}",
                         f"{nbytes / max(n200, 1) / 1024:.1f}", f"{base / t:.2f}x"])
        results[k] = runs
    return rows


def first_screenshots(export, spec, rounds: int, size=(1024, 768), localvolume: bool = True) -> list[list]:
    import neuroglancer as ng

    ds = dvidshards.Dataset(export, spec=spec)
    s0 = ds.scales[0]
    centre = [s0.size[0] / 2, s0.size[1] / 2, s0.size[2] / 2 + 0.5]
    if not ng.server.is_server_running():
        ng.set_server_bind_address("127.0.0.1", 0)
    drv = open_browser(ng.Viewer().get_viewer_url(), size=(size[0] + 64, size[1] + 200))
    rows = []
    try:
        for view, scale in (("full resolution (1 voxel/pixel)", 1.0), ("zoomed out (4 voxels/pixel)", 4.0)):
            times: dict[str, list] = {"dvidshards": [], "LocalVolume": []} if localvolume else {"dvidshards": []}
            chunks: dict[str, object] = {}
            for r in range(rounds + 1):
                for name in list(times)[r % len(times):] + list(times)[:r % len(times)]:
                    dsr = dvidshards.Dataset(export, spec=spec)
                    if name == "LocalVolume":
                        lv, dims, calls = local_volume(dsr)
                        v = lv_viewer(dsr, lv, dims, centre)
                        srv = None
                    else:
                        v = dvidshards.serve.view.viewer(dsr, position=centre)
                        srv = v.dvidshards_server
                    with v.txn() as s:
                        s.layout = "xy"
                        s.cross_section_scale = scale
                        s.show_scale_bar = s.show_axis_lines = s.show_default_annotations = False
                    with v.config_state.txn() as c:
                        c.show_ui_controls = False
                        c.show_panel_borders = False
                        c.viewer_size = list(size)
                    t = time.perf_counter()
                    drv.get(v.get_viewer_url())
                    png = screenshot(v, timeout=600)
                    dt = time.perf_counter() - t
                    if srv is not None:
                        st = srv.stats()["agglomerated"]
                        chunks[name] = dict(sorted(st["scales"].items()))
                        srv.close()
                    else:
                        by = {}
                        for key, _ in calls:
                            by[key] = by.get(key, 0) + 1
                        chunks[name] = dict(sorted(by.items()))
                    drv.get("about:blank")
                    if r:
                        times[name].append(dt)
                    assert len(png) > 1000
            base = med(times["LocalVolume"]) if localvolume else float("nan")
            for name, v in times.items():
                rows.append([view, name, f"{med(v):.2f}", f"{min(v):.2f}", f"{base / med(v):.2f}x",
                             ", ".join(f"{k}: {n}" for k, n in chunks[name].items())])
    finally:
        drv.quit()
    return rows


def real_blocks(workdir: Path, data: Path, rounds: int) -> list[list]:
    """The real mCNS shard served whole-chunk: transcoded vs decoded and encoded again."""
    spec = mcns_spec(data)
    root = real_export(workdir, data)
    ds = dvidshards.Dataset(root, spec=spec)
    coords = ds.shard(1, tuple(int(v) for v in REAL_SHARD.split("_"))).coords
    key = ds.scale(1).to_json()["key"]
    paths = [f"/{key}/{x * 64}-{x * 64 + 64}_{y * 64}-{y * 64 + 64}_{z * 64}-{z * 64 + 64}" for x, y, z in coords]
    runs: dict[str, list] = {"transcoded from the record": [], "decoded + re-encoded": []}
    info = {}
    for r in range(rounds + 1):
        for name in list(runs)[r % 2:] + list(runs)[:r % 2]:
            with ViewServer(threads=2) as srv:
                srv.add(dvidshards.Dataset(root, spec=spec), transcode=name.startswith("transcoded"))
                dt, cpu, got = fetch_all(srv.http_url(), paths)
            assert all(s == 200 for s, _ in got), {s for s, _ in got}
            if r:
                runs[name].append((dt, cpu))
            info[name] = sum(n for _, n in got)
    base = med([dt for dt, _ in runs["decoded + re-encoded"]])
    rows = []
    for name, v in runs.items():
        t = med([dt for dt, _ in v])
        rows.append([name, len(paths), f"{len(paths) / t:.0f}", f"{1e3 * med([c for _, c in v]) / len(paths):.2f}",
                     f"{info[name] / len(paths) / 1024:.1f}", f"{base / t:.2f}x"])
    return rows


def main() -> None:
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-localvolume", action="store_true",
                   help="measure dvidshards only (before/after comparisons of the view server)")
    args = p.parse_args()
    size = (256, 256, 128) if args.quick else (768, 768, 256)
    rounds = 1 if args.quick else args.rounds
    header("dvidshards view vs neuroglancer LocalVolume")
    export, spec = build_export(args.workdir, size)
    ds = dvidshards.Dataset(export, spec=spec)
    print(f"export: {size} voxels, scales {[tuple(s.size) for s in ds.scales]}, "
          f"shard files per scale {[len(ds.shards(s.index)) for s in ds.scales]}; medians of {rounds} rounds "
          f"after 1 warm-up, interleaved\n")
    table(["chunks of", "server", "requests", "with data (200)", "chunks/s", "s", "server CPU ms/chunk", "KiB/chunk",
           "vs LocalVolume"],
          throughput(export, spec, rounds, not args.no_localvolume),
          "Chunks served per second (2 client threads; 404 = background chunk)")
    if find_browser() is None:
        print("no chromium + chromedriver: screenshot timings skipped\n")
    else:
        table(["view (1024x768, xy)", "server", "median s", "best s", "vs LocalVolume", "chunk requests per scale"],
              first_screenshots(export, spec, rounds, localvolume=not args.no_localvolume),
              "Time to the first full screenshot (page load to neuroglancer's screenshot reply)")
    data = args.data if args.data else DEFAULT_DATA
    if (data / f"{REAL_SHARD}.arrow").is_file():
        table(["route", "chunks", "chunks/s", "server CPU ms/chunk", "KiB/chunk", "vs decode + encode"],
              real_blocks(args.workdir, data, rounds), "The real mCNS shard (258 blocks, scale 1), every chunk over HTTP")


if __name__ == "__main__":
    main()
