"""Peak RSS while reading a 512³ box from shards of ≥ 100 MB each (vs one small shard).

Run from the project root::

    python benchmarks/bench_memory.py [--quick] [--repeat N] [--workdir DIR] [--data DIR]

Data: an mCNS-scale-1 export of 8 shards (2048³ voxels, 32³ = 32,768 records each, the real
shard's blocks reused, ~140 MB per file); the box is centred on the corner the 8 shards share,
so it reads 64 chunks from each. For comparison the same-size box from the synthetic 512³
export of bench_read (one 4.5 MB shard).

Each measurement runs in a fresh Python process: import, open (with the spec), one warm-up
chunk read, then the kernel's peak-RSS counter is reset (``/proc/self/clear_refs``) and the box
is read with ``read(order="F")``. RSS counts mapped shard-file pages too. Reported: RSS before
the read (baseline: interpreter, libraries, JIT code), peak during the read, and peak −
baseline, against the target peak ≤ output size + 300 MB.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import common as C

CORNER = (32768, 26624, 30720)  # shared by the 8 shards below (mCNS scale 1, extent 2048)
BIG8 = tuple((x, y, z) for z in (28672, 30720) for y in (24576, 26624) for x in (30720, 32768))


def child(kind: str, root: str, half: int, data: str) -> None:
    """Measure one read in this (fresh) process and print JSON."""
    import dvidshards

    if kind == "big":
        store = dvidshards.open(root, scale=1, spec=C.mcns_spec(C.Path(data)), context=C.context())
        lo = [c - half for c in CORNER]
    else:
        pair = C.SyntheticPair(C.Path(root))
        store = pair.open(C.context())
        lo = [0, 0, 0]
    box = store[tuple(slice(a, a + 2 * half) for a in lo)]
    C.warm(box)
    base = C.rss()
    ok = C.reset_peak_rss()
    t = time.perf_counter()
    out = box.read(order="F").result()
    dt = time.perf_counter() - t
    peak = C.peak_rss()
    print(json.dumps({"base": base, "peak": peak, "after": C.rss(), "out": out.nbytes, "reset": ok, "s": dt}))


def run_child(kind: str, root, half: int, data) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, str(root), str(half), str(data), ",".join(map(str, CORNER))]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode:
        raise SystemExit(f"child failed: {' '.join(cmd)}\n{r.stderr}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None):
    global CORNER
    ap = C.parser(__doc__)
    ap.add_argument("--repeat", type=int, default=None, help="fresh processes per case (default 3; --quick 1)")
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        kind, root, half, data, corner = args.child
        CORNER = tuple(int(v) for v in corner.split(","))
        child(kind, root, int(half), data)
        return
    C.require_real_data(args.data)
    repeat = args.repeat or (1 if args.quick else 3)
    half = 128 if args.quick else 256
    shards = BIG8[:1] if args.quick else BIG8
    big = C.big_shard_export(args.workdir, args.data, shards=shards,
                             name="big-32768" if args.quick else "big8-32768")
    pair = C.synthetic_pair(args.workdir, 256 if args.quick else 512)
    C.header("bench_memory: peak RSS of a box read vs shard size")
    if args.quick:  # the box inside the one shard
        CORNER = tuple(o + 1024 for o in BIG8[0])
    sizes = sorted({(C.Path(big) / "s1" / f"{o[0]}_{o[1]}_{o[2]}.arrow").stat().st_size for o in shards})
    cases = [("big", big, f"{len(shards)} shard(s) of {sizes[0] / 1e6:.0f}-{sizes[-1] / 1e6:.0f} MB, "
              "32,768 records each"),
             ("small", pair.folder, f"1 shard of {pair.stats['export_bytes'] / 1e6:.1f} MB (synthetic)")]
    rows = []
    verdicts = []
    for kind, root, what in cases:
        res = [run_child(kind, root, half, args.data) for _ in range(repeat)]
        worst = max(res, key=lambda r: r["peak"] - r["base"])
        out = worst["out"]
        limit = out + 300_000_000  # 300 MB (286 MiB)
        inc = worst["peak"] - worst["base"]
        rows.append([what, f"{out / C.MIB:.0f}", f"{worst['base'] / C.MIB:.0f}", f"{worst['peak'] / C.MIB:.0f}",
                     f"{inc / C.MIB:.0f}", f"{(inc - out) / C.MIB:.0f}", f"{limit / C.MIB:.0f}",
                     f"{C.med([r['s'] for r in res]):.2f}"])
        verdicts.append((what, worst, limit))
        if not worst["reset"]:
            print("(could not reset the peak-RSS counter: peak includes the time before the read)")
    C.table(["shards", "output MiB", "RSS before read MiB", "peak RSS MiB", "peak − before MiB",
             "beyond output MiB", "target: output + 300 MB, in MiB", "read s"], rows,
            title=f"Peak RSS reading a {2 * half}³ box, read(order='F') (worst of {repeat} fresh processes)")
    C.table(["target", "measured", "verdict"], [
        [f"peak RSS ≤ output + 300 MB ({what})",
         f"peak {w['peak'] / C.MIB:.0f} MiB (read adds {(w['peak'] - w['base']) / C.MIB:.0f} MiB to a "
         f"{w['base'] / C.MIB:.0f} MiB process) vs {lim / C.MIB:.0f} MiB",
         f"absolute: {C.verdict(w['peak'] <= lim)}; read's own: {C.verdict(w['peak'] - w['base'] <= lim)}"]
        for what, w, lim in verdicts], title="Target")
    print(f"load average at end: {C.load_text()}")


if __name__ == "__main__":
    main()
