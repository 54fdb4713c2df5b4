"""EngineArgs -> EngineConfig resolution and validation."""
from __future__ import annotations

import pytest

from pyengine import EngineArgs
from pyengine.config import DEFAULT_MODEL_DIR


def test_defaults(llama_dir):
    cfg = EngineArgs(model=str(llama_dir), device="cpu").create_engine_config()
    assert cfg.device.type == "cpu" and cfg.attention_backend == "torch" and cfg.enforce_eager
    assert cfg.async_scheduling and cfg.enable_prefix_caching and cfg.enable_chunked_prefill
    assert cfg.scheduling_policy == "fcfs" and cfg.block_size == 16
    assert cfg.max_model_len == 1024  # max_position_embeddings of the tiny model


def test_default_model_when_none():
    cfg = EngineArgs(device="cpu").create_engine_config()
    assert cfg.model == str(DEFAULT_MODEL_DIR)


def test_async_env_rollback(llama_dir, monkeypatch):
    monkeypatch.setenv("VENGINE_ASYNC_SCHED", "0")
    assert not EngineArgs(model=str(llama_dir), device="cpu", async_scheduling=True).create_engine_config().async_scheduling


@pytest.mark.parametrize("kwargs, match", [
    ({"load_format": "pt"}, "load_format"),
    ({"gpu_memory_utilization": 0}, "gpu_memory_utilization"),
    ({"block_size": 0}, "block_size"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
    ({"enable_chunked_prefill": False, "max_num_batched_tokens": 16}, "chunked prefill"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be a positive integer"),
    ({"tensor_parallel_size": 3}, r"num_attention_heads \(4\) must be divisible by tensor_parallel_size \(3\)"),
])
def test_rejections(llama_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=str(llama_dir), device="cpu", **kwargs).create_engine_config()


def test_tensor_parallel_size(llama_dir):
    cfg = EngineArgs(model=str(llama_dir), device="cpu", tensor_parallel_size=2).create_engine_config()
    assert cfg.tensor_parallel_size == 2
    assert EngineArgs(model=str(llama_dir), device="cpu").create_engine_config().tensor_parallel_size == 1


@pytest.mark.parametrize("heads, kv, inter, tp, match", [
    (12, 8, 96, 3, r"num_key_value_heads \(8\)"),
    (12, 4, 98, 4, r"intermediate_size \(98\)"),
    (12, 4, 96, 12, None),  # 4 KV heads over 12 ranks: each replicated on 3
])
def test_tensor_parallel_split_rules(heads, kv, inter, tp, match):
    from types import SimpleNamespace

    import torch

    from pyengine.config import _check_tensor_parallel
    cfg = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=inter)
    if match is None:
        _check_tensor_parallel(tp, cfg, torch.device("cpu"))
    else:
        with pytest.raises(ValueError, match=match):
            _check_tensor_parallel(tp, cfg, torch.device("cpu"))
