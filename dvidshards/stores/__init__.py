"""Byte stores: one async-first interface over local files, TensorStore kvstores and memory.

``as_store`` turns what a user passes (a path, a URL, a kvstore spec dict, a store) into a store.
"""

from __future__ import annotations

import os

from ..errors import SpecError
from .base import ByteStore, PastEndError, Stat, background_loop, decode_pool, drive, run_sync
from .local import LocalStore
from .memory import MemoryStore

__all__ = ["ByteStore", "LocalStore", "MemoryStore", "PastEndError", "Stat", "as_store", "background_loop",
           "decode_pool", "drive", "run_sync"]


def as_store(source) -> ByteStore:
    """A ByteStore for a local directory, a URL (gs://, s3://, http(s)://), a kvstore spec or a store."""
    if isinstance(source, ByteStore):
        return source
    if isinstance(source, (str, os.PathLike)):
        s = os.fspath(source)
        if "://" in s and not s.startswith("file://"):
            from .kvstore import KvStore
            return KvStore.from_url(s)
        s = s[len("file://"):] if s.startswith("file://") else s
        if not os.path.isdir(s):
            if not os.path.exists(s):
                raise SpecError(f"{s}: no such folder (an export is a folder holding s0, s1, ...)")
            raise SpecError(f"{s}: is a file, not a folder (an export is a folder holding s0, s1, ...)")
        return LocalStore(s)
    if isinstance(source, dict):
        from .kvstore import KvStore
        return KvStore(source)
    raise SpecError(f"cannot open {type(source).__name__} as an export (give a path, URL or kvstore spec)")
