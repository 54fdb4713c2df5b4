"""Every request field vLLM's OpenAI protocol defines is declared, and either honoured or
refused with a 400 naming it (issue 23 item 2): the protocol layer
(pyengine/entrypoints/openai/protocol.py, serving_engine.py, serving_completion.py,
serving_chat.py), through the engine's Processor, with no engine."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from pyengine import EngineArgs, VLLMValidationError
from pyengine.engine.processor import Processor
from pyengine.entrypoints.openai.protocol import UNSUPPORTED_FIELDS, ChatCompletionRequest, CompletionRequest
from pyengine.entrypoints.openai.serving_chat import chat_echo, chat_inputs
from pyengine.entrypoints.openai.serving_completion import completion_inputs
from pyengine.entrypoints.openai.serving_engine import parse_request

# The request fields of vLLM's CompletionRequest and ChatCompletionRequest
# (vllm/entrypoints/openai/protocol.py; since split into completion/ and chat_completion/),
# older ones (best_of, guided_*, structural_tag) included.
VLLM_COMMON = ["model", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n", "presence_penalty",
               "seed", "stop", "stream", "stream_options", "temperature", "top_p", "user", "use_beam_search",
               "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
               "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
               "spaces_between_special_tokens", "truncate_prompt_tokens", "allowed_token_ids", "prompt_logprobs",
               "add_special_tokens", "response_format", "structured_outputs", "guided_json", "guided_regex",
               "guided_choice", "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern",
               "priority", "request_id", "logits_processors", "return_tokens_as_token_ids", "return_token_ids",
               "cache_salt", "kv_transfer_params", "vllm_xargs", "max_repetition_pattern_size",
               "min_repetition_pattern_size", "repetition_min_count"]
VLLM_COMPLETION = VLLM_COMMON + ["prompt", "prompt_embeds", "best_of", "echo", "suffix"]
VLLM_CHAT = VLLM_COMMON + ["messages", "top_logprobs", "max_completion_tokens", "tools", "tool_choice",
                           "reasoning_effort", "include_reasoning", "parallel_tool_calls", "best_of", "bad_words",
                           "echo", "add_generation_prompt", "continue_final_message", "documents", "chat_template",
                           "chat_template_kwargs", "mm_processor_kwargs", "structural_tag"]

# a value that asks for something, per field vengine refuses
ASKING = {"use_beam_search": True, "length_penalty": 0.5, "spaces_between_special_tokens": False,
          "prompt_logprobs": 1, "logits_processors": ["m.f"],
          "kv_transfer_params": {"a": 1}, "vllm_xargs": {"k": 1}, "max_repetition_pattern_size": 4,
          "min_repetition_pattern_size": 2, "repetition_min_count": 3, "prompt_embeds": "AAAA",
          "chat_template": "{{ messages }}", "mm_processor_kwargs": {"x": 1}, "structural_tag": "{}"}
# the values that ask for nothing (vLLM's defaults), accepted
UNUSED = {"use_beam_search": False, "length_penalty": 1.0, "spaces_between_special_tokens": True,
          "logits_processors": [], "kv_transfer_params": {}, "vllm_xargs": {},
          "max_repetition_pattern_size": 0, "min_repetition_pattern_size": 0, "repetition_min_count": 0,
          "mm_processor_kwargs": {}}

MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def processor(llama_dir, tokenizer):
    return Processor(EngineArgs(model=str(llama_dir), device="cpu", max_model_len=128).create_engine_config(),
                     tokenizer)


def _completion(processor, **body):
    return completion_inputs(processor, parse_request(CompletionRequest, _json({"prompt": "def f(x):", **body})))


def _chat(processor, **body):
    return chat_inputs(processor, parse_request(ChatCompletionRequest, _json({"messages": MSGS, **body})))


def _json(body) -> str:
    import json
    return json.dumps(body)


@pytest.mark.parametrize("schema, names", [(CompletionRequest, VLLM_COMPLETION), (ChatCompletionRequest, VLLM_CHAT)])
def test_every_vllm_field_is_declared(schema, names):
    """Declared, so never logged as unknown and dropped: each is honoured or refused."""
    missing = sorted(set(names) - set(schema.model_fields))
    assert not missing, missing
    assert set(ASKING) == set(UNSUPPORTED_FIELDS)


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_FIELDS))
def test_unsupported_fields_refused_naming_the_field(processor, name):
    ran = 0
    for make, schema in ((_completion, CompletionRequest), (_chat, ChatCompletionRequest)):
        if name not in schema.model_fields:
            continue
        ran += 1
        with pytest.raises(VLLMValidationError) as ei:
            make(processor, **{name: ASKING[name]})
        assert ei.value.parameter == name and f"{name} is not supported" in str(ei.value)
        if name in UNUSED:
            make(processor, **{name: UNUSED[name]})  # the default asks for nothing
    assert ran


def test_max_completion_tokens_refused_on_completions(processor):
    with pytest.raises(VLLMValidationError) as ei:
        _completion(processor, max_completion_tokens=40)
    assert ei.value.parameter == "max_completion_tokens" and "takes max_tokens" in str(ei.value)
    assert _chat(processor, max_completion_tokens=40).sampling_params.max_tokens == 40


@pytest.mark.parametrize("make", [_completion, _chat])
def test_sampling_fields_reach_the_sampling_params(processor, make, tokenizer):
    sp = make(processor, bad_words=["self"], allowed_token_ids=[5, 9], truncate_prompt_tokens=3).sampling_params
    assert (sp.bad_words, sp.allowed_token_ids, sp.truncate_prompt_tokens) == (["self"], [5, 9], 3)
    with pytest.raises(VLLMValidationError, match="allowed_token_ids") as ei:
        make(processor, allowed_token_ids=[])
    assert ei.value.parameter == "allowed_token_ids"
    assert make(processor, cache_salt="tenant-1").cache_salt == "tenant-1"
    with pytest.raises(VLLMValidationError, match="cache_salt must be a non-empty string") as ei:
        make(processor, cache_salt="")
    assert ei.value.parameter == "cache_salt"


def test_truncate_prompt_tokens_cuts_the_prompt_on_the_left(processor, tokenizer):
    long = list(range(20, 220))  # 200 tokens: more than max_model_len (128)
    got = _completion(processor, prompt=long, truncate_prompt_tokens=10, max_tokens=4)
    assert got.prompts == [(None, long[-10:])]
    text = "def main(): return self.value " * 30
    (t, ids), = _completion(processor, prompt=text, truncate_prompt_tokens=-1, max_tokens=8).prompts
    assert t is None and ids == tokenizer.encode(text)[-120:]  # as many as fit next to max_tokens
    (t, ids), = _completion(processor, prompt="x = 1", truncate_prompt_tokens=50).prompts
    assert t == "x = 1"  # shorter than the limit: unchanged, text kept
    with pytest.raises(VLLMValidationError) as ei:
        _completion(processor, prompt=long, truncate_prompt_tokens=200, max_tokens=4)
    assert ei.value.parameter == "truncate_prompt_tokens"
    chat = _chat(processor, messages=[{"role": "user", "content": text}], truncate_prompt_tokens=16)
    full = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=False)
    assert chat.prompt_token_ids == tokenizer.encode(full, add_special_tokens=False)[-16:]


def test_add_special_tokens(llama_dir, tokenizer):
    """Completions add the tokenizer's special tokens unless told not to; chat adds none
    unless told to (vLLM's defaults). The test tokenizer adds none: give it a BOS."""
    import copy

    from tokenizers import processors

    tok = copy.deepcopy(tokenizer)
    bos = tok.convert_tokens_to_ids("<s>")
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    proc = Processor(EngineArgs(model=str(llama_dir), device="cpu", max_model_len=128).create_engine_config(), tok)
    plain = tok.encode("def f(x):", add_special_tokens=False)
    assert _completion(proc).prompts[0][1] == [bos] + plain
    assert _completion(proc, add_special_tokens=False).prompts[0][1] == plain
    assert _chat(proc).prompt_token_ids[0] != bos
    assert _chat(proc, add_special_tokens=True).prompt_token_ids[0] == bos


def test_documents_and_reasoning_effort_reach_the_template(processor, tokenizer):
    template = ("{% for d in documents %}[{{ d.title }}]{% endfor %}<{{ reasoning_effort }}>"
                "{% for m in messages %}{{ m.content }}{% endfor %}")
    req = parse_request(ChatCompletionRequest, _json({
        "messages": MSGS, "documents": [{"title": "A", "text": "a"}, {"title": "B", "text": "b"}],
        "reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}}))
    got = chat_inputs(processor, req, chat_template=template)
    assert got.text == "[A][B]<low>hi"  # the request's own field over chat_template_kwargs, as vLLM


@pytest.mark.parametrize("body, echo", [
    ({"messages": MSGS + [{"role": "assistant", "content": "Once upon"}], "continue_final_message": True,
      "add_generation_prompt": False}, "Once upon"),
    ({"messages": MSGS + [{"role": "assistant", "content": "Once upon"}], "continue_final_message": True}, "Once upon"),
    ({"messages": MSGS + [{"role": "assistant", "content": "Once upon"}]}, "Once upon"),  # same role: vLLM echoes
    ({"messages": MSGS}, None),  # the final message is the user's: not the response's role
    ({"messages": MSGS, "add_generation_prompt": False}, "hi"),  # no generation prompt: its own role
])
def test_chat_echo_text(body, echo):
    assert chat_echo(parse_request(ChatCompletionRequest, _json(dict(body, echo=True)))) == echo
    assert chat_echo(parse_request(ChatCompletionRequest, _json(body))) is None


@pytest.mark.parametrize("body, words", [
    ({"max_completion_tokens": -1}, "max_completion_tokens must be"),
    ({"max_completion_tokens": 3, "min_tokens": 5}, "max_completion_tokens=3"),  # min_tokens names it too
    ({"max_completion_tokens": 500}, "or max_completion_tokens."),  # past max_model_len: the engine request's rule
])
def test_chat_refusal_names_max_completion_tokens(processor, body, words):
    from pyengine.entrypoints.openai.serving_chat import OpenAIServingChat

    with pytest.raises(VLLMValidationError) as ei:
        inputs = _chat(processor, **body)
        OpenAIServingChat.engine_request(SimpleNamespace(processor=processor), inputs, "r")
    assert words in str(ei.value) and "max_tokens" not in str(ei.value), str(ei.value)
    assert ei.value.parameter == ("min_tokens" if "min_tokens" in body else "max_completion_tokens")
    with pytest.raises(VLLMValidationError) as ei:  # max_tokens given: named as it is
        _chat(processor, max_tokens=-1)
    assert ei.value.parameter == "max_tokens" and str(ei.value).startswith("max_tokens must be")


def test_renamed_validation_error():
    names = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens", "messages": "input",
             "a_b": "c_d", "c_d": "e_f"}
    e = VLLMValidationError("max_tokens must be at most 5 (max_tokens=9); the messages, x.max_tokens and "
                            "max_tokens_2 are kept; a_b -> c_d, once.", parameter="max_tokens", value=-1)
    r = e.renamed(names)
    # identifiers only (no word of a sentence), whole words not after a ".", in one pass
    assert (str(r), r.parameter, r.value) == (
        "max_output_tokens must be at most 5 (max_output_tokens=9); the messages, x.max_tokens and "
        "max_tokens_2 are kept; c_d -> e_f, once.", "max_output_tokens", -1)
    assert VLLMValidationError("m", parameter="messages.0.content").renamed(names).parameter == "input.0.content"
    assert e.renamed({}) is e and e.renamed({"temperature": "temp"}) is e
    # a field that is a word ("stop") only where the message opens with it, as its parameter
    stop = VLLMValidationError("stop must list at most 64 strings; stop words stay.", parameter="stop")
    assert str(stop.renamed({"stop": "stop_sequences"})) == "stop_sequences must list at most 64 strings; stop words stay."
    assert str(VLLMValidationError("stop here", parameter="seed").renamed({"stop": "x_y"})) == "stop here"
