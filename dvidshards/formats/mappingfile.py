"""The content of a mapping file in DVID's ``/mappings`` formats: supervoxel and body ids, checked.

Text or binary is told by the content, never the length. Text: a ``supervoxel body`` pair per
line (comma, spaces or a tab between; an optional header of names, ``#`` comments and blank
lines), parsed by ``pyarrow.csv``; other layouts are first normalised by a compiled pass that
keeps every line at its number, so errors name the right line. Binary: little-endian uint64
pairs (``/mappings?format=binary``), when asked for or when the bytes cannot be text (NUL and
other controls, which every binary mapping with ids below 2**56 holds). Supervoxel 0 maps only to
0. gzip, zstd, bzip2 and xz content is decompressed first (told by its first bytes), lz4, zip
and 7z refused by name; empty content (an interrupted download) is an error.
"""

from __future__ import annotations

import codecs
import contextlib
import importlib
import math
import re
from io import BufferedIOBase, BytesIO
from typing import Any

import numba as nb
import numpy as np

from ..errors import MappingError

__all__ = ["background_message", "background_row", "check_format", "parse_pairs"]

_U64_MAX = (1 << 64) - 1
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
_LIMIT = np.frombuffer(b"18446744073709551615", np.uint8)  # 2**64 - 1


@nb.njit(nogil=True, cache=True)
def _normalise(src, dst):  # type: ignore[no-untyped-def]
    """Copy text ``src`` to ``dst`` without ``#`` comments, blanks (space, tab, CR) collapsed to one
    space between fields and none at line ends, newlines kept; returns the length written."""
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
def _first_bad_line(buf, start, line, comma):  # type: ignore[no-untyped-def]
    """(line number, start, end) of the first line from byte ``start`` of normalised text that is
    neither empty nor ``digits SEP digits`` below 2**64 (SEP: ``,`` with at most one space either
    side, or one space); (-1, -1, -1) when none."""
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


def _token_reason(s: str) -> str | None:
    """Why a text token is not a uint64 id (None when it is one)."""
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


def background_row(sv: np.ndarray, body: np.ndarray) -> int:
    """The first row mapping supervoxel 0 to a body, or -1."""
    zero = np.flatnonzero(sv == 0)
    if zero.size:
        bad = zero[body[zero] != 0]
        if bad.size:
            return int(bad[0])
    return -1


def background_message(where: str, body: int) -> str:
    return (f"{where} maps supervoxel 0 to body {body}; 0 is background (no supervoxel) and can only "
            f"map to 0: remove that row or map it to 0")


def check_format(format: str) -> None:
    """MappingError unless ``format`` is one a mapping file is read as."""
    if format not in ("auto", "text", "binary"):
        raise MappingError(f"mapping file format must be 'auto', 'text' or 'binary', not {format!r}")


def parse_pairs(src: Any, name: str, format: str = "auto") -> tuple[np.ndarray, np.ndarray]:
    """(supervoxels, bodies) of a mapping file's content in file order, checked. ``src``: bytes-like
    or a seekable binary file object (read from its start, not closed; its OSError passes through)."""
    check_format(format)
    source = _Source(name, src)
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
    i = background_row(sv, body)
    if i >= 0:
        where = (f"{source.name}: pair #{i} (byte offset {16 * i})" if format == "binary"
                 else f"{source.name}: line {_line_of_row(source, i)}")
        raise MappingError(background_message(where, int(body[i])))
    return sv, body


class _Source:
    """A mapping file's content: an in-memory buffer, or a seekable binary file object."""

    def __init__(self, name: str, src: Any, compression: str | None = None) -> None:
        self.name = name
        self.compression = compression
        self.file = None if isinstance(src, (bytes, bytearray, memoryview)) or not hasattr(src, "read") else src
        self.data = None if self.file is not None else memoryview(src).cast("B")

    def head(self, n: int = _SNIFF) -> bytes:
        if self.file is None:
            assert self.data is not None
            return bytes(self.data[:n])
        self.file.seek(0)
        return bytes(self.file.read(n))

    def all(self) -> Any:
        """Every byte (a buffer numpy and pyarrow read without a copy)."""
        if self.file is None:
            return self.data
        self.file.seek(0)
        return self.file.read()

    def arrow(self, start: int) -> Any:
        """A pyarrow input stream from byte ``start`` on."""
        import pyarrow as pa

        if self.file is None:
            assert self.data is not None
            return pa.BufferReader(pa.py_buffer(self.data[start:]))
        self.file.seek(start)
        if isinstance(self.file, pa.NativeFile):  # a file pyarrow opened: read without the GIL
            return self.file
        return pa.PythonFile(self.file, mode="r")


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
    """The compression or archive format these first bytes start, or None."""
    for magic, kind, _ in _MAGIC:
        if head.startswith(magic):
            if kind == "bzip2" and not (head[3:4].isdigit() and head[4:10] == _BZ2_BLOCK):
                continue  # text that happens to start with "BZh"
            return kind
    return None


_CHUNK = 16 << 20


def _decompress(kind: str, source: _Source) -> bytearray:
    """The decompressed content; MappingError naming the file when damaged, cut short or in a
    format not read here."""
    path = source.name
    how = {k: h for _, k, h in _MAGIC}[kind]
    if how is None:
        what = "a zip archive" if kind == "zip" else "a 7z archive" if kind == "7z" else f"{kind}-compressed"
        raise MappingError(f"{path}: is {what}, which is not read here: extract the mapping file (text "
                           f"'supervoxel body' lines or DVID's binary pairs) and give that, or compress it "
                           f"with gzip or zstd")
    raw = source.file if source.file is not None else BytesIO(source.data)  # type: ignore[arg-type]
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
            stream: BufferedIOBase
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
    """What the decompressors raise on damaged or truncated data."""
    import zlib

    out: list[type[BaseException]] = [EOFError, OSError, ValueError, zlib.error]
    for mod, name in (("zstandard", "ZstdError"), ("lzma", "LZMAError")):
        with contextlib.suppress(ImportError):
            out.append(getattr(importlib.import_module(mod), name))
    return tuple(out)


def _not_text(head: bytes) -> bool:
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


def _line_at(text: bytes | memoryview, pos: int) -> tuple[int, str]:
    """End offset and text of the line starting at ``pos``."""
    m = _NEWLINE.search(text, pos)
    end = len(text) if m is None else m.start()
    return end, bytes(text[pos:end]).decode("utf-8", "replace")


def _layout(text: bytes | memoryview) -> tuple[int, int, str] | None:
    """(byte offset, line number from 0, delimiter) of normalised text's first data line (after a
    header of names), or None."""
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
            if source.file is None:  # (a file object is the caller's: not closed here)
                src.close()
    # anything else (comments, runs of blanks, trailing blanks, a bad line): normalise it all
    clean, where = _normalised(source)
    if where is None:
        return np.zeros(0, np.uint64), np.zeros(0, np.uint64)
    pos, line, delim = where
    try:
        return _read_pairs(pa.BufferReader(pa.py_buffer(clean[pos:])), delim)
    except pa.ArrowInvalid as e:
        message = str(e)
    _diagnose(clean, pos, line, delim, path, message)
    raise AssertionError("unreachable")  # _diagnose raises


def _normalised(source: _Source) -> tuple[np.ndarray, tuple[int, int, str] | None]:
    """The whole content normalised (byte-order mark dropped), and its `_layout`."""
    raw = np.frombuffer(source.all(), np.uint8)
    bom = len(_BOM) if raw[:3].tobytes() == _BOM else 0
    clean = np.empty(raw.shape[0] - bom, np.uint8)
    clean = clean[:_normalise(raw[bom:], clean)]
    del raw
    return clean, _layout(clean.data)


def _line_offset(raw: np.ndarray, line: int) -> int:
    if line == 0:
        return 0
    return int(np.flatnonzero(raw == 10)[line - 1]) + 1


def _line_of_row(source: _Source, row: int) -> int:
    """Line number (from 1) of data row ``row`` of a text mapping, for messages."""
    clean, where = _normalised(source)
    if where is None:
        return 0
    pos, line, _ = where
    text = clean[pos:]
    nl = np.flatnonzero(text == 10)
    starts = np.concatenate([[0], nl + 1])
    ends = np.concatenate([nl, [text.size]])
    full = np.flatnonzero(ends > starts)
    return line + int(full[row]) + 1 if row < full.size else 0


def _read_pairs(src: Any, delim: str) -> tuple[np.ndarray, np.ndarray]:
    """Two uint64 columns of a CSV stream, each copied into one contiguous array."""
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
