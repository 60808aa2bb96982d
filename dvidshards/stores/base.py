"""The byte-store interface: where an export's files come from.

Async first: every read is a coroutine, so remote stores overlap requests; stores whose
reads never wait (local files, memory) also answer synchronously, and their coroutines
complete without suspending, so ``drive`` runs them on the caller's thread with no loop.
"""

from __future__ import annotations

import asyncio
import builtins
import os
import threading
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ..errors import ShardFormatError

__all__ = ["ByteStore", "PastEndError", "Stat", "background_loop", "decode_pool", "drive", "run_sync"]


class PastEndError(ShardFormatError):
    """A byte range lies (partly) past the end of its file; ``total_size`` when known."""

    def __init__(self, msg: str, total_size: int | None = None):
        super().__init__(msg)
        self.total_size = total_size

    def __reduce__(self):
        return (PastEndError, (str(self), self.total_size))


@dataclass(frozen=True)
class Stat:
    """What a store knows of a file without reading it: size and a change stamp."""

    size: int | None
    stamp: str | None  # mtime in ns (local) or a generation/etag (remote); None if unknown


class ByteStore(ABC):
    """Read-only access to the files of an export, by key relative to its root."""

    #: True when ``map`` gives a whole file at once, cheaply (a view of memory, or a local file's
    #: private copy read now: never a memory map, which a file shrinking under it turns into SIGBUS)
    mappable: bool = False
    #: True when the async methods never suspend (local, memory): callable via ``drive``
    immediate: bool = False

    @abstractmethod
    def describe(self, key: str) -> str:
        """The path or URL of key, for messages."""

    @abstractmethod
    async def read(self, key: str, start: int | None = None, stop: int | None = None):
        """Bytes [start, stop) of key (whole file by default; ``start < 0, stop=None``: the last
        -start bytes).  MissingShardError if absent, PastEndError past its end."""

    async def read_ranges(self, key: str, ranges, *, return_exceptions: bool = False) -> list:
        """Several byte ranges of one file (remote stores issue them together)."""
        out = []
        for a, b in ranges:
            try:
                out.append(await self.read(key, a, b))
            except Exception as e:
                if not return_exceptions:
                    raise
                out.append(e)
        return out

    @abstractmethod
    async def exists(self, key: str) -> bool:
        """Whether key exists."""

    @abstractmethod
    async def list(self, prefix: str = "") -> list[str]:
        """Names directly below the folder prefix (files and folders, no recursion)."""

    async def stat(self, key: str) -> Stat:
        """Size and change stamp of key (None where the store cannot tell cheaply)."""
        return Stat(None, None)

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

    # --- blocking twins -------------------------------------------------------------------------

    def _sync(self, coro):
        return drive(coro) if self.immediate else run_sync(coro)

    def read_sync(self, key: str, start: int | None = None, stop: int | None = None):
        return self._sync(self.read(key, start, stop))

    def exists_sync(self, key: str) -> bool:
        return self._sync(self.exists(key))

    def list_sync(self, prefix: str = "") -> builtins.list[str]:
        return self._sync(self.list(prefix))

    def stat_sync(self, key: str) -> Stat:
        return self._sync(self.stat(key))


def slice_range(data, start: int | None, stop: int | None, where: str):
    """Bytes [start, stop) of an in-memory file (``start < 0, stop=None``: the last -start bytes).

    PastEndError when the range leaves the file, as a remote store would report it.
    """
    n = len(data)
    a = (n + start if start < 0 else start) if start is not None else 0
    b = n if stop is None else stop
    if a < 0 or b > n or a > b:
        raise PastEndError(f"{where}: bytes [{start}, {stop}) lie past its end ({n} bytes)", n)
    return data[a:b]


def drive(coro):
    """Run a coroutine that never suspends (immediate stores) on this thread, with no loop."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
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


def run_sync(coro, timeout: float | None = None):
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
