"""Messages that cross the engine-core boundary, with a cbor2 codec
(mirrors vllm/v1/engine/__init__.py). The in-process client passes the objects
directly; a multi-process core would send ``encode(msg)`` over a socket."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

import cbor2

from pyengine.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved (SamplingParams.max_tokens=None -> up to max_model_len)
    arrival_time: float
    priority: int = 0


@dataclass
class EngineCoreAbort:
    request_ids: list[str]


@dataclass
class LogprobsEntry:
    """Logprobs of one generated token: token_ids[0] is the sampled token, then the top-k."""
    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: Optional[list[LogprobsEntry]] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_gpu_blocks: int = 0
    num_free_blocks: int = 0
    num_steps: int = 0
    step_host_time_s: float = 0.0  # cumulative host time spent in schedule + launch + update, seconds


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: Optional[SchedulerStats] = None
    timestamp: float = 0.0


@dataclass
class EngineDeadMessage:
    """Sent on the output queue when the engine-core thread died."""
    message: str


_TYPES = {c.__name__: c for c in (EngineCoreRequest, EngineCoreAbort, LogprobsEntry, EngineCoreOutput,
                                  SchedulerStats, EngineCoreOutputs, EngineDeadMessage, SamplingParams)}


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        d = {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        d["__type__"] = type(obj).__name__
        return d
    if isinstance(obj, (list, tuple)):
        return [_to_plain(x) for x in obj]
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    if isinstance(obj, RequestOutputKind):
        return int(obj)
    return obj


def _from_plain(obj: Any) -> Any:
    if isinstance(obj, dict) and "__type__" in obj:
        cls = _TYPES[obj.pop("__type__")]
        kwargs = {k: _from_plain(v) for k, v in obj.items()}
        if cls is SamplingParams:
            kwargs["all_stop_token_ids"] = set(kwargs.get("all_stop_token_ids") or ())
        return cls(**kwargs)
    if isinstance(obj, list):
        return [_from_plain(x) for x in obj]
    return obj


def encode(msg: Any) -> bytes:
    """Serialize a message dataclass with cbor2."""
    return cbor2.dumps(_to_plain(msg))


def decode(data: bytes) -> Any:
    """Inverse of ``encode``; raises ValueError on an unknown message type."""
    try:
        return _from_plain(cbor2.loads(data))
    except KeyError as e:
        raise ValueError(f"Unknown message type {e}") from None
