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
from typing import Any

from pyengine import envs
from pyengine.codec import decode, encode
from pyengine.config import EngineConfig
from pyengine.engine.core import EngineCore
from pyengine.engine.core_proc import EngineCoreProc, run_engine_core, run_engine_core_on_devices
from pyengine.exceptions import EngineDeadError, exception_from
from pyengine.messages import (
    EngineCoreAbort,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    EngineCoreShutdown,
    EngineDeadMessage,
    FinishReason,
    UtilityOutput,
    UtilityRequest,
)
from pyengine.utils import UNGUARDED_MAIN_EXIT_CODE, choose_start_method, run_forked, unguarded_main_message

logger = logging.getLogger(__name__)

# transformers config modules of the supported families (pyengine/models/registry.py).
PRELOAD_CONFIG_MODULES = ("transformers.models.llama.configuration_llama",
                          "transformers.models.mistral.configuration_mistral",
                          "transformers.models.qwen2.configuration_qwen2",
                          "transformers.models.qwen3.configuration_qwen3")
# Seconds a utility call waits for the engine core's answer.
UTILITY_TIMEOUT_S = 60.0

Output = EngineCoreOutputs | EngineDeadMessage | None


def multiprocessing_enabled(default: bool = True) -> bool:
    """The ``VENGINE_ENABLE_MULTIPROCESSING`` switch (pyengine/envs.py); ``default`` when unset."""
    v = envs.enable_multiprocessing()
    return default if v is None else v


def make_client(config: EngineConfig, multiprocess: bool | None = None, wait: bool = True) -> EngineCoreClient:
    """The engine-core client for ``config``; ``multiprocess=None`` follows the environment
    switch. With ``wait=False`` the engine process may still be loading: the caller does
    its own set-up meanwhile, then calls ``wait_ready()``. Raises whatever the engine core
    raised while starting (``ValueError`` for a bad model or configuration)."""
    if multiprocess is None:
        multiprocess = multiprocessing_enabled()
    client: EngineCoreClient
    if config.data_parallel_size > 1:
        client = DPClient.start(config, multiprocess)
    else:
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

    def get_output(self, timeout: float | None = None) -> Output:
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

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Add the engine requests of one front-end request (its n > 1 samples) together:
        a data-parallel client places them on one engine core."""
        for r in requests:
            self.add_request(r)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(EngineCoreAbort(list(request_ids)))

    def call_utility_all(self, method: str, *args: Any, timeout: float = UTILITY_TIMEOUT_S) -> list:
        """``call_utility`` on every engine core; one result per core (one here)."""
        return [self.call_utility(method, *args, timeout=timeout)]

    def dead_engines(self) -> dict[int, str]:
        """{engine index: why it died} of the engine cores that died while others serve
        (data parallelism); empty otherwise (one core's death is the engine's)."""
        return {}

    def engine_count(self) -> int:
        """How many engine cores serve behind this client."""
        return 1

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
        self.engine_core: EngineCore | None = None  # in-process only: tests and benchmarks look inside
        self._init_error: BaseException | None = None
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

    def get_output(self, timeout: float | None = None) -> Output:
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


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def data_parallel_devices(config: EngineConfig, rank: int) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` of data-parallel rank ``rank``: its
    ``tensor_parallel_size`` devices (rank r takes r*tp .. r*tp+tp-1 of the devices this
    process sees); None off CUDA or without data parallelism (the environment is kept)."""
    if config.device.type != "cuda" or config.data_parallel_size == 1:
        return None
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = ([d.strip() for d in visible.split(",") if d.strip()] if visible
           else [str(i) for i in range(torch.cuda.device_count())])
    tp = config.tensor_parallel_size
    mine = ids[rank * tp:(rank + 1) * tp]
    if len(mine) < tp:
        raise ValueError(f"data-parallel rank {rank} needs devices {rank * tp}..{(rank + 1) * tp - 1}; "
                         f"only {len(ids)} visible ({','.join(ids)}).")
    return ",".join(mine)


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
    rank = config.data_parallel_rank
    proc = ctx.Process(target=run_engine_core_on_devices,
                       args=(data_parallel_devices(config, rank), config, [b for _, b in pairs], level),
                       name=f"EngineCore_DP{rank}" if config.data_parallel_size > 1 else "EngineCore")
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

    def __init__(self, config: EngineConfig | None = None, target=None, conn=None, prefer_fork: bool = True,
                 close_in_child: tuple = ()):
        super().__init__()
        self._send_lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        self._dead: EngineDeadMessage | None = None
        self._closed = False
        # How the engine process was started ("fork", "forkserver", "spawn"; None: attached).
        self.start_method: str | None = None
        if conn is not None:
            self._conn, self.proc = conn, None
            return
        assert config is not None  # the engine to start (only an attached client has none)
        ctx, self._start_note = _mp_context(config, prefer_fork)
        self.start_method = ctx.get_start_method()
        self._conn, child_conn = ctx.Pipe(duplex=True)
        level = logging.getLogger("pyengine").getEffectiveLevel()
        target = target or run_engine_core
        args: tuple = (config, child_conn, level)
        devices = data_parallel_devices(config, config.data_parallel_rank)
        if devices is not None:  # this rank's GPUs only, set in the child before CUDA starts
            target, args = run_engine_core_on_devices, (devices, *args)
        if self.start_method == "fork":  # the copy must not hold this side's ends open
            target, args = run_forked, ([self._conn, self._wake_r, self._wake_w, *close_in_child], target, *args)
        self.proc = ctx.Process(target=target, args=args, name="EngineCore")
        self.proc.start()
        child_conn.close()

    def parent_ends(self) -> tuple:
        """This side's pipe ends (the connection and the wake-up fds)."""
        return (self._conn, self._wake_r, self._wake_w)

    @classmethod
    def attach(cls, conn) -> MPClient:
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
                raise RuntimeError(unguarded_main_message("The engine core process", self.start_method,  # type: ignore[arg-type]
                                                          self._start_note))  # (it started the process)
            msg = first.message if isinstance(first, EngineDeadMessage) else f"unexpected first message {first!r}"
            error = exception_from(first.error) if isinstance(first, EngineDeadMessage) and first.error else None
            if isinstance(error, ValueError):  # a bad model or configuration, raised as it was raised
                raise error
            raise RuntimeError(f"The engine core failed to start: {msg}")
        self.ready = first
        logger.info("Engine core running in process %s.", self.pid)

    @property
    def pid(self) -> int | None:
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

    def _recv(self, timeout: float | None):
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

    def get_output(self, timeout: float | None = None) -> Output:
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
        proc = self.proc
        if proc is None:  # attached: the engine's owner stops it
            return
        proc.join(timeout)
        if proc.is_alive():
            logger.warning("The engine core process did not stop in %.0f s; terminating it.", timeout)
            proc.terminate()
            proc.join(5.0)
        if proc.is_alive():
            proc.kill()
            proc.join()

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


class DPClient(EngineCoreClient):
    """N engine cores behind one front end: vLLM's data parallelism (mirrors
    vllm/v1/engine/core_client.py's ``DPLBAsyncMPClient`` and the load its DP coordinator
    publishes). Each core is a client of its own (``MPClient``: a process per
    data-parallel rank, with ``CUDA_VISIBLE_DEVICES`` set to the rank's devices; or an
    attached connection, ``vengine serve --api-server-count``), with its own scheduler and
    KV cache.

    Placement: each front-end request (its n > 1 samples together) goes to the core with
    the least load, load being the requests it has waiting plus running: the larger of
    this front end's own count (placed, not yet finished) and the core's last published
    ``num_waiting + num_running`` (every front end's) plus what this front end placed
    since; ties go round-robin. Aborts go to the owning core; utility calls to every core.

    One reader thread per core moves its outputs onto one queue (``get_output``), so the
    front end sees one stream of ``EngineCoreOutputs``, each with its core's
    ``scheduler_stats`` (``engine_index``). A core that dies fails only its own requests
    (a terminal output with finish_reason "error" each) and is placed on no more;
    ``dead_engines`` names it. When the last one dies, ``get_output`` returns the
    ``EngineDeadMessage``."""

    def __init__(self, clients: list[EngineCoreClient]):
        super().__init__()
        if len(clients) < 2:
            raise ValueError("a data-parallel client needs at least two engine cores")
        self.clients = clients
        n = len(clients)
        self._lock = threading.Lock()
        self.owner: dict[str, int] = {}  # request id -> engine index
        self.in_flight = [0] * n  # this front end's requests on each core, not yet finished
        self.published = [0] * n  # each core's last published num_waiting + num_running
        self.since_published = [0] * n  # placed on each core since its last stats
        self.num_placed = [0] * n  # cumulative engine requests placed on each core
        self.dead: dict[int, str] = {}
        self._rr = 0
        self._out: queue.Queue = queue.Queue()
        self._stopping = False
        self._readers: list[threading.Thread] = []

    @classmethod
    def start(cls, config: EngineConfig, multiprocess: bool = True) -> DPClient:
        """Start ``config.data_parallel_size`` engine cores, rank r with
        ``config.replace(data_parallel_rank=r)``: processes (never forked on CUDA, so that
        each rank's ``CUDA_VISIBLE_DEVICES`` takes effect), or with ``multiprocess=False``
        threads of this process (CPU debugging). Raises what a core raised while starting
        (the others are stopped)."""
        clients: list[EngineCoreClient] = []
        try:
            for r in range(config.data_parallel_size):
                cfg = config.replace(data_parallel_rank=r)
                if multiprocess:  # a forked rank must not hold the earlier ranks' pipe ends open
                    ends = tuple(e for c in clients if isinstance(c, MPClient) for e in c.parent_ends())
                    clients.append(MPClient(cfg, prefer_fork=config.device.type != "cuda", close_in_child=ends))
                else:
                    clients.append(InprocClient(cfg))
        except BaseException:
            for c in clients:
                c.shutdown()
                c.close()
            raise
        return cls(clients)

    @classmethod
    def attach(cls, conns: list) -> DPClient:
        """A client over one connection to each engine process of ranks 0..N-1, started
        elsewhere (``vengine serve --api-server-count``)."""
        return cls([MPClient.attach(c) for c in conns])

    def wait_ready(self) -> None:
        if hasattr(self, "ready"):
            return
        try:
            for c in self.clients:
                c.wait_ready()
        except BaseException:
            for c in self.clients:
                c.shutdown()
                c.close()
            raise
        self.ready_all = [c.ready for c in self.clients]
        self.ready = self.ready_all[0]
        for i in range(len(self.clients)):
            self.published[i] = 0
            t = threading.Thread(target=self._read, args=(i,), name=f"EngineCoreOutput-DP{i}", daemon=True)
            self._readers.append(t)
            t.start()

    def engine_count(self) -> int:
        return len(self.clients)

    # -- placement ------------------------------------------------------------------------
    def _load(self, i: int) -> int:
        return max(self.in_flight[i], self.published[i] + self.since_published[i])

    def choose_engine(self) -> int:
        """The engine index the next request goes to (call with the lock held). Raises
        EngineDeadError when every core is dead."""
        n = len(self.clients)
        best, best_load = -1, None
        for k in range(n):
            i = (self._rr + k) % n
            if i in self.dead:
                continue
            load = self._load(i)
            if best_load is None or load < best_load:
                best, best_load = i, load
        if best < 0:
            raise EngineDeadError("every engine core died: " + "; ".join(f"{i}: {m}" for i, m in
                                                                         sorted(self.dead.items())))
        self._rr = (best + 1) % n
        return best

    def add_request(self, request: EngineCoreRequest) -> None:
        self.add_requests([request])

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        if not requests:
            return
        with self._lock:  # a core's death handler waits: it fails what was placed on it
            i = self.choose_engine()
            for r in requests:
                self.owner[r.request_id] = i
            k = len(requests)
            self.in_flight[i] += k
            self.since_published[i] += k
            self.num_placed[i] += k
            try:
                for r in requests:
                    self.clients[i].add_request(r)
            except EngineDeadError:
                pass  # its reader sees the death and fails these requests

    def abort_requests(self, request_ids: list[str]) -> None:
        per: dict[int, list[str]] = {}
        with self._lock:
            for rid in request_ids:
                i = self.owner.get(rid)
                if i is not None and i not in self.dead:
                    per.setdefault(i, []).append(rid)
        for i, ids in per.items():
            try:
                self.clients[i].abort_requests(ids)
            except EngineDeadError:
                pass

    # -- outputs ----------------------------------------------------------------------------
    def _read(self, i: int) -> None:
        client = self.clients[i]
        while True:
            msg = client.get_output(None)
            if self._stopping:
                return
            if msg is None:
                continue
            if isinstance(msg, EngineDeadMessage):
                self._core_died(i, msg)
                return
            with self._lock:
                st = msg.scheduler_stats
                if st is not None:
                    self.published[i] = st.num_waiting + st.num_running
                    self.since_published[i] = 0
                for o in msg.outputs:
                    if o.finish_reason is not None and self.owner.pop(o.request_id, None) is not None:
                        self.in_flight[i] -= 1
            self._out.put(msg)

    def _core_died(self, i: int, msg: EngineDeadMessage) -> None:
        reason = msg.message
        with self._lock:
            self.dead[i] = reason
            ids = [rid for rid, o in self.owner.items() if o == i]
            for rid in ids:
                del self.owner[rid]
            self.in_flight[i] = 0
            all_dead = len(self.dead) == len(self.clients)
        logger.error("Engine core %d died (%s); %d of its requests failed.%s", i, reason, len(ids),
                     "" if all_dead else " The other engine cores go on serving.")
        if ids:
            error = f"engine core {i} died: {reason}"
            self._out.put(EngineCoreOutputs([EngineCoreOutput(rid, [], finish_reason=FinishReason.ERROR, error=error)
                                             for rid in ids], None, 0.0))
        if all_dead:
            self._fail_calls(reason)
            self._out.put(EngineDeadMessage("every engine core died: " + "; ".join(
                f"engine core {k}: {m}" for k, m in sorted(self.dead.items())), msg.error))

    def get_output(self, timeout: float | None = None) -> Output:
        try:
            return self._out.get(timeout=timeout)
        except queue.Empty:
            return None

    def wake_output_reader(self) -> None:
        self._out.put(None)

    def dead_engines(self) -> dict[int, str]:
        with self._lock:
            return dict(self.dead)

    def is_alive(self) -> bool:
        return any(i not in self.dead and c.is_alive() for i, c in enumerate(self.clients))

    # -- utility calls ------------------------------------------------------------------------
    def call_utility_all(self, method: str, *args: Any, timeout: float = UTILITY_TIMEOUT_S) -> list:
        """``call_utility`` on every live engine core, in engine order (each core's reader
        thread resolves its answers)."""
        live = [c for i, c in enumerate(self.clients) if i not in self.dead]
        if not live:
            raise EngineDeadError("every engine core died")
        return [c.call_utility(method, *args, timeout=timeout) for c in live]

    def call_utility(self, method: str, *args: Any, timeout: float = UTILITY_TIMEOUT_S) -> Any:
        """Every live core's answer; booleans combined (True when every core answered
        True: ``reset_prefix_cache``), anything else as the list of answers."""
        results = self.call_utility_all(method, *args, timeout=timeout)
        return all(results) if all(isinstance(r, bool) for r in results) else results

    # -- lifetime -------------------------------------------------------------------------------
    def shutdown(self) -> None:
        self._stopping = True
        for c in self.clients:
            c.shutdown()
            c.wake_output_reader()
        for t in self._readers:
            if t is not threading.current_thread():
                t.join(10)
        self._fail_calls("the engine was shut down")

    def close(self) -> None:
        for c in self.clients:
            c.close()
