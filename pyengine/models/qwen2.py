"""Qwen2 (mirrors vllm/model_executor/models/qwen2.py): Llama layout with bias on q/k/v
(always) and none on o_proj. Sliding-window layers are not implemented: a window shorter than
``max_model_len`` is refused at load."""
from __future__ import annotations

from pyengine.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    applies_sliding_window = True  # a window shorter than max_model_len is refused (verify_engine_config)

    def qkv_bias(self, hf_config) -> bool:
        return True

    def o_bias(self, hf_config) -> bool:
        return False
