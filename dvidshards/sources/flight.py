"""Arrow Flight, the client side: ``FlightSource`` and the protocol the server speaks.

``dvidshards serve-flight`` (``dvidshards.serve.flight``) serves the block records of an
export, a table or another Flight server:

* ``get_flight_info`` (descriptor: the JSON command ``{"v": 1, "scale": k}``, or the path
  ``s{k}``) gives one ``FlightEndpoint`` per shard.
* **Tickets** are JSON: ``{"v": 1, "scale": k, "shard": [ox, oy, oz]}`` (one shard, by its
  voxel origin), optionally with ``"box": [[x0, y0, z0], [x1, y1, z1]]`` (voxels) and/or
  ``"chunks": [[x, y, z], ...]`` (without ``"shard"``: every shard they touch),
  ``"columns": [...]`` and ``"batch_rows": n``; or ``{"v": 1, "scale": k, "partition": i,
  "of": N}`` (optionally ``"skip": [shard ids]``): every shard with ``shard_id % N == i``,
  in (shard_id, morton) order.  No shard (nor box, chunks or partition): the whole scale.
* **Batches** carry up to ``batch_rows`` records (256) of one shard id, with ``shard_id``
  and ``morton`` columns.  The last batch of each shard id carries the app metadata
  ``{"shard_id", "origin", "records", "end": true}``; the stream ends with an empty batch
  carrying ``{"done": true, "shards", "records"}``, so a reader tells a complete stream
  from a cut one.
* **Errors** are ``FlightServerError``s whose ``extra_info`` holds ``{"type", "message"}``:
  the client raises the same dvidshards error type with the server's message.
* **Auth**: an optional bearer token (``authorization: Bearer …`` on every call) and TLS.

``Dataset(FlightSource("grpc://host:port"))`` is a volume like the shard files.  It loads a
shard with one DoGet, and `FlightSource.read_records` fetches a list of chunks or a box with
one DoGet: never one RPC per chunk.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as fl

from .. import errors as _errors_module
from ..errors import DvidShardsError, RemoteReadError, SpecError
from ..formats.blocks import BlockStreamError
from ..formats.multiscale import Scale, parse_multiscale
from ..formats.records import RecordTable
from .base import RecordSource
from .tables import BATCH_ROWS, STREAM_SCHEMA, CellLimitError, PartialStreamError, normalise_records

__all__ = ["SCHEMES", "TICKET_VERSION", "FlightAuthError", "FlightSource", "client_error", "parse_ticket",
           "read_pem", "server_error", "tune_malloc"]

TICKET_VERSION = 1
_MAX_CHUNKS = 1 << 20
SCHEMES = ("grpc://", "grpc+tcp://", "grpc+tls://")


class FlightAuthError(DvidShardsError, PermissionError):
    """The Flight server refused the call: no token, or a wrong one."""


def _error_types() -> dict:
    out = {n: getattr(_errors_module, n) for n in _errors_module.__all__
           if isinstance(getattr(_errors_module, n), type) and issubclass(getattr(_errors_module, n), Exception)}
    for cls in (CellLimitError, PartialStreamError, FlightAuthError, BlockStreamError):
        out[cls.__name__] = cls
    return out


def server_error(e: BaseException) -> fl.FlightServerError:
    """A Flight error carrying a dvidshards error's type and message."""
    typed = isinstance(e, DvidShardsError)
    name = type(e).__name__ if typed else "RemoteReadError"
    msg = str(e) if typed else f"server error: {type(e).__name__}: {e}"
    info = json.dumps({"type": name, "message": msg}).encode()
    return fl.FlightServerError(f"{name}: {msg}", extra_info=info)


def client_error(e: BaseException, uri: str) -> BaseException:
    """The dvidshards error a Flight error stands for."""
    info = getattr(e, "extra_info", None)
    if info:
        try:
            d = json.loads(bytes(info))
            cls = _error_types().get(d.get("type"))
            if cls is not None:
                return cls(f"{uri}: {d.get('message')}")
        except (ValueError, TypeError, AttributeError):
            pass
    text = str(e).split(". Detail:")[0].split("\n")[0]
    if isinstance(e, (fl.FlightUnauthenticatedError, fl.FlightUnauthorizedError)):
        return FlightAuthError(f"{uri}: {text}")
    if isinstance(e, fl.FlightUnavailableError):
        return RemoteReadError(f"{uri}: the Flight server is unreachable ({text})")
    if isinstance(e, fl.FlightTimedOutError):
        return RemoteReadError(f"{uri}: the Flight call timed out ({text})")
    return RemoteReadError(f"{uri}: {type(e).__name__}: {text}")


# --- memory ------------------------------------------------------------------------------------

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
_tuned: bool | None = None
_tune_lock = threading.Lock()


def tune_malloc(keep_bytes: int = 256 << 20, mmap_threshold: int = 32 << 20) -> bool:
    """Make glibc's malloc keep the memory a Flight stream frees, for the whole process; whether
    it applied (glibc only; the first call's values stay).

    gRPC receives and sends each record batch in ``malloc`` buffers.  With glibc's defaults a
    ~1 MB buffer is mmapped or trimmed back to the system when freed, so the next batch
    page-faults every 4 KiB again: on loopback half of a Flight client's CPU, a bulk scan capped
    at ~0.7 GB/s (bench_sources).  This sets ``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD`` with
    ``mallopt`` (as ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` in the environment
    would); up to ``keep_bytes`` of freed memory per heap then stays with the process.  Being
    process-wide, the library never makes it on its own: ``serve-flight`` and ``ingest`` call it
    (they own their process), as does ``FlightSource(..., tune_malloc=True)``.
    """
    global _tuned
    with _tune_lock:
        if _tuned is None:
            import ctypes
            import platform

            _tuned = False
            if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
                try:
                    libc = ctypes.CDLL("libc.so.6")
                    _tuned = bool(libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold))) and bool(
                        libc.mallopt(_M_TRIM_THRESHOLD, int(keep_bytes)))
                except (OSError, AttributeError):
                    _tuned = False
        return _tuned


_tune_malloc = tune_malloc  # FlightSource's keyword of the same name hides the function


# --- tickets ------------------------------------------------------------------------------------


def ints(v, n: int, what: str) -> list[int]:
    if not isinstance(v, list) or len(v) != n or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise SpecError(f"ticket: {what} must be a list of {n} integers, got {v!r}")
    return v


def _server_json(raw, uri: str, what: str):
    """JSON a server sent, or RemoteReadError naming what was malformed (never a bare ValueError)."""
    try:
        return json.loads(bytes(raw))
    except (ValueError, RecursionError) as e:
        raise RemoteReadError(f"{uri}: the server sent malformed {what} ({str(e)[:80]})") from None


def parse_ticket(raw: bytes, scales: dict) -> dict:
    """A checked ticket dict (SpecError naming what is wrong)."""
    try:
        d = json.loads(bytes(raw))
    except (ValueError, RecursionError) as e:
        raise SpecError(f"ticket is not JSON ({e})") from None
    if not isinstance(d, dict):
        raise SpecError("ticket must be a JSON object")
    if d.get("v") != TICKET_VERSION:
        raise SpecError(f"ticket version {d.get('v')!r} is not supported (this server speaks {TICKET_VERSION})")
    known = {"v", "scale", "shard", "box", "chunks", "columns", "partition", "of", "skip", "batch_rows"}
    extra = sorted(set(d) - known)
    if extra:
        raise SpecError(f"ticket: unknown keys {extra}")
    k = d.get("scale")
    if not isinstance(k, int) or isinstance(k, bool) or k not in scales:
        raise SpecError(f"ticket: scale {k!r} does not exist; scales are {sorted(scales)}")
    out: dict[str, Any] = {"scale": k}
    if "shard" in d:
        out["shard"] = tuple(ints(d["shard"], 3, "shard"))
    if "box" in d:
        b = d["box"]
        if not isinstance(b, list) or len(b) != 2:
            raise SpecError(f"ticket: box must be [[x0, y0, z0], [x1, y1, z1]], got {b!r}")
        lo, hi = ints(b[0], 3, "box[0]"), ints(b[1], 3, "box[1]")
        if any(a > z for a, z in zip(lo, hi, strict=True)):
            raise SpecError(f"ticket: box {b} has a negative size")
        out["box"] = (lo, hi)
    if "chunks" in d:
        c = d["chunks"]
        if not isinstance(c, list) or len(c) > _MAX_CHUNKS:
            raise SpecError(f"ticket: chunks must be a list of at most {_MAX_CHUNKS} [x, y, z]")
        out["chunks"] = [ints(v, 3, "a chunk") for v in c]
    if "columns" in d:
        cols = d["columns"]
        if not isinstance(cols, list) or not cols or any(c not in STREAM_SCHEMA.names for c in cols) or \
                len(set(cols)) != len(cols):
            raise SpecError(f"ticket: columns must be distinct names among {STREAM_SCHEMA.names}, got {cols!r}")
        out["columns"] = cols
    if ("partition" in d) != ("of" in d):
        raise SpecError("ticket: give partition and of together")
    if "partition" in d:
        i, n = d["partition"], d["of"]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (i, n)) or not 0 <= i < n:
            raise SpecError(f"ticket: partition must satisfy 0 <= partition < of, got {i!r}, {n!r}")
        if any(x in d for x in ("shard", "box", "chunks")):
            raise SpecError("ticket: a partition streams whole shards; no shard, box or chunks with it")
        out["partition"], out["of"] = i, n
        skip = d.get("skip", [])
        if not isinstance(skip, list) or not all(isinstance(v, int) for v in skip):
            raise SpecError("ticket: skip must be a list of shard ids")
        out["skip"] = skip
    elif "skip" in d:
        raise SpecError("ticket: skip applies to partitions only")
    br = d.get("batch_rows", BATCH_ROWS)
    if not isinstance(br, int) or isinstance(br, bool) or not 1 <= br <= 1 << 16:
        raise SpecError(f"ticket: batch_rows must be 1..65536, got {br!r}")
    out["batch_rows"] = br
    return out


def read_pem(v) -> bytes:
    if isinstance(v, (bytes, bytearray)):
        return bytes(v)
    with open(os.fspath(v), "rb") as f:
        return f.read()


# --- the client ---------------------------------------------------------------------------------


class FlightSource(RecordSource):
    """Block records from a Flight server (``dvidshards serve-flight``) as a Dataset source.

    Parameters
    ----------
    uri : str
        ``grpc://host:port`` (or ``grpc+tls://``).
    token : str, optional
        Bearer token.
    tls_root_certs : bytes or path, optional
        The server's root certificate (PEM) for ``grpc+tls://``.
    timeout : float, optional
        Seconds per call.
    tune_malloc : bool
        Call `tune_malloc` (process-wide: glibc keeps the memory freed between record
        batches).  A bulk scan on loopback ran 2x faster with it; off by default because it
        changes the whole process's allocator.
    """

    immediate = True  # calls block the calling thread, like reading a local file
    mappable = False

    def __init__(self, uri: str, *, token: str | None = None, tls_root_certs=None, timeout: float | None = None,
                 disable_server_verification: bool = False, tune_malloc: bool = False):
        if not isinstance(uri, str) or not uri.startswith(SCHEMES):
            raise SpecError(f"a Flight URI must start with one of {SCHEMES}, got {uri!r}")
        if tune_malloc:
            _tune_malloc()
        self.uri = self.name = uri
        self.token = token
        self.tls_root_certs = read_pem(tls_root_certs) if tls_root_certs is not None else None
        self.timeout = timeout
        self.disable_server_verification = disable_server_verification
        self._client: fl.FlightClient | None = None
        self._pid: int | None = None
        self._lock = threading.Lock()
        self.spec = self._spec()
        self.scales = {s.index: s for s in parse_multiscale(self.spec, uri)}
        self.exported = self._exported()

    def __getstate__(self):
        d = self.__dict__.copy()
        d["_client"] = d["_pid"] = d["_lock"] = None
        return d

    def __setstate__(self, d):
        self.__dict__.update(d)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"FlightSource({self.uri!r})"

    # --- calls --------------------------------------------------------------------------------

    @property
    def client(self) -> fl.FlightClient:
        c = self._client
        if c is None or self._pid != os.getpid():
            with self._lock:
                if self._client is None or self._pid != os.getpid():
                    uri = self.uri.replace("grpc://", "grpc+tcp://", 1)
                    kw: dict[str, Any] = {}
                    if self.tls_root_certs is not None:
                        kw["tls_root_certs"] = self.tls_root_certs
                    if self.disable_server_verification:
                        kw["disable_server_verification"] = True
                    self._client = fl.FlightClient(uri, **kw)
                    self._pid = os.getpid()
                c = self._client
        return c

    def _options(self) -> fl.FlightCallOptions:
        headers = [(b"authorization", f"Bearer {self.token}".encode())] if self.token else []
        return fl.FlightCallOptions(headers=headers, timeout=self.timeout)

    def _spec(self) -> dict:
        try:
            res = list(self.client.do_action(fl.Action("spec", b""), self._options()))
        except fl.FlightError as e:
            raise client_error(e, self.uri) from None
        if not res:
            raise RemoteReadError(f"{self.uri}: the server sent no spec")
        d = _server_json(res[0].body, self.uri, "spec")
        if not isinstance(d, dict):
            raise RemoteReadError(f"{self.uri}: the server's spec is not a JSON object")
        return d

    def _exported(self) -> tuple[int, ...]:
        """The scales the server's source holds (a server without the action: every scale of its spec)."""
        try:
            res = list(self.client.do_action(fl.Action("exported", b""), self._options()))
        except fl.FlightServerError as e:
            if "unknown action" in str(e):
                return tuple(sorted(self.scales))
            raise client_error(e, self.uri) from None
        except fl.FlightError as e:
            raise client_error(e, self.uri) from None
        d = _server_json(res[0].body, self.uri, "exported") if res else None
        if not isinstance(d, list) or not all(isinstance(k, int) and k in self.scales for k in d):
            raise RemoteReadError(f"{self.uri}: the server's list of exported scales is not scales of its spec: {d!r}")
        return tuple(sorted(d))

    def stream(self, ticket: dict):
        """(batch, meta dict) of one DoGet, ending with the ``done`` marker; typed errors.

        Raises `PartialStreamError` when the stream ends without its done marker or with
        fewer records than it announced.
        """
        raw = json.dumps({"v": TICKET_VERSION, **ticket}).encode()
        try:
            reader = self.client.do_get(fl.Ticket(raw), self._options())
        except fl.FlightError as e:
            raise client_error(e, self.uri) from None
        got = 0
        while True:
            try:
                chunk = reader.read_chunk()
            except StopIteration:
                raise PartialStreamError(f"{self.uri}: the stream ended without its done marker after {got} "
                                         f"records (ticket {ticket})") from None
            except fl.FlightError as e:
                raise client_error(e, self.uri) from None
            except pa.ArrowException as e:
                raise RemoteReadError(f"{self.uri}: the stream broke after {got} records ({e})") from None
            meta = _server_json(chunk.app_metadata, self.uri, "batch metadata") \
                if chunk.app_metadata is not None else {}
            if not isinstance(meta, dict):
                raise RemoteReadError(f"{self.uri}: the server's batch metadata is not a JSON object")
            batch = chunk.data
            if meta.get("done"):
                if meta.get("records") != got:
                    raise PartialStreamError(f"{self.uri}: received {got} records, the server sent "
                                             f"{meta.get('records')}")
                yield batch, meta
                return
            got += batch.num_rows
            yield batch, meta

    def scan(self, scale: int, *, partition: int | None = None, of: int | None = None, skip=(), box=None,
             chunks=None, columns=None, batch_rows: int = BATCH_ROWS):
        """Stream a scale, a partition of its shards, a box or chunks: (batch, meta) pairs."""
        t: dict = {"scale": int(scale), "batch_rows": int(batch_rows)}
        if partition is not None:
            if of is None:
                raise TypeError("scan: give partition and of together")
            t.update(partition=int(partition), of=int(of), skip=[int(s) for s in skip])
        if box is not None:
            t["box"] = [[int(v) for v in box[0]], [int(v) for v in box[1]]]
        if chunks is not None:
            t["chunks"] = np.asarray(chunks, np.int64).reshape(-1, 3).tolist()
        if columns is not None:
            t["columns"] = list(columns)
        return self.stream(t)

    def _records(self, ticket: dict, where: str, scale: Scale) -> RecordTable:
        batches = [b for b, _ in self.stream(ticket)]
        t = pa.Table.from_batches(batches, schema=STREAM_SCHEMA)
        return normalise_records(t, where, scale)

    def read_records(self, scale, chunks=None, box=None) -> RecordTable:
        """The records of a list of chunks and/or a voxel box, with one DoGet."""
        s = scale if isinstance(scale, Scale) else self.scales[int(scale)]
        t: dict = {"scale": s.index}
        if chunks is not None:
            t["chunks"] = np.asarray(chunks, np.int64).reshape(-1, 3).tolist()
        if box is not None:
            t["box"] = [[int(v) for v in box[0]], [int(v) for v in box[1]]]
        return self._records(t, self.describe(s.folder), s)

    # --- RecordSource ---------------------------------------------------------------------------

    def shard_origins(self, scale: Scale) -> list[tuple[int, int, int]]:
        d = fl.FlightDescriptor.for_command(json.dumps({"v": TICKET_VERSION, "scale": scale.index}))
        try:
            info = self.client.get_flight_info(d, self._options())
        except fl.FlightError as e:
            raise client_error(e, self.uri) from None
        out = []
        for ep in info.endpoints:
            t = _server_json(ep.ticket.ticket, self.uri, "ticket")
            o = t.get("shard") if isinstance(t, dict) else None
            if not (isinstance(o, list) and len(o) == 3 and all(type(v) is int and v >= 0 for v in o)):
                raise RemoteReadError(f"{self.uri}: the server sent a ticket without a shard origin: "
                                      f"{bytes(ep.ticket.ticket)[:80]!r}")
            out.append(tuple(o))
        return sorted(out)

    async def load_records(self, scale: Scale, origin) -> RecordTable:
        o = tuple(int(v) for v in origin)
        return self._records({"scale": scale.index, "shard": list(o)}, self.describe(scale.stem(o)), scale)
