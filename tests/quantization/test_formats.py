"""GPTQ, AWQ and HF-native block FP8 checkpoints, written by the tests in those formats,
give on CPU exactly the greedy tokens of a plain model holding their dequantized weights
(transformers running it); ``quantization="fp8"`` quantizes a float checkpoint at load as
compressed-tensors' FP8_DYNAMIC does."""
from __future__ import annotations

import json

import pytest

from pyengine import LLM, SamplingParams
from tests.helpers import hf_greedy, prompt_token_ids
from tests.quant_helpers import awq_checkpoint, compressed_tensors_checkpoint, fp8_block_checkpoint, gptq_checkpoint

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return prompt_token_ids(tokenizer, 4, seed=21)


def _engine_greedy(model_dir, prompts, **kw):
    llm = LLM(str(model_dir), device="cpu", **kw)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


GPTQ_CASES = {
    "g32": dict(bits=4, group_size=32),
    "act_order": dict(bits=4, group_size=32, desc_act=True),
    "asym_v2": dict(bits=4, group_size=32, sym=False, checkpoint_format="gptq_v2"),
    "asym_v1": dict(bits=4, group_size=32, sym=False),
    "per_channel": dict(bits=4, group_size=-1),
    "int8": dict(bits=8, group_size=32, desc_act=True),
}


@pytest.mark.parametrize("case", list(GPTQ_CASES))
def test_gptq(case, model_dirs, prompts, tmp_path):
    family = "qwen2" if case == "asym_v1" else "llama"  # qwen2: qkv biases, tied embeddings
    q, plain = gptq_checkpoint(model_dirs[family], tmp_path / "q", tmp_path / "plain", **GPTQ_CASES[case])
    assert _engine_greedy(q, prompts) == hf_greedy(plain, prompts, MAX_TOKENS)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_awq(family, model_dirs, prompts, tmp_path):
    q, plain = awq_checkpoint(model_dirs[family], tmp_path / "q", tmp_path / "plain")
    ref = hf_greedy(plain, prompts, MAX_TOKENS)
    assert _engine_greedy(q, prompts) == ref
    assert ref != hf_greedy(model_dirs[family], prompts, MAX_TOKENS)  # 4 bits changed the model


@pytest.mark.parametrize("block", [(32, 32), (16, 32)])
def test_fp8_block(block, model_dirs, prompts, tmp_path):
    q, plain = fp8_block_checkpoint(model_dirs["qwen3"], tmp_path / "q", tmp_path / "plain", block=block)
    assert _engine_greedy(q, prompts) == hf_greedy(plain, prompts, MAX_TOKENS)


def test_gptq_sentencepiece(llama_sp_dir, sp_tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    prompts = prompt_token_ids(AutoTokenizer.from_pretrained(str(sp_tokenizer_dir)), 3, seed=3)
    q, plain = gptq_checkpoint(llama_sp_dir, tmp_path / "q", tmp_path / "plain", desc_act=True)
    assert _engine_greedy(q, prompts) == hf_greedy(plain, prompts, MAX_TOKENS)


def test_online_fp8_matches_fp8_dynamic(llama_dir, prompts, tmp_path):
    """quantization="fp8" on the float model == the FP8_DYNAMIC checkpoint of it (same
    per-channel weights, same per-token activations), run by transformers."""
    ct = compressed_tensors_checkpoint(llama_dir, tmp_path / "ct", "FP8_DYNAMIC")
    ref = hf_greedy(ct, prompts, MAX_TOKENS)
    assert _engine_greedy(llama_dir, prompts, quantization="fp8") == ref
    assert ref != hf_greedy(llama_dir, prompts, MAX_TOKENS)


@pytest.mark.parametrize("change, match", [
    ({"bits": 3}, "bits=3"), ({"checkpoint_format": "marlin"}, "marlin"), ({"lm_head": True}, "lm_head"),
])
def test_gptq_unsupported_refused(change, match, llama_dir, tmp_path):
    q, _ = gptq_checkpoint(llama_dir, tmp_path / "q", tmp_path / "plain")
    cfg = json.loads((q / "config.json").read_text())
    cfg["quantization_config"].update(change)
    (q / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        LLM(str(q), device="cpu")


def test_quantization_arg_must_agree_with_checkpoint(llama_dir, tmp_path):
    q, _ = gptq_checkpoint(llama_dir, tmp_path / "q", tmp_path / "plain")
    with pytest.raises(ValueError, match="quantized with 'gptq'"):
        LLM(str(q), device="cpu", quantization="fp8")
    with pytest.raises(ValueError, match="needs a checkpoint quantized with it"):
        LLM(str(llama_dir), device="cpu", quantization="awq")


def test_gptq_parts_with_different_act_order_refused(llama_dir, tmp_path):
    """q/k/v share one input, so one activation order: a checkpoint whose k_proj disagrees
    cannot be one fused layer, and is refused rather than loaded with q's order."""
    from safetensors.torch import load_file, save_file

    q, _ = gptq_checkpoint(llama_dir, tmp_path / "q", tmp_path / "plain", desc_act=True)
    sd = load_file(str(q / "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj.g_idx"
    sd[name] = sd[name].flip(0).contiguous()
    save_file(sd, str(q / "model.safetensors"))
    with pytest.raises(ValueError, match="g_idx.*differs"):
        LLM(str(q), device="cpu")



def test_gptq_g_idx_checked(llama_dir, tmp_path):
    """desc_act false with an act-order g_idx would dequantize other weights than its writer
    (a probe: loaded, other tokens); a g_idx past the scales' groups was an IndexError."""
    from safetensors.torch import load_file, save_file

    q, _ = gptq_checkpoint(llama_dir, tmp_path / "q", tmp_path / "plain", desc_act=True)
    cfg = json.loads((q / "config.json").read_text())
    cfg["quantization_config"]["desc_act"] = False
    (q / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="desc_act is false .* g_idx is not the trivial"):
        LLM(str(q), device="cpu")
    cfg["quantization_config"]["desc_act"] = True
    (q / "config.json").write_text(json.dumps(cfg))
    sd = load_file(str(q / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.g_idx"
    sd[name][0] = 99
    save_file(sd, str(q / "model.safetensors"))
    with pytest.raises(ValueError, match="'model.layers.1.mlp.down_proj'.*g_idx holds group 99"):
        LLM(str(q), device="cpu")


def test_gptq_null_checkpoint_format_is_the_default(llama_dir, prompts, tmp_path):
    q, plain = gptq_checkpoint(llama_dir, tmp_path / "q", tmp_path / "plain")
    cfg = json.loads((q / "config.json").read_text())
    cfg["quantization_config"]["checkpoint_format"] = None
    (q / "config.json").write_text(json.dumps(cfg))
    assert _engine_greedy(q, prompts) == hf_greedy(plain, prompts, MAX_TOKENS)


def test_fp8_block_power_of_two_scale_format_refused(model_dirs, tmp_path):
    q, _ = fp8_block_checkpoint(model_dirs["qwen3"], tmp_path / "q", tmp_path / "plain")
    cfg = json.loads((q / "config.json").read_text())
    cfg["quantization_config"]["scale_fmt"] = "ue8m0"
    (q / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="scale_fmt 'ue8m0' is not supported"):
        LLM(str(q), device="cpu")
