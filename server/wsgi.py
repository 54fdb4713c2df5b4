"""Serving the app with gevent's ``pywsgi`` (no monkey-patching).

``make_server`` builds the ``WSGIServer`` (connection cap through ``spawn=Pool(n)``,
TCP_NODELAY on every accepted socket, the client socket exposed to the app for disconnect
detection). ``BackgroundServer`` runs one on its own native thread with its own hub, for
tests, benchmarks and embedding; it is stopped from any thread through an async watcher.
"""
from __future__ import annotations

import logging
import socket as _stdsocket
import threading
from typing import Optional

import gevent
import gevent.socket
from gevent.pool import Pool
from gevent.pywsgi import WSGIHandler, WSGIServer

from .app import SOCKET_ENVIRON_KEY

logger = logging.getLogger("vengine.server")

DEFAULT_MAX_CONCURRENT_STREAMS = 1024
_BACKLOG = 2048


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


class BackgroundServer:
    """Serve ``app`` on a daemon thread; ``.port`` once started; ``.stop()`` from anywhere."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0,
                 max_concurrent_streams: int = DEFAULT_MAX_CONCURRENT_STREAMS, access_log: bool = False):
        self.app, self.host, self.requested_port = app, host, port
        self.max_concurrent_streams = max_concurrent_streams
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
        server = None
        try:
            server = make_server(self.app, self.host, self.requested_port, self.max_concurrent_streams,
                                 self.access_log)
            server.start()
            self.port = server.server_port
            stopper = hub.loop.async_()
            stopper.start(lambda: gevent.spawn(server.stop, 2.0))
            self._stopper = stopper
        except BaseException as e:  # noqa: BLE001 - reported to start()
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            server.serve_forever()
        finally:
            st = self.app.extensions.get("vengine")
            if st is not None:
                st.close()
            self._stopper = None
            stopper.close()
            hub.destroy(destroy_loop=True)

    def stop(self, timeout: float = 10.0) -> None:
        s = self._stopper
        if s is not None:
            s.send()
        self._thread.join(timeout)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
