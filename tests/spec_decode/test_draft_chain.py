"""The draft model's one-replay chain (pyengine/spec_decode/draft_chain.py), run eagerly on
the CPU: the steps it takes get the same drafts as the depth-by-depth path, it takes the
steady-state steps (and leaves prompts and short-room steps to that path), and greedy
output stays the target's own."""
from __future__ import annotations

import os

import pytest

from pyengine import LLM, SamplingParams
from tests.helpers import build_tiny_model, prompt_token_ids

K = 3


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, tokenizer_dir):
    return build_tiny_model(tmp_path_factory.mktemp("draft"), "qwen3", tokenizer_dir, seed=7, num_hidden_layers=2)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    base = prompt_token_ids(tokenizer, 3, min_len=4, max_len=20, seed=4)
    return [base[0] * 3, base[1], base[2] + base[2]]


def _run(llama_dir, draft_dir, prompts, chain: bool, max_tokens: int = 16, early: bool = True, **kw):
    spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": K}
    llm = LLM(str(llama_dir), device="cpu", speculative_config=spec, **kw)
    drafter = llm.llm_engine.engine_core.model_runner.drafter
    drafter.early_chain = early
    if chain:
        drafter.enable_draft_chain()
    calls = {"chain": 0, "steps": 0, "early": 0}
    drafts = []
    run, propose, chain_obj = drafter._run, drafter.propose, drafter._chain
    if chain_obj is not None:
        chain_run = chain_obj.run

        def counted(plan):
            calls["chain"] += 1
            return chain_run(plan)
        chain_obj.run = counted

    def counted_run(plan):
        calls["steps"] += 1
        return run(plan)

    def recording(so, sampled, generated, hidden):
        early = drafter.early_chain_steps
        out = propose(so, sampled, generated, hidden)
        if drafter.early_chain_steps > early:  # (async: the chain launched after the verification)
            calls["chain"] += 1
            calls["steps"] += 1
            calls["early"] += 1
        if sampled:
            drafts.append([list(d) for d in out])  # each request's drafts it keeps
        return out
    drafter._run, drafter.propose = counted_run, recording
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    st = llm.llm_engine.get_stats()
    calls["accepted"], calls["drafted"] = st.spec_num_accepted_tokens, st.spec_num_draft_tokens
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], drafts, calls


@pytest.mark.parametrize("draft,mode", [("other", {}), ("other", {"max_num_batched_tokens": 16}), ("self", {})])
def test_chain_drafts_equal_the_stepwise_ones(llama_dir, draft_dir, prompts, draft, mode):
    # the target as its own draft accepts every draft: first forwards of k + 2 tokens
    draft_dir = llama_dir if draft == "self" else draft_dir
    toks_a, drafts_a, calls_a = _run(llama_dir, draft_dir, prompts, chain=False, **mode)
    toks_b, drafts_b, calls_b = _run(llama_dir, draft_dir, prompts, chain=True, **mode)
    assert toks_a == toks_b
    assert drafts_a == drafts_b
    assert calls_a["chain"] == 0
    # the steady state goes through the chain; the prompts' first forwards do not
    assert 0 < calls_b["chain"] < calls_b["steps"]


def test_greedy_with_the_chain_is_the_targets(llama_dir, draft_dir, prompts):
    off = LLM(str(llama_dir), device="cpu")
    ref = [o.outputs[0].token_ids for o in off.generate(prompts, SamplingParams(temperature=0, max_tokens=16),
                                                          use_tqdm=False)]
    off.shutdown()
    got, _, calls = _run(llama_dir, draft_dir, prompts, chain=True, async_scheduling=True)
    assert got == ref and calls["chain"] > 0


@pytest.mark.parametrize("draft", ["other", "self"])
def test_early_chain_drafts_equal_the_late_ones(llama_dir, draft_dir, prompts, draft):
    """Async scheduling: the chain launched straight after each verification (before its
    result reaches the host) drafts, step by step, what it drafts when launched after the
    result; the target drafting for itself has every draft accepted (its draft KV right)."""
    draft_dir = llama_dir if draft == "self" else draft_dir
    toks_a, drafts_a, calls_a = _run(llama_dir, draft_dir, prompts, chain=True, early=False, async_scheduling=True)
    toks_b, drafts_b, calls_b = _run(llama_dir, draft_dir, prompts, chain=True, async_scheduling=True)
    assert toks_a == toks_b and drafts_a == drafts_b
    assert calls_a["early"] == 0 < calls_b["early"]
    if draft == "self":
        assert calls_b["accepted"] == calls_b["drafted"] > 0


def test_fits_requests_of_up_to_k_drafts(llama_dir, draft_dir):
    from pyengine.spec_decode.base import DraftPlan
    from pyengine.spec_decode.draft_chain import DraftChain

    with pytest.raises(ValueError):
        DraftChain(None, None, 0, [1], 4, 64, 16, "cpu")
    c = DraftChain(None, None, K, [1, 2], 4, 64, 16, "cpu")
    seq = (20, [5] * (K + 2), [1, 2])
    assert c.fits(DraftPlan([seq], [(0, K)]))
    assert c.fits(DraftPlan([seq, (3, [4], [3])], [(0, K), (1, K)]))
    assert c.fits(DraftPlan([seq, (3, [4], [3])], [(0, K), (1, 1)]))  # fewer drafts (the end of its room)
    assert not c.fits(DraftPlan([seq], [(0, K + 1)]))  # more drafts than the chain's depth
    assert not c.fits(DraftPlan([seq], []))  # a prefill chunk's KV only
    assert not c.fits(DraftPlan([(20, [5] * (K + 3), [1, 2])], [(0, K)]))  # a longer first forward
    assert not c.fits(DraftPlan([seq] * 3, [(0, K), (1, K), (2, K)]))  # more requests than the largest size
    assert not c.fits(DraftPlan([(60, [5], [1, 2, 3, 4])], [(0, K)]))  # its padded forward past the table


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get("VENGINE_TRITON_OPS_ON_CPU") != "1",
                    reason="set TRITON_INTERPRET=1 VENGINE_TRITON_OPS_ON_CPU=1")
def test_chain_on_the_triton_kernels(llama_dir, draft_dir, prompts):
    """The GPU path's kernels (the extend kernel over padded first forwards, the decode
    kernel at each depth) through triton's interpreter: the same drafts as step by step."""
    kw = {"attention_backend": "triton"}
    toks_a, drafts_a, _ = _run(llama_dir, draft_dir, prompts[:2], chain=False, max_tokens=8, **kw)
    toks_b, drafts_b, calls = _run(llama_dir, draft_dir, prompts[:2], chain=True, max_tokens=8, **kw)
    assert toks_a == toks_b and drafts_a == drafts_b and calls["chain"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("sched", ["sync", "async"])
def test_chain_graphs_on_cuda(llama_dir, draft_dir, prompts, sched, monkeypatch):
    """CUDA, after an engine without speculation in the same process (where a graph
    writing into a swapped-out attention scratch once corrupted other tensors): the
    chain's graphs are captured at start-up and replayed in the steady state; greedy
    output is the target's."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setenv("VENGINE_DRAFT_CHAIN", "1")
    sp = SamplingParams(temperature=0, max_tokens=24)
    off = LLM(str(llama_dir), device="cuda", dtype="float32")
    ref = [o.outputs[0].token_ids for o in off.generate(prompts, sp, use_tqdm=False)]
    off.shutdown()
    spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": K}
    llm = LLM(str(llama_dir), device="cuda", dtype="float32", speculative_config=spec,
              async_scheduling=sched == "async")
    try:
        chain = llm.llm_engine.engine_core.model_runner.drafter._chain
        assert chain is not None and set(chain.graphs) == set(chain.sizes)
        calls = []
        run = chain.run
        run_verified = chain.run_verified
        chain.run = lambda plan: calls.append(len(plan.seqs)) or run(plan)
        chain.run_verified = lambda reqs, *a: calls.append(len(reqs)) or run_verified(reqs, *a)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert got == ref
        assert calls and max(calls) == len(prompts)
        one = [o.outputs[0].token_ids for o in llm.generate(prompts[:1], sp, use_tqdm=False)]
        assert one == ref[:1] and calls[-1] == 1
        # async: the chain's graph launched straight after the verification, its inputs derived there
        assert (llm.llm_engine.engine_core.model_runner.drafter.early_chain_steps > 0) == (sched == "async")
    finally:
        llm.shutdown()


def _chain_llm(llama_dir, draft_dir, sched: str):
    spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": K}
    llm = LLM(str(llama_dir), device="cpu", speculative_config=spec, async_scheduling=sched == "async")
    drafter = llm.llm_engine.engine_core.model_runner.drafter
    drafter.enable_draft_chain()
    rows = {"device": 0, "host": 0}
    propose = drafter.propose

    def counted(*a):
        from pyengine.spec_decode.base import DraftRow

        out = propose(*a)
        for d in out:
            if d:
                rows["device" if isinstance(d, DraftRow) else "host"] += 1
        return out
    drafter.propose = counted
    return llm, rows


@pytest.mark.parametrize("kind", ["greedy", "penalties"])
def test_async_chain_drafts_stay_on_the_device(llama_dir, draft_dir, prompts, kind):
    """Async scheduling, one rank: the chain's drafts stay on the device (``DraftRow``s),
    the next step's inputs gather them there and the verification reads their values
    after its own copy back; greedy output is still the target's. With penalties the
    sampling metadata reads the drafts' values on the host (the same drafts)."""
    extra = {} if kind == "greedy" else {"frequency_penalty": 0.7, "repetition_penalty": 1.3, "min_tokens": 4}
    sp = SamplingParams(temperature=0, max_tokens=16, **extra)
    off = LLM(str(llama_dir), device="cpu")
    ref = [o.outputs[0].token_ids for o in off.generate(prompts, sp, use_tqdm=False)]
    off.shutdown()
    llm, rows = _chain_llm(llama_dir, draft_dir, "async")
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert llm.llm_engine.get_stats().spec_num_accepted_tokens > 0
    llm.shutdown()
    assert got == ref
    assert rows["device"] > 0


def test_async_device_drafts_with_seeded_random_rows_match_host_drafts(llama_dir, draft_dir, prompts):
    """A batch with a seeded random row (its verification takes the drafts as device ids,
    built from their host copy) gives what the same async engine gives with the drafts
    copied to the host at once (``device_drafts`` off)."""
    sps = [SamplingParams(temperature=0.8, top_k=20, seed=11, max_tokens=16)] + \
        [SamplingParams(temperature=0, max_tokens=16)] * (len(prompts) - 1)
    outs = {}
    for device in (False, True):
        llm, rows = _chain_llm(llama_dir, draft_dir, "async")
        llm.llm_engine.engine_core.model_runner.drafter.device_drafts = device
        outs[device] = [o.outputs[0].token_ids for o in llm.generate(prompts, sps, use_tqdm=False)]
        llm.shutdown()
        assert (rows["device"] > 0) == device and rows["host"] > 0
    assert outs[False] == outs[True]


def _reference_fill(plan, bs, Q, W, blk):
    """The staging rows a step's plan gets, stated plainly: per request its tokens, then
    padding rows at its last position with slot -1; padding requests read the null block."""
    ids, pos, slots, last, plast, cap, seq0 = [], [], [], [], [], [], []
    bt = [[0] * W for _ in range(bs)]
    for r, (start, toks, blocks) in enumerate(plan.seqs):
        q, p_last = len(toks), start + len(toks) - 1
        ids += list(toks) + [0] * (Q - q)
        pos += list(range(start, p_last + 1)) + [p_last] * (Q - q)
        slots += [blocks[p // blk] * blk + p % blk for p in range(start, p_last + 1)] + [-1] * (Q - q)
        last.append(r * Q + q - 1)
        plast.append(p_last)
        cap.append(len(blocks) * blk)
        seq0.append(start + Q)
        bt[r][:len(blocks)] = blocks
    for r in range(len(plan.seqs), bs):
        ids += [0] * Q
        pos += [Q - 1] * Q
        slots += [-1] * Q
        last.append(r * Q + Q - 1)
        plast.append(Q - 1)
        cap.append(0)
        seq0.append(Q)
    return {"ids": ids, "pos": pos, "slots": slots, "last": last, "plast": plast, "cap": cap, "seq0": seq0,
            "bt": [b for row in bt for b in row]}


def test_fill_stages_what_the_rule_says():
    from pyengine.spec_decode.base import DraftPlan
    from pyengine.spec_decode.draft_chain import DraftChain

    W, blk = 4, 16
    c = DraftChain(None, None, K, [1, 2, 4], W, 64, blk, "cpu")
    plans = [DraftPlan([(20, [5] * (K + 2), [3, 9])], [(0, K)]),
             DraftPlan([(33, [7, 8], [2, 6, 1]), (0, [1] * (K + 2), [4])], [(0, K), (1, K)]),
             DraftPlan([(15, [9], [5, 2])], [(0, K)])]
    for plan, bs in zip(plans, (1, 4, 2)):
        c._fill(plan, 4)  # dirty every row first: a smaller step must overwrite what it reads
        c._fill(plan, bs)
        want = _reference_fill(plan, bs, K + 2, W, blk)
        for name, values in want.items():
            assert c._host[name][:len(values)].tolist() == values, name


@pytest.mark.parametrize("greedy", [True, False])
def test_run_verified_stages_the_first_forward_the_result_gives(greedy):
    """The chain launched after a verification (before its result is on the host) stages
    what ``_fill`` stages for the plan the result gives: each request's first forward is
    its verified step's first token, then its candidates through the first rejected row.
    Greedy rows accept where the candidate is the next row's input; random rows where
    ``accepted`` says."""
    import torch

    from pyengine.spec_decode.base import DraftPlan
    from pyengine.spec_decode.draft_chain import DraftChain

    W, blk = 4, 16
    c = DraftChain(None, None, K, [1, 2, 4], W, 64, blk, "cpu")
    # three requests: (start, drafts fed, block ids); logits rows 0-3, 4-5, 6-9
    reqs = [(20, 0, K, [3, 9]), (33, 4, 1, [2, 6, 1]), (9, 6, K, [5])]
    inp = torch.tensor([7, 11, 12, 13, 8, 21, 9, 31, 32, 33])  # the newest token, then the drafts
    if greedy:  # request 0 accepts two drafts, request 1 its only one, request 2 none
        cand = torch.tensor([11, 12, 40, 41, 21, 50, 60, 61, 62, 63])
        acc = None
        taken = [[7, 11, 12, 40], [8, 21, 50], [9, 60]]
    else:  # accepted flags whatever the values: all of request 0, none of 1, the first of 2
        cand = torch.tensor([11, 12, 13, 44, 55, 56, 31, 66, 67, 68])
        acc = torch.tensor([True, True, True, False, False, False, True, False, True, False])
        taken = [[7, 11, 12, 13, 44], [8, 55], [9, 31, 66]]
    plan = DraftPlan([(p, t, b) for (p, _, _, b), t in zip(reqs, taken)], [(i, K) for i in range(3)])
    for bs in (4, 3):
        c._stage_verified(reqs, 4, len(inp))  # dirty every row first
        c._derive_verified(3, inp, cand, acc)
        c._stage_verified(reqs, bs, len(inp))
        c._derive_verified(3, inp, cand, acc)
        want = _reference_fill(plan, bs, K + 2, W, blk)
        for name, values in want.items():
            assert c._host[name][:len(values)].tolist() == values, (name, bs)


def test_trusted_prefix_hit_is_the_leading_blocks_the_draft_wrote():
    from types import SimpleNamespace as NS

    from pyengine.spec_decode.draft_model import DraftModelProposer

    p = DraftModelProposer.__new__(DraftModelProposer)  # (only its block bookkeeping)
    p.block_size, p._draft_blocks = 4, {7: 70, 8: 80, 9: 90}
    req = NS(request=NS(num_cached_tokens=12, block_hashes=[70, 80, 90]), block_ids=[7, 8, 9, 3])
    assert p._trusted_hit(req) == 12
    # block 8 now holds other content (computed without the draft, or reused): hash 81
    req.request.block_hashes = [70, 81, 90]
    assert p._trusted_hit(req) == 4
    del p._draft_blocks[7]  # never filled by the draft
    assert p._trusted_hit(req) == 0
    assert p._trusted_hit(NS(request=NS(num_cached_tokens=-1, block_hashes=[]), block_ids=[7])) == 0
