"""The neuroglancer multiscale spec: one parser and one builder for every JSON it appears in.

DVID's ``export-shards`` input (``mcns-ng-specs.json``), an export's ``info``, a consolidated
index's geometry and what ``dvidshards view`` serves. `Scale` is one entry, with DVID's
shard-grid arithmetic (extent, origins, file stems). DVID has named shard files two ways
(FORMATS.md §3a): ``Scale.naming`` says which a scale's files follow and ``Scale.shard_extent``
is the files' extent under it, so finding a chunk's file is one code path for both;
`naming_of_origins` tells the generation from file names.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import SpecError
from .sharding import (
    DVID_NAMING_CHANGE,
    NAMINGS,
    ShardingSpec,
    dvid_old_shard_extent,
    dvid_shard_extent,
    namings_agree,
)

__all__ = ["SINGLE_SHARD", "Scale", "multiscale_info", "naming_note", "naming_of_origins", "parse_json", "parse_multiscale"]

SINGLE_SHARD = 1 << 40  # shard extent when every chunk lives in one shard at the origin


@dataclass(frozen=True)
class Scale:
    """Geometry of one scale of an export (vectors x, y, z); ``index`` is its folder ``s{index}``.

    ``inferred`` names what was guessed from the files rather than given (``"size"``,
    ``"shard_extent"``, ``"resolution"``; ``resolution`` is then None unless given).
    ``shard_extent`` is the voxel extent of the shard files under ``naming``: ``"current"`` (DVID
    since 2026-03-21, `dvid_shard_extent`) or ``"old"`` (`dvid_old_shard_extent`: a neuroglancer
    shard larger than that cube spans several files).
    """

    index: int
    size: tuple[int, int, int]
    resolution: tuple[float, float, float] | None
    shard_extent: int
    chunk_size: tuple[int, int, int] = (64, 64, 64)
    voxel_offset: tuple[int, int, int] = (0, 0, 0)
    key: str = ""
    sharding: ShardingSpec | None = None
    inferred: tuple[str, ...] = field(default=(), compare=False)
    #: with an inferred shard extent: the extent (voxels) the loaded records prove, never larger
    proven_extent: int | None = field(default=None, compare=False)
    #: DVID's naming generation of the scale's shard files: "current" or "old" (see the class doc)
    naming: str = "current"

    def __post_init__(self) -> None:
        if self.naming not in NAMINGS:
            raise SpecError(f"scale {self.index}: naming must be one of {', '.join(NAMINGS)}, got {self.naming!r}")

    def extent_of(self, naming: str) -> int:
        """Shard file extent (voxels) under a naming generation (``shard_extent`` for both without a
        sharding spec)."""
        if naming not in NAMINGS:
            raise SpecError(f"naming must be one of {', '.join(NAMINGS)}, got {naming!r}")
        if self.sharding is None or naming == self.naming:
            return self.shard_extent
        if naming == "old":
            return dvid_old_shard_extent(self.sharding, self.chunk_size[0])
        end = [o + z for o, z in zip(self.voxel_offset, self.size, strict=True)]
        return dvid_shard_extent(self.sharding, end, self.chunk_size[0])

    @functools.cached_property
    def namings_differ(self) -> bool:
        """Whether DVID's two namings put some chunk of this scale in different files (only then must
        the file names be read)."""
        if self.sharding is None or "shard_extent" in self.inferred:
            return False
        return not namings_agree(self.extent_of("old"), self.extent_of("current"), self.grid, self.chunk_size[0])

    def with_naming(self, naming: str) -> Scale:
        """This scale with its shard files named under ``naming`` (``shard_extent`` to match)."""
        if naming == self.naming:
            return self
        return dataclasses.replace(self, shard_extent=self.extent_of(naming), naming=naming)

    def fits(self, origins: Any, extent: int | None = None) -> np.ndarray:
        """(n,) bool: whether a file at each (n, 3) voxel origin lies on the shard grid of ``extent``
        (default the scale's) and meets the volume."""
        o = np.asarray(origins, np.int64).reshape(-1, 3)
        e = min(self.shard_extent if extent is None else extent, SINGLE_SHARD)
        lo = np.asarray(self.voxel_offset, np.int64)
        hi = lo + np.asarray(self.size, np.int64)
        on = ~(o % e != 0).any(axis=1) if e < SINGLE_SHARD else ~(o != 0).any(axis=1)
        return np.asarray(on & ~((o >= hi) | (o + e <= lo)).any(axis=1))

    @property
    def folder(self) -> str:
        return f"s{self.index}"

    @functools.cached_property
    def grid(self) -> tuple[int, int, int]:
        """Chunks per axis covering the volume from the origin (computed once: a hot path asks)."""
        x, y, z = (-(-(o + s) // c) for o, s, c in zip(self.voxel_offset, self.size, self.chunk_size, strict=True))
        return x, y, z  # grid_shape's arithmetic; the fields were checked when parsed

    @property
    def num_chunk_slots(self) -> int:
        """Chunks in the volume's bounding grid (present or not)."""
        return math.prod(self.grid)

    @property
    def shard_chunks(self) -> int:
        """Chunks per shard side (the whole grid for a single shard)."""
        return min(self.shard_extent, SINGLE_SHARD) // self.chunk_size[0]

    def shard_origin(self, x: int, y: int, z: int) -> tuple[int, int, int]:
        """Voxel origin of the shard file that holds chunk (x, y, z)."""
        s = self.shard_extent
        cx, cy, cz = self.chunk_size
        return (x * cx // s * s, y * cy // s * s, z * cz // s * s)

    def shard_box(self, origin: Any) -> tuple[np.ndarray, np.ndarray]:
        """Chunk coordinates [lo, hi) of the shard whose voxel origin is given."""
        cs = np.asarray(self.chunk_size, np.int64)
        o = np.asarray(origin, np.int64)
        return o // cs, (o + min(self.shard_extent, SINGLE_SHARD)) // cs

    def stem(self, origin: Any) -> str:
        """Key of a shard without extension, e.g. ``"s1/30720_24576_28672"``."""
        return f"{self.folder}/{int(origin[0])}_{int(origin[1])}_{int(origin[2])}"

    def is_origin(self, origin: Any) -> bool:
        """Whether a voxel origin lies on this scale's shard grid."""
        return self.shard_extent >= SINGLE_SHARD or not any(int(v) % self.shard_extent for v in origin)

    def check_box(self, box: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(lo, hi)`` int64 voxel corners of ``[[x0, y0, z0], [x1, y1, z1]]``, inside the volume."""
        try:
            lo, hi = (np.asarray(v, np.int64).reshape(3) for v in box)
        except OverflowError:
            raise SpecError(f"box {box!r}: coordinates must fit in 64 bits") from None
        except (TypeError, ValueError):
            raise SpecError(f"box must be [[x0, y0, z0], [x1, y1, z1]], got {box!r}") from None
        vlo = np.asarray(self.voxel_offset, np.int64)
        vhi = vlo + np.asarray(self.size, np.int64)
        if (lo > hi).any() or (lo < vlo).any() or (hi > vhi).any():
            raise SpecError(f"box {lo.tolist()}..{hi.tolist()} is not inside scale {self.index}'s volume "
                            f"{vlo.tolist()}..{vhi.tolist()}")
        return lo, hi

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "key": self.key or f"s{self.index}",
            "size": list(self.size),
            "resolution": list(self.resolution) if self.resolution is not None else [1.0, 1.0, 1.0],
            "voxel_offset": list(self.voxel_offset),
            "chunk_sizes": [list(self.chunk_size)],
            "encoding": "compressed_segmentation",
            "compressed_segmentation_block_size": [8, 8, 8],
        }
        if self.sharding is not None:
            d["sharding"] = self.sharding.to_json()
        return d


def naming_of_origins(scale: Scale, origins: Any) -> str | None:
    """The naming generation a scale's shard file names follow, or None when they cannot tell.

    A name fits a generation when it lies on its shard grid and meets the volume. Every name fitting
    exactly one generation: that one; every name fitting both (they agree there, or too few names):
    None, read as today's DVID names it; some fitting neither: the one more names fit (ties:
    current), so the check of the names names a file that fits neither.
    """
    o = np.asarray(origins, np.int64).reshape(-1, 3)
    if not len(o) or not scale.namings_differ:
        return None
    fit = {n: scale.fits(o, scale.extent_of(n)) for n in NAMINGS}
    if fit["current"].all() and fit["old"].all():
        return None
    return "old" if int(fit["old"].sum()) > int(fit["current"].sum()) else "current"


def naming_note(scale: Scale) -> str:
    """How the two naming generations differ at a scale, for messages ("" where they agree)."""
    if not scale.namings_differ:
        return ""
    other = "old" if scale.naming == "current" else "current"
    when = f"before {DVID_NAMING_CHANGE}" if other == "old" else f"since {DVID_NAMING_CHANGE}"
    return f", or {scale.extent_of(other)} voxels as DVID named files {when}"


def multiscale_info(scales: list[Scale]) -> dict[str, Any]:
    """The neuroglancer ``info`` of a list of scales (what ``parse_multiscale`` reads back)."""
    return {
        "@type": "neuroglancer_multiscale_volume",
        "type": "segmentation",
        "data_type": "uint64",
        "num_channels": 1,
        "scales": [s.to_json() for s in scales],
    }


def _number(x: Any, cast: Any) -> Any:
    """A JSON number as int or float: never a string, a bool, or a fraction cut to an int."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(x)
    if cast is int and not isinstance(x, numbers.Integral):
        if not float(x).is_integer():
            raise ValueError(x)
    return cast(x)


def _triple(v: Any, what: str, where: str, cast: Any = int) -> tuple[Any, ...]:
    try:
        t = tuple(_number(x, cast) for x in v)
    except (TypeError, ValueError, OverflowError):
        t = ()
    if len(t) != 3:
        kind = "integers" if cast is int else "numbers"
        raise SpecError(f"{where}: {what} must be three {kind}, got {v!r}")
    return t


def parse_json(data: bytes, where: str) -> dict[str, Any]:
    """A JSON object from bytes, or SpecError naming where it came from."""
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise SpecError(f"{where}: not valid JSON ({str(e)[:80]})") from None
    if not isinstance(obj, dict):
        raise SpecError(f"{where}: not a JSON object")
    return obj


def parse_multiscale(spec: dict[str, Any], where: str = "spec") -> list[Scale]:
    """Scales of a neuroglancer multiscale spec (DVID's export-shards input or an ``info``); scale
    ``i`` is folder ``s{i}``, as DVID writes it."""
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
        if min(size) <= 0 or min(cs) <= 0 or not all(r > 0 and math.isfinite(r) for r in res):
            raise SpecError(f"{w}: sizes and resolutions must be positive")
        if max(size) >= 1 << 40 or max(cs) > 1024 or min(off) < 0:
            raise SpecError(f"{w}: size {size}, chunk size {cs} or offset {off} is out of range")
        sharding = ShardingSpec.from_json(s["sharding"]) if s.get("sharding") else None
        if sharding is not None:
            if len(set(cs)) != 1:
                raise SpecError(f"{w}: DVID's shard naming needs cubic chunks, got {cs}")
            extent = dvid_shard_extent(sharding, [o + z for o, z in zip(off, size, strict=True)], cs[0])
        else:
            extent = SINGLE_SHARD
        scales.append(Scale(i, size, res, extent, cs, off, str(s.get("key", f"s{i}")), sharding))
    return scales
