"""The one HTTP stack of dvidshards' servers (``view``, ``serve-dvid``), on aiohttp.

`application` gives declared routes CORS on every answer (and preflight ``OPTIONS``), one text
line per failure with the status of the server's error table, gzip by aiohttp, and a bounded pool
for blocking work (`in_thread`, `admitted`; `Busy` is 503). `Server` binds its port at
once (0: any free one; a busy port is one `SpecError` line) and serves on its own thread until
`Server.close`, or until Ctrl-C (`Server.wait`). aiohttp is optional (extras ``view``, ``serve``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import DvidShardsError, SpecError

try:
    from aiohttp import web
except ImportError:  # pragma: no cover - the extras install it
    raise SpecError("the servers need aiohttp: pip install 'dvidshards[serve]'") from None

__all__ = ["Busy", "ErrorTable", "Server", "admitted", "application", "in_thread", "serve"]

log = logging.getLogger(__name__)

T = TypeVar("T")
ErrorTable = Mapping[type[BaseException], int]
"""Exception type -> HTTP status; an exception takes the status of its most specific listed type."""


class Busy(Exception):
    """No slot for the request freed within the admit timeout (answered 503, Retry-After: 1)."""


@dataclass
class _Work:
    pool: concurrent.futures.ThreadPoolExecutor
    slots: asyncio.Semaphore
    admit_timeout: float | None
    errors: ErrorTable
    logger: logging.Logger
    gzip: bool


_WORK = web.AppKey("dvidshards.work", _Work)


def application(routes: Iterable[web.AbstractRouteDef], *, errors: ErrorTable | None = None,
                logger: logging.Logger = log, threads: int = 2, in_flight: int | None = None,
                admit_timeout: float | None = None, gzip: bool = False,
                client_max_size: int = 1 << 20) -> web.Application:
    """An aiohttp application of declared routes, with CORS, the error table and a worker pool.

    Parameters
    ----------
    routes : iterable of route definitions
        An aiohttp ``RouteTableDef`` or a list of ``web.get(path, handler)`` rows.
    errors : {exception type: status}, optional
        How a handler's exception is answered (unlisted: 500).
    logger : logging.Logger
        Where failed requests (status >= 500) and the debug line of each request go.
    threads : int
        Threads of the pool blocking work runs on (`in_thread`).
    in_flight : int, optional
        Requests admitted at a time (`admitted`; default ``threads``); the others wait.
    admit_timeout : float, optional
        Seconds a request waits for a slot before it is answered `Busy` (default: no limit).
    gzip : bool
        gzip ``Response`` bodies over 256 bytes with status 200 to clients that accept it.
    client_max_size : int
        Largest request body in bytes.
    """
    if int(threads) < 1:
        raise SpecError(f"threads must be at least 1, got {threads}")
    n = int(threads if in_flight is None else in_flight)
    if n < 1:
        raise SpecError(f"in_flight must be at least 1, got {in_flight}")
    work = _Work(concurrent.futures.ThreadPoolExecutor(int(threads), thread_name_prefix=f"{logger.name}-work"),
                 asyncio.Semaphore(n), admit_timeout, dict(errors or {}), logger, bool(gzip))
    app = web.Application(middlewares=[_middleware], client_max_size=int(client_max_size))
    app[_WORK] = work
    app.add_routes(routes)
    app.on_response_prepare.append(_cors)

    async def _stop_pool(app: web.Application) -> None:
        work.pool.shutdown(wait=False, cancel_futures=True)

    app.on_cleanup.append(_stop_pool)
    return app


async def _cors(request: web.Request, response: web.StreamResponse) -> None:
    response.headers.setdefault("Access-Control-Allow-Origin", "*")
    response.headers.setdefault("Access-Control-Expose-Headers", "*")


def _status(e: BaseException, errors: ErrorTable) -> int:
    for t in type(e).__mro__:
        if t in errors:
            return errors[t]
    return 503 if isinstance(e, Busy) else 500


@web.middleware
async def _middleware(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
    work = request.app[_WORK]
    t0 = time.perf_counter()
    status = 500
    try:
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:  # a CORS preflight
            methods = sorted({r.method for r in request.app.router.routes()} - {"*"} | {"OPTIONS"})
            resp: web.StreamResponse = web.Response(status=204, headers={
                "Access-Control-Allow-Methods": ", ".join(methods),
                "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers", "*"),
                "Access-Control-Max-Age": "86400"})
        else:
            try:
                resp = await handler(request)
            except web.HTTPException as e:
                status = e.status
                raise
            except Exception as e:  # noqa: BLE001 - every failure is one answer with the status of the table
                resp = _error(request, e, work)
        if (work.gzip and type(resp) is web.Response and resp.status == 200
                and isinstance(resp.body, bytes | bytearray) and len(resp.body) > 256):
            resp.enable_compression()
        status = resp.status
        return resp
    finally:
        if work.logger.isEnabledFor(logging.DEBUG):
            work.logger.debug("%s %s %d %.1f ms", request.method, request.path_qs, status,
                              1e3 * (time.perf_counter() - t0))


def _error(request: web.Request, e: Exception, work: _Work) -> web.Response:
    status = _status(e, work.errors)
    msg = f"{type(e).__name__}: {' '.join(str(e).split())}"
    if status >= 500 and not isinstance(e, Busy):
        if isinstance(e, DvidShardsError):
            work.logger.error("%s %s: %s", request.method, request.path, msg)
        else:
            work.logger.error("%s %s: %s", request.method, request.path, msg, exc_info=e)
    headers = {"Retry-After": "1"} if isinstance(e, Busy) else None
    return web.Response(status=status, text=msg + "\n", headers=headers)


@contextlib.asynccontextmanager
async def admitted(request: web.Request) -> AsyncIterator[None]:
    """Hold one of the application's ``in_flight`` slots (raises `Busy` after its admit timeout)."""
    work = request.app[_WORK]
    if work.slots.locked():  # (wait_for costs a task: only when the request has to wait)
        try:
            await asyncio.wait_for(work.slots.acquire(), work.admit_timeout)
        except asyncio.TimeoutError:
            raise Busy(f"no request slot freed within {work.admit_timeout:g} s") from None
    else:
        await work.slots.acquire()
    try:
        yield
    finally:
        work.slots.release()


async def in_thread(request: web.Request, fn: Callable[..., T], *args: Any, admit: bool = True) -> T:
    """``fn(*args)`` on the application's pool (in one admitted slot unless ``admit=False``)."""
    loop = asyncio.get_running_loop()
    pool = request.app[_WORK].pool
    if not admit:
        return await loop.run_in_executor(pool, fn, *args)
    async with admitted(request):
        return await loop.run_in_executor(pool, fn, *args)


# --------------------------------------------------------------------------- the server


def _bind(host: str, port: int, *, reuse_port: bool) -> socket.socket:
    """A listening socket on host:port; a port that cannot be had is one SpecError line naming it."""
    if not 0 <= int(port) <= 65535:
        raise SpecError(f"port {port}: give 0..65535 (0: any free port)")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, int(port)))
        sock.listen(256)
    except OSError as e:
        sock.close()
        if e.errno in (errno.EADDRINUSE, errno.EACCES):
            why = "is in use" if e.errno == errno.EADDRINUSE else "is not allowed"
            raise SpecError(f"port {port} on {host or '0.0.0.0'} {why}: pick another --port (0: any free port)") \
                from None
        raise SpecError(f"cannot listen on {host or '0.0.0.0'}:{port} ({e.strerror or e})") from None
    return sock


class Server:
    """An application listening on host:port, served on its own thread and event loop.

    The port is bound when the server is made (``port=0``: any free port; `url` says which);
    `start` serves, `close` stops (answers in flight get a second) and releases the port.
    ``with Server(app) as srv:`` starts and closes it; `wait` blocks until Ctrl-C, then closes.

    Parameters
    ----------
    app : aiohttp.web.Application
        Usually made by `application`.
    host : str
        Address to listen on (``0.0.0.0``: every interface; `url` then names this host).
    port : int
        0: any free port.
    reuse_port : bool
        Let other processes listen on the same port (SO_REUSEPORT): the kernel spreads
        connections over them.
    name : str
        Name of the server's thread.
    """

    def __init__(self, app: web.Application, *, host: str = "127.0.0.1", port: int = 0, reuse_port: bool = False,
                 name: str = "dvidshards-http"):
        self.app = app
        self._sock = _bind(host, port, reuse_port=reuse_port)
        self.host, self.port = host, int(self._sock.getsockname()[1])
        shown = socket.getfqdn() if host in ("", "0.0.0.0", "::") else host
        self.url = f"http://{'[' + shown + ']' if ':' in shown else shown}:{self.port}"
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def start(self) -> Server:
        """Start answering; returns once the server listens."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"{self.name}:{self.port}", daemon=True)
            self._thread.start()
            self._ready.wait()
        if self._error is not None:
            raise self._error
        return self

    def _run(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=1.0)
        try:
            loop.run_until_complete(runner.setup())
            loop.run_until_complete(web.SockSite(runner, self._sock).start())
        except BaseException as e:  # noqa: BLE001 - raised by start()
            self._error = e
            self._sock.close()
        self._ready.set()
        if self._error is None:
            loop.run_forever()
        try:  # the connections, the listening socket and the pool
            loop.run_until_complete(runner.cleanup())
        except Exception:
            log.debug("%s: cleanup", self.name, exc_info=True)
        loop.close()

    def close(self) -> None:
        """Stop answering and release the port and the threads (again: nothing)."""
        loop, thread = self._loop, self._thread
        if thread is None:
            self._sock.close()
            return
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # closed meanwhile
                loop.call_soon_threadsafe(loop.stop)
        if thread is not threading.current_thread():
            thread.join(timeout=30)

    def wait(self, *, ready: str = "", file: Any = None) -> None:
        """Serve until Ctrl-C (or `close` from another thread), then close; ``ready`` is printed to
        ``file`` once a Ctrl-C stops the server cleanly (one before it ends the program as any other)."""
        self.start()
        assert self._thread is not None
        try:
            if ready:
                print(ready, file=file, flush=True)
            self._thread.join()
        except KeyboardInterrupt:  # the way to stop a server: not an error
            pass
        finally:
            self.close()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Server({self.url})"


@contextlib.contextmanager
def serve(app: web.Application, *, host: str = "127.0.0.1", port: int = 0,
          reuse_port: bool = False) -> Iterator[str]:
    """``with serve(app) as url:`` the application served in the background; stopped at the end."""
    with Server(app, host=host, port=port, reuse_port=reuse_port) as srv:
        yield srv.url
