"""The read layer: chunk requests over shards, for TensorStore and for bulk reads.

``ChunkReader`` is the one ``virtual_chunked`` read function, for every store.  It holds only
picklable settings; each process opens shards through its own ``ShardCache``.  Stores that never
wait (local files, memory) are read on TensorStore's callback thread; remote stores return a
``ts.Future`` at once and queue the chunk on the per-process I/O loop, where the chunks of a
shard arriving together are merged into as few byte-range requests as possible, fetched
concurrently and decoded on a thread pool.  ``read_box`` is the bulk reader: every chunk of a box
decoded in parallel straight into the caller's array.
"""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import tensorstore as ts
import zstandard

from .consolidated import ConsolidatedIndex, consolidated_paths
from .errors import ChunkIndexError, DvidShardsError, MissingShardError, RemoteReadError, SpecError
from .formats.arrowipc import R_USIZE
from .formats.codec import decode_into, decode_row_into
from .formats.labels import LabelSource
from .formats.multiscale import Scale
from .formats.records import RecordTable, max_block_bytes
from .scalefiles import ScaleFiles, check_origins, list_scale, probe_neighbours
from .shard import Shard, ShardCache, load_shard, merge_ranges, with_chunk
from .sources.base import RecordSource
from .stores.base import ByteStore, background_loop, decode_pool

__all__ = ["ChunkReader", "aligned_empty", "check_scale", "read_box"]

WINDOW, MAX_WAIT = 0.001, 0.010  # s: gather a shard's burst of chunk requests before fetching
_PROBED_SHARDS = 3  # shards per process and scale whose neighbours are probed when nothing was listed (local)
_MISSING_HINT = ("DVID writes no file for an all-background shard: open with fill_missing_shards=True to read "
                 "it as 0")


def _stale(ci: ConsolidatedIndex, what: str) -> ChunkIndexError:
    return ChunkIndexError(f"{ci.path}: the consolidated index is stale: {what}; run `dvidshards consolidate` again")


async def check_scale(store: ByteStore | RecordSource, scale: Scale, consolidated: ConsolidatedIndex | None = None,
                      geometry: str = "the spec") -> ScaleFiles:
    """List a scale's folder once and check its names against the geometry (``list_scale``) and
    a consolidated index: a shard file that appeared since, or is gone, is a ChunkIndexError "the
    consolidated index is stale".  A store that cannot list (http) is not checked here."""
    files = await list_scale(store, scale, geometry, check=False)
    if consolidated is not None and files.origins is not None:
        listed, indexed = set(files.origins), set(consolidated.shards)
        new, gone = sorted(listed - indexed), sorted(indexed - listed)
        if new:
            raise _stale(consolidated, f"it lists no shard {store.describe(scale.stem(new[0]) + '.arrow')}, which "
                                       f"exists now ({len(new)} such files)")
        if gone:
            raise _stale(consolidated, f"{store.describe(scale.stem(gone[0]) + '.arrow')} is gone ({len(gone)} such "
                                       f"files)")
    if files.origins:
        check_origins(scale, files.origins, store, geometry)
    return files


class ChunkReader:
    """``read_function`` of an export scale's virtual_chunked store (pickles without open files).

    Reads ``scale`` of ``store`` as ``labels``; ``fill_missing_shards``: a missing shard file is
    background, not a MissingShardError; ``max_shards``, ``max_bytes``: bounds of the per-process
    shard cache; ``consolidated``: a folder of consolidated indexes; ``policy``: of shard loads
    (None: eager for local stores, lazy for remote); ``geometry``: where the scale's geometry came
    from, for messages ("the spec", ...).

    Each process checks the scale's file names against its geometry: with a consolidated index
    it lists the folder once before its first load (``check_scale``); otherwise it lists
    nothing (opening a 26,500-shard scale must not cost a listing) and, with its first three
    loads (remote: the first, concurrently), probes for files between the grid's origins next
    to that shard (``probe_neighbours``: a spec with larger shards than the export's would read
    their chunks as background).  A check done in this process by whoever built the reader
    (``checked``) counts.  A scale without folder is a SpecError where that is known, unless
    ``fill_missing_shards`` (it reads as 0); elsewhere each missing shard a MissingShardError.
    """

    def __init__(self, store: ByteStore | RecordSource, scale: Scale, labels: LabelSource, *,
                 fill_missing_shards: bool = False, max_shards: int = 64, max_bytes: int = 512 << 20, consolidated: str | None = None,
                 policy: str | None = None, geometry: str = "the spec"):
        if int(max_shards) < 1:
            raise ValueError("max_shards must be at least 1")
        self.store = store
        self.scale = scale
        self.labels = labels
        self.fill_missing_shards = bool(fill_missing_shards)
        self.max_shards = int(max_shards)
        self.max_bytes = int(max_bytes)
        self.consolidated = consolidated
        self.policy = policy
        self.geometry = geometry
        self._state: _ProcState | None = None
        self._state_lock = threading.Lock()
        self._files: tuple[int, ScaleFiles] | None = None  # (pid, check) done by whoever built the reader
        self._hot: tuple | None = None  # the shard the last chunk came from (local stores), see __call__

    def __getstate__(self):
        d = self.__dict__.copy()
        d["_state"] = None
        d["_state_lock"] = None
        d["_hot"] = None
        d["_files"] = None  # never ship the listing with a task: each process checks once
        return d

    def checked(self, files: ScaleFiles) -> None:
        """Take a check of the scale's files done in this process (``Dataset.open``) as this process's."""
        self._files = (os.getpid(), files)
        st = self._state
        if st is not None and st.pid == os.getpid() and st.files is None:
            st.files = files

    async def files(self) -> ScaleFiles:
        """This process's check of the scale's files (``check_scale``), run once per process."""
        st = self._proc()
        if st.files is not None:
            return st.files
        if st.files_error is not None:
            raise st.files_error
        if self.store.immediate:  # never suspends: one thread checks, the others wait for it
            with st.files_lock:
                if st.files is None and st.files_error is None:
                    try:
                        st.files = await check_scale(self.store, self.scale, st.consolidated, self.geometry)
                    except DvidShardsError as e:
                        st.files_error = e
                        raise
                if st.files_error is not None:
                    raise st.files_error
                assert st.files is not None
                return st.files
        if st.files_task is None:  # on the I/O loop: one listing, every load waits for it
            st.files_task = asyncio.ensure_future(check_scale(self.store, self.scale, st.consolidated,
                                                              self.geometry))
        try:
            files = await asyncio.shield(st.files_task)
        except RemoteReadError:
            st.files_task = None  # transient: the next load lists again
            raise
        st.files = files
        return files

    def __setstate__(self, d):
        self.__dict__.update(d)
        self._state_lock = threading.Lock()

    # --- per-process state ------------------------------------------------------------------------

    def _proc(self) -> _ProcState:
        st = self._state
        if st is None or st.pid != os.getpid():
            with self._state_lock:
                if self._state is None or self._state.pid != os.getpid():
                    self._state = _ProcState(self)
                st = self._state
        assert st is not None
        return st

    @property
    def cache(self) -> ShardCache:
        """This process's shard cache."""
        return self._proc().cache

    async def load(self, origin) -> Shard | None:
        """Load the shard at origin; None when it is missing and the user asked to fill it."""
        s, store = self.scale, self.store
        key = s.stem(origin) + ".arrow"
        st = self._proc()
        if st.files_error is not None:
            raise st.files_error
        ci = st.consolidated
        files = st.files if st.files is not None or ci is None else await self.files()
        if files is not None and not files.folder:
            if self.fill_missing_shards:
                return None
            files.require_folder()
        given = None
        if ci is not None:
            given = ci.shard_index(origin)
            if given is None:  # the index saw no such shard: is that still so? (the listing said, if any)
                if (files is None or files.origins is None) and await store.exists(key):
                    raise _stale(ci, f"it lists no shard {store.describe(key)}, which exists now")
                if self.fill_missing_shards:
                    return None
                raise MissingShardError(f"{store.describe(key)}: no such shard file ({_MISSING_HINT})")
            size, stamp = ci.stamp(origin)
            try:
                now = await store.stat(key)
            except MissingShardError:
                raise _stale(ci, f"{store.describe(key)} is gone") from None
            same_kind = stamp is not None and now.stamp is not None and \
                stamp.split(":", 1)[0] == now.stamp.split(":", 1)[0]
            if (size is not None and now.size is not None and now.size != size) or \
                    (same_kind and now.stamp != stamp):
                raise _stale(ci, f"{store.describe(key)} changed since it was indexed")
        probe = None
        if files is None and isinstance(store, ByteStore) and "shard_extent" not in s.inferred and \
                st.probes < (_PROBED_SHARDS if store.immediate else 1):
            st.probes += 1  # the folder was not listed: look for files between the grid's origins
            if store.immediate:
                await self._probe(origin)
            else:  # concurrently with the load: no latency added
                probe = asyncio.ensure_future(self._probe(origin))
        try:
            shard = await load_shard(store, s, origin, policy=self.policy, index=given)
        except MissingShardError as e:
            if probe is not None:
                await probe
            if self.fill_missing_shards and not await store.exists(key):
                return None
            raise MissingShardError(f"{e} ({_MISSING_HINT})") from None
        except BaseException:
            if probe is not None:
                probe.cancel()
            raise
        if probe is not None:
            await probe
        return shard

    async def _probe(self, origin) -> None:
        """``probe_neighbours`` of one shard; a SpecError is this process's answer from then on."""
        assert isinstance(self.store, ByteStore)
        try:
            await probe_neighbours(self.store, self.scale, origin, self.geometry)
        except SpecError as e:
            self._proc().files_error = e
            raise
        except DvidShardsError:  # the store failed to answer (a remote fault): ask again with a later shard
            self._proc().probes -= 1

    def shard(self, x: int, y: int, z: int) -> Shard | None:
        """The shard holding chunk (x, y, z) in this process (None: missing, read as 0)."""
        try:
            return self._proc().cache.get_sync(self.scale.shard_origin(x, y, z))
        except DvidShardsError as e:
            raise with_chunk(e, (x, y, z)) from None

    def absent(self, shard: Shard | None, x: int, y: int, z: int) -> None:
        """SpecError when reading chunk (x, y, z) as background is a guess: with a shard extent
        guessed from file names larger than the records seen prove, a chunk beyond the proven
        part of its shard might belong to a missing shard file."""
        s = self.scale
        proven = s.proven_extent
        if proven is None or proven >= s.shard_extent or self.fill_missing_shards:
            return
        origin = s.shard_origin(x, y, z)
        local = [c * n - o for c, n, o in zip((x, y, z), s.chunk_size, origin, strict=True)]
        if max(local) >= proven:
            raise SpecError(f"chunk {(x, y, z)}: the shard size {s.shard_extent} was guessed from file names, but "
                            f"the records seen prove only {proven} voxels, so this chunk may belong to a missing "
                            f"shard file. Pass the export's spec (spec=...) or fill_missing_shards=True")

    # --- the TensorStore callback ----------------------------------------------------------------

    def __call__(self, domain: ts.IndexDomain, array: np.ndarray, params=None):
        o = domain.origin
        hot = self._hot
        if hot is not None:  # a chunk of the shard the last one came from: no cache lookup
            cx, cy, cz, lx, ly, lz, hx, hy, hz, shard, table = hot
            x, y, z = o[0] // cx, o[1] // cy, o[2] // cz
            if lx <= x < hx and ly <= y < hy and lz <= z < hz:
                i = shard.find(x, y, z)
                if i is not None:
                    if table is not None:
                        table.decode_into(i, array.T, self.labels)
                    else:
                        shard.decode(i, array.T, self.labels)
                    return None
        cx, cy, cz = self.scale.chunk_size
        x, y, z = o[0] // cx, o[1] // cy, o[2] // cz
        if not self.store.immediate:
            promise, future = ts.Promise.new()  # type: ignore[var-annotated]
            st = self._proc()
            st.loop.call_soon_threadsafe(st.enqueue, _Request(x, y, z, array, promise))
            return future
        shard = self.shard(x, y, z)
        i = shard.find(x, y, z) if shard is not None else None
        if shard is None or i is None:
            self.absent(shard, x, y, z)
            array.fill(0)
        else:
            shard.decode(i, array.T, self.labels)
        if shard is not None:
            # remembered per reader, for the next chunk (TensorStore asks in order, a shard's chunks
            # together); a shard the cache has since dropped stays readable, it is only not counted
            lo, hi = shard.box
            self._hot = (cx, cy, cz, *(int(v) for v in lo), *(int(v) for v in hi), shard,
                         shard.table() if shard.policy == "eager" else None)
        return None


class _ProcState:
    """A reader's per-process state: shard cache, consolidated index, I/O queue."""

    def __init__(self, reader: ChunkReader):
        self.reader = reader
        self.pid = os.getpid()
        self.cache = ShardCache(reader.load, reader.store, max_shards=reader.max_shards, max_bytes=reader.max_bytes)
        self.consolidated = None
        if reader.consolidated is not None:
            if os.path.exists(consolidated_paths(reader.consolidated, reader.scale.folder)[0]):
                self.consolidated = ConsolidatedIndex(reader.consolidated, reader.scale.folder)
        done = reader._files
        self.files: ScaleFiles | None = done[1] if done is not None and done[0] == self.pid else None
        self.files_error: DvidShardsError | None = None
        self.files_lock = threading.Lock()
        self.files_task: asyncio.Future | None = None
        self.probes = 0
        self._loop: Any = None
        self.pending: dict = {}

    @property
    def loop(self):
        if self._loop is None:
            self._loop = background_loop()
        return self._loop

    # --- remote stores: requests merged per shard on the I/O loop ------------------------------

    def enqueue(self, req: _Request) -> None:
        try:
            origin = self.reader.scale.shard_origin(req.x, req.y, req.z)
        except BaseException as e:  # noqa: BLE001 - reported, never raised past here
            req.fail(e)
            return
        reqs = self.pending.get(origin)
        if reqs is None:
            self.pending[origin] = [req]
            self.loop.create_task(self.flush(origin))
        else:
            reqs.append(req)

    async def flush(self, origin) -> None:
        window, max_wait = WINDOW, MAX_WAIT
        reqs: list[_Request] = []
        try:
            try:
                shard = await self.cache.get(origin)
            except DvidShardsError as e:
                q = self.pending[origin][0]
                raise with_chunk(e, (q.x, q.y, q.z)) from None
            # gather the rest of this burst of callbacks for the shard
            t0, n = self.loop.time(), -1
            while len(self.pending[origin]) != n and self.loop.time() - t0 < max_wait:
                n = len(self.pending[origin])
                await asyncio.sleep(window)
            reqs = self.pending.pop(origin)
            await self.serve(shard, reqs)
        except BaseException as e:
            for q in reqs or self.pending.pop(origin, []):
                q.fail(e)
            if not isinstance(e, Exception):
                raise

    async def serve(self, shard: Shard | None, reqs: list[_Request]) -> None:
        pool, labels = decode_pool(), self.reader.labels
        wanted = []
        for q in reqs:
            i = shard.find(q.x, q.y, q.z) if shard is not None else None
            if i is None:
                try:
                    self.reader.absent(shard, q.x, q.y, q.z)
                except BaseException as e:  # noqa: BLE001 - reported, never raised past here
                    q.fail(e)
                    continue
                pool.submit(_zero, q)
            else:
                wanted.append((q, i))
        if not wanted or shard is None:
            return
        if shard.policy == "eager":  # records already resolved
            t = shard.table()
            for q, i in wanted:
                pool.submit(_decode, t, i, q, labels)
            return
        groups = merge_ranges([(*_span(shard, i), (q, i)) for q, i in wanted])
        bufs = await shard.store.read_ranges(shard.key, [(g[0], g[1]) for g in groups], return_exceptions=True)
        for g, buf in zip(groups, bufs, strict=True):
            items = g[2]
            if isinstance(buf, BaseException):
                for q, i in items:
                    q.fail(shard._range_error(buf, i))
                continue
            u8 = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, np.uint8)
            try:
                t = shard._resolve(u8, g[0], np.array([i for _, i in items], np.int64))
            except BaseException as e:  # noqa: BLE001 - reported, never raised past here
                # resolve one by one so that each chunk gets its own error, and good ones read
                for q, i in items:
                    try:
                        tk = shard._resolve(u8, g[0], np.array([i], np.int64))
                    except BaseException as e1:  # noqa: BLE001 - reported, never raised past here
                        q.fail(e1 if isinstance(e1, DvidShardsError) else e)
                        continue
                    pool.submit(_decode, tk, 0, q, labels)
                continue
            for k, (q, _) in enumerate(items):
                pool.submit(_decode, t, k, q, labels)


def _span(shard: Shard, i: int) -> tuple[int, int]:
    off, n = shard.batch(i)
    return off, off + n


class _Request:
    __slots__ = ("x", "y", "z", "array", "promise", "done")

    def __init__(self, x, y, z, array, promise):
        self.x, self.y, self.z, self.array, self.promise = x, y, z, array, promise
        self.done = False

    def ok(self, e: BaseException | None = None) -> None:
        if not self.done:
            self.done = True
            self.array = None
            if e is None:
                self.promise.set_result(None)
            else:
                self.promise.set_exception(e)

    def fail(self, e: BaseException) -> None:
        self.ok(e)


def _zero(req: _Request) -> None:
    try:
        req.array.fill(0)
    except BaseException as e:  # noqa: BLE001 - reported, never raised past here
        req.fail(e)
    else:
        req.ok()


def _decode(table, k: int, req: _Request, labels) -> None:
    try:
        table.decode_into(k, req.array.T, labels)
    except BaseException as e:  # noqa: BLE001 - reported, never raised past here
        req.fail(e)
    else:
        req.ok()


# --- the bulk reader ----------------------------------------------------------------------------

def aligned_empty(shape, order: str = "F", align: int = 64) -> np.ndarray:
    """An uninitialised uint64 array whose data starts on an ``align``-byte boundary.

    numpy's large allocations start 16 bytes into a page, so every 8-voxel row (64 bytes) the
    decoder stores straddles two cache lines; from a 64-byte boundary each is one line (bench_bulk
    512³, 2 threads: a read took 1.33x the time of filling it, against 1.40x into ``np.empty``).
    """
    shape = tuple(int(v) for v in shape)
    n = 8 * int(np.prod(shape, dtype=np.int64))
    raw = np.empty(n + align, np.uint8)
    off = -raw.ctypes.data % align
    return raw[off:off + n].view(np.uint64).reshape(shape, order=order)  # type: ignore[call-overload]


_RUN = 64  # most chunks in one row of a run (one zstd batch on local stores)
_REMOTE_RUN = 256  # most chunks in one run on remote stores (one coalesced fetch of records)


def read_box(reader: ChunkReader, box, out: np.ndarray | None = None, threads: int | None = None) -> np.ndarray:
    """Decode every chunk of a voxel box into an (x, y, z) array, in parallel, with no copy.

    Parameters
    ----------
    reader : ChunkReader
        The scale, label source and shard cache to read with.
    box : [[x0, y0, z0], [x1, y1, z1]]
        Voxels, any alignment, inside the volume.
    out : numpy.ndarray, optional
        uint64 array of shape (x1-x0, y1-y0, z1-z0): F-ordered, or any array whose ``.T`` is a
        (z, y, x) view; default a new F-ordered array aligned to 64 bytes (``aligned_empty``,
        which is also the fastest kind of ``out``).
    threads : int, optional
        Decoding threads (default: the number of cores).

    The box is cut into rows (one shard's chunks along an x row of chunks, in the memory order
    of an F-ordered output).  Locally each row is a run; remotely a run gathers up to 256 chunks
    of a shard, fetched at once, and a shard is split so that every thread has a part.  Threads
    take the next run as they finish one, so they write neighbouring rows together.  A run's
    payloads are decompressed in one zstd call.  Whole chunks side by side along x (x contiguous
    in ``out``) are decoded together z by z and y by y (``codec.decode_row_into``), writing the
    output in memory order: chunk by chunk costs ~1.6x.  Chunks cut on their near side go through
    a per-thread scratch block.
    """
    scale = reader.scale
    lo, hi = scale.check_box(box)
    shape = tuple(int(v) for v in hi - lo)
    if out is None:
        out = aligned_empty(shape)
    elif not isinstance(out, np.ndarray) or out.dtype != np.uint64 or out.shape != shape or \
            not out.flags.writeable:
        raise SpecError(f"out must be a writable uint64 array of shape {shape}")
    if 0 in shape:
        return out
    rows = _plan(scale, [int(v) for v in lo], [int(v) for v in hi])
    n = max(1, int(threads or os.cpu_count() or 1))
    runs = [(r[0], [r[1:]]) for r in rows] if reader.store.immediate else _group(rows, n)
    n = min(n, len(runs))
    if n == 1:
        w = _BulkWorker(reader, out, lo)
        for run in runs:
            w.run(run)
        return out
    todo = iter(enumerate(runs))  # shared: next() on a list iterator is atomic under the GIL
    failed: list[tuple[int, BaseException]] = []

    def work():
        w = _BulkWorker(reader, out, lo)
        for k, run in todo:
            if failed:
                return
            try:
                w.run(run)
            except BaseException as e:  # noqa: BLE001 - stop the others after their current run
                failed.append((k, e))
                return

    with ThreadPoolExecutor(n, thread_name_prefix="dvidshards-read") as pool:
        for f in [pool.submit(work) for _ in range(n)]:
            f.result()
    if failed:  # every run before the first failure ran: that failure is the serial one
        raise min(failed, key=lambda ke: ke[0])[1]
    return out


def _plan(scale: Scale, lo: list[int], hi: list[int]) -> list[tuple]:
    """Rows ``(origin, cy, cz, cx0, cx1)``: chunks cx0..cx1-1 of one shard on one x row, z-major."""
    (cx, cy, cz), e = scale.chunk_size, scale.shard_extent
    x0, x1 = lo[0] // cx, (hi[0] - 1) // cx + 1
    runs = []
    for z in range(lo[2] // cz, (hi[2] - 1) // cz + 1):
        for y in range(lo[1] // cy, (hi[1] - 1) // cy + 1):
            a = x0
            while a < x1:
                origin = scale.shard_origin(a, y, z)
                b = min(x1, a + _RUN, (origin[0] + e + cx - 1) // cx)  # stay inside the shard
                runs.append((origin, y, z, a, max(b, a + 1)))
                a = max(b, a + 1)
    return runs


def _group(rows: list[tuple], threads: int) -> list[tuple]:
    """Runs ``(origin, [(cy, cz, cx0, cx1), ...])`` of one shard's rows, for remote stores: at most
    ``_REMOTE_RUN`` chunks and a thread's share of the shard's, so one shard keeps every thread busy."""
    by_shard: dict = {}
    for r in rows:
        by_shard.setdefault(r[0], []).append(r[1:])
    runs = []
    for origin, rs in by_shard.items():
        total = sum(x1 - x0 for _, _, x0, x1 in rs)
        cap = max(1, min(_REMOTE_RUN, -(-total // threads)))
        part: list = []
        size = 0
        for r in rs:
            if part and size + r[3] - r[2] > cap:
                runs.append((origin, part))
                part, size = [], 0
            part.append(r)
            size += r[3] - r[2]
        runs.append((origin, part))
    return runs


class _BulkWorker:
    """One thread's state in ``read_box``: its decompressor, scratch block and current shard."""

    def __init__(self, reader: ChunkReader, out: np.ndarray, lo):
        self.reader = reader
        self.labels = reader.labels
        self.out = out
        self.lo = [int(v) for v in lo]
        self.hi = [a + n for a, n in zip(self.lo, out.shape, strict=True)]
        self.cs = tuple(int(c) for c in reader.scale.chunk_size)
        self.max_block = max_block_bytes(self.cs)
        self._scratch: np.ndarray | None = None
        self._dctx: zstandard.ZstdDecompressor | None = None
        self._origin = None
        self._shard: Shard | None = None

    @property
    def scratch(self) -> np.ndarray:
        if self._scratch is None:
            self._scratch = np.empty(self.cs[::-1], np.uint64)
        return self._scratch

    def run(self, run) -> None:
        origin, chunk_rows = run
        reader, lo, hi, cs = self.reader, self.lo, self.hi, self.cs
        if origin != self._origin:
            y, z, x0, _ = chunk_rows[0]
            self._shard = reader.shard(x0, y, z)
            self._origin = origin
        shard = self._shard
        rows, targets = [], []
        whole = self.out.strides[0] == 8  # x contiguous: whole chunks side by side decode row by row
        for y, z, x0, x1 in chunk_rows:
            ya, yb = max(y * cs[1], lo[1]), min((y + 1) * cs[1], hi[1])
            za, zb = max(z * cs[2], lo[2]), min((z + 1) * cs[2], hi[2])
            row = self.out[:, ya - lo[1]:yb - lo[1], za - lo[2]:zb - lo[2]]
            near = ya > y * cs[1] or za > z * cs[2]
            for x in range(x0, x1):
                xa, xb = max(x * cs[0], lo[0]), min((x + 1) * cs[0], hi[0])
                sub = row[xa - lo[0]:xb - lo[0]].T  # (z, y, x)
                i = shard.find(x, y, z) if shard is not None else None
                if i is None:
                    reader.absent(shard, x, y, z)
                    sub.fill(0)
                else:
                    rows.append(i)
                    skip = (xa - x * cs[0], ya - y * cs[1], za - z * cs[2]) if near or xa > x * cs[0] else None
                    full = whole and skip is None and sub.shape == cs[::-1]
                    targets.append((sub, skip, (row, xa - lo[0]) if full else None))
        if not rows:
            return
        assert shard is not None
        if shard.policy == "eager":  # records resolved at load: index the shard's own table
            t, ks = shard.table(), rows
        else:
            t = shard.table(rows)
            ks = list(range(len(rows)))
        blocks = self._decompress(t, ks)
        j = 0
        while j < len(targets):
            e = j + 1
            place = targets[j][2]
            if blocks is not None and place is not None:
                # whole chunks side by side along x: one row-by-row decode writes them in memory order
                row, xa = place
                while e < len(targets) and _next_to(targets[e][2], row, xa + (e - j) * cs[0]):
                    e += 1
                if e - j > 1 and self._decode_row(t, ks[j:e], [blocks[m] for m in range(j, e)],
                                                  row[xa:xa + (e - j) * cs[0]].T):
                    j = e
                    continue
            for m in range(j, e):  # one chunk at a time (or again, after a failed row)
                sub, skip, _ = targets[m]
                k = ks[m]
                direct = skip is None
                dst = sub if direct else self.scratch
                if blocks is None or not _decode_block(t, k, blocks[m], dst, self.labels):
                    t.decode_into(k, dst, self.labels)  # the one-chunk path: its typed error, or the data
                if not direct:
                    sx, sy, sz = skip or (0, 0, 0)
                    nz, ny, nx = sub.shape
                    sub[...] = dst[sz:sz + nz, sy:sy + ny, sx:sx + nx]
            j = e

    def _decode_row(self, t: RecordTable, ks: list[int], blocks: list, out: np.ndarray) -> bool:
        """Decode whole chunks side by side along x into ``out`` in memory order; False when a block
        is damaged or its lists do not match it (one at a time then raises the typed error)."""
        parts = [np.frombuffer(b, np.uint8) for b in blocks]
        for k, b in zip(ks, parts, strict=True):
            if b.shape[0] < 16 or not t.labels_match(k, b):
                return False
        offs = np.zeros(len(parts) + 1, np.int64)
        np.cumsum([p.shape[0] for p in parts], out=offs[1:])
        pals = [p for p in (self.labels.palette(t, k) for k in ks) if p is not None]
        pal: np.ndarray | None = None
        poffs: np.ndarray | None = None
        if pals:  # a palette per record (agglomerated, mapped), or none (supervoxels)
            pal = np.concatenate(pals)
            poffs = np.zeros(len(pals) + 1, np.int64)
            np.cumsum([p.shape[0] for p in pals], out=poffs[1:])
        return decode_row_into(np.concatenate(parts), offs, pal, poffs, out)

    def _decompress(self, t: RecordTable, ks: list[int]):
        """Payloads of records ks in one zstd call when every record states a plausible size (zstd
        checks each frame's size and checksum); None: the one-chunk path, which raises the typed error."""
        usize = t.rec[ks, R_USIZE]
        if len(usize) < 2 or usize.min() < 16 or usize.max() > self.max_block:
            return None
        if self._dctx is None:
            self._dctx = zstandard.ZstdDecompressor()
        buf, off, ln = t.gather_payloads(ks)  # a file's table reads them now: ShardFormatError if it shrank
        segs = np.empty((len(ks), 2), np.uint64)
        segs[:, 0] = off
        segs[:, 1] = ln
        try:
            frames = zstandard.BufferWithSegments(buf, segs.tobytes())  # type: ignore[arg-type]  # any buffer
            return self._dctx.multi_decompress_to_buffer(frames, decompressed_sizes=usize.astype(np.uint64).tobytes())
        except (zstandard.ZstdError, ValueError, TypeError):
            return None


def _next_to(place, row: np.ndarray, xa: int) -> bool:
    """True when a target's whole-chunk place is in the same output row at x offset xa."""
    return place is not None and place[0] is row and place[1] == xa


def _decode_block(t: RecordTable, k: int, block, out: np.ndarray, labels) -> bool:
    """Decode record k of t from its decompressed block; False: leave it to the one-chunk path."""
    b = np.frombuffer(block, np.uint8)
    if b.shape[0] < 16 or not t.labels_match(k, b):
        return False
    try:
        decode_into(b, labels.palette(t, k), out)
    except DvidShardsError:
        return False
    return True
