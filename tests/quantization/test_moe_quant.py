"""Quantized checkpoints of MoE models (``pyengine/models/loader.py``): attention (and
Qwen2-MoE's shared expert) quantized with the routers and experts in float runs token-exact
against transformers on the dequantized weights; FP8 experts (compressed-tensors and HF
``fp8``, per tensor / channel / block, and ``quantization="fp8"`` at load) load into the
fused MoE (``Fp8MoEMethod``) and run token-exact against transformers on the dequantized
weights, under tensor parallelism too; so do INT4 / INT8 experts (GPTQ, AWQ,
compressed-tensors pack-quantized: ``MoeWNA16Method``); experts stored quantized where the
config keeps them float, or float where it quantizes them, are refused naming why. Also
the loader's other quantization checks a probe found missing: a tied model's quantized
``lm_head`` and an MoE checkpoint's KV cache scales."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pyengine import LLM, SamplingParams
from tests.helpers import build_tiny_model, engine_greedy, hf_greedy, prompt_token_ids
from tests.quant_helpers import (
    add_kv_cache_scales,
    awq_checkpoint,
    compressed_tensors_checkpoint,
    compressed_tensors_moe_checkpoint,
    fp8_moe_checkpoint,
    gptq_checkpoint,
)

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
    (from ``plain``): the checkpoint then quantizes attention (and shared experts) only, and
    its config says so (``modules_in_block_to_quantize``)."""
    import json

    from safetensors.torch import load_file, save_file

    sd, ref = load_file(str(q / "model.safetensors")), load_file(str(plain / "model.safetensors"))
    sd = {k: v for k, v in sd.items() if ".experts." not in k}
    sd.update({k: v for k, v in ref.items() if ".experts." in k})
    save_file(sd, str(q / "model.safetensors"))
    cfg = json.loads((q / "config.json").read_text())
    cfg["quantization_config"]["modules_in_block_to_quantize"] = [
        [f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")],
        [f"shared_expert.{p}" for p in ("gate_proj", "up_proj", "down_proj")]]
    (q / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_gptq_attention_quantized_matches_transformers(family, moe_dirs, prompts, tmp_path):
    q, plain = gptq_checkpoint(moe_dirs[family], tmp_path / "q", tmp_path / "plain", group_size=16)
    _experts_back_to_float(q, plain)
    ref = hf_greedy(plain, prompts, MAX_TOKENS, ignore_eos=True)
    assert _greedy(q, prompts) == ref
    assert ref != hf_greedy(moe_dirs[family], prompts, MAX_TOKENS, ignore_eos=True)  # 4 bits changed it


def test_quantized_experts_the_config_leaves_out_refused(moe_dirs, tmp_path):
    """GPTQ experts while ``modules_in_block_to_quantize`` names attention only: the experts'
    tensors have nowhere to go (the config keeps them float), refused naming them."""
    import json
    q, _ = gptq_checkpoint(moe_dirs["qwen3_moe"], tmp_path / "q", tmp_path / "plain", group_size=16)
    cfg = json.loads((q / "config.json").read_text())
    cfg["quantization_config"]["modules_in_block_to_quantize"] = [["self_attn.q_proj", "self_attn.k_proj",
                                                                   "self_attn.v_proj", "self_attn.o_proj"]]
    (q / "config.json").write_text(json.dumps(cfg))
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


# (family, checkpoint format, scale form, block, activations, experts only)
FP8_CASES = [
    ("qwen3_moe", "compressed-tensors", "channel", None, None, False),
    ("mixtral", "compressed-tensors", "tensor", None, None, False),
    ("qwen2_moe", "compressed-tensors", "block", (16, 16), None, False),
    ("qwen3_moe", "compressed-tensors", "channel", None, "token", True),  # FP8_DYNAMIC experts: weight-only
    ("qwen3_moe", "fp8", "block", (16, 32), None, False),  # Qwen3-30B-A3B-FP8's format
    ("mixtral", "fp8", "tensor", None, None, True),
]


@pytest.mark.parametrize("family,fmt,form,block,act,experts_only", FP8_CASES)
def test_fp8_experts_match_transformers_on_dequantized_weights(family, fmt, form, block, act, experts_only,
                                                               moe_dirs, prompts, tmp_path):
    q, plain = fp8_moe_checkpoint(moe_dirs[family], tmp_path / "q", tmp_path / "plain", fmt=fmt, form=form,
                                  block=block, act=act, experts_only=experts_only)
    ref = hf_greedy(plain, prompts, MAX_TOKENS, ignore_eos=True)
    assert _greedy(q, prompts) == ref
    if (family, form) == ("qwen3_moe", "channel") and not experts_only:
        assert ref != hf_greedy(moe_dirs[family], prompts, MAX_TOKENS, ignore_eos=True)  # FP8 changed it


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fmt,form,block", [("compressed-tensors", "channel", None), ("fp8", "block", (16, 16))])
def test_fp8_experts_tp2_and_expert_parallel(fmt, form, block, moe_dirs, prompts, tmp_path):
    """Each rank's gate/up rows and down columns of every expert, with their scales (block
    scales split by block), or whole experts with expert parallelism."""
    q, plain = fp8_moe_checkpoint(moe_dirs["qwen3_moe"], tmp_path / "q", tmp_path / "plain", fmt=fmt, form=form,
                                  block=block)
    ref = hf_greedy(plain, prompts, MAX_TOKENS, ignore_eos=True)
    assert _greedy(q, prompts, tensor_parallel_size=2) == ref
    assert _greedy(q, prompts, tensor_parallel_size=2, enable_expert_parallel=True) == ref


def test_online_fp8_quantizes_the_experts(moe_dirs, prompts, tmp_path):
    """``quantization="fp8"`` at load quantizes the experts per output row as well as the
    dense layers (vLLM's ``fp8`` method): the same tokens as a checkpoint quantized that way
    (FP8_DYNAMIC attention, per-channel experts), which other tests check against transformers."""
    d = moe_dirs["qwen3_moe"]
    online = _greedy(d, prompts, quantization="fp8")
    q, _ = fp8_moe_checkpoint(d, tmp_path / "q", tmp_path / "plain", form="channel", act="token")
    assert online == _greedy(q, prompts)
    assert online != _greedy(d, prompts)  # FP8's rounding changed it


def test_fp8_experts_dummy_weights_run(moe_dirs):
    for kw in ({"quantization": "fp8"}, {}):
        llm = LLM(str(moe_dirs["mixtral"]), device="cpu", load_format="dummy", **kw)
        try:
            assert len(llm.generate([[1, 2, 3]], None, use_tqdm=False)[0].outputs[0].token_ids) > 0
        finally:
            llm.shutdown()


def test_float_experts_under_an_int_config_refused(moe_dirs, tmp_path):
    """compressed-tensors' ``Linear`` target covers the experts, but transformers' stacked
    experts are no ``Linear``s, so compressed-tensors alone leaves them float: the checkpoint
    and its config disagree, and that is said at load, not run either way."""
    d = compressed_tensors_checkpoint(moe_dirs["qwen3_moe"], tmp_path / "q", "W4A16", group_size=16,
                                      ignore=["lm_head", "re:.*mlp.gate$"])
    with pytest.raises(ValueError, match=r"experts\.0\.\w+\.weight' is an unquantized expert tensor, but the "
                                         r"quantization_config quantizes the experts"):
        LLM(str(d), device="cpu")


# INT4 / INT8 weight-only experts (moe_wna16): (family, format, writer options)
INT_CASES = [
    ("qwen3_moe", "gptq", {"bits": 4, "group_size": 16}),
    ("mixtral", "gptq", {"bits": 8, "group_size": -1, "checkpoint_format": "gptq_v2"}),  # per channel
    ("qwen2_moe", "gptq", {"bits": 4, "group_size": 16, "desc_act": True, "sym": False}),  # act order: dequantized
    ("qwen3_moe", "awq", {"group_size": 16}),
    ("mixtral", "compressed-tensors", {"scheme": "W4A16", "group_size": 16}),
    ("qwen2_moe", "compressed-tensors", {"scheme": "W4A16_ASYM", "group_size": 16}),
    ("qwen3_moe", "compressed-tensors", {"scheme": "W8A16", "group_size": 32}),
]


def int_moe_checkpoint(src: Path, root: Path, fmt: str, opts: dict) -> tuple[Path, Path]:
    """(quantized checkpoint, plain model of its dequantized weights) of ``fmt`` with every
    linear layer and expert projection quantized, the routers float."""
    if fmt == "gptq":
        return gptq_checkpoint(src, root / "q", root / "plain", **opts)
    if fmt == "awq":
        return awq_checkpoint(src, root / "q", root / "plain", **opts)
    return compressed_tensors_moe_checkpoint(src, root / "q", root / "plain", **opts)


@pytest.mark.parametrize("family,fmt,opts", INT_CASES)
def test_int_experts_match_transformers_on_dequantized_weights(family, fmt, opts, moe_dirs, prompts, tmp_path):
    q, plain = int_moe_checkpoint(moe_dirs[family], tmp_path, fmt, opts)
    ref = hf_greedy(plain, prompts, MAX_TOKENS, ignore_eos=True)
    assert _greedy(q, prompts) == ref
    if (family, fmt) == ("qwen3_moe", "gptq"):
        assert ref != hf_greedy(moe_dirs[family], prompts, MAX_TOKENS, ignore_eos=True)  # 4 bits changed it


@pytest.mark.timeout(600)
@pytest.mark.parametrize("family,fmt,opts", [
    ("qwen3_moe", "gptq", {"bits": 4, "group_size": 16, "desc_act": True}),
    # Mixtral's experts sit under a name the loader renames (block_sparse_moe -> mlp): another
    # rank's expert must be recognised by its renamed path
    ("mixtral", "compressed-tensors", {"scheme": "W4A16_ASYM", "group_size": 16})])
def test_int_experts_tp2_and_expert_parallel(family, fmt, opts, moe_dirs, prompts, tmp_path):
    """Each rank's gate/up rows and down columns of every expert (packed words, groups, zero
    points and act-order g_idx split as the dense layers split them), or whole experts."""
    q, plain = int_moe_checkpoint(moe_dirs[family], tmp_path, fmt, opts)
    ref = hf_greedy(plain, prompts, MAX_TOKENS, ignore_eos=True)
    assert _greedy(q, prompts, tensor_parallel_size=2) == ref
    assert _greedy(q, prompts, tensor_parallel_size=2, enable_expert_parallel=True) == ref


def test_int_experts_with_a_sentencepiece_tokenizer(sp_tokenizer_dir, tmp_path):
    """The fixture rule's other tokenizer kind: a GPTQ MoE model with a SentencePiece
    tokenizer, generating text through the tokenizer, against transformers."""
    from transformers import AutoTokenizer

    d = build_tiny_model(tmp_path / "m", "mixtral", sp_tokenizer_dir, seed=3)
    q, plain = gptq_checkpoint(d, tmp_path / "q", tmp_path / "plain", group_size=16)
    tok = AutoTokenizer.from_pretrained(str(q))
    prompts = [tok("Grüße aus Köln, 東京").input_ids, tok("the quick brown fox").input_ids]
    ref = hf_greedy(plain, prompts, MAX_TOKENS, ignore_eos=True)
    llm = LLM(str(q), device="cpu")
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                            use_tqdm=False)
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == ref
    assert [o.outputs[0].text for o in outs] == [tok.decode(r, skip_special_tokens=True) for r in ref]


def test_int_experts_dummy_weights_run(moe_dirs, tmp_path):
    q, _ = gptq_checkpoint(moe_dirs["qwen2_moe"], tmp_path / "q", tmp_path / "plain", group_size=16)
    llm = LLM(str(q), device="cpu", load_format="dummy")
    try:
        assert len(llm.generate([[1, 2, 3]], None, use_tqdm=False)[0].outputs[0].token_ids) > 0
    finally:
        llm.shutdown()


def test_int_expert_id_past_the_models_experts_refused(moe_dirs, tmp_path):
    """A whole extra expert (id 8 of 8) is an unknown tensor, not another rank's expert."""
    from safetensors.torch import load_file, save_file

    q, _ = gptq_checkpoint(moe_dirs["qwen3_moe"], tmp_path / "q", tmp_path / "plain", group_size=16)
    sd = load_file(str(q / "model.safetensors"))
    src = "model.layers.0.mlp.experts.0."
    sd.update({"model.layers.0.mlp.experts.8." + k[len(src):]: v.clone() for k, v in sd.items() if k.startswith(src)})
    save_file(sd, str(q / "model.safetensors"))
    for kw in ({}, {"tensor_parallel_size": 2, "enable_expert_parallel": True}):
        with pytest.raises(ValueError, match=r"experts\.8\..*expert id 8 out of range: the model has 8 experts"):
            LLM(str(q), device="cpu", **kw)


@pytest.mark.timeout(300)
def test_gptq_dummy_weights_under_tensor_parallelism(moe_dirs, tmp_path):
    """Dummy GPTQ weights are a valid checkpoint on every rank: a row-parallel layer's g_idx
    holds its rows' global groups (benchmarks/moe.py --quantization gptq -tp 2)."""
    q, _ = gptq_checkpoint(moe_dirs["qwen3_moe"], tmp_path / "q", tmp_path / "plain", group_size=16)
    llm = LLM(str(q), device="cpu", load_format="dummy", tensor_parallel_size=2)
    try:
        assert len(llm.generate([[1, 2, 3]], None, use_tqdm=False)[0].outputs[0].token_ids) > 0
    finally:
        llm.shutdown()


def test_compressed_tensors_g_idx_past_its_groups_refused():
    from pyengine.layers.linear import RowParallelLinear
    from pyengine.layers.quantization.compressed_tensors import CompressedTensorsWNA16, Scheme
    from pyengine.layers.quantization.utils import pack_int32

    lin = RowParallelLinear(32, 16)
    lin.set_quant_method(CompressedTensorsWNA16(Scheme(("Linear",), "int", 4, "group", group_size=16,
                                                       actorder="group")))
    lin.weight_packed.data.copy_(pack_int32(torch.randint(0, 16, (16, 32)), 4, 1))
    lin.weight_scale.data.fill_(0.01)
    g_idx = torch.arange(32) // 16
    g_idx[5] = 2
    lin.weight_g_idx.data.copy_(g_idx)
    with pytest.raises(ValueError, match="g_idx holds group 2 .*outside the 2 groups of its scales"):
        lin.quant_method.process_weights_after_loading(lin)


def test_int_expert_bits_refused():
    from pyengine.layers.quantization.moe_wna16 import MoeWNA16Method

    with pytest.raises(ValueError, match="3-bit weights are not supported"):
        MoeWNA16Method(lambda: None, 3, "GPTQ")


def test_fp8_experts_the_config_leaves_float_refused(moe_dirs, tmp_path):
    """Experts stored FP8 while the config's ignore list keeps them float: refused, never run
    as if the FP8 values were the weights."""
    import json
    q, _ = fp8_moe_checkpoint(moe_dirs["qwen3_moe"], tmp_path / "q", tmp_path / "plain", form="channel")
    cfg = json.loads((q / "config.json").read_text())
    cfg["quantization_config"]["ignore"].append("re:.*experts.*")
    (q / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"MoE experts stored quantized are not supported in this form"):
        LLM(str(q), device="cpu")


def test_fp8_block_that_does_not_divide_the_ranks_rows_refused():
    from types import SimpleNamespace

    from pyengine.layers.fused_moe.layer import FusedMoE
    from pyengine.layers.quantization.fp8 import Fp8MoEMethod

    moe = FusedMoE(4, 2, 64, 32, True, tp_group=SimpleNamespace(world_size=2, rank=1))
    with pytest.raises(ValueError, match=r"block rows 32 do not divide this rank's 16 gate/up rows"):
        moe.set_quant_method(Fp8MoEMethod("block", (32, 32)))
    moe.set_quant_method(Fp8MoEMethod("block", (16, 16), scale_name="weight_scale_inv"))
    assert moe.w13_weight.dtype == torch.float8_e4m3fn
    assert moe.w13_weight_scale_inv.shape == (4, 2, 4) and moe.w2_weight_scale_inv.shape == (4, 4, 1)


def test_fp8_experts_with_static_input_scales_refused():
    """The experts run weight-only: a static activation scale would go unused, so a config
    that prescribes one for them is refused (HF fp8 and compressed-tensors alike)."""
    from pyengine.layers.quantization.compressed_tensors import CompressedTensorsConfig
    from pyengine.layers.quantization.fp8 import Fp8Config

    names = [f"model.layers.0.mlp.experts.{e}.{p}" for e in range(2) for p in ("gate_proj", "up_proj", "down_proj")]
    prefix = "model.layers.0.mlp.experts"
    static = Fp8Config.from_config({"quant_method": "fp8", "activation_scheme": "static"})
    with pytest.raises(ValueError, match="static activation scales"):
        static.get_moe_method(None, prefix, names)
    assert Fp8Config.from_config({"quant_method": "fp8", "modules_to_not_convert": ["experts"]}).get_moe_method(
        None, prefix, names) is None
    w = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "tensor"}
    a = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "tensor"}
    ct = CompressedTensorsConfig.from_config({"quant_method": "compressed-tensors", "config_groups": {
        "g": {"targets": ["Linear"], "weights": w, "input_activations": a, "format": "float-quantized"}}})
    with pytest.raises(ValueError, match="static per-tensor input_scale"):
        ct.get_moe_method(None, prefix, names)
    partly = CompressedTensorsConfig.from_config({"quant_method": "compressed-tensors", "ignore": [names[0]],
                                                  "config_groups": {"g": {"targets": ["Linear"], "weights": w,
                                                                          "format": "float-quantized"}}})
    with pytest.raises(ValueError, match=r"quantizes only some of the parts.*up_proj and 1 more but not the others"):
        partly.get_moe_method(None, prefix, names)  # 5 of 6 quantized: 4 named (an MoE layer has hundreds)
