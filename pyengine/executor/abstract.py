"""The executor interface the engine core drives (mirrors vllm/v1/executor/abstract.py)."""
from __future__ import annotations

from abc import ABC, abstractmethod

from pyengine.config import EngineConfig
from pyengine.core.sched.output import SchedulerOutput


class Executor(ABC):
    """Owns the model runner(s) of one engine. ``Executor.get_class(config)(config)`` loads
    the model; ``initialize_kv_cache()`` sizes and allocates the KV cache (returns the
    number of blocks); ``execute_model(so, non_blocking, grammar_output, defer_sampling)``
    runs one step and returns what ``ModelRunner.execute_model`` returns (rank 0's sampled
    tokens, or None when sampling is deferred to ``sample_tokens(grammar_output)``);
    ``shutdown()`` frees everything. ``driver_runner``: the ModelRunner in this process
    (rank 0)."""

    @staticmethod
    def get_class(config: EngineConfig) -> type[Executor]:
        """UniProcExecutor for one rank, MultiprocExecutor for tensor parallelism."""
        if config.tensor_parallel_size > 1:
            from pyengine.executor.multiproc_executor import MultiprocExecutor
            return MultiprocExecutor
        from pyengine.executor.uniproc_executor import UniProcExecutor
        return UniProcExecutor

    driver_runner = None

    @abstractmethod
    def initialize_kv_cache(self) -> int:
        ...

    @abstractmethod
    def execute_model(self, so: SchedulerOutput, non_blocking: bool = False, grammar_output=None,
                      defer_sampling: bool = False):
        ...

    @abstractmethod
    def sample_tokens(self, grammar_output=None):
        ...

    def profile(self, is_start: bool, out_dir: str = "", trace: bool = True):
        """Open (``is_start``) or close a profiling window on every rank (see
        pyengine/worker/profiler.py; vLLM's ``Executor.profile``): each rank writes its
        files into ``out_dir``. Closing returns rank 0's summary (dict)."""
        if is_start:
            return self.driver_runner.start_profile(out_dir, trace)
        return self.driver_runner.stop_profile()

    @abstractmethod
    def shutdown(self) -> None:
        ...
