"""References for tables of block records: Morton codes by brute force, an export's records, and
volume/chunk equality of two datasets."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from dvidshards.dataset import Dataset


def brute_morton(c, grid) -> int:
    """Compressed Morton code by the definition: interleave x, y, z bits, skipping spent axes."""
    bits = [max(int(g) - 1, 0).bit_length() for g in grid]
    code, out = 0, 0
    for b in range(max(bits)):
        for a in range(3):
            if b < bits[a]:
                code |= ((int(c[a]) >> b) & 1) << out
                out += 1
    return code


def export_records(root: Path, scale: int) -> dict:
    """{(x, y, z): (labels, supervoxels, payload)} of a scale's shard files, read with pyarrow."""
    out = {}
    for f in sorted((root / f"s{scale}").glob("*.arrow")):
        with pa.OSFile(str(f)) as src:
            for b in pa.ipc.open_stream(src):
                d = b.to_pydict()
                for i in range(b.num_rows):
                    key = (d["chunk_x"][i], d["chunk_y"][i], d["chunk_z"][i])
                    assert key not in out
                    out[key] = (d["labels"][i], d["supervoxels"][i], d["dvid_compressed_block"][i])
    return out


def assert_volumes_equal(ds_a: Dataset, ds_b: Dataset, scales) -> None:
    for k in scales:
        s = ds_a.scale(k)
        box = [list(s.voxel_offset), list(np.add(s.voxel_offset, s.size))]
        for labels in ("agglomerated", "supervoxels"):
            np.testing.assert_array_equal(ds_a.read(box, scale=k, labels=labels, fill_missing_shards=True),
                                          ds_b.read(box, scale=k, labels=labels, fill_missing_shards=True))


def assert_chunks_equal(ds_a: Dataset, ds_b: Dataset, scale: int, coords) -> None:
    for c in coords:
        box = [list(np.asarray(c) * 64), list(np.asarray(c) * 64 + 64)]
        for labels in ("agglomerated", "supervoxels"):
            np.testing.assert_array_equal(ds_a.read(box, scale=scale, labels=labels),
                                          ds_b.read(box, scale=scale, labels=labels))
