"""The store interface: where an export's files come from and where a job's files go.

One abstract class, :class:`ByteStore`, for reading and writing, as zarr-python v3's ``Store``:
implementations apart (``LocalStore``, ``KvStore``, ``MemoryStore``), a read-only mode, and one
contract (``tests/stores/test_contract.py``) every implementation passes.

Async first: every read and write is a coroutine, so remote stores overlap requests; stores whose
calls never wait (local files, memory) complete their coroutines without suspending, so the
``*_sync`` twins run them on the caller's thread with no loop (``drive``); the others run on the
per-process I/O loop (``run_sync``). File-like access (``writer``, ``open``) is synchronous.

Errors: a missing file read is ``MissingShardError``, a range past its end ``PastEndError``, a
remote read that kept failing ``RemoteReadError``; a write that fails, and any call that cannot
use the location (full disk, permission, a read-only file system, an unreachable bucket), is one
``OutputError`` line naming the path (``os_error``); a write to a read-only store is
``ReadOnlyError``.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import errno
import io
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Coroutine, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO, TypeVar

import numpy as np

from ..errors import MissingShardError, OutputError, ShardFormatError

__all__ = ["TMP", "ByteStore", "PastEndError", "ReadOnlyError", "Stat", "background_loop", "decode_pool", "drive",
           "is_temporary", "os_error", "run_sync"]

T = TypeVar("T")
#: what a store's read gives: bytes, or a zero-copy view (memory stores)
Data = Any
#: the marker in the hidden names of files being written (``.NAME.tmp-XXXX``), which listings skip
TMP = ".tmp-"


class PastEndError(ShardFormatError):
    """A byte range lies (partly) past the end of its file; ``total_size`` when known."""

    def __init__(self, msg: str, total_size: int | None = None):
        super().__init__(msg)
        self.total_size = total_size

    def __reduce__(self) -> tuple[Any, ...]:
        return (PastEndError, (str(self), self.total_size))


class ReadOnlyError(OutputError):
    """A write to a store opened read-only (or one that cannot be written: http(s))."""


@dataclass(frozen=True)
class Stat:
    """What a store knows of a file without reading it: size and a change stamp."""

    size: int | None
    stamp: str | None  # mtime in ns (local) or a generation/etag (remote); None if unknown


def is_temporary(name: str) -> bool:
    """Whether a file name is a write in progress (hidden: listings leave it out)."""
    return name.startswith(".") and TMP in name


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


def os_error(e: OSError, where: str, doing: str) -> OutputError:
    """One line naming the path, for the errors users hit (full disk, permissions, not a folder)."""
    code = e.errno
    if code == errno.ENOSPC or code == errno.EDQUOT:
        why = "no space left on the device (free some space, then run the same command with --resume)"
    elif code in (errno.EACCES, errno.EPERM):
        why = "permission denied (choose a destination you can write to)"
    elif code == errno.EROFS:
        why = "the file system is read-only (choose a destination you can write to)"
    elif code == errno.ENOTDIR:
        why = "a file is in the way where a folder is needed"
    elif code == errno.EISDIR:
        why = "a folder is in the way where a file is needed"
    else:
        why = e.strerror or _one_line(e)
    return OutputError(f"{where}: cannot {doing}: {why}")


class ByteStore(ABC):
    """The files under one root, by ``/``-joined key: read, and (unless read-only) written.

    Subclasses implement ``describe``, ``read``, ``exists`` and ``list``; a writable store also
    ``put``, ``create``, ``replace``, ``delete``, ``delete_prefix``, ``list_prefix`` and
    ``child``. Writes are atomic: a reader sees a file whole or not at all.
    """

    #: True when ``map`` gives a whole file at once, cheaply (a view of memory, or a local file's
    #: private copy read now: never a memory map, which a file shrinking under it turns into SIGBUS)
    mappable: bool = False
    #: True when the async methods never suspend (local, memory): callable via ``drive``
    immediate: bool = False
    #: True when writes are refused (``as_read_only``, http(s), ``as_store`` without ``writable``)
    read_only: bool = False

    # --- reading ------------------------------------------------------------------------------

    @abstractmethod
    def describe(self, key: str) -> str:
        """The path or URL of key, for messages."""

    @abstractmethod
    async def read(self, key: str, start: int | None = None, stop: int | None = None) -> Data:
        """Bytes [start, stop) of key (whole file by default; ``start < 0, stop=None``: the last
        -start bytes).  MissingShardError if absent, PastEndError past its end."""

    async def read_ranges(self, key: str, ranges: Iterable[tuple[int, int]], *,
                          return_exceptions: bool = False) -> builtins.list[Any]:
        """Several byte ranges of one file (remote stores issue them together)."""
        out: builtins.list[Any] = []
        for a, b in ranges:
            try:
                out.append(await self.read(key, a, b))
            except Exception as e:
                if not return_exceptions:
                    raise
                out.append(e)
        return out

    async def get(self, key: str) -> bytes | None:
        """The whole of key, or None when it does not exist."""
        try:
            return bytes(await self.read(key))
        except MissingShardError:
            return None

    @abstractmethod
    async def exists(self, key: str) -> bool:
        """Whether key exists."""

    @abstractmethod
    async def list(self, prefix: str = "") -> builtins.list[str]:
        """Names directly below the folder prefix (files and folders, no recursion), sorted;
        ``[]`` when there is none. Files being written are left out."""

    async def list_prefix(self, prefix: str = "") -> builtins.list[str]:
        """Every file key below the folder prefix (recursively, relative to the root), sorted."""
        out: builtins.list[str] = []
        base = prefix.strip("/")
        for name in await self.list(base):
            key = f"{base}/{name}" if base else name
            below = await self.list_prefix(key)
            out.extend(below if below else [key])
        return sorted(out)

    async def stat(self, key: str) -> Stat:
        """Size and change stamp of key (None where the store cannot tell cheaply)."""
        return Stat(None, None)

    async def size(self, key: str) -> int:
        """The size of file key in bytes (MissingShardError if absent)."""
        st = await self.stat(key)
        return st.size if st.size is not None else len(await self.read(key))

    async def is_folder(self, prefix: str) -> bool:
        """Whether the folder prefix exists (object stores: whether anything lies under it)."""
        return bool(await self.list(prefix))

    async def sample(self, prefix: str, n: int) -> builtins.list[str] | None:
        """Up to n ``.arrow`` names of a folder, if this store gives them cheaply (None: it cannot).

        Object stores list every key of a prefix (TensorStore has no limit): they give None.
        """
        return None

    def map(self, key: str) -> np.ndarray:
        """The whole of key as a read-only uint8 array; only for ``mappable`` stores."""
        raise NotImplementedError(f"{type(self).__name__} cannot memory-map {self.describe(key)}")

    def open(self, key: str) -> BinaryIO:
        """Key as a readable, seekable binary file that reads the byte ranges asked for (a Parquet
        reader of one part of a large file fetches only that part). MissingShardError if absent."""
        return io.BufferedReader(_RangedFile(self, key, self.size_sync(key)), buffer_size=1 << 18)

    # --- writing (refused unless a subclass writes) ----------------------------------------------

    def _refuse(self, key: str) -> ReadOnlyError:
        return ReadOnlyError(f"{self.describe(key)}: cannot write it: {type(self).__name__} "
                             f"{self.describe('')} is read-only")

    def _check_writable(self, key: str) -> None:
        if self.read_only:
            raise self._refuse(key)

    async def put(self, key: str, data: bytes) -> None:
        """Write key atomically (never seen half written), replacing what was there."""
        raise self._refuse(key)

    async def create(self, key: str, data: bytes) -> bool:
        """Write key only if it does not exist, atomically; False when it already did."""
        raise self._refuse(key)

    async def replace(self, key: str, data: bytes, *, expected: bytes) -> bool:
        """Write key only if it still holds ``expected``; False when it changed (or is gone)."""
        raise self._refuse(key)

    async def delete(self, key: str) -> None:
        """Delete file key if it exists."""
        raise self._refuse(key)

    async def delete_prefix(self, prefix: str = "") -> None:
        """Delete the folder prefix and everything below it (or the file prefix) if it exists."""
        raise self._refuse(prefix)

    @contextlib.contextmanager
    def writer(self, key: str) -> Iterator[BinaryIO]:
        """A binary file to write key into, published atomically when the block ends without an
        error (a local store streams it to a hidden temporary file and renames it; a bucket gets
        it as one object); nothing is published when the block raises."""
        self._check_writable(key)
        buf = io.BytesIO()
        yield buf
        self.put_sync(key, buf.getvalue())

    def check_writable(self, *, kind: str = "folder") -> None:
        """Before any work: that a job can write here (``kind``: a ``folder`` or one ``file`` at
        the root); one OutputError line otherwise."""
        self._check_writable("")

    # --- locations ------------------------------------------------------------------------------

    def child(self, prefix: str) -> ByteStore:
        """The folder prefix as a store of its own (same kind, same read-only mode)."""
        raise NotImplementedError(f"{type(self).__name__} has no sub-stores")

    def as_read_only(self) -> ByteStore:
        """This store with writes refused (a copy; this one is unchanged)."""
        import copy

        other = copy.copy(self)
        other.read_only = True
        return other

    def local_path(self, key: str = "") -> str | None:
        """The path of key on this host's file system (None: not a local store)."""
        return None

    def kvstore_spec(self) -> dict[str, Any] | None:
        """The root as a TensorStore kvstore spec (path ending with '/'), for TensorStore's own
        drivers; None when TensorStore cannot reach it (a store in Python memory)."""
        return None

    # --- blocking twins -------------------------------------------------------------------------

    def _sync(self, coro: Coroutine[Any, Any, T]) -> T:
        return drive(coro) if self.immediate else run_sync(coro)

    def read_sync(self, key: str, start: int | None = None, stop: int | None = None) -> Data:
        return self._sync(self.read(key, start, stop))

    def get_sync(self, key: str) -> bytes | None:
        return self._sync(self.get(key))

    def exists_sync(self, key: str) -> bool:
        return self._sync(self.exists(key))

    def list_sync(self, prefix: str = "") -> builtins.list[str]:
        return self._sync(self.list(prefix))

    def list_prefix_sync(self, prefix: str = "") -> builtins.list[str]:
        return self._sync(self.list_prefix(prefix))

    def stat_sync(self, key: str) -> Stat:
        return self._sync(self.stat(key))

    def size_sync(self, key: str) -> int:
        return self._sync(self.size(key))

    def is_folder_sync(self, prefix: str) -> bool:
        return self._sync(self.is_folder(prefix))

    def put_sync(self, key: str, data: bytes) -> None:
        self._sync(self.put(key, data))

    def create_sync(self, key: str, data: bytes) -> bool:
        return self._sync(self.create(key, data))

    def replace_sync(self, key: str, data: bytes, *, expected: bytes) -> bool:
        return self._sync(self.replace(key, data, expected=expected))

    def delete_sync(self, key: str) -> None:
        self._sync(self.delete(key))

    def delete_prefix_sync(self, prefix: str = "") -> None:
        self._sync(self.delete_prefix(prefix))


class _RangedFile(io.RawIOBase):
    """A file of a store as a seekable raw file that reads the byte ranges it is asked for."""

    def __init__(self, store: ByteStore, key: str, size: int):
        self.store, self.key, self.size = store, key, size
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readall(self) -> bytes:
        data = bytes(self.store.read_sync(self.key, self._pos, self.size)) if self._pos < self.size else b""
        self._pos += len(data)
        return data

    def readinto(self, b: Any) -> int:
        n = min(len(b), self.size - self._pos)
        if n <= 0:
            return 0
        data = self.store.read_sync(self.key, self._pos, self._pos + n)
        m = len(data)
        memoryview(b).cast("B")[:m] = memoryview(data).cast("B")
        self._pos += m
        return m


def slice_range(data: Any, start: int | None, stop: int | None, where: str) -> Any:
    """Bytes [start, stop) of an in-memory file (``start < 0, stop=None``: the last -start bytes).

    PastEndError when the range leaves the file, as a remote store would report it.
    """
    n = len(data)
    a = (n + start if start < 0 else start) if start is not None else 0
    b = n if stop is None else stop
    if a < 0 or b > n or a > b:
        raise PastEndError(f"{where}: bytes [{start}, {stop}) lie past its end ({n} bytes)", n)
    return data[a:b]


def drive(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that never suspends (immediate stores) on this thread, with no loop."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]
    coro.close()
    raise RuntimeError("dvidshards: a coroutine of an immediate store suspended")


# --- the per-process I/O loop and decode pool ---------------------------------------------------

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_loop_thread: threading.Thread | None = None
_loop_pid: int | None = None
_pool: ThreadPoolExecutor | None = None
_pool_pid: int | None = None


def _run_forever(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    loop.run_forever()


def background_loop() -> asyncio.AbstractEventLoop:
    """The asyncio loop (one daemon thread per process) that runs every remote read.

    Independent of any loop the caller runs (Jupyter), so blocking on a result from the
    caller's thread never stalls the I/O.
    """
    global _loop, _loop_thread, _loop_pid
    with _lock:
        if _loop is None or _loop_pid != os.getpid() or _loop_thread is None or not _loop_thread.is_alive():
            _loop = asyncio.new_event_loop()
            _loop_thread = threading.Thread(target=_run_forever, args=(_loop,), name="dvidshards-io", daemon=True)
            _loop_thread.start()
            _loop_pid = os.getpid()
        return _loop


def on_loop_thread() -> bool:
    """Whether the caller runs on the I/O loop thread (where blocking would deadlock)."""
    return threading.current_thread() is _loop_thread


def run_sync(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run a coroutine on the background loop and wait for its result (not from that loop)."""
    loop = background_loop()
    if on_loop_thread():
        coro.close()
        raise RuntimeError("dvidshards: a blocking remote call was made on the I/O loop thread; await the "
                           "async variant instead")
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)


def decode_pool() -> ThreadPoolExecutor:
    """A small per-process thread pool for decoding fetched records (zstd and numba release the GIL)."""
    global _pool, _pool_pid
    with _lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(max_workers=max(2, min(16, os.cpu_count() or 2)),
                                       thread_name_prefix="dvidshards-decode")
            _pool_pid = os.getpid()
        return _pool
