"""Arrow Flight for block records: a server for any export or table, and a client source.

``dvidshards serve-flight SOURCE`` (or `serve`) serves the block records of an export's shard
files, a table or another Flight server, the pull design DVID's export was meant to have:

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

`FlightSource` is the client: ``Dataset(FlightSource("grpc://host:port"))`` is a volume like
the shard files.  It loads a shard with one DoGet, and `FlightSource.read_records` fetches a
list of chunks or a box with one DoGet: never one RPC per chunk.
"""

from __future__ import annotations

import hmac
import json
import os
import threading
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as fl

from . import errors as _errors_module
from .errors import DvidShardsError, MissingShardError, RemoteReadError, SpecError
from .formats.multiscale import Scale, parse_multiscale
from .formats.records import RecordTable
from .shard import RecordSource, Shard
from .tables import (
    BATCH_ROWS,
    STREAM_SCHEMA,
    CellLimitError,
    PartialStreamError,
    origins_by_shard_id,
    partition_plan,
    record_spans,
    select_rows,
    shard_ids,
)

__all__ = ["TICKET_VERSION", "ExportFlightServer", "FlightAuthError", "FlightSource", "IngestCommand",
           "add_arguments", "as_record_source", "main", "serve", "tune_malloc"]

TICKET_VERSION = 1
_MAX_CHUNKS = 1 << 20
_SCHEMES = ("grpc://", "grpc+tcp://", "grpc+tls://")


class FlightAuthError(DvidShardsError, PermissionError):
    """The Flight server refused the call: no token, or a wrong one."""


def _error_types() -> dict:
    from .formats.blocks import BlockStreamError

    out = {n: getattr(_errors_module, n) for n in _errors_module.__all__
           if isinstance(getattr(_errors_module, n), type) and issubclass(getattr(_errors_module, n), Exception)}
    for cls in (CellLimitError, PartialStreamError, FlightAuthError, BlockStreamError):
        out[cls.__name__] = cls
    return out


def _server_error(e: BaseException) -> fl.FlightServerError:
    """A Flight error carrying a dvidshards error's type and message."""
    typed = isinstance(e, DvidShardsError)
    name = type(e).__name__ if typed else "RemoteReadError"
    msg = str(e) if typed else f"server error: {type(e).__name__}: {e}"
    info = json.dumps({"type": name, "message": msg}).encode()
    return fl.FlightServerError(f"{name}: {msg}", extra_info=info)


def _client_error(e: BaseException, uri: str) -> BaseException:
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
    """Make glibc's malloc keep the memory a Flight stream frees, for the whole process.

    gRPC receives (and sends) each record batch in buffers from ``malloc``.  With glibc's
    defaults a ~1 MB buffer is mmapped or trimmed back to the system as soon as it is freed,
    so the next batch page-faults every 4 KiB again: on loopback that was half of a Flight
    client's CPU time and capped a bulk scan at ~0.7 GB/s (benchmarks/bench_sources.py).
    This sets ``M_MMAP_THRESHOLD`` (allocations below it come from the heap) and
    ``M_TRIM_THRESHOLD`` (free memory kept at a heap's top) with ``mallopt``.

    The cost: up to ``keep_bytes`` of freed memory per heap stays with the process.  It is a
    process-wide setting, so the library never makes it on its own: ``dvidshards serve-flight``
    and ``dvidshards ingest`` call it (they own their process), and ``FlightSource(...,
    tune_malloc=True)`` does.  Setting ``MALLOC_TRIM_THRESHOLD_`` and ``MALLOC_MMAP_THRESHOLD_``
    in the environment has the same effect.  Returns whether it applied (glibc only; the
    first call's values stay).
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


def _ints(v, n: int, what: str) -> list[int]:
    if not isinstance(v, list) or len(v) != n or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise SpecError(f"ticket: {what} must be a list of {n} integers, got {v!r}")
    return v


def parse_ticket(raw: bytes, scales: dict) -> dict:
    """A checked ticket dict (SpecError naming what is wrong)."""
    try:
        d = json.loads(bytes(raw))
    except ValueError as e:
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
        out["shard"] = tuple(_ints(d["shard"], 3, "shard"))
    if "box" in d:
        b = d["box"]
        if not isinstance(b, list) or len(b) != 2:
            raise SpecError(f"ticket: box must be [[x0, y0, z0], [x1, y1, z1]], got {b!r}")
        lo, hi = _ints(b[0], 3, "box[0]"), _ints(b[1], 3, "box[1]")
        if any(a > z for a, z in zip(lo, hi, strict=True)):
            raise SpecError(f"ticket: box {b} has a negative size")
        out["box"] = (lo, hi)
    if "chunks" in d:
        c = d["chunks"]
        if not isinstance(c, list) or len(c) > _MAX_CHUNKS:
            raise SpecError(f"ticket: chunks must be a list of at most {_MAX_CHUNKS} [x, y, z]")
        out["chunks"] = [_ints(v, 3, "a chunk") for v in c]
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


# --- the server ---------------------------------------------------------------------------------


class _BearerFactory(fl.ServerMiddlewareFactory):
    def __init__(self, token: str):
        super().__init__()
        self._want = f"Bearer {token}".encode()

    def start_call(self, info, headers):
        got = [v.encode() if isinstance(v, str) else bytes(v)
               for k, vs in headers.items() if k.lower() == "authorization" for v in vs]
        if not any(hmac.compare_digest(g, self._want) for g in got):
            raise fl.FlightUnauthenticatedError("a valid bearer token is required (authorization: Bearer ...)")
        return None


def _open_dataset(source, spec=None):
    """A Dataset over an export, a table, a Flight URI or a record source."""
    from .dataset import Dataset
    from .tables import TableSource, read_table_info

    if isinstance(source, Dataset):
        return source
    if isinstance(source, RecordSource):
        return Dataset(source, spec=spec)
    if isinstance(source, str) and source.startswith(_SCHEMES):
        return Dataset(FlightSource(source), spec=spec)
    if isinstance(source, (str, os.PathLike)):
        p = os.fspath(source)
        if os.path.isdir(p) and read_table_info(p) is not None:
            return Dataset(TableSource(p), spec=spec)
        if os.path.isfile(p) or (os.path.isdir(p) and not any(n.startswith("s") and n[1:].isdigit()
                                                             for n in os.listdir(p))):
            return Dataset(TableSource(p, spec=spec))
    if not isinstance(source, (str, os.PathLike, pa.Table)) and hasattr(source, "__arrow_c_stream__"):
        return Dataset(TableSource(source, spec=spec))
    return Dataset(source, spec=spec)


class ExportFlightServer(fl.FlightServerBase):
    """A Flight server of an export's (or table's) block records; see the module docstring.

    Build it with `serve`.  ``location`` is the URI clients connect to.
    """

    def __init__(self, source, *, host: str = "127.0.0.1", port: int = 0, spec=None, token: str | None = None,
                 tls: tuple | None = None, batch_rows: int = BATCH_ROWS, check: bool = True):
        self.ds = _open_dataset(source, spec)
        if self.ds.spec is None:
            raise SpecError(f"{self.ds.store.describe('')}: serving needs the export's spec (spec=...)")
        self.scales = {s.index: s for s in self.ds.scales}
        self.batch_rows = int(batch_rows)
        self.check = check
        scheme = "grpc+tls" if tls else "grpc+tcp"
        kwargs: dict[str, Any] = {}
        if tls:
            cert, key = (_pem(v) for v in tls)
            kwargs["tls_certificates"] = [fl.CertKeyPair(cert, key)]
        if token:
            kwargs["middleware"] = {"auth": _BearerFactory(token)}
        super().__init__(f"{scheme}://{host}:{int(port)}", **kwargs)
        self.host = host
        self.location = f"{'grpc+tls' if tls else 'grpc'}://{host}:{self.port}"
        self._thread: threading.Thread | None = None
        self._plans: dict = {}

    # --- helpers ---------------------------------------------------------------------------

    def _scale(self, k) -> Scale:
        try:
            return self.scales[k]
        except KeyError:
            raise SpecError(f"scale {k!r} does not exist; scales are {sorted(self.scales)}") from None

    def _origins(self, s: Scale) -> list[tuple]:
        return [tuple(o) for o in self.ds.shards(s.index)]

    def _shard(self, s: Scale, origin) -> Shard:
        return self.ds.reader(s.index).cache.get_sync(tuple(origin))

    def _by_id(self, s: Scale) -> dict:
        p = self._plans.get(s.index)
        if p is None:
            p = self._plans[s.index] = origins_by_shard_id(s, self._origins(s))
        return p

    def _endpoints(self, s: Scale, box=None) -> list:
        out = []
        by_first = sorted(self._origins(s), key=lambda o: (int(shard_ids(s, o)[0]) if len(shard_ids(s, o)) else -1,
                                                            o))
        for o in by_first:
            if box is not None:
                lo, hi = s.shard_box(o)
                cs = np.asarray(s.chunk_size)
                blo, bhi = np.asarray(box[0]) // cs, -(-np.asarray(box[1]) // cs)
                if ((hi <= blo) | (lo >= bhi)).any():
                    continue
            t = {"v": TICKET_VERSION, "scale": s.index, "shard": list(o)}
            out.append(fl.FlightEndpoint(json.dumps(t).encode(), [fl.Location(self._client_location())]))
        return out

    def _client_location(self) -> str:
        return self.location.replace("grpc://", "grpc+tcp://", 1)

    def _descriptor_scale(self, descriptor) -> tuple[Scale, dict]:
        if descriptor.descriptor_type == fl.DescriptorType.PATH:
            path = [p.decode() if isinstance(p, bytes) else p for p in descriptor.path]
            if len(path) != 1 or not path[0].startswith("s") or not path[0][1:].isdigit():
                raise SpecError(f"descriptor path must be ['s<k>'], got {path}")
            return self._scale(int(path[0][1:])), {}
        try:
            d = json.loads(bytes(descriptor.command))
        except ValueError as e:
            raise SpecError(f"descriptor command is not JSON ({e})") from None
        if not isinstance(d, dict) or d.get("v") != TICKET_VERSION:
            raise SpecError(f"descriptor command must be {{'v': {TICKET_VERSION}, 'scale': k}}")
        return self._scale(d.get("scale")), d

    # --- Flight methods ----------------------------------------------------------------------

    def get_flight_info(self, context, descriptor):
        try:
            s, d = self._descriptor_scale(descriptor)
            box = d.get("box")
            if box is not None:
                box = (_ints(box[0], 3, "box[0]"), _ints(box[1], 3, "box[1]"))
            return fl.FlightInfo(STREAM_SCHEMA, descriptor, self._endpoints(s, box), -1, -1)
        except Exception as e:  # noqa: BLE001 - every error goes to the client typed
            raise _server_error(e) from None

    def list_flights(self, context, criteria):
        for s in self.ds.scales:
            d = fl.FlightDescriptor.for_command(json.dumps({"v": TICKET_VERSION, "scale": s.index}))
            yield fl.FlightInfo(STREAM_SCHEMA, d, self._endpoints(s), -1, -1)

    def list_actions(self, context):
        return [("spec", "the neuroglancer multiscale spec of the served records (JSON)"),
                ("ping", "an empty answer")]

    def do_action(self, context, action):
        if action.type == "spec":
            return [json.dumps(self.ds.spec).encode()]
        if action.type == "ping":
            return [b"{}"]
        raise _server_error(SpecError(f"unknown action {action.type!r}; actions are spec, ping"))

    def do_get(self, context, ticket):
        try:
            t = parse_ticket(ticket.ticket, self.scales)
        except Exception as e:  # noqa: BLE001
            raise _server_error(e) from None
        s = self.scales[t["scale"]]
        cols = t.get("columns")
        schema = STREAM_SCHEMA if cols is None else pa.schema([STREAM_SCHEMA.field(c) for c in cols])
        return fl.GeneratorStream(schema, self._generate(s, t, schema))

    def _plan(self, s: Scale, t: dict) -> list[tuple]:
        """(shard ids or None, origin) in stream order."""
        if "partition" in t:
            return [([sid], o) for sid, o in partition_plan(self._by_id(s), t["partition"], t["of"], t["skip"])]
        if "shard" in t:
            o = t["shard"]
            if not s.is_origin(o):
                raise MissingShardError(f"{self.ds.store.describe(s.stem(o))}: origin {o} is not on the shard grid")
            return [(None, o)]
        origins = self._origins(s)
        if "box" in t or "chunks" in t:
            cs = np.asarray(s.chunk_size, np.int64)
            want = set()
            if "chunks" in t:
                want |= {s.shard_origin(*c) for c in t["chunks"]}
            if "box" in t:
                lo, hi = (np.asarray(v, np.int64) for v in t["box"])
                c0, c1 = lo // cs, -(-hi // cs)
                want |= {o for o in origins if not ((s.shard_box(o)[1] <= c0) | (s.shard_box(o)[0] >= c1)).any()}
            origins = [o for o in origins if o in want]
        return [(None, o) for o in sorted(origins, key=lambda o: (int(min(shard_ids(s, o), default=-1)), o))]

    def _spans(self, s: Scale, t: dict):
        """(batches, meta) of the ticket's records, a gathered span at a time, in stream order."""
        for only, origin in self._plan(s, t):
            shard = self._shard(s, origin)
            rows = select_rows(shard, s, t.get("box"), t.get("chunks"))
            yield from record_spans(shard.table(), s, origin, rows=rows, only=only, batch_rows=t["batch_rows"],
                                    columns=t.get("columns"), check=self.check)

    def _generate(self, s: Scale, t: dict, schema: pa.Schema):
        shards = records = 0
        try:
            # the next span is built on another thread (the gather runs without the GIL) while
            # Arrow's C++ stream sends this one
            for batches, meta in _ahead(self._spans(s, t)):
                records += sum(b.num_rows for b in batches)
                # a reader is drained by Arrow's C++ stream without coming back to Python:
                # per batch, only the one carrying app metadata passes through here
                last = [(batches.pop(), pa.py_buffer(json.dumps(meta).encode()))] if meta else []
                if batches:
                    yield pa.RecordBatchReader.from_batches(schema, batches)
                if meta:
                    shards += 1
                    yield last[0]
            done = {"done": True, "shards": shards, "records": records}
            yield pa.RecordBatch.from_pylist([], schema=schema), pa.py_buffer(json.dumps(done).encode())
        except Exception as e:  # noqa: BLE001 - typed to the client, mid-stream
            raise _server_error(e) from None

    # --- life ----------------------------------------------------------------------------

    def start(self) -> ExportFlightServer:
        """Serve on a daemon thread (the server already listens)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self.serve, name="dvidshards-flight", daemon=True)
            self._thread.start()
        return self

    def __enter__(self) -> ExportFlightServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _ahead(items, depth: int = 1):
    """Iterate ``items`` on a thread of its own, ``depth`` items ahead of the caller.

    An exception in ``items`` is raised here, in order; when the caller stops early (a client
    that hung up closes the generator), the thread stops at its next item.
    """
    import queue

    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    end = object()

    def run():
        try:
            for x in items:
                while not stop.is_set():
                    try:
                        q.put(x, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(end)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            q.put(e)

    th = threading.Thread(target=run, name="dvidshards-flight-ahead", daemon=True)
    th.start()
    try:
        while True:
            x = q.get()
            if x is end:
                return
            if isinstance(x, BaseException):
                raise x
            yield x
    finally:
        stop.set()


def _pem(v) -> bytes:
    if isinstance(v, (bytes, bytearray)):
        return bytes(v)
    with open(os.fspath(v), "rb") as f:
        return f.read()


def serve(source, *, host: str = "127.0.0.1", port: int = 0, spec=None, token: str | None = None,
          tls: tuple | None = None, batch_rows: int = BATCH_ROWS, check: bool = True) -> ExportFlightServer:
    """Start a Flight server of an export's block records (returns at once; it serves on a thread).

    Parameters
    ----------
    source : path, URL, Dataset, table or Flight URI
        An export (with ``spec=`` when it has no info file), a table (``dvidshards ingest``
        output, Parquet, Arrow), or a record source.
    host, port : str, int
        Where to listen; port 0 picks a free port (``server.location`` says which).
    spec : dict or path, optional
        The export's neuroglancer multiscale spec.
    token : str, optional
        Require ``authorization: Bearer <token>`` on every call.
    tls : (cert, key), optional
        PEM bytes or paths: serve ``grpc+tls://``.
    batch_rows : int
        Default records per batch (a ticket may ask for others).
    check : bool
        Check each payload's zstd frame header against its uncompressed_size before sending.

    Returns
    -------
    ExportFlightServer
        ``.location`` (``grpc://HOST:PORT``), ``.shutdown()``; a context manager.
    """
    return ExportFlightServer(source, host=host, port=port, spec=spec, token=token, tls=tls,
                              batch_rows=batch_rows, check=check).start()


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
        if not isinstance(uri, str) or not uri.startswith(_SCHEMES):
            raise SpecError(f"a Flight URI must start with one of {_SCHEMES}, got {uri!r}")
        if tune_malloc:
            _tune_malloc()
        self.uri = uri
        self.token = token
        self.tls_root_certs = _pem(tls_root_certs) if tls_root_certs is not None else None
        self.timeout = timeout
        self.disable_server_verification = disable_server_verification
        self._client: fl.FlightClient | None = None
        self._pid: int | None = None
        self._lock = threading.Lock()
        self.spec = self._spec()
        self.scales = {s.index: s for s in parse_multiscale(self.spec, uri)}

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
            raise _client_error(e, self.uri) from None
        return json.loads(bytes(res[0].body))

    def stream(self, ticket: dict):
        """(batch, meta dict) of one DoGet, ending with the ``done`` marker; typed errors.

        Raises `PartialStreamError` when the stream ends without its done marker or with
        fewer records than it announced.
        """
        raw = json.dumps({"v": TICKET_VERSION, **ticket}).encode()
        try:
            reader = self.client.do_get(fl.Ticket(raw), self._options())
        except fl.FlightError as e:
            raise _client_error(e, self.uri) from None
        got = 0
        while True:
            try:
                chunk = reader.read_chunk()
            except StopIteration:
                raise PartialStreamError(f"{self.uri}: the stream ended without its done marker after {got} "
                                         f"records (ticket {ticket})") from None
            except fl.FlightError as e:
                raise _client_error(e, self.uri) from None
            except pa.ArrowException as e:
                raise RemoteReadError(f"{self.uri}: the stream broke after {got} records ({e})") from None
            meta = json.loads(bytes(chunk.app_metadata)) if chunk.app_metadata is not None else {}
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
        from .tables import normalise_records

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

    def describe(self, key: str) -> str:
        return f"{self.uri}/{key}" if key else self.uri

    def shard_origins(self, scale: Scale) -> list[tuple[int, int, int]]:
        d = fl.FlightDescriptor.for_command(json.dumps({"v": TICKET_VERSION, "scale": scale.index}))
        try:
            info = self.client.get_flight_info(d, self._options())
        except fl.FlightError as e:
            raise _client_error(e, self.uri) from None
        return sorted(tuple(json.loads(bytes(ep.ticket.ticket))["shard"]) for ep in info.endpoints)

    async def exists(self, key: str) -> bool:
        import re

        m = re.match(r"^s(\d+)/(\d+)_(\d+)_(\d+)\.arrow$", key)
        if not m:
            return False
        k, *o = (int(g) for g in m.groups())
        return k in self.scales and tuple(o) in set(self.shard_origins(self.scales[k]))

    async def load_shard(self, scale: Scale, origin) -> Shard:
        o = tuple(int(v) for v in origin)
        table = self._records({"scale": scale.index, "shard": list(o)}, self.describe(scale.stem(o)), scale)
        return Shard.from_records(self, table, scale, o)


# --- any record source -----------------------------------------------------------------------


def as_record_source(source, *, spec=None, scale: int = 0, **kwargs) -> RecordSource:
    """The RecordSource for a Flight URI (``grpc://host:port``), a table or an Arrow stream.

    ``kwargs`` go to `FlightSource` (token, tls_root_certs, timeout).  An export of shard files
    is not a record source (open it with ``Dataset``): SpecError.
    """
    from .tables import TableSource, read_table_info

    if isinstance(source, RecordSource):
        return source
    if isinstance(source, str) and source.startswith(_SCHEMES):
        return FlightSource(source, **kwargs)
    if isinstance(source, (str, os.PathLike)):
        p = os.fspath(source)
        if os.path.isdir(p) and read_table_info(p) is None and any(
                f.endswith(".arrow") for n in os.listdir(p) if n.startswith("s") and n[1:].isdigit()
                and os.path.isdir(os.path.join(p, n)) for f in os.listdir(os.path.join(p, n))):
            raise SpecError(f"{p}: an export of shard files, not a table (open it with Dataset)")
    return TableSource(source, spec=spec, scale=scale)


# --- command line -------------------------------------------------------------------------------


def add_arguments(p) -> None:
    """Arguments of ``dvidshards serve-flight``."""
    p.add_argument("source", help="an export (folder or URL), a table (ingest output, Parquet, Arrow) or grpc://")
    p.add_argument("--spec", help="the neuroglancer multiscale spec given to DVID's export-shards")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="port (default 0: any free port; the URI is printed)")
    p.add_argument("--token", help="require this bearer token (default: $DVIDSHARDS_FLIGHT_TOKEN if set)")
    p.add_argument("--tls-cert", metavar="PEM", help="serve grpc+tls:// with this certificate ...")
    p.add_argument("--tls-key", metavar="PEM", help="... and this private key")
    p.add_argument("--batch-rows", type=int, default=BATCH_ROWS, help=f"records per batch (default {BATCH_ROWS})")


def main(args) -> int:
    """Run ``dvidshards serve-flight``: print the location, then serve until interrupted."""
    import sys

    if bool(args.tls_cert) != bool(args.tls_key):
        raise SpecError("give --tls-cert and --tls-key together")
    if not 0 <= args.port <= 65535 or not 1 <= args.batch_rows <= 1 << 16:
        raise SpecError("--port must be 0..65535 and --batch-rows 1..65536")
    tls = (args.tls_cert, args.tls_key) if args.tls_cert else None
    tune_malloc()  # this process only serves: keep the memory its streams free (see tune_malloc)
    server = serve(args.source, host=args.host, port=args.port, spec=args.spec,
                   token=args.token or os.environ.get("DVIDSHARDS_FLIGHT_TOKEN") or None, tls=tls,
                   batch_rows=args.batch_rows)
    print(server.location, flush=True)
    print(f"serving {server.ds.store.describe('')} (Ctrl-C to stop)", file=sys.stderr, flush=True)
    assert server._thread is not None  # serve() starts the server's thread
    try:
        server._thread.join()
    finally:
        server.shutdown()
    return 0


class IngestCommand:
    """``dvidshards ingest``: a Flight server or an export into a table; /blocks dumps into an export."""

    @staticmethod
    def add_arguments(p) -> None:
        from .tables import CELL_LIMIT, ROW_GROUP

        p.add_argument("source", nargs="+",
                       help="grpc://HOST:PORT (a Flight server), an export folder, or DVID /blocks dump files")
        p.add_argument("--to", required=True, metavar="FOLDER",
                       help="the table folder (from a Flight server or an export), or the export to create "
                            "(from /blocks dumps)")
        p.add_argument("--workers", type=int, default=2, metavar="N",
                       help="partitions pulled concurrently (default 2)")
        p.add_argument("--scales", type=int, nargs="+", metavar="K", help="scales to ingest (default: all)")
        p.add_argument("--spec", help="the neuroglancer multiscale spec (an export without info; or the "
                                      "/blocks dumps' volume)")
        p.add_argument("--mapping",
                       help="/blocks dumps: supervoxel -> body mapping file for the agglomerated labels")
        p.add_argument("--compression", default="auto", choices=("auto", "blocks", "gzip", "lz4", "uncompressed"),
                       help="/blocks dumps: what the payloads hold (default: tell by content)")
        p.add_argument("--cell-limit", type=int, default=CELL_LIMIT, metavar="BYTES",
                       help=f"largest table cell; bigger payloads split over bin1..bin4 (default {CELL_LIMIT})")
        p.add_argument("--row-group-size", type=int, default=ROW_GROUP, metavar="ROWS",
                       help=f"rows per Parquet row group (default {ROW_GROUP})")
        p.add_argument("--token", help="Flight bearer token (default: $DVIDSHARDS_FLIGHT_TOKEN)")
        p.add_argument("--tls-root-certs", metavar="PEM", help="root certificate of a grpc+tls:// server")
        p.add_argument("--scheduler", default="threads",
                       help="'threads' (default), 'local:N' (dask LocalCluster) or a scheduler address")

    @staticmethod
    def main(args) -> int:
        """Run ``dvidshards ingest``; 0 on success, 1 when a partition failed."""
        from .tables import ingest, ingest_blocks

        srcs = args.source
        remote = [s for s in srcs if s.startswith(_SCHEMES)]
        if remote or (len(srcs) == 1 and os.path.isdir(srcs[0])):
            if len(srcs) != 1:
                raise SpecError("give one Flight server or export")
            if args.mapping:
                raise SpecError("--mapping applies to /blocks dumps only")
            if args.workers < 1 or args.cell_limit < 1 or args.row_group_size < 1:
                raise SpecError("--workers, --cell-limit and --row-group-size must be positive")
            source = srcs[0]
            if remote:
                source = FlightSource(source, token=args.token or os.environ.get("DVIDSHARDS_FLIGHT_TOKEN") or None,
                                      tls_root_certs=args.tls_root_certs, tune_malloc=True)
            report = ingest(source, args.to, workers=args.workers, scales=args.scales, cell_limit=args.cell_limit,
                            row_group_size=args.row_group_size, spec=args.spec,
                            scheduler=None if args.scheduler == "threads" else args.scheduler)
            print(report.summary())
            return 0 if report.ok else 1
        for s in srcs:
            if not os.path.isfile(s):
                raise SpecError(f"{s}: no such file (nor a grpc:// URI or export folder)")
        out = ingest_blocks(srcs, args.to, mapping=args.mapping, spec=args.spec, compression=args.compression)
        print(f"{out['ingest']['records']} blocks in {out['ingest']['shards']} shards -> {args.to}")
        return 0
