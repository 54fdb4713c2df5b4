"""Qwen2-MoE (mirrors vllm/model_executor/models/qwen2_moe.py): Qwen2's attention (q/k/v
bias per ``qkv_bias``) and, in the sparse layers, routed experts plus a shared expert (a
dense MLP of ``shared_expert_intermediate_size``) scaled by a sigmoid gate per token:
``experts(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)``, as transformers'
``Qwen2MoeSparseMoeBlock``. Sparse-layer rule, router and checkpoint names as Qwen3-MoE."""
from __future__ import annotations

import torch
from torch import nn

from pyengine.layers.fused_moe.layer import FusedMoE
from pyengine.layers.linear import ReplicatedLinear
from pyengine.models.llama import GatedMLP
from pyengine.models.moe_base import MoECausalLMMixin, check_moe_config, is_sparse_layer
from pyengine.models.qwen2 import Qwen2ForCausalLM


class Qwen2MoeSparseMoeBlock(nn.Module):
    """``gate`` (router, replicated), ``experts`` (``FusedMoE``), ``shared_expert``
    (tensor-parallel GatedMLP) and ``shared_expert_gate`` (replicated [1, hidden]).
    ``forward(x [T, H]) -> [T, H]``, this rank's partial sum (the sigmoid gate is the same
    on every rank, so it scales the shared expert's partial sums exactly)."""

    def __init__(self, hf_config, tp_group=None, enable_expert_parallel: bool = False):
        super().__init__()
        h = hf_config.hidden_size
        self.gate = ReplicatedLinear(h, hf_config.num_experts)
        self.experts = FusedMoE(hf_config.num_experts, hf_config.num_experts_per_tok, h,
                                hf_config.moe_intermediate_size, renormalize=bool(hf_config.norm_topk_prob),
                                tp_group=tp_group, enable_expert_parallel=enable_expert_parallel,
                                hidden_act=hf_config.hidden_act)
        self.shared_expert = GatedMLP(h, hf_config.shared_expert_intermediate_size, bias=False,
                                      hidden_act=hf_config.hidden_act, tp_group=tp_group)
        self.shared_expert_gate = ReplicatedLinear(h, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.experts(x, self.gate(x)) + shared


class Qwen2MoeForCausalLM(MoECausalLMMixin, Qwen2ForCausalLM):
    """``Qwen2MoeForCausalLM(hf_config, attn_backend, tp_group=None,
    enable_expert_parallel=False)``; otherwise the interface of ``LlamaForCausalLM``."""

    def __init__(self, hf_config, attn_backend, tp_group=None, enable_expert_parallel: bool = False):
        check_moe_config(hf_config)
        self.enable_expert_parallel = enable_expert_parallel  # read by make_mlp during __init__
        super().__init__(hf_config, attn_backend, tp_group)

    def qkv_bias(self, hf_config) -> bool:
        return bool(getattr(hf_config, "qkv_bias", True))

    def make_mlp(self, hf_config, layer_idx: int, tp_group) -> nn.Module:
        if is_sparse_layer(hf_config, layer_idx):
            return Qwen2MoeSparseMoeBlock(hf_config, tp_group, self.enable_expert_parallel)
        return GatedMLP(hf_config.hidden_size, hf_config.intermediate_size, bias=False,
                        hidden_act=hf_config.hidden_act, tp_group=tp_group)
