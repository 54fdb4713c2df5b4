"""The MoE models through the GPU compute path (Triton fused MoE, Triton attention and
ops, minus CUDA graphs) on CPU under triton's interpreter, token-exact against
transformers. Runs only with TRITON_INTERPRET=1 VENGINE_TRITON_OPS_ON_CPU=1 (slow)."""
from __future__ import annotations

import os

import pytest

from pyengine import LLM, SamplingParams
from pyengine.layers.fused_moe.layer import FusedMoE
from tests.helpers import build_tiny_model, hf_greedy, prompt_token_ids

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get("VENGINE_TRITON_OPS_ON_CPU") != "1",
    reason="set TRITON_INTERPRET=1 VENGINE_TRITON_OPS_ON_CPU=1")


@pytest.mark.parametrize("family,overrides", [("qwen3_moe", dict(decoder_sparse_step=2, num_hidden_layers=2)),
                                              ("mixtral", {}), ("qwen2_moe", dict(norm_topk_prob=True))])
def test_fused_moe_path_matches_transformers(family, overrides, tmp_path, tokenizer_dir, tokenizer, monkeypatch):
    d = build_tiny_model(tmp_path / family, family, tokenizer_dir, seed=21, **overrides)
    calls = []
    real = FusedMoE.forward
    monkeypatch.setattr(FusedMoE, "forward", lambda self, x, logits: calls.append(x.shape[0]) or real(self, x, logits))
    # 24-token steps: prompts of up to 30 tokens are prefilled in chunks (grouped GEMM
    # path) while the others decode (GEMV path below 5 tokens).
    prompts = prompt_token_ids(tokenizer, 4, 4, 30, seed=21)
    llm = LLM(str(d), device="cpu", attention_backend="triton", max_num_batched_tokens=24)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(d, prompts, 6, ignore_eos=True)
    assert min(calls) <= 4 < max(calls)  # both kernel paths ran
