"""Supervoxel → body mappings applied at read time, as a palette swap per block.

`LabelMapping` holds the mapping as two sorted uint64 arrays. It is built from a dict, an
(n, 2) array, a pandas Series or a file in DVID's ``/mappings`` formats, and every id is
checked on the way in: a negative, fractional, NaN or non-numeric id is a `MappingError`
that names where it was (file and line, Series index, dict key, array row) and the value.

Files
-----
Text or binary is decided by the content, never by the length:

* text: one ``supervoxel body`` pair per line, separated by a comma, spaces or a tab; an
  optional header line of names (``sv_id,body_id``), ``#`` comments and blank lines are
  allowed. Parsed by ``pyarrow.csv`` (multithreaded); a file that is not plain
  ``id<sep>id`` lines is first normalised by a compiled pass (comments dropped, runs of
  blanks collapsed) that keeps every line where it was, so errors name the right line.
* binary: little-endian uint64 pairs (DVID's ``/mappings?format=binary``). Used when asked
  for (``format="binary"``) or when the bytes cannot be text (NUL and other control bytes,
  which every binary mapping with ids below 2**56 holds).

Supervoxel 0 is background: a mapping may send it to 0 (or leave it out), never to a body.

A file compressed with gzip or zstd (also bzip2 and xz) is told by its first bytes, whatever its
name, and decompressed first; lz4, zip and 7z are refused by name. An empty file (0 bytes: an
interrupted download) is a `MappingError`, not an empty mapping.

Files by path
-------------
This module parses content (bytes, or a file object it is handed) and does no I/O of its own
beyond the plain read of a file it is given by path: no child process, no lock, no cache on
disk. Paths go through the installed `MappingFiles` (`file_stamp`, `LabelMapping.from_file`,
`load_file`, `prepare_file`): ``dvidshards.runtime.mappings`` installs the package's, which loads
a file once per process and a large one once per host (a memory-mapped sidecar).
"""

from __future__ import annotations

import codecs
import contextlib
import io
import math
import os
import re

import numba as nb
import numpy as np
from numba.core import types as nbt

from ..errors import MappingError
from . import jit

__all__ = ["LabelMapping", "MappingFiles", "check_format", "check_stamp", "file_stamp", "install_files",
           "installed_files", "load_file", "parse_mapping", "prepare_file"]

_U64_MAX = (1 << 64) - 1
_FLOAT_EXACT = float(1 << 53)  # floats at or above hold integers inexactly
_SNIFF = 1 << 16  # bytes looked at to tell text from binary and find a header
_BOM = b"\xef\xbb\xbf"
# bytes no text mapping holds: C0 controls except tab, LF, CR; and DEL
_NOT_TEXT = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_CONTENT = re.compile(rb"[^\n]")  # in normalised text every non-empty line has content
_NEWLINE = re.compile(rb"\n")
_INT = re.compile(r"[0-9]+")
_SIGNED = re.compile(r"[+-][0-9]+")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")  # a header's column name
_NOT_NAMES = {"nan", "na", "null", "none", "inf", "infinity"}
_NAN = {"nan", "+nan", "-nan", "na", "n/a", "null", "none", "<na>"}
_RADIX_BITS = 11
_RADIX = 1 << _RADIX_BITS
_LIMIT = np.frombuffer(b"18446744073709551615", np.uint8)  # 2**64 - 1


# --------------------------------------------------------------------------- kernels


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


def _apply_numpy(sv, keys, values, out):
    """``_apply`` in numpy, used until it is compiled (formats.jit)."""
    n = keys.shape[0]
    if n == 0:
        out[:] = sv
        return
    i = np.minimum(np.searchsorted(keys, sv), n - 1)
    out[:] = np.where(keys[i] == sv, values[i], sv)


_U64 = nbt.Array(nbt.uint64, 1, "A", readonly=True)
_apply_k = jit.kernel(_apply, [(_U64, _U64, _U64, nbt.Array(nbt.uint64, 1, "A"))], _apply_numpy, exclusive=True)


@nb.njit(nogil=True, cache=True)
def _radix_sort_pairs(k, v, k2, v2):
    """Sort (k, v) by k, stably, with (k2, v2) as scratch; True when the result is in k2, v2.

    LSD radix sort on 11-bit digits; a digit every key shares is skipped. k, v are overwritten.
    """
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


@nb.njit(nogil=True, cache=True)
def _normalise(src, dst):
    """Copy text ``src`` to ``dst`` with ``#`` comments dropped and blanks (space, tab, CR)
    collapsed to one space between fields and none at line ends; newlines are kept, so every
    line stays at its number. Returns the length written (≤ len(src))."""
    j = 0
    pending = False  # a blank seen after content on this line
    content = False
    comment = False
    for i in range(src.shape[0]):
        c = src[i]
        if c == 10:
            dst[j] = 10
            j += 1
            pending = content = comment = False
        elif comment:
            continue
        elif c == 35:  # '#'
            comment = True
        elif c == 32 or c == 9 or c == 13:
            pending = content
        else:
            if pending:
                dst[j] = 32
                j += 1
                pending = False
            dst[j] = c
            j += 1
            content = True
    return j


@nb.njit(nogil=True, cache=True)
def _first_bad_line(buf, start, line, comma):
    """First line at or after byte ``start`` (line number ``line``) of normalised text that is
    neither empty nor ``digits SEP digits`` with both numbers below 2**64; returns (its line
    number, start, end) or (-1, -1, -1). SEP is ``,`` (with at most one space either side) or
    one space."""
    n = buf.shape[0]
    i = start
    while i < n:
        end = i
        while end < n and buf[end] != 10:
            end += 1
        ok = True
        if end > i:
            p = i
            for field in range(2):
                q = p
                while q < end and 48 <= buf[q] <= 57:
                    q += 1
                nd = q - p
                if nd == 0:
                    ok = False
                    break
                # more than 20 digits, or 20 digits above 2**64 - 1 (leading zeros count)
                if nd > 20:
                    ok = False
                    break
                if nd == 20:
                    for t in range(20):
                        a, b = buf[p + t], _LIMIT[t]
                        if a != b:
                            ok = a < b
                            break
                    if not ok:
                        break
                p = q
                if field == 0:
                    if comma:
                        if p < end and buf[p] == 32:
                            p += 1
                        if p >= end or buf[p] != 44:
                            ok = False
                            break
                        p += 1
                        if p < end and buf[p] == 32:
                            p += 1
                    else:
                        if p >= end or buf[p] != 32:
                            ok = False
                            break
                        p += 1
            if ok and p != end:
                ok = False
        if not ok:
            return line, i, end
        i = end + 1
        line += 1
    return -1, -1, -1


# --------------------------------------------------------------------------- id checks


def _reason(v) -> str | None:
    """Why a single value is not a uint64 id (None when it is one)."""
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


def _token_reason(s: str) -> str | None:
    """Why a token of a text mapping is not a uint64 id (None when it is one)."""
    s = s.strip()
    if _INT.fullmatch(s):
        return None if int(s) <= _U64_MAX else "larger than 2**64 - 1"
    if _SIGNED.fullmatch(s):
        return "negative" if s[0] == "-" else "not a plain decimal integer (it has a sign)"
    if not s or s.lower() in _NAN:
        return "NaN (a missing value)" if s else "empty"
    try:
        f = float(s)
    except ValueError:
        return "not a number"
    if math.isnan(f):
        return "NaN (a missing value)"
    if math.isinf(f) or f != math.floor(f):
        return "not an integer"
    return "negative" if f < 0 else "written as a float, not an integer"


def _show(v) -> str:
    return repr(v.item() if isinstance(v, np.generic) else v)


def _fail(source: str, where: str, value, reason: str):
    raise MappingError(f"{source}: {where} is {_show(value)}, which is {reason}; "
                       "supervoxel and body ids must be non-negative integers") from None


def _ids(a, source: str, where) -> np.ndarray:
    """``a`` as uint64 ids, or `MappingError` naming ``where(i)`` and the value of the first bad one."""
    a = np.asarray(a)
    if a.ndim != 1:
        a = a.reshape(-1)
    kind = a.dtype.kind
    if kind == "u":
        return a.astype(np.uint64, copy=False)
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
    return a.astype(np.uint64)


def _background_row(sv: np.ndarray, body: np.ndarray) -> int:
    """Index of the first row mapping supervoxel 0 to a non-zero body, or -1."""
    zero = np.flatnonzero(sv == 0)
    if zero.size:
        bad = zero[body[zero] != 0]
        if bad.size:
            return int(bad[0])
    return -1


def _check_background(sv: np.ndarray, body: np.ndarray, source: str, where) -> None:
    """MappingError naming ``where(i)`` when row i sends supervoxel 0 (background) to a body."""
    i = _background_row(sv, body)
    if i >= 0:
        raise MappingError(_background_message(f"{source}: {where(i)}", int(body[i])))


def _background_message(where: str, body: int) -> str:
    return (f"{where} maps supervoxel 0 to body {body}; 0 is background (no supervoxel) and can only "
            f"map to 0: remove that row or map it to 0")


# --------------------------------------------------------------------------- the mapping


class LabelMapping:
    """A supervoxel → body mapping; supervoxels absent from it keep their id.

    Build it with `LabelMapping.from_any` from a dict, an (n, 2) array, a pandas Series
    (index supervoxels, values bodies) or a file in DVID's ``/mappings`` formats, or with
    `LabelMapping.from_file`.

    Parameters
    ----------
    supervoxels, bodies : array_like
        Equal-length uint64 ids (checked: non-negative integers). A supervoxel listed twice
        must have the same body both times.

    Attributes
    ----------
    keys : numpy.ndarray
        Sorted unique supervoxel ids (uint64).
    values : numpy.ndarray
        Their bodies (uint64), same order.

    Raises
    ------
    MappingError
        A bad id (named with its position and value), unequal lengths, a supervoxel
        mapped to two bodies, or supervoxel 0 (background) mapped to a body.

    Notes
    -----
    Pickles by value (16 bytes per supervoxel): a mapping object handed to a job travels in
    every task. Give jobs a mapping *file* instead (`load_file`: loaded once per worker).
    """

    __slots__ = ("keys", "values")

    def __init__(self, supervoxels, bodies):
        sv = _ids(supervoxels, "mapping", lambda i: f"supervoxel #{i}")
        body = _ids(bodies, "mapping", lambda i: f"body #{i}")
        if sv.shape != body.shape:
            raise MappingError(f"mapping has {sv.size} supervoxels but {body.size} bodies")
        _check_background(sv, body, "mapping", lambda i: f"row #{i}")
        # own copies: the caller's arrays are never sorted in place nor aliased
        self._set(np.array(sv, np.uint64, order="C"), np.array(body, np.uint64, order="C"))

    @classmethod
    def _owned(cls, sv: np.ndarray, body: np.ndarray) -> LabelMapping:
        """A mapping over fresh contiguous uint64 arrays that it may sort in place."""
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

    def __getstate__(self):
        return (self.keys, self.values)

    def __setstate__(self, state):
        self.keys, self.values = state

    def palette(self, supervoxels: np.ndarray) -> np.ndarray:
        """The bodies of a block's supervoxel list (uint64, same order and length)."""
        out = np.empty(supervoxels.shape[0], np.uint64)
        _apply_k(supervoxels, self.keys, self.values, out)
        return out

    def __call__(self, supervoxels) -> np.ndarray:
        """Map any array of supervoxel ids (for users; the reader uses `palette`)."""
        a = np.ascontiguousarray(supervoxels, dtype=np.uint64)
        return self.palette(a.ravel()).reshape(a.shape)

    # ----------------------------------------------------------------------- builders

    @classmethod
    def from_any(cls, obj) -> LabelMapping:
        """Build a mapping from a dict, (n, 2) array, pandas Series, LabelMapping or file path.

        Parameters
        ----------
        obj : LabelMapping, dict, pandas.Series, array_like or path
            A dict ``{supervoxel: body}``; a Series whose index holds supervoxels and whose
            values hold bodies; an (n, 2) array of ``(supervoxel, body)`` rows; a path to a
            text or binary mapping file (see `from_file`; loaded through `load_file`, so at most
            once per process and file version).

        Returns
        -------
        LabelMapping

        Raises
        ------
        MappingError
            For anything that is not a mapping, and for every bad id, named by its dict key,
            Series index, array row or file line, with its value.
        """
        if isinstance(obj, LabelMapping):
            return obj
        if isinstance(obj, (str, os.PathLike)):
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
    def from_file(cls, path, format: str = "auto") -> LabelMapping:
        """Read a mapping file in DVID's ``/mappings`` formats.

        Parameters
        ----------
        path : str or os.PathLike
            The file.
        format : {"auto", "text", "binary"}, optional
            ``"text"``: lines ``supervoxel body`` (comma, spaces or a tab between; an
            optional header line of column names; ``#`` comments and blank lines skipped;
            ids in decimal, or hexadecimal with ``0x`` as pyarrow reads them).
            ``"binary"``: little-endian uint64 ``(supervoxel, body)`` pairs. ``"auto"``
            (default): text unless the first 64 KiB hold bytes no text has (NUL and other
            control bytes).

        Returns
        -------
        LabelMapping

        Raises
        ------
        MappingError
            The file cannot be read; a text line is malformed or holds a negative,
            fractional, NaN or too large id (the message names the file, the line number
            and the value); a binary file is not a whole number of 16-byte pairs; supervoxel 0
            is mapped to a body (named by its line, or pair of a binary file); the file is
            empty, damaged compressed data, or compressed in a format not read here.

        Notes
        -----
        A file compressed with gzip, zstd, bzip2 or xz (told by its first bytes, not its name)
        is decompressed first; other compressed or archive formats are refused by name. An
        empty file (0 bytes) is an error, not an empty mapping.

        Parses the file at every call. `load_file` (what ``from_any``, the readers and the jobs
        use) parses it once per process, and large files once per host.
        """
        return _files.read(os.fspath(path), format)

    @classmethod
    def from_bytes(cls, data, name: str = "mapping bytes", format: str = "auto") -> LabelMapping:
        """A mapping from the bytes of a mapping file (any bytes-like object, or a seekable binary
        file object), as `from_file` reads them; ``name`` is what errors call it."""
        return parse_mapping(data, name, format)

    @classmethod
    def from_sorted(cls, keys: np.ndarray, values: np.ndarray) -> LabelMapping:
        """A mapping over arrays already sorted, unique and checked (a sidecar's: not checked again)."""
        self = cls.__new__(cls)
        self.keys, self.values = keys, values
        return self


def check_format(format: str) -> None:
    if format not in ("auto", "text", "binary"):
        raise MappingError(f"mapping file format must be 'auto', 'text' or 'binary', not {format!r}")


def parse_mapping(src, name: str, format: str = "auto") -> LabelMapping:
    """A mapping from the content of a mapping file, checked (see `LabelMapping.from_file`).

    ``src`` is a bytes-like object or a seekable binary file object (read from its start; not
    closed). ``name`` names it in errors (the file's path). Compressed content (gzip, zstd,
    bzip2, xz) is decompressed first.
    """
    sv, body = _parse(_Source(name, src), format)
    return LabelMapping._owned(sv, body)


def _parse(source: _Source, format: str) -> tuple[np.ndarray, np.ndarray]:
    """(supervoxels, bodies) of a mapping file's content in file order, checked; OSError passes through."""
    check_format(format)
    path = source.name
    head = source.head()
    if not head:
        raise MappingError(f"{path}: the mapping file is empty (0 bytes): an interrupted download or copy? "
                           f"(a mapping of nothing is written as a header line alone, 'sv body')")
    kind = _compression(head)
    if kind is not None:
        source = _Source(f"{path} ({kind}-decompressed)", _decompress(kind, source), compression=kind)
        head = source.head()
        if not head:
            raise MappingError(f"{path}: the {kind}-compressed mapping file decompresses to 0 bytes: "
                               f"an interrupted download or copy?")
    if format == "auto":
        format = "binary" if _not_text(head) else "text"
    if format == "binary":
        sv, body = _read_binary(source)
    else:
        sv, body = _read_text(source, head)
    i = _background_row(sv, body)
    if i >= 0:
        where = (f"{source.name}: pair #{i} (byte offset {16 * i})" if format == "binary"
                 else f"{source.name}: line {_line_of_row(source, i)}")
        raise MappingError(_background_message(where, int(body[i])))
    return sv, body


class _Source:
    """The content of a mapping file: an in-memory buffer, or a seekable binary file object."""

    def __init__(self, name: str, src, compression: str | None = None):
        self.name = name
        self.compression = compression
        self.file = None if isinstance(src, (bytes, bytearray, memoryview)) or not hasattr(src, "read") else src
        self.data = None if self.file is not None else memoryview(src).cast("B")

    def head(self, n: int = _SNIFF) -> bytes:
        if self.file is None:
            assert self.data is not None
            return bytes(self.data[:n])
        self.file.seek(0)
        return self.file.read(n)

    def all(self):
        """Every byte (a buffer numpy and pyarrow read without a copy)."""
        if self.file is None:
            return self.data
        self.file.seek(0)
        return self.file.read()

    def arrow(self, start: int):
        """A pyarrow input stream from byte ``start`` on."""
        import pyarrow as pa

        if self.file is None:
            assert self.data is not None
            return pa.BufferReader(pa.py_buffer(self.data[start:]))
        name = getattr(self.file, "name", None)
        if isinstance(name, str) and os.path.isfile(name):  # a file on disk: pyarrow reads it without the GIL
            f = pa.OSFile(name)
            f.seek(start)
            return f
        self.file.seek(start)
        return pa.PythonFile(self.file, mode="r")


# --------------------------------------------------------------------------- compression

# (magic at offset 0, name, how to read it or None: refused by name with what to do)
_MAGIC = (
    (b"\x1f\x8b", "gzip", "gzip"),
    (b"\x28\xb5\x2f\xfd", "zstd", "zstd"),
    (b"\xfd7zXZ\x00", "xz", "xz"),
    (b"BZh", "bzip2", "bzip2"),
    (b"\x04\x22\x4d\x18", "lz4", None),
    (b"PK\x03\x04", "zip", None),
    (b"7z\xbc\xaf\x27\x1c", "7z", None),
)
_BZ2_BLOCK = b"\x31\x41\x59\x26\x53\x59"  # the first block's magic, after "BZh" and the level digit


def _compression(head: bytes) -> str | None:
    """The compression (or archive) format these first bytes start, or None (plain content)."""
    for magic, kind, _ in _MAGIC:
        if head.startswith(magic):
            if kind == "bzip2" and not (head[3:4].isdigit() and head[4:10] == _BZ2_BLOCK):
                continue  # text that happens to start with "BZh"
            return kind
    return None


_CHUNK = 16 << 20


def _decompress(kind: str, source: _Source) -> bytearray:
    """The decompressed content; MappingError naming the file when it is damaged or truncated,
    or in a format not read here."""
    path = source.name
    how = {k: h for _, k, h in _MAGIC}[kind]
    if how is None:
        what = "a zip archive" if kind == "zip" else "a 7z archive" if kind == "7z" else f"{kind}-compressed"
        raise MappingError(f"{path}: is {what}, which is not read here: extract the mapping file (text "
                           f"'supervoxel body' lines or DVID's binary pairs) and give that, or compress it "
                           f"with gzip or zstd")
    raw = source.file if source.file is not None else io.BytesIO(source.data)  # type: ignore[arg-type]
    raw.seek(0)
    out = bytearray()
    try:
        if how == "zstd":
            import zstandard

            d, fed = zstandard.ZstdDecompressor().decompressobj(), False
            while True:
                chunk = raw.read(_CHUNK)
                if not chunk:
                    break
                while chunk:
                    out += d.decompress(chunk)
                    fed = True
                    if d.eof:  # a frame ended: what follows is the next frame (or nothing)
                        chunk, d, fed = d.unused_data, zstandard.ZstdDecompressor().decompressobj(), False
                    else:
                        chunk = b""
            if fed:
                raise EOFError("the data ends inside a zstd frame")
        else:
            stream: io.BufferedIOBase
            if how == "gzip":
                import gzip
                stream = gzip.GzipFile(fileobj=raw, mode="rb")
            elif how == "bzip2":
                import bz2
                stream = bz2.BZ2File(raw, mode="rb")
            else:
                import lzma
                stream = lzma.LZMAFile(raw, mode="rb")
            with stream:
                while True:
                    chunk = stream.read(_CHUNK)
                    if not chunk:
                        break
                    out += chunk
    except ImportError as e:
        raise MappingError(f"{path}: is {kind}-compressed, and this Python cannot decompress it ({e}); "
                           f"decompress it first") from None
    except _damaged() as e:  # a bad header or checksum, or cut short
        raise MappingError(f"{path}: the {kind}-compressed mapping file is damaged or incomplete "
                           f"({type(e).__name__}: {e}): an interrupted download or copy?") from None
    return out


def _damaged() -> tuple[type[BaseException], ...]:
    """The exceptions the decompressors raise on damaged or truncated data."""
    import zlib

    out: list[type[BaseException]] = [EOFError, OSError, ValueError, zlib.error]
    for mod, name in (("zstandard", "ZstdError"), ("lzma", "LZMAError")):
        with contextlib.suppress(ImportError):
            out.append(getattr(__import__(mod), name))
    return tuple(out)


# --------------------------------------------------------------------------- files


def _not_text(head: bytes) -> bool:
    """Whether these first bytes of a file cannot start a text mapping."""
    if _NOT_TEXT.search(head):
        return True
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return True
    return False


def _read_binary(source: _Source) -> tuple[np.ndarray, np.ndarray]:
    data = source.all()
    if len(data) % 16:
        bad = _NOT_TEXT.search(bytes(data[:_SNIFF]))
        why = "" if bad is None else (f" (and it is not text: byte 0x{bad.group()[0]:02x} at offset "
                                      f"{bad.start()})")
        raise MappingError(f"{source.name}: a binary mapping is little-endian uint64 (supervoxel, body) "
                           f"pairs, but the file's {len(data)} bytes are not a whole number of "
                           f"16-byte pairs{why}")
    pairs = np.frombuffer(data, dtype="<u8").reshape(-1, 2)
    del data
    return pairs[:, 0].astype(np.uint64), pairs[:, 1].astype(np.uint64)


def _line_at(text, pos: int) -> tuple[int, str]:
    """End offset and text of the line starting at ``pos`` (``text``: bytes or memoryview)."""
    m = _NEWLINE.search(text, pos)
    end = len(text) if m is None else m.start()
    return end, bytes(text[pos:end]).decode("utf-8", "replace")


def _layout(text) -> tuple[int, int, str] | None:
    """Where the data of normalised text begins: (byte offset, line number from 0, delimiter).

    The first non-empty line is a header when every field is a name (``sv_id body_id``).
    None when there is no data line.
    """
    m = _CONTENT.search(text)
    if m is None:
        return None
    end, line = _line_at(text, m.start())
    if all(_NAME.fullmatch(t) and t.lower() not in _NOT_NAMES for t in re.split(r" ?, ?| ", line)):
        m = _CONTENT.search(text, end)
        if m is None:
            return None
        end, line = _line_at(text, m.start())
    pos = m.start()
    return pos, bytes(text[:pos]).count(b"\n"), "," if "," in line else " "


def _read_text(source: _Source, head: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(supervoxels, bodies) of a text mapping file; ``head`` is its first bytes."""
    import pyarrow as pa

    path = source.name
    bom = len(_BOM) if head.startswith(_BOM) else 0
    # fast path: from the first data line on, plain "id<sep>id" lines straight into pyarrow
    raw = np.frombuffer(head, np.uint8)[bom:]
    clean = np.empty_like(raw)
    where = _layout(clean[:_normalise(raw, clean)].data)
    if where is None and len(head) < _SNIFF:
        return np.zeros(0, np.uint64), np.zeros(0, np.uint64)
    if where is not None:
        _, line, delim = where
        start = bom + _line_offset(raw, line)
        first = head[start:head.find(b"\n", start) if b"\n" in head[start:] else len(head)]
        if delim == " " and b"\t" in first and b" " not in first.strip():
            delim = "\t"
        src = source.arrow(start)
        try:
            return _read_pairs(src, delim)
        except pa.ArrowInvalid:
            pass
        finally:
            if not isinstance(src, pa.PythonFile):  # (closing that one would close the caller's file)
                src.close()
    # anything else (comments, runs of blanks, trailing blanks, a bad line): normalise it all
    raw = np.frombuffer(source.all(), np.uint8)
    clean = np.empty(raw.shape[0] - bom, np.uint8)
    clean = clean[:_normalise(raw[bom:], clean)]
    del raw
    where = _layout(clean.data)
    if where is None:
        return np.zeros(0, np.uint64), np.zeros(0, np.uint64)
    pos, line, delim = where
    try:
        return _read_pairs(pa.BufferReader(pa.py_buffer(clean[pos:])), delim)
    except pa.ArrowInvalid as e:
        message = str(e)
    _diagnose(clean, pos, line, delim, path, message)
    raise AssertionError("unreachable")  # _diagnose raises


def _line_offset(raw: np.ndarray, line: int) -> int:
    """Byte offset of line ``line`` (from 0) in ``raw`` (a file's first bytes)."""
    if line == 0:
        return 0
    return int(np.flatnonzero(raw == 10)[line - 1]) + 1


def _line_of_row(source: _Source, row: int) -> int:
    """Line number (from 1) of data row ``row`` (from 0) of a text mapping (for error messages)."""
    raw = np.frombuffer(source.all(), np.uint8)
    bom = len(_BOM) if raw[:3].tobytes() == _BOM else 0
    clean = np.empty(raw.shape[0] - bom, np.uint8)
    clean = clean[:_normalise(raw[bom:], clean)]
    del raw
    where = _layout(clean.data)
    if where is None:
        return 0
    pos, line, _ = where
    text = clean[pos:]
    nl = np.flatnonzero(text == 10)
    starts = np.concatenate([[0], nl + 1])
    ends = np.concatenate([nl, [text.size]])
    full = np.flatnonzero(ends > starts)
    return line + int(full[row]) + 1 if row < full.size else 0


def _read_pairs(src, delim: str) -> tuple[np.ndarray, np.ndarray]:
    """Two uint64 columns from a CSV stream, each copied into one contiguous array."""
    import pyarrow as pa
    import pyarrow.csv as pcsv

    cols = ["sv", "body"]
    table = pcsv.read_csv(
        src,
        read_options=pcsv.ReadOptions(column_names=cols, block_size=16 << 20),
        parse_options=pcsv.ParseOptions(delimiter=delim, quote_char=False, ignore_empty_lines=True),
        convert_options=pcsv.ConvertOptions(
            column_types={c: pa.uint64() for c in cols}, null_values=[], strings_can_be_null=False,
            quoted_strings_can_be_null=False),
    )
    out = []
    for c in cols:  # the table's chunks of a column are freed once it is copied
        col = table.column(c)
        a = np.empty(len(col), np.uint64)
        pos = 0
        for chunk in col.chunks:
            n = len(chunk)
            a[pos:pos + n] = np.frombuffer(chunk.buffers()[1], np.uint64, n, chunk.offset * 8)
            pos += n
        out.append(a)
        del col, chunk
        table = table.drop_columns([c])
        pa.default_memory_pool().release_unused()  # hand the freed column back to the OS now
    return out[0], out[1]


def _diagnose(clean: np.ndarray, pos: int, line: int, delim: str, path: str, message: str) -> None:
    """Raise a MappingError naming the first bad line of a normalised text mapping and its value."""
    n, lo, hi = _first_bad_line(clean, pos, line, delim == ",")
    if n < 0:  # every line is well formed, yet pyarrow refused it
        raise MappingError(f"{path}: cannot read as a text mapping ('supervoxel body' lines): {message}")
    n += 1
    text = bytes(clean[lo:hi]).decode("utf-8", "replace")
    hint = ("; if this is a binary mapping, pass format='binary'"
            if _NOT_TEXT.search(bytes(clean[lo:hi])) else "")
    fields = re.split(r" ?, ?" if delim == "," else " ", text)
    if len(fields) != 2:
        sep = "a comma" if delim == "," else "spaces or a tab"
        raise MappingError(f"{path}: line {n} is {text[:80]!r}: expected two ids (supervoxel, "
                           f"body) separated by {sep}, found {len(fields)} field(s){hint}")
    for what, token in zip(("supervoxel", "body"), fields, strict=True):
        why = _token_reason(token)
        if why is not None:
            raise MappingError(f"{path}: line {n}: {what} id {token!r} is {why}; "
                               f"ids must be non-negative integers{hint}")
    raise MappingError(f"{path}: line {n} is {text[:80]!r}: cannot read it as 'supervoxel body'{hint}")


# --------------------------------------------------------------------------- files by path


class MappingFiles:
    """How mapping files given as paths are reached: `file_stamp`, `LabelMapping.from_file`,
    `load_file` and `prepare_file` all go through the one installed (`install_files`).

    This default reads the file in the calling thread at every load, and keeps nothing.
    ``dvidshards.runtime.mappings`` installs the one the package uses when ``dvidshards`` is
    imported: each file version loaded once per process, and large files parsed once per host
    into a sidecar that every process memory-maps.
    """

    def stamp(self, path: str) -> tuple[int, int]:
        """``(size, mtime_ns)`` of the file; MappingError when it is missing or not a file."""
        try:
            st = os.stat(path)
        except OSError as e:
            raise MappingError(f"{path}: mapping file not found" if isinstance(e, FileNotFoundError)
                               else f"{path}: cannot read mapping ({e.strerror or e})") from None
        if not os.path.isfile(path):
            raise MappingError(f"{path}: cannot read mapping (not a file)")
        return int(st.st_size), int(st.st_mtime_ns)

    def read(self, path: str, format: str = "auto") -> LabelMapping:
        """Parse the file now (`LabelMapping.from_file`)."""
        check_format(format)
        try:
            with open(path, "rb") as f:
                return parse_mapping(f, path, format)
        except OSError as e:
            raise MappingError(f"{path}: cannot read mapping ({e.strerror or e})") from None

    def load(self, path: str, stamp: tuple[int, int] | None, format: str) -> LabelMapping:
        """The mapping of the file as it was at ``stamp`` (`load_file`)."""
        check_format(format)
        now = self.stamp(path)
        check_stamp(path, stamp, now)
        m = self.read(path, format)
        if self.stamp(path) != now:
            raise MappingError(f"{path}: the mapping file changed while it was read; run again")
        return m

    def prepare(self, path: str, stamp: tuple[int, int] | None, format: str) -> None:
        """Check the file for a job's client (`prepare_file`)."""
        self.load(path, stamp, format)


def check_stamp(path: str, planned: tuple[int, int] | None, now: tuple[int, int]) -> None:
    """MappingError when the file's stamp ``now`` is not the one a job ``planned`` with."""
    if planned is not None and tuple(planned) != tuple(now):
        raise MappingError(f"{path}: the mapping file changed after the job was planned (size {planned[0]} -> "
                           f"{now[0]} bytes, modified {planned[1]} -> {now[1]} ns); run the job again to use it")


_files = MappingFiles()


def install_files(files: MappingFiles) -> MappingFiles:
    """Make ``files`` reach every mapping file of this process; returns the one it replaces."""
    global _files
    old, _files = _files, files
    return old


def installed_files() -> MappingFiles:
    """The `MappingFiles` in use."""
    return _files


def file_stamp(path) -> tuple[int, int]:
    """``(size, mtime_ns)`` of a mapping file: what says that it changed.

    Raises
    ------
    MappingError
        The file does not exist or cannot be read.
    """
    return _files.stamp(os.fspath(path))


def load_file(path, stamp: tuple[int, int] | None = None, format: str = "auto") -> LabelMapping:
    """A mapping file, loaded at most once per process and version of the file (with the
    package's runtime; see `MappingFiles`).

    Parameters
    ----------
    path : str or os.PathLike
        The mapping file.
    stamp : (size, mtime_ns), optional
        The version the caller planned with (`file_stamp`): if the file differs now, the load
        fails instead of using another mapping.
    format : {"auto", "text", "binary"}
        As in `LabelMapping.from_file`.

    Returns
    -------
    LabelMapping
        Shared by every caller of this process; its arrays may be read-only memory maps.

    Raises
    ------
    MappingError
        The file is missing, unreadable, empty or malformed (line and value named), or it
        changed since ``stamp``.
    """
    return _files.load(os.path.abspath(os.fspath(path)), stamp, format)


def prepare_file(path, stamp: tuple[int, int] | None = None, format: str = "auto") -> None:
    """Check a mapping file for a job's client, before any task: a bad file fails here. With the
    package's runtime, a large file is parsed in a child process into the per-host sidecar the
    workers memory-map, so this process's memory does not grow with the mapping.

    Raises
    ------
    MappingError
        As `load_file`.
    """
    _files.prepare(os.path.abspath(os.fspath(path)), stamp, format)
