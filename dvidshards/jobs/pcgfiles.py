"""A pcg-edges output's files: the side table's parts, and an output read back from any store.

The side table (``supervoxels/``, a Parquet file per task: pcg_id, dvid_supervoxel, chunk_x,
chunk_y, chunk_z, voxels, sorted by pcg_id) reads as one table; each part's metadata lists the
chunks its task covered and wrote files for: the task's completion record (:class:`Part`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

from ..formats import pcg as fmt
from ..formats.pcg import PcgError
from ..stores import ByteStore, as_store

__all__ = ["SCHEMA", "SIDE_TABLE", "Part", "read_chunk_components", "read_chunk_edges", "read_part", "read_side_table",
           "write_part"]

SIDE_TABLE = "supervoxels"  # a folder: one Parquet file per task
VERSION = 3  # 2: manifest.json of its own; 1: one supervoxels.parquet built on the client
COVERED, WRITTEN = b"dvidshards.covered", b"dvidshards.written"  # a part's metadata: the chunks done, with files
SCHEMA = pa.schema([("pcg_id", pa.uint64()), ("dvid_supervoxel", pa.uint64()), ("chunk_x", pa.int32()),
                     ("chunk_y", pa.int32()), ("chunk_z", pa.int32()), ("voxels", pa.uint64())])
Chunk = tuple[int, ...]


class Part:
    """A task's side-table part: rows (pcg_id, supervoxel, voxels) with their chunks, and the chunks
    it covers (done) and wrote files for."""

    def __init__(self, rows: np.ndarray | None = None, chunks: np.ndarray | None = None, covered=(), written=()):
        self.parts: list[tuple[np.ndarray, np.ndarray]] = [] if rows is None or chunks is None else [(rows, chunks)]
        self.covered: set[Chunk] = set(covered)
        self.written: set[Chunk] = set(written)

    @property
    def rows(self) -> int:
        return sum(len(r) for r, _ in self.parts)

    def add(self, c: Chunk, rows: np.ndarray, written: bool) -> None:
        rows = rows.reshape(-1, 3)
        self.parts.append((rows, np.broadcast_to(np.asarray(c, np.int32), (len(rows), 3))))
        self.covered.add(c)
        if written:
            self.written.add(c)

    def merge(self, other: Part) -> int:
        """Add the chunks ``other`` covers and this part does not; how many."""
        new = other.covered - self.covered
        for rows, chunks in other.parts:
            keep = np.array([tuple(c) in new for c in chunks.tolist()], np.bool_)
            if keep.any():
                self.parts.append((rows[keep], chunks[keep]))
        self.covered |= new
        self.written |= other.written & new
        return len(new)


def read_part(store: ByteStore, key: str) -> Part:
    """A task's part as written (empty when none)."""
    data = store.get_sync(key)
    where = store.describe(key)
    if data is None:
        return Part()
    try:
        t = pq.read_table(pa.BufferReader(data))
    except (OSError, pa.ArrowException) as e:
        raise PcgError(f"{where}: unreadable side-table part ({e}); delete it and resume") from None
    meta = t.schema.metadata or {}
    try:
        covered, written = ({tuple(int(v) for v in c) for c in json.loads(meta[k])} for k in (COVERED, WRITTEN))
    except (KeyError, ValueError, TypeError):
        raise PcgError(f"{where}: a side-table part without its lists of chunks; delete it and resume") from None
    if t.schema.names != SCHEMA.names:
        raise PcgError(f"{where}: not a side-table part (columns {t.schema.names})")
    rows = np.stack([t.column(n).to_numpy().astype(np.uint64) for n in ("pcg_id", "dvid_supervoxel", "voxels")], 1)
    chunks = np.stack([t.column(n).to_numpy().astype(np.int32) for n in ("chunk_x", "chunk_y", "chunk_z")], 1)
    return Part(rows, chunks, covered, written)


def write_part(store: ByteStore, key: str, part: Part) -> None:
    """Rows sorted by PCG id, the chunk lists in the metadata."""
    a = np.concatenate([r for r, _ in part.parts]) if part.parts else np.zeros((0, 3), np.uint64)
    c = np.concatenate([k for _, k in part.parts]) if part.parts else np.zeros((0, 3), np.int32)
    order = np.argsort(a[:, 0], kind="stable")
    a, c = a[order], c[order]
    meta = {COVERED: json.dumps(sorted(part.covered)).encode(), WRITTEN: json.dumps(sorted(part.written)).encode()}
    table = pa.table([a[:, 0], a[:, 1], c[:, 0], c[:, 1], c[:, 2], a[:, 2]], schema=SCHEMA.with_metadata(meta))
    with store.writer(key) as f:
        pq.write_table(table, f, compression="zstd")


# --------------------------------------------------------------------------- reading back


def read_chunk_edges(path: Any, coords: Sequence[int]) -> dict:
    """One chunk's edges: ``{"in"|"between"|"cross": (ids1, ids2, affinities, areas)}``; a missing
    file reads as none (as PCG's ``get_chunk_edges``), a corrupt one is a PcgError naming it.
    ``path``: the output (a folder, ``gs://``, ``s3://``, a kvstore spec or a store)."""
    store = as_store(path, what="pcg-edges output")
    name = fmt.edges_path(coords)
    where = store.describe(name)
    data = store.get_sync(name)
    if data is None:
        return fmt.decode_edges(b"", where)
    try:
        raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=1 << 34)
    except zstandard.ZstdError as e:
        raise PcgError(f"{where}: not a zstd frame ({e})") from None
    return fmt.decode_edges(raw, where)


def read_chunk_components(path: Any, coords: Sequence[int]) -> list[np.ndarray]:
    """One chunk's groups of PCG ids (an array per body), [] if absent."""
    store = as_store(path, what="pcg-edges output")
    name = fmt.components_path(coords)
    data = store.get_sync(name)
    return [] if data is None else fmt.decode_components(data, store.describe(name))


def read_side_table(path: Any) -> pa.Table:
    """The side table as one table sorted by ``pcg_id``: every piece (DVID supervoxel in a PCG chunk)
    of the chunks done. A large one reads better as the folder, with ``pyarrow.dataset``."""
    store = as_store(path, what="pcg-edges output")
    names = [n for n in store.list_sync(SIDE_TABLE) if n.endswith(".parquet")]
    if not names and not store.is_folder_sync(SIDE_TABLE):
        raise PcgError(f"{store.describe(SIDE_TABLE)}: no side table (not a pcg-edges output of version {VERSION})")
    parts = []
    for n in names:
        key = f"{SIDE_TABLE}/{n}"
        try:
            parts.append(pq.read_table(pa.BufferReader(store.get_sync(key) or b"")).replace_schema_metadata(None))
        except (OSError, pa.ArrowException) as e:
            raise PcgError(f"{store.describe(key)}: unreadable side-table part ({e})") from None
    t = pa.concat_tables(parts) if parts else SCHEMA.empty_table()
    return t.sort_by("pcg_id")
