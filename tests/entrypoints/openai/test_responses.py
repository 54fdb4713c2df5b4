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
