"""Supervoxel → body mappings applied at read time, as a palette swap per block.

`LabelMapping` holds two sorted uint64 arrays, built from a dict, an (n, 2) array, a pandas
Series or a file in DVID's ``/mappings`` formats (`formats.mappingfile`); a bad id is a
`MappingError` naming where it was (file and line, index, key, row) and its value. This module
does no I/O: paths go through the installed `MappingFiles`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import numba as nb
import numpy as np
from numba.core import types as nbt

from ..errors import MappingError
from . import jit
from .mappingfile import background_message, background_row, check_format, parse_pairs

__all__ = ["LabelMapping", "MappingFiles", "as_path", "check_format", "check_stamp", "file_stamp", "install_files",
           "installed_files", "PathLike", "is_path", "load_file", "parse_mapping", "prepare_file"]

_U64_MAX = (1 << 64) - 1
_FLOAT_EXACT = float(1 << 53)  # floats at or above hold integers inexactly
_RADIX_BITS = 11
_RADIX = 1 << _RADIX_BITS


@nb.njit(nogil=True, cache=True)
def _apply(sv, keys, values, out):  # type: ignore[no-untyped-def]
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


def _apply_numpy(sv: Any, keys: Any, values: Any, out: np.ndarray) -> None:
    n = keys.shape[0]
    if n == 0:
        out[:] = sv
        return
    i = np.minimum(np.searchsorted(keys, sv), n - 1)
    out[:] = np.where(keys[i] == sv, values[i], sv)


_U64 = nbt.Array(nbt.uint64, 1, "A", readonly=True)
_apply_k = jit.kernel(_apply, [(_U64, _U64, _U64, nbt.Array(nbt.uint64, 1, "A"))], _apply_numpy, exclusive=True)


@nb.njit(nogil=True, cache=True)
def _radix_sort_pairs(k, v, k2, v2):  # type: ignore[no-untyped-def]
    """Stable LSD radix sort of (k, v) by k on 11-bit digits, skipping a digit every key shares,
    (k2, v2) as scratch (k, v overwritten); True when the result is in k2, v2."""
    n = k.shape[0]
    nd = (64 + _RADIX_BITS - 1) // _RADIX_BITS
    mask = np.uint64(_RADIX - 1)
    counts = np.zeros((nd, _RADIX), np.int64)
    for i in range(n):
        x = k[i]
        for d in range(nd):
            counts[d, np.intp((x >> np.uint64(_RADIX_BITS * d)) & mask)] += 1
    src_k, src_v, dst_k, dst_v = k, v, k2, v2
    flips = 0
    pos = np.empty(_RADIX, np.int64)
    for d in range(nd):
        one_bucket = False
        total = 0
        for b in range(_RADIX):
            c = counts[d, b]
            one_bucket |= c == n
            pos[b] = total
            total += c
        if one_bucket:
            continue
        shift = np.uint64(_RADIX_BITS * d)
        for i in range(n):
            x = src_k[i]
            b = np.intp((x >> shift) & mask)
            p = pos[b]
            dst_k[p] = x
            dst_v[p] = src_v[i]
            pos[b] = p + 1
        src_k, src_v, dst_k, dst_v = dst_k, dst_v, src_k, src_v
        flips += 1
    return flips % 2 == 1


def _reason(v: Any) -> str | None:
    """Why one value is not a uint64 id (None when it is one)."""
    if isinstance(v, (bool, np.bool_)):
        return "a boolean, not an integer id"
    if isinstance(v, (int, np.integer)):
        v = int(v)
        if v < 0:
            return "negative"
        return None if v <= _U64_MAX else "larger than 2**64 - 1"
    if isinstance(v, (float, np.floating)):
        f = float(v)
        if math.isnan(f):
            return "NaN (a missing value)"
        if math.isinf(f) or f != math.floor(f):
            return "not an integer"
        if f < 0:
            return "negative"
        return None if f < _FLOAT_EXACT else "a float too large to hold an id exactly (use integers)"
    if isinstance(v, (str, bytes)):
        return f"text ({type(v).__name__}), not an integer id"
    if v is None or type(v).__name__ in ("NAType", "NaTType"):
        return "NaN (a missing value)"
    return f"a {type(v).__name__}, not an integer id"


def _show(v: Any) -> str:
    return repr(v.item() if isinstance(v, np.generic) else v)


def _fail(source: str, where: str, value: Any, reason: str) -> None:
    raise MappingError(f"{source}: {where} is {_show(value)}, which is {reason}; "
                       "supervoxel and body ids must be non-negative integers") from None


def _ids(a: Any, source: str, where: Callable[[int], str]) -> np.ndarray:
    """``a`` as uint64 ids; MappingError naming ``where(i)`` and the first bad value."""
    a = np.asarray(a)
    if a.ndim != 1:
        a = a.reshape(-1)
    kind = a.dtype.kind
    if kind == "u":
        return np.asarray(a.astype(np.uint64, copy=False))
    if kind == "i":
        bad = np.flatnonzero(a < 0)
    elif kind == "f":
        with np.errstate(invalid="ignore"):
            ok = (a >= 0) & (a < _FLOAT_EXACT) & (np.floor(a) == a)  # False for NaN
        bad = np.flatnonzero(~ok)
    elif kind == "O":
        bad = np.flatnonzero(np.fromiter((_reason(v) is not None for v in a), bool, a.size))
    else:
        bad = np.arange(min(a.size, 1))
    if bad.size:
        i = int(bad[0])
        v = a[i]
        _fail(source, where(i), v, _reason(v) or f"of dtype {a.dtype}, not an integer id")
    if kind == "O":
        return np.fromiter((int(v) for v in a), np.uint64, a.size)
    return np.asarray(a.astype(np.uint64))


def _check_background(sv: np.ndarray, body: np.ndarray, source: str, where: Callable[[int], str]) -> None:
    """MappingError naming ``where(i)`` when row i maps supervoxel 0 (background) to a body."""
    i = background_row(sv, body)
    if i >= 0:
        raise MappingError(background_message(f"{source}: {where(i)}", int(body[i])))


class LabelMapping:
    """A supervoxel → body mapping; supervoxels absent from it keep their id.

    Parameters
    ----------
    supervoxels, bodies : array_like
        Equal-length non-negative integer ids; a supervoxel listed twice has one body.

    Attributes
    ----------
    keys, values : numpy.ndarray
        Sorted unique supervoxels and their bodies (uint64).

    Raises
    ------
    MappingError
        A bad id (named by position and value), unequal lengths, a supervoxel mapped to two
        bodies, or supervoxel 0 mapped to a body.

    Notes
    -----
    Pickles by value (16 bytes per supervoxel): give jobs a mapping file instead (`load_file`:
    loaded once per worker).
    """

    __slots__ = ("keys", "values")

    def __init__(self, supervoxels: Any, bodies: Any) -> None:
        sv = _ids(supervoxels, "mapping", lambda i: f"supervoxel #{i}")
        body = _ids(bodies, "mapping", lambda i: f"body #{i}")
        if sv.shape != body.shape:
            raise MappingError(f"mapping has {sv.size} supervoxels but {body.size} bodies")
        _check_background(sv, body, "mapping", lambda i: f"row #{i}")
        # own copies: never sort the caller's arrays in place
        self._set(np.array(sv, np.uint64, order="C"), np.array(body, np.uint64, order="C"))

    @classmethod
    def _owned(cls, sv: np.ndarray, body: np.ndarray) -> LabelMapping:
        """A mapping over fresh contiguous uint64 arrays it may sort in place."""
        self = cls.__new__(cls)
        self._set(sv, body)
        return self

    def _set(self, sv: np.ndarray, body: np.ndarray) -> None:
        if sv.size > 1 and not (sv[1:] >= sv[:-1]).all():
            k2, v2 = np.empty_like(sv), np.empty_like(body)
            if _radix_sort_pairs(sv, body, k2, v2):
                sv, body = k2, v2
            del k2, v2
        dup = np.flatnonzero(sv[1:] == sv[:-1])
        if dup.size:
            conflict = dup[body[dup] != body[dup + 1]]
            if conflict.size:
                i = conflict[0]
                raise MappingError(f"supervoxel {sv[i]} is mapped to both {body[i]} and {body[i + 1]}")
            keep = np.ones(sv.size, bool)
            keep[dup + 1] = False
            sv, body = sv[keep], body[keep]
        self.keys, self.values = sv, body

    def __len__(self) -> int:
        return self.keys.size

    def __repr__(self) -> str:
        return f"LabelMapping({len(self)} supervoxels)"

    def __getstate__(self) -> Any:
        return (self.keys, self.values)

    def __setstate__(self, state: Any) -> None:
        self.keys, self.values = state

    def palette(self, supervoxels: np.ndarray) -> np.ndarray:
        """The bodies of a block's supervoxel list (uint64, same order and length)."""
        out = np.empty(supervoxels.shape[0], np.uint64)
        _apply_k(supervoxels, self.keys, self.values, out)
        return out

    def __call__(self, supervoxels: Any) -> np.ndarray:
        """Map any array of supervoxel ids."""
        a = np.ascontiguousarray(supervoxels, dtype=np.uint64)
        return self.palette(a.ravel()).reshape(a.shape)

    @classmethod
    def from_any(cls, obj: Any) -> LabelMapping:
        """A mapping from a dict ``{supervoxel: body}``, a pandas Series (index supervoxels), an (n, 2)
        array of rows, a LabelMapping or a file path (`load_file`). MappingError for anything else
        and for every bad id, named by its key, index, row or file line."""
        if isinstance(obj, LabelMapping):
            return obj
        if is_path(obj):
            return load_file(obj)
        if isinstance(obj, dict):
            keys = np.fromiter(obj.keys(), object, len(obj))
            vals = np.fromiter(obj.values(), object, len(obj))
            sv = _ids(keys, "mapping dict", lambda i: "a key")
            body = _ids(vals, "mapping dict", lambda i: f"the value of key {_show(keys[i])}")
            _check_background(sv, body, "mapping dict", lambda i: "key 0")
            return cls(sv, body)
        if hasattr(obj, "index") and hasattr(obj, "to_numpy") and getattr(obj, "ndim", 0) == 1:
            index = np.asarray(obj.index.to_numpy() if hasattr(obj.index, "to_numpy") else obj.index)
            sv = _ids(index, "mapping Series", lambda i: f"the index at position {i}")
            body = _ids(obj.to_numpy(), "mapping Series", lambda i: f"the value at index {_show(index[i])}")
            _check_background(sv, body, "mapping Series", lambda i: f"the index at position {i}")
            return cls(sv, body)
        try:
            a = np.asarray(obj)
        except (TypeError, ValueError) as e:
            raise MappingError(f"cannot use {type(obj).__name__} as a label mapping ({e})") from None
        if a.ndim != 2 or a.shape[1] != 2:
            raise MappingError(f"a label mapping must be a dict, a pandas Series, a file or an "
                               f"(n, 2) array of (supervoxel, body) rows; got a {type(obj).__name__} "
                               f"of shape {a.shape}")
        sv = _ids(a[:, 0], "mapping array", lambda i: f"row {i} column 0 (supervoxel)")
        body = _ids(a[:, 1], "mapping array", lambda i: f"row {i} column 1 (body)")
        _check_background(sv, body, "mapping array", lambda i: f"row {i}")
        return cls(sv, body)

    @classmethod
    def from_file(cls, path: PathLike, format: str = "auto") -> LabelMapping:
        """Read a mapping file in DVID's ``/mappings`` formats, at every call (`load_file` reads a file
        version once per process, a large one once per host).

        Parameters
        ----------
        path : str or os.PathLike
        format : {"auto", "text", "binary"}, optional
            ``"text"``: lines ``supervoxel body`` (comma, spaces or a tab between; an optional header
            line; ``#`` comments and blank lines skipped; decimal or ``0x`` hexadecimal ids).
            ``"binary"``: little-endian uint64 pairs. ``"auto"``: text unless the first 64 KiB hold
            NUL or other control bytes. gzip, zstd, bzip2 and xz content (told by its first bytes) is
            decompressed first.

        Raises
        ------
        MappingError
            The file cannot be read, is empty, damaged or compressed otherwise; a text line is
            malformed or holds a bad id (file, line and value named); a binary file is not whole
            16-byte pairs; supervoxel 0 is mapped to a body.
        """
        return installed_files().read(as_path(path), format)

    @classmethod
    def from_bytes(cls, data: Any, name: str = "mapping bytes", format: str = "auto") -> LabelMapping:
        """A mapping from a mapping file's bytes (or a seekable binary file object), as `from_file`
        reads them; ``name`` is what errors call it."""
        return parse_mapping(data, name, format)

    @classmethod
    def from_sorted(cls, keys: np.ndarray, values: np.ndarray) -> LabelMapping:
        """A mapping over arrays already sorted, unique and checked (a sidecar's)."""
        self = cls.__new__(cls)
        self.keys, self.values = keys, values
        return self


def parse_mapping(src: Any, name: str, format: str = "auto") -> LabelMapping:
    """A checked mapping from a mapping file's content (bytes-like or a seekable binary file read
    from its start); ``name`` names it in errors."""
    sv, body = parse_pairs(src, name, format)
    return LabelMapping._owned(sv, body)


def is_path(obj: Any) -> bool:
    """Whether ``obj`` names a file (a str or an ``os.PathLike``)."""
    return isinstance(obj, str) or hasattr(obj, "__fspath__")


def as_path(path: PathLike) -> str:
    p = path.__fspath__() if hasattr(path, "__fspath__") else path
    if not isinstance(p, str):
        raise MappingError(f"{p!r}: give a mapping file's path as text")
    return p


class _Fspath(Protocol):
    def __fspath__(self) -> str: ...


PathLike = str | _Fspath  # a path as text, or an os.PathLike of text (pathlib.Path)


class MappingFiles(Protocol):
    """How mapping files given as paths are reached (`install_files`): ``dvidshards.runtime.mappings``
    installs the package's on ``import dvidshards``."""

    def absolute(self, path: str) -> str: ...  # the absolute path (what a task elsewhere opens)

    def exists(self, path: str) -> bool: ...  # a file (or folder) is there

    def stamp(self, path: str) -> tuple[int, int]: ...  # (size, mtime_ns); MappingError if not a file

    def read(self, path: str, format: str = "auto") -> LabelMapping: ...  # parsed now (from_file)

    def load(self, path: str, stamp: tuple[int, int] | None, format: str) -> LabelMapping: ...  # (load_file)

    def prepare(self, path: str, stamp: tuple[int, int] | None, format: str) -> None: ...  # (prepare_file)


def check_stamp(path: str, planned: tuple[int, int] | None, now: tuple[int, int]) -> None:
    """MappingError when the file's stamp ``now`` is not the one a job ``planned`` with."""
    if planned is not None and tuple(planned) != tuple(now):
        raise MappingError(f"{path}: the mapping file changed after the job was planned (size {planned[0]} -> "
                           f"{now[0]} bytes, modified {planned[1]} -> {now[1]} ns); run the job again to use it")


_files: MappingFiles | None = None


def install_files(files: MappingFiles) -> MappingFiles | None:
    """Make ``files`` reach every mapping file of this process; returns the one it replaces."""
    global _files
    old, _files = _files, files
    return old


def installed_files() -> MappingFiles:
    if _files is None:
        raise MappingError("mapping files are read by dvidshards.runtime.mappings: import dvidshards first")
    return _files


def file_stamp(path: PathLike) -> tuple[int, int]:
    """``(size, mtime_ns)`` of a mapping file, what says it changed; MappingError when it cannot be read."""
    return installed_files().stamp(as_path(path))


def load_file(path: PathLike, stamp: tuple[int, int] | None = None, format: str = "auto") -> LabelMapping:
    """A mapping file loaded at most once per process and version (shared; its arrays may be
    read-only memory maps). ``stamp``: the version planned with (`file_stamp`), a file changed
    since fails; ``format`` as `LabelMapping.from_file`, whose MappingErrors it raises."""
    files = installed_files()
    return files.load(files.absolute(as_path(path)), stamp, format)


def prepare_file(path: PathLike, stamp: tuple[int, int] | None = None, format: str = "auto") -> None:
    """Check a mapping file for a job's client before any task (MappingError as `load_file`); a
    large one is parsed in a child process into the sidecar the workers memory-map."""
    files = installed_files()
    files.prepare(files.absolute(as_path(path)), stamp, format)
