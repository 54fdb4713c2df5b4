"""``SamplingParams.thinking_token_budget`` end to end through ``LLM`` (CPU), on a scripted
reasoning model that thinks ``Hmm`` forever unless the budget forces ``</think>``: the
reasoning holds exactly the budget, the answer follows, with async scheduling on or off
(identical tokens), with an undecided start (Qwen3's optional ``<think>``) or a prompt that
opened the reasoning (DeepSeek-R1's), with speculative decoding (n-gram drafts of the
endless ``Hmm`` are rejected where the budget ends); a model that ends its reasoning first
is left alone; the Processor's refusals."""
from __future__ import annotations

import pytest

from pyengine import LLM, SamplingParams
from pyengine.reasoning import ReasoningParserManager

ASK = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def tok(reasoning_tokenizer):
    return reasoning_tokenizer


@pytest.fixture(scope="module")
def ids(tok):
    one = {t: tok.convert_tokens_to_ids(t) for t in ("<think>", "</think>", "Hmm", "OK")}
    return dict(one, para=tok.encode("\n\n", add_special_tokens=False)[0], eos=tok.eos_token_id)


@pytest.fixture(scope="module")
def prompt(tok):
    """A Qwen3-style thinking prompt (ends in "\\n": the model opens <think> itself)."""
    return tok.encode(tok.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)


@pytest.fixture(scope="module")
def llms(thinking_loop_dir):
    made = {mode: LLM(str(thinking_loop_dir), device="cpu", max_model_len=256, async_scheduling=mode == "async")
            for mode in ("async", "sync")}
    yield made
    for llm in made.values():
        llm.shutdown()


def budgeted(ids, budget, open_=False, **kw):
    kw.setdefault("temperature", 0)
    return SamplingParams(max_tokens=kw.pop("max_tokens", 64), thinking_token_budget=budget,
                          thinking_start_token_id=ids["<think>"], thinking_end_token_id=ids["</think>"],
                          thinking_open=open_, **kw)


def gen(llm, prompts, params):
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_the_reasoning_holds_exactly_the_budget_then_the_answer_follows(llms, tok, ids, prompt, mode):
    budgets = [0, 1, 2, 7, 30]
    outs = gen(llms[mode], [prompt] * len(budgets), [budgeted(ids, b) for b in budgets])
    parser = ReasoningParserManager.get_reasoning_parser("qwen3")(tok, prompt_token_ids=prompt)
    for b, out in zip(budgets, outs):
        assert out.token_ids == [ids["<think>"]] + [ids["Hmm"]] * b + [ids["</think>"], ids["para"], ids["OK"],
                                                                       ids["eos"]], b
        assert parser.count_reasoning_tokens(out.token_ids) == b
        assert parser.extract_reasoning(out.text, out.token_ids) == ("Hmm" * b or None, "\n\nOK")
        assert out.finish_reason == "stop"
    # without a budget the model never stops thinking
    free = gen(llms[mode], [prompt], SamplingParams(temperature=0, max_tokens=20))[0]
    assert free.token_ids == [ids["<think>"]] + [ids["Hmm"]] * 19 and free.finish_reason == "length"


def test_async_and_sync_scheduling_give_the_same_tokens_in_a_mixed_batch(llms, ids, prompt):
    opened = prompt + [ids["<think>"]]  # DeepSeek-R1's way: the prompt opened the reasoning
    batch = [(prompt, budgeted(ids, 3)), (opened, budgeted(ids, 5, open_=True)), (prompt, budgeted(ids, 12)),
             (prompt, SamplingParams(temperature=0, max_tokens=9)), (opened, budgeted(ids, 0, open_=True))]
    got = {mode: [o.token_ids for o in gen(llms[mode], [p for p, _ in batch], [sp for _, sp in batch])]
           for mode in llms}
    assert got["async"] == got["sync"]
    tail = [ids["</think>"], ids["para"], ids["OK"], ids["eos"]]
    assert got["sync"][1] == [ids["Hmm"]] * 5 + tail  # open: counted from the first output token
    assert got["sync"][4] == tail  # budget 0 on an open reasoning: the end comes first


def test_random_sampling_keeps_the_budget(llms, tok, ids, prompt):
    """At a high temperature the scripted model says almost anything: every output's
    reasoning still holds at most the budget (fewer only if a sampled ``</think>`` or EOS
    came first), and seeded outputs are the same with async scheduling on and off."""
    opened = prompt + [ids["<think>"]]
    params = [budgeted(ids, 6, open_=True, temperature=4.0, seed=s, max_tokens=40) for s in range(8)]
    got = {mode: gen(llms[mode], [opened] * len(params), params) for mode in llms}
    assert [o.token_ids for o in got["async"]] == [o.token_ids for o in got["sync"]]
    parser = ReasoningParserManager.get_reasoning_parser("deepseek_r1")(tok, prompt_token_ids=opened)
    counts = [parser.count_reasoning_tokens(o.token_ids) for o in got["sync"]]
    for c, o in zip(counts, got["sync"]):
        assert c <= 6, o.token_ids
        assert ids["</think>"] in o.token_ids or o.finish_reason == "stop", o.token_ids
    assert 6 in counts  # the budget, not chance, ended some reasoning


def test_a_reasoning_that_ends_first_is_left_alone(reasoning_dir, tok, ids, prompt):
    llm = LLM(str(reasoning_dir), device="cpu", max_model_len=256)
    try:
        out = gen(llm, [prompt], budgeted(ids, 5))[0]
        plain = gen(llm, [prompt], SamplingParams(temperature=0, max_tokens=64))[0]
        assert out.token_ids == plain.token_ids and out.text == "<think>Hmm</think>\n\nOK"
    finally:
        llm.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_speculative_drafts_stop_where_the_budget_ends(thinking_loop_dir, ids, prompt, async_scheduling):
    """(async: the rows' budget state also takes the tokens of the step in flight.)"""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    llm = LLM(str(thinking_loop_dir), device="cpu", max_model_len=256, async_scheduling=async_scheduling,
              speculative_config=spec)
    try:
        budgets = [2, 5, 9]
        outs = gen(llm, [prompt] * 3, [budgeted(ids, b) for b in budgets])
        st = llm.llm_engine.get_stats()
        for b, out in zip(budgets, outs):
            assert out.token_ids == [ids["<think>"]] + [ids["Hmm"]] * b + [ids["</think>"], ids["para"], ids["OK"],
                                                                           ids["eos"]]
        assert st.spec_num_draft_tokens > st.spec_num_accepted_tokens > 0  # drafts ran, and some were rejected
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kw,param", [
    (dict(thinking_token_budget=3), "thinking_token_budget"),  # no end token: nothing to force
    (dict(thinking_token_budget=3, thinking_end_token_id=10 ** 6), "thinking_end_token_id"),
    ("allowed", "allowed_token_ids"),
    ("bad", "bad_words"),
])
def test_the_processor_refuses_what_it_cannot_honour(llms, ids, prompt, kw, param):
    if kw == "allowed":
        sp = budgeted(ids, 3, allowed_token_ids=[ids["Hmm"], ids["<think>"]])
    elif kw == "bad":
        sp = budgeted(ids, 3, bad_words=["</think>"])
    else:
        sp = SamplingParams(**kw)
    with pytest.raises(ValueError) as e:
        llms["sync"].generate([prompt], sp, use_tqdm=False)
    assert e.value.parameter == param, str(e.value)


@pytest.mark.gpu
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_the_budget_on_the_device(thinking_loop_dir, tok, ids, prompt, async_scheduling):
    """On CUDA (decode CUDA graphs, pinned copies, the device-side placeholder check): the
    same exact budgets, greedy and seeded random, as on the CPU."""
    llm = LLM(str(thinking_loop_dir), device="cuda", dtype="float32", max_model_len=256, max_num_seqs=16,
              async_scheduling=async_scheduling)
    try:
        budgets = [0, 1, 7, 30]
        outs = gen(llm, [prompt] * len(budgets), [budgeted(ids, b) for b in budgets])
        for b, out in zip(budgets, outs):
            assert out.token_ids == [ids["<think>"]] + [ids["Hmm"]] * b + [ids["</think>"], ids["para"], ids["OK"],
                                                                           ids["eos"]], b
        opened = prompt + [ids["<think>"]]
        parser = ReasoningParserManager.get_reasoning_parser("deepseek_r1")(tok, prompt_token_ids=opened)
        rand = gen(llm, [opened] * 8, [budgeted(ids, 6, open_=True, temperature=4.0, seed=s, max_tokens=40)
                                      for s in range(8)])
        assert all(parser.count_reasoning_tokens(o.token_ids) <= 6 for o in rand)
        assert any(parser.count_reasoning_tokens(o.token_ids) == 6 for o in rand)
    finally:
        llm.shutdown()
