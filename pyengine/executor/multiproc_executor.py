"""Tensor parallelism over processes (mirrors vllm/v1/executor/multiproc_executor.py).

Rank 0 runs in this process (the engine core's), next to the scheduler; ranks 1..N-1
are worker processes (``pyengine.worker.worker.worker_main``), forked where that is sound
and the main module is a script, else spawned (``pyengine.utils.choose_start_method``).
All ranks join one torch.distributed group through a ``tcp://`` rendezvous on a port
picked at run time.
Each step rank 0 sends the step's packed inputs to the other ranks over the gloo group,
every rank runs the same forward (NCCL / gloo all-reduces inside), rank 0 gathers the
logits and samples, and, with async scheduling, broadcasts the sampled ids (the next step
may feed them from the device).

Failure handling: a monitor thread watches the worker processes. When one dies outside
shutdown, the executor is marked failed, and on CUDA the NCCL communicators are aborted
so that a collective waiting for the dead rank returns (gloo raises by itself); the step
in progress and every later one raise RuntimeError naming the rank, which the engine
core turns into EngineDeadError for every request. Workers exit when this process dies
(their pipe to it closes) or when a collective fails.
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.connection
import threading
import weakref

import torch.distributed

from pyengine import envs
from pyengine.config import EngineConfig
from pyengine.core.sched.output import SchedulerOutput
from pyengine.distributed import get_distributed_init_method, get_open_port
from pyengine.distributed.shm_broadcast import SpinWaiter
from pyengine.exceptions import exception_from
from pyengine.executor.abstract import Executor
from pyengine.messages import ErrorInfo
from pyengine.utils import UNGUARDED_MAIN_EXIT_CODE, choose_start_method, run_forked, unguarded_main_message
from pyengine.worker.worker import Worker, worker_main

logger = logging.getLogger(__name__)

# Workers and rank 0 rendezvous here; one host for now (multi-node would start the other
# ranks on their hosts with the same init method).
_HOST = "127.0.0.1"
_JOIN_TIMEOUT_S = 10.0
_POLL_S = 50e-6  # the longest sleep between looks at a step's completion event
_SPIN_S = 2e-3  # how long the first looks spin instead (a sleep overshoots by ~50 us)


class _WorkerHandle:
    def __init__(self, rank: int, proc, conn, start_method: str, start_note: str):
        self.rank, self.proc, self.conn = rank, proc, conn
        self.start_method, self.start_note = start_method, start_note  # for the unguarded-main message
        self.error: ErrorInfo | None = None  # what it reported
        self._lock = threading.Lock()  # the engine and the monitor thread both ask

    def poll_messages(self) -> None:
        try:
            while self.conn.poll():
                msg = self.conn.recv()
                if msg[0] == "error":
                    self.error = msg[1]
        except (EOFError, OSError):
            pass

    def failure(self) -> str | None:
        """A message if this worker died or reported an error, else None."""
        with self._lock:
            # The sentinel (like the worker's sockets) closes as the process starts exiting,
            # a moment before waitpid can reap it: a ready sentinel means dead.
            dead = bool(multiprocessing.connection.wait([self.proc.sentinel], timeout=0))
            if dead:
                self.proc.join(1.0)  # reap it, for the exit code
            self.poll_messages()
            if self.error is not None:
                return f"tensor-parallel worker rank {self.rank} failed: {self.error}"
            if dead and self.proc.exitcode == UNGUARDED_MAIN_EXIT_CODE:
                return unguarded_main_message(f"tensor-parallel worker rank {self.rank}", self.start_method,
                                              self.start_note)
            if dead:
                return f"tensor-parallel worker rank {self.rank} died (exit code {self.proc.exitcode})"
            return None


class _CheckedOutput:
    """An AsyncModelRunnerOutput whose ``get_output`` raises if a worker died meanwhile:
    it polls the copy's event instead of blocking on it (a step whose collective waits
    for a dead rank may never finish) — spinning for the first 2 ms, since a sleep ends
    ~50 µs late, then sleeping up to 50 µs between looks — and checks again after (with NCCL, an aborted
    collective completes with garbage rather than an error)."""

    def __init__(self, inner, executor: MultiprocExecutor):
        self._inner, self._executor = inner, executor

    def get_output(self):
        w = SpinWaiter(_SPIN_S, None, _POLL_S)
        while not self._inner.ready():
            self._executor.check_alive()
            w.wait()
        # (a speculative step's output runs the proposer here: collectives with every rank)
        out = self._executor._call(self._inner.get_output)
        self._executor.check_alive()
        return out


class MultiprocExecutor(Executor):
    """``config.tensor_parallel_size`` ranks: rank 0 here, the others started. Raises
    whatever loading the model raises on rank 0, or RuntimeError (ValueError when the
    worker's was one) naming the worker rank that failed to start."""

    def __init__(self, config: EngineConfig):
        if torch.distributed.is_initialized():
            raise RuntimeError("a torch.distributed process group already exists in this process; "
                               "only one tensor-parallel engine can run per process")
        self.config = config
        self.world_size = config.tensor_parallel_size
        self.workers: list[_WorkerHandle] = []
        self.failure: str | None = None
        self._ready = False
        self._closed = False
        self._non_blocking = False  # of the step in progress (execute_model -> sample_tokens)
        self._stop_r, self._stop_w = multiprocessing.Pipe(duplex=False)
        self.driver = Worker(config, 0, self.world_size,
                             get_distributed_init_method(_HOST, get_open_port(_HOST)))
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref().shutdown())
        try:
            method, note = choose_start_method(envs.multiproc_method(), "spawn")
            if method == "forkserver":  # its server preloads the engine core, not a worker
                method = "spawn"
            ctx = multiprocessing.get_context(method)
            for rank in range(1, self.world_size):
                parent_conn, child_conn = ctx.Pipe(duplex=True)
                target, args = worker_main, (config, rank, self.world_size, self.driver.init_method, child_conn)
                if method == "fork":  # the copy must not hold this side's ends open (see worker_main)
                    target, args = run_forked, ([self._stop_r, self._stop_w, parent_conn]
                                                + [w.conn for w in self.workers], target, *args)
                proc = ctx.Process(target=target, name=f"vengine-tp-rank{rank}", daemon=True, args=args)
                proc.start()
                child_conn.close()
                self.workers.append(_WorkerHandle(rank, proc, parent_conn, method, note))
            self.driver.init_device(peer_failure=self._worker_failure)
            self._monitor = threading.Thread(target=self._monitor_workers, name="tp-monitor", daemon=True)
            self._monitor.start()
            self.driver.load_model()
        except BaseException as e:
            self._raise_start_failure(e)
        self.driver_runner = self.driver.model_runner

    def _raise_start_failure(self, e: BaseException):
        """Shut everything down; raise the worker's error when one failed (the error rank 0
        saw is then only the broken collective), else ``e``."""
        msg = self._worker_failure(wait_s=2.0)
        self.shutdown()
        if msg is None:
            raise e
        failed = next((w for w in self.workers if w.error is not None), None)
        error = exception_from(failed.error) if failed is not None else None
        raise (ValueError if isinstance(error, ValueError) else RuntimeError)(msg) from e

    def _worker_failure(self, wait_s: float = 0.0) -> str | None:
        """The first worker failure message, waiting up to ``wait_s`` for a dying worker's
        report (a broken collective on rank 0 may come before the worker's message)."""
        if wait_s > 0 and self.workers:
            multiprocessing.connection.wait([w.proc.sentinel for w in self.workers], timeout=wait_s)
        for w in self.workers:
            msg = w.failure()
            if msg is not None:
                return msg
        return None

    def _monitor_workers(self) -> None:
        sentinels = {w.proc.sentinel: w for w in self.workers}
        ready = multiprocessing.connection.wait(list(sentinels) + [self._stop_r])
        if self._closed or self._stop_r in ready:
            return
        self.failure = self._worker_failure(wait_s=0.5) or "a tensor-parallel worker died"
        logger.error("%s; the engine stops", self.failure)
        if self.config.device.type == "cuda":
            self.driver.tp.abort()  # unblock rank 0 if it waits in a collective on the dead rank

    def check_alive(self) -> None:
        """Raises RuntimeError if a worker died."""
        if self.failure is not None:
            raise RuntimeError(self.failure)

    def initialize_kv_cache(self) -> int:
        try:
            n = self.driver.initialize_kv_cache()
        except BaseException as e:
            self._raise_start_failure(e)
        self._ready = True
        return n

    def execute_model(self, so: SchedulerOutput, non_blocking: bool = False, grammar_output=None,
                      defer_sampling: bool = False):
        self._non_blocking = non_blocking
        return self._checked(self.driver_runner.execute_model, so, non_blocking, grammar_output, defer_sampling)

    def sample_tokens(self, grammar_output=None):
        return self._checked(self.driver_runner.sample_tokens, grammar_output)

    def profile(self, is_start: bool, out_dir: str = "", trace: bool = True):
        return self._call(super().profile, is_start, out_dir, trace)

    def _call(self, fn, *args):
        """``fn(*args)`` (a runner call), its failure turned into the worker's failure
        message when a worker died."""
        self.check_alive()
        try:
            return fn(*args)
        except Exception as e:
            msg = self.failure or self._worker_failure(wait_s=1.0)
            if msg is None:
                raise
            raise RuntimeError(msg) from e

    def _checked(self, fn, *args):
        """``_call(fn, *args)``; a non-blocking output wrapped in ``_CheckedOutput``."""
        out = self._call(fn, *args)
        if out is None:  # sampling deferred
            return None
        if not self._non_blocking:
            self.check_alive()
            return out
        return _CheckedOutput(out, self)

    def shutdown(self) -> None:
        """Stop the workers (rank 0 sends stop; stragglers are terminated), free rank 0's
        model and the process group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop_w.close()
        if self._ready and self.failure is None and self.driver.tp is not None:
            try:
                self.driver.model_runner.broadcast_stop()
            except Exception as e:
                logger.debug("stop broadcast: %s", e)
        monitor = getattr(self, "_monitor", None)
        if monitor is not None and monitor is not threading.current_thread():
            monitor.join(5.0)  # it sees the closed pipe at once; gone, it cannot hinder a later fork
        if monitor is None or not monitor.is_alive():
            self._stop_r.close()
        for w in self.workers:
            w.proc.join(_JOIN_TIMEOUT_S if self._ready else 0.0)
            if w.proc.is_alive():
                w.proc.terminate()
                w.proc.join(2.0)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(2.0)
            w.conn.close()
        self.driver.shutdown()
