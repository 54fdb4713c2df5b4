"""pyengine/models/loader.py: a model is built on the meta device and allocated once in its
final form (``materialize``), so a quantized checkpoint's load never holds the float model."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from pyengine.layers.fused_moe.layer import FusedMoE
from pyengine.layers.rotary import RotaryEmbedding
from pyengine.models.loader import materialize

ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def test_materialize_keeps_parameter_attributes_and_sharing():
    """``nn.Module.to_empty`` would drop the loaders' attributes and untie a shared weight."""
    with torch.device("meta"):
        model = nn.ModuleDict({"a": nn.Linear(4, 6, bias=False), "b": nn.Linear(4, 6, bias=False)})
    model["b"].weight = model["a"].weight  # tied, as a tied LM head
    model["a"].weight.output_dim = 0
    materialize(model, "cpu")
    w = model["a"].weight
    assert w.device.type == "cpu" and w.shape == (6, 4) and isinstance(w, nn.Parameter)
    assert w.output_dim == 0
    assert model["b"].weight is w


def test_materialize_computes_the_buffers():
    """Rotary caches and expert maps built on the meta device hold what a build on the
    device computes."""
    group = SimpleNamespace(world_size=2, rank=1)  # expert parallelism: this rank holds experts 4..7
    built = {}
    for where in ("meta", "cpu"):
        with torch.device(where):
            built[where] = (RotaryEmbedding(16, 64, ROPE, dtype=torch.float32),
                            FusedMoE(8, 2, 32, 16, True, tp_group=group, enable_expert_parallel=True))
    for m in built["meta"]:
        materialize(m, "cpu")
    rope, moe = built["meta"]
    assert torch.equal(rope.cos_sin_cache, built["cpu"][0].cos_sin_cache)
    assert moe.expert_map.tolist() == [-1] * 4 + [0, 1, 2, 3] == built["cpu"][1].expert_map.tolist()


class _Buffered(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.arange(4))


class _Attribute(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.arange(4)


@pytest.mark.parametrize("cls,what", [(_Buffered, "no init_buffers"), (_Attribute, "nothing computes")])
def test_materialize_refuses_a_meta_tensor_it_cannot_compute(cls, what):
    with torch.device("meta"):
        m = cls()
    with pytest.raises(RuntimeError, match=what):
        materialize(m, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("quant", ["gptq", "fp8"])
def test_quantized_load_peak_memory_below_the_float_model(family, quant, tokenizer_dir, tmp_path):
    """Loading a GPTQ 4-bit checkpoint, or a float32 one quantized to FP8 at load, peaks
    on the GPU well below the float32 model (it was the whole float model and more: built
    first, then replaced by the quantized layers; on-the-fly FP8 held every float weight
    until the last was loaded). What stays above the quantized size is one layer's
    processing at a time (measured on an H100 at 6 layers: 0.52-0.64 of the float model;
    12 layers halve that share)."""
    from pyengine.attention.backend import get_backend_cls
    from pyengine.config import EngineArgs
    from pyengine.models.loader import load_model
    from pyengine.models.registry import model_dims
    from tests.helpers import build_tiny_model
    from tests.quant_helpers import gptq_checkpoint

    wide = dict(hidden_size=256, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                num_hidden_layers=12)
    if family == "qwen3_moe":
        wide.update(moe_intermediate_size=256, num_experts=16)
    src = build_tiny_model(tmp_path / "src", family, tokenizer_dir, seed=5, **wide)
    if quant == "gptq":
        model_dir, kw = gptq_checkpoint(src, tmp_path / "q", tmp_path / "plain", bits=4, group_size=32)[0], {}
    else:
        model_dir, kw = src, {"quantization": "fp8"}
    cfg = EngineArgs(model=str(model_dir), device="cuda", dtype="float32", max_model_len=256,
                     **kw).create_engine_config()
    dims = model_dims(cfg.hf_config)
    backend = get_backend_cls("torch")(dims.num_heads, dims.num_kv_heads, dims.head_dim, dims.head_dim ** -0.5, 16,
                                       cfg.dtype, cfg.device)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model = load_model(cfg, backend)
    peak = torch.cuda.max_memory_allocated() - base
    float_bytes = sum(p.numel() * 4 for p in load_model(EngineArgs(
        model=str(src), device="cpu", dtype="float32", max_model_len=256).create_engine_config(),
        backend).parameters())
    kept = torch.int32 if quant == "gptq" else torch.float8_e4m3fn  # the kernels' form, not dequantized
    assert any(p.dtype == kept for p in model.parameters())
    assert peak < 0.6 * float_bytes, (peak, float_bytes)


def _load(model_dir, **kw):
    from pyengine.attention.backend import get_backend_cls
    from pyengine.config import EngineArgs
    from pyengine.models.loader import load_model
    from pyengine.models.registry import model_dims

    cfg = EngineArgs(model=str(model_dir), device="cpu", dtype="float32", max_model_len=64, **kw).create_engine_config()
    dims = model_dims(cfg.hf_config)
    backend = get_backend_cls("torch")(dims.num_heads, dims.num_kv_heads, dims.head_dim, dims.head_dim ** -0.5, 16,
                                       cfg.dtype, cfg.device)
    return load_model(cfg, backend)


def test_quantized_layers_finish_as_the_checkpoint_fills_them(llama_dir, tmp_path, monkeypatch):
    """Each on-the-fly FP8 layer is quantized as soon as its tensors are in, before the next
    layer's arrive (the outputs of such loads are held to transformers by the quantization
    tests)."""
    from pyengine.layers.quantization.fp8 import Fp8LinearMethod
    from pyengine.models import loader

    events: list[tuple[str, str]] = []
    real_param = loader.LayerwiseFinish.param
    real_process = Fp8LinearMethod.process_weights_after_loading

    def param(self, name, params):
        events.append(("load", name.rsplit(".", 1)[0]))
        return real_param(self, name, params)

    def process(self, layer):
        events.append(("finish", layer.prefix_for_test))
        return real_process(self, layer)

    monkeypatch.setattr(loader.LayerwiseFinish, "param", param)
    monkeypatch.setattr(Fp8LinearMethod, "process_weights_after_loading", process)
    monkeypatch.setattr(loader, "quantize_linear_layers", _tagging(loader.quantize_linear_layers))
    _load(llama_dir, quantization="fp8")
    finished = [p for kind, p in events if kind == "finish"]
    assert len(finished) == len(set(finished)) > 4  # every linear layer once
    for prefix in finished[:-1]:  # no layer's tensor after its finish: each finished at its last tensor
        at = events.index(("finish", prefix))
        assert ("load", prefix) not in events[at + 1:]
        assert any(kind == "load" for kind, _ in events[at + 1:])  # ...and before the end of the load


def _tagging(quantize):
    def wrapped(model, quant_config):
        quantize(model, quant_config)
        for prefix, m in model.named_modules():
            m.prefix_for_test = prefix
    return wrapped


def test_a_quantized_tensor_given_twice_refused(llama_dir, tmp_path):
    """A layer already processed cannot take its tensor again: refused, naming it."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from tests.quant_helpers import gptq_checkpoint

    q, _ = gptq_checkpoint(llama_dir, tmp_path / "q", tmp_path / "plain", bits=4, group_size=16)
    name = "model.layers.0.self_attn.o_proj.qweight"
    (f,) = sorted(q.glob("*.safetensors"))
    with safe_open(str(f), framework="pt") as fh:
        save_file({name: fh.get_tensor(name)}, str(q / "zz-duplicate.safetensors"))
    with pytest.raises(ValueError, match="o_proj.*twice"):
        _load(q)
