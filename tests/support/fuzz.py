"""Structure-aware fuzzing of whole exports, through the public API only.

A *template* is a clean export (the real mCNS shard with one of its three CSV indexes, or a
synthetic export written by `dvidshards.writer.write_export`) plus an independent reference:
a digest of every chunk in both label modes, computed with pyarrow + ``decode_block`` (real)
or from the volume the export was written from (synthetic).

A *trial* copies one template into a scratch folder, applies one or two mutations chosen by
``numpy.random.default_rng([seed, kind, trial])`` to one region of one shard file or index,
then opens it with ``dvidshards.open``, reads every chunk in both label modes and runs
``dvidshards.verify(decode=True)``.  The outcome is classified:

``exact``
    every chunk equals the reference (verify may or may not flag the damage).
``typed``
    something raised a `DvidShardsError` and no chunk read returned wrong data.
``data_silent``
    a label-value or payload mutation read without error but differs (DVID has no checksum
    on label lists: reported apart, not a loader bug).
``struct_silent``
    a container or index mutation read without error and differs: a bug.
``untyped``
    any other exception: a bug.
``crash`` / ``hang``
    the worker process died from a signal, or did not answer within the timeout.
``harness_error``
    this module failed (a mutation it could not build, a worker exiting without a signal).

Two flags are counted beside the class: ``verify_missed`` (``verify`` said ok while a read
differed) and ``unnamed`` (a typed chunk-read error whose message names no chunk or no file).

Trials run in worker processes (`Campaign`), restarted after a crash, a hang or when their
RSS passes a cap, so every crash is counted and attributed to its trial.  ``python -m
tests.support.fuzz worker|memory|repro`` are the entry points the campaign, the tests
and benchmarks/fuzz_shards.py use.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import hashlib
import json
import os
import queue
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "BAD",
    "CLASSES",
    "CSV_REGIONS",
    "FAIL",
    "SHARD_REGIONS",
    "Campaign",
    "Mutation",
    "Template",
    "arrow_map",
    "build_templates",
    "mutate",
    "run_trial",
]

REAL_SHARD = "30720_24576_28672"
REAL_CSVS = {"A": f"{REAL_SHARD}-newformat.csv", "B": f"{REAL_SHARD}-offsets.csv", "C": f"{REAL_SHARD}.csv"}
SYN_SHAPE = (190, 150, 140)  # 3x3x3 chunks, 2x2x2 shards of 128 voxels, cropped edge chunks
MODES = ("agglomerated", "supervoxels")
KINDS = {"shard": 1, "csv": 2}

# outcome classes, worst first (a trial gets the worst that applies); harness_error: a bug of
# this module (a mutation that could not be built, a worker that exited without a signal)
CLASSES = ("harness_error", "crash", "hang", "untyped", "struct_silent", "data_silent", "typed", "exact")
BAD = ("crash", "hang", "untyped", "struct_silent")
FAIL = ("harness_error",) + BAD  # what a campaign must not see

# region -> weight; regions that do not apply to a template are skipped
SHARD_REGIONS = {
    "schema": 9, "batch_meta": 11, "row_count": 5, "field_nodes": 6, "buffers": 16, "list_offsets": 10,
    "coords": 6, "label_values": 7, "payload": 7, "end_of_stream": 5, "order": 9, "truncation": 5,
    "footer": 4,
}
CSV_REGIONS = {"csv_field": 40, "csv_rows": 25, "csv_header": 15, "csv_text": 12, "csv_reorder": 8}
DATA_ONLY = {"label_values", "payload"}  # no checksum can catch these: reported apart
IN_PLACE = {"schema", "batch_meta", "row_count", "field_nodes", "buffers", "list_offsets", "coords",
            "label_values", "payload"}  # same file size: two of them can be combined

I64_SPECIAL = (0, 1, 2, -1, -2, 7, 8, 2**31 - 1, 2**31, 2**31 + 1, 2**32 - 1, 2**32, 2**32 + 1, -(2**31),
               2**61, 2**62, 2**63 - 1, 2**63 - 2, 2**63 - 8, -(2**63), -(2**63) + 1, 2**64 - 8,
               (2**63 - 1) // 12 + 1, (2**63 - 1) // 8 + 1, (2**63 - 1) // 16 + 1)


# --------------------------------------------------------------------------- small helpers


def rss_bytes(pid: int | str = "self") -> int:
    """VmRSS of a process (bytes), 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _proc_counts() -> dict:
    """Threads, open fds and memory-mapped regions of this process (leak indicators)."""
    out = {"threads": threading.active_count(), "os_threads": 0, "fds": 0, "maps": 0, "arrow_maps": 0,
           "deleted_arrow_maps": 0, "deleted_fds": 0}
    with contextlib.suppress(OSError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Threads:"):
                    out["os_threads"] = int(line.split()[1])
        fds = os.listdir("/proc/self/fd")
        out["fds"] = len(fds)
        for fd in fds:
            with contextlib.suppress(OSError):
                out["deleted_fds"] += os.readlink(f"/proc/self/fd/{fd}").endswith("(deleted)")
        with open("/proc/self/maps") as f:
            lines = f.readlines()
        out["maps"] = len(lines)
        out["arrow_maps"] = sum(1 for ln in lines if ".arrow" in ln)
        # maps of shard files already deleted (earlier trials' copies): something still holds them
        out["deleted_arrow_maps"] = sum(1 for ln in lines if ".arrow (deleted)" in ln)
    return out


_WEIGHTS: list = []


def _digest(a: np.ndarray) -> str:
    """Fingerprint of an (x, y, z) chunk: sum of voxels times fixed random odd weights (mod 2^64).

    Any single changed voxel changes it (odd weights); a cryptographic hash of 2 MB chunks cost
    ~10x more and dominated the trials.
    """
    if not _WEIGHTS:
        _WEIGHTS.append(np.random.default_rng(12345).integers(0, 2**63, 64**3, dtype=np.uint64) * 2 + 1)
    flat = np.ravel(a, order="F").astype(np.uint64, copy=False)
    w = _WEIGHTS[0]
    if flat.size > w.size:
        return hashlib.blake2b(flat.tobytes(), digest_size=12).hexdigest()
    return f"{int(np.multiply(flat, w[:flat.size]).sum()):x}:{flat.size}:{a.shape}"


def _put(buf: bytearray, pos: int, width: int, value: int) -> int:
    """Write value (wrapped to width bytes, little-endian) at pos; returns the old unsigned value."""
    old = int.from_bytes(buf[pos:pos + width], "little")
    buf[pos:pos + width] = (value % (1 << (8 * width))).to_bytes(width, "little")
    return old


def _get(buf, pos: int, width: int, signed: bool = True) -> int:
    return int.from_bytes(bytes(buf[pos:pos + width]), "little", signed=signed)


def _special(rng: np.random.Generator, old: int, width: int, related=()) -> int:
    """An integer tweak: a boundary value, a neighbour of one, or one aimed at a sum overflowing."""
    rel = [int(r) for r in related]
    cands = list(I64_SPECIAL) + [old + 1, old - 1, old + 8, old - 8, 2 * old, old + 2**31, old + 2**32]
    cands += rel + [r + d for r in rel for d in (-8, -1, 1, 8)]
    cands += [2**63 - r - d for r in rel + [old] for d in (0, 1)]  # off + len just past 2^63
    cands += [2**64 - r for r in rel if r > 0]  # -r as unsigned
    mod = 1 << (8 * width)
    for _ in range(20):
        v = int(cands[int(rng.integers(len(cands)))])
        if rng.random() < 0.25:
            v += int(rng.integers(-3, 4))
        if (v - old) % mod:
            return v
    return old + 1


# --------------------------------------------------------------------------- Arrow IPC map


@dataclass
class Message:
    """One IPC message located in a file (all positions absolute)."""

    offset: int
    prefix: int
    meta_len: int
    body_len: int
    kind: str  # "schema", "batch" or "eos"
    bodylen_pos: int = -1
    length_pos: int = -1  # RecordBatch.length (rows)
    rows: int = 0
    nodes_pos: int = -1  # vector length u32; FieldNode structs follow
    n_nodes: int = 0
    buffers_pos: int = -1
    n_buffers: int = 0
    buffers: list = field(default_factory=list)  # (offset, length) relative to the body

    @property
    def meta_start(self) -> int:
        return self.offset + self.prefix

    @property
    def body_start(self) -> int:
        return self.meta_start + self.meta_len

    @property
    def end(self) -> int:
        return self.body_start + self.body_len

    def node_pos(self, k: int) -> int:
        return self.nodes_pos + 4 + 16 * k

    def buffer_pos(self, k: int) -> int:
        return self.buffers_pos + 4 + 16 * k


@dataclass
class ArrowMap:
    """Where everything is in one shard file."""

    size: int
    is_file: bool
    messages: list
    buffer_roles: list  # per buffer of a batch: (column, role)
    node_names: list
    ipc_end: int  # end of the IPC part (before a CHUNKIDX footer)
    footer: tuple | None = None  # IPC file footer: (start, length, blocks_pos, n_blocks)
    json_footer: tuple | None = None  # CHUNKIDX: (json start, json length)

    @property
    def batches(self) -> list:
        return [m for m in self.messages if m.kind == "batch"]

    @property
    def schema(self) -> Message:
        return self.messages[0]

    def role(self, column: str, role: str) -> int:
        return self.buffer_roles.index((column, role))


def _fb_field(b: bytes, t: int, k: int) -> int:
    """Absolute position of field k of the flatbuffer table at t (-1: absent)."""
    vt = t - _get(b, t, 4)
    vsize = _get(b, vt, 2, False)
    if 4 + 2 * k + 2 > vsize:
        return -1
    fo = _get(b, vt + 4 + 2 * k, 2, False)
    return t + fo if fo else -1


def _fb_deref(b: bytes, p: int) -> int:
    return p + _get(b, p, 4, False)


def _layout(schema) -> tuple[list, list]:
    """(buffer roles, node names) of a record batch of this schema."""
    import pyarrow as pa

    roles, nodes = [], []
    for f in schema:
        t = f.type
        nodes.append(f.name)
        if pa.types.is_list(t) or pa.types.is_large_list(t):
            nodes.append(f.name + ".item")
            roles += [(f.name, "validity"), (f.name, "offsets"), (f.name + ".item", "validity"),
                      (f.name + ".item", "values")]
        elif pa.types.is_binary(t) or pa.types.is_large_binary(t):
            roles += [(f.name, "validity"), (f.name, "offsets"), (f.name, "values")]
        else:
            roles += [(f.name, "validity"), (f.name, "values")]
    return roles, nodes


def arrow_map(data: bytes) -> ArrowMap:
    """Locate every message, batch header field and buffer of a clean shard file.

    Envelopes and flatbuffer tables are walked here (pyarrow does not expose positions); each
    message is cross-checked with ``pyarrow.ipc.read_message`` and each batch with pyarrow's
    own decoding, so a wrong map fails loudly instead of aiming mutations at the wrong bytes.
    """
    import pyarrow as pa

    size = len(data)
    ipc_end = size
    json_footer = None
    if data.endswith(b"CHUNKIDX"):
        n = _get(data, size - 16, 8, False)
        json_footer = (size - 16 - n, n)
        ipc_end = size - 16 - n
    is_file = data[:6] == b"ARROW1"
    p = 8 if is_file else 0
    messages = []
    schema = None
    while p + 8 <= ipc_end:
        cont = _get(data, p, 4, False)
        prefix, meta = (8, _get(data, p + 4, 4)) if cont == 0xFFFFFFFF else (4, cont)
        if meta == 0:
            messages.append(Message(p, prefix, 0, 0, "eos"))
            p += prefix
            break
        ms = p + prefix
        root = _fb_deref(data, ms)
        htype = data[_fb_field(data, root, 1)]
        hdr = _fb_deref(data, _fb_field(data, root, 2))
        blp = _fb_field(data, root, 3)
        body = _get(data, blp, 8) if blp >= 0 else 0
        m = Message(p, prefix, meta, body, {1: "schema", 3: "batch"}.get(htype, "other"), bodylen_pos=blp)
        pm = pa.ipc.read_message(pa.py_buffer(data[p:m.end]))
        assert pm.body.size == body and pm.type == {1: "schema", 3: "record batch"}[htype], (p, pm.type)
        if htype == 1:
            schema = pa.ipc.read_schema(pm)
        else:
            m.length_pos = _fb_field(data, hdr, 0)
            m.nodes_pos = _fb_deref(data, _fb_field(data, hdr, 1))
            m.n_nodes = _get(data, m.nodes_pos, 4, False)
            m.buffers_pos = _fb_deref(data, _fb_field(data, hdr, 2))
            m.n_buffers = _get(data, m.buffers_pos, 4, False)
            m.buffers = [(_get(data, m.buffer_pos(k), 8), _get(data, m.buffer_pos(k) + 8, 8))
                         for k in range(m.n_buffers)]
            batch = pa.ipc.read_record_batch(pm, schema)
            m.rows = batch.num_rows
            assert _get(data, m.length_pos, 8) == m.rows
        messages.append(m)
        p = m.end
    roles, nodes = _layout(schema)
    footer = None
    if is_file:
        flen = _get(data, ipc_end - 10, 4)
        start = ipc_end - 10 - flen
        root = _fb_deref(data, start)
        bp = _fb_deref(data, _fb_field(data, root, 3))
        footer = (start, flen, bp, _get(data, bp, 4, False))
    amap = ArrowMap(size, is_file, messages, roles, nodes, ipc_end, footer, json_footer)
    for m in amap.batches:
        assert m.n_buffers == len(roles) and m.n_nodes == len(nodes), (m.n_buffers, len(roles))
    return amap


# --------------------------------------------------------------------------- templates


@dataclass
class Template:
    """A clean export to mutate and the reference its chunks must read as."""

    name: str
    root: str  # export root (holding s{scale})
    scale: int
    spec: dict | None  # None: open without a spec (geometry inferred from the files)
    stems: list  # shard stems relative to root, e.g. "s1/30720_24576_28672"
    index: str  # "A", "B", "C" or "D"
    boxes: list  # voxel boxes [x0, x1, y0, y1, z0, z1] read by every trial (one per chunk)
    shape: list  # the volume shape a clean open gives
    refs: dict = field(default_factory=dict)  # mode -> list of chunk digests (same order as boxes)

    @property
    def has_csv(self) -> bool:
        return self.index in ("A", "B", "C")

    def to_json(self) -> dict:
        return asdict(self)


def _real_reference(data_dir: Path, boxes: list) -> dict:
    """Chunk digests of the real shard from pyarrow records and the codec's decode_block."""
    import pyarrow as pa
    import zstandard

    from dvidshards.formats.codec import decode_block

    dctx = zstandard.ZstdDecompressor()
    by_chunk = {}
    with pa.OSFile(str(data_dir / f"{REAL_SHARD}.arrow")) as f:
        for batch in pa.ipc.open_stream(f):
            d = batch.to_pydict()
            for i in range(batch.num_rows):
                blk = dctx.decompress(d["dvid_compressed_block"][i])
                key = (d["chunk_x"][i], d["chunk_y"][i], d["chunk_z"][i])
                by_chunk[key] = (decode_block(blk, np.array(d["labels"][i], np.uint64)).T, decode_block(blk).T)
    zero = _digest(np.zeros((64, 64, 64), np.uint64))
    refs: dict[str, list[str]] = {m: [] for m in MODES}
    for b in boxes:
        got = by_chunk.get((b[0] // 64, b[2] // 64, b[4] // 64))
        for k, m in enumerate(MODES):
            refs[m].append(zero if got is None else _digest(got[k]))
    return refs


def _real_boxes(data_dir: Path) -> list:
    """Every chunk the real shard holds, and 6 absent chunks of its bounding box."""
    import pyarrow as pa

    coords = []
    with pa.OSFile(str(data_dir / f"{REAL_SHARD}.arrow")) as f:
        for batch in pa.ipc.open_stream(f):
            d = batch.to_pydict()
            coords += list(zip(d["chunk_x"], d["chunk_y"], d["chunk_z"], strict=True))
    c = np.array(coords)
    have = set(coords)
    lo, hi = c.min(0), c.max(0)
    absent = [(x, y, z) for x in range(lo[0], hi[0] + 1) for y in range(lo[1], hi[1] + 1)
              for z in range(lo[2], hi[2] + 1) if (x, y, z) not in have][::29][:6]
    return [[64 * x, 64 * x + 64, 64 * y, 64 * y + 64, 64 * z, 64 * z + 64] for x, y, z in coords + absent]


def _map_labels(sv: np.ndarray, mapping: np.ndarray) -> np.ndarray:
    """Apply a (n, 2) supervoxel -> body table; unmapped ids keep their value (plain numpy)."""
    keys = mapping[:, 0]
    order = np.argsort(keys)
    keys, vals = keys[order], mapping[order, 1]
    pos = np.clip(np.searchsorted(keys, sv), 0, len(keys) - 1)
    return np.where(keys[pos] == sv, vals[pos], sv)


def build_templates(workdir, data_dir=None, synthetic: bool = True, real: bool = True,
                    check: bool = True) -> list[Template]:
    """Write the clean templates into workdir (real ones need data_dir, the folder of the mCNS shard).

    With ``check``, every clean template is read through ``dvidshards.open`` and ``verify`` in
    this process and must equal its reference (RuntimeError otherwise).
    """
    workdir = Path(workdir)
    (workdir / "templates").mkdir(parents=True, exist_ok=True)
    out = []
    if real and data_dir is not None and (Path(data_dir) / f"{REAL_SHARD}.arrow").is_file():
        data_dir = Path(data_dir)
        spec = json.loads((data_dir / "mcns-ng-specs.json").read_text())
        boxes = _real_boxes(data_dir)
        refs = _real_reference(data_dir, boxes)
        size = spec["scales"][1]["size"]
        for variant, csv in REAL_CSVS.items():
            root = workdir / "templates" / f"real-{variant}"
            (root / "s1").mkdir(parents=True, exist_ok=True)
            shutil.copyfile(data_dir / f"{REAL_SHARD}.arrow", root / "s1" / f"{REAL_SHARD}.arrow")
            shutil.copyfile(data_dir / csv, root / "s1" / f"{REAL_SHARD}.csv")
            out.append(Template(f"real-{variant}", str(root), 1, spec, [f"s1/{REAL_SHARD}"], variant, boxes,
                                list(size), refs))
        # the A export opened without its spec: geometry inferred from the one shard's records
        held = np.array([[b[0], b[2], b[4]] for b, r in zip(boxes, refs["agglomerated"], strict=True)
                         if r != _digest(np.zeros((64, 64, 64), np.uint64))]) // 64
        shape = [int(v) for v in 64 * (held.max(axis=0) + 1)]
        root = workdir / "templates" / "real-A-nospec"
        shutil.copytree(workdir / "templates" / "real-A", root, dirs_exist_ok=True)
        out.append(Template("real-A-nospec", str(root), 1, None, [f"s1/{REAL_SHARD}"], "A", boxes, shape, refs))
    if synthetic:
        out += _synthetic_templates(workdir)
    for t in out:
        if check:  # the clean export must read as its reference: checks harness and library at once
            res = check_export(t, t.root)
            if classify(res, False) != "exact":
                raise RuntimeError(f"clean template {t.name} does not read as its reference: {res}")
        (workdir / "templates" / f"{t.name}.json").write_text(json.dumps(t.to_json()))
    return out


def _synthetic_templates(workdir: Path) -> list[Template]:
    from dvidshards.demo.neurons import neuron_volume
    from dvidshards.writer import write_export

    sv, mapping = neuron_volume(SYN_SHAPE, n_bodies=14, svs_per_body=4, seed=7)
    grid = [-(-s // 64) for s in SYN_SHAPE]
    padded = np.zeros([64 * g for g in grid], np.uint64)
    padded[: SYN_SHAPE[0], : SYN_SHAPE[1], : SYN_SHAPE[2]] = sv
    vols = {"agglomerated": _map_labels(padded, mapping), "supervoxels": padded}
    # chunks holding no non-zero agglomerated voxel get no record: they read as 0 in both modes
    chunks = [(x, y, z) for x in range(grid[0]) for y in range(grid[1]) for z in range(grid[2])]
    for x, y, z in chunks:
        s = np.s_[64 * x:64 * x + 64, 64 * y:64 * y + 64, 64 * z:64 * z + 64]
        if not vols["agglomerated"][s].any():
            vols["supervoxels"][s] = 0
    variants: list[tuple[str, dict[str, Any], bool]] = [
        ("syn-A1", dict(index="A"), True), ("syn-A3", dict(index="A", batch_size=3), True),
        ("syn-B", dict(index="B"), True), ("syn-C", dict(index="C"), True),
        ("syn-Cf", dict(index="C", container="file"), True), ("syn-D", dict(index="D"), True),
        ("syn-A3-nospec", dict(index="A", batch_size=3), False)]
    out = []
    for name, kw, with_spec in variants:
        root = workdir / "templates" / name
        spec = write_export(sv, root, mapping=mapping, scales=1, shard_chunks=2, overwrite=True, **kw)
        stems = sorted(f"s0/{p.stem}" for p in (root / "s0").glob("*.arrow"))
        if with_spec:
            shape = list(SYN_SHAPE)
        else:  # inferred: whole chunks up to the last chunk holding a record
            held = np.array([c for c in chunks if vols["agglomerated"][
                64 * c[0]:64 * c[0] + 64, 64 * c[1]:64 * c[1] + 64, 64 * c[2]:64 * c[2] + 64].any()])
            shape = [int(v) for v in 64 * (held.max(axis=0) + 1)]
        boxes: list[list[int]] = []
        refs: dict[str, list[str]] = {m: [] for m in MODES}
        for x, y, z in chunks:
            b = [64 * x, min(64 * x + 64, shape[0]), 64 * y, min(64 * y + 64, shape[1]),
                 64 * z, min(64 * z + 64, shape[2])]
            boxes.append(b)
            for m in MODES:
                refs[m].append(_digest(vols[m][b[0]:b[1], b[2]:b[3], b[4]:b[5]]))
        out.append(Template(name, str(root), 0, spec if with_spec else None, stems, kw["index"], boxes, shape,
                            refs))
    return out


def load_templates(workdir) -> list[Template]:
    """Templates written by `build_templates`."""
    return [Template(**json.loads(p.read_text())) for p in sorted((Path(workdir) / "templates").glob("*.json"))]


# --------------------------------------------------------------------------- mutations


@dataclass
class Mutation:
    """One change to one file of a trial's export."""

    region: str
    op: str
    file: str  # path relative to the export root
    offset: int = -1  # byte offset in the file (or row number for CSV edits)
    old: object = None
    new: object = None
    note: str = ""

    @property
    def data_only(self) -> bool:
        return self.region in DATA_ONLY

    def describe(self) -> str:
        where = f" at {self.offset}" if self.offset >= 0 else ""
        change = f" {self.old!r} -> {self.new!r}" if self.old is not None or self.new is not None else ""
        return f"{self.region}/{self.op} {self.file}{where}{change}{' (' + self.note + ')' if self.note else ''}"


class _Files:
    """The files of one trial's export, edited in memory and written back once."""

    def __init__(self, root: Path):
        self.root = root
        self.data: dict[str, bytearray] = {}
        self._maps: dict[str, ArrowMap] = {}

    def get(self, rel: str) -> bytearray:
        if rel not in self.data:
            self.data[rel] = bytearray((self.root / rel).read_bytes())
        return self.data[rel]

    def amap(self, rel: str) -> ArrowMap:
        """Map of the file as it was before any edit of this trial."""
        if rel not in self._maps:
            self._maps[rel] = arrow_map(bytes(self.get(rel)))
        return self._maps[rel]

    def write(self) -> None:
        for rel, b in self.data.items():
            (self.root / rel).write_bytes(bytes(b))


def _pick(rng, seq):
    return seq[int(rng.integers(len(seq)))]


def _choose_region(rng, regions: dict, ok) -> str:
    names = [r for r in regions if ok(r)]
    w = np.array([regions[r] for r in names], float)
    return names[int(rng.choice(len(names), p=w / w.sum()))]


def _shard_region_ok(t: Template, amap: ArrowMap, region: str) -> bool:
    if region == "footer":
        return amap.is_file or amap.json_footer is not None
    if region == "end_of_stream":
        return not amap.is_file
    if region == "order":
        return len(amap.batches) >= 2
    return True


def mutate(rng: np.random.Generator, t: Template, files: _Files, kind: str) -> list[Mutation]:
    """Apply one (sometimes two in-place) mutations of a kind ("shard" or "csv") to a trial's files."""
    stem = _pick(rng, t.stems)
    arrow = stem + ".arrow"
    if kind == "csv":
        region = _choose_region(rng, CSV_REGIONS, lambda r: True)
        return [_CSV_OPS[region](rng, t, files, stem + ".csv", region)]
    amap = files.amap(arrow)
    region = _choose_region(rng, SHARD_REGIONS, lambda r: _shard_region_ok(t, amap, r))
    muts = [_ARROW_OPS[region](rng, t, files, arrow, amap, region)]
    # a second structural in-place edit now and then (never mixed with a data-only one, whose
    # silent difference would then be blamed on the structure)
    if region in IN_PLACE - DATA_ONLY and rng.random() < 0.15:
        second = _choose_region(rng, SHARD_REGIONS, lambda r: r in IN_PLACE - DATA_ONLY)
        muts.append(_ARROW_OPS[second](rng, t, files, arrow, amap, second))
    return muts


def _int_edit(rng, b: bytearray, pos: int, width: int, region: str, op: str, rel: str, related=(), note=""):
    old = _get(b, pos, width)
    new = _special(rng, old, width, related)
    _put(b, pos, width, new)
    return Mutation(region, op, rel, pos, old, new, note)


def _generic(rng, b: bytearray, lo: int, hi: int, region: str, rel: str, related=()) -> Mutation:
    """Integer tweak at an aligned position, a u16 (vtable-sized) tweak, or random bytes in [lo, hi)."""
    r = rng.random()
    if r < 0.5 and hi - lo >= 4:
        pos = lo + 4 * int(rng.integers((hi - lo) // 4))
        return _int_edit(rng, b, pos, 4, region, "int32", rel, related)
    if r < 0.65 and hi - lo >= 8:
        pos = lo + 8 * int(rng.integers((hi - lo) // 8))
        return _int_edit(rng, b, pos, 8, region, "int64", rel, related)
    if r < 0.85 and hi - lo >= 2:
        pos = lo + 2 * int(rng.integers((hi - lo) // 2))
        old = _get(b, pos, 2, False)
        new = int(_pick(rng, [0, 1, 2, 4, 0xFFFF, 0x8000, 0x7FFF, old + 2, old - 2, old + 4, old - 4, old * 2]))
        _put(b, pos, 2, new)
        return Mutation(region, "uint16", rel, pos, old, new % 65536)
    pos = lo + int(rng.integers(max(1, hi - lo)))
    old = b[pos]
    b[pos] = (old ^ (1 << int(rng.integers(8)))) if rng.random() < 0.5 else int(rng.integers(256))
    return Mutation(region, "byte", rel, pos, old, b[pos])


def _schema_op(rng, t, files, rel, amap, region):
    b = files.get(rel)
    s = amap.schema
    if rng.random() < 0.12:  # the envelope: continuation marker or metadata length
        pos = s.offset + (4 if s.prefix == 8 and rng.random() < 0.7 else 0)
        return _int_edit(rng, b, pos, 4, region, "envelope", rel, (s.meta_len, amap.size))
    return _generic(rng, b, s.meta_start, s.body_start, region, rel, (s.meta_len,))


def _batch(rng, amap: ArrowMap) -> Message:
    return _pick(rng, amap.batches)


def _batch_meta_op(rng, t, files, rel, amap, region):
    b = files.get(rel)
    m = _batch(rng, amap)
    r = rng.random()
    if r < 0.15:
        pos = m.offset + (4 if m.prefix == 8 and rng.random() < 0.7 else 0)
        return _int_edit(rng, b, pos, 4, region, "envelope", rel, (m.meta_len, m.body_len, amap.size))
    if r < 0.35:
        return _int_edit(rng, b, m.bodylen_pos, 8, region, "bodyLength", rel, (m.body_len, amap.size, m.meta_len))
    if r < 0.45:  # the vector lengths of nodes / buffers
        pos = _pick(rng, [m.nodes_pos, m.buffers_pos])
        return _int_edit(rng, b, pos, 4, region, "vector_length", rel, (m.n_nodes, m.n_buffers))
    return _generic(rng, b, m.meta_start, m.body_start, region, rel, (m.body_len, m.meta_len))


def _row_count_op(rng, t, files, rel, amap, region):
    b = files.get(rel)
    m = _batch(rng, amap)
    rows = _get(b, m.length_pos, 8)
    return _int_edit(rng, b, m.length_pos, 8, region, "length", rel,
                     (rows, m.body_len, m.body_len // 12 + 1, (2**63 - 1) // 12 + 1, 2**62 + 1))


def _field_nodes_op(rng, t, files, rel, amap, region):
    b = files.get(rel)
    m = _batch(rng, amap)
    k = int(rng.integers(m.n_nodes))
    which = int(rng.integers(2))
    pos = m.node_pos(k) + 8 * which
    old = _get(b, pos, 8)
    return _int_edit(rng, b, pos, 8, region, ("length", "null_count")[which], rel, (old, m.body_len),
                     note=f"node {k} {amap.node_names[k]}")


def _buffers_op(rng, t, files, rel, amap, region):
    b = files.get(rel)
    m = _batch(rng, amap)
    n = m.n_buffers
    k = int(rng.integers(n))
    col, role = amap.buffer_roles[k]
    note = f"buffer {k} {col}.{role}"
    off, ln = m.buffers[k]
    others = [o for o, _ in m.buffers] + [x for _, x in m.buffers]
    r = rng.random()
    if r < 0.3:
        return _int_edit(rng, b, m.buffer_pos(k), 8, region, "offset", rel, [m.body_len, ln] + others, note)
    if r < 0.55:
        return _int_edit(rng, b, m.buffer_pos(k) + 8, 8, region, "length", rel, [m.body_len, off] + others, note)
    if r < 0.75:  # move onto another buffer (e.g. labels values onto the supervoxels list)
        j = int(rng.integers(n))
        if rng.random() < 0.5 and ("labels.item", "values") in amap.buffer_roles:
            k, j = amap.role("labels.item", "values"), amap.role("supervoxels.item", "values")
            note = f"buffer {k} labels.item.values"
        _put(b, m.buffer_pos(k), 8, m.buffers[j][0])
        if rng.random() < 0.5:
            _put(b, m.buffer_pos(k) + 8, 8, m.buffers[j][1])
        return Mutation(region, "alias", rel, m.buffer_pos(k), m.buffers[k], m.buffers[j], f"{note} onto buffer {j}")
    if r < 0.9:  # shift by a few bytes
        d = int(_pick(rng, [-16, -8, -4, -1, 1, 4, 8, 16]))
        _put(b, m.buffer_pos(k), 8, off + d)
        return Mutation(region, "shift", rel, m.buffer_pos(k), off, off + d, note)
    j = int(rng.integers(n))  # swap two descriptors
    pk, pj = m.buffer_pos(k), m.buffer_pos(j)
    dk, dj = bytes(b[pk:pk + 16]), bytes(b[pj:pj + 16])
    b[pk:pk + 16], b[pj:pj + 16] = dj, dk
    return Mutation(region, "swap", rel, pk, k, j, note)


def _list_offsets_op(rng, t, files, rel, amap, region):
    b = files.get(rel)
    m = _batch(rng, amap)
    col = _pick(rng, ["labels", "supervoxels", "dvid_compressed_block"])
    k = amap.role(col, "offsets")
    off, ln = m.buffers[k]
    vk = amap.role(col + ".item", "values") if col != "dvid_compressed_block" else amap.role(col, "values")
    vlen = m.buffers[vk][1]
    nent = max(1, ln // 4)
    i = int(rng.integers(nent))
    pos = m.body_start + off + 4 * i
    prev = _get(b, pos - 4, 4) if i else 0
    nxt = _get(b, pos + 4, 4) if i + 1 < nent else 0
    elems = vlen // (1 if col == "dvid_compressed_block" else 8)
    return _int_edit(rng, b, pos, 4, region, "offset", rel, (prev, nxt, elems, elems + 1, vlen), f"{col}[{i}]")


def _coords_op(rng, t, files, rel, amap, region):
    b = files.get(rel)
    m = _batch(rng, amap)
    col = _pick(rng, ["chunk_x", "chunk_y", "chunk_z", "uncompressed_size"])
    if col not in [c for c, _ in amap.buffer_roles]:
        col = "chunk_x"
    off, ln = m.buffers[amap.role(col, "values")]
    i = int(rng.integers(max(1, ln // 4)))
    pos = m.body_start + off + 4 * i
    old = _get(b, pos, 4)
    return _int_edit(rng, b, pos, 4, region, col, rel, (old, old + 32, old - 32, old + 2, 1 << 21), f"row {i}")


def _label_values_op(rng, t, files, rel, amap, region):
    b = files.get(rel)
    m = _batch(rng, amap)
    col = _pick(rng, ["labels", "supervoxels"])
    off, ln = m.buffers[amap.role(col + ".item", "values")]
    i = int(rng.integers(max(1, ln // 8)))
    pos = m.body_start + off + 8 * i
    old = _get(b, pos, 8, False)
    other = _get(b, m.body_start + off + 8 * int(rng.integers(max(1, ln // 8))), 8, False)
    new = int(_pick(rng, [0, 2**64 - 1, other, old + 1, int(rng.integers(1, 2**63))]))
    if new == old:
        new = old ^ 1
    _put(b, pos, 8, new)
    return Mutation(region, col, rel, pos, old, new, f"{col}[{i}]")


def _payload_op(rng, t, files, rel, amap, region):
    b = files.get(rel)
    m = _batch(rng, amap)
    off, ln = m.buffers[amap.role("dvid_compressed_block", "values")]
    lo = m.body_start + off
    r = rng.random()
    if r < 0.3:  # the zstd frame header (magic, descriptor, content size)
        pos = lo + int(rng.integers(min(ln, 14)))
    else:
        pos = lo + int(rng.integers(max(1, ln)))
    if r > 0.85:  # zero a span
        n = int(rng.integers(1, 64))
        old = bytes(b[pos:pos + n])
        b[pos:pos + n] = bytes(len(old))
        return Mutation(region, "zero_span", rel, pos, len(old), 0)
    old = b[pos]
    b[pos] = old ^ (1 << int(rng.integers(8)))
    return Mutation(region, "bit_flip", rel, pos, old, b[pos])


def _eos_op(rng, t, files, rel, amap, region):
    b = files.get(rel)
    eos = [m for m in amap.messages if m.kind == "eos"]
    last = amap.batches[-1]
    end = eos[0].offset if eos else amap.ipc_end
    op = _pick(rng, ["remove", "length", "garbage", "batch_after", "double", "partial"])
    tail = bytes(b[amap.ipc_end:])  # a CHUNKIDX footer stays at the end
    if op == "remove":
        del b[end:amap.ipc_end]
        return Mutation(region, op, rel, end)
    if op == "length" and eos:
        return _int_edit(rng, b, end + 4, 4, region, op, rel, (last.meta_len, amap.size - end))
    if op == "garbage":
        g = rng.integers(0, 256, int(rng.integers(1, 64)), dtype=np.uint8).tobytes()
        b[amap.ipc_end:] = g + tail
        return Mutation(region, op, rel, amap.ipc_end, None, len(g))
    if op == "batch_after":  # a copy of the last batch after the end-of-stream marker
        b[amap.ipc_end:] = bytes(b[last.offset:last.end]) + tail
        return Mutation(region, op, rel, amap.ipc_end)
    if op == "double":
        b[amap.ipc_end:] = b"\xff\xff\xff\xff\x00\x00\x00\x00" + tail
        return Mutation(region, op, rel, amap.ipc_end)
    cut = end + int(rng.integers(1, 8))  # end-of-stream cut short
    del b[cut:amap.ipc_end]
    return Mutation(region, "partial", rel, cut)


def _message_order_op(rng, t, files, rel, amap, region):
    """Swap, duplicate, delete or shuffle record batches; sometimes fix the index up to match."""
    b = files.get(rel)
    bs = amap.batches
    first, last = bs[0].offset, bs[-1].end
    chunks = [bytes(b[m.offset:m.end]) for m in bs]
    order = list(range(len(bs)))
    op = _pick(rng, ["swap", "duplicate", "delete", "shuffle", "consistent"])
    if op == "consistent" and not (t.has_csv and not amap.is_file):
        op = "shuffle"
    i, j = sorted(int(v) for v in rng.choice(len(bs), 2, replace=False))
    if op == "swap":
        order[i], order[j] = order[j], order[i]
    elif op == "duplicate":
        order.insert(j, i)
    elif op == "delete":
        order.pop(i)
    else:
        order = [int(v) for v in rng.permutation(len(bs))]
    b[first:last] = b"".join(chunks[k] for k in order)
    mut = Mutation(region, op, rel, first, None, order[:12], f"{len(bs)} batches")
    if op == "consistent":
        _fix_csv(files, rel[:-6] + ".csv", amap, order)
        mut.note += ", index rewritten to match (a valid export)"
    return mut


def _fix_csv(files: _Files, rel: str, amap: ArrowMap, order: list) -> None:
    """Rewrite a CSV index after the batches were reordered (the export stays valid)."""
    bs = amap.batches
    lines = bytes(files.get(rel)).decode().splitlines()
    head = [ln for ln in lines[:2] if ln.startswith("#") or ln.startswith("x,")]
    body = lines[len(head):]
    cols = head[-1].split(",")
    rows = [m.rows for m in bs]  # of the clean file: the batches have already been moved
    new_off, pos = {}, bs[0].offset
    for k in order:
        new_off[bs[k].offset] = pos
        pos += bs[k].end - bs[k].offset
    old_start = np.concatenate([[0], np.cumsum(rows)])
    new_start, acc = {}, 0
    for k in order:
        new_start[k] = acc
        acc += rows[k]
    out = []
    for ln in body:
        cells = dict(zip(cols, ln.split(","), strict=True))
        if "offset" in cells:
            cells["offset"] = str(new_off[int(cells["offset"])])
        if "rec" in cells and "offset" not in cells:
            r = int(cells["rec"])
            k = int(np.searchsorted(old_start, r, side="right") - 1)
            cells["rec"] = str(new_start[k] + r - old_start[k])
        out.append(",".join(cells[c] for c in cols))
    files.data[rel] = bytearray(("\n".join(head + out) + "\n").encode())


def _truncation_op(rng, t, files, rel, amap, region):
    b = files.get(rel)
    r = rng.random()
    if r < 0.4:  # at or near a message boundary
        m = _pick(rng, amap.messages)
        cut = m.offset + int(_pick(rng, [0, 1, 4, 7, 8, 9, -1, -4]))
    elif r < 0.5:
        cut = int(_pick(rng, [0, 1, 4, 7, 8, 12]))
    else:
        cut = int(rng.integers(0, len(b)))
    cut = max(0, min(cut, len(b) - 1))
    del b[cut:]
    return Mutation(region, "truncate", rel, cut, amap.size, cut)


def _footer_op(rng, t, files, rel, amap, region):
    b = files.get(rel)
    if amap.json_footer is not None and (amap.footer is None or rng.random() < 0.5):
        js, jn = amap.json_footer
        r = rng.random()
        if r < 0.3:
            return _int_edit(rng, b, js + jn, 8, region, "json_length", rel, (jn, amap.size, js))
        if r < 0.4:
            pos = len(b) - 1 - int(rng.integers(8))
            old = b[pos]
            b[pos] ^= 0x20
            return Mutation(region, "magic", rel, pos, old, b[pos])
        text = bytes(b[js:js + jn]).decode()
        obj = json.loads(text)
        key = _pick(rng, list(obj))
        if r < 0.7:
            obj[key] = _special(rng, obj[key], 8, (len(obj), obj[key]))
            op = "value"
        else:
            x, y, z = (int(v) for v in key.split("_"))
            v = obj.pop(key)
            obj[f"{x + 64 * int(_pick(rng, [-1, 1, 2]))}_{y}_{z}" if rng.random() < 0.7 else f"{x + 1}_{y}_{z}"] = v
            op = "key"
        new = json.dumps(obj).encode()
        b[js:] = new + len(new).to_bytes(8, "little") + b"CHUNKIDX"
        return Mutation(region, op, rel, js, key, None, "CHUNKIDX JSON rewritten")
    start, flen, bp, n = amap.footer
    r = rng.random()
    if r < 0.6 and n:
        k = int(rng.integers(n))
        which = int(rng.integers(3))
        pos = bp + 4 + 24 * k + (0, 8, 16)[which]
        width = (8, 4, 8)[which]
        return _int_edit(rng, b, pos, width, region, ("block_offset", "block_meta_len", "block_body_len")[which],
                         rel, (amap.batches[k].offset, amap.batches[k].meta_len, amap.batches[k].body_len,
                               amap.size), f"block {k}")
    if r < 0.75:
        return _int_edit(rng, b, amap.ipc_end - 10, 4, region, "footer_length", rel, (flen, amap.size))
    if r < 0.85:
        return _int_edit(rng, b, bp, 4, region, "block_count", rel, (n, n + 1))
    return _generic(rng, b, start, start + flen, region, rel, (flen,))


_ARROW_OPS = {
    "schema": _schema_op, "batch_meta": _batch_meta_op, "row_count": _row_count_op,
    "field_nodes": _field_nodes_op, "buffers": _buffers_op, "list_offsets": _list_offsets_op,
    "coords": _coords_op, "label_values": _label_values_op, "payload": _payload_op,
    "end_of_stream": _eos_op, "order": _message_order_op, "truncation": _truncation_op, "footer": _footer_op,
}


# --- CSV indexes


def _csv_split(b: bytearray) -> tuple[list[str], list[str]]:
    lines = bytes(b).decode().splitlines()
    nhead = 2 if lines and lines[0].startswith("#") else 1
    return lines[:nhead], lines[nhead:]


def _csv_join(files: _Files, rel: str, head: list[str], body: list[str], end: str = "\n") -> None:
    files.data[rel] = bytearray((end.join(head + body) + end).encode())


CSV_JUNK = ("", "x", "1.5", "0x10", " 7", "7 ", "1e3", "+7", "-0", "\u0663", "00000000000000000000000042",
            "9223372036854775808", "18446744073709551616", "-9223372036854775809", "NaN", "null", '"5"')


def _csv_field_op(rng, t, files, rel, region):
    b = files.get(rel)
    head, body = _csv_split(b)
    cols = head[-1].split(",")
    i = int(rng.integers(len(body)))
    c = int(rng.integers(len(cols)))
    cells = body[i].split(",")
    old = cells[c]
    if rng.random() < 0.2:
        new = str(_pick(rng, CSV_JUNK))
    elif rng.random() < 0.2:  # another row's value: a real but wrong chunk, offset, size or row
        new = _pick(rng, body).split(",")[c]
    else:
        amap = files.amap(rel[:-4] + ".arrow")
        new = str(_special(rng, int(old), 8, (int(old), amap.size, amap.schema.meta_len + 8, len(body),
                                              int(old) + 2 ** 21)))
        if rng.random() < 0.3:  # as it would be written unsigned
            new = str(int(new) % 2**64)
    cells[c] = new
    body[i] = ",".join(cells)
    _csv_join(files, rel, head, body)
    return Mutation(region, cols[c], rel, i, old, new, f"variant {t.index}")


def _csv_rows_op(rng, t, files, rel, region):
    b = files.get(rel)
    head, body = _csv_split(b)
    n = len(body)
    op = _pick(rng, ["delete", "delete_last", "duplicate", "header_only", "truncate_line", "blank_line",
                     "garbage_line", "extra_column", "missing_column", "swap_field", "extra_row"])
    i, j = (int(v) for v in rng.integers(0, n, 2))
    if op == "delete":
        body.pop(i)
    elif op == "delete_last":
        body = body[: n - int(rng.integers(1, min(n, 4) + 1))]
    elif op == "duplicate":
        body.insert(j, body[i])
    elif op == "header_only":
        body = []
    elif op == "truncate_line":
        body[i] = body[i][: int(rng.integers(0, len(body[i])))]
        if rng.random() < 0.5:
            body = body[: i + 1]
    elif op == "blank_line":
        body.insert(i, "")
    elif op == "garbage_line":
        body.insert(i, _pick(rng, ["#", "x,y,z", "1,2", ",,,", "a,b,c,d,e,f", "\t"]))
    elif op == "extra_column":
        body[i] += ",0"
    elif op == "missing_column":
        body[i] = body[i].rsplit(",", 1)[0]
    elif op == "swap_field":  # exchange one column between two rows
        ci, cj = body[i].split(","), body[j].split(",")
        c = int(rng.integers(len(ci)))
        ci[c], cj[c] = cj[c], ci[c]
        body[i], body[j] = ",".join(ci), ",".join(cj)
    else:  # a row for a chunk the shard does not hold, pointing at a real record
        cells = body[i].split(",")
        cells[0] = str(int(cells[0]) + int(_pick(rng, [1, -1, 2])))
        body.append(",".join(cells))
    _csv_join(files, rel, head, body)
    return Mutation(region, op, rel, i, None, None, f"variant {t.index}, {n} rows")


def _csv_header_op(rng, t, files, rel, region):
    b = files.get(rel)
    head, body = _csv_split(b)
    op = _pick(rng, ["schema_size", "drop_schema_line", "other_variant", "rename_column", "reorder_header",
                     "comment_line", "upper", "spaces"])
    old = list(head)
    if op == "schema_size" and head[0].startswith("#"):
        v = int(head[0].split("=")[1])
        head[0] = f"# schema_size={_special(rng, v, 8, (v, v + 8, v - 8, 2**32 - v))}"
    elif op == "drop_schema_line" and head[0].startswith("#"):
        head = head[1:]
    elif op == "other_variant":
        head[-1] = _pick(rng, ["x,y,z,offset,size,batch_idx", "x,y,z,rec,offset,size", "x,y,z,rec"])
    elif op == "rename_column":
        cols = head[-1].split(",")
        k = int(rng.integers(len(cols)))
        cols[k] = _pick(rng, ["X", "offs", "", "rec ", "batch"])
        head[-1] = ",".join(cols)
    elif op == "reorder_header":  # header and rows reordered together: still the same index
        cols = head[-1].split(",")
        perm = [int(v) for v in rng.permutation(len(cols))]
        head[-1] = ",".join(cols[k] for k in perm)
        body = [",".join(ln.split(",")[k] for k in perm) for ln in body]
    elif op == "comment_line":
        head.insert(len(head) - 1, "# exported by dvid")
    elif op == "upper":
        head[-1] = head[-1].upper()
    else:
        head[-1] = head[-1].replace(",", ", ")
    _csv_join(files, rel, head, body)
    return Mutation(region, op, rel, 0, old, head, f"variant {t.index}")


def _csv_text_op(rng, t, files, rel, region):
    b = files.get(rel)
    op = _pick(rng, ["crlf", "bom", "no_final_newline", "nul", "flip", "truncate", "empty", "binary",
                     "long_line", "trailing_spaces"])
    old_len = len(b)
    if op == "crlf":
        b[:] = bytes(b).replace(b"\n", b"\r\n")
    elif op == "bom":
        b[:0] = b"\xef\xbb\xbf"
    elif op == "no_final_newline":
        b[:] = bytes(b).rstrip(b"\n")
    elif op == "nul":
        b.insert(int(rng.integers(len(b))), 0)
    elif op == "flip":
        p = int(rng.integers(len(b)))
        b[p] ^= 1 << int(rng.integers(8))
    elif op == "truncate":
        del b[int(rng.integers(len(b))):]
    elif op == "empty":
        b[:] = b""
    elif op == "binary":
        b[:] = rng.integers(0, 256, int(rng.integers(1, 400)), dtype=np.uint8).tobytes()
    elif op == "long_line":
        b[:] = bytes(b) + b"1" * 100_000 + b",1,1,1,1,1\n"
    else:
        b[:] = bytes(b).replace(b"\n", b"  \n")
    return Mutation(region, op, rel, -1, old_len, len(b), f"variant {t.index}")


def _csv_reorder_op(rng, t, files, rel, region):
    """Shuffle or reverse the rows: any order is allowed, the data must read exactly."""
    b = files.get(rel)
    head, body = _csv_split(b)
    op = _pick(rng, ["shuffle", "reverse"])
    body = [body[int(k)] for k in rng.permutation(len(body))] if op == "shuffle" else body[::-1]
    _csv_join(files, rel, head, body)
    return Mutation(region, op, rel, -1, None, None, f"variant {t.index}")


_CSV_OPS = {"csv_field": _csv_field_op, "csv_rows": _csv_rows_op, "csv_header": _csv_header_op,
            "csv_text": _csv_text_op, "csv_reorder": _csv_reorder_op}


# --------------------------------------------------------------------------- one trial


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:400]}"


def check_export(t: Template, root, bad_box_limit: int = 3) -> dict:
    """Open, read every chunk in both label modes and verify an export copy of template t.

    Returns counts of chunk outcomes, the first typed and untyped errors, and verify's verdict.
    """
    with warnings.catch_warnings():  # e.g. GeometryWarning for exports opened without a spec
        warnings.simplefilter("ignore")
        return _check_export(t, root, bad_box_limit)


def _check_export(t: Template, root, bad_box_limit: int) -> dict:
    import dvidshards
    from dvidshards.errors import DvidShardsError

    out: dict[str, Any] = {
        "read_ok": 0, "differ": 0, "typed": 0, "untyped": 0, "first_typed": None, "first_untyped": None,
        "differ_boxes": [], "verify": None, "shape": None, "unnamed": None}
    files = [Path(s).name for s in t.stems]

    def note(e):
        key = "typed" if isinstance(e, DvidShardsError) else "untyped"
        out[key] += 1
        if out["first_" + key] is None:
            out["first_" + key] = _error(e)

    for mode in MODES:
        try:
            vol = dvidshards.open(str(root), scale=t.scale, spec=t.spec, labels=mode, fill_missing_shards=True)
        except Exception as e:  # noqa: BLE001 - classifying every exception is the point
            note(e)
            continue
        shape = [int(v) for v in vol.shape]
        out["shape"] = shape
        if shape != list(t.shape):  # the geometry itself changed: every read is suspect
            out["differ"] += 1
            out["differ_boxes"].append(f"volume shape {shape}, the clean export gives {list(t.shape)}")
            continue
        for b, want in zip(t.boxes, t.refs[mode], strict=True):
            try:
                got = vol[b[0]:b[1], b[2]:b[3], b[4]:b[5]].read(order="F").result()
            except Exception as e:  # noqa: BLE001
                note(e)
                msg = str(e)
                chunk = (b[0] // 64, b[2] // 64, b[4] // 64)
                if out["unnamed"] is None and isinstance(e, DvidShardsError) and (
                        str(chunk) not in msg or not any(f in msg for f in files)):
                    out["unnamed"] = f"chunk {chunk}: {_error(e)}"
                continue
            if _digest(got) == want:
                out["read_ok"] += 1
            else:
                out["differ"] += 1
                if len(out["differ_boxes"]) < bad_box_limit:
                    out["differ_boxes"].append(f"{mode} chunk {(b[0] // 64, b[2] // 64, b[4] // 64)}")
        del vol
    try:
        rep = dvidshards.verify(str(root), scale=t.scale, spec=t.spec, decode=True)
        out["verify"] = "ok" if rep.ok else "problems"
        if not rep.ok and out["first_typed"] is None and out["typed"] == 0:
            out["verify_problem"] = f"{rep.problems[0].kind}: {rep.problems[0].message[:300]}"
    except Exception as e:  # noqa: BLE001
        out["verify"] = "raised"
        note(e)
    return out


def classify(res: dict, data_only: bool) -> str:
    """The class of a trial from its check_export result."""
    if res["untyped"]:
        return "untyped"
    if res["differ"]:
        return "data_silent" if data_only else "struct_silent"
    if res["typed"]:
        return "typed"
    return "exact"


def trial_rng(seed: int, kind: str, trial: int) -> np.random.Generator:
    return np.random.default_rng([seed, KINDS[kind], trial])


def prepare_trial(t: Template, kind: str, seed: int, trial: int, root: Path) -> list[Mutation]:
    """Copy template t to root and apply the mutations of (seed, kind, trial); returns them."""
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(t.root, root)
    files = _Files(root)
    muts = mutate(trial_rng(seed, kind, trial), t, files, kind)
    files.write()
    (root.parent / (root.name + ".mutation.json")).write_text(json.dumps(
        {"template": t.name, "kind": kind, "seed": seed, "trial": trial,
         "mutations": [asdict(m) | {"text": m.describe()} for m in muts]}, default=str))
    return muts


def run_trial(t: Template, kind: str, seed: int, trial: int, scratch: Path) -> dict:
    """Mutate a copy of t, check it, classify; the copy is left in scratch/trial for the caller."""
    import traceback

    root = scratch / "trial"
    head = {"template": t.name, "kind": kind, "seed": seed, "trial": trial}
    try:
        muts = prepare_trial(t, kind, seed, trial, root)
    except Exception:  # noqa: BLE001 - a bug of the harness, not of the library
        return head | {"class": "harness_error", "region": "?", "detail": traceback.format_exc(limit=4)}
    t0 = time.perf_counter()
    try:
        res = check_export(t, root)
    except Exception:  # noqa: BLE001 - check_export classifies library errors itself
        return head | {"class": "harness_error", "region": muts[0].region, "detail": traceback.format_exc(limit=4),
                       "mutation": "; ".join(m.describe() for m in muts)}
    data_only = all(m.data_only for m in muts)
    cls = classify(res, data_only)
    region = muts[0].region if len(muts) == 1 else "+".join(m.region for m in muts)
    return head | {
            "region": region, "mutation": "; ".join(m.describe() for m in muts), "class": cls,
            "verify_missed": bool(res["differ"]) and res["verify"] == "ok", "unnamed": res["unnamed"],
            "seconds": round(time.perf_counter() - t0, 3),
            "detail": res["first_untyped"] or (res["differ_boxes"][0] if res["differ_boxes"] else None)
            or res["first_typed"] or res.get("verify_problem"),
            "verify": res["verify"]}


# --------------------------------------------------------------------------- worker processes


def _worker(args) -> int:
    """Trial server: JSON requests on stdin, one JSON answer per line on the saved stdout."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed goes to stderr
    faulthandler.enable()
    templates = {t.name: t for t in load_templates(args.workdir)}
    scratch = Path(args.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    import dvidshards  # noqa: F401  (import cost and JIT loading before the first trial)

    t = min(templates.values(), key=lambda t: len(t.boxes))  # warm up: imports, JIT cache, pools
    res = check_export(t, t.root)
    if classify(res, False) != "exact":
        proto.write(json.dumps({"setup_error": f"clean template {t.name}: {res}"}) + "\n")
        return 1
    proto.write(json.dumps({"ready": True, "pid": os.getpid(), "rss": rss_bytes()}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("quit"):
            break
        res = run_trial(templates[req["template"]], req["kind"], req["seed"], req["trial"], scratch)
        gc.collect()
        res["rss"] = rss_bytes()
        proto.write(json.dumps(res, default=str) + "\n")
    return 0


#: a trial's worker that answers nothing for this many times its CPU allowance in wall time is hung
#: (blocked without spending CPU); a busy machine stretches wall time, here by less than this
WALL_FACTOR = 10


def _cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system) process ``pid`` has used, from /proc; None without /proc or once
    the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14-15)


class _Worker:
    """One trial server process; restarted by its owner after a crash, hang or RSS cap."""

    def __init__(self, n: int, workdir: Path, env: dict, log: Path, start_timeout: float):
        self.n = n
        self.scratch = workdir / f"w{n}"
        self.log = log
        self.logf = open(log, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.fuzz", "worker", "--workdir", str(workdir),
             "--scratch", str(self.scratch)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.logf, env=env, text=True, bufsize=1)
        self.pid = self.proc.pid
        ready = self._answer(start_timeout)
        if not isinstance(ready, dict) or "setup_error" in ready:
            raise RuntimeError(f"fuzz worker {n} did not start: {ready} (log {log}: {self._tail()})")
        self.ready: dict = ready

    def _answer(self, cpu_seconds: float) -> dict | str:
        """The next answer line; or why there is none: "eof" (the worker ended) or "hang" (it spent
        ``cpu_seconds`` of CPU, or ``WALL_FACTOR`` times that in wall time, without answering).

        A hang is measured in the worker's CPU time, not in wall time: a trial on a busy machine
        takes longer, never more CPU, so load never turns a slow trial into a hang. A worker blocked
        without spending CPU (a deadlock) is a hang after the wall-time bound."""
        assert self.proc.stdout is not None  # Popen(stdout=PIPE)
        cpu0, t0 = _cpu_seconds(self.pid), time.monotonic()
        while True:
            r, _, _ = select.select([self.proc.stdout], [], [], 1.0)
            if r:
                line = self.proc.stdout.readline()
                return json.loads(line) if line else "eof"
            cpu, wall = _cpu_seconds(self.pid), time.monotonic() - t0
            if cpu0 is None or cpu is None:  # no /proc (or the worker is gone): wall time alone
                if self.proc.poll() is not None:
                    return "eof"
                if wall > cpu_seconds:
                    return "hang"
            elif cpu - cpu0 > cpu_seconds or wall > cpu_seconds * WALL_FACTOR:
                return "hang"

    def _tail(self) -> str:
        self.logf.flush()
        with contextlib.suppress(OSError):
            return self.log.read_bytes()[-3000:].decode(errors="replace")
        return ""

    def run(self, req: dict, timeout: float) -> dict:
        self.logf.write(f"\n=== trial {req}\n".encode())
        self.logf.flush()
        assert self.proc.stdin is not None  # Popen(stdin=PIPE)
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        ans = self._answer(timeout)
        if isinstance(ans, dict):
            return ans
        if ans == "hang" and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
            return {"class": "hang", "detail": f"no answer after {timeout:.0f} s of CPU or "
                                               f"{timeout * WALL_FACTOR:.0f} s"}
        self.proc.wait()
        rc = self.proc.returncode
        if rc >= 0:  # exited without a signal: the harness failed (a Python error in the worker)
            return {"class": "harness_error", "detail": f"worker exited with {rc}", "stderr": self._tail()}
        name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else f"signal {-rc}"
        return {"class": "crash", "detail": f"worker died ({name})", "stderr": self._tail()}

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None  # Popen(stdin=PIPE)
            with contextlib.suppress(BrokenPipeError, OSError):
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.flush()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.logf.close()


class Campaign:
    """Run trials in worker processes and collect classes, examples and worker RSS.

    Parameters
    ----------
    workdir : path
        Holds ``templates/`` (see `build_templates`) and the workers' scratch folders.
    jobs : int
        Worker processes.
    timeout : float
        CPU seconds a trial's worker may spend before the trial is a hang (or ``WALL_FACTOR`` times
        that in wall time, for a worker blocked without spending CPU): never wall time alone, which
        a busy machine stretches.
    failures : path, optional
        Folder receiving the inputs of every bad trial (bad classes and verify-missed).
    rss_cap : int
        A worker whose RSS passes this many bytes is restarted (counted in ``rss_restarts``).
    """

    def __init__(self, workdir, jobs: int = 2, timeout: float = 60.0, failures=None,
                 rss_cap: int = 4 << 30, start_timeout: float = 600.0, keep_per_class: int = 20):
        self.workdir = Path(workdir)
        self.jobs = max(1, int(jobs))
        self.timeout = float(timeout)
        self.failures = Path(failures) if failures else None
        self.rss_cap = int(rss_cap)
        self.start_timeout = start_timeout
        self.keep = keep_per_class
        self.results: list[dict] = []
        self.rss: dict[int, list] = {}  # worker pid -> [(trials done, rss)]
        self.rss_restarts = 0
        self.restarts = 0
        self._lock = threading.Lock()
        self._kept: dict[tuple, int] = {}
        pkg = Path(__file__).resolve().parents[2]
        self.env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(pkg)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
            PYTHONFAULTHANDLER="1")

    def run(self, requests: list[dict], progress=None) -> list[dict]:
        """Run every request ``{"template", "kind", "seed", "trial"}``; returns the results."""
        todo: queue.Queue = queue.Queue()
        for r in requests:
            todo.put(r)
        errors: list[BaseException] = []
        threads = [threading.Thread(target=self._drive, args=(n, todo, progress, errors), daemon=True)
                   for n in range(self.jobs)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if errors:
            raise errors[0]
        return self.results

    def _drive(self, n: int, todo: queue.Queue, progress, errors: list) -> None:
        log = self.workdir / f"worker{n}.log"
        w = None
        try:
            while True:
                try:
                    req = todo.get_nowait()
                except queue.Empty:
                    break
                if w is None or not w.alive():
                    w = _Worker(n, self.workdir, self.env, log, self.start_timeout)
                    self.rss.setdefault(w.pid, [(0, w.ready["rss"])])
                res = {**req, **w.run(req, self.timeout)}
                if res["class"] in ("crash", "hang", "harness_error") and not w.alive():
                    try:
                        self._describe_dead(res)
                    except Exception as e:  # noqa: BLE001 - keep the campaign going
                        res["mutation"] = f"(could not rebuild the mutation: {_error(e)})"
                    w.stop()
                    w = None
                    with self._lock:
                        self.restarts += 1
                else:
                    series = self.rss[w.pid]
                    series.append((series[-1][0] + 1, res["rss"]))
                    if res["rss"] > self.rss_cap:
                        w.stop()
                        w = None
                        with self._lock:
                            self.rss_restarts += 1
                self._keep(res, n)
                with self._lock:
                    self.results.append(res)
                if progress:
                    progress(res)
        except BaseException as e:  # noqa: BLE001 - re-raised by run()
            errors.append(e)
        finally:
            if w is not None:
                w.stop()

    def _describe_dead(self, res: dict) -> None:
        """The mutation of a trial whose worker died, from the description it left on disk."""
        t = {t.name: t for t in load_templates(self.workdir)}[res["template"]]
        tmp = self.workdir / f"describe-{os.getpid()}-{threading.get_ident()}"
        try:
            muts = prepare_trial(t, res["kind"], res["seed"], res["trial"], tmp / "trial")
            res["region"] = muts[0].region if len(muts) == 1 else "+".join(m.region for m in muts)
            res["mutation"] = "; ".join(m.describe() for m in muts)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _keep(self, res: dict, n: int) -> None:
        """Copy a bad trial's inputs into the failures folder (a few per class and region)."""
        bad = res["class"] in BAD or res.get("verify_missed") and res["class"] != "data_silent"
        if not bad or self.failures is None:
            return
        key = (res["class"], res.get("region"))
        with self._lock:
            self._kept[key] = self._kept.get(key, 0) + 1
            if self._kept[key] > self.keep:
                return
        name = f"{res['class']}-{res.get('region')}-{res['kind']}-{res['template']}-{res['seed']}-{res['trial']}"
        dest = self.failures / name
        src = self.workdir / f"w{n}" / "trial"
        with contextlib.suppress(OSError):
            if src.exists() and res["class"] not in ("crash", "hang"):
                shutil.copytree(src, dest / "export")
            else:  # the worker is gone: rebuild the input from its seed
                t = {t.name: t for t in load_templates(self.workdir)}[res["template"]]
                prepare_trial(t, res["kind"], res["seed"], res["trial"], dest / "export")
            (dest / "result.json").write_text(json.dumps(res, indent=1, default=str))
        res["saved"] = str(dest)

    # --- reporting

    def counts(self, kind: str | None = None) -> dict:
        """{region: {class: n, "verify_missed": n, "trials": n}} plus a "total" row."""
        rows: dict[str, dict] = {}
        for r in self.results:
            if kind and r["kind"] != kind:
                continue
            region = r.get("region") or "?"
            for key in ("two structural edits" if "+" in region else region, "total"):
                row = rows.setdefault(key, {c: 0 for c in CLASSES} | {"verify_missed": 0, "unnamed": 0,
                                                                      "trials": 0})
                row[r["class"]] += 1
                row["trials"] += 1
                row["verify_missed"] += bool(r.get("verify_missed"))
                row["unnamed"] += bool(r.get("unnamed"))
        return rows

    def table(self, kind: str | None = None) -> str:
        """Markdown table of classes by region."""
        rows = self.counts(kind)
        cols = ["trials", *CLASSES[::-1], "verify_missed", "unnamed"]
        names = sorted((k for k in rows if k != "total"), key=lambda k: (-rows[k]["trials"], k)) + ["total"]
        lines = ["| region | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
        for k in names:
            if k in rows:
                lines.append(f"| {k} | " + " | ".join(str(rows[k][c]) for c in cols) + " |")
        return "\n".join(lines)

    def examples(self, classes=("harness_error",) + BAD + ("verify_missed",), per_key: int = 3) -> list[dict]:
        """A few results of each bad class and region (``verify_missed``: verify said ok, data differ,
        outside the data-only regions; ``unnamed``: a typed chunk-read error naming no chunk or file)."""
        seen: dict[tuple, int] = {}
        out = []
        for r in self.results:
            if r["class"] in classes:
                cls, detail = r["class"], r.get("detail")
            elif "verify_missed" in classes and r.get("verify_missed") and r["class"] != "data_silent":
                cls, detail = "verify_missed", r.get("detail")
            elif "unnamed" in classes and r.get("unnamed"):
                cls, detail = "unnamed", r["unnamed"]
            else:
                continue
            key = (cls, r.get("region"))
            seen[key] = seen.get(key, 0) + 1
            if seen[key] <= per_key:
                out.append(r | {"as": cls, "detail": detail})
        return out

    def rss_table(self) -> str:
        """Per worker process: RSS after start-up, at each quarter of its trials, peak and growth."""
        lines = ["| worker pid | trials | RSS ready | at 25 % | at 50 % | at 75 % | last | peak | growth |",
                 "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for pid, s in self.rss.items():
            v = [x / 2**20 for _, x in s]
            q = [v[min(len(v) - 1, round(f * (len(v) - 1)))] for f in (0.25, 0.5, 0.75)]
            lines.append(f"| {pid} | {s[-1][0]} | {v[0]:.0f} | " + " | ".join(f"{x:.0f}" for x in q)
                         + f" | {v[-1]:.0f} | {max(v):.0f} | {v[-1] - v[0]:+.0f} |")
        return "\n".join(lines) + "\n\n(MB)"

    def save(self, path) -> None:
        """Every result and each worker's RSS series as JSON."""
        Path(path).write_text(json.dumps({"results": self.results, "rss": {str(k): v for k, v in self.rss.items()},
                                          "restarts": self.restarts, "rss_restarts": self.rss_restarts},
                                         default=str))


def plan_requests(templates: list[Template], kind: str, n: int, seed: int, start: int = 0) -> list[dict]:
    """n trial requests of a kind, templates taken in turn (CSV trials only on CSV templates)."""
    ts = [t for t in templates if kind == "shard" or t.has_csv]
    return [{"template": ts[i % len(ts)].name, "kind": kind, "seed": seed, "trial": i}
            for i in range(start, start + n)]


# --------------------------------------------------------------------------- memory cycles


def memory_cycles(workdir, cycles: int = 150, warmup: int = 30, seed: int = 0, tracemalloc_top: int = 0,
                  log=None) -> dict:
    """open/read/verify/drop cycles of clean and damaged exports in this process, sampling RSS.

    Cycle c uses template ``c % len(templates)``; every third cycle is clean, the others take
    the mutation regions in turn (every shard and CSV region), so all corruption classes recur.
    Returns RSS per cycle (bytes), thread/fd/map counts at the end of warm-up and at the end,
    the classes seen and, with ``tracemalloc_top``, the largest Python allocation growths.
    ``log``: a file receiving one JSON line per cycle as it ends (survives a crash).
    """
    import tracemalloc

    templates = load_templates(workdir)
    scratch = Path(workdir) / "mem"
    scratch.mkdir(exist_ok=True)
    regions = [("shard", r) for r in SHARD_REGIONS] + [("csv", r) for r in CSV_REGIONS]
    samples: list[int] = []
    classes: dict[str, dict[str, int]] = {}
    counts: dict[str, dict] = {}
    snap = None
    for c in range(cycles):
        t = templates[c % len(templates)]
        root = scratch / "trial"
        if c % 3 == 0:
            if root.exists():
                shutil.rmtree(root)
            shutil.copytree(t.root, root)
            cls = classify(check_export(t, root), False)
            label = "clean"
        else:
            kind, region = regions[(c // 3 * 2 + c % 3 - 1) % len(regions)]
            if kind == "csv" and not t.has_csv:
                kind, region = "shard", "buffers"
            # search trial numbers until the rng picks this region (deterministic, cheap)
            trial = _trial_for_region(t, kind, region, seed, c)
            res = run_trial(t, kind, seed, trial, scratch)
            cls, label = res["class"], f"{kind}:{res['region']}"
        classes[label] = classes.get(label, {})
        classes[label][cls] = classes[label].get(cls, 0) + 1
        gc.collect()
        samples.append(rss_bytes())
        if log is not None:
            with open(log, "a") as f:
                f.write(json.dumps({"cycle": c, "template": t.name, "label": label, "class": cls,
                                    "rss": samples[-1]}) + "\n")
        if c + 1 == warmup:
            counts["warmup"] = _proc_counts()
            if tracemalloc_top:
                tracemalloc.start(10)
                snap = tracemalloc.take_snapshot()
    counts["end"] = _proc_counts()
    out = {"rss": samples, "warmup": warmup, "counts": counts, "classes": classes}
    if snap is not None:
        diff = tracemalloc.take_snapshot().compare_to(snap, "traceback")
        out["tracemalloc"] = [{"size_diff": d.size_diff, "count_diff": d.count_diff,
                               "where": [str(f) for f in d.traceback.format()[-6:]]}
                              for d in diff[:tracemalloc_top]]
        tracemalloc.stop()
    return out


def _trial_for_region(t: Template, kind: str, region: str, seed: int, c: int) -> int:
    """The first trial number from c * 1000 on whose mutation lands in region (same rng as mutate)."""
    regions = CSV_REGIONS if kind == "csv" else SHARD_REGIONS
    tmp_files = _Files(Path(t.root))
    for trial in range(c * 1000, c * 1000 + 1000):
        rng = trial_rng(seed, kind, trial)
        stem = _pick(rng, t.stems)
        if kind == "csv":
            got = _choose_region(rng, regions, lambda r: True)
        else:
            amap = tmp_files.amap(stem + ".arrow")
            got = _choose_region(rng, regions, lambda r, a=amap: _shard_region_ok(t, a, r))
        if got == region:
            return trial
    return c * 1000


# --------------------------------------------------------------------------- entry points


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.support.fuzz", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker", help="trial server used by Campaign")
    w.add_argument("--workdir", required=True)
    w.add_argument("--scratch", required=True)
    m = sub.add_parser("memory", help="memory_cycles in this process, JSON on stdout")
    m.add_argument("--workdir", required=True)
    m.add_argument("--data", default=None, help="folder of the real mCNS shard (optional)")
    m.add_argument("--cycles", type=int, default=150)
    m.add_argument("--warmup", type=int, default=30)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--tracemalloc", type=int, default=0)
    m.add_argument("--log", default=None, help="one JSON line per cycle")
    r = sub.add_parser("repro", help="run one trial in this process and print it")
    r.add_argument("--workdir", required=True)
    r.add_argument("--data", default=None)
    r.add_argument("case", help="KIND:SEED:TRIAL:TEMPLATE, e.g. shard:1:17:real-A")
    args = ap.parse_args(argv)
    if args.cmd == "worker":
        return _worker(args)
    if not (Path(args.workdir) / "templates").is_dir():
        build_templates(args.workdir, args.data)
    if args.cmd == "memory":
        res = memory_cycles(args.workdir, args.cycles, args.warmup, args.seed, args.tracemalloc, args.log)
        print(json.dumps(res))
        return 0
    kind, seed, trial, name = args.case.split(":")
    t = {t.name: t for t in load_templates(args.workdir)}[name]
    scratch = Path(args.workdir) / "repro"
    print(json.dumps(run_trial(t, kind, int(seed), int(trial), scratch), indent=1, default=str))
    print(f"mutated export left in {scratch / 'trial'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
