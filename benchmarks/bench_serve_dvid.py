"""``dvidshards serve-dvid``: server CPU per request against the in-process floor, and under load.

Data: a size³ neuron-like export (``neuron_volume``, default 384³, 60 bodies of 6 supervoxels,
2 scales, DVID's layout) and its label index, built once into the work directory.

Measured:

* **CPU per request, by kind** (issue 37: at most ~2x the reads it needs): the server in its
  own process answers each kind's requests one at a time (after a pass that fills its caches, as a
  running server has them), and its process CPU (``/proc``) is divided by the requests. The
  *floor* is the CPU, in this process, of the reads each request needs: the blocks holding its
  points (zstd, for a mixed chunk) for ``label``/``labels``; decoding every chunk of the body
  (``chunk_decoder``) for ``sparsevol``; the body's rows of the label index (a Parquet read, no
  cache) for ``size``, ``sizes``, ``supervoxels``, ``sparsevol-size``, ``sparsevol-coarse`` and
  ``index``; the look-ups in the supervoxel table for ``mapping``; the 4 blocks (zstd) for
  ``specificblocks``. ``/tags`` gives the cost of a request that reads nothing.
* **Load**: 8 client processes each sending 1,000 requests over loopback (``requests.Session``),
  drawn from a pool of 300 mixed requests. Every answer is compared byte for byte with the answer
  the same server gave when asked alone first: an error is a status other than 200 or other
  bytes. Latency p50/p99 per kind, throughput, and the server's RSS sampled every 0.25 s (after
  the serial warm-up pass, its peak, and at the end: flat means it does not grow).
* **/sparsevol of the largest body** (rles and blocks): client wall time and server CPU per
  request, against decoding that body's chunks in this process and ``Body.sparsevol``.

Run: ``.venv/bin/python benchmarks/bench_serve_dvid.py [--quick] [--clients 8] [--requests 1000]``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
from common import table

import dvidshards
from dvidshards.bodies import Body, chunk_decoder
from dvidshards.formats.labelindex import bucket_name, bucket_of
from dvidshards.formats.records import R_NSV

SERVER = """
import sys
from dvidshards.serve.dvid import serve
s = serve(sys.argv[1], spec=sys.argv[2], label_index=sys.argv[3], port=0, threads=int(sys.argv[4]))
print(s.url, s.api.uuid, flush=True)
s.wait()
"""


def build(workdir: Path, size: int, log=print) -> Path:
    """The export and its label index (once per parameters)."""
    from dvidshards.demo.neurons import neuron_volume
    from dvidshards.jobs.labelindex import label_index
    from dvidshards.writer import write_export

    params = {"kind": "serve-dvid", "size": size, "n_bodies": 60, "svs": 6, "seed": 3, "version": 1}
    folder = workdir / f"serve-dvid-{size}"
    if common._fresh(folder, params):
        return folder
    common._reset(folder)
    t0 = time.perf_counter()
    log(f"building {folder} (once) ...")
    sv, mapping = neuron_volume((size,) * 3, n_bodies=60, svs_per_body=6, seed=3)
    spec = write_export(sv, folder / "export", mapping=mapping, scales=2)
    (folder / "spec.json").write_text(json.dumps(spec))
    del sv
    label_index(str(folder / "export"), str(folder / "index"), scale=0, spec=spec, progress=False)
    common._done(folder, params)
    log(f"built in {time.perf_counter() - t0:.0f} s")
    return folder


def request_pool(ds, idx, n: int, seed: int = 0) -> list[tuple[str, str, dict, object]]:
    """(kind, path tail, query, JSON body or None) of n mixed requests."""
    rng = np.random.default_rng(seed)
    pairs = np.concatenate([np.stack(p, axis=1) for p in idx.pairs()])
    bodies = np.unique(pairs[:, 1])
    svs = pairs[:, 0]
    chunks = ds.chunks(0)
    size = np.array(ds.scale(0).size)
    kinds = {"labels": 20, "label": 10, "sparsevol": 15, "sparsevol-blocks": 5, "sparsevol-size": 10, "size": 10,
             "sizes": 5, "supervoxels": 5, "specificblocks": 10, "mapping": 3, "sparsevol-coarse": 4, "index": 3}
    names = list(kinds)
    p = np.array([kinds[k] for k in names], float)
    out = []
    for k in rng.choice(len(names), n, p=p / p.sum()):
        kind = names[k]
        b = int(rng.choice(bodies))
        if kind == "labels":
            out.append((kind, "labels", {}, rng.integers(0, size, (50, 3)).tolist()))
        elif kind == "label":
            x, y, z = rng.integers(0, size).tolist()
            out.append((kind, f"label/{x}_{y}_{z}", {}, None))
        elif kind == "sparsevol-blocks":
            out.append((kind, f"sparsevol/{b}", {"format": "blocks"}, None))
        elif kind == "sizes":
            out.append((kind, "sizes", {}, [int(v) for v in rng.choice(bodies, 10)]))
        elif kind == "specificblocks":
            c = chunks[rng.choice(len(chunks), 4)]
            out.append((kind, "specificblocks", {"blocks": ",".join(str(int(v)) for v in c.ravel())}, None))
        elif kind == "mapping":
            out.append((kind, "mapping", {}, [int(v) for v in rng.choice(svs, 10)]))
        else:
            out.append((kind, f"{kind}/{b}", {}, None))
    return out


def client(args) -> list[tuple[str, float, bool]]:
    """One client process: its requests in order; (kind, seconds, answer as expected)."""
    import requests

    base, pool, want, order = args
    s = requests.Session()
    out = []
    for i in order:
        kind, tail, q, body = pool[i]
        t0 = time.perf_counter()
        try:
            r = s.get(f"{base}/{tail}", params=q, json=body, timeout=300)
            ok = r.status_code == 200 and r.content == want[i]
        except Exception:  # noqa: BLE001 - counted as an error
            ok = False
        out.append((kind, time.perf_counter() - t0, ok))
    return out


def proc_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def proc_cpu(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=1000, help="requests per client")
    p.add_argument("--threads", type=int, default=2, help="the server's decoding threads")
    p.add_argument("--size", type=int, default=384)
    args = p.parse_args()
    if args.quick:
        args.size, args.requests = 192, 100
    common.header("serve-dvid: DVID's labelmap API from an export, under load")
    folder = build(args.workdir, args.size)
    spec = str(folder / "spec.json")
    ds = dvidshards.Dataset(str(folder / "export"), spec=spec)
    idx = dvidshards.query.BodyIndex(folder / "index")
    srv = subprocess.Popen([sys.executable, "-c", SERVER, str(folder / "export"), spec, str(folder / "index"),
                            str(args.threads)], stdout=subprocess.PIPE, text=True)
    try:
        url, uuid = srv.stdout.readline().split()
        base = f"{url}/api/node/{uuid}/segmentation"
        run(args, ds, idx, srv.pid, base)
    finally:
        srv.terminate()
        srv.wait(timeout=60)


def run(args, ds, idx, pid: int, base: str) -> None:
    import requests

    pool = request_pool(ds, idx, 300)
    per_kind(ds, idx, pid, base, pool)
    s = requests.Session()
    want = []
    t0, c0 = time.perf_counter(), proc_cpu(pid)
    for kind, tail, q, body in pool:  # the serial pass: the reference answers, and the warm-up
        r = s.get(f"{base}/{tail}", params=q, json=body, timeout=300)
        if r.status_code != 200:
            raise SystemExit(f"serial pass: {kind} {tail} {q}: {r.status_code} {r.text[:200]}")
        want.append(r.content)
    serial_wall, serial_cpu = time.perf_counter() - t0, proc_cpu(pid) - c0
    print(f"serial pass: {len(pool)} requests in {serial_wall:.1f} s, server CPU {serial_cpu:.1f} s; "
          f"{sum(map(len, want)) / 1e6:.1f} MB answered\n")
    rss: list[tuple[float, int]] = []
    stop = threading.Event()

    def sample():
        t = time.perf_counter()
        while not stop.is_set():
            rss.append((time.perf_counter() - t, proc_rss(pid)))
            stop.wait(0.25)

    rng = np.random.default_rng(1)
    orders = [rng.integers(0, len(pool), args.requests).tolist() for _ in range(args.clients)]
    sampler = threading.Thread(target=sample, daemon=True)
    rss0 = proc_rss(pid)
    sampler.start()
    t0, c0 = time.perf_counter(), proc_cpu(pid)
    with mp.get_context("spawn").Pool(args.clients) as workers:
        results = workers.map(client, [(base, pool, want, o) for o in orders])
    wall, cpu = time.perf_counter() - t0, proc_cpu(pid) - c0
    stop.set()
    sampler.join()
    flat = [r for c in results for r in c]
    errors = sum(not ok for _, _, ok in flat)
    lat = np.array([t for _, t, _ in flat])
    kinds = sorted({k for k, _, _ in flat})
    rows = [[k, sum(1 for kk, _, _ in flat if kk == k),
             *(f"{np.percentile([t for kk, t, _ in flat if kk == k], q) * 1e3:.1f}" for q in (50, 99)),
             sum(1 for kk, _, ok in flat if kk == k and not ok)] for k in kinds]
    rows.append(["all", len(flat), f"{np.percentile(lat, 50) * 1e3:.1f}", f"{np.percentile(lat, 99) * 1e3:.1f}",
                 errors])
    table(["request", "n", "p50 ms", "p99 ms", "errors"], rows,
          f"{args.clients} clients x {args.requests} requests over loopback, server with {args.threads} threads "
          f"and the label index ({args.size}³ export)")
    mem = np.array([v for _, v in rss])
    quarters = [mem[int(len(mem) * f)] for f in (0.25, 0.5, 0.75)] if len(mem) else []
    table(["", "value"], [
        ["wall (s)", f"{wall:.1f}"], ["requests/s", f"{len(flat) / wall:.0f}"],
        ["server CPU (s)", f"{cpu:.1f}"], ["server CPU per request (ms)", f"{cpu / len(flat) * 1e3:.2f}"],
        ["errors", errors],
        ["RSS after the serial pass (MiB)", f"{rss0 / common.MIB:.0f}"],
        ["RSS at 25/50/75 % of the run (MiB)", " / ".join(f"{v / common.MIB:.0f}" for v in quarters)],
        ["RSS peak / end (MiB)", f"{mem.max() / common.MIB:.0f} / {mem[-1] / common.MIB:.0f}"],
        ["RSS samples", len(mem)],
    ], "throughput and server memory")
    print(json.dumps({"wall": wall, "errors": errors, "p50": float(np.percentile(lat, 50)),
                      "p99": float(np.percentile(lat, 99)), "rss0": rss0, "rss": [int(v) for v in mem[::4]],
                      "cpu": cpu, "load": common.load_text()}))
    print()
    large_body(ds, idx, pid, base)


def floor(ds, idx, kind: str, tail: str, body) -> None:
    """The reads one request needs, in this process (see the module docstring)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    s = ds.scale(0)
    reader = ds.reader(s, labels="agglomerated")
    if kind in ("label", "labels", "specificblocks"):
        if kind == "label":
            pts = np.array([[int(v) for v in tail.split("/")[1].split("_")]])
        elif kind == "labels":
            pts = np.asarray(body, np.int64)
        for c in np.unique(pts // 64, axis=0) if kind != "specificblocks" else body:
            sh = reader.shard(*(int(v) for v in c))
            i = sh.find(*(int(v) for v in c)) if sh is not None else None
            if i is not None:
                t = sh.table(np.array([i]))
                if kind == "specificblocks" or t.rec[0, R_NSV] > 1:
                    t.block(0)
    elif kind in ("sparsevol", "sparsevol-blocks"):
        decode = chunk_decoder(ds, 0)
        for c in idx.blocks(int(tail.split("/")[1])):
            decode(c)
    elif kind == "mapping":
        idx.bodies_of(body)
    else:
        for b in (body if kind == "sizes" else [int(tail.split("/")[1])]):
            key = bucket_name(int(bucket_of(np.uint64(b), idx.bits)), idx.bits)
            pq.read_table(idx.store.open(key), filters=pc.field("body") == pa.scalar(b, pa.uint64()))


def per_kind(ds, idx, pid: int, base: str, pool) -> None:
    """Server CPU per request of each kind (one at a time, caches filled) against the floor."""
    import requests

    s = requests.Session()
    kinds = sorted({k for k, *_ in pool})
    specific = {}
    for k, _, q, _ in pool:  # the blocks of /specificblocks, as the floor reads them
        if k == "specificblocks":
            specific[q["blocks"]] = np.array([int(v) for v in q["blocks"].split(",")]).reshape(-1, 3)
    idx.supervoxel_table()

    def server_cpu(items, reps):
        for _, tail, q, body in items:  # fill the server's caches
            assert s.get(f"{base}/{tail}", params=q, json=body, timeout=300).status_code == 200
        c0 = proc_cpu(pid)
        for _ in range(reps):
            for _, tail, q, body in items:
                s.get(f"{base}/{tail}", params=q, json=body, timeout=300)
        return (proc_cpu(pid) - c0) / (reps * len(items))

    c0 = proc_cpu(pid)
    for _ in range(500):
        s.get(f"{base}/tags", timeout=60)
    null = (proc_cpu(pid) - c0) / 500
    rows = []
    for kind in kinds:
        items = [it for it in pool if it[0] == kind][:40]
        reps = max(1, 200 // len(items)) if kind not in ("sparsevol", "sparsevol-blocks") else 2
        srv = server_cpu(items, reps)
        for _, tail, q, body in items:  # warm this process's shard cache too
            floor(ds, idx, kind, tail, specific.get(q.get("blocks")) if kind == "specificblocks" else body)
        c0 = time.process_time()
        for _ in range(reps):
            for _, tail, q, body in items:
                floor(ds, idx, kind, tail, specific.get(q.get("blocks")) if kind == "specificblocks" else body)
        fl = (time.process_time() - c0) / (reps * len(items))
        rows.append([kind, len(items) * reps, f"{srv * 1e3:.2f}", f"{fl * 1e3:.2f}", f"{srv / fl:.2f}",
                     f"{max(srv - null, 0) / fl:.2f}"])
    table(["request", "n", "server CPU ms", "floor ms", "ratio", "ratio less HTTP"], rows,
          f"server CPU per request (one at a time, caches filled) against the reads it needs in-process; "
          f"a request of the instance that reads nothing (/tags) costs {null * 1e3:.2f} ms of server CPU")


def large_body(ds, idx, pid: int, base: str) -> None:
    import requests

    ids = np.unique(np.concatenate([b for _, b in idx.pairs()])).tolist()
    big = max(ids, key=lambda b: len(idx.blocks(b)))
    body = Body(ds, big, index=idx)
    chunks = body.chunks()
    s = requests.Session()
    rows = []
    for fmt in ("rles", "blocks"):  # /proc counts CPU in clock ticks (10 ms): 20 requests per figure
        walls, cpus = [], []
        for _ in range(3):
            t0, c0 = time.perf_counter(), proc_cpu(pid)
            for _ in range(20):
                r = s.get(f"{base}/sparsevol/{big}", params={"format": fmt}, timeout=300)
                assert r.status_code == 200
            walls.append((time.perf_counter() - t0) / 20)
            cpus.append((proc_cpu(pid) - c0) / 20)
        rows.append([f"GET /sparsevol?format={fmt}", f"{np.median(walls) * 1e3:.1f}",
                     f"{np.median(cpus) * 1e3:.1f}", f"{len(r.content) / 1e6:.2f}"])
    decode = chunk_decoder(ds, 0)
    for c in chunks[:2]:
        decode(c)  # warm
    cpus = []
    for _ in range(5):
        c0 = time.process_time()
        for c in chunks:
            decode(c)
        cpus.append(time.process_time() - c0)
    rows.append(["Python: decode its chunks (chunk_decoder)", "", f"{np.median(cpus) * 1e3:.1f}", ""])
    cpus = []
    for _ in range(3):
        c0 = time.process_time()
        data = Body(ds, big, index=idx).sparsevol()
        cpus.append(time.process_time() - c0)
    rows.append(["Python: Body.sparsevol()", "", f"{np.median(cpus) * 1e3:.1f}", f"{len(data) / 1e6:.2f}"])
    table(["", "wall ms (client)", "CPU ms (process)", "MB"], rows,
          f"/sparsevol of the body with the most chunks ({big}: {len(chunks)} chunks, {body.size()} voxels); "
          f"per request, median of 3 runs (CPU: /proc of the server over 20 requests, process time of Python)")


if __name__ == "__main__":
    main()
