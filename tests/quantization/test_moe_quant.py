"""Quantized checkpoints of MoE models (``pyengine/models/loader.py``): attention (and
Qwen2-MoE's shared expert) quantized with the routers and experts in float runs token-exact
against transformers on the dequantized weights; experts stored quantized, or quantized at
load, are refused naming why (a helper's probe found every such load crashing with an
AttributeError on the router). Also the loader's other quantization checks a probe found
missing: a tied model's quantized ``lm_head`` and an MoE checkpoint's KV cache scales."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pyengine import LLM
from tests.helpers import build_tiny_model, engine_greedy, hf_greedy, prompt_token_ids
from tests.quant_helpers import add_kv_cache_scales, gptq_checkpoint

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return prompt_token_ids(tokenizer, 3, seed=31)


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("moe_quant")
    return {f: build_tiny_model(root / f, f, tokenizer_dir, seed=7) for f in ("qwen3_moe", "mixtral", "qwen2_moe")}


def _greedy(model_dir, prompts, **kw):
    return engine_greedy(model_dir, prompts, MAX_TOKENS, **kw)


def _experts_back_to_float(q: Path, plain: Path) -> None:
    """Replace the GPTQ tensors of every expert in ``q`` by the dequantized float weight
    (from ``plain``): the checkpoint then quantizes attention (and shared experts) only."""
    from safetensors.torch import load_file, save_file

    sd, ref = load_file(str(q / "model.safetensors")), load_file(str(plain / "model.safetensors"))
    sd = {k: v for k, v in sd.items() if ".experts." not in k}
    sd.update({k: v for k, v in ref.items() if ".experts." in k})
    save_file(sd, str(q / "model.safetensors"))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_gptq_attention_quantized_matches_transformers(family, moe_dirs, prompts, tmp_path):
    q, plain = gptq_checkpoint(moe_dirs[family], tmp_path / "q", tmp_path / "plain", group_size=16)
    _experts_back_to_float(q, plain)
    ref = hf_greedy(plain, prompts, MAX_TOKENS, ignore_eos=True)
    assert _greedy(q, prompts) == ref
    assert ref != hf_greedy(moe_dirs[family], prompts, MAX_TOKENS, ignore_eos=True)  # 4 bits changed it


def test_quantized_experts_refused(moe_dirs, tmp_path):
    q, _ = gptq_checkpoint(moe_dirs["qwen3_moe"], tmp_path / "q", tmp_path / "plain", group_size=16)
    with pytest.raises(ValueError, match=r"MoE experts stored quantized are not supported.*experts\.\d+\."):
        LLM(str(q), device="cpu")


def test_quantized_router_refused(moe_dirs, tmp_path):
    """Routers stay in float (ReplicatedLinear is never quantized): FP8 router weights with a
    scale are refused, never cast to float and run without it."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / "m"
    import shutil
    shutil.copytree(moe_dirs["mixtral"], d)
    sd = load_file(str(d / "model.safetensors"))
    name = "model.layers.0.block_sparse_moe.gate.weight"
    w = sd[name]
    scale = w.abs().amax(1, keepdim=True) / 448.0
    sd[name] = (w / scale).to(torch.float8_e4m3fn)
    sd[name + "_scale"] = scale
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"quantizes model.layers.0.block_sparse_moe.gate.weight.*routers and gates"):
        LLM(str(d), device="cpu")


def test_online_fp8_of_moe_refused(moe_dirs):
    with pytest.raises(ValueError, match="quantization='fp8' at load is not supported for Qwen3MoeForCausalLM: its "
                                         "MoE experts"):
        LLM(str(moe_dirs["qwen3_moe"]), device="cpu", quantization="fp8")


def test_moe_checkpoint_kv_cache_scales_load(moe_dirs, prompts, tokenizer, tmp_path):
    """llm-compressor's kv_cache_scheme scales (``self_attn.k_scale``) on an MoE model: used
    by the FP8 KV cache, ignored by the model dtype's one — not an unknown tensor."""
    import shutil
    d = tmp_path / "kv"
    shutil.copytree(moe_dirs["qwen3_moe"], d)
    add_kv_cache_scales(d, prompt_token_ids(tokenizer, 2, seed=5))
    assert _greedy(d, prompts) == hf_greedy(moe_dirs["qwen3_moe"], prompts, MAX_TOKENS, ignore_eos=True)
    LLM(str(d), device="cpu", kv_cache_dtype="fp8").shutdown()


def test_tied_quantized_lm_head_refused(tmp_path, tokenizer_dir):
    """A tied model whose checkpoint also holds a quantized lm_head: the head would run as the
    float embedding, so it is refused."""
    from safetensors.torch import load_file, save_file

    d = build_tiny_model(tmp_path / "tied", "llama", tokenizer_dir, tie_word_embeddings=True)
    sd = load_file(str(d / "model.safetensors"))
    w = sd["model.embed_tokens.weight"]
    scale = w.abs().amax(1, keepdim=True) / 448.0
    sd["lm_head.weight"] = (w / scale).to(torch.float8_e4m3fn)
    sd["lm_head.weight_scale"] = scale
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="lm_head.weight"):
        LLM(str(d), device="cpu")
