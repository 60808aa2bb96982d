"""Stores: one interface for reading and writing files under a root, over local folders,
TensorStore kvstores (gs://, s3://, http(s):// read-only, any kvstore spec) and memory.

``as_store`` is the one parser of what a user names (a path, a URL, a kvstore spec dict, a
store). Opened for reading (the default), a store refuses writes; ``writable=True`` is for a
job's output and refuses, in one line and before anything is touched, what cannot be written:
an http(s) URL or another scheme, a URL with a slash missing (``gs:/bucket``), no bucket.
"""

from __future__ import annotations

import os
import re
from typing import Any

from ..errors import OutputError, SpecError
from .base import (
    ByteStore,
    PastEndError,
    ReadOnlyError,
    Stat,
    background_loop,
    decode_pool,
    drive,
    is_temporary,
    os_error,
    run_sync,
)
from .local import LocalStore
from .memory import MemoryStore

__all__ = ["ByteStore", "LocalStore", "MemoryStore", "PastEndError", "ReadOnlyError", "Stat", "as_store",
           "background_loop", "decode_pool", "drive", "is_temporary", "os_error", "run_sync"]

_WRITABLE_SCHEMES = ("gs", "s3", "memory")
_WRITABLE_DRIVERS = ("gcs", "s3", "memory", "file")
_S3_OPTIONS = ("endpoint_override", "scheme", "region")


def as_store(source: Any, *, writable: bool = False, what: str | None = None) -> ByteStore:
    """The store a user named: a local folder, ``file://``, ``gs://``, ``s3://`` (options
    ``?endpoint_override=host:port&scheme=http&region=r``; ``AWS_ENDPOINT_URL_S3`` or
    ``AWS_ENDPOINT_URL`` when no endpoint is given), ``http(s)://`` (read-only), ``memory://NAME/``
    (this process's store of that name), a TensorStore kvstore spec dict, or a store (as it is).

    Parameters
    ----------
    writable : bool
        False (default): an existing export, opened read-only (SpecError when it cannot be). True:
        where a job writes (made as needed); OutputError for what no job can write to.
    what : str, optional
        What the location is, for messages (``destination``, ``work folder``).
    """
    if isinstance(source, ByteStore):
        return source
    error = OutputError if writable else SpecError
    name = what or ("destination" if writable else "export")
    if isinstance(source, dict):
        return _of_spec(dict(source), writable, name)
    try:
        text = os.fspath(source)
    except TypeError:
        raise error(f"cannot open {type(source).__name__} as {'a ' + name if writable else 'an export'} "
                    f"(give a path, URL or kvstore spec)") from None
    if not text:
        raise error(f"{name} is empty")
    if text.startswith("file://"):
        text = text[len("file://"):]
    elif (m := re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://", text)) is not None:
        return _of_url(text, m.group(1).lower(), writable, name)
    else:
        first = text.replace("\\", "/").split("/", 1)[0]
        if re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]+:", first):
            raise error(f"{name} {text!r} looks like a URL with a slash missing ({first}//...); give "
                        f"{first}//bucket/path or a local path")
    if writable:
        return LocalStore(os.path.abspath(os.path.expanduser(text)))
    if not os.path.isdir(text):
        if not os.path.exists(text):
            raise SpecError(f"{text}: no such folder (an export is a folder holding s0, s1, ...)")
        raise SpecError(f"{text}: is a file, not a folder (an export is a folder holding s0, s1, ...)")
    return LocalStore(text, read_only=True)


def _of_spec(spec: dict[str, Any], writable: bool, name: str) -> ByteStore:
    from .kvstore import KvStore

    driver = spec.get("driver")
    if driver == "file":
        path = os.path.abspath(spec.get("path", ""))
        return LocalStore(path, read_only=not writable)
    if writable and driver not in _WRITABLE_DRIVERS:
        raise OutputError(f"{name}: a job writes to a local folder, gcs, s3 or memory, not the {driver!r} "
                          f"kvstore driver")
    return KvStore(spec, read_only=not writable)


def _of_url(text: str, scheme: str, writable: bool, name: str) -> ByteStore:
    from .kvstore import KvStore

    error = OutputError if writable else SpecError
    if writable and scheme not in _WRITABLE_SCHEMES:
        raise OutputError(f"{name} {text}: a job writes to a local folder, gs://, s3:// or memory://, "
                          f"not {scheme}://")
    if scheme == "memory":
        where = text[len("memory://"):].split("?", 1)[0]
        label, _, prefix = where.partition("/")
        if not label:
            raise error(f"{name} {text}: give memory://NAME/path")
        return MemoryStore.named(label, prefix, read_only=not writable)
    base, _, query = text.partition("?")
    if scheme != "s3":
        base = text if not writable else base
        if query and writable:
            raise OutputError(f"{name} {text}: only s3:// URLs take options after '?'")
    options: dict[str, Any] = {}
    if scheme == "s3" and query:
        opts = dict(p.partition("=")[::2] for p in query.split("&") if p)
        unknown = sorted(set(opts) - set(_S3_OPTIONS))
        if unknown:
            raise error(f"{name} {text}: unknown option {unknown[0]!r} ({', '.join(_S3_OPTIONS)})")
        if "endpoint_override" in opts:
            options["endpoint"] = f"{opts.get('scheme', 'https')}://{opts['endpoint_override']}"
        if "region" in opts:
            options["aws_region"] = opts["region"]
    try:
        kv = KvStore.from_url(base, options=options, read_only=not writable)
    except SpecError as e:
        if not writable:
            raise
        raise OutputError(f"{name} {text}: not a storage URL ({' '.join(str(e).split())[:200]})") from None
    if kv.spec.get("driver") in ("gcs", "s3") and not kv.spec.get("bucket"):
        raise error(f"{name} {text}: no bucket named")
    return kv
