"""``/v1/messages`` without HTTP (pyengine/entrypoints/anthropic/): requests as the
``anthropic`` SDK sends them, refusals of what cannot be honoured, the chat request they
become, and messages, event streams, token counts and error bodies validated by the SDK's
own types, SSE parser and stream accumulator (``messages.stream``)."""
from __future__ import annotations

import json

import anthropic
import pytest
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
from anthropic.types.shared import ErrorResponse
from pydantic import TypeAdapter, ValidationError

from pyengine.entrypoints.anthropic.messages_utils import (
    MessagesStreamState,
    anthropic_param,
    chat_to_message,
    messages_to_chat_request,
    sse,
    stop_reason_of,
)
from pyengine.entrypoints.anthropic.protocol import (
    CountTokensRequest,
    MessagesRequest,
    check_messages_request,
    count_tokens_response,
    error_body,
)
from pyengine.entrypoints.openai.protocol import ChatCompletionRequest
from pyengine.entrypoints.structured_outputs import structured_outputs_from_request
from pyengine.entrypoints.tool_calls import normalize_tools, resolve_tool_choice
from pyengine.exceptions import VLLMValidationError
from tests.entrypoints.sdk_helpers import Recorder, assert_declared, http_module, json_reply, sse_reply

EVENT = TypeAdapter(RawMessageStreamEvent)
WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ARGS = '{"city": "Paris"}'


def client_for(rec: Recorder) -> anthropic.Anthropic:
    return anthropic.Anthropic(api_key="k", base_url="http://test", http_client=rec.http_client(anthropic))


def sent_by_sdk(**kwargs) -> dict:
    """The JSON body ``client.messages.create(**kwargs)`` sends."""
    rec = Recorder(lambda body: json_reply(chat_to_message(parse({"model": "m", "max_tokens": 1, "messages": [
        {"role": "user", "content": "x"}]}), chat_completion(content="hi"))))
    client_for(rec).messages.create(model="m", **kwargs)
    assert rec.paths == ["/v1/messages"]
    return rec.bodies[0]


def parse(body: dict, cls=MessagesRequest):
    return cls.model_validate_json(json.dumps(body))


def chat_completion(content=None, reasoning=None, tool_calls=None, finish="stop", stop_reason=None, prompt=5,
                    completion=7, cached=None) -> dict:
    msg = {"role": "assistant", "content": content}
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    if tool_calls:
        msg["tool_calls"] = tool_calls
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": msg, "finish_reason": finish, "stop_reason": stop_reason}],
            "usage": usage}


def tool_call(call_id="toolu_1", name="get_weather", arguments=ARGS) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# ---- requests ------------------------------------------------------------------------------


def test_sdk_request_is_understood_and_becomes_a_chat_request():
    body = sent_by_sdk(
        max_tokens=4096, system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools.",
                                                                          "cache_control": {"type": "ephemeral"}}],
        stop_sequences=["END"], tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather",
                                                              "disable_parallel_tool_use": True},
        thinking={"type": "enabled", "budget_tokens": 2048}, metadata={"user_id": "u1"},
        output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}},
        messages=[{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": [
                      {"type": "thinking", "thinking": "I should call it.", "signature": "sig"},
                      {"type": "text", "text": "Checking."},
                      {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                  {"role": "user", "content": [
                      {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                      {"type": "text", "text": "And tomorrow?"}]}],
        extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 5})
    req = parse(body)
    check_messages_request(req)
    chat = messages_to_chat_request(req)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief.\nUse tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "I should call it.",
         "tool_calls": [tool_call()]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "And tomorrow?"}]
    assert (chat["max_tokens"], chat["stop"], chat["temperature"], chat["top_p"], chat["top_k"]) == \
        (4096, ["END"], 0.5, 0.9, 5)
    assert chat["thinking_token_budget"] == 2048  # enforced by the engine (vLLM's chat field)
    assert chat["user"] == "u1" and chat["parallel_tool_calls"] is False and chat["stream"] is False
    assert chat["chat_template_kwargs"] == {"enable_thinking": True}
    assert "continue_final_message" not in chat
    creq = ChatCompletionRequest.model_validate(chat)
    tools = normalize_tools(creq.tools)
    assert tools == [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                       "parameters": WEATHER["input_schema"]}}]
    mode = resolve_tool_choice(tools, creq.tool_choice, creq.parallel_tool_calls)
    assert (mode.kind, mode.name, mode.parallel_tool_calls) == ("named", "get_weather", False)
    so = structured_outputs_from_request(creq.structured_output_fields())
    assert so is not None and so.json == {"type": "object"}


@pytest.mark.parametrize("choice,want", [({"type": "auto"}, "auto"), ({"type": "any"}, "required"),
                                         ({"type": "none"}, "none"), (None, None)])
def test_tool_choice_mapping(choice, want):
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]}
    if choice:
        body["tool_choice"] = choice
    chat = messages_to_chat_request(parse(body))
    assert chat.get("tool_choice") == want
    mode = resolve_tool_choice(normalize_tools(chat["tools"]), chat.get("tool_choice"), None, True)
    assert mode.kind == (want or "auto")


def test_prefill_thinking_off_and_count_tokens():
    body = {"model": "m", "max_tokens": 5, "thinking": {"type": "disabled"},
            "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "The answer is"}]}
    chat = messages_to_chat_request(parse(body))
    assert chat["continue_final_message"] is True and chat["add_generation_prompt"] is False
    assert chat["messages"][-1] == {"role": "assistant", "content": "The answer is"}
    assert chat["chat_template_kwargs"] == {"enable_thinking": False}
    ChatCompletionRequest.model_validate(chat)
    # count_tokens, as the SDK sends it
    rec = Recorder(lambda b: json_reply(count_tokens_response(17)))
    got = client_for(rec).messages.count_tokens(model="m", system="S", messages=[{"role": "user", "content": "x"}],
                                                tools=[WEATHER])
    assert isinstance(got, MessageTokensCount) and got.input_tokens == 17
    assert rec.paths == ["/v1/messages/count_tokens"]
    creq = parse(rec.bodies[0], CountTokensRequest)
    check_messages_request(creq)
    counted = messages_to_chat_request(creq)
    assert counted["messages"] == [{"role": "system", "content": "S"}, {"role": "user", "content": "x"}]
    assert "max_tokens" not in counted and counted["tools"][0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize("max_tokens,budget,param,message", [
    (4096, 1023, "thinking.budget_tokens", "thinking.enabled.budget_tokens: Input should be greater than or equal "
                                           "to 1024"),
    (1024, 1024, "max_tokens", "`max_tokens` must be greater than `thinking.budget_tokens`."),
    (1000, 2048, "max_tokens", "`max_tokens` must be greater than `thinking.budget_tokens`."),
])
def test_thinking_budget_is_checked_as_anthropic_does(max_tokens, budget, param, message):
    body = {"model": "m", "max_tokens": max_tokens, "messages": [{"role": "user", "content": "x"}],
            "thinking": {"type": "enabled", "budget_tokens": budget}}
    with pytest.raises(VLLMValidationError) as e:
        check_messages_request(parse(body))
    assert e.value.parameter == param and str(e.value).startswith(message), str(e.value)
    assert error_body(400, str(e.value))["error"]["type"] == "invalid_request_error"


def test_thinking_budget_edges_and_count_tokens():
    ok = {"model": "m", "max_tokens": 1025, "messages": [{"role": "user", "content": "x"}],
          "thinking": {"type": "enabled", "budget_tokens": 1024}}
    check_messages_request(parse(ok))
    assert messages_to_chat_request(parse(ok))["thinking_token_budget"] == 1024
    assert anthropic_param("thinking_token_budget") == "thinking.budget_tokens"
    # count_tokens has no max_tokens and generates nothing: the 1024 floor only, no budget in its chat request
    counted = dict(ok)
    del counted["max_tokens"]
    creq = parse(counted, CountTokensRequest)
    check_messages_request(creq)
    assert "thinking_token_budget" not in messages_to_chat_request(creq)
    counted["thinking"] = {"type": "enabled", "budget_tokens": 10}
    with pytest.raises(VLLMValidationError, match="greater than or equal to 1024"):
        check_messages_request(parse(counted, CountTokensRequest))
    # adaptive thinking carries no budget
    adaptive = dict(ok, thinking={"type": "adaptive"}, max_tokens=5)
    check_messages_request(parse(adaptive))
    assert "thinking_token_budget" not in messages_to_chat_request(parse(adaptive))


@pytest.mark.parametrize("extra,param", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {}}]}]}]}, "messages[0].content[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "citations": [{"a": 1}]}]}]},
     "messages[0].content[0].citations"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
    ({"tools": [dict(WEATHER, strict=True)]}, "tools[0].strict"),
    ({"tools": [dict(WEATHER, input_examples=[{"city": "x"}])]}, "tools[0].input_examples"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024, "display": "omitted"}}, "thinking.display"),
    ({"thinking": {"type": "between_tools"}}, "thinking"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"container": "c_1"}, "container"),
    ({"mcp_servers": [{"name": "x"}]}, "mcp_servers"),
    ({"service_tier": "priority"}, "service_tier"),
    ({"frobnicate": True}, "frobnicate"),
    ({"metadata": {"user_id": "u", "team": "t"}}, "metadata.team"),
])
def test_what_cannot_be_honoured_is_refused(extra, param):
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER], **extra}
    with pytest.raises(VLLMValidationError) as e:
        check_messages_request(parse(body))
    assert e.value.parameter == param, str(e.value)


def test_tool_type_may_be_absent_custom_or_null():
    for extra in ({}, {"type": "custom"}, {"type": None}):
        body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                "tools": [dict(WEATHER, **extra)]}
        check_messages_request(parse(body))
        assert messages_to_chat_request(parse(body))["tools"][0]["function"]["name"] == "get_weather"


def test_strict_tool_with_a_forced_choice_is_honoured():
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
            "tools": [dict(WEATHER, strict=True)], "tool_choice": {"type": "any"}}
    check_messages_request(parse(body))


def test_bad_bodies_and_param_names():
    for body in ({"model": "m", "messages": [{"role": "user", "content": "x"}]},  # max_tokens is required
                 {"model": "m", "max_tokens": 5, "messages": []},
                 {"model": "m", "max_tokens": "5", "messages": [{"role": "user", "content": "x"}]},
                 {"model": "m", "max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]}):
        with pytest.raises(ValidationError):
            parse(body)
    assert anthropic_param("stop") == "stop_sequences" and anthropic_param("max_tokens") == "max_tokens"
    assert anthropic_param("response_format.json_schema") == "output_config.format.json_schema"


def test_error_bodies():
    for status, kind in [(400, "invalid_request_error"), (401, "authentication_error"), (404, "not_found_error"),
                         (429, "rate_limit_error"), (500, "api_error"), (529, "overloaded_error")]:
        body = error_body(status, "nope")
        err = ErrorResponse.model_validate(body)
        assert err.error.type == kind and err.error.message == "nope"
    # the SDK raises its typed error from our body
    http = http_module(anthropic)
    client = anthropic.Anthropic(api_key="k", base_url="http://test", max_retries=0, http_client=http.Client(
        transport=http.MockTransport(lambda r: http.Response(400, json=error_body(400, "max_tokens: too big")))))
    with pytest.raises(anthropic.BadRequestError, match="too big"):
        client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}])


# ---- finished messages ---------------------------------------------------------------------


def _req(**kw):
    return parse({"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "x"}],
                  "stop_sequences": ["END"], "tools": [WEATHER], **kw})


@pytest.mark.parametrize("case", ["text", "thinking", "tool_use", "named", "length", "stop_sequence", "bad_args"])
def test_message_object(case):
    chat = {"text": chat_completion(content="Hello"),
            "thinking": chat_completion(content="\n\nOK", reasoning="Hmm", cached=2),
            "tool_use": chat_completion(content="\n\n", reasoning="Hmm", tool_calls=[tool_call()], finish="tool_calls"),
            "named": chat_completion(tool_calls=[tool_call()], finish="stop"),  # chat's named choice keeps "stop"
            "length": chat_completion(reasoning="Hm", finish="length"),
            "stop_sequence": chat_completion(content="Hi", stop_reason="END"),
            "bad_args": chat_completion(tool_calls=[tool_call(arguments='{"city": "Par')], finish="length")}[case]
    msg = Message.model_validate(chat_to_message(_req(), chat, message_id="msg_x", reasoning_tokens=1))
    assert_declared(msg)
    assert msg.id == "msg_x" and msg.model == "m" and msg.role == "assistant"
    kinds = [b.type for b in msg.content]
    want = {"text": (["text"], "end_turn"), "thinking": (["thinking", "text"], "end_turn"),
            "tool_use": (["thinking", "tool_use"], "tool_use"), "named": (["tool_use"], "tool_use"),
            "length": (["thinking"], "max_tokens"), "stop_sequence": (["text"], "stop_sequence"),
            "bad_args": (["text"], "max_tokens")}[case]
    assert (kinds, msg.stop_reason) == want
    assert msg.stop_sequence == ("END" if case == "stop_sequence" else None)
    if case == "thinking":
        assert msg.content[0].thinking == "Hmm" and msg.content[1].text == "\n\nOK"
        assert (msg.usage.input_tokens, msg.usage.cache_read_input_tokens, msg.usage.output_tokens) == (3, 2, 7)
        assert msg.usage.output_tokens_details.thinking_tokens == 1
    if case in ("tool_use", "named"):
        block = msg.content[-1]
        assert (block.id, block.name, block.input) == ("toolu_1", "get_weather", {"city": "Paris"})


def test_abort_and_error_are_not_messages():
    for finish in ("abort", "error"):
        with pytest.raises(ValueError, match="error body"):
            chat_to_message(_req(), chat_completion(content="x", finish=finish))
    assert stop_reason_of(_req(), "stop", 7, False) == ("end_turn", None)  # a stop token id, not a sequence


# ---- streams -------------------------------------------------------------------------------

STREAMS = {
    "text": ([{"content": "Hel"}, {"content": "lo"}], "stop", None),
    "thinking": ([{"reasoning_content": "H"}, {"reasoning_content": "mm"}, {"content": "\n\n"}, {"content": "OK"}],
                 "stop", None),
    "tool_use": ([{"reasoning_content": "Hmm"}, {"content": "\n\n"}, {"tool_calls": [dict(tool_call(), index=0)]}],
                 "tool_calls", None),
    "pieces": ([{"tool_calls": [{"index": 0, "id": "toolu_1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": ""}}]},
                {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
                {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]},
                {"tool_calls": [dict(tool_call("toolu_2", arguments="{}"), index=1)]}], "stop", None),
    "length": ([{"reasoning_content": "Hm"}], "length", None),
    "stop_sequence": ([{"content": "Hi"}], "stop", "END"),
    "spaces_only": ([{"content": "\n\n"}], "stop", None),
    "empty": ([], "stop", None),
}


def run_stream(deltas, finish, stop_reason):
    st = MessagesStreamState(_req(), "m", 5, message_id="msg_s")
    events = st.start()
    for d in deltas:
        events += st.chat_delta(d)
    return events + st.finish(finish, 7, stop_reason)


@pytest.mark.parametrize("case", list(STREAMS))
def test_stream_events(case):
    deltas, finish, stop_reason = STREAMS[case]
    events = run_stream(deltas, finish, stop_reason)
    for e in events:
        assert_declared(EVENT.validate_python(e))
    types = [e["type"] for e in events]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    # blocks open, get deltas and close in order, one at a time
    open_index = None
    for e in events[1:-2]:
        if e["type"] == "content_block_start":
            assert open_index is None
            open_index = e["index"]
        elif e["type"] == "content_block_delta":
            assert e["index"] == open_index
        else:
            assert e["type"] == "content_block_stop" and e["index"] == open_index
            open_index = None
    assert open_index is None
    # the SDK's stream accumulator (messages.stream) agrees with the non-streamed message
    rec = Recorder(lambda body: sse_reply([sse(e) for e in events]))
    with client_for(rec).messages.stream(model="m", max_tokens=9, messages=[{"role": "user", "content": "x"}]) as s:
        final = s.get_final_message()
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            c = calls.setdefault(tc["index"], {"id": tc.get("id"), "type": "function",
                                               "function": {"name": tc["function"].get("name"), "arguments": ""}})
            c["function"]["arguments"] += tc["function"].get("arguments", "")
    whole = Message.model_validate(chat_to_message(_req(), chat_completion(
        "".join(d.get("content", "") for d in deltas) or None,
        "".join(d.get("reasoning_content", "") for d in deltas) or None, list(calls.values()), finish, stop_reason)))
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert (final.stop_reason, final.stop_sequence) == (whole.stop_reason, whole.stop_sequence)
    assert final.usage.output_tokens == 7 and final.usage.input_tokens == 5


def test_stream_error_event_is_raised_by_the_sdk():
    events = MessagesStreamState(_req(), "m", 5).start() + [MessagesStreamState.error_event("engine died")]
    rec = Recorder(lambda body: sse_reply([sse(e) for e in events]))
    with pytest.raises(anthropic.APIStatusError, match="engine died"), \
            client_for(rec).messages.stream(model="m", max_tokens=9, messages=[{"role": "user", "content": "x"}]) as s:
        s.get_final_message()
