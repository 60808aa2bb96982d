"""The HTTP stack both servers stand on: declared routes, CORS, the error table, admission,
gzip and file ranges, the port, and a background server that starts and stops.

Read with urllib (a client that is not aiohttp). Nothing waits on a sleep: a test that needs a
request in progress waits on an event the handler sets.
"""

from __future__ import annotations

import gzip
import logging
import socket
import threading
import urllib.error
import urllib.request

import pytest

pytest.importorskip("aiohttp")
from aiohttp import web

from dvidshards.errors import NotFoundError, SpecError
from dvidshards.serve.http import Server, application, in_thread, serve


def get(url: str, headers=None, method="GET"):
    """(status, headers, body); HTTP errors are answers too."""
    req = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


class Oops(RuntimeError):
    pass


def make_app(tmp_path=None, **kw):
    routes = web.RouteTableDef()

    @routes.get("/hello/{name}")
    async def hello(request):
        return web.Response(text=f"hello {request.match_info['name']}")

    @routes.get("/missing/{id:[0-9]+}")
    async def missing(request):
        raise NotFoundError(f"body {request.match_info['id']}: not in the export")

    @routes.get("/bad")
    async def bad(request):
        raise SpecError("scale=9: this export holds\n  scales [0, 1]")

    @routes.get("/bug")
    async def bug(request):
        return await in_thread(request, lambda: 1 // 0)

    @routes.get("/oops")
    async def oops(request):
        raise Oops("a bug")

    @routes.get("/big")
    async def big(request):
        return web.Response(body=bytes(range(256)) * 64)

    if tmp_path is not None:
        @routes.get("/file")
        async def file(request):
            return web.FileResponse(tmp_path / "data.bin")

    errors = {NotFoundError: 404, SpecError: 400, Oops: 418}
    return application(routes, errors=errors, logger=logging.getLogger("tests.http"), **kw)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("http")
    (tmp / "data.bin").write_bytes(bytes(range(256)) * 40)
    with serve(make_app(tmp, gzip=True)) as url:
        yield url


def test_declared_routes_answer_and_others_are_404(base):
    assert get(base + "/hello/world")[2] == b"hello world"
    assert get(base + "/nothing")[0] == 404
    assert get(base + "/missing/abc")[0] == 404  # does not match the route's pattern
    assert get(base + "/hello/world", method="POST")[0] == 405


def test_cors_on_every_answer_and_preflight(base):
    for path in ("/hello/x", "/nothing", "/missing/3", "/bug", "/file"):
        assert get(base + path)[1]["Access-Control-Allow-Origin"] == "*", path
    status, headers, body = get(base + "/hello/x", method="OPTIONS", headers={
        "Origin": "http://neuroglancer.example", "Access-Control-Request-Method": "GET",
        "Access-Control-Request-Headers": "range"})
    assert status == 204 and body == b""
    assert headers["Access-Control-Allow-Origin"] == "*"
    assert {"GET", "HEAD"} <= {m.strip() for m in headers["Access-Control-Allow-Methods"].split(",")}
    assert headers["Access-Control-Allow-Headers"] == "range"


def test_error_table_gives_status_and_one_line(base, caplog):
    caplog.set_level(logging.DEBUG, logger="tests.http")
    status, _, body = get(base + "/missing/12")
    assert status == 404 and body == b"NotFoundError: body 12: not in the export\n"
    status, _, body = get(base + "/bad")
    assert status == 400 and body == b"SpecError: scale=9: this export holds scales [0, 1]\n"
    assert get(base + "/oops")[0] == 418  # the table's own status, for a type that is no DvidShardsError
    status, _, body = get(base + "/bug")  # not in the table: 500, logged with its traceback
    assert status == 500 and body.startswith(b"ZeroDivisionError")
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is not None and "/bug" in errors[0].getMessage()
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any(m.startswith("GET /missing/12 404") for m in lines)  # one line per request


def test_gzip_for_clients_that_accept_it(base):
    plain = get(base + "/big")
    assert plain[0] == 200 and "Content-Encoding" not in plain[1]
    zipped = get(base + "/big", headers={"Accept-Encoding": "gzip"})
    assert zipped[1]["Content-Encoding"] == "gzip" and gzip.decompress(zipped[2]) == plain[2]
    assert len(zipped[2]) < len(plain[2])
    head = get(base + "/big", method="HEAD")
    assert head[0] == 200 and head[2] == b"" and int(head[1]["Content-Length"]) == len(plain[2])


def test_file_ranges(base):
    whole = bytes(range(256)) * 40
    status, headers, part = get(base + "/file", {"Range": "bytes=5-99"})
    assert status == 206 and part == whole[5:100] and headers["Content-Range"] == f"bytes 5-99/{len(whole)}"
    assert get(base + "/file", {"Range": "bytes=-10"})[2] == whole[-10:]
    assert get(base + "/file", {"Range": f"bytes={len(whole)}-"})[0] == 416
    assert get(base + "/file")[2] == whole


def test_requests_beyond_the_slots_are_busy_after_the_admit_timeout():
    entered, release = threading.Event(), threading.Event()
    routes = web.RouteTableDef()

    @routes.get("/slow")
    async def slow(request):
        def work():
            entered.set()
            assert release.wait(60)
            return web.Response(text="done")
        return await in_thread(request, work)

    with serve(application(routes, threads=1, admit_timeout=0.2)) as url:
        first: list = []
        th = threading.Thread(target=lambda: first.append(get(url + "/slow")))
        th.start()
        try:
            assert entered.wait(60)
            status, headers, body = get(url + "/slow")
            assert status == 503 and headers["Retry-After"] == "1" and body.startswith(b"Busy")
        finally:
            release.set()
            th.join(60)
        assert first[0][0] == 200 and first[0][2] == b"done"


def test_busy_port_is_one_line_naming_it():
    with Server(make_app()) as srv:
        with pytest.raises(SpecError, match=f"^port {srv.port} on 127.0.0.1 is in use: pick another --port"):
            Server(make_app(), port=srv.port)
    with pytest.raises(SpecError, match="port 70000"):
        Server(make_app(), port=70000)


def test_background_server_starts_and_stops_cleanly():
    before = {t.name for t in threading.enumerate()}
    srv = Server(make_app(), name="test-http")
    assert srv.url == f"http://127.0.0.1:{srv.port}"
    with srv:  # answers as soon as start returns
        assert get(srv.url + "/hello/a")[2] == b"hello a"
        assert get(srv.url + "/bug")[0] == 500  # the pool has a thread now
    srv.close()  # a second close: nothing
    # nothing listens on the port any more (connections in TIME_WAIT may remain) and no thread is left
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", srv.port))
    left = {t.name for t in threading.enumerate()} - before
    assert not [n for n in left if n.startswith(("test-http", "tests.http"))], left


def test_wait_returns_when_closed_from_another_thread():
    srv = Server(make_app())
    srv.start()
    done = threading.Event()
    th = threading.Thread(target=lambda: (srv.wait(), done.set()))
    th.start()
    assert get(srv.url + "/hello/b")[0] == 200
    srv.close()
    th.join(60)
    assert done.is_set()
