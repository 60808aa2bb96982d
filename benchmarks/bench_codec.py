"""Benchmark the DVID block decoder against a numpy reference and the memory floor.

Run from the project root::

    python benchmarks/bench_codec.py [--data DIR] [--repeat N]

All numbers come from this one process. Per block: dvidshards ``decode_into`` into a
preallocated 64³ uint64 buffer, a vectorised numpy reference decoder (no numba) into the same
buffer, and ``out.fill`` of that buffer (the memory floor). Then the 258 real blocks decoded
on 1 thread vs 2 threads (``ThreadPoolExecutor``, one output buffer per thread). Last, the cost
of the read-time check that a record's supervoxel list is its block's label list (issue 23):
``RecordTable.decode_into`` of the real shard's records (zstd + check + decode, agglomerated
palette) with the check and as it was before it, interleaved, in this thread's CPU time.
"""

from __future__ import annotations

import argparse
import gzip
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dvidshards.errors import BlockDecodeError  # noqa: E402
from dvidshards.formats.codec import block_header, decode_into  # noqa: E402

REAL_SHARD = "30720_24576_28672.arrow"


def load_blocks(data_dir: Path) -> tuple[np.ndarray, list[np.ndarray]]:
    """The fib19 block and the uncompressed blocks of the real mCNS shard, as uint8 arrays."""
    import pyarrow as pa
    import zstandard

    fib = gzip.decompress((data_dir / "fib19-64x64x64-sample1-block.dat.gz").read_bytes())
    dctx = zstandard.ZstdDecompressor()
    blocks = []
    with pa.OSFile(str(data_dir / REAL_SHARD)) as f:
        for batch in pa.ipc.open_stream(f):
            for payload in batch.column("dvid_compressed_block").to_pylist():
                blocks.append(np.frombuffer(dctx.decompress(payload), np.uint8))
    return np.frombuffer(fib, np.uint8), blocks


def numpy_decode(data: np.ndarray, out: np.ndarray) -> None:
    """Reference decoder in plain vectorised numpy (whole block at once, one pass per bit width)."""
    gx, gy, gz, n = (int(v) for v in data[:16].view("<u4"))
    labels = data[16 : 16 + 8 * n].view("<u8")
    if n == 1:
        out[...] = labels[0]
        return
    nsub = gx * gy * gz
    p = 16 + 8 * n
    nsb = data[p : p + 2 * nsub].view("<u2").astype(np.int64)
    p += 2 * nsub
    sbidx = data[p : p + 4 * int(nsb.sum())].view("<u4")
    p += 4 * sbidx.size
    bits = np.zeros_like(nsb)
    many = nsb > 1
    bits[many] = np.ceil(np.log2(nsb[many])).astype(np.int64)
    vstart = p + np.concatenate(([0], np.cumsum(64 * bits)[:-1]))
    istart = np.concatenate(([0], np.cumsum(nsb)[:-1]))
    subs = out.reshape(gz, 8, gy, 8, gx, 8).transpose(
        0, 2, 4, 1, 3, 5
    )  # a view: (sz, sy, sx, z, y, x)
    sz, sy, sx = np.unravel_index(np.arange(nsub), (gz, gy, gx))
    for b in np.unique(bits):
        sel = np.flatnonzero(bits == b)
        if b == 0:
            vals = np.where(
                nsb[sel] == 0, np.uint64(0), labels[sbidx[np.minimum(istart[sel], sbidx.size - 1)]]
            )
            subs[sz[sel], sy[sel], sx[sel]] = vals[:, None, None, None]
            continue
        raw = data[vstart[sel][:, None] + np.arange(64 * b)]  # (k, 64*b) bytes
        unpacked = np.unpackbits(raw, axis=1).reshape(len(sel), 512, b)
        v = unpacked.astype(np.int64) @ (1 << np.arange(b - 1, -1, -1))
        vox = labels[sbidx[istart[sel][:, None] + v]]
        subs[sz[sel], sy[sel], sx[sel]] = vox.reshape(-1, 8, 8, 8)


def per_block_us(fn, blocks) -> float:
    """Mean µs per call of fn over one pass of blocks."""
    t = time.perf_counter()
    for b in blocks:
        fn(b)
    return (time.perf_counter() - t) / len(blocks) * 1e6


def thread_run(blocks, nthreads: int, repeat: int, fill: bool = False) -> list[float]:
    """Wall-clock ms to decode (or just fill for) all blocks split over nthreads, one buffer each."""
    bufs = [np.empty((64, 64, 64), np.uint64) for _ in range(nthreads)]
    parts = [blocks[i::nthreads] for i in range(nthreads)]

    def work(i):
        out = bufs[i]
        for b in parts[i]:
            if fill:
                out.fill(7)
            else:
                decode_into(b, None, out)

    times = []
    with ThreadPoolExecutor(max_workers=nthreads) as pool:
        list(pool.map(work, range(nthreads)))  # warm up the threads
        for _ in range(repeat):
            t = time.perf_counter()
            list(pool.map(work, range(nthreads)))
            times.append((time.perf_counter() - t) * 1e3)
    return times


def check_cost(data_dir: Path, repeat: int) -> None:
    """Per record: the label-list check alone, and RecordTable.decode_into with it on and off."""
    import pyarrow as pa

    from dvidshards.formats import records
    from dvidshards.formats.labels import as_labels

    with pa.OSFile(str(data_dir / REAL_SHARD)) as f:
        t = records.RecordTable.from_batch(pa.ipc.open_stream(f).read_all(), REAL_SHARD)
    blocks = [t.block(i) for i in range(len(t))]
    out = np.empty((64, 64, 64), np.uint64)
    agg = as_labels("agglomerated")
    rows = range(len(t))

    def per_record_us(fn) -> float:
        c = time.thread_time()
        for i in rows:
            fn(i)
        return (time.thread_time() - c) / len(t) * 1e6

    def decode(i):
        t.decode_into(i, out, agg)

    def decode_before(i):  # decode_into as it was before the check (the label counts compared)
        r = t.rec[i].tolist()
        pay = r[records.R_PAY]
        try:
            block = records._decompress(t.bufs[0][pay:pay + r[records.R_PAYLEN]], r[records.R_USIZE], t._max_block)
            n = int.from_bytes(block[12:16], "little") if len(block) >= 16 else -1
            if n >= 1 and n != r[records.R_NSV]:
                raise BlockDecodeError(f"the block has {n} labels but its record lists {r[records.R_NSV]}")
            decode_into(np.frombuffer(block, np.uint8), agg.palette(t, i), out)
        except BlockDecodeError as e:
            raise BlockDecodeError(f"{t.where(i)}: {e}") from None

    res: dict[str, list[float]] = {"check alone": [], "on": [], "off": []}
    for r in range(repeat):
        order = [("on", decode), ("off", decode_before)] if r % 2 else [("off", decode_before), ("on", decode)]
        for k, fn in order:
            res[k].append(per_record_us(fn))
        res["check alone"].append(per_record_us(lambda i: t.labels_match(i, blocks[i])))
    on, off = statistics.median(res["on"]), statistics.median(res["off"])
    alone = statistics.median(res["check alone"])
    nsv = [len(t.supervoxels(i)) for i in rows]
    print(f"\n# read-time label-list check, {len(t)} real mCNS records (labels/record median "
          f"{int(np.median(nsv))}, max {max(nsv)}), this thread's CPU time, median of {repeat} interleaved passes")
    print("| RecordTable.decode_into µs/record, with the check | as before it | ratio | check alone µs (labels_match) |")
    print("|---|---|---|---|")
    print(f"| {on:.1f} | {off:.1f} | {on / off:.4f} | {alone:.2f} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--data",
        type=Path,
        default=ROOT.parent / "shared" / "data" / "dvid",
        help="folder of the real DVID files",
    )
    ap.add_argument(
        "--repeat", type=int, default=30, help="timed passes per measurement (median reported)"
    )
    ap.add_argument(
        "--thread-trials",
        type=int,
        default=150,
        help="alternating 1-/2-thread trials (best and median reported)",
    )
    args = ap.parse_args(argv)

    fib, real = load_blocks(args.data)
    out = np.empty((64, 64, 64), np.uint64)
    ref = np.empty_like(out)
    for b in [fib, *real]:  # correctness first (and JIT warm-up)
        decode_into(b, None, out)
        numpy_decode(b, ref)
        if not np.array_equal(out, ref):
            raise SystemExit("numpy reference and dvidshards disagree")

    cases = {"fib19 block (18 labels)": [fib], f"mCNS blocks (n={len(real)})": real}
    fns = {
        "dvidshards": lambda b: decode_into(b, None, out),
        "numpy ref": lambda b: numpy_decode(b, out),
        "fill (floor)": lambda b: out.fill(7),
    }
    res: dict[tuple[str, str], list[float]] = {}
    for case, blocks in cases.items():
        batch = blocks * max(1, 200 // len(blocks))  # >= 200 calls per timed pass
        for _ in range(args.repeat):  # interleaved, so drift hits all three alike
            for name, fn in fns.items():
                res.setdefault((case, name), []).append(per_block_us(fn, batch))

    nlab = [block_header(b).num_labels for b in real]
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}, numpy {np.__version__}"
    )
    print(
        f"# mCNS blocks: labels/block median {int(np.median(nlab))} (range {min(nlab)}-{max(nlab)}); median of {args.repeat} passes"
    )
    print()
    print(
        f"| {'case':<26} | {'dvidshards µs':>13} | {'numpy ref µs':>12} | {'fill µs':>7} | {'dvidshards/fill':>15} | {'numpy/fill':>10} |"
    )
    print(f"|{'-' * 28}|{'-' * 15}|{'-' * 14}|{'-' * 9}|{'-' * 17}|{'-' * 12}|")
    for case in cases:
        d, r, f = (statistics.median(res[case, k]) for k in fns)
        print(
            f"| {case:<26} | {d:>13.1f} | {r:>12.1f} | {f:>7.1f} | {d / f:>14.2f}x | {r / f:>9.1f}x |"
        )

    print()
    print(
        f"| {len(real)} mCNS blocks | 1 thread ms (best) | 2 threads ms (best) | speedup (best) | speedup (median of {args.thread_trials // 10 * 10}) |"
    )
    print("|---|---|---|---|---|")
    for name, fill in (("dvidshards decode_into", False), ("fill floor (out.fill, nogil)", True)):
        r1, r2 = [], []
        for _ in range(args.thread_trials // 10):  # alternate so background load hits both alike
            r1 += thread_run(real, 1, 10, fill)
            r2 += thread_run(real, 2, 10, fill)
        print(
            f"| {name} | {min(r1):.2f} | {min(r2):.2f} | {min(r1) / min(r2):.2f}x"
            f" | {statistics.median(r1) / statistics.median(r2):.2f}x |"
        )
    tiny = np.frombuffer(
        np.array([1, 1, 1, 1], "<u4").tobytes() + np.array([5], "<u8").tobytes(), np.uint8
    )
    small = np.empty((8, 8, 8), np.uint64)
    calls = [
        per_block_us(lambda b: decode_into(b, None, small), [tiny] * 2000)
        for _ in range(args.repeat)
    ]
    print(
        f"\n# whole decode_into call on a 24-byte 8³ solid block (Python + dispatch + kernel): {min(calls):.2f} µs"
    )
    check_cost(args.data, args.repeat)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"\n# 1-min load average at the end: {load:.2f} (other processes on the machine skew thread scaling)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
