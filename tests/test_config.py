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
])
def test_rejections(llama_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=str(llama_dir), device="cpu", **kwargs).create_engine_config()
