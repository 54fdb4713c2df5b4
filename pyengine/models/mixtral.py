"""Mixtral (mirrors vllm/model_executor/models/mixtral.py): Llama/Mistral attention and,
in every layer, a softmax top-k router over ``num_local_experts`` experts of
``intermediate_size``, the top-k probabilities always renormalised. Checkpoint names as
HF: ``block_sparse_moe.gate.weight`` and ``block_sparse_moe.experts.<e>.w1`` (gate),
``w3`` (up), ``w2`` (down), loaded into the layer's ``mlp``. A ``sliding_window`` is
accepted only when ``max_model_len`` fits in it (see ``moe_base``)."""
from __future__ import annotations

import torch
from torch import nn

from pyengine.layers.fused_moe.layer import FusedMoE
from pyengine.layers.linear import ReplicatedLinear
from pyengine.models.llama import LlamaForCausalLM
from pyengine.models.moe_base import MoECausalLMMixin, check_moe_config


class MixtralSparseMoeBlock(nn.Module):
    """``gate`` (the router, replicated: [num_local_experts, hidden]) then ``experts``
    (``FusedMoE``, renormalised top-k, the weights kept float32 as transformers' router
    keeps them). ``forward(x [T, H]) -> [T, H]``, this rank's
    partial sum."""

    def __init__(self, hf_config, tp_group=None, enable_expert_parallel: bool = False):
        super().__init__()
        self.gate = ReplicatedLinear(hf_config.hidden_size, hf_config.num_local_experts)
        self.experts = FusedMoE(hf_config.num_local_experts, hf_config.num_experts_per_tok, hf_config.hidden_size,
                                hf_config.intermediate_size, renormalize=True, tp_group=tp_group,
                                enable_expert_parallel=enable_expert_parallel, hidden_act=hf_config.hidden_act,
                                cast_routing_weights=False)  # transformers' MixtralTopKRouter: float32 weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))


class MixtralForCausalLM(MoECausalLMMixin, LlamaForCausalLM):
    """``MixtralForCausalLM(hf_config, attn_backend, tp_group=None,
    enable_expert_parallel=False)``; otherwise the interface of ``LlamaForCausalLM``."""

    applies_sliding_window, window_reads_layer_types = True, False  # transformers: every layer
    expert_proj_names = {"w1": "w1", "w3": "w3", "w2": "w2"}
    checkpoint_renames = ((".block_sparse_moe.", ".mlp."),)

    def __init__(self, hf_config, attn_backend, tp_group=None, enable_expert_parallel: bool = False):
        check_moe_config(hf_config)
        self.enable_expert_parallel = enable_expert_parallel  # read by make_mlp during __init__
        super().__init__(hf_config, attn_backend, tp_group)

    def make_mlp(self, hf_config, layer_idx: int, tp_group) -> nn.Module:
        return MixtralSparseMoeBlock(hf_config, tp_group, self.enable_expert_parallel)
