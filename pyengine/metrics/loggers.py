"""Stat loggers (mirrors vllm/v1/metrics/loggers.py): objects that receive each engine
step's ``SchedulerStats`` and ``IterationStats``; ``LoggingStatLogger`` writes vLLM's
periodic throughput line to the ``pyengine.metrics.loggers`` logger."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pyengine import envs
from pyengine.metrics.stats import IterationStats, SchedulerStats

logger = logging.getLogger(__name__)


class StatLoggerBase:
    """A consumer of engine statistics. ``record`` is called once per engine step, on the
    thread that processes the engine's outputs (``AsyncLLM``'s output handler, or the
    caller of ``LLMEngine.step``): it must be quick and must not block. ``log`` is called
    every ``VENGINE_LOG_STATS_INTERVAL`` seconds on that same thread, so the two never
    run at once."""

    def record(self, scheduler_stats: SchedulerStats | None,
               iteration_stats: IterationStats | None) -> None:
        raise NotImplementedError

    def log(self) -> None:
        """Periodic hook; nothing by default."""


class LoggingStatLogger(StatLoggerBase):
    """One INFO line per interval: prompt and generation throughput (tokens/s over the
    interval), running and waiting requests, KV cache use and the prefix cache hit rate
    (over the interval's lookups; since start-up when it had none), in vLLM's format.
    An idle engine (no tokens in this interval or the one before, nothing running or
    waiting) logs at DEBUG instead, so a quiet server does not fill its log."""

    def __init__(self, engine_index: int = 0):
        self.engine_index = engine_index
        self.last_scheduler_stats = SchedulerStats()
        self.last_prompt_throughput = 0.0
        self.last_generation_throughput = 0.0
        self._hits_at_last_log = 0
        self._queries_at_last_log = 0
        self._spec_at_last_log = (0, 0, 0)  # drafts, draft tokens, accepted tokens
        self._reset(time.monotonic())

    def _reset(self, now: float) -> None:
        self.last_log_time = now
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    def record(self, scheduler_stats: SchedulerStats | None,
               iteration_stats: IterationStats | None) -> None:
        if scheduler_stats is not None and scheduler_stats.engine_index != self.engine_index:
            return
        if iteration_stats is not None:
            self.num_prompt_tokens += iteration_stats.num_prompt_tokens
            self.num_generation_tokens += iteration_stats.num_generation_tokens
        if scheduler_stats is not None:
            self.last_scheduler_stats = scheduler_stats

    def _prefix_cache_hit_rate(self, st: SchedulerStats) -> float:
        queries = st.prefix_cache_queries - self._queries_at_last_log
        hits = st.prefix_cache_hits - self._hits_at_last_log
        if queries <= 0:  # no lookups in this interval (or a counter reset): the lifetime rate
            queries, hits = st.prefix_cache_queries, st.prefix_cache_hits
        self._queries_at_last_log, self._hits_at_last_log = st.prefix_cache_queries, st.prefix_cache_hits
        return hits / queries if queries > 0 else 0.0

    def _spec_decoding(self, st: SchedulerStats) -> str:
        """Speculative decoding over the interval (since start-up when it verified no
        draft): ", Mean acceptance length: ..., Draft acceptance rate: ...%" (vLLM's
        SpecDecoding line, shortened); "" without speculation."""
        if not st.spec_accepted_per_pos:
            return ""
        now = (st.spec_num_drafts, st.spec_num_draft_tokens, st.spec_num_accepted_tokens)
        d = [a - b for a, b in zip(now, self._spec_at_last_log)]
        if d[0] <= 0:
            d = list(now)
        self._spec_at_last_log = now
        drafts, draft_toks, accepted = d
        if drafts <= 0:
            return ", Mean acceptance length: -"
        return (f", Mean acceptance length: {1 + accepted / drafts:.2f}, "
                f"Draft acceptance rate: {100 * accepted / max(draft_toks, 1):.1f}%")

    def log(self) -> None:
        now = time.monotonic()
        elapsed = now - self.last_log_time
        prompt_tp = self.num_prompt_tokens / elapsed if elapsed > 0 else 0.0
        gen_tp = self.num_generation_tokens / elapsed if elapsed > 0 else 0.0
        self._reset(now)
        st = self.last_scheduler_stats
        busy = (prompt_tp or gen_tp or self.last_prompt_throughput or self.last_generation_throughput
                or st.num_running or st.num_waiting)
        self.last_prompt_throughput, self.last_generation_throughput = prompt_tp, gen_tp
        (logger.info if busy else logger.debug)(
            "Engine %03d: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%%s",
            self.engine_index, prompt_tp, gen_tp, st.num_running, st.num_waiting,
            st.kv_cache_usage * 100, self._prefix_cache_hit_rate(st) * 100, self._spec_decoding(st))


class StatLoggerManager:
    """The stat loggers of one front end and the clock of their periodic ``log``
    (``interval_s`` seconds; vLLM's ``StatLoggerManager``). ``add`` may be called from any
    thread; ``record`` and ``maybe_log`` from the output-processing thread only."""

    def __init__(self, loggers: list[StatLoggerBase] | None = None, interval_s: float = 10.0):
        self.loggers: list[StatLoggerBase] = list(loggers or [])
        self.interval_s = interval_s
        self._next_log = time.monotonic() + interval_s

    def add(self, stat_logger: StatLoggerBase) -> Callable[[], None]:
        """Start feeding ``stat_logger``; returns a function that stops it."""
        self.loggers = self.loggers + [stat_logger]  # copy on write: the output thread iterates

        def remove() -> None:
            self.loggers = [x for x in self.loggers if x is not stat_logger]
        return remove

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None) -> None:
        for stat_logger in self.loggers:
            try:
                stat_logger.record(scheduler_stats, iteration_stats)
            except Exception:  # noqa: BLE001 - a broken logger must not stop the engine's outputs
                logger.exception("Stat logger %r failed", stat_logger)

    def seconds_to_next_log(self) -> float | None:
        """How long the output thread may block before ``maybe_log`` is due; None: no loggers."""
        if not self.loggers:
            return None
        return max(0.0, self._next_log - time.monotonic())

    def maybe_log(self) -> None:
        now = time.monotonic()
        if now < self._next_log:
            return
        self._next_log = now + self.interval_s
        for stat_logger in self.loggers:
            try:
                stat_logger.log()
            except Exception:  # noqa: BLE001 - a broken logger must not stop the engine's outputs
                logger.exception("Stat logger %r failed", stat_logger)


def make_stat_logger_manager(log_stats: bool, stat_loggers: list[StatLoggerBase] | None = None,
                             num_engines: int = 1) -> StatLoggerManager:
    """A front end's loggers: ``stat_loggers``, after one ``LoggingStatLogger`` per engine
    core when ``log_stats``; the interval is ``VENGINE_LOG_STATS_INTERVAL`` (ValueError if
    bad)."""
    loggers = ([LoggingStatLogger(i) for i in range(num_engines)] if log_stats else []) + list(stat_loggers or [])
    return StatLoggerManager(loggers, envs.log_stats_interval())
