"""A whole export: its scales and their geometry.

Geometry comes from a neuroglancer multiscale spec (the JSON DVID's export-shards takes, or an
``info`` file in the export) and is otherwise inferred from the shard files.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import numpy as np

from .errors import SpecError
from .formats.sharding import ShardingSpec, dvid_shard_extent, grid_shape
from .sources import ByteSource, LocalSource

__all__ = ["Dataset", "Scale", "as_source", "parse_multiscale"]

_STEM = re.compile(r"^(\d+)_(\d+)_(\d+)$")
SINGLE_SHARD = 1 << 40  # shard extent when every chunk lives in one shard at the origin


@dataclass(frozen=True)
class Scale:
    """Geometry of one scale of an export (all vectors x, y, z)."""

    index: int
    size: tuple[int, int, int]
    resolution: tuple[float, float, float]
    shard_extent: int
    chunk_size: tuple[int, int, int] = (64, 64, 64)
    voxel_offset: tuple[int, int, int] = (0, 0, 0)
    key: str = ""
    sharding: ShardingSpec | None = None
    inferred: bool = field(default=False, compare=False)

    @property
    def folder(self) -> str:
        """The scale's folder in the export, always ``s{index}``."""
        return f"s{self.index}"

    @property
    def grid(self) -> tuple[int, int, int]:
        """Chunks per axis covering the volume from the origin."""
        end = np.add(self.voxel_offset, self.size)
        return grid_shape(end, self.chunk_size)

    @property
    def num_chunk_slots(self) -> int:
        """Chunks in the volume's bounding grid (present or not)."""
        return math.prod(self.grid)

    def shard_box(self, origin) -> tuple[np.ndarray, np.ndarray]:
        """Chunk coordinates [lo, hi) of the shard whose voxel origin is given."""
        lo = np.asarray(origin, np.int64) // np.asarray(self.chunk_size)
        hi = (np.asarray(origin, np.int64) + min(self.shard_extent, SINGLE_SHARD)) // np.asarray(self.chunk_size)
        return lo, hi

    def to_json(self) -> dict:
        """The neuroglancer scale entry."""
        d = {
            "key": self.key or f"s{self.index}",
            "size": list(self.size),
            "resolution": list(self.resolution),
            "voxel_offset": list(self.voxel_offset),
            "chunk_sizes": [list(self.chunk_size)],
            "encoding": "compressed_segmentation",
            "compressed_segmentation_block_size": [8, 8, 8],
        }
        if self.sharding is not None:
            d["sharding"] = self.sharding.to_json()
        return d


def _triple(v, what: str, where: str, cast=int) -> tuple:
    try:
        t = tuple(cast(x) for x in v)
    except (TypeError, ValueError):
        t = ()
    if len(t) != 3:
        raise SpecError(f"{where}: {what} must be three numbers, got {v!r}")
    return t


def parse_multiscale(spec: dict, where: str = "spec") -> list[Scale]:
    """Scales of a neuroglancer multiscale spec (DVID's export-shards input or an ``info`` file)."""
    if not isinstance(spec, dict) or not isinstance(spec.get("scales"), list) or not spec["scales"]:
        raise SpecError(f"{where}: not a neuroglancer multiscale spec (no 'scales' list)")
    dtype = spec.get("data_type", "uint64")
    if dtype != "uint64":
        raise SpecError(f"{where}: data_type is {dtype!r}; DVID label exports are uint64")
    scales = []
    for i, s in enumerate(spec["scales"]):
        w = f"{where}: scale {i}"
        if not isinstance(s, dict):
            raise SpecError(f"{w} is not an object")
        size = _triple(s.get("size"), "size", w)
        res = _triple(s.get("resolution"), "resolution", w, float)
        off = _triple(s.get("voxel_offset", (0, 0, 0)), "voxel_offset", w)
        cs_list = s.get("chunk_sizes", [[64, 64, 64]])
        cs = _triple(cs_list[0] if isinstance(cs_list, list) and cs_list else None, "chunk_sizes", w)
        if min(size) <= 0 or min(cs) <= 0 or min(res) <= 0:
            raise SpecError(f"{w}: sizes and resolutions must be positive")
        sharding = ShardingSpec.from_json(s["sharding"]) if s.get("sharding") else None
        if sharding is not None:
            if len(set(cs)) != 1:
                raise SpecError(f"{w}: DVID's shard naming needs cubic chunks, got {cs}")
            extent = dvid_shard_extent(sharding, np.add(off, size), cs[0])
        else:
            extent = SINGLE_SHARD
        scales.append(Scale(i, size, res, extent, cs, off, str(s.get("key", f"s{i}")), sharding))
    return scales


def _spec_from_consolidated(folder: str) -> dict | None:
    """The geometry stored in a folder of consolidated indexes (None if it holds none)."""
    from .index import ConsolidatedIndex

    names = sorted((n for n in os.listdir(folder) if re.fullmatch(r"s\d+\.chunks\.arrow", n)),
                   key=lambda n: int(n[1:].split(".")[0])) if os.path.isdir(folder) else []
    metas = [ConsolidatedIndex(folder, n.split(".")[0]).meta for n in names]
    if not metas or [m.get("index") for m in metas] != list(range(len(metas))):
        return None
    return {"@type": "neuroglancer_multiscale_volume", "data_type": "uint64", "num_channels": 1,
            "scales": [m["scale"] for m in metas]}


def as_source(source) -> ByteSource:
    """A ByteSource for a path (local directory) or an existing ByteSource."""
    if isinstance(source, ByteSource):
        return source
    if isinstance(source, (str, os.PathLike)):
        s = os.fspath(source)
        if "://" in s and not s.startswith("file://"):
            from .kvsource import KvStoreSource  # cloud and http sources
            return KvStoreSource.from_url(s)
        s = s[len("file://"):] if s.startswith("file://") else s
        if not os.path.isdir(s):
            raise SpecError(f"{s}: not a directory (an export holds folders s0, s1, ...)")
        return LocalSource(s)
    if isinstance(source, dict):
        from .kvsource import KvStoreSource
        return KvStoreSource(source)
    raise SpecError(f"cannot open {type(source).__name__} as an export (give a path, URL or kvstore spec)")


def _load_spec(spec, source: ByteSource) -> tuple[dict | None, str]:
    if spec is None:
        if source.exists("info"):
            return _json(source.read("info"), source.describe("info")), source.describe("info")
        return None, ""
    if isinstance(spec, dict):
        return spec, "spec"
    path = os.fspath(spec)
    try:
        with open(path, "rb") as f:
            return _json(f.read(), path), path
    except OSError as e:
        raise SpecError(f"{path}: cannot read spec ({e.strerror or e})") from None


def _json(data: bytes, where: str) -> dict:
    try:
        return json.loads(data)
    except ValueError as e:
        raise SpecError(f"{where}: not valid JSON ({e})") from None


def shard_stems(source: ByteSource, folder: str) -> list[tuple[int, int, int]]:
    """Voxel origins of the shard files in one scale folder."""
    out = []
    for name in source.list(folder):
        if name.endswith(".arrow"):
            m = _STEM.match(name[:-6])
            if m:
                out.append(tuple(int(g) for g in m.groups()))
    return out


def infer_extent(origins: list[tuple[int, int, int]]) -> int:
    """Shard extent S from file names: the gcd of all origin components (cubic shards)."""
    g = 0
    for o in origins:
        for v in o:
            g = math.gcd(g, v)
    return g or SINGLE_SHARD


def open_shard(source: ByteSource, stem: str, chunk_size=(64, 64, 64), box=None):
    """A loaded shard: memory-mapped for local sources, byte-range reads otherwise."""
    if source.mappable:
        from .shardfile import ShardFile
        return ShardFile(source, stem, chunk_size, box=box)
    from .remote import RemoteShard
    return RemoteShard(source, stem, chunk_size, box=box)


def _index_coords(source: ByteSource, stem: str) -> np.ndarray:
    """Chunk coordinates listed by a shard's index (its CSV alone when there is one)."""
    from .index import parse_csv

    if source.exists(stem + ".csv"):
        return parse_csv(source.read(stem + ".csv"), source.describe(stem + ".csv")).coords
    return open_shard(source, stem).index.coords


def _infer_scales(source: ByteSource) -> list[Scale]:
    folders = sorted(int(n[1:]) for n in source.list("") if re.fullmatch(r"s\d+", n))
    if not folders:
        raise SpecError(f"{source.describe('')}: no scale folders s0, s1, ... found")
    scales = []
    for k in folders:
        origins = shard_stems(source, f"s{k}")
        if not origins:
            continue
        extent = infer_extent(origins)
        # the volume ends in the shards at the largest origin along each axis (their indexes only)
        top = np.max(origins, axis=0)
        hi = np.zeros(3, np.int64)
        for o in (o for o in origins if any(v == t for v, t in zip(o, top, strict=True))):
            coords = _index_coords(source, f"s{k}/{o[0]}_{o[1]}_{o[2]}")
            if len(coords):
                hi = np.maximum(hi, coords.max(axis=0) + 1)
        size = tuple(int(v) * 64 for v in np.maximum(hi, 1))
        f = float(2 ** k)
        scales.append(Scale(k, size, (f, f, f), extent, key=f"s{k}", inferred=True))
    return scales


class Dataset:
    """An export: its scales, their geometry and their volumes.

    Parameters
    ----------
    source : str, path, URL, kvstore spec dict or ByteSource
        The export root (holding ``s0``, ``s1``, ...).
    spec : dict or path, optional
        The neuroglancer multiscale spec given to DVID's export-shards (like
        ``mcns-ng-specs.json``). Default: an ``info`` file at the root, else the geometry
        saved in a consolidated index, else geometry inferred from the shard files (size
        rounded up to whole chunks, resolution 2**scale).
    index : path, optional
        A folder of consolidated indexes written by ``dvidshards consolidate``: shards are
        then located without reading their own indexes or listing folders.
    """

    def __init__(self, source, *, spec=None, index=None):
        self.source = as_source(source)
        self.index = os.fspath(index) if index is not None else None
        raw, where = _load_spec(spec, self.source)
        if raw is None and self.index is not None:
            raw, where = _spec_from_consolidated(self.index), self.index
        self.spec = raw
        self.scales = parse_multiscale(raw, where) if raw is not None else _infer_scales(self.source)

    def __repr__(self) -> str:
        return f"Dataset({self.source.describe('')!r}, scales={len(self.scales)})"

    def consolidated(self, scale=0):
        """The consolidated index of a scale (None when there is none)."""
        from .index import ConsolidatedIndex, consolidated_paths

        s = self.scale(scale)
        if self.index is None or not os.path.exists(consolidated_paths(self.index, s.folder)[0]):
            return None
        return ConsolidatedIndex(self.index, s.folder)

    def chunks(self, scale=0) -> np.ndarray:
        """Every chunk coordinate present at a scale, (n, 3) x, y, z (fast with a consolidated index)."""
        ci = self.consolidated(scale)
        if ci is not None:
            return ci.chunks()
        s = self.scale(scale)
        parts = [open_shard(self.source, f"{s.folder}/{o[0]}_{o[1]}_{o[2]}", s.chunk_size).index.coords
                 for o in self.shards(s.index)]
        return np.concatenate(parts) if parts else np.zeros((0, 3), np.int64)

    def scale(self, which=0) -> Scale:
        """A scale by index, or by resolution (a number or an (x, y, z) triple)."""
        if isinstance(which, Scale):
            return which
        if isinstance(which, (int, np.integer)) and not isinstance(which, bool):
            if 0 <= which < len(self.scales):
                return self.scales[which]
            raise SpecError(f"scale {which} does not exist (the export has {len(self.scales)} scales)")
        res = (float(which),) * 3 if isinstance(which, (float, np.floating)) else tuple(float(v) for v in which)
        for s in self.scales:
            if np.allclose(s.resolution, res):
                return s
        raise SpecError(f"no scale has resolution {res}; resolutions are {[s.resolution for s in self.scales]}")

    @property
    def info(self) -> dict:
        """The neuroglancer ``info`` of the export."""
        return {
            "@type": "neuroglancer_multiscale_volume",
            "type": "segmentation",
            "data_type": "uint64",
            "num_channels": 1,
            "scales": [s.to_json() for s in self.scales],
        }

    def shards(self, scale=0) -> list[tuple[int, int, int]]:
        """Voxel origins of the shard files present at a scale (lists the folder)."""
        ci = self.consolidated(scale)
        return ci.shards if ci is not None else shard_stems(self.source, self.scale(scale).folder)

    def open(self, scale=0, *, labels="agglomerated", fill_missing_shards: bool = False, context=None,
             max_shards: int = 64):
        """The scale as a ``tensorstore.TensorStore``; see ``dvidshards.open``."""
        from .volume import open_scale

        return open_scale(self, self.scale(scale), labels=labels, fill_missing_shards=fill_missing_shards,
                          context=context, max_shards=max_shards)

