"""Skeletons of every body: ``dvidshards skeletons`` vs igneous' skeleton forge + merge, and kimimaro whole-volume.

Data, each at 32 nm (the default skeleton scale, s2 of mCNS):

* **neurons**: ``neuron_volume`` bodies as thin as mCNS neurites at 32 nm (radius 3-8 voxels), 1024 x
  1024 x 128 voxels (``--quick``: 512 x 512 x 64), written as an export whose s0 is 32 nm;
* **real**: the real mCNS shard (s1, 16 nm) with s2 made by ``downsample`` (the job does it itself).

Both get a precomputed twin holding the same labels at 32 nm (cloud-volume, raw), which igneous reads.

Measured, serially, CPU seconds of the process doing the work (this one, or igneous' own):

* ``dvidshards skeletons`` (default blocks of 256³, one voxel of overlap): bodies per core-second;
* kimimaro on the whole volume at once (``parallel=1``, the same TEASAR parameters, dust 1000);
* igneous (``igneous-pipeline`` in a venv of its own, ``--igneous-python``: ``python -m venv
  /work/venv-igneous && /work/venv-igneous/bin/pip install igneous-pipeline``):
  ``create_skeletonizing_tasks(mip=0, sharded=True)`` (512³ cutouts, the same TEASAR parameters, dust
  1000) then ``create_sharded_skeleton_merge_tasks`` (no tick removal, so that cable lengths compare),
  through ``LocalTaskQueue(parallel=1)``, on the twin (the conversion igneous needs first is not
  counted);
* the ratios of bodies per core-second against both, in the same process and run;
* quality per body against kimimaro on the whole body (the whole volume at once, 0 outside it):
  total cable, the share of bodies within 10 %, and trees == 26-connected pieces (of >= 1000 voxels);
* the job's peak memory in a fresh process (serial: one task at a time), over its baseline.

Run: ``.venv/bin/python benchmarks/bench_skeletons.py [--quick] [--igneous-python PATH]``.
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
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
from common import table

import dvidshards
from dvidshards.jobs.skeletons import DUST, SkeletonOutput, skeletons

TEASAR = {"scale": 4, "const": 500}

IGNEOUS = """
import json, resource, sys, time
from taskqueue import LocalTaskQueue
import igneous.task_creation as tc
from cloudvolume import CloudVolume
path = sys.argv[1]
tq = LocalTaskQueue(parallel=1, progress=False)
cpu = lambda r: r.ru_utime + r.ru_stime
c0 = resource.getrusage(resource.RUSAGE_SELF)
tq.insert(tc.create_skeletonizing_tasks(path, mip=0, shape=(512, 512, 512), sharded=True, dust_threshold=1000,
                                        teasar_params={"scale": 4, "const": 500}, fill_missing=True))
tq.execute(progress=False)
c1 = resource.getrusage(resource.RUSAGE_SELF)
tq.insert(tc.create_sharded_skeleton_merge_tasks(path, dust_threshold=0, tick_threshold=0))
tq.execute(progress=False)
c2 = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"forge_cpu": cpu(c1) - cpu(c0), "merge_cpu": cpu(c2) - cpu(c1), "peak_rss": c2.ru_maxrss * 1024}))
"""

PEAK = """
import json, resource, sys, threading
import dvidshards
from dvidshards.jobs.skeletons import skeletons

def status():
    return int(next(line for line in open("/proc/self/status") if line.startswith("VmRSS")).split()[1]) * 1024

ds = dvidshards.Dataset(sys.argv[1], spec=json.loads(open(sys.argv[2]).read()))
import kimimaro, cc3d, fastremap  # libraries loaded: the baseline of a worker
base = status()
peak = [base]
done = threading.Event()

def watch():
    while not done.wait(0.02):
        peak[0] = max(peak[0], status())

threading.Thread(target=watch, daemon=True).start()
rep = skeletons(ds, sys.argv[3], scheduler="serial", progress=False)
done.set()
print(json.dumps({"ok": rep.ok, "base": base, "peak": peak[0]}))
"""


def cpu_now() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def neurons(work: Path, shape) -> tuple[dvidshards.Dataset, np.ndarray]:
    """An export whose s0 is 32 nm, and its labels (x, y, z)."""
    from dvidshards.demo.neurons import neuron_volume
    from dvidshards.formats.mapping import LabelMapping
    from dvidshards.writer import write_export

    sv, mapping = neuron_volume(shape, n_bodies=max(20, shape[0] // 12), svs_per_body=2, seed=4)
    spec = write_export(np.array(sv), work / "neurons", mapping=mapping, resolution=(32, 32, 32))
    return dvidshards.Dataset(work / "neurons", spec=spec), LabelMapping.from_any(mapping)(np.array(sv))


def real(work: Path, data: Path) -> tuple[dvidshards.Dataset, np.ndarray, np.ndarray]:
    """The real shard as s1 of an export (the job makes s2), and its s2 labels with their voxel origin."""
    from dvidshards.jobs.downsample import downsample

    root = common.real_export(work, data)
    spec = common.mcns_spec(data)
    ds = dvidshards.Dataset(root, spec=spec)
    downsample(ds, work / "real-s2", scales=[2], progress=False)
    s2 = ds.with_scales(str(work / "real-s2"), [2])
    c = s2.chunks(2)
    lo, hi = c.min(axis=0) * 64, (c.max(axis=0) + 1) * 64
    return ds, s2.read([lo.tolist(), hi.tolist()], scale=2), lo


def twin(labels: np.ndarray, path: Path) -> None:
    """The same labels as a precomputed volume at 32 nm (what igneous reads)."""
    from cloudvolume import CloudVolume

    info = CloudVolume.create_new_info(num_channels=1, layer_type="segmentation", data_type="uint64", encoding="raw",
                                       resolution=[32, 32, 32], voxel_offset=[0, 0, 0], chunk_size=[64, 64, 64],
                                       volume_size=list(labels.shape))
    cv = CloudVolume(f"file://{path}", info=info, progress=False)
    cv.commit_info()
    cv[:, :, :] = labels


def igneous(python: str, labels: np.ndarray, work: Path) -> dict | None:
    if not python or not Path(python).exists():
        return None
    path = work / "igneous"
    shutil.rmtree(path, ignore_errors=True)
    twin(labels, path)
    script = work / "igneous_run.py"
    script.write_text(IGNEOUS)
    r = subprocess.run([python, str(script), f"file://{path}"], capture_output=True, text=True)
    if r.returncode:
        print(r.stderr[-3000:], file=sys.stderr)
        return None
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["path"] = path
    return out


def whole(labels: np.ndarray) -> tuple[dict, float]:
    import kimimaro

    vol = np.asfortranarray(np.pad(labels, 1))  # 0 outside the volume, as the job reads it
    c0 = cpu_now()
    got = kimimaro.skeletonize(vol, teasar_params=TEASAR, anisotropy=(32, 32, 32), dust_threshold=DUST,
                               progress=False, parallel=1)
    cpu = cpu_now() - c0
    for s in got.values():
        s.vertices -= np.float32(32)
    return got, cpu


def quality(labels: np.ndarray, get, ref: dict) -> list:
    """[bodies, total cable / kimimaro's, bodies within 10 %, bodies whose trees are their pieces]."""
    import cc3d

    rel, good, ours, theirs = [], 0, 0.0, 0.0
    for b, w in ref.items():
        sk = get(b)
        if sk is None:
            rel.append(-1.0)
            continue
        v, e = sk
        d = v[e[:, 0]] - v[e[:, 1]]
        cable = float(np.sqrt((d.astype(np.float64) ** 2).sum(axis=1)).sum())
        rel.append(cable / w.cable_length() - 1)
        ours, theirs = ours + cable, theirs + w.cable_length()
        mask = labels == b
        cc = cc3d.connected_components(mask, connectivity=26)
        vox = np.clip(np.floor(v / 32).astype(int), 0, np.asarray(labels.shape) - 1)
        piece = cc[tuple(vox.T)]
        from scipy.sparse import coo_matrix
        from scipy.sparse.csgraph import connected_components

        k, comp = connected_components(coo_matrix((np.ones(len(e)), (e[:, 0], e[:, 1])), shape=(len(v),) * 2),
                                       directed=False)
        big = set(np.flatnonzero(np.bincount(cc.reshape(-1)) > DUST).tolist()) - {0}  # kimimaro: over dust
        one = all(len(np.unique(piece[comp == t])) == 1 for t in range(k))
        good += int(one and big <= set(piece.tolist()) and len(set(piece.tolist())) == k)
    r = np.asarray(rel)
    return [len(ref), f"{ours / max(theirs, 1e-9):.3f}", f"{(np.abs(r) <= 0.1).mean():.0%}", f"{good}/{len(ref)}"]


def ours_get(dest: Path, origin):
    reader = SkeletonOutput(dest)

    def get(b):
        sk = reader.get(b)
        return None if sk is None else (sk.vertices - np.asarray(origin, np.float32) * 32, sk.edges)

    return get


def igneous_get(path: Path):
    from cloudvolume import CloudVolume

    cv = CloudVolume(f"file://{path}", progress=False)

    def get(b):
        try:
            s = cv.skeleton.get(int(b))
        except Exception:  # noqa: BLE001 - a body igneous wrote no skeleton for
            return None
        return (s.vertices, s.edges) if len(s.vertices) else None

    return get


def peak(ds: dvidshards.Dataset, work: Path) -> float:
    """The job's peak resident memory over its baseline, in a fresh process (MiB)."""
    script, spec = work / "peak_run.py", work / "spec.json"
    script.write_text(PEAK)
    spec.write_text(json.dumps(ds.spec))
    shutil.rmtree(work / "peak", ignore_errors=True)
    shutil.rmtree(work / "peak.work", ignore_errors=True)
    r = subprocess.run([sys.executable, str(script), str(ds.store.local_path()), str(spec), str(work / "peak")],
                       capture_output=True, text=True, cwd=str(common.ROOT))
    if r.returncode:
        raise RuntimeError(f"the fresh-process run failed:\n{r.stderr[-3000:]}")
    got = json.loads(r.stdout.strip().splitlines()[-1])
    return (got["peak"] - got["base"]) / common.MIB


def run(name: str, ds, labels: np.ndarray, origin, work: Path, args, rows: list, qrows: list) -> None:
    dest = work / f"ours-{name}"
    skeletons(ds, work / f"warm-{name}", scheduler="serial", progress=False)  # kernels and libraries loaded
    c0, t0 = cpu_now(), time.perf_counter()
    rep = skeletons(ds, dest, scheduler="serial", progress=False)
    cpu, wall = cpu_now() - c0, time.perf_counter() - t0
    assert rep.ok, rep.summary()
    ref, kcpu = whole(labels)
    n = rep.totals["bodies"]
    ig = igneous(args.igneous_python, labels, work)
    rows.append([name, "dvidshards skeletons", n, f"{cpu:.1f}", f"{n / cpu:.2f}", "1.00", f"wall {wall:.1f} s"])
    rows.append([name, "kimimaro, whole volume", len(ref), f"{kcpu:.1f}", f"{len(ref) / kcpu:.2f}",
                 f"{(n / cpu) / (len(ref) / kcpu):.2f}", "one call, parallel=1"])
    qrows.append([name, "dvidshards skeletons", *quality(labels, ours_get(dest, origin), ref)])
    if ig is not None:
        icpu = ig["forge_cpu"] + ig["merge_cpu"]
        rows.append([name, "igneous forge + merge (512³ tasks)", len(ref), f"{icpu:.1f}", f"{len(ref) / icpu:.2f}",
                     f"{(n / cpu) / (len(ref) / icpu):.2f}",
                     f"forge {ig['forge_cpu']:.1f} + merge {ig['merge_cpu']:.1f}; peak {ig['peak_rss'] / common.MIB:.0f} MiB"])
        qrows.append([name, "igneous", *quality(labels, igneous_get(ig["path"]), ref)])
    else:
        rows.append([name, "igneous", "-", "-", "-", "-", "not run (no --igneous-python venv)"])
    if not args.no_peak and ds.store.local_path() is not None:
        rows.append([name, "dvidshards skeletons, fresh process", n, "-", "-", "-",
                     f"peak {peak(ds, work):.0f} MiB over its baseline"])


def main() -> None:
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--igneous-python", default="/work/venv-igneous/bin/python",
                   help="python of a venv with igneous-pipeline installed (skipped when absent)")
    p.add_argument("--no-peak", action="store_true", help="skip the fresh-process memory run")
    args = p.parse_args()
    common.header("bench_skeletons: dvidshards skeletons vs igneous skeleton forge + merge and kimimaro whole-volume")
    os.environ.setdefault("DVIDSHARDS_KERNELS", "compiled")
    work = Path(tempfile.mkdtemp(prefix="bench-skeletons-", dir=args.workdir if args.workdir.exists() else None))
    rows: list = []
    qrows: list = []
    try:
        ds, labels = neurons(work, (512, 512, 64) if args.quick else (1024, 1024, 128))
        run("neurons", ds, labels, (0, 0, 0), work, args, rows, qrows)
        if not args.quick and (args.data / f"{common.REAL_SHARD}.arrow").exists():
            rds, rlabels, lo = real(work, args.data)
            run("real mCNS shard", rds, rlabels, lo, work, args, rows, qrows)
        table(["data", "run", "bodies", "CPU s", "bodies per core-s", "ours / this (per core-s)", "notes"], rows,
              title="Cost (serial; the ratio is ours over the row's, goal >= 1.5 against igneous)")
        table(["data", "output", "bodies", "total cable / kimimaro's", "bodies within 10 %", "trees == pieces"],
              qrows, title="Quality per body against kimimaro on each whole body (the whole volume, 0 outside)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
