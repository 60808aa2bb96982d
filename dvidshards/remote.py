"""Exports in cloud storage or on HTTP servers, read with coalesced byte-range requests.

A remote export is reached through a TensorStore kvstore (``gs://``, ``s3://``, ``http(s)://``
or any kvstore spec), so credentials, endpoints and request limits are TensorStore's own
settings.  No file is downloaded whole (legacy C streams come close, see below).  Per shard and
per process (LRU of ``max_shards``):

* variants A and B: the CSV once, then the schema message ``[0, schema_size)`` once;
* variant D (IPC file + ``CHUNKIDX`` footer, no CSV): a probe for the CSV, the last 64 KiB
  (the footer, the JSON index and the IPC file footer; exact suffix reads when they are
  larger) and the first 4 KiB (the schema): three requests;
* variant C: the CSV and the first 4 KiB; an IPC *file* adds the last 64 KiB (its footer); an
  IPC *stream* has no record-batch offsets anywhere, so its message headers are scanned once
  in windows of 1 MiB growing to 16 MiB (bodies larger than a window are skipped, smaller
  ones read through: about the whole file for DVID's small records, plus the partial last
  window twice, since its size is learnt from the failed request).  Convert such indexes to
  variant A to avoid that cost.  For C and D, record-batch row counts come from the batch
  headers (their first 4 KiB, merged like chunk reads) unless every batch holds one record
  (DVID's default), which is then checked on every read.

Chunk reads then fetch only the record batch messages that hold the chunks: the chunks of one
TensorStore read that fall in one shard are gathered for a moment (a 1 ms debounce, at most
10 ms), their batch messages merged into as few requests as possible (gaps up to
``RemoteChunkReader.gap`` bytes, at most ``max_request`` bytes per request), fetched
concurrently in one ``ts.Batch``, and decoded on a small thread pool (zstd and the numba
decoder release the GIL).  The TensorStore callback never blocks: it hands the chunk to a
per-process asyncio loop thread and returns a ``ts.Future``.  Payloads are not cached unless
a byte budget is given (``KvStoreSource(..., cache_bytes=N)``).

Failures: TensorStore retries transient HTTP failures itself (its ``*_request_retries``
context resources; bounded defaults are set here when the user gives none), and every read
is retried again a bounded number of times with exponential backoff, including a value
shorter than the range asked for, which is never decoded.  A persistent failure raises
``RemoteReadError`` naming the URL and byte range; a missing object ``MissingShardError``.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections import OrderedDict

import numpy as np
import tensorstore as ts

from .formats import arrowipc as ipc
from .errors import ChunkIndexError, MissingShardError, ShardFormatError
from .index import RawIndex, ShardIndex, footer_length, pack_key, pack_keys, parse_csv, parse_footer
from .kvsource import KvStoreSource, _decode_pool, _PastEnd, background_loop, run_sync
from .shardfile import AGGLOMERATED, SUPERVOXELS, decode_record, decompress_block, max_block_bytes
from .sources import ByteSource

__all__ = ["KvStoreSource", "RemoteChunkReader", "RemoteShard", "background_loop", "run_sync"]

_WINDOW, _WINDOW_MAX = 1 << 20, 16 << 20  # stream scan window: first and largest
_HEADER_PROBE = 4096  # bytes read to find a record batch's row count in its header
_HEAD, _TAIL = 4 << 10, 64 << 10  # speculative first reads of a legacy shard's head and tail

# async access to any ByteSource (sync ones run on the default executor)


async def _aread(source: ByteSource, key: str, start=None, stop=None) -> bytes:
    if hasattr(source, "read_async"):
        return await source.read_async(key, start, stop)
    return await asyncio.get_running_loop().run_in_executor(None, source.read, key, start, stop)


async def _aread_many(source: ByteSource, key: str, ranges, return_exceptions: bool) -> list:
    if hasattr(source, "read_many_async"):
        return await source.read_many_async(key, ranges, return_exceptions=return_exceptions)
    return await asyncio.gather(*(_aread(source, key, a, b) for a, b in ranges), return_exceptions=return_exceptions)


async def _aexists(source: ByteSource, key: str) -> bool:
    if hasattr(source, "exists_async"):
        return await source.exists_async(key)
    return await asyncio.get_running_loop().run_in_executor(None, source.exists, key)


# --- a shard over byte ranges ---------------------------------------------------------------------

_CONTINUATION = 0xFFFFFFFF
_RECORD_BATCH = 3


def _header_rows(b: np.ndarray, off: int, end: int) -> tuple[int, int, int, int, int]:
    """(code, message length incl. prefix, body length, header type, rows) from a message's header only.

    Uses arrowipc's checked flatbuffer readers; ``b[off:end]`` must hold the prefix and metadata.
    """
    code, mlen, body, htype, hdr = (int(v) for v in ipc._message(b, off, end))
    if code != 0:
        return code, mlen, 0, 0, 0
    if htype != _RECORD_BATCH:
        return 4, htype, 0, htype, 0
    lo = off + (8 if int.from_bytes(b[off:off + 4].tobytes(), "little") == _CONTINUATION else 4)
    q = int(ipc._field(b, hdr, 0, lo, off + mlen))
    if q < 0 or q + 8 > off + mlen:
        return 3, 0, 0, htype, 0
    rows = int.from_bytes(b[q:q + 8].tobytes(), "little", signed=True) if q > 0 else 0
    return 0, mlen, body, htype, rows


def _prefix(head: bytes, off: int, where: str) -> tuple[int, int]:
    """(prefix length, metadata length) of the IPC message starting at head[off:off + 8]."""
    if len(head) < off + 8:
        raise ShardFormatError(f"{where}: {len(head)} bytes is too short for an Arrow IPC shard")
    first = int.from_bytes(head[off:off + 4], "little")
    if first == _CONTINUATION:
        return 8, int.from_bytes(head[off + 4:off + 8], "little", signed=True)
    return 4, int.from_bytes(head[off:off + 4], "little", signed=True)


def _merge(ranges, gap: int, max_bytes: int) -> list[list]:
    """Merge (start, stop, item) ranges closer than gap into [start, stop, items] groups."""
    out: list[list] = []
    for a, b, item in sorted(ranges, key=lambda r: r[0]):
        if out and a - out[-1][1] <= gap and max(b, out[-1][1]) - out[-1][0] <= max_bytes:
            g = out[-1]
            g[1] = max(g[1], b)
            g[2].append(item)
        else:
            out.append([a, b, [item]])
    return out


def _c(c) -> tuple[int, ...]:
    return tuple(int(v) for v in c)


class _Window:
    """Sequential windowed reads of one object whose size is unknown until its end is met."""

    def __init__(self, source: ByteSource, key: str, head: bytes = b"", whole: bool = False):
        self.source, self.key, self.window = source, key, _WINDOW
        self.buf, self.base = head, 0
        self.total = len(head) if whole else None

    async def need(self, p: int, n: int) -> bool:
        """Make bytes [p, p + n) available in buf (False: the object ends before p + n)."""
        if self.base <= p and p + n <= self.base + len(self.buf):
            return True
        if self.total is not None and p + n > self.total:
            return False
        stop = p + max(n, self.window)
        if self.total is not None:
            stop = min(stop, self.total)
        try:
            self.buf, self.base = await _aread(self.source, self.key, p, stop), p
            self.window = min(2 * self.window, _WINDOW_MAX)
            return True
        except _PastEnd as e:
            if e.total_size is not None and self.total is None:
                self.total = e.total_size
                return await self.need(p, n)
            if stop > p + n:
                try:
                    self.buf, self.base = await _aread(self.source, self.key, p, p + n), p
                    return True
                except _PastEnd:
                    return False
            return False


class RemoteShard:
    """A shard read with byte-range requests: index and schema in memory, records on demand.

    Parameters
    ----------
    source : ByteSource
        Where the files are (any source; ``KvStoreSource`` for cloud and http).
    stem : str
        Key of the shard without extension, e.g. ``"s0/0_0_0"``.
    chunk_size : tuple of int
        Chunk shape (x, y, z) in voxels.
    box : tuple or None
        ``(lo, hi)`` chunk coordinates the shard's name says it covers; index entries outside
        are errors.

    Notes
    -----
    The constructor blocks on the I/O loop; ``await RemoteShard.open_async(...)`` is its
    async twin.  Each record is checked when it is read (its coordinates must be the index's)
    rather than all at load, since that would read the whole shard.
    """

    def __init__(self, source: ByteSource, stem: str, chunk_size=(64, 64, 64), box=None):
        self._setup(source, stem, chunk_size, box)
        run_sync(self._load())

    @classmethod
    async def open_async(cls, source: ByteSource, stem: str, chunk_size=(64, 64, 64), box=None) -> RemoteShard:
        """Load a shard's schema and index on the running loop."""
        self = cls.__new__(cls)
        self._setup(source, stem, chunk_size, box)
        await self._load()
        return self

    def _setup(self, source, stem, chunk_size, box) -> None:
        self.source = source
        self.stem = stem
        self.key = stem + ".arrow"
        self.path = source.describe(self.key)
        self.chunk_size = tuple(int(c) for c in chunk_size)
        self._max_block = max_block_bytes(self.chunk_size)
        self._box = box
        # legacy variants: the first bytes and the last bytes of the file, read once while loading
        self._headbuf = self._tailbuf = b""
        self._whole = False

    def __len__(self) -> int:
        return len(self.index)

    def __repr__(self) -> str:
        return f"RemoteShard({self.path!r}, variant={self.variant}, chunks={len(self)})"

    # --- loading -----------------------------------------------------------------------------

    async def _load(self) -> None:
        src, where = self.source, self.path
        csv_key = self.stem + ".csv"
        try:
            text = await _aread(src, csv_key)
        except MissingShardError:
            text = None
        if text is not None:
            raw = parse_csv(text, src.describe(csv_key))
            schema, schema_len, is_file = await self._schema(raw.schema_size, src.describe(csv_key))
            trailer = 0
        else:
            await self._speculate(tail=True, missing=f"no such shard file (nor {csv_key})")
            tail = await self._tail(16, "a CHUNKIDX footer")
            n = footer_length(tail, 1 << 62, where)
            if n is None:
                raise ChunkIndexError(f"{where}: no chunk index (neither {self.stem}.csv nor a CHUNKIDX footer)")
            blob = await self._tail(16 + n, f"its {n}-byte CHUNKIDX footer", chunk_error=True)
            raw = parse_footer(blob[:n], self.chunk_size, where)
            schema, schema_len, is_file = await self._schema(None, None)
            trailer = 16 + n
        if raw.variant in ("A", "B"):
            index = ShardIndex.from_raw(raw, where)
        elif is_file:
            index = ShardIndex.from_raw(raw, where, await self._file_batches(trailer, raw))
        else:
            index = ShardIndex.from_raw(raw, where, await self._stream_batches(schema_len, raw))
        self._headbuf = self._tailbuf = b""
        self.layout = ipc.SchemaLayout(schema, where)
        self.variant, self.index, self.schema_size = index.variant, index, schema_len
        self._check_box()
        self._lookup = dict(zip(pack_keys(index.coords).tolist(), range(len(index)), strict=True))

    async def _speculate(self, *, tail: bool, missing: str = "no such shard file") -> None:
        """Read up to _TAIL last (or _HEAD first) bytes in one request; the whole file if shorter.

        Unknown sizes (a driver that does not report them) leave the buffer empty: exact reads follow.
        """
        if self._whole or (self._tailbuf if tail else self._headbuf):
            return
        k = _TAIL if tail else _HEAD
        try:
            buf = await _aread(self.source, self.key, *((-k, None) if tail else (0, k)))
        except MissingShardError:
            raise MissingShardError(f"{self.path}: {missing}") from None
        except _PastEnd as e:
            if e.total_size is None or e.total_size >= k:
                return
            buf = await _aread(self.source, self.key, 0, e.total_size) if e.total_size else b""
            self._headbuf = self._tailbuf = buf
            self._whole = True
            return
        if tail:
            self._tailbuf = buf
        else:
            self._headbuf = buf

    async def _tail(self, n: int, what: str, *, chunk_error: bool = False) -> bytes:
        err = ChunkIndexError if chunk_error else ShardFormatError
        if len(self._tailbuf) >= n:
            return self._tailbuf[len(self._tailbuf) - n:]
        if self._whole:
            raise err(f"{self.path}: the file ({len(self._tailbuf)} bytes) is shorter than {what} ({n} bytes)")
        try:
            return await _aread(self.source, self.key, -n, None)
        except MissingShardError:
            raise MissingShardError(f"{self.path}: no such shard file") from None
        except _PastEnd:
            raise err(f"{self.path}: the file is shorter than {what} ({n} bytes)") from None

    async def _head(self, stop: int) -> bytes:
        if len(self._headbuf) >= stop:
            return self._headbuf[:stop]
        if self._whole:
            raise ShardFormatError(f"{self.path}: the file ends inside its {stop}-byte schema")
        try:
            return await _aread(self.source, self.key, 0, stop)
        except MissingShardError:
            raise MissingShardError(f"{self.path}: no such shard file") from None
        except _PastEnd:
            raise ShardFormatError(f"{self.path}: the file ends inside its {stop}-byte schema") from None

    async def _schema(self, hint: int | None, csv_where: str | None):
        """(schema, schema message length, is IPC file); one read when the CSV gives the size."""
        where = self.path
        if hint is not None:
            head = await self._head(max(hint, 8))
            if not ipc.is_ipc_file(head[:6]):
                try:
                    schema, n = ipc.schema_from_message(head, 0, where)
                except ShardFormatError:
                    pass  # diagnosed below
                else:
                    if n != hint:
                        raise ChunkIndexError(f"{csv_where}: schema_size={hint} but the schema message in "
                                              f"{where} is {n} bytes")
                    return schema, n, False
        await self._speculate(tail=False)
        first = await self._head(16)
        is_file = ipc.is_ipc_file(first[:6])
        off = 8 if is_file else 0
        prefix, meta = _prefix(first, off, where)
        if meta <= 0 or meta > 1 << 24:
            raise ShardFormatError(f"{where}: no Arrow schema message at byte {off}")
        head = await self._head(off + prefix + meta)
        schema, n = ipc.schema_from_message(head, off, where)
        if hint is not None and not is_file and n != hint:
            raise ChunkIndexError(f"{csv_where}: schema_size={hint} but the schema message in {where} is {n} bytes")
        return schema, n, is_file

    async def _file_batches(self, trailer: int, raw: RawIndex):
        """Record batches listed in the IPC file footer ending ``trailer`` bytes before the end."""
        where = self.path
        await self._speculate(tail=True)
        end10 = await self._tail(trailer + 10, "an Arrow IPC file footer")
        if end10[4:10] != ipc.ARROW_MAGIC:
            raise ShardFormatError(f"{where}: Arrow IPC file does not end with the ARROW1 magic")
        flen = int.from_bytes(end10[:4], "little", signed=True)
        if flen <= 0:
            raise ShardFormatError(f"{where}: malformed Arrow IPC file footer")
        tail = await self._tail(trailer + 10 + flen + 8, "its Arrow IPC file footer")
        offs, lens = ipc.file_footer_blocks(tail, len(tail) - trailer, where)
        return offs, lens, await self._batch_rows(offs, lens, raw)

    async def _batch_rows(self, offs: np.ndarray, lens: np.ndarray, raw: RawIndex) -> np.ndarray:
        n = len(offs)
        if n == len(raw.coords) and (n == 0 or int(raw.rec.max()) == n - 1):
            return np.ones(n, np.int64)  # one record per batch (DVID's default), checked per read
        where = self.path
        probes = [(int(o), int(o) + int(min(ln, _HEADER_PROBE)), k) for k, (o, ln) in enumerate(zip(offs, lens, strict=True))]
        groups = _merge(probes, RemoteChunkReader.gap, RemoteChunkReader.max_request)
        bufs = await _aread_many(self.source, self.key, [(g[0], g[1]) for g in groups], False)
        rows = np.empty(n, np.int64)
        for g, buf in zip(groups, bufs, strict=True):
            b = np.frombuffer(buf, np.uint8)
            for k in g[2]:
                off = int(offs[k]) - g[0]
                code, a, _, _, r = _header_rows(b, off, min(len(b), off + int(lens[k])))
                if code == 1:  # header longer than the probe
                    whole = await _aread(self.source, self.key, int(offs[k]), int(offs[k] + lens[k]))
                    code, a, _, _, r = _header_rows(np.frombuffer(whole, np.uint8), 0, len(whole))
                if code:
                    ipc._raise(code, int(offs[k]), a, where)
                rows[k] = r
        return rows

    async def _stream_batches(self, start: int, raw: RawIndex):
        """Scan the stream's message headers from start (no offsets are stored anywhere)."""
        where = self.path
        w = _Window(self.source, self.key, self._headbuf, self._whole)
        offs, lens, rows = [], [], []
        p = start
        while await w.need(p, 8):
            prefix, meta = _prefix(w.buf, p - w.base, where)
            if meta == 0:
                break  # end-of-stream marker
            if meta < 0 or not await w.need(p, prefix + meta):
                raise ShardFormatError(f"{where}: Arrow message at byte {p} runs past the end of the file")
            b = np.frombuffer(w.buf, np.uint8)
            code, mlen, body, _, r = _header_rows(b, p - w.base, p - w.base + prefix + meta)
            if code:
                ipc._raise(code, p, mlen, where)
            offs.append(p)
            lens.append(mlen + body)
            rows.append(r)
            p += mlen + body
        return (np.array(offs, np.int64), np.array(lens, np.int64), np.array(rows, np.int64))

    def _check_box(self) -> None:
        if self._box is None or not len(self.index):
            return
        lo, hi = (np.asarray(v) for v in self._box)
        got = self.index.coords
        out = np.flatnonzero(((got < lo) | (got >= hi)).any(axis=1))
        if out.size:
            i = int(out[0])
            raise ChunkIndexError(f"{self.path}: chunk {_c(got[i])} lies outside the shard its file name says "
                                  f"(chunks {tuple(lo.tolist())} to {tuple((hi - 1).tolist())})")

    # --- reading -----------------------------------------------------------------------------

    def find(self, x: int, y: int, z: int) -> int | None:
        """Record number of chunk (x, y, z), None when the shard does not hold it (background)."""
        return self._lookup.get(pack_key(x, y, z))

    def batch(self, i: int) -> tuple[int, int]:
        """(file offset, length) of the record batch message holding record i."""
        return int(self.index.msg_off[i]), int(self.index.msg_len[i])

    def where(self, i: int) -> str:
        return f"{self.path}: chunk {_c(self.index.coords[i])}"

    def resolve(self, buf, base: int, i: int) -> np.ndarray:
        """Locate record i inside buf (bytes from file offset base holding its batch message)."""
        ix = self.index
        rec = ipc.resolve_rows(buf, base, ix.msg_off[i:i + 1], ix.msg_len[i:i + 1], ix.row[i:i + 1], self.layout,
                               self.path, chunks=ix.coords[i:i + 1])[0]
        if (rec[ipc.R_CX:ipc.R_CZ + 1] != ix.coords[i]).any():
            raise ChunkIndexError(f"{self.path}: index says chunk {_c(ix.coords[i])} but its record holds chunk "
                                  f"{_c(rec[ipc.R_CX:ipc.R_CZ + 1])}")
        return rec

    def decode_into(self, buf, base: int, i: int, out: np.ndarray, mode: int = AGGLOMERATED, mapping=None) -> None:
        """Resolve, decompress and decode record i (its batch is in buf) into out (z, y, x)."""
        rec = self.resolve(buf, base, i).tolist()
        u8 = np.frombuffer(buf, np.uint8)
        where = self.where(i)
        pay = rec[ipc.R_PAY] - base
        block = decompress_block(u8[pay:pay + rec[ipc.R_PAYLEN]], rec[ipc.R_USIZE], self._max_block, where)
        if mode == AGGLOMERATED:
            palette = _u64(u8, rec[ipc.R_LAB] - base, rec[ipc.R_NLAB])
        elif mode == SUPERVOXELS:
            palette = None
        else:
            palette = mapping.palette(_u64(u8, rec[ipc.R_SV] - base, rec[ipc.R_NSV]))
        decode_record(block, palette, out, where)

    def range_error(self, e: BaseException, i: int) -> BaseException:
        """The error to report for record i when fetching its batch failed with e."""
        if isinstance(e, _PastEnd):
            off, n = self.batch(i)
            return ChunkIndexError(f"{self.where(i)}: its index entry points at bytes [{off}, {off + n}), past "
                                   f"the end of the file")
        return e

    async def fetch_async(self, i: int) -> bytes:
        """The batch message holding record i."""
        off, n = self.batch(i)
        try:
            return await _aread(self.source, self.key, off, off + n)
        except _PastEnd as e:
            raise self.range_error(e, i) from None

    async def read_into_async(self, x: int, y: int, z: int, out: np.ndarray, mode: int = AGGLOMERATED,
                              mapping=None) -> bool:
        """Async ``read_into`` (one request; the reader batches many chunks instead)."""
        i = self.find(x, y, z)
        if i is None:
            out.fill(0)
            return False
        buf = await self.fetch_async(i)
        await asyncio.get_running_loop().run_in_executor(_decode_pool(), self.decode_into, buf, self.batch(i)[0],
                                                         i, out, mode, mapping)
        return True

    def read_into(self, x: int, y: int, z: int, out: np.ndarray, mode: int = AGGLOMERATED, mapping=None) -> bool:
        """Decode chunk (x, y, z) into out (z, y, x); 0 if absent.  Returns whether the shard held it."""
        i = self.find(x, y, z)
        if i is None:
            out.fill(0)
            return False
        buf = run_sync(self.fetch_async(i))
        self.decode_into(buf, self.batch(i)[0], i, out, mode, mapping)
        return True

    def _record(self, i: int):
        buf = run_sync(self.fetch_async(i))
        base = self.batch(i)[0]
        return buf, base, self.resolve(buf, base, i).tolist()

    def block(self, i: int) -> bytes:
        """The uncompressed DVID block of record i (fetches its batch)."""
        buf, base, rec = self._record(i)
        pay = rec[ipc.R_PAY] - base
        return decompress_block(np.frombuffer(buf, np.uint8)[pay:pay + rec[ipc.R_PAYLEN]], rec[ipc.R_USIZE],
                                self._max_block, self.where(i))

    def labels(self, i: int) -> np.ndarray:
        """The agglomerated label list of record i (fetches its batch)."""
        buf, base, rec = self._record(i)
        return _u64(np.frombuffer(buf, np.uint8), rec[ipc.R_LAB] - base, rec[ipc.R_NLAB]).copy()

    def supervoxels(self, i: int) -> np.ndarray:
        """The supervoxel list of record i (fetches its batch)."""
        buf, base, rec = self._record(i)
        return _u64(np.frombuffer(buf, np.uint8), rec[ipc.R_SV] - base, rec[ipc.R_NSV]).copy()


def _u64(u8: np.ndarray, off: int, n: int) -> np.ndarray:
    v = u8[off:off + 8 * n]
    return v.view(np.uint64) if v.ctypes.data % 8 == 0 else v.copy().view(np.uint64)


# --- the TensorStore read function ----------------------------------------------------------------


class _ByteLRU:
    """Record batch messages by (key, offset), bounded by their total size."""

    def __init__(self, budget: int):
        self.budget = int(budget)
        self.used = 0
        self._d: OrderedDict = OrderedDict()

    def get(self, k):
        v = self._d.get(k)
        if v is not None:
            self._d.move_to_end(k)
        return v

    def put(self, k, v: bytes) -> None:
        if len(v) > self.budget or k in self._d:
            return
        self._d[k] = v
        self.used += len(v)
        while self.used > self.budget:
            _, old = self._d.popitem(last=False)
            self.used -= len(old)


class _Request:
    __slots__ = ("x", "y", "z", "array", "promise", "done")

    def __init__(self, x, y, z, array, promise):
        self.x, self.y, self.z, self.array, self.promise = x, y, z, array, promise
        self.done = False

    def ok(self) -> None:
        if not self.done:
            self.done = True
            self.array = None
            self.promise.set_result(None)

    def fail(self, e: BaseException) -> None:
        if not self.done:
            self.done = True
            self.array = None
            self.promise.set_exception(e)


def _zero(req: _Request) -> None:
    try:
        req.array.fill(0)
    except BaseException as e:
        req.fail(e)
    else:
        req.ok()


def _decode(shard: RemoteShard, buf, base: int, i: int, req: _Request, mode: int, mapping) -> None:
    try:
        shard.decode_into(buf, base, i, req.array.T, mode, mapping)
    except BaseException as e:
        req.fail(e)
    else:
        req.ok()


class _Runtime:
    """A reader's per-process state; lives on the I/O loop thread only."""

    def __init__(self, reader: RemoteChunkReader):
        self.reader = reader
        self.pid = os.getpid()
        self.loop = background_loop()
        self.pool = _decode_pool()
        self.shards: OrderedDict = OrderedDict()
        self.loading: dict = {}
        self.pending: dict = {}
        budget = reader.cache_bytes
        self.cache = _ByteLRU(budget) if budget else None

    def enqueue(self, req: _Request) -> None:
        try:
            origin = self.reader.origin(req.x, req.y, req.z)
        except BaseException as e:
            req.fail(e)
            return
        reqs = self.pending.get(origin)
        if reqs is None:
            self.pending[origin] = [req]
            self.loop.create_task(self.flush(origin))
        else:
            reqs.append(req)

    async def shard(self, origin) -> RemoteShard | None:
        """The loaded shard at origin (None: missing, filled with 0); one load at a time per shard."""
        if origin in self.shards:
            self.shards.move_to_end(origin)
            return self.shards[origin]
        fut = self.loading.get(origin)
        if fut is not None:
            return await asyncio.shield(fut)
        fut = self.loop.create_future()
        self.loading[origin] = fut
        try:
            shard = await self.reader._load_shard(origin)
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # retrieved: waiters re-raise it
            raise
        finally:
            self.loading.pop(origin, None)
        fut.set_result(shard)
        self.shards[origin] = shard
        while len(self.shards) > self.reader.max_shards:
            self.shards.popitem(last=False)
        return shard

    async def flush(self, origin) -> None:
        r = self.reader
        reqs: list[_Request] = []
        try:
            shard = await self.shard(origin)
            # gather the rest of this burst of callbacks for the shard
            t0, n = self.loop.time(), -1
            while len(self.pending[origin]) != n and self.loop.time() - t0 < r.max_wait:
                n = len(self.pending[origin])
                await asyncio.sleep(r.window)
            reqs = self.pending.pop(origin)
            await self.serve(shard, reqs)
        except BaseException as e:
            for q in reqs or self.pending.pop(origin, []):
                q.fail(e)
            if not isinstance(e, Exception):
                raise

    async def serve(self, shard: RemoteShard | None, reqs: list[_Request]) -> None:
        r, pool = self.reader, self.pool
        if shard is None:
            for q in reqs:
                pool.submit(_zero, q)
            return
        by_batch: dict[int, list] = {}
        for q in reqs:
            i = shard.find(q.x, q.y, q.z)
            if i is None:
                pool.submit(_zero, q)
            else:
                by_batch.setdefault(shard.batch(i)[0], []).append((q, i))
        todo = []
        for off, items in by_batch.items():
            data = self.cache.get((shard.key, off)) if self.cache is not None else None
            if data is not None:
                for q, i in items:
                    pool.submit(_decode, shard, data, off, i, q, r.mode, r.mapping)
            else:
                todo.append((off, off + shard.batch(items[0][1])[1], (off, items)))
        if not todo:
            return
        groups = _merge(todo, r.gap, r.max_request)
        results = await _aread_many(shard.source, shard.key, [(g[0], g[1]) for g in groups], True)
        for (a, _, batches), res in zip(groups, results, strict=True):
            if isinstance(res, BaseException):
                for _, items in batches:
                    for q, i in items:
                        q.fail(shard.range_error(res, i))
                continue
            for off, items in batches:
                if self.cache is not None:
                    n = shard.batch(items[0][1])[1]
                    self.cache.put((shard.key, off), res[off - a:off - a + n])
                for q, i in items:
                    pool.submit(_decode, shard, res, a, i, q, r.mode, r.mapping)


class RemoteChunkReader:
    """``read_function`` of the virtual_chunked store of a remote export (byte-range reads).

    Parameters
    ----------
    source : ByteSource
        A non-mappable source, normally ``KvStoreSource``.
    scale : Scale
        Geometry of the scale read.
    mode : int
        ``AGGLOMERATED``, ``SUPERVOXELS`` or ``MAPPED``.
    mapping : LabelMapping or None
        Supervoxel → body mapping for ``MAPPED``.
    fill_missing_shards : bool
        Read a missing shard file as 0 instead of raising MissingShardError.
    max_shards : int
        Shard indexes kept per process (LRU).
    cache_bytes : int, optional
        Byte budget of a record batch cache per process; default the source's
        ``cache_bytes`` (0: none).

    Notes
    -----
    A call returns at once with a ``ts.Future``: the chunk is queued on the per-process I/O
    loop, where the chunks of one shard are fetched together and decoded on a thread pool.
    It therefore needs no ``loop=`` argument and works the same from scripts, Jupyter and
    unpickled copies (an ``async def`` read function would lose its loop when pickled).
    ``await reader.read_async(domain, array)`` is the coroutine form.
    """

    #: merge record batches whose gap is at most this many bytes into one request
    gap = 64 << 10
    #: largest merged request
    max_request = 8 << 20
    #: debounce while gathering the chunks of one shard (s), and its upper bound
    window = 0.001
    max_wait = 0.010

    def __init__(self, source: ByteSource, scale, mode: int, mapping=None, fill_missing_shards: bool = False,
                 max_shards: int = 64, *, cache_bytes: int | None = None):
        if int(max_shards) < 1:
            raise ValueError("max_shards must be at least 1")
        self.source = source
        self.scale = scale
        self.mode = mode
        self.mapping = mapping
        self.fill_missing_shards = bool(fill_missing_shards)
        self.max_shards = int(max_shards)
        self.cache_bytes = int(getattr(source, "cache_bytes", 0) if cache_bytes is None else cache_bytes)
        self._rt: _Runtime | None = None
        self._rt_lock = threading.Lock()

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_rt"] = None
        state["_rt_lock"] = None
        return state

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)
        self._rt_lock = threading.Lock()

    def _runtime(self) -> _Runtime:
        rt = self._rt
        if rt is None or rt.pid != os.getpid():
            with self._rt_lock:
                if self._rt is None or self._rt.pid != os.getpid():
                    self._rt = _Runtime(self)
                rt = self._rt
        return rt

    def origin(self, x: int, y: int, z: int) -> tuple[int, int, int]:
        """Voxel origin of the shard that holds chunk (x, y, z) (GlobalIndex's arithmetic)."""
        s = self.scale.shard_extent
        cx, cy, cz = self.scale.chunk_size
        return (x * cx // s * s, y * cy // s * s, z * cz // s * s)

    async def _load_shard(self, origin) -> RemoteShard | None:
        s = self.scale
        stem = f"{s.folder}/{origin[0]}_{origin[1]}_{origin[2]}"
        try:
            return await RemoteShard.open_async(self.source, stem, s.chunk_size, box=s.shard_box(origin))
        except MissingShardError as e:
            if self.fill_missing_shards and not await _aexists(self.source, stem + ".arrow"):
                return None
            raise MissingShardError(f"{e} (DVID writes no file for an all-background shard: "
                                    f"open with fill_missing_shards=True to read it as 0)") from None

    def shard(self, x: int, y: int, z: int) -> RemoteShard | None:
        """The shard holding chunk (x, y, z) in this process (None: missing, filled with 0)."""
        rt = self._runtime()
        return run_sync(rt.shard(self.origin(x, y, z)))

    @property
    def loaded(self) -> int:
        """How many shard indexes are in memory in this process."""
        return 0 if self._rt is None else len(self._rt.shards)

    def __call__(self, domain: ts.IndexDomain, array: np.ndarray, params=None) -> ts.Future:
        cx, cy, cz = self.scale.chunk_size
        o = domain.origin
        promise, future = ts.Promise.new()
        rt = self._runtime()
        rt.loop.call_soon_threadsafe(rt.enqueue, _Request(o[0] // cx, o[1] // cy, o[2] // cz, array, promise))
        return future

    async def read_async(self, domain: ts.IndexDomain, array: np.ndarray, params=None) -> None:
        """Coroutine form of the read function (usable as an ``async`` read_function with ``loop=``)."""
        await self(domain, array, params)
