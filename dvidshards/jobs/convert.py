"""Convert an export to neuroglancer precomputed or zarr v3: every scale of its spec.

``convert(source, dest, format=...)`` (and ``dvidshards convert``) writes:

* **precomputed** — a multiscale segmentation volume, ``compressed_segmentation`` chunks of
  64³ with 8³ blocks, ``neuroglancer_uint64_sharded_v1`` shards (by default the export's own
  sharding, so one DVID shard is one output shard; ``shard_bits_extra=n`` splits each into
  2ⁿ whole output shards). Interior chunks are *transcoded* from the DVID blocks without
  decoding voxels (:mod:`dvidshards.formats.cseg`, byte-identical to TensorStore's encoder).
* **zarr3** — a group with one array per scale (``s0``, ``s1``, …), ``sharding_indexed`` with
  64³ inner chunks compressed by zstd, ``dimension_names`` x, y, z and an OME-Zarr
  ``multiscales`` entry on the group.

How it is safe and bounded:

* The **planner** (:func:`plan_scale`, :func:`plan_tasks`) checks, per scale, that output shards
  are boxes of chunks (identity hash, no shard-number wrap; else :class:`ConvertPlanError`) and
  tries to prove that each lies inside one source shard file's box. Where the proof holds a
  task owns one source shard and therefore all of its output shards (streamed, byte-identical,
  bounded memory). Where it fails — DVID's old shard names at coarse scales (the mCNS spec's
  s7-s11: files of 1024, 512, 256 voxels where neuroglancer's shard is 1088, 576, 320), or an
  output sharding coarser than the export's — the scale is *grouped*: a task owns one output
  shard and reads every source file meeting its box, one at a time (each file read by every
  task it meets; a local shard is spooled beside itself and written in its order, the same
  bytes). Either way no two tasks write one output shard.
* **Scales the export lacks** (DVID exports scale 0 only by default): the scales its spec lists
  above the finest one held are made first by :func:`dvidshards.jobs.downsample.downsample`
  (DVID's pyramid rule, or ``method="mode"``) into ``WORKDIR/scales`` (default ``DEST.work``
  beside the output), then converted with the export as one pyramid; the work folder goes when
  the output is complete. ``resume`` finishes either stage.
* On a **local destination** a precomputed output shard is built on disk as its chunks are
  encoded, minishard by minishard (:class:`dvidshards.formats.sharding.ShardFileWriter`, with
  TensorStore's own gzip for the minishard indexes: byte-identical to its sharded writer), then
  renamed over the old file: a task holds one chunk and one minishard index, whatever the size
  of the shard (a dense 32,768-chunk shard with raw chunk data: ~0.8 GB of output, 0.72 GiB peak
  RSS, most of it the source shard; one transaction: 1.4 GiB). On other kvstores (gs://, s3://)
  and for zarr3, each output shard is written in **one kvstore transaction of encoded chunks**
  through TensorStore's ``neuroglancer_uint64_sharded`` or ``zarr3_sharding_indexed`` driver:
  a task holds one output shard's encoded bytes (zarr3's are zstd-compressed, ~4 KB a chunk).
  Either way the cost per chunk does not grow with the shard. Chunks TensorStore must encode
  (edge chunks cut by the volume bound, zarr3, ``encoder="tensorstore"``) are decoded and
  written into an unsharded in-memory array of the same geometry and encoding; the chunk's
  bytes are read back from the memory kvstore. ``info`` and the arrays' ``zarr.json`` are
  written by TensorStore's drivers before any data (the zarr group's ``zarr.json`` through
  TensorStore's kvstore: it has no group driver).
* The destination holds a **manifest**, ``_dvidshards.json``: the command and arguments, the
  spec, the scales made (``made``), the tasks of both stages counted and the failed ones named
  with their reasons, ``"complete": false`` from before the first chunk until every task has
  succeeded. ``dvidshards verify DEST`` reports it (and spot-checks the scales converted from
  the export against it). A destination holding
  anything but this conversion's own earlier output is refused before anything is written
  (``overwrite=True`` replaces this conversion's files and leaves others alone).
* Precomputed chunk data is gzipped here (zlib level 1 by default, ``gzip_level``) and handed to
  the sharded kvstore driver as is: TensorStore's own writer compresses at level 9, which
  costs ~15x the CPU of level 1 for chunks ~20 % smaller; readers decode either.
* Background (all-zero) chunks and absent chunks are never written; records outside the volume
  are counted and skipped.
* ``resume=True`` skips output shards that exist with the expected number of chunks (records
  whose palette is not all 0), reading only their index; shard files are written whole, anything
  else is deleted and rewritten. The manifest's arguments must match the interrupted run's; the
  manifest is made complete when the resumed run succeeds.
* Tasks run where ``scheduler`` says (:mod:`dvidshards.jobs.runner`: in this process, on
  threads by default, or on dask), one :class:`~dvidshards.jobs.runner.TaskRunner` per job.
  The transcode kernel answers through its numpy fallback while numba compiles it in the
  background, so a fresh worker's first task does not wait for the compiler.
"""

from __future__ import annotations

import contextlib
import gzip
import itertools
import json
import math
import os
import resource
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import SupportsFloat, SupportsInt

import numpy as np

from ..dataset import Dataset
from ..errors import BlockDecodeError, DvidShardsError, OutputError, ShardFormatError, SpecError
from ..formats.cseg import transcode_u8
from ..formats.labels import as_labels
from ..formats.multiscale import SINGLE_SHARD
from ..formats.records import R_NSV
from ..formats.sharding import (
    ShardFileWriter,
    ShardingSpec,
    compressed_morton_code,
    compressed_z_index_bits,
    grid_shape,
    shard_and_minishard,
    shard_extent_chunks,
    shard_key,
)
from .options import (
    add_dest,
    add_job_options,
    add_labels,
    add_scales,
    add_source,
    command_line,
    dest_of,
    job_options,
    scales_of,
)
from .output import Destination, JobReport, Output, check_apart
from .output import read_manifest as _read_manifest
from .readback import compare_chunks, kvstore_root, open_scale
from .runner import TaskRunner, scheduler_of

__all__ = ["ConvertCommand",
    "FORMATS",
    "ZARR_INNER_CODECS",
    "ConvertPlanError",
    "ConvertTotals",
    "ShardResult",
    "ScalePlan",
    "add_arguments",
    "convert",
    "default_workdir",
    "main",
    "plan_scale",
    "plan_tasks",
    "read_manifest",
]

FORMATS = ("precomputed", "zarr3")
ENCODERS = ("transcode", "tensorstore")
# zarr3 inner chunks: raw little-endian uint64 then zstd (segmentation compresses ~10x)
ZARR_INNER_CODECS = [{"name": "bytes", "configuration": {"endian": "little"}},
                     {"name": "zstd", "configuration": {"level": 3, "checksum": False}}]
ZARR_INDEX_CODECS = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
_NO_CHUNK = np.uint64(2**64 - 1)
#: the kernels a conversion task uses, slowest to compile first (TaskRunner.run compiles them first)
KERNELS = ("dvidshards.formats.cseg._transcode_kernel", "dvidshards.formats.codec._decode_kernel",
           "dvidshards.formats.arrowipc._resolve", "dvidshards.formats.arrowipc._message",
           "dvidshards.formats.mapping._apply")
_ZERO8 = bytes(8)
_U64 = np.dtype(np.uint64)


class ConvertPlanError(SpecError):
    """The planner refuses a layout: output shards could be shared between tasks, or the
    source geometry cannot be converted chunk for chunk."""


# --------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class ScalePlan:
    """What one scale of the output looks like and how source shards map onto it.

    Vectors are x, y, z. ``grid`` is the output chunk grid (from ``voxel_offset``);
    ``shard_chunks`` the output shard box in chunks; ``cell`` the source shard file's box side
    in chunks, under the naming of its files (source chunk coordinates are absolute, output
    ones relative to the offset). ``grouped``: tasks are output shards, not source shards.
    """

    index: int
    key: str
    size: tuple[int, int, int]
    voxel_offset: tuple[int, int, int]
    resolution: tuple[float, float, float]
    chunk: int
    grid: tuple[int, int, int]
    shard_chunks: tuple[int, int, int]
    cell: int
    sharding: dict | None = None  # output neuroglancer sharding spec (precomputed)
    #: one task per output shard, reading every source file meeting its box (the proof that
    #: source files hold whole output shards fails: DVID's old names at coarse scales, a coarser
    #: output sharding); else one task per source shard
    grouped: bool = False

    @property
    def chunk_offset(self) -> np.ndarray:
        return np.asarray(self.voxel_offset, np.int64) // self.chunk

    def precomputed_sharding(self) -> dict:
        """The output neuroglancer sharding spec; only precomputed plans have one."""
        if self.sharding is None:
            raise ConvertPlanError(f"scale {self.index}: plan has no output sharding "
                                   f"(planned for zarr3, used as precomputed)")
        return self.sharding

    def shard_ids(self, rel: np.ndarray) -> np.ndarray:
        """Output shard of each relative chunk coordinate: shard number, or a flat box index."""
        if self.sharding is not None:
            shard, _ = shard_and_minishard(ShardingSpec.from_json(self.sharding), rel, self.grid)
            return np.asarray(shard, np.uint64).astype(np.int64)
        box = rel // np.asarray(self.shard_chunks, np.int64)
        nb = [-(-g // s) for g, s in zip(self.grid, self.shard_chunks, strict=True)]
        return (box[:, 2] * nb[1] + box[:, 1]) * nb[0] + box[:, 0]

    def shard_file(self, rel_first: np.ndarray, shard_id: int) -> str:
        """Key of an output shard file under the output root."""
        if self.sharding is not None:
            return f"{self.key}/{shard_key(int(shard_id), int(self.sharding['shard_bits']))}"
        i, j, k = (int(v) for v in np.asarray(rel_first) // np.asarray(self.shard_chunks))
        return f"{self.key}/c/{i}/{j}/{k}"


def _int3(v: Sequence[SupportsInt]) -> tuple[int, int, int]:
    x, y, z = v
    return int(x), int(y), int(z)


def _float3(v: Sequence[SupportsFloat]) -> tuple[float, float, float]:
    x, y, z = v
    return float(x), float(y), float(z)


def _output_sharding(src: ShardingSpec, extra: int, where: str) -> ShardingSpec:
    """The export's sharding with ``extra`` more shard bits, taken from minishard then preshift
    bits, so that every output shard box is a sub-box of a source one."""
    if extra < 0:
        raise ConvertPlanError(f"{where}: shard_bits_extra must be >= 0, got {extra}")
    take_m = min(extra, src.minishard_bits)
    take_p = extra - take_m
    if take_p > src.preshift_bits or src.shard_bits + extra > 64:
        raise ConvertPlanError(f"{where}: cannot split shards {extra} more times: the sharding has "
                               f"{src.minishard_bits} minishard + {src.preshift_bits} preshift bits")
    j = src.to_json()
    j.update(shard_bits=src.shard_bits + extra, minishard_bits=src.minishard_bits - take_m,
             preshift_bits=src.preshift_bits - take_p)
    return ShardingSpec.from_json(j)


def plan_scale(scale, fmt: str = "precomputed", *, shard_bits_extra: int = 0,
               sharding: dict | None = None, data_encoding: str = "gzip") -> ScalePlan:
    """Plan one scale: output geometry, and the kind of task that writes each output shard whole.

    The proof that every output shard lies in one source shard file (under the scale's naming)
    gives one task per source shard; where it fails the plan is ``grouped``: one task per
    output shard (:func:`plan_tasks`).

    Parameters
    ----------
    scale : dvidshards.formats.multiscale.Scale
        The source scale (from the export's spec).
    fmt : {"precomputed", "zarr3"}
    shard_bits_extra : int
        Split every source shard into ``2**n`` output shards.
    sharding : dict, optional
        An explicit output ``neuroglancer_uint64_sharded_v1`` spec instead of the export's own
        (still subject to the proof).
    data_encoding : {"gzip", "raw"}
        Precomputed chunk data encoding inside shards with the export's sharding (an explicit
        ``sharding`` keeps its own).

    Returns
    -------
    ScalePlan

    Raises
    ------
    ConvertPlanError
        When output shards are not boxes of chunks (a hashed sharding, shard numbers that wrap,
        more shard bits than the sharding has) or the geometry is not chunk-aligned.
    """
    where = f"scale {scale.index}"
    if fmt not in FORMATS:
        raise SpecError(f"format must be one of {FORMATS}, got {fmt!r}")
    cs = tuple(int(c) for c in scale.chunk_size)
    if len(set(cs)) != 1:
        raise ConvertPlanError(f"{where}: chunks {cs} are not cubic")
    chunk = cs[0]
    off = _int3(scale.voxel_offset)
    if any(v % chunk for v in off):
        raise ConvertPlanError(f"{where}: voxel_offset {off} is not a multiple of the chunk size {chunk}: "
                               f"DVID chunks would straddle output chunks")
    if scale.resolution is None:
        raise ConvertPlanError(f"{where}: resolution unknown (geometry inferred); give the export's spec")
    src = scale.sharding
    if sharding is not None:
        out = sharding if isinstance(sharding, ShardingSpec) else ShardingSpec.from_json(sharding)
        if shard_bits_extra:
            out = _output_sharding(out, shard_bits_extra, where)
    elif src is None:
        raise ConvertPlanError(f"{where}: the export's spec has no sharding; give the spec DVID was given "
                               f"(--spec) or an output sharding")
    else:
        out = _output_sharding(src, shard_bits_extra, where)
    if out.hash != "identity":
        raise ConvertPlanError(f"{where}: output sharding hash {out.hash!r} does not make shards boxes of "
                               f"chunks, so no task can own whole output shards; use 'identity'")
    if sharding is None:  # the export's bits; chunk data encoded as asked (DVID's specs say raw)
        out = ShardingSpec.from_json({**out.to_json(), "data_encoding": data_encoding})
    grid = grid_shape(scale.size, chunk)
    bits = compressed_z_index_bits(grid)
    if sum(bits) > out.preshift_bits + out.minishard_bits + out.shard_bits:
        raise ConvertPlanError(
            f"{where}: the chunk grid {grid} needs {sum(bits)} Morton bits but the output sharding has "
            f"{out.preshift_bits + out.minishard_bits + out.shard_bits}: shard numbers would wrap and one "
            f"output shard would hold chunks of several source shards")
    box = shard_extent_chunks(out, grid)
    extent = int(min(scale.shard_extent, SINGLE_SHARD))
    if extent % chunk:
        raise ConvertPlanError(f"{where}: source shard extent {extent} is not a multiple of {chunk}")
    cell = extent // chunk
    coff = [v // chunk for v in off]
    # the proof: along each axis every output box interval lies in one source cell; where it
    # fails (files smaller than the output shard, or boxes across files), tasks are output shards
    grouped = False
    for a in range(3):
        for k in range(-(-grid[a] // box[a])):
            lo = coff[a] + k * box[a]
            hi = coff[a] + min((k + 1) * box[a], grid[a]) - 1
            grouped = grouped or lo // cell != hi // cell
    return ScalePlan(
        index=scale.index, key=f"s{scale.index}" if fmt == "zarr3" else (scale.key or f"s{scale.index}"),
        size=_int3(scale.size), voxel_offset=off,
        resolution=_float3(scale.resolution), chunk=chunk, grid=grid,
        shard_chunks=_int3(box), cell=cell,
        sharding=out.to_json() if fmt == "precomputed" else None, grouped=grouped,
    )


def plan_tasks(sp: ScalePlan, origins) -> list[tuple]:
    """The tasks of one planned scale from the voxel origins of its source shard files.

    One ``(scale, origin)`` per source shard, or on a grouped scale one ``(scale, (i, j, k),
    origins)`` per output shard: its box index (output shard box ``i, j, k`` along x, y, z) and
    the source files meeting that box, each read in turn. Either way no two tasks write one
    output shard, and what the client holds grows with shard files, not chunks.
    """
    origins = [tuple(int(v) for v in o) for o in origins]
    if not sp.grouped:
        return [(sp.index, o) for o in origins]
    box = np.asarray(sp.shard_chunks, np.int64)
    grid = np.asarray(sp.grid, np.int64)
    groups: dict[tuple[int, int, int], set] = {}
    for o in origins:
        lo = np.asarray(o, np.int64) // sp.chunk - sp.chunk_offset
        hi = np.minimum(lo + sp.cell, grid)
        lo = np.maximum(lo, 0)
        if (lo >= hi).any():
            continue  # a file wholly outside the volume (the dataset's name check refuses those)
        for b in itertools.product(*(range(int(lo[a] // box[a]), int((hi[a] - 1) // box[a]) + 1)
                                     for a in range(3))):
            groups.setdefault(_int3(b), set()).add(o)
    return [(sp.index, b, tuple(sorted(groups[b]))) for b in sorted(groups)]


# --------------------------------------------------------------------------- output metadata


def _sub(root: dict, path: str) -> dict:
    j = dict(root)
    j["path"] = root.get("path", "") + path
    return j


def _precomputed_spec(kv: dict, sp: ScalePlan, sharded: bool) -> dict:
    meta: dict[str, object] = {
            "key": sp.key, "size": list(sp.size), "voxel_offset": list(sp.voxel_offset),
            "resolution": list(sp.resolution), "chunk_size": [sp.chunk] * 3,
            "encoding": "compressed_segmentation", "compressed_segmentation_block_size": [8, 8, 8]}
    if sharded and sp.sharding is not None:
        meta["sharding"] = sp.sharding
    return {"driver": "neuroglancer_precomputed", "kvstore": kv,
            "multiscale_metadata": {"type": "segmentation", "data_type": "uint64", "num_channels": 1},
            "scale_metadata": meta}


def _zarr3_metadata(sp: ScalePlan, sharded: bool) -> dict:
    if sharded:
        codecs = [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": [sp.chunk] * 3, "codecs": ZARR_INNER_CODECS,
            "index_codecs": ZARR_INDEX_CODECS, "index_location": "end"}}]
        outer = [sp.chunk * b for b in sp.shard_chunks]
    else:
        codecs, outer = ZARR_INNER_CODECS, [sp.chunk] * 3
    return {"shape": list(sp.size), "data_type": "uint64", "fill_value": 0,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": outer}},
            "codecs": codecs, "dimension_names": ["x", "y", "z"]}


def _ome_group(plans: list[ScalePlan], existing: dict | None) -> dict:
    datasets = {}
    if existing:
        for ms in existing.get("attributes", {}).get("ome", {}).get("multiscales", [])[:1]:
            for d in ms.get("datasets", []):
                datasets[d["path"]] = d
    for sp in plans:
        datasets[sp.key] = {"path": sp.key, "coordinateTransformations": [
            {"type": "scale", "scale": list(sp.resolution)},
            {"type": "translation", "translation": [o * r for o, r in zip(sp.voxel_offset, sp.resolution, strict=True)]}]}
    ordered = [datasets[k] for k in sorted(datasets, key=lambda p: (len(p), p))]
    return {"zarr_format": 3, "node_type": "group", "attributes": {"ome": {"version": "0.5", "multiscales": [{
        "name": "segmentation", "axes": [{"name": a, "type": "space", "unit": "nanometer"} for a in "xyz"],
        "datasets": ordered}]}}}


def _create_output(kv: dict, fmt: str, plans: list[ScalePlan], context) -> None:
    """Write info / zarr.json (TensorStore's drivers) before any data; fail on a mismatch."""

    import tensorstore as ts

    try:
        if fmt == "precomputed":
            for sp in plans:
                ts.open(_precomputed_spec(kv, sp, True), create=True, open=True, context=context).result()
        else:
            root = ts.KvStore.open(kv, context=context).result()
            r = root.read("zarr.json").result()
            existing = json.loads(r.value) if r.state == "value" else None
            if existing is not None and existing.get("node_type") != "group":
                raise ConvertPlanError(f"{_describe(kv)}zarr.json exists and is not a zarr v3 group")
            root.write("zarr.json", json.dumps(_ome_group(plans, existing), indent=1).encode()).result()
            for sp in plans:
                ts.open({"driver": "zarr3", "kvstore": _sub(kv, sp.key + "/"),
                         "metadata": _zarr3_metadata(sp, True)}, create=True, open=True, context=context).result()
    except ValueError as e:
        if isinstance(e, DvidShardsError):
            raise
        text = " ".join(str(e).split()).split(" [tensorstore_spec=", 1)[0]
        status = text.split(":", 1)[0]
        if status in ("PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED"):
            why = {"PERMISSION_DENIED": "permission denied", "RESOURCE_EXHAUSTED": "no space left (or a quota)"}.get(
                status, text[:160])
            raise OutputError(f"{_describe(kv)}: cannot write the output's metadata: {why}") from None
        raise ConvertPlanError(f"{_describe(kv)}: existing output does not match this conversion "
                               f"({text[:200]}); choose another destination or pass --overwrite") from None


def _describe(kv: dict) -> str:
    driver = str(kv.get("driver"))
    scheme = {"gcs": "gs"}.get(driver, driver)  # the URL a user writes: gs://
    return f"{scheme}://{kv.get('bucket', '')}{'/' if kv.get('bucket') else ''}{kv.get('path', '')}"


# --------------------------------------------------------------------------- existing shards


def count_shard_chunks(data: bytes, fmt: str, sp: ScalePlan, where: str) -> int:
    """Chunks held by an output shard file, from its index (raises ShardFormatError)."""
    n = len(data)

    def read(a: int, b: int) -> bytes:
        if b > n:
            raise ShardFormatError(f"{where}: shard of {n} bytes, its index needs {b}")
        return data[a:b]

    return _count_chunks(read, n, fmt, sp, where)


def _count_chunks(read, size: int, fmt: str, sp: ScalePlan, where: str) -> int:
    # read(a, b) -> bytes [a, b) of the shard file (a < 0: from the end); reads the index only
    if fmt == "zarr3":
        n = math.prod(sp.shard_chunks)
        if 0 <= size < 16 * n + 4:
            raise ShardFormatError(f"{where}: zarr shard shorter than its index")
        tail = read(size - 16 * n - 4 if size >= 0 else -(16 * n + 4), size if size >= 0 else None)
        if len(tail) != 16 * n + 4:
            raise ShardFormatError(f"{where}: zarr shard shorter than its index")
        idx = np.frombuffer(tail, "<u8", 2 * n)
        return int((idx[0::2] != _NO_CHUNK).sum())
    spec = sp.precomputed_sharding()
    nmini = 1 << int(spec["minishard_bits"])
    head = read(0, 16 * nmini)
    if len(head) != 16 * nmini:
        raise ShardFormatError(f"{where}: shard shorter than its index")
    ranges = np.frombuffer(head, "<u8").reshape(-1, 2)
    ranges = ranges[ranges[:, 0] != ranges[:, 1]]
    if not len(ranges):
        return 0
    if (ranges[:, 0] > ranges[:, 1]).any() or ranges.max() > 2**40:
        raise ShardFormatError(f"{where}: minishard index out of range")
    ranges = ranges.astype(np.int64)
    a, b = int(ranges[:, 0].min()), int(ranges[:, 1].max())
    region = read(16 * nmini + a, 16 * nmini + b)
    if len(region) != b - a:
        raise ShardFormatError(f"{where}: minishard index out of range")
    total = 0
    for lo, hi in ranges.tolist():
        raw = region[lo - a:hi - a]
        if spec.get("minishard_index_encoding", "raw") == "gzip":
            try:
                raw = gzip.decompress(raw)
            except (OSError, EOFError) as e:
                raise ShardFormatError(f"{where}: bad gzip minishard index ({e})") from None
        if len(raw) % 24:
            raise ShardFormatError(f"{where}: minishard index of {len(raw)} bytes")
        total += len(raw) // 24
    return total


def _existing_chunks(root, key: str, fmt: str, sp: ScalePlan, where: str) -> int | None:
    """Chunks in an existing output shard (byte-range reads of its index); None: no file,
    -1: damaged."""
    state = {}

    def read(a: int, b: int | None) -> bytes:
        r = root.read(key, byte_range=slice(a, b)).result()
        if r.state != "value":
            state["missing"] = True
            raise ShardFormatError(f"{where}: missing")
        return r.value

    try:
        return _count_chunks(read, -1, fmt, sp, where)
    except ShardFormatError:
        return None if state else -1
    except ConvertPlanError:  # a plan without sharding used as precomputed: not a damaged file
        raise
    except ValueError:  # OUT_OF_RANGE from TensorStore: shorter than its index
        return -1


# --------------------------------------------------------------------------- the task


@dataclass
class _Job:
    token: str
    dataset: Dataset
    fmt: str
    dest: dict
    labels: object
    encoder: str
    resume: bool
    plans: dict
    gzip_level: int = 1
    only: frozenset | None = None
    stream: bool = True

    @property
    def local_root(self) -> str | None:
        """The destination folder when it is a local file system (shards are streamed to disk)."""
        return self.dest["path"] if self.dest.get("driver") == "file" and self.stream else None


class _Stager:
    """Chunks encoded by TensorStore: an unsharded in-memory array of the output's geometry."""

    def __init__(self, fmt: str, sp: ScalePlan, context):
        import tensorstore as ts

        self.fmt, self.sp = fmt, sp
        mem = {"driver": "memory", "path": f"stage-{uuid.uuid4().hex}/"}
        if fmt == "precomputed":
            self.arr = ts.open(_precomputed_spec(mem, sp, False), create=True, context=context).result()[..., 0]
        else:
            self.arr = ts.open({"driver": "zarr3", "kvstore": mem, "metadata": _zarr3_metadata(sp, False)},
                               create=True, context=context).result()
        self.kv = ts.KvStore.open(mem, context=context).result()

    def encode(self, rel, vol_zyx: np.ndarray) -> bytes | None:
        """Encoded bytes of one chunk at relative chunk position ``rel`` (None: all fill)."""
        sp = self.sp
        lo = np.asarray(rel, np.int64) * sp.chunk
        hi = np.minimum(lo + sp.chunk, sp.size)
        if self.fmt == "precomputed":
            lo = lo + sp.voxel_offset
            hi = hi + sp.voxel_offset
            key = f"{sp.key}/{lo[0]}-{hi[0]}_{lo[1]}-{hi[1]}_{lo[2]}-{hi[2]}"
        else:
            key = "c/{}/{}/{}".format(*(int(v) for v in rel))
        self.arr[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]].write(vol_zyx.T).result()
        r = self.kv.read(key).result()
        if r.state != "value":
            return None
        self.kv.write(key, None).result()  # delete
        return r.value


class _TsGzip:
    """TensorStore's own gzip of a minishard index (its zlib build's bytes, not Python's): the
    index written as the one value of a 0-bit sharded store with gzip data, on the memory kvstore."""

    def __init__(self, context):
        import tensorstore as ts

        mem = {"driver": "memory", "path": f"gz-{uuid.uuid4().hex}/"}
        self.kv = ts.KvStore.open({"driver": "neuroglancer_uint64_sharded", "base": mem, "metadata": {
            "@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 0, "minishard_bits": 0, "shard_bits": 0,
            "hash": "identity", "data_encoding": "gzip", "minishard_index_encoding": "raw"}},
            context=context).result()
        self.mem = ts.KvStore.open(mem, context=context).result()

    def __call__(self, data: bytes) -> bytes:
        self.kv.write(_ZERO8, data).result()
        raw = self.mem.read("0.shard").result().value  # shard index (16), the value, its index (24)
        start, size = struct.unpack_from("<QQ", raw, len(raw) - 16)
        return bytes(raw[16 + start:16 + start + size])


class _Worker:
    """Per-process state of one conversion: dataset, label source, kvstores; and per thread
    (the "threads" scheduler runs tasks side by side on this one object) stagers and buffers."""

    def __init__(self, job: _Job):
        import tensorstore as ts

        self.job = job
        self.ds = job.dataset
        self.labels = as_labels(job.labels)
        self.context = ts.Context({"cache_pool": {"total_bytes_limit": 0}})
        self.root = ts.KvStore.open(job.dest, context=self.context).result()
        self._stores: dict = {}
        self._lock = threading.Lock()
        self.local = threading.local()  # stagers, scratch, gzip of this thread

    @property
    def scratch(self) -> np.ndarray | None:
        return getattr(self.local, "scratch", None)

    @scratch.setter
    def scratch(self, a: np.ndarray) -> None:
        self.local.scratch = a

    def stager(self, sp: ScalePlan) -> _Stager:
        stagers = self.local.__dict__.setdefault("stagers", {})
        s = stagers.get(sp.index)
        if s is None:
            s = stagers[sp.index] = _Stager(self.job.fmt, sp, self.context)
        return s

    def gzip_index(self) -> _TsGzip:
        g = getattr(self.local, "gzip", None)
        if g is None:
            g = self.local.gzip = _TsGzip(self.context)
        return g

    def shard_store(self, sp: ScalePlan, shard_file: str):
        import tensorstore as ts

        if self.job.fmt == "precomputed":
            with self._lock:
                kv = self._stores.get(sp.index)
                if kv is None:
                    kv = self._stores[sp.index] = ts.KvStore.open({
                        "driver": "neuroglancer_uint64_sharded", "base": _sub(self.job.dest, sp.key + "/"),
                        # chunk data gzipped by _gzip
                        "metadata": {**sp.precomputed_sharding(), "data_encoding": "raw"}},
                        context=self.context).result()
            return kv
        return ts.KvStore.open({
            "driver": "zarr3_sharding_indexed", "base": _sub(self.job.dest, shard_file),
            "grid_shape": list(sp.shard_chunks), "index_codecs": ZARR_INDEX_CODECS,
            "index_location": "end"}, context=self.context).result()


_WORKERS: dict[str, _Worker] = {}
_WORKERS_LOCK = threading.Lock()


def _worker(job: _Job) -> _Worker:
    with _WORKERS_LOCK:
        w = _WORKERS.get(job.token)
        if w is None:
            _WORKERS.clear()  # one conversion at a time per process
            w = _WORKERS[job.token] = _Worker(job)
        return w


@dataclass
class ShardResult:
    """What one task did (one source shard); summed over tasks, a conversion's ``report.totals``."""

    records: int = 0
    written: int = 0
    transcoded: int = 0
    encoded: int = 0  # by TensorStore
    background: int = 0
    outside: int = 0
    shards_written: int = 0
    shards_skipped: int = 0
    encoded_bytes: int = 0
    cpu_s: float = 0.0
    wall_s: float = 0.0
    max_rss_mib: float = 0.0

    def to_json(self) -> dict:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in self.__dict__.items()}

    def add(self, o: ShardResult) -> None:
        for f in ("records", "written", "transcoded", "encoded", "background", "outside", "shards_written",
                  "shards_skipped", "encoded_bytes", "cpu_s", "wall_s"):
            setattr(self, f, getattr(self, f) + getattr(o, f))
        self.max_rss_mib = max(self.max_rss_mib, o.max_rss_mib)


def _source_rows(table, origin, sp: ScalePlan) -> tuple[np.ndarray, np.ndarray]:
    """``(rel, inside)`` of one source shard's records: output chunk coordinates (relative to the
    volume's offset) and whether each lies in the volume. A record outside its file's box is a
    ShardFormatError naming it (the file is damaged, or its name is not its box)."""
    coords = np.asarray(table.coords, np.int64).reshape(-1, 3)
    cell_lo = np.asarray(origin, np.int64) // sp.chunk
    outside_cell = ((coords < cell_lo) | (coords >= cell_lo + sp.cell)).any(axis=1)
    if outside_cell.any():
        i = int(np.flatnonzero(outside_cell)[0])
        raise ShardFormatError(f"{table.where(i)}: chunk lies outside its shard's box "
                               f"(origin {tuple(origin)}, {sp.cell} chunks per side)")
    rel = coords - sp.chunk_offset
    inside = ((rel >= 0) & (rel < np.asarray(sp.grid))).all(axis=1)
    return rel, inside


def _convert_shard(job: _Job, item) -> ShardResult:
    """The task: convert every record of one source shard into its (whole) output shards (on a
    grouped scale: one output shard from the source shards meeting it, :func:`_convert_group`)."""
    if len(item) == 3:
        return _convert_group(job, item)
    t0, c0 = time.perf_counter(), time.process_time()  # with threads: the process, others included
    if job.only is not None and item not in job.only:
        return ShardResult()
    w = _worker(job)
    k, origin = item
    sp: ScalePlan = job.plans[k]
    res = ShardResult()
    table = w.ds.shard(k, origin).table()
    res.records = len(table)
    if not len(table):
        return res
    rel, inside = _source_rows(table, origin, sp)
    res.outside = int((~inside).sum())
    rows = np.flatnonzero(inside)
    ids = sp.shard_ids(rel[rows])
    order = np.argsort(ids, kind="stable")
    rows, ids = rows[order], ids[order]
    cuts = np.flatnonzero(np.diff(ids)) + 1
    for group in np.split(rows, cuts):
        _write_output_shard(w, sp, table, group, rel, res)
    res.cpu_s = time.process_time() - c0
    res.wall_s = time.perf_counter() - t0
    res.max_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return res


def _convert_group(job: _Job, item) -> ShardResult:
    """The task of a grouped scale: one whole output shard from every source shard meeting its
    box, read one at a time (``item`` is ``(scale, box index, source origins)``).

    A local precomputed shard is streamed as on the other path, its encoded chunks spooled to a
    file beside it in the order they are read and then written in the shard's order: memory is
    one source shard and 24 bytes per chunk. Elsewhere the chunks go into one transaction.
    Records outside the volume are counted by the task whose box holds the file's first chunk
    inside the volume (once per file).
    """
    t0, c0 = time.perf_counter(), time.process_time()
    if job.only is not None and item not in job.only:
        return ShardResult()
    w = _worker(job)
    k, b, origins = item
    sp: ScalePlan = job.plans[k]
    res = ShardResult()
    size = np.asarray(sp.shard_chunks, np.int64)
    lo = np.asarray(b, np.int64) * size
    hi = np.minimum(lo + size, sp.grid)
    fname = sp.shard_file(lo, int(sp.shard_ids(lo[None])[0]))

    def sources():
        """(table, rows in the box, their relative coordinates, whole chunks) per source shard."""
        for o in origins:
            table = w.ds.shard(k, o).table()
            if not len(table):
                continue
            rel, inside = _source_rows(table, o, sp)
            first = np.maximum(np.asarray(o, np.int64) // sp.chunk - sp.chunk_offset, 0) // size
            mine = inside & ((rel >= lo) & (rel < hi)).all(axis=1)
            rows = np.flatnonzero(mine)
            yield table, rows, rel[rows], ((rel[rows] + 1) * sp.chunk <= np.asarray(sp.size)).all(axis=1), \
                int((~inside).sum()) if tuple(first.tolist()) == tuple(b) else 0

    if job.resume:
        have = _existing_chunks(w.root, fname, job.fmt, sp, _describe(job.dest) + fname)
        if have is not None:
            want = 0
            for table, rows, _, _, _ in sources():
                want += _expected_chunks(w, table, rows)
            if have == want:
                res.shards_skipped += 1
                return _timed(res, t0, c0)
    if job.fmt == "precomputed" and job.local_root is not None:
        _spool_precomputed(w, sp, sources(), fname, res)
    else:
        def pieces():
            for table, rows, rr, whole, outside in sources():
                res.records += len(rows)
                res.outside += outside
                if job.fmt == "precomputed":
                    keys = [struct.pack(">Q", int(c)) for c in
                            np.atleast_1d(compressed_morton_code(rr, sp.grid)).astype(np.uint64)]
                else:
                    keys = [struct.pack(">III", *(int(v) for v in c)) for c in rr % size]
                yield from zip(keys, itertools.repeat(table), rows, rr, whole)

        _transaction_write(w, sp, fname, pieces(), res)
    return _timed(res, t0, c0)


def _timed(res: ShardResult, t0: float, c0: float) -> ShardResult:
    res.cpu_s = time.process_time() - c0
    res.wall_s = time.perf_counter() - t0
    res.max_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return res


def _spool_precomputed(w: _Worker, sp: ScalePlan, sources, fname: str, res: ShardResult) -> None:
    """A local output shard of a grouped scale: chunks encoded source by source into a spool file
    beside it, then copied into the shard file in its order (minishard, key) by ShardFileWriter,
    whose bytes are TensorStore's. Renamed over the old file when whole."""
    spec = ShardingSpec.from_json(sp.precomputed_sharding())
    path = os.path.join(w.job.local_root or "", fname)
    stem = f"{path}.{w.job.token}.{threading.get_ident()}"
    tmp, spool = f"{stem}.tmp", f"{stem}.spool.tmp"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    keys: list[np.ndarray] = []
    starts: list[int] = []
    sizes: list[int] = []
    try:
        with open(spool, "w+b") as sf:
            pos = 0
            for table, rows, rr, whole, outside in sources:
                res.records += len(rows)
                res.outside += outside
                if not len(rows):
                    continue
                codes = np.atleast_1d(compressed_morton_code(rr, sp.grid)).astype(np.uint64)
                kept = np.zeros(len(rows), bool)
                for j in range(len(rows)):
                    enc = _chunk_bytes(w, sp, table, int(rows[j]), rr[j], bool(whole[j]), res)
                    if enc is not None:
                        sf.write(enc)
                        starts.append(pos)
                        sizes.append(len(enc))
                        pos += len(enc)
                        kept[j] = True
                keys.append(codes[kept])
            allkeys = np.concatenate(keys) if keys else np.zeros(0, np.uint64)
            mini = (allkeys >> np.uint64(spec.preshift_bits)) & np.uint64((1 << spec.minishard_bits) - 1) \
                if spec.preshift_bits < 64 else np.zeros_like(allkeys)
            order = np.lexsort((allkeys, mini))
            with open(tmp, "wb") as f:
                out = ShardFileWriter(spec, f, w.gzip_index())
                for j in order.tolist():
                    sf.seek(starts[j])
                    out.add(int(allkeys[j]), sf.read(sizes[j]))
                n = out.finish()
                f.flush()
                os.fsync(f.fileno())
        if n:
            os.replace(tmp, path)
            res.shards_written += 1
        else:
            os.unlink(tmp)
            if os.path.exists(path):
                os.unlink(path)  # an earlier run's shard: this one holds only background
    finally:
        for p in (tmp, spool):
            if os.path.exists(p):
                os.unlink(p)


def _expected_chunks(w: _Worker, table, rows) -> int:
    # records whose palette is all 0 are background (others almost always are not)
    n = 0
    for i in rows:
        pal = w.labels.palette(table, int(i))
        pal = table.supervoxels(int(i)) if pal is None else pal
        n += bool(np.any(pal))
    return n


def _write_output_shard(w: _Worker, sp: ScalePlan, table, rows, rel, res: ShardResult) -> None:
    job = w.job
    fname = sp.shard_file(rel[rows[0]], int(sp.shard_ids(rel[rows[:1]])[0]))
    if job.resume:
        have = _existing_chunks(w.root, fname, job.fmt, sp, _describe(job.dest) + fname)
        if have is not None and have == _expected_chunks(w, table, rows):
            res.shards_skipped += 1
            return
    rr = rel[rows]
    whole = ((rr + 1) * sp.chunk <= np.asarray(sp.size)).all(axis=1)  # else cut by the bound
    if job.fmt == "precomputed":
        keys = np.atleast_1d(compressed_morton_code(rr, sp.grid)).astype(np.uint64)
        if job.local_root is not None:
            _stream_precomputed(w, sp, table, rows, rr, whole, keys, fname, res)
            return
        pieces = ((struct.pack(">Q", int(c)), table, i, r, f) for c, i, r, f in
                  zip(keys, rows, rr, whole, strict=True))
    else:
        inner = rr % np.asarray(sp.shard_chunks)
        pieces = ((struct.pack(">III", *(int(v) for v in c)), table, i, r, f) for c, i, r, f in
                  zip(inner, rows, rr, whole, strict=True))
    _transaction_write(w, sp, fname, pieces, res)


def _chunk_bytes(w: _Worker, sp: ScalePlan, table, i: int, rel, full: bool, res: ShardResult) -> bytes | None:
    """One output chunk's stored bytes (None: background, not stored)."""
    job = w.job
    enc: bytes | None
    if job.fmt == "precomputed" and job.encoder == "transcode" and full:
        enc = _transcode_record(w, table, i, sp)
        res.transcoded += 1
        if len(enc) == 4 + 8 * (sp.chunk // 8) ** 3 + 8 and enc[-8:] == _ZERO8:  # an all-0 chunk
            enc = None
    else:
        enc = _encode_record(w, sp, table, i, rel)
        res.encoded += 1
    if enc is None:
        res.background += 1
        return None
    if job.fmt == "precomputed" and sp.precomputed_sharding().get("data_encoding") == "gzip":
        enc = _gzip(enc, job.gzip_level)
    res.encoded_bytes += len(enc)
    res.written += 1
    return enc


def _stream_precomputed(w: _Worker, sp: ScalePlan, table, rows, rr, whole, keys, fname: str,
                        res: ShardResult) -> None:
    """A local output shard built on disk as its chunks are encoded, minishard by minishard
    (formats.sharding.ShardFileWriter), then renamed over the old one: memory is one chunk and
    one minishard index, whatever the size of the shard."""
    spec = ShardingSpec.from_json(sp.precomputed_sharding())
    mini = (keys >> np.uint64(spec.preshift_bits)) & np.uint64((1 << spec.minishard_bits) - 1) \
        if spec.preshift_bits < 64 else np.zeros_like(keys)
    order = np.lexsort((keys, mini))  # the file's order (identity hash: the planner's proof)
    path = os.path.join(w.job.local_root or "", fname)
    tmp = f"{path}.{w.job.token}.{threading.get_ident()}.tmp"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    gz = w.gzip_index()
    try:
        with open(tmp, "wb") as f:
            out = ShardFileWriter(spec, f, gz)
            for j in order.tolist():
                enc = _chunk_bytes(w, sp, table, int(rows[j]), rr[j], bool(whole[j]), res)
                if enc is not None:
                    out.add(int(keys[j]), enc)
            n = out.finish()
            f.flush()
            os.fsync(f.fileno())
        if n:
            os.replace(tmp, path)  # whole or not at all: resume never sees half a shard
            res.shards_written += 1
        else:
            os.unlink(tmp)
            if os.path.exists(path):
                os.unlink(path)  # an earlier run's shard: this one holds only background
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _transaction_write(w: _Worker, sp: ScalePlan, fname: str, pieces, res: ShardResult) -> None:
    """A remote output shard (or a zarr3 one): its encoded chunks in one kvstore transaction of
    TensorStore's sharded driver, which assembles the file at commit (memory: the shard's
    encoded bytes). ``pieces`` are ``(key, table, row, relative chunk, whole)``."""
    import tensorstore as ts

    w.root.write(fname, None).result()  # delete: rewritten whole, never merged with what was there
    kv = w.shard_store(sp, fname)
    txn = ts.Transaction()
    kvt = kv.with_transaction(txn)
    written = 0
    for key, table, i, rel, full in pieces:
        enc = _chunk_bytes(w, sp, table, int(i), rel, bool(full), res)
        if enc is not None:
            kvt.write(key, enc)
            written += 1
    if written:
        txn.commit_async().result()
        res.shards_written += 1
    else:
        txn.abort()


def _gzip(data: bytes, level: int) -> bytes:
    # TensorStore's sharded writer gzips at level 9 (4.5 ms per real chunk, 3.48 KB); level 1
    # costs 0.31 ms for 4.41 KB. Any reader of data_encoding gzip reads either.
    c = zlib.compressobj(level, zlib.DEFLATED, 31)
    return c.compress(data) + c.flush()


def _transcode_record(w: _Worker, table, i: int, sp: ScalePlan) -> bytes:
    block = table.block(i)  # BlockDecodeError names the file and chunk
    head = struct.pack("<3I", *(sp.chunk // 8,) * 3)
    nsv = int(table.rec[i, R_NSV])
    try:
        if block[:12] != head:
            raise BlockDecodeError(f"block grid {struct.unpack('<3I', block[:12]) if len(block) >= 12 else ()} "
                                   f"sub-blocks is not the chunk size {8 * head[0]}³")
        if int.from_bytes(block[12:16], "little") != nsv:
            raise ShardFormatError(f"its label lists have {nsv} entries, its block has "
                                   f"{int.from_bytes(block[12:16], 'little')} labels")
        pal = w.labels.palette(table, i)
        if pal is not None and (pal.dtype != _U64 or not pal.flags.c_contiguous):
            pal = np.ascontiguousarray(pal, _U64)
        return transcode_u8(np.frombuffer(block, np.uint8), pal)
    except (BlockDecodeError, ShardFormatError) as e:
        raise type(e)(f"{table.where(i)}: {e}") from None


def _encode_record(w: _Worker, sp: ScalePlan, table, i: int, rel) -> bytes | None:
    scratch = w.scratch
    if scratch is None or scratch.shape[0] != sp.chunk:
        scratch = w.scratch = np.empty((sp.chunk,) * 3, np.uint64)
    lo = np.asarray(rel, np.int64) * sp.chunk
    ext = np.minimum(sp.chunk, np.asarray(sp.size) - lo)  # x, y, z voxels inside the volume
    view = scratch[:ext[2], :ext[1], :ext[0]]
    table.decode_into(i, view, w.labels)
    return w.stager(sp).encode(rel, view)  # None when all 0: TensorStore stores no such chunk


# --------------------------------------------------------------------------- the job


@dataclass
class ConvertTotals(ShardResult):
    """A conversion's figures: the tasks' :class:`ShardResult` summed, the read-back check, and
    the scales made first (``made``: the downsample stage's totals, see :func:`convert`)."""

    verified: int = 0
    verified_background: int = 0  # of ``verified``: chunks the source holds none of, read back as 0
    mismatches: list = field(default_factory=list)
    made: dict | None = None


#: the folder of the work folder where convert makes the scales an export lacks
STAGED = "scales"


def _task_name(plans: dict, item) -> str:
    """A task as failures name it: its source shard (``s1/0_0_2048``), or on a grouped scale its
    output shard file (``s7/0.shard``, ``s7/c/0/0/1``)."""
    if len(item) == 3:
        k, b, _ = item
        sp = plans[k]
        lo = np.asarray(b, np.int64) * np.asarray(sp.shard_chunks, np.int64)
        return f"s{k}/{sp.shard_file(lo, int(sp.shard_ids(lo[None])[0])).split('/', 1)[1]}"
    k, o = item
    return f"s{k}/{o[0]}_{o[1]}_{o[2]}"


def _notes(fmt: str, t: ShardResult, verified: int, mismatches: list) -> list[str]:
    lines = [f"{fmt}: {t.shards_written:,} output shards written, {t.shards_skipped:,} complete ones kept; "
             f"{t.written:,} chunks written ({t.transcoded:,} transcoded, {t.encoded:,} encoded by TensorStore), "
             f"{t.background:,} background skipped, {t.outside:,} outside the volume; "
             f"{t.encoded_bytes / 2**20:.1f} MiB encoded; peak worker RSS {t.max_rss_mib:.0f} MiB"]
    if verified or mismatches:
        bg = getattr(t, "verified_background", 0)
        lines.append(f"verify: {verified:,} chunks read back ({verified - bg:,} with data, {bg:,} background), "
                     f"{len(mismatches):,} differ")
    return lines


def _held(ks) -> str:
    return ", ".join(f"s{k}" for k in sorted(ks))


def _choose_scales(ds: Dataset, wanted: list[int] | None) -> tuple[list[int], list[int]]:
    """``(scales to convert, scales to make first)``.

    Default: every scale the export holds, and every scale its spec lists above the finest one
    held that it does not hold (made). Explicit scales: those, the absent ones made when a finer
    scale is held, else ``NotExportedError`` (``ds.require_scale``).
    """
    held = set(ds.exported)
    listed = [s.index for s in ds.scales]
    can_make = ds.spec is not None and not any(s.inferred for s in ds.scales)
    if wanted is None:
        make = [k for k in listed if k not in held and any(h < k for h in held)] if can_make else []
        return sorted(held | set(make)), make
    for k in wanted:
        ds.scale(k)  # a scale the spec does not list: SpecError naming those it does
    make = [k for k in wanted if k not in held]
    for k in make:
        if not can_make or not any(h < k for h in held):
            ds.require_scale(k)  # NotExportedError: nothing finer to make it from
    return list(wanted), make


def _check_makeable(ds: Dataset, make: list[int]) -> list[int]:
    """The scales the downsample stage makes (those asked, and the ones between), refused before
    any work where the downsample job would refuse them (its checks, in short)."""
    held = set(ds.exported)
    start = max(h for h in held if h < min(make))
    made = list(range(start + 1, max(make) + 1))
    base = ds.scale(start)
    for k in [start, *made]:
        s = ds.scale(k)
        if s.chunk_size != base.chunk_size or len(set(s.chunk_size)) != 1 or s.chunk_size[0] % 16 or \
                any(s.voxel_offset):
            raise ConvertPlanError(f"scale {k}: chunks {list(s.chunk_size)}, voxel_offset {list(s.voxel_offset)}: "
                                   f"the scales {_held(make)} this export lacks cannot be made from s{start} (the "
                                   f"same cubic chunks at the origin are needed); convert the scales it holds "
                                   f"(--scales {' '.join(map(str, sorted(held)))})")
    return made


def default_workdir(destination: Destination) -> Destination:
    """The work folder of a conversion that makes scales: ``DEST.work`` beside the output
    (a sibling folder, or a sibling prefix in the same bucket), never inside it.

    Raises
    ------
    OutputError
        When there is no "beside": the destination is a bucket's root or a file system's, or
        memory:// (not shared with the stores that read the made scales); give ``workdir``.
    """
    folder, name = destination.parent_and_name()
    if not name or (destination.spec is not None and destination.spec.get("driver") == "memory"):
        raise OutputError(f"{destination.describe()}: the scales the export lacks are made in a work folder "
                          f"beside the output, and there is none here; give --workdir (a folder, gs:// or s3://)")
    return folder.child(name + ".work")


def _workdir_of(destination: Destination, workdir) -> Destination:
    wd = default_workdir(destination) if workdir is None else Destination.of(workdir, what="work folder")
    if wd.spec is not None and wd.spec.get("driver") == "memory":
        raise OutputError(f"work folder {wd.describe()}: memory:// is not shared with the stores that read the "
                          f"made scales; give a folder, gs:// or s3://")
    return wd


def _fold(out: Output, rep: JobReport) -> None:
    """Count the downsample stage's report into the conversion's (its tasks, failures, CPU)."""
    r = out.report
    r.tasks += rep.tasks
    r.done += rep.done
    r.skipped += rep.skipped
    r.task_cpu += rep.task_cpu
    for item, msg in rep.failed.items():
        r.failed[f"downsample {item}"] = msg


def _remove_work(wd: Destination, staged: Destination) -> None:
    """The staged scales, and the work folder when nothing else is left in it."""
    staged.rmtree("")
    if wd.local and os.path.isdir(wd.local_path()):
        try:
            os.rmdir(wd.local_path())
        except OSError:
            pass  # the user's own folder, holding other files: left as it is


def convert(source, dest, format: str = "precomputed", *, spec=None, scales=None,
            labels="agglomerated", method: str = "dvid", scheduler=None, workdir=None, resume: bool = False,
            overwrite: bool = False, progress: bool | None = None, allow_partial: bool = False, verify: int = 0,
            encoder: str = "transcode", shard_bits_extra: int = 0, sharding: dict | None = None,
            data_encoding: str = "gzip", gzip_level: int = 1, seed: int = 0, command: str | None = None,
            _stop_after: int | None = None, _only=None, _stream: bool = True,
            _stop_downsample_after: int | None = None) -> JobReport:
    """Convert an export to neuroglancer precomputed or zarr v3: every scale of its spec.

    The output stands on :mod:`dvidshards.jobs.output`: refused before any work unless empty (or
    this conversion's own earlier output with ``resume``/``overwrite``), locked while written, and
    holding a manifest ``_dvidshards.json`` that says ``"complete": false`` until every task has
    succeeded (``dvidshards verify DEST`` reads it; it records the spec and the scales made).

    **An export lacking scales** (DVID exports scale 0 only by default; FORMATS.md §3a): the
    scales its spec lists above the finest one it holds are made first, the way DVID makes its
    pyramid (:func:`dvidshards.jobs.downsample.downsample`, ``method``), into ``WORKDIR/scales``,
    and the export and those scales are converted as one pyramid (``Dataset.with_scales``): one
    command gives neuroglancer every scale, as tensorstore-export's two stages do. Scales below
    the finest one held cannot be made and are left out (said in the report). Explicit
    ``scales`` naming a scale the export lacks: it is made too (with the scales between, each
    made from the one below), and only the scales asked are converted; a scale with nothing finer
    held is a ``NotExportedError``. ``resume`` finishes either stage; the work folder is removed
    when the output is complete.

    Parameters
    ----------
    source : str, path, URL, kvstore spec or dvidshards.Dataset
        The export.
    dest : str, path, URL or kvstore spec dict
        Output root: a folder, ``gs://…``, ``s3://…`` or a TensorStore kvstore spec.
    format : {"precomputed", "zarr3"}
    spec : dict or path, optional
        The neuroglancer spec DVID was given (default: the export's ``info``).
    scales : list of int, optional
        Scales to convert (default: every scale the export holds, and those it lacks above its
        finest, made first).
    labels : "agglomerated", "supervoxels" or a mapping (file path, dict, ...)
        Ids written. A mapping given as an object is pickled to every worker; a path is read
        by each worker. Made scales: each block's supervoxels by ``method``, then the same ids
        (bodies: the source records' own supervoxel -> body pairs, or the mapping).
    method : {"dvid", "mode"}
        How scales an export lacks are made: DVID's pyramid rule (the most frequent non-zero
        supervoxel of each 2x2x2 cell, ties to the smaller id) or TensorStore's ``"mode"``.
    scheduler : None, str or distributed.Client
        Where tasks run (:mod:`dvidshards.jobs.runner`).
    workdir : path or URL, optional
        Where scales an export lacks are made, visible to every worker: default ``DEST.work``
        beside the output (for ``gs://b/out``: ``gs://b/out.work``; a bucket's root needs an
        explicit one). Never inside the output or the export. Unused when nothing is made.
    resume : bool
        Finish an interrupted run: the same arguments; made scales already staged and output
        shards that exist with the expected chunk count are kept. (After a complete run the
        staged scales are gone; resuming it keeps the made scales' output as it is.)
    overwrite : bool
        Replace an earlier output: the metadata and the scale folders this run writes are
        deleted first (other files in the destination are left alone), and scales staged by an
        earlier run are made again.
    progress : bool, optional
        Progress bar (default: on a terminal; log lines otherwise).
    allow_partial : bool
        Return the report of an incomplete output instead of raising JobError.
    verify : int
        Read this many random chunks per scale back through TensorStore's own driver and
        compare them with the source (made scales: with the staged ones).
    encoder : {"transcode", "tensorstore"}
        ``tensorstore`` encodes every precomputed chunk with TensorStore (decoded voxels).
    shard_bits_extra : int
        Split each source shard into ``2**n`` output shards (changes the output geometry).
    sharding : dict, optional
        An explicit output sharding spec for every scale (identity hash, no wrapping shard
        numbers; shards larger than the source's are written one task per output shard).
    data_encoding : {"gzip", "raw"}
        Precomputed chunk data encoding with the export's sharding (default gzip).
    gzip_level : int
        zlib level of gzip chunk data (1-9).
    seed : int
        Seed of the verification sample.
    command : str, optional
        The command line, recorded in the manifest.

    Returns
    -------
    JobReport
        ``totals`` is a :class:`ConvertTotals`: the tasks' figures summed, the read-back check,
        and the downsample stage's totals (``made``). ``tasks`` counts both stages.

    Raises
    ------
    ConvertPlanError, SpecError, NotExportedError, OutputError
        Before anything is written, when the layout, the arguments, a scale asked for or the
        destination (or work folder) are refused.
    JobError
        The output is incomplete (a task failed, a chunk read back differed) and ``allow_partial``
        is false; ``.report`` is the report.
    """
    from .downsample import METHODS, downsample

    if format not in FORMATS:
        raise SpecError(f"format must be one of {FORMATS}, got {format!r}")
    if encoder not in ENCODERS:
        raise SpecError(f"encoder must be one of {ENCODERS}, got {encoder!r}")
    if method not in METHODS:
        raise SpecError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if data_encoding not in ("gzip", "raw"):
        raise SpecError(f"data_encoding must be 'gzip' or 'raw', got {data_encoding!r}")
    if not isinstance(gzip_level, int) or not 1 <= gzip_level <= 9:
        raise SpecError(f"gzip_level must be an integer 1..9, got {gzip_level!r}")
    if resume and overwrite:
        raise SpecError("give resume or overwrite, not both")
    scheduler_of(scheduler)  # a malformed scheduler is refused before anything is written
    destination = Destination.of(dest)
    ds = source if isinstance(source, Dataset) else Dataset(source, spec=spec)
    as_labels(labels)  # refuse a bad label argument before starting
    wanted = scales_of(scales)
    chosen, make = _choose_scales(ds, wanted)
    made = _check_makeable(ds, make) if make else []
    held = set(ds.exported)
    plans = {k: plan_scale(ds.scale(k) if k in held else ds.scale(k).with_naming("current"), format,
                           shard_bits_extra=shard_bits_extra, sharding=sharding, data_encoding=data_encoding)
             for k in chosen}
    by_scale = {k: [tuple(int(v) for v in o) for o in ds.shards(k)] for k in plans if k in held}
    if wanted is None:  # default: the scales held that have shards, and the ones made
        plans = {k: p for k, p in plans.items() if k not in held or by_scale[k]}
    if not plans:
        raise SpecError(f"{ds!r}: no shards to convert")
    wd = staged = None
    if make:
        wd = _workdir_of(destination, workdir)
        check_apart(wd, source=ds, what="work folder")
        staged = wd.child(STAGED)
        if not resume and not overwrite and staged.list():
            raise OutputError(f"work folder {wd.describe()} holds scales made by an earlier conversion; pass "
                              f"--resume to finish it, or --overwrite to start again")
    params = {"format": format, "scales": sorted(plans),
              "labels": labels if isinstance(labels, str) else f"<{type(labels).__name__}>",
              "encoder": encoder, "shard_bits_extra": shard_bits_extra, "sharding": sharding,
              "data_encoding": data_encoding, "gzip_level": gzip_level}
    if make:
        params["method"] = method
    keys = {plans[k].key for k in plans}
    meta = "info" if format == "precomputed" else "zarr.json"
    import tensorstore as ts

    made_wd = wd is not None and wd.local and not os.path.exists(wd.local_path())
    try:
        with Output(destination, job="convert", parameters=params, source=ds, scales=sorted(plans),
                    command=command, resume=resume, overwrite=overwrite, workdir=wd,
                    own=lambda name: name == meta or name in keys) as out, contextlib.ExitStack() as stack:
            out.update(format=format, keys={str(k): plans[k].key for k in sorted(plans)}, spec=ds.spec,
                       made=[k for k in sorted(plans) if k in make])
            kv = destination.kvstore
            context = ts.Context()
            _create_output(kv, format, sorted(plans.values(), key=lambda p: p.index), context)  # refuses a mismatch
            totals = ConvertTotals()
            notes: list[str] = []
            read, todo, stage_ok = ds, sorted(plans), True
            tr = stack.enter_context(TaskRunner(scheduler, progress=progress))  # one cluster for both stages
            if make and wd is not None and wd.local:
                tr.check_shared(wd.local_path())  # workers elsewhere must see the made scales
            if make:
                assert wd is not None and staged is not None
                previous = out.previous or {}
                ours = [k for k in todo if k in make]
                if resume and previous.get("complete") is True and not staged.list():
                    todo = [k for k in todo if k not in make]  # the complete earlier run converted them
                    notes.append(f"{_held(ours)} kept as the earlier complete run wrote them (the scales it made "
                                 f"are gone; --overwrite makes and converts them again)")
                else:
                    rep = downsample(ds, staged, scales=make, method=method,
                                     labels=None if isinstance(labels, str) and labels == "agglomerated" else labels,
                                     scheduler=tr.client() if tr.distributed else scheduler, resume=resume,
                                     overwrite=overwrite, progress=progress,
                                     allow_partial=True, command=command, _stop_after=_stop_downsample_after)
                    _fold(out, rep)
                    totals.made = rep.totals.to_json() if rep.totals is not None else None
                    notes += [f"made first ({staged.describe()}): {n}" for n in rep.notes]
                    if rep.complete:
                        read = ds.with_scales(staged.local_path() if staged.local else staged.kvstore,
                                              [k for k in made if k not in held])
                    else:
                        stage_ok = False
                        todo = [k for k in todo if k not in make]
                        notes.append(f"{_held(ours)} not converted: making them did not finish (--resume finishes "
                                     f"both stages)")
                skipped = [k for k in (s.index for s in ds.scales) if k not in held and k not in plans]
                if skipped and wanted is None:
                    notes.append(f"{_held(skipped)} not exported and not made: no finer scale is held to make "
                                 f"them from")
            items: list[tuple] = []
            for k in todo:
                origins: list
                if k in held:
                    origins = by_scale[k]
                else:
                    assert staged is not None
                    origins = read.shards(k) if staged.list(f"s{k}") else []  # all background: no folder
                items += plan_tasks(plans[k], origins)
            if len(set(items)) != len(items):
                raise ConvertPlanError("two tasks for one shard")
            # benchmarks: _only, the tasks that do their work (the others return at once); _stream=False,
            # the route of remote destinations (one transaction per output shard) on a local one
            job = _Job(uuid.uuid4().hex, read, format, kv, labels, encoder, resume, plans, gzip_level,
                       None if _only is None else frozenset(_only), _stream)
            run_items = items if _stop_after is None else items[:_stop_after]  # tests: as if killed
            phase = tr.run(partial(_convert_shard, job), run_items, desc=f"{format} shards", kernels=KERNELS)
            stack.close()
            out.add(phase, name=partial(_task_name, plans))
            out.report.tasks += len(items) - len(run_items)
            for r in phase.results.values():
                totals.add(r)
            if verify:
                for k in todo:
                    sc = verify_output(read, kv, format, plans[k], labels, verify, seed=seed)
                    n, bad = sc
                    totals.verified += n
                    totals.verified_background += getattr(sc, "background", 0)
                    totals.mismatches += bad
                for m in totals.mismatches:
                    out.fail(f"verify {m.split(':', 1)[0]}", m.split(": ", 1)[-1])
            report = out.finish(totals=totals, notes=_notes(format, totals, totals.verified, totals.mismatches)
                                + notes, complete=len(run_items) == len(items) and _only is None and stage_ok,
                                allow_partial=allow_partial)
    finally:
        if made_wd and wd is not None and os.path.isdir(wd.local_path()) and not os.listdir(wd.local_path()):
            os.rmdir(wd.local_path())  # refused or failed before making anything: no empty folder left
    if report.complete and wd is not None and staged is not None:
        _remove_work(wd, staged)
    return report


def read_manifest(dest) -> dict | None:
    """The manifest of a conversion output (None when there is none): :func:`dvidshards.jobs.output.read_manifest`."""
    return _read_manifest(dest)


def open_output(kv, fmt: str, sp: ScalePlan):
    """The converted scale opened with TensorStore's own driver (x, y, z)."""
    return open_scale(kvstore_root(kv), fmt, sp.key)


def verify_output(ds, dest, fmt: str, sp: ScalePlan, labels, n: int, *, seed: int = 0) -> tuple[int, list]:
    """Read ``n`` random source chunks of a scale back from the output and compare.

    Returns (chunks compared, list of mismatch descriptions).
    """
    if n <= 0 or not ds.shards(sp.index):
        return 0, []
    return compare_chunks(ds, open_output(dest, fmt, sp), fmt, sp.index, labels, n, np.random.default_rng(seed))


# --------------------------------------------------------------------------- command line


def add_arguments(p) -> None:
    """Arguments of ``dvidshards convert``."""
    add_source(p)
    add_dest(p, what="output root: empty, or this conversion's own earlier output", old=())
    p.add_argument("--format", required=True, choices=FORMATS,
                   help="output format: neuroglancer precomputed (sharded, compressed_segmentation) or zarr v3")
    add_scales(p, help="scales to convert (default: every scale of the spec: those the export holds, and those it "
                       "lacks above its finest, made first by --method; a scale asked for that the export lacks is "
                       "made too)")
    add_labels(p)
    p.add_argument("--method", choices=("dvid", "mode"), default="dvid",
                   help="how scales the export lacks are made: dvid, DVID's own pyramid rule (the most frequent "
                        "non-zero supervoxel; default), or mode, TensorStore's")
    add_job_options(p)
    p.add_argument("--verify", type=int, default=0, metavar="N",
                   help="read N random chunks per scale back with TensorStore and compare")
    p.add_argument("--encoder", choices=ENCODERS, default="transcode",
                   help="precomputed chunks: transcode DVID blocks (default) or TensorStore's encoder")
    p.add_argument("--shard-bits-extra", type=int, default=0, metavar="n",
                   help="split each source shard into 2^n output shards (changes the output geometry)")
    p.add_argument("--data-encoding", choices=("gzip", "raw"), default="gzip",
                   help="precomputed chunk data encoding in shards (default gzip)")
    p.add_argument("--gzip-level", type=int, default=1, choices=range(1, 10), metavar="1-9",
                   help="zlib level of gzip chunk data (default 1)")


_DEFAULTS = {"labels": "agglomerated", "method": "dvid", "verify": 0, "encoder": "transcode", "shard_bits_extra": 0,
             "data_encoding": "gzip", "gzip_level": 1}


def main(args) -> int:
    """Run ``dvidshards convert``; 0 when the output is complete, 1 when it is not (the manifest
    says so), 2 when refused before any work."""
    report = convert(args.source, dest_of(args), args.format, spec=args.spec, scales=args.scales,
                     labels=args.labels, method=args.method, verify=args.verify, encoder=args.encoder,
                     shard_bits_extra=args.shard_bits_extra, data_encoding=args.data_encoding,
                     gzip_level=args.gzip_level, allow_partial=True,
                     command=command_line("convert", args, skip=[k for k, v in _DEFAULTS.items()
                                                                  if getattr(args, k) == v]),
                     **job_options(args))
    print(report.summary())
    return 0 if report.ok else 1


class ConvertCommand:
    """``dvidshards convert``: one row of ``cli.COMMANDS``."""

    add_arguments = staticmethod(add_arguments)
    main = staticmethod(main)
