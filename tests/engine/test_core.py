"""EngineCore: vLLM's per-request error path. Any exception while adding or scheduling
ONE request ends only that request (finish_reason "error", the error text carried to the
front ends); the engine keeps stepping, the other requests' tokens are unchanged and no
KV block leaks."""
from __future__ import annotations

import pytest

from pyengine import LLM, SamplingParams
from tests.helpers import fail_request_add, fail_request_allocation, hf_greedy, prompt_token_ids

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return prompt_token_ids(tokenizer, 4, min_len=4, max_len=30, seed=11)


@pytest.fixture(scope="module")
def reference(llama_dir, prompts):
    return hf_greedy(llama_dir, prompts, MAX_TOKENS)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("where", ["add", "schedule"])
def test_one_failing_request_ends_only_itself(llama_dir, prompts, reference, monkeypatch, where,
                                              async_scheduling):
    llm = LLM(str(llama_dir), device="cpu", async_scheduling=async_scheduling)
    core = llm.llm_engine.engine_core
    bad = 1  # the prompt whose request fails
    if where == "add":
        fail_request_add(monkeypatch, prompts[bad])
    else:
        fail_request_allocation(monkeypatch, core, prompts[bad], after_tokens=3)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    for i, out in enumerate(outs):
        c = out.outputs[0]
        if i == bad:
            assert out.finished and c.finish_reason == "error"
            assert ("OverflowError: injected" if where == "add" else "RuntimeError: injected") in c.error
            assert c.token_ids == reference[i][:len(c.token_ids)] and len(c.token_ids) < MAX_TOKENS
        else:
            assert c.finish_reason == "length" and c.error is None
            assert c.token_ids == reference[i]
    stats = llm.llm_engine.get_stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_gpu_blocks, "KV blocks leaked"
    monkeypatch.undo()
    again = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                         use_tqdm=False)
    assert again[0].outputs[0].token_ids == reference[0]
