"""Meshes for every body: ``dvidshards meshes`` vs igneous' mesh forge, and view's first mesh.

Data: ``common.synthetic_pair`` (a size³ neuron-like export, default 512³ with 200 bodies of 8
supervoxels, and its precomputed twin holding the same agglomerated labels as sharded
compressed_segmentation, written by TensorStore: "the converted precomputed volume").

Measured, serially (one core), CPU seconds of the process (or child process) doing the work:

* ``dvidshards meshes`` straight from the export at the default scale (s2, 32 nm), one level of
  detail as igneous' ``num_lod=0``: per-cell marching cubes and decimation, per-node decimation,
  Draco, shard files; with its default simplification (about 1/10 of the marching-cubes faces
  within 1.25 voxels, igneous' 40 nm at 32 nm) and unsimplified (``reduction_factor=0``), after
  a warm-up run that loads the kernels (a long job's state);
* igneous (``igneous-pipeline``, run by ``--igneous-python``, a venv of its own:
  ``python -m venv /work/venv-igneous && /work/venv-igneous/bin/pip install igneous-pipeline``):
  ``create_meshing_tasks(mip=2, sharded=True)`` (the forge, its default simplification) then
  ``create_sharded_multires_mesh_tasks`` (the merge) on a precomputed twin whose mip 2 holds the
  same s2 labels, through a ``LocalTaskQueue(parallel=1)``;
* the conversion igneous needs first: ``dvidshards convert`` of the export (CPU seconds);
* ``dvidshards view``: wall time of the first (uncached) on-demand mesh of a body spanning at
  least 8 chunks, with the default 2 s budget and at full resolution;
* the default run (levels from s2 and s3) in a fresh process, warmed up on a corner of the volume
  first: its CPU, and its peak resident and anonymous memory (sampled every 20 ms) over the
  baseline: the job streams fragments to disk and merges one body at a time, so its peak follows
  the largest body, not the export;
* quality per body at s2, for both outputs through cloud-volume's reader (each body's fragments
  welded where they meet): bodies whose s2 voxels are one 18- (26-) connected piece, and bodies
  whose mesh is one watertight piece with a volume within 15 % of their s2 voxels.

Run: ``.venv/bin/python benchmarks/bench_meshes.py [--quick] [--igneous-python PATH]``.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numba
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
from common import table

import dvidshards
from dvidshards.bodies import Body
from dvidshards.jobs.convert import convert
from dvidshards.jobs.meshes import meshes
from dvidshards.serve.view import serve

IGNEOUS = """
import json, resource, sys, time
from taskqueue import LocalTaskQueue
import igneous.task_creation as tc
path = sys.argv[1]
tq = LocalTaskQueue(parallel=1, progress=False)
t0 = time.perf_counter()
c0 = resource.getrusage(resource.RUSAGE_SELF)
tq.insert(tc.create_meshing_tasks(path, mip=int(sys.argv[2]), shape=(448, 448, 448), sharded=True, mesh_dir="mesh",
                                  spatial_index=True, fill_missing=True))
tq.execute(progress=False)
c1 = resource.getrusage(resource.RUSAGE_SELF)
t1 = time.perf_counter()
tq.insert(tc.create_sharded_multires_mesh_tasks(path, num_lod=0, mesh_dir="mesh", progress=False))
tq.execute(progress=False)
c2 = resource.getrusage(resource.RUSAGE_SELF)
cpu = lambda a, b: (b.ru_utime + b.ru_stime) - (a.ru_utime + a.ru_stime)
print(json.dumps({"forge_cpu": cpu(c0, c1), "merge_cpu": cpu(c1, c2), "wall": time.perf_counter() - t0,
                  "forge_wall": t1 - t0, "peak_rss": c2.ru_maxrss * 1024}))
"""


def cpu_now() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def ours(ds, dest: Path, **kw) -> dict:
    shutil.rmtree(dest, ignore_errors=True)
    c0, t0 = cpu_now(), time.perf_counter()
    rep = meshes(ds, dest, scheduler="serial", progress=False, **kw)
    cpu, wall = cpu_now() - c0, time.perf_counter() - t0
    assert rep.ok, rep.summary()
    return {"bodies": rep.totals["bodies"], "cpu": cpu, "wall": wall, "fragments": rep.totals["pieces"],
            "bytes": sum(p.stat().st_size for p in (dest / "mesh").glob("*.shard"))}


def igneous(python: str, precomputed: Path, work: Path, mip: int = 0) -> dict | None:
    if not python or not Path(python).exists():
        return None
    dest = work / "igneous-precomputed"
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(precomputed, dest)
    script = work / "igneous_run.py"
    script.write_text(IGNEOUS)
    r = subprocess.run([python, str(script), f"file://{dest}", str(mip)], capture_output=True, text=True)
    if r.returncode:
        print(r.stderr[-3000:], file=sys.stderr)
        return None
    out = json.loads(r.stdout.strip().splitlines()[-1])
    mesh = dest / "mesh"
    out["bytes"] = sum(p.stat().st_size for p in mesh.glob("*.shard"))
    out["bodies"] = _count_bodies(dest)
    return out


def _scaled_pair(pair, work: Path, size: int):
    """The pair's volume as an export with scales s0-s3 (DVID's pyramid), and a precomputed twin
    whose mip 2 holds the same s2 labels (what igneous meshes at mip 2)."""
    from cloudvolume import CloudVolume

    from dvidshards.writer import write_export

    spec = json.loads((pair.folder / "spec.json").read_text())
    src = dvidshards.Dataset(pair.folder / "export", spec=spec)
    root = work / "export-4-scales"
    bodies = src.read([[0, 0, 0], [size] * 3], scale=0)  # the agglomerated labels, as the twin holds them
    spec4 = write_export(bodies, root, scales=4)
    ds = dvidshards.Dataset(root, spec=spec4)
    s2 = ds.read([[0, 0, 0], list(ds.scale(2).size)], scale=2)
    twin = work / "twin-mip2"
    info = CloudVolume.create_new_info(num_channels=1, layer_type="segmentation", data_type="uint64",
                                       encoding="raw", resolution=[8, 8, 8], voxel_offset=[0, 0, 0],
                                       chunk_size=[64, 64, 64], volume_size=[size] * 3)
    cv = CloudVolume(f"file://{twin}", info=info, progress=False)
    cv.add_scale((2, 2, 2))
    cv.add_scale((4, 4, 4))
    cv.commit_info()
    CloudVolume(f"file://{twin}", mip=2, progress=False)[:, :, :] = s2
    return ds, twin


def _count_bodies(dest: Path) -> int | None:
    try:
        from cloudvolume import CloudVolume

        cv = CloudVolume(f"file://{dest}", progress=False)
        return len(cv.mesh.reader.list_segids()) if hasattr(cv.mesh.reader, "list_segids") else None
    except Exception:  # noqa: BLE001 - the count is informative only
        return None


def faces_of(dest: Path, ids) -> int:
    from cloudvolume import CloudVolume

    cv = CloudVolume(f"file://{dest}", progress=False)
    n = 0
    for b in ids:
        m = cv.mesh.get(int(b))
        m = m[int(b)] if isinstance(m, dict) else m
        n += len(m.faces)
    return n


def view_latency(ds, body: int, budget: float) -> dict:
    with serve(ds, mesh_budget=budget) as srv:
        t0 = time.perf_counter()
        with urllib.request.urlopen(f"{srv.http_url()}/mesh/{body}:0:mesh", timeout=600) as r:
            data = r.read()
        dt = time.perf_counter() - t0
        st = srv.stats()["agglomerated"]
    return {"seconds": dt, "scale": next(iter(st["mesh_scales"])), "bytes": len(data)}


def main() -> None:
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--igneous-python", default="/work/venv-igneous/bin/python",
                   help="python of a venv with igneous-pipeline installed (skipped when absent)")
    args = p.parse_args()
    common.header("bench_meshes: dvidshards meshes vs igneous mesh forge; view's first mesh")
    size, n_bodies = (256, 40) if args.quick else (512, 200)
    pair = common.synthetic_pair(args.workdir, size, n_bodies=n_bodies, svs_per_body=8)
    work = Path(tempfile.mkdtemp(prefix="bench-meshes-", dir=args.workdir))
    ds, twin = _scaled_pair(pair, work, size)
    try:
        vol_ids = None
        rows = []
        # conversion (what igneous needs first)
        c0, t0 = cpu_now(), time.perf_counter()
        rep = convert(ds, work / "converted", format="precomputed", scheduler="serial", progress=False)
        conv_cpu, conv_wall = cpu_now() - c0, time.perf_counter() - t0
        assert rep.ok
        ours(ds, work / "warm", lods=1, box=[[0, 0, 0], [256, 256, 256]])  # kernels loaded: a long job's state
        a = ours(ds, work / "ours", lods=1)  # the default scale (s2, 32 nm), one level as igneous' num_lod=0
        b = ours(ds, work / "ours-unsimplified", lods=1, reduction_factor=0, cell_reduction=0)
        ig = igneous(args.igneous_python, twin, work, mip=2)
        n = a["bodies"]
        vol_ids = _sample_ids(ds)
        fa = faces_of(work / "ours", vol_ids)
        fb = faces_of(work / "ours-unsimplified", vol_ids)
        rows.append(["dvidshards meshes s2, one level (default simplification)", n, f"{a['cpu']:.1f}",
                     f"{n / a['cpu']:.2f}", f"{a['bytes'] / 1e6:.1f}", fa // len(vol_ids), "1.00"])
        rows.append(["dvidshards meshes s2, one level, unsimplified", b["bodies"], f"{b['cpu']:.1f}",
                     f"{b['bodies'] / b['cpu']:.2f}", f"{b['bytes'] / 1e6:.1f}", fb // len(vol_ids),
                     f"{b['cpu'] / a['cpu']:.2f}"])
        c = peak_rss(ds, work)  # the default levels (s2 and s3), in a fresh process: its CPU and peak memory
        rows.append(["dvidshards meshes default (levels from s2 and s3)", c["bodies"], f"{c['cpu']:.1f}",
                     f"{c['bodies'] / c['cpu']:.2f}", f"{c['bytes'] / 1e6:.1f}", "", f"{c['cpu'] / a['cpu']:.2f}"])
        if ig is not None:
            ig_cpu = ig["forge_cpu"] + ig["merge_cpu"]
            fi = faces_of(work / "igneous-precomputed", vol_ids)
            rows.append(["igneous forge + merge at mip 2 (the same s2 labels)", ig.get("bodies") or n, f"{ig_cpu:.1f}",
                         f"{n / ig_cpu:.2f}", f"{ig['bytes'] / 1e6:.1f}", fi // len(vol_ids),
                         f"{ig_cpu / a['cpu']:.2f}"])
            rows.append(["igneous + dvidshards convert first", n, f"{ig_cpu + conv_cpu:.1f}",
                         f"{n / (ig_cpu + conv_cpu):.2f}", "", "", f"{(ig_cpu + conv_cpu) / a['cpu']:.2f}"])
        table(["job", "bodies", "CPU s", "bodies / core-s", "MB", "faces / body (lod 0)",
                     "CPU vs ours"], rows,
                    title=f"{size}³ export, {n_bodies} bodies: meshing every body, one core")
        print(f"\nconvert (serial): {conv_cpu:.1f} CPU s, {conv_wall:.1f} s wall; "
              f"ours wall {a['wall']:.1f} s" + (f"; igneous wall {ig['wall']:.1f} s" if ig else
                                                 "; igneous not run (no --igneous-python venv)"))
        # view: first mesh of a body spanning >= 8 chunks
        body, nchunks = _big_body(ds)
        rows = []
        for budget in (2.0, 1e9):
            r = view_latency(ds, body, budget)
            rows.append([f"{budget:g}" if budget < 1e6 else "none (full resolution)", body, nchunks,
                         r["scale"], f"{r['seconds']:.2f}", f"{r['bytes'] / 1e6:.2f}"])
        table(["budget s", "body", "s0 chunks", "scale meshed", "first mesh s", "MB"], rows,
                    title="dvidshards view: first (uncached) mesh of a body")
        r = c
        table(["export", "bodies", "cell fragments", "volume as uint64 MiB", "RSS before MiB", "peak RSS MiB",
               "anon before MiB", "peak anon MiB"],
              [[f"{size}³", n_bodies, r["fragments"], f"{size ** 3 * 8 / 2**20:.0f}",
                f"{r['base']['VmRSS'] / 2**20:.0f}", f"{r['peak']['VmRSS'] / 2**20:.0f}",
                f"{r['base']['RssAnon'] / 2**20:.0f}", f"{r['peak']['RssAnon'] / 2**20:.0f}"]],
              title="dvidshards meshes: peak memory of the default run above (fresh process, serial: the largest "
                    "task's, over the imported baseline)")
        rows = [["dvidshards meshes s2, one level", *quality(ds, work / "ours", 2)]]
        if ig is not None:
            rows.append(["igneous forge + merge at mip 2", *quality(ds, work / "igneous-precomputed", 2)])
        table(["output", "bodies", "18- (26-) connected at s2", "one watertight piece, volume within 15 %",
               "of the connected ones", "median volume / voxels"], rows,
              title="Quality per body at s2 (cloud-volume's reader; fragments welded where they meet)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


RSS = """
import json, sys, threading, time


def status():
    out = {}
    for line in open("/proc/self/status"):
        if line.startswith(("VmRSS", "RssAnon")):
            k, v = line.split(":")
            out[k] = int(v.split()[0]) * 1024
    return out


import dvidshards
from dvidshards.formats.mesh import mesh_block
from dvidshards.jobs.meshes import meshes

ds = dvidshards.Dataset(sys.argv[1], spec=json.loads(open(sys.argv[2]).read()))
mesh_block(ds.read([[0, 0, 0], [65, 65, 65]], threads=1), (0, 0, 0))  # kernels compiled, libraries loaded
meshes(ds, sys.argv[3] + "-warm", box=[[0, 0, 0], [256, 256, 256]], scheduler="serial", progress=False)
base = status()
peak = dict(base)
done = threading.Event()


def watch():  # the high-water marks of resident and anonymous memory, sampled every 20 ms
    while not done.wait(0.02):
        for k, v in status().items():
            peak[k] = max(peak[k], v)


t = threading.Thread(target=watch, daemon=True)
t.start()
import resource
r0 = resource.getrusage(resource.RUSAGE_SELF)
rep = meshes(ds, sys.argv[3], scheduler="serial", progress=False)
r1 = resource.getrusage(resource.RUSAGE_SELF)
done.set()
t.join()
print(json.dumps({"ok": rep.ok, "bodies": rep.totals["bodies"], "fragments": rep.totals["pieces"], "base": base,
                  "peak": peak, "cpu": (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)}))
"""


def peak_rss(ds, work: Path) -> dict:
    """A default meshes run in a fresh process: its CPU, peak RSS and anonymous memory, the bytes it wrote."""
    dest = work / "ours-default"
    shutil.rmtree(dest, ignore_errors=True)
    script = work / "rss_run.py"
    script.write_text(RSS)
    spec = work / "spec-4-scales.json"
    spec.write_text(json.dumps(ds.spec))
    env = {k: v for k, v in os.environ.items() if k != "DVIDSHARDS_KERNELS"}  # the default, as a user runs it
    r = subprocess.run([sys.executable, str(script), str(work / "export-4-scales"), str(spec), str(dest)],
                       capture_output=True, text=True, env=dict(env, PYTHONPATH=str(common.ROOT)))
    if r.returncode:
        raise RuntimeError(r.stderr[-2000:])
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["ok"], out
    out["bytes"] = sum(p.stat().st_size for p in (dest / "mesh").glob("*.shard"))
    return out


@numba.njit(cache=True)
def _components(vol, reach):  # pragma: no cover - numba
    """Union-find over voxels: pieces of each label, neighbours within ``reach`` steps (1: 6-connected,
    2: 18-connected, the connectivity marching cubes keeps (zmesh joins voxels meeting at an edge, not
    at a corner), 3: 26-connected). Returns each voxel's root index."""
    nx, ny, nz = vol.shape
    parent = np.arange(nx * ny * nz)
    for x in range(nx):
        for y in range(ny):
            for z in range(nz):
                lab = vol[x, y, z]
                if lab == 0:
                    continue
                a = (x * ny + y) * nz + z
                for dx in range(0, 2):
                    for dy in range(-1, 2):
                        for dz in range(-1, 2):
                            if (dx, dy, dz) <= (0, 0, 0) or abs(dx) + abs(dy) + abs(dz) > reach:
                                continue
                            u, v, w = x + dx, y + dy, z + dz
                            if u >= nx or v < 0 or v >= ny or w < 0 or w >= nz or vol[u, v, w] != lab:
                                continue
                            b = (u * ny + v) * nz + w
                            ra, rb = a, b
                            while parent[ra] != ra:
                                parent[ra] = parent[parent[ra]]
                                ra = parent[ra]
                            while parent[rb] != rb:
                                parent[rb] = parent[parent[rb]]
                                rb = parent[rb]
                            if ra != rb:
                                parent[max(ra, rb)] = min(ra, rb)
    for i in range(parent.size):
        r = i
        while parent[r] != r:
            r = parent[r]
        parent[i] = r
    return parent


def _mesh_pieces(m) -> int:
    """Connected pieces of a welded mesh (faces sharing vertices)."""
    parent = np.arange(len(m.vertices))

    def find(a):
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for a, b, c in m.faces.tolist():
        ra, rb, rc = find(a), find(b), find(c)
        parent[rb] = ra
        parent[find(rc)] = ra
    return len({find(int(v)) for v in np.unique(m.faces)})


def quality(ds, dest: Path, scale: int) -> list:
    """Per body at ``scale``: is it one 18-connected piece there, and does cloud-volume's answer (its
    fragments welded where they meet) make one watertight piece whose volume is within 15 % of its
    voxels? Returns the table's cells."""
    from cloudvolume import CloudVolume

    from dvidshards.formats import mesh as M
    from tests.support import watertight as W

    vol = ds.read([[0, 0, 0], list(ds.scale(scale).size)], scale=scale)
    res = np.asarray(ds.scale(scale).resolution, np.float64)
    roots = _components(np.ascontiguousarray(vol), 2).reshape(vol.shape)
    roots26 = _components(np.ascontiguousarray(vol), 3).reshape(vol.shape)
    cv = CloudVolume(f"file://{dest}", progress=False)
    ids = [int(b) for b in np.unique(vol[vol != 0])]
    connected = connected26 = good = good_connected = 0
    ratios = []
    for b in ids:
        mask = vol == b
        one = len(np.unique(roots[mask])) == 1
        connected26 += len(np.unique(roots26[mask])) == 1
        got = cv.mesh.get(b)
        m = got[b] if isinstance(got, dict) else got
        w = M.merge_fragments([M.Mesh(m.vertices, m.faces)])
        ratio = W.enclosed_volume(w.vertices, w.faces) / (mask.sum() * res.prod())
        ok = len(w.faces) > 0 and W.is_watertight(w.vertices, w.faces) and _mesh_pieces(w) == 1 and abs(ratio - 1) < 0.15
        connected += one
        good += ok
        good_connected += ok and one
        ratios.append(ratio)
    return [len(ids), f"{connected} ({connected26})", good, f"{good_connected} of {connected}",
            f"{np.median(ratios):.3f}"]


def _sample_ids(ds, n: int = 10) -> list[int]:
    s = ds.scale(0)
    t = ds.shard(s, ds.shards(0)[0]).table()
    from dvidshards.formats.records import list_values

    vals, _ = list_values(t, "labels")
    u = np.unique(vals)
    u = u[u != 0]
    return [int(v) for v in u[:: max(1, len(u) // n)][:n]]


def _big_body(ds) -> tuple[int, int]:
    """A body spanning at least 8 chunks (the one with the most chunks of the first shard)."""
    from dvidshards.formats.records import list_values

    t = ds.shard(0, ds.shards(0)[0]).table()
    vals, _ = list_values(t, "labels")
    u, c = np.unique(vals[vals != 0], return_counts=True)
    b = int(u[np.argmax(c)])
    n = len(Body(ds, b).chunks)
    assert n >= 8, n
    return b, n


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
