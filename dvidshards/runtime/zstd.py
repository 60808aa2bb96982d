"""One zstd decompression context per OS thread, for `formats.records` (installed on import).

Keyed by thread id, not a ``threading.local``: TensorStore's pool threads get a fresh thread
state (hence a fresh local) per callback, and a ``ZSTD_DCtx`` per chunk cost ~10 % of a read.
A thread id is reused only after its thread ended.
"""

from __future__ import annotations

import threading

import zstandard

from ..formats import records

__all__ = ["decompressor", "install"]

_dctxs: dict[int, zstandard.ZstdDecompressor] = {}
_get_ident = threading.get_ident


def decompressor() -> zstandard.ZstdDecompressor:
    """This thread's decompressor."""
    d = _dctxs.get(_get_ident())
    if d is None:
        if len(_dctxs) >= 256:  # short-lived threads come and go: drop the stale ones
            _dctxs.clear()
        d = _dctxs[_get_ident()] = zstandard.ZstdDecompressor()
    return d


def install() -> None:
    records.install_decompressor(decompressor)


install()
