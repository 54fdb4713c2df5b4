"""Messages that cross the engine-core boundary, with a cbor2 codec
(mirrors vllm/v1/engine/__init__.py). The in-process client passes the objects
directly; the multi-process client (``core_client.MPClient``) sends ``encode(msg)``
over a pipe to the engine-core process and ``decode``s what comes back.

The codec is generic (a map per dataclass, named by ``__type__``) except for the one
message sent every engine step, ``EngineCoreOutputs``: that goes column-wise (request
ids, token id lists, and the rare non-default fields sparsely), which costs about a
tenth of the generic form for a batch of 256 (see docs/benchmarks.md)."""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, Optional

import cbor2

from pyengine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams


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
    cache_salt: Optional[str] = None


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
    new_logprobs: Optional[list[LogprobsEntry]] = None
    finish_reason: Optional[FinishReason] = None
    stop_reason: Optional[int | str] = None
    num_cached_tokens: int = 0
    error: Optional[str] = None  # with FinishReason.ERROR: what failed, for the front ends
    # time.monotonic() when the request was first scheduled; sent with its first token
    # (the front end's queue / prefill time metrics)
    first_scheduled_time: Optional[float] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SchedulerStats:
    """The scheduler's state after one engine step (mirrors vllm/v1/metrics/stats.py's
    SchedulerStats); counters are cumulative since start-up. ``kv_cache_usage`` is a
    fraction in [0, 1]; prefix-cache queries and hits are in tokens;
    ``num_batched_tokens`` is the number of tokens the step that produced these outputs
    ran through the model (0 for outputs that no model step produced: aborts, start-up,
    utility calls)."""
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
    num_batched_tokens: int = 0
    grammar_bitmask_time_s: float = 0.0  # cumulative host time filling structured-output bitmasks, seconds
    grammar_bitmask_steps: int = 0  # cumulative steps that had constrained rows (a bitmask filled)
    grammar_bitmask_rows: int = 0  # cumulative constrained rows (one per constrained request per such step)


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: Optional[SchedulerStats] = None
    timestamp: float = 0.0


@dataclass
class EngineDeadMessage:
    """Sent on the output queue when the engine core died, or failed to start
    (``during_startup``); ``error_type`` names the exception class (``ValueError`` for a
    bad model or configuration)."""
    message: str
    error_type: str = ""
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
    error: Optional[str] = None  # "<ExceptionType>: <message>" when the call raised


_TYPES = {c.__name__: c for c in (EngineCoreRequest, EngineCoreAbort, LogprobsEntry, EngineCoreOutput,
                                  SchedulerStats, EngineCoreOutputs, EngineDeadMessage, SamplingParams,
                                  EngineCoreReady, EngineCoreShutdown, UtilityRequest, UtilityOutput,
                                  StructuredOutputsParams)}
_OUTPUTS_FORMAT = "EngineCoreOutputs/columns-3"
_STATS_FIELDS = [f.name for f in dataclasses.fields(SchedulerStats)]
# A list of these is sent as it is: walking a prompt's token ids one by one cost ~150 us
# per request on each side of the pipe, time the engine process spends between steps.
_SCALARS = frozenset({int, float, str, bool, type(None)})


def _field_names(cls) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}  # a cache of dataclass field names, filled once per class


def _to_plain(obj: Any) -> Any:
    t = type(obj)
    if t in _SCALARS:
        return obj
    if isinstance(obj, (list, tuple)):
        if _SCALARS.issuperset(map(type, obj)):
            return obj if t is list else list(obj)
        return [_to_plain(x) for x in obj]
    if isinstance(obj, RequestOutputKind):
        return int(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        d = {name: _to_plain(getattr(obj, name)) for name in _field_names(t)}
        d["__type__"] = t.__name__
        return d
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    return obj


def _from_plain(obj: Any) -> Any:
    if isinstance(obj, dict) and "__type__" in obj:
        cls = _TYPES[obj.pop("__type__")]
        kwargs = {k: _from_plain(v) for k, v in obj.items()}
        if cls is SamplingParams:
            kwargs["all_stop_token_ids"] = set(kwargs.get("all_stop_token_ids") or ())
        return cls(**kwargs)
    if isinstance(obj, list):
        if _SCALARS.issuperset(map(type, obj)):
            return obj
        return [_from_plain(x) for x in obj]
    return obj


def _encode_outputs(msg: EngineCoreOutputs) -> list:
    outs = msg.outputs
    rare = [[i, _to_plain(o.new_logprobs), o.finish_reason, o.stop_reason, o.num_cached_tokens, o.error,
             o.first_scheduled_time]
            for i, o in enumerate(outs)
            if o.finish_reason is not None or o.num_cached_tokens or o.new_logprobs is not None
            or o.stop_reason is not None or o.first_scheduled_time is not None]
    stats = msg.scheduler_stats
    return [_OUTPUTS_FORMAT, msg.timestamp,
            None if stats is None else [getattr(stats, n) for n in _STATS_FIELDS],
            [o.request_id for o in outs], [o.new_token_ids for o in outs], rare]


def _decode_outputs(obj: list) -> EngineCoreOutputs:
    _, timestamp, stats, rids, toks, rare = obj
    outs = [EngineCoreOutput(r, t) for r, t in zip(rids, toks)]
    for i, lps, finish, stop, cached, error, scheduled in rare:
        o = outs[i]
        o.new_logprobs, o.stop_reason, o.num_cached_tokens = _from_plain(lps), stop, cached
        o.finish_reason = None if finish is None else FinishReason(finish)
        o.error, o.first_scheduled_time = error, scheduled
    return EngineCoreOutputs(outs, None if stats is None else SchedulerStats(*stats), timestamp)


def encode(msg: Any) -> bytes:
    """Serialize a message dataclass with cbor2."""
    if type(msg) is EngineCoreOutputs:
        return cbor2.dumps(_encode_outputs(msg))
    return cbor2.dumps(_to_plain(msg))


def decode(data: bytes) -> Any:
    """Inverse of ``encode``; raises ValueError on an unknown message type."""
    try:
        obj = cbor2.loads(data)
        if isinstance(obj, list) and obj and obj[0] == _OUTPUTS_FORMAT:
            return _decode_outputs(obj)
        return _from_plain(obj)
    except KeyError as e:
        raise ValueError(f"Unknown message type {e}") from None
