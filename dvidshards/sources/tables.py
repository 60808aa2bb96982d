"""Block records as Arrow tables: their keys, record batches, cells and the table layout.

The design DVID's export was meant to follow (a Flight stream to N workers writing a table
sorted by shard and Morton code, payloads over a cell limit split across ``bin1..bin4``),
shared by ``ingest`` (writes tables), the Flight server and client (streams) and the sources
that read tables (``sources.tablesource``, ``sources.vastdb``).

**The table layout** ``ingest`` writes (a folder)::

    TABLE/info                                      neuroglancer multiscale spec + "dvidshards_table"
    TABLE/s{k}/{shard_id}_{ox}_{oy}_{oz}.parquet    one file per shard, rows sorted by morton

Columns ``shard_id, morton`` (int64: the neuroglancer shard number of the scale's sharding
spec, 0 without one, and the chunk's compressed Morton code), ``chunk_x/y/z`` (int32),
``labels``, ``supervoxels`` (list<uint64>), ``dvid_compressed_block`` (binary, null when
split), ``uncompressed_size`` (uint32) and ``bin1..bin4`` (binary, null unless split).  A
file appears only complete (written aside, then renamed), so a worker that dies leaves no
partial shard and a restarted one skips the shards already written.  Row groups are small
(`ROW_GROUP` rows) with statistics on the keys: a chunk is found from its file name and the
row groups' ``morton`` ranges.
"""

from __future__ import annotations

import functools
import json
import os
import re
import uuid
from collections.abc import Iterable, Iterator

import numba
import numpy as np
import pyarrow as pa
from numba.core import cgutils, types
from numba.extending import intrinsic

from ..errors import BlockDecodeError, ChunkIndexError, DvidShardsError, ShardFormatError, SpecError
from ..formats import arrowipc as ipc
from ..formats.chunkindex import pack_keys
from ..formats.multiscale import Scale, parse_json
from ..formats.records import RecordTable
from ..formats.sharding import (
    compressed_z_index_bits,
    dvid_shard_names_collide,
    murmurhash3_x86_128_low64,
)

__all__ = ["BATCH_ROWS", "BINS", "CELL_LIMIT", "ROW_GROUP", "STREAM_SCHEMA", "TABLE_SCHEMA", "CellLimitError",
           "PartialStreamError", "TableFileWriter", "as_arrow_table", "coords_of", "frame_sizes", "morton_codes",
           "normalise_records", "origins_by_shard_id", "partition_plan", "read_table_info", "record_batches",
           "record_keys", "record_spans", "records_to_batch", "select_rows", "shard_ids", "spec_from", "split_cells",
           "table_files", "write_table_info"]

CELL_LIMIT = 126 * 1024  # bytes per cell (VastDB's limit, from DVID's design)
BINS = ("bin1", "bin2", "bin3", "bin4")
ROW_GROUP = 256  # rows per Parquet row group; bench_sources measures it: 64-128 rows look up a chunk
# ~0.2 ms faster but scan slower and hold 2-4x the footer memory per open file (5.5 MB at 64 rows)
BATCH_ROWS = 256  # rows per streamed record batch
GATHER_BYTES = 16 << 20  # records gathered at once by a stream, then sliced into batches (measured: 8-128 MB)
TABLE_VERSION = 1
_META_KEY = b"dvidshards.table"
_FILE = re.compile(r"^([0-9]+)_([0-9]+)_([0-9]+)_([0-9]+)\.parquet$")

#: the stream's schema (Flight) and the table's without the bins
STREAM_SCHEMA = pa.schema([
    pa.field("shard_id", pa.int64(), nullable=False),
    pa.field("morton", pa.int64(), nullable=False),
    pa.field("chunk_x", pa.int32(), nullable=False),
    pa.field("chunk_y", pa.int32(), nullable=False),
    pa.field("chunk_z", pa.int32(), nullable=False),
    pa.field("labels", pa.list_(pa.uint64()), nullable=False),
    pa.field("supervoxels", pa.list_(pa.uint64()), nullable=False),
    pa.field("dvid_compressed_block", pa.binary(), nullable=False),
    pa.field("uncompressed_size", pa.uint32(), nullable=False),
])
TABLE_SCHEMA = pa.schema([*(f for f in STREAM_SCHEMA if f.name != "dvid_compressed_block"),
                          pa.field("dvid_compressed_block", pa.binary(), nullable=True),
                          *(pa.field(b, pa.binary(), nullable=True) for b in BINS)])


class CellLimitError(DvidShardsError, ValueError):
    """A record's payload (or label list) does not fit the table's cells (4 bins at most)."""


class PartialStreamError(DvidShardsError, OSError):
    """A record stream ended before it said it was complete (a worker or server died)."""


# --- keys ---------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _morton_tables(grid: tuple[int, ...]) -> tuple[tuple[int, int, np.ndarray], ...]:
    """(axis, byte, 256-entry table) whose ORed look-ups give the compressed Morton code.

    Entry v of (axis, byte k) is the code's bits for the bits 8k..8k+7 of that axis holding v:
    the same bit layout as `compressed_morton_code` (bit b of every axis that still has bits,
    x before y before z), looked up a byte at a time instead of a bit at a time.
    """
    bits = compressed_z_index_bits(grid)
    pos: dict[tuple[int, int], int] = {}
    for b in range(max(bits)):
        for a in range(3):
            if b < bits[a]:
                pos[(a, b)] = len(pos)
    v = np.arange(256, dtype=np.uint64)
    out = []
    for a in range(3):
        for k in range(-(-bits[a] // 8)):
            t = np.zeros(256, np.uint64)
            for j in range(8):
                if (a, 8 * k + j) in pos:
                    t |= ((v >> np.uint64(j)) & np.uint64(1)) << np.uint64(pos[(a, 8 * k + j)])
            out.append((a, k, t))
    return tuple(out)


def morton_codes(c: np.ndarray, grid: tuple[int, ...]) -> np.ndarray:
    """uint64 compressed Morton codes of (n, 3) int64 chunk coordinates inside ``grid`` (the caller
    checks): `compressed_morton_code`, ~50x faster on one chunk (a table look-up computes it per chunk)."""
    if len(c) <= 8:  # a few chunks (random access): Python ints beat two dozen tiny numpy calls
        lists = _morton_lists(grid)
        return np.array([_or_all(lists, r) for r in c.tolist()], np.uint64)
    code = np.zeros(len(c), np.uint64)
    for a, k, t in _morton_tables(grid):
        code |= t[(c[:, a] >> (8 * k)) & 255]
    return code


@functools.lru_cache(maxsize=64)
def _morton_lists(grid: tuple[int, ...]) -> tuple[tuple[int, int, list], ...]:
    return tuple((a, 8 * k, [int(v) for v in t]) for a, k, t in _morton_tables(grid))


def _or_all(lists, xyz: list) -> int:
    code = 0
    for a, shift, t in lists:
        code |= t[(xyz[a] >> shift) & 255]
    return code


def record_keys(scale: Scale, coords) -> tuple[np.ndarray, np.ndarray]:
    """(shard_id, morton) int64 of chunk coordinates at a scale: the neuroglancer chunk id over the
    scale's grid and the shard number its sharding spec gives (0 without sharding)."""
    c = np.asarray(coords, np.int64).reshape(-1, 3)
    if not len(c):
        z = np.zeros(0, np.int64)
        return z, z.copy()
    grid = scale.grid
    bad = np.flatnonzero(((c < 0) | (c >= np.asarray(grid, np.int64))).any(axis=1))
    if bad.size:
        raise ChunkIndexError(f"chunk {tuple(int(v) for v in c[bad[0]])} lies outside scale {scale.index}'s "
                              f"chunk grid {grid}")
    morton = morton_codes(c, tuple(int(v) for v in grid))
    if morton.size and int(morton.max()) >= 1 << 63:
        raise SpecError(f"scale {scale.index}: chunk ids need 64 bits; the table keys are int64")
    sh = scale.sharding
    if sh is None:
        sid = np.zeros(len(c), np.uint64)
    else:  # neuroglancer's shard number from the chunk id (as shard_and_minishard computes it)
        hashed = morton >> np.uint64(sh.preshift_bits) if sh.preshift_bits < 64 else np.zeros_like(morton)
        if sh.hash == "murmurhash3_x86_128":
            hashed = np.atleast_1d(murmurhash3_x86_128_low64(hashed))
        sid = hashed >> np.uint64(sh.minishard_bits) if sh.minishard_bits < 64 else np.zeros_like(hashed)
        sid &= np.uint64((1 << sh.shard_bits) - 1)
    return sid.astype(np.int64), morton.astype(np.int64)


def shard_ids(scale: Scale, origin) -> np.ndarray:
    """Sorted shard ids of the chunks of the DVID shard box at a voxel origin: one, unless DVID's
    cubic naming puts several neuroglancer shards in one file (or the hash is not the identity)."""
    lo, hi = scale.shard_box(origin)
    hi = np.minimum(hi, np.asarray(scale.grid, np.int64))
    if (hi <= lo).any():
        return np.zeros(0, np.int64)
    sh = scale.sharding
    if sh is None:
        return np.zeros(1, np.int64)
    if sh.hash == "identity" and not dvid_shard_names_collide(
            sh, [o + s for o, s in zip(scale.voxel_offset, scale.size, strict=True)], scale.chunk_size[0]):
        return record_keys(scale, lo[None])[0]
    axes = [np.arange(a, b, dtype=np.int64) for a, b in zip(lo, hi, strict=True)]
    grid = np.stack(np.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 3)
    return np.unique(record_keys(scale, grid)[0])


# --- records as record batches --------------------------------------------------------------------


@intrinsic
def _copy_bytes(typingctx, dst, dst_at, src, src_at, n):  # pragma: no cover - compiled
    """memcpy(&dst[dst_at], &src[src_at], n) for uint8 arrays (the caller checks the bounds).

    numba compiles ``out[p:p + n] = src[o:o + n]`` to a byte loop that ran at ~2 GB/s here,
    a quarter of memcpy: it set the speed of every Flight stream (bench_sources).
    """
    if not all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" and a.dtype == types.uint8
               for a in (dst, src)):
        return None  # contiguous uint8 vectors only: the pointers below assume a stride of 1
    sig = types.void(dst, types.int64, src, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        d, d_at, s, s_at, count = args
        dary = context.make_array(signature.args[0])(context, builder, d)
        sary = context.make_array(signature.args[2])(context, builder, s)
        cgutils.raw_memcpy(builder, builder.gep(dary.data, [d_at]), builder.gep(sary.data, [s_at]), count, 1)
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(nogil=True, cache=True)
def _gather_kernel(src, offs, lens, out, out_offs):  # pragma: no cover - compiled
    p = 0
    for i in range(offs.shape[0]):
        o, n = offs[i], lens[i]
        out_offs[i] = p
        _copy_bytes(out, p, src, o, n)  # type: ignore[call-arg]
        p += n
    out_offs[offs.shape[0]] = p


def _gather(src: np.ndarray, offs: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate byte ranges of src: (bytes, int32 or int64 offsets)."""
    src = np.ascontiguousarray(src, np.uint8)  # the kernel's memcpy needs a plain byte vector (no copy if so)
    offs = np.ascontiguousarray(offs, np.int64)
    lens = np.ascontiguousarray(lens, np.int64)
    n = src.shape[0]
    if len(offs) and (offs.min() < 0 or lens.min() < 0 or (offs > n - lens).any()):
        raise ShardFormatError("record byte ranges lie outside their buffers")  # validated upstream
    total = int(lens.sum())
    # from Arrow's pool, which keeps freed memory: a fresh numpy array page-faults every
    # 4 KiB it touches, which tripled the cost of a stream's gathers (bench_sources)
    out = np.frombuffer(pa.allocate_buffer(total), np.uint8) if total else np.zeros(0, np.uint8)
    out_offs = np.empty(len(offs) + 1, np.int64)
    _gather_kernel(src, offs, lens, out, out_offs)
    return out, out_offs


def _binary_array(data: np.ndarray, offs: np.ndarray) -> pa.Array:
    if offs[-1] < 1 << 31:
        return pa.Array.from_buffers(pa.binary(), len(offs) - 1, [None, pa.py_buffer(offs.astype(np.int32)),
                                                                  pa.py_buffer(data)])
    return pa.Array.from_buffers(pa.large_binary(), len(offs) - 1, [None, pa.py_buffer(offs), pa.py_buffer(data)])


def _u64_list_array(data: np.ndarray, offs_bytes: np.ndarray) -> pa.Array:
    values = pa.Array.from_buffers(pa.uint64(), len(data) // 8, [None, pa.py_buffer(data)])
    return pa.ListArray.from_arrays(pa.array((offs_bytes // 8).astype(np.int32), pa.int32()), values)


def records_to_batch(t: RecordTable, rows, shard_id: np.ndarray, morton: np.ndarray,
                     columns: Iterable[str] | None = None) -> pa.RecordBatch:
    """Records ``rows`` of a RecordTable as one record batch of `STREAM_SCHEMA` (copied).

    ``shard_id`` and ``morton`` are the rows' keys; ``columns`` projects (default: all).
    """
    rows = np.asarray(rows, np.int64)
    rec = t.rec[rows]
    cols = list(STREAM_SCHEMA.names) if columns is None else list(columns)
    arrays = []
    for name in cols:
        if name == "shard_id":
            arrays.append(pa.array(np.asarray(shard_id, np.int64)))
        elif name == "morton":
            arrays.append(pa.array(np.asarray(morton, np.int64)))
        elif name in ("chunk_x", "chunk_y", "chunk_z"):
            arrays.append(pa.array(rec[:, ipc.R_CX + "xyz".index(name[-1])].astype(np.int32)))
        elif name == "labels":
            arrays.append(_u64_list_array(*_gather(t.bufs[1], rec[:, ipc.R_LAB], 8 * rec[:, ipc.R_NLAB])))
        elif name == "supervoxels":
            arrays.append(_u64_list_array(*_gather(t.bufs[2], rec[:, ipc.R_SV], 8 * rec[:, ipc.R_NSV])))
        elif name == "dvid_compressed_block":
            arrays.append(_binary_array(*_gather(t.bufs[0], rec[:, ipc.R_PAY], rec[:, ipc.R_PAYLEN])))
        elif name == "uncompressed_size":
            us = rec[:, ipc.R_USIZE].copy()
            miss = np.flatnonzero(us < 0)  # schema without the column: the frame says it
            if miss.size:
                us[miss] = frame_sizes(t, rows[miss])
            for k in np.flatnonzero(us < 0):
                if us[k] == -2:
                    raise BlockDecodeError(f"{t.where(int(rows[k]))}: dvid_compressed_block is not a zstd frame")
                us[k] = len(t.block(int(rows[k])))
            arrays.append(pa.array(us.astype(np.uint32)))
        else:
            raise SpecError(f"unknown record column {name!r}; columns are {list(STREAM_SCHEMA.names)}")
    schema = pa.schema([STREAM_SCHEMA.field(c) for c in cols])
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


@numba.njit(nogil=True, cache=True)
def _frame_sizes_kernel(buf, offs, lens, out):  # pragma: no cover - compiled
    """Declared content size of each zstd frame: >= 0, -1 when absent, -2 when not a frame."""
    n = buf.shape[0]
    for i in range(offs.shape[0]):
        o, m = offs[i], lens[i]
        out[i] = -2
        if o < 0 or m < 6 or o > n - m:
            continue
        if buf[o] != 0x28 or buf[o + 1] != 0xB5 or buf[o + 2] != 0x2F or buf[o + 3] != 0xFD:
            continue
        fhd = np.int64(buf[o + 4])
        if (fhd >> 3) & 1:  # reserved bit
            continue
        single = (fhd >> 5) & 1
        did = fhd & 3
        p = o + 5 + (0 if single else 1)
        if did == 1:
            p += 1
        elif did == 2:
            p += 2
        elif did == 3:
            p += 4
        flag = fhd >> 6
        size = 1 if (flag == 0 and single) else 0 if flag == 0 else 2 if flag == 1 else 4 if flag == 2 else 8
        if size == 0:
            out[i] = -1
            continue
        if p + size > o + m:
            continue
        v = np.int64(0)
        for k in range(size):
            v |= np.int64(buf[p + k]) << (8 * k)
        out[i] = v + 256 if size == 2 else v


def frame_sizes(t: RecordTable, rows: np.ndarray) -> np.ndarray:
    """The content sizes the payloads' zstd frame headers declare (-1 absent, -2 not a frame)."""
    rec = t.rec[rows]
    out = np.empty(len(rows), np.int64)
    _frame_sizes_kernel(t.bufs[0], np.ascontiguousarray(rec[:, ipc.R_PAY]), np.ascontiguousarray(
        rec[:, ipc.R_PAYLEN]), out)
    return out


def _check_frames(t: RecordTable, rows: np.ndarray) -> None:
    """Each payload is a zstd frame whose declared size agrees with uncompressed_size (cheap)."""
    sizes = frame_sizes(t, rows)
    us = t.rec[rows, ipc.R_USIZE]
    bad = np.flatnonzero((sizes == -2) | ((sizes >= 0) & (us >= 0) & (sizes != us)))
    if bad.size:
        k = int(bad[0])
        i = int(rows[k])
        if sizes[k] == -2:
            raise BlockDecodeError(f"{t.where(i)}: dvid_compressed_block is not a zstd frame")
        raise BlockDecodeError(f"{t.where(i)}: zstd frame declares {sizes[k]} bytes, uncompressed_size is {us[k]}")


def _chunk_filter(coords: np.ndarray, scale: Scale, box=None, chunks=None) -> np.ndarray:
    """Boolean mask of records in a voxel box and/or a chunk list."""
    keep = np.ones(len(coords), bool)
    if box is not None:
        lo, hi = (np.asarray(v, np.int64) for v in box)
        cs = np.asarray(scale.chunk_size, np.int64)
        c0, c1 = lo // cs, -(-hi // cs)  # chunks intersecting [lo, hi)
        keep &= ((coords >= c0) & (coords < c1)).all(axis=1)
    if chunks is not None:
        want = np.asarray(chunks, np.int64).reshape(-1, 3)
        keep &= np.isin(pack_keys(coords), pack_keys(want))
    return keep


def select_rows(shard, scale: Scale, box=None, chunks=None) -> np.ndarray:
    """Record numbers of a loaded shard in a voxel box and/or a chunk list, by chunk look-up.

    A small selection costs its own size (``Shard.find``), not the shard's; a box larger than
    the shard's record count is filtered over the records instead.
    """
    rows = None
    if chunks is not None:
        found = (shard.find(*(int(v) for v in c)) for c in np.asarray(chunks, np.int64).reshape(-1, 3))
        rows = np.unique(np.fromiter((r for r in found if r is not None), np.int64))
    if box is not None:
        cs = np.asarray(scale.chunk_size, np.int64)
        lo, hi = shard.box
        c0 = np.maximum(np.asarray(box[0], np.int64) // cs, lo)
        c1 = np.minimum(-(-np.asarray(box[1], np.int64) // cs), hi)
        n = int(np.prod(np.maximum(c1 - c0, 0)))
        if n <= 2 * len(shard):
            import itertools

            found = (shard.find(x, y, z) for z, y, x in itertools.product(*(range(int(a), int(b)) for a, b in
                                                                            zip(c0[::-1], c1[::-1], strict=True))))
            in_box = np.fromiter((r for r in found if r is not None), np.int64)
        else:
            in_box = np.flatnonzero(_chunk_filter(shard.coords, scale, box=box))
        rows = np.sort(in_box) if rows is None else np.intersect1d(rows, in_box)
    return np.arange(len(shard)) if rows is None else rows


def record_batches(table: RecordTable, scale: Scale, origin, *, rows=None, only: Iterable[int] | None = None,
                   box=None, chunks=None, batch_rows: int = BATCH_ROWS, columns=None, check: bool = True
                   ) -> Iterator[tuple[pa.RecordBatch, dict]]:
    """One DVID shard's records as record batches sorted by (shard_id, morton).

    Yields ``(batch, meta)``; batches never span two shard ids, and the last batch of each
    shard id has ``meta = {"shard_id", "origin", "records", "end": True}`` (``{}``
    otherwise).  ``rows`` preselects records (see `select_rows`), else ``box`` (voxels) and
    ``chunks`` filter them; ``only`` keeps some shard ids; with ``check`` every payload's
    zstd frame header is checked first.
    """
    for batches, meta in record_spans(table, scale, origin, rows=rows, only=only, box=box, chunks=chunks,
                                      batch_rows=batch_rows, columns=columns, check=check):
        for x in batches[:-1]:
            yield x, {}
        yield batches[-1], meta


def record_spans(table: RecordTable, scale: Scale, origin, *, rows=None, only: Iterable[int] | None = None,
                 box=None, chunks=None, batch_rows: int = BATCH_ROWS, columns=None, check: bool = True
                 ) -> Iterator[tuple[list[pa.RecordBatch], dict]]:
    """`record_batches` a gathered span at a time: (batches, meta of the last batch).

    The batches of a span are zero-copy slices of one gather of about `GATHER_BYTES`; a span
    never crosses a shard id, and only a span's last batch can end one.
    """
    coords = table.coords
    if rows is not None:
        rows = np.asarray(rows, np.int64)
    elif box is not None or chunks is not None:
        rows = np.flatnonzero(_chunk_filter(coords, scale, box, chunks))
    else:
        rows = np.arange(len(coords))
    sid, mor = record_keys(scale, coords[rows])
    if only is not None:
        keep = np.isin(sid, np.fromiter(only, np.int64))
        rows, sid, mor = rows[keep], sid[keep], mor[keep]
    order = np.lexsort((mor, sid))
    rows, sid, mor = rows[order], sid[order], mor[order]
    if check:
        _check_frames(table, rows)
    o = [int(v) for v in origin]
    cuts = np.flatnonzero(np.diff(sid)) + 1
    for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), len(rows)], strict=True):
        if a == b:
            continue
        s, n = int(sid[a]), b - a
        for k, e in _gather_spans(table, rows, a, b, batch_rows):
            big = records_to_batch(table, rows[k:e], sid[k:e], mor[k:e], columns)
            parts = [big] if e - k <= batch_rows else \
                [big.slice(j - k, min(batch_rows, e - j)) for j in range(k, e, batch_rows)]
            yield parts, ({"shard_id": s, "origin": o, "records": n, "end": True} if e == b else {})


def _gather_spans(table: RecordTable, rows: np.ndarray, a: int, b: int, batch_rows: int) -> list[tuple[int, int]]:
    """Row spans [k, e) of rows[a:b], whole batches each, of about `GATHER_BYTES` of records.

    A stream's batches are zero-copy slices of one gathered span: one numba gather and one
    set of Arrow arrays per few MB instead of per batch (the per-batch cost bounded the
    1-row and 256-row streams; the IPC writer sends a slice's own bytes only).
    """
    r = table.rec[rows[a:b]]
    size = np.cumsum(r[:, ipc.R_PAYLEN] + 8 * (r[:, ipc.R_NLAB] + r[:, ipc.R_NSV]))
    ends = np.append(np.arange(batch_rows, b - a, batch_rows), b - a)  # batch ends, relative to a
    spans, k, base = [], 0, 0
    for e in ends.tolist():
        if size[e - 1] - base >= GATHER_BYTES or e == b - a:
            spans.append((a + k, a + e))
            k, base = e, int(size[e - 1])
    return spans


def partition_plan(origins_by_id: dict[int, list], partition: int, of: int, skip=()) -> list[tuple[int, tuple]]:
    """(shard_id, origin) pairs of a partition (``shard_id % of == partition``), in shard order."""
    skip = {int(s) for s in skip}
    out: list[tuple[int, tuple]] = []
    for s in sorted(origins_by_id):
        if s % of == partition and s not in skip:
            out.extend((s, o) for o in origins_by_id[s])
    return out


def origins_by_shard_id(scale: Scale, origins) -> dict[int, list]:
    """{shard_id: [DVID shard origins holding it]} of the present DVID shards."""
    out: dict[int, list] = {}
    for o in origins:
        for s in shard_ids(scale, o).tolist():
            out.setdefault(int(s), []).append(tuple(int(v) for v in o))
    return out


# --- cells --------------------------------------------------------------------------------------


def split_cells(batch: pa.RecordBatch, cell_limit: int = CELL_LIMIT, where: str = "") -> pa.RecordBatch:
    """A stream batch in the table's schema: payloads over ``cell_limit`` split over bin1..bin4.

    A split row has a null ``dvid_compressed_block``; an unsplit row null bins.  A payload
    over four cells raises `CellLimitError` naming its chunk.
    """
    import pyarrow.compute as pc

    if cell_limit < 1:
        raise SpecError(f"cell_limit must be positive, got {cell_limit}")
    pay = batch.column("dvid_compressed_block")
    n = batch.num_rows
    lens = pc.binary_length(pay).to_numpy(zero_copy_only=False) if n else np.zeros(0, np.int64)
    big = np.flatnonzero(lens > cell_limit)
    cols = {name: batch.column(name) for name in batch.schema.names}
    if not big.size:
        bins = [pa.nulls(n, pa.binary()) for _ in BINS]
    else:
        over = big[lens[big] > 4 * cell_limit]
        if over.size:
            i = int(over[0])
            c = tuple(int(batch.column(a)[i].as_py()) for a in ("chunk_x", "chunk_y", "chunk_z"))
            raise CellLimitError(f"{where + ': ' if where else ''}chunk {c}: its payload is {int(lens[i])} bytes, "
                                 f"more than 4 cells of {cell_limit} bytes (bin1..bin4); raise the cell limit")
        mask = np.zeros(n, bool)
        mask[big] = True
        data, starts, ends = _binary_parts(pay)
        bins = []
        for k in range(4):
            a = starts + k * cell_limit
            valid = mask & (a < ends)
            lens = np.where(valid, np.minimum(a + cell_limit, ends) - a, 0)
            out, offs = _gather(data, np.where(valid, a, 0), lens)
            bits = pa.py_buffer(np.packbits(valid, bitorder="little"))
            bins.append(pa.Array.from_buffers(pa.binary(), n, [bits, pa.py_buffer(offs.astype(np.int32)),
                                                               pa.py_buffer(out)], null_count=int(n - valid.sum())))
        if not pa.types.is_binary(pay.type):
            pay = pay.cast(pa.binary())
        pay = pc.if_else(pa.array(mask), pa.scalar(None, pa.binary()), pay)
    cols["dvid_compressed_block"] = pay
    arrays = [cols[f.name] if f.name not in BINS else bins[BINS.index(f.name)] for f in TABLE_SCHEMA]
    return pa.RecordBatch.from_arrays(arrays, schema=TABLE_SCHEMA)


def _binary_parts(arr) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(data bytes, start offsets, end offsets) of a binary array (its slice respected)."""
    large = pa.types.is_large_binary(arr.type)
    bufs = arr.buffers()
    data = np.frombuffer(bufs[2], np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
    raw = np.frombuffer(bufs[1], np.int64 if large else np.int32)[arr.offset:arr.offset + len(arr) + 1]
    offs = raw.astype(np.int64)
    return data, offs[:-1], offs[1:]


def normalise_records(table, path: str, scale: Scale | None = None, check_keys: bool = True) -> RecordTable:
    """A RecordTable from a table or batch of records (bins reassembled, keys checked)."""
    if isinstance(table, pa.RecordBatch):
        table = pa.Table.from_batches([table])
    present = [b for b in BINS if b in table.schema.names]
    if present and all(table.column(b).null_count == table.num_rows for b in present):
        table = table.drop_columns(present)  # nothing split here: payloads stay zero-copy
    names = table.schema.names
    if check_keys and scale is not None and "shard_id" in names and "morton" in names and table.num_rows:
        coords = coords_of(table, path)
        sid, mor = record_keys(scale, coords)
        got_s = table.column("shard_id").to_numpy().astype(np.int64)
        got_m = table.column("morton").to_numpy().astype(np.int64)
        bad = np.flatnonzero((got_s != sid) | (got_m != mor))
        if bad.size:
            i = int(bad[0])
            raise ChunkIndexError(f"{path}: chunk {tuple(int(v) for v in coords[i])} is stored with shard_id "
                                  f"{got_s[i]}, morton {got_m[i]} but scale {scale.index}'s spec gives "
                                  f"{sid[i]}, {mor[i]}: the table was written with another spec")
    cs = scale.chunk_size if scale is not None else (64, 64, 64)
    return RecordTable.from_batch(table, path, cs)


# --- Parquet files ------------------------------------------------------------------------------


def _file_name(shard_id: int, origin) -> str:
    return f"{int(shard_id)}_{int(origin[0])}_{int(origin[1])}_{int(origin[2])}.parquet"


def _parquet_options() -> dict:
    compress = {c: ("zstd" if c in ("labels", "supervoxels", "shard_id", "morton", "chunk_x", "chunk_y",
                                    "chunk_z", "uncompressed_size") else "none") for c in TABLE_SCHEMA.names}
    # bin1's statistics are for its null count: a look-up skips the bins of a row group without
    # split payloads (min/max of payloads over 4 KB are not stored)
    return dict(compression=compress, use_dictionary=False,
                write_statistics=["shard_id", "morton", "chunk_x", "chunk_y", "chunk_z", "bin1"])


class TableFileWriter:
    """One shard's Parquet file, written aside and renamed into place when complete."""

    def __init__(self, folder: str, shard_id: int, origin, scale: Scale, row_group_size: int, cell_limit: int):
        import pyarrow.parquet as pq

        self.final = os.path.join(folder, _file_name(shard_id, origin))
        self.tmp = os.path.join(folder, f".{_file_name(shard_id, origin)}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        self.shard_id, self.origin, self.rg, self.cell_limit = int(shard_id), tuple(origin), row_group_size, cell_limit
        meta = {"version": TABLE_VERSION, "scale": scale.index, "shard_id": self.shard_id,
                "origin": list(self.origin)}
        self.schema = TABLE_SCHEMA.with_metadata({_META_KEY: json.dumps(meta).encode()})
        self.w = pq.ParquetWriter(self.tmp, self.schema, **_parquet_options())
        self.pending: list[pa.RecordBatch] = []
        self.npending = 0
        self.rows = 0
        self.bytes = 0

    def add(self, batch: pa.RecordBatch) -> None:
        b = split_cells(batch, self.cell_limit, self.final)
        self.pending.append(b)
        self.npending += b.num_rows
        self.rows += b.num_rows
        self.bytes += b.nbytes
        if self.npending >= self.rg:
            self._flush(final=False)

    def _flush(self, final: bool) -> None:
        if not self.pending:
            return
        t = pa.Table.from_batches(self.pending, schema=self.schema)
        whole = (t.num_rows // self.rg) * self.rg if not final else t.num_rows
        if whole:
            self.w.write_table(t.slice(0, whole), row_group_size=self.rg)
        rest = t.slice(whole)
        self.pending = rest.to_batches() if rest.num_rows else []
        self.npending = rest.num_rows

    def close(self) -> str:
        self._flush(final=True)
        self.w.close()
        os.replace(self.tmp, self.final)
        return self.final

    def abort(self) -> None:
        try:
            self.w.close()
        except Exception:  # noqa: BLE001 - already failing
            pass
        try:
            os.unlink(self.tmp)
        except OSError:
            pass


def write_table_info(root: str, spec: dict, *, complete: bool, extra: dict | None = None) -> None:
    """Write ``root/info``: the spec plus the table's own section (atomically)."""
    d = dict(spec)
    d["dvidshards_table"] = {"version": TABLE_VERSION, "complete": bool(complete), **(extra or {})}
    tmp = os.path.join(root, f".info.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(d, f, indent=1)
        f.write("\n")
    os.replace(tmp, os.path.join(root, "info"))


def read_table_info(root: str) -> dict | None:
    """The table section and spec of a table folder, or None when it is not one."""
    path = os.path.join(root, "info")
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        d = parse_json(f.read(), path)
    return d if isinstance(d.get("dvidshards_table"), dict) else None


def table_files(root: str, scale: int) -> dict[int, tuple[tuple, str]]:
    """{shard_id: (origin, path)} of the complete shard files of a scale folder."""
    folder = os.path.join(root, f"s{scale}")
    out: dict[int, tuple[tuple, str]] = {}
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return out
    for name in names:
        m = _FILE.match(name)
        if m:
            s, x, y, z = (int(g) for g in m.groups())
            if s in out:
                raise ChunkIndexError(f"{folder}: two files for shard id {s}")
            out[s] = ((x, y, z), os.path.join(folder, name))
    return out


# --- reading tables ----------------------------------------------------------------------------


def as_arrow_table(obj) -> pa.Table:
    if isinstance(obj, pa.Table):
        return obj
    if isinstance(obj, pa.RecordBatch):
        return pa.Table.from_batches([obj])
    if isinstance(obj, pa.RecordBatchReader):
        return obj.read_all()
    if hasattr(obj, "to_table") and not hasattr(obj, "__arrow_c_stream__"):  # pyarrow.dataset
        return obj.to_table()
    if hasattr(obj, "__arrow_c_stream__"):
        return pa.RecordBatchReader.from_stream(obj).read_all()
    raise SpecError(f"cannot read a {type(obj).__name__} as a table of block records")


def coords_of(table, where: str = "the table") -> np.ndarray:
    names = table.schema.names
    for base in ("chunk_", "block_coord_"):
        cols = [base + a for a in "xyz"]
        if all(c in names for c in cols):
            break
    else:
        raise ShardFormatError(f"{where} has no chunk_x/y/z (or block_coord_x/y/z) columns: {names}")
    out = []
    for c in cols:
        col = table.column(c)
        if not pa.types.is_integer(col.type) or col.null_count:
            raise ShardFormatError(f"{where}: column {c!r} must hold integers without nulls ({col.type})")
        out.append(np.asarray(col.to_numpy(zero_copy_only=False), np.int64))
    return np.stack(out, axis=1) if out[0].size else np.zeros((0, 3), np.int64)


def spec_from(spec, schema: pa.Schema | None) -> dict | None:
    if spec is not None:
        if isinstance(spec, dict):
            return spec
        path = os.fspath(spec)
        try:
            with open(path, "rb") as f:
                return parse_json(f.read(), path)
        except OSError as e:
            raise SpecError(f"{path}: cannot read spec ({e.strerror or e})") from None
    meta = (schema.metadata or {}) if schema is not None else {}
    if b"dvidshards.spec" in meta:
        return parse_json(meta[b"dvidshards.spec"], "the table's dvidshards.spec metadata")
    return None
