"""``vengine serve [MODEL]``: the OpenAI-compatible server's command line.

Flags carry ``vllm serve``'s names. ``main()`` is the console entry point; it accepts
``vengine serve MODEL ...`` as well as ``vengine MODEL ...`` (and ``python -m server``).
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import Callable, Optional, Sequence

from pyengine import envs
from pyengine.tool_parsers import ToolParserManager

from .app import DEFAULT_MAX_BODY_BYTES
from .wsgi import (DEFAULT_MAX_CONCURRENT_STREAMS, DEFAULT_REQUEST_READ_TIMEOUT, DEFAULT_SHUTDOWN_TIMEOUT,
                   DEFAULT_TIMEOUT_KEEP_ALIVE, RETRY_AFTER_S)

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vengine serve",
        description="Serve a model over an OpenAI-compatible HTTP API (completions, chat, SSE streaming).")
    p.add_argument("model", nargs="?", default=None,
                   help="Hugging Face model directory; omitted: the built-in default model.")
    p.add_argument("--model", dest="model_opt", default=None, help=argparse.SUPPRESS)
    p.add_argument("--host", default="127.0.0.1", help="Bind address (default: %(default)s).")
    p.add_argument("--port", type=int, default=8000, help="Bind port (default: %(default)s; 0: any free port).")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="Model name(s) the API accepts; the first is reported (default: the directory name).")
    p.add_argument("--tokenizer", default=None, help="Tokenizer directory (default: the model's).")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="A prefill takes at most this many tokens per step, so concurrent long prompts "
                        "share the token budget (default: %(default)s, no cap).")
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs")
    p.add_argument("--async-scheduling", dest="async_scheduling", action="store_true", default=None,
                   help="Force async scheduling on (default: on where compatible).")
    p.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="Shard the model over N ranks (one process and one GPU each; default: %(default)s).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights of the model's shape (benchmarks).")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="Send streamed deltas every N tokens of a request; its first token and "
                        "its end at once (default: %(default)s).")
    p.add_argument("--api-key", default=None,
                   help="Require 'Authorization: Bearer KEY' on /v1/* (default: $VENGINE_API_KEY or $VLLM_API_KEY, else none).")
    p.add_argument("--chat-template", default=None,
                   help="Jinja chat template, or a file holding one (default: the tokenizer's).")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='Let the model decide to call tools (tool_choice "auto"); needs --tool-call-parser.')
    p.add_argument("--tool-call-parser", default=None, choices=sorted(ToolParserManager.tool_parsers),
                   help="How tool calls are read from the model's output (hermes: <tool_call>{...}</tool_call>, "
                        "the Qwen/Hermes format). tool_choice \"required\" and named functions work without it.")
    p.add_argument("--max-concurrent-streams", type=int, default=DEFAULT_MAX_CONCURRENT_STREAMS,
                   help="Most requests served at once (streams included; idle connections do not count, "
                        "nor do /health, /metrics, /version, /v1/models); one more gets 503 with "
                        f"Retry-After: {RETRY_AFTER_S} (default: %(default)s).")
    p.add_argument("--timeout-keep-alive", type=float, default=None,
                   help="Close a connection that waits this many seconds for its next request (a fresh "
                        "one for its first) (default: $VENGINE_HTTP_TIMEOUT_KEEP_ALIVE or "
                        f"$VLLM_HTTP_TIMEOUT_KEEP_ALIVE, else {DEFAULT_TIMEOUT_KEEP_ALIVE:g}, as uvicorn and vLLM).")
    p.add_argument("--request-read-timeout", type=float, default=DEFAULT_REQUEST_READ_TIMEOUT,
                   help="Seconds a request's headers, and then its body, may take to arrive once its "
                        "first byte came; later: 408 and the connection closes (default: %(default)s).")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="Larger request bodies get 413 (default: %(default)s).")
    p.add_argument("--api-server-count", type=int, default=1,
                   help="Front-end (API server) processes sharing one engine process and the port, "
                        "as vllm serve's flag (default: %(default)s).")
    p.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT,
                   help="On SIGTERM/SIGINT: seconds that requests in flight get to finish before they are "
                        "cut (a stream then ends with an error event and [DONE]); new connections are "
                        "refused at once (default: %(default)s, cut at once, as vLLM). A second signal "
                        "cuts at once.")
    p.add_argument("--disable-access-log", action="store_true", help="Do not log each HTTP request.")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        argv = argv[1:]
    args = build_parser().parse_args(argv)
    if args.model is None:
        args.model = args.model_opt
    if args.api_key is None:
        args.api_key = envs.api_key()
    if args.timeout_keep_alive is None:
        try:
            args.timeout_keep_alive = envs.http_timeout_keep_alive(DEFAULT_TIMEOUT_KEEP_ALIVE)
        except ValueError as e:
            build_parser().error(str(e))
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        build_parser().error("--enable-auto-tool-choice requires --tool-call-parser")
    if args.max_concurrent_streams < 1:
        build_parser().error("--max-concurrent-streams must be >= 1")
    if args.api_server_count < 1:
        build_parser().error("--api-server-count must be >= 1")
    if not args.shutdown_timeout >= 0:  # also NaN
        build_parser().error("--shutdown-timeout must be >= 0")
    for flag in ("timeout_keep_alive", "request_read_timeout"):
        if not 0 < getattr(args, flag) < float("inf"):  # also NaN
            build_parser().error(f"--{flag.replace('_', '-')} must be a positive number of seconds")
    return args


def engine_args_from(args: argparse.Namespace):
    from pyengine import EngineArgs

    return EngineArgs(
        model=args.model, tokenizer=args.tokenizer, dtype=args.dtype, device=args.device,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        scheduling_policy=args.scheduling_policy, seed=args.seed,
        async_scheduling=args.async_scheduling, enforce_eager=args.enforce_eager,
        load_format=args.load_format, stream_interval=args.stream_interval,
        tensor_parallel_size=args.tensor_parallel_size,
        served_model_name=(args.served_model_name or [None])[0])


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
    from .wsgi import ConnectionLimits, make_server, raise_fd_limit, serve_until_shutdown

    raise_fd_limit()  # every open connection holds a descriptor
    app = create_app(engine, args)
    server = make_server(app, args.host, args.port, access_log=not args.disable_access_log, listener=listener,
                         limits=ConnectionLimits.from_args(args))
    names = ", ".join(app.extensions["vengine"].cfg.served_model_names)

    def install(trigger) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            gevent.signal_handler(sig, trigger)
        url = f"http://{args.host}:{server.server_port}"
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
