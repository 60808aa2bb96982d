"""What the zstd checksums cost ``verify`` (issue 16): HEAD against the package at f2540fd.

Before f2540fd's successor, ``verify(decode=False)`` only loaded every shard and checked its
index; now it also decompresses every payload, so each frame's zstd content checksum is
checked. This script times, each call in a fresh subprocess (interpreter start and imports not
counted; the numba cache load is), and a second identical call in the same process
(``verify`` loads shards itself, without the dataset's shard cache), ``dvidshards.verify(root, spec=..., decode=False)`` and
``decode=True`` with the package at HEAD and with the package at f2540fd (extracted with
``git archive`` to a temporary folder and put first on ``PYTHONPATH``), on:

1. the real mCNS shard (scale 1, 258 records) laid out as an export of symlinks;
2. a synthetic neuron-like export of 1024³ = 1.07 Gvoxel: the 512³ ``neuron_volume`` +
   ``write_export`` export tiled 2×2×2 (see `synthetic_export`), built once and reused.

One untimed round warms the page cache and the numba caches; the variants then run
interleaved (rotating order) for ``--rounds`` rounds, and the median is reported. The load
average is printed with every table: the machine is shared.

    python benchmarks/bench_verify.py [--rounds 3] [--tiles 2]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import (
    GIB,
    ROOT,
    _done,
    _fresh,
    _reset,
    header,
    load_text,
    mcns_spec,
    med,
    parser,
    real_export,
    require_real_data,
    synthetic_pair,
    table,
)

BEFORE = "f2540fd"

# the child: time one verify call, print what it checked as JSON on the last line
CHILD = r"""
import json, sys, time
import dvidshards
root, spec, decode = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
t = time.perf_counter()
r = dvidshards.verify(root, spec=spec, decode=decode)
dt = time.perf_counter() - t
t = time.perf_counter()
r2 = dvidshards.verify(root, spec=spec, decode=decode)
dt2 = time.perf_counter() - t
assert r2.ok == r.ok and r2.chunks == r.chunks
print(json.dumps({"s": dt, "s2": dt2, "ok": bool(r.ok), "shards": r.shards, "chunks": r.chunks,
                  "decompressed": getattr(r, "decompressed", None), "decoded": r.decoded,
                  "problems": [str(p) for p in r.problems[:3]], "pkg": dvidshards.__file__}))
"""


def extract_before(dest: Path) -> Path:
    """The package at ``BEFORE`` under ``dest`` (extracted once)."""
    if not (dest / "dvidshards" / "__init__.py").is_file():
        dest.mkdir(parents=True, exist_ok=True)
        arch = subprocess.run(["git", "-C", str(ROOT), "archive", BEFORE, "dvidshards"], check=True,
                              capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=arch, check=True)
    return dest


def synthetic_export(workdir: Path, tiles: int = 2) -> Path:
    """A one-scale export of ``tiles``³ copies of the 512³ synthetic export (built once).

    ``neuron_volume`` of 1024³ takes far too long on a loaded 2-core machine, so the 512³
    ``neuron_volume`` + ``write_export`` export of `common.synthetic_pair` (200 bodies × 8
    supervoxels, ~70 % foreground) is repeated ``tiles`` times along each axis: its records,
    payloads unchanged, with chunk coordinates shifted, written by `write_shard` in ZYX order
    with the spec `write_export` would give the larger volume (`default_sharding`).
    """
    pair = synthetic_pair(workdir)
    n = 512 * tiles
    folder = workdir / ("verify-1g" if tiles == 2 else f"verify-{n}")
    params = {"kind": "verify-tiled", "from": pair.folder.name, "tiles": tiles, "version": 1}
    if _fresh(folder, params):
        return folder
    import pyarrow as pa

    from dvidshards.writer import _sharding_json, default_sharding, write_shard

    _reset(folder)
    spec = json.loads(json.dumps(pair.spec))
    sc = spec["scales"][0]
    assert sc["size"] == [512, 512, 512] and len(spec["scales"]) == 1, sc
    sc["size"] = [n, n, n]
    sc["sharding"] = _sharding_json(default_sharding(sc["size"]))
    src = sorted((pair.export / "s0").glob("*.arrow"))
    assert [f.name for f in src] == ["0_0_0.arrow"], src
    with pa.OSFile(str(src[0])) as f:
        recs = [r for b in pa.ipc.open_stream(f) for r in b.to_pylist()]
    g = 512 // 64
    out = []
    for tz in range(tiles):
        for ty in range(tiles):
            for tx in range(tiles):
                for r in recs:
                    out.append(dict(r, chunk_x=r["chunk_x"] + tx * g, chunk_y=r["chunk_y"] + ty * g,
                                    chunk_z=r["chunk_z"] + tz * g))
    out.sort(key=lambda r: (r["chunk_z"], r["chunk_y"], r["chunk_x"]))
    (folder / "export" / "s0").mkdir(parents=True)
    write_shard(folder / "export" / "s0" / "0_0_0", out, batch_size=spec.get("batch_size", 1))
    (folder / "spec.json").write_text(json.dumps(spec))
    _done(folder, params)
    return folder


def run(pkg_path: Path, root: Path, spec: Path, decode: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=str(pkg_path))
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", CHILD, str(root), str(spec), "1" if decode else "0"], env=env,
                       capture_output=True, text=True, cwd="/")
    wall = time.perf_counter() - t
    if p.returncode:
        sys.exit(f"child failed ({pkg_path}, {root}, decode={decode}):\n{p.stderr}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    want = str(pkg_path / "dvidshards")
    if not out["pkg"].startswith(want):
        sys.exit(f"child imported {out['pkg']}, not the package under {want}")
    out["wall"] = wall
    out["load"] = os.getloadavg()[0]
    return out


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (median reported; default 3)")
    p.add_argument("--tiles", type=int, default=2,
                   help="copies of the 512³ synthetic export per axis (default 2: 1024³ = 1.07 Gvoxel)")
    p.add_argument("--before-dir", type=Path, default=Path(f"/tmp/dvidshards-{BEFORE}"),
                   help=f"where the package at {BEFORE} is extracted (default /tmp/dvidshards-{BEFORE})")
    args = p.parse_args()
    if args.quick:
        args.tiles, args.rounds = 1, 1
    data = require_real_data(args.data)
    header("verify: the cost of zstd checksums without --decode (issue 16)")

    real = real_export(args.workdir, data)
    real_spec = data / "mcns-ng-specs.json"
    mcns_spec(data)  # readable JSON
    syn = synthetic_export(args.workdir, args.tiles)
    inputs = {"real mCNS shard": (real, real_spec), "synthetic": (syn / "export", syn / "spec.json")}
    pkgs = {"HEAD": ROOT, BEFORE: extract_before(args.before_dir)}

    variants = [(i, k, d) for i in inputs for k in pkgs for d in (False, True)]
    res: dict = {v: [] for v in variants}
    loads = []
    for r in range(1 + args.rounds):  # round 0: warm-up, untimed
        k = r % len(variants)
        for v in variants[k:] + variants[:k]:
            i, pk, d = v
            out = run(pkgs[pk], *inputs[i], d)
            if not out["ok"]:
                sys.exit(f"verify found problems in {i} ({pk}, decode={d}): {out['problems']}")
            if r:
                res[v].append(out)
                loads.append(out["load"])
        print(f"round {r} done, load {load_text()}", file=sys.stderr)

    syn_spec = json.loads((syn / "spec.json").read_text())["scales"][0]
    size = syn_spec["size"]
    du = sum(f.stat().st_size for f in (syn / "export").rglob("*") if f.is_file())
    s0 = res[("synthetic", "HEAD", False)][0]
    r0 = res[("real mCNS shard", "HEAD", False)][0]
    table(["data", "value"], [
        ["real mCNS shard", f"s1/{real.name} symlinks: 1 shard, {r0['chunks']} chunks"],
        ["synthetic", f"{size[0]}×{size[1]}×{size[2]} = {size[0] * size[1] * size[2] / 1e9:.2f} Gvoxel, "
                      f"{args.tiles}³ tiles of the 512³ neuron_volume(200 bodies × 8 sv) export, 1 scale: {s0['shards']} shards, "
                      f"{s0['chunks']} chunks, {du / GIB * 1024:.0f} MiB on disk"],
        ["rounds", f"1 untimed warm-up + {args.rounds} timed, interleaved, each call a fresh subprocess"],
        ["load average (1 min) during timed runs", f"min {min(loads):.2f}, median {med(loads):.2f}, "
                                                   f"max {max(loads):.2f}"],
    ], title="Data")

    rows = []
    for i in inputs:
        for pk in pkgs:
            for d in (False, True):
                v = res[(i, pk, d)]
                s = [o["s"] for o in v]
                s2 = [o["s2"] for o in v]
                rows.append([i, pk, "True" if d else "False", f"{med(s) * 1e3:.1f}",
                             f"{min(s) * 1e3:.1f}", f"{max(s) * 1e3:.1f}", f"{med(s2) * 1e3:.1f}", f"{med([o['wall'] for o in v]):.2f}",
                             v[0]["decompressed"] if v[0]["decompressed"] is not None else "–", v[0]["decoded"],
                             f"{med([o['load'] for o in v]):.2f}"])
    table(["data", "package", "decode", "1st call median ms", "min ms", "max ms", "2nd call median ms",
           "subprocess wall s (median)",
           "payloads decompressed", "blocks decoded", "load (1 min)"], rows,
          title="verify(root, spec=..., decode=...), time of the call")

    rows = []
    for i in inputs:
        for key, call in (("s", "1st (fresh process)"), ("s2", "2nd (same process)")):
            m = {(pk, d): med([o[key] for o in res[(i, pk, d)]]) for pk in pkgs for d in (False, True)}
            rows.append([i, call, f"{m[('HEAD', False)] / m[(BEFORE, False)]:.2f}",
                         f"{m[('HEAD', True)] / m[(BEFORE, True)]:.2f}",
                         f"{m[('HEAD', False)] / m[('HEAD', True)]:.2f}",
                         f"{(m[('HEAD', False)] - m[(BEFORE, False)]) * 1e3:.1f}",
                         f"{(m[(BEFORE, True)] - m[(BEFORE, False)]) * 1e3:.1f}"])
    table(["data", "call", f"decode=False: HEAD ÷ {BEFORE}", f"decode=True: HEAD ÷ {BEFORE}",
           "HEAD: decode=False ÷ decode=True", f"checksum pass ms (HEAD − {BEFORE}, decode=False)",
           f"decode pass ms ({BEFORE}: True − False)"], rows, title="Ratios (medians)")


if __name__ == "__main__":
    main()
