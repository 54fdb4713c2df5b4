"""The cbor2 codec of the engine-core messages (``pyengine.messages``): the multi-process
client (``core_client.MPClient``) sends ``encode(msg)`` over a pipe to the engine-core
process and ``decode``s what comes back; the in-process client passes the objects
directly.

The codec is generic (a map per dataclass, named by ``__type__``) except for the one
message sent every engine step, ``EngineCoreOutputs``: that goes column-wise (request
ids, token id lists, and the rare non-default fields sparsely), which costs about a
tenth of the generic form for a batch of 256 (see docs/benchmarks.md)."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import cbor2

from pyengine.messages import (
    EngineCoreAbort,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    EngineCoreShutdown,
    EngineDeadMessage,
    ErrorInfo,
    FinishReason,
    LogprobsEntry,
    SchedulerStats,
    UtilityOutput,
    UtilityRequest,
)
from pyengine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__all__ = ["encode", "decode"]

_TYPES = {c.__name__: c for c in (EngineCoreRequest, EngineCoreAbort, LogprobsEntry, EngineCoreOutput,
                                  SchedulerStats, EngineCoreOutputs, EngineDeadMessage, SamplingParams,
                                  EngineCoreReady, EngineCoreShutdown, UtilityRequest, UtilityOutput,
                                  StructuredOutputsParams, ErrorInfo)}
_OUTPUTS_FORMAT = "EngineCoreOutputs/columns-3"
_STATS_FIELDS = [f.name for f in dataclasses.fields(SchedulerStats)]
# A list of these is sent as it is: walking a prompt's token ids one by one cost ~150 us
# per request on each side of the pipe, time the engine process spends between steps.
_SCALARS = frozenset({int, float, str, bool, type(None)})


@functools.cache
def _field_names(cls) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


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
