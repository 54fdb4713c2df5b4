"""Serving the app with gevent's ``pywsgi`` (no monkey-patching).

``make_server`` builds the ``WSGIServer`` (connection cap through ``spawn=Pool(n)``,
TCP_NODELAY on every accepted socket, the client socket exposed to the app for disconnect
detection). ``graceful_shutdown`` is the drain that SIGTERM runs (``--shutdown-timeout``).
``BackgroundServer`` runs one on its own native thread with its own hub, for tests,
benchmarks and embedding; it is stopped (with the same drain) from any thread through an
async watcher.
"""
from __future__ import annotations

import logging
import socket as _stdsocket
import threading
import time
from typing import Optional

import gevent
import gevent.socket
from gevent.event import Event
from gevent.pool import Pool
from gevent.pywsgi import WSGIHandler, WSGIServer

from .app import SOCKET_ENVIRON_KEY

logger = logging.getLogger(__name__)

DEFAULT_MAX_CONCURRENT_STREAMS = 1024
DEFAULT_SHUTDOWN_TIMEOUT = 0.0  # vLLM's default: requests in flight are cut at once
_BACKLOG = 2048
_CUT_GRACE_S = 5.0  # after the drain: how long cut streams get to write their error event
_POLL_S = 0.05


class VEngineHandler(WSGIHandler):
    """pywsgi handler that sets TCP_NODELAY and hands the socket to the app."""

    def __init__(self, sock, address, server, rfile=None):
        try:
            sock.setsockopt(_stdsocket.IPPROTO_TCP, _stdsocket.TCP_NODELAY, 1)
        except OSError:  # not TCP (unix socket): nothing to do
            pass
        super().__init__(sock, address, server, rfile)

    def get_environ(self):
        env = super().get_environ()
        env[SOCKET_ENVIRON_KEY] = self.socket
        return env

    def finalize_headers(self):
        super().finalize_headers()
        if self.request_version != "HTTP/1.0" or self.code in (204, 304):
            return
        names = {(k.decode("latin-1") if isinstance(k, bytes) else k).lower() for k, _ in self.response_headers}
        if "content-length" not in names:
            # HTTP/1.0 has no chunked encoding, so a body of unknown length (a stream) ends
            # only when the connection closes: say so, and close it (pywsgi would answer an
            # HTTP/1.0 keep-alive request with keep-alive and the client would never see
            # the end of the response).
            self.close_connection = True
            self.response_headers = [(k, v) for k, v in self.response_headers
                                     if (k.decode("latin-1") if isinstance(k, bytes) else k).lower() != "connection"]
            self.response_headers.append((b"Connection", b"close"))


def make_server(app, host: str = "127.0.0.1", port: int = 8000,
                max_concurrent_streams: int = DEFAULT_MAX_CONCURRENT_STREAMS,
                access_log: bool = True, listener=None) -> WSGIServer:
    """Build (not start) the gevent WSGI server for ``app``. Must be started on the thread
    whose hub will run it. ``listener``: a bound, listening socket to accept on instead of
    ``(host, port)``."""
    log = "default" if access_log else None
    if listener is not None and not isinstance(listener, gevent.socket.socket):
        # a stdlib socket (inherited from the supervisor): accept through the hub
        listener = gevent.socket.socket(listener.family, listener.type, fileno=listener.detach())
    return WSGIServer(listener if listener is not None else (host, port), app, spawn=Pool(max_concurrent_streams), handler_class=VEngineHandler,
                      log=log, error_log="default", backlog=None if listener is not None else _BACKLOG)


def _wait_idle(state, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while state.active_requests and time.monotonic() < deadline:
        gevent.sleep(_POLL_S)


def graceful_shutdown(server: WSGIServer, app, timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
    """The drain run on SIGTERM (call it on the server's hub; returns when done).

    1. The listening socket closes: new connections are refused.
    2. New requests on open keep-alive connections get 503 (``Connection: close``).
    3. Requests in flight get up to ``timeout`` seconds (vLLM's ``--shutdown-timeout``;
       0: none) to finish.
    4. Those still running are cut: their engine requests are aborted, a stream ends with
       an error event (503) and ``[DONE]``, a plain request gets a 503.
    5. Idle keep-alive connections are closed. The engine itself is left running (the
       caller shuts it down)."""
    state = app.extensions.get("vengine")
    server.close()
    if state is not None:
        state.begin_shutdown()
        _wait_idle(state, timeout)
        if state.active_requests:
            logger.warning("Shutdown: %d request(s) still running after %.1f s; cutting them",
                           state.active_requests, timeout)
        state.cut_jobs("The server is shutting down; the request was cut before it finished.")
        _wait_idle(state, _CUT_GRACE_S)
    if server.pool is not None:
        server.pool.kill(block=True, timeout=1)


def serve_until_shutdown(server: WSGIServer, app, shutdown_timeout: float, install) -> None:
    """Start ``server`` and block (on this thread's hub) until a drain that ``install`` can
    trigger has finished. ``install(trigger)`` gets a callable to run on the hub to begin
    the drain; calling it again while a drain runs cuts the requests at once."""
    done = Event()
    state = {"draining": False}

    def drain():
        try:
            graceful_shutdown(server, app, shutdown_timeout)
        finally:
            done.set()

    def trigger():
        if state["draining"]:  # a second signal: no more waiting
            st = app.extensions.get("vengine")
            if st is not None:
                st.cut_jobs("The server is shutting down; the request was cut before it finished.")
            return
        state["draining"] = True
        gevent.spawn(drain)

    server.start()
    install(trigger)
    done.wait()


class BackgroundServer:
    """Serve ``app`` on a daemon thread; ``.port`` once started; ``.stop()`` from anywhere."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0,
                 max_concurrent_streams: int = DEFAULT_MAX_CONCURRENT_STREAMS, access_log: bool = False,
                 shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT):
        self.app, self.host, self.requested_port = app, host, port
        self.max_concurrent_streams = max_concurrent_streams
        self.shutdown_timeout = shutdown_timeout
        self.access_log = access_log
        self.port: Optional[int] = None
        self._ready = threading.Event()
        self._error: Optional[BaseException] = None
        self._stopper = None
        self._thread = threading.Thread(target=self._run, name="vengine-http", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError("the HTTP server did not start in time")
        if self._error is not None:
            raise RuntimeError(f"the HTTP server failed to start: {self._error!r}")
        return self

    def _run(self) -> None:
        hub = gevent.get_hub()
        stopper = hub.loop.async_()

        def install(trigger):
            stopper.start(trigger)
            self._stopper = stopper
            self.port = server.server_port
            self._ready.set()
        try:
            server = make_server(self.app, self.host, self.requested_port, self.max_concurrent_streams,
                                 self.access_log)
            serve_until_shutdown(server, self.app, self.shutdown_timeout, install)
        except BaseException as e:  # noqa: BLE001 - reported to start()
            if self._ready.is_set():
                raise
            self._error = e
            self._ready.set()
        finally:
            self._stopper = None
            stopper.close()
            if self._error is None:
                st = self.app.extensions.get("vengine")
                if st is not None:
                    st.close()
                hub.destroy(destroy_loop=True)

    def stop(self, timeout: Optional[float] = None) -> None:
        """Drain (``shutdown_timeout``, then cut what still runs) and stop; waits for it
        at most ``timeout`` seconds (default: the drain plus a margin)."""
        s = self._stopper
        if s is not None:
            s.send()
        self._thread.join(self.shutdown_timeout + _CUT_GRACE_S + 10.0 if timeout is None else timeout)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
