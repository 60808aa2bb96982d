"""Mapping files: `LabelMapping.from_file` on 10⁶, 10⁷ and 10⁸ text rows, time and peak RSS.

Each load runs in a fresh process (so that its peak RSS is its own); the file is read once
beforehand so the page cache is warm. The baseline is the parser before the pyarrow.csv
rewrite (a Python loop over lines, taken from git at commit 4d13bce), run on 10⁶ rows only:
it needs ~1.9 s per million lines.

Files look like DVID's ``/mappings`` text output: ``supervoxel body`` per line, space
separated, supervoxel ids around 10¹¹ in random order, 50 supervoxels per body on average.
Each child checks what it loaded against an order-independent checksum of the generated rows.

    python benchmarks/bench_mapping.py            # 10⁶ (new and old), 10⁷, 10⁸
    python benchmarks/bench_mapping.py --quick    # 10⁶ and 10⁷ only
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).absolute().parent))

import common  # noqa: E402

BASELINE_COMMIT = "4d13bce"  # last commit with the line-by-line parser
_MIX = np.uint64(0x9E3779B97F4A7C15)


def _rows(n: int, seed: int, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows [start, stop) of an n-row mapping: unique supervoxels, shuffled by a bijection."""
    i = np.arange(start, stop, dtype=np.uint64)
    # a bijection of [0, n) scrambles the order without holding a permutation of n in memory
    a = np.uint64(2_654_435_761 if n % 2_654_435_761 else 40_503)
    j = (i * a + np.uint64(seed)) % np.uint64(n)
    sv = np.uint64(100_000_000_000) + j * np.uint64(7)
    body = np.uint64(100_000_000_000) + (j // np.uint64(50)) * np.uint64(350)
    return sv, body


def checksum(keys: np.ndarray, values: np.ndarray) -> int:
    """Order-independent checksum of (supervoxel, body) rows."""
    with np.errstate(over="ignore"):
        return int(np.sum((keys * _MIX) ^ values, dtype=np.uint64))


def make_file(workdir: Path, n: int, seed: int = 1, log=print) -> tuple[Path, int]:
    """Write (once) an n-row text mapping; returns its path and checksum."""
    import pyarrow as pa
    import pyarrow.csv as pcsv

    folder = workdir / "mappings"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"mapping-{n}.txt"
    meta = folder / f"mapping-{n}.json"
    params = {"n": n, "seed": seed, "version": 1}
    try:
        m = json.loads(meta.read_text())
        if m["params"] == params and path.stat().st_size == m["bytes"]:
            return path, m["checksum"]
    except (OSError, ValueError, KeyError):
        pass
    t = time.perf_counter()
    log(f"writing {path} ({n:,} rows, once) ...")
    total = np.uint64(0)
    opts = pcsv.WriteOptions(include_header=False, delimiter=" ", quoting_style="none")
    with pcsv.CSVWriter(str(path), pa.schema([("sv", pa.uint64()), ("body", pa.uint64())]),
                        write_options=opts) as w:
        step = 5_000_000
        for lo in range(0, n, step):
            sv, body = _rows(n, seed, lo, min(n, lo + step))
            with np.errstate(over="ignore"):
                total += np.sum((sv * _MIX) ^ body, dtype=np.uint64)
            w.write_table(pa.table({"sv": sv, "body": body}))
    meta.write_text(json.dumps({"params": params, "bytes": path.stat().st_size, "checksum": int(total)}))
    log(f"  {path.stat().st_size / common.MIB:.0f} MiB in {time.perf_counter() - t:.0f} s")
    return path, int(total)


def _old_parser():
    """The line-by-line parser of commit 4d13bce, loaded from git."""
    src = subprocess.run(["git", "-C", str(Path(__file__).resolve().parents[1]), "show", f"{BASELINE_COMMIT}:dvidshards/formats/mapping.py"],
                         capture_output=True, text=True, check=True).stdout
    src = src.replace("from ..errors import MappingError", "from dvidshards.errors import MappingError")
    src = src.replace("cache=True", "cache=False")  # exec'd source has no file to cache beside
    mod = types.ModuleType("old_mapping")
    mod.__file__ = "<old_mapping>"
    exec(compile(src, "old_mapping.py", "exec"), mod.__dict__)  # noqa: S102 - our own source from git
    return mod.LabelMapping


def child(which: str, path: str, expect: int) -> None:
    """Load one file in this process; print a JSON line of timings and memory."""
    from dvidshards.formats import mapping as new

    cls = _old_parser() if which == "old" else new.LabelMapping
    warm = Path(path).with_name("warm-up.txt")  # compile/load the kernels before measuring
    warm.write_text("sv body\n3 30\n1 10\n")
    cls.from_file(warm)
    build = [0.0]
    name = "_set" if hasattr(cls, "_set") else "__init__"  # sorting and checks, after parsing
    inner = getattr(cls, name)

    def timed(self, *a, **kw):
        t = time.perf_counter()
        inner(self, *a, **kw)
        build[0] += time.perf_counter() - t

    setattr(cls, name, timed)
    base = common.rss()
    common.reset_peak_rss()
    c = _cpu()
    t = time.perf_counter()
    m = cls.from_file(path)
    dt = time.perf_counter() - t
    cpu = _cpu() - c
    peak = common.peak_rss()
    ok = len(m.keys) > 0 and checksum(m.keys, m.values) == expect
    print(json.dumps({"seconds": dt, "cpu": cpu, "build": build[0], "peak": peak, "base": base, "rows": len(m),
                      "ok": ok, "load": common.load_text()}))


def _cpu() -> float:
    """CPU seconds of this process, every thread (user + system): what a busy machine does not inflate."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run_child(which: str, path: Path, expect: int) -> dict:
    with open(path, "rb") as f:  # warm the page cache
        while f.read(64 << 20):
            pass
    out = subprocess.run([sys.executable, __file__, "--child", which, str(path), str(expect)],
                         capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"child {which} {path} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = common.parser(__doc__.split("\n")[0])
    p.add_argument("--child", nargs=3, help=argparse_hidden())
    p.add_argument("--rows", type=int, nargs="+", help="row counts to load (default 10⁶ 10⁷ 10⁸)")
    args = p.parse_args()
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]))
        return
    common.header("bench_mapping: LabelMapping.from_file on text mappings")
    sizes = args.rows or ([10**6, 10**7] if args.quick else [10**6, 10**7, 10**8])
    rows, res = [], {}
    for n in sizes:
        path, expect = make_file(args.workdir, n)
        size = path.stat().st_size
        for which in (["old", "new"] if n == 10**6 else ["new"]):
            r = run_child(which, path, expect)
            res[which, n] = r
            rows.append([
                "line loop (4d13bce)" if which == "old" else "pyarrow.csv (now)",
                f"{n:,}", f"{size / common.MIB:.0f}", f"{r['seconds']:.2f}",
                f"{r['seconds'] - r['build']:.2f}", f"{r['build']:.2f}", f"{r['cpu']:.1f}",
                f"{r['seconds'] / n * 1e6:.2f}", f"{r['peak'] / common.MIB:.0f}",
                f"{(r['peak'] - r['base']) / common.MIB:.0f}", f"{(r['peak'] - r['base']) / (16 * n):.1f}",
                "yes" if r["ok"] else "NO", r["load"]])
    common.table(["parser", "rows", "file MiB", "load s", "parse s", "sort+check s", "CPU s", "s per 10⁶ rows",
                  "peak RSS MiB", "peak − before MiB", "added / result size", "exact", "load average after"], rows,
                 title="text mapping load (fresh process each, page cache warm)")
    if ("old", 10**6) in res:
        old, new = res["old", 10**6], res["new", 10**6]
        print(f"10⁶ rows: pyarrow.csv loads {old['seconds'] / new['seconds']:.1f} × faster than the line loop "
              f"({new['seconds']:.2f} s vs {old['seconds']:.2f} s)")
    if ("new", 10**8) in res:
        r = res["new", 10**8]
        print(f"10⁸ rows in {r['seconds']:.1f} s ({r['cpu']:.1f} CPU s on {os.cpu_count()} cores): target < 60 s "
              f"{common.verdict(r['seconds'] < 60)}; load average now {common.load_text()}")


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
