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
import contextlib
import errno
import mmap
import os
import shutil
import threading
import uuid
from collections.abc import Iterator
from typing import Any, BinaryIO

import numpy as np

from ..errors import MissingShardError, OutputError, ShardFormatError
from .base import TMP, ByteStore, PastEndError, Stat, is_temporary, os_error

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

    def __reduce__(self) -> tuple[Any, ...]:
        return (ShardFile, (self.path, -1, self.ident))

    def __del__(self, _close: Any = os.close, _release: Any = _release) -> None:  # bound now: usable at interpreter exit
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

    def readinto(self, buf: Any, offset: int) -> int:
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

    def _preadinto(fd: int, buf: Any, offset: int) -> int:
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

    def _preadinto(fd: int, buf: Any, offset: int) -> int:
        data = _pread(fd, len(memoryview(buf)), offset)
        memoryview(buf).cast("B")[:len(data)] = data
        return len(data)


class _Snapshot(mmap.mmap):
    """Private anonymous memory holding a copy of a file, and the file it came from (``shard_file``).

    ``madvise`` does nothing: the shard loader drops a file map's pages after a load, which on
    anonymous memory would discard the copy; the copy is freed with its last reference instead.
    """

    shard_file: ShardFile | None = None

    def madvise(self, *args: Any, **kwargs: Any) -> None:
        return None


class LocalStore(ByteStore):
    """A folder on this host's file system. Reading maps nothing: ``map`` gives a private snapshot
    of a file (and its ``ShardFile``), ranges are ``pread``. Writing goes through a hidden
    temporary file renamed into place (``.NAME.tmp-XXXX``, which listings skip); ``create`` links
    a complete temporary file to its name (``O_EXCL`` where links are not supported)."""

    mappable = True
    immediate = True

    def __init__(self, root: str | os.PathLike[str], *, read_only: bool = False):
        self.root = os.fspath(root)
        self.read_only = read_only

    def __repr__(self) -> str:
        return f"LocalStore({self.root!r}{', read_only=True' if self.read_only else ''})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_local_store, (self.root, self.read_only))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LocalStore) and other.root == self.root

    def __hash__(self) -> int:
        return hash(self.root)

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key) if key else self.root

    def describe(self, key: str) -> str:
        return self._path(key)

    def local_path(self, key: str = "") -> str:
        return self._path(key)

    def kvstore_spec(self) -> dict[str, Any]:
        return {"driver": "file", "path": os.path.abspath(self.root).rstrip("/") + "/"}

    def child(self, prefix: str) -> LocalStore:
        return LocalStore(self._path(prefix.strip("/")), read_only=self.read_only)

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

    async def read(self, key: str, start: int | None = None, stop: int | None = None) -> bytes:
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

    async def get(self, key: str) -> bytes | None:
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except IsADirectoryError:
            raise OutputError(f"{self._path(key)}: is a folder, not a file") from None
        except OSError as e:
            raise os_error(e, self._path(key), "read it") from None

    def open(self, key: str) -> BinaryIO:
        try:
            return open(self._path(key), "rb")
        except FileNotFoundError:
            raise MissingShardError(f"{self._path(key)}: no such file") from None
        except OSError as e:
            raise os_error(e, self._path(key), "read it") from None

    async def exists(self, key: str) -> bool:
        return os.path.exists(self._path(key))

    async def list(self, prefix: str = "") -> builtins.list[str]:
        try:
            names = os.listdir(self._path(prefix))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as e:
            raise os_error(e, self._path(prefix), "list it") from None
        return sorted(n for n in names if not is_temporary(n))

    async def list_prefix(self, prefix: str = "") -> builtins.list[str]:
        top = self._path(prefix.strip("/"))
        out = []
        for folder, _dirs, files in os.walk(top):
            rel = os.path.relpath(folder, self.root).replace(os.sep, "/")
            out += [n if rel == "." else f"{rel}/{n}" for n in files if not is_temporary(n)]
        return sorted(out)

    async def is_folder(self, prefix: str) -> bool:
        return os.path.isdir(self._path(prefix))

    async def sample(self, prefix: str, n: int) -> builtins.list[str] | None:
        """Up to n ``.arrow`` names, in directory order, reading no more of the folder than that."""
        out: builtins.list[str] = []
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

    # --- writing --------------------------------------------------------------------------------

    def _temporary(self, key: str) -> tuple[str, str]:
        target = self._path(key)
        folder, name = os.path.split(target)
        return target, os.path.join(folder, f".{name}{TMP}{uuid.uuid4().hex[:12]}")

    @contextlib.contextmanager
    def writer(self, key: str) -> Iterator[BinaryIO]:
        self._check_writable(key)
        target, tmp = self._temporary(key)
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(tmp, "wb") as f:
                yield f
            os.replace(tmp, target)
        except OSError as e:
            _unlink_quietly(tmp)
            raise os_error(e, target, "write it") from None
        except BaseException:
            _unlink_quietly(tmp)
            raise

    async def put(self, key: str, data: bytes) -> None:
        with self.writer(key) as f:
            f.write(data)

    async def create(self, key: str, data: bytes) -> bool:
        self._check_writable(key)
        target, tmp = self._temporary(key)
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
            try:
                os.link(tmp, target)  # appears whole, only where nothing is
            except FileExistsError:
                return False
            except OSError as e:
                if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                    raise
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)  # no links here
                with os.fdopen(fd, "wb") as t:
                    t.write(data)
            return True
        except FileExistsError:
            return False
        except OSError as e:
            raise os_error(e, target, "create it") from None
        finally:
            _unlink_quietly(tmp)

    async def replace(self, key: str, data: bytes, *, expected: bytes) -> bool:
        # only a lock's owner replaces it (its heartbeat) or a job taking over a dead owner's:
        # compare, then rename
        self._check_writable(key)
        if await self.get(key) != expected:
            return False
        await self.put(key, data)
        return True

    async def delete(self, key: str) -> None:
        self._check_writable(key)
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise os_error(e, self._path(key), "delete it") from None

    async def delete_prefix(self, prefix: str = "") -> None:
        self._check_writable(prefix)
        p = self._path(prefix.strip("/"))
        try:
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p)
            elif os.path.lexists(p):
                os.unlink(p)
        except OSError as e:
            raise os_error(e, p, "delete it") from None

    def check_writable(self, *, kind: str = "folder") -> None:
        """The nearest existing folder on the path is a folder, writable, with space left
        (nothing is created)."""
        self._check_writable("")
        target = os.path.abspath(self.root)
        if os.path.exists(target):
            if kind == "folder" and not os.path.isdir(target):
                raise OutputError(f"{target}: is a file; a folder is needed here")
            if kind == "file" and os.path.isdir(target):
                raise OutputError(f"{target}: is a folder; a file is needed here")
        probe = target if os.path.isdir(target) else os.path.dirname(target)
        while not os.path.exists(probe):
            probe = os.path.dirname(probe)
        if not os.path.isdir(probe):
            raise OutputError(f"{self.root}: cannot make the folder: {probe} is a file")
        try:
            st = os.statvfs(probe)
        except OSError:
            st = None
        read_only = st is not None and bool(st.f_flag & getattr(os, "ST_RDONLY", 1))
        if not os.access(probe, os.W_OK | os.X_OK):
            why = "read-only file system" if read_only else "permission denied"
            raise OutputError(f"{self.root}: cannot write there: {why} ({probe}); choose a destination "
                              f"you can write to")
        if st is None:
            return
        if read_only:
            raise OutputError(f"{self.root}: cannot write there: read-only file system ({probe})")
        free = st.f_bavail * st.f_frsize
        if free < 1 << 20:
            raise OutputError(f"{self.root}: cannot write there: no space left on the device ({free:,} "
                              f"bytes free at {probe})")


def _local_store(root: str, read_only: bool) -> LocalStore:
    return LocalStore(root, read_only=read_only)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
