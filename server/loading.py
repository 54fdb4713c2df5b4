"""Answering while the engine loads (issue 29, readiness).

``vengine serve`` binds its port before the engine loads (minutes for a large model) and,
until the engine is ready, answers on it from a ``BackgroundServer`` of its own (a
native thread with its own gevent hub: the main thread is busy building the engine):

- ``GET /health``: 503 ``{"status": "loading"}``, so a readiness probe or a router sees
  "not ready" rather than a refused connection;
- ``GET /version``: 200 (it needs no engine);
- everything else, ``/metrics`` included: 503 with OpenAI's error body. ``/metrics`` has no
  engine figures yet, and zeros would show a loading replica as an idle one to a router
  that balances on them; a scrape that fails says "down", which is true.

Every answer has ``Retry-After`` (but ``/version``'s) and ``Connection: close``: the server
that answers once the engine is ready is another one on the same socket, so no
connection is kept across the hand-over. When it stops, the loading server accepts no
more and answers the connections it had accepted (``HANDOVER_GRACE_S``); in between,
new connections wait in the socket's backlog; none is refused or reset.
"""
from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

from flask import Flask, request

from pyengine import VERSION

from .http import error_response, json_response, not_ready_response
from .middleware import apply_http_options
from .wsgi import BackgroundServer, ConnectionLimits

LOADING_RETRY_AFTER_S = 5  # a model loads in seconds to minutes: a probe's period, not a tight loop
LOADING_MESSAGE = "The server is loading the model and is not ready yet; retry later."
# When it stops (the engine is ready), how long the connections it accepted get to send
# their request and have it answered: none is reset in the hand-over. A connection that
# sends nothing in that time is closed; those not yet accepted wait for the next server.
HANDOVER_GRACE_S = 2.0


def create_loading_app(args=None) -> Flask:
    """The app served while the engine loads (see the module docstring); ``args``: the
    ``vengine serve`` namespace (``--root-path``, CORS), or None."""
    app = Flask("vengine.loading", static_folder=None)
    apply_http_options(app, args)  # the same paths (--root-path) and CORS as the app proper

    @app.before_request
    def _loading():  # every path and method, before any routing
        if request.path == "/version":
            resp = json_response({"version": VERSION})
        else:
            resp = not_ready_response("loading") if request.path == "/health" else error_response(503, LOADING_MESSAGE)
            resp.headers["Retry-After"] = str(LOADING_RETRY_AFTER_S)
        resp.headers["Connection"] = "close"
        return resp
    return app


@contextlib.contextmanager
def answering_while_loading(args, listener: socket.socket, ssl_args: dict | None,
                            what: str) -> Iterator[BackgroundServer]:
    """Serve ``create_loading_app(args)`` on ``listener`` (a dup of it: the socket stays
    open and listening for the server that follows) until the block ends; yields the
    server (``.stop()`` ends it sooner; again is harmless). Prints where it answers;
    ``what``: the model being loaded, for that line."""
    limits = ConnectionLimits.from_args(args)
    srv = BackgroundServer(create_loading_app(args), listener=listener.dup(), ssl_args=ssl_args,
                           access_log=not getattr(args, "disable_access_log", False),
                           shutdown_timeout=HANDOVER_GRACE_S,
                           timeout_keep_alive=limits.timeout_keep_alive,
                           request_read_timeout=limits.request_read_timeout).start()
    try:
        url = f"{'https' if ssl_args else 'http'}://{args.host}:{srv.port}{getattr(args, 'root_path', None) or ''}"
        print(f"vengine: loading {what}; {url} answers 503 until it is ready", flush=True)
        yield srv
    finally:
        srv.stop()
