"""Architecture name -> model class (mirrors vllm/model_executor/models/registry.py)."""
from __future__ import annotations

import importlib
from dataclasses import dataclass

from pyengine.config import get_head_dim

# architectures[0] in config.json -> (module under pyengine.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_cls(hf_config) -> type:
    """Model class for ``hf_config.architectures[0]``.

    Raises ValueError (naming the supported architectures) when the config has no
    architectures or an unsupported one.
    """
    archs = getattr(hf_config, "architectures", None) or []
    arch = archs[0] if archs else None
    if arch not in _MODELS:
        raise ValueError(f"Unsupported model architecture {arch!r}; supported: "
                         f"{', '.join(supported_architectures())}.")
    module, name = _MODELS[arch]
    return getattr(importlib.import_module(f"pyengine.models.{module}"), name)


@dataclass(frozen=True)
class ModelDims:
    """Shapes the model runner sizes KV caches and the attention backend with."""
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int


def model_dims(hf_config, tp_size: int = 1) -> ModelDims:
    """head_dim is ``pyengine.config.get_head_dim``; num_kv_heads defaults to num_heads.
    With ``tp_size`` > 1 the head counts are one tensor-parallel rank's: num_heads /
    tp_size, and num_kv_heads / tp_size or 1 when there are fewer KV heads than ranks
    (replicated; see QKVParallelLinear)."""
    num_heads = hf_config.num_attention_heads
    head_dim = get_head_dim(hf_config)
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    return ModelDims(
        num_layers=hf_config.num_hidden_layers,
        num_heads=num_heads // tp_size,
        num_kv_heads=max(1, num_kv_heads // tp_size),
        head_dim=int(head_dim),
        hidden_size=hf_config.hidden_size,
        vocab_size=hf_config.vocab_size,
    )
