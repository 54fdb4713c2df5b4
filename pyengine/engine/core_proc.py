"""EngineCoreProc, EngineCore's busy loop between an input and an output queue, and the
host of the engine-core process (its front-end connections, start-up, exit when the front
ends are gone). Mirrors vllm/v1/engine/core.py's EngineCoreProc / run_engine_core."""
from __future__ import annotations

import itertools
import logging
import os
import queue
import signal
import threading

from pyengine import envs
from pyengine.config import EngineConfig
from pyengine.engine.core import EngineCore
from pyengine.messages import (
    EngineCoreAbort,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreShutdown,
    EngineDeadMessage,
    ErrorInfo,
    UtilityOutput,
    UtilityRequest,
)

logger = logging.getLogger(__name__)


EngineCoreInput = EngineCoreRequest | EngineCoreAbort | UtilityRequest | EngineCoreShutdown


class EngineCoreProc:
    """EngineCore's busy loop between an input queue (adds, aborts, utility calls,
    shutdown) and an output queue (EngineCoreOutputs, UtilityOutputs, and one
    EngineDeadMessage if the loop dies). Blocks only when there is no work. The
    in-process client runs it on a thread; the multi-process client in the main thread of
    its own process (``pyengine.engine.core_proc``). Mirrors vllm/v1/engine/core.py's
    EngineCoreProc."""

    def __init__(self, engine_core: EngineCore, input_queue: queue.Queue[EngineCoreInput],
                 output_queue: queue.Queue):
        self.engine_core = engine_core
        self.input_queue = input_queue
        self.output_queue = output_queue

    def run_busy_loop(self) -> bool:
        """Serve until an EngineCoreShutdown arrives (returns True) or a step raises (puts
        an EngineDeadMessage on the output queue, returns False). Releases the device
        either way."""
        core = self.engine_core
        step = core.step_fn()
        try:
            while True:
                if not core.has_work() and not self._handle(self.input_queue.get()):
                    return True
                if not self._drain_input():
                    return True
                outputs = step()
                if outputs is not None:  # also output-less steps (prefill chunks): fresh stats
                    self.output_queue.put(outputs)
        except BaseException as e:
            logger.exception("EngineCore loop died")
            self.output_queue.put(EngineDeadMessage(f"{type(e).__name__}: {e}", ErrorInfo.of(e)))
            return False
        finally:
            core.shutdown()

    def _drain_input(self) -> bool:
        while True:
            try:
                msg = self.input_queue.get_nowait()
            except queue.Empty:
                return True
            if not self._handle(msg):
                return False

    def _handle(self, msg) -> bool:
        """Apply one input message; False means shut down."""
        if isinstance(msg, EngineCoreRequest):
            self.engine_core.add_request(msg)
        elif isinstance(msg, EngineCoreAbort):
            self.engine_core.abort_requests(msg.request_ids)
        elif isinstance(msg, UtilityRequest):
            self.output_queue.put(self.engine_core.call_utility(msg))
        elif isinstance(msg, EngineCoreShutdown):
            return False
        return True


# ---- the engine-core process (multi-process client) -------------------------------------

_STOP_WRITER = object()
# An orphaned engine process (its front end gone) that does not stop within this many
# seconds is exited hard: it must never keep holding the GPU.
_ORPHAN_GRACE_S = 30.0


class _FrontEndLinks:
    """The engine process's side of its front-end connections (one per front-end process:
    ``--api-server-count`` runs several). One reader thread per connection decodes its
    inputs onto the busy loop's input queue; one writer thread encodes the loop's outputs
    and routes them: request outputs to the front end that sent the request, utility
    answers to the caller, everything else (ready, death) to all. A front end that goes
    away has its requests aborted; when the last one is gone, the process shuts down."""

    def __init__(self, conns: list, input_queue: queue.Queue, serving):
        self.conns = conns
        self.input_queue = input_queue
        self.serving = serving  # threading.Event: set once EngineCore is built
        self.owner: dict[str, int] = {}  # request id -> front end (with several)
        self.calls: dict[int, tuple[int, int]] = {}  # engine-side call id -> (front end, its call id)
        self._call_ids = itertools.count()
        self._open = len(conns)
        self._lock = threading.Lock()

    def start_readers(self) -> None:
        from pyengine.utils import mark_fork_safe

        for i in range(len(self.conns)):
            # It only waits on its pipe: tensor-parallel workers may still be forked from here.
            mark_fork_safe(threading.Thread(target=self._read, args=(i,), name=f"EngineCoreInput-{i}",
                                            daemon=True)).start()

    def _read(self, i: int) -> None:
        from pyengine.codec import decode

        conn, several = self.conns[i], len(self.conns) > 1
        while True:
            try:
                msg = decode(conn.recv_bytes())
            except (EOFError, OSError):
                self._gone(i)
                return
            if isinstance(msg, UtilityRequest):
                with self._lock:
                    call_id = next(self._call_ids)
                    self.calls[call_id] = (i, msg.call_id)
                msg.call_id = call_id
            elif several and isinstance(msg, EngineCoreRequest):
                self.owner[msg.request_id] = i
            self.input_queue.put(msg)
            if isinstance(msg, EngineCoreShutdown):
                return

    def _gone(self, i: int) -> None:
        with self._lock:
            self._open -= 1
            last = self._open == 0
        if not last:  # the others keep going; its requests are dropped
            logger.warning("Front end %d is gone; aborting its requests.", i)
            self.input_queue.put(EngineCoreAbort([r for r, o in list(self.owner.items()) if o == i]))
            return
        logger.warning("The front end is gone; the engine core is shutting down.")
        if not self.serving.is_set():  # still loading: nothing to finish, do not hold the device
            os._exit(1)
        self.input_queue.put(EngineCoreShutdown())
        threading.Timer(_ORPHAN_GRACE_S, os._exit, (1,)).start()

    def write(self, msg) -> None:
        """Send one busy-loop output where it belongs (OSError: that front end is gone;
        its reader sees it too)."""
        from pyengine.codec import encode

        if isinstance(msg, UtilityOutput):
            i, msg.call_id = self.calls.pop(msg.call_id, (0, msg.call_id))
            self._send(i, encode(msg))
        elif isinstance(msg, EngineCoreOutputs) and len(self.conns) > 1:
            per: list[list] = [[] for _ in self.conns]
            owner = self.owner
            for o in msg.outputs:
                per[owner.get(o.request_id, 0)].append(o)
                if o.finish_reason is not None:
                    owner.pop(o.request_id, None)
            for i, outs in enumerate(per):  # every front end gets the step's stats
                self._send(i, encode(EngineCoreOutputs(outs, msg.scheduler_stats, msg.timestamp)))
        else:
            data = encode(msg)
            for i in range(len(self.conns)):
                self._send(i, data)

    def _send(self, i: int, data: bytes) -> None:
        try:
            self.conns[i].send_bytes(data)
        except OSError:
            pass


def run_engine_core(config: EngineConfig, conns, log_level: int = logging.WARNING) -> None:
    """Main of the engine-core process started by ``core_client.MPClient`` (or by
    ``vengine serve --api-server-count N``).

    ``conns``: a duplex ``multiprocessing`` connection to the front end, or a list of them
    (one per front-end process), carrying ``codec.encode``d messages (see
    ``_FrontEndLinks``). The busy loop runs here, on the main thread. The first output is
    ``EngineCoreReady``, or an ``EngineDeadMessage`` with ``during_startup`` if EngineCore
    could not be built. End of input from every front end (they exited or were killed)
    shuts the process down. Exit status 0 after a requested shutdown, 1 after a failure.
    SIGINT is ignored: the front end shuts this process down."""
    from pyengine.messages import EngineCoreReady
    from pyengine.utils import freeze_gc_heap

    conns = list(conns) if isinstance(conns, (list, tuple)) else [conns]
    # Ctrl-C reaches the whole process group: the front end leads that shutdown (its streams
    # cut with an error event, then EngineCoreShutdown), and end of its input stops this
    # process if it cannot; dying here first only printed a KeyboardInterrupt traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [engine core]: %(message)s")
    # One engine in this process, ever: torch's symmetric memory, whose rendezvous hangs for
    # a second tensor-parallel engine in one process, is safe here, so tensor parallelism
    # takes the fast all-reduce path unless the user said otherwise (the worker processes
    # this one starts inherit the setting).
    envs.default_symm_mem_allreduce_on()
    input_queue: queue.Queue = queue.Queue()
    output_queue: queue.Queue = queue.Queue()
    links = _FrontEndLinks(conns, input_queue, threading.Event())

    def writer() -> None:
        while True:
            msg = output_queue.get()
            if msg is _STOP_WRITER:
                return
            links.write(msg)

    links.start_readers()
    try:
        core = EngineCore(config)
    except BaseException as e:  # reported to the front ends, which raise it to the user
        logger.debug("EngineCore failed to start", exc_info=True)
        links.write(EngineDeadMessage(str(e) or type(e).__name__, ErrorInfo.of(e), during_startup=True))
        for c in conns:
            c.close()
        _exit(1)
    freeze_gc_heap()
    out_thread = threading.Thread(target=writer, name="EngineCoreOutput", daemon=True)
    out_thread.start()
    output_queue.put(EngineCoreReady(core.get_stats()))
    links.serving.set()
    ok = EngineCoreProc(core, input_queue, output_queue).run_busy_loop()
    output_queue.put(_STOP_WRITER)
    out_thread.join(10)
    for c in conns:
        c.close()
    _exit(0 if ok else 1)


def run_engine_core_on_devices(devices, config: EngineConfig, conns, log_level: int = logging.WARNING) -> None:
    """``run_engine_core`` on the GPUs ``devices`` (a ``CUDA_VISIBLE_DEVICES`` value, set
    before CUDA starts in this process; None keeps the environment): one data-parallel
    rank's engine-core process."""
    if devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = devices
    run_engine_core(config, conns, log_level)


def _exit(code: int) -> None:
    """Leave without the interpreter's teardown (torch's is slow and there is nothing to
    save: the device memory goes back with the process)."""
    import os
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
