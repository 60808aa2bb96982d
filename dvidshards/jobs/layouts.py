"""The two layouts ``convert`` writes, neuroglancer precomputed and zarr v3, a scale at a time:
the output geometry and the proof that an output shard lies in one source file (:func:`scale_layout`),
the metadata (written by TensorStore's drivers), the chunk encoders (a DVID block transcoded to
``compressed_segmentation`` without decoding voxels, byte-identical to TensorStore's; TensorStore's
own for the rest), the shard writers (a precomputed shard streamed by
:class:`~dvidshards.formats.sharding.PrecomputedShardWriter` with TensorStore's gzip of the minishard
indexes, a zarr3 shard in one TensorStore transaction) and the chunks a written shard holds.
"""

from __future__ import annotations

import gzip
import json
import math
import struct
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, SupportsFloat, SupportsInt

import numpy as np

from ..errors import (
    BlockDecodeError,
    DvidShardsError,
    MissingShardError,
    OutputError,
    ShardFormatError,
    SpecError,
)
from ..formats.cseg import transcode_u8
from ..formats.multiscale import SINGLE_SHARD, Scale
from ..formats.records import R_NSV
from ..formats.sharding import (
    PrecomputedShardWriter,
    ShardingSpec,
    compressed_z_index_bits,
    grid_shape,
    shard_and_minishard,
    shard_extent_chunks,
    shard_key,
)
from ..stores import ByteStore

__all__ = ["FORMATS", "ZARR_INDEX_CODECS", "ZARR_INNER_CODECS", "ConvertPlanError", "ScaleLayout", "Stager",
           "TsGzip", "create_output", "existing_chunks", "int3", "scale_boxes",
           "scale_layout", "transcode_chunk", "window", "write_precomputed_shard", "write_zarr3_shard"]

FORMATS = ("precomputed", "zarr3")
# zarr3 inner chunks: raw little-endian uint64 then zstd (segmentation compresses ~10x)
ZARR_INNER_CODECS = [{"name": "bytes", "configuration": {"endian": "little"}},
                     {"name": "zstd", "configuration": {"level": 3, "checksum": False}}]
ZARR_INDEX_CODECS = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
_NO_CHUNK = np.uint64(2**64 - 1)
_ZERO8 = bytes(8)
_U64 = np.dtype(np.uint64)


class ConvertPlanError(SpecError):
    """A layout refused: tasks could share an output shard, or chunks would not map one to one."""


# --------------------------------------------------------------------------- geometry


@dataclass(frozen=True)
class ScaleLayout:
    """One scale of the output, and how source shards map onto it (vectors x, y, z).

    ``grid``: output chunks (from ``voxel_offset``); ``shard_chunks``: an output shard's box;
    ``cell``: a source shard file's box side in chunks (source chunks are absolute, output ones
    relative to the offset). ``grouped``: no proof that every output shard lies in one source file
    (DVID's old names at coarse scales, a coarser output sharding): tasks are output shards.
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
    sharding: dict | None = None  # the output neuroglancer sharding (precomputed)
    grouped: bool = False

    @property
    def chunk_offset(self) -> np.ndarray:
        return np.asarray(self.voxel_offset, np.int64) // self.chunk

    def precomputed_sharding(self) -> dict:
        if self.sharding is None:
            raise ConvertPlanError(f"scale {self.index}: the layout has no output sharding "
                                   f"(planned for zarr3, used as precomputed)")
        return self.sharding

    def shard_ids(self, rel: np.ndarray) -> np.ndarray:
        """Each relative chunk's output shard: its number, or a flat box index."""
        if self.sharding is not None:
            shard, _ = shard_and_minishard(ShardingSpec.from_json(self.sharding), rel, self.grid)
            return np.asarray(shard, np.uint64).astype(np.int64)
        box = rel // np.asarray(self.shard_chunks, np.int64)
        nb = [-(-g // s) for g, s in zip(self.grid, self.shard_chunks, strict=True)]
        return (box[:, 2] * nb[1] + box[:, 1]) * nb[0] + box[:, 0]

    def shard_file(self, rel_first: np.ndarray) -> str:
        """Key of the output shard holding relative chunk ``rel_first``."""
        if self.sharding is not None:
            shard = int(self.shard_ids(np.asarray(rel_first, np.int64).reshape(1, 3))[0])
            return f"{self.key}/{shard_key(shard, int(self.sharding['shard_bits']))}"
        i, j, k = (int(v) for v in np.asarray(rel_first) // np.asarray(self.shard_chunks))
        return f"{self.key}/c/{i}/{j}/{k}"


def int3(v: Iterable[SupportsInt]) -> tuple[int, int, int]:
    x, y, z = v
    return int(x), int(y), int(z)


def _float3(v: Sequence[SupportsFloat]) -> tuple[float, float, float]:
    x, y, z = v
    return float(x), float(y), float(z)


def _split_sharding(src: ShardingSpec, extra: int, where: str) -> ShardingSpec:
    """``src`` with ``extra`` more shard bits, from minishard then preshift bits: every output shard
    box is a sub-box of a source one."""
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


def scale_layout(scale: Scale, *, format: str = "precomputed", shard_bits_extra: int = 0,
                 sharding: dict | None = None, data_encoding: str = "gzip") -> ScaleLayout:
    """The output layout of a source scale (``sharding``: instead of the export's, which gets
    ``data_encoding``). ConvertPlanError when output shards are not boxes of chunks (a hashed
    sharding, shard numbers that wrap, too many bits) or the geometry is not chunk-aligned."""
    where = f"scale {scale.index}"
    if format not in FORMATS:
        raise SpecError(f"format must be one of {FORMATS}, got {format!r}")
    cs = tuple(int(c) for c in scale.chunk_size)
    if len(set(cs)) != 1:
        raise ConvertPlanError(f"{where}: chunks {cs} are not cubic")
    chunk = cs[0]
    off = int3(scale.voxel_offset)
    if any(v % chunk for v in off):
        raise ConvertPlanError(f"{where}: voxel_offset {off} is not a multiple of the chunk size {chunk}: "
                               f"DVID chunks would straddle output chunks")
    if scale.resolution is None:
        raise ConvertPlanError(f"{where}: resolution unknown (geometry inferred); give the export's spec")
    if sharding is not None:
        out = sharding if isinstance(sharding, ShardingSpec) else ShardingSpec.from_json(sharding)
        if shard_bits_extra:
            out = _split_sharding(out, shard_bits_extra, where)
    elif scale.sharding is None:
        raise ConvertPlanError(f"{where}: the export's spec has no sharding; give the spec DVID was given "
                               f"(--spec) or an output sharding")
    else:  # the export's bits; chunk data encoded as asked (DVID's specs say raw)
        out = _split_sharding(scale.sharding, shard_bits_extra, where)
        out = ShardingSpec.from_json({**out.to_json(), "data_encoding": data_encoding})
    if out.hash != "identity":
        raise ConvertPlanError(f"{where}: output sharding hash {out.hash!r} does not make shards boxes of "
                               f"chunks, so no task can own whole output shards; use 'identity'")
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
    # the proof: along each axis every output box interval lies in one source cell
    grouped = any((coff[a] + k * box[a]) // cell != (coff[a] + min((k + 1) * box[a], grid[a]) - 1) // cell
                  for a in range(3) for k in range(-(-grid[a] // box[a])))
    return ScaleLayout(
        index=scale.index, key=f"s{scale.index}" if format == "zarr3" else (scale.key or f"s{scale.index}"),
        size=int3(scale.size), voxel_offset=off, resolution=_float3(scale.resolution), chunk=chunk, grid=grid,
        shard_chunks=int3(box), cell=cell, sharding=out.to_json() if format == "precomputed" else None,
        grouped=grouped)


Box = tuple[tuple[int, int, int], tuple[int, int, int]]


def window(sp: ScaleLayout, clip: Box | None) -> tuple[np.ndarray, np.ndarray]:
    """The absolute voxel box converted: the clip box, or the volume."""
    if clip is not None:
        return np.asarray(clip[0], np.int64), np.asarray(clip[1], np.int64)
    off = np.asarray(sp.voxel_offset, np.int64)
    return off, off + np.asarray(sp.size, np.int64)


def scale_boxes(source: Any, box: Box, scales: Iterable[int]) -> dict[int, Box]:
    """``box`` (scale-0 voxels, inside its volume) as each scale's voxels covering it."""
    base = source.scale(0)
    lo, hi = base.check_box(box)
    out: dict[int, Box] = {}
    for k in scales:
        s = source.scale(k)
        f = np.asarray(s.resolution, float) / np.asarray(base.resolution, float)
        off = np.asarray(s.voxel_offset, np.int64)
        klo = np.maximum(np.floor(lo / f + 1e-9).astype(np.int64), off)
        khi = np.minimum(np.ceil(hi / f - 1e-9).astype(np.int64), off + np.asarray(s.size, np.int64))
        out[k] = (int3(klo), int3(khi))
    return out


# --------------------------------------------------------------------------- metadata


def _sub(root: dict, path: str) -> dict:
    return {**root, "path": root.get("path", "") + path}


def precomputed_spec(kv: dict, sp: ScaleLayout, *, sharded: bool = True) -> dict:
    meta: dict[str, object] = {
        "key": sp.key, "size": list(sp.size), "voxel_offset": list(sp.voxel_offset),
        "resolution": list(sp.resolution), "chunk_size": [sp.chunk] * 3,
        "encoding": "compressed_segmentation", "compressed_segmentation_block_size": [8, 8, 8]}
    if sharded and sp.sharding is not None:
        meta["sharding"] = sp.sharding
    return {"driver": "neuroglancer_precomputed", "kvstore": kv,
            "multiscale_metadata": {"type": "segmentation", "data_type": "uint64", "num_channels": 1},
            "scale_metadata": meta}


def zarr3_metadata(sp: ScaleLayout, *, sharded: bool = True) -> dict:
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


def _ome_group(layouts: list[ScaleLayout], existing: dict | None) -> dict:
    datasets = {}
    if existing:
        for ms in existing.get("attributes", {}).get("ome", {}).get("multiscales", [])[:1]:
            for d in ms.get("datasets", []):
                datasets[d["path"]] = d
    for sp in layouts:
        datasets[sp.key] = {"path": sp.key, "coordinateTransformations": [
            {"type": "scale", "scale": list(sp.resolution)},
            {"type": "translation", "translation": [o * r for o, r in zip(sp.voxel_offset, sp.resolution, strict=True)]}]}
    ordered = [datasets[k] for k in sorted(datasets, key=lambda p: (len(p), p))]
    return {"zarr_format": 3, "node_type": "group", "attributes": {"ome": {"version": "0.5", "multiscales": [{
        "name": "segmentation", "axes": [{"name": a, "type": "space", "unit": "nanometer"} for a in "xyz"],
        "datasets": ordered}]}}}


def create_output(store: ByteStore, format: str, layouts: list[ScaleLayout], context: Any) -> None:
    """``info`` / ``zarr.json`` before any data; ConvertPlanError when those there say otherwise."""
    import tensorstore as ts

    kv = store.kvstore_spec()
    assert kv is not None  # convert refuses a store TensorStore cannot reach
    try:
        if format == "precomputed":
            for sp in layouts:
                ts.open(precomputed_spec(kv, sp), create=True, open=True, context=context).result()
            return
        data = store.get_sync("zarr.json")
        existing = json.loads(data) if data is not None else None
        if existing is not None and existing.get("node_type") != "group":
            raise ConvertPlanError(f"{store.describe('zarr.json')} exists and is not a zarr v3 group")
        store.put_sync("zarr.json", json.dumps(_ome_group(layouts, existing), indent=1).encode())
        for sp in layouts:
            ts.open({"driver": "zarr3", "kvstore": _sub(kv, sp.key + "/"), "metadata": zarr3_metadata(sp)},
                    create=True, open=True, context=context).result()
    except ValueError as e:
        if isinstance(e, DvidShardsError):
            raise
        text = " ".join(str(e).split()).split(" [tensorstore_spec=", 1)[0]
        status = text.split(":", 1)[0]
        if status in ("PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED"):
            why = {"PERMISSION_DENIED": "permission denied", "RESOURCE_EXHAUSTED": "no space left (or a quota)"}.get(
                status, text[:160])
            raise OutputError(f"{store.describe('')}: cannot write the output's metadata: {why}") from None
        raise ConvertPlanError(f"{store.describe('')}: existing output does not match this conversion "
                               f"({text[:200]}); choose another destination or pass --overwrite") from None


# --------------------------------------------------------------------------- chunk encoders


def transcode_chunk(table: Any, i: int, chunk: int, labels: Any) -> bytes:
    """Record ``i``'s DVID block as a ``compressed_segmentation`` chunk, no voxel decoded."""
    block = table.block(i)  # BlockDecodeError names the file and chunk
    head = struct.pack("<3I", *(chunk // 8,) * 3)
    nsv = int(table.rec[i, R_NSV])
    try:
        if block[:12] != head:
            raise BlockDecodeError(f"block grid {struct.unpack('<3I', block[:12]) if len(block) >= 12 else ()} "
                                   f"sub-blocks is not the chunk size {8 * head[0]}³")
        if int.from_bytes(block[12:16], "little") != nsv:
            raise ShardFormatError(f"its label lists have {nsv} entries, its block has "
                                   f"{int.from_bytes(block[12:16], 'little')} labels")
        pal = labels.palette(table, i)
        if pal is not None and (pal.dtype != _U64 or not pal.flags.c_contiguous):
            pal = np.ascontiguousarray(pal, _U64)
        return transcode_u8(np.frombuffer(block, np.uint8), pal)
    except (BlockDecodeError, ShardFormatError) as e:
        raise type(e)(f"{table.where(i)}: {e}") from None


class Stager:
    """Chunks encoded by TensorStore, through an unsharded in-memory array of the scale's geometry."""

    def __init__(self, format: str, sp: ScaleLayout, context: Any):
        import tensorstore as ts

        self.format, self.sp = format, sp
        mem = {"driver": "memory", "path": f"stage-{uuid.uuid4().hex}/"}
        if format == "precomputed":
            self.arr = ts.open(precomputed_spec(mem, sp, sharded=False), create=True, context=context).result()[..., 0]
        else:
            self.arr = ts.open({"driver": "zarr3", "kvstore": mem, "metadata": zarr3_metadata(sp, sharded=False)},
                               create=True, context=context).result()
        self.kv = ts.KvStore.open(mem, context=context).result()

    def encode(self, rel: Any, vol_zyx: np.ndarray) -> bytes | None:
        """The chunk at relative position ``rel`` encoded (None: all fill)."""
        sp = self.sp
        lo = np.asarray(rel, np.int64) * sp.chunk
        hi = np.minimum(lo + sp.chunk, sp.size)
        if self.format == "precomputed":
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


class TsGzip:
    """TensorStore's own gzip of a minishard index (its zlib's bytes, not Python's): the index as the
    one value of a 0-bit sharded store with gzip data, in memory."""

    def __init__(self, context: Any):
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


# --------------------------------------------------------------------------- shard files


def file_order(spec: ShardingSpec, keys: np.ndarray) -> np.ndarray:
    """Chunk ids in a shard file's order: by minishard, then ascending (identity hash)."""
    mini = (keys >> np.uint64(spec.preshift_bits)) & np.uint64((1 << spec.minishard_bits) - 1) \
        if spec.preshift_bits < 64 else np.zeros_like(keys)
    return np.lexsort((keys, mini))


class _Nothing(Exception):  # a shard file of no chunk: not published
    pass


def write_precomputed_shard(store: ByteStore, key: str, spec: ShardingSpec,
                            chunks: Iterable[tuple[int, bytes | None]], gzip_index: Callable[[bytes], bytes]) -> int:
    """A precomputed shard file from ``(chunk id, bytes or None: background)`` in the file's order,
    streamed (published whole, never held in memory); the chunks written. With none, no file."""
    n = 0
    try:
        with store.writer(key) as f:
            out = PrecomputedShardWriter(spec, f, gzip_index)
            for k, data in chunks:
                if data is not None:
                    out.add(k, data)
            n = out.finish()
            if not n:
                raise _Nothing
    except _Nothing:
        store.delete_sync(key)
    return n


def write_zarr3_shard(store: ByteStore, key: str, sp: ScaleLayout, chunks: Iterable[tuple[bytes, bytes | None]],
                      context: Any) -> int:
    """A zarr3 shard from ``(inner key, chunk or None: background)`` in one transaction of
    TensorStore's ``zarr3_sharding_indexed`` driver (never merged with one there); the chunks written."""
    import tensorstore as ts

    kvspec = store.kvstore_spec()
    assert kvspec is not None
    store.delete_sync(key)
    kv = ts.KvStore.open({"driver": "zarr3_sharding_indexed", "base": _sub(kvspec, key),
                          "grid_shape": list(sp.shard_chunks), "index_codecs": ZARR_INDEX_CODECS,
                          "index_location": "end"}, context=context).result()
    txn = ts.Transaction()
    kvt = kv.with_transaction(txn)
    n = 0
    for k, data in chunks:
        if data is not None:
            kvt.write(k, data)
            n += 1
    if n:
        txn.commit_async().result()
    else:
        txn.abort()
    return n


def existing_chunks(store: ByteStore, key: str, format: str, sp: ScaleLayout) -> int | None:
    """Chunks an output shard holds, from its index (ranged reads); None: no file, -1: damaged."""
    where = store.describe(key)
    try:
        if format == "zarr3":
            n = math.prod(sp.shard_chunks)
            tail = bytes(store.read_sync(key, -(16 * n + 4), None))
            if len(tail) != 16 * n + 4:
                raise ShardFormatError(f"{where}: zarr shard shorter than its index")
            return int((np.frombuffer(tail, "<u8", 2 * n)[0::2] != _NO_CHUNK).sum())
        spec = sp.precomputed_sharding()
        nmini = 1 << int(spec["minishard_bits"])
        head = bytes(store.read_sync(key, 0, 16 * nmini))
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
        region = bytes(store.read_sync(key, 16 * nmini + a, 16 * nmini + b))
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
    except MissingShardError:
        return None
    except ShardFormatError:  # PastEndError included: shorter than its index
        return -1
