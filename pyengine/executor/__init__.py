"""Executors: how the engine core reaches its model runner(s) (role of vllm/v1/executor/)."""
from pyengine.executor.abstract import Executor

__all__ = ["Executor"]
