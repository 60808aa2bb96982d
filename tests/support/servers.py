"""Loopback servers for the remote-read tests and benchmark.

``RangeServer`` is a small threaded HTTP server over a local folder that honours ``Range``
requests (206 + ``Content-Range``), counts requests and body bytes, and can inject faults: a
share of 503 responses, dropped connections and truncated bodies (a ``Content-Length`` larger
than what is sent).  ``MotoS3`` runs moto's S3 server on a free loopback port.
"""

from __future__ import annotations

import os
import random
import re
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests.support.waiting import HANG_SECONDS

__all__ = ["FakeGCS", "MotoS3", "RangeServer", "free_port"]

_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are separate writes: avoid 40 ms delayed-ACK stalls
    server: _Server

    def log_message(self, format, *args):  # quiet
        pass

    def do_HEAD(self):
        self._serve(head=True)

    def do_GET(self):
        self._serve(head=False)

    def _serve(self, head: bool) -> None:
        srv = self.server.owner
        rel = self.path.split("?", 1)[0].lstrip("/")
        fault = srv._draw()
        srv._count(rel, self.headers.get("Range"), fault)
        if srv.latency:
            time.sleep(srv.latency)
        if fault == "503":
            body = b"injected failure\n"
            self.send_response(503)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if fault == "drop":
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        path = srv.root / rel
        if not rel or ".." in Path(rel).parts or not path.is_file():
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        size = path.stat().st_size
        start, stop, status = 0, size, 200
        rng = self.headers.get("Range")
        if rng:
            m = _RANGE.match(rng.strip())
            if m is None or (not m.group(1) and not m.group(2)):
                self._unsatisfiable(size)
                return
            if m.group(1):
                start = int(m.group(1))
                stop = min(size, int(m.group(2)) + 1) if m.group(2) else size
            else:  # suffix
                start = max(0, size - int(m.group(2)))
            if start >= size or stop <= start:
                self._unsatisfiable(size)
                return
            status = 206
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read(stop - start)
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{size}")
        self.end_headers()
        if head:
            return
        if fault == "truncate" and len(data) > 1:
            data = data[: len(data) // 2]
            self.close_connection = True
        srv._sent(len(data))  # counted before the client can see it
        self.wfile.write(data)

    def _unsatisfiable(self, size: int) -> None:
        self.send_response(416)
        self.send_header("Content-Range", f"bytes */{size}")
        self.send_header("Content-Length", "0")
        self.end_headers()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    owner: RangeServer

    def handle_error(self, request, client_address):  # clients hanging up are expected here
        pass


class RangeServer:
    """A threaded HTTP server on 127.0.0.1 serving ``root``, with Range support and faults.

    Parameters
    ----------
    root : path
        Folder served at ``/``.
    fail : float
        Share of requests answered with 503.
    drop : float
        Share of requests whose connection is closed without a response.
    truncate : float
        Share of requests whose body is cut in half (Content-Length announces all of it).
    seed : int
        Seed of the fault draws.
    latency : float
        Seconds each request waits before its answer (to mimic a distant server).
    """

    def __init__(self, root, *, fail: float = 0.0, drop: float = 0.0, truncate: float = 0.0, seed: int = 0,
                 latency: float = 0.0):
        self.root = Path(root)
        self.latency = float(latency)
        self.fail, self.drop, self.truncate = float(fail), float(drop), float(truncate)
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.requests: Counter = Counter()  # per path
        self.ranges: list[tuple[str, str | None]] = []
        self.faults: Counter = Counter()
        self.bytes_sent = 0
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Base URL, ending in ``/``."""
        if self._httpd is None:
            raise RuntimeError("RangeServer is not running; call start() first")
        host, port = self._httpd.server_address[:2]
        assert isinstance(host, str)  # an AF_INET address: (str host, port)
        return f"http://{host}:{port}/"

    @property
    def total_requests(self) -> int:
        """Requests received (all paths, faults included)."""
        return sum(self.requests.values())

    def set_faults(self, *, fail: float = 0.0, drop: float = 0.0, truncate: float = 0.0) -> None:
        """Change the fault shares."""
        with self._lock:
            self.fail, self.drop, self.truncate = float(fail), float(drop), float(truncate)

    def reset_counts(self) -> None:
        """Zero the request, fault and byte counters."""
        with self._lock:
            self.requests.clear()
            self.faults.clear()
            self.ranges.clear()
            self.bytes_sent = 0

    def _draw(self) -> str | None:
        with self._lock:
            u = self._rng.random()
        if u < self.fail:
            return "503"
        if u < self.fail + self.drop:
            return "drop"
        if u < self.fail + self.drop + self.truncate:
            return "truncate"
        return None

    def _count(self, path: str, rng: str | None, fault: str | None) -> None:
        with self._lock:
            self.requests[path] += 1
            self.ranges.append((path, rng))
            if fault:
                self.faults[fault] += 1

    def _sent(self, n: int) -> None:
        with self._lock:
            self.bytes_sent += n

    def start(self) -> RangeServer:
        """Start serving on a free loopback port."""
        self._httpd = _Server(("127.0.0.1", 0), _Handler)
        self._httpd.owner = self
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="RangeServer", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            assert self._thread is not None  # start() sets both
            self._thread.join(5)
            self._httpd = None

    def __enter__(self) -> RangeServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class _LoopbackServer:
    """A server on 127.0.0.1 that sets environment variables while it runs (restored at stop);
    a context manager. Subclasses start ``self._server`` in ``start`` and call ``_set_env``."""

    def __init__(self):
        self._server = None
        self.port: int | None = None
        self._env: dict[str, str | None] = {}

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _set_env(self, values: dict[str, str]) -> None:
        for k, v in values.items():
            self._env.setdefault(k, os.environ.get(k))
            os.environ[k] = v

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
        for k, v in self._env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        self._env.clear()

    def start(self):
        raise NotImplementedError

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class MotoS3(_LoopbackServer):
    """moto's S3 server on 127.0.0.1 (any credentials accepted), with upload helpers.

    Sets dummy ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` (and region) in the environment
    while running, since TensorStore's s3 driver signs every request.
    """

    REGION = "us-east-1"

    def start(self) -> MotoS3:
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)

        self._set_env({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": self.REGION, "AWS_REGION": self.REGION})
        self.port = free_port()
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
        return self

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=self.REGION,
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def upload_dir(self, bucket: str, local, prefix: str) -> None:
        """Create the bucket if needed and upload every file under ``local`` to ``prefix``."""
        c = self.bucket(bucket)
        local = Path(local)
        for p in sorted(local.rglob("*")):
            if p.is_file():
                c.put_object(Bucket=bucket, Key=prefix + p.relative_to(local).as_posix(), Body=p.read_bytes())

    def bucket(self, bucket: str):
        """A client, after creating the bucket if needed."""
        c = self.client()
        try:
            c.create_bucket(Bucket=bucket)
        except (c.exceptions.BucketAlreadyOwnedByYou, c.exceptions.BucketAlreadyExists):
            pass
        return c

    def upload(self, bucket: str, key: str, data: bytes) -> None:
        """Put one object (creating the bucket if needed)."""
        self.bucket(bucket).put_object(Bucket=bucket, Key=key, Body=data)

    def spec(self, bucket: str, path: str) -> dict:
        """TensorStore kvstore spec of ``s3://bucket/path`` on this server."""
        return {"driver": "s3", "bucket": bucket, "path": path, "endpoint": self.endpoint,
                "aws_region": self.REGION}


def _patch_emulator() -> None:
    """Teach the emulator three things real GCS does and TensorStore uses: ``objects.list`` with
    ``startOffset``/``endOffset`` (TensorStore lists a key range with them, and the emulator would
    return the whole bucket), suffix byte ranges (``Range: bytes=-N``, the footer read of a shard
    without a CSV index), and the ``x-goog-generation`` header of a download (what TensorStore's
    conditional writes compare). Patched once per process."""
    import json
    from http import HTTPStatus

    from gcp_storage_emulator import server
    from gcp_storage_emulator.handlers import objects

    if getattr(objects, "_dvidshards_patched", False):
        return
    list_objects, download_object = objects.ls, objects.download

    def ls(request, response, storage, *args, **kwargs):
        list_objects(request, response, storage, *args, **kwargs)
        lo, hi = (request.query.get(k, [None])[0] for k in ("startOffset", "endOffset"))
        if (lo or hi) and response.status == HTTPStatus.OK:
            body = json.loads(response._content)
            body["items"] = [o for o in body.get("items", []) if (not lo or o["name"] >= lo)
                             and (not hi or o["name"] < hi)]
            response.json(body)

    def download(request, response, storage, *args, **kwargs):
        suffix = re.fullmatch(r"\s*bytes=-(\d+)\s*", request.get_header("range", "") or "")
        if suffix:
            try:
                size = len(storage.get_file(request.params["bucket_name"], request.params["object_id"]))
            except Exception:  # noqa: BLE001 - the handler answers 404 itself
                size = None
            if size is not None:
                headers = request._request_handler.headers
                del headers["range"]
                headers["Range"] = f"bytes={max(0, size - int(suffix[1]))}-"
        download_object(request, response, storage, *args, **kwargs)
        if response.status in (HTTPStatus.OK, HTTPStatus.PARTIAL_CONTENT):
            try:
                obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
            except Exception:  # noqa: BLE001 - answered already
                return
            response["x-goog-generation"] = str(obj["generation"])  # what conditional writes compare
            response["x-goog-metageneration"] = str(obj.get("metageneration", 1))

    for _, handlers in server.HANDLERS:
        for fn, patched in ((list_objects, ls), (download_object, download)):
            if handlers.get(server.GET) is fn:
                handlers[server.GET] = patched
    objects.download = download  # objects.get (``alt=media``) calls it by name
    objects._dvidshards_patched = True


def _threaded_run(api) -> None:
    """The emulator's API thread, serving each connection on a thread of its own: its one-thread
    server stalls when a client holds a response open while it sends another request (TensorStore
    and pyarrow both read in parallel)."""
    from functools import partial

    from gcp_storage_emulator.server import RequestHandler

    api._httpd = ThreadingHTTPServer((api._host, api._port), partial(RequestHandler, api._storage))
    api._httpd.daemon_threads = True
    api.is_running.set()
    api._httpd.serve_forever()


class FakeGCS(_LoopbackServer):
    """A Google Cloud Storage emulator (``gcp-storage-emulator``, in memory) on 127.0.0.1.

    TensorStore's gcs driver takes its endpoint from the environment, not from its spec: while
    running, this sets ``TENSORSTORE_GCS_HTTP_URL`` (read each time a gcs kvstore is opened, and
    inherited by processes started meanwhile) and ``GOOGLE_AUTH_TOKEN_FOR_TESTING`` (no search
    for credentials). So ``gs://bucket/path`` URLs and ``{"driver": "gcs"}`` specs reach it as they
    are. (pyarrow's GCS file system, which work folders use, does not work with it: its reads of
    an open file stall.)
    """

    def start(self) -> FakeGCS:
        import logging

        from gcp_storage_emulator.server import create_server

        logging.getLogger("gcp_storage_emulator").setLevel(logging.CRITICAL)  # a 404 is an answer here
        _patch_emulator()
        self.port = free_port()
        self._server = create_server("127.0.0.1", self.port, in_memory=True)
        self._server._api.run = _threaded_run.__get__(self._server._api)
        self._server.start()
        self._set_env({"TENSORSTORE_GCS_HTTP_URL": self.endpoint, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "testing"})
        return self

    def _call(self, method: str, route: str, body: dict | None = None):
        import json
        import urllib.request

        req = urllib.request.Request(f"{self.endpoint}/storage/v1/{route}", method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=HANG_SECONDS) as r:
            return json.loads(r.read() or b"{}")

    def bucket(self, bucket: str) -> None:
        """Create the bucket unless it exists (GCS bucket names have at least 3 characters)."""
        import urllib.error

        try:
            self._call("POST", "b?project=test", {"name": bucket})
        except urllib.error.HTTPError as e:
            if e.code != 409:  # already there
                raise

    def upload(self, bucket: str, key: str, data: bytes) -> None:
        """Put one object (creating the bucket if needed)."""
        import tensorstore as ts

        self.bucket(bucket)
        ts.KvStore.open({"driver": "gcs", "bucket": bucket}).result().write(key, data).result()

    def upload_dir(self, bucket: str, local, prefix: str) -> None:
        """Create the bucket if needed and upload every file under ``local`` to ``prefix``."""
        import tensorstore as ts

        self.bucket(bucket)
        kv = ts.KvStore.open({"driver": "gcs", "bucket": bucket}).result()
        local = Path(local)
        for p in sorted(local.rglob("*")):
            if p.is_file():
                kv.write(prefix + p.relative_to(local).as_posix(), p.read_bytes()).result()

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        """The object names under ``prefix``, sorted."""
        import tensorstore as ts

        kv = ts.KvStore.open({"driver": "gcs", "bucket": bucket}).result()
        return sorted(k.decode() for k in kv.list(ts.KvStore.KeyRange(prefix, prefix + "\xff") if prefix else
                                                  ts.KvStore.KeyRange()).result())

    def spec(self, bucket: str, path: str) -> dict:
        """TensorStore kvstore spec of ``gs://bucket/path`` (the endpoint is in the environment)."""
        return {"driver": "gcs", "bucket": bucket, "path": path}
