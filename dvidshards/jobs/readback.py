"""An output read back: its root as a TensorStore kvstore, a scale opened with TensorStore's own
driver, and random chunks of it compared with the source export. ``convert --verify N`` and
``verify --spot-check N`` are this one check.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorstore as ts

from ..errors import SpecError
from ..stores import ByteStore, as_store

__all__ = ["SpotCheck", "compare_chunks", "kvstore_root", "open_scale"]

_BACKGROUND_TRIES = 16  # random chunks looked at per background sample before it is taken as one with data
_DATA_TRIES = 64  # random draws that find no chunk not compared yet before the chunks with data count as done


def kvstore_root(dest: Any) -> dict:
    """The output root (path, URL, kvstore spec dict or store) as a TensorStore kvstore spec."""
    if isinstance(dest, ByteStore):
        store = dest
    else:  # a local output given by path need not exist yet
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


@dataclass(frozen=True)
class SpotCheck:
    """What :func:`compare_chunks` compared: chunks the source holds records of (``with_data``),
    chunks it holds none of (``background``: must read as 0), one line per chunk that differs."""

    with_data: int
    background: int
    problems: list[str]

    @property
    def compared(self) -> int:
        return self.with_data + self.background

    def describe(self) -> str:
        return f"{self.compared} chunks compared ({self.with_data} with data, {self.background} background)"


def compare_chunks(ds: Any, arr: ts.TensorStore, fmt: str, scale: int, labels: Any, n: int, rng: Any, *,
                   box: Any = None) -> SpotCheck:
    """Compare up to ``n`` random chunks of a scale of the output ``arr`` with the export ``ds``.

    Half are chunks the source holds (a random record of a random shard file), half chunks of the
    volume it holds no record of (which must read as 0); a volume short of one kind gives its
    share to the other. Each chunk is drawn once at most: a small source has each chunk compared
    once. ``box`` (``[lo, hi)``, voxels of this scale): an output of the box only (``convert
    --box``): chunks meeting it are drawn, and the source reads as 0 outside it.
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
    end = np.minimum(off + np.asarray(s.size, np.int64), np.asarray(dom.exclusive_max[:3], np.int64) + zarr_off)
    off = np.maximum(off, np.asarray(dom.inclusive_min[:3], np.int64) + zarr_off)
    blo, bhi = (off, end) if box is None else (np.maximum(off, box[0]), np.minimum(end, box[1]))
    glo, ghi = blo // chunk, -(-bhi // chunk)  # the chunks drawn
    if (ghi <= glo).any():
        return SpotCheck(0, 0, [])

    def meets(o: Any) -> bool:
        a, b = s.shard_box(o)
        return bool((a < ghi).all() and (b > glo).all())

    origins = [o for o in origins if meets(o)]

    def coords_of(o: Any) -> np.ndarray:
        x, y, z = (int(v) for v in np.asarray(o, np.int64) // chunk)
        shard = reader.shard(x, y, z)
        c = np.asarray(shard.coords if shard is not None else np.zeros((0, 3)), np.int64).reshape(-1, 3)
        return c[((c >= glo) & (c < ghi)).all(axis=1)]

    def holds(c: Any) -> bool:
        x, y, z = (int(v) for v in c)
        if s.shard_origin(x, y, z) not in have:
            return False  # no shard file there: DVID writes none for an all-background shard
        shard = reader.shard(x, y, z)
        return shard is not None and shard.find(x, y, z) is not None

    def chunks_with_data() -> Any:
        if len(origins) <= n:  # few shard files: every chunk they hold, in random order
            pool = np.concatenate([coords_of(o) for o in origins] or [np.zeros((0, 3), np.int64)])
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

    def background_chunks() -> Any:
        if not _BACKGROUND_TRIES:
            return
        if int(np.prod(ghi - glo)) <= max(4 * n, 4096):  # a small grid: every background chunk, in random order
            grid = np.stack(np.meshgrid(*(np.arange(a, b) for a, b in zip(glo, ghi, strict=True)),
                                        indexing="ij"), -1).reshape(-1, 3)
            empty = grid[[not holds(c) for c in grid]]
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

    with_data, background, bad = 0, 0, []
    data, empty = chunks_with_data(), background_chunks()
    for k in range(n):
        first, second = (empty, data) if k % 2 else (data, empty)
        c, kind = next(first, None), first
        if c is None:
            c, kind = next(second, None), second
        if c is None:
            break  # every chunk of both kinds compared
        lo, hi = np.maximum(c * chunk, off), np.minimum((c + 1) * chunk, end)
        rlo, rhi = lo - zarr_off, hi - zarr_off
        got = arr[rlo[0]:rhi[0], rlo[1]:rhi[1], rlo[2]:rhi[2]].read().result()
        where = f"s{s.index} chunk {tuple(c.tolist())}"
        if kind is empty:
            background += 1
            if got.any():
                bad.append(f"{where}: {int(np.count_nonzero(got))} voxels are not 0 where the source has no data "
                           f"(background)")
            continue
        want = ds.read([lo.tolist(), hi.tolist()], scale=s.index, labels=labels, threads=1)
        if box is not None:  # 0 outside the box
            a, b = np.clip(blo - lo, 0, hi - lo), np.clip(bhi - lo, 0, hi - lo)
            keep = np.zeros(want.shape, bool)
            keep[a[0]:b[0], a[1]:b[1], a[2]:b[2]] = True
            want[~keep] = 0
        with_data += 1
        if not np.array_equal(got, want):
            bad.append(f"{where}: {int((got != want).sum())} voxels differ from the source")
    return SpotCheck(with_data, background, bad)
