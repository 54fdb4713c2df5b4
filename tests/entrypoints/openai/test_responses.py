"""The protocol layer's response objects (pyengine/entrypoints/openai): what the HTTP server
and the C ABI's chat send validates against the ``openai`` package's own types."""
from __future__ import annotations

import json
import math

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from pyengine.entrypoints.openai.errors import RequestFailed
from pyengine.entrypoints.openai.serving_chat import ChatResponseBuilder
from pyengine.entrypoints.openai.serving_completion import CompletionResponseBuilder
from pyengine.entrypoints.openai.serving_engine import ChoiceState, DeltaDriver, LogprobsFormatter, chunk_json
from pyengine.entrypoints.tool_calls import ToolCallExtractor, resolve_tool_choice
from pyengine.outputs import CompletionOutput, Logprob, RequestOutput


def _delta(text: str, token: int, finish=None) -> RequestOutput:
    return RequestOutput("r", None, [1] * 7, [CompletionOutput(0, text, [token], finish_reason=finish)],
                         finish is not None)


def _chat_driver(response_id: str, prompt_tokens: int, **kw) -> DeltaDriver:
    builder = ChatResponseBuilder(response_id, "m", 5, None, [ToolCallExtractor(resolve_tool_choice([], None), None)])
    return DeltaDriver(builder, 1, 1, prompt_tokens, **kw)


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_stream_chunks(include_usage):
    d = _chat_driver("chatcmpl-1", 7, include_usage=include_usage)
    out = d.first_chunks() + d.feed(0, _delta("Hel", 5)) + d.feed(0, _delta("lo", 6)) + d.feed(
        0, _delta("", 7, "length")) + d.last_chunks()
    out = [json.loads(chunk_json(c)) for c in out]
    for chunk in out:
        ChatCompletionChunk.model_validate(chunk)
    assert out[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in out if c["choices"]) == "Hello"
    assert [c["choices"][0]["finish_reason"] for c in out if c["choices"]][-1] == "length"
    assert {c["id"] for c in out} == {"chatcmpl-1"} and {c["created"] for c in out} == {5}
    if include_usage:
        assert out[-1]["choices"] == [] and out[-1]["usage"] == {"prompt_tokens": 7, "completion_tokens": 3,
                                                                 "total_tokens": 10}
    else:
        assert all("usage" not in c for c in out)


def test_chat_stream_response():
    d = _chat_driver("chatcmpl-2", 4)
    d.accumulate(0, _delta("a", 5))
    d.accumulate(0, _delta("b", 6, "stop"))
    resp = d.response()
    ChatCompletion.model_validate(resp)
    assert resp["choices"][0]["message"] == {"role": "assistant", "content": "ab"}
    assert resp["usage"]["completion_tokens"] == 2 and resp["choices"][0]["finish_reason"] == "stop"


def test_a_failed_output_raises():
    d = _chat_driver("chatcmpl-3", 4)
    failed = RequestOutput("r", None, [1], [CompletionOutput(0, "", [], finish_reason="error", error="boom")], True)
    with pytest.raises(RequestFailed, match="boom"):
        d.feed(0, failed)


def test_chat_logprobs_and_completion_objects(tokenizer):
    ids = tokenizer("hello world", add_special_tokens=False)["input_ids"][:2]
    lps = [{t: Logprob(-0.5, 1), t + 1: Logprob(-math.inf, 2)} for t in ids]
    fmt = LogprobsFormatter(tokenizer, 2)
    chat = ChatResponseBuilder("chatcmpl-3", "m", 1, fmt, [ToolCallExtractor(resolve_tool_choice([], None), None)])
    ch = ChoiceState()
    ch.text.append("hi")
    ch.finish_reason = "length"
    resp = chat.response([chat.choice(0, ch, ids, lps)], 3, 2)
    ChatCompletion.model_validate(resp)
    top = resp["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    assert [t["logprob"] for t in top] == [-0.5, -9999.0]  # JSON has no -inf
    for chunk in chat.delta_chunks(0, ChoiceState(), "hi", ids, lps, "length"):
        ChatCompletionChunk.model_validate(chunk)

    comp = CompletionResponseBuilder("cmpl-1", "m", 1, fmt, echo_lens=[3])
    ch = ChoiceState(offset=3)
    ch.text.append("ab hi")
    ch.finish_reason = "stop"
    resp = comp.response([comp.choice(0, ch, ids, lps)], 3, 2)
    Completion.model_validate(resp)
    assert resp["choices"][0]["logprobs"]["text_offset"][0] == 3  # after the echoed prompt
    # openai's Completion has no null finish_reason (its stream parser does not validate):
    # the last chunk validates
    (chunk,) = comp.delta_chunks(0, ChoiceState(), "x", ids, lps, "length")
    Completion.model_validate(chunk)


TEMPLATE_TEXTS = ["", "Hello", " world", 'quote " and \\ backslash', "line\nbreak\ttab", "caf\u00e9 \u65e5\u672c \U0001f600",
                  "\x00\x1f control", "</script>", "\u2028\u2029"]


def _chat_builder(n: int, mode):
    return ChatResponseBuilder("chatcmpl-9", "the-model", 123, None, [ToolCallExtractor(mode) for _ in range(n)])


@pytest.mark.parametrize("make", [
    lambda: CompletionResponseBuilder("cmpl-9", "the-model", 123, None),
    lambda: _chat_builder(3, resolve_tool_choice([], None)),
])
def test_text_delta_template_is_the_chunks_json(make):
    """The server's streamed common case (a text delta, no logprobs, no finish) is sent
    as the template around the text's JSON: byte for byte what json.dumps of the
    builder's own chunk gives, for any text and choice index."""
    import json
    from json.encoder import encode_basestring_ascii

    builder = make()
    for idx in range(3):
        head, tail = builder.text_delta_template(idx)
        for text in TEMPLATE_TEXTS:
            (chunk,) = builder.delta_chunks(idx, ChoiceState(), text, [1, 2], None, None)
            assert head + encode_basestring_ascii(text) + tail == json.dumps(chunk, separators=(",", ":"))


def test_text_delta_template_only_where_the_chunk_is_the_text_alone(tokenizer):
    fmt = LogprobsFormatter(tokenizer, 1)
    assert CompletionResponseBuilder("cmpl-9", "m", 1, fmt).text_delta_template(0) is None
    assert _chat_builder(1, resolve_tool_choice([], None)).text_delta_template(0) is not None
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert _chat_builder(1, resolve_tool_choice(tools, "required")).text_delta_template(0) is None
    named = resolve_tool_choice(tools, {"type": "function", "function": {"name": "f"}})
    assert _chat_builder(1, named).text_delta_template(0) is None
    chat = ChatResponseBuilder("c", "m", 1, LogprobsFormatter(tokenizer, 0),
                               [ToolCallExtractor(resolve_tool_choice([], None))])
    assert chat.text_delta_template(0) is None


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_inside_the_reasoning_stays_reasoning(reasoning_tokenizer, stream):
    """Issue 28: with a reasoning parser, tool calls are parsed from the content only. A
    hermes call written inside <think>…</think> is reasoning text, not a call; the content
    after </think> goes to the tool parser (a call there is one, tests/server/test_agent_apis)."""
    from pyengine.entrypoints.openai.serving_chat import make_extractor
    from pyengine.entrypoints.reasoning import RequestReasoning
    from pyengine.reasoning import Qwen3ReasoningParser
    from tests.helpers import THINK_END, THINK_START, TOOL_CALL_END, TOOL_CALL_JSON, TOOL_CALL_START

    tok = reasoning_tokenizer
    call = TOOL_CALL_START + TOOL_CALL_JSON + TOOL_CALL_END
    pieces = [THINK_START, TOOL_CALL_START, TOOL_CALL_JSON, TOOL_CALL_END, THINK_END, "\n\n", "OK"]
    ids = [tok.convert_tokens_to_ids(p) if p in (THINK_START, THINK_END, TOOL_CALL_START, TOOL_CALL_END)
           else tok.encode(p, add_special_tokens=False)[0] for p in pieces]
    assert [tok.decode([t]) for t in ids] == pieces
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                add_generation_prompt=True), add_special_tokens=False)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    mode = resolve_tool_choice(tools, "auto", auto_tool_choice=True)
    builder = ChatResponseBuilder("chatcmpl-r", "m", 5, None, [make_extractor(mode, "hermes", tok)],
                                  reasoning=RequestReasoning(Qwen3ReasoningParser, tok, None, prompt))
    d = DeltaDriver(builder, 1, 1, len(prompt))
    deltas = [RequestOutput("r", None, prompt, [CompletionOutput(0, p, [t], finish_reason="stop" if last else None)],
                            last) for i, (p, t) in enumerate(zip(pieces, ids)) for last in [i == len(ids) - 1]]
    if stream:
        chunks = [json.loads(chunk_json(c)) for c in
                  d.first_chunks() + [c for o in deltas for c in d.feed(0, o)] + d.last_chunks()]
        for c in chunks:
            ChatCompletionChunk.model_validate(c)
        got = [c["choices"][0] for c in chunks if c["choices"]]
        reasoning = "".join(g["delta"].get("reasoning_content") or "" for g in got)
        content = "".join(g["delta"].get("content") or "" for g in got)
        calls = [t for g in got for t in g["delta"].get("tool_calls") or []]
        finish = got[-1]["finish_reason"]
    else:
        for o in deltas:
            d.accumulate(0, o)
        resp = d.response()
        ChatCompletion.model_validate(resp)
        msg, finish = resp["choices"][0]["message"], resp["choices"][0]["finish_reason"]
        reasoning, content, calls = msg["reasoning_content"], msg["content"], msg.get("tool_calls") or []
    assert (reasoning, content, calls, finish) == (call, "\n\nOK", [], "stop")
