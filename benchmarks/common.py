"""Shared helpers of the dvidshards benchmarks: data sets, timing, tables, memory.

Benchmark data is generated once into a work directory (``--workdir``, default
``$DVIDSHARDS_BENCH_DIR`` or ``<tmp>/dvidshards-bench``) and reused by later runs; a data set
is rebuilt when its parameters change. The real mCNS shard is read from ``--data`` (default
``../shared/data/dvid`` beside the project) and never copied: exports that need it hold
symlinks to it.

Every script prints Markdown tables, so its output can be pasted into ``RESULTS.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# benchmarks measure the compiled kernels: numba's own behaviour (compile on the first call and
# wait), not the first seconds of a fresh process, where formats.jit answers through fallbacks
# (bench_coldstart measures those, in child processes with the default mode)
os.environ.setdefault("DVIDSHARDS_KERNELS", "compiled")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import tensorstore as ts  # noqa: E402

import dvidshards  # noqa: E402

DEFAULT_DATA = ROOT.parent / "shared" / "data" / "dvid"
DEFAULT_WORK = Path(os.environ.get("DVIDSHARDS_BENCH_DIR", Path(tempfile.gettempdir()) / "dvidshards-bench"))
REAL_SHARD = "30720_24576_28672"  # mCNS scale 1, 258 records, shard extent 2048 voxels
CHUNK = 64
GIB = 1 << 30
MIB = 1 << 20


# --------------------------------------------------------------------------- command line


def parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark takes."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", type=Path, default=DEFAULT_WORK,
                   help=f"where generated data sets are kept between runs (default {DEFAULT_WORK})")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA,
                   help=f"folder with the real DVID files (default {DEFAULT_DATA})")
    p.add_argument("--quick", action="store_true", help="small sizes and few rounds: a smoke run")
    return p


def require_real_data(data: Path) -> Path:
    if not (data / f"{REAL_SHARD}.arrow").is_file():
        sys.exit(f"real DVID data not found in {data} (expected {REAL_SHARD}.arrow); pass --data DIR")
    return data


# --------------------------------------------------------------------------- machine


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def machine() -> str:
    """One paragraph describing the machine, the software and the command line."""
    from importlib.metadata import version

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    env = "".join(f"{k}={os.environ[k]} " for k in ("GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_") if k in os.environ)
    try:
        rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "dvidshards"], capture_output=True,
                               text=True, timeout=5).stdout.strip()
        rev = f"{rev}{' + uncommitted dvidshards/ changes' if dirty else ''}"
    except (OSError, subprocess.SubprocessError):
        rev = "?"
    return (f"machine: {os.cpu_count()} CPUs ({_cpu_model()}), {mem:.1f} GiB RAM, {platform.system()} "
            f"{platform.release()}; load average {load_text()}\n"
            f"software: Python {platform.python_version()}, "
            + ", ".join(f"{m} {version(m)}" for m in ("tensorstore", "numpy", "numba", "pyarrow", "zstandard"))
            + "; "
            f"dvidshards at {rev}\n"
            f"command: {env}{' '.join([Path(sys.executable).name, *sys.argv])}")


def load_text() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def header(title: str) -> None:
    print(f"# {title}\n")
    print(machine())
    print()


# --------------------------------------------------------------------------- timing


def alternate(fns: dict, rounds: int, warmup: int = 1) -> dict[str, list[float]]:
    """Time each callable ``rounds`` times, interleaved (A B C, B C A, ...); seconds per call.

    Interleaving spreads slow phases of a shared machine over every variant; rotating the
    start removes any advantage of going first. ``warmup`` untimed rounds come first.
    """
    names = list(fns)
    out = {n: [] for n in names}
    for r in range(warmup + rounds):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            gc.collect()
            t = time.perf_counter()
            fns[n]()
            dt = time.perf_counter() - t
            if r >= warmup:
                out[n].append(dt)
    return out


def med(v) -> float:
    return float(statistics.median(v))


def pct(v, q: float) -> float:
    return float(np.percentile(np.asarray(v, float), q))


def ms(s: float, digits: int = 1) -> str:
    return f"{s * 1e3:.{digits}f}"


def table(headers: list[str], rows: list[list], title: str | None = None) -> str:
    """A Markdown table (printed and returned)."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    lines = []
    if title:
        lines += [f"### {title}", ""]
    lines.append("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |")
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells:
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |")
    text = "\n".join(lines)
    print(text)
    print()
    return text


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


# --------------------------------------------------------------------------- memory


def rss() -> int:
    """Current resident set size in bytes."""
    return _status("VmRSS")


def peak_rss() -> int:
    """Peak resident set size in bytes since start (or since ``reset_peak_rss``)."""
    return _status("VmHWM")


def reset_peak_rss() -> bool:
    """Reset the kernel's peak RSS counter of this process (Linux ``clear_refs`` 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


# --------------------------------------------------------------------------- TensorStore


def context(dcc: int | None = None, cache_bytes: int = 0) -> ts.Context:
    """A context with TensorStore's cache off (or ``cache_bytes``) and optionally the copy pool size."""
    spec = {"cache_pool": {"total_bytes_limit": int(cache_bytes)}}
    if dcc is not None:
        spec["data_copy_concurrency"] = {"limit": int(dcc)}
    return ts.Context(spec)


def fill_store(shape, value: int = 3, ctx: ts.Context | None = None) -> ts.TensorStore:
    """The trivial-fill floor: a virtual_chunked volume like dvidshards' whose callback only fills."""

    def fill(domain, array, params):
        array.fill(value)

    kw = {} if ctx is None else {"context": ctx}
    return ts.virtual_chunked(
        fill, dtype=ts.uint64, domain=ts.IndexDomain(labels=["x", "y", "z"], shape=list(shape)),
        chunk_layout=ts.ChunkLayout(read_chunk_shape=[CHUNK] * 3, grid_origin=[0, 0, 0], inner_order=[2, 1, 0]),
        **kw)


def warm(store: ts.TensorStore, at=None) -> None:
    """Read one chunk on its own, so that loading the numba kernels is not part of any timing."""
    at = store.domain.inclusive_min if at is None else at
    store[tuple(slice(int(o), int(o) + 1) for o in at)].read().result()


def precomputed_spec(path: Path, scale: dict) -> dict:
    """The neuroglancer_precomputed spec a user would convert a DVID scale to (same sharding)."""
    sharding = {"@type": "neuroglancer_uint64_sharded_v1", "data_encoding": "raw",
                **{k: v for k, v in scale["sharding"].items() if k != "@type"}}
    return {
        "driver": "neuroglancer_precomputed",
        "kvstore": {"driver": "file", "path": str(path)},
        "multiscale_metadata": {"type": "segmentation", "data_type": "uint64", "num_channels": 1},
        "scale_metadata": {
            "size": scale["size"], "resolution": scale["resolution"], "voxel_offset": [0, 0, 0],
            "chunk_size": [CHUNK] * 3, "encoding": "compressed_segmentation",
            "compressed_segmentation_block_size": [8, 8, 8], "sharding": sharding,
        },
    }


def open_precomputed(path: Path, ctx: ts.Context | None = None) -> ts.TensorStore:
    """An existing precomputed volume as x, y, z (channel dropped)."""
    kw = {} if ctx is None else {"context": ctx}
    store = ts.open({"driver": "neuroglancer_precomputed", "kvstore": {"driver": "file", "path": str(path)}},
                    read=True, **kw).result()
    return store[ts.d["channel"][0]]


# --------------------------------------------------------------------------- data sets


def _fresh(folder: Path, params: dict) -> bool:
    """Whether folder holds a complete data set made with these parameters."""
    try:
        return json.loads((folder / "params.json").read_text()) == params
    except (OSError, ValueError):
        return False


def _done(folder: Path, params: dict) -> None:
    (folder / "params.json").write_text(json.dumps(params))


def _reset(folder: Path) -> None:
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)


class SyntheticPair:
    """A synthetic neuron-like export and the same voxels as sharded neuroglancer precomputed."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.export = folder / "export"
        self.precomputed = folder / "precomputed"
        self.spec = json.loads((folder / "spec.json").read_text())
        self.stats = json.loads((folder / "stats.json").read_text())

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.spec["scales"][0]["size"])

    def open(self, ctx: ts.Context | None = None, **kw) -> ts.TensorStore:
        return dvidshards.open(self.export, spec=self.spec, context=ctx, **kw)

    def open_precomputed(self, ctx: ts.Context | None = None) -> ts.TensorStore:
        return open_precomputed(self.precomputed, ctx)


def synthetic_pair(workdir: Path, size: int = 512, *, n_bodies: int = 200, svs_per_body: int = 8, seed: int = 1,
                   log=print) -> SyntheticPair:
    """Build (once) a size³ neuron-like export and its precomputed twin.

    ``neuron_volume`` with 200 bodies of 8 supervoxels fills ~70 % of a 512³ volume with a
    median of ~20 labels per 64³ block (the real mCNS shard: 2-105, median 14). The export is
    DVID's layout (mCNS sharding rule, 32³ chunks per shard); the precomputed volume holds the
    agglomerated labels (what dvidshards reads by default) as compressed_segmentation with the
    same sharding parameters, written by TensorStore. Rebuilt when ``dvidshards/writer.py`` changes.
    """
    import hashlib

    from dvidshards.demo.neurons import neuron_volume
    from dvidshards.writer import write_export

    writer = hashlib.sha1((ROOT / "dvidshards" / "writer.py").read_bytes()).hexdigest()[:12]
    params = {"kind": "synthetic_pair", "size": size, "n_bodies": n_bodies, "svs_per_body": svs_per_body,
              "seed": seed, "writer": writer, "version": 1}
    folder = workdir / f"synthetic-{size}-{n_bodies}x{svs_per_body}-s{seed}"
    if _fresh(folder, params):
        return SyntheticPair(folder)
    _reset(folder)
    t0 = time.perf_counter()
    log(f"building {folder} (once) ...")
    sv, mapping = neuron_volume((size,) * 3, n_bodies=n_bodies, svs_per_body=svs_per_body, seed=seed)
    spec = write_export(sv, folder / "export", mapping=mapping)
    (folder / "spec.json").write_text(json.dumps(spec))
    del sv
    # the precomputed twin holds exactly what dvidshards reads (agglomerated labels)
    vol = dvidshards.open(folder / "export", spec=spec)
    warm(vol)
    body = vol.read(order="F").result()
    dst = ts.open(precomputed_spec(folder / "precomputed", spec["scales"][0]), create=True,
                  delete_existing=True).result()
    with ts.Transaction() as txn:  # one shard file written once (not rewritten per chunk)
        dst.with_transaction(txn)[ts.d["channel"][0]].write(body).result()
    nlab = []
    zyx = body.T
    for z in range(0, size, CHUNK):
        for y in range(0, size, CHUNK):
            for x in range(0, size, CHUNK):
                nlab.append(len(np.unique(zyx[z:z + CHUNK, y:y + CHUNK, x:x + CHUNK])))
    stats = {
        "foreground": float((body != 0).mean()),
        "labels_per_chunk_median": float(np.median(nlab)),
        "labels_per_chunk_max": int(max(nlab)),
        "export_bytes": _du(folder / "export"),
        "precomputed_bytes": _du(folder / "precomputed"),
    }
    (folder / "stats.json").write_text(json.dumps(stats))
    _done(folder, params)
    log(f"built in {time.perf_counter() - t0:.0f} s")
    return SyntheticPair(folder)


def _du(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def real_records(data: Path) -> list[dict]:
    """The real mCNS shard's records as dicts (pyarrow), compressed blocks included."""
    import pyarrow as pa

    out = []
    with pa.OSFile(str(data / f"{REAL_SHARD}.arrow")) as f:
        for batch in pa.ipc.open_stream(f):
            out += batch.to_pylist()
    return out


def mcns_spec(data: Path) -> dict:
    return json.loads((data / "mcns-ng-specs.json").read_text())


def real_export(workdir: Path, data: Path) -> Path:
    """A one-shard export (scale 1 of the mCNS spec) whose shard is a symlink to the real one."""
    folder = workdir / "real-258"
    s1 = folder / "s1"
    if not (s1 / f"{REAL_SHARD}.arrow").exists():
        _reset(folder)
        s1.mkdir()
        (s1 / f"{REAL_SHARD}.arrow").symlink_to(data / f"{REAL_SHARD}.arrow")
        (s1 / f"{REAL_SHARD}.csv").symlink_to(data / f"{REAL_SHARD}-newformat.csv")
    return folder


def full_shard_records(records: list[dict], lo_chunk, n: int = 32, order: str = "zyx"):
    """Records for every chunk of an n³-chunk shard at chunk lo_chunk, reusing the real blocks cyclically.

    Record k (in ZYX order, as DVID writes) gets real record ``k % len(records)``'s block,
    labels and supervoxels.
    """
    x0, y0, z0 = (int(v) for v in lo_chunk)
    k = 0
    for z in range(n):
        for y in range(n):
            for x in range(n):
                r = records[k % len(records)]
                yield {"chunk_x": x0 + x, "chunk_y": y0 + y, "chunk_z": z0 + z, "labels": r["labels"],
                       "supervoxels": r["supervoxels"], "dvid_compressed_block": r["dvid_compressed_block"],
                       "uncompressed_size": r["uncompressed_size"]}
                k += 1


def synthetic_records(workdir: Path, size: int = 256, n_bodies: int = 60, seed: int = 1, log=print) -> list[dict]:
    """Records (as dicts, pyarrow) of a synthetic neuron-like size³ export written by ``write_export``.

    Needs no real data: the pool ``full_shard_records`` cycles through to fill big shards.
    """
    import pyarrow as pa

    from dvidshards.demo.neurons import neuron_volume
    from dvidshards.writer import write_export

    params = {"kind": "synthetic_records", "size": size, "n_bodies": n_bodies, "seed": seed, "version": 1}
    folder = workdir / f"records-{size}-{n_bodies}-s{seed}"
    if not _fresh(folder, params):
        _reset(folder)
        log(f"writing {folder} (once) ...")
        sv, mapping = neuron_volume((size,) * 3, n_bodies=n_bodies, seed=seed)
        write_export(sv, folder / "export", mapping=mapping, shard_chunks=size // CHUNK)
        _done(folder, params)
    out = []
    for arrow in sorted((folder / "export" / "s0").glob("*.arrow")):
        with pa.OSFile(str(arrow)) as f:
            for batch in pa.ipc.open_stream(f):
                out += batch.to_pylist()
    return out


def big_shard_export(workdir: Path, data: Path, shards=((30720, 24576, 28672),), name: str = "big-32768",
                     log=print) -> Path:
    """An mCNS-scale-1 export whose shards each hold all 32³ = 32,768 chunks of their box.

    Blocks are the real shard's, reused cyclically (~140 MB per shard). Geometry: the mCNS spec,
    scale 1 (shard extent 2048 voxels).
    """
    from dvidshards.writer import write_shard

    params = {"kind": name, "shards": [list(s) for s in shards], "version": 1}
    folder = workdir / name
    if _fresh(folder, params):
        return folder
    _reset(folder)
    (folder / "s1").mkdir()
    records = real_records(data)
    t0 = time.perf_counter()
    for o in shards:
        log(f"writing {folder}/s1/{o[0]}_{o[1]}_{o[2]} (32,768 records) ...")
        write_shard(folder / "s1" / f"{o[0]}_{o[1]}_{o[2]}", full_shard_records(records, [v // CHUNK for v in o]))
    _done(folder, params)
    log(f"built in {time.perf_counter() - t0:.0f} s")
    return folder


@contextlib.contextmanager
def quiet_gc():
    """Collect garbage once, then keep the collector off while timing."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
