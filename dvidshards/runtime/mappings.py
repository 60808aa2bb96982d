"""Mapping files loaded once per process, and large ones parsed once per host.

Installed as `formats.mapping`'s file access on import. A file is loaded at most once per
process (cached by path and ``(size, mtime_ns)``, the newest few kept); one of
``DVIDSHARDS_MAPPING_SIDECAR_BYTES`` (8 MiB) or more at most once per host: the first process
needing it has a child parse it into a sidecar (sorted keys and values as ``.npy``, written to a
temporary folder and renamed) in ``DVIDSHARDS_CACHE_DIR`` (default ``$XDG_CACHE_HOME/dvidshards``
or ``~/.cache/dvidshards``; ``off`` disables it) that every process memory-maps: one copy in the
page cache, no worker keeping the parse's memory. A file lock makes the others wait for the
parse, a file that does not parse leaves its error for them, and sidecars of older versions or
vanished files are deleted when a new one is written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
import warnings
from collections import OrderedDict

import numpy as np
import pyarrow as pa

from ..errors import MappingError
from ..formats import mapping as fm
from ..formats.mapping import LabelMapping
from .locks import acquire

__all__ = ["SidecarFiles", "cache_info", "clear_cache", "install"]

_SIDECAR_VERSION = 2  # 2: compressed files are read (a version-1 sidecar of one would hold garbage)
_CACHE_ENV = "DVIDSHARDS_CACHE_DIR"
_SIDECAR_ENV = "DVIDSHARDS_MAPPING_SIDECAR_BYTES"
_SIDECAR_BYTES = 8 << 20  # smaller files parse in well under a second: no sidecar
_MEMORY_ENTRIES = 4  # mappings kept per process (the newest)
_memory: OrderedDict = OrderedDict()
_lock = threading.RLock()
_stats = {"parsed": 0, "built": 0, "opened": 0, "hits": 0}
_warned: set = set()


class SidecarFiles(fm.MappingFiles):
    """`formats.mapping.MappingFiles` on this host's files, with the per-process cache and the
    per-host sidecars."""

    def absolute(self, path: str) -> str:
        return os.path.abspath(path)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def stamp(self, path: str) -> tuple[int, int]:
        return _stamp(path)

    def read(self, path: str, format: str = "auto") -> LabelMapping:
        return _read(path, format)

    def load(self, path: str, stamp: tuple[int, int] | None, format: str) -> LabelMapping:
        fm.check_format(format)
        now = self.stamp(path)
        fm.check_stamp(path, stamp, now)
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

    def prepare(self, path: str, stamp: tuple[int, int] | None, format: str) -> None:
        """A file that gets a sidecar is parsed in a child process (this one does not grow); a small one,
        or any with the cache off, is loaded here."""
        fm.check_format(format)
        now = self.stamp(path)
        fm.check_stamp(path, stamp, now)
        root = _cache_root() if now[0] >= _sidecar_bytes() else None
        with _lock:
            if (path, now, format) in _memory:
                return
            if root is None or _load_via_sidecar(root, path, now, format) is None:
                self.load(path, now, format)


def install() -> None:
    fm.install_files(SidecarFiles())


def cache_info() -> dict:
    """What this process's mapping cache did: ``parsed``, ``built`` (sidecars by a child it started),
    ``opened`` (sidecars mapped), ``hits`` (from memory), ``entries`` (held now)."""
    with _lock:
        return {**_stats, "entries": len(_memory)}


def clear_cache() -> None:
    """Forget this process's loaded mappings and counters (sidecars stay)."""
    with _lock:
        _memory.clear()
        for k in _stats:
            _stats[k] = 0


def _cache_root() -> str | None:
    """The sidecar folder, or None when the disk cache is off."""
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


def _child_main(argv: list[str]) -> int:
    """The child parsing a file into its sidecar (its parent holds the lock); exit 3 with the
    MappingError on stdout."""
    root, path, size, mtime, format = argv
    try:
        _build(root, path, (int(size), int(mtime)), format)
    except MappingError as e:
        print(str(e))
        return 3
    return 0


def _writable(root: str) -> bool:
    with contextlib.suppress(OSError):
        os.makedirs(root, exist_ok=True)
    ok = os.access(root, os.W_OK | os.X_OK)
    if not ok and root not in _warned:
        _warned.add(root)
        warnings.warn(f"mapping cache folder {root} is not writable: each process parses large mapping files itself "
                      f"(set {_CACHE_ENV} to a writable folder, or 'off')", stacklevel=4)
    return ok


def _stamp(path: str) -> tuple[int, int]:
    """``(size, mtime_ns)`` of the file; MappingError when it is missing or not a file."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise MappingError(f"{path}: mapping file not found" if isinstance(e, FileNotFoundError)
                           else f"{path}: cannot read mapping ({e.strerror or e})") from None
    if not os.path.isfile(path):
        raise MappingError(f"{path}: cannot read mapping (not a file)")
    return int(st.st_size), int(st.st_mtime_ns)


def _read(path: str, format: str) -> LabelMapping:
    """Parse the file now (pyarrow reads it without the GIL)."""
    fm.check_format(format)
    try:
        with pa.OSFile(path) as f:
            return fm.parse_mapping(f, path, format)
    except OSError as e:
        why = "No such file or directory" if isinstance(e, FileNotFoundError) else e.strerror or e
        raise MappingError(f"{path}: cannot read mapping ({why})") from None


def _parse_checked(path: str, stamp: tuple[int, int], format: str) -> LabelMapping:
    """Parse the file; MappingError if it changed meanwhile."""
    m = _read(path, format)
    if _stamp(path) != stamp:
        raise MappingError(f"{path}: the mapping file changed while it was read; run again")
    _stats["parsed"] += 1
    return m


def _open_sidecar(folder: str, path: str, stamp: tuple[int, int], format: str) -> LabelMapping | None:
    """The sidecar in ``folder`` memory-mapped, or None when absent or not this file's."""
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
    return LabelMapping.from_sorted(np.asarray(keys), np.asarray(values))


def _load_via_sidecar(root: str, path: str, stamp: tuple[int, int], format: str) -> LabelMapping | None:
    """The mapping from its sidecar, built first (once per host) if needed, in a child process (a
    parse of 10⁸ rows takes ~3.4 GiB, much not returned to the system) while the host's other
    processes wait on a file lock. None when the cache folder cannot be written."""
    if not _writable(root):
        return None
    _, name = _names(path, stamp, format)
    folder = os.path.join(root, name)
    m = _open_sidecar(folder, path, stamp, format)
    if m is not None:
        return m
    with acquire(os.path.join(root, name + ".lock")):
        m = _open_sidecar(folder, path, stamp, format)  # another process built it while we waited
        if m is not None:
            return m
        _raise_recorded(root, name)
        try:
            r = subprocess.run([sys.executable, "-c", "import sys; from dvidshards.runtime import mappings; "
                                "sys.exit(mappings._child_main(sys.argv[1:]))", root, path, str(stamp[0]),
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
    """Raise the MappingError an earlier parse of this file version left, if any."""
    try:
        with open(os.path.join(root, name + ".error"), encoding="utf-8") as f:
            raise MappingError(f.read())
    except FileNotFoundError:
        pass


def _build(root: str, path: str, stamp: tuple[int, int], format: str) -> LabelMapping:
    """Parse the file here and write its sidecar (or its error): the sidecar's mapping, or the parsed
    one when no sidecar can be written."""
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
    """Delete sidecars of other versions of this file and of files gone or changed, and temporary
    folders of writers dead for a day."""
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


def _after_fork() -> None:  # the parent's lock may have been held by a thread that is not here
    global _lock
    _lock = threading.RLock()


install()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
