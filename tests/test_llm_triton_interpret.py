"""The GPU compute path (triton attention backend and fused triton ops, minus CUDA graphs)
run on CPU through triton's interpreter, token-exact against transformers. Runs only with
TRITON_INTERPRET=1 VENGINE_TRITON_OPS_ON_CPU=1 (the interpreter is slow); it catches
integration bugs between the model runner, the models and the kernels before a GPU run."""
from __future__ import annotations

import collections
import os

import pytest

from pyengine import LLM, SamplingParams
from tests.helpers import hf_greedy, prompt_token_ids

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get("VENGINE_TRITON_OPS_ON_CPU") != "1",
    reason="set TRITON_INTERPRET=1 VENGINE_TRITON_OPS_ON_CPU=1")


def count_launches(monkeypatch) -> collections.Counter:
    """Counts launches (``kernel[grid](...)``) of every triton kernel of pyengine/ops by
    kernel name, from now on: proof that the ops ran as triton, not as their torch
    fallbacks."""
    import triton.runtime

    from pyengine.ops import fused, paged_attention

    counts: collections.Counter = collections.Counter()
    for module in (fused, paged_attention):
        for name, kernel in vars(module).items():
            if isinstance(kernel, triton.runtime.KernelInterface):
                def run(*args, _run=kernel.run, _name=name, **kwargs):
                    counts[_name] += 1
                    return _run(*args, **kwargs)
                monkeypatch.setattr(kernel, "run", run)  # what kernel[grid](...) calls
    return counts


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_triton_path_matches_transformers(family, model_dirs, tokenizer, monkeypatch):
    prompts = prompt_token_ids(tokenizer, 4, 4, 30, seed=21)
    llm = LLM(str(model_dirs[family]), device="cpu", attention_backend="triton", max_num_batched_tokens=24)
    n = count_launches(monkeypatch)  # after start-up: only generate's forwards count
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model_dirs[family], prompts, 8, ignore_eos=True)
    # Every op of every layer of every forward ran as a triton kernel: per forward and
    # layer one fused RoPE + KV-cache write (with Qwen3's q/k norm), one attention
    # (prefill/extend or decode), one SiLU-and-mul, two RMSNorms; plus the final norm.
    layers = llm.llm_engine.config.hf_config.num_hidden_layers
    forwards, rest = divmod(n["_rope_cache_kernel"], layers)
    assert forwards > 0 and rest == 0, dict(n)
    assert n["_extend_kernel"] > 0 and n["_decode_split_kernel"] > 0, dict(n)  # prefill and decode steps
    assert n["_extend_kernel"] + n["_decode_split_kernel"] == n["_silu_and_mul_kernel"] == forwards * layers, dict(n)
    assert n["_rms_norm_kernel"] == forwards * (2 * layers + 1), dict(n)


def test_kernel_warm_up_writes_no_kv(model_dirs, tokenizer):
    llm = LLM(str(model_dirs["qwen3"]), device="cpu", attention_backend="triton")
    runner = llm.llm_engine.engine_core.model_runner
    for c in runner.kv_caches:
        c.fill_(0.5)
    runner._warm_up_kernels()
    assert all(bool((c == 0.5).all()) for c in runner.kv_caches)
    prompts = prompt_token_ids(tokenizer, 2, 4, 20, seed=5)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model_dirs["qwen3"], prompts, 4, ignore_eos=True)
