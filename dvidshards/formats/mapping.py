"""Supervoxel → body mappings applied at read time, as a palette swap per block."""

from __future__ import annotations

import os

import numba as nb
import numpy as np

from ..errors import MappingError

__all__ = ["LabelMapping"]


@nb.njit(nogil=True, cache=True)
def _apply(sv, keys, values, out):
    n = keys.shape[0]
    for i in range(sv.shape[0]):
        s = sv[i]
        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi) >> 1
            if keys[mid] < s:
                lo = mid + 1
            else:
                hi = mid
        out[i] = values[lo] if lo < n and keys[lo] == s else s


class LabelMapping:
    """A supervoxel → body mapping; supervoxels absent from it keep their id.

    Build it with ``LabelMapping.from_any`` from a dict, an (n, 2) array, a pandas Series
    (index supervoxels, values bodies) or a file in DVID's ``/mappings`` formats.
    """

    __slots__ = ("keys", "values")

    def __init__(self, supervoxels, bodies):
        sv = np.ascontiguousarray(supervoxels, dtype=np.uint64).ravel()
        body = np.ascontiguousarray(bodies, dtype=np.uint64).ravel()
        if sv.shape != body.shape:
            raise MappingError(f"mapping has {sv.size} supervoxels but {body.size} bodies")
        order = np.argsort(sv, kind="stable")
        sv, body = sv[order], body[order]
        dup = np.flatnonzero(sv[1:] == sv[:-1])
        conflict = dup[body[dup] != body[dup + 1]]
        if conflict.size:
            i = conflict[0]
            raise MappingError(f"supervoxel {sv[i]} is mapped to both {body[i]} and {body[i + 1]}")
        if dup.size:
            keep = np.ones(sv.size, bool)
            keep[dup + 1] = False
            sv, body = sv[keep], body[keep]
        self.keys, self.values = sv, body

    def __len__(self) -> int:
        return self.keys.size

    def __repr__(self) -> str:
        return f"LabelMapping({len(self)} supervoxels)"

    def __getstate__(self):
        return (self.keys, self.values)

    def __setstate__(self, state):
        self.keys, self.values = state

    def palette(self, supervoxels: np.ndarray) -> np.ndarray:
        """The bodies of a block's supervoxel list (same order and length)."""
        out = np.empty(supervoxels.shape[0], np.uint64)
        _apply(supervoxels, self.keys, self.values, out)
        return out

    def __call__(self, supervoxels) -> np.ndarray:
        """Map any array of supervoxel ids (for users; the reader uses ``palette``)."""
        a = np.ascontiguousarray(supervoxels, dtype=np.uint64)
        return self.palette(a.ravel()).reshape(a.shape)

    @classmethod
    def from_any(cls, obj) -> LabelMapping:
        """Build a mapping from a dict, (n, 2) array, pandas Series, LabelMapping or file path."""
        if isinstance(obj, LabelMapping):
            return obj
        if isinstance(obj, (str, os.PathLike)):
            return cls.from_file(obj)
        if isinstance(obj, dict):
            return cls(np.fromiter(obj.keys(), np.uint64, len(obj)), np.fromiter(obj.values(), np.uint64, len(obj)))
        if hasattr(obj, "index") and hasattr(obj, "to_numpy") and getattr(obj, "ndim", 0) == 1:
            return cls(np.asarray(obj.index, dtype=np.uint64), obj.to_numpy(dtype=np.uint64))
        try:
            a = np.asarray(obj)
        except (TypeError, ValueError) as e:
            raise MappingError(f"cannot use {type(obj).__name__} as a label mapping ({e})") from None
        if a.ndim != 2 or a.shape[1] != 2 or not np.issubdtype(a.dtype, np.integer):
            raise MappingError(f"a mapping array must be (n, 2) integers, got shape {a.shape} {a.dtype}")
        if np.issubdtype(a.dtype, np.signedinteger) and a.size and a.min() < 0:
            raise MappingError("a mapping array holds negative ids")
        return cls(a[:, 0], a[:, 1])

    @classmethod
    def from_file(cls, path) -> LabelMapping:
        """Read DVID's ``/mappings`` formats: text lines ``sv body``, or binary LE uint64 pairs."""
        path = os.fspath(path)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise MappingError(f"{path}: cannot read mapping ({e.strerror or e})") from None
        head = data[:4096]
        if head and all(c in b"0123456789 \t\r\n,#" or 97 <= c <= 122 or 65 <= c <= 90 for c in head):
            return cls._from_text(data, path)
        if len(data) % 16:
            raise MappingError(f"{path}: binary mapping is {len(data)} bytes, not a whole number of uint64 pairs")
        pairs = np.frombuffer(data, dtype="<u8").reshape(-1, 2)
        return cls(pairs[:, 0], pairs[:, 1])

    @classmethod
    def _from_text(cls, data: bytes, path: str) -> LabelMapping:
        rows = []
        for n, line in enumerate(data.decode("ascii").splitlines(), 1):
            line = line.split("#", 1)[0].replace(",", " ").split()
            if not line:
                continue
            if len(line) != 2 or not (line[0].isdigit() and line[1].isdigit()):
                if n == 1 and not any(t.isdigit() for t in line):
                    continue  # a header line
                raise MappingError(f"{path}: line {n} is not 'supervoxel body': {' '.join(line)[:60]!r}")
            rows.append((int(line[0]), int(line[1])))
        a = np.array(rows, dtype=np.uint64).reshape(-1, 2)
        return cls(a[:, 0], a[:, 1])
