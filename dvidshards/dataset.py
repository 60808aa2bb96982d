"""A whole export: its scales and their geometry, shards, volumes and bulk reads.

Geometry comes from the neuroglancer multiscale spec given to DVID's export-shards (``spec=``),
an ``info`` file in the export, or a folder of consolidated indexes.  Without any of them it is
inferred from the files, and said so: ``open`` warns (``GeometryWarning``) with what it
guessed, ``Scale.inferred`` names it, units are unknown unless ``resolution=`` is given, and a
chunk that could belong to a missing shard file is never read as background on a guess.
"""

from __future__ import annotations

import asyncio
import builtins
import itertools
import math
import os
import re
import warnings

import numpy as np
import tensorstore as ts

from .arrays import to_dask as dask_array
from .bodies import Body
from .consolidated import ConsolidatedIndex, consolidated_paths, scales_from_consolidated
from .errors import ChunkIndexError, GeometryWarning, MissingShardError, SpecError
from .formats.labels import as_labels
from .formats.multiscale import SINGLE_SHARD, Scale, multiscale_info, parse_json, parse_multiscale
from .query import BodyIndex, BodyMask, body_mask, chunks_with, labels_in_box
from .read import ChunkReader, check_scale, read_box
from .shard import (
    ScaleFiles,
    Shard,
    load_shard_sync,
    parse_shard_names,
    sample_scale,
    scale_folders,
)
from .sources import RecordSource, record_source_of
from .stores import ByteStore, as_store

__all__ = ["Dataset", "Scale", "open", "shard_origins"]

def shard_origins(store, folder: str) -> list[tuple[int, int, int]]:
    """Voxel origins of the shard files in one scale folder (lists it; nothing is checked)."""
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
    source : str, path, URL, kvstore spec dict or ByteStore
        The export root (holding ``s0``, ``s1``, ...).
    spec : dict or path, optional
        The neuroglancer multiscale spec given to DVID's export-shards (``mcns-ng-specs.json``).
        Default: an ``info`` file at the root, else the geometry saved in ``index``, else
        geometry inferred from the files (with a ``GeometryWarning``).
    index : path, optional
        A folder of consolidated indexes (``dvidshards consolidate``): shards are located
        without reading their own indexes, and geometry comes with them.
    resolution : (x, y, z), optional
        Scale 0's voxel size in nm when geometry is inferred (scale k: 2**k times it).
    policy : "eager", "lazy" or None
        Shard validation policy (None: eager for local files and memory, lazy for remote).

    Notes
    -----
    The geometry is checked against the export's files, by name only: a shard file off a
    scale's shard grid, or outside its volume, is a SpecError naming it (the spec is another
    volume's), and a scale the spec lists but the export has no folder for is a SpecError
    (reads: unless ``fill_missing_shards``).  Jobs check when they list a scale (``shards``);
    ``open``/``read`` check a sample of a local folder's names at once, and each process
    looks for off-grid files next to the first shards it loads (a remote listing is slow).
    """

    def __init__(self, source, *, spec=None, index=None, resolution=None, policy: str | None = None):
        source = record_source_of(source, spec) or source
        self.store: ByteStore | RecordSource = source if isinstance(source, RecordSource) else as_store(source)
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
        self._readers: dict = {}
        self._files: dict[int, ScaleFiles] = {}
        self._sampled: dict[int, bool | None] = {}

    def __getstate__(self):
        d = self.__dict__.copy()
        d["_readers"] = {}
        d["_files"] = {}  # never ship listings with tasks: each process checks once
        d["_sampled"] = {}
        return d

    def __repr__(self) -> str:
        return f"Dataset({self.store.describe('')!r}, scales={[s.index for s in self.scales]})"

    @property
    def source(self) -> ByteStore | RecordSource:
        """The byte store of the export (same as ``store``)."""
        return self.store

    # --- geometry ----------------------------------------------------------------------------

    def _infer(self, res0) -> list[Scale]:
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
            g = 0
            for o in origins:
                for v in o:
                    g = math.gcd(g, v)
            extent = g or SINGLE_SHARD
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
            hx, hy, hz = (int(v) * 64 for v in np.maximum(hi, 1))
            size = (hx, hy, hz)
            inferred = ("size", "shard_extent") + (() if res is not None else ("resolution",))
            proven = min(extent, 64 * (1 << (span - 1).bit_length())) if span else 64
            s = Scale(k, size, res, extent, key=f"s{k}", inferred=inferred, proven_extent=proven)
            scales.append(s)
            warnings.warn(f"{store.describe(s.folder)}: no spec or info file: guessed shard size {extent if extent < SINGLE_SHARD else 'one shard'}"
                          f" from {len(origins)} file names and volume size {size} from the last shards' records"
                          f"{'' if res is not None else '; units unknown'}. Pass spec= (the neuroglancer spec "
                          f"given to DVID's export-shards) for exact geometry", GeometryWarning, stacklevel=3)
        if not scales:
            raise SpecError(f"{store.describe('')}: no shard files in any scale folder")
        return scales

    def scale(self, which=0, *, resolution=None) -> Scale:
        """A scale by folder number (``k`` is ``s{k}``) or by ``resolution=(x, y, z)`` in nm."""
        if resolution is not None or isinstance(which, (tuple, list, np.ndarray)):
            res = _resolution(resolution if resolution is not None else which, "scale")
            for s in self.scales:
                if s.resolution is not None and res is not None and np.allclose(s.resolution, res):
                    return s
            raise SpecError(f"no scale has resolution {res}; resolutions are "
                            f"{ {s.index: s.resolution for s in self.scales} }")
        if isinstance(which, Scale):
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

    def files(self, scale=0, *, refresh: bool = False) -> ScaleFiles:
        """A listing of a scale's folder, checked (``read.check_scale``); kept for this Dataset.

        Shard files off the scale's shard grid or outside its volume are a SpecError naming
        one (the spec is not the export's), and a consolidated index that lists other shard
        files than the folder holds is stale (ChunkIndexError).  Names only, no file is read.
        ``shards`` (every job) lists again each time; a read lists only with a consolidated
        index (once), else it checks a sample of names at open and probes next to the first
        shards it loads (see ``ChunkReader``): a listing of a 26,500-shard scale costs ~70 ms.
        """
        s = self.scale(scale)
        f = self._files.get(s.index)
        if f is None or refresh:
            f = self.store._sync(check_scale(self.store, s, self._consolidated(s), self.geometry))
            self._files[s.index] = f
        return f

    def shards(self, scale=0) -> list[tuple[int, int, int]]:
        """Voxel origins of the shard files present at a scale.

        A folder listing, checked (``files``): a scale the export has no folder for is a
        SpecError.  A store that cannot list (http) takes them from the consolidated index, or
        else probes every origin of the spec's shard grid.
        """
        s = self.scale(scale)
        if isinstance(self.store, RecordSource):
            return sorted(self.store.shard_origins(s))
        f = self.files(s, refresh=True)
        f.require_folder()
        if f.origins is not None:
            return list(f.origins)
        ci = self._consolidated(s)
        if ci is not None:
            return sorted(ci.shards)
        if "shard_extent" in s.inferred:
            raise SpecError(f"{self.store.describe(s.folder)}: this store cannot list folders; give the export's "
                            f"neuroglancer spec (spec=...) or a consolidated index (index=...)")
        return self._probe(s)

    def _probe(self, s: Scale) -> list[tuple[int, int, int]]:
        """Origins of the shard grid whose files exist (concurrent existence checks)."""
        n = [max(1, -(-(o + z) // min(s.shard_extent, SINGLE_SHARD)))
             for o, z in zip(s.voxel_offset, s.size, strict=True)]
        e = min(s.shard_extent, SINGLE_SHARD)
        grid = [(x * e, y * e, z * e) for x, y, z in itertools.product(*(range(k) for k in n))]
        if len(grid) > 1_000_000:
            raise SpecError(f"{self.store.describe(s.folder)}: cannot list this store and the shard grid has "
                            f"{len(grid)} origins; use a consolidated index (index=...)")
        store = self.store

        async def probe():
            sem = asyncio.Semaphore(64)

            async def one(o):
                async with sem:
                    return o if await store.exists(s.stem(o) + ".arrow") else None

            return await asyncio.gather(*(one(o) for o in grid))

        found = store._sync(probe())
        return sorted(o for o in found if o is not None)

    def shard(self, scale, origin, *, policy: str | None = None, consolidated: bool = True) -> Shard:
        """The loaded, checked shard at a voxel origin (MissingShardError if its file is absent)."""
        s = self.scale(scale)
        o = tuple(int(v) for v in origin)
        if not s.is_origin(o):
            raise MissingShardError(f"{self.store.describe(s.stem(o) + '.arrow')}: origin {o} is not on the shard "
                                    f"grid (shard extent {s.shard_extent} voxels)")
        f = self._files.get(s.index)
        if (f.folder if f is not None else self._sample(s)) is False:
            self._no_folder(s)
        if consolidated and self.index is not None and policy is None:
            return self.reader(s).cache.get_sync(o) or _missing(self, s, o)
        return load_shard_sync(self.store, s, o, policy=policy or self.policy)

    def chunks(self, scale=0) -> np.ndarray:
        """Every chunk coordinate present at a scale, (n, 3) x, y, z (fast with a consolidated index)."""
        s = self.scale(scale)
        ci = self._consolidated(s)
        if ci is not None:
            self.files(s).require_folder()
            return ci.chunks()
        parts = [self.shard(s, o).coords for o in self.shards(s)]
        return np.concatenate(parts) if parts else np.zeros((0, 3), np.int64)

    # --- volumes -----------------------------------------------------------------------------

    def reader(self, scale=0, labels="agglomerated", *, fill_missing_shards: bool = False,
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

    def _new_reader(self, s: Scale, labels, fill_missing_shards: bool, max_shards: int) -> ChunkReader:
        """A reader of a scale whose files were checked here, so that a wrong geometry fails at open.

        A full check when this Dataset listed the scale (``shards``) or has its consolidated
        index (``files``: listed once, compared with the index); else the cheap sample of
        ``_sample`` (the reader then probes next to its first shards, see ``ChunkReader``).
        """
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
        """The SpecError of a scale the export has no folder for."""
        assert isinstance(self.store, ByteStore)
        others = self.store._sync(scale_folders(self.store))
        ScaleFiles(s, self.store.describe(s.folder), None, False, others).require_folder()

    def _sample(self, s: Scale) -> bool | None:
        """``shard.sample_scale`` once per scale: whether the folder exists (None: unknown)."""
        if s.index not in self._sampled:
            self._sampled[s.index] = self.store._sync(sample_scale(self.store, s, self.geometry))
        return self._sampled[s.index]

    def read(self, box, scale=0, labels="agglomerated", out=None, threads: int | None = None, *,
             fill_missing_shards: bool = False) -> np.ndarray:
        """Decode a voxel box straight into an (x, y, z) uint64 array, in parallel (the bulk reader).

        Parameters
        ----------
        box : [[x0, y0, z0], [x1, y1, z1]]
            Voxels, any alignment, inside the scale's volume.
        scale : int or Scale
            Folder number.
        labels : "agglomerated", "supervoxels" or a mapping
        out : numpy.ndarray, optional
            Destination of shape (x1-x0, y1-y0, z1-z0): F-ordered, or C-ordered so that ``.T``
            is (z, y, x); default a new F-ordered array. Reusing an array: allocate it with
            ``dvidshards.read.aligned_empty(shape)`` (64-byte aligned), into which decoding is
            ~5% faster than into ``np.empty`` (whose rows straddle cache lines).
        threads : int, optional
            Decoding threads (default: all cores).
        """
        return read_box(self.reader(scale, labels, fill_missing_shards=fill_missing_shards), box, out, threads)

    def open(self, scale=0, *, labels="agglomerated", fill_missing_shards: bool = False, context=None,
             max_shards: int = 64) -> ts.TensorStore:
        """The scale as a ``tensorstore.TensorStore``; see ``dvidshards.open``."""
        s = self.scale(scale)
        reader = self._new_reader(s, as_labels(labels), fill_missing_shards, max_shards)
        kwargs = {} if context is None else {"context": context}
        units = [ts.Unit(r, "nm") for r in s.resolution] if s.resolution is not None else None
        return ts.virtual_chunked(
            reader,
            dtype=ts.uint64,
            domain=ts.IndexDomain(labels=["x", "y", "z"], inclusive_min=list(s.voxel_offset), shape=list(s.size)),
            chunk_layout=ts.ChunkLayout(read_chunk_shape=list(s.chunk_size), grid_origin=[0, 0, 0],
                                        inner_order=[2, 1, 0]),
            dimension_units=units,
            **kwargs,
        )

    # --- queries (implemented in dvidshards.query, one layer below) -----------------------------

    def labels(self, box, scale=0, labels="agglomerated") -> np.ndarray:
        """Sorted unique ids in a voxel box; whole chunks from their label lists, cut chunks decoded."""
        return labels_in_box(self, box, scale, labels)

    def chunks_with(self, ids, scale=0, labels="agglomerated") -> np.ndarray:
        """(n, 3) chunk coordinates whose label lists hold any of ids (no decompression)."""
        return chunks_with(self, ids, scale, labels)

    def body_index(self, path) -> BodyIndex:
        """The label index written by ``dvidshards label-index``, for per-body look-ups."""
        return BodyIndex(path)

    def body_mask(self, body, scale=0, labels="agglomerated", index=None) -> BodyMask:
        """A body's voxels as a boolean mask over its bounding box, decoding only its chunks."""
        return body_mask(self, body, scale, labels=labels, index=index)

    def body(self, id, scale=0, labels="agglomerated", index=None) -> Body:  # noqa: A002 - DVID's name
        """One body on demand: chunks, size, box, mask, DVID sparsevol, mesh (``dvidshards.bodies.Body``)."""
        return Body(self, id, scale, labels, index=index)

    def to_dask(self, scale=0, labels="agglomerated", *, chunks=None, box=None, fill_missing_shards: bool = False):
        """A scale as a lazy dask array (x, y, z) over the bulk reader, one read per chunk-aligned block
        (needs ``dvidshards[dask]``)."""
        return dask_array(self, scale, labels, chunks=chunks, box=box, fill_missing_shards=fill_missing_shards)


def _missing(ds: Dataset, s: Scale, o) -> Shard:
    raise MissingShardError(f"{ds.store.describe(s.stem(o) + '.arrow')}: no such shard file")


def open(source, *, scale=0, labels="agglomerated", fill_missing_shards: bool = False, context=None,
         spec=None, index=None, resolution=None, max_shards: int = 64) -> ts.TensorStore:
    """Open one scale of a DVID export as a read-only ``tensorstore.TensorStore``.

    Parameters
    ----------
    source : str, path, URL, kvstore spec dict, ByteStore or Dataset
        The export root (holding ``s0``, ``s1``, ...).
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

