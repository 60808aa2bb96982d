"""The TensorStore adapter: an export scale as a ``ts.virtual_chunked`` volume.

The read function is a picklable callable holding only the source, the scale's geometry and the
label choice; each process opens shards lazily on first touch.  Chunks are 64³ on a grid at the
origin with ``inner_order=[2, 1, 0]``, so ``array.T`` is DVID's own z, y, x order and the decoder
writes straight into TensorStore's buffer.
"""

from __future__ import annotations

import os

import numpy as np
import tensorstore as ts

from .dataset import Dataset, Scale
from .errors import MissingShardError, SpecError
from .index import ConsolidatedIndex, GlobalIndex, consolidated_paths
from .formats.mapping import LabelMapping
from .shardfile import AGGLOMERATED, MAPPED, SUPERVOXELS, ShardFile

__all__ = ["ChunkReader", "open", "open_scale"]


class ChunkReader:
    """``read_function`` of the virtual_chunked store (pickles without its open files)."""

    def __init__(self, source, scale: Scale, mode: int, mapping: LabelMapping | None = None,
                 fill_missing_shards: bool = False, max_shards: int = 64, consolidated: str | None = None):
        self.source = source
        self.consolidated = consolidated
        self.scale = scale
        self.mode = mode
        self.mapping = mapping
        self.fill_missing_shards = bool(fill_missing_shards)
        self.max_shards = int(max_shards)
        self._index: GlobalIndex | None = None
        self._consolidated = None

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_index"] = state["_consolidated"] = None
        return state

    def _open_index(self) -> GlobalIndex:
        if self._index is None:
            s = self.scale
            if self.consolidated is not None:
                self._consolidated = ConsolidatedIndex(self.consolidated, s.folder)
            self._index = GlobalIndex(self._load_shard, s.shard_extent, s.chunk_size, self.max_shards)
        return self._index

    def _load_shard(self, origin) -> ShardFile | None:
        s = self.scale
        stem = f"{s.folder}/{origin[0]}_{origin[1]}_{origin[2]}"
        given = None
        if self._consolidated is not None:
            given = self._consolidated.shard_index(origin)
            if given is None:
                return None  # the consolidated index lists every shard there is: none here
        try:
            return ShardFile(self.source, stem, s.chunk_size, box=s.shard_box(origin), index=given)
        except MissingShardError as e:
            if self.fill_missing_shards and not self.source.exists(stem + ".arrow"):
                return None
            raise MissingShardError(f"{e} (DVID writes no file for an all-background shard: "
                                    f"open with fill_missing_shards=True to read it as 0)") from None

    def shard(self, x: int, y: int, z: int) -> ShardFile | None:
        """The shard holding chunk (x, y, z) in this process (None: missing, filled with 0)."""
        return (self._index or self._open_index()).shard(x, y, z)

    def __call__(self, domain: ts.IndexDomain, array: np.ndarray, params=None) -> None:
        cx, cy, cz = self.scale.chunk_size
        o = domain.origin
        x, y, z = o[0] // cx, o[1] // cy, o[2] // cz
        index = self._index
        sf = (index if index is not None else self._open_index()).shard(x, y, z)
        if sf is None:
            array.fill(0)
        else:
            sf.read_into(x, y, z, array.T, self.mode, self.mapping)


def _label_mode(labels) -> tuple[int, LabelMapping | None]:
    if isinstance(labels, str) and labels in ("agglomerated", "supervoxels"):
        return (AGGLOMERATED if labels == "agglomerated" else SUPERVOXELS), None
    if isinstance(labels, (str, os.PathLike)) and not os.path.isfile(labels):
        raise SpecError(f"labels must be 'agglomerated', 'supervoxels' or a mapping (dict, array, Series "
                        f"or mapping file); {os.fspath(labels)!r} is none of these")
    return MAPPED, LabelMapping.from_any(labels)


def open_scale(dataset: Dataset, scale: Scale, *, labels="agglomerated", fill_missing_shards=False,
               context=None, max_shards: int = 64) -> ts.TensorStore:
    """Build the virtual_chunked store of one scale (see ``open``)."""
    mode, mapping = _label_mode(labels)
    if dataset.source.mappable:
        ci = dataset.index
        ci = ci if ci is not None and os.path.exists(consolidated_paths(ci, scale.folder)[0]) else None
        reader = ChunkReader(dataset.source, scale, mode, mapping, fill_missing_shards, max_shards, ci)
    else:
        from .remote import RemoteChunkReader  # byte-range reads, async
        reader = RemoteChunkReader(dataset.source, scale, mode, mapping, fill_missing_shards, max_shards)
    kwargs = {} if context is None else {"context": context}
    return ts.virtual_chunked(
        reader,
        dtype=ts.uint64,
        domain=ts.IndexDomain(labels=["x", "y", "z"], inclusive_min=list(scale.voxel_offset), shape=list(scale.size)),
        chunk_layout=ts.ChunkLayout(read_chunk_shape=list(scale.chunk_size), grid_origin=[0, 0, 0],
                                    inner_order=[2, 1, 0]),
        dimension_units=[ts.Unit(r, "nm") for r in scale.resolution],
        **kwargs,
    )


def open(source, *, scale=0, labels="agglomerated", fill_missing_shards: bool = False, context=None,
         spec=None, index=None, max_shards: int = 64) -> ts.TensorStore:
    """Open one scale of a DVID export as a read-only ``tensorstore.TensorStore``.

    Parameters
    ----------
    source : str, path, URL, kvstore spec dict or Dataset
        The export root (holding ``s0``, ``s1``, ...).
    scale : int, float or (x, y, z) resolution
        Which scale.
    labels : "agglomerated", "supervoxels" or a mapping
        Voxel values: the records' agglomerated labels, the supervoxels, or a supervoxel →
        body mapping applied at read time (dict, (n, 2) array, pandas Series or a file in
        DVID's ``/mappings`` text or binary format); unmapped supervoxels keep their id.
    fill_missing_shards : bool
        Read a missing shard file as background instead of raising MissingShardError.
    context : tensorstore.Context, optional
        E.g. ``ts.Context({"data_copy_concurrency": {"limit": 8}})``.
    spec : dict or path, optional
        The neuroglancer multiscale spec of the export (see ``Dataset``).
    index : path, optional
        A folder of consolidated indexes (``dvidshards consolidate``).
    max_shards : int
        Shard indexes kept open per process (LRU).

    Returns
    -------
    tensorstore.TensorStore
        uint64, dimensions ``["x", "y", "z"]``, 64³ chunks; read with ``order="F"`` for speed.
    """
    ds = source if isinstance(source, Dataset) else Dataset(source, spec=spec, index=index)
    return ds.open(scale, labels=labels, fill_missing_shards=fill_missing_shards, context=context,
                   max_shards=max_shards)
