"""``vengine serve [MODEL]``: the OpenAI-compatible server's command line.

Flags carry ``vllm serve``'s names; they are generated from ``EngineArgs`` and the
server's ``FrontendArgs`` (server/cli_args.py). ``main()`` is the console entry point; it
accepts ``vengine serve MODEL ...`` as well as ``vengine MODEL ...`` (and
``python -m server``).
"""
from __future__ import annotations

import logging
import signal
import sys
from typing import Callable, Optional, Sequence

from .cli_args import IGNORED_FLAGS_ATTR, engine_args_from, parse_args

__all__ = ["main", "parse_args", "engine_args_from", "serve_engine"]

logger = logging.getLogger(__name__)


def _log_level(name: str) -> str:
    return "DEBUG" if name == "trace" else name.upper()


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=_log_level(args.log_level), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for what in getattr(args, IGNORED_FLAGS_ATTR, None) or []:
        logger.warning("Ignoring the vLLM flag %s.", what)
    if args.api_server_count > 1:
        from .api_server import serve_api_servers
        return serve_api_servers(args)
    from pyengine import AsyncLLM

    try:
        engine = AsyncLLM.from_engine_args(engine_args_from(args))
    except (ValueError, OSError, RuntimeError) as e:  # RuntimeError: the engine process failed to start
        what = args.model or "the built-in default model"
        print(f"vengine serve: cannot load {what}: {e}", file=sys.stderr)
        return 2
    try:
        return serve_engine(args, engine)
    finally:
        engine.shutdown()


def serve_engine(args, engine, listener=None, on_ready: Optional[Callable[[str], None]] = None) -> int:
    """Serve ``engine`` (an AsyncLLM) over HTTP on this thread until SIGINT/SIGTERM and the
    drain that follows (``--shutdown-timeout``, ``server.wsgi.graceful_shutdown``); returns
    the exit status. ``listener``: an already bound and listening socket to accept on
    instead of ``args.host``/``args.port`` (``--api-server-count``: shared by the API
    servers). ``on_ready(url)`` replaces the "serving on" line."""
    import gevent

    from .app import create_app
    from .wsgi import ConnectionLimits, make_server, raise_fd_limit, serve_until_shutdown, ssl_args_from

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


if __name__ == "__main__":
    sys.exit(main())
