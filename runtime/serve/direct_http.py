"""The HTTP door served by the Ingress replica itself (``http.direct``), not through Ray Serve's HTTP proxy.

Through Serve's proxy every request crosses one more process: the proxy parses it, hands it to the replica in a Ray
actor call and streams the answer back the same way. On 2 CPUs that hop costs about 8 ms per request (a caption of
64 tokens takes about 200 ms with speculation, a one-word answer about 60 ms), and CPU the decode loop needs. With
``http.direct`` the Ingress replica listens on ``http.host:http.port`` itself: a uvicorn server in the replica's
event loop runs the same ``HttpApi`` (routes, auth, admission, metrics and errors are those of Serve's path), and
``specula serve`` starts Serve without a proxy (``proxy_location`` Disabled: Ray Serve still runs, places and
health-checks the replica). It needs one Ingress replica per port, so it is decided with the placement
(``launch.py``).

What Serve's proxy did besides routing is done here: the application's ``route_prefix`` (``root_path``, as Serve
sets it; other paths are 404), and a client that disconnects before its answer is ready cancels the handler, so
the generation stops and its KV cache is freed. A streamed answer is cancelled by Starlette's own disconnect watch.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import time
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from specula.runtime.serve.errors import error_body

log = logging.getLogger(__name__)
Handler = Callable[[Request], Awaitable[Response]]

# A replica that Serve restarts may start while its predecessor still holds the port: keep trying this long.
BIND_WAIT_S = 30.0


class DirectHttp:
    """A uvicorn server over ``handler`` on a socket bound at construction, serving as a task of the running loop."""

    def __init__(self, handler: Handler, host: str, port: int, route_prefix: str = "/",
                 bind_wait_s: float = BIND_WAIT_S) -> None:
        import uvicorn

        self.sock = bind(host, port, bind_wait_s)
        app = asgi_app(handler, route_prefix)
        self.server = uvicorn.Server(uvicorn.Config(app, lifespan="off", access_log=False, log_level="warning",
                                                    log_config=None, timeout_keep_alive=90))
        self.server.capture_signals = contextlib.nullcontext  # signals are the replica process's (Ray's), never
        #                                                          uvicorn's, even on a loop in the main thread
        self.task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[self.sock]))
        self.task.add_done_callback(_log_failure)

    def close(self) -> None:
        """End the server: uvicorn stops accepting, closes the socket and lets open responses finish."""
        self.server.should_exit = True


def free_port() -> int:
    """A TCP port free on loopback now (for a listener started next: another process may take it meanwhile)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bind(host: str, port: int, wait_s: float = BIND_WAIT_S) -> socket.socket:
    """A listening TCP socket on host:port; while the port is taken, retry for ``wait_s`` seconds, then raise
    ``OSError`` naming the address and the config fields that set it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    deadline = time.monotonic() + wait_s
    while True:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT connections of a predecessor
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # accepted sockets inherit it: no Nagle wait
        try:
            sock.bind((host, port))
            sock.listen(2048)
            sock.setblocking(False)
            return sock
        except OSError as e:
            sock.close()
            if e.errno != errno.EADDRINUSE or time.monotonic() >= deadline:
                raise OSError(e.errno, f"http.direct: cannot listen on {host}:{port} ({e.strerror}); set http.port "
                                       "(specula serve --port) to a free port or http.direct: false") from None
            time.sleep(0.25)


def asgi_app(handler: Handler, route_prefix: str = "/"):
    """The ASGI app of the direct door: ``handler`` (``HttpApi.__call__``) for HTTP requests under ``route_prefix``.

    The handler reads the body itself (``HttpApi`` bounds it by ``max_request_bytes``); once the body is in, the
    connection is watched while the handler runs, and a disconnect cancels it. Only then does the response take
    over the connection (a ``StreamingResponse`` watches for the disconnect itself)."""
    root = route_prefix.rstrip("/")

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":  # no lifespan, no websockets
            return
        path = scope.get("path", "/")
        if root and not (path == root or path.startswith(root + "/")):
            body = error_body(f"no route {path} (the application is under {root}/)", 404, code="not_found")
            await JSONResponse(body, status_code=404)(scope, receive, send)
            return
        scope = {**scope, "root_path": root}  # what Serve's proxy hands a replica: _path() strips it
        watched = _Watched(receive)
        task = asyncio.ensure_future(handler(Request(scope, watched)))
        watch = asyncio.ensure_future(watched.watch())
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the server is stopping
            task.cancel()
            raise
        finally:
            watch.cancel()
        if not task.done():  # the client left before its answer: stop the generation, free its KV cache
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return
        await task.result()(scope, receive, send)

    return app


class _Watched:
    """``receive`` for the handler's Request, and the disconnect watch that takes the connection over once the
    body is in: the handler reads the body messages as they come; asked again after them, it waits for the
    disconnect the watch sees (as a Starlette request over Serve's proxy would)."""

    def __init__(self, receive) -> None:
        self.receive = receive
        self.body_done = asyncio.Event()
        self.disconnected = asyncio.Event()

    async def __call__(self) -> dict:
        if self.body_done.is_set():
            await self.disconnected.wait()
            return {"type": "http.disconnect"}
        message = await self.receive()
        if message["type"] == "http.disconnect":
            self.disconnected.set()
            self.body_done.set()
        elif not message.get("more_body", False):
            self.body_done.set()
        return message

    async def watch(self) -> None:
        """Returns when the client disconnects (after its body was read)."""
        await self.body_done.wait()
        while not self.disconnected.is_set():
            if (await self.receive())["type"] == "http.disconnect":
                self.disconnected.set()


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the direct HTTP door stopped: %r", task.exception())
