"""The meshes job's partial results: cell pieces in fragment files of its work folder.

A fragment file (:class:`FragmentWriter`, one per source shard) holds each piece (a body's mesh in
a cell, with its counts) as a 64-byte header, its vertices and faces, sorted by the body's bucket
(the mesh shard it lands in) and body, the buckets' index in a footer. A reduce task reads a
bucket's pieces across files body by body (:func:`by_body`, a k-way merge: one body in memory);
many files merge in groups first (:func:`merge_task`).
"""

from __future__ import annotations

import array
import heapq
import itertools
import os
import struct
import tempfile
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np

from ..errors import SpecError
from ..formats.mesh import Mesh
from ..stores import ByteStore
from ..stores.base import TMP

__all__ = ["Fragment", "FragmentWriter", "MergeTask", "buckets_of", "by_body", "merge_task", "parse"]

_MAGIC = b"DVSMESH2"
_HEAD = np.dtype([("body", "<u8"), ("x", "<i4"), ("y", "<i4"), ("z", "<i4"), ("scale", "<u4"),
                  ("nv", "<u4"), ("nf", "<u4"), ("mc", "<u4"), ("pad", "<u4"), ("voxels", "<u8"),
                  ("volume", "<f8"), ("area", "<f8")])  # one piece's header (64 bytes)
_INDEX = np.dtype([("bucket", "<u8"), ("off", "<u8"), ("len", "<u8")])


@dataclass(frozen=True)
class Fragment:
    """One cell's piece of one body, as a map task wrote it."""

    body: int
    cell: tuple[int, int, int]
    scale: int
    mesh: Mesh
    mc_faces: int  # faces marching cubes made (before the per-cell pass)
    voxels: int  # the body's voxels in the cell's own chunk
    volume: float  # signed volume contribution (about the origin) of the marching-cubes surface
    area: float  # area of the marching-cubes surface


def parse(raw: bytes) -> Fragment:
    h = np.frombuffer(raw, _HEAD, 1, 0)[0]
    nv, nf = int(h["nv"]), int(h["nf"])
    v = np.frombuffer(raw, "<f4", 3 * nv, _HEAD.itemsize).reshape(nv, 3)
    f = np.frombuffer(raw, "<u4", 3 * nf, _HEAD.itemsize + 12 * nv).reshape(nf, 3)
    return Fragment(int(h["body"]), (int(h["x"]), int(h["y"]), int(h["z"])), int(h["scale"]), Mesh(v, f),
                    int(h["mc"]), int(h["voxels"]), float(h["volume"]), float(h["area"]))


class FragmentWriter:
    """The fragment file ``key``, published when the block ends without an error. Pieces go to a
    scratch file as they come (hidden beside a local file, else a temporary one), 24 bytes a piece
    in memory; at the end they are copied into ``key`` sorted by ``bucket(bodies)`` and body."""

    def __init__(self, work: ByteStore, key: str, bucket: Callable[[np.ndarray], np.ndarray]):
        self.work, self.key, self.bucket = work, key, bucket
        self.rows = array.array("Q")  # body, offset, length of each piece
        self.count = 0
        local = work.local_path(key)
        if local is not None:
            os.makedirs(os.path.dirname(local), exist_ok=True)
            self.scratch = os.path.join(os.path.dirname(local), f".{os.path.basename(local)}{TMP}{uuid.uuid4().hex[:12]}")
        else:
            fd, self.scratch = tempfile.mkstemp(prefix="dvidshards-meshes-")
            os.close(fd)
        self.file: BinaryIO = open(self.scratch, "wb")  # closed by __exit__
        self.pos = 0

    def __enter__(self) -> FragmentWriter:
        return self

    def add(self, body: int, cell: Sequence[int], scale: int, m: Mesh, mc_faces: int = 0, voxels: int = 0,
            volume: float = 0.0, area: float = 0.0) -> None:
        h = np.zeros(1, _HEAD)
        h["body"], h["x"], h["y"], h["z"] = body, cell[0], cell[1], cell[2]
        h["scale"], h["nv"], h["nf"] = scale, len(m.vertices), len(m.faces)
        h["mc"], h["voxels"], h["volume"], h["area"] = mc_faces, voxels, volume, area
        blob = h.tobytes() + m.vertices.astype("<f4").tobytes() + m.faces.astype("<u4").tobytes()
        self.file.write(blob)
        self.rows.extend((body, self.pos, len(blob)))
        self.pos += len(blob)

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        try:
            self.file.close()
            if kind is None:
                self._sort()
        finally:
            if os.path.exists(self.scratch):
                os.remove(self.scratch)

    def _sort(self) -> None:
        table = np.zeros(len(self.rows) // 3, [("bucket", "<u8"), ("body", "<u8"), ("off", "<u8"), ("len", "<u8")])
        if self.rows:
            arr = np.frombuffer(self.rows, np.uint64).reshape(-1, 3)
            table["body"], table["off"], table["len"] = arr[:, 0], arr[:, 1], arr[:, 2]
            table["bucket"] = self.bucket(table["body"])
        self.count = len(table)
        table = table[np.lexsort((table["body"], table["bucket"]))]
        with self.work.writer(self.key) as out:
            index = []
            if len(table):
                with open(self.scratch, "rb") as src:  # plain reads: nothing of the file stays mapped
                    pos = 0
                    cur, start = None, 0
                    for bk, off, n in zip(table["bucket"].tolist(), table["off"].tolist(), table["len"].tolist(),
                                          strict=True):
                        if bk != cur:
                            if cur is not None:
                                index.append((cur, start, pos - start))
                            cur, start = bk, pos
                        src.seek(off)
                        out.write(src.read(n))
                        pos += n
                    index.append((cur, start, pos - start))
            _write_footer(out, index)


def _write_footer(out: BinaryIO, index: list) -> None:
    idx = np.array(index, _INDEX) if index else np.zeros(0, _INDEX)
    out.write(idx.tobytes())
    out.write(struct.pack("<Q", len(idx)) + _MAGIC)


def _read_index(f: BinaryIO, where: str) -> np.ndarray:
    f.seek(0, os.SEEK_END)
    size = f.tell()
    if size < 16:
        raise SpecError(f"{where}: not a fragment file (too short)")
    f.seek(size - 16)
    tail = f.read(16)
    if tail[8:] != _MAGIC:
        raise SpecError(f"{where}: not a fragment file (no footer)")
    n = struct.unpack("<Q", tail[:8])[0]
    if 16 + n * _INDEX.itemsize > size:
        raise SpecError(f"{where}: fragment file footer is damaged")
    f.seek(size - 16 - n * _INDEX.itemsize)
    return np.frombuffer(f.read(n * _INDEX.itemsize), _INDEX)


def buckets_of(work: ByteStore, key: str) -> np.ndarray:
    """The buckets a fragment file holds pieces of."""
    with work.open(key) as f:
        return _read_index(f, work.describe(key))["bucket"].copy()


def _scan(work: ByteStore, key: str, bucket: int) -> Iterator[tuple[int, bytes]]:
    """(body, raw entry) of a bucket's pieces in a file, in its order (by body), one at a time."""
    where = work.describe(key)
    with work.open(key) as f:
        idx = _read_index(f, where)
        k = int(np.searchsorted(idx["bucket"], np.uint64(bucket)))
        if k == len(idx) or int(idx["bucket"][k]) != bucket:
            return
        off, n = int(idx["off"][k]), int(idx["len"][k])
        f.seek(off)
        pos = 0
        while pos < n:
            head = f.read(_HEAD.itemsize)
            if len(head) < _HEAD.itemsize or pos + _HEAD.itemsize > n:
                raise SpecError(f"{where}: fragment data truncated")
            h = np.frombuffer(head, _HEAD, 1)[0]
            size = 12 * (int(h["nv"]) + int(h["nf"]))
            rest = f.read(size)
            if len(rest) < size or pos + _HEAD.itemsize + size > n:
                raise SpecError(f"{where}: fragment data truncated")
            yield int(h["body"]), head + rest
            pos += _HEAD.itemsize + size


def by_body(work: ByteStore, keys: Sequence[str], bucket: int) -> Iterator[tuple[int, list[bytes]]]:
    """``(body, [raw entries])`` of one bucket across files, body by body (a k-way merge)."""
    merged = heapq.merge(*(_scan(work, k, bucket) for k in keys), key=lambda e: e[0])
    for body, group in itertools.groupby(merged, key=lambda e: e[0]):
        yield body, [raw for _, raw in group]


@dataclass(frozen=True)
class MergeTask:
    """A group of fragment files of a work folder merged into ``key`` (``L{level}/{k}.frag``)."""

    work: ByteStore = field(compare=False, repr=False)
    level: int
    k: int
    keys: tuple[str, ...]

    @property
    def key(self) -> str:
        return f"L{self.level}/{self.k:06d}.frag"

    def __str__(self) -> str:
        return f"regroup {self.level}.{self.k}"


def merge_task(task: MergeTask) -> int:
    """A group of fragment files merged into one, bucket by bucket, body by body."""
    work = task.work
    buckets: Any = np.unique(np.concatenate([buckets_of(work, k) for k in task.keys])) if task.keys else []
    index = []
    pos = 0
    with work.writer(task.key) as out:
        for b in [int(v) for v in buckets]:
            start = pos
            for _, raws in by_body(work, task.keys, b):  # stays sorted by body
                for raw in raws:
                    out.write(raw)
                    pos += len(raw)
            index.append((b, start, pos - start))
        _write_footer(out, index)
    return len(task.keys)
