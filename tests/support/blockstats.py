"""One block's statistics through `formats.blockstats.batch_stats` (a batch of one), as dense arrays."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from dvidshards.formats.blockstats import batch_stats


def block_stats(block: bytes, extent=None, *, lo=(0, 0, 0)) -> SimpleNamespace:
    """``labels``, ``counts`` (N,) and ``boxes`` (N, 6), zeros where an entry has no voxel, of the
    voxels in [lo, extent) of one block (its own label list length, when readable, is the record's)."""
    n = int.from_bytes(block[12:16], "little") if len(block) >= 16 else 0
    n = n if 16 + 8 * n <= len(block) else 0
    hi = (1 << 30,) * 3 if extent is None else extent
    _, ent, _, vox, box = batch_stats(np.frombuffer(block, np.uint8), np.array([0, len(block)]),
                                      np.array([lo]), np.array([hi]), np.array([n]))
    counts, boxes = np.zeros(n, np.int64), np.zeros((n, 6), np.int64)
    counts[ent], boxes[ent] = vox, box
    return SimpleNamespace(labels=np.frombuffer(block, "<u8", n, 16), counts=counts, boxes=boxes)
