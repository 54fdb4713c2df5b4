"""A checkpoint the engine cannot honour is refused at load, naming what it cannot honour
(issue 26): before, a compressed-tensors FP8 checkpoint loaded its FP8 weights without
their scales and generated garbage."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pyengine.config import EngineArgs


def _copy_with(src: Path, dst: Path, quantization_config: dict | None = None, tensors: dict | None = None) -> Path:
    """A copy of the model dir ``src`` with ``quantization_config`` in config.json and
    ``tensors`` (name -> tensor) replacing/adding checkpoint tensors."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if quantization_config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["quantization_config"] = quantization_config
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensors:
        sd = load_file(str(dst / "model.safetensors"))
        sd.update(tensors)
        save_file(sd, str(dst / "model.safetensors"))
    return dst


def test_unknown_quant_method_refused_naming_it(llama_dir, tmp_path):
    d = _copy_with(Path(llama_dir), tmp_path / "m", {"quant_method": "bitsandbytes", "load_in_4bit": True})
    with pytest.raises(ValueError, match="'bitsandbytes'"):
        EngineArgs(model=str(d), device="cpu").create_engine_config()


def test_fp8_weights_without_config_refused(llama_dir, tmp_path):
    """FP8 weights and their scales with no quantization_config: refused, naming the tensor."""
    from safetensors import safe_open

    with safe_open(str(Path(llama_dir) / "model.safetensors"), "pt") as fh:
        w = fh.get_tensor("model.layers.0.self_attn.q_proj.weight")
    scale = w.abs().amax(1, keepdim=True) / 448.0
    d = _copy_with(Path(llama_dir), tmp_path / "m", tensors={
        "model.layers.0.self_attn.q_proj.weight": (w / scale).to(torch.float8_e4m3fn),
        "model.layers.0.self_attn.q_proj.weight_scale": scale})
    from pyengine.llm import LLM
    with pytest.raises(ValueError, match="q_proj"):
        LLM(model=str(d), device="cpu", num_gpu_blocks_override=16)


def test_unused_scale_refused(llama_dir, tmp_path):
    """A weight_scale no layer takes (its layer is not quantized by the config): refused."""
    d = _copy_with(Path(llama_dir), tmp_path / "m", tensors={
        "model.layers.1.mlp.down_proj.weight_scale": torch.ones(64, 1)})
    from pyengine.config import EngineArgs as EA
    from pyengine.models.loader import load_model
    cfg = EA(model=str(d), device="cpu").create_engine_config()
    with pytest.raises(ValueError, match="down_proj.weight_scale"):
        load_model(cfg, _backend(cfg))


def _backend(cfg):
    from pyengine.attention.backend import get_backend_cls
    from pyengine.models.registry import model_dims

    d = model_dims(cfg.hf_config)
    return get_backend_cls("torch")(d.num_heads, d.num_kv_heads, d.head_dim, d.head_dim ** -0.5, cfg.block_size,
                                    cfg.dtype, cfg.device)
