"""One rank in this process: today's ModelRunner, called directly (mirrors
vllm/v1/executor/uniproc_executor.py)."""
from __future__ import annotations

from pyengine.config import EngineConfig
from pyengine.core.sched.output import SchedulerOutput
from pyengine.executor.abstract import Executor
from pyengine.worker.model_runner import ModelRunner


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig):
        self.driver_runner = ModelRunner(config)

    def initialize_kv_cache(self) -> int:
        return self.driver_runner.initialize_kv_cache()

    def execute_model(self, so: SchedulerOutput, non_blocking: bool = False, grammar_output=None,
                      defer_sampling: bool = False):
        return self.driver_runner.execute_model(so, non_blocking, grammar_output, defer_sampling)

    def sample_tokens(self, grammar_output=None):
        return self.driver_runner.sample_tokens(grammar_output)

    def shutdown(self) -> None:
        self.driver_runner.release()
