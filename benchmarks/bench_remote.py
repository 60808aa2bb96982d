"""Benchmark remote reads (byte ranges over HTTP and S3) against local reads of the same export.

Run from the project root::

    python benchmarks/bench_remote.py [--size 256] [--shard-chunks 2] [--batch-size 4] [--latency-ms 20]

Starts its own servers on 127.0.0.1 (the Range-honouring HTTP server of ``tests.support.servers``,
once as is and once answering every request after ``--latency-ms``, and moto's S3 server),
writes a synthetic export, then prints one table:

* cold chunk: requests and KiB to read one chunk of a shard not touched yet (CSV + schema +
  its record batch), averaged over one chunk per shard;
* warm chunk: the same for a second chunk of each shard (index cached: one record batch);
* volume: the whole scale 0 in one read (fresh store): seconds, chunks/s, decoded MB/s, requests
  and MB fetched, and the time relative to local.

Requests and bytes are counted by the ``KvStore`` byte store (``stores/kvstore.py``: each read
attempt it issues through TensorStore, and the bytes returned); for http the server's own request
count is printed too ("server req"), as a check on TensorStore batching or retries.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import common as C  # noqa: E402

import dvidshards  # noqa: E402
from dvidshards.demo.neurons import neuron_volume  # noqa: E402
from dvidshards.stores.kvstore import KvStore  # noqa: E402
from dvidshards.writer import write_export  # noqa: E402
from tests.support.servers import MotoS3, RangeServer  # noqa: E402


def chunk_lists(export: Path, folder: str = "s0") -> list[list[tuple[int, int, int]]]:
    """Per shard of a scale: the chunk coordinates its CSV lists (shards with 2+ chunks only)."""
    out = []
    for csv in sorted((export / folder).glob("*.csv")):
        rows = csv.read_text().splitlines()[2:]
        out.append([tuple(int(v) for v in r.split(",")[:3]) for r in rows])
    return [c for c in out if len(c) >= 2]


def read_chunk(store, c) -> np.ndarray:
    x, y, z = (64 * v for v in c)
    return store[x:x + 64, y:y + 64, z:z + 64].read(order="F").result()


def measure(name: str, make, chunks, repeat: int, server: RangeServer | None = None) -> dict:
    """Cold and warm single chunks, then whole-volume throughput, for one source."""
    row = {"source": name}
    store, src = make()
    counts = []
    for kind, pick in (("cold", 0), ("warm", 1)):
        before = dict(src.stats) if src else None
        seen = server.total_requests if server else 0
        for shard in chunks:
            read_chunk(store, shard[pick])
        if src:
            n = len(chunks)
            row[f"{kind}_req"] = (src.stats["requests"] - before["requests"]) / n
            row[f"{kind}_kib"] = (src.stats["bytes"] - before["bytes"]) / n / 1024
        if server:
            row[f"{kind}_sreq"] = (server.total_requests - seen) / len(chunks)
    times = []
    for _ in range(repeat):
        store, src = make()
        before = dict(src.stats) if src else None
        t0 = time.perf_counter()
        vol = store.read(order="F").result()
        times.append(time.perf_counter() - t0)
        if src:
            counts.append((src.stats["requests"] - before["requests"], src.stats["bytes"] - before["bytes"]))
    t = statistics.median(times)
    nchunks = int(np.prod([-(-s // 64) for s in vol.shape]))
    row.update(time=t, chunks_s=nchunks / t, mb_s=vol.nbytes / t / 1e6, checksum=int(vol.sum(dtype=np.uint64)))
    if counts:
        row["vol_req"], row["vol_mb"] = counts[-1][0], counts[-1][1] / 1e6
    return row


def real_shard(data: Path, tmp: Path) -> list[str] | None:
    """Every chunk of the real mCNS shard read one by one, over http vs local (None: no data)."""
    arrow = data / "30720_24576_28672.arrow"
    if not arrow.is_file():
        return None
    export = tmp / "mcns"
    (export / "s1").mkdir(parents=True)
    os.symlink(arrow, export / "s1" / arrow.name)
    (export / "s1" / "30720_24576_28672.csv").write_bytes((data / "30720_24576_28672-newformat.csv").read_bytes())
    spec = data / "mcns-ng-specs.json"
    chunks = chunk_lists(export, "s1")[0]
    lines = []
    with RangeServer(export) as srv:
        for name in ("local", "http"):
            src = KvStore.from_url(srv.url) if name == "http" else None
            store = dvidshards.open(src or export, scale=1, spec=spec)
            t0 = time.perf_counter()
            for c in chunks:
                read_chunk(store, c)
            t = time.perf_counter() - t0
            if src is None:
                lines.append(f"| {name:<5} | {len(chunks)} | {t * 1e3 / len(chunks):.2f} | - | - |")
            else:
                lines.append(f"| {name:<5} | {len(chunks)} | {t * 1e3 / len(chunks):.2f} | "
                             f"{src.stats['requests'] / len(chunks):.2f} | "
                             f"{src.stats['bytes'] / len(chunks) / 1024:.2f} |")
    head = [f"# real mCNS shard ({arrow.stat().st_size / 1e6:.2f} MB, variant A index): each chunk read "
            f"separately, one after another (first read loads CSV + schema)",
            "| source | chunks | ms per chunk | requests per chunk | KiB per chunk |",
            "|--------|--------|--------------|--------------------|---------------|"]
    return head + lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=256, help="volume side in voxels")
    ap.add_argument("--shard-chunks", type=int, default=2, help="chunks per shard side")
    ap.add_argument("--batch-size", type=int, default=4, help="records per Arrow record batch")
    ap.add_argument("--latency-ms", type=float, default=20.0, help="added per request by the slow http server")
    ap.add_argument("--bodies", type=int, default=60, help="neurons in the synthetic volume")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "dvid",
                    help="folder with the real mCNS shard (optional)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        export = Path(tmp) / "export"
        vol, mapping = neuron_volume((args.size,) * 3, n_bodies=args.bodies, seed=1)
        write_export(vol, export, mapping=mapping, scales=1, shard_chunks=args.shard_chunks,
                     batch_size=args.batch_size, index="A", info=True)
        shards = sorted((export / "s0").glob("*.arrow"))
        chunks = chunk_lists(export)
        size = sum(p.stat().st_size for p in shards)
        print(C.machine())
        print()
        print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python "
              f"{platform.python_version()}; export {args.size}^3, {len(shards)} shards at s0 "
              f"({size / 1e6:.2f} MB, {args.shard_chunks}^3 chunks per shard, {args.batch_size} records per "
              f"batch); single-chunk columns average one chunk of each of {len(chunks)} shards")

        with RangeServer(export) as fast, RangeServer(export, latency=args.latency_ms / 1000) as slow, \
                MotoS3() as s3:
            s3.upload_dir("bench", export, "export/")

            def remote(source_factory):
                def make():
                    src = source_factory()
                    return dvidshards.open(src, fill_missing_shards=True), src
                return make

            rows = [
                measure("local", lambda: (dvidshards.open(export, fill_missing_shards=True), None), chunks,
                        args.repeat),
                measure("http", remote(lambda: KvStore.from_url(fast.url)), chunks, args.repeat, fast),
                measure(f"http +{args.latency_ms:g} ms", remote(lambda: KvStore.from_url(slow.url)), chunks,
                        args.repeat, slow),
                measure("s3 (moto)", remote(lambda: KvStore(s3.spec("bench", "export/"))), chunks,
                        args.repeat),
            ]
        real = real_shard(args.data, Path(tmp))
    assert len({r["checksum"] for r in rows}) == 1, "remote and local volumes differ"
    base = rows[0]["time"]
    cols = ["source", "cold chunk: req", "server req", "KiB", "warm chunk: req", "server req", "KiB", "volume s",
            "chunks/s", "MB/s", "req", "MB fetched", "time vs local"]
    table = []
    for r in rows:
        net = "cold_req" in r
        table.append([
            r["source"],
            f"{r['cold_req']:.1f}" if net else "-", f"{r['cold_sreq']:.1f}" if "cold_sreq" in r else "-",
            f"{r['cold_kib']:.1f}" if net else "-",
            f"{r['warm_req']:.1f}" if net else "-", f"{r['warm_sreq']:.1f}" if "warm_sreq" in r else "-",
            f"{r['warm_kib']:.1f}" if net else "-",
            f"{r['time']:.3f}", f"{r['chunks_s']:.0f}", f"{r['mb_s']:.0f}",
            str(r["vol_req"]) if net else "-", f"{r['vol_mb']:.3f}" if net else "-", f"{r['time'] / base:.2f}x",
        ])
    widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(cols)]
    print("| " + " | ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for t in table:
        print("| " + " | ".join((v.ljust(w) if i == 0 else v.rjust(w)) for i, (v, w) in
                                enumerate(zip(t, widths, strict=True))) + " |")
    if real:
        print()
        print("\n".join(real))

if __name__ == "__main__":
    main()
