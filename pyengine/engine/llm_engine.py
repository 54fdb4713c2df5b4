"""LLMEngine: a synchronous driver of EngineCore on the caller's thread, for offline use
(mirrors vllm/v1/engine/llm_engine.py)."""
from __future__ import annotations

import time
import weakref
from typing import Any

from pyengine.config import EngineConfig
from pyengine.engine.core import EngineCore
from pyengine.engine.output_processor import OutputProcessor
from pyengine.engine.processor import ProcessedRequest, Processor
from pyengine.metrics.loggers import StatLoggerBase, make_stat_logger_manager
from pyengine.metrics.stats import IterationStats, combine_scheduler_stats
from pyengine.outputs import RequestOutput
from pyengine.sampling_params import SamplingParams
from pyengine.tokenizer import load_tokenizer
from pyengine.utils import freeze_gc_heap, unfreeze_gc_heap


def _shutdown(engine_core) -> None:
    engine_core.shutdown()
    if not isinstance(engine_core, EngineCore):  # an engine-core client: its pipes too
        engine_core.close()
    unfreeze_gc_heap()


# Seconds one step waits for the engine cores' next outputs (data parallelism).
_CLIENT_STEP_TIMEOUT_S = 1.0


class LLMEngine:
    """``log_stats``: log a stats line every ``VENGINE_LOG_STATS_INTERVAL`` seconds of
    stepping (None: unless ``config.disable_log_stats``); ``stat_loggers``: more
    ``StatLoggerBase`` objects fed with every step's statistics.

    Shut down by ``shutdown()``, or when the engine is garbage-collected (``del llm``,
    ``gc.collect()``, as vLLM's docs tell users to free an engine), or at interpreter exit:
    the device memory and a tensor-parallel process group go, so another engine can be
    built in this process.

    With ``config.data_parallel_size`` N > 1 the engine cores are N processes behind a
    ``DPClient`` (pyengine/engine/core_client.py) instead of one on this thread: each
    step hands out the outputs of whichever cores have some, waiting up to a second for
    them."""

    def __init__(self, config: EngineConfig, log_stats: bool | None = None,
                 stat_loggers: list[StatLoggerBase] | None = None):
        self.config = config
        self.stat_loggers = make_stat_logger_manager(
            not config.disable_log_stats if log_stats is None else log_stats, stat_loggers,
            config.data_parallel_size)
        # The engine core first: its tensor-parallel workers start before the tokenizer's
        # thread pool does, so they can still be forked (pyengine.utils.choose_start_method).
        self.data_parallel = config.data_parallel_size > 1
        # an EngineCore in this process, or (data parallel) a DPClient over the ranks' processes
        self.engine_core: Any
        if self.data_parallel:
            from pyengine.engine.core_client import make_client
            self.engine_core = make_client(config, multiprocess=True, wait=False)
        else:
            self.engine_core = EngineCore(config)
        try:
            self.tokenizer = load_tokenizer(config)
            if self.data_parallel:
                self.engine_core.wait_ready()
        except BaseException:
            _shutdown(self.engine_core)
            raise
        self.processor = Processor(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._step: Any = None if self.data_parallel else self.engine_core.step_fn()  # (no bound method: no cycle)
        if self.data_parallel:
            self._stats_per_engine = [r.stats for r in self.engine_core.ready_all]
        # Holds the core, not this object: runs when this object is collected.
        self._finalizer = weakref.finalize(self, _shutdown, self.engine_core)
        freeze_gc_heap()

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    priority: int = 0) -> None:
        """Raises ValueError for bad input; nothing is queued then."""
        self.add_processed(request_id, self.processor.process(request_id, prompt, params, priority))

    def add_processed(self, request_id: str, processed: ProcessedRequest) -> None:
        """Queue a request already validated by ``self.processor.process``."""
        self.output_processor.add_request(request_id, processed.prompt_text, processed.prompt_token_ids,
                                          processed.params, processed.core_requests)
        if self.data_parallel:
            self.engine_core.add_requests(processed.core_requests)
        else:
            for r in processed.core_requests:
                self.engine_core.add_request(r)

    def abort_request(self, request_ids: list[str]) -> None:
        """Ends these requests at once (their ids are free again); unknown ids are ignored."""
        core_ids, _ = self.output_processor.abort_requests(request_ids, time.monotonic())
        self.engine_core.abort_requests(core_ids)

    def has_unfinished_requests(self) -> bool:
        if self.data_parallel:
            return self.output_processor.get_num_unfinished_requests() > 0
        return self.output_processor.get_num_unfinished_requests() > 0 or self.engine_core.has_work()

    def _client_step(self):
        """The next outputs of the engine cores (data parallelism), or None after
        ``_CLIENT_STEP_TIMEOUT_S``. Raises EngineDeadError once every core died."""
        from pyengine.exceptions import EngineDeadError
        from pyengine.messages import EngineDeadMessage

        outs = self.engine_core.get_output(_CLIENT_STEP_TIMEOUT_S)
        if isinstance(outs, EngineDeadMessage):
            raise EngineDeadError(f"Engine core died: {outs.message}")
        if outs is not None and outs.scheduler_stats is not None:
            self._stats_per_engine[outs.scheduler_stats.engine_index] = outs.scheduler_stats
        return outs

    def step(self) -> list[RequestOutput]:
        outs = self._client_step() if self.data_parallel else self._step()
        if outs is None:
            return []
        loggers = self.stat_loggers
        iteration_stats = IterationStats() if loggers.loggers else None
        deliveries, to_abort = self.output_processor.process_outputs(outs.outputs, outs.timestamp, iteration_stats)
        if to_abort:
            self.engine_core.abort_requests(to_abort)
        if iteration_stats is not None:
            loggers.record(outs.scheduler_stats, iteration_stats)
            loggers.maybe_log()
        return [ro for _, ro in deliveries]

    def reset_prefix_cache(self) -> bool:
        """False (nothing changed) while requests hold KV blocks (on any engine core)."""
        if self.data_parallel:
            return all(self.engine_core.call_utility_all("reset_prefix_cache"))
        return self.engine_core.reset_prefix_cache()

    def get_stats(self):
        """The scheduler's figures (several engine cores: summed, ``combine_scheduler_stats``)."""
        if self.data_parallel:
            return combine_scheduler_stats(self.get_stats_per_engine())
        return self.engine_core.scheduler.make_stats()

    def get_stats_per_engine(self) -> list:
        """Each engine core's ``SchedulerStats`` (as of its last step), by engine index."""
        if self.data_parallel:
            return list(self._stats_per_engine)
        return [self.get_stats()]

    def shutdown(self) -> None:
        """Release the model, KV cache and CUDA graphs (device memory). Idempotent."""
        self._finalizer()
