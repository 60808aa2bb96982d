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
chunk (wall and CPU), second chunk.

Exit: ``dvidshards verify --decode`` of the same export as a command line user runs it, cold and
warm: its wall time and the time from its last line of output to its exit (what a user waits
for after the work is done). "in-process compile" is the behaviour before the helper process
(the background thread compiles, and the exit waits for the compile in flight), selected with
the helper's own environment variable, so that both run in this script. With ``--profile`` every ``Dispatcher.compile`` call in a cold
and a warm process is timed in thread CPU seconds (inclusive of nested compiles; "self" excludes
them) and the slowest are listed, with their signatures:
with a warm cache a "compile" is a load from the cache.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid

import common as C

from dvidshards.runtime import kernels

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
import dvidshards.runtime  # (what import dvidshards installs: the kernel compiler)
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
    from dvidshards.demo.neurons import neuron_volume
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


_STATS_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from dvidshards.formats import blockstats
if sys.argv[2] == "before":  # block statistics without its numpy fallback, as before issue 22's follow-up
    blockstats._batch.fallback = None
import dvidshards
import dvidshards.runtime
from dvidshards.jobs.stats import body_stats_table
t1 = time.perf_counter()
ds = dvidshards.Dataset(sys.argv[1], spec=json.loads(open(sys.argv[3]).read()))
t = body_stats_table(ds, scale=0, labels="agglomerated", scheduler="serial", progress=False)
t2 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "stats": t2 - t1, "rows": t.num_rows, "ready": blockstats._batch.ready}))
import os
os._exit(0)  # what is still compiling is the helper's (as a worker that goes on to its next task)
"""


def run_stats_child(export, spec, cache_dir: str, before: bool) -> dict:
    """A fresh worker's first ``stats`` work (the demo export at s0, serial), cold numba cache."""
    tag = f"stats-{uuid.uuid4().hex}"
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir, DVIDSHARDS_BENCH_TAG=tag)
    env.pop("DVIDSHARDS_KERNELS", None)
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", _STATS_CHILD, str(export), "before" if before else "now", str(spec)],
                       capture_output=True, text=True, env=env, cwd=str(C.ROOT), check=False)
    if r.returncode:
        raise SystemExit(f"stats child failed:\n{r.stderr}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["wall"] = time.perf_counter() - t
    while _helpers_running(tag):  # the child's helper still compiling: not on the next run's cores
        time.sleep(0.2)
    return out


def _helpers_running(tag: str) -> bool:
    """Whether a process whose environment carries ``tag`` (a kernel helper left behind) runs."""
    for env in glob.glob("/proc/[0-9]*/environ"):
        try:
            with open(env, "rb") as f:
                if tag.encode() in f.read():
                    return True
        except OSError:
            pass
    return False


def run_cli(export, spec, cache_dir: str, in_process: bool) -> dict:
    """``dvidshards verify --decode`` in a new process: wall time and the lag from its last output line to its exit."""
    tag = f"DVIDSHARDS_BENCH_TAG=exit-{uuid.uuid4().hex}"
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir, DVIDSHARDS_BENCH_TAG=tag.partition("=")[2])
    env.pop("DVIDSHARDS_KERNELS", None)
    env.pop(kernels._HELPER_ENV, None)
    if in_process:
        env[kernels._HELPER_ENV] = "1"  # no helper: compile in this process and wait for it at exit
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "dvidshards.cli", "verify", str(export), "--spec", str(spec),
                          "--decode"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=str(C.ROOT),
                         text=True)
    last, lines = t0, []
    assert p.stdout is not None
    for line in p.stdout:
        last = time.perf_counter()
        lines.append(line)
    code = p.wait()
    end = time.perf_counter()
    if code:
        raise SystemExit(f"dvidshards verify failed ({code}):\n{''.join(lines)}")
    while _helpers_running(tag):  # the helper finishing the cache: not on the next run's cores
        time.sleep(0.2)
    return {"wall": end - t0, "lag": end - last, "helper_done": time.perf_counter() - t0}


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
        exits = {"cold, helper process (now)": [], "cold, in-process compile (before)": [], "warm": []}
        for i in range(repeat):
            for in_process in (False, True):
                d = os.path.join(tmp, f"exit{i}-{int(in_process)}")
                os.mkdir(d)
                key = "cold, in-process compile (before)" if in_process else "cold, helper process (now)"
                exits[key].append(run_cli(export, spec, d, in_process))
            exits["warm"].append(run_cli(export, spec, os.path.join(tmp, f"exit{i}-0"), False))
        first_stats: dict = {"numpy fallback while numba compiles (now)": [],
                             "compile first (before: no fallback for block statistics)": []}
        for i in range(repeat):
            for before, key in ((False, "numpy fallback while numba compiles (now)"),
                                (True, "compile first (before: no fallback for block statistics)")):
                d = os.path.join(tmp, f"stats{i}-{int(before)}")
                os.mkdir(d)
                first_stats[key].append(run_stats_child(export, spec, d, before))
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
    C.table(["numba cache", "wall s", "last output line to exit s (median)", "max s",
             "helper done at s (cold cache filled)"],
            [[k, f"{C.med([r['wall'] for r in v]):.2f}", f"{C.med([r['lag'] for r in v]):.2f}",
              f"{max(r['lag'] for r in v):.2f}", f"{C.med([r['helper_done'] for r in v]):.2f}"] for k, v in exits.items()],
            title=f"`dvidshards verify --decode` of the demo export: the wait after the work (medians of {repeat})")
    C.table(["block statistics", "body_stats s", "process wall s", "bodies", "kernel compiled by the end"],
            [[k, f"{C.med([r['stats'] for r in v]):.2f}", f"{C.med([r['wall'] for r in v]):.2f}", v[0]["rows"],
              ", ".join(sorted({str(r["ready"]) for r in v}))] for k, v in first_stats.items()],
            title=f"A fresh worker's first stats work, cold numba cache: `body_stats` of the demo export at s0, "
                  f"serial (medians of {repeat})")
    cold = C.med([r["import"] + r["open"] + r["first"] for r in res["cold"]])
    warm = C.med([r["import"] + r["open"] + r["first"] for r in res["warm"]])
    cold_first = C.med([r["first"] for r in res["cold"]])
    warm_first = C.med([r["first"] for r in res["warm"]])
    C.table(["target (issues 11, 25)", "measured", "verdict"], [
        ["first chunk read of a fresh process, cold numba cache ≤ 3 s",
         f"{cold_first:.2f} s first read ({cold:.2f} s import + open + read)", C.verdict(cold_first <= 3.0)],
        ["the same with the cache warm ≤ 0.5 s",
         f"{warm_first:.2f} s first read ({warm:.2f} s import + open + read)", C.verdict(warm_first <= 0.5)],
        ["a command exits promptly with a cold cache: last line to exit ≤ warm + 0.5 s",
         f"{C.med([r['lag'] for r in exits['cold, helper process (now)']]):.2f} s cold, "
         f"{C.med([r['lag'] for r in exits['warm']]):.2f} s warm "
         f"(in-process compile: {C.med([r['lag'] for r in exits['cold, in-process compile (before)']]):.2f} s)",
         C.verdict(C.med([r["lag"] for r in exits["cold, helper process (now)"]])
                   <= C.med([r["lag"] for r in exits["warm"]]) + 0.5)],
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
