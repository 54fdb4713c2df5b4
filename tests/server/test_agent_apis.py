"""Issue 28 over HTTP: ``vengine serve --reasoning-parser qwen3`` on the scripted Qwen3-style
reasoning models (tests.helpers.reasoning_script: ``<think>Hmm</think>\\n\\nOK``, or a
hermes tool call after ``</think>``), driven with the official SDKs: chat completions
(``reasoning_content``, streamed and not, tool calls from the content only, structured
outputs after the reasoning, ``chat_template_kwargs``, ``include_reasoning``),
``client.responses.create`` (streamed and not, forced function call) and Anthropic's
``messages.create`` / ``messages.stream`` (forced ``tool_use``), ``count_tokens``, the
Anthropic error body and ``x-api-key``. A tokenizer without the think tokens is refused
at start-up."""
from __future__ import annotations

import json
from types import SimpleNamespace

import anthropic
import openai
import pytest

from tests.server.conftest import make_engine, serve_app

MODEL = "qwen3-tiny"
KEY = "agent-key"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PARAMS = {"type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"]}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}
RESP_TOOL = {"type": "function", "name": "get_weather", "parameters": PARAMS}
ANTH_TOOL = {"name": "get_weather", "description": "Weather", "input_schema": PARAMS}
SERVE = dict(served_model_name=[MODEL], reasoning_parser="qwen3", tool_call_parser="hermes",
             enable_auto_tool_choice=True)


@pytest.fixture(scope="module")
def engines(reasoning_dir, reasoning_tool_dir):
    engs = {"answer": make_engine(reasoning_dir), "tool": make_engine(reasoning_tool_dir)}
    yield engs
    for e in engs.values():
        e.shutdown()


@pytest.fixture(scope="module")
def servers(engines):
    gens = {name: serve_app(eng, **SERVE) for name, eng in engines.items()}
    gens["keyed"] = serve_app(engines["answer"], **SERVE, api_key=KEY)
    gens["r1"] = serve_app(engines["answer"], **dict(SERVE, reasoning_parser="deepseek_r1"))
    srvs = {name: next(g) for name, g in gens.items()}
    yield srvs
    for g in gens.values():
        g.close()


def oai(srv, key="unused"):
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=key, max_retries=0, timeout=60)


def anth(srv, key="unused"):
    return anthropic.Anthropic(base_url=srv.base_url, api_key=key, max_retries=0, timeout=60)


# ---- chat completions --------------------------------------------------------------------


def _stream(client, **kw):
    reasoning, content, calls, finish = [], [], [], None
    for ch in client.chat.completions.create(model=MODEL, messages=ASK, stream=True, **kw):
        for c in ch.choices:
            d = c.delta.model_dump()
            if d.get("reasoning_content"):
                assert d.get("reasoning") == d["reasoning_content"]
                assert not content, "reasoning after the content began"
                reasoning.append(d["reasoning_content"])
            if d.get("content"):
                content.append(d["content"])
            calls += d.get("tool_calls") or []
            finish = c.finish_reason or finish
    return "".join(reasoning), "".join(content), calls, finish


def test_chat_reasoning_split(servers):
    c = oai(servers["answer"])
    r = c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16)
    m = r.choices[0].message.model_dump()
    assert (m["reasoning_content"], m["reasoning"], m["content"]) == ("Hmm", "Hmm", "\n\nOK")
    assert r.usage.completion_tokens_details.reasoning_tokens == 1
    assert _stream(c, max_tokens=16) == ("Hmm", "\n\nOK", [], "stop")


def test_chat_reasoning_split_deepseek_r1(servers):
    """--reasoning-parser deepseek_r1 over the same model (its output opens <think> itself,
    which R1's parser accepts): the same split, streamed and not."""
    c = oai(servers["r1"])
    m = c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16).choices[0].message.model_dump()
    assert (m["reasoning_content"], m["content"]) == ("Hmm", "\n\nOK")
    assert _stream(c, max_tokens=16) == ("Hmm", "\n\nOK", [], "stop")


def test_chat_template_kwargs_and_include_reasoning(servers):
    c = oai(servers["answer"])
    off = c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16,
                                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    m = off.choices[0].message.model_dump()
    assert m["content"] == "OK" and m["reasoning_content"] is None
    hidden = c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16, extra_body={"include_reasoning": False})
    m = hidden.choices[0].message.model_dump()
    assert m["content"] == "\n\nOK" and m["reasoning_content"] is None
    assert _stream(c, max_tokens=16, extra_body={"include_reasoning": False}) == ("", "\n\nOK", [], "stop")


def test_chat_tool_call_after_reasoning(servers):
    c = oai(servers["tool"])
    r = c.chat.completions.create(model=MODEL, messages=ASK, tools=[CHAT_TOOL], max_tokens=32)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.model_dump()["reasoning_content"] == "Hmm"
    assert [(t.function.name, json.loads(t.function.arguments)) for t in ch.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    assert not (ch.message.content or "").strip()
    reasoning, content, calls, finish = _stream(c, tools=[CHAT_TOOL], max_tokens=32)
    assert (reasoning, content.strip(), finish) == ("Hmm", "", "tool_calls")
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(t["function"]["arguments"] or "" for t in calls)) == {"city": "Paris"}


@pytest.mark.parametrize("stream", [False, True])
def test_structured_output_applies_after_reasoning(servers, stream):
    """The grammar leaves the reasoning free (without the gate it would forbid <think>)
    and constrains what follows </think>: a choice the script never says alone."""
    c = oai(servers["answer"])
    kw = dict(max_tokens=16, temperature=0, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    if stream:
        reasoning, content, _, _ = _stream(c, **kw)
    else:
        m = c.chat.completions.create(model=MODEL, messages=ASK, **kw).choices[0].message.model_dump()
        reasoning, content = m["reasoning_content"], m["content"]
    assert reasoning == "Hmm" and content in ("yes", "no")


def test_forced_tool_call_after_reasoning(servers):
    c = oai(servers["tool"])
    r = c.chat.completions.create(model=MODEL, messages=ASK, tools=[CHAT_TOOL], max_tokens=40, temperature=0,
                                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    m = r.choices[0].message
    assert m.model_dump()["reasoning_content"] == "Hmm"
    assert json.loads(m.tool_calls[0].function.arguments) == {"city": "Paris"}


def test_start_up_refuses_a_tokenizer_without_think_tokens(engine):
    from server import create_app

    with pytest.raises(ValueError, match="<think>"):
        create_app(engine, SimpleNamespace(reasoning_parser="qwen3"))
    with pytest.raises(ValueError, match="Unknown reasoning parser"):
        create_app(engine, SimpleNamespace(reasoning_parser="nope"))


def test_cli_accepts_the_reasoning_parser_flag():
    from server.cli_args import parse_args

    assert parse_args(["serve", "m", "--reasoning-parser", "deepseek_r1"]).reasoning_parser == "deepseek_r1"
    with pytest.raises(SystemExit):
        parse_args(["serve", "m", "--reasoning-parser", "nope"])


# ---- /v1/responses -----------------------------------------------------------------------


def test_responses_create(servers):
    r = oai(servers["answer"]).responses.create(model=MODEL, input="What is the weather?", instructions="Be brief.",
                                                max_output_tokens=16)
    assert r.status == "completed" and [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "Hmm" and r.output_text == "\n\nOK"
    assert r.usage.output_tokens_details.reasoning_tokens == 1 and r.usage.input_tokens > 0


def test_responses_stream_events(servers):
    events = list(oai(servers["answer"]).responses.create(model=MODEL, input="Hi", max_output_tokens=16, stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Hmm"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "\n\nOK"
    assert types.index("response.reasoning_text.done") < types.index("response.output_text.delta")
    final = events[-1].response
    assert final.output_text == "\n\nOK" and final.usage.output_tokens_details.reasoning_tokens == 1


@pytest.mark.parametrize("stream", [False, True])
def test_responses_forced_function_call(servers, stream):
    c = oai(servers["tool"])
    kw = dict(model=MODEL, input="Weather in Paris?", tools=[RESP_TOOL], max_output_tokens=40, temperature=0,
              tool_choice={"type": "function", "name": "get_weather"})
    if stream:
        with c.responses.stream(**kw) as s:
            r = s.get_final_response()
    else:
        r = c.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.output[0].type == "reasoning" and len(calls) == 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Paris"}


def test_responses_auto_tool_call_after_reasoning(servers):
    with oai(servers["tool"]).responses.stream(model=MODEL, input="Weather?", tools=[RESP_TOOL],
                                               max_output_tokens=40) as s:
        r = s.get_final_response()
    assert [o.type for o in r.output] == ["reasoning", "function_call"]
    assert json.loads(r.output[1].arguments) == {"city": "Paris"}


@pytest.mark.parametrize("stream", [False, True])
def test_responses_required_tool_choice(servers, stream):
    """tool_choice "required" on the model that answers in text: the calls' grammar after
    the reasoning makes it call (parallel_tool_calls false: one call; the scripted model
    would not end an open-ended array)."""
    c = oai(servers["answer"])
    kw = dict(model=MODEL, input="Weather in Paris?", tools=[RESP_TOOL], max_output_tokens=200, temperature=0,
              tool_choice="required", parallel_tool_calls=False)
    if stream:
        with c.responses.stream(**kw) as s:
            r = s.get_final_response()
    else:
        r = c.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.output[0].type == "reasoning" and [x.name for x in calls] == ["get_weather"], r.output
    assert json.loads(calls[0].arguments) == {"city": "Paris"}


@pytest.mark.parametrize("stream", [False, True])
def test_responses_text_format_json_schema(servers, stream):
    """text.format json_schema: the grammar applies to the answer after the reasoning."""
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    kw = dict(model=MODEL, input="Hi", max_output_tokens=64, temperature=0,
              text={"format": {"type": "json_schema", "name": "a", "schema": schema, "strict": True}})
    c = oai(servers["answer"])
    if stream:
        with c.responses.stream(**kw) as s:
            r = s.get_final_response()
    else:
        r = c.responses.create(**kw)
    assert r.output[0].type == "reasoning" and r.output[0].content[0].text == "Hmm", r.output
    assert json.loads(r.output_text) in ({"answer": "yes"}, {"answer": "no"}), r.output_text


@pytest.mark.parametrize("field,value", [("store", True), ("previous_response_id", "resp_1"),
                                         ("background", True)])
def test_responses_refuses_stored_state(servers, field, value):
    with pytest.raises(openai.BadRequestError) as ei:
        oai(servers["answer"]).responses.create(model=MODEL, input="Hi", extra_body={field: value})
    assert ei.value.body["param"] == field and "not supported" in ei.value.body["message"]


def test_responses_refusal_names_the_responses_field(servers):
    with pytest.raises(openai.BadRequestError) as ei:
        oai(servers["answer"]).responses.create(model=MODEL, input="Hi", max_output_tokens=0)
    assert ei.value.body["param"] == "max_output_tokens"


# ---- /v1/messages ------------------------------------------------------------------------


def test_messages_create(servers):
    m = anth(servers["answer"]).messages.create(model=MODEL, max_tokens=16, system="Be brief.", messages=ASK,
                                                thinking={"type": "adaptive"})  # budgets: test_thinking_budget
    assert [b.type for b in m.content] == ["thinking", "text"] and m.content[0].thinking == "Hmm"
    assert m.content[1].text == "\n\nOK" and m.stop_reason == "end_turn" and m.usage.output_tokens > 0


def test_messages_stream_forced_tool_use(servers):
    forced = {"type": "tool", "name": "get_weather"}
    with anth(servers["tool"]).messages.stream(model=MODEL, max_tokens=40, messages=ASK, tools=[ANTH_TOOL],
                                               extra_body={"temperature": 0}, tool_choice=forced) as s:
        events = [e.type for e in s]
        m = s.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert [b.type for b in m.content] == ["thinking", "tool_use"] and m.stop_reason == "tool_use"
    assert (m.content[1].name, m.content[1].input) == ("get_weather", {"city": "Paris"})


def test_messages_create_forced_tool_use_and_stream_text(servers):
    forced = {"type": "any", "disable_parallel_tool_use": True}
    m = anth(servers["tool"]).messages.create(model=MODEL, max_tokens=96, messages=ASK, tools=[ANTH_TOOL],
                                              extra_body={"temperature": 0}, tool_choice=forced)
    assert m.stop_reason == "tool_use" and m.content[-1].input == {"city": "Paris"}
    with anth(servers["answer"]).messages.stream(model=MODEL, max_tokens=16, messages=ASK) as s:
        text = "".join(s.text_stream)
        m = s.get_final_message()
    assert text == "\n\nOK" and m.content[0].thinking == "Hmm" and m.stop_reason == "end_turn"


@pytest.mark.parametrize("stream", [False, True])
def test_messages_stop_sequences_and_tool_choice_none(servers, stream):
    """stop_sequences end the answer with stop_reason "stop_sequence" (the sequence named);
    tool_choice none leaves the tool model's call as text, with no tool_use block."""
    def create(srv, **kw):
        c = anth(srv)
        if not stream:
            return c.messages.create(model=MODEL, messages=ASK, extra_body={"temperature": 0}, **kw)
        with c.messages.stream(model=MODEL, messages=ASK, extra_body={"temperature": 0}, **kw) as s:
            return s.get_final_message()
    m = create(servers["answer"], max_tokens=16, stop_sequences=["OK"])
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "OK"), m
    assert [b.type for b in m.content] == ["thinking", "text"] and m.content[1].text == "\n\n"
    m = create(servers["tool"], max_tokens=40, tools=[ANTH_TOOL], tool_choice={"type": "none"})
    assert [b.type for b in m.content] == ["thinking", "text"] and m.stop_reason == "end_turn", m
    assert "<tool_call>" in m.content[1].text


def test_messages_count_tokens(servers, engines):
    c = anth(servers["answer"])
    n = c.messages.count_tokens(model=MODEL, messages=ASK).input_tokens
    m = c.messages.create(model=MODEL, max_tokens=16, messages=ASK)
    assert n == m.usage.input_tokens > 0


def test_messages_errors_have_anthropic_bodies(servers):
    c = anth(servers["answer"])
    with pytest.raises(anthropic.BadRequestError) as ei:
        c.messages.create(model=MODEL, max_tokens=16, messages=ASK, extra_body={"mcp_servers": [{"url": "x"}]})
    assert ei.value.body == {"type": "error", "error": {"type": "invalid_request_error",
                                                        "message": ei.value.body["error"]["message"]}}
    with pytest.raises(anthropic.NotFoundError) as ei:
        c.messages.create(model="claude-nope", max_tokens=16, messages=ASK)
    assert ei.value.body["error"]["type"] == "not_found_error"
    # the engine's "stop must ..." as this API names the field (a probe saw vLLM's name)
    with pytest.raises(anthropic.BadRequestError) as ei:
        c.messages.create(model=MODEL, max_tokens=16, messages=ASK, stop_sequences=["x"] * 65)
    assert ei.value.body["error"]["message"].startswith("stop_sequences must list at most 64 strings")


def test_api_key_as_x_api_key_or_bearer(servers):
    srv = servers["keyed"]
    assert anth(srv, KEY).messages.create(model=MODEL, max_tokens=4, messages=ASK).content  # x-api-key
    assert oai(srv, KEY).responses.create(model=MODEL, input="Hi", max_output_tokens=4).output  # Bearer
    with pytest.raises(anthropic.AuthenticationError) as ei:
        anth(srv, "wrong").messages.create(model=MODEL, max_tokens=4, messages=ASK)
    assert ei.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        oai(srv, "wrong").responses.create(model=MODEL, input="Hi")
