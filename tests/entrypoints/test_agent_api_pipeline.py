"""The pieces of issue 28 put together the way an endpoint would (no HTTP): a Responses or
Messages request -> its chat request -> ``serving_chat.chat_inputs`` (the chat endpoint's own
rules and template) -> the engine (the scripted Qwen3-style reasoning models) -> the
reasoning parser -> the tool-call extractor (hermes) on the content only -> the Responses /
Messages object, and, token by token, the event stream read back by the SDK."""
from __future__ import annotations

import anthropic
import openai
import pytest

from pyengine import LLM, RequestOutputKind
from pyengine.entrypoints.anthropic.messages_utils import MessagesStreamState, chat_to_message, messages_to_chat_request
from pyengine.entrypoints.anthropic.messages_utils import sse as anthropic_sse
from pyengine.entrypoints.anthropic.protocol import MessagesRequest, check_messages_request
from pyengine.entrypoints.openai.protocol import ChatCompletionRequest
from pyengine.entrypoints.openai.protocol_responses import ResponsesRequest, check_responses_request
from pyengine.entrypoints.openai.responses_utils import ResponsesStreamState, chat_to_response, responses_to_chat_request
from pyengine.entrypoints.openai.responses_utils import sse as responses_sse
from pyengine.entrypoints.openai.serving_chat import chat_inputs, make_extractor
from pyengine.reasoning import ReasoningParserManager
from tests.entrypoints.sdk_helpers import Recorder, sse_reply

FN = {"type": "function", "name": "get_weather",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
TOOL = {"name": "get_weather", "input_schema": FN["parameters"]}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def engines(reasoning_dir, reasoning_tool_dir):
    llms = {"answer": LLM(str(reasoning_dir), device="cpu", max_model_len=512),
            "tool": LLM(str(reasoning_tool_dir), device="cpu", max_model_len=512)}
    yield llms
    for llm in llms.values():
        llm.shutdown()


def run(llm, chat_body: dict):
    """What an endpoint does with the chat request: (chat.completion dict, chat-style deltas
    one token at a time, output)."""
    creq = ChatCompletionRequest.model_validate(chat_body)
    processor = llm.llm_engine.processor
    tok = processor.tokenizer
    inputs = chat_inputs(processor, creq, tool_call_parser="hermes", enable_auto_tool_choice=True,
                         output_kind=RequestOutputKind.FINAL_ONLY, stream=False)
    out = llm.generate([inputs.prompt_token_ids], inputs.sampling_params, use_tqdm=False)[0].outputs[0]
    make_parser = ReasoningParserManager.get_reasoning_parser("qwen3")
    kw = dict(chat_template_kwargs=creq.chat_template_kwargs, prompt_token_ids=inputs.prompt_token_ids)
    # whole output: reasoning first, tool calls from the content only
    reasoning, content = make_parser(tok, **kw).extract_reasoning(out.text, out.token_ids)
    ext = make_extractor(inputs.tool_mode, "hermes", tok)
    msg = dict(ext.message(content or ""), reasoning_content=reasoning)
    completion = {"model": "m", "choices": [{"index": 0, "message": msg, "finish_reason": ext.finish_reason(
        out.finish_reason), "stop_reason": out.stop_reason}],
        "usage": {"prompt_tokens": len(inputs.prompt_token_ids), "completion_tokens": len(out.token_ids)}}
    # the same, streamed a token at a time
    parser, ext = make_parser(tok, **kw), make_extractor(inputs.tool_mode, "hermes", tok)
    deltas = []
    for m in [parser.extract_reasoning_streaming(tok.decode([t], skip_special_tokens=True), [t])
              for t in out.token_ids] + [parser.finish_streaming()]:
        if m is not None and m.reasoning_content:
            deltas.append({"reasoning_content": m.reasoning_content})
        if m is not None and m.content:
            deltas += ext.stream(m.content)
    deltas += ext.finish()
    return completion, deltas, dict(out=out, finish_reason=ext.finish_reason(out.finish_reason),
                                    reasoning_tokens=parser.num_reasoning_tokens)


@pytest.mark.parametrize("model", ["answer", "tool"])
def test_responses(engines, model):
    body = {"model": "m", "input": ASK, "instructions": "Be brief.", "max_output_tokens": 32}
    if model == "tool":
        body["tools"] = [FN]
    req = ResponsesRequest.model_validate(body)
    check_responses_request(req)
    completion, deltas, info = run(engines[model], responses_to_chat_request(req))
    whole = openai.types.responses.Response.model_validate(chat_to_response(req, completion, reasoning_tokens=1))
    st = ResponsesStreamState(req, "m", completion["usage"]["prompt_tokens"])
    events = st.start()
    for d in deltas:
        events += st.chat_delta(d)
    events += st.finish(info["finish_reason"], len(info["out"].token_ids), reasoning_tokens=info["reasoning_tokens"])
    rec = Recorder(lambda b: sse_reply([responses_sse(e) for e in events]))
    client = openai.OpenAI(api_key="k", base_url="http://test/v1", http_client=rec.http_client())
    with client.responses.stream(model="m", input=ASK) as s:
        streamed = s.get_final_response()
    for r in (whole, streamed):
        assert r.output[0].type == "reasoning" and r.output[0].content[0].text == "Hmm"
        assert r.usage.output_tokens_details.reasoning_tokens == 1
        if model == "answer":
            assert [o.type for o in r.output] == ["reasoning", "message"] and r.output_text == "\n\nOK"
        else:
            assert [o.type for o in r.output] == ["reasoning", "function_call"]
            assert r.output[1].name == "get_weather" and r.output[1].arguments == '{"city": "Paris"}'


@pytest.mark.parametrize("model", ["answer", "tool"])
def test_messages(engines, model):
    body = {"model": "m", "max_tokens": 32, "system": "Be brief.", "messages": [{"role": "user", "content": ASK}],
            "thinking": {"type": "adaptive"}}  # a budget needs a reasoning parser in chat_inputs
    if model == "tool":
        body["tools"] = [TOOL]
    req = MessagesRequest.model_validate(body)
    check_messages_request(req)
    completion, deltas, info = run(engines[model], messages_to_chat_request(req))
    whole = anthropic.types.Message.model_validate(chat_to_message(req, completion))
    st = MessagesStreamState(req, "m", completion["usage"]["prompt_tokens"])
    events = st.start()
    for d in deltas:
        events += st.chat_delta(d)
    events += st.finish(info["finish_reason"], len(info["out"].token_ids), info["out"].stop_reason)
    rec = Recorder(lambda b: sse_reply([anthropic_sse(e) for e in events]))
    client = anthropic.Anthropic(api_key="k", base_url="http://test", http_client=rec.http_client(anthropic))
    with client.messages.stream(model="m", max_tokens=32, messages=[{"role": "user", "content": ASK}]) as s:
        streamed = s.get_final_message()
    for m in (whole, streamed):
        assert m.content[0].type == "thinking" and m.content[0].thinking == "Hmm"
        if model == "answer":
            assert [b.type for b in m.content] == ["thinking", "text"] and m.content[1].text == "\n\nOK"
            assert m.stop_reason == "end_turn"
        else:
            assert [b.type for b in m.content] == ["thinking", "tool_use"] and m.stop_reason == "tool_use"
            assert (m.content[1].name, m.content[1].input) == ("get_weather", {"city": "Paris"})
