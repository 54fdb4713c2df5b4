"""Client side of the engine core (mirrors vllm/v1/engine/core_client.py).

``make_client(config)`` returns one of two clients that pass the same messages
(pyengine/messages.py, pyengine/codec.py):

- ``InprocClient``: the engine core's busy loop (``EngineCoreProc``) on a native thread of
  this process, fed through queues with the message objects themselves.
- ``MPClient``: the busy loop in a process of its own (``core.run_engine_core``), fed
  through a duplex ``multiprocessing`` pipe with ``codec.encode``d bytes, so the engine
  loop no longer shares a GIL with the front end (output processing, HTTP, C delivery).

Which one: ``VENGINE_ENABLE_MULTIPROCESSING`` (vLLM's ``VLLM_ENABLE_V1_MULTIPROCESSING``):
``1`` the process, ``0`` the thread; unset, the default below. How the engine process
starts (``VENGINE_MULTIPROC_METHOD``, or chosen as vLLM does): by ``fork`` when the
caller's main module is a script and forking is sound (no CUDA context, no other threads:
``pyengine.utils.choose_start_method``), so a script without an ``if __name__ ==
"__main__":`` guard works; otherwise by ``multiprocessing``'s ``forkserver`` (a server
process that imported the engine once, so each engine starts by a fork of it, without
re-importing torch) or, with ``spawn``, by a fresh interpreter. Those two re-run the
caller's main module in the child: there it must be guarded, and an unguarded one fails
the start with one line that says so.

Failure semantics of the process boundary: the engine process exiting for any reason
(an exception in a step, OOM, ``kill -9``) makes ``get_output`` return an
``EngineDeadMessage`` at once (the process sentinel is watched with the pipe); the
front end exiting closes the pipe, and the engine process shuts down (see
``core.run_engine_core``); a start-up failure in the engine process is raised by the
constructor with the child's message; ``shutdown`` joins the process (terminate, then
kill, if it does not stop).
"""
from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import queue
import signal
import sys
import threading
from concurrent.futures import Future
from multiprocessing.connection import wait as mp_wait
from typing import Any, Optional, Union

from pyengine import envs
from pyengine.config import EngineConfig
from pyengine.engine.core import EngineCore
from pyengine.engine.core_proc import EngineCoreProc, run_engine_core
from pyengine.codec import decode, encode
from pyengine.exceptions import EngineDeadError, exception_from
from pyengine.messages import (EngineCoreAbort, EngineCoreOutputs, EngineCoreReady, EngineCoreRequest,
                               EngineCoreShutdown, EngineDeadMessage, UtilityOutput, UtilityRequest)
from pyengine.utils import UNGUARDED_MAIN_EXIT_CODE, choose_start_method, run_forked, unguarded_main_message

logger = logging.getLogger(__name__)

# transformers config modules of the supported families (pyengine/models/registry.py).
PRELOAD_CONFIG_MODULES = ("transformers.models.llama.configuration_llama",
                          "transformers.models.mistral.configuration_mistral",
                          "transformers.models.qwen2.configuration_qwen2",
                          "transformers.models.qwen3.configuration_qwen3")
# Seconds a utility call waits for the engine core's answer.
UTILITY_TIMEOUT_S = 60.0

Output = Union[EngineCoreOutputs, EngineDeadMessage, None]


def multiprocessing_enabled(default: bool = True) -> bool:
    """The ``VENGINE_ENABLE_MULTIPROCESSING`` switch (pyengine/envs.py); ``default`` when unset."""
    v = envs.enable_multiprocessing()
    return default if v is None else v


def make_client(config: EngineConfig, multiprocess: Optional[bool] = None, wait: bool = True) -> "EngineCoreClient":
    """The engine-core client for ``config``; ``multiprocess=None`` follows the environment
    switch. With ``wait=False`` the engine process may still be loading: the caller does
    its own set-up meanwhile, then calls ``wait_ready()``. Raises whatever the engine core
    raised while starting (``ValueError`` for a bad model or configuration)."""
    if multiprocess is None:
        multiprocess = multiprocessing_enabled()
    client = MPClient(config) if multiprocess else InprocClient(config)
    if wait:
        client.wait_ready()
    return client


class EngineCoreClient:
    """What a front end may ask of the engine core. ``ready`` holds the core's first
    report (its ``SchedulerStats``, KV-cache size included)."""

    ready: EngineCoreReady

    def __init__(self):
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count()
        self._calls_lock = threading.Lock()

    # -- to be provided ---------------------------------------------------------------
    def wait_ready(self) -> None:
        """Block until the engine core serves; raises its start-up error."""

    def _send(self, msg) -> None:
        raise NotImplementedError

    def get_output(self, timeout: Optional[float] = None) -> Output:
        """The next EngineCoreOutputs (or the EngineDeadMessage) from the core; None on
        timeout or after ``wake_output_reader``. One reader thread only."""
        raise NotImplementedError

    def wake_output_reader(self) -> None:
        raise NotImplementedError

    def is_alive(self) -> bool:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release what outlives ``shutdown`` (after the output reader stopped)."""

    # -- shared ---------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(EngineCoreAbort(list(request_ids)))

    def call_utility(self, method: str, *args: Any, timeout: float = UTILITY_TIMEOUT_S) -> Any:
        """Run ``EngineCore.<method>(*args)`` between two engine steps and return its result.
        Needs a thread reading ``get_output`` (AsyncLLM's output handler). Raises
        ``EngineDeadError``, ``TimeoutError``, or ``RuntimeError`` with the core's error."""
        fut: Future = Future()
        with self._calls_lock:
            call_id = next(self._call_ids)
            self._calls[call_id] = fut
        try:
            self._send(UtilityRequest(call_id, method, list(args)))
            return fut.result(timeout)
        except TimeoutError:
            raise TimeoutError(f"engine core utility call {method!r} got no answer within {timeout} s") from None
        finally:
            with self._calls_lock:
                self._calls.pop(call_id, None)

    def _take_utility(self, msg) -> bool:
        """Resolve the waiting call if ``msg`` answers one."""
        if not isinstance(msg, UtilityOutput):
            return False
        with self._calls_lock:
            fut = self._calls.get(msg.call_id)
        if fut is not None:
            if msg.error is None:
                fut.set_result(msg.result)
            else:
                fut.set_exception(exception_from(msg.error))
        return True

    def _fail_calls(self, message: str) -> None:
        with self._calls_lock:
            calls = list(self._calls.values())
        for fut in calls:
            if not fut.done():
                fut.set_exception(EngineDeadError(message))


class InprocClient(EngineCoreClient):
    """The busy loop on a native thread named ``EngineCore`` of this process."""

    def __init__(self, config: EngineConfig):
        super().__init__()
        self.input_queue: queue.Queue = queue.Queue()
        self.output_queue: queue.Queue = queue.Queue()
        self.engine_core: Optional[EngineCore] = None  # in-process only: tests and benchmarks look inside
        self._init_error: Optional[BaseException] = None
        self._started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(config,), name="EngineCore", daemon=True)
        self.thread.start()
        self._started.wait()
        if self._init_error is not None:
            self.thread.join()
            raise self._init_error

    def _run(self, config: EngineConfig) -> None:
        try:
            core = EngineCore(config)
            self.ready = EngineCoreReady(core.get_stats())
        except BaseException as e:  # raised by the constructor, on the caller's thread
            self._init_error = e
            self._started.set()
            return
        self.engine_core = core
        self._started.set()
        EngineCoreProc(core, self.input_queue, self.output_queue).run_busy_loop()

    def _send(self, msg) -> None:
        self.input_queue.put(msg)

    def get_output(self, timeout: Optional[float] = None) -> Output:
        while True:
            try:
                msg = self.output_queue.get(timeout=timeout)
            except queue.Empty:
                return None
            if self._take_utility(msg):
                continue
            if isinstance(msg, EngineDeadMessage):
                self._fail_calls(msg.message)
            return msg

    def wake_output_reader(self) -> None:
        self.output_queue.put(None)

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        self.input_queue.put(EngineCoreShutdown())
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout)
        self._fail_calls("the engine was shut down")


def _mp_context(config: EngineConfig, prefer_fork: bool = True):
    """``(context, start note)``: see ``pyengine.utils.choose_start_method``."""
    method, note = choose_start_method(envs.multiproc_method(), "forkserver", prefer_fork)
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        # The server imports the engine and the config classes that unpickling an
        # EngineConfig needs (importing one costs seconds: it pulls in much of
        # transformers) once; each engine process is then a fork of it.
        ctx.set_forkserver_preload(["pyengine.engine.core", type(config.hf_config).__module__,
                                    *PRELOAD_CONFIG_MODULES])
    if not hasattr(sys, "argv"):  # an embedded interpreter (the C ABI) may have none
        sys.argv = [""]
    return ctx, note


def _exit_reason(code: Optional[int]) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def start_engine_core_process(config: EngineConfig, num_front_ends: int):
    """Start one engine-core process for ``num_front_ends`` front-end processes (each then
    serves through ``MPClient.attach(conn)``). Returns ``(process, [conn, ...])``; the
    caller owns the process: it watches its sentinel, and joins it once every front end has
    closed its connection (which ends the engine process). Never forked: the front ends
    are processes of their own, and a fork would inherit what the caller holds (its
    listening socket)."""
    ctx, _ = _mp_context(config, prefer_fork=False)
    pairs = [ctx.Pipe(duplex=True) for _ in range(num_front_ends)]
    level = logging.getLogger("pyengine").getEffectiveLevel()
    proc = ctx.Process(target=run_engine_core, args=(config, [b for _, b in pairs], level), name="EngineCore")
    proc.start()
    for _, b in pairs:
        b.close()
    return proc, [a for a, _ in pairs]


class MPClient(EngineCoreClient):
    """The busy loop in its own process (``core.run_engine_core``), over a duplex pipe.

    With ``conn`` (``attach``), the client joins an engine process that another process
    started and watches (``vengine serve --api-server-count N``: one engine, N front
    ends): it has no process handle, learns of the engine's death from the pipe's end, and
    its ``shutdown`` only closes its own connection."""

    def __init__(self, config: Optional[EngineConfig] = None, target=None, conn=None):
        super().__init__()
        self._send_lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        self._dead: Optional[EngineDeadMessage] = None
        self._closed = False
        # How the engine process was started ("fork", "forkserver", "spawn"; None: attached).
        self.start_method: Optional[str] = None
        if conn is not None:
            self._conn, self.proc = conn, None
            return
        ctx, self._start_note = _mp_context(config)
        self.start_method = ctx.get_start_method()
        self._conn, child_conn = ctx.Pipe(duplex=True)
        level = logging.getLogger("pyengine").getEffectiveLevel()
        target, args = target or run_engine_core, (config, child_conn, level)
        if self.start_method == "fork":  # the copy must not hold this side's ends open
            target, args = run_forked, ([self._conn, self._wake_r, self._wake_w], target, *args)
        self.proc = ctx.Process(target=target, args=args, name="EngineCore")
        self.proc.start()
        child_conn.close()

    @classmethod
    def attach(cls, conn) -> "MPClient":
        """A client on one connection of an engine process started elsewhere."""
        return cls(conn=conn)

    def wait_ready(self) -> None:
        if hasattr(self, "ready"):
            return
        first = self._recv(None)
        if not isinstance(first, EngineCoreReady):
            self._stop_process(5.0)
            unguarded = self.proc is not None and self.proc.exitcode == UNGUARDED_MAIN_EXIT_CODE
            self.close()
            if unguarded:
                raise RuntimeError(unguarded_main_message("The engine core process", self.start_method,
                                                          self._start_note))
            msg = first.message if isinstance(first, EngineDeadMessage) else f"unexpected first message {first!r}"
            error = exception_from(first.error) if isinstance(first, EngineDeadMessage) and first.error else None
            if isinstance(error, ValueError):  # a bad model or configuration, raised as it was raised
                raise error
            raise RuntimeError(f"The engine core failed to start: {msg}")
        self.ready = first
        logger.info("Engine core running in process %s.", self.pid)

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc is not None else None

    def _exit_reason(self) -> str:
        if self.proc is None:
            return "its connection closed"
        self.proc.join(0.5)
        return _exit_reason(self.proc.exitcode)

    def _send(self, msg) -> None:
        data = encode(msg)
        try:
            with self._send_lock:
                self._conn.send_bytes(data)
        except (OSError, ValueError) as e:  # ValueError: the pipe was closed here
            raise EngineDeadError(f"the engine core process is gone ({self._exit_reason()})") from e

    def _dead_message(self) -> EngineDeadMessage:
        return EngineDeadMessage(f"the engine core process died unexpectedly ({self._exit_reason()})")

    def _recv(self, timeout: Optional[float]):
        """One decoded message; None on timeout or wake-up; an EngineDeadMessage once the
        process is gone and the pipe holds nothing more."""
        conn = self._conn
        if not conn.poll(0):
            watch = [conn, self._wake_r] + ([self.proc.sentinel] if self.proc is not None else [])
            ready = mp_wait(watch, timeout)
            if not ready:
                return None
            if conn not in ready:
                if self._wake_r in ready:
                    os.read(self._wake_r, 512)
                    return None
                if not conn.poll(0):  # the process ended and left nothing unread
                    return self._dead_message()
        try:
            return decode(conn.recv_bytes())
        except (EOFError, OSError):
            return self._dead_message()

    def get_output(self, timeout: Optional[float] = None) -> Output:
        if self._dead is not None:
            return self._dead
        while True:
            msg = self._recv(timeout)
            if self._take_utility(msg):
                continue
            if isinstance(msg, EngineDeadMessage):
                self._dead = msg
                self._fail_calls(msg.message)
            return msg

    def wake_output_reader(self) -> None:
        try:
            os.write(self._wake_w, b"w")
        except OSError:
            pass

    def is_alive(self) -> bool:
        return self._dead is None and (self.proc is None or self.proc.is_alive())

    def _stop_process(self, timeout: float) -> None:
        self.proc.join(timeout)
        if self.proc.is_alive():
            logger.warning("The engine core process did not stop in %.0f s; terminating it.", timeout)
            self.proc.terminate()
            self.proc.join(5.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Ask the engine process to stop, join it (terminate / kill past ``timeout``)."""
        if self._closed:
            return
        if self.proc is None:  # attached: the engine's owner stops it
            self._fail_calls("the engine was shut down")
            self.wake_output_reader()
            return
        try:
            self._send(EngineCoreShutdown())
        except EngineDeadError:
            pass
        self._stop_process(timeout)
        self._fail_calls("the engine was shut down")
        self.wake_output_reader()

    def close(self) -> None:
        """Release the pipe and wake-up fds (after the output reader stopped)."""
        if self._closed:
            return
        self._closed = True
        self._conn.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        if self.proc is not None:
            try:
                self.proc.close()
            except ValueError:  # still running: shutdown was not called
                pass
