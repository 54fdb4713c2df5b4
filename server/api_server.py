"""``vengine serve --api-server-count N``: N front-end (API server) processes over one
engine-core process, as vLLM's flag of the same name.

One front-end process carries the HTTP handling, the SSE encoding and the output
processing (detokenization) of every stream on one GIL; past some load that process, not
the engine, is the limit (docs/benchmarks.md). With N API servers:

- this process binds the listening socket (and answers 503 on it, ``server.loading``,
  until the first API server has its engine; the API servers accept only after that, so
  the port goes from 503 to 200 once), starts the engine-core process with one pipe
  per API server (``pyengine.engine.core_client.start_engine_core_process``), then starts
  the N API servers (``spawn``); each gets the listening socket and one pipe, serves
  through ``AsyncLLM(config, client=MPClient.attach(conn))`` and accepts connections on
  the shared socket (the kernel hands each connection to one of them);
- it then supervises: SIGTERM/SIGINT is passed on to the API servers (each drains as a
  lone server does, ``--shutdown-timeout``), and the engine process ends once the last
  API server has closed its pipe; if the engine or any API server dies, the others are
  stopped and the exit status is non-zero;
- each API server watches this process and stops if it disappears, so no process is left
  behind.

Each API server's ``/metrics`` counts the requests it served; the engine's own figures
(running, waiting, KV cache) are the same in all of them.

With ``--data-parallel-size N`` there are N engine-core processes (one per rank, each with
its own scheduler and KV cache) and each API server holds one pipe to each of them
(``pyengine.engine.core_client.DPClient``): it places its requests on the least-loaded
core, as published by the cores. An engine core that dies fails only its own requests;
the server goes on with the others (``/health`` names the dead one) and stops only when
none is left.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from multiprocessing.connection import wait as mp_wait

from .cli_args import engine_args_from
from .loading import answering_while_loading
from .serve import listen, serve_engine

logger = logging.getLogger(__name__)

_STOP_GRACE_S = 30.0  # after SIGTERM and each API server's drain (--shutdown-timeout), before a kill


def _watch_parent(parent_pid: int) -> None:
    """Exit (hard) when the supervising process is gone: an API server never outlives it."""
    def run():
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)
    threading.Thread(target=run, name="parent-watch", daemon=True).start()


def run_api_server(args, conn, listener: socket.socket, index: int, status, go, parent_pid: int) -> None:
    """Main of one API server process: an AsyncLLM attached to the shared engine process,
    the app, and the gevent server on the shared listening socket. Reports "loaded" once
    the engine is ready, waits for ``go`` (set once the supervisor stopped answering 503 on
    the socket) before it accepts, then reports "ready"; or the start-up error, on
    ``status``."""
    logging.basicConfig(level="DEBUG" if args.log_level == "trace" else args.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s [api server {index}]: %(message)s")
    _watch_parent(parent_pid)
    from pyengine import AsyncLLM, DPClient, MPClient

    try:
        engine_args = engine_args_from(args)
        client = DPClient.attach(conn) if isinstance(conn, (list, tuple)) else MPClient.attach(conn)
        engine = AsyncLLM(engine_args.create_engine_config(), client=client,
                          log_requests=engine_args.enable_log_requests, log_stats=not engine_args.disable_log_stats)
    except Exception as e:  # noqa: BLE001 - reported by the supervisor
        status.put((index, f"{type(e).__name__}: {e}"))
        sys.exit(2)
    status.put((index, "loaded"))
    go.wait()
    try:
        code = serve_engine(args, engine, listener=listener, on_ready=lambda url: status.put((index, "ready")))
    finally:
        engine.shutdown()
    sys.exit(code)


def serve_api_servers(args) -> int:
    """The supervisor of ``--api-server-count N`` (N >= 2), or of one API server over
    several engine cores (``--data-parallel-size``). Returns the exit status."""
    n = args.api_server_count
    try:
        config = engine_args_from(args).create_engine_config()
    except ValueError as e:
        print(f"vengine serve: {e}", file=sys.stderr)
        return 2
    bound = listen(args)
    if bound is None:
        return 2
    listener, ssl_args = bound
    port = listener.getsockname()[1]
    stop = threading.Event()
    # This process answers 503 on the port until the first API server has its engine;
    # then it stops, and the API servers accept (see _await_ready).
    with answering_while_loading(args, listener, ssl_args, args.model or "the built-in default model") as loading:
        servers, engines, channel = _start_processes(args, config, listener, n)
        listener.close()  # the API servers and the loading server hold it now
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        code = _await_ready(channel, servers, engines, n, stop, on_first_loaded=loading.stop)
    if code == 0:
        scheme = "https" if ssl_args else "http"
        cores = f", {config.data_parallel_size} engine cores" if config.data_parallel_size > 1 else ""
        print(f"vengine: serving {', '.join(args.served_model_name or [config.served_model_name])} "
              f"on {scheme}://{args.host}:{port}{args.root_path or ''} ({n} API servers{cores})", flush=True)
        code = _supervise(servers, engines, stop)
    _stop_all(servers, engines, args.shutdown_timeout + _STOP_GRACE_S)
    return code


def _start_processes(args, config, listener: socket.socket, n: int):
    """The engine-core process(es), then the ``n`` API servers (each with the listening
    socket and its pipe to each core); returns ``(servers, engines, (status queue, go
    event))`` (see ``run_api_server``)."""
    from pyengine import start_engine_core_process

    dp = config.data_parallel_size
    engines, conns = [], []  # conns[r][i]: engine rank r's pipe to API server i
    for r in range(dp):
        proc, rank_conns = start_engine_core_process(config.replace(data_parallel_rank=r), n)
        engines.append(proc)
        conns.append(rank_conns)
    ctx = multiprocessing.get_context("spawn")
    status, go = ctx.SimpleQueue(), ctx.Event()
    servers = [ctx.Process(target=run_api_server,
                           args=(args, conns[0][i] if dp == 1 else [conns[r][i] for r in range(dp)], listener, i,
                                 status, go, os.getpid()),
                           name=f"APIServer-{i}") for i in range(n)]
    for p in servers:
        p.start()
    for rank_conns in conns:  # the API servers hold them now: an engine sees their end when they exit
        for c in rank_conns:
            c.close()
    return servers, engines, (status, go)


def _await_ready(channel, servers, engines, n: int, stop: threading.Event, on_first_loaded) -> int:
    """0 once all ``n`` API servers are ready, else the exit status: 1 on SIGTERM/SIGINT,
    2 when one failed or exited. When the first has its engine, ``on_first_loaded()``
    (this process stops answering 503), then the API servers may accept (``go``): the
    port goes from 503 to 200 once, never back."""
    status, go = channel
    ready = 0
    while ready < n:
        if stop.is_set():
            return 1
        if not status.empty():
            index, what = status.get()
            if what == "loaded":
                if not go.is_set():
                    on_first_loaded()
                    go.set()
                continue
            if what != "ready":
                print(f"vengine serve: API server {index} failed to start: {what}", file=sys.stderr)
                return 2
            ready += 1
            continue
        if any(p.exitcode is not None for p in servers + engines):
            print("vengine serve: a process exited during start-up (see the log above)", file=sys.stderr)
            return 2
        time.sleep(0.05)
    return 0


def _supervise(servers, engines, stop: threading.Event) -> int:
    """Until SIGTERM/SIGINT (0), an API server's exit or the last engine core's (1). With
    several engine cores one that exits is logged and the others serve on (the API
    servers fail its requests and report it on /health)."""
    sentinels = {p.sentinel: p for p in servers + engines}
    live_engines = set(engines)
    while not stop.is_set():
        done = mp_wait(list(sentinels), timeout=0.5)
        for s in done:
            gone = sentinels.pop(s)
            if gone in live_engines and len(live_engines) > 1:
                live_engines.discard(gone)
                logger.error("%s exited (status %s); the other engine cores go on serving.", gone.name,
                             gone.exitcode)
                continue
            logger.error("%s exited (status %s); stopping the server.", gone.name, gone.exitcode)
            return 1
    return 0


def _stop_all(servers, engines, grace: float) -> None:
    """SIGTERM to every API server (each drains), then the engine ends with the last pipe;
    what still runs ``grace`` seconds later is killed."""
    for p in servers:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace
    for p in servers + engines:
        p.join(max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5)
