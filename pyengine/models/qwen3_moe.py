"""Qwen3-MoE (mirrors vllm/model_executor/models/qwen3_moe.py): Qwen3's attention (per-head
q/k RMSNorm) and, in the sparse layers, a softmax top-k router over ``num_experts``
experts of ``moe_intermediate_size`` (``norm_topk_prob``: renormalise the top-k
probabilities); the layers in ``mlp_only_layers``, or off the ``decoder_sparse_step``
rhythm, keep a dense MLP of ``intermediate_size``. Checkpoint names as HF
(``mlp.gate.weight``, ``mlp.experts.<e>.{gate,up,down}_proj.weight``)."""
from __future__ import annotations

import torch
from torch import nn

from pyengine.layers.fused_moe.layer import FusedMoE
from pyengine.layers.linear import ReplicatedLinear
from pyengine.models.llama import GatedMLP
from pyengine.models.moe_base import MoECausalLMMixin, check_moe_config, is_sparse_layer
from pyengine.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeSparseMoeBlock(nn.Module):
    """``gate`` (the router, replicated: [num_experts, hidden]) then ``experts``
    (``FusedMoE``). ``forward(x [T, H]) -> [T, H]``, this rank's partial sum."""

    def __init__(self, hf_config, tp_group=None, enable_expert_parallel: bool = False):
        super().__init__()
        self.gate = ReplicatedLinear(hf_config.hidden_size, hf_config.num_experts)
        self.experts = FusedMoE(hf_config.num_experts, hf_config.num_experts_per_tok, hf_config.hidden_size,
                                hf_config.moe_intermediate_size, renormalize=bool(hf_config.norm_topk_prob),
                                tp_group=tp_group, enable_expert_parallel=enable_expert_parallel,
                                hidden_act=hf_config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))


class Qwen3MoeForCausalLM(MoECausalLMMixin, Qwen3ForCausalLM):
    """``Qwen3MoeForCausalLM(hf_config, attn_backend, tp_group=None,
    enable_expert_parallel=False)``; otherwise the interface of ``LlamaForCausalLM``.
    Raises ValueError for a config variant it cannot honour (see ``moe_base``)."""

    window_reads_layer_types = False  # transformers' Qwen3-MoE applies the window to every layer

    def __init__(self, hf_config, attn_backend, tp_group=None, enable_expert_parallel: bool = False):
        check_moe_config(hf_config)
        self.enable_expert_parallel = enable_expert_parallel  # read by make_mlp during __init__
        super().__init__(hf_config, attn_backend, tp_group)

    def make_mlp(self, hf_config, layer_idx: int, tp_group) -> nn.Module:
        if is_sparse_layer(hf_config, layer_idx):
            return Qwen3MoeSparseMoeBlock(hf_config, tp_group, self.enable_expert_parallel)
        # transformers' Qwen3MoeMLP: no bias whatever mlp_bias says
        return GatedMLP(hf_config.hidden_size, hf_config.intermediate_size, bias=False,
                        hidden_act=hf_config.hidden_act, tp_group=tp_group)
