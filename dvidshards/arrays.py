"""A scale of an export as a dask array over the bulk reader (``Dataset.to_dask``).

Each block is one ``ds.read(box, ...)`` of a box aligned to the chunk grid (no chunk is decoded
by two blocks); the first and last blocks along an axis are cut by the volume or ``box``.  The
graph is one lazy blockwise layer whose tasks pickle the dataset, not data, so they run on any
dask scheduler.  dask is optional (``pip install 'dvidshards[dask]'``).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from .errors import SpecError
from .formats.labels import as_labels
from .formats.multiscale import Scale
from .protocol import DatasetLike

__all__ = ["block_boxes", "to_dask"]


def _edges(lo: int, hi: int, step: int) -> list[int]:
    """Block boundaries of [lo, hi): multiples of step inside, lo and hi at the ends."""
    first = (lo // step + 1) * step
    return [lo, *range(first, hi, step), hi]


def block_boxes(s: Scale, chunks: Any = None, box: Any = None) -> tuple[np.ndarray, np.ndarray, list[list[int]]]:
    """(lo, hi, per-axis block boundaries) of the blocks of a scale (see `to_dask`)."""
    cs = np.asarray(s.chunk_size, np.int64)
    vlo = np.asarray(s.voxel_offset, np.int64)
    vhi = vlo + np.asarray(s.size, np.int64)
    if box is None:
        lo, hi = vlo, vhi
    else:
        b = np.asarray(box, np.int64)
        if b.shape != (2, 3) or (b[0] < vlo).any() or (b[1] > vhi).any() or (b[1] <= b[0]).any():
            raise SpecError(f"box {np.asarray(box).tolist()} is not a non-empty box inside the volume "
                            f"{vlo.tolist()}..{vhi.tolist()}")
        lo, hi = b[0], b[1]
    if chunks is None:
        chunks = 4 * cs  # 256³ uint64: 128 MiB a block
    step = np.broadcast_to(np.asarray(chunks, np.int64), (3,))
    if (step < 1).any() or (step % cs).any():
        raise SpecError(f"chunks {np.asarray(chunks).tolist()} must be positive multiples of the chunk size "
                        f"{cs.tolist()}")
    edges = [_edges(int(lo[a]), int(hi[a]), int(step[a])) for a in range(3)]
    return lo, hi, edges


def _read_block(ds: DatasetLike, scale: int, labels: Any, edges, fill_missing_shards: bool, block_id=None):
    i, j, k = block_id
    box = [[edges[0][i], edges[1][j], edges[2][k]], [edges[0][i + 1], edges[1][j + 1], edges[2][k + 1]]]
    return ds.read(box, scale=scale, labels=labels, threads=1, fill_missing_shards=fill_missing_shards)


def to_dask(ds: DatasetLike, scale: int | Scale = 0, labels: Any = "agglomerated", *, chunks: Any = None,
            box: Any = None, fill_missing_shards: bool = False) -> Any:
    """A scale as a lazy ``dask.array.Array`` (x, y, z) of uint64, one single-threaded bulk read per
    block (dask runs blocks in parallel).

    Parameters
    ----------
    ds : DatasetLike
    scale : int or Scale
    labels : "agglomerated", "supervoxels" or a mapping
        Voxel values (see ``Dataset.read``).
    chunks : int or (x, y, z), optional
        Block size in voxels, multiples of the chunk size (default 256³), aligned to the chunk grid.
    box : [[x0, y0, z0], [x1, y1, z1]], optional
        Only this part of the volume (default: all of it); index 0 of the array is ``x0``.
    fill_missing_shards : bool
        Read missing shard files as background instead of raising ``MissingShardError``.
    """
    try:
        import dask.array as da
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("to_dask needs dask: pip install 'dvidshards[dask]'") from e
    s = ds.scale(scale)
    src = as_labels(labels)
    _, _, edges = block_boxes(s, chunks, box)
    sizes = tuple(tuple(int(b - a) for a, b in zip(e[:-1], e[1:], strict=True)) for e in edges)
    fn = functools.partial(_read_block, ds, s.index, src, tuple(tuple(e) for e in edges), bool(fill_missing_shards))
    name = f"dvidshards-read-{s.folder}-{src.name}-{abs(hash((id(ds), s.index, src, str(edges)))):x}"
    return da.map_blocks(fn, dtype=np.uint64, chunks=sizes, name=name, meta=np.empty((0, 0, 0), np.uint64))
