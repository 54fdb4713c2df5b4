"""Quantized checkpoints under tensor parallelism (2 ranks, gloo on CPU): each rank loads its
part of the packed weights, scales and zero points (GPTQ act order: the row-parallel
layers' scales whole, g_idx split), and greedy output equals one rank's."""
from __future__ import annotations

import pytest

from pyengine import LLM, SamplingParams
from tests.helpers import prompt_token_ids
from tests.quant_helpers import add_kv_cache_scales, compressed_tensors_checkpoint, gptq_checkpoint

MAX_TOKENS = 12


def _greedy(model_dir, prompts, **kw):
    llm = LLM(str(model_dir), device="cpu", **kw)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()


@pytest.mark.timeout(600)
# FP8 with static activation scales: a dynamic per-token scale of a row-parallel layer's input
# comes from each rank's slice of the token (as in vLLM), so TP=2 is not bitwise TP=1 there.
@pytest.mark.parametrize("fmt", ["gptq_act_order", "w4a16_asym", "fp8_static", "fp8_kv_cache"])
def test_tp2_matches_tp1(fmt, llama_dir, tokenizer, tmp_path):
    prompts = prompt_token_ids(tokenizer, 3, seed=8)
    kw = {}
    if fmt == "gptq_act_order":
        d, _ = gptq_checkpoint(llama_dir, tmp_path / "q", tmp_path / "plain", desc_act=True)
    elif fmt == "w4a16_asym":
        d = compressed_tensors_checkpoint(llama_dir, tmp_path / "q", "W4A16_ASYM", group_size=32)
    elif fmt == "fp8_static":
        d = compressed_tensors_checkpoint(llama_dir, tmp_path / "q", "FP8",
                                          calibration=prompt_token_ids(tokenizer, 2, seed=1))
    else:  # each rank's KV heads in an FP8 cache with the layer's checkpoint scales
        d = compressed_tensors_checkpoint(llama_dir, tmp_path / "q", "W4A16", group_size=32)
        add_kv_cache_scales(d, prompt_token_ids(tokenizer, 2, seed=1))
        kw = {"kv_cache_dtype": "fp8"}
    assert _greedy(d, prompts, tensor_parallel_size=2, **kw) == _greedy(d, prompts, **kw)
