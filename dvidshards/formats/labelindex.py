"""DVID's label index as a Parquet dataset: its schema, hash buckets and label-source identity.

``dvidshards label-index`` writes ``out/bucket=HH/part-0.parquet`` files (every row of a body in
the file of ``bucket_of(body, bits)``, sorted by body, supervoxel and chunk) and
``out/_meta.json``; ``dvidshards.query.BodyIndex`` reads them.  Pure: no I/O here.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

__all__ = ["HASH_BITS", "INDEX_FORMAT", "INDEX_SCHEMA", "bucket_name", "bucket_of", "labels_id"]

INDEX_FORMAT = "dvidshards-label-index"
HASH_BITS = 16  # bucket ids are the top bits of a 16-bit multiplicative hash of the body id
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)

INDEX_SCHEMA = pa.schema([
    ("body", pa.uint64()), ("supervoxel", pa.uint64()),
    ("chunk_x", pa.int32()), ("chunk_y", pa.int32()), ("chunk_z", pa.int32()),
    ("voxels", pa.int64()),
])


def bucket_of(body, bits: int) -> np.ndarray:
    """The hash bucket (0 .. 2**bits - 1) of body ids in a ``bits``-bit partition."""
    b = np.asarray(body, dtype=np.uint64)
    h = (b * _GOLDEN) >> np.uint64(64 - HASH_BITS)
    return (h >> np.uint64(HASH_BITS - bits)).astype(np.int64)


def bucket_name(bucket: int, bits: int) -> str:
    """The file of a bucket, relative to the index folder."""
    return f"bucket={bucket:0{max(1, (bits + 3) // 4)}x}/part-0.parquet"


def labels_id(src) -> dict:
    """What identifies a label source in job metadata: ``src.identity()`` (cheap: a mapping file
    by its path and change stamp, nothing parsed; a mapping object by its content's hash)."""
    return dict(src.identity())
