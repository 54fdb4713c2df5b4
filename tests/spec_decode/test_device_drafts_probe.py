"""Probes of the draft chain's device drafts under async scheduling (``DeviceDrafts`` /
``DraftRow``, pyengine/spec_decode/base.py; the runner's ``_resolve_spec``, ``_fill_drafts``,
``_sample_spec``; step_codec's ``_step_tokens``), run eagerly on the CPU.

The oracle: greedy output with speculation on (chain enabled, async scheduling) is the
same model's without speculation, token for token (and text, finish and stop reasons);
no KV block is left held afterwards; one request's failure never ends the engine. Seeded
random rows: the chain engine with ``device_drafts`` off gives what it gives with it on.

Three drafts: the target itself (every draft accepted), the target with 2% noise on its
weights (most accepted, every few rejected) and an unrelated random model (almost every
draft rejected)."""
from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import torch

from pyengine import LLM, SamplingParams, StructuredOutputsParams
from pyengine.spec_decode.base import DraftRow
from tests.helpers import build_tiny_model, fail_request_allocation, prompt_token_ids, with_generation_config

K = 3
MAX_TOKENS = 20
# make test runs the probes with the draft that both accepts and rejects and a few points of each
# sweep; VENGINE_PROBE_ALL_DRAFTS=1 adds the target as its own draft and an unrelated one, and
# PROBE_FUZZ_SEEDS more fuzz seeds (the helper that wrote these ran 40-60)
DRAFTS = ["self", "near", "other"] if os.environ.get("VENGINE_PROBE_ALL_DRAFTS") == "1" else ["near"]


# ---- fixtures --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def other_dir(tmp_path_factory, tokenizer_dir):
    return build_tiny_model(tmp_path_factory.mktemp("probe_other"), "qwen3", tokenizer_dir, seed=7,
                            num_hidden_layers=2)


@pytest.fixture(scope="module")
def near_dir(tmp_path_factory, llama_dir):
    """The target's weights with 2% (of each tensor's std) noise: ~70% of drafts accepted."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("probe_near") / "m"
    shutil.copytree(llama_dir, out)
    g = torch.Generator().manual_seed(0)
    for f in out.glob("*.safetensors"):
        t = load_file(str(f))
        save_file({k: v + 0.02 * v.std() * torch.randn(v.shape, generator=g) for k, v in t.items()}, str(f))
    return out


@pytest.fixture(scope="module")
def drafts(llama_dir, near_dir, other_dir):
    return {"self": llama_dir, "near": near_dir, "other": other_dir}


@pytest.fixture(scope="module")
def prompts(tokenizer):
    base = prompt_token_ids(tokenizer, 5, min_len=3, max_len=24, seed=21)
    return [base[0] * 2, base[1], base[2], base[3] + base[3][:4], base[4]]


@pytest.fixture(scope="module")
def plain(llama_dir):
    """plain(**kw): the target without speculation (cached per keyword set)."""
    engines: dict = {}

    def get(model_dir=None, **kw):
        key = (str(model_dir or llama_dir), tuple(sorted(kw.items())))
        if key not in engines:
            engines[key] = LLM(str(model_dir or llama_dir), device="cpu", **kw)
        return engines[key]
    yield get
    for e in engines.values():
        e.shutdown()


class Counts:
    def __init__(self, llm, draft):
        self.llm, self.draft = llm, draft
        self.exact = draft == "self"  # every draft accepted (greedy rows only, no penalties)
        self.device = 0  # DraftRows handed out
        self.host = 0  # host draft lists handed out
        self.big_steps = 0  # propose calls with more sampled rows than the chain takes
        self.calls = 0


def _chain_llm(llama_dir, drafts, draft, model_dir=None, spec_extra=None, **kw):
    """The target with the draft model ``drafts[draft]`` under async scheduling, the chain
    on (eager); and its counters."""
    draft_dir = drafts[draft]
    spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": K, **(spec_extra or {})}
    llm = LLM(str(model_dir or llama_dir), device="cpu", speculative_config=spec, async_scheduling=True, **kw)
    assert llm.llm_engine.engine_core.config.async_scheduling
    drafter = llm.llm_engine.engine_core.model_runner.drafter
    drafter.enable_draft_chain()
    assert drafter.device_drafts
    counts = Counts(llm, draft)
    propose = drafter.propose

    def counted(so, sampled, generated, hidden):
        out = propose(so, sampled, generated, hidden)
        counts.calls += 1
        if len(sampled) > 32:
            counts.big_steps += 1
        for d in out:
            if isinstance(d, DraftRow):
                counts.device += 1
            elif d:
                counts.host += 1
        return out
    drafter.propose = counted
    return llm, counts


def _tok(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def _summary(outs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


def _assert_idle(llm):
    st = llm.llm_engine.get_stats()
    assert st.num_running == 0 and st.num_waiting == 0, st
    assert st.num_free_blocks == st.num_gpu_blocks, f"KV blocks leaked: {st.num_free_blocks} of {st.num_gpu_blocks}"


def _done(counts):
    """Idle, no leak, the chain's device drafts were used, and the target drafting for
    itself had every draft accepted (a draft fed a wrong token, or a draft KV read wrong,
    shows there even where verification keeps the output right)."""
    _assert_idle(counts.llm)
    assert counts.device > 0, "the chain's device drafts were never used"
    if counts.exact:
        st = counts.llm.llm_engine.get_stats()
        assert st.spec_num_accepted_tokens == st.spec_num_draft_tokens > 0, \
            (st.spec_num_accepted_tokens, st.spec_num_draft_tokens, st.spec_accepted_per_pos)


def _greedy(**kw):
    return SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", MAX_TOKENS), **kw)


# ---- max_tokens, stops, min_tokens, ignore_eos ------------------------------------------

@pytest.mark.parametrize("draft", DRAFTS)
def test_max_tokens_1_to_k_plus_3(draft, drafts, llama_dir, plain, prompts):
    llm, counts = _chain_llm(llama_dir, drafts, draft)
    ref_llm = plain()
    try:
        for mt in list(range(1, K + 4)) + [7, 8, 9, 10, 11, 13]:  # (the chain: from the third step)
            sp = _greedy(max_tokens=mt, ignore_eos=True)
            assert _summary(llm.generate(prompts, sp, use_tqdm=False)) == \
                _summary(ref_llm.generate(prompts, sp, use_tqdm=False)), mt
            _assert_idle(llm)
        # one batch, each request its own max_tokens
        sps = [_greedy(max_tokens=1 + i % (K + 3), ignore_eos=True) for i in range(len(prompts))]
        sps[-1] = _greedy(max_tokens=MAX_TOKENS, ignore_eos=True)
        assert _summary(llm.generate(prompts, sps, use_tqdm=False)) == \
            _summary(ref_llm.generate(prompts, sps, use_tqdm=False))
        _done(counts)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("draft", DRAFTS)
def test_stop_token_ids_inside_accepted_runs(draft, drafts, llama_dir, plain, prompts):
    ref_llm = plain()
    ref = _tok(ref_llm.generate(prompts, _greedy(ignore_eos=True), use_tqdm=False))
    llm, counts = _chain_llm(llama_dir, drafts, draft)
    try:
        for j in (1, 2, 3, 4, 5, 7, 10):
            sps = [_greedy(stop_token_ids=[r[0][j]]) for r in ref]
            want = ref_llm.generate(prompts, sps, use_tqdm=False)
            got = llm.generate(prompts, sps, use_tqdm=False)
            assert _summary(got) == _summary(want), j
            sp = _greedy(stop_token_ids=[ref[0][0][j]], include_stop_str_in_output=True)
            assert _summary(llm.generate(prompts, sp, use_tqdm=False)) == \
                _summary(ref_llm.generate(prompts, sp, use_tqdm=False)), (j, sp)
        _done(counts)
        counts.exact = False  # (min_tokens bans the stop token on the target only: rejections)
        for j in (1, 2, 3, 4, 5, 7, 10):
            sp = _greedy(stop_token_ids=[ref[0][0][j]], min_tokens=j + 2)
            assert _summary(llm.generate(prompts, sp, use_tqdm=False)) == \
                _summary(ref_llm.generate(prompts, sp, use_tqdm=False)), (j, sp)
        _done(counts)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("draft", DRAFTS)
def test_stop_strings_inside_accepted_runs(draft, drafts, llama_dir, plain, prompts):
    ref_llm = plain()
    texts = [o.outputs[0].text for o in ref_llm.generate(prompts, _greedy(ignore_eos=True), use_tqdm=False)]
    llm, counts = _chain_llm(llama_dir, drafts, draft)
    try:
        for frac in (0.15, 0.3, 0.5, 0.8):
            stops = [t[int(len(t) * frac):int(len(t) * frac) + 2] or "zz" for t in texts]
            for incl in (False, True):
                sps = [_greedy(stop=[s], include_stop_str_in_output=incl) for s in stops]
                want = ref_llm.generate(prompts, sps, use_tqdm=False)
                got = llm.generate(prompts, sps, use_tqdm=False)
                assert _summary(got) == _summary(want), (frac, incl)
        _done(counts)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("draft", DRAFTS)
def test_min_tokens_and_ignore_eos_with_a_frequent_eos(draft, drafts, llama_dir, plain, prompts, tmp_path):
    """The model's EOS made a token its greedy outputs hold early: without ignore_eos the
    requests end at it (inside an accepted run of drafts), with min_tokens later."""
    ref = _tok(plain().generate(prompts, _greedy(ignore_eos=True), use_tqdm=False))
    eos = ref[1][0][3]
    model = with_generation_config(llama_dir, tmp_path / "eos_model", eos_token_id=eos)
    ref_llm = plain(model)
    llm, counts = _chain_llm(llama_dir, drafts, draft, model_dir=model)
    counts.exact = False  # (min_tokens bans EOS on the target only: rejections)
    try:
        for sp in (_greedy(), _greedy(ignore_eos=True), _greedy(min_tokens=6), _greedy(min_tokens=MAX_TOKENS),
                   _greedy(min_tokens=2, max_tokens=5), _greedy(min_tokens=1, ignore_eos=True)):
            want = ref_llm.generate(prompts, sp, use_tqdm=False)
            assert any(o.outputs[0].finish_reason == "stop" for o in want) or sp.ignore_eos or sp.min_tokens >= 6
            assert _summary(llm.generate(prompts, sp, use_tqdm=False)) == _summary(want), sp
        _done(counts)
    finally:
        llm.shutdown()


# ---- many requests, prefix cache, preemption, chunked prefill, max_model_len ----------------

@pytest.mark.parametrize("draft", [d for d in DRAFTS if d != "other"])
def test_more_requests_than_the_chain_takes(draft, drafts, llama_dir, plain, tokenizer):
    """40 requests: steps of more than 32 sampled rows go depth by depth, then, as the
    short ones finish, the chain takes over (and back, when a second wave arrives)."""
    ps = prompt_token_ids(tokenizer, 40, min_len=2, max_len=16, seed=5)
    sps = [_greedy(max_tokens=2 + (i * 7) % 22 if i % 5 else 40, ignore_eos=True) for i in range(len(ps))]
    llm, counts = _chain_llm(llama_dir, drafts, draft)
    try:
        want = _summary(plain().generate(ps, sps, use_tqdm=False))
        assert _summary(llm.generate(ps, sps, use_tqdm=False)) == want
        assert counts.big_steps > 0
        _done(counts)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("draft", [d for d in DRAFTS if d != "other"])
def test_waves_of_requests_between_steps(draft, drafts, llama_dir, plain, tokenizer):
    """LLMEngine: requests added between steps, so that chain steps (all decodes), prefill
    steps and steps of more than 32 rows follow each other in every order."""
    ps = prompt_token_ids(tokenizer, 48, min_len=2, max_len=20, seed=6)
    sps = [_greedy(max_tokens=3 + (i * 5) % 19, ignore_eos=True) for i in range(len(ps))]
    want = _tok(plain().generate(ps, sps, use_tqdm=False))
    llm, counts = _chain_llm(llama_dir, drafts, draft)
    eng = llm.llm_engine
    try:
        schedule = {0: range(0, 2), 3: range(2, 4), 5: range(4, 38), 9: range(38, 40), 20: range(40, 48)}
        got: dict = {}
        step = 0
        while step < 400 and (step <= max(schedule) or eng.has_unfinished_requests()):
            for i in schedule.get(step, ()):
                eng.add_request(f"r{i}", {"prompt_token_ids": ps[i]}, sps[i])
            for ro in eng.step():
                if ro.finished:
                    got[int(ro.request_id[1:])] = [ro.outputs[0].token_ids]
            step += 1
        assert [got.get(i) for i in range(len(ps))] == want
        assert counts.big_steps > 0
        _done(counts)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("draft", DRAFTS)
def test_prefix_cache_hits(draft, drafts, llama_dir, plain, prompts):
    """The same prompt twice in one batch, again in a later batch, and prompts that extend
    an earlier output (its blocks cached, rejected drafts' KV past it)."""
    ref_llm = plain()
    llm, counts = _chain_llm(llama_dir, drafts, draft)
    try:
        long = [p * 3 for p in prompts[:3]]  # > one block: something to hit
        twice = long + long
        assert _summary(llm.generate(twice, _greedy(), use_tqdm=False)) == \
            _summary(ref_llm.generate(twice, _greedy(), use_tqdm=False))
        before = llm.llm_engine.get_stats().prefix_cache_hits
        first = llm.generate(long, _greedy(), use_tqdm=False)
        assert _summary(first) == _summary(ref_llm.generate(long, _greedy(), use_tqdm=False))
        longer = [p + o.outputs[0].token_ids for p, o in zip(long, first)]
        longer += [x + x[:5] for x in longer[:1]]
        assert _summary(llm.generate(longer, _greedy(), use_tqdm=False)) == \
            _summary(ref_llm.generate(longer, _greedy(), use_tqdm=False))
        assert llm.llm_engine.get_stats().prefix_cache_hits > before
        _done(counts)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("blocks", [6, 10])
@pytest.mark.parametrize("draft", DRAFTS)
def test_preemption(draft, blocks, drafts, llama_dir, plain, prompts):
    kw = {"num_gpu_blocks_override": blocks, "max_model_len": 96}
    sp = _greedy(max_tokens=24, ignore_eos=True)
    want = _summary(plain(**kw).generate(prompts, sp, use_tqdm=False))
    llm, counts = _chain_llm(llama_dir, drafts, draft, **kw)
    try:
        assert _summary(llm.generate(prompts, sp, use_tqdm=False)) == want
        st = llm.llm_engine.get_stats()
        assert st.num_preemptions > 0
        _done(counts)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("draft", DRAFTS)
def test_preemption_with_priority(draft, drafts, llama_dir, plain, prompts):
    kw = {"num_gpu_blocks_override": 7, "max_model_len": 96, "scheduling_policy": "priority"}
    sp = _greedy(max_tokens=24, ignore_eos=True)
    prio = [3, 1, 4, 0, 2]
    want = _summary(plain(**kw).generate(prompts, sp, use_tqdm=False, priority=prio))
    llm, counts = _chain_llm(llama_dir, drafts, draft, **kw)
    try:
        assert _summary(llm.generate(prompts, sp, use_tqdm=False, priority=prio)) == want
        _done(counts)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("draft", DRAFTS)
def test_chunked_prefill(draft, drafts, llama_dir, plain, prompts):
    kw = {"max_num_batched_tokens": 16}
    ps = prompts + [prompts[0] * 3]
    sp = _greedy(ignore_eos=True)
    want = _summary(plain(**kw).generate(ps, sp, use_tqdm=False))
    llm, counts = _chain_llm(llama_dir, drafts, draft, **kw)
    try:
        assert _summary(llm.generate(ps, sp, use_tqdm=False)) == want
        _done(counts)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("draft", DRAFTS)
def test_max_model_len_cuts_the_room(draft, drafts, llama_dir, plain, prompts):
    """A context length a few tokens past the prompts: the drafts' room ends at it."""
    ps = [p[:20] for p in prompts]
    kw = {"max_model_len": 32}
    sp = SamplingParams(temperature=0, ignore_eos=True)  # max_tokens: the rest of the context
    want = _summary(plain(**kw).generate(ps, sp, use_tqdm=False))
    llm, counts = _chain_llm(llama_dir, drafts, draft, **kw)
    try:
        assert _summary(llm.generate(ps, sp, use_tqdm=False)) == want
        _done(counts)
    finally:
        llm.shutdown()


# ---- constrained, n > 1, logprobs, penalties, seeded random ---------------------------------

@pytest.mark.parametrize("draft", DRAFTS)
def test_structured_outputs_next_to_greedy_rows(draft, drafts, llama_dir, plain, prompts):
    from tests.structured_output.schemas import SCHEMAS

    so_json = StructuredOutputsParams(json=SCHEMAS[1], disable_any_whitespace=True)
    so_re = StructuredOutputsParams(regex="[a-z]{3,12}")
    sps = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=so_json), _greedy(ignore_eos=True),
           SamplingParams(temperature=0, max_tokens=24, structured_outputs=so_re), _greedy(ignore_eos=True),
           _greedy(ignore_eos=True)]
    want = plain().generate(prompts, sps, use_tqdm=False)
    llm, counts = _chain_llm(llama_dir, drafts, draft)
    try:
        got = llm.generate(prompts, sps, use_tqdm=False)
        assert _summary(got) == _summary(want)
        if got[0].outputs[0].finish_reason == "stop":
            json.loads(got[0].outputs[0].text.lstrip("\ufffd"))  # (a random prompt's last byte)
        # a constrained request alone among chain rows, arriving later
        got2 = llm.generate(prompts[1:] + prompts[:1], sps[1:] + sps[:1], use_tqdm=False)
        assert _summary(got2) == _summary(plain().generate(prompts[1:] + prompts[:1], sps[1:] + sps[:1],
                                                             use_tqdm=False))
        _done(counts)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("draft", DRAFTS)
def test_n_and_logprobs(draft, drafts, llama_dir, plain, prompts):
    sps = [SamplingParams(temperature=0.7, top_k=1, max_tokens=MAX_TOKENS, logprobs=2, n=2, ignore_eos=True),
           _greedy(logprobs=1, ignore_eos=True), _greedy(ignore_eos=True), _greedy(logprobs=0, ignore_eos=True),
           _greedy(ignore_eos=True, logprobs=3)]
    want = plain().generate(prompts, sps, use_tqdm=False)
    llm, counts = _chain_llm(llama_dir, drafts, draft)
    try:
        got = llm.generate(prompts, sps, use_tqdm=False)
        assert _summary(got) == _summary(want)
        for w, g in zip(want, got):
            for cw, cg in zip(w.outputs, g.outputs):
                if cw.logprobs is None:
                    assert cg.logprobs is None
                    continue
                assert len(cg.logprobs) == len(cg.token_ids)
                for dw, dg in zip(cw.logprobs, cg.logprobs):
                    assert list(dw) == list(dg)
                    for t in dw:
                        assert dg[t].logprob == pytest.approx(dw[t].logprob, abs=1e-4)
                        assert dg[t].rank == dw[t].rank
        _done(counts)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("draft", DRAFTS)
def test_penalties_next_to_plain_greedy_rows(draft, drafts, llama_dir, plain, prompts):
    sps = [_greedy(ignore_eos=True, repetition_penalty=1.4), _greedy(ignore_eos=True),
           _greedy(ignore_eos=True, frequency_penalty=0.8, presence_penalty=0.3), _greedy(ignore_eos=True),
           _greedy(ignore_eos=True, min_tokens=4)]
    want = plain().generate(prompts, sps, use_tqdm=False)
    llm, counts = _chain_llm(llama_dir, drafts, draft)
    counts.exact = False  # (the draft knows no penalties)
    try:
        assert _summary(llm.generate(prompts, sps, use_tqdm=False)) == _summary(want)
        _done(counts)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("draft", DRAFTS)
def test_seeded_random_rows_device_drafts_match_host_drafts(draft, drafts, llama_dir, prompts):
    sps = [SamplingParams(temperature=0.9, top_k=30, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True),
           _greedy(ignore_eos=True),
           SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True, n=2),
           _greedy(ignore_eos=True, max_tokens=5),
           SamplingParams(temperature=0.5, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)]
    outs = {}
    for device in (False, True):
        llm, counts = _chain_llm(llama_dir, drafts, draft)
        llm.llm_engine.engine_core.model_runner.drafter.device_drafts = device
        outs[device] = [_tok(llm.generate(prompts, sps, use_tqdm=False)),
                        _tok(llm.generate(prompts[::-1], sps, use_tqdm=False))]
        _assert_idle(llm)
        llm.shutdown()
        assert (counts.device > 0) == device
    assert outs[False] == outs[True]


@pytest.mark.parametrize("draft", DRAFTS)
def test_all_greedy_then_all_seeded(draft, drafts, llama_dir, prompts):
    """A batch switches from all-greedy (the drafts' values read with the result) to one
    with a seeded row (the verification takes them as device ids) mid-stream."""
    outs = {}
    for device in (False, True):
        llm, counts = _chain_llm(llama_dir, drafts, draft)
        llm.llm_engine.engine_core.model_runner.drafter.device_drafts = device
        eng = llm.llm_engine
        got: dict = {}
        for i, p in enumerate(prompts[:3]):
            eng.add_request(f"g{i}", {"prompt_token_ids": p}, _greedy(ignore_eos=True))
        step = 0
        while eng.has_unfinished_requests() or step < 7:
            if step == 6:
                eng.add_request("s", {"prompt_token_ids": prompts[3]},
                                SamplingParams(temperature=0.8, seed=9, max_tokens=12, ignore_eos=True))
            for ro in eng.step():
                if ro.finished:
                    got[ro.request_id] = ro.outputs[0].token_ids
            step += 1
        outs[device] = got
        _assert_idle(llm)
        llm.shutdown()
        assert (counts.device > 0) == device
    assert outs[False] == outs[True]


# ---- disable_by_batch_size ------------------------------------------------------------------

@pytest.mark.parametrize("cut", [2, 4])
@pytest.mark.parametrize("draft", [d for d in DRAFTS if d != "other"])
def test_disable_by_batch_size_crossings(draft, cut, drafts, llama_dir, plain, prompts):
    sps = [_greedy(max_tokens=n, ignore_eos=True) for n in (3, 6, 20, 40, 9)]
    want = _summary(plain().generate(prompts, sps, use_tqdm=False))
    llm, counts = _chain_llm(llama_dir, drafts, draft, spec_extra={"disable_by_batch_size": cut})
    try:
        assert _summary(llm.generate(prompts, sps, use_tqdm=False)) == want
        _done(counts)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("draft", [d for d in DRAFTS if d != "other"])
def test_disable_by_batch_size_crossings_with_arrivals(draft, drafts, llama_dir, plain, prompts, tokenizer):
    """Requests arrive between steps, crossing the cut both ways several times while chain
    drafts are in flight."""
    ps = prompts + prompt_token_ids(tokenizer, 5, min_len=3, max_len=12, seed=8)
    sps = [_greedy(max_tokens=4 + (i * 5) % 17, ignore_eos=True) for i in range(len(ps))]
    want = _tok(plain().generate(ps, sps, use_tqdm=False))
    llm, counts = _chain_llm(llama_dir, drafts, draft, spec_extra={"disable_by_batch_size": 3})
    eng = llm.llm_engine
    try:
        arrivals = {0: [0, 1], 4: [2], 6: [3], 9: [4, 5], 14: [6], 15: [7], 22: [8, 9]}
        got: dict = {}
        step = 0
        while step < 400 and (step <= max(arrivals) or eng.has_unfinished_requests()):
            for i in arrivals.get(step, ()):
                eng.add_request(f"r{i}", {"prompt_token_ids": ps[i]}, sps[i])
            for ro in eng.step():
                if ro.finished:
                    got[int(ro.request_id[1:])] = [ro.outputs[0].token_ids]
            step += 1
        assert [got.get(i) for i in range(len(ps))] == want
        _done(counts)
    finally:
        llm.shutdown()


# ---- aborts, failures -------------------------------------------------------------------------

@pytest.mark.parametrize("when", [1, 4, 9])
@pytest.mark.parametrize("draft", [d for d in DRAFTS if d != "other"])
def test_abort_between_steps(draft, when, drafts, llama_dir, plain, prompts):
    """LLMEngine: two of five requests aborted after ``when`` steps (with chain drafts of
    theirs in flight); the others keep the target's tokens; nothing leaks; the engine
    serves the same prompts again."""
    sp = _greedy(ignore_eos=True)
    want = _tok(plain().generate(prompts, sp, use_tqdm=False))
    llm, counts = _chain_llm(llama_dir, drafts, draft)
    eng = llm.llm_engine
    try:
        for i, p in enumerate(prompts):
            eng.add_request(f"a{i}", {"prompt_token_ids": p}, sp)
        got: dict = {}
        step = 0
        while eng.has_unfinished_requests():
            if step == when:
                eng.abort_request(["a1", "a3"])
            for ro in eng.step():
                if ro.finished:
                    got[ro.request_id] = ro.outputs[0]
            step += 1
            assert step < 300
        for i in (0, 2, 4):
            assert got[f"a{i}"].token_ids == want[i][0], i
        for i in (1, 3):
            c = got.get(f"a{i}")
            if c is not None:  # (aborted: a prefix of its tokens)
                assert c.token_ids == want[i][0][:len(c.token_ids)]
        _assert_idle(llm)
        assert _tok(llm.generate(prompts, sp, use_tqdm=False)) == want
        _done(counts)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("draft", [d for d in DRAFTS if d != "other"])
def test_abort_all_then_reuse_ids(draft, drafts, llama_dir, plain, prompts):
    """Every request aborted mid-stream (the chain's drafts of the step in flight then
    belong to no one), then the same ids again."""
    sp = _greedy(ignore_eos=True)
    want = _tok(plain().generate(prompts, sp, use_tqdm=False))
    llm, counts = _chain_llm(llama_dir, drafts, draft)
    eng = llm.llm_engine
    try:
        for rnd in range(3):
            for i, p in enumerate(prompts):
                eng.add_request(f"x{i}", {"prompt_token_ids": p}, sp)
            for _ in range(3 + rnd):
                eng.step()
            eng.abort_request([f"x{i}" for i in range(len(prompts))])
            for _ in range(4):
                eng.step()
            assert not eng.has_unfinished_requests()
            _assert_idle(llm)
        got: dict = {}
        for i, p in enumerate(prompts):
            eng.add_request(f"x{i}", {"prompt_token_ids": p}, sp)
        while eng.has_unfinished_requests():
            for ro in eng.step():
                if ro.finished:
                    got[ro.request_id] = ro.outputs[0].token_ids
        assert [[got[f"x{i}"]] for i in range(len(prompts))] == want
        _done(counts)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("draft", [d for d in DRAFTS if d != "other"])
def test_asyncllm_abort_mid_stream(draft, drafts, llama_dir, plain, prompts):
    from pyengine import AsyncLLM, EngineArgs
    from pyengine.sampling_params import RequestOutputKind

    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    want = _tok(plain().generate(prompts, _greedy(max_tokens=24, ignore_eos=True), use_tqdm=False))
    spec = {"method": "draft_model", "model": str(drafts[draft]), "num_speculative_tokens": K}
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(llama_dir), device="cpu", speculative_config=spec,
                                                  async_scheduling=True), multiprocess=False)
    try:
        core = engine.engine_core.engine_core
        core.model_runner.drafter.enable_draft_chain()

        def drain(c):
            toks, last = [], None
            while True:
                last = c.get(timeout=60)
                toks += last.outputs[0].token_ids
                if last.finished:
                    return toks, last.outputs[0].finish_reason

        for rnd in range(2):
            cs = {i: engine.add_request(f"q{rnd}-{i}", {"prompt_token_ids": p}, sp) for i, p in enumerate(prompts)}
            first = cs[1].get(timeout=60)
            engine.abort(f"q{rnd}-1")
            c0 = cs[0].get(timeout=60)
            engine.abort(f"q{rnd}-0")
            results = {i: drain(c) for i, c in cs.items()}
            assert results[1][1] == "abort" and results[0][1] in ("abort", "length")
            for i in (2, 3, 4):
                assert results[i] == (want[i][0], "length"), i
            got1 = first.outputs[0].token_ids + results[1][0]
            assert got1 == want[1][0][:len(got1)]
            got0 = c0.outputs[0].token_ids + results[0][0]
            assert got0 == want[0][0][:len(got0)]
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                st = engine.get_stats()
                if st.num_running == 0 and st.num_waiting == 0 and st.num_free_blocks == st.num_gpu_blocks:
                    break
                time.sleep(0.02)
            st = engine.get_stats()
            assert st.num_running == 0 and st.num_waiting == 0 and st.num_free_blocks == st.num_gpu_blocks, st
        assert not engine.errored
    finally:
        engine.shutdown()


@pytest.mark.parametrize("after", [1, 5])
@pytest.mark.parametrize("draft", [d for d in DRAFTS if d != "other"])
def test_one_failing_request_ends_only_itself(draft, after, drafts, llama_dir, plain, prompts, monkeypatch):
    sp = _greedy(ignore_eos=True)
    want = _tok(plain().generate(prompts, sp, use_tqdm=False))
    llm, counts = _chain_llm(llama_dir, drafts, draft)
    try:
        bad = 2
        fail_request_allocation(monkeypatch, llm.llm_engine.engine_core, prompts[bad], after_tokens=after)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        for i, o in enumerate(outs):
            c = o.outputs[0]
            if i == bad:
                assert c.finish_reason == "error" and "RuntimeError: injected" in (c.error or "")
                assert c.token_ids == want[i][0][:len(c.token_ids)]
            else:
                assert (c.token_ids, c.finish_reason) == (want[i][0], "length"), i
        _assert_idle(llm)
        monkeypatch.undo()
        assert _tok(llm.generate(prompts, sp, use_tqdm=False)) == want
        _done(counts)
    finally:
        llm.shutdown()


# ---- more: id reuse at once, bad words, allowed ids, constrained arrivals, long runs ---------

def _drive(eng, arrivals: dict, aborts: dict | None = None, limit: int = 500) -> dict:
    """Step ``eng`` (an LLMEngine): at step i add ``arrivals[i]`` ((id, prompt, params)...)
    and abort ``aborts[i]`` (ids), both before the step. Returns id -> the finished
    request's last CompletionOutput (the last one per id)."""
    aborts = aborts or {}
    got: dict = {}
    step = 0
    last = max(list(arrivals) + list(aborts) + [0])
    while step <= last or eng.has_unfinished_requests():
        if step in aborts:
            eng.abort_request(aborts[step])
        for rid, p, sp in arrivals.get(step, ()):
            eng.add_request(rid, {"prompt_token_ids": p}, sp)
        for ro in eng.step():
            if ro.finished:
                got[ro.request_id] = ro.outputs[0]
        step += 1
        assert step < limit
    return got


@pytest.mark.parametrize("gap", [0, 2])
@pytest.mark.parametrize("draft", [d for d in DRAFTS if d != "other"])
def test_aborted_ids_reused_at_once(draft, gap, drafts, llama_dir, plain, prompts):
    """Every request aborted mid-stream and its id added again ``gap`` steps later (0: in
    the same breath), while the aborted requests' chain drafts and verification may still
    be in flight: the new requests get the target's tokens, from the start."""
    sp = _greedy(ignore_eos=True)
    want = _tok(plain().generate(prompts, sp, use_tqdm=False))
    llm, counts = _chain_llm(llama_dir, drafts, draft)
    try:
        ids = [f"z{i}" for i in range(len(prompts))]
        first = [(r, p, sp) for r, p in zip(ids, prompts)]
        # (the second wave: the prompts rotated, so that a stale state of an id shows)
        rot = prompts[1:] + prompts[:1]
        second = [(r, p, sp) for r, p in zip(ids, rot)]
        got = _drive(llm.llm_engine, {0: first, 5 + gap: second}, {5: ids})
        want_rot = want[1:] + want[:1]
        assert [got[r].token_ids for r in ids] == [w[0] for w in want_rot]
        _done(counts)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("draft", [d for d in DRAFTS if d != "other"])
def test_seeded_ids_reused_at_once_device_vs_host(draft, drafts, llama_dir, prompts):
    sp = SamplingParams(temperature=0.9, seed=17, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = {}
    for device in (False, True):
        llm, counts = _chain_llm(llama_dir, drafts, draft)
        llm.llm_engine.engine_core.model_runner.drafter.device_drafts = device
        ids = [f"z{i}" for i in range(len(prompts))]
        waves = {0: [(r, p, sp if i % 2 else _greedy(ignore_eos=True)) for i, (r, p) in enumerate(zip(ids, prompts))],
                 6: [(r, p, sp) for r, p in zip(ids[::2], prompts[::-1])]}
        got = _drive(llm.llm_engine, waves, {6: ids[::2]})
        outs[device] = {r: c.token_ids for r, c in got.items()}
        _assert_idle(llm)
        llm.shutdown()
    assert outs[False] == outs[True]


@pytest.mark.parametrize("draft", [d for d in DRAFTS if d != "other"])
def test_seeded_rows_under_preemption_device_vs_host(draft, drafts, llama_dir, prompts):
    """Seeded random rows preempted and resumed (their generators rewound by the draws the
    engine discarded): the chain's device drafts give what host drafts give."""
    kw = {"num_gpu_blocks_override": 7, "max_model_len": 96}
    sps = [SamplingParams(temperature=0.8, seed=i, max_tokens=24, ignore_eos=True) if i % 2 else
           _greedy(max_tokens=24, ignore_eos=True) for i in range(len(prompts))]
    outs = {}
    for device in (False, True):
        llm, counts = _chain_llm(llama_dir, drafts, draft, **kw)
        llm.llm_engine.engine_core.model_runner.drafter.device_drafts = device
        outs[device] = _tok(llm.generate(prompts, sps, use_tqdm=False))
        assert llm.llm_engine.get_stats().num_preemptions > 0
        _assert_idle(llm)
        llm.shutdown()
        assert (counts.device > 0) == device
    assert outs[False] == outs[True]


@pytest.mark.parametrize("draft", DRAFTS)
def test_bad_words_and_allowed_ids_next_to_greedy_rows(draft, drafts, llama_dir, plain, prompts, tokenizer):
    ref = _tok(plain().generate(prompts, _greedy(ignore_eos=True), use_tqdm=False))
    word = tokenizer.decode([ref[1][0][4]]).strip() or "the"
    allowed = sorted(set(ref[3][0][:6]) | set(range(5, 60)))
    sps = [_greedy(ignore_eos=True), _greedy(ignore_eos=True, bad_words=[word]), _greedy(ignore_eos=True),
           _greedy(ignore_eos=True, allowed_token_ids=allowed), _greedy(ignore_eos=True, min_p=0.2)]
    want = plain().generate(prompts, sps, use_tqdm=False)
    llm, counts = _chain_llm(llama_dir, drafts, draft)
    counts.exact = False  # (the draft knows no bans)
    try:
        assert _summary(llm.generate(prompts, sps, use_tqdm=False)) == _summary(want)
        _done(counts)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("draft", DRAFTS)
def test_constrained_request_arrives_and_leaves_mid_stream(draft, drafts, llama_dir, plain, prompts):
    """Chain steps, then a constrained request joins (the chain does not fit: drafts by
    depth, none for it) and leaves again; and one aborted mid-stream."""
    so = StructuredOutputsParams(regex="[a-z]{2,6}")
    c_sp = SamplingParams(temperature=0, max_tokens=10, structured_outputs=so)
    sp = _greedy(max_tokens=30, ignore_eos=True)
    ps = prompts[:3]
    want = _tok(plain().generate(ps, sp, use_tqdm=False))
    want_c = plain().generate([prompts[3]], c_sp, use_tqdm=False)[0].outputs[0].token_ids
    llm, counts = _chain_llm(llama_dir, drafts, draft)
    try:
        waves = {0: [(f"g{i}", p, sp) for i, p in enumerate(ps)], 4: [("c0", prompts[3], c_sp)],
                 7: [("c1", prompts[3], c_sp)]}
        got = _drive(llm.llm_engine, waves, {9: ["c1"]})
        assert [[got[f"g{i}"].token_ids] for i in range(len(ps))] == want
        assert got["c0"].token_ids == want_c
        c1 = got.get("c1")
        assert c1 is None or c1.token_ids == want_c[:len(c1.token_ids)]
        _done(counts)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("draft", DRAFTS)
def test_long_runs_with_preemption_and_prefix_hits(draft, drafts, llama_dir, plain, prompts):
    """Longer outputs (up to the context length) under a small KV cache, the same prompts
    twice (cache hits on blocks the chain's drafts wrote past), max_tokens None."""
    kw = {"num_gpu_blocks_override": 9, "max_model_len": 96}
    ps = [p[:24] for p in prompts] + [prompts[0][:24]]
    sps = [SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)] + \
        [_greedy(max_tokens=40 + 5 * i, ignore_eos=True) for i in range(len(ps) - 1)]
    want = _summary(plain(**kw).generate(ps, sps, use_tqdm=False))
    llm, counts = _chain_llm(llama_dir, drafts, draft, **kw)
    try:
        assert _summary(llm.generate(ps, sps, use_tqdm=False)) == want
        assert _summary(llm.generate(ps, sps, use_tqdm=False)) == want
        _done(counts)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("draft", [d for d in DRAFTS if d != "other"])
def test_a_prompt_of_max_model_len_minus_one(draft, drafts, llama_dir, plain, prompts, tokenizer):
    kw = {"max_model_len": 40}
    ps = prompt_token_ids(tokenizer, 2, min_len=39, max_len=39, seed=2) + [p[:20] for p in prompts[:3]] + \
        prompt_token_ids(tokenizer, 1, min_len=36, max_len=36, seed=3)
    sp = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    want = _summary(plain(**kw).generate(ps, sp, use_tqdm=False))
    llm, counts = _chain_llm(llama_dir, drafts, draft, **kw)
    try:
        assert _summary(llm.generate(ps, sp, use_tqdm=False)) == want
        _done(counts)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("draft", [d for d in DRAFTS if d != "other"])
def test_n_greedy_children_share_a_prompt(draft, drafts, llama_dir, plain, prompts):
    """n = 3 children of one prompt (top_k=1: greedy through the random path), with other
    requests, all drafting through the chain at once."""
    sps = [SamplingParams(temperature=1.0, top_k=1, n=3, max_tokens=MAX_TOKENS, ignore_eos=True, seed=4)] + \
        [_greedy(ignore_eos=True)] * (len(prompts) - 1)
    want = plain().generate(prompts, sps, use_tqdm=False)
    llm, counts = _chain_llm(llama_dir, drafts, draft)
    try:
        assert _summary(llm.generate(prompts, sps, use_tqdm=False)) == _summary(want)
        _done(counts)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("draft", [d for d in DRAFTS if d != "other"])
def test_chain_sizes_every_batch_size(draft, drafts, llama_dir, plain, tokenizer):
    """Batches of 1..33 requests in steady state (every capture size, padded rows, and one
    over the top)."""
    ps = prompt_token_ids(tokenizer, 33, min_len=2, max_len=10, seed=12)
    llm, counts = _chain_llm(llama_dir, drafts, draft)
    sizes = []
    chain = llm.llm_engine.engine_core.model_runner.drafter._chain
    run, run_verified = chain.run, chain.run_verified
    chain.run = lambda plan: sizes.append(len(plan.seqs)) or run(plan)
    # (the chain launched straight after a verification, before its result is on the host)
    chain.run_verified = lambda reqs, *a: sizes.append(len(reqs)) or run_verified(reqs, *a)
    try:
        for n in (1, 2, 3, 5, 8, 13, 17, 31, 32, 33):
            sp = _greedy(max_tokens=12, ignore_eos=True)
            assert _tok(llm.generate(ps[:n], sp, use_tqdm=False)) == _tok(plain().generate(ps[:n], sp, use_tqdm=False)), n
        assert {1, 2, 3, 5, 8, 13, 17, 31, 32} <= set(sizes) and 33 not in sizes
        _done(counts)
    finally:
        llm.shutdown()


# ---- engine shapes: k, block size, max_num_seqs, no prefix caching; an abort storm ----------

@pytest.mark.parametrize("k", [1, 5])
@pytest.mark.parametrize("draft", DRAFTS)
def test_other_numbers_of_speculative_tokens(draft, k, drafts, llama_dir, plain, prompts):
    # (the chain takes a step only where every request drafts k: long, even ends)
    sps = [_greedy(max_tokens=n, ignore_eos=True) for n in (2, 30, 36, 30, 36)]
    want = _summary(plain().generate(prompts, sps, use_tqdm=False))
    llm, counts = _chain_llm(llama_dir, drafts, draft, spec_extra={"num_speculative_tokens": k})
    try:
        assert _summary(llm.generate(prompts, sps, use_tqdm=False)) == want
        _done(counts)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("mode", [{"block_size": 8}, {"block_size": 32}, {"enable_prefix_caching": False},
                                  {"max_num_seqs": 2}, {"max_num_seqs": 1},
                                  {"block_size": 8, "num_gpu_blocks_override": 14, "max_model_len": 96}],
                         ids=["bs8", "bs32", "no_prefix_caching", "seqs2", "seqs1", "bs8_preempt"])
@pytest.mark.parametrize("draft", [d for d in DRAFTS if d != "other"])
def test_engine_shapes(draft, mode, drafts, llama_dir, plain, prompts):
    sp = _greedy(max_tokens=24, ignore_eos=True)
    want = _summary(plain(**mode).generate(prompts, sp, use_tqdm=False))
    llm, counts = _chain_llm(llama_dir, drafts, draft, **mode)
    try:
        assert _summary(llm.generate(prompts, sp, use_tqdm=False)) == want
        _done(counts)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("draft", [d for d in DRAFTS if d != "other"])
def test_asyncllm_abort_storm(draft, drafts, llama_dir, plain, tokenizer):
    """Many greedy requests into an in-process AsyncLLM, half of them aborted at random
    moments: every one not aborted gets the target's tokens; the engine ends idle."""
    import random

    from pyengine import AsyncLLM, EngineArgs

    rng = random.Random(0)
    ps = prompt_token_ids(tokenizer, 40, 2, 30, seed=9)
    sps = [_greedy(max_tokens=rng.randint(1, 30), ignore_eos=True) for _ in ps]
    want = _tok(plain(max_model_len=256, num_gpu_blocks_override=64).generate(ps, sps, use_tqdm=False))
    spec = {"method": "draft_model", "model": str(drafts[draft]), "num_speculative_tokens": K}
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(llama_dir), device="cpu", speculative_config=spec,
                                                  max_model_len=256, num_gpu_blocks_override=64,
                                                  async_scheduling=True), multiprocess=False)
    try:
        engine.engine_core.engine_core.model_runner.drafter.enable_draft_chain()
        collectors, aborted = {}, set()
        for i, p in enumerate(ps):
            collectors[i] = engine.add_request(f"s{i}", {"prompt_token_ids": p}, sps[i])
            if rng.random() < 0.5:
                v = rng.randint(0, i)
                engine.abort(f"s{v}")
                aborted.add(v)
            if rng.random() < 0.3:
                time.sleep(0.01)
        for i, c in collectors.items():
            while True:
                out = c.get(timeout=60)
                if out.finished:
                    break
            o = out.outputs[0]
            if i in aborted and o.finish_reason == "abort":
                assert o.token_ids == want[i][0][:len(o.token_ids)], i
            else:
                assert (o.token_ids, o.finish_reason) == (want[i][0], "length"), i
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            st = engine.get_stats()
            if st.num_running == 0 and st.num_waiting == 0 and st.num_free_blocks == st.num_gpu_blocks:
                break
            time.sleep(0.02)
        st = engine.get_stats()
        assert st.num_running == 0 and st.num_waiting == 0 and st.num_free_blocks == st.num_gpu_blocks, st
        assert not engine.errored
    finally:
        engine.shutdown()


# ---- more failures and outputs: a grammar that fails to compile mid-stream, logprobs at stops --

@pytest.mark.parametrize("draft", [d for d in DRAFTS if d != "other"])
def test_compile_failure_mid_stream_ends_only_that_request(draft, drafts, llama_dir, plain, prompts, monkeypatch):
    from pyengine.structured_output.backend_xgrammar import XgrammarBackend

    orig = XgrammarBackend.compile

    def compile_(self, so):
        if so.kind == "regex":
            raise ValueError("boom in compile")
        return orig(self, so)

    monkeypatch.setattr(XgrammarBackend, "compile", compile_)
    sp = _greedy(max_tokens=30, ignore_eos=True)
    want = _tok(plain().generate(prompts[:3], sp, use_tqdm=False))
    bad = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="a+"))
    good = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["x", "yy"]))
    llm, counts = _chain_llm(llama_dir, drafts, draft)
    try:
        waves = {0: [(f"g{i}", p, sp) for i, p in enumerate(prompts[:3])], 4: [("bad", prompts[3], bad)],
                 6: [("good", prompts[4], good)], 8: [("bad2", prompts[4], bad)]}
        got = _drive(llm.llm_engine, waves)
        assert [[got[f"g{i}"].token_ids] for i in range(3)] == want
        for r in ("bad", "bad2"):
            assert got[r].finish_reason == "error" and "boom in compile" in (got[r].error or "")
        assert got["good"].text in ("x", "yy")
        _done(counts)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("draft", DRAFTS)
def test_logprobs_where_a_stop_cuts_an_accepted_run(draft, drafts, llama_dir, plain, prompts):
    ref_llm = plain()
    ref = _tok(ref_llm.generate(prompts, _greedy(ignore_eos=True), use_tqdm=False))
    texts = [o.outputs[0].text for o in ref_llm.generate(prompts, _greedy(ignore_eos=True), use_tqdm=False)]
    llm, counts = _chain_llm(llama_dir, drafts, draft)
    try:
        for j in (2, 5, 9):
            sps = [_greedy(stop_token_ids=[ref[0][0][j]], logprobs=2),
                   _greedy(stop=[texts[1][len(texts[1]) // 2:len(texts[1]) // 2 + 2]], logprobs=1),
                   _greedy(max_tokens=j, logprobs=0, ignore_eos=True),
                   _greedy(stop_token_ids=[ref[3][0][j]], logprobs=1, detokenize=False),
                   _greedy(max_tokens=j + 1, logprobs=3, ignore_eos=True)]
            want = ref_llm.generate(prompts, sps, use_tqdm=False)
            got = llm.generate(prompts, sps, use_tqdm=False)
            assert _summary(got) == _summary(want), j
            for w, g in zip(want, got):
                cw, cg = w.outputs[0], g.outputs[0]
                assert len(cg.logprobs) == len(cg.token_ids) == len(cw.logprobs)
                for dw, dg in zip(cw.logprobs, cg.logprobs):
                    assert list(dw) == list(dg)
                    for t in dw:
                        assert dg[t].logprob == pytest.approx(dw[t].logprob, abs=1e-4)
                assert cg.cumulative_logprob == pytest.approx(cw.cumulative_logprob, abs=1e-3)
        _done(counts)
    finally:
        llm.shutdown()


# ---- the draft's KV behind a prefix-cache hit ------------------------------------------------

def _delta(llm, fn):
    a = llm.llm_engine.get_stats()
    out = fn()
    b = llm.llm_engine.get_stats()
    return out, (b.prefix_cache_hits - a.prefix_cache_hits, b.spec_num_draft_tokens - a.spec_num_draft_tokens,
                 b.spec_num_accepted_tokens - a.spec_num_accepted_tokens)


@pytest.mark.parametrize("chain", [False, True])
def test_prefix_hit_on_blocks_computed_without_speculation(chain, drafts, llama_dir, plain, tokenizer):
    """disable_by_batch_size=2: two requests decode without speculation, so the draft
    never writes its KV for their generated tokens; then a prompt that extends one of
    their outputs hits those cached blocks. The proposer trusts the draft KV behind any
    prefix-cache hit (``v = num_cached_tokens`` at epoch 0), so the target drafting for
    itself should still have every draft accepted. (Output stays the target's either way:
    the verification guards it; what breaks is the acceptance.)"""
    ps = prompt_token_ids(tokenizer, 2, min_len=20, max_len=20, seed=3)
    sp = _greedy(max_tokens=40, ignore_eos=True)
    if chain:
        llm, counts = _chain_llm(llama_dir, drafts, "self", spec_extra={"disable_by_batch_size": 2})
    else:
        spec = {"method": "draft_model", "model": str(llama_dir), "num_speculative_tokens": K,
                "disable_by_batch_size": 2}
        llm = LLM(str(llama_dir), device="cpu", speculative_config=spec, async_scheduling=True)
    try:
        outs = llm.generate(ps, sp, use_tqdm=False)
        longer = [ps[0] + outs[0].outputs[0].token_ids]
        sp2 = _greedy(max_tokens=20, ignore_eos=True)
        got, (hits, drafted, accepted) = _delta(llm, lambda: llm.generate(longer, sp2, use_tqdm=False))
        assert _tok(got) == _tok(plain().generate(longer, sp2, use_tqdm=False))  # (holds)
        assert hits > 0 and drafted > 0
        assert accepted == drafted, f"{accepted} of {drafted} drafts accepted after a {hits}-token prefix hit"
    finally:
        llm.shutdown()


def test_prefix_hit_on_a_prompt_prefilled_without_speculation(drafts, llama_dir, plain, tokenizer):
    """The same with a prompt: prefilled in a step without speculation (two requests
    already running, disable_by_batch_size=2) by a request that finishes before any step
    speculates again; later requests sharing that prompt run alone (speculating) and hit
    its cached blocks, whose draft KV was never written (and is never rewritten: every
    later hit trusts it again)."""
    a, b = prompt_token_ids(tokenizer, 2, min_len=6, max_len=6, seed=13)
    shared = prompt_token_ids(tokenizer, 1, min_len=40, max_len=40, seed=14)[0]
    llm, counts = _chain_llm(llama_dir, drafts, "self", spec_extra={"disable_by_batch_size": 2})
    try:
        sp_bg = _greedy(max_tokens=12, ignore_eos=True)
        _drive(llm.llm_engine, {0: [("a", a, sp_bg), ("b", b, sp_bg)],
                                3: [("c", shared, _greedy(max_tokens=4, ignore_eos=True))]})
        sp = _greedy(max_tokens=30, ignore_eos=True)
        for i in range(2):
            later = [shared + [5 + i]]
            got, (hits, drafted, accepted) = _delta(llm, lambda later=later: llm.generate(later, sp, use_tqdm=False))
            assert _tok(got) == _tok(plain().generate(later, sp, use_tqdm=False))  # (holds)
            assert hits > 0 and drafted > 0
            assert accepted == drafted, f"later request {i}: {accepted} of {drafted} drafts accepted after a {hits}-token hit"
    finally:
        llm.shutdown()


# ---- a fuzz of everything at once -------------------------------------------------------------

@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("seed", range(int(os.environ.get("PROBE_FUZZ_SEEDS", "2"))))
def test_fuzz_arrivals_aborts_cut_chunking_preemption(seed, caching, drafts, llama_dir, plain, tokenizer):
    """Random arrivals and aborts between steps, random max_tokens (1..30), a random
    disable_by_batch_size, a token budget that chunks prefills and cuts drafts, a KV cache
    small enough to preempt; prefix caching off or on (prompts share prefixes then). Every
    request not aborted gets the target's tokens; the target drafting for itself has every
    draft accepted (prefix caching with a cut excepted: test_prefix_hit_on_* above)."""
    import random

    rng = random.Random(seed)
    draft = ["self", "near"][seed % 2]
    kw = {"enable_prefix_caching": caching, "max_model_len": 96,
          "num_gpu_blocks_override": rng.choice([8, 12, 20, 40]), "max_num_batched_tokens": rng.choice([16, 24, 96])}
    cut = rng.choice([None, 2, 3, 5])
    n = 24
    ps = prompt_token_ids(tokenizer, n, min_len=2, max_len=40, seed=100 + seed)
    if caching:  # shared prefixes: a third of the prompts extend another's
        ps = [ps[i] if i % 3 or i == 0 else ps[i - 1] + ps[i][:rng.randint(1, 8)] for i in range(n)]
    sps = [_greedy(max_tokens=rng.randint(1, 30), ignore_eos=True) for _ in ps]
    want = _tok(plain(**kw).generate(ps, sps, use_tqdm=False))
    arrivals: dict = {}
    aborts: dict = {}
    aborted = set()
    for i in range(n):
        arrivals.setdefault(rng.randint(0, 40), []).append((f"f{i}", ps[i], sps[i]))
    for i in rng.sample(range(n), 5):
        aborts.setdefault(rng.randint(1, 50), []).append(f"f{i}")
        aborted.add(i)
    llm, counts = _chain_llm(llama_dir, drafts, draft, spec_extra={"disable_by_batch_size": cut} if cut else None, **kw)
    try:
        got = _drive(llm.llm_engine, arrivals, aborts, limit=2000)
        for i in range(n):
            c = got.get(f"f{i}")
            if i in aborted:
                assert c is None or c.token_ids == want[i][0][:len(c.token_ids)], i
            else:
                assert c is not None and c.token_ids == want[i][0], (i, kw, cut)
        _assert_idle(llm)
        print(f"fuzz {seed}: {counts.device} device rows, {counts.host} host rows, {kw}, cut {cut}")
        if counts.exact and not (caching and cut):
            st = llm.llm_engine.get_stats()
            assert st.spec_num_accepted_tokens == st.spec_num_draft_tokens
    finally:
        llm.shutdown()


@pytest.mark.parametrize("seed", range(int(os.environ.get("PROBE_FUZZ_SEEDS", "2"))))
def test_fuzz_seeded_rows_device_vs_host(seed, drafts, llama_dir, tokenizer):
    """The fuzz above with seeded random rows (and penalties, logprobs, n = 2) mixed in:
    the chain engine gives the same tokens with device drafts as with host drafts."""
    import random

    rng = random.Random(1000 + seed)
    draft = DRAFTS[seed % len(DRAFTS)]
    kw = {"max_model_len": 96, "num_gpu_blocks_override": rng.choice([8, 12, 40]),
          "max_num_batched_tokens": rng.choice([16, 24, 96])}
    cut = rng.choice([None, 3])
    n = 16
    ps = prompt_token_ids(tokenizer, n, min_len=2, max_len=40, seed=200 + seed)

    def params():
        mt = rng.randint(1, 30)
        kind = rng.random()
        if kind < 0.4:
            return _greedy(max_tokens=mt, ignore_eos=True)
        extra = {}
        if rng.random() < 0.3:
            extra["logprobs"] = 1
        if rng.random() < 0.2:
            extra["repetition_penalty"] = 1.2
        if rng.random() < 0.2:
            extra["n"] = 2
        return SamplingParams(temperature=rng.choice([0.5, 1.0]), top_k=rng.choice([0, 20]), seed=rng.randint(0, 99),
                              max_tokens=mt, ignore_eos=True, **extra)
    sps = [params() for _ in ps]
    arrivals: dict = {}
    for i in range(n):
        arrivals.setdefault(rng.randint(0, 30), []).append((f"f{i}", ps[i], sps[i]))
    aborts = {rng.randint(1, 40): [f"f{i}"] for i in rng.sample(range(n), 3)}
    outs = {}
    for device in (False, True):
        llm, counts = _chain_llm(llama_dir, drafts, draft, spec_extra={"disable_by_batch_size": cut} if cut else None,
                                 **kw)
        llm.llm_engine.engine_core.model_runner.drafter.device_drafts = device
        try:
            got = _drive(llm.llm_engine, arrivals, aborts, limit=2000)
            outs[device] = {r: (c.token_ids, c.finish_reason) for r, c in got.items()}
            _assert_idle(llm)
        finally:
            llm.shutdown()
    assert outs[False] == outs[True]
