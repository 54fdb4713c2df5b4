"""Serving one ``AsyncLLM`` over HTTP on this thread (``serve_engine``): the app, the
gevent server with its connection limits, the signal handlers and the shutdown drain.
``vengine serve`` (``server.cli``) and each API server of ``--api-server-count``
(``server.api_server``) call it, on the socket that ``listen`` bound before the engine
loaded."""
from __future__ import annotations

import logging
import signal
import socket
import sys
from collections.abc import Callable

import gevent

from .app import create_app
from .wsgi import ConnectionLimits, bind_listener, make_server, raise_fd_limit, serve_until_shutdown, ssl_args_from

logger = logging.getLogger(__name__)


def listen(args) -> tuple[socket.socket, dict | None] | None:
    """The socket listening on ``--host``/``--port`` and the TLS arguments (``--ssl-*``),
    had before the engine loads (so the port answers while it does, ``server.loading``,
    and a bad certificate or a port in use fails at once); None, the reason printed,
    when either cannot be had."""
    try:
        ssl_args = ssl_args_from(args)
    except ValueError as e:
        print(f"vengine serve: {e}", file=sys.stderr)
        return None
    try:
        return bind_listener(args.host, args.port), ssl_args
    except OSError as e:
        print(f"vengine serve: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return None


def serve_engine(args, engine, listener=None, on_ready: Callable[[str], None] | None = None) -> int:
    """Serve ``engine`` (an AsyncLLM) over HTTP on this thread until SIGINT/SIGTERM and the
    drain that follows (``--shutdown-timeout``, ``server.wsgi.graceful_shutdown``); returns
    the exit status. ``listener``: an already bound and listening socket to accept on
    instead of ``args.host``/``args.port`` (``--api-server-count``: shared by the API
    servers). ``on_ready(url)`` replaces the "serving on" line."""
    raise_fd_limit()  # every open connection holds a descriptor
    try:
        ssl_args = ssl_args_from(args)
        app = create_app(engine, args)
    except (ValueError, OSError) as e:  # --root-path, --chat-template, --ssl-* files
        print(f"vengine serve: {e}", file=sys.stderr)
        return 2
    server = make_server(app, args.host, args.port, access_log=not args.disable_access_log, listener=listener,
                         limits=ConnectionLimits.from_args(args), ssl_args=ssl_args)
    names = ", ".join(app.extensions["vengine"].cfg.served_model_names)

    def install(trigger) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            gevent.signal_handler(sig, trigger)
        url = f"{'https' if ssl_args else 'http'}://{args.host}:{server.server_port}{args.root_path or ''}"
        logger.info("Serving %s on %s (OpenAI API under /v1)", names, url)
        if on_ready is None:
            print(f"vengine: serving {names} on {url}", flush=True)
        else:
            on_ready(url)
    try:
        serve_until_shutdown(server, app, args.shutdown_timeout, install)
    except OSError as e:
        print(f"vengine serve: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    logger.info("Shut down.")
    app.extensions["vengine"].close()
    return 0
