"""EngineCore: schedule -> execute -> update, one step at a time (mirrors
vllm/v1/engine/core.py). Its busy loop and the engine-core process host are
``pyengine.engine.core_proc``; where the loop runs — a thread of the front end's process
or a process of its own — is the client's choice (pyengine/engine/core_client.py)."""
from __future__ import annotations

import logging
import time
from collections import deque

from pyengine import envs
from pyengine.config import EngineConfig
from pyengine.core.sched.async_scheduler import AsyncScheduler
from pyengine.core.sched.scheduler import Scheduler
from pyengine.distributed.kv_events import KVEventBatch, make_publisher
from pyengine.executor import Executor
from pyengine.messages import EngineCoreOutputs, EngineCoreRequest, ErrorInfo, SchedulerStats, UtilityOutput, UtilityRequest
from pyengine.request import Request, RequestStatus

logger = logging.getLogger(__name__)


class EngineCore:
    """Owns the scheduler and the model executor (one model runner, or tensor-parallel
    ranks). Not thread-safe: one thread drives it."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_executor = Executor.get_class(config)(config)  # type: ignore[call-arg] # the concrete executors take it
        self.model_runner = self.model_executor.driver_runner  # rank 0's, in this process
        try:
            num_blocks = self.model_executor.initialize_kv_cache()
            capacity = (num_blocks - 1) * config.block_size
            if capacity < config.max_model_len:
                raise ValueError(f"The KV cache holds {capacity} tokens ({num_blocks - 1} blocks of "
                                 f"{config.block_size}), fewer than max_model_len={config.max_model_len}; "
                                 f"raise the KV cache size or lower max_model_len.")
        except BaseException:
            self.model_executor.shutdown()
            raise
        self.scheduler = (AsyncScheduler if config.async_scheduling else Scheduler)(config, num_blocks)
        try:  # vLLM's KV events (pyengine/distributed/kv_events.py): None unless configured
            self.kv_event_publisher = make_publisher(config.kv_events_config, config.data_parallel_rank)
        except BaseException:
            self.model_executor.shutdown()
            raise
        # (scheduler output, pending runner output), oldest first.
        self.batch_queue: deque = deque()
        self.batch_queue_size = 2 if config.async_scheduling else 1
        logger.info("Asynchronous scheduling is %s.", "enabled" if config.async_scheduling else "disabled")
        _log_engine_ready(config, num_blocks - 1)  # one block is the null block

    def add_request(self, req: EngineCoreRequest) -> None:
        """Never raises for a bad request: any exception while adding it ends only this
        request, with finish_reason "error" in the next outputs (vLLM's per-request error
        path); the engine and the other requests go on."""
        try:
            self.scheduler.add_request(Request(req.request_id, req.prompt_token_ids, req.sampling_params,
                                               req.max_tokens, req.arrival_time, req.priority, req.cache_salt))
        except Exception as e:  # noqa: BLE001 - one request's failure ends only that request
            self.scheduler.fail_request(req.request_id, e)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache``: forget every cached prefix. Returns False, and
        changes nothing, while requests hold KV blocks."""
        done = self.scheduler.reset_prefix_cache()
        self.publish_kv_events()
        return done

    def publish_kv_events(self) -> None:
        """Hand the KV events recorded since the last call (one engine step's) to the
        publisher as one ``KVEventBatch``; nothing without a publisher or events."""
        if self.kv_event_publisher is None:
            return
        events = self.scheduler.kv_cache_manager.take_events()
        if events:
            self.kv_event_publisher.publish(KVEventBatch(time.time(), events, self.config.data_parallel_rank))

    def has_work(self) -> bool:
        return self.scheduler.has_requests() or bool(self.batch_queue)

    def step(self) -> EngineCoreOutputs | None:
        """Schedule, execute, sample, update: one synchronous step. With constrained rows,
        the bitmask is filled while the device runs the forward (sampling deferred)."""
        if not self.scheduler.has_unfinished_requests():
            return self.scheduler.take_pending_outputs()
        so = self.scheduler.schedule()
        if so.is_empty:
            return self.scheduler.take_pending_outputs()
        ex = self.model_executor
        if so.has_structured_output:
            ex.execute_model(so, defer_sampling=True)
            out = ex.sample_tokens(self.scheduler.get_grammar_bitmask(so))
        else:
            out = ex.execute_model(so)
        return self.scheduler.update_from_output(so, out)

    def step_with_batch_queue(self) -> EngineCoreOutputs | None:
        """Async scheduling: launch batch N+1 before consuming batch N's sampled tokens.

        Returns None (or only abort outputs) right after a launch that left the queue
        non-full, so the caller loops back and schedules the next batch at once.

        Structured outputs (vLLM's deferred sampling): the bitmask of batch N+1 needs batch
        N's tokens accepted by the grammars. So when N+1 has constrained rows and N is in
        flight, N+1's forward is launched, then N's tokens are consumed, then N+1's bitmask
        is filled on the host (the device still runs N+1's forward) and its sampling
        launched. Every batch in the queue has been sampled (batch N+1's forward feeds N's
        sampled ids)."""
        ex = self.model_executor
        deferred = None
        # Speculative decoding pipelines too: the runner fills the next step's draft
        # placeholders itself (pyengine/worker/model_runner.py). Only where the step would
        # change between speculative and not (disable_by_batch_size crossed) does it wait for
        # the batch in flight, so that no placeholder spans the two kinds of step. A
        # speculative step in flight with no draft placeholders (e.g. the prefill-only first
        # step of a burst of requests: none ran at its start) needs no wait before a plain
        # one: its rows' newest tokens are its sampled ones, nothing to take back.
        sched = self.scheduler
        spec_wait = False
        if sched.spec_enabled and self.batch_queue:
            last = self.batch_queue[-1][0]
            if last.speculative != sched.wants_speculative_step():
                spec_wait = not last.speculative or any(s.spec_token_ids for s in last.scheduled)
        if (len(self.batch_queue) < self.batch_queue_size and self.scheduler.has_unfinished_requests()
                and not spec_wait):
            so = self.scheduler.schedule()
            if not so.is_empty:
                if so.has_structured_output and self.batch_queue:
                    ex.execute_model(so, non_blocking=True, defer_sampling=True)
                    deferred = so
                else:
                    grammar = self.scheduler.get_grammar_bitmask(so) if so.has_structured_output else None
                    self.batch_queue.append((so, ex.execute_model(so, non_blocking=True, grammar_output=grammar)))
                    if len(self.batch_queue) < self.batch_queue_size:
                        return self.scheduler.take_pending_outputs()
        if not self.batch_queue:
            return self.scheduler.take_pending_outputs()
        so, pending = self.batch_queue.popleft()
        outputs = self.scheduler.update_from_output(so, pending.get_output())
        if deferred is not None:
            grammar = self.scheduler.get_grammar_bitmask(deferred)
            self.batch_queue.append((deferred, ex.sample_tokens(grammar)))
        return outputs

    def profile(self, is_start: bool, out_dir: str | None = None, trace: bool = True):
        """Open (``is_start``) or close a profiling window on every tensor-parallel rank
        (vLLM's ``EngineCore.profile``; see pyengine/worker/profiler.py). ``out_dir``
        (default ``VENGINE_TORCH_PROFILER_DIR``): where each rank writes its phase timings
        and, with ``trace``, its torch.profiler trace. Closing returns rank 0's summary.
        Raises ValueError when opening with no directory, RuntimeError when a window is
        already open (opening) or none is (closing)."""
        if is_start:
            out_dir = out_dir or envs.torch_profiler_dir()
            if not out_dir:
                raise ValueError("profiling needs a directory: pass out_dir or set VENGINE_TORCH_PROFILER_DIR")
            return self.model_executor.profile(True, out_dir, trace)
        return self.model_executor.profile(False)

    def shutdown(self) -> None:
        """Release device memory (model, KV cache, graphs); no more steps after this."""
        self.batch_queue.clear()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.shutdown()
            self.kv_event_publisher = None
        self.scheduler.structured_output_manager.shutdown()
        self.model_executor.shutdown()

    def step_fn(self):
        """The step function of this configuration; with KV events, one that publishes each
        step's events after it."""
        step = self.step_with_batch_queue if self.config.async_scheduling else self.step
        if self.kv_event_publisher is None:
            return step

        def step_and_publish():
            out = step()
            self.publish_kv_events()
            return out
        return step_and_publish

    # ---- utility calls (front ends reach the scheduler only through these) ----------
    UTILITY_METHODS = frozenset({"get_stats", "reset_prefix_cache"})

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def call_utility(self, msg: UtilityRequest) -> UtilityOutput:
        """Run one allowed utility method; an error is returned, never raised (it concerns
        the caller, not the engine)."""
        if msg.method not in self.UTILITY_METHODS:
            return UtilityOutput(msg.call_id, None, ErrorInfo("ValueError", f"unknown utility method {msg.method!r}"))
        try:
            return UtilityOutput(msg.call_id, getattr(self, msg.method)(*msg.args))
        except Exception as e:  # noqa: BLE001 - reported to the caller
            return UtilityOutput(msg.call_id, None, ErrorInfo.of(e))


def _log_engine_ready(config: EngineConfig, num_kv_blocks: int) -> None:
    """The start-up summary users look for first: what runs where, and how many tokens the
    KV cache holds (with vLLM's "maximum concurrency" at full-length requests)."""
    kv_tokens = num_kv_blocks * config.block_size
    logger.info("Engine core ready: model %s, dtype %s, device %s, tensor_parallel_size %d, max_model_len %d, "
                "max_num_seqs %d, max_num_batched_tokens %d, scheduling %s; KV cache: %d tokens (%d blocks of %d); "
                "maximum concurrency for %d-token requests: %.2fx.",
                config.model, str(config.dtype).removeprefix("torch."), config.device, config.tensor_parallel_size,
                config.max_model_len, config.max_num_seqs, config.max_num_batched_tokens,
                str(config.scheduling_policy),
                kv_tokens, num_kv_blocks, config.block_size, config.max_model_len,
                kv_tokens / config.max_model_len)
