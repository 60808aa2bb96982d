"""Converting an export to neuroglancer precomputed / zarr v3 (issue 17): dvidshards vs peers.

Run from the project root::

    python benchmarks/bench_convert.py [--quick] [--workdir DIR] [--data DIR]
    python benchmarks/bench_convert.py --issue22 [dense,first,schedulers,plan] [--quick]

``--issue22`` runs the sections of issue 22 instead (no real data needed), each measurement in
a fresh Python process:

* ``dense``: a dense 32,768-chunk s0 shard of the procedural mCNS export
  (`tests.support.procedural`), raw chunk data, converted with the export's own geometry:
  peak RSS of the route every destination takes (the shard streamed into the store's writer: a
  local file built on disk; a bucket's object assembled in memory);
* ``first``: the first task of a fresh worker with an empty ``NUMBA_CACHE_DIR``: the transcode
  kernel compiled in the caller's thread before any chunk (``DVIDSHARDS_KERNELS=compiled``,
  what every worker did before) against the default (numpy fallback while numba compiles in the
  background);
* ``schedulers``: wall time of a whole convert of a synthetic export of a few dozen shards with
  ``--scheduler serial``, the default (``auto``) and ``local:2``;
* ``plan``: all 12 scales of the procedural mCNS export planned and submitted (serially, and
  with the default scheduler), a random sample of s0 tasks executed, the others returning at
  once: client peak RSS, planning time, tasks, bytes per pickled task, overhead per task, and
  the projected core-hours of mCNS from the sample's CPU per chunk.

Data (built once in the work directory; blocks of the real mCNS shard reused cyclically for the
large shards, geometry of mCNS scale 1):

* ``real``: the real mCNS shard, 258 chunks;
* ``syn512``: a 512³ synthetic neuron-like export (one shard of 512 chunks);
* ``1024``, ``16384``, ``32768``: one shard of that many chunks.

First, the transcoder alone: CPU µs per chunk of ``transcode_u8`` on the 258 real blocks (both
label modes) against ``decode_block`` and ``decode_block`` + TensorStore's encoder (bytes checked
equal first). ``--transcode-only`` stops there.

Every measurement runs in a fresh Python process, serially, one after the other. The process
first does the same job on the real shard, untimed (first-use costs of TensorStore's drivers,
numba's cache and zlib, 0.1-0.4 s, are paid once per worker, not per shard); then CPU is the
process's user + system time (all threads) and peak RSS the kernel's high-water mark (reset
before the timed job). Variants:

* ``dvidshards``: ``dvidshards.jobs.convert.convert`` in the process (scheduler None), precomputed
  with gzip chunk data (level 1, the default) or raw, or zarr3;
* ``dvidshards, TS encoder``: ``encoder="tensorstore"`` (decode + TensorStore's encoder);
* ``commit-every-100 loop``: tensorstore-export's way, written here from its description (its
  reader is not a dependency): the whole shard loaded in memory with pyarrow, then per chunk
  zstd-decompress, decode (dvidshards' decoder), transpose, write through TensorStore's
  ``neuroglancer_precomputed`` driver inside a ``ts.Transaction`` committed every 100 chunks.
  Its output uses the export's spec as given (raw chunk data, as tensorstore-export writes);
* ``floor``: zstd-decompress every record and write its already-encoded chunk (computed before
  the clock starts) through the same staged route, one kvstore transaction per shard, with the
  same gzip (or raw) as the pipeline; no encode;
* ``TS staged from memory`` (zarr3): the voxels already decoded in memory, each chunk encoded
  by TensorStore (unsharded in-memory array) and written through ``zarr3_sharding_indexed``
  in one transaction per shard.
"""

from __future__ import annotations

import argparse
import itertools
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common as C

CHUNKS_MCNS = 587_000_000
PEER_CORE_HOURS = 1015
SHARD = (30720, 24576, 28672)  # the real shard's origin (mCNS scale 1)


# --------------------------------------------------------------------------- data sets


def slab_export(workdir: Path, data: Path, n: int, log=print) -> Path:
    """One mCNS-scale-1 shard holding the first n chunks (z slowest) of its 32³ box."""
    from dvidshards.writer import write_shard

    if n == 32768:
        return C.big_shard_export(workdir, data, log=log)
    params = {"kind": f"slab-{n}", "version": 1}
    folder = workdir / f"slab-{n}"
    if C._fresh(folder, params):
        return folder
    C._reset(folder)
    (folder / "s1").mkdir()
    records = C.real_records(data)
    lo = [v // C.CHUNK for v in SHARD]
    write_shard(folder / "s1" / "{}_{}_{}".format(*SHARD),
                itertools.islice(C.full_shard_records(records, lo), n))
    C._done(folder, params)
    return folder


def datasets(workdir: Path, data: Path, quick: bool) -> list[dict]:
    spec = C.mcns_spec(data)
    out = [{"name": "real", "root": str(C.real_export(workdir, data)), "spec": spec, "scale": 1}]
    pair = C.synthetic_pair(workdir, 256 if quick else 512)
    out.append({"name": f"syn{pair.shape[0]}", "root": str(pair.export), "spec": pair.spec, "scale": 0})
    for n in ((1024,) if quick else (1024, 16384, 32768)):
        out.append({"name": str(n), "root": str(slab_export(workdir, data, n)), "spec": spec, "scale": 1})
    return out


# --------------------------------------------------------------------------- children


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _warm(ds, scale) -> None:
    """Load the numba kernels (from numba's cache) before the clock starts."""
    import numpy as np

    from dvidshards.formats.codec import decode_block
    from dvidshards.formats.cseg import transcode

    t = ds.shard(scale, ds.shards(scale)[0]).table(np.arange(1))
    transcode(t.block(0), t.labels(0))
    decode_block(t.block(0), t.labels(0))


def child_dvid(d: dict, out: Path, fmt: str, data_encoding: str, encoder: str, extra: int) -> dict:
    import dvidshards
    from dvidshards.jobs.convert import convert

    ds = dvidshards.Dataset(d["root"], spec=d["spec"])
    _warm(ds, d["scale"])
    base = C.rss()
    C.reset_peak_rss()
    c0, t0 = _cpu(), time.perf_counter()
    rep = convert(ds, out, format=fmt, scales=[d["scale"]], data_encoding=data_encoding, encoder=encoder,
                  shard_bits_extra=extra, progress=False)
    assert rep.ok, rep.summary()
    return {"chunks": rep.totals.written, "cpu": _cpu() - c0, "wall": time.perf_counter() - t0,
            "base": base, "peak": C.peak_rss(), "bytes": C._du(out), "shards": rep.totals.shards_written}


def child_loop(d: dict, out: Path) -> dict:
    """tensorstore-export's worker: whole shard in memory, commit every 100 chunks."""
    import numpy as np
    import pyarrow as pa
    import tensorstore as ts
    import zstandard

    from dvidshards.formats.codec import decode_block

    sc = d["spec"]["scales"][d["scale"]]
    spec = C.precomputed_spec(out, sc)  # the export's sharding, raw chunk data
    folder = Path(d["root"]) / f"s{d['scale']}"
    path = next(folder.glob("*.arrow"))
    dctx = zstandard.ZstdDecompressor()
    with pa.OSFile(str(path)) as f:
        first = next(iter(pa.ipc.open_stream(f)))
    decode_block(dctx.decompress(first.column("dvid_compressed_block")[0].as_py()))  # numba loaded
    base = C.rss()
    C.reset_peak_rss()
    c0, t0 = _cpu(), time.perf_counter()
    with pa.OSFile(str(path)) as f:
        table = pa.ipc.open_stream(f).read_all()  # the whole shard in memory
    cols = table.to_pydict()
    store = ts.open(spec, create=True, context=C.context()).result()[ts.d["channel"][0]]
    txn = ts.Transaction()
    n = 0
    for i in range(table.num_rows):
        block = dctx.decompress(cols["dvid_compressed_block"][i])
        vol = decode_block(block, np.asarray(cols["labels"][i], np.uint64))
        x, y, z = (64 * cols[k][i] for k in ("chunk_x", "chunk_y", "chunk_z"))
        store.with_transaction(txn)[x:x + 64, y:y + 64, z:z + 64].write(vol.transpose(2, 1, 0)).result()
        n += 1
        if n % 100 == 0:
            txn.commit_async().result()
            txn = ts.Transaction()
    txn.commit_async().result()
    return {"chunks": n, "cpu": _cpu() - c0, "wall": time.perf_counter() - t0, "base": base,
            "peak": C.peak_rss(), "bytes": C._du(out)}


def _encoded(d: dict, ds, plan):
    """Each record's final chunk bytes, computed before the clock (distinct payloads once)."""
    from dvidshards.formats.cseg import transcode

    cache, out = {}, []
    for o in ds.shards(d["scale"]):
        t = ds.shard(d["scale"], o).table()
        for i in range(len(t)):
            p = bytes(t.payload(i))
            if p not in cache:
                cache[p] = transcode(t.block(i), t.labels(i))
            out.append(cache[p])
    return out


def child_floor(d: dict, out: Path, data_encoding: str, ts_gzip: bool = False) -> dict:
    """zstd decompression + the staged kvstore write of already-encoded chunks, no encode."""
    import gzip
    import struct

    import numpy as np
    import tensorstore as ts
    import zstandard

    import dvidshards
    from dvidshards.formats.sharding import compressed_morton_code
    from dvidshards.jobs.layouts import scale_layout

    ds = dvidshards.Dataset(d["root"], spec=d["spec"])
    plan = scale_layout(ds.scale(d["scale"]), format="precomputed", data_encoding=data_encoding)
    encoded = _encoded(d, ds, plan)
    meta = dict(plan.sharding) if ts_gzip else {**plan.sharding, "data_encoding": "raw"}
    gz = data_encoding == "gzip" and not ts_gzip
    dctx = zstandard.ZstdDecompressor()
    base = C.rss()
    C.reset_peak_rss()
    c0, t0 = _cpu(), time.perf_counter()
    kv = ts.KvStore.open({"driver": "neuroglancer_uint64_sharded", "base": f"file://{out}/{plan.key}/",
                          "metadata": meta}, context=C.context()).result()
    n = 0
    for o in ds.shards(d["scale"]):
        t = ds.shard(d["scale"], o).table()
        keys = np.atleast_1d(compressed_morton_code(t.coords - plan.chunk_offset, plan.grid))
        txn = ts.Transaction()
        kvt = kv.with_transaction(txn)
        for i in range(len(t)):
            dctx.decompress(t.payload(i))
            v = encoded[n]
            kvt.write(struct.pack(">Q", int(keys[i])), gzip.compress(v, 1, mtime=0) if gz else v)
            n += 1
        txn.commit_async().result()
    return {"chunks": n, "cpu": _cpu() - c0, "wall": time.perf_counter() - t0, "base": base,
            "peak": C.peak_rss(), "bytes": C._du(out)}


def child_zarr_ts(d: dict, out: Path) -> dict:
    """TensorStore writing the same voxels from memory by the staged route (zarr3)."""
    import struct

    import numpy as np
    import tensorstore as ts

    import dvidshards
    from dvidshards.formats.codec import decode_block
    from dvidshards.jobs.layouts import ZARR_INDEX_CODECS, Stager, create_output, scale_layout
    from dvidshards.stores import as_store

    ds = dvidshards.Dataset(d["root"], spec=d["spec"])
    plan = scale_layout(ds.scale(d["scale"]), format="zarr3")
    ctx = C.context()
    vols, cache = [], {}
    for o in ds.shards(d["scale"]):
        t = ds.shard(d["scale"], o).table()
        for i in range(len(t)):
            p = bytes(t.payload(i))
            if p not in cache:
                cache[p] = decode_block(t.block(i), t.labels(i))
            vols.append((o, t.coords[i] - plan.chunk_offset, cache[p]))
    store = as_store(out, writable=True)
    kvj = store.kvstore_spec()
    create_output(store, "zarr3", [plan], ctx)
    stager = Stager("zarr3", plan, ctx)
    stager.encode(vols[0][1], vols[0][2])
    base = C.rss()
    C.reset_peak_rss()
    c0, t0 = _cpu(), time.perf_counter()
    by_shard: dict = {}
    for _o, rel, vol in vols:
        by_shard.setdefault(tuple((rel // plan.shard_chunks).tolist()), []).append((rel, vol))
    n = 0
    for sh, items in by_shard.items():
        kv = ts.KvStore.open({"driver": "zarr3_sharding_indexed",
                              "base": {**kvj, "path": kvj["path"] + "{}/c/{}/{}/{}".format(plan.key, *sh)},
                              "grid_shape": list(plan.shard_chunks), "index_codecs": ZARR_INDEX_CODECS,
                              "index_location": "end"}, context=ctx).result()
        txn = ts.Transaction()
        kvt = kv.with_transaction(txn)
        for rel, vol in items:
            enc = stager.encode(rel, vol)
            kvt.write(struct.pack(">III", *(int(v) for v in np.asarray(rel) % plan.shard_chunks)), enc)
            n += 1
        txn.commit_async().result()
    return {"chunks": n, "cpu": _cpu() - c0, "wall": time.perf_counter() - t0, "base": base,
            "peak": C.peak_rss(), "bytes": C._du(out)}


def child(args: list[str]) -> None:
    kind, dj, out = args[0], json.loads(args[1]), Path(args[2])
    opts, warm = json.loads(args[3]), json.loads(args[4])
    fn = {"dvid": child_dvid, "loop": child_loop, "floor": child_floor, "zarr_ts": child_zarr_ts}[kind]
    # the same job on the real shard first, untimed: first-use costs (TensorStore drivers, numba
    # and zlib initialisation, ~0.1-0.4 s) are paid once per worker, not per shard
    fn(warm, out.with_name(out.name + "-warm"), **opts)
    shutil.rmtree(out.with_name(out.name + "-warm"), ignore_errors=True)
    print(json.dumps(fn(dj, out, **opts)))


def run(kind: str, d: dict, workdir: Path, warm: dict, **opts) -> dict:
    out = Path(tempfile.mkdtemp(prefix="conv-out-", dir=workdir))
    shutil.rmtree(out)
    try:
        cmd = [sys.executable, __file__, "--child", kind, json.dumps(d), str(out), json.dumps(opts), json.dumps(warm)]
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if r.returncode:
            raise SystemExit(f"child failed: {kind} {d['name']} {opts}\n{r.stderr[-3000:]}")
        return json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(out.with_name(out.name + "-warm"), ignore_errors=True)


# --------------------------------------------------------------------------- issue 22


def _dense_origin(store):
    origins = store.shard_origins(0)
    return next(o for o in origins[len(origins) // 2:] if len(store.shard_chunks(0, o)) == 32768)


def i22_child(kind: str, opts: dict) -> dict:
    """One issue-22 measurement, in this (fresh) process."""
    import pickle
    import random

    import dvidshards
    from dvidshards.jobs.convert import Job, convert, plan, run_task
    from dvidshards.jobs.layouts import scale_layout
    from dvidshards.stores import as_store
    from tests.support.procedural import ProceduralStore

    t0, c0 = time.perf_counter(), _cpu()
    out = opts["out"]
    if kind == "dense":
        store = ProceduralStore()
        ds = dvidshards.Dataset(store, spec=store.spec)
        o = _dense_origin(store)
        t0, c0 = time.perf_counter(), _cpu()
        rep = convert(ds, out, format="precomputed", scales=[0], data_encoding="raw", scheduler="serial",
                      progress=False, _only={(0, tuple(o))})
        return {"wall": time.perf_counter() - t0, "cpu": _cpu() - c0, "peak": C.peak_rss(),
                "chunks": rep.totals.written, "bytes": rep.totals.encoded_bytes, "ok": rep.ok}
    if kind == "first":
        spec = json.loads(Path(opts["spec"]).read_text())
        ds = dvidshards.Dataset(opts["export"], spec=spec)
        t1 = time.perf_counter()
        rep = convert(ds, out, format="precomputed", scales=[0], scheduler="serial", progress=False, _stop_after=1,
                      allow_partial=True)
        return {"import_open": t1 - t0, "first_task": time.perf_counter() - t1, "cpu": _cpu() - c0,
                "peak": C.peak_rss(), "chunks": rep.totals.written, "ok": rep.ok}
    if kind == "schedulers":
        spec = json.loads(Path(opts["spec"]).read_text())
        rep = convert(opts["export"], out, format="precomputed", spec=spec, scheduler=opts["scheduler"],
                      progress=False)
        return {"wall": time.perf_counter() - t0, "cpu": _cpu() - c0, "tasks": rep.tasks, "ok": rep.ok,
                "task_cpu": rep.totals.cpu_s}
    if kind == "plan":
        store = ProceduralStore()
        ds = dvidshards.Dataset(store, spec=store.spec)
        plans = {s.index: scale_layout(s, format="precomputed") for s in ds.scales}
        job = Job(ds, as_store(out, writable=True), "precomputed", "agglomerated")
        tasks = list(plan(ds, plans, job=job))
        items = [t.key for t in tasks]
        t_plan = time.perf_counter() - t0
        rng = random.Random(opts["seed"])
        s0 = [it for it in items if it[0] == 0]
        sample = set(rng.sample(s0, opts["sample"]))  # empty: every task returns at once
        task_bytes = len(pickle.dumps((run_task, tasks[0])))
        t1 = time.perf_counter()
        rep = convert(ds, out, format="precomputed", scheduler=opts["scheduler"], progress=False, _only=sample,
                      allow_partial=True)
        # _only=set(): nothing executes; the peak is the client's own (plan, submit, results)
        wall = time.perf_counter() - t1
        chunks_by_scale = {}
        for k in plans:
            origins = [it for it in items if it[0] == k]
            pick = rng.sample(origins, min(len(origins), 200))
            chunks_by_scale[k] = len(origins) * sum(len(store.shard_chunks(k, o)) for _, o in pick) / len(pick)
        return {"plan": t_plan, "tasks": len(items), "task_bytes": task_bytes, "run_wall": wall,
                "sample": len(sample), "sample_wall": rep.totals.wall_s, "sample_cpu": rep.totals.cpu_s,
                "sample_records": rep.totals.records, "sample_written": rep.totals.written,
                "worker_peak": rep.totals.max_rss_mib, "peak": C.peak_rss(), "ok": rep.ok,
                "chunks_total": sum(chunks_by_scale.values()), "chunks_s0": chunks_by_scale[0]}
    raise SystemExit(f"unknown issue-22 measurement {kind}")


def i22_run(kind: str, opts: dict, env: dict | None = None) -> dict:
    import os

    cmd = [sys.executable, __file__, "--i22-child", kind, json.dumps(opts)]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False, env={**os.environ, **(env or {})})
    shutil.rmtree(opts["out"], ignore_errors=True)
    if r.returncode:
        raise SystemExit(f"child failed: {kind} {opts}\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def issue22(args, sections: list[str]) -> None:
    import os

    work = args.workdir / "issue22"
    work.mkdir(parents=True, exist_ok=True)
    C.header("dvidshards convert at mCNS scale (issue 22 items 5, 6, 7 and 2)")

    def out():
        d = Path(tempfile.mkdtemp(prefix="out-", dir=work))
        shutil.rmtree(d)
        return str(d)

    def export(name, shape, scales, shard_chunks):
        from dvidshards.demo.neurons import neuron_volume
        from dvidshards.writer import write_export

        root = work / name
        spec = work / f"{name}.spec.json"
        if not spec.exists():
            shutil.rmtree(root, ignore_errors=True)
            sv, mapping = neuron_volume(shape, n_bodies=40, svs_per_body=4, seed=3)
            spec.write_text(json.dumps(write_export(sv, root, mapping=mapping, scales=scales,
                                                    shard_chunks=shard_chunks)))
        return str(root), str(spec)

    if "dense" in sections:
        rows = []
        r = i22_run("dense", {"out": out()})
        rows.append(["streamed into the store's writer", r["chunks"], f"{r['bytes'] / C.MIB:.0f}",
                     f"{r['peak'] / C.MIB:.0f}", f"{r['wall']:.1f}", f"{1e3 * r['cpu'] / r['chunks']:.3f}",
                     C.verdict(r["peak"] <= C.GIB)])
        C.table(["route", "chunks", "output MiB", "peak RSS MiB", "wall s", "CPU ms/chunk", "<= 1 GiB"], rows,
                "Dense 32,768-chunk shard, raw chunk data, export's geometry (fresh process each)")
    if "first" in sections:
        root, spec = export("first", (512, 512, 320), 1, 4)
        rows = []
        for label, mode in (("compile, then convert (before: DVIDSHARDS_KERNELS=compiled)", "compiled"),
                            ("default: numpy fallback while numba compiles", "background")):
            for trial in range(1 if args.quick else 2):
                cache = Path(tempfile.mkdtemp(prefix="numba-", dir=work))
                r = i22_run("first", {"out": out(), "export": root, "spec": spec},
                            {"NUMBA_CACHE_DIR": str(cache), "DVIDSHARDS_KERNELS": mode})
                shutil.rmtree(cache, ignore_errors=True)
                rows.append([label, trial + 1, r["chunks"], f"{r['import_open']:.2f}", f"{r['first_task']:.2f}",
                             f"{r['cpu']:.1f}", f"{r['peak'] / C.MIB:.0f}"])
        C.table(["first task of a fresh worker, empty NUMBA_CACHE_DIR", "trial", "chunks", "import+open s",
                 "first task s", "process CPU s", "peak RSS MiB"], rows)
    if "schedulers" in sections:
        root, spec = export("sched", (512, 384, 320), 2, 2)
        nshards = sum(1 for _ in Path(root).rglob("*.arrow"))
        res = {}
        for sched in ("serial", None, "local:2"):
            walls = [i22_run("schedulers", {"out": out(), "export": root, "spec": spec, "scheduler": sched})["wall"]
                     for _ in range(1 if args.quick else 3)]
            res[sched] = min(walls)
        rows = [[s or "default (auto)", f"{w:.2f}", f"{w / res['serial']:.2f}x",
                 C.verdict(w <= 1.5 * res["serial"]) if s != "local:2" else ""] for s, w in res.items()]
        C.table(["--scheduler", "wall s (best)", "/ serial", "<= 1.5x serial"], rows,
                f"Whole convert of a {nshards}-shard synthetic export, precomputed (fresh process each, "
                f"{os.cpu_count()} cores)")
    if "plan" in sections:
        rows = []
        proj = []
        n = 3 if args.quick else 10
        for sched, sample in (("serial", 0), ("serial", n), (None, n)):
            r = i22_run("plan", {"out": out(), "scheduler": sched, "sample": sample, "seed": 1})
            # per-task overhead: serially, the run's wall less the executed tasks' (threads overlap them)
            over = (r["run_wall"] - r["sample_wall"]) / max(1, r["tasks"] - r["sample"])
            rows.append([sched or "default (auto)", r["tasks"], f"{r['plan']:.1f}", f"{r['run_wall']:.1f}",
                         f"{r['peak'] / C.MIB:.0f}", r["task_bytes"],
                         f"{1e3 * over:.3f}" if sched == "serial" else "(overlapping)", r["sample"],
                         f"{r['worker_peak']:.0f}" if sample else "-",
                         C.verdict(r["peak"] <= 2 * C.GIB and r["plan"] <= 120)])
            if sample and sched == "serial":  # process CPU: with threads it counts the other task too
                cpc = r["sample_cpu"] / max(1, r["sample_records"])
                proj.append([r["sample_records"], f"{1e3 * cpc:.3f}", f"{r['chunks_s0'] / 1e6:.0f} M",
                             f"{r['chunks_total'] / 1e6:.0f} M", f"{r['chunks_total'] * cpc / 3600:.0f}",
                             f"{CHUNKS_MCNS * cpc / 3600:.0f}"])
        C.table(["scheduler", "tasks (12 scales)", "planning s", "submit+run s", "client peak RSS MiB",
                 "bytes per pickled task", "overhead ms per task", "tasks executed", "worker peak MiB",
                 "peak <= 2 GiB, plan <= 2 min"], rows, "Procedural mCNS export, all 12 scales: plan and submit "
                                                         "every task, execute a random sample of s0 shards "
                                                         "(0: the client alone)")
        C.table(["chunks in sample", "CPU ms per chunk", "chunks s0 (est.)", "chunks, 12 scales (est.)",
                 "projected core-hours", f"core-hours at mCNS's {CHUNKS_MCNS / 1e6:.0f} M chunks"], proj,
                "Projection (serial sample of procedural s0 shards, raw transcode + gzip level 1)")


# --------------------------------------------------------------------------- the transcoder alone


def transcode_section(data: Path, rounds: int) -> None:
    """µs of CPU per 64³ chunk: transcode vs decode_block (+ TensorStore's encoder), real blocks."""
    import numpy as np
    import tensorstore as ts
    import zstandard

    from dvidshards.formats.codec import decode_block
    from dvidshards.formats.cseg import transcode_u8

    recs = C.real_records(data)
    dctx = zstandard.ZstdDecompressor()
    blocks = [np.frombuffer(dctx.decompress(r["dvid_compressed_block"]), np.uint8) for r in recs]
    pals = [np.asarray(r["labels"], np.uint64) for r in recs]
    arr = ts.open({"driver": "neuroglancer_precomputed", "kvstore": {"driver": "memory"}, "create": True,
                   "multiscale_metadata": {"type": "segmentation", "data_type": "uint64", "num_channels": 1},
                   "scale_metadata": {"size": [64, 64, 64], "resolution": [8, 8, 8], "chunk_size": [64, 64, 64],
                                      "encoding": "compressed_segmentation",
                                      "compressed_segmentation_block_size": [8, 8, 8]}},
                  context=C.context()).result()[..., 0]
    kv, key = arr.kvstore, "8_8_8/0-64_0-64_0-64"
    out = np.empty((64, 64, 64), np.uint64)

    def ts_encode(vol):
        arr.write(vol.T).result()
        v = kv.read(key).result().value
        kv.write(key, None).result()
        return v

    def dec_enc(b, p):
        return ts_encode(decode_block(b, p, out))

    assert all(transcode_u8(b, p) == dec_enc(b, p) for b, p in zip(blocks, pals, strict=True))
    fns = {
        "transcode, agglomerated": lambda: [transcode_u8(b, p) for b, p in zip(blocks, pals, strict=True)],
        "transcode, supervoxels": lambda: [transcode_u8(b, None) for b in blocks],
        "decode_block only": lambda: [decode_block(b, p, out) for b, p in zip(blocks, pals, strict=True)],
        "decode_block + TensorStore encode": lambda: [dec_enc(b, p) for b, p in zip(blocks, pals, strict=True)],
    }
    cpu: dict = {k: [] for k in fns}
    names = list(fns)
    for r in range(rounds + 1):
        for n in names[r % len(names):] + names[:r % len(names)]:
            c0 = _cpu()
            fns[n]()
            if r:
                cpu[n].append((_cpu() - c0) / len(blocks))
    base = C.med(cpu["transcode, agglomerated"])
    C.table(["per 64³ chunk (258 real blocks)", "CPU µs (median)", "CPU µs (best)", "/ transcode"],
            [[n, f"{1e6 * C.med(v):.1f}", f"{1e6 * min(v):.1f}", f"{C.med(v) / base:.1f}x"] for n, v in cpu.items()],
            f"The transcoder alone (median and best of {rounds} interleaved rounds, process CPU time; "
            f"bytes equal to TensorStore's on all 258)")


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    p = C.parser(__doc__.split("\n")[0])
    p.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    p.add_argument("--transcode-only", action="store_true", help="only the transcoder section")
    p.add_argument("--issue22", nargs="?", const="dense,first,schedulers,plan", default=None, metavar="SECTIONS",
                   help="the issue-22 sections instead (comma separated: dense, first, schedulers, plan)")
    p.add_argument("--i22-child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.child)
        return 0
    if args.i22_child:
        print(json.dumps(i22_child(args.i22_child[0], json.loads(args.i22_child[1]))))
        return 0
    if args.issue22:
        issue22(args, args.issue22.split(","))
        return 0
    data = C.require_real_data(args.data)
    args.workdir.mkdir(parents=True, exist_ok=True)
    C.header("dvidshards convert vs tensorstore-export's loop and the floor (issue 17)")
    transcode_section(data, 3 if args.quick else 15)
    if args.transcode_only:
        return 0
    sets = datasets(args.workdir, data, args.quick)
    res: dict = {}

    def m(name, label, kind, **opts):
        r = run(kind, d, args.workdir, sets[0], **opts)
        res[(name, label)] = r
        print(f"  {name:>6} {label:<34} {r['chunks']:>6} chunks  {1e3 * r['cpu'] / r['chunks']:7.3f} CPU ms/chunk"
              f"  peak {r['peak'] / C.MIB:7.0f} MiB  ({C.load_text()})", flush=True)

    for d in sets:
        name = d["name"]
        m(name, "dvidshards precomputed gzip", "dvid", fmt="precomputed", data_encoding="gzip",
          encoder="transcode", extra=0)
        m(name, "dvidshards precomputed raw", "dvid", fmt="precomputed", data_encoding="raw",
          encoder="transcode", extra=0)
        m(name, "floor gzip", "floor", data_encoding="gzip")
        m(name, "floor raw", "floor", data_encoding="raw")
        if name == "32768":
            m(name, "dvidshards precomputed gzip, extra 2", "dvid", fmt="precomputed", data_encoding="gzip",
              encoder="transcode", extra=2)
            continue
        m(name, "commit-every-100 loop (raw)", "loop")
        if name != "16384":
            m(name, "dvidshards, TS encoder, raw", "dvid", fmt="precomputed", data_encoding="raw",
              encoder="tensorstore", extra=0)
        if name == "1024":
            m(name, "floor, TensorStore's gzip", "floor", data_encoding="gzip", ts_gzip=True)
        m(name, "dvidshards zarr3", "dvid", fmt="zarr3", data_encoding="raw", encoder="transcode", extra=0)
        m(name, "zarr3 TS staged from memory", "zarr_ts")

    def cpc(name, label):
        r = res.get((name, label))
        return None if r is None else r["cpu"] / r["chunks"]

    rows = []
    for (name, label), r in res.items():
        c = r["cpu"] / r["chunks"]
        loop = cpc(name, "commit-every-100 loop (raw)")
        floor = cpc(name, "floor gzip" if "gzip" in label and "floor" not in label else "floor raw")
        rows.append([name, label, r["chunks"], f"{r['chunks'] / r['wall']:.0f}", f"{1e3 * c:.3f}",
                     f"{r['peak'] / C.MIB:.0f}", f"{r['base'] / C.MIB:.0f}",
                     f"{loop / c:.1f}x" if loop and "loop" not in label else "",
                     f"{c / floor:.2f}x" if floor and label.startswith("dvidshards precomputed") else ""])
    C.table(["shard", "variant", "chunks", "chunks/s", "CPU ms/chunk", "peak RSS MiB", "base RSS MiB",
             "loop CPU / this", "this / floor"], rows, "Per variant (each in a fresh process, serial)")

    verdicts = []
    for n_, need in (("16384", 10.0), ("1024", 5.0)):
        for enc in ("raw", "gzip"):
            a, b = cpc(n_, f"dvidshards precomputed {enc}"), cpc(n_, "commit-every-100 loop (raw)")
            if a and b:
                verdicts.append([f"precomputed {enc}: loop CPU / dvidshards at {n_} chunks >= {need:g}x",
                                 f"{b / a:.1f}x", C.verdict(b / a >= need)])
    for d in sets:
        for enc in ("gzip", "raw"):
            a, b = cpc(d["name"], f"dvidshards precomputed {enc}"), cpc(d["name"], f"floor {enc}")
            if a and b:
                verdicts.append([f"{enc}: dvidshards / floor <= 1.5x ({d['name']})", f"{a / b:.2f}x",
                                 C.verdict(a / b <= 1.5)])
    for enc in ("gzip", "raw"):
        a, b = cpc("16384", f"dvidshards precomputed {enc}"), cpc("1024", f"dvidshards precomputed {enc}")
        if a and b:
            verdicts.append([f"{enc}: CPU/chunk at 16,384 <= 1.2x at 1,024", f"{a / b:.2f}x", C.verdict(a / b <= 1.2)])
    for d in sets:
        a, b = cpc(d["name"], "dvidshards zarr3"), cpc(d["name"], "zarr3 TS staged from memory")
        if a and b:
            verdicts.append([f"zarr3: dvidshards / TS staged from memory <= 1.3x ({d['name']})", f"{a / b:.2f}x",
                             C.verdict(a / b <= 1.3)])
    for label in ("dvidshards precomputed gzip", "dvidshards precomputed gzip, extra 2"):
        r = res.get(("32768", label))
        if r:
            verdicts.append([f"peak RSS, 32,768-chunk shard, {label.replace('dvidshards precomputed ', '')}",
                             f"{r['peak'] / C.MIB:.0f} MiB", "stated" if "extra" not in label else
                             C.verdict(r["peak"] <= C.GIB)])
    big = next((s for s in ("32768", "16384", "1024") if cpc(s, "dvidshards precomputed gzip")), None)
    if big:
        for enc in ("gzip", "raw"):
            c = cpc(big, f"dvidshards precomputed {enc}")
            hours = CHUNKS_MCNS * c / 3600
            verdicts.append([f"projection, mCNS {CHUNKS_MCNS / 1e6:.0f} M chunks, {enc} (CPU/chunk at {big})",
                             f"{hours:.0f} core-hours (peer ~{PEER_CORE_HOURS})", C.verdict(hours < 100)])
    C.table(["target", "measured", "verdict"], verdicts, "Targets")
    print(f"load average at end: {C.load_text()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
