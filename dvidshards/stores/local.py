"""A directory on a local file system: shard files read into memory to load, then by byte range.

A shard file can change while a reader has it open: an export copied again over itself, a sync
in progress. Through a memory map, the first access past the file's new end kills the process
with SIGBUS. So nothing here maps a file.

* ``map`` reads the whole file into private memory: the snapshot the eager loader checks, freed
  when the load is done. It hands the file, still open, to the record table as a ``ShardFile``.
* A record table then reads each payload with ``os.pread``. A file that shrank gives a short
  read, which the table reports as a ShardFormatError naming the file and the chunk.
* Range reads (``read``) are ``pread`` too.
"""

from __future__ import annotations

import builtins
import mmap
import os
import threading

import numpy as np

from ..errors import MissingShardError, ShardFormatError
from .base import ByteStore, PastEndError, Stat

__all__ = ["LocalStore", "ShardFile"]

_MAX_READ = 1 << 30  # bytes per read() call (some systems cap one read at 2 GiB)
_preadv = getattr(os, "preadv", None)
_ANON = {"flags": mmap.MAP_PRIVATE} if hasattr(mmap, "MAP_PRIVATE") else {}
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)
_HUGE = 4 << 20  # snapshots from this size ask for huge pages


def _fd_cap() -> int:
    """How many shard files a process keeps open (a quarter of its file limit, 64 to 1024)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 256
    if soft == getattr(resource, "RLIM_INFINITY", -1) or soft <= 0:
        return 1024
    return max(64, min(1024, soft // 4))


_held_lock = threading.Lock()
_held = 0  # open descriptors held by ShardFiles in this process
_cap: int | None = None


def _claim() -> bool:
    global _held, _cap
    with _held_lock:
        if _cap is None:
            _cap = _fd_cap()
        if _held >= _cap:
            return False
        _held += 1
        return True


def _release() -> None:
    global _held
    with _held_lock:
        _held -= 1


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class ShardFile:
    """One shard file as it was when loaded: read by byte range with ``os.pread``.

    It keeps the descriptor it was loaded through, so a file replaced by a rename (what most
    sync tools do) keeps reading as the version loaded. A file changed in place shows on a
    short read (``pread`` returns what exists) and on ``changed()``. Past a per-process number
    of open files (a quarter of the limit), and after pickling, each read opens the file again
    and checks that it is still the same file, unchanged.
    """

    __slots__ = ("__weakref__", "_fd", "ident", "path")

    def __init__(self, path: str, fd: int, ident: tuple[int, int, int, int], keep: bool = True):
        self.path = path
        self.ident = ident
        self._fd = -1
        if keep and fd >= 0 and _claim():
            self._fd = fd
        elif fd >= 0:
            os.close(fd)

    @property
    def size(self) -> int:
        """The file's size when it was loaded."""
        return self.ident[2]

    def __repr__(self) -> str:
        return f"ShardFile({self.path!r}, {self.size} bytes)"

    def __reduce__(self):
        return (ShardFile, (self.path, -1, self.ident))

    def __del__(self, _close=os.close, _release=_release):  # bound now: usable at interpreter exit
        fd, self._fd = self._fd, -1
        if fd >= 0:
            try:
                _close(fd)
            except OSError:
                pass
            finally:
                _release()

    def pread(self, offset: int, n: int) -> bytes:
        """Bytes [offset, offset + n) as they are now: fewer when the file ends before (it shrank)."""
        fd = self._fd
        try:
            if fd >= 0:
                return _pread(fd, n, offset)
            return self._reopened(offset, n)
        except OSError as e:
            raise ShardFormatError(f"{self.path}: cannot read bytes [{offset}, {offset + n}) of this shard file "
                                   f"({e.strerror or e})") from None

    def readinto(self, buf, offset: int) -> int:
        """Fill ``buf`` (a writable buffer) from ``offset``; how many bytes were read."""
        fd = self._fd
        try:
            if fd >= 0:
                return _preadinto(fd, buf, offset)
            data = self._reopened(offset, len(memoryview(buf)))
        except OSError as e:
            raise ShardFormatError(f"{self.path}: cannot read from byte {offset} of this shard file "
                                   f"({e.strerror or e})") from None
        memoryview(buf).cast("B")[:len(data)] = data
        return len(data)

    def _reopened(self, offset: int, n: int) -> bytes:
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        except OSError:
            return b""  # gone: the caller says the file changed
        try:
            if _identity(os.fstat(fd)) != self.ident:
                return b""
            return _pread(fd, n, offset)
        finally:
            os.close(fd)

    def changed(self) -> str | None:
        """How the file differs from the one loaded (None: same size and modification time)."""
        try:
            st = os.fstat(self._fd) if self._fd >= 0 else os.stat(self.path)
        except OSError as e:
            return f"it cannot be read any more ({e.strerror or e})"
        now = _identity(st)
        if now[:2] != self.ident[:2]:
            return "it was replaced by another file"
        if now[2] != self.ident[2]:
            return f"it is {now[2]} bytes now, {self.ident[2]} when it was loaded"
        if now[3] != self.ident[3]:
            return "it was modified since it was loaded"
        return None


if hasattr(os, "pread"):
    _pread = os.pread

    def _preadinto(fd: int, buf, offset: int) -> int:
        mv = memoryview(buf).cast("B")
        done = 0
        while done < len(mv):
            if _preadv is not None:
                k = _preadv(fd, [mv[done:done + _MAX_READ]], offset + done)
            else:
                piece = os.pread(fd, min(len(mv) - done, _MAX_READ), offset + done)
                k = len(piece)
                mv[done:done + k] = piece
            if k <= 0:
                break
            done += k
        return done
else:  # pragma: no cover - no pread (Windows): one read at a time per process
    _seek_lock = threading.Lock()

    def _pread(fd: int, n: int, offset: int) -> bytes:
        with _seek_lock:
            os.lseek(fd, offset, os.SEEK_SET)
            return os.read(fd, n)

    def _preadinto(fd: int, buf, offset: int) -> int:
        data = _pread(fd, len(memoryview(buf)), offset)
        memoryview(buf).cast("B")[:len(data)] = data
        return len(data)


class _Snapshot(mmap.mmap):
    """Private anonymous memory holding a copy of a file, and the file it came from (``shard_file``).

    ``madvise`` does nothing: the shard loader drops a file map's pages after a load, which on
    anonymous memory would discard the copy; the copy is freed with its last reference instead.
    """

    shard_file: ShardFile | None = None

    def madvise(self, *args, **kwargs):
        return None


class LocalStore(ByteStore):
    """A local export root. Nothing is memory-mapped: ``map`` gives a private snapshot of a file
    (and its ``ShardFile``), ranges are ``pread``."""

    mappable = True
    immediate = True

    def __init__(self, root: str | os.PathLike):
        self.root = os.fspath(root)

    def __repr__(self) -> str:
        return f"LocalStore({self.root!r})"

    def __reduce__(self):
        return (LocalStore, (self.root,))

    def __eq__(self, other) -> bool:
        return isinstance(other, LocalStore) and other.root == self.root

    def __hash__(self) -> int:
        return hash(self.root)

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key) if key else self.root

    def describe(self, key: str) -> str:
        return self._path(key)

    def _open(self, path: str, what: str = "open") -> int:
        try:
            return os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        except OSError as e:
            raise MissingShardError(f"{path}: cannot {what} ({e.strerror or e})") from None

    def map(self, key: str) -> np.ndarray:
        """A read-only uint8 copy of the whole file, read now.

        The memory under it carries the open file as ``shard_file`` (``RecordTable.from_ipc``
        reads payloads from it later). ShardFormatError when the file shrinks while it is read.
        """
        path = self._path(key)
        fd = self._open(path)
        try:
            st = os.fstat(fd)
            size = st.st_size
            if size == 0:
                os.close(fd)
                return np.zeros(0, np.uint8)
            snap = _Snapshot(-1, size, **_ANON)
            if size >= _HUGE and _MADV_HUGEPAGE is not None:  # 2 MiB pages: a third of the CPU of 4 KiB ones
                try:
                    mmap.mmap.madvise(snap, _MADV_HUGEPAGE)
                except OSError:
                    pass
            got = _preadinto(fd, snap, 0)
            if got != size:
                raise ShardFormatError(f"{path}: the file changed while it was read: {got} of its {size} bytes "
                                       f"could be read (is it being copied or synced?)")
        except OSError as e:
            os.close(fd)
            raise MissingShardError(f"{path}: cannot read ({e.strerror or e})") from None
        except BaseException:
            os.close(fd)
            raise
        snap.shard_file = ShardFile(path, fd, _identity(st))
        a = np.frombuffer(snap, np.uint8)
        a.flags.writeable = False
        return a

    async def read(self, key: str, start: int | None = None, stop: int | None = None):
        path = self._path(key)
        if start is None and stop is None:
            try:
                with open(path, "rb") as f:
                    return f.read()
            except OSError as e:
                raise MissingShardError(f"{path}: cannot read ({e.strerror or e})") from None
        fd = self._open(path, "read")
        try:
            try:
                n = os.fstat(fd).st_size
                a = (n + start if start < 0 else start) if start is not None else 0
                b = n if stop is None else stop
                if a < 0 or b > n or a > b:
                    raise PastEndError(f"{path}: bytes [{start}, {stop}) lie past its end ({n} bytes)", n)
                data = _pread(fd, b - a, a)
            except OSError as e:
                raise MissingShardError(f"{path}: cannot read ({e.strerror or e})") from None
        finally:
            os.close(fd)
        if len(data) != b - a:
            raise PastEndError(f"{path}: bytes [{start}, {stop}) lie past its end (it shrank while read)", None)
        return data

    async def exists(self, key: str) -> bool:
        return os.path.exists(self._path(key))

    async def list(self, prefix: str = "") -> list[str]:
        try:
            return sorted(os.listdir(self._path(prefix)))
        except OSError:
            return []

    async def is_folder(self, prefix: str) -> bool:
        return os.path.isdir(self._path(prefix))

    async def sample(self, prefix: str, n: int) -> builtins.list[str] | None:
        """Up to n ``.arrow`` names, in directory order, reading no more of the folder than that."""
        out: list[str] = []
        try:
            with os.scandir(self._path(prefix)) as it:
                for entry in it:
                    if entry.name.endswith(".arrow"):
                        out.append(entry.name)
                        if len(out) >= n:
                            break
        except OSError:
            return []
        return out

    async def stat(self, key: str) -> Stat:
        try:
            st = os.stat(self._path(key))
        except OSError:
            raise MissingShardError(f"{self._path(key)}: no such file") from None
        return Stat(st.st_size, f"mtime:{st.st_mtime_ns}")

