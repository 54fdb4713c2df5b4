"""Serving the app with gevent's ``pywsgi`` (no monkey-patching).

``make_server`` builds the ``WSGIServer``: TCP_NODELAY on every accepted socket, the client
socket exposed to the app for disconnect detection, and the connection rules a public
server needs (``ConnectionLimits``):

- a connection waiting for a request (a fresh one, or a keep-alive one after its response)
  is closed after ``timeout_keep_alive`` seconds without a byte (uvicorn's and vLLM's
  ``--timeout-keep-alive``);
- once a request's first byte arrived, its headers and its body must arrive within
  ``request_read_timeout`` seconds (a slow-drip client cannot hold a connection or a
  request slot): late headers get a 408 and the connection is closed, a late body a 408
  JSON error from the app;
- ``max_concurrent_streams`` counts requests being served (from their headers to the end
  of their response, streams included), not sockets: a request over it gets a prompt 503
  with ``Retry-After``; ``/health``, ``/metrics``, ``/version`` and ``/v1/models`` are not
  counted, so they answer whatever the load. Open sockets are bounded only by the
  process's file-descriptor limit (``raise_fd_limit``), less a reserve.

``graceful_shutdown`` is the drain that SIGTERM runs (``--shutdown-timeout``).
``BackgroundServer`` runs one on its own native thread with its own hub, for tests,
benchmarks and embedding; it is stopped (with the same drain) from any thread through an
async watcher.
"""
from __future__ import annotations

import json
import logging
import os
import resource
import socket as _stdsocket
import threading
import time
from dataclasses import dataclass

import gevent
import gevent.socket
from gevent.event import Event
from gevent.pool import Pool
from gevent.pywsgi import WSGIHandler, WSGIServer
from werkzeug.exceptions import RequestTimeout

from .http import DEFAULT_MAX_CONCURRENT_STREAMS, SOCKET_ENVIRON_KEY, error_body

logger = logging.getLogger(__name__)

DEFAULT_SHUTDOWN_TIMEOUT = 0.0  # vLLM's default: requests in flight are cut at once
DEFAULT_TIMEOUT_KEEP_ALIVE = 5.0  # uvicorn's default, and vLLM's (VLLM_HTTP_TIMEOUT_KEEP_ALIVE)
DEFAULT_REQUEST_READ_TIMEOUT = 60.0  # nginx's client_header_timeout / client_body_timeout
RETRY_AFTER_S = 1  # what a request over the cap is told to wait (seconds)
# Answered whatever the load: not counted against max_concurrent_streams.
UNCAPPED_PATHS = frozenset({"/health", "/metrics", "/version", "/v1/models"})
_BACKLOG = 2048
_CUT_GRACE_S = 5.0  # after the drain: how long cut streams get to write their error event
_POLL_S = 0.05
_FD_RESERVE = 128  # descriptors kept for the engine pipes, the log, files: not for clients
_DISCARD_MAX = 64 << 20  # an unread body larger than this is not read out: the connection closes


@dataclass
class ConnectionLimits:
    """The connection rules of one server (see the module docstring); seconds."""
    max_concurrent_streams: int = DEFAULT_MAX_CONCURRENT_STREAMS
    timeout_keep_alive: float = DEFAULT_TIMEOUT_KEEP_ALIVE
    request_read_timeout: float = DEFAULT_REQUEST_READ_TIMEOUT

    @classmethod
    def from_args(cls, args) -> ConnectionLimits:
        d = cls()
        return cls(max_concurrent_streams=getattr(args, "max_concurrent_streams", d.max_concurrent_streams),
                   timeout_keep_alive=getattr(args, "timeout_keep_alive", d.timeout_keep_alive),
                   request_read_timeout=getattr(args, "request_read_timeout", d.request_read_timeout))


def raise_fd_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit (as ``vllm serve``
    does): every open connection holds one. Returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # not allowed here: keep what we have
            pass
    return soft


def _max_connections() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(16, soft - _FD_RESERVE)


class _Deadline:
    """Runs blocking reads until a monotonic deadline; ``expired`` once one ran out."""

    __slots__ = ("at", "expired")

    def __init__(self, seconds: float):
        self.at = time.monotonic() + seconds
        self.expired = False

    def run(self, fn, *args):
        """``fn(*args)``, or ``None`` with ``expired`` set once the deadline passed first."""
        left = self.at - time.monotonic()
        if self.expired or left <= 0:
            self.expired = True
            return None
        t = gevent.Timeout(left)
        t.start()
        try:
            return fn(*args)
        except gevent.Timeout as e:
            if e is not t:
                raise
            self.expired = True
            return None
        finally:
            t.close()


class _RequestReadTimeout(ValueError):
    """The request's headers did not arrive in time (a ValueError: pywsgi logs it as a
    client's error, one line, no traceback)."""


def _raw_error_response(status_line: str, message: str) -> bytes:
    """A complete HTTP/1.1 error response (OpenAI's error body) that closes the connection."""
    body = json.dumps(error_body(int(status_line.split()[0]), message)).encode()
    return (f"HTTP/1.1 {status_line}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n").encode() + body


class _TimedInput:
    """``wsgi.input`` whose reads share the request's deadline. A read that would end
    after it raises werkzeug's ``RequestTimeout`` (the app answers 408) and marks the
    connection to be closed, so the unread rest is never waited for."""

    __slots__ = ("_input", "_handler", "_deadline", "_timeout_s")

    def __init__(self, inp, handler: VEngineHandler, deadline: _Deadline, timeout_s: float):
        self._input, self._handler, self._deadline, self._timeout_s = inp, handler, deadline, timeout_s

    def _read(self, fn, *args):
        try:
            out = self._deadline.run(fn, *args)
        except Exception:  # a malformed body (bad chunk framing, EOF): its rest cannot be found
            self._handler.close_connection = True
            raise
        if self._deadline.expired:
            self._handler.close_connection = True
            raise RequestTimeout(f"The request body did not arrive within {self._timeout_s:g} s "
                                 f"(--request-read-timeout).")
        return out

    def read(self, length=None):
        return self._read(self._input.read, length)

    def readline(self, size=None):
        return self._read(self._input.readline, size)

    def readlines(self, hint=None):
        return self._read(self._input.readlines, hint)

    def __iter__(self):
        return self

    def __next__(self):
        line = self.readline()
        if not line:
            raise StopIteration
        return line

    def _discard(self) -> None:
        """pywsgi's hook after the app ran: read out what the app left unread, to keep the
        connection. Only within the deadline, at most ``_DISCARD_MAX`` bytes (a larger
        rest, e.g. of a body over the app's limit, chunked or not, closes the
        connection instead), and not at all when the connection is closing anyway."""
        inp, h = self._input, self._handler
        if h.close_connection or self._deadline.expired:
            return
        if not inp.chunked_input and (inp.content_length or 0) - inp.position > _DISCARD_MAX:
            h.close_connection = True
            return
        inp.send_100_continue_enabled = False  # the response is out: no "100 Continue" after it
        left = _DISCARD_MAX
        try:
            while left > 0:
                data = self._deadline.run(inp.read, min(left, 1 << 16))
                if self._deadline.expired:
                    break
                if not data:
                    return
                left -= len(data)
        except (OSError, ValueError):  # a broken body or connection: nothing to keep
            pass
        h.close_connection = True


def _over_capacity_app(limit: int):
    body = json.dumps(error_body(503, f"The server is serving its maximum of {limit} concurrent requests "
                                      f"(--max-concurrent-streams); retry after {RETRY_AFTER_S} s.")).encode()
    headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body))),
               ("Retry-After", str(RETRY_AFTER_S))]

    def app(environ, start_response):
        start_response("503 Service Unavailable", list(headers))
        return [body]
    return app


class VEngineHandler(WSGIHandler):
    """pywsgi handler: TCP_NODELAY, the socket handed to the app, the keep-alive and read
    timeouts and the request cap of ``VEngineServer``."""

    _deadline: _Deadline | None = None

    def __init__(self, sock, address, server, rfile=None):
        try:
            sock.setsockopt(_stdsocket.IPPROTO_TCP, _stdsocket.TCP_NODELAY, 1)
        except OSError:  # not TCP (unix socket): nothing to do
            pass
        super().__init__(sock, address, server, rfile)

    def read_requestline(self):
        limits = self.server.limits
        # Idle until the request's first byte (peek: buffered pipelined bytes count).
        first = _Deadline(limits.timeout_keep_alive).run(self.rfile.peek, 1)
        if not first:  # idle too long, or EOF: close quietly
            return ""
        self._deadline = _Deadline(limits.request_read_timeout)
        line = self._deadline.run(super().read_requestline)
        return "" if self._deadline.expired else line

    def read_request(self, raw_requestline):
        ok = self._deadline.run(super().read_request, raw_requestline)
        if self._deadline.expired:
            raise _RequestReadTimeout(f"request headers not received within {self.server.limits.request_read_timeout:g} s; "
                                      "closing")
        return ok

    def handle_one_request(self):
        # pywsgi answers a request whose headers could not be read with its 400 (the
        # ``(status, raw response)`` this method returns); late headers get a 408 instead.
        result = super().handle_one_request()
        if isinstance(result, tuple) and self._deadline is not None and self._deadline.expired:
            t = self.server.limits.request_read_timeout
            return ("408", _raw_error_response(
                "408 Request Timeout", f"The request headers did not arrive within {t:g} s (--request-read-timeout)."))
        return result

    def get_environ(self):
        env = super().get_environ()
        env[SOCKET_ENVIRON_KEY] = self.socket
        if env["wsgi.input"] is self.wsgi_input:
            self.wsgi_input = _TimedInput(self.wsgi_input, self, self._deadline, self.server.limits.request_read_timeout)
            env["wsgi.input"] = self.wsgi_input
        return env

    def handle_one_response(self):
        gate = self.server.gate
        if self.environ.get("PATH_INFO") in UNCAPPED_PATHS:
            return super().handle_one_response()
        if gate.active >= gate.limit:
            self.application = gate.refuse
            return super().handle_one_response()
        gate.active += 1
        try:
            return super().handle_one_response()
        finally:
            gate.active -= 1

    def finalize_headers(self):
        super().finalize_headers()
        if self.code in (204, 304):
            return
        names = {(k.decode("latin-1") if isinstance(k, bytes) else k).lower() for k, _ in self.response_headers}
        if self.request_version == "HTTP/1.0" and "content-length" not in names:
            # HTTP/1.0 has no chunked encoding, so a body of unknown length (a stream) ends
            # only when the connection closes: say so, and close it (pywsgi would answer an
            # HTTP/1.0 keep-alive request with keep-alive and the client would never see
            # the end of the response).
            self.close_connection = True
            self.response_headers = [(k, v) for k, v in self.response_headers
                                     if (k.decode("latin-1") if isinstance(k, bytes) else k).lower() != "connection"]
            self.response_headers.append((b"Connection", b"close"))
        elif self.close_connection and "connection" not in names:
            # closing after this response (a timed-out body): tell the client
            self.response_headers.append((b"Connection", b"close"))


class _RequestGate:
    """Requests being served against the cap (hub thread only, no lock)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.active = 0
        self.refuse = _over_capacity_app(limit)


class VEngineServer(WSGIServer):
    """``WSGIServer`` carrying the ``ConnectionLimits`` its handlers apply."""

    handler_class = VEngineHandler

    def __init__(self, listener, application, limits: ConnectionLimits, **kw):
        super().__init__(listener, application, **kw)
        self.limits = limits
        self.gate = _RequestGate(limits.max_concurrent_streams)


def make_server(app, host: str = "127.0.0.1", port: int = 8000,
                max_concurrent_streams: int = DEFAULT_MAX_CONCURRENT_STREAMS,
                access_log: bool = True, listener=None, limits: ConnectionLimits | None = None,
                ssl_args: dict | None = None) -> WSGIServer:
    """Build (not start) the gevent WSGI server for ``app``. Must be started on the thread
    whose hub will run it. ``listener``: a bound, listening socket to accept on instead of
    ``(host, port)``. ``limits`` (default: the defaults with ``max_concurrent_streams``):
    the timeouts and the request cap. ``ssl_args``: serve HTTPS (``ssl_args_from``)."""
    if limits is None:
        limits = ConnectionLimits(max_concurrent_streams=max_concurrent_streams)
    log = "default" if access_log else None
    if listener is not None and not isinstance(listener, gevent.socket.socket):
        # a stdlib socket (inherited from the supervisor): accept through the hub
        listener = gevent.socket.socket(listener.family, listener.type, fileno=listener.detach())
    # The pool bounds sockets only by the descriptors there are: the request cap is the gate's.
    return VEngineServer(listener if listener is not None else (host, port), app, limits,
                         spawn=Pool(_max_connections()), log=log, error_log="default",
                         backlog=None if listener is not None else _BACKLOG, **(ssl_args or {}))


def bind_listener(host: str, port: int) -> _stdsocket.socket:
    """A TCP socket bound to ``(host, port)`` and listening (port 0: a free one), to be
    served by ``make_server(listener=...)``: bound before the engine loads, so the port
    answers (503) while it does (``server.loading``). Raises OSError."""
    family = _stdsocket.AF_INET6 if ":" in host else _stdsocket.AF_INET
    sock = _stdsocket.socket(family, _stdsocket.SOCK_STREAM)
    try:
        sock.setsockopt(_stdsocket.SOL_SOCKET, _stdsocket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def ssl_args_from(args) -> dict | None:
    """gevent's SSL arguments (a server-side TLS context) from ``--ssl-keyfile`` /
    ``--ssl-certfile`` / ``--ssl-ca-certs`` / ``--ssl-cert-reqs``; None: plain HTTP.
    Raises ValueError when only one of the key and the certificate is given, or the
    files cannot be read as such."""
    import gevent.ssl

    key, cert = getattr(args, "ssl_keyfile", None), getattr(args, "ssl_certfile", None)
    if not key and not cert:
        return None
    if not key or not cert:
        raise ValueError("HTTPS needs both --ssl-keyfile and --ssl-certfile.")
    ca = getattr(args, "ssl_ca_certs", None)
    for flag, path in (("--ssl-keyfile", key), ("--ssl-certfile", cert), ("--ssl-ca-certs", ca)):
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"{flag}: no such file: {path}")
    ctx = gevent.ssl.SSLContext(gevent.ssl.PROTOCOL_TLS_SERVER)  # gevent's: cooperative sockets
    try:
        ctx.load_cert_chain(cert, key)
        if ca:
            ctx.load_verify_locations(ca)
    except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
        raise ValueError(f"cannot use --ssl-keyfile {key} / --ssl-certfile {cert}"
                         f"{f' / --ssl-ca-certs {ca}' if ca else ''}: {e}") from None
    ctx.verify_mode = gevent.ssl.VerifyMode(int(getattr(args, "ssl_cert_reqs", 0) or 0))
    return {"ssl_context": ctx}


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
       caller shuts it down).

    An app without vengine's state (the loading app, ``server.loading``: every answer
    closes its connection) has no requests to cut: its connections get up to ``timeout``
    seconds to be answered and closed before those left are closed (step 5)."""
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
    elif server.pool is not None:
        server.pool.join(timeout=timeout)
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
    """Serve ``app`` on a daemon thread; ``.port`` once started; ``.stop()`` from anywhere.
    ``max_concurrent_streams``, ``timeout_keep_alive``, ``request_read_timeout``: see
    ``ConnectionLimits``. ``listener``: a bound, listening stdlib socket to accept on
    (this server takes it over, and closes it when it stops) instead of ``host``/``port``."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0,
                 max_concurrent_streams: int = DEFAULT_MAX_CONCURRENT_STREAMS, access_log: bool = False,
                 shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
                 timeout_keep_alive: float = DEFAULT_TIMEOUT_KEEP_ALIVE,
                 request_read_timeout: float = DEFAULT_REQUEST_READ_TIMEOUT, ssl_args: dict | None = None,
                 listener: _stdsocket.socket | None = None):
        self.app, self.host, self.requested_port = app, host, port
        self.ssl_args = ssl_args
        self.listener = listener  # a bound, listening socket to accept on instead of (host, port)
        self.limits = ConnectionLimits(max_concurrent_streams, timeout_keep_alive, request_read_timeout)
        self.shutdown_timeout = shutdown_timeout
        self.access_log = access_log
        self.port: int | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._stopper = None
        self._thread = threading.Thread(target=self._run, name="vengine-http", daemon=True)

    @property
    def base_url(self) -> str:
        return f"{'https' if self.ssl_args else 'http'}://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> BackgroundServer:
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
            server = make_server(self.app, self.host, self.requested_port, access_log=self.access_log,
                                 listener=self.listener, limits=self.limits, ssl_args=self.ssl_args)
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

    def stop(self, timeout: float | None = None) -> None:
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
