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
import os
import random
import re
from typing import Any

import tensorstore as ts

from ..errors import MissingShardError, RemoteReadError, SpecError
from .base import ByteStore, PastEndError, Stat

__all__ = ["KvStore"]

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
_TOTAL_SIZE = re.compile(r"total size ([0-9]+)")



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


def _byte_range(start: int | None, stop: int | None):
    return None if start is None and stop is None else slice(start, stop)


def _expected(start: int | None, stop: int | None) -> int | None:
    if stop is not None:
        return stop - (start or 0)
    if start is not None and start < 0:
        return -start
    return None


# --- the byte source ------------------------------------------------------------------------------


def _normalise_spec(spec) -> dict:
    if isinstance(spec, ts.KvStore.Spec):
        spec = spec.to_json()
    elif isinstance(spec, str):
        try:
            spec = ts.KvStore.Spec(spec).to_json()
        except ValueError as e:
            raise SpecError(f"{spec}: not a TensorStore kvstore URL ({e})") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("driver"), str):
        raise SpecError(f"a kvstore spec must be a dict with a 'driver', got {spec!r}")
    spec = dict(spec)
    path = spec.get("path", "")
    if path and not path.endswith("/"):
        spec["path"] = path + "/"  # the export root is a folder
    try:
        ts.KvStore.Spec(spec)
    except ValueError as e:
        raise SpecError(f"invalid kvstore spec {spec!r}: {e}") from None
    return spec


def _base_url(spec: dict) -> str:
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
    """An export root in any TensorStore kvstore (gs://, s3://, http(s)://, ...).

    Parameters
    ----------
    spec : dict, str or tensorstore.KvStore.Spec
        The kvstore of the export root, e.g. ``{"driver": "s3", "bucket": "b", "path":
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
        Further attempts of a read that failed transiently (5xx, reset, timeout, unreachable
        host) or came back short; then ``RemoteReadError``.
    backoff : float
        First delay between those attempts in seconds, doubled each time (with jitter).

    Notes
    -----
    The methods are coroutines run on the per-process I/O loop (``stores.base.background_loop``);
    the ``*_sync`` twins block and must not be called from that loop.
    The source pickles as its settings (the open kvstore is reopened lazily).
    """

    mappable = False

    def __init__(self, spec, context=None, *, retries: int = 3, backoff: float = 0.1):
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
        self.url = _base_url(self.spec)
        self._kv: Any = None
        self.stats = {"requests": 0, "bytes": 0, "retries": 0}

    @classmethod
    def from_url(cls, url: str, context=None, *, options: dict | None = None, **kwargs) -> KvStore:
        """A source for a kvstore URL: ``gs://bucket/path/``, ``s3://bucket/path/``, ``https://host/path/``.

        Parameters
        ----------
        url : str
            TensorStore kvstore URL of the export root.
        context : tensorstore.Context or dict, optional
            As for the constructor.
        options : dict, optional
            Further members of the kvstore spec, e.g. ``{"endpoint": "http://127.0.0.1:9000",
            "aws_region": "us-east-1"}`` or ``{"requester_pays": True}``.  For ``s3://`` URLs
            without an ``endpoint``, the AWS SDK variables ``AWS_ENDPOINT_URL_S3`` or
            ``AWS_ENDPOINT_URL`` give it when set (TensorStore itself ignores them).
        **kwargs
            ``retries``, ``backoff``: as for the constructor.
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
        return f"KvStore({self.url!r})"

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_kv"] = None
        state["stats"] = {"requests": 0, "bytes": 0, "retries": 0}
        return state

    def describe(self, key: str) -> str:
        return self.url + key

    def _context(self) -> ts.Context:
        if isinstance(self.context, ts.Context):
            return self.context
        driver = self.spec["driver"]
        spec: dict = {}
        if driver in _RETRY_RESOURCE:
            spec[_RETRY_RESOURCE[driver]] = dict(DEFAULT_TS_RETRIES)
            spec[_CONCURRENCY_RESOURCE[driver]] = dict(DEFAULT_CONCURRENCY)
        spec.update(self.context or {})
        return ts.Context(spec)

    async def _kvstore(self):
        kv = self._kv
        if kv is None:
            try:
                kv = await ts.KvStore.open(self.spec, context=self._context())
            except ValueError as e:
                raise RemoteReadError(f"{self.url}: cannot open the kvstore ({e})") from None
            self._kv = kv
        return kv

    def _delay(self, attempt: int) -> float:
        return self.backoff * (2 ** (attempt - 1)) * (1 + 0.25 * random.random())

    def _failure(self, key: str, start, stop, status: str, e: BaseException) -> Exception:
        where = f"{self.describe(key)} {_span(start, stop)}"
        if status == "OUT_OF_RANGE":
            m = _TOTAL_SIZE.search(str(e))
            return PastEndError(f"{where}: past the end of the object ({e})", int(m.group(1)) if m else None)
        if status == "NOT_FOUND":
            return MissingShardError(f"{self.describe(key)}: not found ({e})")
        return RemoteReadError(f"{where}: {e}")

    async def _read(self, key: str, start: int | None, stop: int | None, first=None) -> bytes:
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
            return value
        raise RemoteReadError(f"{self.describe(key)} {_span(start, stop)}: failed after {attempt + 1} "
                              f"attempt{'s' if attempt else ''}: {last}")

    async def read(self, key: str, start: int | None = None, stop: int | None = None) -> bytes:
        """Bytes [start, stop) of key (all of it by default; ``start < 0, stop=None``: the last -start bytes)."""
        return await self._read(key, start, stop)

    async def read_ranges(self, key: str, ranges, *, return_exceptions: bool = False) -> list:
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
        """Whether key exists (a 1-byte read)."""
        try:
            await self._read(key, 0, 1)
        except MissingShardError:
            return False
        except PastEndError:
            return True  # an empty object
        return True

    async def stat(self, key: str) -> Stat:
        """The object's generation (etag) from a 1-byte read; its size is not known cheaply."""
        kv = await self._kvstore()
        try:
            result = await kv.read(key, byte_range=slice(0, 1))
        except (ValueError, OSError) as e:
            raise RemoteReadError(f"{self.describe(key)}: cannot stat ({e})") from None
        if result.state == "missing":
            raise MissingShardError(f"{self.describe(key)}: no such object")
        gen = result.stamp.generation
        return Stat(None, "generation:" + (gen.hex() if isinstance(gen, bytes) else str(gen)))

    async def list(self, prefix: str = "") -> list[str]:
        """Names directly below the folder prefix (lists every key under it)."""
        kv = await self._kvstore()
        p = prefix.strip("/") + "/" if prefix.strip("/") else ""
        rng = ts.KvStore.KeyRange(p, p[:-1] + chr(ord(p[-1]) + 1)) if p else ts.KvStore.KeyRange()
        for attempt in range(self.retries + 1):
            if attempt:
                self.stats["retries"] += 1
                await asyncio.sleep(self._delay(attempt))
            try:
                keys = await kv.list(rng, strip_prefix_length=len(p.encode()))
                break
            except NotImplementedError:
                raise SpecError(f"{self.describe(p)}: this kvstore ({self.spec['driver']}) cannot list folders; "
                                f"give the export's neuroglancer spec (spec=...) or put an 'info' file at its "
                                f"root") from None
            except ValueError as e:
                if self.ts_retries or _status(e) not in _TRANSIENT or attempt == self.retries:
                    raise RemoteReadError(f"{self.describe(p)}: cannot list ({e})") from None
        return sorted({k.decode("utf-8", "replace").split("/", 1)[0] for k in keys} - {""})
