"""A directory on a local file system: files opened read-only and memory-mapped."""

from __future__ import annotations

import builtins
import mmap
import os

import numpy as np

from ..errors import MissingShardError
from .base import ByteStore, Stat, slice_range

__all__ = ["LocalStore"]


class LocalStore(ByteStore):
    """A local export root; ranges are zero-copy slices of a read-only memory map."""

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

    def map(self, key: str) -> np.ndarray:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                if os.fstat(f.fileno()).st_size == 0:
                    return np.zeros(0, np.uint8)
                m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise MissingShardError(f"{path}: cannot open ({e.strerror or e})") from None
        return np.frombuffer(m, dtype=np.uint8)

    async def read(self, key: str, start: int | None = None, stop: int | None = None):
        path = self._path(key)
        if start is None and stop is None:
            try:
                with open(path, "rb") as f:
                    return f.read()
            except OSError as e:
                raise MissingShardError(f"{path}: cannot read ({e.strerror or e})") from None
        return slice_range(self.map(key), start, stop, path)

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
