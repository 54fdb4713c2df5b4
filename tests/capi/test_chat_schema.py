"""capi.chat: OpenAI chat request -> prompt ids + SamplingParams (the engine's Processor,
no engine)."""
import json

import pytest

from capi.chat import parse_chat_request
from pyengine import EngineArgs, RequestOutputKind, StructuredOutputsParams, VLLMValidationError
from pyengine.engine.processor import Processor


@pytest.fixture(scope="module")
def processor(llama_dir, tokenizer):
    return Processor(EngineArgs(model=str(llama_dir), device="cpu", max_model_len=256,
                                scheduling_policy="priority").create_engine_config(),
                     tokenizer)


def _parse(body, processor):
    return parse_chat_request(json.dumps(body), processor, RequestOutputKind.DELTA)


def test_template_and_params(processor, tokenizer):
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}]
    ids, sp, prio, flags, *_ = _parse({"messages": msgs, "max_completion_tokens": 7, "temperature": 0.5,
                                   "stop": "x", "seed": 3, "priority": -2,
                                   "stream_options": {"include_usage": True}}, processor)
    flat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    text = tokenizer.apply_chat_template(flat, add_generation_prompt=True, tokenize=False)
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert (sp.max_tokens, sp.temperature, sp.stop, sp.seed, sp.output_kind) == (7, 0.5, ["x"], 3, RequestOutputKind.DELTA)
    assert (prio, flags) == (-2, 1)


@pytest.mark.parametrize("body, needle", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "a"}], "response_format": {"type": "xml"}}, "response_format.type"),
    ({"messages": [{"role": "user", "content": "a"}], "response_format": {"type": "json_object"},
      "guided_regex": "a+"}, "Only one structured-output constraint"),
    ({"messages": [{"role": "user", "content": "a"}], "tool_choice": "required",
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
     "tool calling is served over HTTP"),
    # tools with no tool_choice: HTTP's message would name server flags a C host cannot set
    ({"messages": [{"role": "user", "content": "a"}],
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
     "request field 'tools' is not supported by vllm_chat: tool calling is served over HTTP"),
    # the protocol layer's rule first, with HTTP's message
    ({"messages": [{"role": "user", "content": "a"}], "tool_choice": "required"}, "tool_choice 'required' needs tools"),
    ({"messages": [{"role": "user", "content": "a"}], "logprobs": True}, "logprobs"),
    ({"messages": [{"role": "user", "content": "a"}], "n": 2}, "n must be 1"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "content is a string or a list of text parts"),
    ({"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": {"messages": []}}, "messages"),
    ({"messages": [{"role": "user", "content": "a"}], "priority": "high"}, "priority"),
])
def test_refusals(processor, body, needle):
    # ChatRequestError (what only vllm_chat refuses) or the protocol layer's VLLMValidationError
    with pytest.raises(ValueError, match=needle):
        _parse(body, processor)


@pytest.mark.parametrize("raw, message", [
    ('"top_p": 0', "top_p must be a finite number in (0, 1], got 0.0."),
    ('"temperature": NaN', "temperature must be a finite number >= 0, got nan."),
    ('"temperature": Infinity', "temperature must be a finite number >= 0, got inf."),
    ('"seed": 18446744073709551616', "seed must be an integer in [-9223372036854775808, 9223372036854775807]"),
    ('"max_tokens": 1e400', "max_tokens: Input should be a valid integer"),  # the schema's answer, as HTTP's
])
def test_engine_range_errors_pass_unchanged(processor, raw, message):
    # JSON's NaN / Infinity literals and integers past 64 bits: the engine's own message
    body = '{"messages": [{"role": "user", "content": "a"}], ' + raw + "}"
    with pytest.raises(ValueError) as ei:
        parse_chat_request(body, processor, RequestOutputKind.DELTA)
    assert str(ei.value).startswith(message)


@pytest.mark.parametrize("fields, expect", [
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "integer"}}}},
     StructuredOutputsParams(json={"type": "integer"})),
    ({"response_format": {"type": "text"}}, None),
    ({"guided_choice": ["a", "b"]}, StructuredOutputsParams(choice=["a", "b"])),
    ({"structured_outputs": {"regex": "[0-9]+"}}, StructuredOutputsParams(regex="[0-9]+")),
])
def test_structured_output_fields(processor, fields, expect):
    # the HTTP server's fields and rules (pyengine.entrypoints.structured_outputs)
    sp = _parse({"messages": [{"role": "user", "content": "a"}], **fields}, processor).sampling_params
    assert sp.structured_outputs == expect


def test_not_json(processor):
    with pytest.raises(VLLMValidationError, match="Invalid JSON body"):  # HTTP's message
        parse_chat_request("{nope", processor, RequestOutputKind.DELTA)


def test_huge_chat_refused_before_it_is_tokenized(processor, monkeypatch):
    # issue 16 kind 2: the engine's cheap character bound, on the rendered chat
    encoded = []
    encode = processor.encode
    monkeypatch.setattr(processor, "encode", lambda text, *a, **k: encoded.append(len(text)) or encode(text, *a, **k))
    with pytest.raises(VLLMValidationError) as ei:
        _parse({"messages": [{"role": "user", "content": "fox " * (1 << 20)}]}, processor)
    assert ei.value.parameter == "messages" and not encoded
    assert "characters" in str(ei.value) and "256 tokens" in str(ei.value)
    # within the bound: tokenized, then refused for its token count (still naming messages)
    with pytest.raises(VLLMValidationError) as ei:
        _parse({"messages": [{"role": "user", "content": "fox " * 300}]}, processor)
    assert encoded and ei.value.parameter == "messages" and "maximum context length is 256" in str(ei.value)
