"""pyengine/metrics/loggers.py: the periodic stats line and the loggers' manager."""
from __future__ import annotations

import logging
import re

from pyengine.metrics import (
    IterationStats,
    LoggingStatLogger,
    SchedulerStats,
    StatLoggerBase,
    StatLoggerManager,
    make_stat_logger_manager,
)

LINE = re.compile(r"Engine 000: Avg prompt throughput: ([\d.]+) tokens/s, Avg generation throughput: ([\d.]+) "
                  r"tokens/s, Running: (\d+) reqs, Waiting: (\d+) reqs, KV cache usage: ([\d.]+)%, "
                  r"Prefix cache hit rate: ([\d.]+)%")
LOGGER = "pyengine.metrics.loggers"


def _lines(caplog):
    return [(r.levelno, LINE.search(r.getMessage())) for r in caplog.records if r.name == LOGGER]


def test_logging_stat_logger_line(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    sl = LoggingStatLogger()
    sl.last_log_time -= 2.0  # an interval of (just over) 2 s
    sl.record(SchedulerStats(num_running=3, num_waiting=1, kv_cache_usage=0.25,
                             prefix_cache_queries=200, prefix_cache_hits=50), IterationStats(60, 40))
    sl.record(None, IterationStats(40, 10))
    sl.log()
    (level, m), = _lines(caplog)
    assert level == logging.INFO
    prompt, gen, running, waiting, kv, hit = m.groups()
    assert 45.0 <= float(prompt) <= 50.0 and 22.5 <= float(gen) <= 25.0  # 100 and 50 tokens over ~2 s
    assert (running, waiting, kv, hit) == ("3", "1", "25.0", "25.0")

    # next interval: the hit rate is over this interval's lookups only (100 queries, 100 hits)
    caplog.clear()
    sl.record(SchedulerStats(num_running=0, kv_cache_usage=0.0, prefix_cache_queries=300, prefix_cache_hits=150),
              IterationStats(0, 0))
    sl.log()
    (level, m), = _lines(caplog)
    assert level == logging.INFO  # the interval before had tokens: still reported
    assert float(m.group(1)) == 0.0 and float(m.group(6)) == 100.0

    caplog.clear()
    sl.log()  # idle twice in a row: DEBUG, and the lifetime hit rate (no lookups in the interval)
    (level, m), = _lines(caplog)
    assert level == logging.DEBUG and float(m.group(6)) == 50.0


class _Recorder(StatLoggerBase):
    def __init__(self):
        self.records, self.logs = [], 0

    def record(self, scheduler_stats, iteration_stats):
        self.records.append((scheduler_stats, iteration_stats))

    def log(self):
        self.logs += 1


class _Broken(StatLoggerBase):
    def record(self, scheduler_stats, iteration_stats):
        raise RuntimeError("broken record")

    def log(self):
        raise RuntimeError("broken log")


def test_manager_interval_add_remove_and_broken_loggers(caplog):
    mgr = StatLoggerManager([], interval_s=3600.0)
    assert mgr.seconds_to_next_log() is None  # no loggers: the output thread may block
    rec = _Recorder()
    remove = mgr.add(rec)
    mgr.add(_Broken())
    assert 3500.0 < mgr.seconds_to_next_log() <= 3600.0
    st, it = SchedulerStats(num_running=1), IterationStats(3, 4)
    mgr.record(st, it)  # the broken one is logged, the recorder still gets it
    assert rec.records == [(st, it)] and "broken record" in caplog.text
    mgr.maybe_log()
    assert rec.logs == 0  # not due
    mgr._next_log -= 3600.0
    assert mgr.seconds_to_next_log() == 0.0
    mgr.maybe_log()
    assert rec.logs == 1 and "broken log" in caplog.text
    mgr.maybe_log()
    assert rec.logs == 1  # the next one is an interval away
    remove()
    mgr.record(st, it)
    assert len(rec.records) == 1


def test_make_stat_logger_manager(monkeypatch):
    monkeypatch.setenv("VENGINE_LOG_STATS_INTERVAL", "0.5")
    on = make_stat_logger_manager(True)
    assert [type(x) for x in on.loggers] == [LoggingStatLogger] and on.interval_s == 0.5
    rec = _Recorder()
    off = make_stat_logger_manager(False, [rec])
    assert off.loggers == [rec]
