"""A whole export: its scales and their geometry, shards, volumes and bulk reads.

Geometry comes from the neuroglancer spec given to DVID's export-shards (``spec=``), the export's
``info``, or a folder of consolidated indexes; else it is inferred from the files, and said so
(``GeometryWarning``, ``Scale.inferred``; units unknown unless ``resolution=``), and a chunk that
could belong to a missing shard file is never read as background on a guess.
"""

from __future__ import annotations

import asyncio
import builtins
import itertools
import math
import os
import re
import sys
import warnings
from types import FrameType
from typing import Any

import numpy as np
import tensorstore as ts

from .arrays import to_dask as dask_array
from .bodies import Body
from .consolidated import ConsolidatedIndex, consolidated_paths, scales_from_consolidated
from .errors import (
    ChunkIndexError,
    GeometryWarning,
    IncompleteScalesWarning,
    MissingShardError,
    SpecError,
)
from .formats.labels import as_labels
from .formats.multiscale import SINGLE_SHARD, Scale, multiscale_info, parse_json, parse_multiscale
from .protocol import DatasetLike
from .pyramid import MANIFEST, Layer, LayeredStore, drive_all, given_roots, present_scales, roots_of
from .query import BodyIndex, BodyMask, body_mask, chunks_with, label_at, labels_in_box, unique
from .query import mapping as export_mapping
from .read import ChunkReader, check_scale, read_box
from .scalefiles import (
    ScaleFiles,
    check_origins,
    not_exported_error,
    parse_shard_names,
    sample_scale,
    scale_folders,
    scale_naming,
    scales_phrase,
)
from .shard import Shard, load_shard_sync
from .sources import RecordSource, record_source_of
from .stores import ByteStore, as_store

__all__ = ["Dataset", "IncompleteScalesWarning", "LayeredStore", "Scale", "open", "shard_origins"]


def _caller_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside dvidshards (the user's)."""
    level = 1
    f: FrameType | None = sys._getframe(2)  # whoever called the function warning
    while f is not None and f.f_globals.get("__name__", "").partition(".")[0] == "dvidshards":
        f = f.f_back
        level += 1
    return level + 1


def shard_origins(store: Any, folder: str) -> list[tuple[int, int, int]]:
    """Voxel origins of the shard files in one scale folder (a listing, nothing checked)."""
    return parse_shard_names(store.list_sync(folder))


def _load_spec(spec, store) -> tuple[dict | None, str]:
    if spec is None and isinstance(store, RecordSource):
        raise SpecError(f"{store.describe('')}: give the neuroglancer multiscale spec of these records (spec=...)")
    if spec is None:
        try:
            data = store.read_sync("info")
        except MissingShardError:
            return None, ""
        return parse_json(bytes(data), store.describe("info")), store.describe("info")
    if isinstance(spec, dict):
        return spec, "spec"
    path = os.fspath(spec)
    try:
        with builtins.open(path, "rb") as f:
            return parse_json(f.read(), path), path
    except OSError as e:
        raise SpecError(f"{path}: cannot read spec ({e.strerror or e})") from None


def _resolution(resolution, where: str) -> tuple[float, float, float] | None:
    if resolution is None:
        return None
    if isinstance(resolution, (int, float, np.number)):
        raise SpecError(f"{where}: resolution must be (x, y, z) in nm, e.g. (8, 8, 8), got {resolution!r}")
    try:
        r = tuple(float(v) for v in resolution)
    except (TypeError, ValueError):
        r = ()
    if len(r) != 3 or not all(v > 0 and math.isfinite(v) for v in r):
        raise SpecError(f"{where}: resolution must be three positive numbers (nm), got {resolution!r}")
    return r


class Dataset:
    """An export: its scales, their geometry, shards and volumes.

    Parameters
    ----------
    source : str, path, URL, kvstore spec dict or ByteStore, or a list of them
        The export root (holding ``s0``, ``s1``, ...). Several roots are one pyramid: scale ``k``
        from the first root holding ``s{k}``. A downsample output is read over the source its
        manifest names: ``Dataset(dest)`` is the whole pyramid (``IncompleteScalesWarning`` when
        its scales are not complete).
    spec : dict or path, optional
        The neuroglancer spec given to DVID's export-shards. Default: the root's ``info``, else
        the geometry saved in ``index``, else inferred from the files (``GeometryWarning``).
    index : path, optional
        A folder of consolidated indexes (``dvidshards consolidate``): shards located without
        reading their own indexes, geometry with them.
    resolution : (x, y, z), optional
        Scale 0's voxel size in nm when geometry is inferred.
    policy : "eager", "lazy" or None
        Shard validation (None: eager for local files and memory, lazy for remote).

    Notes
    -----
    An export holds a prefix of its spec's scales (DVID exports scale 0 only by default):
    ``exported`` lists them, ``require_scale(k)`` is the check every read and job makes
    (``NotExportedError``). Where DVID's two shard-file naming generations differ (FORMATS.md §3a),
    each scale's is read from its file names at open (``Scale.naming``). File names are checked
    against the geometry: a shard file off a scale's grid or outside its volume is a SpecError
    naming it. Jobs check when they list a scale (``shards``); reads check a sample of names at
    open and look next to the first shards they load (a remote listing is slow).
    """

    def __init__(self, source: Any, *, spec: Any = None, index: Any = None, resolution: Any = None,
                 policy: str | None = None):
        layers = self._open_roots(source, spec)
        self.index = os.fspath(index) if index is not None else None
        if self.index is not None and not os.path.isdir(self.index):
            raise ChunkIndexError(f"{self.index}: no such folder of consolidated indexes (index=...)")
        if policy not in (None, "eager", "lazy"):
            raise SpecError(f"policy must be 'eager', 'lazy' or None, got {policy!r}")
        self.policy = policy
        res0 = _resolution(resolution, "resolution")
        if spec is None and isinstance(self.store, RecordSource) and self.store.spec is not None:
            spec = self.store.spec
        raw, where = _load_spec(spec, self.store)
        saved = scales_from_consolidated(self.index) if raw is None and self.index is not None else None
        self._exported: tuple[int, ...] | None = None
        self._filled: frozenset[int] = frozenset()
        self._listed: dict[int, bool] = {}  # scale folders a listing at open found (True) or not (False)
        self._seen: dict[int, builtins.list] = {}  # shard origins the naming detection saw, checked at first use
        if layers is not None:
            folders = [s.index for s in (parse_multiscale(raw, where) if raw is not None else saved[1]
                                         if saved is not None else [])] or None
            self._route(layers, folders)
        self.spec: dict | None
        if raw is not None:
            self.spec = raw
            self.scales = parse_multiscale(raw, where)
            self.geometry = ("the spec" if where == "spec" else f"the info file {where}"
                             if spec is None else f"the spec {where}")
        elif saved is not None:
            self.spec, self.scales = saved
            self.geometry = f"the geometry saved in the consolidated index {self.index}"
        else:
            self.spec = None
            self.scales = self._infer(res0)
            self.geometry = "the geometry inferred from the file names"
        self.scales = self._named(self.scales)
        self._readers: dict = {}
        self._files: dict[int, ScaleFiles] = {}
        self._sampled: dict[int, bool | None] = {}
        #: the scale numbers this export holds, ascending
        self.exported: tuple[int, ...] = self._exported if self._exported is not None else self._find_exported()

    def _open_roots(self, source: Any, spec: Any) -> builtins.list[Layer] | None:
        """Set ``store``; the layers of several roots (None: one plain root)."""
        roots = builtins.list(source) if isinstance(source, (builtins.list, tuple)) else [source]
        if not roots:
            raise SpecError("give an export root (or a list of them)")
        if len(roots) == 1:
            one = record_source_of(roots[0], spec) or roots[0]
            if isinstance(one, RecordSource):
                self.store: ByteStore | RecordSource = one
                return None
            store = as_store(one)
            layers = roots_of(store)
            if len(layers) == 1:
                self.store = store
                return None
        else:
            for r in roots:
                if isinstance(r, RecordSource) or record_source_of(r, spec) is not None:
                    raise SpecError(f"{r!r}: a record source cannot be one of several roots; give export folders")
            layers = given_roots([as_store(r) for r in roots])
        self.store = LayeredStore([st for st, _, _ in layers])
        for st, _, m in layers:
            if m is not None and not m["complete"]:
                warnings.warn(f"{st.describe('')}: the downsampled scales {scales_phrase(m['scales'])} are not "
                              f"complete ({MANIFEST} says complete: false): chunks of the shards not made yet are "
                              f"missing; finish them by running the same dvidshards downsample command with --resume",
                              IncompleteScalesWarning, stacklevel=_caller_stacklevel())
        return layers

    def _route(self, layers: builtins.list[Layer], indices: builtins.list[int] | None) -> None:
        """Give each scale a root: a downsample output's own (remade) scales first, outermost first;
        every other scale the first root holding its folder."""
        assert isinstance(self.store, LayeredStore)
        route: dict[int, int] = {}
        for i in reversed(range(len(layers))):
            st, held, m = layers[i]
            if m is not None and held is not None:
                for k in sorted(held):
                    route.setdefault(k, i)
        for i, (st, held, _) in enumerate(layers):
            if held is None:
                if indices is None:  # geometry inferred from the folders: every root is listed
                    names = st.list_sync("")
                    held = frozenset(int(n[1:]) for n in names if re.fullmatch(r"s[0-9]+", n))
                else:
                    held = frozenset(st._sync(present_scales(st, indices, {})))
            for k in sorted(held):
                route.setdefault(k, i)
        self.store.route = route
        self._exported = tuple(sorted(route))
        # the scales of a complete downsample output: a shard file it did not write holds only background
        made = [m is not None and m["complete"] for _, _, m in layers]
        self._filled = frozenset(k for k, i in route.items() if made[i])

    def __getstate__(self) -> dict:
        # never ship readers or listings with tasks: each process checks once
        return {**self.__dict__, "_readers": {}, "_files": {}, "_sampled": {}, "_listed": {}, "_seen": {}}

    def __repr__(self) -> str:
        return f"Dataset({self.store.describe('')!r}, scales={[s.index for s in self.scales]})"

    # --- which scales, and how their files are named ---------------------------------------------

    def _find_exported(self) -> tuple[int, ...]:
        """The scales one root holds (elsewhere ``pyramid.present_scales``; a store that cannot list: every one)."""
        indices = [s.index for s in self.scales]
        if isinstance(self.store, RecordSource):  # a source says what it holds (None: every scale)
            held = self.store.exported
            return tuple(indices) if held is None else tuple(k for k in indices if k in held)
        if all("shard_extent" in s.inferred for s in self.scales):
            return tuple(indices)
        if self.store.immediate:  # a stat per scale folder: a read lists only the folder it reads
            return tuple(k for k in indices if self.store.is_folder_sync(f"s{k}"))
        try:
            return tuple(sorted(self.store._sync(present_scales(self.store, indices, dict(self._listed)))))
        except SpecError:  # a store that cannot list (http): every scale of the spec is taken as there
            return tuple(indices)

    def require_scale(self, scale: Any = 0) -> Scale:
        """The scale, or ``NotExportedError`` (one line naming how to make it) when the export does
        not hold it."""
        s = self.scale(scale)
        if s.index not in self.exported:
            raise not_exported_error(self.store, s.index, self.exported)
        return s

    def with_scales(self, root: Any, scales: Any) -> Dataset:
        """This dataset with ``scales`` read from ``root`` (made there, today's naming): ``convert``
        of a partial export. Unlike ``Dataset([export, root])`` no manifest is followed."""
        if isinstance(self.store, RecordSource):
            raise SpecError(f"{self.store!r}: a record source cannot be read with other roots")
        if isinstance(self.store, LayeredStore):
            stores, route = builtins.list(self.store.stores), dict(self.store.route)
        else:
            stores, route = [self.store], {k: 0 for k in self.exported}
        stores.append(as_store(root))
        for k in scales:
            self.scale(k)  # a scale the spec does not list: SpecError
            route[int(k)] = len(stores) - 1
        ds = Dataset(LayeredStore(stores, route), spec=self.spec, index=self.index, policy=self.policy)
        ds._filled = self._filled | frozenset(int(k) for k in scales)  # made whole: an absent file is background
        return ds

    def _named(self, scales: builtins.list[Scale]) -> builtins.list[Scale]:
        """The scales with their files' naming generation where DVID's two differ (a few coarse
        scales; a consolidated index's shard list instead of a listing)."""
        todo = [s for s in scales if s.namings_differ and "shard_extent" not in s.inferred]
        if not todo or isinstance(self.store, RecordSource):
            return scales
        if self._exported is not None:  # several roots: only the scales some root holds
            todo = [s for s in todo if s.index in self._exported]
        given = {}
        for s in todo:
            ci = self._consolidated(s)
            given[s.index] = ci.shards if ci is not None else None
        store = self.store
        found = drive_all(store, (scale_naming(store, s, given[s.index]) for s in todo))
        named = {}
        for s, (naming, seen) in zip(todo, found, strict=True):
            if seen is not None:
                self._seen[s.index] = seen
                if seen:
                    self._listed[s.index] = True
                elif not store.immediate:  # an object store's empty listing: no such folder
                    self._listed[s.index] = False
            if naming is not None:
                named[s.index] = s.with_naming(naming)
        return [named.get(s.index, s) for s in scales]

    # --- geometry ----------------------------------------------------------------------------

    def _infer(self, res0: Any) -> list[Scale]:
        store = self.store
        try:
            names = store.list_sync("")
        except SpecError:
            raise SpecError(f"{store.describe('')}: this store cannot list folders; give the export's "
                            f"neuroglancer spec (spec=...) or put an 'info' file at its root") from None
        folders = sorted(int(n[1:]) for n in names if re.fullmatch(r"s[0-9]+", n))
        if not folders:
            raise SpecError(f"{store.describe('')}: no scale folders s0, s1, ... found")
        scales = []
        for k in folders:
            origins = shard_origins(store, f"s{k}")
            if not origins:
                continue
            extent = math.gcd(*(v for o in origins for v in o)) or SINGLE_SHARD
            res = tuple(r * 2 ** k for r in res0) if res0 is not None else None
            probe = Scale(k, (1, 1, 1), res, extent, key=f"s{k}")
            assert isinstance(store, ByteStore)
            # the volume ends in the shards at the largest origin along each axis: load those
            top = np.max(origins, axis=0)
            hi = np.zeros(3, np.int64)
            span = 0  # chunks from its origin that a loaded shard's records reach
            for o in (o for o in origins if any(v == t for v, t in zip(o, top, strict=True))):
                shard = load_shard_sync(store, probe, o, policy=self.policy)
                if len(shard):
                    hi = np.maximum(hi, shard.coords.max(axis=0) + 1)
                    span = max(span, int(shard.extent().max()))
            x, y, z = (int(v) * 64 for v in np.maximum(hi, 1))
            inferred = ("size", "shard_extent") + (() if res is not None else ("resolution",))
            proven = min(extent, 64 * (1 << (span - 1).bit_length())) if span else 64
            scales.append(Scale(k, (x, y, z), res, extent, key=f"s{k}", inferred=inferred, proven_extent=proven))
        if not scales:
            raise SpecError(f"{store.describe('')}: no shard files in any scale folder")
        warnings.warn(f"{store.describe('')}: no spec or info file: each scale's shard size and volume size are "
                      f"guessed from its file names{'' if res0 is not None else '; units unknown'} (dvidshards "
                      f"info shows them). Pass spec= (the neuroglancer spec given to DVID's export-shards) for exact "
                      f"geometry", GeometryWarning, stacklevel=_caller_stacklevel())
        return scales

    def scale(self, which: Any = 0, *, resolution: Any = None) -> Scale:
        """A scale by folder number (``k`` is ``s{k}``) or by ``resolution=(x, y, z)`` in nm."""
        if resolution is not None or isinstance(which, (tuple, list, np.ndarray)):
            res = _resolution(resolution if resolution is not None else which, "scale")
            for s in self.scales:
                if s.resolution is not None and res is not None and np.allclose(s.resolution, res):
                    return s
            raise SpecError(f"no scale has resolution {res}; resolutions are "
                            f"{ {s.index: s.resolution for s in self.scales} }")
        if isinstance(which, Scale):  # one of ours; or the same scale parsed from the spec: ours (its naming)
            mine = next((s for s in self.scales if s.index == which.index), None)
            if mine is not None and which.with_naming(mine.naming) == mine:
                return mine
            return which
        if isinstance(which, (int, np.integer)) and not isinstance(which, bool):
            for s in self.scales:
                if s.index == which:
                    return s
            raise SpecError(f"scale {which} (folder s{which}) does not exist; scales are "
                            f"{[s.index for s in self.scales]}")
        raise SpecError(f"scale must be a folder number k (for s{{k}}) or resolution=(x, y, z); got {which!r}")

    @property
    def info(self) -> dict:
        """The neuroglancer ``info`` of the export (``"inferred"`` lists guessed fields per scale)."""
        info = multiscale_info(self.scales)
        for entry, s in zip(info["scales"], self.scales, strict=True):
            if s.inferred:
                entry["inferred"] = list(s.inferred)
        return info

    # --- shards ------------------------------------------------------------------------------

    def _consolidated(self, s: Scale) -> ConsolidatedIndex | None:
        if self.index is not None and os.path.exists(consolidated_paths(self.index, s.folder)[0]):
            return ConsolidatedIndex(self.index, s.folder)
        return None

    def files(self, scale: Any = 0, *, refresh: bool = False) -> ScaleFiles:
        """A scale folder's listing, checked against the geometry and a consolidated index
        (``read.check_scale``: names only), kept for this Dataset. A listing of a 26,500-shard
        scale costs ~70 ms: ``shards`` (jobs) lists each time, a read only with a consolidated index."""
        s = self.scale(scale)
        f = self._files.get(s.index)
        if f is None or refresh:
            f = self.store._sync(check_scale(self.store, s, self._consolidated(s), self.geometry))
            self._files[s.index] = f
        return f

    def shards(self, scale: int | Scale = 0) -> builtins.list[tuple[int, int, int]]:
        """Voxel origins of the shard files at a scale (``files``; NotExportedError for a scale not
        held). A store that cannot list takes them from the consolidated index, else probes every
        origin of the shard grid."""
        s = self.scale(scale)
        if isinstance(self.store, RecordSource):
            return sorted(self.store.shard_origins(s))
        self.require_scale(s)
        f = self.files(s, refresh=True)
        if s.index in self._filled and f.folder is False:
            return []
        f.require_folder()
        if f.origins is not None:
            return builtins.list(f.origins)
        ci = self._consolidated(s)
        if ci is not None:
            return sorted(ci.shards)
        if "shard_extent" in s.inferred:
            raise SpecError(f"{self.store.describe(s.folder)}: this store cannot list folders; give the export's "
                            f"neuroglancer spec (spec=...) or a consolidated index (index=...)")
        return self._probe(s)

    def _probe(self, s: Scale) -> builtins.list[tuple[int, int, int]]:
        """Origins of the shard grid whose files exist (checked concurrently)."""
        n = [max(1, -(-(o + z) // min(s.shard_extent, SINGLE_SHARD)))
             for o, z in zip(s.voxel_offset, s.size, strict=True)]
        e = min(s.shard_extent, SINGLE_SHARD)
        grid = [(x * e, y * e, z * e) for x, y, z in itertools.product(*(range(k) for k in n))]
        if len(grid) > 1_000_000:
            raise SpecError(f"{self.store.describe(s.folder)}: cannot list this store and the shard grid has "
                            f"{len(grid)} origins; use a consolidated index (index=...)")
        store = self.store

        async def probe() -> builtins.list:
            sem = asyncio.Semaphore(64)

            async def one(o: tuple[int, int, int]) -> tuple[int, int, int] | None:
                async with sem:
                    return o if await store.exists(s.stem(o) + ".arrow") else None

            return await asyncio.gather(*(one(o) for o in grid))

        found = store._sync(probe())
        return sorted(o for o in found if o is not None)

    def shard(self, scale: int | Scale, origin: Any, *, policy: str | None = None, consolidated: bool = True) -> Shard:
        """The loaded, checked shard at a voxel origin (MissingShardError if its file is absent)."""
        s = self.scale(scale)
        o = tuple(int(v) for v in origin)
        if not s.is_origin(o):
            raise MissingShardError(f"{self.store.describe(s.stem(o) + '.arrow')}: origin {o} is not on the shard "
                                    f"grid (shard extent {s.shard_extent} voxels)")
        f = self._files.get(s.index)
        if s.index not in self.exported or (s.index not in self._filled and
                                            (f.folder if f is not None else self._sample(s)) is False):
            self._no_folder(s)
        if consolidated and self.index is not None and policy is None:
            return self.reader(s).cache.get_sync(o) or _missing(self, s, o)
        return load_shard_sync(self.store, s, o, policy=policy or self.policy)

    def chunks(self, scale: int | Scale = 0) -> np.ndarray:
        """Every chunk coordinate present at a scale, (n, 3) x, y, z (fast with a consolidated index)."""
        s = self.scale(scale)
        ci = self._consolidated(s)
        if ci is not None:
            self.files(s).require_folder()
            return ci.chunks()
        parts = [self.shard(s, o).coords for o in self.shards(s)]
        return np.concatenate(parts) if parts else np.zeros((0, 3), np.int64)

    # --- volumes -----------------------------------------------------------------------------

    def reader(self, scale: int | Scale = 0, *, labels: Any = "agglomerated", fill_missing_shards: bool = False,
               max_shards: int = 64) -> ChunkReader:
        """The (cached) chunk reader of a scale and label source; its shard cache is shared."""
        s = self.scale(scale)
        src = as_labels(labels)
        key = (s.index, src, bool(fill_missing_shards), int(max_shards))
        r = self._readers.get(key)
        if r is None:
            r = self._new_reader(s, src, fill_missing_shards, max_shards)
            self._readers[key] = r
        return r

    def _new_reader(self, s: Scale, labels: Any, fill_missing_shards: bool, max_shards: int) -> ChunkReader:
        """A reader of a scale whose files were checked here (a wrong geometry fails at open): in
        full when listed (``files``), else ``_sample``. A scale a complete downsample output made
        reads a shard file it did not write as background."""
        if s.index in self._filled:
            self.require_scale(s)
            fill_missing_shards = True
        if not fill_missing_shards:
            self.require_scale(s)
        files = self._files.get(s.index)
        if files is None and self._consolidated(s) is not None:
            files = self.files(s)
        if files is not None:
            if not fill_missing_shards:
                files.require_folder()
        elif self._sample(s) is False and not fill_missing_shards:
            self._no_folder(s)
        r = ChunkReader(self.store, s, labels, fill_missing_shards=fill_missing_shards, max_shards=max_shards,
                        consolidated=self.index, policy=self.policy, geometry=self.geometry)
        if files is not None:
            r.checked(files)
        return r

    def _no_folder(self, s: Scale) -> None:
        held = self.exported if s.index not in self.exported else None
        if held is None and isinstance(self.store, ByteStore):
            folders = self.store._sync(scale_folders(self.store))
            held = None if folders is None else tuple(int(f[1:]) for f in folders)
        raise not_exported_error(self.store, s.index, held)

    def _sample(self, s: Scale) -> bool | None:
        """Whether the scale's folder exists (None: unknown), its names sampled and checked once
        (those the naming detection listed, when it did)."""
        if s.index not in self._sampled:
            seen = self._seen.get(s.index)
            if seen:
                check_origins(s, seen, self.store, self.geometry)
                self._sampled[s.index] = True
            else:
                self._sampled[s.index] = self.store._sync(sample_scale(self.store, s, self.geometry))
        return self._sampled[s.index]

    def read(self, box: Any, *, scale: int | Scale = 0, labels: Any = "agglomerated", out: np.ndarray | None = None,
             threads: int | None = None, fill_missing_shards: bool = False) -> np.ndarray:
        """Decode a voxel box straight into an (x, y, z) uint64 array, in parallel (the bulk reader).

        Parameters
        ----------
        box : [[x0, y0, z0], [x1, y1, z1]]
            Voxels, any alignment, inside the scale's volume.
        scale : int or Scale
            Folder number.
        labels : "agglomerated", "supervoxels" or a mapping
        out : numpy.ndarray, optional
            Of shape (x1-x0, y1-y0, z1-z0), F-ordered (or C-ordered, ``.T`` being (z, y, x));
            default a new F-ordered array. ``dvidshards.read.aligned_empty(shape)`` (64-byte
            aligned) decodes ~5% faster than ``np.empty``, whose rows straddle cache lines.
        threads : int, optional
            Decoding threads (default: all cores).
        """
        reader = self.reader(scale, labels=labels, fill_missing_shards=fill_missing_shards)
        return read_box(reader, box, out, threads)

    def open(self, scale: int | Scale = 0, *, labels: Any = "agglomerated", fill_missing_shards: bool = False,
             context: ts.Context | None = None, max_shards: int = 64) -> ts.TensorStore:
        """The scale as a ``tensorstore.TensorStore``; see ``dvidshards.open``."""
        s = self.scale(scale)
        reader = self._new_reader(s, as_labels(labels), fill_missing_shards, max_shards)
        kwargs: dict[str, Any] = {} if context is None else {"context": context}
        units = [ts.Unit(r, "nm") for r in s.resolution] if s.resolution is not None else None
        return ts.virtual_chunked(
            reader,
            dtype=ts.uint64,
            domain=ts.IndexDomain(labels=["x", "y", "z"], inclusive_min=builtins.list(s.voxel_offset),
                                  shape=builtins.list(s.size)),
            chunk_layout=ts.ChunkLayout(read_chunk_shape=builtins.list(s.chunk_size), grid_origin=[0, 0, 0],
                                        inner_order=[2, 1, 0]),
            dimension_units=units,
            **kwargs,
        )

    # --- queries (implemented in dvidshards.query, one layer below) -----------------------------

    def labels(self, box, *, scale: int | Scale = 0, labels: Any = "agglomerated") -> np.ndarray:
        """Sorted unique ids in a voxel box; whole chunks from their label lists, cut chunks decoded."""
        return labels_in_box(self, box, scale=scale, labels=labels)

    def chunks_with(self, ids, *, scale: int | Scale = 0, labels: Any = "agglomerated") -> np.ndarray:
        """(n, 3) chunk coordinates whose label lists hold any of ids (no decompression)."""
        return chunks_with(self, ids, scale=scale, labels=labels)

    def body_index(self, path: Any) -> BodyIndex:
        """The label index written by ``dvidshards label-index``, for per-body look-ups."""
        return BodyIndex(path)

    def body_mask(self, body: int, *, scale: int | Scale = 0, labels: Any = "agglomerated",
                  index: Any = None) -> BodyMask:
        """A body's voxels as a boolean mask over its bounding box, decoding only its chunks."""
        return body_mask(self, body, scale=scale, labels=labels, index=index)

    def body(self, id: int, *, scale: int | Scale = 0, labels: Any = "agglomerated", index: Any = None) -> Body:
        """One body on demand: chunks, size, box, mask, DVID sparsevol, mesh (``dvidshards.bodies.Body``)."""
        return Body(self, id, scale=scale, labels=labels, index=index)

    def to_dask(self, box=None, *, scale: int | Scale = 0, labels: Any = "agglomerated", chunks: Any = None,
                fill_missing_shards: bool = False) -> Any:
        """A scale (or ``box`` of it) as a lazy dask array (x, y, z) over the bulk reader, one read per
        chunk-aligned block (needs ``dvidshards[dask]``)."""
        return dask_array(self, scale, labels, chunks=chunks, box=box, fill_missing_shards=fill_missing_shards)

    def label_at(self, points, *, scale: int | Scale = 0, labels: Any = "agglomerated",
                 fill_missing_shards: bool = False) -> np.ndarray:
        """The ids at voxels ``(n, 3)`` x, y, z (DVID's ``/labels``; cloud-volume's ``download_point``)."""
        return label_at(self, points, scale=scale, labels=labels, fill_missing_shards=fill_missing_shards)

    def unique(self, box, *, scale: int | Scale = 0, labels: Any = "agglomerated", counts: bool = False,
               fill_missing_shards: bool = False) -> Any:
        """The ids in a voxel box, with voxel counts when ``counts`` (cloud-volume's ``unique``); solid
        chunks answer from their label lists."""
        return unique(self, box, scale=scale, labels=labels, counts=counts, fill_missing_shards=fill_missing_shards)

    def mapping(self, *, scale: int | Scale | None = None, supervoxels: Any = None, table: bool = False) -> Any:
        """The export's own supervoxel -> body pairs, from the records' two lists (DVID's ``/mappings``):
        a LabelMapping, or a table with ``table=True``."""
        return export_mapping(self, scale=scale, supervoxels=supervoxels, table=table)


def _is_dataset_like(ds: Dataset) -> DatasetLike:
    return ds  # mypy holds Dataset to the protocol


def _missing(ds: Dataset, s: Scale, o: Any) -> Shard:
    raise MissingShardError(f"{ds.store.describe(s.stem(o) + '.arrow')}: no such shard file")


def open(source: Any, *, scale: Any = 0, labels: Any = "agglomerated", fill_missing_shards: bool = False,
         context: ts.Context | None = None, spec: Any = None, index: Any = None, resolution: Any = None,
         max_shards: int = 64) -> ts.TensorStore:
    """Open one scale of a DVID export as a read-only ``tensorstore.TensorStore``.

    Parameters
    ----------
    source : str, path, URL, kvstore spec dict, ByteStore or Dataset, or a list of roots
        The export root, or several (see ``Dataset``).
    scale : int or (x, y, z)
        Folder number k (``s{k}``), or a resolution in nm.
    labels : "agglomerated", "supervoxels" or a mapping
        Voxel values: the records' agglomerated labels, the supervoxels, or a supervoxel →
        body mapping applied at read time (LabelMapping, dict, (n, 2) array, pandas Series or
        a mapping file); unmapped supervoxels keep their id.
    fill_missing_shards : bool
        Read a missing shard file as background instead of raising MissingShardError.
    context : tensorstore.Context, optional
        E.g. ``ts.Context({"data_copy_concurrency": {"limit": 8}})``.
    spec, index, resolution :
        See ``Dataset``.
    max_shards : int
        Shards kept loaded per process (LRU).

    Returns
    -------
    tensorstore.TensorStore
        uint64, dimensions ``["x", "y", "z"]``, 64³ chunks; read with ``order="F"`` for speed.
    """
    ds = source if isinstance(source, Dataset) else Dataset(source, spec=spec, index=index, resolution=resolution)
    return ds.open(scale, labels=labels, fill_missing_shards=fill_missing_shards, context=context,
                   max_shards=max_shards)

