"""``vengine serve [MODEL]``: the OpenAI-compatible server's command line.

Flags carry ``vllm serve``'s names; they are generated from ``EngineArgs`` and the
server's ``FrontendArgs`` (server/cli_args.py). ``main()`` is the console entry point; it
accepts ``vengine serve MODEL ...`` as well as ``vengine MODEL ...`` (and
``python -m server``).
"""
from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from .api_server import serve_api_servers
from .cli_args import IGNORED_FLAGS_ATTR, engine_args_from, parse_args
from .loading import answering_while_loading
from .serve import listen, serve_engine

__all__ = ["main", "parse_args", "engine_args_from", "serve_engine"]

logger = logging.getLogger(__name__)


def _log_level(name: str) -> str:
    return "DEBUG" if name == "trace" else name.upper()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=_log_level(args.log_level), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for what in getattr(args, IGNORED_FLAGS_ATTR, None) or []:
        logger.warning("Ignoring the vLLM flag %s.", what)
    if args.api_server_count > 1:  # (one API server over several engine cores is the process below)
        return serve_api_servers(args)
    from pyengine import AsyncLLM

    bound = listen(args)
    if bound is None:
        return 2
    listener, ssl_args = bound
    what = args.model or "the built-in default model"
    with answering_while_loading(args, listener, ssl_args, what):  # 503 until the engine is ready
        try:
            engine = AsyncLLM.from_engine_args(engine_args_from(args))
        except (ValueError, OSError, RuntimeError) as e:  # RuntimeError: the engine process failed to start
            print(f"vengine serve: cannot load {what}: {e}", file=sys.stderr)
            listener.close()
            return 2
    try:
        return serve_engine(args, engine, listener=listener)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    sys.exit(main())
