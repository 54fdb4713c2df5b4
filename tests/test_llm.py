"""End-to-end tests of pyengine.LLM against transformers' own greedy generation."""
from __future__ import annotations

import pytest
import torch

from pyengine import LLM, FinishReason, SamplingParams
from tests.helpers import banned_at, expected_text, find_bad_word, hf_greedy, hf_logits, prompt_token_ids

MAX_TOKENS = 24
FAMILIES = ["llama", "qwen2", "qwen3"]
# Engine configurations that must not change greedy output.
CONFIGS = {
    "default": {},
    "no_prefix_caching": {"enable_prefix_caching": False},
    "chunked_prefill": {"max_num_batched_tokens": 16},
    "preemption": {"num_gpu_blocks_override": 8, "max_model_len": 128, "max_num_batched_tokens": 64},
    "sync_scheduling": {"async_scheduling": False},
    "long_prefill_threshold": {"long_prefill_token_threshold": 7},
}


@pytest.fixture(scope="module")
def prompts(tokenizer):
    base = prompt_token_ids(tokenizer, 8, min_len=4, max_len=40, seed=0)
    shared = base[0][:4] + prompt_token_ids(tokenizer, 1, 36, 36, seed=1)[0]  # 40-token shared prefix
    # Three prompts share a 40-token prefix so prefix caching has something to hit.
    return base[:5] + [shared + p[:6] for p in base[5:8]]


@pytest.fixture(scope="module")
def references(model_dirs, prompts):
    return {fam: hf_greedy(model_dirs[fam], prompts, MAX_TOKENS) for fam in FAMILIES}


def _assert_no_leak(llm: LLM) -> None:
    stats = llm.llm_engine.get_stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_gpu_blocks, "KV blocks leaked"


def _run_greedy(model_dir, prompts, device, **kwargs):
    llm = LLM(str(model_dir), device=device, **kwargs)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers(family, config, model_dirs, prompts, references):
    llm, got = _run_greedy(model_dirs[family], prompts, "cpu", **CONFIGS[config])
    assert got == references[family]
    stats = llm.llm_engine.get_stats()
    if config == "preemption":
        assert stats.num_preemptions > 0
    if config == "no_prefix_caching":
        assert stats.prefix_cache_hits == 0
    elif config == "default":
        # The three prompts sharing a 40-token prefix hit at least 2 blocks each after the first.
        assert stats.prefix_cache_hits >= 2 * 32
    _assert_no_leak(llm)


@pytest.mark.gpu
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers_gpu(family, config, model_dirs, prompts, references):
    # max_num_seqs=16: few CUDA graphs to capture per engine, so the suite stays quick.
    llm, got = _run_greedy(model_dirs[family], prompts, "cuda", dtype="float32", max_num_seqs=16, **CONFIGS[config])
    try:
        assert got == references[family]
        _assert_no_leak(llm)
    finally:
        llm.shutdown()  # the next case sizes its KV cache from free GPU memory


def test_outputs_text_and_finish_reasons(llama_dir, tokenizer, prompts, references):
    llm = LLM(str(llama_dir), device="cpu")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    eos = tokenizer.eos_token_id
    for out, ref, p in zip(outs, references["llama"], prompts):
        c = out.outputs[0]
        assert out.finished and out.prompt_token_ids == p
        # A trailing incomplete UTF-8 sequence (random weights) is never emitted, and bytes
        # of the prompt's last, incomplete character count as output (echo leaves them out).
        assert c.text == expected_text(tokenizer, p, ref)
        assert c.finish_reason == ("stop" if ref[-1] == eos else "length")
        assert c.stop_reason is None


def test_string_prompts_and_prefix_stats(llama_dir):
    llm = LLM(str(llama_dir), device="cpu", block_size=4)
    text = "def add(a, b):\n    return a + b\n" * 3
    first = llm.generate(text, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    hits_before = llm.llm_engine.get_stats().prefix_cache_hits
    second = llm.generate([text], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert second.num_cached_tokens > 0
    assert llm.llm_engine.get_stats().prefix_cache_hits - hits_before == second.num_cached_tokens
    _assert_no_leak(llm)


def test_stop_token_ids_and_stop_strings(llama_dir, tokenizer, prompts, references):
    llm = LLM(str(llama_dir), device="cpu")
    ref = references["llama"][1]
    stop_id = ref[3]
    out = llm.generate([prompts[1]], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref[: ref.index(stop_id) + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)

    full = tokenizer.decode(ref, skip_special_tokens=True).rstrip("\ufffd")
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip(), "pick a visible stop string"
    out = llm.generate([prompts[1]], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == full[: full.index(stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    out = llm.generate([prompts[1]], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[stop],
                                                    include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert out.text == full[: full.index(stop) + len(stop)]
    _assert_no_leak(llm)


def test_ignore_eos_and_min_tokens(llama_dir, tokenizer, prompts):
    eos = tokenizer.eos_token_id
    llm = LLM(str(llama_dir), device="cpu")
    ref = hf_greedy(llama_dir, prompts, 40, ignore_eos=True)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs)
    # min_tokens: EOS is masked until min_tokens tokens were produced.
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=30, min_tokens=12), use_tqdm=False)
    for o in outs:
        ids = o.outputs[0].token_ids
        assert len(ids) >= 12 and eos not in ids[:12]


def test_max_tokens_none_runs_to_max_model_len(llama_dir, prompts):
    llm = LLM(str(llama_dir), device="cpu", max_model_len=48)
    outs = llm.generate(prompts[:3], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)
    for o, p in zip(outs, prompts[:3]):
        assert len(p) + len(o.outputs[0].token_ids) == 48
        assert o.outputs[0].finish_reason == "length"


def test_logprobs_match_transformers(llama_dir, prompts, references):
    llm = LLM(str(llama_dir), device="cpu")
    out = llm.generate([prompts[2]], SamplingParams(temperature=0, max_tokens=8, logprobs=3), use_tqdm=False)[0]
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids)
    ref_lp = torch.log_softmax(hf_logits(llama_dir, prompts[2] + c.token_ids), dim=-1)
    total = 0.0
    for i, (tok, lp) in enumerate(zip(c.token_ids, c.logprobs)):
        row = ref_lp[len(prompts[2]) - 1 + i]
        assert lp[tok].rank == 1
        assert lp[tok].logprob == pytest.approx(row[tok].item(), abs=1e-4)
        assert set(lp) == set(row.topk(3).indices.tolist()) | {tok}
        total += row[tok].item()
    assert c.cumulative_logprob == pytest.approx(total, abs=1e-3)


def test_seeded_sampling_reproducible_across_batches(llama_dir, prompts):
    llm = LLM(str(llama_dir), device="cpu")
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([prompts[0]], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=10 + i, ignore_eos=True) for i in range(4)]
    mixed = llm.generate(prompts[3:7] + [prompts[0]], others + [sp], use_tqdm=False)[-1].outputs[0].token_ids
    first = llm.generate([prompts[0]] + prompts[3:5], [sp] + others[:2], use_tqdm=False)[0].outputs[0].token_ids
    assert alone == mixed == first
    other_seed = llm.generate([prompts[0]], sp.clone(seed=99), use_tqdm=False)[0].outputs[0].token_ids
    assert other_seed != alone


def test_top_k_1_equals_greedy(llama_dir, prompts, references):
    llm = LLM(str(llama_dir), device="cpu")
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, top_k=1, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == references["llama"]


def test_n_completions(llama_dir, prompts):
    llm = LLM(str(llama_dir), device="cpu")
    out = llm.generate([prompts[0]], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    _assert_no_leak(llm)


def test_reset_prefix_cache(llama_dir):
    # issue 12 kind 4: vLLM's LLM.reset_prefix_cache(), False while blocks are in use
    llm = LLM(str(llama_dir), device="cpu", block_size=4)
    text = "def add(a, b):\n    return a + b\n" * 3
    sp = SamplingParams(temperature=0, max_tokens=4)
    first = llm.generate(text, sp, use_tqdm=False)[0]
    assert llm.generate(text, sp, use_tqdm=False)[0].num_cached_tokens > 0
    engine = llm.llm_engine
    engine.add_request("busy", text, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert llm.reset_prefix_cache() is False  # a request holds blocks: nothing changes
    engine.abort_request(["busy"])
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.reset_prefix_cache() is True
    again = llm.generate(text, sp, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    _assert_no_leak(llm)


@pytest.mark.parametrize("bad, match", [
    ("", "empty"),
    ([], "empty"),
    ([10**9], "vocabulary"),
    ([1] * 200, "maximum context length is 128 tokens. However, your prompt has 200 tokens"),
    ("fox " * (1 << 20), "it has 4194304 characters"),  # refused before it is tokenized (issue 16)
    (3.5, "string or a list"),
])
def test_bad_prompts_rejected_and_engine_keeps_serving(llama_dir, prompts, references, bad, match):
    llm = LLM(str(llama_dir), device="cpu", max_model_len=128)
    with pytest.raises(ValueError, match=match):
        llm.generate([prompts[0], bad], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    _assert_no_leak(llm)
    outs = llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == references["llama"][:2]


def test_out_of_range_sampling_values_never_reach_the_engine(llama_dir, prompts, references):
    # issue 12: a seed past 64 bits raised inside the engine step; NaN temperature ran
    llm = LLM(str(llama_dir), device="cpu", max_model_len=128)
    for bad in ({"seed": 2 ** 64}, {"temperature": float("nan")}, {"n": 10 ** 20}, {"top_p": float("inf")}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            llm.generate(prompts[:2], SamplingParams(max_tokens=4, **bad), use_tqdm=False)
    _assert_no_leak(llm)
    outs = llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == references["llama"][:2]
    # the ends of the seed range run (torch's generator takes the whole int64 range)
    from pyengine.sampling_params import INT64_MAX, INT64_MIN
    outs = llm.generate(prompts[:2], [SamplingParams(seed=INT64_MAX, n=2, max_tokens=4, ignore_eos=True),
                                      SamplingParams(seed=INT64_MIN, max_tokens=4, ignore_eos=True)], use_tqdm=False)
    assert [len(c.token_ids) for o in outs for c in o.outputs] == [4, 4, 4]
    _assert_no_leak(llm)


@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -3}, "top_k"),
    ({"min_p": 2.0}, "min_p"),
    ({"n": 2, "temperature": 0}, "greedy"),
    ({"bogus_field": 1}, "bogus_field"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"logprobs": -1}, "logprobs"),  # more than max_logprobs: refused by the engine (test_processor)
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"scheduling_policy": "lifo"}, "fcfs, priority"),
    ({"device": "tpu"}, "device"),
    ({"dtype": "int3"}, "dtype"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"not_an_arg": 1}, "not_an_arg"),
    ({"num_gpu_blocks_override": 2, "max_model_len": 1024}, "max_model_len"),
])
def test_bad_engine_args(llama_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(str(llama_dir), device=kwargs.pop("device", "cpu"), **kwargs)


def test_model_without_tokenizer_is_refused(no_tokenizer_dir):
    with pytest.raises(ValueError, match="cannot encode text"):
        LLM(str(no_tokenizer_dir), device="cpu")


def test_missing_model_dir(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path / "nope"), device="cpu")


def test_shutdown_releases_model_and_kv_cache(llama_dir, prompts):
    llm = LLM(str(llama_dir), device="cpu")
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    runner = llm.llm_engine.engine_core.model_runner
    llm.shutdown()
    assert runner.model is None and runner.kv_caches == [] and runner.graph_runner is None


@pytest.mark.parametrize("case", ["override", "linear_rope"])
def test_positions_past_max_position_embeddings(llama_dir, tmp_path, monkeypatch, tokenizer, case):
    # Sequences past max_position_embeddings (1024) either through the explicit override or
    # a linear-RoPE-scaled model: no IndexError in the rotary cache, and greedy tokens equal
    # transformers' (which computes RoPE on the fly at any position).
    from tests.test_config import rope_scaled_copy

    model = llama_dir
    if case == "override":
        monkeypatch.setenv("VENGINE_ALLOW_LONG_MAX_MODEL_LEN", "1")
    else:
        model = rope_scaled_copy(llama_dir, tmp_path / "linear", rope_type="linear", factor=2.0)
    prompt = prompt_token_ids(tokenizer, 1, min_len=1030, max_len=1030, seed=11)[0]
    llm = LLM(str(model), device="cpu", max_model_len=1040, num_gpu_blocks_override=70)
    try:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                           use_tqdm=False)[0]
    finally:
        llm.shutdown()
    assert out.outputs[0].token_ids == hf_greedy(model, [prompt], 4, ignore_eos=True)[0]


def test_scripted_model_emits_its_script(scripted_dir, scripted_tokenizer):
    # The fixture the text-edge tests rely on: the script, token for token, as transformers.
    from tests.helpers import EMOJI

    tok = scripted_tokenizer
    a = tok.encode("xyA", add_special_tokens=False)
    e = tok.encode("ok" + EMOJI, add_special_tokens=False)[:-2]
    llm = LLM(str(scripted_dir), device="cpu", max_model_len=64)
    try:
        outs = llm.generate([a, e], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    finally:
        llm.shutdown()
    ids = [o.outputs[0].token_ids for o in outs]
    assert [tok.decode([t]) for t in ids[0]] == ["DEF", "G", "HI", "</s>"]
    assert tok.decode(e + ids[1], skip_special_tokens=True) == "ok" + EMOJI + "!"
    assert ids == hf_greedy(scripted_dir, [a, e], 8)
    assert [o.outputs[0].text for o in outs] == ["DEFGHI", EMOJI + "!"]


def test_stats_log_line_offline_only_when_asked(llama_dir, monkeypatch, caplog):
    """LLM logs no stats by default (as vLLM's); disable_log_stats=False turns the line on."""
    import logging

    caplog.set_level(logging.INFO, logger="pyengine")
    monkeypatch.setenv("VENGINE_LOG_STATS_INTERVAL", "0.01")
    llm = LLM(str(llama_dir), device="cpu", disable_log_stats=False)
    llm.generate([[5, 6, 7, 8]] * 2, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert "Avg generation throughput" in caplog.text
    configs = []
    monkeypatch.setattr("pyengine.llm.LLMEngine", lambda config: configs.append(config))
    LLM(str(llama_dir), device="cpu")
    assert configs[0].disable_log_stats  # off unless asked for


# ---- LLM.chat -----------------------------------------------------------------------

CHAT_SP = SamplingParams(temperature=0, max_tokens=12)
CONVERSATIONS = [
    [{"role": "system", "content": "You answer in code."}, {"role": "user", "content": "def f(x):"}],
    [{"role": "user", "content": [{"type": "text", "text": "import os"}, {"type": "text", "text": "import sys"}]}],
    [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "More"}],
]


@pytest.fixture(scope="module")
def chat_llm(llama_dir):
    return LLM(str(llama_dir), device="cpu")


def _by_hand(tok, conversation, **kw):
    """The rendering LLM.chat must match: transformers' template, special tokens not added twice."""
    text = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True, **kw)
    return tok.encode(text, add_special_tokens=False)


def test_chat_matches_template_by_hand_then_generate(chat_llm):
    tok = chat_llm.get_tokenizer()
    conv = CONVERSATIONS[0]
    ids = _by_hand(tok, conv)
    assert tok.decode(ids).endswith("<|im_start|>assistant\n") and ids.count(tok.bos_token_id) <= 1
    (out,) = chat_llm.chat(conv, CHAT_SP, use_tqdm=False)
    (ref,) = chat_llm.generate([ids], CHAT_SP, use_tqdm=False)
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids and out.outputs[0].text == ref.outputs[0].text
    assert isinstance(out.outputs[0].finish_reason, FinishReason) and out.outputs[0].finish_reason == "length"


def test_chat_batch_of_conversations_in_order(chat_llm, llama_dir):
    tok = chat_llm.get_tokenizer()
    rendered = [_by_hand(tok, [{**m, "content": "\n".join(p["text"] for p in m["content"])}
                               if isinstance(m["content"], list) else m for m in conv])
                for conv in CONVERSATIONS]
    outs = chat_llm.chat(CONVERSATIONS, CHAT_SP, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == rendered
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(llama_dir, rendered, CHAT_SP.max_tokens)
    # a list of per-conversation params pairs with the conversations, as generate's
    outs2 = chat_llm.chat(CONVERSATIONS, [CHAT_SP.clone(max_tokens=k, ignore_eos=True) for k in (1, 2, 3)],
                          use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs2] == [o.outputs[0].token_ids[:k] for o, k in zip(outs, (1, 2, 3))]


def test_chat_continue_final_message_and_template_kwargs(chat_llm):
    tok = chat_llm.get_tokenizer()
    conv = [{"role": "user", "content": "Write a loop"}, {"role": "assistant", "content": "for i in"}]
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt"):
        chat_llm.chat(conv, CHAT_SP, use_tqdm=False, continue_final_message=True)
    (out,) = chat_llm.chat(conv, CHAT_SP, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    assert tok.decode(out.prompt_token_ids).endswith("assistant\nfor i in")  # left open for the model
    template = "{% for m in messages %}[{{ m['role'] }}|{{ shout }}] {{ m['content'] }}\n{% endfor %}"
    (out,) = chat_llm.chat(conv[:1], CHAT_SP, use_tqdm=False, chat_template=template,
                           chat_template_kwargs={"shout": "LOUD"})
    assert out.prompt_token_ids == tok.encode("[user|LOUD] Write a loop\n", add_special_tokens=False)


def test_chat_refused_without_a_template(chat_llm, monkeypatch):
    tok = chat_llm.get_tokenizer()
    monkeypatch.setattr(tok, "chat_template", None)
    with pytest.raises(ValueError, match="no chat template"):
        chat_llm.chat(CONVERSATIONS[0], CHAT_SP, use_tqdm=False)
    # nothing was queued; a template passed in still works (no ChatML guessed anywhere)
    assert not chat_llm.llm_engine.has_unfinished_requests()
    (out,) = chat_llm.chat(CONVERSATIONS[0], CHAT_SP, use_tqdm=False,
                           chat_template="{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    assert out.prompt_token_ids == tok.encode("You answer in code.\ndef f(x):\n", add_special_tokens=False)


def test_chat_bad_messages(chat_llm):
    for bad, match in (([], "non-empty list"), ([{"content": "x"}], "string 'role'"),
                       ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "text content parts"),
                       ([[{"role": "user", "content": "ok"}], []], "non-empty list")):
        with pytest.raises(ValueError, match=match):
            chat_llm.chat(bad, CHAT_SP, use_tqdm=False)
    assert not chat_llm.llm_engine.has_unfinished_requests()


def test_chat_over_the_character_bound_refused_before_tokenizing(chat_llm, monkeypatch):
    # issue 16 kind 2: the rendered chat meets the engine's cheap bound before the tokenizer
    from pyengine import VLLMValidationError

    proc = chat_llm.llm_engine.processor
    encoded = []
    encode = proc.encode
    monkeypatch.setattr(proc, "encode", lambda text, *a, **k: encoded.append(len(text)) or encode(text, *a, **k))
    with pytest.raises(VLLMValidationError) as ei:
        chat_llm.chat([{"role": "user", "content": "fox " * (1 << 20)}], CHAT_SP, use_tqdm=False)
    assert ei.value.parameter == "messages" and "characters" in str(ei.value) and not encoded
    assert not chat_llm.llm_engine.has_unfinished_requests()
    chat_llm.chat(CONVERSATIONS[0], CHAT_SP, use_tqdm=False)
    assert encoded  # a chat within the bound is encoded by the same Processor.encode
def test_default_sampling_params_from_the_generation_config(llama_greedy_dir, llama_dir, prompts, references):
    # the model recommends greedy, top_k 7 and 3 new tokens (generation_config.json)
    llm = LLM(str(llama_greedy_dir), device="cpu")
    d = llm.get_default_sampling_params()
    assert (d.temperature, d.top_k, d.max_tokens) == (0.0, 7, 3)
    outs = llm.generate(prompts[:3], use_tqdm=False)  # no sampling params: the model's defaults
    assert [list(o.outputs[0].token_ids) for o in outs] == [list(r[:3]) for r in references["llama"][:3]]
    # generation_config="vllm" ignores the file
    assert LLM(str(llama_greedy_dir), device="cpu", generation_config="vllm").get_default_sampling_params().temperature == 1.0


# ---- bad_words and allowed_token_ids (issue 23): the sampler's masks end to end ----------

@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("model", ["llama_dir", "llama_sp_dir"])  # byte-level BPE, SentencePiece
def test_bad_words_never_generated(model, async_scheduling, request):
    """The greedy output with a word banned is the unbanned output up to where the word's
    last token would come, then another token; no banned sequence appears anywhere. A
    one-token word and a two-token word (banned only right after its first token, which
    under async scheduling the host has not seen yet)."""
    llm = LLM(str(request.getfixturevalue(model)), device="cpu", async_scheduling=async_scheduling)
    tok, processor = llm.get_tokenizer(), llm.llm_engine.processor
    prompts = prompt_token_ids(tok, 6, min_len=4, max_len=20, seed=5)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    base = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    for length in (1, 2):
        n, word, seqs = find_bad_word(tok, processor, base, length)
        got = llm.generate([prompts[n]], greedy.clone(bad_words=[word]), use_tqdm=False)[0].outputs[0].token_ids
        i = banned_at(base[n], seqs)
        assert got[:i] == base[n][:i] and got[i] != base[n][i], (word, seqs)
        assert banned_at(got, seqs) is None, (word, seqs, got)
    _assert_no_leak(llm)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_allowed_token_ids_only(llama_dir, prompts, async_scheduling):
    allowed = [5, 77, 300, 301]
    llm = LLM(str(llama_dir), device="cpu", async_scheduling=async_scheduling)
    for temperature in (0, 1.0):
        outs = llm.generate(prompts, SamplingParams(temperature=temperature, max_tokens=12, seed=1,
                                                    allowed_token_ids=allowed), use_tqdm=False)
        for o in outs:
            assert len(o.outputs[0].token_ids) == 12 and set(o.outputs[0].token_ids) <= set(allowed)
    logits = hf_logits(llama_dir, prompts[0])[-1]
    first = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=1, allowed_token_ids=allowed),
                         use_tqdm=False)[0].outputs[0].token_ids
    assert first == [max(allowed, key=lambda t: logits[t].item())]
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate([prompts[0]], SamplingParams(allowed_token_ids=[10 ** 6]), use_tqdm=False)
