"""The Qwen3-style reasoning fixture (tests/conftest.py: reasoning_dir, reasoning_tool_dir)
through the engine: the scripted outputs token for token (and as transformers gives them),
split by the reasoning parsers, streamed (with text held back by a stop-string check) and
not, and the tool call after ``</think>`` found by the hermes tool parser."""
from __future__ import annotations

import json

import pytest

from pyengine import LLM, EngineArgs, RequestOutputKind, SamplingParams
from pyengine.engine.llm_engine import LLMEngine
from pyengine.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser
from pyengine.tool_parsers import ToolParserManager
from tests.helpers import R1_STYLE_CHAT_TEMPLATE, THINK_END, TOOL_CALL_JSON, hf_greedy


def render(tok, template=None, **kw) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": "What is the weather in Paris?"}],
                                   chat_template=template, tokenize=False, add_generation_prompt=True, **kw)
    return tok.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def prompts(reasoning_tokenizer):
    tok = reasoning_tokenizer
    return {"think": render(tok), "no_think": render(tok, enable_thinking=False),
            "r1": render(tok, R1_STYLE_CHAT_TEMPLATE)}


def _generate(model_dir, prompts):
    llm = LLM(str(model_dir), device="cpu", max_model_len=128)
    try:
        outs = llm.generate(list(prompts.values()), SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    finally:
        llm.shutdown()
    return {k: o.outputs[0] for k, o in zip(prompts, outs)}


def test_reasoning_model_outputs(reasoning_dir, reasoning_tokenizer, prompts):
    tok = reasoning_tokenizer
    outs = _generate(reasoning_dir, prompts)
    assert {k: o.text for k, o in outs.items()} == {"think": "<think>Hmm</think>\n\nOK", "no_think": "OK",
                                                    "r1": "Hmm</think>\n\nOK"}
    assert [o.token_ids for o in outs.values()] == hf_greedy(reasoning_dir, list(prompts.values()), 16)
    assert all(o.finish_reason == "stop" for o in outs.values())

    def split(cls, key, **kw):
        o = outs[key]
        return cls(tok, prompt_token_ids=prompts[key], chat_template_kwargs=kw).extract_reasoning(o.text, o.token_ids)
    assert split(Qwen3ReasoningParser, "think") == ("Hmm", "\n\nOK")
    assert split(Qwen3ReasoningParser, "no_think", enable_thinking=False) == (None, "OK")
    assert split(Qwen3ReasoningParser, "r1") == ("Hmm", "\n\nOK")
    assert split(DeepSeekR1ReasoningParser, "r1") == ("Hmm", "\n\nOK")


def test_tool_call_after_reasoning(reasoning_tool_dir, reasoning_tokenizer, prompts):
    tok = reasoning_tokenizer
    outs = _generate(reasoning_tool_dir, {"think": prompts["think"]})
    o = outs["think"]
    assert o.text == f"<think>Hmm</think>\n\n<tool_call>{TOOL_CALL_JSON}</tool_call>"
    reasoning, content = Qwen3ReasoningParser(tok, prompt_token_ids=prompts["think"]).extract_reasoning(
        o.text, o.token_ids)
    assert reasoning == "Hmm"
    info = ToolParserManager.get_tool_parser("hermes")(tok).extract_tool_calls(content)
    assert info.tools_called and info.content is None
    (call,) = info.tool_calls
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_streamed_with_text_held_back(reasoning_dir, reasoning_tokenizer, prompts):
    # A stop string that "</think>" begins makes the output processor hold the tag's text
    # back (the text that ends the output so far could still start it), so the </think>
    # id comes in a delta of its own with no text, and its text with the next token's; the
    # streamed split equals the whole output's. LLMEngine.step hands over each step's
    # delta as it is (a collector's reader could get two steps merged).
    tok = reasoning_tokenizer
    end_id = tok.convert_tokens_to_ids(THINK_END)
    engine = LLMEngine(EngineArgs(model=str(reasoning_dir), device="cpu", max_model_len=128).create_engine_config())
    try:
        sp = SamplingParams(temperature=0, max_tokens=16, stop=[THINK_END + "!"], output_kind=RequestOutputKind.DELTA)
        engine.add_request("r", prompts["think"], sp)
        deltas = []
        while engine.has_unfinished_requests():
            deltas += [(o.outputs[0].text, list(o.outputs[0].token_ids)) for o in engine.step()]
    finally:
        engine.shutdown()
    assert "".join(t for t, _ in deltas) == "<think>Hmm</think>\n\nOK"
    assert ("", [end_id]) in deltas, deltas  # the check held the tag's text back
    p = Qwen3ReasoningParser(tok, prompt_token_ids=prompts["think"])
    got = [p.extract_reasoning_streaming(text, ids) for text, ids in deltas] + [p.finish_streaming()]
    assert "".join(m.reasoning_content or "" for m in got if m) == "Hmm"
    assert "".join(m.content or "" for m in got if m) == "\n\nOK"
    assert p.reasoning_ended and p.num_reasoning_tokens == 1
