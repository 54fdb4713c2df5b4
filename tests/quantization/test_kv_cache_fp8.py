"""FP8 KV cache (``kv_cache_dtype="fp8"``): e4m3 cache, per-layer scales from the checkpoint's
``kv_cache_scheme`` (else 1.0), twice the tokens in the same memory; the torch backend's
output equals transformers running compressed-tensors' K/V quantization with those scales."""
from __future__ import annotations

import pytest
import torch

from pyengine import LLM, SamplingParams
from pyengine.config import EngineArgs
from tests.helpers import hf_greedy, prompt_token_ids
from tests.quant_helpers import add_kv_cache_scales, compressed_tensors_checkpoint, hf_greedy_fp8_kv

MAX_TOKENS = 16


def _greedy(llm, prompts):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def kv_scheme(tmp_path_factory, llama_dir, tokenizer):
    """A compressed-tensors W4A16 checkpoint with FP8 KV cache scales (k_scale / v_scale per
    layer, calibrated) and its scales."""
    d = compressed_tensors_checkpoint(llama_dir, tmp_path_factory.mktemp("kv") / "m", "W4A16", group_size=32)
    return d, add_kv_cache_scales(d, prompt_token_ids(tokenizer, 4, seed=3))


def test_checkpoint_scales_match_transformers(kv_scheme, tokenizer):
    d, scales = kv_scheme
    prompts = prompt_token_ids(tokenizer, 4, seed=13)
    llm = LLM(str(d), device="cpu", kv_cache_dtype="fp8")
    runner = llm.llm_engine.engine_core.model_runner
    assert all(c.dtype == torch.float8_e4m3fn for c in runner.kv_caches)
    attn = runner.model.model.layers[1].self_attn
    assert (attn.k_scale, attn.v_scale) == pytest.approx(scales[1], rel=1e-6)  # read from the checkpoint
    got = _greedy(llm, prompts)
    assert got == hf_greedy_fp8_kv(d, prompts, MAX_TOKENS, scales)
    assert got != hf_greedy(d, prompts, MAX_TOKENS)  # the KV quantization is in effect


def test_bf16_cache_ignores_scales(kv_scheme, tokenizer):
    d, _ = kv_scheme
    prompts = prompt_token_ids(tokenizer, 2, seed=13)
    assert _greedy(LLM(str(d), device="cpu"), prompts) == hf_greedy(d, prompts, MAX_TOKENS)


def test_twice_the_tokens(llama_dir):
    blocks = {}
    for dtype in ("auto", "fp8"):
        llm = LLM(str(llama_dir), device="cpu", dtype="bfloat16", kv_cache_dtype=dtype, kv_cache_memory_bytes=1 << 20)
        blocks[dtype] = llm.llm_engine.engine_core.model_runner.num_blocks
    assert blocks["fp8"] in (2 * blocks["auto"], 2 * blocks["auto"] - 1, 2 * blocks["auto"] + 1)


def test_scale_one_without_checkpoint_scales(llama_dir, tokenizer):
    """A float checkpoint has no scales: 1.0 (vLLM's default); outputs stay close to the
    bf16 cache's (the first tokens agree)."""
    prompts = prompt_token_ids(tokenizer, 3, seed=14)
    llm = LLM(str(llama_dir), device="cpu", kv_cache_dtype="fp8")
    assert llm.llm_engine.engine_core.model_runner.model.model.layers[1].self_attn.k_scale == 1.0
    fp8 = _greedy(llm, prompts)
    ref = hf_greedy(llama_dir, prompts, MAX_TOKENS)
    assert all(a[:2] == b[:2] for a, b in zip(fp8, ref))


def test_unknown_kv_cache_dtype_refused(llama_dir):
    with pytest.raises(ValueError, match="fp8_e5m2"):
        EngineArgs(model=str(llama_dir), device="cpu", kv_cache_dtype="fp8_e5m2").create_engine_config()
