"""The shard files of a scale, by name only: listing, the checks of names against the geometry,
DVID's naming generation, and the messages for a scale the export does not hold."""

from __future__ import annotations

import asyncio
import itertools
import re
from dataclasses import dataclass, field

import numpy as np

from .errors import NotExportedError, SpecError
from .formats.multiscale import SINGLE_SHARD, Scale, naming_note, naming_of_origins
from .sources.base import RecordSource
from .stores.base import ByteStore

__all__ = ["ScaleFiles", "check_origins", "list_scale", "neighbour_origins", "not_exported_error",
           "not_exported_note", "parse_shard_names", "probe_neighbours", "sample_scale", "scale_folders",
           "scale_naming", "scales_phrase"]

_SHARD_NAME = re.compile(r"([0-9]+)_([0-9]+)_([0-9]+)\.arrow")  # ASCII digits: \d takes other scripts' too


def parse_shard_names(names) -> list[tuple[int, int, int]]:
    """Sorted voxel origins of the ``{ox}_{oy}_{oz}.arrow`` names among a folder's names."""
    out = []
    for n in names:
        if n.endswith(".arrow"):
            m = _SHARD_NAME.fullmatch(n)
            if m:
                out.append((int(m.group(1)), int(m.group(2)), int(m.group(3))))
    return sorted(out)


@dataclass(frozen=True)
class ScaleFiles:
    """What one listing of a scale's folder found: names only, no file read.

    ``origins``: the shard files' voxel origins (None: the store cannot list, e.g. http);
    ``folder``: False when the export has no folder for the scale; then ``others`` are the
    scale folders it has (None: not listed) and ``store`` the store listed.
    """

    scale: Scale
    where: str
    origins: tuple[tuple[int, int, int], ...] | None
    folder: bool
    others: tuple[str, ...] | None = None
    store: ByteStore | RecordSource | None = field(default=None, compare=False, repr=False)

    def require_folder(self) -> None:
        """NotExportedError (a SpecError) when the export has no folder for the scale."""
        if not self.folder:
            held = None if self.others is None else [int(f[1:]) for f in self.others]
            raise not_exported_error(self.store, self.scale.index, held)


async def scale_folders(store: ByteStore) -> tuple[str, ...] | None:
    """The export's scale folders in scale order, where a root listing is cheap (else None).

    For messages only: an object store lists every key below the root (the whole export).
    """
    if not store.immediate:
        return None
    try:
        names = await store.list("")
    except SpecError:
        return None
    return tuple(sorted((n for n in names if re.fullmatch(r"s[0-9]+", n)), key=lambda n: int(n[1:])))


async def list_scale(store: ByteStore | RecordSource, scale: Scale, geometry: str = "the spec", *,
                     check: bool = True) -> ScaleFiles:
    """List a scale's folder and check its shard file names against the scale's geometry.

    A name off the shard grid or outside the volume is a SpecError (the spec is not the
    export's): one listing and arithmetic on names (the 52,900 names of mCNS ``s0``: ~25 ms
    beyond the listing; bench_read).  A record source, or a store that cannot list, gives
    ``origins=None``.  ``check=False`` lists only (the caller runs ``check_origins``).
    """
    where = store.describe(scale.folder)
    if isinstance(store, RecordSource):
        return ScaleFiles(scale, where, None, True)
    try:
        names = await store.list(scale.folder)
    except SpecError:  # the store cannot list (http)
        return ScaleFiles(scale, where, None, True)
    origins = parse_shard_names(names)
    folder = bool(names) or await store.is_folder(scale.folder)
    if origins and check:
        check_origins(scale, origins, store, geometry)
    return ScaleFiles(scale, where, tuple(origins), folder, None if folder else await scale_folders(store), store)


async def sample_scale(store: ByteStore | RecordSource, scale: Scale, geometry: str = "the spec",
                       n: int = 256) -> bool | None:
    """The cheap check at open: up to ``n`` shard file names of a scale against its geometry.

    Only where the store gives a few names cheaply (``ByteStore.sample``: a local folder, memory).
    Returns whether the folder exists (None: cannot tell cheaply).  When DVID's shards are
    smaller than the spec's, 7 in 8 of its files or more lie off the spec's grid, so a sample of
    a few hundred finds one.
    """
    if isinstance(store, RecordSource):
        return True
    names = await store.sample(scale.folder, n)
    if names is None:
        return None
    origins = parse_shard_names(names)
    if origins:
        check_origins(scale, origins, store, geometry)
        return True
    return await store.is_folder(scale.folder)


async def scale_naming(store: ByteStore | RecordSource, scale: Scale, origins=None,
                       n: int = 256) -> tuple[str | None, list[tuple[int, int, int]] | None]:
    """DVID's naming generation of a scale's shard files from their names: (naming, origins seen).

    Only where the generations differ (``Scale.namings_differ``).  From ``origins`` when given
    (a consolidated index's); else a sample of ``n`` names where cheap, the whole listing only
    when the sample cannot tell; a store that cannot list is asked whether files exist at origins
    only the old generation uses.  ``naming`` None: the names cannot tell (today's naming then
    reads them exactly, see ``naming_of_origins``).  The caller checks the origins seen against
    the grid of the naming chosen (``check_origins``).
    """
    if isinstance(store, RecordSource) or not scale.namings_differ:
        return None, None
    if origins is not None:
        return naming_of_origins(scale, origins), None
    names = await store.sample(scale.folder, n)
    if names is not None:
        seen = parse_shard_names(names)
        got = naming_of_origins(scale, seen)
        if got is not None or len(names) < n:
            return got, seen
    try:
        names = await store.list(scale.folder)
    except SpecError:  # the store cannot list (http)
        return await _probe_naming(store, scale), None
    seen = parse_shard_names(names)
    return naming_of_origins(scale, seen), seen


async def _exist(store: ByteStore, keys: list[str], limit: int = 64) -> list[bool]:
    """Whether each key exists: in turn on an immediate store, else ``limit`` at a time."""
    if store.immediate:
        return [await store.exists(k) for k in keys]
    sem = asyncio.Semaphore(limit)

    async def one(k):
        async with sem:
            return await store.exists(k)

    return list(await asyncio.gather(*(one(k) for k in keys)))


async def _probe_naming(store: ByteStore, scale: Scale, limit: int = 4096) -> str | None:
    """"old" when a shard file exists at an origin only the old naming uses (None: none or too many)."""
    old, new = scale.extent_of("old"), scale.extent_of("current")
    lo = np.asarray(scale.voxel_offset, np.int64)
    hi = lo + np.asarray(scale.size, np.int64)
    axes = [range(int(a) // old * old, int(b), old) for a, b in zip(lo, hi, strict=True)]
    if np.prod([len(a) for a in axes]) > limit * 8:
        return None
    only_old = [o for o in itertools.product(*axes) if any(v % new for v in o)][:limit]
    return "old" if any(await _exist(store, [scale.stem(o) + ".arrow" for o in only_old])) else None


def neighbour_origins(scale: Scale, origin) -> list[tuple[int, int, int]]:
    """Origins off the shard grid where a smaller-sharded export would have files next to the
    shard at ``origin``: + 1, 2, 4, ... chunks along each axis below the extent, inside the
    volume (15 for mCNS's 2048-voxel shards)."""
    e = min(scale.shard_extent, SINGLE_SHARD)
    end = [a + b for a, b in zip(scale.voxel_offset, scale.size, strict=True)]
    out = []
    step = min(scale.chunk_size)
    while step < e:
        for axis in range(3):
            p = [int(v) for v in origin]
            p[axis] += step
            if p[axis] < end[axis] and p[axis] % e:
                out.append((p[0], p[1], p[2]))
        step *= 2
    return out


def _grid(scale: Scale) -> str:
    e = min(scale.shard_extent, SINGLE_SHARD)
    return f"shards of {e} voxels{naming_note(scale)}" if e < SINGLE_SHARD else "one shard at 0_0_0 (no sharding)"


async def probe_neighbours(store: ByteStore, scale: Scale, origin, geometry: str = "the spec") -> None:
    """SpecError when a shard file exists off the grid next to the shard at ``origin``.

    What reads check when nothing was listed: a spec with larger shards than the export's (its
    files then lie between the spec's origins) would read their chunks as background.
    """
    keys = [scale.stem(p) + ".arrow" for p in neighbour_origins(scale, origin)]
    hits = [k for k, f in zip(keys, await _exist(store, keys), strict=True) if f]
    if hits:
        raise SpecError(f"{store.describe(hits[0])}: this shard file is not on the shard grid of {geometry} (scale "
                        f"{scale.index}: {_grid(scale)}), so the chunks it holds would read as background: that "
                        f"geometry is not this export's; give the spec given to DVID's export-shards")


def check_origins(scale: Scale, origins, store, geometry: str = "the spec") -> None:
    """SpecError naming a shard file off the scale's grid (of its naming generation) or outside
    its volume."""
    o = np.asarray(origins, np.int64).reshape(-1, 3)
    bad = np.flatnonzero(~scale.fits(o))
    if not bad.size:
        return
    e = min(scale.shard_extent, SINGLE_SHARD)
    lo = np.asarray(scale.voxel_offset, np.int64)
    hi = lo + np.asarray(scale.size, np.int64)
    i = int(bad[0])
    name = store.describe(scale.stem(o[i]) + ".arrow")
    off = (o[i] % e != 0).any() if e < SINGLE_SHARD else (o[i] != 0).any()
    if off:
        why = f"is not on the shard grid of {geometry} (scale {scale.index}: {_grid(scale)})"
    else:
        why = (f"lies outside the volume of {geometry} (scale {scale.index}: voxels {lo.tolist()} to "
               f"{hi.tolist()})")
    raise SpecError(f"{name}: this shard file {why}: that geometry is not this export's ({int(bad.size)} of "
                    f"{len(o)} files do not fit); give the spec given to DVID's export-shards")


def scales_phrase(held) -> str:
    """Scale numbers as a short phrase: "s0", "s0-s3", "s0-s6, s10, s11" or "no scale"."""
    ks = sorted({int(k) for k in held})
    if not ks:
        return "no scale"
    runs: list[list[int]] = []
    for k in ks:
        if runs and k == runs[-1][-1] + 1:
            runs[-1].append(k)
        else:
            runs.append([k])
    return ", ".join(f"s{r[0]}-s{r[-1]}" if len(r) > 2 else ", ".join(f"s{k}" for k in r) for r in runs)


def not_exported_note(store, indices) -> str:
    """The line ``info`` and ``verify`` print for the scales an export does not hold."""
    source = getattr(store, "base", store).describe("")
    return (f"not exported: {scales_phrase(indices)} (the spec lists them, this export does not hold them; make "
            f"them with: dvidshards downsample {source} DEST)")


def not_exported_error(store, index: int, held) -> NotExportedError:
    """The error of a scale the spec lists and the export does not hold (``held``: the scales it
    holds, None: not known); it names the command that makes it."""
    root = store.describe("")
    source = getattr(store, "base", store).describe("")
    has = f"; it holds {scales_phrase(held)}" if held is not None else ""
    return NotExportedError(f"scale {index} is not exported in {root} (it has no folder s{index}{has}); make it "
                            f"with: dvidshards downsample {source} DEST")
