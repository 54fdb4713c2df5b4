"""``/v1/responses`` without HTTP (pyengine/entrypoints/openai/protocol_responses.py and
responses_utils.py): requests as the ``openai`` SDK sends them, refusals of what cannot be
honoured, the chat request they become, and responses and event streams validated by the
SDK's own types, SSE parser and stream accumulator."""
from __future__ import annotations

import json

import openai
import pytest
from openai.lib.streaming.responses import ResponseStreamState as SDKStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from pyengine.entrypoints.openai.protocol import ChatCompletionRequest
from pyengine.entrypoints.openai.protocol_responses import ResponsesRequest, check_responses_request, unsupported_fields
from pyengine.entrypoints.openai.responses_utils import (
    ResponsesStreamState,
    chat_to_response,
    responses_param,
    responses_to_chat_request,
    sse,
)
from pyengine.entrypoints.request_fields import unknown_fields
from pyengine.entrypoints.structured_outputs import structured_outputs_from_request
from pyengine.entrypoints.tool_calls import normalize_tools, resolve_tool_choice
from pyengine.exceptions import VLLMValidationError
from tests.entrypoints.sdk_helpers import Recorder, assert_declared, json_reply, sse_reply

EVENT = TypeAdapter(ResponseStreamEvent)
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
           "strict": True}
ARGS = '{"city": "Paris"}'


def sent_by_sdk(**kwargs) -> dict:
    """The JSON body ``client.responses.create(**kwargs)`` sends."""
    rec = Recorder(lambda body: json_reply(_minimal_response()))
    client = openai.OpenAI(api_key="k", base_url="http://test/v1", http_client=rec.http_client())
    client.responses.create(model="m", **kwargs)
    assert rec.paths == ["/v1/responses"]
    return rec.bodies[0]


def _minimal_response() -> dict:
    req = ResponsesRequest.model_validate({"input": "x"})
    return chat_to_response(req, chat_completion(content="hi"))


def chat_completion(content=None, reasoning=None, tool_calls=None, finish="stop", prompt=5, completion=7) -> dict:
    msg = {"role": "assistant", "content": content}
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": msg, "finish_reason": finish}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}


def tool_call(call_id="call_1", name="get_weather", arguments=ARGS) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def parse(body: dict) -> ResponsesRequest:
    return ResponsesRequest.model_validate_json(json.dumps(body))


# ---- requests ------------------------------------------------------------------------------


def test_sdk_request_is_understood_and_becomes_a_chat_request():
    body = sent_by_sdk(
        instructions="Be brief.", max_output_tokens=64, temperature=0.5, top_p=0.9, tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False, store=False,
        text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": True}},
        reasoning={"effort": "low"}, metadata={"k": "v"}, user="u1", truncation="disabled",
        input=[{"role": "developer", "content": "Use tools."},
               {"role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                            {"type": "input_text", "text": "in Paris?"}]},
               {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "r"}]},
               {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": ARGS},
               {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
               {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                "content": [{"type": "output_text", "text": "Sunny.", "annotations": []}]},
               {"role": "user", "content": "And tomorrow?"}],
        extra_body={"top_k": 5, "seed": 3, "chat_template_kwargs": {"x": 1}})
    req = parse(body)
    check_responses_request(req)
    chat = responses_to_chat_request(req)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "r", "tool_calls": [tool_call()]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "And tomorrow?"}]
    assert chat["max_tokens"] == 64 and chat["temperature"] == 0.5 and chat["top_p"] == 0.9
    assert chat["top_k"] == 5 and chat["seed"] == 3 and chat["user"] == "u1" and chat["model"] == "m"
    assert chat["parallel_tool_calls"] is False and chat["stream"] is False
    assert chat["chat_template_kwargs"] == {"enable_thinking": True, "reasoning_effort": "low", "x": 1}
    # the chat layer's own rules accept it and see the same tool, choice and constraint
    creq = ChatCompletionRequest.model_validate(chat)
    tools = normalize_tools(creq.tools)
    assert tools == [{"type": "function", "function": {k: WEATHER[k] for k in
                                                       ("name", "description", "parameters", "strict")}}]
    mode = resolve_tool_choice(tools, creq.tool_choice, creq.parallel_tool_calls)
    assert (mode.kind, mode.name) == ("named", "get_weather")
    so = structured_outputs_from_request(creq.structured_output_fields())
    assert so is not None and so.json == {"type": "object"}


def test_string_input_and_defaults():
    req = parse(sent_by_sdk(input="hi"))
    check_responses_request(req)
    assert responses_to_chat_request(req) == {"messages": [{"role": "user", "content": "hi"}], "model": "m",
                                              "stream": False}
    assert responses_to_chat_request(parse({"input": "x", "reasoning": {"effort": "none"}}))[
        "chat_template_kwargs"] == {"enable_thinking": False}
    fmt = responses_to_chat_request(parse({"input": "x", "text": {"format": {"type": "json_object"}}}))
    assert fmt["response_format"] == {"type": "json_object"}
    assert "response_format" not in responses_to_chat_request(parse({"input": "x", "text": {"format": {"type": "text"}}}))


@pytest.mark.parametrize("extra,param", [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"tools": [dict(WEATHER, defer_loading=True)]}, "tools[0].defer_loading"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"input": [{"role": "user", "content": "x", "flavour": "y"}]}, "input[0].flavour"),
])
def test_what_cannot_be_honoured_is_refused(extra, param):
    body = {"model": "m", "input": "hi", **extra}
    req = parse(body)
    assert unknown_fields(req) or unsupported_fields(req)
    with pytest.raises(VLLMValidationError) as e:
        check_responses_request(req)
    assert e.value.parameter == param, str(e.value)


def test_refusals_name_the_responses_field():
    assert responses_param("max_tokens") == "max_output_tokens"
    assert responses_param("response_format.json_schema.schema") == "text.format.json_schema.schema"
    assert responses_param("messages") == "input" and responses_param("temperature") == "temperature"
    assert responses_param(None) is None


def test_bad_types_are_validation_errors():
    from pydantic import ValidationError
    for body in ({"input": 5}, {"input": "x", "temperature": "hot"}, {"input": [{"role": "robot", "content": "x"}]},
                 {"input": "x", "max_output_tokens": "9"}):
        with pytest.raises(ValidationError):
            parse(body)


# ---- finished responses ------------------------------------------------------------------


@pytest.mark.parametrize("case", ["text", "reasoning", "tool_call", "length", "empty", "error"])
def test_response_object(case):
    req = parse({"model": "m", "input": "hi", "tools": [WEATHER], "metadata": {"a": "b"}, "max_output_tokens": 9,
                 "user": "u", "safety_identifier": "s1", "prompt_cache_key": "k1"})
    chat = {"text": chat_completion(content="Hello"),
            "reasoning": chat_completion(content="\n\nOK", reasoning="Hmm"),
            "tool_call": chat_completion(content="\n\n", reasoning="Hmm", tool_calls=[tool_call()], finish="tool_calls"),
            "length": chat_completion(reasoning="Hm", finish="length"),
            "empty": chat_completion(content=None),
            "error": chat_completion(content="x", finish="error")}[case]
    obj = chat_to_response(req, chat, response_id="resp_x", created_at=3.0, reasoning_tokens=1,
                           error="RuntimeError: boom" if case == "error" else None)
    resp = Response.model_validate(obj)
    assert_declared(resp)
    assert resp.id == "resp_x" and resp.model == "m" and resp.metadata == {"a": "b"} and resp.max_output_tokens == 9
    assert (resp.user, resp.safety_identifier, resp.prompt_cache_key) == ("u", "s1", "k1")  # echoed, not dropped
    assert resp.usage.input_tokens == 5 and resp.usage.output_tokens == 7 and resp.usage.total_tokens == 12
    kinds = [o.type for o in resp.output]
    if case == "text":
        assert kinds == ["message"] and resp.output_text == "Hello" and resp.status == "completed"
    elif case == "reasoning":
        assert kinds == ["reasoning", "message"] and resp.output[0].content[0].text == "Hmm"
        assert resp.output_text == "\n\nOK" and resp.usage.output_tokens_details.reasoning_tokens == 1
    elif case == "tool_call":
        assert kinds == ["reasoning", "function_call"]  # the whitespace before the call is not a message
        call = resp.output[1]
        assert (call.call_id, call.name, json.loads(call.arguments)) == ("call_1", "get_weather", {"city": "Paris"})
    elif case == "length":
        assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
        assert kinds == ["reasoning"] and resp.output[0].status == "incomplete"
    elif case == "empty":
        assert kinds == ["message"] and resp.output_text == ""
    else:
        assert resp.status == "failed" and resp.error.code == "server_error" and "boom" in resp.error.message


# ---- streams -------------------------------------------------------------------------------

STREAMS = {
    "text": ([{"content": "Hel"}, {"content": "lo"}], "stop"),
    "reasoning": ([{"reasoning_content": "H"}, {"reasoning_content": "mm"}, {"content": "\n\n"}, {"content": "OK"}],
                  "stop"),
    "tool_call": ([{"reasoning_content": "Hmm"}, {"content": "\n\n"},
                   {"tool_calls": [dict(tool_call(), index=0)]}], "tool_calls"),
    "pieces": ([{"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": ""}}]},
                {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
                {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]},
                {"tool_calls": [dict(tool_call("call_2", arguments="{}"), index=1)]}], "tool_calls"),
    "length": ([{"reasoning_content": "Hm"}], "length"),
    "spaces_only": ([{"content": "\n\n"}], "stop"),
    "empty": ([], "stop"),
}


def _unparsed(v):
    """``v`` without the SDK accumulator's ``parsed`` and ``parsed_arguments`` fields."""
    if isinstance(v, dict):
        return {k: _unparsed(x) for k, x in v.items() if k not in ("parsed", "parsed_arguments")}
    return [_unparsed(x) for x in v] if isinstance(v, list) else v


def run_stream(deltas, finish, req=None):
    req = req or parse({"model": "m", "input": "hi", "tools": [WEATHER]})
    st = ResponsesStreamState(req, "m", 5, created_at=2.0)
    events = st.start()
    for d in deltas:
        events += st.chat_delta(d)
    events += st.finish(finish, 7, reasoning_tokens=2)
    return events


@pytest.mark.parametrize("case", list(STREAMS))
def test_stream_events(case):
    deltas, finish = STREAMS[case]
    events = run_stream(deltas, finish)
    parsed = [EVENT.validate_python(e) for e in events]
    for p in parsed:
        assert_declared(p)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    types = [e["type"] for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == ("response.incomplete" if finish == "length" else "response.completed")
    # the SDK's own accumulator rebuilds the final response from the events
    sdk = SDKStreamState(input_tools=[WEATHER], text_format=openai.omit)
    last = [sdk.handle_event(p) for p in parsed][-1]
    final = Response.model_validate(events[-1]["response"])
    if finish != "length":
        (done,) = last
        # what the SDK accumulated (its Parsed* types) is what we say it is
        assert _unparsed([o.model_dump() for o in done.response.output]) == [o.model_dump() for o in final.output]
    assert [o.type for o in final.output] == {
        "text": ["message"], "reasoning": ["reasoning", "message"], "tool_call": ["reasoning", "function_call"],
        "pieces": ["function_call", "function_call"], "length": ["reasoning"], "spaces_only": ["message"],
        "empty": ["message"]}[case]
    # each item's done event carries what its deltas added up to
    for item in final.output:
        adds = "".join(e.get("delta", "") for e in events if e.get("item_id") == item.id and e["type"].endswith(".delta"))
        whole = {"message": lambda i: i.content[0].text, "reasoning": lambda i: i.content[0].text,
                 "function_call": lambda i: i.arguments}[item.type](item)
        assert adds == whole
    assert final.usage.output_tokens_details.reasoning_tokens == 2
    # and so does every .done event of the item
    for e in events:
        if e["type"] in ("response.output_text.done", "response.reasoning_text.done",
                         "response.function_call_arguments.done", "response.content_part.done"):
            adds = "".join(x.get("delta", "") for x in events if x.get("item_id") == e["item_id"]
                           and x["type"].endswith(".delta"))
            assert (e.get("text") or e.get("arguments") or e.get("part", {}).get("text") or "") == adds, e


@pytest.mark.parametrize("case", ["text", "reasoning", "tool_call", "pieces", "length"])
def test_stream_and_whole_response_agree(case):
    """The streamed final response has the items, texts and status the non-streamed one has."""
    deltas, finish = STREAMS[case]
    streamed = Response.model_validate(run_stream(deltas, finish)[-1]["response"])
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas) or None
    content = "".join(d.get("content", "") for d in deltas) or None
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            c = calls.setdefault(tc["index"], {"id": tc.get("id"), "type": "function",
                                               "function": {"name": tc["function"].get("name"), "arguments": ""}})
            c["function"]["arguments"] += tc["function"].get("arguments", "")
    whole = Response.model_validate(chat_to_response(
        parse({"model": "m", "input": "hi", "tools": [WEATHER]}),
        chat_completion(content, reasoning, list(calls.values()), finish)))

    def shape(r):
        return [(o.type, o.status, getattr(o, "arguments", None), getattr(o, "name", None),
                 [c.text for c in (getattr(o, "content", None) or [])]) for o in r.output]
    assert shape(streamed) == shape(whole) and streamed.status == whole.status


def test_sdk_reads_the_stream_and_the_response():
    """Through the SDK: ``responses.create(stream=True)`` parses our SSE frames into typed
    events, ``responses.stream`` accumulates them, ``responses.create`` parses the object."""
    deltas, finish = STREAMS["tool_call"]
    frames = [sse(e) for e in run_stream(deltas, finish)]
    rec = Recorder(lambda body: sse_reply(frames))
    client = openai.OpenAI(api_key="k", base_url="http://test/v1", http_client=rec.http_client())
    got = list(client.responses.create(model="m", input="hi", tools=[WEATHER], stream=True))
    assert [e.type for e in got] == [json.loads(f.split("data: ", 1)[1])["type"] for f in frames]
    with client.responses.stream(model="m", input="hi", tools=[WEATHER]) as s:
        final = s.get_final_response()
    assert [o.type for o in final.output] == ["reasoning", "function_call"]
    assert final.output[1].name == "get_weather" and json.loads(final.output[1].arguments) == {"city": "Paris"}
    assert rec.bodies[-1]["stream"] is True
    whole = chat_to_response(parse({"model": "m", "input": "hi"}), chat_completion(content="Hi", reasoning="Hmm"))
    rec2 = Recorder(lambda body: json_reply(whole))
    client2 = openai.OpenAI(api_key="k", base_url="http://test/v1", http_client=rec2.http_client())
    r = client2.responses.create(model="m", input="hi")
    assert r.output_text == "Hi" and r.output[0].type == "reasoning"
