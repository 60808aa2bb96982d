"""Outputs read back: a precomputed or zarr v3 dataset's root, a scale of it opened
with TensorStore's own driver, and random chunks of it compared with the source export.

``convert`` writes them (and checks them with ``--verify N``); ``verify`` checks a conversion from
its manifest (``--spot-check N``). Both use these, so that the two checks are one.
"""

from __future__ import annotations

import os

import numpy as np
import tensorstore as ts

from ..errors import SpecError
from ..stores import as_store

__all__ = ["SpotCheck", "compare_chunks", "kvstore_root", "open_scale"]


def kvstore_root(dest) -> dict:
    """The output root (path, URL or kvstore spec dict) as a TensorStore kvstore spec whose path
    ends with '/' (``stores.as_store``'s parser)."""
    url = isinstance(dest, dict) or "://" in os.fspath(dest)
    store = as_store(dest) if url else as_store(dest, writable=True, what="output")
    spec = store.kvstore_spec()
    if spec is None:
        raise SpecError(f"{store.describe('')}: TensorStore cannot open a store held in Python memory")
    return spec


def open_scale(root: dict, fmt: str, key: str) -> ts.TensorStore:
    """Scale ``key`` of an output opened with TensorStore's driver: (x, y, z), from its metadata."""
    if fmt == "precomputed":
        return ts.open({"driver": "neuroglancer_precomputed", "kvstore": root,
                        "scale_metadata": {"key": key}}).result()[..., 0]
    return ts.open({"driver": "zarr3", "kvstore": {**root, "path": root.get("path", "") + key + "/"}}).result()


class SpotCheck(tuple):
    """What ``compare_chunks`` checked: unpacks as ``(chunks compared, mismatch lines)``.

    ``with_data`` chunks hold records in the source; ``background`` chunks hold none there and must
    read as 0 in the output; the first item is their sum.
    """

    with_data: int
    background: int

    def __new__(cls, with_data: int, background: int, problems: list[str]):
        self = super().__new__(cls, (int(with_data) + int(background), list(problems)))
        self.with_data, self.background = int(with_data), int(background)
        return self

    def __reduce__(self):
        return (SpotCheck, (self.with_data, self.background, self[1]))

    @property
    def compared(self) -> int:
        return int(self[0])

    @property
    def problems(self) -> list[str]:
        return self[1]

    def describe(self) -> str:
        """``"N chunks compared (a with data, b background)"``."""
        return f"{self.compared} chunks compared ({self.with_data} with data, {self.background} background)"


_BACKGROUND_TRIES = 16  # random chunks looked at per background sample before it is taken as one with data
_DATA_TRIES = 64  # random draws that find no chunk not compared yet before the chunks with data count as done


def compare_chunks(ds, arr: ts.TensorStore, fmt: str, scale: int, labels, n: int, rng) -> SpotCheck:
    """Read up to ``n`` random chunks of a scale from the output ``arr`` and compare them with the
    export (``ds``, a Dataset, duck-typed). Each chunk is drawn once at most: a source with fewer
    chunks than ``n`` has each of them compared once, and the count says how many were.

    Half of them are chunks the source holds (a random shard file, a random record of it; every
    record of every shard in random order when there are no more shard files than ``n``), read from
    both and compared.  The other half are chunks inside the volume that the source has no record
    for (drawn uniformly over the volume's chunk grid until one has none, in a shard file or where
    there is none; every such chunk in random order when the grid is small), which must read as 0
    in the output.  A volume with no background (or too little to find in a few draws) gives its
    share to chunks with data, and the other way round.

    Returns
    -------
    SpotCheck
        ``(chunks compared, one line per chunk that differs)``, and the counts of each kind.
    """
    s = ds.scale(scale)
    origins = ds.shards(s.index)
    if not origins or n <= 0:
        return SpotCheck(0, 0, [])
    reader = ds.reader(s.index, labels=labels)
    have = set(origins)
    off = np.asarray(s.voxel_offset, np.int64)
    chunk = np.asarray(s.chunk_size, np.int64)
    zarr_off = off if fmt != "precomputed" else np.zeros(3, np.int64)  # zarr arrays start at 0
    # the volume both describe (a source read without its spec guesses a volume from its file names)
    dom = arr.domain
    lo_out = np.asarray(dom.inclusive_min[:3], np.int64) + zarr_off
    end = np.minimum(off + np.asarray(s.size, np.int64), np.asarray(dom.exclusive_max[:3], np.int64) + zarr_off)
    off = np.maximum(off, lo_out)
    glo, ghi = off // chunk, -(-end // chunk)
    if (ghi <= glo).any():
        return SpotCheck(0, 0, [])
    with_data, background, bad = 0, 0, []

    def output(lo, hi):
        rlo, rhi = lo - zarr_off, hi - zarr_off
        return arr[rlo[0]:rhi[0], rlo[1]:rhi[1], rlo[2]:rhi[2]].read().result()

    def box(c):
        return np.maximum(c * chunk, off), np.minimum((c + 1) * chunk, end)

    def coords_of(o) -> np.ndarray:
        x, y, z = (int(v) for v in np.asarray(o, np.int64) // chunk)
        shard = reader.shard(x, y, z)
        return np.asarray(shard.coords if shard is not None else np.zeros((0, 3)), np.int64).reshape(-1, 3)

    def holds(c) -> bool:
        x, y, z = (int(v) for v in c)
        if s.shard_origin(x, y, z) not in have:
            return False  # no shard file there: DVID writes none for an all-background shard
        shard = reader.shard(x, y, z)
        return shard is not None and shard.find(x, y, z) is not None

    def chunks_with_data():
        if len(origins) <= n:  # few shard files: every chunk they hold, in random order
            pool = np.concatenate([coords_of(o) for o in origins])
            yield from pool[rng.permutation(len(pool))]
            return
        seen: set = set()
        misses = 0
        while misses < _DATA_TRIES:
            coords = coords_of(origins[int(rng.integers(len(origins)))])
            c = coords[int(rng.integers(len(coords)))] if len(coords) else None
            if c is None or tuple(c.tolist()) in seen:
                misses += 1
                continue
            seen.add(tuple(c.tolist()))
            misses = 0
            yield c

    def background_chunks():
        if not _BACKGROUND_TRIES:
            return
        cells = int(np.prod(ghi - glo))
        if cells <= max(4 * n, 4096):  # a small grid: every background chunk, in random order
            grid = np.stack(np.meshgrid(*(np.arange(a, b) for a, b in zip(glo, ghi, strict=True)),
                                        indexing="ij"), -1).reshape(-1, 3)
            empty = grid[[not holds(c) for c in grid]] if len(grid) else grid
            yield from empty[rng.permutation(len(empty))]
            return
        seen: set = set()
        while True:
            for _ in range(_BACKGROUND_TRIES):
                c = rng.integers(glo, ghi)
                if tuple(c.tolist()) not in seen and not holds(c):
                    break
            else:
                return
            seen.add(tuple(c.tolist()))
            yield c

    data, empty = chunks_with_data(), background_chunks()
    for k in range(n):
        first, second = (empty, data) if k % 2 else (data, empty)
        c = next(first, None)
        kind = first
        if c is None:
            c, kind = next(second, None), second
        if c is None:
            break  # every chunk of both kinds compared
        lo, hi = box(c)
        if (hi <= lo).any():
            continue
        got = output(lo, hi)
        if kind is empty:
            background += 1
            if got.any():
                bad.append(f"s{s.index} chunk {tuple(c.tolist())}: {int(np.count_nonzero(got))} voxels are not 0 "
                           f"where the source has no data (background)")
            continue
        want = ds.read([lo.tolist(), hi.tolist()], scale=s.index, labels=labels, threads=1)
        with_data += 1
        if not np.array_equal(got, want):
            bad.append(f"s{s.index} chunk {tuple(c.tolist())}: {int((got != want).sum())} voxels differ "
                       f"from the source")
    return SpotCheck(with_data, background, bad)
