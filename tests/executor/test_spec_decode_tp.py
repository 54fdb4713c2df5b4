"""Speculative decoding with tensor parallelism (TP=2 over gloo, two processes, tiny fp32
models): verification is the target's forward with query length 1 + k on every rank (the
drafts are input ids of the packed step), only rank 0 runs the rejection sampler, and a
draft model / EAGLE-3 head runs sharded on the same group from rank 0's ``DraftPlan``.
Greedy output with speculation on at TP=2 equals speculation off at TP=1 and transformers,
for ngram, a draft model, the target as its own draft (every draft accepted: the sharded
draft computes what the sharded verification does) and an untrained EAGLE-3 head, with
sync and async scheduling, chunked prefill, prefix-cache hits and preemption; async
scheduling across the disable_by_batch_size cutoff (steps switch between sampled-id
broadcasts and verification); a killed worker ends every request with EngineDeadError.

Each TP=2 engine spawns a process (seconds on a small box), so each case covers several
features."""
from __future__ import annotations

import pytest
import torch

from pyengine import LLM, SamplingParams
from pyengine.spec_decode.base import DraftPlan
from pyengine.worker.step_codec import KIND_DRAFT, KIND_STEP, KIND_TOKENS, KIND_VERIFY, StepShape, payload_bytes
from tests.executor.test_multiproc_executor import _kill_worker_and_check
from tests.helpers import build_tiny_eagle3, build_tiny_model, hf_greedy, prompt_token_ids

MAX_TOKENS = 12
K = 3
# Small steps and a small KV cache: prompts prefilled in chunks, requests preempted.
STRESS = {"max_num_batched_tokens": 16, "num_gpu_blocks_override": 6, "max_model_len": 96}


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, tokenizer_dir):
    return build_tiny_model(tmp_path_factory.mktemp("draft_tp"), "llama", tokenizer_dir, seed=5, num_hidden_layers=1)


@pytest.fixture(scope="module")
def eagle_dir(tmp_path_factory, llama_dir):
    # a draft vocabulary of 301: split 151 + 150 over two ranks (the last range padded)
    return build_tiny_eagle3(tmp_path_factory.mktemp("eagle3_tp"), llama_dir, seed=3, draft_vocab_size=301)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    base = prompt_token_ids(tokenizer, 6, min_len=4, max_len=30, seed=0)
    shared = prompt_token_ids(tokenizer, 1, 36, 36, seed=1)[0]
    # repeats for the n-gram lookup, and a shared 36-token prefix for the prefix cache
    return [base[0] * 3, base[1] + base[1], shared + base[3][:5], shared + base[4][:5]]


@pytest.fixture(scope="module")
def reference(llama_dir, prompts):
    """Speculation off at TP=1, which must equal transformers."""
    llm = LLM(str(llama_dir), device="cpu")
    try:
        got = _tokens(llm.generate(prompts, _greedy(), use_tqdm=False))
    finally:
        llm.shutdown()
    assert got == hf_greedy(llama_dir, prompts, MAX_TOKENS)
    return got


def _greedy(max_tokens=MAX_TOKENS):
    return SamplingParams(temperature=0, max_tokens=max_tokens, detokenize=False)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _spec(method, llama_dir, draft_dir, eagle_dir):
    return {"ngram": {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
            "draft_model": {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": K},
            "draft_self": {"method": "draft_model", "model": str(llama_dir), "num_speculative_tokens": K},
            "eagle3": {"method": "eagle3", "model": str(eagle_dir), "num_speculative_tokens": K}}[method]


def _record_messages(llm) -> list[int]:
    """The kinds of the messages rank 0 sends its worker from now on."""
    tp = llm.llm_engine.engine_core.model_executor.driver.tp
    kinds: list[int] = []
    send = tp.send_step

    def recording(header, *payload):
        kinds.append(int(header[0]))
        return send(header, *payload)
    tp.send_step = recording
    return kinds


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sched", ["sync", "async"])
@pytest.mark.parametrize("method", ["ngram", "draft_model", "draft_self", "eagle3"])
def test_tp2_spec_greedy_equals_tp1_off(method, sched, llama_dir, draft_dir, eagle_dir, prompts, reference):
    llm = LLM(str(llama_dir), device="cpu", tensor_parallel_size=2, async_scheduling=sched == "async",
              speculative_config=_spec(method, llama_dir, draft_dir, eagle_dir), **STRESS)
    try:
        assert llm.llm_engine.engine_core.config.async_scheduling == (sched == "async")
        kinds = _record_messages(llm)
        got = _tokens(llm.generate(prompts, _greedy(), use_tqdm=False))
        assert got == reference
        again = _tokens(llm.generate(prompts, _greedy(), use_tqdm=False))  # prefix-cache hits this time
        assert again == reference
        st = llm.llm_engine.get_stats()
    finally:
        llm.shutdown()
    assert st.prefix_cache_hits > 0 and st.num_preemptions > 0
    assert st.num_free_blocks == st.num_gpu_blocks  # no KV block leaked
    assert st.spec_num_drafts > 0 and sum(st.spec_accepted_per_pos) == st.spec_num_accepted_tokens
    if method == "draft_self":  # the sharded draft computes what the sharded verification does
        assert st.spec_num_accepted_tokens == st.spec_num_draft_tokens > 0
    assert KIND_VERIFY in kinds
    # model-based proposers send their forwards; ngram drafts on rank 0 alone
    assert (KIND_DRAFT in kinds) == (method != "ngram")
    # async scheduling: the followers' placeholder tokens after each verified step
    assert (KIND_TOKENS in kinds) == (sched == "async")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_tp2_async_across_the_cutoff(method, llama_dir, draft_dir, eagle_dir, prompts, reference):
    """Steps of >= 3 running requests pipeline without drafts (rank 0 broadcasts the sampled
    ids), smaller ones with draft placeholders (verified; tokens messages): the followers
    switch with them."""
    spec = {**_spec(method, llama_dir, draft_dir, eagle_dir), "disable_by_batch_size": 3}
    llm = LLM(str(llama_dir), device="cpu", tensor_parallel_size=2, async_scheduling=True, speculative_config=spec)
    try:
        kinds = _record_messages(llm)
        lens = (3, 6, 20, 20)  # two finish early: the rest speculate
        got = _tokens(llm.generate(prompts, [_greedy(n) for n in lens], use_tqdm=False))
        st = llm.llm_engine.get_stats()
    finally:
        llm.shutdown()
    want = LLM(str(llama_dir), device="cpu")
    try:
        assert got == _tokens(want.generate(prompts, [_greedy(n) for n in lens], use_tqdm=False))
    finally:
        want.shutdown()
    assert st.spec_num_drafts > 0
    assert KIND_STEP in kinds and KIND_VERIFY in kinds and KIND_TOKENS in kinds


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_killed_worker_with_speculation_ends_every_request(method, llama_dir, draft_dir, eagle_dir, prompts):
    _kill_worker_and_check(llama_dir, prompts, "cpu", False, limit_s=5,
                           speculative_config=_spec(method, llama_dir, draft_dir, eagle_dir))


def test_draft_plan_round_trip():
    plan = DraftPlan([(0, [5, 6, 7], [3, 4]), (17, [9], [1, 2, 8])], [(1, 3)], [4, 0])
    a = plan.encode()
    assert a.dtype.name == "int64"
    assert DraftPlan.decode(a) == plan
    bare = DraftPlan([(2, [1], [7])], [])
    assert DraftPlan.decode(bare.encode()) == bare
    assert plan.depth_batch([(1, 3)], 2) == [(17 + 1 - 1 + 2, (0,), [1, 2, 8])]
    # the step codec sizes these messages' payloads from their headers
    assert payload_bytes([KIND_DRAFT, a.size, 0, 0, 0, 0, 0, 0]) == 8 * a.size
    assert payload_bytes([KIND_TOKENS, 5, 0, 0, 0, 0, 0, 0]) == 40
    sh = StepShape(4, 1, 0, 4, 1, 4, 10)
    assert StepShape.from_header(sh.header(verify=True)) == sh and sh.header(verify=True)[0] == KIND_VERIFY


# ---- GPU (2 GPUs, NCCL, CUDA graphs and triton kernels): tools/tp_h200x2.sh gpu_tp_spec ------
needs_two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                    reason="needs 2 GPUs")
GPU = {"max_num_seqs": 16, **STRESS}  # few CUDA graphs to capture; uniform verification steps replay them


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.timeout(600)
@pytest.mark.parametrize("method,sched", [("ngram", "async"), ("draft_self", "sync"), ("draft_self", "async"),
                                          ("eagle3", "async")])
def test_tp2_gpu_fp32_spec_matches_transformers(method, sched, llama_dir, draft_dir, eagle_dir, prompts):
    ref = hf_greedy(llama_dir, prompts, MAX_TOKENS)
    llm = LLM(str(llama_dir), device="cuda", dtype="float32", tensor_parallel_size=2,
              async_scheduling=sched == "async", speculative_config=_spec(method, llama_dir, draft_dir, eagle_dir),
              **GPU)
    try:
        got = _tokens(llm.generate(prompts, _greedy(), use_tqdm=False))
        st = llm.llm_engine.get_stats()
    finally:
        llm.shutdown()
    assert got == ref
    assert st.spec_num_drafts > 0 and st.num_free_blocks == st.num_gpu_blocks and st.num_preemptions > 0
    if method == "draft_self":
        assert st.spec_num_accepted_tokens == st.spec_num_draft_tokens > 0


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.timeout(600)
def test_tp2_gpu_bf16_spec_matches_tp1_off(llama_dir, draft_dir, eagle_dir, prompts):
    """bf16: verification rows (query length 1 + k) and TP=2's split sums round differently
    from TP=1's decode steps, so a greedy choice between near-equal logits may flip
    (tests/executor/test_multiproc_executor.py's NEAR_TIE); anywhere else the tokens match."""
    from tests.executor.test_multiproc_executor import NEAR_TIE

    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, detokenize=False, logprobs=2)
    off = LLM(str(llama_dir), device="cuda", dtype="bfloat16", **GPU)
    try:
        tp1 = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in off.generate(prompts, sp, use_tqdm=False)]
    finally:
        off.shutdown()
    llm = LLM(str(llama_dir), device="cuda", dtype="bfloat16", tensor_parallel_size=2,
              speculative_config=_spec("ngram", llama_dir, draft_dir, eagle_dir), **GPU)
    try:
        tp2 = _tokens(llm.generate(prompts, _greedy(), use_tqdm=False))
        assert llm.llm_engine.get_stats().spec_num_drafts > 0
    finally:
        llm.shutdown()
    same = total = 0
    for (toks1, lps1), toks2 in zip(tp1, tp2):
        total += len(toks1)
        for i, (a, b) in enumerate(zip(toks1, toks2)):
            if a != b:
                top = sorted((lp.logprob for lp in lps1[i].values()), reverse=True)
                assert top[0] - top[1] < NEAR_TIE, f"diverged at token {i} without a near tie: {toks1} vs {toks2}"
                break
            same += 1
        else:
            assert len(toks1) == len(toks2)
    assert same >= 0.5 * total, f"only {same} of {total} tokens identical"


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.timeout(180)
def test_killed_worker_with_speculation_gpu(llama_dir, draft_dir, eagle_dir, prompts):
    _kill_worker_and_check(llama_dir, prompts, "cuda", True, limit_s=10,
                           speculative_config=_spec("eagle3", llama_dir, draft_dir, eagle_dir))
