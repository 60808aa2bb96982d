"""Chunk indexes: every variant DVID has written, normalised to one in-memory form.

Variants (FORMATS.md §3): CSV ``x,y,z,offset,size,batch_idx`` (A), ``x,y,z,rec,offset,size``
(B), ``x,y,z,rec`` (C), and the ``CHUNKIDX`` JSON footer (D).  All become a ``ShardIndex``:
chunk coordinates plus the byte range of the record batch message and the row inside it.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.feather  # noqa: F401  (pa.feather)

from .errors import ChunkIndexError

__all__ = ["FOOTER_MAGIC", "ConsolidatedIndex", "GlobalIndex", "RawIndex", "ShardIndex", "pack_keys", "parse_csv", "parse_footer", "write_consolidated"]

FOOTER_MAGIC = b"CHUNKIDX"
_VARIANTS = {
    ("x", "y", "z", "offset", "size", "batch_idx"): "A",
    ("x", "y", "z", "rec", "offset", "size"): "B",
    ("x", "y", "z", "rec"): "C",
}
KEY_BITS = 21
KEY_LIMIT = 1 << KEY_BITS


def pack_keys(coords: np.ndarray) -> np.ndarray:
    """One int64 key per (x, y, z) chunk coordinate (21 bits per axis)."""
    c = np.asarray(coords, np.int64)
    return (c[..., 0] << (2 * KEY_BITS)) | (c[..., 1] << KEY_BITS) | c[..., 2]


def pack_key(x: int, y: int, z: int) -> int:
    return (x << (2 * KEY_BITS)) | (y << KEY_BITS) | z


@dataclass(frozen=True)
class RawIndex:
    """An index as read from its file, before record batches are located."""

    variant: str
    coords: np.ndarray  # (n, 3) int64 chunk coordinates
    rec: np.ndarray | None = None  # row across the whole file (B, C, D)
    offset: np.ndarray | None = None  # record batch message offset (A, B)
    size: np.ndarray | None = None  # record batch message length (A, B)
    batch_idx: np.ndarray | None = None  # row inside the batch (A)
    schema_size: int | None = None


@dataclass(frozen=True)
class ShardIndex:
    """One shard's chunks in normalised form (one row per chunk)."""

    variant: str
    coords: np.ndarray  # (n, 3) int64
    msg_off: np.ndarray  # int64 file offset of the record batch message
    msg_len: np.ndarray  # int64 its length
    row: np.ndarray  # int64 row inside that batch

    def __len__(self) -> int:
        return len(self.coords)

    @classmethod
    def from_raw(cls, raw: RawIndex, where: str, batches: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
                 ) -> ShardIndex:
        """Locate every chunk's record batch; ``batches`` (offsets, lengths, rows) is needed for C and D."""
        if raw.variant == "A":
            return cls("A", raw.coords, raw.offset, raw.size, raw.batch_idx)
        if raw.variant == "B":
            return cls("B", raw.coords, raw.offset, raw.size, np.zeros(len(raw.coords), np.int64))
        offs, lens, rows = batches
        starts = np.concatenate([[0], np.cumsum(rows)])
        bad = np.flatnonzero(raw.rec >= starts[-1])
        if bad.size:
            i = bad[0]
            raise ChunkIndexError(f"{where}: chunk {_c(raw.coords[i])} points at record {raw.rec[i]}, "
                                  f"but the file holds {starts[-1]} records")
        b = np.searchsorted(starts, raw.rec, side="right") - 1
        return cls(raw.variant, raw.coords, offs[b], lens[b], raw.rec - starts[b])


def _c(c) -> tuple[int, ...]:
    return tuple(int(v) for v in c)


def _check(coords: np.ndarray, where: str) -> None:
    """Coordinates in range and unique."""
    if coords.size and (coords.min() < 0 or coords.max() >= KEY_LIMIT):
        i = int(np.flatnonzero(((coords < 0) | (coords >= KEY_LIMIT)).any(axis=1))[0])
        raise ChunkIndexError(f"{where}: chunk coordinate {_c(coords[i])} out of range")
    keys = pack_keys(coords)
    uniq, first, counts = np.unique(keys, return_index=True, return_counts=True)
    if uniq.size != keys.size:
        i = first[np.flatnonzero(counts > 1)[0]]
        raise ChunkIndexError(f"{where}: chunk {_c(coords[i])} is listed more than once")


def _int64s(col: pa.ChunkedArray) -> np.ndarray:
    """An int64 column as numpy from its data buffer (pyarrow's to_numpy imports pandas: ~250 ms)."""
    a = col.combine_chunks()
    return np.frombuffer(a.buffers()[1], np.int64, count=len(a), offset=8 * a.offset)


def parse_csv(text: bytes, where: str) -> RawIndex:
    """Parse a CSV chunk index of variant A, B or C (detected from its header)."""
    schema_size = None
    body = bytes(text)
    if body.startswith(b"#"):
        first, _, body = body.partition(b"\n")
        key, _, value = first[1:].strip().partition(b"=")
        if key.strip() != b"schema_size" or not value.strip().isdigit():
            raise ChunkIndexError(f"{where}: unrecognised first line {first[:60]!r}")
        schema_size = int(value)
    header, _, rows = body.partition(b"\n")
    cols = tuple(c.strip() for c in header.decode("ascii", "replace").strip().split(","))
    variant = _VARIANTS.get(cols)
    if variant is None:
        raise ChunkIndexError(f"{where}: unknown chunk index columns {','.join(cols)!r}")
    if variant in "AB" and schema_size is None:
        raise ChunkIndexError(f"{where}: variant {variant} index lacks its '# schema_size=' line")
    try:
        table = pacsv.read_csv(
            pa.py_buffer(rows),
            read_options=pacsv.ReadOptions(column_names=list(cols), use_threads=False),
            convert_options=pacsv.ConvertOptions(column_types={c: pa.int64() for c in cols}),
        ) if rows.strip() else None
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise ChunkIndexError(f"{where}: malformed chunk index row: {str(e).splitlines()[0]}") from None
    if table is None:
        arrays = {c: np.zeros(0, np.int64) for c in cols}
    else:
        if any(table.column(c).null_count for c in cols):
            raise ChunkIndexError(f"{where}: chunk index has empty fields")
        arrays = {c: _int64s(table.column(c)) for c in cols}
    coords = np.stack([arrays["x"], arrays["y"], arrays["z"]], axis=1).astype(np.int64, copy=False)
    _check(coords, where)
    for c in cols[3:]:
        bad = np.flatnonzero(arrays[c] < 0)
        if bad.size:
            raise ChunkIndexError(f"{where}: chunk {_c(coords[bad[0]])} has negative {c}")
    return RawIndex(variant, coords, rec=arrays.get("rec"), offset=arrays.get("offset"),
                    size=arrays.get("size"), batch_idx=arrays.get("batch_idx"), schema_size=schema_size)


def footer_length(tail: bytes, file_size: int, where: str) -> int | None:
    """Length of the JSON of a CHUNKIDX footer given the file's last 16 bytes (None: no footer)."""
    if len(tail) < 16 or tail[-8:] != FOOTER_MAGIC:
        return None
    (n,) = struct.unpack("<Q", tail[-16:-8])
    if n < 2 or n > file_size - 16:
        raise ChunkIndexError(f"{where}: CHUNKIDX footer claims {n} bytes of JSON in a {file_size}-byte file")
    return n


def parse_footer(blob: bytes, chunk_size: tuple[int, int, int], where: str) -> RawIndex:
    """Parse the JSON of a CHUNKIDX footer (variant D: keys ``"x_y_z"`` in voxel units)."""
    try:
        obj = json.loads(blob)
    except (UnicodeDecodeError, ValueError) as e:
        raise ChunkIndexError(f"{where}: CHUNKIDX footer is not JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ChunkIndexError(f"{where}: CHUNKIDX footer is not a JSON object")
    n = len(obj)
    coords = np.empty((n, 3), np.int64)
    rec = np.empty(n, np.int64)
    cs = np.asarray(chunk_size, np.int64)
    for i, (k, v) in enumerate(obj.items()):
        parts = k.split("_")
        if len(parts) != 3 or not all(p.isdigit() for p in parts) or type(v) is not int or v < 0:
            raise ChunkIndexError(f"{where}: bad CHUNKIDX entry {k!r}: {v!r}")
        vox = np.array([int(p) for p in parts], np.int64)
        if (vox % cs).any():
            raise ChunkIndexError(f"{where}: CHUNKIDX key {k!r} is not a chunk origin (chunk size {tuple(cs)})")
        coords[i] = vox // cs
        rec[i] = v
    _check(coords, where)
    return RawIndex("D", coords, rec=rec)


class GlobalIndex:
    """Chunk coordinate → (shard, record) for one scale, built lazily from the shard indexes.

    A chunk is routed to its shard by arithmetic on the shard extent; a shard's index is
    loaded on first touch (by ``load(origin)``, which returns a shard object or None for a
    missing shard the user asked to fill) and kept in a bounded LRU.
    """

    def __init__(self, load, shard_extent: int, chunk_size: tuple[int, int, int], max_shards: int = 64):
        if max_shards < 1:
            raise ValueError("max_shards must be at least 1")
        self._load = load
        self.shard_extent = int(shard_extent)
        self.chunk_size = tuple(int(c) for c in chunk_size)
        self.max_shards = int(max_shards)
        self._shards: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self._loading: dict = {}
        self._newest = None  # key of the most recently used shard (the end of the LRU order)

    def __getstate__(self):
        raise TypeError("GlobalIndex holds open files; pickle the reader that builds it instead")

    def origin(self, x: int, y: int, z: int) -> tuple[int, int, int]:
        """Voxel origin of the shard that holds chunk (x, y, z)."""
        s = self.shard_extent
        cx, cy, cz = self.chunk_size
        return (x * cx // s * s, y * cy // s * s, z * cz // s * s)

    def shard(self, x: int, y: int, z: int):
        """The loaded shard holding chunk (x, y, z) (None: a missing shard to fill with 0)."""
        # runs once per chunk with the GIL held: origin() inlined, and the LRU order is only
        # updated (under the lock) when the shard is not already the most recently used one
        s = self.shard_extent
        cx, cy, cz = self.chunk_size
        key = (x * cx // s * s, y * cy // s * s, z * cz // s * s)
        shards = self._shards
        try:
            sf = shards[key]
        except KeyError:
            return self._miss(key)
        if key != self._newest and len(shards) > 1:
            with self._lock:
                if key in shards:
                    shards.move_to_end(key)
                    self._newest = key
        return sf

    def _miss(self, key):
        with self._lock:
            if key in self._shards:
                return self._shards[key]
            gate = self._loading.get(key)
            if gate is None:
                gate = self._loading[key] = threading.Lock()
        with gate:  # one loader per shard; others wait for it
            with self._lock:
                if key in self._shards:
                    return self._shards[key]
            try:
                sf = self._load(key)
            finally:
                with self._lock:
                    self._loading.pop(key, None)
            with self._lock:
                self._shards[key] = sf
                self._newest = key
                while len(self._shards) > self.max_shards:
                    self._shards.popitem(last=False)
        return sf

    @property
    def loaded(self) -> int:
        """How many shard indexes are in memory."""
        return len(self._shards)


# --- consolidated per-scale index ----------------------------------------------------------------

_CHUNKS_SCHEMA = pa.schema([
    ("chunk_x", pa.int32()), ("chunk_y", pa.int32()), ("chunk_z", pa.int32()),
    ("msg_off", pa.int64()), ("msg_len", pa.int64()), ("row", pa.int32()),
])
_SHARDS_SCHEMA = pa.schema([
    ("origin_x", pa.int64()), ("origin_y", pa.int64()), ("origin_z", pa.int64()),
    ("start", pa.int64()), ("stop", pa.int64()), ("variant", pa.string()),
])


def consolidated_paths(folder: str, scale_folder: str) -> tuple[str, str]:
    """The two files of a scale's consolidated index: chunks and table of shards."""
    return (os.path.join(folder, f"{scale_folder}.chunks.arrow"), os.path.join(folder, f"{scale_folder}.shards.arrow"))


def write_consolidated(dataset, scale, folder: str, open_shard=None) -> tuple[str, int, int]:
    """Write one scale's consolidated index (every shard's index, checked) into folder.

    Streams shard by shard (one record batch each), so memory stays bounded whatever the
    export's size. Returns (chunks file path, chunks, shards).
    """
    from .dataset import open_shard as default_open
    from .dataset import shard_stems

    open_shard = open_shard or default_open
    src = dataset.source
    if src.mappable:
        root = os.path.realpath(src.describe(""))
        if os.path.realpath(folder).startswith(root + os.sep) or os.path.realpath(folder) == root:
            raise ChunkIndexError(f"{folder}: consolidated indexes go outside the export ({root}), never into it")
    os.makedirs(folder, exist_ok=True)
    chunks_path, shards_path = consolidated_paths(folder, scale.folder)
    origins = sorted(shard_stems(src, scale.folder))
    toc = {k: [] for k in _SHARDS_SCHEMA.names}
    n = 0
    meta = {b"dvidshards": json.dumps({"version": 1, "scale": scale.to_json(), "index": scale.index}).encode()}
    tmp = chunks_path + ".tmp"
    with pa.OSFile(tmp, "wb") as f, pa.ipc.new_file(f, _CHUNKS_SCHEMA.with_metadata(meta)) as w:
        for o in origins:
            sf = open_shard(src, f"{scale.folder}/{o[0]}_{o[1]}_{o[2]}", scale.chunk_size, box=scale.shard_box(o))
            ix = sf.index
            order = np.argsort(pack_keys(ix.coords), kind="stable")
            c = ix.coords[order]
            w.write_batch(pa.record_batch([
                pa.array(c[:, 0].astype(np.int32)), pa.array(c[:, 1].astype(np.int32)),
                pa.array(c[:, 2].astype(np.int32)), pa.array(ix.msg_off[order]), pa.array(ix.msg_len[order]),
                pa.array(ix.row[order].astype(np.int32))], schema=_CHUNKS_SCHEMA))
            for k, v in zip(_SHARDS_SCHEMA.names, (*o, n, n + len(ix), ix.variant), strict=True):
                toc[k].append(v)
            n += len(ix)
    os.replace(tmp, chunks_path)
    pa.feather.write_feather(pa.table(toc, schema=_SHARDS_SCHEMA.with_metadata(meta)), shards_path,
                             compression="uncompressed")
    return chunks_path, n, len(origins)


class ConsolidatedIndex:
    """A scale's consolidated index, memory-mapped: shard tables and a listing of every chunk."""

    def __init__(self, folder: str, scale_folder: str):
        self.folder, self.scale_folder = folder, scale_folder
        chunks_path, shards_path = consolidated_paths(folder, scale_folder)
        try:
            self._chunks = pa.ipc.open_file(pa.memory_map(chunks_path)).read_all()
            toc = pa.feather.read_table(shards_path, memory_map=True)
        except (OSError, pa.ArrowInvalid) as e:
            raise ChunkIndexError(f"{chunks_path}: unreadable consolidated index ({e})") from None
        if self._chunks.schema.remove_metadata() != _CHUNKS_SCHEMA or toc.schema.remove_metadata() != _SHARDS_SCHEMA:
            raise ChunkIndexError(f"{chunks_path}: not a dvidshards consolidated index")
        self.meta = json.loads((self._chunks.schema.metadata or {}).get(b"dvidshards", b"{}"))
        cols = {k: toc.column(k).to_pylist() for k in _SHARDS_SCHEMA.names}
        self._toc = {(x, y, z): (a, b, v) for x, y, z, a, b, v in zip(*cols.values(), strict=True)}
        self._cols = {k: self._chunks.column(k).combine_chunks().to_numpy() for k in _CHUNKS_SCHEMA.names}
        if sum(b - a for a, b, _ in self._toc.values()) != len(self):
            raise ChunkIndexError(f"{chunks_path}: table of shards does not cover its {len(self)} chunks")

    def __len__(self) -> int:
        return self._chunks.num_rows

    def __getstate__(self):
        return (self.folder, self.scale_folder)

    def __setstate__(self, state):
        self.__init__(*state)

    @property
    def shards(self) -> list[tuple[int, int, int]]:
        """Voxel origins of the shards the index lists."""
        return list(self._toc)

    def chunks(self) -> np.ndarray:
        """Every chunk coordinate of the scale, (n, 3) int32 x, y, z."""
        c = self._cols
        return np.stack([c["chunk_x"], c["chunk_y"], c["chunk_z"]], axis=1)

    def shard_index(self, origin) -> ShardIndex | None:
        """The ShardIndex of one shard, None when the index lists no such shard."""
        entry = self._toc.get(tuple(int(v) for v in origin))
        if entry is None:
            return None
        a, b, variant = entry
        c = self._cols
        coords = np.stack([c["chunk_x"][a:b], c["chunk_y"][a:b], c["chunk_z"][a:b]], axis=1).astype(np.int64)
        return ShardIndex(variant, coords, c["msg_off"][a:b].copy(), c["msg_len"][a:b].copy(),
                          c["row"][a:b].astype(np.int64))
