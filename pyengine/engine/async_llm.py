"""AsyncLLM: the serving front end over an engine core (mirrors
vllm/v1/engine/async_llm.py).

The engine core runs behind an ``EngineCoreClient`` (pyengine/engine/core_client.py): in
its own process (``MPClient``) or on a thread of this one (``InprocClient``). Here, one
output-handler thread reads the core's outputs, runs the OutputProcessor
(detokenization, stop strings, n > 1) and fills one RequestOutputCollector per request.
Readers may be plain threads (``collector.get()``), asyncio (``generate()``), gevent or
C, which hook in with ``add_output_listener``. Nothing here touches the scheduler: stats
and utility calls are messages.
"""
from __future__ import annotations

import asyncio
import atexit
import logging
import threading
import time
import weakref
from collections.abc import AsyncGenerator, Callable, Iterable

from pyengine.config import EngineArgs, EngineConfig
from pyengine.engine.core_client import EngineCoreClient, make_client
from pyengine.engine.output_processor import OutputProcessor, RequestOutputCollector, wake_asyncio_readers
from pyengine.engine.processor import ProcessedRequest, Processor
from pyengine.exceptions import EngineDeadError
from pyengine.messages import EngineDeadMessage, SchedulerStats
from pyengine.metrics.loggers import StatLoggerBase, make_stat_logger_manager
from pyengine.metrics.stats import IterationStats, combine_scheduler_stats
from pyengine.outputs import RequestOutput
from pyengine.sampling_params import SamplingParams
from pyengine.tokenizer import load_tokenizer
from pyengine.utils import freeze_gc_heap, unfreeze_gc_heap

logger = logging.getLogger(__name__)


class AsyncLLM:
    """``multiprocess``: the engine core in its own process (True) or on a thread (False);
    None follows ``VENGINE_ENABLE_MULTIPROCESSING`` (pyengine/engine/core_client.py).
    ``client``: serve through this engine-core client instead of starting one (an API
    server of ``vengine serve --api-server-count N`` attaches to a shared engine process).
    ``log_stats``: log a stats line every ``VENGINE_LOG_STATS_INTERVAL`` seconds (logger
    ``pyengine.metrics.loggers``, INFO; None: unless ``config.disable_log_stats``).
    ``log_requests``: log each request received (id, prompt length, sampling params; never
    the prompt text), at INFO on ``pyengine.engine.async_llm``. ``stat_loggers``: more
    ``StatLoggerBase`` objects fed with every step's statistics (``add_stat_logger`` adds
    one later)."""

    def __init__(self, config: EngineConfig, multiprocess: bool | None = None,
                 client: EngineCoreClient | None = None, *, log_stats: bool | None = None,
                 log_requests: bool = False, stat_loggers: list[StatLoggerBase] | None = None):
        self.config = config
        self.log_requests = log_requests
        self.stat_loggers = make_stat_logger_manager(
            not config.disable_log_stats if log_stats is None else log_stats, stat_loggers,
            config.data_parallel_size)
        self._lock = threading.Lock()  # serializes OutputProcessor use across threads
        self._listeners: list[Callable[[list[str]], None]] = []
        self.dead_error: BaseException | None = None
        self._shutdown = False
        # The engine process loads the model while this one loads the tokenizer.
        self.engine_core = client if client is not None else make_client(config, multiprocess, wait=False)
        try:
            self.tokenizer = load_tokenizer(config)
            self.processor = Processor(config, self.tokenizer)
            self.output_processor = OutputProcessor(self.tokenizer, config.stream_interval)
            self.engine_core.wait_ready()
        except BaseException:
            self.engine_core.shutdown()
            self.engine_core.close()
            raise
        ready_all = getattr(self.engine_core, "ready_all", None) or [self.engine_core.ready]
        self._stats_per_engine: list[SchedulerStats] = [r.stats for r in ready_all]
        freeze_gc_heap()
        self._output_thread = threading.Thread(target=self._output_handler_loop, name="OutputHandler", daemon=True)
        self._output_thread.start()
        # Join the engine threads before interpreter teardown (a daemon thread killed inside
        # a torch call aborts the process); weak, so the engine can still be collected.
        ref = weakref.ref(self)
        atexit.register(lambda: (llm := ref()) is not None and llm.shutdown())  # type: ignore[func-returns-value]

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, multiprocess: bool | None = None,
                         log_requests: bool | None = None) -> AsyncLLM:
        """Stats are logged unless ``engine_args.disable_log_stats``; requests if
        ``log_requests``, else (None) if ``engine_args`` is an ``AsyncEngineArgs`` with
        ``enable_log_requests`` (``vengine serve --enable-log-requests``). Raises
        ValueError for bad engine arguments."""
        if log_requests is None:
            log_requests = bool(getattr(engine_args, "enable_log_requests", False))
        return cls(engine_args.create_engine_config(), multiprocess, log_requests=log_requests)

    @property
    def errored(self) -> bool:
        """True once the engine died or was shut down."""
        return self.dead_error is not None

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling parameters of a request that sets none (vLLM's neutral defaults
        overridden by ``--generation-config``); front ends apply a request's own fields
        over them (``clone``). A new object each call."""
        return self.processor.get_default_sampling_params()

    async def check_health(self) -> None:
        """vLLM's health probe: returns when the engine can serve; raises EngineDeadError
        (with the reason) once the engine died or was shut down."""
        if self.dead_error is not None:
            raise self.dead_error
        if self._shutdown or not self.engine_core.is_alive():
            raise EngineDeadError("The engine core is not running.")

    def dead_engines(self) -> dict[int, str]:
        """{engine index: why it died} of the data-parallel engine cores that died while
        the others serve (their requests failed; no new ones go there). Empty with one
        engine core, whose death is the engine's (``errored``)."""
        return self.engine_core.dead_engines()

    async def reset_prefix_cache(self) -> bool:
        """vLLM's ``AsyncLLM.reset_prefix_cache``: forget every cached prefix, on the
        engine-core side between two steps. Returns False, and changes nothing, while
        requests hold KV blocks. Raises EngineDeadError once the engine died."""
        if self.dead_error is not None:
            raise EngineDeadError(str(self.dead_error))
        loop = asyncio.get_running_loop()
        return bool(await loop.run_in_executor(None, self.engine_core.call_utility, "reset_prefix_cache"))

    # ---- requests ------------------------------------------------------------------
    def add_request(self, request_id: str, prompt, sampling_params: SamplingParams | None = None,
                    priority: int = 0) -> RequestOutputCollector:
        """Validate and enqueue one request (``Processor.process``); returns its collector.

        Raises ValueError (bad input, duplicate id) or EngineDeadError; nothing is queued then."""
        self._check_alive()
        return self.add_processed_request(self.processor.process(request_id, prompt, sampling_params, priority))

    def add_processed_request(self, request: ProcessedRequest) -> RequestOutputCollector:
        """Enqueue a request the ``Processor`` already validated (``Processor.process``, or
        a front end's own steps ending in ``Processor.engine_request``): no rule runs
        again. Returns its collector. Raises ValueError (a duplicate id) or
        EngineDeadError; nothing is queued then."""
        self._check_alive()
        rid, params = request.request_id, request.params
        if self.log_requests:
            logger.info("Received request %s: prompt: %d tokens, priority: %d, params: %r",
                        rid, len(request.prompt_token_ids), request.priority, params)
        collector = RequestOutputCollector(rid, params.output_kind)
        with self._lock:
            self.output_processor.add_request(rid, request.prompt_text, request.prompt_token_ids, params,
                                              request.core_requests, collector)
        self.engine_core.add_requests(request.core_requests)
        return collector

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(str(self.dead_error))
        if self._shutdown:
            raise EngineDeadError("AsyncLLM was shut down.")

    def abort(self, request_id: str | Iterable[str]) -> None:
        """Idempotent; unknown or finished ids are ignored. The stream ends at once with
        finish_reason 'abort' and the id can be used again right away (as in vLLM, it is
        freed in the output processor; the engine core's abort follows)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        with self._lock:
            core_ids, deliveries = self.output_processor.abort_requests(ids, time.monotonic())
        for collector, ro in deliveries:
            collector.put(ro)
        self._notify([ro.request_id for _, ro in deliveries])
        self.engine_core.abort_requests(core_ids)

    async def generate(self, prompt, sampling_params: SamplingParams | None, request_id: str,
                       priority: int = 0) -> AsyncGenerator[RequestOutput, None]:
        """Async generator of this request's outputs; aborts it if the consumer stops early."""
        collector = self.add_request(request_id, prompt, sampling_params, priority)
        try:
            while True:
                out = await collector.get_async()
                yield out
                if out.finished:
                    return
        finally:
            if not collector.finished:
                self.abort(request_id)

    def add_output_listener(self, fn: Callable[[list[str]], None]) -> Callable[[], None]:
        """fn(request_ids) runs on the output-handler thread once per engine step, after
        those requests' collectors were filled; it must not block. Returns an unsubscribe."""
        self._listeners = self._listeners + [fn]

        def remove() -> None:
            self._listeners = [f for f in self._listeners if f is not fn]
        return remove

    def get_stats(self) -> SchedulerStats:
        """Scheduler and KV-cache figures as of the last engine step (with several engine
        cores, their sum: ``combine_scheduler_stats``)."""
        return combine_scheduler_stats(self._stats_per_engine)

    def get_stats_per_engine(self) -> list[SchedulerStats]:
        """Each engine core's figures as of its last step, by engine index
        (``SchedulerStats.engine_index``); one element without data parallelism."""
        return list(self._stats_per_engine)

    def add_stat_logger(self, stat_logger: StatLoggerBase) -> Callable[[], None]:
        """Feed ``stat_logger`` every engine step's ``SchedulerStats`` and
        ``IterationStats`` from now on (``record`` runs on the output-handler thread and
        must not block). Returns a function that stops it."""
        return self.stat_loggers.add(stat_logger)

    # ---- output handler --------------------------------------------------------------
    def _output_handler_loop(self) -> None:
        stat_loggers = self.stat_loggers
        while True:
            # Wakes up for the periodic stats line even when the engine is idle.
            outs = self.engine_core.get_output(stat_loggers.seconds_to_next_log())
            if self._shutdown:
                return
            if stat_loggers.loggers:
                stat_loggers.maybe_log()
            if outs is None:
                continue
            if isinstance(outs, EngineDeadMessage):
                self._fail(EngineDeadError(f"Engine core died: {outs.message}"))
                return
            try:
                iteration_stats = IterationStats() if stat_loggers.loggers else None
                with self._lock:
                    deliveries, to_abort = self.output_processor.process_outputs(outs.outputs, outs.timestamp,
                                                                                 iteration_stats)
                st = outs.scheduler_stats
                if st is not None:
                    self._stats_per_engine[st.engine_index] = st
                waiters = []
                for collector, ro in deliveries:
                    w = collector.put(ro, False)
                    if w is not None:
                        waiters.append(w)
                if waiters:
                    wake_asyncio_readers(waiters)
                if to_abort:
                    self.engine_core.abort_requests(to_abort)
                self._notify([ro.request_id for _, ro in deliveries])
                if iteration_stats is not None:  # after the readers were woken: off their latency
                    stat_loggers.record(outs.scheduler_stats, iteration_stats)
            except BaseException as e:  # a bug here must not hang readers
                logger.exception("Output handler failed")
                self._fail(EngineDeadError(f"Output handler died: {type(e).__name__}: {e}"))
                return

    def _notify(self, ids: list[str]) -> None:
        if not ids:
            return
        for fn in self._listeners:
            try:
                fn(ids)
            except Exception:
                logger.exception("Output listener failed")

    def _fail(self, error: EngineDeadError) -> None:
        self.dead_error = error
        with self._lock:
            ids = list(self.output_processor.parents)
            collectors = self.output_processor.fail_all(error)
        for collector in collectors:
            if collector is not None:
                collector.put(error)
        self._notify(ids)

    def shutdown(self) -> None:
        """Stop and join the engine threads; idempotent. Pending requests get EngineDeadError."""
        if self._shutdown:
            return
        self._shutdown = True
        self.engine_core.shutdown()
        self.engine_core.wake_output_reader()
        if threading.current_thread() is not self._output_thread:
            self._output_thread.join(timeout=10)
            self.engine_core.close()
        unfreeze_gc_heap()
        if self.dead_error is None:
            self._fail(EngineDeadError("AsyncLLM was shut down."))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
