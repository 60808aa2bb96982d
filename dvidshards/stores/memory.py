"""An in-memory store: bytes that arrived by other routes, ``memory://`` locations, and tests."""

from __future__ import annotations

import builtins
import threading
from typing import Any, ClassVar

import numpy as np

from ..errors import MissingShardError
from .base import ByteStore, Stat, slice_range

__all__ = ["MemoryStore"]

_write_lock = threading.Lock()  # create and replace compare, then write: one at a time per process


class MemoryStore(ByteStore):
    """Files held as bytes in a dict ``{key: bytes}``; ranges are zero-copy views.

    ``name`` appears in messages (``memory://name/key``). ``MemoryStore.named(name)`` is the one
    store of that name in this process (what ``memory://name/...`` opens): a job's output written
    there is read back by a later ``open`` in the same process. A store pickles with its files.
    """

    mappable = True
    immediate = True
    _named: ClassVar[dict[str, dict[str, bytes]]] = {}

    def __init__(self, files: dict[str, bytes] | None = None, name: str = "memory", *, prefix: str = "",
                 read_only: bool = False, _shared: dict[str, bytes] | None = None):
        self.files: dict[str, bytes] = _shared if _shared is not None else ({} if files is None else dict(files))
        self.name = name
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.read_only = read_only

    @classmethod
    def named(cls, name: str, prefix: str = "", *, read_only: bool = False) -> MemoryStore:
        """The process-wide store ``memory://name/`` (made empty on first use), at folder prefix."""
        with _write_lock:
            files = cls._named.setdefault(name, {})
        return cls(name=name, prefix=prefix, read_only=read_only, _shared=files)

    def __repr__(self) -> str:
        return f"MemoryStore({self.describe('')!r}, {len(self.files)} files)"

    def describe(self, key: str) -> str:
        return f"memory://{self.name}/{self.prefix}{key}"

    def child(self, prefix: str) -> MemoryStore:
        return MemoryStore(name=self.name, prefix=self.prefix + prefix.strip("/"), read_only=self.read_only,
                           _shared=self.files)

    def map(self, key: str) -> np.ndarray:
        try:
            return np.frombuffer(self.files[self.prefix + key], np.uint8)
        except KeyError:
            raise MissingShardError(f"{self.describe(key)}: no such file") from None

    async def read(self, key: str, start: int | None = None, stop: int | None = None) -> Any:
        return slice_range(self.map(key), start, stop, self.describe(key))

    async def get(self, key: str) -> bytes | None:
        data = self.files.get(self.prefix + key)
        return None if data is None else bytes(data)

    async def exists(self, key: str) -> bool:
        return self.prefix + key in self.files

    def _below(self, prefix: str) -> tuple[str, builtins.list[str]]:
        p = self.prefix + (prefix.strip("/") + "/" if prefix.strip("/") else "")
        return p, [k for k in builtins.list(self.files) if k.startswith(p)]

    async def list(self, prefix: str = "") -> builtins.list[str]:
        p, keys = self._below(prefix)
        return sorted({k[len(p):].split("/", 1)[0] for k in keys} - {""})

    async def list_prefix(self, prefix: str = "") -> builtins.list[str]:
        _, keys = self._below(prefix)
        return sorted(k[len(self.prefix):] for k in keys)

    async def is_folder(self, prefix: str) -> bool:
        return bool(self._below(prefix)[1])

    async def sample(self, prefix: str, n: int) -> builtins.list[str] | None:
        return [k for k in await self.list(prefix) if k.endswith(".arrow")]  # in memory: every name is cheap

    async def stat(self, key: str) -> Stat:
        return Stat(len(self.map(key)), None)

    # --- writing (a dict assignment is atomic) ------------------------------------------------------

    async def put(self, key: str, data: bytes) -> None:
        self._check_writable(key)
        self.files[self.prefix + key] = bytes(data)

    async def create(self, key: str, data: bytes) -> bool:
        self._check_writable(key)
        with _write_lock:
            if self.prefix + key in self.files:
                return False
            self.files[self.prefix + key] = bytes(data)
            return True

    async def replace(self, key: str, data: bytes, *, expected: bytes) -> bool:
        self._check_writable(key)
        with _write_lock:
            if self.files.get(self.prefix + key) != expected:
                return False
            self.files[self.prefix + key] = bytes(data)
            return True

    async def delete(self, key: str) -> None:
        self._check_writable(key)
        self.files.pop(self.prefix + key, None)

    async def delete_prefix(self, prefix: str = "") -> None:
        self._check_writable(prefix)
        p = self.prefix + prefix.strip("/")
        _, keys = self._below(prefix)
        for k in [*keys, p]:
            self.files.pop(k, None)
