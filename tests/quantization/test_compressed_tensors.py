"""compressed-tensors checkpoints (llm-compressor's schemes) give transformers' greedy
tokens exactly on CPU: transformers with compressed-tensors decompresses the weights and
runs the schemes' activation quantization; the engine dequantizes at load and reproduces
it."""
from __future__ import annotations

import pytest
import torch

from pyengine import LLM, SamplingParams
from tests.helpers import hf_greedy, prompt_token_ids
from tests.quant_helpers import compressed_tensors_checkpoint

MAX_TOKENS = 16
SCHEMES = {
    "FP8_DYNAMIC": {},
    "W4A16": {"group_size": 32},
    "W4A16_ASYM": {"group_size": 32, "plain": True},
    "W8A16": {"group_size": 32},
    "FP8": {"calibrate": True},  # static per-tensor activation scales
    "FP8_BLOCK": {"block": (32, 32)},
}


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return prompt_token_ids(tokenizer, 4, seed=11)


def _engine_greedy(model_dir, prompts, **kw):
    llm = LLM(str(model_dir), device="cpu", **kw)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_scheme_matches_transformers(scheme, llama_dir, tokenizer, prompts, tmp_path):
    opts = dict(SCHEMES[scheme])
    calib = prompt_token_ids(tokenizer, 4, seed=5) if opts.pop("calibrate", False) else None
    plain = tmp_path / "plain" if opts.pop("plain", False) else None
    d = compressed_tensors_checkpoint(llama_dir, tmp_path / scheme, scheme, calibration=calib, plain_dir=plain, **opts)
    # transformers mis-sizes asymmetric INT4's packed zero points: there the oracle is the float
    # model holding compressed-tensors' own decompression of the checkpoint.
    ref = hf_greedy(plain or d, prompts, MAX_TOKENS)
    assert _engine_greedy(d, prompts) == ref
    # the quantization is not a no-op: the float model's tokens differ somewhere
    assert hf_greedy(llama_dir, prompts, MAX_TOKENS) != ref or scheme == "W8A16"


@pytest.mark.parametrize("scheme", ["FP8_DYNAMIC", "FP8", "W4A16"])
def test_qwen3_scheme_matches_transformers(scheme, qwen3_dir, tokenizer, prompts, tmp_path):
    """A Qwen3 (per-head q/k norms, a sharded source checkpoint) quantized by compressed-tensors:
    W8A8 FP8 with dynamic per-token and static per-tensor activations, and pack-quantized
    W4A16 (group 32: the tiny model is 64 wide)."""
    opts = dict(SCHEMES[scheme])
    calib = prompt_token_ids(tokenizer, 4, seed=5) if opts.pop("calibrate", False) else None
    d = compressed_tensors_checkpoint(qwen3_dir, tmp_path / scheme, scheme, calibration=calib, **opts)
    assert _engine_greedy(d, prompts) == hf_greedy(d, prompts, MAX_TOKENS)


@pytest.mark.parametrize("scheme", ["FP8_DYNAMIC", "W4A16"])
def test_sentencepiece_model(scheme, llama_sp_dir, sp_tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    prompts = prompt_token_ids(AutoTokenizer.from_pretrained(str(sp_tokenizer_dir)), 3, seed=2)
    d = compressed_tensors_checkpoint(llama_sp_dir, tmp_path / scheme, scheme, **SCHEMES[scheme])
    assert _engine_greedy(d, prompts) == hf_greedy(d, prompts, MAX_TOKENS)


def test_fused_parts_quantized_differently_refused(llama_dir, tmp_path):
    d = compressed_tensors_checkpoint(llama_dir, tmp_path / "m", "FP8_DYNAMIC",
                                      ignore=["lm_head", "re:.*layers\\.0\\.self_attn\\.k_proj"])
    with pytest.raises(ValueError, match="qkv_proj"):
        LLM(str(d), device="cpu")


def test_ignored_layers_stay_unquantized(llama_dir, tokenizer, prompts, tmp_path):
    d = compressed_tensors_checkpoint(llama_dir, tmp_path / "m", "W4A16", group_size=32,
                                      ignore=["lm_head", "re:.*mlp\\.down_proj"])
    assert _engine_greedy(d, prompts) == hf_greedy(d, prompts, MAX_TOKENS)


def test_unsupported_scheme_refused_naming_it(llama_dir, tmp_path):
    d = compressed_tensors_checkpoint(llama_dir, tmp_path / "m", "W8A8")
    with pytest.raises(ValueError, match="activation quantization"):
        LLM(str(d), device="cpu")


def _group(targets, weights, input_activations=None, fmt=None):
    g = {"targets": targets, "weights": weights}
    if input_activations is not None:
        g["input_activations"] = input_activations
    if fmt is not None:
        g["format"] = fmt
    return g


FP8_CHANNEL = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
FP8_TOKEN = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
W4_G16 = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 16, "symmetric": True, "dynamic": False}


@pytest.mark.parametrize("order", ["class_first", "regex_first"])
def test_overlapping_groups_take_compressed_tensors_precedence(order):
    """A layer two groups target gets the most specific one: exact name, then ``re:``, then a
    class name (compressed-tensors' ``match_targets``), whatever the groups' order — a probe
    found the first group in config.json order applied (FP8 activations on MLP layers a
    weight-only group targets: other tokens than transformers)."""
    from pyengine.layers.quantization.compressed_tensors import CompressedTensorsConfig

    groups = {"a": _group(["Linear"], FP8_CHANNEL, FP8_TOKEN, "float-quantized"),
              "b": _group(["re:.*mlp.*"], W4_G16, fmt="pack-quantized"),
              "c": _group(["model.layers.0.mlp.down_proj"], FP8_CHANNEL, fmt="float-quantized")}
    if order == "regex_first":
        groups = dict(reversed(list(groups.items())))
    cfg = CompressedTensorsConfig.from_config({"quant_method": "compressed-tensors", "config_groups": groups})
    got = {n: (s.kind, s.act) for n in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.up_proj",
                                        "model.layers.0.mlp.down_proj")
           for s in [cfg._scheme_for(n)]}
    assert got == {"model.layers.0.self_attn.q_proj": ("fp8", "token"), "model.layers.1.mlp.up_proj": ("int", None),
                   "model.layers.0.mlp.down_proj": ("fp8", None)}


def test_kv_cache_scheme_alone_is_accepted():
    """What llm-compressor writes for a KV-cache-only recipe: no config groups."""
    from pyengine.layers.quantization.compressed_tensors import CompressedTensorsConfig

    kv = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    cfg = CompressedTensorsConfig.from_config({"quant_method": "compressed-tensors", "config_groups": {},
                                               "kv_cache_scheme": kv})
    assert cfg.kv_cache_scales() and cfg._scheme_for("model.layers.0.self_attn.q_proj") is None
    with pytest.raises(ValueError, match="without config_groups"):
        CompressedTensorsConfig.from_config({"quant_method": "compressed-tensors", "config_groups": {}})


def test_fused_parts_static_input_scales_must_agree():
    """q/k/v (gate/up) share their input: one static scale quantizes it. vLLM takes the
    largest of the parts'; that is not what each part's own scale computes, so differing
    scales are refused."""
    from torch import nn

    from pyengine.layers.quantization.utils import fused_input_scale

    layer = nn.Module()
    layer.input_scale = nn.Parameter(torch.tensor([0.5, 0.5, 0.5]), requires_grad=False)
    assert fused_input_scale(layer).item() == 0.5
    layer.input_scale.data[1] = 25.0
    with pytest.raises(ValueError, match=r"static input_scale values differ \(\[0.5, 25.0, 0.5\]\)"):
        fused_input_scale(layer)


def test_naive_quantized_fp8_and_dense_sparsity_accepted():
    """compressed-tensors writes FP8 weight-only groups as naive-quantized (its float-quantized
    compressor is an alias) and a dense model's sparsity_config as format "dense"."""
    from pyengine.layers.quantization.compressed_tensors import CompressedTensorsConfig

    cfg = CompressedTensorsConfig.from_config({
        "quant_method": "compressed-tensors", "format": "naive-quantized",
        "sparsity_config": {"format": "dense", "targets": []},
        "config_groups": {"g": _group(["Linear"], FP8_CHANNEL)}})
    s = cfg._scheme_for("model.layers.0.mlp.down_proj")
    assert (s.kind, s.strategy, s.act) == ("fp8", "channel", None)
    with pytest.raises(ValueError, match="sparsity_config"):
        CompressedTensorsConfig.from_config({"quant_method": "compressed-tensors",
                                             "sparsity_config": {"format": "sparse-24-bitmask"},
                                             "config_groups": {"g": _group(["Linear"], FP8_CHANNEL)}})


def test_fused_parts_in_groups_of_the_same_scheme_load_as_one():
    """q_proj named by one group, k/v by a class target of an identical scheme: one method
    (a probe found it refused as "different quantization schemes")."""
    from pyengine.layers.quantization.compressed_tensors import CompressedTensorsConfig

    cfg = CompressedTensorsConfig.from_config({"quant_method": "compressed-tensors", "config_groups": {
        "a": _group(["model.layers.0.self_attn.q_proj"], W4_G16, fmt="pack-quantized"),
        "b": _group(["Linear"], W4_G16, fmt="pack-quantized")}})
    names = [f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]
    method = cfg.get_quant_method(None, "model.layers.0.self_attn.qkv_proj", names)
    assert method.scheme.kind == "int" and method.scheme.group_size == 16


def test_naive_quantized_fp8_checkpoint_matches_transformers(llama_dir, prompts, tmp_path):
    """The FP8_DYNAMIC tensors under compressed-tensors' naive-quantized format name (its
    float-quantized compressor is an alias): transformers decompresses them with the naive
    compressor, the engine loads them as float-quantized; the same tokens."""
    import json

    d = compressed_tensors_checkpoint(llama_dir, tmp_path / "ct", "FP8_DYNAMIC")
    cfg = json.loads((d / "config.json").read_text())
    qc = cfg["quantization_config"]
    qc["format"] = "naive-quantized"
    for g in qc["config_groups"].values():
        g["format"] = "naive-quantized"
    (d / "config.json").write_text(json.dumps(cfg))
    ref = hf_greedy(d, prompts, MAX_TOKENS)
    assert _engine_greedy(d, prompts) == ref
    assert ref != hf_greedy(llama_dir, prompts, MAX_TOKENS)  # FP8 changed the model
