"""Speculative decoding on CUDA (triton attention, CUDA graphs for the plain decode steps):
greedy output with speculation on is token-identical to off for ngram, a draft model (the
target drafting for itself: all drafts accepted) and an untrained EAGLE-3 head, float32,
with sync and with async scheduling (the next step scheduled with draft placeholders
while this one runs: pinned copies on the side stream); seeded random output too."""
from __future__ import annotations

import pytest
import torch

from pyengine import LLM, SamplingParams
from tests.helpers import build_tiny_eagle3, prompt_token_ids
from tests.spec_decode.test_spec_decode import trace_overlap

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def setup(tokenizer, llama_dir, tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    base = prompt_token_ids(tokenizer, 6, min_len=4, max_len=40, seed=0)
    prompts = [b * 3 for b in base[:3]] + base[3:]
    eagle = build_tiny_eagle3(tmp_path_factory.mktemp("eagle3_gpu"), llama_dir, draft_vocab_size=300)
    off = LLM(str(llama_dir), device="cuda", dtype="float32", async_scheduling=False)
    sp = SamplingParams(temperature=0, max_tokens=32)
    ref = [o.outputs[0].token_ids for o in off.generate(prompts, sp, use_tqdm=False)]
    off.shutdown()
    return prompts, sp, ref, eagle


@pytest.mark.parametrize("method", ["ngram", "draft_self", "eagle3"])
@pytest.mark.parametrize("mode", ["default", "preemption", "async", "async_preemption", "async_cutoff"])
def test_greedy_on_equals_off_cuda(setup, llama_dir, method, mode):
    prompts, sp, ref, eagle = setup
    spec = {"ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
            "draft_self": {"method": "draft_model", "model": str(llama_dir), "num_speculative_tokens": 3},
            "eagle3": {"method": "eagle3", "model": str(eagle), "num_speculative_tokens": 3}}[method]
    kw: dict = {"num_gpu_blocks_override": 12, "max_model_len": 192} if mode.endswith("preemption") else {}
    kw["async_scheduling"] = mode.startswith("async")
    if mode == "async_cutoff":  # no drafts in steps of >= 3 requests, drafts below
        spec = {**spec, "disable_by_batch_size": 3}
    llm = LLM(str(llama_dir), device="cuda", dtype="float32", speculative_config=spec, **kw)
    try:
        assert llm.llm_engine.engine_core.config.async_scheduling == kw["async_scheduling"]
        counts = trace_overlap(llm)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert got == ref
        if mode in ("async", "async_preemption"):
            assert counts["overlapped"] > 0 and counts["sync_like"] == 0
        if mode.endswith("preemption"):
            assert llm.llm_engine.get_stats().num_preemptions > 0
        if mode == "async_cutoff":  # two requests: below the cutoff, with drafts
            assert [o.outputs[0].token_ids for o in llm.generate(prompts[:2], sp, use_tqdm=False)] == ref[:2]
        st = llm.llm_engine.get_stats()
        assert st.spec_num_drafts > 0
        if method == "draft_self":
            assert st.spec_num_accepted_tokens == st.spec_num_draft_tokens
        assert st.num_free_blocks == st.num_gpu_blocks
    finally:
        llm.shutdown()


@pytest.mark.parametrize("method", ["ngram", "draft_self"])
@pytest.mark.parametrize("mode", ["sync", "async", "async_preemption"])
def test_seeded_random_on_equals_off_cuda(setup, llama_dir, method, mode):
    """Seeded random rows draw by (seed, position) through the Triton hash kernel: with
    speculation on they give the tokens of the run without it (float32)."""
    prompts = setup[0]
    sps = [SamplingParams(temperature=0.3, top_k=20, seed=100 + i, max_tokens=32) for i in range(len(prompts))]
    off = LLM(str(llama_dir), device="cuda", dtype="float32", async_scheduling=False)
    try:
        ref = [o.outputs[0].token_ids for o in off.generate(prompts, sps, use_tqdm=False)]
    finally:
        off.shutdown()
    spec = {"ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
            "draft_self": {"method": "draft_model", "model": str(llama_dir), "num_speculative_tokens": 3}}[method]
    kw: dict = {"num_gpu_blocks_override": 12, "max_model_len": 192} if mode.endswith("preemption") else {}
    llm = LLM(str(llama_dir), device="cuda", dtype="float32", speculative_config=spec,
              async_scheduling=mode.startswith("async"), **kw)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sps, use_tqdm=False)]
        assert got == ref
        st = llm.llm_engine.get_stats()
        assert st.spec_num_draft_tokens > 0
        if method == "draft_self":
            assert st.spec_num_accepted_tokens > 0
        if mode.endswith("preemption"):
            assert st.num_preemptions > 0
    finally:
        llm.shutdown()
