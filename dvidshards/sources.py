"""Byte sources: where an export's files come from.

The read path needs only this small interface.  ``LocalSource`` memory-maps files read-only (a
chunk read touches just its record's pages); remote sources implement the same calls with
byte-range reads.
"""

from __future__ import annotations

import mmap
import os
from abc import ABC, abstractmethod

import numpy as np

from .errors import MissingShardError

__all__ = ["ByteSource", "LocalSource"]


class ByteSource(ABC):
    """Read-only access to the files of an export, by key relative to its root."""

    #: True when ``map`` gives zero-copy views of whole files
    mappable: bool = False

    @abstractmethod
    def describe(self, key: str) -> str:
        """The path or URL of key, for messages."""

    @abstractmethod
    def read(self, key: str, start: int | None = None, stop: int | None = None) -> bytes:
        """Bytes [start, stop) of key (the whole file by default); MissingShardError if absent."""

    @abstractmethod
    def size(self, key: str) -> int:
        """Length of key in bytes; MissingShardError if absent."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether key exists."""

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Names directly below the folder prefix (files and folders, no recursion)."""

    def map(self, key: str) -> np.ndarray:
        """A read-only uint8 view of the whole of key; only for ``mappable`` sources."""
        raise NotImplementedError(f"{type(self).__name__} cannot memory-map {self.describe(key)}")

    def read_many(self, key: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        """Several byte ranges of one file; remote sources fetch them concurrently."""
        return [self.read(key, a, b) for a, b in ranges]


class LocalSource(ByteSource):
    """A directory on a local file system; files are opened read-only and memory-mapped."""

    mappable = True

    def __init__(self, root: str | os.PathLike):
        self.root = os.fspath(root)

    def __repr__(self) -> str:
        return f"LocalSource({self.root!r})"

    def __reduce__(self):
        return (LocalSource, (self.root,))

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key) if key else self.root

    def describe(self, key: str) -> str:
        return self._path(key)

    def read(self, key: str, start: int | None = None, stop: int | None = None) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                if start:
                    f.seek(start)
                return f.read() if stop is None else f.read(stop - (start or 0))
        except OSError as e:
            raise MissingShardError(f"{path}: cannot read ({e.strerror or e})") from None

    def size(self, key: str) -> int:
        try:
            return os.stat(self._path(key)).st_size
        except OSError as e:
            raise MissingShardError(f"{self._path(key)}: cannot stat ({e.strerror or e})") from None

    def exists(self, key: str) -> bool:
        return os.path.exists(self._path(key))

    def list(self, prefix: str = "") -> list[str]:
        try:
            return sorted(os.listdir(self._path(prefix)))
        except OSError:
            return []

    def map(self, key: str) -> np.ndarray:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                if os.fstat(f.fileno()).st_size == 0:
                    return np.zeros(0, np.uint8)
                m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise MissingShardError(f"{path}: cannot open shard file ({e.strerror or e})") from None
        return np.frombuffer(m, dtype=np.uint8)
