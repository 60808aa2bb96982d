"""The bulk reader (``Dataset.read``) against the TensorStore path, precomputed and ``np.full``.

Run from the project root::

    python benchmarks/bench_bulk.py [--quick] [--rounds N] [--size 512] [--workdir DIR]

Data: ``common.synthetic_pair`` (a size³ neuron-like export in DVID's layout and the same
agglomerated voxels as sharded neuroglancer precomputed, written by TensorStore).

Measured in one process, interleaved rounds, medians, with 1 and 2 decoding threads
(``threads=`` for ``Dataset.read``, ``data_copy_concurrency`` for the TensorStore stores):

1. the aligned size³ box into a preallocated, already-touched array (``out=``): the bulk reader,
   the TensorStore path of dvidshards, precomputed, and ``out.fill`` (the memory floor); then the
   bulk reader and the fill into a second array from ``dvidshards.read.aligned_empty`` (64-byte
   aligned; numpy's own large allocations start 16 bytes into a page), each ÷ its own fill;
2. the same into a fresh array (page zeroing included): the bulk reader vs precomputed vs
   ``np.full``;
3. an unaligned box (cut chunks on every side).

Targets (issue 12): into ``out=``, ``Dataset.read`` ≤ 1.5× filling that array; into a fresh
array, ``Dataset.read`` ≥ 2× faster than precomputed, both with 2 threads.

The ``out=`` table also gives the process CPU time per call (all threads): on a shared machine
wall times stretch with other load, CPU times much less, so the two together tell a slow round
from a slow code path.  The load average is printed before and after.
"""

from __future__ import annotations

import time

import common as C
import numpy as np
import tensorstore as ts

import dvidshards
from dvidshards.read import aligned_empty


def main(argv=None):
    ap = C.parser(__doc__)
    ap.add_argument("--size", type=int, default=None, help="volume side (default 512; --quick 256)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 9; --quick 3)")
    args = ap.parse_args(argv)
    size = args.size or (256 if args.quick else 512)
    rounds = args.rounds or (3 if args.quick else 9)
    pair = C.synthetic_pair(args.workdir, size)
    C.header("bench_bulk: Dataset.read vs the TensorStore path, precomputed and the memory floor")
    ds = dvidshards.Dataset(pair.export, spec=pair.spec)
    shape = pair.shape
    box = [[0, 0, 0], list(shape)]
    ref = ds.read(box)  # warm shard cache, numba, page cache
    try:  # kernels compiled in the background (when the codec has them): measure compiled code
        from dvidshards.formats import jit
    except ImportError:
        pass
    else:
        jit.wait()
    rows_out, rows_new = [], []
    verdicts = {}
    for threads in (1, 2):
        ctx = ts.Context({"data_copy_concurrency": {"limit": threads}, "cache_pool": {"total_bytes_limit": 0}})
        vol = ds.open(0, context=ctx)
        pre = pair.open_precomputed(ctx)
        got = vol.read(order="F").result()
        if not (np.array_equal(got, ref) and np.array_equal(pre.read(order="F").result(), ref)):
            raise SystemExit("the stores disagree: rebuild --workdir")
        del got
        out = np.empty(shape, np.uint64, order="F")  # numpy's allocation: 16 bytes into a page
        al = aligned_empty(shape)  # the same, from a 64-byte boundary
        assert out.ctypes.data % 64 != 0 and al.ctypes.data % 64 == 0
        out.fill(1)
        al.fill(1)
        dst = ts.array(out, copy=False)
        cpu: dict[str, list[float]] = {}
        t = C.alternate({k: _cpu_timed(k, f, cpu) for k, f in {
            "Dataset.read(out=)": lambda out=out, n=threads: ds.read(box, out=out, threads=n),
            "TensorStore path (dvidshards.open)": lambda dst=dst, vol=vol: dst.write(vol).result(),
            "precomputed": lambda dst=dst, pre=pre: dst.write(pre).result(),
            "out.fill (floor)": lambda out=out: out.fill(7),
            "Dataset.read(out=aligned)": lambda al=al, n=threads: ds.read(box, out=al, threads=n),
            "aligned.fill (floor)": lambda al=al: al.fill(7),
        }.items()}, rounds)
        for a in (out, al):
            a.fill(7)
            if not np.array_equal(ds.read(box, out=a, threads=threads), ref):
                raise SystemExit("Dataset.read(out=) differs from the reference")
        pm = C.med(t["precomputed"])
        for k, v in t.items():
            floor = C.med(t["aligned.fill (floor)" if "aligned" in k else "out.fill (floor)"])
            rows_out.append([threads, k, C.ms(C.med(v)), C.ms(min(v)), C.ms(C.med(cpu[k])), f"{C.med(v) / floor:.2f}",
                             f"{C.med(v) / pm:.2f}"])
        verdicts[f"out=, {threads} thr: read ÷ fill ≤ 1.5"] = \
            C.med(t["Dataset.read(out=)"]) / C.med(t["out.fill (floor)"])
        verdicts[f"out=aligned_empty, {threads} thr: read ÷ fill ≤ 1.5"] = \
            C.med(t["Dataset.read(out=aligned)"]) / C.med(t["aligned.fill (floor)"])
        del out, al, dst
        t = C.alternate({
            "Dataset.read (new array)": lambda n=threads: ds.read(box, threads=n),
            "precomputed read (new array)": lambda pre=pre: pre.read(order="F").result(),
            "np.full (new array)": lambda: np.full(shape, 7, np.uint64, order="F"),
        }, rounds)
        pm = C.med(t["precomputed read (new array)"])
        for k, v in t.items():
            rows_new.append([threads, k, C.ms(C.med(v)), f"{C.med(v) / pm:.2f}"])
        verdicts[f"new array, {threads} thr: precomputed ÷ read ≥ 2"] = pm / C.med(t["Dataset.read (new array)"])
    C.table(["threads", "path", "median ms", "min ms", "CPU ms (median)", "÷ fill of the same array", "÷ precomputed"], rows_out,
            title=f"Aligned {size}³ into a preallocated, touched array")
    C.table(["threads", "path", "median ms", "÷ precomputed"], rows_new, title=f"Aligned {size}³ into a fresh array")

    off = (37, 101, 211) if size >= 512 else (19, 51, 105)
    ext = tuple(min(s - o, e) for s, o, e in zip(shape, off, (300, 200, 100), strict=True))
    ubox = [list(off), [o + e for o, e in zip(off, ext, strict=True)]]
    sl = tuple(slice(a, b) for a, b in zip(*ubox, strict=True))
    ctx = ts.Context({"data_copy_concurrency": {"limit": 2}, "cache_pool": {"total_bytes_limit": 0}})
    vol, pre = ds.open(0, context=ctx), pair.open_precomputed(ctx)
    if not np.array_equal(ds.read(ubox), ref[sl]):
        raise SystemExit("unaligned read differs")
    t = C.alternate({"Dataset.read": lambda: ds.read(ubox, threads=2),
                     "TensorStore path": lambda: vol[sl].read(order="F").result(),
                     "precomputed": lambda: pre[sl].read(order="F").result()}, rounds)
    pm = C.med(t["precomputed"])
    C.table(["path", "median ms", "÷ precomputed"], [[k, C.ms(C.med(v)), f"{C.med(v) / pm:.2f}"] for k, v in t.items()],
            title=f"Unaligned box {ext} at {off}, 2 threads")
    C.table(["target", "measured", "verdict"],
            [[k, f"{v:.2f}", C.verdict(v <= 1.5 if "≤" in k else v >= 2)] for k, v in verdicts.items()],
            title="Targets (issue 12)")
    print(f"load average at the end: {C.load_text()}")


def _cpu_timed(name, fn, cpu):
    """fn, recording the process CPU time of each call in cpu[name]."""
    def timed():
        c0 = time.process_time()
        fn()
        cpu.setdefault(name, []).append(time.process_time() - c0)
    return timed


if __name__ == "__main__":
    main()
