"""EngineCore (schedule -> execute -> update) and EngineCoreProc, its busy loop on one
native thread (mirrors vllm/v1/engine/core.py)."""
from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from typing import Optional, Union

from pyengine.config import EngineConfig
from pyengine.core.sched.async_scheduler import AsyncScheduler
from pyengine.core.sched.scheduler import Scheduler
from pyengine.engine.messages import (EngineCoreAbort, EngineCoreOutputs, EngineCoreRequest,
                                      EngineDeadMessage)
from pyengine.request import Request, RequestStatus
from pyengine.worker.model_runner import ModelRunner

logger = logging.getLogger("pyengine")


class EngineCore:
    """Owns the scheduler and the model runner. Not thread-safe: one thread drives it."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_runner = ModelRunner(config)
        num_blocks = self.model_runner.initialize_kv_cache()
        capacity = (num_blocks - 1) * config.block_size
        if capacity < config.max_model_len:
            raise ValueError(f"The KV cache holds {capacity} tokens ({num_blocks - 1} blocks of "
                             f"{config.block_size}), fewer than max_model_len={config.max_model_len}; "
                             f"raise the KV cache size or lower max_model_len.")
        self.scheduler = (AsyncScheduler if config.async_scheduling else Scheduler)(config, num_blocks)
        # (scheduler output, pending runner output), oldest first.
        self.batch_queue: deque = deque()
        self.batch_queue_size = 2 if config.async_scheduling else 1
        logger.info("Asynchronous scheduling is %s.", "enabled" if config.async_scheduling else "disabled")

    def add_request(self, req: EngineCoreRequest) -> None:
        self.scheduler.add_request(Request(req.request_id, req.prompt_token_ids, req.sampling_params,
                                           req.max_tokens, req.arrival_time, req.priority))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_work(self) -> bool:
        return self.scheduler.has_requests() or bool(self.batch_queue)

    def step(self) -> Optional[EngineCoreOutputs]:
        """Schedule, execute, sample, update: one synchronous step."""
        if not self.scheduler.has_unfinished_requests():
            return self.scheduler.take_pending_outputs()
        so = self.scheduler.schedule()
        if so.is_empty:
            return self.scheduler.take_pending_outputs()
        return self.scheduler.update_from_output(so, self.model_runner.execute_model(so))

    def step_with_batch_queue(self) -> Optional[EngineCoreOutputs]:
        """Async scheduling: launch batch N+1 before consuming batch N's sampled tokens.

        Returns None (or only abort outputs) right after a launch that left the queue
        non-full, so the caller loops back and schedules the next batch at once."""
        if len(self.batch_queue) < self.batch_queue_size and self.scheduler.has_unfinished_requests():
            so = self.scheduler.schedule()
            if not so.is_empty:
                self.batch_queue.append((so, self.model_runner.execute_model(so, non_blocking=True)))
                if len(self.batch_queue) < self.batch_queue_size:
                    return self.scheduler.take_pending_outputs()
        if not self.batch_queue:
            return self.scheduler.take_pending_outputs()
        so, pending = self.batch_queue.popleft()
        return self.scheduler.update_from_output(so, pending.get_output())

    def shutdown(self) -> None:
        """Release device memory (model, KV cache, graphs); no more steps after this."""
        self.batch_queue.clear()
        self.model_runner.release()

    def step_fn(self):
        return self.step_with_batch_queue if self.config.async_scheduling else self.step


_SHUTDOWN = object()
EngineCoreInput = Union[EngineCoreRequest, EngineCoreAbort, object]


class EngineCoreProc:
    """Runs EngineCore's busy loop on one native thread between an input queue (adds,
    aborts, shutdown) and an output queue (EngineCoreOutputs, or EngineDeadMessage once
    if the loop dies). Blocks only when there is no work. Construction raises whatever
    EngineCore's construction raised (e.g. ValueError for a bad model)."""

    def __init__(self, config: EngineConfig):
        self.input_queue: "queue.Queue[EngineCoreInput]" = queue.Queue()
        self.output_queue: "queue.Queue" = queue.Queue()
        self.engine_core: Optional[EngineCore] = None
        self._init_error: Optional[BaseException] = None
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(config,), name="EngineCore", daemon=True)
        self.thread.start()
        self._ready.wait()
        if self._init_error is not None:
            self.thread.join()
            raise self._init_error

    def _run(self, config: EngineConfig) -> None:
        try:
            self.engine_core = EngineCore(config)
        except BaseException as e:  # reported to the constructing thread
            self._init_error = e
            self._ready.set()
            return
        self._ready.set()
        core = self.engine_core
        step = core.step_fn()
        try:
            while True:
                if not core.has_work() and not self._handle(self.input_queue.get()):
                    break
                if not self._drain_input():
                    break
                outputs = step()
                if outputs is not None:  # also output-less steps (prefill chunks): fresh stats
                    self.output_queue.put(outputs)
        except BaseException as e:
            logger.exception("EngineCore loop died")
            self.output_queue.put(EngineDeadMessage(f"{type(e).__name__}: {e}"))
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
        if msg is _SHUTDOWN:
            return False
        if isinstance(msg, EngineCoreRequest):
            self.engine_core.add_request(msg)
        elif isinstance(msg, EngineCoreAbort):
            self.engine_core.abort_requests(msg.request_ids)
        return True

    def shutdown(self, timeout: float = 10.0) -> None:
        self.input_queue.put(_SHUTDOWN)
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout)
