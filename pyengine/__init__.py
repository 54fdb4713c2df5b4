"""vengine's Python engine: continuous batching over a paged KV cache, in the mould of vLLM v1."""
import logging as _logging

from pyengine.config import EngineArgs, EngineConfig, SchedulingPolicy
from pyengine.engine.detokenizer import prompt_text_for_echo
from pyengine.engine.output_processor import RequestOutputCollector
from pyengine.exceptions import EngineDeadError, VLLMValidationError
from pyengine.messages import FinishReason, SchedulerStats
from pyengine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pyengine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

VERSION = "0.1.0"
__version__ = VERSION

_logging.getLogger("pyengine").addHandler(_logging.NullHandler())


def __getattr__(name):
    # Heavy modules (torch model code) load on first use.
    if name == "LLM":
        from pyengine.llm import LLM
        return LLM
    if name == "AsyncLLM":
        from pyengine.engine.async_llm import AsyncLLM
        return AsyncLLM
    if name in ("MPClient", "DPClient", "start_engine_core_process"):  # several front ends, one engine process
        from pyengine.engine import core_client
        return getattr(core_client, name)
    raise AttributeError(name)


__all__ = ["LLM", "AsyncLLM", "MPClient", "DPClient", "start_engine_core_process", "SamplingParams", "StructuredOutputsParams",
           "RequestOutputKind", "EngineArgs", "EngineConfig", "RequestOutput", "CompletionOutput", "Logprob",
           "RequestMetrics", "EngineDeadError", "RequestOutputCollector", "SchedulerStats", "FinishReason",
           "SchedulingPolicy", "VLLMValidationError", "prompt_text_for_echo", "VERSION", "__version__"]
