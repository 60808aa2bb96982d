"""Cold start: a fresh Python process reading its first chunk, with and without numba's on-disk cache.

Run from the project root::

    python benchmarks/bench_coldstart.py [--quick] [--repeat N] [--workdir DIR]

Data: the demo's export (``dvidshards.demo``: ``DEFAULT_SIZE`` voxels, its bodies, scales,
resolution and shard size), written once into ``--workdir``.

Each measurement is a new ``python`` process (``subprocess``) that imports dvidshards, opens
scale 0 with the spec and reads one 64³ chunk with foreground (then a second chunk, for the
in-process warm cost). Conditions, interleaved:

* cold: ``NUMBA_CACHE_DIR`` set to a new empty folder: every kernel is compiled, as after a
  fresh install (nothing under the installed package is deleted: other processes use it);
* warm: the same folder again, filled by the cold run just before;
* default: ``NUMBA_CACHE_DIR`` unset: the package's own ``__pycache__`` as it is now.

Times: interpreter start to exit (the subprocess wall time), ``import dvidshards``, open, first
chunk (wall and CPU), second chunk. With ``--profile`` every ``Dispatcher.compile`` call in a cold
and a warm process is timed in thread CPU seconds (inclusive of nested compiles; "self" excludes
them) and the slowest are listed, with their signatures:
with a warm cache a "compile" is a load from the cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import common as C

_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
profile = sys.argv[3] == "1"
events = []
if profile:
    import numba.core.dispatcher as _d
    _orig = _d.Dispatcher.compile
    _stack = []

    def _timed(self, sig):
        _stack.append(0.0)
        t = time.thread_time()  # CPU seconds of this thread: robust to a busy machine
        try:
            return _orig(self, sig)
        finally:
            dt = time.thread_time() - t
            child = _stack.pop()
            if _stack:
                _stack[-1] += dt
            events.append([f"{self.py_func.__module__}.{self.py_func.__qualname__}", str(sig), dt, dt - child])

    _d.Dispatcher.compile = _timed
import dvidshards
t1 = time.perf_counter()
root, spec = sys.argv[1], json.loads(open(sys.argv[2]).read())
x, y, z = map(int, sys.argv[4].split(","))
store = dvidshards.open(root, spec=spec, fill_missing_shards=True)
t2 = time.perf_counter()
c2 = time.process_time()
a = store[x:x + 64, y:y + 64, z:z + 64].read(order="F").result()
t3 = time.perf_counter()
c3 = time.process_time()
store[x + 64:x + 128, y:y + 64, z:z + 64].read(order="F").result()
t4 = time.perf_counter()
from dvidshards.formats import jit
behind = sorted(k for k, v in jit.status().items() if v in ("queued", "compiling"))
jit.wait()  # until every kernel called is compiled (or loaded from the cache) in the background
t5 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "open": t2 - t1, "first": t3 - t2, "second": t4 - t3,
                  "ready": t5 - t0, "behind": behind,
                  "first_cpu": c3 - c2, "cpu": time.process_time(),
                  "nonzero": int((a != 0).sum()), "events": events}))
"""


def build(workdir, log=print):
    """The demo's export (once): returns (export folder, spec path, chunk origin with foreground)."""
    from dvidshards.demo import DEFAULT_SIZE, RESOLUTION, SHARD_CHUNKS
    from dvidshards.testing.synthetic import neuron_volume
    from dvidshards.writer import write_export

    params = {"kind": "coldstart-demo", "size": list(DEFAULT_SIZE), "shard_chunks": SHARD_CHUNKS,
              "resolution": list(RESOLUTION), "version": 1}
    folder = workdir / "coldstart-demo"
    if not C._fresh(folder, params):
        C._reset(folder)
        log(f"writing the demo export into {folder} (once) ...")
        sv, mapping = neuron_volume(DEFAULT_SIZE, n_bodies=40, svs_per_body=6, seed=7)
        spec = write_export(sv, folder / "export", mapping=mapping, scales=3, resolution=RESOLUTION,
                            shard_chunks=SHARD_CHUNKS)
        (folder / "spec.json").write_text(json.dumps(spec))
        # the foreground chunk nearest the centre (its +x neighbour is read second)
        g = [s // 64 for s in DEFAULT_SIZE]
        best = None
        for cz in range(g[2]):
            for cy in range(g[1]):
                for cx in range(g[0] - 1):
                    fg = int((sv[64 * cx:64 * cx + 64, 64 * cy:64 * cy + 64, 64 * cz:64 * cz + 64] != 0).sum())
                    d = sum((c - n / 2) ** 2 for c, n in zip((cx, cy, cz), g, strict=True))
                    if fg > 64 ** 3 // 4 and (best is None or d < best[0]):
                        best = (d, (64 * cx, 64 * cy, 64 * cz))
        (folder / "chunk.json").write_text(json.dumps(best[1] if best else [0, 0, 0]))
        del sv
        C._done(folder, params)
    return folder / "export", folder / "spec.json", tuple(json.loads((folder / "chunk.json").read_text()))


def run_child(export, spec, chunk, cache_dir: str | None, profile: bool = False) -> dict:
    env = dict(os.environ)
    env.pop("NUMBA_CACHE_DIR", None)
    env.pop("DVIDSHARDS_KERNELS", None)  # the default mode, as a user gets it
    if cache_dir is not None:
        env["NUMBA_CACHE_DIR"] = cache_dir
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", _CHILD, str(export), str(spec), "1" if profile else "0",
                        ",".join(map(str, chunk))], capture_output=True, text=True, env=env, cwd=str(C.ROOT),
                       check=False)
    wall = time.perf_counter() - t
    if r.returncode:
        raise SystemExit(f"child failed:\n{r.stderr}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["wall"] = wall
    return out


def main(argv=None):
    ap = C.parser(__doc__)
    ap.add_argument("--repeat", type=int, default=None, help="processes per condition (default 3; --quick 1)")
    ap.add_argument("--profile", action="store_true", help="also time every numba compile (cold and warm)")
    ap.add_argument("--top", type=int, default=15, help="compiles listed with --profile")
    args = ap.parse_args(argv)
    repeat = args.repeat or (1 if args.quick else 3)
    export, spec, chunk = build(args.workdir)
    from dvidshards.demo import DEFAULT_SIZE

    C.header("bench_coldstart: fresh process, first chunk, numba cache cold / warm")
    res = {"cold": [], "warm": [], "default": []}
    with tempfile.TemporaryDirectory(prefix="dvidshards-numba-") as tmp:
        for i in range(repeat):
            d = os.path.join(tmp, f"cache{i}")
            os.mkdir(d)
            res["cold"].append(run_child(export, spec, chunk, d))
            res["warm"].append(run_child(export, spec, chunk, d))
            res["default"].append(run_child(export, spec, chunk, None))
        prof = None
        if args.profile:
            d = os.path.join(tmp, "profile")
            os.mkdir(d)
            prof = {"cold": run_child(export, spec, chunk, d, profile=True),
                    "warm": run_child(export, spec, chunk, d, profile=True)}
    rows = []
    for k, v in res.items():
        rows.append([k, f"{C.med([r['wall'] for r in v]):.2f}", f"{C.med([r['import'] for r in v]):.2f}",
                     f"{C.med([r['open'] for r in v]) * 1e3:.0f}", f"{C.med([r['first'] for r in v]):.2f}",
                     f"{C.med([r['first_cpu'] for r in v]):.2f}", f"{C.med([r['cpu'] for r in v]):.2f}",
                     f"{C.med([r['second'] for r in v]) * 1e3:.1f}",
                     f"{min(r['first'] for r in v):.2f}–{max(r['first'] for r in v):.2f}",
                     f"{C.med([r['ready'] for r in v]):.2f}", len(v[0]["behind"])])
    C.table(["numba cache", "process wall s", "import s", "open ms", "first chunk s", "first chunk CPU s",
             "process CPU s", "second chunk ms",
             "first chunk range s", "kernels compiled at s", "kernels still compiling after 2 chunks"], rows,
            title=f"Fresh process, demo export {'×'.join(map(str, DEFAULT_SIZE))}, chunk at {chunk} "
                  f"(medians of {repeat})")
    cold = C.med([r["import"] + r["open"] + r["first"] for r in res["cold"]])
    warm = C.med([r["import"] + r["open"] + r["first"] for r in res["warm"]])
    cold_first = C.med([r["first"] for r in res["cold"]])
    warm_first = C.med([r["first"] for r in res["warm"]])
    C.table(["target (issue 11)", "measured", "verdict"], [
        ["first chunk read of a fresh process, cold numba cache ≤ 3 s",
         f"{cold_first:.2f} s first read ({cold:.2f} s import + open + read)", C.verdict(cold_first <= 3.0)],
        ["the same with the cache warm ≤ 0.5 s",
         f"{warm_first:.2f} s first read ({warm:.2f} s import + open + read)", C.verdict(warm_first <= 0.5)],
    ], title="Targets (on the read, as the demo reports it; import is the interpreter loading the libraries)")
    if prof:
        for kind in ("cold", "warm"):
            ev = prof[kind]["events"]
            total = sum(e[3] for e in ev)
            agg: dict = {}
            for name, sig, inc, own in ev:
                a = agg.setdefault(name, [0, 0.0, 0.0, set()])
                a[0] += 1
                a[1] += inc
                a[2] += own
                a[3].add(sig)
            top = sorted(agg.items(), key=lambda kv: -kv[1][2])[:args.top]
            C.table(["function", "compile calls", "signatures", "inclusive CPU s", "self CPU s"],
                    [[n, a[0], len(a[3]), f"{a[1]:.2f}", f"{a[2]:.2f}"] for n, a in top],
                    title=f"numba Dispatcher.compile, {kind} cache: {len(ev)} calls, {total:.2f} CPU s in "
                          f"all (first chunk {prof[kind]['first']:.2f} s, import {prof[kind]['import']:.2f} s)")
            for n, a in top:
                if n.startswith("dvidshards"):
                    for sig in sorted(a[3]):
                        print(f"- {n}{sig}")
            print()
    print(f"load average at end: {C.load_text()}")


if __name__ == "__main__":
    main()
