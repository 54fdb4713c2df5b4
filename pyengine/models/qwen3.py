"""Qwen3 (mirrors vllm/model_executor/models/qwen3.py): Llama layout plus per-head RMSNorm
of q and k (``self_attn.q_norm`` / ``k_norm``, weight [head_dim]) before RoPE; biases
follow ``attention_bias`` (default off)."""
from __future__ import annotations

from pyengine.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
    applies_sliding_window = True
