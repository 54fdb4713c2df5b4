"""Engine statistics for loggers (mirrors vllm/v1/metrics/): what one engine step brought
(``IterationStats``), the scheduler's state (``SchedulerStats``, a message of the engine
core), and the loggers that consume them (``StatLoggerBase``, the periodic
``LoggingStatLogger``)."""
from pyengine.metrics.loggers import LoggingStatLogger, StatLoggerBase, StatLoggerManager, make_stat_logger_manager
from pyengine.metrics.stats import IterationStats, SchedulerStats

__all__ = ["IterationStats", "LoggingStatLogger", "SchedulerStats", "StatLoggerBase", "StatLoggerManager",
           "make_stat_logger_manager"]
