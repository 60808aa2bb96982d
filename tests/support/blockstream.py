"""DVID ``/blocks`` streams written for the tests (what ``POST …/blocks`` takes; the package only reads them)."""

from __future__ import annotations

import gzip

import numpy as np

from dvidshards.formats.blocks import lz4_block_compress


def write_stream(records, *, compression: str = "gzip") -> bytes:
    """``int32 bx, by, bz, nbytes`` and the block, per ``((bx, by, bz), block)`` record, blocks gzipped
    (DVID's native form), as lz4 blocks or uncompressed."""
    out = []
    for (bx, by, bz), block in records:
        data = bytes(block)
        if compression == "gzip":
            data = gzip.compress(data, 6, mtime=0)
        elif compression == "lz4":
            data = lz4_block_compress(data)
        elif compression != "uncompressed":
            raise ValueError(compression)
        out += [np.array([bx, by, bz, len(data)], "<i4").tobytes(), data]
    return b"".join(out)
