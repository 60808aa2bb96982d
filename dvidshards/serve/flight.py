"""Arrow Flight, the server side: ``dvidshards serve-flight`` and `serve`.

The protocol (descriptors, tickets, batches, errors, auth) is described in
``dvidshards.sources.flight``, whose ``FlightSource`` is the client.
"""

from __future__ import annotations

import errno
import hmac
import itertools
import json
import os
import threading
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as fl

from ..dataset import Dataset
from ..errors import MissingShardError, SpecError
from ..formats.multiscale import SINGLE_SHARD, Scale
from ..formats.records import RecordTable
from ..shard import Shard
from ..sources.base import RecordSource
from ..sources.flight import (
    SCHEMES,
    TICKET_VERSION,
    FlightSource,
    ints,
    parse_ticket,
    read_pem,
    server_error,
    tune_malloc,
)
from ..sources.tables import (
    BATCH_ROWS,
    STREAM_SCHEMA,
    origins_by_shard_id,
    partition_plan,
    read_table_info,
    record_spans,
    select_rows,
    shard_ids,
)
from ..sources.tablesource import TableSource

__all__ = ["FlightCommand", "ExportFlightServer", "add_arguments", "main", "serve"]

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


def _bind_error(host: str, port: int) -> OSError | None:
    """Why host:port cannot be listened on (port in use, address not here), as an OSError naming
    them, or None when a socket binds there (port 0 always binds)."""
    import socket

    if not port:
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as b:
        return OSError(errno.EADDRNOTAVAIL, f"cannot serve on {host}:{port}: {b.strerror or b}")
    for family, kind, proto, _, addr in infos[:1]:
        try:
            with socket.socket(family, kind, proto) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC: a port in TIME_WAIT is free
                s.bind(addr)
        except OSError as b:
            hint = (f" (another program listens on port {port}: give another --port, or 0 for any free port)"
                    if b.errno == errno.EADDRINUSE else "")
            return OSError(b.errno, f"cannot serve on {host}:{port}: {b.strerror}{hint}")
    return None


def _open_dataset(source, spec=None):
    """A Dataset over an export, a table, a Flight URI or a record source."""
    if isinstance(source, Dataset):
        return source
    if isinstance(source, RecordSource):
        return Dataset(source, spec=spec)
    if isinstance(source, str) and source.startswith(SCHEMES):
        return Dataset(FlightSource(source), spec=spec)
    if isinstance(source, (str, os.PathLike)):
        p = os.fspath(source)
        if os.path.isdir(p) and read_table_info(p) is not None:
            return Dataset(TableSource(p), spec=spec)
        if os.path.isfile(p) or (os.path.isdir(p) and not any(n.startswith("s") and n[1:].isascii() and n[1:].isdigit()
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
        # clients read the spec, so they name shards as today's DVID does: a scale whose files DVID
        # named the old way (one cube per scale, FORMATS.md §3a) is served by today's shard grid
        self.scales = {s.index: s.with_naming("current") for s in self.ds.scales}
        self.batch_rows = int(batch_rows)
        self.check = check
        scheme = "grpc+tls" if tls else "grpc+tcp"
        kwargs: dict[str, Any] = {}
        if tls:
            cert, key = (read_pem(v) for v in tls)
            kwargs["tls_certificates"] = [fl.CertKeyPair(cert, key)]
        if token:
            kwargs["middleware"] = {"auth": _BearerFactory(token)}
        busy = _bind_error(host, int(port))  # before gRPC tries (and logs its own lines)
        if busy is not None:
            raise busy
        try:
            super().__init__(f"{scheme}://{host}:{int(port)}", **kwargs)
        except pa.ArrowException as e:  # gRPC says only "Server did not start properly"
            raise _bind_error(host, int(port)) or OSError(
                errno.EIO, f"cannot serve on {host}:{port}: the Flight server did not start ({e})") from None
        self.host = host
        self.location = f"{'grpc+tls' if tls else 'grpc'}://{host}:{self.port}"
        self._done = threading.Event()
        self._plans: dict = {}
        self._old_files: dict[int, set] = {}  # the shard files of scales named the old way

    # --- helpers ---------------------------------------------------------------------------

    def _scale(self, k) -> Scale:
        try:
            return self.scales[k]
        except KeyError:
            raise SpecError(f"scale {k!r} does not exist; scales are {sorted(self.scales)}") from None

    def _origins(self, s: Scale) -> list[tuple]:
        """The shard origins served at a scale, on today's grid (``s``: a scale of ``self.scales``)."""
        files = [tuple(int(v) for v in o) for o in self.ds.shards(s.index)]
        f = self.ds.scale(s.index)
        if f.naming == s.naming:
            return files
        cells = set()  # today's shard cells the old files' boxes meet, inside the grid
        e = min(s.shard_extent, SINGLE_SHARD) // s.chunk_size[0]
        grid = np.asarray(s.grid, np.int64)
        for o in files:
            lo, hi = f.shard_box(o)
            hi = np.minimum(hi, grid)
            if (hi <= lo).any():
                continue
            rng = [range(int(a) // e, (int(b) - 1) // e + 1) for a, b in zip(lo, hi, strict=True)]
            cells |= {tuple(int(c) * e * n for c, n in zip(cell, s.chunk_size, strict=True))
                      for cell in itertools.product(*rng)}
        return sorted(cells)

    def _shard(self, s: Scale, origin) -> Shard:
        """The shard served at an origin of ``s``'s grid: the export's shard file, or, where DVID named
        the files the old way, the records of every file meeting that shard's box."""
        o = tuple(int(v) for v in origin)
        f = self.ds.scale(s.index)
        reader = self.ds.reader(s.index)
        if f.naming == s.naming:
            return reader.cache.get_sync(o)
        lo, hi = s.shard_box(o)
        hi = np.minimum(hi, np.asarray(s.grid, np.int64))
        e = min(f.shard_extent, SINGLE_SHARD) // f.chunk_size[0]
        files = self._old_files.get(s.index)
        if files is None:
            files = self._old_files[s.index] = {tuple(int(v) for v in p) for p in self.ds.shards(s.index)}
        rng = [range(int(a) // e, (int(b) - 1) // e + 1) for a, b in zip(lo, hi, strict=True)]
        parts = []
        for cell in itertools.product(*rng):
            fo = tuple(int(c) * e * n for c, n in zip(cell, f.chunk_size, strict=True))
            if fo not in files:
                continue
            shard = reader.cache.get_sync(fo)
            c = shard.coords
            inside = np.flatnonzero(((c >= lo) & (c < hi)).all(axis=1))
            if len(inside):
                parts.append(shard.table(inside))
        if not parts:
            raise MissingShardError(f"{self.ds.store.describe(s.stem(o) + '.arrow')}: no shard file holds a chunk "
                                    f"of this shard")
        table = RecordTable.concat(parts, self.ds.store.describe(s.stem(o)), s.chunk_size)
        return Shard.from_records(self.ds.store, table, s, o)

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
            if len(path) != 1 or not path[0].startswith("s") or not path[0][1:].isascii() \
                    or not path[0][1:].isdigit():
                raise SpecError(f"descriptor path must be ['s<k>'], got {path}")
            return self._scale(int(path[0][1:])), {}
        try:
            d = json.loads(bytes(descriptor.command))
        except (ValueError, RecursionError) as e:
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
                box = (ints(box[0], 3, "box[0]"), ints(box[1], 3, "box[1]"))
            return fl.FlightInfo(STREAM_SCHEMA, descriptor, self._endpoints(s, box), -1, -1)
        except Exception as e:  # noqa: BLE001 - every error goes to the client typed
            raise server_error(e) from None

    def list_flights(self, context, criteria):
        for s in self.ds.scales:
            if not self.ds.files(s).folder:  # a scale the export lacks: asking for it is the SpecError
                continue
            d = fl.FlightDescriptor.for_command(json.dumps({"v": TICKET_VERSION, "scale": s.index}))
            yield fl.FlightInfo(STREAM_SCHEMA, d, self._endpoints(s), -1, -1)

    def list_actions(self, context):
        return [("spec", "the neuroglancer multiscale spec of the served records (JSON)"),
                ("exported", "the scales the source holds (JSON list); the spec's others are not exported"),
                ("ping", "an empty answer")]

    def do_action(self, context, action):
        if action.type == "spec":
            return [json.dumps(self.ds.spec).encode()]
        if action.type == "exported":
            return [json.dumps(list(self.ds.exported)).encode()]
        if action.type == "ping":
            return [b"{}"]
        raise server_error(SpecError(f"unknown action {action.type!r}; actions are spec, exported, ping"))

    def do_get(self, context, ticket):
        try:
            t = parse_ticket(ticket.ticket, self.scales)
        except Exception as e:  # noqa: BLE001
            raise server_error(e) from None
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
            raise server_error(e) from None

    # --- life ----------------------------------------------------------------------------

    # gRPC serves on its own threads from the moment the server is built. Flight's blocking
    # ``serve()`` is not called: on its way out it shuts down whichever server of the process
    # called ``serve()`` last, so a server started while another was stopping could stop
    # listening at once (a client then got "connection refused"; seen under load, reproduced
    # with pyarrow alone).

    def start(self) -> ExportFlightServer:
        """The server (it listens and serves from its construction on); for ``with serve(...)``."""
        return self

    def wait(self) -> None:
        """Block until `shutdown` (Ctrl-C raises KeyboardInterrupt here)."""
        while not self._done.wait(3600):
            pass

    def shutdown(self) -> None:
        """Stop serving: the calls in flight end, the port is released."""
        super().shutdown()
        self._done.set()

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


def serve(source, *, host: str = "127.0.0.1", port: int = 0, spec=None, token: str | None = None,
          tls: tuple | None = None, batch_rows: int = BATCH_ROWS, check: bool = True) -> ExportFlightServer:
    """Start a Flight server of an export's block records (returns at once; it serves on gRPC's threads).

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
    try:
        server.wait()
    finally:
        server.shutdown()
    return 0


class FlightCommand:
    """``dvidshards serve-flight``: one row of ``cli.COMMANDS``."""

    add_arguments = staticmethod(add_arguments)
    main = staticmethod(main)
