"""capi.chat: OpenAI chat request -> prompt ids + SamplingParams (no engine needed)."""
import json

import pytest

from capi.chat import ChatRequestError, parse_chat_request
from pyengine import RequestOutputKind, SamplingParams


def _parse(body, tokenizer):
    return parse_chat_request(json.dumps(body), tokenizer, SamplingParams, RequestOutputKind.DELTA)


def test_template_and_params(tokenizer):
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}]
    ids, sp, prio, flags = _parse({"messages": msgs, "max_completion_tokens": 7, "temperature": 0.5,
                                   "stop": "x", "seed": 3, "priority": -2,
                                   "stream_options": {"include_usage": True}}, tokenizer)
    flat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    text = tokenizer.apply_chat_template(flat, add_generation_prompt=True, tokenize=False)
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert (sp.max_tokens, sp.temperature, sp.stop, sp.seed, sp.output_kind) == (7, 0.5, ["x"], 3, RequestOutputKind.DELTA)
    assert (prio, flags) == (-2, 1)


@pytest.mark.parametrize("body, needle", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "a"}], "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "a"}], "logprobs": True}, "logprobs"),
    ({"messages": [{"role": "user", "content": "a"}], "n": 2}, "n must be 1"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "image_url"),
    ({"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": {"messages": []}}, "messages"),
    ({"messages": [{"role": "user", "content": "a"}], "top_p": 0}, "top_p"),
    ({"messages": [{"role": "user", "content": "a"}], "priority": "high"}, "priority"),
])
def test_refusals(tokenizer, body, needle):
    with pytest.raises(ChatRequestError, match=needle):
        _parse(body, tokenizer)


def test_not_json(tokenizer):
    with pytest.raises(ChatRequestError, match="JSON"):
        parse_chat_request("{nope", tokenizer, SamplingParams, RequestOutputKind.DELTA)
