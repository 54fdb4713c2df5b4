"""Tool calling over HTTP with the openai client: tool_choice required / named function
(enforced with structured outputs), auto with the hermes parser, streamed tool-call deltas
as OpenAI sends them, tool calls and tool results in the history, and 400s."""
from __future__ import annotations

import json

import jsonschema
import pytest

from tests.server.conftest import MODEL_NAME, openai_client, serve_app
from tests.server.http_util import collect_stream, post

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMA_OF = {"get_weather": WEATHER, "get_time": TIME}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_server(engine):
    """An app over the session engine with the hermes parser and auto tool choice."""
    yield from serve_app(engine, served_model_name=[MODEL_NAME], tool_call_parser="hermes",
                         enable_auto_tool_choice=True)


@pytest.fixture(scope="module")
def tool_client(tool_server):
    return openai_client(tool_server)


def _check_calls(calls, names=None):
    assert calls
    for c in calls:
        assert c.type == "function" and c.id
        assert names is None or c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMA_OF[c.function.name])


def _accumulate(stream):
    """A streamed answer put together as a client does: {index: [id, name, arguments]},
    content, finish_reason; checks that id/type/name come first, once per call."""
    calls: dict = {}
    content, finish = "", None
    for ch in stream:
        if not ch.choices:
            continue
        c = ch.choices[0]
        content += c.delta.content or ""
        for tc in c.delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id and tc.type == "function" and tc.function.name, "a call's first delta names it"
                calls[tc.index] = [tc.id, tc.function.name, tc.function.arguments or ""]
            else:
                assert tc.id is None and not (tc.function.name or "")
                calls[tc.index][2] += tc.function.arguments or ""
        if c.finish_reason is not None:
            finish = c.finish_reason
    return calls, content, finish


@pytest.mark.parametrize("stream", [False, True])
def test_named_function(client, stream):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(model=MODEL_NAME, messages=MSGS, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=300)
    if stream:
        calls, content, finish = _accumulate(client.chat.completions.create(stream=True, **kw))
        assert list(calls) == [0] and calls[0][1] == "get_weather" and not content
        jsonschema.validate(json.loads(calls[0][2]), WEATHER)
    else:
        r = client.chat.completions.create(**kw)
        msg, finish = r.choices[0].message, r.choices[0].finish_reason
        assert msg.content is None and len(msg.tool_calls) == 1
        _check_calls(msg.tool_calls, {"get_weather"})
    assert finish == "stop"  # a forced function ends with "stop", as OpenAI's


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parallel", [True, False])
def test_required(client, stream, parallel):
    kw = dict(model=MODEL_NAME, messages=MSGS, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=300,
              parallel_tool_calls=parallel)
    if stream:
        calls, content, finish = _accumulate(client.chat.completions.create(stream=True, **kw))
        assert calls and not content and sorted(calls) == list(range(len(calls)))
        for _, name, args in calls.values():
            jsonschema.validate(json.loads(args), SCHEMA_OF[name])
        n = len(calls)
    else:
        r = client.chat.completions.create(**kw)
        msg, finish = r.choices[0].message, r.choices[0].finish_reason
        assert msg.content is None
        _check_calls(msg.tool_calls, set(SCHEMA_OF))
        n = len(msg.tool_calls)
    assert finish == "tool_calls"
    assert parallel or n == 1


def test_history_with_tool_calls_and_results(client, tool_client):
    first = client.chat.completions.create(model=MODEL_NAME, messages=MSGS, tools=TOOLS, temperature=0,
                                           max_tokens=200, tool_choice="required")
    calls = first.choices[0].message.tool_calls
    history = MSGS + [first.choices[0].message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": json.dumps({"forecast": "sunny"})} for c in calls]
    r = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS, tool_choice="none",
                                       temperature=0, max_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"
    # the tiny model's template (ChatML-like) renders every message it gets, tool results included
    r2 = client.chat.completions.create(model=MODEL_NAME, messages=history[:1], temperature=0, max_tokens=8)
    assert r.usage.prompt_tokens > r2.usage.prompt_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_auto_with_hermes_parser(tool_client, stream):
    """tool_choice auto: the output is free and the hermes parser reads <tool_call> blocks;
    a regex (vLLM's structured_outputs field) makes the random model write one."""
    regex = (r'Let me check\.<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,8}", '
             r'"days": [1-7]\}\}\n</tool_call>')
    kw = dict(model=MODEL_NAME, messages=MSGS, tools=TOOLS, temperature=0, max_tokens=200,
              extra_body={"structured_outputs": {"regex": regex}})
    if stream:
        calls, content, finish = _accumulate(tool_client.chat.completions.create(stream=True, **kw))
        assert content == "Let me check." and list(calls) == [0] and calls[0][1] == "get_weather"
        jsonschema.validate(json.loads(calls[0][2]), WEATHER)
    else:
        r = tool_client.chat.completions.create(**kw)
        msg, finish = r.choices[0].message, r.choices[0].finish_reason
        assert msg.content == "Let me check."
        _check_calls(msg.tool_calls, {"get_weather"})
    assert finish == "tool_calls"
    # no call in the output: plain content, finish_reason unchanged
    r = tool_client.chat.completions.create(model=MODEL_NAME, messages=MSGS, tools=TOOLS, temperature=0,
                                            max_tokens=6)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"


def test_stream_chunks_have_openai_shape(server):
    body = {"model": MODEL_NAME, "messages": MSGS, "tools": TOOLS, "stream": True, "temperature": 0,
            "max_tokens": 300, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    status, events, _ = collect_stream(server.port, "/v1/chat/completions", body)
    assert status == 200 and events[-1][1] == "[DONE]"
    deltas = [e["choices"][0]["delta"] for _, e in events[:-1] if e["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    head = deltas[1]["tool_calls"][0]
    assert head["index"] == 0 and head["type"] == "function" and head["id"].startswith("chatcmpl-tool-")
    assert head["function"] == {"name": "get_time", "arguments": ""}
    args = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas[2:] if d.get("tool_calls"))
    jsonschema.validate(json.loads(args), TIME)


@pytest.mark.parametrize("body, param, needle", [
    ({"tool_choice": "auto"}, "tool_choice", "--enable-auto-tool-choice"),
    ({}, "tool_choice", "--enable-auto-tool-choice"),  # tools without tool_choice: OpenAI's default "auto"
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not in tools"),
    ({"tool_choice": "sometimes"}, "tool_choice", "must be 'none', 'auto', 'required'"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools", "only function tools"),
    ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools", "used twice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "cannot be combined"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": None, "functions": [{"name": "f"}]}, "functions", "use tools"),
])
def test_tool_errors_are_400(server, body, param, needle):
    req = {"model": MODEL_NAME, "messages": MSGS, "tools": TOOLS, "max_tokens": 4, **body}
    status, _, data = post(server.port, "/v1/chat/completions", req)
    assert status == 400, data
    err = json.loads(data)["error"]
    assert needle in err["message"] and err["param"] == param, err


@pytest.mark.parametrize("field, value", [("tools", TOOLS), ("tool_choice", "required"), ("parallel_tool_calls", False)])
def test_tool_fields_on_completions_are_400(server, field, value):
    status, _, data = post(server.port, "/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4,
                                                             field: value})
    assert status == 400, data
    err = json.loads(data)["error"]
    assert err["param"] == field and "/v1/chat/completions" in err["message"], err


def test_cli_flags():
    from server.cli import parse_args

    args = parse_args(["serve", "m", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert args.enable_auto_tool_choice and args.tool_call_parser == "hermes"
    with pytest.raises(SystemExit):
        parse_args(["m", "--enable-auto-tool-choice"])
    with pytest.raises(SystemExit):
        parse_args(["m", "--tool-call-parser", "nope"])
