"""Outputs that jobs write and check: a precomputed or zarr v3 dataset's root, a scale of it opened
with TensorStore's own driver, and random chunks of it compared with the source export.

``convert`` writes them (and checks them with ``--verify N``); ``verify`` checks a conversion from
its manifest (``--spot-check N``). Both use these, so that the two checks are one.
"""

from __future__ import annotations

import os

import numpy as np
import tensorstore as ts

__all__ = ["compare_chunks", "kvstore_root", "open_scale"]


def kvstore_root(dest) -> dict:
    """The output root (path, URL or kvstore spec dict) as a TensorStore kvstore spec whose path
    ends with '/'."""
    if isinstance(dest, dict):
        j = dict(dest)
    elif "://" in os.fspath(dest):
        j = ts.KvStore.Spec(os.fspath(dest)).to_json()
    else:
        j = {"driver": "file", "path": os.path.abspath(os.fspath(dest))}
    p = j.get("path", "")
    if p and not p.endswith("/"):
        j["path"] = p + "/"
    return j


def open_scale(root: dict, fmt: str, key: str) -> ts.TensorStore:
    """Scale ``key`` of an output opened with TensorStore's driver: (x, y, z), from its metadata."""
    if fmt == "precomputed":
        return ts.open({"driver": "neuroglancer_precomputed", "kvstore": root,
                        "scale_metadata": {"key": key}}).result()[..., 0]
    return ts.open({"driver": "zarr3", "kvstore": {**root, "path": root.get("path", "") + key + "/"}}).result()


def compare_chunks(ds, arr: ts.TensorStore, fmt: str, scale: int, labels, n: int, rng) -> tuple[int, list[str]]:
    """Read ``n`` random source chunks of a scale from the output ``arr`` and compare them with the
    export (``ds``, a Dataset, duck-typed).

    Returns
    -------
    (int, list of str)
        Chunks compared, and one line per chunk that differs.
    """
    s = ds.scale(scale)
    origins = ds.shards(s.index)
    if not origins or n <= 0:
        return 0, []
    off = np.asarray(s.voxel_offset, np.int64)
    size = np.asarray(s.size, np.int64)
    chunk = np.asarray(s.chunk_size, np.int64)
    done, bad = 0, []
    for _ in range(n):
        o = origins[int(rng.integers(len(origins)))]
        coords = ds.shard(s.index, o).coords
        if not len(coords):
            continue
        c = np.asarray(coords[int(rng.integers(len(coords)))], np.int64)
        lo, hi = np.maximum(c * chunk, off), np.minimum((c + 1) * chunk, off + size)
        if (hi <= lo).any():
            continue
        want = ds.read([lo.tolist(), hi.tolist()], scale=s.index, labels=labels, threads=1)
        rlo = lo if fmt == "precomputed" else lo - off  # zarr arrays start at 0
        rhi = rlo + (hi - lo)
        got = arr[rlo[0]:rhi[0], rlo[1]:rhi[1], rlo[2]:rhi[2]].read().result()
        done += 1
        if not np.array_equal(got, want):
            bad.append(f"s{s.index} chunk {tuple(c.tolist())}: {int((got != want).sum())} voxels differ "
                       f"from the source")
    return done, bad
