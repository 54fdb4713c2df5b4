"""EngineArgs -> EngineConfig resolution and validation."""
from __future__ import annotations

import pytest

from pyengine import EngineArgs, SchedulingPolicy
from pyengine.config import DEFAULT_MODEL_DIR


def test_defaults(llama_dir):
    cfg = EngineArgs(model=str(llama_dir), device="cpu").create_engine_config()
    assert cfg.device.type == "cpu" and cfg.attention_backend == "torch" and cfg.enforce_eager
    assert cfg.async_scheduling and cfg.enable_prefix_caching and cfg.enable_chunked_prefill
    assert cfg.scheduling_policy == "fcfs" and cfg.block_size == 16
    assert cfg.scheduling_policy is SchedulingPolicy.FCFS
    assert cfg.max_model_len == 1024  # max_position_embeddings of the tiny model
    assert cfg.long_prefill_token_threshold == 0


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
    ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold"),
    ({"long_prefill_token_threshold": 1.5}, "long_prefill_token_threshold"),
    ({"long_prefill_token_threshold": 8, "enable_chunked_prefill": False}, "needs chunked prefill"),
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


def rope_scaled_copy(src, dst, **rope):
    """The model in ``src`` with ``rope_parameters`` updated by ``rope``, saved to ``dst``."""
    import json
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["rope_parameters"].update(rope)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_max_model_len_past_the_models_length_refused(llama_dir, monkeypatch):
    # Issue 17: --max-model-len 2048 on a model with max_position_embeddings 1024 started,
    # and the first sequence past position 1024 killed the engine.
    monkeypatch.delenv("VENGINE_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    with pytest.raises(ValueError) as ei:
        EngineArgs(model=str(llama_dir), device="cpu", max_model_len=2048).create_engine_config()
    msg = str(ei.value)
    assert "max_model_len=2048" in msg and "max_position_embeddings=1024" in msg
    assert "VENGINE_ALLOW_LONG_MAX_MODEL_LEN=1" in msg
    assert EngineArgs(model=str(llama_dir), device="cpu", max_model_len=1024).create_engine_config().max_model_len == 1024


def test_long_max_model_len_allowed_by_the_override(llama_dir, monkeypatch, caplog):
    monkeypatch.setenv("VENGINE_ALLOW_LONG_MAX_MODEL_LEN", "1")
    cfg = EngineArgs(model=str(llama_dir), device="cpu", max_model_len=2048).create_engine_config()
    assert cfg.max_model_len == 2048
    assert "VENGINE_ALLOW_LONG_MAX_MODEL_LEN" in caplog.text


def test_linear_rope_scaling_extends_the_models_length(llama_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("VENGINE_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    d = rope_scaled_copy(llama_dir, tmp_path / "linear", rope_type="linear", factor=2.0)
    assert EngineArgs(model=str(d), device="cpu").create_engine_config().max_model_len == 2048
    with pytest.raises(ValueError, match="linear RoPE scaling factor 2"):
        EngineArgs(model=str(d), device="cpu", max_model_len=2049).create_engine_config()


def test_generation_config_gives_the_default_sampling_params(llama_dir, llama_greedy_dir, tmp_path):
    # auto: the model's generation_config.json (its max_new_tokens is vLLM's max_tokens)
    auto = EngineArgs(model=str(llama_greedy_dir), device="cpu").create_engine_config()
    assert auto.get_diff_sampling_param() == {"temperature": 0.0, "top_k": 7, "max_tokens": 3}
    # vllm: vLLM's neutral defaults; override_generation_config still applies
    vllm = EngineArgs(model=str(llama_greedy_dir), device="cpu", generation_config="vllm",
                      override_generation_config={"top_p": 0.5}).create_engine_config()
    assert vllm.get_diff_sampling_param() == {"top_p": 0.5}
    # a directory: its generation_config.json, for a model that has none of these
    assert EngineArgs(model=str(llama_dir), device="cpu").create_engine_config().get_diff_sampling_param() == {}
    folder = EngineArgs(model=str(llama_dir), device="cpu",
                        generation_config=str(llama_greedy_dir)).create_engine_config()
    assert folder.get_diff_sampling_param() == {"temperature": 0.0, "top_k": 7, "max_tokens": 3}
    over = EngineArgs(model=str(llama_greedy_dir), device="cpu",
                      override_generation_config={"temperature": 0.7, "max_new_tokens": 9}).create_engine_config()
    assert over.get_diff_sampling_param() == {"temperature": 0.7, "top_k": 7, "max_tokens": 9}


@pytest.mark.parametrize("kwargs, match", [
    ({"generation_config": "/nonexistent/dir"}, "generation_config must be 'auto', 'vllm' or a directory"),
    ({"override_generation_config": {"temperature": -1}}, r"invalid default sampling parameters.*temperature"),
    ({"override_generation_config": [1]}, "override_generation_config must be a dict"),
    ({"max_logprobs": -2}, "max_logprobs must be an integer >= 0, or -1"),
    ({"attention_backend": "flash"}, "Unknown attention_backend 'flash'; valid: torch, triton"),
])
def test_generation_and_logprob_settings_refused(llama_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=str(llama_dir), device="cpu", **kwargs).create_engine_config()


def test_max_logprobs_minus_one_is_the_vocabulary(llama_dir):
    cfg = EngineArgs(model=str(llama_dir), device="cpu", max_logprobs=-1).create_engine_config()
    assert cfg.max_logprobs == cfg.hf_config.vocab_size


def test_served_model_names_first_is_reported(llama_dir):
    cfg = EngineArgs(model=str(llama_dir), device="cpu", served_model_name=["a", "b"]).create_engine_config()
    assert cfg.served_model_name == "a"


def test_value_sets_match_the_literal_types():
    from typing import get_args

    from pyengine.config import DTYPES, ModelDType

    assert list(DTYPES) == list(get_args(ModelDType))
