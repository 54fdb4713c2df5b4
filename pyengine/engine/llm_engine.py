"""LLMEngine: a synchronous driver of EngineCore on the caller's thread, for offline use
(mirrors vllm/v1/engine/llm_engine.py)."""
from __future__ import annotations

import time
import weakref
from typing import Optional

from pyengine.config import EngineConfig
from pyengine.tokenizer import load_tokenizer
from pyengine.engine.core import EngineCore
from pyengine.engine.output_processor import OutputProcessor
from pyengine.engine.processor import Processor
from pyengine.metrics.loggers import StatLoggerBase, make_stat_logger_manager
from pyengine.metrics.stats import IterationStats
from pyengine.outputs import RequestOutput
from pyengine.sampling_params import SamplingParams
from pyengine.utils import freeze_gc_heap, unfreeze_gc_heap


def _shutdown(engine_core: EngineCore) -> None:
    engine_core.shutdown()
    unfreeze_gc_heap()


class LLMEngine:
    """``log_stats``: log a stats line every ``VENGINE_LOG_STATS_INTERVAL`` seconds of
    stepping (None: unless ``config.disable_log_stats``); ``stat_loggers``: more
    ``StatLoggerBase`` objects fed with every step's statistics.

    Shut down by ``shutdown()``, or when the engine is garbage-collected (``del llm``,
    ``gc.collect()``, as vLLM's docs tell users to free an engine), or at interpreter exit:
    the device memory and a tensor-parallel process group go, so another engine can be
    built in this process."""

    def __init__(self, config: EngineConfig, log_stats: Optional[bool] = None,
                 stat_loggers: Optional[list[StatLoggerBase]] = None):
        self.config = config
        self.stat_loggers = make_stat_logger_manager(
            not config.disable_log_stats if log_stats is None else log_stats, stat_loggers)
        # The engine core first: its tensor-parallel workers start before the tokenizer's
        # thread pool does, so they can still be forked (pyengine.utils.choose_start_method).
        self.engine_core = EngineCore(config)
        try:
            self.tokenizer = load_tokenizer(config)
        except BaseException:
            self.engine_core.shutdown()
            raise
        self.processor = Processor(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._step = self.engine_core.step_fn()
        # Holds the core, not this object: runs when this object is collected.
        self._finalizer = weakref.finalize(self, _shutdown, self.engine_core)
        freeze_gc_heap()

    def add_request(self, request_id: str, prompt, params: Optional[SamplingParams] = None,
                    priority: int = 0) -> None:
        """Raises ValueError for bad input; nothing is queued then."""
        self.add_processed(request_id, self.processor.process(request_id, prompt, params, priority))

    def add_processed(self, request_id: str, processed) -> None:
        """Queue a request already validated by ``self.processor.process``."""
        text, ids, params, core_reqs = processed
        self.output_processor.add_request(request_id, text, ids, params, core_reqs)
        for r in core_reqs:
            self.engine_core.add_request(r)

    def abort_request(self, request_ids: list[str]) -> None:
        """Ends these requests at once (their ids are free again); unknown ids are ignored."""
        core_ids, _ = self.output_processor.abort_requests(request_ids, time.monotonic())
        self.engine_core.abort_requests(core_ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.get_num_unfinished_requests() > 0 or self.engine_core.has_work()

    def step(self) -> list[RequestOutput]:
        outs = self._step()
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
        """False (nothing changed) while requests hold KV blocks."""
        return self.engine_core.reset_prefix_cache()

    def get_stats(self):
        return self.engine_core.scheduler.make_stats()

    def shutdown(self) -> None:
        """Release the model, KV cache and CUDA graphs (device memory). Idempotent."""
        self._finalizer()
