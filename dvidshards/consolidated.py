"""Consolidated per-scale chunk indexes: every shard's index in one memory-mapped file.

Two Arrow IPC files outside the export per scale: ``s{k}.chunks.arrow`` (a row per chunk) and
``s{k}.shards.arrow`` (a row per shard: its rows, index variant, and its file's size and change
stamp when indexed), so that a shard file that changed, or appeared since, is a typed "stale
index" error.  Each scale's geometry is saved with the file extent and naming generation its
files were read with (``Scale.shard_extent``, ``Scale.naming``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

import numpy as np
import pyarrow as pa
import pyarrow.feather
from tqdm.auto import tqdm

from .errors import ChunkIndexError
from .formats.chunkindex import ShardIndex, pack_keys
from .formats.multiscale import Scale, parse_multiscale
from .formats.sharding import NAMINGS

__all__ = ["ConsolidatedIndex", "consolidated_paths", "scales_from_consolidated", "write_consolidated"]

VERSION = 2
_CHUNKS_SCHEMA = pa.schema([
    ("chunk_x", pa.int32()), ("chunk_y", pa.int32()), ("chunk_z", pa.int32()),
    ("msg_off", pa.int64()), ("msg_len", pa.int64()), ("row", pa.int32()),
])
_SHARDS_SCHEMA = pa.schema([
    ("origin_x", pa.int64()), ("origin_y", pa.int64()), ("origin_z", pa.int64()),
    ("start", pa.int64()), ("stop", pa.int64()), ("variant", pa.string()),
    ("size", pa.int64()), ("stamp", pa.string()),
])


def consolidated_paths(folder: str, scale_folder: str) -> tuple[str, str]:
    """The two files of a scale's consolidated index: chunks and table of shards."""
    return (os.path.join(folder, f"{scale_folder}.chunks.arrow"),
            os.path.join(folder, f"{scale_folder}.shards.arrow"))


def write_consolidated(dataset, scale, folder: str, progress: bool = False) -> tuple[str, int, int]:
    """Write one scale's consolidated index (every shard loaded and checked) into folder:
    (chunks file path, chunks, shards).

    Streams shard by shard (bounded memory).  A scale the export has no folder for, or whose
    files do not fit the geometry, is a SpecError before anything is written.  The geometry is
    saved with guessed parts (``Scale.inferred``), so that it opens as it was.
    """
    store = dataset.store
    for st in getattr(store, "stores", [store]):  # every root of a layered dataset
        if st.mappable and hasattr(st, "root"):
            root = os.path.realpath(st.root)
            real = os.path.realpath(folder)
            if real == root or real.startswith(root + os.sep):
                raise ChunkIndexError(f"{folder}: consolidated indexes go outside the export ({root}), never into it")
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ChunkIndexError(f"{folder}: exists and is not a folder")
    origins = sorted(dataset.shards(scale.index))  # listed and checked first: a missing folder writes nothing
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise ChunkIndexError(f"{folder}: cannot create the index folder ({e.strerror or e})") from None
    chunks_path, shards_path = consolidated_paths(folder, scale.folder)
    toc: dict[str, list] = {k: [] for k in _SHARDS_SCHEMA.names}
    n = 0
    meta = {b"dvidshards": json.dumps({"version": VERSION, "scale": scale.to_json(), "index": scale.index,
                                       "shard_extent": scale.shard_extent, "inferred": list(scale.inferred),
                                       "proven_extent": scale.proven_extent, "naming": scale.naming}).encode()}
    tmp = chunks_path + ".tmp"
    bar = tqdm(total=len(origins), desc=f"consolidate {scale.folder}", unit="shard", disable=not progress)
    try:
        with pa.OSFile(tmp, "wb") as f, pa.ipc.new_file(f, _CHUNKS_SCHEMA.with_metadata(meta)) as w:
            for o in origins:
                st = store.stat_sync(scale.stem(o) + ".arrow")
                shard = dataset.shard(scale.index, o, policy="eager", consolidated=False)
                ix = shard.index
                order = np.argsort(pack_keys(ix.coords), kind="stable")
                c = ix.coords[order]
                w.write_batch(pa.record_batch([
                    pa.array(c[:, 0].astype(np.int32)), pa.array(c[:, 1].astype(np.int32)),
                    pa.array(c[:, 2].astype(np.int32)), pa.array(ix.msg_off[order]), pa.array(ix.msg_len[order]),
                    pa.array(ix.row[order].astype(np.int32))], schema=_CHUNKS_SCHEMA))
                row = (*o, n, n + len(ix), ix.variant, st.size if st.size is not None else -1, st.stamp or "")
                for k, v in zip(_SHARDS_SCHEMA.names, row, strict=True):
                    toc[k].append(v)
                n += len(ix)
                bar.update(1)
        os.replace(tmp, chunks_path)
        pa.feather.write_feather(pa.table(toc, schema=_SHARDS_SCHEMA.with_metadata(meta)), shards_path,
                                 compression="uncompressed")
    except OSError as e:
        raise ChunkIndexError(f"{folder}: cannot write the consolidated index ({e.strerror or e})") from None
    finally:
        bar.close()
        if os.path.exists(tmp):
            os.remove(tmp)
    return chunks_path, n, len(origins)


class ConsolidatedIndex:
    """A scale's consolidated index, memory-mapped: shard tables and a listing of every chunk."""

    def __init__(self, folder: str, scale_folder: str):
        self.folder, self.scale_folder = folder, scale_folder
        chunks_path, shards_path = consolidated_paths(folder, scale_folder)
        self.path = chunks_path
        try:
            self._chunks = pa.ipc.open_file(pa.memory_map(chunks_path)).read_all()
            toc = pa.feather.read_table(shards_path, memory_map=True)
        except (OSError, pa.ArrowInvalid) as e:
            raise ChunkIndexError(f"{chunks_path}: unreadable consolidated index ({e})") from None
        try:
            self.meta = json.loads((self._chunks.schema.metadata or {}).get(b"dvidshards", b"{}"))
        except (ValueError, RecursionError):
            self.meta = None
        if not isinstance(self.meta, dict) or self.meta.get("version") != VERSION or \
                toc.schema.remove_metadata() != _SHARDS_SCHEMA:
            raise ChunkIndexError(f"{chunks_path}: written by another version of dvidshards; run "
                                  f"`dvidshards consolidate` again")
        if self._chunks.schema.remove_metadata() != _CHUNKS_SCHEMA:
            raise ChunkIndexError(f"{chunks_path}: not a dvidshards consolidated index")
        cols = {k: toc.column(k).to_pylist() for k in _SHARDS_SCHEMA.names}
        self._toc: dict[tuple, tuple] = {tuple(r[:3]): tuple(r[3:]) for r in zip(*cols.values(), strict=True)}
        self._cols = {k: self._chunks.column(k).combine_chunks().to_numpy() for k in _CHUNKS_SCHEMA.names}
        if sum(e[1] - e[0] for e in self._toc.values()) != len(self):
            raise ChunkIndexError(f"{chunks_path}: table of shards does not cover its {len(self)} chunks")

    def __len__(self) -> int:
        return self._chunks.num_rows

    def __getstate__(self):
        return (self.folder, self.scale_folder)

    def __setstate__(self, state):
        self.__init__(*state)  # type: ignore[misc]

    @property
    def shards(self) -> list[tuple[int, int, int]]:
        """Voxel origins of the shards the index lists."""
        return list(self._toc)

    def chunks(self) -> np.ndarray:
        """Every chunk coordinate of the scale, (n, 3) int32 x, y, z."""
        c = self._cols
        return np.stack([c["chunk_x"], c["chunk_y"], c["chunk_z"]], axis=1)

    def stamp(self, origin) -> tuple[int | None, str | None]:
        """(size, change stamp) of the shard's file when it was indexed."""
        e = self._toc[tuple(int(v) for v in origin)]
        return (e[3] if e[3] >= 0 else None), (e[4] or None)

    def shard_index(self, origin) -> ShardIndex | None:
        """The ShardIndex of one shard, None when the index lists no such shard."""
        entry = self._toc.get(tuple(int(v) for v in origin))
        if entry is None:
            return None
        a, b, variant = entry[:3]
        c = self._cols
        coords = np.stack([c["chunk_x"][a:b], c["chunk_y"][a:b], c["chunk_z"][a:b]], axis=1).astype(np.int64)
        return ShardIndex(variant, coords, c["msg_off"][a:b].copy(), c["msg_len"][a:b].copy(),
                          c["row"][a:b].astype(np.int64))


def scales_from_consolidated(folder: str) -> tuple[dict | None, list[Scale]] | None:
    """(spec, scales) saved in a folder of consolidated indexes, as when it was written; None when
    it does not hold scales 0, 1, ... of one export.

    ``spec`` is None when the geometry was inferred (``Scale.inferred`` says what was guessed);
    the scales carry the shard extent used, which the neuroglancer form cannot hold without a
    sharding spec.
    """
    spec, metas = _consolidated_metas(folder)
    if spec is None:
        return None
    scales = parse_multiscale(spec, folder)
    out = []
    for s, m in zip(scales, metas, strict=True):
        extent = m.get("shard_extent")
        if type(extent) is not int or extent <= 0:  # written before the extent was saved: the spec's own
            out.append(s)
            continue
        inferred = tuple(str(v) for v in m.get("inferred") or ())
        proven = m.get("proven_extent")
        saved_naming = m.get("naming")
        naming = saved_naming if isinstance(saved_naming, str) and saved_naming in NAMINGS else "current"
        out.append(dataclasses.replace(
            s, shard_extent=extent, inferred=inferred, proven_extent=proven if type(proven) is int else None,
            resolution=None if "resolution" in inferred else s.resolution, naming=naming))
    if any(s.inferred for s in out):
        spec = None
    return spec, out


def _consolidated_metas(folder: str) -> tuple[dict | None, list[dict]]:
    if not os.path.isdir(folder):
        raise ChunkIndexError(f"{folder}: no such folder of consolidated indexes")
    names = sorted((n for n in os.listdir(folder) if re.fullmatch(r"s[0-9]+\.chunks\.arrow", n)),
                   key=lambda n: int(n[1:].split(".")[0]))
    if not names:
        raise ChunkIndexError(f"{folder}: holds no consolidated index (s0.chunks.arrow, ...); run "
                              f"`dvidshards consolidate`")
    metas = [ConsolidatedIndex(folder, n.split(".")[0]).meta for n in names]
    if [m.get("index") for m in metas] != list(range(len(metas))):
        return None, metas
    spec = {"@type": "neuroglancer_multiscale_volume", "data_type": "uint64", "num_channels": 1,
            "scales": [m.get("scale") for m in metas]}
    parse_multiscale(spec, folder)  # check it
    return spec, metas
