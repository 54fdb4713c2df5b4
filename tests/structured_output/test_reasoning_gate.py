"""Reasoner-aware structured outputs in the engine (``StructuredOutputsParams.reasoning_*``):
the reasoning is not constrained, the grammar starts after the end token, and an
undecided start (Qwen3's optional ``<think>``) constrains the first token with the start
token allowed besides. On the scripted Qwen3-style reasoning model, greedy."""
from __future__ import annotations

import pytest
import torch

from pyengine import LLM, SamplingParams, StructuredOutputsParams
from pyengine.exceptions import VLLMValidationError
from pyengine.structured_output import allow_token

ASK = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def llm(reasoning_dir):
    eng = LLM(str(reasoning_dir), device="cpu", max_model_len=256)
    yield eng
    eng.shutdown()


def _run(llm, tok, choice, thinking=True, **gate):
    prompt = tok.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True, enable_thinking=thinking)
    ids = tok.encode(prompt, add_special_tokens=False)
    sp = SamplingParams(temperature=0, max_tokens=12, skip_special_tokens=True,
                        structured_outputs=StructuredOutputsParams(choice=choice, **gate))
    return llm.generate([ids], sp, use_tqdm=False)[0].outputs[0].text


def test_reasoning_is_free_and_the_grammar_follows_the_end_token(llm, reasoning_tokenizer):
    tok = reasoning_tokenizer
    start, end = tok.convert_tokens_to_ids(["<think>", "</think>"])
    # no gate: the grammar applies from the first token, so the model cannot think
    assert _run(llm, tok, ["yes", "no"]) in ("yes", "no")
    # the gate with an undecided start: <think> allowed first, then free until </think>
    out = _run(llm, tok, ["yes", "no"], reasoning_end_token_id=end, reasoning_start_token_id=start)
    assert out in ("<think>Hmm</think>yes", "<think>Hmm</think>no")
    # reasoning from the first token (the template opened it): the model's own <think> is reasoning too
    assert _run(llm, tok, ["yes", "no"], reasoning_end_token_id=end).startswith("<think>Hmm</think>")


def test_an_undecided_start_constrains_a_first_token_that_is_not_the_start_tag(llm, reasoning_tokenizer):
    tok = reasoning_tokenizer
    start, end = tok.convert_tokens_to_ids(["<think>", "</think>"])
    # enable_thinking=false: the script answers "OK" at once, which the choice forbids
    gate = dict(reasoning_end_token_id=end, reasoning_start_token_id=start)
    assert _run(llm, tok, ["yes", "no"], thinking=False, **gate) in ("yes", "no")
    assert _run(llm, tok, ["OK", "KO"], thinking=False, **gate) == "OK"


def test_gate_fields_are_checked():
    with pytest.raises(VLLMValidationError, match="needs reasoning_end_token_id"):
        StructuredOutputsParams(choice=["a"], reasoning_start_token_id=3)
    with pytest.raises(VLLMValidationError, match="token id"):
        StructuredOutputsParams(choice=["a"], reasoning_end_token_id=-1)


def test_gate_token_outside_the_vocabulary_is_refused(llm):
    sp = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a"], reasoning_end_token_id=10 ** 6))
    with pytest.raises(VLLMValidationError, match="not in the vocabulary"):
        llm.generate(["Hi"], sp, use_tqdm=False)


def test_allow_token_sets_one_bit_including_the_sign_bit():
    bm = torch.zeros(2, 3, dtype=torch.int32)
    for t in (0, 31, 33, 95):
        allow_token(bm, 1, t)
    words = bm[1].tolist()
    assert bm[0].tolist() == [0, 0, 0]
    assert [w & 0xFFFFFFFF for w in words] == [(1 << 0) | (1 << 31), 1 << 1, 1 << 31]
