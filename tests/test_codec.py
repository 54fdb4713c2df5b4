"""cbor2 codec of the engine-core messages: round trips and unknown types."""
import cbor2
import pytest

from pyengine.codec import decode, encode
from pyengine.messages import (
    EngineCoreAbort,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDeadMessage,
    ErrorInfo,
    FinishReason,
    LogprobsEntry,
    SchedulerStats,
)
from pyengine.sampling_params import RequestOutputKind, SamplingParams


def roundtrip(msg):
    data = encode(msg)
    assert isinstance(data, bytes)
    out = decode(data)
    assert type(out) is type(msg)
    assert out == msg
    return out


def test_engine_core_request_roundtrip():
    sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, seed=1234,
                        stop=["\n\n", "END"], stop_token_ids=[7, 9], max_tokens=33, min_tokens=2,
                        logprobs=3, presence_penalty=0.5, frequency_penalty=-0.25,
                        repetition_penalty=1.1, include_stop_str_in_output=True,
                        skip_special_tokens=False, output_kind=RequestOutputKind.DELTA,
                        all_stop_token_ids={2, 3})
    req = EngineCoreRequest("req-1", [1, 2, 3, 400], sp, 33, 12345.678, priority=-2)
    out = roundtrip(req)
    p = out.sampling_params
    assert isinstance(p, SamplingParams)
    assert p.stop == ["\n\n", "END"]
    assert p.stop_token_ids == [7, 9]
    assert p.seed == 1234
    assert p.output_kind is RequestOutputKind.DELTA
    assert isinstance(p.all_stop_token_ids, set)
    assert p.all_stop_token_ids == {2, 3, 7, 9}
    assert out.prompt_token_ids == [1, 2, 3, 400]
    assert out.arrival_time == 12345.678
    assert out.priority == -2 and out.max_tokens == 33


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_sampling_params_output_kinds_and_defaults(kind):
    sp = SamplingParams(output_kind=kind)
    req = EngineCoreRequest("r", [5], sp, 16, 0.0)
    out = roundtrip(req)
    assert out.sampling_params.output_kind is kind
    assert out.sampling_params.seed is None
    assert out.sampling_params.stop == [] and out.sampling_params.all_stop_token_ids == set()


def test_abort_roundtrip():
    out = roundtrip(EngineCoreAbort(["a", "b", "c"]))
    assert out.request_ids == ["a", "b", "c"]
    roundtrip(EngineCoreAbort([]))


def test_outputs_roundtrip_with_logprobs_and_stats():
    stats = SchedulerStats(num_running=3, num_waiting=1, kv_cache_usage=0.375, prefix_cache_queries=100,
                           prefix_cache_hits=48, num_preemptions=2, num_gpu_blocks=64,
                           num_free_blocks=40, num_steps=17, step_host_time_s=0.0125, num_batched_tokens=300)
    outs = EngineCoreOutputs([
        EngineCoreOutput("a", [11], [LogprobsEntry([11, 12, 13], [-0.1, -2.5, -3.0], 1)]),
        EngineCoreOutput("b", [2], None, finish_reason="stop", stop_reason=None, num_cached_tokens=16),
        EngineCoreOutput("c", [9], None, finish_reason="stop", stop_reason=9),
        EngineCoreOutput("d", [], None, finish_reason="stop", stop_reason="END"),
        EngineCoreOutput("e", [], finish_reason="abort"),
        EngineCoreOutput("f", [], finish_reason="error", error="OverflowError: injected"),
        EngineCoreOutput("g", [4], first_scheduled_time=98.25),  # only that field is not the default
    ], stats, 99.5)
    out = roundtrip(outs)
    a, b, c, d, e, f, g = out.outputs
    assert f.finish_reason == "error" and f.error == "OverflowError: injected" and a.error is None
    # the codec carries the value; the far side gets the enum back
    assert [o.finish_reason for o in out.outputs] == [None, FinishReason.STOP, FinishReason.STOP,
                                                      FinishReason.STOP, FinishReason.ABORT, FinishReason.ERROR, None]
    assert all(type(o.finish_reason) is FinishReason for o in out.outputs[1:-1])
    assert isinstance(a.new_logprobs[0], LogprobsEntry)
    assert a.new_logprobs[0].token_ids == [11, 12, 13]
    assert a.new_logprobs[0].logprobs == [-0.1, -2.5, -3.0]
    assert a.new_logprobs[0].sampled_rank == 1
    assert not a.finished and b.finished and e.finished
    assert c.stop_reason == 9 and d.stop_reason == "END"
    assert b.num_cached_tokens == 16
    assert g.first_scheduled_time == 98.25 and a.first_scheduled_time is None
    assert isinstance(out.scheduler_stats, SchedulerStats)
    assert out.scheduler_stats.kv_cache_usage == 0.375 and out.scheduler_stats.num_batched_tokens == 300
    assert out.timestamp == 99.5


def test_outputs_roundtrip_empty_and_no_stats():
    out = roundtrip(EngineCoreOutputs())
    assert out.outputs == [] and out.scheduler_stats is None


def test_dead_message_roundtrip():
    roundtrip(EngineDeadMessage("RuntimeError: boom", ErrorInfo("RuntimeError", "boom")))


def test_unknown_type_raises_value_error():
    with pytest.raises(ValueError):
        decode(cbor2.dumps({"__type__": "NotAMessage", "x": 1}))


def test_unknown_nested_type_raises_value_error():
    data = cbor2.dumps({"__type__": "EngineCoreOutputs", "outputs": [{"__type__": "Bogus"}],
                        "scheduler_stats": None, "timestamp": 0.0})
    with pytest.raises(ValueError):
        decode(data)


def test_finish_reason_is_the_openai_string():
    """FinishReason members are the OpenAI strings: equal, same hash, same JSON."""
    import json

    assert [r.value for r in FinishReason] == ["stop", "length", "abort", "error"]
    for r in FinishReason:
        assert r == r.value and str(r) == r.value and hash(r) == hash(r.value)
        assert json.dumps({"finish_reason": r}) == json.dumps({"finish_reason": r.value})
        assert {r.value: 1}[r] == 1
    assert FinishReason("length") is FinishReason.LENGTH


@pytest.mark.parametrize("so", [
    dict(json='{"type":"object","properties":{"a":{"type":"integer"}}}', disable_any_whitespace=True),
    dict(regex=r"[0-9]{3}"), dict(choice=["yes", "no"]), dict(grammar='root ::= "a" | "b"'),
    dict(json_object=True, disable_additional_properties=True)])
def test_structured_outputs_params_roundtrip(so):
    from pyengine.sampling_params import StructuredOutputsParams

    sp = SamplingParams(structured_outputs=StructuredOutputsParams(**so), all_stop_token_ids={2})
    out = roundtrip(EngineCoreRequest("r", [5], sp, 16, 0.0))
    got = out.sampling_params.structured_outputs
    assert isinstance(got, StructuredOutputsParams) and got == sp.structured_outputs
    assert got.kind == sp.structured_outputs.kind


def test_errors_cross_as_their_class():
    from pyengine.exceptions import EngineDeadError, VLLMValidationError, exception_from
    from pyengine.messages import UtilityOutput

    for exc in (ValueError("bad model"), VLLMValidationError("too long", parameter="prompt"),
                EngineDeadError("gone"), OverflowError("huge")):
        out = roundtrip(UtilityOutput(3, None, ErrorInfo.of(exc)))
        back = exception_from(out.error)
        if type(exc) is OverflowError:  # not transported: a RuntimeError naming the class
            assert type(back) is RuntimeError and str(back) == "OverflowError: huge"
        else:
            assert type(back) is type(exc) and str(back) == str(exc)
            assert getattr(back, "parameter", None) == getattr(exc, "parameter", None)
