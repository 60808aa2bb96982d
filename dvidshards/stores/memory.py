"""An in-memory store: bytes that arrived by other routes, and tests."""

from __future__ import annotations

import builtins

import numpy as np

from ..errors import MissingShardError
from .base import ByteStore, Stat, slice_range

__all__ = ["MemoryStore"]


class MemoryStore(ByteStore):
    """Files held as bytes in a dict ``{key: bytes}``; ranges are zero-copy views.

    ``name`` appears in messages (``memory://name/key``).
    """

    mappable = True
    immediate = True

    def __init__(self, files: dict | None = None, name: str = "memory"):
        self.files = {} if files is None else dict(files)
        self.name = name

    def __repr__(self) -> str:
        return f"MemoryStore({self.name!r}, {len(self.files)} files)"

    def describe(self, key: str) -> str:
        return f"memory://{self.name}/{key}"

    def map(self, key: str) -> np.ndarray:
        try:
            return np.frombuffer(self.files[key], np.uint8)
        except KeyError:
            raise MissingShardError(f"{self.describe(key)}: no such file") from None

    async def read(self, key: str, start: int | None = None, stop: int | None = None):
        return slice_range(self.map(key), start, stop, self.describe(key))

    async def exists(self, key: str) -> bool:
        return key in self.files

    async def list(self, prefix: str = "") -> list[str]:
        p = prefix.strip("/") + "/" if prefix.strip("/") else ""
        return sorted({k[len(p):].split("/", 1)[0] for k in self.files if k.startswith(p)} - {""})

    async def sample(self, prefix: str, n: int) -> builtins.list[str] | None:
        return [k for k in await self.list(prefix) if k.endswith(".arrow")]  # in memory: every name is cheap

    async def stat(self, key: str) -> Stat:
        return Stat(len(self.map(key)), None)
