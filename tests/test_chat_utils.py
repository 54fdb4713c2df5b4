"""pyengine/chat_utils.py: message parsing, template resolution (no fallback), rendering."""
from __future__ import annotations

import copy

import pytest

from pyengine.chat_utils import apply_hf_chat_template, parse_chat_messages, resolve_chat_template


def test_parse_joins_text_parts_and_keeps_other_keys():
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "u"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]
    before = copy.deepcopy(msgs)
    conv = parse_chat_messages(msgs)
    assert conv == [{"role": "user", "content": "a\nb", "name": "u"},
                    {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]
    assert msgs == before  # the caller's messages are not modified


@pytest.mark.parametrize("bad, match", [
    ([], "non-empty list"), ("hello", "non-empty list"), ([{"role": 1, "content": "x"}], "string 'role'"),
    (["user: hi"], "string 'role'"), ([{"role": "user", "content": 5}], "content must be"),
    ([{"role": "user", "content": [{"type": "text"}]}], "text content parts"),
])
def test_parse_refuses_malformed_messages(bad, match):
    with pytest.raises(ValueError, match=match):
        parse_chat_messages(bad)


class _NoTemplate:
    chat_template = None


def test_no_template_is_refused_not_guessed(tokenizer):
    with pytest.raises(ValueError, match="no chat template"):
        resolve_chat_template(_NoTemplate(), None)
    assert resolve_chat_template(_NoTemplate(), "{{ x }}") == "{{ x }}"
    assert resolve_chat_template(tokenizer, None) == tokenizer.chat_template


def test_apply_renders_with_transformers(tokenizer):
    conv = [{"role": "user", "content": "hi"}]
    assert apply_hf_chat_template(tokenizer, conv) == tokenizer.apply_chat_template(
        conv, tokenize=False, add_generation_prompt=True)
    assert apply_hf_chat_template(tokenizer, conv, add_generation_prompt=False).endswith("hi<|im_end|>\n")
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    got = apply_hf_chat_template(tokenizer, conv, "{{ tools[0]['function']['name'] }}/{{ x }}", tools=tools,
                                 chat_template_kwargs={"x": 7})
    assert got == "get_time/7"


def test_apply_errors_are_value_errors(tokenizer):
    conv = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="cannot both be true"):
        apply_hf_chat_template(tokenizer, conv, continue_final_message=True)
    with pytest.raises(ValueError, match="may not set 'tokenize'"):
        apply_hf_chat_template(tokenizer, conv, chat_template_kwargs={"tokenize": True})
    with pytest.raises(ValueError, match="Cannot apply the chat template"):
        apply_hf_chat_template(tokenizer, conv, "{{ raise_exception('no system role') }}")
    with pytest.raises(ValueError, match="Cannot apply the chat template"):
        apply_hf_chat_template(tokenizer, conv, "{% for m in messages %}")  # not a template
