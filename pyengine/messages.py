"""Messages that cross the engine-core boundary (mirrors vllm/v1/engine/__init__.py): the
shared vocabulary of every floor of the engine. This module imports nothing of the engine
but the request parameters and the scheduler's stats; ``pyengine.codec`` turns these
dataclasses into bytes and back for the multi-process engine core."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from pyengine.metrics.stats import SchedulerStats
from pyengine.sampling_params import SamplingParams

__all__ = ["FinishReason", "EngineCoreRequest", "EngineCoreAbort", "LogprobsEntry", "EngineCoreOutput",
           "SchedulerStats", "EngineCoreOutputs", "ErrorInfo", "EngineDeadMessage", "EngineCoreReady",
           "EngineCoreShutdown", "UtilityRequest", "UtilityOutput"]


class FinishReason(enum.StrEnum):
    """Why a request ended (vLLM's ``FinishReason``). A ``str`` whose value is the
    OpenAI-facing string, so it compares equal to, hashes like, JSON-encodes as and crosses
    the cbor2 codec as ``"stop"`` / ``"length"`` / ``"abort"`` / ``"error"``.

    STOP: EOS, a stop token id or a stop string; LENGTH: ``max_tokens`` or
    ``max_model_len`` reached; ABORT: aborted (by the caller, a disconnect, a shutdown);
    ERROR: this request failed inside the engine (the others went on)."""
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved (SamplingParams.max_tokens=None -> up to max_model_len)
    arrival_time: float
    priority: int = 0
    # vLLM's cache_salt: mixed into the first block's hash, so only requests with the same
    # salt share cached prefixes
    cache_salt: str | None = None


@dataclass
class EngineCoreAbort:
    request_ids: list[str]


@dataclass(slots=True)
class LogprobsEntry:
    """Logprobs of one generated token: token_ids[0] is the sampled token, then the top-k."""
    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int


@dataclass(slots=True)
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[LogprobsEntry] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # with FinishReason.ERROR: what failed, for the front ends
    # time.monotonic() when the request was first scheduled; sent with its first token
    # (the front end's queue / prefill time metrics)
    first_scheduled_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0


@dataclass
class ErrorInfo:
    """An exception as it crosses the engine-core boundary: its class (one of
    ``pyengine.exceptions.TRANSPORTED``, else ``RuntimeError`` with the class's name in
    the text), text and, for a ``VLLMValidationError``, the field at fault. The other side
    raises it as the same class (``pyengine.exceptions.raise_error_info``)."""
    type: str
    message: str
    parameter: str | None = None

    @classmethod
    def of(cls, exc: BaseException) -> ErrorInfo:
        return cls(type(exc).__name__, str(exc), getattr(exc, "parameter", None))

    def __str__(self) -> str:
        return f"{self.type}: {self.message}"


@dataclass
class EngineDeadMessage:
    """Sent on the output queue when the engine core died, or failed to start
    (``during_startup``): ``message`` for the user; ``error``, the exception it died of
    where one was raised (a ``ValueError`` for a bad model or configuration, re-raised as
    such by the client)."""
    message: str
    error: ErrorInfo | None = None
    during_startup: bool = False


@dataclass
class EngineCoreReady:
    """The engine core's first output: it is built and serving."""
    stats: SchedulerStats


@dataclass
class EngineCoreShutdown:
    """Input: stop the busy loop, release the device, exit."""


@dataclass
class UtilityRequest:
    """Input: call ``EngineCore.<method>(*args)`` on the engine-core side (between steps);
    answered by a ``UtilityOutput`` with the same ``call_id``."""
    call_id: int
    method: str
    args: list = field(default_factory=list)


@dataclass
class UtilityOutput:
    call_id: int
    result: Any = None
    error: ErrorInfo | None = None  # when the call raised
