"""Brute force for body statistics and label indexes (from the volumes an export was written from),
and readers of their outputs with pyarrow alone."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pds
import pyarrow.parquet as pq

import dvidshards
from dvidshards.formats.labelindex import bucket_of
from tests.support.exports import make_export

STATS_COLUMNS = ["label", "voxels", "supervoxels", "chunks", "x0", "y0", "z0", "x1", "y1", "z1"]


def stats_export(folder):
    """A 200x170x150 export of 2 scales, 7 shard files at s0 (one shard box all background), with its info."""
    e = make_export(folder, shape=(200, 170, 150), seed=5, scales=2)
    with open(os.path.join(e.root, "info"), "w") as f:  # exact geometry, no GeometryWarning
        json.dump(e.spec, f)
    return e


def unique_pairs(a: np.ndarray, b: np.ndarray):
    """Distinct (a, b) pairs sorted, with their counts (np.unique(axis=0) is very slow)."""
    o = np.lexsort((b, a))
    a, b = a[o], b[o]
    starts = np.flatnonzero(np.r_[True, (a[1:] != a[:-1]) | (b[1:] != b[:-1])])
    return a[starts], b[starts], np.diff(np.r_[starts, len(a)])


_BRUTE: dict = {}  # brute_stats by the volumes' digests: tests ask for the same few exports' again and again


def brute_stats(body: np.ndarray, sv: np.ndarray, offset=(0, 0, 0), chunk=64) -> dict:
    """{label: (voxels, supervoxels, chunks, box)} of an (x, y, z) volume, label 0 left out."""
    key = (body.shape, body.dtype.str, sv.dtype.str, tuple(int(v) for v in offset), chunk,
           hashlib.blake2b(np.ascontiguousarray(body).data).digest(),
           hashlib.blake2b(np.ascontiguousarray(sv).data).digest())
    if key not in _BRUTE:
        _BRUTE[key] = _brute_stats(body, sv, offset, chunk)
    return dict(_BRUTE[key])


def _brute_stats(body: np.ndarray, sv: np.ndarray, offset, chunk) -> dict:
    flat = body.ravel()
    order = np.argsort(flat, kind="stable")
    lab = flat[order]
    starts = np.flatnonzero(np.r_[True, lab[1:] != lab[:-1]])
    xyz = np.stack(np.unravel_index(order, body.shape), axis=1) + np.asarray(offset)
    lo = np.minimum.reduceat(xyz, starts, axis=0)
    hi = np.maximum.reduceat(xyz, starts, axis=0) + 1
    voxels = np.diff(np.r_[starts, len(lab)])
    pb, _, _ = unique_pairs(flat, sv.ravel())
    nsv = dict(zip(*np.unique(pb, return_counts=True), strict=True))
    cid = xyz // chunk
    key = (cid[:, 0] * 100_003 + cid[:, 1]) * 100_003 + cid[:, 2]
    cb, _, _ = unique_pairs(lab, key.astype(np.uint64))
    nch = dict(zip(*np.unique(cb, return_counts=True), strict=True))
    out = {}
    for k, s in enumerate(starts):
        lb = int(lab[s])
        if lb:
            out[lb] = (int(voxels[k]), int(nsv[lb]), int(nch[lb]), tuple(lo[k].tolist() + hi[k].tolist()))
    return out


def brute_index(body, sv, chunk=64, offset=(0, 0, 0)) -> set:
    """{(body, sv, cx, cy, cz, voxels)} of (x, y, z) volumes whose first voxel is at ``offset``."""
    rows = set()
    off = np.asarray(offset)
    lo_c = off // chunk
    hi_c = -(-(off + np.asarray(body.shape)) // chunk)
    for cx in range(lo_c[0], hi_c[0]):
        for cy in range(lo_c[1], hi_c[1]):
            for cz in range(lo_c[2], hi_c[2]):
                a = np.maximum(np.array([cx, cy, cz]) * chunk - off, 0)
                b = np.array([cx + 1, cy + 1, cz + 1]) * chunk - off
                sl = np.s_[a[0]:b[0], a[1]:b[1], a[2]:b[2]]
                pb, ps, n = unique_pairs(body[sl].ravel(), sv[sl].ravel())
                rows |= {(int(b_), int(s), cx, cy, cz, int(c)) for b_, s, c in zip(pb, ps, n, strict=True) if b_}
    return rows


def as_dict(t) -> dict:
    """{label: (voxels, supervoxels, chunks, box)} of a statistics table."""
    d = t.to_pydict()
    return {d["label"][i]: (d["voxels"][i], d["supervoxels"][i], d["chunks"][i],
                            tuple(d[c][i] for c in ("x0", "y0", "z0", "x1", "y1", "z1")))
            for i in range(t.num_rows)}


def read_folder(out) -> pa.Table:
    """A dataset folder as one table (the manifest _dvidshards.json is not a Parquet file)."""
    return pds.dataset(out, format="parquet", partitioning="hive", ignore_prefixes=[".", "_", "dvidshards."]).to_table()


def read_index(out) -> set:
    """The rows of a label-index folder, as a set."""
    d = read_folder(out).to_pydict()
    return set(zip(d["body"], d["supervoxel"], d["chunk_x"], d["chunk_y"], d["chunk_z"], d["voxels"], strict=False))


def read_dataset(out) -> dict:
    """{label: row} of a statistics dataset folder, checking that each file holds its bucket only,
    voxels descending."""
    meta = json.loads((out / "_meta.json").read_text())
    rows = {}
    for b in range(1 << meta["bits"]):
        t = pq.read_table(out / f"bucket={b:0{max(1, (meta['bits'] + 3) // 4)}x}" / "part-0.parquet")
        assert t.schema.remove_metadata().names == STATS_COLUMNS
        assert (bucket_of(t["label"].to_numpy(), meta["bits"]) == b).all()
        assert (np.diff(t["voxels"].to_numpy()) <= 0).all()
        rows.update(as_dict(t))
    return rows


def damaged_copy(exp, folder):
    """A copy of the export with one record of one s0 shard damaged: (root, shard path, origin, good bytes)."""
    root = folder / "exp"
    shutil.copytree(exp.root, root)
    ds = dvidshards.Dataset(root)
    o = ds.shards(0)[3]
    t = ds.shard(0, o).table()
    path = os.path.join(root, "s0", f"{o[0]}_{o[1]}_{o[2]}.arrow")
    with open(path, "rb") as f:
        data = bytearray(f.read())
    pay = bytes(t.payload(len(t) - 1))
    at = data.find(pay)
    assert at > 0 and len(pay) > 20
    with open(os.path.join(exp.root, "s0", os.path.basename(path)), "rb") as f:
        good = f.read()
    data[at + len(pay) // 2] ^= 0xFF
    with open(path, "wb") as f:
        f.write(bytes(data))
    return root, path, o, good


def tree(folder) -> dict:
    """{relative path: (size, mtime_ns)} of every file under a folder (to show nothing changed)."""
    folder = str(folder)
    out = {}
    for d, _, files in os.walk(folder):
        for f in files:
            st = os.stat(os.path.join(d, f))
            out[os.path.relpath(os.path.join(d, f), folder)] = (st.st_size, st.st_mtime_ns)
    return out
