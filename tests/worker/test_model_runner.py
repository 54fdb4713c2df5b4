"""ModelRunner: KV cache sizing, async placeholder feeding, CUDA graphs (gpu)."""
from __future__ import annotations

import pytest

from pyengine import LLM, EngineArgs, SamplingParams
from pyengine.worker.cuda_graph import capture_sizes
from pyengine.worker.model_runner import ModelRunner
from tests.helpers import hf_greedy, prompt_token_ids


def test_kv_cache_sizing(llama_dir):
    cfg = EngineArgs(model=str(llama_dir), device="cpu", num_gpu_blocks_override=10).create_engine_config()
    runner = ModelRunner(cfg)
    assert runner.determine_num_blocks() == 11  # + the null block
    per_block = runner.kv_bytes_per_block()
    d = runner.dims
    assert per_block == 2 * d.num_layers * cfg.block_size * d.num_kv_heads * d.head_dim * 4  # fp32
    cfg2 = EngineArgs(model=str(llama_dir), device="cpu", kv_cache_memory_bytes=per_block * 33).create_engine_config()
    assert ModelRunner(cfg2).determine_num_blocks() == 33
    n = runner.initialize_kv_cache()
    assert len(runner.kv_caches) == d.num_layers
    assert runner.kv_caches[0].shape == (2, n, cfg.block_size, d.num_kv_heads, d.head_dim)


def test_capture_sizes():
    assert capture_sizes(256)[:6] == [1, 2, 4, 8, 16, 24]
    assert capture_sizes(256)[-1] == 256 and all(b > a for a, b in zip(capture_sizes(256), capture_sizes(256)[1:]))
    assert capture_sizes(5) == [1, 2, 4, 5]


def test_async_steps_feed_placeholders_from_device(llama_dir, tokenizer):
    """With async scheduling every decode input after the first token comes from the
    previous step's device tensor; the output must still equal transformers'."""
    llm = LLM(str(llama_dir), device="cpu", async_scheduling=True)
    runner = llm.llm_engine.engine_core.model_runner
    fed = {"placeholders": 0, "odd_sizes": 0}
    orig = runner._prepare_inputs

    def spy(so):
        fed["placeholders"] += sum(s.placeholder_input for s in so.scheduled)
        out = orig(so)
        ids, pos, meta = out[:3]
        # every device view starts 16-byte aligned (triton specialises on pointer alignment)
        views = [ids, pos, meta.query_start_loc, meta.seq_lens, meta.block_table, meta.slot_mapping]
        fed["odd_sizes"] += meta.num_actual_tokens % 2 or meta.num_reqs % 4 != 3
        assert all(v.storage_offset() * v.element_size() % 16 == 0 for v in views)
        return out
    runner._prepare_inputs = spy
    prompts = prompt_token_ids(tokenizer, 4, 4, 20, seed=11)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(llama_dir, prompts, 12, ignore_eos=True)
    assert fed["placeholders"] >= 4 * 10
    assert fed["odd_sizes"] > 0  # the alignment check saw sizes that would misalign unpadded views


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_match_eager(qwen3_dir, tokenizer, dtype):
    prompts = prompt_token_ids(tokenizer, 12, 4, 40, seed=12)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    results = {}
    for eager in (True, False):
        llm = LLM(str(qwen3_dir), device="cuda", dtype=dtype, max_num_seqs=16, enforce_eager=eager)
        assert (llm.llm_engine.engine_core.model_runner.graph_runner is None) == eager
        results[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        llm.shutdown()
    assert results[True] == results[False]
    if dtype == "float32":
        assert results[False] == hf_greedy(qwen3_dir, prompts, 24, ignore_eos=True)


def test_seeded_sampling_unchanged_by_preemption_under_async_scheduling(llama_dir, tokenizer):
    """A preempted request's in-flight token is dropped under async scheduling; its seeded
    generator is rewound by that draw, so it samples the same tokens as with sync
    scheduling and no preemption."""
    prompts = prompt_token_ids(tokenizer, 12, 10, 30, seed=4)
    sps = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=12, ignore_eos=True) for i in range(12)]

    def run(**kw):
        llm = LLM(str(llama_dir), device="cpu", block_size=4, max_model_len=48, **kw)
        outs = llm.generate(prompts, sps, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.llm_engine.get_stats().num_preemptions

    ref, _ = run(async_scheduling=False)
    got, preemptions = run(async_scheduling=True, num_gpu_blocks_override=14)
    assert preemptions > 0
    assert got == ref
