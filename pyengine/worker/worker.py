"""One tensor-parallel rank: its device, its place in the process group and its
ModelRunner (mirrors vllm/v1/worker/gpu_worker.py), and the entry point of the worker
processes (ranks > 0) that MultiprocExecutor starts (role of vllm/v1/executor/
multiproc_executor.py's WorkerProc)."""
from __future__ import annotations

import logging
import os
import signal
import threading
import traceback
from collections.abc import Callable

import torch

from pyengine.config import EngineConfig
from pyengine.distributed import init_distributed_environment
from pyengine.messages import ErrorInfo
from pyengine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Worker:
    """Rank ``rank`` of ``world_size``. Rank 0 lives in the engine-core process and runs
    the steps the scheduler hands it; the other ranks run ``busy_loop``."""

    def __init__(self, config: EngineConfig, rank: int, world_size: int, init_method: str):
        if config.device.type == "cuda":  # one GPU per rank
            config = config.replace(device=torch.device("cuda", rank))
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.init_method = init_method
        self.tp = None
        self.model_runner: ModelRunner | None = None
        self._threads_before: int | None = None

    def init_device(self, peer_failure: Callable[[], str | None] | None = None) -> None:
        """Join the process group (see ``init_distributed_environment``). On CPU, the ranks
        share the host's cores: each takes an equal part of torch's intra-op threads
        (process-wide for rank 0's process), since oversubscribed ranks stall each other's
        collectives."""
        if self.config.device.type == "cpu":
            self._threads_before = torch.get_num_threads()  # restored by shutdown
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            torch.set_num_threads(max(1, cores // self.world_size))
        self.tp = init_distributed_environment(self.rank, self.world_size, self.init_method, self.config.device,
                                               peer_failure=peer_failure)
        self.tp.enable_symm_mem(self.config.dtype)

        def check() -> None:  # rank 0, while it waits for a free slot of the step queue
            msg = peer_failure() if peer_failure is not None else None
            if msg is not None:
                raise RuntimeError(msg)
        self.tp.init_message_queue(check if self.rank == 0 else None)

    def load_model(self) -> None:
        self.model_runner = ModelRunner(self.config, self.tp)

    def initialize_kv_cache(self) -> int:
        """Every rank sizes its KV cache, the group takes the smallest, every rank allocates
        that many blocks (then warm-up and CUDA graphs, collectives in lockstep). Returns
        the number of blocks."""
        n = self.tp.all_reduce_min(self.model_runner.determine_num_blocks())
        return self.model_runner.initialize_kv_cache(n)

    def busy_loop(self) -> None:
        """Ranks > 0: follow rank 0's steps until it sends stop."""
        while self.model_runner.execute_follower_step():
            pass

    def shutdown(self) -> None:
        if self.model_runner is not None:
            self.model_runner.release()
        if self.tp is not None:
            self.tp.destroy()
            self.tp = None
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None


def _exit_when_parent_dies(conn) -> None:
    """The parent never writes to this pipe: EOF means its process is gone."""
    try:
        conn.recv()
    except (EOFError, OSError):
        pass
    os._exit(1)


def worker_main(config: EngineConfig, rank: int, world_size: int, init_method: str, conn) -> None:
    """Body of a worker process (rank > 0). Reports a start-up or step failure to the
    parent as ``("error", ErrorInfo)`` on ``conn``, then exits
    non-zero; exits when the parent dies; exits 0 after rank 0's stop."""
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: rank 0's process leads the shutdown (core_proc)
    threading.Thread(target=_exit_when_parent_dies, args=(conn,), name="parent-watch", daemon=True).start()
    worker = Worker(config, rank, world_size, init_method)
    try:
        worker.init_device()
        worker.load_model()
        worker.initialize_kv_cache()
        conn.send(("ready",))
        worker.busy_loop()
        worker.shutdown()
    except BaseException as e:
        logger.error("tensor-parallel rank %d failed:\n%s", rank, traceback.format_exc())
        try:
            conn.send(("error", ErrorInfo.of(e)))
        except Exception:
            pass
        os._exit(1)
    # Skip interpreter teardown: the process group is gone and nothing else needs flushing.
    os._exit(0)
