"""Record sources: block records that come as tables, Arrow streams, Flight or VastDB.

Beside ``dvidshards.stores`` (bytes of shard files), one layer below the shard loader: each
source gives a shard's records as a ``RecordTable``, and ``Dataset(source)`` reads them like
shard files.

* ``TableSource`` (``sources.tablesource``) - a table written by ``dvidshards ingest``, Parquet
  or Arrow files, a ``pyarrow.Table`` or any Arrow stream (``sources.tables``: their format).
* ``FlightSource`` (``sources.flight``) - a ``dvidshards serve-flight`` server.
* ``VastDBSource`` (``sources.vastdb``) - a VastDB table.
"""

from __future__ import annotations

import builtins
import os

from ..errors import SpecError
from .base import RecordSource

__all__ = ["FlightSource", "RecordSource", "TableSource", "VastDBSource", "as_record_source", "record_source_of"]

_FLIGHT = ("grpc://", "grpc+tcp://", "grpc+tls://")
_LAZY = {"TableSource": "tablesource", "FlightSource": "flight", "VastDBSource": "vastdb"}


def __getattr__(name: str):
    # the sources import pyarrow.flight and numba kernels: only when asked for
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def record_source_of(source, spec=None) -> RecordSource | None:
    """The record source ``source`` names (a Flight URI, a table file or folder, an Arrow
    stream), or None when it is an export of shard files (or a store)."""
    if isinstance(source, RecordSource):
        return source
    table = hasattr(source, "__arrow_c_stream__")
    if isinstance(source, str) and source.startswith(_FLIGHT):
        table = True
    elif isinstance(source, (str, os.PathLike)):
        p = os.fspath(source)
        if os.path.isfile(p) and p.endswith((".parquet", ".arrow", ".feather", ".ipc")):
            table = True
        elif os.path.isfile(os.path.join(p, "info")):
            try:
                with builtins.open(os.path.join(p, "info"), "rb") as f:
                    table = b'"dvidshards_table"' in f.read()
            except OSError:
                table = False
    return as_record_source(source, spec=spec) if table else None


def as_record_source(source, *, spec=None, scale: int = 0, **kwargs) -> RecordSource:
    """The RecordSource for a Flight URI (``grpc://host:port``), a table or an Arrow stream.

    ``kwargs`` go to `FlightSource` (token, tls_root_certs, timeout).  An export of shard files
    is not a record source (open it with ``Dataset``): SpecError.
    """
    from .tables import read_table_info
    from .tablesource import TableSource

    if isinstance(source, RecordSource):
        return source
    if isinstance(source, str) and source.startswith(_FLIGHT):
        from .flight import FlightSource

        return FlightSource(source, **kwargs)
    if isinstance(source, (str, os.PathLike)):
        p = os.fspath(source)
        if os.path.isdir(p) and read_table_info(p) is None and any(
                f.endswith(".arrow") for n in os.listdir(p) if n.startswith("s") and n[1:].isascii() and n[1:].isdigit()
                and os.path.isdir(os.path.join(p, n)) for f in os.listdir(os.path.join(p, n))):
            raise SpecError(f"{p}: an export of shard files, not a table (open it with Dataset)")
    return TableSource(source, spec=spec, scale=scale)
