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

Once per process, once per host
-------------------------------
`load_file` is how jobs and readers load a mapping given as a path: at most once per process
(cached by path and change stamp, ``(size, mtime_ns)``), and for files of
``DVIDSHARDS_MAPPING_SIDECAR_BYTES`` (default 8 MiB) or more at most once per host: the first
process to need it starts a child process that parses the file and writes a *sidecar* (the
sorted keys and values as ``.npy`` files, written to a temporary folder and renamed) in the
cache folder ``DVIDSHARDS_CACHE_DIR`` (default ``$XDG_CACHE_HOME/dvidshards`` or
``~/.cache/dvidshards``; ``off`` disables it), and every process memory-maps it, so the page
cache holds one copy for all the workers of a host and no worker keeps the parse's memory. A
file lock makes the other processes wait for that parse instead of repeating it, and a file
that does not parse leaves its error there for them. Sidecars of older versions of a file, and
of files that are gone, are deleted when a new one is written.
"""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import uuid
import warnings
from collections import OrderedDict

import numba as nb
import numpy as np
from numba.core import types as nbt

from ..errors import MappingError
from . import jit

__all__ = ["LabelMapping", "cache_info", "clear_cache", "file_stamp", "load_file", "prepare_file"]

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
            is mapped to a body (named by its line, or pair of a binary file).

        Notes
        -----
        Parses the file at every call. `load_file` (what ``from_any``, the readers and the jobs
        use) parses it once per process, and large files once per host.
        """
        path = os.fspath(path)
        try:
            sv, body = _parse_file(path, format)
        except OSError as e:
            raise MappingError(f"{path}: cannot read mapping ({e.strerror or e})") from None
        return cls._owned(sv, body)

    @classmethod
    def _sorted(cls, keys: np.ndarray, values: np.ndarray) -> LabelMapping:
        """A mapping over arrays already sorted, unique and checked (a sidecar's)."""
        self = cls.__new__(cls)
        self.keys, self.values = keys, values
        return self


def _check_format(format: str) -> None:
    if format not in ("auto", "text", "binary"):
        raise MappingError(f"mapping file format must be 'auto', 'text' or 'binary', not {format!r}")


def _parse_file(path: str, format: str) -> tuple[np.ndarray, np.ndarray]:
    """(supervoxels, bodies) of a mapping file in file order, checked; OSError passes through."""
    _check_format(format)
    with open(path, "rb") as f:
        head = f.read(_SNIFF)
        if format == "auto":
            format = "binary" if _not_text(head) else "text"
        if format == "binary":
            f.seek(0)
            sv, body = _read_binary(f, path)
        else:
            sv, body = _read_text(f, head, path)
    i = _background_row(sv, body)
    if i >= 0:
        where = (f"{path}: pair #{i} (byte offset {16 * i})" if format == "binary"
                 else f"{path}: line {_line_of_row(path, i)}")
        raise MappingError(_background_message(where, int(body[i])))
    return sv, body


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


def _read_binary(f, path: str) -> tuple[np.ndarray, np.ndarray]:
    data = f.read()
    if len(data) % 16:
        bad = _NOT_TEXT.search(data, 0, _SNIFF)
        why = "" if bad is None else (f" (and it is not text: byte 0x{bad.group()[0]:02x} at offset "
                                      f"{bad.start()})")
        raise MappingError(f"{path}: a binary mapping is little-endian uint64 (supervoxel, body) "
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


def _read_text(f, head: bytes, path: str) -> tuple[np.ndarray, np.ndarray]:
    """(supervoxels, bodies) of a text mapping file; ``head`` is its first bytes."""
    import pyarrow as pa

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
        with pa.OSFile(path) as src:
            src.seek(start)
            try:
                return _read_pairs(src, delim)
            except pa.ArrowInvalid:
                pass
    # anything else (comments, runs of blanks, trailing blanks, a bad line): normalise it all
    f.seek(0)
    raw = np.fromfile(f, np.uint8)
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


def _line_of_row(path: str, row: int) -> int:
    """Line number (from 1) of data row ``row`` (from 0) of a text mapping (for error messages)."""
    raw = np.fromfile(path, np.uint8)
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


# --------------------------------------------------------------------------- once per process


_SIDECAR_VERSION = 1
_CACHE_ENV = "DVIDSHARDS_CACHE_DIR"
_SIDECAR_ENV = "DVIDSHARDS_MAPPING_SIDECAR_BYTES"
_SIDECAR_BYTES = 8 << 20  # smaller files parse in well under a second: no sidecar
_MEMORY_ENTRIES = 4  # mappings kept per process (the newest)
_memory: OrderedDict = OrderedDict()
_lock = threading.RLock()
_stats = {"parsed": 0, "built": 0, "opened": 0, "hits": 0}
_warned: set = set()


def file_stamp(path) -> tuple[int, int]:
    """``(size, mtime_ns)`` of a mapping file: what says that it changed.

    Raises
    ------
    MappingError
        The file does not exist or cannot be read.
    """
    path = os.fspath(path)
    try:
        st = os.stat(path)
    except OSError as e:
        raise MappingError(f"{path}: mapping file not found" if isinstance(e, FileNotFoundError)
                           else f"{path}: cannot read mapping ({e.strerror or e})") from None
    if not os.path.isfile(path):
        raise MappingError(f"{path}: cannot read mapping (not a file)")
    return int(st.st_size), int(st.st_mtime_ns)


def cache_info() -> dict:
    """What this process's mapping cache did: ``parsed`` (files parsed in this process),
    ``built`` (sidecars built by a child process it started), ``opened`` (sidecars
    memory-mapped), ``hits`` (loads answered from memory), ``entries`` (held now)."""
    with _lock:
        return {**_stats, "entries": len(_memory)}


def clear_cache() -> None:
    """Forget this process's loaded mappings and counters (the sidecars on disk stay)."""
    with _lock:
        _memory.clear()
        for k in _stats:
            _stats[k] = 0


def _cache_root() -> str | None:
    """The mapping sidecar folder, or None when the disk cache is off."""
    env = os.environ.get(_CACHE_ENV)
    if env is not None:
        if env.strip().lower() in ("", "0", "off", "none", "no"):
            return None
        base = env
    else:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(xdg, "dvidshards")
    return os.path.join(os.path.abspath(base), "mappings")


def _sidecar_bytes() -> int:
    try:
        return int(os.environ.get(_SIDECAR_ENV, _SIDECAR_BYTES))
    except ValueError:
        return _SIDECAR_BYTES


def _names(path: str, stamp: tuple[int, int], format: str) -> tuple[str, str]:
    """(prefix shared by every version of this file, this version's sidecar name)."""
    prefix = hashlib.sha256(path.encode("utf-8", "surrogateescape")).hexdigest()[:20]
    version = hashlib.sha256(f"{stamp[0]}:{stamp[1]}:{format}:{_SIDECAR_VERSION}".encode()).hexdigest()[:16]
    return prefix, f"{prefix}-{version}"


def load_file(path, stamp: tuple[int, int] | None = None, format: str = "auto") -> LabelMapping:
    """A mapping file, loaded at most once per process and version of the file.

    The first load in a process memory-maps the file's sidecar (read-only) when the disk cache
    has one; else, for a large file, a child process parses it and writes the sidecar for every
    process of the host (see the module docstring); a small file is parsed here
    (`LabelMapping.from_file`).
    Thread-safe: concurrent callers wait for one load.

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
        The file is missing, unreadable or malformed (line and value named), or it changed
        since ``stamp``.
    """
    _check_format(format)
    path = os.path.abspath(os.fspath(path))
    now = file_stamp(path)
    if stamp is not None and tuple(stamp) != now:
        raise MappingError(f"{path}: the mapping file changed after the job was planned (size {stamp[0]} -> "
                           f"{now[0]} bytes, modified {stamp[1]} -> {now[1]} ns); run the job again to use it")
    key = (path, now, format)
    with _lock:
        m = _memory.get(key)
        if m is not None:
            _memory.move_to_end(key)
            _stats["hits"] += 1
            return m
        root = _cache_root() if now[0] >= _sidecar_bytes() else None
        m = _load_via_sidecar(root, path, now, format) if root is not None else None
        if m is None:
            m = _parse_checked(path, now, format)
        _memory[key] = m
        while len(_memory) > _MEMORY_ENTRIES:
            _memory.popitem(last=False)
        return m


def prepare_file(path, stamp: tuple[int, int] | None = None, format: str = "auto") -> None:
    """Check a mapping file and build its sidecar without holding the mapping in this process.

    For a job's client: a bad file fails here, before any task, and the workers of this host
    then memory-map the sidecar. A file that gets a sidecar (``DVIDSHARDS_MAPPING_SIDECAR_BYTES``
    or more, disk cache on) is parsed in a child process, so this process's memory does not
    grow with the mapping; a small one (or any, with the cache off) is loaded here.

    Raises
    ------
    MappingError
        As `load_file`.
    """
    _check_format(format)
    path = os.path.abspath(os.fspath(path))
    now = file_stamp(path)
    if stamp is not None and tuple(stamp) != now:
        load_file(path, stamp, format)  # raises: changed
    root = _cache_root() if now[0] >= _sidecar_bytes() else None
    with _lock:
        if (path, now, format) in _memory:
            return
        if root is None or _load_via_sidecar(root, path, now, format) is None:
            load_file(path, now, format)


def _child_main(argv: list[str]) -> int:
    """The child that parses a file and writes its sidecar (its parent holds the host's lock);
    exit 3 with the MappingError on stdout."""
    root, path, size, mtime, format = argv
    try:
        _build(root, path, (int(size), int(mtime)), format)
    except MappingError as e:
        print(str(e))
        return 3
    return 0


def _writable(root: str) -> bool:
    try:
        os.makedirs(root, exist_ok=True)
    except OSError:
        pass
    ok = os.access(root, os.W_OK | os.X_OK)
    if not ok and root not in _warned:
        _warned.add(root)
        warnings.warn(f"mapping cache folder {root} is not writable: each process parses large mapping files itself "
                      f"(set {_CACHE_ENV} to a writable folder, or 'off')", stacklevel=3)
    return ok


def _parse_checked(path: str, stamp: tuple[int, int], format: str) -> LabelMapping:
    """Parse the file; MappingError if it changed while it was read."""
    try:
        sv, body = _parse_file(path, format)
    except OSError as e:
        raise MappingError(f"{path}: cannot read mapping ({e.strerror or e})") from None
    if file_stamp(path) != stamp:
        raise MappingError(f"{path}: the mapping file changed while it was read; run again")
    m = LabelMapping._owned(sv, body)
    _stats["parsed"] += 1
    return m


def _open_sidecar(folder: str, path: str, stamp: tuple[int, int], format: str) -> LabelMapping | None:
    """The sidecar in ``folder`` memory-mapped, or None when it is absent or not this file's."""
    try:
        with open(os.path.join(folder, "meta.json"), "rb") as f:
            meta = json.loads(f.read())
        want = {"version": _SIDECAR_VERSION, "path": path, "size": stamp[0], "mtime_ns": stamp[1], "format": format}
        if any(meta.get(k) != v for k, v in want.items()):
            return None
        keys = np.load(os.path.join(folder, "keys.npy"), mmap_mode="r", allow_pickle=False)
        values = np.load(os.path.join(folder, "values.npy"), mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError):
        return None
    rows = meta.get("rows")
    for a in (keys, values):
        if a.dtype != np.uint64 or a.ndim != 1 or a.shape[0] != rows:
            return None
    _stats["opened"] += 1
    # plain read-only ndarray views over the maps (numba types them as arrays)
    return LabelMapping._sorted(np.asarray(keys), np.asarray(values))


def _load_via_sidecar(root: str, path: str, stamp: tuple[int, int], format: str) -> LabelMapping | None:
    """The mapping from its sidecar, building the sidecar first (once per host) if needed.

    The build runs in a child process, so no worker keeps the parse's memory (~3.4 GiB at 10⁸
    rows, much of it not returned to the system); the other processes of the host wait on a
    file lock meanwhile. None when the cache folder cannot be written (the caller parses in
    memory).
    """
    if not _writable(root):
        return None
    _, name = _names(path, stamp, format)
    folder = os.path.join(root, name)
    m = _open_sidecar(folder, path, stamp, format)
    if m is not None:
        return m
    with _file_lock(os.path.join(root, name + ".lock")):
        m = _open_sidecar(folder, path, stamp, format)  # another process built it while we waited
        if m is not None:
            return m
        _raise_recorded(root, name)
        try:
            r = subprocess.run([sys.executable, "-c", "import sys; from dvidshards.formats.mapping import "
                                "_child_main; sys.exit(_child_main(sys.argv[1:]))", root, path, str(stamp[0]),
                                str(stamp[1]), format], capture_output=True, text=True)
        except OSError:  # no interpreter to start (embedded Python): parse here
            return _build(root, path, stamp, format)
        _stats["built"] += 1
        if r.returncode == 3:
            raise MappingError(r.stdout.strip() or f"{path}: cannot read mapping")
        if r.returncode:
            tail = " ".join((r.stderr or "").split()[-40:])
            raise MappingError(f"{path}: the process parsing the mapping failed (exit {r.returncode}: {tail})")
        m = _open_sidecar(folder, path, stamp, format)
        return m if m is not None else _build(root, path, stamp, format)  # an unwritable sidecar: parse here


def _raise_recorded(root: str, name: str) -> None:
    """Raise the MappingError an earlier parse of this file version left (if any)."""
    try:
        with open(os.path.join(root, name + ".error"), encoding="utf-8") as f:
            raise MappingError(f.read())
    except FileNotFoundError:
        pass


def _build(root: str, path: str, stamp: tuple[int, int], format: str) -> LabelMapping:
    """Parse the file here and write its sidecar (or its error); the sidecar's mapping, or the
    parsed one when the sidecar cannot be written."""
    prefix, name = _names(path, stamp, format)
    folder = os.path.join(root, name)
    try:
        parsed = _parse_checked(path, stamp, format)
    except MappingError as e:
        if "changed" not in str(e) and "cannot read mapping" not in str(e):
            _write_atomic(os.path.join(root, name + ".error"), str(e).encode())  # the others fail at once
        raise
    try:
        _write_sidecar(root, folder, parsed, path, stamp, format)
    except OSError:
        return parsed
    del parsed
    _prune(root, prefix, name)
    m = _open_sidecar(folder, path, stamp, format)
    if m is None:
        raise MappingError(f"{path}: the mapping cache {folder} was written but cannot be read back")
    return m


def _write_sidecar(root: str, folder: str, m: LabelMapping, path: str, stamp, format: str) -> None:
    tmp = os.path.join(root, f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    try:
        np.save(os.path.join(tmp, "keys.npy"), m.keys)
        np.save(os.path.join(tmp, "values.npy"), m.values)
        meta = {"version": _SIDECAR_VERSION, "path": path, "size": stamp[0], "mtime_ns": stamp[1], "format": format,
                "rows": len(m)}
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f)
        try:
            os.rename(tmp, folder)
        except OSError:
            if not os.path.isdir(folder):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _prune(root: str, prefix: str, keep: str) -> None:
    """Delete sidecars of other versions of this file, of files that are gone or changed, and
    temporary folders of writers that died a day ago."""
    entries = []
    with contextlib.suppress(OSError), os.scandir(root) as it:
        entries = list(it)
    for e in entries:
        name = e.name
        if name == keep or name.startswith(keep + "."):
            continue
        if name.startswith(".tmp-"):
            with contextlib.suppress(OSError):
                if e.stat().st_mtime < time.time() - 86400:
                    shutil.rmtree(e.path, ignore_errors=True)
            continue
        stem = name.split(".", 1)[0]
        stale = stem.startswith(prefix + "-")
        if not stale and e.is_dir() and "-" in stem and not name.startswith("."):
            try:
                with open(os.path.join(e.path, "meta.json"), "rb") as f:
                    meta = json.loads(f.read())
                st = os.stat(meta["path"])
                stale = (st.st_size, st.st_mtime_ns) != (meta["size"], meta["mtime_ns"])
            except FileNotFoundError:
                stale = True
            except (OSError, ValueError, KeyError, TypeError):
                stale = False
        if stale and not name.endswith(".lock"):
            if e.is_dir():
                shutil.rmtree(e.path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.remove(e.path)


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(tmp)


@contextlib.contextmanager
def _file_lock(path: str):
    """An exclusive lock between processes (fcntl; none where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
