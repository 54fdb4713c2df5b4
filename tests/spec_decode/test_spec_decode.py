"""Speculative decoding end to end (LLM on tiny random models, CPU), with sync and with
async scheduling: greedy output with speculation on is token-identical to off for every
proposer (ngram, a draft model, the target as its own draft, an untrained EAGLE-3 head)
under prefix caching, chunked prefill, preemption, priority; scripted proposers give
100% / 0% acceptance with the same output; stop tokens, stop strings, max_tokens,
logprobs, n > 1, structured outputs, disable_by_batch_size; no KV block leaks. Async:
the next step is scheduled with draft placeholders before this one is verified."""
from __future__ import annotations

import pytest

from pyengine import LLM, SamplingParams, StructuredOutputsParams
from pyengine.spec_decode import TokenProposer
from pyengine.spec_decode.base import DraftRow
from tests.helpers import build_tiny_eagle3, build_tiny_model, prompt_token_ids

MAX_TOKENS = 12
K = 3


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, tokenizer_dir):
    return build_tiny_model(tmp_path_factory.mktemp("draft"), "llama", tokenizer_dir, seed=5, num_hidden_layers=1)


@pytest.fixture(scope="module")
def eagle_dir(tmp_path_factory, llama_dir):
    return build_tiny_eagle3(tmp_path_factory.mktemp("eagle3"), llama_dir, seed=3, draft_vocab_size=300)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    base = prompt_token_ids(tokenizer, 6, min_len=4, max_len=30, seed=0)
    shared = prompt_token_ids(tokenizer, 1, 36, 36, seed=1)[0]
    # repeats for the n-gram lookup to find, and a shared 36-token prefix for the prefix cache
    return [base[0] * 3, base[1] + base[1], shared + base[3][:5], shared + base[4][:5]]


SCHED = ["sync", "async"]


def _llm(model_dir, spec=None, sched="sync", **kw):
    llm = LLM(str(model_dir), device="cpu", async_scheduling=sched == "async", speculative_config=spec, **kw)
    assert llm.llm_engine.engine_core.config.async_scheduling == (sched == "async")
    return llm


def _greedy(**kw):
    return SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", MAX_TOKENS), **kw)


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def _assert_no_leak(llm):
    st = llm.llm_engine.get_stats()
    assert st.num_running == 0 and st.num_waiting == 0
    assert st.num_free_blocks == st.num_gpu_blocks, "KV blocks leaked"


@pytest.fixture(scope="module")
def off(llama_dir):
    llm = _llm(llama_dir)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def reference(off, prompts):
    return _tokens(off.generate(prompts, _greedy(), use_tqdm=False))


def _spec(method, draft_dir, eagle_dir, llama_dir):
    return {"ngram": {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
            "draft_model": {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": K},
            "draft_self": {"method": "draft_model", "model": str(llama_dir), "num_speculative_tokens": K},
            "eagle3": {"method": "eagle3", "model": str(eagle_dir), "num_speculative_tokens": K}}[method]


MODES = {
    "default": {},
    "no_prefix_caching": {"enable_prefix_caching": False},
    "chunked_prefill": {"max_num_batched_tokens": 16},
    "preemption": {"num_gpu_blocks_override": 6, "max_model_len": 96, "max_num_batched_tokens": 96},
    "priority": {"scheduling_policy": "priority"},
}
CASES = [("ngram", mode) for mode in MODES] + [("draft_self", "default"), ("draft_self", "preemption"),
                                               ("draft_model", "chunked_prefill"), ("eagle3", "default"),
                                               ("eagle3", "preemption")]
ASYNC_ONLY = [("draft_model", "default"), ("draft_self", "chunked_prefill"), ("draft_self", "priority"),
              ("eagle3", "chunked_prefill"), ("eagle3", "no_prefix_caching")]


@pytest.mark.parametrize("method,mode,sched", [(m, d, s) for s in SCHED for m, d in CASES]
                         + [(m, d, "async") for m, d in ASYNC_ONLY])
def test_greedy_on_equals_off(method, mode, sched, llama_dir, draft_dir, eagle_dir, prompts, reference):
    llm = _llm(llama_dir, _spec(method, draft_dir, eagle_dir, llama_dir), sched, **MODES[mode])
    prio = list(range(len(prompts), 0, -1)) if mode == "priority" else None
    got = _tokens(llm.generate(prompts, _greedy(), use_tqdm=False, priority=prio))
    assert got == reference
    st = llm.llm_engine.get_stats()
    assert st.spec_num_drafts > 0 and st.spec_num_draft_tokens >= st.spec_num_drafts
    assert sum(st.spec_accepted_per_pos) == st.spec_num_accepted_tokens
    if method == "draft_self":  # the target drafting for itself: every draft is its own greedy token
        assert st.spec_num_accepted_tokens == st.spec_num_draft_tokens
    if mode == "preemption":
        assert st.num_preemptions > 0
    _assert_no_leak(llm)
    llm.shutdown()


@pytest.mark.parametrize("method,mode", [("draft_model", m) for m in MODES] + [("draft_self", "preemption")])
def test_greedy_on_equals_off_with_device_drafts(method, mode, llama_dir, draft_dir, eagle_dir, prompts, reference):
    """Async scheduling with the draft chain (run eagerly here; CUDA graphs on a GPU): its
    drafts stay on the device (``DraftRow``) and the next step gathers them there, in
    every mode."""
    llm = _llm(llama_dir, _spec(method, draft_dir, eagle_dir, llama_dir), "async", **MODES[mode])
    drafter = llm.llm_engine.engine_core.model_runner.drafter
    drafter.enable_draft_chain()
    device_rows = []
    propose = drafter.propose

    def counted(*a):
        out = propose(*a)
        device_rows.extend(d for d in out if isinstance(d, DraftRow))
        return out
    drafter.propose = counted
    prio = list(range(len(prompts), 0, -1)) if mode == "priority" else None
    got = _tokens(llm.generate(prompts, _greedy(), use_tqdm=False, priority=prio))
    assert got == reference
    assert device_rows
    st = llm.llm_engine.get_stats()
    if method == "draft_self":
        assert st.spec_num_accepted_tokens == st.spec_num_draft_tokens
    if mode == "preemption":
        assert st.num_preemptions > 0
    _assert_no_leak(llm)
    llm.shutdown()


@pytest.mark.parametrize("method,sched", [("ngram", "async"), ("draft_model", "sync"), ("draft_self", "async")])
def test_verification_padded_to_the_graph_query_length(method, sched, llama_dir, draft_dir, eagle_dir, prompts,
                                                        reference):
    """A speculative step whose requests carry fewer than k drafts (the end of max_tokens,
    an n-gram that found fewer) is packed with every request padded to 1 + k rows (what
    the verify CUDA graph replays; forced here on the CPU), and the draft chain drafts
    for requests with fewer than k drafts' room: the same greedy tokens, every draft of
    the target drafting for itself accepted."""
    llm = _llm(llama_dir, _spec(method, draft_dir, eagle_dir, llama_dir), sched)
    runner = llm.llm_engine.engine_core.model_runner
    runner.verify_pad_q = K + 1
    padded, short_chain = [], []
    prepare = runner._prepare_inputs

    def counted(so):
        out = prepare(so)
        if out[2].num_actual_tokens > so.total_num_scheduled_tokens:
            padded.append(out[2].num_actual_tokens)
        return out
    runner._prepare_inputs = counted
    if method != "ngram" and sched == "async":
        drafter = runner.drafter
        drafter.enable_draft_chain()
        propose = drafter.propose

        def proposing(so, sampled, generated, hidden):
            out = propose(so, sampled, generated, hidden)
            # the chain's drafts (launched before or after the result) kept short by the room
            if any(isinstance(d, DraftRow) and 0 < len(d) < K for d in out):
                short_chain.append(out)
            return out
        drafter.propose = proposing
    got = _tokens(llm.generate(prompts, _greedy(), use_tqdm=False))
    assert got == reference
    assert padded and all(n % (K + 1) == 0 for n in padded)
    st = llm.llm_engine.get_stats()
    if method == "draft_self":
        assert st.spec_num_accepted_tokens == st.spec_num_draft_tokens
        assert short_chain
    _assert_no_leak(llm)
    llm.shutdown()


@pytest.mark.parametrize("method,sched", [("ngram", "sync"), ("draft_model", "async")])
def test_padded_verification_and_chain_at_max_model_len(method, sched, llama_dir, draft_dir, eagle_dir, prompts):
    """Requests that run into max_model_len (their room for drafts shrinking to 0) with the
    padding forced and (draft models) the chain: the target's tokens, up to the same end;
    the chain's positions past max_model_len are clamped, nothing written there."""
    max_len = max(len(p) for p in prompts) + 6
    sp = [_greedy(max_tokens=max_len - len(p)) for p in prompts]  # (each prompt's whole room: vLLM refuses more)
    off = _llm(llama_dir, None, sched, max_model_len=max_len)
    want = _tokens(off.generate(prompts, sp, use_tqdm=False))
    off.shutdown()
    k = 5  # (past K: a chain's depths reach past max_model_len - 1 before its room ends)
    spec = {**_spec(method, draft_dir, eagle_dir, llama_dir), "num_speculative_tokens": k}
    llm = _llm(llama_dir, spec, sched, max_model_len=max_len)
    runner = llm.llm_engine.engine_core.model_runner
    runner.verify_pad_q = k + 1
    seen: list[int] = []
    if method != "ngram":
        runner.drafter.enable_draft_chain()
        chain = runner.drafter._chain
        model = chain.model

        class Recording:  # the positions the chain's forwards feed (RoPE's table ends at max_model_len)
            def __call__(self, ids, pos, meta):
                seen.append(int(pos.max()))
                return model(ids, pos, meta)

            def compute_greedy(self, h):
                return model.compute_greedy(h)
        chain.model = Recording()
    # one request at a time (the chain takes a step only when every request in it drafts)
    got = [_tokens(llm.generate([p], s, use_tqdm=False))[0] for p, s in zip(prompts, sp)]
    assert got == want
    assert all(len(p) + len(t[0]) == max_len for p, t in zip(prompts, want))
    if method != "ngram":
        assert seen and max(seen) == max_len - 1
    _assert_no_leak(llm)
    llm.shutdown()


def test_logprobs_and_n_with_device_drafts(llama_dir, draft_dir, off, prompts):
    """n > 1 with logprobs (random rows: their verification takes the drafts from the host
    copy) next to greedy rows (device drafts), async scheduling with the draft chain."""
    llm = _llm(llama_dir, _spec("draft_self", draft_dir, None, llama_dir), "async")
    llm.llm_engine.engine_core.model_runner.drafter.enable_draft_chain()
    sps = [SamplingParams(temperature=0.7, top_k=1, max_tokens=MAX_TOKENS, logprobs=2, n=2)] + \
        [_greedy(logprobs=1)] * (len(prompts) - 1)
    want, got = off.generate(prompts, sps, use_tqdm=False), llm.generate(prompts, sps, use_tqdm=False)
    assert _tokens(got) == _tokens(want)
    for w, g in zip(want, got):
        for cw, cg in zip(w.outputs, g.outputs):
            assert [list(d) for d in cg.logprobs] == [list(d) for d in cw.logprobs]
    assert llm.llm_engine.get_stats().spec_num_accepted_tokens > 0
    _assert_no_leak(llm)
    llm.shutdown()


@pytest.mark.parametrize("sched", SCHED)
def test_prefix_hit_on_blocks_computed_without_speculation(sched, llama_dir, off, tokenizer):
    """Two requests decode without speculation (disable_by_batch_size=2), so the draft
    writes no KV for their outputs; a prompt extending one of them then hits those cached
    blocks. The draft must not trust KV it never wrote: the target drafting for itself has
    every draft accepted (trusting it left 5 of 32 accepted; the output held either way)."""
    spec = {**_spec("draft_self", None, None, llama_dir), "disable_by_batch_size": 2}
    llm = _llm(llama_dir, spec, sched)
    ps = prompt_token_ids(tokenizer, 2, min_len=20, max_len=20, seed=3)
    outs = llm.generate(ps, _greedy(max_tokens=40, ignore_eos=True), use_tqdm=False)
    longer = [ps[0] + outs[0].outputs[0].token_ids]
    sp = _greedy(max_tokens=20, ignore_eos=True)
    a = llm.llm_engine.get_stats()
    got = llm.generate(longer, sp, use_tqdm=False)
    b = llm.llm_engine.get_stats()
    assert _tokens(got) == _tokens(off.generate(longer, sp, use_tqdm=False))
    assert b.prefix_cache_hits > a.prefix_cache_hits
    drafted = b.spec_num_draft_tokens - a.spec_num_draft_tokens
    assert drafted > 0 and b.spec_num_accepted_tokens - a.spec_num_accepted_tokens == drafted
    _assert_no_leak(llm)
    llm.shutdown()


class Scripted(TokenProposer):
    """Drafts the reference continuation (``right``) or a token that is never it."""

    def __init__(self, spec, max_model_len, refs, right, vocab):
        super().__init__(spec, max_model_len)
        self.refs, self.right, self.vocab = refs, right, vocab

    def draft(self, request, context, k):
        ref = self.refs.get(tuple(request.prompt_token_ids))
        if ref is None:  # a prompt without a reference: any drafts
            return [0] * k
        done = len(context) - request.num_prompt_tokens
        nxt = ref[done:done + k]
        return nxt if self.right else [(t + 1) % self.vocab for t in nxt]


@pytest.fixture(scope="module", params=SCHED)
def scripted(request, llama_dir, prompts, reference):
    llm = _llm(llama_dir, {"method": "ngram", "num_speculative_tokens": K}, request.param)
    runner = llm.llm_engine.engine_core.model_runner
    refs = {tuple(p): r[0] for p, r in zip(prompts, reference)}

    def use(right):
        runner.drafter = Scripted(runner.spec_config, llm.llm_engine.engine_core.config.max_model_len, refs, right,
                                  runner.dims.vocab_size)
        return llm
    yield use
    llm.shutdown()


def _delta(llm, fn):
    a = llm.llm_engine.get_stats()
    out = fn()
    b = llm.llm_engine.get_stats()
    return out, (b.spec_num_drafts - a.spec_num_drafts, b.spec_num_draft_tokens - a.spec_num_draft_tokens,
                 b.spec_num_accepted_tokens - a.spec_num_accepted_tokens)


@pytest.mark.parametrize("right", [True, False])
def test_scripted_acceptance(scripted, prompts, reference, right):
    llm = scripted(right)
    got, (drafts, draft_toks, accepted) = _delta(llm, lambda: _tokens(llm.generate(prompts, _greedy(),
                                                                                  use_tqdm=False)))
    assert got == reference
    assert draft_toks > 0
    assert accepted == (draft_toks if right else 0)
    if right:  # k + 1 tokens per verification: far fewer steps than tokens
        assert drafts < sum(len(r[0]) for r in reference)
    _assert_no_leak(llm)


def test_stop_token_and_max_tokens_inside_accepted_run(scripted, off, prompts, reference):
    llm = scripted(True)
    stop_tok = reference[0][0][5]
    for sp in (_greedy(stop_token_ids=[stop_tok]), _greedy(max_tokens=5), _greedy(max_tokens=1),
               _greedy(stop_token_ids=[stop_tok], include_stop_str_in_output=True, min_tokens=6)):
        want = off.generate(prompts, sp, use_tqdm=False)
        got = llm.generate(prompts, sp, use_tqdm=False)
        assert _tokens(got) == _tokens(want)
        assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in want]
        assert all(len(o.outputs[0].token_ids) <= sp.max_tokens for o in got)
    _assert_no_leak(llm)


def test_stop_string_inside_accepted_run(scripted, off, prompts, reference, tokenizer):
    llm = scripted(True)
    text = off.generate([prompts[0]], _greedy(), use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    sp = _greedy(stop=[stop])
    want, got = off.generate(prompts, sp, use_tqdm=False), llm.generate(prompts, sp, use_tqdm=False)
    assert _tokens(got) == _tokens(want)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert got[0].outputs[0].stop_reason == stop


def test_logprobs_and_n(scripted, off, prompts):
    llm = scripted(True)
    # n > 1 needs random sampling; top_k=1 makes it the greedy choice through the random path
    sp = SamplingParams(temperature=0.7, top_k=1, max_tokens=MAX_TOKENS, logprobs=2, n=2)
    want, got = off.generate(prompts, sp, use_tqdm=False), llm.generate(prompts, sp, use_tqdm=False)
    assert _tokens(got) == _tokens(want)
    for w, g in zip(want, got):
        for cw, cg in zip(w.outputs, g.outputs):
            assert len(cg.logprobs) == len(cg.token_ids)
            for dw, dg in zip(cw.logprobs, cg.logprobs):
                assert list(dw) == list(dg)
                for t in dw:
                    assert dg[t].logprob == pytest.approx(dw[t].logprob, abs=1e-4)
                    assert dg[t].rank == dw[t].rank
            assert cg.cumulative_logprob == pytest.approx(cw.cumulative_logprob, abs=1e-3)


def test_prefix_cache_hit_on_a_speculated_output(scripted, off, prompts, reference):
    """Rejected drafts wrote KV past the accepted tokens: a later prompt that extends the
    first request's output hits its cached blocks and must see only accepted tokens."""
    llm = scripted(False)  # every draft rejected: the most rolled-back KV
    longer = [p + r[0] for p, r in zip(prompts, reference)]
    llm.generate(prompts, _greedy(), use_tqdm=False)
    before = llm.llm_engine.get_stats().prefix_cache_hits
    got = llm.generate(longer, _greedy(max_tokens=8), use_tqdm=False)
    assert llm.llm_engine.get_stats().prefix_cache_hits > before
    assert _tokens(got) == _tokens(off.generate(longer, _greedy(max_tokens=8), use_tqdm=False))


@pytest.mark.parametrize("sched", SCHED)
def test_structured_outputs_carry_no_drafts(sched, llama_dir, off, prompts):
    llm = _llm(llama_dir, {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1}, sched)
    so = SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(regex="[a-z]{3,20}"))
    params = [so, _greedy()] * 2
    want, got = off.generate(prompts, params, use_tqdm=False), llm.generate(prompts, params, use_tqdm=False)
    assert _tokens(got) == _tokens(want)
    _assert_no_leak(llm)
    llm.shutdown()


@pytest.mark.parametrize("sched", SCHED)
def test_disable_by_batch_size(sched, llama_dir, prompts, reference):
    spec = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "disable_by_batch_size": 2}
    llm = _llm(llama_dir, spec, sched, max_num_seqs=8)
    (got, (drafts, _, _)) = _delta(llm, lambda: _tokens(llm.generate(prompts[:2], _greedy(), use_tqdm=False)))
    assert got == reference[:2] and drafts == 0  # two running: no drafts
    (got, (drafts, _, _)) = _delta(llm, lambda: _tokens(llm.generate(prompts[:1], _greedy(), use_tqdm=False)))
    assert got == reference[:1] and drafts > 0
    llm.shutdown()


@pytest.mark.parametrize("method", ["ngram", "draft_self", "eagle3"])
def test_async_scheduling_across_the_cutoff(method, llama_dir, draft_dir, eagle_dir, prompts, reference):
    """With disable_by_batch_size and async scheduling: steps of that many running
    requests pipeline without drafts, smaller ones pipeline with draft placeholders; the
    engine crosses between the two as requests finish."""
    spec = {**_spec(method, draft_dir, eagle_dir, llama_dir), "disable_by_batch_size": 3}
    llm = LLM(str(llama_dir), device="cpu", async_scheduling=True, speculative_config=spec)
    assert llm.llm_engine.engine_core.config.async_scheduling
    params = [_greedy(max_tokens=n) for n in (3, 6, 20, 20)]  # two finish early: the rest speculate
    got = _tokens(llm.generate(prompts, params, use_tqdm=False))
    want = _tokens(LLM(str(llama_dir), device="cpu").generate(prompts, params, use_tqdm=False))
    assert got == want
    st = llm.llm_engine.get_stats()
    assert st.spec_num_drafts > 0
    if method == "draft_self":  # draft KV caught up over the steps without speculation
        assert st.spec_num_accepted_tokens == st.spec_num_draft_tokens
    _assert_no_leak(llm)
    llm.shutdown()


@pytest.mark.parametrize("method", ["ngram", "draft_self", "eagle3"])
def test_async_burst_start_pipelines_past_the_cutoff(method, llama_dir, draft_dir, eagle_dir, prompts, reference):
    """A burst of at least disable_by_batch_size requests into an idle engine: its first
    step (prefill only) is speculative, since none ran at its start, but carries no draft
    placeholders, so the next step (plain: the cutoff is reached) is scheduled while it is
    in flight, as without speculation; the same tokens as without speculation."""
    spec = {**_spec(method, draft_dir, eagle_dir, llama_dir), "disable_by_batch_size": 3}
    llm = LLM(str(llama_dir), device="cpu", async_scheduling=True, speculative_config=spec)
    plain_after_spec = []  # per plain step: whether a speculative step was in flight

    def seen(so, in_flight):
        if not so.speculative:
            plain_after_spec.append(any(s.speculative for s in in_flight))
    trace_steps(llm, seen)
    got = _tokens(llm.generate(prompts, _greedy(), use_tqdm=False))
    assert got == reference
    assert plain_after_spec and plain_after_spec[0]  # the second step did not wait for the first
    _assert_no_leak(llm)
    llm.shutdown()


@pytest.mark.parametrize("sched", SCHED)
def test_seeded_random_is_reproducible(sched, llama_dir, prompts):
    llm = _llm(llama_dir, {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1}, sched)
    sp = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=MAX_TOKENS)
    alone = _tokens(llm.generate([prompts[0]], sp, use_tqdm=False))[0]
    batch = _tokens(llm.generate(prompts, [sp] + [SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS)] * 3,
                                 use_tqdm=False))[0]
    again = _tokens(llm.generate([prompts[0]], sp, use_tqdm=False))[0]
    assert alone == batch == again
    llm.shutdown()


def _seeded(prompts):
    return [SamplingParams(temperature=0.3, top_k=20, seed=100 + i, max_tokens=MAX_TOKENS) for i in range(len(prompts))]


@pytest.fixture(scope="module")
def seeded_reference(off, prompts):
    return _tokens(off.generate(prompts, _seeded(prompts), use_tqdm=False))


SEEDED_CASES = [("ngram", "default"), ("ngram", "preemption"), ("draft_model", "default"),
                ("draft_self", "preemption"), ("eagle3", "chunked_prefill")]


@pytest.mark.parametrize("method,mode,sched", [(m, d, s) for s in SCHED for m, d in SEEDED_CASES])
def test_seeded_random_on_equals_off(method, mode, sched, llama_dir, draft_dir, eagle_dir, prompts,
                                     seeded_reference):
    """Seeded random sampling gives the tokens of a run without speculation, under sync and
    async scheduling and preemption: a row's draws depend on its seed and position only,
    and a one-hot draft is accepted iff it is the token the row samples."""
    llm = _llm(llama_dir, _spec(method, draft_dir, eagle_dir, llama_dir), sched, **MODES[mode])
    got = _tokens(llm.generate(prompts, _seeded(prompts), use_tqdm=False))
    st = llm.llm_engine.get_stats()
    assert st.spec_num_draft_tokens > 0  # (the random drafters' drafts are mostly rejected: below, scripted ones)
    if mode == "preemption":
        assert st.num_preemptions > 0
    assert got == seeded_reference
    _assert_no_leak(llm)
    llm.shutdown()


class ScriptedMixed(Scripted):
    """Drafts the reference continuation with every third output position wrong."""

    def draft(self, request, context, k):
        done = len(context) - request.num_prompt_tokens
        return [t if (done + j) % 3 != 2 else (t + 1) % self.vocab
                for j, t in enumerate(super().draft(request, context, k))]


@pytest.mark.parametrize("sched", SCHED)
def test_seeded_random_with_accepted_and_rejected_drafts_equals_off(sched, llama_dir, prompts, seeded_reference):
    llm = _llm(llama_dir, {"method": "ngram", "num_speculative_tokens": K}, sched)
    runner = llm.llm_engine.engine_core.model_runner
    refs = {tuple(p): r[0] for p, r in zip(prompts, seeded_reference)}
    runner.drafter = ScriptedMixed(runner.spec_config, llm.llm_engine.engine_core.config.max_model_len, refs, True,
                                   runner.dims.vocab_size)
    got, (drafts, draft_toks, accepted) = _delta(llm, lambda: _tokens(llm.generate(prompts, _seeded(prompts),
                                                                                  use_tqdm=False)))
    assert got == seeded_reference
    assert 0 < accepted < draft_toks  # runs accepted, cut short and rejected
    _assert_no_leak(llm)
    llm.shutdown()


def trace_steps(llm, seen) -> None:
    """From now on call ``seen(so, in_flight)`` for each non-empty step the scheduler
    schedules, ``in_flight`` being the steps scheduled and not yet updated before it."""
    sched = llm.llm_engine.engine_core.scheduler
    in_flight: list = []
    schedule, update = sched.schedule, sched.update_from_output

    def traced_schedule():
        so = schedule()
        if not so.is_empty:
            seen(so, in_flight)
            in_flight.append(so)
        return so

    def traced_update(so, out):
        in_flight.remove(so)
        return update(so, out)
    sched.schedule, sched.update_from_output = traced_schedule, traced_update


def trace_overlap(llm) -> dict:
    """Count, from now on, the speculative steps with drafts that were scheduled while
    the step before was in flight with each drafted row's drafts still placeholders
    (``overlapped``), and those that were not (``sync_like``)."""
    counts = {"overlapped": 0, "sync_like": 0}

    def seen(so, in_flight):
        rows = [s for s in so.scheduled if s.spec_token_ids]
        if so.speculative and rows:
            ok = in_flight and all(s.placeholder_input and set(s.spec_token_ids) == {-1} for s in rows)
            counts["overlapped" if ok else "sync_like"] += 1
    trace_steps(llm, seen)
    return counts


@pytest.mark.parametrize("method", ["ngram", "draft_model", "draft_self", "eagle3"])
def test_async_schedules_the_next_step_before_this_one_is_verified(method, llama_dir, draft_dir, eagle_dir, prompts,
                                                                   reference):
    """The overlap itself: each speculative step after the first is scheduled while the
    step before it is still in flight (its update_from_output not yet run), its decode
    rows carrying draft placeholders; a fallback to synchronous stepping fails this. The
    runner fills the placeholders: drafts are fed and counted (the target drafting for
    itself: every one accepted)."""
    llm = _llm(llama_dir, _spec(method, draft_dir, eagle_dir, llama_dir), "async")
    counts = trace_overlap(llm)
    got = _tokens(llm.generate(prompts, _greedy(), use_tqdm=False))
    assert got == reference
    assert counts["overlapped"] >= 3 and counts["sync_like"] == 0
    st = llm.llm_engine.get_stats()
    assert st.spec_num_drafts > 0 and st.spec_num_draft_tokens > 0
    assert sum(st.spec_accepted_per_pos) == st.spec_num_accepted_tokens
    if method == "draft_self":
        assert st.spec_num_accepted_tokens == st.spec_num_draft_tokens
    _assert_no_leak(llm)
    llm.shutdown()


def test_async_counters_equal_sync_with_the_target_as_draft(llama_dir, draft_dir, eagle_dir, prompts):
    """Accepted counts come from the corrected placeholders: with the target drafting for
    itself at batch 1 (no max_tokens cut inside the run: k + 1 divides max_tokens), async
    scheduling verifies exactly what sync scheduling does."""
    spec = _spec("draft_self", draft_dir, eagle_dir, llama_dir)
    stats = []
    for sched in SCHED:
        llm = _llm(llama_dir, spec, sched)
        llm.generate(prompts[:1], _greedy(max_tokens=1 + 2 * (K + 1)), use_tqdm=False)
        st = llm.llm_engine.get_stats()
        stats.append((st.spec_num_drafts, st.spec_num_draft_tokens, st.spec_num_accepted_tokens,
                      st.spec_accepted_per_pos))
        llm.shutdown()
    assert stats[0] == stats[1] == (2, 2 * K, 2 * K, [2] * K)


@pytest.mark.parametrize("sched", SCHED)
def test_penalties_and_min_tokens_see_every_earlier_token(sched, llama_dir, off, prompts):
    """Penalties and min_tokens read the output so far; under async scheduling that
    includes the tokens of the step in flight, which only the runner knows yet."""
    llm = _llm(llama_dir, _spec("draft_self", None, None, llama_dir), sched)
    sp = _greedy(max_tokens=16, frequency_penalty=0.7, presence_penalty=0.4, repetition_penalty=1.3, min_tokens=6,
                 stop_token_ids=[0, 1, 2, 3])
    assert _tokens(llm.generate(prompts, sp, use_tqdm=False)) == _tokens(off.generate(prompts, sp, use_tqdm=False))
    assert llm.llm_engine.get_stats().spec_num_accepted_tokens > 0
    _assert_no_leak(llm)
    llm.shutdown()
