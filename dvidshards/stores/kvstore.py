"""A ByteStore over TensorStore kvstores (gs://, s3://, http(s)://, any kvstore spec).

Credentials, endpoints and request limits are TensorStore's own settings.  Transient failures
(5xx, resets, timeouts, an unreachable host) are retried by one layer, bounded: this store's
(``retries`` attempts more, exponential backoff from ``backoff``), with TensorStore's own
``*_request_retries`` set to none; or, when the caller's context sets TensorStore's retries,
TensorStore's alone.  A value shorter than the range asked for is never returned: it is asked
again (``retries`` times) whatever the context.  A persistent failure raises
``RemoteReadError`` naming the URL, byte range and attempts; a missing object
``MissingShardError``.  With no network at all a read fails after its 1 + ``retries`` attempts
(0.7 s of backoff with the defaults; it took 4 s when both layers retried).  I/O runs on one
asyncio loop thread per process.
"""

from __future__ import annotations

import asyncio
import builtins
import os
import random
import re
import uuid
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import tensorstore as ts

from ..errors import MissingShardError, OutputError, RemoteReadError, SpecError
from .base import ByteStore, PastEndError, Stat, is_temporary

__all__ = ["PROBE_SECONDS", "REMOTE_SECONDS", "KvStore"]

#: seconds a bucket has to answer the check that it can be written (and to open) before a job is refused
PROBE_SECONDS = float(os.environ.get("DVIDSHARDS_PROBE_SECONDS", "30"))
#: seconds one remote write may take (a write of a large output shard included)
REMOTE_SECONDS = float(os.environ.get("DVIDSHARDS_REMOTE_SECONDS", "600"))

# TensorStore's own retry resource per driver: none when this store retries (one layer, not two)
_RETRY_RESOURCE = {"http": "http_request_retries", "s3": "s3_request_retries", "gcs": "gcs_request_retries"}
DEFAULT_TS_RETRIES = {"max_retries": 0, "initial_delay": "100ms", "max_delay": "2s"}
# the store's own request pool: a process that also reads through TensorStore's default context
# (a viewer reading the server that this store feeds) must not starve the store's requests
_CONCURRENCY_RESOURCE = {"http": "http_request_concurrency", "s3": "s3_request_concurrency",
                         "gcs": "gcs_request_concurrency"}
DEFAULT_CONCURRENCY = {"limit": 32}

# TensorStore absl status codes worth another attempt
_TRANSIENT = frozenset({"ABORTED", "UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "INTERNAL",
                        "UNKNOWN", "DATA_LOSS"})
_STATUS = re.compile(r"^\s*([A-Z][A-Z_]{3,}):")
_TOTAL_SIZE = re.compile(r"(?:total size|value of size) ([0-9]+)")



# --- errors ---------------------------------------------------------------------------------------


def _status(e: BaseException) -> str | None:
    """The TensorStore status code of an I/O failure; None for errors that are not I/O."""
    if isinstance(e, TimeoutError):
        return "DEADLINE_EXCEEDED"
    if isinstance(e, ConnectionError):
        return "UNAVAILABLE"
    if isinstance(e, (ValueError, OSError)):
        m = _STATUS.match(str(e))
        return m.group(1) if m else "UNKNOWN"
    return None


def _span(start: int | None, stop: int | None) -> str:
    if start is None and stop is None:
        return "(whole object)"
    if start is not None and start < 0 and stop is None:
        return f"(last {-start} bytes)"
    return f"bytes [{start or 0}, {'end' if stop is None else stop})"


def _byte_range(start: int | None, stop: int | None) -> slice | None:
    return None if start is None and stop is None else slice(start, stop)


def _expected(start: int | None, stop: int | None) -> int | None:
    if stop is not None:
        return stop - (start or 0)
    if start is not None and start < 0:
        return -start
    return None


# --- the byte source ------------------------------------------------------------------------------


def _normalise_spec(spec: Any) -> dict[str, Any]:
    if isinstance(spec, ts.KvStore.Spec):
        spec = spec.to_json()
    elif isinstance(spec, str):
        try:
            spec = ts.KvStore.Spec(spec).to_json()
        except ValueError as e:
            raise SpecError(f"{spec}: not a TensorStore kvstore URL ({e})") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("driver"), str):
        raise SpecError(f"a kvstore spec must be a dict with a 'driver', got {spec!r}")
    out: dict[str, Any] = dict(spec)
    path = out.get("path", "")
    if path and not path.endswith("/"):
        out["path"] = path + "/"  # the export root is a folder
    try:
        ts.KvStore.Spec(out)
    except ValueError as e:
        raise SpecError(f"invalid kvstore spec {out!r}: {e}") from None
    return out


def _base_url(spec: dict[str, Any]) -> str:
    """A URL naming the export root, for messages."""
    d, path = spec["driver"], spec.get("path", "")
    if d == "s3":
        return f"s3://{spec.get('bucket', '')}/{path}"
    if d == "gcs":
        return f"gs://{spec.get('bucket', '')}/{path}"
    if d == "http":
        base = spec.get("base_url", "").split("?", 1)[0].rstrip("/")
        return f"{base}{path}" if path.startswith("/") else f"{base}/{path}"
    try:
        return ts.KvStore.Spec(spec).url
    except (ValueError, NotImplementedError):
        return f"{d}://{path}"


class KvStore(ByteStore):
    """A root in any TensorStore kvstore (gs://, s3://, http(s)://, memory, ...).

    Parameters
    ----------
    spec : dict, str or tensorstore.KvStore.Spec
        The kvstore of the root, e.g. ``{"driver": "s3", "bucket": "b", "path":
        "exports/seg/", "endpoint": "http://127.0.0.1:9000", "aws_region": "us-east-1"}``
        or a URL such as ``"gs://bucket/exports/seg/"``.  Credentials, endpoints and request
        limits are TensorStore's (see its kvstore driver documentation).
    context : tensorstore.Context or dict, optional
        TensorStore context.  When none is given (or a dict without the driver's
        ``*_request_retries`` resource), TensorStore makes one attempt per request
        (``DEFAULT_TS_RETRIES``, instead of its default of 32 retries up to 32 s apart) and
        this store retries.  A context that sets TensorStore's retries (any
        ``tensorstore.Context``, or a dict with the resource) retries transient failures itself,
        and this store then does not retry them again.
    retries : int
        Further attempts of a call that failed transiently (5xx, reset, timeout, unreachable
        host) or of a read that came back short; then ``RemoteReadError`` (reads) or
        ``OutputError`` (writes).
    backoff : float
        First delay between those attempts in seconds, doubled each time (with jitter).
    read_only : bool
        Refuse writes (always for http(s)).

    Notes
    -----
    The methods are coroutines run on the per-process I/O loop (``stores.base.background_loop``);
    the ``*_sync`` twins block and must not be called from that loop.  Writes are whole objects
    (a bucket shows an object whole or not at all); ``create`` and ``replace`` are writes
    conditional on the object's generation.  The store pickles as its settings (the open kvstore
    is reopened lazily).
    """

    mappable = False

    def __init__(self, spec: Any, context: Any = None, *, retries: int = 3, backoff: float = 0.1,
                 read_only: bool = False):
        self.spec = _normalise_spec(spec)
        if context is not None and not isinstance(context, (ts.Context, dict)):
            raise SpecError(f"context must be a tensorstore.Context or a dict, got {type(context).__name__}")
        if int(retries) < 0 or float(backoff) < 0:
            raise SpecError("retries and backoff must be non-negative")
        self.context = context
        # one retry layer for transient failures: TensorStore's when the caller's context sets it
        self.ts_retries = isinstance(context, ts.Context) or (
            isinstance(context, dict) and _RETRY_RESOURCE.get(self.spec["driver"]) in context)
        self.retries = int(retries)
        self.backoff = float(backoff)
        self.read_only = read_only or self.spec["driver"] == "http"
        self.url = _base_url(self.spec)
        self._kv: Any = None
        self.stats = {"requests": 0, "bytes": 0, "retries": 0}

    @classmethod
    def from_url(cls, url: str, context: Any = None, *, options: dict[str, Any] | None = None,
                 **kwargs: Any) -> KvStore:
        """A store for a kvstore URL: ``gs://bucket/path/``, ``s3://bucket/path/``, ``https://host/path/``.

        Parameters
        ----------
        url : str
            TensorStore kvstore URL of the root.
        context : tensorstore.Context or dict, optional
            As for the constructor.
        options : dict, optional
            Further members of the kvstore spec, e.g. ``{"endpoint": "http://127.0.0.1:9000",
            "aws_region": "us-east-1"}`` or ``{"requester_pays": True}``.  For ``s3://`` URLs
            without an ``endpoint``, the AWS SDK variables ``AWS_ENDPOINT_URL_S3`` or
            ``AWS_ENDPOINT_URL`` give it when set (TensorStore itself ignores them).
        **kwargs
            ``retries``, ``backoff``, ``read_only``: as for the constructor.
        """
        try:
            spec = ts.KvStore.Spec(url).to_json()
        except ValueError as e:
            raise SpecError(f"{url}: not a TensorStore kvstore URL ({e})") from None
        spec.update(options or {})
        if spec["driver"] == "s3" and "endpoint" not in spec:
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
            if endpoint:
                spec["endpoint"] = endpoint
        return cls(spec, context, **kwargs)

    def __repr__(self) -> str:
        return f"KvStore({self.url!r}{', read_only=True' if self.read_only else ''})"

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_kv"] = None
        state["stats"] = {"requests": 0, "bytes": 0, "retries": 0}
        return state

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KvStore) and other.spec == self.spec

    def __hash__(self) -> int:
        return hash(self.url)

    def describe(self, key: str) -> str:
        return self.url + key

    def kvstore_spec(self) -> dict[str, Any]:
        return dict(self.spec)

    def child(self, prefix: str) -> KvStore:
        spec = dict(self.spec)
        spec["path"] = spec.get("path", "") + prefix.strip("/") + "/"
        return KvStore(spec, self.context, retries=self.retries, backoff=self.backoff, read_only=self.read_only)

    def _context(self) -> ts.Context:
        if isinstance(self.context, ts.Context):
            return self.context
        driver = self.spec["driver"]
        spec: dict[str, Any] = {}
        if driver in _RETRY_RESOURCE:
            spec[_RETRY_RESOURCE[driver]] = dict(DEFAULT_TS_RETRIES)
            spec[_CONCURRENCY_RESOURCE[driver]] = dict(DEFAULT_CONCURRENCY)
        spec.update(self.context or {})
        return ts.Context(spec)

    async def _kvstore(self) -> Any:
        kv = self._kv
        if kv is None:
            try:
                kv = await asyncio.wait_for(_awaited(ts.KvStore.open(self.spec, context=self._context())),
                                            PROBE_SECONDS)
            except (ValueError, TimeoutError, asyncio.TimeoutError) as e:
                why = "no answer in time (is it reachable from this machine?)" if not isinstance(e, ValueError) \
                    else _one_line(e)
                raise RemoteReadError(f"{self.url}: cannot open the kvstore ({why})") from None
            self._kv = kv
        return kv

    def _delay(self, attempt: int) -> float:
        return float(self.backoff * (2 ** (attempt - 1)) * (1 + 0.25 * random.random()))

    def _failure(self, key: str, start: int | None, stop: int | None, status: str, e: BaseException) -> Exception:
        where = f"{self.describe(key)} {_span(start, stop)}"
        if status == "OUT_OF_RANGE":
            m = _TOTAL_SIZE.search(str(e))
            return PastEndError(f"{where}: past the end of the object ({e})", int(m.group(1)) if m else None)
        if status == "NOT_FOUND":
            return MissingShardError(f"{self.describe(key)}: not found ({e})")
        return RemoteReadError(f"{where}: {e}")

    async def _read(self, key: str, start: int | None, stop: int | None, first: Any = None) -> bytes:
        """One read with retries; ``first`` is an already issued first attempt (a ts.Future)."""
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                self.stats["retries"] += 1
                await asyncio.sleep(self._delay(attempt))
            try:
                if attempt == 0 and first is not None:
                    fut = first
                else:
                    fut = (await self._kvstore()).read(key, byte_range=_byte_range(start, stop))
                self.stats["requests"] += 1
                result = await fut
            except asyncio.CancelledError:
                raise
            except Exception as e:
                status = _status(e)
                if status is None or isinstance(e, RemoteReadError):
                    raise
                if status not in _TRANSIENT:
                    raise self._failure(key, start, stop, status, e) from None
                last = str(e)
                if self.ts_retries:  # TensorStore has retried it already
                    break
                continue
            if result.state == "missing":
                raise MissingShardError(f"{self.describe(key)}: no such object")
            value = result.value
            want = _expected(start, stop)
            if want is not None and len(value) != want:
                last = f"short read: {len(value)} of {want} bytes"
                continue  # never decoded: another attempt
            self.stats["bytes"] += len(value)
            return value  # type: ignore[no-any-return]
        raise RemoteReadError(f"{self.describe(key)} {_span(start, stop)}: failed after {attempt + 1} "
                              f"attempt{'s' if attempt else ''}: {last}")

    async def read(self, key: str, start: int | None = None, stop: int | None = None) -> bytes:
        """Bytes [start, stop) of key (all of it by default; ``start < 0, stop=None``: the last -start bytes)."""
        return await self._read(key, start, stop)

    async def read_ranges(self, key: str, ranges: Iterable[tuple[int, int]], *,
                          return_exceptions: bool = False) -> builtins.list[Any]:
        """Several byte ranges of one object, issued together in one ``ts.Batch``, retried separately."""
        ranges = [(int(a), int(b)) for a, b in ranges]
        if not ranges:
            return []
        kv = await self._kvstore()
        with ts.Batch() as batch:
            futs = [kv.read(key, byte_range=slice(a, b), batch=batch) for a, b in ranges]
        return await asyncio.gather(*(self._read(key, a, b, f) for (a, b), f in zip(ranges, futs, strict=True)),
                                    return_exceptions=return_exceptions)

    async def exists(self, key: str) -> bool:
        """Whether the object key exists (a 1-byte read)."""
        try:
            await self._read(key, 0, 1)
        except MissingShardError:
            return False
        except PastEndError:
            return True  # an empty object
        return True

    async def stat(self, key: str) -> Stat:
        """The object's generation (etag) from a 1-byte read; its size is not known cheaply (``size``)."""
        kv = await self._kvstore()
        try:
            result = await kv.read(key, byte_range=slice(0, 1))
        except (ValueError, OSError) as e:
            raise RemoteReadError(f"{self.describe(key)}: cannot stat ({e})") from None
        if result.state == "missing":
            raise MissingShardError(f"{self.describe(key)}: no such object")
        gen = result.stamp.generation
        return Stat(None, "generation:" + (gen.hex() if isinstance(gen, bytes) else str(gen)))

    async def size(self, key: str) -> int:
        """The object's size: from the answer to a range past its end where the server says it
        there, else by reading it."""
        try:
            await self._read(key, 1 << 62, None)
        except PastEndError as e:
            if e.total_size is not None:
                return e.total_size
        except RemoteReadError:
            pass  # a server that answers otherwise (an emulator): the object is read
        return len(await self._read(key, None, None))

    async def list(self, prefix: str = "") -> builtins.list[str]:
        """Names directly below the folder prefix (lists every key under it)."""
        p = prefix.strip("/") + "/" if prefix.strip("/") else ""
        keys = await self._keys(p)
        names = {k[len(p):].split("/", 1)[0] for k in keys}
        return sorted(n for n in names if n and not is_temporary(n))

    async def list_prefix(self, prefix: str = "") -> builtins.list[str]:
        p = prefix.strip("/") + "/" if prefix.strip("/") else ""
        return sorted(await self._keys(p))

    async def _keys(self, p: str) -> builtins.list[str]:
        rng = ts.KvStore.KeyRange(p, _prefix_end(p)) if p else ts.KvStore.KeyRange()
        try:
            keys = await self._call(p, "list it", lambda kv: kv.list(rng), reading=True)
        except NotImplementedError:
            raise SpecError(f"{self.describe(p)}: this kvstore ({self.spec['driver']}) cannot list folders; "
                            f"give the export's neuroglancer spec (spec=...) or put an 'info' file at its "
                            f"root") from None
        return [k.decode("utf-8", "replace") for k in keys]

    # --- writing --------------------------------------------------------------------------------

    async def _call(self, key: str, doing: str, make: Callable[[Any], Awaitable[Any]], *,
                    reading: bool = False, timeout: float | None = None) -> Any:
        """``make(kvstore)`` awaited, with retries of transient failures, within REMOTE_SECONDS;
        else one OutputError line naming the object (RemoteReadError when ``reading``)."""
        error = RemoteReadError if reading else OutputError
        for attempt in range(self.retries + 1):
            if attempt:
                self.stats["retries"] += 1
                await asyncio.sleep(self._delay(attempt))
            try:
                kv = await self._kvstore()
                return await asyncio.wait_for(_awaited(make(kv)), REMOTE_SECONDS if timeout is None else timeout)
            except asyncio.CancelledError:
                raise
            except (TimeoutError, asyncio.TimeoutError):
                raise error(f"{self.describe(key)}: cannot {doing}: no answer in time (is it reachable from "
                            f"this machine?)") from None
            except RemoteReadError as e:
                raise error(f"{self.describe(key)}: cannot {doing}: {_one_line(e)}") from None
            except Exception as e:
                status = _status(e)
                if status is None:
                    raise
                if status in _TRANSIENT and not self.ts_retries and attempt < self.retries:
                    continue
                raise error(f"{self.describe(key)}: cannot {doing}: {_one_line(e)}") from None
        raise AssertionError("unreachable")

    async def put(self, key: str, data: bytes) -> None:
        self._check_writable(key)
        await self._call(key, "write it", lambda kv: kv.write(key, bytes(data)))

    async def _conditional(self, key: str, data: bytes, expected: bytes | None, doing: str) -> bool:
        """Write key if it holds ``expected`` (None: if it is absent), by generation."""
        self._check_writable(key)
        now = await self._call(key, "read it", lambda kv: kv.read(key))
        held = bytes(now.value) if now.state == "value" else None
        if held != expected:
            return False
        gen = now.stamp.generation
        try:
            stamp = await self._call(key, doing, lambda kv: kv.write(key, bytes(data), if_equal=gen))
        except OutputError:
            # a transient failure may hide a write that was done: ours if the object now holds it
            again = await self._call(key, "read it", lambda kv: kv.read(key))
            if again.state == "value" and bytes(again.value) == bytes(data):
                return True
            raise
        return bool(stamp.generation)

    async def create(self, key: str, data: bytes) -> bool:
        return await self._conditional(key, data, None, "create it")

    async def replace(self, key: str, data: bytes, *, expected: bytes) -> bool:
        return await self._conditional(key, data, bytes(expected), "write it")

    async def delete(self, key: str) -> None:
        self._check_writable(key)
        await self._call(key, "delete it", lambda kv: kv.write(key, None))

    async def delete_prefix(self, prefix: str = "") -> None:
        self._check_writable(prefix)
        p = prefix.strip("/")
        rng = ts.KvStore.KeyRange(p + "/", _prefix_end(p + "/")) if p else ts.KvStore.KeyRange()
        await self._call(prefix, "delete it", lambda kv: kv.delete_range(rng))
        if p:
            await self._call(prefix, "delete it", lambda kv: kv.write(p, None))

    def check_writable(self, *, kind: str = "folder") -> None:
        """A probe object written and deleted within PROBE_SECONDS."""
        self._check_writable("")
        key = f".dvidshards-probe-{uuid.uuid4().hex[:12]}"

        async def probe() -> None:
            await self._call("", "write there", lambda kv: kv.write(key, b"probe"), timeout=PROBE_SECONDS)
            await self._call("", "write there", lambda kv: kv.write(key, None), timeout=PROBE_SECONDS)

        try:
            self._sync(probe())
        except RemoteReadError as e:  # the kvstore could not be opened
            raise OutputError(f"{self.describe('')}: cannot write there: {_one_line(e)}") from None


async def _awaited(fut: Any) -> Any:
    return await fut


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


def _prefix_end(prefix: str) -> str:
    """The first key after every key starting with ``prefix`` ('/' + 1 is '0')."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)
